//! The radix prefix cache, in tokens, over chain blocks.
//!
//! A chained block hash identifies its whole prefix, so a map from hash to node (with
//! its parent hash) *is* a radix tree: no edge labels, no token comparison. Each node
//! holds the tokens of one block, a reference count (requests using it now) and a
//! last-use stamp. Only unreferenced leaves are evicted, least recently used first;
//! evicting a leaf can make its parent an evictable leaf.
//!
//! Invariant: a request references every node of its matched/inserted path from the
//! root, so a node's refcount is at least any child's, and every unreferenced node sits
//! in an unreferenced subtree that leaf-first eviction can fully reclaim.

use std::collections::{BTreeSet, HashMap};

/// One block of a cached prefix.
#[derive(Debug, Clone)]
struct Node {
    /// Hash of the previous block, `None` for the first block of a prompt.
    parent: Option<u64>,
    /// Tokens this block holds.
    tokens: u32,
    /// Requests holding this block.
    refs: u32,
    /// Cached children.
    children: u32,
    /// Logical clock of the last release (LRU order).
    stamp: u64,
}

/// How much of a prompt the cache holds ([`RadixCache::match_prefix`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Leading blocks found: the ones a request references while it runs.
    pub blocks: usize,
    /// Prompt tokens they serve.
    pub tokens: u64,
    /// Tokens of the last matched block that its cached node lacks (it was cached by a
    /// shorter prompt): the request computes them and grows the node.
    pub short: u32,
    /// Tokens the last matched block's cached node holds beyond the prompt's block (a
    /// longer prompt cached it): a request referencing the node holds them without
    /// using them, which the engine's admission must allow for.
    pub long: u32,
}

/// Prefix cache over chain blocks with LRU eviction of unreferenced leaves.
#[derive(Debug, Default, Clone)]
pub struct RadixCache {
    nodes: HashMap<u64, Node>,
    /// Unreferenced leaves ordered by `(stamp, hash)`: the eviction order.
    evictable_leaves: BTreeSet<(u64, u64)>,
    /// Tokens of every cached node.
    cached_tokens: u64,
    /// Tokens of cached nodes with no reference (reclaimable by eviction).
    unreferenced_tokens: u64,
    clock: u64,
    /// Hashes evicted since the last [`take_evicted`](Self::take_evicted), when
    /// recorded (the engine's KV events): `None` records nothing.
    evicted: Option<Vec<u64>>,
}

impl RadixCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Record the hashes of evicted blocks (for [`take_evicted`](Self::take_evicted)).
    pub fn set_record_evictions(&mut self, on: bool) {
        self.evicted = on.then(Vec::new);
    }

    /// The blocks evicted since the last call, in eviction order (leaves first).
    pub fn take_evicted(&mut self) -> Vec<u64> {
        self.evicted
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Every cached block: (chained hash, tokens), in no order.
    pub fn blocks(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.nodes.iter().map(|(&h, n)| (h, n.tokens))
    }

    /// Tokens held by cached blocks (referenced or not).
    pub fn cached_tokens(&self) -> u64 {
        self.cached_tokens
    }

    /// Tokens that eviction could reclaim now.
    pub fn evictable_tokens(&self) -> u64 {
        self.unreferenced_tokens
    }

    /// Number of cached blocks.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// True when block `hash` is cached.
    pub fn contains(&self, hash: u64) -> bool {
        self.nodes.contains_key(&hash)
    }

    /// Reference count of block `hash` (0 when absent).
    pub fn refs(&self, hash: u64) -> u32 {
        self.nodes.get(&hash).map_or(0, |n| n.refs)
    }

    /// Tokens block `hash` holds (0 when absent).
    pub fn tokens(&self, hash: u64) -> u32 {
        self.nodes.get(&hash).map_or(0, |n| n.tokens)
    }

    /// The cached prefix of a prompt whose blocks are `hashes` holding `block_tokens`.
    ///
    /// A hash names a prefix, not its length: a prompt cut short (a trace's block id on
    /// a shortened last block) caches fewer tokens under a hash than a longer prompt
    /// puts there. What is reused is the tokens both hold, as a real radix cache reuses
    /// a common token prefix: of a matched block, the fewer of the node's and the
    /// prompt's tokens. Where the two differ, the prompts' tokens diverge within the
    /// block, so matching stops after it.
    pub fn match_prefix(&self, hashes: &[u64], block_tokens: &[u32]) -> PrefixMatch {
        let mut m = PrefixMatch::default();
        for (h, &want) in hashes.iter().zip(block_tokens) {
            let Some(node) = self.nodes.get(h) else {
                break;
            };
            m.blocks += 1;
            m.tokens += want.min(node.tokens) as u64;
            if node.tokens != want {
                m.short = want.saturating_sub(node.tokens);
                m.long = node.tokens.saturating_sub(want);
                break;
            }
        }
        m
    }

    /// Take a reference on a cached block (a request starts using it).
    ///
    /// Returns false (and does nothing) if the block is not cached.
    pub fn acquire(&mut self, hash: u64) -> bool {
        let Some(node) = self.nodes.get_mut(&hash) else {
            return false;
        };
        if node.refs == 0 {
            self.unreferenced_tokens -= node.tokens as u64;
            if node.children == 0 {
                self.evictable_leaves.remove(&(node.stamp, hash));
            }
        }
        node.refs += 1;
        true
    }

    /// Drop a reference taken with [`acquire`](Self::acquire) or [`insert`](Self::insert).
    pub fn release(&mut self, hash: u64) {
        self.clock += 1;
        let stamp = self.clock;
        let Some(node) = self.nodes.get_mut(&hash) else {
            return;
        };
        debug_assert!(node.refs > 0, "release of an unreferenced block");
        if node.refs == 0 {
            return;
        }
        node.refs -= 1;
        node.stamp = stamp;
        if node.refs == 0 {
            self.unreferenced_tokens += node.tokens as u64;
            if node.children == 0 {
                self.evictable_leaves.insert((stamp, hash));
            }
        }
    }

    /// Cache a newly computed block below `parent` and take one reference on it.
    ///
    /// The parent must be cached (and referenced by the caller) unless this is a first
    /// block. If the block is already cached (another request computed it meanwhile) this
    /// takes a reference and [grows](Self::grow) it to `tokens`; returns whether the
    /// block is new to the cache.
    pub fn insert(&mut self, hash: u64, parent: Option<u64>, tokens: u32) -> bool {
        if self.acquire(hash) {
            self.grow(hash, tokens);
            return false;
        }
        if let Some(p) = parent {
            if let Some(pn) = self.nodes.get_mut(&p) {
                if pn.children == 0 && pn.refs == 0 {
                    self.evictable_leaves.remove(&(pn.stamp, p));
                }
                pn.children += 1;
            }
        }
        self.clock += 1;
        self.nodes.insert(
            hash,
            Node {
                parent,
                tokens,
                refs: 1,
                children: 0,
                stamp: self.clock,
            },
        );
        self.cached_tokens += tokens as u64;
        true
    }

    /// Make cached block `hash` hold at least `tokens` tokens: a request computed the
    /// whole of a block that a shorter prompt cached only part of. Without it the
    /// request's computed tokens would leave its reservation without entering the
    /// cache, and KV in use would go uncounted. Returns the tokens added.
    pub fn grow(&mut self, hash: u64, tokens: u32) -> u64 {
        let Some(node) = self.nodes.get_mut(&hash) else {
            return 0;
        };
        let added = tokens.saturating_sub(node.tokens) as u64;
        node.tokens += added as u32;
        self.cached_tokens += added;
        if node.refs == 0 {
            self.unreferenced_tokens += added;
        }
        added
    }

    /// Evict least recently used unreferenced leaves until at least `tokens` tokens
    /// are freed or nothing is evictable. Returns the tokens freed.
    pub fn evict(&mut self, tokens: u64) -> u64 {
        let mut freed = 0;
        while freed < tokens {
            let Some((_, hash)) = self.evictable_leaves.pop_first() else {
                break;
            };
            let node = self.nodes.remove(&hash).expect("evictable leaf is cached");
            if let Some(log) = &mut self.evicted {
                log.push(hash);
            }
            freed += node.tokens as u64;
            self.cached_tokens -= node.tokens as u64;
            self.unreferenced_tokens -= node.tokens as u64;
            if let Some(p) = node.parent {
                if let Some(pn) = self.nodes.get_mut(&p) {
                    pn.children -= 1;
                    if pn.children == 0 && pn.refs == 0 {
                        self.evictable_leaves.insert((pn.stamp, p));
                    }
                }
            }
        }
        freed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn evicts_lru_leaf_first_and_never_referenced() {
        let mut c = RadixCache::new();
        // Chain a: 1 -> 2 ; chain b: 1 -> 3.
        c.insert(1, None, 10);
        c.insert(2, Some(1), 10);
        c.acquire(1);
        c.insert(3, Some(1), 10);
        // a finishes first, b is still running.
        c.release(2);
        c.release(1);
        assert_eq!(c.evictable_tokens(), 10);
        assert_eq!(c.evict(100), 10);
        assert!(!c.contains(2));
        assert!(c.contains(1) && c.contains(3));
        c.release(3);
        c.release(1);
        assert_eq!(c.evict(5), 10);
        assert!(!c.contains(3), "leaf goes before its parent");
        assert_eq!(c.evict(5), 10);
        assert!(c.is_empty());
        assert_eq!(c.cached_tokens(), 0);
    }

    proptest! {
        /// Random insert/release/evict sequences keep the token counters exact and
        /// never evict a referenced block.
        #[test]
        fn counters_stay_exact(ops in proptest::collection::vec((0u8..3, 0usize..6, 1u64..40), 1..200)) {
            let mut c = RadixCache::new();
            // Chains of length 6 from 3 different roots; held[i] = depth held by holder i.
            let mut held: Vec<(u64, usize)> = Vec::new();
            for (op, depth, x) in ops {
                match op {
                    0 => {
                        let root = x % 3;
                        let chain: Vec<u64> = (0..=depth as u64).map(|i| root * 100 + i + 1).collect();
                        let mut parent = None;
                        for &h in &chain {
                            c.insert(h, parent, 4);
                            parent = Some(h);
                        }
                        held.push((root, depth));
                    }
                    1 => {
                        if !held.is_empty() {
                            let (root, depth) = held.swap_remove(x as usize % held.len());
                            for i in 0..=depth as u64 {
                                c.release(root * 100 + i + 1);
                            }
                        }
                    }
                    _ => {
                        c.evict(x);
                    }
                }
                let total: u64 = c.nodes.values().map(|n| n.tokens as u64).sum();
                let unref: u64 = c.nodes.values().filter(|n| n.refs == 0).map(|n| n.tokens as u64).sum();
                prop_assert_eq!(total, c.cached_tokens());
                prop_assert_eq!(unref, c.evictable_tokens());
                for &(root, depth) in &held {
                    for i in 0..=depth as u64 {
                        prop_assert!(c.contains(root * 100 + i + 1));
                    }
                }
            }
            for (root, depth) in held.drain(..) {
                for i in 0..=depth as u64 {
                    c.release(root * 100 + i + 1);
                }
            }
            c.evict(u64::MAX);
            prop_assert!(c.is_empty());
        }
    }
}
