//! Two nodes over the real QUIC cluster (mutual TLS, foca, gossip) on loopback: the
//! summary and stats gossip reach the peer, and a saturated node forwards to the peer
//! holding the prefix over a QUIC bi-stream.
mod common;

use std::time::Duration;

use common::*;
use gorgo_core::NodeId;
use gorgo_node::NodeListeners;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

async fn quic_node(
    id: &str,
    engine: &StubEngine,
    ca: &gorgo_cluster::ClusterCa,
    seeds: &[std::net::SocketAddr],
) -> (
    gorgo_node::NodeHandle,
    CancellationToken,
    std::net::SocketAddr,
) {
    quic_node_of(id, &[engine.url()], ca, seeds).await
}

/// [`quic_node`] fronting the engines at `urls` (replicas in that order).
async fn quic_node_of(
    id: &str,
    urls: &[String],
    ca: &gorgo_cluster::ClusterCa,
    seeds: &[std::net::SocketAddr],
) -> (
    gorgo_node::NodeHandle,
    CancellationToken,
    std::net::SocketAddr,
) {
    // Bind the QUIC port first so the peer can use it as a seed.
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let quic = udp.local_addr().unwrap();
    drop(udp);
    let seeds: Vec<String> = seeds.iter().map(|s| format!("\"{s}\"")).collect();
    let mut cfg =
        config_with_engines(id, urls, &format!("seeds = [{}]\n", seeds.join(", "))).into_inner();
    cfg.listen.quic = quic;
    let shutdown = CancellationToken::new();
    let handle = start_quic(cfg, ca, &shutdown).await.unwrap();
    (handle, shutdown, quic)
}

/// The cluster's CA for a test (the TLS provider installed first).
fn test_ca() -> gorgo_cluster::ClusterCa {
    let _ = rustls::crypto::ring::default_provider().install_default();
    gorgo_cluster::ClusterCa::generate("test CA").unwrap()
}

/// Start node `cfg` on the QUIC cluster, its certificate from `ca`, HTTP and admin on
/// port 0.
async fn start_quic(
    cfg: gorgo_node::NodeConfig,
    ca: &gorgo_cluster::ClusterCa,
    shutdown: &CancellationToken,
) -> Result<gorgo_node::NodeHandle, gorgo_node::NodeError> {
    let creds = ca.issue(&NodeId(cfg.node.id.clone())).unwrap().credentials;
    let listeners = NodeListeners {
        http: TcpListener::bind("127.0.0.1:0").await.unwrap(),
        admin: TcpListener::bind("127.0.0.1:0").await.unwrap(),
    };
    let cfg = cfg.validate().unwrap();
    gorgo_node::cluster::start_with_credentials(cfg, creds, listeners, shutdown.clone()).await
}

#[tokio::test]
async fn saturated_node_forwards_over_quic() {
    let ca = test_ca();
    let (ea, eb) = (StubEngine::start("a").await, StubEngine::start("b").await);
    let (a, a_stop, a_quic) = quic_node("a", &ea, &ca, &[]).await;
    let (b, b_stop, _) = quic_node("b", &eb, &ca, &[a_quic]).await;
    let p = prompt("a long shared context", 40_000);

    // b serves the prompt: its shadow index, then its gossiped summary, hold it.
    let resp = client()
        .post(format!("http://{}/v1/chat/completions", b.http_addr))
        .json(&chat_body(&p, false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-gorgo-served-by"], "b");

    // Wait (bounded) until a sees b alive with an RTT, stats, and the prefix.
    let chain = a.state.hasher.chain(
        &gorgo_core::prompt::canonicalize(gorgo_core::Endpoint::Chat, &chat_body(&p, false))
            .unwrap(),
    );
    let peers = a.state.peers.clone();
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let ready = peers.peers().iter().any(|v| {
                v.id == NodeId::from("b") && v.alive && v.rtt_ms.is_finite() && v.stats.is_some()
            }) && peers.matched_tokens(&NodeId::from("b"), 0, &chain) > 0;
            if ready {
                break;
            }
            // Gossip runs on its own clock; poll its result, never assume its timing.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("gossip reached a");

    ea.waiting.store(50, std::sync::atomic::Ordering::SeqCst);
    a.state.engine(0).unwrap().adapter.scrape().await;
    let resp = client()
        .post(format!("http://{}/v1/chat/completions", a.http_addr))
        .json(&chat_body(&p, true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-gorgo-served-by"], "b");
    assert_eq!(resp.headers()["x-gorgo-hops"], "1");
    let text = resp.text().await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert_eq!(ea.requests(), 0);
    // The forwarded stream's first chunk taught a's ledger how b's first byte compared
    // with the cost model's prediction (docs/policy.md, "forward bias").
    let bias =
        a.state
            .router
            .ledger
            .lock()
            .forward_bias_ms(&NodeId::from("b"), 0, a.state.now_ms());
    assert!(bias != 0.0 && bias.is_finite(), "bias {bias}");

    // `/metrics` splits the cluster's traffic by kind: b's summary reached a, so b
    // sent summary gossip (its first message to a new peer a snapshot) and SWIM.
    let text = metrics_at(&format!("http://{}", b.admin_addr)).await;
    for series in [
        r#"gorgo_cluster_bytes_total{traffic="swim",direction="sent"}"#,
        r#"gorgo_cluster_bytes_total{traffic="summary",direction="sent"}"#,
        r#"gorgo_cluster_bytes_total{traffic="summary",direction="received"}"#,
        r#"gorgo_gossip_messages_sent_total{kind="snapshot"}"#,
    ] {
        let v = metric_value(&text, series);
        assert!(v.is_some_and(|v| v > 0.0), "{series}: {v:?} in {text}");
    }
    let total: f64 = ["swim", "summary", "app"]
        .iter()
        .map(|t| {
            metric_value(
                &text,
                &format!(r#"gorgo_cluster_bytes_total{{traffic="{t}",direction="sent"}}"#),
            )
            .unwrap()
        })
        .sum();
    // The split adds up to the total (read in the same refresh).
    assert_eq!(
        metric_value(&text, "gorgo_gossip_sent_bytes_total"),
        Some(total)
    );
    for series in [
        r#"gorgo_gossip_messages_sent_total{kind="delta"}"#,
        r#"gorgo_gossip_messages_sent_total{kind="snapshot_request"}"#,
        "gorgo_cluster_spurious_turn_undead_dropped_total",
    ] {
        assert!(metric_value(&text, series).is_some(), "{series} in {text}");
    }
    a_stop.cancel();
    b_stop.cancel();
}

/// An engine removed from b at run time takes its summary with it: a, which held b's
/// summary of it (fingerprints counted against a's cap on what b's summaries hold),
/// hears it emptied. Before, b gossiped the engine's last summary every round for the
/// rest of its run, and a held it.
#[tokio::test]
async fn a_removed_engines_summary_is_emptied_at_its_peers() {
    let ca = test_ca();
    let ea = StubEngine::start("a").await;
    let eb = [StubEngine::start("b0").await, StubEngine::start("b1").await];
    let (a, a_stop, a_quic) = quic_node("a", &ea, &ca, &[]).await;
    let urls: Vec<String> = eb.iter().map(|e| e.url()).collect();
    let (b, b_stop, _) = quic_node_of("b", &urls, &ca, &[a_quic]).await;

    // b's engine 1 serves the prompt (engine 0 drained meanwhile).
    let p = prompt("the removed engine's context", 40_000);
    b.state.engine(0).unwrap().start_draining();
    let resp = client()
        .post(format!("http://{}/v1/chat/completions", b.http_addr))
        .json(&chat_body(&p, false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(eb[1].requests(), 1);
    assert!(b.state.engine(0).unwrap().start_serving());

    let chain = a.state.hasher.chain(
        &gorgo_core::prompt::canonicalize(gorgo_core::Endpoint::Chat, &chat_body(&p, false))
            .unwrap(),
    );
    let held = {
        let (peers, chain) = (a.state.peers.clone(), chain.clone());
        move || peers.matched_tokens(&NodeId::from("b"), 1, &chain)
    };
    let wait = |what: &'static str, done: Box<dyn Fn() -> bool>| async move {
        tokio::time::timeout(Duration::from_secs(30), async {
            while !done() {
                // Gossip runs on its own clock; poll its result.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect(what)
    };
    wait(
        "a holds b's summary of engine 1",
        Box::new(move || held() > 0),
    )
    .await;

    assert!(b.state.remove_engine(1).unwrap());
    let state = b.state.clone();
    wait(
        "engine 1 leaves b",
        Box::new(move || state.engine(1).is_none()),
    )
    .await;
    let peers = a.state.peers.clone();
    wait(
        "a's copy of engine 1's summary is emptied",
        Box::new(move || peers.matched_tokens(&NodeId::from("b"), 1, &chain) == 0),
    )
    .await;
    a_stop.cancel();
    b_stop.cancel();
}

/// An engine removed from a at run time leaves b's view of a once it has drained:
/// b's `/admin/state` lists a's remaining engine only, and the model only that
/// engine served is gone from b's `/v1/models`; added back (the same URL, the next
/// replica number) it is listed at b again. Before, a gossiped the removed engine's
/// last (draining) stats and empty summary every round for the rest of its run, and
/// b listed a phantom replica of a.
#[tokio::test]
async fn a_removed_engine_leaves_its_peers_views_and_comes_back_when_added_again() {
    let ca = test_ca();
    let ea = [StubEngine::start("a0").await, StubEngine::start("a1").await];
    ea[1].set_models(&["only-at-a1"]);
    let eb = StubEngine::start("b").await;
    let urls: Vec<String> = ea.iter().map(|e| e.url()).collect();
    let (a, a_stop, a_quic) = quic_node_of("a", &urls, &ca, &[]).await;
    let (b, b_stop, _) = quic_node("b", &eb, &ca, &[a_quic]).await;
    // a's engines as b's router sees them (what `/admin/state` shows), and whether
    // b's `/v1/models` counts a's second engine's model.
    let view = {
        let peers = b.state.peers.clone();
        move || {
            let of_a = peers.peers().into_iter().find(|p| p.id.0 == "a");
            of_a.map_or((vec![], false), |p| {
                let replicas: Vec<u16> = p.engines.iter().map(|e| e.stats.replica).collect();
                (replicas, p.models().contains("only-at-a1"))
            })
        }
    };
    let admin_state = || async {
        let state: serde_json::Value = client()
            .get(format!("http://{}/admin/state", b.admin_addr))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let of_a = state["peers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["id"] == "a")
            .cloned()
            .unwrap();
        let replicas: Vec<u64> = of_a["engines"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["replica"].as_u64().unwrap())
            .collect();
        replicas
    };
    let models = || async {
        let list: serde_json::Value = client()
            .get(format!("http://{}/v1/models", b.http_addr))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        list["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["id"] == "only-at-a1")
            .map(|m| m["nodes"].clone())
    };
    until("b lists a's two engines", || view() == (vec![0, 1], true)).await;
    assert_eq!(admin_state().await, [0, 1]);
    assert_eq!(models().await, Some(serde_json::json!(["a"])));

    assert!(a.state.remove_engine(1).unwrap());
    let state = a.state.clone();
    until("engine 1 drains and leaves a", || state.engine(1).is_none()).await;
    until("b lists a's remaining engine only", || {
        view() == (vec![0], false)
    })
    .await;
    assert_eq!(admin_state().await, [0]);
    assert_eq!(models().await, None);

    // The same engine added back: the next replica number, heard at b as any.
    let added: serde_json::Value = client()
        .post(format!("http://{}/admin/engines", a.admin_addr))
        .bearer_auth(TOKEN)
        .json(&serde_json::json!({"url": urls[1], "kind": "sglang"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(added["replica"], 2, "{added}");
    until("b lists the engine added back", || {
        view() == (vec![0, 2], true)
    })
    .await;
    assert_eq!(admin_state().await, [0, 2]);
    assert_eq!(models().await, Some(serde_json::json!(["a"])));
    a_stop.cancel();
    b_stop.cancel();
}

/// A QUIC port in use is refused naming `listen.quic`, as the HTTP and admin ports
/// name theirs (it was "cluster: io: Address already in use").
#[tokio::test]
async fn a_quic_port_in_use_names_its_field() {
    let ca = test_ca();
    let engine = StubEngine::start("a").await;
    let taken = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut cfg = config("a", &engine.url(), "").into_inner();
    cfg.listen.quic = taken.local_addr().unwrap();
    let e = start_quic(cfg, &ca, &CancellationToken::new())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("`listen.quic`"), "{e}");
}

/// `/readyz` of the admin API at `admin`: status and body.
async fn readyz(admin: std::net::SocketAddr) -> (u16, String) {
    let resp = client()
        .get(format!("http://{admin}/readyz"))
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

/// `/admin/state`'s `identity_refused` at `admin`.
async fn identity_refused(admin: std::net::SocketAddr) -> serde_json::Value {
    let state: serde_json::Value = client()
        .get(format!("http://{admin}/admin/state"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    state["identity_refused"].clone()
}

/// A second node started with b's id and a certificate for it (a copied config, on
/// another port) while b is alive says so itself: its `/admin/state` lists a's
/// refusal with b's address, `/metrics` counts it, and `/readyz` answers 503 naming
/// the id and that address, though its engine is healthy. b stays ready, refused by
/// nobody. Before, the second node answered `/readyz` 200 and showed nothing.
#[tokio::test]
async fn a_second_node_with_a_live_nodes_id_says_so_and_is_not_ready() {
    let ca = test_ca();
    let (ea, eb, edup) = (
        StubEngine::start("a").await,
        StubEngine::start("b").await,
        StubEngine::start("b").await,
    );
    let (a, a_stop, a_quic) = quic_node("a", &ea, &ca, &[]).await;
    let (b, b_stop, b_quic) = quic_node("b", &eb, &ca, &[a_quic]).await;
    let b_seen = a.state.peers.clone();
    until("a holds b alive", || {
        b_seen
            .peers()
            .iter()
            .any(|p| p.id == NodeId::from("b") && p.alive)
    })
    .await;
    let (dup, dup_stop, _) = quic_node("b", &edup, &ca, &[a_quic]).await;

    // Its engine passes its first health check and a's refusal comes back on their
    // own clocks: wait for both, never assume when.
    let dup_engine = dup.state.engine(0).unwrap().adapter.clone();
    let dup_peers = dup.state.peers.clone();
    until(
        "the duplicate's engine is healthy and a's refusal is in",
        || dup_engine.is_ready() && !gorgo_node::peers::refused_island(&*dup_peers).is_empty(),
    )
    .await;
    let (status, body) = readyz(dup.admin_addr).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("node id b") && body.contains(&b_quic.to_string()),
        "{body}"
    );
    let refused = identity_refused(dup.admin_addr).await;
    assert_eq!(refused[0]["by"], "a", "{refused}");
    assert_eq!(refused[0]["held_at"], b_quic.to_string(), "{refused}");
    assert!(refused[0]["first_age_ms"].is_u64(), "{refused}");
    let text = metrics_at(&format!("http://{}", dup.admin_addr)).await;
    let told = metric_value(&text, "gorgo_cluster_own_id_refused_total");
    assert!(told.is_some_and(|v| v >= 1.0), "{told:?} in {text}");

    // The genuine b: ready (its engine checked), refused by nobody.
    until("b's engine is healthy", || b.state.is_ready()).await;
    assert_eq!(readyz(b.admin_addr).await.0, 200);
    assert_eq!(identity_refused(b.admin_addr).await, serde_json::json!([]));
    let text = metrics_at(&format!("http://{}", b.admin_addr)).await;
    assert_eq!(
        metric_value(&text, "gorgo_cluster_own_id_refused_total"),
        Some(0.0)
    );
    for stop in [dup_stop, b_stop, a_stop] {
        stop.cancel();
    }
}
