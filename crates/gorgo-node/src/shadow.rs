//! The shadow prefix index of this node's own engine: which chained block hashes the
//! engine probably still caches, with LRU eviction under its KV token capacity.
//!
//! Kept small and private to the node until `gorgo_core::index::ShadowIndex` lands; the
//! interface (`insert`, `longest_match`) is the same so the swap is mechanical.

use std::collections::{BTreeMap, HashMap};

use gorgo_core::HashChain;

/// LRU set of chained block hashes with a token budget.
#[derive(Debug)]
pub struct ShadowIndex {
    capacity_tokens: u64,
    used_tokens: u64,
    tick: u64,
    entries: HashMap<u64, (u64, u32)>,
    by_age: BTreeMap<u64, u64>,
}

impl ShadowIndex {
    /// An empty index over `capacity_tokens`.
    pub fn new(capacity_tokens: u64) -> Self {
        ShadowIndex {
            capacity_tokens: capacity_tokens.max(1),
            used_tokens: 0,
            tick: 0,
            entries: HashMap::new(),
            by_age: BTreeMap::new(),
        }
    }

    /// Record that the engine was sent `chain` (its blocks are now cached).
    pub fn insert(&mut self, chain: &HashChain) {
        for (i, &h) in chain.hashes.iter().enumerate() {
            self.tick += 1;
            let tokens = chain.block_tokens.get(i).copied().unwrap_or(0);
            if let Some((age, _)) = self.entries.get_mut(&h) {
                self.by_age.remove(age);
                *age = self.tick;
            } else {
                self.entries.insert(h, (self.tick, tokens));
                self.used_tokens += tokens as u64;
            }
            self.by_age.insert(self.tick, h);
        }
        while self.used_tokens > self.capacity_tokens {
            let Some((_, h)) = self.by_age.pop_first() else {
                break;
            };
            if let Some((_, t)) = self.entries.remove(&h) {
                self.used_tokens -= t as u64;
            }
        }
    }

    /// Tokens of the longest prefix of `chain` held.
    pub fn longest_match(&self, chain: &HashChain) -> u64 {
        let blocks = chain
            .hashes
            .iter()
            .take_while(|h| self.entries.contains_key(h))
            .count();
        chain.prefix_tokens(blocks)
    }

    /// Number of blocks held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_oldest_under_capacity() {
        let mut idx = ShadowIndex::new(128);
        let a = HashChain::from_bytes(&[b'a'; 512], 256, 4);
        let b = HashChain::from_bytes(&[b'b'; 512], 256, 4);
        idx.insert(&a);
        assert_eq!(idx.longest_match(&a), 128);
        idx.insert(&b);
        assert_eq!(idx.longest_match(&b), 128);
        assert_eq!(idx.longest_match(&a), 0);
    }
}
