//! `gorgo sim` end to end: generate a small trace with `gorgo trace generate`, simulate
//! it for a few policies plus the oracle with tuning, and check the report files and
//! their schema (docs/design.md, Interfaces).

use std::path::Path;
use std::process::Command;

fn gorgo() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gorgo"))
}

fn topology() -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/configs/topologies/three-region.toml"
    )
    .to_owned()
}

fn generate(dir: &Path) -> std::path::PathBuf {
    generate_lasting(dir, "120")
}

/// [`generate`] of `seconds` of traffic.
fn generate_lasting(dir: &Path, seconds: &str) -> std::path::PathBuf {
    let trace = dir.join("trace.jsonl");
    let out = gorgo()
        .args([
            "trace",
            "generate",
            "--seed",
            "3",
            "--duration-s",
            seconds,
            "--users",
            "40",
        ])
        .arg("--out")
        .arg(&trace)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    trace
}

#[test]
fn sim_writes_the_compare_report_with_tuning_and_oracle_gap() {
    let dir = tempfile::tempdir().unwrap();
    // Long enough for trials to be decided (the line measures its noise for four
    // windows first), without a start fit (a record only where it moves a weight) and
    // a line that never settles (windows of 16 measure a noise no trial could see
    // through): `tuning.jsonl` has trial records whatever the fits and noise are.
    let trace = generate_lasting(dir.path(), "400");
    let out_dir = dir.path().join("out");
    let out = gorgo()
        .args([
            "sim",
            "--policies",
            "gorgo,least-load,oracle",
            "--tune",
            "--tuning-window",
            "16",
            "--tuning-set",
            "fit_start=false",
            "--tuning-set",
            "settle_margin=1.0",
        ])
        .args([
            "--time-scale",
            "0.5",
            "--seed",
            "1",
            "--topology",
            &topology(),
        ])
        .arg("--trace")
        .arg(&trace)
        .arg("--out")
        .arg(&out_dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("Distributed vs oracle"), "{stdout}");
    for f in [
        "results.json",
        "table.md",
        "requests.csv",
        "ttft_cdf.svg",
        "region_share.svg",
        "sim.json",
        "tuning.jsonl",
    ] {
        assert!(out_dir.join(f).exists(), "{f} missing");
    }
    let results: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out_dir.join("results.json")).unwrap()).unwrap();
    for p in ["gorgo", "least-load", "oracle"] {
        let r = &results["policies"][p];
        for k in [
            "requests",
            "failed",
            "duration_s",
            "throughput_rps",
            "ttft_ms",
            "e2e_ms",
            "itl_ms",
            "region_share",
            "forwarded_share",
        ] {
            assert!(r.get(k).is_some(), "{p}.{k} missing: {r}");
        }
        for q in ["p50", "p95", "p99", "mean"] {
            assert!(r["ttft_ms"][q].as_f64().is_some(), "{p}.ttft_ms.{q}");
        }
    }
    let sim: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out_dir.join("sim.json")).unwrap()).unwrap();
    assert!(sim["oracle_gap"]["p95_ttft_ratio"].as_f64().unwrap() > 0.0);
    // The default is the node's own view of its engine; the oracle is labelled exact.
    assert_eq!(sim["config"]["view"], "node");
    assert_eq!(sim["config"]["oracle_view"], "exact-state");
    let table = std::fs::read_to_string(out_dir.join("table.md")).unwrap();
    assert!(table.starts_with("Simulated, view: node"), "{table}");
    assert!(stdout.contains("oracle: exact-state"), "{stdout}");
    for run in sim["runs"].as_array().unwrap() {
        let c = &run["counters"];
        assert_eq!(
            c["requests"],
            results["policies"][run["policy"].as_str().unwrap()]["requests"]
        );
        assert_eq!(c["unexpected_events"], 0);
    }
    let tuning = std::fs::read_to_string(out_dir.join("tuning.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(tuning.lines().next().unwrap()).unwrap();
    for k in gorgo_core::tuning::TUNING_JSONL_KEYS {
        assert!(first.get(k).is_some(), "tuning.jsonl lacks {k}: {first}");
    }
}

#[test]
fn sim_rejects_bad_input_with_the_flag_named() {
    let dir = tempfile::tempdir().unwrap();
    let trace = generate(dir.path());
    let run = |extra: &[&str]| {
        gorgo()
            .args(["sim", "--topology", &topology()])
            .arg("--trace")
            .arg(&trace)
            .arg("--out")
            .arg(dir.path().join("o"))
            .args(extra)
            .output()
            .unwrap()
    };
    let out = run(&["--policies", "gorgo,nope"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--policies"));
    // Errors name the flag, not the config field it sets; zero requests is an error,
    // not an empty report.
    for (flag, value) in [
        ("--time-scale", "0"),
        ("--metrics-interval-ms", "0"),
        ("--replicas", "0"),
        ("--max-requests", "0"),
    ] {
        let out = run(&[flag, value]);
        assert!(!out.status.success(), "{flag} {value}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{flag} {value}: {err}");
    }
    // The old flag is gone: the node's view is the default.
    let out = run(&["--live-node-stats"]);
    assert!(!out.status.success());
    // The idealisation is asked for by name and reported as such.
    let out = run(&[
        "--exact-state",
        "--policies",
        "gorgo",
        "--max-requests",
        "50",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sim: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("o/sim.json")).unwrap()).unwrap();
    assert_eq!(sim["config"]["view"], "exact-state");
    let table = std::fs::read_to_string(dir.path().join("o/table.md")).unwrap();
    assert!(table.starts_with("Simulated, view: exact-state"), "{table}");
    // So is the causal oracle, a bound rather than the oracle.
    let out = run(&[
        "--causal-oracle",
        "--policies",
        "gorgo,oracle",
        "--max-requests",
        "50",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sim: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("o/sim.json")).unwrap()).unwrap();
    assert_eq!(sim["config"]["oracle_view"], "exact-state, causal forwards");
    let table = std::fs::read_to_string(dir.path().join("o/table.md")).unwrap();
    assert!(table.contains("(--causal-oracle)"), "{table}");
    let out = gorgo()
        .args(["sim", "--trace", "/nonexistent/trace.jsonl", "--out"])
        .arg(dir.path().join("o"))
        .args(["--topology", &topology()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--trace"));
}

/// `gorgo sweep --live` checks every simulator flag before its first live run (it
/// simulates the latency floor at the end): a bad one fails at once, before any cluster
/// is started (no `live-x*` directory); and a `--replicas` too large for a live
/// cluster is an error naming it, not a value wrapped to 16 bits.
#[test]
fn a_live_sweep_checks_its_flags_before_any_live_run() {
    let dir = tempfile::tempdir().unwrap();
    let trace = generate(dir.path());
    let out_dir = dir.path().join("sweep");
    for (flag, value) in [
        ("--engine-profile", "no-such-profile"),
        ("--replicas", "70000"),
        ("--replicas", "0"),
    ] {
        let out = gorgo()
            .args(["sweep", "--live", "--topology", &topology()])
            .args(["--time-scales", "0.02", "--policies", "round-robin"])
            .args(["--base-port", "47960", "--no-progress"])
            .args([flag, value])
            .arg("--trace")
            .arg(&trace)
            .arg("--out")
            .arg(&out_dir)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{flag} {value}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(flag) && err.contains(value),
            "{flag} {value}: {err}"
        );
        let live_dirs: Vec<_> = std::fs::read_dir(&out_dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert!(live_dirs.is_empty(), "{flag} {value}: {live_dirs:?}");
    }
}

/// `gorgo trace convert F --out F` (or through another path to F: `./F`, a link to it)
/// reads F to its end before replacing it: every row is converted, none lost to a
/// truncation under the reader. F is larger than the reader's 1 MiB buffer.
#[test]
fn trace_convert_onto_its_own_input_keeps_every_row() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("mooncake.jsonl");
    let rows = 12_000;
    let text: String = (0..rows)
        .map(|i| {
            let ids: Vec<String> = (0..16).map(|k| (i * 16 + k).to_string()).collect();
            format!(
                "{{\"timestamp\": {}, \"input_length\": 8000, \"output_length\": 20, \"hash_ids\": [{}]}}\n",
                i * 10,
                ids.join(", ")
            )
        })
        .collect();
    assert!(text.len() > 2 << 20);
    std::fs::write(&trace, &text).unwrap();
    let link = dir.path().join("link.jsonl");
    std::os::unix::fs::symlink(&trace, &link).unwrap();
    let same_file = [
        trace.clone(),
        dir.path().join(".").join("mooncake.jsonl"),
        link.clone(),
    ];
    for out in &same_file {
        let status = gorgo()
            .args(["trace", "convert"])
            .arg(&trace)
            .arg("--out")
            .arg(out)
            .output()
            .unwrap();
        assert!(
            status.status.success(),
            "{}: {}",
            out.display(),
            String::from_utf8_lossy(&status.stderr)
        );
        let converted = std::fs::read_to_string(&trace).unwrap();
        assert_eq!(converted.lines().count(), rows, "{}", out.display());
        assert!(converted.contains("\"block_tokens\""), "{}", out.display());
    }
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
}

/// A trace (or window) that selects no request is an error naming it: the report of
/// no requests was a table of blanks, written with exit status 0.
#[test]
fn a_selection_of_no_request_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let late = dir.path().join("late.jsonl");
    std::fs::write(
        &late,
        "{\"timestamp\": 5000, \"input_length\": 100, \"output_length\": 4, \"hash_ids\": [1]}\n",
    )
    .unwrap();
    for (trace, window) in [(&empty, None), (&late, Some("0.001"))] {
        let mut cmd = gorgo();
        cmd.args([
            "sim",
            "--topology",
            &topology(),
            "--policies",
            "round-robin",
        ])
        .arg("--trace")
        .arg(trace)
        .arg("--out")
        .arg(dir.path().join("out"));
        if let Some(w) = window {
            cmd.args(["--window-s", w]);
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(err.contains("selects no request"), "{err}");
    }
}
