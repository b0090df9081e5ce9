//! The paper's Apr 5 arrivals on three `paper-l40s-qwen35b-a3b` engines (virtual
//! time): emulated TTFT p50/p95 within a factor 1.5 of the real
//! `simple-session-affinity` run (712 ms, 2,428 ms) and ITL p50 within 25% of the real
//! one (20.2 ms). Rules in `support/apr5.rs`.

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
    // ITL = (E2E - TTFT) / (output - 1), the decode speed under the run's own load.
    let real_out: Vec<u32> = rows.iter().map(|r| r.output_tokens).collect();
    let real_e2e: Vec<f64> = rows.iter().map(|r| r.e2e_ms).collect();
    let emu_out: Vec<u32> = out.iter().map(|o| o.output_tokens).collect();
    let emu_e2e: Vec<f64> = out.iter().map(|o| o.e2e_ms).collect();
    let (real_itl50, _) = apr5::p50_p95(&apr5::itl(&real, &real_e2e, &real_out));
    let (emu_itl50, _) = apr5::p50_p95(&apr5::itl(&emu, &emu_e2e, &emu_out));
    assert!((real_itl50 - 20.2).abs() < 0.1, "real ITL p50 {real_itl50}");
    let ratio = emu_itl50 / real_itl50;
    assert!(
        (0.75..=1.25).contains(&ratio),
        "ITL p50: emulated {emu_itl50:.1} ms vs real {real_itl50:.1} ms (ratio {ratio:.2})"
    );
}
