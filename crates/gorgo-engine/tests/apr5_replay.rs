//! The paper's Apr 5 arrivals on three `paper-l40s-qwen35b-a3b` engines (virtual
//! time): emulated TTFT p50/p95 within a factor 1.5 of the real
//! `simple-session-affinity` run (712 ms, 2,428 ms). Rules in `support/apr5.rs`.

mod support {
    pub mod apr5;
}
use support::apr5;

use gorgo_engine::Profile;

#[test]
fn apr5_ttft_matches_the_papers_session_affinity_run() {
    let Some(rows) = apr5::load("simple-session-affinity") else {
        eprintln!("skipped: {} not found", apr5::trace_path().display());
        return;
    };
    assert_eq!(rows.len(), 7195);
    let profile = Profile::by_name("paper-l40s-qwen35b-a3b").unwrap();
    let out = apr5::replay(&rows, &profile);
    assert!(out
        .iter()
        .all(|o| o.ttft_ms.is_finite() && o.e2e_ms >= o.ttft_ms));
    let real: Vec<f64> = rows.iter().map(|r| r.ttft_ms).collect();
    let emu: Vec<f64> = out.iter().map(|o| o.ttft_ms).collect();
    let (real50, real95) = apr5::p50_p95(&real);
    let (emu50, emu95) = apr5::p50_p95(&emu);
    assert!((real50 - 711.871).abs() < 0.01 && (real95 - 2427.785).abs() < 0.01);
    for (what, r, e) in [("p50", real50, emu50), ("p95", real95, emu95)] {
        let ratio = e / r;
        assert!(
            (1.0 / 1.5..=1.5).contains(&ratio),
            "TTFT {what}: emulated {e:.0} ms vs real {r:.0} ms (ratio {ratio:.2})"
        );
    }
}
