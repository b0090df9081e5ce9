//! The TCP relay: each accepted connection gets its own upstream connection;
//! every chunk read on one side is written to the other after the link's delay.
//! Chunks never overtake each other and bytes are never lost; a full queue
//! (the byte budget) stops reading, which backpressures the sender as TCP would.
//! Connection setup itself is not delayed: the first delay a client sees is on
//! its first bytes. While the link's gate is down (a partition) new connections
//! are closed at once and open ones are cut.
//!
//! A side that is gone (a read from it fails: reset; or a write to it fails) ends
//! only what flows towards it: the other direction still delivers what it holds,
//! then its end (a half-close), and what the live side still sends is read and
//! dropped until it closes, as a client still uploading to a server that answered
//! and reset gets the answer first. `reset_grace` bounds how long that lasts past
//! the time the relay's last held chunk is due (on a slow link, long after the
//! reset).

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::link::{DuplexLink, Mode, SharedLinkParams, Verdict};
use crate::relay::{now, wake_at, RelayHandle, RelayStats};
use crate::NetemError;

/// Pause after a failed accept (out of descriptors: it would fail again at once).
const ACCEPT_RETRY: Duration = Duration::from_millis(20);
/// Default of [`TcpRelayOptions::reset_grace`].
const DEFAULT_RESET_GRACE: Duration = Duration::from_secs(5);
/// Limits of a TCP relay.
#[derive(Clone, Debug)]
pub struct TcpRelayOptions {
    /// Most concurrent connections; further ones are closed at once.
    pub max_connections: usize,
    /// Largest chunk read at once (one delay decision per chunk), in
    /// `[1, u32::MAX]`: a chunk takes its length in credit at once.
    pub chunk_size: usize,
    /// Once one side of a connection is gone (reset, or a write to it failed), how
    /// long the other side has, past the time the last chunk the relay holds for it
    /// is due (delay, jitter and rate included), to take what it holds and to
    /// close; then the connection is cut (5 s by default). Counted from when the
    /// held data is due, not from the loss, so a backlog that a slow link takes
    /// longer than this to carry is delivered whole; without a bound a client
    /// that neither reads nor closes would hold the connection's task forever.
    pub reset_grace: Duration,
}

impl Default for TcpRelayOptions {
    fn default() -> Self {
        TcpRelayOptions {
            max_connections: 4096,
            chunk_size: 64 * 1024,
            reset_grace: DEFAULT_RESET_GRACE,
        }
    }
}

/// Starts TCP relays; see the module docs.
#[derive(Debug)]
pub struct TcpRelay;

impl TcpRelay {
    /// Listens on `listen` and relays each connection to `target` over `link`
    /// (`to_target` for client bytes, `to_source` for the replies).
    pub async fn start(
        listen: SocketAddr,
        target: SocketAddr,
        link: DuplexLink,
        seed: u64,
    ) -> Result<RelayHandle, NetemError> {
        Self::start_with(listen, target, link, seed, TcpRelayOptions::default()).await
    }

    /// [`start`](Self::start) with explicit limits.
    pub async fn start_with(
        listen: SocketAddr,
        target: SocketAddr,
        link: DuplexLink,
        seed: u64,
        options: TcpRelayOptions,
    ) -> Result<RelayHandle, NetemError> {
        // Zero would read nothing, which looks like the end of the stream;
        // credit is taken in u32 units (`Semaphore::acquire_many`).
        if options.chunk_size == 0 || u32::try_from(options.chunk_size).is_err() {
            return Err(NetemError::Options {
                field: "chunk_size".into(),
                reason: format!("must be in [1, {}], got {}", u32::MAX, options.chunk_size),
            });
        }
        let listener = TcpListener::bind(listen)
            .await
            .map_err(|source| NetemError::Bind {
                addr: listen,
                source,
            })?;
        let local_addr = listener.local_addr().map_err(|source| NetemError::Bind {
            addr: listen,
            source,
        })?;
        let cancel = CancellationToken::new();
        let tracker = TaskTracker::new();
        let stats = Arc::new(RelayStats::default());
        tracker.spawn(accept_loop(
            listener,
            target,
            link,
            seed,
            options,
            stats.clone(),
            cancel.clone(),
            tracker.clone(),
        ));
        Ok(RelayHandle {
            local_addr,
            cancel,
            tracker,
            stats,
        })
    }
}

#[allow(clippy::too_many_arguments)]
async fn accept_loop(
    listener: TcpListener,
    target: SocketAddr,
    link: DuplexLink,
    seed: u64,
    options: TcpRelayOptions,
    stats: Arc<RelayStats>,
    cancel: CancellationToken,
    tracker: TaskTracker,
) {
    // `Semaphore::new` panics above MAX_PERMITS (2^61); no host holds that
    // many connections, so a larger limit means the same as MAX_PERMITS.
    let slots = Arc::new(Semaphore::new(
        options.max_connections.min(Semaphore::MAX_PERMITS),
    ));
    let mut opened: u64 = 0;
    loop {
        let accepted = tokio::select! {
            _ = cancel.cancelled() => break,
            a = listener.accept() => a,
        };
        let (client, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Per-connection failures (reset before accept, fd limits) are
                // not fatal for the listener. Out of descriptors, accept fails again
                // at once until one is freed: a short pause, not a busy loop.
                tracing::debug!(error = %e, "tcp relay accept failed");
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tokio::time::sleep(ACCEPT_RETRY) => {}
                }
                continue;
            }
        };
        if !link.gate.is_up() {
            // A partition: refused (closed at once), as a cut network would
            // refuse it.
            stats.add(&stats.partitioned, 1);
            continue;
        }
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            stats.add(&stats.flows_rejected, 1);
            continue;
        };
        opened += 1;
        stats.add(&stats.flows_opened, 1);
        let active = ActiveConnection::new(stats.clone(), slot);
        let conn_seed = seed ^ opened.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let conn = cancel.child_token();
        let (link, options, stats) = (link.clone(), options.clone(), stats.clone());
        tracker.spawn(async move {
            let _active = active;
            tokio::select! {
                r = relay_connection(client, target, &link, conn_seed, &options, &stats, &conn) => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, %peer, "tcp relay connection ended");
                    }
                }
                // A partition cuts the connection: both sockets close with it.
                _ = link.gate.cut() => {
                    stats.add(&stats.partitioned, 1);
                    conn.cancel();
                }
            }
        });
    }
}

/// A connection's slot, counted in `flows_active` while held. Ending the
/// count in `Drop` means a task that panics or is aborted still gives both
/// back, so `flows_active` cannot stick above the connections really open.
struct ActiveConnection {
    stats: Arc<RelayStats>,
    _slot: OwnedSemaphorePermit,
}

impl ActiveConnection {
    fn new(stats: Arc<RelayStats>, slot: OwnedSemaphorePermit) -> Self {
        stats.add(&stats.flows_active, 1);
        ActiveConnection { stats, _slot: slot }
    }
}

impl Drop for ActiveConnection {
    fn drop(&mut self) {
        self.stats.sub(&self.stats.flows_active, 1);
    }
}

async fn relay_connection(
    client: TcpStream,
    target: SocketAddr,
    link: &DuplexLink,
    seed: u64,
    options: &TcpRelayOptions,
    stats: &RelayStats,
    cancel: &CancellationToken,
) -> std::io::Result<()> {
    let upstream = tokio::select! {
        _ = cancel.cancelled() => return Ok(()),
        u = connect_upstream(target) => u?,
    };
    client.set_nodelay(true)?;
    upstream.set_nodelay(true)?;
    let (client_read, client_write) = client.into_split();
    let (upstream_read, upstream_write) = upstream.into_split();
    let client_gone = CancellationToken::new();
    let target_gone = CancellationToken::new();
    // When the last chunk each direction holds for its writer's side is due.
    let (forward_held, backward_held) = (watch::Sender::new(None), watch::Sender::new(None));
    let forward = pipe(
        client_read,
        upstream_write,
        &link.to_target,
        seed,
        options,
        stats,
        cancel,
        Sides {
            reader_gone: &client_gone,
            writer_gone: &target_gone,
            held_until: &forward_held,
        },
    );
    let backward = pipe(
        upstream_read,
        client_write,
        &link.to_source,
        seed.rotate_left(17) ^ 1,
        options,
        stats,
        cancel,
        Sides {
            reader_gone: &target_gone,
            writer_gone: &client_gone,
            held_until: &backward_held,
        },
    );
    let both = async {
        let (a, b) = tokio::join!(forward, backward);
        a.and(b)
    };
    // Once a side is gone, the grace runs from when the last chunk held for a live
    // side is due (later if a direction admits more), or from the loss if that is
    // later: it bounds a side that takes nothing or never closes, not a backlog
    // that the link is still carrying.
    let cut = async {
        tokio::select! {
            _ = client_gone.cancelled() => {}
            _ = target_gone.cancelled() => {}
        }
        let gone_at = now();
        let (mut forward, mut backward) = (forward_held.subscribe(), backward_held.subscribe());
        loop {
            let from = [(&mut forward, &target_gone), (&mut backward, &client_gone)]
                .into_iter()
                .filter_map(|(held, writer_gone)| {
                    // Marked seen either way, or `changed` would wake at once again.
                    let due = *held.borrow_and_update();
                    due.filter(|_| !writer_gone.is_cancelled())
                })
                .fold(gone_at, Instant::max);
            // `sleep` takes any length (an absurd grace waits "forever").
            let wait = from
                .saturating_duration_since(now())
                .saturating_add(options.reset_grace);
            tokio::select! {
                _ = tokio::time::sleep(wait) => break,
                // The senders outlive this future, so `changed` cannot fail.
                Ok(()) = forward.changed() => {}
                Ok(()) = backward.changed() => {}
            }
        }
    };
    tokio::select! {
        r = both => r,
        _ = cut => {
            tracing::debug!("tcp relay connection cut: reset_grace passed after a side was gone");
            Ok(())
        }
    }
}

/// Connects to `target` as `TcpStream::connect` does (its errors, refused,
/// unreachable or timed out, are returned as they are), except for a connection
/// that the target accepted, answered and reset before the connect completed in
/// user space: `connect` sees the reset (`SO_ERROR` is `ECONNRESET`, or `EPIPE`
/// after the target's FIN) and fails, though the kernel still holds the answer,
/// which a direct client would read. That connection is returned instead, so the
/// relay reads the answer and then the end of the stream (the reset consumed as
/// the connect's error). The kernel reports a reset before the handshake as
/// `ECONNREFUSED`, so these two errors mean the connection existed. `connect`
/// closes its descriptor when it fails, so a second one of the same socket
/// keeps it.
async fn connect_upstream(target: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = if target.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    let kept = socket2::SockRef::from(&socket).try_clone()?;
    match socket.connect(target).await {
        Ok(stream) => Ok(stream),
        Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) => {
            tracing::debug!(error = %e, "tcp relay target reset before the connect completed");
            TcpStream::from_std(kept.into())
        }
        Err(e) => Err(e),
    }
}

/// A chunk in flight; `None` data is the end of the stream.
struct Chunk {
    due: Instant,
    data: Option<Bytes>,
}

/// The sides of one direction of a connection: each cancelled once its socket is
/// gone (a read from it or a write to it failed), seen by both directions; and
/// when the last chunk this direction holds for its writer's side is due, from
/// which `reset_grace` runs.
struct Sides<'a> {
    reader_gone: &'a CancellationToken,
    writer_gone: &'a CancellationToken,
    held_until: &'a watch::Sender<Option<Instant>>,
}

impl Sides<'_> {
    /// A chunk (or the end of the stream) due at `due` was queued for the writer's
    /// side: it raises `held_until` while that side is there to take it (what the
    /// relay drops for a side that is gone holds nothing up).
    fn holding(&self, due: Instant) {
        if self.writer_gone.is_cancelled() {
            return;
        }
        self.held_until.send_if_modified(|held| {
            let later = held.is_none_or(|h| due > h);
            if later {
                *held = Some(due);
            }
            later
        });
    }
}

/// Reads what `reader` has (up to `buf.len()` bytes) and returns a copy of
/// it sized to what was read; `None` at the end of the stream. A copy, not a
/// view of `buf`: a queued chunk is charged its length against the byte
/// budget, so it must not pin a whole `chunk_size` allocation (16-byte writes
/// would otherwise hold 64 KiB each).
async fn read_chunk(
    reader: &mut (impl AsyncRead + Unpin),
    buf: &mut [u8],
) -> std::io::Result<Option<Bytes>> {
    let n = reader.read(buf).await?;
    Ok((n > 0).then(|| Bytes::copy_from_slice(&buf[..n])))
}

/// One direction of a connection: a reader that stamps each chunk with its
/// delivery time and a writer that writes it then. A failed read ends the stream
/// after what was read before it; a failed write drops what the reader still sends
/// until it ends (see the module docs). The direction ends when its writer does.
#[allow(clippy::too_many_arguments)]
async fn pipe(
    mut reader: impl AsyncRead + Unpin,
    mut writer: impl AsyncWrite + Unpin,
    params: &SharedLinkParams,
    seed: u64,
    options: &TcpRelayOptions,
    stats: &RelayStats,
    cancel: &CancellationToken,
    sides: Sides<'_>,
) -> std::io::Result<()> {
    // At least one chunk, or a full-size read could never get its credit. At
    // most MAX_PERMITS (2^61 bytes), above which `Semaphore::new` panics: a
    // larger budget (usize::MAX as "unlimited") is no tighter than that.
    let budget = params
        .get()
        .queue_limit_bytes
        .max(options.chunk_size)
        .min(Semaphore::MAX_PERMITS);
    let credit = Semaphore::new(budget);
    let (tx, mut rx) = mpsc::unbounded_channel::<Chunk>();
    let mut shaper = params.shaper(Mode::Stream, seed);

    let read_side = async {
        // One buffer for every read: each chunk queued is a copy of just the
        // bytes read (see `read_chunk`).
        let mut buf = vec![0u8; options.chunk_size];
        loop {
            let data = match read_chunk(&mut reader, &mut buf).await {
                Ok(Some(data)) => data,
                Ok(None) => Bytes::new(),
                // A read that fails (a reset after the peer's last bytes) ends the
                // stream after what was read before it, as TCP delivers it, instead
                // of cutting those bytes off (a node's early 413 before a reset).
                Err(e) => {
                    tracing::debug!(error = %e, "tcp relay read failed; ending the stream");
                    sides.reader_gone.cancel();
                    Bytes::new()
                }
            };
            if data.is_empty() {
                let due = match shaper.admit(now(), 0) {
                    Verdict::Deliver(due) => due,
                    _ => now(),
                };
                sides.holding(due);
                let _ = tx.send(Chunk { due, data: None });
                return Ok::<(), std::io::Error>(());
            }
            let n = data.len();
            stats.add(&stats.packets_in, 1);
            stats.add(&stats.bytes_in, n as u64);
            // Backpressure: wait for the writer to free budget. `n` fits in a
            // u32 and in the budget: n <= chunk_size <= u32::MAX (checked in
            // `start_with`) < MAX_PERMITS.
            let permits = credit
                .acquire_many(n as u32)
                .await
                .map_err(|_| std::io::Error::other("relay queue closed"))?;
            permits.forget();
            let due = match shaper.admit(now(), n) {
                Verdict::Deliver(due) => due,
                _ => now(),
            };
            sides.holding(due);
            if tx
                .send(Chunk {
                    due,
                    data: Some(data),
                })
                .is_err()
            {
                return Ok(());
            }
        }
    };
    let write_side = async {
        while let Some(chunk) = rx.recv().await {
            tokio::time::sleep_until(wake_at(chunk.due)).await;
            let Some(data) = chunk.data else {
                // The end of the stream travels after the data, as a half-close.
                if let Err(e) = writer.shutdown().await {
                    writer_gone(stats, &sides, &e);
                }
                return Ok::<(), std::io::Error>(());
            };
            if let Err(e) = writer.write_all(&data).await {
                credit.add_permits(data.len());
                writer_gone(stats, &sides, &e);
                // The writer's side is gone: what the reader still sends is read and
                // dropped (the network carries it to a host that is no longer there)
                // until the reader's side ends it, while the other direction
                // delivers what it holds. A reader's side that sends and never
                // closes is cut with the connection after `reset_grace`.
                while let Some(Chunk {
                    data: Some(dropped),
                    ..
                }) = rx.recv().await
                {
                    credit.add_permits(dropped.len());
                }
                return Ok(());
            }
            stats.add(&stats.packets_out, 1);
            stats.add(&stats.bytes_out, data.len() as u64);
            credit.add_permits(data.len());
        }
        Ok(())
    };
    // The direction ends with its writer: at the end of the stream, or after its
    // writer's side is gone and its reader's side has ended too.
    let joined = async {
        tokio::pin!(read_side, write_side);
        let mut reading = true;
        loop {
            tokio::select! {
                r = &mut read_side, if reading => {
                    r?;
                    reading = false;
                }
                w = &mut write_side => return w,
            }
        }
    };
    let result = tokio::select! {
        _ = cancel.cancelled() => Ok(()),
        r = joined => r,
    };
    if result.is_err() {
        cancel.cancel();
    }
    result
}

/// A write to a direction's writer failed: its side is gone (counted in
/// `send_errors`), which starts the connection's `reset_grace`.
fn writer_gone(stats: &RelayStats, sides: &Sides<'_>, e: &std::io::Error) {
    tracing::debug!(error = %e, "tcp relay write failed; the other direction goes on");
    stats.add(&stats.send_errors, 1);
    sides.writer_gone.cancel();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 16-byte read into a 64 KiB buffer queues a chunk that owns 16 bytes:
    /// the memory held matches the credit charged.
    #[tokio::test]
    async fn a_chunk_holds_only_the_bytes_read() {
        let mut buf = vec![0u8; TcpRelayOptions::default().chunk_size];
        let mut reader = &b"sixteen bytes..."[..];
        let chunk = read_chunk(&mut reader, &mut buf).await.unwrap().unwrap();
        assert_eq!(&chunk[..], b"sixteen bytes...");
        // A unique `Bytes` becomes a `Vec` over its own allocation, so the
        // capacity is the size of the allocation the chunk pins.
        assert_eq!(Vec::from(chunk).capacity(), 16);
        assert!(read_chunk(&mut reader, &mut buf).await.unwrap().is_none());
    }

    /// A connection task that panics still ends its count in `flows_active`.
    #[tokio::test]
    async fn a_panicking_connection_task_is_no_longer_counted_active() {
        let stats = Arc::new(RelayStats::default());
        let slot = Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap();
        let active = ActiveConnection::new(stats.clone(), slot);
        assert_eq!(stats.snapshot().flows_active, 1);
        let task = tokio::spawn(async move {
            let _active = active;
            panic!("connection task fails");
        });
        assert!(task.await.unwrap_err().is_panic());
        assert_eq!(stats.snapshot().flows_active, 0);
    }

    /// A target that refuses the connection is still a failed connect, reported
    /// as `TcpStream::connect` reports it (only a reset after the handshake is
    /// taken as a connection).
    #[tokio::test]
    async fn a_refused_upstream_connect_fails_as_before() {
        let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = closed.local_addr().unwrap();
        drop(closed);
        let err = connect_upstream(target).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}");
    }
}
