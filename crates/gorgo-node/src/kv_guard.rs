//! A loopback relay in front of the engine's ZeroMQ sockets that checks every frame
//! header before the `zeromq` decoder reads it.
//!
//! The decoder reserves whatever length a frame header announces (an 8-byte length:
//! up to 2^64), so one bad header from a broken or hostile publisher would abort the
//! node on a failed allocation, and it slices a command by the lengths inside it, so
//! a malformed READY panics the task that connects. The node's SUB and DEALER sockets
//! connect to this relay instead of the engine; the relay connects to the engine,
//! passes the node's bytes through as they are, and passes the engine's through the
//! core's [`FrameGuard`], closing both connections at the first frame it refuses. The
//! sockets then reconnect by themselves; what the cut lost is a gap in the event
//! sequence, which the follower replays or resyncs (docs/kv-events.md).
//!
//! The relay is also where the engine's side of a connection is seen to close (the
//! `zeromq` SUB socket reconnects without a word): it says so through
//! [`EngineClosed`], since the engine may have restarted (docs/kv-events.md).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gorgo_core::zmtp::{FrameGuard, FrameLimits};
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// Connections relayed at once: the node opens one SUB and at most one replay DEALER
/// per engine; anything beyond is not the node's.
const MAX_CONNECTIONS: usize = 8;

/// How long the connect to the engine may take.
const UPSTREAM_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The pause after a failed accept.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Bytes read from the engine at a time.
const READ_CHUNK: usize = 64 << 10;

/// Where the refused frames are counted: per engine for `/admin/state`, and node-wide
/// for Prometheus.
#[derive(Debug, Clone, Default)]
pub struct RejectCounters {
    /// This engine's connections cut.
    pub engine: Arc<AtomicU64>,
    /// The node's (`gorgo_kv_event_refused_frames_total`).
    pub node: Counter,
}

/// Told each time the engine closes a relayed connection it had accepted (not when
/// the node's side closes, nor when the relay cuts one at a refused frame): the engine
/// may have restarted, and the SUB socket, which reconnects by itself, would not say.
pub type EngineClosed = Arc<tokio::sync::Notify>;

/// A running relay: the endpoint the node's socket connects to instead of the
/// engine's.
#[derive(Debug)]
pub struct GuardedEndpoint {
    /// `tcp://127.0.0.1:PORT`.
    pub endpoint: String,
}

/// Start a relay to `upstream` (`tcp://host:port`) checking the engine's frames
/// against `limits`, until `shutdown`; `closed` (if any) is told when the engine closes
/// a connection.
pub async fn start(
    upstream: &str,
    limits: FrameLimits,
    rejects: RejectCounters,
    closed: Option<EngineClosed>,
    shutdown: CancellationToken,
) -> std::io::Result<GuardedEndpoint> {
    let target = upstream
        .strip_prefix("tcp://")
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("not a tcp:// endpoint: {upstream}"),
            )
        })?
        .to_string();
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let local: SocketAddr = listener.local_addr()?;
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                _ = shutdown.cancelled() => return,
                a = listener.accept() => a,
            };
            let downstream = match accepted {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of descriptors, most likely: do not spin on it.
                    tracing::warn!(upstream = %target, error = %e, "kv events relay: accept failed");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(ACCEPT_BACKOFF) => continue,
                    }
                }
            };
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                tracing::warn!(upstream = %target, "kv events relay: too many connections, one refused");
                continue;
            };
            let target = target.clone();
            let rejects = rejects.clone();
            let closed = closed.clone();
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                let _permit = permit;
                let end = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    end = relay(downstream, &target, limits, &rejects) => end,
                };
                if let (RelayEnd::EngineClosed, Some(closed)) = (end, closed) {
                    tracing::info!(upstream = %target, "kv events relay: the engine closed the connection");
                    closed.notify_one();
                }
            });
        }
    });
    Ok(GuardedEndpoint {
        endpoint: format!("tcp://{local}"),
    })
}

/// How a relayed connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RelayEnd {
    /// The engine was never reached.
    Unreachable,
    /// The engine closed its side (or it broke): it may have restarted.
    EngineClosed,
    /// The node closed its side, or the guard cut the connection at a refused frame.
    Other,
}

/// One connection: the node's bytes to the engine unchecked, the engine's to the node
/// through the guard; ends when either side closes or the guard refuses a frame.
async fn relay(
    downstream: TcpStream,
    target: &str,
    limits: FrameLimits,
    rejects: &RejectCounters,
) -> RelayEnd {
    let upstream = match tokio::time::timeout(UPSTREAM_CONNECT_TIMEOUT, TcpStream::connect(target))
        .await
    {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            tracing::debug!(upstream = target, error = %e, "kv events relay: engine not reachable");
            return RelayEnd::Unreachable;
        }
        Err(_) => {
            tracing::debug!(
                upstream = target,
                "kv events relay: engine connect timed out"
            );
            return RelayEnd::Unreachable;
        }
    };
    let _ = upstream.set_nodelay(true);
    let _ = downstream.set_nodelay(true);
    let (mut down_read, mut down_write) = downstream.into_split();
    let (mut up_read, mut up_write) = upstream.into_split();
    let to_engine = async {
        let _ = tokio::io::copy(&mut down_read, &mut up_write).await;
    };
    let to_node = async {
        let mut guard = FrameGuard::new(limits);
        let mut buf = vec![0u8; READ_CHUNK];
        loop {
            let n = match up_read.read(&mut buf).await {
                Ok(0) | Err(_) => return RelayEnd::EngineClosed,
                Ok(n) => n,
            };
            if let Err(e) = guard.feed(&buf[..n]) {
                rejects.engine.fetch_add(1, Ordering::Relaxed);
                rejects.node.inc();
                tracing::warn!(upstream = target, error = %e, "kv events relay: a frame refused, connection closed");
                return RelayEnd::Other;
            }
            if down_write.write_all(&buf[..n]).await.is_err() {
                return RelayEnd::Other;
            }
        }
    };
    // Either direction ending ends both: the sockets reconnect as a pair.
    tokio::select! {
        _ = to_engine => RelayEnd::Other,
        end = to_node => end,
    }
}
