//! Online tuning over the real QUIC cluster: proposals and reports travel on the
//! cluster's application channel (mutual TLS). Node `a` advertises an address nothing
//! listens on; `b` reaches it only through `[cluster.dial_overrides]`, so the test also
//! shows the node wires that table into the cluster.
mod common;

use std::time::Duration;

use common::*;
use gorgo_core::NodeId;
use gorgo_node::NodeListeners;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

fn free_udp() -> std::net::SocketAddr {
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    udp.local_addr().unwrap()
}

async fn quic_node(
    id: &str,
    engine: &StubEngine,
    ca: &gorgo_cluster::ClusterCa,
    advertise: Option<std::net::SocketAddr>,
    cluster: &str,
) -> (gorgo_node::NodeHandle, CancellationToken) {
    // Windows of 4 requests are far too noisy to decide a trial on, so a line would
    // settle after measuring the noise; this test is about the messages, so it never
    // does (as in `tuning_mesh`).
    let tuning = "[tuning]\nmode = \"online\"\nwindow_requests = 4\nmax_trial_windows = 1\n\
                  min_samples = 2\nstartup_grace_ms = 0\nsettle_margin = 1.0\n";
    node_with_tuning(id, engine, ca, advertise, cluster, tuning).await
}

async fn node_with_tuning(
    id: &str,
    engine: &StubEngine,
    ca: &gorgo_cluster::ClusterCa,
    advertise: Option<std::net::SocketAddr>,
    cluster: &str,
    tuning: &str,
) -> (gorgo_node::NodeHandle, CancellationToken) {
    let mut cfg = config(id, &engine.url(), &format!("{cluster}\n{tuning}")).into_inner();
    cfg.listen.quic = free_udp();
    cfg.listen.advertise_quic = advertise;
    let cfg = cfg.validate().unwrap();
    let creds = ca.issue(&NodeId::from(id)).unwrap().credentials;
    let listeners = NodeListeners {
        http: TcpListener::bind("127.0.0.1:0").await.unwrap(),
        admin: TcpListener::bind("127.0.0.1:0").await.unwrap(),
    };
    let shutdown = CancellationToken::new();
    let handle =
        gorgo_node::cluster::start_with_credentials(cfg, creds, listeners, shutdown.clone())
            .await
            .unwrap();
    (handle, shutdown)
}

#[tokio::test]
async fn proposals_and_reports_travel_over_quic_through_a_dial_override() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca = gorgo_cluster::ClusterCa::generate("test CA").unwrap();
    let (ea, eb) = (StubEngine::start("a").await, StubEngine::start("b").await);
    // `a` advertises an address nothing listens on, as behind a relay.
    let a_advertised = free_udp();
    let gossip = "[cluster]\ngossip_interval_ms = 50\n";
    let (a, a_stop) = quic_node("a", &ea, &ca, Some(a_advertised), gossip).await;
    let b_cluster = format!(
        "[cluster]\nseeds = [\"{a_advertised}\"]\ngossip_interval_ms = 50\n\
         [cluster.dial_overrides]\n\"{a_advertised}\" = \"{}\"\n",
        a.state.config.listen.quic
    );
    let (b, b_stop) = quic_node("b", &eb, &ca, None, &b_cluster).await;

    // Clients talk to b only: a (the leader, smallest id) can fill its windows only
    // from b's reports, and b routes with a's proposals.
    let mut b_epoch = b.state.tuning.subscribe();
    let base = format!("http://{}", b.http_addr);
    let drive = async {
        for i in 0usize.. {
            let v = b.state.tuning.view();
            // The first windows measure the noise and decide nothing (how many depends
            // on how 4 requests fall into the arms' halves): go on until a decided.
            if v.epoch >= 5
                && v.leader == Some("a".into())
                && !a.state.tuning.view().history.is_empty()
            {
                return;
            }
            let resp = client()
                .post(format!("{base}/v1/chat/completions"))
                // Streamed: only an event stream's first byte is a TTFT to tune on.
                .json(&chat_body(&prompt(&format!("p{i}"), 300), true))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            resp.bytes().await.unwrap();
            if i % 4 == 3 {
                // Give the report a round to reach a: wait for b's epoch to move
                // (bounded, not a fixed sleep).
                let _ = tokio::time::timeout(Duration::from_millis(500), b_epoch.changed()).await;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(60), drive)
        .await
        .expect("b never followed a's epochs");
    let view = a.state.tuning.view();
    assert!(view.is_leader);
    assert!(!view.history.is_empty(), "a decided nothing");
    // Every sample a decided on came from b.
    assert!(view
        .history
        .iter()
        .all(|e| e.record.samples + e.record.incumbent_samples >= 2));
    a_stop.cancel();
    b_stop.cancel();
}

/// A tuning message addressed to an id no member holds (a stale proposal names its
/// leader, which the message body sets) starts no sender task: before, each made-up id
/// got a task that waited for the cluster to close.
#[tokio::test]
async fn tuning_messages_to_ids_no_member_holds_start_no_tasks() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let engine = StubEngine::start("a").await;
    let ca = gorgo_cluster::ClusterCa::generate("test CA").unwrap();
    // Static: the node leads no line, so nothing it broadcasts prunes the senders
    // (a follower's case).
    let (node, shutdown) = node_with_tuning("a", &engine, &ca, None, "", "").await;
    let cfg = gorgo_core::es::TuningConfig::gorgo();
    let proposal = |leader: String| {
        gorgo_core::tuning::TuningMessage::Proposal(gorgo_core::tuning::Proposal {
            epoch: 3,
            leader: leader.as_str().into(),
            incarnation: 0,
            weights: cfg.start_weights(),
            candidate: None,
            phase: gorgo_core::tuning::Phase::MeasureCandidate,
            state: gorgo_core::es::EsState::new(&cfg),
            switchback_block_ms: None,
        })
    };
    let tasks = tokio::runtime::Handle::current().metrics();
    let before = tasks.num_alive_tasks();
    for i in 0..300 {
        let to = NodeId::from(format!("ghost-{i}").as_str());
        node.state
            .peers
            .send_tuning(&to, &proposal(format!("ghost-{i}")));
    }
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    let after = tasks.num_alive_tasks();
    assert!(after < before + 100, "{before} tasks before, {after} after");
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), node.wait()).await;
}
