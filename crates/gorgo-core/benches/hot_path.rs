//! The per-request hot path of a node: hashing the prompt, matching it against the
//! local shadow index and every peer's summary, and the `gorgo` decision.
//!
//! Run: `cargo bench -p gorgo-core --bench hot_path -- --warm-up-time 1 --measurement-time 3`
//! (figures in docs/benchmarks.md).

use std::cell::Cell;
use std::ops::{Deref, DerefMut};
use std::time::{Duration, Instant};

use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion};
use gorgo_core::candidates::{build_candidates, LocalState, PeerState};
use gorgo_core::cost::ForwardLedger;
use gorgo_core::decision::decide;
use gorgo_core::kv_events::{AlignedBlockEvent, KvEventFollower, KvFollowerConfig};
use gorgo_core::kv_wire::{encode_batch, encode_seq, KvEvent, KvEventBatch};
use gorgo_core::policy::{build, PolicyKind, RouteRequest};
use gorgo_core::prompt::PromptHasher;
use gorgo_core::summary::{PeerSummary, SummarySample, SummarySnapshot};
use gorgo_core::{percentile, HashChain, NodeId, QueueStats, ShadowIndex, Weights};
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// 32 KiB: an 8k-token prompt at 4 bytes per token.
const PROMPT_BYTES: usize = 32 * 1024;
/// Blocks in the local index and in each peer's summary.
const INDEX_BLOCKS: usize = 100_000;
const PEERS: usize = 16;

fn random_bytes(rng: &mut ChaCha8Rng, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rng.fill_bytes(&mut v);
    v
}

/// A shadow index of about `INDEX_BLOCKS` blocks: distinct 32 KiB prompts (128 blocks
/// each), plus the first `shared_blocks` blocks of `prompt`.
fn local_index(rng: &mut ChaCha8Rng, prompt: &[u8], shared_blocks: usize) -> ShadowIndex {
    let mut index = ShadowIndex::new(u64::MAX / 2);
    let per_prompt = PROMPT_BYTES / 256;
    for i in 0..INDEX_BLOCKS / per_prompt {
        let chain = HashChain::from_bytes(&random_bytes(rng, PROMPT_BYTES), 256, 4);
        index.insert(&chain, i as u64);
    }
    let shared = HashChain::from_bytes(&prompt[..shared_blocks * 256], 256, 4);
    index.insert(&shared, 1_000_000);
    index
}

/// A peer summary of `INDEX_BLOCKS` random fingerprints plus the first `shared_blocks`
/// of `chain`.
fn peer_summary(rng: &mut ChaCha8Rng, chain: &HashChain, shared_blocks: usize) -> PeerSummary {
    let mut fps: Vec<u32> = (0..INDEX_BLOCKS).map(|_| rng.next_u32()).collect();
    fps.extend((0..shared_blocks).map(|i| chain.fingerprint(i)));
    fps.sort_unstable();
    fps.dedup();
    let mut s = PeerSummary::new();
    s.apply_snapshot(SummarySnapshot {
        version: 1,
        fingerprints: fps,
        sample: SummarySample::EVERY_BLOCK,
    });
    s
}

/// Gossiped stats of a busy engine (engine `replica` of its node).
fn random_stats(rng: &mut ChaCha8Rng, replica: u16) -> QueueStats {
    QueueStats {
        version: 1,
        replica,
        unfinished_prefill_tokens: rng.random_range(0..20_000),
        running: rng.random_range(0..64),
        waiting: rng.random_range(0..8),
        t_p_ms: 0.0938,
        base_ms: 150.0,
        decode_step_ms: 25.0,
        ..QueueStats::default()
    }
}

/// The `gorgo` decision a node makes for a client request (hops 0, max hops 1) with
/// the default weights: the target's index.
fn decide_target(
    chain: &HashChain,
    prompt_tokens: u64,
    candidates: &[gorgo_core::cost::Candidate],
    policy: &mut dyn gorgo_core::policy::Policy,
    rng: u64,
) -> Option<usize> {
    let req = RouteRequest {
        chain,
        prompt_tokens,
        session_key: None,
    };
    decide(&req, 0, 1, candidates, policy, Weights::default(), rng)
        .ok()
        .map(|d| d.target_index)
}

/// The forward ledger as the node's mutex hands it to `build_candidates`, adding to
/// `held` how long it was held: the node's other decisions and every forward's record
/// and settle wait that long (docs/benchmarks.md, "Ledger lock").
struct Held<'a> {
    ledger: &'a mut ForwardLedger,
    since: Instant,
    held: &'a Cell<Duration>,
}

impl Deref for Held<'_> {
    type Target = ForwardLedger;
    fn deref(&self) -> &ForwardLedger {
        self.ledger
    }
}

impl DerefMut for Held<'_> {
    fn deref_mut(&mut self) -> &mut ForwardLedger {
        self.ledger
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.held.set(self.held.get() + self.since.elapsed());
    }
}

struct Peer {
    node: NodeId,
    rtt_ms: f64,
    summary: PeerSummary,
    stats: QueueStats,
}

fn bench(c: &mut Criterion) {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let prompt = random_bytes(&mut rng, PROMPT_BYTES);
    let hasher = PromptHasher::default();
    let chain = hasher.chain(&prompt);
    assert_eq!(chain.len(), 128);

    c.bench_function("hash_32KiB_prompt", |b| {
        b.iter(|| hasher.chain(black_box(&prompt)))
    });

    // The local index holds half of this prompt (a multi-turn conversation).
    let index = local_index(&mut rng, &prompt, 64);
    assert!(index.len() >= INDEX_BLOCKS);
    assert_eq!(index.longest_match(&chain), 64 * 64);
    c.bench_function("shadow_index_longest_match_100k_blocks", |b| {
        b.iter(|| index.longest_match(black_box(&chain)))
    });

    // 16 peers with 100k-fingerprint summaries; peer i holds the first 4 i blocks of
    // the prompt (0 to 60 of 128): 480 hits and 16 misses to walk in total.
    let peers: Vec<Peer> = (0..PEERS)
        .map(|i| Peer {
            node: NodeId(format!("peer-{i:02}")),
            rtt_ms: 20.0 + 15.0 * i as f64,
            summary: peer_summary(&mut rng, &chain, 4 * i),
            stats: random_stats(&mut rng, 0),
        })
        .collect();
    let local_node = NodeId::from("local");
    let local_stats = QueueStats {
        unfinished_prefill_tokens: 12_000,
        running: 32,
        t_p_ms: 0.0938,
        decode_step_ms: 25.0,
        ..QueueStats::default()
    };
    let mut policy = build(PolicyKind::Gorgo);
    // This node's ledger: a few forwards pending at every peer and a learnt forward
    // bias, so the decision pays for the ledger lookups it makes in production.
    let mut ledger = ForwardLedger::new();
    for (i, p) in peers.iter().enumerate() {
        for k in 0..(i % 4) as u64 {
            ledger.record_forward(&p.node, 0, 2_000, 2_000, 1_000 + k);
        }
        ledger.observe_forward_ttft(&p.node, 0, 800.0, 900.0 + 10.0 * i as f64, 1_000);
    }
    // The node looks a peer's summary up by id (its peer table is a map).
    let summaries: std::collections::HashMap<&NodeId, &PeerSummary> =
        peers.iter().map(|p| (&p.node, &p.summary)).collect();
    let mut n = 0u64;
    // How long the ledger was held, summed over decisions.
    let held = Cell::new(Duration::ZERO);
    // Everything a request costs the node before it proxies: hash the prompt, match it
    // locally and against every peer, build candidates (the core's builder, as the node
    // calls it), decide.
    let mut one_decision = |n: u64| {
        let chain = hasher.chain(black_box(&prompt));
        let prompt_tokens = chain.total_tokens();
        let local = LocalState {
            node: local_node.clone(),
            healthy: true,
            cached_tokens: index.longest_match(&chain),
            stats: local_stats.clone(),
        };
        let peer_states = peers.iter().map(|p| PeerState {
            node: &p.node,
            alive: true,
            eligible: true,
            rtt_ms: p.rtt_ms,
            stats: Some(&p.stats),
            stats_age_ms: 0,
        });
        let candidates = build_candidates(
            [local],
            peer_states,
            |id, _replica| summaries.get(id).map_or(0, |s| s.matched_tokens(&chain)),
            || Held {
                ledger: &mut ledger,
                since: Instant::now(),
                held: &held,
            },
            1_500,
        );
        decide_target(&chain, prompt_tokens, &candidates, policy.as_mut(), n)
    };
    c.bench_function("gorgo_decision_16_peers_100k_blocks_8k_prompt", |b| {
        b.iter(|| {
            n = n.wrapping_add(0x9e37_79b9_7f4a_7c15);
            one_decision(n)
        })
    });
    // Criterion reports means and medians; the tail comes from raw samples, one
    // decision per sample, with the time the ledger was held in it.
    let (mut samples_us, mut held_us): (Vec<f64>, Vec<f64>) = (0..50_000u64)
        .map(|i| {
            held.set(Duration::ZERO);
            let t = Instant::now();
            black_box(one_decision(i.wrapping_mul(0x9e37_79b9_7f4a_7c15)));
            (
                t.elapsed().as_secs_f64() * 1e6,
                held.get().as_secs_f64() * 1e6,
            )
        })
        .unzip();
    samples_us.sort_by(f64::total_cmp);
    held_us.sort_by(f64::total_cmp);
    println!(
        "gorgo_decision raw samples: n {} p50 {:.2} us p99 {:.2} us p99.9 {:.2} us max {:.2} us",
        samples_us.len(),
        percentile(&samples_us, 50.0).unwrap_or(f64::NAN),
        percentile(&samples_us, 99.0).unwrap_or(f64::NAN),
        percentile(&samples_us, 99.9).unwrap_or(f64::NAN),
        samples_us.last().copied().unwrap_or(f64::NAN),
    );
    println!(
        "gorgo_decision ledger held per decision: p50 {:.2} us p99 {:.2} us p99.9 {:.2} us max {:.2} us",
        percentile(&held_us, 50.0).unwrap_or(f64::NAN),
        percentile(&held_us, 99.0).unwrap_or(f64::NAN),
        percentile(&held_us, 99.9).unwrap_or(f64::NAN),
        held_us.last().copied().unwrap_or(f64::NAN),
    );
}

/// The decision of a node fronting four engines in a three-region cluster of four
/// engines per region (docs/design.md, "Replicas"): 12 candidates, each engine with
/// its own 100k-block index or summary.
fn bench_replicas(c: &mut Criterion) {
    const ENGINES: u16 = 4;
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let prompt = random_bytes(&mut rng, PROMPT_BYTES);
    let hasher = PromptHasher::default();
    let chain = hasher.chain(&prompt);
    // Local engine k holds the first 16 k blocks of the prompt.
    let locals: Vec<(ShadowIndex, QueueStats)> = (0..ENGINES)
        .map(|k| {
            let index = local_index(&mut rng, &prompt, 16 * k as usize + 1);
            (index, random_stats(&mut rng, k))
        })
        .collect();
    let peers: Vec<(NodeId, u16, f64, PeerSummary, QueueStats)> = (0..2)
        .flat_map(|i| (0..ENGINES).map(move |k| (i, k)))
        .map(|(i, k)| {
            let summary = peer_summary(&mut rng, &chain, 8 * (i * ENGINES as usize + k as usize));
            let stats = random_stats(&mut rng, k);
            (
                NodeId(format!("peer-{i}")),
                k,
                40.0 + 60.0 * i as f64,
                summary,
                stats,
            )
        })
        .collect();
    let local_node = NodeId::from("local");
    let mut policy = build(PolicyKind::Gorgo);
    let mut ledger = ForwardLedger::new();
    let mut n = 0u64;
    c.bench_function(
        "gorgo_decision_3_regions_x_4_engines_100k_blocks_8k_prompt",
        |b| {
            b.iter(|| {
                n = n.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let chain = hasher.chain(black_box(&prompt));
                let prompt_tokens = chain.total_tokens();
                let local = locals.iter().map(|(index, stats)| LocalState {
                    node: local_node.clone(),
                    healthy: true,
                    cached_tokens: index.longest_match(&chain),
                    stats: stats.clone(),
                });
                let peer_states = peers.iter().map(|(node, _, rtt_ms, _, stats)| PeerState {
                    node,
                    alive: true,
                    eligible: true,
                    rtt_ms: *rtt_ms,
                    stats: Some(stats),
                    stats_age_ms: 0,
                });
                let candidates = build_candidates(
                    local,
                    peer_states,
                    |id, replica| {
                        peers
                            .iter()
                            .find(|(node, k, ..)| node == id && *k == replica)
                            .map_or(0, |(_, _, _, s, _)| s.matched_tokens(&chain))
                    },
                    || &mut ledger,
                    1_500,
                );
                decide_target(&chain, prompt_tokens, &candidates, policy.as_mut(), n)
            })
        },
    );
}

/// Blocks stored below one parent in [`bench_kv_siblings`].
const SIBLINGS: u64 = 20_000;

/// The engine's KV events, where many sequences share one prefix: a system prompt's
/// last block with `SIBLINGS` distinct continuations (SGLang's 1-token blocks make
/// such fan-outs common), all evicted one by one. The follower runs under the lock
/// the request path takes, so its cost per event must not grow with the fan-out.
fn bench_kv_siblings(c: &mut Criterion) {
    let stored: Vec<AlignedBlockEvent> = std::iter::once(AlignedBlockEvent::Stored {
        hash: 1,
        parent: None,
        tokens: 64,
    })
    .chain((0..SIBLINGS).map(|i| AlignedBlockEvent::Stored {
        hash: 1_000 + i,
        parent: Some(1),
        tokens: 64,
    }))
    .collect();
    let removed: Vec<AlignedBlockEvent> = (0..SIBLINGS)
        .map(|i| AlignedBlockEvent::Removed { hash: 1_000 + i })
        .collect();
    let mut group = c.benchmark_group("kv_events");
    group.sample_size(10);
    group.bench_function("evict_20k_siblings_one_by_one", |b| {
        b.iter_batched(
            || {
                let mut f = KvEventFollower::new(KvFollowerConfig::new(64), 0).unwrap();
                f.apply_aligned(&stored, 0);
                f
            },
            |mut f| {
                for event in &removed {
                    f.apply_aligned(std::slice::from_ref(event), 1);
                }
                assert_eq!(f.engine_blocks(), 1);
                f
            },
            BatchSize::LargeInput,
        )
    });
    // A batch that names a block the follower holds 200,000 times (one-token blocks,
    // as SGLang's, under a 63-token chain): each repeat is one more copy, and must not
    // walk the chain's parents again.
    const REPEATS: usize = 200_000;
    let batch = |seq: i64, event: KvEvent| {
        let payload = encode_batch(&KvEventBatch {
            ts: 0.0,
            events: vec![event],
            data_parallel_rank: None,
            unknown_events: 0,
        });
        (encode_seq(seq), payload)
    };
    let chain: Vec<u64> = (1..=63).collect();
    let (seq0, first) = batch(
        0,
        KvEvent::BlockStored {
            block_hashes: chain.clone(),
            parent: None,
            token_ids: (0..63).collect(),
            block_size: 1,
            lora_id: None,
            medium: None,
            extra_keys_from: None,
        },
    );
    let (seq1, repeated) = batch(
        1,
        KvEvent::BlockStored {
            block_hashes: vec![63; REPEATS],
            parent: Some(62),
            token_ids: vec![62; REPEATS],
            block_size: 1,
            lora_id: None,
            medium: None,
            extra_keys_from: None,
        },
    );
    group.bench_function("restore_a_known_block_200k_times", |b| {
        b.iter_batched(
            || {
                let mut config = KvFollowerConfig::new(64);
                config.max_payload_bytes = 16 << 20;
                let mut f = KvEventFollower::new(config, 0).unwrap();
                f.on_message(&[b"kv", &seq0, &first], 0);
                f
            },
            |mut f| {
                f.on_message(&[b"kv", &seq1, &repeated], 1);
                assert_eq!(f.engine_blocks(), 63);
                f
            },
            BatchSize::LargeInput,
        )
    });
    group.finish();
}

criterion_group!(benches, bench, bench_replicas, bench_kv_siblings);
criterion_main!(benches);
