//! A node in front of the engine emulator started as each engine it can pass for
//! (`gorgo engine --kind sglang|vllm`), the node's config stating the same kind: the
//! node reads the engine's queue from that engine's `/metrics` names, and the same
//! load reads the same from either kind.
mod common;

use common::*;
use gorgo_engine::{EmulatedKind, EmulatorConfig, Profile};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const MODEL: &str = "Qwen/Qwen2.5-1.5B-Instruct";

/// An emulator of `kind` with one running slot and a slow decode (a long answer holds
/// the slot for minutes), until `shutdown`. Returns its base URL.
async fn one_slot_emulator(kind: EmulatedKind, shutdown: &CancellationToken) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut profile = Profile::by_name("h200-dense-1.5b").unwrap();
    profile.max_running_requests = 1;
    profile.decode_base_ms = 50.0;
    let mut config = EmulatorConfig::new(profile);
    config.kind = kind;
    let sd = shutdown.clone();
    tokio::spawn(async move {
        gorgo_engine::serve(listener, config, async move { sd.cancelled().await }).await
    });
    format!("http://{addr}")
}

/// A streamed chat request of `seed`'s prompt whose answer is far longer than the
/// test: its response (kept open) holds its place in the engine until dropped.
async fn long_stream(base: &str, seed: &str) -> reqwest::Response {
    let body = serde_json::json!({"model": MODEL, "stream": true, "max_tokens": 20_000,
        "messages": [{"role": "user", "content": prompt(seed, 400)}]});
    let resp = client()
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{seed}");
    resp
}

/// What a node of `kind` in front of an emulator of the same kind shows in
/// `/admin/state` once one request of its own runs on the engine and two sent to the
/// engine directly wait there: the engine's scrape and the node's queue stats.
async fn admin_state_under_load(kind: EmulatedKind) -> serde_json::Value {
    let stop = CancellationToken::new();
    let url = one_slot_emulator(kind, &stop).await;
    let engine = format!(
        "[engine]\nurl = \"{url}\"\nkind = \"{kind}\"\nmetrics_interval_ms = 0\nhealth_interval_ms = 3600000\n"
    );
    let node = start_node(config_text("a", &engine, ""), None).await;
    let adapter = node.state().engine(0).unwrap().adapter.clone();
    until("the engine is confirmed", || adapter.is_ready()).await;
    // The emulator answers a stream's head once the engine holds the request, so each
    // of these is on the engine when it returns: the node's own takes the one slot,
    // the others (not the node's) wait behind it.
    let mine = long_stream(&node.base, "mine").await;
    let theirs = [
        long_stream(&url, "theirs 1").await,
        long_stream(&url, "theirs 2").await,
    ];
    adapter.scrape().await;
    let state = admin_json(&node, "/admin/state").await;
    drop((mine, theirs));
    node.shutdown.cancel();
    stop.cancel();
    state
}

/// A node of kind `vllm` reads a vLLM emulator's queue: one running, two waiting
/// (which only the scrape knows: the node sent one request), the KV capacity the
/// engine states; the same as a node of kind `sglang` reads from an SGLang emulator
/// under the same load.
#[tokio::test]
async fn a_vllm_node_reads_a_vllm_emulators_queue_as_an_sglang_node_reads_sglangs() {
    let sglang = admin_state_under_load(EmulatedKind::Sglang).await;
    let vllm = admin_state_under_load(EmulatedKind::Vllm).await;
    for (kind, state) in [("sglang", &sglang), ("vllm", &vllm)] {
        let engine = &state["engine"];
        assert_eq!(engine["kind"], kind, "{state}");
        let scraped = &engine["scraped"];
        assert_eq!(scraped["running"], 1.0, "{kind}: {scraped}");
        assert_eq!(scraped["waiting"], 2.0, "{kind}: {scraped}");
        assert_eq!(
            scraped["kv_capacity_tokens"], 4_200_000.0,
            "{kind}: {scraped}"
        );
        assert!(
            scraped["kv_used_tokens"].as_f64().unwrap() > 0.0,
            "{kind}: {scraped}"
        );
        assert!(scraped["cache_hit_rate"].is_number(), "{kind}: {scraped}");
        let stats = &state["queue_stats"][0];
        assert_eq!(stats["running"], 1, "{kind}: {stats}");
        assert_eq!(stats["waiting"], 2, "{kind}: {stats}");
        assert_eq!(stats["kv_capacity_tokens"], 4_200_000, "{kind}: {stats}");
    }
    let used = |s: &serde_json::Value| s["queue_stats"][0]["kv_used_tokens"].as_u64().unwrap();
    assert!(used(&sglang).abs_diff(used(&vllm)) <= 1, "{sglang}\n{vllm}");
}
