//! The per-request hot path of a node: hashing the prompt, matching it against the
//! local shadow index and every peer's summary, and the `gorgo` decision.
//!
//! Run: `cargo bench -p gorgo-core --bench hot_path -- --warm-up-time 1 --measurement-time 3`
//! (figures in docs/benchmarks.md).

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use gorgo_core::cost::Candidate;
use gorgo_core::decision::decide;
use gorgo_core::policy::{build, PolicyKind, RouteRequest};
use gorgo_core::prompt::PromptHasher;
use gorgo_core::summary::{PeerSummary, SummarySnapshot};
use gorgo_core::{HashChain, NodeId, QueueStats, ShadowIndex, Weights};
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
    });
    s
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
            stats: QueueStats {
                version: 1,
                unfinished_prefill_tokens: rng.random_range(0..20_000),
                running: rng.random_range(0..64),
                waiting: rng.random_range(0..8),
                t_p_ms: 0.0938,
                base_ms: 150.0,
                decode_step_ms: 25.0,
                ..QueueStats::default()
            },
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
    let weights = Weights::default();
    let mut n = 0u64;
    c.bench_function("gorgo_decision_16_peers_100k_blocks_8k_prompt", |b| {
        b.iter(|| {
            // Everything a request costs the node before it proxies: hash the prompt,
            // match it locally and against every peer, build candidates, decide.
            let chain = hasher.chain(black_box(&prompt));
            let prompt_tokens = chain.total_tokens();
            let mut candidates = Vec::with_capacity(PEERS + 1);
            let mut local = Candidate::idle(local_node.clone(), true, 0.0);
            local.cached_tokens = index.longest_match(&chain);
            local.stats = local_stats.clone();
            candidates.push(local);
            for p in &peers {
                let mut c = Candidate::idle(p.node.clone(), false, p.rtt_ms);
                c.cached_tokens = p.summary.matched_tokens(&chain);
                c.stats = p.stats.clone();
                candidates.push(c);
            }
            let req = RouteRequest {
                chain: &chain,
                prompt_tokens,
                session_key: None,
            };
            n = n.wrapping_add(0x9e37_79b9_7f4a_7c15);
            decide(&req, 0, 1, &candidates, policy.as_mut(), weights, n).map(|d| d.target_index)
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
