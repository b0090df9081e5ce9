//! The engine routes a node serves besides chat and completions, through a node of an
//! in-process two-node cluster: `/health`, `/health_generate`, `/v1/embeddings`,
//! `/v1/responses`, SGLang's `/generate` (text and `input_ids`), `/tokenize` and
//! `/detokenize`. Each is checked for success, streaming where the engine streams it,
//! bad input (OpenAI error JSON) and a client that goes away (the engine's request is
//! cancelled, not left running).
mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use gorgo_node::mesh::Mesh;

async fn cluster() -> (Vec<Arc<StubEngine>>, Vec<TestNode>) {
    let mesh = Mesh::new();
    mesh.set_rtt("a", "b", 50.0);
    let mut engines = Vec::new();
    let mut nodes = Vec::new();
    for id in ["a", "b"] {
        let engine = StubEngine::start(id).await;
        let extra = "[limits]\nmax_body_bytes = 65536\n";
        nodes.push(start_node(config(id, &engine.url(), extra), Some(&mesh)).await);
        engines.push(engine);
    }
    (engines, nodes)
}

/// Wait (bounded) until `cond` holds.
async fn until(what: &str, cond: impl Fn() -> bool) {
    tokio::time::timeout(Duration::from_secs(10), async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("timed out waiting for {what}"));
}

async fn post(node: &TestNode, path: &str, body: serde_json::Value) -> reqwest::Response {
    client()
        .post(format!("{}{path}", node.base))
        .json(&body)
        .send()
        .await
        .unwrap()
}

const NATIVE: [(&str, bool); 5] = [
    ("/v1/embeddings", false),
    ("/v1/responses", true),
    ("/generate", true),
    ("/tokenize", false),
    ("/detokenize", false),
];

fn native_body(path: &str, stream: bool) -> serde_json::Value {
    match path {
        "/v1/embeddings" => serde_json::json!({"model": "m", "input": ["one", "two"]}),
        "/v1/responses" => serde_json::json!({"model": "m", "input": "hello", "stream": stream}),
        "/generate" => {
            serde_json::json!({"text": "hello", "sampling_params": {"max_new_tokens": 4}, "stream": stream})
        }
        _ => serde_json::json!({"tokens": [1, 2, 3]}),
    }
}

#[tokio::test]
async fn native_routes_pass_through_with_the_nodes_headers() {
    let (engines, nodes) = cluster().await;
    for (path, streams) in NATIVE {
        let resp = post(&nodes[0], path, native_body(path, false)).await;
        assert_eq!(resp.status(), 200, "{path}");
        assert_eq!(resp.headers()["x-gorgo-served-by"], "a", "{path}");
        assert_eq!(resp.headers()["content-type"], "application/json");
        let v: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(v["route"], path, "the engine got the route asked for");
        assert_eq!(
            v["echo"],
            native_body(path, false),
            "and the body unchanged"
        );
        if streams {
            let resp = post(&nodes[0], path, native_body(path, true)).await;
            assert_eq!(resp.status(), 200);
            assert_eq!(resp.headers()["content-type"], "text/event-stream");
            let text = resp.text().await.unwrap();
            assert!(text.contains("hello") && text.contains(" world"), "{text}");
            assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        }
    }
    // SGLang's /generate takes token ids as well as text.
    let ids = serde_json::json!({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}});
    let v: serde_json::Value = post(&nodes[1], "/generate", ids.clone())
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["echo"], ids);
    assert_eq!(v["engine"], "b", "served by the node's own engine");
    // /tokenize (the stub counts words).
    let v: serde_json::Value = post(
        &nodes[0],
        "/tokenize",
        serde_json::json!({"prompt": "a b c d"}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(v["count"], 4);
    assert_eq!(engines[1].requests(), 1);
    assert_eq!(
        engines[0].requests(),
        8,
        "five routes, two streamed too, and /tokenize"
    );
}

#[tokio::test]
async fn native_routes_refuse_bad_input_in_openai_shape() {
    let (engines, nodes) = cluster().await;
    for path in [
        "/v1/embeddings",
        "/v1/responses",
        "/generate",
        "/tokenize",
        "/detokenize",
    ] {
        let url = format!("{}{path}", nodes[0].base);
        for (body, status) in [
            ("not json".to_owned(), 400),
            ("[1, 2]".to_owned(), 400),
            (format!("{{\"text\": \"{}\"}}", "x".repeat(70_000)), 413),
        ] {
            let resp = client()
                .post(&url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            let (got, _) = error_of(resp).await;
            assert_eq!(got, status, "{path}");
        }
        let resp = client().get(&url).send().await.unwrap();
        assert_eq!(error_of(resp).await.0, 405, "{path}: GET");
    }
    assert_eq!(
        engines[0].requests(),
        0,
        "no bad request reached the engine"
    );
    // With every slot taken a body is not even parsed (that takes many times its size,
    // which only requests in flight may hold): a 503, whatever the body.
    let permits = &nodes[0].state().permits;
    let held = permits
        .clone()
        .acquire_many_owned(permits.available_permits() as u32)
        .await
        .unwrap();
    let resp = client()
        .post(format!("{}/v1/embeddings", nodes[0].base))
        .header("content-type", "application/json")
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(
        error_of(resp).await.0,
        503,
        "parsed before a slot was taken"
    );
    drop(held);
    // /health_generate when the engine cannot generate.
    engines[0].set_mode(REJECT);
    let resp = client()
        .get(format!("{}/health_generate", nodes[0].base))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(resp).await.0, 503);
    engines[0].set_mode(NORMAL);
    let resp = client()
        .get(format!("{}/health_generate", nodes[0].base))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        client()
            .get(format!("{}/health", nodes[0].base))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
}

#[tokio::test]
async fn a_client_that_goes_away_cancels_the_engine_request() {
    let (engines, nodes) = cluster().await;
    let engine = engines[0].clone();
    for (path, streams) in NATIVE {
        // Before the engine answered: the engine holds the request.
        engine.set_mode(HANG);
        let url = format!("{}{path}", nodes[0].base);
        let body = native_body(path, false);
        let pending = tokio::spawn(async move { client().post(url).json(&body).send().await });
        until("the engine to hold the request", || {
            engine.active.load(Ordering::SeqCst) == 1
        })
        .await;
        pending.abort();
        until("the engine request to be cancelled", || {
            engine.active.load(Ordering::SeqCst) == 0
        })
        .await;
        // Mid-stream: the first event arrived, then the client leaves.
        if streams {
            engine.set_mode(STREAM_THEN_HANG);
            let mut resp = post(&nodes[0], path, native_body(path, true)).await;
            assert_eq!(resp.status(), 200);
            let first = resp.chunk().await.unwrap().unwrap();
            assert!(first.starts_with(b"data: "));
            assert_eq!(engine.active.load(Ordering::SeqCst), 1);
            drop(resp);
            until("the engine stream to be dropped", || {
                engine.active.load(Ordering::SeqCst) == 0
            })
            .await;
        }
    }
    engine.release.notify_waiters();
}

/// The native routes run under the request deadline and in the engine's accounting,
/// like routed requests: a `/generate` stream that stalls after its first event ends
/// with a timeout error event at the deadline, the engine request is cancelled, and
/// while it ran the node counted it as in flight at its engine.
#[tokio::test]
async fn native_routes_run_under_the_deadline_and_in_the_accounting() {
    let engine = StubEngine::start("a").await;
    let extra = "[limits]\nrequest_timeout_ms = 500\n";
    let node = start_node(config("a", &engine.url(), extra), None).await;
    engine.set_mode(STREAM_THEN_HANG);
    let mut resp = post(&node, "/generate", native_body("/generate", true)).await;
    assert_eq!(resp.status(), 200);
    let first = resp.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    let adapter = &node.state().engine(0).unwrap().adapter;
    assert_eq!(adapter.inflight(), 1);
    // The rest of the body: the node's timeout event, then the end.
    let rest = tokio::time::timeout(Duration::from_secs(10), resp.bytes())
        .await
        .expect("the deadline ends the stream")
        .unwrap();
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains("request timed out"), "{rest}");
    until("the engine stream to be dropped", || {
        engine.active.load(Ordering::SeqCst) == 0
    })
    .await;
    assert_eq!(adapter.inflight(), 0);
    let metrics = metrics_text(&node).await;
    assert!(
        metrics.contains(
            r#"gorgo_requests_total{outcome="timeout",policy="unrouted",served_by="a"} 1"#
        ),
        "{metrics}"
    );
    engine.release.notify_waiters();
}

/// `/health_generate` needs no token and is real engine work: probes that arrive while
/// one runs take its answer instead of each sending a generation.
#[tokio::test]
async fn concurrent_health_generate_probes_share_one_generation() {
    let (engines, nodes) = cluster().await;
    let engine = engines[0].clone();
    engine.set_mode(HANG);
    let before = engine.requests();
    let url = format!("{}/health_generate", nodes[0].base);
    let probes: Vec<_> = (0..20)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { client().get(url).send().await.unwrap().status() })
        })
        .collect();
    until("the first probe to reach the engine", || {
        engine.requests() > before
    })
    .await;
    // Every probe's connection is open before the held one is let go.
    let mut open = 0;
    for _ in 0..2000 {
        open = metric_value(
            &metrics_text(&nodes[0]).await,
            r#"gorgo_connections_open{port="client"}"#,
        )
        .unwrap_or(0.0) as u64;
        if open >= 20 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(open >= 20, "{open} connections");
    engine.set_mode(NORMAL);
    engine.release.notify_waiters();
    for p in probes {
        assert_eq!(p.await.unwrap(), 200);
    }
    // One generation (a straggler that arrived after it ended may send a second).
    assert!(
        engine.requests() - before <= 2,
        "{} generations",
        engine.requests() - before
    );
}

/// A generation that hangs fails `/health_generate` within twenty health timeouts,
/// not at the first-byte timeout (120 s) while every other probe waits behind it.
#[tokio::test]
async fn a_hung_generation_fails_health_generate_at_its_deadline() {
    let engine = StubEngine::start("a").await;
    let node = start_node(
        config_with_engine(
            "a",
            &engine.url(),
            "health_timeout_ms = 20
",
        ),
        None,
    )
    .await;
    engine.set_mode(HANG);
    let resp = tokio::time::timeout(
        Duration::from_secs(60),
        client()
            .get(format!("{}/health_generate", node.base))
            .send(),
    )
    .await
    .expect("the probe ends at its deadline")
    .unwrap();
    let (status, err) = error_of(resp).await;
    assert_eq!(status, 503);
    assert!(
        err["error"]["message"].as_str().unwrap().contains("400 ms"),
        "{err}"
    );
    engine.release.notify_waiters();
    node.shutdown.cancel();
}

/// A probe that waited on another takes its answer only if that one ended: when the
/// probe it waited on is dropped (its client left), it runs its own instead of
/// answering with an older outcome (here a success, from before the engine hung).
#[tokio::test]
async fn a_probe_whose_leader_left_does_not_answer_with_an_old_outcome() {
    let engine = StubEngine::start("a").await;
    let node = start_node(
        config_with_engine("a", &engine.url(), "health_timeout_ms = 20\n"),
        None,
    )
    .await;
    let url = format!("{}/health_generate", node.base);
    assert_eq!(client().get(&url).send().await.unwrap().status(), 200);
    engine.set_mode(HANG);
    let before = engine.requests();
    let leader = tokio::spawn({
        let url = url.clone();
        async move { client().get(url).send().await.map(|r| r.status()) }
    });
    until("the leading probe to reach the engine", || {
        engine.requests() > before
    })
    .await;
    let waiter = tokio::spawn({
        let url = url.clone();
        async move { client().get(url).send().await.unwrap().status() }
    });
    // Both probes' connections open (the waiter's on the probe lock), then the
    // leader's client leaves.
    let mut open = 0.0;
    for _ in 0..2000 {
        open = metric_value(
            &metrics_text(&node).await,
            r#"gorgo_connections_open{port="client"}"#,
        )
        .unwrap_or(0.0);
        if open >= 2.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(open >= 2.0, "{open} connections");
    leader.abort();
    assert_eq!(waiter.await.unwrap(), 503, "the engine hangs now");
    engine.release.notify_waiters();
    node.shutdown.cancel();
}
