//! The request path shared by the HTTP ingress and incoming forwards: decide, then
//! dispatch: serve on the local engine or relay through a peer (the forward client in
//! `forward`), falling back to local when a forward fails before its first byte.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures::StreamExt;
use gorgo_core::candidates::{build_candidates, LocalState, PeerState};
use gorgo_core::cost::{Candidate, CostTerms};
use gorgo_core::decision::{ForwardOffer, ForwardOrigin};
use gorgo_core::health::RequestOutcome;
use gorgo_core::NodeId;

use crate::api::{
    BodyStream, EngineAnswer, RoutedRequest, ServeError, Upstream, PASS_RESPONSE_HEADERS,
    PREDICTED_TTFT_HEADER,
};
use crate::config::UnlistedModel;
use crate::engine::{EngineTicket, FirstToken};
use crate::error::NodeError;
use crate::forward::forward;
use crate::metrics::EngineFailureKind;
use crate::route::{DecisionInput, Target};
use crate::stream_usage::UsageStripped;
use crate::{telemetry, NodeState};
use tracing::Instrument as _;

/// The engine's response headers that travel to the client ([`PASS_RESPONSE_HEADERS`]),
/// on the routed and the unrouted routes alike.
pub(crate) fn pass_headers(headers: &reqwest::header::HeaderMap) -> Vec<(String, String)> {
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

/// What a retry of a request leaves out: the local engines that failed it before its
/// first byte, or every local engine (the node is too full to serve it itself), and the
/// peers whose forward failed before its first byte (routing again would mostly pick
/// the same peer, which has not been declared dead yet), and the nodes the request has
/// left (`RoutedRequest::via`).
#[derive(Debug, Clone, Default)]
struct Excluded {
    all_local: bool,
    replicas: Vec<u16>,
    peers: Vec<NodeId>,
    /// A peer refused this request already: a forward after that goes with no offer,
    /// so that the request is refused at most once (docs/policy.md, "Refusal at the
    /// target"). Before, a local engine that failed it after a refusal sent it back to
    /// the same peer with another offer, to be refused again (up to three times).
    refused: bool,
    /// Local engines that answered it with a 5xx other than a gateway failure: not
    /// counted against their breakers then (it may be the request's fault,
    /// [`crate::engine::EngineAdapter::is_gateway_failure`]), but once another engine
    /// or a peer serves it, it was theirs, and it counts ([`Excluded::served`]).
    answered_5xx: Vec<u16>,
}

impl Excluded {
    /// Nothing failed yet; the nodes `req` has left are out from the start when it may
    /// still be forwarded (a forward never goes back to one). At `max_hops` it is
    /// served here whatever the peers cost, and they stay candidates: the refusal
    /// check and the decision log price it as the simulator does (which keeps a path
    /// only where the next node may forward again).
    fn leaving_out_path(req: &RoutedRequest, all_local: bool, max_hops: u8) -> Self {
        Excluded {
            all_local,
            refused: false,
            answered_5xx: Vec::new(),
            replicas: Vec::new(),
            peers: if req.hops < max_hops {
                req.via.clone()
            } else {
                Vec::new()
            },
        }
    }

    fn local(&self, replica: u16) -> bool {
        self.all_local || self.replicas.contains(&replica)
    }

    /// How much was left out: a retry is worth it only when this grew.
    fn len(&self) -> usize {
        self.replicas.len() + self.peers.len()
    }

    /// The request was served (a 2xx head) after local engines answered it with a
    /// 5xx that is no gateway failure: the request was not at fault, those engines
    /// were, and their breakers count it. One bad request that every engine answers
    /// 500 (llama-cpp-python's answer to a body it cannot parse) counts nowhere.
    fn served(&mut self, state: &NodeState, status: u16) {
        if !(200..300).contains(&status) {
            return;
        }
        for replica in self.answered_5xx.drain(..) {
            if let Some(engine) = state.engine(replica) {
                engine.adapter.record(RequestOutcome::Failed);
            }
        }
    }
}

/// The candidates of a decision, built by the core ([`build_candidates`]) from this
/// node's view of each of its engines, their shadow indexes, the peer table (every
/// engine of every peer) and the forward ledger. An engine in `excluded`, draining or
/// not healthy is a candidate that cannot serve. A request that names a model has only
/// the engines serving it as candidates ([`QueueStats::serves`]).
///
/// [`QueueStats::serves`]: gorgo_core::QueueStats::serves
fn candidates(state: &NodeState, req: &RoutedRequest, excluded: &Excluded) -> Vec<Candidate> {
    let chain = &req.chain;
    let model = req.model.as_deref();
    let epoch = state.tuning.epoch();
    let locals: Vec<LocalState> = state
        .engines()
        .iter()
        .map(|e| {
            let stats = e.queue_stats(epoch);
            LocalState {
                node: state.id.clone(),
                healthy: !excluded.local(e.replica)
                    && e.takes_requests()
                    && model.is_none_or(|m| stats.serves(m)),
                cached_tokens: e.shadow.lock().longest_match(chain),
                stats,
            }
        })
        .collect();
    let peers = state.peers.peers();
    let views = peers.iter().flat_map(|p| {
        p.engines.iter().map(move |e| PeerState {
            node: &p.id,
            alive: p.alive,
            // Only an engine serving the request's model; not a peer that failed this
            // request before its first byte (out of its retries, as a dead one would
            // be) nor one the request has left. Those still decide on the others.
            eligible: model.is_none_or(|m| e.stats.serves(m)) && !excluded.peers.contains(&p.id),
            rtt_ms: p.rtt_ms,
            stats: Some(&e.stats),
            stats_age_ms: e.stats_age_ms,
        })
    });
    // The builder locks the ledger only after the summary walks.
    build_candidates(
        locals,
        views,
        |peer, replica| state.peers.matched_tokens(peer, replica, chain),
        || state.router.ledger.lock(),
        state.now_ms(),
    )
}

/// A request for a model that no region serves (neither the local engine nor any
/// live peer lists it; a region whose list is not known counts as serving it) is
/// refused, or with `routing.unlisted_model = "any"` routed as if it named none.
fn check_model(state: &NodeState, mut req: RoutedRequest) -> Result<RoutedRequest, ServeError> {
    let Some(model) = req.model.as_deref() else {
        return Ok(req);
    };
    let served = state.local_stats().iter().any(|s| s.serves(model))
        || state
            .peers
            .peers()
            .iter()
            .filter(|p| p.alive)
            .flat_map(|p| p.engines.iter().map(|e| &e.stats))
            .any(|s| !s.draining && s.serves(model));
    match state.config.routing.unlisted_model {
        _ if served => Ok(req),
        UnlistedModel::Any => {
            req.model = None;
            Ok(req)
        }
        UnlistedModel::Reject => Err(ServeError::ModelNotFound(model.to_owned())),
    }
}

/// Route and serve one request. A prompt longer than the engines' context is refused
/// here, before routing, so it reaches no engine and no cache model. When a local
/// engine fails it before the first byte (a breaker that opened, a timeout, a 5xx
/// head), the request is routed again without that engine: to another local engine
/// or a peer (at most `MAX_ATTEMPTS` (4) tries, whose terms carry the time the
/// earlier ones took).
pub async fn serve(state: &Arc<NodeState>, req: RoutedRequest) -> Result<Upstream, ServeError> {
    let (req, mut excluded) = checked(state, req, false)?;
    serve_excluding(state, &req, &mut excluded, &mut Tries::new()).await
}

/// `req` past the checks every entry point makes (a model some region serves, a
/// prompt the engines can hold), and what it starts out leaving out: the nodes it has
/// left, and with `all_local` this node's engines.
fn checked(
    state: &NodeState,
    req: RoutedRequest,
    all_local: bool,
) -> Result<(RoutedRequest, Excluded), ServeError> {
    let req = check_model(state, req)?;
    check_context(state, &req)?;
    let excluded = Excluded::leaving_out_path(&req, all_local, state.config.routing.max_hops);
    Ok((req, excluded))
}

/// Tries of one request, the first included: each failure before the first byte
/// leaves out the engine that failed it, and a client waits for at most this many.
const MAX_ATTEMPTS: usize = 4;

/// The tries one request has had, however many passes route it ([`serve_draining`]
/// makes two): at most [`MAX_ATTEMPTS`] in all, and the time since the first, which
/// a later try's terms carry (its client has waited that long already).
struct Tries {
    made: usize,
    first: Option<Instant>,
}

impl Tries {
    fn new() -> Self {
        Tries {
            made: 0,
            first: None,
        }
    }

    /// Count a try about to be made: the time lost to the tries before it (0 for the
    /// first), `None` once [`MAX_ATTEMPTS`] are spent.
    fn next(&mut self) -> Option<f64> {
        if self.made >= MAX_ATTEMPTS {
            return None;
        }
        self.made += 1;
        match self.first {
            Some(first) => Some(first.elapsed().as_secs_f64() * 1000.0),
            None => {
                self.first = Some(Instant::now());
                Some(0.0)
            }
        }
    }
}

async fn serve_excluding(
    state: &Arc<NodeState>,
    req: &RoutedRequest,
    excluded: &mut Excluded,
    tries: &mut Tries,
) -> Result<Upstream, ServeError> {
    let mut first_error = None;
    while let Some(lost_ms) = tries.next() {
        let before = excluded.len();
        match route_and_serve(state, req, excluded, lost_ms).await {
            // An engine or a peer failed it: route again without it.
            Err(e) if e.may_fall_back() && excluded.len() > before => {
                first_error.get_or_insert(e);
            }
            // A refusal is the answer a forwarding node asked for, whatever failed
            // before it: the node serves the request itself (a 502 told it this node
            // had failed, and it learned no bias).
            Err(e @ ServeError::Refused(_)) => return Err(e),
            // Nowhere else to go: the first failure says what went wrong.
            Err(e) => return Err(first_error.unwrap_or(e)),
            Ok(up) => {
                excluded.served(state, up.status);
                return Ok(up);
            }
        }
    }
    Err(first_error.unwrap_or_else(|| ServeError::Unavailable("no engine could serve".into())))
}

/// Serve `req` anywhere but on the local engines: the node is too full to take it
/// itself, and a peer with room is better than a 503.
pub async fn serve_elsewhere(
    state: &Arc<NodeState>,
    req: RoutedRequest,
) -> Result<Upstream, ServeError> {
    let (req, mut excluded) = checked(state, req, true)?;
    serve_excluding(state, &req, &mut excluded, &mut Tries::new()).await
}

/// Serve `req` while this node drains: at a peer while one can take it, so the node
/// empties; here when none can, without the peers that failed it (tried again, each
/// could cost another wait for a head that does not come).
pub async fn serve_draining(
    state: &Arc<NodeState>,
    req: RoutedRequest,
) -> Result<Upstream, ServeError> {
    let (req, mut excluded) = checked(state, req, true)?;
    // One budget of tries for both passes: a client waits for at most four.
    let mut tries = Tries::new();
    match serve_excluding(state, &req, &mut excluded, &mut tries).await {
        Err(e) if e.may_fall_back() => {
            excluded.all_local = false;
            serve_excluding(state, &req, &mut excluded, &mut tries).await
        }
        served => served,
    }
}

/// How far over the context an estimated prompt count (no tokenizer) must be before
/// the node refuses it, as a share of the context: within it the engine, which counts
/// exactly, decides (its refusal reaches the client as it gave it). The estimate runs
/// a few percent high or low (8% high before the byte rate's fit, measured against
/// llama.cpp), and refusing a prompt the engine would serve is worse than letting the
/// engine refuse one.
pub const ESTIMATED_CONTEXT_TOLERANCE: f64 = 0.10;

/// Refuse a prompt the engines cannot hold (the smallest context any of them says it
/// has: replicas serve one model, and a request may land on any of them). A completions
/// batch is checked prompt by prompt, as vLLM checks it: its longest prompt. A count
/// estimated from bytes is refused only past [`ESTIMATED_CONTEXT_TOLERANCE`].
fn check_context(state: &NodeState, req: &RoutedRequest) -> Result<(), ServeError> {
    let prompt_tokens = req.longest_prompt_tokens;
    let max = state
        .engines()
        .iter()
        .filter_map(|e| e.adapter.max_context_tokens())
        .min();
    let over = |max: u64| {
        if state.tokens.exact() {
            prompt_tokens > max
        } else {
            prompt_tokens as f64 > max as f64 * (1.0 + ESTIMATED_CONTEXT_TOLERANCE)
        }
    };
    match max {
        Some(max) if over(max) => Err(ServeError::ContextLength {
            endpoint: req.endpoint,
            message: format!(
                "this model's maximum context length is {max} tokens; the prompt has \
                 {prompt_tokens} tokens ({})",
                state.tokens.how_counted()
            ),
        }),
        _ => Ok(()),
    }
}

/// One decision and its dispatch. A forward that fails before its first byte falls
/// back to the best local engine not `excluded`; a local engine that fails it is added
/// to `excluded` (the caller routes it again). `lost_ms`: the time earlier tries of
/// this request took, which the terms it is served with carry.
async fn route_and_serve(
    state: &Arc<NodeState>,
    req: &RoutedRequest,
    excluded: &mut Excluded,
    lost_ms: f64,
) -> Result<Upstream, ServeError> {
    let local_excluded = excluded.all_local;
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
        origin: req.origin_request_id.map(|request_id| ForwardOrigin {
            node: req.origin.clone(),
            request_id,
        }),
    };
    let decided = telemetry::decide_span(&state.id, policy).in_scope(|| {
        let cands = candidates(state, req, excluded);
        // A peer's forward, checked against what the peer said serving it there costs.
        if let Some(offer) = req
            .offer
            .filter(|_| state.config.routing.refuse_forwards && req.hops >= input.max_hops)
        {
            if let Some(refusal) = state.router.refuse(&input, &cands, &offer) {
                return Err(refusal);
            }
        }
        let count = cands.len();
        let (target, record) = state.router.decide(&input, cands);
        telemetry::record_decision(count, &state.id, &target, &record.reason);
        Ok((target, record))
    });
    let (target, record) = match decided {
        Ok(d) => d,
        Err(refusal) => {
            state.metrics.forwards_refused.inc();
            tracing::debug!(request_id = req.request_id, origin = %req.origin, ?refusal, "forward refused");
            return Err(ServeError::Refused(refusal));
        }
    };
    // The histogram is in seconds: `gorgo-paper`'s terms count tokens.
    if let Some(terms) = record
        .candidates
        .iter()
        .find(|c| c.chosen)
        .and_then(|c| c.terms)
        .filter(|_| policy.terms_in_ms())
    {
        state.metrics.terms(&terms);
    }
    let chosen = record.candidates.iter().find(|c| c.chosen);
    // The terms of where the request is served, as it meets them: the chosen
    // candidate's, unless a forward comes back (then the local engine's after the time
    // lost). The prediction the client is told and the start fit's evidence both come
    // from them.
    let mut met = chosen.and_then(|c| c.terms);
    let unbiased_predicted = chosen.and_then(|c| c.terms?.unbiased_estimated_ttft_ms());
    let chosen_replica = chosen.map_or(0, |c| c.replica);
    let decided = Instant::now();
    // What serving here costs, sent with a forward so the peer can refuse it; not when
    // this node cannot serve it itself.
    let best_local = best_local(&record);
    let offer = if local_excluded || excluded.refused {
        None
    } else {
        best_local.and_then(|l| ForwardOffer::new(l.terms.total_ms, input.weights, policy))
    };
    tracing::debug!(request_id = req.request_id, ?target, reason = %record.reason, "decided");
    let served = match target {
        Target::Nothing => Err(ServeError::Unavailable(
            "no healthy engine and no live peer".into(),
        )),
        Target::Local(replica) => serve_local_or_exclude(state, req, replica, excluded).await,
        Target::Peer(peer) => match forward_until_head(state, &peer, &record, req, offer).await {
            Ok(up) => {
                state.metrics.forward(&peer.0, "ok");
                Ok(learn_forward_bias(
                    state,
                    (peer, chosen_replica),
                    unbiased_predicted,
                    decided,
                    up,
                ))
            }
            Err(NodeError::Refused { refusal, .. }) if best_local.is_some() => {
                tracing::debug!(request_id = req.request_id, %peer, ?refusal, "forward refused; serving locally");
                state.metrics.forward(&peer.0, "refused");
                excluded.refused = true;
                let elapsed_ms = decided.elapsed().as_secs_f64() * 1000.0;
                state
                    .router
                    .forward_refused(&peer, &record, &refusal, elapsed_ms, state.now_ms());
                let local = best_local.expect("checked in the guard");
                // Served here after all: the request meets this node's own engine, after
                // the round trip the refusal took (the simulator does the same).
                met = local.terms.served_locally_after(elapsed_ms, input.weights);
                serve_local_or_exclude(state, req, local.replica, excluded).await
            }
            Err(e) => {
                tracing::warn!(request_id = req.request_id, %peer, error = %e, "forward failed before first byte; serving locally");
                state.metrics.forward(&peer.0, "fallback");
                state.router.forward_failed(&peer, &record);
                let failed = format!("forward to {peer} failed and no local engine");
                excluded.peers.push(peer);
                match best_local {
                    Some(local) => {
                        // As for a refusal: the local engine, after the time the forward
                        // took to fail.
                        let elapsed_ms = decided.elapsed().as_secs_f64() * 1000.0;
                        met = local.terms.served_locally_after(elapsed_ms, input.weights);
                        serve_local_or_exclude(state, req, local.replica, excluded).await
                    }
                    // Routed again without that peer (the caller's retry); if nothing
                    // else serves it, a peer that kept it waiting is a 504, and one whose
                    // engine answered for the request passes on that answer.
                    None => Err(match e {
                        NodeError::HeadTimeout(_) => ServeError::Timeout(format!("{failed}: {e}")),
                        NodeError::EngineAnswered { answer, .. } => {
                            ServeError::EngineAnswered(answer)
                        }
                        _ => ServeError::Unavailable(failed),
                    }),
                }
            }
        },
    };
    // A later try: its client has waited for the earlier ones already (as for a
    // forward that comes back, the time lost counts as the route's).
    if lost_ms > 0.0 {
        met = met.and_then(|t| t.served_locally_after(lost_ms, input.weights));
    }
    served.map(|mut up| {
        up.chosen_terms = met.map(|t| (t, input.weights));
        if let Some(p) = met.and_then(|t| t.estimated_ttft_ms) {
            up.headers
                .retain(|(k, _)| !k.eq_ignore_ascii_case(PREDICTED_TTFT_HEADER));
            up.headers
                .push((PREDICTED_TTFT_HEADER.to_owned(), format!("{p:.1}")));
        }
        up
    })
}

/// An engine's response body as the node relays it, under the request's `ticket` in
/// the engine's accounting: `on_chunk` sees each chunk first (with the ticket, to mark
/// the prefill); a chunk that fails counts against the engine's breaker; the body's
/// clean end counts as an answer and, for a success status, completes the ticket (an
/// error body is no decode: it is cancelled, as the view asks); dropping the stream
/// (the client gone, the deadline) cancels the ticket. `keep` lives until the end (a
/// span).
pub(crate) fn relay_engine_body<F, K>(
    state: &Arc<NodeState>,
    engine: Arc<crate::local::LocalEngine>,
    resp: reqwest::Response,
    ticket: Option<EngineTicket>,
    mut on_chunk: F,
    keep: K,
) -> BodyStream
where
    F: FnMut(&reqwest::Result<Bytes>, Option<&mut EngineTicket>) + Send + 'static,
    K: Send + 'static,
{
    // A 5xx head is no answer for the breaker: a gateway failure counted as a failure
    // already (`send_streamed`), another 5xx counts neither way
    // (`EngineAdapter::is_gateway_failure`); the end of its error body must not close
    // a breaker it may just have opened.
    let server_error = resp.status().is_server_error();
    // Only a success decoded anything: an error body's end must not teach the view a
    // decode time (a response that is not streamed would teach its expected prefill
    // end to its error's arrival, about nothing; `EngineView::finish`).
    let success = resp.status().is_success();
    let failed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let failed_in_body = failed.clone();
    let ticket = Arc::new(parking_lot::Mutex::new(ticket));
    let ticket_in_body = ticket.clone();
    let st = state.clone();
    let eng = engine.clone();
    let body = resp.bytes_stream().map(move |chunk| {
        on_chunk(&chunk, ticket_in_body.lock().as_mut());
        chunk.map_err(|e| {
            // An engine that dies mid-stream failed this request as surely as one that
            // refuses it: it counts towards the breaker (a client going away drops the
            // stream instead, and counts nothing).
            failed_in_body.store(true, std::sync::atomic::Ordering::Relaxed);
            st.metrics.engine_failed(EngineFailureKind::Gateway);
            eng.adapter.record(RequestOutcome::Failed);
            format!("engine stream failed: {}", e.without_url())
        })
    });
    // The body ran to its end: the request succeeded, for the breaker too.
    let ended = futures::stream::once(async move {
        let taken = ticket.lock().take();
        if !failed.load(std::sync::atomic::Ordering::Relaxed) {
            if !server_error {
                engine.adapter.record(RequestOutcome::Answered);
            }
            // Dropped otherwise: cancelled, released without a decode time.
            if let Some(t) = taken.filter(|_| success) {
                t.completed();
            }
        }
        drop(keep);
    })
    .filter_map(|()| async { None });
    Box::pin(body.chain(ended))
}

/// Whether response `headers` say the body is a server-sent event stream: only then
/// does its first chunk mark the first token.
pub(crate) fn is_event_stream(headers: &[(String, String)]) -> bool {
    headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("content-type") && v.contains("text/event-stream"))
}

/// The local engine a decision priced cheapest among those that could serve
/// (`gorgo_core::decision::best_local`, as the simulator picks it): where a forward
/// that fails or is refused goes instead, what a forward offers the peer as the cost
/// of serving here (its total), and what the request meets once this node serves it
/// itself (`CostTerms::served_locally_after`: the prediction and the start fit's
/// evidence).
#[derive(Debug, Clone, Copy)]
struct BestLocal {
    replica: u16,
    /// Its terms in the decision.
    terms: CostTerms,
}

fn best_local(record: &crate::route::DecisionRecord) -> Option<BestLocal> {
    let c = &record.candidates[gorgo_core::decision::best_local(&record.candidates)?];
    Some(BestLocal {
        replica: c.replica,
        terms: c.terms?,
    })
}

/// Serve on local engine `replica`; a failure before the first byte that another
/// engine may take adds it to `excluded`.
async fn serve_local_or_exclude(
    state: &Arc<NodeState>,
    req: &RoutedRequest,
    replica: u16,
    excluded: &mut Excluded,
) -> Result<Upstream, ServeError> {
    let served = serve_local(state, req, replica).await;
    if served.as_ref().is_err_and(|e| e.may_fall_back()) {
        excluded.replicas.push(replica);
    }
    if let Err(ServeError::EngineAnswered(answer)) = &served {
        if !crate::engine::EngineAdapter::is_gateway_failure(
            http::StatusCode::from_u16(answer.status).unwrap_or(http::StatusCode::BAD_GATEWAY),
        ) {
            excluded.answered_5xx.push(replica);
        }
    }
    served
}

/// [`forward`] `req` to `peer` as `record` decided, taking it off the ledger if the
/// client leaves before the response head ([`PendingForward`]).
async fn forward_until_head(
    state: &Arc<NodeState>,
    peer: &NodeId,
    record: &crate::route::DecisionRecord,
    req: &RoutedRequest,
    offer: Option<gorgo_core::decision::ForwardOffer>,
) -> Result<Upstream, NodeError> {
    let pending = PendingForward {
        state,
        peer,
        record,
    };
    let result = forward(state, peer, req, offer).await;
    pending.settled();
    result
}

/// A forward waiting for its response head. Dropped there (the client left, and the
/// request's future with it) it takes the forward off the ledger
/// ([`crate::route::Router::forward_cancelled`]); once the head is in, or the forward
/// failed, the caller forgets it and accounts for the outcome itself.
struct PendingForward<'a> {
    state: &'a NodeState,
    peer: &'a NodeId,
    record: &'a crate::route::DecisionRecord,
}

impl PendingForward<'_> {
    /// The head came in or the forward failed: the caller accounts for it.
    fn settled(self) {
        std::mem::forget(self);
    }
}

impl Drop for PendingForward<'_> {
    fn drop(&mut self) {
        self.state.router.forward_cancelled(self.peer, self.record);
    }
}

/// Wrap a forwarded response so that its first chunk tells the forward ledger how long
/// the forward took against the cost model's prediction before the forward bias
/// (`gorgo_core::cost::ForwardLedger::observe_forward_ttft`): the peer's forward bias.
fn learn_forward_bias(
    state: &Arc<NodeState>,
    (peer, replica): (NodeId, u16),
    unbiased_predicted_ms: Option<f64>,
    decided: Instant,
    mut up: Upstream,
) -> Upstream {
    let Some(predicted_ms) = unbiased_predicted_ms else {
        return up;
    };
    // Only a stream's first chunk marks its first token; a whole JSON body comes at the
    // end, which would teach the ledger E2E instead.
    let streaming = is_event_stream(&up.headers);
    if up.status >= 300 || !streaming {
        return up;
    }
    let st = state.clone();
    let mut first = true;
    up.body = Box::pin(up.body.map(move |chunk| {
        if first && chunk.is_ok() {
            first = false;
            let measured_ms = decided.elapsed().as_secs_f64() * 1000.0;
            st.router.ledger.lock().observe_forward_ttft(
                &peer,
                replica,
                predicted_ms,
                measured_ms,
                st.now_ms(),
            );
        }
        chunk
    }));
    up
}

/// Serve on local engine `replica`. Its shadow index learns the prompt only once the
/// engine has accepted it (a success head): a prompt the engine refuses is not in its
/// cache, and must not be gossiped as if it were. An engine drained or being removed
/// since the decision (a forward's fallback was fixed when the forward was decided,
/// up to a first-byte timeout earlier) is refused: the caller leaves it out and
/// decides again.
pub async fn serve_local(
    state: &Arc<NodeState>,
    req: &RoutedRequest,
    replica: u16,
) -> Result<Upstream, ServeError> {
    let Some(engine) = state.engine(replica) else {
        // Removed since the decision: nothing reached it, so another may take it.
        return Err(ServeError::Failed(format!("engine {replica} was removed")));
    };
    if engine.status() != crate::local::EngineStatus::Serving {
        // Its breaker is the adapter's to check (`send_streamed`); a drain is the
        // operator's word that it takes nothing new, whenever the decision was made.
        return Err(ServeError::Unavailable(format!(
            "engine {replica} takes no new requests (draining)"
        )));
    }
    let prompt_tokens = req.chain.total_tokens();
    let cached = engine.shadow.lock().longest_match(&req.chain);
    let uncached = prompt_tokens.saturating_sub(cached);
    // The view records the wait it expects behind work already at the engine; the fit
    // subtracts it at the first byte so `t_p` measures prefill, not queueing.
    let first_token = if req.stream_usage.is_streamed() {
        FirstToken::Streamed
    } else {
        FirstToken::AtTheEnd
    };
    let ticket = engine
        .adapter
        .dispatch(prompt_tokens, uncached, first_token);
    let started = Instant::now();
    let dispatched_ms = state.now_ms();
    let engine_span = telemetry::engine_span(&state.id);
    let mut headers = req.headers.clone();
    headers.extend(telemetry::trace_headers(&engine_span));
    // Usage on every stream, for the index correction and the token count below; the
    // client's own wish (as this engine's kind reads it) decides what it gets back.
    let sent = req
        .stream_usage
        .engine_body(engine.adapter.kind(), &req.body);
    let resp = engine
        .adapter
        .send_streamed(
            http::Method::POST,
            req.endpoint.path(),
            &headers,
            sent.body,
            first_token,
        )
        .instrument(engine_span.clone())
        .await
        .map_err(|e| {
            if e.is_engine_failure() {
                state.metrics.engine_failed(EngineFailureKind::Gateway);
            }
            ServeError::from(e)
        })?;
    let status = resp.status().as_u16();
    engine_span.record("http.response.status_code", status);
    if resp.status().is_server_error() {
        state
            .metrics
            .engine_failed(crate::engine::EngineAdapter::failure_kind(resp.status()));
        // Nothing of it reached the client: let the caller route it elsewhere, holding
        // the engine's answer for a client with nowhere else to go.
        let headers = pass_headers(resp.headers());
        let read = engine
            .adapter
            .read_answer(resp, crate::api::ENGINE_ANSWER_MAX_BYTES)
            .await;
        return Err(match read {
            Some(body) => ServeError::EngineAnswered(EngineAnswer {
                status,
                headers,
                body: body.into(),
            }),
            None => ServeError::Failed(format!("engine answered {status}")),
        });
    }
    if resp.status().is_success() {
        if let Some(kv) = &engine.kv_events {
            kv.on_dispatch();
        }
        state.change_index(replica, &engine.shadow, |shadow| {
            [shadow.insert(&req.chain, dispatched_ms)]
        });
    }
    let headers = pass_headers(resp.headers());
    // Only a stream's first chunk marks the first token; a whole JSON body comes at the
    // end, and would feed the prefill fit the request's E2E as its TTFT.
    let streaming = is_event_stream(&headers);
    let st = state.clone();
    let eng = engine.clone();
    let chain = req.chain.clone();
    let canonical = req.canonical;
    let predicted = cached;
    let mut first = true;
    let mut corrected = false;
    let mut observed = false;
    let mut usage = crate::usage::UsageScanner::default();
    let on_chunk = move |chunk: &reqwest::Result<Bytes>, ticket: Option<&mut EngineTicket>| {
        if first {
            first = false;
            let ttft_ms = started.elapsed().as_secs_f64() * 1000.0;
            // An error in place of the first chunk is no prefill time.
            let measured = status < 300 && streaming && chunk.is_ok();
            if let Some(t) = ticket {
                t.prefilled(measured.then_some(ttft_ms));
            }
        }
        if let (Ok(bytes), false) = (chunk, corrected && observed) {
            usage.feed(bytes);
            // The engine's own count of cached prompt tokens corrects the shadow index.
            if let (Some(cached), false) = (usage.cached_tokens(), corrected) {
                corrected = true;
                if status < 300 && prompt_tokens > 0 {
                    let error = predicted.abs_diff(cached) as f64 / prompt_tokens as f64;
                    st.metrics.cache_estimate_error.observe(error.min(1.0));
                }
                st.change_index(replica, &eng.shadow, |shadow| {
                    [shadow.correct(&chain, cached, predicted, dispatched_ms)]
                });
            }
            // Its count of prompt tokens measures ours and teaches the ratio.
            if let (Some(engine_tokens), false) = (usage.prompt_tokens(), observed) {
                observed = true;
                if status < 300 {
                    st.tokens
                        .observe(&st.metrics, canonical, chain.total_tokens(), engine_tokens);
                }
            }
        }
    };
    // The engine's part ends with its body (or when the relay drops it).
    let body = relay_engine_body(state, engine, resp, Some(ticket), on_chunk, engine_span);
    // The usage event the client did not ask for goes no further than the scanner
    // (`on_chunk` sees each chunk before this filter does).
    let body: BodyStream = if sent.strip_usage_event && streaming && status < 300 {
        Box::pin(UsageStripped::new(body))
    } else {
        body
    };
    Ok(Upstream {
        status,
        headers,
        served_by: state.config.node.region.clone(),
        served_by_label: state.config.node.region.clone(),
        hops: req.hops,
        body,
        chosen_terms: None,
    })
}
