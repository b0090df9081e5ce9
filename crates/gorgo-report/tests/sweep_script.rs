//! `scripts/sweep_ratios.py` reads what `Sweep::write` writes: censored (+inf) and
//! unmeasured (NaN) p95s, both `null` in JSON, without crashing, telling them apart.

use gorgo_report::{LatencyStats, PolicyResult, Slo, Sweep, SweepPoint};

fn result(ttft_p95: f64, e2e_p95: f64) -> PolicyResult {
    let mut r = PolicyResult::from_records(std::iter::empty());
    let stats = |p95: f64| LatencyStats {
        p50: 100.0,
        p95,
        p99: p95,
        mean: 100.0,
    };
    r.requests = 100;
    r.ttft_ms = stats(ttft_p95);
    r.e2e_ms = stats(e2e_p95);
    r
}

#[test]
fn the_ratio_script_reads_censored_and_unmeasured_points() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/sweep_ratios.py");
    let point = |load: f64, policies: Vec<(&str, PolicyResult)>| SweepPoint {
        time_scale: 1.0 / load,
        offered_rps: load,
        policies: policies
            .into_iter()
            .map(|(p, r)| (p.to_owned(), r))
            .collect(),
    };
    let sweep = Sweep::new(
        serde_json::json!({}),
        1.0,
        Slo {
            ttft_p95_ms: 2000.0,
            e2e_p95_ms: None,
        },
        vec![
            point(
                1.0,
                vec![
                    ("gorgo", result(500.0, 5000.0)),
                    ("least-load", result(600.0, 5000.0)),
                ],
            ),
            // gorgo's p95 TTFT censored (a live run with too many failures).
            point(
                2.0,
                vec![
                    ("gorgo", result(f64::INFINITY, 9000.0)),
                    ("least-load", result(900.0, 6000.0)),
                ],
            ),
            // Nothing of gorgo measured; the baseline's E2E censored.
            point(
                4.0,
                vec![
                    ("gorgo", PolicyResult::from_records(std::iter::empty())),
                    ("least-load", result(1500.0, f64::INFINITY)),
                ],
            ),
        ],
    );
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sw");
    sweep.write(&out).unwrap();
    let run = match std::process::Command::new("python3")
        .arg(script)
        .arg(out.join("sweep.json"))
        .output()
    {
        Ok(run) => run,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!("python3 not found: skipped");
            return;
        }
        Err(e) => panic!("python3: {e}"),
    };
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stdout}\n{stderr}");
    let rows: Vec<&str> = stdout.lines().filter(|l| l.starts_with("| sw |")).collect();
    assert_eq!(rows.len(), 3, "{stdout}");
    // By decreasing time scale: 1, 2, 4 req/s.
    assert!(rows[0].contains("| 500 | 0.833 (least-load) |"), "{stdout}");
    assert!(
        rows[1].contains("| censored | censored (least-load) |"),
        "{stdout}"
    );
    assert!(rows[2].contains("| - | - (least-load) |"), "{stdout}");
    // Only the first point has both ratios; gorgo's censored TTFT misses the 0.85x bar.
    assert!(
        stdout.contains("(over 1 with both ratios measured)"),
        "{stdout}"
    );
    assert!(stdout.contains("TTFT above 0.85x at 1"), "{stdout}");
}
