//! Online fit of a node's prefill cost: `TTFT - RTT = base + t_p * uncached_tokens`.
//!
//! Each node fits its own engine (docs/design.md, "What a node knows") so heterogeneous
//! regions get their own `t_p`, and gossips the result in its queue stats. Recursive
//! least squares with a forgetting factor follows drift (load, model swaps) without
//! storing history; the configured profile seeds it so the first decisions are sane.
//!
//! What the fit is fed, and why (the simulator found both problems, docs/simulator.md):
//!
//! - **Prefill only, not queueing.** Engine-side TTFT includes the wait behind work
//!   already at the engine. Fed raw, under overload that wait (seconds to hours, not
//!   proportional to this request's own uncached tokens) swamps the regression: `t_p`
//!   collapsed to its floor on one node and tripled on another, and routing went
//!   haywire. Drivers therefore call [`PrefillFit::observe_after_wait`] with the
//!   unweighted queueing estimate the node had at dispatch (`cost::queue_ms` of its own
//!   local candidate, the same estimate the cost model uses) and the fit regresses on
//!   `TTFT - RTT - queued`. Samples where that is negative (the estimate overshot) are
//!   refused rather than clamped to 0, which would bias `t_p` down. We chose subtraction
//!   over "only samples with nothing ahead" alone because at moderate load most
//!   requests wait a little and that would starve the fit.
//! - **Only samples the estimate can clean.** Under overload the wait is minutes to
//!   hours and the estimate's error alone dwarfs a prefill of a second: the
//!   subtraction leaves garbage (measured: `t_p` pinned at a band edge). A sample is
//!   therefore skipped (counted in [`PrefillFit::skipped`]) when the estimated wait
//!   exceeds [`MAX_QUEUED_SHARE`] x the fit's own prediction for it, or when what is
//!   left exceeds [`MAX_RESIDUAL_FACTOR`] x that prediction (a wait the estimate did
//!   not see). During sustained overload the fit thus keeps its last good value instead
//!   of learning the queue.
//! - **Weighted by the noise of a sample.** Each observation is scaled by its expected
//!   noise ([`FitConfig::noise_cv`] x the fit's prediction, at least 25 ms), so the
//!   seed's prior counts against real noise and a couple of slow early requests cannot
//!   move `t_p` by their whole error (on a real engine two samples once took a region
//!   from 1.35 to 4.0 ms per token and starved it of the traffic that would correct it).
//! - **A band around the seed.** The estimate is imperfect, so `t_p` is also kept in
//!   `[seed / T_P_BAND, seed * T_P_BAND]` (the state itself is projected into the band
//!   after every update, so it cannot wind up outside it and take a long time to come
//!   back) and `base` in `[0, max(seed_base * T_P_BAND, MIN_BASE_CAP_MS)]`. A real
//!   engine within 4x of its profile is fitted exactly; one bad window cannot make a
//!   node look a million times cheaper or dearer than its peers. A profile off by more
//!   than 4x is a configuration error, visible in `/admin/state` as `t_p` pinned at a
//!   band edge.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::error::CoreError;

/// Tokens are fitted in thousands so the two regressors have similar magnitudes and the
/// 2x2 covariance stays well conditioned.
const TOKEN_SCALE: f64 = 1000.0;

/// Largest observation accepted, ms: anything above is a stuck request, not prefill.
const MAX_OBSERVED_MS: f64 = 600_000.0;

/// Largest prompt accepted, tokens: beyond any context window, so a bad count.
const MAX_TOKENS: u64 = 10_000_000;

/// Factor bounding the fitted `t_p` (and `base`) around the profile seed, both ways.
pub const T_P_BAND: f64 = 4.0;

/// Largest estimated wait, as a multiple of the predicted prefill, for which a sample
/// is still used.
pub const MAX_QUEUED_SHARE: f64 = 1.0;

/// Largest `TTFT - RTT - queued`, as a multiple of the predicted prefill, accepted as a
/// prefill observation (the band's width: a real engine up to 4x off is still tracked).
pub const MAX_RESIDUAL_FACTOR: f64 = T_P_BAND;

/// Smallest upper bound on the fitted base, ms, so a zero seed still leaves room.
const MIN_BASE_CAP_MS: f64 = 1000.0;

/// Tuning knobs of [`PrefillFit`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FitConfig {
    /// RLS forgetting factor in (0, 1]; memory is about `1 / (1 - forgetting)` samples.
    pub forgetting: f64,
    /// Samples kept to compute R^2 of the current fit.
    pub r2_window: usize,
    /// Prior variance of the seeded base, ms^2 (how far the profile may be off).
    pub base_prior_var: f64,
    /// Prior variance of the seeded `t_p`, (ms per 1000 tokens)^2.
    pub t_p_prior_var: f64,
    /// Bound on the covariance trace: forgetting stops above it, which prevents windup
    /// when every request has the same length and the data carry no information.
    pub max_cov_trace: f64,
    /// Standard deviation of one observation about the fitted line, as a fraction of
    /// the fit's prediction for it (TTFT noise grows with the prefill): how much a single
    /// sample is trusted against the seed. The regression is weighted by it, so the first
    /// samples move the fit in proportion to how far the profile may be off, not by
    /// almost all of their error (plain RLS assumes a noise of 1 ms: on a real engine two
    /// samples took a region's `t_p` from 1.35 to 4.0 ms per token, and the region then
    /// got almost no traffic to correct it; docs/real-engine.md).
    #[serde(default = "default_noise_cv")]
    pub noise_cv: f64,
}

/// The default [`FitConfig::noise_cv`]: a TTFT prediction is trusted to about a
/// quarter of itself. Forward refusals use the same figure as their margin
/// ([`crate::decision::refuse_forward`]).
pub const DEFAULT_NOISE_CV: f64 = 0.25;

fn default_noise_cv() -> f64 {
    DEFAULT_NOISE_CV
}

/// Smallest observation noise assumed, ms (a tiny prediction is not that precise).
const MIN_NOISE_MS: f64 = 25.0;

impl Default for FitConfig {
    fn default() -> Self {
        FitConfig {
            forgetting: 0.995,
            r2_window: 256,
            base_prior_var: 100.0 * 100.0,
            t_p_prior_var: 50.0 * 50.0,
            max_cov_trace: 1e6,
            noise_cv: default_noise_cv(),
        }
    }
}

impl FitConfig {
    /// Check every field, naming the one that is wrong.
    pub fn validate(&self) -> Result<(), CoreError> {
        let bad = |field: &str, reason: &str| {
            Err(CoreError::InvalidConfig {
                field: field.into(),
                reason: reason.into(),
            })
        };
        if !(self.forgetting > 0.0 && self.forgetting <= 1.0) {
            return bad("forgetting", "must be in (0, 1]");
        }
        if self.r2_window < 3 {
            return bad("r2_window", "must be at least 3");
        }
        if !(self.base_prior_var.is_finite() && self.base_prior_var > 0.0) {
            return bad("base_prior_var", "must be positive");
        }
        if !(self.t_p_prior_var.is_finite() && self.t_p_prior_var > 0.0) {
            return bad("t_p_prior_var", "must be positive");
        }
        if !(self.max_cov_trace.is_finite() && self.max_cov_trace > 0.0) {
            return bad("max_cov_trace", "must be positive");
        }
        if !(self.noise_cv.is_finite() && self.noise_cv > 0.0) {
            return bad("noise_cv", "must be positive");
        }
        Ok(())
    }
}

/// Recursive-least-squares fit of `TTFT - RTT = base + t_p * uncached_tokens`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrefillFit {
    cfg: FitConfig,
    /// `[base_ms, t_p_ms * TOKEN_SCALE]`.
    theta: [f64; 2],
    /// Covariance, row-major 2x2.
    p: [[f64; 2]; 2],
    /// Recent `(uncached_tokens, ttft - rtt)` for R^2.
    recent: VecDeque<(f64, f64)>,
    samples: u64,
    rejected: u64,
    /// Samples skipped because queueing dominated them.
    #[serde(default)]
    skipped: u64,
    /// `[min, max]` of `theta[1]` (scaled `t_p`): the band around the seed.
    #[serde(default = "unbounded")]
    t_p_band: [f64; 2],
    /// Largest `theta[0]` (base), ms.
    #[serde(default = "unbounded_cap")]
    base_cap_ms: f64,
}

fn unbounded() -> [f64; 2] {
    [0.0, f64::MAX]
}

fn unbounded_cap() -> f64 {
    f64::MAX
}

impl PrefillFit {
    /// Start from a profile's `base_ms` and `t_p_ms` (e.g. the paper's 150.72, 0.0938).
    pub fn new(seed_base_ms: f64, seed_t_p_ms: f64, cfg: FitConfig) -> Result<Self, CoreError> {
        cfg.validate()?;
        if !(seed_base_ms.is_finite() && seed_base_ms >= 0.0) {
            return Err(CoreError::InvalidConfig {
                field: "base_ms".into(),
                reason: "must be a finite, non-negative number".into(),
            });
        }
        if !(seed_t_p_ms.is_finite() && seed_t_p_ms > 0.0) {
            return Err(CoreError::InvalidConfig {
                field: "t_p_ms".into(),
                reason: "must be a finite, positive number".into(),
            });
        }
        Ok(PrefillFit {
            cfg,
            theta: [seed_base_ms, seed_t_p_ms * TOKEN_SCALE],
            p: [[cfg.base_prior_var, 0.0], [0.0, cfg.t_p_prior_var]],
            recent: VecDeque::with_capacity(cfg.r2_window),
            samples: 0,
            rejected: 0,
            skipped: 0,
            t_p_band: [
                seed_t_p_ms * TOKEN_SCALE / T_P_BAND,
                seed_t_p_ms * TOKEN_SCALE * T_P_BAND,
            ],
            base_cap_ms: (seed_base_ms * T_P_BAND).max(MIN_BASE_CAP_MS),
        })
    }

    /// Add one finished request that waited behind no work (or whose wait is unknown).
    /// Same as [`PrefillFit::observe_after_wait`] with `queued_ms = 0`.
    pub fn observe(&mut self, ttft_ms: f64, rtt_ms: f64, uncached_tokens: u64) -> bool {
        self.observe_after_wait(ttft_ms, rtt_ms, 0.0, uncached_tokens)
    }

    /// Add one finished request whose engine-side TTFT includes an estimated
    /// `queued_ms` of waiting behind other work (the node's unweighted
    /// `cost::queue_ms` for itself at dispatch); the fit sees `ttft - rtt - queued`.
    /// Returns false (and ignores it) when the inputs are not finite, negative, larger
    /// than any real prefill, or when the wait estimate exceeds the observed latency
    /// (all counted in [`PrefillFit::rejected`]), or when queueing dominates the sample
    /// (counted in [`PrefillFit::skipped`]; see the module docs).
    pub fn observe_after_wait(
        &mut self,
        ttft_ms: f64,
        rtt_ms: f64,
        queued_ms: f64,
        uncached_tokens: u64,
    ) -> bool {
        let y = ttft_ms - rtt_ms - queued_ms;
        let sane = ttft_ms.is_finite()
            && rtt_ms.is_finite()
            && rtt_ms >= 0.0
            && queued_ms.is_finite()
            && queued_ms >= 0.0
            && (0.0..=MAX_OBSERVED_MS).contains(&y)
            && uncached_tokens <= MAX_TOKENS;
        if !sane {
            self.rejected += 1;
            return false;
        }
        let predicted = self.predict_ms(uncached_tokens);
        if queued_ms > MAX_QUEUED_SHARE * predicted || y > MAX_RESIDUAL_FACTOR * predicted {
            self.skipped += 1;
            return false;
        }
        // Weighted least squares: each observation scaled by its noise.
        let sigma = (self.cfg.noise_cv * predicted).max(MIN_NOISE_MS);
        let x = [1.0 / sigma, uncached_tokens as f64 / TOKEN_SCALE / sigma];
        let y_scaled = y / sigma;
        let px = [
            self.p[0][0] * x[0] + self.p[0][1] * x[1],
            self.p[1][0] * x[0] + self.p[1][1] * x[1],
        ];
        let trace = self.p[0][0] + self.p[1][1];
        let lambda = if trace < self.cfg.max_cov_trace {
            self.cfg.forgetting
        } else {
            1.0
        };
        let denom = lambda + x[0] * px[0] + x[1] * px[1];
        if !(denom.is_finite() && denom > 0.0) {
            self.rejected += 1;
            return false;
        }
        let k = [px[0] / denom, px[1] / denom];
        let err = y_scaled - (self.theta[0] * x[0] + self.theta[1] * x[1]);
        // Projected into the band (see the module docs).
        let theta = [
            (self.theta[0] + k[0] * err).clamp(0.0, self.base_cap_ms),
            (self.theta[1] + k[1] * err).clamp(self.t_p_band[0], self.t_p_band[1]),
        ];
        // P = (P - k x^T P) / lambda, symmetrised against rounding drift.
        let mut p = [[0.0; 2]; 2];
        for (i, row) in p.iter_mut().enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                *v = (self.p[i][j] - k[i] * px[j]) / lambda;
            }
        }
        let off = 0.5 * (p[0][1] + p[1][0]);
        p[0][1] = off;
        p[1][0] = off;
        if !(theta.iter().all(|v| v.is_finite()) && p.iter().flatten().all(|v| v.is_finite())) {
            self.rejected += 1;
            return false;
        }
        self.theta = theta;
        self.p = p;
        if self.recent.len() == self.cfg.r2_window {
            self.recent.pop_front();
        }
        self.recent.push_back((uncached_tokens as f64, y));
        self.samples += 1;
        true
    }

    /// Fitted fixed cost, ms (never negative).
    pub fn base_ms(&self) -> f64 {
        self.theta[0].max(0.0)
    }

    /// Fitted prefill cost per uncached token, ms: within [`T_P_BAND`] of the seed, and
    /// never below a microsecond per thousand tokens, so a noisy fit can make prefill
    /// look neither free nor absurdly dear.
    pub fn t_p_ms(&self) -> f64 {
        (self.theta[1].clamp(self.t_p_band[0], self.t_p_band[1]) / TOKEN_SCALE).max(1e-6)
    }

    /// Predicted `TTFT - RTT` for `uncached_tokens`, ms.
    pub fn predict_ms(&self, uncached_tokens: u64) -> f64 {
        self.base_ms() + self.t_p_ms() * uncached_tokens as f64
    }

    /// Coefficient of determination of the current fit over the recent window; `None`
    /// with fewer than 3 samples or when every observation is identical.
    pub fn r_squared(&self) -> Option<f64> {
        let n = self.recent.len();
        if n < 3 {
            return None;
        }
        let mean = self.recent.iter().map(|&(_, y)| y).sum::<f64>() / n as f64;
        let ss_tot: f64 = self.recent.iter().map(|&(_, y)| (y - mean).powi(2)).sum();
        if ss_tot <= f64::EPSILON {
            return None;
        }
        let ss_res: f64 = self
            .recent
            .iter()
            .map(|&(u, y)| {
                let pred = self.theta[0] + self.theta[1] * u / TOKEN_SCALE;
                (y - pred).powi(2)
            })
            .sum();
        Some(1.0 - ss_res / ss_tot)
    }

    /// Observations accepted so far.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// Observations refused as degenerate.
    pub fn rejected(&self) -> u64 {
        self.rejected
    }

    /// Observations skipped because queueing dominated them.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn two_slow_samples_do_not_make_a_region_look_three_times_dearer() {
        // The real-engine case: seed 1.35 ms/token, two early requests that took about
        // three times the seed's prediction (a cold start). The fit moves, but a
        // handful of samples must not pin the region at the band's top edge.
        let mut f = PrefillFit::new(150.0, 1.35, FitConfig::default()).unwrap();
        for _ in 0..2 {
            assert!(f.observe(150.0 + 3.0 * 1.35 * 1500.0, 0.0, 1500));
        }
        assert!(f.t_p_ms() > 1.35, "it learns: {}", f.t_p_ms());
        assert!(f.t_p_ms() < 2.0, "but not from two samples: {}", f.t_p_ms());
        // Evidence that keeps coming still wins.
        for i in 0..1000u64 {
            let u = 500 + (i * 97) % 3000;
            f.observe(150.0 + 3.0 * 1.35 * u as f64, 0.0, u);
        }
        assert!((f.t_p_ms() - 4.05).abs() < 0.3, "{}", f.t_p_ms());
    }

    #[test]
    fn converges_to_a_new_engine() {
        let mut f = PrefillFit::new(150.72, 0.0938, FitConfig::default()).unwrap();
        // The engine is actually an H200: 40 ms + 0.0295 ms/token, with noise.
        let mut s = 12345u64;
        for i in 0..2000u64 {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let noise = ((s >> 33) as f64 / (1u64 << 31) as f64 - 0.5) * 10.0;
            let tokens = 100 + (i * 7919) % 16_000;
            let rtt = 30.0;
            assert!(f.observe(rtt + 40.0 + 0.0295 * tokens as f64 + noise, rtt, tokens));
        }
        assert!((f.t_p_ms() - 0.0295).abs() < 0.001, "t_p {}", f.t_p_ms());
        assert!((f.base_ms() - 40.0).abs() < 3.0, "base {}", f.base_ms());
        assert!(f.r_squared().unwrap() > 0.98);
    }

    #[test]
    fn degenerate_inputs_are_refused() {
        let mut f = PrefillFit::new(150.0, 0.09, FitConfig::default()).unwrap();
        assert!(!f.observe(f64::NAN, 0.0, 10));
        assert!(!f.observe(100.0, f64::INFINITY, 10));
        assert!(!f.observe(10.0, 50.0, 10));
        assert!(!f.observe(100.0, -1.0, 10));
        assert_eq!(f.samples(), 0);
        assert_eq!(f.rejected(), 4);
        assert_eq!(f.t_p_ms(), 0.09);
        assert!(f.r_squared().is_none());
        assert!(PrefillFit::new(-1.0, 0.09, FitConfig::default()).is_err());
        let cfg = FitConfig {
            forgetting: 1.5,
            ..FitConfig::default()
        };
        match PrefillFit::new(1.0, 0.09, cfg) {
            Err(CoreError::InvalidConfig { field, .. }) => assert_eq!(field, "forgetting"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn constant_length_requests_do_not_wind_up() {
        let mut f = PrefillFit::new(150.0, 0.09, FitConfig::default()).unwrap();
        for _ in 0..100_000 {
            f.observe(240.0, 0.0, 1000);
        }
        assert!(f.t_p_ms().is_finite() && f.base_ms().is_finite());
        assert!((f.predict_ms(1000) - 240.0).abs() < 1.0);
    }

    #[test]
    fn queueing_is_subtracted_not_fitted() {
        // The engine prefills at 40 ms + 0.05 ms/token, but requests also wait behind
        // a random amount of work the node estimated at dispatch (up to about as long
        // as their prefill; longer waits are skipped, tested below).
        let mut raw = PrefillFit::new(150.72, 0.0938, FitConfig::default()).unwrap();
        let mut net = raw.clone();
        for i in 0..3000u64 {
            let tokens = 500 + (i * 7919) % 8000;
            let wait = ((i * 104_729) % 200) as f64;
            let ttft = 40.0 + 0.05 * tokens as f64 + wait;
            raw.observe(ttft, 0.0, tokens);
            net.observe_after_wait(ttft, 0.0, wait, tokens);
        }
        assert!(net.samples() > 2500, "{} samples", net.samples());
        assert!((net.t_p_ms() - 0.05).abs() < 1e-3, "t_p {}", net.t_p_ms());
        assert!((net.base_ms() - 40.0).abs() < 3.0, "base {}", net.base_ms());
        // Fed raw, the fit is garbage, but the band keeps it within 4x of the seed.
        let t = raw.t_p_ms();
        assert!((0.0938 / T_P_BAND - 1e-12..=0.0938 * T_P_BAND + 1e-12).contains(&t));
        // A wait estimate larger than the latency itself is refused.
        assert!(!net.observe_after_wait(100.0, 0.0, 200.0, 10));
        assert!(!net.observe_after_wait(100.0, 0.0, f64::NAN, 10));
        assert_eq!(net.rejected(), 2);
        net.skipped = 0;
        // Overload: waits of minutes, estimated or not, teach the fit nothing.
        let before = net.clone();
        assert!(!net.observe_after_wait(600_000.0 - 1.0, 0.0, 500_000.0, 1000));
        assert!(!net.observe_after_wait(30_000.0, 0.0, 0.0, 1000));
        assert_eq!(net.skipped(), 2);
        assert_eq!(
            (net.t_p_ms(), net.base_ms()),
            (before.t_p_ms(), before.base_ms())
        );
    }

    proptest! {
        #[test]
        fn stays_in_the_band(obs in proptest::collection::vec((0.0..1e6f64, 0u64..100_000), 1..300)) {
            let mut f = PrefillFit::new(150.0, 0.09, FitConfig::default()).unwrap();
            for (t, u) in obs {
                f.observe(t, 0.0, u);
            }
            prop_assert!(f.t_p_ms() >= 0.09 / T_P_BAND * (1.0 - 1e-12));
            prop_assert!(f.t_p_ms() <= 0.09 * T_P_BAND * (1.0 + 1e-12));
            prop_assert!(f.base_ms() <= (150.0 * T_P_BAND).max(MIN_BASE_CAP_MS));
        }

        #[test]
        fn never_non_finite(obs in proptest::collection::vec((any::<f64>(), any::<f64>(), any::<u64>()), 0..200)) {
            let mut f = PrefillFit::new(150.0, 0.09, FitConfig::default()).unwrap();
            for (t, r, u) in obs {
                f.observe(t, r, u);
            }
            prop_assert!(f.t_p_ms().is_finite() && f.base_ms().is_finite());
            prop_assert!(f.t_p_ms() > 0.0 && f.base_ms() >= 0.0);
        }
    }
}
