//! The shadow prefix index: a node's model of its own engine's prefix cache.
//!
//! The node cannot see inside the engine, so it replays what it sends there: every
//! dispatched prompt's hash chain is inserted, and blocks are evicted least recently
//! used first when the modelled cache exceeds the engine's KV capacity in tokens, the
//! way a radix prefix cache evicts (leaves first: a block is only evicted once no
//! cached block extends it). Its blocks' fingerprints are what the node gossips, so the
//! index owns the node's [`LocalSummary`] and reports every added and evicted block to
//! it.
//!
//! Structure: a forest of blocks (each block's parent is the previous block of its
//! chain) in a slab, a hash map from block hash to slot, and one intrusive LRU list of
//! all blocks. A chain is touched from its last block back to its first, so every
//! block is more recently used than all its descendants and the least recently used
//! block is always a leaf: eviction pops the list's tail, O(1) per block.

use std::collections::HashMap;

use crate::hash::{fingerprint, HashChain};
use crate::summary::{is_summarised, FingerprintBuildHasher, LocalSummary, SummarySample};

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Block {
    hash: u64,
    tokens: u32,
    parent: u32,
    first_child: u32,
    next_sibling: u32,
    prev_sibling: u32,
    /// Towards the most recently used end.
    newer: u32,
    /// Towards the least recently used end.
    older: u32,
    last_used_ms: u64,
}

/// The node's model of its engine's prefix cache. See the module docs.
#[derive(Debug, Clone)]
pub struct ShadowIndex {
    slots: Vec<Block>,
    free: Vec<u32>,
    by_hash: HashMap<u64, u32, U64BuildHasher>,
    /// Most recently used block.
    head: u32,
    /// Least recently used block (always a leaf).
    tail: u32,
    used_tokens: u64,
    capacity_tokens: u64,
    summary: LocalSummary,
}

/// Block hashes are xxh3 outputs already; hash them by a cheap multiply like
/// fingerprints.
type U64BuildHasher = FingerprintBuildHasher;

impl ShadowIndex {
    /// An empty index modelling a cache of `capacity_tokens` KV tokens, with a fresh
    /// [`LocalSummary`].
    pub fn new(capacity_tokens: u64) -> Self {
        Self::with_summary(capacity_tokens, LocalSummary::new())
    }

    /// An empty index whose summary keeps one block in `sample` (a cluster setting:
    /// see [`crate::summary::SampleChooser`]).
    pub fn with_sample(capacity_tokens: u64, sample: SummarySample) -> Self {
        Self::with_summary(capacity_tokens, LocalSummary::new().with_sample(sample))
    }

    /// An empty index reporting to `summary` (e.g. one seeded with
    /// [`LocalSummary::starting_at`], a custom log capacity or a sample), which must be
    /// empty: the index records its blocks at the summary's sample.
    pub fn with_summary(capacity_tokens: u64, summary: LocalSummary) -> Self {
        ShadowIndex {
            slots: Vec::new(),
            free: Vec::new(),
            by_hash: HashMap::default(),
            head: NIL,
            tail: NIL,
            used_tokens: 0,
            capacity_tokens,
            summary,
        }
    }

    /// The summary of this index's blocks, for gossip.
    pub fn summary(&self) -> &LocalSummary {
        &self.summary
    }

    /// Summarise one block in `sample` from now on: the blocks held whose fingerprint
    /// enters or leaves the set at the new rate are recorded as ordinary changes
    /// (version bumps; 1 -> 4 removes about three quarters, 4 -> 1 adds them back), so
    /// peers follow through the usual deltas or snapshots. O(blocks held), once per
    /// change of rate; a no-op when the rate is unchanged.
    pub fn set_summary_sample(&mut self, sample: SummarySample) {
        let old = self.summary.sample();
        if old == sample {
            return;
        }
        for &hash in self.by_hash.keys() {
            let fp = fingerprint(hash);
            match (is_summarised(fp, old), is_summarised(fp, sample)) {
                (true, false) => self.summary.record_remove(fp),
                (false, true) => self.summary.record_add(fp),
                _ => {}
            }
        }
        self.summary.set_sample(sample);
    }

    /// Tokens held by the modelled cache.
    pub fn used_tokens(&self) -> u64 {
        self.used_tokens
    }

    /// The modelled KV capacity in tokens.
    pub fn capacity_tokens(&self) -> u64 {
        self.capacity_tokens
    }

    /// Change the capacity (e.g. once the engine adapter reads the real one), evicting
    /// least recently used blocks until the index fits.
    pub fn set_capacity(&mut self, capacity_tokens: u64) {
        self.capacity_tokens = capacity_tokens;
        self.evict_to_capacity();
    }

    /// Number of blocks held.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// True when the block with chained hash `hash` is held.
    pub fn contains(&self, hash: u64) -> bool {
        self.by_hash.contains_key(&hash)
    }

    /// Tokens of `chain` the modelled cache holds: blocks walked from the start until
    /// the first miss.
    pub fn longest_match(&self, chain: &HashChain) -> u64 {
        chain.prefix_tokens(self.longest_match_blocks(chain))
    }

    /// Blocks of `chain` the modelled cache holds (see
    /// [`longest_match`](Self::longest_match)).
    pub fn longest_match_blocks(&self, chain: &HashChain) -> usize {
        chain
            .hashes
            .iter()
            .take_while(|h| self.by_hash.contains_key(h))
            .count()
    }

    /// A prompt was dispatched to the engine at `now_ms`: the engine now caches all of
    /// it. Touches the blocks held, adds the others, then evicts to capacity.
    pub fn insert(&mut self, chain: &HashChain, now_ms: u64) {
        self.insert_prefix(chain, chain.len(), now_ms);
        self.evict_to_capacity();
    }

    /// Insert the first `blocks` blocks of `chain` and touch them, last to first.
    fn insert_prefix(&mut self, chain: &HashChain, blocks: usize, now_ms: u64) {
        let blocks = blocks.min(chain.hashes.len()).min(chain.block_tokens.len());
        if blocks == 0 {
            return;
        }
        let mut parent = NIL;
        for i in 0..blocks {
            let h = chain.hashes[i];
            parent = match self.by_hash.get(&h) {
                Some(&slot) => slot,
                None => self.create(h, chain.block_tokens[i], parent, now_ms),
            };
        }
        // Touch from the last block up its parent links: each block ends up more
        // recent than its descendants, which keeps the LRU tail a leaf.
        let mut slot = parent;
        let mut steps = 0;
        while slot != NIL && steps < blocks {
            self.slots[slot as usize].last_used_ms = now_ms;
            self.move_to_head(slot);
            slot = self.slots[slot as usize].parent;
            steps += 1;
        }
    }

    /// The engine reported that this request found `engine_cached_tokens` of `chain`
    /// in its cache when its prefill ran; the index had predicted `predicted_tokens`
    /// when the request was dispatched at `dispatched_ms`.
    ///
    /// The count arrives with the end of the response (its usage), seconds or minutes
    /// after the prefill it describes, and the dispatch already inserted the chain. So
    /// it only ever removes: if the engine cached less than predicted (at least half a
    /// block less: the node's token counts may be estimates), the first block it
    /// missed had been evicted there, and with it everything that extended it; the
    /// blocks other requests hung below that point are dropped, those not used since
    /// the dispatch. Blocks used since were put there by requests that came after this
    /// one, whose prefill ran after this one's had recomputed the missed block. The
    /// chain's own blocks stay: the engine has just computed them.
    ///
    /// Nothing is added back and nothing reordered. Measured (docs/simulator.md, "Late
    /// corrections"): moving the chain to the LRU head, or re-adding the chain's
    /// blocks the index's LRU had dropped while the request ran, pushed out older
    /// prefixes of sessions that come back, and under KV pressure made the index a
    /// worse guide than no correction at all.
    pub fn correct(
        &mut self,
        chain: &HashChain,
        engine_cached_tokens: u64,
        predicted_tokens: u64,
        dispatched_ms: u64,
    ) {
        let n = chain.hashes.len().min(chain.block_tokens.len());
        // Blocks whose first half lies within a count. The chain's token counts are the
        // node's (exact with a tokenizer, learned estimates without: bytes per token and
        // the template's overhead on the first block), the engine's are its own;
        // requiring a whole block would read a count one token high as a miss of the
        // first block and drop every other prefix hung below it (measured live: a
        // one-token overhead estimate wiped the shadow index below the shared first
        // block on every cold request).
        let covered = |tokens: u64| {
            let (mut sum, mut k) = (0u64, 0);
            while k < n && sum + (chain.block_tokens[k] as u64).div_ceil(2) <= tokens {
                sum += chain.block_tokens[k] as u64;
                k += 1;
            }
            k
        };
        let k = covered(engine_cached_tokens);
        if k < covered(predicted_tokens) {
            if let Some(&missed) = self.by_hash.get(&chain.hashes[k]) {
                self.drop_off_chain_descendants(missed, chain, k, dispatched_ms);
            }
        }
    }

    /// The engine says it holds block `hash` below `parent` (its KV events:
    /// [`crate::kv_events`]): add it, or touch it if held. A parent not held makes it
    /// a first block. It enters the LRU order just behind its parent, so that parents
    /// stay more recent than their children without touching the whole chain, and the
    /// shadow model can take over from this picture. No eviction: the engine evicts.
    pub fn insert_block(&mut self, hash: u64, parent: Option<u64>, tokens: u32, now_ms: u64) {
        if let Some(&slot) = self.by_hash.get(&hash) {
            self.slots[slot as usize].last_used_ms = now_ms;
            return;
        }
        let parent_slot = parent
            .and_then(|p| self.by_hash.get(&p))
            .copied()
            .unwrap_or(NIL);
        let slot = self.create(hash, tokens, parent_slot, now_ms);
        if parent_slot != NIL {
            // `create` put it at the head; move it just older than its parent.
            self.unlink_lru(slot);
            let older = self.slots[parent_slot as usize].older;
            self.slots[slot as usize].newer = parent_slot;
            self.slots[slot as usize].older = older;
            self.slots[parent_slot as usize].older = slot;
            if older != NIL {
                self.slots[older as usize].newer = slot;
            } else {
                self.tail = slot;
            }
        }
    }

    /// The engine no longer matches block `hash`: remove it and every block below it.
    /// Returns whether it was held.
    pub fn remove_block(&mut self, hash: u64) -> bool {
        match self.by_hash.get(&hash) {
            Some(&slot) => {
                self.remove_subtree(slot);
                true
            }
            None => false,
        }
    }

    /// Forget every block (each leaves the summary as an ordinary change).
    pub fn clear(&mut self) {
        while self.tail != NIL {
            self.remove_subtree(self.tail);
        }
    }

    /// Below `slot` (block `depth` of `chain`), drop every block off the chain last
    /// used at or before `stale_by`.
    fn drop_off_chain_descendants(
        &mut self,
        mut slot: u32,
        chain: &HashChain,
        mut depth: usize,
        stale_by: u64,
    ) {
        loop {
            let next_on_chain = chain
                .hashes
                .get(depth + 1)
                .and_then(|h| self.by_hash.get(h))
                .copied();
            let mut child = self.slots[slot as usize].first_child;
            while child != NIL {
                let next = self.slots[child as usize].next_sibling;
                if Some(child) != next_on_chain {
                    self.drop_stale_subtree(child, stale_by);
                }
                child = next;
            }
            match next_on_chain {
                Some(c) if self.slots[c as usize].parent == slot => {
                    slot = c;
                    depth += 1;
                }
                _ => return,
            }
        }
    }

    /// Drop the blocks of the subtree at `root` last used at or before `stale_by`.
    /// A parent is touched whenever a child is, so a stale block's subtree is stale
    /// whole; a fresh one's is searched.
    fn drop_stale_subtree(&mut self, root: u32, stale_by: u64) {
        let mut fresh = vec![root];
        while let Some(slot) = fresh.pop() {
            if self.slots[slot as usize].last_used_ms <= stale_by {
                self.remove_subtree(slot);
                continue;
            }
            let mut child = self.slots[slot as usize].first_child;
            while child != NIL {
                fresh.push(child);
                child = self.slots[child as usize].next_sibling;
            }
        }
    }

    fn evict_to_capacity(&mut self) {
        while self.used_tokens > self.capacity_tokens && self.tail != NIL {
            let victim = self.tail;
            if self.slots[victim as usize].first_child == NIL {
                self.remove_leaf(victim);
            } else {
                // Unreachable while the LRU invariant holds; stay consistent anyway.
                self.remove_subtree(victim);
            }
        }
    }

    fn create(&mut self, hash: u64, tokens: u32, parent: u32, now_ms: u64) -> u32 {
        let block = Block {
            hash,
            tokens,
            parent,
            first_child: NIL,
            next_sibling: NIL,
            prev_sibling: NIL,
            newer: NIL,
            older: NIL,
            last_used_ms: now_ms,
        };
        let slot = match self.free.pop() {
            Some(s) => {
                self.slots[s as usize] = block;
                s
            }
            None => {
                self.slots.push(block);
                (self.slots.len() - 1) as u32
            }
        };
        if parent != NIL {
            let old_first = self.slots[parent as usize].first_child;
            self.slots[slot as usize].next_sibling = old_first;
            if old_first != NIL {
                self.slots[old_first as usize].prev_sibling = slot;
            }
            self.slots[parent as usize].first_child = slot;
        }
        self.push_head(slot);
        self.by_hash.insert(hash, slot);
        self.used_tokens += tokens as u64;
        if is_summarised(fingerprint(hash), self.summary.sample()) {
            self.summary.record_add(fingerprint(hash));
        }
        slot
    }

    /// Remove `root` and all its descendants, deepest first.
    fn remove_subtree(&mut self, root: u32) {
        let mut slot = root;
        loop {
            // Descend to a leaf.
            while self.slots[slot as usize].first_child != NIL {
                slot = self.slots[slot as usize].first_child;
            }
            let parent = self.slots[slot as usize].parent;
            let is_root = slot == root;
            self.remove_leaf(slot);
            if is_root {
                return;
            }
            slot = parent;
        }
    }

    fn remove_leaf(&mut self, slot: u32) {
        let b = self.slots[slot as usize].clone();
        debug_assert_eq!(b.first_child, NIL);
        if b.prev_sibling != NIL {
            self.slots[b.prev_sibling as usize].next_sibling = b.next_sibling;
        } else if b.parent != NIL {
            self.slots[b.parent as usize].first_child = b.next_sibling;
        }
        if b.next_sibling != NIL {
            self.slots[b.next_sibling as usize].prev_sibling = b.prev_sibling;
        }
        self.unlink_lru(slot);
        self.by_hash.remove(&b.hash);
        self.used_tokens -= b.tokens as u64;
        if is_summarised(fingerprint(b.hash), self.summary.sample()) {
            self.summary.record_remove(fingerprint(b.hash));
        }
        self.free.push(slot);
    }

    fn unlink_lru(&mut self, slot: u32) {
        let (newer, older) = {
            let b = &self.slots[slot as usize];
            (b.newer, b.older)
        };
        if newer != NIL {
            self.slots[newer as usize].older = older;
        } else {
            self.head = older;
        }
        if older != NIL {
            self.slots[older as usize].newer = newer;
        } else {
            self.tail = newer;
        }
        let b = &mut self.slots[slot as usize];
        b.newer = NIL;
        b.older = NIL;
    }

    fn push_head(&mut self, slot: u32) {
        let old_head = self.head;
        {
            let b = &mut self.slots[slot as usize];
            b.newer = NIL;
            b.older = old_head;
        }
        if old_head != NIL {
            self.slots[old_head as usize].newer = slot;
        } else {
            self.tail = slot;
        }
        self.head = slot;
    }

    fn move_to_head(&mut self, slot: u32) {
        if self.head == slot {
            return;
        }
        self.unlink_lru(slot);
        self.push_head(slot);
    }

    /// Check every structural invariant (tests and debugging): parent/child links,
    /// LRU list order (parents more recent than children), token and summary totals.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut rank = HashMap::new();
        let mut slot = self.head;
        let mut prev = NIL;
        while slot != NIL {
            let b = &self.slots[slot as usize];
            if b.newer != prev {
                return Err(format!("lru back link broken at {slot}"));
            }
            rank.insert(slot, rank.len());
            prev = slot;
            slot = b.older;
        }
        if prev != self.tail {
            return Err("lru tail wrong".into());
        }
        if rank.len() != self.by_hash.len() {
            return Err(format!(
                "lru has {} blocks, map {}",
                rank.len(),
                self.by_hash.len()
            ));
        }
        let mut tokens = 0u64;
        for (&hash, &slot) in &self.by_hash {
            let b = &self.slots[slot as usize];
            if b.hash != hash {
                return Err("map points to wrong slot".into());
            }
            tokens += b.tokens as u64;
            if b.parent != NIL {
                if rank[&b.parent] > rank[&slot] {
                    return Err("parent older than child".into());
                }
                let mut c = self.slots[b.parent as usize].first_child;
                let mut found = false;
                while c != NIL {
                    found |= c == slot;
                    c = self.slots[c as usize].next_sibling;
                }
                if !found {
                    return Err("child missing from parent's list".into());
                }
            }
            let summarised = is_summarised(fingerprint(hash), self.summary.sample());
            if summarised != self.summary.contains(fingerprint(hash)) {
                return Err(format!(
                    "summary disagrees on a block (summarised: {summarised})"
                ));
            }
        }
        if tokens != self.used_tokens {
            return Err(format!(
                "used_tokens {} but blocks hold {tokens}",
                self.used_tokens
            ));
        }
        if self.used_tokens > self.capacity_tokens {
            return Err("over capacity".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn chain(ids: &[u64]) -> HashChain {
        HashChain::from_int_block_ids(ids, 10, ids.len() as u64 * 10)
    }

    #[test]
    fn insert_match_and_lru_eviction() {
        let mut ix = ShadowIndex::new(50);
        ix.insert(&chain(&[1, 2, 3]), 0);
        assert_eq!(ix.longest_match(&chain(&[1, 2, 3, 4])), 30);
        assert_eq!(ix.longest_match(&chain(&[1, 5])), 10);
        ix.insert(&chain(&[1, 5]), 1); // shares block 1: 40 tokens
        assert_eq!(ix.used_tokens(), 40);
        ix.insert(&chain(&[7, 8]), 2); // 60 > 50: evict LRU leaf, [1,2,3]'s tail
        assert_eq!(ix.used_tokens(), 50);
        assert_eq!(ix.longest_match(&chain(&[1, 2, 3])), 20);
        ix.check_invariants().unwrap();
        ix.set_capacity(20);
        assert_eq!(ix.len(), 2);
        assert_eq!(ix.longest_match(&chain(&[7, 8])), 20);
        ix.check_invariants().unwrap();
        let c = chain(&[7, 8]);
        let summarised = (0..2)
            .filter(|&i| is_summarised(c.fingerprint(i), SummarySample::EVERY_BLOCK))
            .count();
        assert_eq!(ix.summary().len(), summarised);
    }

    #[test]
    fn shared_prefix_outlives_its_extensions() {
        let mut ix = ShadowIndex::new(40);
        ix.insert(&chain(&[1, 2]), 0);
        ix.insert(&chain(&[1, 3]), 1);
        ix.insert(&chain(&[9, 9]), 2); // evicts [1,2]'s leaf 2 first, never block 1
        assert!(ix.contains(chain(&[1]).hashes[0]));
        ix.check_invariants().unwrap();
    }

    #[test]
    fn correct_drops_stale_extensions_keeps_chain() {
        let mut ix = ShadowIndex::new(1_000);
        ix.insert(&chain(&[1, 2, 3]), 0);
        ix.insert(&chain(&[1, 2, 4, 5]), 1);
        // The next request on [1,2,3,6] hit only 10 tokens: block 2 had been evicted in
        // the engine, so [1,2,4,5] beyond block 1 is gone there.
        let c = chain(&[1, 2, 3, 6]);
        ix.insert(&c, 2);
        ix.correct(&c, 10, 30, 2);
        assert_eq!(ix.longest_match(&c), 40);
        assert_eq!(ix.longest_match(&chain(&[1, 2, 4, 5])), 20);
        ix.check_invariants().unwrap();
        // More than we modelled: a late count adds nothing (the blocks it speaks of
        // may have gone since; re-adding them pushed out prefixes that come back).
        let mut fresh = ShadowIndex::new(1_000);
        fresh.correct(&c, 40, 0, 4);
        assert_eq!(fresh.longest_match(&c), 0);
        fresh.check_invariants().unwrap();
    }

    #[test]
    fn a_late_correction_keeps_what_later_requests_put_there() {
        // A request on [1,2,3] is dispatched at 10 and finds only block 1 cached (2 had
        // been evicted). Before its count arrives with the end of its response (at
        // 50), a later request on [1,2,4] (at 20) ran after it: the engine holds block
        // 4. The one on [1,2,5], used last before the dispatch, went with block 2.
        let mut ix = ShadowIndex::new(1_000);
        ix.insert(&chain(&[1, 2, 5]), 5);
        let c = chain(&[1, 2, 3]);
        ix.insert(&c, 10);
        ix.insert(&chain(&[1, 2, 4]), 20);
        ix.correct(&c, 10, 20, 10);
        assert_eq!(ix.longest_match(&chain(&[1, 2, 4])), 30, "used since: kept");
        assert_eq!(ix.longest_match(&chain(&[1, 2, 5])), 20, "stale: dropped");
        assert_eq!(ix.longest_match(&c), 30);
        ix.check_invariants().unwrap();
    }

    #[test]
    fn a_count_one_token_high_is_not_a_miss_of_the_shared_first_block() {
        // Two sessions share their first block (a common system prompt). The node's
        // estimate counts that block one token higher than the engine (the learned
        // template overhead): the engine reporting exactly the block's 10 tokens cached
        // is a hit of block 0, not a miss that drops the other session's blocks.
        let mut ix = ShadowIndex::new(1_000);
        ix.insert(&chain(&[1, 2, 3]), 0);
        let mut c = chain(&[1, 7]);
        c.block_tokens[0] += 1;
        ix.insert(&c, 1);
        ix.correct(&c, 10, 11, 1);
        assert_eq!(
            ix.longest_match(&chain(&[1, 2, 3])),
            30,
            "the other session stays"
        );
        ix.check_invariants().unwrap();
    }

    #[test]
    fn oversized_chain_keeps_its_head() {
        let mut ix = ShadowIndex::new(25);
        let c = chain(&[1, 2, 3, 4]);
        ix.insert(&c, 0);
        assert_eq!(ix.longest_match(&c), 20);
        ix.check_invariants().unwrap();
        ix.insert(&HashChain::default(), 1);
    }

    #[test]
    fn changing_the_sample_re_derives_the_summary_as_changes() {
        let ids: Vec<u64> = (0..400).collect();
        let c = HashChain::from_int_block_ids(&ids, 10, 4_000);
        let mut ix = ShadowIndex::with_sample(1_000_000, SummarySample::EVERY_BLOCK);
        ix.insert(&c, 0);
        assert_eq!(ix.summary().len(), 400);
        let v = ix.summary().version();
        let four = SummarySample::from_rate(4).unwrap();
        let at_four = (0..400)
            .filter(|&i| is_summarised(c.fingerprint(i), four))
            .count();
        assert!(at_four > 50 && at_four < 150, "{at_four}");

        ix.set_summary_sample(four);
        ix.check_invariants().unwrap();
        assert_eq!(ix.summary().len(), at_four);
        assert_eq!(ix.summary().version(), v + (400 - at_four) as u64);
        let down = ix.summary().delta_since(v).unwrap();
        assert_eq!((down.added.len(), down.removed.len()), (0, 400 - at_four));
        assert_eq!(down.sample, four);
        // Unchanged rate: nothing moves.
        ix.set_summary_sample(four);
        assert_eq!(ix.summary().version(), v + (400 - at_four) as u64);

        let v4 = ix.summary().version();
        ix.set_summary_sample(SummarySample::EVERY_BLOCK);
        ix.check_invariants().unwrap();
        assert_eq!(ix.summary().len(), 400);
        let up = ix.summary().delta_since(v4).unwrap();
        assert_eq!((up.added.len(), up.removed.len()), (400 - at_four, 0));
        assert_eq!(up.sample, SummarySample::EVERY_BLOCK);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(Vec<u64>),
        Correct(Vec<u64>, u64),
        Capacity(u64),
        Sample(u8),
        Sync,
    }

    fn op() -> impl Strategy<Value = Op> {
        // Block ids from a small alphabet so chains share prefixes and branch.
        let ids = prop::collection::vec(0u64..4, 0..8);
        prop_oneof![
            6 => ids.clone().prop_map(Op::Insert),
            2 => (ids, 0u64..90).prop_map(|(c, t)| Op::Correct(c, t)),
            1 => (0u64..200).prop_map(Op::Capacity),
            1 => (0u8..=3).prop_map(Op::Sample),
            1 => Just(Op::Sync),
        ]
    }

    proptest! {
        /// Any sequence of operations, changes of sample included, keeps the structure
        /// consistent, under capacity, and the summary equal to the fingerprints of the
        /// blocks held that are summarised at the current sample; a peer syncing by
        /// deltas (snapshots on a gap) holds exactly that set and the sender's sample.
        #[test]
        fn invariants_hold(
            ops in prop::collection::vec(op(), 0..60),
            cap in 0u64..200,
            log_capacity in 1usize..64,
        ) {
            let mut ix = ShadowIndex::with_summary(cap, LocalSummary::with_log_capacity(log_capacity));
            let mut peer = crate::summary::PeerSummary::new();
            let sync = |ix: &ShadowIndex, peer: &mut crate::summary::PeerSummary| {
                match ix.summary().delta_since(peer.version()) {
                    Some(d) => peer.apply_delta(&d).unwrap(),
                    None => peer.apply_snapshot(ix.summary().snapshot()),
                }
            };
            for (t, op) in ops.into_iter().enumerate() {
                match op {
                    Op::Insert(ids) => ix.insert(&chain(&ids), t as u64),
                    Op::Correct(ids, tokens) => {
                        let c = chain(&ids);
                        let predicted = ix.longest_match(&c);
                        ix.correct(&c, tokens, predicted, (t as u64).saturating_sub(3))
                    }
                    Op::Capacity(c) => ix.set_capacity(c),
                    Op::Sample(bits) => ix.set_summary_sample(SummarySample::from_bits(bits).unwrap()),
                    Op::Sync => sync(&ix, &mut peer),
                }
                prop_assert_eq!(ix.check_invariants(), Ok(()));
            }
            let sample = ix.summary().sample();
            let mut fps: Vec<u32> = ix
                .by_hash
                .keys()
                .map(|&h| fingerprint(h))
                .filter(|&fp| is_summarised(fp, sample))
                .collect();
            fps.sort_unstable();
            fps.dedup();
            prop_assert_eq!(&fps, &ix.summary().snapshot().fingerprints);
            sync(&ix, &mut peer);
            let mut held: Vec<u32> = fps.iter().copied().filter(|&fp| peer.contains(fp)).collect();
            held.dedup();
            prop_assert_eq!(held.len(), peer.len());
            prop_assert_eq!(held, fps);
            prop_assert_eq!(peer.sample(), sample);
        }
    }
}
