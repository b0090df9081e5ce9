//! The forward protocol on one bidirectional stream between two nodes.
//!
//! Request: a length-prefixed (u32, big endian) bincode [`ForwardRequest`] holding the
//! client's body. Response: a length-prefixed [`ForwardResponseHead`], then the
//! engine's response bytes in chunk frames (u32 big-endian length, at most
//! [`MAX_CHUNK_BYTES`], then the bytes), ended by a 0 length (clean end) or `u32::MAX`
//! (the serving side failed mid-response). A stream that ends without either marker
//! (reset, error) after the head is a mid-response failure too. A 502 head with
//! [`ENGINE_ANSWER_HEADER`] is the serving node's engine answering a server error of its
//! own: the engine's body follows (at most [`ENGINE_ANSWER_MAX_BYTES`]), which the
//! origin reads whole before it decides where the request goes next.
//!
//! Both ends live here: [`forward`] is the client (the origin relays a request to the
//! peer `serve` chose), [`handle_incoming`] the server (a peer relays one to us).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::StreamExt;
use gorgo_core::NodeId;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::api::{
    error_json, session_key, BodyStream, EngineAnswer, RoutedRequest, ServeError, Upstream,
    ENGINE_ANSWER_HEADER, ENGINE_ANSWER_MAX_BYTES, LONGEST_PROMPT_HEADER, PASS_REQUEST_HEADERS,
    PASS_RESPONSE_HEADERS, POLICY_HEADER, SESSION_HEADER,
};
use crate::error::NodeError;
use crate::peers::{ForwardRecv, ForwardSend, IncomingForward};
use crate::stream_usage::StreamUsage;
use crate::{telemetry, NodeState};
use tracing::Instrument as _;

pub use gorgo_core::wire::{ForwardRequest, ForwardResponseHead, MAX_RESPONSE_HEAD};

/// Write one length-prefixed frame.
pub async fn write_frame<W: AsyncWrite + Unpin + ?Sized, T: Serialize>(
    w: &mut W,
    msg: &T,
) -> Result<(), NodeError> {
    let bytes =
        gorgo_core::wire::try_encode(msg).map_err(|e| NodeError::Protocol(e.to_string()))?;
    let len =
        u32::try_from(bytes.len()).map_err(|_| NodeError::Protocol("frame too large".into()))?;
    w.write_all(&len.to_be_bytes()).await?;
    w.write_all(&bytes).await?;
    w.flush().await?;
    Ok(())
}

/// Read one length-prefixed frame of at most `limit` bytes.
pub async fn read_frame<R: AsyncRead + Unpin + ?Sized, T: DeserializeOwned>(
    r: &mut R,
    limit: usize,
) -> Result<T, NodeError> {
    read_leased_frame(r, limit, None).await
}

/// [`read_frame`], the frame's announced length first taken from `lease` (a request
/// a peer sends: it counts in the node's budget of bodies being read) before its bytes
/// are read and buffered.
async fn read_leased_frame<R: AsyncRead + Unpin + ?Sized, T: DeserializeOwned>(
    r: &mut R,
    limit: usize,
    lease: Option<&mut crate::budget::BodyLease>,
) -> Result<T, NodeError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > limit {
        return Err(NodeError::Protocol(format!(
            "frame of {len} bytes over limit {limit}"
        )));
    }
    if let Some(lease) = lease {
        lease.cover(len).map_err(|_| NodeError::BodyBudget)?;
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf).await?;
    gorgo_core::wire::decode(&buf, limit).map_err(|e| NodeError::Protocol(e.to_string()))
}

/// Largest chunk a peer may send in one response frame.
pub const MAX_CHUNK_BYTES: usize = 16 * 1024 * 1024;
/// Chunk-length marker: the response ended cleanly.
const END_OK: u32 = 0;
/// Chunk-length marker: the serving side failed mid-response.
const END_ERR: u32 = u32::MAX;

/// Forward to a peer and wait for its response head. Any error here happened before
/// the first byte, so the caller may serve locally instead.
///
/// The whole forward races the peer's death in membership
/// ([`crate::peers::PeerSource::peer_gone`]): a killed peer's stream never ends by
/// itself (nothing closes it until the QUIC idle timeout or the first-byte timeout),
/// so the moment membership declares the peer dead, a forward still waiting for its
/// head fails with [`NodeError::PeerGone`] (`serve` falls back to serving it here),
/// and a response already relaying ends with an error (the ingress sends the client an
/// SSE error event).
///
/// `offer` is what serving the request here would cost; the peer may refuse the
/// forward against it ([`NodeError::Refused`]).
pub async fn forward(
    state: &Arc<NodeState>,
    peer: &NodeId,
    req: &RoutedRequest,
    offer: Option<gorgo_core::decision::ForwardOffer>,
) -> Result<Upstream, NodeError> {
    // The peer's head comes with its engine's: at the first token, or with the whole
    // answer when it is not streamed.
    let timeout = state
        .config
        .limits
        .head_timeout(req.stream_usage.is_streamed());
    // Taken before opening: a death while the stream opens counts too.
    let mut gone = state.peers.peer_gone(peer);
    let span = telemetry::forward_span(&state.id, peer, req.hops.saturating_add(1));
    let fut = async {
        let (mut send, mut recv) = state.peers.open_forward(peer).await?;
        let mut headers = req.headers.clone();
        if let Some(p) = req.policy {
            headers.push((POLICY_HEADER.to_owned(), p.as_str().to_owned()));
        }
        if let Some(s) = &req.session_id {
            headers.push((SESSION_HEADER.to_owned(), s.clone()));
        }
        headers.push((
            LONGEST_PROMPT_HEADER.to_owned(),
            req.longest_prompt_tokens.to_string(),
        ));
        // The peer's spans join this trace as children of this forward.
        headers.extend(telemetry::trace_headers(&span));
        let msg = ForwardRequest {
            // The id at the origin, as the origin's name travels: a node in between
            // passes on the one it received, so every node's record names the request
            // by the same number.
            request_id: req.origin_request_id.unwrap_or(req.request_id),
            hops: req.hops.saturating_add(1),
            origin: req.origin.clone(),
            via: req.via.iter().chain([&state.id]).cloned().collect(),
            endpoint: req.endpoint,
            chain: req.chain.clone(),
            body: req.body.to_vec(),
            headers,
            model: req.model.clone(),
            offer,
        };
        write_frame(&mut send, &msg).await?;
        let head: ForwardResponseHead = read_frame(&mut recv, MAX_RESPONSE_HEAD).await?;
        // The peer's engine answered for the request: its answer follows the head at
        // once, and is read under the same deadline and watch on the peer's death.
        let answer = if matches!(head.status, 502..=504) {
            read_engine_answer(&mut recv, &head).await
        } else {
            None
        };
        Ok::<_, NodeError>((send, recv, head, answer))
    };
    let (send, recv, head, answer) = tokio::select! {
        biased;
        _ = &mut gone => return Err(NodeError::PeerGone(peer.clone())),
        head = tokio::time::timeout(timeout, fut).instrument(span.clone()) => head.map_err(|_| {
            NodeError::HeadTimeout(format!("peer {peer} sent no response head in time"))
        })??,
    };
    if let Some(refusal) = head.refusal {
        return Err(NodeError::Refused {
            peer: peer.clone(),
            refusal,
        });
    }
    if let Some(answer) = answer {
        // Its engine answered a server error, and the peer had nowhere else to go:
        // nothing reached the client yet, so the caller may still serve it elsewhere,
        // and holds the answer for a client with nowhere else to go.
        return Err(NodeError::EngineAnswered {
            peer: peer.clone(),
            answer,
        });
    }
    if matches!(head.status, 502..=504) {
        // The peer could not serve after all (its engine failed, timed out or it is
        // overloaded): nothing reached the client yet, so the caller may still serve
        // locally.
        let message = format!("peer {peer} answered {}", head.status);
        return Err(if head.status == 504 {
            NodeError::HeadTimeout(message)
        } else {
            NodeError::Cluster(message)
        });
    }
    let headers = passed_headers(head.headers);
    let served_by_label = region_label(state, peer, &head.served_by.0);
    Ok(Upstream {
        status: head.status,
        headers,
        served_by: head.served_by.0,
        served_by_label,
        hops: head.hops,
        // The forward's span stays open while its response relays.
        body: chunk_stream(recv, (send, span), gone, peer.clone()),
        chosen_terms: None,
    })
}

/// The headers of a peer's response head that travel to the client
/// ([`PASS_RESPONSE_HEADERS`]): not the forward protocol's own.
fn passed_headers(headers: Vec<(String, String)>) -> Vec<(String, String)> {
    headers
        .into_iter()
        .filter(|(k, _)| PASS_RESPONSE_HEADERS.contains(&k.to_ascii_lowercase().as_str()))
        .collect()
}

/// The engine answer a peer's 502 `head` says follows it ([`ENGINE_ANSWER_HEADER`]):
/// its status, passed headers and body, read whole (at most
/// [`ENGINE_ANSWER_MAX_BYTES`], as the peer held it). `None` when none follows (the
/// peer's own failure) or what follows is no answer to hold: a status that is no server
/// error, a body over the cap, a stream that broke. The head is then the plain 502 it
/// is to a node of the last build.
async fn read_engine_answer(
    recv: &mut ForwardRecv,
    head: &ForwardResponseHead,
) -> Option<EngineAnswer> {
    let status = head
        .headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(ENGINE_ANSWER_HEADER))?
        .1
        .trim()
        .parse::<u16>()
        .ok()
        .filter(|s| (500..=599).contains(s))?;
    let mut body = Vec::new();
    while let Some(chunk) = read_chunk(recv, ENGINE_ANSWER_MAX_BYTES - body.len())
        .await
        .ok()?
    {
        body.extend_from_slice(&chunk);
    }
    Some(EngineAnswer {
        status,
        headers: passed_headers(head.headers.clone()),
        body: body.into(),
    })
}

/// The `served_by` label of the request metric for a response `peer` relayed that
/// says `claimed` served it: `claimed` when membership knows it as a region (this
/// node's or a live or recent peer's: with `max_hops` above 1 a forward may be served
/// further on), else the region membership gives for `peer`, else
/// [`UNKNOWN_REGION`]. The label set stays within the regions membership knows,
/// whatever a peer writes in its head.
fn region_label(state: &NodeState, peer: &NodeId, claimed: &str) -> String {
    let peers = state.peers.peers();
    let known = claimed == state.config.node.region
        || peers.iter().any(|p| p.region.as_deref() == Some(claimed));
    if known {
        return claimed.to_owned();
    }
    peers
        .iter()
        .find(|p| p.id == *peer)
        .and_then(|p| p.region.clone())
        .unwrap_or_else(|| UNKNOWN_REGION.to_owned())
}

/// The `served_by` label of a forward answered by a peer membership no longer knows
/// the region of, and that claimed one it does not know either.
pub const UNKNOWN_REGION: &str = "unknown";

/// Turn a peer's chunk frames into a body stream that ends with an error once `gone`
/// (the peer's death in membership) resolves. `keep` (the send half) lives as long as
/// the stream so the peer does not see us go away before we do.
fn chunk_stream<K: Send + 'static>(
    recv: ForwardRecv,
    keep: K,
    gone: BoxFuture<'static, ()>,
    peer: NodeId,
) -> BodyStream {
    Box::pin(futures::stream::unfold(
        Some((recv, keep, gone)),
        move |st| {
            let peer = peer.clone();
            async move {
                let (mut recv, keep, mut gone) = st?;
                tokio::select! {
                    biased;
                    _ = &mut gone => Some((
                        Err(format!("peer {peer} declared dead mid-response")),
                        None,
                    )),
                    chunk = read_chunk(&mut recv, MAX_CHUNK_BYTES) => match chunk {
                        Ok(Some(bytes)) => Some((Ok(bytes), Some((recv, keep, gone)))),
                        Ok(None) => None,
                        Err(e) => Some((Err(e), None)),
                    },
                }
            }
        },
    ))
}

/// One chunk frame of a forwarded response, of at most `limit` bytes (checked before
/// they are read): its bytes, `None` at a clean end, or why the stream broke.
async fn read_chunk(recv: &mut ForwardRecv, limit: usize) -> Result<Option<Bytes>, String> {
    let mut len = [0u8; 4];
    recv.read_exact(&mut len)
        .await
        .map_err(|e| format!("peer stream ended early: {e}"))?;
    match u32::from_be_bytes(len) {
        END_OK => Ok(None),
        END_ERR => Err("serving node failed mid-response".to_owned()),
        n if n as usize > limit => Err(format!("peer chunk of {n} bytes over limit {limit}")),
        n => {
            let mut buf = vec![0u8; n as usize];
            recv.read_exact(&mut buf)
                .await
                .map_err(|e| format!("peer stream ended early: {e}"))?;
            Ok(Some(Bytes::from(buf)))
        }
    }
}

/// Serve a forward a peer opened to us: read the request, route it with `serve` (the
/// node's decision, `crate::serve::serve`, handed in so this module does not import
/// the module that imports it), write the head and relay the bytes as chunk frames.
pub async fn handle_incoming<F, Fut>(state: Arc<NodeState>, incoming: IncomingForward, serve: F)
where
    F: FnOnce(Arc<NodeState>, RoutedRequest) -> Fut,
    Fut: Future<Output = Result<Upstream, ServeError>>,
{
    let IncomingForward {
        from,
        mut send,
        mut recv,
    } = incoming;
    state.metrics.forwards_received.inc();
    // The request holds a client body this node would accept itself, plus its chain
    // and headers; a peer has as long to send it as a client has to send a body.
    let limit = state.config.limits.max_body_bytes + crate::config::FORWARD_OVERHEAD_BYTES;
    let wait = Duration::from_millis(state.config.limits.body_timeout_ms);
    let mut lease = state.body_budget.lease();
    let read = read_leased_frame(&mut recv, limit, Some(&mut lease));
    let msg: ForwardRequest = match tokio::time::timeout(wait, read).await {
        Ok(Ok(m)) => m,
        Ok(Err(NodeError::BodyBudget)) => {
            drop(lease);
            // 503: the origin serves the request itself or elsewhere.
            let message = NodeError::BodyBudget.to_string();
            let _ = write_error_head(&mut send, &state, 503, 0, &error_json(503, &message)).await;
            return;
        }
        Ok(Err(e)) => {
            // What the announced length took of the budget goes back before the error
            // head waits on the origin.
            drop(lease);
            tracing::warn!(%from, error = %e, "bad forward request");
            let message = format!("bad forward request: {e}");
            // 502: the origin serves the request itself (nothing reached its client).
            let _ = write_error_head(&mut send, &state, 502, 0, &error_json(502, &message)).await;
            return;
        }
        Err(_) => {
            drop(lease);
            tracing::warn!(%from, "forward request not sent in time");
            let message = "forward request not sent within limits.body_timeout_ms";
            let _ = write_error_head(&mut send, &state, 502, 0, &error_json(502, message)).await;
            return;
        }
    };
    // Read: from here the request is held under the forward slots, like a client's.
    drop(lease);
    let permit = state.forward_permits.clone().try_acquire_owned().ok();
    let refused = match &permit {
        None => Some((503, "node overloaded")),
        Some(_) => unservable(&msg, &state.id),
    };
    if let Some((status, message)) = refused {
        let body = error_json(status, message);
        let _ = write_error_head(&mut send, &state, status, msg.hops, &body).await;
        return;
    }
    let header = |name: &str| {
        msg.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    };
    let span = telemetry::forwarded_span(&state.id, &from, msg.hops, &msg.headers);
    let policy = header(POLICY_HEADER).and_then(|p| crate::route::parse_policy(&p).ok());
    let session_id = header(SESSION_HEADER);
    // The client's wish about usage travels in its body, unchanged by the origin: read
    // here, where the request may be served (the only parse of it on this node).
    let stream_usage = StreamUsage::of_body(msg.endpoint, &msg.body);
    // The origin's count of the longest prompt, never more than the whole chain; from
    // an origin that does not send it, the whole chain, as that origin checked it.
    let total = msg.chain.total_tokens();
    let longest_prompt_tokens = header(LONGEST_PROMPT_HEADER)
        .and_then(|n| n.parse::<u64>().ok())
        .map_or(total, |n| n.min(total));
    let req = RoutedRequest {
        request_id: state.next_request_id(),
        endpoint: msg.endpoint,
        body: Bytes::from(msg.body),
        stream_usage,
        headers: msg
            .headers
            .into_iter()
            .filter(|(k, _)| PASS_REQUEST_HEADERS.contains(&k.to_ascii_lowercase().as_str()))
            .collect(),
        session_key: session_id.as_deref().map(session_key),
        session_id,
        longest_prompt_tokens,
        chain: msg.chain,
        canonical: None,
        // The path it took, whatever the count it came with says: a peer that sent
        // `hops: 0` with a `via` of one let the request travel up to `MAX_HOPS`
        // whatever `max_hops` allows (the guard reads `hops`).
        hops: msg.hops.max(u8::try_from(msg.via.len()).unwrap_or(u8::MAX)),
        via: msg.via,
        policy,
        origin: msg.origin,
        origin_request_id: Some(msg.request_id),
        model: msg.model,
        weights: state.tuning.weights(),
        offer: msg
            .offer
            .and_then(|o| gorgo_core::decision::ForwardOffer::new(o.cost_ms, o.weights, o.policy)),
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
        served = serve(state.clone(), req.clone()).instrument(span.clone()) => served,
        _ = &mut origin_gone => {
            tracing::debug!(request_id = req.request_id, "origin went away before the response");
            return;
        }
    };
    let up = match served {
        Ok(up) => up,
        Err(ServeError::Refused(refusal)) => {
            let head = ForwardResponseHead {
                status: 503,
                headers: Vec::new(),
                served_by: NodeId(state.config.node.region.clone()),
                hops: req.hops,
                refusal: Some(refusal),
            };
            let write = async {
                write_frame(&mut send, &head).await?;
                end_stream(&mut send, END_OK).await?;
                Ok::<_, NodeError>(())
            };
            let _ = bounded(&state, write).await;
            return;
        }
        Err(ServeError::EngineAnswered(answer)) => {
            // A 502, as the request path takes it: the origin serves it elsewhere where
            // it can. The engine's answer follows, for a client with nowhere else to go
            // (read by `read_engine_answer`; a node of the last build reads the 502).
            let mut headers = answer.headers;
            headers.push((ENGINE_ANSWER_HEADER.to_owned(), answer.status.to_string()));
            let _ = write_whole_head(&mut send, &state, 502, req.hops, headers, &answer.body).await;
            return;
        }
        Err(e @ (ServeError::ContextLength { .. } | ServeError::ModelNotFound(_))) => {
            // What this region cannot hold, its origin can: it checked the prompt
            // against its own engines' context before routing, and forwarded for a model
            // it was told this region serves. 502: the origin serves it itself or routes
            // it again without this node (a 400 or 404 passed on to its client refused a
            // request the cluster could serve).
            let message = format!(
                "region {} cannot serve this forward: {}",
                state.config.node.region,
                e.message()
            );
            let _ = write_error_head(&mut send, &state, 502, req.hops, &error_json(502, &message))
                .await;
            return;
        }
        // 502, 503 or 504: the origin serves it itself or routes it again.
        Err(e) => {
            let status = e.status().0.as_u16();
            let body = error_json(status, &e.message());
            let _ = write_error_head(&mut send, &state, status, req.hops, &body).await;
            return;
        }
    };
    let head = ForwardResponseHead {
        status: up.status,
        headers: up.headers,
        served_by: NodeId(up.served_by),
        hops: up.hops,
        refusal: None,
    };
    let mut body = up.body;
    tokio::select! {
        res = bounded(&state, write_frame(&mut send, &head)) => if res.is_err() {
            return;
        },
        // Dropping the body cancels the engine request.
        _ = &mut origin_gone => return,
    }
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
                // A write waits for the origin's flow-control credit: an origin gone, or
                // one that stops reading for as long as a client may take to send a
                // body, ends the relay (and, dropping the body, the engine request).
                let write = async {
                    for piece in bytes.chunks(MAX_CHUNK_BYTES) {
                        write_chunk(&mut send, piece).await?;
                    }
                    Ok::<_, std::io::Error>(())
                };
                tokio::select! {
                    res = bounded(&state, write) => res,
                    _ = &mut origin_gone => Err(NodeError::Io(std::io::ErrorKind::BrokenPipe.into())),
                }
            }
            Err(e) => {
                tracing::warn!(request_id = req.request_id, error = %e, "engine failed mid-stream");
                let _ = bounded(&state, end_stream(&mut send, END_ERR)).await;
                return;
            }
        };
        if res.is_err() {
            // The origin went away (client disconnect): dropping the body cancels the
            // engine request.
            return;
        }
    }
    let _ = bounded(&state, end_stream(&mut send, END_OK)).await;
}

/// A write to the origin, which waits for the flow-control credit only the origin
/// grants: bounded by `limits.body_timeout_ms` (as long as a client may take to send a
/// body), so an origin that stops reading cannot hold this node's forward slot, engine
/// request or body budget for ever.
async fn bounded<F, E>(state: &NodeState, write: F) -> Result<(), NodeError>
where
    F: Future<Output = Result<(), E>>,
    NodeError: From<E>,
{
    let wait = Duration::from_millis(state.config.limits.body_timeout_ms);
    match tokio::time::timeout(wait, write).await {
        Ok(res) => res.map_err(NodeError::from),
        Err(_) => Err(NodeError::Io(std::io::ErrorKind::TimedOut.into())),
    }
}

/// The end marker (`END_OK` or `END_ERR`) and the stream's close.
async fn end_stream(send: &mut ForwardSend, marker: u32) -> std::io::Result<()> {
    send.write_all(&marker.to_be_bytes()).await?;
    send.shutdown().await
}

async fn write_chunk(send: &mut ForwardSend, bytes: &[u8]) -> std::io::Result<()> {
    send.write_all(&(bytes.len() as u32).to_be_bytes()).await?;
    send.write_all(bytes).await?;
    send.flush().await
}

/// A head with this node's own error, its OpenAI error `body` (JSON) and the end.
async fn write_error_head(
    send: &mut ForwardSend,
    state: &NodeState,
    status: u16,
    hops: u8,
    body: &str,
) -> Result<(), NodeError> {
    let headers = vec![("content-type".into(), "application/json".into())];
    write_whole_head(send, state, status, hops, headers, body.as_bytes()).await
}

/// A head with `status` and `headers`, then the whole `body` (no chunk when it is
/// empty: a chunk of 0 bytes is the end marker) and the clean end.
async fn write_whole_head(
    send: &mut ForwardSend,
    state: &NodeState,
    status: u16,
    hops: u8,
    headers: Vec<(String, String)>,
    body: &[u8],
) -> Result<(), NodeError> {
    let head = ForwardResponseHead {
        status,
        headers,
        served_by: NodeId(state.config.node.region.clone()),
        hops,
        refusal: None,
    };
    bounded(state, async {
        write_frame(send, &head).await?;
        for piece in body.chunks(MAX_CHUNK_BYTES) {
            write_chunk(send, piece).await?;
        }
        end_stream(send, END_OK).await?;
        Ok::<_, NodeError>(())
    })
    .await
}

/// Why a forward that was read whole cannot be served here, as the status and message
/// of its error head; `None` when it can.
fn unservable(msg: &ForwardRequest, me: &NodeId) -> Option<(u16, &'static str)> {
    if msg.via.len() > usize::from(gorgo_core::wire::MAX_HOPS) || msg.via.contains(me) {
        // A path longer than any guard allows, or one through this node: a peer that
        // sent it back. 502: its origin serves the request itself (its client did
        // nothing wrong).
        Some((
            502,
            "forward came back to a node it had left, or took too many hops",
        ))
    } else if msg.chain.hashes.len() != msg.chain.block_tokens.len() {
        Some((400, "malformed forward"))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gorgo_core::{HashChain, NodeId};

    fn sample() -> ForwardRequest {
        ForwardRequest {
            request_id: 7,
            hops: 1,
            origin: NodeId::from("a"),
            via: vec![NodeId::from("a")],
            endpoint: gorgo_core::Endpoint::Completions,
            chain: HashChain::from_bytes(b"hello world", 4, 4),
            body: br#"{"prompt":"hello world"}"#.to_vec(),
            headers: vec![("content-type".into(), "application/json".into())],
            model: None,
            offer: gorgo_core::decision::ForwardOffer::new(
                12.5,
                gorgo_core::Weights::default(),
                gorgo_core::policy::PolicyKind::Gorgo,
            ),
        }
    }

    #[tokio::test]
    async fn frames_round_trip() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        write_frame(&mut a, &sample()).await.unwrap();
        let got: ForwardRequest = read_frame(&mut b, 1 << 16).await.unwrap();
        assert_eq!(got, sample());
    }

    #[tokio::test]
    async fn oversized_frame_is_rejected_before_reading() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        a.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
        let err = read_frame::<_, ForwardRequest>(&mut b, 1024)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("over limit"), "{err}");
    }

    /// A peer's 502 head with `headers`, then `body` in chunk frames of `chunk` bytes
    /// and the clean end, as the origin reads it.
    async fn answer_behind(
        headers: Vec<(String, String)>,
        body: &[u8],
        chunk: usize,
    ) -> Option<EngineAnswer> {
        let head = ForwardResponseHead {
            status: 502,
            headers,
            served_by: NodeId::from("b"),
            hops: 1,
            refusal: None,
        };
        let (a, b) = tokio::io::duplex(1 << 20);
        let mut send: ForwardSend = Box::pin(a);
        let mut recv: ForwardRecv = Box::pin(b);
        for piece in body.chunks(chunk) {
            write_chunk(&mut send, piece).await.unwrap();
        }
        end_stream(&mut send, END_OK).await.unwrap();
        read_engine_answer(&mut recv, &head).await
    }

    fn answer_headers(status: &str) -> Vec<(String, String)> {
        vec![
            ("content-type".into(), "application/json".into()),
            (ENGINE_ANSWER_HEADER.into(), status.into()),
        ]
    }

    /// The engine's answer behind a 502 head is read whole, in however many chunks,
    /// with the passed headers only; up to the cap the serving node held it to, and
    /// only for a server error's status: anything else leaves the plain 502.
    #[tokio::test]
    async fn an_engine_answer_is_read_whole_within_its_cap() {
        let body = vec![b'x'; ENGINE_ANSWER_MAX_BYTES];
        let answer = answer_behind(answer_headers("500"), &body, 1000)
            .await
            .unwrap();
        assert_eq!(answer.status, 500);
        assert_eq!(answer.body.len(), ENGINE_ANSWER_MAX_BYTES);
        assert_eq!(
            answer.headers,
            vec![("content-type".to_owned(), "application/json".to_owned())]
        );
        let over = vec![b'x'; ENGINE_ANSWER_MAX_BYTES + 1];
        let over = answer_behind(answer_headers("500"), &over, 1000).await;
        assert!(over.is_none(), "an answer over the cap was held");
        for status in ["200", "404", "600", "x"] {
            assert_eq!(answer_behind(answer_headers(status), b"{}", 2).await, None);
        }
        let plain = vec![("content-type".into(), "application/json".into())];
        assert_eq!(answer_behind(plain, b"{}", 2).await, None);
    }

    #[tokio::test]
    async fn garbage_frame_is_an_error() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        a.write_all(&8u32.to_be_bytes()).await.unwrap();
        a.write_all(&[0xff; 8]).await.unwrap();
        assert!(read_frame::<_, ForwardRequest>(&mut b, 1024).await.is_err());
    }
}
