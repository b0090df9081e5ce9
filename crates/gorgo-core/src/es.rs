//! The (1+1) evolution strategy that tunes `w_rtt` and `w_queue` against p95 TTFT.
//!
//! - Mutation in log space, `w' = exp(ln w + sigma * N(0, 1))` per weight, clipped to
//!   the bounds: weights are positive and their effect is multiplicative.
//! - Step size by Rechenberg's 1/5 rule over the last 8 outcomes (decay 0.817).
//! - Two fixes over the paper's code (docs/design.md, "Online tuning"): a candidate is
//!   accepted only when strictly better than the incumbent re-measured in an adjacent
//!   window (a lucky incumbent score is never kept forever), and never when its p95 E2E
//!   is worse than the incumbent's by more than `guard` (the paper's `w_queue = 0`
//!   reward hacking).
//! - A third, found by the simulator on long runs (docs/simulator.md): with a noisy
//!   objective "strictly better" accepts about half of the candidates that change
//!   nothing, the 1/5 rule then inflates sigma to its maximum and the weights random-walk
//!   into a bound. A candidate must now beat the re-measured incumbent by
//!   `min_improvement` (default 3% of p95 TTFT, about the window-to-window noise of a
//!   128-request p95), and sigma is capped at 1.0 (a factor e per standard deviation).
//!   This deliberately departs from the paper, which accepted candidates up to 0.5%
//!   *worse*: a neutral candidate is now a failure, so on a flat objective sigma shrinks
//!   and the weights stay put.
//! - The fixed margin is not enough when windows are small: in the simulator windows
//!   close on their time cap with ~35 requests and the p95 of two windows with the
//!   *same* weights differs by ~30% (sd of the log ratio). So the margin also adapts:
//!   every trial re-measures the incumbent, and the log ratio of two consecutive
//!   measurements of the same incumbent is window noise; its EWMA variance gives the
//!   noise sd, and a candidate must beat the incumbent by `noise_z` of those (default
//!   2.33: about 1% of neutral candidates pass); before [`MIN_NOISE_SAMPLES`] such
//!   samples were seen no candidate is accepted at all. Under heavy noise the tuner
//!   thus mostly stops moving instead of random-walking into a bound.
//!
//! - Trials are interleaved by default ([`TrialDesign::Interleaved`]): candidate and
//!   incumbent are measured in the same window, each request assigned to one of them by
//!   a hash of its id, so load drifting between windows no longer reads as a difference
//!   between weights (sequential windows of 128 requests re-measured the same incumbent
//!   at 1,023-1,437 ms live). Each arm is also split in two halves by a second bit of
//!   the hash; the log ratio of two halves with the same weights is a noise sample
//!   taken in every window, which sets the margin as above.
//! - The E2E guard holds along the whole line, not per trial: every accepted trial
//!   adds its paired log E2E ratio to `e2e_drift`, and a candidate is refused when
//!   that sum would pass `ln(1 + guard)`. A per-trial guard let a chain of candidates
//!   each a few percent worse in E2E walk `w_queue` to its floor (E2E 1.09-1.71x the
//!   best baseline in the simulator).
//!
//! The whole state is serde and deterministic under its seed (the random stream is
//! `(seed, draws)`), so it can travel in a proposal and any node can continue it.

use std::collections::VecDeque;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Cauchy, StandardNormal};
use serde::{Deserialize, Serialize};

use crate::error::CoreError;
use crate::policy::PolicyKind;
use crate::types::Weights;

/// Why an interleaved line runs no trial in a window: both arms run the incumbent, and
/// their halves measure the noise ([`EsState::trial_hold`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TrialHold {
    /// Fewer than [`MIN_NOISE_SAMPLES`] noise samples: whether a trial could be decided
    /// is not known yet, and a candidate would cost its arm's traffic for nothing.
    MeasuringNoise,
    /// At the measured noise a trial would need more than `settle_margin` of
    /// improvement ([`EsState::is_settled`]).
    Settled,
}

/// Longest switchback block, ms (an hour: longer blocks would leave a window with one
/// arm). Followers drop a proposal above it, so the config refuses it too.
pub const MAX_SWITCHBACK_BLOCK_MS: u64 = 3_600_000;

/// Longest leader lease, ms ([`TuningConfig::leader_lease_ms`]): a dead leader's line
/// waits this long at most after its last proposal before another node continues it.
pub const MAX_LEADER_LEASE_MS: u64 = 60_000;

/// Outcomes the 1/5 rule looks at.
pub const SUCCESS_WINDOW: usize = 8;
/// Rechenberg's step-size factor.
pub const SIGMA_DECAY: f64 = 0.817;
/// Target success rate of the 1/5 rule.
pub const TARGET_SUCCESS_RATE: f64 = 0.2;
/// Incumbent re-measurement pairs needed before the noise estimate sets the margin.
pub const MIN_NOISE_SAMPLES: u64 = 4;
/// EWMA weight of a new noise sample.
const NOISE_ALPHA: f64 = 0.1;

/// Start value and bounds of one tuned weight.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamBounds {
    /// Where tuning starts (and the [`Tuner`](crate::tuning::Tuner)'s weights in
    /// `static` mode; a node routes with `routing.weights` in `static` mode instead,
    /// docs/node.md).
    pub start: f64,
    /// Lower bound, > 0 (the mutation works on logarithms).
    pub min: f64,
    /// Upper bound.
    pub max: f64,
}

impl ParamBounds {
    fn clip(&self, w: f64) -> f64 {
        if w.is_nan() {
            self.start
        } else {
            w.clamp(self.min, self.max)
        }
    }

    /// `exp(ln_w)` reflected into the bounds in log space: a step past a bound comes
    /// back by as much as it overshot, so a weight at its bound still moves on every
    /// mutation (clipping would leave it there on half of them).
    fn reflect(&self, ln_w: f64) -> f64 {
        let (lo, hi) = (self.min.ln(), self.max.ln());
        let span = hi - lo;
        if !ln_w.is_finite() || span <= 0.0 {
            return self.clip(ln_w.exp());
        }
        // Fold onto [0, 2 span), then mirror the upper half.
        let x = (ln_w - lo).rem_euclid(2.0 * span);
        let x = if x > span { 2.0 * span - x } else { x };
        self.clip((lo + x).exp())
    }

    fn validate(&self, field: &str) -> Result<(), CoreError> {
        let ok = self.min.is_finite()
            && self.max.is_finite()
            && self.min > 0.0
            && self.min <= self.max
            && self.max <= crate::types::MAX_WEIGHT
            && self.start >= self.min
            && self.start <= self.max;
        if ok {
            Ok(())
        } else {
            Err(CoreError::InvalidConfig {
                field: field.into(),
                reason: format!(
                    "need 0 < min <= start <= max <= {}, got start {} in [{}, {}]",
                    crate::types::MAX_WEIGHT,
                    self.start,
                    self.min,
                    self.max
                ),
            })
        }
    }
}

/// How a node's weights evolve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TuningMode {
    /// Tune continuously.
    Online,
    /// Fixed weights: a node's `routing.weights` (or its learned-weights file), the
    /// simulator's `--weights`; the tuner itself reports its `start` values.
    Static,
    /// Tune until the step size falls below `freeze_sigma`, then keep the incumbent.
    TuneThenFreeze,
}

/// How a trial compares a candidate with the incumbent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TrialDesign {
    /// Both in one window: each request is routed with one of the two weight sets by a
    /// hash of its id, so both see the same traffic and load drift cancels.
    #[default]
    Interleaved,
    /// The incumbent re-measured in one window, the candidate in the next (the paper's
    /// design; kept to measure what interleaving buys).
    Sequential,
    /// Both in one window, in alternating blocks of time (`switchback_block_ms`):
    /// every node routes every request of a block with the same weight set, so a
    /// candidate's effect on the queues everyone shares is inside its own arm. An
    /// interleaved trial cannot see that effect: a weight set that piles work on warm
    /// engines makes the other arm's requests wait, and a queue-avoiding arm makes
    /// room that the other arm takes (docs/tuning.md, "Switchback trials").
    Switchback,
}

impl TrialDesign {
    /// Both arms are measured in the same window (interleaved or switchback), so the
    /// comparison is paired and the window's halves measure the noise.
    pub fn is_paired(self) -> bool {
        matches!(self, TrialDesign::Interleaved | TrialDesign::Switchback)
    }
}

/// The distribution of a mutation step (in log space, scaled by sigma).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mutation {
    /// Standard normal: every step local.
    #[default]
    Gaussian,
    /// Standard Cauchy (heavy tails): most steps local, one in five over three sigma,
    /// so a line that starts in a bad corner can jump out of it in one trial, where
    /// normal steps need a chain of small gains that the noise hides.
    Cauchy,
}

/// Configuration of the tuner and of the distributed trial protocol.
///
/// Also the schema of a node's `[tuning]` table (`gorgo-node`'s config deserialises
/// into it), so the serde names are the config's: `window_requests`, `window_max_ms`
/// and `e2e_guard` (the field names are accepted as aliases), and [`validate`] names
/// fields by them.
///
/// [`validate`]: TuningConfig::validate
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TuningConfig {
    /// `online`, `static` or `tune-then-freeze`.
    pub mode: TuningMode,
    /// `interleaved` (default) or `sequential`.
    pub trial: TrialDesign,
    /// `gaussian` or `cauchy` mutation steps.
    pub mutation: Mutation,
    /// Switchback: the length of one block of time routed with one arm, ms. Longer
    /// than the queues' memory (a queue a block builds still slows the next block's
    /// requests) and several per window.
    pub switchback_block_ms: u64,
    /// Interleaved: windows one trial may take before its candidate counts as not
    /// better (it is decided sooner once clearly better or clearly not).
    pub max_trial_windows: u32,
    /// Requests per trial window, cluster-wide.
    #[serde(rename = "window_requests", alias = "window")]
    pub window: usize,
    /// A window closes after this long even if not full, ms...
    #[serde(rename = "window_max_ms", alias = "time_cap_ms")]
    pub time_cap_ms: u64,
    /// ...provided it has at least this many samples (else it is extended).
    pub min_samples: usize,
    /// `w_rtt` start and bounds.
    pub w_rtt: ParamBounds,
    /// `w_queue` start and bounds.
    pub w_queue: ParamBounds,
    /// Initial mutation step size (log space). 0.5 (a factor 1.65 per standard
    /// deviation): the start fit makes the coarse move, and around good weights p95
    /// TTFT is flat within a factor of two, so wider steps mostly propose weights off
    /// that plateau (docs/tuning.md, "No acceptance on unmeasured noise").
    pub sigma0: f64,
    /// Smallest step size.
    pub sigma_min: f64,
    /// Largest step size.
    pub sigma_max: f64,
    /// Fraction of the incumbent's p95 TTFT a candidate must beat it by to be accepted
    /// (noise margin; 0 is the plain "strictly better" rule).
    pub min_improvement: f64,
    /// Noise margin in standard deviations of the measured window-to-window noise of
    /// the incumbent's p95 (0 disables the adaptive margin). 2.33, one-sided 1%: a line
    /// runs 20-110 trials in the simulator's runs and every false acceptance stays, so
    /// the error rate is set for the run, not for one trial.
    pub noise_z: f64,
    /// E2E guard: reject a candidate whose p95 E2E exceeds the incumbent's by more than
    /// this fraction.
    #[serde(rename = "e2e_guard", alias = "guard")]
    pub guard: f64,
    /// `tune-then-freeze` stops when sigma falls below this.
    pub freeze_sigma: f64,
    /// An interleaved line runs a trial only while one can be decided: once the
    /// measured noise makes the improvement a trial of `max_trial_windows` windows
    /// must show ([`EsState::required_improvement`]) larger than this fraction, the
    /// line is settled and its windows route every request with the incumbent (no
    /// candidate) until the noise falls below it again. 0.10: around the start fit the
    /// best fixed weights are within about 10% of p95 TTFT (docs/tuning.md, "A line
    /// that cannot decide settles"), so a trial that needs more can only pass by luck
    /// and costs the traffic of its candidate arm. 1.0 or more: never settle.
    pub settle_margin: f64,
    /// Seed of the mutation stream.
    pub seed: u64,
    /// A node that has heard no proposal waits this long after its first tick before
    /// starting a new line of epochs, so a joining node adopts the running one instead.
    pub startup_grace_ms: u64,
    /// A leader this node heard from itself (a proposal it sent) within this long keeps
    /// its line, even where this node's membership view calls it dead: membership can
    /// be asymmetric (one node's probes fail while the leader's messages still arrive),
    /// and a node that took such a line over would be taken over back at the leader's
    /// next tick, one epoch a tick, with no window ever closing. Shorter than the time
    /// membership takes to call a dead node down (3.2 s by default, gorgo-cluster's
    /// `SwimTimings`), so a real failover waits no longer.
    pub leader_lease_ms: u64,
    /// Fit the start: at the end of a line's first window, move each weight the
    /// measurements pin down to what makes the cost's TTFT terms predict measured TTFT
    /// ([`crate::tuning::TermSums::fit`]), before any trial (docs/tuning.md, "The
    /// start fit").
    pub fit_start: bool,
}

impl Default for TuningConfig {
    fn default() -> Self {
        TuningConfig::gorgo()
    }
}

impl TuningConfig {
    /// docs/design.md defaults for the millisecond model: both weights start at 1.0 in
    /// [0.05, 4.0].
    pub fn gorgo() -> Self {
        TuningConfig {
            mode: TuningMode::Online,
            trial: TrialDesign::Interleaved,
            switchback_block_ms: 10_000,
            mutation: Mutation::Gaussian,
            max_trial_windows: 2,
            window: 128,
            time_cap_ms: 60_000,
            min_samples: 32,
            w_rtt: ParamBounds {
                start: 1.0,
                min: 0.05,
                max: 4.0,
            },
            w_queue: ParamBounds {
                start: 1.0,
                min: 0.05,
                max: 4.0,
            },
            sigma0: 0.5,
            sigma_min: 0.01,
            sigma_max: 1.0,
            min_improvement: 0.03,
            noise_z: 2.33,
            guard: 0.05,
            freeze_sigma: 0.05,
            settle_margin: 0.10,
            seed: 0x676f_7267_6f65_7321,
            startup_grace_ms: 1000,
            leader_lease_ms: 2000,
            fit_start: true,
        }
    }

    /// The paper's setup for `gorgo-paper`: `w_rtt` 0.5 in [0.05, 2.0], `w_queue` 0.1
    /// in [0.05, 0.5], sigma 0.5. No start fit: the paper's score weighs queued tokens,
    /// not milliseconds, so a fit of its terms to measured TTFT has no unit in common
    /// with its weights.
    pub fn gorgo_paper() -> Self {
        TuningConfig {
            fit_start: false,
            w_rtt: ParamBounds {
                start: 0.5,
                min: 0.05,
                max: 2.0,
            },
            w_queue: ParamBounds {
                start: 0.1,
                min: 0.05,
                max: 0.5,
            },
            ..TuningConfig::gorgo()
        }
    }

    /// The defaults for tuning `kind`'s weights.
    pub fn for_policy(kind: PolicyKind) -> Self {
        match kind {
            PolicyKind::GorgoPaper => TuningConfig::gorgo_paper(),
            _ => TuningConfig::gorgo(),
        }
    }

    /// The weights tuning starts from (and stays at in `static` mode).
    pub fn start_weights(&self) -> Weights {
        Weights {
            w_rtt: self.w_rtt.start,
            w_queue: self.w_queue.start,
        }
    }

    /// `w` clipped to the bounds.
    pub fn clip(&self, w: Weights) -> Weights {
        Weights {
            w_rtt: self.w_rtt.clip(w.w_rtt),
            w_queue: self.w_queue.clip(w.w_queue),
        }
    }

    /// Check every field, naming the one that is wrong.
    pub fn validate(&self) -> Result<(), CoreError> {
        let bad = |field: &str, reason: &str| {
            Err(CoreError::InvalidConfig {
                field: field.into(),
                reason: reason.into(),
            })
        };
        self.w_rtt.validate("w_rtt")?;
        self.w_queue.validate("w_queue")?;
        if self.window == 0 {
            return bad("window_requests", "must be at least 1");
        }
        // A paired trial splits each window between its two arms: a window of one
        // request has one arm only, and no trial is ever decided.
        if self.window < 2 && self.trial.is_paired() {
            return bad(
                "window_requests",
                "must be at least 2 with an interleaved or switchback trial (each window holds both arms)",
            );
        }
        if self.max_trial_windows == 0 {
            return bad("max_trial_windows", "must be at least 1");
        }
        if self.min_samples == 0 || self.min_samples > self.window {
            return bad("min_samples", "must be in [1, window_requests]");
        }
        // Followers ignore a proposal with longer blocks (`Proposal::is_plausible`):
        // a line configured beyond it would never be followed.
        if !(1..=MAX_SWITCHBACK_BLOCK_MS).contains(&self.switchback_block_ms) {
            return bad(
                "switchback_block_ms",
                "must be in 1..=3600000 (at most an hour)",
            );
        }
        if self.time_cap_ms == 0 {
            return bad("window_max_ms", "must be positive");
        }
        if self.leader_lease_ms > MAX_LEADER_LEASE_MS {
            return bad("leader_lease_ms", "must be at most 60000 (a minute)");
        }
        // A switchback window must be able to span four blocks (each arm in both
        // halves); one closed by its time cap sooner had unbalanced arms, or one arm
        // with no requests at all.
        if self.trial == TrialDesign::Switchback
            && self.time_cap_ms < self.switchback_block_ms.saturating_mul(4)
        {
            return bad(
                "window_max_ms",
                "must be at least 4 x switchback_block_ms with trial = \"switchback\"",
            );
        }
        if !(self.sigma_min.is_finite() && self.sigma_min > 0.0) {
            return bad("sigma_min", "must be positive");
        }
        if !(self.sigma_max.is_finite() && self.sigma_max >= self.sigma_min) {
            return bad("sigma_max", "must be at least sigma_min");
        }
        if !(self.sigma0 >= self.sigma_min && self.sigma0 <= self.sigma_max) {
            return bad("sigma0", "must be in [sigma_min, sigma_max]");
        }
        if !(self.min_improvement >= 0.0 && self.min_improvement < 1.0) {
            return bad("min_improvement", "must be a fraction in [0, 1)");
        }
        if !(self.noise_z.is_finite() && self.noise_z >= 0.0) {
            return bad("noise_z", "must be non-negative");
        }
        if !(self.guard.is_finite() && self.guard >= 0.0) {
            return bad("e2e_guard", "must be a non-negative fraction");
        }
        if !(self.freeze_sigma.is_finite() && self.freeze_sigma >= 0.0) {
            return bad("freeze_sigma", "must be non-negative");
        }
        if !(self.settle_margin.is_finite() && self.settle_margin > 0.0) {
            return bad(
                "settle_margin",
                "must be a positive fraction (1.0: never settle)",
            );
        }
        Ok(())
    }
}

/// What one trial window measured (merged over the cluster).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Measurement {
    /// p95 TTFT, ms: the score (lower is better).
    pub p95_ttft_ms: f64,
    /// p95 E2E, ms: the guard.
    pub p95_e2e_ms: f64,
    /// Requests measured.
    pub samples: u64,
    /// Mean TTFT of the slowest 20% ([`TAIL_QUANTILE`]), ms: what trials compare
    /// when present (`None`: they compare `p95_ttft_ms`).
    #[serde(default)]
    pub tail_ttft_ms: Option<f64>,
}

/// Trials compare the mean TTFT above this quantile, not the p95 itself. The p95 of a
/// 64-request arm rests on its three or four slowest requests; the mean of the slowest
/// 20% rests on thirteen. Measured in the simulator on five workloads, its
/// window-to-window noise is 10-35% lower (docs/tuning.md, "Noise"), and it orders
/// fixed weights as p95 does.
pub const TAIL_QUANTILE: f64 = 0.8;

impl Measurement {
    fn is_valid(&self) -> bool {
        self.samples > 0
            && self.p95_ttft_ms.is_finite()
            && self.p95_e2e_ms.is_finite()
            && self.p95_ttft_ms >= 0.0
            && self.p95_e2e_ms >= 0.0
            && self.score() > 0.0
    }

    /// What a trial compares: the tail mean when measured, else p95 TTFT.
    pub fn score(&self) -> f64 {
        self.tail_ttft_ms
            .filter(|t| t.is_finite())
            .unwrap_or(self.p95_ttft_ms)
    }
}

/// The evidence on the candidate of an interleaved trial so far: a trial spans up to
/// `max_trial_windows` windows, until the candidate is clearly better or not.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrialEvidence {
    /// Windows seen (valid or not).
    pub windows: u32,
    /// Windows with both arms measured.
    pub valid: u32,
    /// Sum over valid windows of `ln(candidate score / incumbent score)`.
    pub sum_log_score: f64,
    /// Sum of `ln(candidate p95 E2E / incumbent p95 E2E)`.
    pub sum_log_e2e: f64,
    /// Sums of the logs of the candidate's and the incumbent's p95 TTFT, p95 E2E and
    /// score (their geometric means go in the trial's record).
    pub sum_ln: [f64; 6],
    /// Requests measured on the candidate's arm.
    pub cand_samples: u64,
    /// Requests measured on the incumbent's arm.
    pub inc_samples: u64,
}

impl TrialEvidence {
    /// Every sum finite (a proposal from the network may carry anything).
    pub fn is_finite(&self) -> bool {
        self.sum_log_score.is_finite()
            && self.sum_log_e2e.is_finite()
            && self.sum_ln.iter().all(|v| v.is_finite())
    }
}

/// Why a candidate was accepted or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    /// p95 TTFT better by at least `min_improvement`, E2E within the guard.
    Accepted,
    /// p95 TTFT not better than the re-measured incumbent by `min_improvement`.
    NotBetter,
    /// Better TTFT, but p95 E2E worse than the incumbent's by more than the guard.
    E2eGuard,
    /// A measurement was empty or not finite; no outcome recorded.
    InvalidMeasurement,
    /// Not a trial: the line's start fit moved the incumbent to the fitted weights
    /// (the record's `candidate`).
    StartFit,
}

/// Bound on `|e2e_drift|` a line's state may carry (a factor e in p95 E2E).
pub const MAX_E2E_DRIFT: f64 = 1.0;

/// Bound on the trial noise variance a line's state may carry (a standard deviation of
/// 1 in the log ratio: a factor e between two windows of the same weights).
pub const MAX_NOISE_VAR: f64 = 1.0;

/// The whole tuner state: it travels with every proposal.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EsState {
    /// Best weights so far.
    pub incumbent: Weights,
    /// The incumbent's last score, ms: the mean TTFT beyond the [`TAIL_QUANTILE`]
    /// quantile (its slowest 20%), as the trials compare it; a sequential line's
    /// re-measurement stores its p95.
    pub incumbent_score: Option<f64>,
    /// The incumbent's measurement in the window adjacent to the pending candidate.
    pub pending_incumbent: Option<Measurement>,
    /// Mutation step size (log space).
    pub sigma: f64,
    /// Last outcomes (true = accepted), at most [`SUCCESS_WINDOW`].
    pub outcomes: VecDeque<bool>,
    /// Last epoch decided with this state (0 before any).
    pub epoch: u64,
    /// Candidates decided.
    pub trials: u64,
    /// Seed of the mutation stream.
    pub seed: u64,
    /// Mutations drawn so far (the stream position).
    pub draws: u64,
    /// True once `tune-then-freeze` has frozen.
    pub frozen: bool,
    /// The incumbent's p95 TTFT as last measured (its own window, or the candidate
    /// window that made it incumbent), to pair with its next re-measurement.
    #[serde(default)]
    pub last_incumbent_p95_ms: Option<f64>,
    /// EWMA of the squared log ratio of consecutive measurements of the same incumbent.
    #[serde(default)]
    pub noise_var: f64,
    /// Pairs behind `noise_var`.
    #[serde(default)]
    pub noise_samples: u64,
    /// The pending interleaved trial's evidence (`None` between trials).
    #[serde(default)]
    pub pending_trial: Option<Box<TrialEvidence>>,
    /// Sum of `ln(candidate p95 E2E / incumbent p95 E2E)` over the accepted trials: how
    /// much the line's E2E has moved from the start weights, each step measured paired.
    #[serde(default)]
    pub e2e_drift: f64,
    /// The line's start fit has been made (or there was nothing to fit): it is made
    /// once per line, whoever leads.
    #[serde(default)]
    pub start_fitted: bool,
}

impl EsState {
    /// Hold the state to what an honest line can reach, whoever computed it (a proposal
    /// from the network, or this leader's own window): evidence and drift that are
    /// not finite would poison every later decision; finite but extreme drift or
    /// noise would switch the E2E guard off, or settle the line for good; a step size
    /// outside the bounds would mutate by nothing (or by anything), and a tiny one
    /// would freeze a `tune-then-freeze` line at once.
    pub fn bound(&mut self, cfg: &TuningConfig) {
        if self.pending_trial.as_ref().is_some_and(|t| !t.is_finite()) {
            self.pending_trial = None;
        }
        if !self.e2e_drift.is_finite() {
            self.e2e_drift = 0.0;
        }
        self.e2e_drift = self.e2e_drift.clamp(-MAX_E2E_DRIFT, MAX_E2E_DRIFT);
        if !(self.noise_var.is_finite() && self.noise_var >= 0.0) {
            self.noise_var = 0.0;
            self.noise_samples = 0;
        }
        self.noise_var = self.noise_var.min(MAX_NOISE_VAR);
        // Scores are p95s in ms: an infinite one would put an infinite noise
        // observation into the next sequential decision.
        let score = |s: Option<f64>| s.filter(|p| p.is_finite() && *p > 0.0);
        self.incumbent_score = score(self.incumbent_score);
        self.last_incumbent_p95_ms = score(self.last_incumbent_p95_ms);
        self.incumbent = cfg.clip(self.incumbent);
        if !(self.sigma.is_finite() && self.sigma > 0.0) {
            self.sigma = cfg.sigma0;
        }
        self.sigma = self.sigma.clamp(cfg.sigma_min, cfg.sigma_max);
    }

    /// A fresh tuner at the configured start.
    pub fn new(cfg: &TuningConfig) -> Self {
        EsState {
            incumbent: cfg.start_weights(),
            incumbent_score: None,
            pending_incumbent: None,
            sigma: cfg.sigma0,
            outcomes: VecDeque::with_capacity(SUCCESS_WINDOW),
            epoch: 0,
            trials: 0,
            seed: cfg.seed,
            draws: 0,
            frozen: false,
            last_incumbent_p95_ms: None,
            noise_var: 0.0,
            noise_samples: 0,
            e2e_drift: 0.0,
            pending_trial: None,
            start_fitted: false,
        }
    }

    /// One noise sample: `var`, the variance of a candidate-against-incumbent log
    /// ratio of p95 TTFT that a comparison of equal weights would show.
    fn observe_noise(&mut self, var: f64) {
        if !var.is_finite() {
            return;
        }
        // A plain mean until there are 1 / NOISE_ALPHA samples, an EWMA after: an EWMA
        // seeded with its first sample weighs that one sample 73% after four, and the
        // first trials were judged on it (docs/tuning.md, "No acceptance on unmeasured
        // noise").
        self.noise_samples += 1;
        let gain = (1.0 / self.noise_samples as f64).max(NOISE_ALPHA);
        self.noise_var += gain * (var - self.noise_var);
    }

    /// The scores of the two halves of one arm of an interleaved window (the same
    /// weights, half the requests each). A whole-arm comparison has half the variance
    /// of a half-against-half one: `var = ln(a / b)^2 / 2`.
    pub fn observe_halves(&mut self, half_a_ms: f64, half_b_ms: f64) {
        if half_a_ms > 0.0 && half_b_ms > 0.0 {
            let d = (half_a_ms / half_b_ms).ln();
            self.observe_noise(d * d / 2.0);
        }
    }

    /// One window of an interleaved trial of `candidate` (`cand` and `incumbent` are
    /// its two arms). `Some` once the trial is decided: the verdict and the two arms'
    /// measurements over the trial's windows (geometric means, summed samples); `None`
    /// to measure `candidate` for another window.
    ///
    /// Decided as soon as the mean log ratio of the scores is below
    /// `ln(1 - min_improvement)` by `noise_z` standard errors (better: accepted unless
    /// the E2E guard refuses), or above it by as many (clearly not better), or after
    /// `max_trial_windows` windows (not better).
    pub fn observe_window(
        &mut self,
        cfg: &TuningConfig,
        candidate: Weights,
        cand: Measurement,
        incumbent: Measurement,
    ) -> Option<(Verdict, Measurement, Measurement)> {
        let ev = self.pending_trial.get_or_insert_with(Box::default);
        ev.windows += 1;
        if cand.is_valid() && incumbent.is_valid() {
            ev.valid += 1;
            ev.sum_log_score += (cand.score() / incumbent.score()).ln();
            let e2e = |m: &Measurement| m.p95_e2e_ms.max(1e-3);
            ev.sum_log_e2e += (e2e(&cand) / e2e(&incumbent)).ln();
            let lns = [
                cand.p95_ttft_ms,
                incumbent.p95_ttft_ms,
                cand.p95_e2e_ms,
                incumbent.p95_e2e_ms,
                cand.score(),
                incumbent.score(),
            ];
            for (acc, v) in ev.sum_ln.iter_mut().zip(lns) {
                *acc += v.max(1e-3).ln();
            }
            // Saturating: the counts come from peers' reports.
            ev.cand_samples = ev.cand_samples.saturating_add(cand.samples);
            ev.inc_samples = ev.inc_samples.saturating_add(incumbent.samples);
        }
        let ev = (**ev).clone();
        let last = ev.windows >= cfg.max_trial_windows;
        if ev.valid == 0 {
            if last {
                self.pending_trial = None;
                return Some((Verdict::InvalidMeasurement, cand, incumbent));
            }
            return None;
        }
        let k = f64::from(ev.valid);
        let mean = ev.sum_log_score / k;
        let noise_known = self.noise_known(cfg);
        let z_se = match self.noise_sd() {
            Some(sd) if noise_known => cfg.noise_z * sd / k.sqrt(),
            _ => 0.0,
        };
        let threshold = (1.0 - cfg.min_improvement).ln();
        // No acceptance on unmeasured noise: one lucky window at the start of a line
        // otherwise moved the incumbent for the rest of the run (15 of 50 first trials
        // were accepted in the simulator, against about 5% later ones).
        let better = noise_known && mean + z_se < threshold;
        let clearly_not = z_se > 0.0 && mean - z_se > threshold;
        if !(better || clearly_not || last) {
            return None;
        }
        self.pending_trial = None;
        let g = |i: usize| (ev.sum_ln[i] / k).exp();
        let cand_m = Measurement {
            p95_ttft_ms: g(0),
            p95_e2e_ms: g(2),
            samples: ev.cand_samples,
            tail_ttft_ms: Some(g(4)),
        };
        let inc_m = Measurement {
            p95_ttft_ms: g(1),
            p95_e2e_ms: g(3),
            samples: ev.inc_samples,
            tail_ttft_ms: Some(g(5)),
        };
        let verdict = self.judge(
            cfg,
            candidate,
            better,
            ev.sum_log_e2e / k,
            cand_m.score(),
            inc_m.score(),
        );
        Some((verdict, cand_m, inc_m))
    }

    /// Draw the next candidate: `exp(ln w + sigma * z)` per weight (`z` standard
    /// normal or Cauchy), reflected into the bounds.
    pub fn mutate(&mut self, cfg: &TuningConfig) -> Weights {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        rng.set_stream(self.draws);
        self.draws += 1;
        let (z_rtt, z_queue): (f64, f64) = match cfg.mutation {
            Mutation::Gaussian => (rng.sample(StandardNormal), rng.sample(StandardNormal)),
            Mutation::Cauchy => Cauchy::new(0.0, 1.0)
                .map_or((0.0, 0.0), |c: Cauchy<f64>| (rng.sample(c), rng.sample(c))),
        };
        let inc = cfg.clip(self.incumbent);
        Weights {
            w_rtt: cfg.w_rtt.reflect(inc.w_rtt.ln() + self.sigma * z_rtt),
            w_queue: cfg.w_queue.reflect(inc.w_queue.ln() + self.sigma * z_queue),
        }
    }

    /// Decide `candidate` from its window and the incumbent's adjacent window, update
    /// the incumbent and the step size.
    pub fn conclude(
        &mut self,
        cfg: &TuningConfig,
        candidate: Weights,
        cand: Measurement,
        incumbent: Measurement,
    ) -> Verdict {
        if !cand.is_valid() || !incumbent.is_valid() {
            return Verdict::InvalidMeasurement;
        }
        if cfg.trial == TrialDesign::Sequential {
            // Two consecutive windows of the incumbent: the noise a sequential
            // comparison has (load drift included).
            if let Some(prev) = self.last_incumbent_p95_ms.filter(|p| *p > 0.0) {
                let d = (incumbent.score() / prev).ln();
                self.observe_noise(d * d);
            }
        }
        let margin = self.margin(cfg);
        // Against the incumbent measured in the same window (interleaved) or the
        // adjacent one (sequential).
        let e2e_step = if incumbent.p95_e2e_ms > 0.0 && cand.p95_e2e_ms > 0.0 {
            (cand.p95_e2e_ms / incumbent.p95_e2e_ms).ln()
        } else {
            0.0
        };
        let better = self.noise_known(cfg) && cand.score() < incumbent.score() * (1.0 - margin);
        self.judge(
            cfg,
            candidate,
            better,
            e2e_step,
            cand.score(),
            incumbent.score(),
        )
    }

    /// The verdict on `candidate` given whether its score is better by the margin and
    /// its log E2E step; updates the incumbent, the E2E drift, the outcomes and the
    /// step size.
    fn judge(
        &mut self,
        cfg: &TuningConfig,
        candidate: Weights,
        better: bool,
        e2e_step: f64,
        cand_score: f64,
        inc_score: f64,
    ) -> Verdict {
        let budget = (1.0 + cfg.guard).ln();
        let verdict = if !better {
            Verdict::NotBetter
        } else if e2e_step > budget || self.e2e_drift + e2e_step > budget {
            Verdict::E2eGuard
        } else {
            Verdict::Accepted
        };
        let accepted = verdict == Verdict::Accepted;
        if accepted {
            self.incumbent = cfg.clip(candidate);
            self.incumbent_score = Some(cand_score);
            self.e2e_drift += e2e_step;
        } else {
            self.incumbent_score = Some(inc_score);
        }
        self.last_incumbent_p95_ms = self.incumbent_score;
        self.trials += 1;
        if self.outcomes.len() == SUCCESS_WINDOW {
            self.outcomes.pop_front();
        }
        self.outcomes.push_back(accepted);
        // Once per SUCCESS_WINDOW trials, not after every trial: with a sliding window
        // two lucky successes kept sigma growing for eight trials in a row (x5 in all),
        // the inflation the simulator saw.
        if self.outcomes.len() == SUCCESS_WINDOW
            && self.trials.is_multiple_of(SUCCESS_WINDOW as u64)
        {
            let rate = self.success_rate().unwrap_or(TARGET_SUCCESS_RATE);
            // Successes judged before the noise was known may be luck: no growth until
            // the whole outcome window was judged with the noise margin.
            let all_judged_with_noise = cfg.noise_z == 0.0
                || self.noise_samples >= MIN_NOISE_SAMPLES + SUCCESS_WINDOW as u64;
            if rate > TARGET_SUCCESS_RATE && all_judged_with_noise {
                self.sigma /= SIGMA_DECAY;
            } else if rate < TARGET_SUCCESS_RATE {
                self.sigma *= SIGMA_DECAY;
            }
            self.sigma = self.sigma.clamp(cfg.sigma_min, cfg.sigma_max);
        }
        if self.should_freeze(cfg) {
            self.frozen = true;
        }
        verdict
    }

    /// True when a `tune-then-freeze` line should stop now: its step size fell below
    /// `freeze_sigma`, or no trial could be decided any more (settled), and the start
    /// fit is done. Not before the fit: it goes on for up to its windows whatever the
    /// trials do, and freezing first would write the unfitted start as learned.
    pub fn should_freeze(&self, cfg: &TuningConfig) -> bool {
        cfg.mode == TuningMode::TuneThenFreeze
            && (self.start_fitted || !cfg.fit_start)
            && (self.sigma < cfg.freeze_sigma || self.is_settled(cfg))
    }

    /// Fraction of the incumbent's p95 a candidate must beat it by now: the larger of
    /// `min_improvement` and `noise_z` noise standard deviations (once measured).
    pub fn margin(&self, cfg: &TuningConfig) -> f64 {
        let fixed = cfg.min_improvement;
        if cfg.noise_z == 0.0 || !self.noise_known(cfg) {
            return fixed;
        }
        // Log-space threshold back to a fraction: p95_c < p95_i * exp(-z * sd).
        let adaptive = 1.0 - (-cfg.noise_z * self.noise_var.max(0.0).sqrt()).exp();
        fixed.max(adaptive)
    }

    /// Enough noise samples to judge a candidate on ([`MIN_NOISE_SAMPLES`]), or the
    /// adaptive margin is off (`noise_z` 0). Before that no candidate is accepted.
    pub fn noise_known(&self, cfg: &TuningConfig) -> bool {
        cfg.noise_z == 0.0 || self.noise_samples >= MIN_NOISE_SAMPLES
    }

    /// The improvement of the candidate's score over the incumbent's, as a fraction,
    /// that an interleaved trial of `max_trial_windows` windows needs to be accepted at
    /// the measured noise: `1 - exp(ln(1 - min_improvement) - noise_z sd / sqrt(k))`.
    /// `None` while the noise is not known (or the adaptive margin is off).
    pub fn required_improvement(&self, cfg: &TuningConfig) -> Option<f64> {
        if cfg.noise_z == 0.0 || !self.noise_known(cfg) {
            return None;
        }
        let sd = self.noise_sd()?;
        let k = f64::from(cfg.max_trial_windows.max(1));
        let threshold = (1.0 - cfg.min_improvement).ln() - cfg.noise_z * sd / k.sqrt();
        Some(1.0 - threshold.exp())
    }

    /// Why an interleaved line runs no trial now, or `None` when it runs one (and for a
    /// sequential line, which always does): the noise is not measured yet, or the line
    /// has settled. The tuner's proposals and `/admin/tuning` both read it here.
    pub fn trial_hold(&self, cfg: &TuningConfig) -> Option<TrialHold> {
        if !cfg.trial.is_paired() {
            None
        } else if !self.noise_known(cfg) {
            Some(TrialHold::MeasuringNoise)
        } else if self.is_settled(cfg) {
            Some(TrialHold::Settled)
        } else {
            None
        }
    }

    /// True when an interleaved line should run no trial now: the improvement a trial
    /// would have to show is above `settle_margin` (see there for why).
    pub fn is_settled(&self, cfg: &TuningConfig) -> bool {
        cfg.trial.is_paired()
            && self
                .required_improvement(cfg)
                .is_some_and(|r| r > cfg.settle_margin)
    }

    /// The measured noise: standard deviation of the log ratio of p95 TTFT between
    /// two measurements of equal weights as the trial design compares them (`None`
    /// before any sample).
    pub fn noise_sd(&self) -> Option<f64> {
        (self.noise_samples > 0).then(|| self.noise_var.max(0.0).sqrt())
    }

    /// Share of accepted outcomes in the window, `None` before any.
    pub fn success_rate(&self) -> Option<f64> {
        if self.outcomes.is_empty() {
            None
        } else {
            Some(self.outcomes.iter().filter(|&&o| o).count() as f64 / self.outcomes.len() as f64)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(ttft: f64, e2e: f64) -> Measurement {
        Measurement {
            p95_ttft_ms: ttft,
            p95_e2e_ms: e2e,
            samples: 128,
            tail_ttft_ms: None,
        }
    }

    /// A trial's sample counts come from peers' reports, which can claim any count:
    /// summed over windows they saturate, never overflow (a debug build panicked).
    #[test]
    fn a_trials_sample_counts_saturate() {
        let cfg = TuningConfig::gorgo();
        let mut s = EsState::new(&cfg);
        let cand = Weights {
            w_rtt: 1.5,
            w_queue: 1.0,
        };
        let huge = Measurement {
            samples: u64::MAX,
            ..m(100.0, 1000.0)
        };
        // Nothing measured of the noise yet: the same evidence is never decided early.
        let decided =
            (0..cfg.max_trial_windows).find_map(|_| s.observe_window(&cfg, cand, huge, huge));
        let (_, c, i) = decided.expect("decided by the last window");
        assert_eq!((c.samples, i.samples), (u64::MAX, u64::MAX));
    }

    #[test]
    fn mutation_is_deterministic_log_space_and_clipped() {
        let cfg = TuningConfig::gorgo_paper();
        let mut a = EsState::new(&cfg);
        let mut b = a.clone();
        for _ in 0..200 {
            let wa = a.mutate(&cfg);
            assert_eq!(wa, b.mutate(&cfg));
            assert!((0.05..=2.0).contains(&wa.w_rtt) && (0.05..=0.5).contains(&wa.w_queue));
        }
        // Serde round trip keeps the stream position.
        let json = serde_json::to_string(&a).unwrap();
        let mut c: EsState = serde_json::from_str(&json).unwrap();
        assert_eq!(c.mutate(&cfg), a.mutate(&cfg));
    }

    #[test]
    fn a_weight_at_its_bound_is_reflected_not_stuck() {
        let cfg = TuningConfig::gorgo();
        let mut s = EsState::new(&cfg);
        s.incumbent = Weights {
            w_rtt: 2.0,
            w_queue: cfg.w_queue.min,
        };
        for _ in 0..200 {
            let c = s.mutate(&cfg);
            assert!(c.w_queue > cfg.w_queue.min, "{c:?}");
            assert!(c.w_queue <= cfg.w_queue.max && c.w_rtt <= cfg.w_rtt.max);
            assert!(c.w_rtt >= cfg.w_rtt.min);
        }
        let b = cfg.w_queue;
        // Past the top by ln 2: back by ln 2; a huge step folds but stays inside.
        assert!((b.reflect(b.max.ln() + 2f64.ln()) - b.max / 2.0).abs() < 1e-9);
        assert!((b.reflect(b.min.ln() - 2f64.ln()) - b.min * 2.0).abs() < 1e-9);
        let far = b.reflect(1e6);
        assert!(far >= b.min && far <= b.max);
        assert_eq!(b.reflect(f64::NAN), b.start);
    }

    #[test]
    fn the_improvement_a_trial_needs_follows_the_noise() {
        let cfg = TuningConfig::gorgo();
        let mut s = EsState::new(&cfg);
        assert_eq!(s.required_improvement(&cfg), None, "noise not measured yet");
        assert!(!s.is_settled(&cfg));
        s.noise_samples = MIN_NOISE_SAMPLES;
        // sd 0.1 (a 128-request window in the simulator, docs/tuning.md): a two-window
        // trial at z 2.33 needs 1 - 0.97 exp(-2.33 x 0.1 / sqrt 2) = 17.7%.
        s.noise_var = 0.01;
        let need = s.required_improvement(&cfg).unwrap();
        assert!((need - (1.0 - 0.97 * (-0.233 / 2f64.sqrt()).exp())).abs() < 1e-12);
        assert!(s.is_settled(&cfg));
        // sd 0.02: 5.2%, decidable.
        s.noise_var = 0.0004;
        assert!(!s.is_settled(&cfg));
        // Never with the margin off or the settling off.
        s.noise_var = 0.01;
        let off = TuningConfig {
            noise_z: 0.0,
            ..cfg
        };
        assert!(!s.is_settled(&off));
        let never = TuningConfig {
            settle_margin: 1.0,
            ..cfg
        };
        assert!(!s.is_settled(&never));
        let bad = TuningConfig {
            settle_margin: 0.0,
            ..cfg
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("settle_margin"));
    }

    #[test]
    fn no_acceptance_on_unmeasured_noise() {
        let cand = Weights {
            w_rtt: 2.0,
            w_queue: 0.5,
        };
        for trial in [TrialDesign::Interleaved, TrialDesign::Sequential] {
            let cfg = TuningConfig {
                trial,
                ..TuningConfig::gorgo()
            };
            let mut s = EsState::new(&cfg);
            // Half the incumbent's TTFT, but nothing says yet how noisy a window is.
            assert_eq!(
                s.conclude(&cfg, cand, m(50.0, 1000.0), m(100.0, 1000.0)),
                Verdict::NotBetter,
                "{trial:?}"
            );
            let decided = (0..cfg.max_trial_windows)
                .find_map(|_| s.observe_window(&cfg, cand, m(50.0, 1000.0), m(100.0, 1000.0)));
            assert_eq!(decided.map(|d| d.0), Some(Verdict::NotBetter), "{trial:?}");
            assert_eq!(s.incumbent, cfg.start_weights());
            // Once measured (here: none), the same evidence is accepted.
            for _ in 0..MIN_NOISE_SAMPLES {
                s.observe_halves(100.0, 100.0);
            }
            let decided = s.observe_window(&cfg, cand, m(50.0, 1000.0), m(100.0, 1000.0));
            assert_eq!(decided.map(|d| d.0), Some(Verdict::Accepted), "{trial:?}");
            assert_eq!(s.incumbent, cand);
        }
        // With the margin disabled there is nothing to wait for.
        let cfg = TuningConfig {
            noise_z: 0.0,
            ..TuningConfig::gorgo()
        };
        let mut s = EsState::new(&cfg);
        assert_eq!(
            s.conclude(&cfg, cand, m(50.0, 1000.0), m(100.0, 1000.0)),
            Verdict::Accepted
        );
    }

    #[test]
    fn the_noise_estimate_starts_as_a_plain_mean() {
        let mut s = EsState::new(&TuningConfig::gorgo());
        // Four samples of variance 1, 0, 0, 0 (d^2 / 2 of the halves' log ratio).
        s.observe_halves(2f64.sqrt().exp(), 1.0);
        for _ in 0..3 {
            s.observe_halves(1.0, 1.0);
        }
        assert!((s.noise_var - 0.25).abs() < 1e-9, "{}", s.noise_var);
        // Past 1 / NOISE_ALPHA samples it is an EWMA of gain NOISE_ALPHA.
        for _ in 4..20 {
            s.observe_halves(1.0, 1.0);
        }
        let before = s.noise_var;
        s.observe_halves(2f64.sqrt().exp(), 1.0);
        assert!((s.noise_var - (before + NOISE_ALPHA * (1.0 - before))).abs() < 1e-9);
    }

    #[test]
    fn strict_acceptance_and_e2e_guard() {
        let cfg = TuningConfig::gorgo();
        let mut s = EsState::new(&cfg);
        // Noise measured, and none: the fixed margin alone decides.
        for _ in 0..MIN_NOISE_SAMPLES {
            s.observe_halves(100.0, 100.0);
        }
        let cand = Weights {
            w_rtt: 2.0,
            w_queue: 0.5,
        };
        assert_eq!(
            s.conclude(&cfg, cand, m(100.0, 1000.0), m(100.0, 1000.0)),
            Verdict::NotBetter
        );
        assert_eq!(s.incumbent, cfg.start_weights());
        assert_eq!(
            s.conclude(&cfg, cand, m(90.0, 1060.0), m(100.0, 1000.0)),
            Verdict::E2eGuard
        );
        assert_eq!(s.incumbent, cfg.start_weights());
        assert_eq!(
            s.conclude(&cfg, cand, m(90.0, 1049.0), m(100.0, 1000.0)),
            Verdict::Accepted
        );
        assert_eq!(s.incumbent, cand);
        assert_eq!(s.incumbent_score, Some(90.0));
        assert_eq!(
            s.conclude(&cfg, cand, m(f64::NAN, 1.0), m(100.0, 1000.0)),
            Verdict::InvalidMeasurement
        );
        assert_eq!(s.trials, 3);
    }

    #[test]
    fn one_fifth_rule() {
        // Sequential: the incumbent windows measure the noise the growth waits for.
        let cfg = TuningConfig {
            mode: TuningMode::TuneThenFreeze,
            trial: TrialDesign::Sequential,
            fit_start: false,
            ..TuningConfig::gorgo()
        };
        let mut s = EsState::new(&cfg);
        let w = cfg.start_weights();
        for _ in 0..7 {
            s.conclude(&cfg, w, m(200.0, 1.0), m(100.0, 1.0));
        }
        assert_eq!(s.sigma, cfg.sigma0, "no adaptation before 8 outcomes");
        s.conclude(&cfg, w, m(200.0, 1.0), m(100.0, 1.0));
        assert!((s.sigma - cfg.sigma0 * SIGMA_DECAY).abs() < 1e-12);
        for _ in 0..8 {
            s.conclude(&cfg, w, m(50.0, 1.0), m(100.0, 1.0));
        }
        assert!(s.sigma > cfg.sigma0 * SIGMA_DECAY);
        for _ in 0..200 {
            s.conclude(&cfg, w, m(200.0, 1.0), m(100.0, 1.0));
        }
        assert_eq!(s.sigma, cfg.sigma_min);
        assert!(s.frozen);
    }

    /// A step size below `freeze_sigma` freezes a `tune-then-freeze` line only once
    /// its start fit is done: freezing first would write the unfitted start.
    #[test]
    fn a_line_freezes_only_once_its_start_fit_is_done() {
        let cfg = TuningConfig {
            mode: TuningMode::TuneThenFreeze,
            trial: TrialDesign::Sequential,
            sigma0: 0.04,
            ..TuningConfig::gorgo()
        };
        let mut s = EsState::new(&cfg);
        let w = cfg.start_weights();
        s.conclude(&cfg, w, m(200.0, 1.0), m(100.0, 1.0));
        assert!(!s.frozen, "frozen before the start fit");
        s.start_fitted = true;
        s.conclude(&cfg, w, m(200.0, 1.0), m(100.0, 1.0));
        assert!(s.frozen);
    }

    #[test]
    fn config_errors_name_the_field() {
        let mut cfg = TuningConfig::gorgo();
        cfg.w_queue.min = 0.0;
        match cfg.validate() {
            Err(CoreError::InvalidConfig { field, .. }) => assert_eq!(field, "w_queue"),
            other => panic!("{other:?}"),
        }
        let bad: Result<TuningConfig, _> = serde_json::from_str(r#"{"windw": 3}"#);
        assert!(bad.unwrap_err().to_string().contains("windw"));
        let ok: TuningConfig =
            serde_json::from_str(r#"{"window": 64, "mode": "tune-then-freeze"}"#).unwrap();
        assert_eq!(ok.window, 64);
        assert!(ok.validate().is_ok());
        assert!(TuningConfig::gorgo_paper().validate().is_ok());
        // The config's names are the serde names, and the names errors use.
        let text = serde_json::to_string(&TuningConfig::gorgo()).unwrap();
        for key in ["window_requests", "window_max_ms", "e2e_guard"] {
            assert!(text.contains(key), "{text}");
        }
        let cfg: TuningConfig = serde_json::from_str(r#"{"window_requests": 0}"#).unwrap();
        match cfg.validate() {
            Err(CoreError::InvalidConfig { field, .. }) => assert_eq!(field, "window_requests"),
            other => panic!("{other:?}"),
        }
        // A window of one request cannot hold both arms of a paired trial: it tuned
        // nothing, silently; a sequential trial measures one arm a window.
        for trial in ["interleaved", "switchback"] {
            let cfg: TuningConfig = serde_json::from_str(&format!(
                r#"{{"window_requests": 1, "min_samples": 1, "trial": "{trial}"}}"#
            ))
            .unwrap();
            match cfg.validate() {
                Err(CoreError::InvalidConfig { field, .. }) => {
                    assert_eq!(field, "window_requests", "{trial}")
                }
                other => panic!("{trial}: {other:?}"),
            }
        }
        let cfg: TuningConfig = serde_json::from_str(
            r#"{"window_requests": 1, "min_samples": 1, "trial": "sequential"}"#,
        )
        .unwrap();
        cfg.validate().unwrap();
        // Blocks longer than followers accept (`Proposal::is_plausible`) are refused
        // here, not dropped by every follower.
        let mut cfg = TuningConfig::gorgo();
        cfg.switchback_block_ms = MAX_SWITCHBACK_BLOCK_MS;
        assert!(cfg.validate().is_ok());
        cfg.switchback_block_ms += 1;
        match cfg.validate() {
            Err(CoreError::InvalidConfig { field, .. }) => {
                assert_eq!(field, "switchback_block_ms")
            }
            other => panic!("{other:?}"),
        }
        // A switchback window must be able to span four blocks before its time cap.
        let mut cfg = TuningConfig {
            trial: TrialDesign::Switchback,
            ..TuningConfig::gorgo()
        };
        cfg.switchback_block_ms = cfg.time_cap_ms / 4;
        assert!(cfg.validate().is_ok());
        cfg.switchback_block_ms += 1;
        match cfg.validate() {
            Err(CoreError::InvalidConfig { field, .. }) => assert_eq!(field, "window_max_ms"),
            other => panic!("{other:?}"),
        }
    }
}
