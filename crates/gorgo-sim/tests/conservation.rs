//! Replays small generated traces and checks conservation: every request is served
//! exactly once, hops never exceed `max_hops`, and no engine's KV occupancy or prefix
//! cache ever exceeds its capacity. Also checks determinism, the oracle mode, tuning
//! and the report.

use std::collections::HashSet;

use gorgo_core::policy::PolicyKind;
use gorgo_engine::Profile;
use gorgo_sim::{report::build_report, simulate, Network, PolicyRun, SimConfig};
use gorgo_workload::{generate, GeneratorConfig, TraceRequest};

fn trace(seed: u64, duration_s: f64, users: u32) -> Vec<TraceRequest> {
    let cfg = GeneratorConfig {
        seed,
        duration_s,
        users,
        requests_per_user: 300.0,
        think_time_median_s: 5.0,
        ..GeneratorConfig::default()
    };
    generate(&cfg).expect("generator config is valid")
}

/// A small engine so that eviction and queueing both happen in a short trace.
fn small_profile() -> Profile {
    let mut p = Profile::by_name("paper-a100-mistral7b").unwrap();
    p.max_total_tokens = 60_000;
    p.max_running_requests = 16;
    p
}

fn config() -> SimConfig {
    let mut network = Network::uniform(3, 40.0, 3.0);
    network.jitter_ms = 5.0;
    let mut cfg = SimConfig::new(network, small_profile());
    cfg.time_scale = 0.5;
    cfg.seed = 7;
    cfg
}

fn run(cfg: &SimConfig, kind: PolicyKind, t: &[TraceRequest]) -> PolicyRun {
    simulate(cfg, kind, t.iter().cloned().map(Ok), &mut |_| {}).unwrap()
}

fn check_conservation(cfg: &SimConfig, run: &PolicyRun, n: usize) {
    let c = &run.counters;
    let p = &run.policy;
    assert_eq!(c.requests, n as u64, "{p}: every row read");
    assert_eq!(
        c.completed + c.failed,
        n as u64,
        "{p}: every request finished"
    );
    assert_eq!(c.unexpected_events, 0, "{p}");
    for v in &c.view_counters_end {
        assert_eq!(
            v.inflight + v.unfinished_prefill_tokens + v.queued_prompt_tokens,
            0,
            "{p}: a node's view drifted"
        );
    }
    // Served exactly once: one first token and one finish per completed request.
    assert_eq!(c.first_tokens, c.completed, "{p}");
    assert_eq!(c.finishes, c.completed, "{p}");
    assert_eq!(c.served_by_region.iter().sum::<u64>(), c.completed, "{p}");
    assert!(
        c.max_hops_seen <= cfg.max_hops,
        "{p}: hops {}",
        c.max_hops_seen
    );
    for r in 0..c.capacity_tokens.len() {
        assert!(
            c.max_used_tokens[r] <= c.capacity_tokens[r],
            "{p}: region {r} used {} of {}",
            c.max_used_tokens[r],
            c.capacity_tokens[r]
        );
        assert!(c.max_cached_tokens[r] <= c.capacity_tokens[r], "{p}");
    }
    let rows = run.rows.as_ref().expect("rows kept");
    assert_eq!(rows.len(), n, "{p}");
    let ids: HashSet<u64> = rows.iter().map(|r| r.index).collect();
    assert_eq!(ids.len(), n, "{p}: each request recorded once");
    for r in rows {
        assert!(r.hops <= cfg.max_hops, "{p}");
        if r.ok {
            assert!(r.served.is_some());
            if r.hops == 0 {
                assert_eq!(
                    r.served,
                    Some(r.home),
                    "{p}: unforwarded means served at home"
                );
            } else if cfg.max_hops == 1 {
                assert_ne!(r.served, Some(r.home), "{p}: one forward leaves home");
            }
            assert!(r.ttft_ms > 0.0 && r.e2e_ms >= r.ttft_ms, "{p}: {r:?}");
        }
    }
}

#[test]
fn every_policy_conserves_requests() {
    let t = trace(1, 120.0, 40);
    assert!(t.len() > 200, "trace too small: {}", t.len());
    let cfg = config();
    // Only prompts longer than the context fail, whatever the policy.
    let too_long = t
        .iter()
        .filter(|r| r.input_tokens + r.output_tokens as u64 > cfg.profiles[0].context_length)
        .count() as u64;
    let context = cfg.profiles[0].context_length;
    let over_context = t.iter().filter(|r| r.input_tokens > context).count();
    assert!(over_context > 0, "the trace has prompts over the context");
    for kind in PolicyKind::ALL {
        let r = run(&cfg, kind, &t);
        check_conservation(&cfg, &r, t.len());
        assert_eq!(r.counters.failed, too_long, "{kind}");
        // A prompt over the context is refused at its node's door, as the live node's
        // `check_context` does: never forwarded (it was routed, and could cost a WAN
        // hop before the engine refused it).
        for row in r.rows.as_ref().unwrap() {
            if u64::from(row.input_tokens) > context {
                assert_eq!((row.ok, row.hops), (false, 0), "{kind}: {row:?}");
            }
        }
    }
}

/// Clients that do not stream: their nodes see the first token only with the whole
/// response; every request is still served once, and no view drifts (the view takes
/// their prefill as done at its expected end, `EngineView::dispatch_unobserved`).
#[test]
fn clients_that_do_not_stream_are_conserved() {
    let t = trace(1, 120.0, 40);
    let mut cfg = config();
    cfg.time_scale = 0.5;
    for share in [0.5, 1.0] {
        cfg.non_streamed_share = share;
        for kind in [PolicyKind::Gorgo, PolicyKind::LeastLoad, PolicyKind::Oracle] {
            let r = run(&cfg, kind, &t);
            check_conservation(&cfg, &r, t.len());
        }
    }
}

#[test]
fn refused_forwards_are_served_at_home_exactly_once() {
    let t = trace(1, 120.0, 40);
    let mut cfg = config();
    cfg.time_scale = 0.25;
    for refuse in [true, false] {
        cfg.refuse_forwards = refuse;
        for kind in [
            PolicyKind::Gorgo,
            PolicyKind::GorgoTtft,
            PolicyKind::CacheAware,
        ] {
            let r = run(&cfg, kind, &t);
            check_conservation(&cfg, &r, t.len());
            let refused = r.counters.refused_forwards;
            let refuses = refuse && kind != PolicyKind::CacheAware;
            assert_eq!(refused > 0, refuses, "{kind} refuse={refuse}: {refused}");
        }
    }
}

#[test]
fn cache_pressure_evicts_but_never_overflows() {
    let t = trace(2, 120.0, 60);
    let mut cfg = config();
    for p in &mut cfg.profiles {
        p.max_total_tokens = 40_000;
        p.context_length = 32_000;
    }
    let r = run(&cfg, PolicyKind::Gorgo, &t);
    check_conservation(&cfg, &r, t.len());
    // The caches filled up: occupancy reached most of the capacity.
    assert!(r.counters.max_cached_tokens.iter().any(|&c| c > 20_000));
}

#[test]
fn same_seed_same_result() {
    let t = trace(3, 60.0, 30);
    let cfg = config();
    let a = run(&cfg, PolicyKind::Gorgo, &t);
    let b = run(&cfg, PolicyKind::Gorgo, &t);
    assert_eq!(a.rows, b.rows);
    assert_eq!(a.counters, b.counters);
}

#[test]
fn max_hops_two_still_bounded() {
    let t = trace(4, 60.0, 30);
    let mut cfg = config();
    cfg.max_hops = 2;
    let r = run(&cfg, PolicyKind::Random, &t);
    check_conservation(&cfg, &r, t.len());
    assert_eq!(r.counters.max_hops_seen, 2);
    // A forward never goes back to a node it has left (`via`): two hops end at a third
    // region, never at home.
    let rows = r.rows.as_ref().unwrap();
    let bounced = rows
        .iter()
        .filter(|r| r.hops == 2 && r.served == Some(r.home))
        .count();
    assert_eq!(bounced, 0, "of {} two-hop requests", {
        rows.iter().filter(|r| r.hops == 2).count()
    });
}

#[test]
fn local_only_never_forwards_and_failures_are_recorded() {
    let mut t = trace(5, 60.0, 20);
    // One request no engine can take: recorded as failed, not lost.
    t[3].input_tokens = 1_000_000;
    let cfg = config();
    let r = run(&cfg, PolicyKind::LocalOnly, &t);
    assert_eq!(r.counters.forwarded, 0);
    assert_eq!(r.counters.failed, 1);
    assert_eq!(r.counters.completed + 1, t.len() as u64);
    let failed: Vec<_> = r.rows.as_ref().unwrap().iter().filter(|r| !r.ok).collect();
    // Refused at its node's door (the live node's `check_context`), before any engine.
    let error = failed[0].error.as_deref().unwrap();
    assert!(error.contains("context length"), "{error}");
}

#[test]
fn tuning_decides_epochs_and_report_has_them() {
    let t = trace(6, 300.0, 60);
    let mut cfg = config();
    cfg.tune = true;
    cfg.tuning_window = Some(32);
    let g = run(&cfg, PolicyKind::Gorgo, &t);
    check_conservation(&cfg, &g, t.len());
    assert!(!g.tuning.is_empty(), "no tuning epoch decided");
    let o = run(&cfg, PolicyKind::Oracle, &t);
    let report = build_report(&serde_json::json!({"test": true}), &[g, o]).unwrap();
    assert_eq!(report.results.policies.len(), 2);
    assert!(!report.tuning.is_empty());
    let line: serde_json::Value = serde_json::from_str(&report.tuning[0]).unwrap();
    for key in [
        "policy",
        "epoch",
        "leader",
        "candidate",
        "incumbent",
        "accepted",
        "sigma",
    ] {
        assert!(line.get(key).is_some(), "tuning line lacks {key}: {line}");
    }
    let gap = gorgo_sim::report::oracle_gap(&report.results).unwrap();
    assert!(gap.p95_ttft_ratio.is_finite() && gap.p95_ttft_ratio > 0.0);
}

#[test]
fn row_cap_falls_back_to_sketches() {
    let t = trace(7, 60.0, 20);
    let mut cfg = config();
    cfg.max_rows = 10;
    let r = run(&cfg, PolicyKind::LeastLoad, &t);
    assert!(r.rows.is_none());
    let report = build_report(&serde_json::json!({}), std::slice::from_ref(&r)).unwrap();
    let p = report.results.policy("least-load").unwrap();
    assert_eq!(p.requests, t.len() as u64);
    assert!(p.ttft_ms.p50 > 0.0 && p.ttft_ms.p95 >= p.ttft_ms.p50);
    assert!(report.records.is_empty());
}

#[test]
fn bad_config_names_the_field() {
    let mut cfg = config();
    cfg.time_scale = 0.0;
    let e = simulate(&cfg, PolicyKind::Gorgo, std::iter::empty(), &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("time_scale"), "{e}");
    let mut cfg = config();
    cfg.profiles.pop();
    let e = simulate(&cfg, PolicyKind::Gorgo, std::iter::empty(), &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("profiles"), "{e}");
    let mut cfg = config();
    cfg.non_streamed_share = 1.5;
    let e = simulate(&cfg, PolicyKind::Gorgo, std::iter::empty(), &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("non_streamed_share"), "{e}");
    for replicas in [0, 65] {
        let mut cfg = config();
        cfg.replicas = replicas;
        let e = simulate(&cfg, PolicyKind::Gorgo, std::iter::empty(), &mut |_| {}).unwrap_err();
        assert!(e.to_string().contains("replicas"), "{e}");
    }
}

/// Four engines per region: every policy still serves each request exactly once, on
/// engines that never overflow, with every engine of the cluster used; each node keeps
/// one view per engine (none drifts), and gossip carries one stream per engine (with
/// loss, snapshot requests reach the right one: nothing stays unrepaired).
#[test]
fn replicas_conserve_and_use_every_engine() {
    let t = trace(3, 120.0, 60);
    let mut cfg = config();
    cfg.replicas = 4;
    // Four times the engines: four times the load.
    cfg.time_scale = 0.125;
    for kind in PolicyKind::ALL {
        let r = run(&cfg, kind, &t);
        check_conservation(&cfg, &r, t.len());
        let c = &r.counters;
        assert_eq!(c.capacity_tokens.len(), 12, "{kind}");
        if kind != PolicyKind::LocalOnly {
            assert!(c.forwarded > 0, "{kind}: some requests leave home");
        }
        if matches!(
            kind,
            PolicyKind::Gorgo
                | PolicyKind::LeastRequest
                | PolicyKind::RoundRobin
                | PolicyKind::Oracle
        ) {
            for (e, used) in c.max_used_tokens.iter().enumerate() {
                assert!(*used > 0, "{kind}: engine {e} never used");
            }
        }
        if kind != PolicyKind::Oracle {
            assert_eq!(c.view_counters_end.len(), 12, "{kind}");
        }
    }
    let one = run(&config(), PolicyKind::Gorgo, &t);
    let four = run(&cfg, PolicyKind::Gorgo, &t);
    let per_ms = |r: &PolicyRun| r.counters.gossip_messages as f64 / r.counters.end_ms;
    let ratio = per_ms(&four) / per_ms(&one);
    assert!((3.5..4.5).contains(&ratio), "gossip messages x{ratio:.2}");
    cfg.gossip_loss = 0.2;
    cfg.kv_events = true;
    let lossy = run(&cfg, PolicyKind::Gorgo, &t);
    check_conservation(&cfg, &lossy, t.len());
    assert!(lossy.counters.snapshot_requests > 0);
}

#[test]
fn mooncake_slice_runs_if_present() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/data/traces/mooncake_conversation_trace.jsonl"
    );
    let Ok(reader) = gorgo_workload::open_trace(std::path::Path::new(path)) else {
        eprintln!("skipping: {path} missing");
        return;
    };
    let mut cfg = SimConfig::new(
        Network::uniform(3, 45.0, 3.0),
        Profile::by_name("paper-a100-mistral7b").unwrap(),
    );
    cfg.max_requests = Some(300);
    let r = simulate(&cfg, PolicyKind::Gorgo, reader, &mut |_| {}).unwrap();
    assert_eq!(r.counters.requests, 300);
    assert_eq!(r.counters.completed + r.counters.failed, 300);
    assert_eq!(r.counters.first_tokens, r.counters.completed);
}

#[test]
fn max_context_shortens_instead_of_failing() {
    let mut t = trace(8, 60.0, 20);
    // A prompt far past the context, with block ids past its shortened length.
    t[2].input_tokens = 200_000;
    if let gorgo_workload::BlockIds::Int(ids) = &mut t[2].blocks {
        ids.extend(1_000_000..1_000_800);
    }
    let mut cfg = config();
    cfg.max_context_tokens = Some(cfg.profiles[0].context_length);
    let r = run(&cfg, PolicyKind::Gorgo, &t);
    check_conservation(&cfg, &r, t.len());
    assert_eq!(r.counters.failed, 0);
    let row = r
        .rows
        .as_ref()
        .unwrap()
        .iter()
        .find(|r| r.index == 2)
        .unwrap();
    assert!(row.ok);
    assert_eq!(
        row.input_tokens as u64,
        cfg.profiles[0].context_length
            - row.output_tokens as u64
            - gorgo_workload::CHAT_TEMPLATE_TOKENS
    );
}

/// A prompt shortened to the context keeps its block ids, so its last block is cached
/// short under an id that a longer turn of the same conversation holds in full. The
/// engines reuse only the tokens a block holds, so no engine's KV ever overflows.
#[test]
fn shortened_prompts_sharing_prefixes_never_overflow() {
    let mut t = trace(2, 120.0, 60);
    // Three prompt families: every row's blocks are a prefix of its family's ids.
    for (i, r) in t.iter_mut().enumerate() {
        let family = i as u64 % 3 * 1_000_000;
        let blocks = r.input_tokens.div_ceil(u64::from(r.tokens_per_block));
        r.blocks = gorgo_workload::BlockIds::Int((family..family + blocks).collect());
    }
    let mut cfg = config();
    cfg.max_context_tokens = Some(1199);
    for p in &mut cfg.profiles {
        p.max_total_tokens = 2000;
    }
    let limit = |out: u32| gorgo_workload::context_prompt_limit(out, 1199);
    let shortened = t.iter().filter(|r| r.input_tokens > limit(r.output_tokens));
    assert!(shortened.count() > 100, "the context shortens many prompts");
    for kind in [PolicyKind::Gorgo, PolicyKind::LeastLoad, PolicyKind::Oracle] {
        let r = run(&cfg, kind, &t);
        check_conservation(&cfg, &r, t.len());
        assert_eq!(r.counters.failed, 0, "{kind}");
        let rows = r.rows.as_ref().unwrap();
        assert!(
            rows.iter().any(|r| r.cached_tokens > 0),
            "{kind}: prefixes shared"
        );
    }
}

/// One-token answers with client jitter: the first and the last byte of a stream get
/// their own delay draws, yet the last never arrives before the first (E2E >= TTFT,
/// which `check_conservation` asserts), served at home or forwarded over jittery links
/// (where the forwarding node must also see the first byte before the stream ends:
/// no unexpected event).
#[test]
fn the_last_byte_never_overtakes_the_first() {
    let mut t = trace(1, 120.0, 40);
    t.truncate(200);
    for r in &mut t {
        r.output_tokens = 1;
    }
    let mut cfg = config();
    cfg.network = Network::uniform(1, 0.0, 2.0);
    cfg.network.regions[0].client_jitter_ms = 5.0;
    cfg.profiles.truncate(1);
    let r = run(&cfg, PolicyKind::Gorgo, &t);
    check_conservation(&cfg, &r, t.len());

    let mut cfg = config();
    cfg.network.jitter_ms = 30.0;
    for region in &mut cfg.network.regions {
        region.client_jitter_ms = 5.0;
    }
    for kind in [PolicyKind::Random, PolicyKind::Gorgo] {
        let r = run(&cfg, kind, &t);
        check_conservation(&cfg, &r, t.len());
        assert!(r.counters.forwarded > 0, "{kind}");
    }
}

#[test]
fn live_chains_and_exact_state_conserve_too() {
    let t = trace(9, 60.0, 30);
    for exact_state in [false, true] {
        let mut cfg = config();
        cfg.live_chains = true;
        cfg.exact_state = exact_state;
        for kind in [
            PolicyKind::Gorgo,
            PolicyKind::SimpleSessionAffinity,
            PolicyKind::Oracle,
        ] {
            let r = run(&cfg, kind, &t);
            check_conservation(&cfg, &r, t.len());
        }
    }
}

#[test]
fn node_view_counters_return_to_zero() {
    // Loaded (queueing, evictions, refusals possible) so every path of the view runs.
    let t = trace(21, 90.0, 60);
    let mut cfg = config();
    cfg.time_scale = 0.25;
    for kind in [
        PolicyKind::Gorgo,
        PolicyKind::LeastRequest,
        PolicyKind::PrefixCache,
    ] {
        let r = run(&cfg, kind, &t);
        check_conservation(&cfg, &r, t.len());
        let views = &r.counters.view_counters_end;
        assert_eq!(views.len(), 3, "{kind:?}: one view per node");
        for (i, v) in views.iter().enumerate() {
            assert_eq!(
                (
                    v.inflight,
                    v.unfinished_prefill_tokens,
                    v.queued_prompt_tokens
                ),
                (0, 0, 0),
                "{kind:?}: node {i}'s view drifted"
            );
        }
    }
    // The oracle has no nodes, so no views.
    let r = run(&cfg, PolicyKind::Oracle, &t);
    assert!(r.counters.view_counters_end.is_empty());
}

#[test]
fn summary_sample_follows_the_topology_and_divides_gossip() {
    use gorgo_core::summary::{SampleSetting, SummarySample};
    let t = trace(11, 30.0, 12);
    let mut cfg = config();
    // Auto: three regions (two peers) keep every block; 31 peers take one in 8.
    assert_eq!(cfg.summary_sample, SampleSetting::Auto);
    assert_eq!(cfg.summary_sample_rate(), SummarySample::EVERY_BLOCK);
    let every = run(&cfg, PolicyKind::Gorgo, &t);
    let big = SimConfig::new(Network::uniform(32, 40.0, 3.0), small_profile());
    big.validate().unwrap();
    assert_eq!(big.summary_sample_rate().rate(), 8);
    // A fixed 4 on three regions: far fewer summary bytes, same requests conserved.
    cfg.summary_sample = SampleSetting::Fixed(SummarySample::from_rate(4).unwrap());
    assert_eq!(cfg.summary_sample_rate().rate(), 4);
    let sampled = run(&cfg, PolicyKind::Gorgo, &t);
    check_conservation(&cfg, &sampled, t.len());
    let (a, b) = (every.counters.gossip_bytes, sampled.counters.gossip_bytes);
    assert!(b < a, "sampled {b} bytes, every block {a}");
}

#[test]
fn gossip_loss_is_repaired_by_snapshot_requests() {
    let t = trace(11, 60.0, 12);
    let mut cfg = config();
    cfg.gossip_loss = 0.2;
    let lossy = run(&cfg, PolicyKind::Gorgo, &t);
    check_conservation(&cfg, &lossy, t.len());
    let c = &lossy.counters;
    assert!(c.gossip_lost > 0, "some gossip lost");
    assert!(c.snapshot_requests > 0, "gaps asked for snapshots");
    assert!(
        c.gossip_bytes > c.gossip_messages,
        "bytes from encoded sizes"
    );
    // Seeded: the same loss again.
    let again = run(&cfg, PolicyKind::Gorgo, &t);
    assert_eq!(again.counters.gossip_lost, c.gossip_lost);
    assert_eq!(again.counters.snapshot_requests, c.snapshot_requests);
    // Without loss nothing is lost and no gap needs a snapshot.
    cfg.gossip_loss = 0.0;
    let clean = run(&cfg, PolicyKind::Gorgo, &t);
    assert_eq!(clean.counters.gossip_lost, 0);
    assert_eq!(clean.counters.snapshot_requests, 0);
    cfg.gossip_loss = 1.0;
    assert!(cfg.validate().is_err());
}

#[test]
fn results_carry_cache_hits_and_prediction_error() {
    let cfg = config();
    let t = trace(3, 300.0, 12);
    let runs: Vec<PolicyRun> = [PolicyKind::Gorgo, PolicyKind::LeastLoad]
        .into_iter()
        .map(|k| run(&cfg, k, &t))
        .collect();
    let report = build_report(&serde_json::json!({}), &runs).unwrap();
    let json = serde_json::to_value(&report.results).unwrap();
    let g = &json["policies"]["gorgo"];
    let hit = g["cache_hit_ratio"].as_f64().unwrap();
    assert!(hit > 0.0 && hit < 1.0, "{g}");
    assert!(!g["cache_hit_ratio_by_region"]
        .as_object()
        .unwrap()
        .is_empty());
    let p = &g["prediction"];
    assert!(p["n"].as_u64().unwrap() > 0, "{p}");
    assert!(p["mape_median"].as_f64().unwrap() >= 0.0, "{p}");
    let rho = p["spearman"].as_f64().unwrap();
    assert!((-1.0..=1.0).contains(&rho), "{p}");
    // Every completed gorgo request has an estimate; least-load makes none.
    let completed = g["requests"].as_u64().unwrap() - g["failed"].as_u64().unwrap();
    assert_eq!(p["n"].as_u64().unwrap(), completed);
    assert!(json["policies"]["least-load"]["prediction"].is_null());
    assert!(json["policies"]["least-load"]["cache_hit_ratio"]
        .as_f64()
        .is_some());
    assert!(report
        .records
        .iter()
        .filter(|r| r.policy == "gorgo")
        .all(|r| r.predicted_ttft_ms.is_some()));
    // The gossip the nodes sent, as `sim.json` has it; none without nodes (oracle).
    let gossip = g["gossip_bytes_per_node_per_s"].as_f64().unwrap();
    let expected = runs[0].counters.gossip_bytes_per_node_per_s_arriving(3);
    assert!(gossip > 0.0 && (gossip - expected).abs() < 1e-9, "{g}");
    let oracle = run(&cfg, PolicyKind::Oracle, &t);
    let report_o = build_report(&serde_json::json!({}), std::slice::from_ref(&oracle)).unwrap();
    assert!(report_o
        .results
        .policy("oracle")
        .unwrap()
        .gossip_bytes_per_node_per_s
        .is_none());

    // Past the row cap the same fields come from the sketches (no Spearman there).
    let mut capped = cfg.clone();
    capped.max_rows = 10;
    let run = run(&capped, PolicyKind::Gorgo, &t);
    let r = gorgo_sim::report::result_from_sketches(&run);
    let exact = report.results.policy("gorgo").unwrap();
    assert!((r.cache_hit_ratio.unwrap() - exact.cache_hit_ratio.unwrap()).abs() < 1e-9);
    let p = r.prediction.unwrap();
    assert_eq!(p.spearman, None);
    assert_eq!(p.n, exact.prediction.unwrap().n);
    assert!(
        (p.mape_median - exact.prediction.unwrap().mape_median).abs()
            <= 0.02 * exact.prediction.unwrap().mape_median + 1e-9
    );
}

/// The floor is a lower bound: no request of any policy, at any load, with one engine
/// or several per region and regions of different speeds, beats its own E2E floor,
/// nor caches more of its prompt than the unbounded shared cache (with what its
/// burst-mates compute: a burst of two identical prompts longer than a prefill chunk,
/// where the engine admits the second once the first has computed the blocks); within
/// each burst (requests arriving at the same instant) the sorted TTFTs are at least the
/// sorted floors; so no percentile beats the floor's, nor any cache hit ratio its
/// bound.
#[test]
fn floor_is_below_every_request_of_every_policy() {
    use std::collections::BTreeMap;

    use gorgo_core::sketch::summarize;
    use gorgo_sim::floor::{request_floors, summarize_floors};
    let mut t = trace(8, 120.0, 40);
    // Bursts: every fifth request arrives with the one before it.
    for i in (1..t.len()).step_by(5) {
        t[i].timestamp_ms = t[i - 1].timestamp_ms;
    }
    // A burst of one long prompt twice, at one home, after the rest has drained: its
    // second request waits for a prefill batch with room, and finds the blocks the
    // first computed (32 blocks, 16,384 tokens: two of the profile's prefill chunks).
    let last = t.last().unwrap().timestamp_ms;
    let mut long = t[0].clone();
    long.timestamp_ms = last + 600_000;
    long.input_tokens = 16_384;
    long.output_tokens = 1;
    long.blocks = gorgo_workload::BlockIds::Int((10_000_000..10_000_032).collect());
    long.home_region = Some("r0".into());
    t.push(long.clone());
    t.push(long);
    let slack = |v: f64| 0.01 + v * 1e-6;
    for (time_scale, replicas) in [(0.5, 1), (4.0, 2)] {
        let mut cfg = config();
        cfg.time_scale = time_scale;
        cfg.replicas = replicas;
        // One region slower than the others: the floor takes the fastest engine.
        cfg.profiles[1].t_p_ms_per_token *= 2.0;
        let floors = request_floors(&cfg, t.iter().cloned().map(Ok)).unwrap();
        assert_eq!(floors.len(), t.len());
        let floor = summarize_floors(&floors);
        assert!(floor.cache_hit_ratio.unwrap() > 0.3, "{floor:?}");
        let mut floor_bursts: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
        for f in &floors {
            floor_bursts
                .entry(f.arrival_ms)
                .or_default()
                .push(f.ttft_ms);
        }
        assert!(floor_bursts.values().any(|b| b.len() > 1));
        for kind in PolicyKind::ALL {
            let r = run(&cfg, kind, &t);
            let rows = r.rows.as_ref().expect("rows kept");
            let (mut ttft, mut e2e) = (Vec::new(), Vec::new());
            let mut bursts: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
            for row in rows.iter().filter(|r| r.ok) {
                let f = &floors[row.index as usize];
                assert!(
                    row.e2e_ms as f64 >= f.e2e_ms - slack(f.e2e_ms),
                    "{kind} x{time_scale}: r{} E2E {} under its floor {}",
                    row.index,
                    row.e2e_ms,
                    f.e2e_ms
                );
                assert!(
                    row.cached_tokens as u64 <= f.cache_bound_tokens,
                    "{kind}: r{} cached {} over the floor's bound {}",
                    row.index,
                    row.cached_tokens,
                    f.cache_bound_tokens
                );
                // What any engine held when the node decided was computed by earlier
                // arrivals (what the engine used later may include a burst-mate's).
                assert!(
                    row.cached_anywhere_tokens as u64 <= f.cached_tokens,
                    "{kind}: r{} anywhere {} over the floor's {}",
                    row.index,
                    row.cached_anywhere_tokens,
                    f.cached_tokens
                );
                bursts
                    .entry(f.arrival_ms)
                    .or_default()
                    .push(row.ttft_ms as f64);
                ttft.push(row.ttft_ms as f64);
                e2e.push(row.e2e_ms as f64);
            }
            for (at, mut got) in bursts {
                let mut bound = floor_bursts[&at].clone();
                got.sort_by(f64::total_cmp);
                bound.sort_by(f64::total_cmp);
                for (g, b) in got.iter().zip(&bound) {
                    assert!(
                        *g >= b - slack(*b),
                        "{kind} x{time_scale}: burst at {at}: TTFTs {got:?} under floors {bound:?}"
                    );
                }
            }
            if rows.iter().all(|r| r.ok) {
                assert!(
                    summarize(&mut ttft).p95 >= floor.ttft_ms.p95 - 0.01,
                    "{kind}"
                );
                assert!(summarize(&mut e2e).p95 >= floor.e2e_ms.p95 - 0.01, "{kind}");
                let cached: u64 = rows.iter().map(|r| r.cached_tokens as u64).sum();
                let prompt: u64 = rows.iter().map(|r| r.input_tokens as u64).sum();
                let hit = cached as f64 / prompt as f64;
                let bound = floor.cache_hit_ratio.unwrap();
                assert!(hit <= bound, "{kind}: hit {hit} over the bound {bound}");
            }
        }
    }
}

/// `decisions.jsonl`'s records: the first `decision_log` decisions, each naming its
/// node and request, with every candidate's terms; the forwards' second decisions and
/// the refusals among them, each naming where the forward came from (`origin`: the
/// home node and the request's id there), and each refused forward's decision at home
/// marked `forward-refused`, as the live node's `/admin/decisions` has them; and
/// keeping them changes nothing of the run.
#[test]
fn the_decision_log_keeps_the_first_decisions_and_changes_nothing() {
    let t = trace(1, 120.0, 40);
    let mut cfg = config();
    cfg.time_scale = 0.25;
    let plain = run(&cfg, PolicyKind::Gorgo, &t);
    assert!(plain.decisions.is_empty(), "none kept by default");
    cfg.decision_log = 100_000;
    let logged = run(&cfg, PolicyKind::Gorgo, &t);
    assert_eq!(plain.rows, logged.rows, "logging does not change the run");
    let d = &logged.decisions;
    let c = &logged.counters;
    let client = d.iter().filter(|l| l.record.hops == 0).count() as u64;
    let refused = d.iter().filter(|l| l.record.reason == "refused").count() as u64;
    // One decision per request at its home node (but those refused at its door, a
    // prompt over the context: the live node decides nothing for them either), one per
    // forward at its target (its check there, or its decision when served).
    let at_door = logged
        .rows
        .as_ref()
        .unwrap()
        .iter()
        .filter(|r| {
            r.error
                .as_deref()
                .is_some_and(|e| e.starts_with("context length"))
        })
        .count() as u64;
    assert_eq!(client + at_door, c.requests);
    assert_eq!(refused, c.refused_forwards);
    assert!(refused > 0, "this load refuses some forwards");
    // (`forwarded` counts the completed forwards; a failed one was decided too.)
    let at_targets = d.len() as u64 - client;
    assert!(
        at_targets >= c.forwarded + c.refused_forwards,
        "{at_targets}"
    );
    assert!(
        at_targets <= c.forwarded + c.refused_forwards + c.failed,
        "{at_targets}"
    );
    for l in d {
        assert!(!l.record.candidates.is_empty());
        let winner = l.record.winner.as_ref();
        assert_eq!(winner.is_some(), l.record.reason != "refused");
        if let Some(w) = winner {
            assert!(l.record.candidates.iter().any(|c| c.chosen && &c.node == w));
        }
        if l.record.reason == "policy" {
            assert!(l.record.candidates.iter().all(|c| c.terms.is_some()));
        }
    }
    // Forwards and refusals pair with the decision that sent them, as live.
    let rows = logged.rows.as_ref().unwrap();
    let home = |id: u64| {
        let row = rows.iter().find(|r| r.index == id).unwrap();
        gorgo_core::NodeId(format!("r{}", row.home))
    };
    for l in d {
        let r = &l.record;
        let origin = (r.hops > 0).then(|| gorgo_core::decision::ForwardOrigin {
            node: home(r.request_id),
            request_id: r.request_id,
        });
        assert_eq!(r.origin, origin, "r{} at {}", r.request_id, l.node);
        let refused_here = r.hops == 0
            && d.iter()
                .any(|x| x.record.request_id == r.request_id && x.record.reason == "refused");
        assert_eq!(
            r.forward_outcome.as_deref(),
            refused_here.then_some("forward-refused"),
            "r{} at {}",
            r.request_id,
            l.node
        );
    }
    // The loads the count-based policies compare are in the record too.
    let cands = || d.iter().flat_map(|l| &l.record.candidates);
    assert!(cands().any(|c| c.running > 0) && cands().any(|c| c.inflight_forwards > 0));
    cfg.decision_log = 10;
    assert_eq!(run(&cfg, PolicyKind::Gorgo, &t).decisions, d[..10]);
}

/// Late binding (`hold_tokens`): under load nodes hold requests back and decide them
/// again, and every request is still served exactly once, with one engine or four,
/// the same way on every run; the oracle and a config without it hold nothing.
#[test]
fn late_binding_holds_under_load_and_conserves() {
    let t = trace(21, 90.0, 60);
    let mut cfg = config();
    cfg.time_scale = 0.25;
    let plain = run(&cfg, PolicyKind::Gorgo, &t);
    assert_eq!(plain.counters.holds, 0);
    cfg.hold_tokens = 2048;
    for replicas in [1, 4] {
        cfg.replicas = replicas;
        let r = run(&cfg, PolicyKind::Gorgo, &t);
        check_conservation(&cfg, &r, t.len());
        assert!(r.counters.holds > 0, "replicas {replicas}: nothing held");
        let again = run(&cfg, PolicyKind::Gorgo, &t);
        assert_eq!(again.counters.holds, r.counters.holds);
        assert_eq!(again.counters.end_ms, r.counters.end_ms);
        let oracle = run(&cfg, PolicyKind::Oracle, &t);
        check_conservation(&cfg, &oracle, t.len());
        assert_eq!(oracle.counters.holds, 0);
    }
}

/// The causal oracle knows another region's forward once news of it could have
/// arrived. With no delay between regions that is at once, so it decides exactly as the
/// oracle does; with delay it knows less, so it decides otherwise (the test would pass
/// vacuously if the flag did nothing), and it still serves every request once.
#[test]
fn the_causal_oracle_is_the_oracle_without_delay_and_conserves_with_it() {
    let t = trace(3, 60.0, 30);
    let mut cfg = config();
    cfg.network = Network::uniform(3, 0.0, 3.0);
    let full = run(&cfg, PolicyKind::Oracle, &t);
    cfg.causal_oracle = true;
    let causal = run(&cfg, PolicyKind::Oracle, &t);
    assert!(full.counters.forwarded > 0);
    assert_eq!(full.rows, causal.rows);

    let mut cfg = config();
    let full = run(&cfg, PolicyKind::Oracle, &t);
    cfg.causal_oracle = true;
    let causal = run(&cfg, PolicyKind::Oracle, &t);
    check_conservation(&cfg, &causal, t.len());
    assert_ne!(full.rows, causal.rows);
}

/// A request of a trace row, sent at `timestamp_ms` from region `home`.
fn homed_row(timestamp_ms: u64, home: &str, block: u64) -> TraceRequest {
    TraceRequest {
        timestamp_ms,
        input_tokens: 512,
        output_tokens: 4,
        blocks: gorgo_workload::BlockIds::Int(vec![block]),
        tokens_per_block: 512,
        user: None,
        session: None,
        home_region: Some(home.to_owned()),
        request_id: None,
        system_prompt_hash: None,
    }
}

/// The cluster is warm when the trace starts, as a live one is (`gorgo up` starts a
/// replay once every node has every peer's stats): a burst at the first instant is
/// spread by a policy that spreads load. It started cold, and the first burst stayed
/// home under every policy.
#[test]
fn the_first_burst_finds_every_peer_known() {
    let cfg = SimConfig::new(Network::uniform(3, 40.0, 3.0), small_profile());
    let names = cfg.network.names();
    let t: Vec<TraceRequest> = (0..6).map(|i| homed_row(0, &names[0], i)).collect();
    let run = run(&cfg, PolicyKind::RoundRobin, &t);
    let c = &run.counters;
    assert!(
        c.served_by_region[1] + c.served_by_region[2] > 0,
        "{:?}",
        c.served_by_region
    );
    // Reported from the trace's start: no request starts before 0.
    let rows = run.rows.as_ref().expect("rows kept");
    assert!(rows.iter().all(|r| r.start_ms >= 0.0 && r.start_ms < 1.0));
}

/// A row far in the future (an epoch-ms timestamp in a relative trace) is reached
/// without ticking through the gap: the nodes ticked every 250 ms of it.
#[test]
fn an_outlier_timestamp_does_not_tick_through_the_gap() {
    let cfg = SimConfig::new(Network::uniform(3, 40.0, 3.0), small_profile());
    let names = cfg.network.names();
    let t = [
        homed_row(0, &names[0], 1),
        homed_row(1_700_000_000_000, &names[1], 2),
    ];
    let run = run(&cfg, PolicyKind::Gorgo, &t);
    assert_eq!(run.counters.completed, 2);
    assert!(run.counters.events < 100_000, "{}", run.counters.events);
}
