//! Summary gossip: every interval, each alive peer gets the delta of this node's prefix
//! summary since the version it last got (a snapshot on join, after a send failure or
//! when it reports a gap), on its own QUIC uni-stream, with the current queue stats.
//!
//! Frame on the stream: `[STREAM_GOSSIP][oldest_change_ms: u64 LE][wire::GossipMessage]`.
//! `oldest_change_ms` is when (origin's wall clock) the oldest change in the delta was
//! made; the receiver subtracts it from its own clock to measure staleness. 0 means
//! unknown (snapshots).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use gorgo_core::summary::{LocalSummary, PeerSummary, SummaryDelta, SummarySnapshot};
use gorgo_core::wire::{self, GossipMessage, MAX_GOSSIP_MESSAGE};
use gorgo_core::ShadowIndex;
use gorgo_core::{CoreError, NodeId};
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::cluster::Inner;
use crate::config::WallClock;
use crate::state::{ClusterMetrics, TrafficKind};
use crate::transport::{self, STREAM_GOSSIP};

/// How many change points [`SharedSummary`] remembers for staleness stamps.
const CHANGE_LOG: usize = 4096;
/// A peer that reported a gap is not asked again for a snapshot sooner than this.
const SNAPSHOT_REQUEST_BACKOFF: Duration = Duration::from_secs(1);

/// Deltas held per peer while waiting for the one they follow.
const MAX_PENDING_DELTAS: usize = 8;
/// A version gap that has not filled after this long is a real loss: ask for a snapshot.
const GAP_TIMEOUT: Duration = Duration::from_secs(1);

/// Receiver-side reordering of one peer's deltas. Each delta travels on its own
/// uni-stream, so a later one can overtake an earlier one (a lost packet retransmitted);
/// instead of asking for a snapshot at once, hold a few future deltas until the gap
/// fills, and ask only when it persists past [`GAP_TIMEOUT`] or too many pile up.
#[derive(Debug, Default)]
pub(crate) struct DeltaReorder {
    /// Future deltas by `from_version`.
    pending: BTreeMap<u64, SummaryDelta>,
    /// When the current gap was first seen (or last narrowed).
    gap_since: Option<Instant>,
}

/// What receiving a delta did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeltaOutcome {
    /// Applied, with any held deltas that follow on from it.
    Applied,
    /// Ahead of the held version: kept until the gap fills.
    Buffered,
    /// The gap did not fill in time (or cannot): the sender must send a snapshot.
    NeedSnapshot,
}

impl DeltaReorder {
    /// Apply `delta` to `summary`, or hold it if it is ahead; `now` times the gap.
    pub(crate) fn receive(
        &mut self,
        summary: &mut PeerSummary,
        delta: SummaryDelta,
        now: Instant,
    ) -> Result<DeltaOutcome, CoreError> {
        match summary.apply_delta(&delta) {
            Ok(()) => {
                self.drain(summary, now)?;
                Ok(DeltaOutcome::Applied)
            }
            Err(CoreError::SummaryGap { have, from }) if from > have => {
                let since = *self.gap_since.get_or_insert(now);
                let full = self.pending.len() >= MAX_PENDING_DELTAS
                    && !self.pending.contains_key(&delta.from_version);
                if full || now.saturating_duration_since(since) >= GAP_TIMEOUT {
                    self.clear();
                    return Ok(DeltaOutcome::NeedSnapshot);
                }
                self.pending.insert(delta.from_version, delta);
                Ok(DeltaOutcome::Buffered)
            }
            // A delta from before what we hold that reaches past it: only a snapshot
            // can repair that.
            Err(CoreError::SummaryGap { .. }) => {
                self.clear();
                Ok(DeltaOutcome::NeedSnapshot)
            }
            Err(e) => Err(e),
        }
    }

    /// After a snapshot: drop what it covers and apply what follows it.
    pub(crate) fn after_snapshot(&mut self, summary: &mut PeerSummary, now: Instant) {
        if self.drain(summary, now).is_err() {
            self.clear();
        }
    }

    /// Apply held deltas that now follow on; forget the ones already covered.
    fn drain(&mut self, summary: &mut PeerSummary, now: Instant) -> Result<(), CoreError> {
        let mut progressed = false;
        loop {
            let held = summary.version();
            self.pending.retain(|_, d| d.to_version > held);
            let Some(next) = self.pending.remove(&held) else {
                break;
            };
            summary.apply_delta(&next)?;
            progressed = true;
        }
        if self.pending.is_empty() {
            self.gap_since = None;
        } else if progressed {
            self.gap_since = Some(now);
        }
        Ok(())
    }

    fn clear(&mut self) {
        self.pending.clear();
        self.gap_since = None;
    }

    /// Deltas held now.
    #[cfg(test)]
    pub(crate) fn pending(&self) -> usize {
        self.pending.len()
    }
}

/// Anything that owns the node's [`LocalSummary`]: the summary itself, or the shadow
/// index that maintains it.
pub trait HoldsSummary: Send + 'static {
    /// The summary to gossip.
    fn summary(&self) -> &LocalSummary;
}

impl HoldsSummary for LocalSummary {
    fn summary(&self) -> &LocalSummary {
        self
    }
}

impl HoldsSummary for ShadowIndex {
    fn summary(&self) -> &LocalSummary {
        ShadowIndex::summary(self)
    }
}

/// What the gossip task sends a peer next.
#[derive(Debug, Clone)]
pub struct SummaryUpdate {
    /// The version the peer holds once it applied this.
    pub version: u64,
    /// Wall ms of the oldest change carried (0: unknown).
    pub oldest_change_ms: u64,
    /// Delta or snapshot.
    pub body: SummaryBody,
}

/// A delta or a whole snapshot.
#[derive(Debug, Clone)]
pub enum SummaryBody {
    /// The changes since the version the peer holds.
    Delta(SummaryDelta),
    /// Everything.
    Snapshot(SummarySnapshot),
}

/// The cluster's read side of the local summary (object safe, so the cluster need not
/// know what holds the summary).
pub trait SummarySource: Send + Sync + std::fmt::Debug + 'static {
    /// Current version.
    fn version(&self) -> u64;
    /// Fingerprints held.
    fn len(&self) -> usize;
    /// True when empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// What a peer that was last sent `last_sent` (`None`: nothing yet) needs now;
    /// `None` when it is up to date.
    fn update_since(&self, last_sent: Option<u64>) -> Option<SummaryUpdate>;
}

/// The node's own summary (or the index holding it), shared between the router (which
/// changes it) and the gossip task (which reads deltas). It also remembers when each
/// version was reached, so that a delta can carry the time of its oldest change.
pub struct SharedSummary<S = LocalSummary> {
    inner: Mutex<SummaryInner<S>>,
    clock: WallClock,
}

struct SummaryInner<S> {
    holder: S,
    /// (version reached, wall ms when reached), oldest first.
    changes: VecDeque<(u64, u64)>,
}

impl<S: HoldsSummary> std::fmt::Debug for SharedSummary<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedSummary")
            .field("version", &self.read(|s| s.summary().version()))
            .finish()
    }
}

impl<S: HoldsSummary> SharedSummary<S> {
    /// Share `holder`, stamping summary changes with `clock`.
    pub fn new(holder: S, clock: WallClock) -> Arc<Self> {
        Arc::new(SharedSummary {
            inner: Mutex::new(SummaryInner {
                holder,
                changes: VecDeque::new(),
            }),
            clock,
        })
    }

    /// Change the holder (keep `f` short: the gossip task waits on the same lock).
    pub fn update<R>(&self, f: impl FnOnce(&mut S) -> R) -> R {
        let mut g = self.inner.lock();
        let before = g.holder.summary().version();
        let r = f(&mut g.holder);
        let after = g.holder.summary().version();
        if after != before {
            let now = (self.clock)();
            if g.changes.len() == CHANGE_LOG {
                g.changes.pop_front();
            }
            g.changes.push_back((after, now));
        }
        r
    }

    /// Read the holder.
    pub fn read<R>(&self, f: impl FnOnce(&S) -> R) -> R {
        f(&self.inner.lock().holder)
    }
}

/// Wall ms of the oldest change after version `v` (0 when unknown).
fn oldest_change_after(changes: &VecDeque<(u64, u64)>, v: u64) -> u64 {
    changes
        .iter()
        .find(|(ver, _)| *ver > v)
        .map_or(0, |(_, t)| *t)
}

impl<S: HoldsSummary> SummarySource for SharedSummary<S> {
    fn version(&self) -> u64 {
        self.read(|s| s.summary().version())
    }

    fn len(&self) -> usize {
        self.read(|s| s.summary().len())
    }

    fn update_since(&self, last_sent: Option<u64>) -> Option<SummaryUpdate> {
        let g = self.inner.lock();
        let summary = g.holder.summary();
        let version = summary.version();
        let snapshot = || SummaryUpdate {
            version,
            oldest_change_ms: 0,
            body: SummaryBody::Snapshot(summary.snapshot()),
        };
        match last_sent {
            Some(v) if v == version => None,
            Some(v) => Some(match summary.delta_since(v) {
                Some(delta) => SummaryUpdate {
                    version,
                    oldest_change_ms: oldest_change_after(&g.changes, v),
                    body: SummaryBody::Delta(delta),
                },
                None => snapshot(),
            }),
            None => Some(snapshot()),
        }
    }
}

/// Per-peer sender state.
#[derive(Debug, Default)]
pub(crate) struct GossipState {
    peers: HashMap<NodeId, PeerGossip>,
}

#[derive(Debug, Default)]
struct PeerGossip {
    /// The version the peer was last sent; `None`: send a snapshot.
    last_sent: Option<u64>,
    in_flight: bool,
    snapshot_requested_at: Option<Instant>,
}

/// A peer (re)joined: it gets a snapshot on the next round.
pub(crate) fn peer_joined(inner: &Inner, node: &NodeId) {
    inner.gossip.lock().peers.remove(node);
}

/// The gossip loop: one round per `gossip_interval` until shutdown.
pub(crate) async fn run(inner: Arc<Inner>) {
    let mut tick = tokio::time::interval(inner.config.gossip_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = inner.shutdown.cancelled() => return,
            _ = tick.tick() => round(&inner),
        }
    }
}

fn round(inner: &Arc<Inner>) {
    for (node, conn) in inner.conns.all() {
        if conn.close_reason().is_none() {
            inner
                .peers
                .record_rtt(&node, conn.rtt().as_secs_f64() * 1000.0);
        }
    }
    let stats = inner.local_stats.lock().clone();
    for peer in inner.peers.alive_ids() {
        let last_sent = {
            let mut g = inner.gossip.lock();
            let st = g.peers.entry(peer.clone()).or_default();
            if st.in_flight {
                continue;
            }
            st.last_sent
        };
        let Some(update) = inner.summary.update_since(last_sent) else {
            continue;
        };
        let (version, oldest_ms) = (update.version, update.oldest_change_ms);
        let origin = inner.node_id.clone();
        let msg = match update.body {
            SummaryBody::Delta(delta) => GossipMessage::SummaryDelta {
                origin,
                delta,
                stats: stats.clone(),
            },
            SummaryBody::Snapshot(snapshot) => GossipMessage::SummarySnapshot {
                origin,
                snapshot,
                stats: stats.clone(),
            },
        };
        let is_snapshot = matches!(msg, GossipMessage::SummarySnapshot { .. });
        let frame = frame(oldest_ms, &msg);
        if frame.len() > MAX_GOSSIP_MESSAGE + 9 {
            tracing::warn!(bytes = frame.len(), "summary over the gossip cap; not sent");
            continue;
        }
        if let Some(st) = inner.gossip.lock().peers.get_mut(&peer) {
            st.in_flight = true;
        }
        let inner = inner.clone();
        tokio::spawn(async move {
            let result = transport::send_uni(&inner, &peer, TrafficKind::Summary, &frame).await;
            if result.is_ok() {
                ClusterMetrics::bump(if is_snapshot {
                    &inner.metrics.snapshots_sent
                } else {
                    &inner.metrics.deltas_sent
                });
            }
            let mut g = inner.gossip.lock();
            if let Some(st) = g.peers.get_mut(&peer) {
                st.in_flight = false;
                st.last_sent = result.is_ok().then_some(version);
            }
        });
    }
}

fn frame(oldest_change_ms: u64, msg: &GossipMessage) -> Vec<u8> {
    let body = wire::encode(msg);
    let mut f = Vec::with_capacity(body.len() + 9);
    f.push(STREAM_GOSSIP);
    f.extend_from_slice(&oldest_change_ms.to_le_bytes());
    f.extend_from_slice(&body);
    f
}

/// Handle one gossip frame (after its kind byte) from `from`.
pub(crate) async fn handle_frame(inner: &Arc<Inner>, from: &NodeId, bytes: &[u8]) {
    let Some((stamp, body)) = bytes.split_first_chunk::<8>() else {
        ClusterMetrics::bump(&inner.metrics.malformed_received);
        return;
    };
    let oldest_change_ms = u64::from_le_bytes(*stamp);
    let msg: GossipMessage = match wire::decode(body, MAX_GOSSIP_MESSAGE) {
        Ok(m) => m,
        Err(e) => {
            tracing::debug!(peer = %from, "gossip refused: {e}");
            ClusterMetrics::bump(&inner.metrics.malformed_received);
            return;
        }
    };
    let origin = match &msg {
        GossipMessage::SummaryDelta { origin, .. }
        | GossipMessage::SummarySnapshot { origin, .. }
        | GossipMessage::SnapshotRequest { origin, .. } => origin,
    };
    if origin != from {
        ClusterMetrics::bump(&inner.metrics.spoofed_received);
        return;
    }
    let now = Instant::now();
    let need_snapshot = match msg {
        GossipMessage::SnapshotRequest { .. } => {
            if let Some(st) = inner.gossip.lock().peers.get_mut(from) {
                st.last_sent = None;
            }
            false
        }
        GossipMessage::SummarySnapshot {
            snapshot, stats, ..
        } => {
            let Some(mut guard) = inner.peers.peers.get_mut(from) else {
                return;
            };
            let e = &mut *guard;
            let summary = e.summary.get_or_insert_with(PeerSummary::new);
            summary.apply_snapshot(snapshot);
            // Deltas that overtook the snapshot follow on from it.
            e.reorder.after_snapshot(summary, now);
            e.summary_at = Some(now);
            e.summary_bytes = bytes.len() as u64 + 1;
            drop(guard);
            if stats.version > 0 {
                inner.peers.offer_stats(from, &stats, now);
            }
            false
        }
        GossipMessage::SummaryDelta { delta, stats, .. } => {
            let delta_is_empty = delta.is_empty();
            let applied = {
                let Some(mut guard) = inner.peers.peers.get_mut(from) else {
                    return;
                };
                let e = &mut *guard;
                match e.summary.as_mut() {
                    None => Err(()),
                    Some(s) => match e.reorder.receive(s, delta, now) {
                        Ok(DeltaOutcome::Applied) => {
                            e.summary_at = Some(now);
                            Ok(true)
                        }
                        Ok(DeltaOutcome::Buffered) => Ok(false),
                        Ok(DeltaOutcome::NeedSnapshot) => Err(()),
                        Err(err) => {
                            tracing::debug!(peer = %from, "bad delta: {err}");
                            ClusterMetrics::bump(&inner.metrics.malformed_received);
                            return;
                        }
                    },
                }
            };
            if stats.version > 0 {
                inner.peers.offer_stats(from, &stats, now);
            }
            if applied == Ok(true) && oldest_change_ms > 0 && !delta_is_empty {
                let wall = (inner.config.wall_clock)();
                inner
                    .metrics
                    .record_staleness(wall.saturating_sub(oldest_change_ms));
            }
            applied.is_err()
        }
    };
    if need_snapshot {
        let have_version = inner
            .peers
            .peers
            .get(from)
            .and_then(|e| e.summary.as_ref().map(|s| s.version()));
        {
            let mut g = inner.gossip.lock();
            let st = g.peers.entry(from.clone()).or_default();
            if st
                .snapshot_requested_at
                .is_some_and(|t| now.saturating_duration_since(t) < SNAPSHOT_REQUEST_BACKOFF)
            {
                return;
            }
            st.snapshot_requested_at = Some(now);
        }
        let req = GossipMessage::SnapshotRequest {
            origin: inner.node_id.clone(),
            have_version: have_version.unwrap_or(0),
        };
        let f = frame(0, &req);
        ClusterMetrics::bump(&inner.metrics.snapshot_requests_sent);
        if let Err(e) = transport::send_uni(inner, from, TrafficKind::Summary, &f).await {
            tracing::debug!(peer = %from, "snapshot request: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    fn clock() -> (Arc<AtomicU64>, WallClock) {
        let t = Arc::new(AtomicU64::new(1_000));
        let c = t.clone();
        (t, Arc::new(move || c.load(Ordering::Relaxed)))
    }

    #[test]
    fn first_update_is_a_snapshot_then_deltas_with_oldest_change_time() {
        let (t, clock) = clock();
        let shared = SharedSummary::new(LocalSummary::new().starting_at(10), clock);
        shared.update(|s| s.record_add(1));
        let first = shared.update_since(None).unwrap();
        assert!(matches!(first.body, SummaryBody::Snapshot(_)));
        assert_eq!(first.version, 11);
        assert!(shared.update_since(Some(11)).is_none(), "up to date");

        t.store(2_000, Ordering::Relaxed);
        shared.update(|s| s.record_add(2));
        t.store(3_000, Ordering::Relaxed);
        shared.update(|s| s.record_remove(1));
        let next = shared.update_since(Some(11)).unwrap();
        assert_eq!(next.version, 13);
        assert_eq!(
            next.oldest_change_ms, 2_000,
            "the oldest change not yet sent"
        );
        match next.body {
            SummaryBody::Delta(d) => {
                assert_eq!(d.added, vec![2]);
                assert_eq!(d.removed, vec![1]);
            }
            SummaryBody::Snapshot(_) => panic!("expected a delta"),
        }
        // A reader that does not change anything records no change point.
        shared.update(|s| s.contains(2));
        assert_eq!(
            shared.update_since(Some(12)).unwrap().oldest_change_ms,
            3_000
        );
        // A version we cannot serve a delta from gets a snapshot.
        assert!(matches!(
            shared.update_since(Some(99)).unwrap().body,
            SummaryBody::Snapshot(_)
        ));
    }

    fn delta(from: u64, to: u64, added: &[u32]) -> SummaryDelta {
        SummaryDelta {
            from_version: from,
            to_version: to,
            added: added.to_vec(),
            removed: vec![],
        }
    }

    fn peer_at(version: u64) -> PeerSummary {
        let mut p = PeerSummary::new();
        p.apply_snapshot(SummarySnapshot {
            version,
            fingerprints: vec![],
        });
        p
    }

    #[test]
    fn overtaken_deltas_wait_for_the_gap_instead_of_a_snapshot() {
        let t0 = Instant::now();
        let mut peer = peer_at(1);
        let mut r = DeltaReorder::default();
        // 3->4 and 2->3 overtake 1->2 (three uni-streams, delivered backwards).
        assert_eq!(
            r.receive(&mut peer, delta(3, 4, &[4]), t0).unwrap(),
            DeltaOutcome::Buffered
        );
        assert_eq!(
            r.receive(&mut peer, delta(2, 3, &[3]), t0).unwrap(),
            DeltaOutcome::Buffered
        );
        assert_eq!(peer.version(), 1);
        assert_eq!(
            r.receive(
                &mut peer,
                delta(1, 2, &[2]),
                t0 + Duration::from_millis(300)
            )
            .unwrap(),
            DeltaOutcome::Applied
        );
        assert_eq!(peer.version(), 4, "the held deltas followed on");
        assert_eq!(peer.len(), 3);
        assert_eq!(r.pending(), 0);
    }

    #[test]
    fn a_gap_that_persists_or_overflows_asks_for_a_snapshot() {
        let t0 = Instant::now();
        let mut peer = peer_at(1);
        let mut r = DeltaReorder::default();
        assert_eq!(
            r.receive(&mut peer, delta(2, 3, &[]), t0).unwrap(),
            DeltaOutcome::Buffered
        );
        assert_eq!(
            r.receive(&mut peer, delta(3, 4, &[]), t0 + GAP_TIMEOUT)
                .unwrap(),
            DeltaOutcome::NeedSnapshot
        );
        assert_eq!(r.pending(), 0);
        // A snapshot then picks up the deltas that follow it.
        let mut r = DeltaReorder::default();
        for v in 5..5 + MAX_PENDING_DELTAS as u64 {
            assert_eq!(
                r.receive(&mut peer, delta(v, v + 1, &[v as u32]), t0)
                    .unwrap(),
                DeltaOutcome::Buffered
            );
        }
        let mut snap = peer_at(6);
        r.after_snapshot(&mut snap, t0);
        assert_eq!(snap.version(), 5 + MAX_PENDING_DELTAS as u64);
        assert_eq!(r.pending(), 0);
        // Too many held deltas: stop waiting.
        let mut r = DeltaReorder::default();
        for v in 5..5 + MAX_PENDING_DELTAS as u64 {
            r.receive(&mut peer, delta(v, v + 1, &[]), t0).unwrap();
        }
        assert_eq!(
            r.receive(&mut peer, delta(50, 51, &[]), t0).unwrap(),
            DeltaOutcome::NeedSnapshot
        );
        // A delta from before what we hold that reaches past it cannot be repaired.
        assert_eq!(
            r.receive(&mut peer, delta(0, 9, &[]), t0).unwrap(),
            DeltaOutcome::NeedSnapshot
        );
    }

    #[test]
    fn frames_decode_and_garbage_does_not() {
        let msg = GossipMessage::SnapshotRequest {
            origin: NodeId::from("a"),
            have_version: 3,
        };
        let f = frame(7, &msg);
        assert_eq!(f[0], STREAM_GOSSIP);
        assert_eq!(u64::from_le_bytes(f[1..9].try_into().unwrap()), 7);
        let back: GossipMessage = wire::decode(&f[9..], MAX_GOSSIP_MESSAGE).unwrap();
        assert_eq!(back, msg);
        assert!(wire::decode::<GossipMessage>(&[0xff; 64], MAX_GOSSIP_MESSAGE).is_err());
    }
}
