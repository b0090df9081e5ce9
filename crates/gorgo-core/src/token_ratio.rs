//! The bytes-per-token ratio, learned online from the engine's own counts.
//!
//! Without a tokenizer a node estimates a prompt's tokens from its canonical bytes. A
//! fixed 4 bytes per token is far off for many models (3.5x on the llama.cpp run of
//! issue #17), and the error goes straight into the context-length check and the
//! prefill cost. Every engine reports `usage.prompt_tokens`; [`TokenRatio`] learns the
//! ratio from (canonical bytes, engine tokens) pairs:
//!
//! - bounded: the last [`WINDOW`] observations, each ratio within
//!   [[`MIN_BYTES_PER_TOKEN`], [`MAX_BYTES_PER_TOKEN`]] (others are refused);
//! - robust: the estimate is the ratio of sums over the observations whose own ratio
//!   lies within a factor 2 of the window's median, so a few odd prompts (an image
//!   placeholder, a huge tool schema) do not drag it;
//! - weighted by size: a ratio of sums counts long prompts more, and long prompts are
//!   where the estimate matters.
//!
//! Only token counts follow the ratio: a byte chain's block hashes never depend on it
//! (`crate::prompt::PromptHasher`), so summaries stay comparable while it moves.

use std::collections::VecDeque;

use crate::error::CoreError;
use crate::prompt::TokenCounter;

/// Observations kept: enough for a stable median, few enough to follow a change of
/// model or workload within minutes.
pub const WINDOW: usize = 256;
/// Smallest accepted bytes per token (CJK text in a byte-level BPE is ~1; below 0.25
/// something else is being counted).
pub const MIN_BYTES_PER_TOKEN: f64 = 0.25;
/// Largest accepted bytes per token.
pub const MAX_BYTES_PER_TOKEN: f64 = 64.0;

/// The online bytes-per-token estimate (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenRatio {
    seed: f64,
    window: VecDeque<(u64, u64)>,
    estimate: f64,
    accepted: u64,
    refused: u64,
}

impl TokenRatio {
    /// A ratio starting at `seed_bytes_per_token` (`routing.bytes_per_token`) until the
    /// first observation. Errors when the seed is outside the accepted range.
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
            estimate: seed_bytes_per_token,
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
        self.estimate = self.trimmed_ratio();
        true
    }

    fn trimmed_ratio(&self) -> f64 {
        let mut ratios: Vec<f64> = self
            .window
            .iter()
            .map(|&(b, t)| b as f64 / t as f64)
            .collect();
        ratios.sort_by(f64::total_cmp);
        let median = ratios[ratios.len() / 2];
        let (lo, hi) = (median / 2.0, median * 2.0);
        let (bytes, tokens) = self
            .window
            .iter()
            .filter(|&&(b, t)| (lo..=hi).contains(&(b as f64 / t as f64)))
            .fold((0u128, 0u128), |(sb, st), &(b, t)| {
                (sb + b as u128, st + t as u128)
            });
        // The median's own observation always passes the filter.
        (bytes as f64 / tokens as f64).clamp(MIN_BYTES_PER_TOKEN, MAX_BYTES_PER_TOKEN)
    }

    /// The current estimate of bytes per token.
    pub fn bytes_per_token(&self) -> f64 {
        self.estimate
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

    /// Estimated tokens in `bytes` prompt bytes: rounded to nearest, so that the
    /// per-block counts of a chain add up without a bias; at least 1 for any byte.
    pub fn tokens(&self, bytes: u64) -> u64 {
        if bytes == 0 {
            return 0;
        }
        ((bytes as f64 / self.estimate).round() as u64).max(1)
    }
}

impl TokenCounter for TokenRatio {
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
        assert!((r.bytes_per_token() - 1.2).abs() < 0.1, "{r:?}");
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
        assert!(TokenRatio::new(0.0).is_err());
        assert!(TokenRatio::new(f64::NAN).is_err());
        assert_eq!(r.tokens(0), 0);
        assert_eq!(r.tokens(1), 1);
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
            if r.samples() > 0 {
                // A ratio of sums of a subset of the window lies between its extremes.
                let ratios = r.window.iter().map(|&(b, t)| b as f64 / t as f64);
                let lo = ratios.clone().fold(f64::INFINITY, f64::min);
                let hi = ratios.fold(0.0, f64::max);
                let e = r.bytes_per_token();
                prop_assert!(e >= lo * (1.0 - 1e-9) && e <= hi * (1.0 + 1e-9), "{e} not in [{lo}, {hi}]");
            } else {
                prop_assert_eq!(r.bytes_per_token(), seed);
            }
        }

        #[test]
        fn a_constant_ratio_is_learned_exactly(ratio in 0.5f64..16.0, n in 1usize..100) {
            let mut r = TokenRatio::new(4.0).unwrap();
            for i in 0..n {
                let tokens = 100 + i as u64 * 13;
                r.observe((tokens as f64 * ratio).round() as u64, tokens);
            }
            prop_assert!((r.bytes_per_token() - ratio).abs() / ratio < 0.01);
        }
    }
}
