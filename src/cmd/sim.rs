//! `gorgo sim`: replay a trace through the discrete-event simulator (crates/gorgo-sim)
//! for each policy and write the report of `gorgo compare` (results.json, table.md,
//! requests.csv, plots, tuning.jsonl with `--tune`) plus `sim.json` (conservation
//! counters, speed, the distributed-vs-oracle gap).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Instant;

use anyhow::{bail, Context};
use gorgo_core::es::TrialDesign;
use gorgo_core::policy::PolicyKind;
use gorgo_core::Weights;
use gorgo_engine::Profile;
use gorgo_netem::Topology;
use gorgo_sim::report::{build_report, oracle_gap};
use gorgo_sim::{simulate, Network, PolicyRun, Progress, RegionNet, SimConfig, SimError};
use gorgo_workload::{TraceRequest, WorkloadError};
use serde_json::json;

/// Every policy, then the oracle: what `--policies all` runs.
const ALL_POLICIES: &str = "gorgo,gorgo-ttft,gorgo-paper,least-load,least-request,prefix-cache,session-affinity,simple-session-affinity,cache-aware,round-robin,random,local-only,oracle";

/// Arguments of this subcommand.
#[derive(clap::Args, Debug)]
pub struct SimArgs {
    /// Trace file (Mooncake, ART-Chat, Azure or generator JSONL; format detected).
    #[arg(long)]
    trace: PathBuf,
    /// Comma-separated policies (`oracle` included), or `all`.
    #[arg(long, default_value = DEFAULT_POLICIES)]
    policies: String,
    /// Multiplies inter-arrival times (< 1 compresses the trace and loads the engines).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Run the distributed tuning protocol for the policies that use weights; writes
    /// `tuning.jsonl`.
    #[arg(long)]
    tune: bool,
    /// Tuning trial window, requests cluster-wide (default: the core's); with `--tune`
    /// only.
    #[arg(long)]
    tuning_window: Option<usize>,
    /// Tuning trial design: `interleaved` (the default: candidate and incumbent in one
    /// window, by a hash of each request), `switchback` (in one window, by blocks of
    /// time) or `sequential` (adjacent windows); with `--tune` only.
    #[arg(long, value_parser = parse_trial)]
    trial: Option<TrialDesign>,
    /// Fixed weights `W_RTT,W_QUEUE` for the policies that use weights (with
    /// `--tune`: where tuning starts). Default: each policy's own.
    #[arg(long, value_parser = parse_weights)]
    weights: Option<Weights>,
    /// The tuner's initial step size (log space; default the core's 0.5). A tiny one
    /// (0.01) makes every trial compare nearly equal weights: its log ratios are the
    /// trial design's noise. With `--tune` only.
    #[arg(long)]
    tuning_sigma: Option<f64>,
    /// Set a `[tuning]` key (as in a node's config) on the policy's tuning defaults,
    /// `KEY=VALUE` (a JSON value, e.g. `max_trial_windows=2`); repeatable; with
    /// `--tune` only. Applied after `--tuning-sigma`; `--weights` and
    /// `--tuning-window` win over it.
    #[arg(long = "tuning-set", value_parser = parse_key_value)]
    tuning_set: Vec<(String, serde_json::Value)>,
    /// Per-request rows kept per policy for requests.csv and exact percentiles; longer
    /// runs report from sketches (1% accuracy) and write no rows.
    #[arg(long, default_value_t = 200_000)]
    max_rows: usize,
    /// Write `decisions.jsonl`: each policy's first N routing decisions (client
    /// requests, forwards, refusals), each as the deciding node's `/admin/decisions`
    /// shows it plus the node's name, to compare with a live run's decision by decision.
    #[arg(long, default_value_t = 0)]
    decisions: usize,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    model: SimModelArgs,
}

/// The policies `gorgo sim` (and `gorgo sweep`) run by default: the main ones and the
/// oracle.
pub const DEFAULT_POLICIES: &str =
    "gorgo,least-load,least-request,prefix-cache,session-affinity,simple-session-affinity,oracle";

/// What the simulated system is (topology, engines, gossip, routing guard) and which
/// part of the trace it replays: shared by `gorgo sim` and `gorgo sweep`.
#[derive(clap::Args, Debug, Clone)]
pub struct SimModelArgs {
    /// Topology TOML (regions, client delays, one-way delay matrix, jitter, rate).
    #[arg(long, default_value = "configs/topologies/three-region.toml")]
    pub topology: PathBuf,
    /// Seed of jitter, gossip phases, tie-breaks and tuning mutations.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Salt of the home-region hash (default: the same assignment as `gorgo bench`).
    #[arg(long)]
    pub region_seed: Option<u64>,
    /// Engine profile name or TOML file, for every region.
    #[arg(long, default_value = "paper-a100-mistral7b")]
    pub engine_profile: String,
    /// Engines per region (replicas), each with the engine profile: every node decides
    /// over its own engines and every peer's (docs/design.md, "Replicas").
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// Gossip interval (summaries, queue stats, tuning ticks), ms.
    #[arg(long, default_value_t = 250.0)]
    pub gossip_interval_ms: f64,
    /// Extra gossip transit delay on top of the one-way delay, ms.
    #[arg(long, default_value_t = 0.0)]
    pub gossip_delay_ms: f64,
    /// Probability that a gossip message is lost (seeded by --seed), in [0, 1):
    /// exercises the receivers' reorder buffers and snapshot requests.
    #[arg(long, default_value_t = 0.0)]
    pub gossip_loss: f64,
    /// The max-hops guard.
    #[arg(long, default_value_t = 1)]
    pub max_hops: u8,
    /// Only requests with a trace timestamp before this many seconds (as `gorgo
    /// compare --window`).
    #[arg(long)]
    pub window_s: Option<f64>,
    /// Only the first this many requests.
    #[arg(long)]
    pub max_requests: Option<u64>,
    /// Shorten prompts so prompt + output fit this many tokens, as `gorgo compare
    /// --max-context-tokens` does (default: leave them; longer ones fail).
    #[arg(long)]
    pub max_context_tokens: Option<u64>,
    /// Hash prompts as a live replay does (synthesised chat body, node rendering,
    /// 256-byte blocks) rather than from trace block ids; slower, for comparisons with
    /// `gorgo compare`.
    #[arg(long)]
    pub live_chains: bool,
    /// Idealisation: nodes decide on and gossip their engines' exact state. By default
    /// each node knows what a deployed node knows: its own view of its engine (its
    /// dispatches, first tokens and finishes, and the engine's `/metrics` scraped every
    /// `--metrics-interval-ms`), computed by the node's code (gorgo-core `EngineView`).
    #[arg(long)]
    pub exact_state: bool,
    /// A bound for distributed routers: the oracle knows another region's forward in
    /// transit only once news of it could have reached the deciding region (the
    /// topology's one-way delay), not at once; engine state stays exact
    /// (docs/policy.md, "What the oracle knows that no node can").
    #[arg(long)]
    pub causal_oracle: bool,
    /// The engines do not report their concurrency limit and no node is told it, as
    /// with vLLM or llama-cpp-python's server. By default every node knows its
    /// engine's limit (the profile's `max_running_requests`), as a node reads it from
    /// SGLang's `/get_server_info`, llama.cpp's `/props` or the emulator, and its queue
    /// estimate counts the decode of the requests holding the slots.
    #[arg(long)]
    pub unreported_max_running: bool,
    /// Period of each node's `/metrics` scrape, ms (the node's
    /// `engine.metrics_interval_ms`).
    #[arg(long, default_value_t = gorgo_core::accounting::DEFAULT_METRICS_INTERVAL_MS as f64)]
    pub metrics_interval_ms: f64,
    /// Summary sample (the nodes' `cluster.summary_sample`): `auto` (by the
    /// topology's peer count: 1 up to 4 peers, 2 up to 8, 4 up to 16, 8 up to 32) or a power
    /// of two from 1 to 64.
    #[arg(long, default_value = "auto")]
    pub summary_sample: gorgo_core::summary::SampleSetting,
    /// Each node's prefix index follows its engine's KV events (the cache's stores and
    /// evictions, after `--kv-events-delay-ms`) instead of its shadow model
    /// (docs/kv-events.md).
    #[arg(long)]
    pub kv_events: bool,
    /// The KV events' transit delay from engine to node, ms.
    #[arg(long, default_value_t = 2.0)]
    pub kv_events_delay_ms: f64,
    /// Whether a forward's target refuses it when serving it there would cost more than
    /// the forwarding node's own engine (the nodes' `routing.refuse_forwards`;
    /// docs/policy.md, "Refusal at the target").
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub refuse_forwards: bool,
    /// Late binding, a candidate mechanism the live node does not have yet (0: off):
    /// each node holds a request it decided for its own engine while that engine has
    /// more than this many prefill tokens dispatched, and decides it again when an
    /// engine has room or once per gossip interval (docs/policy.md, "Late binding";
    /// 16384 is two chunks of SGLang's chunked prefill).
    #[arg(long, default_value_t = 0)]
    pub hold_tokens: u64,
    /// Share of requests whose client does not stream (`stream: false`), drawn by a
    /// hash of the request and the seed: their nodes see their first token only with
    /// the whole response, at the end, as a live node does.
    #[arg(long, default_value_t = 0.0)]
    pub non_streamed_share: f64,
}

impl SimModelArgs {
    /// The simulation config these flags describe (time scale 1, no tuning, the
    /// default row cap), validated.
    pub fn config(&self) -> anyhow::Result<SimConfig> {
        let topology = Topology::from_file(&self.topology)
            .with_context(|| format!("--topology {}", self.topology.display()))?;
        let profile = Profile::by_name_or_file(&self.engine_profile)
            .with_context(|| format!("--engine-profile {}", self.engine_profile))?;
        if let Some(w) = self.window_s {
            if !(w.is_finite() && w > 0.0) {
                bail!("--window-s must be > 0");
            }
        }
        if self.max_requests == Some(0) {
            bail!("--max-requests must be at least 1");
        }
        check_max_context_tokens(self.max_context_tokens)?;
        let mut cfg = SimConfig::new(network(&topology), profile);
        cfg.replicas = self.replicas;
        cfg.gossip_interval_ms = self.gossip_interval_ms;
        cfg.gossip_extra_delay_ms = self.gossip_delay_ms;
        cfg.gossip_loss = self.gossip_loss;
        cfg.max_hops = self.max_hops;
        cfg.seed = self.seed;
        cfg.region_seed = self.region_seed;
        cfg.max_requests = self.max_requests;
        cfg.max_context_tokens = self.max_context_tokens;
        cfg.live_chains = self.live_chains;
        cfg.exact_state = self.exact_state;
        cfg.causal_oracle = self.causal_oracle;
        cfg.unreported_max_running = self.unreported_max_running;
        cfg.metrics_interval_ms = self.metrics_interval_ms;
        cfg.summary_sample = self.summary_sample;
        cfg.kv_events = self.kv_events;
        cfg.kv_events_delay_ms = self.kv_events_delay_ms;
        cfg.refuse_forwards = self.refuse_forwards;
        cfg.hold_tokens = self.hold_tokens;
        cfg.non_streamed_share = self.non_streamed_share;
        validate(&cfg)?;
        Ok(cfg)
    }

    /// These flags for the report's `config`.
    pub fn describe(&self, cfg: &SimConfig) -> serde_json::Value {
        json!({
            "topology": self.topology.display().to_string(),
            "regions": cfg.network.names(),
            "engine_profile": cfg.profiles.first().map(|p| p.name.clone()),
            "replicas": cfg.replicas,
            "seed": self.seed,
            "region_seed": self.region_seed,
            "gossip_interval_ms": self.gossip_interval_ms,
            "gossip_delay_ms": self.gossip_delay_ms,
            "gossip_loss": self.gossip_loss,
            "max_hops": self.max_hops,
            "window_s": self.window_s,
            "max_requests": self.max_requests,
            "max_context_tokens": self.max_context_tokens,
            "live_chains": self.live_chains,
            "view": view_name(self.exact_state),
            "max_running_requests": if self.unreported_max_running { "unreported" } else { "reported" },
            "metrics_interval_ms": self.metrics_interval_ms,
            "decode_step_ms": cfg.decode_step_ms,
            "summary_sample": self.summary_sample.to_string(),
            "summary_sample_rate": cfg.summary_sample_rate().rate(),
            "oracle_view": oracle_view_name(self.causal_oracle),
            "kv_events": self.kv_events,
            "kv_events_delay_ms": self.kv_events_delay_ms,
            "refuse_forwards": self.refuse_forwards,
            "hold_tokens": self.hold_tokens,
            "non_streamed_share": self.non_streamed_share,
        })
    }
}

/// `--max-context-tokens` of `gorgo sim`, `sweep` and `bench`: room for the chat
/// template, a prompt token and an output token
/// ([`gorgo_workload::MIN_CONTEXT_TOKENS`]). Below it the prompt was shortened to one
/// token and the output overflowed the limit, silently.
pub fn check_max_context_tokens(max: Option<u64>) -> anyhow::Result<()> {
    let min = gorgo_workload::MIN_CONTEXT_TOKENS;
    if max.is_some_and(|m| m < min) {
        bail!(
            "--max-context-tokens must be at least {min} (the chat template's {} tokens, a \
             prompt token and an output token)",
            gorgo_workload::CHAT_TEMPLATE_TOKENS
        );
    }
    Ok(())
}

/// `cfg.validate()`, its error naming the flag that sets the field where one does
/// (`--replicas 0`, not `replicas`).
pub fn validate(cfg: &SimConfig) -> anyhow::Result<()> {
    match cfg.validate() {
        Ok(()) => Ok(()),
        Err(SimError::InvalidConfig { field, reason }) => {
            let flag = match field.as_str() {
                "gossip_extra_delay_ms" => Some("gossip-delay-ms"),
                "engine_profile" => Some("engine-profile"),
                "tuning_set" => Some("tuning-set"),
                f @ ("replicas"
                | "gossip_interval_ms"
                | "gossip_loss"
                | "time_scale"
                | "metrics_interval_ms"
                | "tuning_sigma"
                | "weights"
                | "tuning_window"
                | "kv_events_delay_ms"
                | "non_streamed_share") => Some(f),
                _ => None,
            };
            match flag {
                Some(f) => bail!("--{} {reason}", f.replace('_', "-")),
                None => bail!("simulation config: invalid {field}: {reason}"),
            }
        }
        Err(e) => Err(e).context("simulation config"),
    }
}

/// The cache-estimate error of a run (the client's node's predicted cached tokens for
/// its choice against the engine's count), for `sim.json`: percent of the prompt and
/// mean tokens, over the completed requests with a prediction.
fn cache_estimate_error(s: &gorgo_sim::Sketches) -> serde_json::Value {
    let pct = &s.cache_estimate_error_pct;
    let (sum, n) = s.cache_estimate_error_tokens;
    json!({
        "n": n,
        "mean_tokens": (n > 0).then(|| sum as f64 / n as f64),
        "mean_pct": pct.mean(),
        "p50_pct": pct.quantile(0.5),
        "p95_pct": pct.quantile(0.95),
    })
}

/// What the nodes know, as `sim.json` names it.
pub fn view_name(exact_state: bool) -> &'static str {
    if exact_state {
        "exact-state"
    } else {
        "node"
    }
}

/// What the oracle knows, as `sim.json` names it.
pub fn oracle_view_name(causal: bool) -> &'static str {
    if causal {
        "exact-state, causal forwards"
    } else {
        "exact-state"
    }
}

/// The line above the table saying what the nodes knew.
pub fn view_header(cfg: &SimConfig, with_oracle: bool) -> String {
    let mut line = if cfg.exact_state {
        "Simulated, view: exact-state (idealisation: every node decides on its engine's exact state)".to_owned()
    } else {
        format!(
            "Simulated, view: node (each node's own view of its engine: its dispatches and the engine's /metrics every {} ms)",
            cfg.metrics_interval_ms
        )
    };
    if cfg.replicas > 1 {
        line += &format!("; {} engines per region", cfg.replicas);
    }
    if cfg.hold_tokens > 0 {
        line += &format!(
            "; late binding above {} tokens (not in the live node)",
            cfg.hold_tokens
        );
    }
    if cfg.non_streamed_share > 0.0 {
        line += &format!(
            "; {:.0}% of clients not streaming",
            cfg.non_streamed_share * 100.0
        );
    }
    if with_oracle {
        line += if cfg.causal_oracle {
            "; oracle: exact-state, forwards known only once news of them could arrive (--causal-oracle)"
        } else {
            "; oracle: exact-state, perfect information"
        };
    }
    line
}

/// The simulator's network from a topology file.
fn network(t: &Topology) -> Network {
    Network {
        regions: t
            .regions
            .iter()
            .map(|r| RegionNet {
                name: r.name.clone(),
                client_delay_ms: r.client_delay_ms,
                client_jitter_ms: r.client_jitter_ms,
            })
            .collect(),
        one_way_ms: t.one_way_ms.clone(),
        jitter_ms: t.jitter_ms,
        rate_mbps: t.rate_mbps,
    }
}

/// `W_RTT,W_QUEUE`, both positive.
pub fn parse_weights(s: &str) -> Result<Weights, String> {
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    let [r, q] = parts.as_slice() else {
        return Err(format!("`{s}`: want W_RTT,W_QUEUE"));
    };
    // Positive (the simulator divides by them), and within what a node's config and
    // admin API take (`MAX_WEIGHT`): 1e300 was taken here alone.
    let max = gorgo_core::types::MAX_WEIGHT;
    let num = |v: &str| match v.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 && x <= max => Ok(x),
        _ => Err(format!("`{v}` is not a weight in (0, {max}]")),
    };
    Ok(Weights {
        w_rtt: num(r)?,
        w_queue: num(q)?,
    })
}

/// `KEY=VALUE`, the value read as JSON (a bare word is a string).
fn parse_key_value(s: &str) -> Result<(String, serde_json::Value), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}`: want KEY=VALUE"))?;
    let v = serde_json::from_str(v).unwrap_or_else(|_| serde_json::Value::String(v.to_owned()));
    Ok((k.trim().to_owned(), v))
}

/// `interleaved`, `switchback` or `sequential`.
pub fn parse_trial(s: &str) -> Result<TrialDesign, String> {
    match s {
        "interleaved" => Ok(TrialDesign::Interleaved),
        "switchback" => Ok(TrialDesign::Switchback),
        "sequential" => Ok(TrialDesign::Sequential),
        _ => Err(format!("`{s}`: want interleaved, switchback or sequential")),
    }
}

/// Policy names from a comma-separated list (`all`: every policy and the oracle).
pub fn parse_policies(list: &str) -> anyhow::Result<Vec<PolicyKind>> {
    let list = if list.trim() == "all" {
        ALL_POLICIES
    } else {
        list
    };
    let mut out = Vec::new();
    for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let k = PolicyKind::from_str(name).with_context(|| format!("--policies: `{name}`"))?;
        if !out.contains(&k) {
            out.push(k);
        }
    }
    if out.is_empty() {
        bail!("--policies: no policy given");
    }
    Ok(out)
}

/// The trace's requests `--window-s` and `--max-requests` select, the selection
/// `gorgo bench --window --max-requests` replays (`gorgo_workload::select_requests`:
/// trace time, before rebasing and `--time-scale`; in arrival order).
pub fn rows(
    path: &Path,
    model: &SimModelArgs,
) -> anyhow::Result<impl Iterator<Item = Result<TraceRequest, WorkloadError>>> {
    gorgo_workload::select_requests(path, model.window_s, model.max_requests)
        .with_context(|| format!("--trace {}", path.display()))
}

/// `decisions.jsonl`: every run's kept decisions, one JSON object a line, in run and
/// decision order.
fn write_decisions(path: &std::path::Path, runs: &[gorgo_sim::PolicyRun]) -> anyhow::Result<()> {
    let mut out = String::new();
    for line in runs.iter().flat_map(|r| &r.decisions) {
        out += &serde_json::to_string(line)?;
        out.push('\n');
    }
    gorgo_files::write_atomic(path, out.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

/// `floor.csv`: each request's floor beside requests.csv (`request_id` joins them), so
/// a policy's excess over what was possible can be taken apart per request
/// (`scripts/floor_gap.py`).
fn write_floors(path: &Path, floors: &[gorgo_sim::floor::RequestFloor]) -> anyhow::Result<()> {
    let mut text = String::from(
        "request_id,ttft_floor_ms,e2e_floor_ms,prompt_tokens,cached_floor_tokens,servable,cache_bound_tokens\n",
    );
    for f in floors {
        text.push_str(&format!(
            "r{},{:.3},{:.3},{},{},{},{}\n",
            f.index,
            f.ttft_ms,
            f.e2e_ms,
            f.prompt_tokens,
            f.cached_tokens,
            f.servable,
            f.cache_bound_tokens
        ));
    }
    gorgo_files::write_atomic(path, text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

/// Run the simulation for every policy and write the report.
pub fn run(args: SimArgs) -> anyhow::Result<()> {
    let policies = parse_policies(&args.policies)?;
    let mut cfg = args.model.config()?;
    cfg.time_scale = args.time_scale;
    cfg.tune = args.tune;
    cfg.tuning_window = args.tuning_window;
    cfg.trial = args.trial.unwrap_or_default();
    cfg.weights = args.weights;
    cfg.tuning_sigma = args.tuning_sigma;
    cfg.tuning_set = args.tuning_set.clone();
    cfg.max_rows = args.max_rows;
    cfg.decision_log = args.decisions;
    // Read only by a tuner: anywhere else each was recorded in results.json and did
    // nothing, a typo and all.
    let tuning_only = [
        ("--tuning-window", args.tuning_window.is_some()),
        ("--trial", args.trial.is_some()),
        ("--tuning-sigma", args.tuning_sigma.is_some()),
        ("--tuning-set", !args.tuning_set.is_empty()),
    ];
    if let Some((flag, _)) = tuning_only.iter().find(|(_, given)| *given) {
        if !policies.iter().any(|&k| cfg.tunes(k)) {
            bail!("{flag}: no effect without --tune and a policy that tunes (gorgo, say)");
        }
    }
    validate(&cfg)?;
    super::create_out_dir(&args.out)?;

    let mut config = json!({
        "mode": "sim",
        "trace": args.trace.display().to_string(),
        "policies": policies.iter().map(|p| p.as_str()).collect::<Vec<_>>(),
        "time_scale": args.time_scale,
        "tune": args.tune,
        "tuning_window": args.tuning_window,
        "trial": cfg.trial,
        "weights": args.weights,
        "tuning_sigma": args.tuning_sigma,
        "tuning_set": args.tuning_set.iter().cloned().collect::<serde_json::Map<_, _>>(),
    });
    if let (Some(c), serde_json::Value::Object(m)) =
        (config.as_object_mut(), args.model.describe(&cfg))
    {
        c.extend(m);
    }

    let mut runs: Vec<PolicyRun> = Vec::new();
    let mut speed = Vec::new();
    for kind in &policies {
        let started = Instant::now();
        let mut last_line = Instant::now();
        let name = kind.as_str();
        let mut progress = |p: Progress| {
            if last_line.elapsed().as_secs_f64() >= 1.0 {
                last_line = Instant::now();
                eprintln!(
                    "[sim {name}] {} requests read, {} finished, {} in flight, virtual {:.1} s",
                    p.requests,
                    p.finished,
                    p.in_flight,
                    p.now_ms / 1000.0
                );
            }
        };
        let run = simulate(&cfg, *kind, rows(&args.trace, &args.model)?, &mut progress)
            .with_context(|| format!("simulating {name}"))?;
        // A report of no requests is a table of blanks that looks like a result.
        if run.counters.requests == 0 {
            bail!(
                "{} selects no request{}",
                args.trace.display(),
                args.model
                    .window_s
                    .map_or(String::new(), |w| format!(" in its --window-s {w} window"))
            );
        }
        let wall_s = started.elapsed().as_secs_f64();
        let c = &run.counters;
        // Summary gossip sent per node per second of virtual time (frames as the live
        // cluster writes them; none in oracle mode), over the run and while the trace
        // arrives.
        let nodes = cfg.network.regions.len();
        let gossip_bps = c.gossip_bytes_per_node_per_s(nodes);
        let gossip_bps_arriving = c.gossip_bytes_per_node_per_s_arriving(nodes);
        eprintln!(
            "[sim {name}] done: {} requests ({} failed) in {:.2} s wall, {:.0} requests/min, virtual {:.1} s, gossip {:.1} KiB/s per node ({:.1} KiB/s while requests arrive)",
            c.requests,
            c.failed,
            wall_s,
            c.requests as f64 / wall_s.max(1e-9) * 60.0,
            c.end_ms / 1000.0,
            gossip_bps / 1024.0,
            gossip_bps_arriving / 1024.0
        );
        speed.push(json!({
            "policy": name,
            "wall_s": wall_s,
            "requests_per_min": c.requests as f64 / wall_s.max(1e-9) * 60.0,
            "gossip_bytes_per_node_per_s": gossip_bps,
            "gossip_bytes_per_node_per_s_arriving": gossip_bps_arriving,
            "cache_estimate_error": cache_estimate_error(&run.sketches),
            "counters": c,
        }));
        runs.push(run);
    }

    let report = build_report(&config, &runs).context("building the report")?;
    report
        .write(&args.out)
        .with_context(|| format!("writing the report to {}", args.out.display()))?;
    let decisions = args.out.join("decisions.jsonl");
    if args.decisions > 0 {
        write_decisions(&decisions, &runs)?;
    } else {
        // An earlier run's, which would read as this run's decisions.
        gorgo_files::remove_stale(&decisions)
            .with_context(|| format!("removing the stale {}", decisions.display()))?;
    }
    let gap = oracle_gap(&report.results);
    let floors = gorgo_sim::floor::request_floors(&cfg, rows(&args.trace, &args.model)?)
        .context("computing the latency floor")?;
    let floor = gorgo_sim::floor::summarize_floors(&floors);
    write_floors(&args.out.join("floor.csv"), &floors)?;
    let summary = json!({
        "config": config,
        "runs": speed,
        "oracle_gap": gap,
        "floor": floor,
        "exact_percentiles": runs.iter().all(|r| r.rows.is_some()),
    });
    let path = args.out.join("sim.json");
    gorgo_files::write_atomic(
        &path,
        (serde_json::to_string_pretty(&summary)? + "\n").as_bytes(),
    )
    .with_context(|| format!("writing {}", path.display()))?;

    let header = view_header(&cfg, policies.contains(&PolicyKind::Oracle));
    let table = args.out.join("table.md");
    let text =
        std::fs::read_to_string(&table).with_context(|| format!("reading {}", table.display()))?;
    gorgo_files::write_atomic(&table, format!("{header}\n\n{text}").as_bytes())
        .with_context(|| format!("writing {}", table.display()))?;
    let mut stdout = std::io::stdout().lock();
    write!(
        stdout,
        "{header}\n\n{}",
        gorgo_report::render_table(&report)
    )?;
    let mut lines = Vec::new();
    if let Some(g) = gap {
        lines.push(format!(
            "Distributed vs oracle: gorgo p95 TTFT {:.1} ms / oracle {:.1} ms = {:.3} (p50 ratio {:.3})\n",
            g.gorgo_p95_ttft_ms, g.oracle_p95_ttft_ms, g.p95_ttft_ratio, g.p50_ttft_ratio
        ));
    }
    let floor_label = "Floor (no policy can beat it: each request alone on the fastest engine, an unbounded cache shared by every engine, no network)";
    // Over no request (every prompt too long for every engine) its figures are NaN.
    lines.push(if floor.requests == 0 {
        format!("{floor_label}: n/a (no request of the trace fits an engine: every one fails)\n")
    } else {
        format!(
            "{floor_label}: TTFT p50 {:.1} ms, p95 {:.1} ms; E2E p95 {:.2} s; cache hit at most {}\n",
            floor.ttft_ms.p50,
            floor.ttft_ms.p95,
            floor.e2e_ms.p95 / 1000.0,
            floor
                .cache_hit_ratio
                .map_or("-".into(), |h| format!("{:.1}%", h * 100.0))
        )
    });
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&table)
        .with_context(|| format!("appending to {}", table.display()))?;
    for line in &lines {
        write!(stdout, "\n{line}")?;
        write!(f, "\n{line}")?;
    }
    writeln!(stdout, "\nReport: {}", args.out.display())?;
    Ok(())
}
