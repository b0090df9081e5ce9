//! Online tuning through the real node driver: three in-process nodes on the mesh,
//! `online` mode with a small window. Proposals propagate, epochs advance, every node
//! routes with the leader's weights; a killed leader is replaced by the next-smallest
//! id, which continues the line; the admin API shows the trajectory and switches modes.
//!
//! Time: the nodes tick on the real clock (gossip interval 20 ms); tests wait on the
//! driver's epoch watch, never on a fixed sleep.
mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use gorgo_core::tuning::Phase;
use gorgo_core::{NodeId, Weights};
use serde_json::Value;

const IDS: [&str; 3] = ["a", "b", "c"];

const TUNING: &str = r#"
[cluster]
gossip_interval_ms = 20
[tuning]
mode = "online"
window_requests = 6
max_trial_windows = 1
min_samples = 2
window_max_ms = 600000
startup_grace_ms = 0
# The mesh calls a killed node dead at once (SWIM takes 3.2 s): a lease scaled to the
# 20 ms ticks, so that b takes the line over within the requests `drive_until` sends.
leader_lease_ms = 100
# Windows of 6 requests are far too noisy to decide a trial on, so a line would settle
# (no candidate); these tests are about the trials' protocol, so it never does
# (settling is gorgo-core's `a_line_that_cannot_decide_settles_...`).
settle_margin = 1.0
"#;

type Cluster = MeshCluster;

const RTTS: [(&str, &str, f64); 3] = [("a", "b", 90.0), ("a", "c", 180.0), ("b", "c", 250.0)];

async fn cluster() -> Cluster {
    mesh_cluster(&IDS, &RTTS, |_| TUNING.to_owned()).await
}

async fn chat_ok(node: &TestNode, i: usize) {
    let resp = client()
        .post(format!("{}/v1/chat/completions", node.base))
        .json(&chat_body(
            &prompt(&format!("q{i}"), 600),
            i.is_multiple_of(2),
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.bytes().await.unwrap();
}

/// Send requests round-robin to `nodes` until node `watch` follows epoch >= `epoch`.
async fn drive_until(c: &Cluster, nodes: &[usize], watch: usize, epoch: u64) {
    let state = c.nodes[watch].state();
    for i in 0..2000 {
        if state.tuning.epoch() >= epoch {
            return;
        }
        chat_ok(&c.nodes[nodes[i % nodes.len()]], i).await;
    }
    panic!(
        "epoch {} after 2000 requests, wanted {epoch}",
        state.tuning.epoch()
    );
}

/// Send requests round-robin to `nodes` until node `watch` has decided `trials`
/// trials (its history): how many windows the noise and the start fit take before the
/// first trial depends on how the requests fell into them.
async fn drive_until_trials(c: &Cluster, nodes: &[usize], watch: usize, trials: usize) {
    let state = c.nodes[watch].state();
    for i in 0..2000 {
        if state.tuning.view().history.len() >= trials {
            return;
        }
        chat_ok(&c.nodes[nodes[i % nodes.len()]], i).await;
    }
    panic!(
        "{} trials after 2000 requests, wanted {trials}",
        state.tuning.view().history.len()
    );
}

/// (epoch, leader, weights) of every listed node.
fn views(c: &Cluster, nodes: &[usize]) -> Vec<(u64, Option<NodeId>, Weights)> {
    nodes
        .iter()
        .map(|&i| {
            let v = c.nodes[i].state().tuning.view();
            (v.epoch, v.leader, v.weights)
        })
        .collect()
}

/// Traffic stopped: wait (on epoch changes, not on a clock) until the listed nodes
/// agree, as they must within a gossip round of the last proposal.
async fn assert_agree(c: &Cluster, nodes: &[usize]) -> (u64, Option<NodeId>, Weights) {
    let mut rx = c.nodes[nodes[0]].state().tuning.subscribe();
    for _ in 0..10 {
        let v = views(c, nodes);
        if v.windows(2).all(|w| w[0] == w[1]) {
            return v[0].clone();
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), rx.changed()).await;
    }
    panic!("nodes disagree: {:?}", views(c, nodes));
}

#[tokio::test]
async fn three_nodes_follow_one_leader_and_epochs_advance() {
    let c = cluster().await;
    drive_until(&c, &[0, 1, 2], 0, 9).await;
    drive_until_trials(&c, &[0, 1, 2], 0, 4).await;
    let (epoch, leader, weights) = assert_agree(&c, &[0, 1, 2]).await;
    assert!(epoch >= 9);
    assert_eq!(leader, Some(NodeId::from("a")));
    // Every node routes with the weights of the epoch it follows.
    for n in &c.nodes {
        assert_eq!(*n.state().weights.read(), weights);
        // A key with the low bit clear is routed on the incumbent's arm, the weights
        // the node reports; one with it set on the candidate's of an interleaved trial
        // (the incumbent's again in a settled line's window, which has no candidate).
        assert_eq!(n.state().tuning.admit(0).weights, weights);
        let v = n.state().tuning.view();
        if v.phase == Some(Phase::Interleaved) {
            let want = v.candidate.unwrap_or(weights);
            assert_eq!(n.state().tuning.admit(1).weights, want);
        }
    }
    let a = c.nodes[0].state().tuning.view();
    assert!(a.is_leader);
    assert!(a.history.len() >= 4, "{} trials", a.history.len());
    let epochs: BTreeSet<u64> = a.history.iter().map(|e| e.record.epoch).collect();
    assert_eq!(epochs.len(), a.history.len(), "an epoch decided twice");
    let bounds = c.nodes[0].state().tuning.config();
    for e in &a.history {
        assert_eq!(e.record.leader, NodeId::from("a"));
        assert!(e.record.samples + e.record.incumbent_samples >= 6);
        let w = e.record.candidate;
        assert!(w.w_rtt >= bounds.w_rtt.min && w.w_rtt <= bounds.w_rtt.max);
        assert!(w.w_queue >= bounds.w_queue.min && w.w_queue <= bounds.w_queue.max);
    }
    // Every ingress gave the start fit its requests' decision terms.
    for n in &c.nodes {
        assert!(n.state().tuning.view().fit_samples > 0, "{}", n.state().id);
    }
    // Followers decide nothing.
    for n in &c.nodes[1..] {
        assert!(n.state().tuning.view().history.is_empty());
        assert!(!n.state().tuning.is_leader());
    }

    // The admin API: trajectory in both formats, state and metrics.
    let body = admin_json(&c.nodes[0], "/admin/tuning").await;
    assert_eq!(body["mode"], "online");
    assert_eq!(body["leader"], "a");
    let history = body["history"].as_array().unwrap();
    assert!(history.len() >= 4);
    for k in gorgo_core::tuning::TUNING_JSONL_KEYS {
        assert!(history[0].get(k).is_some(), "{k} missing: {}", history[0]);
    }
    let paper = &body["es_trace"][0];
    for k in [
        "kind",
        "step",
        "score",
        "best_score",
        "best_params",
        "candidate",
        "sigma",
        "accepted",
        "rechenberg",
    ] {
        assert!(paper.get(k).is_some(), "{k} missing: {paper}");
    }
    let metrics = metrics_text(&c.nodes[1]).await;
    assert!(metrics.contains("gorgo_tuning_epoch"), "{metrics}");
}

/// A non-streamed response's first byte comes at the end of generation: it must not
/// reach the tuner as a TTFT (it would score trials by output length), nor the start
/// fit; a streamed one must.
#[tokio::test]
async fn only_streamed_responses_are_measured_for_tuning() {
    let c = cluster().await;
    let a = &c.nodes[0];
    let mut rx = a.state().tuning.subscribe();
    while a.state().tuning.epoch() == 0 {
        tokio::time::timeout(Duration::from_secs(10), rx.changed())
            .await
            .expect("a first epoch")
            .unwrap();
    }
    let send = |i: usize, stream: bool| {
        let base = a.base.clone();
        async move {
            let resp = client()
                .post(format!("{base}/v1/chat/completions"))
                .json(&chat_body(&prompt(&format!("s{i}"), 600), stream))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            resp.bytes().await.unwrap();
        }
    };
    let before = a.state().tuning.view().fit_samples;
    for i in 0..8 {
        send(i, false).await;
    }
    assert_eq!(a.state().tuning.view().fit_samples, before);
    for i in 8..10 {
        send(i, true).await;
    }
    assert!(a.state().tuning.view().fit_samples > before);
}

#[tokio::test]
async fn killed_leader_is_replaced_by_the_next_smallest_id() {
    let c = cluster().await;
    drive_until(&c, &[0, 1, 2], 0, 5).await;
    // Part of an epoch, then the leader dies before it closes.
    chat_ok(&c.nodes[1], 1).await;
    chat_ok(&c.nodes[2], 2).await;
    let last = c.nodes[0].state().tuning.view();
    let a_decided: BTreeSet<u64> = last.history.iter().map(|e| e.record.epoch).collect();
    c.mesh.kill("a");
    // b takes over once a's lease has run out, from a's last proposal.
    drive_until(&c, &[1, 2], 1, last.epoch + 5).await;
    let (_, leader, _) = assert_agree(&c, &[1, 2]).await;
    assert_eq!(leader, Some(NodeId::from("b")));
    let b = c.nodes[1].state().tuning.view();
    assert!(b.is_leader);
    assert!(!b.history.is_empty());
    assert!(b.trials.unwrap() >= last.trials.unwrap());
    for e in &b.history {
        assert_eq!(e.record.leader, NodeId::from("b"));
        assert!(
            e.record.epoch > last.epoch,
            "epoch {} reused",
            e.record.epoch
        );
        assert!(!a_decided.contains(&e.record.epoch));
        // The line continues: b's steps count on from a's.
        assert!(e.step > last.trials.unwrap());
    }
}

#[tokio::test]
async fn put_weights_switches_modes() {
    let c = cluster().await;
    drive_until(&c, &[0, 1, 2], 2, 2).await;
    let put = |node: &TestNode, body: Value| {
        let url = format!("{}/admin/weights", node.admin);
        async move {
            client()
                .put(url)
                .bearer_auth(TOKEN)
                .json(&body)
                .send()
                .await
                .unwrap()
        }
    };
    let c_node = &c.nodes[2];
    let r = put(c_node, serde_json::json!({"w_rtt": 0.3, "w_queue": 0.2})).await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["mode"], "static");
    let fixed = Weights {
        w_rtt: 0.3,
        w_queue: 0.2,
    };
    assert_eq!(c_node.state().tuning.admit(0).weights, fixed);
    // Static: proposals no longer move this node.
    let before = c.nodes[0].state().tuning.epoch();
    drive_until(&c, &[0, 1], 0, before + 2).await;
    assert_eq!(c_node.state().tuning.weights(), fixed);
    // Weights with a tuning mode make no sense; a lone weight neither.
    let r = put(
        c_node,
        serde_json::json!({"w_rtt": 0.3, "w_queue": 0.2, "mode": "online"}),
    )
    .await;
    assert_eq!(r.status(), 400);
    let r = put(c_node, serde_json::json!({"w_rtt": 0.3})).await;
    assert_eq!(r.status(), 400);
    let r = put(c_node, serde_json::json!({"mode": "sometimes"})).await;
    assert_eq!(r.status(), 400);
    // Back online: it rejoins the running line at the leader's next announcement.
    let r = put(c_node, serde_json::json!({"mode": "online"})).await;
    assert_eq!(r.status(), 200);
    let target = c.nodes[0].state().tuning.epoch() + 1;
    drive_until(&c, &[0, 1], 2, target).await;
    let (_, leader, _) = assert_agree(&c, &[0, 1, 2]).await;
    assert_eq!(leader, Some(NodeId::from("a")));
    assert_ne!(c_node.state().tuning.view().phase, Some(Phase::Frozen));
}

#[tokio::test]
async fn learned_weights_file_sets_static_weights_and_the_tuning_start() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("learned.json");
    std::fs::write(
        &file,
        r#"{"rtt_weight": 0.276, "prefill_weight": 1.0, "load_weight": 1.0, "queue_weight": 0.5}"#,
    )
    .unwrap();
    let learned = Weights {
        w_rtt: 0.276,
        w_queue: 0.5,
    };
    let state = |extra: String| {
        let cfg = config("a", "http://127.0.0.1:9", &extra);
        gorgo_node::NodeState::new(cfg, Arc::new(gorgo_node::NoPeers)).unwrap()
    };
    let path = file.display();
    // Static: the file's weights, instead of routing.weights.
    let s = state(format!("[tuning]\nweights_file = \"{path}\"\n"));
    assert_eq!(s.tuning.admit(0).weights, learned);
    assert_eq!(*s.weights.read(), learned);
    // Online: tuning starts there (clipped into the policy's bounds).
    let s = state(format!(
        "[routing]\npolicy = \"gorgo-paper\"\n[tuning]\nmode = \"online\"\nweights_file = \"{path}\"\n"
    ));
    assert_eq!(s.tuning.config().start_weights(), learned);
    assert_eq!(s.tuning.admit(0).weights, learned);
    // A missing file is a config error naming the key.
    let cfg = config(
        "a",
        "http://127.0.0.1:9",
        "[tuning]\nweights_file = \"/nonexistent/w.json\"\n",
    );
    let e = gorgo_node::NodeState::new(cfg, Arc::new(gorgo_node::NoPeers)).unwrap_err();
    assert!(e.to_string().contains("tuning.weights_file"), "{e}");
}

#[tokio::test]
async fn tune_then_freeze_stops_and_writes_the_learned_weights() {
    let dir = tempfile::tempdir().unwrap();
    let c = mesh_cluster(&IDS, &[], |id| {
        // sigma0 below freeze_sigma: the first decided trial freezes the line.
        TUNING.replace("mode = \"online\"", "mode = \"tune-then-freeze\"")
            + &format!(
                "sigma0 = 0.04\nlearned_weights_out = \"{}\"\n",
                dir.path().join(format!("{id}.json")).display()
            )
    })
    .await;
    // Interleaved: the first windows measure the noise (a 6-request window can leave
    // a half without samples, so how many it takes varies), and the first trial
    // decided once the start fit is done (it may move the start, a record of its own,
    // or give up after its windows) freezes the line.
    let mut epoch = 1;
    while c.nodes[2].state().tuning.view().phase != Some(Phase::Frozen) {
        epoch += 1;
        assert!(epoch < 30, "not frozen by epoch {epoch}");
        drive_until(&c, &[0, 1, 2], 2, epoch).await;
    }
    let (epoch, _, weights) = assert_agree(&c, &[0, 1, 2]).await;
    let decided = c.nodes[0].state().tuning.view().history.len();
    assert!(decided >= 1, "frozen with nothing decided");
    for n in &c.nodes {
        let v = n.state().tuning.view();
        assert_eq!(v.phase, Some(Phase::Frozen));
        // The file is written off the driver's lock, after the phase shows frozen.
        let mut written = n.state().tuning.learned_weights_written();
        tokio::time::timeout(Duration::from_secs(10), written.wait_for(Option::is_some))
            .await
            .expect("the learned weights written")
            .unwrap();
        let file = dir.path().join(format!("{}.json", n.state().id));
        let learned = gorgo_node::tuning::read_learned_weights(&file).unwrap();
        assert_eq!(learned, weights);
    }
    // Frozen: more traffic decides nothing and moves no epoch.
    for i in 0..20 {
        chat_ok(&c.nodes[i % 3], i).await;
    }
    assert_eq!(c.nodes[0].state().tuning.epoch(), epoch);
    assert_eq!(c.nodes[0].state().tuning.view().history.len(), decided);
}
