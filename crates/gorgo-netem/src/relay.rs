//! What the UDP and TCP relays share: counters, the handle that stops them,
//! the gate that cuts a link, and the delivery timer.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How early a delivery timer is armed. Tokio's timer wheel has 1 ms ticks and
/// rounds deadlines up, so a timer armed for `t` fires between `t` and about
/// `t + 1.x ms`; arming it this much earlier centres delivery on `t`.
/// Measured in `docs/netem.md`.
pub(crate) const TIMER_LEAD: Duration = Duration::from_micros(900);

/// The instant at which to wake for a delivery due at `due`.
pub(crate) fn wake_at(due: Instant) -> tokio::time::Instant {
    tokio::time::Instant::from_std(due.checked_sub(TIMER_LEAD).unwrap_or(due))
}

/// Whether a delivery due at `due` may go out at `now`.
pub(crate) fn is_due(due: Instant, now: Instant) -> bool {
    now + TIMER_LEAD >= due
}

/// The current instant on tokio's clock (virtual under `tokio::time::pause`).
pub(crate) fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// The on/off switch of a link, shared by every relay task that carries it.
///
/// It exists so a chaos script can partition two regions and heal them again
/// while the relays run: while the gate is down, datagrams in either direction
/// are dropped and TCP connections are refused, and open ones are cut (a relay
/// cannot drop bytes out of a stream without corrupting it). Checked when a
/// packet or connection arrives; what was admitted before the cut still lands,
/// as packets already on the wire would.
#[derive(Clone, Debug)]
pub struct LinkGate {
    up: Arc<watch::Sender<bool>>,
}

impl Default for LinkGate {
    fn default() -> Self {
        LinkGate {
            up: Arc::new(watch::Sender::new(true)),
        }
    }
}

impl LinkGate {
    /// Whether the link carries traffic now.
    pub fn is_up(&self) -> bool {
        *self.up.borrow()
    }

    /// Puts the link up (`true`) or cuts it (`false`); returns whether that
    /// changed anything.
    pub fn set_up(&self, up: bool) -> bool {
        self.up
            .send_if_modified(|state| std::mem::replace(state, up) != up)
    }

    /// Resolves once the link is cut (at once if it is already).
    pub(crate) async fn cut(&self) {
        let mut rx = self.up.subscribe();
        // The sender lives as long as `self`, so this cannot fail.
        let _ = rx.wait_for(|up| !*up).await;
    }
}

/// Live counters of one relay, shared with its tasks.
#[derive(Debug, Default)]
pub struct RelayStats {
    pub(crate) packets_in: AtomicU64,
    pub(crate) packets_out: AtomicU64,
    pub(crate) bytes_in: AtomicU64,
    pub(crate) bytes_out: AtomicU64,
    pub(crate) lost: AtomicU64,
    pub(crate) overflowed: AtomicU64,
    pub(crate) send_errors: AtomicU64,
    pub(crate) flows_opened: AtomicU64,
    pub(crate) flows_active: AtomicU64,
    pub(crate) flows_rejected: AtomicU64,
    pub(crate) partitioned: AtomicU64,
    changed: Notify,
}

/// A snapshot of a relay's counters (both directions together).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RelayCounters {
    /// Datagrams or stream chunks read from either side.
    pub packets_in: u64,
    /// Datagrams or stream chunks written to either side.
    pub packets_out: u64,
    /// Bytes read.
    pub bytes_in: u64,
    /// Bytes written.
    pub bytes_out: u64,
    /// Datagrams dropped by the loss model.
    pub lost: u64,
    /// Datagrams dropped because a queue's byte budget was full.
    pub overflowed: u64,
    /// Datagrams the OS refused to send, and TCP writes that failed (that side of
    /// the connection was reset or gone).
    pub send_errors: u64,
    /// UDP sessions or TCP connections opened.
    pub flows_opened: u64,
    /// UDP sessions or TCP connections now open.
    pub flows_active: u64,
    /// New sources or connections turned away because the table was full.
    pub flows_rejected: u64,
    /// Datagrams dropped, and TCP connections refused or cut, because their
    /// link's [`LinkGate`] was down.
    pub partitioned: u64,
}

impl RelayStats {
    pub(crate) fn add(&self, counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
        self.changed.notify_waiters();
    }

    pub(crate) fn sub(&self, counter: &AtomicU64, n: u64) {
        counter.fetch_sub(n, Ordering::Relaxed);
        self.changed.notify_waiters();
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> RelayCounters {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        RelayCounters {
            packets_in: g(&self.packets_in),
            packets_out: g(&self.packets_out),
            bytes_in: g(&self.bytes_in),
            bytes_out: g(&self.bytes_out),
            lost: g(&self.lost),
            overflowed: g(&self.overflowed),
            send_errors: g(&self.send_errors),
            flows_opened: g(&self.flows_opened),
            flows_active: g(&self.flows_active),
            flows_rejected: g(&self.flows_rejected),
            partitioned: g(&self.partitioned),
        }
    }

    /// Waits until `cond` holds on the counters; wakes on every change, so a
    /// test can wait for the relay without sleeping.
    pub async fn wait_until(&self, mut cond: impl FnMut(&RelayCounters) -> bool) -> RelayCounters {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let snap = self.snapshot();
            if cond(&snap) {
                return snap;
            }
            notified.await;
        }
    }
}

/// A running relay. Dropping it stops the relay's tasks without waiting;
/// [`shutdown`](Self::shutdown) stops them and waits until all have ended.
#[derive(Debug)]
pub struct RelayHandle {
    pub(crate) local_addr: SocketAddr,
    pub(crate) cancel: CancellationToken,
    pub(crate) tracker: TaskTracker,
    pub(crate) stats: Arc<RelayStats>,
}

impl RelayHandle {
    /// The address the relay listens on (the real port when started on port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The relay's live counters.
    pub fn stats(&self) -> &Arc<RelayStats> {
        &self.stats
    }

    /// Whether the relay has stopped (shut down or failed).
    pub fn is_stopped(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Stops every task of the relay and waits for them to finish.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }
}

impl Drop for RelayHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}
