//! An in-process cluster: nodes in one process see each other directly, with fresh
//! stats and exact prefix matches, and forward over in-memory pipes.
//!
//! Why: it runs the node's real routing, forwarding and fallback code without QUIC,
//! certificates or gossip timing, which makes multi-node tests deterministic and fast.
//! Production uses the QUIC cluster through the same [`PeerSource`] trait.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};

use futures::future::BoxFuture;
use gorgo_core::tuning::TuningMessage;
use gorgo_core::{HashChain, NodeId, QueueStats};
use parking_lot::RwLock;
use tokio::sync::mpsc;

use crate::error::NodeError;
use crate::peers::{ForwardRecv, ForwardSend, IncomingForward, PeerEngine, PeerSource, PeerView};
use crate::NodeState;

/// Buffer of each in-memory forward pipe, bytes.
const PIPE_BYTES: usize = 256 * 1024;

struct Member {
    state: Weak<NodeState>,
    incoming: mpsc::Sender<IncomingForward>,
    alive: bool,
    /// It called [`PeerSource::drain`]: peers see its stats say so.
    draining: bool,
}

/// The registry of in-process nodes.
#[derive(Default)]
pub struct Mesh {
    members: RwLock<BTreeMap<NodeId, Member>>,
    rtt_ms: RwLock<BTreeMap<(NodeId, NodeId), f64>>,
    /// Counts membership changes (kills), for [`PeerSource::peer_gone`] to wait on.
    changes: tokio::sync::watch::Sender<u64>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh")
            .field("members", &self.members.read().len())
            .finish()
    }
}

impl Mesh {
    /// An empty mesh.
    pub fn new() -> Arc<Self> {
        Arc::new(Mesh::default())
    }

    /// The peer source node `me` should be built with.
    pub fn peer_source(self: &Arc<Self>, me: &str) -> Arc<MeshPeers> {
        Arc::new(MeshPeers {
            mesh: self.clone(),
            me: NodeId::from(me),
        })
    }

    /// Set the RTT both ways between two nodes (default 0).
    pub fn set_rtt(&self, a: &str, b: &str, rtt_ms: f64) {
        let mut m = self.rtt_ms.write();
        m.insert((NodeId::from(a), NodeId::from(b)), rtt_ms);
        m.insert((NodeId::from(b), NodeId::from(a)), rtt_ms);
    }

    /// Register a node; the receiver carries the forwards peers open to it.
    pub fn join(&self, state: &Arc<NodeState>) -> mpsc::Receiver<IncomingForward> {
        let (tx, rx) = mpsc::channel(1024);
        self.members.write().insert(
            state.id.clone(),
            Member {
                state: Arc::downgrade(state),
                incoming: tx,
                alive: true,
                draining: false,
            },
        );
        rx
    }

    /// Mark a node dead, as a failure detector would: peers stop choosing it, new
    /// forwards to it fail, and forwards in flight to it end
    /// ([`PeerSource::peer_gone`]), whatever the node itself still does.
    pub fn kill(&self, id: &str) {
        if let Some(m) = self.members.write().get_mut(&NodeId::from(id)) {
            m.alive = false;
        }
        self.changes.send_modify(|n| *n += 1);
    }

    fn is_alive(&self, id: &NodeId) -> bool {
        self.members.read().get(id).is_some_and(|m| m.alive)
    }
}

/// One node's view of the mesh.
#[derive(Debug)]
pub struct MeshPeers {
    mesh: Arc<Mesh>,
    me: NodeId,
}

impl MeshPeers {
    /// `peer`'s state when both it and this node are alive (locks released).
    fn live_state(&self, peer: &NodeId) -> Option<Arc<NodeState>> {
        let members = self.mesh.members.read();
        if !members.get(&self.me).is_some_and(|m| m.alive) {
            return None;
        }
        members
            .get(peer)
            .filter(|m| m.alive)
            .and_then(|m| m.state.upgrade())
    }
}

impl PeerSource for MeshPeers {
    fn peers(&self) -> Vec<PeerView> {
        let rtts = self.mesh.rtt_ms.read();
        self.mesh
            .members
            .read()
            .iter()
            .filter(|(id, _)| **id != self.me)
            .map(|(id, m)| {
                let state = m.state.upgrade();
                // The peer's engines as its own stats say, read directly (so they
                // are always fresh: age 0).
                let engines: Vec<PeerEngine> = state
                    .as_ref()
                    .map(|s| {
                        s.local_stats()
                            .into_iter()
                            .map(|st| PeerEngine {
                                stats: QueueStats {
                                    draining: st.draining || m.draining,
                                    ..st
                                },
                                stats_age_ms: 0,
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                PeerView {
                    id: id.clone(),
                    region: state.as_ref().map(|s| s.config.node.region.clone()),
                    alive: m.alive && state.is_some(),
                    rtt_ms: rtts
                        .get(&(self.me.clone(), id.clone()))
                        .copied()
                        .unwrap_or(0.0),
                    stats_age_ms: state.as_ref().map(|_| 0),
                    summary_version: 0,
                    summary_entries: state
                        .as_ref()
                        .and_then(|s| s.engines().first().map(|e| e.shadow.lock().len() as u64))
                        .unwrap_or(0),
                    summary_age_ms: state.as_ref().map(|_| 0),
                    stats: engines.first().map(|e| e.stats.clone()),
                    engines,
                }
            })
            .collect()
    }

    fn matched_tokens(&self, peer: &NodeId, replica: u16, chain: &HashChain) -> u64 {
        let members = self.mesh.members.read();
        members
            .get(peer)
            .and_then(|m| m.state.upgrade())
            .and_then(|s| s.engine(replica))
            .map(|e| e.shadow.lock().longest_match(chain))
            .unwrap_or(0)
    }

    fn open_forward(
        &self,
        peer: &NodeId,
    ) -> BoxFuture<'static, Result<(ForwardSend, ForwardRecv), NodeError>> {
        let target = {
            let members = self.mesh.members.read();
            members
                .get(peer)
                .filter(|m| m.alive)
                .map(|m| m.incoming.clone())
        };
        let from = self.me.clone();
        let peer = peer.clone();
        Box::pin(async move {
            let Some(tx) = target else {
                return Err(NodeError::Cluster(format!("peer {peer} is not alive")));
            };
            let (ours, theirs) = tokio::io::duplex(PIPE_BYTES);
            let (our_recv, our_send) = tokio::io::split(ours);
            let (their_recv, their_send) = tokio::io::split(theirs);
            let incoming = IncomingForward {
                from,
                send: Box::pin(their_send),
                recv: Box::pin(their_recv),
            };
            tx.send(incoming).await.map_err(|_| {
                NodeError::Cluster(format!("peer {peer} stopped accepting forwards"))
            })?;
            Ok((
                Box::pin(our_send) as ForwardSend,
                Box::pin(our_recv) as ForwardRecv,
            ))
        })
    }

    fn peer_gone(&self, peer: &NodeId) -> BoxFuture<'static, ()> {
        // Subscribed before looking, so that a kill in between is not missed.
        let mut changes = self.mesh.changes.subscribe();
        let mesh = self.mesh.clone();
        let peer = peer.clone();
        Box::pin(async move {
            while mesh.is_alive(&peer) {
                if changes.changed().await.is_err() {
                    return;
                }
            }
        })
    }

    fn drain(&self) {
        if let Some(m) = self.mesh.members.write().get_mut(&self.me) {
            m.draining = true;
        }
    }

    fn publish_stats(&self, _stats: QueueStats) {
        // Peers read our live stats directly.
    }

    fn send_tuning(&self, to: &NodeId, msg: &TuningMessage) {
        // Delivered at once, on the caller's task: a deterministic bus. Nothing is
        // delivered from or to a killed node.
        if let Some(peer) = self.live_state(to) {
            peer.on_tuning_message(&self.me, msg.clone());
        }
    }

    fn broadcast_tuning(&self, msg: &TuningMessage) {
        let ids: Vec<NodeId> = self
            .mesh
            .members
            .read()
            .keys()
            .filter(|id| **id != self.me)
            .cloned()
            .collect();
        for id in ids {
            self.send_tuning(&id, msg);
        }
    }
}
