//! Per-policy aggregation in DESIGN.md's results.json schema.

use std::collections::BTreeMap;

use gorgo_core::{summarize, LatencyStats};
use serde::{Deserialize, Serialize};

use crate::record::RequestRecord;

/// One policy's aggregate: what `results.json` holds under `policies.<name>`.
///
/// Latencies, region shares and the forwarded share are over completed requests;
/// `requests` counts every request, `failed` those that did not complete.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyResult {
    /// Requests sent.
    pub requests: u64,
    /// Requests that did not complete.
    pub failed: u64,
    /// From the first send to the last completion, seconds.
    pub duration_s: f64,
    /// Completed requests per second over `duration_s`.
    pub throughput_rps: f64,
    /// Time to first token, ms.
    pub ttft_ms: LatencyStats,
    /// End-to-end latency, ms.
    pub e2e_ms: LatencyStats,
    /// Inter-token latency, ms (requests with at least two output tokens).
    pub itl_ms: LatencyStats,
    /// Fraction of completed requests served by each region.
    pub region_share: BTreeMap<String, f64>,
    /// Fraction of completed requests served outside their home region.
    pub forwarded_share: f64,
}

impl PolicyResult {
    /// Aggregate one policy's records.
    pub fn from_records<'a>(records: impl IntoIterator<Item = &'a RequestRecord>) -> Self {
        let mut requests = 0u64;
        let mut failed = 0u64;
        let (mut first, mut last) = (f64::INFINITY, f64::NEG_INFINITY);
        let (mut ttft, mut e2e, mut itl) = (Vec::new(), Vec::new(), Vec::new());
        let mut served: BTreeMap<String, u64> = BTreeMap::new();
        let mut forwarded = 0u64;
        for r in records {
            requests += 1;
            if r.start_ms.is_finite() {
                first = first.min(r.start_ms);
                last = last.max(
                    r.start_ms
                        + if r.e2e_ms.is_finite() {
                            r.e2e_ms.max(0.0)
                        } else {
                            0.0
                        },
                );
            }
            if !r.ok {
                failed += 1;
                continue;
            }
            ttft.push(r.ttft_ms);
            e2e.push(r.e2e_ms);
            if let Some(v) = r.itl() {
                itl.push(v);
            }
            if let Some(s) = &r.served_by {
                *served.entry(s.clone()).or_insert(0) += 1;
            }
            if r.forwarded() {
                forwarded += 1;
            }
        }
        let completed = requests - failed;
        let duration_s = if last > first {
            (last - first) / 1000.0
        } else {
            0.0
        };
        let share = |n: u64| {
            if completed == 0 {
                0.0
            } else {
                n as f64 / completed as f64
            }
        };
        PolicyResult {
            requests,
            failed,
            duration_s,
            throughput_rps: if duration_s > 0.0 {
                completed as f64 / duration_s
            } else {
                0.0
            },
            ttft_ms: summarize(&mut ttft),
            e2e_ms: summarize(&mut e2e),
            itl_ms: summarize(&mut itl),
            region_share: served.into_iter().map(|(k, n)| (k, share(n))).collect(),
            forwarded_share: share(forwarded),
        }
    }
}

/// Aggregate records per policy, in the order policies first appear.
pub fn aggregate(records: &[RequestRecord]) -> Vec<(String, PolicyResult)> {
    let mut order: Vec<&str> = Vec::new();
    for r in records {
        if !order.contains(&r.policy.as_str()) {
            order.push(&r.policy);
        }
    }
    order
        .into_iter()
        .map(|p| {
            (
                p.to_owned(),
                PolicyResult::from_records(records.iter().filter(|r| r.policy == p)),
            )
        })
        .collect()
}
