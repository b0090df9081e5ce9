//! `gorgo up --detach` / `gorgo down` end to end: the real binary starts a
//! three-region LAN cluster (relays, engine emulators, nodes), every region
//! serves a streaming chat request through its client relay, every node sees
//! its two peers, and `gorgo down` leaves no process behind.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const GORGO: &str = env!("CARGO_BIN_EXE_gorgo");
/// How long the cluster may take to form (debug build, 2 busy cores).
const FORM_TIMEOUT: Duration = Duration::from_secs(60);

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn gorgo(args: &[&str]) -> Output {
    Command::new(GORGO)
        .args(args)
        .current_dir(root())
        .output()
        .expect("running gorgo")
}

/// Runs `gorgo down` however the test ends.
struct Down<'a>(&'a Path);

impl Drop for Down<'_> {
    fn drop(&mut self) {
        let _ = gorgo(&["down", "--run-dir", &self.0.display().to_string()]);
    }
}

fn pid_alive(pid: u64) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

#[test]
fn down_without_a_cluster_is_a_no_op_and_bad_topologies_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = gorgo(&["down", "--run-dir", &dir.path().display().to_string()]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("nothing running"));

    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[[regions]]\nname = \"a\"\nclient_delay_ms = -1\n").unwrap();
    let out = gorgo(&[
        "up",
        "--topology",
        &bad.display().to_string(),
        "--run-dir",
        &dir.path().display().to_string(),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("regions[0].client_delay_ms"), "{err}");

    // A start outside the tuning bounds names the flag and the weight, and a trial
    // design that does not exist names the flag and the designs, before anything is
    // started.
    let err = up_refused(dir.path(), &["--tuning-start", "9,0.5"]);
    assert!(
        err.contains("--tuning-start 9,0.5") && err.contains("w_rtt"),
        "{err}"
    );
    let err = up_refused(dir.path(), &["--tuning-trial", "alternate"]);
    assert!(
        err.contains("--tuning-trial") && err.contains("switchback"),
        "{err}"
    );
    // A zero window names the flag, not the config field it becomes.
    let err = up_refused(dir.path(), &["--tuning-window", "0"]);
    assert!(err.contains("--tuning-window"), "{err}");
    // A timeout past what a deadline can hold is a flag error, not an overflow panic.
    let err = up_refused(dir.path(), &["--ready-timeout-s", &u64::MAX.to_string()]);
    assert!(
        err.contains("--ready-timeout-s") && !err.contains("panicked"),
        "{err}"
    );
    // Something already listening on one of the cluster's addresses (a cluster left
    // behind would answer the new one's readiness checks): refused, naming it.
    let taken = std::net::TcpListener::bind("127.0.0.77:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    // The netem control API is at base + 6 of region 0's address.
    let base = (port - 6).to_string();
    let err = up_refused(dir.path(), &["--ip-base", "77", "--base-port", &base]);
    assert!(
        err.contains(&format!("127.0.0.77:{port}")) && err.contains("is taken"),
        "{err}"
    );
}

/// Flags that cannot work are refused before anything starts, naming the flag: a netem
/// control API off loopback (it takes no token: `0.0.0.0` opened the partition API to
/// the network), and a readiness timeout of 0 s (`up` and `restart` then always failed,
/// "not ready after 0 s", the restarted process left running).
#[test]
fn flags_that_cannot_work_are_refused_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let topology = root().join("configs/topologies/three-region.toml");
    let topology = topology.to_str().unwrap();
    // `--plan` exits before binding anything: the flag is checked first all the same.
    for control in ["0.0.0.0:27999", "[::]:27999", "192.0.2.1:27999"] {
        let out = gorgo(&[
            "netem",
            "--topology",
            topology,
            "--control",
            control,
            "--plan",
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && err.contains(&format!("--control {control}"))
                && err.contains("loopback"),
            "{control}: {err}"
        );
    }
    for control in ["127.0.0.9:27999", "[::1]:27999"] {
        let out = gorgo(&[
            "netem",
            "--topology",
            topology,
            "--control",
            control,
            "--plan",
        ]);
        assert!(
            out.status.success(),
            "{control}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let run = dir.path().display().to_string();
    let out = gorgo(&[
        "restart",
        "--run-dir",
        &run,
        "netem",
        "--ready-timeout-s",
        "0",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--ready-timeout-s"),
        "{err}"
    );
    let err = up_refused(dir.path(), &["--ready-timeout-s", "0"]);
    assert!(err.contains("--ready-timeout-s"), "{err}");
}

/// `gorgo bench` against a cluster that answers nothing: every request fails, and the
/// exit status says so (it was 0, with "1 requests failed"); the report is written.
#[test]
fn a_bench_whose_every_request_failed_exits_non_zero() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("one.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 100, \"output_length\": 10, \"hash_ids\": [0]}\n",
    )
    .unwrap();
    let out_dir = dir.path().join("bench");
    let out = gorgo(&[
        "bench",
        "--trace",
        &trace.display().to_string(),
        // Nothing listens on port 1.
        "--cluster",
        "us-ashburn=http://127.0.0.1:1",
        "--no-progress",
        "--out",
        &out_dir.display().to_string(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("every request failed (1 of 1"),
        "{err}"
    );
    assert!(out_dir.join("requests.csv").exists());
}

/// A node or region named `ca` would get certificate files named like the cluster
/// CA's and overwrite them (the nodes then fail their handshakes with `UnknownIssuer`):
/// `gorgo certs` and `gorgo up` refuse it, naming it, and keep the CA whole.
#[test]
fn a_node_or_region_named_ca_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    let certs_arg = certs.display().to_string();
    let out = gorgo(&["certs", "--out", &certs_arg, "--nodes", "us"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ca = std::fs::read(certs.join("ca.pem")).unwrap();
    let ca_key = std::fs::read(certs.join("ca.key")).unwrap();
    for nodes in ["ca,eu", "eu,eu"] {
        let out = gorgo(&["certs", "--out", &certs_arg, "--nodes", nodes]);
        assert!(!out.status.success(), "{nodes}");
        let err = String::from_utf8_lossy(&out.stderr);
        let id = nodes.split(',').next().unwrap();
        assert!(err.contains(&format!("`{id}`")), "{nodes}: {err}");
    }
    assert_eq!(std::fs::read(certs.join("ca.pem")).unwrap(), ca);
    assert_eq!(std::fs::read(certs.join("ca.key")).unwrap(), ca_key);
    assert!(!certs.join("eu.pem").exists());

    // A topology with a region `ca`: refused before anything starts.
    let topology = dir.path().join("ca.toml");
    std::fs::write(
        &topology,
        "[[regions]]\nname = \"ca\"\nclient_delay_ms = 1.0\n\n\
         [[regions]]\nname = \"us\"\nclient_delay_ms = 1.0\n\n\
         [one_way_ms]\nca = { us = 1.0 }\n",
    )
    .unwrap();
    let run_dir = dir.path().join("run");
    let run = run_dir.display().to_string();
    let out = gorgo(&[
        "up",
        "--topology",
        &topology.display().to_string(),
        "--run-dir",
        &run,
        "--ip-base",
        "78",
        "--base-port",
        "26900",
        "--ready-timeout-s",
        "20",
    ]);
    let _down = Down(&run_dir);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("`ca`"), "{err}");
    assert!(!run_dir.join("pids.json").exists(), "nothing started");
}

/// A process of this test, in a process group of its own (as a cluster's first child
/// is), killed however the test ends.
struct Bystander(std::process::Child);

impl Bystander {
    fn start() -> Self {
        use std::os::unix::process::CommandExt;
        Bystander(
            Command::new("sleep")
                .arg("300")
                .process_group(0)
                .spawn()
                .unwrap(),
        )
    }
}

impl Drop for Bystander {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A stale `pids.json` (a reboot, a `gorgo up` that was SIGKILLed) names pids that
/// other processes may have by now: `gorgo down` leaves such a process alone, naming
/// it, and `gorgo up` does not take it for a cluster already running. So when the
/// recorded arguments are that process's own (`sleep 300` recorded with `300`): its
/// program is not gorgo (before, only the arguments were compared, and it was killed).
#[test]
fn a_stale_pids_file_never_signals_another_process() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("stale");
    let run = run_dir.display().to_string();
    std::fs::create_dir_all(&run_dir).unwrap();
    let mut other = Bystander::start();
    let pid = other.0.id();
    let pids = serde_json::json!({
        "pgid": pid,
        "processes": [
            {"name": "netem", "pid": pid, "args": ["netem", "--topology", "t.toml"]},
            {"name": "node-a", "pid": pid, "args": ["node", "--config", "node-a.toml"]},
            {"name": "engine-x", "pid": pid, "args": ["300"]},
            {"name": "engine-y", "pid": pid, "args": ["300"], "exe": GORGO},
        ],
    });
    std::fs::write(run_dir.join("pids.json"), pids.to_string()).unwrap();

    // Not "already running": `gorgo up` goes on, to the next check (an address taken
    // here, so that it stops before starting anything).
    let taken = std::net::TcpListener::bind("127.0.0.79:0").unwrap();
    let base = (taken.local_addr().unwrap().port() - 6).to_string();
    let topology = root().join("configs/topologies/three-region.toml");
    let out = gorgo(&[
        "up",
        "--topology",
        topology.to_str().unwrap(),
        "--run-dir",
        &run,
        "--ip-base",
        "79",
        "--base-port",
        &base,
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("is taken") && !err.contains("already running"),
        "{err}"
    );

    let out = gorgo(&["down", "--run-dir", &run]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("pid {pid}")) && err.contains("left alone"),
        "{err}"
    );
    assert!(
        other.0.try_wait().unwrap().is_none(),
        "gorgo down signalled a process that was not the one recorded"
    );
    assert!(!run_dir.join("pids.json").exists());
}

/// `pids.json` is read with a cap (16 MiB), by `gorgo up`, `down` and `restart`: one
/// that is valid JSON but one byte over it is refused naming the file and the cap
/// (before, a run dir's `pids.json` linked to `/dev/zero` grew memory without end).
#[test]
fn a_pids_file_over_the_cap_is_refused_naming_it() {
    const CAP: usize = 16 << 20;
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("big");
    let run = run_dir.display().to_string();
    std::fs::create_dir_all(&run_dir).unwrap();
    let pids = r#"{"pgid": 0, "processes": [{"name": "engine-x", "pid": 0, "args": ["x"]}]}"#;
    let pids_path = run_dir.join("pids.json");
    std::fs::write(
        &pids_path,
        format!("{pids}{}", " ".repeat(CAP + 1 - pids.len())),
    )
    .unwrap();
    // Should `gorgo up` read past the file, an address taken here stops it before it
    // starts anything.
    let taken = std::net::TcpListener::bind("127.0.0.85:0").unwrap();
    let base = (taken.local_addr().unwrap().port() - 6).to_string();
    let topology = root().join("configs/topologies/three-region.toml");
    let up = [
        "up",
        "--topology",
        topology.to_str().unwrap(),
        "--run-dir",
        &run,
        "--ip-base",
        "85",
        "--base-port",
        &base,
    ];
    for args in [
        &up[..],
        &["down", "--run-dir", &run][..],
        &["restart", "--run-dir", &run, "engine-x"][..],
    ] {
        let out = gorgo(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && err.contains(&pids_path.display().to_string())
                && err.contains(&format!("larger than {CAP} bytes")),
            "{}: {err}",
            args[0]
        );
    }
}

/// `gorgo restart` of a process whose cluster is gone starts it in a group of its own
/// and records that group: the recorded group id, which may be another job's by now,
/// is neither joined nor, by the `gorgo down` after, killed. Before, the restarted
/// process joined it, and `gorgo down` killed the stranger with it.
#[test]
fn a_restart_never_joins_a_strangers_group() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("restart");
    let run = run_dir.display().to_string();
    std::fs::create_dir_all(run_dir.join("logs")).unwrap();
    let mut stranger = Bystander::start();
    let gone = {
        let mut c = Command::new("true").spawn().unwrap();
        c.wait().unwrap();
        c.id()
    };
    let free = std::net::TcpListener::bind("127.0.0.81:0").unwrap();
    let listen = free.local_addr().unwrap().to_string();
    drop(free);
    let pids = serde_json::json!({
        "pgid": stranger.0.id(),
        "processes": [{"name": "engine-x", "pid": gone, "args": [
            "engine", "--profile", "paper-a100-mistral7b", "--listen", listen, "--model", "m",
        ]}],
    });
    std::fs::write(run_dir.join("pids.json"), pids.to_string()).unwrap();
    let out = gorgo(&["restart", "--run-dir", &run, "engine-x"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = gorgo(&["down", "--run-dir", &run]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stranger.0.try_wait().unwrap().is_none(),
        "the stranger in the recorded group was killed"
    );
}

/// Ctrl-C (SIGINT) while `gorgo up` waits for its nodes to be ready stops every child
/// it has started (they are in a process group of their own: the terminal's Ctrl-C
/// reaches `gorgo up` alone).
#[test]
fn an_interrupted_up_stops_every_child_it_started() {
    // Ctrl-C, and the hangup of a closed terminal or a dropped SSH session (which
    // killed `gorgo up` and left its children running).
    for signal in ["-INT", "-HUP"] {
        interrupted_up_stops_every_child(signal);
    }
}

fn interrupted_up_stops_every_child(signal: &str) {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let run = run_dir.display().to_string();
    let _down = Down(&run_dir);
    // One region's engine never answers, so its node is never ready: the signal comes
    // while `gorgo up` is still starting, however fast the machine.
    let mut up = Command::new(GORGO)
        .args([
            "up",
            "--topology",
            "configs/topologies/lan.toml",
            "--run-dir",
            &run,
            "--ip-base",
            "173",
            "--base-port",
            "26560",
            "--ready-timeout-s",
            "600",
            "--engine-url",
            "us-ashburn=http://127.0.0.1:9",
        ])
        .current_dir(root())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Every child started: netem, two emulators and three nodes.
    let deadline = Instant::now() + FORM_TIMEOUT;
    let pids = loop {
        let pids = std::fs::read(run_dir.join("pids.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
        if let Some(p) = pids.filter(|p| p["processes"].as_array().map(Vec::len) == Some(6)) {
            break p;
        }
        assert!(up.try_wait().unwrap().is_none(), "gorgo up ended early");
        assert!(
            Instant::now() < deadline,
            "gorgo up never started its children"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!run_dir.join("cluster.json").exists(), "still starting");
    let status = Command::new("kill")
        .args([signal, &up.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = up.wait_with_output().unwrap();
    assert!(!out.status.success(), "an interrupted start is a failure");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("interrupted"), "{err}");
    for p in pids["processes"].as_array().unwrap() {
        let pid = p["pid"].as_u64().unwrap();
        assert!(
            !pid_alive(pid),
            "{} (pid {pid}) outlived gorgo up stopped by {signal}",
            p["name"]
        );
    }
    assert!(!run_dir.join("pids.json").exists());
}

/// `gorgo up` of the three-region topology with `flags`, which must fail before
/// anything starts: its stderr.
fn up_refused(run_dir: &Path, flags: &[&str]) -> String {
    let topology = root().join("configs/topologies/three-region.toml");
    let run = run_dir.display().to_string();
    let mut args = vec!["up", "--topology", topology.to_str().unwrap()];
    args.extend_from_slice(flags);
    args.extend(["--run-dir", &run]);
    let out = gorgo(&args);
    assert!(!out.status.success());
    assert!(!run_dir.join("pids.json").exists());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// GET an admin route with the cluster's token, as JSON.
async fn admin_get(http: &reqwest::Client, url: &str, token: &str) -> serde_json::Value {
    http.get(url)
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_serves_every_region_and_down_stops_everything() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let run = run_dir.display().to_string();
    let _down = Down(&run_dir);
    let out = tokio::task::spawn_blocking({
        let run = run.clone();
        move || {
            gorgo(&[
                "up",
                "--topology",
                "configs/topologies/lan.toml",
                "--run-dir",
                &run,
                "--detach",
                // Away from the defaults so a developer's own cluster is untouched.
                "--ip-base",
                "170",
                "--base-port",
                "26600",
                "--ready-timeout-s",
                "120",
                // The emulators publish KV events and the nodes follow them.
                "--kv-events",
                // Two engines per region: each node fronts both as `[[engines]]`.
                "--replicas",
                "2",
            ])
        }
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "gorgo up failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let cluster: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run_dir.join("cluster.json")).unwrap()).unwrap();
    let token = cluster["admin_token"].as_str().unwrap().to_owned();
    let regions = cluster["regions"].as_array().unwrap();
    assert_eq!(regions.len(), 3);

    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    // Ready means the nodes have met: each lists both others alive with their stats
    // the moment `up` returns, so a replay's first requests route as the rest do.
    for region in regions {
        let url = format!("{}/admin/peers", region["admin_url"].as_str().unwrap());
        let peers = admin_get(&http, &url, &token).await;
        let met = peers.as_array().map_or(0, |p| {
            p.iter()
                .filter(|p| p["alive"] == true && !p["stats"].is_null())
                .count()
        });
        assert_eq!(met, 2, "{url}: {peers}");
    }
    let mut served = std::collections::BTreeSet::new();
    for region in regions {
        let url = format!(
            "{}/v1/chat/completions",
            region["client_url"].as_str().unwrap()
        );
        let body = serde_json::json!({
            "model": "gorgo-emulated",
            // Long enough for full cache blocks, which the KV events publish.
            "messages": [{"role": "user", "content": format!("hello from {} ", region["name"]).repeat(30)}],
            "max_tokens": 4,
            "stream": true,
        });
        let response = http.post(&url).json(&body).send().await.unwrap();
        assert_eq!(response.status(), 200, "{url}");
        served.insert(
            response.headers()["x-gorgo-served-by"]
                .to_str()
                .unwrap()
                .to_owned(),
        );
        let text = response.text().await.unwrap();
        assert!(
            text.contains("data:") && text.contains("[DONE]"),
            "{url}: {text}"
        );
    }

    // The prefix index of the engine that served follows that engine's KV events once
    // they flow (an engine that served nothing hears none).
    assert!(!served.is_empty());
    for region in regions
        .iter()
        .filter(|r| served.contains(r["name"].as_str().unwrap()))
    {
        let url = format!("{}/admin/state", region["admin_url"].as_str().unwrap());
        let deadline = Instant::now() + FORM_TIMEOUT;
        loop {
            let state = admin_get(&http, &url, &token).await;
            let engines = state["engines"].as_array().cloned().unwrap_or_default();
            assert_eq!(engines.len(), 2, "{url}: {state}");
            // The engine that served: its stream has brought batches, and its index
            // follows them.
            if engines.iter().any(|e| {
                e["prefix_index_source"] == "events"
                    && e["kv_events"]["counters"]["batches"].as_u64() > Some(0)
            }) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{url}: no engine's index followed its events: {engines:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    // Membership forms over the relays: each node lists both peers, alive.
    for region in regions {
        let url = format!("{}/admin/peers", region["admin_url"].as_str().unwrap());
        let deadline = Instant::now() + FORM_TIMEOUT;
        loop {
            let peers = admin_get(&http, &url, &token).await;
            // Alive, and both of each peer's engines heard of (their stats gossiped).
            let alive = peers
                .as_array()
                .map(|p| {
                    p.iter()
                        .filter(|p| {
                            p["alive"] == true && p["engines"].as_array().map(Vec::len) == Some(2)
                        })
                        .count()
                })
                .unwrap_or(0);
            if alive == 2 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{url}: peers never formed: {peers}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    // `gorgo bench --policy P` against nodes that ignore the policy header (this
    // cluster was started without --allow-policy-header) is refused before anything is
    // sent: its results would be their own policy's under P's name.
    let trace = dir.path().join("two.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 4, \"hash_ids\": [1, 2]}\n\
         {\"timestamp\": 10, \"input_length\": 600, \"output_length\": 4, \"hash_ids\": [1, 3]}\n",
    )
    .unwrap();
    let bench_out = dir.path().join("bench");
    let out = tokio::task::spawn_blocking({
        let (run, trace, bench_out) = (run.clone(), trace.clone(), bench_out.clone());
        move || {
            gorgo(&[
                "bench",
                "--trace",
                trace.to_str().unwrap(),
                "--cluster",
                &run,
                "--policy",
                "round-robin",
                "--no-progress",
                "--out",
                bench_out.to_str().unwrap(),
            ])
        }
    })
    .await
    .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--policy round-robin")
            && err.contains("`gorgo`")
            && err.contains("--allow-policy-header"),
        "{err}"
    );
    assert!(!bench_out.join("results.json").exists());

    // `gorgo restart netem` returns once the new relays serve (their control API
    // answers): it reported a netem that failed to bind as restarted.
    let out = gorgo(&["restart", "--run-dir", &run, "netem"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pids: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run_dir.join("pids.json")).unwrap()).unwrap();
    let netem_pid = pids["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "netem")
        .and_then(|p| p["pid"].as_u64())
        .unwrap();
    assert!(pid_alive(netem_pid));

    // `gorgo down` stops the nodes first and lets them drain: a stream in flight when
    // it starts finishes whole, on an engine and relays that are still up.
    let region = &regions[0];
    let url = format!(
        "{}/v1/chat/completions",
        region["client_url"].as_str().unwrap()
    );
    let body = serde_json::json!({
        "model": "gorgo-emulated",
        "messages": [{"role": "user", "content": "a long answer, please"}],
        // About 5 s of decode on the emulator: down starts well before the end.
        "max_tokens": 500,
        "ignore_eos": true,
        "stream": true,
    });
    let mut response = http.post(&url).json(&body).send().await.unwrap();
    assert_eq!(response.status(), 200, "{url}");
    let mut text = String::from_utf8(response.chunk().await.unwrap().unwrap().to_vec()).unwrap();
    let down = tokio::task::spawn_blocking(move || gorgo(&["down", "--run-dir", &run]));
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => text.push_str(&String::from_utf8_lossy(&chunk)),
            Ok(None) => break,
            Err(e) => panic!("the stream was cut by gorgo down: {e}; so far: {text}"),
        }
    }
    assert!(text.contains("[DONE]"), "{text}");
    let out = down.await.unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for p in pids["processes"].as_array().unwrap() {
        let pid = p["pid"].as_u64().unwrap();
        assert!(
            !pid_alive(pid),
            "{} (pid {pid}) survived gorgo down",
            p["name"]
        );
    }
    assert!(!run_dir.join("pids.json").exists());
}

/// `gorgo compare` killed (SIGTERM: a `kill`, a CI job's timeout) in the middle of its
/// replay stops the replay and tears its clusters down: no engine, node or relay it
/// started outlives it.
#[test]
fn a_terminated_compare_tears_its_clusters_down() {
    let dir = tempfile::tempdir().unwrap();
    // A minute of small requests: the replay is still going when the signal comes.
    let trace = dir.path().join("trace.jsonl");
    let rows: Vec<String> = (0..60)
        .map(|i| {
            format!(
                r#"{{"timestamp": {}, "input_length": 600, "output_length": 16, "hash_ids": [{}, {}]}}"#,
                i * 1000,
                i % 3,
                100 + i
            )
        })
        .collect();
    std::fs::write(&trace, rows.join("\n") + "\n").unwrap();
    let out = dir.path().join("out");
    let mut compare = Command::new(GORGO)
        .args([
            "compare",
            "--trace",
            &trace.display().to_string(),
            "--topology",
            "configs/topologies/lan.toml",
            "--policies",
            "gorgo",
            "--base-port",
            "26800",
            "--no-progress",
            "--out",
            &out.display().to_string(),
        ])
        .current_dir(root())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let run_dir = out.join("gorgo").join("run");
    let _down = Down(&run_dir);
    // The cluster is up once its cluster.json is written; its processes are in pids.json.
    let deadline = Instant::now() + FORM_TIMEOUT * 2;
    let pids = loop {
        let ready = run_dir.join("cluster.json").exists();
        if let (true, Ok(bytes)) = (ready, std::fs::read(run_dir.join("pids.json"))) {
            break serde_json::from_slice::<serde_json::Value>(&bytes).unwrap();
        }
        assert!(
            compare.try_wait().unwrap().is_none(),
            "compare ended before its cluster was up"
        );
        assert!(Instant::now() < deadline, "the cluster never came up");
        std::thread::sleep(Duration::from_millis(100));
    };
    let status = Command::new("kill")
        .args(["-TERM", &compare.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + FORM_TIMEOUT;
    let exit = loop {
        if let Some(exit) = compare.try_wait().unwrap() {
            break exit;
        }
        assert!(Instant::now() < deadline, "compare did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!exit.success(), "an interrupted compare exits non-zero");
    for p in pids["processes"].as_array().unwrap() {
        let pid = p["pid"].as_u64().unwrap();
        assert!(
            !pid_alive(pid),
            "{} (pid {pid}) outlived the terminated compare",
            p["name"]
        );
    }
}
