//! Hand-built routing situations: the cost model, every policy's rule, and the
//! forward-or-serve guards.

use gorgo_core::cost::{cost_terms, Candidate};
use gorgo_core::cost::{fewest_uncached_tokens, ForwardLedger};
use gorgo_core::decision::{
    decide, refuse_forward, CandidateExplain, DecisionReason, ForwardOffer, NoCandidateReason,
    Refusal, REFUSAL_MARGIN,
};
use gorgo_core::hash::HashChain;
use gorgo_core::policy::{build, PolicyKind, RouteRequest};
use gorgo_core::types::MAX_WEIGHT;
use gorgo_core::{CoreError, NodeId, Weights};
use proptest::prelude::*;

const T_P: f64 = 0.094;

fn cand(name: &str, is_local: bool, rtt_ms: f64) -> Candidate {
    let mut c = Candidate::idle(name, is_local, rtt_ms);
    c.stats.t_p_ms = T_P;
    c
}

fn chain_of(tokens: u64) -> HashChain {
    HashChain::from_bytes(&vec![b'x'; (tokens * 4) as usize], 256, 4)
}

fn choose(
    kind: PolicyKind,
    req: &RouteRequest<'_>,
    cands: &[Candidate],
    rng: u64,
) -> Option<usize> {
    let mut p = build(kind);
    p.choose(req, cands, kind.default_weights(), rng).index
}

fn target(kind: PolicyKind, req: &RouteRequest<'_>, cands: &[Candidate]) -> String {
    let mut p = build(kind);
    let d = decide(req, 0, 1, cands, p.as_mut(), kind.default_weights(), 7).expect("a target");
    d.target.0
}

#[test]
fn cached_peer_wins_only_while_rtt_is_below_the_prefill_it_saves() {
    // 1,000 cached tokens x 0.094 ms = 94 ms of prefill saved at the peer.
    let chain = chain_of(1200);
    let req = RouteRequest {
        chain: &chain,
        prompt_tokens: 1200,
        session_key: None,
    };
    let local = cand("a-local", true, 0.0);
    let mut peer = cand("b-peer", false, 20.0);
    peer.cached_tokens = 1000;
    assert_eq!(
        target(PolicyKind::Gorgo, &req, &[local.clone(), peer.clone()]),
        "b-peer"
    );
    let saved = cost_terms(1200, &local, Weights::default(), 1200).total_ms
        - cost_terms(1200, &peer, Weights::default(), 1200).prefill_ms;
    assert!((saved - 94.0).abs() < 1e-6);
    peer.rtt_ms = 180.0;
    assert_eq!(target(PolicyKind::Gorgo, &req, &[local, peer]), "a-local");
}

#[test]
fn busy_local_engine_loses_to_an_idle_peer() {
    let chain = chain_of(2000);
    let req = RouteRequest {
        chain: &chain,
        prompt_tokens: 2000,
        session_key: None,
    };
    let mut local = cand("a", true, 0.0);
    local.stats.unfinished_prefill_tokens = 20_000;
    local.stats.running = 30;
    local.stats.decode_step_ms = 25.0;
    // The same batch at both, so the decode-stall term is equal and the queue decides.
    let mut peer = cand("b", false, 90.0);
    peer.stats.running = 30;
    assert_eq!(
        target(PolicyKind::Gorgo, &req, &[local.clone(), peer.clone()]),
        "b"
    );
    // With w_queue near zero the queue is ignored and the request stays.
    let mut p = build(PolicyKind::Gorgo);
    let w = Weights {
        w_rtt: 1.0,
        w_queue: 0.01,
    };
    let d = decide(&req, 0, 1, &[local, peer], p.as_mut(), w, 0).unwrap();
    assert!(d.is_local);
    let terms = d
        .candidates
        .iter()
        .map(|c| c.terms.unwrap())
        .collect::<Vec<_>>();
    assert!(terms[0].queue_ms > 0.0 && terms[1].queue_ms == 0.0);
}

#[test]
fn anti_herding_forwards_count_as_queue() {
    let chain = chain_of(1000);
    let req = RouteRequest {
        chain: &chain,
        prompt_tokens: 1000,
        session_key: None,
    };
    let mut local = cand("a", true, 0.0);
    local.stats.unfinished_prefill_tokens = 3000;
    let mut peer = cand("b", false, 50.0);
    assert_eq!(
        target(PolicyKind::Gorgo, &req, &[local.clone(), peer.clone()]),
        "b"
    );
    peer.inflight_forwards = 3;
    peer.inflight_forward_prompt_tokens = 3000;
    assert_eq!(target(PolicyKind::Gorgo, &req, &[local, peer]), "a");
}

#[test]
fn unhealthy_never_chosen_and_nothing_healthy_is_no_candidate() {
    let chain = chain_of(500);
    let req = RouteRequest {
        chain: &chain,
        prompt_tokens: 500,
        session_key: None,
    };
    let mut local = cand("a", true, 0.0);
    local.stats.unfinished_prefill_tokens = 100_000;
    let mut peer = cand("b", false, 10.0);
    peer.healthy = false;
    for kind in PolicyKind::ALL {
        assert_eq!(
            target(kind, &req, &[local.clone(), peer.clone()]),
            "a",
            "{kind}"
        );
    }
    local.healthy = false;
    for kind in PolicyKind::ALL {
        let mut p = build(kind);
        let err = decide(
            &req,
            0,
            1,
            &[local.clone(), peer.clone()],
            p.as_mut(),
            Weights::default(),
            1,
        )
        .unwrap_err();
        assert_eq!(err.reason, NoCandidateReason::NoneHealthy);
    }
    // At max hops with the local engine down, nothing may serve even if a peer could.
    peer.healthy = true;
    let mut p = build(PolicyKind::Gorgo);
    let err = decide(
        &req,
        1,
        1,
        &[local.clone(), peer.clone()],
        p.as_mut(),
        Weights::default(),
        1,
    )
    .unwrap_err();
    assert_eq!(err.reason, NoCandidateReason::LocalUnhealthyAtMaxHops);
    // Its record prices the local engine (what serving here would have cost), not the
    // peer, which the request could not go to.
    assert!(err.candidates[0].terms.is_some_and(|t| t.total_ms > 0.0));
    assert!(err.candidates[1].terms.is_none());
    let mut p = build(PolicyKind::LocalOnly);
    let err = decide(
        &req,
        0,
        1,
        &[local, peer],
        p.as_mut(),
        Weights::default(),
        1,
    )
    .unwrap_err();
    assert_eq!(err.reason, NoCandidateReason::PolicyDeclined);
}

#[test]
fn decisions_serialize_for_the_admin_api() {
    let chain = chain_of(500);
    let req = RouteRequest {
        chain: &chain,
        prompt_tokens: 500,
        session_key: None,
    };
    let cands = [cand("a", true, 0.0), cand("b", false, 10.0)];
    let mut p = build(PolicyKind::Gorgo);
    let d = decide(&req, 0, 1, &cands, p.as_mut(), Weights::default(), 1).unwrap();
    assert_eq!(d.reason, DecisionReason::Policy);
    let json = serde_json::to_value(&d).unwrap();
    assert_eq!(json["policy"], "gorgo");
    assert_eq!(json["candidates"][0]["chosen"], true);
    assert!(json["candidates"][1]["terms"]["total_ms"].is_number());
    let back: gorgo_core::decision::Decision = serde_json::from_value(json).unwrap();
    assert_eq!(back, d);
}

#[test]
fn policy_names_round_trip() {
    for kind in PolicyKind::ALL {
        assert_eq!(kind.to_string().parse::<PolicyKind>().unwrap(), kind);
        assert_eq!(build(kind).kind(), kind);
        assert_eq!(serde_json::to_value(kind).unwrap(), kind.to_string());
    }
    assert_eq!(
        "simple-session-affinity".parse::<PolicyKind>().unwrap(),
        PolicyKind::SimpleSessionAffinity
    );
    match "fastest".parse::<PolicyKind>() {
        Err(CoreError::InvalidConfig { field, .. }) => assert_eq!(field, "policy"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn least_load_and_least_request() {
    let chain = chain_of(100);
    let req = RouteRequest {
        chain: &chain,
        prompt_tokens: 100,
        session_key: None,
    };
    let mut a = cand("a", true, 0.0);
    a.stats.running = 2;
    let mut b = cand("b", false, 300.0);
    b.stats.running = 1;
    b.stats.kv_used_tokens = 10_000;
    let mut c = cand("c", false, 300.0);
    c.stats.running = 1;
    c.stats.waiting = 1;
    let cands = [a, b, c];
    // least-load: a = 2, b = 10,001, c = 2 -> a (local wins the tie).
    assert_eq!(choose(PolicyKind::LeastLoad, &req, &cands, 1), Some(0));
    // least-request: a = 2, b = 1, c = 2 -> b.
    assert_eq!(choose(PolicyKind::LeastRequest, &req, &cands, 1), Some(1));
    let mut cands = cands;
    cands[1].inflight_forwards = 5;
    assert_eq!(choose(PolicyKind::LeastRequest, &req, &cands, 1), Some(0));
}

/// A saturated KV gauge (a peer's gossip is not range-checked; an engine's report of
/// 1.8e19 or more reads as `u64::MAX`) makes its engine the most loaded, not a panic in
/// the request's task (debug) or a sum wrapped to nearly 0 (release).
#[test]
fn least_load_saturates_on_a_huge_kv_gauge() {
    let chain = chain_of(100);
    let req = RouteRequest {
        chain: &chain,
        prompt_tokens: 100,
        session_key: None,
    };
    let mut local = cand("a", true, 0.0);
    local.stats.running = 1;
    local.stats.kv_used_tokens = 1000;
    let mut peer = cand("b", false, 10.0);
    peer.stats.running = 2;
    peer.stats.kv_used_tokens = u64::MAX;
    peer.inflight_forward_prompt_tokens = 7;
    assert_eq!(target(PolicyKind::LeastLoad, &req, &[local, peer]), "a");
}

#[test]
fn prefix_cache_rule() {
    let chain = chain_of(4000);
    let req = RouteRequest {
        chain: &chain,
        prompt_tokens: 4000,
        session_key: None,
    };
    let mut cands: Vec<Candidate> = (0..5)
        .map(|i| cand(&format!("n{i}"), i == 0, 50.0))
        .collect();
    for c in cands.iter_mut() {
        c.stats.running = 4;
    }
    cands[2].cached_tokens = 3000;
    cands[3].cached_tokens = 1000;
    assert_eq!(choose(PolicyKind::PrefixCache, &req, &cands, 0), Some(2));
    // An outlier load above mean + 2 sigma is skipped despite its match.
    for c in cands.iter_mut() {
        c.stats.running = 1;
    }
    let mut many: Vec<Candidate> = cands.clone();
    for i in 5..10 {
        let mut c = cand(&format!("n{i}"), false, 50.0);
        c.stats.running = 1;
        many.push(c);
    }
    many[2].stats.running = 12;
    assert_eq!(choose(PolicyKind::PrefixCache, &req, &many, 0), Some(3));
    // Spread above 16 requests: least-request.
    cands[2].stats.running = 20;
    cands[4].stats.running = 0;
    assert_eq!(choose(PolicyKind::PrefixCache, &req, &cands, 0), Some(4));
}

#[test]
fn cache_aware_rule() {
    let chain = chain_of(1000);
    let req = RouteRequest {
        chain: &chain,
        prompt_tokens: 1000,
        session_key: None,
    };
    let mut a = cand("a", true, 0.0);
    a.stats.kv_used_tokens = 50_000;
    let mut b = cand("b", false, 50.0);
    b.cached_tokens = 400;
    b.stats.kv_used_tokens = 90_000;
    let mut c = cand("c", false, 50.0);
    c.stats.kv_used_tokens = 10_000;
    // Match rate 0.4 > 0.3: longest match.
    let mut cands = vec![a, b, c];
    assert_eq!(choose(PolicyKind::CacheAware, &req, &cands, 0), Some(1));
    // Match rate 0.2: smallest cache.
    cands[1].cached_tokens = 200;
    assert_eq!(choose(PolicyKind::CacheAware, &req, &cands, 0), Some(2));
    // Imbalanced (100 vs 10: > 64 apart and > 1.5x): least loaded, whatever the cache.
    cands[1].cached_tokens = 1000;
    cands[0].stats.running = 10;
    cands[1].stats.running = 100;
    cands[2].stats.running = 30;
    assert_eq!(choose(PolicyKind::CacheAware, &req, &cands, 0), Some(0));
    // Spread 90 but ratio under 1.5 is not imbalance.
    cands[0].stats.running = 200;
    cands[1].stats.running = 290;
    cands[2].stats.running = 250;
    assert_eq!(choose(PolicyKind::CacheAware, &req, &cands, 0), Some(1));
}

#[test]
fn session_affinity_is_consistent_across_nodes_and_membership() {
    let names = ["eu", "us", "ap", "sa", "af"];
    let chain = chain_of(300);
    let mut moved = 0;
    for key in 0..200u64 {
        let req = RouteRequest {
            chain: &chain,
            prompt_tokens: 300,
            session_key: Some(key),
        };
        let cands: Vec<Candidate> = names
            .iter()
            .enumerate()
            .map(|(i, n)| cand(n, i == 0, 10.0))
            .collect();
        let first = target(PolicyKind::SessionAffinity, &req, &cands);
        // Another node (other candidate order, other local) agrees.
        let mut other: Vec<Candidate> = cands.iter().rev().cloned().collect();
        for c in other.iter_mut() {
            c.is_local = c.node.0 == "af";
        }
        assert_eq!(target(PolicyKind::SessionAffinity, &req, &other), first);
        // Removing a node that did not hold the session never moves it.
        let mut fewer = cands.clone();
        let gone = fewer
            .iter()
            .position(|c| c.node.0 != first && !c.is_local)
            .unwrap();
        fewer[gone].healthy = false;
        assert_eq!(target(PolicyKind::SessionAffinity, &req, &fewer), first);
        if first != "eu" {
            moved += 1;
        }
    }
    // Sessions spread over nodes (not all pinned to the local one).
    assert!(moved > 100, "{moved}");
    // Without a session id, the first block decides: same first block, same target.
    let a = HashChain::from_bytes(&[vec![b'q'; 256], vec![b'1'; 1000]].concat(), 256, 4);
    let b = HashChain::from_bytes(&[vec![b'q'; 256], vec![b'2'; 3000]].concat(), 256, 4);
    let cands: Vec<Candidate> = names
        .iter()
        .enumerate()
        .map(|(i, n)| cand(n, i == 0, 10.0))
        .collect();
    let ra = RouteRequest {
        chain: &a,
        prompt_tokens: a.total_tokens(),
        session_key: None,
    };
    let rb = RouteRequest {
        chain: &b,
        prompt_tokens: b.total_tokens(),
        session_key: None,
    };
    assert_eq!(
        target(PolicyKind::SessionAffinity, &ra, &cands),
        target(PolicyKind::SessionAffinity, &rb, &cands)
    );
}

#[test]
fn simple_session_affinity_hashes_the_first_256_tokens() {
    let names = ["eu", "us", "ap"];
    let cands: Vec<Candidate> = names
        .iter()
        .enumerate()
        .map(|(i, n)| cand(n, i == 0, 10.0))
        .collect();
    let mut targets = std::collections::HashSet::new();
    for s in 0..50u8 {
        // 1024 shared bytes = 256 tokens; what follows must not matter.
        let head = vec![s; 1024];
        let a = HashChain::from_bytes(&[head.clone(), vec![1; 500]].concat(), 256, 4);
        let b = HashChain::from_bytes(&[head, vec![2; 9000]].concat(), 256, 4);
        let ra = RouteRequest {
            chain: &a,
            prompt_tokens: a.total_tokens(),
            session_key: Some(1),
        };
        let rb = RouteRequest {
            chain: &b,
            prompt_tokens: b.total_tokens(),
            session_key: Some(2),
        };
        let ta = target(PolicyKind::SimpleSessionAffinity, &ra, &cands);
        assert_eq!(ta, target(PolicyKind::SimpleSessionAffinity, &rb, &cands));
        let reversed: Vec<Candidate> = cands.iter().rev().cloned().collect();
        assert_eq!(
            ta,
            target(PolicyKind::SimpleSessionAffinity, &ra, &reversed)
        );
        targets.insert(ta);
    }
    assert_eq!(targets.len(), 3);
}

#[test]
fn round_robin_random_local_only_oracle() {
    let chain = chain_of(100);
    let req = RouteRequest {
        chain: &chain,
        prompt_tokens: 100,
        session_key: None,
    };
    let mut cands: Vec<Candidate> = (0..4)
        .map(|i| cand(&format!("n{i}"), i == 1, 30.0))
        .collect();
    cands[2].healthy = false;
    let mut rr = build(PolicyKind::RoundRobin);
    let picks: Vec<_> = (0..6)
        .map(|_| {
            rr.choose(&req, &cands, Weights::default(), 0)
                .index
                .unwrap()
        })
        .collect();
    assert_eq!(picks, vec![0, 1, 3, 0, 1, 3]);
    let mut random = build(PolicyKind::Random);
    let mut seen = [0usize; 4];
    for r in 0..300u64 {
        let i = random
            .choose(
                &req,
                &cands,
                Weights::default(),
                r.wrapping_mul(0x9e37_79b9_7f4a_7c15),
            )
            .index
            .unwrap();
        seen[i] += 1;
    }
    assert_eq!(seen[2], 0);
    assert!(seen[0] > 50 && seen[1] > 50 && seen[3] > 50, "{seen:?}");
    assert_eq!(choose(PolicyKind::LocalOnly, &req, &cands, 0), Some(1));
    cands[0].cached_tokens = 100;
    cands[0].rtt_ms = 1.0;
    assert_eq!(
        choose(PolicyKind::Oracle, &req, &cands, 0),
        choose(PolicyKind::Gorgo, &req, &cands, 0)
    );
}

#[test]
fn gorgo_paper_uses_mixed_units() {
    let chain = chain_of(1000);
    let req = RouteRequest {
        chain: &chain,
        prompt_tokens: 1000,
        session_key: None,
    };
    let mut local = cand("a", true, 0.0);
    local.stats.queued_prompt_tokens = 900;
    let mut peer = cand("b", false, 90.0);
    peer.cached_tokens = 500;
    let w = Weights {
        w_rtt: 0.276,
        w_queue: 0.5,
    };
    let mut p = build(PolicyKind::GorgoPaper);
    let c = p.choose(&req, &[local, peer], w, 0);
    let t = c.terms.unwrap();
    // local: 1000 + 0.5 * 900 = 1450; peer: 0.276 * 90 + 500 = 524.84.
    assert!((t[0].total_ms - 1450.0).abs() < 1e-9);
    assert!((t[1].total_ms - 524.84).abs() < 1e-9);
    assert_eq!(c.index, Some(1));
}

/// `gorgo-paper` counts its own forwards since a peer's stats in that peer's queued
/// tokens at their raw prompt tokens, as the stats count the requests dispatched
/// there; it counted their prefill tokens (the uncached part, what `gorgo` counts), so
/// a forward to a peer caching most of its prompt hardly counted. `gorgo` still counts
/// their prefill.
#[test]
fn gorgo_paper_counts_its_forwards_at_their_raw_prompt_tokens() {
    let chain = chain_of(1000);
    let req = RouteRequest {
        chain: &chain,
        prompt_tokens: 1000,
        session_key: None,
    };
    let peer = NodeId::from("b");
    let mut ledger = ForwardLedger::new();
    // Two forwards of 4,000-token prompts, 3,500 of each cached at the peer.
    ledger.record_forward(&peer, 0, 500, 4000, 10);
    ledger.record_forward(&peer, 0, 500, 4000, 20);
    let mut c = cand("b", false, 90.0);
    c.stats.queued_prompt_tokens = 2000;
    ledger.apply(&mut c, 30);
    assert_eq!(
        (
            c.inflight_forward_prompt_tokens,
            c.inflight_forward_raw_prompt_tokens
        ),
        (1000, 8000)
    );
    let w = PolicyKind::GorgoPaper.default_weights();
    let t = build(PolicyKind::GorgoPaper)
        .terms(&req, std::slice::from_ref(&c), w)
        .unwrap()[0];
    assert_eq!(t.tokens_ahead, 10_000);
    assert!((t.queue_ms - 0.5 * 10_000.0).abs() < 1e-9, "{t:?}");
    let g = cost_terms(1000, &c, Weights::default(), 1000);
    assert_eq!(g.tokens_ahead, 1000);
    // A refused forward leaves both counts.
    ledger.cancel_forward(&peer, 0, 500, 4000, 10);
    ledger.apply(&mut c, 30);
    assert_eq!(
        (
            c.inflight_forward_prompt_tokens,
            c.inflight_forward_raw_prompt_tokens
        ),
        (500, 4000)
    );
}

/// `gorgo-paper` predicts with the `gorgo` model, forward bias included, as `gorgo`
/// does; its unbiased prediction, what the forward ledger learns from, holds no bias
/// (it held it: the ledger then chased its own value).
#[test]
fn gorgo_papers_unbiased_prediction_holds_no_forward_bias() {
    let chain = chain_of(1000);
    let req = RouteRequest {
        chain: &chain,
        prompt_tokens: 1000,
        session_key: None,
    };
    let mut c = Candidate::idle("b", false, 10.0);
    c.stats.t_p_ms = 0.1;
    c.stats.unfinished_prefill_tokens = 1000;
    let w = PolicyKind::GorgoPaper.default_weights();
    let p = build(PolicyKind::GorgoPaper);
    let unbiased = p.terms(&req, std::slice::from_ref(&c), w).unwrap()[0];
    c.forward_bias_ms = 1000.0;
    let biased = p.terms(&req, std::slice::from_ref(&c), w).unwrap()[0];
    assert_eq!(biased.estimated_ttft_ms, Some(1210.0));
    assert_eq!(biased.forward_bias_ms, 1000.0);
    assert_eq!(
        biased.unbiased_estimated_ttft_ms(),
        unbiased.unbiased_estimated_ttft_ms()
    );
    assert_eq!(unbiased.unbiased_estimated_ttft_ms(), Some(210.0));
    // A negative bias never takes the queue below 0 (as in `gorgo`'s terms).
    c.forward_bias_ms = -1e6;
    let fast = p.terms(&req, std::slice::from_ref(&c), w).unwrap()[0];
    assert_eq!(fast.estimated_ttft_ms, Some(110.0));
    assert_eq!(fast.unbiased_estimated_ttft_ms(), Some(210.0));
    // The score itself never held the bias.
    assert_eq!(biased.total_ms, unbiased.total_ms);
}

/// In closed loop (predicting with the bias learnt so far, learning from the
/// prediction without it), `gorgo-paper`'s forwards that always land 1 s late teach
/// the whole second, as `gorgo`'s do (it settled at half).
#[test]
fn gorgo_papers_forward_bias_learns_the_whole_lateness() {
    let chain = chain_of(1000);
    let req = RouteRequest {
        chain: &chain,
        prompt_tokens: 1000,
        session_key: None,
    };
    let p = build(PolicyKind::GorgoPaper);
    let w = PolicyKind::GorgoPaper.default_weights();
    let mut ledger = ForwardLedger::new();
    let mut c = Candidate::idle("b", false, 10.0);
    c.stats.t_p_ms = 0.1;
    for i in 0..200u64 {
        ledger.apply(&mut c, i * 10);
        let t = p.terms(&req, std::slice::from_ref(&c), w).unwrap()[0];
        let truth = cost_terms(
            1000,
            &Candidate {
                forward_bias_ms: 0.0,
                ..c.clone()
            },
            Weights::default(),
            1000,
        )
        .estimated_ttft_ms
        .unwrap();
        let unbiased = t.unbiased_estimated_ttft_ms().unwrap();
        ledger.observe_forward_ttft(&c.node, 0, unbiased, truth + 1000.0, i * 10);
    }
    let bias = ledger.forward_bias_ms(&"b".into(), 0, 2000);
    assert!((bias - 1000.0).abs() < 50.0, "{bias}");
}

/// With `w_queue = 0` (an operator's choice to ignore the term), a peer whose queue
/// prices to infinity (a gossiped `t_p_ms` of 1e306) has a NaN total; it is never
/// preferred over a candidate with a finite one (`f64::total_cmp` put x86-64's
/// negative NaN before every number, and the peer won).
#[test]
fn a_total_that_cannot_be_priced_never_wins() {
    let chain = HashChain::default();
    let req = RouteRequest {
        chain: &chain,
        prompt_tokens: 100,
        session_key: None,
    };
    let mut local = Candidate::idle("a", true, 0.0);
    local.stats.t_p_ms = 0.1;
    local.stats.unfinished_prefill_tokens = 1_000_000;
    let mut peer = Candidate::idle("b", false, 10.0);
    peer.stats.t_p_ms = 1e306;
    peer.stats.unfinished_prefill_tokens = 1000;
    peer.cached_tokens = 100;
    let w = Weights {
        w_rtt: 1.0,
        w_queue: 0.0,
    };
    assert!(cost_terms(100, &peer, w, 0).total_ms.is_nan());
    let cands = [local, peer];
    for kind in [PolicyKind::Gorgo, PolicyKind::GorgoTtft, PolicyKind::Oracle] {
        for rng in 0..4 {
            let mut p = build(kind);
            let d = decide(&req, 0, 1, &cands, p.as_mut(), w, rng).unwrap();
            assert_eq!(d.target.0, "a", "{kind}");
        }
    }
    // The peer alone is still chosen (it is healthy; the total is only unknown).
    let mut p = build(PolicyKind::Gorgo);
    let d = decide(&req, 0, 1, &cands[1..], p.as_mut(), w, 0).unwrap();
    assert_eq!(d.target.0, "b");
}

/// Candidate `i` of a list whose first `locals` are the deciding node's engines
/// (node `n0`, replicas 0..locals) and the rest one engine of a peer each.
fn arb_candidate(i: usize, locals: usize) -> impl Strategy<Value = Candidate> {
    (
        any::<bool>(),
        prop_oneof![Just(f64::NAN), 0.0..500.0f64],
        0u64..20_000,
        0u64..50_000,
        0u32..100,
        0u32..50,
        0u64..200_000,
        0u32..20,
    )
        .prop_map(
            move |(healthy, rtt, cached, unfinished, running, waiting, kv, fwd)| {
                let local = i < locals;
                let name = if local {
                    "n0".to_owned()
                } else {
                    format!("n{i}")
                };
                let mut c = cand(&name, local, rtt);
                if local {
                    c.stats.replica = i as u16;
                }
                c.healthy = healthy;
                c.cached_tokens = cached;
                c.stats.unfinished_prefill_tokens = unfinished;
                c.stats.running = running;
                c.stats.waiting = waiting;
                c.stats.kv_used_tokens = kv;
                c.stats.decode_step_ms = 20.0;
                c.inflight_forwards = fwd;
                c.inflight_forward_prompt_tokens = fwd as u64 * 100;
                c
            },
        )
}

/// One to seven candidates, of which one to three are local engines.
fn arb_candidates() -> impl Strategy<Value = Vec<Candidate>> {
    (1usize..8, 1usize..4).prop_flat_map(|(n, locals)| {
        let locals = locals.min(n);
        (0..n).map(|i| arb_candidate(i, locals)).collect::<Vec<_>>()
    })
}

proptest! {
    #[test]
    fn max_hops_is_never_exceeded_and_unhealthy_never_chosen(
        cands in arb_candidates(),
        hops in 0u8..4,
        max_hops in 0u8..3,
        prompt in 1u64..20_000,
        policy in 0usize..PolicyKind::ALL.len(),
        rng in any::<u64>(),
        w_rtt in 0.05..4.0f64,
        w_queue in 0.05..4.0f64,
    ) {
        let kind = PolicyKind::ALL[policy];
        let chain = chain_of(prompt.min(2000));
        let req = RouteRequest { chain: &chain, prompt_tokens: prompt, session_key: None };
        let mut p = build(kind);
        let w = Weights { w_rtt, w_queue };
        match decide(&req, hops, max_hops, &cands, p.as_mut(), w, rng) {
            Ok(d) => {
                let chosen = &cands[d.target_index];
                prop_assert!(chosen.healthy);
                prop_assert_eq!(&chosen.node, &d.target);
                // Forwarding adds a hop (hops + 1): it must never exceed max_hops.
                if !d.is_local {
                    prop_assert!(hops < max_hops);
                }
                if hops >= max_hops {
                    prop_assert!(d.is_local);
                    prop_assert_eq!(d.reason, DecisionReason::MaxHops);
                }
                prop_assert_eq!(d.candidates.iter().filter(|c| c.chosen).count(), 1);
            }
            Err(e) => {
                let local_ok = cands.iter().any(|c| c.is_local && c.healthy);
                let any_ok = cands.iter().any(|c| c.healthy);
                match e.reason {
                    NoCandidateReason::NoneHealthy => prop_assert!(!any_ok),
                    NoCandidateReason::LocalUnhealthyAtMaxHops => prop_assert!(hops >= max_hops && !local_ok),
                    NoCandidateReason::PolicyDeclined => prop_assert!(kind == PolicyKind::LocalOnly && !local_ok),
                }
            }
        }
    }
}

/// A figure as a broken or hostile peer might gossip it.
fn garbage_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(f64::NAN),
        Just(f64::INFINITY),
        Just(-1.0),
        Just(1e306),
        Just(f64::MAX),
        0.0..1.0f64,
    ]
}

fn garbage_u64() -> impl Strategy<Value = u64> {
    prop_oneof![Just(u64::MAX), any::<u64>(), 0u64..50_000]
}

fn garbage_u32() -> impl Strategy<Value = u32> {
    prop_oneof![Just(u32::MAX), 0u32..100]
}

/// Candidate `i` (local for `i == 0`) with any gauges and figures at all.
fn arb_garbage_candidate(i: usize) -> impl Strategy<Value = Candidate> {
    (
        (
            any::<bool>(),
            prop_oneof![Just(f64::NAN), Just(f64::INFINITY), 0.0..500.0f64],
            garbage_u64(),
            garbage_u64(),
            garbage_u64(),
            garbage_u64(),
        ),
        (
            garbage_u32(),
            garbage_u32(),
            garbage_u32(),
            garbage_u64(),
            garbage_u32(),
        ),
        (
            garbage_f64(),
            garbage_f64(),
            garbage_f64(),
            garbage_f64(),
            garbage_f64(),
            prop::option::of(garbage_u32()),
        ),
    )
        .prop_map(
            move |(
                (healthy, rtt, cached, unfinished, kv, queued),
                (running, waiting, fwd, fwd_tokens, deciders),
                (t_p, base, step, decode, bias, slots),
            )| {
                let mut c = Candidate::idle(format!("n{i}").as_str(), i == 0, rtt);
                c.healthy = healthy;
                c.cached_tokens = cached;
                c.stats.unfinished_prefill_tokens = unfinished;
                c.stats.kv_used_tokens = kv;
                c.stats.queued_prompt_tokens = queued;
                c.stats.running = running;
                c.stats.waiting = waiting;
                c.inflight_forwards = fwd;
                c.inflight_forward_prompt_tokens = fwd_tokens;
                c.deciders = deciders;
                c.stats.t_p_ms = t_p;
                c.stats.base_ms = base;
                c.stats.decode_step_ms = step;
                c.forward_bias_ms = bias;
                c.stats.slots = slots.map(|max_running| gorgo_core::EngineSlots {
                    max_running,
                    decode_ms: decode,
                });
                c
            },
        )
}

proptest! {
    /// Whatever the candidates' gauges and figures (a peer's gossip is not trusted:
    /// gauges at their maximum, a `t_p` of 1e306, NaN) and whatever the weights (0
    /// included), no policy panics or picks an unhealthy candidate, and a cost-based
    /// one never prefers a candidate it cannot price (a NaN or infinite total) over one
    /// it can.
    #[test]
    fn garbage_gauges_neither_panic_nor_win(
        cands in (1usize..6).prop_flat_map(|n| (0..n).map(arb_garbage_candidate).collect::<Vec<_>>()),
        prompt in prop_oneof![Just(u64::MAX), 1u64..20_000],
        policy in 0usize..PolicyKind::ALL.len(),
        rng in any::<u64>(),
        w_rtt in prop_oneof![Just(0.0), 0.05..4.0f64],
        w_queue in prop_oneof![Just(0.0), 0.05..4.0f64],
    ) {
        let kind = PolicyKind::ALL[policy];
        let chain = chain_of(prompt.min(2000));
        let req = RouteRequest { chain: &chain, prompt_tokens: prompt, session_key: None };
        let mut p = build(kind);
        let w = Weights { w_rtt, w_queue };
        let Ok(d) = decide(&req, 0, 1, &cands, p.as_mut(), w, rng) else {
            return Ok(());
        };
        prop_assert!(cands[d.target_index].healthy);
        let total = |i: usize| d.candidates[i].terms.map(|t| t.total_ms);
        let priceable = (0..cands.len()).any(|i| {
            cands[i].healthy && total(i).is_some_and(f64::is_finite)
        });
        if priceable && d.reason != DecisionReason::PolicyFallback {
            let chosen = total(d.target_index).unwrap();
            prop_assert!(chosen.is_finite(), "{kind} chose a total of {chosen}: {d:?}");
        }
    }
}

/// An offer as a forwarding node makes it; any cost, even one `ForwardOffer::new` would
/// refuse to build, to test the check itself.
fn offer(cost_ms: f64, weights: Weights, policy: PolicyKind) -> ForwardOffer {
    ForwardOffer {
        cost_ms,
        weights,
        policy,
    }
}

/// The target of a forward: itself (busy or idle) and the forwarding node as a peer.
fn at_target(local_prefill_ahead: u64) -> Vec<Candidate> {
    let mut local = cand("b-target", true, 0.0);
    local.stats.unfinished_prefill_tokens = local_prefill_ahead;
    local.stats.running = 4;
    let origin = cand("a-origin", false, 80.0);
    vec![local, origin]
}

/// `refuse_forward` of a 2,000-token prompt at `cands`, under a fresh `kind`, against
/// an offer of `cost_ms` priced with `weights` under the same policy.
fn refusal(
    kind: PolicyKind,
    cands: &[Candidate],
    cost_ms: f64,
    weights: Weights,
) -> Option<(Refusal, Vec<CandidateExplain>)> {
    let chain = chain_of(2000);
    let req = RouteRequest {
        chain: &chain,
        prompt_tokens: 2000,
        session_key: None,
    };
    let p = build(kind);
    refuse_forward(&req, cands, p.as_ref(), &offer(cost_ms, weights, kind))
}

/// A target with two engines, one it cannot price (a NaN total: `w_queue = 0` times a
/// queue that prices to infinity), serves on the one it can: that engine's cost is what
/// it compares with the offer. (`f64::total_cmp` took x86-64's negative NaN for the
/// cheapest, and every forward was refused.)
#[test]
fn a_target_prices_itself_by_an_engine_it_can_price() {
    let w = Weights {
        w_rtt: 1.0,
        w_queue: 0.0,
    };
    let mut broken = cand("b-target", true, 0.0);
    broken.stats.t_p_ms = 1e306;
    broken.stats.unfinished_prefill_tokens = 1000;
    broken.cached_tokens = 2000;
    let mut idle = cand("b-target", true, 0.0);
    idle.stats.replica = 1;
    let cands = [broken, idle, cand("a-origin", false, 80.0)];
    let fewest = fewest_uncached_tokens(2000, &cands);
    assert!(cost_terms(2000, &cands[0], w, fewest).total_ms.is_nan());
    // The idle engine: 2,000 tokens of prefill, 188 ms, under the origin's 500.
    assert_eq!(refusal(PolicyKind::Gorgo, &cands, 500.0, w), None);
    // Nothing it can price: the offer's finite cost is the cheaper.
    assert!(refusal(PolicyKind::Gorgo, &cands[..1], 500.0, w).is_some());
}

#[test]
fn a_forward_is_refused_only_when_serving_it_costs_more_than_at_its_origin() {
    let w = Weights::default();
    let gorgo = PolicyKind::Gorgo;
    // Idle target: 2,000 tokens of prefill, 188 ms; the origin said 500 ms.
    assert_eq!(refusal(gorgo, &at_target(0), 500.0, w), None);
    // 20,000 tokens ahead at the target (about 1.9 s): refused, with its figures.
    let busy = at_target(20_000);
    let (r, explained) = refusal(gorgo, &busy, 500.0, w).expect("refused");
    assert_eq!(explained.len(), busy.len());
    assert!(explained.iter().all(|c| !c.chosen && c.terms.is_some()));
    let fewest = fewest_uncached_tokens(2000, &busy);
    let expected = cost_terms(2000, &busy[0], w, fewest).total_ms;
    assert!((r.local_cost_ms - expected).abs() < 1e-9, "{r:?}");
    assert!(r.local_cost_ms > 500.0 * (1.0 + REFUSAL_MARGIN));
    assert_eq!(r.origin_cost_ms, 500.0);
    // Dearer here, but within the cost model's noise of the offer: served.
    let near = r.local_cost_ms / (1.0 + REFUSAL_MARGIN / 2.0);
    assert_eq!(refusal(gorgo, &busy, near, w), None);
    assert!(
        r.local_estimated_ttft_ms.is_some_and(|t| t > 1000.0),
        "{r:?}"
    );
    // The same forward against a dearer origin is served.
    assert_eq!(refusal(gorgo, &busy, 1e9, w), None);
}

#[test]
fn only_the_millisecond_policies_refuse_and_never_without_a_usable_offer() {
    let busy = at_target(20_000);
    for kind in PolicyKind::ALL {
        let refused = refusal(kind, &busy, 1.0, kind.default_weights());
        let refuses = matches!(kind, PolicyKind::Gorgo | PolicyKind::GorgoTtft);
        assert_eq!(refused.is_some(), refuses, "{kind}");
    }
    let w = Weights::default();
    for bad in [f64::NAN, f64::INFINITY] {
        assert_eq!(refusal(PolicyKind::Gorgo, &busy, bad, w), None);
    }
    // With its own engine down the target does not refuse: the decision says 503.
    let mut down = busy.clone();
    down[0].healthy = false;
    assert_eq!(refusal(PolicyKind::Gorgo, &down, 1.0, w), None);
    // An offer priced by another policy is not compared: `gorgo-ttft`'s total has no
    // stall term, so a `gorgo` target would find its own dearer and refuse it wrongly.
    let chain = chain_of(2000);
    let req = RouteRequest {
        chain: &chain,
        prompt_tokens: 2000,
        session_key: None,
    };
    let p = build(PolicyKind::Gorgo);
    let ttft_offer = offer(1.0, w, PolicyKind::GorgoTtft);
    assert_eq!(refuse_forward(&req, &busy, p.as_ref(), &ttft_offer), None);
    let same = offer(1.0, w, PolicyKind::Gorgo);
    assert!(refuse_forward(&req, &busy, p.as_ref(), &same).is_some());
}

#[test]
fn the_target_prices_its_cost_with_the_offers_weights_and_garbage_offers_are_dropped() {
    let busy = at_target(20_000);
    let light = Weights {
        w_rtt: 1.0,
        w_queue: 0.05,
    };
    // The same offer: refused when the queue weighs fully, served when it barely counts.
    assert!(refusal(PolicyKind::Gorgo, &busy, 500.0, Weights::default()).is_some());
    assert_eq!(refusal(PolicyKind::Gorgo, &busy, 500.0, light), None);
    let w = Weights::default();
    assert!(ForwardOffer::new(500.0, w, PolicyKind::Gorgo).is_some());
    assert!(ForwardOffer::new(0.0, w, PolicyKind::Gorgo).is_some());
    for cost in [f64::NAN, f64::INFINITY, -1.0] {
        assert_eq!(
            ForwardOffer::new(cost, w, PolicyKind::Gorgo),
            None,
            "{cost}"
        );
    }
    // Past what `routing.weights` allows too: a `w_queue` of 1e300 priced any queue
    // here past every offer, refusing all of that peer's forwards.
    for bad in [-1.0, f64::NAN, f64::INFINITY, 1e300, MAX_WEIGHT + 1.0] {
        let weights = Weights {
            w_rtt: 1.0,
            w_queue: bad,
        };
        assert_eq!(
            ForwardOffer::new(500.0, weights, PolicyKind::Gorgo),
            None,
            "{bad}"
        );
    }
    // A weight of 0 (the operator ignores a term) still makes an offer: refusals do
    // not stop silently.
    let no_rtt = Weights {
        w_rtt: 0.0,
        w_queue: 1.0,
    };
    assert!(ForwardOffer::new(500.0, no_rtt, PolicyKind::Gorgo).is_some());
}

#[test]
fn a_refused_forward_no_longer_counts_as_pending() {
    let mut ledger = ForwardLedger::new();
    let peer = "b".into();
    ledger.record_forward(&peer, 0, 1000, 1000, 10);
    ledger.record_forward(&peer, 0, 500, 500, 20);
    ledger.cancel_forward(&peer, 0, 1000, 1000, 10);
    assert_eq!(ledger.pending(&peer, 0), (1, 500));
    // Unknown forwards and peers change nothing.
    ledger.cancel_forward(&peer, 0, 1000, 1000, 10);
    ledger.cancel_forward(&"c".into(), 0, 500, 500, 20);
    assert_eq!(ledger.pending(&peer, 0), (1, 500));
}

proptest! {
    #[test]
    fn a_forward_is_refused_exactly_when_the_local_cost_exceeds_the_offer(
        cands in arb_candidates(),
        prompt in 1u64..20_000,
        cost in 0.0..20_000.0f64,
        w_rtt in 0.05..4.0f64,
        w_queue in 0.05..4.0f64,
    ) {
        let chain = chain_of(prompt.min(2000));
        let req = RouteRequest { chain: &chain, prompt_tokens: prompt, session_key: None };
        let w = Weights { w_rtt, w_queue };
        let p = build(PolicyKind::Gorgo);
        let refused = refuse_forward(&req, &cands, p.as_ref(), &offer(cost, w, PolicyKind::Gorgo)).map(|(r, _)| r);
        // The target serves on its cheapest local engine.
        let fewest = fewest_uncached_tokens(prompt, &cands);
        let cheapest = cands
            .iter()
            .filter(|c| c.is_local && c.healthy)
            .map(|c| cost_terms(prompt, c, w, fewest).total_ms)
            .min_by(f64::total_cmp);
        match cheapest {
            None => prop_assert!(refused.is_none()),
            Some(local) => {
                prop_assert_eq!(refused.is_some(), local > cost * (1.0 + REFUSAL_MARGIN));
                if let Some(r) = refused {
                    prop_assert!(r.local_cost_ms > r.origin_cost_ms);
                }
            }
        }
    }
}

/// A request for all of `chain`, with no session.
fn no_session(chain: &HashChain) -> RouteRequest<'_> {
    RouteRequest {
        chain,
        prompt_tokens: chain.total_tokens(),
        session_key: None,
    }
}

/// A node fronting two engines and a peer fronting two: a request for the node.
fn two_engines_each() -> Vec<Candidate> {
    let engine = |node: &str, local: bool, replica: u16, rtt: f64| {
        let mut c = cand(node, local, rtt);
        c.stats.replica = replica;
        c
    };
    vec![
        engine("a", true, 0, 0.0),
        engine("a", true, 1, 0.0),
        engine("b", false, 0, 30.0),
        engine("b", false, 1, 30.0),
    ]
}

#[test]
fn at_max_hops_the_policy_picks_among_the_local_engines_only() {
    let chain = chain_of(2000);
    let req = no_session(&chain);
    let mut cands = two_engines_each();
    // Engine 0 is busy, engine 1 idle; the peer's engines hold the whole prompt.
    cands[0].stats.unfinished_prefill_tokens = 30_000;
    cands[0].stats.running = 8;
    cands[2].cached_tokens = 2000;
    cands[3].cached_tokens = 2000;
    let mut p = build(PolicyKind::Gorgo);
    let w = Weights::default();
    // Free to forward: the peer's cache wins.
    let d = decide(&req, 0, 1, &cands, p.as_mut(), w, 1).unwrap();
    assert!(!d.is_local, "{d:?}");
    // At max hops: served here, on the idle engine, priced by the policy.
    let d = decide(&req, 1, 1, &cands, p.as_mut(), w, 1).unwrap();
    assert_eq!(d.reason, DecisionReason::MaxHops);
    assert_eq!((d.target_index, d.target_replica), (1, 1));
    assert!(d.candidates[..2].iter().all(|c| c.terms.is_some()));
    assert!(d.candidates[2..].iter().all(|c| c.terms.is_none()));
    // A local engine down leaves the other, even the busy one.
    cands[1].healthy = false;
    let d = decide(&req, 1, 1, &cands, p.as_mut(), w, 1).unwrap();
    assert_eq!(d.target_index, 0);
    // The cheapest local engine is what a forward offers.
    cands[1].healthy = true;
    let d = decide(&req, 0, 1, &cands, p.as_mut(), w, 1).unwrap();
    let idle = d.candidates[1].terms.unwrap().total_ms;
    assert_eq!(d.local_cost_ms(), Some(idle));
    assert!(idle < d.candidates[0].terms.unwrap().total_ms);
    // And what the node predicts once it serves it itself: that engine's estimate,
    // not the chosen peer's.
    let own = d.candidates[1].terms.unwrap().estimated_ttft_ms;
    assert_eq!(d.local_estimated_ttft_ms(), own);
    assert_ne!(
        own,
        d.candidates[d.target_index]
            .terms
            .unwrap()
            .estimated_ttft_ms
    );
}

/// At max hops a node with one engine has nothing to choose, but its decision still
/// prices that engine, as one with several prices them among themselves: every
/// forward a peer serves used to be logged without terms (and an operator could not
/// see what serving it here cost). The peers, which it cannot go to, stay unpriced.
#[test]
fn at_max_hops_a_single_local_engine_is_priced() {
    let chain = chain_of(2000);
    let req = no_session(&chain);
    let mut cands = two_engines_each();
    cands[1].healthy = false;
    let w = Weights::default();
    for kind in [
        PolicyKind::Gorgo,
        PolicyKind::GorgoTtft,
        PolicyKind::GorgoPaper,
    ] {
        let mut p = build(kind);
        let d = decide(&req, 1, 1, &cands, p.as_mut(), w, 1).unwrap();
        assert_eq!((d.reason, d.target_index), (DecisionReason::MaxHops, 0));
        let terms = d.candidates[0].terms.expect("the local engine is priced");
        assert!(
            terms.total_ms.is_finite() && terms.total_ms > 0.0,
            "{kind}: {terms:?}"
        );
        assert_eq!(d.local_cost_ms(), Some(terms.total_ms));
        assert!(
            d.candidates[1..].iter().all(|c| c.terms.is_none()),
            "{kind}"
        );
    }
    // A policy that does not price candidates has no terms to show.
    let mut p = build(PolicyKind::RoundRobin);
    let d = decide(&req, 1, 1, &cands, p.as_mut(), w, 1).unwrap();
    assert!(d.candidates.iter().all(|c| c.terms.is_none()));
}

/// A decision with no healthy candidate still shows what each would have cost, under
/// the policies that price them.
#[test]
fn none_healthy_decisions_keep_their_terms() {
    let chain = chain_of(2000);
    let req = no_session(&chain);
    let mut cands = two_engines_each();
    for c in &mut cands {
        c.healthy = false;
    }
    let mut p = build(PolicyKind::Gorgo);
    let err = decide(&req, 0, 1, &cands, p.as_mut(), Weights::default(), 1).unwrap_err();
    assert_eq!(err.reason, NoCandidateReason::NoneHealthy);
    assert!(err.candidates.iter().all(|c| c.terms.is_some()), "{err:?}");
}

#[test]
fn a_forward_is_refused_only_when_every_local_engine_costs_more() {
    let w = Weights::default();
    let mut cands = two_engines_each();
    cands[0].stats.unfinished_prefill_tokens = 30_000;
    // Engine 1 idle: 2,000 tokens of prefill (188 ms) against an offer of 500 ms.
    assert_eq!(refusal(PolicyKind::Gorgo, &cands, 500.0, w), None);
    cands[1].stats.unfinished_prefill_tokens = 30_000;
    assert!(refusal(PolicyKind::Gorgo, &cands, 500.0, w).is_some());
}

#[test]
fn engines_of_one_node_are_candidates_like_any_other() {
    let chain = chain_of(2000);
    let req = no_session(&chain);
    // Tied local engines: each is drawn, and a tied peer never is.
    let mut cands = two_engines_each();
    cands[2].rtt_ms = 0.0;
    cands[3].rtt_ms = 0.0;
    let totals: Vec<f64> = cands
        .iter()
        .map(|c| cost_terms(2000, c, Weights::default(), 2000).total_ms)
        .collect();
    assert!(totals.iter().all(|t| *t == totals[0]), "{totals:?}");
    let mut picked = [0u32; 4];
    for rng in 0..64 {
        picked[choose(PolicyKind::Gorgo, &req, &cands, rng).unwrap()] += 1;
    }
    assert!(
        picked[0] > 0 && picked[1] > 0 && picked[2] + picked[3] == 0,
        "{picked:?}"
    );
    // local-only: the local engine with the fewest requests.
    let mut cands = two_engines_each();
    cands[0].stats.running = 3;
    assert_eq!(choose(PolicyKind::LocalOnly, &req, &cands, 0), Some(1));
    // round-robin cycles over every engine of every node.
    let mut p = build(PolicyKind::RoundRobin);
    let seen: std::collections::HashSet<usize> = (0..8)
        .filter_map(|r| p.choose(&req, &cands, Weights::default(), r).index)
        .collect();
    assert_eq!(seen.len(), 4);
    // session-affinity spreads sessions over a node's engines too.
    let engines: std::collections::HashSet<usize> = (0..64u64)
        .filter_map(|k| {
            let req = RouteRequest {
                chain: &chain,
                prompt_tokens: 2000,
                session_key: Some(k.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
            };
            choose(PolicyKind::SessionAffinity, &req, &cands, 0)
        })
        .collect();
    assert_eq!(engines.len(), 4, "{engines:?}");
}

/// Three engines whose queues the cost model prices within a few percent of each
/// other (a loaded cluster: seconds of prefill ahead everywhere).
fn three_loaded_engines() -> Vec<Candidate> {
    ["a", "b", "c"]
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let mut c = cand(name, i == 0, 0.0);
            c.stats.replica = i as u16;
            c.stats.unfinished_prefill_tokens = 100_000 + 2_000 * i as u64;
            c
        })
        .collect()
}

/// A gorgo policy that has seen `warm` decisions of distinct one-off keys, so that a
/// key decided next is a session's, not the whole traffic's.
fn warmed_gorgo(cands: &[Candidate], warm: u64) -> Box<dyn gorgo_core::policy::Policy> {
    let mut p = build(PolicyKind::Gorgo);
    let chain = chain_of(1000);
    for k in 0..warm {
        let req = RouteRequest {
            chain: &chain,
            prompt_tokens: 1000,
            session_key: Some(1_000_000 + k),
        };
        p.choose(&req, cands, Weights::default(), 0);
    }
    p
}

fn session_home_of(req: &RouteRequest<'_>, cands: &[Candidate]) -> Option<usize> {
    choose(PolicyKind::SessionAffinity, req, cands, 0)
}

/// A 1,000-token request of session `key`.
fn of_session(chain: &HashChain, key: u64) -> RouteRequest<'_> {
    RouteRequest {
        chain,
        prompt_tokens: 1000,
        session_key: Some(key),
    }
}

/// A session key whose home is not candidate 0 (the cheapest in these cases).
fn key_homed_elsewhere(chain: &HashChain, cands: &[Candidate]) -> u64 {
    (0..1000u64)
        .find(|&k| session_home_of(&of_session(chain, k), cands) != Some(0))
        .expect("a key homed elsewhere")
}

#[test]
fn candidates_the_queue_estimate_cannot_tell_apart_go_to_the_sessions_home() {
    let cands = three_loaded_engines();
    let chain = chain_of(1000);
    let mut p = warmed_gorgo(&cands, 64);
    let mut homes_not_cheapest = 0;
    for key in 0..60u64 {
        let req = of_session(&chain, key);
        let choice = p.choose(&req, &cands, Weights::default(), 0);
        // The queues differ by 2% and 4%, inside the window: always the home.
        assert_eq!(choice.index, session_home_of(&req, &cands), "key {key}");
        assert_eq!(choice.session_home, choice.index != Some(0), "key {key}");
        homes_not_cheapest += usize::from(choice.session_home);
        let mut fresh = warmed_gorgo(&cands, 64);
        let d = decide(&req, 0, 1, &cands, fresh.as_mut(), Weights::default(), 0).unwrap();
        let want = if choice.session_home {
            DecisionReason::SessionHome
        } else {
            DecisionReason::Policy
        };
        assert_eq!(d.reason, want);
    }
    // Rendezvous spreads sessions over the three engines.
    assert!(
        (20..=60).contains(&homes_not_cheapest),
        "{homes_not_cheapest}"
    );
}

#[test]
fn a_cheaper_candidate_beyond_the_queue_error_or_an_idle_cluster_is_decided_by_cost() {
    let chain = chain_of(1000);
    // Beyond the window: the others' queues are 40% longer than the cheapest's.
    let mut cands = three_loaded_engines();
    cands[1].stats.unfinished_prefill_tokens = 140_000;
    cands[2].stats.unfinished_prefill_tokens = 140_000;
    let key = key_homed_elsewhere(&chain, &cands);
    let req = of_session(&chain, key);
    let mut p = warmed_gorgo(&cands, 64);
    let choice = p.choose(&req, &cands, Weights::default(), 0);
    assert_eq!((choice.index, choice.session_home), (Some(0), false));
    // Idle: no queue, no window; the local engine (a tie) serves.
    let idle: Vec<Candidate> = three_loaded_engines()
        .into_iter()
        .map(|mut c| {
            c.stats.unfinished_prefill_tokens = 0;
            c
        })
        .collect();
    let key = key_homed_elsewhere(&chain, &idle);
    let req = of_session(&chain, key);
    let mut p = warmed_gorgo(&idle, 64);
    let choice = p.choose(&req, &idle, Weights::default(), 0);
    assert_eq!((choice.index, choice.session_home), (Some(0), false));
}

#[test]
fn the_sessions_home_never_costs_a_visible_cache_hit() {
    let chain = chain_of(1000);
    let mut cands = three_loaded_engines();
    // The cheapest caches 200 tokens (saving 19 ms, well inside the window); the home
    // caches nothing.
    cands[0].cached_tokens = 200;
    let key = key_homed_elsewhere(&chain, &cands);
    let req = of_session(&chain, key);
    let mut p = warmed_gorgo(&cands, 64);
    assert_eq!(p.choose(&req, &cands, Weights::default(), 0).index, Some(0));
}

/// A forward's target prices the forward to weigh a refusal: that is no decision, and
/// does not count as one in the session table. (Counted, a session whose turns a node
/// kept being forwarded read as a prefix everyone shares and lost its home.)
#[test]
fn weighing_a_refusal_is_not_a_decision_for_the_session_table() {
    let cands = three_loaded_engines();
    let chain = chain_of(1000);
    let key = key_homed_elsewhere(&chain, &cands);
    let req = of_session(&chain, key);
    let mut p = warmed_gorgo(&cands, 64);
    for _ in 0..1000 {
        // An offer far above: never refused, only priced.
        let refused = refuse_forward(
            &req,
            &cands,
            p.as_ref(),
            &offer(1e9, Weights::default(), PolicyKind::Gorgo),
        );
        assert!(refused.is_none());
    }
    let choice = p.choose(&req, &cands, Weights::default(), 0);
    assert!(choice.session_home, "{choice:?}");
    assert_eq!(choice.index, session_home_of(&req, &cands));
}

#[test]
fn a_key_that_most_requests_share_is_no_session() {
    // Every other request carries key 7 (a system prompt every conversation starts
    // with, no session id): it would pin half the traffic to one engine. Its home is
    // not the cheapest, yet after a warm-up it is decided by cost alone, while the
    // one-off keys between are still homed.
    let cands = three_loaded_engines();
    let chain = chain_of(1000);
    let shared = key_homed_elsewhere(&chain, &cands);
    let mut p = build(PolicyKind::Gorgo);
    let mut shared_homed = 0;
    let mut others_homed = 0;
    for i in 0..10_000u64 {
        let key = if i % 2 == 0 { shared } else { 1_000_000 + i };
        let req = of_session(&chain, key);
        let choice = p.choose(&req, &cands, Weights::default(), 0);
        if i >= 100 {
            if key == shared {
                shared_homed += usize::from(choice.session_home);
            } else {
                others_homed += usize::from(choice.session_home);
            }
        }
    }
    assert_eq!(shared_homed, 0);
    assert!(others_homed > 2_000, "{others_homed}");
}

proptest! {
    /// Whatever the candidates and weights: `gorgo`'s pick costs at most the window
    /// more than the cheapest, caches no less than it, and is healthy; so it never
    /// costs more than the refusal margin over the cheapest, and a target does not
    /// refuse a session's home on the stats it was chosen by.
    #[test]
    fn the_sessions_home_stays_within_the_queue_error_of_the_cheapest(
        cands in arb_candidates(),
        keys in proptest::collection::vec(0u64..50, 1..40),
        prompt in 1u64..20_000,
        w_rtt in 0.05f64..4.0,
        w_queue in 0.05f64..4.0,
    ) {
        let chain = chain_of(prompt.min(2000));
        let mut p = build(PolicyKind::Gorgo);
        let weights = Weights { w_rtt, w_queue };
        let fewest = fewest_uncached_tokens(prompt, &cands);
        let terms: Vec<_> = cands
            .iter()
            .map(|c| cost_terms(prompt, c, weights, fewest))
            .collect();
        let cheapest = (0..cands.len())
            .filter(|&i| cands[i].healthy)
            .min_by(|&a, &b| terms[a].total_ms.total_cmp(&terms[b].total_ms));
        for key in keys {
            let req = RouteRequest { chain: &chain, prompt_tokens: prompt, session_key: Some(key) };
            let choice = p.choose(&req, &cands, weights, key);
            let Some(best) = cheapest else {
                prop_assert_eq!(choice.index, None);
                continue;
            };
            let i = choice.index.expect("a pick");
            prop_assert!(cands[i].healthy);
            let b = &terms[best];
            let window = gorgo_core::policy::SESSION_HOME_WINDOW * b.queue_ms.max(0.0);
            prop_assert!(terms[i].total_ms <= b.total_ms + window + 1e-9);
            prop_assert!(
                terms[i].total_ms
                    <= b.total_ms * (1.0 + gorgo_core::decision::REFUSAL_MARGIN) + 1e-9
            );
            prop_assert!(terms[i].cached_tokens >= b.cached_tokens || terms[i].total_ms == b.total_ms);
        }
    }
}
