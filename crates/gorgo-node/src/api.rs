//! The node's API surface, a leaf module: the headers it reads and writes, the OpenAI
//! error body, the request and response types of the request path, and the one mapping
//! from a serving failure to an HTTP status. The ingress (clients), the forward
//! protocol (peers) and `serve` (the decision) all speak these; this module imports
//! none of them.

use std::pin::Pin;

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::Stream;
use gorgo_core::policy::PolicyKind;
use gorgo_core::{Endpoint, HashChain, NodeId};

/// The client API's headers (defined in the core, shared with the bench client).
pub use gorgo_core::headers::{
    session_key, HOPS_HEADER, POLICY_HEADER, PREDICTED_TTFT_HEADER, SERVED_BY_HEADER,
    SESSION_HEADER,
};

/// The OpenAI error body for `status` with `message`.
pub fn error_json(status: u16, message: &str) -> String {
    let (kind, code) = match status {
        400 => ("invalid_request_error", "invalid_request"),
        401 => ("authentication_error", "invalid_token"),
        404 => ("invalid_request_error", "not_found"),
        405 => ("invalid_request_error", "method_not_allowed"),
        413 => ("invalid_request_error", "request_too_large"),
        502 => ("server_error", "engine_failed"),
        503 => ("server_error", "unavailable"),
        504 => ("server_error", "timeout"),
        _ => ("server_error", "error"),
    };
    serde_json::json!({
        "error": {"message": message, "type": kind, "param": null, "code": code}
    })
    .to_string()
}

/// An error response in OpenAI's shape.
pub fn error_response(status: StatusCode, message: &str) -> Response {
    let mut resp = Response::new(Body::from(error_json(status.as_u16(), message)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// Response headers from the engine that travel to the client.
pub const PASS_RESPONSE_HEADERS: &[&str] = &["content-type", "cache-control", "x-request-id"];
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

impl ServeError {
    /// The HTTP status a client (or, through a forward, the origin) gets, and the
    /// outcome label of the request metric: the one mapping of the request path.
    pub fn status(&self) -> (StatusCode, &'static str) {
        match self {
            ServeError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            ServeError::Failed(_) => (StatusCode::BAD_GATEWAY, "engine_failed"),
            ServeError::Timeout(_) => (StatusCode::GATEWAY_TIMEOUT, "timeout"),
        }
    }

    /// What went wrong, for the error body.
    pub fn message(&self) -> &str {
        match self {
            ServeError::Unavailable(m) | ServeError::Failed(m) | ServeError::Timeout(m) => m,
        }
    }
}

/// Turn an error into a response for handlers outside this module.
pub struct ApiError(pub StatusCode, pub String);
impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        error_response(self.0, &self.1)
    }
}
