//! Per-policy aggregation in docs/design.md's results.json schema.

use std::collections::BTreeMap;

use gorgo_core::{percentile, spearman, summarize, LatencyStats};
use serde::{Deserialize, Serialize};

use crate::record::RequestRecord;

/// One policy's aggregate: what `results.json` holds under `policies.<name>`.
///
/// As [`PolicyResult::from_records`] computes it (the simulator's reports), latencies,
/// region shares and the forwarded share are over completed requests; `requests`
/// counts every request, `failed` those that did not complete. A live report
/// (`gorgo bench`, `compare`) replaces `ttft_ms` and `e2e_ms` with percentiles over
/// *every* request sent, a failed one ranked at what it measured or at the time it
/// failed, and names in `config.censored` the percentiles that fall among failures
/// (docs/bench.md, "Failures and censoring"). Either way a consumer that holds them to
/// an SLO must count the failures ([`crate::slo_p95`]).
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
    /// Engine-reported cached prompt tokens over prompt tokens, over completed requests
    /// served by a region whose engine reported them (a request it left them out of
    /// counts as 0 cached: [`PolicyResult::from_records`]); `None` when none did.
    #[serde(default)]
    pub cache_hit_ratio: Option<f64>,
    /// The same ratio per serving region (regions with a report only).
    #[serde(default)]
    pub cache_hit_ratio_by_region: BTreeMap<String, f64>,
    /// How well the cost model's TTFT estimate matched the measured TTFT; `None` when no
    /// request that measured its TTFT carried an estimate (policies that do not
    /// estimate costs).
    #[serde(default)]
    pub prediction: Option<PredictionError>,
    /// Gossip the nodes sent while requests arrived, bytes per node per second: what a
    /// simulation counts (docs/simulator.md); live reports leave it out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gossip_bytes_per_node_per_s: Option<f64>,
}

/// The cost model's prediction error over one policy's requests that measured their
/// TTFT: the chosen candidate's estimated TTFT against the TTFT measured at the client.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PredictionError {
    /// Median of `|estimated - measured| / measured`, percent.
    pub mape_median: f64,
    /// Spearman rank correlation of estimated and measured TTFT (`None` with fewer than
    /// two requests or no spread, or when the run kept no per-request rows).
    pub spearman: Option<f64>,
    /// Requests compared.
    pub n: u64,
}

impl PredictionError {
    /// From `(estimated, measured)` TTFT pairs, ms; `None` when no pair is usable (both
    /// finite, measured > 0).
    pub fn from_pairs(pairs: &[(f64, f64)]) -> Option<Self> {
        let pairs: Vec<(f64, f64)> = pairs
            .iter()
            .copied()
            .filter(|(e, m)| e.is_finite() && m.is_finite() && *m > 0.0)
            .collect();
        let mut ape: Vec<f64> = pairs
            .iter()
            .map(|(e, m)| (e - m).abs() / m * 100.0)
            .collect();
        ape.sort_by(f64::total_cmp);
        Some(PredictionError {
            mape_median: percentile(&ape, 50.0)?,
            spearman: spearman(&pairs),
            n: pairs.len() as u64,
        })
    }
}

/// `cached / prompt` as a ratio, `None` without prompt tokens.
pub fn hit_ratio(cached: u64, prompt: u64) -> Option<f64> {
    (prompt > 0).then(|| cached as f64 / prompt as f64)
}

impl PolicyResult {
    /// Aggregate one policy's records.
    ///
    /// An engine that reports cached prompt tokens may leave them out when nothing was
    /// cached (vLLM with `--enable-prompt-tokens-details` sends `cached_tokens` only
    /// when it is not 0): a completed request without them, served by a region whose
    /// engine reported them for another request, counts as a miss, not as unknown
    /// (which would leave every miss out of the ratio). The prediction error counts
    /// every request that measured its TTFT, one cut after its first token too.
    pub fn from_records<'a>(records: impl IntoIterator<Item = &'a RequestRecord>) -> Self {
        let records: Vec<&RequestRecord> = records.into_iter().collect();
        let reports_cached: std::collections::BTreeSet<&str> = records
            .iter()
            .filter(|r| r.ok && r.cached_tokens.is_some())
            .filter_map(|r| r.served_by.as_deref())
            .collect();
        let mut requests = 0u64;
        let mut failed = 0u64;
        let (mut first, mut last) = (f64::INFINITY, f64::NEG_INFINITY);
        let (mut ttft, mut e2e, mut itl) = (Vec::new(), Vec::new(), Vec::new());
        let mut served: BTreeMap<String, u64> = BTreeMap::new();
        let mut forwarded = 0u64;
        // (cached, prompt) tokens, overall and per serving region.
        let mut hits = (0u64, 0u64);
        let mut hits_by_region: BTreeMap<String, (u64, u64)> = BTreeMap::new();
        let mut predicted = Vec::new();
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
            if let Some(p) = r.predicted_ttft_ms.filter(|_| r.ttft_ms.is_finite()) {
                predicted.push((p, r.ttft_ms));
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
            let cached = r.cached_tokens.or_else(|| {
                r.served_by
                    .as_deref()
                    .is_some_and(|s| reports_cached.contains(s))
                    .then_some(0)
            });
            if let Some(cached) = cached {
                let cached = cached.min(r.input_tokens);
                hits.0 += cached;
                hits.1 += r.input_tokens;
                if let Some(s) = &r.served_by {
                    let e = hits_by_region.entry(s.clone()).or_insert((0, 0));
                    e.0 += cached;
                    e.1 += r.input_tokens;
                }
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
            cache_hit_ratio: hit_ratio(hits.0, hits.1),
            cache_hit_ratio_by_region: hits_by_region
                .into_iter()
                .filter_map(|(k, (c, p))| Some((k, hit_ratio(c, p)?)))
                .collect(),
            prediction: PredictionError::from_pairs(&predicted),
            gossip_bytes_per_node_per_s: None,
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
