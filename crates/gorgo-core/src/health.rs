//! The node's judgement of its engine's health: health checks and the outcomes of
//! real requests in, "may I send it work" out. A sans-IO circuit breaker.
//!
//! Health checks alone are slow to notice a hung engine (one check per interval, each
//! waiting for its timeout) and blind to an engine that answers `/health` but fails
//! requests. So real requests count too, as SGLang's router does: a run of
//! `failures_to_open` consecutive failures (connect errors, first-byte timeouts, 5xx)
//! opens the breaker, as does one failed health check (a check is a deliberate probe
//! with its own short timeout). An open breaker sends nothing for `cooldown_ms`, then
//! goes half-open: one request (or the next health check) probes; success closes it,
//! failure opens it again for another cooldown.

use serde::Serialize;

/// Breaker settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthConfig {
    /// Consecutive request failures that open the breaker (>= 1).
    pub failures_to_open: u32,
    /// How long an open breaker refuses work before a probe, ms.
    pub cooldown_ms: u64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            failures_to_open: 3,
            cooldown_ms: 2_000,
        }
    }
}

/// Where the breaker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case", tag = "state")]
pub enum BreakerState {
    /// Work flows.
    Closed,
    /// No work until `until_ms`.
    Open {
        /// When the cooldown ends.
        until_ms: u64,
    },
    /// One probe is allowed (or in flight); its outcome decides.
    HalfOpen {
        /// A request took the probe slot.
        probing: bool,
    },
}

impl BreakerState {
    /// The gauge value: 0 closed, 1 open, 2 half-open.
    pub fn code(&self) -> i64 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::Open { .. } => 1,
            BreakerState::HalfOpen { .. } => 2,
        }
    }
}

/// What happened to a real request, as the breaker counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestOutcome {
    /// The engine answered with a non-5xx head.
    Answered,
    /// Connect error, reset, first-byte timeout, or a 5xx head.
    Failed,
}

/// A change of routability the driver acts on (e.g. cancel requests waiting for a
/// head when the breaker opens).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthChange {
    /// The engine stopped being routable.
    Opened,
    /// The engine is routable again.
    Closed,
}

/// The breaker.
#[derive(Debug, Clone)]
pub struct EngineHealth {
    config: HealthConfig,
    state: BreakerState,
    consecutive_failures: u32,
    /// A health check has passed at least once (readiness needs evidence).
    confirmed: bool,
}

impl EngineHealth {
    /// A closed breaker, not yet confirmed: optimistic, so a node started beside a
    /// live engine serves at once; the first failure speaks.
    pub fn new(config: HealthConfig) -> Self {
        EngineHealth {
            config: HealthConfig {
                failures_to_open: config.failures_to_open.max(1),
                ..config
            },
            state: BreakerState::Closed,
            consecutive_failures: 0,
            confirmed: false,
        }
    }

    /// The state at `now_ms` (an open breaker whose cooldown ended reads half-open).
    pub fn state(&self, now_ms: u64) -> BreakerState {
        match self.state {
            BreakerState::Open { until_ms } if now_ms >= until_ms => {
                BreakerState::HalfOpen { probing: false }
            }
            s => s,
        }
    }

    /// Whether routing may count on the engine at `now_ms`: closed, or half-open with
    /// the probe slot free.
    pub fn routable(&self, now_ms: u64) -> bool {
        matches!(
            self.state(now_ms),
            BreakerState::Closed | BreakerState::HalfOpen { probing: false }
        )
    }

    /// Whether a health check has ever passed.
    pub fn confirmed(&self) -> bool {
        self.confirmed
    }

    /// A request is about to go to the engine: `true` if it may (in half-open it takes
    /// the probe slot).
    pub fn admit(&mut self, now_ms: u64) -> bool {
        match self.state(now_ms) {
            BreakerState::Closed => true,
            BreakerState::HalfOpen { probing: false } => {
                self.state = BreakerState::HalfOpen { probing: true };
                true
            }
            _ => false,
        }
    }

    /// The outcome of a real request.
    pub fn on_request(&mut self, outcome: RequestOutcome, now_ms: u64) -> Option<HealthChange> {
        match outcome {
            RequestOutcome::Answered => self.succeed(),
            RequestOutcome::Failed => {
                self.consecutive_failures = self.consecutive_failures.saturating_add(1);
                let probing = matches!(self.state(now_ms), BreakerState::HalfOpen { .. });
                if probing || self.consecutive_failures >= self.config.failures_to_open {
                    self.open(now_ms)
                } else {
                    None
                }
            }
        }
    }

    /// The result of a health check.
    pub fn on_check(&mut self, ok: bool, now_ms: u64) -> Option<HealthChange> {
        if ok {
            self.confirmed = true;
            self.succeed()
        } else {
            self.open(now_ms)
        }
    }

    fn succeed(&mut self) -> Option<HealthChange> {
        self.consecutive_failures = 0;
        let was_routable = matches!(self.state, BreakerState::Closed);
        self.state = BreakerState::Closed;
        (!was_routable).then_some(HealthChange::Closed)
    }

    fn open(&mut self, now_ms: u64) -> Option<HealthChange> {
        let was_closed = matches!(self.state, BreakerState::Closed);
        self.state = BreakerState::Open {
            until_ms: now_ms.saturating_add(self.config.cooldown_ms),
        };
        was_closed.then_some(HealthChange::Opened)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn breaker() -> EngineHealth {
        EngineHealth::new(HealthConfig {
            failures_to_open: 3,
            cooldown_ms: 1_000,
        })
    }

    #[test]
    fn opens_after_consecutive_failures_only() {
        let mut h = breaker();
        assert_eq!(h.on_request(RequestOutcome::Failed, 0), None);
        assert_eq!(h.on_request(RequestOutcome::Failed, 0), None);
        assert_eq!(h.on_request(RequestOutcome::Answered, 0), None);
        assert_eq!(h.on_request(RequestOutcome::Failed, 0), None);
        assert_eq!(h.on_request(RequestOutcome::Failed, 0), None);
        assert!(h.routable(0));
        assert_eq!(
            h.on_request(RequestOutcome::Failed, 10),
            Some(HealthChange::Opened)
        );
        assert!(!h.routable(10));
        assert!(!h.admit(500));
    }

    #[test]
    fn a_failed_check_opens_at_once_and_a_passing_one_closes() {
        let mut h = breaker();
        assert!(!h.confirmed());
        assert_eq!(h.on_check(false, 0), Some(HealthChange::Opened));
        assert!(!h.routable(0));
        assert_eq!(h.on_check(true, 100), Some(HealthChange::Closed));
        assert!(h.routable(100));
        assert!(h.confirmed());
    }

    #[test]
    fn half_open_admits_one_probe_whose_outcome_decides() {
        let mut h = breaker();
        h.on_check(false, 0);
        assert_eq!(h.state(999), BreakerState::Open { until_ms: 1_000 });
        assert_eq!(h.state(1_000), BreakerState::HalfOpen { probing: false });
        assert!(h.routable(1_000));
        assert!(h.admit(1_000));
        assert!(!h.admit(1_001), "one probe at a time");
        assert!(!h.routable(1_001));
        // The probe fails: open again for a full cooldown.
        assert_eq!(h.on_request(RequestOutcome::Failed, 1_200), None);
        assert_eq!(h.state(1_300), BreakerState::Open { until_ms: 2_200 });
        // The next probe succeeds: closed.
        assert!(h.admit(2_200));
        assert_eq!(
            h.on_request(RequestOutcome::Answered, 2_300),
            Some(HealthChange::Closed)
        );
        assert!(h.routable(2_300));
    }

    proptest! {
        /// Whatever the sequence, a closed breaker admits, an open one inside its
        /// cooldown never does, and `Opened`/`Closed` changes alternate.
        #[test]
        fn changes_alternate_and_open_never_admits(
            events in proptest::collection::vec((0u8..3, 0u64..3_000), 1..200)
        ) {
            let mut h = breaker();
            let mut now = 0u64;
            let mut last: Option<HealthChange> = None;
            for (kind, dt) in events {
                now += dt;
                let change = match kind {
                    0 => h.on_request(RequestOutcome::Failed, now),
                    1 => h.on_request(RequestOutcome::Answered, now),
                    _ => h.on_check(dt % 2 == 0, now),
                };
                if let Some(c) = change {
                    prop_assert_ne!(Some(c), last);
                    last = Some(c);
                }
                match h.state(now) {
                    BreakerState::Open { until_ms } => {
                        prop_assert!(until_ms > now);
                        let mut probe = h.clone();
                        prop_assert!(!probe.admit(now));
                    }
                    BreakerState::Closed => prop_assert!(h.routable(now)),
                    BreakerState::HalfOpen { .. } => {}
                }
            }
        }
    }
}
