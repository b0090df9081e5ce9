//! Fidelity of the engine model on virtual time: deterministic, no clocks.

use gorgo_core::HashChain;
use gorgo_engine::{Engine, EngineEvent, EngineRequest, Profile};
use proptest::prelude::*;

/// A prompt of `tokens` tokens (4 bytes each) whose bytes depend on `seed`.
fn prompt(seed: u64, tokens: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(tokens * 4);
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    while out.len() < tokens * 4 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push(b'a' + (x % 26) as u8);
    }
    out
}

fn request(id: u64, bytes: &[u8], out: u32, at: f64) -> EngineRequest {
    let chain = HashChain::from_bytes(bytes, 64, 4);
    EngineRequest {
        id,
        prompt_tokens: chain.total_tokens(),
        chain,
        max_output_tokens: out,
        arrival_ms: at,
    }
}

/// Drive `engine` until idle; returns every event.
fn drain(engine: &mut Engine) -> Vec<EngineEvent> {
    let mut events = Vec::new();
    while let Some(t) = engine.next_event_time() {
        engine.step_into(t, &mut events);
    }
    events
}

/// Submit `req` on an engine that is otherwise idle and run it to completion.
/// Returns (TTFT, cached tokens, finish time).
fn run_alone(engine: &mut Engine, req: EngineRequest) -> (f64, u64, f64) {
    let (id, at) = (req.id, req.arrival_ms);
    engine.submit(req, at).unwrap();
    let events = drain(engine);
    let mut first = None;
    let mut end = None;
    for e in events {
        match e {
            EngineEvent::FirstToken {
                id: i,
                at_ms,
                cached_tokens,
            } if i == id => first = Some((at_ms - at, cached_tokens)),
            EngineEvent::Finished { id: i, at_ms, .. } if i == id => end = Some(at_ms),
            _ => {}
        }
    }
    let (ttft, cached) = first.expect("first token");
    (ttft, cached, end.expect("finished"))
}

/// Least squares `y = a + b x`; returns (a, b, R^2).
fn fit(xs: &[f64], ys: &[f64]) -> (f64, f64, f64) {
    let n = xs.len() as f64;
    let mx = xs.iter().sum::<f64>() / n;
    let my = ys.iter().sum::<f64>() / n;
    let sxy: f64 = xs.iter().zip(ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let sxx: f64 = xs.iter().map(|x| (x - mx).powi(2)).sum();
    let b = sxy / sxx;
    let a = my - b * mx;
    let ss_res: f64 = xs
        .iter()
        .zip(ys)
        .map(|(x, y)| (y - a - b * x).powi(2))
        .sum();
    let ss_tot: f64 = ys.iter().map(|y| (y - my).powi(2)).sum();
    (a, b, 1.0 - ss_res / ss_tot)
}

#[test]
fn sequential_ttft_is_base_plus_t_p_times_tokens() {
    let profile = Profile::by_name("paper-a100-mistral7b").unwrap();
    let mut engine = Engine::new(profile);
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    let mut now = 0.0;
    for i in 0..30u64 {
        let tokens = 100 + (i as usize * 7900) / 29;
        let (ttft, cached, end) = run_alone(&mut engine, request(i, &prompt(i, tokens), 4, now));
        assert_eq!(cached, 0, "distinct prompts share nothing");
        xs.push(tokens as f64);
        ys.push(ttft);
        now = end + 1.0;
    }
    let (a, b, r2) = fit(&xs, &ys);
    assert!(r2 >= 0.99, "R^2 {r2}");
    assert!((b - 0.0938).abs() < 1e-6, "slope {b}");
    assert!((a - 150.72).abs() < 1e-3, "intercept {a}");
}

#[test]
fn cached_prefix_pays_only_for_the_uncached_part() {
    let profile = Profile::by_name("paper-a100-mistral7b").unwrap();
    let p = profile.clone();
    let mut engine = Engine::new(profile);
    let base = prompt(7, 4000);
    let (_, cached, end) = run_alone(&mut engine, request(1, &base, 2, 0.0));
    assert_eq!(cached, 0);
    let mut longer = base.clone();
    longer.extend_from_slice(&prompt(8, 2000));
    let (ttft, cached, end) = run_alone(&mut engine, request(2, &longer, 2, end + 10.0));
    assert_eq!(cached, 4000);
    let expected = p.request_overhead_ms + p.prefill_base_ms + p.t_p_ms_per_token * 2000.0;
    assert!(
        (ttft - expected).abs() < 1e-6,
        "ttft {ttft} expected {expected}"
    );
    // The very same prompt again: everything but the last token is cached.
    let (ttft, cached, _) = run_alone(&mut engine, request(3, &longer, 2, end + 10.0));
    assert_eq!(cached, 5999);
    assert!(ttft < p.request_overhead_ms + p.prefill_base_ms + 1.0);
}

fn small_profile(capacity: u64) -> Profile {
    let mut p = Profile::by_name("h200-mistral7b").unwrap();
    p.max_total_tokens = capacity;
    p
}

/// [`small_profile`] with a prefill chunk and a running-request limit of its own.
fn batching_profile(capacity: u64, chunk: u64, max_running: u32) -> Profile {
    let mut p = small_profile(capacity);
    p.chunked_prefill_size = chunk;
    p.max_running_requests = max_running;
    p
}

#[test]
fn eviction_happens_at_capacity_and_only_to_unreferenced_blocks() {
    let mut engine = Engine::new(small_profile(1000));
    let a = prompt(1, 300);
    let b = prompt(2, 300);
    let (_, _, t) = run_alone(&mut engine, request(1, &a, 10, 0.0));
    let (_, _, t) = run_alone(&mut engine, request(2, &b, 10, t + 1.0));
    assert_eq!(
        engine.stats().cached_tokens,
        600,
        "both prompts stay cached below capacity"
    );
    // C needs 600 + 10; only 400 are free: A (least recently used) goes, B stays.
    let c = prompt(3, 600);
    let (_, _, t) = run_alone(&mut engine, request(3, &c, 10, t + 1.0));
    let (_, cached_b, t) = run_alone(&mut engine, request(4, &b, 10, t + 1.0));
    assert_eq!(cached_b, 299, "B survived the eviction");
    let (_, cached_a, t) = run_alone(&mut engine, request(5, &a, 10, t + 1.0));
    assert!(cached_a < 300, "A was evicted (got {cached_a})");
    assert!(engine.stats().used_tokens <= 1000);

    // A long-running D holds 500 tokens; E (600 + 10) cannot evict them and waits.
    let mut engine = Engine::new(small_profile(1000));
    let d = prompt(10, 500);
    let e = prompt(11, 600);
    let t0 = t + 1.0;
    engine.submit(request(10, &d, 200, t0), t0).unwrap();
    // Let D finish its prefill so its blocks are in the cache and referenced.
    let mut events = Vec::new();
    while !events
        .iter()
        .any(|e| matches!(e, EngineEvent::FirstToken { id: 10, .. }))
    {
        let next = engine.next_event_time().unwrap();
        engine.step_into(next, &mut events);
    }
    let t1 = engine.next_event_time().unwrap();
    engine.submit(request(11, &e, 10, t1), t1).unwrap();
    let s = engine.stats();
    assert_eq!(s.waiting, 1, "E waits: D's blocks are referenced");
    assert_eq!(s.cached_tokens, 500);
    let mut d_end = None;
    let mut e_first = None;
    while let Some(next) = engine.next_event_time() {
        for ev in engine.step(next) {
            match ev {
                EngineEvent::Finished { id: 10, at_ms, .. } => d_end = Some(at_ms),
                EngineEvent::FirstToken { id: 11, at_ms, .. } => e_first = Some(at_ms),
                _ => {}
            }
        }
        let s = engine.stats();
        assert!(s.used_tokens + s.evictable_tokens <= 1000);
    }
    assert!(
        e_first.unwrap() > d_end.unwrap(),
        "E ran only after D released its blocks"
    );
    // E needed 610 with 500 free: just enough of D's tail (whole 16-token blocks,
    // leaf first) was evicted, the rest of D stays cached.
    let cached = engine.stats().cached_tokens;
    assert!(
        (1100 - 16 - 110..=1100 - 110).contains(&cached),
        "cached {cached}"
    );
}

#[test]
fn under_a_burst_ttft_grows_with_queue_position() {
    let profile = Profile::by_name("paper-a100-mistral7b").unwrap();
    let mut engine = Engine::new(profile);
    for i in 0..20u64 {
        engine
            .submit(request(i, &prompt(100 + i, 3000), 32, 0.0), 0.0)
            .unwrap();
    }
    let mut first = vec![f64::NAN; 20];
    for e in drain(&mut engine) {
        if let EngineEvent::FirstToken { id, at_ms, .. } = e {
            first[id as usize] = at_ms;
        }
    }
    for w in first.windows(2) {
        assert!(
            w[1] >= w[0],
            "TTFT must not decrease with queue position: {first:?}"
        );
    }
    assert!(first[19] > 5.0 * first[0], "{first:?}");
}

/// A burst waits in the queue and reserves KV only as it enters a prefill batch (as
/// SGLang's `PrefillAdder` does). So the burst's later requests find the prefix its
/// first ones computed, and an older cached prefix is not evicted to hold KV for
/// prompts whose prefill has not begun.
#[test]
fn a_queued_burst_reserves_kv_only_for_the_next_prefill_batch() {
    let mut profile = small_profile(40_000);
    profile.chunked_prefill_size = 8192;
    // The whole burst is queued before the first of it is schedulable.
    profile.request_overhead_ms = 5.0;
    let mut engine = Engine::new(profile);
    // A 6,000-token prefix, cached and unreferenced.
    let old = prompt(1, 6000);
    let (_, _, t) = run_alone(&mut engine, request(1, &old, 1, 0.0));
    // Ten prompts at once, a shared 4,000-token prefix and 1,000 tokens of their own:
    // 50,000 tokens uncached, more than the KV holds.
    let shared = prompt(2, 4000);
    for i in 0..10u64 {
        let mut bytes = shared.clone();
        bytes.extend_from_slice(&prompt(10 + i, 1000));
        engine
            .submit(request(10 + i, &bytes, 1, t + 1.0), t + 1.0)
            .unwrap();
    }
    let mut events = Vec::new();
    while let Some(now) = engine.next_event_time() {
        engine.step_into(now, &mut events);
    }
    // The first batch computes the shared prefix once (8,192 new tokens: two prompts,
    // the second chunked); the eight admitted after it find it cached. Admitting all
    // that fits at once would compute it six times and evict the older prefix.
    let hits = events
        .iter()
        .filter(|e| matches!(e, EngineEvent::FirstToken { cached_tokens, .. } if *cached_tokens >= 4000))
        .count();
    assert_eq!(hits, 8, "of 10 found the shared prefix");
    // The older prefix survived the burst: a follow-up finds it cached.
    let end = events
        .iter()
        .filter_map(|e| match e {
            EngineEvent::Finished { at_ms, .. } => Some(*at_ms),
            _ => None,
        })
        .fold(t, f64::max);
    let mut longer = old.clone();
    longer.extend_from_slice(&prompt(3, 500));
    let (_, cached, _) = run_alone(&mut engine, request(2, &longer, 1, end + 1.0));
    assert_eq!(cached, 6000);
}

#[test]
fn abort_frees_the_slot_and_the_kv_reference() {
    let mut p = small_profile(1000);
    p.max_running_requests = 1;
    let mut engine = Engine::new(p);
    engine
        .submit(request(1, &prompt(1, 400), 500, 0.0), 0.0)
        .unwrap();
    engine
        .submit(request(2, &prompt(2, 100), 5, 0.0), 0.0)
        .unwrap();
    let t = engine.next_event_time().unwrap();
    engine.step(t);
    assert_eq!(engine.stats().running, 1);
    assert_eq!(engine.stats().waiting, 1);
    assert!(engine.abort(1, t + 1.0));
    let s = engine.stats();
    assert_eq!(s.evictable_tokens, s.cached_tokens, "no reference left");
    let events = drain(&mut engine);
    assert!(events
        .iter()
        .any(|e| matches!(e, EngineEvent::Finished { id: 2, .. })));
    assert!(!events
        .iter()
        .any(|e| matches!(e, EngineEvent::Finished { id: 1, .. })));
    assert_eq!(engine.stats().used_tokens, 0, "nothing held once idle");
}

#[test]
fn oversized_and_queue_full_requests_are_rejected() {
    let mut engine = Engine::new(small_profile(1000));
    engine.set_max_waiting(Some(1));
    let big = prompt(1, 2000);
    assert!(engine.submit(request(1, &big, 10, 0.0), 0.0).is_err());
    let huge = prompt(2, 40_000);
    assert!(engine.submit(request(2, &huge, 10, 0.0), 0.0).is_err());
    engine
        .submit(request(3, &prompt(3, 10), 10, 0.0), 0.0)
        .unwrap();
    engine
        .submit(request(4, &prompt(4, 10), 10, 0.0), 0.0)
        .unwrap();
    let rejected = engine.submit(request(5, &prompt(5, 10), 10, 0.0), 0.0);
    assert!(rejected.is_err() || engine.stats().waiting <= 1);
}

#[test]
fn chains_longer_than_the_prompt_are_cut_to_it() {
    let mut engine = Engine::new(small_profile(2000));
    // Trace-style chain for a 600-token prompt: blocks of 512, 88 and a padding 1.
    let chain = HashChain::from_int_block_ids(&[1, 2, 3], 512, 600);
    assert_eq!(chain.total_tokens(), 601);
    let req = |id, at| EngineRequest {
        id,
        chain: chain.clone(),
        prompt_tokens: 600,
        max_output_tokens: 5,
        arrival_ms: at,
    };
    let (_, cached, end) = run_alone(&mut engine, req(1, 0.0));
    assert_eq!(cached, 0);
    let (_, cached, _) = run_alone(&mut engine, req(2, end + 1.0));
    assert_eq!(
        cached, 599,
        "the padding block is dropped, the prompt is all cached"
    );
    assert!(engine.stats().cached_tokens <= 600);
}

/// A trace-style request: block ids `ids` of `block` tokens (a prompt of `tokens`, so
/// its last block may be shorter than its id's full block), as the simulator builds.
fn trace_request(id: u64, ids: &[u64], block: u32, tokens: u64, out: u32) -> EngineRequest {
    EngineRequest {
        id,
        chain: HashChain::from_int_block_ids(ids, block, tokens),
        prompt_tokens: tokens,
        max_output_tokens: out,
        arrival_ms: 0.0,
    }
}

/// A prompt cut short keeps its last block's id on fewer tokens: a longer prompt with
/// the same ids reuses only the tokens cached, and a shorter one matching a longer
/// prompt's block takes out of the evictable total what the cached block holds.
#[test]
fn a_block_cached_short_serves_only_the_tokens_it_holds() {
    let mut engine = Engine::new(small_profile(2000));
    // A: blocks 1, 2 with 512 + 88 tokens (a prompt clamped to 600).
    let (_, cached, end) = run_alone(&mut engine, trace_request(1, &[1, 2], 512, 600, 5));
    assert_eq!(cached, 0);
    // B: blocks 1, 2, 3 with 512 + 512 + 476: only A's 600 tokens are reusable.
    let mut b = trace_request(2, &[1, 2, 3], 512, 1500, 5);
    b.arrival_ms = end + 1.0;
    let (_, cached, end) = run_alone(&mut engine, b);
    assert_eq!(cached, 600, "B reuses what A computed, no more");
    // B computed block 2 in full: the cache holds its whole prompt now.
    let s = engine.stats();
    assert_eq!(
        (s.cached_tokens, s.evictable_tokens, s.used_tokens),
        (1500, 1500, 0)
    );
    let mut again = trace_request(3, &[1, 2, 3], 512, 1500, 5);
    again.arrival_ms = end + 1.0;
    let (_, cached, _) = run_alone(&mut engine, again);
    assert_eq!(cached, 1499);

    // The other order: B first, then A's 88 tokens of block 2 match B's 512.
    let mut engine = Engine::new(small_profile(2000));
    let (_, _, end) = run_alone(&mut engine, trace_request(1, &[1, 2, 3], 512, 1500, 5));
    let mut a = trace_request(2, &[1, 2], 512, 600, 5);
    a.arrival_ms = end + 1.0;
    let (_, cached, _) = run_alone(&mut engine, a);
    assert_eq!(cached, 599);
    let s = engine.stats();
    assert_eq!((s.cached_tokens, s.used_tokens), (1500, 0));
}

/// Submit `reqs` (sorted by arrival) to `engine` and run it dry, checking after every
/// step that KV in use plus the evictable cache stays within `capacity`; at the end
/// every request finished with the output it asked for and nothing stays held.
fn run_within_capacity(
    engine: &mut Engine,
    reqs: Vec<EngineRequest>,
    capacity: u64,
) -> Result<(), TestCaseError> {
    let mut want = std::collections::HashMap::new();
    let mut got = std::collections::HashMap::new();
    let mut events = Vec::new();
    for r in reqs {
        let at = r.arrival_ms;
        while let Some(t) = engine.next_event_time() {
            if t > at {
                break;
            }
            engine.step_into(t, &mut events);
            let s = engine.stats();
            prop_assert!(s.used_tokens + s.evictable_tokens <= capacity);
        }
        want.insert(r.id, r.max_output_tokens);
        engine.submit(r, at).unwrap();
        let s = engine.stats();
        prop_assert!(s.used_tokens + s.evictable_tokens <= capacity);
    }
    while let Some(t) = engine.next_event_time() {
        engine.step_into(t, &mut events);
        let s = engine.stats();
        prop_assert!(s.used_tokens + s.evictable_tokens <= capacity);
    }
    for e in events {
        if let EngineEvent::Finished {
            id, output_tokens, ..
        } = e
        {
            got.insert(id, output_tokens);
        }
    }
    prop_assert_eq!(want, got);
    let s = engine.stats();
    prop_assert_eq!(s.used_tokens, 0);
    prop_assert_eq!(s.evictable_tokens, s.cached_tokens);
    let blocks: u64 = engine.cached_blocks().map(|(_, t)| t as u64).sum();
    prop_assert_eq!(blocks, s.cached_tokens);
    prop_assert_eq!(s.running + s.waiting, 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// Any workload: KV use never exceeds capacity, every request finishes with the
    /// output it asked for, and nothing stays reserved at the end.
    #[test]
    fn every_request_finishes_within_capacity(
        reqs in proptest::collection::vec((0u64..6, 1usize..900, 1u32..40, 0.0f64..500.0), 1..40),
        capacity in 1200u64..4000,
        chunk in 64u64..2048,
        max_running in 1u32..8,
    ) {
        let mut engine = Engine::new(batching_profile(capacity, chunk, max_running));
        let mut reqs = reqs;
        reqs.sort_by(|a, b| a.3.total_cmp(&b.3));
        // Prompts of a family share prefixes of different lengths.
        let reqs = reqs
            .into_iter()
            .enumerate()
            .map(|(i, (family, tokens, out, at))| request(i as u64, &prompt(family, tokens), out, at))
            .collect();
        run_within_capacity(&mut engine, reqs, capacity)?;
    }

    /// The same with trace-style chains: prompts of a family share block ids and have
    /// random lengths, so a block id is cached short by one prompt and in full by
    /// another (as a prompt shortened to the context keeps its ids).
    #[test]
    fn prompts_sharing_block_ids_at_any_length_stay_within_capacity(
        reqs in proptest::collection::vec((0u64..3, 1u64..400, 1u32..40, 0.0f64..500.0), 1..40),
        capacity in 500u64..1500,
        chunk in 16u64..512,
        max_running in 1u32..8,
    ) {
        let mut engine = Engine::new(batching_profile(capacity, chunk, max_running));
        let mut reqs = reqs;
        reqs.sort_by(|a, b| a.3.total_cmp(&b.3));
        let reqs = reqs
            .into_iter()
            .enumerate()
            .map(|(i, (family, tokens, out, at))| {
                let ids: Vec<u64> = (0..tokens.div_ceil(64)).map(|b| family * 1000 + b).collect();
                let mut r = trace_request(i as u64, &ids, 64, tokens, out);
                r.arrival_ms = at;
                r
            })
            .collect();
        run_within_capacity(&mut engine, reqs, capacity)?;
    }
}
