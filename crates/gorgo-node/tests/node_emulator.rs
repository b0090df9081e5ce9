//! Three nodes (in-memory mesh) beside three `gorgo-engine` emulators: the node runs
//! against an SGLang-compatible engine with only the engine URL in its config.
mod common;

use std::sync::Arc;

use common::*;
use gorgo_node::mesh::Mesh;
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn three_nodes_over_emulators() {
    let stop = CancellationToken::new();
    let mesh = Mesh::new();
    mesh.set_rtt("a", "b", 150.0);
    mesh.set_rtt("a", "c", 200.0);
    mesh.set_rtt("b", "c", 250.0);
    let mut nodes = Vec::new();
    for id in ["a", "b", "c"] {
        let url = emulator(&stop).await;
        nodes.push(start_node(config(id, &url, ""), Some(&mesh)).await);
    }
    let c = client();
    for (node, id) in nodes.iter().zip(["a", "b", "c"]) {
        let body = serde_json::json!({"model": "Qwen/Qwen2.5-1.5B-Instruct", "messages": [{"role": "user", "content": prompt(id, 2000)}],
            "max_tokens": 4});
        let resp = c
            .post(format!("{}/v1/chat/completions", node.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["x-gorgo-served-by"], id);
        let v: serde_json::Value = resp.json().await.unwrap();
        assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 0, "{v}");

        // Streaming through the node: SSE from the emulator, ending with [DONE].
        let mut body = body.clone();
        body["stream"] = true.into();
        let resp = c
            .post(format!("{}/v1/chat/completions", node.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let text = resp.text().await.unwrap();
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    }
    // The node read the emulator's SGLang metrics.
    let state: &Arc<gorgo_node::NodeState> = nodes[0].state();
    state.engine(0).unwrap().adapter.scrape().await;
    assert!(
        state
            .engine(0)
            .unwrap()
            .adapter
            .scraped()
            .kv_capacity_tokens
            .is_some(),
        "{:?}",
        state.engine(0).unwrap().adapter.scraped()
    );
    // ... and its concurrency limit, from SGLang's `/get_server_info`; the node's
    // queue stats carry it to peers. The config's limit wins where it states one.
    let adapter = &state.engine(0).unwrap().adapter;
    adapter.learn_max_running().await;
    assert_eq!(
        adapter.max_running_requests(),
        Some((512, gorgo_core::accounting::LimitSource::Engine))
    );
    assert_eq!(
        adapter.queue_stats(0).slots.map(|s| s.max_running),
        Some(512)
    );
    let url = emulator(&stop).await;
    let told = start_node(
        config_with_engine("d", &url, "max_running_requests = 2\n"),
        Some(&mesh),
    )
    .await;
    let adapter = &told.state().engine(0).unwrap().adapter;
    adapter.learn_max_running().await;
    assert_eq!(
        adapter.max_running_requests(),
        Some((2, gorgo_core::accounting::LimitSource::Config))
    );
    stop.cancel();
}
