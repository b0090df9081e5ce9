//! The node's model of its own engine's prefix cache (`gorgo_core::ShadowIndex`), plus
//! the bookkeeping that hands its summary changes to the cluster for gossip.

use gorgo_core::summary::SummaryDelta;
use gorgo_core::{HashChain, ShadowIndex};

/// The shadow index and how far its summary has been handed to gossip.
#[derive(Debug)]
pub struct LocalCache {
    index: ShadowIndex,
    published_version: u64,
}

impl LocalCache {
    /// An empty model of a cache of `capacity_tokens`.
    pub fn new(capacity_tokens: u64) -> Self {
        LocalCache {
            index: ShadowIndex::new(capacity_tokens.max(1)),
            published_version: 0,
        }
    }

    /// Tokens of `chain`'s prefix the engine probably caches.
    pub fn longest_match(&self, chain: &HashChain) -> u64 {
        self.index.longest_match(chain)
    }

    /// Record a dispatch of `chain` to the engine; returns the summary changes to
    /// gossip (`None` when nothing changed).
    pub fn insert(&mut self, chain: &HashChain, now_ms: u64) -> Option<SummaryDelta> {
        self.index.insert(chain, now_ms);
        self.take_delta()
    }

    /// Correct the model with the engine's own count of cached prompt tokens.
    pub fn correct(
        &mut self,
        chain: &HashChain,
        cached_tokens: u64,
        now_ms: u64,
    ) -> Option<SummaryDelta> {
        self.index.correct(chain, cached_tokens, now_ms);
        self.take_delta()
    }

    /// Follow the engine's real capacity once known.
    pub fn set_capacity(&mut self, capacity_tokens: u64) -> Option<SummaryDelta> {
        if capacity_tokens > 0 && capacity_tokens != self.index.capacity_tokens() {
            self.index.set_capacity(capacity_tokens);
        }
        self.take_delta()
    }

    fn take_delta(&mut self) -> Option<SummaryDelta> {
        let summary = self.index.summary();
        if summary.version() == self.published_version {
            return None;
        }
        let delta = summary.delta_since(self.published_version);
        self.published_version = summary.version();
        delta
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Tokens held.
    pub fn used_tokens(&self) -> u64 {
        self.index.used_tokens()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inserts_yield_deltas_once() {
        let mut c = LocalCache::new(10_000);
        // Enough blocks that some are summarised (one in `SUMMARY_SAMPLE`).
        let text: Vec<u8> = (0..16 * 256).map(|i| (i % 251) as u8).collect();
        let chain = HashChain::from_bytes(&text, 256, 4);
        let summarised = (0..chain.len())
            .filter(|&i| gorgo_core::summary::is_summarised(chain.fingerprint(i)))
            .count();
        assert!(summarised > 0);
        let d = c
            .insert(&chain, 0)
            .expect("first insert changes the summary");
        assert_eq!(d.added.len(), summarised);
        assert!(c.insert(&chain, 1).is_none());
        assert_eq!(c.longest_match(&chain), chain.prefix_tokens(chain.len()));
    }
}
