//! Model-aware routing: each node learns the models its engine lists (`/v1/models`)
//! and peers learn them from its stats; a request naming a model goes only to regions
//! that serve it, one no region serves is refused in OpenAI's shape, and `/v1/models`
//! on any node lists the cluster's models with the nodes serving each.
mod common;

use std::sync::Arc;

use common::*;
use gorgo_node::mesh::Mesh;

/// Two regions, `a` serving `alpha` and `b` serving `beta` (and both `shared`), their
/// model lists read.
async fn two_model_cluster(extra: &str) -> (Vec<Arc<StubEngine>>, Vec<TestNode>) {
    let mesh = Mesh::new();
    mesh.set_rtt("a", "b", 50.0);
    let mut engines = Vec::new();
    let mut nodes = Vec::new();
    for (id, model) in [("a", "alpha"), ("b", "beta")] {
        let engine = StubEngine::start(id).await;
        engine.set_models(&[model, "shared"]);
        let node = start_node(config(id, &engine.url(), extra), Some(&mesh)).await;
        assert!(node.state().engine(0).unwrap().adapter.learn_models().await);
        engines.push(engine);
        nodes.push(node);
    }
    (engines, nodes)
}

fn body(model: &str, prompt: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({"model": model, "messages": [{"role": "user", "content": prompt}],
        "stream": stream, "max_tokens": 8})
}

async fn send(node: &TestNode, body: &serde_json::Value) -> reqwest::Response {
    client()
        .post(format!("{}/v1/chat/completions", node.base))
        .json(body)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn requests_go_only_where_their_model_is_served() {
    let (engines, nodes) = two_model_cluster("").await;
    // `beta` is served only at b: a forwards it, though its own engine is idle.
    for stream in [false, true] {
        let resp = send(&nodes[0], &body("beta", "hello beta", stream)).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["x-gorgo-served-by"], "b");
        let text = resp.text().await.unwrap();
        assert!(text.contains("hello"), "{text}");
    }
    // `alpha` at a, from either node.
    for node in &nodes {
        let resp = send(node, &body("alpha", "hello alpha", false)).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["x-gorgo-served-by"], "a");
    }
    assert_eq!(engines[1].requests(), 2);
    assert_eq!(engines[0].requests(), 2);
    // A model no region serves: OpenAI's 404, and no engine saw it.
    let (status, error) = error_of(send(&nodes[1], &body("gamma", "hi", false)).await).await;
    let error = &error["error"];
    assert_eq!(status, 404);
    assert_eq!(error["code"], "model_not_found");
    assert_eq!(error["param"], "model");
    assert_eq!(error["type"], "invalid_request_error");
    assert!(error["message"].as_str().unwrap().contains("gamma"));
    assert_eq!(engines[0].requests() + engines[1].requests(), 4);
    // No model named: any region.
    let mut anon = body("x", "no model", false);
    anon.as_object_mut().unwrap().remove("model");
    assert_eq!(send(&nodes[0], &anon).await.status(), 200);
}

#[tokio::test]
async fn unlisted_models_can_be_let_through_for_engines_that_take_any_name() {
    let (_engines, nodes) = two_model_cluster("[routing]\nunlisted_model = \"any\"\n").await;
    let resp = send(&nodes[0], &body("gamma", "hi", false)).await;
    assert_eq!(resp.status(), 200, "routed as if it named no model");
    // A listed model is still routed by where it is served.
    let resp = send(&nodes[0], &body("beta", "hi", false)).await;
    assert_eq!(resp.headers()["x-gorgo-served-by"], "b");
}

#[tokio::test]
async fn v1_models_lists_the_clusters_models_and_where_each_is_served() {
    let (_engines, nodes) = two_model_cluster("").await;
    for node in &nodes {
        let v = get_models(node).await;
        assert_eq!(v["object"], "list");
        let mut listed: Vec<(String, Vec<String>)> = v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                assert_eq!(m["object"], "model");
                let nodes = m["nodes"].as_array().unwrap();
                let nodes = nodes.iter().map(|n| n.as_str().unwrap().to_owned());
                (m["id"].as_str().unwrap().to_owned(), nodes.collect())
            })
            .collect();
        listed.sort();
        let want =
            |id: &str, at: &[&str]| (id.to_owned(), at.iter().map(|s| s.to_string()).collect());
        assert_eq!(
            listed,
            [
                want("alpha", &["a"]),
                want("beta", &["b"]),
                want("shared", &["a", "b"])
            ]
        );
    }
}

#[tokio::test]
async fn a_changed_model_list_changes_the_routing() {
    let (engines, nodes) = two_model_cluster("").await;
    let resp = send(&nodes[0], &body("delta", "hi", false)).await;
    assert_eq!(resp.status(), 404);
    // b's engine loads `delta` (an adapter, say); once b reads its list again, a
    // routes `delta` there.
    engines[1].set_models(&["beta", "delta"]);
    assert!(
        nodes[1]
            .state()
            .engine(0)
            .unwrap()
            .adapter
            .learn_models()
            .await
    );
    let resp = send(&nodes[0], &body("delta", "hi", false)).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-gorgo-served-by"], "b");
    // Now b no longer lists `shared`: requests for it stay at a.
    for node in &nodes {
        let resp = send(node, &body("shared", "hi", false)).await;
        assert_eq!(resp.headers()["x-gorgo-served-by"], "a");
    }
}

/// An engine with no server info (a 404, as from vLLM or llama-cpp-python's server)
/// leaves the node without a concurrency limit: its queue stats carry none. A limit
/// the engine stated is kept through a failed or busy read (5xx, 429) and withdrawn
/// only when the engine says it has no such endpoint.
#[tokio::test]
async fn an_engine_without_server_info_reports_no_limit() {
    let engine = StubEngine::start("a").await;
    let node = start_node(config("a", &engine.url(), ""), None).await;
    let adapter = &node.state().engine(0).unwrap().adapter;
    adapter.learn_max_running().await;
    assert_eq!(adapter.max_running_requests(), None);
    assert_eq!(adapter.queue_stats(0).slots, None);
    engine.set_server_info(200, serde_json::json!({"max_running_requests": 4}));
    adapter.learn_max_running().await;
    assert_eq!(
        adapter.max_running_requests(),
        Some((4, gorgo_core::accounting::LimitSource::Engine))
    );
    for status in [500, 503, 429, 408] {
        engine.set_server_info(status, serde_json::Value::Null);
        adapter.learn_max_running().await;
        assert_eq!(
            adapter.max_running_requests().map(|(n, _)| n),
            Some(4),
            "a {status} keeps the limit"
        );
    }
    engine.set_server_info(404, serde_json::Value::Null);
    adapter.learn_max_running().await;
    assert_eq!(adapter.max_running_requests(), None, "a 404 withdraws it");
    assert_eq!(adapter.queue_stats(0).slots, None);
}

/// The reads of the engine's model list and limit run beside its health checks, not
/// in their loop: an engine whose server info never answers (SGLang's waits on its
/// scheduler) is still taken out of routing as soon as its health checks fail.
#[tokio::test]
async fn a_hanging_server_info_does_not_hold_back_health_checks() {
    let engine = StubEngine::start("a").await;
    engine.set_server_info(0, serde_json::Value::Null);
    let extra = "health_interval_ms = 20\nhealth_timeout_ms = 60000\nbreaker_failures = 2\n";
    let node = start_node(config_with_engine("a", &engine.url(), extra), None).await;
    let adapter = node.state().engine(0).unwrap().adapter.clone();
    let wait = |what: &'static str, done: Box<dyn Fn() -> bool + Send>| async move {
        tokio::time::timeout(std::time::Duration::from_secs(30), async {
            while !done() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{what}"));
    };
    let e = engine.clone();
    wait(
        "the node asks for the server info",
        Box::new(move || {
            e.server_info_requests
                .load(std::sync::atomic::Ordering::SeqCst)
                > 0
        }),
    )
    .await;
    assert!(adapter.is_healthy());
    engine
        .unhealthy
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let a = adapter.clone();
    wait(
        "health checks go on while the server info hangs",
        Box::new(move || !a.is_healthy()),
    )
    .await;
    engine.release.notify_waiters();
    node.shutdown.cancel();
}

/// `/v1/models` needs no token: while the engine lists no model, clients' calls read
/// its list at most once per retry interval, not once each.
#[tokio::test]
async fn an_engine_listing_no_model_is_not_asked_once_per_client_call() {
    let engine = StubEngine::start("e").await;
    engine.set_models(&[]);
    let node = start_node(config("a", &engine.url(), ""), None).await;
    let before = engine
        .models_requests
        .load(std::sync::atomic::Ordering::SeqCst);
    for _ in 0..20 {
        get_models(&node).await;
    }
    let asked = engine
        .models_requests
        .load(std::sync::atomic::Ordering::SeqCst)
        - before;
    assert!(asked <= 2, "{asked} reads of the engine's list");
    node.shutdown.cancel();
}

/// `GET /v1/models` at `node`: answered 200, its JSON.
async fn get_models(node: &TestNode) -> serde_json::Value {
    let resp = client()
        .get(format!("{}/v1/models", node.base))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.json().await.unwrap()
}

/// An engine whose `/v1/models` answer cannot be read: not JSON, or a list of 10,000
/// ids of 305 bytes (3 MB, over the node's 1 MiB cap); its health checks and model
/// reads counted.
struct UnreadableModels {
    addr: std::net::SocketAddr,
    checks: std::sync::atomic::AtomicU64,
    reads: std::sync::atomic::AtomicU64,
}

impl UnreadableModels {
    async fn start(huge: bool) -> Arc<Self> {
        use std::sync::atomic::Ordering::SeqCst;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let engine = Arc::new(UnreadableModels {
            addr: listener.local_addr().unwrap(),
            checks: Default::default(),
            reads: Default::default(),
        });
        let answer = if huge {
            let data: Vec<_> = (0..10_000)
                .map(|i| serde_json::json!({"id": format!("{i:0>305}")}))
                .collect();
            serde_json::json!({ "data": data }).to_string()
        } else {
            "{\"data\": [".to_owned()
        };
        let (checked, read) = (engine.clone(), engine.clone());
        let app = axum::Router::new()
            .route(
                "/health",
                axum::routing::get(move || {
                    checked.checks.fetch_add(1, SeqCst);
                    async { "ok" }
                }),
            )
            .route(
                "/v1/models",
                axum::routing::get(move || {
                    read.reads.fetch_add(1, SeqCst);
                    let answer = answer.clone();
                    async move { answer }
                }),
            );
        tokio::spawn(async move { axum::serve(listener, app).await });
        engine
    }
}

/// An engine whose `/v1/models` answer cannot be read is asked for it again at the
/// normal refresh (30 s), not at every health check: the node read a malformed or
/// oversized list once a health interval, for good, and said nothing (the warning is
/// `engine::tests::an_unreadable_model_list_is_warned_of_once_per_reason`).
#[tokio::test]
async fn an_unreadable_model_list_is_not_read_again_at_every_health_check() {
    use std::sync::atomic::Ordering::SeqCst;
    for huge in [false, true] {
        let engine = UnreadableModels::start(huge).await;
        let url = format!("http://{}", engine.addr);
        let node = start_node(
            config_with_engine("a", &url, "health_interval_ms = 10\n"),
            None,
        )
        .await;
        until("the list read and 20 health checks", || {
            engine.reads.load(SeqCst) > 0 && engine.checks.load(SeqCst) >= 20
        })
        .await;
        assert_eq!(engine.reads.load(SeqCst), 1, "huge: {huge}");
        assert!(node.state().engine(0).unwrap().adapter.models().is_empty());
        node.shutdown.cancel();
    }
}
