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
use crate::Result;

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
}

impl<W: Write> JsonlWriter<W> {
    /// Write to `out` (wrap files in a `BufWriter`).
    pub fn new(out: W) -> Self {
        JsonlWriter { out }
    }

    /// Append one request.
    pub fn write(&mut self, req: &TraceRequest) -> Result<()> {
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
        serde_json::to_writer(&mut self.out, &row).map_err(std::io::Error::from)?;
        self.out.write_all(b"\n")?;
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
