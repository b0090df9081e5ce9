//! Speed of the data-plane hot paths, for the record (no assertions on speed: CI
//! machines vary). Ignored by default; run in release:
//!
//! `cargo test --release -p gorgo-core --test data_perf -- --ignored --nocapture`

use std::hint::black_box;
use std::time::Instant;

use gorgo_core::wire::{decode, encode, MAX_GOSSIP_MESSAGE};
use gorgo_core::{HashChain, LocalSummary, PeerSummary, PromptHasher, ShadowIndex};

fn per_op(label: &str, ops: u64, f: impl FnOnce()) {
    let start = Instant::now();
    f();
    let ns = start.elapsed().as_nanos() as f64 / ops as f64;
    eprintln!("{label}: {ns:.1} ns/op");
}

#[test]
#[ignore = "measurement, run in release by hand"]
fn data_plane_speed() {
    // A peer summary of 100k blocks (a 6.4M-token cache at 64 tokens per block).
    let mut local = LocalSummary::new();
    let chains: Vec<HashChain> = (0..1_000u64)
        .map(|i| {
            let ids: Vec<u64> = (0..100).map(|b| i * 1_000 + b).collect();
            HashChain::from_int_block_ids(&ids, 64, 6_400)
        })
        .collect();
    for c in &chains {
        for &h in &c.hashes {
            local.record_add(gorgo_core::hash::fingerprint(h));
        }
    }
    let mut peer = PeerSummary::new();
    peer.apply_snapshot(local.snapshot());
    // A 32k-token prompt (500 blocks) that matches 100 blocks, then misses.
    let mut ids: Vec<u64> = (0..100).collect();
    ids.extend(10_000_000..10_000_400);
    let probe = HashChain::from_int_block_ids(&ids, 64, 32_000);
    assert_eq!(peer.longest_match_blocks(&probe), 100);
    let n = 200_000;
    per_op(
        "PeerSummary::matched_tokens, 100-block hit of 500",
        n,
        || {
            for _ in 0..n {
                black_box(peer.matched_tokens(black_box(&probe)));
            }
        },
    );

    let mut ix = ShadowIndex::new(2_000_000);
    let n = chains.len() as u64 * 20;
    per_op(
        "ShadowIndex::insert, 100-block chain, with eviction",
        n,
        || {
            for i in 0..n {
                ix.insert(&chains[(i as usize * 7) % chains.len()], i);
            }
        },
    );
    per_op("ShadowIndex::longest_match, 100-block chain", n, || {
        for i in 0..n {
            black_box(ix.longest_match(&chains[i as usize % chains.len()]));
        }
    });

    let prompt = vec![b'x'; 128 * 1024];
    let hasher = PromptHasher::default();
    let n = 2_000;
    per_op("PromptHasher::chain, 128 KiB prompt", n, || {
        for _ in 0..n {
            black_box(hasher.chain(black_box(&prompt)));
        }
    });

    let snapshot = local.snapshot();
    let bytes = encode(&snapshot);
    let n = 100;
    per_op("decode 100k-fingerprint snapshot", n, || {
        for _ in 0..n {
            let s: gorgo_core::SummarySnapshot = decode(&bytes, MAX_GOSSIP_MESSAGE).unwrap();
            black_box(s);
        }
    });
    eprintln!("snapshot of 100k fingerprints: {} bytes", bytes.len());
}
