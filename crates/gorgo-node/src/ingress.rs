//! The OpenAI-compatible HTTP ingress: body cap, parsing, OpenAI error JSON, and the
//! response relay that passes the engine's bytes through chunk by chunk.

use std::future::Future as _;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use futures::Stream;
use gorgo_core::cost::CostTerms;
use gorgo_core::tuning::{Cell, EpochKey, OpenRequest, TermSample};
use gorgo_core::{Endpoint, Weights};
use http_body_util::BodyExt;
use serde_json::Value;
use tokio::sync::OwnedSemaphorePermit;

use crate::api::{
    error_json, error_response, invalid_field_response, method_not_allowed, not_found,
    overloaded_response, session_key, BodyStream, RoutedRequest, ServeError, Upstream, HOPS_HEADER,
    PASS_REQUEST_HEADERS, POLICY_HEADER, SERVED_BY_HEADER, SESSION_HEADER,
};
use crate::engine::{EngineAdapter, EngineTicket, FirstToken};
use crate::error::NodeError;
use crate::metrics::EngineFailureKind;
use crate::serve::{is_event_stream, relay_engine_body, serve, serve_draining, serve_elsewhere};
use crate::sse::EventFramer;
use crate::stream_usage::StreamUsage;
use crate::{telemetry, NodeState};

/// The client-facing router.
pub fn router(state: Arc<NodeState>) -> axum::Router {
    axum::Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/health_generate", get(health_generate))
        .route("/v1/embeddings", post(local_passthrough))
        .route("/v1/responses", post(local_passthrough))
        .route("/generate", post(local_passthrough))
        .route("/tokenize", post(local_passthrough))
        .route("/detokenize", post(local_passthrough))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            telemetry::trace_request,
        ))
        .with_state(state)
}

async fn chat(State(state): State<Arc<NodeState>>, headers: HeaderMap, body: Body) -> Response {
    completion(state, Endpoint::Chat, headers, body).await
}

async fn completions(
    State(state): State<Arc<NodeState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    completion(state, Endpoint::Completions, headers, body).await
}

/// `GET /v1/models`: every model served anywhere in the cluster, in OpenAI's list
/// shape. The local engine's entries come as it lists them (with its own fields, e.g.
/// `max_model_len`); a model only peers serve gets a plain entry. Each entry adds
/// `nodes`: the nodes whose engines serve it, from their gossiped stats.
async fn models(State(state): State<Arc<NodeState>>) -> Response {
    let Some(engine) = state.preferred_engine() else {
        return error_response(StatusCode::SERVICE_UNAVAILABLE, "no local engine");
    };
    if engine.adapter.is_healthy() {
        engine.adapter.learn_models_if_unknown().await;
    }
    let mut listed: Vec<(Value, Vec<String>)> = engine
        .adapter
        .model_entries()
        .into_iter()
        .map(|entry| (entry, vec![state.id.0.clone()]))
        .collect();
    for peer in state.peers.peers().iter().filter(|p| p.alive) {
        for model in peer.models() {
            match listed
                .iter_mut()
                .find(|(e, _)| e.get("id").and_then(Value::as_str) == Some(model))
            {
                Some((_, nodes)) => nodes.push(peer.id.0.clone()),
                None => listed.push((
                    serde_json::json!({"id": model, "object": "model", "created": 0, "owned_by": "gorgo"}),
                    vec![peer.id.0.clone()],
                )),
            }
        }
    }
    if listed.is_empty() && !state.any_engine_takes_requests() {
        return error_response(StatusCode::SERVICE_UNAVAILABLE, "engine unavailable");
    }
    let data: Vec<Value> = listed
        .into_iter()
        .map(|(mut entry, mut nodes)| {
            nodes.sort();
            if let Some(obj) = entry.as_object_mut() {
                obj.insert("nodes".into(), nodes.into());
            }
            entry
        })
        .collect();
    axum::Json(serde_json::json!({"object": "list", "data": data})).into_response()
}

/// `GET /health` as SGLang and vLLM answer it (clients such as GuideLLM check it
/// before a run): 200 with an empty body while this node can serve (not draining; its
/// engine healthy or a live peer to forward to), 503 otherwise.
async fn health(State(state): State<Arc<NodeState>>) -> Response {
    let can_serve = !state.is_draining()
        && (state.any_engine_takes_requests() || state.peers.peers().iter().any(|p| p.alive));
    if can_serve {
        Response::new(Body::empty())
    } else {
        error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "no healthy engine and no live peer",
        )
    }
}

/// Cap on the answer to `/health_generate`'s one-token completion (a few hundred bytes
/// from a working engine).
const HEALTH_GENERATE_MAX_BYTES: usize = 1 << 20;

/// `GET /health_generate` (SGLang's): a one-token generation through the local engine,
/// so a probe sees an engine that answers `/health` but cannot generate. Probes run
/// one at a time, and one that arrives while another runs takes its answer: the route
/// needs no token, and each probe is real engine work outside the node's accounting.
async fn health_generate(State(state): State<Arc<NodeState>>) -> Response {
    let arrived = Instant::now();
    let (mut last, waited) = match state.health_probe.try_lock() {
        Ok(guard) => (guard, false),
        Err(_) => (state.health_probe.lock().await, true),
    };
    // Only an answer that ended while this probe waited is shared: the probe it waited
    // on may have been dropped (its client left), leaving an older answer behind.
    let outcome = match (waited, last.as_ref()) {
        (true, Some((ended, outcome))) if *ended >= arrived => outcome.clone(),
        _ => {
            let outcome = probe_generation(&state).await;
            *last = Some((Instant::now(), outcome.clone()));
            outcome
        }
    };
    drop(last);
    match outcome {
        Ok(()) => Response::new(Body::empty()),
        Err(m) => error_response(StatusCode::SERVICE_UNAVAILABLE, &m),
    }
}

/// One `/health_generate` probe: `Err` says why the engine could not generate. The
/// whole of it, learning the engine's model included, ends within the engine's
/// generation-probe deadline.
async fn probe_generation(state: &NodeState) -> Result<(), String> {
    let Some(engine) = state.preferred_engine() else {
        return Err("no local engine".into());
    };
    let deadline = engine.adapter.generation_probe_deadline();
    let probe = async {
        let model = engine_model(state)
            .await
            .unwrap_or_else(|| "default".to_owned());
        let body =
            serde_json::json!({"model": model, "prompt": "ping", "max_tokens": 1, "stream": false});
        let headers = [("content-type".to_owned(), "application/json".to_owned())];
        let sent = engine
            .adapter
            .send_request(
                http::Method::POST,
                "/v1/completions",
                &headers,
                Bytes::from(body.to_string()),
            )
            .await;
        match sent {
            Ok(resp) if resp.status().is_success() => {
                match engine.adapter.read_answer(resp, HEALTH_GENERATE_MAX_BYTES).await {
                    Some(_) => Ok(()),
                    None => Err(
                        "engine failed: its answer broke off, ran over 1 MiB or past the health deadline"
                            .into(),
                    ),
                }
            }
            Ok(resp) => Err(format!("engine answered {}", resp.status().as_u16())),
            Err(e) => Err(ServeError::from(e).message()),
        }
    };
    tokio::time::timeout(deadline, probe)
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "engine failed: no one-token answer within {} ms (20 engine.health_timeout_ms)",
                deadline.as_millis()
            ))
        })
}

/// The id of the first model the local engine lists.
async fn engine_model(state: &NodeState) -> Option<String> {
    let engine = state.preferred_engine()?;
    engine.adapter.learn_models_if_unknown().await;
    engine.adapter.models().into_iter().next()
}

/// Endpoints the node passes to its local engine unrouted (`/v1/embeddings`,
/// `/v1/responses`, SGLang's `/generate`, `/tokenize`, `/detokenize`): the same body
/// cap, request deadline ([`respond`]), concurrency slot, breaker, metrics, OpenAI
/// error JSON and `x-gorgo-served-by` as routed requests, and a client that goes away
/// cancels the engine request (the body stream is dropped). Their prompts are not in a
/// form the cost model reads (token ids, response items), so they are not routed; the
/// generating ones are still counted in the engine's accounting (at a prompt size
/// estimated from the body's bytes), so the node does not gossip a busy engine as idle.
async fn local_passthrough(
    State(state): State<Arc<NodeState>>,
    uri: http::Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let pending = CancelledIfDropped::new(state.clone());
    let _ = pending.policy.set(UNROUTED);
    pending
        .answer(pass_to_engine(state, uri, headers, body))
        .await
}

async fn pass_to_engine(
    state: Arc<NodeState>,
    uri: http::Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let started = Instant::now();
    let limits = &state.config.limits;
    // A draining node takes no new engine work it cannot hand to a peer: a keep-alive
    // client sending embeddings kept the engine busy, and the drain ran to its deadline
    // and cut every stream still in flight. Its client retries elsewhere.
    if state.is_draining() {
        state.metrics.request("unavailable", "");
        return overloaded_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "draining: this node takes no new requests for its engine",
            limits.retry_after_s,
        );
    }
    let body = match read_client_body(&state, body, &headers).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    // The slot first, as routed requests take it: parsing a body takes many times its
    // size, and only the requests in flight may hold that.
    let Ok(permit) = state.permits.clone().try_acquire_owned() else {
        state.metrics.request("unavailable", "");
        return overloaded_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many requests in flight",
            limits.retry_after_s,
        );
    };
    let fields = match parse_object(&state, &body) {
        Ok(fields) => fields,
        Err(m) => return error_response(StatusCode::BAD_REQUEST, &m),
    };
    // An embedding's body comes when its prompt is prefilled; a generation's, unless
    // streamed, only once it has finished decoding.
    let first_token =
        if uri.path() == "/v1/embeddings" || fields.get("stream") == Some(&Value::Bool(true)) {
            FirstToken::Streamed
        } else {
            FirstToken::AtTheEnd
        };
    drop(fields);
    let pass = pass_headers(&headers);
    let Some(engine) = state.preferred_engine().filter(|e| e.takes_requests()) else {
        state.metrics.request("unavailable", "");
        let mut resp = ServeError::Unavailable("no local engine takes requests".into()).response();
        if let Ok(v) = HeaderValue::from_str(&limits.retry_after_s.to_string()) {
            resp.headers_mut().insert(http::header::RETRY_AFTER, v);
        }
        return resp;
    };
    // Tokenizing generates nothing; the rest are engine work the node must count.
    let generates = !matches!(uri.path(), "/tokenize" | "/detokenize");
    let ticket = generates.then(|| {
        let tokens = (body.len() as f64 / state.tokens.bytes_per_token()).ceil() as u64;
        engine.adapter.dispatch(tokens, tokens, first_token)
    });
    // Under the request's one deadline, as routed requests are: a head that came
    // after it left `respond` no time, and the client got a 200 whose body was cut at
    // once (a head wait not streamed is the longer of the request and first-byte
    // timeouts, from the send, after a body read that may take its own timeout).
    let sent = tokio::time::timeout_at(
        (started + Duration::from_millis(limits.request_timeout_ms)).into(),
        engine
            .adapter
            .send_streamed(http::Method::POST, uri.path(), &pass, body, first_token),
    )
    .await;
    let resp = match sent {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            if e.is_engine_failure() {
                state.metrics.engine_failed(EngineFailureKind::Gateway);
            }
            let e = ServeError::from(e);
            state.metrics.routed_request(e.status().1, UNROUTED, "");
            return e.response();
        }
        Err(_) => {
            let e = ServeError::Timeout("request timed out".into());
            state.metrics.routed_request(e.status().1, UNROUTED, "");
            return e.response();
        }
    };
    let status = resp.status().as_u16();
    if resp.status().is_server_error() {
        // Counted against the breaker in `send_streamed` when a gateway failure, and
        // here as the routed paths count it: relayed to the client, as no peer
        // serves these routes.
        state
            .metrics
            .engine_failed(EngineAdapter::failure_kind(resp.status()));
    }
    // The headers routed requests pass on (only `content-type` did: an embedding's
    // `x-request-id` never reached its client).
    let headers = crate::serve::pass_headers(resp.headers());
    // The ticket and the breaker's verdict ride with the body (its first chunk marks
    // the prefill, and a success's its decode's start; no fit sample: these prompts'
    // sizes are estimates).
    let ok = status < 300;
    let on_chunk = move |chunk: &reqwest::Result<Bytes>, ticket: Option<&mut EngineTicket>| {
        if let Some(t) = ticket {
            if ok && chunk.is_ok() {
                t.prefilled_unmeasured();
            } else {
                t.prefilled(None);
            }
        }
    };
    let body = relay_engine_body(&state, engine, resp, ticket, on_chunk, ());
    let up = Upstream {
        status,
        headers,
        served_by: state.config.node.region.clone(),
        served_by_label: state.config.node.region.clone(),
        hops: 0,
        body,
        chosen_terms: None,
    };
    respond(state, up, started, Slot::Ingress(permit), None, UNROUTED)
}

/// The `policy` label of requests the node passes to its engine unrouted.
const UNROUTED: &str = "unrouted";

/// The client headers that travel to the engine ([`PASS_REQUEST_HEADERS`]).
fn pass_headers(headers: &HeaderMap) -> Vec<(String, String)> {
    PASS_REQUEST_HEADERS
        .iter()
        .filter_map(|&n| {
            headers
                .get(n)
                .and_then(|v| v.to_str().ok())
                .map(|v| (n.to_owned(), v.to_owned()))
        })
        .collect()
}

/// Read a client's body under `[limits]` (size cap, deadline, the node's budget of
/// bodies being read), or the error answer (413, 408, 503, 400) with the request
/// counted.
async fn read_client_body(
    state: &NodeState,
    body: Body,
    headers: &HeaderMap,
) -> Result<Bytes, Response> {
    let limits = &state.config.limits;
    let read = tokio::time::timeout(
        Duration::from_millis(limits.body_timeout_ms),
        read_body(state, body, limits.max_body_bytes, headers),
    );
    let (outcome, status, message) = match read.await {
        Ok(Ok(b)) => return Ok(b),
        Err(_) => (
            "bad_request",
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "request body not received within {} ms",
                limits.body_timeout_ms
            ),
        ),
        Ok(Err(BodyError::TooLarge)) => (
            "too_large",
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body over {} bytes", limits.max_body_bytes),
        ),
        Ok(Err(BodyError::OverBudget)) => {
            state.metrics.request("unavailable", "");
            return Err(overloaded_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "too many request bodies being read (limits.max_body_bytes_in_flight)",
                limits.retry_after_s,
            ));
        }
        Ok(Err(BodyError::Broken(m))) => (
            "bad_request",
            StatusCode::BAD_REQUEST,
            format!("cannot read body: {m}"),
        ),
    };
    state.metrics.request(outcome, "");
    Err(error_response(status, &message))
}

/// What a request head holds in memory: its names and values, and a map entry each.
fn head_bytes(headers: &HeaderMap) -> usize {
    headers
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 32)
        .sum()
}

/// Why the body could not be read.
enum BodyError {
    TooLarge,
    OverBudget,
    Broken(String),
}

/// Collect `body`, at most `limit` bytes, holding its share of the node's budget of
/// bodies being read while it arrives: the bytes received, not the length announced
/// (a client that announces 8 MiB and sends nothing must not take 8 MiB of it).
async fn read_body(
    state: &NodeState,
    mut body: Body,
    limit: usize,
    headers: &HeaderMap,
) -> Result<Bytes, BodyError> {
    if let Some(len) = headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
    {
        if len > limit as u64 {
            return Err(BodyError::TooLarge);
        }
    }
    // The request's head is held while its body arrives: it counts too. An HTTP/2
    // client's heads of up to `max_header_bytes`, on 256 streams a connection, each
    // waiting for a body that never comes, held memory the budget never saw.
    let head = head_bytes(headers);
    let mut lease = state.body_budget.lease();
    lease.cover(head).map_err(|_| BodyError::OverBudget)?;
    let mut buf = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| BodyError::Broken(e.to_string()))?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers
        };
        let total = buf.len() + data.len();
        if total > limit {
            return Err(BodyError::TooLarge);
        }
        lease
            .cover(head + total)
            .map_err(|_| BodyError::OverBudget)?;
        buf.extend_from_slice(&data);
    }
    Ok(buf.freeze())
}

/// Counts a request as `cancelled` when its handler is dropped before it answers: the
/// client went away while the node read its body, routed it, or waited for its
/// response head (an engine that hangs, a non-streamed generation). Without it such a
/// request was in no count at all, though the engine may have run it. Every answer
/// counts its own outcome and disarms it; from the head on [`Tracked`] counts.
struct CancelledIfDropped {
    state: Arc<NodeState>,
    /// The policy label, set by the handler once it knows which policy routes the
    /// request; empty (a request the client left before it was routed) until then.
    policy: Arc<std::sync::OnceLock<&'static str>>,
    armed: bool,
}

impl CancelledIfDropped {
    fn new(state: Arc<NodeState>) -> Self {
        Self {
            state,
            policy: Arc::default(),
            armed: true,
        }
    }

    /// Run a handler under the guard: if its future is dropped before it answers,
    /// the request counts as cancelled.
    async fn answer(mut self, handler: impl std::future::Future<Output = Response>) -> Response {
        let resp = handler.await;
        self.armed = false;
        resp
    }
}

impl Drop for CancelledIfDropped {
    fn drop(&mut self) {
        if self.armed {
            let policy = self.policy.get().copied().unwrap_or("");
            self.state.metrics.routed_request("cancelled", policy, "");
        }
    }
}

async fn completion(
    state: Arc<NodeState>,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let pending = CancelledIfDropped::new(state.clone());
    let policy = pending.policy.clone();
    pending
        .answer(route_completion(state, endpoint, headers, body, policy))
        .await
}

/// `routed_by` is set to the policy's label once it is known (the label of a request
/// its client leaves from then on).
async fn route_completion(
    state: Arc<NodeState>,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Body,
    routed_by: Arc<std::sync::OnceLock<&'static str>>,
) -> Response {
    let started = Instant::now();
    let limits = &state.config.limits;
    // The body is read before a concurrency slot is taken, within its own deadline:
    // slow or stalled uploads must not hold the slots of requests that are ready.
    let body = match read_client_body(&state, body, &headers).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    // A slot for serving here; without one (the node is full) a peer with room may
    // still take the request, holding a forward slot instead. Only with neither is the
    // client told to come back. Taken before parsing and tokenising, so that the slots
    // bound that work (and its memory: a parsed body is many times its size) too.
    let slot = match state.permits.clone().try_acquire_owned() {
        Ok(p) => Some(Slot::Ingress(p)),
        // Only with a live peer: without one the relay would parse and tokenise the
        // body for nothing, log its healthy engines as excluded and answer "no
        // healthy engine".
        Err(_) if !state.peers.peers().iter().any(|p| p.alive) => None,
        Err(_) => state
            .forward_permits
            .clone()
            .try_acquire_owned()
            .ok()
            .and_then(|forward| {
                // As many as forward permits: there is one whenever that was.
                let relay = state.overflow_permits.clone().try_acquire_owned().ok()?;
                Some(Slot::Overflow(forward, relay))
            }),
    };
    let Some(slot) = slot else {
        state.metrics.request("unavailable", "");
        return overloaded_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many requests in flight",
            limits.retry_after_s,
        );
    };
    let parsed = match parse_object(&state, &body) {
        Ok(fields) => Value::Object(fields),
        Err(m) => return error_response(StatusCode::BAD_REQUEST, &m),
    };
    if let Err(e) = crate::validate::validate_request(endpoint, &parsed) {
        state.metrics.request("bad_request", "");
        return invalid_field_response(e.param, e.code, &e.message);
    }
    // The field a prompt that cannot be read or rendered is about.
    let prompt_param = match endpoint {
        Endpoint::Chat => "messages",
        Endpoint::Completions => "prompt",
    };
    let prompt = match gorgo_core::prompt::canonicalize(endpoint, &parsed) {
        Ok(p) => p,
        Err(e) => {
            state.metrics.request("bad_request", "");
            return invalid_field_response(prompt_param, "invalid_value", &e.to_string());
        }
    };
    let canonical = gorgo_core::prompt::CanonicalSize::of(endpoint, &prompt);
    let model = parsed
        .get("model")
        .and_then(Value::as_str)
        .map(str::to_owned);
    // vLLM's `truncate_prompt_tokens`: the engine keeps the prompt's last N tokens. The
    // prompt is counted, priced and hashed as those N (`tokens::request_chain`), the
    // context check holds N, not the whole prompt, against the engine (it refused
    // prompts vLLM serves), and the token estimate learns nothing from the engine's
    // count of N. (-1, "to the context length", is left to the engine's own check.)
    let truncated_to = parsed
        .get("truncate_prompt_tokens")
        .and_then(Value::as_u64)
        .filter(|&n| n > 0);
    let stream_usage = StreamUsage::of_request(endpoint, &parsed);
    // Only event streams are measured for tuning (`respond`): a whole JSON body's
    // head comes at the end of generation, so one that runs into the deadline is a
    // long generation, not a long wait for its first token.
    let streamed = stream_usage.is_streamed();
    // A completions batch is checked against the context prompt by prompt: without a
    // tokenizer, from its longest prompt's size.
    let batch_longest_bytes = match endpoint {
        Endpoint::Chat => None,
        Endpoint::Completions => gorgo_core::prompt::CompletionsPrompt::of_body(&parsed)
            .ok()
            .and_then(|p| p.longest_batch_prompt_bytes()),
    };
    // The parsed body can be many times the body's size (8 MiB of token ids is about
    // 128 MiB as a `Value`); nothing below reads it, and counting the prompt's tokens
    // may wait for the tokenizer's thread pool.
    drop(parsed);
    let counted = crate::tokens::request_chain(
        &state,
        endpoint,
        &body,
        prompt,
        batch_longest_bytes,
        truncated_to,
        slot,
    );
    let (counted, slot) = match counted.await {
        Ok(c) => c,
        Err(e @ NodeError::Tokenize(_)) => {
            state.metrics.request("bad_request", "");
            return invalid_field_response(prompt_param, "invalid_value", &e.to_string());
        }
        Err(e) => {
            state.metrics.request("internal_error", "");
            return error_response(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string());
        }
    };
    let policy = if state.config.routing.allow_policy_header {
        match headers.get(POLICY_HEADER).map(|v| v.to_str().unwrap_or("")) {
            None => None,
            Some(p) => match crate::route::parse_policy(p) {
                Ok(p) => Some(p),
                Err(m) => {
                    state.metrics.request("bad_request", "");
                    return error_response(
                        StatusCode::BAD_REQUEST,
                        &format!("{POLICY_HEADER}: {m}"),
                    );
                }
            },
        }
    } else {
        None
    };
    let session_id = headers
        .get(SESSION_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let session_key = session_id.as_deref().map(session_key);
    let pass = pass_headers(&headers);
    let pass = if pass.iter().any(|(k, _)| k == "content-type") {
        pass
    } else {
        let mut p = pass;
        p.push(("content-type".into(), "application/json".into()));
        p
    };
    // Tuning: route with the epoch's weights and attribute the latencies to it, unless
    // the client picked another policy (those requests measure something else).
    // The key (a hash of the request id) picks the arm of an interleaved trial.
    let request_id = state.next_request_id();
    let admission = state
        .tuning
        .admit(gorgo_core::hash::hash_bytes(&request_id.to_le_bytes()));
    let tuned = policy.is_none_or(|p| p == state.policy);
    let req = RoutedRequest {
        weights: admission.weights,
        request_id,
        endpoint,
        body,
        stream_usage,
        headers: pass,
        chain: counted.chain,
        longest_prompt_tokens: counted.longest_prompt_tokens,
        canonical: Some(canonical).filter(|_| truncated_to.is_none()),
        hops: 0,
        via: Vec::new(),
        policy,
        session_key,
        session_id,
        model,
        origin: state.id.clone(),
        origin_request_id: None,
        offer: None,
    };
    let policy_name = policy.unwrap_or(state.policy).as_str();
    let _ = routed_by.set(policy_name);
    let serving = async {
        match slot {
            // Draining: peers take new work while any is alive, so the node empties.
            Slot::Ingress(_) if state.is_draining() => serve_draining(&state, req).await,
            Slot::Ingress(_) => serve(&state, req).await,
            Slot::Overflow(..) => serve_elsewhere(&state, req).await,
        }
    };
    // `request_timeout_ms` bounds the whole request, the tries before its head too
    // (each may wait a first-byte timeout); `respond` gets what is left of it.
    let served = tokio::time::timeout_at(
        (started + Duration::from_millis(limits.request_timeout_ms)).into(),
        serving,
    )
    .await
    .unwrap_or_else(|_| Err(ServeError::Timeout("request timed out".into())));
    match served {
        Ok(up) => {
            tracing::debug!(request_id, served_by = %up.served_by, hops = up.hops, status = up.status, "serving");
            let measured = tuned.then_some((admission.epoch, admission.cell));
            respond(state, up, started, slot, measured, policy_name)
        }
        Err(e) => {
            if tuned && streamed && matches!(e, ServeError::Timeout(_)) {
                let waited_ms = started.elapsed().as_secs_f64() * 1000.0;
                state
                    .tuning
                    .record_timed_out(&admission.epoch, admission.cell, waited_ms);
            }
            // What the client gets: an engine's own answer passed on is its status and
            // `engine_error`, as a relayed one is.
            let (status, outcome) = e.status();
            let m = e.message();
            tracing::warn!(request_id, %status, outcome, error = %m, "request failed");
            state.metrics.routed_request(outcome, policy_name, "");
            let mut resp = e.response();
            // The node's own back-off on its 503; an engine's 503 passed on keeps the
            // `Retry-After` it came with.
            if status == StatusCode::SERVICE_UNAVAILABLE {
                if let Ok(v) = HeaderValue::from_str(&limits.retry_after_s.to_string()) {
                    resp.headers_mut()
                        .entry(http::header::RETRY_AFTER)
                        .or_insert(v);
                }
            }
            resp
        }
    }
}

/// Parse a client's body, which must be a JSON object; else count it as a bad
/// request and say what is wrong, telling malformed JSON from JSON of another shape
/// (the client's 400). One place for both the routed and the passed-through routes
/// (the latter said "must be a JSON object" of JSON that did not parse).
/// A body of more than [`crate::validate::MAX_JSON_CONTAINERS`] objects and arrays, or
/// [`crate::validate::MAX_JSON_VALUES`] values, is refused before it is parsed (what
/// parsing it would hold is many times its size).
fn parse_object(state: &NodeState, body: &[u8]) -> Result<serde_json::Map<String, Value>, String> {
    use crate::validate::{too_much_json, MAX_JSON_CONTAINERS, MAX_JSON_VALUES};
    let message = if let Some(m) = too_much_json(body, MAX_JSON_CONTAINERS, MAX_JSON_VALUES) {
        m
    } else {
        match serde_json::from_slice(body) {
            Ok(Value::Object(fields)) => return Ok(fields),
            Ok(_) => "request body must be a JSON object".to_owned(),
            Err(e) => format!("malformed JSON: {e}"),
        }
    };
    state.metrics.request("bad_request", "");
    Err(message)
}

/// What a request in flight holds: a slot of the ingress cap, or (the node full) one
/// of the forward cap while a peer serves it.
enum Slot {
    Ingress(#[allow(dead_code)] OwnedSemaphorePermit),
    Overflow(
        #[allow(dead_code)] OwnedSemaphorePermit,
        #[allow(dead_code)] OwnedSemaphorePermit,
    ),
}

fn respond(
    state: Arc<NodeState>,
    up: Upstream,
    started: Instant,
    slot: Slot,
    measured: Option<(EpochKey, Cell)>,
    policy: &'static str,
) -> Response {
    let status = StatusCode::from_u16(up.status).unwrap_or(StatusCode::BAD_GATEWAY);
    // A whole JSON body's first byte comes at the end of generation: its "TTFT" is the
    // request's E2E, which would score the tuner's trials by output length and bias its
    // start fit by the decode time. Only event streams are measured for tuning.
    let event_stream = is_event_stream(&up.headers);
    let measured = measured.filter(|_| event_stream);
    // What is left of the whole request's deadline, which started with it.
    let deadline = Duration::from_millis(state.config.limits.request_timeout_ms)
        .saturating_sub(started.elapsed());
    let held = Arc::new(parking_lot::Mutex::new(Held {
        upstream: Some((up.body, slot)),
        waiting: measured.clone(),
        open: None,
    }));
    let (watch_tx, watch_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(drop_at_deadline(
        Arc::downgrade(&held),
        state.clone(),
        started,
        deadline,
        watch_rx,
    ));
    let tracked = Tracked {
        held,
        _watch: watch_tx,
        state: state.clone(),
        started,
        measured,
        chosen_terms: up.chosen_terms,
        first_seen: false,
        events: event_stream.then(EventFramer::default),
        ok_status: status.is_success(),
        served_by: up.served_by_label,
        policy,
        finished: false,
        deadline: Box::pin(tokio::time::sleep(deadline)),
    };
    let mut resp = Response::new(Body::from_stream(tracked));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    for (k, v) in &up.headers {
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_str(v),
        ) {
            h.insert(name, value);
        }
    }
    if let Ok(v) = HeaderValue::from_str(&up.served_by) {
        h.insert(SERVED_BY_HEADER, v);
    }
    h.insert(HOPS_HEADER, HeaderValue::from(up.hops as u32));
    resp
}

/// What a response in flight holds that its deadline takes from it
/// ([`drop_at_deadline`]) whether or not its client is reading.
struct Held {
    /// The upstream body and the request's slot, until the response ends or its
    /// deadline passes.
    upstream: Option<(BodyStream, Slot)>,
    /// The tuning epoch and cell of a measured request until its first token: at the
    /// deadline its wait so far is a lower bound on its TTFT and E2E.
    waiting: Option<(EpochKey, Cell)>,
    /// The tuner's handle on the request once its first token counted: handed back at
    /// the end (its E2E, or abandoned), and until then a lower bound in the reports.
    open: Option<OpenRequest>,
}

impl Held {
    /// The request ran into its deadline after `elapsed_ms`: what the tuner holds of
    /// it ends with that time as a lower bound (on its TTFT and E2E before its first
    /// token, on its E2E after). Left out, an arm whose requests ran into the deadline
    /// lost its slowest. Once: the deadline's task and the body's own deadline both
    /// come here, and whichever is first takes what there is.
    fn end_at_deadline(&mut self, tuning: &crate::tuning::TuningDriver, elapsed_ms: f64) {
        if let Some((epoch, cell)) = self.waiting.take() {
            tuning.record_timed_out(&epoch, cell, elapsed_ms);
        }
        if let Some(open) = self.open.take() {
            tuning.record_finish(open, elapsed_ms);
        }
    }
}

/// The response body relay: passes chunks through unchanged, measures TTFT and E2E,
/// turns a mid-stream failure into an SSE error event (streams) or an aborted body,
/// and counts a client that went away as cancelled.
struct Tracked {
    held: Arc<parking_lot::Mutex<Held>>,
    /// Dropped with the response: tells the deadline's task to stop waiting.
    _watch: tokio::sync::oneshot::Sender<()>,
    state: Arc<NodeState>,
    started: Instant,
    /// The tuning epoch and cell the request was admitted under (`None`: not
    /// measured, which a response that is not an event stream never is).
    measured: Option<(EpochKey, Cell)>,
    /// The decision's terms for its choice (the tuner's start-fit evidence).
    chosen_terms: Option<(CostTerms, Weights)>,
    first_seen: bool,
    /// For an event stream (by its content type, whatever the request asked): what
    /// goes out is cut at event boundaries, so a failure can end it with a whole
    /// error event. Any other body is aborted on failure.
    events: Option<EventFramer>,
    ok_status: bool,
    served_by: String,
    /// The routing policy that placed the request.
    policy: &'static str,
    finished: bool,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

/// At `deadline`, drop a response's upstream body (which cancels the engine request
/// or the forward stream) and its slot, unless the response ended first (`done`
/// closed). The body's own deadline only fires when the body is polled, and a client
/// that stops reading stops the polling: without this, it would hold both for as long
/// as it kept its connection.
async fn drop_at_deadline(
    held: std::sync::Weak<parking_lot::Mutex<Held>>,
    state: Arc<NodeState>,
    started: Instant,
    deadline: Duration,
    done: tokio::sync::oneshot::Receiver<()>,
) {
    tokio::select! {
        _ = tokio::time::sleep(deadline) => {}
        _ = done => return,
    }
    if let Some(held) = held.upgrade() {
        let upstream = {
            let mut h = held.lock();
            h.end_at_deadline(&state.tuning, started.elapsed().as_secs_f64() * 1000.0);
            h.upstream.take()
        };
        drop(upstream);
    }
}

impl Tracked {
    fn finish(&mut self, outcome: &str) {
        if !self.finished {
            self.finished = true;
            let outcome = if outcome == "ok" && !self.ok_status {
                "engine_error"
            } else {
                outcome
            };
            self.state
                .metrics
                .routed_request(outcome, self.policy, &self.served_by);
            let e2e = self.started.elapsed().as_secs_f64();
            if outcome == "ok" {
                self.state.metrics.e2e.observe(e2e);
            }
            let mut held = self.held.lock();
            if outcome == "timeout" {
                held.end_at_deadline(&self.state.tuning, e2e * 1000.0);
            }
            held.waiting = None;
            let open = held.open.take();
            drop(held);
            if let Some(open) = open {
                if outcome == "ok" {
                    self.state.tuning.record_finish(open, e2e * 1000.0);
                } else {
                    // Failed or cancelled after its first token: no E2E to count.
                    self.state.tuning.abandon(open);
                }
            }
        }
    }

    /// End the response on a failure: the deadline (`timed_out`, 504 `timeout`) or the
    /// upstream breaking (502 `engine_failed`). An event stream ends with an error
    /// event in place of the partial event it held back; any other body is aborted.
    fn fail(
        &mut self,
        timed_out: bool,
        message: &str,
    ) -> Poll<Option<Result<Bytes, std::io::Error>>> {
        let (outcome, status) = if timed_out {
            ("timeout", 504)
        } else {
            ("stream_error", 502)
        };
        self.finish(outcome);
        match &mut self.events {
            Some(framer) => {
                // Only when the held-back part outgrew its cap did part of an event go
                // out: a blank line ends it, so the error is an event of its own.
                let lead = if framer.mid_event() { "\n\n" } else { "" };
                framer.discard();
                let event = format!("{lead}data: {}\n\n", error_json(status, message));
                Poll::Ready(Some(Ok(Bytes::from(event))))
            }
            None => Poll::Ready(Some(Err(std::io::Error::other(message.to_owned())))),
        }
    }
}

impl Stream for Tracked {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.finished {
            return Poll::Ready(None);
        }
        if self.deadline.as_mut().poll(cx).is_ready() {
            return self.fail(true, "request timed out");
        }
        loop {
            let polled = self
                .held
                .lock()
                .upstream
                .as_mut()
                .map(|(inner, _)| inner.as_mut().poll_next(cx));
            let Some(polled) = polled else {
                return self.fail(true, "request timed out");
            };
            let bytes = match polled {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    // A stream that ends inside an event: what was held goes out as
                    // the engine sent it.
                    let rest = self.events.as_mut().map(EventFramer::flush);
                    self.finish("ok");
                    return Poll::Ready(rest.filter(|r| !r.is_empty()).map(Ok));
                }
                Poll::Ready(Some(Ok(bytes))) => match &mut self.events {
                    Some(framer) => framer.push(bytes),
                    None => bytes,
                },
                Poll::Ready(Some(Err(m))) => {
                    tracing::warn!(error = %m, "upstream failed mid-response");
                    return self.fail(false, &m);
                }
            };
            // All of it held back (no event ended in it): wait for more.
            if bytes.is_empty() && self.events.is_some() {
                continue;
            }
            {
                if !self.first_seen && !bytes.is_empty() {
                    self.first_seen = true;
                    // Its first byte came: no longer a wait for the deadline to count.
                    self.held.lock().waiting = None;
                    let ttft = self.started.elapsed().as_secs_f64();
                    // A whole JSON body's first byte comes with its last: its time is
                    // the E2E, not a TTFT (`respond`), for the histogram as for tuning.
                    if self.ok_status && self.events.is_some() {
                        self.state.metrics.ttft.observe(ttft);
                        let ttft_ms = ttft * 1000.0;
                        if let Some((epoch, cell)) = &self.measured {
                            let terms = self
                                .chosen_terms
                                .and_then(|(terms, w)| TermSample::new(&terms, w, ttft_ms));
                            let now_ms = self.state.now_ms();
                            let open = self
                                .state
                                .tuning
                                .record_first_token(epoch, *cell, ttft_ms, now_ms, terms);
                            // The deadline may have taken the upstream since the poll
                            // above: then nothing will hand the request back, so it is
                            // abandoned here rather than reported open for the rest of
                            // the epoch.
                            let late = {
                                let mut h = self.held.lock();
                                if h.upstream.is_some() {
                                    h.open = open;
                                    None
                                } else {
                                    open
                                }
                            };
                            if let Some(open) = late {
                                self.state.tuning.abandon(open);
                            }
                        }
                    }
                }
                return Poll::Ready(Some(Ok(bytes)));
            }
        }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        // Dropped before the end: the client went away. Dropping `held` (the upstream
        // body) cancels the engine request or the forward stream.
        self.finish("cancelled");
    }
}
