//! The admin listener: `/admin/*` behind the bearer token, Prometheus `/metrics`,
//! `/healthz` and `/readyz` open (probes and scrapers carry no token).

use std::sync::Arc;

use axum::extract::{Query, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Json;
use gorgo_core::es::TuningMode;
use gorgo_core::Weights;
use serde::Deserialize;
use serde_json::json;
use serde_json::Value;

use crate::api::{error_response, invalid_field_response, ApiError};
use crate::NodeState;

/// Largest PUT body on the admin API.
const MAX_ADMIN_BODY: usize = 64 * 1024;

/// The admin router.
pub fn router(state: Arc<NodeState>) -> axum::Router {
    let admin = axum::Router::new()
        .route("/admin/state", get(admin_state))
        .route("/admin/peers", get(peers))
        .route("/admin/decisions", get(decisions))
        .route("/admin/weights", get(get_weights).put(put_weights))
        .route("/admin/tuning", get(tuning))
        .route("/admin/prefix_match", axum::routing::post(prefix_match))
        .route("/admin/engines", get(list_engines).post(add_engine))
        .route(
            "/admin/engines/{replica}",
            axum::routing::delete(remove_engine),
        )
        .route(
            "/admin/engines/{replica}/{action}",
            axum::routing::post(engine_action),
        )
        // Inside the token check: a caller without the token is answered at once.
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            read_body_in_time,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_token,
        ))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_ADMIN_BODY));
    axum::Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .merge(admin)
        .fallback(crate::api::not_found)
        .method_not_allowed_fallback(crate::api::method_not_allowed)
        .with_state(state)
}

/// Constant-time comparison, so the token does not leak through timing.
fn token_matches(given: &[u8], expected: &[u8]) -> bool {
    if given.len() != expected.len() {
        return false;
    }
    given
        .iter()
        .zip(expected)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b))
        == 0
}

/// The token of an `Authorization: Bearer <token>` value: the scheme's name matched
/// without regard to case, as HTTP's auth schemes are (RFC 9110), the token as given.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(token)
}

async fn require_token(State(state): State<Arc<NodeState>>, req: Request, next: Next) -> Response {
    let given = req
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
        .unwrap_or("");
    if token_matches(given.as_bytes(), state.config.admin.token.as_bytes()) {
        next.run(req).await
    } else {
        error_response(
            StatusCode::UNAUTHORIZED,
            "missing or wrong admin bearer token",
        )
    }
}

/// Read an admin call's body whole within `limits.body_timeout_ms` (408 after, as on
/// the client port) and at most [`MAX_ADMIN_BODY`] bytes of it (413), before the
/// handler sees it: a body sent slowly would otherwise hold an admin connection, busy
/// and so never evicted, for as long as its sender liked.
async fn read_body_in_time(
    State(state): State<Arc<NodeState>>,
    req: Request,
    next: Next,
) -> Response {
    use http_body_util::BodyExt;
    let limits = &state.config.limits;
    let (parts, body) = req.into_parts();
    let read = http_body_util::Limited::new(body, MAX_ADMIN_BODY).collect();
    let wait = std::time::Duration::from_millis(limits.body_timeout_ms);
    match tokio::time::timeout(wait, read).await {
        Ok(Ok(collected)) => {
            let body = axum::body::Body::from(collected.to_bytes());
            next.run(Request::from_parts(parts, body)).await
        }
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => error_response(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("request body over {MAX_ADMIN_BODY} bytes"),
        ),
        Ok(Err(e)) => error_response(StatusCode::BAD_REQUEST, &format!("cannot read body: {e}")),
        Err(_) => error_response(
            StatusCode::REQUEST_TIMEOUT,
            &format!(
                "request body not received within {} ms",
                limits.body_timeout_ms
            ),
        ),
    }
}

/// `GET /metrics`: OpenMetrics to a scraper that asks for it (Prometheus does, in
/// its `Accept`), the Prometheus text format 0.0.4 to everyone else (`curl`,
/// `promtool check metrics`), as Prometheus' own client libraries negotiate.
///
/// One encoding at a time, on the blocking pool; a scrape shares the first encoding
/// that started after it arrived ([`NodeState`]'s `scrapes`).
async fn metrics(State(state): State<Arc<NodeState>>, headers: http::HeaderMap) -> Response {
    let arrived = std::time::Instant::now();
    let openmetrics = headers
        .get_all(http::header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    let content_type = if openmetrics {
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    } else {
        "text/plain; version=0.0.4; charset=utf-8"
    };
    let mut scrapes = state.scrapes.lock().await;
    let last = &mut scrapes[usize::from(openmetrics)];
    let body = match last.as_ref().filter(|(started, _)| *started >= arrived) {
        Some((_, body)) => body.clone(),
        None => {
            let started = std::time::Instant::now();
            let st = state.clone();
            let encoded = tokio::task::spawn_blocking(move || {
                st.refresh_gauges();
                if openmetrics {
                    st.metrics.encode()
                } else {
                    st.metrics.encode_prometheus_text()
                }
            })
            .await;
            let Ok(encoded) = encoded else {
                return error_response(StatusCode::INTERNAL_SERVER_ERROR, "encoding failed");
            };
            let body = bytes::Bytes::from(encoded);
            *last = Some((started, body.clone()));
            body
        }
    };
    drop(scrapes);
    ([(http::header::CONTENT_TYPE, content_type)], body).into_response()
}

async fn readyz(State(state): State<Arc<NodeState>>) -> Response {
    // Ready means this node can serve a request itself: not draining, and its own
    // engine passed a health check and its breaker is not open. Live peers alone are
    // not enough: right after start a node may know its peers before it has an RTT
    // sample or stats for them.
    if state.is_ready() {
        (StatusCode::OK, "ready").into_response()
    } else if state.is_draining() {
        error_response(StatusCode::SERVICE_UNAVAILABLE, "draining")
    } else if let Some(refused) = refused_island_message(&state) {
        // Its peers refuse this node's id and none takes it: a second process with a
        // live node's id, an island whose clients belong to the cluster's nodes.
        error_response(StatusCode::SERVICE_UNAVAILABLE, &refused)
    } else if state
        .engines()
        .iter()
        .all(|e| e.status() != crate::local::EngineStatus::Serving)
    {
        // An operator's `POST /admin/engines/N/drain` on every engine: the engines
        // may be healthy, this node just takes no requests for them.
        error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "every local engine drained",
        )
    } else {
        error_response(StatusCode::SERVICE_UNAVAILABLE, "local engine not healthy")
    }
}

/// What `/readyz` says of a node its peers refuse, none taking it
/// ([`crate::peers::refused_island`]): its id, who refuses it and where they hold
/// the id alive. `None` when that is not why it is not ready.
fn refused_island_message(state: &NodeState) -> Option<String> {
    let refused = crate::peers::refused_island(&*state.peers);
    let since_ms = refused.iter().map(|r| r.first_age_ms).max()?;
    let by: Vec<&str> = refused.iter().map(|r| r.by.0.as_str()).collect();
    let held_at: std::collections::BTreeSet<String> =
        refused.iter().map(|r| r.held_at.to_string()).collect();
    Some(format!(
        "node id {} is alive at {} as its peers know it ({} refused this process, for \
         {since_ms} ms): another process runs with this node's id; stop one of them",
        state.id,
        held_at.into_iter().collect::<Vec<_>>().join(", "),
        by.join(", "),
    ))
}

async fn admin_state(State(state): State<Arc<NodeState>>) -> Response {
    let now = state.now_ms();
    let engines: Vec<Value> = state.engines().iter().map(|e| e.view(now)).collect();
    // The first engine's fields at the top level too: all a one-engine node has.
    let first = engines.first().cloned().unwrap_or_default();
    let body = json!({
        "node": state.id,
        "region": state.config.node.region,
        "uptime_ms": now,
        "engine": first,
        "engines": engines,
        "queue_stats": state.local_stats(),
        "fit": first["fit"],
        "tokens": state.tokens.view(state.config.routing.block_bytes),
        "shadow_index_blocks": first["shadow_index_blocks"],
        "shadow_index_tokens": first["shadow_index_tokens"],
        "prefix_index_source": first["prefix_index_source"],
        "kv_events": first["kv_events"],
        "peers": state.peers.peers(),
        // Peers refusing this node's own id, and where each holds it alive: empty but
        // in a second process with a live node's id (docs/cluster.md, "Identity").
        "identity_refused": state.peers.identity_refusals(),
        "weights": *state.weights.read(),
        "policy": state.config.routing.policy,
        // Whether a client's `x-gorgo-policy` is honoured: `gorgo bench --policy`
        // checks it rather than label a run with a policy the node ignored.
        "allow_policy_header": state.config.routing.allow_policy_header,
        "max_hops": state.config.routing.max_hops,
        "tuning": {
            "mode": state.tuning.mode(),
            "epoch": state.tuning.epoch(),
            "leader": state.tuning.leader(),
            "is_leader": state.tuning.is_leader(),
        },
        "gossip": state.peers.gossip_counters(),
    });
    Json(body).into_response()
}

/// `POST /admin/prefix_match` body: a prompt's token ids.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PrefixMatchBody {
    token_ids: Vec<u32>,
    /// Which engine's index (default: the first).
    #[serde(default)]
    replica: u16,
}

/// An admin call's JSON body as `T`, or the answer to a bad one in OpenAI's shape: 413
/// for a body over the admin API's limit, else 400 saying what the body must be
/// (`expected`) and what was wrong with it, with `param` naming the field at fault
/// where one is (axum's own rejections are plain text, and a wrong field is a 422
/// there). The one reader of every admin body: each must be a JSON object, as its
/// `expected` says (serde also takes a struct from an array of its fields in order:
/// `[1, 2]` set the weights).
fn admin_body<T: serde::de::DeserializeOwned>(
    body: Result<Json<Value>, axum::extract::rejection::JsonRejection>,
    expected: &str,
) -> Result<T, Box<Response>> {
    let value = body.map(|Json(v)| v).map_err(|e| {
        let status = match e.status() {
            StatusCode::PAYLOAD_TOO_LARGE => StatusCode::PAYLOAD_TOO_LARGE,
            _ => StatusCode::BAD_REQUEST,
        };
        Box::new(ApiError(status, format!("{expected}: {}", e.body_text())).into_response())
    })?;
    if !value.is_object() {
        let message = format!("{expected}: a JSON object, not {}", json_kind(&value));
        return Err(Box::new(
            ApiError(StatusCode::BAD_REQUEST, message).into_response(),
        ));
    }
    serde_path_to_error::deserialize(value).map_err(|e| {
        let message = format!("{expected}: {e}");
        let inner = e.inner().to_string();
        // The field whose value is wrong; an unknown or missing one serde names in
        // its message, with the object's path.
        let path = e.path().to_string();
        let named = || inner.split('`').nth(1).map(str::to_owned);
        let (param, code) = if inner.starts_with("unknown field") {
            (named(), "unknown_field")
        } else if inner.starts_with("missing field") {
            (named(), "missing_field")
        } else if inner.starts_with("invalid type") {
            (Some(path), "invalid_type")
        } else {
            (Some(path), "invalid_value")
        };
        Box::new(match param.filter(|p| p != ".") {
            Some(param) => invalid_field_response(&param, code, &message),
            None => ApiError(StatusCode::BAD_REQUEST, message).into_response(),
        })
    })
}

/// What a JSON value is, for an error message.
fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The engine named in an admin path, or a 400 in OpenAI's shape.
fn admin_replica<T>(
    path: Result<axum::extract::Path<T>, axum::extract::rejection::PathRejection>,
) -> Result<T, ApiError> {
    path.map(|axum::extract::Path(p)| p).map_err(|e| {
        ApiError(
            StatusCode::BAD_REQUEST,
            format!(
                "the path must name an engine by its replica number (0 to 65535): {}",
                e.body_text()
            ),
        )
    })
}

/// `POST /admin/prefix_match`: how much of a tokenised prompt the node's prefix index
/// holds, in the node's blocks over token ids (what the KV events feed: checks and
/// debugging; the body limit caps the prompt).
async fn prefix_match(
    State(state): State<Arc<NodeState>>,
    body: Result<Json<Value>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let body: PrefixMatchBody = match admin_body(
        body,
        "body must be {\"token_ids\": [integers], \"replica\"}",
    ) {
        Ok(b) => b,
        Err(e) => return *e,
    };
    let chain = gorgo_core::HashChain::from_token_ids(
        &body.token_ids,
        crate::kv_events::node_block_tokens(&state.config),
    );
    let Some(engine) = state.engine(body.replica) else {
        return error_response(StatusCode::NOT_FOUND, "no such engine");
    };
    let cache = engine.shadow.lock();
    let blocks = cache.longest_match_blocks(&chain);
    Json(json!({
        "source": cache.source(),
        "blocks": blocks,
        "tokens": chain.prefix_tokens(blocks),
    }))
    .into_response()
}

/// `GET /admin/engines`: every engine the node fronts, each as `/admin/state` shows
/// it (replica, url, status, health, accounting, fit, index).
async fn list_engines(State(state): State<Arc<NodeState>>) -> Response {
    let now = state.now_ms();
    let engines: Vec<Value> = state.engines().iter().map(|e| e.view(now)).collect();
    Json(engines).into_response()
}

/// `POST /admin/engines`: add an engine, its body an `[[engines]]` entry as JSON
/// (`{"url": ..., "kind": ...}` and any other field of it). 201 with the engine as
/// `GET /admin/engines` shows it; 400 naming the field that is wrong.
async fn add_engine(
    State(state): State<Arc<NodeState>>,
    body: Result<Json<Value>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let engine: crate::config::EngineSection =
        match admin_body(body, "body must be an `[[engines]]` entry as a JSON object") {
            Ok(b) => b,
            Err(e) => return *e,
        };
    match state.add_engine(engine) {
        Ok(e) => (StatusCode::CREATED, Json(e.view(state.now_ms()))).into_response(),
        Err(e) => refused_change(e),
    }
}

/// The answer to an engine change the node refused: 409 for a conflict with its state
/// now, else 400 naming the request's field (in the message and, where the error
/// knows it, in `param`); the message without the `config:` the node's own log lines
/// put before a config error.
fn refused_change(e: crate::NodeError) -> Response {
    match e {
        crate::NodeError::Conflict(m) => error_response(StatusCode::CONFLICT, &m),
        crate::NodeError::InvalidField { field, reason } => invalid_field_response(
            &field,
            "invalid_value",
            &format!("invalid `{field}`: {reason}"),
        ),
        crate::NodeError::Config(m) => error_response(StatusCode::BAD_REQUEST, &m),
        other => error_response(StatusCode::BAD_REQUEST, &other.to_string()),
    }
}

/// `DELETE /admin/engines/{replica}`: drain the engine (no new requests; its stats say
/// draining, so peers stop counting on it), then drop it once its requests are done.
/// 202; 404 when no such engine; 409 for the node's last engine in rotation
/// ([`crate::NodeState::remove_engine`]).
async fn remove_engine(
    State(state): State<Arc<NodeState>>,
    path: Result<axum::extract::Path<u16>, axum::extract::rejection::PathRejection>,
) -> Response {
    let replica = match admin_replica(path) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    match state.remove_engine(replica) {
        Ok(true) => (
            StatusCode::ACCEPTED,
            Json(json!({"replica": replica, "status": "removing"})),
        )
            .into_response(),
        Ok(false) => error_response(StatusCode::NOT_FOUND, "no such engine"),
        Err(e) => refused_change(e),
    }
}

/// `POST /admin/engines/{replica}/drain` (no new requests, it stays) and
/// `.../serve` (back in rotation; not for an engine being removed).
async fn engine_action(
    State(state): State<Arc<NodeState>>,
    path: Result<axum::extract::Path<(u16, String)>, axum::extract::rejection::PathRejection>,
) -> Response {
    let (replica, action) = match admin_replica(path) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let Some(engine) = state.engine(replica) else {
        return error_response(StatusCode::NOT_FOUND, "no such engine");
    };
    match action.as_str() {
        "drain" => engine.start_draining(),
        // Refused in the same step that would put it back: a removal racing with
        // this call either happened first (refused) or comes after (it wins).
        "serve" if !engine.start_serving() => {
            return error_response(StatusCode::CONFLICT, "the engine is being removed")
        }
        "serve" => {}
        _ => return error_response(StatusCode::NOT_FOUND, "actions: drain, serve"),
    }
    Json(engine.view(state.now_ms())).into_response()
}

async fn peers(State(state): State<Arc<NodeState>>) -> Response {
    Json(state.peers.peers()).into_response()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DecisionsQuery {
    limit: Option<usize>,
    /// Newest decisions to skip: the next page starts where the last one ended.
    offset: Option<usize>,
}

async fn decisions(
    State(state): State<Arc<NodeState>>,
    query: Result<Query<DecisionsQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let (limit, offset) = match query {
        Ok(Query(q)) => (q.limit.unwrap_or(50), q.offset.unwrap_or(0)),
        Err(e) => return ApiError(StatusCode::BAD_REQUEST, e.body_text()).into_response(),
    };
    if limit > MAX_DECISIONS_PER_PAGE {
        let message = format!("limit: at most {MAX_DECISIONS_PER_PAGE}");
        return invalid_field_response("limit", "invalid_value", &message);
    }
    let page = state.router.recent(offset, limit);
    Json(page.iter().map(|r| r.as_ref()).collect::<Vec<_>>()).into_response()
}

/// Most decisions one `/admin/decisions` answers: they are copied under the lock
/// every routing decision takes, each with all its candidates, so a dashboard asking
/// for the whole log (up to 100,000) would stall routing and send hundreds of MB.
const MAX_DECISIONS_PER_PAGE: usize = 1000;

async fn get_weights(State(state): State<Arc<NodeState>>) -> Response {
    Json(weights_body(&state)).into_response()
}

fn weights_body(state: &NodeState) -> serde_json::Value {
    let w = state.tuning.weights();
    json!({
        "w_rtt": w.w_rtt,
        "w_queue": w.w_queue,
        "mode": state.tuning.mode(),
        "epoch": state.tuning.epoch(),
    })
}

/// `PUT /admin/weights`: `{"w_rtt", "w_queue"}` fixes the weights (mode `static`);
/// `{"mode": "online" | "tune-then-freeze"}` hands them back to the tuner, which
/// rejoins the cluster's line of proposals; `{"mode": "static"}` alone freezes the
/// weights in use.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WeightsBody {
    #[serde(default)]
    w_rtt: Option<f64>,
    #[serde(default)]
    w_queue: Option<f64>,
    #[serde(default)]
    mode: Option<TuningMode>,
}

async fn put_weights(
    State(state): State<Arc<NodeState>>,
    body: Result<Json<Value>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let body: WeightsBody =
        match admin_body(body, "body must be {\"w_rtt\", \"w_queue\", \"mode\"}") {
            Ok(w) => w,
            Err(e) => return *e,
        };
    // One rule with the config's, so that weights it took can be put back.
    let given = Weights {
        w_rtt: body.w_rtt.unwrap_or(0.0),
        w_queue: body.w_queue.unwrap_or(0.0),
    };
    if let Some(name) = given.out_of_range() {
        let message = format!("`{name}` must be in [0, {}]", gorgo_core::types::MAX_WEIGHT);
        return invalid_field_response(name, "invalid_value", &message);
    }
    let weights = match (body.w_rtt, body.w_queue) {
        (Some(w_rtt), Some(w_queue)) => Some(Weights { w_rtt, w_queue }),
        (None, None) => None,
        (Some(_), None) => {
            let message = "give both `w_rtt` and `w_queue`, or neither";
            return invalid_field_response("w_queue", "missing_field", message);
        }
        (None, Some(_)) => {
            let message = "give both `w_rtt` and `w_queue`, or neither";
            return invalid_field_response("w_rtt", "missing_field", message);
        }
    };
    let mode = match (body.mode, weights) {
        (Some(TuningMode::Static) | None, Some(_)) => TuningMode::Static,
        (Some(m), None) => m,
        (Some(m), Some(_)) => {
            return invalid_field_response(
                "mode",
                "invalid_value",
                &format!(
                    "weights can only be set with mode `static` (mode `{}` tunes them)",
                    serde_json::to_value(m)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default()
                ),
            )
        }
        (None, None) => {
            return ApiError(
                StatusCode::BAD_REQUEST,
                "give `w_rtt` and `w_queue`, or `mode`".into(),
            )
            .into_response()
        }
    };
    if let Err(e) = state.set_tuning_mode(mode, weights) {
        return ApiError(StatusCode::BAD_REQUEST, e.to_string()).into_response();
    }
    let w = state.tuning.weights();
    tracing::info!(
        w_rtt = w.w_rtt,
        w_queue = w.w_queue,
        ?mode,
        "weights set through the admin API"
    );
    Json(weights_body(&state)).into_response()
}

async fn tuning(State(state): State<Arc<NodeState>>) -> Response {
    Json(state.tuning.view()).into_response()
}
