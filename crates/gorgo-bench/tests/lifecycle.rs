//! Cluster lifecycle and the whole comparison, with a stand-in `gorgo` binary (a shell
//! script that "starts" clusters by writing cluster.json pointing at an in-process SSE
//! server, and logs every `down`): teardown is checked on success and on failure.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::stub::{calls, fake_gorgo, requests};
use common::Server;
use gorgo_bench::{
    compare, BenchError, CancellationToken, CompareSpec, LoadMode, ReplayConfig, RunningCluster,
    UpOptions,
};

// One test function: every step spawns the script, and running them serially avoids
// the fork-while-writing race (ETXTBSY) between test threads.
#[tokio::test]
async fn clusters_come_up_and_always_go_down() {
    let server = Server::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let exe = fake_gorgo(tmp.path(), &server.url);
    // A log a run before left, readable by all: the next run's is the owner's alone.
    std::fs::create_dir_all(tmp.path().join("a/run")).unwrap();
    std::fs::write(tmp.path().join("a/run/up.log"), "old").unwrap();
    std::fs::set_permissions(
        tmp.path().join("a/run/up.log"),
        std::os::unix::fs::PermissionsExt::from_mode(0o644),
    )
    .unwrap();
    let opts = |policy: &str| UpOptions {
        exe: exe.clone(),
        topology: tmp.path().join("topo.toml"),
        policy: policy.to_owned(),
        engine_profile: None,
        run_dir: tmp.path().join(policy).join("run"),
        base_port: Some(7100),
        extra_args: Vec::new(),
        timeout: Duration::from_secs(30),
    };

    // Up then drop: torn down by the guard.
    {
        let c = RunningCluster::up(&opts("a")).await.unwrap();
        assert_eq!(c.info.region_names(), vec!["us", "eu"]);
    }
    let log = calls(tmp.path());
    assert_eq!(log[0], "up a 7100");
    // `gorgo up` waits for readiness within the caller's timeout (its own default, 60
    // s, cut a caller's 120 s short), and its log, which holds the admin token, is
    // the owner's alone.
    let ready = std::fs::read_to_string(tmp.path().join("calls.log.ready")).unwrap();
    assert_eq!(ready.lines().next(), Some("ready 25"));
    let mode = std::fs::metadata(tmp.path().join("a/run/up.log")).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o077,
        0
    );
    assert!(
        log[1].starts_with("down ") && log[1].ends_with("a/run"),
        "{log:?}"
    );

    // A failing up: the error carries the log tail, and the partial cluster goes down.
    let err = RunningCluster::up(&opts("broken")).await.unwrap_err();
    assert!(matches!(err, BenchError::Cluster { action: "up", .. }));
    assert!(err.to_string().contains("engine failed to start"), "{err}");
    let log = calls(tmp.path());
    assert!(log.last().unwrap().ends_with("broken/run"), "{log:?}");

    // An up that fails leaving the run dir's pids file as it was started nothing: the
    // cluster already running from there (a second compare with the same --out) is
    // not stopped.
    let busy = tmp.path().join("busy/run");
    std::fs::create_dir_all(&busy).unwrap();
    std::fs::write(busy.join("pids.json"), "{\"running\": true}").unwrap();
    let err = RunningCluster::up(&UpOptions {
        run_dir: busy.clone(),
        ..opts("broken")
    })
    .await
    .unwrap_err();
    assert!(matches!(err, BenchError::Cluster { action: "up", .. }));
    let log = calls(tmp.path());
    assert!(log.iter().all(|l| !l.ends_with("busy/run")), "{log:?}");

    // A whole parallel comparison: distinct port blocks, every request measured,
    // every cluster down.
    std::fs::remove_file(tmp.path().join("calls.log")).unwrap();
    let spec = CompareSpec {
        exe: exe.clone(),
        topology: tmp.path().join("topo.toml"),
        policies: vec!["p1".into(), "p2".into()],
        out: tmp.path().join("cmp"),
        sequential: false,
        engine_profile: None,
        up_args: Vec::new(),
        base_port: 8000,
        port_stride: 100,
        cluster_ports: 7,
        up_timeout: Duration::from_secs(30),
        replay: ReplayConfig {
            mode: LoadMode::Open { time_scale: 0.0 },
            ..ReplayConfig::default()
        },
        model: "m".into(),
        ignore_eos: true,
        progress: None,
    };
    let cmp = compare(&spec, Arc::new(requests(8)), CancellationToken::new())
        .await
        .unwrap();
    assert!(!cmp.interrupted() && cmp.not_run.is_empty());
    let runs = cmp.runs;
    assert_eq!(runs.len(), 2);
    for run in &runs {
        assert_eq!(run.output.outcomes.len(), 8);
        assert_eq!(
            run.output.failed(),
            0,
            "{:?}",
            run.output.outcomes[0].measured
        );
        assert_eq!(run.regions, vec!["us", "eu"]);
    }
    let log = calls(tmp.path());
    assert_eq!(&log[..2], &["up p1 8000", "up p2 8100"]);

    // The report: docs/design.md's results.json schema plus the table, CSV and plots.
    let out = tmp.path().join("cmp");
    let table =
        gorgo_bench::report::write_report(&out, serde_json::json!({"trace": "t"}), &runs).unwrap();
    assert!(table.contains("p1") && table.contains("p2"));
    let results: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap();
    for p in ["p1", "p2"] {
        let r = &results["policies"][p];
        assert_eq!(r["requests"], 8);
        assert_eq!(r["failed"], 0);
        for key in ["p50", "p95", "p99", "mean"] {
            assert!(r["ttft_ms"][key].is_number(), "{r}");
        }
        assert!(r["region_share"].is_object());
        assert!(results["config"]["slip_ms"][p]["p99"].is_number());
    }
    for f in [
        "table.md",
        "requests.csv",
        "ttft_cdf.svg",
        "region_share.svg",
    ] {
        assert!(out.join(f).is_file(), "{f}");
    }
    assert_eq!(log.iter().filter(|l| l.starts_with("down")).count(), 2);

    // Sequential: each cluster is down before the next one comes up.
    std::fs::remove_file(tmp.path().join("calls.log")).unwrap();
    let sequential = CompareSpec {
        sequential: true,
        ..spec.clone()
    };
    let runs = compare(&sequential, Arc::new(requests(3)), CancellationToken::new())
        .await
        .unwrap()
        .runs;
    assert_eq!(
        runs.iter().map(|r| r.output.outcomes.len()).sum::<usize>(),
        6
    );
    let kinds: Vec<String> = calls(tmp.path())
        .iter()
        .map(|l| l.split(' ').next().unwrap().to_owned())
        .collect();
    assert_eq!(kinds, vec!["up", "down", "up", "down"]);

    // Duplicate or path-like policy names are refused before anything starts.
    for bad in [
        vec!["p1".to_owned(), "p1".to_owned()],
        vec!["../x".to_owned()],
    ] {
        let spec = CompareSpec {
            policies: bad,
            ..spec.clone()
        };
        let err = compare(&spec, Arc::new(requests(1)), CancellationToken::new())
            .await
            .unwrap_err();
        assert!(err.to_string().contains("policies"), "{err}");
    }
    // Port blocks that overlap (closer than a block) or run past 65535 are refused
    // before anything starts (a stride of 0 put every cluster on one block; a block
    // of 11 ports, two engines a region, overlaps at a stride of 7), naming the flag
    // at fault: the stride for an overlap, the base port for a run past 65535.
    for (base_port, port_stride, cluster_ports, blamed) in [
        (8000, 0, 7, "port_stride"),
        (8000, 6, 7, "port_stride"),
        (8000, 7, 11, "port_stride"),
        (65_500, 100, 7, "base_port"),
        (65_430, 100, 7, "base_port"),
    ] {
        let spec = CompareSpec {
            base_port,
            port_stride,
            cluster_ports,
            ..spec.clone()
        };
        let err = compare(&spec, Arc::new(requests(1)), CancellationToken::new())
            .await
            .unwrap_err();
        assert!(err.to_string().contains(blamed), "{err}");
    }

    // A comparison whose second cluster fails: the first one still goes down.
    std::fs::remove_file(tmp.path().join("calls.log")).unwrap();
    let spec = CompareSpec {
        policies: vec!["p1".into(), "broken".into()],
        ..spec
    };
    let err = compare(&spec, Arc::new(requests(2)), CancellationToken::new())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("engine failed"), "{err}");
    let log = calls(tmp.path());
    assert_eq!(
        log.iter().filter(|l| l.starts_with("down")).count(),
        2,
        "{log:?}"
    );

    // In sequence, a cluster that fails after a policy finished: the finished run is
    // kept and the failure named, and the sequence stops there (p2 never comes up).
    std::fs::remove_file(tmp.path().join("calls.log")).unwrap();
    let spec = CompareSpec {
        policies: vec!["p1".into(), "broken".into(), "p2".into()],
        sequential: true,
        out: tmp.path().join("seq-broken"),
        ..spec
    };
    let cmp = compare(&spec, Arc::new(requests(2)), CancellationToken::new())
        .await
        .expect("a failure after a finished policy keeps it");
    assert_eq!(cmp.runs.len(), 1);
    assert_eq!(cmp.runs[0].policy, "p1");
    assert_eq!(cmp.runs[0].output.outcomes.len(), 2);
    assert_eq!(cmp.failed.len(), 1);
    assert_eq!(cmp.failed[0].policy, "broken");
    assert!(
        cmp.failed[0].error.contains("engine failed"),
        "{:?}",
        cmp.failed
    );
    assert_eq!(cmp.not_run, ["p2"]);
    assert!(!cmp.interrupted());
    let log = calls(tmp.path());
    assert!(!log.iter().any(|l| l.starts_with("up p2")), "{log:?}");
    // Its report says which policy failed and which never ran.
    let report = tmp.path().join("seq-broken-report");
    gorgo_bench::report::write_comparison_report(&report, serde_json::json!({}), &cmp).unwrap();
    let results: serde_json::Value =
        serde_json::from_slice(&std::fs::read(report.join("results.json")).unwrap()).unwrap();
    assert_eq!(results["config"]["failed"][0]["policy"], "broken");
    assert_eq!(results["config"]["cancelled"], serde_json::json!(["p2"]));
    assert_eq!(results["policies"]["p1"]["requests"], 2);

    server.stop().await;
}
