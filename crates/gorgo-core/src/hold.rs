//! Late binding: requests a node holds back from its engines until one can start them
//! soon, deciding them again meanwhile.
//!
//! A node that sends every request to an engine the moment it arrives decides on what
//! it knew then. When a burst reaches every region at once (the Mooncake conversation
//! trace: about ten requests per timestamp), each node takes its peers for idle because
//! their stats predate the burst, and once a request sits in an engine's queue no later
//! knowledge can move it (docs/policy.md, "The oracle's lead on mc"). At saturation the
//! same holds for every request: it is placed by the cache and queue of the moment it
//! arrived, minutes before it runs. A [`HoldQueue`] keeps a request at the node while
//! its engine has more than [`HoldConfig::engine_tokens`] of prefill dispatched (enough
//! to fill its next prefill batches), in one queue ordered by when the client sent it
//! (forwards included, so a forward never overtakes the node's own older requests nor
//! is overtaken by newer ones). The driver decides held requests again when an engine
//! has room or their last decision is [`HoldConfig::redecide_ms`] old, with the held
//! work ahead of each counted in the local candidates' queues and in the node's gossip.
//!
//! A state machine without IO: the simulator drives it (`gorgo sim --hold-tokens`); the
//! live node does not hold requests yet (docs/policy.md, "Late binding").

use std::collections::VecDeque;

use crate::error::CoreError;

/// When a node holds requests back, and how often it decides them again.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HoldConfig {
    /// Hold while the engine has more than this many prefill tokens dispatched and not
    /// yet prefilled: two chunks of SGLang's default chunked prefill keep its next
    /// prefill batches full (a queue measured in milliseconds instead starved the
    /// batches at the knee: docs/policy.md, "Late binding").
    pub engine_tokens: u64,
    /// Decide a held request again at least this often, ms: new peer stats arrive once
    /// per gossip interval, so deciding more often sees nothing new.
    pub redecide_ms: u64,
    /// Most requests held at once; a request beyond it goes to its engine at once.
    pub max_held: usize,
}

impl HoldConfig {
    /// A config, checked: every field must be positive.
    pub fn new(engine_tokens: u64, redecide_ms: u64, max_held: usize) -> Result<Self, CoreError> {
        let bad = |field: &str| CoreError::InvalidConfig {
            field: field.into(),
            reason: "must be positive".into(),
        };
        if engine_tokens == 0 {
            return Err(bad("hold.engine_tokens"));
        }
        if redecide_ms == 0 {
            return Err(bad("hold.redecide_ms"));
        }
        if max_held == 0 {
            return Err(bad("hold.max_held"));
        }
        Ok(HoldConfig {
            engine_tokens,
            redecide_ms,
            max_held,
        })
    }
}

/// One held request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// The driver's id of the request.
    pub id: u64,
    /// When its client sent it, ms: the queue's order.
    pub send_ms: u64,
    /// Prefill tokens it is expected to need (the prompt less what its engine is
    /// believed to hold): its share of the held work.
    pub uncached_tokens: u64,
    /// When it was last decided, ms.
    pub decided_ms: u64,
}

/// The requests a node holds, oldest first, and their prefill work.
#[derive(Debug, Clone)]
pub struct HoldQueue {
    cfg: HoldConfig,
    entries: VecDeque<Held>,
    tokens: u64,
}

impl HoldQueue {
    /// An empty queue.
    pub fn new(cfg: HoldConfig) -> Self {
        HoldQueue {
            cfg,
            entries: VecDeque::new(),
            tokens: 0,
        }
    }

    /// Whether an engine with `unfinished_prefill_tokens` dispatched and not yet
    /// prefilled has its next prefill batches filled already.
    pub fn engine_busy(&self, unfinished_prefill_tokens: u64) -> bool {
        unfinished_prefill_tokens > self.cfg.engine_tokens
    }

    /// Whether a request just decided for a local engine with
    /// `unfinished_prefill_tokens` waits here: that engine is busy, or requests wait
    /// already and it queues behind them, unless the queue is full. `in_pass`: the
    /// request is one of a [`HoldQueue::drain`] pass, whose older entries still held
    /// are in the queue ahead of it and do not count.
    pub fn should_hold(&self, unfinished_prefill_tokens: u64, in_pass: bool) -> bool {
        if self.entries.len() >= self.cfg.max_held {
            return false;
        }
        self.engine_busy(unfinished_prefill_tokens) || (!in_pass && !self.entries.is_empty())
    }

    /// Hold a request, in its place by `send_ms` (after those sent no later).
    pub fn hold(&mut self, h: Held) {
        let at = self
            .entries
            .iter()
            .rposition(|e| e.send_ms <= h.send_ms)
            .map_or(0, |i| i + 1);
        self.entries.insert(at, h);
        self.tokens = self.tokens.saturating_add(h.uncached_tokens);
    }

    /// Take every held request out, oldest first, for a pass: the driver decides each
    /// one that [`HoldQueue::is_due`] again (those older than it and still held are
    /// back in the queue, ahead of it, [`HoldQueue::tokens`]) and hands back with
    /// [`HoldQueue::hold`] the ones that stay.
    pub fn drain(&mut self) -> Vec<Held> {
        self.tokens = 0;
        self.entries.drain(..).collect()
    }

    /// Whether `h` is decided again now: an engine has room (`engine_free`), or its
    /// last decision is [`HoldConfig::redecide_ms`] old.
    pub fn is_due(&self, h: &Held, now_ms: u64, engine_free: bool) -> bool {
        engine_free || now_ms.saturating_sub(h.decided_ms) >= self.cfg.redecide_ms
    }

    /// Drop a request that no longer waits (its client left); `None` if not held.
    pub fn remove(&mut self, id: u64) -> Option<Held> {
        let i = self.entries.iter().position(|e| e.id == id)?;
        let h = self.entries.remove(i)?;
        self.tokens = self.tokens.saturating_sub(h.uncached_tokens);
        Some(h)
    }

    /// Prefill tokens of the held requests: work the node has taken on that no engine
    /// shows yet, counted in its own candidates and its gossiped stats.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Requests held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cfg() -> HoldConfig {
        HoldConfig::new(16_384, 250, 4).unwrap()
    }

    fn held(id: u64, send_ms: u64, tokens: u64) -> Held {
        Held {
            id,
            send_ms,
            uncached_tokens: tokens,
            decided_ms: send_ms,
        }
    }

    #[test]
    fn a_config_field_at_zero_is_named() {
        let e = HoldConfig::new(16_384, 0, 4).unwrap_err();
        assert!(e.to_string().contains("hold.redecide_ms"), "{e}");
        let e = HoldConfig::new(0, 250, 4).unwrap_err();
        assert!(e.to_string().contains("hold.engine_tokens"), "{e}");
        let e = HoldConfig::new(1, 250, 0).unwrap_err();
        assert!(e.to_string().contains("hold.max_held"), "{e}");
    }

    #[test]
    fn holds_while_the_engine_is_busy_and_queues_new_requests_behind_held_ones() {
        let mut q = HoldQueue::new(cfg());
        assert!(!q.should_hold(16_384, false), "two chunks is not busy");
        assert!(q.should_hold(16_385, false));
        q.hold(held(1, 10, 500));
        assert!(
            q.should_hold(0, false),
            "a new request waits behind a held one"
        );
        assert!(
            !q.should_hold(0, true),
            "in a pass the engine's room decides"
        );
    }

    #[test]
    fn a_full_queue_holds_nothing_more() {
        let mut q = HoldQueue::new(cfg());
        for i in 0..4 {
            q.hold(held(i, i, 1));
        }
        assert!(!q.should_hold(1 << 30, false));
    }

    #[test]
    fn ordered_by_send_time_a_forward_goes_before_newer_requests() {
        let mut q = HoldQueue::new(cfg());
        q.hold(held(1, 100, 10));
        q.hold(held(2, 300, 20));
        // A forward whose client sent it at 200 arrives now.
        q.hold(held(3, 200, 30));
        // Equal send times keep arrival order.
        q.hold(held(4, 300, 40));
        let order: Vec<u64> = q.drain().iter().map(|h| h.id).collect();
        assert_eq!(order, vec![1, 3, 2, 4]);
        assert_eq!(q.tokens(), 0);
    }

    #[test]
    fn due_when_an_engine_has_room_or_the_decision_is_old() {
        let q = HoldQueue::new(cfg());
        let h = held(1, 1000, 10);
        assert!(!q.is_due(&h, 1249, false));
        assert!(q.is_due(&h, 1250, false));
        assert!(q.is_due(&h, 1001, true));
    }

    #[test]
    fn removing_a_request_takes_its_tokens_out() {
        let mut q = HoldQueue::new(cfg());
        q.hold(held(1, 1, 100));
        q.hold(held(2, 2, 50));
        assert_eq!(q.remove(1).map(|h| h.id), Some(1));
        assert_eq!(q.remove(1), None);
        assert_eq!((q.len(), q.tokens()), (1, 50));
    }

    proptest! {
        /// Whatever the order of arrival, a pass sees the requests by send time, and
        /// the held tokens are the sum of what is held.
        #[test]
        fn drain_is_sorted_and_tokens_add_up(
            items in proptest::collection::vec((0u64..1000, 0u64..100_000), 0..40),
            remove in proptest::collection::vec(0u64..40, 0..10),
        ) {
            let mut q = HoldQueue::new(HoldConfig::new(1, 1, 1000).unwrap());
            for (i, &(send, tokens)) in items.iter().enumerate() {
                q.hold(held(i as u64, send, tokens));
            }
            for id in remove {
                q.remove(id);
            }
            let expect: u64 = q.entries.iter().map(|h| h.uncached_tokens).sum();
            prop_assert_eq!(q.tokens(), expect);
            let out = q.drain();
            prop_assert!(out.windows(2).all(|w| w[0].send_ms <= w[1].send_ms));
            // Equal send times keep arrival order (ids are arrival order).
            prop_assert!(out
                .windows(2)
                .all(|w| w[0].send_ms < w[1].send_ms || w[0].id < w[1].id));
        }
    }
}
