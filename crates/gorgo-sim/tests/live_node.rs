//! The simulated node knows what the live node knows, when the live node knows it
//! (crates/gorgo-node is the reference): small constructed traces, each checking one
//! behaviour of the node's request path against what `serve.rs`, `forward.rs` and
//! `route.rs` do.

use gorgo_core::policy::PolicyKind;
use gorgo_engine::Profile;
use gorgo_sim::{simulate, Network, PolicyRun, SimConfig};
use gorgo_workload::{BlockIds, TraceRequest};

/// A trace row sent at `ts` ms by a client of `home`, its prompt `input` tokens over
/// block ids `ids` (512 tokens each), answered with `out` tokens.
fn row(ts: u64, input: u64, ids: Vec<u64>, out: u32, home: &str) -> TraceRequest {
    TraceRequest {
        timestamp_ms: ts,
        input_tokens: input,
        output_tokens: out,
        blocks: BlockIds::Int(ids),
        tokens_per_block: 512,
        user: None,
        session: None,
        home_region: Some(home.into()),
        request_id: None,
        system_prompt_hash: None,
    }
}

fn run(cfg: &SimConfig, kind: PolicyKind, t: &[TraceRequest]) -> PolicyRun {
    simulate(cfg, kind, t.iter().cloned().map(Ok), &mut |_| {}).unwrap()
}

fn profile() -> Profile {
    Profile::by_name("paper-a100-mistral7b").unwrap()
}

/// A client that does not stream gets the engine's response head with the whole
/// response, and only then does the live node's prefix index learn the prompt
/// (`serve_local` inserts on the success head): the same prompt again, decided while
/// the first still runs, finds nothing cached there; decided after the first ended,
/// it finds all of it. A streaming client's prompt is learned at once (the head comes
/// first).
#[test]
fn a_non_streamed_prompt_is_learned_with_its_response() {
    let mut cfg = SimConfig::new(Network::uniform(1, 0.0, 3.0), profile());
    cfg.decision_log = 100;
    let ids: Vec<u64> = (1..=8).collect();
    let t = vec![
        row(0, 4096, ids.clone(), 500, "r0"),
        row(2000, 4096, ids.clone(), 500, "r0"),
        row(30_000, 4096, ids.clone(), 500, "r0"),
    ];
    // The local engine's believed cached tokens at each decision.
    let believed = |r: &PolicyRun, index: u64| {
        let d = r
            .decisions
            .iter()
            .find(|d| d.record.request_id == index)
            .unwrap();
        d.record.candidates[0].cached_tokens
    };
    for (share, while_running) in [(0.0, 4096), (1.0, 0)] {
        cfg.non_streamed_share = share;
        let r = run(&cfg, PolicyKind::Gorgo, &t);
        let rows = r.rows.as_ref().unwrap();
        let first = rows.iter().find(|x| x.index == 0).unwrap();
        assert!(
            first.e2e_ms > 2_100.0 && first.e2e_ms < 30_000.0,
            "{}",
            first.e2e_ms
        );
        assert_eq!(believed(&r, 1), while_running, "share {share}");
        assert_eq!(believed(&r, 2), 4096, "share {share}");
    }
}

/// The generated multi-turn trace of `tests/conservation.rs`, on three regions of small
/// engines at four times its rate: loaded enough that targets refuse forwards.
fn loaded() -> (SimConfig, Vec<TraceRequest>) {
    let t = gorgo_workload::generate(&gorgo_workload::GeneratorConfig {
        seed: 1,
        duration_s: 120.0,
        users: 40,
        requests_per_user: 300.0,
        think_time_median_s: 5.0,
        ..gorgo_workload::GeneratorConfig::default()
    })
    .unwrap();
    let mut p = profile();
    p.max_total_tokens = 60_000;
    p.max_running_requests = 16;
    let mut network = Network::uniform(3, 40.0, 3.0);
    network.jitter_ms = 5.0;
    let mut cfg = SimConfig::new(network, p);
    cfg.time_scale = 0.25;
    cfg.seed = 7;
    cfg.decision_log = 1_000_000;
    (cfg, t)
}

/// A refused forward is served on the client's node's best local engine (as the live
/// node serves it): its row's predicted cached tokens are what that node believed that
/// engine holds, not what it believed of the peer that refused, so `sim.json`'s
/// `cache_estimate_error` pairs the engine's count with the estimate of the engine
/// that served it.
#[test]
fn a_refused_forward_predicts_the_cache_of_the_engine_that_serves_it() {
    let (cfg, t) = loaded();
    let r = run(&cfg, PolicyKind::Gorgo, &t);
    let rows = r.rows.as_ref().unwrap();
    let refused: std::collections::HashSet<u64> = r
        .decisions
        .iter()
        .filter(|d| d.record.reason == "refused")
        .map(|d| d.record.request_id)
        .collect();
    assert!(refused.len() > 3, "{} refusals", refused.len());
    let mut differ = 0;
    for d in r.decisions.iter().filter(|d| d.record.hops == 0) {
        let rec = &d.record;
        if !refused.contains(&rec.request_id) {
            continue;
        }
        let local = &rec.candidates[gorgo_core::decision::best_local(&rec.candidates).unwrap()];
        let chosen = rec.candidates.iter().find(|c| c.chosen).unwrap();
        differ += usize::from(chosen.cached_tokens != local.cached_tokens);
        let row = rows.iter().find(|x| x.index == rec.request_id).unwrap();
        assert_eq!(row.hops, 0, "r{}", rec.request_id);
        assert_eq!(
            row.predicted_cached_tokens.map(u64::from),
            Some(local.cached_tokens),
            "r{}: the refusing peer's estimate was {}",
            rec.request_id,
            chosen.cached_tokens
        );
    }
    // Refusals where the two estimates differ, which the check above tells apart.
    assert!(differ > 0);
}
