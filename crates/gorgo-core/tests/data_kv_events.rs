//! The KV-event follower against a reference model of an engine's block cache: the
//! node blocks it holds are exactly those whose engine blocks the engine matches, for
//! any engine and node block sizes, through evictions, clears, lost batches with
//! replay, publisher restarts and garbage.

use std::collections::HashMap;

use gorgo_core::hash::hash_bytes;
use gorgo_core::kv_events::{FollowerAction, IndexSource, KvEventFollower, KvFollowerConfig};
use gorgo_core::kv_wire::{encode_batch, encode_seq, KvEvent, KvEventBatch};
use gorgo_core::{HashChain, NodeBlockChange, ShadowIndex};
use proptest::prelude::*;

/// An engine's prefix cache as plainly as it can be written: blocks of `block_size`
/// token ids keyed by a hash of (parent, tokens), stored in runs as vLLM does (one
/// `BlockStored` per new run, parent the last block already cached), evicted leaf
/// first, or a whole subtree at once.
struct RefEngine {
    block_size: usize,
    blocks: HashMap<u64, (Option<u64>, Vec<u32>)>,
}

impl RefEngine {
    fn new(block_size: usize) -> Self {
        RefEngine {
            block_size,
            blocks: HashMap::new(),
        }
    }

    fn key(parent: Option<u64>, tokens: &[u32]) -> u64 {
        let mut bytes = parent.unwrap_or(0).to_le_bytes().to_vec();
        bytes.push(parent.is_some() as u8);
        tokens
            .iter()
            .for_each(|t| bytes.extend_from_slice(&t.to_le_bytes()));
        hash_bytes(&bytes)
    }

    fn store(&mut self, prompt: &[u32]) -> Option<KvEvent> {
        let mut parent = None;
        let (mut hashes, mut token_ids, mut run_parent) = (Vec::new(), Vec::new(), None);
        for block in prompt.chunks_exact(self.block_size) {
            let h = Self::key(parent, block);
            if let std::collections::hash_map::Entry::Vacant(e) = self.blocks.entry(h) {
                if hashes.is_empty() {
                    run_parent = parent;
                }
                e.insert((parent, block.to_vec()));
                hashes.push(h);
                token_ids.extend_from_slice(block);
            }
            parent = Some(h);
        }
        (!hashes.is_empty()).then(|| KvEvent::BlockStored {
            block_hashes: hashes,
            parent: run_parent,
            token_ids,
            block_size: self.block_size as u32,
            lora_id: None,
            medium: Some("GPU".into()),
            extra_keys_from: None,
        })
    }

    fn leaves(&self) -> Vec<u64> {
        let mut leaves: Vec<u64> = self
            .blocks
            .keys()
            .filter(|h| !self.blocks.values().any(|(p, _)| *p == Some(**h)))
            .copied()
            .collect();
        leaves.sort_unstable();
        leaves
    }

    fn evict_leaf(&mut self, pick: usize) -> Option<KvEvent> {
        let leaves = self.leaves();
        let h = *leaves.get(pick % leaves.len().max(1))?;
        self.blocks.remove(&h);
        Some(KvEvent::BlockRemoved {
            block_hashes: vec![h],
            medium: None,
        })
    }

    /// A block and all below it, listed root first (the follower must not care).
    fn evict_subtree(&mut self, pick: usize) -> Option<KvEvent> {
        let mut all: Vec<u64> = self.blocks.keys().copied().collect();
        all.sort_unstable();
        let root = *all.get(pick % all.len().max(1))?;
        let mut gone = vec![root];
        let mut i = 0;
        while i < gone.len() {
            let h = gone[i];
            gone.extend(
                self.blocks
                    .iter()
                    .filter(|(_, (p, _))| *p == Some(h))
                    .map(|(c, _)| *c),
            );
            i += 1;
        }
        gone.iter().for_each(|h| {
            self.blocks.remove(h);
        });
        Some(KvEvent::BlockRemoved {
            block_hashes: gone,
            medium: Some("GPU".into()),
        })
    }

    /// Tokens of `prompt` the engine would serve from its cache.
    fn matched_tokens(&self, prompt: &[u32]) -> usize {
        let mut parent = None;
        let mut n = 0;
        for block in prompt.chunks_exact(self.block_size) {
            let h = Self::key(parent, block);
            if !self.blocks.contains_key(&h) {
                break;
            }
            n += block.len();
            parent = Some(h);
        }
        n
    }
}

/// The node blocks of `prompt` the engine fully holds: what the follower must hold.
fn expected_node_blocks(engine: &RefEngine, prompt: &[u32], node_block: usize) -> usize {
    engine.matched_tokens(prompt) / node_block
}

fn held_node_blocks(f: &KvEventFollower, prompt: &[u32], node_block: usize) -> usize {
    let chain = HashChain::from_token_ids(prompt, node_block);
    chain
        .hashes
        .iter()
        .zip(&chain.block_tokens)
        .take_while(|(h, &t)| t as usize == node_block && f.contains_node_block(**h))
        .count()
}

/// Apply a follower's changes to a node index, as the node does.
fn apply(index: &mut ShadowIndex, changes: &[NodeBlockChange]) {
    for c in changes {
        match *c {
            NodeBlockChange::Added {
                hash,
                parent,
                tokens,
            } => index.insert_block(hash, parent, tokens, 0),
            NodeBlockChange::Removed { hash } => {
                index.remove_block(hash);
            }
            NodeBlockChange::Cleared => index.clear(),
        }
    }
}

fn message(seq: u64, events: Vec<KvEvent>) -> (u64, Vec<u8>) {
    let payload = encode_batch(&KvEventBatch {
        ts: seq as f64,
        events,
        data_parallel_rank: None,
        unknown_events: 0,
    });
    (seq, payload)
}

fn deliver(f: &mut KvEventFollower, seq: u64, payload: &[u8], now: u64) {
    f.on_message(&[b"kv", &encode_seq(seq as i64), payload], now);
}

/// Answer the follower's replay requests from `buffer` (seq, payload), as vLLM's
/// ROUTER does: every batch from the start seq, then the end marker.
fn serve_replays(f: &mut KvEventFollower, buffer: &[(u64, Vec<u8>)], now: u64) {
    for _ in 0..8 {
        let actions = f.take_actions();
        if actions.is_empty() {
            return;
        }
        for FollowerAction::RequestReplay { from_seq } in actions {
            for (seq, payload) in buffer.iter().filter(|(s, _)| *s >= from_seq) {
                f.on_replay_message(&[b"", &encode_seq(*seq as i64), payload], now);
            }
            f.on_replay_message(&[b"", &encode_seq(-1), b""], now);
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Store(Vec<u32>),
    EvictLeaf(usize),
    EvictSubtree(usize),
    Clear,
    Query(Vec<u32>),
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    // Tokens from a tiny alphabet so prompts share prefixes and branch.
    let prompt = prop::collection::vec(0u32..3, 0..40);
    prop_oneof![
        6 => prompt.clone().prop_map(Op::Store),
        3 => any::<usize>().prop_map(Op::EvictLeaf),
        1 => any::<usize>().prop_map(Op::EvictSubtree),
        1 => Just(Op::Clear),
        3 => prompt.prop_map(Op::Query),
        1 => Just(Op::Restart),
    ]
}

fn config(node_block: usize) -> KvFollowerConfig {
    KvFollowerConfig {
        replay: true,
        ..KvFollowerConfig::new(node_block)
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Any engine block size and node block size a multiple of it, any cache history, any batches lost on the
    /// way (replayed from the publisher's buffer), publisher restarts: the follower
    /// holds exactly the node blocks the engine matches, and a node index fed its
    /// changes agrees.
    #[test]
    fn follows_the_reference_engine(
        engine_block in 1usize..5,
        blocks_per_node in 1usize..4,
        ops in prop::collection::vec((op(), any::<bool>()), 1..60),
    ) {
        let node_block = engine_block * blocks_per_node;
        let mut engine = RefEngine::new(engine_block);
        let mut f = KvEventFollower::new(config(node_block), 0).unwrap();
        let mut index = ShadowIndex::new(u64::MAX);
        let mut buffer: Vec<(u64, Vec<u8>)> = Vec::new();
        let mut seq = 0u64;
        let mut just_restarted = true;
        // A batch lost and not yet noticed (no later batch came): the follower lags.
        let mut outstanding = false;
        for (t, (op, lost)) in ops.into_iter().enumerate() {
            let now = t as u64;
            let event = match &op {
                Op::Store(p) => engine.store(p),
                Op::EvictLeaf(i) => engine.evict_leaf(*i),
                Op::EvictSubtree(i) => engine.evict_subtree(*i),
                Op::Clear => Some(KvEvent::AllBlocksCleared),
                Op::Restart => {
                    engine = RefEngine::new(engine_block);
                    buffer.clear();
                    seq = 0;
                    just_restarted = true;
                    // Unseen until the new publisher's first batch.
                    outstanding = true;
                    None
                }
                Op::Query(_) if outstanding => None,
                Op::Query(p) => {
                    prop_assert_eq!(
                        held_node_blocks(&f, p, node_block),
                        expected_node_blocks(&engine, p, node_block)
                    );
                    let chain = HashChain::from_token_ids(p, node_block);
                    prop_assert_eq!(
                        index.longest_match_blocks(&chain).min(p.len() / node_block),
                        expected_node_blocks(&engine, p, node_block)
                    );
                    None
                }
            };
            if let Op::Clear = op {
                engine.blocks.clear();
            }
            let Some(event) = event else { continue };
            let (s, payload) = message(seq, vec![event]);
            seq += 1;
            buffer.push((s, payload.clone()));
            // A publisher's first batch after a restart always arrives: a restart
            // whose first batches are all lost is indistinguishable from a gap.
            if !lost || just_restarted {
                deliver(&mut f, s, &payload, now);
                serve_replays(&mut f, &buffer, now);
                outstanding = false;
            } else {
                outstanding = true;
            }
            just_restarted = false;
            apply(&mut index, &f.take_changes());
            prop_assert_eq!(index.check_invariants(), Ok(()));
        }
        // A last batch flushes any gap at the end.
        let (s, payload) = message(seq, vec![]);
        buffer.push((s, payload.clone()));
        deliver(&mut f, s, &payload, 1_000);
        serve_replays(&mut f, &buffer, 1_000);
        apply(&mut index, &f.take_changes());
        prop_assert_eq!(f.source(), IndexSource::Events);
        prop_assert_eq!(f.counters().resyncs, 0);
        prop_assert_eq!(index.len(), f.node_blocks());
    }
}

/// 4-byte "token ids" made of a byte prompt's 4-byte chunks hash to the same chain as
/// the bytes themselves (full blocks): a node without a tokenizer hashes canonical
/// bytes, and an emulator can publish those chunks as token ids.
#[test]
fn byte_chunks_as_token_ids_match_the_byte_chain() {
    let bytes: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
    let ids: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let by_bytes = HashChain::from_bytes(&bytes, 256, 4);
    let by_ids = HashChain::from_token_ids(&ids, 64);
    let full = bytes.len() / 256;
    assert_eq!(by_bytes.hashes[..full], by_ids.hashes[..full]);
}

fn stored(prompt: &[u32], block: usize, parent_key: Option<u64>) -> (Vec<u64>, KvEvent) {
    let mut parent = parent_key;
    let mut hashes = Vec::new();
    for b in prompt.chunks_exact(block) {
        let h = RefEngine::key(parent, b);
        hashes.push(h);
        parent = Some(h);
    }
    (
        hashes.clone(),
        KvEvent::BlockStored {
            block_hashes: hashes,
            parent: parent_key,
            token_ids: prompt.to_vec(),
            block_size: block as u32,
            lora_id: None,
            medium: None,
            extra_keys_from: None,
        },
    )
}

#[test]
fn engine_blocks_become_node_blocks_and_removal_cuts_descendants() {
    let mut f = KvEventFollower::new(KvFollowerConfig::new(64), 0).unwrap();
    let prompt: Vec<u32> = (0..200).collect();
    let (hashes, ev) = stored(&prompt[..192], 16, None);
    let (s, p) = message(0, vec![ev]);
    deliver(&mut f, s, &p, 0);
    assert_eq!(f.source(), IndexSource::Events, "seq 0: the whole history");
    assert_eq!(f.engine_blocks(), 12);
    assert_eq!(held_node_blocks(&f, &prompt, 64), 3);
    let changes = f.take_changes();
    assert_eq!(changes[0], NodeBlockChange::Cleared);
    assert_eq!(changes.len(), 4);
    // The engine evicts block 5 (tokens 80..96): node block 1 (64..128) and 2 go.
    let (s, p) = message(
        1,
        vec![KvEvent::BlockRemoved {
            block_hashes: vec![hashes[5]],
            medium: None,
        }],
    );
    deliver(&mut f, s, &p, 1);
    assert_eq!(held_node_blocks(&f, &prompt, 64), 1);
    assert_eq!(f.engine_blocks(), 5);
    let removed: Vec<_> = f
        .take_changes()
        .into_iter()
        .filter(|c| matches!(c, NodeBlockChange::Removed { .. }))
        .collect();
    assert_eq!(removed.len(), 2);
    // LoRA blocks, other tiers and orphans are ignored and counted.
    let (_, mut lora) = stored(&prompt[..16], 16, Some(12345));
    if let KvEvent::BlockStored { parent, .. } = &mut lora {
        *parent = None;
    }
    if let KvEvent::BlockStored { lora_id, .. } = &mut lora {
        *lora_id = Some(1);
    }
    let (_, orphan) = stored(&prompt[..16], 16, Some(999));
    let (s, p) = message(2, vec![lora, orphan, KvEvent::Unknown]);
    deliver(&mut f, s, &p, 2);
    assert_eq!(f.counters().ignored_blocks, 2);
    assert_eq!(f.engine_blocks(), 5);
}

#[test]
fn garbage_oversized_and_silence_resync_into_the_shadow_model() {
    let cfg = KvFollowerConfig {
        max_payload_bytes: 4096,
        warmup_ms: 100,
        silence_ms: 1_000,
        silence_dispatches: 2,
        ..KvFollowerConfig::new(4)
    };
    let mut f = KvEventFollower::new(cfg, 0).unwrap();
    let prompt: Vec<u32> = (0..16).collect();
    let (_, ev) = stored(&prompt, 4, None);
    let (s, p) = message(0, vec![ev]);
    deliver(&mut f, s, &p, 0);
    assert_eq!(f.source(), IndexSource::Events);
    assert_eq!(f.node_blocks(), 4);

    // Garbage with a good seq: a resync, the blocks kept unconfirmed (the engine
    // does not store what it still holds again).
    deliver(&mut f, 1, b"\xc1\xc1 not msgpack", 10);
    assert_eq!(f.source(), IndexSource::Shadow);
    assert_eq!(f.fallback_reason(), Some("undecodable batch"));
    assert_eq!(f.node_blocks(), 4);
    assert_eq!(f.unconfirmed_blocks(), 4);
    assert_eq!(f.counters().decode_errors, 1);
    // Wrong framing, a short seq, an oversized payload: counted, never a panic.
    f.on_message(&[b"only one frame"], 11);
    f.on_message(&[b"", b"123", b""], 12);
    f.on_message(&[b"", &encode_seq(2), &vec![0u8; 5000]], 13);
    assert_eq!(f.counters().decode_errors, 4);
    assert_eq!(f.counters().oversized, 1);

    // The stream comes back mid-way: the index waits for the warm-up, then follows
    // the events again; the first half stored again is confirmed.
    let (_, ev) = stored(&prompt[..8], 4, None);
    let (s, p) = message(5, vec![ev]);
    deliver(&mut f, s, &p, 20);
    assert_eq!(f.source(), IndexSource::Shadow);
    f.tick(119);
    assert_eq!(f.source(), IndexSource::Shadow);
    f.tick(120);
    assert_eq!(f.source(), IndexSource::Events);
    assert_eq!(f.node_blocks(), 4);
    assert_eq!(f.unconfirmed_blocks(), 2);
    assert_eq!(f.fallback_ms(120), 110);

    // Silence with requests served: a resync; silence without requests is fine.
    f.tick(5_000);
    assert_eq!(f.source(), IndexSource::Events);
    f.on_dispatch();
    f.on_dispatch();
    f.tick(5_001);
    assert_eq!(f.source(), IndexSource::Shadow);
    assert_eq!(f.fallback_reason(), Some("silent stream"));
    assert_eq!(f.counters().silences, 1);
}

#[test]
fn gaps_replay_and_restarts() {
    let cfg = KvFollowerConfig {
        replay_timeout_ms: 50,
        ..config(4)
    };
    let mut f = KvEventFollower::new(cfg, 0).unwrap();
    let mut engine = RefEngine::new(2);
    let mut buffer = Vec::new();
    for (i, p) in [[1u32, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9]]
        .iter()
        .enumerate()
    {
        buffer.push(message(i as u64, vec![engine.store(p).unwrap()]));
    }
    // Joining late: batch 1 first, the replay from 0 gives the whole history.
    deliver(&mut f, 1, &buffer[1].1, 0);
    assert_eq!(
        f.take_actions(),
        vec![FollowerAction::RequestReplay { from_seq: 0 }]
    );
    assert_eq!(f.source(), IndexSource::Shadow);
    for (s, p) in &buffer {
        f.on_replay_message(&[&encode_seq(*s as i64), p], 1);
    }
    f.on_replay_message(&[&encode_seq(-1), b""], 1);
    assert_eq!(f.source(), IndexSource::Events);
    assert_eq!(f.node_blocks(), 3);

    // A gap whose replay never comes: a resync after the timeout.
    buffer.push(message(2, vec![engine.evict_leaf(0).unwrap()]));
    buffer.push(message(3, vec![]));
    deliver(&mut f, 3, &buffer[3].1, 10);
    assert_eq!(f.counters().gaps, 1);
    assert_eq!(
        f.take_actions(),
        vec![FollowerAction::RequestReplay { from_seq: 2 }]
    );
    f.tick(59);
    assert_eq!(f.source(), IndexSource::Events);
    f.tick(60);
    assert_eq!(f.source(), IndexSource::Shadow);
    assert_eq!(f.fallback_reason(), Some("replay timed out"));
    assert_eq!(f.counters().replay_failures, 1);

    // A publisher that restarts starts from an empty cache at seq 0.
    let mut engine = RefEngine::new(2);
    let (s, p) = message(0, vec![engine.store(&[7, 7, 7, 7]).unwrap()]);
    deliver(&mut f, s, &p, 100);
    assert_eq!(f.counters().restarts, 1);
    assert_eq!(f.source(), IndexSource::Events);
    assert_eq!(f.node_blocks(), 1);
    assert_eq!(held_node_blocks(&f, &[7, 7, 7, 7], 4), 1);
}

/// Live batches held during a replay are capped in bytes and entries: a flood of tiny
/// messages while the replay is out ends it (a resync), the rest goes on.
#[test]
fn the_replay_backlog_is_bounded() {
    let cfg = KvFollowerConfig {
        max_pending_bytes: 64 * 100,
        ..config(4)
    };
    let mut f = KvEventFollower::new(cfg, 0).unwrap();
    let (s, p) = message(0, vec![]);
    deliver(&mut f, s, &p, 0);
    // Batch 1 is lost: 2 opens a replay, which never answers.
    for seq in 2..200 {
        let (s, p) = message(seq, vec![]);
        deliver(&mut f, s, &p, 1);
    }
    assert_eq!(f.counters().replays, 1);
    assert_eq!(f.counters().replay_failures, 1);
    assert_eq!(f.fallback_reason(), Some("replay backlog full"));
    // The held batches went on as a stream whose start is unknown.
    assert_eq!(f.counters().batches, 1 + 198);
}

/// A flood of batches with a gap before each (a publisher gone wrong, or hostile)
/// while a replay is out: when the backlog overflows, the batches it held are fed
/// again once, resyncing at their gaps, not asking for a replay at each (which held
/// the rest again and re-fed them once per entry freed: quadratic work under the lock
/// the request path takes, and a stack frame per entry).
#[test]
fn a_backlog_of_gapped_batches_is_fed_again_once() {
    let cfg = KvFollowerConfig {
        max_pending_bytes: 64 * 100,
        ..config(4)
    };
    let mut f = KvEventFollower::new(cfg, 0).unwrap();
    let (s, p) = message(0, vec![]);
    deliver(&mut f, s, &p, 0);
    for i in 0..1000u64 {
        let (s, p) = message(3 + 2 * i, vec![]);
        deliver(&mut f, s, &p, 1);
    }
    let c = f.counters();
    // One replay per backlog's worth of batches, not one per batch.
    assert!(c.replays <= 20, "{c:?}");
    assert!(c.replay_failures >= 1, "{c:?}");
}

proptest! {
    /// Whatever arrives on either socket, in any framing, the follower neither
    /// panics nor holds more than its caps, and a good batch after it is applied.
    #[test]
    fn any_bytes_never_panic(
        messages in prop::collection::vec(
            (prop::collection::vec(prop::collection::vec(any::<u8>(), 0..40), 0..5), any::<bool>()),
            0..40,
        ),
        mutate in prop::collection::vec((any::<usize>(), any::<u8>()), 0..8),
    ) {
        let cfg = KvFollowerConfig {
            max_engine_blocks: 64,
            max_payload_bytes: 1024,
            replay_timeout_ms: 5,
            ..config(4)
        };
        let mut f = KvEventFollower::new(cfg, 0).unwrap();
        // A real batch with bytes flipped, as well as raw garbage.
        let mut engine = RefEngine::new(2);
        let (_, mut good) = message(0, vec![engine.store(&[1, 2, 3, 4, 5, 6, 7, 8]).unwrap()]);
        for (i, b) in mutate {
            let n = good.len();
            good[i % n] = b;
        }
        for (now, (frames, replay)) in messages.iter().enumerate() {
            let mut parts: Vec<&[u8]> = frames.iter().map(|f| f.as_slice()).collect();
            if parts.len() == 3 {
                parts[2] = &good;
            }
            if *replay {
                f.on_replay_message(&parts, now as u64);
            } else {
                f.on_message(&parts, now as u64);
            }
            f.tick(now as u64);
            prop_assert!(f.engine_blocks() <= 64);
            f.take_changes();
            f.take_actions();
        }
        f.tick(1_000);
        let (_, fine) = message(1_000, vec![]);
        let before = f.counters().batches;
        deliver(&mut f, 1_000, &fine, 1_001);
        f.tick(1_002);
        prop_assert!(f.counters().batches > before || f.take_actions().len() == 1);
    }
}

/// On subscribing, the follower asks for the publisher's buffer: what was published
/// before the subscription took effect comes from there, and an empty buffer means an
/// empty cache, followed at once.
#[test]
fn subscribing_asks_for_the_buffered_history() {
    let mut f = KvEventFollower::new(config(4), 0).unwrap();
    f.on_subscribed(0);
    assert_eq!(
        f.take_actions(),
        vec![FollowerAction::RequestReplay { from_seq: 0 }]
    );
    f.on_replay_message(&[b"", &encode_seq(-1), b""], 1);
    assert_eq!(f.source(), IndexSource::Events, "nothing published yet");
    let mut engine = RefEngine::new(2);
    let (s, p) = message(0, vec![engine.store(&[1, 2, 3, 4]).unwrap()]);
    deliver(&mut f, s, &p, 2);
    assert_eq!(f.node_blocks(), 1);

    // Published before the subscription: the replay brings it.
    let mut f = KvEventFollower::new(config(4), 0).unwrap();
    f.on_subscribed(10);
    f.take_actions();
    f.on_replay_message(&[b"", &encode_seq(0), &p], 11);
    f.on_replay_message(&[b"", &encode_seq(-1), b""], 11);
    assert_eq!(f.source(), IndexSource::Events);
    assert_eq!(f.node_blocks(), 1);
    assert_eq!(f.counters().gaps, 0);
    // Without a replay socket there is nothing to ask.
    let mut f = KvEventFollower::new(KvFollowerConfig::new(4), 0).unwrap();
    f.on_subscribed(0);
    assert!(f.take_actions().is_empty());
}

/// A replay that ends short of the batches held (the replay socket holds less, or
/// belongs to another engine) is a failed replay: counted, a resync, and no second
/// request for the same missing batches (which came back at once, for ever).
#[test]
fn a_short_replay_is_a_failure_not_a_loop() {
    let mut f = KvEventFollower::new(config(4), 0).unwrap();
    let mut engine = RefEngine::new(2);
    let batches: Vec<_> = (0..3u32)
        .map(|i| message(u64::from(i), vec![engine.store(&[i, i, i, i]).unwrap()]))
        .collect();
    deliver(&mut f, batches[0].0, &batches[0].1, 0);
    deliver(&mut f, batches[2].0, &batches[2].1, 1);
    assert_eq!(
        f.take_actions(),
        vec![FollowerAction::RequestReplay { from_seq: 1 }]
    );
    // The replay socket has nothing from seq 1 on: just the end marker.
    f.on_replay_message(&[b"", &encode_seq(-1), b""], 2);
    assert_eq!(
        f.take_actions(),
        vec![],
        "asked again for what is not there"
    );
    assert_eq!(f.counters().replay_failures, 1);
    assert_eq!(f.counters().replays, 1);
    assert_eq!(f.fallback_reason(), Some("replay incomplete"));
    // The batch held was fed again as a new stream's start.
    assert_eq!(held_node_blocks(&f, &[2, 2, 2, 2], 4), 1);
}

/// vLLM keeps duplicate physical blocks of one hash (two requests with the same new
/// prefix in one step) and stores and evicts each: the prefix stays in the index
/// until its last copy goes.
#[test]
fn a_block_stored_twice_stays_until_both_copies_are_removed() {
    let mut f = KvEventFollower::new(KvFollowerConfig::new(64), 0).unwrap();
    let prompt: Vec<u32> = (0..128).collect();
    let (hashes, ev) = stored(&prompt, 16, None);
    let (s, p) = message(0, vec![ev.clone(), ev]);
    deliver(&mut f, s, &p, 0);
    assert_eq!(held_node_blocks(&f, &prompt, 64), 2);
    let remove_first = || KvEvent::BlockRemoved {
        block_hashes: vec![hashes[0]],
        medium: None,
    };
    let (s, p) = message(1, vec![remove_first()]);
    deliver(&mut f, s, &p, 1);
    assert_eq!(held_node_blocks(&f, &prompt, 64), 2, "one copy is left");
    assert_eq!(f.engine_blocks(), 8);
    let (s, p) = message(2, vec![remove_first()]);
    deliver(&mut f, s, &p, 2);
    assert_eq!(held_node_blocks(&f, &prompt, 64), 0);
    assert_eq!(f.engine_blocks(), 0);
}

/// An engine whose block hashes name a page by its own tokens alone (not by its
/// prefix: a hash that comes back under another parent) claims no prefix it does not
/// hold: a page seen again under another parent stops the event there. Before, the
/// follower went on from where that hash first stood, and chained the next page as a
/// first block: `[5, 9]` held though the engine holds `[5, 7, 5, 9]`.
#[test]
fn a_hash_seen_again_under_another_parent_claims_nothing_after_it() {
    let mut f = KvEventFollower::new(KvFollowerConfig::new(2), 0).unwrap();
    let page = |t: u32| 1_000 + u64::from(t);
    let ev = KvEvent::BlockStored {
        block_hashes: vec![page(5), page(7), page(5), page(9)],
        parent: None,
        token_ids: vec![5, 7, 5, 9],
        block_size: 1,
        lora_id: None,
        medium: None,
        extra_keys_from: None,
    };
    let (s, p) = message(0, vec![ev]);
    deliver(&mut f, s, &p, 0);
    assert_eq!(
        held_node_blocks(&f, &[5, 9], 2),
        0,
        "a prefix the engine does not hold"
    );
    assert_eq!(held_node_blocks(&f, &[5, 7, 5, 9], 2), 1);
    assert_eq!(f.counters().ignored_blocks, 2);
}

/// A publisher that restarts and whose first batches are lost (its sequence goes back,
/// not to 0) belongs to a restarted engine, whose cache starts empty: the index is
/// cleared. Before, the dead engine's blocks stayed in it while the shadow model
/// carried on from them.
#[test]
fn a_publisher_back_at_a_lower_sequence_clears_the_index() {
    let mut f = KvEventFollower::new(KvFollowerConfig::new(64), 0).unwrap();
    let prompt: Vec<u32> = (0..128).collect();
    let (_, ev) = stored(&prompt, 16, None);
    let (s, p) = message(0, vec![ev]);
    deliver(&mut f, s, &p, 0);
    for seq in 1..10 {
        let (s, p) = message(seq, Vec::new());
        deliver(&mut f, s, &p, seq);
    }
    assert_eq!(f.source(), IndexSource::Events);
    assert_eq!(held_node_blocks(&f, &prompt, 64), 2);
    f.take_changes();
    let (s, p) = message(3, Vec::new());
    deliver(&mut f, s, &p, 10);
    assert!(f.take_changes().contains(&NodeBlockChange::Cleared));
    assert_eq!(held_node_blocks(&f, &prompt, 64), 0);
    assert_eq!(f.counters().restarts, 1);
}

/// A stream silent while the index is on the shadow model (no batch yet since the
/// subscription, requests sent) is a silence too, so the node subscribes again on a new
/// connection; a new subscription starts the clock anew. Before, silence was checked
/// only while following events: a connection dead before its first batch was never
/// replaced.
#[test]
fn a_stream_silent_before_its_first_batch_is_a_silence() {
    let cfg = KvFollowerConfig {
        silence_ms: 1_000,
        silence_dispatches: 2,
        ..KvFollowerConfig::new(64)
    };
    let mut f = KvEventFollower::new(cfg, 0).unwrap();
    f.on_subscribed(0);
    assert_eq!(f.source(), IndexSource::Shadow);
    f.on_dispatch();
    f.on_dispatch();
    f.tick(999);
    assert_eq!(f.counters().silences, 0);
    f.tick(1_000);
    assert_eq!(f.counters().silences, 1);
    // Subscribed again: its own clock, its own dispatches.
    f.on_subscribed(1_001);
    f.on_dispatch();
    f.tick(2_500);
    assert_eq!(f.counters().silences, 1);
    f.on_dispatch();
    f.tick(2_500);
    assert_eq!(f.counters().silences, 2);
}

/// Blocks of 32 after a block of 16 start off the 32-token grid: they are not read. A
/// node block of 64 would end inside the third of them ([48, 80]) and claim 16 tokens
/// the engine matches only with the whole block; before, a prompt that shares the first
/// 64 tokens but not the next 16 was held at one node block.
#[test]
fn blocks_off_their_own_grid_are_not_read() {
    let mut f = KvEventFollower::new(KvFollowerConfig::new(64), 0).unwrap();
    let prompt: Vec<u32> = (0..80).collect();
    let (first, ev) = stored(&prompt[..16], 16, None);
    let (_, rest) = stored(&prompt[16..], 32, Some(first[0]));
    let (s, p) = message(0, vec![ev, rest]);
    deliver(&mut f, s, &p, 0);
    let mut diverging = prompt[..70].to_vec();
    diverging.extend([9_000, 9_001]);
    assert_eq!(held_node_blocks(&f, &diverging, 64), 0);
    assert_eq!(f.counters().ignored_blocks, 2);
}

/// One batch of a scheduler step of SGLang's one-token pages: 70,000 chained
/// `BlockStored` events (past the 65,536 events a batch once held at most, within the
/// byte cap) are applied, no resync; and so are 70,000 `BlockRemoved` (a long radix
/// leaf evicted page by page). Before, each batch was refused and every block forgotten.
#[test]
fn a_batch_of_70k_one_token_pages_is_applied() {
    let mut f = KvEventFollower::new(KvFollowerConfig::new(64), 0).unwrap();
    let prompt: Vec<u32> = (0..70_000).collect();
    let mut hashes = Vec::new();
    let mut parent = None;
    let stores: Vec<KvEvent> = prompt
        .iter()
        .map(|&t| {
            let h = RefEngine::key(parent, &[t]);
            let ev = KvEvent::BlockStored {
                block_hashes: vec![h],
                parent,
                token_ids: vec![t],
                block_size: 1,
                lora_id: None,
                medium: Some("GPU".into()),
                extra_keys_from: None,
            };
            hashes.push(h);
            parent = Some(h);
            ev
        })
        .collect();
    let (s, p) = message(0, stores);
    assert!(p.len() <= gorgo_core::kv_wire::DEFAULT_MAX_PAYLOAD_BYTES);
    deliver(&mut f, s, &p, 0);
    assert_eq!(f.counters().resyncs, 0);
    assert_eq!(f.source(), IndexSource::Events);
    assert_eq!(f.engine_blocks(), 70_000);
    assert_eq!(f.node_blocks(), 70_000 / 64);
    assert_eq!(held_node_blocks(&f, &prompt, 64), 70_000 / 64);
    // The leaf evicted page by page, the last first.
    let removals: Vec<KvEvent> = hashes
        .iter()
        .rev()
        .map(|&h| KvEvent::BlockRemoved {
            block_hashes: vec![h],
            medium: Some("GPU".into()),
        })
        .collect();
    let (s, p) = message(1, removals);
    deliver(&mut f, s, &p, 1);
    assert_eq!(f.counters().resyncs, 0);
    assert_eq!(f.counters().decode_errors, 0);
    assert_eq!((f.engine_blocks(), f.node_blocks()), (0, 0));
    assert_eq!(f.counters().events, 140_000);
}

/// vLLM's extra keys in the map form: four blocks whose first folds in a cache salt
/// (`[["salt"], null, null, null]`). The same tokens unsalted are not what the engine
/// holds, so none of the four is a node block (the three after it chain from it):
/// counted like LoRA blocks. A salt from the third block keeps the two before it.
#[test]
fn blocks_under_extra_keys_are_not_plain_token_blocks() {
    #[derive(serde::Serialize)]
    struct Stored {
        #[serde(rename = "type")]
        tag: &'static str,
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<i64>,
        medium: &'static str,
        lora_name: Option<&'static str>,
        extra_keys: Vec<Option<(&'static str,)>>,
    }
    #[derive(serde::Serialize)]
    struct Batch {
        ts: f64,
        events: Vec<Stored>,
    }
    let payload = |hashes: Vec<u64>, prompt: &[u32], keyed: usize| {
        rmp_serde::to_vec_named(&Batch {
            ts: 0.0,
            events: vec![Stored {
                tag: "BlockStored",
                block_hashes: hashes,
                parent_block_hash: None,
                token_ids: prompt.to_vec(),
                block_size: 16,
                lora_id: None,
                medium: "GPU",
                lora_name: None,
                extra_keys: (0..4).map(|i| (i == keyed).then_some(("salt",))).collect(),
            }],
        })
        .unwrap()
    };
    let prompt: Vec<u32> = (0..64).collect();
    let (hashes, _) = stored(&prompt, 16, None);
    // Node blocks of 16 tokens: one per engine block.
    let mut f = KvEventFollower::new(KvFollowerConfig::new(16), 0).unwrap();
    deliver(&mut f, 0, &payload(hashes.clone(), &prompt, 0), 0);
    assert_eq!(f.source(), IndexSource::Events);
    assert_eq!(held_node_blocks(&f, &prompt, 16), 0);
    assert_eq!((f.engine_blocks(), f.node_blocks()), (0, 0));
    assert_eq!(f.counters().ignored_blocks, 4);
    // Keyed from the third block: the two plain ones before it are held.
    let mut f = KvEventFollower::new(KvFollowerConfig::new(16), 0).unwrap();
    deliver(&mut f, 0, &payload(hashes, &prompt, 2), 0);
    assert_eq!(held_node_blocks(&f, &prompt, 16), 2);
    assert_eq!(f.engine_blocks(), 2);
    assert_eq!(f.counters().ignored_blocks, 2);
}

/// SGLang in EAGLE mode stores pages of token pairs: the store is counted as ignored,
/// the removal beside it in the batch applied, no resync. Before, the whole batch did
/// not decode, and the node resynced on each.
#[test]
fn a_token_pair_store_is_ignored_and_its_batch_applied() {
    let mut f = KvEventFollower::new(KvFollowerConfig::new(1), 0).unwrap();
    let plain = rmp_serde::to_vec(&(
        0.0f64,
        (("BlockStored", vec![9u64], (), vec![7u32], 1u8, (), "GPU"),),
    ))
    .unwrap();
    deliver(&mut f, 0, &plain, 0);
    assert_eq!(held_node_blocks(&f, &[7], 1), 1);
    // [0.0, [["BlockStored",[1],null,[[1,2]],1,null,"GPU"], ["BlockRemoved",[9],"GPU"]]]
    let pairs = rmp_serde::to_vec(&(
        0.0f64,
        (
            (
                "BlockStored",
                vec![1u64],
                (),
                vec![(1u32, 2u32)],
                1u8,
                (),
                "GPU",
            ),
            ("BlockRemoved", vec![9u64], "GPU"),
        ),
    ))
    .unwrap();
    deliver(&mut f, 1, &pairs, 1);
    assert_eq!(f.counters().resyncs, 0);
    assert_eq!(f.counters().decode_errors, 0);
    assert_eq!(f.counters().ignored_blocks, 1);
    assert_eq!(held_node_blocks(&f, &[7], 1), 0);
    assert_eq!(f.engine_blocks(), 0);
    assert_eq!(f.source(), IndexSource::Events);
}

/// A closed connection to the publisher may be an engine restart whose first batches
/// were lost: its next seq can read as no gap at all. The picture is not trusted (a
/// resync onto the shadow model, the dead engine's blocks forgotten), the next
/// subscription asks for the whole buffer again, and the stream is followed by the
/// usual rules: here the warm-up.
#[test]
fn a_closed_connection_is_a_possible_restart() {
    let cfg = KvFollowerConfig {
        warmup_ms: 100,
        replay: true,
        ..KvFollowerConfig::new(64)
    };
    let mut f = KvEventFollower::new(cfg, 0).unwrap();
    let old: Vec<u32> = (0..128).collect();
    let (_, ev) = stored(&old, 16, None);
    let (s, p) = message(0, vec![ev]);
    deliver(&mut f, s, &p, 0);
    assert_eq!(held_node_blocks(&f, &old, 64), 2);
    f.take_changes();
    f.on_disconnected(10);
    assert_eq!(f.source(), IndexSource::Shadow);
    assert_eq!(f.fallback_reason(), Some("publisher connection closed"));
    assert_eq!((f.counters().disconnects, f.counters().resyncs), (1, 1));
    assert_eq!(held_node_blocks(&f, &old, 64), 0);
    // Subscribed again: the whole buffer asked for, as at the start.
    f.on_subscribed(20);
    assert_eq!(
        f.take_actions(),
        vec![FollowerAction::RequestReplay { from_seq: 0 }]
    );
    // The new engine's buffer no longer starts at 0 and its next batch is seq 1, as
    // if nothing had happened: followed only after the warm-up, without the old blocks.
    let new: Vec<u32> = (1_000..1_128).collect();
    let (_, ev) = stored(&new, 16, None);
    let (_, p) = message(1, vec![ev]);
    f.on_replay_message(&[&encode_seq(1), &p], 30);
    f.on_replay_message(&[&encode_seq(-1), b""], 30);
    deliver(&mut f, 2, &message(2, Vec::new()).1, 40);
    assert_eq!(f.source(), IndexSource::Shadow);
    f.tick(130);
    assert_eq!(f.source(), IndexSource::Events);
    assert_eq!(held_node_blocks(&f, &new, 64), 2);
    assert_eq!(held_node_blocks(&f, &old, 64), 0);
}
