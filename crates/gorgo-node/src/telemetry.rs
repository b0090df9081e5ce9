//! Traces of the request path (docs/node.md, "Tracing"): a span for each client
//! request (`request`), its routing decision (`decide`), the forward to a peer
//! (`forward`), the forwarded request at the peer (`forwarded`) and the time at the
//! local engine until its response ends (`engine`). W3C trace context (`traceparent`,
//! `tracestate`) joins them across the forward hop, and from the client and to the
//! engine, so that one trace spans every node a request passed through.
//!
//! The node only creates `tracing` spans. Whether they become OpenTelemetry spans,
//! and where those go, is up to the subscriber: the binary installs [`layer`] over
//! [`otlp_provider`] when `[telemetry] otlp_endpoint` is set, tests over an in-memory
//! exporter. Without the layer no trace context is read or passed on and nothing is
//! exported; the spans cost what plain `tracing` spans cost.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use bytes::Bytes;
use gorgo_core::NodeId;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::field::Empty;
use tracing::{Instrument, Span};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

use crate::api::{HOPS_HEADER, SERVED_BY_HEADER};
use crate::config::TelemetrySection;
use crate::engine::read_capped;
use crate::error::NodeError;
use crate::route::Target;
use crate::NodeState;

/// The W3C trace context header (the trace and the parent span).
pub const TRACEPARENT: &str = "traceparent";
/// The W3C vendor trace state header, passed on with [`TRACEPARENT`].
pub const TRACESTATE: &str = "tracestate";

/// Time allowed for one OTLP export request.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The `tracing` layer that makes the node's spans OpenTelemetry spans of
/// `provider`'s tracer. Only this crate's spans and events: the dependencies' (hyper,
/// quinn, foca) would bury the request path.
pub fn layer<S>(provider: &SdkTracerProvider) -> impl Layer<S> + Send + Sync + 'static
where
    S: tracing::Subscriber + for<'span> LookupSpan<'span> + Send + Sync,
{
    tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("gorgo-node"))
        // The spans are made here, in this module: source location and target would
        // say so on every one. Threads say nothing on a work-stealing runtime.
        .with_location(false)
        .with_target(false)
        .with_threads(false)
        .with_filter(Targets::new().with_target("gorgo_node", tracing::Level::INFO))
}

/// The tracer provider that sends spans in batches by OTLP/HTTP (protobuf) to
/// `otlp_endpoint`, or `None` when none is configured. `runtime` carries the export
/// requests (`RuntimeHttpClient`). Shut it down before the runtime ends, so that
/// the last batch goes out.
pub fn otlp_provider(
    config: &TelemetrySection,
    node: &NodeId,
    runtime: tokio::runtime::Handle,
) -> Result<Option<SdkTracerProvider>, NodeError> {
    let Some(endpoint) = &config.otlp_endpoint else {
        return Ok(None);
    };
    let client = reqwest::Client::builder()
        .timeout(EXPORT_TIMEOUT)
        .build()
        .map_err(|e| NodeError::Telemetry(format!("OTLP HTTP client: {e}")))?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_endpoint(endpoint.clone())
        .with_timeout(EXPORT_TIMEOUT)
        .with_http_client(RuntimeHttpClient { client, runtime })
        .build()
        .map_err(|e| NodeError::Telemetry(format!("OTLP exporter for {endpoint}: {e}")))?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(config.service_name.clone())
        .with_attribute(opentelemetry::KeyValue::new(
            "service.instance.id",
            node.0.clone(),
        ))
        .build();
    Ok(Some(
        SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource)
            .build(),
    ))
}

/// Cap on an OTLP collector's answer to an export (a few bytes: an empty or partial
/// success message).
const MAX_COLLECTOR_ANSWER_BYTES: usize = 1 << 20;

/// The OTLP exporter's HTTP client: the workspace's reqwest client, run on the node's
/// tokio runtime. The SDK's batch processor exports from a thread of its own, outside
/// any runtime, so each request is handed to the runtime and awaited from there; this
/// spares the node a second HTTP stack (opentelemetry-otlp's own clients are a newer
/// reqwest, or a blocking one).
#[derive(Debug)]
struct RuntimeHttpClient {
    client: reqwest::Client,
    runtime: tokio::runtime::Handle,
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for RuntimeHttpClient {
    async fn send_bytes(
        &self,
        request: http::Request<Bytes>,
    ) -> Result<http::Response<Bytes>, opentelemetry_http::HttpError> {
        let request = reqwest::Request::try_from(request)?;
        let client = self.client.clone();
        let sent = self.runtime.spawn(async move {
            let resp = client.execute(request).await?;
            let mut answer = http::Response::new(Bytes::new());
            *answer.status_mut() = resp.status();
            *answer.headers_mut() = resp.headers().clone();
            let body = read_capped(resp, MAX_COLLECTOR_ANSWER_BYTES)
                .await
                .ok_or("the collector's answer broke off or ran over 1 MiB")?;
            *answer.body_mut() = Bytes::from(body);
            Ok::<_, opentelemetry_http::HttpError>(answer)
        });
        sent.await?
    }
}

/// The W3C trace context of `span` as request headers, to send with work done for it
/// elsewhere (a forward, the engine request); empty when no OpenTelemetry layer
/// records the span.
pub fn trace_headers(span: &Span) -> Vec<(String, String)> {
    let mut carrier: HashMap<String, String> = HashMap::new();
    TraceContextPropagator::new().inject_context(&span.context(), &mut carrier);
    carrier.into_iter().collect()
}

/// Make `span` a child of the W3C trace context in `headers` (a client's, or the
/// forwarding node's), when there is one. Call it before the span is entered.
pub fn set_remote_parent<'h>(span: &Span, headers: impl IntoIterator<Item = (&'h str, &'h str)>) {
    let carrier: HashMap<String, String> = headers
        .into_iter()
        .filter(|(k, _)| k.eq_ignore_ascii_case(TRACEPARENT) || k.eq_ignore_ascii_case(TRACESTATE))
        .map(|(k, v)| (k.to_ascii_lowercase(), v.to_owned()))
        .collect();
    if carrier.contains_key(TRACEPARENT) {
        let parent = TraceContextPropagator::new().extract(&carrier);
        // Fails only when no OpenTelemetry layer records the span: nothing to join.
        let _ = span.set_parent(parent);
    }
}

/// Ingress middleware: each client request (`POST`: completions and the endpoints
/// passed to the engine) runs in a [`request_span`], open until its response body
/// ends. `GET`s (probes, `/v1/models`) are not traced: a load balancer's health
/// checks would be most of the traces.
pub async fn trace_request(
    State(state): State<Arc<NodeState>>,
    request: Request,
    next: Next,
) -> Response {
    if request.method() == http::Method::GET {
        return next.run(request).await;
    }
    let span = request_span(&state.id, request.uri().path(), request.headers());
    in_request_span(span, next.run(request)).await
}

/// The span of a client request at the node it arrived at, a child of the client's
/// `traceparent` when it sent one.
pub fn request_span(node: &NodeId, path: &str, headers: &http::HeaderMap) -> Span {
    let span = tracing::info_span!(
        "request",
        otel.kind = "server",
        node = %node,
        url.path = path,
        http.response.status_code = Empty,
        served_by = Empty,
        hops = Empty,
    );
    set_remote_parent(
        &span,
        headers
            .iter()
            .filter_map(|(k, v)| Some((k.as_str(), v.to_str().ok()?))),
    );
    span
}

/// Run a request handler in `span`, and keep the span open until the response body
/// ends (or the client goes away): a streamed response is most of a request's time.
pub async fn in_request_span(span: Span, handler: impl Future<Output = Response>) -> Response {
    let resp = handler.instrument(span.clone()).await;
    span.record("http.response.status_code", resp.status().as_u16());
    for (field, header) in [("served_by", SERVED_BY_HEADER), ("hops", HOPS_HEADER)] {
        if let Some(v) = resp.headers().get(header).and_then(|v| v.to_str().ok()) {
            span.record(field, v);
        }
    }
    resp.map(|inner| Body::new(InSpan { inner, _span: span }))
}

/// A response body that holds its request's span open until it is dropped. It passes
/// on the body's size, so a whole response keeps its `content-length`.
struct InSpan {
    inner: Body,
    _span: Span,
}

impl http_body::Body for InSpan {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The span of a forward a peer sent this node, a child of the peer's `forward`
/// span (its context travels in the forwarded request's headers).
pub fn forwarded_span(
    node: &NodeId,
    from: &NodeId,
    hops: u8,
    headers: &[(String, String)],
) -> Span {
    let span = tracing::info_span!(
        "forwarded",
        otel.kind = "server",
        node = %node,
        from = %from,
        hops,
    );
    set_remote_parent(&span, headers.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    span
}

/// The span of one routing decision; [`record_decision`] fills in its outcome.
pub fn decide_span(node: &NodeId, policy: gorgo_core::policy::PolicyKind) -> Span {
    tracing::info_span!(
        "decide",
        node = %node,
        policy = policy.as_str(),
        candidates = Empty,
        chosen = Empty,
        reason = Empty,
    )
}

/// Record a decision's outcome on the current span (the [`decide_span`] it ran in):
/// how many candidates it weighed, the node it chose (empty: none could serve) and
/// why.
pub fn record_decision(candidates: usize, local: &NodeId, target: &Target, reason: &str) {
    let chosen = match target {
        Target::Local(_) => local.0.as_str(),
        Target::Peer(peer) => peer.0.as_str(),
        Target::Nothing => "",
    };
    let span = Span::current();
    span.record("candidates", candidates);
    span.record("chosen", chosen);
    span.record("reason", reason);
}

/// The span of a forward to `peer`, open until the peer's response ends.
pub fn forward_span(node: &NodeId, peer: &NodeId, hops: u8) -> Span {
    tracing::info_span!("forward", otel.kind = "client", node = %node, peer = %peer, hops)
}

/// The span of a request at the local engine, open until its response ends.
pub fn engine_span(node: &NodeId) -> Span {
    tracing::info_span!(
        "engine",
        otel.kind = "client",
        node = %node,
        http.response.status_code = Empty,
    )
}
