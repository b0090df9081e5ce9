//! Timing and capacity profiles of an inference engine.
//!
//! A profile is what makes the one engine model behave like a particular GPU and
//! model: the cost of a prefill batch, the cost of a decode step, the KV capacity and
//! the scheduler limits. Built-in profiles live in `configs/engines/*.toml` and are
//! embedded in the binary so `gorgo engine --profile <name>` works from any directory;
//! `docs/engine-profiles.md` says how each was fitted.

use serde::{Deserialize, Serialize};

use crate::{EngineError, RejectReason};

/// The built-in profiles: `(name, TOML text)`, embedded at compile time.
const BUILT_IN: &[(&str, &str)] = &[
    (
        "paper-a100-mistral7b",
        include_str!("../../../configs/engines/paper-a100-mistral7b.toml"),
    ),
    (
        "h200-mistral7b",
        include_str!("../../../configs/engines/h200-mistral7b.toml"),
    ),
    (
        "h200-dense-1.5b",
        include_str!("../../../configs/engines/h200-dense-1.5b.toml"),
    ),
    (
        "paper-l40s-qwen35b-a3b",
        include_str!("../../../configs/engines/paper-l40s-qwen35b-a3b.toml"),
    ),
];

/// Most ms a profile's fixed costs (`request_overhead_ms`, `prefill_base_ms`,
/// `decode_base_ms`) may be: a minute, a thousand times any measured engine's.
pub const MAX_FIXED_MS: f64 = 60_000.0;

/// Most ms a profile's costs per token or sequence (`t_p_ms_per_token`, `per_seq_ms`,
/// `per_ctx_token_ms`) may be: a second, as a node's `engine.t_p_ms` (a CPU llama.cpp
/// takes tens of ms a token).
pub const MAX_UNIT_MS: f64 = 1_000.0;

/// Costs and limits of one engine (GPU + model + serving stack).
///
/// Every time is in milliseconds. A prefill batch of `n` new tokens costs
/// `prefill_base_ms + t_p_ms_per_token * n`; a decode step over `b` sequences with `c`
/// context tokens in total costs
/// `decode_base_ms + per_seq_ms * min(b, per_seq_batch_cap) + per_ctx_token_ms * c`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Profile name, as used with `--profile`.
    pub name: String,
    /// One line on what hardware, model and stack this profile stands for.
    #[serde(default)]
    pub description: String,
    /// Model name the emulator reports by default (`/v1/models`, `model` fields).
    pub model: String,
    /// Fixed latency of every request before the scheduler sees it (HTTP, tokenizer,
    /// IPC). It delays the first token but does not occupy the GPU.
    #[serde(default)]
    pub request_overhead_ms: f64,
    /// Fixed cost of one prefill batch (kernel launches, scheduling), GPU-bound.
    pub prefill_base_ms: f64,
    /// Prefill cost per uncached prompt token.
    pub t_p_ms_per_token: f64,
    /// Fixed cost of one decode step.
    pub decode_base_ms: f64,
    /// Decode step cost per running sequence.
    pub per_seq_ms: f64,
    /// Most sequences `per_seq_ms` is charged for (none: every one). A mixture-of-experts
    /// model reads more experts as the batch grows until it reads all of them; past
    /// that batch more sequences add no weight reads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_seq_batch_cap: Option<u32>,
    /// Decode step cost per context token summed over the batch (attention reads).
    pub per_ctx_token_ms: f64,
    /// KV cache capacity in tokens (SGLang's `max_total_num_tokens`).
    pub max_total_tokens: u64,
    /// Most new prompt tokens in one prefill batch (SGLang's `chunked_prefill_size`).
    pub chunked_prefill_size: u64,
    /// Most requests running (prefilling or decoding) at once.
    pub max_running_requests: u32,
    /// Longest prompt + output a request may ask for.
    pub context_length: u64,
    /// Which iteration runs when both prefill and decode work are pending.
    #[serde(default)]
    pub schedule: Schedule,
}

/// What a scheduler runs when it could run either a prefill batch or a decode step.
///
/// The choice decides how long running requests wait while prompts keep arriving,
/// so it shapes E2E under load: serving stacks differ here, and a profile says which
/// one it stands for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Schedule {
    /// A prefill batch and a decode step take turns (decode steps between the chunks
    /// of a long prefill, as with vLLM's chunked prefill or SGLang's mixed chunks).
    #[default]
    Alternate,
    /// A prefill batch whenever one can be formed; decode only when no waiting request
    /// can be admitted (SGLang's default scheduler, without `--enable-mixed-chunk`).
    PrefillFirst,
}

impl Profile {
    /// Names of the built-in profiles.
    pub fn built_in_names() -> Vec<&'static str> {
        BUILT_IN.iter().map(|(n, _)| *n).collect()
    }

    /// A built-in profile by name (`paper-a100-mistral7b`, `h200-mistral7b`,
    /// `h200-dense-1.5b`, `paper-l40s-qwen35b-a3b`).
    pub fn by_name(name: &str) -> Result<Profile, EngineError> {
        let (_, text) = BUILT_IN.iter().find(|(n, _)| *n == name).ok_or_else(|| {
            EngineError::UnknownProfile {
                name: name.to_owned(),
                known: Self::built_in_names().join(", "),
            }
        })?;
        Self::from_toml_str(text, name)
    }

    /// Load a custom profile from a TOML file, read with a cap
    /// ([`gorgo_files::MAX_CONFIG_FILE_BYTES`]: `/dev/zero` is refused, not read).
    pub fn from_file(path: impl AsRef<std::path::Path>) -> Result<Profile, EngineError> {
        let path = path.as_ref();
        let text = gorgo_files::read_capped(path, gorgo_files::MAX_CONFIG_FILE_BYTES).map_err(
            |source| EngineError::ReadProfile {
                path: path.display().to_string(),
                source,
            },
        )?;
        Self::from_toml_str(&text, &path.display().to_string())
    }

    /// A built-in name if there is one with that name, else a file path.
    pub fn by_name_or_file(name_or_path: &str) -> Result<Profile, EngineError> {
        if BUILT_IN.iter().any(|(n, _)| *n == name_or_path) {
            Self::by_name(name_or_path)
        } else if std::path::Path::new(name_or_path).exists() {
            Self::from_file(name_or_path)
        } else {
            Self::by_name(name_or_path)
        }
    }

    /// Parse and validate profile TOML; `source_name` goes into error messages.
    pub fn from_toml_str(text: &str, source_name: &str) -> Result<Profile, EngineError> {
        let profile: Profile = toml::from_str(text).map_err(|e| EngineError::InvalidProfile {
            source_name: source_name.to_owned(),
            message: e.to_string(),
        })?;
        profile
            .validate()
            .map_err(|message| EngineError::InvalidProfile {
                source_name: source_name.to_owned(),
                message,
            })?;
        Ok(profile)
    }

    /// Check value ranges; the error names the field.
    ///
    /// Times are bounded far above any real engine's ([`MAX_FIXED_MS`] for a fixed
    /// cost, [`MAX_UNIT_MS`] for a cost per token or sequence): the simulator adds
    /// them to virtual time in f64 ms, and a cost of `1e300` left it ticking at one
    /// instant for ever. `t_p_ms_per_token` must be positive: it seeds each node's
    /// prefill fit, which has no zero slope.
    pub fn validate(&self) -> Result<(), String> {
        // (field, value, most, whether 0 is refused)
        let times = [
            (
                "request_overhead_ms",
                self.request_overhead_ms,
                MAX_FIXED_MS,
                false,
            ),
            ("prefill_base_ms", self.prefill_base_ms, MAX_FIXED_MS, false),
            ("decode_base_ms", self.decode_base_ms, MAX_FIXED_MS, false),
            ("t_p_ms_per_token", self.t_p_ms_per_token, MAX_UNIT_MS, true),
            ("per_seq_ms", self.per_seq_ms, MAX_UNIT_MS, false),
            (
                "per_ctx_token_ms",
                self.per_ctx_token_ms,
                MAX_UNIT_MS,
                false,
            ),
        ];
        for (field, v, max, positive) in times {
            let low_ok = if positive { v > 0.0 } else { v >= 0.0 };
            if !(v.is_finite() && low_ok && v <= max) {
                let low = if positive { "(0" } else { "[0" };
                return Err(format!(
                    "field `{field}` must be a number in {low}, {max}] ms"
                ));
            }
        }
        if self.decode_base_ms + self.per_seq_ms <= 0.0 {
            return Err("fields `decode_base_ms` and `per_seq_ms` cannot both be 0".into());
        }
        let positive = [
            ("max_total_tokens", self.max_total_tokens),
            ("chunked_prefill_size", self.chunked_prefill_size),
            ("max_running_requests", self.max_running_requests as u64),
            ("context_length", self.context_length),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(format!("field `{field}` must be > 0"));
            }
        }
        if self.per_seq_batch_cap == Some(0) {
            return Err("field `per_seq_batch_cap` must be > 0 (leave it out for no cap)".into());
        }
        if self.name.is_empty() {
            return Err("field `name` must not be empty".into());
        }
        Ok(())
    }

    /// Why an engine of this profile refuses a request of `prompt_tokens` and
    /// `output_tokens` whatever its state (`None`: it can serve it): over the context
    /// length, or more than the KV cache could ever hold. One check for the engine's
    /// admission and for what the simulator's latency floor counts, so the floor covers
    /// exactly the requests an engine can serve.
    pub fn refusal(&self, prompt_tokens: u64, output_tokens: u64) -> Option<RejectReason> {
        let requested = prompt_tokens + output_tokens;
        if requested > self.context_length {
            Some(RejectReason::ContextLength {
                requested,
                limit: self.context_length,
            })
        } else if requested >= self.max_total_tokens {
            // `>=`: a fully cached prompt recomputes one token, which needs one more.
            Some(RejectReason::OverCapacity {
                requested,
                capacity: self.max_total_tokens,
            })
        } else {
            None
        }
    }

    /// Engine-side TTFT of a lone request with `uncached` new tokens on an idle engine.
    pub fn idle_ttft_ms(&self, uncached: u64) -> f64 {
        let chunks = uncached.max(1).div_ceil(self.chunked_prefill_size);
        self.request_overhead_ms
            + chunks as f64 * self.prefill_base_ms
            + self.t_p_ms_per_token * uncached as f64
    }

    /// Cost of one decode step over `batch` sequences holding `context_tokens` in all.
    pub fn decode_step_ms(&self, batch: usize, context_tokens: u64) -> f64 {
        let charged = match self.per_seq_batch_cap {
            Some(cap) => batch.min(cap as usize),
            None => batch,
        };
        self.decode_base_ms
            + self.per_seq_ms * charged as f64
            + self.per_ctx_token_ms * context_tokens as f64
    }

    /// Cost of one prefill batch of `tokens` new tokens.
    pub fn prefill_batch_ms(&self, tokens: u64) -> f64 {
        self.prefill_base_ms + self.t_p_ms_per_token * tokens as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_built_in_profile_loads() {
        for name in Profile::built_in_names() {
            let p = Profile::by_name(name).unwrap();
            assert_eq!(p.name, name);
        }
    }

    #[test]
    fn unknown_name_lists_the_known_ones() {
        let e = Profile::by_name("nope").unwrap_err().to_string();
        assert!(e.contains("paper-a100-mistral7b"), "{e}");
    }

    /// A profile file is read with a cap: one byte over it, or `/dev/zero` (which
    /// says it is empty), is refused naming the file and the cap, never read whole.
    #[test]
    fn a_profile_file_over_the_cap_is_refused() {
        let cap = gorgo_files::MAX_CONFIG_FILE_BYTES;
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big.toml");
        std::fs::File::create(&big)
            .unwrap()
            .set_len(cap + 1)
            .unwrap();
        let zero = std::path::Path::new("/dev/zero");
        for path in [big.as_path(), zero].into_iter().filter(|p| p.exists()) {
            let e = Profile::from_file(path).unwrap_err();
            let read = matches!(e, EngineError::ReadProfile { .. });
            let e = e.to_string();
            // Read whole, the file's NULs would fill the message.
            let e: String = e.chars().take(300).collect();
            assert!(read, "{e}");
            assert!(
                e.contains(&path.display().to_string())
                    && e.contains(&format!("larger than {cap} bytes")),
                "{e}"
            );
        }
    }

    #[test]
    fn unknown_field_is_named() {
        let mut text = include_str!("../../../configs/engines/h200-mistral7b.toml").to_owned();
        text.push_str("\nt_p_ms_per_tokn = 1.0\n");
        let e = Profile::from_toml_str(&text, "x").unwrap_err().to_string();
        assert!(e.contains("t_p_ms_per_tokn"), "{e}");
    }

    #[test]
    fn per_seq_cost_stops_at_the_batch_cap() {
        let mut p = Profile::by_name("h200-mistral7b").unwrap();
        p.per_ctx_token_ms = 0.0;
        p.per_seq_ms = 1.0;
        p.decode_base_ms = 2.0;
        assert_eq!(p.decode_step_ms(10, 0), 12.0);
        p.per_seq_batch_cap = Some(4);
        assert_eq!(p.decode_step_ms(3, 0), 5.0);
        assert_eq!(p.decode_step_ms(10, 0), 6.0);
        let text = include_str!("../../../configs/engines/h200-mistral7b.toml").to_owned()
            + "\nper_seq_batch_cap = 0\n";
        let e = Profile::from_toml_str(&text, "x").unwrap_err().to_string();
        assert!(e.contains("per_seq_batch_cap"), "{e}");
    }

    #[test]
    fn schedule_defaults_to_alternate_and_a_bad_one_is_named() {
        let text = include_str!("../../../configs/engines/h200-mistral7b.toml");
        assert_eq!(
            Profile::from_toml_str(text, "x").unwrap().schedule,
            Schedule::Alternate
        );
        let first = format!("{text}\nschedule = \"prefill-first\"\n");
        assert_eq!(
            Profile::from_toml_str(&first, "x").unwrap().schedule,
            Schedule::PrefillFirst
        );
        let bad = format!("{text}\nschedule = \"fifo\"\n");
        let e = Profile::from_toml_str(&bad, "x").unwrap_err().to_string();
        assert!(e.contains("schedule") && e.contains("prefill-first"), "{e}");
    }

    /// Times past what any engine takes are refused naming the field (a cost of
    /// `1e300` hung the simulator), and so is a zero prefill slope, which the nodes'
    /// fit refused later under the node setting's name (`engine.t_p_ms`).
    #[test]
    fn huge_times_and_a_zero_prefill_slope_are_refused_naming_the_field() {
        let text = include_str!("../../../configs/engines/paper-a100-mistral7b.toml");
        for (line, value, field) in [
            ("t_p_ms_per_token = 0.0938", "1e300", "t_p_ms_per_token"),
            ("t_p_ms_per_token = 0.0938", "1001", "t_p_ms_per_token"),
            ("t_p_ms_per_token = 0.0938", "0", "t_p_ms_per_token"),
            ("prefill_base_ms = 20.0", "1e300", "prefill_base_ms"),
            (
                "request_overhead_ms = 130.72",
                "60001",
                "request_overhead_ms",
            ),
            ("decode_base_ms = 10.36", "1e12", "decode_base_ms"),
            ("per_seq_ms = 0.037", "1e300", "per_seq_ms"),
            ("per_ctx_token_ms = 0.0000936", "1e300", "per_ctx_token_ms"),
        ] {
            assert!(text.contains(line), "{line}");
            let key = line.split(" = ").next().unwrap();
            let bad = text.replace(line, &format!("{key} = {value}"));
            let e = Profile::from_toml_str(&bad, "p.toml")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("p.toml") && e.contains(field),
                "{key} = {value}: {e}"
            );
            assert!(e.len() < 200, "{e}");
        }
        // At the bounds: accepted.
        let edge = text
            .replace("t_p_ms_per_token = 0.0938", "t_p_ms_per_token = 1000")
            .replace("prefill_base_ms = 20.0", "prefill_base_ms = 60000");
        Profile::from_toml_str(&edge, "p.toml").unwrap();
    }

    #[test]
    fn bad_value_is_named() {
        let text = include_str!("../../../configs/engines/h200-mistral7b.toml")
            .replace("max_running_requests = ", "max_running_requests = 0 #");
        let e = Profile::from_toml_str(&text, "x").unwrap_err().to_string();
        assert!(e.contains("max_running_requests"), "{e}");
    }
}
