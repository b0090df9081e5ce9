//! `gorgo tune-offline`: the reference online tuning should approach. Runs one policy
//! (default `gorgo`) with every pair of fixed weights of a grid through the simulator on
//! one workload and load, and reports the best fixed weights with their p95 TTFT and
//! E2E: overall, and among the weights whose p95 E2E is within `--e2e-tolerance` of the
//! policy's default weights' (what the tuner's E2E guard allows). Writes `grid.json`
//! and `grid.md` (docs/tuning.md, "The reference").

use std::path::PathBuf;

use anyhow::{bail, Context};
use gorgo_core::policy::PolicyKind;
use gorgo_core::types::MAX_WEIGHT;
use gorgo_core::Weights;
use serde::Serialize;
use serde_json::json;

use super::sim::SimModelArgs;
use super::sweep::{policy_result, simulate_jobs, trace_rate, SimJob};

/// Arguments of `gorgo tune-offline`.
#[derive(clap::Args, Debug)]
pub struct TuneOfflineArgs {
    /// Trace file (any format `gorgo sim` reads).
    #[arg(long)]
    trace: PathBuf,
    /// Multiplies inter-arrival times (< 1 is more load).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// The policy whose weights are searched (one that uses weights).
    #[arg(long, default_value = "gorgo")]
    policy: PolicyKind,
    /// `w_rtt` values of the grid.
    #[arg(long, value_delimiter = ',', default_value = "0.125,0.25,0.5,1,2,4")]
    rtt_grid: Vec<f64>,
    /// `w_queue` values of the grid.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0.05,0.125,0.25,0.5,1,2,4"
    )]
    queue_grid: Vec<f64>,
    /// The E2E constraint of the second answer: p95 E2E at most this fraction above
    /// the default weights' (the tuner's `e2e_guard`).
    #[arg(long, default_value_t = 0.05)]
    e2e_tolerance: f64,
    /// Simulations run at once (threads).
    #[arg(long, default_value_t = 2)]
    jobs: usize,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Output directory.
    #[arg(long, default_value = "out/tune-offline")]
    out: PathBuf,
    #[command(flatten)]
    model: SimModelArgs,
}

/// One grid point's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct GridPoint {
    /// The fixed weights.
    pub weights: Weights,
    /// p50 TTFT, ms.
    pub p50_ttft_ms: f64,
    /// p95 TTFT, ms.
    pub p95_ttft_ms: f64,
    /// p95 E2E, ms.
    pub p95_e2e_ms: f64,
    /// Engine-reported cache hit ratio.
    pub cache_hit_ratio: Option<f64>,
    /// Requests that did not complete.
    pub failed: u64,
}

/// Run the grid and write the report.
pub fn run(mut args: TuneOfflineArgs) -> anyhow::Result<()> {
    if !args.policy.uses_weights() {
        bail!("--policy {}: it uses no weights", args.policy);
    }
    for (flag, grid) in [
        ("--rtt-grid", &mut args.rtt_grid),
        ("--queue-grid", &mut args.queue_grid),
    ] {
        // Positive, and within what a person may set (`MAX_WEIGHT`, as the tuner's
        // bounds and `routing.weights`).
        if let Some(bad) = grid
            .iter()
            .find(|&&w| !(w.is_finite() && w > 0.0 && w <= MAX_WEIGHT))
        {
            bail!("{flag}: {bad:e} is not a weight in (0, {MAX_WEIGHT}]");
        }
        if grid.is_empty() {
            bail!("{flag}: give at least one weight");
        }
        // Each distinct cell is simulated once (as `sweep` dedupes its time scales).
        grid.sort_by(f64::total_cmp);
        grid.dedup();
    }
    if !(args.e2e_tolerance.is_finite() && args.e2e_tolerance >= 0.0) {
        bail!("--e2e-tolerance must be >= 0");
    }
    let mut base = args.model.config()?;
    base.time_scale = args.time_scale;
    super::sim::validate(&base)?;
    super::create_out_dir(&args.out)?;
    let default = args.policy.default_weights();
    let mut grid: Vec<Weights> = args
        .rtt_grid
        .iter()
        .flat_map(|&w_rtt| {
            args.queue_grid
                .iter()
                .map(move |&w_queue| Weights { w_rtt, w_queue })
        })
        .collect();
    // The default weights are always measured: the E2E constraint is relative to them.
    if !grid.contains(&default) {
        grid.push(default);
    }
    let jobs: Vec<SimJob> = grid
        .iter()
        .map(|&w| {
            let mut cfg = base.clone();
            cfg.weights = Some(w);
            SimJob {
                cfg,
                kind: args.policy,
            }
        })
        .collect();
    let (requests, _) = trace_rate(&args.trace, &args.model)?;
    let runs = simulate_jobs(
        &jobs,
        &args.trace,
        &args.model,
        args.jobs,
        requests,
        !args.no_progress,
    )?;
    let points: Vec<GridPoint> = grid
        .iter()
        .zip(&runs)
        .map(|(&weights, run)| {
            let r = policy_result(run)?;
            Ok(GridPoint {
                weights,
                p50_ttft_ms: r.ttft_ms.p50,
                p95_ttft_ms: r.ttft_ms.p95,
                p95_e2e_ms: r.e2e_ms.p95,
                cache_hit_ratio: r.cache_hit_ratio,
                failed: r.failed,
            })
        })
        .collect::<anyhow::Result<_>>()?;
    let at_default = points
        .iter()
        .find(|p| p.weights == default)
        .cloned()
        .context("the default weights were not run")?;
    let best = best_by_ttft(points.iter()).cloned();
    let e2e_cap = at_default.p95_e2e_ms * (1.0 + args.e2e_tolerance);
    let best_within = best_by_ttft(points.iter().filter(|p| p.p95_e2e_ms <= e2e_cap)).cloned();

    let mut config = json!({
        "trace": args.trace.display().to_string(),
        "time_scale": args.time_scale,
        "policy": args.policy.as_str(),
        "e2e_tolerance": args.e2e_tolerance,
        "requests": requests,
    });
    if let (Some(c), serde_json::Value::Object(m)) =
        (config.as_object_mut(), args.model.describe(&base))
    {
        c.extend(m);
    }
    let report = json!({
        "config": config,
        "points": points,
        "default": at_default,
        "best": best,
        "best_within_e2e": best_within,
    });
    let path = args.out.join("grid.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report)? + "\n")
        .with_context(|| format!("writing {}", path.display()))?;
    let md = render(
        &args,
        &points,
        &at_default,
        best.as_ref(),
        best_within.as_ref(),
    );
    let path = args.out.join("grid.md");
    std::fs::write(&path, &md).with_context(|| format!("writing {}", path.display()))?;
    out!("{md}");
    outln!("\nGrid: {}", args.out.display());
    Ok(())
}

/// The point with the lowest p95 TTFT (ties: the lower p95 E2E).
fn best_by_ttft<'a>(points: impl Iterator<Item = &'a GridPoint>) -> Option<&'a GridPoint> {
    points.filter(|p| p.p95_ttft_ms.is_finite()).min_by(|a, b| {
        a.p95_ttft_ms
            .total_cmp(&b.p95_ttft_ms)
            .then(a.p95_e2e_ms.total_cmp(&b.p95_e2e_ms))
    })
}

/// `grid.md`: p95 TTFT and p95 E2E tables (rows `w_rtt`, columns `w_queue`) and the
/// answers.
fn render(
    args: &TuneOfflineArgs,
    points: &[GridPoint],
    at_default: &GridPoint,
    best: Option<&GridPoint>,
    best_within: Option<&GridPoint>,
) -> String {
    let cell = |w_rtt: f64, w_queue: f64, f: &dyn Fn(&GridPoint) -> String| {
        points
            .iter()
            .find(|p| p.weights.w_rtt == w_rtt && p.weights.w_queue == w_queue)
            .map_or("-".to_owned(), f)
    };
    let table = |title: &str, f: &dyn Fn(&GridPoint) -> String| {
        let mut s = format!("{title}\n\n| w_rtt \\ w_queue |");
        for q in &args.queue_grid {
            s += &format!(" {q} |");
        }
        s += "\n|---|";
        s += &"---:|".repeat(args.queue_grid.len());
        s += "\n";
        for r in &args.rtt_grid {
            s += &format!("| {r} |");
            for q in &args.queue_grid {
                s += &format!(" {} |", cell(*r, *q, f));
            }
            s += "\n";
        }
        s
    };
    let line = |name: &str, p: Option<&GridPoint>| {
        match p {
        Some(p) => format!(
            "- {name}: w_rtt {}, w_queue {}: p95 TTFT {:.0} ms, p95 E2E {:.0} ms ({:.3}x / {:.3}x the default weights')\n",
            p.weights.w_rtt,
            p.weights.w_queue,
            p.p95_ttft_ms,
            p.p95_e2e_ms,
            p.p95_ttft_ms / at_default.p95_ttft_ms,
            p.p95_e2e_ms / at_default.p95_e2e_ms
        ),
        None => format!("- {name}: none\n"),
    }
    };
    let mut s = format!(
        "Fixed-weight grid of `{}` on {} at time scale {} (simulated, view: {})\n\n",
        args.policy,
        args.trace.display(),
        args.time_scale,
        super::sim::view_name(args.model.exact_state)
    );
    s += &table("p95 TTFT, ms", &|p| format!("{:.0}", p.p95_ttft_ms));
    s += "\n";
    s += &table("p95 E2E, s", &|p| format!("{:.1}", p.p95_e2e_ms / 1000.0));
    s += "\n";
    s += &line(
        &format!(
            "default weights ({}, {})",
            at_default.weights.w_rtt, at_default.weights.w_queue
        ),
        Some(at_default),
    );
    s += &line("best p95 TTFT", best);
    s += &line(
        &format!(
            "best p95 TTFT with p95 E2E within {:.0}% of the default's",
            args.e2e_tolerance * 100.0
        ),
        best_within,
    );
    s
}
