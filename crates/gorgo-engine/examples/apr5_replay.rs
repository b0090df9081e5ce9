//! Replays the GORGO paper's Apr 5 arrivals against three emulated engines on virtual
//! time and prints the comparison with the paper's real `simple-session-affinity` run.
//!
//! `cargo run -p gorgo-engine --release --example apr5_replay [-- <profile name or toml> [<csv out>]]`
//!
//! With a CSV path it also writes `input_tokens,engine,real_ttft_ms,emulated_ttft_ms` per request.

#[path = "../tests/support/apr5.rs"]
mod apr5;

use gorgo_engine::Profile;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let name = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "paper-l40s-qwen35b-a3b".to_owned());
    let profile = Profile::by_name_or_file(&name)?;
    let Some(rows) = apr5::load("simple-session-affinity") else {
        eprintln!("skipped: {} not found", apr5::trace_path().display());
        return Ok(());
    };
    let started = std::time::Instant::now();
    let out = apr5::replay(&rows, &profile);
    let elapsed = started.elapsed();
    let real_ttft: Vec<f64> = rows.iter().map(|r| r.ttft_ms).collect();
    let real_e2e: Vec<f64> = rows.iter().map(|r| r.e2e_ms).collect();
    let real_out: Vec<u32> = rows.iter().map(|r| r.output_tokens).collect();
    let emu_ttft: Vec<f64> = out.iter().map(|o| o.ttft_ms).collect();
    let emu_e2e: Vec<f64> = out.iter().map(|o| o.e2e_ms).collect();
    let emu_out: Vec<u32> = out.iter().map(|o| o.output_tokens).collect();
    let rt = apr5::p50_p95(&real_ttft);
    let et = apr5::p50_p95(&emu_ttft);
    let re = apr5::p50_p95(&real_e2e);
    let ee = apr5::p50_p95(&emu_e2e);
    let ri = apr5::p50_p95(&apr5::itl(&real_ttft, &real_e2e, &real_out));
    let ei = apr5::p50_p95(&apr5::itl(&emu_ttft, &emu_e2e, &emu_out));
    println!(
        "profile {} ; {} requests replayed in {:.3} s",
        profile.name,
        rows.len(),
        elapsed.as_secs_f64()
    );
    println!("| metric | paper (real) | emulated | ratio |");
    println!("|---|---:|---:|---:|");
    for (m, r, e) in [
        ("TTFT p50 (ms)", rt.0, et.0),
        ("TTFT p95 (ms)", rt.1, et.1),
        ("E2E p50 (ms)", re.0, ee.0),
        ("E2E p95 (ms)", re.1, ee.1),
        ("ITL p50 (ms)", ri.0, ei.0),
        ("ITL p95 (ms)", ri.1, ei.1),
    ] {
        println!("| {m} | {r:.0} | {e:.0} | {:.2} |", e / r);
    }
    if let Some(path) = std::env::args().nth(2) {
        let mut csv = String::from("input_tokens,engine,real_ttft_ms,emulated_ttft_ms\n");
        for (r, o) in rows.iter().zip(&out) {
            csv.push_str(&format!(
                "{},{},{:.3},{:.3}\n",
                r.input_tokens, o.engine, r.ttft_ms, o.ttft_ms
            ));
        }
        std::fs::write(&path, csv)?;
    }
    Ok(())
}
