//! A node fronting several engines (`[[engines]]`, docs/design.md "Replicas"): each a
//! candidate of its own in one decision with the peers, a dead one routed around
//! before the first byte, and engines added, drained and removed at run time.
mod common;

use std::sync::Arc;

use common::*;
use gorgo_node::NodeConfig;

async fn engines(n: usize) -> Vec<Arc<StubEngine>> {
    let mut v = Vec::new();
    for i in 0..n {
        v.push(StubEngine::start(&format!("e{i}")).await);
    }
    v
}

async fn chat(node: &TestNode, prompt: &str) -> u16 {
    chat_as(node, prompt, false).await
}

/// [`chat`], streamed or not: a streamed request's head comes with its first token, so
/// it is what the first-byte timeout bounds (one that is not streamed waits up to the
/// request timeout: `LimitsSection::head_timeout`).
async fn chat_as(node: &TestNode, prompt: &str, stream: bool) -> u16 {
    client()
        .post(format!("{}/v1/chat/completions", node.base))
        .json(&chat_body(prompt, stream))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// One admin call to `node`: its status and JSON body.
async fn admin_call(
    node: &TestNode,
    method: reqwest::Method,
    path: String,
    body: Option<serde_json::Value>,
) -> (u16, serde_json::Value) {
    let mut req = client()
        .request(method, format!("{}{path}", node.admin))
        .bearer_auth(TOKEN);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json::<serde_json::Value>().await.unwrap())
}

fn served(engines: &[Arc<StubEngine>]) -> Vec<u64> {
    engines.iter().map(|e| e.requests()).collect()
}

#[tokio::test]
async fn every_replica_is_a_candidate_and_a_prompt_goes_back_to_its_cache() {
    let es = engines(3).await;
    let urls: Vec<String> = es.iter().map(|e| e.url()).collect();
    let node = start_node(config_with_engines("a", &urls, ""), None).await;
    let long = prompt("a long shared system prompt", 8000);
    assert_eq!(chat(&node, &long).await, 200);
    let d = admin_json(&node, "/admin/decisions?limit=1").await;
    let cands = d[0]["candidates"].as_array().unwrap();
    let replicas: Vec<u64> = cands
        .iter()
        .filter(|c| c["is_local"] == true)
        .map(|c| c["replica"].as_u64().unwrap())
        .collect();
    assert_eq!(replicas, [0, 1, 2], "{d}");
    let first = served(&es);
    let home = first
        .iter()
        .position(|&n| n == 1)
        .expect("one engine served it");
    // The same prompt again: only the engine that holds it has it cached, so it is
    // the cheapest candidate.
    for _ in 0..3 {
        assert_eq!(chat(&node, &long).await, 200);
    }
    assert_eq!(served(&es)[home], 4, "{:?}", served(&es));
    let state = admin_json(&node, "/admin/state").await;
    assert_eq!(state["engines"].as_array().unwrap().len(), 3, "{state}");
    assert_eq!(state["queue_stats"][2]["replica"], 2, "{state}");
    node.shutdown.cancel();
}

#[tokio::test]
async fn a_dead_replica_is_routed_around_before_the_first_byte() {
    let es = engines(2).await;
    let urls: Vec<String> = es.iter().map(|e| e.url()).collect();
    let node = start_node(config_with_engines("a", &urls, ""), None).await;
    // Engine 0 dies: connections to it are refused.
    es[0].shutdown.cancel();
    for i in 0..8 {
        let status = chat(&node, &prompt(&format!("request {i}"), 400)).await;
        assert_eq!(status, 200, "request {i} fell back to the live replica");
    }
    assert_eq!(es[1].requests(), 8);
    // The failures open engine 0's breaker: it stops being a candidate that can serve.
    let d = admin_json(&node, "/admin/decisions?limit=1").await;
    let dead = d[0]["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["is_local"] == true && c["replica"] == 0)
        .cloned()
        .unwrap();
    assert_eq!(dead["healthy"], false, "{d}");
    // Its stats say so to peers: they stop counting on it at the next gossip round.
    let stats = node.state().local_stats();
    assert!(stats[0].draining && !stats[1].draining, "{stats:?}");
    node.shutdown.cancel();
}

/// A 500 counts against an engine once another engine serves the same request: then
/// the request was not at fault. Engine 0 answers every request 500 while its health
/// check passes; each request goes on to engine 1 and is served, and engine 0's breaker
/// opens. (A request every engine answers 500 counts nowhere:
/// `node_single::an_engines_500_answers_do_not_open_the_breaker`.)
#[tokio::test]
async fn an_engine_whose_500s_another_engine_serves_is_taken_out() {
    let es = engines(2).await;
    es[0].set_mode(SERVER_ERROR);
    let urls: Vec<String> = es.iter().map(|e| e.url()).collect();
    let node = start_node(config_with_engines("a", &urls, ""), None).await;
    let broken = node.state().engine(0).unwrap().adapter.clone();
    for i in 0..8 {
        let status = chat(&node, &prompt(&format!("request {i}"), 400)).await;
        assert_eq!(status, 200, "request {i} served by the other replica");
    }
    assert_eq!(es[1].requests(), 8);
    assert!(es[0].requests() >= 3, "{}", es[0].requests());
    assert!(
        matches!(
            broken.breaker(),
            gorgo_core::health::BreakerState::Open { .. }
        ),
        "{:?}",
        broken.breaker()
    );
    node.shutdown.cancel();
}

#[tokio::test]
async fn replicas_are_added_drained_and_removed_through_the_admin_api() {
    use reqwest::Method;
    let es = engines(3).await;
    let node = start_node(config_with_engines("a", &[es[0].url()], ""), None).await;
    let admin = |method, path: &str, body| admin_call(&node, method, path.to_owned(), body);
    let add = |url: String, more: serde_json::Value| {
        let mut body = serde_json::json!({"url": url, "kind": "sglang"});
        body.as_object_mut()
            .unwrap()
            .extend(more.as_object().unwrap().clone());
        admin(Method::POST, "/admin/engines", Some(body))
    };
    // A bad entry is refused, naming the field.
    for (url, more, field) in [
        ("ftp://x".to_owned(), serde_json::json!({}), "url"),
        (es[1].url(), serde_json::json!({"wieght": 1}), "wieght"),
    ] {
        let (status, body) = add(url, more).await;
        assert_eq!(status, 400, "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(field), "{body}");
    }
    // Two engines added: replicas 1 and 2.
    for (i, e) in es[1..].iter().enumerate() {
        let (status, v) = add(e.url(), serde_json::json!({"metrics_interval_ms": 0})).await;
        assert_eq!(status, 201, "{v}");
        assert_eq!(v["replica"], i as u64 + 1, "{v}");
    }
    // They take requests once their first health check has passed.
    let state = node.state().clone();
    until("engines 1 and 2 checked", || {
        [1, 2]
            .iter()
            .all(|&r| state.engine(r).unwrap().takes_requests())
    })
    .await;
    // The same engine twice is refused.
    assert_eq!(add(es[1].url(), serde_json::json!({})).await.0, 400);
    let list = admin_json(&node, "/admin/engines").await;
    assert_eq!(list.as_array().unwrap().len(), 3, "{list}");

    // Engines 0 and 1 drain: every request goes to engine 2.
    for r in [0, 1] {
        let path = format!("/admin/engines/{r}/drain");
        assert_eq!(admin(Method::POST, &path, None).await.0, 200);
    }
    // All three drained, the node is not ready, and says why: its engines are
    // healthy, it takes no requests for them.
    assert_eq!(
        admin(Method::POST, "/admin/engines/2/drain", None).await.0,
        200
    );
    let ready = client()
        .get(format!("{}/readyz", node.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 503);
    let why = ready.text().await.unwrap();
    assert!(why.contains("every local engine drained"), "{why}");
    assert_eq!(
        admin(Method::POST, "/admin/engines/2/serve", None).await.0,
        200
    );
    let before = served(&es);
    for i in 0..5 {
        assert_eq!(chat(&node, &prompt(&format!("drain {i}"), 300)).await, 200);
    }
    let metrics = metrics_text(&node).await;
    for line in [
        "gorgo_engine_replica_serving{replica=\"0\"} 0",
        "gorgo_engine_replica_serving{replica=\"2\"} 1",
        "gorgo_engine_healthy 3",
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
    let after = served(&es);
    assert_eq!(after[0], before[0]);
    assert_eq!(after[1], before[1]);
    assert_eq!(after[2], before[2] + 5);
    // Engine 0 back in rotation.
    assert_eq!(
        admin(Method::POST, "/admin/engines/0/serve", None).await.0,
        200
    );

    // Removing engine 1: it drains and leaves the set once idle (the next tick).
    assert_eq!(admin(Method::DELETE, "/admin/engines/1", None).await.0, 202);
    until("engine 1 removed", || state.engine(1).is_none()).await;
    assert_eq!(admin(Method::DELETE, "/admin/engines/1", None).await.0, 404);
    // Engine 2 goes too; engine 0, the last, cannot.
    assert_eq!(admin(Method::DELETE, "/admin/engines/2", None).await.0, 202);
    assert_eq!(admin(Method::DELETE, "/admin/engines/0", None).await.0, 409);
    until("engine 2 removed", || state.engine(2).is_none()).await;
    assert_eq!(chat(&node, "still served").await, 200);
    // A new engine takes a new replica number, never a removed one's.
    let (status, v) = add(es[1].url(), serde_json::json!({})).await;
    assert_eq!(status, 201);
    assert_eq!(v["replica"], 3, "{v}");
    node.shutdown.cancel();
}

/// An engine added to a running node takes no request, and is gossiped draining, until
/// a health check has passed: idle and unqueued, it was the cheapest candidate of all
/// and drew requests to an address nothing had checked (here one that answers
/// nothing, health checks included).
#[tokio::test]
async fn an_engine_added_at_run_time_waits_for_its_first_health_check() {
    let es = engines(2).await;
    let node = start_node(config_with_engines("a", &[es[0].url()], ""), None).await;
    es[1].set_mode(HANG_ALL);
    let resp = client()
        .post(format!("{}/admin/engines", node.admin))
        .bearer_auth(TOKEN)
        .json(
            &serde_json::json!({"url": es[1].url(), "kind": "sglang", "health_timeout_ms": 60000}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    let state = node.state().clone();
    assert!(!state.engine(1).unwrap().takes_requests());
    assert!(state.local_stats()[1].draining);
    for i in 0..4 {
        assert_eq!(chat(&node, &prompt(&format!("new {i}"), 300)).await, 200);
    }
    assert_eq!(es[1].requests(), 0);
    // It answers: its next check passes, and it takes requests.
    es[1].set_mode(NORMAL);
    es[1].release.notify_waiters();
    until("engine 1 checked", || {
        state.engine(1).unwrap().takes_requests()
    })
    .await;
    assert!(!state.local_stats()[1].draining);
    node.shutdown.cancel();
}

/// Replica numbers are never reused in a run: once 64 were given out, adding one more
/// is a 409 that says a restart lifts it (it was a 400 naming `engines`, a field the
/// body does not have).
#[tokio::test]
async fn past_64_engines_added_in_a_run_adding_is_a_conflict() {
    let es = engines(1).await;
    let node = start_node(config_with_engines("a", &[es[0].url()], ""), None).await;
    let add = |port: u16| {
        let body = serde_json::json!({"url": format!("http://127.0.0.2:{port}"), "kind": "sglang", "health_interval_ms": 3600000});
        client()
            .post(format!("{}/admin/engines", node.admin))
            .bearer_auth(TOKEN)
            .json(&body)
            .send()
    };
    for port in 1..64 {
        assert_eq!(add(port).await.unwrap().status(), 201, "engine {port}");
    }
    // 64 engines: one leaves, and the next would be replica 64.
    let resp = client()
        .delete(format!("{}/admin/engines/63", node.admin))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 202);
    let state = node.state().clone();
    until("engine 63 removed", || state.engine(63).is_none()).await;
    let (status, err) = error_of(add(64).await.unwrap()).await;
    assert_eq!(status, 409, "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("restart"),
        "{err}"
    );
    node.shutdown.cancel();
}

/// Changes of the engine set that the node's state blocks are refused with a 409 that
/// says what blocks them, and a reload applies what it can:
/// - removing the last engine in rotation while the others are drained (before: 202,
///   and the node then served nothing itself, with nothing saying why);
/// - adding back an engine still draining out (before: 400 "already fronts");
/// - a reload whose file still lists such an engine adds the file's new ones (before:
///   it stopped at that engine with "already fronts" and added nothing).
#[tokio::test]
async fn engine_set_changes_the_state_blocks_say_why_and_a_reload_applies_the_rest() {
    use reqwest::Method;
    let es = engines(3).await;
    let urls: Vec<String> = es.iter().map(|e| e.url()).collect();
    let node = start_node(config_with_engines("a", &urls[..2], ""), None).await;
    let admin = |method, path: &str, body| admin_call(&node, method, path.to_owned(), body);
    // Engine 1 drained: engine 0 is the last in rotation.
    assert_eq!(
        admin(Method::POST, "/admin/engines/1/drain", None).await.0,
        200
    );
    let (status, body) = admin(Method::DELETE, "/admin/engines/0", None).await;
    assert_eq!(status, 409, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("drained: 1"),
        "{body}"
    );
    // Engine 1 back, engine 0 drained: a streamed request held at engine 1.
    assert_eq!(
        admin(Method::POST, "/admin/engines/1/serve", None).await.0,
        200
    );
    assert_eq!(
        admin(Method::POST, "/admin/engines/0/drain", None).await.0,
        200
    );
    es[1].set_mode(STREAM_THEN_HANG);
    let held = client()
        .post(format!("{}/v1/chat/completions", node.base))
        .json(&chat_body("held", true))
        .send()
        .await
        .unwrap();
    assert_eq!(held.status(), 200);
    assert_eq!(
        admin(Method::POST, "/admin/engines/0/serve", None).await.0,
        200
    );
    // Engine 1 is removed while its request runs: it stays until the request ends.
    assert_eq!(admin(Method::DELETE, "/admin/engines/1", None).await.0, 202);
    let body = serde_json::json!({"url": urls[1], "kind": "sglang"});
    let (status, err) = admin(Method::POST, "/admin/engines", Some(body)).await;
    assert_eq!(status, 409, "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("being removed"),
        "{err}"
    );
    // The file still lists engine 1 and adds a third: the third is added.
    let file = config_with_engines("a", &urls, "");
    let (added, removed) = node.state().reload_engines(file.engines()).unwrap();
    assert_eq!((added, removed), (vec![2], vec![]));
    assert!(node.state().engine(1).is_some(), "still draining out");
    // The held request ends; engine 1 leaves.
    es[1].release.notify_waiters();
    let _ = held.bytes().await;
    let state = node.state().clone();
    until("engine 1 removed", || state.engine(1).is_none()).await;
    node.shutdown.cancel();
}

#[tokio::test]
async fn peers_see_each_replica_and_decide_over_all_of_them() {
    let mesh = gorgo_node::mesh::Mesh::new();
    mesh.set_rtt("a", "b", 20.0);
    let ea = StubEngine::start("a").await;
    let eb = engines(2).await;
    let a = start_node(config("a", &ea.url(), ""), Some(&mesh)).await;
    let urls: Vec<String> = eb.iter().map(|e| e.url()).collect();
    let b = start_node(config_with_engines("b", &urls, ""), Some(&mesh)).await;
    assert_eq!(chat(&a, "hello").await, 200);
    let d = admin_json(&a, "/admin/decisions?limit=1").await;
    let of_b: Vec<u64> = d[0]["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["node"] == "b")
        .map(|c| c["replica"].as_u64().unwrap())
        .collect();
    assert_eq!(of_b, [0, 1], "{d}");
    a.shutdown.cancel();
    b.shutdown.cancel();
}

#[tokio::test]
async fn a_hung_replica_times_out_and_its_requests_go_to_another() {
    let es = engines(2).await;
    let urls: Vec<String> = es.iter().map(|e| e.url()).collect();
    let node = start_node(
        config_with_engines("a", &urls, "[limits]\nfirst_byte_timeout_ms = 300\n"),
        None,
    )
    .await;
    // Engine 0 accepts requests and never answers them (a wedged engine).
    es[0].set_mode(HANG);
    // The first goes to it, times out and is tried again: predicted (and measured for
    // the start fit) with the time that first try took, which the prediction its
    // client was told left out (the second replica's terms alone).
    let resp = client()
        .post(format!("{}/v1/chat/completions", node.base))
        .json(&chat_body(&prompt("hung 0", 400), true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        es[0].requests(),
        1,
        "the first try went to the hung replica"
    );
    let predicted: f64 = resp.headers()["x-gorgo-predicted-ttft-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(predicted >= 300.0, "{predicted}");
    for i in 1..6 {
        let status = chat_as(&node, &prompt(&format!("hung {i}"), 400), true).await;
        assert_eq!(status, 200, "request {i}");
    }
    assert_eq!(
        es[1].requests(),
        6,
        "every request ended on the live replica"
    );
    es[0].release.notify_waiters();
    node.shutdown.cancel();
}

#[tokio::test]
async fn a_reloaded_config_adds_and_removes_engines_by_url() {
    let es = engines(3).await;
    let node = start_node(
        config_with_engines("a", &[es[0].url(), es[1].url()], ""),
        None,
    )
    .await;
    let state = node.state().clone();
    let wanted = config_with_engines("a", &[es[1].url(), es[2].url()], "");
    let (added, removed) = state.reload_engines(wanted.engines()).unwrap();
    assert_eq!(added, [2]);
    assert_eq!(removed, [0]);
    until("engine 0 removed", || state.engine(0).is_none()).await;
    let urls: Vec<String> = state
        .engines()
        .iter()
        .map(|e| e.config.url.clone())
        .collect();
    assert_eq!(urls, [es[1].url(), es[2].url()]);
    // The same list again changes nothing.
    assert_eq!(
        state.reload_engines(wanted.engines()).unwrap(),
        (vec![], vec![])
    );
    node.shutdown.cancel();
}

/// A reload that replaces every engine adds the new ones before it drains the old
/// (removing first stopped at the last old engine, which a node always keeps, and
/// left the node on it alone); an engine of the startup file that was removed may be
/// added back (the check used the startup file's list, which still had it).
#[tokio::test]
async fn a_reload_replaces_every_engine_and_a_removed_one_comes_back() {
    let es = engines(3).await;
    let node = start_node(config_with_engines("a", &[es[0].url()], ""), None).await;
    let state = node.state().clone();
    let wanted = config_with_engines("a", &[es[1].url(), es[2].url()], "");
    let (added, removed) = state.reload_engines(wanted.engines()).unwrap();
    assert_eq!((added, removed), (vec![1, 2], vec![0]));
    until("engine 0 removed", || state.engine(0).is_none()).await;
    // Back to the startup file's engine alone.
    let first = config_with_engines("a", &[es[0].url()], "");
    let (added, removed) = state.reload_engines(first.engines()).unwrap();
    assert_eq!((added, removed), (vec![3], vec![1, 2]));
    until("engines 1 and 2 removed", || state.engines().len() == 1).await;
    assert_eq!(state.engines()[0].config.url, es[0].url());
    assert_eq!(
        chat(&node, "served by the engine that came back").await,
        200
    );
    node.shutdown.cancel();
}

/// A reload applies whole or not at all (docs/node.md: a bad config changes nothing):
/// one whose third engine is invalid adds none of the others (it added them one at a
/// time and stopped at the third, leaving the second added), and one whose removals
/// would leave no engine in rotation adds nothing either.
#[tokio::test]
async fn a_reload_that_cannot_apply_whole_changes_nothing() {
    let es = engines(3).await;
    let node = start_node(config_with_engines("a", &[es[0].url()], ""), None).await;
    let state = node.state().clone();
    let mut wanted = config_with_engines("a", &[es[0].url(), es[1].url()], "")
        .engines()
        .to_vec();
    let mut third = wanted[1].clone();
    third.url = es[2].url();
    third.health_interval_ms = 0;
    wanted.push(third);
    let e = state.reload_engines(&wanted).unwrap_err().to_string();
    assert!(e.contains("health_interval_ms"), "{e}");
    let urls: Vec<String> = state
        .engines()
        .iter()
        .map(|e| e.config.url.clone())
        .collect();
    assert_eq!(urls, [es[0].url()], "nothing added");
    // Engine 0 removed for a drained engine: no engine would stay in rotation.
    let mut drained = wanted[1].clone();
    drained.weight = 0.0;
    let e = state.reload_engines(&[drained]).unwrap_err().to_string();
    assert!(e.contains("cannot be removed"), "{e}");
    assert_eq!(state.engines().len(), 1, "nothing added");
    assert!(!state.engines()[0].is_removing(), "nothing removed");
    // No replica number was spent on what was not added.
    let (added, removed) = state.reload_engines(&wanted[..2]).unwrap();
    assert_eq!((added, removed), (vec![1], vec![]));
    node.shutdown.cancel();
}

#[tokio::test]
async fn health_checks_take_a_dead_replica_out_without_a_request() {
    let es = engines(2).await;
    let urls: Vec<String> = es.iter().map(|e| e.url()).collect();
    let text = config_with_engines("a", &urls, "")
        .into_inner()
        .to_toml_string()
        .unwrap()
        .replace("health_interval_ms = 3600000", "health_interval_ms = 50");
    let node = start_node(NodeConfig::from_toml_str(&text).unwrap(), None).await;
    let state = node.state().clone();
    until("both engines confirmed", || state.is_ready()).await;
    es[1].shutdown.cancel();
    until("engine 1 out", || {
        !state.engine(1).unwrap().takes_requests()
    })
    .await;
    let stats = state.local_stats();
    assert!(!stats[0].draining && stats[1].draining, "{stats:?}");
    assert!(state.is_ready(), "engine 0 still serves");
    node.shutdown.cancel();
}

/// `request_timeout_ms` bounds the whole request, its tries before the head too: with
/// two hanging engines each try waits a first-byte timeout, and two of them outlast
/// the request's deadline, which answers (504, "request timed out") instead of the
/// engines' own timeouts one after the other.
#[tokio::test]
async fn the_request_deadline_covers_the_tries_before_the_head() {
    let es = engines(2).await;
    for e in &es {
        e.set_mode(HANG);
    }
    let urls: Vec<String> = es.iter().map(|e| e.url()).collect();
    let extra = "[limits]\nrequest_timeout_ms = 1000\nfirst_byte_timeout_ms = 800\n";
    let node = start_node(config_with_engines("a", &urls, extra), None).await;
    // Streamed: each try's head is bounded by the first-byte timeout.
    let (status, body) = error_of(post_chat(&node, "x", true).await).await;
    assert_eq!(status, 504);
    assert_eq!(body["error"]["message"], "request timed out", "{body}");
    assert_eq!(served(&es), vec![1, 1], "both engines were tried");
    for e in &es {
        e.release.notify_waiters();
    }
    node.shutdown.cancel();
}

/// One engine spelled another way (a trailing `/`, the scheme or the host in capitals)
/// is the engine the node already fronts: `POST /admin/engines` refuses it (it used to
/// become a second replica, one engine counted as two candidates with two gossip
/// streams, each seeing half its requests). The admin API's errors name the request's
/// own field (`url`, not `engines[1].url` of the merged list, nor "config: ..."), and
/// a conflict with the node's state is a 409 `invalid_request_error`.
#[tokio::test]
async fn an_engine_spelled_another_way_is_refused_as_the_same_engine() {
    let es = engines(1).await;
    let node = start_node(config_with_engines("a", &[es[0].url()], ""), None).await;
    let call = |method: reqwest::Method, path: &str, body: Option<serde_json::Value>| {
        let mut req = client()
            .request(method, format!("{}{path}", node.admin))
            .bearer_auth(TOKEN);
        if let Some(b) = body {
            req = req.json(&b);
        }
        async move { error_of(req.send().await.unwrap()).await }
    };
    let url = es[0].url();
    for spelled in [
        format!("{url}/"),
        url.replace("http://", "HTTP://"),
        url.clone(),
    ] {
        let body = serde_json::json!({"url": spelled, "kind": "sglang"});
        let (status, e) = call(reqwest::Method::POST, "/admin/engines", Some(body)).await;
        assert_eq!(status, 400, "{spelled}: {e}");
        let message = e["error"]["message"].as_str().unwrap();
        assert!(
            message.starts_with("invalid `url`: the node already fronts"),
            "{spelled}: {e}"
        );
        assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
    }
    let body = serde_json::json!({"url": "ftp://x", "kind": "sglang"});
    let (status, e) = call(reqwest::Method::POST, "/admin/engines", Some(body)).await;
    assert_eq!(status, 400, "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("invalid `url`: must start with http://"),
        "{e}"
    );
    assert_eq!(node.state().engines().len(), 1);
    // The last engine cannot go: a conflict, in the request error's shape.
    let (status, e) = call(reqwest::Method::DELETE, "/admin/engines/0", None).await;
    assert_eq!(status, 409, "{e}");
    assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
    assert_eq!(e["error"]["code"], "conflict", "{e}");
    let message = e["error"]["message"].as_str().unwrap();
    assert!(!message.starts_with("config:"), "{e}");
    node.shutdown.cancel();
}

/// An engine URL is `http://host:port`: the spellings that slipped past the duplicate
/// check as another engine (user info, a `.` path, an empty query or fragment, the
/// integer form of the IPv4 address, which the HTTP client reads as the same
/// address) are refused, with `param` `url`, and the node still fronts one engine.
#[tokio::test]
async fn an_engine_url_is_host_and_port_however_it_is_spelled() {
    use reqwest::Method;
    let es = engines(1).await;
    let node = start_node(config_with_engines("a", &[es[0].url()], ""), None).await;
    let port = es[0].addr.port();
    let url = es[0].url();
    for spelled in [
        format!("http://x@127.0.0.1:{port}"),
        format!("{url}/."),
        format!("{url}/?"),
        format!("{url}/#"),
        format!("{url}/x?y=1"),
        format!("http://2130706433:{port}"),
        format!("http://127.1:{port}/"),
    ] {
        let body = serde_json::json!({"url": spelled, "kind": "sglang"});
        let (status, e) =
            admin_call(&node, Method::POST, "/admin/engines".into(), Some(body)).await;
        assert_eq!(status, 400, "{spelled}: {e}");
        assert_eq!(e["error"]["param"], "url", "{spelled}: {e}");
        let message = e["error"]["message"].as_str().unwrap();
        assert!(message.starts_with("invalid `url`: "), "{spelled}: {e}");
    }
    assert_eq!(node.state().engines().len(), 1);
    node.shutdown.cancel();
}

/// An engine no health check has passed is not reported healthy (the answer to
/// `POST /admin/engines` said `"healthy": true` for an address nothing listens on),
/// and it does not count as in rotation: the one engine that passed its checks cannot
/// be removed while the others have passed none (it was, leaving the node with no
/// working engine). Engines that never passed a check may be removed, and a reload
/// may swap an engine that never passed one (a node started before its engine).
#[tokio::test]
async fn an_engine_no_health_check_passed_is_neither_healthy_nor_in_rotation() {
    use reqwest::Method;
    let es = engines(1).await;
    let node = start_node(config_with_engines("a", &[es[0].url()], ""), None).await;
    let state = node.state().clone();
    until("engine 0 checked", || state.is_ready()).await;
    let nowhere = serde_json::json!({"url": "http://127.0.0.2:1", "kind": "sglang"});
    let (status, v) = admin_call(&node, Method::POST, "/admin/engines".into(), Some(nowhere)).await;
    assert_eq!(status, 201, "{v}");
    assert_eq!(v["healthy"], false, "{v}");
    assert_eq!(v["health_checked"], false, "{v}");
    let list = admin_json(&node, "/admin/engines").await;
    assert_eq!(list[0]["healthy"], true, "{list}");
    assert_eq!(list[0]["health_checked"], true, "{list}");
    assert_eq!(list[1]["healthy"], false, "{list}");
    let (status, e) = admin_call(&node, Method::DELETE, "/admin/engines/0".into(), None).await;
    assert_eq!(status, 409, "{e}");
    assert_eq!(e["error"]["code"], "conflict", "{e}");
    let message = e["error"]["message"].as_str().unwrap();
    assert!(message.contains("health check"), "{e}");
    assert!(!state.engine(0).unwrap().is_removing());
    assert!(state.is_ready());
    // The unchecked one may go.
    let (status, e) = admin_call(&node, Method::DELETE, "/admin/engines/1".into(), None).await;
    assert_eq!(status, 202, "{e}");
    node.shutdown.cancel();

    // A node whose engine never answered: a reload swaps it for one that does.
    let node = start_node(
        config_with_engines("b", &["http://127.0.0.2:1".to_owned()], ""),
        None,
    )
    .await;
    let state = node.state().clone();
    let wanted = config_with_engines("b", &[es[0].url()], "");
    let (added, removed) = state.reload_engines(wanted.engines()).unwrap();
    assert_eq!((added, removed), (vec![1], vec![0]));
    until("engine 1 checked", || state.is_ready()).await;
    node.shutdown.cancel();
}

/// Every admin body is a JSON object: serde also takes a struct from an array of its
/// fields in order, and `PUT /admin/weights` took `[1, 2]` and changed the weights.
/// A field of the wrong type or value is named in `param`.
#[tokio::test]
async fn admin_bodies_are_objects_and_their_errors_name_the_field() {
    use reqwest::Method;
    let es = engines(1).await;
    let node = start_node(config_with_engines("a", &[es[0].url()], ""), None).await;
    let before = *node.state().weights.read();
    for (method, path, body) in [
        (Method::PUT, "/admin/weights", serde_json::json!([1, 2])),
        (
            Method::PUT,
            "/admin/weights",
            serde_json::json!([1, 2, "static"]),
        ),
        (
            Method::POST,
            "/admin/engines",
            serde_json::json!(["http://127.0.0.2:1", "sglang"]),
        ),
        (
            Method::POST,
            "/admin/prefix_match",
            serde_json::json!([[1, 2], 0]),
        ),
        (Method::PUT, "/admin/weights", serde_json::json!("static")),
    ] {
        let (status, e) = admin_call(&node, method, path.into(), Some(body.clone())).await;
        assert_eq!(status, 400, "{path} {body}: {e}");
        let message = e["error"]["message"].as_str().unwrap();
        assert!(
            message.starts_with("body must be") && message.contains("a JSON object"),
            "{path} {body}: {e}"
        );
    }
    assert_eq!(*node.state().weights.read(), before, "weights unchanged");
    assert_eq!(node.state().engines().len(), 1);
    for (method, path, body, param) in [
        (
            Method::PUT,
            "/admin/weights",
            serde_json::json!({"w_rtt": "x", "w_queue": 1}),
            "w_rtt",
        ),
        (
            Method::PUT,
            "/admin/weights",
            serde_json::json!({"w_rt": 1, "w_queue": 1}),
            "w_rt",
        ),
        (
            Method::POST,
            "/admin/engines",
            serde_json::json!({"url": "http://127.0.0.2:1", "kind": "sglang", "weight": "x"}),
            "weight",
        ),
        (
            Method::POST,
            "/admin/engines",
            serde_json::json!({"url": "http://127.0.0.2:1"}),
            "kind",
        ),
        (
            Method::POST,
            "/admin/engines",
            serde_json::json!({"url": "http://127.0.0.2:1", "kind": "sglang", "weight": -1.0}),
            "weight",
        ),
        (
            Method::POST,
            "/admin/engines",
            serde_json::json!({"url": es[0].url(), "kind": "sglang"}),
            "url",
        ),
        (
            Method::POST,
            "/admin/engines",
            serde_json::json!({"url": "http://127.0.0.2:1", "kind": "sglang", "health_path": "/x\r\nEvil: 1"}),
            "health_path",
        ),
        (
            Method::POST,
            "/admin/prefix_match",
            serde_json::json!({"token_ids": [1, -2]}),
            "token_ids[1]",
        ),
    ] {
        let (status, e) = admin_call(&node, method, path.into(), Some(body.clone())).await;
        assert_eq!(status, 400, "{path} {body}: {e}");
        assert_eq!(e["error"]["param"], param, "{path} {body}: {e}");
    }
    assert_eq!(node.state().engines().len(), 1);
    node.shutdown.cancel();
}
