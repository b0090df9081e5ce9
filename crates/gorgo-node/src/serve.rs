//! The request path shared by the HTTP ingress and incoming forwards: decide, then
//! serve on the local engine or relay through a peer, falling back to local when a
//! forward fails before its first byte.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::{Stream, StreamExt};
use gorgo_core::cost::Candidate;
use gorgo_core::policy::PolicyKind;
use gorgo_core::{Endpoint, HashChain, NodeId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::engine::EngineFailure;
use crate::error::NodeError;
use crate::forward::{
    read_frame, write_frame, ForwardRequest, ForwardResponseHead, MAX_RESPONSE_HEAD,
};
use crate::peers::{ForwardRecv, IncomingForward};
use crate::route::{DecisionInput, Target};
use crate::NodeState;

/// Largest chunk a peer may send in one response frame.
pub const MAX_CHUNK_BYTES: usize = 16 * 1024 * 1024;
/// Chunk-length marker: the response ended cleanly.
const END_OK: u32 = 0;
/// Chunk-length marker: the serving side failed mid-response.
const END_ERR: u32 = u32::MAX;

/// Response headers from the engine that travel to the client.
/// Response header with the TTFT, ms, the cost model predicted for the candidate this
/// node chose (`gorgo_core::cost::estimated_ttft_ms`; cost-based policies only), so a
/// benchmark client can report the model's prediction error. Set by the client's node:
/// a forwarded request carries its first decision's prediction.
pub const PREDICTED_TTFT_HEADER: &str = "x-gorgo-predicted-ttft-ms";
const PASS_RESPONSE_HEADERS: &[&str] = &["content-type", "cache-control", "x-request-id"];
/// Client headers that travel to the engine.
pub const PASS_REQUEST_HEADERS: &[&str] =
    &["content-type", "authorization", "accept", "x-request-id"];

/// A streaming body: chunks as the engine produced them, or an error mid-stream.
pub type BodyStream = Pin<Box<dyn Stream<Item = Result<Bytes, String>> + Send>>;

/// A request ready to route.
#[derive(Debug, Clone)]
pub struct RoutedRequest {
    /// Id on this node.
    pub request_id: u64,
    /// Chat or completions.
    pub endpoint: Endpoint,
    /// The client's body, unchanged.
    pub body: Bytes,
    /// Headers passed to the engine.
    pub headers: Vec<(String, String)>,
    /// The prompt's chain.
    pub chain: HashChain,
    /// Hops taken so far.
    pub hops: u8,
    /// Policy override (`x-gorgo-policy`).
    pub policy: Option<PolicyKind>,
    /// Hash of `x-session-id`, when sent.
    pub session_key: Option<u64>,
    /// The raw `x-session-id`, passed on to peers.
    pub session_id: Option<String>,
    /// The node the client talks to.
    pub origin: NodeId,
    /// The cost weights to route with: the tuning epoch's, fixed at admission so the
    /// request is routed with the weights of the epoch it is attributed to.
    pub weights: gorgo_core::Weights,
}

/// Why a request could not be served; the ingress maps it to a status.
#[derive(Debug, Clone, PartialEq)]
pub enum ServeError {
    /// No engine and no live peer (503).
    Unavailable(String),
    /// The engine or a peer failed (502).
    Failed(String),
    /// Timed out before the first byte (504).
    Timeout(String),
}

/// A response on its way to the client.
pub struct Upstream {
    /// HTTP status.
    pub status: u16,
    /// Headers to pass on.
    pub headers: Vec<(String, String)>,
    /// The region that served.
    pub served_by: String,
    /// Hops taken.
    pub hops: u8,
    /// The bytes.
    pub body: BodyStream,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("status", &self.status)
            .field("served_by", &self.served_by)
            .field("hops", &self.hops)
            .finish()
    }
}

fn pass_headers(headers: &reqwest::header::HeaderMap) -> Vec<(String, String)> {
    PASS_RESPONSE_HEADERS
        .iter()
        .filter_map(|&name| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(|v| (name.to_owned(), v.to_owned()))
        })
        .collect()
}

/// Build the candidates: the local node first, then every live peer.
fn candidates(state: &NodeState, chain: &HashChain) -> Vec<Candidate> {
    let mut out = Vec::new();
    let local_stats = state.local_stats();
    out.push(Candidate {
        node: state.id.clone(),
        is_local: true,
        healthy: state.engine.is_healthy(),
        rtt_ms: 0.0,
        cached_tokens: state.shadow.lock().longest_match(chain),
        stats: local_stats,
        inflight_forwards: 0,
        inflight_forward_prompt_tokens: 0,
    });
    for p in state.peers.peers() {
        if !p.alive || p.id == state.id {
            continue;
        }
        let Some(stats) = p.stats.clone() else {
            continue;
        };
        {
            let mut ledger = state.router.ledger.lock();
            ledger.observe_stats(&p.id, stats.version, state.now_ms(), p.rtt_ms);
        }
        out.push(Candidate {
            cached_tokens: state.peers.matched_tokens(&p.id, chain),
            node: p.id,
            is_local: false,
            healthy: true,
            rtt_ms: p.rtt_ms,
            stats,
            inflight_forwards: 0,
            inflight_forward_prompt_tokens: 0,
        });
    }
    out
}

/// Route and serve one request.
pub async fn serve(state: &Arc<NodeState>, req: RoutedRequest) -> Result<Upstream, ServeError> {
    let policy = req.policy.unwrap_or(state.policy);
    let prompt_tokens = req.chain.total_tokens();
    let input = DecisionInput {
        request_id: req.request_id,
        policy,
        hops: req.hops,
        max_hops: state.config.routing.max_hops,
        chain: &req.chain,
        prompt_tokens,
        session_key: req.session_key,
        weights: req.weights,
        now_ms: state.now_ms(),
    };
    let cands = candidates(state, &req.chain);
    let (target, record) = state.router.decide(&input, cands);
    if let Some(terms) = record
        .candidates
        .iter()
        .find(|c| c.chosen)
        .and_then(|c| c.terms)
    {
        state.metrics.terms(&terms);
    }
    let predicted = record
        .candidates
        .iter()
        .find(|c| c.chosen)
        .and_then(|c| c.terms?.estimated_ttft_ms);
    tracing::debug!(request_id = req.request_id, ?target, reason = %record.reason, "decided");
    let served = match target {
        Target::Nothing => Err(ServeError::Unavailable(
            "no healthy engine and no live peer".into(),
        )),
        Target::Local => serve_local(state, &req).await,
        Target::Peer(peer) => match forward(state, &peer, &req).await {
            Ok(up) => {
                state.metrics.forward(&peer.0, "ok");
                Ok(up)
            }
            Err(e) => {
                tracing::warn!(request_id = req.request_id, %peer, error = %e, "forward failed before first byte; serving locally");
                state.metrics.forward(&peer.0, "fallback");
                if state.engine.is_healthy() {
                    serve_local(state, &req).await
                } else {
                    Err(ServeError::Unavailable(format!(
                        "forward to {peer} failed and no local engine"
                    )))
                }
            }
        },
    };
    served.map(|mut up| {
        if let Some(p) = predicted {
            up.headers
                .retain(|(k, _)| !k.eq_ignore_ascii_case(PREDICTED_TTFT_HEADER));
            up.headers
                .push((PREDICTED_TTFT_HEADER.to_owned(), format!("{p:.1}")));
        }
        up
    })
}

/// Serve on the local engine.
pub async fn serve_local(
    state: &Arc<NodeState>,
    req: &RoutedRequest,
) -> Result<Upstream, ServeError> {
    let prompt_tokens = req.chain.total_tokens();
    let (cached, delta) = {
        let mut shadow = state.shadow.lock();
        (
            shadow.longest_match(&req.chain),
            shadow.insert(&req.chain, state.now_ms()),
        )
    };
    if let Some(delta) = delta {
        state.peers.publish_summary(&delta);
    }
    let uncached = prompt_tokens.saturating_sub(cached);
    // The wait this node expects behind work already at its engine: the fit subtracts
    // it so `t_p` measures prefill, not queueing (gorgo-core `fit.rs`).
    let queued_est_ms = gorgo_core::cost::queue_ms(&Candidate {
        stats: state.local_stats(),
        ..Candidate::idle("local", true, 0.0)
    })
    .0;
    let mut ticket = state.engine.dispatch(prompt_tokens, uncached);
    let started = Instant::now();
    let resp = state
        .engine
        .send(
            http::Method::POST,
            req.endpoint.path(),
            &req.headers,
            req.body.clone(),
        )
        .await
        .map_err(|e| match e {
            EngineFailure::Timeout => ServeError::Timeout("engine did not answer in time".into()),
            EngineFailure::Failed(m) => ServeError::Failed(format!("engine failed: {m}")),
        })?;
    let status = resp.status().as_u16();
    let headers = pass_headers(resp.headers());
    let st = state.clone();
    let chain = req.chain.clone();
    let mut first = true;
    let mut corrected = false;
    let body = resp.bytes_stream().map(move |chunk| {
        if first {
            first = false;
            ticket.prefilled();
            let ttft_ms = started.elapsed().as_secs_f64() * 1000.0;
            if status < 300 {
                st.fit
                    .lock()
                    .observe_after_wait(ttft_ms, 0.0, queued_est_ms, uncached);
            }
        }
        if let (Ok(bytes), false) = (&chunk, corrected) {
            // The engine's own count of cached prompt tokens corrects the shadow index.
            if let Some(cached) = find_cached_tokens(bytes) {
                corrected = true;
                let delta = st.shadow.lock().correct(&chain, cached, st.now_ms());
                if let Some(delta) = delta {
                    st.peers.publish_summary(&delta);
                }
            }
        }
        chunk.map_err(|e| format!("engine stream failed: {e}"))
    });
    Ok(Upstream {
        status,
        headers,
        served_by: state.config.node.region.clone(),
        hops: req.hops,
        body: Box::pin(body),
    })
}

/// `usage.prompt_tokens_details.cached_tokens` in a response chunk, found without
/// parsing the JSON (the usage object arrives in the last chunk, in one piece).
fn find_cached_tokens(bytes: &[u8]) -> Option<u64> {
    const KEY: &[u8] = b"\"cached_tokens\":";
    let at = bytes.windows(KEY.len()).position(|w| w == KEY)?;
    let rest = &bytes[at + KEY.len()..];
    let start = rest.iter().position(|b| !b.is_ascii_whitespace())?;
    let digits: &[u8] = &rest[start..];
    let len = digits.iter().take_while(|b| b.is_ascii_digit()).count();
    if len == 0 || len > 19 {
        return None;
    }
    std::str::from_utf8(&digits[..len]).ok()?.parse().ok()
}

/// Forward to a peer and wait for its response head. Any error here happened before
/// the first byte, so the caller may serve locally instead.
async fn forward(
    state: &Arc<NodeState>,
    peer: &NodeId,
    req: &RoutedRequest,
) -> Result<Upstream, NodeError> {
    let timeout = Duration::from_millis(state.config.limits.first_byte_timeout_ms);
    let fut = async {
        let (mut send, mut recv) = state.peers.open_forward(peer).await?;
        let mut headers = req.headers.clone();
        if let Some(p) = req.policy {
            headers.push((
                crate::ingress::POLICY_HEADER.to_owned(),
                p.as_str().to_owned(),
            ));
        }
        if let Some(s) = &req.session_id {
            headers.push((crate::ingress::SESSION_HEADER.to_owned(), s.clone()));
        }
        let msg = ForwardRequest {
            request_id: req.request_id,
            hops: req.hops.saturating_add(1),
            origin: req.origin.clone(),
            endpoint: req.endpoint,
            chain: req.chain.clone(),
            body: req.body.to_vec(),
            headers,
        };
        write_frame(&mut send, &msg).await?;
        let head: ForwardResponseHead = read_frame(&mut recv, MAX_RESPONSE_HEAD).await?;
        Ok::<_, NodeError>((send, recv, head))
    };
    let (send, recv, head) = tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| NodeError::Cluster(format!("peer {peer} sent no response head in time")))??;
    if head.status == 502 || head.status == 503 {
        // The peer could not serve after all (its engine failed or it is overloaded):
        // nothing reached the client yet, so the caller may still serve locally.
        return Err(NodeError::Cluster(format!(
            "peer {peer} answered {}",
            head.status
        )));
    }
    let headers = head
        .headers
        .into_iter()
        .filter(|(k, _)| PASS_RESPONSE_HEADERS.contains(&k.to_ascii_lowercase().as_str()))
        .collect();
    Ok(Upstream {
        status: head.status,
        headers,
        served_by: head.served_by.0,
        hops: head.hops,
        body: chunk_stream(recv, send),
    })
}

/// Turn a peer's chunk frames into a body stream. `keep` (the send half) lives as long
/// as the stream so the peer does not see us go away before we do.
fn chunk_stream<K: Send + 'static>(recv: ForwardRecv, keep: K) -> BodyStream {
    Box::pin(futures::stream::unfold(
        Some((recv, keep)),
        |st| async move {
            let (mut recv, keep) = st?;
            let mut len = [0u8; 4];
            if let Err(e) = recv.read_exact(&mut len).await {
                return Some((Err(format!("peer stream ended early: {e}")), None));
            }
            match u32::from_be_bytes(len) {
                END_OK => None,
                END_ERR => Some((Err("serving node failed mid-response".to_owned()), None)),
                n if n as usize > MAX_CHUNK_BYTES => {
                    Some((Err(format!("peer chunk of {n} bytes over limit")), None))
                }
                n => {
                    let mut buf = vec![0u8; n as usize];
                    match recv.read_exact(&mut buf).await {
                        Ok(_) => Some((Ok(Bytes::from(buf)), Some((recv, keep)))),
                        Err(e) => Some((Err(format!("peer stream ended early: {e}")), None)),
                    }
                }
            }
        },
    ))
}

/// Serve a forward a peer opened to us: read the request, route it (under the hop
/// guard), write the head and relay the bytes as chunk frames.
pub async fn handle_incoming(state: Arc<NodeState>, incoming: IncomingForward) {
    let IncomingForward {
        from,
        mut send,
        mut recv,
    } = incoming;
    state.metrics.forwards_received.inc();
    let limit = (state.config.limits.max_body_bytes + crate::forward::REQUEST_OVERHEAD_BYTES)
        .min(crate::forward::MAX_FORWARD_HEAD.max(state.config.limits.max_body_bytes));
    let msg: ForwardRequest = match read_frame(&mut recv, limit).await {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(%from, error = %e, "bad forward request");
            return;
        }
    };
    let Some(_permit) = state.forward_permits.clone().try_acquire_owned().ok() else {
        let _ = write_error_head(&mut send, &state, 503, msg.hops, "node overloaded").await;
        return;
    };
    if msg.chain.hashes.len() != msg.chain.block_tokens.len() {
        let _ = write_error_head(&mut send, &state, 400, msg.hops, "malformed forward").await;
        return;
    }
    let header = |name: &str| {
        msg.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    };
    let policy =
        header(crate::ingress::POLICY_HEADER).and_then(|p| crate::route::parse_policy(&p).ok());
    let session_id = header(crate::ingress::SESSION_HEADER);
    let req = RoutedRequest {
        request_id: state.next_request_id(),
        endpoint: msg.endpoint,
        body: Bytes::from(msg.body),
        headers: msg
            .headers
            .into_iter()
            .filter(|(k, _)| PASS_REQUEST_HEADERS.contains(&k.to_ascii_lowercase().as_str()))
            .collect(),
        session_key: session_id
            .as_deref()
            .map(|s| gorgo_core::hash::hash_bytes(s.as_bytes())),
        session_id,
        chain: msg.chain,
        hops: msg.hops,
        policy,
        origin: msg.origin,
        weights: state.tuning.weights(),
    };
    tracing::debug!(%from, request_id = req.request_id, hops = req.hops, "forward received");
    // The origin keeps its half open until the response ends; reading EOF (or an error)
    // from it means the client went away, which cancels the work here.
    let origin_gone = async move {
        let mut probe = [0u8; 1];
        let _ = recv.read(&mut probe).await;
    };
    tokio::pin!(origin_gone);
    let served = tokio::select! {
        served = serve(&state, req.clone()) => served,
        _ = &mut origin_gone => {
            tracing::debug!(request_id = req.request_id, "origin went away before the response");
            return;
        }
    };
    let up = match served {
        Ok(up) => up,
        Err(e) => {
            let (status, m) = match e {
                ServeError::Unavailable(m) => (503, m),
                ServeError::Failed(m) => (502, m),
                ServeError::Timeout(m) => (504, m),
            };
            let _ = write_error_head(&mut send, &state, status, req.hops, &m).await;
            return;
        }
    };
    let head = ForwardResponseHead {
        status: up.status,
        headers: up.headers,
        served_by: NodeId(up.served_by),
        hops: up.hops,
    };
    if write_frame(&mut send, &head).await.is_err() {
        return;
    }
    let mut body = up.body;
    loop {
        let chunk = tokio::select! {
            chunk = body.next() => match chunk {
                Some(chunk) => chunk,
                None => break,
            },
            _ = &mut origin_gone => {
                tracing::debug!(request_id = req.request_id, "origin went away mid-response");
                return;
            }
        };
        let res = match chunk {
            Ok(bytes) if bytes.is_empty() => continue,
            Ok(bytes) => {
                let mut ok = Ok(());
                for piece in bytes.chunks(MAX_CHUNK_BYTES) {
                    ok = write_chunk(&mut send, piece).await;
                    if ok.is_err() {
                        break;
                    }
                }
                ok
            }
            Err(e) => {
                tracing::warn!(request_id = req.request_id, error = %e, "engine failed mid-stream");
                let _ = send.write_all(&END_ERR.to_be_bytes()).await;
                let _ = send.shutdown().await;
                return;
            }
        };
        if res.is_err() {
            // The origin went away (client disconnect): dropping the body cancels the
            // engine request.
            return;
        }
    }
    let _ = send.write_all(&END_OK.to_be_bytes()).await;
    let _ = send.shutdown().await;
}

async fn write_chunk(send: &mut crate::peers::ForwardSend, bytes: &[u8]) -> std::io::Result<()> {
    send.write_all(&(bytes.len() as u32).to_be_bytes()).await?;
    send.write_all(bytes).await?;
    send.flush().await
}

async fn write_error_head(
    send: &mut crate::peers::ForwardSend,
    state: &NodeState,
    status: u16,
    hops: u8,
    message: &str,
) -> Result<(), NodeError> {
    let head = ForwardResponseHead {
        status,
        headers: vec![("content-type".into(), "application/json".into())],
        served_by: NodeId(state.config.node.region.clone()),
        hops,
    };
    write_frame(send, &head).await?;
    let body = crate::ingress::error_json(status, message);
    write_chunk(send, body.as_bytes()).await?;
    send.write_all(&END_OK.to_be_bytes()).await?;
    send.shutdown().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::find_cached_tokens;

    #[test]
    fn finds_cached_tokens_in_usage() {
        let chunk = br#"data: {"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens": 64}}}"#;
        assert_eq!(find_cached_tokens(chunk), Some(64));
        assert_eq!(find_cached_tokens(br#"{"cached_tokens":null}"#), None);
        assert_eq!(find_cached_tokens(b"data: [DONE]"), None);
        assert_eq!(
            find_cached_tokens(br#"{"cached_tokens":99999999999999999999999}"#),
            None
        );
    }
}
