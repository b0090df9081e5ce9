//! Usage on streamed requests: the node asks its engine for it every time, and the
//! client gets the usage chunk only when it asked. (What else changes for a client
//! that did not ask: OpenAI-style engines, the emulator among them, then add
//! `"usage": null` to every content chunk, which reaches the client; vLLM omits unset
//! fields.)
//!
//! The engine's `usage` corrects the node's prefix index (`cached_tokens`) and teaches
//! its token count (`prompt_tokens`) ([`crate::usage`]). A streamed chat or
//! completions response carries it only when the request says
//! `"stream_options": {"include_usage": true}`, and most clients (the `openai` Python
//! package by default) do not: without this, the node would learn nothing from
//! streamed requests. So the node that serves a streamed request sets
//! `stream_options.include_usage` in the body it sends its engine
//! ([`StreamUsage::engine_body`]), and, when the client had not asked, drops the
//! usage-only event (`choices` empty, `usage` set, just before `data: [DONE]`) from what
//! it relays ([`UsageStripped`]), after the usage scanner has read it.
//!
//! The client's wish is read from the client's own body, which is what a forward
//! carries unchanged: the node that serves the request (the forward's target) asks its
//! engine and strips; the origin relays the target's bytes as they come. A
//! `stream_options` that does not say (`{}`) means what the serving engine's kind
//! defaults to ([`StreamUsage::for_engine`]): yes for vLLM, no for the others.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use futures::Stream;
use gorgo_core::{Endpoint, EngineKind};
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::sse::{event_data, first_event_end, EventFramer};

/// What a request's client asked of the usage of a streamed response, read from its
/// body: it decides whether the node changes the body it sends the engine, and whether
/// it drops the usage event from the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StreamUsage {
    /// Not a streamed request (or a body this does not read): sent and relayed as is.
    #[default]
    NotStreamed,
    /// Streamed, with `stream_options.include_usage: true`: sent and relayed as is,
    /// the usage event included.
    ClientAsked,
    /// Streamed without it: the engine is asked for usage and the client does not get
    /// the usage event.
    ClientDidNotAsk {
        /// The body has a `stream_options` member (its other keys are kept).
        has_stream_options: bool,
    },
    /// Streamed, with `stream_options` an object that does not set `include_usage`:
    /// engines read that differently (vLLM's `StreamOptions.include_usage` defaults to
    /// true, OpenAI's and SGLang's to false), so what the client asked is known only
    /// once the engine is ([`StreamUsage::for_engine`]).
    EngineDefault,
}

/// The body a serving node sends its engine, and what to do with the response.
#[derive(Debug, Clone)]
pub struct EngineRequestBody {
    /// The client's body, with `stream_options.include_usage` set where the node asks
    /// for usage the client did not.
    pub body: Bytes,
    /// The node asked for usage the client did not: the response's usage-only event
    /// is not relayed ([`UsageStripped`]).
    pub strip_usage_event: bool,
}

/// Whether an endpoint's streamed responses carry usage on
/// `stream_options.include_usage`: both routed OpenAI endpoints do (the endpoints the
/// node passes through unrouted never come here).
fn takes_stream_options(endpoint: Endpoint) -> bool {
    match endpoint {
        Endpoint::Chat | Endpoint::Completions => true,
    }
}

/// Whether the client's `stream_options` already speak of usage in a way the node must
/// not second-guess: `include_usage` true, or any value but `false`/`null` (vLLM's lax
/// parsing reads `"true"` or `1` as asking), or `continuous_usage_stats` (vLLM's usage
/// on every chunk). Such a body goes to the engine as it is and its response is
/// relayed whole.
fn client_set_usage(options: &Value) -> bool {
    let include = options.get("include_usage");
    !matches!(include, None | Some(Value::Null) | Some(Value::Bool(false)))
        || options.get("continuous_usage_stats").is_some()
}

/// Whether the client's `stream_options` leave usage to the engine's default: an
/// object without `include_usage` (`null` is a no said outright, as vLLM reads it).
fn leaves_usage_to_engine(options: &Value) -> bool {
    options
        .as_object()
        .is_some_and(|o| !o.contains_key("include_usage"))
}

/// The two members of a body this module reads, borrowed from the body's bytes (a
/// scan that skips the rest without building it).
#[derive(Deserialize)]
struct StreamMembers<'a> {
    #[serde(borrow, default)]
    stream: Option<&'a RawValue>,
    /// Present (`null` included) or not: `null` must be replaced, not added to.
    #[serde(borrow, default, deserialize_with = "present")]
    stream_options: Option<&'a RawValue>,
}

/// A member that is there, even as `null`.
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&'de RawValue>::deserialize(d).map(Some)
}

/// The two members of `body`, when it is a JSON object that has each at most once
/// (serde would also read a struct from an array: that is not a request body).
fn read_members(body: &[u8]) -> Option<StreamMembers<'_>> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace())?;
    if *first != b'{' {
        return None;
    }
    serde_json::from_slice(body).ok()
}

impl StreamUsage {
    /// Whether the response is a stream: only then does the node see the first
    /// token when it comes.
    pub fn is_streamed(self) -> bool {
        self != StreamUsage::NotStreamed
    }

    /// What the client asked, from the body the ingress already parsed (no second
    /// parse on the client's node).
    pub fn of_request(endpoint: Endpoint, body: &Value) -> Self {
        Self::classify(endpoint, body.get("stream"), body.get("stream_options"))
    }

    /// What the client asked, from a body's bytes: for a peer's forward, whose body
    /// this node has not parsed. Only the two members are read; a body that does not
    /// read as an object with them once each is [`StreamUsage::NotStreamed`].
    pub fn of_body(endpoint: Endpoint, body: &[u8]) -> Self {
        let Some(members) = read_members(body) else {
            return StreamUsage::NotStreamed;
        };
        let read = |raw: Option<&RawValue>| raw.and_then(|r| serde_json::from_str(r.get()).ok());
        let stream: Option<Value> = read(members.stream);
        let options: Option<Value> = read(members.stream_options);
        Self::classify(endpoint, stream.as_ref(), options.as_ref())
    }

    /// `stream` and `stream_options` as the body has them (`None`: absent).
    fn classify(endpoint: Endpoint, stream: Option<&Value>, options: Option<&Value>) -> Self {
        if !takes_stream_options(endpoint) || stream != Some(&Value::Bool(true)) {
            return StreamUsage::NotStreamed;
        }
        match options {
            Some(o) if client_set_usage(o) => StreamUsage::ClientAsked,
            Some(o) if leaves_usage_to_engine(o) => StreamUsage::EngineDefault,
            o => StreamUsage::ClientDidNotAsk {
                has_stream_options: o.is_some(),
            },
        }
    }

    /// What the client asked of an engine of `kind`: [`StreamUsage::EngineDefault`]
    /// becomes what that engine reads it as (vLLM: asked; the others, as OpenAI: not);
    /// the rest is what it was.
    pub fn for_engine(self, kind: EngineKind) -> Self {
        match (self, kind) {
            (StreamUsage::EngineDefault, EngineKind::Vllm) => StreamUsage::ClientAsked,
            (StreamUsage::EngineDefault, EngineKind::Sglang | EngineKind::Openai) => {
                StreamUsage::ClientDidNotAsk {
                    has_stream_options: true,
                }
            }
            (other, _) => other,
        }
    }

    /// The body to send an engine of `kind` for a client's `body`. A body the node
    /// cannot change (not an object, `stream_options` neither an object nor `null`, a
    /// member twice) goes as it is, and nothing is stripped from its response.
    pub fn engine_body(self, kind: EngineKind, body: &Bytes) -> EngineRequestBody {
        let asked = match self.for_engine(kind) {
            StreamUsage::ClientDidNotAsk { has_stream_options } => {
                with_include_usage(body, has_stream_options)
            }
            StreamUsage::NotStreamed | StreamUsage::ClientAsked | StreamUsage::EngineDefault => {
                None
            }
        };
        match asked {
            Some(body) => EngineRequestBody {
                body,
                strip_usage_event: true,
            },
            None => EngineRequestBody {
                body: body.clone(),
                strip_usage_event: false,
            },
        }
    }
}

/// `body` with `stream_options.include_usage: true`, the rest byte for byte as it was:
/// without `stream_options`, the member is put first; with it, its value is replaced
/// by the same object plus the key. `None` when that cannot be done.
fn with_include_usage(body: &[u8], has_stream_options: bool) -> Option<Bytes> {
    if !has_stream_options {
        // The object has members (`stream` at least), so a comma follows ours.
        let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
        if body[open] != b'{' {
            return None;
        }
        let member = br#""stream_options":{"include_usage":true},"#;
        let mut out = BytesMut::with_capacity(body.len() + member.len());
        out.extend_from_slice(&body[..=open]);
        out.extend_from_slice(member);
        out.extend_from_slice(&body[open + 1..]);
        return Some(out.freeze());
    }
    let members = read_members(body)?;
    let raw = members.stream_options?.get();
    // The value's place in the body: the scan borrows it from `body`'s bytes.
    let start = (raw.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
    let end = start.checked_add(raw.len()).filter(|&e| e <= body.len())?;
    let mut options = match serde_json::from_str::<Value>(raw).ok()? {
        Value::Object(m) => m,
        Value::Null => Map::new(),
        _ => return None,
    };
    options.insert("include_usage".into(), Value::Bool(true));
    let options = serde_json::to_vec(&options).ok()?;
    let mut out = BytesMut::with_capacity(body.len() + options.len());
    out.extend_from_slice(&body[..start]);
    out.extend_from_slice(&options);
    out.extend_from_slice(&body[end..]);
    Some(out.freeze())
}

/// Drops usage-only events from an engine's event stream as it passes: whole events
/// are cut by the relay's `EventFramer` (each goes out as soon as the blank line
/// that ends it arrives), an event over the framer's cap passes unread, and an event
/// is dropped only when its data is a JSON object with `choices` an empty array and
/// `usage` an object. Usage carried on a content event (non-empty `choices`), as some
/// engines send it, is left as it is: removing it would mean rewriting that event.
#[derive(Debug, Default)]
pub struct UsageEventFilter {
    framer: EventFramer,
}

impl UsageEventFilter {
    /// What of `chunk` goes out now: its whole events, less the usage-only ones.
    pub fn push(&mut self, chunk: Bytes) -> Bytes {
        // Bytes that begin inside an event (the framer let an oversize one through)
        // start with that event's rest, which is not an event of its own.
        let starts_mid_event = self.framer.mid_event();
        let whole = self.framer.push(chunk);
        if !has_empty_choices(&whole) {
            // Every content event has a choice: most chunks pass without a copy.
            return whole;
        }
        let mut kept = BytesMut::with_capacity(whole.len());
        let mut at = 0;
        let mut first = true;
        while let Some(len) = first_event_end(&whole[at..]) {
            let event = &whole[at..at + len];
            if (first && starts_mid_event) || !is_usage_only(event) {
                kept.extend_from_slice(event);
            }
            at += len;
            first = false;
        }
        kept.extend_from_slice(&whole[at..]);
        kept.freeze()
    }

    /// What is held at the end of the stream: an event the engine did not end, which
    /// goes out as it came.
    pub fn finish(&mut self) -> Bytes {
        self.framer.flush()
    }

    /// Drop the unfinished event: the stream failed, and the relay ends it with an
    /// error event of its own.
    pub fn discard(&mut self) {
        self.framer.discard();
    }
}

/// `"choices"`, `:` and `[]` (whitespace allowed between): the mark of a usage-only
/// event, found without parsing. Generated text cannot contain it: JSON escapes the
/// quotes of a string inside a string.
fn has_empty_choices(bytes: &[u8]) -> bool {
    const KEY: &[u8] = b"\"choices\"";
    let mut from = 0;
    while let Some(at) = bytes[from..].windows(KEY.len()).position(|w| w == KEY) {
        let after = from + at + KEY.len();
        let mut rest = bytes[after..]
            .iter()
            .copied()
            .filter(|b| !b.is_ascii_whitespace());
        if rest.next() == Some(b':') && rest.next() == Some(b'[') && rest.next() == Some(b']') {
            return true;
        }
        from = after;
    }
    false
}

/// Whether `event` (one whole event) is a usage-only chunk.
fn is_usage_only(event: &[u8]) -> bool {
    let Some(data) = event_data(event) else {
        return false;
    };
    let Ok(Value::Object(chunk)) = serde_json::from_slice::<Value>(&data) else {
        return false;
    };
    chunk
        .get("choices")
        .and_then(Value::as_array)
        .is_some_and(Vec::is_empty)
        && chunk.get("usage").is_some_and(Value::is_object)
}

/// A response body with its usage-only events dropped ([`UsageEventFilter`]); an
/// error from the upstream drops the unfinished event and passes on.
pub struct UsageStripped<S> {
    inner: S,
    filter: UsageEventFilter,
    ended: bool,
}

impl<S> UsageStripped<S> {
    /// Wrap `inner`, an engine's event-stream body.
    pub fn new(inner: S) -> Self {
        UsageStripped {
            inner,
            filter: UsageEventFilter::default(),
            ended: false,
        }
    }
}

impl<S, E> Stream for UsageStripped<S>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
{
    type Item = Result<Bytes, E>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.ended {
            return Poll::Ready(None);
        }
        loop {
            match Pin::new(&mut self.inner).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(chunk))) => {
                    let out = self.filter.push(chunk);
                    if !out.is_empty() {
                        return Poll::Ready(Some(Ok(out)));
                    }
                    // Held back (an event not ended yet) or dropped: read on.
                }
                Poll::Ready(Some(Err(e))) => {
                    self.filter.discard();
                    self.ended = true;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(None) => {
                    self.ended = true;
                    let rest = self.filter.finish();
                    return Poll::Ready((!rest.is_empty()).then_some(Ok(rest)));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use proptest::prelude::*;

    const CONTENT: &str = r#"data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}],"usage":null}"#;
    const FINISH: &str = r#"data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":null}"#;
    const USAGE: &str = r#"data: {"id":"x","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":2,"total_tokens":14,"prompt_tokens_details":{"cached_tokens":8}}}"#;
    const DONE: &str = "data: [DONE]";

    /// A stream's events, each ended by a blank line of `eol`.
    fn stream_of(events: &[&str], eol: &str) -> String {
        events.iter().map(|e| format!("{e}{eol}{eol}")).collect()
    }

    /// Everything the filter lets out of `chunks`, the end of the stream included.
    fn filtered(chunks: &[&[u8]]) -> String {
        let mut f = UsageEventFilter::default();
        let mut out = Vec::new();
        for c in chunks {
            out.extend_from_slice(&f.push(Bytes::copy_from_slice(c)));
        }
        out.extend_from_slice(&f.finish());
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn the_usage_only_event_is_dropped_and_done_kept() {
        let input = stream_of(&[CONTENT, FINISH, USAGE, DONE], "\n");
        let want = stream_of(&[CONTENT, FINISH, DONE], "\n");
        assert_eq!(filtered(&[input.as_bytes()]), want);
        // One event a chunk, as a network read may cut them.
        let per_event: Vec<String> = [CONTENT, FINISH, USAGE, DONE]
            .iter()
            .map(|e| stream_of(&[e], "\n"))
            .collect();
        let chunks: Vec<&[u8]> = per_event.iter().map(|s| s.as_bytes()).collect();
        assert_eq!(filtered(&chunks), want);
    }

    #[test]
    fn crlf_events_are_read_too() {
        let input = stream_of(&[CONTENT, USAGE, DONE], "\r\n");
        assert_eq!(
            filtered(&[input.as_bytes()]),
            stream_of(&[CONTENT, DONE], "\r\n")
        );
    }

    #[test]
    fn usage_on_a_content_event_is_left_alone() {
        let last = r#"data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":3}}"#;
        let input = stream_of(&[CONTENT, last, DONE], "\n");
        assert_eq!(filtered(&[input.as_bytes()]), input);
        // Empty choices without usage, and text that quotes the mark, are kept.
        let no_usage = r#"data: {"choices":[],"usage":null}"#;
        let quoted = r#"data: {"choices":[{"delta":{"content":"\"choices\": []"}}]}"#;
        let input = stream_of(&[no_usage, quoted, DONE], "\n");
        assert_eq!(filtered(&[input.as_bytes()]), input);
    }

    #[test]
    fn an_oversize_event_passes_through_unread() {
        // Past the framer's cap the event goes out as it is, even a usage-only one.
        let padding = " ".repeat(2 * crate::sse::MAX_HELD_EVENT_BYTES);
        let big_usage =
            format!(r#"data: {{"choices":[],"usage":{{"prompt_tokens":1}},"pad":"{padding}"}}"#);
        let input = stream_of(&[CONTENT, &big_usage, USAGE, DONE], "\n");
        let want = stream_of(&[CONTENT, &big_usage, DONE], "\n");
        let chunks: Vec<&[u8]> = input.as_bytes().chunks(4096).collect();
        assert_eq!(filtered(&chunks), want);
    }

    #[test]
    fn an_unended_event_goes_out_at_the_end_and_is_dropped_on_failure() {
        assert_eq!(filtered(&[USAGE.as_bytes()]), USAGE);
        let mut f = UsageEventFilter::default();
        assert_eq!(f.push(Bytes::from_static(b"data: {\"cho")), "");
        f.discard();
        assert_eq!(f.finish(), "");
    }

    #[tokio::test]
    async fn the_stream_wrapper_drops_the_usage_event_and_passes_errors() {
        let input = stream_of(&[CONTENT, USAGE, DONE], "\n");
        let (a, b) = input.split_at(CONTENT.len() + 5);
        let chunks = vec![
            Ok::<_, String>(Bytes::copy_from_slice(a.as_bytes())),
            Ok(Bytes::copy_from_slice(b.as_bytes())),
        ];
        let out: Vec<_> = UsageStripped::new(futures::stream::iter(chunks))
            .collect()
            .await;
        let text: String = out
            .into_iter()
            .map(|c| String::from_utf8(c.unwrap().to_vec()).unwrap())
            .collect();
        assert_eq!(text, stream_of(&[CONTENT, DONE], "\n"));
        let broken = vec![
            Ok(Bytes::from_static(b"data: {\"cho")),
            Err("gone".to_owned()),
        ];
        let out: Vec<_> = UsageStripped::new(futures::stream::iter(broken))
            .collect()
            .await;
        assert_eq!(out, vec![Err("gone".to_owned())]);
    }

    #[test]
    fn usage_options_the_engine_may_read_as_asking_are_left_to_the_client() {
        for options in [
            serde_json::json!({"include_usage": "true"}),
            serde_json::json!({"include_usage": 1}),
            serde_json::json!({"include_usage": false, "continuous_usage_stats": true}),
        ] {
            let body = serde_json::json!({"stream": true, "stream_options": options});
            assert_eq!(
                StreamUsage::of_request(Endpoint::Chat, &body),
                StreamUsage::ClientAsked,
                "{body}"
            );
            let bytes = Bytes::from(body.to_string());
            assert_eq!(
                StreamUsage::of_body(Endpoint::Chat, &bytes),
                StreamUsage::ClientAsked
            );
            let sent = StreamUsage::ClientAsked.engine_body(EngineKind::Sglang, &bytes);
            assert!(!sent.strip_usage_event);
            assert_eq!(sent.body, bytes);
        }
        let body = serde_json::json!({"stream": true, "stream_options": {"include_usage": false}});
        assert_eq!(
            StreamUsage::of_request(Endpoint::Chat, &body),
            StreamUsage::ClientDidNotAsk {
                has_stream_options: true
            }
        );
    }

    #[test]
    fn what_the_client_asked_is_read_from_its_body() {
        use StreamUsage::*;
        let cases: &[(&str, StreamUsage)] = &[
            (r#"{"prompt":"x"}"#, NotStreamed),
            (r#"{"prompt":"x","stream":false}"#, NotStreamed),
            (
                r#"{"prompt":"x","stream":true}"#,
                ClientDidNotAsk {
                    has_stream_options: false,
                },
            ),
            (
                r#"{"prompt":"x","stream":true,"stream_options":null}"#,
                ClientDidNotAsk {
                    has_stream_options: true,
                },
            ),
            (
                r#"{"prompt":"x","stream":true,"stream_options":{"include_usage":false}}"#,
                ClientDidNotAsk {
                    has_stream_options: true,
                },
            ),
            (
                r#"{"prompt":"x","stream":true,"stream_options":{"include_usage":true}}"#,
                ClientAsked,
            ),
        ];
        for (body, want) in cases {
            let value: Value = serde_json::from_str(body).unwrap();
            assert_eq!(
                StreamUsage::of_request(Endpoint::Completions, &value),
                *want,
                "{body}"
            );
            assert_eq!(
                StreamUsage::of_body(Endpoint::Completions, body.as_bytes()),
                *want,
                "{body}"
            );
        }
        // Bytes that do not read as a body are left alone.
        for bad in [
            &b"[true]"[..],
            b"not json",
            br#"{"stream":true,"stream":true}"#,
        ] {
            assert_eq!(StreamUsage::of_body(Endpoint::Chat, bad), NotStreamed);
        }
    }

    #[test]
    fn stream_options_without_include_usage_mean_what_the_engine_defaults_to() {
        // vLLM's `StreamOptions.include_usage` defaults to true: `{}` asks for usage
        // there. OpenAI's default, and SGLang's, is false.
        for options in [serde_json::json!({}), serde_json::json!({"x_other": 1})] {
            let body = serde_json::json!({"stream": true, "stream_options": options});
            let bytes = Bytes::from(body.to_string());
            for usage in [
                StreamUsage::of_request(Endpoint::Chat, &body),
                StreamUsage::of_body(Endpoint::Chat, &bytes),
            ] {
                assert_eq!(
                    usage.for_engine(EngineKind::Vllm),
                    StreamUsage::ClientAsked,
                    "{body}"
                );
                let sent = usage.engine_body(EngineKind::Vllm, &bytes);
                assert_eq!((&sent.body, sent.strip_usage_event), (&bytes, false));
                for kind in [EngineKind::Sglang, EngineKind::Openai] {
                    assert_eq!(
                        usage.for_engine(kind),
                        StreamUsage::ClientDidNotAsk {
                            has_stream_options: true
                        },
                        "{body} {kind:?}"
                    );
                    let sent = usage.engine_body(kind, &bytes);
                    let v: Value = serde_json::from_slice(&sent.body).unwrap();
                    assert_eq!(v["stream_options"]["include_usage"], true);
                    assert!(sent.strip_usage_event);
                }
            }
        }
        // Said outright, `null` or `false` is no for every engine.
        for options in [
            serde_json::json!({"include_usage": null}),
            serde_json::json!({"include_usage": false}),
            Value::Null,
        ] {
            let body = serde_json::json!({"stream": true, "stream_options": options});
            assert_eq!(
                StreamUsage::of_request(Endpoint::Chat, &body).for_engine(EngineKind::Vllm),
                StreamUsage::ClientDidNotAsk {
                    has_stream_options: true
                },
                "{body}"
            );
        }
    }

    /// The body sent to the engine for `body`, parsed, and whether its usage event is
    /// stripped.
    fn sent(body: &str) -> (Value, bool) {
        let usage = StreamUsage::of_body(Endpoint::Chat, body.as_bytes());
        let sent = usage.engine_body(EngineKind::Sglang, &Bytes::copy_from_slice(body.as_bytes()));
        (
            serde_json::from_slice(&sent.body).unwrap(),
            sent.strip_usage_event,
        )
    }

    #[test]
    fn the_engine_is_asked_for_usage_the_client_did_not_ask_for() {
        let (v, strip) = sent(r#" {"messages":[],"stream":true}"#);
        assert_eq!(
            v["stream_options"],
            serde_json::json!({"include_usage": true})
        );
        assert_eq!(v["messages"], serde_json::json!([]));
        assert!(strip);
        // Other stream_options keys are kept; null is replaced.
        let (v, strip) =
            sent(r#"{"stream":true,"stream_options":{"include_usage":false,"x_other":7},"n":1}"#);
        assert_eq!(
            v["stream_options"],
            serde_json::json!({"include_usage": true, "x_other": 7})
        );
        assert_eq!(v["n"], 1);
        assert!(strip);
        let (v, _) = sent(r#"{"stream":true,"stream_options":null}"#);
        assert_eq!(
            v["stream_options"],
            serde_json::json!({"include_usage": true})
        );
        // Asked, or not streamed: the body goes as it is.
        for body in [
            r#"{"stream":true,"stream_options":{"include_usage":true}}"#,
            r#"{"stream":false}"#,
        ] {
            let usage = StreamUsage::of_body(Endpoint::Chat, body.as_bytes());
            let sent = usage.engine_body(EngineKind::Sglang, &Bytes::from(body));
            assert_eq!(sent.body, body);
            assert!(!sent.strip_usage_event);
        }
        // A stream_options the node cannot extend: as it is, nothing stripped.
        let body = Bytes::from_static(br#"{"stream":true,"stream_options":"x"}"#);
        let sent = StreamUsage::ClientDidNotAsk {
            has_stream_options: true,
        }
        .engine_body(EngineKind::Sglang, &body);
        assert_eq!((sent.body, sent.strip_usage_event), (body, false));
    }

    proptest! {
        /// Wherever the network cuts the stream, the client gets the same bytes: every
        /// event but the usage-only one, each whole.
        #[test]
        fn any_split_gives_the_same_events(
            cuts in proptest::collection::vec(0usize..2_000, 0..12),
            crlf in any::<bool>(),
        ) {
            let eol = if crlf { "\r\n" } else { "\n" };
            let input = stream_of(&[CONTENT, CONTENT, FINISH, USAGE, DONE], eol);
            let want = stream_of(&[CONTENT, CONTENT, FINISH, DONE], eol);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (input.len() + 1)).collect();
            cuts.sort_unstable();
            let mut chunks = Vec::new();
            let mut from = 0;
            for cut in cuts.into_iter().chain([input.len()]) {
                chunks.push(&input.as_bytes()[from..cut]);
                from = cut;
            }
            prop_assert_eq!(filtered(&chunks), want);
        }

        /// An event goes out with the chunk that ends it: nothing of the stream is
        /// held past the end of the event it is in.
        #[test]
        fn events_go_out_as_soon_as_they_end(cut in 1usize..400) {
            let input = stream_of(&[CONTENT, FINISH, DONE], "\n");
            let cut = cut.min(input.len());
            let mut f = UsageEventFilter::default();
            let out = f.push(Bytes::copy_from_slice(&input.as_bytes()[..cut]));
            let ended = crate::sse::last_event_end(&input.as_bytes()[..cut]).unwrap_or(0);
            prop_assert_eq!(&out[..], &input.as_bytes()[..ended]);
        }
    }
}
