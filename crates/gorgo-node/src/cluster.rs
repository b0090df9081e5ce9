//! The QUIC cluster (`gorgo-cluster`) behind the router's [`PeerSource`] trait, and the
//! one-call startup of a node with it.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use gorgo_cluster::{
    ClusterConfig, ClusterHandle, ClusterSocket, NodeCredentials, SharedSummary, TlsFiles,
    MAX_APP_MESSAGE,
};
use gorgo_core::summary::SummaryDelta;
use gorgo_core::tuning::TuningMessage;
use gorgo_core::{HashChain, LocalSummary, NodeId, QueueStats};
use tokio_util::sync::CancellationToken;

use crate::error::NodeError;
use crate::peers::{
    ForwardRecv, ForwardSend, GossipCounters, IncomingForward, IncomingForwards, NoPeers,
    PeerEngine, PeerSource, PeerView,
};
use crate::tuning::TUNING_APP_KIND;
use crate::{NodeHandle, NodeListeners, NodeState, ValidatedConfig};

/// The router's view of a running QUIC cluster member.
#[derive(Clone)]
pub struct ClusterPeers {
    handle: ClusterHandle,
    /// The mirror of each engine's summary the cluster gossips, by replica.
    summaries: Arc<parking_lot::Mutex<BTreeMap<u16, Arc<SharedSummary<LocalSummary>>>>>,
    wall_clock: gorgo_cluster::WallClock,
    /// Tuning messages on their way, newest only, per peer.
    tuning_out: Arc<NewestPerPeer>,
}

/// One sender task per peer holding only the newest message for it: a tuning message
/// supersedes the one before it to the same peer (a proposal the older proposal, a
/// report, cumulative, the older report), and a send can wait up to the stream
/// timeout on a peer that is alive to SWIM but takes no streams. A task per message
/// would pile up one every tick per such peer, each holding its message, and outlive
/// the node's shutdown.
#[derive(Default)]
pub struct NewestPerPeer {
    slots: parking_lot::Mutex<
        std::collections::HashMap<NodeId, tokio::sync::watch::Sender<bytes::Bytes>>,
    >,
}

impl NewestPerPeer {
    /// Hand `message` to `to`'s task, replacing what it has not sent yet; the first
    /// message to a peer starts its task, which runs `send` on each newest message in
    /// turn until `stop` resolves or the slot is dropped ([`NewestPerPeer::retain`]).
    pub fn send<S, F>(&self, to: &NodeId, message: bytes::Bytes, send: S, stop: F)
    where
        S: Fn(NodeId, bytes::Bytes) -> BoxFuture<'static, ()> + Send + 'static,
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let mut slots = self.slots.lock();
        if let Some(slot) = slots.get(to) {
            if slot.send(message.clone()).is_ok() {
                return;
            }
        }
        let (slot, mut newest) = tokio::sync::watch::channel(message);
        newest.mark_changed();
        slots.insert(to.clone(), slot);
        let to = to.clone();
        tokio::spawn(async move {
            tokio::pin!(stop);
            loop {
                tokio::select! {
                    biased;
                    _ = &mut stop => return,
                    changed = newest.changed() => if changed.is_err() {
                        return;
                    },
                }
                let message = newest.borrow_and_update().clone();
                tokio::select! {
                    biased;
                    _ = &mut stop => return,
                    _ = send(to.clone(), message) => {}
                }
            }
        });
    }

    /// Drop the slots (ending their tasks once their send is done) of peers `keep`
    /// refuses: peers no longer alive.
    pub fn retain(&self, keep: impl Fn(&NodeId) -> bool) {
        self.slots.lock().retain(|id, _| keep(id));
    }

    /// Peers with a sender task.
    pub fn peers(&self) -> usize {
        self.slots.lock().len()
    }
}

impl std::fmt::Debug for ClusterPeers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterPeers")
            .field("handle", &self.handle)
            .field("engines", &self.summaries.lock().len())
            .finish()
    }
}

impl ClusterPeers {
    /// Wrap a started cluster and the summary it gossips for engine 0 (the one passed
    /// to `gorgo_cluster::start`); `engines` more engines (replicas 1..) get their own
    /// summaries, stamped by `wall_clock`.
    pub fn new(
        handle: ClusterHandle,
        summary: Arc<SharedSummary<LocalSummary>>,
        engines: u16,
        wall_clock: gorgo_cluster::WallClock,
    ) -> Self {
        let peers = ClusterPeers {
            handle,
            summaries: Arc::new(parking_lot::Mutex::new(BTreeMap::from([(0, summary)]))),
            wall_clock,
            tuning_out: Arc::default(),
        };
        for replica in 1..engines {
            peers.add_engine(replica);
        }
        peers
    }
}

impl ClusterPeers {
    /// A tuning message to `to` on its peer's sender task (newest only), which ends
    /// when the cluster closes.
    fn send_newest(&self, to: &NodeId, message: bytes::Bytes) {
        let handle = self.handle.clone();
        let send = move |to: NodeId, bytes: bytes::Bytes| -> BoxFuture<'static, ()> {
            let handle = handle.clone();
            Box::pin(async move {
                if let Err(e) = handle.send_to(&to, TUNING_APP_KIND, &bytes).await {
                    tracing::debug!(peer = %to, error = %e, "tuning message not sent");
                }
            })
        };
        let closed = self.handle.clone();
        self.tuning_out
            .send(to, message, send, async move { closed.closed().await });
    }
}

/// The router's view of one peer from the cluster's: every engine whose stats
/// arrived (one that left the peer is in no view), and the ages of the peer's
/// freshest stats and summary (those of its first engine alone may have stopped
/// coming while the others' come).
fn router_view(p: gorgo_cluster::PeerView) -> PeerView {
    let summary_age_ms = p
        .engines
        .iter()
        .filter_map(|e| e.summary_age_ms)
        .min()
        .or(p.summary_age_ms);
    PeerView {
        id: p.id,
        region: Some(p.region),
        alive: p.alive,
        // No RTT sample yet: the peer is not a candidate worth paying for.
        rtt_ms: p.rtt_ms.unwrap_or(f64::INFINITY),
        stats: p.stats,
        engines: p
            .engines
            .into_iter()
            .filter_map(|e| {
                Some(PeerEngine {
                    stats: e.stats?,
                    stats_age_ms: e.stats_age_ms.unwrap_or(0),
                })
            })
            .collect(),
        stats_age_ms: p.stats_age_ms,
        summary_version: p.summary_version.unwrap_or(0),
        summary_entries: p.summary_len as u64,
        summary_age_ms,
    }
}

impl PeerSource for ClusterPeers {
    fn peers(&self) -> Vec<PeerView> {
        self.handle.peers().into_iter().map(router_view).collect()
    }

    fn matched_tokens(&self, peer: &NodeId, replica: u16, chain: &HashChain) -> u64 {
        self.handle
            .with_peer_summary(peer, replica, |s| s.matched_tokens(chain))
            .unwrap_or(0)
    }

    fn open_forward(
        &self,
        peer: &NodeId,
    ) -> BoxFuture<'static, Result<(ForwardSend, ForwardRecv), NodeError>> {
        let handle = self.handle.clone();
        let peer = peer.clone();
        Box::pin(async move {
            let (send, recv) = handle
                .open_forward(&peer)
                .await
                .map_err(|e| NodeError::Cluster(format!("{peer}: {e}")))?;
            Ok((Box::pin(send) as ForwardSend, Box::pin(recv) as ForwardRecv))
        })
    }

    fn peer_gone(&self, peer: &NodeId) -> BoxFuture<'static, ()> {
        Box::pin(self.handle.peer_gone(peer))
    }

    fn drain(&self) {
        if let Err(e) = self.handle.drain() {
            tracing::warn!(error = %e, "draining: stats broadcast failed");
        }
    }

    fn leave(&self) -> BoxFuture<'static, ()> {
        let handle = self.handle.clone();
        Box::pin(async move {
            if let Err(e) = handle.leave().await {
                // Already stopped (shutdown cancelled): nothing left to leave.
                tracing::debug!(error = %e, "leave");
            }
        })
    }

    fn publish_stats(&self, stats: QueueStats) {
        if let Err(e) = self.handle.broadcast_stats(stats) {
            tracing::debug!(error = %e, "stats broadcast failed");
        }
    }

    fn add_engine(&self, replica: u16) {
        let summary = SharedSummary::new(LocalSummary::new(), self.wall_clock.clone());
        match self.handle.set_engine(replica, summary.clone()) {
            Ok(()) => {
                self.summaries.lock().insert(replica, summary);
            }
            Err(e) => tracing::warn!(replica, error = %e, "engine not gossiped"),
        }
    }

    fn remove_engine(&self, replica: u16) {
        self.summaries.lock().remove(&replica);
        if let Err(e) = self.handle.remove_engine(replica) {
            tracing::warn!(replica, error = %e, "engine's gossip not ended");
        }
    }

    fn publish_summary(&self, replica: u16, delta: &SummaryDelta) {
        let Some(summary) = self.summaries.lock().get(&replica).cloned() else {
            return;
        };
        summary.update(|s| {
            for &fp in &delta.added {
                s.record_add(fp);
            }
            for &fp in &delta.removed {
                s.record_remove(fp);
            }
            // The mirror gossips the shadow index's rate with the set derived at it.
            s.set_sample(delta.sample);
        });
    }

    fn send_tuning(&self, to: &NodeId, msg: &TuningMessage) {
        // `to` may come from a message body (a stale proposal's leader): a sender task
        // for an id no member holds would wait for the cluster to close, one per
        // made-up id.
        let alive = self.handle.alive_peers();
        self.tuning_out.retain(|id| alive.contains(id));
        if !alive.contains(to) {
            tracing::debug!(peer = %to, "tuning message to a node not alive: not sent");
            return;
        }
        let Some(bytes) = tuning_bytes(msg) else {
            return;
        };
        self.send_newest(to, bytes::Bytes::from(bytes));
    }

    fn broadcast_tuning(&self, msg: &TuningMessage) {
        let Some(bytes) = tuning_bytes(msg) else {
            return;
        };
        let bytes = bytes::Bytes::from(bytes);
        // A task per peer, so an unreachable peer does not hold up the others; the
        // tasks of peers gone go with them.
        let alive = self.handle.alive_peers();
        self.tuning_out.retain(|id| alive.contains(id));
        for to in &alive {
            self.send_newest(to, bytes.clone());
        }
    }

    fn identity_refusals(&self) -> Vec<gorgo_cluster::IdentityRefusal> {
        self.handle.identity_refusals()
    }

    fn gossip_counters(&self) -> GossipCounters {
        let m = self.handle.metrics();
        let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        // Each kind loaded once, the totals summed from them: the split adds up.
        let traffic = crate::peers::Traffic {
            swim: (load(&m.swim_bytes_sent), load(&m.swim_bytes_received)),
            summary: (load(&m.summary_bytes_sent), load(&m.summary_bytes_received)),
            app: (load(&m.app_bytes_sent), load(&m.app_bytes_received)),
        };
        GossipCounters {
            bytes_sent: traffic.swim.0 + traffic.summary.0 + traffic.app.0,
            bytes_received: traffic.swim.1 + traffic.summary.1 + traffic.app.1,
            identity_conflicts: load(&m.identity_conflicts),
            own_id_claimed: load(&m.own_id_claimed),
            own_id_refused: load(&m.own_id_refused),
            refused: crate::peers::Refused {
                malformed: load(&m.malformed_received),
                spoofed: load(&m.spoofed_received),
                handshake: load(&m.handshakes_failed),
                other_protocol: load(&m.handshakes_other_protocol),
                foreign_certificate: load(&m.handshakes_foreign_certificate),
                expired_certificate: load(&m.handshakes_expired_certificate),
                unbound_stream: load(&m.unbound_streams_dropped),
                excess_connection: load(&m.excess_connections_closed),
                misaddressed_announce: load(&m.misaddressed_announces),
            },
            traffic,
            messages_sent: crate::peers::GossipSent {
                deltas: load(&m.deltas_sent),
                snapshots: load(&m.snapshots_sent),
                snapshot_requests: load(&m.snapshot_requests_sent),
            },
            spurious_turn_undead_dropped: load(&m.spurious_turn_undead_dropped),
        }
    }
}

/// A tuning message encoded for the cluster's application channel, `None` (logged)
/// when it does not fit.
fn tuning_bytes(msg: &TuningMessage) -> Option<Vec<u8>> {
    match gorgo_core::wire::try_encode(msg) {
        Ok(b) if b.len() <= MAX_APP_MESSAGE => Some(b),
        Ok(b) => {
            tracing::warn!(bytes = b.len(), "tuning message too large for the cluster");
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, "tuning message not encodable");
            None
        }
    }
}

/// Hand tuning messages from the cluster's application inbox to the node, until
/// `shutdown`. Other kinds and undecodable payloads are dropped (logged).
pub fn spawn_app_inbox(
    handle: &ClusterHandle,
    state: Arc<NodeState>,
    shutdown: CancellationToken,
) -> Result<(), NodeError> {
    let mut inbox = handle
        .app_inbox()
        .ok_or_else(|| NodeError::Cluster("app inbox already taken".into()))?;
    tokio::spawn(async move {
        loop {
            let msg = tokio::select! {
                _ = shutdown.cancelled() => return,
                m = inbox.recv() => match m { Some(m) => m, None => return },
            };
            if msg.kind != TUNING_APP_KIND {
                tracing::debug!(from = %msg.from, kind = msg.kind, "unknown app message kind");
                continue;
            }
            match gorgo_core::wire::decode::<TuningMessage>(&msg.payload, MAX_APP_MESSAGE) {
                Ok(m) => state.on_tuning_message(&msg.from, m),
                Err(e) => {
                    tracing::debug!(from = %msg.from, error = %e, "malformed tuning message")
                }
            }
        }
    });
    Ok(())
}

/// The node's certificates as `[tls]` names them, the key checked against the
/// certificate; errors name the field ([`tls_error`]).
fn load_credentials(config: &ValidatedConfig) -> Result<NodeCredentials, NodeError> {
    let files = TlsFiles {
        ca: config.tls.ca.clone(),
        cert: config.tls.cert.clone(),
        key: config.tls.key.clone(),
    };
    NodeCredentials::load(&files).map_err(tls_error)
}

/// A certificate error as a config error naming its field (`tls.ca`, `tls.cert`,
/// `tls.key`; a certificate for another node names `tls.cert` and `node.id`).
fn tls_error(e: gorgo_cluster::ClusterError) -> NodeError {
    match e {
        gorgo_cluster::ClusterError::Config {
            field: "node_id",
            reason,
        } => NodeError::invalid("tls.cert", format!("`node.id` {reason}")),
        gorgo_cluster::ClusterError::Config { field, reason } => NodeError::invalid(field, reason),
        other => NodeError::Config(other.to_string()),
    }
}

/// Everything a start reads besides the sockets, checked without starting
/// (`gorgo node --check`): the certificates (signed by the CA, valid now, naming
/// `node.id`), the tokenizer and chat template, the learned-weights file. A config
/// that passes the schema but names a missing or mismatched file would otherwise pass
/// the check and fail at the start it was meant to vouch for.
pub fn preflight(config: &ValidatedConfig) -> Result<(), NodeError> {
    load_credentials(config)?
        .check_identity(&NodeId(config.node.id.clone()))
        .map_err(tls_error)?;
    NodeState::new(config.clone(), Arc::new(NoPeers)).map(drop)
}

/// Start a node and its QUIC cluster member from a config: load the certificates,
/// join through the seeds, bind the HTTP and admin listeners, serve until `shutdown`.
pub async fn start_with_cluster(
    config: ValidatedConfig,
    shutdown: CancellationToken,
) -> Result<NodeHandle, NodeError> {
    let credentials = load_credentials(&config)?;
    let listeners = NodeListeners::bind(&config).await?;
    start_with_credentials(config, credentials, listeners, shutdown).await
}

/// [`start_with_cluster`] with credentials in memory and listeners already bound
/// (tests: certificates from `ClusterCa`, sockets on port 0).
pub async fn start_with_credentials(
    config: ValidatedConfig,
    credentials: NodeCredentials,
    listeners: NodeListeners,
    shutdown: CancellationToken,
) -> Result<NodeHandle, NodeError> {
    let mut cc = ClusterConfig::new(
        NodeId(config.node.id.clone()),
        config.node.region.clone(),
        config.listen.quic,
        credentials,
    );
    cc.advertise = config.advertised_quic();
    cc.seeds = config.cluster.seeds.clone();
    cc.seeds.extend(
        config
            .cluster
            .peers
            .values()
            .copied()
            .filter(|a| !config.cluster.seeds.contains(a)),
    );
    cc.gossip_interval = std::time::Duration::from_millis(config.cluster.gossip_interval_ms);
    cc.dial_overrides = config
        .cluster
        .dial_overrides
        .iter()
        .map(|(&advertised, &dial)| (advertised, dial))
        .collect();
    if !config.cluster.peers.is_empty() {
        tracing::info!(
            "cluster.peers: used as seeds; to dial a peer somewhere other than what it advertises, use cluster.dial_overrides"
        );
    }
    // Bound here, as the HTTP and admin listeners are, so that a port in use names
    // its field (the cluster's own bind said "io: Address already in use").
    let udp = std::net::UdpSocket::bind(config.listen.quic).map_err(|e| {
        NodeError::Config(format!(
            "invalid `listen.quic`: cannot listen on {}: {e}",
            config.listen.quic
        ))
    })?;
    let summary = SharedSummary::new(LocalSummary::new(), gorgo_cluster::system_clock());
    let handle = gorgo_cluster::start(
        cc,
        ClusterSocket::Std(udp),
        summary.clone(),
        shutdown.clone(),
    )
    .await
    .map_err(|e| NodeError::Cluster(e.to_string()))?;
    let incoming = adapt_incoming(&handle)?;
    let engines = config.engines().len() as u16;
    let peers = ClusterPeers::new(
        handle.clone(),
        summary,
        engines,
        gorgo_cluster::system_clock(),
    );
    let state = NodeState::new(config, Arc::new(peers))?;
    spawn_app_inbox(&handle, state.clone(), shutdown.clone())?;
    crate::start(state, listeners, incoming, shutdown).await
}

/// The cluster's incoming forward streams, as the node takes them (converted as they
/// are taken: no relay task, no second channel).
pub fn adapt_incoming(handle: &ClusterHandle) -> Result<IncomingForwards, NodeError> {
    let from_cluster = handle
        .incoming_forwards()
        .ok_or_else(|| NodeError::Cluster("incoming forwards already taken".into()))?;
    Ok(IncomingForwards::from_receiver(from_cluster, |f| {
        IncomingForward {
            from: f.from,
            send: Box::pin(f.send),
            recv: Box::pin(f.recv),
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer whose first engine has left (its summary frozen an hour ago) and whose
    /// second still gossips: the router's view, and with it
    /// `gorgo_peer_prefixes_age_seconds`, gives the second's age.
    #[test]
    fn a_peers_summary_age_is_its_freshest_engines() {
        let engine = |replica: u16, summary_age_ms: u64| gorgo_cluster::PeerEngineView {
            replica,
            summary_version: Some(1),
            summary_len: 1,
            summary_bytes: 8,
            summary_age_ms: Some(summary_age_ms),
            pending_deltas: 0,
            stats: None,
            stats_age_ms: None,
        };
        let peer = gorgo_cluster::PeerView {
            id: NodeId::from("b"),
            region: "eu".into(),
            addr: "127.0.0.1:1".parse().unwrap(),
            generation: 1,
            incarnation: None,
            state: gorgo_cluster::PeerState::Alive,
            alive: true,
            rtt_ms: Some(10.0),
            summary_version: Some(1),
            summary_len: 1,
            summary_bytes: 8,
            summary_age_ms: Some(3_600_000),
            stats: None,
            stats_age_ms: None,
            engines: vec![engine(0, 3_600_000), engine(1, 250)],
            bytes_sent: 0,
            bytes_received: 0,
        };
        assert_eq!(router_view(peer).summary_age_ms, Some(250));
    }

    /// A peer that takes no message (alive to SWIM, refusing streams) holds one
    /// sender task however many ticks send to it, and gets the newest message once
    /// it takes one; the task ends when its peer is let go, or at shutdown.
    #[tokio::test]
    async fn a_peer_that_takes_nothing_holds_one_task_and_the_newest_message() {
        let out = NewestPerPeer::default();
        let taken = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let send = {
            let (taken, gate) = (taken.clone(), gate.clone());
            move |_: NodeId, m: bytes::Bytes| -> BoxFuture<'static, ()> {
                let (taken, gate) = (taken.clone(), gate.clone());
                Box::pin(async move {
                    gate.acquire().await.unwrap().forget();
                    taken.lock().push(m);
                })
            }
        };
        let stop = CancellationToken::new();
        let metrics = tokio::runtime::Handle::current().metrics();
        let before = metrics.num_alive_tasks();
        let b = NodeId::from("b");
        for i in 0..100 {
            let stop = stop.clone();
            out.send(
                &b,
                bytes::Bytes::from(format!("{i}")),
                send.clone(),
                async move { stop.cancelled().await },
            );
            tokio::task::yield_now().await;
        }
        assert_eq!(
            metrics.num_alive_tasks(),
            before + 1,
            "one task for the peer"
        );
        // The first message was taken into the send the peer blocks; then the newest.
        gate.add_permits(2);
        tokio::time::timeout(std::time::Duration::from_secs(20), async {
            while taken.lock().len() < 2 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("both sends end");
        assert_eq!(
            *taken.lock(),
            [bytes::Bytes::from("0"), bytes::Bytes::from("99")]
        );
        let settled = || async {
            let tasks = tokio::runtime::Handle::current().metrics();
            tokio::time::timeout(std::time::Duration::from_secs(20), async {
                while tasks.num_alive_tasks() > before {
                    tokio::task::yield_now().await;
                }
            })
            .await
            .expect("the sender task ends");
        };
        out.retain(|_| false);
        assert_eq!(out.peers(), 0);
        settled().await;
        // At shutdown too, mid-send.
        let stop2 = stop.clone();
        out.send(&b, bytes::Bytes::from("x"), send, async move {
            stop2.cancelled().await
        });
        tokio::task::yield_now().await;
        stop.cancel();
        settled().await;
    }
}
