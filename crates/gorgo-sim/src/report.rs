//! From simulation runs to the report of `gorgo-report` (results.json, table.md,
//! requests.csv, plots, tuning.jsonl), plus the simulator's own summary.

use std::collections::BTreeMap;

use gorgo_core::{LatencySketch, LatencyStats};
use gorgo_report::{hit_ratio, PolicyResult, PredictionError, Report, RequestRecord, Results};
use serde::Serialize;

use crate::collect::{PolicyRun, Row};
use crate::Result;

/// The distributed-vs-oracle gap: how much worse the distributed `gorgo` nodes do than
/// one router that sees everything instantly.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct OracleGap {
    /// `gorgo` p95 TTFT, ms.
    pub gorgo_p95_ttft_ms: f64,
    /// `oracle` p95 TTFT, ms.
    pub oracle_p95_ttft_ms: f64,
    /// `gorgo / oracle` p95 TTFT (1.0: distribution costs nothing).
    pub p95_ttft_ratio: f64,
    /// `gorgo / oracle` p50 TTFT.
    pub p50_ttft_ratio: f64,
}

/// The gap between `gorgo` and `oracle`, when both ran.
pub fn oracle_gap(results: &Results) -> Option<OracleGap> {
    let g = results.policy("gorgo")?;
    let o = results.policy("oracle")?;
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    Some(OracleGap {
        gorgo_p95_ttft_ms: g.ttft_ms.p95,
        oracle_p95_ttft_ms: o.ttft_ms.p95,
        p95_ttft_ratio: ratio(g.ttft_ms.p95, o.ttft_ms.p95),
        p50_ttft_ratio: ratio(g.ttft_ms.p50, o.ttft_ms.p50),
    })
}

fn record(policy: &str, regions: &[String], r: &Row) -> RequestRecord {
    RequestRecord {
        policy: policy.to_owned(),
        request_id: format!("r{}", r.index),
        region: regions[r.home as usize].clone(),
        served_by: r.served.map(|s| regions[s as usize].clone()),
        hops: r.hops as u32,
        // The simulator fails requests only before their first token: no TTFT.
        ttft_ms: if r.ok { r.ttft_ms as f64 } else { f64::NAN },
        e2e_ms: r.e2e_ms as f64,
        itl_ms: None,
        input_tokens: r.input_tokens as u64,
        output_tokens: r.output_tokens as u64,
        cached_tokens: r.ok.then_some(r.cached_tokens as u64),
        predicted_ttft_ms: r.predicted_ttft_ms.map(f64::from),
        cached_anywhere_tokens: Some(u64::from(r.cached_anywhere_tokens)),
        start_ms: r.start_ms,
        // The simulator has no response head apart from the first token.
        first_byte_ms: None,
        retries: 0,
        ok: r.ok,
        error: r.error.as_deref().map(str::to_owned),
    }
}

/// A sketch's statistics; NaN where it holds nothing (no completed request), as
/// [`gorgo_core::summarize`] gives.
fn stats(s: &LatencySketch) -> LatencyStats {
    let q = |p| s.quantile(p).unwrap_or(f64::NAN);
    LatencyStats {
        p50: q(0.50),
        p95: q(0.95),
        p99: q(0.99),
        mean: s.mean().unwrap_or(f64::NAN),
    }
}

/// A policy's aggregate from its sketches (1% relative accuracy on percentiles), for
/// runs too long to keep every row. The prediction's Spearman correlation needs every
/// pair, so it is absent here.
pub fn result_from_sketches(run: &PolicyRun) -> PolicyResult {
    let c = &run.counters;
    let s = &run.sketches;
    let duration_s = if s.last_end_ms > s.first_start_ms {
        (s.last_end_ms - s.first_start_ms) / 1000.0
    } else {
        0.0
    };
    let share = |n: u64| {
        if c.completed == 0 {
            0.0
        } else {
            n as f64 / c.completed as f64
        }
    };
    let region_share: BTreeMap<String, f64> = run
        .regions
        .iter()
        .zip(&c.served_by_region)
        .filter(|(_, &n)| n > 0)
        .map(|(r, &n)| (r.clone(), share(n)))
        .collect();
    PolicyResult {
        requests: c.requests,
        failed: c.failed,
        duration_s,
        throughput_rps: if duration_s > 0.0 {
            c.completed as f64 / duration_s
        } else {
            0.0
        },
        ttft_ms: stats(&s.ttft),
        e2e_ms: stats(&s.e2e),
        itl_ms: stats(&s.itl),
        region_share,
        forwarded_share: share(c.forwarded),
        cache_hit_ratio: {
            let (cached, prompt) = s
                .hit_tokens
                .iter()
                .fold((0, 0), |a, h| (a.0 + h.0, a.1 + h.1));
            hit_ratio(cached, prompt)
        },
        cache_hit_ratio_by_region: run
            .regions
            .iter()
            .zip(&s.hit_tokens)
            .filter_map(|(r, &(cached, prompt))| Some((r.clone(), hit_ratio(cached, prompt)?)))
            .collect(),
        prediction: s.prediction_ape.quantile(0.5).map(|m| PredictionError {
            mape_median: m,
            spearman: None,
            n: s.prediction_ape.count(),
        }),
        gossip_bytes_per_node_per_s: gossip(run),
    }
}

/// The gossip a run's nodes sent while requests arrived (none in oracle mode, where
/// no node gossips).
fn gossip(run: &PolicyRun) -> Option<f64> {
    let c = &run.counters;
    (c.gossip_messages > 0).then(|| c.gossip_bytes_per_node_per_s_arriving(run.regions.len()))
}

/// Build the report of `runs`: exact aggregates from the rows when every run kept
/// them, else aggregates from the sketches and no per-request CSV rows.
pub fn build_report<C: Serialize + ?Sized>(config: &C, runs: &[PolicyRun]) -> Result<Report> {
    let tuning: Vec<_> = runs.iter().flat_map(|r| r.tuning.iter()).collect();
    let report = if runs.iter().all(|r| r.rows.is_some()) {
        let records: Vec<RequestRecord> = runs
            .iter()
            .flat_map(|run| {
                run.rows
                    .iter()
                    .flatten()
                    .map(|row| record(&run.policy, &run.regions, row))
            })
            .collect();
        let mut report = Report::from_records(config, records)?;
        // A policy with no request at all still gets its (empty) entry.
        for run in runs {
            if report.results.policy(&run.policy).is_none() {
                report
                    .results
                    .policies
                    .push((run.policy.clone(), result_from_sketches(run)));
            }
        }
        for run in runs {
            if let Some(r) = report.results.policy_mut(&run.policy) {
                r.gossip_bytes_per_node_per_s = gossip(run);
            }
        }
        report
    } else {
        let mut report = Report::from_records(config, Vec::new())?;
        report.results.policies = runs
            .iter()
            .map(|r| (r.policy.clone(), result_from_sketches(r)))
            .collect();
        report
    };
    Ok(report.with_tuning(&tuning)?)
}
