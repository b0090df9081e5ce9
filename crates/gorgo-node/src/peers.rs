//! What the node needs from the cluster layer, as a small trait.
//!
//! The router only needs a view of live peers (RTT, queue stats, cached prefixes) and a
//! way to open a byte stream to one of them. Keeping that behind [`PeerSource`] lets
//! the node run over the QUIC cluster in production and over an in-process mesh in
//! tests, with the same routing and forwarding code.

use std::pin::Pin;

use futures::future::BoxFuture;
use futures::Stream;
use gorgo_core::tuning::TuningMessage;
use gorgo_core::{HashChain, NodeId, QueueStats};
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::error::NodeError;

/// The sending half of a forward stream.
pub type ForwardSend = Pin<Box<dyn AsyncWrite + Send>>;
/// The receiving half of a forward stream.
pub type ForwardRecv = Pin<Box<dyn AsyncRead + Send>>;

/// A forward stream a peer opened to us: who sent it and its two halves.
pub struct IncomingForward {
    /// The peer that opened the stream (for logs and metrics).
    pub from: NodeId,
    /// Where we write the response head and bytes.
    pub send: ForwardSend,
    /// Where we read the request.
    pub recv: ForwardRecv,
}

/// The forwards peers open to a node, as [`crate::start`] takes them: any stream of
/// them, so each transport hands over its own receiver (mapped in place, not relayed
/// through a second channel): the QUIC cluster's, or an in-process mesh's channel.
pub struct IncomingForwards(Pin<Box<dyn Stream<Item = IncomingForward> + Send>>);

impl IncomingForwards {
    /// Wrap any stream of incoming forwards.
    pub fn new(stream: impl Stream<Item = IncomingForward> + Send + 'static) -> Self {
        IncomingForwards(Box::pin(stream))
    }

    /// The items of `rx`, converted by `convert` as they are taken.
    pub fn from_receiver<T: Send + 'static>(
        rx: tokio::sync::mpsc::Receiver<T>,
        convert: fn(T) -> IncomingForward,
    ) -> Self {
        IncomingForwards::new(futures::stream::unfold(rx, move |mut rx| async move {
            rx.recv().await.map(|item| (convert(item), rx))
        }))
    }
}

impl From<tokio::sync::mpsc::Receiver<IncomingForward>> for IncomingForwards {
    fn from(rx: tokio::sync::mpsc::Receiver<IncomingForward>) -> Self {
        IncomingForwards::from_receiver(rx, |f| f)
    }
}

impl Stream for IncomingForwards {
    type Item = IncomingForward;
    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<IncomingForward>> {
        self.0.as_mut().poll_next(cx)
    }
}

impl std::fmt::Debug for IncomingForwards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IncomingForwards")
    }
}

impl std::fmt::Debug for IncomingForward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IncomingForward")
            .field("from", &self.from)
            .finish()
    }
}

/// One peer as the router sees it.
#[derive(Debug, Clone, Serialize)]
pub struct PeerView {
    /// The peer's node id.
    pub id: NodeId,
    /// The peer's region, when known.
    pub region: Option<String>,
    /// Alive in the membership view.
    pub alive: bool,
    /// Smoothed RTT to the peer, ms.
    pub rtt_ms: f64,
    /// The last queue stats of the peer's first engine (replica 0), when any arrived:
    /// what a one-engine peer has, and where its model list and drain show.
    pub stats: Option<QueueStats>,
    /// The last queue stats of each of the peer's engines heard of (docs/design.md,
    /// "Replicas"), in replica order: every one a routing candidate.
    pub engines: Vec<PeerEngine>,
    /// Age of those stats, ms.
    pub stats_age_ms: Option<u64>,
    /// Version of the peer's prefix summary we hold.
    pub summary_version: u64,
    /// Fingerprints in that summary.
    pub summary_entries: u64,
    /// Age of that summary, ms.
    pub summary_age_ms: Option<u64>,
}

impl PeerView {
    /// The models the peer's engines in rotation serve, each once, from every engine's
    /// stats: `stats` are its first engine's, which may have left (replica 0 removed,
    /// its last stats saying draining), and the peer's other engines' models went
    /// unlisted with it.
    pub fn models(&self) -> std::collections::BTreeSet<&str> {
        let each: Vec<&QueueStats> = if self.engines.is_empty() {
            self.stats.iter().collect()
        } else {
            self.engines.iter().map(|e| &e.stats).collect()
        };
        each.into_iter()
            .filter(|s| !s.draining)
            .flat_map(|s| s.models.iter().map(String::as_str))
            .collect()
    }

    /// How old the peer's freshest stats are, ms: those of its first engine alone grew
    /// without end once that engine had left, on a peer whose others report.
    pub fn freshest_stats_age_ms(&self) -> Option<u64> {
        self.engines
            .iter()
            .map(|e| e.stats_age_ms)
            .min()
            .or(self.stats_age_ms)
    }
}

/// One engine of a peer as the router sees it: its last queue stats and when they
/// arrived (the forward ledger clears by arrival, `gorgo_core::candidates`).
#[derive(Debug, Clone, Serialize)]
pub struct PeerEngine {
    /// The engine's last queue stats.
    #[serde(flatten)]
    pub stats: QueueStats,
    /// How long ago they arrived, ms.
    pub stats_age_ms: u64,
}

/// Gossip traffic counters, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct GossipCounters {
    /// Bytes of gossip sent.
    pub bytes_sent: u64,
    /// Bytes of gossip received.
    pub bytes_received: u64,
    /// Claims of a peer's node id from a second address, refused.
    pub identity_conflicts: u64,
    /// Claims of this node's own id by another process, refused.
    pub own_id_claimed: u64,
    /// Connections peers closed because they hold this node's own id alive at another
    /// address: this process is refused as a second one with a live node's id.
    pub own_id_refused: u64,
    /// What the transport refused or dropped, by kind (`metrics::RefusedLabels`).
    pub refused: Refused,
    /// Bytes by traffic kind and direction (`metrics::TrafficLabels`): the totals
    /// above split, so that an operator can tell membership chatter from summaries
    /// from tuning messages (issue #20's gossip budget is the summaries').
    pub traffic: Traffic,
    /// Summary gossip messages sent, by kind (`metrics::GossipSentLabels`).
    pub messages_sent: GossipSent,
    /// "You were declared down" notices dropped because the member refuted its
    /// suspicion in time (docs/cluster.md): nonzero only while members flap.
    pub spurious_turn_undead_dropped: u64,
}

/// Cluster bytes by traffic kind, for `/metrics` (payload bytes handed to QUIC).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Traffic {
    /// SWIM membership bytes sent / received.
    pub swim: (u64, u64),
    /// Summary and stats gossip bytes sent / received.
    pub summary: (u64, u64),
    /// Application (tuning) message bytes sent / received.
    pub app: (u64, u64),
}

/// Summary gossip messages sent, by kind, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct GossipSent {
    /// Deltas (a round's summary changes, or none, with the queue stats).
    pub deltas: u64,
    /// Full snapshots (a peer joined, or asked after a gap).
    pub snapshots: u64,
    /// Snapshot requests this node sent after a version gap: a steady rise means
    /// summary gossip is being lost or reordered past the reorder buffer.
    pub snapshot_requests: u64,
}

/// What the cluster transport refused or dropped from the network, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Refused {
    /// Messages that did not decode or were over their cap.
    pub malformed: u64,
    /// SWIM packets whose claimed sender did not match the TLS peer.
    pub spoofed: u64,
    /// Inbound connections refused at the handshake.
    pub handshake: u64,
    /// Handshakes (either way) failed for another cluster protocol version.
    pub other_protocol: u64,
    /// Handshakes (either way) failed for a certificate from another CA.
    pub foreign_certificate: u64,
    /// Handshakes (either way) failed for an expired certificate.
    pub expired_certificate: u64,
    /// Streams on a connection no accepted claim vouches for.
    pub unbound_stream: u64,
    /// Inbound connections closed over the per-certificate cap.
    pub excess_connection: u64,
    /// Announces (joins) addressed to another address than this node advertises,
    /// which SWIM ignores: a peer seeding this node at an address it does not
    /// advertise (docs/cluster.md).
    pub misaddressed_announce: u64,
}

/// The cluster as the router needs it.
pub trait PeerSource: Send + Sync + 'static {
    /// Every known peer (not this node), alive or not.
    fn peers(&self) -> Vec<PeerView>;
    /// Tokens of `chain`'s prefix the last summary of the peer's engine `replica`
    /// says it caches.
    fn matched_tokens(&self, peer: &NodeId, replica: u16, chain: &HashChain) -> u64;
    /// Open a forward stream to `peer`.
    fn open_forward(
        &self,
        peer: &NodeId,
    ) -> BoxFuture<'static, Result<(ForwardSend, ForwardRecv), NodeError>>;
    /// Resolves once `peer` is not alive (at once when it is not alive now), or is
    /// back as a new run of its process: what was in flight to it will never be
    /// answered. A forward races its response against it ([`crate::forward::forward`]):
    /// a stream to a killed node would otherwise hang until a timeout although
    /// membership declared the node dead.
    fn peer_gone(&self, peer: &NodeId) -> BoxFuture<'static, ()>;
    /// Start draining (the node binary's SIGTERM): tell peers to stop sending this
    /// node new forwards at once, while it stays a member so that what is in flight
    /// finishes. Then wait for the work in flight and [`leave`](Self::leave).
    fn drain(&self) {}
    /// Leave the cluster (after [`drain`](Self::drain)): peers see this node go at
    /// once rather than after failure detection. Resolves when the leave is sent and
    /// the cluster's endpoint closed; forwards still in flight end with it. The QUIC
    /// cluster then cancels the shutdown token it was started with, which
    /// [`crate::cluster::start_with_cluster`] shares with the node: the node stops too.
    fn leave(&self) -> BoxFuture<'static, ()> {
        Box::pin(std::future::ready(()))
    }
    /// Announce this node's queue stats to peers.
    fn publish_stats(&self, stats: QueueStats);
    /// Hand changes of the prefix summary of this node's engine `replica` to gossip.
    fn publish_summary(&self, _replica: u16, _delta: &gorgo_core::summary::SummaryDelta) {}
    /// This node fronts a new engine `replica` (added at run time): gossip its
    /// summary and stats as their own stream from now on.
    fn add_engine(&self, _replica: u16) {}
    /// This node fronts engine `replica` no more (removed, its requests done): end
    /// its stream, so that peers drop it (without, they listed it for the rest of the
    /// run). A peer source that reads this node's engines directly has nothing to do.
    fn remove_engine(&self, _replica: u16) {}
    /// Gossip traffic so far.
    fn gossip_counters(&self) -> GossipCounters {
        GossipCounters::default()
    }
    /// The peers refusing this node's claim to its own id now, each with where it
    /// holds the id alive: another process runs with this node's id
    /// (docs/cluster.md, "Identity"). `/admin/state` shows them, and `/readyz` fails
    /// while they leave the node with no live peer ([`refused_island`]).
    fn identity_refusals(&self) -> Vec<gorgo_cluster::IdentityRefusal> {
        Vec::new()
    }
    /// Send a tuning message to one peer, best effort (the protocol repeats itself
    /// every tick, so a lost message costs one round).
    fn send_tuning(&self, _to: &NodeId, _msg: &TuningMessage) {}
    /// Send a tuning message to every live peer, best effort.
    fn broadcast_tuning(&self, _msg: &TuningMessage) {}
}

/// The refusals of this node's id when they leave it alone: some peer refuses it
/// ([`PeerSource::identity_refusals`]) and none is alive. Empty otherwise.
///
/// Why: such a node is a second process with a live node's id (a copied config or
/// certificate), cut off from the cluster while the genuine one lives; it would serve
/// its clients from its own engine as a one-node island, so `/readyz` fails and a
/// load balancer sends them to a node in the cluster. A node some peer takes is in
/// the cluster, refusals or not (two peers that met two processes with one id in a
/// different order each take one), and stays ready.
pub fn refused_island(peers: &dyn PeerSource) -> Vec<gorgo_cluster::IdentityRefusal> {
    let refusals = peers.identity_refusals();
    if refusals.is_empty() || peers.peers().iter().any(|p| p.alive) {
        return Vec::new();
    }
    refusals
}

/// A cluster of one: no peers. Used when a node runs alone.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoPeers;

impl PeerSource for NoPeers {
    fn peers(&self) -> Vec<PeerView> {
        Vec::new()
    }
    fn matched_tokens(&self, _peer: &NodeId, _replica: u16, _chain: &HashChain) -> u64 {
        0
    }
    fn open_forward(
        &self,
        peer: &NodeId,
    ) -> BoxFuture<'static, Result<(ForwardSend, ForwardRecv), NodeError>> {
        let peer = peer.clone();
        Box::pin(async move { Err(NodeError::Cluster(format!("no peer {peer}"))) })
    }
    fn peer_gone(&self, _peer: &NodeId) -> BoxFuture<'static, ()> {
        // No peer is ever alive here.
        Box::pin(std::future::ready(()))
    }
    fn publish_stats(&self, _stats: QueueStats) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(models: &[&str], draining: bool, age_ms: u64) -> PeerEngine {
        PeerEngine {
            stats: QueueStats {
                models: models.iter().map(|m| (*m).to_owned()).collect(),
                draining,
                ..QueueStats::default()
            },
            stats_age_ms: age_ms,
        }
    }

    /// A peer whose first engine has left (its last stats say draining, and age): its
    /// other engines' models are listed and its stats are as fresh as theirs. Before,
    /// both came from the first engine alone: no model listed, an age that only grew.
    #[test]
    fn a_peer_whose_first_engine_left_is_read_from_its_others() {
        let gone = engine(&["m"], true, 600_000);
        let peer = PeerView {
            id: NodeId::from("b"),
            region: None,
            alive: true,
            rtt_ms: 1.0,
            stats: Some(gone.stats.clone()),
            engines: vec![
                gone,
                engine(&["m", "n"], false, 80),
                engine(&["n"], false, 40),
            ],
            stats_age_ms: Some(600_000),
            summary_version: 0,
            summary_entries: 0,
            summary_age_ms: None,
        };
        assert_eq!(peer.models().into_iter().collect::<Vec<_>>(), ["m", "n"]);
        assert_eq!(peer.freshest_stats_age_ms(), Some(40));
        // A peer known only by its stats (no engine list): those.
        let plain = PeerView {
            engines: Vec::new(),
            stats: Some(engine(&["p"], false, 0).stats),
            ..peer
        };
        assert_eq!(plain.models().into_iter().collect::<Vec<_>>(), ["p"]);
        assert_eq!(plain.freshest_stats_age_ms(), Some(600_000));
    }
}
