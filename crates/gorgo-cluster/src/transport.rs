//! The QUIC side: one endpoint per node, one connection per peer (single in-flight
//! dial), and the demultiplexing of what arrives on a connection:
//! datagrams are SWIM, uni-streams are summaries and app messages, bi-streams are
//! forwarded requests handed to the node.
//!
//! This is the bottom layer of the crate: it knows the peer table and the metrics
//! (`state`), and hands what arrives to an [`Inbound`] the cluster implements, so it
//! imports nothing from the modules above it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use dashmap::DashMap;
use gorgo_core::NodeId;
use parking_lot::Mutex;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::{ClusterError, Result};
use crate::identity::{MemberId, MAX_SWIM_PACKET};
use crate::state::{ClusterMetrics, PeerTable, TrafficKind};
use crate::tls::{peer_node_id, CLUSTER_SERVER_NAME};

/// A bi-stream a peer opened to forward a request to this node.
#[derive(Debug)]
pub struct IncomingForward {
    /// The peer (from its certificate).
    pub from: NodeId,
    /// Where the response goes.
    pub send: quinn::SendStream,
    /// Where the request comes from.
    pub recv: quinn::RecvStream,
}

/// An application message (e.g. the tuning protocol) from a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppMessage {
    /// The peer (from its certificate).
    pub from: NodeId,
    /// Application-defined kind byte.
    pub kind: u8,
    /// Payload, at most [`MAX_APP_MESSAGE`] bytes.
    pub payload: Bytes,
}

/// Where the transport hands what arrives (implemented by the cluster driver): the
/// transport stays below the SWIM, gossip and node layers instead of reaching into
/// them.
pub(crate) trait Inbound: Send + Sync + 'static {
    /// A SWIM packet (kind byte stripped) from `from`.
    fn swim(&self, from: NodeId, data: Bytes);
    /// A summary gossip frame (kind byte stripped) from `from`.
    fn gossip(&self, from: &NodeId, frame: &[u8]);
    /// An application message.
    fn app(&self, msg: AppMessage);
    /// A forwarding bi-stream.
    fn forward(&self, fwd: IncomingForward);
}

/// The node's QUIC endpoint, its connections, and the byte counting of what crosses
/// them.
pub(crate) struct Transport {
    node_id: NodeId,
    /// Taken (closed and dropped) on shutdown, so that handle clones the node still
    /// holds do not keep the UDP socket bound.
    endpoint: Mutex<Option<quinn::Endpoint>>,
    pub(crate) conns: Connections,
    dial_overrides: HashMap<SocketAddr, SocketAddr>,
    pub(crate) peers: Arc<PeerTable>,
    pub(crate) metrics: Arc<ClusterMetrics>,
    shutdown: CancellationToken,
    inbound: Weak<dyn Inbound>,
}

/// First byte of a uni-stream carrying summary gossip.
pub(crate) const STREAM_GOSSIP: u8 = 1;
/// First byte of a uni-stream carrying an application message.
pub(crate) const STREAM_APP: u8 = 2;
/// First byte of a SWIM datagram (room for other datagram kinds later).
pub(crate) const DATAGRAM_SWIM: u8 = 1;

/// Cap on one summary gossip stream: the largest gossip message plus its stamp.
pub const MAX_GOSSIP_FRAME: usize = gorgo_core::wire::MAX_GOSSIP_MESSAGE + 9;
/// Cap on one application message payload.
pub const MAX_APP_MESSAGE: usize = 64 * 1024;
/// After a failed dial, datagrams to that address are dropped for this long instead of
/// queueing more dials behind a dead peer.
const DIAL_BACKOFF: Duration = Duration::from_millis(500);

/// The single in-flight dial to one address.
#[derive(Debug, Default)]
pub(crate) struct DialSlot {
    lock: tokio::sync::Mutex<()>,
    failed_at: Mutex<Option<Instant>>,
}

/// Connections by peer id (from its certificate) and, for dials, by address.
#[derive(Debug, Default)]
pub(crate) struct Connections {
    by_node: DashMap<NodeId, quinn::Connection>,
    by_addr: DashMap<SocketAddr, (NodeId, quinn::Connection)>,
    dials: DashMap<SocketAddr, Arc<DialSlot>>,
}

fn usable(c: &quinn::Connection) -> bool {
    c.close_reason().is_none()
}

impl Connections {
    fn lookup(&self, node: Option<&NodeId>, addr: SocketAddr) -> Option<quinn::Connection> {
        if let Some(n) = node {
            if let Some(c) = self.by_node.get(n).filter(|c| usable(c)) {
                return Some(c.clone());
            }
        }
        self.by_addr
            .get(&addr)
            .filter(|e| usable(&e.1) && node.is_none_or(|n| *n == e.0))
            .map(|e| e.1.clone())
    }

    pub(crate) fn get(&self, node: &NodeId) -> Option<quinn::Connection> {
        self.by_node
            .get(node)
            .filter(|c| usable(c))
            .map(|c| c.clone())
    }

    /// UDP bytes (QUIC overhead included) sent on every open connection so far.
    pub(crate) fn udp_bytes_sent(&self) -> u64 {
        let mut seen = std::collections::HashSet::new();
        let mut total = 0;
        let conns = self
            .by_node
            .iter()
            .map(|e| e.value().clone())
            .chain(self.by_addr.iter().map(|e| e.value().1.clone()));
        for c in conns {
            if seen.insert(c.stable_id()) {
                total += c.stats().udp_tx.bytes;
            }
        }
        total
    }

    /// Forget every connection (shutdown).
    pub(crate) fn clear(&self) {
        self.by_node.clear();
        self.by_addr.clear();
        self.dials.clear();
    }

    pub(crate) fn all(&self) -> Vec<(NodeId, quinn::Connection)> {
        self.by_node
            .iter()
            .map(|e| (e.key().clone(), e.value().clone()))
            .collect()
    }
}

/// The quinn transport config shared by both directions.
pub(crate) fn transport_config(idle: Duration, keep_alive: Duration) -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    if let Ok(idle) = quinn::IdleTimeout::try_from(idle) {
        t.max_idle_timeout(Some(idle));
    }
    t.keep_alive_interval(Some(keep_alive));
    t.max_concurrent_uni_streams(64u32.into());
    t.max_concurrent_bidi_streams(1024u32.into());
    t.datagram_receive_buffer_size(Some(256 * 1024));
    t.datagram_send_buffer_size(256 * 1024);
    t
}

impl Transport {
    /// A transport on `endpoint` that hands what arrives to `inbound`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        node_id: NodeId,
        endpoint: quinn::Endpoint,
        dial_overrides: HashMap<SocketAddr, SocketAddr>,
        peers: Arc<PeerTable>,
        metrics: Arc<ClusterMetrics>,
        shutdown: CancellationToken,
        inbound: Weak<dyn Inbound>,
    ) -> Self {
        Transport {
            node_id,
            endpoint: Mutex::new(Some(endpoint)),
            conns: Connections::default(),
            dial_overrides,
            peers,
            metrics,
            shutdown,
            inbound,
        }
    }

    /// The endpoint, until shutdown closes it.
    pub(crate) fn endpoint(&self) -> Result<quinn::Endpoint> {
        self.endpoint.lock().clone().ok_or(ClusterError::Shutdown)
    }

    /// Take the endpoint for closing (shutdown).
    pub(crate) fn take_endpoint(&self) -> Option<quinn::Endpoint> {
        self.endpoint.lock().take()
    }
}

/// Get a connection to `addr` (the node there being `node` when known), dialing if
/// needed. Concurrent callers for one address share a single dial.
pub(crate) async fn connect(
    inner: &Arc<Transport>,
    node: Option<&NodeId>,
    addr: SocketAddr,
) -> Result<quinn::Connection> {
    let addr = dial_addr(inner, addr);
    if let Some(c) = inner.conns.lookup(node, addr) {
        return Ok(c);
    }
    let slot = inner.conns.dials.entry(addr).or_default().clone();
    let _guard = slot.lock.lock().await;
    if let Some(c) = inner.conns.lookup(node, addr) {
        return Ok(c);
    }
    if slot
        .failed_at
        .lock()
        .is_some_and(|t| t.elapsed() < DIAL_BACKOFF)
    {
        return Err(ClusterError::Connection(quinn::ConnectionError::TimedOut));
    }
    let server_name = node.map_or(CLUSTER_SERVER_NAME, |n| n.0.as_str());
    let result = async {
        let conn = inner.endpoint()?.connect(addr, server_name)?.await?;
        let Some(peer) = peer_node_id(&conn) else {
            conn.close(1u32.into(), b"no node id");
            return Err(ClusterError::Tls(
                "peer certificate names no node id".into(),
            ));
        };
        if let Some(n) = node {
            if *n != peer {
                conn.close(1u32.into(), b"identity mismatch");
                return Err(ClusterError::PeerMismatch {
                    expected: n.clone(),
                    got: peer.0,
                });
            }
        }
        if peer == inner.node_id {
            conn.close(1u32.into(), b"self");
            return Err(ClusterError::PeerMismatch {
                expected: NodeId("<peer>".into()),
                got: peer.0,
            });
        }
        inner
            .conns
            .by_addr
            .insert(addr, (peer.clone(), conn.clone()));
        register(inner, peer, conn.clone());
        Ok(conn)
    }
    .await;
    *slot.failed_at.lock() = if result.is_err() {
        Some(Instant::now())
    } else {
        None
    };
    result
}

/// Where to dial a peer that advertises `advertised`: its configured override, else
/// that address.
fn dial_addr(inner: &Transport, advertised: SocketAddr) -> SocketAddr {
    inner
        .dial_overrides
        .get(&advertised)
        .copied()
        .unwrap_or(advertised)
}

/// Send one SWIM packet to `dst`, dialing in the background if there is no connection.
pub(crate) fn send_swim(inner: &Arc<Transport>, dst: MemberId, packet: Bytes) {
    let mut datagram = Vec::with_capacity(packet.len() + 1);
    datagram.push(DATAGRAM_SWIM);
    datagram.extend_from_slice(&packet);
    let datagram = Bytes::from(datagram);
    let node = (!dst.node.0.is_empty()).then_some(&dst.node);
    if let Some(c) = inner.conns.lookup(node, dial_addr(inner, dst.addr)) {
        send_datagram(inner, &c, node, datagram);
        return;
    }
    let inner = inner.clone();
    tokio::spawn(async move {
        let node = (!dst.node.0.is_empty()).then_some(&dst.node);
        match connect(&inner, node, dst.addr).await {
            Ok(c) => send_datagram(&inner, &c, node, datagram),
            Err(e) => tracing::debug!(peer = %dst.node, addr = %dst.addr, "swim send dropped: {e}"),
        }
    });
}

fn send_datagram(inner: &Transport, c: &quinn::Connection, node: Option<&NodeId>, datagram: Bytes) {
    let len = datagram.len();
    match c.send_datagram(datagram) {
        Ok(()) => {
            inner.metrics.sent(TrafficKind::Swim, len);
            if let Some(n) = node {
                inner.peers.add_bytes(n, len as u64, 0);
            }
        }
        Err(e) => tracing::debug!("swim datagram dropped: {e}"),
    }
}

/// Open a uni-stream to `node`, write `frame`, finish it.
pub(crate) async fn send_uni(
    inner: &Arc<Transport>,
    node: &NodeId,
    kind: TrafficKind,
    frame: &[u8],
) -> Result<()> {
    let conn = match inner.conns.get(node) {
        Some(c) => c,
        None => {
            let addr = inner
                .peers
                .peers
                .get(node)
                .map(|e| e.member.addr)
                .ok_or_else(|| ClusterError::UnknownPeer(node.clone()))?;
            connect(inner, Some(node), addr).await?
        }
    };
    let mut send = conn.open_uni().await?;
    send.write_all(frame).await?;
    // A stream finished after the connection closed reports the close; the data
    // either got there or the receiver will resync with a snapshot.
    let _ = send.finish();
    inner.metrics.sent(kind, frame.len());
    inner.peers.add_bytes(node, frame.len() as u64, 0);
    Ok(())
}

/// Accept inbound connections until shutdown.
pub(crate) async fn accept_loop(inner: Arc<Transport>) {
    let Ok(endpoint) = inner.endpoint() else {
        return;
    };
    loop {
        let incoming = tokio::select! {
            biased;
            _ = inner.shutdown.cancelled() => return,
            i = endpoint.accept() => match i { Some(i) => i, None => return },
        };
        let inner = inner.clone();
        tokio::spawn(async move {
            let conn = match incoming.await {
                Ok(c) => c,
                Err(e) => {
                    ClusterMetrics::bump(&inner.metrics.handshakes_failed);
                    tracing::debug!("inbound handshake failed: {e}");
                    return;
                }
            };
            match peer_node_id(&conn) {
                Some(peer) if peer != inner.node_id => register(&inner, peer, conn),
                _ => {
                    ClusterMetrics::bump(&inner.metrics.handshakes_failed);
                    conn.close(1u32.into(), b"no node id");
                }
            }
        });
    }
}

/// Make `conn` the connection to `peer` and serve what arrives on it.
fn register(inner: &Arc<Transport>, peer: NodeId, conn: quinn::Connection) {
    // quinn has an RTT estimate from the handshake already: a known peer gets it now
    // rather than at the next gossip round.
    inner
        .peers
        .seed_rtt(&peer, conn.rtt().as_secs_f64() * 1000.0);
    inner.conns.by_node.insert(peer.clone(), conn.clone());
    tokio::spawn(read_datagrams(inner.clone(), peer.clone(), conn.clone()));
    tokio::spawn(accept_unis(inner.clone(), peer.clone(), conn.clone()));
    tokio::spawn(accept_bis(inner.clone(), peer, conn));
}

async fn read_datagrams(inner: Arc<Transport>, peer: NodeId, conn: quinn::Connection) {
    loop {
        let d = tokio::select! {
            biased;
            _ = inner.shutdown.cancelled() => return,
            d = conn.read_datagram() => match d { Ok(d) => d, Err(_) => break },
        };
        inner.metrics.received(TrafficKind::Swim, d.len());
        inner.peers.add_bytes(&peer, 0, d.len() as u64);
        if d.len() < 2 || d.len() > MAX_SWIM_PACKET + 1 || d[0] != DATAGRAM_SWIM {
            ClusterMetrics::bump(&inner.metrics.malformed_received);
            continue;
        }
        match inner.inbound.upgrade() {
            Some(inbound) => inbound.swim(peer.clone(), d.slice(1..)),
            None => return,
        }
    }
    // Forget the connection if it is still the registered one.
    inner
        .conns
        .by_node
        .remove_if(&peer, |_, c| c.stable_id() == conn.stable_id());
}

async fn accept_unis(inner: Arc<Transport>, peer: NodeId, conn: quinn::Connection) {
    loop {
        let mut recv = tokio::select! {
            biased;
            _ = inner.shutdown.cancelled() => return,
            r = conn.accept_uni() => match r { Ok(r) => r, Err(_) => return },
        };
        let inner = inner.clone();
        let peer = peer.clone();
        tokio::spawn(async move {
            // Read the kind first so each kind gets its own cap: an app message
            // stream may not buffer a gossip-sized payload.
            let mut kind = [0u8; 1];
            if recv.read_exact(&mut kind).await.is_err() {
                ClusterMetrics::bump(&inner.metrics.malformed_received);
                return;
            }
            let cap = match kind[0] {
                STREAM_GOSSIP => MAX_GOSSIP_FRAME,
                STREAM_APP => MAX_APP_MESSAGE + 2,
                _ => {
                    ClusterMetrics::bump(&inner.metrics.malformed_received);
                    let _ = recv.stop(1u32.into());
                    return;
                }
            };
            let rest = match recv.read_to_end(cap - 1).await {
                Ok(b) => b,
                Err(e) => {
                    tracing::debug!(%peer, "uni-stream dropped: {e}");
                    ClusterMetrics::bump(&inner.metrics.malformed_received);
                    return;
                }
            };
            let mut bytes = Vec::with_capacity(rest.len() + 1);
            bytes.push(kind[0]);
            bytes.extend_from_slice(&rest);
            inner.peers.add_bytes(&peer, 0, bytes.len() as u64);
            match bytes.first() {
                Some(&STREAM_GOSSIP) => {
                    inner.metrics.received(TrafficKind::Summary, bytes.len());
                    if let Some(inbound) = inner.inbound.upgrade() {
                        inbound.gossip(&peer, &bytes[1..]);
                    }
                }
                Some(&STREAM_APP) if bytes.len() >= 2 && bytes.len() - 2 <= MAX_APP_MESSAGE => {
                    inner.metrics.received(TrafficKind::App, bytes.len());
                    let msg = AppMessage {
                        from: peer,
                        kind: bytes[1],
                        payload: Bytes::copy_from_slice(&bytes[2..]),
                    };
                    if let Some(inbound) = inner.inbound.upgrade() {
                        inbound.app(msg);
                    }
                }
                _ => ClusterMetrics::bump(&inner.metrics.malformed_received),
            }
        });
    }
}

async fn accept_bis(inner: Arc<Transport>, peer: NodeId, conn: quinn::Connection) {
    loop {
        let (send, recv) = tokio::select! {
            biased;
            _ = inner.shutdown.cancelled() => return,
            r = conn.accept_bi() => match r { Ok(r) => r, Err(_) => return },
        };
        let fwd = IncomingForward {
            from: peer.clone(),
            send,
            recv,
        };
        match inner.inbound.upgrade() {
            Some(inbound) => inbound.forward(fwd),
            None => return,
        }
    }
}
