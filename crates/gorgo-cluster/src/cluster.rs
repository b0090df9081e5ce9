//! The cluster driver: starts the endpoint, runs foca on a thin tokio task, and hands
//! the node a [`ClusterHandle`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use foca::{AccumulatingRuntime, BroadcastHandler, Foca, Invalidates, OwnedNotification, Timer};
use foca_rand::SeedableRng;
use gorgo_core::summary::PeerSummary;
use gorgo_core::{NodeId, QueueStats};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::ClusterConfig;
use crate::error::{ClusterError, Result};
use crate::gossip::{GossipDriver, SummarySource};
use crate::identity::{self, BincodeCodec, MemberId};
use crate::state::{
    Claim, ClusterMetrics, IdentityRefusal, OwnIdRefusals, PeerTable, PeerView, TrafficKind,
    REFUSAL_TTL_ANNOUNCE_PERIODS,
};
use crate::tls::{client_crypto, server_crypto, validate_node_id};
use crate::transport::{self, Inbound, Transport, MAX_APP_MESSAGE, STREAM_APP};
pub use crate::transport::{AppMessage, IncomingForward};

/// Where the QUIC endpoint gets its UDP socket.
pub enum ClusterSocket {
    /// Bind `ClusterConfig::listen` with a std socket.
    Bind,
    /// A bound std socket (real network).
    Std(std::net::UdpSocket),
    /// Any socket and runtime quinn accepts (tests: turmoil).
    Custom {
        /// The socket.
        socket: Arc<dyn quinn::AsyncUdpSocket>,
        /// The runtime (timers and spawning).
        runtime: Arc<dyn quinn::Runtime>,
    },
}

impl std::fmt::Debug for ClusterSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClusterSocket::Bind => f.write_str("Bind"),
            ClusterSocket::Std(s) => f.debug_tuple("Std").field(s).finish(),
            ClusterSocket::Custom { socket, .. } => f.debug_tuple("Custom").field(socket).finish(),
        }
    }
}

/// A membership change as this node saw it, for the admin API and traces.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum MembershipEvent {
    /// A peer became a routing candidate.
    Up(NodeId, u64),
    /// A peer was declared down or left.
    Down(NodeId, u64),
    /// A live peer came back under a new generation without being seen down: it
    /// restarted at its address (or rejoined) before failure detection fired, so what
    /// was in flight to its old run is lost.
    Renamed(NodeId, u64),
    /// This node rejoined with a new generation after being declared down.
    Rejoined(u64),
}

enum FocaInput {
    Data {
        from: NodeId,
        conn: quinn::Connection,
        data: Bytes,
    },
    Timer(Timer<MemberId>),
    Broadcast(Vec<u8>),
    /// This node dialed the peer for streams: announce to it on the new connection.
    AnnounceTo(NodeId, quinn::Connection),
    Leave(oneshot::Sender<()>),
}

/// Shared state of a running cluster member.
struct Inner {
    node_id: NodeId,
    config: ClusterConfig,
    me: Mutex<MemberId>,
    /// This run of the process (the wall clock at start, ms), stamped on every stats
    /// copy it publishes: peers order copies by it first (docs/cluster.md,
    /// "Incarnations").
    incarnation: u64,
    /// Set by [`ClusterHandle::drain`]: every stats copy from then on says so.
    draining: std::sync::atomic::AtomicBool,
    /// Refused claims already logged at warning level, so that an impostor sending
    /// ten packets a second logs once (the metric counts them all).
    refusals_logged: Mutex<crate::state::LogOnce<(NodeId, SocketAddr)>>,
    /// Peers that refused this node's own claim to its id, and where they hold it
    /// (docs/cluster.md, "Identity: one live process per node id").
    own_id_refusals: OwnIdRefusals,
    /// The QUIC endpoint and connections (hands what arrives back to this `Inner`
    /// through [`Inbound`]).
    transport: Arc<Transport>,
    /// Summary gossip (the core's state machine and its IO).
    gossip: Arc<GossipDriver>,
    /// Cancelled once the endpoint is closed and released.
    closed: CancellationToken,
    peers: Arc<PeerTable>,
    metrics: Arc<ClusterMetrics>,
    foca_tx: mpsc::Sender<FocaInput>,
    shutdown: CancellationToken,
    forward_tx: mpsc::Sender<IncomingForward>,
    forward_rx: Mutex<Option<mpsc::Receiver<IncomingForward>>>,
    app_tx: mpsc::Sender<AppMessage>,
    app_rx: Mutex<Option<mpsc::Receiver<AppMessage>>>,
    started: Instant,
    events: Mutex<std::collections::VecDeque<(Duration, MembershipEvent)>>,
    membership_tx: tokio::sync::watch::Sender<u64>,
    /// When this node last renewed its identity (a rejoin): a "you were declared down"
    /// for the new identity sooner than a suspicion could run its course is not news.
    renewed_at: Mutex<Option<Instant>>,
}

/// What the node holds: cheap to clone, every method usable from any task.
#[derive(Clone)]
pub struct ClusterHandle {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ClusterHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterHandle")
            .field("node", &self.inner.node_id)
            .finish_non_exhaustive()
    }
}

/// Forwards waiting for the node to take them.
const FORWARD_INBOX: usize = 1024;
/// App messages waiting for the node to take them.
const APP_INBOX: usize = 1024;
/// Inputs queued for the SWIM task; SWIM packets beyond it are dropped (SWIM tolerates
/// loss), timers and commands wait.
const FOCA_INBOX: usize = 4096;
/// Cap on one encoded stats broadcast.
const MAX_STATS_BROADCAST: usize = 512;
/// How long shutdown waits for closing connections to drain before it lets go of the
/// endpoint (the socket is released once they have).
const CLOSE_DRAIN: Duration = Duration::from_secs(2);

/// Start a cluster member: bind the endpoint, announce to the seeds, gossip `summary`
/// (e.g. an `Arc<SharedSummary<ShadowIndex>>`) until `shutdown` is cancelled (then
/// leave gracefully).
pub async fn start(
    config: ClusterConfig,
    socket: ClusterSocket,
    summary: Arc<dyn SummarySource>,
    shutdown: CancellationToken,
) -> Result<ClusterHandle> {
    validate_node_id(&config.node_id)?;
    config.credentials.check_identity(&config.node_id)?;
    if config.gossip_interval.is_zero() {
        return Err(ClusterError::Config {
            field: "gossip_interval",
            reason: "must be > 0".into(),
        });
    }
    if config.swim.probe_rtt >= config.swim.probe_period {
        return Err(ClusterError::Config {
            field: "swim.probe_rtt",
            reason: "must be shorter than swim.probe_period".into(),
        });
    }
    let transport = Arc::new(transport::transport_config(
        config.idle_timeout,
        config.keep_alive,
    ));
    let mut server =
        quinn::ServerConfig::with_crypto(Arc::new(server_crypto(&config.credentials)?));
    server.transport_config(transport.clone());
    let mut client = quinn::ClientConfig::new(Arc::new(client_crypto(&config.credentials)?));
    client.transport_config(transport);
    let endpoint_config = quinn::EndpointConfig::default();
    let mut endpoint = match socket {
        ClusterSocket::Bind => {
            let s = std::net::UdpSocket::bind(config.listen)?;
            quinn::Endpoint::new(
                endpoint_config,
                Some(server),
                s,
                Arc::new(quinn::TokioRuntime),
            )?
        }
        ClusterSocket::Std(s) => quinn::Endpoint::new(
            endpoint_config,
            Some(server),
            s,
            Arc::new(quinn::TokioRuntime),
        )?,
        ClusterSocket::Custom { socket, runtime } => quinn::Endpoint::new_with_abstract_socket(
            endpoint_config,
            Some(server),
            socket,
            runtime,
        )?,
    };
    endpoint.set_default_client_config(client);
    // Listening on port 0 (tests, ad-hoc runs): advertise the port actually bound.
    let mut config = config;
    if config.advertise.port() == 0 {
        config.advertise.set_port(endpoint.local_addr()?.port());
    }

    let incarnation = (config.wall_clock)();
    let generation = config.generation.unwrap_or(incarnation);
    let me = MemberId {
        node: config.node_id.clone(),
        region: config.region.clone(),
        addr: config.advertise,
        generation,
    };
    let seed = config.rng_seed.unwrap_or_else(|| {
        gorgo_core::hash::hash_bytes(format!("{}/{generation}", config.node_id).as_bytes())
    });
    let (foca_tx, foca_rx) = mpsc::channel(FOCA_INBOX);
    let (forward_tx, forward_rx) = mpsc::channel(FORWARD_INBOX);
    let (app_tx, app_rx) = mpsc::channel(APP_INBOX);
    let peers = Arc::new(PeerTable::default());
    let metrics = Arc::new(ClusterMetrics::default());
    let inner = Arc::new_cyclic(|weak: &std::sync::Weak<Inner>| Inner {
        node_id: config.node_id.clone(),
        me: Mutex::new(me.clone()),
        incarnation,
        draining: std::sync::atomic::AtomicBool::new(false),
        refusals_logged: Mutex::new(crate::state::LogOnce::new(
            transport::REFUSAL_WARNINGS.0,
            transport::REFUSAL_WARNINGS.1,
        )),
        own_id_refusals: OwnIdRefusals::default(),
        transport: Arc::new(Transport::new(
            config.node_id.clone(),
            endpoint,
            config.dial_overrides.clone(),
            peers.clone(),
            metrics.clone(),
            shutdown.clone(),
            weak.clone(),
            config.swim.probe_period,
        )),
        gossip: Arc::new(GossipDriver::new(
            config.node_id.clone(),
            incarnation,
            summary,
            config.wall_clock.clone(),
        )),
        closed: CancellationToken::new(),
        peers,
        metrics,
        foca_tx,
        shutdown,
        forward_tx,
        forward_rx: Mutex::new(Some(forward_rx)),
        app_tx,
        app_rx: Mutex::new(Some(app_rx)),
        started: Instant::now(),
        events: Mutex::new(std::collections::VecDeque::new()),
        membership_tx: tokio::sync::watch::channel(0).0,
        renewed_at: Mutex::new(None),
        config,
    });
    let handler = StatsHandler {
        inner: Arc::downgrade(&inner),
    };
    let foca = Foca::with_custom_broadcast(
        me,
        inner.config.swim.foca_config(),
        foca_rand::rngs::SmallRng::seed_from_u64(seed),
        BincodeCodec,
        handler,
    );
    tokio::spawn(transport::accept_loop(inner.transport.clone()));
    tokio::spawn(run_foca(inner.clone(), foca, foca_rx));
    tokio::spawn(crate::gossip::run(
        inner.gossip.clone(),
        inner.transport.clone(),
        inner.config.gossip_interval,
        inner.shutdown.clone(),
    ));
    Ok(ClusterHandle { inner })
}

type ClusterFoca = Foca<MemberId, BincodeCodec, foca_rand::rngs::SmallRng, StatsHandler>;

async fn run_foca(inner: Arc<Inner>, mut foca: ClusterFoca, mut rx: mpsc::Receiver<FocaInput>) {
    let mut rt = AccumulatingRuntime::new();
    announce_to_seeds(&inner, &mut foca, &mut rt);
    drain(&inner, &mut foca, &mut rt);
    let mut reannounce = tokio::time::interval(inner.config.swim.announce_period);
    reannounce.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    reannounce.tick().await;
    loop {
        tokio::select! {
            biased;
            _ = inner.shutdown.cancelled() => {
                let _ = foca.leave_cluster(&mut rt);
                drain(&inner, &mut foca, &mut rt);
                flush_and_close(&inner).await;
                return;
            }
            input = rx.recv() => {
                let Some(input) = input else { return };
                match input {
                    FocaInput::Data { from, conn, data } => {
                        handle_data(&inner, &mut foca, &mut rt, &from, &conn, &data)
                    }
                    FocaInput::Timer(t) => {
                        if let Err(e) = foca.handle_timer(t, &mut rt) {
                            tracing::debug!("foca timer: {e}");
                        }
                    }
                    FocaInput::AnnounceTo(node, conn) => {
                        announce_to_member(&inner, &mut foca, &mut rt, &node, &conn)
                    }
                    FocaInput::Broadcast(b) => {
                        if let Err(e) = foca.add_broadcast(&b) {
                            tracing::debug!("foca broadcast: {e}");
                        } else {
                            let _ = foca.broadcast(&mut rt);
                        }
                    }
                    FocaInput::Leave(done) => {
                        let _ = foca.leave_cluster(&mut rt);
                        drain(&inner, &mut foca, &mut rt);
                        flush_and_close(&inner).await;
                        inner.shutdown.cancel();
                        let _ = done.send(());
                        return;
                    }
                }
            }
            _ = reannounce.tick() => {
                inner
                    .peers
                    .forget_down(Instant::now(), inner.config.swim.remove_down_after);
                // Dial state of addresses no longer being dialed (failed dials past
                // their backoff among them) goes too, or every address ever dialed
                // would keep an entry.
                inner.transport.conns.prune_dials();
                if foca.num_members() == 0 {
                    // Alone: the seeds may be back, and so may members we saw go down
                    // (a node with no seeds has only those to rejoin through).
                    announce_to_known(&inner, &mut foca, &mut rt);
                }
            }
        }
        // Renewing the identity makes foca ask for more work: bounded, as renewing
        // cannot by itself make foca declare us down again.
        for _ in 0..3 {
            match drain(&inner, &mut foca, &mut rt) {
                SelfState::Fine => break,
                SelfState::Defunct => renew_identity(&inner, &mut foca, &mut rt),
                SelfState::Rejoined => announce_to_known(&inner, &mut foca, &mut rt),
            }
        }
    }
}

/// What foca's notifications said about this node's own identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SelfState {
    /// Nothing to do.
    Fine,
    /// foca renewed the identity itself (declared down, `Notification::Rejoin`): tell
    /// everyone we know, not just whoever foca picks.
    Rejoined,
    /// foca gave up on the identity (`Notification::Defunct`): renew it ourselves.
    Defunct,
}

/// A node must never stay defunct: take a new generation and rejoin through the seeds
/// and every member we know (foca 2.0's intended pattern: `Identity::renew` +
/// `Foca::change_identity`, then announce).
fn renew_identity(
    inner: &Arc<Inner>,
    foca: &mut ClusterFoca,
    rt: &mut AccumulatingRuntime<MemberId>,
) {
    let current = foca.identity().clone();
    let next = MemberId {
        generation: current.generation.saturating_add(1),
        ..current
    };
    match foca.change_identity(next.clone(), &mut *rt) {
        Ok(()) => {
            tracing::warn!(generation = next.generation, "declared down; rejoining");
            inner.log(MembershipEvent::Rejoined(next.generation));
            *inner.me.lock() = next;
            *inner.renewed_at.lock() = Some(Instant::now());
            announce_to_known(inner, foca, rt);
        }
        Err(e) => tracing::warn!("renewing the identity failed: {e}"),
    }
}

/// Announce to the seeds and to every member foca remembers, down ones included.
fn announce_to_known(
    inner: &Arc<Inner>,
    foca: &mut ClusterFoca,
    rt: &mut AccumulatingRuntime<MemberId>,
) {
    announce_to_seeds(inner, foca, rt);
    let seeds = &inner.config.seeds;
    let known: Vec<MemberId> = foca
        .iter_membership_state()
        .map(|m| m.id().clone())
        .filter(|id| id.node != inner.node_id && !seeds.contains(&id.addr))
        .collect();
    for id in known {
        if let Err(e) = foca.announce(id, &mut *rt) {
            tracing::debug!("announce: {e}");
        }
    }
}

/// A SWIM packet to `node` now (an announce: the one message foca sends to a member
/// of our choosing), on `conn`, the connection this node just dialed it on for
/// streams: the peer holds what arrives on an inbound connection until a SWIM packet
/// on that connection claims the sender's address (docs/cluster.md, "Identity"). Sent
/// on `conn` itself, not on whichever connection the peer table names for the node by
/// the time this runs (a claim of the peer's on another connection may have replaced
/// it). Nothing when foca does not hold the node as active.
fn announce_to_member(
    inner: &Arc<Inner>,
    foca: &mut ClusterFoca,
    rt: &mut AccumulatingRuntime<MemberId>,
    node: &NodeId,
    conn: &quinn::Connection,
) {
    let member = foca
        .iter_membership_state()
        .find(|m| m.id().node == *node && m.state() != foca::State::Down)
        .map(|m| m.id().clone());
    let Some(member) = member else { return };
    if let Err(e) = foca.announce(member.clone(), &mut *rt) {
        tracing::debug!(peer = %node, "announce: {e}");
        return;
    }
    // The run loop drains after every input, so what is queued now is the announce's
    // own packet; anything else goes out the usual way.
    while let Some((dst, bytes)) = rt.to_send() {
        if !may_send_swim(inner, foca, &dst, &bytes) {
            continue;
        }
        if dst == member {
            transport::send_swim_on(&inner.transport, conn, &dst, bytes);
        } else {
            transport::send_swim(&inner.transport, dst, bytes);
        }
    }
}

/// Whether a SWIM packet foca wants sent to `dst` goes out: not a spurious
/// turn-undead, and not to a claim the peer table refused.
fn may_send_swim(inner: &Arc<Inner>, foca: &ClusterFoca, dst: &MemberId, bytes: &[u8]) -> bool {
    if is_spurious_turn_undead(foca, dst, bytes) {
        ClusterMetrics::bump(&inner.metrics.spurious_turn_undead_dropped);
        return false;
    }
    // foca may hold a refused claim it heard of second-hand (this node, or a live
    // peer's id at another address): nothing goes to it, and the connection to the
    // genuine node is not used to reach it. Seeds (no node id yet) always go.
    dst.node.0.is_empty()
        || inner.peers.claim(&inner.node_id, &dst.node, dst.addr) == Claim::Accepted
}

fn announce_to_seeds(
    inner: &Arc<Inner>,
    foca: &mut ClusterFoca,
    rt: &mut AccumulatingRuntime<MemberId>,
) {
    for seed in &inner.config.seeds {
        if *seed == inner.config.advertise {
            continue;
        }
        if let Err(e) = foca.announce(MemberId::seed(*seed), &mut *rt) {
            tracing::debug!(%seed, "announce: {e}");
        }
    }
}

fn handle_data(
    inner: &Arc<Inner>,
    foca: &mut ClusterFoca,
    rt: &mut AccumulatingRuntime<MemberId>,
    from: &NodeId,
    conn: &quinn::Connection,
    data: &[u8],
) {
    // The TLS peer must be who the packet claims to come from: a node may only speak
    // for itself.
    let header = match foca::Codec::decode_header(&mut BincodeCodec, data) {
        Ok(h) if h.src.node == *from => h,
        Ok(_) => {
            ClusterMetrics::bump(&inner.metrics.spoofed_received);
            return;
        }
        Err(_) => {
            ClusterMetrics::bump(&inner.metrics.malformed_received);
            return;
        }
    };
    // And the id must not be held alive at another address: a second process with
    // the same certificate stays out of SWIM altogether; nor may the address be held
    // alive by another id, which foca would replace (docs/cluster.md, "Identity").
    let src = &header.src;
    match inner.peers.sender_claim(&inner.node_id, from, src.addr) {
        Claim::Accepted => {
            // Credited only now, its kind byte counted: a datagram that is refused is
            // no one's traffic but the transport's (`swim_bytes_received`).
            inner.peers.add_bytes(from, 0, data.len() as u64 + 1);
            inner.transport.bind_inbound(conn, src);
            // A peer sends SWIM only to a claim it accepted (`may_send_swim`): one
            // that refused this node's id takes it now.
            if inner.own_id_refusals.accepted_by(from) {
                tracing::info!(node = %inner.node_id, peer = %from, "a peer that refused this node's id takes it now");
            }
        }
        refused => {
            inner.transport.refuse(from, conn);
            // The process behind the connection is told, once per connection, that
            // the id is alive elsewhere and where: it has no other way to learn it.
            if let Claim::Conflict { bound } = refused {
                if inner.transport.tell_held_elsewhere(from, conn, bound) {
                    tracing::debug!(peer = %from, claimed_from = %src.addr, alive_at = %bound, "connection of a refused claim closed, telling it where the id is alive");
                }
            }
            inner.refused(src, refused);
            return;
        }
    }
    // foca takes an announce only when addressed to the address this node advertises,
    // and drops the others without a word: a peer that seeds this node at another
    // address (one that reaches it) re-announces for ever, and neither side says why.
    if header.message == foca::Message::Announce && header.dst.addr != foca.identity().addr {
        ClusterMetrics::bump(&inner.metrics.misaddressed_announces);
        if inner
            .refusals_logged
            .lock()
            .first((from.clone(), header.dst.addr), Instant::now())
        {
            tracing::warn!(
                peer = %from,
                seeded_at = %header.dst.addr,
                advertised = %foca.identity().addr,
                "a peer announces to this node at an address it does not advertise, which SWIM ignores: \
                 seed it at the advertised address (listen.advertise_quic), and map that to the one \
                 that reaches it with cluster.dial_overrides on the peer"
            );
        }
        return;
    }
    // foca renews its identity on any "you were declared down" for it, and every
    // renewal makes each peer forget this node's summaries and cut the forwards it has
    // in flight here. A member that declares the identity just renewed down sooner
    // than a suspicion can take (probe, indirect probe, suspicion timeout) is not
    // reporting a suspicion: one member with a certificate made this node renew at
    // every packet.
    if header.message == foca::Message::TurnUndead && header.dst == *foca.identity() {
        let window = inner.config.swim.probe_period + inner.config.swim.suspect_to_down_after;
        if inner
            .renewed_at
            .lock()
            .is_some_and(|at| at.elapsed() < window)
        {
            ClusterMetrics::bump(&inner.metrics.spurious_turn_undead_dropped);
            tracing::debug!(peer = %from, "declared down just after renewing: ignored");
            return;
        }
    }
    forget_outranking_down_identity(foca, rt, src);
    let kept = drop_relayed_address_claims(inner, foca, &header, data);
    if let Err(e) = foca.handle_data(kept.as_deref().unwrap_or(data), &mut *rt) {
        ClusterMetrics::bump(&inner.metrics.malformed_received);
        tracing::debug!(peer = %from, "swim packet refused: {e}");
    }
}

/// `data` without the membership updates it relays that would replace the member foca
/// holds at an address (alive, suspect or down) with another identity: another node
/// id, or the same id under a newer generation (`identity::displaced_by_relayed`);
/// `None` when it relays none. Each under another node id is counted in
/// `identity_conflicts` and warned about once per claimed id and address; one under
/// the held id (most likely a restart heard of before its own word) only logged at
/// debug level.
///
/// Why: a relayed update is no one's own word, and foca keys members by address: one
/// forged update took a live node out of membership for as long as the relaying member
/// kept the phantom alive. Not "until the holder is suspected or down": a member can
/// relay that suspicion or "down" first, and the genuine node's own answer to the
/// forgery (foca declares another identity at its address down and gossips that) is
/// such an update too. A restarted node, or a new node at a dead node's address, is
/// taken from its own SWIM packets instead (the latter once this node holds the old
/// one down, `PeerTable::sender_claim`): it announces itself to every peer it dials
/// for gossip, so within a gossip round (docs/cluster.md, "Identity").
fn drop_relayed_address_claims(
    inner: &Arc<Inner>,
    foca: &ClusterFoca,
    header: &foca::Header<MemberId>,
    data: &[u8],
) -> Option<Vec<u8>> {
    // foca reads the updates only of a packet addressed to this identity.
    if header.dst != *foca.identity() {
        return None;
    }
    let mut refused = Vec::new();
    let kept = identity::without_updates(data, |update| {
        let holder = identity::displaced_by_relayed(foca.iter_membership_state(), update.id());
        if let Some(holder) = holder {
            refused.push((update.id().clone(), holder.node.clone()));
        }
        holder.is_some()
    });
    let now = Instant::now();
    for (claim, holder) in refused {
        if claim.node == holder {
            // Most likely a restart heard of before its own word, which comes within a
            // gossip round: routine, not a conflict.
            tracing::debug!(peer = %claim.node, generation = claim.generation, relayed_by = %header.src.node, "a relayed new identity of a held member; waiting for its own word");
            continue;
        }
        ClusterMetrics::bump(&inner.metrics.identity_conflicts);
        if inner
            .refusals_logged
            .lock()
            .first((claim.node.clone(), claim.addr), now)
        {
            tracing::warn!(
                peer = %claim.node,
                claimed_at = %claim.addr,
                held_by = %holder,
                relayed_by = %header.src.node,
                "a member relays another identity at the address of a member held here; \
                 not believed until it claims the address itself"
            );
        }
    }
    kept
}

/// Let go of the down identity foca holds at `src`'s address for `src`'s own node id
/// when it outranks `src` (a higher generation), so that foca takes `src` as the
/// node's new identity rather than a stale one.
///
/// Why: the generation is the wall clock at start, and a node restarted at its address
/// on a clock that reads earlier than its previous run's start (a clock stepped back,
/// the host replaced) has an older generation than the identity its peers declared
/// down there. foca's address conflict goes to the higher generation, so it answered
/// every packet of the restarted node with "you are down", and the node renewed
/// (generation + 1) again and again, still below: out of the cluster until foca
/// dropped the old identity `remove_down_after` (60 s) after declaring it down.
/// Measured live: a node restarted under `faketime -30m` rejoined 63 s after its kill.
/// `src` is the TLS-authenticated sender and the peer table accepted its claim; a
/// restart at the same address is the same claim ("Identity" in docs/cluster.md).
/// Only a down identity is let go, so a live node is never replaced this way.
fn forget_outranking_down_identity(
    foca: &mut ClusterFoca,
    rt: &mut AccumulatingRuntime<MemberId>,
    src: &MemberId,
) {
    let stale = foca
        .iter_membership_state()
        .find(|m| {
            let id = m.id();
            m.state() == foca::State::Down
                && id.addr == src.addr
                && id.node == src.node
                && id.generation > src.generation
        })
        .map(|m| m.id().clone());
    if let Some(stale) = stale {
        tracing::info!(
            peer = %src.node,
            down_generation = stale.generation,
            generation = src.generation,
            "a peer restarted at its address with an older generation (its clock behind its previous run's); its down identity is let go"
        );
        // `RemoveDown` removes a member only while it is down: what foca's own timer
        // would do `remove_down_after` later.
        if let Err(e) = foca.handle_timer(Timer::RemoveDown(stale), &mut *rt) {
            tracing::debug!(peer = %src.node, "forgetting a down identity: {e}");
        }
    }
}

/// Carry out what foca asked for: sends, timers, notifications; says whether this
/// node's own identity needs attention.
fn drain(
    inner: &Arc<Inner>,
    foca: &mut ClusterFoca,
    rt: &mut AccumulatingRuntime<MemberId>,
) -> SelfState {
    let mut self_state = SelfState::Fine;
    while let Some((dst, bytes)) = rt.to_send() {
        if may_send_swim(inner, foca, &dst, &bytes) {
            transport::send_swim(&inner.transport, dst, bytes);
        }
    }
    while let Some((after, timer)) = rt.to_schedule() {
        let tx = inner.foca_tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            let _ = tx.send(FocaInput::Timer(timer)).await;
        });
    }
    while let Some(n) = rt.to_notify() {
        let now = Instant::now();
        match n {
            OwnedNotification::MemberUp(m) => member_up(inner, &m, now),
            OwnedNotification::MemberDown(m) => member_down(inner, foca, &m, now),
            // foca keys members by address (`Identity::Addr`): a member with another
            // node id and a higher generation at a known address replaces the member
            // there, and foca says only `Rename` (plus `MemberUp` / `MemberDown` for the
            // new one when liveness changed). The old node is gone from foca's view,
            // never probed again: it is down here too, and the new one is up if foca
            // holds it active. (`member_up` is idempotent: a `MemberUp(new)` that
            // follows changes nothing.) A new node at a dead node's address (a
            // re-provisioned host, a reused pod IP) takes its place this way from its
            // own SWIM packets, which `handle_data` refuses while the old node is alive
            // here (`PeerTable::sender_claim`); heard of second-hand, it is not
            // believed (`drop_relayed_address_claims`), nor is a relayed restart.
            //
            // Why not `Addr = (NodeId, SocketAddr)`, so that different ids never
            // conflict: seeds are announced to with a placeholder identity that has no
            // node id (`MemberId::seed`), and foca takes an announce only when its
            // `dst.addr()` equals its own `addr()`; keyed by id, no join through a seed
            // would work, and foca's handling of updates about another identity at
            // this node's own address would change with it.
            OwnedNotification::Rename(old, new) if old.node != new.node => {
                member_down(inner, foca, &old, now);
                let active = foca
                    .iter_membership_state()
                    .any(|c| *c.id() == new && c.state() != foca::State::Down);
                if active {
                    member_up(inner, &new, now);
                }
            }
            OwnedNotification::Rename(_, new) => {
                if inner.peers.is_alive(&new.node) {
                    match inner.peers.member_up(&inner.node_id, &new, now) {
                        Claim::Accepted => {
                            seed_rtt(inner, &new.node);
                            inner.log(MembershipEvent::Renamed(new.node.clone(), new.generation));
                            // A new incarnation holds nothing of ours: start it with a
                            // snapshot.
                            inner.gossip.peer_joined(&new.node);
                        }
                        refused => inner.refused(&new, refused),
                    }
                }
            }
            OwnedNotification::Rejoin(id) => {
                inner.log(MembershipEvent::Rejoined(id.generation));
                *inner.me.lock() = id;
                *inner.renewed_at.lock() = Some(Instant::now());
                self_state = self_state.max_with(SelfState::Rejoined);
            }
            // Also what foca says after our own `leave_cluster`; the callers that leave
            // stop right after and ignore it.
            OwnedNotification::Defunct => self_state = SelfState::Defunct,
            OwnedNotification::Active | OwnedNotification::Idle => {}
        }
    }
    let _ = foca;
    self_state
}

/// foca says `member` is up: it becomes a routing candidate unless its claim to the
/// node id is refused. Nothing when the table holds it alive already (a rename to
/// another id brings it up, and foca may say so too).
fn member_up(inner: &Arc<Inner>, member: &MemberId, now: Instant) {
    if inner.peers.holds_alive(member) {
        return;
    }
    match inner.peers.member_up(&inner.node_id, member, now) {
        Claim::Accepted => {
            seed_rtt(inner, &member.node);
            inner.log(MembershipEvent::Up(member.node.clone(), member.generation));
            inner.gossip.peer_joined(&member.node);
        }
        refused => inner.refused(member, refused),
    }
}

/// foca says `member` is down (or replaced it with another id at its address): it is
/// no routing candidate any more, unless the table holds another claim to the id.
fn member_down(inner: &Arc<Inner>, foca: &ClusterFoca, member: &MemberId, now: Instant) {
    if !inner.peers.member_down(member, now) {
        return;
    }
    inner.log(MembershipEvent::Down(
        member.node.clone(),
        member.generation,
    ));
    // Another process may have claimed the id meanwhile (a node restarted elsewhere
    // before its old self was declared down): foca holds it alive, and will not say so
    // again.
    let next = foca
        .iter_membership_state()
        .find(|c| {
            c.id().node == member.node
                && c.id().addr != member.addr
                && c.state() != foca::State::Down
        })
        .map(|c| c.id().clone());
    if let Some(next) = next {
        member_up(inner, &next, now);
    }
}

/// foca 2.0 sends `TurnUndead` ("you were declared down") when a suspicion timer
/// fires even if the suspect refuted in time and is still active in its own view (the
/// refutation fails the timer's incarnation check, but the courtesy message goes out
/// regardless). The receiver then renews its identity for nothing: under CPU load,
/// where refutations come late but in time, that is a stream of needless rejoins. Such
/// a message is dropped here; a `TurnUndead` to a member foca does hold as down (or no
/// longer knows) still goes out.
fn is_spurious_turn_undead(foca: &ClusterFoca, dst: &MemberId, packet: &[u8]) -> bool {
    let Ok(header) = foca::Codec::decode_header(&mut BincodeCodec, packet) else {
        return false;
    };
    header.message == foca::Message::TurnUndead
        && foca
            .iter_membership_state()
            .any(|m| m.id() == dst && m.state() != foca::State::Down)
}

impl SelfState {
    /// Defunct outranks Rejoined outranks Fine.
    fn max_with(self, other: SelfState) -> SelfState {
        match (self, other) {
            (SelfState::Defunct, _) | (_, SelfState::Defunct) => SelfState::Defunct,
            (SelfState::Rejoined, _) | (_, SelfState::Rejoined) => SelfState::Rejoined,
            _ => SelfState::Fine,
        }
    }
}

/// A peer that just came up has a connection (SWIM ran over it): seed its RTT from
/// quinn's estimate (handshake RTT at first) so cost-based routing can use it now.
fn seed_rtt(inner: &Inner, node: &NodeId) {
    if let Some(c) = inner.transport.conns.get(node) {
        inner.peers.seed_rtt(node, c.rtt().as_secs_f64() * 1000.0);
    }
}

/// Give queued SWIM datagrams (the leave notice) a moment to go out, then close.
async fn flush_and_close(inner: &Inner) {
    for _ in 0..20 {
        let pending = inner.transport.conns.all().iter().any(|(_, c)| {
            c.close_reason().is_none() && c.datagram_send_buffer_space() < 256 * 1024
        });
        if !pending {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // One more short pause: a datagram out of the buffer may still sit in quinn's
    // packet queue.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let endpoint = inner.transport.take_endpoint();
    if let Some(endpoint) = endpoint {
        endpoint.close(0u32.into(), b"leave");
        // quinn's driver keeps the socket until every endpoint clone is gone and the
        // closing connections have drained.
        let _ = tokio::time::timeout(CLOSE_DRAIN, endpoint.wait_idle()).await;
    }
    inner.transport.conns.clear();
    inner.closed.cancel();
}

impl Inbound for Inner {
    fn swim(&self, from: NodeId, conn: quinn::Connection, data: Bytes) {
        if self
            .foca_tx
            .try_send(FocaInput::Data { from, conn, data })
            .is_err()
        {
            tracing::debug!("swim inbox full; packet dropped");
        }
    }

    fn gossip(&self, from: &NodeId, frame: &[u8]) {
        crate::gossip::handle_frame(&self.gossip, &self.transport, from, frame);
    }

    fn app(&self, msg: AppMessage) {
        if self.app_tx.try_send(msg).is_err() {
            tracing::debug!("app inbox full or closed; message dropped");
        }
    }

    fn dialed(&self, peer: &NodeId, conn: &quinn::Connection) {
        if self
            .foca_tx
            .try_send(FocaInput::AnnounceTo(peer.clone(), conn.clone()))
            .is_err()
        {
            tracing::debug!(%peer, "swim inbox full; announce on the new connection skipped");
        }
    }

    fn own_id_refused(&self, by: &NodeId, held_at: SocketAddr) {
        // A peer that says this node's id is alive at this node's own address says
        // nothing that can be true of another process: not believed.
        if held_at == self.config.advertise {
            ClusterMetrics::bump(&self.metrics.malformed_received);
            return;
        }
        ClusterMetrics::bump(&self.metrics.own_id_refused);
        let ttl = self.refusal_ttl();
        if self
            .own_id_refusals
            .record(by, held_at, Instant::now(), ttl)
        {
            tracing::error!(
                node = %self.node_id,
                advertised = %self.config.advertise,
                refused_by = %by,
                alive_at = %held_at,
                "peer {by} refuses this node: it holds node id {} alive at {held_at}. Another \
                 process runs with this node's id (a copied config or certificate?), and this \
                 one stays out of the cluster while it does; stop one of them. (A node \
                 restarted at a new address before its previous run was declared down is \
                 refused only until then.)",
                self.node_id
            );
        }
    }

    fn forward(&self, fwd: IncomingForward) {
        if let Err(e) = self.forward_tx.try_send(fwd) {
            // Dropping the streams resets them: the origin retries locally.
            let peer = match &e {
                mpsc::error::TrySendError::Full(f) | mpsc::error::TrySendError::Closed(f) => {
                    f.from.clone()
                }
            };
            tracing::debug!(%peer, "forward inbox full or closed; stream refused");
        }
    }
}

/// Membership events a node keeps for [`ClusterHandle::membership_log`]: a long-lived
/// node in a churning cluster (or a member relaying made-up ones) must not grow the log
/// without end.
pub const MAX_MEMBERSHIP_EVENTS: usize = 4096;

impl Inner {
    /// How long a refusal of this node's id is held after the last one
    /// ([`REFUSAL_TTL_ANNOUNCE_PERIODS`]).
    fn refusal_ttl(&self) -> Duration {
        self.config
            .swim
            .announce_period
            .saturating_mul(REFUSAL_TTL_ANNOUNCE_PERIODS)
    }

    fn log(&self, e: MembershipEvent) {
        tracing::info!(node = %self.node_id, event = ?e, "membership");
        let mut events = self.events.lock();
        if events.len() >= MAX_MEMBERSHIP_EVENTS {
            events.pop_front();
        }
        events.push_back((self.started.elapsed(), e));
        drop(events);
        self.membership_tx.send_modify(|n| *n += 1);
    }

    /// Count and log a refused claim to a node id (loudly when it is this node's own:
    /// another process runs with this node's certificate). This node goes on either
    /// way.
    fn refused(&self, claim: &MemberId, why: Claim) {
        let first = {
            self.refusals_logged
                .lock()
                .first((claim.node.clone(), claim.addr), Instant::now())
        };
        match why {
            Claim::Accepted => {}
            Claim::Ours => {
                ClusterMetrics::bump(&self.metrics.own_id_claimed);
                if first {
                    tracing::error!(
                        node = %self.node_id,
                        claimed_from = %claim.addr,
                        region = %claim.region,
                        "another process claims this node's id (same certificate?); refused, this node keeps it"
                    );
                }
            }
            Claim::Full => {
                ClusterMetrics::bump(&self.metrics.malformed_received);
                if first {
                    tracing::warn!(
                        peer = %claim.node,
                        claimed_from = %claim.addr,
                        max = crate::state::MAX_PEERS,
                        "a new member with the membership table full; refused"
                    );
                }
            }
            Claim::Invalid => {
                ClusterMetrics::bump(&self.metrics.malformed_received);
                if first {
                    tracing::warn!(
                        peer = %claim.node,
                        claimed_from = %claim.addr,
                        "a member with an id no node can have; refused"
                    );
                }
            }
            Claim::Conflict { bound } => {
                ClusterMetrics::bump(&self.metrics.identity_conflicts);
                if first {
                    tracing::warn!(
                        peer = %claim.node,
                        claimed_from = %claim.addr,
                        region = %claim.region,
                        alive_at = %bound,
                        "node id claimed from a second address while alive at its first; refused"
                    );
                }
            }
            Claim::AddressTaken { holder } => {
                ClusterMetrics::bump(&self.metrics.identity_conflicts);
                if first {
                    tracing::warn!(
                        peer = %claim.node,
                        claimed_from = %claim.addr,
                        region = %claim.region,
                        alive_there = %holder,
                        "address claimed under another node id while the node there is alive; refused until it is declared down"
                    );
                }
            }
        }
    }
}

/// A queue-stats broadcast: small, ordered per origin by [`QueueStats::order`]. A
/// receiver takes it only from its origin and does not relay it (`StatsHandler`); it
/// names the address its origin advertises, and is dropped when the id is bound
/// alive elsewhere (an impostor's).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StatsBroadcast {
    origin: NodeId,
    addr: SocketAddr,
    stats: QueueStats,
}

/// Key under which foca disseminates a stats broadcast: newer stats from the same
/// origin (a newer run's, whatever their version) replace older ones still in the
/// backlog.
#[derive(Debug, Clone, PartialEq, Eq)]
struct StatsKey {
    origin: NodeId,
    /// Each engine's stats are their own stream (docs/design.md, "Replicas").
    replica: u16,
    order: (u64, u64),
}

impl Invalidates for StatsKey {
    fn invalidates(&self, other: &Self) -> bool {
        self.origin == other.origin
            && self.order > other.order
            && (self.replica == other.replica || self.order.0 > other.order.0)
    }
}

/// Decode error of a stats broadcast.
#[derive(Debug, thiserror::Error)]
#[error("stats broadcast: {0}")]
struct StatsError(String);

struct StatsHandler {
    inner: std::sync::Weak<Inner>,
}

fn stats_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_STATS_BROADCAST>()
}

impl BroadcastHandler<MemberId> for StatsHandler {
    type Key = StatsKey;
    type Error = StatsError;

    fn receive_item(
        &mut self,
        data: &[u8],
        sender: Option<&MemberId>,
    ) -> Result<Option<StatsKey>, StatsError> {
        if data.len() > MAX_STATS_BROADCAST {
            return Err(StatsError(format!(
                "{} bytes over {MAX_STATS_BROADCAST}",
                data.len()
            )));
        }
        let (b, _): (StatsBroadcast, usize) =
            bincode::serde::decode_from_slice(data, stats_config())
                .map_err(|e| StatsError(e.to_string()))?;
        let key = StatsKey {
            origin: b.origin.clone(),
            replica: b.stats.replica,
            order: b.stats.order(),
        };
        let Some(inner) = self.inner.upgrade() else {
            return Ok(None);
        };
        let Some(sender) = sender else {
            // Our own, added through `broadcast_stats`.
            return Ok(Some(key));
        };
        if sender.node != b.origin {
            // Forged: the packet's sender is authenticated (its TLS peer, `handle_data`),
            // the origin it names is not. A copy from anyone but its origin could speak
            // for any node (draining, a run that never ends, a queue that pulls
            // traffic), so copies are neither kept nor relayed (below): each node's
            // stats reach its peers on its own packets, and ride on every summary
            // message of its own stream.
            ClusterMetrics::bump(&inner.metrics.spoofed_received);
            return Ok(None);
        }
        if b.origin == inner.node_id {
            // Ours from a previous run, or another process's with our id: not a peer.
            return Ok(None);
        }
        if let Claim::Conflict { bound } = inner.peers.claim(&inner.node_id, &b.origin, b.addr) {
            ClusterMetrics::bump(&inner.metrics.identity_conflicts);
            tracing::debug!(origin = %b.origin, claimed_from = %b.addr, alive_at = %bound, "stats broadcast of a refused claim dropped");
            return Ok(None);
        }
        let now = Instant::now();
        // The first broadcast of the identity membership accepted vouches for its
        // run, whatever its incarnation (docs/cluster.md, "Incarnations"): foca
        // handed it from an active member, and `sender` is that member's identity.
        inner.peers.vouch_run(sender, b.stats.incarnation);
        inner.peers.offer_stats(&b.origin, &b.stats, now);
        Ok(None)
    }
}

impl ClusterHandle {
    /// This node's id.
    pub fn node_id(&self) -> &NodeId {
        &self.inner.node_id
    }

    /// This node's current SWIM identity (the generation grows on rejoin).
    pub fn identity(&self) -> MemberId {
        self.inner.me.lock().clone()
    }

    /// This run of the process: the wall clock at start, ms, on every stats copy and
    /// so on every summary message it sends. A restarted node has a newer one, which
    /// makes its peers drop what they held of the previous run at once.
    pub fn incarnation(&self) -> u64 {
        self.inner.incarnation
    }

    /// The peers refusing this node's claim to its own id now, and where each holds
    /// the id alive: empty unless another process runs with this node's id (or this
    /// node restarted at a new address before its previous run was declared down).
    /// Why: the refused process learns no member and would otherwise serve as a
    /// one-node island with nothing saying why (docs/cluster.md, "Identity").
    pub fn identity_refusals(&self) -> Vec<IdentityRefusal> {
        self.inner
            .own_id_refusals
            .current(Instant::now(), self.inner.refusal_ttl())
    }

    /// The local address of the QUIC endpoint.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.inner.transport.endpoint()?.local_addr()?)
    }

    /// Every known peer, alive or not, sorted by id.
    pub fn peers(&self) -> Vec<PeerView> {
        self.inner.peers.views(Instant::now())
    }

    /// Ids of the peers that are routing candidates now, sorted.
    pub fn alive_peers(&self) -> Vec<NodeId> {
        self.inner.peers.alive_ids()
    }

    /// Run `f` on the summary of `peer`'s engine `replica` while holding its table
    /// shard briefly: for routing, keep `f` short (a prefix walk), never IO.
    pub fn with_peer_summary<R>(
        &self,
        peer: &NodeId,
        replica: u16,
        f: impl FnOnce(&PeerSummary) -> R,
    ) -> Option<R> {
        let e = self.inner.peers.peers.get(peer)?;
        e.engines.get(replica as usize)?.gossip.summary().map(f)
    }

    /// The local summary this cluster gossips for engine 0 (the one `start` took).
    pub fn local_summary(&self) -> Arc<dyn SummarySource> {
        self.inner
            .gossip
            .summary(0)
            .expect("engine 0 is gossiped from the start")
    }

    /// The summary gossiped for this node's engine `replica`, when it is.
    pub fn engine_summary(&self, replica: u16) -> Option<Arc<dyn SummarySource>> {
        self.inner.gossip.summary(replica)
    }

    /// Gossip `summary` as this node's engine `replica` (a replica added at run time,
    /// or the engines after the first at start), replacing what that replica
    /// gossiped: peers get a snapshot of it on the next round. Its stats follow with
    /// [`broadcast_stats`](Self::broadcast_stats). Versions only grow within a run:
    /// a peer keeps what it holds of the replica against a snapshot of a lower
    /// version, so a summary that replaces another must continue its versions (the
    /// node never replaces one: it does not reuse replica numbers). Refused for a
    /// replica that left in this run ([`remove_engine`](Self::remove_engine)).
    pub fn set_engine(&self, replica: u16, summary: Arc<dyn SummarySource>) -> Result<()> {
        if replica >= gorgo_core::types::MAX_REPLICAS {
            return Err(ClusterError::Config {
                field: "replica",
                reason: format!("must be below {}", gorgo_core::types::MAX_REPLICAS),
            });
        }
        if !self.inner.gossip.set_engine(replica, summary) {
            return Err(ClusterError::Config {
                field: "replica",
                reason: format!(
                    "engine {replica} left in this run; a replica number is not reused"
                ),
            });
        }
        Ok(())
    }

    /// This node fronts engine `replica` no more (removed at run time, its requests
    /// done): its stream ends with stats that say so
    /// ([`gorgo_core::gossip::LEFT_VERSION`]), sent to each peer on its summary
    /// stream until it takes them and as a SWIM copy now, on which peers let go of
    /// the engine: it leaves their table and views. Nothing else of it is sent from
    /// now on (before, its last stats and summary went out every round for the rest
    /// of the run, and every peer listed a phantom replica). Errors for a replica
    /// not gossiped, or one that left already.
    pub fn remove_engine(&self, replica: u16) -> Result<()> {
        let Some(last) = self.inner.gossip.end_engine(replica) else {
            return Err(ClusterError::Config {
                field: "replica",
                reason: format!("engine {replica} is not gossiped"),
            });
        };
        self.broadcast_swim(last)
    }

    /// Open a bi-stream to `peer` to forward a request.
    pub async fn open_forward(
        &self,
        peer: &NodeId,
    ) -> Result<(quinn::SendStream, quinn::RecvStream)> {
        let conn = match self.inner.transport.conns.get(peer) {
            Some(c) => c,
            None => {
                let addr = self
                    .inner
                    .peers
                    .peers
                    .get(peer)
                    .map(|e| e.member.addr)
                    .ok_or_else(|| ClusterError::UnknownPeer(peer.clone()))?;
                transport::connect(
                    &self.inner.transport,
                    Some(peer),
                    addr,
                    transport::DialFor::Streams,
                )
                .await?
            }
        };
        Ok(conn.open_bi().await?)
    }

    /// The receiver of bi-streams peers open to forward requests here (once: the
    /// first caller takes it).
    pub fn incoming_forwards(&self) -> Option<mpsc::Receiver<IncomingForward>> {
        self.inner.forward_rx.lock().take()
    }

    /// The receiver of application messages (once: the first caller takes it).
    pub fn app_inbox(&self) -> Option<mpsc::Receiver<AppMessage>> {
        self.inner.app_rx.lock().take()
    }

    /// Send an application message to one peer (reliable, on a uni-stream).
    pub async fn send_to(&self, peer: &NodeId, kind: u8, payload: &[u8]) -> Result<()> {
        if payload.len() > MAX_APP_MESSAGE {
            return Err(ClusterError::TooLarge {
                size: payload.len(),
                limit: MAX_APP_MESSAGE,
            });
        }
        let mut frame = Vec::with_capacity(payload.len() + 2);
        frame.push(STREAM_APP);
        frame.push(kind);
        frame.extend_from_slice(payload);
        transport::send_uni(&self.inner.transport, peer, TrafficKind::App, &frame).await
    }

    /// Send an application message to every alive peer; returns how many got it.
    pub async fn broadcast(&self, kind: u8, payload: &[u8]) -> Result<usize> {
        let mut sent = 0;
        for peer in self.alive_peers() {
            match self.send_to(&peer, kind, payload).await {
                Ok(()) => sent += 1,
                Err(ClusterError::TooLarge { size, limit }) => {
                    return Err(ClusterError::TooLarge { size, limit })
                }
                Err(e) => tracing::debug!(%peer, "app broadcast: {e}"),
            }
        }
        Ok(sent)
    }

    /// Publish this node's queue stats: a foca broadcast now, and attached to every
    /// summary message. The version is assigned here (monotonic for this run), and so
    /// are this run's incarnation and whether the node is draining.
    pub fn broadcast_stats(&self, mut stats: QueueStats) -> Result<()> {
        stats.draining = stats.draining || self.is_draining();
        if !self.inner.gossip.set_stats(&mut stats) {
            return Err(ClusterError::Config {
                field: "replica",
                reason: format!(
                    "engine {} is not gossiped (`set_engine` first), or has left",
                    stats.replica
                ),
            });
        }
        self.broadcast_swim(stats)
    }

    /// The SWIM copy of `stats` (their version set by the gossip driver): a foca
    /// broadcast now.
    fn broadcast_swim(&self, mut stats: QueueStats) -> Result<()> {
        // The SWIM copy is capped small ([`MAX_STATS_BROADCAST`]): it leaves the model
        // list to the summary messages, and receivers keep the models they hold.
        stats.models.clear();
        let b = StatsBroadcast {
            origin: self.inner.node_id.clone(),
            addr: self.inner.config.advertise,
            stats,
        };
        let bytes = bincode::serde::encode_to_vec(&b, stats_config())
            .map_err(|e| ClusterError::Decode(e.to_string()))?;
        match self.inner.foca_tx.try_send(FocaInput::Broadcast(bytes)) {
            Ok(()) => Ok(()),
            // Saturated: this copy is dropped, the next one (and every summary message)
            // carries newer stats anyway.
            Err(mpsc::error::TrySendError::Full(_)) => Ok(()),
            Err(mpsc::error::TrySendError::Closed(_)) => Err(ClusterError::Shutdown),
        }
    }

    /// The cluster's counters.
    pub fn metrics(&self) -> &ClusterMetrics {
        &self.inner.metrics
    }

    /// UDP bytes sent on the currently open connections, QUIC overhead included (a
    /// closed connection's bytes drop out: use for rates over stable windows).
    pub fn udp_bytes_sent(&self) -> u64 {
        self.inner.transport.conns.udp_bytes_sent()
    }

    /// Addresses this node holds dial state for: dials in flight, failed dials in
    /// their 500 ms backoff, and idle entries until the next `announce_period` tick
    /// drops them. Exposed so that operators and tests can see that the transport
    /// keeps state for what it is dialing now, not for every address it ever dialed.
    pub fn dial_slots(&self) -> usize {
        self.inner.transport.conns.dial_slots()
    }

    /// A receiver that changes on every membership change (the value counts them): wait
    /// on it to re-evaluate routing candidates or tuning leadership.
    pub fn subscribe_membership(&self) -> tokio::sync::watch::Receiver<u64> {
        self.inner.membership_tx.subscribe()
    }

    /// Membership changes seen so far (the last [`MAX_MEMBERSHIP_EVENTS`]), with the
    /// time since start.
    pub fn membership_log(&self) -> Vec<(Duration, MembershipEvent)> {
        self.inner.events.lock().iter().cloned().collect()
    }

    /// Resolves once `peer` is no longer alive as it is now in this node's membership
    /// view: declared down or left, or back under another generation (it restarted
    /// before failure detection fired). At once when it is not alive now. Why: a
    /// forward to a peer that died waits on a QUIC stream that only the idle timeout
    /// would end; the forward races its response against this and ends the moment
    /// membership knows (docs/cluster.md, "Forwards to a dead peer").
    pub fn peer_gone(
        &self,
        peer: &NodeId,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        // Subscribed before looking, so that a change in between is not missed.
        let mut changes = self.inner.membership_tx.subscribe();
        let peers = self.inner.peers.clone();
        let peer = peer.clone();
        let now = peers.alive_generation(&peer);
        async move {
            let Some(generation) = now else {
                return;
            };
            while peers.alive_generation(&peer) == Some(generation) {
                if changes.changed().await.is_err() {
                    return;
                }
            }
        }
    }

    /// Start draining: every stats copy this node publishes from now on (and the one
    /// broadcast right away) says it is draining, and peers leave it out of their
    /// routing candidates as soon as one arrives (about one one-way delay), while it
    /// stays a member: forwards already in flight here finish, and gossip goes on.
    /// Then, once the work in flight is done, [`leave`](Self::leave). The node binary
    /// calls this first on SIGTERM.
    pub fn drain(&self) -> Result<()> {
        self.inner
            .draining
            .store(true, std::sync::atomic::Ordering::Relaxed);
        for stats in self.inner.gossip.all_stats() {
            self.broadcast_stats(stats)?;
        }
        Ok(())
    }

    /// True once [`drain`](Self::drain) was called.
    pub fn is_draining(&self) -> bool {
        self.inner
            .draining
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Leave the cluster gracefully (peers see the leave at once rather than after a
    /// failed probe) and stop every task. Forwards still in flight from or to this
    /// node end with it: [`drain`](Self::drain) first and wait for them.
    pub async fn leave(&self) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        self.inner
            .foca_tx
            .send(FocaInput::Leave(tx))
            .await
            .map_err(|_| ClusterError::Shutdown)?;
        rx.await.map_err(|_| ClusterError::Shutdown)
    }

    /// True once the cluster has stopped (shutdown cancelled or left).
    pub fn is_stopped(&self) -> bool {
        self.inner.shutdown.is_cancelled()
    }

    /// Resolves once a stopped cluster has closed its endpoint and let go of it (the
    /// UDP socket is released as soon as quinn's driver sees that), whatever handle
    /// clones are still around: a node restarted in the same process can then bind
    /// the same port.
    pub async fn closed(&self) {
        self.inner.closed.cancelled().await
    }
}
