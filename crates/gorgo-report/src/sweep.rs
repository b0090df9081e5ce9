//! Load sweeps: the same workload through every policy at several offered loads, and
//! **goodput at SLO**, the highest offered load at which a policy still meets its
//! latency objectives.
//!
//! A single load point says little: which policy wins changes with load (the paper's
//! own results change sign past a time scale of about 3). `gorgo sweep` produces one
//! [`crate::Results`]-style aggregate per (load, policy); this module turns them into
//! `sweep.json`, `sweep.md` and the per-load plots, whatever driver (simulator or live
//! clusters) produced them.

use serde::{Deserialize, Serialize};

use crate::table::markdown;
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepPoint {
    /// The factor applied to the trace's inter-arrival times (< 1: faster).
    pub time_scale: f64,
    /// Offered load, requests per second: the trace's mean rate / `time_scale`.
    pub offered_rps: f64,
    /// Aggregates by policy name, in run order.
    #[serde(with = "crate::ordered_map")]
    pub policies: Vec<(String, PolicyResult)>,
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

/// One policy's goodput at the SLO.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Goodput {
    /// The policy.
    pub policy: String,
    /// Highest offered load meeting the SLO, requests/s ([`goodput_at_slo`]).
    pub goodput_rps: f64,
    /// `goodput_rps` over the best baseline's (`None` when the best baseline's is 0 or
    /// no baseline ran).
    pub ratio_to_best_baseline: Option<f64>,
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
    /// The baseline with the highest goodput (ties: the first), if any baseline ran.
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
/// non-finite load are dropped; a non-finite latency counts as a miss.
pub fn goodput_at_slo(curve: &[(f64, f64, f64)], slo: Slo) -> f64 {
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
        return points.last().map_or(0.0, |p| p.0);
    };
    if first_miss == 0 {
        return 0.0;
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
    load.clamp(lo.0, hi.0)
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
                let curve: Vec<(f64, f64, f64)> = sweep
                    .curve(&p)
                    .into_iter()
                    .map(|(load, r)| (load, r.ttft_ms.p95, r.e2e_ms.p95))
                    .collect();
                Goodput {
                    goodput_rps: goodput_at_slo(&curve, slo),
                    policy: p,
                    ratio_to_best_baseline: None,
                }
            })
            .collect();
        let best = goodput
            .iter()
            .filter(|g| is_baseline(&g.policy))
            .fold(None::<&Goodput>, |best, g| match best {
                Some(b) if b.goodput_rps >= g.goodput_rps => Some(b),
                _ => Some(g),
            })
            .map(|g| (g.policy.clone(), g.goodput_rps));
        if let Some((_, base)) = &best {
            for g in &mut goodput {
                g.ratio_to_best_baseline = (*base > 0.0).then(|| g.goodput_rps / base);
            }
        }
        sweep.best_baseline = best.map(|(p, _)| p);
        sweep.goodput = goodput;
        sweep
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
            .map(|p| format!("{:.2} req/s (x{})", p.offered_rps, p.time_scale)),
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

/// Label of the floor's row in the per-load tables.
const FLOOR_ROW: &str = "floor (no policy can beat)";

/// One line per load: the best baseline's p95 TTFT over the floor's, and what a
/// ratio of 0.85 to the best baseline would need against the floor. Where the best
/// baseline is within 1 / 0.85 of the floor, that bar is below what any policy can do.
fn floor_headroom(sweep: &Sweep, floor: &LatencyFloor) -> String {
    let mut out = format!(
        "\nHeadroom over the floor (p95 TTFT {:.0} ms over {} requests: each request alone on \
         the fastest engine, an unbounded cache shared by every engine, no network):\n\n",
        floor.ttft_ms.p95, floor.requests
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
            let (name, best) = pt
                .policies
                .iter()
                .filter(|(p, _)| is_baseline(p))
                .min_by(|a, b| a.1.ttft_ms.p95.total_cmp(&b.1.ttft_ms.p95))?;
            let ratio = best.ttft_ms.p95 / floor.ttft_ms.p95;
            Some(vec![
                format!("{:.2} req/s (x{})", pt.offered_rps, pt.time_scale),
                name.clone(),
                format!("{ratio:.2}"),
                format!(
                    "{:.2}{}",
                    0.85 * ratio,
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
            vec![
                name,
                format!("{:.2}", g.goodput_rps),
                g.ratio_to_best_baseline
                    .map_or("-".into(), |r| format!("{r:.2}x")),
            ]
        })
        .collect();
    out.push_str(&markdown(&header, &rows));
    let floor = sweep.floor.as_ref();
    let ttft = |r: &LatencyStats| format!("{:.0}", r.p95);
    let e2e = |r: &LatencyStats| format!("{:.2}", r.p95 / 1000.0);
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
}
