//! Streaming trace readers: Mooncake JSONL, ART-Chat-2.5M day files, Azure CSV and the
//! generator's own JSONL.
//!
//! A [`TraceReader`] yields one [`TraceRequest`] at a time, so a consumer (the
//! simulator, the replay client) holds memory bounded by what it keeps, not by the
//! trace's length.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use gorgo_core::calendar::days_from_civil;
use serde::Deserialize;

use crate::record::{BlockIds, TraceRequest};
use crate::{Result, WorkloadError};

/// Mooncake's block size in tokens.
pub const MOONCAKE_TOKENS_PER_BLOCK: u32 = 512;
/// ART-Chat-2.5M's block size in tokens (the generator uses it too).
pub const ART_TOKENS_PER_BLOCK: u32 = 256;
/// Longest trace line accepted: a corrupt file must not make us buffer gigabytes.
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// `text` without a leading UTF-8 byte order mark, which some editors write at the
/// start of a file: a trace is read as if it had none, whatever its format (the Azure
/// CSV reader, csv-core, drops it from the first record the same way).
fn strip_bom(text: &str) -> &str {
    text.strip_prefix('\u{feff}').unwrap_or(text)
}

/// The trace formats this crate reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceFormat {
    /// `{"timestamp", "input_length", "output_length", "hash_ids": [int]}`, 512-token blocks.
    Mooncake,
    /// Mooncake-like rows with hex-string ids over 256-token blocks, `token_hash` (the
    /// user), `request`, `request_id`, `system_prompt_hash`; timestamps are rebased to
    /// the first row.
    ArtChat,
    /// `TIMESTAMP,ContextTokens,GeneratedTokens` with datetime timestamps (rebased to
    /// the first row), no prefix information.
    Azure,
    /// The generator's JSONL: Mooncake-like plus `block_tokens`, `user`, `session`,
    /// `home_region`, `request_id` (see docs/workloads.md).
    Gorgo,
}

impl std::str::FromStr for TraceFormat {
    type Err = WorkloadError;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "mooncake" => Ok(TraceFormat::Mooncake),
            "art" | "art-chat" | "artchat" => Ok(TraceFormat::ArtChat),
            "azure" => Ok(TraceFormat::Azure),
            "gorgo" | "jsonl" => Ok(TraceFormat::Gorgo),
            other => Err(WorkloadError::UnknownFormat(format!(
                "`{other}` (expected mooncake, art, azure or gorgo)"
            ))),
        }
    }
}

/// Guess a trace's format from its path (extension) and its first bytes.
///
/// Content wins over the extension: a JSON object on the first line is one of the JSONL
/// formats, told apart by its keys; a `TIMESTAMP` header is Azure. A leading UTF-8
/// byte order mark is skipped.
pub fn detect_format(path: Option<&Path>, head: &[u8]) -> Result<TraceFormat> {
    let text = String::from_utf8_lossy(head);
    let first = strip_bom(&text)
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty());
    match first {
        Some(line) if line.starts_with('{') => {
            // Tell the JSONL formats apart by the first row's top-level keys (a chat
            // body nested in ART rows must not count).
            let row: serde_json::Map<String, serde_json::Value> = match serde_json::from_str(line) {
                Ok(row) => row,
                // A head cut inside a very long first line (ART rows carry whole chat
                // bodies): fall back to looking for the telling keys in the text.
                Err(_) => return Ok(detect_truncated_row(line)),
            };
            let has = |k: &str| row.contains_key(k);
            if has("block_tokens") || has("user") || has("session") || has("home_region") {
                Ok(TraceFormat::Gorgo)
            } else if has("token_hash")
                || has("system_prompt_hash")
                || row
                    .get("hash_ids")
                    .and_then(|v| v.get(0))
                    .is_some_and(|v| v.is_string())
            {
                Ok(TraceFormat::ArtChat)
            } else {
                Ok(TraceFormat::Mooncake)
            }
        }
        Some(line) if line.to_ascii_uppercase().starts_with("TIMESTAMP") => Ok(TraceFormat::Azure),
        _ => {
            let ext = path
                .and_then(|p| p.extension())
                .and_then(|e| e.to_str())
                .map(str::to_ascii_lowercase);
            match ext.as_deref() {
                Some("csv") => Ok(TraceFormat::Azure),
                Some("jsonl") | Some("json") if first.is_none() => Ok(TraceFormat::Gorgo),
                _ => Err(WorkloadError::UnknownFormat(match path {
                    Some(p) => format!(
                        "{} (neither JSONL rows nor an Azure CSV header)",
                        p.display()
                    ),
                    None => "neither JSONL rows nor an Azure CSV header".to_owned(),
                })),
            }
        }
    }
}

fn detect_truncated_row(head: &str) -> TraceFormat {
    let compact: String = head.split_whitespace().collect();
    if compact.contains("\"block_tokens\":") || compact.contains("\"home_region\":") {
        TraceFormat::Gorgo
    } else if compact.contains("\"token_hash\":") || compact.contains("\"hash_ids\":[\"") {
        TraceFormat::ArtChat
    } else {
        TraceFormat::Mooncake
    }
}

/// Open a trace file and detect its format.
pub fn open_trace(path: &Path) -> Result<TraceReader<BufReader<File>>> {
    let file = File::open(path)?;
    // Large enough that the first row of an ART-Chat file (with its chat body) usually
    // fits whole in the detection window.
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let format = detect_format(Some(path), reader.fill_buf()?)?;
    Ok(TraceReader::new(reader, format))
}

enum Source<R> {
    Lines {
        reader: R,
        buf: String,
    },
    Csv {
        records: csv::Reader<R>,
        columns: Option<[usize; 3]>,
    },
}

/// A streaming iterator of [`TraceRequest`]s over any [`BufRead`].
///
/// Yields `Err` for a malformed line (naming its 1-based number) and keeps going, so a
/// caller may skip bad rows or stop at the first.
pub struct TraceReader<R> {
    source: Source<R>,
    format: TraceFormat,
    line: u64,
    origin_ms: Option<u64>,
}

impl<R: BufRead> TraceReader<R> {
    /// Read `reader` as `format`.
    pub fn new(reader: R, format: TraceFormat) -> Self {
        let source = match format {
            TraceFormat::Azure => Source::Csv {
                records: csv::ReaderBuilder::new()
                    .has_headers(false)
                    .trim(csv::Trim::All)
                    .flexible(true)
                    .from_reader(reader),
                columns: None,
            },
            _ => Source::Lines {
                reader,
                buf: String::new(),
            },
        };
        TraceReader {
            source,
            format,
            line: 0,
            origin_ms: None,
        }
    }

    /// The format being read.
    pub fn format(&self) -> TraceFormat {
        self.format
    }

    /// Timestamps of formats that are rebased (ART-Chat, Azure) are relative to the
    /// first row; this is that row's absolute time in ms, once read.
    pub fn origin_ms(&self) -> Option<u64> {
        self.origin_ms
    }

    /// `absolute_ms` from the origin (the first row's time). A row earlier than the
    /// first is moved to the origin, as documented (docs/workloads.md): a streaming
    /// reader has yielded the rows before it already, rebased to the first, and real
    /// day files (ART-Chat's, Azure's) have rows a little out of order there; failing
    /// the whole trace for one of them was worse (tried 2026-12-07, reverted). Rows
    /// later than the first may be in any order: the selection of a run sorts them
    /// (`select_requests`).
    fn rebase(&mut self, absolute_ms: u64) -> u64 {
        let origin = *self.origin_ms.get_or_insert(absolute_ms);
        absolute_ms.saturating_sub(origin)
    }

    /// `req` as read at the current line, rebased when the format is ([`Self::rebase`])
    /// and checked as every row is ([`check_request`]), or the error naming the line.
    fn finish_row(
        &mut self,
        mut req: TraceRequest,
        absolute_ms: u64,
        user_field: &str,
    ) -> Result<TraceRequest> {
        let line = self.line;
        let parse = |reason| WorkloadError::Parse { line, reason };
        req.timestamp_ms = match self.format {
            TraceFormat::ArtChat | TraceFormat::Azure => self.rebase(absolute_ms),
            TraceFormat::Mooncake | TraceFormat::Gorgo => absolute_ms,
        };
        check_request(&req, user_field).map_err(parse)?;
        Ok(req)
    }

    fn next_line(&mut self) -> Option<Result<TraceRequest>> {
        loop {
            let Source::Lines { reader, buf } = &mut self.source else {
                unreachable!("next_line on a CSV source")
            };
            buf.clear();
            let n =
                match std::io::Read::take(&mut *reader, MAX_LINE_BYTES as u64 + 1).read_line(buf) {
                    Ok(n) => n,
                    Err(e) => {
                        self.line += 1;
                        return Some(Err(if e.kind() == std::io::ErrorKind::InvalidData {
                            WorkloadError::Parse {
                                line: self.line,
                                reason: "not UTF-8".into(),
                            }
                        } else {
                            e.into()
                        }));
                    }
                };
            if n == 0 {
                return None;
            }
            self.line += 1;
            if let Err(reason) = check_line_bytes(n) {
                return Some(Err(WorkloadError::Parse {
                    line: self.line,
                    reason,
                }));
            }
            // Only the file's first line can start with a byte order mark.
            let text = if self.line == 1 {
                strip_bom(buf)
            } else {
                buf.as_str()
            }
            .trim();
            if text.is_empty() {
                continue;
            }
            let parsed = parse_json_row(text, self.format);
            return Some(match parsed {
                Ok((req, absolute_ms, user_field)) => self.finish_row(req, absolute_ms, user_field),
                Err(reason) => Err(WorkloadError::Parse {
                    line: self.line,
                    reason,
                }),
            });
        }
    }

    fn next_csv(&mut self) -> Option<Result<TraceRequest>> {
        loop {
            let Source::Csv { records, columns } = &mut self.source else {
                unreachable!("next_csv on a line source")
            };
            let mut record = csv::StringRecord::new();
            match records.read_record(&mut record) {
                Ok(false) => return None,
                Ok(true) => {}
                Err(e) => {
                    let line = e.position().map(|p| p.line()).unwrap_or(self.line + 1);
                    return Some(Err(WorkloadError::Parse {
                        line,
                        reason: e.to_string(),
                    }));
                }
            }
            let line = record.position().map(|p| p.line()).unwrap_or(self.line + 1);
            self.line = line;
            if record.iter().all(|f| f.is_empty()) {
                continue;
            }
            let cols = match columns {
                Some(c) => *c,
                None => match azure_columns(&record) {
                    Ok(c) => {
                        *columns = Some(c);
                        continue;
                    }
                    Err(reason) => return Some(Err(WorkloadError::Parse { line, reason })),
                },
            };
            let row = parse_azure_row(&record, cols);
            return Some(match row {
                Ok((absolute_ms, input, output)) => self.finish_row(
                    TraceRequest {
                        timestamp_ms: 0,
                        input_tokens: input,
                        output_tokens: output,
                        blocks: BlockIds::None,
                        tokens_per_block: ART_TOKENS_PER_BLOCK,
                        user: None,
                        session: None,
                        home_region: None,
                        request_id: None,
                        system_prompt_hash: None,
                    },
                    absolute_ms,
                    "user",
                ),
                Err(reason) => Err(WorkloadError::Parse { line, reason }),
            });
        }
    }
}

impl<R: BufRead> Iterator for TraceReader<R> {
    type Item = Result<TraceRequest>;

    fn next(&mut self) -> Option<Self::Item> {
        match self.source {
            Source::Lines { .. } => self.next_line(),
            Source::Csv { .. } => self.next_csv(),
        }
    }
}

/// An id that traces spell as a string or a number; kept as a string.
#[derive(Deserialize)]
#[serde(untagged)]
enum StringOrInt {
    Str(String),
    Int(u64),
}

impl From<StringOrInt> for String {
    fn from(v: StringOrInt) -> String {
        match v {
            StringOrInt::Str(s) => s,
            StringOrInt::Int(i) => i.to_string(),
        }
    }
}

/// Only `max_tokens` of an ART-Chat `request` body matters here; serde skips the rest.
#[derive(Deserialize)]
struct ChatRequestLimits {
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct JsonRow {
    timestamp: f64,
    input_length: u64,
    output_length: Option<u64>,
    #[serde(default)]
    hash_ids: BlockIds,
    block_tokens: Option<u32>,
    user: Option<StringOrInt>,
    token_hash: Option<StringOrInt>,
    session: Option<StringOrInt>,
    home_region: Option<String>,
    request_id: Option<StringOrInt>,
    system_prompt_hash: Option<String>,
    request: Option<ChatRequestLimits>,
}

/// Largest prompt a trace row may have, tokens: far above any engine's context (the
/// largest are 10M), and small enough that synthesising its text (4 bytes a token)
/// cannot exhaust memory.
pub const MAX_INPUT_TOKENS: u64 = 16 << 20;

/// Largest timestamp a trace row may have, ms (about 285 years): beyond it the value
/// cannot be a trace's, and would saturate to nonsense arrival times.
const MAX_TIMESTAMP_MS: f64 = 9.0e12;

/// An input length within [`MAX_INPUT_TOKENS`].
fn check_input_length(tokens: u64) -> std::result::Result<(), String> {
    if tokens > MAX_INPUT_TOKENS {
        return Err(format!(
            "input_length {tokens} is over the {MAX_INPUT_TOKENS} tokens a trace row may have"
        ));
    }
    Ok(())
}

/// A timestamp, ms from the trace's origin, in `[0, MAX_TIMESTAMP_MS]`: checked on
/// the number a JSON row spells (before it is rounded to whole ms) and on every row a
/// reader yields or a writer writes ([`check_request`]).
fn check_timestamp(ms: f64) -> std::result::Result<(), String> {
    if !(ms.is_finite() && (0.0..=MAX_TIMESTAMP_MS).contains(&ms)) {
        return Err(format!(
            "timestamp {ms} is not a number of ms in [0, {MAX_TIMESTAMP_MS}] from the \
             trace's origin"
        ));
    }
    Ok(())
}

/// A line of `bytes` (its newline included) within [`MAX_LINE_BYTES`]: what the JSONL
/// readers take, and so what [`crate::JsonlWriter`] may write. The message leaves the
/// length to the caller: a reader stops counting one byte past the limit.
pub(crate) fn check_line_bytes(bytes: usize) -> std::result::Result<(), String> {
    if bytes > MAX_LINE_BYTES {
        return Err(format!(
            "line longer than the {MAX_LINE_BYTES} bytes a trace line may have"
        ));
    }
    Ok(())
}

/// Why `req` is no row a trace may hold, naming the field: the one check of the values
/// every reader yields (whatever the format spelt) and [`crate::JsonlWriter`] writes,
/// so that whatever `gorgo trace convert` or `generate` writes reads back. `user_field`
/// names the field `req.user` came from (`user`; ART-Chat's `token_hash`).
pub(crate) fn check_request(
    req: &TraceRequest,
    user_field: &str,
) -> std::result::Result<(), String> {
    check_timestamp(req.timestamp_ms as f64)?;
    check_input_length(req.input_tokens)?;
    if req.tokens_per_block == 0 || u64::from(req.tokens_per_block) > MAX_INPUT_TOKENS {
        return Err(format!(
            "block_tokens {} is not in [1, {MAX_INPUT_TOKENS}]",
            req.tokens_per_block
        ));
    }
    check_header_id(user_field, req.user.as_deref())?;
    check_header_id("session", req.session.as_deref())
}

/// An id of field `field` that a live replay sends as the
/// [`SESSION_HEADER`](gorgo_core::headers::SESSION_HEADER) value (`user`, `session`):
/// an error for an ASCII control character, which no HTTP header value can carry (it
/// failed at send time, naming neither the row nor the field).
fn check_header_id(field: &str, id: Option<&str>) -> std::result::Result<(), String> {
    match id.and_then(|s| s.chars().find(char::is_ascii_control)) {
        Some(c) => Err(format!(
            "`{field}` holds control character U+{:04X}, which its {} header cannot carry",
            u32::from(c),
            gorgo_core::headers::SESSION_HEADER
        )),
        None => Ok(()),
    }
}

/// A JSON row, an error naming the field it is about and the column, not serde's own
/// "at line 1 column N" (the row is always line 1 of its own text; the caller adds the
/// file's line).
fn parse_row_json<T: serde::de::DeserializeOwned>(text: &str) -> std::result::Result<T, String> {
    let mut de = serde_json::Deserializer::from_str(text);
    let row = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        describe_json_error(Some(path).filter(|p| p != "."), &e.into_inner())
    })?;
    de.end().map_err(|e| describe_json_error(None, &e))?;
    Ok(row)
}

/// serde_json's message without its "at line 1 column N", the column first and the
/// field (when known) named.
fn describe_json_error(field: Option<String>, e: &serde_json::Error) -> String {
    let full = e.to_string();
    let position = format!(" at line {} column {}", e.line(), e.column());
    let what = full.strip_suffix(&position).unwrap_or(&full);
    let column = if e.column() > 0 {
        format!("column {}: ", e.column())
    } else {
        String::new()
    };
    match field {
        Some(f) => format!("{column}`{f}`: {what}"),
        None => format!("{column}{what}"),
    }
}

/// A JSON row as a request (its timestamp left at 0), its absolute timestamp in ms and
/// the field its user came from, for [`check_request`] once the reader has rebased it.
fn parse_json_row(
    text: &str,
    format: TraceFormat,
) -> std::result::Result<(TraceRequest, u64, &'static str), String> {
    let row: JsonRow = parse_row_json(text)?;
    // Before it is rounded (and saturated) to whole ms: the message shows the number
    // the row spells.
    check_timestamp(row.timestamp)?;
    let output = row
        .output_length
        .or_else(|| {
            row.request
                .as_ref()
                .and_then(|r| r.max_tokens.or(r.max_completion_tokens))
        })
        .ok_or_else(|| "missing output_length (and no request.max_tokens)".to_owned())?;
    let output_tokens =
        u32::try_from(output).map_err(|_| format!("output_length {output} out of range"))?;
    let default_block = match (&row.hash_ids, format) {
        (BlockIds::Hex(_), _) | (_, TraceFormat::ArtChat) | (_, TraceFormat::Gorgo) => {
            ART_TOKENS_PER_BLOCK
        }
        _ => MOONCAKE_TOKENS_PER_BLOCK,
    };
    let tokens_per_block = row.block_tokens.unwrap_or(default_block);
    let user_field = if row.user.is_some() {
        "user"
    } else {
        "token_hash"
    };
    let user = row.user.or(row.token_hash).map(String::from);
    let session = row.session.map(String::from);
    let req = TraceRequest {
        timestamp_ms: 0,
        input_tokens: row.input_length,
        output_tokens,
        blocks: row.hash_ids,
        tokens_per_block,
        user,
        session,
        home_region: row.home_region,
        request_id: row.request_id.map(String::from),
        system_prompt_hash: row.system_prompt_hash,
    };
    Ok((req, row.timestamp.round() as u64, user_field))
}

fn azure_columns(header: &csv::StringRecord) -> std::result::Result<[usize; 3], String> {
    let find = |name: &str| {
        header
            .iter()
            .position(|h| h.eq_ignore_ascii_case(name))
            .ok_or_else(|| format!("Azure CSV header lacks column `{name}`"))
    };
    Ok([
        find("TIMESTAMP")?,
        find("ContextTokens")?,
        find("GeneratedTokens")?,
    ])
}

fn parse_azure_row(
    record: &csv::StringRecord,
    [ts, ctx, gen]: [usize; 3],
) -> std::result::Result<(u64, u64, u32), String> {
    let field = |i: usize, name: &str| {
        record
            .get(i)
            .ok_or_else(|| format!("missing column `{name}`"))
    };
    let when = parse_datetime_ms(field(ts, "TIMESTAMP")?)?;
    let input = field(ctx, "ContextTokens")?
        .parse::<u64>()
        .map_err(|e| format!("ContextTokens: {e}"))?;
    check_input_length(input).map_err(|e| format!("ContextTokens: {e}"))?;
    let output = field(gen, "GeneratedTokens")?
        .parse::<u32>()
        .map_err(|e| format!("GeneratedTokens: {e}"))?;
    Ok((when, input, output))
}

/// Parse `YYYY-MM-DD HH:MM:SS[.fraction]` (also with `T`; a trailing `Z` or a UTC
/// offset `±HH:MM`, as Azure's 2024 traces write `+00:00`) into ms since the Unix
/// epoch, UTC.
pub fn parse_datetime_ms(s: &str) -> std::result::Result<u64, String> {
    let bad = || format!("timestamp `{s}` is not `YYYY-MM-DD HH:MM:SS[.fff][Z|±HH:MM]`");
    let s = s.trim().trim_end_matches('Z');
    // A UTC offset after the time: `+HH:MM` or `-HH:MM` (after the date's own dashes).
    let (s, offset_ms) = match s.get(s.len().saturating_sub(6)..) {
        Some(tail)
            if s.len() > 16
                && (tail.starts_with('+') || tail.starts_with('-'))
                && tail.as_bytes()[3] == b':'
                && tail[1..3]
                    .bytes()
                    .chain(tail[4..6].bytes())
                    .all(|b| b.is_ascii_digit()) =>
        {
            let hours: i64 = tail[1..3].parse().map_err(|_| bad())?;
            let minutes: i64 = tail[4..6].parse().map_err(|_| bad())?;
            if hours > 23 || minutes > 59 {
                return Err(bad());
            }
            let sign = if tail.starts_with('-') { -1 } else { 1 };
            (&s[..s.len() - 6], sign * (hours * 60 + minutes) * 60_000)
        }
        _ => (s, 0),
    };
    let (date, time) = s.split_once([' ', 'T']).ok_or_else(bad)?;
    let mut d = date.splitn(3, '-');
    let (y, m, day) = (d.next(), d.next(), d.next());
    let num = |v: Option<&str>| v.and_then(|x| x.parse::<i64>().ok()).ok_or_else(bad);
    let (y, m, day) = (num(y)?, num(m)?, num(day)?);
    let (hms, frac) = time.split_once('.').unwrap_or((time, ""));
    let mut t = hms.splitn(3, ':');
    let (hh, mm, ss) = (num(t.next())?, num(t.next())?, num(t.next())?);
    // Years outside 1970-9999 are no trace's (and far ones would overflow the sums).
    if !(1970..=9999).contains(&y)
        || !(1..=12).contains(&m)
        || !(1..=gorgo_core::calendar::days_in_month(y, m)).contains(&day)
        || hh > 23
        || mm > 59
        || ss > 60
    {
        return Err(bad());
    }
    if !frac.chars().all(|c| c.is_ascii_digit()) {
        return Err(bad());
    }
    // Milliseconds from the first three fraction digits, padded.
    let ms_frac = frac
        .chars()
        .chain("000".chars())
        .take(3)
        .collect::<String>();
    let ms_frac: i64 = ms_frac.parse().map_err(|_| bad())?;
    let days = days_from_civil(y, m, day);
    // Local time minus its offset is UTC.
    let ms = ((days * 24 + hh) * 60 + mm) * 60_000 + ss * 1000 + ms_frac - offset_ms;
    u64::try_from(ms).map_err(|_| format!("timestamp `{s}` is before 1970"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A JSON row parsed and checked as a reader does (not rebased), or the reason.
    fn checked_row(text: &str, format: TraceFormat) -> std::result::Result<(), String> {
        let (req, absolute_ms, user_field) = parse_json_row(text, format)?;
        let req = TraceRequest {
            timestamp_ms: absolute_ms,
            ..req
        };
        check_request(&req, user_field)
    }

    #[test]
    fn out_of_range_values_are_errors_naming_the_field() {
        let row = |r: &str| checked_row(r, TraceFormat::Mooncake);
        let e = row(r#"{"timestamp":0,"input_length":1000000000000,"output_length":1}"#);
        assert!(e.unwrap_err().contains("input_length"));
        let e = row(r#"{"timestamp":1e300,"input_length":10,"output_length":1}"#);
        assert!(e.unwrap_err().contains("timestamp"));
        let e =
            row(r#"{"timestamp":0,"input_length":10,"output_length":1,"block_tokens":4294967295}"#);
        assert!(e.unwrap_err().contains("block_tokens"));
        assert!(row(r#"{"timestamp":5,"input_length":10,"output_length":1}"#).is_ok());
        // A wrong type names its field and the column, not serde's "line 1" (the
        // caller prefixes the file's line).
        let e = row(r#"{"timestamp":0,"input_length":"ten","output_length":1}"#).unwrap_err();
        assert!(e.contains("`input_length`") && e.contains("column"), "{e}");
        assert!(!e.contains("line 1"), "{e}");
        // A bad id says what the ids must be, not the name of the type behind them
        // ("untagged enum BlockIds").
        for ids in ["[1,\"a\"]", "[18446744073709551616]", "[-1]", "[1.5]", "{}"] {
            let e = row(&format!(
                r#"{{"timestamp":0,"input_length":10,"output_length":1,"hash_ids":{ids}}}"#
            ))
            .unwrap_err();
            assert!(
                e.contains("`hash_ids`") && e.contains("all integers") && !e.contains("BlockIds"),
                "{ids}: {e}"
            );
        }
        let e = row(r#"{"timestamp":0,"input_length":10,"output_length":1} x"#).unwrap_err();
        assert!(
            e.contains("trailing characters") && !e.contains("line 1"),
            "{e}"
        );
        assert!(parse_datetime_ms("300000000-01-01 00:00:00").is_err());
        assert!(parse_datetime_ms("9999-12-31 23:59:59").is_ok());
        // A day the month does not have is an error, not a day of the next month.
        assert!(parse_datetime_ms("2023-02-30 12:00:00").is_err());
        assert!(parse_datetime_ms("2023-04-31 00:00:00").is_err());
        assert!(parse_datetime_ms("2024-02-29 00:00:00").is_ok());
    }

    /// A UTF-8 byte order mark before the first row (as some editors write) is
    /// skipped in JSONL as in an Azure CSV: the JSONL was an "unknown trace format",
    /// or "line 1: column 1: expected value" with its format given.
    #[test]
    fn a_leading_byte_order_mark_is_skipped() {
        let moon =
            "{\"timestamp\": 0, \"input_length\": 100, \"output_length\": 10, \"hash_ids\": [0]}\n";
        let bom = format!("\u{feff}{moon}");
        assert_eq!(
            detect_format(None, bom.as_bytes()).unwrap(),
            TraceFormat::Mooncake
        );
        let read = |text: &str, format| {
            TraceReader::new(std::io::Cursor::new(text.as_bytes().to_vec()), format)
                .collect::<Vec<_>>()
        };
        let rows = read(&bom, TraceFormat::Mooncake);
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].as_ref().unwrap().input_tokens, 100);
        // Detected from its header, not only from a `.csv` name.
        let csv =
            "\u{feff}TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:15:46.68,100,10\r\n";
        assert_eq!(
            detect_format(None, csv.as_bytes()).unwrap(),
            TraceFormat::Azure
        );
        let rows = read(csv, TraceFormat::Azure);
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].as_ref().unwrap().input_tokens, 100);
        // One past the start of the file is no byte order mark: an error naming its line.
        let rows = read(&format!("{moon}{bom}"), TraceFormat::Mooncake);
        assert!(
            matches!(rows[1], Err(WorkloadError::Parse { line: 2, .. })),
            "{rows:?}"
        );
    }

    /// `user` and `session` (ART-Chat: `token_hash`) become a live replay's
    /// `x-session-id` header: a control character there is an error naming the line
    /// and the field when the trace is read, not a "builder error" when it is sent.
    #[test]
    fn ids_sent_as_a_header_refuse_control_characters() {
        let row = checked_row;
        let e = row(
            r#"{"timestamp":0,"input_length":10,"output_length":1,"user":"\u0000\n"}"#,
            TraceFormat::Gorgo,
        )
        .unwrap_err();
        assert!(
            e.contains("`user`") && e.contains("U+0000") && e.contains("x-session-id"),
            "{e}"
        );
        let e = row(
            r#"{"timestamp":0,"input_length":10,"output_length":1,"user":"u","session":"s\u007f"}"#,
            TraceFormat::Gorgo,
        )
        .unwrap_err();
        assert!(e.contains("`session`") && e.contains("U+007F"), "{e}");
        let e = row(
            r#"{"timestamp":0,"input_length":10,"hash_ids":["ab"],"token_hash":"a\tb","request":{"max_tokens":5}}"#,
            TraceFormat::ArtChat,
        )
        .unwrap_err();
        assert!(e.contains("`token_hash`"), "{e}");
        // Any other text, and numbers, are fine.
        row(
            r#"{"timestamp":0,"input_length":10,"output_length":1,"user":"Zoë 1","session":7}"#,
            TraceFormat::Gorgo,
        )
        .unwrap();
        let text = "{\"timestamp\":0,\"input_length\":10,\"output_length\":1,\"user\":\"u\"}\n\
                    {\"timestamp\":1,\"input_length\":10,\"output_length\":1,\"user\":\"\\u001b\"}\n";
        let rows: Vec<_> =
            TraceReader::new(std::io::Cursor::new(text.as_bytes()), TraceFormat::Gorgo).collect();
        match &rows[1] {
            Err(e @ WorkloadError::Parse { line: 2, .. }) => {
                assert!(e.to_string().contains("`user`"), "{e}")
            }
            other => panic!("{other:?}"),
        }
    }

    /// ART-Chat and Azure times are rebased to the first row: a row earlier than it is
    /// an error naming its line (it was moved to 0 without a word, ahead of the rows
    /// before it), and so is one too late for any reader (a CSV row dated 9999, which
    /// `trace convert` wrote and the reader of its output refused). Rows after the
    /// first may be in any order.
    #[test]
    fn rebased_rows_before_the_first_move_to_it_and_out_of_range_ones_are_errors() {
        let read = |text: &str, format| {
            TraceReader::new(std::io::Cursor::new(text.as_bytes().to_vec()), format)
                .map(|r| r.map(|req| req.timestamp_ms).map_err(|e| e.to_string()))
                .collect::<Vec<_>>()
        };
        let csv = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                   2023-11-16 18:15:46.68,100,10\n\
                   2023-11-16 18:15:40.00,100,10\n\
                   2023-11-16 18:15:48.00,100,10\n\
                   2023-11-16 18:15:47.00,100,10\n\
                   9999-12-31 23:59:59,100,10\n";
        let rows = read(csv, TraceFormat::Azure);
        // A row before the first is moved to it (the origin), as documented.
        assert_eq!(rows[0..4], [Ok(0), Ok(0), Ok(1320), Ok(320)]);
        let e = rows[4].as_ref().unwrap_err();
        assert!(e.starts_with("line 6:") && e.contains("timestamp"), "{e}");
        let art = |t: u64| {
            format!(
                "{{\"timestamp\":{t},\"input_length\":10,\"hash_ids\":[\"ab\"],\"token_hash\":\"u\",\"request\":{{\"max_tokens\":5}}}}\n"
            )
        };
        let rows = read(&(art(1000) + &art(400) + &art(1500)), TraceFormat::ArtChat);
        assert_eq!(rows, [Ok(0), Ok(0), Ok(500)]);
    }

    #[test]
    fn datetimes_parse_to_epoch_ms() {
        assert_eq!(parse_datetime_ms("1970-01-01 00:00:00").unwrap(), 0);
        assert_eq!(
            parse_datetime_ms("1970-01-02 00:00:01.5").unwrap(),
            86_401_500
        );
        // 2023-11-16T18:15:46.680Z
        assert_eq!(
            parse_datetime_ms("2023-11-16 18:15:46.6805900").unwrap(),
            1_700_158_546_680
        );
        assert!(parse_datetime_ms("2023-13-16 18:15:46").is_err());
        assert!(parse_datetime_ms("yesterday").is_err());
        // Azure's 2024 traces write a UTC offset (every row was refused): applied.
        assert_eq!(
            parse_datetime_ms("2024-05-10 00:00:00.009930+00:00").unwrap(),
            1_715_299_200_009
        );
        assert_eq!(
            parse_datetime_ms("2024-05-10T02:30:00+02:30").unwrap(),
            1_715_299_200_000
        );
        assert_eq!(
            parse_datetime_ms("2024-05-09 22:00:00-02:00").unwrap(),
            1_715_299_200_000
        );
        assert!(parse_datetime_ms("2024-05-10 00:00:00+24:00").is_err());
        assert!(parse_datetime_ms("2024-05-10 00:00:00+0a:00").is_err());
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_input_never_panics(text in "(\\PC|\n){0,200}", fmt in 0usize..4) {
            let format = [TraceFormat::Mooncake, TraceFormat::ArtChat, TraceFormat::Azure, TraceFormat::Gorgo][fmt];
            for row in TraceReader::new(std::io::Cursor::new(text.as_bytes()), format).take(1000) {
                if let Err(e) = row {
                    proptest::prop_assert!(!e.to_string().is_empty());
                }
            }
            let _ = detect_format(None, text.as_bytes());
        }
    }

    #[test]
    fn formats_are_detected_from_content() {
        let moon = br#"{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}"#;
        assert_eq!(detect_format(None, moon).unwrap(), TraceFormat::Mooncake);
        let art = br#"{"timestamp": 5, "input_length": 1, "hash_ids": ["ab"], "token_hash": "u"}"#;
        assert_eq!(detect_format(None, art).unwrap(), TraceFormat::ArtChat);
        let gen = br#"{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [1], "block_tokens": 256, "user": "u1"}"#;
        assert_eq!(detect_format(None, gen).unwrap(), TraceFormat::Gorgo);
        assert_eq!(
            detect_format(None, b"TIMESTAMP,ContextTokens,GeneratedTokens\n").unwrap(),
            TraceFormat::Azure
        );
        assert!(detect_format(None, b"hello\n").is_err());
        let cut = br#"{"timestamp": 5, "input_length": 1, "hash_ids": ["ab", "cd"], "request": {"messages": [{"role": "user", "content": "lo"#;
        assert_eq!(detect_format(None, cut).unwrap(), TraceFormat::ArtChat);
    }
}
