//! One streaming request, measured where the client is.
//!
//! TTFT is the time from just before the request is written to the first SSE event
//! that carries non-empty generated text; E2E runs to the end of the stream. Every
//! failure (connect, status, timeout, error event, truncated stream) becomes an error
//! string in the measurement, never a panic or an early return of the whole run.

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;

use crate::sse::{SseEvent, SseParser};

/// The client API's headers, as the node names them.
pub use gorgo_core::headers::{
    HOPS_HEADER, POLICY_HEADER, PREDICTED_TTFT_HEADER, SERVED_BY_HEADER, SESSION_HEADER,
};

/// Cap on the error body we keep from a failed response.
const MAX_ERROR_BODY: usize = 512;

/// What one request measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Measured {
    /// First content chunk, ms after the send.
    pub ttft_ms: Option<f64>,
    /// The 2xx response head, ms after the send: the stream began (a failure after
    /// it is a stream cut mid-way, before it a request that never started).
    pub first_byte_ms: Option<f64>,
    /// End of stream, ms after the send.
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
    /// refused, or closed by the server as the request went out).
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
        .pool_idle_timeout(Duration::from_secs(60))
        .build()
}

/// Send one streaming request and measure it. `headers` are extra request headers.
pub async fn send_streaming(
    client: &reqwest::Client,
    url: &str,
    body: Bytes,
    headers: &[(&'static str, String)],
) -> Measured {
    let t0 = Instant::now();
    let mut m = Measured::default();
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
                return m;
            }
        }
    };
    m.served_by = header_str(&resp, SERVED_BY_HEADER);
    m.hops = header_str(&resp, HOPS_HEADER).and_then(|h| h.trim().parse().ok());
    m.predicted_ttft_ms = header_str(&resp, PREDICTED_TTFT_HEADER)
        .and_then(|h| h.trim().parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v >= 0.0);
    let status = resp.status();
    if status.is_success() {
        m.first_byte_ms = Some(ms_since(t0));
    } else {
        let text = resp.text().await.unwrap_or_default();
        let text: String = text.chars().take(MAX_ERROR_BODY).collect();
        m.error = Some(format!("HTTP {}: {}", status.as_u16(), text.trim()));
        m.e2e_ms = Some(ms_since(t0));
        return m;
    }
    let mut parser = SseParser::new();
    let mut events = Vec::new();
    let mut done = false;
    let mut stream = resp.bytes_stream();
    while let Some(next) = stream.next().await {
        match next {
            Ok(bytes) => parser.feed(&bytes, &mut events),
            Err(e) => {
                m.error = Some(describe(&e));
                break;
            }
        }
        done |= absorb(&mut m, &mut events, t0);
        if m.error.is_some() {
            break;
        }
    }
    if m.error.is_none() {
        parser.finish(&mut events);
        done |= absorb(&mut m, &mut events, t0);
    }
    m.e2e_ms = Some(ms_since(t0));
    if m.error.is_none() && !done {
        m.error = Some("stream ended before [DONE]".into());
    }
    if m.error.is_none() && m.ttft_ms.is_none() {
        m.error = Some("stream carried no content".into());
    }
    m
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
                    m.error.get_or_insert(format!("error event: {e}"));
                }
            }
        }
    }
    done
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
