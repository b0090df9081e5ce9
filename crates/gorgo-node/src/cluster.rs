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
    ForwardRecv, ForwardSend, GossipCounters, IncomingForward, IncomingForwards, PeerEngine,
    PeerSource, PeerView,
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
        };
        for replica in 1..engines {
            peers.add_engine(replica);
        }
        peers
    }
}

impl PeerSource for ClusterPeers {
    fn peers(&self) -> Vec<PeerView> {
        self.handle
            .peers()
            .into_iter()
            .map(|p| PeerView {
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
                summary_age_ms: p.summary_age_ms,
            })
            .collect()
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
        let Some(bytes) = tuning_bytes(msg) else {
            return;
        };
        let handle = self.handle.clone();
        let to = to.clone();
        tokio::spawn(async move {
            if let Err(e) = handle.send_to(&to, TUNING_APP_KIND, &bytes).await {
                tracing::debug!(peer = %to, error = %e, "tuning message not sent");
            }
        });
    }

    fn broadcast_tuning(&self, msg: &TuningMessage) {
        let Some(bytes) = tuning_bytes(msg) else {
            return;
        };
        let bytes = bytes::Bytes::from(bytes);
        // One task per peer, so an unreachable peer does not hold up the others.
        for to in self.handle.alive_peers() {
            let handle = self.handle.clone();
            let bytes = bytes.clone();
            tokio::spawn(async move {
                if let Err(e) = handle.send_to(&to, TUNING_APP_KIND, &bytes).await {
                    tracing::debug!(peer = %to, error = %e, "tuning message not sent");
                }
            });
        }
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
            refused: crate::peers::Refused {
                malformed: load(&m.malformed_received),
                spoofed: load(&m.spoofed_received),
                handshake: load(&m.handshakes_failed),
                other_protocol: load(&m.handshakes_other_protocol),
                foreign_certificate: load(&m.handshakes_foreign_certificate),
                unbound_stream: load(&m.unbound_streams_dropped),
                excess_connection: load(&m.excess_connections_closed),
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

/// Start a node and its QUIC cluster member from a config: load the certificates,
/// join through the seeds, bind the HTTP and admin listeners, serve until `shutdown`.
pub async fn start_with_cluster(
    config: ValidatedConfig,
    shutdown: CancellationToken,
) -> Result<NodeHandle, NodeError> {
    let files = TlsFiles {
        ca: config.tls.ca.clone(),
        cert: config.tls.cert.clone(),
        key: config.tls.key.clone(),
    };
    let credentials =
        NodeCredentials::load(&files).map_err(|e| NodeError::Config(format!("tls: {e}")))?;
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
    let summary = SharedSummary::new(LocalSummary::new(), gorgo_cluster::system_clock());
    let handle = gorgo_cluster::start(cc, ClusterSocket::Bind, summary.clone(), shutdown.clone())
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
