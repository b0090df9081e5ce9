//! Traces across the forward hop: two nodes in one process, their spans recorded by
//! an in-memory OpenTelemetry exporter through the node's own layer. A request that
//! node `a` forwards to `b` is one trace, under the client's `traceparent`: `b`'s
//! spans are children of `a`'s `forward` span. And the OTLP exporter the binary
//! builds from `[telemetry]` posts spans to a collector.
mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;
use gorgo_node::mesh::Mesh;
use opentelemetry::trace::{SpanId, TraceId, Tracer as _, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tracing_subscriber::layer::SubscriberExt as _;

/// The client's own trace and span, sent as `traceparent`.
const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";
/// How long spans may take to end after the client has its response: each closes when
/// its body is dropped, just after the last byte went out.
const SPANS_DEADLINE: Duration = Duration::from_secs(10);

fn attr(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

/// The spans of `trace` that have ended, by (name, node).
fn spans_of(
    exporter: &InMemorySpanExporter,
    trace: TraceId,
) -> HashMap<(String, String), SpanData> {
    exporter
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|s| s.span_context.trace_id() == trace)
        .map(|s| {
            (
                (s.name.to_string(), attr(&s, "node").unwrap_or_default()),
                s,
            )
        })
        .collect()
}

/// Wait (bounded) until `trace` holds every span in `names` (name, node).
async fn wait_for_spans(
    exporter: &InMemorySpanExporter,
    trace: TraceId,
    names: &[(&str, &str)],
) -> HashMap<(String, String), SpanData> {
    let deadline = Instant::now() + SPANS_DEADLINE;
    loop {
        let spans = spans_of(exporter, trace);
        let missing: Vec<_> = names
            .iter()
            .filter(|(n, node)| !spans.contains_key(&((*n).to_owned(), (*node).to_owned())))
            .collect();
        if missing.is_empty() {
            return spans;
        }
        assert!(
            Instant::now() < deadline,
            "spans {missing:?} never ended; have {:?}",
            spans.keys().collect::<Vec<_>>()
        );
        // Spans end on the server's side of the response; poll, bounded above.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// A current-thread runtime: every task of both nodes runs on this thread, which is
// where the in-memory subscriber is installed (no process-wide provider).
#[tokio::test]
async fn a_forwarded_request_is_one_trace_across_both_nodes() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let _subscriber = tracing::subscriber::set_default(
        tracing_subscriber::registry().with(gorgo_node::telemetry::layer(&provider)),
    );

    let mesh = Mesh::new();
    let (ea, eb) = (StubEngine::start("a").await, StubEngine::start("b").await);
    let a = start_node(config("a", &ea.url(), ""), Some(&mesh)).await;
    let b = start_node(config("b", &eb.url(), ""), Some(&mesh)).await;
    let p = prompt("a long shared context", 40_000);

    // b serves the prompt first, so b's engine holds it; no traceparent: a new trace.
    let resp = client()
        .post(format!("{}/v1/chat/completions", b.base))
        .json(&chat_body(&p, false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-gorgo-served-by"], "b");
    let _ = resp.bytes().await.unwrap();

    // a is saturated: the request goes to b, under the client's trace.
    ea.waiting.store(50, std::sync::atomic::Ordering::SeqCst);
    a.state().engine(0).unwrap().adapter.scrape().await;
    let resp = client()
        .post(format!("{}/v1/chat/completions", a.base))
        .header("traceparent", format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"))
        .json(&chat_body(&p, true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-gorgo-served-by"], "b");
    assert_eq!(resp.headers()["x-gorgo-hops"], "1");
    let text = resp.text().await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");

    let trace = TraceId::from_hex(CLIENT_TRACE).unwrap();
    let spans = wait_for_spans(
        &exporter,
        trace,
        &[
            ("request", "a"),
            ("decide", "a"),
            ("forward", "a"),
            ("forwarded", "b"),
            ("decide", "b"),
            ("engine", "b"),
        ],
    )
    .await;
    let span = |name: &str, node: &str| &spans[&(name.to_owned(), node.to_owned())];
    let id = |name: &str, node: &str| span(name, node).span_context.span_id();
    let parent = |name: &str, node: &str| span(name, node).parent_span_id;

    // a: the request is the client's child; the decision and the forward are its.
    assert_eq!(
        parent("request", "a"),
        SpanId::from_hex(CLIENT_SPAN).unwrap()
    );
    assert_eq!(parent("decide", "a"), id("request", "a"));
    assert_eq!(parent("forward", "a"), id("request", "a"));
    // b: the forwarded request is a child of a's forward, across the hop.
    assert_eq!(parent("forwarded", "b"), id("forward", "a"));
    assert!(span("forwarded", "b").parent_span_is_remote);
    assert_eq!(parent("decide", "b"), id("forwarded", "b"));
    assert_eq!(parent("engine", "b"), id("forwarded", "b"));
    // a's engine never saw it.
    assert!(!spans.contains_key(&("engine".to_owned(), "a".to_owned())));

    // What the decisions chose, among how many.
    assert_eq!(attr(span("decide", "a"), "chosen").as_deref(), Some("b"));
    assert_eq!(
        attr(span("decide", "a"), "candidates").as_deref(),
        Some("2")
    );
    assert_eq!(attr(span("decide", "b"), "chosen").as_deref(), Some("b"));
    assert_eq!(
        attr(span("decide", "b"), "reason").as_deref(),
        Some("max-hops")
    );
    assert_eq!(attr(span("forward", "a"), "peer").as_deref(), Some("b"));
    assert_eq!(
        attr(span("request", "a"), "served_by").as_deref(),
        Some("b")
    );
    assert_eq!(
        attr(span("engine", "b"), "http.response.status_code").as_deref(),
        Some("200")
    );
    // b's engine got the engine span's context, to trace the request itself.
    let engine_span = span("engine", "b").span_context.span_id();
    assert_eq!(
        eb.traceparents.lock().last().cloned(),
        Some(format!("00-{CLIENT_TRACE}-{engine_span}-01"))
    );
    // The forward lasts while b serves: it started before and ended after b's part.
    let (fwd, served) = (span("forward", "a"), span("forwarded", "b"));
    assert!(fwd.start_time <= served.start_time && served.end_time <= fwd.end_time);

    // The first request, sent without a traceparent, is a trace of its own at b.
    let first = exporter
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .find(|s| s.name == "request" && attr(s, "node").as_deref() == Some("b"))
        .expect("b's own request span");
    assert_eq!(first.parent_span_id, SpanId::INVALID);
    let own = wait_for_spans(
        &exporter,
        first.span_context.trace_id(),
        &[("request", "b"), ("decide", "b"), ("engine", "b")],
    )
    .await;
    assert_eq!(
        own[&("engine".to_owned(), "b".to_owned())].parent_span_id,
        first.span_context.span_id()
    );

    // Requests passed straight to the engine are traced too; probes are not.
    let resp = client()
        .post(format!("{}/tokenize", b.base))
        .json(&serde_json::json!({"prompt": "one two"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let _ = resp.bytes().await.unwrap();
    let health = client()
        .get(format!("{}/health", b.base))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    let deadline = Instant::now() + SPANS_DEADLINE;
    let paths = loop {
        let paths: Vec<String> = exporter
            .get_finished_spans()
            .unwrap()
            .iter()
            .filter(|s| s.name == "request")
            .filter_map(|s| attr(s, "url.path"))
            .collect();
        if paths.iter().any(|p| p == "/tokenize") || Instant::now() >= deadline {
            break paths;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(paths.iter().any(|p| p == "/tokenize"), "{paths:?}");
    assert!(!paths.iter().any(|p| p == "/health"), "{paths:?}");
    a.shutdown.cancel();
    b.shutdown.cancel();
}

#[tokio::test]
async fn otlp_exporter_posts_protobuf_spans_to_the_collector() {
    // A collector stand-in: what it was sent comes back on a channel.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let collector = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |headers: axum::http::HeaderMap, body: bytes::Bytes| {
            let tx = tx.clone();
            async move {
                let ct = headers
                    .get("content-type")
                    .map(|v| v.to_str().unwrap().to_owned());
                let _ = tx.send((ct, body));
                ""
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let stopped = stop.clone();
    tokio::spawn(async move {
        axum::serve(listener, collector)
            .with_graceful_shutdown(async move { stopped.cancelled().await })
            .await
            .unwrap();
    });

    let telemetry = config(
        "a",
        "http://127.0.0.1:1",
        &format!(
            "[telemetry]\notlp_endpoint = \"http://{addr}/v1/traces\"\nservice_name = \"gorgo-test\"\n"
        ),
    )
    .telemetry
    .clone();
    let provider = gorgo_node::telemetry::otlp_provider(
        &telemetry,
        &gorgo_core::NodeId::from("a"),
        tokio::runtime::Handle::current(),
    )
    .unwrap()
    .expect("an endpoint is configured");
    provider.tracer("test").in_span("probe-span", |_| {});
    // Flushing blocks until the export is answered, and the export runs on this
    // runtime: flush from a blocking thread.
    let flushed = provider.clone();
    tokio::task::spawn_blocking(move || flushed.force_flush())
        .await
        .unwrap()
        .unwrap();
    let (content_type, body) = tokio::time::timeout(SPANS_DEADLINE, rx.recv())
        .await
        .expect("the collector got an export")
        .unwrap();
    assert_eq!(content_type.as_deref(), Some("application/x-protobuf"));
    let has = |needle: &[u8]| body.windows(needle.len()).any(|w| w == needle);
    assert!(has(b"probe-span") && has(b"gorgo-test"), "{body:?}");
    tokio::task::spawn_blocking(move || provider.shutdown())
        .await
        .unwrap()
        .unwrap();
    stop.cancel();

    // No endpoint: no provider, nothing exported.
    let off = gorgo_node::config::TelemetrySection::default();
    assert!(gorgo_node::telemetry::otlp_provider(
        &off,
        &gorgo_core::NodeId::from("a"),
        tokio::runtime::Handle::current()
    )
    .unwrap()
    .is_none());
}
