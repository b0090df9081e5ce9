//! Load sweeps: the same workload through every policy at several offered loads, and
//! **goodput at SLO**, the highest offered load at which a policy still meets its
//! latency objectives.
//!
//! A single load point says little: which policy wins changes with load (the paper's
//! own results change sign past a time scale of about 3). `gorgo sweep` produces one
//! [`crate::Results`]-style aggregate per (load, policy); this module turns them into
//! `sweep.json`, `sweep.md` and the per-load plots, whatever driver (simulator or live
//! clusters) produced them.

use std::collections::BTreeMap;

use gorgo_core::sketch::nearest_rank;
use serde::{Deserialize, Serialize};

use crate::table::{markdown, num};
use crate::{LatencyStats, PolicyResult};

/// The latency objectives a sweep point must meet to count towards goodput.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    /// Largest acceptable p95 TTFT, ms.
    pub ttft_p95_ms: f64,
    /// Largest acceptable p95 end-to-end latency, ms (`None`: not checked).
    pub e2e_p95_ms: Option<f64>,
}

/// One load of a sweep: every policy's aggregate at one time scale.
///
/// A latency percentile of +inf is **censored**: above every measured value (a live
/// p95 with more than 5% of the requests failed before measuring it, docs/bench.md).
/// JSON has no infinity and serde_json writes it as `null`, as it does NaN ("nothing
/// measured"), so `sweep.json` adds `censored`: per policy, the percentiles that were
/// +inf (`"ttft_ms.p95"`), which reading restores.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(into = "PointJson", from = "PointJson")]
pub struct SweepPoint {
    /// The factor applied to the trace's inter-arrival times (< 1: faster).
    pub time_scale: f64,
    /// Offered load, requests per second: the trace's mean rate / `time_scale`.
    pub offered_rps: f64,
    /// Aggregates by policy name, in run order.
    pub policies: Vec<(String, PolicyResult)>,
}

/// A [`SweepPoint`] as `sweep.json` holds it: its fields and the censored marks.
#[derive(Serialize, Deserialize)]
struct PointJson {
    time_scale: f64,
    offered_rps: f64,
    #[serde(with = "crate::ordered_map")]
    policies: Vec<(String, PolicyResult)>,
    /// Per policy, the percentiles that are +inf, as `"<metric>.<stat>"`; absent when
    /// none are (and in sweeps written before it existed).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    censored: BTreeMap<String, Vec<String>>,
}

/// The latency statistics of a result by their names in `results.json`, each field by
/// its name, so that censored marks name them as a reader of the JSON finds them.
fn stats_fields(r: &mut PolicyResult) -> [(&'static str, &'static str, &mut f64); 12] {
    let [t, e, i] = [&mut r.ttft_ms, &mut r.e2e_ms, &mut r.itl_ms];
    [
        ("ttft_ms", "p50", &mut t.p50),
        ("ttft_ms", "p95", &mut t.p95),
        ("ttft_ms", "p99", &mut t.p99),
        ("ttft_ms", "mean", &mut t.mean),
        ("e2e_ms", "p50", &mut e.p50),
        ("e2e_ms", "p95", &mut e.p95),
        ("e2e_ms", "p99", &mut e.p99),
        ("e2e_ms", "mean", &mut e.mean),
        ("itl_ms", "p50", &mut i.p50),
        ("itl_ms", "p95", &mut i.p95),
        ("itl_ms", "p99", &mut i.p99),
        ("itl_ms", "mean", &mut i.mean),
    ]
}

impl From<SweepPoint> for PointJson {
    fn from(mut p: SweepPoint) -> Self {
        let mut censored = BTreeMap::new();
        for (policy, r) in &mut p.policies {
            let marks: Vec<String> = stats_fields(r)
                .into_iter()
                .filter(|(_, _, v)| **v == f64::INFINITY)
                .map(|(metric, stat, _)| format!("{metric}.{stat}"))
                .collect();
            if !marks.is_empty() {
                censored.insert(policy.clone(), marks);
            }
        }
        PointJson {
            time_scale: p.time_scale,
            offered_rps: p.offered_rps,
            policies: p.policies,
            censored,
        }
    }
}

impl From<PointJson> for SweepPoint {
    fn from(mut p: PointJson) -> Self {
        for (policy, r) in &mut p.policies {
            let Some(marks) = p.censored.get(policy.as_str()) else {
                continue;
            };
            for (metric, stat, v) in stats_fields(r) {
                if marks
                    .iter()
                    .any(|m| m.split_once('.') == Some((metric, stat)))
                {
                    *v = f64::INFINITY;
                }
            }
        }
        SweepPoint {
            time_scale: p.time_scale,
            offered_rps: p.offered_rps,
            policies: p.policies,
        }
    }
}

/// A workload's latency floor: what no policy can beat (computed by `gorgo-sim`'s
/// `floor` module: every request alone on the fastest engine, with an unbounded cache
/// shared by every engine holding every earlier request's prompt, and no network).
///
/// It exists so that a ratio to the best baseline can be read against what was
/// possible at all: where the best baseline is within a few percent of the floor, no
/// rule can be much better than it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LatencyFloor {
    /// Requests the floor was computed over.
    pub requests: u64,
    /// Floor of TTFT, ms.
    pub ttft_ms: LatencyStats,
    /// Floor of end-to-end latency, ms.
    pub e2e_ms: LatencyStats,
    /// The highest cache hit ratio any policy can reach (the unbounded shared cache's).
    pub cache_hit_ratio: Option<f64>,
}

/// Whether a goodput (or a ratio of two) is a value or only a bound: a sweep brackets
/// the goodput only where the SLO is crossed between two tested loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Bound {
    /// A value: the SLO is crossed between two tested loads.
    #[default]
    Exact,
    /// At least the value: every tested load met the SLO, and a higher one may too.
    AtLeast,
    /// At most the value (a ratio over a baseline's lower bound).
    AtMost,
    /// Below the value: the lowest tested load already missed the SLO.
    Below,
}

impl Bound {
    /// How a cell shows the bound before its value: `>= 4.00`, `< 0.50`.
    fn prefix(self) -> &'static str {
        match self {
            Bound::Exact => "",
            Bound::AtLeast => ">= ",
            Bound::AtMost => "<= ",
            Bound::Below => "< ",
        }
    }
}

/// One policy's goodput at the SLO.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Goodput {
    /// The policy.
    pub policy: String,
    /// Highest offered load meeting the SLO, requests/s ([`goodput_at_slo`]): 0 when
    /// the lowest load missed it.
    pub goodput_rps: f64,
    /// Whether `goodput_rps` is a value: `at_least` when every tested load met the SLO
    /// (it is the highest load), `below` when the lowest missed (the goodput lies below
    /// the lowest load, [`Sweep::lowest_load`]; `goodput_rps` is 0). Sweeps written
    /// before it existed read as `exact`.
    #[serde(default)]
    pub bound: Bound,
    /// `goodput_rps` over the best baseline's (`None` when there is no best baseline,
    /// or when both are lower bounds, so nothing is known of their ratio).
    pub ratio_to_best_baseline: Option<f64>,
    /// Whether the ratio is a value or a bound, from the two goodputs' bounds: a lower
    /// bound over a value is `at_least`, a value over a lower bound `at_most`, a goodput
    /// below the lowest load gives `below` (the ratio of that load).
    #[serde(default)]
    pub ratio_bound: Bound,
}

/// A whole sweep: what `sweep.json` holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sweep {
    /// Whatever describes the run (trace, topology, flags): free-form JSON.
    pub config: serde_json::Value,
    /// The workload's mean arrival rate at time scale 1, requests/s.
    pub trace_rate_rps: f64,
    /// The objectives goodput is measured against.
    pub slo: Slo,
    /// One entry per load, by increasing offered load.
    pub points: Vec<SweepPoint>,
    /// Per policy, in run order.
    pub goodput: Vec<Goodput>,
    /// The baseline with the highest goodput (ties: the first), if any baseline ran
    /// and its goodput is above 0 (with every goodput 0 no baseline is best).
    pub best_baseline: Option<String>,
    /// The workload's latency floor (the same at every load: it has no queue), when
    /// the driver computed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub floor: Option<LatencyFloor>,
}

/// True for the policies goodput ratios are taken against: neither a `gorgo` policy
/// nor the `oracle` (which no deployment can run).
pub fn is_baseline(policy: &str) -> bool {
    !policy.starts_with("gorgo") && policy != "oracle"
}

/// Highest offered load meeting `slo` on a measured curve of `(offered_rps, p95 TTFT
/// ms, p95 E2E ms)` points (any order).
///
/// Walking up from the lowest load: 0 when the lowest point already misses the SLO;
/// the highest load when every point meets it; otherwise the load where the curve
/// crosses the SLO between the last point that meets it and the first that does not,
/// by linear interpolation of each violated metric (the lowest crossing of the
/// violated metrics). Points past the first miss are ignored: a latency that comes
/// back under the SLO at a higher load is noise, not capacity. Points with a
/// non-finite or negative load are dropped; a non-finite latency (NaN: not measured;
/// +inf: censored) counts as a miss.
///
/// The latencies are taken as given: failed requests are the caller's to count
/// ([`Sweep::new`] counts them as infinitely slow, [`slo_p95`]). The first two cases
/// are bounds, not values; [`goodput_with_bound`] says which.
pub fn goodput_at_slo(curve: &[(f64, f64, f64)], slo: Slo) -> f64 {
    match goodput_with_bound(curve, slo) {
        (_, Bound::Below) => 0.0,
        (rps, _) => rps,
    }
}

/// [`goodput_at_slo`] with what it is: [`Bound::Exact`] where the SLO is crossed
/// between two loads, [`Bound::AtLeast`] with the highest load when every load meets
/// it, [`Bound::Below`] with the lowest load when that one misses (and `(0, Below)`
/// for a curve with no usable point).
pub fn goodput_with_bound(curve: &[(f64, f64, f64)], slo: Slo) -> (f64, Bound) {
    let mut points: Vec<(f64, f64, f64)> = curve
        .iter()
        .copied()
        .filter(|p| p.0.is_finite() && p.0 >= 0.0)
        .collect();
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    // False for NaN: a latency that could not be measured misses.
    let within = |v: f64, limit: f64| v <= limit;
    let meets = |p: &(f64, f64, f64)| {
        within(p.1, slo.ttft_p95_ms) && slo.e2e_p95_ms.is_none_or(|e| within(p.2, e))
    };
    let Some(first_miss) = points.iter().position(|p| !meets(p)) else {
        return points
            .last()
            .map_or((0.0, Bound::Below), |p| (p.0, Bound::AtLeast));
    };
    if first_miss == 0 {
        return (points[0].0, Bound::Below);
    }
    let (lo, hi) = (points[first_miss - 1], points[first_miss]);
    // Where `value` goes from `a` (<= limit, at lo.0) to `b` (> limit, at hi.0).
    let cross = |a: f64, b: f64, limit: f64| {
        if b.is_finite() && b > a {
            lo.0 + (limit - a) / (b - a) * (hi.0 - lo.0)
        } else {
            lo.0
        }
    };
    let mut load = hi.0;
    if !within(hi.1, slo.ttft_p95_ms) {
        load = load.min(cross(lo.1, hi.1, slo.ttft_p95_ms));
    }
    if let Some(e) = slo.e2e_p95_ms {
        if !within(hi.2, e) {
            load = load.min(cross(lo.2, hi.2, e));
        }
    }
    (load.clamp(lo.0, hi.0), Bound::Exact)
}

/// The p95 of `stats` (one of `r`'s latencies) to hold against an SLO, with every
/// failed request counted as infinitely slow: goodput at a p95 SLO is the highest load
/// whose p95 over *every* request sent, failures counted as infinite, is within it.
///
/// The aggregate keeps percentiles and counts, not the requests, so this is the
/// smallest stored percentile sure to be at least that p95 (a miss is never read as
/// a meet): with `f` of `n` requests failed, the p95 is the sample of rank
/// `k = ceil(0.95 n)`. No failure: the stored p95. When the failures reach into that
/// rank (more than 5% failed) the p95 is a failure: +inf. Otherwise the stored p99
/// when at least `k` samples under it are not failures (`ceil(0.99 n) - f >= k`,
/// true both of percentiles over completed requests, the simulator's, and of a live
/// report's over every request with failures at the time they failed); else +inf, as
/// no stored percentile bounds it.
pub fn slo_p95(r: &PolicyResult, stats: &LatencyStats) -> f64 {
    let (n, f) = (r.requests, r.failed.min(r.requests));
    if f == 0 {
        return stats.p95;
    }
    let k = nearest_rank(0.95, n);
    if n - f >= k && nearest_rank(0.99, n) - f >= k {
        stats.p99
    } else {
        f64::INFINITY
    }
}

impl Sweep {
    /// Assemble a sweep from its points (sorted here by offered load) and compute every
    /// policy's goodput and its ratio to the best baseline.
    pub fn new(
        config: serde_json::Value,
        trace_rate_rps: f64,
        slo: Slo,
        mut points: Vec<SweepPoint>,
    ) -> Self {
        points.sort_by(|a, b| a.offered_rps.total_cmp(&b.offered_rps));
        // A live point's percentiles are over every request sent, those that failed
        // before the metric ranked slowest (`gorgo compare`'s report), so its p95 is
        // the one to hold against the SLO as it is, +inf where it is censored: the
        // bound `slo_p95` takes for the simulator's (over completed requests only)
        // held a live policy with one failure to its p99, and missed it at 1%.
        let live = config.get("mode").and_then(serde_json::Value::as_str) == Some("live");
        let held = |r: &PolicyResult, s: &LatencyStats| if live { s.p95 } else { slo_p95(r, s) };
        let mut sweep = Sweep {
            config,
            trace_rate_rps,
            slo,
            points,
            goodput: Vec::new(),
            best_baseline: None,
            floor: None,
        };
        let mut goodput: Vec<Goodput> = sweep
            .policies()
            .into_iter()
            .map(|p| {
                // Failed requests count as infinitely slow (`held`).
                let curve: Vec<(f64, f64, f64)> = sweep
                    .curve(&p)
                    .into_iter()
                    .map(|(load, r)| (load, held(r, &r.ttft_ms), held(r, &r.e2e_ms)))
                    .collect();
                let (rps, bound) = goodput_with_bound(&curve, slo);
                Goodput {
                    goodput_rps: if bound == Bound::Below { 0.0 } else { rps },
                    bound,
                    policy: p,
                    ratio_to_best_baseline: None,
                    ratio_bound: Bound::Exact,
                }
            })
            .collect();
        // With every goodput 0 no baseline is best: naming one would read as a winner.
        let best = goodput
            .iter()
            .filter(|g| is_baseline(&g.policy))
            .fold(None::<&Goodput>, |best, g| match best {
                Some(b) if b.goodput_rps >= g.goodput_rps => Some(b),
                _ => Some(g),
            })
            .filter(|g| g.goodput_rps > 0.0)
            .map(|g| (g.policy.clone(), g.goodput_rps, g.bound));
        if let Some((_, base, base_bound)) = best {
            for g in &mut goodput {
                let ratio = match (g.bound, base_bound) {
                    (Bound::AtLeast, Bound::AtLeast) => None,
                    (Bound::Exact, Bound::AtLeast) => Some((g.goodput_rps, Bound::AtMost)),
                    (Bound::Below, _) => sweep.lowest_load(&g.policy).map(|l| (l, Bound::Below)),
                    (bound, _) => Some((g.goodput_rps, bound)),
                };
                if let Some((rps, bound)) = ratio {
                    g.ratio_to_best_baseline = Some(rps / base);
                    g.ratio_bound = bound;
                }
            }
        }
        sweep.best_baseline = best.map(|(p, _, _)| p);
        sweep.goodput = goodput;
        sweep
    }

    /// The lowest load `policy` ran at (what a goodput [`Bound::Below`] lies below).
    pub fn lowest_load(&self, policy: &str) -> Option<f64> {
        self.curve(policy)
            .into_iter()
            .map(|(load, _)| load)
            .filter(|l| l.is_finite() && *l >= 0.0)
            .min_by(f64::total_cmp)
    }

    /// Policy names in the order they first appear.
    pub fn policies(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for (p, _) in self.points.iter().flat_map(|pt| &pt.policies) {
            if !out.contains(p) {
                out.push(p.clone());
            }
        }
        out
    }

    /// `policy`'s aggregates by increasing offered load.
    pub fn curve(&self, policy: &str) -> Vec<(f64, &PolicyResult)> {
        self.points
            .iter()
            .filter_map(|pt| {
                pt.policies
                    .iter()
                    .find(|(p, _)| p == policy)
                    .map(|(_, r)| (pt.offered_rps, r))
            })
            .collect()
    }
}

/// One table: a row per policy, a column per offered load, cells from `cell`, and a
/// last row `extra` (a label and one cell for every load) when given.
fn per_load_table(
    sweep: &Sweep,
    cell: impl Fn(&PolicyResult) -> String,
    extra: Option<(&str, String)>,
) -> String {
    let mut header = vec!["policy".to_string()];
    header.extend(
        sweep
            .points
            .iter()
            .map(|p| load_label(p.offered_rps, p.time_scale)),
    );
    let rows: Vec<Vec<String>> = sweep
        .policies()
        .into_iter()
        .map(|policy| {
            let mut row = vec![policy.clone()];
            row.extend(sweep.points.iter().map(|pt| {
                pt.policies
                    .iter()
                    .find(|(p, _)| *p == policy)
                    .map_or("-".into(), |(_, r)| cell(r))
            }));
            row
        })
        .chain(extra.map(|(label, cell)| {
            std::iter::once(label.to_string())
                .chain(sweep.points.iter().map(|_| cell.clone()))
                .collect()
        }))
        .collect();
    markdown(&header, &rows)
}

/// A load's column header: `0.50 req/s (x5.882)`. The time scale gets at most three
/// decimals (trailing zeros dropped): `--rates` makes it `trace rate / rate`, whose
/// full float (5.882352941176471) says nothing more.
fn load_label(offered_rps: f64, time_scale: f64) -> String {
    let rounded = (time_scale * 1000.0).round() / 1000.0;
    let scale = if rounded == 0.0 && time_scale != 0.0 {
        // Too small for three decimals: two significant digits instead.
        format!("{time_scale:.1e}")
    } else {
        format!("{rounded}")
    };
    format!("{offered_rps:.2} req/s (x{scale})")
}

/// Label of the floor's row in the per-load tables.
const FLOOR_ROW: &str = "floor (no policy can beat)";

/// One line per load: the best baseline's p95 TTFT over the floor's, and what a
/// ratio of 0.85 to the best baseline would need against the floor. Where the best
/// baseline is within 1 / 0.85 of the floor, that bar is below what any policy can do.
fn floor_headroom(sweep: &Sweep, floor: &LatencyFloor) -> String {
    let mut out = format!(
        "\nHeadroom over the floor (p95 TTFT {} ms over {} requests: each request alone on \
         the fastest engine, an unbounded cache shared by every engine, no network):\n\n",
        num(floor.ttft_ms.p95, 1.0, 0),
        floor.requests
    );
    let header: Vec<String> = [
        "load",
        "best baseline",
        "its p95 / floor",
        "0.85x of it / floor",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let rows: Vec<Vec<String>> = sweep
        .points
        .iter()
        .filter_map(|pt| {
            // A baseline nothing measured (NaN) is no best; with none measured the
            // load's ratios are `-`.
            let baselines: Vec<_> = pt.policies.iter().filter(|(p, _)| is_baseline(p)).collect();
            if baselines.is_empty() {
                return None;
            }
            let (name, best) = baselines
                .into_iter()
                .filter(|(_, r)| !r.ttft_ms.p95.is_nan())
                .min_by(|a, b| a.1.ttft_ms.p95.total_cmp(&b.1.ttft_ms.p95))
                .map_or(("-", f64::NAN), |(p, r)| (p.as_str(), r.ttft_ms.p95));
            // NaN when either side is unmeasured: `-`, never a comparison.
            let ratio = best / floor.ttft_ms.p95;
            Some(vec![
                load_label(pt.offered_rps, pt.time_scale),
                name.to_owned(),
                num(ratio, 1.0, 2),
                format!(
                    "{}{}",
                    num(0.85 * ratio, 1.0, 2),
                    if 0.85 * ratio < 1.0 {
                        " (below the floor)"
                    } else {
                        ""
                    }
                ),
            ])
        })
        .collect();
    out.push_str(&markdown(&header, &rows));
    out
}

/// `sweep.md`: goodput at the SLO, then p95 TTFT, p95 E2E, cache hit ratio and the
/// cost model's prediction error per policy and load.
pub fn render_sweep_markdown(sweep: &Sweep) -> String {
    let slo = match sweep.slo.e2e_p95_ms {
        Some(e) => format!(
            "p95 TTFT <= {:.0} ms and p95 E2E <= {:.0} ms",
            sweep.slo.ttft_p95_ms, e
        ),
        None => format!("p95 TTFT <= {:.0} ms", sweep.slo.ttft_p95_ms),
    };
    let mut out = format!(
        "Goodput at SLO ({slo}; highest offered load meeting it, interpolated between \
         sweep points; trace rate {:.3} req/s at time scale 1):\n\n",
        sweep.trace_rate_rps
    );
    let header: Vec<String> = ["policy", "goodput req/s", "vs best baseline"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let rows: Vec<Vec<String>> = sweep
        .goodput
        .iter()
        .map(|g| {
            let mut name = g.policy.clone();
            if sweep.best_baseline.as_deref() == Some(g.policy.as_str()) {
                name.push_str(" (best baseline)");
            }
            let goodput = match g.bound {
                Bound::Below => sweep.lowest_load(&g.policy).unwrap_or(0.0),
                _ => g.goodput_rps,
            };
            vec![
                name,
                format!("{}{goodput:.2}", g.bound.prefix()),
                g.ratio_to_best_baseline
                    .map_or("-".into(), |r| format!("{}{r:.2}x", g.ratio_bound.prefix())),
            ]
        })
        .collect();
    out.push_str(&markdown(&header, &rows));
    if sweep.goodput.iter().any(|g| g.bound != Bound::Exact) {
        out.push_str(
            "\n`>=`: every load tested met the SLO, so the goodput is at least the highest \
             (a higher load may meet it too); `<`: the lowest load tested already missed it. \
             Ratios of bounds are bounds; two lower bounds have no ratio (`-`).\n",
        );
    }
    let any_failed = sweep
        .points
        .iter()
        .flat_map(|p| &p.policies)
        .any(|(_, r)| r.failed > 0);
    let live = sweep.config.get("mode").and_then(serde_json::Value::as_str) == Some("live");
    if any_failed && live {
        out.push_str(
            "\nFailed requests count as infinitely slow against the SLO: a live point's p95 \
             is over every request sent, a request that failed before measuring the metric \
             ranked slowest, so a load where more than 5% failed before measuring it misses \
             the SLO (`inf`); a stream cut after its first token keeps its TTFT.\n",
        );
    } else if any_failed {
        out.push_str(
            "\nFailed requests count as infinitely slow against the SLO: a load where more \
             than 5% failed misses it; with fewer, its p99 stands in for the p95 (the \
             smallest stored percentile sure to cover the failures).\n",
        );
    }
    let floor = sweep.floor.as_ref();
    // NaN (nothing measured) shows as `-`, as in table.md; +inf (censored) as `inf`.
    let ttft = |r: &LatencyStats| num(r.p95, 1.0, 0);
    let e2e = |r: &LatencyStats| num(r.p95, 1000.0, 2);
    let hit = |h: Option<f64>| h.map_or("-".into(), |h| format!("{:.1}%", h * 100.0));
    out.push_str("\np95 TTFT, ms:\n\n");
    out.push_str(&per_load_table(
        sweep,
        |r| ttft(&r.ttft_ms),
        floor.map(|f| (FLOOR_ROW, ttft(&f.ttft_ms))),
    ));
    if let Some(f) = floor {
        out.push_str(&floor_headroom(sweep, f));
    }
    out.push_str("\np95 E2E, s:\n\n");
    out.push_str(&per_load_table(
        sweep,
        |r| e2e(&r.e2e_ms),
        floor.map(|f| (FLOOR_ROW, e2e(&f.e2e_ms))),
    ));
    out.push_str("\nCache hit ratio (cached prompt tokens / prompt tokens):\n\n");
    out.push_str(&per_load_table(
        sweep,
        |r| hit(r.cache_hit_ratio),
        floor.map(|f| ("bound (unbounded shared cache)", hit(f.cache_hit_ratio))),
    ));
    out.push_str(
        "\nPrediction error of the cost model (median APE / Spearman rho of estimated vs \
         measured TTFT):\n\n",
    );
    out.push_str(&per_load_table(
        sweep,
        |r| {
            r.prediction.map_or("-".into(), |p| {
                format!(
                    "{:.0}% / {}",
                    p.mape_median,
                    p.spearman.map_or("-".into(), |s| format!("{s:.2}"))
                )
            })
        },
        None,
    ));
    let gossip = sweep
        .points
        .iter()
        .flat_map(|p| &p.policies)
        .any(|(_, r)| r.gossip_bytes_per_node_per_s.is_some());
    if gossip {
        out.push_str("\nGossip per node while requests arrive, KiB/s:\n\n");
        out.push_str(&per_load_table(
            sweep,
            |r| {
                r.gossip_bytes_per_node_per_s
                    .map_or("-".into(), |b| format!("{:.1}", b / 1024.0))
            },
            None,
        ));
    }
    let failed: u64 = sweep
        .points
        .iter()
        .flat_map(|p| &p.policies)
        .map(|(_, r)| r.failed)
        .sum();
    if failed > 0 {
        out.push_str("\nFailed requests:\n\n");
        out.push_str(&per_load_table(sweep, |r| r.failed.to_string(), None));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SLO: Slo = Slo {
        ttft_p95_ms: 2000.0,
        e2e_p95_ms: None,
    };

    #[test]
    fn never_meets_is_zero() {
        let curve = [(1.0, 2500.0, 0.0), (2.0, 3000.0, 0.0), (4.0, 9000.0, 0.0)];
        assert_eq!(goodput_at_slo(&curve, SLO), 0.0);
        assert_eq!(goodput_at_slo(&[], SLO), 0.0);
    }

    #[test]
    fn meets_everywhere_is_the_highest_load() {
        let curve = [(4.0, 900.0, 0.0), (1.0, 300.0, 0.0), (2.0, 500.0, 0.0)];
        assert_eq!(goodput_at_slo(&curve, SLO), 4.0);
    }

    #[test]
    fn crossing_is_interpolated() {
        // TTFT 1000 ms at 2 req/s, 3000 ms at 4 req/s: 2000 ms is crossed at 3 req/s.
        let curve = [(1.0, 500.0, 0.0), (2.0, 1000.0, 0.0), (4.0, 3000.0, 0.0)];
        assert!((goodput_at_slo(&curve, SLO) - 3.0).abs() < 1e-12);
        // Exactly at the SLO counts as meeting it.
        let curve = [(1.0, 500.0, 0.0), (2.0, 2000.0, 0.0), (4.0, 3000.0, 0.0)];
        assert!((goodput_at_slo(&curve, SLO) - 2.0).abs() < 1e-12);
        // A recovery past the first miss is ignored.
        let curve = [(1.0, 1000.0, 0.0), (2.0, 3000.0, 0.0), (3.0, 1500.0, 0.0)];
        assert!((goodput_at_slo(&curve, SLO) - 1.5).abs() < 1e-12);
    }

    #[test]
    fn the_e2e_objective_binds_when_it_crosses_first() {
        let slo = Slo {
            ttft_p95_ms: 2000.0,
            e2e_p95_ms: Some(10_000.0),
        };
        // TTFT crosses at 3.5 req/s, E2E (8 s -> 16 s) at 2.5 req/s.
        let curve = [(2.0, 1000.0, 8_000.0), (4.0, 2500.0, 16_000.0)];
        assert!((goodput_at_slo(&curve, slo) - 2.5).abs() < 1e-12);
        // A non-finite latency is a miss (crossing at the last good point).
        let curve = [(2.0, 1000.0, 8_000.0), (4.0, f64::NAN, 9_000.0)];
        assert_eq!(goodput_at_slo(&curve, slo), 2.0);
    }

    fn result(ttft_p95: f64) -> PolicyResult {
        let mut r = PolicyResult::from_records(std::iter::empty());
        // Measured values (nothing measured is NaN, which never equals itself).
        r.ttft_ms = LatencyStats::default();
        r.e2e_ms = LatencyStats::default();
        r.itl_ms = LatencyStats::default();
        r.ttft_ms.p95 = ttft_p95;
        r
    }

    /// A live point with a few failures is held to its p95 (over every request, the
    /// failures ranked slowest): one timeout in 1,000 no longer makes it a miss, as its
    /// p99 did. A simulated one (percentiles over completed requests) still is held
    /// to the bound that counts its failures.
    #[test]
    fn a_live_point_with_few_failures_is_held_to_its_p95() {
        let point = |load: f64| {
            let mut r = result(1500.0);
            r.requests = 1000;
            r.failed = 1;
            r.ttft_ms.p99 = 2600.0;
            SweepPoint {
                time_scale: 1.0 / load,
                offered_rps: load,
                policies: vec![("gorgo".into(), r)],
            }
        };
        let goodput = |mode: &str| {
            Sweep::new(
                serde_json::json!({"mode": mode}),
                1.0,
                SLO,
                vec![point(2.0)],
            )
            .goodput[0]
                .bound
        };
        assert_eq!(goodput("live"), Bound::AtLeast);
        assert_eq!(goodput("sim"), Bound::Below);
    }

    #[test]
    fn ratios_are_to_the_best_baseline() {
        let point = |load: f64, ttft: [f64; 3]| SweepPoint {
            time_scale: 1.0 / load,
            offered_rps: load,
            policies: vec![
                ("gorgo".into(), result(ttft[0])),
                ("least-load".into(), result(ttft[1])),
                ("oracle".into(), result(ttft[2])),
            ],
        };
        let sweep = Sweep::new(
            serde_json::json!({}),
            1.0,
            SLO,
            vec![
                point(4.0, [1500.0, 4000.0, 100.0]),
                point(2.0, [1000.0, 1000.0, 100.0]),
            ],
        );
        assert_eq!(sweep.points[0].offered_rps, 2.0);
        assert_eq!(sweep.best_baseline.as_deref(), Some("least-load"));
        let g: Vec<_> = sweep
            .goodput
            .iter()
            .map(|g| (g.policy.as_str(), g.goodput_rps, g.ratio_to_best_baseline))
            .collect();
        // least-load crosses 2000 ms a third of the way from 2 to 4 req/s.
        let ll = 2.0 + 2.0 / 3.0;
        assert_eq!(g[0], ("gorgo", 4.0, Some(4.0 / ll)));
        assert_eq!(g[1].2, Some(1.0));
        assert!((g[1].1 - ll).abs() < 1e-12);
        assert_eq!(g[2].1, 4.0);
        let md = render_sweep_markdown(&sweep);
        assert!(
            md.contains("| least-load (best baseline) | 2.67 | 1.00x |"),
            "{md}"
        );
        let back: Sweep = serde_json::from_str(&serde_json::to_string(&sweep).unwrap()).unwrap();
        assert_eq!(back, sweep);
    }

    #[test]
    fn the_floor_is_a_row_and_bars_below_it_are_flagged() {
        let point = |load: f64, ttft: f64| SweepPoint {
            time_scale: 1.0 / load,
            offered_rps: load,
            policies: vec![
                ("gorgo".into(), result(ttft)),
                ("round-robin".into(), result(ttft * 2.0)),
                ("least-load".into(), result(ttft)),
            ],
        };
        let mut sweep = Sweep::new(
            serde_json::json!({}),
            1.0,
            SLO,
            vec![point(1.0, 1100.0), point(2.0, 3000.0)],
        );
        let floor = LatencyStats {
            p50: 500.0,
            p95: 1000.0,
            p99: 1200.0,
            mean: 600.0,
        };
        sweep.floor = Some(LatencyFloor {
            requests: 10,
            ttft_ms: floor,
            e2e_ms: floor,
            cache_hit_ratio: Some(0.5),
        });
        let md = render_sweep_markdown(&sweep);
        assert!(
            md.contains("| floor (no policy can beat) | 1000 | 1000 |"),
            "{md}"
        );
        // least-load, not round-robin, is the best baseline; 0.85 x 1100 is under 1000.
        assert!(
            md.contains("| 1.00 req/s (x1) | least-load | 1.10 | 0.94 (below the floor) |"),
            "{md}"
        );
        assert!(
            md.contains("| 2.00 req/s (x0.5) | least-load | 3.00 | 2.55 |"),
            "{md}"
        );
        assert!(
            md.contains("| bound (unbounded shared cache) | 50.0% |"),
            "{md}"
        );
        let back: Sweep = serde_json::from_str(&serde_json::to_string(&sweep).unwrap()).unwrap();
        assert_eq!(back, sweep);
        // Sweeps written before the floor existed still load.
        let mut old = serde_json::to_value(&sweep).unwrap();
        old.as_object_mut().unwrap().remove("floor");
        let back: Sweep = serde_json::from_value(old).unwrap();
        assert_eq!(back.floor, None);
    }

    fn sweep_of(points: Vec<(f64, Vec<(&str, PolicyResult)>)>) -> Sweep {
        Sweep::new(
            serde_json::json!({}),
            1.0,
            SLO,
            points
                .into_iter()
                .map(|(load, policies)| SweepPoint {
                    time_scale: 1.0 / load,
                    offered_rps: load,
                    policies: policies
                        .into_iter()
                        .map(|(p, r)| (p.to_owned(), r))
                        .collect(),
                })
                .collect(),
        )
    }

    /// A sweep where nothing was measured (every prompt refused) prints `-`, as
    /// table.md does, never `NaN`, in the latency cells and the headroom table, and
    /// names no best baseline among goodputs that are all 0.
    #[test]
    fn unmeasured_points_print_dashes_not_nan() {
        let none = || PolicyResult::from_records(std::iter::empty());
        let mut sweep = sweep_of(vec![
            (0.5, vec![("gorgo", none()), ("least-load", none())]),
            (1.0, vec![("gorgo", none()), ("least-load", none())]),
        ]);
        let floor = LatencyStats {
            p50: 500.0,
            p95: 1000.0,
            p99: 1200.0,
            mean: 600.0,
        };
        sweep.floor = Some(LatencyFloor {
            requests: 4,
            ttft_ms: floor,
            e2e_ms: floor,
            cache_hit_ratio: None,
        });
        assert_eq!(sweep.best_baseline, None);
        let md = render_sweep_markdown(&sweep);
        assert!(!md.contains("NaN"), "{md}");
        assert!(!md.contains("best baseline)"), "{md}");
        assert!(md.contains("| gorgo | - | - |"), "{md}");
        assert!(md.contains("| 0.50 req/s (x2) | - | - | - |"), "{md}");
        // A floor over no request (every one refused) is unmeasured too.
        sweep.floor = Some(LatencyFloor {
            requests: 0,
            ttft_ms: LatencyStats::unmeasured(),
            e2e_ms: LatencyStats::unmeasured(),
            cache_hit_ratio: None,
        });
        let md = render_sweep_markdown(&sweep);
        assert!(!md.contains("NaN"), "{md}");
    }

    /// Goodput at the edges of a sweep is a bound: every load met the SLO (at least
    /// the highest) or the lowest missed (below it). Two policies that meet it
    /// everywhere are not a tie, and their ratio is unknown.
    #[test]
    fn goodput_at_the_edges_is_a_bound() {
        let sweep = sweep_of(vec![
            (
                2.0,
                vec![
                    ("gorgo", result(500.0)),
                    ("least-load", result(500.0)),
                    ("round-robin", result(3000.0)),
                ],
            ),
            (
                4.0,
                vec![
                    ("gorgo", result(900.0)),
                    ("least-load", result(900.0)),
                    ("round-robin", result(9000.0)),
                ],
            ),
        ]);
        let g = |p: &str| sweep.goodput.iter().find(|g| g.policy == p).unwrap();
        assert_eq!(sweep.best_baseline.as_deref(), Some("least-load"));
        assert_eq!(
            (g("gorgo").goodput_rps, g("gorgo").bound),
            (4.0, Bound::AtLeast)
        );
        assert_eq!(g("gorgo").ratio_to_best_baseline, None);
        assert_eq!(g("least-load").ratio_to_best_baseline, None);
        assert_eq!(
            (g("round-robin").goodput_rps, g("round-robin").bound),
            (0.0, Bound::Below)
        );
        // Below 2 req/s, over at least 4: below half of it.
        assert_eq!(g("round-robin").ratio_to_best_baseline, Some(0.5));
        assert_eq!(g("round-robin").ratio_bound, Bound::Below);
        let md = render_sweep_markdown(&sweep);
        assert!(md.contains("| gorgo | >= 4.00 | - |"), "{md}");
        assert!(
            md.contains("| least-load (best baseline) | >= 4.00 | - |"),
            "{md}"
        );
        assert!(md.contains("| round-robin | < 2.00 | < 0.50x |"), "{md}");
        // A value over a lower bound is at most their ratio.
        let sweep = sweep_of(vec![
            (
                2.0,
                vec![("gorgo", result(1000.0)), ("least-load", result(500.0))],
            ),
            (
                4.0,
                vec![("gorgo", result(3000.0)), ("least-load", result(900.0))],
            ),
        ]);
        let g = &sweep.goodput[0];
        assert_eq!((g.goodput_rps, g.bound), (3.0, Bound::Exact));
        assert_eq!(
            (g.ratio_to_best_baseline, g.ratio_bound),
            (Some(0.75), Bound::AtMost)
        );
        assert!(render_sweep_markdown(&sweep).contains("| gorgo | 3.00 | <= 0.75x |"));
        // Read back, and read as exact from a sweep written before bounds existed.
        let json = serde_json::to_value(&sweep).unwrap();
        assert_eq!(json["goodput"][0]["ratio_bound"], "at_most");
        let mut old = json.clone();
        for g in old["goodput"].as_array_mut().unwrap() {
            let g = g.as_object_mut().unwrap();
            g.remove("bound");
            g.remove("ratio_bound");
        }
        let back: Sweep = serde_json::from_value(old).unwrap();
        assert_eq!(back.goodput[0].bound, Bound::Exact);
    }

    /// Failed requests count as infinitely slow: a load where 60 of 100 failed misses
    /// a 2 s SLO whatever the completed requests' p95; with 2 of 100 failed, the p99
    /// (the smallest stored percentile sure to cover them) is held to it.
    #[test]
    fn failed_requests_count_as_infinitely_slow() {
        let with = |failed: u64, p99: f64| {
            let mut r = result(500.0);
            r.requests = 100;
            r.failed = failed;
            r.ttft_ms.p99 = p99;
            r.e2e_ms.p95 = 1.0;
            r.e2e_ms.p99 = 1.0;
            r
        };
        let goodput = |r: PolicyResult| {
            let g = &sweep_of(vec![(1.0, vec![("least-load", r)])]).goodput[0];
            (g.goodput_rps, g.bound)
        };
        assert_eq!(goodput(with(60, 600.0)), (0.0, Bound::Below));
        assert_eq!(goodput(with(0, 2500.0)), (1.0, Bound::AtLeast));
        assert_eq!(goodput(with(2, 2500.0)), (0.0, Bound::Below));
        assert_eq!(goodput(with(2, 1500.0)), (1.0, Bound::AtLeast));
        // 5 of 100: the p95 is the slowest completed request, which nothing stored bounds.
        assert_eq!(goodput(with(5, 600.0)), (0.0, Bound::Below));
    }

    /// The note under the tables says how failures were held to the SLO, which
    /// differs: a simulated point's p99 stands in for its p95, a live point's p95 is
    /// over every request already.
    #[test]
    fn the_failure_note_follows_the_sweeps_mode() {
        let mut r = result(500.0);
        r.requests = 100;
        r.failed = 2;
        let mut sweep = sweep_of(vec![(1.0, vec![("least-load", r)])]);
        assert!(render_sweep_markdown(&sweep).contains("p99 stands in"));
        sweep.config = serde_json::json!({"mode": "live"});
        let md = render_sweep_markdown(&sweep);
        assert!(
            !md.contains("p99") && md.contains("over every request sent"),
            "{md}"
        );
    }

    /// A censored p95 (+inf) and an unmeasured one (NaN) are both `null` in JSON;
    /// `sweep.json` keeps them apart with `censored` marks, and reading restores +inf.
    #[test]
    fn censored_percentiles_survive_sweep_json() {
        let mut censored = result(500.0);
        censored.ttft_ms.p95 = f64::INFINITY;
        censored.ttft_ms.p99 = f64::INFINITY;
        let sweep = sweep_of(vec![(
            1.0,
            vec![
                ("least-load", censored),
                ("gorgo", PolicyResult::from_records(std::iter::empty())),
            ],
        )]);
        let json = serde_json::to_value(&sweep).unwrap();
        let point = &json["points"][0];
        assert_eq!(
            point["policies"]["least-load"]["ttft_ms"]["p95"],
            serde_json::Value::Null
        );
        assert_eq!(
            point["censored"],
            serde_json::json!({"least-load": ["ttft_ms.p95", "ttft_ms.p99"]})
        );
        // From the text, as a reader gets it (a `Value` would sort the policies).
        let back: Sweep = serde_json::from_str(&serde_json::to_string(&sweep).unwrap()).unwrap();
        let r = &back.points[0].policies[0].1;
        assert_eq!(
            (r.ttft_ms.p50, r.ttft_ms.p95, r.ttft_ms.p99),
            (0.0, f64::INFINITY, f64::INFINITY)
        );
        assert!(back.points[0].policies[1].1.ttft_ms.p95.is_nan());
        // No censored value, no `censored` key.
        let plain = sweep_of(vec![(1.0, vec![("least-load", result(500.0))])]);
        assert!(serde_json::to_value(&plain).unwrap()["points"][0]
            .get("censored")
            .is_none());
    }

    #[test]
    fn time_scales_get_at_most_three_decimals() {
        assert_eq!(load_label(0.5, 5.882352941176471), "0.50 req/s (x5.882)");
        assert_eq!(load_label(2.0, 0.5), "2.00 req/s (x0.5)");
        assert_eq!(load_label(1.0, 1.0), "1.00 req/s (x1)");
        assert_eq!(load_label(1.0, 0.0001234), "1.00 req/s (x1.2e-4)");
    }
}
