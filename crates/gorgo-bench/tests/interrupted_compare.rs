//! An interrupted comparison keeps the policies that finished and says what it cut
//! short. The interrupt comes at a point the stand-in `gorgo` signals through a FIFO
//! (a cluster coming up, a cluster going down), never after a guessed delay.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::stub::{calls, fake_gorgo, make_fifos, requests};
use common::Server;
use gorgo_bench::{compare, CancellationToken, CompareSpec, LoadMode, ReplayConfig};

fn spec(exe: &Path, out: &Path, policies: &[&str], sequential: bool) -> CompareSpec {
    CompareSpec {
        exe: exe.to_path_buf(),
        topology: out.join("topo.toml"),
        policies: policies.iter().map(|p| (*p).to_owned()).collect(),
        out: out.to_path_buf(),
        sequential,
        engine_profile: None,
        up_args: Vec::new(),
        base_port: 8000,
        port_stride: 100,
        cluster_ports: 7,
        up_timeout: Duration::from_secs(600),
        replay: ReplayConfig {
            mode: LoadMode::Open { time_scale: 0.0 },
            ..ReplayConfig::default()
        },
        model: "m".into(),
        ignore_eos: true,
        progress: None,
    }
}

/// Cancel `cancel` once the stub writes to `signal` (a FIFO: the read waits for it),
/// then write `ack` when given. A thread of its own, not the runtime's blocking pool,
/// so a test that fails before the signal ends instead of waiting on it.
fn cancel_on(signal: &Path, ack: Option<&Path>, cancel: &CancellationToken) {
    let (signal, ack, cancel) = (signal.to_owned(), ack.map(Path::to_owned), cancel.clone());
    std::thread::spawn(move || {
        std::fs::read(&signal).unwrap();
        cancel.cancel();
        if let Some(ack) = ack {
            std::fs::write(ack, "go\n").unwrap();
        }
    });
}

// One test function: every step spawns the script, and running them serially avoids
// the fork-while-writing race (ETXTBSY) between test threads.
#[tokio::test]
async fn an_interrupted_compare_keeps_the_policies_that_finished() {
    let server = Server::start().await;
    let tmp = tempfile::tempdir().unwrap();
    make_fifos(tmp.path());
    let exe = fake_gorgo(tmp.path(), &server.url);

    // Sequential, interrupted while the second cluster comes up: the first policy's
    // run is kept, complete; the second never ran; both clusters go down.
    let out = tmp.path().join("a");
    let cancel = CancellationToken::new();
    cancel_on(&tmp.path().join("up.fifo"), None, &cancel);
    let cmp = compare(
        &spec(&exe, &out, &["p1", "hang"], true),
        Arc::new(requests(3)),
        cancel,
    )
    .await
    .expect("an interrupt is not an error");
    assert!(cmp.interrupted());
    assert_eq!(cmp.runs.len(), 1);
    assert_eq!(cmp.runs[0].policy, "p1");
    assert!(!cmp.runs[0].output.cancelled);
    assert_eq!(cmp.runs[0].output.outcomes.len(), 3);
    assert_eq!(cmp.runs[0].output.failed(), 0);
    assert_eq!(cmp.not_run, ["hang"]);
    let log = calls(tmp.path());
    assert!(log.iter().any(|l| l.ends_with("hang/run")), "{log:?}");
    // Its report says the comparison was cut short.
    let report = out.join("report");
    gorgo_bench::report::write_comparison_report(
        &report,
        serde_json::json!({"policies": ["p1", "hang"]}),
        &cmp,
    )
    .unwrap();
    let results: serde_json::Value =
        serde_json::from_slice(&std::fs::read(report.join("results.json")).unwrap()).unwrap();
    assert_eq!(results["config"]["cancelled"], serde_json::json!(["hang"]));
    assert_eq!(results["policies"]["p1"]["requests"], 3);
    assert!(results["policies"]["hang"].is_null());

    // Sequential, interrupted after the first replay returned (while its cluster goes
    // down): that run stands, complete, and the comparison is still marked cut short.
    std::fs::remove_file(tmp.path().join("calls.log")).unwrap();
    let out = tmp.path().join("b");
    let cancel = CancellationToken::new();
    cancel_on(
        &tmp.path().join("down.fifo"),
        Some(&tmp.path().join("ack.fifo")),
        &cancel,
    );
    let cmp = compare(
        &spec(&exe, &out, &["signals-down", "p2"], true),
        Arc::new(requests(3)),
        cancel,
    )
    .await
    .unwrap();
    assert!(cmp.interrupted());
    assert_eq!(cmp.runs.len(), 1);
    assert!(!cmp.runs[0].output.cancelled);
    assert_eq!(cmp.runs[0].output.outcomes.len(), 3);
    assert_eq!(cmp.not_run, ["p2"]);
    let log = calls(tmp.path());
    assert!(!log.iter().any(|l| l.starts_with("up p2")), "{log:?}");

    // Side by side, interrupted while the second cluster comes up: nothing ran, every
    // cluster goes down.
    std::fs::remove_file(tmp.path().join("calls.log")).unwrap();
    let cancel = CancellationToken::new();
    cancel_on(&tmp.path().join("up.fifo"), None, &cancel);
    let cmp = compare(
        &spec(&exe, &tmp.path().join("c"), &["p1", "hang"], false),
        Arc::new(requests(3)),
        cancel,
    )
    .await
    .unwrap();
    assert!(cmp.interrupted() && cmp.runs.is_empty());
    assert_eq!(cmp.not_run, ["p1", "hang"]);
    let downs = calls(tmp.path())
        .iter()
        .filter(|l| l.starts_with("down"))
        .count();
    assert_eq!(downs, 2);

    server.stop().await;
}
