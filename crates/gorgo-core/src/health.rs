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

    /// How bad it is, for the worst of several engines: open (no request at all) over
    /// half-open (a probe may pass) over closed. Not [`BreakerState::code`]'s order,
    /// whose maximum called an open engine beside a half-open one half-open.
    pub fn severity(&self) -> u8 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::HalfOpen { .. } => 1,
            BreakerState::Open { .. } => 2,
        }
    }
}

/// What happened to a real request, as the breaker counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestOutcome {
    /// The engine answered (a head that is no 5xx).
    Answered,
    /// Connect error, reset, first-byte timeout, or a head that says the engine failed
    /// (the node counts 502, 503 and 504: another 5xx answers for the request).
    Failed,
}

/// What the breaker says to a request about to go to the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Not now: the breaker is open, or its half-open probe is taken.
    Refused,
    /// Send it; it counts like any request.
    Admitted,
    /// Send it: it is the half-open probe, and no other request goes until its outcome
    /// is in, or it is given up ([`EngineHealth::abandon_probe`]).
    Probe,
}

impl Admission {
    /// Whether the request may go.
    pub fn may_send(self) -> bool {
        self != Admission::Refused
    }
}

/// A change of routability the driver acts on (e.g. cancel requests waiting for a
/// head when the breaker opens).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthChange {
    /// The engine stopped being routable.
    Opened,
    /// The engine is routable again.
    Closed,
    /// The breaker opened again from half-open while its probe was out (the probe
    /// failed, or a health check did): it was not routable before either, but a probe
    /// still waiting for its head decides nothing any more, and its request should
    /// fail over now rather than wait (the driver wakes it as on `Opened`).
    Reopened,
}

/// The breaker.
#[derive(Debug, Clone)]
pub struct EngineHealth {
    config: HealthConfig,
    state: BreakerState,
    consecutive_failures: u32,
    /// A health check has passed at least once (readiness needs evidence).
    confirmed: bool,
    /// Probes admitted so far: which one holds the slot ([`EngineHealth::probe`]), so
    /// that giving up an old one does not free a newer one's.
    probes: u64,
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
            probes: 0,
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

    /// A request is about to go to the engine: whether it may (in half-open it takes
    /// the probe slot).
    pub fn admit(&mut self, now_ms: u64) -> Admission {
        match self.state(now_ms) {
            BreakerState::Closed => Admission::Admitted,
            BreakerState::HalfOpen { probing: false } => {
                self.state = BreakerState::HalfOpen { probing: true };
                self.probes += 1;
                Admission::Probe
            }
            _ => Admission::Refused,
        }
    }

    /// The probe [`EngineHealth::admit`] admitted last (after [`Admission::Probe`]:
    /// the one holding the slot), for [`EngineHealth::abandon_probe`].
    pub fn probe(&self) -> u64 {
        self.probes
    }

    /// Probe `probe` ([`EngineHealth::probe`]) was given up before its outcome (its
    /// client went away): the slot is free for the next request, instead of the engine
    /// going unused until the next health check. Only if it still holds the slot: a
    /// probe given up after the breaker opened again and admitted another must not
    /// free that one's, or two would be out at once.
    pub fn abandon_probe(&mut self, probe: u64) {
        if probe == self.probes && self.state == (BreakerState::HalfOpen { probing: true }) {
            self.state = BreakerState::HalfOpen { probing: false };
        }
    }

    /// The outcome of a real request other than the half-open probe (whose failure is
    /// [`EngineHealth::on_probe_failed`]'s).
    ///
    /// While the breaker is not closed, every such request was sent before it opened
    /// (it admits none but the probe since). An answer during the cooldown is older
    /// news than what opened it, so it does not close it (the cooldown holds, and then
    /// one probe decides); after the cooldown an answer shows the engine serving now,
    /// and closes it. A failure is the opening's own news arriving late (the requests a
    /// hung engine held time out one by one): it neither extends the cooldown nor
    /// reopens a half-open breaker, whose probe decides. Before, each such timeout
    /// opened the breaker for another whole cooldown, and one arriving while a probe
    /// was out threw the probe's success away.
    pub fn on_request(&mut self, outcome: RequestOutcome, now_ms: u64) -> Option<HealthChange> {
        let state = self.state(now_ms);
        match outcome {
            RequestOutcome::Answered if matches!(state, BreakerState::Open { .. }) => None,
            RequestOutcome::Answered => self.succeed(),
            RequestOutcome::Failed if state != BreakerState::Closed => None,
            RequestOutcome::Failed => {
                self.consecutive_failures = self.consecutive_failures.saturating_add(1);
                if self.consecutive_failures >= self.config.failures_to_open {
                    self.open(now_ms)
                } else {
                    None
                }
            }
        }
    }

    /// Probe `probe` ([`EngineHealth::probe`]) failed: open again for a whole
    /// cooldown, if it still holds the slot (a health check may have reopened the
    /// breaker while it was out, and a later probe may hold the slot now).
    pub fn on_probe_failed(&mut self, probe: u64, now_ms: u64) -> Option<HealthChange> {
        if probe == self.probes && self.state(now_ms) == (BreakerState::HalfOpen { probing: true })
        {
            self.consecutive_failures = self.consecutive_failures.saturating_add(1);
            self.open(now_ms)
        } else {
            None
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
        let before = self.state;
        self.state = BreakerState::Open {
            until_ms: now_ms.saturating_add(self.config.cooldown_ms),
        };
        match before {
            BreakerState::Closed => Some(HealthChange::Opened),
            BreakerState::HalfOpen { probing: true } => Some(HealthChange::Reopened),
            _ => None,
        }
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
        assert!(!h.admit(500).may_send());
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
        assert_eq!(h.admit(1_000), Admission::Probe);
        assert_eq!(h.admit(1_001), Admission::Refused, "one probe at a time");
        assert!(!h.routable(1_001));
        // The probe fails: open again for a full cooldown.
        assert_eq!(
            h.on_probe_failed(h.probe(), 1_200),
            Some(HealthChange::Reopened)
        );
        assert_eq!(h.state(1_300), BreakerState::Open { until_ms: 2_200 });
        // The next probe succeeds: closed.
        assert_eq!(h.admit(2_200), Admission::Probe);
        assert_eq!(
            h.on_request(RequestOutcome::Answered, 2_300),
            Some(HealthChange::Closed)
        );
        assert!(h.routable(2_300));
        assert_eq!(h.admit(2_300), Admission::Admitted);
    }

    /// A request sent before the breaker opened that is answered during the cooldown
    /// does not close it: "open" holds for the cooldown, whatever was in flight.
    #[test]
    fn a_late_answer_does_not_cut_the_cooldown_short() {
        let mut h = breaker();
        assert_eq!(h.on_check(false, 0), Some(HealthChange::Opened));
        assert_eq!(h.on_request(RequestOutcome::Answered, 10), None);
        assert!(!h.routable(10));
        assert_eq!(h.state(10), BreakerState::Open { until_ms: 1_000 });
        // After the cooldown an answer is news again.
        assert_eq!(
            h.on_request(RequestOutcome::Answered, 1_000),
            Some(HealthChange::Closed)
        );
    }

    /// A request sent before the breaker opened that fails later (a hung engine's held
    /// requests time out one by one) neither extends the cooldown nor reopens the
    /// half-open breaker, nor throws away its probe's success: the probe decides.
    #[test]
    fn a_late_failure_is_the_openings_news_not_new_news() {
        let mut h = breaker();
        for _ in 0..3 {
            h.on_request(RequestOutcome::Failed, 0);
        }
        assert_eq!(h.state(0), BreakerState::Open { until_ms: 1_000 });
        assert_eq!(h.on_request(RequestOutcome::Failed, 500), None);
        assert_eq!(h.state(500), BreakerState::Open { until_ms: 1_000 });
        assert_eq!(h.admit(1_000), Admission::Probe);
        assert_eq!(h.on_request(RequestOutcome::Failed, 1_001), None);
        assert_eq!(h.state(1_001), BreakerState::HalfOpen { probing: true });
        assert_eq!(
            h.on_request(RequestOutcome::Answered, 1_002),
            Some(HealthChange::Closed)
        );
        // A probe's failure after it lost the slot decides nothing.
        h.on_check(false, 2_000);
        assert_eq!(h.admit(3_000), Admission::Probe);
        let stale = h.probe();
        assert_eq!(h.on_check(false, 3_100), Some(HealthChange::Reopened));
        assert_eq!(h.admit(4_100), Admission::Probe);
        assert_eq!(h.on_probe_failed(stale, 4_200), None);
        assert_eq!(h.state(4_200), BreakerState::HalfOpen { probing: true });
        // Closed, failures count again.
        h.on_request(RequestOutcome::Answered, 4_300);
        for _ in 0..2 {
            assert_eq!(h.on_request(RequestOutcome::Failed, 4_400), None);
        }
        assert_eq!(
            h.on_request(RequestOutcome::Failed, 4_400),
            Some(HealthChange::Opened)
        );
    }

    /// A probe given up before its outcome frees the slot for the next request.
    #[test]
    fn an_abandoned_probe_frees_its_slot() {
        let mut h = breaker();
        h.on_check(false, 0);
        assert_eq!(h.admit(1_000), Admission::Probe);
        assert!(!h.routable(1_000));
        h.abandon_probe(h.probe());
        assert!(h.routable(1_000));
        assert_eq!(h.admit(1_001), Admission::Probe);
        // Giving up is only for the probe: a closed breaker stays closed.
        h.on_request(RequestOutcome::Answered, 1_100);
        h.abandon_probe(h.probe());
        assert_eq!(h.state(1_100), BreakerState::Closed);
    }

    /// A failed health check while the probe is out opens the breaker again and says
    /// so (its request fails over instead of waiting for a head); after the cooldown
    /// the next probe holds the slot, and the first one given up late does not free it.
    #[test]
    fn a_probe_outlived_by_a_reopen_neither_waits_nor_frees_the_next_ones_slot() {
        let mut h = breaker();
        h.on_check(false, 0);
        assert_eq!(h.admit(1_000), Admission::Probe);
        let first = h.probe();
        assert_eq!(h.on_check(false, 1_100), Some(HealthChange::Reopened));
        assert_eq!(h.state(1_200), BreakerState::Open { until_ms: 2_100 });
        assert_eq!(h.admit(2_100), Admission::Probe);
        h.abandon_probe(first);
        assert_eq!(h.admit(2_101), Admission::Refused, "one probe at a time");
        h.abandon_probe(h.probe());
        assert_eq!(h.admit(2_102), Admission::Probe);
    }

    proptest! {
        /// Whatever the sequence, a closed breaker admits, an open one inside its
        /// cooldown never does, and `Opened`/`Closed` changes alternate.
        #[test]
        fn changes_alternate_and_open_never_admits(
            events in proptest::collection::vec((0u8..5, 0u64..3_000), 1..200)
        ) {
            let mut h = breaker();
            let mut now = 0u64;
            let mut last: Option<HealthChange> = None;
            for (kind, dt) in events {
                now += dt;
                let change = match kind {
                    0 if dt % 3 == 0 => h.on_probe_failed(h.probe(), now),
                    0 => h.on_request(RequestOutcome::Failed, now),
                    1 => h.on_request(RequestOutcome::Answered, now),
                    2 => h.on_check(dt % 2 == 0, now),
                    3 => {
                        h.admit(now);
                        None
                    }
                    _ => {
                        h.abandon_probe(h.probe());
                        None
                    }
                };
                if let Some(c) = change.filter(|c| *c != HealthChange::Reopened) {
                    prop_assert_ne!(Some(c), last);
                    last = Some(c);
                }
                match h.state(now) {
                    BreakerState::Open { until_ms } => {
                        prop_assert!(until_ms > now);
                        let mut probe = h.clone();
                        prop_assert_eq!(probe.admit(now), Admission::Refused);
                    }
                    BreakerState::Closed => prop_assert!(h.routable(now)),
                    BreakerState::HalfOpen { .. } => {}
                }
            }
        }
    }
}
