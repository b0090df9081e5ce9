//! `gorgo trace stats`: the shape of a trace, in the figures ART-Chat-2.5M publishes
//! per window, so a generated trace can be checked against them.

use std::collections::{HashMap, HashSet};

use gorgo_core::sketch::percentile;
use serde::{Deserialize, Serialize};

use crate::record::TraceRequest;

/// Nearest-rank percentiles and mean of a length distribution (tokens).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LengthSummary {
    /// Median.
    pub p50: f64,
    /// 95th percentile.
    pub p95: f64,
    /// Arithmetic mean.
    pub mean: f64,
}

impl LengthSummary {
    fn of(mut values: Vec<f64>) -> Self {
        if values.is_empty() {
            return LengthSummary::default();
        }
        values.sort_by(f64::total_cmp);
        LengthSummary {
            p50: percentile(&values, 50.0).unwrap_or(0.0),
            p95: percentile(&values, 95.0).unwrap_or(0.0),
            mean: values.iter().sum::<f64>() / values.len() as f64,
        }
    }
}

/// A trace's statistics; serialises to the JSON of `gorgo trace stats --json`
/// (docs/design.md, Interfaces). Fields that need block ids or user ids are `None` (JSON
/// `null`) when the trace lacks them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceStats {
    /// Number of requests.
    pub requests: u64,
    /// Last minus first arrival, seconds.
    pub span_s: f64,
    /// `requests / span_s` (0 for a zero span).
    pub rate_rps: f64,
    /// Prompt lengths.
    pub input_tokens: LengthSummary,
    /// Output lengths.
    pub output_tokens: LengthSummary,
    /// Fraction of all listed blocks already listed by an earlier request.
    pub block_reuse: Option<f64>,
    /// Fraction of all listed blocks already listed by an earlier request of the same
    /// user (`block_reuse - intra_user_reuse` is cross-user reuse).
    pub intra_user_reuse: Option<f64>,
    /// Distinct users.
    pub users: Option<u64>,
    /// `requests / users`.
    pub requests_per_user: Option<f64>,
    /// Share of requests that belong to a conversation of two or more turns (see
    /// [`StatsAccumulator`] for how conversations are found).
    pub multi_turn_share: Option<f64>,
}

/// Builds [`TraceStats`] one request at a time (memory grows with distinct blocks).
///
/// Conversations: rows with a `session` group by (user, session). Rows with a user and
/// no session are linked heuristically: a request continues an earlier request of the
/// same user when it contains that request's last or second-to-last block at position
/// 1 or later (ids are prefix-chained, so that means it extends that prompt beyond its
/// first block), and both then count as multi-turn.
#[derive(Debug, Default)]
pub struct StatsAccumulator {
    inputs: Vec<f64>,
    outputs: Vec<f64>,
    first_ms: Option<u64>,
    last_ms: u64,
    seen_blocks: HashSet<u64>,
    total_blocks: u64,
    reused_blocks: u64,
    users: HashMap<String, u32>,
    user_blocks: HashSet<(u32, u64)>,
    intra_reused_blocks: u64,
    requests_with_user: u64,
    sessions: HashMap<(u32, String), u64>,
    continuation_keys: HashMap<(u32, u64), usize>,
    inferred_multi: Vec<bool>,
}

impl StatsAccumulator {
    /// An empty accumulator.
    pub fn new() -> Self {
        Self::default()
    }

    /// Account for one request.
    pub fn push(&mut self, req: &TraceRequest) {
        self.inputs.push(req.input_tokens as f64);
        self.outputs.push(req.output_tokens as f64);
        self.first_ms = Some(
            self.first_ms
                .map_or(req.timestamp_ms, |f| f.min(req.timestamp_ms)),
        );
        self.last_ms = self.last_ms.max(req.timestamp_ms);

        let user = req.user.as_ref().map(|u| {
            let next = self.users.len() as u32;
            *self.users.entry(u.clone()).or_insert(next)
        });
        let n = req.blocks.len();
        for i in 0..n {
            let key = req.blocks.key(i);
            self.total_blocks += 1;
            if !self.seen_blocks.insert(key) {
                self.reused_blocks += 1;
            }
            if let Some(u) = user {
                if !self.user_blocks.insert((u, key)) {
                    self.intra_reused_blocks += 1;
                }
            }
        }
        let Some(u) = user else { return };
        self.requests_with_user += 1;
        if let Some(s) = &req.session {
            *self.sessions.entry((u, s.clone())).or_insert(0) += 1;
            return;
        }
        let index = self.inferred_multi.len();
        self.inferred_multi.push(false);
        let earlier =
            (1..n).find_map(|i| self.continuation_keys.get(&(u, req.blocks.key(i))).copied());
        if let Some(prev) = earlier {
            self.inferred_multi[prev] = true;
            self.inferred_multi[index] = true;
        }
        if n >= 2 {
            for i in [n - 2, n - 1] {
                self.continuation_keys.insert((u, req.blocks.key(i)), index);
            }
        }
    }

    /// The statistics of everything pushed.
    pub fn finish(self) -> TraceStats {
        let requests = self.inputs.len() as u64;
        let span_s = self
            .first_ms
            .map_or(0.0, |f| (self.last_ms - f) as f64 / 1000.0);
        let rate_rps = if span_s > 0.0 {
            requests as f64 / span_s
        } else {
            0.0
        };
        let has_blocks = self.total_blocks > 0;
        let has_users = self.requests_with_user > 0;
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let multi = self.sessions.values().filter(|&&c| c >= 2).sum::<u64>()
            + self.inferred_multi.iter().filter(|&&m| m).count() as u64;
        TraceStats {
            requests,
            span_s,
            rate_rps,
            input_tokens: LengthSummary::of(self.inputs),
            output_tokens: LengthSummary::of(self.outputs),
            block_reuse: has_blocks.then(|| ratio(self.reused_blocks, self.total_blocks)),
            intra_user_reuse: (has_blocks && has_users)
                .then(|| ratio(self.intra_reused_blocks, self.total_blocks)),
            users: has_users.then_some(self.users.len() as u64),
            requests_per_user: has_users
                .then(|| ratio(self.requests_with_user, self.users.len() as u64)),
            multi_turn_share: has_users.then(|| ratio(multi, self.requests_with_user)),
        }
    }
}

impl TraceStats {
    /// Statistics of a sequence of requests.
    pub fn from_requests<'a>(requests: impl IntoIterator<Item = &'a TraceRequest>) -> Self {
        let mut acc = StatsAccumulator::new();
        for r in requests {
            acc.push(r);
        }
        acc.finish()
    }

    /// A human-readable multi-line rendering (what `gorgo trace stats` prints).
    pub fn render(&self) -> String {
        let pct = |v: Option<f64>| v.map_or("n/a".to_owned(), |v| format!("{:.1}%", v * 100.0));
        let opt = |v: Option<f64>, d: usize| v.map_or("n/a".to_owned(), |v| format!("{v:.d$}"));
        let cross = match (self.block_reuse, self.intra_user_reuse) {
            (Some(a), Some(b)) => Some(a - b),
            _ => None,
        };
        format!(
            "requests           {}\n\
             span               {:.1} s\n\
             rate               {:.2} req/s\n\
             input tokens       p50 {:.0}  p95 {:.0}  mean {:.0}\n\
             output tokens      p50 {:.0}  p95 {:.0}  mean {:.0}\n\
             block reuse        {}\n\
             intra-user reuse   {}\n\
             cross-user reuse   {}\n\
             users              {}\n\
             requests per user  {}\n\
             multi-turn share   {}\n",
            self.requests,
            self.span_s,
            self.rate_rps,
            self.input_tokens.p50,
            self.input_tokens.p95,
            self.input_tokens.mean,
            self.output_tokens.p50,
            self.output_tokens.p95,
            self.output_tokens.mean,
            pct(self.block_reuse),
            pct(self.intra_user_reuse),
            pct(cross),
            self.users.map_or("n/a".to_owned(), |u| u.to_string()),
            opt(self.requests_per_user, 1),
            pct(self.multi_turn_share),
        )
    }
}
