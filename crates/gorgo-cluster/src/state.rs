//! What the rest of the node reads: the peer table and the cluster's metrics.
//!
//! Written by the cluster tasks, read concurrently by the router on every request, so
//! it is a `DashMap` of small entries; readers take a copy ([`PeerView`]) or a short
//! borrow ([`crate::ClusterHandle::with_peer_summary`]) and never hold a lock across IO.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::DashMap;
use gorgo_core::gossip::{
    self as core_gossip, GossipConfig, PeerGossip, PeerRun, Prepared, Received,
};
use gorgo_core::wire::GossipMessage;
use gorgo_core::{CoreError, NodeId, QueueStats};
use parking_lot::Mutex;
use serde::Serialize;
use tokio::time::Instant;

use crate::identity::MemberId;

/// EWMA weight of a new RTT sample (docs/design.md: alpha 0.3).
pub const RTT_EWMA_ALPHA: f64 = 0.3;

/// Membership of a peer as this node's SWIM view sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PeerState {
    /// Active: a routing candidate.
    Alive,
    /// Declared down or left: not a routing candidate.
    Down,
}

/// What this node makes of someone claiming a node id from an address (the sender of
/// a SWIM packet, a member foca tells us about, the origin of a stats broadcast).
///
/// A node id is bound to its certificate (the TLS layer checks that) and to one live
/// address: the first live claim holds it until membership declares it down. Why: a
/// second process with the same certificate (a misconfigured deploy, a copied key)
/// must not take a live node's place in routing, nor take it down with it when it
/// dies (docs/cluster.md, "Identity").
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Claim {
    /// Nobody else holds the id alive (a new node, a node restarted at its address,
    /// or one restarted elsewhere after its old self was declared down).
    Accepted,
    /// A live member holds the id at another address: refused, it keeps the id.
    Conflict {
        /// Where the live holder of the id is.
        bound: SocketAddr,
    },
    /// A SWIM packet's sender claims an address a live member with another id holds
    /// ([`PeerTable::sender_claim`]): refused, the member keeps the address until
    /// membership declares it down.
    AddressTaken {
        /// The live member at the address.
        holder: NodeId,
    },
    /// The id is this node's own: whoever claims it is never one of its peers.
    Ours,
    /// Not an id any node can have ([`crate::tls::validate_node_id`]): members are
    /// heard of second-hand, so a member relaying made-up ones must not grow the
    /// table.
    Invalid,
    /// A new member while the table holds [`MAX_PEERS`]: members are heard of
    /// second-hand, and each one costs a full summary snapshot a round while it cannot
    /// be reached, so a member relaying made-up ones must not grow it without end.
    Full,
}

/// Members the table holds at most, down ones included until forgotten: far beyond
/// any deployment this design serves (one node a region, 32 regions simulated).
pub const MAX_PEERS: usize = 1024;

/// One peer's entry in the table.
#[derive(Debug)]
pub(crate) struct PeerEntry {
    pub(crate) member: MemberId,
    pub(crate) state: PeerState,
    pub(crate) state_since: Instant,
    pub(crate) rtt_ms: Option<f64>,
    /// What was heard of each of the peer's engines, by replica (docs/design.md,
    /// "Replicas"): grows as replicas are heard of, up to [`gorgo_core::types::
    /// MAX_REPLICAS`].
    pub(crate) engines: Vec<HeardEngine>,
    /// Which run of the peer's process all of its engines' state is of
    /// (docs/cluster.md, "Incarnations").
    pub(crate) run: PeerRun,
    pub(crate) bytes_sent: u64,
    pub(crate) bytes_received: u64,
}

/// One engine of a peer as heard: its summary and stats, its reorder buffer (the
/// core's gossip state machine; this table only stores it), and when each arrived.
#[derive(Debug, Default)]
pub(crate) struct HeardEngine {
    pub(crate) gossip: PeerGossip,
    pub(crate) summary_at: Option<Instant>,
    pub(crate) summary_bytes: u64,
    pub(crate) stats_at: Option<Instant>,
}

impl HeardEngine {
    /// The gossip state let go of the summary or the stats (another run of the peer
    /// replaced what was held): their stamps go with them.
    pub(crate) fn forget_stamps_if_gone(&mut self) {
        if self.gossip.summary().is_none() {
            self.summary_at = None;
            self.summary_bytes = 0;
        }
        if self.gossip.stats().is_none() {
            self.stats_at = None;
        }
    }

    fn forget(&mut self) {
        self.gossip.forget();
        self.summary_at = None;
        self.summary_bytes = 0;
        self.stats_at = None;
    }
}

impl PeerEntry {
    /// Make room for the peer's engine `replica`, which a summary message or stats
    /// speak for (created when first heard of; the caller has checked `replica`
    /// against the limit). Which run's word is taken is the peer's [`PeerRun`]'s to
    /// say, for all of its engines together.
    fn make_room(&mut self, replica: u16) {
        let r = replica as usize;
        if self.engines.len() <= r {
            self.engines.resize_with(r + 1, HeardEngine::default);
        }
    }

    /// Another run of the peer may have replaced what its engines held: their stamps
    /// go with what went.
    fn forget_stamps_if_gone(&mut self) {
        for e in &mut self.engines {
            e.forget_stamps_if_gone();
        }
    }

    /// Hand `msg`, a summary message (which the transport says came from `from`)
    /// prepared outside the table's lock ([`Prepared`]: a snapshot's set is built
    /// already, and what it replaces is left in `msg`, for the caller to drop after
    /// the lock), to the state of the engine it is about, within
    /// [`GossipConfig::max_peer_fingerprints`] for all of the peer's engines together,
    /// when it is of the run the peer's [`PeerRun`] hears
    /// ([`gorgo_core::gossip::receive_prepared_from_peer`]), on behalf of node `me`.
    /// Why here: the cap and the run are per peer, and this entry is what holds all of
    /// a peer's engines. The caller has checked the message's replica against the
    /// limit.
    pub(crate) fn receive(
        &mut self,
        me: &NodeId,
        from: &NodeId,
        msg: &mut Prepared,
        now_ms: u64,
        config: &GossipConfig,
    ) -> Result<Received, CoreError> {
        if let Some(m) = msg.message() {
            self.make_room(core_gossip::replica(m));
        }
        let received = core_gossip::receive_prepared_from_peer(
            &mut self.engines,
            |h| &mut h.gossip,
            &mut self.run,
            me,
            from,
            msg,
            now_ms,
            config,
        );
        self.forget_stamps_if_gone();
        received
    }

    /// Keep the reorder buffers of the peer's engines within
    /// [`GossipConfig::max_peer_pending_bytes`] together, after engine `replica` took
    /// a message ([`PeerGossip::limit_pending`]), on behalf of node `me`: the snapshot
    /// request to send the peer, if its buffer went. Why here: the cap is per peer, and
    /// this entry is what holds all of a peer's engines.
    pub(crate) fn limit_pending(
        &mut self,
        replica: u16,
        me: &NodeId,
        now_ms: u64,
        config: &GossipConfig,
    ) -> Option<GossipMessage> {
        gorgo_core::gossip::limit_peer_pending(
            &mut self.engines,
            |h| &mut h.gossip,
            replica,
            me,
            now_ms,
            config,
        )
    }

    fn new(member: MemberId, now: Instant) -> Self {
        PeerEntry {
            member,
            state: PeerState::Down,
            state_since: now,
            rtt_ms: None,
            engines: vec![HeardEngine::default()],
            run: PeerRun::new(),
            bytes_sent: 0,
            bytes_received: 0,
        }
    }
}

/// One engine of a peer, as [`PeerView`] shows it.
#[derive(Debug, Clone, Serialize)]
pub struct PeerEngineView {
    /// Which of the peer's engines.
    pub replica: u16,
    /// Version of its summary we hold; `None` before the first snapshot.
    pub summary_version: Option<u64>,
    /// Fingerprints in that summary.
    pub summary_len: usize,
    /// Encoded size of that summary, bytes.
    pub summary_bytes: u64,
    /// Time since the summary last changed or was confirmed, ms.
    pub summary_age_ms: Option<u64>,
    /// Deltas of its summary held in the reorder buffer, waiting for the one they
    /// follow: 0 but for a moment, unless deltas were lost or the peer misbehaves.
    pub pending_deltas: usize,
    /// The engine's last queue stats.
    pub stats: Option<QueueStats>,
    /// Time since those stats arrived, ms.
    pub stats_age_ms: Option<u64>,
}

/// A copy of one peer's state, cheap to hand to the admin API and the router.
#[derive(Debug, Clone, Serialize)]
pub struct PeerView {
    /// Node id.
    pub id: NodeId,
    /// Region it serves.
    pub region: String,
    /// Address peers dial.
    pub addr: SocketAddr,
    /// Identity generation (grows on rejoin).
    pub generation: u64,
    /// The run of the peer's process the summary and stats held are from (its start
    /// time, ms); `None` before anything arrived.
    pub incarnation: Option<u64>,
    /// Membership state.
    pub state: PeerState,
    /// True when the peer is a routing candidate.
    pub alive: bool,
    /// EWMA of QUIC path RTT, ms; `None` before the first sample.
    pub rtt_ms: Option<f64>,
    /// Version of the summary of its first engine (replica 0, or the lowest that has
    /// not left) we hold; `None` before the first snapshot. The fields down to
    /// `stats_age_ms` are the first engine's, which is all a one-engine peer has;
    /// `engines` has every engine's.
    pub summary_version: Option<u64>,
    /// Fingerprints in the summary we hold.
    pub summary_len: usize,
    /// Encoded size of the summary we hold, bytes.
    pub summary_bytes: u64,
    /// Time since the summary last changed or was confirmed, ms.
    pub summary_age_ms: Option<u64>,
    /// The peer's last queue stats.
    pub stats: Option<QueueStats>,
    /// Time since those stats arrived, ms.
    pub stats_age_ms: Option<u64>,
    /// Every engine of the peer heard of, by replica, but those that left it
    /// ([`gorgo_core::gossip::PeerGossip::left`]).
    pub engines: Vec<PeerEngineView>,
    /// Bytes we sent to this peer: SWIM datagrams, summary and app streams (payload
    /// handed to QUIC).
    pub bytes_sent: u64,
    /// Bytes we took from this peer as its own: SWIM datagrams whose packet speaks for
    /// it from the address its id is bound to, and summary and app streams read whole
    /// on a connection vouched for it. What was refused is credited to no peer (a
    /// certificate names who sent it, not whom it speaks for); the node-wide
    /// [`ClusterMetrics`] byte counters count it.
    pub bytes_received: u64,
}

/// The concurrent peer table.
#[derive(Debug, Default)]
pub struct PeerTable {
    pub(crate) peers: DashMap<NodeId, PeerEntry>,
    /// Peers whose summary messages were dropped because the table did not hold them
    /// yet ([`PeerTable::dropped_before_entry`]), at most
    /// [`MAX_DROPPED_BEFORE_ENTRY`].
    dropped_before_entry: DashMap<NodeId, ()>,
}

/// Most peers [`PeerTable::dropped_before_entry`] remembers; past it, the memory is
/// cleared (a peer forgotten waits for its first snapshot some seconds longer).
const MAX_DROPPED_BEFORE_ENTRY: usize = 1024;

fn age_ms(at: Option<Instant>, now: Instant) -> Option<u64> {
    at.map(|t| now.saturating_duration_since(t).as_millis() as u64)
}

impl PeerTable {
    /// A copy of every known peer (alive or not), sorted by node id.
    pub fn views(&self, now: Instant) -> Vec<PeerView> {
        let mut out: Vec<PeerView> = self
            .peers
            .iter()
            .map(|e| {
                let p = e.value();
                // An engine that left the peer is in no view (its stats ended its
                // stream; the entry stays, so that nothing late of it comes back).
                let engines: Vec<PeerEngineView> = p
                    .engines
                    .iter()
                    .enumerate()
                    .filter(|(_, h)| !h.gossip.left())
                    .map(|(i, h)| PeerEngineView {
                        replica: i as u16,
                        summary_version: h.gossip.summary().map(|s| s.version()),
                        summary_len: h.gossip.summary().map_or(0, |s| s.len()),
                        summary_bytes: h.summary_bytes,
                        summary_age_ms: age_ms(h.summary_at, now),
                        pending_deltas: h.gossip.pending(),
                        stats: h.gossip.stats().cloned(),
                        stats_age_ms: age_ms(h.stats_at, now),
                    })
                    .collect();
                let first = engines.first();
                PeerView {
                    id: e.key().clone(),
                    region: p.member.region.clone(),
                    addr: p.member.addr,
                    generation: p.member.generation,
                    incarnation: p.run.incarnation(),
                    state: p.state,
                    alive: p.state == PeerState::Alive,
                    rtt_ms: p.rtt_ms,
                    summary_version: first.and_then(|f| f.summary_version),
                    summary_len: first.map_or(0, |f| f.summary_len),
                    summary_bytes: first.map_or(0, |f| f.summary_bytes),
                    summary_age_ms: first.and_then(|f| f.summary_age_ms),
                    stats: first.and_then(|f| f.stats.clone()),
                    stats_age_ms: first.and_then(|f| f.stats_age_ms),
                    engines,
                    bytes_sent: p.bytes_sent,
                    bytes_received: p.bytes_received,
                }
            })
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// Time out the reorder buffer of every engine of every peer held
    /// ([`PeerGossip::tick`]), on behalf of node `me`: the snapshot requests to send,
    /// each to an alive peer. A down peer's buffers go too (its entry stays until
    /// [`forget_down`](Self::forget_down)), but it is asked for nothing.
    pub(crate) fn tick_gossip(
        &self,
        me: &NodeId,
        now_ms: u64,
        config: &GossipConfig,
    ) -> Vec<(NodeId, GossipMessage)> {
        let mut out = Vec::new();
        for mut e in self.peers.iter_mut() {
            let (node, entry) = e.pair_mut();
            let alive = entry.state == PeerState::Alive;
            for (r, h) in entry.engines.iter_mut().enumerate() {
                let request = h.gossip.tick(me, r as u16, now_ms, config);
                if let Some(request) = request.filter(|_| alive) {
                    out.push((node.clone(), request));
                }
            }
        }
        out
    }

    /// Ids of the peers that are routing candidates, sorted.
    pub fn alive_ids(&self) -> Vec<NodeId> {
        let mut ids: Vec<NodeId> = self
            .peers
            .iter()
            .filter(|e| e.value().state == PeerState::Alive)
            .map(|e| e.key().clone())
            .collect();
        ids.sort();
        ids
    }

    /// What this node (`me`) makes of `node` being claimed from `addr` (see [`Claim`]).
    pub(crate) fn claim(&self, me: &NodeId, node: &NodeId, addr: SocketAddr) -> Claim {
        if node == me {
            return Claim::Ours;
        }
        if crate::tls::validate_node_id(node).is_err() {
            return Claim::Invalid;
        }
        match self.bound_addr(node) {
            Some(bound) if bound != addr => Claim::Conflict { bound },
            _ => Claim::Accepted,
        }
    }

    /// What this node (`me`) makes of a SWIM packet whose (TLS-authenticated) sender
    /// claims `node` from `addr`: [`claim`](Self::claim), and besides, the address must
    /// not be held by a live peer with another id ([`Claim::AddressTaken`]).
    ///
    /// Why: foca keys members by address (`Identity::Addr`), and a sender with a
    /// higher generation at a known address replaces the member there (`Rename`),
    /// whatever its id. Unchecked, any certificate holder could take a live node out
    /// of membership with one packet (its id, the node's address, a huge
    /// generation), and the node could not win its address back by renewing. A
    /// genuine newcomer at a dead node's address (a re-provisioned host, a reused pod
    /// IP) waits for failure detection to declare the old node down (about 3 s), then
    /// re-announces and is accepted. Only first-hand claims are checked here: what
    /// foca hears of second-hand is not authenticated in SWIM, and an update relayed
    /// about another identity at a held address is dropped before foca sees it
    /// (`drop_relayed_address_claims` in `cluster.rs`).
    pub(crate) fn sender_claim(&self, me: &NodeId, node: &NodeId, addr: SocketAddr) -> Claim {
        let claim = self.claim(me, node, addr);
        // The live holder of its own address needs no scan: the table holds one live
        // member per address (a rename takes the old one down before the new comes up).
        if claim != Claim::Accepted || self.bound_addr(node) == Some(addr) {
            return claim;
        }
        let holder = self
            .peers
            .iter()
            .find(|e| e.state == PeerState::Alive && e.member.addr == addr && e.key() != node)
            .map(|e| e.key().clone());
        match holder {
            Some(holder) => Claim::AddressTaken { holder },
            None => claim,
        }
    }

    /// Whether the table holds exactly `member` (id, address, generation) alive.
    pub(crate) fn holds_alive(&self, member: &MemberId) -> bool {
        self.peers
            .get(&member.node)
            .is_some_and(|e| e.state == PeerState::Alive && e.member == *member)
    }

    /// The address `node` is bound to while it is alive.
    pub(crate) fn bound_addr(&self, node: &NodeId) -> Option<SocketAddr> {
        self.peers
            .get(node)
            .filter(|e| e.state == PeerState::Alive)
            .map(|e| e.member.addr)
    }

    /// A summary message from `node` was dropped: the table does not hold it yet.
    /// Membership is not symmetric, and a peer that knows us starts our stream with a
    /// snapshot, which may arrive before we know the peer. When the entry is made,
    /// the peer's engines ask for a snapshot at their first delta instead of waiting
    /// seconds for the dropped one ([`PeerRun::messages_dropped`]). Any authenticated
    /// node can make this table remember it, so it is capped.
    pub(crate) fn dropped_before_entry(&self, node: &NodeId) {
        if self.dropped_before_entry.len() >= MAX_DROPPED_BEFORE_ENTRY {
            self.dropped_before_entry.clear();
        }
        self.dropped_before_entry.insert(node.clone(), ());
        // Membership may have made the entry since the caller looked: then it did not
        // see the mark, and it is taken here (whichever side removes it acts on it).
        if let Some(mut e) = self.peers.get_mut(node) {
            if self.dropped_before_entry.remove(node).is_some() && e.run.incarnation().is_none() {
                e.run.messages_dropped();
            }
        }
    }

    /// `member` is up, as this node (`me`) sees it: it becomes (or stays) a routing
    /// candidate unless the claim is refused ([`Claim`]), which the table leaves as it
    /// was.
    pub(crate) fn member_up(&self, me: &NodeId, member: &MemberId, now: Instant) -> Claim {
        let claim = self.claim(me, &member.node, member.addr);
        if claim != Claim::Accepted {
            return claim;
        }
        if self.peers.len() >= MAX_PEERS && !self.peers.contains_key(&member.node) {
            return Claim::Full;
        }
        let mut fresh = false;
        let mut e = self.peers.entry(member.node.clone()).or_insert_with(|| {
            fresh = true;
            PeerEntry::new(member.clone(), now)
        });
        if fresh || e.member.generation != member.generation {
            // A new identity (a restart, or a rejoin after being declared down): what
            // we held may be a dead run's. The run heard stays, so that a dead run's
            // messages still travelling cannot come back; the first stats broadcast
            // of this identity vouches for its run, whatever its incarnation
            // (`vouch_run`). Unless a newer run's messages came first: then what is
            // held is already that run's (the old run's went when it arrived).
            if !e.run.new_run_since_membership() {
                for h in &mut e.engines {
                    h.forget();
                }
            }
            e.run.membership_changed();
        }
        if fresh && self.dropped_before_entry.remove(&member.node).is_some() {
            e.run.messages_dropped();
        }
        e.member = member.clone();
        if e.state != PeerState::Alive {
            e.state = PeerState::Alive;
            e.state_since = now;
        }
        claim
    }

    /// `member` was declared down or left; true when that took its entry down. A
    /// claim this table refused (another address) never takes the holder down.
    pub(crate) fn member_down(&self, member: &MemberId, now: Instant) -> bool {
        let Some(mut e) = self.peers.get_mut(&member.node) else {
            return false;
        };
        if e.member.addr != member.addr
            || e.member.generation > member.generation
            || e.state == PeerState::Down
        {
            return false;
        }
        e.state = PeerState::Down;
        e.state_since = now;
        true
    }

    /// Drop the entries of peers down for longer than `after` (the time foca keeps a
    /// down member: `SwimConfig::remove_down_after`), summaries and all; how many went.
    /// Without this a table kept every id it ever heard of: a member relaying many
    /// well-formed ids would grow it for good. A peer that comes back is heard of anew
    /// (a snapshot starts its gossip).
    pub(crate) fn forget_down(&self, now: Instant, after: std::time::Duration) -> usize {
        let before = self.peers.len();
        self.peers.retain(|_, e| {
            e.state != PeerState::Down || now.saturating_duration_since(e.state_since) <= after
        });
        before - self.peers.len()
    }

    pub(crate) fn is_alive(&self, node: &NodeId) -> bool {
        self.peers
            .get(node)
            .is_some_and(|e| e.state == PeerState::Alive)
    }

    /// The generation `node` is alive under, if it is.
    pub(crate) fn alive_generation(&self, node: &NodeId) -> Option<u64> {
        self.peers
            .get(node)
            .filter(|e| e.state == PeerState::Alive)
            .map(|e| e.member.generation)
    }

    pub(crate) fn record_rtt(&self, node: &NodeId, sample_ms: f64) {
        if let Some(mut e) = self.peers.get_mut(node) {
            e.rtt_ms = Some(match e.rtt_ms {
                None => sample_ms,
                Some(prev) => RTT_EWMA_ALPHA * sample_ms + (1.0 - RTT_EWMA_ALPHA) * prev,
            });
        }
    }

    /// Seed the RTT of a peer that has no sample yet (quinn's handshake estimate of a
    /// fresh connection), so a just-joined peer is routable before the first gossip
    /// round samples it.
    pub(crate) fn seed_rtt(&self, node: &NodeId, sample_ms: f64) {
        if let Some(mut e) = self.peers.get_mut(node) {
            if e.rtt_ms.is_none() {
                e.rtt_ms = Some(sample_ms);
            }
        }
    }

    /// Keep `stats` if newer than what we hold, and of the run heard
    /// ([`core_gossip::offer_peer_stats`]); true when kept.
    pub(crate) fn offer_stats(&self, node: &NodeId, stats: &QueueStats, now: Instant) -> bool {
        match self.peers.get_mut(node) {
            Some(mut e) if stats.replica < gorgo_core::types::MAX_REPLICAS => {
                let e = &mut *e;
                e.make_room(stats.replica);
                let kept = core_gossip::offer_peer_stats(
                    &mut e.engines,
                    |h| &mut h.gossip,
                    &mut e.run,
                    stats,
                );
                if kept {
                    e.engines[usize::from(stats.replica)].stats_at = Some(now);
                }
                e.forget_stamps_if_gone();
                kept
            }
            Some(_) => false,
            None => false,
        }
    }

    /// A stats broadcast of run `incarnation` came on a SWIM packet of `sender`: when
    /// that is the identity the table holds alive for the node, and the first such
    /// since membership accepted it, the run is vouched for
    /// ([`core_gossip::vouch_peer_run`]): heard from now on, though its incarnation is
    /// older than a dead run's (a restart on a clock that reads earlier). True when
    /// the run heard changed.
    pub(crate) fn vouch_run(&self, sender: &MemberId, incarnation: u64) -> bool {
        let Some(mut e) = self.peers.get_mut(&sender.node) else {
            return false;
        };
        if e.state != PeerState::Alive || e.member != *sender {
            return false;
        }
        let e = &mut *e;
        let changed =
            core_gossip::vouch_peer_run(&mut e.engines, |h| &mut h.gossip, &mut e.run, incarnation);
        e.forget_stamps_if_gone();
        changed
    }

    pub(crate) fn add_bytes(&self, node: &NodeId, sent: u64, received: u64) {
        if let Some(mut e) = self.peers.get_mut(node) {
            e.bytes_sent += sent;
            e.bytes_received += received;
        }
    }
}

/// How many staleness samples are kept for percentiles (a sliding window).
pub const STALENESS_WINDOW: usize = 8192;

/// Traffic kinds counted separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrafficKind {
    /// SWIM packets (QUIC datagrams), stats broadcasts included.
    Swim,
    /// Summary deltas, snapshots and snapshot requests (uni-streams).
    Summary,
    /// Application messages (tuning protocol), uni-streams.
    App,
}

/// Counters the node exports as metrics. All byte counts are payload bytes as handed to
/// QUIC (no QUIC/UDP overhead).
#[derive(Debug, Default)]
pub struct ClusterMetrics {
    /// SWIM bytes sent.
    pub swim_bytes_sent: AtomicU64,
    /// SWIM bytes received: every datagram read, refused ones included.
    pub swim_bytes_received: AtomicU64,
    /// Summary gossip bytes sent.
    pub summary_bytes_sent: AtomicU64,
    /// Summary gossip bytes received.
    pub summary_bytes_received: AtomicU64,
    /// App message bytes sent.
    pub app_bytes_sent: AtomicU64,
    /// App message bytes received.
    pub app_bytes_received: AtomicU64,
    /// Summary deltas sent.
    pub deltas_sent: AtomicU64,
    /// Full snapshots sent.
    pub snapshots_sent: AtomicU64,
    /// Snapshot requests sent after a version gap.
    pub snapshot_requests_sent: AtomicU64,
    /// Messages dropped because they did not decode or were over their cap.
    pub malformed_received: AtomicU64,
    /// SWIM packets whose claimed sender did not match the TLS peer.
    pub spoofed_received: AtomicU64,
    /// Announces (joins) addressed to another address than the one this node
    /// advertises, which foca ignores: a peer seeding this node at an address that
    /// reaches it (a private IP, a load balancer) while it advertises another. Each
    /// new (sender, address) pair is also warned about, naming both addresses.
    pub misaddressed_announces: AtomicU64,
    /// Inbound connections refused (handshake failure, unknown identity, a handshake
    /// not done within its deadline, or one past the cap on handshakes at once).
    pub handshakes_failed: AtomicU64,
    /// Handshakes, dialed or accepted, that failed because the other side speaks
    /// another cluster protocol version (no ALPN in common): a node of another release.
    pub handshakes_other_protocol: AtomicU64,
    /// Handshakes, dialed or accepted, that failed because one side's certificate is
    /// not from the CA the other trusts: a node of another cluster, or a CA replaced.
    pub handshakes_foreign_certificate: AtomicU64,
    /// Handshakes, dialed or accepted, that failed because one side's certificate has
    /// expired: a node to re-issue (`gorgo certs --days`) and restart.
    pub handshakes_expired_certificate: AtomicU64,
    /// "You were declared down" notices dropped: those foca wanted to send to a member
    /// that refuted its suspicion in time, and those received for this node's identity
    /// sooner after its last renewal than a suspicion can take (see `docs/cluster.md`).
    pub spurious_turn_undead_dropped: AtomicU64,
    /// Claims of a peer's node id from another address than the live member holding
    /// it (SWIM packets, membership updates, stats broadcasts), SWIM packets whose
    /// sender claims an address a live member with another id holds, and relayed
    /// membership updates that name another id at the address of a member foca holds
    /// (dropped before foca sees them), refused: an impostor or a forged update, a
    /// node restarted elsewhere before its old self was declared down, or a new node
    /// at a dead node's address (before that one was declared down; heard of
    /// second-hand, until it speaks for itself).
    pub identity_conflicts: AtomicU64,
    /// Membership updates that claim this node's own id for another process, refused
    /// (this node keeps its id and goes on).
    pub own_id_claimed: AtomicU64,
    /// Connections peers closed because they hold this node's own id alive at
    /// another address (`ClusterHandle::identity_refusals` says who and where): this
    /// process is a second one with a live node's id, or it restarted at a new address
    /// before its previous run was declared down (then it stops within seconds).
    pub own_id_refused: AtomicU64,
    /// Streams (gossip, app messages, forwards) refused because they came on a
    /// connection no accepted claim vouches for while the node id is bound elsewhere,
    /// or on an inbound connection that made no SWIM claim within the wait for one
    /// (four SWIM probe periods: a process with a stolen certificate that never sends
    /// SWIM, docs/cluster.md "Identity").
    pub unbound_streams_dropped: AtomicU64,
    /// Inbound connections closed because their certificate's node id held more open
    /// here at once than the cap (4, `transport::MAX_INBOUND_CONNECTIONS_PER_NODE`):
    /// the oldest that spoke for nobody, else the oldest but the one this node sends
    /// on, went (docs/cluster.md, "Transport").
    pub excess_connections_closed: AtomicU64,
    staleness_ms: Mutex<VecDeque<u64>>,
}

impl ClusterMetrics {
    pub(crate) fn sent(&self, kind: TrafficKind, bytes: usize) {
        let c = match kind {
            TrafficKind::Swim => &self.swim_bytes_sent,
            TrafficKind::Summary => &self.summary_bytes_sent,
            TrafficKind::App => &self.app_bytes_sent,
        };
        c.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub(crate) fn received(&self, kind: TrafficKind, bytes: usize) {
        let c = match kind {
            TrafficKind::Swim => &self.swim_bytes_received,
            TrafficKind::Summary => &self.summary_bytes_received,
            TrafficKind::App => &self.app_bytes_received,
        };
        c.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Total gossip bytes sent, all kinds.
    pub fn total_bytes_sent(&self) -> u64 {
        self.swim_bytes_sent.load(Ordering::Relaxed)
            + self.summary_bytes_sent.load(Ordering::Relaxed)
            + self.app_bytes_sent.load(Ordering::Relaxed)
    }

    /// Total gossip bytes received, all kinds.
    pub fn total_bytes_received(&self) -> u64 {
        self.swim_bytes_received.load(Ordering::Relaxed)
            + self.summary_bytes_received.load(Ordering::Relaxed)
            + self.app_bytes_received.load(Ordering::Relaxed)
    }

    pub(crate) fn record_staleness(&self, ms: u64) {
        let mut s = self.staleness_ms.lock();
        if s.len() == STALENESS_WINDOW {
            s.pop_front();
        }
        s.push_back(ms);
    }

    /// The recent summary staleness samples, ms: for each summary message received, the
    /// time from the oldest change it carries being made at its origin to it being
    /// applied here (origin and receiver clocks, see `docs/cluster.md`).
    pub fn staleness_samples(&self) -> Vec<u64> {
        self.staleness_ms.lock().iter().copied().collect()
    }
}

/// A peer's refusal of this node's own claim to its node id, as this node was told
/// of it ([`crate::ClusterHandle::identity_refusals`]).
///
/// Why: a peer that holds this node's id alive at another address refuses every SWIM
/// packet of this process, so a second process started with a live node's config and
/// certificate learns no member and serves its clients as a one-node island, while
/// only the peers log the conflict. The refusing peer closes the connection with a
/// code that says so and the live holder's address (docs/cluster.md, "Identity: one
/// live process per node id"), and this is what the refused process keeps of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct IdentityRefusal {
    /// The peer that refused this node's claim.
    pub by: NodeId,
    /// Where that peer holds this node's id alive: the address the live holder
    /// advertises, as the peer knows it.
    pub held_at: SocketAddr,
    /// Time since that peer first refused this node, ms (this run of refusals: one
    /// that stopped for [`REFUSAL_TTL_ANNOUNCE_PERIODS`] announce periods is over).
    pub first_age_ms: u64,
    /// Time since its last refusal, ms.
    pub last_age_ms: u64,
}

/// Announce periods (`SwimTimings::announce_period`, 2 s by default) a refusal of this
/// node's id is held after the last one: a process every peer refuses re-announces
/// each period (foca knows no member), and each announce comes on a new connection
/// that the refusing peer closes again, so a refusal still going on is told again
/// every period; five leave room for lost closes. One that stopped (the holder died
/// and the peer now takes this node, or the peer went away) goes within 10 s.
pub const REFUSAL_TTL_ANNOUNCE_PERIODS: u32 = 5;

/// The refusals of this node's own claim to its id, by the peer that refused
/// ([`IdentityRefusal`]); at most [`MAX_PEERS`] peers (the one refused longest ago
/// goes first), since any certificate holder can tell one.
#[derive(Debug, Default)]
pub(crate) struct OwnIdRefusals {
    by: Mutex<std::collections::BTreeMap<NodeId, HeldRefusal>>,
}

#[derive(Debug, Clone, Copy)]
struct HeldRefusal {
    held_at: SocketAddr,
    first: Instant,
    last: Instant,
}

impl OwnIdRefusals {
    /// Peer `by` refused this node's id, held alive at `held_at` in its view, at
    /// `now`; refusals last told more than `ttl` ago are over. True when this is news
    /// to log: the first refusal of a run of them from `by`, or a new `held_at`.
    pub(crate) fn record(
        &self,
        by: &NodeId,
        held_at: SocketAddr,
        now: Instant,
        ttl: std::time::Duration,
    ) -> bool {
        let mut held = self.by.lock();
        held.retain(|_, r| now.saturating_duration_since(r.last) <= ttl);
        if let Some(r) = held.get_mut(by) {
            let news = r.held_at != held_at;
            r.held_at = held_at;
            r.last = now;
            return news;
        }
        if held.len() >= MAX_PEERS {
            let oldest = held
                .iter()
                .min_by_key(|(_, r)| r.last)
                .map(|(k, _)| k.clone());
            if let Some(oldest) = oldest {
                held.remove(&oldest);
            }
        }
        held.insert(
            by.clone(),
            HeldRefusal {
                held_at,
                first: now,
                last: now,
            },
        );
        true
    }

    /// Peer `by` took a SWIM packet of this node's (it sent one on a claim it
    /// accepted): whatever it refused before is over. True when it had refused.
    pub(crate) fn accepted_by(&self, by: &NodeId) -> bool {
        let mut held = self.by.lock();
        // The common case, a packet of a peer that never refused: no map walk.
        !held.is_empty() && held.remove(by).is_some()
    }

    /// The refusals going on at `now` (told within `ttl`), sorted by peer.
    pub(crate) fn current(&self, now: Instant, ttl: std::time::Duration) -> Vec<IdentityRefusal> {
        self.by
            .lock()
            .iter()
            .filter(|(_, r)| now.saturating_duration_since(r.last) <= ttl)
            .map(|(by, r)| IdentityRefusal {
                by: by.clone(),
                held_at: r.held_at,
                first_age_ms: now.saturating_duration_since(r.first).as_millis() as u64,
                last_age_ms: now.saturating_duration_since(r.last).as_millis() as u64,
            })
            .collect()
    }
}

/// Which warnings to log: each key once, and at most `cap` keys a `window`. Why both:
/// a warning per key, not per packet, and a sender that makes up a new key each packet
/// (a new source address) logs `cap` a window, not one a packet; and when the window
/// ends the set starts again, so that a flood of made-up keys does not silence the
/// warnings about a real misconfiguration for the rest of the run.
#[derive(Debug)]
pub(crate) struct LogOnce<K> {
    logged: std::collections::HashSet<K>,
    /// When the window began (its first key).
    since: Option<Instant>,
    cap: usize,
    window: std::time::Duration,
}

impl<K: std::hash::Hash + Eq> LogOnce<K> {
    /// At most `cap` keys a `window`.
    pub(crate) fn new(cap: usize, window: std::time::Duration) -> Self {
        LogOnce {
            logged: std::collections::HashSet::new(),
            since: None,
            cap,
            window,
        }
    }

    /// Whether to log `key` at `now`: the first time in this window, while the
    /// window has room.
    pub(crate) fn first(&mut self, key: K, now: Instant) -> bool {
        let since = *self.since.get_or_insert(now);
        if now.saturating_duration_since(since) >= self.window {
            self.logged.clear();
            self.since = Some(now);
        }
        self.logged.len() < self.cap && self.logged.insert(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gorgo_core::summary::{LocalSummary, SummaryDelta, SummarySnapshot};

    /// Each key once a window, at most `cap` keys a window, and a new window starts
    /// over: a flood of made-up keys neither logs one a packet nor silences the rest
    /// of the run.
    #[test]
    fn warnings_are_once_per_key_and_capped_per_window() {
        let t0 = Instant::now();
        let mut log = LogOnce::new(2, std::time::Duration::from_secs(60));
        assert!(log.first(1, t0));
        assert!(!log.first(1, t0));
        assert!(log.first(2, t0));
        assert!(!log.first(3, t0), "over the cap");
        let later = t0 + std::time::Duration::from_secs(60);
        assert!(log.first(3, later));
        assert!(log.first(1, later));
    }

    /// A refusal of this node's id is held from its first to TTL after its last: its
    /// first age runs on across refusals, a new holder address is news (logged
    /// again), a peer that takes this node ends it at once, one not told again within
    /// the TTL is over, and the peers held are capped.
    #[test]
    fn own_id_refusals_run_from_the_first_to_the_last_within_the_ttl() {
        let ttl = std::time::Duration::from_secs(10);
        let s = std::time::Duration::from_secs;
        let t0 = Instant::now();
        let (a, b) = (NodeId::from("a"), NodeId::from("b"));
        let (x, y): (SocketAddr, SocketAddr) = (
            "10.0.0.1:7000".parse().unwrap(),
            "10.0.0.2:7000".parse().unwrap(),
        );
        let r = OwnIdRefusals::default();
        assert!(r.current(t0, ttl).is_empty());
        assert!(r.record(&a, x, t0, ttl), "the first is news");
        assert!(!r.record(&a, x, t0 + s(2), ttl), "the same again is not");
        assert!(r.record(&b, x, t0 + s(3), ttl));
        let now = t0 + s(4);
        assert_eq!(
            r.current(now, ttl),
            [
                IdentityRefusal {
                    by: a.clone(),
                    held_at: x,
                    first_age_ms: 4_000,
                    last_age_ms: 2_000
                },
                IdentityRefusal {
                    by: b.clone(),
                    held_at: x,
                    first_age_ms: 1_000,
                    last_age_ms: 1_000
                },
            ]
        );
        assert!(
            r.record(&a, y, t0 + s(5), ttl),
            "a new holder address is news"
        );
        assert_eq!(r.current(t0 + s(5), ttl)[0].held_at, y);
        assert_eq!(r.current(t0 + s(5), ttl)[0].first_age_ms, 5_000);
        // a takes this node: over at once; b, not told again, goes after the TTL.
        assert!(r.accepted_by(&a));
        assert!(!r.accepted_by(&a));
        assert_eq!(r.current(t0 + s(13), ttl).len(), 1);
        assert!(r.current(t0 + s(14), ttl).is_empty());
        // Told again after it was over: a new run of refusals, its age from now.
        assert!(r.record(&b, x, t0 + s(20), ttl));
        assert_eq!(r.current(t0 + s(20), ttl)[0].first_age_ms, 0);
        // At most MAX_PEERS peers: the one told longest ago goes.
        for i in 0..MAX_PEERS {
            r.record(&NodeId(format!("p{i}")), x, t0 + s(21), ttl);
        }
        let held = r.current(t0 + s(21), ttl);
        assert_eq!(held.len(), MAX_PEERS);
        assert!(held.iter().all(|h| h.by != b), "b was told longest ago");
    }

    fn member(n: &str, g: u64) -> MemberId {
        MemberId {
            node: NodeId::from(n),
            region: "r".into(),
            addr: "10.0.0.1:1".parse().unwrap(),
            generation: g,
        }
    }

    fn member_at(n: &str, g: u64, addr: &str) -> MemberId {
        MemberId {
            addr: addr.parse().unwrap(),
            ..member(n, g)
        }
    }

    fn me() -> NodeId {
        NodeId::from("me")
    }

    /// A summary message of peer "a" about its engine `replica` (run 1).
    fn summary_msg(replica: u16, delta: Option<(u64, usize)>) -> GossipMessage {
        summary_msg_of("a", replica, delta)
    }

    /// A summary message of peer `peer` about its engine `replica` (run 1): a snapshot
    /// at version 1, or a delta `(from version, fingerprints added)` to the next.
    fn summary_msg_of(peer: &str, replica: u16, delta: Option<(u64, usize)>) -> GossipMessage {
        use gorgo_core::summary::{SummaryDelta, SummarySnapshot};
        let stats = QueueStats {
            incarnation: 1,
            version: 1,
            replica,
            ..Default::default()
        };
        let origin = NodeId::from(peer);
        match delta {
            None => GossipMessage::SummarySnapshot {
                origin,
                snapshot: SummarySnapshot {
                    version: 1,
                    ..Default::default()
                },
                stats,
            },
            Some((from, fingerprints)) => GossipMessage::SummaryDelta {
                origin,
                delta: SummaryDelta {
                    from_version: from,
                    to_version: from + 1,
                    added: (0..fingerprints as u32).collect(),
                    ..Default::default()
                },
                stats,
            },
        }
    }

    /// A restarted peer's snapshot that arrives before membership brings its new
    /// identity is kept when the identity comes: it is already the new run's. A rejoin
    /// of the run membership has vouched for lets go of what is held, as before.
    /// Peer "a"'s (run 1) message carrying `snapshot` or `delta` of its engine 0.
    fn of_a(snapshot: Option<SummarySnapshot>, delta: Option<SummaryDelta>) -> GossipMessage {
        let (origin, stats) = (NodeId::from("a"), QueueStats::default());
        let stats = QueueStats {
            incarnation: 1,
            version: 1,
            ..stats
        };
        match (snapshot, delta) {
            (Some(snapshot), _) => GossipMessage::SummarySnapshot {
                origin,
                snapshot,
                stats,
            },
            (None, delta) => GossipMessage::SummaryDelta {
                origin,
                delta: delta.unwrap_or_default(),
                stats,
            },
        }
    }

    /// Whether what engine 0 of `e` holds is `local`'s set at `local`'s version.
    fn holds(e: &PeerEntry, local: &LocalSummary) -> Result<(), String> {
        let held = e.engines[0].gossip.summary().ok_or("nothing held")?;
        let want = local.snapshot();
        if held.version() != want.version
            || held.len() != want.fingerprints.len()
            || !want.fingerprints.iter().all(|&fp| held.contains(fp))
        {
            return Err(format!(
                "held v{} ({} fps), want v{} ({} fps)",
                held.version(),
                held.len(),
                want.version,
                want.fingerprints.len()
            ));
        }
        Ok(())
    }

    /// A peer's snapshot is built outside the table's lock ([`Prepared`]); under it,
    /// it is swapped in, and what it replaced comes back to be freed after the lock.
    /// Before, the set was built (and the old one freed) under the shard lock routing
    /// reads: tens of ms at a 4M-fingerprint join or resync.
    #[test]
    fn a_snapshot_is_built_before_the_lock_and_swapped_in_under_it() {
        let t = PeerTable::default();
        let a = NodeId::from("a");
        let cfg = GossipConfig::default();
        t.member_up(&me(), &member("a", 1), Instant::now());
        let mut local = LocalSummary::new();
        for fp in 0..100 {
            local.record_add(fp);
        }
        let mut first = Prepared::new(of_a(Some(local.snapshot()), None));
        assert!(first.holds_summary(), "the set is built when prepared");
        let mut e = t.peers.get_mut(&a).unwrap();
        e.receive(&me(), &a, &mut first, 0, &cfg).unwrap();
        assert!(!first.holds_summary(), "nothing was held before");
        holds(&e, &local).unwrap();
        for fp in 100..150 {
            local.record_add(fp);
        }
        let mut second = Prepared::new(of_a(Some(local.snapshot()), None));
        e.receive(&me(), &a, &mut second, 0, &cfg).unwrap();
        assert!(second.holds_summary(), "the replaced set comes back");
        holds(&e, &local).unwrap();
        // An older snapshot is not applied: its set comes back, unused.
        let mut old = Prepared::new(of_a(Some(SummarySnapshot::default()), None));
        e.receive(&me(), &a, &mut old, 0, &cfg).unwrap();
        assert!(old.holds_summary());
        holds(&e, &local).unwrap();
        // Taken once: a second take does nothing.
        e.receive(&me(), &a, &mut old, 0, &cfg).unwrap();
        holds(&e, &local).unwrap();
    }

    /// Deltas taken while a snapshot is being built (after it is prepared, before it
    /// is taken) are neither lost nor applied twice: one that follows the snapshot
    /// waits for it, one it covers is applied and then replaced by the same set.
    #[test]
    fn deltas_taken_while_a_snapshot_is_built_are_neither_lost_nor_doubled() {
        let cfg = GossipConfig::default();
        let a = NodeId::from("a");
        let mut local = LocalSummary::new();
        let change = |local: &mut LocalSummary, from: u32| {
            for fp in from..from + 10 {
                local.record_add(fp);
            }
            local.record_remove(from);
        };
        change(&mut local, 0);
        let v0 = local.version();
        let s0 = local.snapshot();
        change(&mut local, 100);
        let covered = local.delta_since(v0).unwrap();
        let snapshot = local.snapshot();
        let vs = local.version();
        change(&mut local, 200);
        let follows = local.delta_since(vs).unwrap();
        // Held nothing, or held v0: the delta the snapshot covers, the one that
        // follows it, or both, taken while it is built.
        for (start, during) in [
            (None, vec![follows.clone()]),
            (Some(s0.clone()), vec![covered.clone()]),
            (Some(s0.clone()), vec![follows.clone()]),
            (Some(s0.clone()), vec![covered.clone(), follows.clone()]),
            (Some(s0.clone()), vec![follows.clone(), covered.clone()]),
        ] {
            let t = PeerTable::default();
            t.member_up(&me(), &member("a", 1), Instant::now());
            let mut e = t.peers.get_mut(&a).unwrap();
            if let Some(s0) = start.clone() {
                let mut m = Prepared::new(of_a(Some(s0), None));
                e.receive(&me(), &a, &mut m, 0, &cfg).unwrap();
            }
            let mut building = Prepared::new(of_a(Some(snapshot.clone()), None));
            for d in &during {
                let mut m = Prepared::new(of_a(None, Some(d.clone())));
                e.receive(&me(), &a, &mut m, 1, &cfg).unwrap();
            }
            e.receive(&me(), &a, &mut building, 2, &cfg).unwrap();
            let case = format!(
                "from {:?}, {} deltas",
                start.map(|s| s.version),
                during.len()
            );
            if during.iter().any(|d| d.from_version == vs) {
                holds(&e, &local)
                    .map_err(|m| format!("{case}: {m}"))
                    .unwrap();
            } else {
                // Up to the snapshot; the next delta follows on.
                let mut m = Prepared::new(of_a(None, Some(follows.clone())));
                e.receive(&me(), &a, &mut m, 3, &cfg).unwrap();
                holds(&e, &local)
                    .map_err(|m| format!("{case}: {m}"))
                    .unwrap();
            }
            assert_eq!(e.engines[0].gossip.pending(), 0, "{case}");
        }
    }

    /// The measurement of docs/cluster.md, "Snapshots off the lock": how long the
    /// peer's shard lock (which routing reads on every request) is held while a
    /// 4M-fingerprint snapshot replaces a 4M one, as before (built and the old set
    /// freed under it) and now. Run in release:
    /// `cargo test --release -p gorgo-cluster --lib -- --ignored --nocapture measure_`.
    #[test]
    #[ignore = "measurement: prints figures"]
    fn measure_lock_hold_applying_a_4m_fingerprint_snapshot() {
        use std::time::Instant as Clock;
        let cfg = GossipConfig::default();
        let (t, a) = (PeerTable::default(), NodeId::from("a"));
        t.member_up(&me(), &member("a", 1), Instant::now());
        let n: u32 = 4_000_000;
        let snapshot = |version: u64, salt: u32| SummarySnapshot {
            version,
            fingerprints: (0..n)
                .map(|i| i.wrapping_mul(2_654_435_761) ^ salt)
                .collect(),
            ..Default::default()
        };
        let mut version = 1;
        let mut apply = |early: bool| {
            version += 1;
            let msg = of_a(Some(snapshot(version, version as u32)), None);
            let t0 = Clock::now();
            let mut prepared = early.then(|| Prepared::new(msg.clone()));
            let built = t0.elapsed();
            let t1 = Clock::now();
            let mut guard = t.peers.get_mut(&a).unwrap();
            let mut msg = prepared.take().unwrap_or_else(|| Prepared::new(msg));
            guard.receive(&me(), &a, &mut msg, 0, &cfg).unwrap();
            if !early {
                drop(msg);
                drop(guard);
                return (built, t1.elapsed());
            }
            drop(guard);
            let held = t1.elapsed();
            drop(msg);
            (built, held)
        };
        apply(true);
        for _ in 0..3 {
            let (_, before) = apply(false);
            let (built, now) = apply(true);
            println!(
                "{n} fingerprints replacing {n}: shard lock held {:.1} ms before, \
                 {:.3} ms now (set built outside it in {:.1} ms)",
                before.as_secs_f64() * 1e3,
                now.as_secs_f64() * 1e3,
                built.as_secs_f64() * 1e3
            );
        }
    }

    proptest::proptest! {
        /// Whenever a snapshot is prepared and whatever deltas are taken before it is
        /// taken, the peer ends where it would have had the snapshot been received
        /// whole when taken (the path before snapshots were built off the lock), and,
        /// once every delta is in, holds the sender's summary.
        #[test]
        fn a_snapshot_prepared_early_ends_where_one_received_whole_does(
            changes in proptest::collection::vec((0u32..64, proptest::bool::ANY), 1..60),
            cut in 0usize..6,
            order in proptest::collection::vec(0usize..100, 6),
            prepared_at in 0usize..7,
        ) {
            let cfg = GossipConfig::default();
            let a = NodeId::from("a");
            // The sender's stream: deltas of 6 rounds, a snapshot after round `cut`.
            let mut local = LocalSummary::new();
            let (mut deltas, mut snapshot) = (Vec::new(), None);
            let per_round = changes.len().div_ceil(6);
            for (round, chunk) in changes.chunks(per_round).enumerate() {
                let from = local.version();
                for &(fp, add) in chunk {
                    if add { local.record_add(fp) } else { local.record_remove(fp) }
                }
                deltas.push(local.delta_since(from).unwrap());
                if round == cut {
                    snapshot = Some(local.snapshot());
                }
            }
            let snapshot = snapshot.unwrap_or_else(|| local.snapshot());
            // Deltas in a shuffled order; the snapshot is taken after all of them, and
            // prepared after the first `prepared_at`.
            let mut shuffled: Vec<(usize, SummaryDelta)> =
                order.iter().copied().zip(deltas.iter().cloned()).collect();
            shuffled.sort_by_key(|(k, _)| *k);
            let run = |early: bool| {
                let t = PeerTable::default();
                t.member_up(&me(), &member("a", 1), Instant::now());
                let mut e = t.peers.get_mut(&a).unwrap();
                let mut building = None;
                for (i, (_, d)) in shuffled.iter().enumerate() {
                    if early && i == prepared_at {
                        building = Some(Prepared::new(of_a(Some(snapshot.clone()), None)));
                    }
                    let mut m = Prepared::new(of_a(None, Some(d.clone())));
                    let _ = e.receive(&me(), &a, &mut m, 0, &cfg);
                }
                let mut s = building
                    .unwrap_or_else(|| Prepared::new(of_a(Some(snapshot.clone()), None)));
                let _ = e.receive(&me(), &a, &mut s, 0, &cfg);
                // Then every delta again, in order, as the sender would resend them
                // after a snapshot request: nothing was lost.
                let h = e.engines[0].gossip.summary().map(|s| (s.version(), s.len()));
                let pending = e.engines[0].gossip.pending();
                for d in &deltas {
                    let mut m = Prepared::new(of_a(None, Some(d.clone())));
                    let _ = e.receive(&me(), &a, &mut m, 0, &cfg);
                }
                (h, pending, holds(&e, &local))
            };
            let (early, whole) = (run(true), run(false));
            proptest::prop_assert_eq!(&early, &whole);
            proptest::prop_assert_eq!(early.2, Ok(()));
        }
    }

    #[test]
    fn a_new_runs_state_heard_before_its_identity_is_kept() {
        let config = GossipConfig::default();
        let t = PeerTable::default();
        let a = NodeId::from("a");
        let of_run = |incarnation: u64| {
            let mut msg = summary_msg(0, None);
            if let GossipMessage::SummarySnapshot { stats, .. } = &mut msg {
                stats.incarnation = incarnation;
            }
            msg
        };
        let held = |t: &PeerTable| {
            t.peers.get(&a).unwrap().engines[0]
                .gossip
                .summary()
                .is_some()
        };
        t.member_up(&me(), &member("a", 1), Instant::now());
        t.peers
            .get_mut(&a)
            .unwrap()
            .receive(&me(), &a, &mut Prepared::new(of_run(1)), 0, &config)
            .unwrap();
        // Membership vouches for the run held (the run heard does not change).
        assert!(!t.vouch_run(&member("a", 1), 1));
        // The restart: run 2's snapshot first, then its identity.
        t.peers
            .get_mut(&a)
            .unwrap()
            .receive(&me(), &a, &mut Prepared::new(of_run(2)), 0, &config)
            .unwrap();
        assert!(held(&t));
        t.member_up(&me(), &member("a", 2), Instant::now());
        assert!(held(&t), "run 2's summary was let go");
        // Membership vouches for run 2; a later rejoin of it lets go, as before.
        assert!(!t.vouch_run(&member("a", 2), 2));
        t.member_up(&me(), &member("a", 3), Instant::now());
        assert!(!held(&t));
    }

    /// A peer's first snapshot dropped because the table did not hold it yet: once
    /// membership brings the peer in, its first delta asks for a snapshot at once.
    /// Without the drop, the delta waits for the snapshot presumed on its way.
    #[test]
    fn a_snapshot_dropped_before_the_peer_was_held_is_asked_for_at_the_first_delta() {
        let config = GossipConfig::default();
        // Whether the drop is marked, and whether the mark lands after membership made
        // the entry (the driver looked before, the mark comes after).
        for (dropped, late, asks) in [
            (false, false, false),
            (true, false, true),
            (true, true, true),
        ] {
            let t = PeerTable::default();
            let a = NodeId::from("a");
            if dropped && !late {
                t.dropped_before_entry(&a);
            }
            t.member_up(&me(), &member("a", 1), Instant::now());
            if dropped && late {
                t.dropped_before_entry(&a);
            }
            assert!(t.dropped_before_entry.is_empty());
            let mut e = t.peers.get_mut(&a).unwrap();
            let got = e
                .receive(
                    &me(),
                    &a,
                    &mut Prepared::new(summary_msg(0, Some((1, 2)))),
                    0,
                    &config,
                )
                .unwrap();
            assert_eq!(got.reply.is_some(), asks, "dropped {dropped}, late {late}");
        }
    }

    #[test]
    fn a_peers_reorder_buffers_are_capped_across_its_engines() {
        let t = PeerTable::default();
        let now = Instant::now();
        let a = NodeId::from("a");
        t.member_up(&me(), &member("a", 1), now);
        let mut e = t.peers.get_mut(&a).unwrap();
        // What the driver does with a message (`gossip::handle_frame`).
        fn take(
            e: &mut PeerEntry,
            replica: u16,
            msg: GossipMessage,
            config: &GossipConfig,
        ) -> Option<GossipMessage> {
            e.receive(&me(), &"a".into(), &mut Prepared::new(msg), 0, config)
                .unwrap();
            e.limit_pending(replica, &me(), 0, config)
        }
        // Room for two deltas of 1,000 fingerprints, whichever engines hold them.
        let one = {
            let mut p = PeerGossip::new();
            let cfg = GossipConfig::default();
            p.receive(0, &me(), &a, summary_msg(0, None), 0, &cfg)
                .unwrap();
            p.receive(0, &me(), &a, summary_msg(0, Some((3, 1_000))), 0, &cfg)
                .unwrap();
            p.pending_bytes()
        };
        let cfg = GossipConfig {
            max_peer_pending_bytes: 2 * one,
            ..Default::default()
        };
        for r in 0..3 {
            assert!(take(&mut e, r, summary_msg(r, None), &cfg).is_none());
        }
        assert!(take(&mut e, 0, summary_msg(0, Some((3, 1_000))), &cfg).is_none());
        assert!(take(&mut e, 1, summary_msg(1, Some((3, 1_000))), &cfg).is_none());
        // The third, on another engine, takes the peer over: that engine's buffer goes
        // and it is asked for a snapshot; the others keep theirs.
        let request = take(&mut e, 2, summary_msg(2, Some((3, 1_000))), &cfg);
        assert!(
            matches!(
                request,
                Some(GossipMessage::SnapshotRequest { replica: 2, .. })
            ),
            "{request:?}"
        );
        let held: Vec<usize> = e.engines.iter().map(|h| h.gossip.pending()).collect();
        assert_eq!(held, [1, 1, 0]);
        // Engine 0's gap fills: its room is free again, and a delta past a gap on
        // engine 2 waits.
        assert!(take(&mut e, 0, summary_msg(0, Some((1, 0))), &cfg).is_none());
        assert!(take(&mut e, 0, summary_msg(0, Some((2, 0))), &cfg).is_none());
        assert_eq!(e.engines[0].gossip.summary().unwrap().version(), 4);
        assert!(take(&mut e, 2, summary_msg(2, Some((3, 1_000))), &cfg).is_none());
        assert_eq!(e.engines[2].gossip.pending(), 1);
    }

    #[test]
    fn a_peers_summaries_are_capped_across_its_engines() {
        let t = PeerTable::default();
        let a = NodeId::from("a");
        t.member_up(&me(), &member("a", 1), Instant::now());
        let mut e = t.peers.get_mut(&a).unwrap();
        // Room for 10 fingerprints, whichever engines hold them.
        let cfg = GossipConfig {
            max_peer_fingerprints: 10,
            ..Default::default()
        };
        for r in 0..2 {
            e.receive(&me(), &a, &mut Prepared::new(summary_msg(r, None)), 0, &cfg)
                .unwrap();
        }
        e.receive(
            &me(),
            &a,
            &mut Prepared::new(summary_msg(0, Some((1, 6)))),
            0,
            &cfg,
        )
        .unwrap();
        // Six more on engine 1 would hold 12: refused (the driver counts it
        // malformed), engine 1 unchanged.
        let refused = e.receive(
            &me(),
            &a,
            &mut Prepared::new(summary_msg(1, Some((1, 6)))),
            0,
            &cfg,
        );
        assert!(
            matches!(&refused, Err(CoreError::Malformed(m)) if m.contains("12")),
            "{refused:?}"
        );
        let held = |e: &PeerEntry, r: usize| {
            let s = e.engines[r].gossip.summary().unwrap();
            (s.version(), s.len())
        };
        assert_eq!((held(&e, 0), held(&e, 1)), ((2, 6), (1, 0)));
        // Four fit.
        e.receive(
            &me(),
            &a,
            &mut Prepared::new(summary_msg(1, Some((1, 4)))),
            0,
            &cfg,
        )
        .unwrap();
        assert_eq!(held(&e, 1), (2, 4));
    }

    #[test]
    fn a_tick_lets_go_of_every_peers_timed_out_gaps_and_asks_only_the_alive() {
        let t = PeerTable::default();
        let now = Instant::now();
        let cfg = GossipConfig::default();
        for (peer, replicas) in [("a", vec![0, 2]), ("b", vec![1])] {
            t.member_up(
                &me(),
                &member_at(peer, 1, &format!("10.0.0.{}:1", replicas[0] + 1)),
                now,
            );
            let mut e = t.peers.get_mut(&NodeId::from(peer)).unwrap();
            for r in replicas {
                let from = NodeId::from(peer);
                for msg in [None, Some((3, 1))] {
                    let msg = summary_msg_of(peer, r, msg);
                    e.receive(&me(), &from, &mut Prepared::new(msg), 0, &cfg)
                        .unwrap();
                }
                assert_eq!(e.engines[r as usize].gossip.pending(), 1);
            }
        }
        t.member_down(&member_at("b", 1, "10.0.0.2:1"), now);
        assert!(t
            .tick_gossip(&me(), cfg.gap_timeout_ms - 1, &cfg)
            .is_empty());
        let mut asked: Vec<(String, u16)> = t
            .tick_gossip(&me(), cfg.gap_timeout_ms, &cfg)
            .into_iter()
            .map(|(peer, req)| (peer.0, gorgo_core::gossip::replica(&req)))
            .collect();
        asked.sort();
        assert_eq!(asked, [("a".to_owned(), 0), ("a".to_owned(), 2)]);
        for e in t.peers.iter() {
            assert!(
                e.engines.iter().all(|h| h.gossip.pending() == 0),
                "{}",
                e.key()
            );
        }
    }

    #[test]
    fn rtt_is_an_ewma_with_alpha_point_three() {
        let t = PeerTable::default();
        let now = Instant::now();
        t.member_up(&me(), &member("a", 1), now);
        t.record_rtt(&NodeId::from("a"), 100.0);
        t.record_rtt(&NodeId::from("a"), 200.0);
        let v = t.views(now);
        assert!((v[0].rtt_ms.unwrap() - 130.0).abs() < 1e-9);
    }

    #[test]
    fn stale_stats_are_dropped_and_down_peers_are_not_candidates() {
        let t = PeerTable::default();
        let now = Instant::now();
        let a = NodeId::from("a");
        t.member_up(&me(), &member("a", 1), now);
        let s = |v| QueueStats {
            version: v,
            ..Default::default()
        };
        assert!(t.offer_stats(&a, &s(2), now));
        assert!(!t.offer_stats(&a, &s(2), now));
        assert!(!t.offer_stats(&a, &s(1), now));
        assert!(t.offer_stats(&a, &s(3), now));
        assert_eq!(t.alive_ids(), vec![a.clone()]);
        // A down notice about an older generation does not take the new one down.
        t.member_up(&me(), &member("a", 2), now);
        t.member_down(&member("a", 1), now);
        assert_eq!(t.alive_ids(), vec![a.clone()]);
        t.member_down(&member("a", 2), now);
        assert!(t.alive_ids().is_empty());
        assert!(!t.views(now)[0].alive);
        // Down entries stay while foca remembers the member, then go; live ones stay.
        t.member_up(&me(), &member("b", 1), now);
        let after = std::time::Duration::from_secs(60);
        assert_eq!(t.forget_down(now + after, after), 0);
        assert_eq!(t.views(now).len(), 2);
        assert_eq!(t.forget_down(now + after * 2, after), 1);
        let left: Vec<NodeId> = t.views(now).into_iter().map(|v| v.id).collect();
        assert_eq!(left, vec![NodeId::from("b")]);
        // Heard of again, it is a peer as before.
        assert_eq!(t.member_up(&me(), &member("a", 3), now), Claim::Accepted);
        assert_eq!(t.alive_ids().len(), 2);
    }

    #[test]
    fn a_restarted_peers_stats_replace_its_dead_runs_whatever_their_versions() {
        let t = PeerTable::default();
        let now = Instant::now();
        let a = NodeId::from("a");
        let run = |incarnation, version, running| QueueStats {
            incarnation,
            version,
            running,
            ..Default::default()
        };
        t.member_up(&me(), &member("a", 100), now);
        assert!(t.offer_stats(&a, &run(100, 2_272, 4), now));
        // kill -9 and restart: a new generation at the same address, stats versions
        // from 1 again.
        t.member_up(&me(), &member("a", 200), now);
        assert!(t.offer_stats(&a, &run(200, 661, 0), now));
        // The dead run's last stats, still disseminated by a third node, stay out.
        assert!(!t.offer_stats(&a, &run(100, 2_273, 4), now));
        let v = &t.views(now)[0];
        assert_eq!(v.stats.as_ref().map(|s| s.running), Some(0));
        assert_eq!(v.incarnation, Some(200));
    }

    /// Review finding 4: a restarted peer's dead run fronted engines 0 and 1, the
    /// new run fronts engine 0. The dead run's late stats for engine 1, or for an
    /// engine the table never held, stay out: the run heard is the peer's, not each
    /// engine's. Before, both came back (routing candidates with a dead run's stats
    /// that the new run never replaces).
    #[test]
    fn a_dead_runs_stats_for_another_engine_stay_out() {
        let t = PeerTable::default();
        let now = Instant::now();
        let a = NodeId::from("a");
        let run = |incarnation, version, replica| QueueStats {
            incarnation,
            version,
            replica,
            ..Default::default()
        };
        t.member_up(&me(), &member("a", 100), now);
        assert!(t.offer_stats(&a, &run(100, 50, 0), now));
        assert!(t.offer_stats(&a, &run(100, 50, 1), now));
        // Restarted with one engine: its engine 0 speaks first; engine 1 is let go.
        t.member_up(&me(), &member("a", 200), now);
        assert!(t.offer_stats(&a, &run(200, 1, 0), now));
        let engine1 = &t.views(now)[0].engines[1];
        assert!(engine1.stats.is_none() && engine1.stats_age_ms.is_none());
        // The dead run's stats, late, for engine 1 and for an engine never held.
        assert!(!t.offer_stats(&a, &run(100, 51, 1), now));
        assert!(!t.offer_stats(&a, &run(100, 51, 3), now));
        let v = &t.views(now)[0];
        let held: Vec<_> = v
            .engines
            .iter()
            .map(|e| e.stats.as_ref().map(|s| s.order()))
            .collect();
        assert_eq!(held[..2], [Some((200, 1)), None]);
        assert!(held[2..].iter().all(Option::is_none), "{held:?}");
        assert_eq!(v.incarnation, Some(200));
    }

    /// Review finding 3: a node restarted elsewhere on a clock 5 s behind its previous
    /// start (its incarnation and default generation are lower than its dead run's).
    /// Membership accepts the new identity; its first stats broadcast vouches for its
    /// run, which is heard from then on, and the dead run's late stats stay out.
    /// Before, every stats copy and summary message of the live run was dropped as an
    /// older run's, for as long as it ran: never a routing candidate.
    #[test]
    fn a_restart_whose_clock_is_behind_is_heard_once_membership_vouches_for_it() {
        let t = PeerTable::default();
        let now = Instant::now();
        let a = NodeId::from("a");
        let run = |incarnation, version| QueueStats {
            incarnation,
            version,
            ..Default::default()
        };
        let first = member("a", 1_000_000);
        t.member_up(&me(), &first, now);
        assert!(t.vouch_run(&first, 1_000_000), "the first run heard");
        assert!(t.offer_stats(&a, &run(1_000_000, 5), now));
        let later = now + std::time::Duration::from_secs(5);
        assert!(t.member_down(&first, later));
        let restarted = member_at("a", 995_000, "10.0.0.2:1");
        assert_eq!(t.member_up(&me(), &restarted, later), Claim::Accepted);
        // Not vouched for yet: an older run for all the table knows.
        assert!(!t.offer_stats(&a, &run(995_000, 1), later));
        // A broadcast of the dead identity vouches for nothing.
        assert!(!t.vouch_run(&first, 1_000_000));
        // The new identity's first broadcast does (the stats handler vouches, then
        // offers the same stats).
        assert!(t.vouch_run(&restarted, 995_000));
        assert!(t.offer_stats(&a, &run(995_000, 2), later));
        let v = &t.views(later)[0];
        assert!(v.alive);
        assert_eq!(v.incarnation, Some(995_000));
        assert_eq!(v.stats.as_ref().map(|s| s.order()), Some((995_000, 2)));
        // The dead run's late stats stay out though newer.
        assert!(!t.offer_stats(&a, &run(1_000_000, 6), later));
        assert!(t.offer_stats(&a, &run(995_000, 3), later));
    }

    #[test]
    fn a_node_id_is_bound_to_one_live_address() {
        let t = PeerTable::default();
        let now = Instant::now();
        let a = NodeId::from("a");
        let genuine = member_at("a", 1, "10.0.0.1:7000");
        let impostor = member_at("a", 9, "10.0.0.9:7000");
        assert_eq!(t.member_up(&me(), &genuine, now), Claim::Accepted);
        // Same id from another address while the first is alive: refused, and the
        // table still holds the genuine node.
        let refused = Claim::Conflict {
            bound: genuine.addr,
        };
        assert_eq!(t.member_up(&me(), &impostor, now), refused);
        assert_eq!(t.claim(&me(), &a, impostor.addr), refused);
        assert_eq!(t.views(now)[0].addr, genuine.addr);
        // The impostor dying does not take the genuine node down with it.
        assert!(!t.member_down(&impostor, now));
        assert_eq!(t.alive_ids(), vec![a.clone()]);
        // A restart at the same address is the same node.
        let restarted = member_at("a", 2, "10.0.0.1:7000");
        assert_eq!(t.member_up(&me(), &restarted, now), Claim::Accepted);
        assert_eq!(t.alive_generation(&a), Some(2));
        // Once it is declared down, the id may come back from another address (a node
        // restarted elsewhere).
        assert!(t.member_down(&restarted, now));
        assert_eq!(t.member_up(&me(), &impostor, now), Claim::Accepted);
        assert_eq!(t.bound_addr(&a), Some(impostor.addr));
        // And a node never lists itself among its peers.
        let me_elsewhere = member_at("me", 5, "10.0.0.5:7000");
        assert_eq!(t.member_up(&me(), &me_elsewhere, now), Claim::Ours);
        assert!(t.views(now).iter().all(|v| v.id != me()));
        // Nor an id no node can have (a member relaying made-up ones).
        for bad in ["", "UPPER", "a b", "-a", &"x".repeat(64)] {
            let made_up = member_at(bad, 1, "10.0.0.7:7000");
            assert_eq!(t.member_up(&me(), &made_up, now), Claim::Invalid, "{bad:?}");
        }
        assert_eq!(t.alive_ids(), vec![a.clone()]);
    }

    /// Members heard of second-hand fill the table only up to MAX_PEERS; one it holds
    /// already still comes up (a restart, a rejoin).
    #[test]
    fn the_table_holds_at_most_max_peers() {
        let t = PeerTable::default();
        let now = Instant::now();
        for i in 0..MAX_PEERS {
            let m = member_at(
                &format!("n{i}"),
                1,
                &format!("10.0.{}.{}:7000", i / 250, i % 250),
            );
            assert_eq!(t.member_up(&me(), &m, now), Claim::Accepted);
        }
        let extra = member_at("extra", 1, "10.9.0.1:7000");
        assert_eq!(t.member_up(&me(), &extra, now), Claim::Full);
        assert!(!t.is_alive(&extra.node));
        let rejoin = member_at("n0", 2, "10.0.0.0:7000");
        assert_eq!(t.member_up(&me(), &rejoin, now), Claim::Accepted);
    }

    #[test]
    fn a_live_members_address_is_not_claimed_under_another_id() {
        let t = PeerTable::default();
        let now = Instant::now();
        let a = member_at("a", 1, "10.0.0.1:7000");
        assert_eq!(t.member_up(&me(), &a, now), Claim::Accepted);
        // The holder itself, and its restart at the address, are accepted.
        assert_eq!(t.sender_claim(&me(), &a.node, a.addr), Claim::Accepted);
        // Another id at its address is refused while it is alive ...
        let b = member_at("b", 9, "10.0.0.1:7000");
        let taken = Claim::AddressTaken {
            holder: a.node.clone(),
        };
        assert_eq!(t.sender_claim(&me(), &b.node, b.addr), taken);
        // ... as a sender only: the rules for the id itself are unchanged.
        assert_eq!(t.claim(&me(), &b.node, b.addr), Claim::Accepted);
        // Anywhere else it is accepted, and so it is at the address once the holder is
        // declared down (a new node on a dead node's host).
        let elsewhere: SocketAddr = "10.0.0.2:7000".parse().unwrap();
        assert_eq!(t.sender_claim(&me(), &b.node, elsewhere), Claim::Accepted);
        assert!(t.member_down(&a, now));
        assert_eq!(t.sender_claim(&me(), &b.node, b.addr), Claim::Accepted);
        assert!(!t.holds_alive(&a));
        assert_eq!(t.member_up(&me(), &b, now), Claim::Accepted);
        assert!(t.holds_alive(&b));
        assert!(!t.holds_alive(&member_at("b", 10, "10.0.0.1:7000")));
    }

    #[test]
    fn staleness_window_is_bounded() {
        let m = ClusterMetrics::default();
        for i in 0..(STALENESS_WINDOW as u64 + 10) {
            m.record_staleness(i);
        }
        let s = m.staleness_samples();
        assert_eq!(s.len(), STALENESS_WINDOW);
        assert_eq!(s[0], 10);
    }
}
