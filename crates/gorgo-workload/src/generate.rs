//! The session-based synthetic workload generator (`gorgo trace generate`).
//!
//! Users hold multi-turn conversations whose context grows turn by turn; each user has
//! a system prompt of their own (reused by all their conversations, which is where
//! almost all of ART-Chat-2.5M's block reuse comes from) and some share a short
//! application prompt with other users (its 0.3% cross-user reuse). Every user lives in
//! a home region; regions have skewed sizes and a diurnal swing in local time. Defaults
//! reproduce ART-Chat-2.5M's published per-30-minute-window statistics (see
//! docs/workloads.md for the target vs generated table).
//!
//! Block ids model content exactly: a conversation is a token stream made of segments
//! (application prompt, system prompt, user messages, answers), and block `i`'s id is a
//! chained hash of the segment pieces it covers. Two streams share a block id exactly
//! when they share the content up to the block's end, and a partial last block gets a
//! different id once the conversation extends it, as in Mooncake's traces.

use gorgo_core::hash::hash_bytes;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, LogNormal, Poisson};
use serde::{Deserialize, Serialize};

use crate::record::{BlockIds, TraceRequest};
use crate::{Result, WorkloadError};

/// Parameters of the generator. Defaults match ART-Chat-2.5M's 30-minute windows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GeneratorConfig {
    /// Seed of the ChaCha8 stream: same config and seed, same trace.
    pub seed: u64,
    /// Length of the generated window, seconds.
    pub duration_s: f64,
    /// Distinct users active in the window.
    pub users: u32,
    /// Home regions users are spread over.
    pub regions: Vec<String>,
    /// Relative share of users per region (regional skew); same length as `regions`.
    pub region_weights: Vec<f64>,
    /// Each region's UTC offset in hours, for its diurnal phase; same length as `regions`.
    pub region_utc_offsets_h: Vec<f64>,
    /// Time of day (UTC hours) at the window's start.
    pub start_hour_utc: f64,
    /// Diurnal swing of a region's request rate: `1 + a cos(2 pi (local - peak) / 24h)`.
    pub diurnal_amplitude: f64,
    /// Local hour of the daily peak.
    pub diurnal_peak_hour: f64,
    /// Mean requests per user per 30 minutes over the window; the diurnal swing moves
    /// requests between regions and over time, not the window's total.
    pub requests_per_user: f64,
    /// Log-normal sigma of per-user activity (how unequal users are).
    pub activity_sigma: f64,
    /// Share of conversations that have a single turn.
    pub single_turn_sessions: f64,
    /// Mean turns of a multi-turn conversation (at least 2).
    pub multi_turn_mean_turns: f64,
    /// Median seconds between the end of one turn and the next message.
    pub think_time_median_s: f64,
    /// Log-normal sigma of the think time.
    pub think_time_sigma: f64,
    /// Median tokens of a user's own system prompt.
    pub system_prompt_median_tokens: f64,
    /// Log-normal sigma of the system prompt length.
    pub system_prompt_sigma: f64,
    /// Number of application prompts shared across users.
    pub shared_prompts: u32,
    /// Tokens of each shared application prompt.
    pub shared_prompt_tokens: u64,
    /// Share of users whose context starts with a shared application prompt.
    pub shared_prompt_users: f64,
    /// Median tokens of a conversation's first message.
    pub first_message_median_tokens: f64,
    /// Log-normal sigma of the first message's length (pasted documents make it wide).
    pub first_message_sigma: f64,
    /// Median tokens of a follow-up message.
    pub followup_message_median_tokens: f64,
    /// Log-normal sigma of a follow-up message's length.
    pub followup_message_sigma: f64,
    /// Output tokens of every request (ART-Chat's `max_tokens`).
    pub output_tokens: u32,
    /// Median tokens of the assistant answer carried into the next turn's context (the
    /// recorded conversation's answer, not capped by the replay's `max_tokens`).
    pub answer_context_median_tokens: f64,
    /// Log-normal sigma of that answer length.
    pub answer_context_sigma: f64,
    /// Tokens per block of the generated ids.
    pub tokens_per_block: u32,
    /// A conversation stops before its context would exceed this.
    pub max_input_tokens: u64,
}

impl Default for GeneratorConfig {
    fn default() -> Self {
        GeneratorConfig {
            seed: 0,
            duration_s: 1800.0,
            users: 575,
            regions: vec![
                "us-ashburn".into(),
                "eu-frankfurt".into(),
                "ap-seoul".into(),
            ],
            region_weights: vec![0.45, 0.35, 0.2],
            region_utc_offsets_h: vec![-5.0, 1.0, 9.0],
            start_hour_utc: 15.0,
            diurnal_amplitude: 0.5,
            diurnal_peak_hour: 14.0,
            requests_per_user: 15.3,
            activity_sigma: 0.3,
            single_turn_sessions: 0.58,
            multi_turn_mean_turns: 4.0,
            think_time_median_s: 25.0,
            think_time_sigma: 0.8,
            system_prompt_median_tokens: 3300.0,
            system_prompt_sigma: 1.0,
            shared_prompts: 8,
            shared_prompt_tokens: 512,
            shared_prompt_users: 0.6,
            first_message_median_tokens: 600.0,
            first_message_sigma: 1.0,
            followup_message_median_tokens: 250.0,
            followup_message_sigma: 1.0,
            output_tokens: 128,
            answer_context_median_tokens: 128.0,
            answer_context_sigma: 0.0,
            tokens_per_block: 256,
            max_input_tokens: 131_072,
        }
    }
}

/// Most requests a generated trace may hold: the generator keeps the whole trace in
/// memory (about 600 bytes a request, so some 6 GB here) to sort it by arrival, and
/// [`GeneratorConfig::validate`] refuses a configuration whose expected count
/// (`users x requests_per_user x duration_s / 1800 s`), or whose user count, is above
/// it. Ten million is four times ART-Chat-2.5M.
pub const MAX_GENERATED_REQUESTS: u64 = 10_000_000;

/// Session starts the generator may draw before it gives up (a diurnal trough with
/// `diurnal_amplitude` near 1 thins nearly every draw away): a bound on its time.
const MAX_SESSION_DRAWS: u64 = 16 * MAX_GENERATED_REQUESTS;

/// Default regional weights for `n` regions that are not the default three: Zipf-like.
pub fn zipf_weights(n: usize) -> Vec<f64> {
    (0..n).map(|i| 1.0 / (i + 1) as f64).collect()
}

impl GeneratorConfig {
    /// Parse a TOML parameter file (any subset of the fields; unknown fields are an
    /// error naming them), then validate it.
    pub fn from_toml_str(text: &str) -> Result<Self> {
        let cfg: GeneratorConfig =
            toml::from_str(text).map_err(|e| WorkloadError::ConfigFile(e.to_string()))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Check every parameter, naming the first bad one.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, reason: &str| {
            Err(WorkloadError::InvalidConfig {
                field,
                reason: reason.to_owned(),
            })
        };
        // Token medians: positive, and at most what a trace row holds of input
        // (`read::MAX_INPUT_TOKENS`), or the generator writes rows its own reader refuses.
        let token_medians = [
            (
                "system_prompt_median_tokens",
                self.system_prompt_median_tokens,
            ),
            (
                "first_message_median_tokens",
                self.first_message_median_tokens,
            ),
            (
                "followup_message_median_tokens",
                self.followup_message_median_tokens,
            ),
            (
                "answer_context_median_tokens",
                self.answer_context_median_tokens,
            ),
        ];
        let positive = [
            ("duration_s", self.duration_s),
            ("requests_per_user", self.requests_per_user),
            ("multi_turn_mean_turns", self.multi_turn_mean_turns),
            ("think_time_median_s", self.think_time_median_s),
        ];
        for (field, v) in positive.into_iter().chain(token_medians) {
            if !(v.is_finite() && v > 0.0) {
                return bad(field, "must be a positive number");
            }
        }
        let limit = crate::read::MAX_INPUT_TOKENS;
        for (field, v) in token_medians {
            if v > limit as f64 {
                return bad(field, &format!("at most {limit} tokens"));
            }
        }
        let sigmas = [
            ("activity_sigma", self.activity_sigma),
            ("think_time_sigma", self.think_time_sigma),
            ("system_prompt_sigma", self.system_prompt_sigma),
            ("first_message_sigma", self.first_message_sigma),
            ("followup_message_sigma", self.followup_message_sigma),
            ("answer_context_sigma", self.answer_context_sigma),
        ];
        for (field, v) in sigmas {
            if !(v.is_finite() && (0.0..=5.0).contains(&v)) {
                return bad(field, "must be in [0, 5]");
            }
        }
        for (field, v) in [
            ("single_turn_sessions", self.single_turn_sessions),
            ("shared_prompt_users", self.shared_prompt_users),
            ("diurnal_amplitude", self.diurnal_amplitude),
        ] {
            if !(v.is_finite() && (0.0..=1.0).contains(&v)) {
                return bad(field, "must be in [0, 1]");
            }
        }
        if self.duration_s > 30.0 * 86_400.0 {
            return bad("duration_s", "at most 30 days");
        }
        if self.multi_turn_mean_turns < 2.0 {
            return bad("multi_turn_mean_turns", "must be at least 2");
        }
        if self.users == 0 {
            return bad("users", "must be at least 1");
        }
        // Every user sends at least one request; the trace is held whole in memory.
        if u64::from(self.users) > MAX_GENERATED_REQUESTS {
            return bad(
                "users",
                &format!("at most {MAX_GENERATED_REQUESTS} (each user sends a request)"),
            );
        }
        let expected = f64::from(self.users) * self.requests_per_user * self.duration_s / 1800.0;
        if expected > MAX_GENERATED_REQUESTS as f64 {
            return bad(
                "requests_per_user",
                &format!(
                    "users x requests_per_user x duration_s / 1800 s is {expected:.3e} \
                     requests, over the {MAX_GENERATED_REQUESTS} a generated trace may hold"
                ),
            );
        }
        if self.regions.is_empty() {
            return bad("regions", "needs at least one region");
        }
        // Every row carries its region as `home_region`: an empty name (`--regions ''`)
        // or one with surrounding blanks (`--regions 'a, b'`) is no topology's region,
        // and a control character no header or table can show.
        if let Some(r) = self.regions.iter().find(|r| {
            r.trim().is_empty() || r.trim() != r.as_str() || r.chars().any(char::is_control)
        }) {
            return bad(
                "regions",
                &format!(
                    "{r:?} is no region name (empty, or with surrounding blanks or control \
                     characters)"
                ),
            );
        }
        // A region twice would be two regions of one name to the replay and the
        // simulator, which key everything by name.
        if let Some((i, _)) = self
            .regions
            .iter()
            .enumerate()
            .find(|(i, r)| self.regions[..*i].contains(r))
        {
            return bad("regions", &format!("`{}` is listed twice", self.regions[i]));
        }
        if self.region_weights.len() != self.regions.len()
            || self
                .region_weights
                .iter()
                .any(|w| !(w.is_finite() && *w >= 0.0))
            || self.region_weights.iter().sum::<f64>() <= 0.0
        {
            return bad(
                "region_weights",
                "one non-negative weight per region, not all zero",
            );
        }
        if self.region_utc_offsets_h.len() != self.regions.len()
            || self.region_utc_offsets_h.iter().any(|o| !o.is_finite())
        {
            return bad("region_utc_offsets_h", "one finite offset per region");
        }
        if !self.start_hour_utc.is_finite() {
            return bad("start_hour_utc", "must be finite");
        }
        if !self.diurnal_peak_hour.is_finite() {
            return bad("diurnal_peak_hour", "must be finite");
        }
        if self.shared_prompt_users > 0.0 && self.shared_prompts == 0 {
            return bad(
                "shared_prompts",
                "must be at least 1 when shared_prompt_users > 0",
            );
        }
        if self.tokens_per_block == 0 {
            return bad("tokens_per_block", "must be positive");
        }
        if self.max_input_tokens == 0 || self.max_input_tokens > limit {
            return bad("max_input_tokens", &format!("must be in [1, {limit}]"));
        }
        if u64::from(self.tokens_per_block) > limit {
            return bad("tokens_per_block", &format!("at most {limit}"));
        }
        Ok(())
    }

    /// Rate multiplier of `region` at `t_s` seconds into the window.
    fn diurnal(&self, region: usize, t_s: f64) -> f64 {
        let local = self.start_hour_utc + t_s / 3600.0 + self.region_utc_offsets_h[region];
        let phase = 2.0 * std::f64::consts::PI * (local - self.diurnal_peak_hour) / 24.0;
        1.0 + self.diurnal_amplitude * phase.cos()
    }

    /// Mean of [`Self::diurnal`] over the window, numerically.
    fn mean_diurnal(&self, region: usize) -> f64 {
        const STEPS: usize = 256;
        let dt = self.duration_s / STEPS as f64;
        (0..STEPS)
            .map(|i| self.diurnal(region, (i as f64 + 0.5) * dt))
            .sum::<f64>()
            / STEPS as f64
    }
}

/// One stretch of a conversation's token stream with a single content identity.
#[derive(Clone, Copy)]
struct Segment {
    id: u64,
    tokens: u64,
}

/// Only 53 bits of each id, so that every JSON reader (JavaScript, Python floats) keeps
/// them exact.
const ID_MASK: u64 = (1 << 53) - 1;

/// Block ids of the first `total` tokens of `segments`: block `i`'s id hashes block
/// `i - 1`'s id with the (segment, start, end) pieces block `i` covers.
fn block_ids(segments: &[Segment], total: u64, tokens_per_block: u64) -> Vec<u64> {
    let mut ids = Vec::with_capacity(total.div_ceil(tokens_per_block) as usize);
    let mut prev = 0u64;
    let mut key: Vec<u8> = Vec::with_capacity(64);
    let mut seg = 0usize;
    let mut seg_start = 0u64; // stream offset of segments[seg]
    let mut pos = 0u64;
    while pos < total {
        let end = (pos + tokens_per_block).min(total);
        key.clear();
        key.extend_from_slice(&prev.to_le_bytes());
        let mut p = pos;
        while p < end {
            while seg_start + segments[seg].tokens <= p {
                seg_start += segments[seg].tokens;
                seg += 1;
            }
            let s = segments[seg];
            let piece_end = end.min(seg_start + s.tokens);
            key.extend_from_slice(&s.id.to_le_bytes());
            key.extend_from_slice(&(p - seg_start).to_le_bytes());
            key.extend_from_slice(&(piece_end - seg_start).to_le_bytes());
            p = piece_end;
        }
        prev = hash_bytes(&key) & ID_MASK;
        ids.push(prev);
        pos = end;
    }
    ids
}

/// Generate a trace, sorted by arrival time, with request ids `r<index>`.
pub fn generate(config: &GeneratorConfig) -> Result<Vec<TraceRequest>> {
    config.validate()?;
    let c = config;
    let mut rng = ChaCha8Rng::seed_from_u64(c.seed);
    let lognormal = |median: f64, sigma: f64| {
        LogNormal::new(median.ln(), sigma).map_err(|e| WorkloadError::InvalidConfig {
            field: "sigma",
            reason: e.to_string(),
        })
    };
    let think = lognormal(c.think_time_median_s, c.think_time_sigma)?;
    let first_len = lognormal(c.first_message_median_tokens, c.first_message_sigma)?;
    let followup_len = lognormal(c.followup_message_median_tokens, c.followup_message_sigma)?;
    let answer_len = lognormal(c.answer_context_median_tokens, c.answer_context_sigma)?;

    let weight_sum: f64 = c.region_weights.iter().sum();
    // The user-weighted mean rate multiplier over the window: dividing by it keeps the
    // window's expected total at `requests_per_user` while regions awake in the window
    // get more of it than regions asleep.
    let mean_diurnal = (0..c.regions.len())
        .map(|r| c.region_weights[r] * c.mean_diurnal(r))
        .sum::<f64>()
        / weight_sum;
    let mean_turns =
        c.single_turn_sessions + (1.0 - c.single_turn_sessions) * c.multi_turn_mean_turns;
    // Sessions per user per second at diurnal factor 1.
    let base_session_rate = c.requests_per_user / 1800.0 / mean_turns;
    let extra_turns_p = 1.0 / (c.multi_turn_mean_turns - 1.0); // geometric on {2, 3, ...}
    let tpb = c.tokens_per_block as u64;

    let mut next_segment_id = c.shared_prompts as u64 + 1;
    let mut fresh = || {
        next_segment_id += 1;
        next_segment_id
    };
    let mut out = Vec::new();
    let mut drawn = 0u64;
    // Per-user traits are stratified (one draw per 1/users quantile slice, in random
    // order): with a few hundred users, independent draws would let a handful of heavy
    // users move the window's p95 by 10% from seed to seed.
    let activity_z = stratified_normals(c.users as usize, &mut rng);
    let system_z = stratified_normals(c.users as usize, &mut rng);
    for user in 0..c.users {
        // Home region by regional weight.
        let mut pick = rng.random::<f64>() * weight_sum;
        let mut region = c.regions.len() - 1;
        for (i, w) in c.region_weights.iter().enumerate() {
            if pick < *w {
                region = i;
                break;
            }
            pick -= w;
        }
        let z = activity_z[user as usize];
        let activity = (c.activity_sigma * z - c.activity_sigma * c.activity_sigma / 2.0).exp();
        // Session starts: a Poisson process thinned by the region's diurnal curve.
        let peak = 1.0 + c.diurnal_amplitude;
        let rate_max = base_session_rate * activity * peak / mean_diurnal;
        let expected = rate_max * c.duration_s;
        // A mean the sampler refuses is an error, not no session: it was taken as 0,
        // and `requests_per_user = 1e100` wrote one request.
        let candidates = if expected > 0.0 {
            Poisson::new(expected)
                .map_err(|e| WorkloadError::InvalidConfig {
                    field: "requests_per_user",
                    reason: format!("{expected:.3e} session starts for one user: {e}"),
                })?
                .sample(&mut rng) as u64
        } else {
            0
        };
        drawn = drawn.saturating_add(candidates);
        if drawn > MAX_SESSION_DRAWS {
            return Err(WorkloadError::InvalidConfig {
                field: "diurnal_amplitude",
                reason: format!(
                    "more than {MAX_SESSION_DRAWS} session starts drawn (the window sits \
                     in a diurnal trough that thins nearly all of them away)"
                ),
            });
        }
        let mut starts = Vec::new();
        for _ in 0..candidates {
            let t = rng.random::<f64>() * c.duration_s;
            if rng.random::<f64>() < c.diurnal(region, t) / peak {
                starts.push(t);
            }
        }
        if starts.is_empty() {
            // Every configured user is active in the window.
            starts.push(rng.random::<f64>() * c.duration_s);
        }
        starts.sort_by(f64::total_cmp);

        let user_name = format!("u{user:05}");
        let mut prefix = Vec::new();
        if rng.random::<f64>() < c.shared_prompt_users {
            let app = rng.random_range(0..c.shared_prompts) as u64 + 1;
            prefix.push(Segment {
                id: app,
                tokens: c.shared_prompt_tokens,
            });
        }
        let own = (c.system_prompt_median_tokens
            * (c.system_prompt_sigma * system_z[user as usize]).exp()) as u64;
        let own = own.max(1);
        prefix.push(Segment {
            id: fresh(),
            tokens: own,
        });
        let system_hash = format!(
            "{:016x}",
            hash_bytes(&prefix[prefix.len() - 1].id.to_le_bytes())
        );

        for (s, start) in starts.into_iter().enumerate() {
            let turns = if rng.random::<f64>() < c.single_turn_sessions {
                1
            } else {
                let mut t = 2u32;
                while rng.random::<f64>() >= extra_turns_p && t < 1000 {
                    t += 1;
                }
                t
            };
            let mut segments = prefix.clone();
            let mut t_s = start;
            for turn in 0..turns {
                let msg_len = if turn == 0 { &first_len } else { &followup_len };
                let msg = (msg_len.sample(&mut rng) as u64).max(1);
                segments.push(Segment {
                    id: fresh(),
                    tokens: msg,
                });
                // Saturating: a segment's sampled length is a float cast, which a
                // long lognormal tail takes to u64::MAX.
                let input: u64 = segments
                    .iter()
                    .fold(0u64, |sum, s| sum.saturating_add(s.tokens));
                if t_s >= c.duration_s || input > c.max_input_tokens {
                    break;
                }
                // The expected count is bounded by `validate`; heavy-tailed activity
                // could still draw far more.
                if out.len() as u64 >= 2 * MAX_GENERATED_REQUESTS {
                    return Err(WorkloadError::InvalidConfig {
                        field: "activity_sigma",
                        reason: format!(
                            "the draws came to over {} requests, twice what a generated \
                             trace may hold",
                            2 * MAX_GENERATED_REQUESTS
                        ),
                    });
                }
                out.push(TraceRequest {
                    timestamp_ms: (t_s * 1000.0) as u64,
                    input_tokens: input,
                    output_tokens: c.output_tokens,
                    blocks: BlockIds::Int(block_ids(&segments, input, tpb)),
                    tokens_per_block: c.tokens_per_block,
                    user: Some(user_name.clone()),
                    session: Some(format!("{user_name}-s{s}")),
                    home_region: Some(c.regions[region].clone()),
                    request_id: None,
                    system_prompt_hash: Some(system_hash.clone()),
                });
                let answer = (answer_len.sample(&mut rng) as u64).max(1);
                segments.push(Segment {
                    id: fresh(),
                    tokens: answer,
                });
                // The answer streams for a while, then the user thinks and types.
                t_s += 2.0 + c.output_tokens as f64 * 0.03 + think.sample(&mut rng);
            }
        }
    }
    out.sort_by_key(|r| r.timestamp_ms);
    for (i, r) in out.iter_mut().enumerate() {
        r.request_id = Some(format!("r{i}"));
    }
    Ok(out)
}

/// `n` standard normal values, one from each of `n` equal-probability slices, shuffled.
fn stratified_normals(n: usize, rng: &mut ChaCha8Rng) -> Vec<f64> {
    let mut v: Vec<f64> = (0..n)
        .map(|i| inverse_normal_cdf((i as f64 + rng.random::<f64>()) / n as f64))
        .collect();
    v.shuffle(rng);
    v
}

/// The standard normal quantile function (Acklam's rational approximation, absolute
/// error about 1e-5 in the tails: plenty for sampling), clamped away from 0 and 1.
#[allow(clippy::excessive_precision)] // the published coefficients, verbatim
fn inverse_normal_cdf(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969683028665376e1,
        2.209460984245205e2,
        -2.759285104469687e2,
        1.383577518672690e2,
        -3.066479806614716e1,
        2.506628277459239,
    ];
    const B: [f64; 5] = [
        -5.447609879822406e1,
        1.615858368580409e2,
        -1.556989798598866e2,
        6.680131188771972e1,
        -1.328068155288572e1,
    ];
    const C: [f64; 6] = [
        -7.784894002430293e-3,
        -3.223964580411365e-1,
        -2.400758277161838,
        -2.549671010229708,
        4.374664141464968,
        2.938163982698783,
    ];
    const D: [f64; 4] = [
        7.784695709041462e-3,
        3.224671290700398e-1,
        2.445134137142996,
        3.754408661907416,
    ];
    let p = p.clamp(1e-12, 1.0 - 1e-12);
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.02425 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.02425 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inverse_normal_cdf_matches_known_quantiles() {
        assert!(inverse_normal_cdf(0.5).abs() < 1e-9);
        assert!((inverse_normal_cdf(0.975) - 1.959_964).abs() < 1e-4);
        assert!((inverse_normal_cdf(0.01) + 2.326_348).abs() < 1e-4);
        assert!((inverse_normal_cdf(0.9999) - 3.719_016).abs() < 1e-4);
    }

    #[test]
    fn block_ids_follow_content() {
        let a = [
            Segment { id: 1, tokens: 300 },
            Segment { id: 2, tokens: 100 },
        ];
        let b = [
            Segment { id: 1, tokens: 300 },
            Segment { id: 3, tokens: 500 },
        ];
        let ia = block_ids(&a, 400, 256);
        let ib = block_ids(&b, 800, 256);
        assert_eq!(ia.len(), 2);
        assert_eq!(ib.len(), 4);
        assert_eq!(ia[0], ib[0]);
        assert_ne!(ia[1], ib[1]);
        // Extending a partial last block changes its id; a prefix of it keeps earlier ones.
        let short = block_ids(&a, 300, 256);
        assert_eq!(short[0], ia[0]);
        assert_ne!(short[1], ia[1]);
    }

    /// A generator config that would write rows its own reader refuses (an input over
    /// the trace limit), sample from a median of zero, or name a region twice, is
    /// refused naming the field.
    #[test]
    fn configs_past_what_a_trace_row_holds_are_refused() {
        for (cfg, field) in [
            (
                GeneratorConfig {
                    answer_context_median_tokens: 0.0,
                    ..Default::default()
                },
                "answer_context_median_tokens",
            ),
            (
                GeneratorConfig {
                    max_input_tokens: 50_000_000,
                    ..Default::default()
                },
                "max_input_tokens",
            ),
            (
                GeneratorConfig {
                    system_prompt_median_tokens: 1e30,
                    ..Default::default()
                },
                "system_prompt_median_tokens",
            ),
            (
                GeneratorConfig {
                    tokens_per_block: u32::MAX,
                    ..Default::default()
                },
                "tokens_per_block",
            ),
            (
                GeneratorConfig {
                    regions: vec!["a".into(), "b".into(), "a".into()],
                    region_weights: vec![1.0; 3],
                    region_utc_offsets_h: vec![0.0; 3],
                    ..Default::default()
                },
                "`a` is listed twice",
            ),
        ] {
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains(field), "{field}: {e}");
        }
    }

    /// Every row carries its region as `home_region`: an empty name (`--regions ''`
    /// wrote `"home_region":""`), a blank one, one with surrounding blanks (`a, b`) or
    /// a control character is refused naming `regions`.
    #[test]
    fn region_names_that_name_no_region_are_refused() {
        for name in ["", "  ", " b", "b ", "a\tb", "a\u{7f}"] {
            let cfg = GeneratorConfig {
                regions: vec!["a".into(), name.into()],
                region_weights: vec![1.0; 2],
                region_utc_offsets_h: vec![0.0; 2],
                ..Default::default()
            };
            match cfg.validate() {
                Err(WorkloadError::InvalidConfig { field, reason }) => {
                    assert_eq!(field, "regions", "{name:?}");
                    assert!(reason.contains(&format!("{name:?}")), "{reason}");
                }
                other => panic!("{name:?}: {other:?}"),
            }
        }
        let cfg = GeneratorConfig {
            regions: vec!["a".into(), "us east 2".into()],
            region_weights: vec![1.0; 2],
            region_utc_offsets_h: vec![0.0; 2],
            ..Default::default()
        };
        cfg.validate().unwrap();
    }

    /// The trace is held in memory whole: a configuration asking for more than
    /// [`MAX_GENERATED_REQUESTS`] is refused before anything is drawn, naming the
    /// field (`users = 100000000` grew to 24 GB; `requests_per_user = 1e100` wrote one
    /// request, its session count having overflowed the sampler).
    #[test]
    fn request_counts_past_the_cap_are_refused_before_generating() {
        for (users, requests_per_user, field) in [
            (100_000_000, 0.001, "users"),
            (1, 1e9, "requests_per_user"),
            (1, 1e100, "requests_per_user"),
            (1, 1e300, "requests_per_user"),
            (10_000, 1001.0, "requests_per_user"),
        ] {
            let cfg = GeneratorConfig {
                users,
                requests_per_user,
                ..Default::default()
            };
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains(field), "{users} x {requests_per_user}: {e}");
            assert!(e.len() < 200, "a readable number: {e}");
            if users == 1 && requests_per_user > 1e99 {
                // Cheap either way: the sampler refused the mean, and one request came.
                assert!(generate(&cfg).is_err(), "{requests_per_user}");
            }
        }
        // At the cap: accepted.
        GeneratorConfig {
            users: 10_000,
            requests_per_user: 1000.0,
            ..Default::default()
        }
        .validate()
        .unwrap();
    }

    #[test]
    fn same_seed_same_trace_and_config_errors_name_the_field() {
        let cfg = GeneratorConfig {
            users: 20,
            duration_s: 300.0,
            ..Default::default()
        };
        assert_eq!(generate(&cfg).unwrap(), generate(&cfg).unwrap());
        let other = GeneratorConfig {
            seed: 1,
            ..cfg.clone()
        };
        assert_ne!(generate(&cfg).unwrap(), generate(&other).unwrap());
        let bad = GeneratorConfig {
            region_weights: vec![1.0],
            ..cfg
        };
        let err = generate(&bad).unwrap_err().to_string();
        assert!(err.contains("region_weights"), "{err}");
    }
}
