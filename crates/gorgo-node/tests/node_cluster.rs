//! Three nodes in one process (in-memory mesh), each beside its own stub engine:
//! local serving, forwarding to the peer that holds the prefix, the max-hops guard,
//! and killed peers.
mod common;

use std::time::Duration;

use common::*;
use gorgo_node::mesh::Mesh;

const IDS: [&str; 3] = ["a", "b", "c"];

type Cluster = MeshCluster;

async fn cluster(extra: &str) -> Cluster {
    let rtts = [("a", "b", 150.0), ("a", "c", 200.0), ("b", "c", 250.0)];
    mesh_cluster(&IDS, &rtts, |_| extra.to_owned()).await
}

impl Cluster {
    /// Make node `i`'s engine report `waiting` queued requests, and read it now.
    async fn saturate(&self, i: usize, waiting: u32) {
        self.engines[i]
            .waiting
            .store(waiting, std::sync::atomic::Ordering::SeqCst);
        self.nodes[i]
            .state()
            .engine(0)
            .unwrap()
            .adapter
            .scrape()
            .await;
    }
}

/// A non-streaming chat through `node`: its status and response headers, body read.
async fn chat_response(node: &TestNode, prompt: &str) -> (u16, reqwest::header::HeaderMap) {
    chat_response_as(node, prompt, false).await
}

/// [`chat_response`], streamed or not.
async fn chat_response_as(
    node: &TestNode,
    prompt: &str,
    stream: bool,
) -> (u16, reqwest::header::HeaderMap) {
    let resp = client()
        .post(format!("{}/v1/chat/completions", node.base))
        .json(&chat_body(prompt, stream))
        .send()
        .await
        .unwrap();
    let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
    let _ = resp.bytes().await.unwrap();
    (status, headers)
}

/// A header's value, empty when absent.
fn header(headers: &reqwest::header::HeaderMap, name: &str) -> String {
    headers
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
}

async fn chat(node: &TestNode, prompt: &str) -> (u16, String, u32) {
    chat_as(node, prompt, false).await
}

/// [`chat`], streamed or not: a streamed request's head comes with its first token, so
/// it is what the first-byte timeout bounds (one that is not streamed waits up to the
/// request timeout: `LimitsSection::head_timeout`).
async fn chat_as(node: &TestNode, prompt: &str, stream: bool) -> (u16, String, u32) {
    let (status, headers) = chat_response_as(node, prompt, stream).await;
    let hops = header(&headers, "x-gorgo-hops").parse().unwrap_or(0);
    (status, header(&headers, "x-gorgo-served-by"), hops)
}

#[tokio::test]
async fn idle_local_engine_serves_locally() {
    let c = cluster("").await;
    for (i, id) in IDS.iter().enumerate() {
        // Distinct prompts: a prompt another node has cached may rightly go there.
        let (status, served, hops) = chat(&c.nodes[i], &prompt(id, 4000)).await;
        assert_eq!((status, served.as_str(), hops), (200, *id, 0));
    }
}

#[tokio::test]
async fn saturated_node_forwards_to_the_peer_holding_the_prefix() {
    let c = cluster("").await;
    let p = prompt("shared context of a long conversation", 40_000);
    // b serves the prompt first, so b's engine caches it.
    assert_eq!(chat(&c.nodes[1], &p).await, (200, "b".into(), 0));
    // a is saturated: 50 requests queued at its engine.
    c.saturate(0, 50).await;
    assert_eq!(chat(&c.nodes[0], &p).await, (200, "b".into(), 1));
    assert_eq!(c.engines[0].requests(), 0, "a's engine never saw it");
    assert_eq!(c.engines[1].requests(), 2);

    // The decision at a shows every candidate's terms and b as the winner.
    let d = admin_json(&c.nodes[0], "/admin/decisions?limit=1").await;
    assert_eq!(d[0]["winner"], "b");
    assert_eq!(d[0]["candidates"].as_array().unwrap().len(), 3);
    // At b the forwarded request arrived with hops = max_hops and was served there;
    // every node is still priced (a, which it left, too: it could not go back anyway,
    // and the simulator prices it so).
    let d = admin_json(&c.nodes[1], "/admin/decisions?limit=1").await;
    assert_eq!(d[0]["reason"], "max-hops");
    assert_eq!(d[0]["candidates"].as_array().unwrap().len(), 3, "{d}");
    // What serving it there cost is shown (b's one engine, priced as a choice among
    // its engines would be; the peers it could not go to are not priced).
    let local = d[0]["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["is_local"] == true)
        .unwrap();
    assert!(local["terms"]["total_ms"].as_f64().is_some(), "{d}");

    // Streaming through the forward stays SSE, chunk by chunk.
    let resp = client()
        .post(format!("{}/v1/chat/completions", c.nodes[0].base))
        .json(&chat_body(&p, true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-gorgo-served-by"], "b");
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let text = resp.text().await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
}

/// A peer whose engines hold a shorter context than the origin's refuses a forwarded
/// prompt it cannot hold with a 502, and the origin, which checked the prompt against
/// its own engines, serves it itself. Before, the peer's 400
/// `context_length_exceeded` reached the client for a prompt the origin's engine could
/// serve.
#[tokio::test]
async fn a_prompt_too_long_for_the_peer_is_served_at_its_origin() {
    let mesh = Mesh::new();
    mesh.set_rtt("a", "b", 150.0);
    let engines = [StubEngine::start("a").await, StubEngine::start("b").await];
    let a = start_node(config("a", &engines[0].url(), ""), Some(&mesh)).await;
    let b = start_node(
        config_with_engine("b", &engines[1].url(), "max_context_tokens = 100\n"),
        Some(&mesh),
    )
    .await;
    until("a holds b's stats", || {
        a.state()
            .peers
            .peers()
            .iter()
            .any(|p| p.id == "b".into() && !p.engines.is_empty())
    })
    .await;
    // a is saturated, so it forwards to b, whose context is 100 tokens.
    engines[0]
        .waiting
        .store(50, std::sync::atomic::Ordering::SeqCst);
    a.state().engine(0).unwrap().adapter.scrape().await;
    let (status, served, hops) = chat(&a, &prompt("a long prompt", 4000)).await;
    assert_eq!((status, served.as_str(), hops), (200, "a", 0));
    assert_eq!(engines[1].requests(), 0, "b's engine never saw it");
    let d = admin_json(&a, "/admin/decisions?limit=1").await;
    assert_eq!(d[0]["winner"], "b", "{d}");
    assert_eq!(d[0]["forward_outcome"], "forward-failed", "{d}");
    // Said to a client of b's own, it is the client's error.
    let resp = post_chat(&b, &prompt("a long prompt", 4000), false).await;
    let (status, err) = error_of(resp).await;
    assert_eq!(status, 400);
    assert_eq!(err["error"]["code"], "context_length_exceeded", "{err}");
    for n in [&a, &b] {
        n.shutdown.cancel();
    }
}

#[tokio::test]
async fn never_more_than_max_hops_even_when_all_are_saturated() {
    let c = cluster("").await;
    for i in 0..3 {
        c.saturate(i, 100).await;
    }
    for round in 0..4 {
        for (i, node) in c.nodes.iter().enumerate() {
            let (status, _, hops) = chat(node, &prompt(&format!("r{round}n{i}"), 8000)).await;
            assert_eq!(status, 200);
            assert!(hops <= 1, "hops {hops}");
        }
    }
    // max_hops = 0 turns forwarding off.
    let c = cluster("[routing]\nmax_hops = 0\n").await;
    let p = prompt("zero hops", 40_000);
    chat(&c.nodes[1], &p).await;
    c.saturate(0, 100).await;
    assert_eq!(chat(&c.nodes[0], &p).await, (200, "a".into(), 0));
}

#[tokio::test]
async fn killed_peer_stops_receiving_forwards() {
    let c = cluster("").await;
    let p = prompt("context held by b", 40_000);
    chat(&c.nodes[1], &p).await;
    c.saturate(0, 50).await;
    assert_eq!(chat(&c.nodes[0], &p).await.1, "b");
    c.mesh.kill("b");
    c.nodes[1].shutdown.cancel();
    let before = c.engines[1].requests();
    for _ in 0..3 {
        let (status, served, _) = chat(&c.nodes[0], &p).await;
        assert_eq!(status, 200);
        assert_ne!(served, "b");
    }
    assert_eq!(c.engines[1].requests(), before);
}

async fn wait_for_requests(engine: &StubEngine, n: u64) {
    tokio::time::timeout(Duration::from_secs(10), async {
        while engine.requests() < n {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("request reached the engine");
}

/// Timeouts far beyond any test: only membership can end a forward to a dead peer.
const NO_TIMEOUTS: &str =
    "[limits]\nfirst_byte_timeout_ms = 3600000\nrequest_timeout_ms = 3600000\n";

/// Guard against a hang: what it wraps must end long before, or the test fails.
async fn or_hang<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), fut)
        .await
        .unwrap_or_else(|_| panic!("{what}: still waiting"))
}

/// The prompt whose prefix b holds in the forward tests.
fn b_prompt() -> String {
    prompt("context held by b", 40_000)
}

impl Cluster {
    /// a, saturated, forwards a prompt to b (which holds its prefix), whose engine is
    /// in `mode`; returns the prompt.
    async fn prefix_at_b(&self, mode: u8) -> String {
        let p = b_prompt();
        chat(&self.nodes[1], &p).await;
        self.saturate(0, 50).await;
        self.engines[1].set_mode(mode);
        p
    }

    /// A non-streaming request at a, forwarded to b and held by b's engine: its status
    /// and server once it is answered.
    async fn held_at_b(&self) -> tokio::task::JoinHandle<(u16, String)> {
        let p = self.prefix_at_b(HANG).await;
        let node_a = self.nodes[0].base.clone();
        let body = chat_body(&p, false);
        let pending = tokio::spawn(async move {
            let resp = client()
                .post(format!("{node_a}/v1/chat/completions"))
                .json(&body)
                .send()
                .await
                .unwrap();
            let served = resp.headers()["x-gorgo-served-by"]
                .to_str()
                .unwrap()
                .to_owned();
            (resp.status().as_u16(), served)
        });
        wait_for_requests(&self.engines[1], 2).await;
        pending
    }

    /// A stream at a, forwarded to b, after its first chunk (b's engine then holds).
    async fn streaming_from_b(&self) -> reqwest::Response {
        let p = self.prefix_at_b(STREAM_THEN_HANG).await;
        let mut resp = client()
            .post(format!("{}/v1/chat/completions", self.nodes[0].base))
            .json(&chat_body(&p, true))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.headers()["x-gorgo-served-by"], "b");
        let first = resp.chunk().await.unwrap().unwrap();
        assert!(first.starts_with(b"data: {"), "{first:?}");
        resp
    }
}

/// The rest of a stream, as text.
async fn rest_of(mut resp: reqwest::Response) -> String {
    let mut rest = Vec::new();
    while let Some(chunk) = resp.chunk().await.unwrap() {
        rest.extend_from_slice(&chunk);
    }
    String::from_utf8(rest).unwrap()
}

/// The rest of a stream that broke: an SSE error event, no end marker.
fn assert_error_event(rest: &str) {
    assert!(rest.starts_with("data: {\"error\""), "{rest}");
    assert!(!rest.contains("[DONE]"), "{rest}");
}

#[tokio::test]
async fn forward_failing_before_first_byte_falls_back_locally() {
    let c = cluster("").await;
    let pending = c.held_at_b().await;
    // The forward is at b's engine, which holds it: now b dies.
    c.mesh.kill("b");
    c.nodes[1].shutdown.cancel();
    let (status, served) = pending.await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(served, "a", "served locally after the forward failed");
    // The failed forward never became work at b: it is off a's ledger at once (b,
    // dead, sends no stats that would clear it).
    let ledger = c.nodes[0]
        .state()
        .router
        .ledger
        .lock()
        .pending(&"b".into(), 0);
    assert_eq!(ledger, (0, 0));
    // a's decision log says the forward it chose failed.
    let d = admin_json(&c.nodes[0], "/admin/decisions?limit=1").await;
    assert_eq!(d[0]["winner"], "b");
    assert_eq!(d[0]["forward_outcome"], "forward-failed", "{d}");
    c.engines[1].release.notify_waiters();
}

/// A client that leaves while its forward waits for the peer's head takes the forward
/// off the ledger then (the stream's reset cancels the work at the peer), not at the
/// peer's next stats.
#[tokio::test]
async fn a_forward_whose_client_left_before_the_head_leaves_the_ledger() {
    let c = cluster("").await;
    let pending = c.held_at_b().await;
    pending.abort();
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let d = admin_json(&c.nodes[0], "/admin/decisions?limit=1").await;
            if d[0]["forward_outcome"] == "forward-cancelled" {
                assert_eq!(d[0]["winner"], "b", "{d}");
                break;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the forward's outcome is noted once the client left");
    let ledger = c.nodes[0]
        .state()
        .router
        .ledger
        .lock()
        .pending(&"b".into(), 0);
    assert_eq!(ledger, (0, 0));
    c.engines[1].release.notify_waiters();
}

/// A peer whose engine times out before its first byte answers the forward 504
/// before anything reached the client: the forwarding node serves the request
/// itself, as for a 502 or a 503 (it used to relay the 504 to the client).
#[tokio::test]
async fn a_forward_the_peer_times_out_falls_back_locally() {
    let c = mesh_cluster(
        &IDS,
        &[("a", "b", 150.0), ("a", "c", 200.0), ("b", "c", 250.0)],
        |id| {
            if id == "b" {
                "[limits]\nfirst_byte_timeout_ms = 300\n".to_owned()
            } else {
                String::new()
            }
        },
    )
    .await;
    let p = c.prefix_at_b(HANG).await;
    let (status, headers) = or_hang(
        "the forwarded request",
        chat_response_as(&c.nodes[0], &p, true),
    )
    .await;
    let served = header(&headers, "x-gorgo-served-by");
    assert_eq!((status, served.as_str()), (200, "a"));
    let d = admin_json(&c.nodes[0], "/admin/decisions?limit=1").await;
    assert_eq!(d[0]["winner"], "b");
    assert_eq!(d[0]["forward_outcome"], "forward-failed", "{d}");
    // What the request met is a's own engine after the 300 ms b's engine took to time
    // out (and a round trip): the prediction the client is told, which comes from the
    // same terms as the start fit's evidence (`CostTerms::served_locally_after`), is
    // a's estimate plus that time, not the forward's, which proved wrong.
    let predicted: f64 = header(&headers, "x-gorgo-predicted-ttft-ms")
        .parse()
        .unwrap();
    let estimate = |is_local: bool| {
        d[0]["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["is_local"] == is_local && c["node"] == if is_local { "a" } else { "b" })
            .unwrap()["terms"]["estimated_ttft_ms"]
            .as_f64()
            .unwrap()
    };
    let (local, forward) = (estimate(true), estimate(false));
    assert!(
        predicted >= local + 300.0 && predicted < local + 60_000.0,
        "predicted {predicted}, a's own estimate {local}, the forward's {forward}"
    );
    c.engines[1].release.notify_waiters();
}

#[tokio::test]
async fn forward_failing_mid_stream_ends_with_an_error_event() {
    let c = cluster("").await;
    let resp = c.streaming_from_b().await;
    c.mesh.kill("b");
    c.nodes[1].shutdown.cancel();
    assert_error_event(&rest_of(resp).await);
    c.engines[1].release.notify_waiters();
}

#[tokio::test]
async fn client_disconnect_cancels_the_forwarded_request_at_the_peer() {
    let c = cluster("").await;
    let resp = c.streaming_from_b().await;
    assert_eq!(c.nodes[1].state().engine(0).unwrap().adapter.inflight(), 1);
    drop(resp);
    let b = c.nodes[1].state().clone();
    tokio::time::timeout(Duration::from_secs(10), async move {
        while b.engine_inflight() != 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the peer dropped the engine request");
    c.engines[1].release.notify_waiters();
}

#[tokio::test]
async fn a_forward_to_a_peer_declared_dead_falls_back_at_once() {
    let c = cluster(NO_TIMEOUTS).await;
    let pending = c.held_at_b().await;
    // b is declared dead, as after kill -9: nothing closes the stream (b's node and
    // engine are still there, still holding it), only membership knows.
    c.mesh.kill("b");
    let (status, served) = or_hang("the forward to dead b", pending).await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(served, "a", "served locally once b was declared dead");
    c.engines[1].release.notify_waiters();
}

#[tokio::test]
async fn a_stream_from_a_peer_declared_dead_ends_with_an_error_event() {
    let c = cluster(NO_TIMEOUTS).await;
    let resp = c.streaming_from_b().await;
    // b is declared dead mid-stream; its stream stays open (its engine still holds).
    c.mesh.kill("b");
    let rest = or_hang("the stream from dead b", rest_of(resp)).await;
    assert_error_event(&rest);
    assert!(rest.contains("declared dead"), "{rest}");
    c.engines[1].release.notify_waiters();
}

#[tokio::test]
async fn a_draining_peer_gets_no_new_forwards_but_finishes_what_it_has() {
    let c = cluster("").await;
    // A stream b is serving for a when b starts draining (SIGTERM at b).
    let resp = c.streaming_from_b().await;
    c.nodes[1].state().peers.drain();
    c.engines[1].set_mode(NORMAL);
    let p = b_prompt();
    let before = c.engines[1].requests();
    for _ in 0..3 {
        let (status, served, _) = chat(&c.nodes[0], &p).await;
        assert_eq!(status, 200);
        assert_ne!(served, "b", "a forwarded to draining b");
    }
    assert_eq!(c.engines[1].requests(), before);
    // What b had in flight finishes normally.
    c.engines[1].release.notify_waiters();
    let rest = or_hang("b's last stream", rest_of(resp)).await;
    assert!(rest.ends_with("data: [DONE]\n\n"), "{rest}");
}

/// b holds the prefix and is far busier than a (100x the requests waiting: enough that
/// b's queue outweighs what a's own queue and the re-prefill stall there cost; c is
/// busier still, so that only a and b are in question), but a believes b fast: its forward
/// bias for b says its last forwards there were early by a minute (a stale belief, as
/// after a burst has just reached b). a forwards to b what b, knowing its own queue,
/// serves later than a would.
async fn refusing_cluster(b_refuses: bool) -> (Cluster, String) {
    let rtts = [("a", "b", 150.0), ("a", "c", 200.0), ("b", "c", 250.0)];
    let c = mesh_cluster(&IDS, &rtts, |id| match id {
        "b" => format!("[routing]\nrefuse_forwards = {b_refuses}\n"),
        _ => String::new(),
    })
    .await;
    let p = b_prompt();
    // Streamed, so that b's prefill fit takes its first sample from it (a whole JSON
    // body's first chunk comes at the end and teaches the fit nothing).
    let resp = client()
        .post(format!("{}/v1/chat/completions", c.nodes[1].base))
        .json(&chat_body(&p, true))
        .send()
        .await
        .unwrap();
    assert_eq!(header(resp.headers(), "x-gorgo-served-by"), "b");
    let _ = resp.bytes().await.unwrap();
    c.saturate(0, 5).await;
    c.saturate(1, 500).await;
    c.saturate(2, 5000).await;
    let a = c.nodes[0].state();
    a.router
        .ledger
        .lock()
        .observe_forward_ttft(&"b".into(), 0, 1e6, 0.0, a.now_ms());
    (c, p)
}

#[tokio::test]
async fn a_forward_the_target_would_serve_later_is_refused_and_served_at_its_origin() {
    let (c, p) = refusing_cluster(true).await;
    let (status, headers) = chat_response(&c.nodes[0], &p).await;
    let served = header(&headers, "x-gorgo-served-by");
    let predicted: f64 = header(&headers, "x-gorgo-predicted-ttft-ms")
        .parse()
        .unwrap();
    assert_eq!((status, served.as_str()), (200, "a"));
    assert_eq!(
        c.engines[1].requests(),
        1,
        "b's engine never saw the forward"
    );
    // a decided to forward to b; b's log shows the refusal with its terms.
    let d = admin_json(&c.nodes[0], "/admin/decisions?limit=1").await;
    assert_eq!(d[0]["winner"], "b");
    // ... and what became of it: the record does not claim b served it.
    assert_eq!(d[0]["forward_outcome"], "forward-refused", "{d}");
    let a_request = d[0]["request_id"].clone();
    // The client is told a's own prediction for serving it (plus the refusal's round
    // trip), not the forward's, which proved wrong.
    let estimate = |is_local: bool| {
        d[0]["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["is_local"] == is_local && c["node"] == if is_local { "a" } else { "b" })
            .unwrap()["terms"]["estimated_ttft_ms"]
            .as_f64()
            .unwrap()
    };
    let (local, forward) = (estimate(true), estimate(false));
    assert!(
        predicted >= local && predicted < local + 60_000.0 && (predicted - forward).abs() > 1.0,
        "predicted {predicted}, a's own estimate {local}, the forward's {forward}"
    );
    let d = admin_json(&c.nodes[1], "/admin/decisions?limit=1").await;
    assert_eq!(d[0]["reason"], "refused");
    assert!(d[0]["winner"].is_null());
    // b's record names the forward's origin and its request there.
    assert_eq!(d[0]["origin"]["node"], "a", "{d}");
    assert_eq!(d[0]["origin"]["request_id"], a_request, "{d}");
    let local = d[0]["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["is_local"] == true)
        .unwrap();
    assert!(local["terms"]["total_ms"].as_f64().unwrap() > 0.0);
    let m = metrics_text(&c.nodes[0]).await;
    assert!(
        m.contains(r#"gorgo_forwards_total{peer="b",result="refused"} 1"#),
        "{m}"
    );
    let m = metrics_text(&c.nodes[1]).await;
    assert!(m.contains("gorgo_forwards_refused_total 1"), "{m}");
    // Nothing of the refused forward stays pending at a.
    let pending = c.nodes[0]
        .state()
        .router
        .ledger
        .lock()
        .pending(&"b".into(), 0);
    assert_eq!(pending, (0, 0));
}

#[tokio::test]
async fn a_node_with_refusals_off_serves_every_forward() {
    let (c, p) = refusing_cluster(false).await;
    assert_eq!(chat(&c.nodes[0], &p).await, (200, "b".into(), 1));
}

/// A forward that fails before its first byte leaves that peer out of the request's
/// next try: a, draining, sends its request to b (which holds the prefix), whose
/// engine does not answer in time; a tries c next (before, it routed to b again or gave
/// up on the peers and served the request itself).
#[tokio::test]
async fn a_peer_that_failed_a_request_is_left_out_of_its_next_try() {
    let c = cluster("[limits]\nfirst_byte_timeout_ms = 300\n").await;
    let p = b_prompt();
    chat(&c.nodes[1], &p).await;
    c.engines[1].set_mode(HANG);
    c.nodes[0].state().start_draining();
    let before = c.engines[1].requests();
    let (status, served, _) = or_hang("the request", chat_as(&c.nodes[0], &p, true)).await;
    assert_eq!(status, 200);
    assert_eq!(served, "c");
    assert_eq!(c.engines[1].requests(), before + 1, "b was tried once");
    c.engines[1].release.notify_waiters();
}

/// With `max_hops` above 1 a forward never goes back to a node it has left: b,
/// saturated like c, gets a's forward (`via` [a]); a, idle and nearest, is b's
/// cheapest candidate, but b serves it itself (before, it sent it back to a: the
/// request bounced, two RTTs for nothing).
#[tokio::test]
async fn a_forward_never_goes_back_to_a_node_it_has_left() {
    use tokio::io::AsyncReadExt;
    let c = cluster("[routing]\nmax_hops = 2\nrefuse_forwards = false\n").await;
    c.saturate(1, 100).await;
    c.saturate(2, 100).await;
    let body = serde_json::to_vec(&chat_body(&prompt("bounce", 8000), false)).unwrap();
    let request = forward_request("a", gorgo_core::Endpoint::Chat, body);
    let mut ex = forward_exchange(
        c.nodes[1].state(),
        &forward_frame(&request).await,
        |state, req| async move { gorgo_node::serve::serve(&state, req).await },
    )
    .await;
    assert_eq!(ex.head.status, 200);
    assert_eq!(ex.head.served_by.0, "b");
    // The decision at b shows a as a candidate that could not serve.
    let d = admin_json(&c.nodes[1], "/admin/decisions?limit=1").await;
    assert_eq!(d[0]["winner"], "b", "{d}");
    // Read the body to its end so that b's serving task finishes.
    let mut rest = Vec::new();
    ex.from_node.read_to_end(&mut rest).await.unwrap();
    drop(ex.to_node);
    ex.served.await.unwrap();
}

/// At the second hop the serving node's decision names the request by its id at the
/// origin (the node its client called), as at the first: the node in between passes
/// the origin's id on. It sent its own id, so the record paired the origin's name with
/// a number the origin never used.
#[tokio::test]
async fn a_second_hop_names_the_request_by_its_id_at_the_origin() {
    use tokio::io::AsyncReadExt;
    let c = cluster("[routing]\nmax_hops = 2\nrefuse_forwards = false\n").await;
    c.saturate(1, 100).await;
    let body = serde_json::to_vec(&chat_body(&prompt("two hops", 8000), false)).unwrap();
    let mut request = forward_request("a", gorgo_core::Endpoint::Chat, body);
    request.request_id = 1_000_000;
    let mut ex = forward_exchange(
        c.nodes[1].state(),
        &forward_frame(&request).await,
        |state, req| async move { gorgo_node::serve::serve(&state, req).await },
    )
    .await;
    assert_eq!(ex.head.status, 200);
    assert_eq!(ex.head.served_by.0, "c");
    let d = admin_json(&c.nodes[2], "/admin/decisions?limit=1").await;
    assert_eq!(d[0]["hops"], 2, "{d}");
    assert_eq!(d[0]["origin"]["node"], "a", "{d}");
    assert_eq!(d[0]["origin"]["request_id"], 1_000_000, "{d}");
    let mut rest = Vec::new();
    ex.from_node.read_to_end(&mut rest).await.unwrap();
    drop(ex.to_node);
    ex.served.await.unwrap();
}

/// A forward that fails falls back to the local engine only while that engine takes
/// new requests: drained while the forward was out (as an operator drains it), it
/// gets nothing, and the request is decided again without it (here nothing is left:
/// 503). It used to reach the drained engine through the fallback the decision fixed.
#[tokio::test]
async fn a_failed_forward_does_not_fall_back_to_an_engine_drained_meanwhile() {
    let c = mesh_cluster(&["a", "b"], &[("a", "b", 150.0)], |_| {
        NO_TIMEOUTS.to_owned()
    })
    .await;
    let p = c.prefix_at_b(HANG).await;
    let node_a = c.nodes[0].base.clone();
    let body = chat_body(&p, false);
    let pending = tokio::spawn(async move {
        let resp = client()
            .post(format!("{node_a}/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        resp.status().as_u16()
    });
    wait_for_requests(&c.engines[1], 2).await;
    let before = c.engines[0].requests();
    let drained = client()
        .post(format!("{}/admin/engines/0/drain", c.nodes[0].admin))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(drained.status(), 200);
    c.mesh.kill("b");
    let status = or_hang("the forward to dead b", pending).await.unwrap();
    assert_eq!(status, 503);
    assert_eq!(
        c.engines[0].requests(),
        before,
        "the drained engine got the request"
    );
    c.engines[1].release.notify_waiters();
}

/// The mesh as a node sees it, except that each forward's response head comes back
/// claiming a new region served it (as a buggy or hostile member's could, or any
/// node's on a multi-hop path).
struct ClaimingPeers {
    inner: std::sync::Arc<gorgo_node::mesh::MeshPeers>,
    next: std::sync::atomic::AtomicU64,
}

impl gorgo_node::PeerSource for ClaimingPeers {
    fn peers(&self) -> Vec<gorgo_node::PeerView> {
        self.inner.peers()
    }
    fn matched_tokens(
        &self,
        peer: &gorgo_core::NodeId,
        replica: u16,
        chain: &gorgo_core::HashChain,
    ) -> u64 {
        self.inner.matched_tokens(peer, replica, chain)
    }
    fn open_forward(
        &self,
        peer: &gorgo_core::NodeId,
    ) -> futures::future::BoxFuture<
        'static,
        Result<
            (
                gorgo_node::peers::ForwardSend,
                gorgo_node::peers::ForwardRecv,
            ),
            gorgo_node::NodeError,
        >,
    > {
        use gorgo_core::wire::ForwardResponseHead;
        let opened = self.inner.open_forward(peer);
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async move {
            let (send, mut recv) = opened.await?;
            let (mut to_node, relayed) = tokio::io::duplex(1 << 16);
            tokio::spawn(async move {
                let Ok(mut head) =
                    gorgo_node::forward::read_frame::<_, ForwardResponseHead>(&mut recv, 1 << 20)
                        .await
                else {
                    return;
                };
                head.served_by = gorgo_core::NodeId(format!("r{n}"));
                if gorgo_node::forward::write_frame(&mut to_node, &head)
                    .await
                    .is_ok()
                {
                    let _ = tokio::io::copy(&mut recv, &mut to_node).await;
                }
            });
            Ok((send, Box::pin(relayed) as gorgo_node::peers::ForwardRecv))
        })
    }
    fn peer_gone(&self, peer: &gorgo_core::NodeId) -> futures::future::BoxFuture<'static, ()> {
        self.inner.peer_gone(peer)
    }
    fn publish_stats(&self, stats: gorgo_core::QueueStats) {
        self.inner.publish_stats(stats)
    }
}

/// What a peer's head says served a forward goes to the client's header, but the
/// `served_by` label of `gorgo_requests_total` names only a region membership knows:
/// a peer claiming a new region per response used to make a new series for each.
#[tokio::test]
async fn the_served_by_label_names_only_regions_membership_knows() {
    let mesh = gorgo_node::mesh::Mesh::new();
    mesh.set_rtt("a", "b", 150.0);
    let (engine_a, engine_b) = (StubEngine::start("a").await, StubEngine::start("b").await);
    let b = start_node(config("b", &engine_b.url(), ""), Some(&mesh)).await;
    let peers = std::sync::Arc::new(ClaimingPeers {
        inner: mesh.peer_source("a"),
        next: std::sync::atomic::AtomicU64::new(0),
    });
    let a = start_node_seeing(config("a", &engine_a.url(), ""), &mesh, peers).await;
    // b holds the prompt and a is saturated: a forwards it to b.
    let p = b_prompt();
    assert_eq!(chat(&b, &p).await, (200, "b".into(), 0));
    engine_a
        .waiting
        .store(50, std::sync::atomic::Ordering::SeqCst);
    a.state().engine(0).unwrap().adapter.scrape().await;
    for i in 0..20 {
        assert_eq!(chat(&a, &p).await, (200, format!("r{i}"), 1));
    }
    let text = metrics_text(&a).await;
    let labels: std::collections::BTreeSet<&str> = text
        .lines()
        .filter(|l| l.starts_with("gorgo_requests_total{"))
        .filter_map(|l| l.split("served_by=\"").nth(1)?.split('"').next())
        .collect();
    assert_eq!(labels, ["b"].into(), "{text}");
}

/// The requests `node` counted with `outcome`, whatever their policy and server.
async fn requests_with_outcome(node: &TestNode, outcome: &str) -> f64 {
    let label = format!("outcome=\"{outcome}\"");
    metrics_text(node)
        .await
        .lines()
        .filter(|l| l.starts_with("gorgo_requests_total{") && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A peer's engine that answers a forward with a server error of its own (500, what
/// llama-cpp-python answers a body it cannot parse), where neither the peer nor the
/// origin has anywhere else to go, reaches the client as the engine gave it: status,
/// body and passed headers, streamed or not, counted `engine_error` as what the client
/// got. Before, the peer sent a plain 502 head and the client got the origin's 503
/// "forward to b failed and no local engine".
#[tokio::test]
async fn a_peers_engine_answer_reaches_a_client_with_nowhere_else_to_go() {
    let c = mesh_cluster(&["a", "b"], &[("a", "b", 150.0)], |_| String::new()).await;
    // a's own engine is out: b is its only candidate.
    c.nodes[0].state().engine(0).unwrap().start_draining();
    c.engines[1].set_mode(SERVER_ERROR);
    for stream in [false, true] {
        let resp = post_chat(&c.nodes[0], &prompt("a bad request", 4000), stream).await;
        assert_eq!(resp.status(), 500, "stream: {stream}");
        assert_eq!(resp.headers()["content-type"], "application/json");
        assert_eq!(resp.headers()["x-request-id"], "engine-request-7");
        assert!(
            !resp.headers().contains_key("x-gorgo-engine-answer"),
            "the forward's own header stays between the nodes"
        );
        assert_eq!(resp.text().await.unwrap(), SERVER_ERROR_BODY);
    }
    assert_eq!(c.engines[0].requests(), 0, "a's drained engine got nothing");
    assert_eq!(c.engines[1].requests(), 2);
    assert_eq!(
        requests_with_outcome(&c.nodes[0], "engine_error").await,
        2.0
    );
    assert_eq!(
        requests_with_outcome(&c.nodes[0], "engine_failed").await,
        0.0
    );
    assert_eq!(requests_with_outcome(&c.nodes[0], "unavailable").await, 0.0);
}

/// A peer's engine answer is still no answer where the origin has somewhere else to
/// go: a forward to b, whose engine answers 500, is served by c (a's own engine is
/// out), or by a's own engine when it is in.
#[tokio::test]
async fn a_peers_engine_answer_is_served_elsewhere_where_the_origin_can() {
    let c = cluster("").await;
    let p = c.prefix_at_b(SERVER_ERROR).await;
    assert_eq!(chat(&c.nodes[0], &p).await, (200, "a".into(), 0));
    c.nodes[0].state().engine(0).unwrap().start_draining();
    assert_eq!(chat(&c.nodes[0], &p).await, (200, "c".into(), 1));
    assert_eq!(c.engines[1].requests(), 3, "b's engine answered both");
    assert_eq!(
        requests_with_outcome(&c.nodes[0], "engine_error").await,
        0.0
    );
}

/// The head of a forward whose engine answered for it is the 502 it was, which a node
/// of the last build takes as before (it serves the request elsewhere and never reads
/// the body), with the engine's status in the forward's own header and its passed
/// headers; the engine's body follows it whole.
#[tokio::test]
async fn an_engine_answer_travels_behind_a_502_head() {
    use gorgo_node::api::{EngineAnswer, ServeError, ENGINE_ANSWER_HEADER};
    use tokio::io::AsyncReadExt;
    let c = mesh_cluster(&["a"], &[], |_| String::new()).await;
    let body = br#"{"prompt": "x"}"#.to_vec();
    let request = forward_request("b", gorgo_core::Endpoint::Completions, body);
    let mut ex = forward_exchange(
        c.nodes[0].state(),
        &forward_frame(&request).await,
        |_, _| {
            std::future::ready(Err(ServeError::EngineAnswered(EngineAnswer {
                status: 500,
                headers: vec![("x-request-id".into(), "engine-request-7".into())],
                body: SERVER_ERROR_BODY.into(),
            })))
        },
    )
    .await;
    assert_eq!(ex.head.status, 502);
    let header = |name: &str| {
        ex.head
            .headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(header(ENGINE_ANSWER_HEADER).as_deref(), Some("500"));
    assert_eq!(header("x-request-id").as_deref(), Some("engine-request-7"));
    let mut rest = Vec::new();
    ex.from_node.read_to_end(&mut rest).await.unwrap();
    let len = SERVER_ERROR_BODY.len();
    assert_eq!(rest[..4], (len as u32).to_be_bytes());
    assert_eq!(&rest[4..4 + len], SERVER_ERROR_BODY.as_bytes());
    assert_eq!(rest[4 + len..], 0u32.to_be_bytes(), "then the clean end");
    ex.served.await.unwrap();
}
