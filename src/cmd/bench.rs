//! `gorgo bench`, `gorgo compare` and `gorgo demo`: thin drivers over `gorgo-bench`.
//!
//! `bench` replays a trace against a running cluster; `compare` starts one cluster per
//! policy (this binary's `up`/`down`) and replays the same workload on each; `demo` is
//! `compare` on a bundled topology and a seeded generated workload, with no arguments.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use gorgo_bench::workload::{body_builder, clamp_context, rebase, replay_items};
use gorgo_bench::{
    indicatif, CancellationToken, ClusterInfo, CompareSpec, LoadMode, PolicyRun, ReplayConfig,
};
use gorgo_workload::TraceRequest;

/// The policies `compare` and `demo` run by default: GORGO and the paper's baselines.
pub const MAIN_POLICIES: &str =
    "gorgo,least-load,least-request,prefix-cache,session-affinity,simple-session-affinity";

/// First port of the first cluster `compare` and `demo` start.
const DEFAULT_BASE_PORT: u16 = 17100;

/// The engine emulators' profile unless told otherwise: the paper's calibration.
const DEFAULT_ENGINE_PROFILE: &str = "paper-a100-mistral7b";

/// The demo's topology, bundled so the demo runs from any directory.
const DEMO_TOPOLOGY: &str = include_str!("../../configs/topologies/three-region.toml");

/// Open loop (trace timestamps) or closed loop (fixed concurrency).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Send each request at `timestamp x time_scale`.
    Open,
    /// `--concurrency` clients, each sending its next request when the last finished.
    Closed,
}

/// How the load is offered: shared by `bench` and `compare`.
#[derive(clap::Args, Debug, Clone)]
pub struct LoadArgs {
    /// Multiplies trace timestamps in open loop (0.5 = twice as fast).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Open or closed loop.
    #[arg(long, value_enum, default_value_t = Mode::Open)]
    pub mode: Mode,
    /// Closed loop: number of clients (default 64). Open loop: cap on requests in
    /// flight (waiting for a slot is recorded as slip; default no cap).
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Stop sending after this many seconds of replay (in-flight requests finish).
    #[arg(long)]
    pub duration: Option<f64>,
    /// Use only the trace's first this-many seconds (trace time, before --time-scale).
    #[arg(long)]
    pub window: Option<f64>,
    /// Send at most this many requests.
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Shorten prompts so prompt + output fit this engine context (tokens); the
    /// emulator profiles' context is 32,768 and Mooncake prompts reach 120k.
    #[arg(long)]
    pub max_context_tokens: Option<u64>,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 300.0)]
    pub timeout_s: f64,
    /// `model` field of the requests.
    #[arg(long, default_value = gorgo_workload::DEFAULT_MODEL)]
    pub model: String,
    /// Do not send `ignore_eos: true` (engines may then stop before `max_tokens`).
    #[arg(long)]
    pub no_ignore_eos: bool,
    /// No progress bars.
    #[arg(long)]
    pub no_progress: bool,
}

/// `s` seconds of flag `--<flag>`: positive, and short enough for a `Duration` (a
/// flag error, not a panic, for `1e300`).
fn flag_secs(flag: &str, s: f64) -> anyhow::Result<Duration> {
    if !(s.is_finite() && s > 0.0) {
        anyhow::bail!("--{flag} must be a positive number of seconds, got {s}");
    }
    Duration::try_from_secs_f64(s).map_err(|e| anyhow::anyhow!("--{flag} {s}: {e}"))
}

impl LoadArgs {
    /// The workload flags that are checked before anything is read or started.
    fn check(&self) -> anyhow::Result<()> {
        if !(self.time_scale.is_finite() && self.time_scale >= 0.0) {
            anyhow::bail!(
                "--time-scale must be a finite number >= 0, got {}",
                self.time_scale
            );
        }
        if let Some(w) = self.window {
            if !(w.is_finite() && w > 0.0) {
                anyhow::bail!("--window must be a positive number of seconds, got {w}");
            }
        }
        // The replay refuses 0 too, but only once `compare` has started every cluster.
        if self.concurrency == Some(0) {
            anyhow::bail!("--concurrency must be at least 1");
        }
        if self.max_requests == Some(0) {
            anyhow::bail!("--max-requests must be at least 1");
        }
        super::sim::check_max_context_tokens(self.max_context_tokens)?;
        self.replay_config()?.validate().map_err(|e| match e {
            gorgo_bench::BenchError::InvalidConfig {
                field: "concurrency" | "max_in_flight",
                reason,
            } => anyhow::anyhow!("--concurrency {reason}"),
            e => e.into(),
        })
    }

    fn replay_config(&self) -> anyhow::Result<ReplayConfig> {
        let mode = match self.mode {
            Mode::Open => LoadMode::Open {
                time_scale: self.time_scale,
            },
            Mode::Closed => LoadMode::Closed {
                concurrency: self.concurrency.unwrap_or(64),
            },
        };
        Ok(ReplayConfig {
            mode,
            max_in_flight: match self.mode {
                Mode::Open => self.concurrency,
                Mode::Closed => None,
            },
            duration: self
                .duration
                .map(|d| flag_secs("duration", d))
                .transpose()?,
            max_requests: self.max_requests,
            request_timeout: flag_secs("timeout-s", self.timeout_s)?,
            ..ReplayConfig::default()
        })
    }

    fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "mode": match self.mode { Mode::Open => "open", Mode::Closed => "closed" },
            "time_scale": self.time_scale,
            "concurrency": self.concurrency,
            "duration_s": self.duration,
            "window_s": self.window,
            "max_requests": self.max_requests,
            "max_context_tokens": self.max_context_tokens,
            "timeout_s": self.timeout_s,
            "model": self.model,
            "ignore_eos": !self.no_ignore_eos,
        })
    }
}

/// Arguments of `gorgo bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Trace file (Mooncake JSONL, ART-Chat, Azure CSV, generator JSONL).
    #[arg(long)]
    pub trace: PathBuf,
    /// The cluster: a `gorgo up` run dir, its cluster.json, or `region=url,...`.
    #[arg(long)]
    pub cluster: String,
    /// Name of this run in the results (e.g. the policy the cluster runs).
    #[arg(long, default_value = "bench")]
    pub label: String,
    /// Send `x-gorgo-policy: <P>` with every request (per-request policy override;
    /// the nodes must allow it: `routing.allow_policy_header`, `gorgo up
    /// --allow-policy-header`).
    #[arg(long)]
    pub policy: Option<String>,
    /// Where results.json, table.md, requests.csv and the plots go.
    #[arg(long, default_value = "out/bench")]
    pub out: PathBuf,
    #[command(flatten)]
    pub load: LoadArgs,
}

/// `gorgo bench`: replay a trace against a running cluster and report.
pub fn run_bench(args: BenchArgs) -> anyhow::Result<()> {
    super::init_tracing();
    args.load.check()?;
    let cluster = ClusterInfo::parse_spec(&args.cluster)
        .with_context(|| format!("--cluster {}", args.cluster))?;
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    if let Some(policy) = &args.policy {
        runtime.block_on(check_policy_honoured(&cluster, policy))?;
    }
    let mut requests = read_workload(&args.trace, &args.load)?;
    let mut cfg = args.load.describe();
    prepare(&mut requests, &args.load, &mut cfg);
    let requests = Arc::new(requests);
    let mut config = args.load.replay_config()?;
    config.policy_header = args.policy.clone();
    if !args.load.no_progress {
        config.progress = Some(indicatif::ProgressBar::new(0));
    }
    let items = replay_items(&requests, &cluster.region_names());
    let bodies = body_builder(
        requests.clone(),
        args.load.model.clone(),
        !args.load.no_ignore_eos,
    );
    let output = runtime.block_on(async {
        let cancel = cancel_on_ctrl_c(None);
        gorgo_bench::replay(&cluster, items, bodies, &config, cancel.cancelled()).await
    })?;
    let label = args.policy.clone().unwrap_or(args.label.clone());
    let tuning = runtime.block_on(gorgo_bench::cluster::fetch_tuning(&cluster, &label));
    // The same trajectory in the paper's ES trace format, to compare with
    // ../shared/data/reference/paper_es_tune_trace_apr5.jsonl.
    let es_trace = runtime.block_on(gorgo_bench::cluster::fetch_es_trace(&cluster, &label));
    if !es_trace.is_empty() {
        std::fs::create_dir_all(&args.out)
            .with_context(|| format!("creating {}", args.out.display()))?;
        let path = args.out.join("es_trace.jsonl");
        gorgo_bench::cluster::write_jsonl(&path, &es_trace)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let interrupted = output.cancelled;
    let runs = vec![PolicyRun {
        policy: label,
        regions: cluster.region_names(),
        output,
        tuning,
    }];
    cfg["command"] = "bench".into();
    cfg["trace"] = args.trace.display().to_string().into();
    cfg["cluster"] = serde_json::to_value(&cluster)?;
    let table = gorgo_bench::report::write_report(&args.out, cfg, &runs)?;
    finish(&args.out, &table, &runs, interrupted)
}

/// `--policy P` labels the run `P`, so every node must route with `P`: by honouring
/// the `x-gorgo-policy` header (`routing.allow_policy_header`, as `/admin/state`
/// reports it) or by running `P` itself. A node that would ignore the header and route
/// with its own policy is an error, naming it, before anything is sent: its results
/// would be another policy's under `P`'s name. A region without an admin URL (a
/// cluster given as `region=url,...`) cannot be checked; it is named on stderr.
async fn check_policy_honoured(cluster: &ClusterInfo, policy: &str) -> anyhow::Result<()> {
    let wanted =
        gorgo_node::route::parse_policy(policy).map_err(|e| anyhow::anyhow!("--policy: {e}"))?;
    let fix = "start the cluster with `gorgo up --allow-policy-header` (or set \
               `routing.allow_policy_header = true` in the node configs), or drop --policy";
    let mut unchecked = Vec::new();
    let admin = |name: &str| {
        cluster
            .regions
            .iter()
            .find(|r| r.name == name)
            .and_then(|r| r.admin_url.clone())
    };
    for (region, state) in gorgo_bench::cluster::fetch_states(cluster).await {
        let Some(state) = state else {
            match admin(&region) {
                None => unchecked.push(region),
                Some(url) => anyhow::bail!(
                    "--policy {policy}: the node of region {region} did not answer \
                     {url}/admin/state, so whether it honours x-gorgo-policy is unknown"
                ),
            }
            continue;
        };
        if state["allow_policy_header"] == true {
            continue;
        }
        let runs =
            serde_json::from_value::<gorgo_core::policy::PolicyKind>(state["policy"].clone()).ok();
        if runs == Some(wanted) {
            continue;
        }
        let runs = runs.map_or_else(|| "an unknown policy".to_owned(), |k| format!("`{k}`"));
        let why = if state.get("allow_policy_header").is_some() {
            "its routing.allow_policy_header is off"
        } else {
            "it does not report routing.allow_policy_header (an older node)"
        };
        anyhow::bail!(
            "--policy {policy}: the node of region {region} routes with {runs} and would \
             ignore x-gorgo-policy ({why}), so the run would be mislabelled; {fix}"
        );
    }
    if !unchecked.is_empty() {
        eprintln!(
            "warning: --policy {policy}: no admin URL for {}: not checked that those nodes \
             honour x-gorgo-policy",
            unchecked.join(", ")
        );
    }
    Ok(())
}

/// Arguments of `gorgo compare`.
#[derive(clap::Args, Debug)]
pub struct CompareArgs {
    /// Trace file (Mooncake JSONL, ART-Chat, Azure CSV, generator JSONL).
    #[arg(long)]
    pub trace: PathBuf,
    /// Topology of every cluster.
    #[arg(long, default_value = "configs/topologies/three-region.toml")]
    pub topology: PathBuf,
    /// Comma-separated policies, one cluster each.
    #[arg(long, default_value = MAIN_POLICIES)]
    pub policies: String,
    /// Output dir (results.json, table.md, requests.csv, plots; cluster logs per policy).
    #[arg(long)]
    pub out: PathBuf,
    /// One policy after the other instead of all clusters at once.
    #[arg(long)]
    pub sequential: bool,
    /// Engine profile of the emulators.
    #[arg(long, default_value = DEFAULT_ENGINE_PROFILE)]
    pub engine_profile: String,
    /// Engine emulators per region in every cluster (`gorgo up --replicas`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16))]
    pub replicas: u16,
    /// Every node's `engine.max_running_requests` (`gorgo up --engine-max-running`):
    /// state the engines' concurrency limit where they do not report it (the emulators
    /// do: their nodes read it from `/get_server_info`).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub engine_max_running: Option<u32>,
    /// First port of the first cluster; each further cluster gets the next block.
    /// Away from `gorgo up`'s default (7100) so a cluster already running there is
    /// never mistaken for one of ours.
    #[arg(long, default_value_t = DEFAULT_BASE_PORT)]
    pub base_port: u16,
    /// Ports between two clusters' blocks.
    #[arg(long, default_value_t = 100)]
    pub port_stride: u16,
    /// Seconds to wait for one cluster to be ready.
    #[arg(long, default_value_t = 120.0)]
    pub up_timeout_s: f64,
    #[command(flatten)]
    pub load: LoadArgs,
}

/// `gorgo compare`: every policy on the same workload, one cluster each.
pub fn run_compare(args: CompareArgs) -> anyhow::Result<()> {
    super::init_tracing();
    args.load.check()?;
    let mut requests = read_workload(&args.trace, &args.load)?;
    let mut cfg = args.load.describe();
    prepare(&mut requests, &args.load, &mut cfg);
    cfg["command"] = "compare".into();
    cfg["trace"] = args.trace.display().to_string().into();
    compare_and_report(&args, requests, cfg)
}

fn compare_and_report(
    args: &CompareArgs,
    requests: Vec<TraceRequest>,
    mut cfg: serde_json::Value,
) -> anyhow::Result<()> {
    if !args.topology.is_file() {
        anyhow::bail!("--topology {}: no such file", args.topology.display());
    }
    super::create_out_dir(&args.out)?;
    let out = args.out.canonicalize()?;
    let spec = compare_spec(
        args,
        std::env::current_exe().context("locating the gorgo binary")?,
        args.topology.canonicalize()?,
        out.clone(),
    )?;
    cfg["topology"] = args.topology.display().to_string().into();
    cfg["policies"] = serde_json::to_value(&spec.policies)?;
    cfg["sequential"] = args.sequential.into();
    cfg["engine_profile"] = args.engine_profile.clone().into();
    cfg["replicas"] = args.replicas.into();
    cfg["engine_max_running"] = args.engine_max_running.into();
    let requests = Arc::new(requests);
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    let comparison = runtime.block_on(async {
        let cancel = cancel_on_ctrl_c(Some(out.clone()));
        gorgo_bench::compare(&spec, requests, cancel).await
    })?;
    if comparison.runs.is_empty() {
        anyhow::bail!("interrupted before any policy finished: no report");
    }
    let table = gorgo_bench::report::write_comparison_report(&out, cfg, &comparison)?;
    finish(&out, &table, &comparison.runs, comparison.interrupted())?;
    if !comparison.failed.is_empty() {
        let failures: Vec<String> = comparison
            .failed
            .iter()
            .map(|f| format!("{}: {}", f.policy, f.error))
            .collect();
        anyhow::bail!(
            "{}; the report covers the {} policies that finished",
            failures.join("; "),
            comparison.runs.len()
        );
    }
    Ok(())
}

/// What `compare` runs, from its arguments: `exe` provides `up` and `down`, `topology`
/// and `out` as the clusters are to see them.
fn compare_spec(
    args: &CompareArgs,
    exe: PathBuf,
    topology: PathBuf,
    out: PathBuf,
) -> anyhow::Result<CompareSpec> {
    let policies = args
        .policies
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(str::to_owned)
        .collect();
    let mut up_args = Vec::new();
    if args.replicas > 1 {
        up_args.extend(["--replicas".to_owned(), args.replicas.to_string()]);
    }
    if let Some(n) = args.engine_max_running {
        up_args.extend(["--engine-max-running".to_owned(), n.to_string()]);
    }
    Ok(CompareSpec {
        exe,
        topology,
        policies,
        out,
        sequential: args.sequential,
        engine_profile: Some(args.engine_profile.clone()),
        up_args,
        base_port: args.base_port,
        port_stride: args.port_stride,
        // As `up_args` lay the cluster out (no --kv-events among them).
        cluster_ports: super::up::cluster_port_span(args.replicas, false),
        up_timeout: flag_secs("up-timeout-s", args.up_timeout_s)?,
        replay: args.load.replay_config()?,
        model: args.load.model.clone(),
        ignore_eos: !args.load.no_ignore_eos,
        progress: (!args.load.no_progress).then(indicatif::MultiProgress::new),
    })
}

/// Arguments of `gorgo demo` (all optional: the demo needs none).
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Where the report goes.
    #[arg(long, default_value = "out/demo")]
    pub out: PathBuf,
    /// Seed of the generated workload.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Users of the generated workload (12 with seed 7: 149 requests over 90 s of
    /// replay, 1.7 req/s per cluster, which loads `paper-a100-mistral7b` emulators
    /// without overloading them).
    #[arg(long, default_value_t = 12)]
    pub users: u32,
    /// Seconds of generated trace (each user's ART-Chat-like 30-minute activity).
    #[arg(long, default_value_t = 1800.0)]
    pub trace_seconds: f64,
    /// Replay speed: trace seconds are multiplied by this.
    #[arg(long, default_value_t = 1.0 / 20.0)]
    pub time_scale: f64,
    /// Comma-separated policies.
    #[arg(long, default_value = MAIN_POLICIES)]
    pub policies: String,
    /// Engine profile of the emulators.
    #[arg(long, default_value = DEFAULT_ENGINE_PROFILE)]
    pub engine_profile: String,
    /// One policy after the other instead of all clusters at once.
    #[arg(long)]
    pub sequential: bool,
}

/// `gorgo demo`: three regions, a seeded generated workload, every main policy.
pub fn run_demo(args: DemoArgs) -> anyhow::Result<()> {
    let load = demo_load(&args)?;
    super::create_out_dir(&args.out)?;
    let topology = args.out.join("three-region.toml");
    std::fs::write(&topology, DEMO_TOPOLOGY)
        .with_context(|| format!("writing {}", topology.display()))?;
    let generator = gorgo_workload::GeneratorConfig {
        seed: args.seed,
        users: args.users,
        duration_s: args.trace_seconds,
        ..gorgo_workload::GeneratorConfig::default()
    };
    let mut requests = gorgo_workload::generate(&generator).context("generating the workload")?;
    eprintln!(
        "gorgo demo: {} requests from {} users over {:.0} s of trace, replayed at x{} ({:.0} s), policies {}",
        requests.len(),
        args.users,
        args.trace_seconds,
        args.time_scale,
        args.trace_seconds * args.time_scale,
        args.policies
    );
    let compare = CompareArgs {
        trace: PathBuf::from("(generated)"),
        topology,
        policies: args.policies.clone(),
        out: args.out.clone(),
        sequential: args.sequential,
        engine_profile: args.engine_profile.clone(),
        replicas: 1,
        engine_max_running: None,
        base_port: DEFAULT_BASE_PORT,
        port_stride: 100,
        up_timeout_s: 120.0,
        load,
    };
    let mut cfg = compare.load.describe();
    cfg["command"] = "demo".into();
    cfg["trace"] = "generated".into();
    cfg["generator"] = serde_json::to_value(&generator)?;
    prepare(&mut requests, &compare.load, &mut cfg);
    // The demo's output is the table: only warnings from the libraries (RUST_LOG
    // still overrides).
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .try_init();
    let clusters = compare.policies.split(',').count();
    if args.sequential {
        eprintln!(
            "starting {clusters} clusters one after the other (logs under {}), replaying on each...",
            args.out.display()
        );
    } else {
        eprintln!(
            "starting {clusters} clusters (logs under {}), then replaying on all at once...",
            args.out.display()
        );
    }
    compare_and_report(&compare, requests, cfg)
}

/// The demo's load, checked before anything starts: the replay refuses a bad
/// `--time-scale` too, but only once every cluster is up.
fn demo_load(args: &DemoArgs) -> anyhow::Result<LoadArgs> {
    let load = LoadArgs {
        time_scale: args.time_scale,
        mode: Mode::Open,
        concurrency: None,
        duration: None,
        window: None,
        max_requests: None,
        max_context_tokens: Some(32_768),
        timeout_s: 120.0,
        model: gorgo_workload::DEFAULT_MODEL.into(),
        no_ignore_eos: false,
        no_progress: false,
    };
    load.check()?;
    Ok(load)
}

/// Read the workload, cut to `--window` and `--max-requests` as `gorgo sim` cuts it
/// (`gorgo_workload::select_requests`).
fn read_workload(path: &Path, load: &LoadArgs) -> anyhow::Result<Vec<TraceRequest>> {
    let requests =
        gorgo_workload::select_requests(path, load.window, load.max_requests.map(|n| n as u64))
            .and_then(|rows| rows.collect::<Result<Vec<_>, _>>())
            .with_context(|| format!("--trace {}", path.display()))?;
    if requests.is_empty() {
        anyhow::bail!("{}: no requests in the selected window", path.display());
    }
    Ok(requests)
}

/// Rebase arrivals to start at 0 and fit prompts to `--max-context-tokens`; records
/// what it changed in `cfg`.
fn prepare(requests: &mut [TraceRequest], load: &LoadArgs, cfg: &mut serde_json::Value) {
    rebase(requests);
    if let Some(max) = load.max_context_tokens {
        let n = clamp_context(requests, max);
        if n > 0 {
            eprintln!("{n} prompts shortened to fit a {max}-token context");
        }
        cfg["prompts_shortened"] = n.into();
    }
    cfg["requests_in_workload"] = requests.len().into();
}

/// A token cancelled on the first Ctrl-C or SIGTERM (a `kill`, a CI timeout), so
/// replays stop and clusters are torn down rather than left running. A second signal
/// exits at once (status 130), as it would have without the handler: a teardown that
/// hangs (a node that does not stop) is the operator's to cut short. `clusters_in`:
/// the `--out` of `compare` and `demo`, under which each policy's cluster runs, for
/// the hint that stops one left running.
fn cancel_on_ctrl_c(clusters_in: Option<PathBuf>) -> CancellationToken {
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    tokio::spawn(async move {
        if super::shutdown_signal().await.is_ok() {
            eprintln!(
                "interrupted: stopping replays and tearing clusters down (again to exit now)"
            );
            c.cancel();
            if super::shutdown_signal().await.is_ok() {
                match clusters_in {
                    Some(out) => {
                        eprintln!("interrupted again: exiting; {}", left_running_hint(&out))
                    }
                    None => eprintln!("interrupted again: exiting"),
                }
                std::process::exit(130);
            }
        }
    });
    cancel
}

/// What stops a cluster of `compare` (output dir `out`) that a second signal left
/// running: `gorgo down` on its run dir, `<out>/<policy>/run` (`gorgo_bench::compare`).
fn left_running_hint(out: &Path) -> String {
    format!(
        "a cluster being torn down may be left running (`gorgo down --run-dir {}` stops it)",
        out.join("POLICY").join("run").display()
    )
}

/// Print the table of the report written to `out`; an error (a non-zero exit) when
/// the run was `interrupted` (the report covers only what finished: its
/// `config.cancelled` names what was cut short) or when every request failed (an
/// unreachable cluster, say), else the count of failed requests on stderr.
fn finish(out: &Path, table: &str, runs: &[PolicyRun], interrupted: bool) -> anyhow::Result<()> {
    outln!("{table}");
    let failed: usize = runs.iter().map(|r| r.output.failed()).sum();
    let sent: usize = runs.iter().map(|r| r.output.outcomes.len()).sum();
    outln!("report: {}", out.display());
    if interrupted {
        anyhow::bail!("interrupted: the report covers what finished");
    }
    if sent > 0 && failed == sent {
        anyhow::bail!("every request failed ({failed} of {sent}; see requests.csv)");
    }
    if failed > 0 {
        eprintln!("{failed} requests failed (see requests.csv)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Demo {
        #[command(flatten)]
        args: DemoArgs,
    }

    #[derive(Parser)]
    struct Load {
        #[command(flatten)]
        args: LoadArgs,
    }

    fn load(argv: &[&str]) -> LoadArgs {
        Load::try_parse_from(std::iter::once("t").chain(argv.iter().copied()))
            .unwrap()
            .args
    }

    #[test]
    fn demo_needs_no_arguments() {
        let d = Demo::try_parse_from(["demo"]).unwrap().args;
        assert_eq!(d.policies.split(',').count(), 6);
        assert_eq!(d.engine_profile, DEFAULT_ENGINE_PROFILE);
        assert!(DEMO_TOPOLOGY.contains("us-ashburn"));
        demo_load(&d).unwrap();
    }

    /// The demo's `--time-scale` is checked before anything starts (the replay
    /// refused it only once every cluster was up).
    #[test]
    fn a_demo_time_scale_the_replay_refuses_is_refused_first() {
        let d = Demo::try_parse_from(["demo", "--time-scale=-1"])
            .unwrap()
            .args;
        let err = demo_load(&d).unwrap_err().to_string();
        assert!(err.contains("--time-scale"), "{err}");
    }

    /// Each cluster's block grows with `--replicas` (replica k's engine at base + 10 +
    /// 6 (k - 1)): a stride that fits one engine a region overlaps the next cluster's
    /// block with two, and is refused before anything starts.
    #[test]
    fn the_port_stride_check_counts_the_replicas() {
        #[derive(Parser)]
        struct Compare {
            #[command(flatten)]
            args: CompareArgs,
        }
        let spec = |argv: &[&str]| {
            let base = [
                "compare",
                "--trace",
                "t.jsonl",
                "--out",
                "o",
                "--no-progress",
                "--policies",
                "p1,p2",
            ];
            let args = Compare::try_parse_from(base.iter().chain(argv))
                .unwrap()
                .args;
            compare_spec(&args, "gorgo".into(), "t.toml".into(), "o".into()).unwrap()
        };
        assert!(spec(&["--port-stride", "7"]).validate().is_ok());
        let two = spec(&["--replicas", "2", "--port-stride", "7"]);
        assert_eq!(two.up_args, ["--replicas", "2"]);
        let err = two.validate().unwrap_err().to_string();
        assert!(
            err.contains("port_stride") && err.contains("11 ports"),
            "{err}"
        );
        assert!(spec(&["--replicas", "2", "--port-stride", "11"])
            .validate()
            .is_ok());
        // The most replicas fit the default stride.
        assert!(spec(&["--replicas", "16"]).validate().is_ok());
        // Blocks that run past the last port blame the base, not the stride.
        let err = spec(&["--base-port", "65500"])
            .validate()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`base_port`") && !err.contains("`port_stride`"),
            "{err}"
        );
        // With KV events, each engine's two ports lie above it too.
        assert_eq!(super::super::up::cluster_port_span(1, true), 9);
        assert_eq!(super::super::up::cluster_port_span(2, true), 16);
    }

    #[test]
    fn load_flags_become_a_replay_config() {
        let c = load(&[
            "--time-scale",
            "0.5",
            "--concurrency",
            "8",
            "--duration",
            "30",
        ])
        .replay_config()
        .unwrap();
        assert_eq!(c.mode, LoadMode::Open { time_scale: 0.5 });
        assert_eq!(c.max_in_flight, Some(8));
        assert_eq!(c.duration, Some(Duration::from_secs(30)));
        let c = load(&["--mode", "closed"]).replay_config().unwrap();
        assert_eq!(c.mode, LoadMode::Closed { concurrency: 64 });
        assert_eq!(c.max_in_flight, None);
        for (bad, field) in [
            ("--timeout-s=0", "timeout-s"),
            ("--duration=-1", "duration"),
            // Past what a `Duration` holds: a flag error, not a panic.
            ("--timeout-s=1e300", "timeout-s"),
            ("--duration=1e300", "duration"),
        ] {
            let err = load(&[bad]).replay_config().unwrap_err().to_string();
            assert!(err.contains(field), "{err}");
        }
        assert!(flag_secs("up-timeout-s", 1e300)
            .unwrap_err()
            .to_string()
            .contains("--up-timeout-s"));
    }

    /// Workload flags that would select nothing sensible are refused, naming the
    /// flag, before the trace is read.
    #[test]
    fn odd_workload_flags_are_refused_naming_them() {
        for (bad, flag) in [
            ("--window=NaN", "--window"),
            ("--window=0", "--window"),
            ("--max-context-tokens=0", "--max-context-tokens"),
            ("--max-requests=0", "--max-requests"),
            ("--time-scale=NaN", "--time-scale"),
            ("--timeout-s=1e300", "--timeout-s"),
            // The replay refused it too, but only after `compare` had started every
            // cluster; closed loop or open.
            ("--concurrency=0", "--concurrency"),
            // Past what a client machine drives (two million clients took 6 GB).
            ("--concurrency=2000000", "--concurrency"),
            // Below the chat template, a prompt token and an output token: the output
            // overflowed the limit, silently.
            ("--max-context-tokens=1", "--max-context-tokens"),
            ("--max-context-tokens=65", "--max-context-tokens"),
        ] {
            let err = load(&[bad]).check().unwrap_err().to_string();
            assert!(err.contains(flag), "{bad}: {err}");
        }
        load(&["--window=30", "--max-context-tokens=32768"])
            .check()
            .unwrap();
        let err = load(&["--mode=closed", "--concurrency=0"])
            .check()
            .unwrap_err()
            .to_string();
        assert!(err.contains("--concurrency"), "{err}");
        let err = load(&["--mode=closed", "--concurrency=2000000"])
            .check()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--concurrency") && err.contains("65536"),
            "{err}"
        );
        load(&[
            "--mode=closed",
            "--concurrency=65536",
            "--max-context-tokens=66",
        ])
        .check()
        .unwrap();
    }

    /// The hint a second Ctrl-C prints is a command `gorgo down` takes (it said
    /// `gorgo down RUN_DIR`, and `down` has no positional argument), on the run dir
    /// `compare` gives each policy's cluster.
    #[test]
    fn the_hint_after_a_second_signal_is_a_valid_down_command() {
        #[derive(Parser)]
        struct Down {
            #[command(flatten)]
            args: super::super::up::DownArgs,
        }
        let hint = left_running_hint(Path::new("/tmp/cmp"));
        let command = hint.split('`').nth(1).expect("a command in backticks");
        let mut words = command.split_whitespace();
        assert_eq!(words.next(), Some("gorgo"), "{hint}");
        assert_eq!(words.next(), Some("down"), "{hint}");
        let down = Down::try_parse_from(std::iter::once("down").chain(words))
            .unwrap_or_else(|e| panic!("{hint}: {e}"))
            .args;
        assert_eq!(down.run_dir, Path::new("/tmp/cmp/POLICY/run"));
    }
}
