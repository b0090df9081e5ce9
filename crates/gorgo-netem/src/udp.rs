//! The UDP relay: datagrams keep their boundaries and each gets its own delay.
//!
//! Every distinct source gets a dedicated upstream socket (a NAT-like table,
//! bounded, with idle expiry), so the target's replies come back through the
//! same socket, are delayed on the reverse link and leave from the listening
//! address to the right source. This is what QUIC between two nodes needs.
//!
//! Which link a datagram crosses can depend on its source IP
//! ([`SourceRoutes`]): one relay in front of a node then emulates every
//! peer's link to it, since each region sends from its own loopback address.
//! While that link's gate is down (a partition) its datagrams are dropped both
//! ways.

use std::cmp::Ordering as CmpOrdering;
use std::collections::{BinaryHeap, HashMap};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::net::UdpSocket;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::link::{DuplexLink, LiveShaper, Mode, Verdict};
use crate::relay::{is_due, now, wake_at, LinkGate, RelayHandle, RelayStats};
use crate::NetemError;

/// Largest datagram carried (the UDP maximum).
const MAX_DATAGRAM: usize = 65_535;

/// Limits of a UDP relay's session table.
#[derive(Clone, Debug)]
pub struct UdpRelayOptions {
    /// Most concurrent sources; packets from further new sources are dropped.
    pub max_sessions: usize,
    /// A source silent in both directions this long loses its session.
    pub idle_timeout: Duration,
}

impl Default for UdpRelayOptions {
    fn default() -> Self {
        UdpRelayOptions {
            max_sessions: 1024,
            idle_timeout: Duration::from_secs(120),
        }
    }
}

/// Which link a datagram crosses, chosen by the IP it comes from.
#[derive(Clone, Debug, Default)]
pub struct SourceRoutes {
    /// Sources with their own link (e.g. each peer region's loopback address).
    pub by_ip: Vec<(IpAddr, DuplexLink)>,
    /// The link for any other source; `None` drops their datagrams (counted as
    /// rejected flows).
    pub default: Option<DuplexLink>,
}

impl SourceRoutes {
    /// Every source crosses the same link.
    pub fn all(link: DuplexLink) -> Self {
        SourceRoutes {
            by_ip: Vec::new(),
            default: Some(link),
        }
    }

    fn lookup(&self, ip: IpAddr) -> Option<(LinkKey, &DuplexLink)> {
        match self.by_ip.iter().find(|(i, _)| *i == ip) {
            Some((i, link)) => Some((Some(*i), link)),
            None => self.default.as_ref().map(|l| (None, l)),
        }
    }
}

/// Which forward shaper a datagram used: its source IP's, or the default's.
type LinkKey = Option<IpAddr>;

/// Starts UDP relays; see the module docs.
#[derive(Debug)]
pub struct UdpRelay;

impl UdpRelay {
    /// Listens on `listen` and relays every source's datagrams to `target`
    /// over `link`, with default table limits. `seed` drives loss and jitter.
    pub async fn start(
        listen: SocketAddr,
        target: SocketAddr,
        link: DuplexLink,
        seed: u64,
    ) -> Result<RelayHandle, NetemError> {
        Self::start_with(listen, target, link, seed, UdpRelayOptions::default()).await
    }

    /// [`start`](Self::start) with explicit session-table limits.
    pub async fn start_with(
        listen: SocketAddr,
        target: SocketAddr,
        link: DuplexLink,
        seed: u64,
        options: UdpRelayOptions,
    ) -> Result<RelayHandle, NetemError> {
        Self::start_routed(listen, target, SourceRoutes::all(link), seed, options).await
    }

    /// A relay whose link depends on each datagram's source IP.
    pub async fn start_routed(
        listen: SocketAddr,
        target: SocketAddr,
        routes: SourceRoutes,
        seed: u64,
        options: UdpRelayOptions,
    ) -> Result<RelayHandle, NetemError> {
        let socket = UdpSocket::bind(listen)
            .await
            .map_err(|source| NetemError::Bind {
                addr: listen,
                source,
            })?;
        let local_addr = socket.local_addr().map_err(|source| NetemError::Bind {
            addr: listen,
            source,
        })?;
        let cancel = CancellationToken::new();
        let tracker = TaskTracker::new();
        let stats = Arc::new(RelayStats::default());
        let relay = Forwarder {
            listen: Arc::new(socket),
            target,
            upstream_ip: upstream_ip(local_addr.ip(), target.ip()),
            shapers: HashMap::new(),
            routes,
            seed,
            options,
            sessions: HashMap::new(),
            queue: DelayQueue::default(),
            epoch: now(),
            stats: stats.clone(),
            cancel: cancel.clone(),
            tracker: tracker.clone(),
        };
        tracker.spawn(relay.run());
        Ok(RelayHandle {
            local_addr,
            cancel,
            tracker,
            stats,
        })
    }
}

/// The address upstream sockets bind to: the listening address's IP when both
/// ends are loopback (so each region's traffic leaves from its own 127.0.0.x),
/// else the unspecified address of the target's family.
fn upstream_ip(listen: IpAddr, target: IpAddr) -> IpAddr {
    if listen.is_loopback() && target.is_loopback() && listen.is_ipv4() == target.is_ipv4() {
        listen
    } else if target.is_ipv4() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    }
}

/// A datagram waiting for its delivery time.
struct Pending {
    due: Instant,
    seq: u64,
    link: LinkKey,
    payload: Bytes,
    via: Arc<UdpSocket>,
    /// Destination for an unconnected `via`; `None` when `via` is connected.
    dest: Option<SocketAddr>,
}

impl PartialEq for Pending {
    fn eq(&self, other: &Self) -> bool {
        (self.due, self.seq) == (other.due, other.seq)
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, other: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}
impl Ord for Pending {
    // Reversed: BinaryHeap is a max-heap and we want the earliest first.
    fn cmp(&self, other: &Self) -> CmpOrdering {
        (other.due, other.seq).cmp(&(self.due, self.seq))
    }
}

/// A delay queue of datagrams, sending each at its time.
#[derive(Default)]
struct DelayQueue {
    heap: BinaryHeap<Pending>,
    /// Tie-breaker so equal delivery times keep arrival order.
    seq: u64,
}

impl DelayQueue {
    fn push(
        &mut self,
        due: Instant,
        link: LinkKey,
        payload: &[u8],
        via: Arc<UdpSocket>,
        dest: Option<SocketAddr>,
    ) {
        self.seq += 1;
        self.heap.push(Pending {
            due,
            seq: self.seq,
            link,
            payload: Bytes::copy_from_slice(payload),
            via,
            dest,
        });
    }

    fn next_wake(&self) -> Option<tokio::time::Instant> {
        self.heap.peek().map(|p| wake_at(p.due))
    }

    /// Sends everything due; returns the bytes sent or abandoned per link (to release).
    async fn send_due(&mut self, stats: &RelayStats) -> Vec<(LinkKey, usize)> {
        let mut released = Vec::new();
        let now = now();
        while self.heap.peek().is_some_and(|p| is_due(p.due, now)) {
            let Some(p) = self.heap.pop() else { break };
            released.push((p.link, p.payload.len()));
            let sent = match p.dest {
                Some(dest) => p.via.send_to(&p.payload, dest).await,
                None => p.via.send(&p.payload).await,
            };
            match sent {
                Ok(n) => {
                    stats.add(&stats.bytes_out, n as u64);
                    stats.add(&stats.packets_out, 1);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "relay send failed");
                    stats.add(&stats.send_errors, 1);
                }
            }
        }
        released
    }
}

struct Session {
    upstream: Arc<UdpSocket>,
    /// Milliseconds since the relay's epoch of the last packet either way.
    last_active_ms: Arc<AtomicU64>,
    cancel: CancellationToken,
}

/// The task owning the listening socket, the session table and the
/// source-to-target delay queue.
struct Forwarder {
    listen: Arc<UdpSocket>,
    target: SocketAddr,
    upstream_ip: IpAddr,
    /// One shaper per link (source IP or default), shared by its sessions.
    shapers: HashMap<LinkKey, LiveShaper>,
    routes: SourceRoutes,
    seed: u64,
    options: UdpRelayOptions,
    sessions: HashMap<SocketAddr, Session>,
    queue: DelayQueue,
    epoch: Instant,
    stats: Arc<RelayStats>,
    cancel: CancellationToken,
    tracker: TaskTracker,
}

impl Forwarder {
    async fn run(mut self) {
        let mut buf = vec![0u8; MAX_DATAGRAM];
        let sweep_every = (self.options.idle_timeout / 2).max(Duration::from_millis(10));
        let mut sweep = tokio::time::interval(sweep_every);
        loop {
            let wake = self.queue.next_wake();
            tokio::select! {
                biased;
                _ = self.cancel.cancelled() => break,
                _ = tokio::time::sleep_until(wake.unwrap_or_else(tokio::time::Instant::now)), if wake.is_some() => {
                    for (link, len) in self.queue.send_due(&self.stats).await {
                        if let Some(shaper) = self.shapers.get_mut(&link) {
                            shaper.release(len);
                        }
                    }
                }
                received = self.listen.recv_from(&mut buf) => match received {
                    Ok((n, source)) => self.on_datagram(&buf[..n], source).await,
                    Err(e) if transient(&e) => continue,
                    Err(e) => {
                        tracing::warn!(error = %e, "udp relay receive failed; stopping");
                        break;
                    }
                },
                _ = sweep.tick() => self.expire_idle(),
            }
        }
        for (_, session) in self.sessions.drain() {
            session.cancel.cancel();
        }
        self.cancel.cancel();
    }

    fn elapsed_ms(&self) -> u64 {
        now().saturating_duration_since(self.epoch).as_millis() as u64
    }

    async fn on_datagram(&mut self, payload: &[u8], source: SocketAddr) {
        self.stats.add(&self.stats.packets_in, 1);
        self.stats.add(&self.stats.bytes_in, payload.len() as u64);
        if self
            .routes
            .lookup(source.ip())
            .is_some_and(|(_, link)| !link.gate.is_up())
        {
            // A partition: dropped before it opens or refreshes a session, as a
            // cut wire would; the session (if any) carries on after the heal.
            self.stats.add(&self.stats.partitioned, 1);
            return;
        }
        let elapsed = self.elapsed_ms();
        if self
            .sessions
            .get(&source)
            .is_some_and(|s| s.cancel.is_cancelled())
        {
            // Its reply task failed: start afresh.
            self.sessions.remove(&source);
        }
        let upstream = match self.sessions.get(&source) {
            Some(s) => {
                s.last_active_ms.store(elapsed, Ordering::Relaxed);
                s.upstream.clone()
            }
            None => match self.open_session(source).await {
                Some(u) => u,
                None => return,
            },
        };
        let Some((key, link)) = self.routes.lookup(source.ip()) else {
            return;
        };
        let seed = self.seed ^ key.map_or(0, ip_seed);
        let shaper = self
            .shapers
            .entry(key)
            .or_insert_with(|| link.to_target.shaper(Mode::Datagram, seed));
        match shaper.admit(now(), payload.len()) {
            Verdict::Deliver(due) => self.queue.push(due, key, payload, upstream, None),
            Verdict::Lost => self.stats.add(&self.stats.lost, 1),
            Verdict::Overflow => self.stats.add(&self.stats.overflowed, 1),
        }
    }

    async fn open_session(&mut self, source: SocketAddr) -> Option<Arc<UdpSocket>> {
        let Some((_, link)) = self.routes.lookup(source.ip()) else {
            self.stats.add(&self.stats.flows_rejected, 1);
            return None;
        };
        let (to_source, gate) = (link.to_source.clone(), link.gate.clone());
        if self.sessions.len() >= self.options.max_sessions {
            self.expire_idle();
        }
        if self.sessions.len() >= self.options.max_sessions {
            self.stats.add(&self.stats.flows_rejected, 1);
            return None;
        }
        let upstream = match bind_connected(SocketAddr::new(self.upstream_ip, 0), self.target).await
        {
            Ok(s) => Arc::new(s),
            Err(e) => {
                tracing::warn!(error = %e, %source, "udp relay cannot open upstream socket");
                self.stats.add(&self.stats.flows_rejected, 1);
                return None;
            }
        };
        let opened = self.stats.flows_opened.load(Ordering::Relaxed);
        self.stats.add(&self.stats.flows_opened, 1);
        self.stats.add(&self.stats.flows_active, 1);
        let last_active_ms = Arc::new(AtomicU64::new(self.elapsed_ms()));
        let cancel = self.cancel.child_token();
        let reverse = Reverse {
            upstream: upstream.clone(),
            listen: self.listen.clone(),
            source,
            shaper: to_source.shaper(
                Mode::Datagram,
                self.seed ^ (opened + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            ),
            gate,
            last_active_ms: last_active_ms.clone(),
            epoch: self.epoch,
            stats: self.stats.clone(),
            cancel: cancel.clone(),
        };
        self.tracker.spawn(reverse.run());
        self.sessions.insert(
            source,
            Session {
                upstream: upstream.clone(),
                last_active_ms,
                cancel,
            },
        );
        Some(upstream)
    }

    fn expire_idle(&mut self) {
        let now_ms = self.elapsed_ms();
        let idle_ms = self.options.idle_timeout.as_millis() as u64;
        self.sessions.retain(|source, s| {
            let idle = now_ms.saturating_sub(s.last_active_ms.load(Ordering::Relaxed)) >= idle_ms
                || s.cancel.is_cancelled();
            if idle {
                tracing::debug!(%source, "udp relay session expired");
                s.cancel.cancel();
            }
            !idle
        });
    }
}

/// A per-source-IP seed component, so each link draws its own sequence.
fn ip_seed(ip: IpAddr) -> u64 {
    let bits = match ip {
        IpAddr::V4(v4) => u64::from(u32::from(v4)),
        IpAddr::V6(v6) => {
            let b = u128::from(v6);
            (b as u64) ^ ((b >> 64) as u64)
        }
    };
    bits.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

async fn bind_connected(local: SocketAddr, target: SocketAddr) -> io::Result<UdpSocket> {
    let socket = UdpSocket::bind(local).await?;
    socket.connect(target).await?;
    Ok(socket)
}

/// Errors a UDP socket reports for an earlier datagram (ICMP unreachable) and
/// that say nothing about the socket itself.
fn transient(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
            | io::ErrorKind::WouldBlock
    )
}

/// One session's task: the target's replies, delayed, back to the source.
struct Reverse {
    upstream: Arc<UdpSocket>,
    listen: Arc<UdpSocket>,
    source: SocketAddr,
    shaper: LiveShaper,
    /// The source's link's gate: replies are dropped while it is down.
    gate: LinkGate,
    last_active_ms: Arc<AtomicU64>,
    epoch: Instant,
    stats: Arc<RelayStats>,
    cancel: CancellationToken,
}

impl Reverse {
    async fn run(mut self) {
        let mut buf = vec![0u8; MAX_DATAGRAM];
        let mut queue = DelayQueue::default();
        loop {
            let wake = queue.next_wake();
            tokio::select! {
                biased;
                _ = self.cancel.cancelled() => break,
                _ = tokio::time::sleep_until(wake.unwrap_or_else(tokio::time::Instant::now)), if wake.is_some() => {
                    for (_, len) in queue.send_due(&self.stats).await {
                        self.shaper.release(len);
                    }
                }
                received = self.upstream.recv(&mut buf) => match received {
                    Ok(n) => {
                        self.stats.add(&self.stats.packets_in, 1);
                        self.stats.add(&self.stats.bytes_in, n as u64);
                        if !self.gate.is_up() {
                            self.stats.add(&self.stats.partitioned, 1);
                            continue;
                        }
                        let at = now();
                        self.last_active_ms.store(
                            at.saturating_duration_since(self.epoch).as_millis() as u64,
                            Ordering::Relaxed,
                        );
                        match self.shaper.admit(at, n) {
                            Verdict::Deliver(due) => {
                                queue.push(due, None, &buf[..n], self.listen.clone(), Some(self.source))
                            }
                            Verdict::Lost => self.stats.add(&self.stats.lost, 1),
                            Verdict::Overflow => self.stats.add(&self.stats.overflowed, 1),
                        }
                    }
                    Err(e) if transient(&e) => continue,
                    Err(e) => {
                        tracing::warn!(error = %e, source = %self.source, "udp relay session failed");
                        break;
                    }
                },
            }
        }
        self.cancel.cancel();
        self.stats.sub(&self.stats.flows_active, 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The per-datagram charge covers at least the queue entry it stands for.
    #[test]
    fn the_datagram_overhead_covers_a_queue_entry() {
        let entry = std::mem::size_of::<Pending>();
        assert!(
            entry <= crate::DATAGRAM_OVERHEAD_BYTES,
            "a queued datagram's entry takes {entry} bytes"
        );
    }
}
