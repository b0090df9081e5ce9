//! The one place that owns client and admin connections: accept, caps, timeouts,
//! protocol, drain.
//!
//! `axum::serve` accepts every connection and keeps it for as long as the peer likes;
//! a node in front of an engine must not. Here each accepted connection first takes a
//! slot (a global cap kept under the process's descriptor limit, and a cap per client
//! IP), then is served by hyper's auto builder (HTTP/1.1, and HTTP/2 with prior
//! knowledge, "h2c") with a header-read timeout (for HTTP/2 heads too: `H2Heads`),
//! an idle timeout and a cap on the request head. A request that lies in the socket
//! when a timer expires (a node resumed after a stop) is read, not lost to the timer
//! (`ConnIo`). A connection that cannot get a slot is accepted and closed at once,
//! so it leaves the kernel's backlog instead of blocking the clients behind it.
//! An HTTP/1 answer that leaves its request body unread (413, 408) is followed by a
//! bounded lingering close, so that a client still sending reads the answer instead
//! of a reset.
//! Shutdown stops accepting, asks every connection to finish its in-flight requests
//! (HTTP/1 `Connection: close`, HTTP/2 GOAWAY) and waits up to a drain deadline.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, Response, StatusCode};
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
// The runtime's clock (virtual under `tokio::time::pause`): connections' idle and
// head waits are measured on the clock their timers run on.
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::api::error_response;

/// Descriptors kept back from the client port's connection cap: the admin port, the
/// engine client's pool, peers' QUIC socket, files. Without a reserve, idle clients
/// can take the last descriptor and `/readyz` stops answering.
pub const RESERVED_FDS: u64 = 1_024;

/// How long a stopping listener waits for its connections to close.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// The longest a connection reads on after a response that left its request body
/// unread (nginx's `lingering_timeout` default): long enough for a client still
/// sending to see the answer, short enough not to hold the connection for it.
pub const LINGER_TIME: Duration = Duration::from_secs(5);

/// Caps and timeouts of one listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Time to send a request head (and, for HTTP/1, the longest wait for the next
    /// request on a keep-alive connection; for a later HTTP/2 head, from its first
    /// byte or the end of the last request).
    pub header_timeout: Duration,
    /// A connection with no request in flight for this long is closed.
    pub idle_timeout: Duration,
    /// A connection whose client has not taken the response bytes waiting for it for
    /// this long is closed (`limits.write_timeout_ms`).
    pub write_timeout: Duration,
    /// Connections open at once.
    pub max_connections: usize,
    /// Connections open at once from one IP.
    pub max_per_ip: usize,
    /// Largest request head answered normally (431 above).
    pub max_header_bytes: usize,
    /// Most headers in a request head (431 above).
    pub max_headers: usize,
    /// How long shutdown waits for connections to close once asked to. A graceful
    /// stop drains before shutdown ([`crate::NodeHandle::drain`]), so this is short.
    pub close_grace: Duration,
    /// After an HTTP/1 response that left its request body unread (413, 408, 503...),
    /// the most bytes of that body read and thrown away before the connection closes.
    /// Closing on unread bytes makes the kernel reset the connection, and a client
    /// still sending loses the answer to the reset of its writes (a lingering close,
    /// as nginx's `lingering_close`).
    pub linger_bytes: usize,
    /// How long that reading on lasts at most.
    pub linger_time: Duration,
}

impl ConnLimits {
    /// The client port's limits from `[limits]`, the connection cap lowered to fit the
    /// descriptor limit (`fd_limit`) less [`RESERVED_FDS`]: each client connection
    /// costs one descriptor here and may cost one more towards the engine.
    pub fn client(limits: &crate::config::LimitsSection, fd_limit: Option<u64>) -> Self {
        let by_fds = fd_limit
            .map(|n| (n.saturating_sub(RESERVED_FDS) / 2).max(16) as usize)
            .unwrap_or(usize::MAX);
        ConnLimits {
            header_timeout: Duration::from_millis(limits.header_timeout_ms),
            idle_timeout: Duration::from_millis(limits.idle_timeout_ms),
            write_timeout: Duration::from_millis(limits.write_timeout_ms),
            max_connections: limits.max_connections.min(by_fds),
            max_per_ip: limits.max_connections_per_ip,
            max_header_bytes: limits.max_header_bytes,
            max_headers: 100,
            close_grace: CLOSE_GRACE,
            linger_bytes: limits.max_body_bytes,
            linger_time: linger_time(limits),
        }
    }

    /// The admin port's limits: few connections (operators, probes, scrapers), served
    /// from the descriptor reserve, the same timeouts.
    pub fn admin(limits: &crate::config::LimitsSection) -> Self {
        ConnLimits {
            header_timeout: Duration::from_millis(limits.header_timeout_ms),
            idle_timeout: Duration::from_millis(limits.idle_timeout_ms),
            write_timeout: Duration::from_millis(limits.write_timeout_ms),
            max_connections: 256,
            max_per_ip: 64,
            max_header_bytes: limits.max_header_bytes,
            max_headers: 100,
            close_grace: CLOSE_GRACE,
            linger_bytes: limits.max_body_bytes,
            linger_time: linger_time(limits),
        }
    }
}

/// [`LINGER_TIME`], or less where a client is given less to send a whole body: a
/// client never has longer to finish an unwanted body than a wanted one.
fn linger_time(limits: &crate::config::LimitsSection) -> Duration {
    LINGER_TIME.min(Duration::from_millis(limits.body_timeout_ms))
}

/// Raise the soft descriptor limit to the hard one (as Go's runtime and most servers
/// do) and return the limit now in force, `None` where it cannot be read.
pub fn raise_fd_limit() -> Option<u64> {
    rlimit::increase_nofile_limit(u64::MAX).ok()
}

/// Labels of connection counts.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConnLabels {
    /// `client` or `admin`.
    pub port: String,
}

/// Labels of refused connections.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusedLabels {
    /// `client` or `admin`.
    pub port: String,
    /// `max_connections`, `per_ip` (refused: no idle connection to evict),
    /// `evicted_max_connections`, `evicted_per_ip` (an idle connection was closed to
    /// make room), `header_timeout`, `idle`, `header_too_large`.
    pub reason: String,
}

/// The connection metrics a listener updates (handles into the node's registry).
#[derive(Debug, Clone, Default)]
pub struct ConnMetrics {
    /// Connections open now, by port.
    pub open: Family<ConnLabels, Gauge>,
    /// Connections refused or closed by a limit, by port and reason.
    pub refused: Family<RefusedLabels, Counter>,
}

impl ConnMetrics {
    fn refuse(&self, port: &str, reason: &str) {
        self.refused
            .get_or_create(&RefusedLabels {
                port: port.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }
    fn open_gauge(&self, port: &str) -> Gauge {
        self.open
            .get_or_create(&ConnLabels {
                port: port.to_owned(),
            })
            .clone()
    }
}

/// Most connections being evicted at once: the cap is exceeded by at most this many
/// while evicted connections close.
const MAX_EVICTING: usize = 64;

/// Open connections, in total and per IP, with what eviction needs of each.
#[derive(Debug, Default)]
struct Slots {
    total: usize,
    per_ip: HashMap<IpAddr, usize>,
    conns: HashMap<u64, Conn>,
    next_id: u64,
    evicting: usize,
}

/// One open connection as [`Slots`] sees it.
#[derive(Debug)]
struct Conn {
    ip: IpAddr,
    activity: Arc<Activity>,
    /// Cancelled to evict the connection.
    evict: CancellationToken,
    evicted: bool,
}

impl Slots {
    /// Evict the connection idle longest (no request in flight), from `ip` when given:
    /// a connection doing nothing yields its place to one that wants to do something.
    fn evict_idle(&mut self, ip: Option<IpAddr>) -> bool {
        if self.evicting >= MAX_EVICTING {
            return false;
        }
        let victim = self
            .conns
            .iter()
            .filter(|(_, c)| !c.evicted && ip.is_none_or(|ip| c.ip == ip))
            .filter(|(_, c)| c.activity.active.load(Ordering::Relaxed) == 0)
            .min_by_key(|(_, c)| c.activity.last_ms.load(Ordering::Relaxed))
            .map(|(&id, _)| id);
        let Some(id) = victim else { return false };
        if let Some(c) = self.conns.get_mut(&id) {
            c.evicted = true;
            c.evict.cancel();
        }
        self.evicting += 1;
        true
    }
}

/// One connection's claim on [`Slots`], released on drop.
struct Slot {
    slots: Arc<Mutex<Slots>>,
    id: u64,
    gauge: Gauge,
    activity: Arc<Activity>,
    evict: CancellationToken,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut s = self.slots.lock();
        s.total -= 1;
        if let Some(c) = s.conns.remove(&self.id) {
            if c.evicted {
                s.evicting -= 1;
            }
            if let Some(n) = s.per_ip.get_mut(&c.ip) {
                *n -= 1;
                if *n == 0 {
                    s.per_ip.remove(&c.ip);
                }
            }
        }
        self.gauge.dec();
    }
}

/// The client a connection from `ip` counts against for the per-IP cap: its IPv4
/// address (an IPv4-mapped IPv6 one too), or its IPv6 /64. One host holds a whole /64
/// (SLAAC, privacy addresses), so keyed by the full address it had a cap per address,
/// 2^64 of them, and could take every `max_connections` slot alone.
fn client_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let prefix = u128::from(v6) & !((1u128 << 64) - 1);
                IpAddr::V6(std::net::Ipv6Addr::from(prefix))
            }
        },
    }
}

/// Claim a slot for a connection from `ip` at `epoch`'s clock. At a cap, the longest
/// idle connection (of that IP, for the per-IP cap) is evicted to make room; with none
/// idle the new connection is refused and the error names the cap.
fn claim(
    slots: &Arc<Mutex<Slots>>,
    limits: &ConnLimits,
    ip: IpAddr,
    gauge: &Gauge,
    epoch: Instant,
) -> Result<(Slot, Option<&'static str>), &'static str> {
    let ip = client_of(ip);
    let mut s = slots.lock();
    let mut evicted = None;
    if s.per_ip.get(&ip).copied().unwrap_or(0) >= limits.max_per_ip {
        if !s.evict_idle(Some(ip)) {
            return Err("per_ip");
        }
        evicted = Some("per_ip");
    } else if s.total >= limits.max_connections {
        if !s.evict_idle(None) {
            return Err("max_connections");
        }
        evicted = Some("max_connections");
    }
    *s.per_ip.entry(ip).or_insert(0) += 1;
    s.total += 1;
    let id = s.next_id;
    s.next_id += 1;
    let activity = Arc::new(Activity {
        active: AtomicUsize::new(0),
        headed: AtomicBool::new(false),
        last_ms: AtomicU64::new(epoch.elapsed().as_millis() as u64),
        head_since: AtomicU64::new(0),
        recheck: tokio::sync::Notify::new(),
        outgoing: Mutex::new(Vec::new()),
        epoch,
    });
    let evict = CancellationToken::new();
    s.conns.insert(
        id,
        Conn {
            ip,
            activity: activity.clone(),
            evict: evict.clone(),
            evicted: false,
        },
    );
    gauge.inc();
    Ok((
        Slot {
            slots: slots.clone(),
            id,
            gauge: gauge.clone(),
            activity,
            evict,
        },
        evicted,
    ))
}

/// What a connection's watchdog and eviction need: requests in flight and the last
/// time one started or ended, in ms on the listener's clock.
#[derive(Debug)]
struct Activity {
    active: AtomicUsize,
    /// Set once a request head has arrived whole (the service was called).
    headed: AtomicBool,
    last_ms: AtomicU64,
    /// Since when (ms after `epoch`, plus one; 0: none) an HTTP/2 request head has
    /// been partly in ([`H2Heads`]): hyper tells of a head only once it is whole and
    /// times none it has begun.
    head_since: AtomicU64,
    /// Wakes the connection's watchdog to look again now: a head began, or the last
    /// request in flight ended with one partly in.
    recheck: tokio::sync::Notify,
    /// The responses on their way out (one at a time on HTTP/1, up to the stream cap
    /// on HTTP/2), each with its own wait for the client: one HTTP/2 stream whose
    /// client stopped reading must be seen while the others still flow.
    outgoing: Mutex<Vec<std::sync::Weak<Outgoing>>>,
    epoch: Instant,
}

/// One response body on its way out.
#[derive(Debug)]
struct Outgoing {
    /// Since when (ms after the connection's `epoch`, plus one; 0: not now) the body
    /// has handed hyper a frame and not been asked for the next: hyper asks again once
    /// it has buffered the frame, so a long wait here means the client stopped
    /// reading this response (on HTTP/2: its stream's window is full).
    wait_since: AtomicU64,
    /// The connection's clock.
    epoch: Instant,
    /// The body and its request's place in flight, until the watchdog takes them
    /// from a stalled stream: dropping the body ends the engine's stream and frees its
    /// slots, and the request no longer counts as in flight, though hyper holds the
    /// stream until its client reads or resets it (hyper's h2 send loop waits for
    /// window before it polls the body again, and would then get an error and reset
    /// it). So a connection left with only cut streams goes idle and is closed by the
    /// idle timeout.
    live: Mutex<Option<(Body, InFlight)>>,
}

/// What the watchdog found about the responses of one connection.
#[derive(Debug, PartialEq)]
enum WriteStall {
    /// No response has waited for its client as long as the write timeout; the
    /// longest wait, if one is waiting.
    None(Option<Duration>),
    /// Every request in flight is a response stalled past the timeout: close the
    /// connection (HTTP/1, or an HTTP/2 client that stopped reading altogether).
    Connection,
    /// Some HTTP/2 streams stalled past the timeout while others are still served:
    /// their bodies were cut (how many), the connection goes on.
    Streams(usize),
}

impl Activity {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
    fn touch(&self) {
        self.last_ms.store(self.now_ms(), Ordering::Relaxed);
    }
    /// A response about to go out: tracked until its body is dropped.
    fn outgoing(&self, body: Body, in_flight: InFlight) -> Arc<Outgoing> {
        let out = Arc::new(Outgoing {
            wait_since: AtomicU64::new(0),
            epoch: self.epoch,
            live: Mutex::new(Some((body, in_flight))),
        });
        let mut list = self.outgoing.lock();
        list.retain(|o| o.strong_count() > 0);
        list.push(Arc::downgrade(&out));
        out
    }

    /// Check the responses' waits for their clients against `timeout`, cutting the
    /// bodies of stalled HTTP/2 streams while others are served.
    fn write_stall(&self, timeout: Duration) -> WriteStall {
        let now = self.now_ms();
        let mut list = self.outgoing.lock();
        list.retain(|o| o.strong_count() > 0);
        let waits: Vec<(Arc<Outgoing>, Duration)> = list
            .iter()
            .filter_map(|o| o.upgrade())
            .filter_map(|o| {
                let since = o.wait_since.load(Ordering::Relaxed);
                (since > 0).then(|| (o, Duration::from_millis(now.saturating_sub(since - 1))))
            })
            .collect();
        drop(list);
        let stalled: Vec<&Arc<Outgoing>> = waits
            .iter()
            .filter(|(_, w)| *w >= timeout)
            .map(|(o, _)| o)
            .collect();
        if stalled.is_empty() {
            return WriteStall::None(waits.iter().map(|(_, w)| *w).max());
        }
        if stalled.len() >= self.active.load(Ordering::Relaxed) {
            return WriteStall::Connection;
        }
        for o in &stalled {
            o.wait_since.store(0, Ordering::Relaxed);
            let live = o.live.lock().take();
            drop(live);
        }
        WriteStall::Streams(stalled.len())
    }
    /// Record whether an HTTP/2 request head is partly in after the bytes just read.
    fn head_pending(&self, pending: bool) {
        let since = self.head_since.load(Ordering::Relaxed);
        if pending && since == 0 {
            self.head_since.store(self.now_ms() + 1, Ordering::Relaxed);
            self.recheck.notify_one();
        } else if !pending && since != 0 {
            self.head_since.store(0, Ordering::Relaxed);
        }
    }
    /// How long a request head has been partly in with no request in flight: since
    /// it began or since the last request ended, whichever came later (a head begun
    /// while a response was still going out is timed from the end of it, as hyper
    /// times an HTTP/1 head from the end of the last response).
    fn head_wait(&self) -> Option<Duration> {
        let since = self.head_since.load(Ordering::Relaxed);
        if since == 0 || self.active.load(Ordering::Relaxed) > 0 {
            return None;
        }
        let from = (since - 1).max(self.last_ms.load(Ordering::Relaxed));
        Some(Duration::from_millis(self.now_ms().saturating_sub(from)))
    }
    fn idle_for(&self) -> Option<Duration> {
        if self.active.load(Ordering::Relaxed) > 0 {
            return None;
        }
        let now = self.epoch.elapsed().as_millis() as u64;
        Some(Duration::from_millis(
            now.saturating_sub(self.last_ms.load(Ordering::Relaxed)),
        ))
    }
}

/// Marks a request in flight on its connection until its response body ends.
#[derive(Debug)]
struct InFlight(Arc<Activity>);

impl InFlight {
    fn begin(a: &Arc<Activity>) -> Self {
        a.headed.store(true, Ordering::Relaxed);
        a.active.fetch_add(1, Ordering::Relaxed);
        a.touch();
        InFlight(a.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.touch();
        let was = self.0.active.fetch_sub(1, Ordering::Relaxed);
        // The head's wait starts now: the watchdog must time it from here.
        if was == 1 && self.0.head_since.load(Ordering::Relaxed) != 0 {
            self.0.recheck.notify_one();
        }
    }
}

/// A response body that keeps its request counted as in flight until it ends.
struct TrackedBody {
    out: Arc<Outgoing>,
}

impl HttpBody for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        // Asked for a frame: hyper has buffered the last one.
        let out = &self.out;
        out.wait_since.store(0, Ordering::Relaxed);
        let mut live = out.live.lock();
        let Some((inner, _)) = live.as_mut() else {
            return Poll::Ready(Some(Err(axum::Error::new(
                "the client stopped reading this response",
            ))));
        };
        let polled = Pin::new(inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(_))) = &polled {
            let now_ms = out.epoch.elapsed().as_millis() as u64;
            out.wait_since.store(now_ms + 1, Ordering::Relaxed);
        }
        polled
    }
    fn is_end_stream(&self) -> bool {
        // A cut body is not at its end: hyper polls it and gets the error.
        self.out
            .live
            .lock()
            .as_ref()
            .is_some_and(|(b, _)| b.is_end_stream())
    }
    fn size_hint(&self) -> SizeHint {
        self.out
            .live
            .lock()
            .as_ref()
            .map_or_else(SizeHint::default, |(b, _)| b.size_hint())
    }
}

/// An HTTP/1 request body that, dropped before its end, hands itself back to `left`:
/// what the handler did not read (an answer given before or without the whole body),
/// for the connection to read on and throw away after the response ([`linger`]).
struct Reclaimable {
    inner: Option<Incoming>,
    /// The body ended, cleanly or not: nothing left to read.
    ended: bool,
    left: Arc<Mutex<Option<Incoming>>>,
}

impl HttpBody for Reclaimable {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let Some(inner) = self.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None | Some(Err(_)))) {
            self.ended = true;
        }
        polled
    }
    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(HttpBody::is_end_stream)
    }
    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(SizeHint::default, HttpBody::size_hint)
    }
}

impl Drop for Reclaimable {
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else {
            return;
        };
        if !self.ended && !inner.is_end_stream() {
            *self.left.lock() = Some(inner);
        }
    }
}

/// Read and throw away what is left of a request body its response did not read,
/// until it ends, more than `max_bytes` of it have been read or `until` passes: the
/// client still sending it gets the time to read the answer before the connection
/// closes (then on unread bytes, the kernel resets it). Returns the bytes read.
async fn linger<B: HttpBody<Data = Bytes> + Unpin>(
    mut body: B,
    max_bytes: usize,
    until: Instant,
) -> usize {
    use http_body_util::BodyExt;
    let mut read = 0usize;
    let drain = async {
        while read <= max_bytes {
            match body.frame().await {
                Some(Ok(frame)) => read += frame.data_ref().map_or(0, |d| d.len()),
                _ => break,
            }
        }
    };
    let _ = tokio::time::timeout_at(until, drain).await;
    read
}

/// Bytes of a request head as the limit counts them: request target and headers.
fn head_bytes<B>(req: &Request<B>) -> usize {
    let target = req.uri().path_and_query().map_or(0, |p| p.as_str().len());
    target
        + req
            .headers()
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len() + 4)
            .sum::<usize>()
}

/// The client preface of HTTP/2 with prior knowledge (RFC 9113 3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Follows an HTTP/2 client's frames just far enough to know whether a request head is
/// partly in: hyper hands the service a head only once its header block is whole and
/// keeps no timer on one begun, so a later head sent by halves (a HEADERS frame and no
/// CONTINUATION, or a frame header cut short) held the connection until the idle
/// timeout. A connection whose first bytes are not the preface is HTTP/1: hyper's own
/// header timer covers it, and nothing is followed.
#[derive(Debug, Default)]
struct H2Heads {
    /// Preface bytes seen so far; frames follow it.
    preface: usize,
    /// Not HTTP/2: nothing to follow.
    off: bool,
    /// The frame header being read and how many of its 9 bytes are in.
    header: [u8; 9],
    have: usize,
    /// Payload bytes of the frame being read still to come.
    payload_left: usize,
    /// The frame being read ends a header block (END_HEADERS).
    ends_block: bool,
    /// A header block began (HEADERS) and has not ended.
    in_block: bool,
}

impl H2Heads {
    /// Follow `bytes`, the next ones the client sent. `None` on HTTP/1; else whether a
    /// request head is partly in after them.
    fn feed(&mut self, mut bytes: &[u8]) -> Option<bool> {
        const HEADERS: u8 = 0x1;
        const CONTINUATION: u8 = 0x9;
        const END_HEADERS: u8 = 0x4;
        if self.off {
            return None;
        }
        if self.preface < H2_PREFACE.len() {
            let n = bytes.len().min(H2_PREFACE.len() - self.preface);
            if bytes[..n] != H2_PREFACE[self.preface..self.preface + n] {
                self.off = true;
                return None;
            }
            self.preface += n;
            bytes = &bytes[n..];
        }
        while !bytes.is_empty() {
            if self.payload_left > 0 {
                let n = bytes.len().min(self.payload_left);
                self.payload_left -= n;
                bytes = &bytes[n..];
                if self.payload_left == 0 {
                    self.frame_end();
                }
                continue;
            }
            let n = bytes.len().min(self.header.len() - self.have);
            self.header[self.have..self.have + n].copy_from_slice(&bytes[..n]);
            self.have += n;
            bytes = &bytes[n..];
            if self.have == self.header.len() {
                self.have = 0;
                let [l0, l1, l2, kind, flags, ..] = self.header;
                self.payload_left = usize::from(l0) << 16 | usize::from(l1) << 8 | usize::from(l2);
                self.in_block |= kind == HEADERS;
                self.ends_block =
                    matches!(kind, HEADERS | CONTINUATION) && flags & END_HEADERS != 0;
                if self.payload_left == 0 {
                    self.frame_end();
                }
            }
        }
        Some(self.in_block || self.have > 0)
    }

    fn frame_end(&mut self) {
        if self.ends_block {
            self.in_block = false;
            self.ends_block = false;
        }
    }
}

/// A client connection's socket as hyper sees it, with two things hyper does not do.
///
/// A read the runtime answers "not yet" (its readiness cache, filled from epoll, holds
/// no event for the socket) asks the kernel itself while the connection has no request
/// in flight. After a stop (SIGSTOP, a VM pause) the runtime's first turn gets no
/// events (epoll_wait fails with EINTR) and runs the timers that expired meanwhile: a
/// request sent meanwhile on a keep-alive connection lay unread in the socket when
/// hyper's header timer or the idle watchdog closed the connection, and its client got
/// no answer. Asked, the kernel hands it over, and the request is served. Only reads of
/// an idle connection ask (the ones a timer may end); the rest do what the runtime says.
///
/// It also follows an HTTP/2 client's frames ([`H2Heads`]) for the head timer.
struct ConnIo {
    tcp: TcpStream,
    activity: Arc<Activity>,
    heads: H2Heads,
}

impl AsyncRead for ConnIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        use std::io::{ErrorKind, Read};
        let this = self.get_mut();
        let start = buf.filled().len();
        let mut polled = Pin::new(&mut this.tcp).poll_read(cx, buf);
        if polled.is_pending()
            && buf.remaining() > 0
            && this.activity.active.load(Ordering::Relaxed) == 0
        {
            // The runtime's waker stays registered: its event, when it comes, only
            // polls a read that finds nothing.
            // A one-byte peek first: most of these asks find nothing (a keep-alive
            // connection between requests), and then nothing of `buf` is zeroed.
            let sock = socket2::SockRef::from(&this.tcp);
            let waiting = |e: &std::io::Error| {
                matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted)
            };
            polled = match sock.peek(&mut [std::mem::MaybeUninit::uninit()]) {
                Err(e) if waiting(&e) => Poll::Pending,
                Err(e) => Poll::Ready(Err(e)),
                // Bytes, or the end of the stream (0): the read takes them.
                Ok(_) => match (&*sock).read(buf.initialize_unfilled()) {
                    Ok(n) => {
                        buf.advance(n);
                        Poll::Ready(Ok(()))
                    }
                    Err(e) if waiting(&e) => Poll::Pending,
                    Err(e) => Poll::Ready(Err(e)),
                },
            };
        }
        if let Poll::Ready(Ok(())) = polled {
            if let Some(pending) = this.heads.feed(&buf.filled()[start..]) {
                this.activity.head_pending(pending);
            }
        }
        polled
    }
}

impl AsyncWrite for ConnIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}

/// Serve `app` on `listener` under `limits` until `closing` (or `shutdown`, which
/// implies it): then stop accepting and ask every connection to close after its
/// in-flight requests (HTTP/1 `Connection: close`, HTTP/2 GOAWAY). Return when they
/// all have, or `limits.close_grace` after `shutdown`, cutting what is left.
/// `port` labels the metrics (`client`, `admin`).
pub async fn run(
    listener: TcpListener,
    app: axum::Router,
    limits: ConnLimits,
    port: &'static str,
    metrics: ConnMetrics,
    closing: CancellationToken,
    shutdown: CancellationToken,
) {
    let slots = Arc::new(Mutex::new(Slots::default()));
    let epoch = Instant::now();
    let mut connections = JoinSet::new();
    let gauge = metrics.open_gauge(port);
    loop {
        let accepted = tokio::select! {
            _ = closing.cancelled() => break,
            _ = shutdown.cancelled() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            a = listener.accept() => a,
        };
        let (tcp, addr) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // EMFILE/ENFILE and friends: the process is out of descriptors. Back off
                // instead of spinning; connections closing will free some.
                tracing::warn!(port, error = %e, "accept failed; backing off");
                tokio::select! {
                    _ = closing.cancelled() => break,
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
                continue;
            }
        };
        let slot = match claim(&slots, &limits, addr.ip(), &gauge, epoch) {
            Ok((slot, evicted)) => {
                if let Some(cap) = evicted {
                    metrics.refuse(port, &format!("evicted_{cap}"));
                }
                slot
            }
            Err(reason) => {
                metrics.refuse(port, reason);
                tracing::debug!(port, %addr, reason, "connection refused");
                drop(tcp);
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        connections.spawn(serve_connection(
            tcp,
            addr,
            slot,
            app.clone(),
            limits,
            port,
            metrics.clone(),
            closing.clone(),
        ));
    }
    // The socket stays open, unaccepted, until the node stops: connections arriving
    // during a drain wait in the kernel's backlog instead of being refused, and are
    // reset when the process exits, which clients retry (nothing was sent on them).
    let _listener = listener;
    // Every connection has been asked to close (they watch `closing`). A drain waits
    // for them; a shutdown cuts those still open after the grace, so no task outlives
    // the node.
    closing.cancel();
    let closed = async { while connections.join_next().await.is_some() {} };
    let cut = async {
        shutdown.cancelled().await;
        tokio::time::sleep(limits.close_grace).await;
    };
    let finished = tokio::select! {
        _ = closed => true,
        _ = cut => false,
    };
    if !finished {
        tracing::warn!(
            port,
            open = connections.len(),
            "close grace passed with connections open; cutting them"
        );
        connections.shutdown().await;
    }
}

#[allow(clippy::too_many_arguments)]
async fn serve_connection(
    tcp: TcpStream,
    addr: SocketAddr,
    slot: Slot,
    app: axum::Router,
    limits: ConnLimits,
    port: &'static str,
    metrics: ConnMetrics,
    closing: CancellationToken,
) {
    let activity = slot.activity.clone();
    let evict = slot.evict.clone();
    let svc_activity = activity.clone();
    let svc_metrics = metrics.clone();
    // The unread body of an HTTP/1 request answered without it, read on here (one
    // request at a time on HTTP/1: one place is enough).
    let (linger_tx, mut linger_rx) = tokio::sync::mpsc::channel::<Incoming>(1);
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let in_flight = InFlight::begin(&svc_activity);
        let app = app.clone();
        let metrics = svc_metrics.clone();
        let linger_tx = linger_tx.clone();
        async move {
            // HTTP/2 needs none of it: an answer before the body ends the stream
            // (RST_STREAM NO_ERROR), not the connection.
            // Nor a client that waits for `100 Continue` before it sends its body: it
            // sends nothing to be reset, and reading on would invite the body.
            let expects_continue = req
                .headers()
                .get(http::header::EXPECT)
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
            let left = (req.version() < http::Version::HTTP_2 && !expects_continue)
                .then(|| Arc::new(Mutex::new(None::<Incoming>)));
            let req = match &left {
                Some(left) => req.map(|b| {
                    Body::new(Reclaimable {
                        inner: Some(b),
                        ended: false,
                        left: left.clone(),
                    })
                }),
                None => req.map(Body::new),
            };
            let mut resp = if head_bytes(&req) > limits.max_header_bytes
                || req.headers().len() > limits.max_headers
            {
                metrics.refuse(port, "header_too_large");
                drop(req);
                error_response(
                    StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                    &format!(
                        "request head over {} bytes or {} headers",
                        limits.max_header_bytes, limits.max_headers
                    ),
                )
            } else {
                match app.oneshot(req).await {
                    Ok(r) => r,
                    Err(never) => match never {},
                }
            };
            // The body the answer left unread (the 431 above dropped it too): read on
            // after the answer. Where it may hold more than is read on, the answer
            // says the connection closes after it; one read to its end can stay open.
            if let Some(unread) = left.and_then(|l| l.lock().take()) {
                let rest = unread.size_hint().exact();
                // A 408 or 413 closes whatever is left (RFC 9110 15.5.9: the server
                // closes after a 408; a client that sent too much is not kept).
                let refused_body = matches!(
                    resp.status(),
                    StatusCode::REQUEST_TIMEOUT | StatusCode::PAYLOAD_TOO_LARGE
                );
                if refused_body || rest.is_none_or(|n| n > limits.linger_bytes as u64) {
                    resp.headers_mut().insert(
                        http::header::CONNECTION,
                        http::HeaderValue::from_static("close"),
                    );
                }
                let _ = linger_tx.try_send(unread);
            }
            let (parts, body) = resp.into_parts();
            let activity = in_flight.0.clone();
            let out = activity.outgoing(body, in_flight);
            Ok::<_, Infallible>(Response::from_parts(parts, TrackedBody { out }))
        }
    });
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    // HTTP/1 half-close stays off (hyper's default): an EOF from the client is how the
    // node learns that it left, and cancels the engine work it was waiting for (a
    // non-streamed generation holds no byte to write until it ends). A client that
    // shuts its write side after the request (`nc -N`) is therefore taken as gone: it
    // gets no answer, and the request counts as cancelled.
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        // Hyper answers a bare 431 above this; under it the service answers in JSON.
        .max_buf_size((limits.max_header_bytes * 4).max(64 * 1024))
        .max_headers(limits.max_headers * 4);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(256)
        .max_header_list_size((limits.max_header_bytes * 4).min(u32::MAX as usize) as u32)
        .keep_alive_interval(Duration::from_secs(20))
        .keep_alive_timeout(Duration::from_secs(10));
    let closing_token = closing;
    let io = ConnIo {
        tcp,
        activity: activity.clone(),
        heads: H2Heads::default(),
    };
    let conn = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    let mut closing = false;
    let mut check = Box::pin(tokio::time::sleep(
        limits.idle_timeout.min(limits.write_timeout),
    ));
    // The first request head's deadline. Hyper enforces `header_timeout` for HTTP/1
    // (`header_read_timeout`), not for HTTP/2, whose half-sent HEADERS frame would
    // otherwise hold the connection until the idle check; this covers both (for
    // HTTP/1 it fires with hyper's own). Later HTTP/2 heads: `check` ([`H2Heads`]).
    let mut first_head = Box::pin(tokio::time::sleep(limits.header_timeout));
    let mut headed = false;
    // Reading on an unread body ([`linger`]). The connection has no request in
    // flight meanwhile: it keeps its slot, and may be evicted at a cap as idle.
    let mut lingering: Option<Pin<Box<dyn std::future::Future<Output = usize> + Send>>> = None;
    loop {
        tokio::select! {
            // The connection first: where its bytes and an expired timer are both
            // ready (a node resumed after a stop), it reads the request (see
            // [`ConnIo`]) before a timer below can take it for idle.
            biased;
            r = conn.as_mut() => {
                if let Err(e) = r {
                    let m = e.to_string();
                    let timed_out = e
                        .downcast_ref::<hyper::Error>()
                        .map_or(m.contains("timeout"), hyper::Error::is_timeout);
                    if timed_out {
                        // Hyper's header timer runs again after each HTTP/1 response,
                        // so a keep-alive connection that served its requests and went
                        // quiet ends here too: that is an idle close, not a client
                        // slow to send a head.
                        let served = activity.headed.load(Ordering::Relaxed)
                            && activity.active.load(Ordering::Relaxed) == 0;
                        metrics.refuse(port, if served { "idle" } else { "header_timeout" });
                    }
                    tracing::debug!(port, %addr, error = %m, "connection ended");
                }
                return;
            }
            Some(unread) = linger_rx.recv(), if lingering.is_none() => {
                let until = Instant::now() + limits.linger_time;
                lingering = Some(Box::pin(linger(unread, limits.linger_bytes, until)));
            }
            read = async { lingering.as_mut().expect("branch enabled").await }, if lingering.is_some() => {
                lingering = None;
                tracing::debug!(port, %addr, read, "read on an unread request body");
            }
            _ = first_head.as_mut(), if !headed => {
                headed = true;
                if !activity.headed.load(Ordering::Relaxed) {
                    metrics.refuse(port, "header_timeout");
                    return;
                }
            }
            _ = closing_token.cancelled(), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            // Evicted to make room: chosen because it had no request in flight, so
            // closing it loses nothing.
            _ = evict.cancelled(), if !closing => {
                if activity.idle_for().is_some() {
                    return;
                }
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            // On while the connection closes too (a drain, an eviction racing a new
            // request): a graceful close waits for the responses in flight, and a
            // client that stopped reading one would hold it, and its slot, until
            // the drain's deadline.
            // A head began, or the last request ended with one partly in: time it.
            _ = activity.recheck.notified() => check.as_mut().reset(Instant::now()),
            _ = check.as_mut() => {
                let head = activity.head_wait();
                match activity.idle_for() {
                    // Nothing in flight: close outright (a graceful close would wait
                    // for a half-sent head). An HTTP/2 head partly in for the header
                    // timeout is a client slow to send it, as an HTTP/1 one is.
                    Some(_) if head.is_some_and(|w| w >= limits.header_timeout) => {
                        metrics.refuse(port, "header_timeout");
                        return;
                    }
                    Some(idle) if idle >= limits.idle_timeout => {
                        metrics.refuse(port, "idle");
                        return;
                    }
                    // Checked again by the idle or the head deadline, or sooner: a
                    // request that starts meanwhile may stall, and that must be seen
                    // within the write timeout.
                    Some(idle) => {
                        let head_left =
                            head.map_or(Duration::MAX, |w| limits.header_timeout - w);
                        check.as_mut().reset(
                            Instant::now()
                                + (limits.idle_timeout - idle)
                                    .min(limits.write_timeout)
                                    .min(head_left),
                        )
                    }
                    None => match activity.write_stall(limits.write_timeout) {
                        // Its client stopped reading what it asked for: close (the
                        // response is lost to it anyway), freeing the slot.
                        WriteStall::Connection => {
                            metrics.refuse(port, "write_timeout");
                            return;
                        }
                        // Some of its HTTP/2 streams: those were cut, the rest go on.
                        WriteStall::Streams(n) => {
                            for _ in 0..n {
                                metrics.refuse(port, "write_timeout_stream");
                            }
                            check.as_mut().reset(Instant::now());
                        }
                        WriteStall::None(waited) => check.as_mut().reset(
                            Instant::now()
                                + (limits.write_timeout - waited.unwrap_or_default())
                                    .min(limits.idle_timeout),
                        ),
                    },
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max: usize, per_ip: usize) -> ConnLimits {
        ConnLimits {
            header_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(1),
            write_timeout: Duration::from_secs(1),
            max_connections: max,
            max_per_ip: per_ip,
            max_header_bytes: 1024,
            max_headers: 10,
            close_grace: Duration::from_secs(1),
            linger_bytes: 1024,
            linger_time: Duration::from_secs(1),
        }
    }

    #[test]
    fn slots_cap_total_and_per_ip_and_free_on_drop() {
        let slots = Arc::new(Mutex::new(Slots::default()));
        let g = Gauge::default();
        let l = limits(3, 2);
        let t = Instant::now();
        let a: IpAddr = "127.0.0.2".parse().unwrap();
        let b: IpAddr = "127.0.0.3".parse().unwrap();
        let busy = |s: &Slot| s.activity.active.store(1, Ordering::Relaxed);
        let (s1, _) = claim(&slots, &l, a, &g, t).unwrap();
        let (s2, _) = claim(&slots, &l, a, &g, t).unwrap();
        busy(&s1);
        busy(&s2);
        assert_eq!(claim(&slots, &l, a, &g, t).err(), Some("per_ip"));
        let (s3, _) = claim(&slots, &l, b, &g, t).unwrap();
        busy(&s3);
        assert_eq!(claim(&slots, &l, b, &g, t).err(), Some("max_connections"));
        assert_eq!(g.get(), 3);
        drop(s1);
        assert_eq!(g.get(), 2);
        assert!(claim(&slots, &l, a, &g, t).is_ok());
    }

    /// The per-IP cap holds per IPv6 /64 (one host's), and an IPv4-mapped address is
    /// its IPv4 one; before, each address of a /64 had its own cap.
    #[test]
    fn the_per_ip_cap_holds_per_ipv6_64() {
        let slots = Arc::new(Mutex::new(Slots::default()));
        let g = Gauge::default();
        let l = limits(64, 2);
        let t = Instant::now();
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        let mut held = Vec::new();
        // Two busy connections from `a` and `b`; a third from `c` is one too many.
        let mut fill = |a: &str, b: &str, c: &str| {
            for from in [a, b] {
                let (s, _) = claim(&slots, &l, ip(from), &g, t).unwrap();
                s.activity.active.store(1, Ordering::Relaxed);
                held.push(s);
            }
            assert_eq!(claim(&slots, &l, ip(c), &g, t).err(), Some("per_ip"), "{c}");
        };
        fill("2001:db8::1", "2001:db8::2", "2001:db8::ffff:3");
        fill("::ffff:10.0.0.1", "10.0.0.1", "10.0.0.1");
        // Another /64 is another client.
        assert!(claim(&slots, &l, ip("2001:db8:0:1::1"), &g, t).is_ok());
    }

    #[test]
    fn at_a_cap_the_longest_idle_connection_is_evicted() {
        let slots = Arc::new(Mutex::new(Slots::default()));
        let g = Gauge::default();
        let l = limits(2, 2);
        let t = Instant::now();
        let a: IpAddr = "127.0.0.2".parse().unwrap();
        let b: IpAddr = "127.0.0.3".parse().unwrap();
        let (old, _) = claim(&slots, &l, a, &g, t).unwrap();
        let (young, _) = claim(&slots, &l, a, &g, t).unwrap();
        old.activity.last_ms.store(0, Ordering::Relaxed);
        young.activity.last_ms.store(10, Ordering::Relaxed);
        // b needs a place: a's longest idle connection yields it.
        let (_nb, evicted) = claim(&slots, &l, b, &g, t).unwrap();
        assert_eq!(evicted, Some("max_connections"));
        assert!(old.evict.is_cancelled());
        assert!(!young.evict.is_cancelled());
        // An evicted connection closing releases its place and its eviction.
        drop(old);
        assert_eq!(slots.lock().evicting, 0);
        assert_eq!(slots.lock().total, 2);
    }

    /// Reading on an unread body stops once more than its byte bound has been read,
    /// though the client would send forever.
    #[tokio::test]
    async fn lingering_stops_after_its_bytes() {
        let chunk = Bytes::from(vec![0u8; 1000]);
        let endless =
            futures::stream::repeat_with(move || Ok::<_, Infallible>(Frame::data(chunk.clone())));
        let far = Instant::now() + Duration::from_secs(3600);
        let read = linger(http_body_util::StreamBody::new(endless), 10_500, far).await;
        assert_eq!(read, 11_000);
    }

    /// ... and at its deadline, though the client sends nothing more and never closes.
    #[tokio::test]
    async fn lingering_stops_at_its_deadline() {
        let silent = futures::stream::pending::<Result<Frame<Bytes>, Infallible>>();
        let soon = Instant::now() + Duration::from_millis(20);
        let read = linger(http_body_util::StreamBody::new(silent), usize::MAX, soon).await;
        assert_eq!(read, 0);
    }

    /// The reading on lasts no longer than a client is given to send a whole body.
    #[test]
    fn lingering_lasts_at_most_the_body_timeout() {
        let mut l = crate::config::LimitsSection::default();
        assert_eq!(ConnLimits::client(&l, None).linger_time, LINGER_TIME);
        l.body_timeout_ms = 200;
        assert_eq!(
            ConnLimits::admin(&l).linger_time,
            Duration::from_millis(200)
        );
        assert_eq!(ConnLimits::client(&l, None).linger_bytes, l.max_body_bytes);
    }

    #[test]
    fn client_cap_fits_under_the_descriptor_limit() {
        let l = crate::config::LimitsSection::default();
        let c = ConnLimits::client(&l, Some(20_000));
        assert_eq!(c.max_connections, (20_000 - RESERVED_FDS as usize) / 2);
        let c = ConnLimits::client(&l, None);
        assert_eq!(c.max_connections, l.max_connections);
    }

    /// An HTTP/2 frame: length, type, flags, stream, payload.
    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = (payload.len() as u32).to_be_bytes();
        let mut f = vec![len[1], len[2], len[3], kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// `GET /` over HTTP/2 (HPACK static entries: `:method GET`, `:scheme http`,
    /// `:path /`) on `stream`, whole (END_STREAM, END_HEADERS).
    fn h2_get(stream: u32) -> Vec<u8> {
        frame(0x1, 0x5, stream, &[0x82, 0x86, 0x84])
    }

    /// The preface, empty SETTINGS and `GET /` on stream 1.
    fn h2_open() -> Vec<u8> {
        let mut b = H2_PREFACE.to_vec();
        b.extend(frame(0x4, 0, 0, &[]));
        b.extend(h2_get(1));
        b
    }

    /// Whether the server's frames in `got` end `stream` (END_STREAM on its HEADERS or
    /// DATA).
    fn h2_ended(got: &[u8], stream: u32) -> bool {
        let mut rest = got;
        while rest.len() >= 9 {
            let len =
                (usize::from(rest[0]) << 16) | (usize::from(rest[1]) << 8) | usize::from(rest[2]);
            let id = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]) & 0x7fff_ffff;
            if rest.len() < 9 + len {
                return false;
            }
            if matches!(rest[3], 0x0 | 0x1) && rest[4] & 0x1 != 0 && id == stream {
                return true;
            }
            rest = &rest[9 + len..];
        }
        false
    }

    /// One connection served by [`serve_connection`] on a real socket, polled by the
    /// test itself (not spawned): the test decides when the runtime hears of its bytes.
    struct Driven {
        conn: Pin<Box<dyn std::future::Future<Output = ()>>>,
        /// The client's end (blocking writes; reads do not block).
        client: std::net::TcpStream,
        /// The server's socket, to see what lies unread in it.
        server_view: std::net::TcpStream,
        /// What the client has read.
        got: Vec<u8>,
        activity: Arc<Activity>,
        metrics: ConnMetrics,
    }

    fn timeouts(header_ms: u64, idle_ms: u64) -> ConnLimits {
        ConnLimits {
            header_timeout: Duration::from_millis(header_ms),
            idle_timeout: Duration::from_millis(idle_ms),
            write_timeout: Duration::from_secs(3600),
            ..limits(64, 64)
        }
    }

    impl Driven {
        fn start(limits: ConnLimits) -> Self {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (server, peer) = listener.accept().unwrap();
            server.set_nonblocking(true).unwrap();
            let server_view = server.try_clone().unwrap();
            let metrics = ConnMetrics::default();
            let slots = Arc::new(Mutex::new(Slots::default()));
            let (slot, _) = claim(
                &slots,
                &limits,
                peer.ip(),
                &Gauge::default(),
                Instant::now(),
            )
            .unwrap();
            let activity = slot.activity.clone();
            let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
            let conn = Box::pin(serve_connection(
                TcpStream::from_std(server).unwrap(),
                peer,
                slot,
                app,
                limits,
                "client",
                metrics.clone(),
                CancellationToken::new(),
            ));
            Driven {
                conn,
                client,
                server_view,
                got: Vec::new(),
                activity,
                metrics,
            }
        }

        fn send(&mut self, bytes: &[u8]) {
            use std::io::Write;
            self.client.write_all(bytes).unwrap();
        }

        /// One poll of the connection, with no turn of the runtime before it: whether
        /// it is still open.
        fn poll_open(&mut self) -> bool {
            let waker = futures::task::noop_waker();
            let mut cx = Context::from_waker(&waker);
            self.conn.as_mut().poll(&mut cx).is_pending()
        }

        /// Poll the connection and let the runtime run its tasks and hear of the
        /// sockets (no time passes) until `done` holds; panics if it closes.
        async fn until(&mut self, what: &str, done: impl Fn(&Self) -> bool) {
            use std::io::Read;
            self.client.set_nonblocking(true).unwrap();
            for _ in 0..100_000 {
                assert!(self.poll_open(), "the connection closed waiting for {what}");
                let mut buf = [0u8; 4096];
                if let Ok(n) = self.client.read(&mut buf) {
                    self.got.extend_from_slice(&buf[..n]);
                }
                if done(self) {
                    self.client.set_nonblocking(false).unwrap();
                    return;
                }
                tokio::task::yield_now().await;
            }
            panic!("never saw {what}");
        }

        /// Wait (without a turn of the runtime) until the kernel holds bytes in the
        /// server's socket that the connection has not read.
        fn until_unread_bytes(&self) {
            while !self.unread_bytes() {
                std::hint::spin_loop();
            }
        }

        /// Whether the server's socket holds bytes the connection has not read.
        fn unread_bytes(&self) -> bool {
            self.server_view.peek(&mut [0u8; 1]).is_ok_and(|n| n > 0)
        }

        fn refused(&self, reason: &str) -> u64 {
            self.metrics
                .refused
                .get_or_create(&RefusedLabels {
                    port: "client".into(),
                    reason: reason.into(),
                })
                .get()
        }

        fn responses(&self) -> usize {
            self.got
                .windows(12)
                .filter(|w| w == b"HTTP/1.1 200")
                .count()
        }
    }

    /// A node stopped (SIGSTOP) past a kept-alive HTTP/1 connection's wait for its next
    /// head, and a request sent on it meanwhile: at the resume, hyper's header timer
    /// had expired and the runtime had not heard of the bytes (its first turn after a
    /// stop gets no events), so hyper found nothing to read, closed the connection on
    /// the timer (`idle`) and the client got no answer. Reproduced here by letting the
    /// timers expire, writing the request, and polling the connection before the
    /// runtime polls its sockets again.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn an_http1_request_sent_while_the_node_was_stopped_is_served() {
        let mut d = Driven::start(timeouts(200, 3_600_000));
        d.send(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n");
        d.until("the first response", |d| {
            d.responses() == 1 && d.got.ends_with(b"ok")
        })
        .await;
        // Stopped past the header timeout; the request arrives meanwhile.
        tokio::time::advance(Duration::from_secs(1)).await;
        d.send(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n");
        d.until_unread_bytes();
        assert!(
            d.poll_open(),
            "closed on its expired timer, the request unread"
        );
        d.until("the second response", |d| {
            d.responses() == 2 && d.got.ends_with(b"ok")
        })
        .await;
        assert_eq!(d.refused("idle"), 0);
    }

    /// The same on HTTP/2, whose idle connection the watchdog closes at
    /// `idle_timeout`: the request in the socket is read before the expired timer is
    /// looked at.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn an_http2_request_sent_while_the_node_was_stopped_is_served() {
        let mut d = Driven::start(timeouts(200, 300));
        d.send(&h2_open());
        d.until("stream 1 to end", |d| {
            h2_ended(&d.got, 1) && d.activity.active.load(Ordering::Relaxed) == 0
        })
        .await;
        // Several stops: which of the connection's futures is polled first must not
        // be left to chance.
        for stream in [3, 5, 7, 9] {
            tokio::time::advance(Duration::from_secs(1)).await;
            d.send(&h2_get(stream));
            d.until_unread_bytes();
            assert!(
                d.poll_open(),
                "closed on its expired timer, the request unread"
            );
            d.until("the stream to end", |d| {
                h2_ended(&d.got, stream) && d.activity.active.load(Ordering::Relaxed) == 0
            })
            .await;
        }
        assert_eq!(d.refused("idle"), 0);
    }

    /// A later HTTP/2 head sent by halves (HEADERS without END_HEADERS, and no
    /// CONTINUATION) on a connection with nothing in flight is closed at the header
    /// timeout, counted as `header_timeout`: hyper times no HTTP/2 head, and only the
    /// idle timeout (an hour here) closed it.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_later_http2_head_sent_by_halves_is_closed_at_the_header_timeout() {
        let mut d = Driven::start(timeouts(200, 3_600_000));
        d.send(&h2_open());
        d.until("stream 1 to end", |d| {
            h2_ended(&d.got, 1) && d.activity.active.load(Ordering::Relaxed) == 0
        })
        .await;
        d.send(&frame(0x1, 0x1, 3, &[0x82]));
        d.until("the half head to be read", |d| !d.unread_bytes())
            .await;
        tokio::time::advance(Duration::from_millis(150)).await;
        assert!(d.poll_open(), "closed before the header timeout");
        tokio::time::advance(Duration::from_millis(100)).await;
        assert!(
            !d.poll_open(),
            "a half head held the connection past the header timeout"
        );
        assert_eq!(d.refused("header_timeout"), 1);
        assert_eq!(d.refused("idle"), 0);
    }

    /// ... while a quiet HTTP/2 connection (no head begun) is kept until the idle
    /// timeout, counted as `idle`.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_quiet_http2_connection_is_kept_until_the_idle_timeout() {
        let mut d = Driven::start(timeouts(200, 5_000));
        d.send(&h2_open());
        d.until("stream 1 to end", |d| {
            h2_ended(&d.got, 1) && d.activity.active.load(Ordering::Relaxed) == 0
        })
        .await;
        // A whole PING is no head.
        d.send(&frame(0x6, 0, 0, &[0; 8]));
        d.until("the ping's answer", |d| {
            d.got.windows(4).any(|w| w == [0, 0, 8, 6])
        })
        .await;
        tokio::time::advance(Duration::from_secs(4)).await;
        assert!(d.poll_open(), "closed before the idle timeout");
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(!d.poll_open());
        assert_eq!(d.refused("idle"), 1);
        assert_eq!(d.refused("header_timeout"), 0);
    }

    /// A head is partly in from its HEADERS frame's first byte to the end of the frame
    /// that ends its header block, however the bytes are cut; HTTP/1 is not followed.
    #[test]
    fn h2_heads_follow_header_blocks_across_reads() {
        let mut start = H2_PREFACE.to_vec();
        start.extend(frame(0x4, 0, 0, &[0; 6]));
        let mut head = frame(0x1, 0x1, 1, &[0x82, 0x86]);
        head.extend(frame(0x9, 0x0, 1, &[0x84]));
        head.extend(frame(0x9, 0x4, 1, &[0x41, 0x1, b'a']));
        let window_update = frame(0x8, 0, 0, &[0, 0, 0, 1]);
        let mut cut = H2Heads::default();
        assert_eq!(cut.feed(&start[..5]), Some(false));
        assert_eq!(cut.feed(&start[5..]), Some(false));
        for (i, b) in head.iter().enumerate() {
            let last = i == head.len() - 1;
            assert_eq!(cut.feed(std::slice::from_ref(b)), Some(!last), "byte {i}");
        }
        assert_eq!(cut.feed(&window_update), Some(false));
        // A HEADERS frame that ends its own block, whole in one read.
        assert_eq!(cut.feed(&frame(0x1, 0x5, 3, &[0x82])), Some(false));
        let mut whole = H2Heads::default();
        assert_eq!(
            whole.feed(&[start, head, window_update].concat()),
            Some(false)
        );
        let mut h1 = H2Heads::default();
        assert_eq!(h1.feed(b"POST / HTTP/1.1\r\n"), None);
        assert_eq!(h1.feed(&frame(0x1, 0, 1, &[0x82])), None);
    }
}
