//! Prefix-cache summaries: what a node tells its peers about its engine's cache.
//!
//! A summary is the versioned set of 32-bit fingerprints ([`crate::hash::fingerprint`])
//! of the chained block hashes in the sender's shadow index. The sender
//! ([`LocalSummary`]) keeps a bounded log of changes so that it can send a
//! [`SummaryDelta`] (added/removed since the version a peer holds) every gossip round,
//! and a [`SummarySnapshot`] when the peer is too far behind. The receiver
//! ([`PeerSummary`]) applies them and answers the routing question "how much of this
//! chain does that peer have cached?" without allocating.
//!
//! Versions count membership changes: each fingerprint that enters or leaves the set
//! bumps the version by one.
//!
//! **Sampling.** Only one block in [`SUMMARY_SAMPLE`] enters a summary: those whose
//! fingerprint [`is_summarised`]. Gossip bytes are proportional to summary changes
//! (every insert and eviction of the shadow index, sent to every peer), so sampling
//! divides them by that factor. The price is precision: because hashes are chained, a
//! summarised block proves its whole prefix cached, so the receiver answers with the
//! prefix up to the last summarised block it finds, on average `SUMMARY_SAMPLE - 1`
//! blocks short of the truth, never over it. A node's own candidate uses its exact
//! shadow index. Measured (`docs/cluster.md`, "32 regions"): a sample of 4 cuts a
//! 32-region cluster's gossip from 197 to 56 KiB/s per node but costs `gorgo` 7% of
//! its goodput on the multi-turn sweep, so the shipped value is 1 (every block): the
//! mechanism is in place, the rate is not yet a cluster setting carried on the wire.

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use serde::{Deserialize, Serialize};

use crate::error::CoreError;
use crate::hash::HashChain;

/// One block in this many enters a summary (a power of two; see the module docs for
/// why it is 1).
pub const SUMMARY_SAMPLE: u32 = 1;

/// True when a block with fingerprint `fp` is part of summaries: its low bits are zero,
/// so about one block in [`SUMMARY_SAMPLE`], spread uniformly along every chain.
#[inline]
pub fn is_summarised(fp: u32) -> bool {
    // Low `log2(SUMMARY_SAMPLE)` bits zero (written so that a sample of 1 is no mask).
    fp.trailing_zeros() >= SUMMARY_SAMPLE.trailing_zeros()
}

/// Default number of changes the sender retains for deltas (about 64 gossip rounds of
/// heavy churn); older peers get a snapshot.
pub const DEFAULT_SUMMARY_LOG_CAPACITY: usize = 1 << 16;

/// A [`Hasher`] for fingerprints and block hashes, which are already uniform hashes: it
/// only mixes them with one multiply so that the hash table's control bytes, taken
/// from the top bits, stay distinct. Far cheaper than SipHash on the routing hot path.
#[derive(Debug, Default, Clone, Copy)]
pub struct FingerprintHasher(u64);

impl Hasher for FingerprintHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        // Not used by u32 keys; fold anything else in deterministically.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    #[inline]
    fn write_u64(&mut self, v: u64) {
        // Block hashes (the shadow index's keys) are uniform 64-bit hashes already.
        self.0 = (v ^ self.0.rotate_left(32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    #[inline]
    fn write_u32(&mut self, v: u32) {
        self.0 = (v as u64 ^ (self.0 << 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// Builds [`FingerprintHasher`]s; the hasher of every fingerprint set and map.
pub type FingerprintBuildHasher = BuildHasherDefault<FingerprintHasher>;

/// A set of fingerprints hashed with [`FingerprintHasher`].
pub type FingerprintSet = HashSet<u32, FingerprintBuildHasher>;

/// The changes that take a receiver from `from_version` to `to_version`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SummaryDelta {
    /// The version the receiver must hold to apply this delta.
    pub from_version: u64,
    /// The version the receiver holds after applying it.
    pub to_version: u64,
    /// Fingerprints present at `to_version` and absent at `from_version` (sorted).
    pub added: Vec<u32>,
    /// Fingerprints present at `from_version` and absent at `to_version` (sorted).
    pub removed: Vec<u32>,
}

impl SummaryDelta {
    /// Bytes this delta takes on the wire ([`crate::wire::encode`]), computed without
    /// encoding, for size metrics.
    pub fn encoded_len(&self) -> usize {
        varint_len(self.from_version)
            + varint_len(self.to_version)
            + seq_len(&self.added)
            + seq_len(&self.removed)
    }

    /// True when the delta changes nothing (the sender had no changes).
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty()
    }
}

/// The whole fingerprint set at `version`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SummarySnapshot {
    /// The sender's version when the snapshot was taken.
    pub version: u64,
    /// Every fingerprint in the set (sorted, distinct).
    pub fingerprints: Vec<u32>,
}

impl SummarySnapshot {
    /// Bytes this snapshot takes on the wire ([`crate::wire::encode`]).
    pub fn encoded_len(&self) -> usize {
        varint_len(self.version) + seq_len(&self.fingerprints)
    }
}

/// bincode 2 standard-config varint size of an unsigned integer (the one place that
/// knows it: summaries and the gossip state machine size their messages with it).
pub(crate) fn varint_len(v: u64) -> usize {
    match v {
        0..=250 => 1,
        251..=0xFFFF => 3,
        0x1_0000..=0xFFFF_FFFF => 5,
        _ => 9,
    }
}

fn seq_len(v: &[u32]) -> usize {
    varint_len(v.len() as u64) + v.iter().map(|&x| varint_len(x as u64)).sum::<usize>()
}

/// The sender side: the node's own fingerprint set, its version and a bounded change
/// log for deltas.
///
/// Fingerprints are reference-counted: two block hashes may share a 32-bit
/// fingerprint, and the fingerprint stays in the set until both are gone.
#[derive(Debug, Clone)]
pub struct LocalSummary {
    refcounts: HashMap<u32, u32, FingerprintBuildHasher>,
    version: u64,
    /// `log[i]` took the set from version `log_start + i` to `log_start + i + 1`:
    /// (fingerprint, true when it entered the set).
    log: VecDeque<(u32, bool)>,
    log_start: u64,
    log_capacity: usize,
}

impl Default for LocalSummary {
    fn default() -> Self {
        Self::new()
    }
}

impl LocalSummary {
    /// An empty summary at version 0 retaining [`DEFAULT_SUMMARY_LOG_CAPACITY`] changes.
    pub fn new() -> Self {
        Self::with_log_capacity(DEFAULT_SUMMARY_LOG_CAPACITY)
    }

    /// An empty summary retaining at most `log_capacity` changes for deltas.
    pub fn with_log_capacity(log_capacity: usize) -> Self {
        LocalSummary {
            refcounts: HashMap::default(),
            version: 0,
            log: VecDeque::new(),
            log_start: 0,
            log_capacity,
        }
    }

    /// Start counting versions at `version` (only while empty and unchanged).
    ///
    /// Why: a restarted node whose versions started again at 0 would look "behind" to
    /// receivers that hold its previous run's higher version, and they would ignore its
    /// deltas as already applied. Drivers seed this with wall-clock milliseconds so a
    /// new run always starts above the last.
    pub fn starting_at(mut self, version: u64) -> Self {
        if self.log.is_empty() && self.refcounts.is_empty() {
            self.version = version;
            self.log_start = version;
        }
        self
    }

    /// The current version.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Number of distinct fingerprints in the set.
    pub fn len(&self) -> usize {
        self.refcounts.len()
    }

    /// True when the set is empty.
    pub fn is_empty(&self) -> bool {
        self.refcounts.is_empty()
    }

    /// True when `fp` is in the set.
    pub fn contains(&self, fp: u32) -> bool {
        self.refcounts.contains_key(&fp)
    }

    /// A block with fingerprint `fp` entered the shadow index.
    pub fn record_add(&mut self, fp: u32) {
        let c = self.refcounts.entry(fp).or_insert(0);
        *c = c.saturating_add(1);
        if *c == 1 {
            self.push_change(fp, true);
        }
    }

    /// A block with fingerprint `fp` left the shadow index. Removing an absent
    /// fingerprint is a no-op.
    pub fn record_remove(&mut self, fp: u32) {
        let Some(c) = self.refcounts.get_mut(&fp) else {
            return;
        };
        *c -= 1;
        if *c == 0 {
            self.refcounts.remove(&fp);
            self.push_change(fp, false);
        }
    }

    fn push_change(&mut self, fp: u32, added: bool) {
        self.version += 1;
        self.log.push_back((fp, added));
        while self.log.len() > self.log_capacity {
            self.log.pop_front();
            self.log_start += 1;
        }
    }

    /// The changes since version `v`, netted (a fingerprint added then removed does not
    /// appear), or `None` when `v` is older than the retained log or newer than the
    /// current version: then the peer needs a [`snapshot`](Self::snapshot).
    pub fn delta_since(&self, v: u64) -> Option<SummaryDelta> {
        if v < self.log_start || v > self.version {
            return None;
        }
        let skip = (v - self.log_start) as usize;
        // fingerprint -> (first change was an add, last change was an add)
        let mut net: HashMap<u32, (bool, bool), FingerprintBuildHasher> = HashMap::default();
        for &(fp, added) in self.log.iter().skip(skip) {
            net.entry(fp)
                .and_modify(|e| e.1 = added)
                .or_insert((added, added));
        }
        let mut delta = SummaryDelta {
            from_version: v,
            to_version: self.version,
            ..Default::default()
        };
        for (fp, (first_add, last_add)) in net {
            match (first_add, last_add) {
                (true, true) => delta.added.push(fp),
                (false, false) => delta.removed.push(fp),
                _ => {}
            }
        }
        delta.added.sort_unstable();
        delta.removed.sort_unstable();
        Some(delta)
    }

    /// The whole set at the current version.
    pub fn snapshot(&self) -> SummarySnapshot {
        let mut fingerprints: Vec<u32> = self.refcounts.keys().copied().collect();
        fingerprints.sort_unstable();
        SummarySnapshot {
            version: self.version,
            fingerprints,
        }
    }
}

/// The receiver side: a peer's fingerprint set as last heard.
#[derive(Debug, Clone, Default)]
pub struct PeerSummary {
    set: FingerprintSet,
    version: u64,
}

impl PeerSummary {
    /// An empty summary at version 0 (nothing heard yet).
    pub fn new() -> Self {
        Self::default()
    }

    /// Apply a delta.
    ///
    /// Applies when `d.from_version` is the version held; ignores a delta already
    /// applied (`d.to_version <= version`); otherwise [`CoreError::SummaryGap`]: the
    /// caller asks the sender for a snapshot.
    pub fn apply_delta(&mut self, d: &SummaryDelta) -> Result<(), CoreError> {
        if d.to_version < d.from_version {
            return Err(CoreError::Malformed(format!(
                "summary delta goes backwards: {} -> {}",
                d.from_version, d.to_version
            )));
        }
        if d.from_version == self.version {
            for fp in &d.removed {
                self.set.remove(fp);
            }
            self.set.extend(d.added.iter().copied());
            self.version = d.to_version;
            Ok(())
        } else if d.to_version <= self.version {
            Ok(())
        } else {
            Err(CoreError::SummaryGap {
                have: self.version,
                from: d.from_version,
            })
        }
    }

    /// Replace everything with a snapshot (whatever its version: a snapshot is the
    /// sender's word on its whole state, e.g. after it restarted).
    pub fn apply_snapshot(&mut self, s: SummarySnapshot) {
        self.set.clear();
        self.set.extend(s.fingerprints);
        self.version = s.version;
    }

    /// The version held.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Number of fingerprints held.
    pub fn len(&self) -> usize {
        self.set.len()
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }

    /// True when `fp` is in the set.
    #[inline]
    pub fn contains(&self, fp: u32) -> bool {
        self.set.contains(&fp)
    }

    /// Blocks of `chain` the peer has cached: the chain walked from the start up to the
    /// last block found in the set, stopping at the first summarised block that is
    /// missing (a prefix cache holds prefixes, so a later hit after such a miss would
    /// be a fingerprint collision, not a usable cache entry). Blocks that are not
    /// summarised ([`is_summarised`]) are absent from sampled summaries and skipped, so
    /// the answer ends at the last summarised hit; a summary that holds every block (as
    /// tests build) gives the exact prefix.
    #[inline]
    pub fn longest_match_blocks(&self, chain: &HashChain) -> usize {
        let mut best = 0;
        for (i, &h) in chain.hashes.iter().enumerate() {
            let fp = crate::hash::fingerprint(h);
            if self.set.contains(&fp) {
                best = i + 1;
            } else if is_summarised(fp) {
                break;
            }
        }
        best
    }

    /// Tokens of `chain` the peer has cached (see
    /// [`longest_match_blocks`](Self::longest_match_blocks)).
    #[inline]
    pub fn matched_tokens(&self, chain: &HashChain) -> u64 {
        chain.prefix_tokens(self.longest_match_blocks(chain))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// A peer's answer from a sampled summary (what a shadow index publishes) is
        /// never more than the truth and ends exactly at the last summarised block of
        /// the cached prefix.
        #[test]
        fn sampled_summary_answers_the_last_summarised_prefix(
            ids in prop::collection::vec(0u64..1_000_000, 1..200),
            cached_blocks in 0usize..200,
        ) {
            let chain = HashChain::from_int_block_ids(&ids, 64, ids.len() as u64 * 64);
            let cached = cached_blocks.min(chain.len());
            let mut local = LocalSummary::new();
            for i in 0..cached {
                if is_summarised(chain.fingerprint(i)) {
                    local.record_add(chain.fingerprint(i));
                }
            }
            let mut peer = PeerSummary::new();
            peer.apply_snapshot(local.snapshot());
            let expect = (0..cached)
                .rev()
                .find(|&i| is_summarised(chain.fingerprint(i)))
                .map_or(0, |i| i + 1);
            prop_assert_eq!(peer.longest_match_blocks(&chain), expect);
        }
    }

    #[test]
    fn about_one_block_in_the_sample_rate_is_summarised() {
        let ids: Vec<u64> = (0..20_000).collect();
        let chain = HashChain::from_int_block_ids(&ids, 64, ids.len() as u64 * 64);
        let n = (0..chain.len())
            .filter(|&i| is_summarised(chain.fingerprint(i)))
            .count();
        let expect = chain.len() / SUMMARY_SAMPLE as usize;
        assert!(n.abs_diff(expect) < expect / 10, "{n} of {}", chain.len());
    }

    #[test]
    fn refcounted_fingerprints() {
        let mut s = LocalSummary::new();
        s.record_add(7);
        s.record_add(7);
        assert_eq!(s.version(), 1);
        s.record_remove(7);
        assert!(s.contains(7));
        s.record_remove(7);
        assert!(!s.contains(7));
        assert_eq!(s.version(), 2);
        s.record_remove(7);
        assert_eq!(s.version(), 2);
    }

    #[test]
    fn deltas_net_and_gap() {
        let mut s = LocalSummary::with_log_capacity(4);
        s.record_add(1);
        s.record_add(2);
        let d = s.delta_since(0).unwrap();
        assert_eq!(d.added, vec![1, 2]);
        s.record_remove(2);
        s.record_add(3);
        let d = s.delta_since(1).unwrap();
        assert_eq!((d.added.clone(), d.removed.clone()), (vec![3], vec![]));
        s.record_add(4); // version 5, log keeps versions 1..=5
        assert!(s.delta_since(0).is_none());
        assert!(s.delta_since(1).is_some());
        assert!(s.delta_since(6).is_none());
        assert!(s.delta_since(5).unwrap().is_empty());

        let mut p = PeerSummary::new();
        assert_eq!(
            p.apply_delta(&s.delta_since(2).unwrap()),
            Err(CoreError::SummaryGap { have: 0, from: 2 })
        );
        p.apply_snapshot(s.snapshot());
        assert_eq!(p.version(), 5);
        // An old delta is ignored.
        p.apply_delta(&SummaryDelta {
            from_version: 1,
            to_version: 3,
            added: vec![99],
            removed: vec![],
        })
        .unwrap();
        assert!(!p.contains(99));
        let backwards = SummaryDelta {
            from_version: 5,
            to_version: 4,
            ..Default::default()
        };
        assert!(p.apply_delta(&backwards).is_err());
    }

    #[test]
    fn starting_version_seeds_log() {
        let mut s = LocalSummary::new().starting_at(1_000);
        s.record_add(5);
        assert_eq!(s.version(), 1_001);
        assert_eq!(s.delta_since(1_000).unwrap().added, vec![5]);
        assert!(s.delta_since(999).is_none());
    }

    #[test]
    fn matches_walk_until_the_first_summarised_miss() {
        let chain = HashChain::from_bytes(&[b'x'; 1024], 256, 4);
        let mut p = PeerSummary::new();
        p.apply_snapshot(SummarySnapshot {
            version: 1,
            fingerprints: vec![
                chain.fingerprint(0),
                chain.fingerprint(1),
                chain.fingerprint(3),
            ],
        });
        // Block 2 is missing: a summarised block's absence ends the prefix; an
        // unsummarised one is never in a sampled summary, and the later hit on the
        // chained hash of block 3 proves the whole prefix.
        let (blocks, tokens) = if is_summarised(chain.fingerprint(2)) {
            (2, 128)
        } else {
            (4, 256)
        };
        assert_eq!(p.longest_match_blocks(&chain), blocks);
        assert_eq!(p.matched_tokens(&chain), tokens);
    }

    #[test]
    fn encoded_len_matches_codec() {
        let d = SummaryDelta {
            from_version: 300,
            to_version: 1 << 40,
            added: vec![0, 250, 251, 70_000, u32::MAX],
            removed: vec![1],
        };
        assert_eq!(d.encoded_len(), crate::wire::encode(&d).len());
        let s = SummarySnapshot {
            version: 7,
            fingerprints: (0..300).map(|i| i * 1_000_003).collect(),
        };
        assert_eq!(s.encoded_len(), crate::wire::encode(&s).len());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Add(u32),
        Remove(u32),
        Sync,
    }

    fn op() -> impl Strategy<Value = Op> {
        // A small fingerprint space so adds, removes and refcounts collide often.
        prop_oneof![
            4 => (0u32..24).prop_map(Op::Add),
            3 => (0u32..24).prop_map(Op::Remove),
            1 => Just(Op::Sync),
        ]
    }

    proptest! {
        /// Any interleaving of changes and delta syncs leaves the receiver equal to the
        /// full snapshot; with a short log, gaps fall back to snapshots.
        #[test]
        fn deltas_converge_to_snapshot(ops in prop::collection::vec(op(), 0..200), cap in 1usize..40) {
            let mut local = LocalSummary::with_log_capacity(cap);
            let mut peer = PeerSummary::new();
            let sync = |local: &LocalSummary, peer: &mut PeerSummary| {
                match local.delta_since(peer.version()) {
                    Some(d) => peer.apply_delta(&d).unwrap(),
                    None => peer.apply_snapshot(local.snapshot()),
                }
            };
            for op in ops {
                match op {
                    Op::Add(fp) => local.record_add(fp),
                    Op::Remove(fp) => local.record_remove(fp),
                    Op::Sync => sync(&local, &mut peer),
                }
            }
            sync(&local, &mut peer);
            let mut held: Vec<u32> = peer.set.iter().copied().collect();
            held.sort_unstable();
            prop_assert_eq!(held, local.snapshot().fingerprints);
            prop_assert_eq!(peer.version(), local.version());
        }
    }
}
