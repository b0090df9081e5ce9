//! The node's model of its own engine's prefix cache (`gorgo_core::ShadowIndex`), plus
//! the bookkeeping that hands its summary changes to the cluster for gossip and keeps
//! its summary sample in step with the cluster's size (`cluster.summary_sample`).
//!
//! The index has two sources (`engine.kv_events`, docs/kv-events.md): the shadow
//! model (inserted at dispatch, corrected from `cached_tokens`, evicted by its LRU at
//! the engine's capacity) or the engine's KV events (blocks added and removed as the
//! engine says, nothing modelled). One index serves both, so its summary and what
//! peers hold of it carry on across a switch as ordinary changes.

use gorgo_core::summary::{
    FingerprintSet, SampleChooser, SampleSetting, SummaryDelta, SummarySample,
};
use gorgo_core::{HashChain, IndexSource, NodeBlockChange, ShadowIndex};

/// The shadow index, how far its summary has been handed to gossip, and the choice of
/// its summary sample.
#[derive(Debug)]
pub struct LocalCache {
    index: ShadowIndex,
    published_version: u64,
    published_sample: SummarySample,
    /// The set as handed out (at `published_version`): what the gossiped mirror holds.
    /// One change larger than the summary's log (an engine's cache cleared, a sample
    /// change, on a large index) has no delta in it; it is handed out as the difference
    /// from this set. Before, it was not handed out at all, and peers kept the old set
    /// for good.
    published: FingerprintSet,
    sample: SampleChooser,
    source: IndexSource,
    /// The engine's capacity, which the shadow model evicts to (unbounded while the
    /// events rule: the engine evicts).
    model_capacity: u64,
}

impl LocalCache {
    /// An empty model of a cache of `capacity_tokens`, summarised at the rate
    /// `setting` gives a node that knows no peers yet (it follows the cluster's size
    /// from then on: [`follow_peers`](Self::follow_peers)).
    pub fn new(capacity_tokens: u64, setting: SampleSetting) -> Self {
        let sample = SampleChooser::new(setting, 0);
        LocalCache {
            index: ShadowIndex::with_sample(capacity_tokens.max(1), sample.current()),
            published_version: 0,
            published_sample: sample.current(),
            published: FingerprintSet::default(),
            sample,
            source: IndexSource::Shadow,
            model_capacity: capacity_tokens.max(1),
        }
    }

    /// `live_peers` peers are live at `now_ms`: change the summary's sample when the
    /// setting calls for it; returns the summary changes to gossip (the fingerprints
    /// that enter or leave at the new rate).
    pub fn follow_peers(&mut self, live_peers: usize, now_ms: u64) -> Option<SummaryDelta> {
        let sample = self.sample.observe(live_peers, now_ms);
        if sample != self.index.summary().sample() {
            tracing::info!(
                live_peers,
                from = %self.index.summary().sample(),
                to = %sample,
                "summary sample changes"
            );
            self.index.set_summary_sample(sample);
        }
        self.take_delta()
    }

    /// The summary's sample now: one block in this many is gossiped.
    pub fn summary_sample(&self) -> SummarySample {
        self.index.summary().sample()
    }

    /// Blocks of `chain`'s prefix the engine probably caches.
    pub fn longest_match_blocks(&self, chain: &HashChain) -> usize {
        self.index.longest_match_blocks(chain)
    }

    /// Tokens of `chain`'s prefix the engine probably caches.
    pub fn longest_match(&self, chain: &HashChain) -> u64 {
        self.index.longest_match(chain)
    }

    /// Record a dispatch of `chain` to the engine; returns the summary changes to
    /// gossip (`None` when nothing changed). Nothing while the events rule: the
    /// engine's own `BlockStored` follows.
    pub fn insert(&mut self, chain: &HashChain, now_ms: u64) -> Option<SummaryDelta> {
        if self.source == IndexSource::Shadow {
            self.index.insert(chain, now_ms);
        }
        self.take_delta()
    }

    /// Correct the model with the engine's own count of cached prompt tokens for a
    /// request dispatched at `dispatched_ms`, for which the model had predicted
    /// `predicted_tokens` (the shadow model only: the events are the engine's word
    /// already).
    pub fn correct(
        &mut self,
        chain: &HashChain,
        cached_tokens: u64,
        predicted_tokens: u64,
        dispatched_ms: u64,
    ) -> Option<SummaryDelta> {
        if self.source == IndexSource::Shadow {
            self.index
                .correct(chain, cached_tokens, predicted_tokens, dispatched_ms);
        }
        self.take_delta()
    }

    /// Follow the engine's real capacity once known (what the shadow model evicts to).
    pub fn set_capacity(&mut self, capacity_tokens: u64) -> Option<SummaryDelta> {
        if capacity_tokens > 0 {
            self.model_capacity = capacity_tokens;
        }
        if self.source == IndexSource::Shadow && self.model_capacity != self.index.capacity_tokens()
        {
            self.index.set_capacity(self.model_capacity);
        }
        self.take_delta()
    }

    /// The source the index follows.
    pub fn source(&self) -> IndexSource {
        self.source
    }

    /// Switch sources. To the events: the engine evicts, so the model's capacity is
    /// lifted (the follower's `Cleared` and blocks come next). Back to the shadow
    /// model: it carries on from the events' picture, evicting to the capacity.
    pub fn set_source(&mut self, source: IndexSource) -> Option<SummaryDelta> {
        self.source = source;
        match source {
            IndexSource::Events => self.index.set_capacity(u64::MAX),
            IndexSource::Shadow => self.index.set_capacity(self.model_capacity),
        }
        self.take_delta()
    }

    /// Forget every block: the engine has left the node, and what peers hold of its
    /// summary (counted against their cap on a peer's fingerprints) goes with the
    /// delta returned. Its last stats say draining, so it is no candidate either way.
    pub fn clear(&mut self) -> Option<SummaryDelta> {
        self.index.clear();
        self.take_delta()
    }

    /// Apply the KV-event follower's changes (while the events rule).
    pub fn apply_kv_changes(
        &mut self,
        changes: &[NodeBlockChange],
        now_ms: u64,
    ) -> Option<SummaryDelta> {
        for change in changes {
            match *change {
                NodeBlockChange::Added {
                    hash,
                    parent,
                    tokens,
                } => self.index.insert_block(hash, parent, tokens, now_ms),
                NodeBlockChange::Removed { hash } => {
                    self.index.remove_block(hash);
                }
                NodeBlockChange::Cleared => self.index.clear(),
            }
        }
        self.take_delta()
    }

    /// The changes since the last one handed out, stamped with the current sample;
    /// also an empty one when only the sample changed, so that the gossiped mirror of
    /// the summary announces it.
    fn take_delta(&mut self) -> Option<SummaryDelta> {
        let summary = self.index.summary();
        if summary.version() == self.published_version && summary.sample() == self.published_sample
        {
            return None;
        }
        let delta = summary
            .delta_since(self.published_version)
            .unwrap_or_else(|| {
                let now: FingerprintSet = summary.snapshot().fingerprints.into_iter().collect();
                let mut added: Vec<u32> = now
                    .iter()
                    .filter(|fp| !self.published.contains(fp))
                    .copied()
                    .collect();
                let mut removed: Vec<u32> = self
                    .published
                    .iter()
                    .filter(|fp| !now.contains(fp))
                    .copied()
                    .collect();
                added.sort_unstable();
                removed.sort_unstable();
                SummaryDelta {
                    from_version: self.published_version,
                    to_version: summary.version(),
                    added,
                    removed,
                    sample: summary.sample(),
                }
            });
        for fp in &delta.removed {
            self.published.remove(fp);
        }
        self.published.extend(delta.added.iter().copied());
        self.published_version = summary.version();
        self.published_sample = summary.sample();
        Some(delta)
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

    use gorgo_core::summary::is_summarised;

    #[test]
    fn inserts_yield_deltas_once() {
        let mut c = LocalCache::new(10_000, SampleSetting::Auto);
        assert_eq!(c.summary_sample(), SummarySample::EVERY_BLOCK);
        let text: Vec<u8> = (0..16 * 256).map(|i| (i % 251) as u8).collect();
        let chain = HashChain::from_bytes(&text, 256, 4);
        let summarised = (0..chain.len())
            .filter(|&i| is_summarised(chain.fingerprint(i), c.summary_sample()))
            .count();
        assert!(summarised > 0);
        let d = c
            .insert(&chain, 0)
            .expect("first insert changes the summary");
        assert_eq!(d.added.len(), summarised);
        assert!(c.insert(&chain, 1).is_none());
        assert_eq!(c.longest_match(&chain), chain.prefix_tokens(chain.len()));
    }

    /// One change larger than the summary's log (65,536 entries: here an engine's KV
    /// events clearing 70,000 blocks) reaches the gossiped mirror whole, as the
    /// difference from what was handed out. Before, it was not handed out at all, and
    /// peers kept every cleared prefix for good.
    #[test]
    fn a_change_past_the_summary_log_still_reaches_gossip() {
        let mut c = LocalCache::new(1 << 40, SampleSetting::Auto);
        let mut mirror = gorgo_core::LocalSummary::new();
        let replay = |m: &mut gorgo_core::LocalSummary, d: SummaryDelta| {
            d.added.iter().for_each(|&fp| m.record_add(fp));
            d.removed.iter().for_each(|&fp| m.record_remove(fp));
            m.set_sample(d.sample);
        };
        if let Some(d) = c.set_source(IndexSource::Events) {
            replay(&mut mirror, d);
        }
        let blocks: Vec<u64> = (1..=70_000u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        for (k, batch) in blocks.chunks(1_000).enumerate() {
            let changes: Vec<NodeBlockChange> = batch
                .iter()
                .enumerate()
                .map(|(i, &hash)| NodeBlockChange::Added {
                    hash,
                    parent: (k * 1_000 + i > 0).then(|| blocks[k * 1_000 + i - 1]),
                    tokens: 64,
                })
                .collect();
            replay(&mut mirror, c.apply_kv_changes(&changes, 0).unwrap());
        }
        assert!(mirror.len() > 65_536, "{}", mirror.len());
        let d = c
            .apply_kv_changes(&[NodeBlockChange::Cleared], 1)
            .expect("the clear is handed out");
        assert!(d.removed.len() > 65_536);
        replay(&mut mirror, d);
        assert_eq!(mirror.len(), 0);
        // And the next change follows on as a delta again.
        let one = [NodeBlockChange::Added {
            hash: 7,
            parent: None,
            tokens: 64,
        }];
        replay(&mut mirror, c.apply_kv_changes(&one, 2).unwrap());
        assert_eq!(mirror.len(), 1);
    }

    #[test]
    fn the_sample_follows_the_peer_count_as_deltas() {
        let hold = gorgo_core::summary::AUTO_SAMPLE_HOLD_MS;
        let mut c = LocalCache::new(1_000_000, SampleSetting::Auto);
        let text: Vec<u8> = (0..200 * 256).map(|i| (i * 7 % 251) as u8).collect();
        let chain = HashChain::from_bytes(&text, 256, 4);
        let d = c.insert(&chain, 0).unwrap();
        assert_eq!(d.added.len(), chain.len());
        // The mirror the cluster gossips, fed the deltas the way `publish_summary` is.
        let mut mirror = gorgo_core::LocalSummary::new();
        let replay = |m: &mut gorgo_core::LocalSummary, d: &SummaryDelta| {
            d.added.iter().for_each(|&fp| m.record_add(fp));
            d.removed.iter().for_each(|&fp| m.record_remove(fp));
            m.set_sample(d.sample);
        };
        replay(&mut mirror, &d);
        assert!(c.follow_peers(15, 1).is_none(), "held back");
        let d = c
            .follow_peers(15, 1 + hold)
            .expect("15 peers: one block in 4");
        let four = SummarySample::from_rate(4).unwrap();
        assert_eq!((c.summary_sample(), d.sample), (four, four));
        let kept = (0..chain.len())
            .filter(|&i| is_summarised(chain.fingerprint(i), four))
            .count();
        assert_eq!((d.added.len(), d.removed.len()), (0, chain.len() - kept));
        replay(&mut mirror, &d);
        assert_eq!(mirror.len(), kept);
        assert_eq!(mirror.sample(), four);
        // Back down to two peers: everything again.
        assert!(c.follow_peers(2, 2 + hold).is_none());
        let d = c.follow_peers(2, 2 + 2 * hold).unwrap();
        assert_eq!(
            (d.added.len(), d.sample),
            (chain.len() - kept, SummarySample::EVERY_BLOCK)
        );
        replay(&mut mirror, &d);
        assert_eq!(mirror.len(), chain.len());
        // A sample change that moves no fingerprint still reaches the mirror.
        let mut empty = LocalCache::new(1_000, SampleSetting::Auto);
        let d = empty.follow_peers(20, 0);
        assert!(d.is_none());
        let d = empty.follow_peers(20, hold).unwrap();
        assert!(d.is_empty());
        assert_eq!(d.sample.rate(), 8);
        assert!(empty.follow_peers(20, hold + 1).is_none());
    }
}
