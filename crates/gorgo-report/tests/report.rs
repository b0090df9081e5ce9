//! Aggregation on hand-built records and the files a report writes.

use gorgo_report::{render_table, PolicyResult, Report, RequestRecord, Results};

fn rec(policy: &str, id: usize, region: &str, served: &str, ttft: f64, e2e: f64) -> RequestRecord {
    RequestRecord {
        policy: policy.into(),
        request_id: format!("r{id}"),
        region: region.into(),
        served_by: Some(served.into()),
        hops: u32::from(region != served),
        ttft_ms: ttft,
        e2e_ms: e2e,
        itl_ms: None,
        input_tokens: 1000,
        output_tokens: 11,
        cached_tokens: Some(512),
        predicted_ttft_ms: None,
        cached_anywhere_tokens: None,
        start_ms: id as f64 * 100.0,
        first_byte_ms: Some(ttft / 2.0),
        retries: 0,
        ok: true,
        error: None,
    }
}

/// Ten `gorgo` requests with TTFT 100..=1000 ms, one failure; three `local-only` ones.
fn records() -> Vec<RequestRecord> {
    let mut v: Vec<_> = (0..10)
        .map(|i| {
            let served = if i < 7 { "us" } else { "eu" };
            rec(
                "gorgo",
                i,
                "us",
                served,
                100.0 * (i + 1) as f64,
                100.0 * (i + 1) as f64 + 1000.0,
            )
        })
        .collect();
    v.push(RequestRecord {
        ok: false,
        served_by: None,
        error: Some("peer gone".into()),
        ttft_ms: f64::NAN,
        e2e_ms: f64::NAN,
        ..rec("gorgo", 10, "us", "us", 0.0, 0.0)
    });
    for i in 0..3 {
        v.push(rec("local-only", i, "eu", "eu", 50.0, 550.0));
    }
    v
}

#[test]
fn aggregation_follows_the_results_schema() {
    let report = Report::from_records(&serde_json::json!({"trace": "t"}), records()).unwrap();
    let names: Vec<_> = report
        .results
        .policies
        .iter()
        .map(|(p, _)| p.as_str())
        .collect();
    assert_eq!(names, ["gorgo", "local-only"]);
    let g = report.results.policy("gorgo").unwrap();
    assert_eq!((g.requests, g.failed), (11, 1));
    // Nearest rank over 100, 200, ..., 1000.
    assert_eq!(
        (g.ttft_ms.p50, g.ttft_ms.p95, g.ttft_ms.p99),
        (500.0, 1000.0, 1000.0)
    );
    assert!((g.ttft_ms.mean - 550.0).abs() < 1e-9);
    assert_eq!(g.e2e_ms.p50, 1500.0);
    // ITL = (E2E - TTFT) / (11 - 1) = 100 ms for every request.
    assert_eq!(g.itl_ms.p50, 100.0);
    assert!((g.region_share["us"] - 0.7).abs() < 1e-9);
    assert!((g.region_share["eu"] - 0.3).abs() < 1e-9);
    assert!((g.forwarded_share - 0.3).abs() < 1e-9);
    // First send at 0 ms; last completion: request 9 at 900 + 2000 ms.
    assert!((g.duration_s - 2.9).abs() < 1e-9);
    assert!((g.throughput_rps - 10.0 / 2.9).abs() < 1e-9);
    let l = report.results.policy("local-only").unwrap();
    assert_eq!(l.forwarded_share, 0.0);
    assert_eq!(l.region_share.len(), 1);

    let json = serde_json::to_value(&report.results).unwrap();
    let p = &json["policies"]["gorgo"];
    for key in [
        "requests",
        "failed",
        "duration_s",
        "throughput_rps",
        "forwarded_share",
    ] {
        assert!(p[key].is_number(), "{key}");
    }
    for key in ["ttft_ms", "e2e_ms", "itl_ms"] {
        for stat in ["p50", "p95", "p99", "mean"] {
            assert!(p[key][stat].is_number(), "{key}.{stat}");
        }
    }
    assert_eq!(json["config"]["trace"], "t");
    let back: Results = serde_json::from_value(json).unwrap();
    assert_eq!(back, report.results);
}

#[test]
fn cache_hits_and_prediction_error_are_aggregated() {
    let mut v = records();
    // Served in eu: half their prompt cached; `local-only` made no estimates.
    for r in v
        .iter_mut()
        .filter(|r| r.served_by.as_deref() == Some("eu"))
    {
        r.cached_tokens = Some(500);
    }
    // gorgo's estimates: 10% high on every completed request except one 50% low, so
    // the ranks still agree except where that one lands.
    for r in v.iter_mut().filter(|r| r.policy == "gorgo" && r.ok) {
        r.predicted_ttft_ms = Some(r.ttft_ms * 1.1);
    }
    v[0].predicted_ttft_ms = Some(v[0].ttft_ms * 0.5);
    let report = Report::from_records(&(), v).unwrap();
    let g = report.results.policy("gorgo").unwrap();
    // 7 in us at 512/1000, 3 in eu at 500/1000; the failed request does not count.
    assert!((g.cache_hit_ratio.unwrap() - (7.0 * 512.0 + 3.0 * 500.0) / 10_000.0).abs() < 1e-12);
    assert_eq!(g.cache_hit_ratio_by_region["us"], 0.512);
    assert_eq!(g.cache_hit_ratio_by_region["eu"], 0.5);
    let p = g.prediction.unwrap();
    assert_eq!(p.n, 10);
    assert!((p.mape_median - 10.0).abs() < 1e-9, "{p:?}");
    // Request 0 (smallest TTFT) stays the smallest estimate: ranks agree exactly.
    assert!((p.spearman.unwrap() - 1.0).abs() < 1e-12);
    let l = report.results.policy("local-only").unwrap();
    assert_eq!(l.prediction, None);
    assert_eq!(l.cache_hit_ratio, Some(0.5));
    // The new fields are in results.json and read back.
    let json = serde_json::to_value(&report.results).unwrap();
    assert_eq!(json["policies"]["gorgo"]["prediction"]["n"], 10);
    assert_eq!(
        json["policies"]["local-only"]["prediction"],
        serde_json::Value::Null
    );
    assert_eq!(
        json["policies"]["gorgo"]["cache_hit_ratio_by_region"]["eu"],
        0.5
    );
    let back: Results = serde_json::from_value(json).unwrap();
    assert_eq!(back, report.results);
}

/// vLLM (`--enable-prompt-tokens-details`) sends `cached_tokens` only when it is not
/// 0: in a region whose engine reported it for some request, a completed request
/// without it is a miss. An engine that never reports it (llama.cpp) leaves its region
/// out of the ratio.
#[test]
fn a_region_that_reports_cached_tokens_counts_their_omission_as_a_miss() {
    let mut v: Vec<_> = (0..4)
        .map(|i| rec("gorgo", i, "us", "us", 100.0, 1100.0))
        .collect();
    v[0].cached_tokens = Some(800);
    for r in &mut v[1..] {
        r.cached_tokens = None;
    }
    let mut llama = rec("gorgo", 9, "eu", "eu", 100.0, 1100.0);
    llama.cached_tokens = None;
    v.push(llama);
    let report = Report::from_records(&(), v).unwrap();
    let g = report.results.policy("gorgo").unwrap();
    assert_eq!(g.cache_hit_ratio, Some(0.2));
    assert_eq!(g.cache_hit_ratio_by_region["us"], 0.2);
    assert!(!g.cache_hit_ratio_by_region.contains_key("eu"));
}

/// A stream cut after its first token measured its TTFT: the cost model's estimate is
/// compared with it, as the live report's TTFT percentiles count it.
#[test]
fn the_prediction_error_counts_a_request_cut_after_its_first_token() {
    let mut v: Vec<_> = (0..3)
        .map(|i| rec("gorgo", i, "us", "us", 100.0, 1100.0))
        .collect();
    for r in &mut v {
        r.predicted_ttft_ms = Some(110.0);
    }
    v[2].ok = false;
    v[2].ttft_ms = 1000.0;
    v.push(RequestRecord {
        ok: false,
        ttft_ms: f64::NAN,
        predicted_ttft_ms: Some(110.0),
        ..rec("gorgo", 3, "us", "us", 0.0, 0.0)
    });
    let report = Report::from_records(&(), v).unwrap();
    let p = report.results.policy("gorgo").unwrap().prediction.unwrap();
    assert_eq!(p.n, 3);
}

#[test]
fn empty_and_all_failed_policies_still_aggregate() {
    let failed = RequestRecord {
        ok: false,
        served_by: None,
        ..rec("x", 0, "us", "us", 1.0, 2.0)
    };
    let r = PolicyResult::from_records([&failed]);
    assert_eq!((r.requests, r.failed, r.throughput_rps), (1, 1, 0.0));
    // Nothing measured is NaN (`null` in JSON), never 0 ms, which would rank best.
    assert!(r.ttft_ms.p95.is_nan() && r.e2e_ms.p50.is_nan());
    let report = Report::from_records(&(), Vec::new()).unwrap();
    assert!(report.results.policies.is_empty());
    let dir = tempfile::tempdir().unwrap();
    report.write(dir.path()).unwrap();
}

#[test]
fn report_files_are_written() {
    #[derive(serde::Serialize)]
    struct Epoch {
        epoch: u64,
        accepted: bool,
    }
    let report = Report::from_records(&serde_json::json!({"n": 1}), records())
        .unwrap()
        .with_tuning(&[
            Epoch {
                epoch: 1,
                accepted: true,
            },
            Epoch {
                epoch: 2,
                accepted: false,
            },
        ])
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    report.write(&out).unwrap();

    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(results["policies"]["gorgo"]["requests"], 11);

    let table = std::fs::read_to_string(out.join("table.md")).unwrap();
    assert!(table.starts_with("| policy |"), "{table}");
    let (main, hits) = table.split_once("\n\n").unwrap();
    assert_eq!(main.lines().count(), 4);
    assert!(table.contains("| gorgo | 11 | 1 |"), "{table}");
    assert!(
        hits.contains("| policy | cache hit eu | cache hit us |"),
        "{table}"
    );
    assert!(hits.contains("| local-only | 51.2% | - |"), "{table}");

    let csv = std::fs::read_to_string(out.join("requests.csv")).unwrap();
    let mut lines = csv.lines();
    assert!(lines
        .next()
        .unwrap()
        .starts_with("policy,request_id,region,served_by,hops,ttft_ms"));
    assert_eq!(lines.count(), 14);
    assert!(csv.contains("peer gone"));

    let tuning = std::fs::read_to_string(out.join("tuning.jsonl")).unwrap();
    assert_eq!(tuning.lines().count(), 2);
    assert!(tuning.starts_with(r#"{"epoch":1,"accepted":true}"#));

    for svg in ["ttft_cdf.svg", "region_share.svg"] {
        let text = std::fs::read_to_string(out.join(svg)).unwrap();
        assert!(
            text.trim_start().starts_with("<svg"),
            "{svg}: {}",
            &text[..text.len().min(80)]
        );
        assert!(text.trim_end().ends_with("</svg>"), "{svg}");
        assert!(text.contains("gorgo"), "{svg} lacks the policy label");
    }

    let console = render_table(&report);
    // Main table (header + 2 policies), a blank line, the per-region cache hits.
    assert_eq!(console.lines().count(), 7);
    assert!(console.lines().nth(1).unwrap().starts_with("gorgo "));
}

#[test]
fn no_tuning_records_no_tuning_file() {
    let report = Report::from_records(&(), records()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    report.write(dir.path()).unwrap();
    assert!(!dir.path().join("tuning.jsonl").exists());
}

/// Two decided trials of a tuning run, as `tuning.jsonl` has them (enough to draw
/// `tuning.svg`).
fn trials() -> Vec<serde_json::Value> {
    (1..=2)
        .map(|epoch| {
            serde_json::json!({
                "policy": "gorgo", "epoch": epoch,
                "candidate": {"w_rtt": 1.2, "w_queue": 0.8},
                "incumbent": {"w_rtt": 1.0, "w_queue": 1.0},
                "score_p95_ttft_ms": 900.0, "incumbent_p95_ttft_ms": 1000.0,
                "accepted": epoch == 1,
            })
        })
        .collect()
}

/// A rerun without tuning into the directory of a tuned run: the old run's
/// `tuning.jsonl` and `tuning.svg` would sit beside the new `results.json` as if they
/// were its own.
#[test]
fn a_rerun_without_tuning_removes_the_old_tuning_files() {
    let dir = tempfile::tempdir().unwrap();
    let tuned = Report::from_records(&(), records())
        .unwrap()
        .with_tuning(&trials())
        .unwrap();
    tuned.write(dir.path()).unwrap();
    assert!(dir.path().join("tuning.jsonl").exists());
    assert!(dir.path().join("tuning.svg").exists());
    Report::from_records(&(), records())
        .unwrap()
        .write(dir.path())
        .unwrap();
    assert!(!dir.path().join("tuning.jsonl").exists());
    assert!(!dir.path().join("tuning.svg").exists());
}

/// A file that cannot be replaced (a directory in its place) fails the write, and the
/// previous `results.json` stays whole and unchanged; no temporary file is left.
#[test]
fn a_failed_write_keeps_the_previous_results() {
    let dir = tempfile::tempdir().unwrap();
    Report::from_records(&serde_json::json!({"run": 1}), records())
        .unwrap()
        .write(dir.path())
        .unwrap();
    let before = std::fs::read(dir.path().join("results.json")).unwrap();
    std::fs::remove_file(dir.path().join("ttft_cdf.svg")).unwrap();
    std::fs::create_dir(dir.path().join("ttft_cdf.svg")).unwrap();
    let second = Report::from_records(&serde_json::json!({"run": 2}), records()).unwrap();
    assert!(second.write(dir.path()).is_err());
    assert_eq!(
        std::fs::read(dir.path().join("results.json")).unwrap(),
        before
    );
    let temporaries: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(temporaries.is_empty(), "{temporaries:?}");
}

/// A run that kept no rows still writes `requests.csv` with its header, so a reader
/// finds the columns rather than an empty file.
#[test]
fn an_empty_report_writes_the_csv_header() {
    let dir = tempfile::tempdir().unwrap();
    Report::from_records(&(), Vec::new())
        .unwrap()
        .write(dir.path())
        .unwrap();
    let csv = std::fs::read_to_string(dir.path().join("requests.csv")).unwrap();
    assert!(csv.starts_with("policy,request_id,"), "{csv:?}");
    assert_eq!(csv.lines().count(), 1);
    // The same header as a report with rows.
    let full = Report::from_records(&(), records()).unwrap();
    full.write(dir.path()).unwrap();
    let with_rows = std::fs::read_to_string(dir.path().join("requests.csv")).unwrap();
    assert_eq!(with_rows.lines().next(), csv.lines().next());
}
