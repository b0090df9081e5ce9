//! Reading every trace format, the generator against ART-Chat-2.5M's published window
//! statistics, and `trace stats` figures on the real Mooncake trace.

use std::io::Cursor;
use std::path::PathBuf;

use gorgo_workload::{
    generate, open_trace, write_jsonl, BlockIds, GeneratorConfig, TraceFormat, TraceReader,
    TraceRequest, TraceStats, WorkloadError,
};

fn shared_trace(name: &str) -> Option<PathBuf> {
    let p = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/data/traces/"
    ))
    .join(name);
    if p.exists() {
        Some(p)
    } else {
        eprintln!("skipping: {} is missing", p.display());
        None
    }
}

fn read_all(text: &str, format: TraceFormat) -> Result<Vec<TraceRequest>, WorkloadError> {
    TraceReader::new(Cursor::new(text.as_bytes()), format).collect()
}

#[test]
fn mooncake_conversation_trace_matches_its_published_figures() {
    let Some(path) = shared_trace("mooncake_conversation_trace.jsonl") else {
        return;
    };
    let reader = open_trace(&path).unwrap();
    assert_eq!(reader.format(), TraceFormat::Mooncake);
    let mut acc = gorgo_workload::StatsAccumulator::new();
    for r in reader {
        acc.push(&r.unwrap());
    }
    let s = acc.finish();
    assert_eq!(s.requests, 12_031);
    assert!(
        (s.input_tokens.mean - 12_035.0).abs() < 1.0,
        "{}",
        s.input_tokens.mean
    );
    let reuse = s.block_reuse.unwrap();
    assert!((reuse - 0.366).abs() < 0.001, "{reuse}");
    assert_eq!(s.users, None);
    assert_eq!(s.multi_turn_share, None);
    let json = serde_json::to_value(&s).unwrap();
    assert!(json["intra_user_reuse"].is_null());
    assert!(json["input_tokens"]["p95"].is_number());
}

#[test]
fn azure_csv_reads_with_rebased_timestamps() {
    let Some(path) = shared_trace("AzureLLMInferenceTrace_conv_2023.csv") else {
        return;
    };
    let reqs: Vec<_> = open_trace(&path)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(reqs.len(), 19_366);
    assert_eq!(reqs[0].timestamp_ms, 0);
    assert_eq!((reqs[0].input_tokens, reqs[0].output_tokens), (374, 44));
    assert_eq!(reqs[1].timestamp_ms, 4315);
    assert_eq!(reqs[0].blocks, BlockIds::None);
    let s = TraceStats::from_requests(&reqs);
    assert!(s.span_s > 3000.0 && s.span_s < 3600.0, "{}", s.span_s);
    assert_eq!(s.block_reuse, None);
}

#[test]
fn art_chat_rows_read_with_hex_ids_users_and_rebasing() {
    let fixture = concat!(
        r#"{"timestamp": 1800000, "input_length": 600, "output_length": 128, "hash_ids": ["0a1b2c3d4e5f60718293a4b5", "c0ffee00c0ffee00c0ffee00", "111111111111111111111111"], "request": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 128}, "request_id": "abc", "token_hash": "user-1", "system_prompt_hash": "sp1"}"#,
        "\n\n",
        r#"{"timestamp": 1802500, "input_length": 700, "hash_ids": ["0a1b2c3d4e5f60718293a4b5", "c0ffee00c0ffee00c0ffee00", "222222222222222222222222"], "request": {"max_tokens": 64}, "request_id": "abd", "token_hash": "user-1", "system_prompt_hash": "sp1"}"#,
        "\n"
    );
    let format = gorgo_workload::detect_format(None, fixture.as_bytes()).unwrap();
    assert_eq!(format, TraceFormat::ArtChat);
    let reqs = read_all(fixture, format).unwrap();
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[0].timestamp_ms, 0);
    assert_eq!(reqs[1].timestamp_ms, 2500);
    assert_eq!(reqs[1].output_tokens, 64);
    assert_eq!(reqs[0].tokens_per_block, 256);
    assert_eq!(reqs[0].user.as_deref(), Some("user-1"));
    assert_eq!(reqs[0].request_id.as_deref(), Some("abc"));
    assert_eq!(reqs[0].system_prompt_hash.as_deref(), Some("sp1"));
    let (a, b) = (reqs[0].chain(), reqs[1].chain());
    assert_eq!(a.block_tokens, vec![256, 256, 88]);
    assert_eq!(a.hashes[..2], b.hashes[..2]);
    assert_ne!(a.hashes[2], b.hashes[2]);
    let s = TraceStats::from_requests(&reqs);
    assert_eq!(s.users, Some(1));
    assert!((s.block_reuse.unwrap() - 2.0 / 6.0).abs() < 1e-9);
    assert_eq!(s.block_reuse, s.intra_user_reuse);
    // Second request extends the first one's second-to-last block: one conversation.
    assert_eq!(s.multi_turn_share, Some(1.0));
}

#[test]
fn malformed_lines_name_their_line_number() {
    let text = concat!(
        r#"{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}"#,
        "\n",
        r#"{"timestamp": 1, "input_length": "ten", "output_length": 1, "hash_ids": [0]}"#,
        "\n",
        "not json\n",
    );
    let results: Vec<_> = TraceReader::new(Cursor::new(text), TraceFormat::Mooncake).collect();
    assert!(results[0].is_ok());
    let e1 = results[1].as_ref().unwrap_err().to_string();
    let e2 = results[2].as_ref().unwrap_err().to_string();
    assert!(e1.starts_with("line 2:"), "{e1}");
    assert!(e2.starts_with("line 3:"), "{e2}");

    let csv = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:47,x,1\n";
    let results: Vec<_> = TraceReader::new(Cursor::new(csv), TraceFormat::Azure).collect();
    let e = results[1].as_ref().unwrap_err().to_string();
    assert!(
        e.starts_with("line 3:") && e.contains("ContextTokens"),
        "{e}"
    );
    let bad_header = read_all("when,ctx\n1,2\n", TraceFormat::Azure)
        .unwrap_err()
        .to_string();
    assert!(
        bad_header.contains("line 1") && bad_header.contains("TIMESTAMP"),
        "{bad_header}"
    );
}

#[test]
fn generated_trace_round_trips_through_jsonl() {
    let cfg = GeneratorConfig {
        users: 30,
        duration_s: 600.0,
        seed: 7,
        ..Default::default()
    };
    let reqs = generate(&cfg).unwrap();
    assert!(!reqs.is_empty());
    let mut buf = Vec::new();
    write_jsonl(&mut buf, &reqs).unwrap();
    let format = gorgo_workload::detect_format(None, &buf).unwrap();
    assert_eq!(format, TraceFormat::Gorgo);
    let back = read_all(std::str::from_utf8(&buf).unwrap(), format).unwrap();
    assert_eq!(back, reqs);
    assert!(back
        .windows(2)
        .all(|w| w[0].timestamp_ms <= w[1].timestamp_ms));
    assert!(back
        .iter()
        .all(|r| cfg.regions.contains(r.home_region.as_ref().unwrap())));
}

/// ART-Chat-2.5M's published per-30-minute-window figures (data README).
struct ArtTarget {
    median_input: f64,
    p95_input: f64,
    requests_per_user: f64,
    multi_turn_share: f64,
    intra_user_reuse: f64,
}

const ART: ArtTarget = ArtTarget {
    median_input: 5_700.0,
    p95_input: 20_000.0,
    requests_per_user: 14.6,
    multi_turn_share: 0.74,
    intra_user_reuse: 0.827,
};

#[test]
fn default_generated_window_matches_art_chat_statistics() {
    let reqs = generate(&GeneratorConfig::default()).unwrap();
    let s = TraceStats::from_requests(&reqs);
    eprintln!("{}", s.render());
    let within = |name: &str, got: f64, want: f64| {
        assert!(
            (got - want).abs() <= 0.10 * want,
            "{name}: generated {got}, target {want}"
        );
    };
    within("median input", s.input_tokens.p50, ART.median_input);
    within("p95 input", s.input_tokens.p95, ART.p95_input);
    within(
        "requests per user",
        s.requests_per_user.unwrap(),
        ART.requests_per_user,
    );
    within(
        "multi-turn share",
        s.multi_turn_share.unwrap(),
        ART.multi_turn_share,
    );
    within(
        "intra-user reuse",
        s.intra_user_reuse.unwrap(),
        ART.intra_user_reuse,
    );
    // The published ranges themselves, for the figures with a range.
    assert!((7_200..=8_700).contains(&s.requests), "{}", s.requests);
    assert!((540..=606).contains(&s.users.unwrap()));
    let cross = s.block_reuse.unwrap() - s.intra_user_reuse.unwrap();
    assert!(cross < 0.01, "cross-user reuse {cross}");
}
