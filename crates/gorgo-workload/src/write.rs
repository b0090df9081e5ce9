//! Writing traces in the generator's JSONL format (what `gorgo trace convert` and
//! `gorgo trace generate` produce, and [`crate::TraceReader`] reads back).
//!
//! One JSON object per line: Mooncake's `timestamp` (ms), `input_length`,
//! `output_length`, `hash_ids` (ints, or hex strings when the source had them) plus
//! `block_tokens` and, when known, `user`, `session`, `home_region`, `request_id`,
//! `system_prompt_hash`.

use std::io::Write;

use serde::Serialize;

use crate::record::{BlockIds, TraceRequest};
use crate::{Result, WorkloadError};

#[derive(Serialize)]
struct Row<'a> {
    timestamp: u64,
    input_length: u64,
    output_length: u32,
    hash_ids: &'a BlockIds,
    block_tokens: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    user: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    session: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    home_region: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    request_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    system_prompt_hash: Option<&'a str>,
}

/// Writes requests one line at a time, so conversion streams.
pub struct JsonlWriter<W> {
    out: W,
    /// Lines written so far.
    lines: u64,
    /// The line being written, reused: its length is checked before it goes out.
    buf: Vec<u8>,
}

impl<W: Write> JsonlWriter<W> {
    /// Write to `out` (wrap files in a `BufWriter`).
    pub fn new(out: W) -> Self {
        JsonlWriter {
            out,
            lines: 0,
            buf: Vec::new(),
        }
    }

    /// Append one request, or refuse it ([`WorkloadError::Unreadable`], nothing of it
    /// written) when the trace readers would refuse the line: every reader's row check
    /// (`crate::read::check_request`: a timestamp past the readers' range, a control
    /// character in `user`, ...) and the longest line they take. Without it `gorgo
    /// trace convert` and `generate` wrote traces that no command could read back.
    pub fn write(&mut self, req: &TraceRequest) -> Result<()> {
        let line = self.lines + 1;
        let unreadable = |reason: String| WorkloadError::Unreadable {
            line,
            request: req
                .request_id
                .as_deref()
                .map_or(String::new(), |id| format!(" (request {id})")),
            reason,
        };
        crate::read::check_request(req, "user").map_err(unreadable)?;
        // `hash_ids: null` would not read back as Mooncake; write `[]` instead.
        let empty = BlockIds::Int(Vec::new());
        let row = Row {
            timestamp: req.timestamp_ms,
            input_length: req.input_tokens,
            output_length: req.output_tokens,
            hash_ids: if req.blocks == BlockIds::None {
                &empty
            } else {
                &req.blocks
            },
            block_tokens: req.tokens_per_block,
            user: req.user.as_deref(),
            session: req.session.as_deref(),
            home_region: req.home_region.as_deref(),
            request_id: req.request_id.as_deref(),
            system_prompt_hash: req.system_prompt_hash.as_deref(),
        };
        self.buf.clear();
        serde_json::to_writer(&mut self.buf, &row).map_err(std::io::Error::from)?;
        self.buf.push(b'\n');
        crate::read::check_line_bytes(self.buf.len()).map_err(|reason| {
            unreadable(format!(
                "{reason} ({} bytes, {} hash_ids)",
                self.buf.len(),
                req.blocks.len()
            ))
        })?;
        self.out.write_all(&self.buf)?;
        self.lines = line;
        Ok(())
    }

    /// Flush and hand back the writer.
    pub fn finish(mut self) -> Result<W> {
        self.out.flush()?;
        Ok(self.out)
    }
}

/// Write every request of `requests` to `out`; returns how many were written.
pub fn write_jsonl<'a, W: Write>(
    out: W,
    requests: impl IntoIterator<Item = &'a TraceRequest>,
) -> Result<u64> {
    let mut w = JsonlWriter::new(out);
    let mut n = 0;
    for r in requests {
        w.write(r)?;
        n += 1;
    }
    w.finish()?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::read::{TraceFormat, TraceReader, MAX_LINE_BYTES};

    /// What the writer writes of `rows`, or its error.
    fn written(rows: &[TraceRequest]) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        write_jsonl(&mut out, rows)?;
        Ok(out)
    }

    /// Whatever the writer writes reads back; a row the readers would refuse is an
    /// error naming the output line, the request and the field, and nothing of it is
    /// written (`trace convert` of a row dated 9999 and `--spread-ties` at the readers'
    /// last millisecond, `trace generate` of a 2M-block prompt, each wrote a trace no
    /// command could read).
    #[test]
    fn a_row_the_readers_refuse_is_not_written() {
        // With ids: a row of none reads back as an empty list.
        let at = |ms| TraceRequest {
            blocks: BlockIds::Int(vec![3]),
            ..TraceRequest::at_ms(ms)
        };
        let ok = at(5);
        let text = written(&[ok.clone(), ok.clone()]).unwrap();
        let back: Vec<_> = TraceReader::new(&text[..], TraceFormat::Gorgo)
            .collect::<Result<_>>()
            .unwrap();
        assert_eq!(back, [ok.clone(), ok.clone()]);

        let mut late = at(9_000_000_000_001);
        late.request_id = Some("r7".into());
        let mut user = ok.clone();
        user.user = Some("a\nb".into());
        let mut zero_block = ok.clone();
        zero_block.tokens_per_block = 0;
        // One id per token of a prompt of a million tokens: a line of some 17 MB.
        let mut long = ok.clone();
        long.input_tokens = 1 << 20;
        long.tokens_per_block = 1;
        long.blocks = BlockIds::Int(vec![1 << 52; 1 << 20]);
        for (bad, field) in [
            (late, "timestamp"),
            (user, "`user`"),
            (zero_block, "block_tokens"),
            (long, &format!("{MAX_LINE_BYTES} bytes")),
        ] {
            let mut out = Vec::new();
            let mut w = JsonlWriter::new(&mut out);
            w.write(&ok).unwrap();
            let e = w.write(&bad).unwrap_err();
            let msg = e.to_string();
            assert!(
                matches!(e, WorkloadError::Unreadable { line: 2, .. })
                    && msg.contains(field)
                    && msg.contains("output line 2"),
                "{field}: {msg}"
            );
            if bad.request_id.is_some() {
                assert!(msg.contains("(request r7)"), "{msg}");
            }
            // The good row before it is all there is.
            w.finish().unwrap();
            assert_eq!(out, written(std::slice::from_ref(&ok)).unwrap());
        }
        // The readers' last millisecond is written, and reads back.
        let last = at(9_000_000_000_000);
        let text = written(std::slice::from_ref(&last)).unwrap();
        let back = TraceReader::new(&text[..], TraceFormat::Gorgo)
            .next()
            .unwrap()
            .unwrap();
        assert_eq!(back, last);
    }
}
