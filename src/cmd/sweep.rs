//! `gorgo sweep`: one workload through every policy at several offered loads, in the
//! simulator (default) or on live clusters (`--live`, through `gorgo compare`), and
//! each policy's goodput at an SLO. Writes `sweep.json`, `sweep.md` and the sweep plots
//! (crates/gorgo-report's `sweep` module).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{bail, Context};
use gorgo_bench::indicatif::{ProgressBar, ProgressStyle};
use gorgo_core::policy::PolicyKind;
use gorgo_report::{PolicyResult, Results, Slo, Sweep, SweepPoint};
use gorgo_sim::report::build_report;
use gorgo_sim::{simulate, PolicyRun, Progress, SimConfig};
use serde_json::json;

use super::bench::{run_compare, CompareArgs, LoadArgs, Mode};
use super::sim::{parse_policies, rows, SimModelArgs, DEFAULT_POLICIES};

/// Arguments of `gorgo sweep`.
#[derive(clap::Args, Debug)]
pub struct SweepArgs {
    /// Trace file (Mooncake, ART-Chat, Azure or generator JSONL; format detected).
    #[arg(long)]
    trace: PathBuf,
    /// Comma-separated policies (`oracle` included in simulation), or `all`.
    #[arg(long, default_value = DEFAULT_POLICIES)]
    policies: String,
    /// Loads as time scales (factors on the trace's inter-arrival times; smaller is
    /// more load).
    #[arg(long, value_delimiter = ',', default_value = "8,6,4,3,2")]
    time_scales: Vec<f64>,
    /// Loads as offered request rates, requests/s (converted to time scales from the
    /// trace's mean rate); replaces `--time-scales`.
    #[arg(long, value_delimiter = ',', conflicts_with = "time_scales")]
    rates: Option<Vec<f64>>,
    /// SLO on p95 TTFT, ms.
    #[arg(long, default_value_t = 2000.0)]
    ttft_slo_ms: f64,
    /// SLO on p95 end-to-end latency, ms (default: not checked).
    #[arg(long)]
    e2e_slo_ms: Option<f64>,
    /// Run on live clusters of emulators (`gorgo compare` per load) instead of the
    /// simulator; `oracle` is skipped (it exists only in simulation).
    #[arg(long)]
    live: bool,
    /// Simulations run at once (threads).
    #[arg(long, default_value_t = 2)]
    jobs: usize,
    /// Live: first port of the first cluster (see `gorgo compare --base-port`).
    #[arg(long, default_value_t = 17100)]
    base_port: u16,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Output directory (live runs keep each load's `gorgo compare` report under
    /// `live-x<scale>/`).
    #[arg(long, default_value = "out/sweep")]
    out: PathBuf,
    #[command(flatten)]
    model: SimModelArgs,
}

/// Requests in the selected part of the trace and its mean arrival rate, requests/s.
pub fn trace_rate(path: &Path, model: &SimModelArgs) -> anyhow::Result<(u64, f64)> {
    let (mut n, mut first, mut last) = (0u64, u64::MAX, 0u64);
    for row in rows(path, model)? {
        let row = row.with_context(|| format!("--trace {}", path.display()))?;
        n += 1;
        first = first.min(row.timestamp_ms);
        last = last.max(row.timestamp_ms);
    }
    if n < 2 || last <= first {
        bail!(
            "{}: need at least two requests spread over time to define a load (got {n})",
            path.display()
        );
    }
    Ok((n, n as f64 / ((last - first) as f64 / 1000.0)))
}

/// The time scales to run, largest (lightest load) first; each within the simulator's
/// bounds (`gorgo_sim::check_time_scale`, as `gorgo sim --time-scale`), live or not.
fn time_scales(args: &SweepArgs, rate: f64) -> anyhow::Result<Vec<f64>> {
    let reason = |s: f64| match gorgo_sim::check_time_scale(s) {
        Err(gorgo_sim::SimError::InvalidConfig { reason, .. }) => Some(reason),
        _ => None,
    };
    let mut scales: Vec<f64> = match &args.rates {
        Some(rates) => rates
            .iter()
            .map(|&r| {
                if !(r.is_finite() && r > 0.0) {
                    bail!("--rates: {r} is not a positive rate")
                }
                let s = rate / r;
                match reason(s) {
                    None => Ok(s),
                    Some(why) => bail!(
                        "--rates: {r:e} requests/s is time scale {s:.3e} on this trace \
                         ({rate:.3} requests/s), which {why}"
                    ),
                }
            })
            .collect::<anyhow::Result<_>>()?,
        None => args
            .time_scales
            .iter()
            .map(|&s| match reason(s) {
                None => Ok(s),
                Some(why) => bail!("--time-scales: {s:e} {why}"),
            })
            .collect::<anyhow::Result<_>>()?,
    };
    if scales.is_empty() {
        bail!("no load to run");
    }
    scales.sort_by(|a, b| b.total_cmp(a));
    scales.dedup();
    Ok(scales)
}

/// Run the sweep and write its files.
pub fn run(args: SweepArgs) -> anyhow::Result<()> {
    if !(args.ttft_slo_ms.is_finite() && args.ttft_slo_ms > 0.0) {
        bail!("--ttft-slo-ms must be positive");
    }
    if args.e2e_slo_ms.is_some_and(|e| !(e.is_finite() && e > 0.0)) {
        bail!("--e2e-slo-ms must be positive");
    }
    let policies = parse_policies(&args.policies)?;
    // Every simulator flag, checked before any run: a live sweep also simulates (the
    // latency floor), and would otherwise find a bad flag after all its live runs.
    if args.live {
        live_replicas(&args.model)?;
    }
    let model = args.model.config()?;
    let (requests, rate) = trace_rate(&args.trace, &args.model)?;
    let scales = time_scales(&args, rate)?;
    super::create_out_dir(&args.out)?;
    let slo = Slo {
        ttft_p95_ms: args.ttft_slo_ms,
        e2e_p95_ms: args.e2e_slo_ms,
    };
    let started = Instant::now();
    let (results, mut config) = if args.live {
        live(&args, &policies, &scales)?
    } else {
        simulated(&args, &policies, &scales, requests)?
    };
    config["trace"] = args.trace.display().to_string().into();
    config["requests"] = requests.into();
    config["time_scales"] = json!(scales);
    config["wall_s"] = started.elapsed().as_secs_f64().into();
    let points = scales
        .iter()
        .zip(results)
        .map(|(&time_scale, policies)| SweepPoint {
            time_scale,
            offered_rps: rate / time_scale,
            policies,
        })
        .collect();
    let mut sweep = Sweep::new(config, rate, slo, points);
    // The floor has no queue, so one computation serves every load.
    sweep.floor = Some(
        gorgo_sim::floor::latency_floor(&model, rows(&args.trace, &args.model)?)
            .context("computing the latency floor")?,
    );
    sweep
        .write(&args.out)
        .with_context(|| format!("writing the sweep to {}", args.out.display()))?;
    out!("{}", gorgo_report::sweep::render_sweep_markdown(&sweep));
    outln!(
        "\nSweep: {} ({:.1} s wall)",
        args.out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

type PointResults = Vec<Vec<(String, PolicyResult)>>;

/// Every (load, policy) in the simulator, `--jobs` at a time.
fn simulated(
    args: &SweepArgs,
    policies: &[PolicyKind],
    scales: &[f64],
    requests: u64,
) -> anyhow::Result<(PointResults, serde_json::Value)> {
    let base = args.model.config()?;
    let index: Vec<(usize, PolicyKind)> = (0..scales.len())
        .flat_map(|s| policies.iter().map(move |&p| (s, p)))
        .collect();
    let jobs: Vec<SimJob> = index
        .iter()
        .map(|&(s, kind)| {
            let mut cfg = base.clone();
            cfg.time_scale = scales[s];
            SimJob { cfg, kind }
        })
        .collect();
    let runs = simulate_jobs(
        &jobs,
        &args.trace,
        &args.model,
        args.jobs,
        requests,
        !args.no_progress,
    )?;
    let mut results: PointResults = vec![Vec::new(); scales.len()];
    for ((s, kind), run) in index.into_iter().zip(runs) {
        results[s].push((kind.as_str().to_owned(), policy_result(&run)?));
    }
    let mut config = json!({
        "mode": "sim",
        "policies": policies.iter().map(|p| p.as_str()).collect::<Vec<_>>(),
    });
    if let (Some(c), serde_json::Value::Object(m)) =
        (config.as_object_mut(), args.model.describe(&base))
    {
        c.extend(m);
    }
    Ok((results, config))
}

/// One simulation of a batch: the system and load, and the policy.
#[derive(Debug, Clone)]
pub struct SimJob {
    /// The simulated system, load and tuning.
    pub cfg: SimConfig,
    /// The policy.
    pub kind: PolicyKind,
}

/// Run `jobs` on the trace (the rows `model` selects: [`rows`]), `threads` at a time,
/// under one progress bar over all simulated requests (`requests` per job); runs come
/// back in job order. Shared by `gorgo sweep` and `gorgo tune-offline`.
pub fn simulate_jobs(
    jobs: &[SimJob],
    trace: &Path,
    model: &SimModelArgs,
    threads: usize,
    requests: u64,
    progress: bool,
) -> anyhow::Result<Vec<PolicyRun>> {
    let bar = if progress {
        ProgressBar::new(jobs.len() as u64 * requests)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{elapsed_precise} [{bar:40}] {percent}% of {len} simulated requests ({msg})",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let out: Mutex<Vec<Option<anyhow::Result<PolicyRun>>>> =
        Mutex::new((0..jobs.len()).map(|_| None).collect());
    let threads = threads.clamp(1, jobs.len().max(1));
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                let mut seen = 0u64;
                let mut progress = |p: Progress| {
                    bar.inc(p.finished.saturating_sub(seen));
                    seen = seen.max(p.finished);
                };
                let result = rows(trace, model).and_then(|rows| {
                    simulate(&job.cfg, job.kind, rows, &mut progress).with_context(|| {
                        format!("simulating {} at x{}", job.kind, job.cfg.time_scale)
                    })
                });
                bar.inc(requests.saturating_sub(seen));
                let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                bar.set_message(format!("{n}/{} runs", jobs.len()));
                if let Ok(mut out) = out.lock() {
                    out[i] = Some(result);
                }
            });
        }
    });
    bar.finish_and_clear();
    let out = out
        .into_inner()
        .map_err(|_| anyhow::anyhow!("a simulation thread panicked"))?;
    out.into_iter()
        .map(|r| r.context("a simulation did not run")?)
        .collect()
}

/// The aggregates of one run (its `results.json` entry).
pub fn policy_result(run: &PolicyRun) -> anyhow::Result<PolicyResult> {
    let report = build_report(&json!({}), std::slice::from_ref(run))?;
    report
        .results
        .policies
        .into_iter()
        .next()
        .map(|(_, r)| r)
        .context("the simulation produced no result")
}

/// Every load on live clusters: one `gorgo compare` per time scale, its report kept
/// under `live-x<scale>/`.
/// A live report's censored percentiles (`config.censored`, docs/bench.md: more than
/// 5% of a policy's requests failed before measuring the metric) hold a lower bound,
/// each failed request at the time it failed: a policy that refuses fast would read
/// faster than one that serves slowly. In a sweep they are +inf (shown as `inf`): a
/// p95 that could not be measured misses every SLO, and goodput counts it so.
fn unknown_where_censored(r: &mut Results) {
    let censored = r.config.get("censored").cloned().unwrap_or_default();
    for (policy, result) in r.policies.iter_mut() {
        for (metric, stats) in [
            ("ttft_ms", &mut result.ttft_ms),
            ("e2e_ms", &mut result.e2e_ms),
        ] {
            let marks = censored[policy.as_str()][metric]["censored"].as_array();
            for name in marks.into_iter().flatten().filter_map(|v| v.as_str()) {
                match name {
                    "p50" => stats.p50 = f64::INFINITY,
                    "p95" => stats.p95 = f64::INFINITY,
                    "p99" => stats.p99 = f64::INFINITY,
                    _ => {}
                }
            }
        }
    }
}

/// `--replicas` of a live sweep: what `gorgo up --replicas` takes (1 to 16), checked
/// where the simulator's `usize` becomes the clusters' `u16` (70000 must not wrap to
/// 4464).
fn live_replicas(model: &SimModelArgs) -> anyhow::Result<u16> {
    u16::try_from(model.replicas)
        .ok()
        .filter(|r| (1..=16).contains(r))
        .with_context(|| {
            format!(
                "--replicas {}: a live sweep runs 1 to 16 engines per region (`gorgo up --replicas`)",
                model.replicas
            )
        })
}

fn live(
    args: &SweepArgs,
    policies: &[PolicyKind],
    scales: &[f64],
) -> anyhow::Result<(PointResults, serde_json::Value)> {
    let names: Vec<&str> = policies
        .iter()
        .map(|p| p.as_str())
        .filter(|p| *p != "oracle")
        .collect();
    if names.is_empty() {
        bail!("--live: no policy to run (`oracle` exists only in simulation)");
    }
    let m = &args.model;
    if m.unreported_max_running {
        bail!("--live: emulators report their concurrency limit; drop --unreported-max-running");
    }
    let sim_only = sim_only_flags(m);
    if !sim_only.is_empty() {
        bail!(
            "--live: {} change only the simulated cluster (a live run would be the default cluster, labelled as if it were not); drop them",
            sim_only.join(", ")
        );
    }
    let mut results = Vec::new();
    for &scale in scales {
        let out = args.out.join(format!("live-x{scale}"));
        eprintln!(
            "[sweep] time scale {scale}: gorgo compare -> {}",
            out.display()
        );
        run_compare(CompareArgs {
            trace: args.trace.clone(),
            topology: m.topology.clone(),
            policies: names.join(","),
            out: out.clone(),
            sequential: false,
            engine_profile: m.engine_profile.clone(),
            replicas: live_replicas(m)?,
            // The live nodes read the limit from their emulators, as the simulated
            // ones are given it.
            engine_max_running: None,
            base_port: args.base_port,
            port_stride: 100,
            up_timeout_s: 120.0,
            load: LoadArgs {
                time_scale: scale,
                mode: Mode::Open,
                concurrency: None,
                duration: None,
                window: m.window_s,
                max_requests: m.max_requests.map(|n| n as usize),
                max_context_tokens: m.max_context_tokens,
                timeout_s: 300.0,
                model: "gorgo-emulated".into(),
                no_ignore_eos: false,
                no_progress: args.no_progress,
            },
        })
        .with_context(|| format!("live run at time scale {scale}"))?;
        let path = out.join("results.json");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let mut r: Results =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        unknown_where_censored(&mut r);
        results.push(r.policies);
    }
    let config = json!({
        "mode": "live",
        "policies": names,
        "topology": m.topology.display().to_string(),
        "engine_profile": m.engine_profile,
        "window_s": m.window_s,
        "max_requests": m.max_requests,
        "max_context_tokens": m.max_context_tokens,
    });
    Ok((results, config))
}

/// The flags of `m` set away from their defaults that only the simulator applies: a
/// live sweep runs the default cluster whatever they say.
fn sim_only_flags(m: &SimModelArgs) -> Vec<&'static str> {
    let default_metrics = gorgo_core::accounting::DEFAULT_METRICS_INTERVAL_MS as f64;
    [
        ("--region-seed", m.region_seed.is_some()),
        ("--gossip-interval-ms", m.gossip_interval_ms != 250.0),
        ("--gossip-delay-ms", m.gossip_delay_ms != 0.0),
        ("--gossip-loss", m.gossip_loss != 0.0),
        ("--max-hops", m.max_hops != 1),
        ("--live-chains", m.live_chains),
        ("--exact-state", m.exact_state),
        ("--causal-oracle", m.causal_oracle),
        (
            "--metrics-interval-ms",
            m.metrics_interval_ms != default_metrics,
        ),
        (
            "--summary-sample",
            m.summary_sample != gorgo_core::summary::SampleSetting::default(),
        ),
        ("--kv-events", m.kv_events),
        ("--refuse-forwards", !m.refuse_forwards),
        ("--hold-tokens", m.hold_tokens != 0),
        ("--non-streamed-share", m.non_streamed_share != 0.0),
    ]
    .into_iter()
    .filter_map(|(flag, set)| set.then_some(flag))
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// `--live` refuses the flags only the simulator applies, naming them: a live sweep
    /// with `--refuse-forwards false` ran the default cluster and said nothing.
    #[test]
    fn a_live_sweep_names_the_simulator_only_flags() {
        let a = parse(&["--live"]).unwrap();
        assert!(sim_only_flags(&a.model).is_empty());
        let a = parse(&[
            "--live",
            "--refuse-forwards",
            "false",
            "--max-hops",
            "2",
            "--region-seed",
            "3",
        ])
        .unwrap();
        assert_eq!(
            sim_only_flags(&a.model),
            ["--region-seed", "--max-hops", "--refuse-forwards"]
        );
    }

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: SweepArgs,
    }

    fn parse(argv: &[&str]) -> Result<SweepArgs, clap::Error> {
        Cli::try_parse_from(["sweep", "--trace", "t.jsonl"].iter().chain(argv)).map(|c| c.args)
    }

    #[test]
    fn loads_come_from_scales_or_rates() {
        let a = parse(&[]).unwrap();
        assert_eq!(time_scales(&a, 4.0).unwrap(), vec![8.0, 6.0, 4.0, 3.0, 2.0]);
        assert_eq!(a.ttft_slo_ms, 2000.0);
        let a = parse(&["--rates", "1,2"]).unwrap();
        // 4 req/s of trace: 1 req/s is x4, 2 req/s is x2.
        assert_eq!(time_scales(&a, 4.0).unwrap(), vec![4.0, 2.0]);
        assert!(parse(&["--rates", "1", "--time-scales", "2"]).is_err());
        let a = parse(&["--rates", "0"]).unwrap();
        assert!(time_scales(&a, 4.0).is_err());
    }

    /// A load past the simulator's time scales (`gorgo_sim::MAX_TIME_SCALE`) is
    /// refused naming the flag, as `gorgo sim --time-scale` refuses it: `1e14` ran for
    /// ever and `--rates 1e-300` reported zeros.
    #[test]
    fn loads_past_the_simulators_time_scales_are_refused() {
        for (argv, flag) in [
            (["--time-scales", "1e14"], "--time-scales"),
            (["--time-scales", "8,1e300"], "--time-scales"),
            (["--time-scales", "inf"], "--time-scales"),
            (["--rates", "1e-300"], "--rates"),
            (["--rates", "0.0001"], "--rates"),
        ] {
            let e = time_scales(&parse(&argv).unwrap(), 4.0)
                .unwrap_err()
                .to_string();
            assert!(e.contains(flag) && e.len() < 200, "{argv:?}: {e}");
        }
        let a = parse(&["--time-scales", "10000"]).unwrap();
        assert_eq!(time_scales(&a, 4.0).unwrap(), vec![10_000.0]);
    }

    /// A live point whose p95 TTFT is censored (more than 5% failed before a first
    /// token, their lower bounds the times they failed) misses the SLO: a policy that
    /// refuses fast does not read faster than one that serves slowly.
    #[test]
    fn a_censored_live_p95_misses_every_slo() {
        let text = r#"{
            "config": {"censored": {"fast-refusals": {"ttft_ms": {"censored": ["p95", "p99"]}}}},
            "policies": {
                "fast-refusals": {"requests": 100, "failed": 6, "duration_s": 1.0,
                    "throughput_rps": 1.0,
                    "ttft_ms": {"p50": 1000.0, "p95": 1000.0, "p99": 1000.0, "mean": 1000.0},
                    "e2e_ms": {"p50": 1.0, "p95": 1.0, "p99": 1.0, "mean": 1.0},
                    "itl_ms": {"p50": 1.0, "p95": 1.0, "p99": 1.0, "mean": 1.0},
                    "region_share": {}, "forwarded_share": 0.0}
            }
        }"#;
        let mut r: Results = serde_json::from_str(text).unwrap();
        unknown_where_censored(&mut r);
        let ttft = r.policies[0].1.ttft_ms;
        assert_eq!((ttft.p50, ttft.p95), (1000.0, f64::INFINITY));
        let slo = Slo {
            ttft_p95_ms: 2000.0,
            e2e_p95_ms: None,
        };
        assert_eq!(
            gorgo_report::goodput_at_slo(&[(1.0, ttft.p95, 1.0)], slo),
            0.0
        );
    }
}
