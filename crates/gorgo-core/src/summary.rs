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
//! **Sampling.** Only one block in `sample` enters a summary: those whose fingerprint
//! [`is_summarised`] at the sender's [`SummarySample`] (low `bits` zero). Gossip bytes
//! are proportional to summary changes (every insert and eviction of the shadow
//! index, sent to every peer), so sampling divides them by the rate. The price is
//! precision: because hashes are chained, a summarised block proves its whole prefix
//! cached, so the receiver answers with the prefix up to the last summarised block it
//! finds, on average `sample - 1` blocks short of the truth, never over it. A node's
//! own candidate uses its exact shadow index.
//!
//! The rate is a cluster setting, not a constant, because its best value depends on
//! the cluster's size: bytes grow with the number of peers, precision matters most on
//! small clusters. Every [`SummarySnapshot`] and [`SummaryDelta`] carries the sender's
//! rate and a [`PeerSummary`] matches with the rate of the last message it applied, so
//! senders may differ and change it at run time. A sender changing its rate re-derives
//! its set from its index ([`crate::ShadowIndex::set_summary_sample`]) as ordinary
//! changes (version bumps), so peers converge through the normal delta/snapshot path.
//! [`SampleChooser`] picks the rate: `auto` (the default) is the smallest power of two
//! at least `ceil(live peers / 4)`, with hysteresis. Measured (`docs/cluster.md`, "32
//! regions"): a 32-region cluster (31 peers, auto picks 8) gossips 47.4 KiB/s per node
//! while requests arrive instead of 309.5 at a sample of 1 (under the 64 KiB/s
//! target); three regions keep 1, where a sample of 4 would cost
//! `gorgo` 7% of its goodput on the multi-turn sweep.

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use serde::{Deserialize, Serialize};

use crate::error::CoreError;
use crate::hash::HashChain;

/// Log2 of the largest sample rate a summary may use (one block in 64): past it a
/// receiver's answers fall too far short of the truth to route on.
pub const MAX_SAMPLE_BITS: u8 = 6;

/// One block in `rate()` (a power of two, 1..=64) enters a summary. Carried on the
/// wire as its log2 (one byte) in every snapshot and delta so that the receiver
/// matches with the sender's rate; a value over [`MAX_SAMPLE_BITS`] does not decode.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(try_from = "u8", into = "u8")]
pub struct SummarySample {
    bits: u8,
}

impl SummarySample {
    /// Every block is summarised: exact answers (the rate of small clusters).
    pub const EVERY_BLOCK: SummarySample = SummarySample { bits: 0 };

    /// The sample of one block in `2^bits`; an error past [`MAX_SAMPLE_BITS`].
    pub fn from_bits(bits: u8) -> Result<Self, CoreError> {
        if bits > MAX_SAMPLE_BITS {
            return Err(CoreError::Malformed(format!(
                "summary sample bits {bits} over {MAX_SAMPLE_BITS}"
            )));
        }
        Ok(SummarySample { bits })
    }

    /// The sample of one block in `rate`; an error unless `rate` is a power of two
    /// from 1 to 64.
    pub fn from_rate(rate: u64) -> Result<Self, CoreError> {
        let max = 1u64 << MAX_SAMPLE_BITS;
        if !rate.is_power_of_two() || rate > max {
            return Err(CoreError::InvalidConfig {
                field: "summary_sample".into(),
                reason: format!("must be a power of two from 1 to {max}, got {rate}"),
            });
        }
        Ok(SummarySample {
            bits: rate.trailing_zeros() as u8,
        })
    }

    /// The smallest sample of at least one block in `rate`, capped at the largest.
    pub fn at_least(rate: u64) -> Self {
        let bits = rate.max(1).next_power_of_two().trailing_zeros();
        SummarySample {
            bits: bits.min(MAX_SAMPLE_BITS as u32) as u8,
        }
    }

    /// Log2 of the rate: the number of low fingerprint bits that must be zero.
    pub fn bits(self) -> u8 {
        self.bits
    }

    /// One block in this many is summarised.
    pub fn rate(self) -> u32 {
        1 << self.bits
    }
}

impl TryFrom<u8> for SummarySample {
    type Error = CoreError;

    fn try_from(bits: u8) -> Result<Self, CoreError> {
        Self::from_bits(bits)
    }
}

impl From<SummarySample> for u8 {
    fn from(s: SummarySample) -> u8 {
        s.bits
    }
}

impl std::fmt::Display for SummarySample {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.rate())
    }
}

/// True when a block with fingerprint `fp` is part of summaries at `sample`: its low
/// `sample.bits()` bits are zero, so about one block in `sample.rate()`, spread
/// uniformly along every chain. The one predicate senders and receivers share.
#[inline]
pub fn is_summarised(fp: u32, sample: SummarySample) -> bool {
    fp.trailing_zeros() >= sample.bits as u32
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
    /// The sender's sample at `to_version`: the receiver matches with it once applied.
    pub sample: SummarySample,
}

impl SummaryDelta {
    /// Bytes this delta takes on the wire ([`crate::wire::encode`]), computed without
    /// encoding, for size metrics.
    pub fn encoded_len(&self) -> usize {
        varint_len(self.from_version)
            + varint_len(self.to_version)
            + seq_len(&self.added)
            + seq_len(&self.removed)
            + 1
    }

    /// True when the delta changes nothing (the sender had no changes).
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty()
    }

    /// Errors unless this is a delta an honest sender builds
    /// ([`LocalSummary::delta_since`]: each list strictly increasing, no fingerprint
    /// in both): [`CoreError::Malformed`] when it goes backwards, a list is out of
    /// order or repeats a fingerprint, or one is both added and removed.
    ///
    /// Why: a receiver counts what a delta would hold before applying it
    /// ([`PeerSummary::len_after`], against [`crate::gossip::GossipConfig`]'s cap),
    /// which takes each fingerprint once; a fingerprint both added and removed does
    /// not say whether the sender holds it; and asking for sorted lists makes the
    /// check one pass without allocating, under the lock the gossip receiver holds.
    pub fn check(&self) -> Result<(), CoreError> {
        if self.to_version < self.from_version {
            return Err(CoreError::Malformed(format!(
                "summary delta goes backwards: {} -> {}",
                self.from_version, self.to_version
            )));
        }
        for (name, list) in [("added", &self.added), ("removed", &self.removed)] {
            if let Some(w) = list.windows(2).find(|w| w[0] >= w[1]) {
                return Err(CoreError::Malformed(format!(
                    "summary delta's {name} list is not strictly increasing at {} then {}",
                    w[0], w[1]
                )));
            }
        }
        // Both lists strictly increasing: walk them together for one in both.
        let (mut i, mut j) = (0, 0);
        while let (Some(a), Some(r)) = (self.added.get(i), self.removed.get(j)) {
            match a.cmp(r) {
                std::cmp::Ordering::Less => i += 1,
                std::cmp::Ordering::Greater => j += 1,
                std::cmp::Ordering::Equal => {
                    return Err(CoreError::Malformed(format!(
                        "summary delta names fingerprint {a} twice"
                    )))
                }
            }
        }
        Ok(())
    }
}

/// The whole fingerprint set at `version`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SummarySnapshot {
    /// The sender's version when the snapshot was taken.
    pub version: u64,
    /// Every fingerprint in the set (sorted, distinct).
    pub fingerprints: Vec<u32>,
    /// The sample the set was derived with: the receiver matches with it.
    pub sample: SummarySample,
}

impl SummarySnapshot {
    /// Bytes this snapshot takes on the wire ([`crate::wire::encode`]).
    pub fn encoded_len(&self) -> usize {
        varint_len(self.version) + seq_len(&self.fingerprints) + 1
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
    /// The rate the set is derived with, stamped on every message.
    sample: SummarySample,
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
            sample: SummarySample::EVERY_BLOCK,
        }
    }

    /// The same summary announcing `sample` (builder form of
    /// [`set_sample`](Self::set_sample), for construction).
    pub fn with_sample(mut self, sample: SummarySample) -> Self {
        self.sample = sample;
        self
    }

    /// The rate the set is derived with.
    pub fn sample(&self) -> SummarySample {
        self.sample
    }

    /// Announce `sample` from now on. The set itself is the caller's to keep
    /// consistent with it: [`crate::ShadowIndex::set_summary_sample`] records the
    /// fingerprints that enter or leave first (as ordinary changes), and a mirror of a
    /// summary copies the sample of each delta it replays.
    ///
    /// A change that moves no fingerprint does not bump the version, so peers already
    /// up to date keep matching with the old rate until the next change: harmless,
    /// because then the index holds no block the two rates disagree on, and either
    /// rate gives the same answer.
    pub fn set_sample(&mut self, sample: SummarySample) {
        self.sample = sample;
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
            sample: self.sample,
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

    /// Every fingerprint in the set, in no order. Why: a driver copies the set under
    /// the lock that guards the summary and sorts the copy after it, once for every
    /// peer that gets the version ([`snapshot`](Self::snapshot) sorts in place).
    pub fn fingerprints(&self) -> impl Iterator<Item = u32> + '_ {
        self.refcounts.keys().copied()
    }

    /// The whole set at the current version.
    pub fn snapshot(&self) -> SummarySnapshot {
        let mut fingerprints: Vec<u32> = self.refcounts.keys().copied().collect();
        fingerprints.sort_unstable();
        SummarySnapshot {
            version: self.version,
            fingerprints,
            sample: self.sample,
        }
    }
}

/// The receiver side: a peer's fingerprint set as last heard.
#[derive(Debug, Clone, Default)]
pub struct PeerSummary {
    set: FingerprintSet,
    version: u64,
    /// The sender's rate as of the last message applied.
    sample: SummarySample,
}

impl PeerSummary {
    /// An empty summary at version 0 (nothing heard yet).
    pub fn new() -> Self {
        Self::default()
    }

    /// Apply a delta.
    ///
    /// Applies when `d.from_version` is the version held (and from then on matches
    /// with the delta's sample); ignores a delta already applied (`d.to_version <=
    /// version`); otherwise [`CoreError::SummaryGap`]: the caller asks the sender for
    /// a snapshot.
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
            // Removals keep the table's allocation; give it back once it is mostly
            // empty (the same reason as in `apply_snapshot`).
            if self.set.capacity() > 4 * self.set.len().max(1024) {
                self.set.shrink_to(2 * self.set.len());
            }
            self.version = d.to_version;
            self.sample = d.sample;
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

    /// Fingerprints held once `d`, a delta from the version held, is applied: what a
    /// cap on them checks before applying it. Exact for a delta that passes
    /// [`SummaryDelta::check`] (each fingerprint named once); O(n) lookups.
    pub fn len_after(&self, d: &SummaryDelta) -> usize {
        let gone = d.removed.iter().filter(|fp| self.set.contains(fp)).count();
        let new = d.added.iter().filter(|fp| !self.set.contains(fp)).count();
        self.set.len() - gone + new
    }

    /// Replace everything with a snapshot (whatever its version: a snapshot is the
    /// sender's word on its whole state, e.g. after it restarted).
    pub fn apply_snapshot(&mut self, s: SummarySnapshot) {
        // A new set, not the old one cleared: a cleared table keeps its allocation,
        // and the cap on what a peer's summaries hold counts fingerprints, so a peer
        // filling a summary and then sending an empty snapshot would pin the largest
        // table it ever had on each of its engines.
        self.set = s.fingerprints.into_iter().collect();
        self.version = s.version;
        self.sample = s.sample;
    }

    /// The sender's rate as of the last message applied (what matching uses).
    pub fn sample(&self) -> SummarySample {
        self.sample
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
    /// summarised ([`is_summarised`] at the sender's sample) are absent from sampled
    /// summaries and skipped, so the answer ends at the last summarised hit; a summary
    /// that holds every block (as tests build) gives the exact prefix.
    #[inline]
    pub fn longest_match_blocks(&self, chain: &HashChain) -> usize {
        let sample = self.sample;
        let mut best = 0;
        for (i, &h) in chain.hashes.iter().enumerate() {
            let fp = crate::hash::fingerprint(h);
            if self.set.contains(&fp) {
                best = i + 1;
            } else if is_summarised(fp, sample) {
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

/// Peers per step of the automatic rate: `auto` keeps one block in
/// `ceil(live peers / AUTO_PEERS_PER_SAMPLE)` (rounded up to a power of two), so a
/// node's gossip bytes, (peers) x (changes / rate), stay at most what a node of a
/// five-node cluster sends at a sample of 1, however large the cluster grows: 1 up to 4
/// peers, 2 up to 8, 4 up to 16, 8 up to 32 (`docs/cluster.md`, "32 regions": 8 keeps
/// the 32-region run under its 64 KiB/s target, 4 does not).
pub const AUTO_PEERS_PER_SAMPLE: usize = 4;

/// How long the live peer count must call for another rate before `auto` moves to it
/// (ms): membership flaps (a peer suspected then back) must not churn the summary,
/// since every change of rate re-sends a large part of it.
pub const AUTO_SAMPLE_HOLD_MS: u64 = 30_000;

/// The summary sample a cluster runs with: the `summary_sample` setting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SampleSetting {
    /// Chosen by cluster size ([`sample_for_peers`]), with hysteresis.
    #[default]
    Auto,
    /// This rate whatever the size.
    Fixed(SummarySample),
}

impl std::str::FromStr for SampleSetting {
    type Err = CoreError;

    /// `auto` or a power of two from 1 to 64.
    fn from_str(s: &str) -> Result<Self, CoreError> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("auto") {
            return Ok(SampleSetting::Auto);
        }
        let rate: u64 = s.parse().map_err(|_| CoreError::InvalidConfig {
            field: "summary_sample".into(),
            reason: format!("must be \"auto\" or a power of two from 1 to 64, got {s:?}"),
        })?;
        SummarySample::from_rate(rate).map(SampleSetting::Fixed)
    }
}

impl std::fmt::Display for SampleSetting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SampleSetting::Auto => f.write_str("auto"),
            SampleSetting::Fixed(s) => write!(f, "{s}"),
        }
    }
}

/// The rate `auto` calls for with `live_peers` peers: the smallest power of two at
/// least `ceil(live_peers / AUTO_PEERS_PER_SAMPLE)` (1 up to 4 peers, 2 up to 8, 4 up
/// to 16, 8 up to 32, ...), capped at 64.
pub fn sample_for_peers(live_peers: usize) -> SummarySample {
    SummarySample::at_least(live_peers.div_ceil(AUTO_PEERS_PER_SAMPLE) as u64)
}

/// Decides the rate a node's summary uses from its live peer count over time
/// (sans-IO: the driver feeds membership and `now_ms`, and applies the answer with
/// [`crate::ShadowIndex::set_summary_sample`]).
///
/// `auto` moves up once the count has called for a higher rate for
/// [`AUTO_SAMPLE_HOLD_MS`], and down only once it is well below the lower rate's
/// bound (a third more peers would still fit it) for as long: a count hovering at a
/// threshold, or a flapping peer, does not change the rate back and forth.
#[derive(Debug, Clone)]
pub struct SampleChooser {
    setting: SampleSetting,
    current: SummarySample,
    /// A rate other than `current` the count has called for, and since when (ms);
    /// the clock restarts when the direction of the change does.
    pending: Option<(SummarySample, u64)>,
    hold_ms: u64,
}

impl SampleChooser {
    /// A chooser starting at the rate `setting` gives `live_peers` peers (no history
    /// to hold back on yet: a node that knows its cluster's size starts right).
    pub fn new(setting: SampleSetting, live_peers: usize) -> Self {
        let current = match setting {
            SampleSetting::Auto => sample_for_peers(live_peers),
            SampleSetting::Fixed(s) => s,
        };
        SampleChooser {
            setting,
            current,
            pending: None,
            hold_ms: AUTO_SAMPLE_HOLD_MS,
        }
    }

    /// The same chooser with another hold time (tests, simulations).
    pub fn with_hold_ms(mut self, hold_ms: u64) -> Self {
        self.hold_ms = hold_ms;
        self
    }

    /// The setting it follows.
    pub fn setting(&self) -> SampleSetting {
        self.setting
    }

    /// The rate chosen now.
    pub fn current(&self) -> SummarySample {
        self.current
    }

    /// `live_peers` peers are live at `now_ms`: the rate to use from now on.
    pub fn observe(&mut self, live_peers: usize, now_ms: u64) -> SummarySample {
        if self.setting != SampleSetting::Auto {
            return self.current;
        }
        let up = sample_for_peers(live_peers);
        let down = sample_for_peers(live_peers.saturating_add(live_peers / 3));
        let wanted = if up > self.current {
            up
        } else if down < self.current {
            down
        } else {
            self.current
        };
        if wanted == self.current {
            self.pending = None;
            return self.current;
        }
        let rising = wanted > self.current;
        let since = match self.pending {
            Some((p, since)) if (p > self.current) == rising => since,
            _ => now_ms,
        };
        if now_ms.saturating_sub(since) >= self.hold_ms {
            self.current = wanted;
            self.pending = None;
        } else {
            self.pending = Some((wanted, since));
        }
        self.current
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
            bits in 0u8..=MAX_SAMPLE_BITS,
        ) {
            let sample = SummarySample::from_bits(bits).unwrap();
            let chain = HashChain::from_int_block_ids(&ids, 64, ids.len() as u64 * 64);
            let cached = cached_blocks.min(chain.len());
            let mut local = LocalSummary::new().with_sample(sample);
            for i in 0..cached {
                if is_summarised(chain.fingerprint(i), sample) {
                    local.record_add(chain.fingerprint(i));
                }
            }
            let mut peer = PeerSummary::new();
            peer.apply_snapshot(local.snapshot());
            prop_assert_eq!(peer.sample(), sample);
            let expect = (0..cached)
                .rev()
                .find(|&i| is_summarised(chain.fingerprint(i), sample))
                .map_or(0, |i| i + 1);
            prop_assert_eq!(peer.longest_match_blocks(&chain), expect);
        }
    }

    #[test]
    fn about_one_block_in_the_sample_rate_is_summarised() {
        let ids: Vec<u64> = (0..20_000).collect();
        let chain = HashChain::from_int_block_ids(&ids, 64, ids.len() as u64 * 64);
        for bits in 0..=MAX_SAMPLE_BITS {
            let sample = SummarySample::from_bits(bits).unwrap();
            let n = (0..chain.len())
                .filter(|&i| is_summarised(chain.fingerprint(i), sample))
                .count();
            let expect = chain.len() / sample.rate() as usize;
            assert!(
                n.abs_diff(expect) < expect / 5,
                "{n} of {} at {sample}",
                chain.len()
            );
        }
    }

    #[test]
    fn sample_values_and_their_bounds() {
        assert_eq!(SummarySample::default(), SummarySample::EVERY_BLOCK);
        assert_eq!(SummarySample::from_rate(1).unwrap().bits(), 0);
        assert_eq!(SummarySample::from_rate(64).unwrap().bits(), 6);
        for bad in [0, 3, 6, 128, u64::MAX] {
            assert!(SummarySample::from_rate(bad).is_err(), "{bad}");
        }
        assert!(SummarySample::from_bits(MAX_SAMPLE_BITS + 1).is_err());
        assert_eq!(SummarySample::at_least(0).rate(), 1);
        assert_eq!(SummarySample::at_least(3).rate(), 4);
        assert_eq!(SummarySample::at_least(1 << 40).rate(), 64);
        assert_eq!(
            "auto".parse::<SampleSetting>().unwrap(),
            SampleSetting::Auto
        );
        assert_eq!(
            " 16".parse::<SampleSetting>().unwrap(),
            SampleSetting::Fixed(SummarySample::from_rate(16).unwrap())
        );
        for bad in ["", "0", "5", "128", "-1", "four"] {
            assert!(bad.parse::<SampleSetting>().is_err(), "{bad:?}");
        }
        for s in ["auto", "1", "8", "64"] {
            assert_eq!(s.parse::<SampleSetting>().unwrap().to_string(), s);
        }
    }

    #[test]
    fn a_sample_over_the_cap_does_not_decode() {
        let s = SummarySnapshot {
            version: 7,
            fingerprints: vec![1, 2],
            sample: SummarySample::from_rate(64).unwrap(),
        };
        let mut bytes = crate::wire::encode(&s);
        assert_eq!(
            crate::wire::decode::<SummarySnapshot>(&bytes, 1 << 10).unwrap(),
            s
        );
        // The sample is the last byte: 7 is one block in 128, over the cap.
        *bytes.last_mut().unwrap() = MAX_SAMPLE_BITS + 1;
        assert!(matches!(
            crate::wire::decode::<SummarySnapshot>(&bytes, 1 << 10),
            Err(CoreError::Malformed(_))
        ));
        let d = SummaryDelta {
            from_version: 1,
            to_version: 2,
            added: vec![3],
            removed: vec![],
            sample: SummarySample::from_rate(4).unwrap(),
        };
        let mut bytes = crate::wire::encode(&d);
        *bytes.last_mut().unwrap() = 255;
        assert!(matches!(
            crate::wire::decode::<SummaryDelta>(&bytes, 1 << 10),
            Err(CoreError::Malformed(_))
        ));
    }

    #[test]
    fn a_receiver_matches_with_the_rate_of_the_last_message_applied() {
        let ids: Vec<u64> = (0..64).collect();
        let chain = HashChain::from_int_block_ids(&ids, 64, 64 * 64);
        let four = SummarySample::from_rate(4).unwrap();
        // The sender holds the whole chain; at 4 only its summarised blocks are sent.
        let fps_at = |s: SummarySample| -> Vec<u32> {
            let mut v: Vec<u32> = (0..chain.len())
                .map(|i| chain.fingerprint(i))
                .filter(|&fp| is_summarised(fp, s))
                .collect();
            v.sort_unstable();
            v
        };
        let last_at_four = (0..chain.len())
            .rev()
            .find(|&i| is_summarised(chain.fingerprint(i), four))
            .unwrap();
        let mut p = PeerSummary::new();
        p.apply_snapshot(SummarySnapshot {
            version: 1,
            fingerprints: fps_at(four),
            sample: four,
        });
        assert_eq!(p.longest_match_blocks(&chain), last_at_four + 1);
        // The same set read as a sample of 1 would stop at the first unsent block.
        let every = SummarySample::EVERY_BLOCK;
        let first_unsent = (0..chain.len())
            .find(|&i| !is_summarised(chain.fingerprint(i), four))
            .unwrap();
        p.apply_delta(&SummaryDelta {
            from_version: 1,
            to_version: 1,
            sample: every,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(p.sample(), every);
        assert_eq!(p.longest_match_blocks(&chain), first_unsent);
        // A delta already applied does not change the rate.
        p.apply_delta(&SummaryDelta {
            from_version: 0,
            to_version: 1,
            sample: four,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(p.sample(), every);
    }

    /// What a peer's summary allocates follows what it holds: a peer that fills one
    /// and then empties it (by snapshot or by delta) leaves no large table behind,
    /// since the cap on a peer's summaries counts fingerprints, not allocations.
    #[test]
    fn an_emptied_peer_summary_gives_its_table_back() {
        let big: Vec<u32> = (0..200_000).collect();
        let mut p = PeerSummary::new();
        p.apply_snapshot(SummarySnapshot {
            version: 1,
            fingerprints: big.clone(),
            sample: SummarySample::EVERY_BLOCK,
        });
        assert!(p.set.capacity() >= 200_000);
        p.apply_snapshot(SummarySnapshot {
            version: 2,
            fingerprints: Vec::new(),
            sample: SummarySample::EVERY_BLOCK,
        });
        assert!(p.set.capacity() < 4096, "{}", p.set.capacity());
        p.apply_snapshot(SummarySnapshot {
            version: 3,
            fingerprints: big.clone(),
            sample: SummarySample::EVERY_BLOCK,
        });
        p.apply_delta(&SummaryDelta {
            from_version: 3,
            to_version: 4,
            sample: SummarySample::EVERY_BLOCK,
            removed: big,
            ..Default::default()
        })
        .unwrap();
        assert!(p.is_empty());
        assert!(p.set.capacity() < 4096, "{}", p.set.capacity());
    }

    #[test]
    fn auto_follows_cluster_size() {
        let rate = |peers| sample_for_peers(peers).rate();
        assert_eq!(
            [0, 1, 2, 4, 5, 8, 9, 16, 17, 31, 32, 33, 1_000].map(rate),
            [1, 1, 1, 1, 2, 2, 4, 4, 8, 8, 8, 16, 64]
        );
        assert_eq!(
            SampleChooser::new(SampleSetting::Auto, 31).current().rate(),
            8
        );
        assert_eq!(
            SampleChooser::new(SampleSetting::Auto, 2).current().rate(),
            1
        );
        let fixed = SampleSetting::Fixed(SummarySample::from_rate(8).unwrap());
        let mut c = SampleChooser::new(fixed, 2);
        assert_eq!(c.observe(100, 0).rate(), 8);
        assert_eq!(c.observe(0, 1_000_000).rate(), 8);
    }

    #[test]
    fn auto_changes_only_after_the_hold_and_goes_down_well_below() {
        let hold = AUTO_SAMPLE_HOLD_MS;
        let mut c = SampleChooser::new(SampleSetting::Auto, 2);
        // Growing to 15 peers: 4 only after the hold.
        assert_eq!(c.observe(15, 1_000).rate(), 1);
        assert_eq!(c.observe(15, 1_000 + hold - 1).rate(), 1);
        assert_eq!(c.observe(15, 1_000 + hold).rate(), 4);
        // A flap under the threshold and back resets nothing upwards and never
        // lowers the rate.
        let t = 1_000 + hold;
        assert_eq!(c.observe(7, t + 1).rate(), 4);
        assert_eq!(
            c.observe(7, t + 2 * hold).rate(),
            4,
            "7 is not well below 8"
        );
        // 6 peers is well below 8 (a third more still fits 2): down after the hold.
        let t = t + 3 * hold;
        assert_eq!(c.observe(6, t).rate(), 4);
        assert_eq!(
            c.observe(15, t + hold / 2).rate(),
            4,
            "back up: the pending drop ends"
        );
        assert_eq!(c.observe(6, t + hold).rate(), 4, "the hold restarted");
        assert_eq!(c.observe(6, t + 2 * hold).rate(), 2);
        // A peer count that flaps across a threshold every few seconds never moves it.
        let mut c = SampleChooser::new(SampleSetting::Auto, 4);
        for i in 0..100u64 {
            let peers = if i % 2 == 0 { 5 } else { 4 };
            assert_eq!(c.observe(peers, i * 5_000).rate(), 1);
        }
    }

    proptest! {
        /// Whatever the peer counts, the chosen rate only changes to one the current
        /// count calls for (between `sample_for_peers` of it and of a third more), and
        /// never twice within one hold.
        #[test]
        fn auto_is_bounded_and_holds(
            steps in prop::collection::vec((0usize..200, 0u64..20_000), 1..200),
            start in 0usize..200,
        ) {
            let mut c = SampleChooser::new(SampleSetting::Auto, start);
            let mut now = 0u64;
            let mut last_change: Option<u64> = None;
            let mut rate = c.current();
            for (peers, dt) in steps {
                now += dt;
                let r = c.observe(peers, now);
                if r != rate {
                    prop_assert!(r >= sample_for_peers(peers));
                    prop_assert!(r <= sample_for_peers(peers + peers / 3));
                    if let Some(t) = last_change {
                        prop_assert!(now - t >= AUTO_SAMPLE_HOLD_MS);
                    }
                    last_change = Some(now);
                    rate = r;
                }
            }
        }
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
            sample: SummarySample::EVERY_BLOCK,
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
        let sample = SummarySample::from_rate(4).unwrap();
        p.apply_snapshot(SummarySnapshot {
            version: 1,
            fingerprints: vec![
                chain.fingerprint(0),
                chain.fingerprint(1),
                chain.fingerprint(3),
            ],
            sample,
        });
        // Block 2 is missing: a summarised block's absence ends the prefix; an
        // unsummarised one is never in a sampled summary, and the later hit on the
        // chained hash of block 3 proves the whole prefix.
        let (blocks, tokens) = if is_summarised(chain.fingerprint(2), sample) {
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
            sample: SummarySample::from_rate(32).unwrap(),
        };
        assert_eq!(d.encoded_len(), crate::wire::encode(&d).len());
        let s = SummarySnapshot {
            version: 7,
            fingerprints: (0..300).map(|i| i * 1_000_003).collect(),
            sample: SummarySample::EVERY_BLOCK,
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
