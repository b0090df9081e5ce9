//! Usage on streamed requests (`gorgo_node::stream_usage`): a node in front of the
//! engine emulator (which honours `stream_options.include_usage`) asks the engine for
//! usage on every streamed request, learns from it, and gives the client the usage
//! chunk only when the client asked for it; through a forward too, where the serving
//! node decides by the client's own body and the origin relays.
mod common;

use common::*;
use gorgo_node::mesh::Mesh;
use tokio_util::sync::CancellationToken;

const MODEL: &str = "Qwen/Qwen2.5-1.5B-Instruct";

/// A streamed request body for `endpoint` (`chat` or `completions`), with
/// `stream_options` when given.
fn streamed_body(endpoint: &str, seed: &str, options: Option<serde_json::Value>) -> String {
    let mut body = match endpoint {
        "chat" => {
            serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": prompt(seed, 2000)}]})
        }
        _ => serde_json::json!({"model": MODEL, "prompt": prompt(seed, 2000)}),
    };
    body["max_tokens"] = 4.into();
    body["stream"] = true.into();
    if let Some(options) = options {
        body["stream_options"] = options;
    }
    body.to_string()
}

/// The SSE stream the client gets for `body` at `node`'s `endpoint`, checked to be
/// whole events ending with `data: [DONE]`; with the server that answered.
async fn stream(node: &TestNode, endpoint: &str, body: String) -> (String, String) {
    let path = match endpoint {
        "chat" => "/v1/chat/completions",
        _ => "/v1/completions",
    };
    let resp = client()
        .post(format!("{}{path}", node.base))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let served_by = resp.headers()["x-gorgo-served-by"]
        .to_str()
        .unwrap()
        .to_owned();
    let text = resp.text().await.unwrap();
    assert!(text.ends_with("\n\ndata: [DONE]\n\n"), "{text}");
    (text, served_by)
}

/// The JSON data of each event before `[DONE]`.
fn chunks(text: &str) -> Vec<serde_json::Value> {
    text.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect()
}

/// The usage-only chunks of a stream (`choices` empty, `usage` set).
fn usage_chunks(text: &str) -> Vec<serde_json::Value> {
    chunks(text)
        .into_iter()
        .filter(|c| c["choices"].as_array().is_some_and(Vec::is_empty) && c["usage"].is_object())
        .collect()
}

/// How many responses' usage `node` read: the count of one of its usage histograms
/// (`gorgo_prompt_token_error_ratio` or `gorgo_cache_estimate_error_ratio`).
async fn usage_observed(node: &TestNode, histogram: &str) -> u64 {
    let text = metrics_text(node).await;
    let name = format!("{histogram}_count ");
    text.lines()
        .find_map(|l| l.strip_prefix(&name))
        .map_or(0, |v| v.trim().parse::<f64>().unwrap() as u64)
}

#[tokio::test]
async fn a_stream_the_client_asked_no_usage_for_is_read_by_the_node_and_not_passed_on() {
    let stop = CancellationToken::new();
    let node = start_node(config("a", &emulator(&stop).await, ""), None).await;
    for (i, endpoint) in ["chat", "completions"].into_iter().enumerate() {
        let (text, _) = stream(&node, endpoint, streamed_body(endpoint, endpoint, None)).await;
        assert!(usage_chunks(&text).is_empty(), "{text}");
        assert!(!chunks(&text).is_empty(), "{text}");
        // The emulator puts `"usage": null` on content chunks only when asked for
        // usage: the node asked it.
        assert!(
            chunks(&text)
                .iter()
                .all(|c| c["usage"].is_null() && c.as_object().unwrap().contains_key("usage")),
            "{text}"
        );
        // And the node read the engine's usage: its token count and the index's
        // cached-token estimate were checked against it.
        let seen = i as u64 + 1;
        assert_eq!(
            usage_observed(&node, "gorgo_prompt_token_error_ratio").await,
            seen
        );
        assert_eq!(
            usage_observed(&node, "gorgo_cache_estimate_error_ratio").await,
            seen
        );
    }
    // A client that says no explicitly, with other stream options, is the same.
    let options = serde_json::json!({"include_usage": false});
    let (text, _) = stream(&node, "chat", streamed_body("chat", "no", Some(options))).await;
    assert!(usage_chunks(&text).is_empty(), "{text}");
    assert_eq!(
        usage_observed(&node, "gorgo_prompt_token_error_ratio").await,
        3
    );
    stop.cancel();
}

#[tokio::test]
async fn a_client_that_asked_for_usage_gets_its_usage_chunk() {
    let stop = CancellationToken::new();
    let node = start_node(config("a", &emulator(&stop).await, ""), None).await;
    for endpoint in ["chat", "completions"] {
        let options = serde_json::json!({"include_usage": true});
        let (text, _) = stream(
            &node,
            endpoint,
            streamed_body(endpoint, endpoint, Some(options)),
        )
        .await;
        let usage = usage_chunks(&text);
        assert_eq!(usage.len(), 1, "{text}");
        assert!(usage[0]["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
        // Just before `[DONE]`, as the engine sent it.
        let last = chunks(&text).pop().unwrap();
        assert_eq!(last, usage[0]);
    }
    assert_eq!(
        usage_observed(&node, "gorgo_prompt_token_error_ratio").await,
        2
    );
    stop.cancel();
}

#[tokio::test]
async fn through_a_forward_the_serving_node_decides_by_the_clients_body() {
    let stop = CancellationToken::new();
    let mesh = Mesh::new();
    mesh.set_rtt("a", "b", 20.0);
    // a's engine takes no requests (weight 0): a forwards every request to b.
    let a = start_node(
        config_with_engine("a", &emulator(&stop).await, "weight = 0\n"),
        Some(&mesh),
    )
    .await;
    let b = start_node(config("b", &emulator(&stop).await, ""), Some(&mesh)).await;

    let (text, served_by) = stream(&a, "chat", streamed_body("chat", "fwd", None)).await;
    assert_eq!(served_by, "b");
    assert!(usage_chunks(&text).is_empty(), "{text}");
    // b asked its engine and read the usage; a served nothing itself.
    assert_eq!(
        usage_observed(&b, "gorgo_cache_estimate_error_ratio").await,
        1
    );
    assert_eq!(
        usage_observed(&a, "gorgo_cache_estimate_error_ratio").await,
        0
    );

    let options = serde_json::json!({"include_usage": true});
    let (text, served_by) = stream(&a, "chat", streamed_body("chat", "fwd2", Some(options))).await;
    assert_eq!(served_by, "b");
    // Exactly the engine's one usage chunk: neither node dropped nor added one.
    assert_eq!(usage_chunks(&text).len(), 1, "{text}");
    assert_eq!(
        usage_observed(&b, "gorgo_cache_estimate_error_ratio").await,
        2
    );
    stop.cancel();
}

/// vLLM reads `stream_options: {}` as asking for usage (its `include_usage` defaults to
/// true), so a node in front of a vLLM engine sends such a body as it is and relays the
/// usage the engine sends; in front of any other kind the node asks for usage itself
/// (OpenAI's default is false). The emulator answers with OpenAI's default, so what
/// tells the two apart here is the node's own request: asked for usage, the emulator
/// adds `"usage": null` to every content chunk and the node reads the usage chunk.
#[tokio::test]
async fn empty_stream_options_mean_what_the_engine_kind_defaults_to() {
    let stop = CancellationToken::new();
    for kind in [
        gorgo_node::config::EngineKind::Vllm,
        gorgo_node::config::EngineKind::Sglang,
    ] {
        let mut config = config("a", &emulator(&stop).await, "").into_inner();
        config.engine.as_mut().unwrap().kind = kind;
        let node = start_node(config.validate().unwrap(), None).await;
        let options = serde_json::json!({});
        let (text, _) = stream(&node, "chat", streamed_body("chat", "empty", Some(options))).await;
        let node_asked = kind != gorgo_node::config::EngineKind::Vllm;
        assert!(usage_chunks(&text).is_empty(), "{kind:?}: {text}");
        assert!(
            chunks(&text)
                .iter()
                .all(|c| c.as_object().unwrap().contains_key("usage") == node_asked),
            "{kind:?}: {text}"
        );
        assert_eq!(
            usage_observed(&node, "gorgo_prompt_token_error_ratio").await,
            u64::from(node_asked),
            "{kind:?}"
        );
        node.shutdown.cancel();
    }
    stop.cancel();
}
