//! The shadow index against a naive reference LRU prefix cache, on random chains and on
//! the real Mooncake conversation trace; and summaries gossiped alongside it.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use gorgo_core::summary::{is_summarised, SummarySample};
use gorgo_core::{HashChain, PeerSummary, ShadowIndex};
use proptest::prelude::*;

/// Obviously correct and slow: every block with a stamp; a chain is touched from its
/// last block to its first (so prefixes are more recent than their extensions); evict
/// the least recently stamped block with no child until under capacity.
#[derive(Default)]
struct ReferenceCache {
    blocks: HashMap<u64, (Option<u64>, u32, u64)>, // hash -> (parent, tokens, stamp)
    clock: u64,
    capacity: u64,
}

impl ReferenceCache {
    fn longest_match(&self, chain: &HashChain) -> u64 {
        let n = chain
            .hashes
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count();
        chain.prefix_tokens(n)
    }

    fn used(&self) -> u64 {
        self.blocks.values().map(|b| b.1 as u64).sum()
    }

    fn insert(&mut self, chain: &HashChain) {
        let mut parent = None;
        for (i, &h) in chain.hashes.iter().enumerate() {
            self.blocks
                .entry(h)
                .or_insert((parent, chain.block_tokens[i], 0));
            parent = Some(h);
        }
        for h in chain.hashes.iter().rev() {
            self.clock += 1;
            self.blocks.get_mut(h).unwrap().2 = self.clock;
        }
        self.evict();
    }

    fn evict(&mut self) {
        let mut used = self.used();
        while used > self.capacity {
            let parents: HashSet<u64> = self.blocks.values().filter_map(|b| b.0).collect();
            let (victim, tokens) = self
                .blocks
                .iter()
                .filter(|(h, _)| !parents.contains(h))
                .min_by_key(|(_, b)| b.2)
                .map(|(h, b)| (*h, b.1))
                .unwrap();
            self.blocks.remove(&victim);
            used -= tokens as u64;
        }
    }
}

fn chain(ids: &[u64]) -> HashChain {
    HashChain::from_int_block_ids(ids, 16, ids.len() as u64 * 16 - 5)
}

proptest! {
    // Integration tests have no lib.rs next to them to persist failures beside.
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

    /// Same matches, same occupancy, same blocks as the reference, whatever the inserts
    /// and capacity changes.
    #[test]
    fn index_equals_reference(
        chains in prop::collection::vec(prop::collection::vec(0u64..3, 1..7), 1..50),
        cap in 0u64..120,
        shrink_at in any::<prop::sample::Index>(),
    ) {
        let mut ix = ShadowIndex::new(cap);
        let mut reference = ReferenceCache { capacity: cap, ..Default::default() };
        let shrink_at = shrink_at.index(chains.len());
        for (t, ids) in chains.iter().enumerate() {
            let c = chain(ids);
            prop_assert_eq!(ix.longest_match(&c), reference.longest_match(&c));
            ix.insert(&c, t as u64);
            reference.insert(&c);
            if t == shrink_at {
                ix.set_capacity(cap / 2);
                reference.capacity = cap / 2;
                reference.evict();
            }
            prop_assert_eq!(ix.used_tokens(), reference.used());
            prop_assert_eq!(ix.len(), reference.blocks.len());
            for h in reference.blocks.keys() {
                prop_assert!(ix.contains(*h));
            }
        }
    }
}

#[derive(serde::Deserialize)]
struct MooncakeRow {
    input_length: u64,
    hash_ids: Vec<u64>,
}

fn mooncake_rows(limit: usize) -> Option<Vec<MooncakeRow>> {
    let path = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/data/traces/mooncake_conversation_trace.jsonl"
    ));
    let Ok(text) = std::fs::read_to_string(&path) else {
        eprintln!("skipping: {} not found", path.display());
        return None;
    };
    Some(
        text.lines()
            .take(limit)
            .map(|l| serde_json::from_str(l).expect("trace row"))
            .collect(),
    )
}

/// Replays the start of the Mooncake conversation trace (512-token blocks) into a
/// small shadow index and checks it against the reference at every request.
#[test]
fn mooncake_replay_matches_reference() {
    let Some(rows) = mooncake_rows(400) else {
        return;
    };
    let capacity = 200_000;
    let mut ix = ShadowIndex::new(capacity);
    let mut reference = ReferenceCache {
        capacity,
        ..Default::default()
    };
    for (i, row) in rows.iter().enumerate() {
        let c = HashChain::from_int_block_ids(&row.hash_ids, 512, row.input_length);
        assert_eq!(
            ix.longest_match(&c),
            reference.longest_match(&c),
            "request {i}"
        );
        ix.insert(&c, i as u64);
        reference.insert(&c);
        assert_eq!(ix.used_tokens(), reference.used(), "request {i}");
    }
    ix.check_invariants().unwrap();
}

/// Replays the whole Mooncake conversation trace into an index sized like an engine's
/// KV cache and gossips its summary to a peer every 8 requests: right after each sync
/// the peer's view of a request's match equals the index's own, and the peer ends
/// holding exactly the local set, at the sender's sample of one block in 4 (the rate
/// `auto` picks for 17 to 32 peers).
#[test]
fn mooncake_replay_gossip() {
    let Some(rows) = mooncake_rows(usize::MAX) else {
        return;
    };
    let capacity = 2_000_000; // tokens
    let sample = SummarySample::from_rate(4).unwrap();
    let mut ix = ShadowIndex::with_sample(capacity, sample);
    let mut unbounded = ShadowIndex::new(u64::MAX);
    let mut peer = PeerSummary::new();
    let (mut hit, mut hit_unbounded, mut total) = (0u64, 0u64, 0u64);
    let (mut delta_bytes, mut deltas, mut max_delta) = (0usize, 0usize, 0usize);
    for (i, row) in rows.iter().enumerate() {
        let c = HashChain::from_int_block_ids(&row.hash_ids, 512, row.input_length);
        let m = ix.longest_match(&c);
        if i % 8 == 0 {
            let d = ix
                .summary()
                .delta_since(peer.version())
                .expect("log covers 8 requests");
            delta_bytes += d.encoded_len();
            max_delta = max_delta.max(d.encoded_len());
            deltas += 1;
            peer.apply_delta(&d).unwrap();
            // The peer sees the sampled summary: the prefix up to the last summarised
            // block of the local match (module docs of `summary`, "Sampling").
            let blocks = ix.longest_match_blocks(&c);
            let expect = (0..blocks)
                .rev()
                .find(|&b| is_summarised(c.fingerprint(b), sample))
                .map_or(0, |b| c.prefix_tokens(b + 1));
            assert_eq!(peer.matched_tokens(&c), expect, "request {i}");
            assert!(expect <= m);
        }
        hit += m;
        hit_unbounded += unbounded.longest_match(&c);
        total += c.total_tokens();
        ix.insert(&c, i as u64);
        unbounded.insert(&c, i as u64);
        assert!(ix.used_tokens() <= capacity);
    }
    ix.check_invariants().unwrap();
    peer.apply_delta(&ix.summary().delta_since(peer.version()).unwrap())
        .unwrap();
    let snapshot = ix.summary().snapshot();
    // About one block in the sample is summarised.
    assert_eq!(peer.sample(), sample);
    let expect = ix.len() / sample.rate() as usize;
    assert!(
        snapshot.fingerprints.len().abs_diff(expect) < expect / 10 + 10,
        "{} summarised of {} blocks",
        snapshot.fingerprints.len(),
        ix.len()
    );
    assert!(snapshot.fingerprints.iter().all(|&fp| peer.contains(fp)));
    assert_eq!(peer.len(), snapshot.fingerprints.len());
    assert!(hit <= hit_unbounded);
    eprintln!(
        "mooncake {} req: cached share of prompt tokens {:.1}% at {capacity} tokens, \
         {:.1}% unbounded; {} blocks held, snapshot {} B, delta per 8 requests mean {} B max {} B",
        rows.len(),
        100.0 * hit as f64 / total as f64,
        100.0 * hit_unbounded as f64 / total as f64,
        ix.len(),
        snapshot.encoded_len(),
        delta_bytes / deltas.max(1),
        max_delta,
    );
}
