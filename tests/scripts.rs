//! The shell scripts of scripts/ that start clusters or skip finished work, run against
//! a stand-in `gorgo` (a shell script that logs each call and writes what the real one
//! would leave behind): what they run, in which order, and what they stop on the way
//! out. Nothing here starts a real cluster.

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The stand-in `gorgo`: logs `$*` to `$STUB_LOG`; `up` writes `cluster.json` and
/// `pids.json` (and fails, after writing them, when its run dir contains
/// `$STUB_UP_FAILS`); `down` logs whether it found a `pids.json` and removes it;
/// `sim`, `compare` and `bench` write a complete `results.json`.
const STUB: &str = r#"#!/usr/bin/env bash
echo "$*" >> "$STUB_LOG"
cmd=$1; shift
out=""; run=""
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=$2; shift ;;
    --run-dir) run=$2; shift ;;
  esac
  shift
done
case $cmd in
  up)
    mkdir -p "$run"
    echo '{"regions": [{"name": "a", "client_url": "http://127.0.0.1:9"}]}' > "$run/cluster.json"
    echo '{"pgid": 0, "processes": []}' > "$run/pids.json"
    case "$run" in *"${STUB_UP_FAILS:-//none//}"*) exit 1 ;; esac ;;
  down)
    [ -f "$run/pids.json" ] && echo "down found pids.json in $run" >> "$STUB_LOG"
    rm -f "$run/pids.json" ;;
  sim|compare|bench)
    mkdir -p "$out"
    cat > "$out/results.json" <<'JSON'
{"config": {}, "policies": {"gorgo": {"requests": 10, "failed": 0, "cache_hit_ratio": 0.5,
 "ttft_ms": {"p50": 100.0, "p95": 200.0, "p99": 300.0},
 "e2e_ms": {"p50": 1000.0, "p95": 2000.0, "p99": 3000.0}}}}
JSON
    ;;
  trace) touch "$out" ;;
esac
"#;

/// Writes the stand-in into `dir`; its path.
fn stub(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("gorgo-stub");
    std::fs::write(&path, STUB).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// A complete `results.json` of policy `gorgo`, interrupted when `cancelled`.
fn results(dir: &Path, cancelled: bool) {
    std::fs::create_dir_all(dir).unwrap();
    let config = if cancelled {
        serde_json::json!({"cancelled": ["gorgo"]})
    } else {
        serde_json::json!({})
    };
    let stats = |p50: f64| serde_json::json!({"p50": p50, "p95": p50 * 2.0, "p99": p50 * 3.0});
    let r = serde_json::json!({
        "config": config,
        "policies": {"gorgo": {"requests": 10, "failed": 0, "ttft_ms": stats(100.0),
            "e2e_ms": stats(1000.0)}},
    });
    std::fs::write(dir.join("results.json"), r.to_string()).unwrap();
}

fn bash(script: &str, args: &[&str], env: &[(&str, &Path)]) -> std::process::Output {
    let mut cmd = Command::new("bash");
    cmd.arg(root().join("scripts").join(script)).args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

/// An interrupted `gorgo compare` still writes `results.json` (with
/// `config.cancelled`): scripts/fidelity.sh replays that window again rather than
/// take it as done, and keeps the finished runs; scripts/fidelity_report.py flags an
/// interrupted live run.
#[test]
fn fidelity_replays_an_interrupted_window_and_its_report_flags_one() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let out = dir.path().join("out");
    let window = out.join("mc-x4");
    results(&window.join("live"), true);
    for done in ["sim-seed1", "sim-seed2", "sim-seed3", "sim-seed4"] {
        results(&window.join(done), false);
    }
    // Interrupted: done again.
    results(&window.join("sim-live-chains"), true);
    std::fs::write(out.join("gen5.jsonl"), "").unwrap();
    let gorgo = stub(dir.path());
    let run = Command::new("bash")
        .arg(root().join("scripts/fidelity.sh"))
        .arg(&out)
        .env("GORGO", &gorgo)
        .env("STUB_LOG", &log)
        .env("WINDOWS", "mc-x4")
        .env("POLICIES", "gorgo")
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let calls = std::fs::read_to_string(&log).unwrap();
    assert!(
        calls
            .lines()
            .any(|l| l.starts_with("compare") && l.contains("mc-x4/live")),
        "the interrupted live run was not replayed: {calls}"
    );
    assert!(
        calls.lines().any(|l| l.contains("sim-live-chains")),
        "{calls}"
    );
    assert!(
        !calls.contains("sim-seed"),
        "finished runs are kept: {calls}"
    );

    // The report of a window whose live run was interrupted says so.
    results(&window.join("live"), true);
    let report = Command::new("python3")
        .arg(root().join("scripts/fidelity_report.py"))
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        report.status.success(),
        "{}",
        String::from_utf8_lossy(&report.stderr)
    );
    let text = String::from_utf8_lossy(&report.stdout);
    assert!(
        text.contains("live run was interrupted") && text.contains("mc-x4 (live interrupted)"),
        "{text}"
    );
}

/// scripts/guidellm.sh stops the cluster it started however it ends: here GuideLLM
/// writes no result, and the script fails after its cluster is up.
#[test]
fn guidellm_stops_its_own_cluster_when_it_fails() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let out = dir.path().join("out");
    std::fs::create_dir_all(out.join("tokenizer")).unwrap();
    std::fs::write(out.join("tokenizer/tokenizer.json"), "{}").unwrap();
    // A GuideLLM of the right version that writes nothing.
    let venv = dir.path().join("venv");
    std::fs::create_dir_all(venv.join("bin")).unwrap();
    let guidellm = venv.join("bin/guidellm");
    std::fs::write(
        &guidellm,
        "#!/usr/bin/env bash\n[ \"$1\" = --version ] && echo 'guidellm 0.8.1'\nexit 0\n",
    )
    .unwrap();
    std::fs::set_permissions(&guidellm, std::fs::Permissions::from_mode(0o755)).unwrap();
    let trace = dir.path().join("trace.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 4, \"hash_ids\": [1]}\n",
    )
    .unwrap();
    let gorgo = stub(dir.path());
    let run = bash(
        "guidellm.sh",
        &[],
        &[
            ("GORGO_BIN", &gorgo),
            ("STUB_LOG", &log),
            ("GORGO_GUIDELLM_OUT", &out),
            ("GORGO_GUIDELLM_VENV", &venv),
            ("GORGO_GUIDELLM_TRACE", &trace),
        ],
    );
    assert!(!run.status.success(), "GuideLLM wrote no result");
    let text = std::fs::read_to_string(&log).unwrap();
    let calls: Vec<&str> = text.lines().collect();
    let run_dir = out.join("run").display().to_string();
    let last_up = calls.iter().rposition(|l| l.starts_with("up")).unwrap();
    assert!(
        calls[last_up..].contains(&format!("down found pids.json in {run_dir}").as_str()),
        "the script's cluster was left running: {calls:?}"
    );
}

/// scripts/kv-events-live.sh stops a cluster an interrupted earlier run left behind
/// before it deletes that run's directory (and its pids.json), and stops its own
/// cluster however it ends (here `gorgo up` of the second source fails after writing
/// its pids.json).
#[test]
fn kv_events_live_stops_leftover_and_own_clusters() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let out = dir.path().join("out");
    let leftover = out.join("shadow/run");
    std::fs::create_dir_all(&leftover).unwrap();
    std::fs::write(leftover.join("pids.json"), "{}").unwrap();
    let gorgo = stub(dir.path());
    let out_arg = out.display().to_string();
    let mut cmd = Command::new("bash");
    cmd.arg(root().join("scripts/kv-events-live.sh"))
        .arg(&out_arg)
        .env("GORGO_BIN", &gorgo)
        .env("STUB_LOG", &log)
        .env("STUB_UP_FAILS", "events/run");
    let run = cmd.output().unwrap();
    assert!(!run.status.success(), "the second `gorgo up` failed");
    let calls: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    let found = |run_dir: &Path| format!("down found pids.json in {}", run_dir.display());
    let first_up = calls.iter().position(|l| l.starts_with("up")).unwrap();
    assert!(
        calls[..first_up].contains(&found(&leftover)),
        "the leftover cluster was not stopped before its run dir went: {calls:?}"
    );
    let events = out.join("events/run");
    let failed_up = calls
        .iter()
        .position(|l| l.starts_with("up") && l.contains("events/run"))
        .unwrap();
    assert!(
        calls[failed_up..].contains(&found(&events)),
        "the script's own cluster was left running: {calls:?}"
    );
}
