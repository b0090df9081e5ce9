//! Summary gossip over QUIC: the IO around the core's gossip state machine
//! ([`gorgo_core::gossip`]). Every interval, each alive peer gets what the core's
//! [`GossipSender`] says it needs (a delta of this node's prefix summary since the
//! version it holds, or a snapshot), on its own QUIC uni-stream, with the current queue
//! stats; what arrives goes to the peer's [`gorgo_core::gossip::PeerGossip`] in the
//! peer table, and a snapshot request it asks for is sent back. Every round also times
//! out the reorder buffers held ([`gorgo_core::gossip::PeerGossip::tick`]), so a gap is
//! let go though the peer sends nothing more.
//!
//! Frame on the stream: `[STREAM_GOSSIP][oldest_change_ms: u64 LE][wire::GossipMessage]`.
//! `oldest_change_ms` is when (origin's wall clock) the oldest change in the delta was
//! made; the receiver subtracts it from its own clock to measure staleness. 0 means
//! unknown (snapshots).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use gorgo_core::gossip::{self as core_gossip, GossipConfig, GossipSender, SendId, SummaryEvent};
use gorgo_core::summary::LocalSummary;
use gorgo_core::wire::{self, GossipMessage, MAX_GOSSIP_MESSAGE};
use gorgo_core::ShadowIndex;
use gorgo_core::{NodeId, QueueStats};
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::WallClock;
use crate::state::{ClusterMetrics, TrafficKind};
use crate::transport::{self, Transport, MAX_GOSSIP_FRAME, STREAM_GOSSIP};

/// How many change points [`SharedSummary`] remembers for staleness stamps.
const CHANGE_LOG: usize = 4096;

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
    /// Run `f` on the summary (keep it short: whoever changes the summary waits).
    fn with_summary(&self, f: &mut dyn FnMut(&LocalSummary));
    /// Wall ms (origin clock) of the oldest change after version `v`; 0 when unknown.
    fn oldest_change_after(&self, v: u64) -> u64;
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

impl<S: HoldsSummary> SummarySource for SharedSummary<S> {
    fn version(&self) -> u64 {
        self.read(|s| s.summary().version())
    }

    fn len(&self) -> usize {
        self.read(|s| s.summary().len())
    }

    fn with_summary(&self, f: &mut dyn FnMut(&LocalSummary)) {
        self.read(|s| f(s.summary()))
    }

    fn oldest_change_after(&self, v: u64) -> u64 {
        self.inner
            .lock()
            .changes
            .iter()
            .find(|(ver, _)| *ver > v)
            .map_or(0, |(_, t)| *t)
    }
}

/// One engine's side of gossip: the core's sender for its summary stream, the summary
/// it reads and the stats it attaches (docs/design.md, "Replicas": each engine a
/// node fronts is gossiped as its own stream, named by its replica).
struct EngineGossip {
    sender: GossipSender,
    summary: Arc<dyn SummarySource>,
    /// The stats this engine last published (attached to every summary message).
    stats: QueueStats,
    /// The node fronts the engine no more ([`GossipDriver::end_engine`]): `stats` end
    /// its stream, and each peer gets them once.
    left: bool,
}

/// The gossip side of a running member: one [`EngineGossip`] per engine it fronts.
pub(crate) struct GossipDriver {
    me: NodeId,
    config: GossipConfig,
    incarnation: u64,
    /// By replica; replica 0 always there (the summary `start` was given).
    engines: Mutex<std::collections::BTreeMap<u16, EngineGossip>>,
    wall_clock: WallClock,
    /// Origin of the `now_ms` the state machine runs on.
    started: Instant,
    /// Signalled when the node publishes new stats: the round runs then, so that
    /// peers get them at once rather than up to a round later (docs/cluster.md,
    /// "Stats every round").
    published: Notify,
}

impl GossipDriver {
    /// Gossip `summary` as engine 0 of run `incarnation` of node `me`.
    pub(crate) fn new(
        me: NodeId,
        incarnation: u64,
        summary: Arc<dyn SummarySource>,
        wall_clock: WallClock,
    ) -> Self {
        let d = GossipDriver {
            me,
            config: GossipConfig::default(),
            incarnation,
            engines: Mutex::new(std::collections::BTreeMap::new()),
            wall_clock,
            started: Instant::now(),
            published: Notify::new(),
        };
        d.set_engine(0, summary);
        d
    }

    /// Gossip `summary` as engine `replica` (replacing what that replica gossiped:
    /// every peer gets a snapshot of it on the next round, and takes it only if its
    /// version is above the one it holds: see [`crate::ClusterHandle::set_engine`]).
    /// False, and nothing changed, for a replica that left in this run: its peers
    /// hold its end, which outranks anything it could send.
    pub(crate) fn set_engine(&self, replica: u16, summary: Arc<dyn SummarySource>) -> bool {
        let mut engines = self.engines.lock();
        if engines.get(&replica).is_some_and(|e| e.left) {
            return false;
        }
        // Stamped from the start: a summary sent before the first stats are
        // published must already say which run and which engine it is of.
        let version = engines.get(&replica).map_or(0, |e| e.stats.version);
        // The replica's sender forgets every peer (each gets a snapshot next) but
        // stays: a new one would count its sends' ids from 0 again, and a verdict of
        // a send still in flight for the old summary could name a new send's id.
        let sender = match engines.remove(&replica) {
            Some(old) => {
                let mut sender = old.sender;
                sender.retain_peers(|_| false);
                sender
            }
            None => GossipSender::new(self.me.clone(), self.config.clone()),
        };
        engines.insert(
            replica,
            EngineGossip {
                sender,
                summary,
                stats: QueueStats {
                    incarnation: self.incarnation,
                    replica,
                    version,
                    ..QueueStats::default()
                },
                left: false,
            },
        );
        true
    }

    /// The node fronts engine `replica` no more (removed at run time, its requests
    /// done): its stream ends with its last stats at [`core_gossip::LEFT_VERSION`],
    /// draining, which every peer gets once (again after it rejoins or asks for a
    /// snapshot), and on which peers let go of the engine. Nothing else of it is sent,
    /// and stats published for it are refused. Returns those last stats; `None` when
    /// the replica is not gossiped or has left already. Its entry stays: a replica
    /// number is not reused within a run, and engine 0's summary stays readable
    /// ([`crate::ClusterHandle::local_summary`]).
    pub(crate) fn end_engine(&self, replica: u16) -> Option<QueueStats> {
        let mut engines = self.engines.lock();
        let e = engines.get_mut(&replica).filter(|e| !e.left)?;
        e.left = true;
        e.stats.version = core_gossip::LEFT_VERSION;
        e.stats.draining = true;
        // Every peer, up to date or not, is sent the end next.
        e.sender.retain_peers(|_| false);
        Some(e.stats.clone())
    }

    /// The summary engine `replica` gossips.
    pub(crate) fn summary(&self, replica: u16) -> Option<Arc<dyn SummarySource>> {
        self.engines.lock().get(&replica).map(|e| e.summary.clone())
    }

    /// Record `stats` (of engine `stats.replica`) as the engine's latest, their
    /// version made monotonic per engine for this run; false when the engine is not
    /// gossiped, or has left (its stats ended).
    pub(crate) fn set_stats(&self, stats: &mut QueueStats) -> bool {
        let mut engines = self.engines.lock();
        let Some(e) = engines.get_mut(&stats.replica).filter(|e| !e.left) else {
            return false;
        };
        stats.version = stats.version.max(e.stats.version + 1);
        stats.incarnation = self.incarnation;
        e.stats = stats.clone();
        drop(engines);
        self.published.notify_one();
        true
    }

    /// Every engine's last stats (of those that have not left).
    pub(crate) fn all_stats(&self) -> Vec<QueueStats> {
        self.engines
            .lock()
            .values()
            .filter(|e| !e.left)
            .map(|e| e.stats.clone())
            .collect()
    }

    /// A peer (re)joined: it gets a snapshot of every engine on the next round.
    pub(crate) fn peer_joined(&self, node: &NodeId) {
        for e in self.engines.lock().values_mut() {
            e.sender.peer_joined(node);
        }
    }

    fn on_sent(&self, replica: u16, peer: &NodeId, id: SendId, delivered: bool) {
        if let Some(e) = self.engines.lock().get_mut(&replica) {
            e.sender.on_sent(peer, id, delivered);
        }
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }
}

/// The gossip loop until `shutdown`: a round whenever the node publishes stats (it
/// does once per gossip interval), and one per `interval` without a publication, so
/// that summaries still flow from a node that publishes none.
///
/// A round right after the publication sends the stats as fresh as the node has them,
/// as the simulator does. On a timer of its own the round would send stats 0-1
/// interval old, and the foca broadcast of the same stats rides yet another timer
/// (docs/cluster.md, "Stats every round").
pub(crate) async fn run(
    gossip: Arc<GossipDriver>,
    transport: Arc<Transport>,
    interval: Duration,
    shutdown: CancellationToken,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = gossip.published.notified() => {
                round(&gossip, &transport);
                tick.reset();
            }
            _ = tick.tick() => round(&gossip, &transport),
        }
    }
}

fn round(gossip: &Arc<GossipDriver>, transport: &Arc<Transport>) {
    for (node, conn) in transport.conns.all() {
        if conn.close_reason().is_none() {
            transport
                .peers
                .record_rtt(&node, conn.rtt().as_secs_f64() * 1000.0);
        }
    }
    // Reorder buffers whose gap outlived the timeout go now, not when the peer next
    // sends a delta: one that never does would pin them (up to 64 engines each).
    let requests = transport
        .peers
        .tick_gossip(&gossip.me, gossip.now_ms(), &gossip.config);
    for (peer, request) in requests {
        send_snapshot_request(transport, peer, &request);
    }
    let peers = transport.peers.alive_ids();
    // What to send, decided under the lock; sent after it.
    let mut out = Vec::new();
    {
        let mut engines = gossip.engines.lock();
        for (&replica, e) in engines.iter_mut() {
            e.sender.retain_peers(|p| peers.contains(p));
            for peer in &peers {
                if e.left && e.sender.acked(peer).is_some() {
                    // The peer took the engine's end: nothing more of it goes there.
                    continue;
                }
                let mut polled = None;
                let (sender, stats) = (&mut e.sender, &e.stats);
                e.summary
                    .with_summary(&mut |s| polled = sender.poll(peer, s, stats));
                let Some(core_gossip::Outgoing { id, message: msg }) = polled else {
                    continue;
                };
                let (oldest_ms, is_snapshot) = match &msg {
                    GossipMessage::SummaryDelta { delta, .. } => {
                        (e.summary.oldest_change_after(delta.from_version), false)
                    }
                    _ => (0, true),
                };
                let frame = frame(oldest_ms, &msg);
                if frame.len() > MAX_GOSSIP_FRAME {
                    tracing::warn!(
                        bytes = frame.len(),
                        replica,
                        "summary over the gossip cap; not sent"
                    );
                    e.sender.on_sent(peer, id, false);
                    continue;
                }
                out.push((replica, peer.clone(), id, frame, is_snapshot));
            }
        }
    }
    for (replica, peer, id, frame, is_snapshot) in out {
        let (gossip, transport) = (gossip.clone(), transport.clone());
        tokio::spawn(async move {
            let result = transport::send_uni(&transport, &peer, TrafficKind::Summary, &frame).await;
            if result.is_ok() {
                ClusterMetrics::bump(if is_snapshot {
                    &transport.metrics.snapshots_sent
                } else {
                    &transport.metrics.deltas_sent
                });
            }
            // By the send's id: the peer may have been reset and sent another message
            // since this one was polled.
            gossip.on_sent(replica, &peer, id, result.is_ok());
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
pub(crate) fn handle_frame(
    gossip: &Arc<GossipDriver>,
    transport: &Arc<Transport>,
    from: &NodeId,
    bytes: &[u8],
) {
    let metrics = &transport.metrics;
    let Some((stamp, body)) = bytes.split_first_chunk::<8>() else {
        ClusterMetrics::bump(&metrics.malformed_received);
        return;
    };
    let oldest_change_ms = u64::from_le_bytes(*stamp);
    let msg: GossipMessage = match wire::decode(body, MAX_GOSSIP_MESSAGE) {
        Ok(m) => m,
        Err(e) => {
            tracing::debug!(peer = %from, "gossip refused: {e}");
            ClusterMetrics::bump(&metrics.malformed_received);
            return;
        }
    };
    if core_gossip::origin(&msg) != from {
        ClusterMetrics::bump(&metrics.spoofed_received);
        return;
    }
    let replica = core_gossip::replica(&msg);
    if replica >= gorgo_core::types::MAX_REPLICAS {
        ClusterMetrics::bump(&metrics.malformed_received);
        return;
    }
    if let GossipMessage::SnapshotRequest { .. } = &msg {
        // It names one of this node's engines, not one of the peer's, so it makes no
        // state in the peer's row: before, a request for engine 63 added 64 empty
        // engines to it. Taken from a peer in the table only, as all gossip.
        if transport.peers.peers.contains_key(from) {
            if let Some(e) = gossip.engines.lock().get_mut(&replica) {
                // At most one a peer every `SNAPSHOT_REQUEST_EVERY_MS` (the core's
                // rule, which the simulator follows too).
                if !e.sender.on_snapshot_request(from, gossip.now_ms()) {
                    tracing::debug!(peer = %from, replica, "snapshot request too soon after the last: not honoured");
                }
            }
        }
        return;
    }
    let (now, now_ms) = (Instant::now(), gossip.now_ms());
    let (received, over_cap) = {
        let Some(mut guard) = transport.peers.peers.get_mut(from) else {
            transport.peers.dropped_before_entry(from);
            return;
        };
        // Within the cap on what the peer's summaries hold, all its engines together,
        // and of the run heard of the peer.
        let received = guard.receive(&gossip.me, from, msg, now_ms, &gossip.config);
        let e = &mut guard.engines[usize::from(replica)];
        let received = match received {
            Ok(r) => {
                match r.summary {
                    SummaryEvent::Snapshot => {
                        e.summary_at = Some(now);
                        e.summary_bytes = bytes.len() as u64 + 1;
                    }
                    SummaryEvent::Applied { .. } => e.summary_at = Some(now),
                    _ => {}
                }
                if r.stats_updated {
                    e.stats_at = Some(now);
                }
                r
            }
            Err(err) => {
                tracing::debug!(peer = %from, "bad gossip: {err}");
                ClusterMetrics::bump(&metrics.malformed_received);
                return;
            }
        };
        let over_cap = guard.limit_pending(replica, &gossip.me, now_ms, &gossip.config);
        (received, over_cap)
    };
    if received.summary == (SummaryEvent::Applied { empty: false }) && oldest_change_ms > 0 {
        let wall = (gossip.wall_clock)();
        metrics.record_staleness(wall.saturating_sub(oldest_change_ms));
    }
    if let Some(reply) = received.reply.or(over_cap) {
        send_snapshot_request(transport, from.clone(), &reply);
    }
}

/// Send `peer` a snapshot request the gossip state machine asked for, counted.
fn send_snapshot_request(transport: &Arc<Transport>, peer: NodeId, request: &GossipMessage) {
    let f = frame(0, request);
    ClusterMetrics::bump(&transport.metrics.snapshot_requests_sent);
    let transport = transport.clone();
    tokio::spawn(async move {
        if let Err(e) = transport::send_uni(&transport, &peer, TrafficKind::Summary, &f).await {
            tracing::debug!(peer = %peer, "snapshot request: {e}");
        }
    });
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
    fn change_points_stamp_the_oldest_change_not_yet_sent() {
        let (t, clock) = clock();
        let shared = SharedSummary::new(LocalSummary::new().starting_at(10), clock);
        shared.update(|s| s.record_add(1));
        t.store(2_000, Ordering::Relaxed);
        shared.update(|s| s.record_add(2));
        t.store(3_000, Ordering::Relaxed);
        shared.update(|s| s.record_remove(1));
        assert_eq!(shared.oldest_change_after(11), 2_000);
        // A reader that does not change anything records no change point.
        shared.update(|s| s.contains(2));
        assert_eq!(shared.oldest_change_after(12), 3_000);
        assert_eq!(shared.oldest_change_after(13), 0, "nothing newer");
        let mut seen = 0;
        shared.with_summary(&mut |s| seen = s.version());
        assert_eq!(seen, 13);
        assert_eq!(SummarySource::len(&*shared), 1);
    }

    #[test]
    fn frames_decode_and_garbage_does_not() {
        let msg = GossipMessage::SnapshotRequest {
            origin: NodeId::from("a"),
            have_version: 3,
            replica: 0,
        };
        let f = frame(7, &msg);
        assert_eq!(f[0], STREAM_GOSSIP);
        assert_eq!(u64::from_le_bytes(f[1..9].try_into().unwrap()), 7);
        let back: GossipMessage = wire::decode(&f[9..], MAX_GOSSIP_MESSAGE).unwrap();
        assert_eq!(back, msg);
        assert!(wire::decode::<GossipMessage>(&[0xff; 64], MAX_GOSSIP_MESSAGE).is_err());
    }
}
