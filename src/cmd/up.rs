//! `gorgo up` / `gorgo down`: a whole local multi-region cluster as child
//! processes of this binary: one `gorgo netem` (every WAN relay of the
//! topology), and per region a `gorgo engine` emulator and a `gorgo node`,
//! all on the loopback plan of `gorgo_netem::plan_cluster`.
//!
//! All children share one process group whose id, with every pid and the
//! arguments it was started with, is written to `<run-dir>/pids.json`. Stopping
//! goes in order (`stop_in_order`): the nodes first (SIGTERM: each drains, and its
//! requests in flight finish on engines and relays that are still up), then the
//! engines and the relays, each step SIGKILLing what is left after its grace.
//! `gorgo down` signals only a pid whose command line is still the one recorded.
//! `<run-dir>/cluster.json` tells clients (and `gorgo bench`) where each region is.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use gorgo_bench::{ClusterInfo, RegionEndpoint};
use gorgo_core::policy::PolicyKind;
use gorgo_core::NodeId;
use gorgo_netem::{plan_cluster, ClusterPlan, PlanOptions, Topology};
use gorgo_node::config::{
    AdminSection, ClusterSection, EngineKind, EngineSection, LimitsSection, ListenSection,
    NodeSection, RoutingSection, TlsSection, TuningMode, TuningSection,
};
use gorgo_node::{NodeConfig, ValidatedConfig};
use serde::{Deserialize, Serialize};

/// How long stopping waits for SIGTERM to stop the engines and relays before SIGKILL
/// (and a node, on `gorgo restart`, four times this).
const STOP_GRACE: Duration = Duration::from_secs(10);
/// How long past its drain deadline (`limits.drain_timeout_ms`, 30 s unless its config
/// says otherwise) a stopped node may take to exit before SIGKILL: after draining,
/// `gorgo node` waits up to 5 s to leave the cluster and 10 s for its tasks.
const NODE_EXIT_MARGIN: Duration = Duration::from_secs(15);
/// The longest wait for the nodes to stop, whatever their drain deadline: with
/// `STOP_GRACE` after it, `gorgo down` takes at most 70 s.
const NODE_STOP_MAX: Duration = Duration::from_secs(60);
/// How often readiness and child liveness are polled while starting.
const POLL_EVERY: Duration = Duration::from_millis(200);

/// Arguments of `gorgo up`.
#[derive(clap::Args, Debug)]
pub struct UpArgs {
    /// Topology file (configs/topologies/*.toml).
    #[arg(long, default_value = "configs/topologies/three-region.toml")]
    pub topology: PathBuf,
    /// Routing policy of every node (`gorgo`, `gorgo-paper`, `least-load`, ...).
    #[arg(long, default_value = "gorgo")]
    pub policy: String,
    /// Let clients pick the policy per request (`x-gorgo-policy`; `gorgo bench
    /// --policy`); off by default, as in a node's config.
    #[arg(long)]
    pub allow_policy_header: bool,
    /// Decisions each node keeps for `/admin/decisions` (`routing.decision_log`; the
    /// node's default when unset): enough for a whole replay lets it be set beside
    /// `gorgo sim --decisions N`.
    #[arg(long)]
    pub decision_log: Option<usize>,
    /// Engine emulator profile (a built-in name or a profile file).
    #[arg(long, default_value = "paper-a100-mistral7b")]
    pub engine_profile: String,
    /// Engine emulators per region (replicas of the model), 1..=16: each node fronts
    /// all of its region's as `[[engines]]` (docs/design.md, "Replicas"). Emulated
    /// regions only.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16))]
    pub replicas: u16,
    /// Use these engines instead of emulators: `region=url,...`.
    #[arg(long, value_delimiter = ',')]
    pub engine_url: Vec<String>,
    /// Kind of the engines given with `--engine-url` (`sglang`, `vllm`, `openai`).
    #[arg(long, default_value = "sglang")]
    pub engine_kind: String,
    /// Health check path of the engines given with `--engine-url` (the node's default:
    /// `/health`, or `/v1/models` for kind `openai`).
    #[arg(long)]
    pub engine_health_path: Option<String>,
    /// KV capacity in tokens of the engines given with `--engine-url`, for engines whose
    /// `/metrics` cannot tell (kind `openai`): bounds each node's model of its engine's cache.
    #[arg(long)]
    pub engine_kv_tokens: Option<u64>,
    /// How many requests each engine runs at once (1 for llama-cpp-python's server):
    /// each node's `engine.max_running_requests`, for `--engine-url` engines and
    /// emulators alike. Not needed where the engine reports it (SGLang, llama.cpp's
    /// server, the emulators: their profile's `max_running_requests`).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub engine_max_running: Option<u32>,
    /// Seed of each node's fitted prefill cost per uncached token (ms) for the engines
    /// given with `--engine-url`: a calibration of that engine (default: the paper's A100).
    #[arg(long)]
    pub engine_t_p_ms: Option<f64>,
    /// Seed of each node's fitted fixed TTFT cost (ms) for the engines given with `--engine-url`.
    #[arg(long)]
    pub engine_base_ms: Option<f64>,
    /// Seed of the cost of one decode step (ms) for the engines given with `--engine-url`.
    #[arg(long)]
    pub engine_decode_step_ms: Option<f64>,
    /// The model's HF `tokenizer.json`: every node counts prompt tokens with it
    /// (`engine.tokenizer`), and so do the emulators.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// The chat template for `--tokenizer` (default: `tokenizer_config.json`'s).
    #[arg(long, requires = "tokenizer")]
    pub chat_template: Option<PathBuf>,
    /// The engines add BOS to rendered chat prompts (`engine.chat_add_special_tokens`;
    /// llama-cpp-python's built-in chat formats do).
    #[arg(long, requires = "tokenizer")]
    pub chat_add_special_tokens: bool,
    /// Directory for logs, generated configs, certificates, pids and cluster.json.
    #[arg(long, default_value = ".gorgo/run")]
    pub run_dir: PathBuf,
    /// Return once every node is ready, leaving the cluster running (`gorgo down` stops it).
    #[arg(long)]
    pub detach: bool,
    /// First port of each region's block of ports (clusters side by side need distinct ones).
    #[arg(long, default_value_t = PlanOptions::default().base_port)]
    pub base_port: u16,
    /// Last octet N of region 0's loopback address, 127.0.0.N (region i gets N + i).
    #[arg(long, default_value_t = PlanOptions::default().ip_base)]
    pub ip_base: u8,
    /// Seed of the relays' loss and jitter draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Tuning mode of every node: `static`, `online` or `tune-then-freeze`.
    #[arg(long, default_value = "static")]
    pub tuning: String,
    /// Tuning trial window, requests cluster-wide (default: the node's, 128).
    #[arg(long)]
    pub tuning_window: Option<u32>,
    /// Time cap of a quiet tuning window, ms (default: the node's, 60000); 1 ms to a
    /// week, as the node's `tuning.window_max_ms` (refused here, before anything starts).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=gorgo_node::config::MAX_TIMEOUT_MS))]
    pub tuning_window_ms: Option<u64>,
    /// Fewest samples a capped window is scored on (default: the node's, 32, at most the
    /// window).
    #[arg(long)]
    pub tuning_min_samples: Option<u32>,
    /// Weights `W_RTT,W_QUEUE` every node routes with and tuning starts from (default:
    /// the policy's own): e.g. `2.0,0.05`, the bad start of docs/tuning.md.
    #[arg(long, value_parser = crate::cmd::sim::parse_weights)]
    pub tuning_start: Option<gorgo_core::Weights>,
    /// Tuning trial design: `interleaved` (the default), `switchback` or `sequential`
    /// (docs/tuning.md).
    #[arg(long, value_parser = crate::cmd::sim::parse_trial)]
    pub tuning_trial: Option<gorgo_core::es::TrialDesign>,
    /// Give up if the nodes are not all ready after this many seconds (at least 1).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub ready_timeout_s: u64,
    /// Each region's emulator publishes its cache's KV events (on its address, ports
    /// base + 7 and base + 8 for replay) and its node's prefix index follows them
    /// (`engine.kv_events`, docs/kv-events.md). Emulated regions only.
    #[arg(long)]
    pub kv_events: bool,
}

/// Ports of an emulator's KV-event publisher and replay endpoints above its own port.
const KV_EVENT_PORTS: [u16; 2] = [4, 5];

/// The KV-event publisher and replay endpoints of the emulator at `engine`: the
/// region's address, the two ports after its block's (base + 7, base + 8).
fn kv_event_endpoints(engine: std::net::SocketAddr) -> anyhow::Result<(String, String)> {
    let port = |offset: u16| {
        engine
            .port()
            .checked_add(offset)
            .with_context(|| format!("--kv-events: no port {offset} above {engine}"))
    };
    let [publish, replay] = KV_EVENT_PORTS;
    Ok((
        format!("tcp://{}:{}", engine.ip(), port(publish)?),
        format!("tcp://{}:{}", engine.ip(), port(replay)?),
    ))
}

/// How far above the plan's engine port (base + 3) engine emulator `replica` listens:
/// 0 for replica 0, base + 10 + 6 (k - 1) for replica k (6 ports a replica, room for
/// its two KV-event ports).
fn replica_port_offset(replica: u16) -> u32 {
    match replica {
        0 => 0,
        k => 7 + 6 * (u32::from(k) - 1),
    }
}

/// The address of region engine emulator `replica`: replica 0 at the plan's engine
/// address, replica k on the region's address at 6 ports a replica above the region's
/// block (base + 10, 16, ...: each with its two KV-event ports, `kv_event_endpoints`).
fn replica_engine_addr(engine: SocketAddr, replica: u16) -> anyhow::Result<SocketAddr> {
    let port = u16::try_from(u32::from(engine.port()) + replica_port_offset(replica))
        .ok()
        .with_context(|| format!("--replicas: no port for replica {replica} above {engine}"))?;
    Ok(SocketAddr::new(engine.ip(), port))
}

/// How many ports from its `--base-port` one cluster takes on each region's address,
/// with `replicas` engines a region and KV events or not: what clusters side by side
/// (`gorgo compare --port-stride`) must keep apart. The plan's block runs from base to
/// netem's control API at base + 6, its engine at base + 3
/// (crates/gorgo-netem/src/plan.rs); the replicas' engines and KV-event ports lie
/// above it.
pub fn cluster_port_span(replicas: u16, kv_events: bool) -> u32 {
    const PLAN_BLOCK: u32 = 7;
    const PLAN_ENGINE: u32 = 3;
    let last_engine = PLAN_ENGINE + replica_port_offset(replicas.saturating_sub(1));
    let top = if kv_events {
        last_engine + u32::from(KV_EVENT_PORTS[1])
    } else {
        last_engine
    };
    PLAN_BLOCK.max(top + 1)
}

/// Arguments of `gorgo down`.
#[derive(clap::Args, Debug)]
pub struct DownArgs {
    /// The run directory `gorgo up` used.
    #[arg(long, default_value = ".gorgo/run")]
    pub run_dir: PathBuf,
}

/// `pids.json`: what `gorgo down` stops.
#[derive(Debug, Serialize, Deserialize)]
struct PidsFile {
    /// Process group of every child.
    pgid: u32,
    processes: Vec<PidEntry>,
}

/// One process of `pids.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PidEntry {
    name: String,
    pid: u32,
    /// The arguments it was started with (`gorgo restart` starts it again with them,
    /// and they tell whether the pid is still that process: [`PidEntry::is_running`]).
    #[serde(default)]
    args: Vec<String>,
    /// The gorgo binary it runs (the one that started it), which
    /// [`PidEntry::is_running`] checks too: arguments alone can be another program's.
    /// Absent from the files of an older `gorgo up`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    exe: Option<PathBuf>,
}

impl PidEntry {
    /// Whether the process recorded here still runs: its pid is alive, its program is
    /// gorgo ([`PidEntry::runs_gorgo`]) and its arguments are the recorded ones. A
    /// stale `pids.json` (after a reboot, or a `gorgo up` that was SIGKILLed) can name
    /// pids that other processes have by now: those must be neither signalled nor
    /// taken for a running cluster. An entry without arguments (an older `gorgo up`)
    /// cannot be checked: not running.
    fn is_running(&self) -> bool {
        if self.args.is_empty() || !pid_alive(self.pid) || !self.runs_gorgo() {
            return false;
        }
        let Ok(cmdline) = std::fs::read(format!("/proc/{}/cmdline", self.pid)) else {
            return false;
        };
        // NUL-separated, with a trailing NUL: the program, then its arguments.
        let mut words = cmdline.split(|&b| b == 0);
        if cmdline.last() == Some(&0) {
            words.next_back();
        }
        words.next();
        words.eq(self.args.iter().map(String::as_bytes))
    }

    /// Whether the pid's program (`/proc/<pid>/exe`) is the recorded gorgo binary or,
    /// for an entry that records none (an older `gorgo up`), a file named `gorgo`.
    /// A binary replaced since the process started (a rebuild) reads `<path>
    /// (deleted)` there, and still counts; a program that cannot be read (another
    /// user's process) does not.
    fn runs_gorgo(&self) -> bool {
        let Ok(exe) = std::fs::read_link(format!("/proc/{}/exe", self.pid)) else {
            return false;
        };
        let exe = match exe.to_str().and_then(|e| e.strip_suffix(" (deleted)")) {
            Some(path) => PathBuf::from(path),
            None => exe,
        };
        match &self.exe {
            Some(recorded) => exe == *recorded,
            None => exe.file_name() == Some("gorgo".as_ref()),
        }
    }

    /// Whether the process of this entry was started as a node (`node-<region>`).
    fn is_node(&self) -> bool {
        self.name.starts_with("node-")
    }
}

impl PidsFile {
    /// The entries whose process still runs ([`PidEntry::is_running`]); each other
    /// entry whose pid is alive is named on stderr: that process is left alone.
    fn running(&self, path: &Path) -> Vec<PidEntry> {
        let (running, other): (Vec<&PidEntry>, Vec<&PidEntry>) =
            self.processes.iter().partition(|p| p.is_running());
        for p in other.iter().filter(|p| pid_alive(p.pid)) {
            eprintln!(
                "warning: {}: pid {} ({}) is not the process recorded there any more \
                 (its program or command line differs): left alone",
                path.display(),
                p.pid,
                p.name
            );
        }
        running.into_iter().cloned().collect()
    }

    /// The process group to signal, only while one of `running` is still in it: a
    /// group id outlives no member, so it cannot be another's group then.
    fn group_of(&self, running: &[PidEntry]) -> Option<u32> {
        running
            .iter()
            .any(|p| process_group(p.pid) == Some(self.pgid))
            .then_some(self.pgid)
    }
}

/// Arguments of `gorgo restart`.
#[derive(clap::Args, Debug)]
pub struct RestartArgs {
    /// The run directory `gorgo up` used.
    #[arg(long, default_value = ".gorgo/run")]
    pub run_dir: PathBuf,
    /// What to restart: a region (its node), or a process name from `pids.json`
    /// (`node-<region>`, `engine-<region>`, `netem`).
    pub name: String,
    /// Kill it (SIGKILL, a crash) instead of a graceful stop (SIGTERM: the node
    /// drains first).
    #[arg(long)]
    pub kill: bool,
    /// Give up if a restarted node is not ready (or a restarted engine emulator does
    /// not answer `/health`) after this many seconds (at least 1).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub ready_timeout_s: u64,
}

/// Start `gorgo <args>` (the binary `exe`, this one: `pids.json` records it) as the
/// child `name` with its output in `<run_dir>/logs/<name>.log` (appended to with
/// `append`, as a restart does), in process group `pgid` (a new group led by the child
/// when `None`).
fn spawn_child(
    exe: &Path,
    run_dir: &Path,
    name: &str,
    args: &[String],
    pgid: Option<u32>,
    append: bool,
) -> anyhow::Result<Child> {
    let log_path = run_dir.join("logs").join(format!("{name}.log"));
    let log = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(append)
        .truncate(!append)
        .open(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        // One group for all children: `gorgo down` signals the group, and
        // a terminal's Ctrl-C reaches only `gorgo up`, which stops them in order.
        cmd.process_group(pgid.unwrap_or(0) as i32);
    }
    cmd.spawn()
        .with_context(|| format!("starting {name}: gorgo {}", args.join(" ")))
}

/// Write a file only its owner can read (it holds the admin token).
fn write_secret(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    gorgo_cluster::write_secret(path, bytes).with_context(|| format!("writing {}", path.display()))
}

/// The running children; dropping it (an error while starting, or the end of
/// a foreground run) stops them all.
struct Children {
    /// This gorgo binary, which every child runs (recorded in `pids.json`).
    exe: PathBuf,
    run_dir: PathBuf,
    pgid: Option<u32>,
    children: Vec<(String, Child, Vec<String>)>,
    armed: bool,
    /// Where the children's process group is published for [`Interrupt`]'s second
    /// signal (0 until the first child is started).
    group: Arc<AtomicU32>,
}

impl Children {
    fn spawn(&mut self, name: &str, args: &[String]) -> anyhow::Result<()> {
        let child = spawn_child(&self.exe, &self.run_dir, name, args, self.pgid, false)?;
        let pgid = *self.pgid.get_or_insert(child.id());
        self.group.store(pgid, Ordering::Relaxed);
        self.children.push((name.to_owned(), child, args.to_vec()));
        self.write_pids()
    }

    fn write_pids(&self) -> anyhow::Result<()> {
        let pids = PidsFile {
            pgid: self.pgid.unwrap_or(0),
            processes: self
                .children
                .iter()
                .map(|(name, c, args)| PidEntry {
                    name: name.clone(),
                    pid: c.id(),
                    args: args.clone(),
                    exe: Some(self.exe.clone()),
                })
                .collect(),
        };
        write_pids(&self.run_dir.join("pids.json"), &pids)
    }

    /// The first child that has exited, with its status.
    fn exited(&mut self) -> Option<(String, std::process::ExitStatus)> {
        self.children
            .iter_mut()
            .find_map(|(name, c, _)| match c.try_wait() {
                Ok(Some(status)) => Some((name.clone(), status)),
                _ => None,
            })
    }

    /// Stop every child in order ([`stop_in_order`]) and reap them.
    fn stop(&mut self) {
        // Only children not reaped yet: a reaped child's pid may be another's already.
        let running: Vec<PidEntry> = self
            .children
            .iter_mut()
            .filter_map(|(name, c, args)| {
                matches!(c.try_wait(), Ok(None)).then(|| PidEntry {
                    name: name.clone(),
                    pid: c.id(),
                    args: args.clone(),
                    exe: Some(self.exe.clone()),
                })
            })
            .collect();
        for name in stop_in_order(&running, self.pgid) {
            eprintln!("{name} did not stop on SIGTERM; killed it");
        }
        for (_, child, _) in &mut self.children {
            let _ = child.wait();
        }
        let _ = std::fs::remove_file(self.run_dir.join("pids.json"));
        self.armed = false;
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        if self.armed {
            self.stop();
        }
    }
}

/// Write `pids.json` whole or not at all: `gorgo down` and the next `gorgo up` read it.
fn write_pids(path: &Path, pids: &PidsFile) -> anyhow::Result<()> {
    gorgo_files::write_atomic(path, &serde_json::to_vec_pretty(pids)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// Stop `procs` in order, so that no request in flight is cut: every node first
/// (SIGTERM: it drains, and its requests in flight finish on the engines and relays,
/// still up), waiting up to the longest drain deadline of their configs plus
/// [`NODE_EXIT_MARGIN`], at most [`NODE_STOP_MAX`], then SIGKILL; then the engines
/// and relays (SIGTERM, [`STOP_GRACE`], SIGKILL); last, SIGKILL to the group `pgid`
/// for anything the children left in it. Returns the names that needed SIGKILL.
fn stop_in_order(procs: &[PidEntry], pgid: Option<u32>) -> Vec<String> {
    let (nodes, rest): (Vec<&PidEntry>, Vec<&PidEntry>) = procs.iter().partition(|p| p.is_node());
    let node_wait = nodes
        .iter()
        .map(|p| node_drain_deadline(&p.args) + NODE_EXIT_MARGIN)
        .max()
        .unwrap_or_default()
        .min(NODE_STOP_MAX);
    let mut killed = stop_all(&nodes, node_wait);
    killed.extend(stop_all(&rest, STOP_GRACE));
    if let Some(pgid) = pgid {
        signal_group(pgid, "KILL");
    }
    killed
}

/// The drain deadline of the node started with `args` (`node --config F`): its
/// config's `limits.drain_timeout_ms`, or the default where the config cannot be read.
fn node_drain_deadline(args: &[String]) -> Duration {
    let config = args
        .iter()
        .position(|a| a == "--config")
        .and_then(|i| args.get(i + 1))
        .and_then(|p| NodeConfig::load(Path::new(p)).ok());
    let ms = config.map_or_else(
        || LimitsSection::default().drain_timeout_ms,
        |c| c.limits.drain_timeout_ms,
    );
    Duration::from_millis(ms)
}

/// SIGTERM every one of `procs`, wait up to `grace` for them all to exit, SIGKILL the
/// rest: their names. A `grace` of zero sends no SIGTERM: a kill is a crash (`gorgo
/// restart --kill`), and a SIGTERM milliseconds before it let a node start its drain
/// and tell its peers it was leaving.
fn stop_all(procs: &[&PidEntry], grace: Duration) -> Vec<String> {
    if !grace.is_zero() {
        for p in procs.iter().filter(|p| p.is_running()) {
            signal_pid(p.pid, "TERM");
        }
    }
    // `grace` is bounded by the constants above: no overflow.
    let deadline = Instant::now() + grace;
    // Alive *and still the recorded process*: a pid that exited and was reused while
    // another node drained (up to a minute) belongs to someone else, and is not waited
    // for or killed.
    while procs.iter().any(|p| p.is_running()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut killed = Vec::new();
    for p in procs.iter().filter(|p| p.is_running()) {
        signal_pid(p.pid, "KILL");
        killed.push(p.name.clone());
    }
    killed
}

/// Sends a signal to a process group with the system `kill` (this crate has
/// no unsafe code, hence no raw `kill(2)`).
fn signal_group(pgid: u32, signal: &str) {
    if pgid == 0 {
        return;
    }
    let _ = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg("--")
        .arg(format!("-{pgid}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

fn signal_pid(pid: u32, signal: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// The process group of a live process (`/proc/<pid>/stat`'s fifth field).
fn process_group(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the parenthesised command name: state, ppid, pgrp.
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(2)?.parse().ok()
}

/// Whether a process is alive (a zombie counts as gone).
fn pid_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .map(|(_, rest)| !rest.trim_start().starts_with('Z'))
            .unwrap_or(true),
        Err(_) => false,
    }
}

fn random_token() -> anyhow::Result<String> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("reading /dev/urandom for the admin token")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The `--engine-*-ms` seeds, checked before anything starts as the node checks
/// `engine.t_p_ms`, `base_ms` and `decode_step_ms` (ceilings included): a value the
/// node refuses failed only once the relays and the first engines had started.
fn check_engine_seed_flags(args: &UpArgs) -> anyhow::Result<()> {
    use gorgo_node::config::{MAX_SEED_BASE_MS, MAX_SEED_MS_PER_TOKEN};
    for (flag, value, zero_ok, max) in [
        (
            "--engine-t-p-ms",
            args.engine_t_p_ms,
            false,
            MAX_SEED_MS_PER_TOKEN,
        ),
        (
            "--engine-base-ms",
            args.engine_base_ms,
            true,
            MAX_SEED_BASE_MS,
        ),
        (
            "--engine-decode-step-ms",
            args.engine_decode_step_ms,
            false,
            MAX_SEED_MS_PER_TOKEN,
        ),
    ] {
        if let Some(v) = value {
            if !(v <= max && (v > 0.0 || (zero_ok && v == 0.0))) {
                bail!("{flag} {v}: must be a positive number of milliseconds, at most {max}");
            }
        }
    }
    Ok(())
}

/// `--engine-url` (`region=url,...`, read by the one parser of such lists) into a map,
/// checking every region exists.
fn parse_engine_urls(
    specs: &[String],
    topology: &Topology,
) -> anyhow::Result<BTreeMap<String, String>> {
    let list = specs.join(",");
    if list.split(',').all(|s| s.trim().is_empty()) {
        return Ok(BTreeMap::new());
    }
    let pairs = gorgo_bench::parse_region_urls(&list).context("--engine-url")?;
    let mut urls = BTreeMap::new();
    for (region, url) in pairs {
        topology
            .region_index(&region)
            .with_context(|| format!("--engine-url `{region}={url}`"))?;
        // As the node checks `engine.url`, before any process of the cluster starts.
        if let Err(reason) = gorgo_node::config::check_engine_url(&url) {
            bail!("--engine-url `{region}={url}`: {reason}");
        }
        urls.insert(region, url);
    }
    Ok(urls)
}

/// What a node is told about its engine beyond the URL and kind.
#[derive(Debug, Default, Clone)]
struct EngineExtras {
    health_path: Option<String>,
    kv_capacity_tokens: Option<u64>,
    max_running_requests: Option<u32>,
    /// `/metrics` scraping off (engines with no Prometheus endpoint).
    no_metrics: bool,
    /// Calibrated seeds of the node's prefill fit and decode step, ms.
    t_p_ms: Option<f64>,
    base_ms: Option<f64>,
    decode_step_ms: Option<f64>,
    /// `--tokenizer`, `--chat-template` (absolute) and `--chat-add-special-tokens`.
    tokenizer: Option<PathBuf>,
    chat_template: Option<PathBuf>,
    chat_add_special_tokens: bool,
}

impl EngineExtras {
    /// The extras for an engine of `kind` given with `--engine-url`.
    fn external(args: &UpArgs, kind: EngineKind) -> Self {
        EngineExtras {
            health_path: args.engine_health_path.clone(),
            kv_capacity_tokens: args.engine_kv_tokens,
            no_metrics: kind == EngineKind::Openai,
            t_p_ms: args.engine_t_p_ms,
            base_ms: args.engine_base_ms,
            decode_step_ms: args.engine_decode_step_ms,
            ..EngineExtras::tokens(args)
        }
    }

    /// What an emulator's node gets: the token-counting extras, paths made absolute
    /// (the node's config lives in the run directory), and the concurrency limit.
    fn tokens(args: &UpArgs) -> Self {
        let absolute = |p: &Option<PathBuf>| {
            p.as_ref()
                .map(|p| std::path::absolute(p).unwrap_or_else(|_| p.clone()))
        };
        EngineExtras {
            tokenizer: absolute(&args.tokenizer),
            chat_template: absolute(&args.chat_template),
            chat_add_special_tokens: args.chat_add_special_tokens,
            max_running_requests: args.engine_max_running,
            ..EngineExtras::default()
        }
    }

    /// What an emulator's node gets: [`EngineExtras::tokens`], and its prefill fit
    /// seeded with the emulated profile's own figures, as `gorgo sim` seeds its nodes
    /// (docs/simulator.md, "What a node decides on"). The node's defaults are the
    /// paper's A100 figures, and the fit stays within a factor of 4 of its seed: a
    /// node in front of a faster profile could never learn it.
    fn emulated(args: &UpArgs) -> anyhow::Result<Self> {
        let profile = gorgo_engine::Profile::by_name_or_file(&args.engine_profile)
            .with_context(|| format!("--engine-profile {}", args.engine_profile))?;
        Ok(EngineExtras {
            t_p_ms: Some(profile.t_p_ms_per_token),
            base_ms: Some(profile.idle_ttft_ms(0)),
            ..EngineExtras::tokens(args)
        })
    }

    /// The emulator's arguments that make it count as the nodes do.
    fn emulator_args(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (flag, path) in [
            ("--tokenizer", &self.tokenizer),
            ("--chat-template", &self.chat_template),
        ] {
            if let Some(p) = path {
                out.push(flag.to_owned());
                out.push(p.display().to_string());
            }
        }
        if self.chat_add_special_tokens {
            out.push("--chat-add-special-tokens".to_owned());
        }
        out
    }

    /// `[engine]` for the engine at `url`: what is given here, the node's defaults for
    /// the rest.
    fn engine_section(&self, url: &str, kind: EngineKind) -> EngineSection {
        let mut engine = EngineSection::new(url, kind);
        engine.health_path = self.health_path.clone();
        engine.kv_capacity_tokens = self.kv_capacity_tokens;
        engine.max_running_requests = self.max_running_requests;
        if self.no_metrics {
            engine.metrics_interval_ms = 0;
        }
        if let Some(v) = self.t_p_ms {
            engine.t_p_ms = v;
        }
        if let Some(v) = self.base_ms {
            engine.base_ms = v;
        }
        if let Some(v) = self.decode_step_ms {
            engine.decode_step_ms = v;
        }
        engine.tokenizer = self.tokenizer.clone();
        engine.chat_template = self.chat_template.clone();
        engine.chat_add_special_tokens = self.chat_add_special_tokens;
        engine
    }
}

/// The node config of one region: its listeners from the plan, its QUIC
/// relay as the advertised address, peers' relays as seeds, the shared CA;
/// validated, so a bad flag fails here with the field's name.
fn node_config(
    plan: &ClusterPlan,
    i: usize,
    mut engines: Vec<EngineSection>,
    certs: &Path,
    routing: RoutingSection,
    tuning: TuningSection,
    token: &str,
) -> anyhow::Result<ValidatedConfig> {
    let r = &plan.regions[i];
    let config = NodeConfig {
        node: NodeSection {
            id: r.name.clone(),
            region: r.name.clone(),
        },
        listen: ListenSection {
            http: r.node_http_addr,
            quic: r.node_quic_addr,
            admin: r.admin_addr,
            advertise_quic: Some(r.quic_relay_addr),
        },
        // One engine keeps the `[engine]` form an operator would write.
        engine: (engines.len() == 1).then(|| engines.remove(0)),
        engines,
        cluster: ClusterSection {
            seeds: r.peers.iter().map(|p| p.relay_addr).collect(),
            ..ClusterSection::default()
        },
        tls: TlsSection {
            ca: certs.join("ca.pem"),
            cert: certs.join(format!("{}.pem", r.name)),
            key: certs.join(format!("{}.key", r.name)),
        },
        routing,
        tuning,
        admin: AdminSection {
            token: token.to_owned(),
        },
        limits: LimitsSection::default(),
        telemetry: Default::default(),
    };
    config
        .validate()
        .with_context(|| format!("node config of region {}", r.name))
}

/// The `[tuning]` of every node: the policy's defaults with the `--tuning*` flags; in
/// `tune-then-freeze` the learned weights go to `<run-dir>/learned-weights-<region>.json`.
fn tuning_section(
    args: &UpArgs,
    region: &str,
    policy: PolicyKind,
) -> anyhow::Result<TuningSection> {
    let mut tuning = TuningSection::for_policy(policy);
    tuning.es.mode = serde_json::from_value::<TuningMode>(args.tuning.clone().into())
        .map_err(|e| anyhow::anyhow!("--tuning {}: {e}", args.tuning))?;
    if let Some(w) = args.tuning_window {
        tuning.es.window = w as usize;
    }
    // A small window needs a matching minimum (default 32) to stay valid.
    match (args.tuning_min_samples, args.tuning_window) {
        (Some(m), _) => tuning.es.min_samples = m as usize,
        (None, Some(w)) if w < 32 => tuning.es.min_samples = w.div_ceil(2) as usize,
        _ => {}
    }
    if let Some(trial) = args.tuning_trial {
        tuning.es.trial = trial;
    }
    if let Some(ms) = args.tuning_window_ms {
        tuning.es.time_cap_ms = ms;
    }
    if let Some(w) = args.tuning_start {
        tuning.es.w_rtt.start = w.w_rtt;
        tuning.es.w_queue.start = w.w_queue;
        tuning
            .es
            .validate()
            .map_err(|e| anyhow::anyhow!("--tuning-start {},{}: {e}", w.w_rtt, w.w_queue))?;
    }
    // Every value checked here, naming the flag, before anything starts (the node
    // config's check would name the config's field, after the relays have started).
    tuning.es.validate().map_err(|e| {
        let flag = match &e {
            gorgo_core::CoreError::InvalidConfig { field, .. } => match field.as_str() {
                "window_requests" => "--tuning-window",
                "min_samples" => "--tuning-min-samples",
                "window_max_ms" => "--tuning-window-ms",
                "w_rtt" | "w_queue" => "--tuning-start",
                _ => "--tuning*",
            },
            _ => "--tuning*",
        };
        anyhow::anyhow!("{flag}: {e}")
    })?;
    if tuning.es.mode == TuningMode::TuneThenFreeze {
        // Relative: resolved against the config's directory, the run directory.
        tuning.learned_weights_out = Some(format!("learned-weights-{region}.json").into());
    }
    Ok(tuning)
}

/// Whether the node whose admin API is at `addr` is ready (`/readyz` 200) and is this
/// run's: it takes this run's admin `token`.
fn node_ready(addr: SocketAddr, token: &str) -> bool {
    http_status(addr, "/readyz", None) == Some(200)
        && http_status(addr, "/admin/state", Some(token)) == Some(200)
}

/// Whether the node whose admin API is at `addr` lists each of `others` (node ids)
/// alive with its queue stats: its peers are routing candidates. `/readyz` says only
/// that its own engine serves; a replay started before the nodes had met (hundreds of
/// ms of gossip on a wide topology) served its first requests all locally, under any
/// policy.
fn node_sees_peers(addr: SocketAddr, token: &str, others: &[&str]) -> bool {
    let Some((200, body)) = http_get(addr, "/admin/peers", Some(token)) else {
        return false;
    };
    let Ok(peers) = serde_json::from_slice::<Vec<serde_json::Value>>(&body) else {
        return false;
    };
    others.iter().all(|id| {
        peers
            .iter()
            .any(|p| p["id"].as_str() == Some(id) && p["alive"] == true && !p["stats"].is_null())
    })
}

/// One plain HTTP/1.1 GET, with `token` as its bearer when given; the status code, or
/// `None` if nothing answered.
fn http_status(addr: SocketAddr, path: &str, token: Option<&str>) -> Option<u16> {
    http_get(addr, path, token).map(|(status, _)| status)
}

/// One plain HTTP/1.1 GET (`Connection: close`), with `token` as its bearer when given:
/// the status code and the body (at most 4 MiB, read until the node closes), or `None`
/// if nothing answered.
fn http_get(addr: SocketAddr, path: &str, token: Option<&str>) -> Option<(u16, Vec<u8>)> {
    let timeout = Duration::from_secs(2);
    let mut stream = TcpStream::connect_timeout(&addr, timeout).ok()?;
    stream.set_read_timeout(Some(timeout)).ok()?;
    stream.set_write_timeout(Some(timeout)).ok()?;
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = Vec::new();
    let _ = (&mut stream).take(4 << 20).read_to_end(&mut response);
    let head_end = response.windows(4).position(|w| w == b"\r\n\r\n");
    let head = std::str::from_utf8(&response[..head_end.unwrap_or(response.len())]).ok()?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let body = head_end.map_or(Vec::new(), |i| response[i + 4..].to_vec());
    Some((status, body))
}

fn log_tail(run_dir: &Path, name: &str) -> String {
    let path = run_dir.join("logs").join(format!("{name}.log"));
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Ctrl-C, SIGTERM or SIGHUP (its terminal closed, its SSH session dropped) to `gorgo
/// up`, caught from before its first child starts to the end: the children are in a
/// process group of their own (a terminal's signals reach `gorgo up` alone), so a
/// signal that killed `gorgo up` would leave every one running.
struct Interrupt {
    /// Sent once, on the first signal.
    signalled: std::sync::mpsc::Receiver<()>,
    /// The children's process group, which a second signal kills at once.
    group: Arc<AtomicU32>,
    /// Whether that signal was taken already.
    seen: std::cell::Cell<bool>,
    /// Runs the signal handlers' task on a thread of its own.
    _runtime: tokio::runtime::Runtime,
}

impl Interrupt {
    /// Install the handlers: from here on the signals no longer kill the process.
    fn install() -> anyhow::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .context("starting the tokio runtime")?;
        // Installed here, before returning: not when the task first runs.
        let (mut int, mut term, mut hup) = {
            let _in = runtime.enter();
            (
                signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
                signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
                signal(SignalKind::hangup()).context("installing the SIGHUP handler")?,
            )
        };
        let (tx, signalled) = std::sync::mpsc::channel();
        let group = Arc::new(AtomicU32::new(0));
        let children = group.clone();
        runtime.spawn(async move {
            for nth in 0.. {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                    _ = hup.recv() => {}
                }
                if nth == 0 {
                    let _ = tx.send(());
                    continue;
                }
                // A second signal while the first stop waits out the nodes' drains
                // (up to a minute): the operator wants out now.
                signal_group(children.load(Ordering::Relaxed), "KILL");
                eprintln!("second signal: every child killed without waiting for drains");
                std::process::exit(130);
            }
        });
        Ok(Interrupt {
            signalled,
            group,
            seen: std::cell::Cell::new(false),
            _runtime: runtime,
        })
    }

    /// Wait up to `timeout` for a signal (none: just look); whether one has come.
    fn wait(&self, timeout: Duration) -> bool {
        if !self.seen.get() {
            let got = match self.signalled.recv_timeout(timeout) {
                Ok(()) => true,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => false,
                // The task ended without sending: its handler failed; treat as a stop.
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => true,
            };
            self.seen.set(got);
        }
        self.seen.get()
    }

    /// An error if a signal has come (the caller's `Children` then stop on drop).
    fn check(&self, starting: &str) -> anyhow::Result<()> {
        if self.wait(Duration::ZERO) {
            bail!("interrupted while starting {starting}: stopping what was started");
        }
        Ok(())
    }
}

/// The instant `secs` seconds from now, for flag `flag`: a flag error, not an
/// overflow panic, where it is too far to represent.
fn deadline_in(flag: &str, secs: u64) -> anyhow::Result<Instant> {
    Instant::now()
        .checked_add(Duration::from_secs(secs))
        .with_context(|| format!("{flag} {secs}: too large"))
}

/// Starts the cluster; see the module docs.
pub fn run_up(args: UpArgs) -> anyhow::Result<()> {
    let topology = Topology::from_file(&args.topology)?;
    let topology_path = std::fs::canonicalize(&args.topology)
        .with_context(|| format!("resolving {}", args.topology.display()))?;
    let options = PlanOptions {
        ip_base: args.ip_base,
        base_port: args.base_port,
    };
    let plan = plan_cluster(&topology, &options)?;
    let external = parse_engine_urls(&args.engine_url, &topology)?;
    let policy = gorgo_node::route::parse_policy(&args.policy)
        .map_err(|e| anyhow::anyhow!("--policy: {e}"))?;
    // The `--tuning*` flags, checked before anything is started.
    tuning_section(&args, "check", policy)?;
    deadline_in("--ready-timeout-s", args.ready_timeout_s)?;
    let engine_kind: EngineKind = args.engine_kind.parse().context("--engine-kind")?;
    check_engine_seed_flags(&args)?;

    std::fs::create_dir_all(args.run_dir.join("logs"))
        .with_context(|| format!("creating {}", args.run_dir.display()))?;
    let run_dir = std::fs::canonicalize(&args.run_dir)
        .with_context(|| format!("resolving --run-dir {}", args.run_dir.display()))?;
    let pids_path = run_dir.join("pids.json");
    match gorgo_files::read_capped(&pids_path, gorgo_files::MAX_CONFIG_FILE_BYTES) {
        Ok(text) => {
            // Written whole or not at all (`write_pids`): one that does not parse was
            // not written by `gorgo up`, and may still stand for a running cluster.
            let pids: PidsFile = serde_json::from_str(&text).with_context(|| {
                format!(
                    "parsing {}; remove it if no cluster runs from there",
                    pids_path.display()
                )
            })?;
            if !pids.running(&pids_path).is_empty() {
                bail!(
                    "a cluster is already running from {}; run `gorgo down --run-dir {}` first",
                    run_dir.display(),
                    args.run_dir.display()
                );
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("reading {}", pids_path.display())),
    }
    let _ = std::fs::remove_file(run_dir.join("cluster.json"));
    taken_addresses_refused(&plan)?;

    let token = random_token()?;
    let certs = run_dir.join("certs");
    let ids: Vec<NodeId> = plan
        .regions
        .iter()
        .map(|r| NodeId(r.name.clone()))
        .collect();
    gorgo_cluster::write_cluster_certs(&certs, &ids, gorgo_cluster::NODE_CERT_DAYS)
        .with_context(|| format!("writing certificates to {}", certs.display()))?;

    let interrupt = Interrupt::install()?;
    let mut children = Children {
        exe: std::env::current_exe().context("finding this binary")?,
        run_dir: run_dir.clone(),
        pgid: None,
        children: Vec::new(),
        armed: true,
        group: interrupt.group.clone(),
    };
    children.spawn(
        "netem",
        &[
            "netem".into(),
            "--topology".into(),
            topology_path.display().to_string(),
            "--ip-base".into(),
            args.ip_base.to_string(),
            "--base-port".into(),
            args.base_port.to_string(),
            "--seed".into(),
            args.seed.to_string(),
        ],
    )?;
    if args.replicas > 1 && !external.is_empty() {
        bail!("--replicas: emulated regions only (give each engine with --engine-url)");
    }
    let mut regions = Vec::new();
    for (i, r) in plan.regions.iter().enumerate() {
        let mut engine_sections = Vec::new();
        let engine_url = match external.get(&r.name) {
            Some(url) => {
                let extras = EngineExtras::external(&args, engine_kind);
                engine_sections.push(extras.engine_section(url, engine_kind));
                url.clone()
            }
            None => {
                let extras = EngineExtras::emulated(&args)?;
                for replica in 0..args.replicas {
                    let addr = replica_engine_addr(r.engine_addr, replica)?;
                    let mut engine_args = vec![
                        "engine".into(),
                        "--profile".into(),
                        args.engine_profile.clone(),
                        "--listen".into(),
                        addr.to_string(),
                        // The name `gorgo bench` sends by default: nodes route a
                        // request only to engines that list the model it names.
                        "--model".into(),
                        gorgo_workload::DEFAULT_MODEL.into(),
                    ];
                    engine_args.extend(extras.emulator_args());
                    let mut section =
                        extras.engine_section(&format!("http://{addr}"), EngineKind::Sglang);
                    if args.kv_events {
                        let (publish, replay) = kv_event_endpoints(addr)?;
                        engine_args.extend([
                            "--kv-events".into(),
                            publish.clone(),
                            "--kv-events-replay".into(),
                            replay.clone(),
                        ]);
                        section.kv_events = Some(publish);
                        section.kv_events_replay = Some(replay);
                    }
                    let name = match replica {
                        0 => format!("engine-{}", r.name),
                        k => format!("engine-{}-{k}", r.name),
                    };
                    interrupt.check(&name)?;
                    children.spawn(&name, &engine_args)?;
                    engine_sections.push(section);
                }
                format!("http://{}", r.engine_addr)
            }
        };
        let config_path = run_dir.join(format!("node-{}.toml", r.name));
        let mut routing = RoutingSection {
            policy,
            allow_policy_header: args.allow_policy_header,
            ..RoutingSection::default()
        };
        if let Some(n) = args.decision_log {
            routing.decision_log = n;
        }
        routing.weights = args.tuning_start;
        let config = node_config(
            &plan,
            i,
            engine_sections,
            &certs,
            routing,
            tuning_section(&args, &r.name, policy)?,
            &token,
        )?;
        let text = format!("# Generated by `gorgo up`.\n{}", config.to_toml_string()?);
        write_secret(&config_path, text.as_bytes())?;
        interrupt.check(&format!("node-{}", r.name))?;
        children.spawn(
            &format!("node-{}", r.name),
            &[
                "node".into(),
                "--config".into(),
                config_path.display().to_string(),
            ],
        )?;
        regions.push(RegionEndpoint {
            name: r.name.clone(),
            client_url: format!("http://{}", r.client_addr),
            admin_url: Some(format!("http://{}", r.admin_addr)),
            engine_url: Some(engine_url),
            node_id: Some(r.name.clone()),
        });
    }

    // Ready: every node answers /readyz with 200 and lists the others alive, and no
    // child has died; a signal stops the wait (and, as `children` drops, every
    // child).
    let deadline = deadline_in("--ready-timeout-s", args.ready_timeout_s)?;
    let mut waiting: Vec<&str> = plan.regions.iter().map(|r| r.name.as_str()).collect();
    while !waiting.is_empty() {
        if let Some((name, status)) = children.exited() {
            bail!(
                "{name} exited ({status}) while starting; its log ({}):\n{}",
                run_dir.join("logs").join(format!("{name}.log")).display(),
                log_tail(&run_dir, &name)
            );
        }
        // Ready, and this run's node: it takes this run's admin token. Another run's
        // node at the same address (two runs started at once on the same ports, this
        // one's node failing to bind) answered `/readyz` too, and the run replayed
        // against the other cluster under its own label.
        // And every node sees every other: their first requests route as in the rest
        // of the run ([`node_sees_peers`]).
        let ids: Vec<&str> = plan.regions.iter().map(|r| r.name.as_str()).collect();
        waiting.retain(|name| {
            let r = plan.regions.iter().find(|r| r.name == *name);
            let others: Vec<&str> = ids.iter().copied().filter(|id| id != name).collect();
            r.is_none_or(|r| {
                !(node_ready(r.admin_addr, &token)
                    && node_sees_peers(r.admin_addr, &token, &others))
            })
        });
        if waiting.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            bail!(
                "nodes not ready (serving, every peer alive) after {} s: {} (logs in {})",
                args.ready_timeout_s,
                waiting.join(", "),
                run_dir.join("logs").display()
            );
        }
        if interrupt.wait(POLL_EVERY) {
            bail!(
                "interrupted while waiting for {} to be ready: stopping the cluster",
                waiting.join(", ")
            );
        }
    }

    let cluster = ClusterInfo {
        admin_token: Some(token.clone()),
        regions,
    };
    let cluster_path = run_dir.join("cluster.json");
    write_secret(&cluster_path, &serde_json::to_vec_pretty(&cluster)?)?;

    tellln!(
        "{:<16} {:<26} {:<26} {:<26} peers (emulated RTT ms)",
        "region",
        "client url",
        "admin url",
        "engine url"
    );
    for (r, p) in cluster.regions.iter().zip(&plan.regions) {
        let peers: Vec<String> = p
            .peers
            .iter()
            .map(|q| format!("{} {}", q.region, q.rtt_ms))
            .collect();
        tellln!(
            "{:<16} {:<26} {:<26} {:<26} {}",
            r.name,
            r.client_url,
            r.admin_url.as_deref().unwrap_or("-"),
            r.engine_url.as_deref().unwrap_or("-"),
            peers.join(", ")
        );
    }
    tellln!("cluster file: {}", cluster_path.display());
    tellln!("admin token:  {token}");

    if args.detach {
        tellln!(
            "running detached; stop with `gorgo down --run-dir {}`",
            args.run_dir.display()
        );
        children.armed = false;
        return Ok(());
    }
    tellln!("running; Ctrl-C to stop");
    let died = loop {
        if interrupt.wait(Duration::from_millis(500)) {
            break None;
        }
        if let Some(exited) = children.exited() {
            break Some(exited);
        }
    };
    eprintln!("stopping the cluster");
    children.stop();
    if let Some((name, status)) = died {
        bail!(
            "{name} exited ({status}); its log:\n{}",
            log_tail(&run_dir, &name)
        );
    }
    Ok(())
}

/// Restarts one process of a cluster started with `gorgo up --detach`: stops it
/// (gracefully, or `--kill`), starts it again with the same arguments in the same
/// process group, records the new pid in `pids.json` (so `gorgo down` stops it) and,
/// for a node or an engine emulator, waits until it answers (`/readyz`, `/health`).
pub fn run_restart(args: RestartArgs) -> anyhow::Result<()> {
    deadline_in("--ready-timeout-s", args.ready_timeout_s)?;
    let pids_path = args.run_dir.join("pids.json");
    let text = gorgo_files::read_capped(&pids_path, gorgo_files::MAX_CONFIG_FILE_BYTES)
        .with_context(|| format!("reading {} (is a cluster running?)", pids_path.display()))?;
    let mut pids: PidsFile =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", pids_path.display()))?;
    let wanted = [args.name.clone(), format!("node-{}", args.name)];
    // The cluster's group still exists while another of its recorded processes runs:
    // then the restarted one joins it. Otherwise the group id may be another job's
    // now, which a later `gorgo down` would kill with the cluster.
    let group = pids
        .processes
        .iter()
        .any(|p| !wanted.contains(&p.name) && p.is_running())
        .then_some(pids.pgid);
    let Some(entry) = pids.processes.iter_mut().find(|p| wanted.contains(&p.name)) else {
        let names: Vec<&str> = pids.processes.iter().map(|p| p.name.as_str()).collect();
        bail!(
            "no process `{}` in {}; there are: {}",
            args.name,
            pids_path.display(),
            names.join(", ")
        );
    };
    if entry.args.is_empty() {
        bail!(
            "{} was started by an older `gorgo up` that did not record its arguments",
            entry.name
        );
    }
    let name = entry.name.clone();
    if entry.is_running() {
        // Waited for while it is still the recorded process (`is_running`: its pid,
        // reused by another, is neither waited for nor killed), as `gorgo down` waits:
        // a node for its drain deadline and its exit, the others for `STOP_GRACE`.
        let grace = if args.kill {
            Duration::ZERO
        } else if entry.is_node() {
            (node_drain_deadline(&entry.args) + NODE_EXIT_MARGIN).min(NODE_STOP_MAX)
        } else {
            STOP_GRACE
        };
        if !stop_all(&[&*entry], grace).is_empty() && !args.kill {
            eprintln!("{name} did not stop on SIGTERM; killed it");
        }
        let deadline = Instant::now() + STOP_GRACE;
        while entry.is_running() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    } else if pid_alive(entry.pid) {
        eprintln!(
            "warning: pid {} is not {name} any more (its program or command line differs): left alone",
            entry.pid
        );
    }
    let run_dir = std::fs::canonicalize(&args.run_dir)
        .with_context(|| format!("resolving --run-dir {}", args.run_dir.display()))?;
    wait_for_ports(&entry.args);
    // Join the cluster's group if it still exists; otherwise a group of its own (its
    // pid is recorded either way, and `gorgo down` signals pids too).
    let exe = std::env::current_exe().context("finding this binary")?;
    let joined = group.and_then(|pgid| {
        spawn_child(&exe, &run_dir, &name, &entry.args, Some(pgid), true)
            .ok()
            .map(|c| (c, pgid))
    });
    let (child, pgid) = match joined {
        Some(joined) => joined,
        None => {
            let child = spawn_child(&exe, &run_dir, &name, &entry.args, None, true)?;
            let own = child.id();
            (child, own)
        }
    };
    entry.pid = child.id();
    entry.exe = Some(exe);
    let pid = entry.pid;
    // The group `gorgo down` kills last is the one the cluster's processes are in now.
    pids.pgid = pgid;
    write_pids(&pids_path, &pids)?;
    if let Some(region) = name.strip_prefix("node-") {
        let cluster: ClusterInfo = serde_json::from_str(
            &gorgo_files::read_capped(
                &run_dir.join("cluster.json"),
                gorgo_files::MAX_CONFIG_FILE_BYTES,
            )
            .context("reading cluster.json")?,
        )
        .context("parsing cluster.json")?;
        let admin = cluster
            .regions
            .iter()
            .find(|r| r.name == region)
            .and_then(|r| r.admin_url.as_deref())
            .and_then(|u| u.trim_start_matches("http://").parse::<SocketAddr>().ok());
        if let Some(admin) = admin {
            wait_answering(
                &run_dir,
                &name,
                pid,
                (admin, "/readyz"),
                args.ready_timeout_s,
            )?;
        }
    }
    if name == "netem" {
        let args_of = |n: &str| {
            pids.processes
                .iter()
                .find(|p| p.name == n)
                .map(|p| p.args.clone())
        };
        if let Some(control) = args_of("netem").and_then(|a| netem_control_addr(&a)) {
            wait_answering(
                &run_dir,
                &name,
                pid,
                (control, "/links"),
                args.ready_timeout_s,
            )?;
        }
    }
    if name.starts_with("engine-") {
        if let Some(addr) = entry_listen(&pids, &name) {
            wait_answering(
                &run_dir,
                &name,
                pid,
                (addr, "/health"),
                args.ready_timeout_s,
            )?;
        }
    }
    tellln!("restarted {name} (pid {pid})");
    Ok(())
}

/// Wait until the restarted process `name` (`pid`) answers 200 on `path` at `addr`:
/// an error naming it, with its log, if it exits first or takes over `timeout_s`.
fn wait_answering(
    run_dir: &Path,
    name: &str,
    pid: u32,
    (addr, path): (SocketAddr, &str),
    timeout_s: u64,
) -> anyhow::Result<()> {
    let deadline = deadline_in("--ready-timeout-s", timeout_s)?;
    while http_status(addr, path, None) != Some(200) {
        if !pid_alive(pid) {
            bail!(
                "{name} exited while starting; its log:\n{}",
                log_tail(run_dir, name)
            );
        }
        if Instant::now() >= deadline {
            bail!("{name} not answering {path} after {timeout_s} s");
        }
        std::thread::sleep(POLL_EVERY);
    }
    Ok(())
}

/// The control API address of the netem started with `args` (`netem --topology ...`):
/// its `--control`, else its plan's. It answers once every relay is bound (the
/// relays start first), so a netem that failed to start (the old one's sockets still
/// held) is seen, not reported restarted.
fn netem_control_addr(args: &[String]) -> Option<SocketAddr> {
    #[derive(clap::Parser)]
    struct Netem {
        #[command(flatten)]
        args: super::netem::NetemArgs,
    }
    let parsed = <Netem as clap::Parser>::try_parse_from(args).ok()?.args;
    if let Some(control) = parsed.control {
        return Some(control);
    }
    let topology = Topology::from_file(&parsed.topology).ok()?;
    let options = PlanOptions {
        ip_base: parsed.ip_base,
        base_port: parsed.base_port,
    };
    Some(plan_cluster(&topology, &options).ok()?.control_addr)
}

/// The `--listen` address `name` was started with (an engine emulator's).
fn entry_listen(pids: &PidsFile, name: &str) -> Option<SocketAddr> {
    let args = &pids.processes.iter().find(|p| p.name == name)?.args;
    let i = args.iter().position(|a| a == "--listen")?;
    args.get(i + 1)?.parse().ok()
}

/// Wait up to 10 s until the listen addresses of the process started with `args` can
/// be bound again: a node's (`node --config F`: HTTP, admin, QUIC) or an engine
/// emulator's (`engine --listen A`). A process whose main thread has exited reads as
/// gone while its other threads still hold its sockets; starting the new one then
/// fails with "address in use" (seen in the chaos soak after an `engine_kill`).
fn wait_for_ports(args: &[String]) {
    let value_of = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
    };
    let mut tcp: Vec<SocketAddr> = Vec::new();
    let mut udp: Vec<SocketAddr> = Vec::new();
    if let Some(config) = value_of("--config").and_then(|p| NodeConfig::load(Path::new(p)).ok()) {
        tcp.extend([config.listen.http, config.listen.admin]);
        udp.push(config.listen.quic);
    }
    if let Some(addr) = value_of("--listen").and_then(|a| a.parse::<SocketAddr>().ok()) {
        tcp.push(addr);
    }
    if args.first().is_some_and(|a| a == "netem") {
        tcp.extend(netem_control_addr(args));
    }
    let free = || {
        tcp.iter().all(|a| std::net::TcpListener::bind(a).is_ok())
            && udp.iter().all(|a| std::net::UdpSocket::bind(a).is_ok())
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !free() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Stops a cluster started with `gorgo up --detach`, in order ([`stop_in_order`]):
/// the processes of `pids.json` that are still the ones recorded there; a pid that is
/// another process by now is named and left alone.
pub fn run_down(args: DownArgs) -> anyhow::Result<()> {
    let pids_path = args.run_dir.join("pids.json");
    let text = match gorgo_files::read_capped(&pids_path, gorgo_files::MAX_CONFIG_FILE_BYTES) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tellln!("nothing running from {}", args.run_dir.display());
            return Ok(());
        }
        Err(e) => return Err(e).with_context(|| format!("reading {}", pids_path.display())),
    };
    let pids: PidsFile =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", pids_path.display()))?;
    let running = pids.running(&pids_path);
    let killed = stop_in_order(&running, pids.group_of(&running));
    std::fs::remove_file(&pids_path)
        .with_context(|| format!("removing {}", pids_path.display()))?;
    let left = pids.processes.len() - running.len();
    let gone = if left > 0 {
        format!("; {left} of its {} were gone", pids.processes.len())
    } else {
        String::new()
    };
    if killed.is_empty() {
        tellln!("stopped {} processes{gone}", running.len());
    } else {
        tellln!(
            "stopped {} processes ({} needed SIGKILL: {}){gone}",
            running.len(),
            killed.len(),
            killed.join(", ")
        );
    }
    Ok(())
}

/// Refuse to start where something already listens on one of the plan's TCP
/// addresses: a cluster left behind on the same ports (a `compare` killed without its
/// teardown) would answer `/readyz` for the new one, whose processes fail to bind, and
/// the run would measure the old cluster.
fn taken_addresses_refused(plan: &ClusterPlan) -> anyhow::Result<()> {
    let addresses = plan
        .regions
        .iter()
        .flat_map(|r| {
            [
                ("client relay", r.client_addr),
                ("node", r.node_http_addr),
                ("node admin", r.admin_addr),
                ("engine", r.engine_addr),
            ]
            .map(|(what, addr)| (r.name.as_str(), what, addr))
        })
        .chain(std::iter::once((
            "cluster",
            "netem control",
            plan.control_addr,
        )));
    for (region, what, addr) in addresses {
        if std::net::TcpListener::bind(addr).is_err() {
            bail!(
                "{addr} ({region}'s {what}) is taken: another cluster or process listens \
                 there; stop it (`gorgo down --run-dir ...` for a cluster left behind) or \
                 pick another --base-port / --ip-base"
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node is ready for this run only when it takes this run's admin token: one of
    /// another run at the same address answers `/readyz` too (before, that was taken
    /// as ready, and the run replayed against the other cluster under its own label).
    #[test]
    fn a_node_that_refuses_the_runs_token_is_not_its_node() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let mut stream = stream.unwrap();
                // The whole head, however it was written.
                let mut head = Vec::new();
                let mut buf = [0u8; 256];
                while !head.ends_with(b"\r\n\r\n") {
                    match stream.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let req = String::from_utf8_lossy(&head);
                let status = if req.starts_with("GET /readyz ")
                    || req.contains("Authorization: Bearer theirs\r\n")
                {
                    "200 OK"
                } else {
                    "401 Unauthorized"
                };
                let _ = write!(stream, "HTTP/1.1 {status}\r\nContent-Length: 0\r\n\r\n");
            }
        });
        assert!(!node_ready(addr, "ours"));
        assert!(node_ready(addr, "theirs"));
    }

    /// Waits until the kernel has filled the cmdline of a child just spawned: just
    /// after its exec it reads empty for a moment (bounded; a condition, not a fixed
    /// sleep), and an entry would then differ from it by an empty read.
    fn wait_for_cmdline(child: &Child) {
        let filled = Instant::now() + Duration::from_secs(10);
        while std::fs::read(format!("/proc/{}/cmdline", child.id())).is_ok_and(|c| c.is_empty())
            && Instant::now() < filled
        {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The program a child runs (`/proc/<pid>/exe`, set by its exec, which `spawn`
    /// has waited for): what `gorgo up` records for a child it started (its own
    /// binary, which the child runs).
    fn exe_of(child: &Child) -> PathBuf {
        std::fs::read_link(format!("/proc/{}/exe", child.id())).unwrap()
    }

    /// A pid that is no longer the recorded process (reused by another) is neither
    /// signalled nor waited for, at the start or at the deadline; the recorded one is
    /// stopped. Another program with the recorded arguments is not the recorded
    /// process either: before, only the arguments were compared, and `gorgo down`
    /// killed a `sleep 30` recorded with the arguments `30`.
    #[test]
    fn stop_all_signals_only_the_recorded_processes() {
        let mut other = Command::new("sleep").arg("30").spawn().unwrap();
        wait_for_cmdline(&other);
        let stranger = PidEntry {
            name: "node-a".into(),
            pid: other.id(),
            args: vec!["node".into(), "--config".into(), "a.toml".into()],
            exe: Some(exe_of(&other)),
        };
        // Its arguments, but recorded as run by gorgo: by the binary recorded, or (an
        // older `gorgo up`, which recorded none) by one named `gorgo`.
        let pid = other.id();
        let same_args = |exe: Option<PathBuf>| PidEntry {
            name: "engine-a".into(),
            pid,
            args: vec!["30".into()],
            exe,
        };
        let impostors = [
            same_args(None),
            same_args(Some("/usr/local/bin/gorgo".into())),
        ];
        for entry in [&stranger, &impostors[0], &impostors[1]] {
            assert!(!entry.is_running(), "{entry:?}");
            assert!(stop_all(&[entry], Duration::from_millis(200)).is_empty());
        }
        assert!(
            matches!(other.try_wait(), Ok(None)),
            "another process was signalled"
        );
        let mine = same_args(Some(exe_of(&other)));
        assert!(mine.is_running());
        stop_all(&[&mine], Duration::from_secs(30));
        assert!(other.wait().is_ok());
    }

    /// A `pids.json` of an older `gorgo up` records no binary: its process must run a
    /// file named `gorgo`. A binary deleted since the process started (a rebuild
    /// replaces it; `/proc/<pid>/exe` then reads `<path> (deleted)`) is still the one
    /// recorded.
    #[test]
    fn a_program_named_gorgo_or_the_recorded_one_counts_even_once_rebuilt() {
        let mut sleep = Command::new("sleep").arg("30").spawn().unwrap();
        let program = exe_of(&sleep);
        sleep.kill().unwrap();
        sleep.wait().unwrap();
        if program.file_name() != Some("sleep".as_ref()) {
            // A multi-call binary (busybox) runs by its name: not one to copy.
            eprintln!("skipping: sleep is {}", program.display());
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let gorgo = dir.path().join("gorgo");
        std::fs::copy(&program, &gorgo).unwrap();
        let gorgo = std::fs::canonicalize(gorgo).unwrap();
        // ETXTBSY while a process forked by another test still holds the copy open
        // for writing: it closes at that process's exec.
        let busy_until = Instant::now() + Duration::from_secs(10);
        let mut child = loop {
            match Command::new(&gorgo).arg("30").spawn() {
                Err(e) if e.raw_os_error() == Some(26) && Instant::now() < busy_until => {
                    std::thread::yield_now()
                }
                other => break other.unwrap(),
            }
        };
        wait_for_cmdline(&child);
        let older = PidEntry {
            name: "engine-a".into(),
            pid: child.id(),
            args: vec!["30".into()],
            exe: None,
        };
        let recorded = PidEntry {
            exe: Some(gorgo.clone()),
            ..older.clone()
        };
        assert!(older.is_running() && recorded.is_running());
        std::fs::remove_file(&gorgo).unwrap();
        assert!(older.is_running() && recorded.is_running());
        let _ = child.kill();
        child.wait().unwrap();
    }

    /// A zero grace is a crash: SIGKILL alone. A SIGTERM first (milliseconds before
    /// the kill) let a node start its drain and tell its peers it was leaving, so
    /// `gorgo restart --kill` tested a graceful leave, not a crash.
    #[test]
    fn a_kill_sends_no_sigterm_first() {
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("termed");
        // Python runs a signal handler at once (it interrupts the sleep): a SIGTERM
        // milliseconds before the kill leaves its mark.
        let script = format!(
            "import signal, time\n\
             def term(*_):\n    open({:?}, 'w').write('term')\n    time.sleep(30)\n\
             signal.signal(signal.SIGTERM, term)\nprint('ready', flush=True)\ntime.sleep(30)\n",
            marker.display().to_string()
        );
        let mut child = Command::new("python3")
            .args(["-c", &script])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // The trap is set once it says so.
        let mut ready = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut ready,
        )
        .unwrap();
        let entry = PidEntry {
            name: "engine-a".into(),
            pid: child.id(),
            args: vec!["-c".into(), script.clone()],
            exe: Some(exe_of(&child)),
        };
        assert!(entry.is_running());
        assert_eq!(stop_all(&[&entry], Duration::ZERO), ["engine-a"]);
        child.wait().unwrap();
        assert!(!marker.exists(), "the process got a SIGTERM");
    }

    #[test]
    fn engine_urls_are_parsed_once_and_checked_against_the_topology() {
        let topology = Topology::from_file(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/configs/topologies/three-region.toml"
        ))
        .unwrap();
        let region = topology.regions[0].name.clone();
        let urls =
            parse_engine_urls(&[format!("{region}=http://127.0.0.1:30000/")], &topology).unwrap();
        assert_eq!(urls[&region], "http://127.0.0.1:30000");
        assert!(parse_engine_urls(&[], &topology).unwrap().is_empty());
        let e = parse_engine_urls(&["mars=http://x".into()], &topology).unwrap_err();
        assert!(format!("{e:#}").contains("mars"), "{e:#}");
        let e = parse_engine_urls(std::slice::from_ref(&region), &topology).unwrap_err();
        assert!(format!("{e:#}").contains("region=url"), "{e:#}");
        // What the node would refuse as `engine.url` is refused here, before anything
        // starts: its client speaks no TLS, and a port past 65535 is no port.
        for url in ["https://127.0.0.1:30000", "http://127.0.0.1:300000"] {
            let e = parse_engine_urls(&[format!("{region}={url}")], &topology).unwrap_err();
            assert!(format!("{e:#}").contains("--engine-url"), "{e:#}");
        }
    }

    fn plan() -> ClusterPlan {
        let topology = Topology::from_file(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/configs/topologies/three-region.toml"
        ))
        .unwrap();
        plan_cluster(&topology, &PlanOptions::default()).unwrap()
    }

    /// What `gorgo node` reads back from what `gorgo up` writes.
    fn written_and_read(config: &ValidatedConfig) -> ValidatedConfig {
        let text = config.to_toml_string().unwrap();
        let back = NodeConfig::from_toml_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(&back, config, "{text}");
        back
    }

    #[test]
    fn external_engine_settings_reach_a_valid_node_config() {
        let plan = plan();
        let extras = EngineExtras {
            health_path: Some("/docs".into()),
            kv_capacity_tokens: Some(5760),
            max_running_requests: Some(1),
            no_metrics: true,
            t_p_ms: Some(1.43),
            base_ms: Some(0.0),
            decode_step_ms: Some(3.0),
            tokenizer: Some("/models/tok/tokenizer.json".into()),
            chat_template: Some("/models/tok/chatml.jinja".into()),
            chat_add_special_tokens: true,
        };
        assert_eq!(
            extras.emulator_args(),
            [
                "--tokenizer",
                "/models/tok/tokenizer.json",
                "--chat-template",
                "/models/tok/chatml.jinja",
                "--chat-add-special-tokens"
            ]
        );
        let config = node_config(
            &plan,
            0,
            vec![extras.engine_section("http://127.0.0.1:18410", EngineKind::Openai)],
            Path::new("/certs"),
            RoutingSection::default(),
            TuningSection::default(),
            "test-admin-token",
        )
        .unwrap();
        let config = written_and_read(&config);
        let engine = config.shared_engine();
        assert!(
            config.engine.is_some(),
            "one engine keeps the `[engine]` form"
        );
        assert_eq!(engine.url, "http://127.0.0.1:18410");
        assert_eq!(engine.kind, EngineKind::Openai);
        assert_eq!(engine.health_path(), "/docs");
        assert_eq!(engine.kv_capacity_tokens, Some(5760));
        assert_eq!(engine.max_running_requests, Some(1));
        assert_eq!(engine.metrics_interval_ms, 0);
        assert_eq!(engine.t_p_ms, 1.43);
        assert_eq!(engine.base_ms, 0.0);
        assert_eq!(engine.decode_step_ms, 3.0);
        assert_eq!(
            engine.tokenizer.as_deref(),
            Some(Path::new("/models/tok/tokenizer.json"))
        );
        assert!(engine.chat_add_special_tokens);
        assert_eq!(
            config.listen.advertise_quic,
            Some(plan.regions[0].quic_relay_addr)
        );
        assert_eq!(config.cluster.seeds.len(), plan.regions[0].peers.len());

        // Nothing given: the node's own defaults.
        let config = node_config(
            &plan,
            1,
            vec![EngineExtras::default()
                .engine_section("http://127.0.0.1:18411", EngineKind::Openai)],
            Path::new("/certs"),
            RoutingSection::default(),
            TuningSection::default(),
            "test-admin-token",
        )
        .unwrap();
        let config = written_and_read(&config);
        assert_eq!(config.shared_engine().health_path(), "/v1/models");
        assert_eq!(config.shared_engine().kv_capacity_tokens, None);

        // Replicas: `[[engines]]`, in order, each checked.
        let replicas: Vec<EngineSection> = (0..3)
            .map(|k| {
                let addr = replica_engine_addr(plan.regions[1].engine_addr, k).unwrap();
                EngineExtras::default()
                    .engine_section(&format!("http://{addr}"), EngineKind::Sglang)
            })
            .collect();
        let config = node_config(
            &plan,
            1,
            replicas,
            Path::new("/certs"),
            RoutingSection::default(),
            TuningSection::default(),
            "test-admin-token",
        )
        .unwrap();
        let config = written_and_read(&config);
        assert!(config.engine.is_none());
        let urls: Vec<&str> = config.engines().iter().map(|e| e.url.as_str()).collect();
        assert_eq!(urls.len(), 3);
        assert_ne!(urls[1], urls[2]);

        // A bad value fails when the config is built, naming the field.
        let mut engine = EngineExtras::default().engine_section("http://x", EngineKind::Sglang);
        engine.t_p_ms = f64::NAN;
        let e = node_config(
            &plan,
            0,
            vec![engine],
            Path::new("/certs"),
            RoutingSection::default(),
            TuningSection::default(),
            "test-admin-token",
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("engine.t_p_ms"), "{e:#}");
    }

    #[test]
    fn tuning_flags_reach_the_node_config() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            up: UpArgs,
        }
        let cli = Cli::parse_from([
            "up",
            "--tuning",
            "tune-then-freeze",
            "--tuning-window",
            "8",
            "--tuning-window-ms",
            "5000",
        ]);
        let tuning = tuning_section(&cli.up, "us", PolicyKind::GorgoPaper).unwrap();
        assert_eq!(tuning.es.mode, TuningMode::TuneThenFreeze);
        assert_eq!((tuning.es.window, tuning.es.min_samples), (8, 4));
        assert_eq!(tuning.es.time_cap_ms, 5000);
        assert_eq!(tuning.es.w_rtt.max, 2.0, "the policy's bounds");
        assert_eq!(
            tuning.learned_weights_out.as_deref(),
            Some(Path::new("learned-weights-us.json"))
        );
        let config = node_config(
            &plan(),
            0,
            vec![EngineSection::new("http://127.0.0.1:1", EngineKind::Sglang)],
            Path::new("/certs"),
            RoutingSection {
                policy: PolicyKind::GorgoPaper,
                ..RoutingSection::default()
            },
            tuning,
            "test-admin-token",
        )
        .unwrap();
        written_and_read(&config);
        let cli = Cli::parse_from(["up", "--tuning", "sometimes"]);
        let e = tuning_section(&cli.up, "us", PolicyKind::Gorgo).unwrap_err();
        assert!(e.to_string().contains("--tuning"), "{e}");
        // "Never" as the largest number: refused as the node refuses
        // `tuning.window_max_ms`, but before anything starts.
        let Err(e) = Cli::try_parse_from(["up", "--tuning-window-ms", "18446744073709551615"])
        else {
            panic!("--tuning-window-ms past a week was taken");
        };
        let e = e.to_string();
        assert!(e.contains("--tuning-window-ms"), "{e}");
    }

    /// The engine seeds the node refuses (past its ceilings too) are refused with the
    /// flag's name before anything starts.
    #[test]
    fn engine_seed_flags_the_node_refuses_are_refused_first() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            up: UpArgs,
        }
        for (flag, value) in [
            ("--engine-t-p-ms", "1e306"),
            ("--engine-t-p-ms", "0"),
            ("--engine-base-ms", "1e306"),
            ("--engine-decode-step-ms", "1e306"),
        ] {
            let cli = Cli::parse_from(["up", flag, value]);
            let e = check_engine_seed_flags(&cli.up).unwrap_err().to_string();
            assert!(e.contains(flag), "{flag} {value}: {e}");
        }
        let cli = Cli::parse_from(["up", "--engine-t-p-ms", "1000", "--engine-base-ms", "0"]);
        check_engine_seed_flags(&cli.up).unwrap();
    }
}
