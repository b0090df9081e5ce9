//! One streaming request, measured where the client is.
//!
//! Every time is counted from an origin the caller chooses: the request's scheduled
//! send time in an open-loop replay, as the simulator counts (see
//! [`send_streaming`]), so whatever delays the client (task spawn, body building, a
//! busy runtime, retries) is inside TTFT and E2E, and how late the request actually
//! went out is recorded apart ([`Measured::sent_ms`]). TTFT runs to the first SSE
//! event that carries non-empty generated text; E2E to `[DONE]` (the completion's
//! last byte; a body held open after it is drained briefly, never waited for). Every
//! failure (connect, status, timeout, error event, truncated stream) becomes an error
//! string in the measurement, never a panic or an early return of the whole run.

use std::future::Future;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::sse::{SseEvent, SseParser};

/// The client API's headers, as the node names them.
pub use gorgo_core::headers::{
    HOPS_HEADER, POLICY_HEADER, PREDICTED_TTFT_HEADER, SERVED_BY_HEADER, SESSION_HEADER,
};

/// What an error event's message is prefixed with in [`Measured::error`]: the report
/// tells the node's timeout events by it.
pub(crate) const ERROR_EVENT: &str = "error event: ";

/// Cap on the error body read from a failed response, bytes: the read stops there
/// (a large or endless error body is never buffered, nor waited for).
const MAX_ERROR_BODY: usize = 512;

/// How long the rest of a body is drained after `[DONE]` (to keep the connection
/// for reuse) before it is dropped; never counted in E2E.
const DRAIN_GRACE: Duration = Duration::from_secs(1);

/// How long an idle pooled connection is kept for reuse. It must stay below the
/// node's `limits.header_timeout_ms` (20 s by default: `default_header_timeout_ms` in
/// crates/gorgo-node/src/config.rs), after which the node closes an idle HTTP/1
/// connection: a connection reused just as the node closes it fails and is retried
/// after a backoff that lands in the request's latency. Half of it leaves room for
/// the netem relay's link delay, which the node's close travels through.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(10);

/// What one request measured. Every time is in ms after the origin passed to
/// [`send_streaming`] (the scheduled send time in an open-loop replay).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Measured {
    /// When the request actually went out (just before its first attempt was
    /// written), ms after the origin: the client's lateness against the schedule.
    /// `None` when it never did (its body could not be built).
    pub sent_ms: Option<f64>,
    /// First content chunk, ms after the origin. Kept when the request failed later
    /// (a stream cut or timed out after its first token): TTFT is defined by the
    /// first token, not by completion.
    pub ttft_ms: Option<f64>,
    /// The 2xx response head, ms after the origin: the stream began (a failure after
    /// it is a stream cut mid-way, before it a request that never started).
    pub first_byte_ms: Option<f64>,
    /// End of stream, ms after the origin; for a failed request, when it failed.
    pub e2e_ms: Option<f64>,
    /// Content chunks seen (the token count when usage is missing).
    pub content_chunks: u64,
    /// `usage.completion_tokens`.
    pub completion_tokens: Option<u64>,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
    /// `x-gorgo-served-by`.
    pub served_by: Option<String>,
    /// `x-gorgo-hops`.
    pub hops: Option<u32>,
    /// `x-gorgo-predicted-ttft-ms` (finite values only).
    pub predicted_ttft_ms: Option<f64>,
    /// Why the request failed; `None` when it succeeded.
    pub error: Option<String>,
    /// Times the request was sent again because nothing answered it (connection
    /// refused, or closed by the server as the request went out). Each retry waits a
    /// backoff that counts in TTFT and E2E, so reports count retries per policy.
    pub connect_retries: u32,
}

/// Retries of a request whose connection could not be made (nothing was sent).
pub const CONNECT_RETRIES: u32 = 2;

/// Build the pooled HTTP client used for one region.
pub fn build_client(
    connect_timeout: Duration,
    request_timeout: Duration,
) -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder()
        .tcp_nodelay(true)
        // Loopback clusters must never go through an environment proxy.
        .no_proxy()
        .connect_timeout(connect_timeout)
        .timeout(request_timeout)
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .build()
}

/// [`Measured::error`] of a request stopped in flight (the replay was stopped).
pub const CANCELLED: &str = "cancelled: stopped before it completed";

/// [`Measured::error`] of a request stopped before it went out: due, never sent.
pub const CANCELLED_UNSENT: &str = "cancelled: stopped before it was sent";

/// Send one streaming request and measure it. `headers` are extra request headers.
///
/// Every time in the result counts from `origin`. The replay passes the request's
/// scheduled send time (the trace timestamp times the time scale, after the start),
/// which is where the simulator counts from: its TTFT is `first token at the client
/// - send_ms` and its E2E `completion - send_ms`, `send_ms` being the scheduled time
/// (crates/gorgo-sim/src/sim.rs `admit` and `complete`; the `Row` of
/// crates/gorgo-sim/src/collect.rs: "time to first token at the client", "when the
/// client sent it"). So any delay of the client itself is in the measured latency, as a
/// real user would see it, and [`Measured::sent_ms`] says how late it went out.
///
/// When `stop` fires first, the request ends at once and keeps what it had measured
/// (its send time, response head, first token, serving region, retries): it fails as
/// [`CANCELLED`] with its E2E so far, a lower bound (censored in the report), or as
/// [`CANCELLED_UNSENT`] without a send time when `stop` had fired before it went out.
/// A request that had already ended (a stream whose `[DONE]` came, then drained) stays
/// as it ended.
pub async fn send_streaming(
    client: &reqwest::Client,
    url: &str,
    body: Bytes,
    headers: &[(&'static str, String)],
    origin: Instant,
    stop: &CancellationToken,
) -> Measured {
    let mut m = Measured::default();
    if unless_stopped(stop, exchange(&mut m, client, url, body, headers, origin)).await {
        end_stopped(&mut m, origin);
    }
    m
}

/// Drive `work` to its end unless `stop` fires first (true then). A stop already
/// fired wins before `work` is first polled: a request is never sent after it.
async fn unless_stopped(stop: &CancellationToken, work: impl Future<Output = ()>) -> bool {
    tokio::select! {
        biased;
        _ = stop.cancelled() => true,
        _ = work => false,
    }
}

/// Record a stop in `m`, which holds what the request measured until then: a request
/// still going fails as cancelled at this time; one that had ended (its E2E set) stays
/// as it was.
fn end_stopped(m: &mut Measured, t0: Instant) {
    if m.e2e_ms.is_none() {
        m.error = Some(
            if m.sent_ms.is_some() {
                CANCELLED
            } else {
                CANCELLED_UNSENT
            }
            .into(),
        );
        m.e2e_ms = Some(ms_since(t0));
    }
}

/// The whole exchange of [`send_streaming`], measured into `m` as it goes (so that a
/// stop keeps what was measured): sends, retries what nothing answered, then reads
/// the response. `m.e2e_ms` is set once the exchange is over (completed or failed).
async fn exchange(
    m: &mut Measured,
    client: &reqwest::Client,
    url: &str,
    body: Bytes,
    headers: &[(&'static str, String)],
    t0: Instant,
) {
    m.sent_ms = Some(ms_since(t0));
    let mut attempt = 0;
    let resp = loop {
        let mut req = client
            .post(url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(reqwest::header::ACCEPT, "text/event-stream")
            .body(body.clone());
        for (name, value) in headers {
            req = req.header(*name, value.as_str());
        }
        match req.send().await {
            Ok(r) => break r,
            // Nothing was answered: retry, as OpenAI's SDK does (2 retries, backoff),
            // so a node restarting behind its address costs a delay, not a failure.
            // The delay counts in the request's TTFT and E2E.
            Err(e) if unanswered(&e) && attempt < CONNECT_RETRIES => {
                attempt += 1;
                m.connect_retries = attempt;
                tokio::time::sleep(Duration::from_millis(250 << attempt)).await;
            }
            Err(e) => {
                m.error = Some(describe(&e));
                // When it failed, as for every other failure: lines it up with what
                // happened meanwhile (a node killed while the request was on its way).
                m.e2e_ms = Some(ms_since(t0));
                return;
            }
        }
    };
    read_response(m, resp, t0).await;
}

/// Measure a response into `m`: its head, then its event stream up to `[DONE]` (or
/// the failure), then a short drain. Sets `m.e2e_ms` as soon as the exchange is over,
/// before the drain.
async fn read_response(m: &mut Measured, resp: reqwest::Response, t0: Instant) {
    m.served_by = header_str(&resp, SERVED_BY_HEADER);
    m.hops = header_str(&resp, HOPS_HEADER).and_then(|h| h.trim().parse().ok());
    m.predicted_ttft_ms = header_str(&resp, PREDICTED_TTFT_HEADER)
        .and_then(|h| h.trim().parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v >= 0.0);
    let status = resp.status();
    if status.is_success() {
        m.first_byte_ms = Some(ms_since(t0));
    } else {
        // Only the head of the body: an error is described by its first bytes, and a
        // huge or endless body must neither fill memory nor hold the request open.
        let text = read_bounded(resp, MAX_ERROR_BODY)
            .await
            .map(|b| utf8_prefix(&b.bytes))
            .unwrap_or_default();
        m.error = Some(format!("HTTP {}: {}", status.as_u16(), text.trim()));
        m.e2e_ms = Some(ms_since(t0));
        return;
    }
    let mut parser = SseParser::new();
    let mut events = Vec::new();
    let mut stream = resp.bytes_stream();
    let mut ended = false;
    loop {
        match stream.next().await {
            None => {
                ended = true;
                break;
            }
            Some(Ok(bytes)) => parser.feed(&bytes, &mut events),
            Some(Err(e)) => {
                m.error = Some(describe(&e));
                break;
            }
        }
        // `[DONE]`: the completion's last byte, where E2E ends (the simulator's E2E
        // is the completion's last byte at the client too).
        if absorb(m, &mut events, t0) {
            m.e2e_ms = Some(ms_since(t0));
            break;
        }
        if m.error.is_some() {
            break;
        }
    }
    if m.error.is_none() && m.e2e_ms.is_none() {
        parser.finish(&mut events);
        if absorb(m, &mut events, t0) {
            m.e2e_ms = Some(ms_since(t0));
        }
    }
    if m.e2e_ms.is_none() {
        m.e2e_ms = Some(ms_since(t0));
        m.error
            .get_or_insert_with(|| "stream ended before [DONE]".into());
    }
    // Before the drain: a stop while draining drops this future, and a stream that
    // carried nothing must not then read as a request that completed.
    if m.error.is_none() && m.ttft_ms.is_none() {
        m.error = Some("stream carried no content".into());
    }
    if m.error.is_none() && !ended {
        // The exchange is over: drain what is left for a moment so the connection can
        // go back to the pool, but a body held open (or cut, or timed out) after
        // `[DONE]` never fails a request that finished. `DRAIN_GRACE` in all, not per
        // chunk: a body that keeps sending after it would hold the request, and in
        // closed loop its worker's slot, until the request timeout.
        let until = tokio::time::Instant::now() + DRAIN_GRACE;
        while let Ok(Some(Ok(_))) = tokio::time::timeout_at(until, stream.next()).await {}
    }
}

/// Fold parsed events into the measurement; true once `[DONE]` was seen.
fn absorb(m: &mut Measured, events: &mut Vec<SseEvent>, t0: Instant) -> bool {
    let mut done = false;
    for ev in events.drain(..) {
        match ev {
            SseEvent::Done => done = true,
            SseEvent::Malformed(e) => {
                m.error.get_or_insert(format!("malformed SSE event: {e}"));
            }
            SseEvent::Chunk(c) => {
                if c.has_content {
                    if m.ttft_ms.is_none() {
                        m.ttft_ms = Some(ms_since(t0));
                    }
                    m.content_chunks += 1;
                }
                if c.completion_tokens.is_some() {
                    m.completion_tokens = c.completion_tokens;
                }
                if c.prompt_tokens.is_some() {
                    m.prompt_tokens = c.prompt_tokens;
                }
                if c.cached_tokens.is_some() {
                    m.cached_tokens = c.cached_tokens;
                }
                if let Some(e) = c.error {
                    m.error.get_or_insert(format!("{ERROR_EVENT}{e}"));
                }
            }
        }
    }
    done
}

/// A body read up to a cap.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct BoundedBody {
    /// The body's first bytes, at most the cap.
    pub bytes: Vec<u8>,
    /// The body ended within the cap: `bytes` is all of it. False when the read
    /// stopped at the cap (the rest, if any, was never read).
    pub complete: bool,
}

/// Read `resp`'s body until its end or `cap` bytes, whichever comes first. The read
/// stops at the cap: nothing past it is pulled from the connection beyond the chunk
/// that crossed it, and nothing past it is kept. Dropping the response then closes
/// the connection when the body was cut, which is fine on the error and admin paths
/// that use this.
pub(crate) async fn read_bounded(
    mut resp: reqwest::Response,
    cap: usize,
) -> Result<BoundedBody, reqwest::Error> {
    let mut bytes = Vec::new();
    while bytes.len() < cap {
        let Some(chunk) = resp.chunk().await? else {
            return Ok(BoundedBody {
                bytes,
                complete: true,
            });
        };
        let take = chunk.len().min(cap - bytes.len());
        bytes.extend_from_slice(&chunk[..take]);
    }
    Ok(BoundedBody {
        bytes,
        complete: false,
    })
}

/// `bytes` as text, up to the last complete UTF-8 character (a cap may cut one in
/// half); invalid sequences before that are replaced.
fn utf8_prefix(bytes: &[u8]) -> String {
    let end = match std::str::from_utf8(bytes) {
        Ok(_) => bytes.len(),
        // An incomplete character at the very end (no `error_len`): cut before it.
        Err(e) if e.error_len().is_none() => e.valid_up_to(),
        Err(_) => bytes.len(),
    };
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

fn header_str(resp: &reqwest::Response, name: &str) -> Option<String> {
    resp.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

fn ms_since(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1000.0
}

/// Whether the request failed before any answer (an error of the send itself, not a
/// timeout): the connection was refused or reset, or a pooled keep-alive connection
/// was closed by the server as the request went out (the race every HTTP/1 client
/// meets when a server closes idle connections). OpenAI's SDK retries these too.
fn unanswered(e: &reqwest::Error) -> bool {
    !e.is_timeout() && (e.is_connect() || e.is_request())
}

/// A short, specific description of a transport error.
fn describe(e: &reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timeout"
    } else if e.is_connect() {
        "connect"
    } else if e.is_body() || e.is_decode() {
        "body"
    } else {
        "request"
    };
    let mut msg = format!("{kind}: {e}");
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// A response whose body is `chunk` repeated `chunks` times (`None`: for ever),
    /// counting the chunks the reader pulled.
    fn counted(
        chunk: &'static [u8],
        chunks: Option<usize>,
    ) -> (reqwest::Response, Arc<AtomicUsize>) {
        let pulled = Arc::new(AtomicUsize::new(0));
        let p = pulled.clone();
        let stream = futures::stream::iter(std::iter::from_fn(move || {
            let n = p.fetch_add(1, Ordering::SeqCst);
            chunks
                .is_none_or(|c| n < c)
                .then(|| Ok::<_, std::io::Error>(Bytes::from_static(chunk)))
        }));
        let resp = axum::http::Response::builder()
            .status(500)
            .body(reqwest::Body::wrap_stream(stream))
            .unwrap();
        (reqwest::Response::from(resp), pulled)
    }

    #[tokio::test]
    async fn an_endless_body_is_read_up_to_the_cap_only() {
        let (resp, pulled) = counted(&[b'x'; 100], None);
        let b = read_bounded(resp, MAX_ERROR_BODY).await.unwrap();
        assert_eq!(b.bytes.len(), MAX_ERROR_BODY);
        assert!(!b.complete);
        // 512 bytes are 6 chunks of 100: nothing was pulled past the one that crossed
        // the cap (an unbounded read would never have returned).
        assert_eq!(pulled.load(Ordering::SeqCst), 6);
    }

    #[tokio::test]
    async fn a_short_body_is_read_whole() {
        let (resp, _) = counted(b"0123456789", Some(3));
        let b = read_bounded(resp, 64).await.unwrap();
        assert_eq!((b.bytes.len(), b.complete), (30, true));
        // A body of exactly the cap: not known to be complete (no read past it).
        let (resp, pulled) = counted(b"0123456789", Some(3));
        let b = read_bounded(resp, 30).await.unwrap();
        assert_eq!((b.bytes.len(), b.complete), (30, false));
        assert_eq!(pulled.load(Ordering::SeqCst), 3);
    }

    const FIRST_TOKEN: &[u8] =
        b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"t\"}}]}\n\n";

    /// A 200 event stream from node `eu` of `frames`, then a stall whose first poll
    /// fires `stop`: the reader asks for more only once it has taken in every frame, so
    /// the stop comes after what they carried was measured, never before.
    fn frames_then_stop(frames: &[&'static [u8]], stop: CancellationToken) -> reqwest::Response {
        let head = futures::stream::iter(
            frames
                .iter()
                .map(|f| Ok::<_, std::io::Error>(Bytes::from_static(f)))
                .collect::<Vec<_>>(),
        );
        let stall = futures::stream::poll_fn(move |_| {
            stop.cancel();
            std::task::Poll::Pending
        });
        let resp = axum::http::Response::builder()
            .status(200)
            .header(SERVED_BY_HEADER, "eu")
            .header(HOPS_HEADER, "1")
            .body(reqwest::Body::wrap_stream(head.chain(stall)))
            .unwrap();
        reqwest::Response::from(resp)
    }

    /// What `send_streaming` does with a response, from its head on.
    async fn read_until_stopped(
        m: &mut Measured,
        resp: reqwest::Response,
        stop: &CancellationToken,
    ) {
        let t0 = Instant::now();
        if unless_stopped(stop, read_response(m, resp, t0)).await {
            end_stopped(m, t0);
        }
    }

    #[tokio::test]
    async fn a_stop_in_flight_keeps_what_the_request_measured() {
        let stop = CancellationToken::new();
        let resp = frames_then_stop(&[FIRST_TOKEN], stop.clone());
        // What the send measured before the response came.
        let mut m = Measured {
            sent_ms: Some(0.0),
            connect_retries: 1,
            ..Measured::default()
        };
        read_until_stopped(&mut m, resp, &stop).await;
        assert_eq!(m.error.as_deref(), Some(CANCELLED));
        let (fb, ttft, e2e) = (
            m.first_byte_ms.unwrap(),
            m.ttft_ms.unwrap(),
            m.e2e_ms.unwrap(),
        );
        assert!(fb <= ttft && ttft <= e2e, "{m:?}");
        assert_eq!(m.served_by.as_deref(), Some("eu"));
        assert_eq!((m.hops, m.content_chunks), (Some(1), 1));
        assert_eq!((m.sent_ms, m.connect_retries), (Some(0.0), 1));
    }

    #[tokio::test]
    async fn a_stop_after_done_leaves_a_completed_request_completed() {
        let stop = CancellationToken::new();
        // The stop comes while the body is drained after `[DONE]`.
        let resp = frames_then_stop(&[FIRST_TOKEN, b"data: [DONE]\n\n"], stop.clone());
        let mut m = Measured::default();
        read_until_stopped(&mut m, resp, &stop).await;
        assert!(stop.is_cancelled());
        assert_eq!(m.error, None);
        assert!(m.e2e_ms.unwrap() >= m.ttft_ms.unwrap());

        // The same with nothing before `[DONE]`: not a completed request.
        let stop = CancellationToken::new();
        let resp = frames_then_stop(&[b"data: [DONE]\n\n"], stop.clone());
        let mut m = Measured::default();
        read_until_stopped(&mut m, resp, &stop).await;
        assert_eq!(m.error.as_deref(), Some("stream carried no content"));
    }

    #[tokio::test]
    async fn a_request_is_never_sent_after_the_stop() {
        let stop = CancellationToken::new();
        stop.cancel();
        let client = build_client(Duration::from_secs(5), Duration::from_secs(5)).unwrap();
        let origin = Instant::now();
        let m = send_streaming(
            &client,
            "http://127.0.0.1:9/x",
            Bytes::new(),
            &[],
            origin,
            &stop,
        )
        .await;
        assert_eq!(m.error.as_deref(), Some(CANCELLED_UNSENT));
        assert_eq!((m.sent_ms, m.connect_retries), (None, 0));
        assert!(m.e2e_ms.is_some());
    }

    #[test]
    fn a_cut_character_is_dropped_not_garbled() {
        let text = "ab\u{e9}".as_bytes(); // 'é' is 2 bytes
        assert_eq!(utf8_prefix(&text[..3]), "ab");
        assert_eq!(utf8_prefix(text), "ab\u{e9}");
        assert_eq!(utf8_prefix(b"a\xffb"), "a\u{fffd}b");
    }
}
