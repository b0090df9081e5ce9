//! `gorgo sim` end to end: generate a small trace with `gorgo trace generate`, simulate
//! it for a few policies plus the oracle with tuning, and check the report files and
//! their schema (docs/design.md, Interfaces).

use std::path::Path;
use std::process::Command;

/// The binary, without a backtrace under its errors whatever the caller's
/// `RUST_BACKTRACE` (the tests read the errors).
fn gorgo() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gorgo"));
    cmd.env("RUST_BACKTRACE", "0");
    cmd
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
        // Weights a node's config and admin API refuse (over `MAX_WEIGHT`).
        ("--weights", "1e300,1"),
    ] {
        let out = run(&[flag, value]);
        assert!(!out.status.success(), "{flag} {value}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{flag} {value}: {err}");
    }
    // `--tuning-set` where nothing tunes did nothing, and was recorded as if it had.
    for extra in [
        &["--policies", "gorgo", "--tuning-set", "max_trial_windows=2"][..],
        &[
            "--policies",
            "least-load,oracle",
            "--tune",
            "--tuning-set",
            "max_trial_windows=2",
        ],
    ] {
        let out = run(&[extra, &["--max-requests", "20"]].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("--tuning-set") && err.contains("--tune"),
            "{extra:?}: {err}"
        );
    }
    // So were the other tuning-only flags: ignored without `--tune`.
    for extra in [
        &["--tuning-window", "16"][..],
        &["--trial", "sequential"],
        &["--tuning-sigma", "0.1"],
    ] {
        let out = run(&[extra, &["--policies", "gorgo", "--max-requests", "20"]].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(extra[0]) && err.contains("--tune"),
            "{extra:?}: {err}"
        );
    }
    // A value of the wrong type names its key.
    let out = run(&[
        "--policies",
        "gorgo",
        "--tune",
        "--tuning-set",
        "max_trial_windows=abc",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--tuning-set `max_trial_windows`"),
        "{err}"
    );
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

/// A subcommand whose stdout is a closed pipe (`| head -c 10`) or a full disk fails
/// with an error naming stdout (exit 1); `println!` panicked there (exit 101, "failed
/// printing to stdout").
#[test]
fn output_to_a_closed_pipe_or_a_full_disk_is_an_error_not_a_panic() {
    let topology = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/configs/topologies/three-region.toml"
    );
    let closed_pipe = || {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        std::process::Stdio::from(writer)
    };
    let full_disk = || {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        std::process::Stdio::from(full)
    };
    for (what, stdout) in [("closed pipe", closed_pipe()), ("full disk", full_disk())] {
        let out = gorgo()
            .args(["netem", "--topology", topology, "--plan"])
            .env("RUST_BACKTRACE", "0")
            .stdout(stdout)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{what}: {stderr}");
        assert!(stderr.contains("writing to stdout"), "{what}: {stderr}");
    }
}

/// Magnitudes no real run uses are refused naming the flag (or the profile file and
/// field), in `sim`, `sweep`, `tune-offline` and `trace generate` alike: each ran for
/// ever, held memory without bound, or exited 0 with figures that cannot be right
/// (a time scale of `1e300`: TTFT p50 0 ms).
#[test]
fn magnitudes_no_run_uses_are_refused_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let trace = generate(dir.path());
    let profile = dir.path().join("slope0.toml");
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/configs/engines/paper-a100-mistral7b.toml"
    ))
    .unwrap()
    .replace("t_p_ms_per_token = 0.0938", "t_p_ms_per_token = 0");
    std::fs::write(&profile, text).unwrap();
    let profile = profile.display().to_string();
    let sim: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--time-scale", "1e300"], "--time-scale"),
        (vec!["--time-scale", "inf"], "finite"),
        (vec!["--gossip-delay-ms", "1e7"], "--gossip-delay-ms"),
        (vec!["--gossip-interval-ms", "1e9"], "--gossip-interval-ms"),
        (
            vec!["--kv-events-delay-ms", "1e300"],
            "--kv-events-delay-ms",
        ),
        (vec!["--tune", "--tuning-window", "1"], "--tuning-window"),
        (vec!["--max-context-tokens", "1"], "--max-context-tokens"),
        (vec!["--engine-profile", &profile], "t_p_ms_per_token"),
    ];
    for (extra, named) in sim {
        let out = gorgo()
            .args(["sim", "--topology", &topology(), "--policies", "gorgo"])
            .args(["--max-requests", "20"])
            .arg("--trace")
            .arg(&trace)
            .arg("--out")
            .arg(dir.path().join("o"))
            .args(&extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?}: {err}");
        let short = err.lines().all(|l| l.len() < 300);
        assert!(err.contains(named) && short, "{extra:?}: {err}");
    }
    let others: Vec<(Vec<&str>, &str)> = vec![
        (vec!["sweep", "--time-scales", "1e300"], "--time-scales"),
        (vec!["sweep", "--rates", "1e-300"], "--rates"),
        (
            vec!["tune-offline", "--time-scale", "1e300"],
            "--time-scale",
        ),
    ];
    for (argv, named) in others {
        let out = gorgo()
            .args(&argv)
            .args([
                "--topology",
                &topology(),
                "--no-progress",
                "--max-requests",
                "20",
            ])
            .arg("--trace")
            .arg(&trace)
            .arg("--out")
            .arg(dir.path().join("o"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{argv:?}: {err}");
        let short = err.lines().all(|l| l.len() < 300);
        assert!(err.contains(named) && short, "{argv:?}: {err}");
    }
    // The generator holds its trace in memory: `1e100` requests per user wrote one.
    let out = gorgo()
        .args([
            "trace",
            "generate",
            "--users",
            "1",
            "--requests-per-user",
            "1e100",
        ])
        .arg("--out")
        .arg(dir.path().join("g.jsonl"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    let short = err.lines().all(|l| l.len() < 300);
    assert!(err.contains("--requests-per-user") && short, "{err}");
    assert!(!dir.path().join("g.jsonl").exists());
}

/// A rerun into the same `--out` without `--decisions` removes the old
/// `decisions.jsonl`, which read as the new run's decisions.
#[test]
fn a_rerun_without_decisions_leaves_no_old_decisions_file() {
    let dir = tempfile::tempdir().unwrap();
    let trace = generate(dir.path());
    let out_dir = dir.path().join("o");
    let run = |extra: &[&str]| {
        let out = gorgo()
            .args(["sim", "--topology", &topology(), "--max-requests", "20"])
            .arg("--trace")
            .arg(&trace)
            .arg("--out")
            .arg(&out_dir)
            .args(extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&["--policies", "gorgo", "--decisions", "5"]);
    assert!(out_dir.join("decisions.jsonl").exists());
    run(&["--policies", "least-load"]);
    assert!(!out_dir.join("decisions.jsonl").exists());
}

/// The generator's `--config` is read with a cap (16 MiB): a valid one padded one byte
/// over it, or `/dev/zero` (before, read until memory ran out), is refused naming the
/// flag and the cap.
#[test]
fn a_generator_config_over_the_cap_is_refused_naming_the_flag() {
    const CAP: usize = 16 << 20;
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("gen.toml");
    std::fs::write(&big, format!("seed = 3\n{}", " ".repeat(CAP - 8))).unwrap();
    let zero = Path::new("/dev/zero");
    for config in [big.as_path(), zero].into_iter().filter(|p| p.exists()) {
        let out = gorgo()
            .args(["trace", "generate", "--config"])
            .arg(config)
            .arg("--out")
            .arg(dir.path().join("t.jsonl"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && err.contains(&format!("--config {}", config.display()))
                && err.contains(&format!("larger than {CAP} bytes")),
            "{err}"
        );
    }
}

/// `sim`, `sweep` and `tune-offline` create `--out` before they simulate: one that
/// cannot be a directory (a file) failed only at the end ("File exists"). And
/// `tune-offline` runs each distinct cell of its grid once (`1,1,1` ran one cell three
/// times), and refuses a weight above the most a person may set (`1e300` ran).
#[test]
fn out_and_the_weight_grid_are_checked_before_simulating() {
    let dir = tempfile::tempdir().unwrap();
    let trace = generate(dir.path());
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    let run = |argv: &[&str], out: &Path| {
        gorgo()
            .args(argv)
            .args(["--topology", &topology(), "--max-requests", "20"])
            .arg("--trace")
            .arg(&trace)
            .arg("--out")
            .arg(out)
            .output()
            .unwrap()
    };
    let commands: [&[&str]; 3] = [
        &["sim", "--policies", "round-robin"],
        &[
            "sweep",
            "--policies",
            "round-robin",
            "--time-scales",
            "2",
            "--no-progress",
        ],
        &[
            "tune-offline",
            "--rtt-grid",
            "1",
            "--queue-grid",
            "1",
            "--no-progress",
        ],
    ];
    for argv in commands {
        let out = run(argv, &file);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{argv:?}: {err}");
        assert!(
            err.contains(&format!("--out {}", file.display())) && !err.contains("done:"),
            "{argv:?}: {err}"
        );
    }

    let grid = dir.path().join("grid");
    let out = run(
        &[
            "tune-offline",
            "--rtt-grid",
            "1,1,1",
            "--queue-grid",
            "0.5,0.5",
            "--no-progress",
        ],
        &grid,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(grid.join("grid.json")).unwrap()).unwrap();
    let cells: Vec<String> = report["points"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["weights"].to_string())
        .collect();
    let mut distinct = cells.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(cells.len(), distinct.len(), "{cells:?}");
    // The one cell of the grid, and the default weights.
    assert_eq!(cells.len(), 2, "{cells:?}");

    for (flag, value) in [("--rtt-grid", "1e300"), ("--queue-grid", "100.5")] {
        let out = run(&["tune-offline", "--no-progress", flag, value], &grid);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(flag) && err.contains("(0, 100]"),
            "{flag} {value}: {err}"
        );
    }
}

/// `gorgo trace convert` and `generate` write only what the trace readers read back:
/// a CSV row dated 9999 (converted, then refused by the reader of the output), a
/// `--spread-ties` past the readers' last millisecond, a generated line over the
/// readers' 16 MiB (`tokens_per_block = 1` and a 2M-token system prompt) are errors
/// naming the line and the field, and no file is written. An Azure row earlier than the
/// first (moved to t = 0 without a word) is an error naming its line; statistics of an
/// empty trace are an error, not zeros; an empty region name is refused naming
/// `--regions`.
#[test]
fn trace_writers_refuse_what_the_readers_refuse() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name);
    let failed = |args: &[&std::ffi::OsStr], wants: &[&str]| {
        let out = gorgo().args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded: {err}");
        for want in wants {
            assert!(err.contains(want), "{args:?}: wants {want:?}: {err}");
        }
    };
    let os = |s: &'static str| std::ffi::OsStr::new(s);
    let header = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,100,10\n";
    std::fs::write(
        p("y9999.csv"),
        format!("{header}9999-12-31 23:59:59,100,10\n"),
    )
    .unwrap();
    failed(
        &[
            os("trace"),
            os("convert"),
            p("y9999.csv").as_os_str(),
            os("--out"),
            p("out.jsonl").as_os_str(),
        ],
        &["y9999.csv", "line 3:", "timestamp 251702142252320"],
    );
    assert!(!p("out.jsonl").exists());
    // Two runs of ties: the last is spread over the 9 s between them, past 9e12 ms.
    let row = |t: u64| {
        format!("{{\"timestamp\":{t},\"input_length\":10,\"output_length\":1,\"hash_ids\":[1]}}\n")
    };
    let near_max = [
        8_999_999_990_000,
        8_999_999_990_000,
        8_999_999_999_000,
        8_999_999_999_000,
    ]
    .map(row)
    .concat();
    std::fs::write(p("max.jsonl"), near_max).unwrap();
    failed(
        &[
            os("trace"),
            os("convert"),
            p("max.jsonl").as_os_str(),
            os("--spread-ties"),
            os("--out"),
            p("out.jsonl").as_os_str(),
        ],
        &["--spread-ties", "output line 4", "timestamp"],
    );
    assert!(!p("out.jsonl").exists());
    std::fs::write(
        p("gen.toml"),
        "tokens_per_block = 1\nsystem_prompt_median_tokens = 2000000.0\nsystem_prompt_sigma = 0.0\n\
         max_input_tokens = 16777216\nusers = 1\nduration_s = 60.0\n",
    )
    .unwrap();
    failed(
        &[
            os("trace"),
            os("generate"),
            os("--config"),
            p("gen.toml").as_os_str(),
            os("--out"),
            p("out.jsonl").as_os_str(),
        ],
        &["output line 1 (request r0)", "16777216 bytes", "hash_ids"],
    );
    assert!(!p("out.jsonl").exists());
    std::fs::write(p("empty.jsonl"), "").unwrap();
    failed(
        &[os("trace"), os("stats"), p("empty.jsonl").as_os_str()],
        &["holds no request"],
    );
    for regions in ["", "a,,b", "a, b"] {
        failed(
            &[
                os("trace"),
                os("generate"),
                os("--users"),
                os("3"),
                os("--regions"),
                std::ffi::OsStr::new(regions),
                os("--out"),
                p("out.jsonl").as_os_str(),
            ],
            &["--regions"],
        );
    }
    assert!(!p("out.jsonl").exists());
}

/// When no request of the trace fits any engine, the floor is over no request: the
/// table says so rather than printing `NaN`.
#[test]
fn a_floor_over_no_request_is_not_nan() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("long.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\":0,\"input_length\":200000,\"output_length\":10,\"hash_ids\":[1]}\n",
    )
    .unwrap();
    let out_dir = dir.path().join("out");
    let out = gorgo()
        .args([
            "sim",
            "--topology",
            &topology(),
            "--policies",
            "round-robin",
        ])
        .arg("--trace")
        .arg(&trace)
        .arg("--out")
        .arg(&out_dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = std::fs::read_to_string(out_dir.join("table.md")).unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    for text in [table.as_str(), &stdout] {
        assert!(!text.contains("NaN"), "{text}");
        assert!(
            text.contains("no policy can beat it") && text.contains("n/a"),
            "{text}"
        );
    }
}

/// `gorgo netem --tc-script` names the topology file it was given in the script's
/// header, not `configs/topologies/<stem>.toml`.
#[test]
fn the_tc_script_names_the_topology_file_given() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("mine.toml");
    std::fs::copy(topology(), &file).unwrap();
    let out = gorgo()
        .args(["netem", "--tc-script", "--topology"])
        .arg(&file)
        .output()
        .unwrap();
    let script = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let header = script.lines().nth(1).unwrap();
    assert!(
        header.contains(&format!("Generated from {} by", file.display())),
        "{header}"
    );
}

/// `--out /dev/stdout` puts the file on stdout: through a pipe (the atomic write made
/// a temporary file beside the pipe's `pipe:[N]` and failed, "No such file"), and
/// appended to a file stdout was opened on with `>>` (the rename replaced that file,
/// dropping what it held). A directory is refused naming it.
#[test]
fn out_dev_stdout_writes_to_stdout() {
    let args = [
        "trace",
        "generate",
        "--seed",
        "3",
        "--duration-s",
        "20",
        "--users",
        "4",
    ];
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("trace.jsonl");
    let out = gorgo().args(args).arg("--out").arg(&file).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let trace = std::fs::read_to_string(&file).unwrap();
    assert!(!trace.is_empty());

    let out = gorgo()
        .args(args)
        .args(["--out", "/dev/stdout"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8(out.stdout).unwrap(), trace);

    let log = dir.path().join("log");
    std::fs::write(&log, "kept\n").unwrap();
    let appended = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
    let out = gorgo()
        .args(args)
        .args(["--out", "/dev/stdout"])
        .stdout(appended)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(&log).unwrap(),
        format!("kept\n{trace}")
    );

    let out = gorgo()
        .args(args)
        .arg("--out")
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("{}: is a directory", dir.path().display())),
        "{stderr}"
    );
}
