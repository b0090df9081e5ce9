//! Latency statistics: the one nearest-rank percentile function of the project and a
//! mergeable latency sketch.
//!
//! Exact percentiles ([`percentile`], [`summarize`]) are for reports, where every sample
//! is at hand. The sketch ([`LatencySketch`]) is for the tuning protocol, where each
//! node summarises the latencies it observed in an epoch and the leader merges the
//! sketches: it is small, serde-serialisable for the wire and mergeable without loss
//! beyond its 1% relative error.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// The nearest-rank percentile of `sorted` (ascending), `p` in `[0, 100]`.
///
/// Nearest rank: with `n` samples the answer is the sample of 1-based rank
/// `ceil(p / 100 * n)`, clamped to `[1, n]` (so `p = 0` gives the minimum and
/// `p = 100` the maximum). It always returns one of the samples, never an
/// interpolation, which is what docs/design.md prescribes for every report.
///
/// Returns `None` for an empty slice or a `p` outside `[0, 100]` (or NaN). The slice
/// must be sorted ascending; this is not checked (callers sort once and ask several
/// percentiles).
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() || !(0.0..=100.0).contains(&p) {
        return None;
    }
    let n = sorted.len();
    let rank = nearest_rank(p / 100.0, n as u64) as usize;
    Some(sorted[rank - 1])
}

/// The 1-based nearest rank of quantile `q` in `[0, 1]` among `n >= 1` samples: the
/// rank [`percentile`] reads, public so that code reasoning about which sample a stored
/// percentile is (a report's goodput, counting failed requests) uses the same one.
pub fn nearest_rank(q: f64, n: u64) -> u64 {
    // `q * n` can land a hair above an integer through rounding (0.95 * 100 is
    // 95.00000000000001); trim that before `ceil` so the rank is the textbook one.
    let x = q * n as f64;
    let x = if (x - x.round()).abs() < 1e-9 {
        x.round()
    } else {
        x
    };
    (x.ceil() as u64).clamp(1, n)
}

/// The latency aggregates written to `results.json` (`ttft_ms`, `e2e_ms`, `itl_ms`).
///
/// Field names are part of the report format: `p50`, `p95`, `p99`, `mean`. A value
/// that could not be measured (a live policy whose requests all failed) is written as
/// `null` (JSON has no NaN) and read back as NaN.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencyStats {
    /// Nearest-rank median.
    #[serde(deserialize_with = "nan_if_null")]
    pub p50: f64,
    /// Nearest-rank 95th percentile.
    #[serde(deserialize_with = "nan_if_null")]
    pub p95: f64,
    /// Nearest-rank 99th percentile.
    #[serde(deserialize_with = "nan_if_null")]
    pub p99: f64,
    /// Arithmetic mean.
    #[serde(deserialize_with = "nan_if_null")]
    pub mean: f64,
}

impl LatencyStats {
    /// Nothing measured: every field NaN (`null` in JSON). Comparisons with NaN are
    /// false, so it meets no SLO, and `total_cmp` ranks it after every measured value.
    pub fn unmeasured() -> Self {
        LatencyStats {
            p50: f64::NAN,
            p95: f64::NAN,
            p99: f64::NAN,
            mean: f64::NAN,
        }
    }
}

/// A number, or NaN for `null` (what serde_json writes for a NaN).
fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// Summarise `values` (sorted in place, NaNs last) with [`percentile`].
///
/// NaN values are dropped from the statistics. An empty input (or all NaN) gives all
/// NaN ([`LatencyStats::unmeasured`]): a policy that completed nothing has no latency,
/// and a 0 ms would rank it best and count it within any SLO.
pub fn summarize(values: &mut [f64]) -> LatencyStats {
    values.sort_by(|a, b| a.total_cmp(b));
    // total_cmp sorts positive NaN last and negative NaN first; keep the finite middle.
    let start = values
        .iter()
        .position(|v| !v.is_nan())
        .unwrap_or(values.len());
    let end = values
        .iter()
        .rposition(|v| !v.is_nan())
        .map_or(start, |i| i + 1);
    let finite = &values[start..end.max(start)];
    if finite.is_empty() {
        return LatencyStats::unmeasured();
    }
    let mean = finite.iter().sum::<f64>() / finite.len() as f64;
    LatencyStats {
        p50: percentile(finite, 50.0).unwrap_or(0.0),
        p95: percentile(finite, 95.0).unwrap_or(0.0),
        p99: percentile(finite, 99.0).unwrap_or(0.0),
        mean,
    }
}

/// Spearman rank correlation of the pairs `(x, y)`: how well the order of one predicts
/// the order of the other (1: same order, -1: reversed, 0: unrelated). Reports use it to
/// judge the cost model, whose job is to rank candidates, not to be exact.
///
/// The Pearson correlation of the ranks, ties given their average rank. Pairs with a
/// non-finite value are dropped. `None` with fewer than two pairs or when either side
/// has all values equal (no ranking to compare).
pub fn spearman(pairs: &[(f64, f64)]) -> Option<f64> {
    let kept: Vec<(f64, f64)> = pairs
        .iter()
        .copied()
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    if kept.len() < 2 {
        return None;
    }
    let rx = ranks(kept.iter().map(|p| p.0));
    let ry = ranks(kept.iter().map(|p| p.1));
    let n = kept.len() as f64;
    let mean = (n + 1.0) / 2.0;
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for (a, b) in rx.iter().zip(&ry) {
        let (dx, dy) = (a - mean, b - mean);
        sxy += dx * dy;
        sxx += dx * dx;
        syy += dy * dy;
    }
    if sxx <= 0.0 || syy <= 0.0 {
        return None;
    }
    Some((sxy / (sxx * syy).sqrt()).clamp(-1.0, 1.0))
}

/// 1-based ranks of `values` in input order, ties sharing their average rank.
fn ranks(values: impl Iterator<Item = f64>) -> Vec<f64> {
    let v: Vec<f64> = values.collect();
    let mut order: Vec<usize> = (0..v.len()).collect();
    order.sort_by(|&a, &b| v[a].total_cmp(&v[b]));
    let mut out = vec![0.0; v.len()];
    let mut i = 0;
    while i < order.len() {
        let mut j = i;
        while j + 1 < order.len() && v[order[j + 1]] == v[order[i]] {
            j += 1;
        }
        // Ranks i+1..=j+1 share their mean.
        let rank = (i + j) as f64 / 2.0 + 1.0;
        for &k in &order[i..=j] {
            out[k] = rank;
        }
        i = j + 1;
    }
    out
}

/// Relative accuracy of [`LatencySketch`]: every quantile is within 1% of a true
/// sample value of the same rank.
pub const SKETCH_RELATIVE_ACCURACY: f64 = 0.01;

/// Values at or below this many milliseconds count as zero (one nanosecond: no latency
/// GORGO measures is that small, and it bounds the number of buckets).
pub const SKETCH_MIN_MS: f64 = 1e-6;

/// Values above this many milliseconds are clamped to it (about 11.5 days).
pub const SKETCH_MAX_MS: f64 = 1e9;

/// `gamma = (1 + a) / (1 - a)`: bucket `k` holds values in `(gamma^(k-1), gamma^k]`.
fn gamma() -> f64 {
    (1.0 + SKETCH_RELATIVE_ACCURACY) / (1.0 - SKETCH_RELATIVE_ACCURACY)
}

fn key_of(ms: f64) -> i32 {
    (ms.ln() / gamma().ln()).ceil() as i32
}

/// The bucket keys a valid sketch can hold; also the bound on its size.
fn key_range() -> (i32, i32) {
    (key_of(SKETCH_MIN_MS), key_of(SKETCH_MAX_MS))
}

/// A mergeable latency sketch with relative error at most 1% (DDSketch-style
/// logarithmic buckets).
///
/// Every value `x` in `(SKETCH_MIN_MS, SKETCH_MAX_MS]` lands in bucket
/// `ceil(log_gamma x)`; a quantile returns its bucket's midpoint
/// `2 gamma^k / (gamma + 1)`, within 1% of every value in the bucket. Merging adds
/// bucket counts, so the merge of two sketches equals the sketch of the union. At most
/// about 2,300 buckets exist, bounding the wire size; a sketch from the network is
/// validated on deserialisation (keys in range, counts consistent).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "SketchWire", into = "SketchWire")]
pub struct LatencySketch {
    buckets: BTreeMap<i32, u64>,
    zero_count: u64,
    count: u64,
    sum: f64,
    min: f64,
    max: f64,
}

/// The serialised form of a sketch, checked by `TryFrom` before it becomes one.
#[derive(Serialize, Deserialize)]
struct SketchWire {
    buckets: Vec<(i32, u64)>,
    zero_count: u64,
    sum: f64,
    min: f64,
    max: f64,
}

impl From<LatencySketch> for SketchWire {
    fn from(s: LatencySketch) -> Self {
        SketchWire {
            buckets: s.buckets.into_iter().collect(),
            zero_count: s.zero_count,
            sum: s.sum,
            min: s.min,
            max: s.max,
        }
    }
}

impl TryFrom<SketchWire> for LatencySketch {
    type Error = String;

    fn try_from(w: SketchWire) -> Result<Self, String> {
        let (lo, hi) = key_range();
        let mut buckets = BTreeMap::new();
        let mut count = w.zero_count;
        for (k, c) in w.buckets {
            if !(lo..=hi).contains(&k) {
                return Err(format!("sketch bucket {k} out of range"));
            }
            if c == 0 {
                continue;
            }
            let slot = buckets.entry(k).or_insert(0u64);
            *slot = slot.checked_add(c).ok_or("sketch bucket count overflows")?;
            count = count.checked_add(c).ok_or("sketch count overflows")?;
        }
        if !w.sum.is_finite() || !w.min.is_finite() || !w.max.is_finite() {
            return Err("sketch sum/min/max not finite".into());
        }
        if count > 0 && w.min > w.max {
            return Err("sketch min above max".into());
        }
        Ok(LatencySketch {
            buckets,
            zero_count: w.zero_count,
            count,
            sum: w.sum,
            min: w.min,
            max: w.max,
        })
    }
}

impl LatencySketch {
    /// An empty sketch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Record one latency in milliseconds. Non-finite values are ignored; negative
    /// values and values at most [`SKETCH_MIN_MS`] count as zero; values above
    /// [`SKETCH_MAX_MS`] are clamped.
    pub fn add(&mut self, ms: f64) {
        if !ms.is_finite() {
            return;
        }
        let ms = ms.clamp(0.0, SKETCH_MAX_MS);
        if ms <= SKETCH_MIN_MS {
            self.zero_count += 1;
        } else {
            *self.buckets.entry(key_of(ms)).or_insert(0) += 1;
        }
        if self.count == 0 {
            self.min = ms;
            self.max = ms;
        } else {
            self.min = self.min.min(ms);
            self.max = self.max.max(ms);
        }
        self.count += 1;
        self.sum += ms;
    }

    /// Fold `other` into `self`: the result is the sketch of both sets of samples.
    pub fn merge(&mut self, other: &LatencySketch) {
        if other.count == 0 {
            return;
        }
        for (&k, &c) in &other.buckets {
            let slot = self.buckets.entry(k).or_insert(0);
            *slot = slot.saturating_add(c);
        }
        self.zero_count = self.zero_count.saturating_add(other.zero_count);
        if self.count == 0 {
            self.min = other.min;
            self.max = other.max;
        } else {
            self.min = self.min.min(other.min);
            self.max = self.max.max(other.max);
        }
        self.count = self.count.saturating_add(other.count);
        self.sum += other.sum;
    }

    /// The nearest-rank quantile `q` in `[0, 1]` (0.95 for p95), within 1% relative
    /// error of the exact nearest-rank value ([`percentile`] at `100 q`).
    ///
    /// `None` when the sketch is empty or `q` is outside `[0, 1]`.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count == 0 || !(0.0..=1.0).contains(&q) {
            return None;
        }
        let rank = nearest_rank(q, self.count);
        if rank <= self.zero_count {
            return Some(0.0);
        }
        let mut seen = self.zero_count;
        let g = gamma();
        for (&k, &c) in &self.buckets {
            // Saturating as `merge` is: sketches from the network each fit a u64, but
            // their merge may not, and the count then stops at u64::MAX.
            seen = seen.saturating_add(c);
            if seen >= rank {
                let mid = 2.0 * g.powi(k) / (g + 1.0);
                // The true extremes are known exactly; never answer outside them.
                return Some(mid.clamp(self.min, self.max));
            }
        }
        Some(self.max)
    }

    /// The quantile `q` of durations of which `self` holds the ones that ended and
    /// `censored` the time so far of the ones still running (right-censored: each is
    /// known only to last at least that long), by the Kaplan-Meier estimate of the
    /// survival function over the buckets (at a bucket, ends count before the
    /// censored). Counting a running one as if it had ended would bias the quantile
    /// low, and leaving it out lower still, as the ones still running are the long
    /// ones; Kaplan-Meier is unbiased when the censoring is independent of the
    /// duration, as a window's close is of a request's length.
    ///
    /// Equal to [`LatencySketch::quantile`] when nothing is censored. When the
    /// estimate never falls to `1 - q` (too many of the longest still running), the
    /// largest time seen, a lower bound. `None` when both are empty or `q` is outside
    /// `[0, 1]`.
    pub fn censored_quantile(&self, censored: &LatencySketch, q: f64) -> Option<f64> {
        if censored.count == 0 || !(0.0..=1.0).contains(&q) {
            return self.quantile(q);
        }
        // Tolerance for the product of ratios against 1 - q.
        const EPS: f64 = 1e-12;
        let last_seen = self.max.max(censored.max);
        let mut at_risk = self.count.saturating_add(censored.count) as f64;
        let mut survival = 1.0;
        let mut step = |ended: u64, running: u64| -> bool {
            if ended > 0 && at_risk > 0.0 {
                survival *= 1.0 - ended as f64 / at_risk;
            }
            at_risk -= ended.saturating_add(running) as f64;
            ended > 0 && survival <= 1.0 - q + EPS
        };
        if step(self.zero_count, censored.zero_count) {
            return Some(0.0);
        }
        let keys: BTreeSet<i32> = self
            .buckets
            .keys()
            .chain(censored.buckets.keys())
            .copied()
            .collect();
        let g = gamma();
        for k in keys {
            let ended = self.buckets.get(&k).copied().unwrap_or(0);
            let running = censored.buckets.get(&k).copied().unwrap_or(0);
            if step(ended, running) {
                let mid = 2.0 * g.powi(k) / (g + 1.0);
                return Some(mid.clamp(self.min, self.max));
            }
        }
        Some(last_seen)
    }

    /// Mean of the samples at or above the nearest-rank quantile `q` (the tail mean,
    /// or CVaR: `tail_mean(0.8)` is the mean of the slowest 20%), from bucket
    /// midpoints (each within 1%). `None` when empty or `q` is outside `[0, 1]`.
    pub fn tail_mean(&self, q: f64) -> Option<f64> {
        if self.count == 0 || !(0.0..=1.0).contains(&q) {
            return None;
        }
        let mut want = self.count - nearest_rank(q, self.count) + 1;
        let n = want as f64;
        let g = gamma();
        let mut sum = 0.0;
        for (&k, &c) in self.buckets.iter().rev() {
            let take = c.min(want);
            let mid = (2.0 * g.powi(k) / (g + 1.0)).clamp(self.min, self.max);
            sum += mid * take as f64;
            want -= take;
            if want == 0 {
                break;
            }
        }
        // Whatever is left sits in the zero bucket.
        Some(sum / n)
    }

    /// Number of samples recorded.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Mean of the samples (exact), `None` when empty.
    pub fn mean(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum / self.count as f64)
    }

    /// True when nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn censored_quantile_is_kaplan_meier() {
        let sketch = |vs: &[f64]| {
            let mut s = LatencySketch::new();
            vs.iter().for_each(|&v| s.add(v));
            s
        };
        let ended = sketch(&[10.0, 20.0, 30.0, 40.0]);
        let running = sketch(&[25.0, 35.0]);
        // Survival 5/6 after 10, 4/6 after 20; 25 leaves the risk set; 4/6 x 2/3 =
        // 0.44 after 30: the median is 30. Counted as ended the running ones would
        // give 25, left out 20.
        let median = ended.censored_quantile(&running, 0.5).unwrap();
        assert!((median - 30.0).abs() < 0.3, "{median}");
        assert!((ended.censored_quantile(&running, 0.2).unwrap() - 20.0).abs() < 0.2);
        // Survival never reaches 0.05 before the last end (0 after 40, the one at
        // risk then ended): p95 is 40.
        assert!((ended.censored_quantile(&running, 0.95).unwrap() - 40.0).abs() < 0.4);
        // Most of the tail still running: the longest time seen, a lower bound.
        let long = sketch(&[500.0, 600.0]);
        assert_eq!(sketch(&[10.0]).censored_quantile(&long, 0.95), Some(600.0));
        assert_eq!(
            LatencySketch::new().censored_quantile(&long, 0.5),
            Some(600.0)
        );
        // Nothing censored: the plain quantile; nothing at all: none.
        let none = LatencySketch::new();
        assert_eq!(ended.censored_quantile(&none, 0.95), ended.quantile(0.95));
        assert_eq!(none.censored_quantile(&none, 0.5), None);
    }

    #[test]
    fn tail_mean_is_the_mean_of_the_slowest() {
        let mut s = LatencySketch::new();
        for v in 1..=100 {
            s.add(f64::from(v));
        }
        // Nearest rank 80 of 100: values 80..=100, mean 90.
        let t = s.tail_mean(0.8).unwrap();
        assert!((t - 90.0).abs() < 0.9, "{t}");
        assert!((s.tail_mean(0.0).unwrap() - 50.5).abs() < 0.6);
        assert!((s.tail_mean(1.0).unwrap() - 100.0).abs() < 1e-9);
        assert_eq!(LatencySketch::new().tail_mean(0.8), None);
        assert_eq!(s.tail_mean(1.5), None);
        let mut z = LatencySketch::new();
        z.add(0.0);
        z.add(0.0);
        assert_eq!(z.tail_mean(0.5), Some(0.0));
    }

    #[test]
    fn nearest_rank_textbook_values() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 95.0), Some(95.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        let w = [15.0, 20.0, 35.0, 40.0, 50.0];
        // Wikipedia's nearest-rank example.
        assert_eq!(percentile(&w, 30.0), Some(20.0));
        assert_eq!(percentile(&w, 40.0), Some(20.0));
        assert_eq!(percentile(&w, 50.0), Some(35.0));
        assert_eq!(percentile(&w, 100.0), Some(50.0));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&w, 101.0), None);
        assert_eq!(percentile(&w, f64::NAN), None);
    }

    #[test]
    fn summarize_sorts_and_ignores_nan() {
        let mut v = vec![3.0, f64::NAN, 1.0, 2.0, 4.0];
        let s = summarize(&mut v);
        assert_eq!(s.p50, 2.0);
        assert_eq!(s.p99, 4.0);
        assert_eq!(s.mean, 2.5);
        let empty = summarize(&mut []);
        assert!(empty.p50.is_nan() && empty.p95.is_nan() && empty.p99.is_nan());
        assert!(empty.mean.is_nan());
        let json = serde_json::to_value(s).unwrap();
        assert!(json.get("p50").is_some() && json.get("mean").is_some());
    }

    #[test]
    fn spearman_known_inputs() {
        let same = [(1.0, 10.0), (2.0, 20.0), (3.0, 25.0), (4.0, 1000.0)];
        assert!((spearman(&same).unwrap() - 1.0).abs() < 1e-12);
        let reversed = [(1.0, 4.0), (2.0, 3.0), (3.0, 2.0), (4.0, 1.0)];
        assert!((spearman(&reversed).unwrap() + 1.0).abs() < 1e-12);
        // Textbook example: d = (0, -1, 1, 0, 0) -> rho = 1 - 6 * 2 / (5 * 24) = 0.9.
        let xs = [(1.0, 1.0), (2.0, 3.0), (3.0, 2.0), (4.0, 4.0), (5.0, 5.0)];
        assert!((spearman(&xs).unwrap() - 0.9).abs() < 1e-12);
        // Ties take their average rank: x ranks (1, 2.5, 2.5, 4) against y = (1, 2, 3, 4).
        let tied = [(1.0, 1.0), (2.0, 2.0), (2.0, 3.0), (3.0, 4.0)];
        let r = spearman(&tied).unwrap();
        assert!((r - 4.5 / (4.5f64 * 5.0).sqrt()).abs() < 1e-12, "{r}");
        // Non-finite pairs dropped; too few or constant sides give None.
        let nan = [
            (1.0, 1.0),
            (f64::NAN, 2.0),
            (2.0, 2.0),
            (3.0, f64::INFINITY),
        ];
        assert!((spearman(&nan).unwrap() - 1.0).abs() < 1e-12);
        assert_eq!(spearman(&[(1.0, 2.0)]), None);
        assert_eq!(spearman(&[(1.0, 2.0), (1.0, 3.0)]), None);
    }

    #[test]
    fn sketch_edges() {
        let mut s = LatencySketch::new();
        assert_eq!(s.quantile(0.5), None);
        s.add(f64::NAN);
        assert!(s.is_empty());
        s.add(0.0);
        s.add(-5.0);
        s.add(1e12);
        assert_eq!(s.count(), 3);
        assert_eq!(s.quantile(0.0), Some(0.0));
        assert_eq!(s.quantile(1.0), Some(SKETCH_MAX_MS));
        assert_eq!(s.quantile(1.5), None);
    }

    #[test]
    fn sketch_rejects_bad_wire_form() {
        let bad = SketchWire {
            buckets: vec![(i32::MAX, 1)],
            zero_count: 0,
            sum: 1.0,
            min: 1.0,
            max: 1.0,
        };
        let bytes = crate::wire::encode(&bad);
        assert!(crate::wire::decode::<LatencySketch>(&bytes, 1 << 16).is_err());
        let mut good = LatencySketch::new();
        for x in [1.0, 10.0, 100.0] {
            good.add(x);
        }
        let bytes = crate::wire::encode(&good);
        assert_eq!(
            crate::wire::decode::<LatencySketch>(&bytes, 1 << 16).unwrap(),
            good
        );
    }

    /// Two sketches from the network, each of a count that fits a u64, merged past it
    /// (the tuning leader merges its followers' cells): the merged count saturates,
    /// and a quantile walks the buckets without overflowing.
    #[test]
    fn a_merge_past_u64_answers_quantiles() {
        let wire = |zero_count: u64, buckets: Vec<(i32, u64)>| {
            let w = SketchWire {
                buckets,
                zero_count,
                sum: 1.0,
                min: 1.0,
                max: 1.0,
            };
            crate::wire::decode::<LatencySketch>(&crate::wire::encode(&w), 1 << 16).unwrap()
        };
        let mut m = LatencySketch::new();
        m.merge(&wire(1 << 63, vec![]));
        m.merge(&wire(0, vec![(key_of(1.0), 1 << 63)]));
        assert_eq!(m.count(), u64::MAX);
        assert_eq!(m.quantile(0.95), Some(1.0));
    }

    fn within(approx: f64, exact: f64) -> bool {
        (approx - exact).abs() <= (SKETCH_RELATIVE_ACCURACY + 1e-9) * exact.abs()
    }

    proptest! {
        #[test]
        fn sketch_quantiles_within_one_percent(
            values in prop::collection::vec(0.01f64..100_000.0, 1..400),
            q in 0.0f64..=1.0,
        ) {
            let mut s = LatencySketch::new();
            for &v in &values {
                s.add(v);
            }
            let mut sorted = values.clone();
            sorted.sort_by(|a, b| a.total_cmp(b));
            let exact = percentile(&sorted, q * 100.0).unwrap();
            let approx = s.quantile(q).unwrap();
            prop_assert!(within(approx, exact), "q={q} exact={exact} approx={approx}");
        }

        /// Running ones all longer than every ended one are as if they had ended
        /// last: the Kaplan-Meier quantile is the union's, where that falls among
        /// the ended ones, and the longest time seen where it does not.
        #[test]
        fn censored_quantile_with_censoring_after_every_end(
            ended in prop::collection::vec(1.0f64..1000.0, 1..200),
            running in prop::collection::vec(2000.0f64..5000.0, 1..50),
            q in 0.0f64..=1.0,
        ) {
            let mut e = LatencySketch::new();
            let mut c = LatencySketch::new();
            let mut union = LatencySketch::new();
            for &v in &ended { e.add(v); union.add(v); }
            for &v in &running { c.add(v); union.add(v); }
            let km = e.censored_quantile(&c, q).unwrap();
            let u = union.quantile(q).unwrap();
            if u < 1500.0 {
                // The same bucket (each answer is clamped to its own sketch's extremes).
                prop_assert!(within(km, u), "km={km} union={u}");
            } else {
                prop_assert_eq!(km, c.max);
            }
        }

        #[test]
        fn sketch_merge_equals_union(
            a in prop::collection::vec(0.0f64..10_000.0, 0..200),
            b in prop::collection::vec(0.0f64..10_000.0, 0..200),
        ) {
            let mut sa = LatencySketch::new();
            let mut sb = LatencySketch::new();
            let mut su = LatencySketch::new();
            for &v in &a { sa.add(v); su.add(v); }
            for &v in &b { sb.add(v); su.add(v); }
            sa.merge(&sb);
            prop_assert_eq!(sa.count(), su.count());
            prop_assert_eq!(&sa.buckets, &su.buckets);
            prop_assert_eq!(sa.zero_count, su.zero_count);
            for q in [0.0, 0.5, 0.95, 0.99, 1.0] {
                prop_assert_eq!(sa.quantile(q), su.quantile(q));
            }
        }
    }

    #[test]
    fn unmeasured_stats_round_trip_as_null_and_nan() {
        let s = LatencyStats {
            p50: 1.0,
            p95: f64::NAN,
            p99: f64::NAN,
            mean: f64::NAN,
        };
        let text = serde_json::to_string(&s).unwrap();
        assert_eq!(text, r#"{"p50":1.0,"p95":null,"p99":null,"mean":null}"#);
        let back: LatencyStats = serde_json::from_str(&text).unwrap();
        assert_eq!(back.p50, 1.0);
        assert!(back.p95.is_nan() && back.p99.is_nan() && back.mean.is_nan());
    }
}
