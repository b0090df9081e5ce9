//! The bytes-per-token ratio, learned online from the engine's own counts.
//!
//! Without a tokenizer a node estimates a prompt's tokens from its canonical bytes. A
//! fixed 4 bytes per token is far off for many models (3.5x on the llama.cpp run of
//! issue #17), and the error goes straight into the context-length check and the
//! prefill cost. Every engine reports `usage.prompt_tokens`; [`TokenRatio`] learns from
//! (canonical bytes, engine tokens) pairs `tokens ≈ overhead + bytes / bytes_per_token`:
//! the ratio of the text, and the fixed tokens the engine's chat template adds to every
//! prompt (role tags, a tools preamble) that the canonical rendering does not have. A
//! node keeps one per [`crate::prompt::PromptShape`], since the overhead differs by
//! shape.
//!
//! - bounded: the last [`WINDOW`] observations, each ratio within
//!   [[`MIN_BYTES_PER_TOKEN`], [`MAX_BYTES_PER_TOKEN`]] (others are refused);
//! - robust: only observations whose own ratio lies within a factor 2 of the window's
//!   median are fitted, so a few odd prompts (an image placeholder, a huge tool
//!   schema) do not drag it;
//! - simple first: the ratio of sums (no overhead) until [`MIN_FIT`] observations of
//!   spread-out sizes allow a least-squares line; a line with a negative overhead, an
//!   overhead above the smallest prompt, or a slope out of range is not taken.
//!
//! Only token counts follow the fit: a byte chain's block hashes never depend on it
//! (`crate::prompt::PromptHasher`), so summaries stay comparable while it moves.

use std::collections::VecDeque;

use crate::error::CoreError;
use crate::prompt::TokenCounter;

/// Observations kept: enough for a stable fit, few enough to follow a change of model
/// or workload within minutes.
pub const WINDOW: usize = 256;
/// Smallest accepted bytes per token (CJK text in a byte-level BPE is ~1; below 0.25
/// something else is being counted).
pub const MIN_BYTES_PER_TOKEN: f64 = 0.25;
/// Largest accepted bytes per token.
pub const MAX_BYTES_PER_TOKEN: f64 = 64.0;
/// Observations before the overhead is fitted (a line through fewer is noise).
pub const MIN_FIT: usize = 8;
/// Largest over smallest prompt size needed to fit an overhead: with similar sizes the
/// intercept is not identifiable.
const MIN_SPREAD: f64 = 1.5;

/// The online token estimate of one prompt shape (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenRatio {
    seed: f64,
    window: VecDeque<(u64, u64)>,
    bytes_per_token: f64,
    overhead: f64,
    accepted: u64,
    refused: u64,
}

/// A fixed tokens-per-byte rate: what a chain's blocks are counted with (the fit's
/// overhead goes to the first block, see [`TokenRatio::overhead_tokens`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PerByteRate {
    bytes_per_token: f64,
}

impl TokenCounter for PerByteRate {
    /// Rounded to nearest, so that the blocks of a chain add up without a bias; at
    /// least 1 for a non-empty block.
    fn count(&self, text: &[u8]) -> u64 {
        if text.is_empty() {
            return 0;
        }
        ((text.len() as f64 / self.bytes_per_token).round() as u64).max(1)
    }
}

impl TokenRatio {
    /// A ratio starting at `seed_bytes_per_token` (`routing.bytes_per_token`), with no
    /// overhead, until the first observation. Errors when the seed is out of range.
    pub fn new(seed_bytes_per_token: f64) -> Result<Self, CoreError> {
        if !(MIN_BYTES_PER_TOKEN..=MAX_BYTES_PER_TOKEN).contains(&seed_bytes_per_token) {
            return Err(CoreError::InvalidConfig {
                field: "bytes_per_token".into(),
                reason: format!("must be in [{MIN_BYTES_PER_TOKEN}, {MAX_BYTES_PER_TOKEN}]"),
            });
        }
        Ok(TokenRatio {
            seed: seed_bytes_per_token,
            window: VecDeque::with_capacity(WINDOW),
            bytes_per_token: seed_bytes_per_token,
            overhead: 0.0,
            accepted: 0,
            refused: 0,
        })
    }

    /// One request's canonical prompt bytes and the engine's `usage.prompt_tokens` for
    /// it. Returns whether it was taken (zero counts and ratios out of range are not).
    pub fn observe(&mut self, prompt_bytes: u64, prompt_tokens: u64) -> bool {
        if prompt_bytes == 0 || prompt_tokens == 0 {
            self.refused += 1;
            return false;
        }
        let ratio = prompt_bytes as f64 / prompt_tokens as f64;
        if !(MIN_BYTES_PER_TOKEN..=MAX_BYTES_PER_TOKEN).contains(&ratio) {
            self.refused += 1;
            return false;
        }
        if self.window.len() == WINDOW {
            self.window.pop_front();
        }
        self.window.push_back((prompt_bytes, prompt_tokens));
        self.accepted += 1;
        self.refit();
        true
    }

    fn refit(&mut self) {
        let mut ratios: Vec<f64> = self
            .window
            .iter()
            .map(|&(b, t)| b as f64 / t as f64)
            .collect();
        ratios.sort_by(f64::total_cmp);
        let median = ratios[ratios.len() / 2];
        let (lo, hi) = (median / 2.0, median * 2.0);
        // The median's own observation always passes: `kept` is never empty.
        let kept: Vec<(f64, f64)> = self
            .window
            .iter()
            .filter(|&&(b, t)| (lo..=hi).contains(&(b as f64 / t as f64)))
            .map(|&(b, t)| (b as f64, t as f64))
            .collect();
        let (sum_b, sum_t) = kept
            .iter()
            .fold((0.0, 0.0), |(sb, st), &(b, t)| (sb + b, st + t));
        self.bytes_per_token = (sum_b / sum_t).clamp(MIN_BYTES_PER_TOKEN, MAX_BYTES_PER_TOKEN);
        self.overhead = 0.0;
        let smallest = self.window.iter().map(|&(_, t)| t).min().unwrap_or(0) as f64;
        if let Some((bytes_per_token, overhead)) = fit_line(&kept, smallest) {
            self.bytes_per_token = bytes_per_token;
            self.overhead = overhead;
        }
    }

    /// The current estimate of bytes per token (of the text beyond the overhead).
    pub fn bytes_per_token(&self) -> f64 {
        self.bytes_per_token
    }

    /// Tokens the engine adds to every prompt of this shape beyond its canonical text
    /// (0 until fitted), rounded.
    pub fn overhead_tokens(&self) -> u64 {
        self.overhead.round() as u64
    }

    /// The rate a chain's blocks are counted with.
    pub fn per_byte(&self) -> PerByteRate {
        PerByteRate {
            bytes_per_token: self.bytes_per_token,
        }
    }

    /// The seed the estimate started from.
    pub fn seed(&self) -> f64 {
        self.seed
    }

    /// Observations taken so far (all time, not only those in the window).
    pub fn samples(&self) -> u64 {
        self.accepted
    }

    /// Observations refused so far (zero counts, ratios out of range).
    pub fn refused(&self) -> u64 {
        self.refused
    }

    /// Estimated tokens of a prompt of `bytes` canonical bytes: the overhead plus the
    /// text's tokens, rounded; at least 1 for any byte.
    pub fn tokens(&self, bytes: u64) -> u64 {
        if bytes == 0 {
            return 0;
        }
        ((self.overhead + bytes as f64 / self.bytes_per_token).round() as u64).max(1)
    }
}

/// Least squares `tokens = overhead + bytes / bytes_per_token` over `points` (bytes,
/// tokens), when there are enough of spread-out sizes and the line is plausible: a
/// slope in range, an overhead from 0 up to below `smallest` (the fewest tokens of any
/// prompt seen).
fn fit_line(points: &[(f64, f64)], smallest: f64) -> Option<(f64, f64)> {
    if points.len() < MIN_FIT {
        return None;
    }
    let n = points.len() as f64;
    let (min_b, max_b) = points
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), &(b, _)| {
            (lo.min(b), hi.max(b))
        });
    if max_b < MIN_SPREAD * min_b {
        return None;
    }
    let mean_b = points.iter().map(|p| p.0).sum::<f64>() / n;
    let mean_t = points.iter().map(|p| p.1).sum::<f64>() / n;
    let var = points.iter().map(|p| (p.0 - mean_b).powi(2)).sum::<f64>();
    let cov = points
        .iter()
        .map(|p| (p.0 - mean_b) * (p.1 - mean_t))
        .sum::<f64>();
    let slope = cov / var;
    let overhead = mean_t - slope * mean_b;
    let plausible = slope.is_finite()
        && (1.0 / MAX_BYTES_PER_TOKEN..=1.0 / MIN_BYTES_PER_TOKEN).contains(&slope)
        && (0.0..smallest).contains(&overhead);
    plausible.then(|| (1.0 / slope, overhead))
}

impl TokenCounter for TokenRatio {
    /// The whole estimate of `text` as one prompt, overhead included.
    fn count(&self, text: &[u8]) -> u64 {
        self.tokens(text.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn starts_at_the_seed_and_learns() {
        let mut r = TokenRatio::new(4.0).unwrap();
        assert_eq!(r.bytes_per_token(), 4.0);
        assert_eq!(r.tokens(400), 100);
        for i in 0..50u64 {
            // About 1.2 bytes per token with some spread.
            let bytes = 1000 + 37 * i;
            r.observe(bytes, (bytes as f64 / (1.1 + 0.004 * i as f64)) as u64);
        }
        let expected = 2000.0 / 1.208;
        assert!(
            (r.tokens(2000) as f64 - expected).abs() / expected < 0.03,
            "{r:?}"
        );
        assert_eq!(r.samples(), 50);
        assert_eq!(r.seed(), 4.0);
    }

    #[test]
    fn outliers_and_nonsense_do_not_move_it() {
        let mut r = TokenRatio::new(4.0).unwrap();
        for _ in 0..20 {
            assert!(r.observe(3000, 1000));
        }
        // Refused: zero counts, impossible ratios.
        assert!(!r.observe(0, 10));
        assert!(!r.observe(10, 0));
        assert!(!r.observe(1_000_000, 1));
        assert_eq!(r.refused(), 3);
        // Taken but trimmed: a few wild ones within range.
        r.observe(60_000, 1000);
        r.observe(300, 1000);
        assert!((r.bytes_per_token() - 3.0).abs() < 1e-9, "{r:?}");
        assert_eq!(r.overhead_tokens(), 0, "one size: no overhead is fitted");
        assert!(TokenRatio::new(0.0).is_err());
        assert!(TokenRatio::new(f64::NAN).is_err());
        assert_eq!(r.tokens(0), 0);
        assert_eq!(r.tokens(1), 1);
    }

    #[test]
    fn a_fixed_overhead_is_fitted() {
        let mut r = TokenRatio::new(4.0).unwrap();
        // A template adding 300 tokens to text of 2 bytes per token.
        for i in 0..20u64 {
            let bytes = 500 + 211 * i;
            r.observe(bytes, 300 + bytes / 2);
        }
        assert!((r.bytes_per_token() - 2.0).abs() < 0.01, "{r:?}");
        assert!(r.overhead_tokens().abs_diff(300) <= 1, "{r:?}");
        assert!(r.tokens(1000).abs_diff(800) <= 2);
        // Blocks are counted at the rate; the overhead is the caller's to place.
        assert_eq!(r.per_byte().count(&[0u8; 256]), 128);
        assert_eq!(r.per_byte().count(&[]), 0);
        assert_eq!(r.per_byte().count(&[0]), 1);
    }

    #[test]
    fn the_window_follows_a_change() {
        let mut r = TokenRatio::new(4.0).unwrap();
        for _ in 0..WINDOW {
            r.observe(4000, 1000);
        }
        for _ in 0..WINDOW {
            r.observe(2000, 1000);
        }
        assert!((r.bytes_per_token() - 2.0).abs() < 1e-9);
    }

    proptest! {
        #[test]
        fn estimate_stays_bounded_and_within_the_observed_range(
            obs in proptest::collection::vec((1u64..1_000_000, 1u64..1_000_000), 1..600),
            seed in 0.25f64..64.0,
        ) {
            let mut r = TokenRatio::new(seed).unwrap();
            for &(b, t) in &obs {
                r.observe(b, t);
                let e = r.bytes_per_token();
                prop_assert!(e.is_finite());
                prop_assert!((MIN_BYTES_PER_TOKEN..=MAX_BYTES_PER_TOKEN).contains(&e));
            }
            prop_assert!(r.window.len() <= WINDOW);
            if r.samples() > 0 && r.overhead_tokens() == 0 {
                // A ratio of sums of a subset of the window lies between its extremes.
                let ratios = r.window.iter().map(|&(b, t)| b as f64 / t as f64);
                let lo = ratios.clone().fold(f64::INFINITY, f64::min);
                let hi = ratios.fold(0.0, f64::max);
                let e = r.bytes_per_token();
                prop_assert!(e >= lo * (1.0 - 1e-9) && e <= hi * (1.0 + 1e-9), "{e} not in [{lo}, {hi}]");
            } else if r.samples() == 0 {
                prop_assert_eq!(r.bytes_per_token(), seed);
            }
            // An overhead never exceeds the smallest prompt in the window.
            let min_t = r.window.iter().map(|&(_, t)| t).min().unwrap_or(0);
            prop_assert!(r.overhead_tokens() <= min_t);
        }

        #[test]
        fn a_constant_ratio_is_learned_exactly(ratio in 0.5f64..16.0, n in 1usize..100) {
            // What is learned is the token count: bytes rounded to integers can tilt the
            // fitted line (ratio 0.69 over 9 sizes: slope 1.1% off, overhead 2 tokens),
            // and the counts stay within a token.
            let mut r = TokenRatio::new(4.0).unwrap();
            let sizes: Vec<(u64, u64)> = (0..n)
                .map(|i| {
                    let tokens = 100 + i as u64 * 13;
                    ((tokens as f64 * ratio).round() as u64, tokens)
                })
                .collect();
            for &(bytes, tokens) in &sizes {
                r.observe(bytes, tokens);
            }
            for &(bytes, tokens) in &sizes {
                let err = r.tokens(bytes).abs_diff(tokens) as f64;
                prop_assert!(err <= 1.0 + 0.01 * tokens as f64, "{bytes} bytes: {} vs {tokens}", r.tokens(bytes));
            }
            prop_assert!((r.bytes_per_token() - ratio).abs() / ratio < 0.02);
        }
    }
}
