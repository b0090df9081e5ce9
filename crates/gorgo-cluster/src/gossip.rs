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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use gorgo_core::gossip::{
    self as core_gossip, GossipConfig, GossipSender, Planned, Prepared, SendId, SummaryEvent,
};
use gorgo_core::summary::{LocalSummary, SummarySnapshot};
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
    /// The summary's last snapshot, sorted once for every peer that gets it.
    snapshots: Arc<SnapshotCache>,
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
                snapshots: Arc::default(),
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
                round(&gossip, &transport).await;
                tick.reset();
            }
            _ = tick.tick() => round(&gossip, &transport).await,
        }
    }
}

/// One round: every peer's deltas sent at once, then the snapshots built
/// ([`build_snapshots`]) and sent. Awaited by [`run`] before its next round, so that a
/// round plans its snapshots only once the last round's are in the cache: a version is
/// sorted once however many rounds ask for it.
async fn round(gossip: &Arc<GossipDriver>, transport: &Arc<Transport>) {
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
    let (deltas, snapshots) = gossip.plan_round(&peers);
    // The deltas wait for no sort.
    send_all(gossip, transport, deltas);
    if snapshots.is_empty() {
        return;
    }
    // Snapshots are sorted and encoded after every lock, off this task: once per
    // engine a round, one frame for every peer that gets it.
    let mut out = Vec::new();
    for (replica, frame, peers) in build_snapshots(gossip.me.clone(), snapshots).await {
        for (peer, id) in peers {
            let Some(frame) = frame.as_ref().filter(|f| f.len() <= MAX_GOSSIP_FRAME) else {
                if let Some(f) = &frame {
                    tracing::warn!(
                        bytes = f.len(),
                        replica,
                        "summary over the gossip cap; not sent"
                    );
                }
                gossip.on_sent(replica, &peer, id, false);
                continue;
            };
            out.push((replica, peer, id, frame.clone(), true));
        }
    }
    send_all(gossip, transport, out);
}

/// Each job's snapshot sorted (once per version: [`SnapshotCache`]) and framed as node
/// `me`'s on tokio's blocking pool, with the job's replica and peers; no frame (sends
/// failed) when that task did not finish (the runtime shutting down).
///
/// Why not on the gossip task: sorting a 4M-fingerprint set takes 60-130 ms, for which
/// it held a tokio worker and every task queued behind it (forwards, SWIM, streams).
async fn build_snapshots(me: NodeId, mut jobs: Vec<SnapshotJob>) -> Vec<BuiltSnapshot> {
    let peers: Vec<(u16, Vec<(NodeId, SendId)>)> = jobs
        .iter_mut()
        .map(|j| (j.replica, std::mem::take(&mut j.peers)))
        .collect();
    let built = tokio::task::spawn_blocking(move || {
        jobs.into_iter()
            .map(|j| Some(j.build(&me)))
            .collect::<Vec<_>>()
    })
    .await;
    let frames = built.unwrap_or_else(|e| {
        tracing::warn!("summary snapshots not built: {e}");
        vec![None; peers.len()]
    });
    peers
        .into_iter()
        .zip(frames)
        .map(|((replica, peers), frame)| (replica, frame, peers))
        .collect()
}

/// A snapshot built for a round: (replica, its frame if built, every peer that gets it
/// with its send's id).
type BuiltSnapshot = (u16, Option<Bytes>, Vec<(NodeId, SendId)>);

/// Send each of `out` on a uni-stream of its own, and report each send's outcome to
/// its engine's sender.
fn send_all(gossip: &Arc<GossipDriver>, transport: &Arc<Transport>, out: Vec<Outbound>) {
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

/// A frame to send: (replica, peer, send id, frame, is a snapshot).
type Outbound = (u16, NodeId, SendId, Bytes, bool);

/// One engine's snapshot of a round, to build after the locks
/// ([`GossipDriver::plan_round`]).
struct SnapshotJob {
    replica: u16,
    cache: Arc<SnapshotCache>,
    source: SnapshotSource,
    stats: QueueStats,
    /// Every peer that gets it, with its send's id.
    peers: Vec<(NodeId, SendId)>,
}

impl SnapshotJob {
    /// After every lock (on the blocking pool: [`build_snapshots`]): the snapshot
    /// sorted (once per version: [`SnapshotCache`]) and framed as node `me`'s, once for
    /// all the job's peers.
    fn build(self, me: &NodeId) -> Bytes {
        let snapshot = self.cache.sorted(self.source);
        let msg = GossipMessage::SummarySnapshot {
            origin: me.clone(),
            snapshot: SummarySnapshot::clone(&snapshot),
            stats: self.stats,
        };
        Bytes::from(frame(0, &msg))
    }
}

impl GossipDriver {
    /// What every engine sends each of `peers` this round, decided under the engines'
    /// lock: deltas framed, and at most one snapshot job per engine, whose set was
    /// copied (or found in its cache) under one hold of the summary's lock for every
    /// peer of the engine, so that all the peers that get a snapshot this round get
    /// the same version, sorted once.
    fn plan_round(&self, peers: &[NodeId]) -> (Vec<Outbound>, Vec<SnapshotJob>) {
        let (mut out, mut jobs) = (Vec::new(), Vec::new());
        let mut engines = self.engines.lock();
        for (&replica, e) in engines.iter_mut() {
            e.sender.retain_peers(|p| peers.contains(p));
            let (mut deltas, mut snapshot_peers, mut source) = (Vec::new(), Vec::new(), None);
            let (sender, stats, left, cache) = (&mut e.sender, &e.stats, e.left, &e.snapshots);
            e.summary.with_summary(&mut |s| {
                for peer in peers {
                    if left && sender.acked(peer).is_some() {
                        // The peer took the engine's end: nothing more of it goes
                        // there.
                        continue;
                    }
                    match sender.plan(peer, s, stats) {
                        None => {}
                        Some((id, Planned::Message(msg))) => deltas.push((peer.clone(), id, *msg)),
                        Some((id, Planned::Snapshot)) => {
                            // One version for every peer: the summary is not changed
                            // while this lock is held.
                            source.get_or_insert_with(|| cache.source(s));
                            snapshot_peers.push((peer.clone(), id));
                        }
                    }
                }
            });
            for (peer, id, msg) in deltas {
                let oldest_ms = match &msg {
                    GossipMessage::SummaryDelta { delta, .. } => {
                        e.summary.oldest_change_after(delta.from_version)
                    }
                    _ => 0,
                };
                let frame = frame(oldest_ms, &msg);
                if frame.len() > MAX_GOSSIP_FRAME {
                    tracing::warn!(
                        bytes = frame.len(),
                        replica,
                        "summary over the gossip cap; not sent"
                    );
                    e.sender.on_sent(&peer, id, false);
                    continue;
                }
                out.push((replica, peer, id, Bytes::from(frame), false));
            }
            if let Some(source) = source {
                jobs.push(SnapshotJob {
                    replica,
                    cache: e.snapshots.clone(),
                    source,
                    stats: e.stats.clone(),
                    peers: snapshot_peers,
                });
            }
        }
        (out, jobs)
    }
}

/// One engine's last snapshot, sorted, kept for the peers that get the same version
/// later (a snapshot request, a join). Why: a snapshot is the whole set sorted, up to
/// 4M fingerprints; built for each peer that asked, under the summary's lock, it held
/// the request path up for its whole sort (140 ms a peer measured at 4M) (docs/cluster.md, "Snapshots off
/// the lock"). Keyed by version and sample: within one summary a version names one
/// set (the deltas peers apply rest on it), and the sample can change without a new
/// version. A summary that replaces the engine's ([`GossipDriver::set_engine`]) gets
/// a cache of its own.
#[derive(Debug, Default)]
pub(crate) struct SnapshotCache {
    held: Mutex<Option<Arc<SummarySnapshot>>>,
    /// Sets sorted: one per version and sample, however many peers get it (what tests
    /// and measurements count).
    sorts: AtomicU64,
    /// The thread the last sort ran on (tests: not the gossip task's).
    #[cfg(test)]
    sorted_on: Mutex<Option<std::thread::ThreadId>>,
}

/// What a snapshot is built from ([`SnapshotCache::source`]).
#[derive(Debug)]
pub(crate) enum SnapshotSource {
    /// The cache's, sorted already.
    Sorted(Arc<SummarySnapshot>),
    /// A copy of the set as it stood, in no order.
    Copied(SummarySnapshot),
}

impl SnapshotCache {
    /// Under the summary's lock: the cached snapshot when it is of `s` as it stands,
    /// otherwise a copy of its set, unsorted (O(fingerprints), but no sort).
    pub(crate) fn source(&self, s: &LocalSummary) -> SnapshotSource {
        let held = self.held.lock();
        match held.as_ref() {
            Some(c) if c.version == s.version() && c.sample == s.sample() => {
                SnapshotSource::Sorted(c.clone())
            }
            _ => SnapshotSource::Copied(SummarySnapshot {
                version: s.version(),
                fingerprints: s.fingerprints().collect(),
                sample: s.sample(),
            }),
        }
    }

    /// After the summary's lock: the snapshot `source` is of, sorted (and kept) when a
    /// copy.
    pub(crate) fn sorted(&self, source: SnapshotSource) -> Arc<SummarySnapshot> {
        match source {
            SnapshotSource::Sorted(s) => s,
            SnapshotSource::Copied(mut s) => {
                s.fingerprints.sort_unstable();
                self.sorts.fetch_add(1, Ordering::Relaxed);
                #[cfg(test)]
                {
                    *self.sorted_on.lock() = Some(std::thread::current().id());
                }
                let s = Arc::new(s);
                *self.held.lock() = Some(s.clone());
                s
            }
        }
    }

    /// Sets sorted so far.
    #[cfg(test)]
    pub(crate) fn sorts(&self) -> u64 {
        self.sorts.load(Ordering::Relaxed)
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
    // A snapshot's set (up to millions of fingerprints) is built here, before the
    // peer's shard lock, which routing reads on every request: under it, the snapshot
    // is swapped in (docs/cluster.md, "Snapshots off the lock").
    let mut msg = Prepared::new(msg);
    let (now, now_ms) = (Instant::now(), gossip.now_ms());
    let (received, over_cap) = {
        let Some(mut guard) = transport.peers.peers.get_mut(from) else {
            transport.peers.dropped_before_entry(from);
            return;
        };
        // Within the cap on what the peer's summaries hold, all its engines together,
        // and of the run heard of the peer.
        let received = guard.receive(&gossip.me, from, &mut msg, now_ms, &gossip.config);
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
    // What a snapshot replaced is freed now, after the lock.
    drop(msg);
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

    /// A driver gossiping a summary of `n` fingerprints as engine 0 of node "me".
    fn driver(n: u32) -> (GossipDriver, Arc<SharedSummary>) {
        let (_, clock) = clock();
        let summary = SharedSummary::new(LocalSummary::new(), clock.clone());
        summary.update(|s| (0..n).rev().for_each(|fp| s.record_add(fp)));
        let driver = GossipDriver::new(NodeId::from("me"), 1, summary.clone(), clock);
        (driver, summary)
    }

    fn peers(k: usize) -> Vec<NodeId> {
        (0..k).map(|i| NodeId(format!("p{i}"))).collect()
    }

    /// The frames a round sends, snapshots built as `round` builds them: (peer, is a
    /// snapshot, frame). Every send is marked delivered.
    fn run_round(d: &GossipDriver, peers: &[NodeId]) -> Vec<(NodeId, bool, Bytes)> {
        let (mut sent, jobs) = d.plan_round(peers);
        for mut job in jobs {
            let peers = std::mem::take(&mut job.peers);
            let f = job.build(&d.me);
            sent.extend(peers.into_iter().map(|(p, id)| (0, p, id, f.clone(), true)));
        }
        sent.into_iter()
            .map(|(r, p, id, f, snap)| {
                d.on_sent(r, &p, id, true);
                (p, snap, f)
            })
            .collect()
    }

    fn sorts(d: &GossipDriver) -> u64 {
        d.engines.lock()[&0].snapshots.sorts()
    }

    /// k peers that get a snapshot of one version cost one sort, whether they get it
    /// in one round (joins) or in k (snapshot requests), and the sort is of the version
    /// sent. Before, each peer's snapshot sorted the whole set, under the summary's
    /// lock.
    #[test]
    fn k_snapshots_of_one_version_sort_once() {
        let (d, summary) = driver(1_000);
        let ps = peers(4);
        let sent = run_round(&d, &ps);
        assert_eq!(sent.len(), 4);
        assert!(sent.iter().all(|(_, snap, _)| *snap));
        assert_eq!(sorts(&d), 1, "four joins, one sort");
        let want = summary.read(|s| s.snapshot());
        for (_, _, f) in &sent {
            let msg: GossipMessage = wire::decode(&f[9..], MAX_GOSSIP_MESSAGE).unwrap();
            let GossipMessage::SummarySnapshot { snapshot, .. } = msg else {
                panic!("not a snapshot: {msg:?}");
            };
            assert_eq!(snapshot, want);
        }
        let snapshots_to = |sent: &[(NodeId, bool, Bytes)]| -> Vec<NodeId> {
            sent.iter().filter(|s| s.1).map(|s| s.0.clone()).collect()
        };
        // Up to date: deltas, then each peer asks for a snapshot in a round of its
        // own (the version unchanged).
        assert!(snapshots_to(&run_round(&d, &ps)).is_empty());
        for p in &ps {
            assert!(d
                .engines
                .lock()
                .get_mut(&0)
                .unwrap()
                .sender
                .on_snapshot_request(p, 0));
            assert_eq!(snapshots_to(&run_round(&d, &ps)), std::slice::from_ref(p));
        }
        assert_eq!(sorts(&d), 1, "four requests of one version, one sort");
        // A new version is sorted again once asked for; the others get a delta.
        summary.update(|s| s.record_add(5_000));
        assert!(d
            .engines
            .lock()
            .get_mut(&0)
            .unwrap()
            .sender
            .on_snapshot_request(&ps[0], 1_000));
        assert_eq!(snapshots_to(&run_round(&d, &ps)), [ps[0].clone()]);
        assert_eq!(sorts(&d), 2);
        // A sample change keeps the version but changes what a snapshot says.
        summary.update(|s| s.set_sample(gorgo_core::summary::SummarySample::at_least(2)));
        assert!(d
            .engines
            .lock()
            .get_mut(&0)
            .unwrap()
            .sender
            .on_snapshot_request(&ps[1], 1_000));
        run_round(&d, &ps);
        assert_eq!(sorts(&d), 3);
        // A summary that replaces the engine's gets a cache of its own.
        let (_, other) = driver(10);
        d.set_engine(0, other);
        assert_eq!(sorts(&d), 0);
    }

    /// A round's snapshots are sorted and framed on tokio's blocking pool, not on the
    /// gossip task: a 4M-fingerprint sort (60-130 ms) held that task's worker thread,
    /// and every task queued on it, for the whole sort. The frames are those the peers
    /// would get from a sort in place, and one version is still sorted once.
    #[tokio::test(flavor = "current_thread")]
    async fn a_rounds_snapshots_are_sorted_off_the_gossip_task() {
        let (d, summary) = driver(1_000);
        let ps = peers(3);
        let (deltas, jobs) = d.plan_round(&ps);
        assert!(deltas.is_empty());
        let built = build_snapshots(d.me.clone(), jobs).await;
        let cache = d.engines.lock()[&0].snapshots.clone();
        let sorted_on = *cache.sorted_on.lock();
        assert_eq!(cache.sorts(), 1);
        assert!(sorted_on.is_some());
        assert_ne!(
            sorted_on,
            Some(std::thread::current().id()),
            "sorted on the gossip task"
        );
        let [(0, Some(frame), got)] = &built[..] else {
            panic!("one frame of engine 0: {built:?}");
        };
        assert_eq!(got.iter().map(|(p, _)| p.clone()).collect::<Vec<_>>(), ps);
        let msg: GossipMessage = wire::decode(&frame[9..], MAX_GOSSIP_MESSAGE).unwrap();
        let GossipMessage::SummarySnapshot { snapshot, .. } = msg else {
            panic!("not a snapshot: {msg:?}");
        };
        assert_eq!(snapshot, summary.read(|s| s.snapshot()));
    }

    /// The measurements of docs/cluster.md, "Snapshots off the lock": serving k
    /// snapshot requests of one 4M-fingerprint version, as before (each sorted under
    /// the summary's lock) and now. Run in release:
    /// `cargo test --release -p gorgo-cluster --lib -- --ignored --nocapture measure_`.
    #[test]
    #[ignore = "measurement: prints figures"]
    fn measure_serving_k_snapshot_requests_of_one_version() {
        use std::time::Instant as Clock;
        let n = 4_000_000;
        let (d, summary) = driver(n);
        let k = 8;
        let ps = peers(k);
        // Before: each request sorted the set under the summary's lock.
        let (mut held_max, mut total) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..k {
            let t = Clock::now();
            let snapshot = summary.read(|s| s.snapshot());
            let held = t.elapsed();
            held_max = held_max.max(held);
            total += held;
            std::hint::black_box(snapshot);
        }
        println!(
            "before: {k} requests of {n} fingerprints: summary lock held {:.1} ms each \
             (max), {:.1} ms in all",
            held_max.as_secs_f64() * 1e3,
            total.as_secs_f64() * 1e3
        );
        // Now: the peers join (one round, one copy and one sort), then each asks in a
        // round of its own.
        // (summary lock held within, the whole round)
        let timed_round = |ask: Option<&NodeId>| {
            if let Some(p) = ask {
                d.engines
                    .lock()
                    .get_mut(&0)
                    .unwrap()
                    .sender
                    .on_snapshot_request(p, 0);
            }
            let t = Clock::now();
            let (_, jobs) = d.plan_round(&ps);
            let planned = t.elapsed();
            for job in jobs {
                let s = job.cache.sorted(job.source);
                for (p, id) in job.peers {
                    d.on_sent(0, &p, id, true);
                }
                std::hint::black_box(s);
            }
            (planned, t.elapsed())
        };
        let (mut plan_max, first) = timed_round(None);
        let mut after = Duration::ZERO;
        for p in &ps {
            let (planned, all) = timed_round(Some(p));
            plan_max = plan_max.max(planned);
            after += all;
        }
        println!(
            "now: {k} joins then {k} requests: summary lock held at most {:.1} ms \
             (a copy, once), first round {:.1} ms in all (copy + sort), {:.3} ms each \
             request after; {} sort(s)",
            plan_max.as_secs_f64() * 1e3,
            first.as_secs_f64() * 1e3,
            after.as_secs_f64() * 1e3 / k as f64,
            sorts(&d)
        );
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
