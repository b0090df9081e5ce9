//! Latency sketches on the GORGO paper's real per-request TTFT and E2E results: every
//! quantile within 1% of the exact nearest-rank value, per policy and merged, and the
//! sketch survives the wire.

use std::collections::BTreeMap;
use std::path::PathBuf;

use gorgo_core::wire::{decode, encode, MAX_TUNING_MESSAGE};
use gorgo_core::{percentile, summarize, LatencySketch};

#[derive(serde::Deserialize)]
struct Row {
    policy: String,
    ttft_ms: Option<f64>,
    e2e_ms: Option<f64>,
}

fn rows() -> Option<Vec<Row>> {
    let path = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/data/reference/paper_apr5_requests.jsonl"
    ));
    let Ok(text) = std::fs::read_to_string(&path) else {
        eprintln!("skipping: {} not found", path.display());
        return None;
    };
    Some(
        text.lines()
            .map(|l| serde_json::from_str(l).expect("paper row"))
            .collect(),
    )
}

fn assert_close(sketch: &LatencySketch, sorted: &[f64], what: &str) {
    for p in [0.0, 1.0, 25.0, 50.0, 90.0, 95.0, 99.0, 99.9, 100.0] {
        let exact = percentile(sorted, p).unwrap();
        let approx = sketch.quantile(p / 100.0).unwrap();
        let rel = (approx - exact).abs() / exact.abs().max(1e-9);
        assert!(
            rel <= 0.01 + 1e-9,
            "{what} p{p}: exact {exact} sketch {approx}"
        );
    }
}

#[test]
fn paper_latencies_within_one_percent_and_mergeable() {
    let Some(rows) = rows() else { return };
    let mut per_policy: BTreeMap<&str, (LatencySketch, Vec<f64>)> = BTreeMap::new();
    let mut all_e2e = (LatencySketch::new(), Vec::new());
    for r in &rows {
        if let Some(t) = r.ttft_ms {
            let e = per_policy.entry(&r.policy).or_default();
            e.0.add(t);
            e.1.push(t);
        }
        if let Some(e) = r.e2e_ms {
            all_e2e.0.add(e);
            all_e2e.1.push(e);
        }
    }
    assert!(per_policy.len() >= 2);
    let mut merged = LatencySketch::new();
    let mut union = Vec::new();
    for (policy, (sketch, values)) in &mut per_policy {
        values.sort_by(f64::total_cmp);
        assert_close(sketch, values, policy);
        // Across the wire and back, unchanged.
        let bytes = encode(&*sketch);
        assert!(bytes.len() < MAX_TUNING_MESSAGE);
        let back: LatencySketch = decode(&bytes, MAX_TUNING_MESSAGE).unwrap();
        assert_eq!(&back, &*sketch);
        merged.merge(&back);
        union.extend_from_slice(values);
        let stats = summarize(&mut values.clone());
        eprintln!(
            "{policy}: n={} ttft p50 {:.0} p95 {:.0} p99 {:.0} mean {:.0} ms; sketch {} B on the wire",
            values.len(),
            stats.p50,
            stats.p95,
            stats.p99,
            stats.mean,
            bytes.len()
        );
    }
    union.sort_by(f64::total_cmp);
    assert_eq!(merged.count(), union.len() as u64);
    assert_close(&merged, &union, "merged");
    all_e2e.1.sort_by(f64::total_cmp);
    assert_close(&all_e2e.0, &all_e2e.1, "e2e");
}
