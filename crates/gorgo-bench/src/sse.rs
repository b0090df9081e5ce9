//! Incremental parser for OpenAI-style server-sent event streams.
//!
//! Sans-IO: bytes go in as they arrive from the socket, parsed chunk summaries come out,
//! so the client can stamp the first content chunk the moment its bytes land and the
//! parser can be tested without a server.

use serde::Deserialize;

/// Cap on one buffered SSE line: a server that never sends a newline must not make
/// the client buffer without bound.
pub const MAX_LINE_BYTES: usize = 4 << 20;

/// Cap on one event's data (its `data:` lines joined): a server that sends data lines
/// and never the blank line that ends the event must not either.
pub const MAX_EVENT_BYTES: usize = 4 << 20;

/// What one `data:` event carried that matters to the benchmark.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChunkInfo {
    /// The event carried non-empty generated text (a content delta or completion text).
    pub has_content: bool,
    /// `usage.completion_tokens`, when the event carried usage.
    pub completion_tokens: Option<u64>,
    /// `usage.prompt_tokens`, when the event carried usage.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`, when reported.
    pub cached_tokens: Option<u64>,
    /// An `error` object or a `finish_reason` of `error` in the stream.
    pub error: Option<String>,
}

/// One parsed server-sent event.
#[derive(Debug, Clone, PartialEq)]
pub enum SseEvent {
    /// A JSON chunk.
    Chunk(ChunkInfo),
    /// `data: [DONE]`: the stream finished normally.
    Done,
    /// A data payload that is not JSON.
    Malformed(String),
}

/// Accumulates bytes and yields complete events.
#[derive(Debug, Default)]
pub struct SseParser {
    line: Vec<u8>,
    data: String,
    overflowed: bool,
    /// The event being read went over [`MAX_EVENT_BYTES`]: its data is dropped.
    event_overflowed: bool,
    /// The last byte ended a line with `\r`: a `\n` right after it belongs to it.
    after_cr: bool,
}

#[derive(Deserialize)]
struct RawChunk {
    #[serde(default)]
    choices: Vec<RawChoice>,
    #[serde(default)]
    usage: Option<RawUsage>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct RawChoice {
    #[serde(default)]
    delta: Option<RawDelta>,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct RawDelta {
    #[serde(default)]
    content: Option<String>,
}

#[derive(Deserialize)]
struct RawUsage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<RawDetails>,
}

#[derive(Deserialize)]
struct RawDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

impl SseParser {
    /// A parser at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feed bytes; complete events are appended to `out`. Lines end with `\r\n`, `\n`
    /// or `\r`, as the SSE format allows.
    pub fn feed(&mut self, bytes: &[u8], out: &mut Vec<SseEvent>) {
        for &b in bytes {
            let after_cr = std::mem::replace(&mut self.after_cr, b == b'\r');
            if b == b'\n' && after_cr {
                // The second half of a `\r\n`: the line ended at the `\r`.
            } else if b == b'\n' || b == b'\r' {
                let line = std::mem::take(&mut self.line);
                self.on_line(&line, out);
            } else if self.line.len() < MAX_LINE_BYTES {
                self.line.push(b);
            } else if !self.overflowed {
                self.overflowed = true;
                out.push(SseEvent::Malformed(format!(
                    "SSE line over {MAX_LINE_BYTES} bytes"
                )));
            }
        }
    }

    /// The stream ended: flush an event that was not terminated by a blank line.
    pub fn finish(&mut self, out: &mut Vec<SseEvent>) {
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.on_line(&line, out);
        }
        self.dispatch(out);
    }

    fn on_line(&mut self, line: &[u8], out: &mut Vec<SseEvent>) {
        if line.is_empty() {
            self.dispatch(out);
            return;
        }
        if let Some(rest) = line.strip_prefix(b"data:") {
            let rest = rest.strip_prefix(b" ").unwrap_or(rest);
            if self.event_overflowed {
                return;
            }
            if self.data.len() + 1 + rest.len() > MAX_EVENT_BYTES {
                self.event_overflowed = true;
                self.data.clear();
                out.push(SseEvent::Malformed(format!(
                    "SSE event over {MAX_EVENT_BYTES} bytes"
                )));
                return;
            }
            if !self.data.is_empty() {
                self.data.push('\n');
            }
            self.data.push_str(&String::from_utf8_lossy(rest));
        }
        // Comments (`:`), `event:`, `id:` and `retry:` lines carry nothing we measure.
    }

    fn dispatch(&mut self, out: &mut Vec<SseEvent>) {
        self.event_overflowed = false;
        if self.data.is_empty() {
            return;
        }
        let data = std::mem::take(&mut self.data);
        out.push(parse_data(&data));
    }
}

/// Parse one event's data payload.
pub fn parse_data(data: &str) -> SseEvent {
    let trimmed = data.trim();
    if trimmed == "[DONE]" {
        return SseEvent::Done;
    }
    let raw: RawChunk = match serde_json::from_str(trimmed) {
        Ok(raw) => raw,
        Err(e) => {
            let head: String = trimmed.chars().take(120).collect();
            return SseEvent::Malformed(format!("{e}: {head}"));
        }
    };
    let mut info = ChunkInfo::default();
    for choice in &raw.choices {
        let delta_content = choice.delta.as_ref().and_then(|d| d.content.as_deref());
        if delta_content.is_some_and(|c| !c.is_empty())
            || choice.text.as_deref().is_some_and(|t| !t.is_empty())
        {
            info.has_content = true;
        }
        if choice.finish_reason.as_deref() == Some("error") {
            info.error = Some("finish_reason: error".into());
        }
    }
    if let Some(usage) = raw.usage {
        info.prompt_tokens = usage.prompt_tokens;
        info.completion_tokens = usage.completion_tokens;
        info.cached_tokens = usage.prompt_tokens_details.and_then(|d| d.cached_tokens);
    }
    if let Some(err) = raw.error {
        let message = err
            .get("message")
            .and_then(|m| m.as_str())
            .map(str::to_owned)
            .unwrap_or_else(|| err.to_string());
        info.error = Some(message);
    }
    SseEvent::Chunk(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_all(chunks: &[&[u8]]) -> Vec<SseEvent> {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        for c in chunks {
            p.feed(c, &mut out);
        }
        p.finish(&mut out);
        out
    }

    #[test]
    fn content_usage_and_done_across_split_chunks() {
        let stream = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\n\
data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\r\n\r\n\
: keep-alive\n\n\
data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":3,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\n\
data: [DONE]\n\n";
        // Split at every possible point: the result must not depend on it.
        for split in 0..stream.len() {
            let ev = parse_all(&[&stream[..split], &stream[split..]]);
            assert_eq!(ev.len(), 4, "split at {split}");
            assert_eq!(ev[0], SseEvent::Chunk(ChunkInfo::default()));
            assert!(matches!(&ev[1], SseEvent::Chunk(c) if c.has_content));
            match &ev[2] {
                SseEvent::Chunk(c) => {
                    assert_eq!(c.completion_tokens, Some(3));
                    assert_eq!(c.prompt_tokens, Some(10));
                    assert_eq!(c.cached_tokens, Some(4));
                    assert!(!c.has_content);
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(ev[3], SseEvent::Done);
        }
    }

    #[test]
    fn completions_text_and_errors() {
        let ev = parse_all(&[b"data: {\"choices\":[{\"text\":\"x\"}]}\n\ndata: {\"error\":{\"message\":\"boom\"}}\n\ndata: nope\n\n"]);
        assert!(matches!(&ev[0], SseEvent::Chunk(c) if c.has_content));
        assert!(matches!(&ev[1], SseEvent::Chunk(c) if c.error.as_deref() == Some("boom")));
        assert!(matches!(&ev[2], SseEvent::Malformed(_)));
    }

    #[test]
    fn lines_may_end_with_a_lone_carriage_return() {
        let stream = b"data: {\"choices\":[{\"text\":\"x\"}]}\r\rdata: [DONE]\r\r";
        for split in 0..stream.len() {
            let ev = parse_all(&[&stream[..split], &stream[split..]]);
            assert_eq!(ev.len(), 2, "split at {split}: {ev:?}");
            assert!(matches!(&ev[0], SseEvent::Chunk(c) if c.has_content));
            assert_eq!(ev[1], SseEvent::Done);
        }
    }

    #[test]
    fn an_event_that_never_ends_is_dropped_at_the_cap() {
        let line = format!("data: {}\n", "x".repeat(1 << 20));
        let mut p = SseParser::new();
        let mut out = Vec::new();
        for _ in 0..(2 * MAX_EVENT_BYTES / line.len()) {
            p.feed(line.as_bytes(), &mut out);
        }
        assert!(p.data.len() <= MAX_EVENT_BYTES, "{}", p.data.len());
        assert_eq!(out.len(), 1, "one error, not one per line");
        assert!(matches!(&out[0], SseEvent::Malformed(m) if m.contains("event over")));
        // The blank line ends the oversized event; the next one parses.
        p.feed(b"\ndata: [DONE]\n\n", &mut out);
        assert_eq!(out.last(), Some(&SseEvent::Done));
        assert_eq!(out.len(), 2);
    }

    #[test]
    fn empty_content_is_not_content() {
        let ev = parse_all(&[b"data: {\"choices\":[{\"delta\":{\"content\":\"\"}}]}"]);
        assert_eq!(ev, vec![SseEvent::Chunk(ChunkInfo::default())]);
    }
}
