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
use tokio::sync::watch;
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
    /// A SWIM packet (kind byte stripped) from `from`, on `conn`: the claim it makes
    /// (its sender's address) decides whether the connection may speak for `from`
    /// ([`Transport::bind_inbound`]).
    fn swim(&self, from: NodeId, conn: quinn::Connection, data: Bytes);
    /// A summary gossip frame (kind byte stripped) from `from`.
    fn gossip(&self, from: &NodeId, frame: &[u8]);
    /// An application message.
    fn app(&self, msg: AppMessage);
    /// A forwarding bi-stream.
    fn forward(&self, fwd: IncomingForward);
    /// This node dialed `peer` to send it streams (gossip, an app message, a
    /// forward): send it a SWIM packet on the new connection at once, so that the
    /// peer vouches the connection ([`Transport::bind_inbound`] on its side) before
    /// the streams on it wait out [`Transport::vouch_wait`] there.
    fn dialed(&self, peer: &NodeId, conn: &quinn::Connection);
    /// `by` closed a connection with [`CLOSE_ID_HELD_ELSEWHERE`]: it holds this node's
    /// id alive at `held_at` and refused this process's claim to it.
    fn own_id_refused(&self, by: &NodeId, held_at: SocketAddr);
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
    /// How long a stream on an inbound connection that has made no SWIM claim yet
    /// waits for one ([`VOUCH_WAIT_PROBE_PERIODS`] SWIM probe periods).
    vouch_wait: Duration,
    /// The addresses already warned about, with why: a warning per address and cause,
    /// not per dial ([`REFUSAL_WARNINGS`]).
    warned: Mutex<crate::state::LogOnce<(SocketAddr, HandshakeRefusal)>>,
}

/// Warnings of refused claims and handshakes: at most 256 keys every 10 minutes, then
/// only the counters and debug logs say, until the window ends. (Before, 256 foreign
/// handshakes from made-up addresses silenced these warnings for the rest of the run,
/// and refused claims from a new address each packet logged one a packet.)
pub(crate) const REFUSAL_WARNINGS: (usize, Duration) = (256, Duration::from_secs(600));

/// A handshake refused for a cause the TLS alert names and an operator must act on:
/// without it, a node of another release, or one issued under another cluster's CA,
/// looks like an unreachable peer (it never joins, and nothing above debug level says
/// why).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum HandshakeRefusal {
    /// No ALPN in common: the peer speaks another cluster protocol version.
    OtherProtocol,
    /// The peer's certificate, or ours at the peer, is not signed by the CA the other
    /// side trusts.
    ForeignCertificate,
    /// The peer's certificate, or ours at the peer, has expired (`gorgo certs --days`).
    ExpiredCertificate,
}

impl HandshakeRefusal {
    /// The cause of a failed handshake, where its TLS alert says (a CRYPTO_ERROR
    /// carries the alert, RFC 9001 section 4.8), whichever side raised it.
    pub(crate) fn of(e: &quinn::ConnectionError) -> Option<Self> {
        // TLS alerts: unknown_ca (48); decrypt_error (51), which is what a certificate
        // signed by another CA of the same name gets (every `gorgo certs` CA is "gorgo
        // cluster CA": the issuer is found by name, its signature does not verify);
        // certificate_expired (45); no_application_protocol (120).
        const CERTIFICATE_EXPIRED: u8 = 45;
        const UNKNOWN_CA: u8 = 48;
        const DECRYPT_ERROR: u8 = 51;
        const NO_APPLICATION_PROTOCOL: u8 = 120;
        let code = match e {
            quinn::ConnectionError::TransportError(t) => t.code,
            quinn::ConnectionError::ConnectionClosed(c) => c.error_code,
            _ => return None,
        };
        if code == quinn::TransportErrorCode::crypto(NO_APPLICATION_PROTOCOL) {
            Some(HandshakeRefusal::OtherProtocol)
        } else if code == quinn::TransportErrorCode::crypto(UNKNOWN_CA)
            || code == quinn::TransportErrorCode::crypto(DECRYPT_ERROR)
        {
            Some(HandshakeRefusal::ForeignCertificate)
        } else if code == quinn::TransportErrorCode::crypto(CERTIFICATE_EXPIRED) {
            Some(HandshakeRefusal::ExpiredCertificate)
        } else {
            None
        }
    }

    fn describe(self) -> String {
        match self {
            HandshakeRefusal::OtherProtocol => format!(
                "it speaks another cluster protocol version (this node speaks {})",
                String::from_utf8_lossy(crate::tls::ALPN)
            ),
            HandshakeRefusal::ForeignCertificate => {
                "its certificate and this node's are not from the same cluster CA".to_owned()
            }
            HandshakeRefusal::ExpiredCertificate => "its certificate or this node's has \
                expired; re-issue it under the cluster CA (`gorgo certs --out <dir> --nodes \
                <id>`) and restart that node"
                .to_owned(),
        }
    }
}

/// Application error code of a connection closed because its SWIM packets claim the
/// peer's node id from an address other than the one a live member holds it at; the
/// close's reason is that address (`SocketAddr`'s text, at most
/// [`MAX_HELD_ELSEWHERE_REASON`] bytes).
///
/// Why: the refused process is otherwise never told. Its peers refuse each of its
/// packets and answer none, so a second process started with a live node's config and
/// certificate logged "ready", answered `/readyz` and served its clients as a one-node
/// island, while only the peers logged the conflict. A close is the one reply that
/// needs no claim accepted, and it is one per connection: the process must dial anew
/// (a handshake of its own) to be told again, so the telling never outgrows what the
/// refused process sends.
pub(crate) const CLOSE_ID_HELD_ELSEWHERE: u32 = 2;
/// Longest reason taken with [`CLOSE_ID_HELD_ELSEWHERE`]: the text of any socket
/// address fits (an IPv6 address with a scope id and a port is at most 58 bytes); a
/// longer one is not an address, and is dropped as malformed.
pub(crate) const MAX_HELD_ELSEWHERE_REASON: usize = 64;

/// The live holder's address a peer named in closing a connection with
/// [`CLOSE_ID_HELD_ELSEWHERE`]: `Some(Ok(addr))` when it did, `Some(Err(()))` for that
/// code with a reason that is no address (or over [`MAX_HELD_ELSEWHERE_REASON`]),
/// `None` for any other end of the connection.
fn held_elsewhere(e: &quinn::ConnectionError) -> Option<Result<SocketAddr, ()>> {
    let quinn::ConnectionError::ApplicationClosed(close) = e else {
        return None;
    };
    if close.error_code != CLOSE_ID_HELD_ELSEWHERE.into() {
        return None;
    }
    Some(
        Some(&close.reason[..])
            .filter(|r| r.len() <= MAX_HELD_ELSEWHERE_REASON)
            .and_then(|r| std::str::from_utf8(r).ok())
            .and_then(|r| r.parse().ok())
            .ok_or(()),
    )
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
/// Longest a QUIC handshake may take, dialing or accepting. quinn has no handshake
/// deadline of its own, and its idle timer restarts on every authenticated packet,
/// handshake packets included: a host that sends its first flight and then only
/// pings (no certificate needed) kept an accepting task and its connection state for
/// ever, and a dial to such a seed held the address's dial slot, and every send queued
/// behind it, for ever. A handshake across the world takes a few round trips.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Inbound handshakes in progress at once; past it new ones are refused at once
/// (`Incoming::refuse`): each holds a task and connection state until it completes
/// or times out, and a handshake needs no certificate to start.
const MAX_INBOUND_HANDSHAKES: usize = 256;
/// Longest a one-message stream may take to be sent or read whole (a 4 MiB snapshot
/// needs about 3.4 s at 10 Mbit/s): a peer that opens a stream and stalls, or stops
/// granting flow-control credit, costs a bounded task, not one for ever.
pub(crate) const STREAM_TIMEOUT: Duration = Duration::from_secs(30);
/// How many SWIM probe periods (`SwimTimings::probe_period`, 800 ms by default) a
/// stream on an inbound connection that has made no SWIM claim yet waits for the
/// connection's first claim before it is dropped: 4, so 3.2 s by default.
///
/// Why wait at all: a certificate proves a node id, not which process holds it, so
/// what a connection's streams say is taken as the id's only once a SWIM packet on the
/// connection claims the address the id is bound to. A process with a stolen
/// certificate that never sends SWIM would otherwise push gossip (an incarnation far
/// ahead, poisoning peers' view of the id) and forwards as the id. Why this long: an
/// honest peer that dials for a stream announces itself on the new connection at once
/// ([`Inbound::dialed`]; a dial for SWIM carries its packet anyway), so the claim
/// normally arrives about when the stream does; if that datagram is lost, the peer's
/// next SWIM packet here comes with foca's periodic gossip (every 200 ms, to two
/// members), a probe or the ack of one of ours, within a few probe periods. Four
/// periods leave room for that; a stream held longer would only be staler, and an
/// impostor's streams are held no longer than this before they are dropped.
pub(crate) const VOUCH_WAIT_PROBE_PERIODS: u32 = 4;

/// The single in-flight dial to one address.
#[derive(Debug, Default)]
pub(crate) struct DialSlot {
    lock: tokio::sync::Mutex<()>,
    /// When the last dial through this slot failed, and why.
    failed: Mutex<Option<(Instant, String)>>,
}

impl DialSlot {
    /// Whether the last dial through this slot failed less than [`DIAL_BACKOFF`] ago:
    /// sends to the address are dropped meanwhile, so the slot must be kept.
    fn backing_off(&self) -> bool {
        self.failed
            .lock()
            .as_ref()
            .is_some_and(|(t, _)| t.elapsed() < DIAL_BACKOFF)
    }

    /// Why the last dial failed, while it is backing off: what a caller refused
    /// meanwhile is told (not "timed out", which no dial did).
    fn refused_while_backing_off(&self, addr: SocketAddr) -> Option<ClusterError> {
        let failed = self.failed.lock();
        let (at, why) = failed.as_ref()?;
        (at.elapsed() < DIAL_BACKOFF).then(|| ClusterError::Backoff {
            addr,
            last: why.clone(),
        })
    }
}

/// What this node knows of the process behind a connection, beyond the node id its
/// certificate names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Vouched {
    /// This node dialed it, at this advertised address (a seed, or where membership
    /// put the node). It speaks for its node while the peer table binds the node there
    /// or nowhere: a process holding the node's certificate at a seed address is not
    /// the node while the node is alive elsewhere.
    Dialed(SocketAddr),
    /// It came in, and its SWIM packets claim the node from this advertised address,
    /// a claim the peer table accepted.
    At(SocketAddr),
    /// It came in, and its SWIM packets claim the node from an address the peer table
    /// refused (the id is alive elsewhere).
    Refused,
}

/// What is known of one open connection's process, and the newest generation it is
/// known to speak for (dialed, or claimed by an accepted SWIM packet on it).
#[derive(Debug)]
struct Vouch {
    /// `None` for an inbound connection that has made no SWIM claim yet. A watch, so
    /// that the streams that arrived on the connection before its first claim wait
    /// for it ([`Transport::wait_vouched`]) rather than poll.
    state: watch::Sender<Option<Vouched>>,
    generation: u64,
    /// Streams of the connection allowed to wait for its claim at once
    /// ([`MAX_STREAMS_AWAITING_VOUCH`]).
    waiting: Arc<tokio::sync::Semaphore>,
}

/// Streams of one connection that may wait for its first SWIM claim at once; more are
/// dropped at once (counted as unbound). QUIC would let a peer hold 1,088 streams open
/// on a connection, each buffering up to its stream window while it waits: an
/// unvouched connection (possibly a stolen certificate's) must not pin that much.
/// An honest peer's claim arrives with its first streams (it announces on dial), so a
/// few wait at most.
const MAX_STREAMS_AWAITING_VOUCH: usize = 32;

/// Inbound connections one certificate's node id may hold open here at once; when a
/// new one would be one more, the oldest of the others that does not speak for the id
/// (no SWIM claim yet, or a refused one), else the oldest of the others, is closed and
/// counted (`ClusterMetrics::excess_connections_closed`). The connection this node
/// sends to the id on is never the one closed.
///
/// Why a cap: every inbound connection is served, with up to 64 uni-streams each
/// reading up to 4 MiB, 32 streams waiting for its claim and a 64 MiB receive window,
/// so one certificate holder opening connections without end could pin memory without
/// end. Why 4: an honest peer holds one connection here that it dialed (two when the
/// address this node is dialed at as a seed is not the one it advertises, or behind a
/// relay), plus, after it restarts, its previous runs' connections until their idle
/// timeout (5 s) closes them. Why close an old one rather than refuse the new one: a
/// peer that restarts comes back on a new connection while its dead run's are still
/// open here; refusing would shut it out until they time out, and a holder of a
/// stolen certificate keeping four connections alive would shut it out for good.
/// Closing the old ones that speak for nobody first keeps a peer's vouched
/// connections against a flood of unvouched ones (a holder that can make accepted
/// claims can already take the id's place, docs/cluster.md "Identity").
const MAX_INBOUND_CONNECTIONS_PER_NODE: usize = 4;

// At most one of a node's connections is the one this node sends on: with two or
// more allowed, there is always another one to close.
const _: () = assert!(MAX_INBOUND_CONNECTIONS_PER_NODE >= 2);

/// Bytes a connection may have received and not yet read, over all its streams
/// (QUIC's connection-level flow control; quinn's default is unlimited). A peer's
/// forwards are read as they arrive, so this only binds streams held unread, e.g.
/// while they wait for the connection's claim: 64 MiB, several of the largest
/// forward bodies at once.
const CONNECTION_RECEIVE_WINDOW_BYTES: u32 = 64 << 20;

impl Vouch {
    fn new(state: Option<Vouched>, generation: u64) -> Self {
        Vouch {
            state: watch::Sender::new(state),
            generation,
            waiting: Arc::new(tokio::sync::Semaphore::new(MAX_STREAMS_AWAITING_VOUCH)),
        }
    }

    fn state(&self) -> Option<Vouched> {
        *self.state.borrow()
    }

    /// Set the state, waking the streams waiting on it when it changed.
    fn set(&self, state: Vouched) {
        self.state.send_if_modified(|s| {
            let changed = *s != Some(state);
            *s = Some(state);
            changed
        });
    }
}

/// Connections by peer id (from its certificate) and, for dials, by address.
///
/// A certificate proves a node id but not which process holds it: two processes with
/// the same certificate each connect as that id. So an inbound connection becomes the
/// one this node sends to the peer on only once a SWIM packet on it claims an address
/// the peer table accepts, its streams are taken as the peer's only then (they wait
/// for that claim, bounded), and one whose claim was refused carries nothing up but
/// its (checked) SWIM packets (docs/cluster.md, "Identity").
#[derive(Debug, Default)]
pub(crate) struct Connections {
    /// The connection this node sends to each peer on.
    by_node: DashMap<NodeId, quinn::Connection>,
    by_addr: DashMap<SocketAddr, (NodeId, quinn::Connection)>,
    dials: DashMap<SocketAddr, Arc<DialSlot>>,
    /// What is known of each open connection's process, by `stable_id`: an entry
    /// from the moment it is served until it closes (none: closed and forgotten).
    vouched: DashMap<usize, Vouch>,
    /// The inbound connections served for each certificate's node id, oldest first:
    /// at most [`MAX_INBOUND_CONNECTIONS_PER_NODE`] open at once.
    inbound: DashMap<NodeId, Vec<quinn::Connection>>,
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

    /// Drop the dial slots that hold nothing any more: no dial in flight or waiting
    /// (nobody but the map holds the slot) and no failed dial's backoff running. The
    /// number dropped.
    ///
    /// Why: a slot is made for every address dialed, and nothing else removes one
    /// whose dial failed (there is no connection whose close could) nor one left
    /// behind by a race with a close; a long-lived node under churn (peers
    /// rescheduled to new addresses, a member announcing many addresses, dead seeds)
    /// would keep one for every address it ever dialed. Dropping an idle slot loses
    /// nothing: a slot past its backoff and held by no caller is what a fresh one is.
    /// A caller takes its slot (a clone) under the map's shard lock, the same lock
    /// `retain` holds, so a slot a dial holds or waits on is never dropped, and
    /// concurrent callers for one address still share it.
    pub(crate) fn prune_dials(&self) -> usize {
        let before = self.dials.len();
        self.dials
            .retain(|_, slot| Arc::strong_count(slot) > 1 || slot.backing_off());
        before.saturating_sub(self.dials.len())
    }

    /// Addresses that hold a dial slot now (a dial in flight, a failed dial's
    /// backoff, or an idle slot the next [`prune_dials`](Self::prune_dials) drops).
    pub(crate) fn dial_slots(&self) -> usize {
        self.dials.len()
    }

    /// Forget every connection (shutdown).
    pub(crate) fn clear(&self) {
        self.by_node.clear();
        self.by_addr.clear();
        self.dials.clear();
        self.vouched.clear();
        self.inbound.clear();
    }

    /// Forget `conn` among `peer`'s inbound connections (it closed), and the peer's
    /// entry with the last one.
    fn forget_inbound(&self, peer: &NodeId, conn: &quinn::Connection) {
        if let Some(mut open) = self.inbound.get_mut(peer) {
            open.retain(|c| c.stable_id() != conn.stable_id());
        }
        self.inbound.remove_if(peer, |_, open| open.is_empty());
    }

    pub(crate) fn all(&self) -> Vec<(NodeId, quinn::Connection)> {
        self.by_node
            .iter()
            .map(|e| (e.key().clone(), e.value().clone()))
            .collect()
    }
}

/// The congestion window a connection between nodes starts with, bytes (QUIC's
/// default is about 14 KB).
///
/// Why: these links carry mostly gossip, too little to grow a window (an app-limited
/// sender's window stays where it is), so every forwarded request started from the
/// initial window and a long prompt's body (128 KB for 32k tokens) spent two or three
/// extra round trips in slow start: measured in `gorgo compare`, 0.6-1 RTT more to the
/// response head for bodies over 48 KB, up to 760 ms on a 250 ms link. 1 MiB carries a
/// body of about 256k tokens in one round trip; quinn paces it over the RTT rather than
/// bursting it. Links between regions are provisioned paths, not the open Internet.
pub const INITIAL_WINDOW_BYTES: u64 = 1024 * 1024;

/// The quinn transport config shared by both directions.
pub(crate) fn transport_config(idle: Duration, keep_alive: Duration) -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    let mut cubic = quinn::congestion::CubicConfig::default();
    cubic.initial_window(INITIAL_WINDOW_BYTES);
    t.congestion_controller_factory(Arc::new(cubic));
    if let Ok(idle) = quinn::IdleTimeout::try_from(idle) {
        t.max_idle_timeout(Some(idle));
    }
    t.keep_alive_interval(Some(keep_alive));
    t.max_concurrent_uni_streams(64u32.into());
    t.max_concurrent_bidi_streams(1024u32.into());
    t.receive_window(CONNECTION_RECEIVE_WINDOW_BYTES.into());
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
        probe_period: Duration,
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
            vouch_wait: probe_period.saturating_mul(VOUCH_WAIT_PROBE_PERIODS),
            warned: Mutex::new(crate::state::LogOnce::new(
                REFUSAL_WARNINGS.0,
                REFUSAL_WARNINGS.1,
            )),
        }
    }

    /// Count a handshake with `addr` that failed with `e`, and warn, once per address
    /// and cause, where the cause is one an operator must act on.
    fn handshake_failed(&self, addr: SocketAddr, e: &quinn::ConnectionError, dialed: bool) {
        let Some(refusal) = HandshakeRefusal::of(e) else {
            return;
        };
        ClusterMetrics::bump(match refusal {
            HandshakeRefusal::OtherProtocol => &self.metrics.handshakes_other_protocol,
            HandshakeRefusal::ForeignCertificate => &self.metrics.handshakes_foreign_certificate,
            HandshakeRefusal::ExpiredCertificate => &self.metrics.handshakes_expired_certificate,
        });
        let first = {
            self.warned
                .lock()
                .first((addr, refusal), tokio::time::Instant::now())
        };
        if first {
            let side = if dialed { "dialing" } else { "accepting" };
            tracing::warn!(%addr, "handshake {side} {addr} refused: {}", refusal.describe());
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

    /// The newest generation `conn` is known to speak for (0: none yet).
    fn generation_of(&self, conn: &quinn::Connection) -> u64 {
        self.conns
            .vouched
            .get(&conn.stable_id())
            .map_or(0, |v| v.generation)
    }

    /// A SWIM packet on `conn` claims `claim.node` from `claim.addr` under
    /// `claim.generation`, and the peer table accepted the claim: the connection may
    /// speak for the node, and becomes the one this node sends to it on when there is
    /// no usable one, or when the one there speaks for an older generation (the
    /// node's previous run, restarted at its address: that connection leads to a dead
    /// process until its idle timeout).
    pub(crate) fn bind_inbound(&self, conn: &quinn::Connection, claim: &MemberId) {
        let id = conn.stable_id();
        {
            // No entry: the connection closed (and was forgotten) while the packet
            // waited for the SWIM task; there is nothing to bind.
            let Some(mut v) = self.conns.vouched.get_mut(&id) else {
                return;
            };
            if !matches!(v.state(), Some(Vouched::Dialed(_))) {
                v.set(Vouched::At(claim.addr));
            }
            v.generation = v.generation.max(claim.generation);
        }
        let current = self.conns.by_node.get(&claim.node).map(|c| c.clone());
        let replace = current.is_none_or(|c| {
            c.stable_id() != id && (!usable(&c) || self.generation_of(&c) < claim.generation)
        });
        if replace {
            // quinn has an RTT estimate from the handshake already: a known peer gets
            // it now rather than at the next gossip round.
            self.peers
                .seed_rtt(&claim.node, conn.rtt().as_secs_f64() * 1000.0);
            self.conns.by_node.insert(claim.node.clone(), conn.clone());
        }
    }

    /// A SWIM packet on `conn` made a claim for `peer` the peer table refused: nothing
    /// from it speaks for `peer`, and this node does not send to `peer` on it.
    pub(crate) fn refuse(&self, peer: &NodeId, conn: &quinn::Connection) {
        let id = conn.stable_id();
        {
            let Some(v) = self.conns.vouched.get(&id) else {
                // Closed and forgotten meanwhile.
                return;
            };
            if let Some(Vouched::Dialed(dialed)) = v.state() {
                // This node chose the address; the claim was refused as a whole (SWIM
                // drops it), the connection stays what it is, but it is not the one
                // to send to `peer` on while the id is bound elsewhere.
                if self.peers.bound_addr(peer).is_none_or(|b| b == dialed) {
                    return;
                }
            } else {
                v.set(Vouched::Refused);
            }
        }
        self.conns
            .by_node
            .remove_if(peer, |_, c| c.stable_id() == id);
    }

    /// A SWIM packet on `conn` claimed `peer` from another address than `bound`, where
    /// a live member holds the id ([`crate::state::Claim::Conflict`]): close the
    /// connection with [`CLOSE_ID_HELD_ELSEWHERE`] and `bound`, so that the process
    /// behind it learns that it was refused and where the holder is. Not the
    /// connection this node dialed to `bound` (the holder's own, whatever one packet
    /// on it says), and one close per connection: a closed one is left as it is. True
    /// when this closed it.
    pub(crate) fn tell_held_elsewhere(
        &self,
        peer: &NodeId,
        conn: &quinn::Connection,
        bound: SocketAddr,
    ) -> bool {
        if !usable(conn) || self.may_speak_for(peer, conn) == Some(true) {
            return false;
        }
        let reason = bound.to_string();
        debug_assert!(reason.len() <= MAX_HELD_ELSEWHERE_REASON, "{reason}");
        conn.close(CLOSE_ID_HELD_ELSEWHERE.into(), reason.as_bytes());
        true
    }

    /// Whether a stream on `conn` speaks for `peer`, when that is known yet: it does
    /// on a connection this node dialed (it chose the address) and on one whose SWIM
    /// claim was accepted for the address the id is bound to now; it does not on one
    /// whose claim was refused, nor on one accepted for another address, nor on a
    /// closed one. `None` for an inbound connection that has made no claim yet: a
    /// peer may open a stream on a fresh connection before its first SWIM packet on
    /// it, so the stream waits for the claim ([`Transport::wait_vouched`]).
    fn may_speak_for(&self, peer: &NodeId, conn: &quinn::Connection) -> Option<bool> {
        let state = match self.conns.vouched.get(&conn.stable_id()) {
            Some(v) => v.state()?,
            None => return Some(false),
        };
        Some(match state {
            Vouched::Refused => false,
            Vouched::At(addr) | Vouched::Dialed(addr) => {
                self.peers.bound_addr(peer).is_none_or(|b| b == addr)
            }
        })
    }

    /// Count `conn`, a new inbound connection of `peer`'s, against the id's cap
    /// ([`MAX_INBOUND_CONNECTIONS_PER_NODE`]): when it would be one too many, another
    /// of the id's connections is given up for it, and returned for closing.
    fn admit_inbound(&self, peer: &NodeId, conn: &quinn::Connection) -> Option<quinn::Connection> {
        // `by_node` is read before `inbound`'s entry is locked; under that lock only
        // `vouched` and the peer table are read (`may_speak_for`), and nothing locks
        // `inbound` while it holds either, so the maps' locks cannot deadlock.
        let sending = self.conns.by_node.get(peer).map(|c| c.stable_id());
        let mut open = self.conns.inbound.entry(peer.clone()).or_default();
        // A closed one not forgotten yet (its datagram task ends soon) is not held.
        open.retain(usable);
        let mut evicted = None;
        if open.len() >= MAX_INBOUND_CONNECTIONS_PER_NODE {
            let others = || {
                open.iter()
                    .enumerate()
                    .filter(|(_, c)| Some(c.stable_id()) != sending)
            };
            let victim = others()
                .find(|(_, c)| self.may_speak_for(peer, c) != Some(true))
                .or_else(|| others().next())
                .map(|(i, _)| i);
            evicted = victim.map(|i| open.remove(i));
        }
        open.push(conn.clone());
        evicted
    }

    /// Wait until inbound `conn` has made a SWIM claim, at most
    /// [`vouch_wait`](Self::vouch_wait), and say whether a stream on it then speaks
    /// for `peer` ([`may_speak_for`](Self::may_speak_for)). False on timeout, when the
    /// connection closes first, and on shutdown (which ends the wait at once).
    ///
    /// Called in the stream's own task, never in the accept loops, so that other
    /// streams and connections keep flowing. At most [`MAX_STREAMS_AWAITING_VOUCH`]
    /// streams of one connection wait at a time (false at once for more), each for at
    /// most `vouch_wait`, and what they may buffer meanwhile is bounded by the
    /// connection's receive window ([`CONNECTION_RECEIVE_WINDOW_BYTES`]).
    async fn wait_vouched(&self, peer: &NodeId, conn: &quinn::Connection) -> bool {
        let (mut state, waiting) = match self.conns.vouched.get(&conn.stable_id()) {
            Some(v) => (v.state.subscribe(), v.waiting.clone()),
            None => return false,
        };
        let Ok(_permit) = waiting.try_acquire_owned() else {
            return false;
        };
        let claimed = tokio::select! {
            biased;
            _ = self.shutdown.cancelled() => false,
            // Err inside: the entry was dropped, the connection closed.
            r = tokio::time::timeout(self.vouch_wait, state.wait_for(Option::is_some)) => {
                matches!(r, Ok(Ok(_)))
            }
        };
        claimed && self.may_speak_for(peer, conn) == Some(true)
    }
}

/// What a dial is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DialFor {
    /// A SWIM packet, sent on the connection right after: the peer vouches the
    /// connection with it.
    Swim,
    /// Streams (gossip, app messages, forwards): a fresh connection is announced on
    /// at once ([`Inbound::dialed`]), so that the peer does not hold them for the
    /// connection's first SWIM packet any longer than needed.
    Streams,
}

/// Get a connection to `addr` (the node there being `node` when known), dialing if
/// needed. Concurrent callers for one address share a single dial.
pub(crate) async fn connect(
    inner: &Arc<Transport>,
    node: Option<&NodeId>,
    addr: SocketAddr,
    purpose: DialFor,
) -> Result<quinn::Connection> {
    let advertised = addr;
    let addr = dial_addr(inner, addr);
    if let Some(c) = inner.conns.lookup(node, addr) {
        return Ok(c);
    }
    let slot = inner.conns.dials.entry(addr).or_default().clone();
    let _guard = slot.lock.lock().await;
    if let Some(c) = inner.conns.lookup(node, addr) {
        return Ok(c);
    }
    if let Some(refused) = slot.refused_while_backing_off(addr) {
        return Err(refused);
    }
    let server_name = node.map_or(CLUSTER_SERVER_NAME, |n| n.0.as_str());
    let result = async {
        let connecting = inner.endpoint()?.connect(addr, server_name)?;
        let conn = tokio::time::timeout(HANDSHAKE_TIMEOUT, connecting)
            .await
            .map_err(|_| {
                ClusterError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("handshake with {addr} not done within {HANDSHAKE_TIMEOUT:?}"),
                ))
            })?
            .inspect_err(|e| inner.handshake_failed(addr, e, true))?;
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
        let generation = inner.peers.alive_generation(&peer).unwrap_or(0);
        inner.conns.vouched.insert(
            conn.stable_id(),
            Vouch::new(Some(Vouched::Dialed(advertised)), generation),
        );
        // The connection to send to `peer` on, unless the id is alive at another
        // address: then whoever answers here (a seed address an impostor with the
        // certificate holds, or the node's previous run) is not the live node, and
        // taking its place would send the node's SWIM, gossip and forwards there.
        if inner
            .peers
            .bound_addr(&peer)
            .is_none_or(|b| b == advertised)
        {
            // quinn has an RTT estimate from the handshake already: a known peer gets
            // it now rather than at the next gossip round.
            inner
                .peers
                .seed_rtt(&peer, conn.rtt().as_secs_f64() * 1000.0);
            inner.conns.by_node.insert(peer.clone(), conn.clone());
        }
        serve(inner, peer.clone(), conn.clone());
        if purpose == DialFor::Streams {
            if let Some(inbound) = inner.inbound.upgrade() {
                inbound.dialed(&peer, &conn);
            }
        }
        Ok(conn)
    }
    .await;
    *slot.failed.lock() = result
        .as_ref()
        .err()
        .map(|e| (Instant::now(), e.to_string()));
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
    let datagram = swim_datagram(&packet);
    let node = (!dst.node.0.is_empty()).then_some(&dst.node);
    if let Some(c) = inner.conns.lookup(node, dial_addr(inner, dst.addr)) {
        send_datagram(inner, &c, node, datagram);
        return;
    }
    let inner = inner.clone();
    tokio::spawn(async move {
        let node = (!dst.node.0.is_empty()).then_some(&dst.node);
        match connect(&inner, node, dst.addr, DialFor::Swim).await {
            Ok(c) => send_datagram(&inner, &c, node, datagram),
            Err(e) => tracing::debug!(peer = %dst.node, addr = %dst.addr, "swim send dropped: {e}"),
        }
    });
}

/// Send a SWIM packet to `dst` on `conn`, the connection this node just dialed it on
/// for streams: the packet that vouches that very connection at the peer
/// ([`Inbound::dialed`]), whichever connection the peer table names for `dst` by now.
pub(crate) fn send_swim_on(
    inner: &Transport,
    conn: &quinn::Connection,
    dst: &MemberId,
    packet: Bytes,
) {
    send_datagram(inner, conn, Some(&dst.node), swim_datagram(&packet));
}

/// A SWIM packet framed as a datagram of the cluster's protocol.
fn swim_datagram(packet: &[u8]) -> Bytes {
    let mut datagram = Vec::with_capacity(packet.len() + 1);
    datagram.push(DATAGRAM_SWIM);
    datagram.extend_from_slice(packet);
    Bytes::from(datagram)
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
            connect(inner, Some(node), addr, DialFor::Streams).await?
        }
    };
    let sent = tokio::time::timeout(STREAM_TIMEOUT, async {
        let mut send = conn.open_uni().await?;
        send.write_all(frame).await?;
        Ok::<_, ClusterError>(send)
    })
    .await
    .map_err(|_| {
        ClusterError::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("stream to {node} not sent within {STREAM_TIMEOUT:?}"),
        ))
    })?;
    let mut send = sent?;
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
    let handshakes = Arc::new(tokio::sync::Semaphore::new(MAX_INBOUND_HANDSHAKES));
    loop {
        let incoming = tokio::select! {
            biased;
            _ = inner.shutdown.cancelled() => return,
            i = endpoint.accept() => match i { Some(i) => i, None => return },
        };
        let Ok(handshake) = handshakes.clone().try_acquire_owned() else {
            ClusterMetrics::bump(&inner.metrics.handshakes_failed);
            incoming.refuse();
            continue;
        };
        let inner = inner.clone();
        tokio::spawn(async move {
            let from = incoming.remote_address();
            let accepted = tokio::time::timeout(HANDSHAKE_TIMEOUT, incoming).await;
            drop(handshake);
            let conn = match accepted {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => {
                    ClusterMetrics::bump(&inner.metrics.handshakes_failed);
                    inner.handshake_failed(from, &e, false);
                    tracing::debug!("inbound handshake failed: {e}");
                    return;
                }
                Err(_) => {
                    ClusterMetrics::bump(&inner.metrics.handshakes_failed);
                    tracing::debug!(%from, "inbound handshake not done within {HANDSHAKE_TIMEOUT:?}");
                    return;
                }
            };
            match peer_node_id(&conn) {
                // Not yet the connection to `peer`, nor one its streams may speak on:
                // its SWIM packets must first claim an address the peer table
                // accepts (`Transport::bind_inbound`).
                Some(peer) if peer != inner.node_id => {
                    inner
                        .conns
                        .vouched
                        .insert(conn.stable_id(), Vouch::new(None, 0));
                    if let Some(old) = inner.admit_inbound(&peer, &conn) {
                        ClusterMetrics::bump(&inner.metrics.excess_connections_closed);
                        tracing::debug!(%peer, "too many connections from one node id; an older one closed");
                        old.close(1u32.into(), b"too many connections");
                    }
                    serve(&inner, peer, conn)
                }
                _ => {
                    ClusterMetrics::bump(&inner.metrics.handshakes_failed);
                    conn.close(1u32.into(), b"no node id");
                }
            }
        });
    }
}

/// Serve what arrives on `conn`, a connection to `peer`.
fn serve(inner: &Arc<Transport>, peer: NodeId, conn: quinn::Connection) {
    tokio::spawn(read_datagrams(inner.clone(), peer.clone(), conn.clone()));
    tokio::spawn(accept_unis(inner.clone(), peer.clone(), conn.clone()));
    tokio::spawn(accept_bis(inner.clone(), peer, conn));
}

async fn read_datagrams(inner: Arc<Transport>, peer: NodeId, conn: quinn::Connection) {
    let closed = loop {
        let d = tokio::select! {
            biased;
            _ = inner.shutdown.cancelled() => return,
            d = conn.read_datagram() => match d { Ok(d) => d, Err(e) => break e },
        };
        // Every datagram read, refused or not; the peer is credited with it only once
        // the SWIM checks take it as the peer's own (`cluster::handle_data`): the
        // certificate names who sent it, not whom its packet speaks for.
        inner.metrics.received(TrafficKind::Swim, d.len());
        if d.len() < 2 || d.len() > MAX_SWIM_PACKET + 1 || d[0] != DATAGRAM_SWIM {
            ClusterMetrics::bump(&inner.metrics.malformed_received);
            continue;
        }
        match inner.inbound.upgrade() {
            Some(inbound) => inbound.swim(peer.clone(), conn.clone(), d.slice(1..)),
            None => return,
        }
    };
    match held_elsewhere(&closed) {
        Some(Ok(held_at)) => {
            if let Some(inbound) = inner.inbound.upgrade() {
                inbound.own_id_refused(&peer, held_at);
            }
        }
        Some(Err(())) => ClusterMetrics::bump(&inner.metrics.malformed_received),
        None => {}
    }
    // Forget the connection if it is still the registered one, by node and by the
    // address it was dialed on: peers that come back on new addresses must not leave
    // closed connections behind for ever. (The address's dial slot goes with the
    // next `Connections::prune_dials`, as every idle one does.)
    inner
        .conns
        .by_node
        .remove_if(&peer, |_, c| c.stable_id() == conn.stable_id());
    let addrs: Vec<SocketAddr> = inner
        .conns
        .by_addr
        .iter()
        .filter(|e| e.value().1.stable_id() == conn.stable_id())
        .map(|e| *e.key())
        .collect();
    for addr in addrs {
        inner
            .conns
            .by_addr
            .remove_if(&addr, |_, (_, c)| c.stable_id() == conn.stable_id());
    }
    inner.conns.vouched.remove(&conn.stable_id());
    inner.conns.forget_inbound(&peer, &conn);
}

async fn accept_unis(inner: Arc<Transport>, peer: NodeId, conn: quinn::Connection) {
    loop {
        let mut recv = tokio::select! {
            biased;
            _ = inner.shutdown.cancelled() => return,
            r = conn.accept_uni() => match r { Ok(r) => r, Err(_) => return },
        };
        let speaks = inner.may_speak_for(&peer, &conn);
        if speaks == Some(false) {
            ClusterMetrics::bump(&inner.metrics.unbound_streams_dropped);
            let _ = recv.stop(1u32.into());
            continue;
        }
        let inner = inner.clone();
        let peer = peer.clone();
        let conn = conn.clone();
        tokio::spawn(async move {
            // Made no claim yet: wait for one here, not in the accept loop.
            if speaks.is_none() && !inner.wait_vouched(&peer, &conn).await {
                drop_unvouched(&inner);
                let _ = recv.stop(1u32.into());
                return;
            }
            let bytes = match read_uni(&mut recv).await {
                Ok(b) => b,
                Err(e) => {
                    tracing::debug!(%peer, "uni-stream dropped: {e}");
                    ClusterMetrics::bump(&inner.metrics.malformed_received);
                    let _ = recv.stop(1u32.into());
                    return;
                }
            };
            match bytes.first() {
                Some(&STREAM_GOSSIP) => {
                    inner.metrics.received(TrafficKind::Summary, bytes.len());
                    inner.peers.add_bytes(&peer, 0, bytes.len() as u64);
                    if let Some(inbound) = inner.inbound.upgrade() {
                        inbound.gossip(&peer, &bytes[1..]);
                    }
                }
                Some(&STREAM_APP) if bytes.len() >= 2 && bytes.len() - 2 <= MAX_APP_MESSAGE => {
                    inner.metrics.received(TrafficKind::App, bytes.len());
                    inner.peers.add_bytes(&peer, 0, bytes.len() as u64);
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

/// A uni-stream's whole message, its kind byte first, read within one
/// [`STREAM_TIMEOUT`] in all; the kind is read first so that each kind gets its own
/// cap (an app message stream may not buffer a gossip-sized payload).
///
/// Why one deadline for the whole read: with one for the kind byte and another for
/// the rest, a peer that sent the rest late (or its first byte after the others: QUIC
/// opens a stream at any offset) held the task for up to twice as long.
async fn read_uni<R: tokio::io::AsyncRead + Unpin>(recv: &mut R) -> Result<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let read = async {
        let mut kind = [0u8; 1];
        recv.read_exact(&mut kind).await?;
        let limit = match kind[0] {
            STREAM_GOSSIP => MAX_GOSSIP_FRAME,
            STREAM_APP => MAX_APP_MESSAGE + 2,
            k => return Err(ClusterError::Decode(format!("unknown stream kind {k}"))),
        };
        let mut bytes = vec![kind[0]];
        // One byte past the cap tells a message over it from one at it.
        recv.take(limit as u64).read_to_end(&mut bytes).await?;
        if bytes.len() > limit {
            return Err(ClusterError::TooLarge {
                size: bytes.len(),
                limit,
            });
        }
        Ok(bytes)
    };
    tokio::time::timeout(STREAM_TIMEOUT, read)
        .await
        .map_err(|_| {
            ClusterError::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("stream not read whole within {STREAM_TIMEOUT:?}"),
            ))
        })?
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
        match inner.may_speak_for(&peer, &conn) {
            Some(true) => match inner.inbound.upgrade() {
                Some(inbound) => inbound.forward(fwd),
                None => return,
            },
            // Dropping the streams resets them: the origin serves elsewhere.
            Some(false) => ClusterMetrics::bump(&inner.metrics.unbound_streams_dropped),
            // Made no claim yet: wait for one in a task of its own, so that the loop
            // goes on accepting.
            None => {
                let inner = inner.clone();
                let (peer, conn) = (peer.clone(), conn.clone());
                tokio::spawn(async move {
                    if !inner.wait_vouched(&peer, &conn).await {
                        drop_unvouched(&inner);
                        return;
                    }
                    if let Some(inbound) = inner.inbound.upgrade() {
                        inbound.forward(fwd);
                    }
                });
            }
        }
    }
}

/// A stream that waited for its connection's first SWIM claim in vain (none in time,
/// or a refused one) is dropped like any stream refused at once, and counted; one cut
/// short by shutdown is just dropped.
fn drop_unvouched(inner: &Transport) {
    if !inner.shutdown.is_cancelled() {
        ClusterMetrics::bump(&inner.metrics.unbound_streams_dropped);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 1], port))
    }

    /// Pruning drops only slots that hold nothing: a slot a caller holds (a dial in
    /// flight, or waiting for one) stays, so callers for one address still share a
    /// single dial, and a failed dial's slot stays until its backoff is over, so sends
    /// to a dead address are still dropped meanwhile.
    #[tokio::test(start_paused = true)]
    async fn prune_drops_idle_dial_slots_only() {
        let conns = Connections::default();
        // A dial that succeeded, held by nobody now.
        conns.dials.insert(addr(1), Arc::default());
        // A dial that failed just now.
        let failed = Arc::new(DialSlot::default());
        *failed.failed.lock() = Some((Instant::now(), "refused".into()));
        conns.dials.insert(addr(2), failed);
        // A dial under way (as `connect` takes its slot).
        let held = conns.dials.entry(addr(3)).or_default().clone();

        assert_eq!(conns.prune_dials(), 1);
        assert!(!conns.dials.contains_key(&addr(1)));
        assert!(conns.dials.get(&addr(2)).is_some_and(|s| s.backing_off()));
        // A second caller for the held address gets the slot the first holds.
        let second = conns.dials.entry(addr(3)).or_default().clone();
        assert!(Arc::ptr_eq(&held, &second));
        drop(second);

        tokio::time::advance(DIAL_BACKOFF).await;
        assert_eq!(conns.prune_dials(), 1, "the backoff is over");
        assert_eq!(conns.dial_slots(), 1, "the held slot stays");
        drop(held);
        assert_eq!(conns.prune_dials(), 1);
        assert_eq!(conns.dial_slots(), 0);
    }

    /// A handshake's TLS alert tells the causes an operator must act on apart, from
    /// either side (the alert this side raised, or the one the peer closed with).
    #[test]
    fn handshake_refusals_are_told_apart_by_their_alert() {
        let closed = |alert: u8| {
            quinn::ConnectionError::ConnectionClosed(quinn::ConnectionClose {
                error_code: quinn::TransportErrorCode::crypto(alert),
                frame_type: None,
                reason: bytes::Bytes::new(),
            })
        };
        assert_eq!(
            HandshakeRefusal::of(&closed(120)),
            Some(HandshakeRefusal::OtherProtocol)
        );
        for alert in [48, 51] {
            assert_eq!(
                HandshakeRefusal::of(&closed(alert)),
                Some(HandshakeRefusal::ForeignCertificate)
            );
        }
        assert_eq!(
            HandshakeRefusal::of(&closed(45)),
            Some(HandshakeRefusal::ExpiredCertificate)
        );
        assert_eq!(HandshakeRefusal::of(&closed(40)), None);
        assert_eq!(
            HandshakeRefusal::of(&quinn::ConnectionError::TimedOut),
            None
        );
    }

    /// A close with [`CLOSE_ID_HELD_ELSEWHERE`] names the holder's address, and the
    /// longest address there is fits its cap; a reason that is no address, or over
    /// the cap, is malformed; any other close is none of it.
    #[test]
    fn a_close_for_an_id_held_elsewhere_names_the_holder() {
        let closed = |code: u32, reason: &str| {
            quinn::ConnectionError::ApplicationClosed(quinn::ApplicationClose {
                error_code: code.into(),
                reason: bytes::Bytes::copy_from_slice(reason.as_bytes()),
            })
        };
        let longest = SocketAddr::V6(std::net::SocketAddrV6::new(
            std::net::Ipv6Addr::new(
                0xffff, 0xffff, 0xffff, 0xffff, 0xffff, 0xffff, 0xfffe, 0xffff,
            ),
            65535,
            0,
            u32::MAX,
        ));
        assert!(
            longest.to_string().len() <= MAX_HELD_ELSEWHERE_REASON,
            "{longest}"
        );
        for addr in [addr(7000), longest] {
            assert_eq!(
                held_elsewhere(&closed(CLOSE_ID_HELD_ELSEWHERE, &addr.to_string())),
                Some(Ok(addr))
            );
        }
        let padded = format!("{}{}", " ".repeat(MAX_HELD_ELSEWHERE_REASON), addr(1));
        for reason in ["", "not an address", padded.as_str()] {
            assert_eq!(
                held_elsewhere(&closed(CLOSE_ID_HELD_ELSEWHERE, reason)),
                Some(Err(())),
                "{reason:?}"
            );
        }
        assert_eq!(held_elsewhere(&closed(1, "10.0.0.1:1")), None);
        assert_eq!(held_elsewhere(&quinn::ConnectionError::TimedOut), None);
    }

    /// A caller turned away while a failed dial backs off is told why that dial
    /// failed (a wrong node at the address, a TLS error), not that it timed out.
    #[tokio::test(start_paused = true)]
    async fn a_dial_refused_during_the_backoff_says_why_the_last_failed() {
        let slot = DialSlot::default();
        assert!(slot.refused_while_backing_off(addr(1)).is_none());
        let why = ClusterError::PeerMismatch {
            expected: NodeId::from("b"),
            got: "c".into(),
        };
        *slot.failed.lock() = Some((Instant::now(), why.to_string()));
        let told = slot.refused_while_backing_off(addr(1)).unwrap().to_string();
        assert!(
            told.contains("expected b, got c") && told.contains("10.0.0.1:1"),
            "{told}"
        );
        tokio::time::advance(DIAL_BACKOFF).await;
        assert!(slot.refused_while_backing_off(addr(1)).is_none());
    }

    /// A peer that trickles a stream (its kind byte just before the deadline, then a
    /// byte now and then, never the end) is cut when `STREAM_TIMEOUT` has passed since
    /// the read began, not that long again after its kind byte: the kind and the rest
    /// are read under one deadline. A whole message within it is read as sent.
    #[tokio::test(start_paused = true)]
    async fn a_trickled_stream_is_cut_at_one_deadline() {
        use tokio::io::AsyncWriteExt;
        let (mut peer, mut recv) = tokio::io::duplex(64);
        tokio::spawn(async move {
            tokio::time::sleep(STREAM_TIMEOUT - Duration::from_secs(1)).await;
            peer.write_all(&[STREAM_GOSSIP]).await?;
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                peer.write_all(&[0]).await?;
            }
            #[allow(unreachable_code)]
            Ok::<_, std::io::Error>(())
        });
        let started = Instant::now();
        let read = read_uni(&mut recv).await;
        let took = started.elapsed();
        assert!(
            matches!(&read, Err(ClusterError::Io(e)) if e.kind() == std::io::ErrorKind::TimedOut),
            "{read:?}"
        );
        assert!(
            took >= STREAM_TIMEOUT && took < STREAM_TIMEOUT + Duration::from_secs(1),
            "cut after {took:?}"
        );

        let (mut peer, mut recv) = tokio::io::duplex(64);
        let mut message = vec![STREAM_APP, 7];
        message.extend_from_slice(&[9; 100]);
        let sent = message.clone();
        tokio::spawn(async move {
            for chunk in sent.chunks(10) {
                tokio::time::sleep(Duration::from_secs(1)).await;
                peer.write_all(chunk).await?;
            }
            Ok::<_, std::io::Error>(())
        });
        assert_eq!(read_uni(&mut recv).await.expect("read whole"), message);
    }

    /// Each kind's cap, its kind byte included: a message at it is read, one byte
    /// more is refused, and an unknown kind is refused at once.
    #[tokio::test]
    async fn a_stream_over_its_kinds_cap_is_refused() {
        let at_cap: Vec<u8> = [STREAM_APP]
            .into_iter()
            .chain(std::iter::repeat_n(1, MAX_APP_MESSAGE + 1))
            .collect();
        assert_eq!(
            read_uni(&mut &at_cap[..]).await.expect("at the cap").len(),
            MAX_APP_MESSAGE + 2
        );
        let mut over = at_cap.clone();
        over.push(1);
        assert!(matches!(
            read_uni(&mut &over[..]).await,
            Err(ClusterError::TooLarge { limit, .. }) if limit == MAX_APP_MESSAGE + 2
        ));
        assert!(matches!(
            read_uni(&mut &[9u8, 1, 2][..]).await,
            Err(ClusterError::Decode(_))
        ));
        assert!(matches!(
            read_uni(&mut &[][..]).await,
            Err(ClusterError::Io(_))
        ));
    }
}
