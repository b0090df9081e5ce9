//! The sans-IO link model: given a packet (or stream chunk) and the time it
//! arrives, decide whether it is lost and when it leaves the far end.
//! The relays are thin drivers around [`LinkShaper`]; tests drive it with
//! made-up instants.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::sync::watch;

use crate::relay::LinkGate;

/// Default byte budget of one queue (bytes admitted and not yet delivered; see
/// [`LinkParams::queue_limit_bytes`] for which queues have one): 16 MiB holds
/// 130 ms of a 1 Gbit/s link.
pub const DEFAULT_QUEUE_LIMIT_BYTES: usize = 16 * 1024 * 1024;

/// What the queue budget charges each datagram beyond its payload: about
/// what queuing it costs in memory (its delay-queue entry, 120 bytes on
/// 64-bit, and the payload allocation's header). Without it an empty datagram
/// would cost nothing against the budget, and any number of them would queue.
pub const DATAGRAM_OVERHEAD_BYTES: usize = 128;

/// Properties of one direction of an emulated link.
#[derive(Clone, Debug, PartialEq)]
pub struct LinkParams {
    /// Fixed one-way propagation delay.
    pub delay: Duration,
    /// Each packet's delay is `delay` plus a uniform draw in `[-jitter, +jitter]`
    /// (never below zero). Datagrams may reorder only when this is non-zero.
    pub jitter: Duration,
    /// Fraction of datagrams dropped, in `[0, 1)`. Streams (TCP) never lose bytes.
    pub loss: f64,
    /// Serialisation rate in bits per second; `None` is unlimited.
    pub rate_bps: Option<u64>,
    /// Byte budget of each queue on this link direction: a datagram that would
    /// push its queue over it is dropped (each is charged its length plus
    /// [`DATAGRAM_OVERHEAD_BYTES`]); a TCP relay stops reading instead.
    ///
    /// Budgets are per flow, not per relay. A TCP relay gives each connection
    /// direction its own (at least one `chunk_size`): a budget its connections
    /// shared would let one stalled reader stall them all, which per-flow TCP
    /// windows do not. A UDP relay has one towards its target per link (per
    /// source-IP route, shared by that link's sessions) and one back per
    /// session. So a relay can queue up to: TCP, `max_connections x 2 x` this;
    /// UDP, `(links + max_sessions) x` this.
    pub queue_limit_bytes: usize,
}

impl LinkParams {
    /// A link with only a fixed delay: no jitter, loss or rate limit.
    pub fn delay_only(delay: Duration) -> Self {
        LinkParams {
            delay,
            jitter: Duration::ZERO,
            loss: 0.0,
            rate_bps: None,
            queue_limit_bytes: DEFAULT_QUEUE_LIMIT_BYTES,
        }
    }
}

/// The parameters of one link direction, shared by every shaper that carries
/// it (clones share them, as [`LinkGate`] clones share the gate).
///
/// It exists so the control API can make a link slower or faster while the
/// relays run: a change applies to what is admitted after it (datagrams and
/// stream chunks already queued keep their delivery time), and, as the link
/// never reorders without jitter, a shorter delay shows once what was sent
/// before it has arrived.
#[derive(Clone, Debug)]
pub struct SharedLinkParams {
    params: Arc<watch::Sender<LinkParams>>,
}

impl SharedLinkParams {
    /// A direction that starts with `params`.
    pub fn new(params: LinkParams) -> Self {
        SharedLinkParams {
            params: Arc::new(watch::Sender::new(params)),
        }
    }

    /// The parameters now.
    pub fn get(&self) -> LinkParams {
        self.params.borrow().clone()
    }

    /// Changes the parameters with `change`; returns whether they changed.
    pub fn update(&self, change: impl FnOnce(&mut LinkParams)) -> bool {
        self.params.send_if_modified(|params| {
            let before = params.clone();
            change(params);
            *params != before
        })
    }

    /// A shaper for one flow of this direction that follows its changes.
    pub(crate) fn shaper(&self, mode: Mode, seed: u64) -> LiveShaper {
        let mut params = self.params.subscribe();
        let shaper = LinkShaper::new(params.borrow_and_update().clone(), mode, seed);
        LiveShaper { shaper, params }
    }
}

impl From<LinkParams> for SharedLinkParams {
    fn from(params: LinkParams) -> Self {
        SharedLinkParams::new(params)
    }
}

/// A [`LinkShaper`] that takes its direction's [`SharedLinkParams`] as they
/// change: the relays' shaper, while `LinkShaper` stays a pure state machine.
#[derive(Debug)]
pub(crate) struct LiveShaper {
    shaper: LinkShaper,
    params: watch::Receiver<LinkParams>,
}

impl LiveShaper {
    /// [`LinkShaper::admit`] under the direction's parameters now.
    pub(crate) fn admit(&mut self, now: Instant, len: usize) -> Verdict {
        // An error means every `SharedLinkParams` is gone: nothing can change.
        if self.params.has_changed().unwrap_or(false) {
            let params = self.params.borrow_and_update().clone();
            self.shaper.set_params(params);
        }
        self.shaper.admit(now, len)
    }

    /// [`LinkShaper::release`].
    pub(crate) fn release(&mut self, len: usize) {
        self.shaper.release(len);
    }
}

/// Both directions of a relayed path: towards the relay's target and back, and
/// the switch that can cut it.
#[derive(Clone, Debug)]
pub struct DuplexLink {
    /// Source (the relay's client) to target.
    pub to_target: SharedLinkParams,
    /// Target's replies back to the source.
    pub to_source: SharedLinkParams,
    /// Up or cut (a partition); clones of a link share it, so one switch can cut
    /// both relays a pair of regions talks through.
    pub gate: LinkGate,
}

impl DuplexLink {
    /// The same parameters in both directions (each direction its own, so a
    /// change to one leaves the other), with a gate of its own (up).
    pub fn symmetric(link: LinkParams) -> Self {
        DuplexLink {
            to_target: SharedLinkParams::new(link.clone()),
            to_source: SharedLinkParams::new(link),
            gate: LinkGate::default(),
        }
    }
}

/// How the shaper treats what it carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// UDP: independent datagrams; loss applies; reorder happens only with jitter.
    Datagram,
    /// TCP: an ordered byte stream; never lost, a chunk never overtakes an earlier one.
    Stream,
}

/// What happens to one admitted packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Deliver at this instant.
    Deliver(Instant),
    /// Dropped by the loss model.
    Lost,
    /// Dropped because the queue's byte budget is full.
    Overflow,
}

/// One direction of an emulated link as a state machine with `now` as input.
#[derive(Debug)]
pub struct LinkShaper {
    params: LinkParams,
    mode: Mode,
    rng: ChaCha8Rng,
    /// When the emulated wire finishes serialising what was admitted so far.
    wire_free_at: Option<Instant>,
    /// Latest delivery instant handed out (for stream order).
    last_delivery: Option<Instant>,
    queued_bytes: usize,
}

impl LinkShaper {
    /// A shaper whose loss and jitter draws follow `seed` deterministically.
    pub fn new(params: LinkParams, mode: Mode, seed: u64) -> Self {
        LinkShaper {
            params,
            mode,
            rng: ChaCha8Rng::seed_from_u64(seed),
            wire_free_at: None,
            last_delivery: None,
            queued_bytes: 0,
        }
    }

    /// The link parameters this shaper applies.
    pub fn params(&self) -> &LinkParams {
        &self.params
    }

    /// Applies `params` from the next [`admit`](Self::admit) on. What was
    /// admitted before keeps its delivery time, and the wire and order state
    /// carry over: a new rate serialises behind what is still on the wire, and
    /// where the link keeps order a shorter delay delivers nothing before what
    /// was admitted earlier. The queue budget counts on (what is queued was
    /// charged under the old one).
    pub fn set_params(&mut self, params: LinkParams) {
        self.params = params;
    }

    /// In [`Mode::Datagram`], bytes charged for datagrams admitted and not yet
    /// [`released`](Self::release) (each its length plus
    /// [`DATAGRAM_OVERHEAD_BYTES`]): what the queue budget limits. Always 0 in
    /// [`Mode::Stream`], which never drops for a full queue: the TCP relay
    /// bounds its queue with credit of its own and never releases here, so a
    /// count would only grow.
    pub fn queued_bytes(&self) -> usize {
        self.queued_bytes
    }

    /// Decides the fate of `len` bytes arriving at `now`. In
    /// [`Mode::Datagram`] a `Deliver` verdict counts the bytes as queued until
    /// [`release`](Self::release).
    pub fn admit(&mut self, now: Instant, len: usize) -> Verdict {
        if self.mode == Mode::Datagram {
            if self.params.loss > 0.0 && self.rng.random::<f64>() < self.params.loss {
                return Verdict::Lost;
            }
            if self.queued_bytes.saturating_add(charge(len)) > self.params.queue_limit_bytes {
                return Verdict::Overflow;
            }
        }
        // Serialisation: the wire carries one packet at a time at the link rate.
        let sent_at = match self.params.rate_bps {
            Some(rate) if rate > 0 => {
                let start = self.wire_free_at.map_or(now, |free| free.max(now));
                let bits = len as u128 * 8;
                let nanos = bits * 1_000_000_000 / rate as u128;
                let done = start + Duration::from_nanos(nanos.min(u64::MAX as u128) as u64);
                self.wire_free_at = Some(done);
                done
            }
            _ => now,
        };
        let mut delay = self.params.delay;
        if !self.params.jitter.is_zero() {
            let j = self.params.jitter.as_secs_f64();
            let offset = self.rng.random_range(-j..=j);
            delay = Duration::from_secs_f64((delay.as_secs_f64() + offset).max(0.0));
        }
        let mut at = sent_at + delay;
        if self.mode == Mode::Stream || self.params.jitter.is_zero() {
            // Order-preserving: never earlier than what was admitted before.
            if let Some(last) = self.last_delivery {
                at = at.max(last);
            }
        }
        self.last_delivery = Some(self.last_delivery.map_or(at, |l| l.max(at)));
        if self.mode == Mode::Datagram {
            // Within the budget checked above, so it cannot overflow.
            self.queued_bytes += charge(len);
        }
        Verdict::Deliver(at)
    }

    /// Gives back the budget of a delivered (or abandoned) datagram of `len`
    /// bytes: what [`admit`](Self::admit) charged for it.
    pub fn release(&mut self, len: usize) {
        self.queued_bytes = self.queued_bytes.saturating_sub(charge(len));
    }
}

/// What a datagram of `len` bytes takes from its queue's budget.
fn charge(len: usize) -> usize {
    len.saturating_add(DATAGRAM_OVERHEAD_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn lossy(loss: f64) -> LinkParams {
        LinkParams {
            loss,
            ..LinkParams::delay_only(Duration::ZERO)
        }
    }

    #[test]
    fn one_percent_loss_is_about_one_percent_and_seeded() {
        let now = Instant::now();
        let count = |seed| {
            let mut s = LinkShaper::new(lossy(0.01), Mode::Datagram, seed);
            (0..20_000)
                .filter(|_| {
                    let v = s.admit(now, 100);
                    s.release(100);
                    v == Verdict::Lost
                })
                .count()
        };
        let lost = count(7);
        assert!((100..=300).contains(&lost), "lost {lost} of 20000");
        assert_eq!(lost, count(7), "same seed, same losses");
    }

    #[test]
    fn rate_adds_serialisation_delay() {
        let now = Instant::now();
        let params = LinkParams {
            rate_bps: Some(8_000_000), // 1 byte per microsecond
            ..LinkParams::delay_only(Duration::from_millis(10))
        };
        let mut s = LinkShaper::new(params, Mode::Datagram, 1);
        assert_eq!(
            s.admit(now, 1000),
            Verdict::Deliver(now + Duration::from_micros(11_000))
        );
        assert_eq!(
            s.admit(now, 1000),
            Verdict::Deliver(now + Duration::from_micros(12_000))
        );
    }

    #[test]
    fn overflow_drops_until_released() {
        let now = Instant::now();
        let params = LinkParams {
            queue_limit_bytes: 1500,
            ..LinkParams::delay_only(Duration::from_millis(1))
        };
        let mut s = LinkShaper::new(params, Mode::Datagram, 1);
        assert!(matches!(s.admit(now, 1000), Verdict::Deliver(_)));
        assert_eq!(s.admit(now, 1000), Verdict::Overflow);
        s.release(1000);
        assert!(matches!(s.admit(now, 1000), Verdict::Deliver(_)));
    }

    /// Empty datagrams are charged too (their queue entries take memory), so a
    /// 1 KiB budget under a long delay holds a handful, not all 10,000.
    #[test]
    fn empty_datagrams_fill_the_budget() {
        let now = Instant::now();
        let params = LinkParams {
            queue_limit_bytes: 1024,
            ..LinkParams::delay_only(Duration::from_secs(20))
        };
        let mut s = LinkShaper::new(params, Mode::Datagram, 1);
        let admitted = (0..10_000)
            .filter(|_| matches!(s.admit(now, 0), Verdict::Deliver(_)))
            .count();
        assert_eq!(admitted, 1024 / DATAGRAM_OVERHEAD_BYTES);
        for _ in 0..admitted {
            s.release(0);
        }
        assert_eq!(s.queued_bytes(), 0, "release gives back what admit charged");
        assert!(matches!(s.admit(now, 0), Verdict::Deliver(_)));
    }

    /// A stream shaper counts nothing as queued, however much it admits: the
    /// TCP relay never releases, so a count would only grow (and overflow).
    #[test]
    fn stream_mode_keeps_no_queue_count() {
        let now = Instant::now();
        let mut s = LinkShaper::new(LinkParams::delay_only(Duration::ZERO), Mode::Stream, 1);
        for _ in 0..3 {
            assert!(matches!(s.admit(now, usize::MAX / 2), Verdict::Deliver(_)));
        }
        assert_eq!(s.queued_bytes(), 0);
    }

    /// New parameters apply from the next admit; what was admitted keeps its
    /// time, and a shorter delay does not let a stream chunk overtake.
    #[test]
    fn new_params_apply_to_what_is_admitted_after() {
        let now = Instant::now();
        let ms = Duration::from_millis;
        let shared = SharedLinkParams::new(LinkParams::delay_only(ms(100)));
        let mut s = shared.shaper(Mode::Stream, 1);
        assert_eq!(s.admit(now, 10), Verdict::Deliver(now + ms(100)));
        assert!(shared.update(|p| p.delay = ms(10)));
        assert!(!shared.update(|p| p.delay = ms(10)), "no change");
        let later = now + ms(50);
        // Due at 60 ms, but a stream keeps order: not before the first chunk.
        assert_eq!(s.admit(later, 10), Verdict::Deliver(now + ms(100)));
        assert_eq!(s.admit(now + ms(200), 10), Verdict::Deliver(now + ms(210)));
        // A rate set later serialises what comes after: 1000 bytes at 8 Mbit/s.
        shared.update(|p| p.rate_bps = Some(8_000_000));
        assert_eq!(
            s.admit(now + ms(300), 1000),
            Verdict::Deliver(now + ms(311))
        );
        // Loss: a datagram shaper made before the change loses about half after it.
        let mut d = shared.shaper(Mode::Datagram, 2);
        shared.update(|p| p.loss = 0.5);
        let lost = (0..1000)
            .filter(|_| d.admit(now, 0) == Verdict::Lost)
            .count();
        assert!((400..=600).contains(&lost), "lost {lost} of 1000 at 50%");
    }

    proptest! {
        /// Without jitter, or in stream mode, deliveries never reorder.
        #[test]
        fn order_preserved_unless_jitter(
            gaps in proptest::collection::vec(0u64..5_000, 1..200),
            lens in proptest::collection::vec(1usize..3000, 200),
            delay_us in 0u64..200_000,
            jitter_us in 0u64..50_000,
            rate in proptest::option::of(1_000_000u64..1_000_000_000),
            stream in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let jitter_us = if stream { jitter_us } else { 0 };
            let params = LinkParams {
                delay: Duration::from_micros(delay_us),
                jitter: Duration::from_micros(jitter_us),
                loss: 0.0,
                rate_bps: rate,
                queue_limit_bytes: usize::MAX,
            };
            let mode = if stream { Mode::Stream } else { Mode::Datagram };
            let mut s = LinkShaper::new(params, mode, seed);
            let mut now = Instant::now();
            let mut last = None;
            for (gap, len) in gaps.iter().zip(&lens) {
                now += Duration::from_micros(*gap);
                let Verdict::Deliver(at) = s.admit(now, *len) else { panic!("dropped") };
                prop_assert!(at >= now);
                if let Some(l) = last { prop_assert!(at >= l); }
                last = Some(at);
            }
        }

        /// Jitter keeps each delay within delay +- jitter (plus serialisation).
        #[test]
        fn jitter_stays_in_bounds(delay_ms in 0u64..300, jitter_ms in 0u64..50, seed in any::<u64>()) {
            let params = LinkParams {
                jitter: Duration::from_millis(jitter_ms),
                ..LinkParams::delay_only(Duration::from_millis(delay_ms))
            };
            let mut s = LinkShaper::new(params, Mode::Datagram, seed);
            let now = Instant::now();
            for _ in 0..50 {
                let Verdict::Deliver(at) = s.admit(now, 10) else { panic!("dropped") };
                let d = at - now;
                prop_assert!(d <= Duration::from_millis(delay_ms + jitter_ms) + Duration::from_micros(1));
                prop_assert!(d + Duration::from_millis(jitter_ms) + Duration::from_micros(1) >= Duration::from_millis(delay_ms));
            }
        }
    }
}
