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

/// Three regions with `configs/topologies/three-region.toml`'s one-way delays
/// (us-eu 45 ms, us-ap 90, eu-ap 125) as r0, r1, r2, no client delay, `max_hops` 2.
fn three_regions_two_hops() -> SimConfig {
    let mut net = Network::uniform(3, 0.0, 0.0);
    let d = [[0.0, 45.0, 90.0], [45.0, 0.0, 125.0], [90.0, 125.0, 0.0]];
    net.one_way_ms = d.iter().map(|r| r.to_vec()).collect();
    let mut cfg = SimConfig::new(net, profile());
    cfg.max_hops = 2;
    cfg
}

/// A request forwarded r0 -> r1 -> r2 comes back r2 -> r1 -> r0, as live: r1's
/// `forward` relays r2's stream and r0 reads r1's. Round-robin sends the fourth
/// request (r0's second) on to r1, and r1 (its second) on to r2; every engine is idle,
/// so its TTFT is the path there and back around the engine's idle prefill.
#[test]
fn two_hops_return_through_the_intermediate() {
    let cfg = three_regions_two_hops();
    let t = vec![
        row(0, 100, vec![], 1, "r2"),
        row(2000, 100, vec![], 1, "r1"),
        row(2000, 100, vec![], 1, "r0"),
        row(2001, 100, vec![], 1, "r0"),
    ];
    let r = run(&cfg, PolicyKind::RoundRobin, &t);
    let rows = r.rows.as_ref().unwrap();
    let two = rows.iter().find(|x| x.index == 3).unwrap();
    assert_eq!((two.hops, two.served), (2, Some(2)), "{two:?}");
    let engine = profile().idle_ttft_ms(100);
    let path = 45.0 + 125.0 + engine + 125.0 + 45.0;
    assert!((two.ttft_ms as f64 - path).abs() < 0.01, "{two:?}: {path}");
    assert!((two.e2e_ms as f64 - path).abs() < 0.01, "{two:?}: {path}");
}

/// Each node that forwards a request learns the forward bias of the peer it forwarded
/// to, from the first byte as it passes back through it (the live node's
/// `learn_forward_bias` on its own forward): r0 -> r1 -> r2 teaches r0 about r1 and r1
/// about r2, never r0 about r2, which r0 did not forward to.
///
/// r0 and r1 each start a 16k-token prompt at home; r0's next request is forwarded to
/// r1, which looks idle to r0 (its stats left before its prompt arrived), and r1,
/// busy, forwards it to r2, which looks idle to r1 but has just taken a 4k-token
/// prompt of its own: both forwards are late. Later requests show each node's bias.
#[test]
fn each_forwarding_node_learns_the_bias_of_its_own_peer() {
    let mut cfg = three_regions_two_hops();
    cfg.decision_log = 100;
    let t = vec![
        row(0, 100, vec![], 1, "r2"),
        row(5000, 16384, (1..=32).collect(), 1, "r0"),
        row(5100, 16384, (101..=132).collect(), 1, "r1"),
        row(5101, 2048, (201..=204).collect(), 20, "r0"),
        row(5140, 4096, (301..=308).collect(), 1, "r2"),
        row(12_000, 2048, (401..=404).collect(), 1, "r0"),
        row(12_000, 2048, (501..=504).collect(), 1, "r1"),
    ];
    let r = run(&cfg, PolicyKind::Gorgo, &t);
    let rows = r.rows.as_ref().unwrap();
    let forwarded = rows.iter().find(|x| x.index == 3).unwrap();
    assert_eq!((forwarded.hops, forwarded.served), (2, Some(2)));
    // The forward bias node `at` holds for `peer`, as its decision for request `index`
    // priced it.
    let bias = |index: u64, at: &str, peer: &str| {
        let d = r
            .decisions
            .iter()
            .find(|d| d.record.request_id == index && d.node == at)
            .unwrap();
        let c = d.record.candidates.iter().find(|c| c.node.0 == peer);
        c.unwrap().terms.unwrap().forward_bias_ms
    };
    assert!(bias(5, "r0", "r1") > 10.0, "{}", bias(5, "r0", "r1"));
    assert_eq!(bias(5, "r0", "r2"), 0.0);
    assert!(bias(6, "r1", "r2") > 10.0, "{}", bias(6, "r1", "r2"));
}

/// With `max_hops` 2 a forward is checked against an offer only where it may not go
/// further, at its second hop, against the offer of the node that sent it there (the
/// live node's `route_and_serve` checks `req.hops >= max_hops`); the refusal goes back
/// to that node, which serves the request itself: one hop from home, in the region
/// whose decision forwarded it.
#[test]
fn a_refusal_at_the_last_hop_goes_back_to_the_node_that_forwarded_it() {
    let (mut cfg, t) = loaded();
    cfg.max_hops = 2;
    let mut refusals = 0;
    for kind in [PolicyKind::Gorgo, PolicyKind::GorgoTtft] {
        let r = run(&cfg, kind, &t);
        let rows = r.rows.as_ref().unwrap();
        for d in r.decisions.iter().filter(|d| d.record.reason == "refused") {
            refusals += 1;
            let id = d.record.request_id;
            assert_eq!(d.record.hops, 2, "{kind} r{id} refused at {}", d.node);
            let forwarder = r
                .decisions
                .iter()
                .find(|f| f.record.request_id == id && f.record.hops == 1)
                .unwrap();
            let row = rows.iter().find(|x| x.index == id).unwrap();
            // Each record names where the request came from, and the forwarding
            // node's says its forward was refused (`/admin/decisions`, live).
            let home = gorgo_core::NodeId(format!("r{}", row.home));
            for rec in [&d.record, &forwarder.record] {
                let origin = rec.origin.as_ref().unwrap();
                assert_eq!((&origin.node, origin.request_id), (&home, id));
            }
            assert_eq!(
                forwarder.record.forward_outcome.as_deref(),
                Some("forward-refused")
            );
            assert_eq!(row.hops, 1, "{kind} r{id}");
            assert_eq!(
                row.served.map(|s| format!("r{s}")).as_deref(),
                Some(forwarder.node.as_str()),
                "{kind} r{id}"
            );
        }
    }
    assert!(refusals > 0);
}

/// At a serial engine whose clients do not stream, the node learns each request's
/// decode time from when its prefill was expected to end, as the live node does (the
/// body's first byte, at the end, is taken as its first token). With several requests
/// queued the expected end prices their decodes with the decode time learnt: taken as
/// measured, an error of that estimate came back several times over. The decode time
/// the simulated node prices its queue with stays near the engine's.
#[test]
fn an_unstreamed_serial_engine_decode_time_is_learnt_near_the_truth() {
    let mut p = profile();
    p.max_running_requests = 1;
    let mut cfg = SimConfig::new(Network::uniform(1, 0.0, 3.0), p);
    cfg.decision_log = 1_000_000;
    cfg.non_streamed_share = 1.0;
    // A request every 1.1 s, each about 6 s of decode: a queue that grows to dozens.
    let t: Vec<TraceRequest> = (0..120u64)
        .map(|i| row(i * 1_100, 512, vec![10_000 + i], 300, "r0"))
        .collect();
    let r = run(&cfg, PolicyKind::Gorgo, &t);
    let rows = r.rows.as_ref().unwrap();
    let mut truth: Vec<f64> = rows
        .iter()
        .map(|x| f64::from(x.e2e_ms) - f64::from(x.ttft_ms))
        .collect();
    truth.sort_by(f64::total_cmp);
    let true_decode = truth[truth.len() / 2];
    // The slot wait prices `n - 1/2` decodes for `n` requests ahead (one slot).
    let learnt: Vec<f64> = r
        .decisions
        .iter()
        .filter(|d| d.record.request_id >= 60)
        .filter_map(|d| {
            let c = &d.record.candidates[0];
            let ahead = f64::from(c.running) + f64::from(c.waiting);
            let slot_wait = c.terms.as_ref()?.slot_wait_ms;
            (ahead >= 1.0).then(|| slot_wait / (ahead - 0.5))
        })
        .collect();
    assert!(learnt.len() > 30, "{} decisions with a queue", learnt.len());
    for d in &learnt {
        assert!(
            (d / true_decode - 1.0).abs() <= 0.25,
            "learnt {d:.0} ms against the engine's {true_decode:.0} ms"
        );
    }
}
