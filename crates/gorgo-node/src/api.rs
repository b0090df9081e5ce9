//! The node's API surface, a leaf module: the headers it reads and writes, the OpenAI
//! error body, the request and response types of the request path, and the one mapping
//! from a serving failure to an HTTP status. The ingress (clients), the forward
//! protocol (peers) and `serve` (the decision) all speak these; this module imports
//! none of them (only `stream_usage`, itself a leaf, for what a request carries).

use std::pin::Pin;

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::Stream;
use gorgo_core::cost::CostTerms;
use gorgo_core::policy::PolicyKind;
use gorgo_core::{Endpoint, HashChain, NodeId, Weights};

use crate::stream_usage::StreamUsage;

/// The client API's headers (defined in the core, shared with the bench client).
pub use gorgo_core::headers::{
    session_key, HOPS_HEADER, POLICY_HEADER, PREDICTED_TTFT_HEADER, SERVED_BY_HEADER,
    SESSION_HEADER,
};

/// The OpenAI error body for `status` with `message`, the code the status implies.
pub fn error_json(status: u16, message: &str) -> String {
    error_json_detailed(status, message, None, None)
}

/// The OpenAI error body with an explicit `code` (e.g. `context_length_exceeded`)
/// and the request field it is about (`param`).
pub fn error_json_detailed(
    status: u16,
    message: &str,
    code: Option<&str>,
    param: Option<&str>,
) -> String {
    let (kind, default_code) = match status {
        400 => ("invalid_request_error", "invalid_request"),
        401 => ("authentication_error", "invalid_token"),
        404 => ("invalid_request_error", "not_found"),
        405 => ("invalid_request_error", "method_not_allowed"),
        408 => ("invalid_request_error", "request_timeout"),
        409 => ("invalid_request_error", "conflict"),
        413 => ("invalid_request_error", "request_too_large"),
        429 => ("rate_limit_error", "rate_limit_exceeded"),
        431 => ("invalid_request_error", "request_header_too_large"),
        502 => ("server_error", "engine_failed"),
        503 => ("server_error", "unavailable"),
        504 => ("server_error", "timeout"),
        _ => ("server_error", "error"),
    };
    serde_json::json!({
        "error": {
            "message": message,
            "type": kind,
            "param": param,
            "code": code.unwrap_or(default_code),
        }
    })
    .to_string()
}

/// An error response in OpenAI's shape.
pub fn error_response(status: StatusCode, message: &str) -> Response {
    json_error_response(status, error_json(status.as_u16(), message))
}

/// 404 in OpenAI's shape: the routers' fallback.
pub async fn not_found() -> Response {
    error_response(StatusCode::NOT_FOUND, "unknown route")
}

/// 405 in OpenAI's shape: the routers' answer to a known path with the wrong method.
pub async fn method_not_allowed() -> Response {
    error_response(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
}

/// A 400 about one request field, in OpenAI's shape (`param` names the field).
pub fn invalid_field_response(param: &str, code: &str, message: &str) -> Response {
    json_error_response(
        StatusCode::BAD_REQUEST,
        error_json_detailed(400, message, Some(code), Some(param)),
    )
}

/// An overload answer (429 or 503) with `Retry-After`, so clients back off instead
/// of retrying at once.
pub fn overloaded_response(status: StatusCode, message: &str, retry_after_s: u64) -> Response {
    let mut resp = error_response(status, message);
    resp.headers_mut()
        .insert(http::header::RETRY_AFTER, HeaderValue::from(retry_after_s));
    resp
}

fn json_error_response(status: StatusCode, body: String) -> Response {
    let mut resp = Response::new(Body::from(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// On a peer's forward only, set by the node that sends it: the tokens of the
/// request's longest prompt as the origin counted them. A forward carries the chain of
/// the whole prompt, and a completions batch is checked against the context prompt by
/// prompt (as vLLM checks it), which the chain alone cannot tell; a header rather than
/// a field of the forward message, so that nodes of the last build, which neither send
/// nor read it, still talk to this one (the peer then checks the whole chain).
pub const LONGEST_PROMPT_HEADER: &str = "x-gorgo-longest-prompt-tokens";

/// On a forward's response head only, set by the node that served it: the status of
/// its engine's own server error ([`ServeError::EngineAnswered`]), whose body follows
/// the head as the engine gave it, with the engine's passed headers in the head. The
/// head's own status stays 502, what the request path makes of such an answer: the
/// origin serves the request elsewhere where it can, and only a client with nowhere
/// else to go gets the engine's answer. A header rather than a field of the head, so
/// that nodes of the last build, which neither send nor read it, still talk to this
/// one (to them it is the 502 it always was).
pub const ENGINE_ANSWER_HEADER: &str = "x-gorgo-engine-answer";

/// Response headers from the engine that travel to the client. `x-accel-buffering: no`
/// is how an engine's event stream (llama-cpp-python's, through sse-starlette) tells
/// an nginx in front of the node not to hold its events back; `retry-after` comes with
/// an engine's own 503 or 429, which a client with nowhere else to go gets as it is.
pub const PASS_RESPONSE_HEADERS: &[&str] = &[
    "content-type",
    "cache-control",
    "x-request-id",
    "x-accel-buffering",
    "retry-after",
];
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
    /// The client's body, unchanged (a forward carries it so; the serving node derives
    /// what it sends its engine from it: [`StreamUsage::engine_body`]).
    pub body: Bytes,
    /// What the client asked of a streamed response's usage, read from `body`: the
    /// serving node asks its engine for usage either way and strips what the client
    /// did not ask for (`crate::stream_usage`).
    pub stream_usage: StreamUsage,
    /// Headers passed to the engine.
    pub headers: Vec<(String, String)>,
    /// The prompt's chain.
    pub chain: HashChain,
    /// Tokens of the request's longest prompt, what the context check compares: the
    /// chain's total but for a completions batch, which the engine checks prompt by
    /// prompt ([`crate::tokens::CountedPrompt`]). A forward brings the origin's count
    /// ([`LONGEST_PROMPT_HEADER`]).
    pub longest_prompt_tokens: u64,
    /// The canonical prompt's size and shape, when this node rendered it (not for a
    /// peer's forward): with the engine's `usage.prompt_tokens`, what the node's token
    /// estimate learns from.
    pub canonical: Option<gorgo_core::prompt::CanonicalSize>,
    /// Hops taken so far.
    pub hops: u8,
    /// The nodes this request has left, the origin first (a forward's `via`): none of
    /// them is a candidate here, so it never goes back.
    pub via: Vec<NodeId>,
    /// Policy override (`x-gorgo-policy`).
    pub policy: Option<PolicyKind>,
    /// Hash of `x-session-id`, when sent.
    pub session_key: Option<u64>,
    /// The raw `x-session-id`, passed on to peers.
    pub session_id: Option<String>,
    /// The `model` the body names, if any: only regions serving it are candidates.
    pub model: Option<String>,
    /// The node the client talks to.
    pub origin: NodeId,
    /// For a peer's forward: the request's id at its origin (the decision log joins
    /// the two nodes' records by it); `None` for this node's own clients.
    pub origin_request_id: Option<u64>,
    /// The cost weights to route with: the tuning epoch's, fixed at admission so the
    /// request is routed with the weights of the epoch it is attributed to.
    pub weights: gorgo_core::Weights,
    /// For a peer's forward: what serving it at that peer would have cost (this node
    /// may refuse the forward against it, `routing.refuse_forwards`).
    pub offer: Option<gorgo_core::decision::ForwardOffer>,
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
    /// The prompt does not fit the engine's context (400 `context_length_exceeded`).
    ContextLength {
        /// The endpoint called, which names the field at fault: `messages` on chat,
        /// `prompt` on completions.
        endpoint: Endpoint,
        /// What does not fit.
        message: String,
    },
    /// No region of the cluster serves the model the request names (404
    /// `model_not_found`, as OpenAI answers); holds the model.
    ModelNotFound(String),
    /// This node refused a peer's forward: serving it here would cost more than the
    /// peer said serving it there would (503 on the forward stream, never to a client:
    /// only forwards carry a cost to refuse against).
    Refused(gorgo_core::decision::Refusal),
    /// An engine (this node's, or through a forward a peer's) answered a server error
    /// (5xx) before anything reached the client. To the request path a failure like
    /// [`ServeError::Failed`] (routed again without that engine or peer; a 502 head
    /// with [`ENGINE_ANSWER_HEADER`] on a forward, which its origin serves elsewhere),
    /// but a client with nowhere else to go gets the engine's own answer, as it would
    /// from the engine directly: llama-cpp-python answers a request it cannot parse (a
    /// message role it does not know) 500 with what is wrong, and the client got
    /// "engine answered 500" instead ([`ServeError::response`]).
    EngineAnswered(EngineAnswer),
}

/// An engine's error answer, held whole so that it can still reach the client after
/// the request was routed again ([`ServeError::EngineAnswered`]).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineAnswer {
    /// The engine's status.
    pub status: u16,
    /// The engine's response headers that travel to clients ([`PASS_RESPONSE_HEADERS`]).
    pub headers: Vec<(String, String)>,
    /// The engine's body, read whole (at most [`ENGINE_ANSWER_MAX_BYTES`]).
    pub body: Bytes,
}

/// The largest error answer of an engine the node holds to pass on (a validation
/// error with its traceback is a few KiB); a larger one is a plain 502.
pub const ENGINE_ANSWER_MAX_BYTES: usize = 64 * 1024;

impl EngineAnswer {
    /// The engine's status as a status code (a 502 for a number that is none: an
    /// answer is only ever built from a 5xx head).
    pub fn status_code(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::BAD_GATEWAY)
    }

    /// What the engine said went wrong: its OpenAI error's `message` (or FastAPI's
    /// `detail`), else its body as text, at most 512 characters, after the status.
    pub fn message(&self) -> String {
        let said = serde_json::from_slice::<serde_json::Value>(&self.body)
            .ok()
            .and_then(|v| {
                let m = v.pointer("/error/message").or_else(|| v.get("detail"))?;
                Some(m.as_str().map_or_else(|| m.to_string(), str::to_owned))
            })
            .unwrap_or_else(|| String::from_utf8_lossy(&self.body).into_owned());
        let said: String = said.chars().take(512).collect();
        if said.trim().is_empty() {
            format!("engine answered {}", self.status)
        } else {
            format!("engine answered {}: {said}", self.status)
        }
    }
}

/// A response on its way to the client.
pub struct Upstream {
    /// HTTP status.
    pub status: u16,
    /// Headers to pass on.
    pub headers: Vec<(String, String)>,
    /// The region that served, as it said (a peer's forward head): the
    /// `x-gorgo-served-by` header, and the head of a forward served here.
    pub served_by: String,
    /// The region the request metric's `served_by` label names: this node's, or for a
    /// forward one membership knows ([`crate::forward::forward`]). Never a string only
    /// the wire vouches for: a peer could make a new series per response.
    pub served_by_label: String,
    /// Hops taken.
    pub hops: u8,
    /// The bytes.
    pub body: BodyStream,
    /// The deciding node's terms for the candidate it chose and the weights it priced
    /// them with (set where the decision was made; `None` for a served forward): the
    /// tuner's start-fit evidence once the client's TTFT is known.
    pub chosen_terms: Option<(CostTerms, Weights)>,
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

impl ServeError {
    /// The HTTP status a client gets ([`ServeError::response`]), and the outcome label
    /// of the request metric: the one mapping of the request path. An engine's own
    /// error answer is what the client gets of it: the engine's status, and
    /// `engine_error`, the outcome of every engine error status relayed to a client
    /// (a passed-through route's 500, a routed request's 4xx); it was 502
    /// `engine_failed` though the client got the engine's 500. On a forward's head it
    /// is a 502 all the same (`crate::forward`), so that the origin serves it
    /// elsewhere.
    pub fn status(&self) -> (StatusCode, &'static str) {
        match self {
            ServeError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            ServeError::Failed(_) => (StatusCode::BAD_GATEWAY, "engine_failed"),
            ServeError::EngineAnswered(answer) => (answer.status_code(), "engine_error"),
            ServeError::Timeout(_) => (StatusCode::GATEWAY_TIMEOUT, "timeout"),
            ServeError::ContextLength { .. } => (StatusCode::BAD_REQUEST, "bad_request"),
            ServeError::ModelNotFound(_) => (StatusCode::NOT_FOUND, "model_not_found"),
            ServeError::Refused(_) => (StatusCode::SERVICE_UNAVAILABLE, "refused"),
        }
    }

    /// What went wrong, for the error body.
    pub fn message(&self) -> String {
        match self {
            ServeError::Unavailable(m)
            | ServeError::Failed(m)
            | ServeError::Timeout(m)
            | ServeError::ContextLength { message: m, .. } => m.clone(),
            ServeError::ModelNotFound(model) => format!(
                "The model `{model}` does not exist or is not served by any region of this cluster."
            ),
            ServeError::Refused(r) => format!(
                "forward refused: {:.0} ms here against {:.0} ms at the forwarding node",
                r.local_cost_ms, r.origin_cost_ms
            ),
            ServeError::EngineAnswered(answer) => answer.message(),
        }
    }

    /// The OpenAI error code of the body, where the status alone does not say it.
    pub fn code(&self) -> Option<&'static str> {
        match self {
            ServeError::ContextLength { .. } => Some("context_length_exceeded"),
            ServeError::ModelNotFound(_) => Some("model_not_found"),
            _ => None,
        }
    }

    /// The request field the error is about.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            ServeError::ContextLength {
                endpoint: Endpoint::Chat,
                ..
            } => Some("messages"),
            ServeError::ContextLength {
                endpoint: Endpoint::Completions,
                ..
            } => Some("prompt"),
            ServeError::ModelNotFound(_) => Some("model"),
            _ => None,
        }
    }

    /// The error as a client response, in OpenAI's shape; an engine's own error answer
    /// as the engine gave it (status, body and passed headers).
    pub fn response(&self) -> Response {
        if let ServeError::EngineAnswered(answer) = self {
            let mut resp = Response::new(Body::from(answer.body.clone()));
            *resp.status_mut() = answer.status_code();
            for (k, v) in &answer.headers {
                if let (Ok(name), Ok(value)) = (
                    http::HeaderName::from_bytes(k.as_bytes()),
                    HeaderValue::from_str(v),
                ) {
                    resp.headers_mut().insert(name, value);
                }
            }
            return resp;
        }
        let status = self.status().0;
        json_error_response(
            status,
            error_json_detailed(status.as_u16(), &self.message(), self.code(), self.param()),
        )
    }

    /// Whether the failure was the serving engine's (or peer's), so the request may
    /// still be served elsewhere; a request the engine can never take is not.
    pub fn may_fall_back(&self) -> bool {
        matches!(
            self,
            ServeError::Failed(_)
                | ServeError::Timeout(_)
                | ServeError::Unavailable(_)
                | ServeError::EngineAnswered(_)
        )
    }
}

/// Turn an error into a response for handlers outside this module.
pub struct ApiError(pub StatusCode, pub String);
impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        error_response(self.0, &self.1)
    }
}
