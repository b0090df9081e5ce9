//! The GORGO cost model: an estimate, in milliseconds, of what serving a request at each
//! candidate region costs: the TTFT it would see there, and the delay its prefill
//! inflicts on the requests already decoding there.
//!
//! ```text
//! cost(r) = w_rtt * RTT_ms(self -> r)          0 for the local region
//!         + t_p(r) * uncached_tokens(r)        prefill of what r has not cached
//!         + w_queue * queue_ms(r)              waiting behind work already at r
//!         + t_p(r) * ( REPREFILL_STALL_WEIGHT  the stall: what this prompt's prefill
//!               * reprefill_tokens(r)          delays: the part another candidate has
//!               * (running(r) + waiting(r))    cached, for every request decoding or
//!                                              queued there,
//!             + SHARED_STALL_WEIGHT            and the part every candidate would
//!               * shared_tokens * running(r) ) have to prefill, for those decoding
//! ```
//!
//! The first three terms happen one after another in the serving pipeline, so with
//! exact estimates their sum is TTFT minus the engine's fixed cost, and both weights
//! would be 1.0 (docs/design.md, "Cost model"). The fourth is what the choice costs
//! other users: a greedy TTFT minimiser ignores it, and under load moves sessions off
//! their caches, re-prefilling whole prompts at engines whose running batches then
//! stall (docs/policy.md has the measurements).

use std::collections::{HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::types::{EngineSlots, NodeId, QueueStats, Weights, MAX_REPLICAS};

/// `t_p` used when a candidate reports none (no stats yet, or a nonsensical value): the
/// paper's A100 + Mistral-7B calibration, 0.0938 ms per prompt token.
pub const FALLBACK_T_P_MS: f64 = 0.0938;

/// Prefill tokens per scheduler iteration assumed when estimating how many decode steps
/// interleave with the prefill work ahead (SGLang's `chunked_prefill_size` default).
pub const PREFILL_CHUNK_TOKENS: u64 = 8192;

/// Weight of the re-prefill part of the decode-stall term ([`stall_ms`]): the prompt
/// tokens a candidate would prefill although another candidate of the same decision has
/// them cached.
///
/// 1.0 is the exact social cost in the engine model (a prefill of `P` ms delays each
/// running request, and each request queued behind it, by `P`), and this part can carry
/// it: it is work the cluster does
/// only because of the choice (moving a session off its cache prefills the cached
/// prefix again while the target's batch waits), and it comes from the per-request
/// match against the prefix summaries, which differs from request to request, so nodes
/// deciding on the same stale stats do not all read it the same way.
pub const REPREFILL_STALL_WEIGHT: f64 = 1.0;

/// Weight of the shared part of the decode-stall term ([`stall_ms`]): the prompt tokens
/// that every candidate would have to prefill (the fewest uncached of the decision).
///
/// Placing that prefill where fewer requests decode does stall fewer of them, but the
/// only thing that differs between candidates here is `running`, the least fresh signal
/// in a peer's stats (a gossip interval old, and the same at every node): weighted as
/// the social cost it makes every node that sees a burst pick the same small batch.
/// Measured (docs/policy.md, "The stall weights"): 0.5 on both parts (the previous
/// rule) left `gorgo` at 1.10-1.13x round-robin's p95 TTFT on the Mooncake conversation
/// trace and 1.53x on a skewed multi-turn workload near saturation; 0.1 here keeps
/// enough of the balance for p95 E2E.
pub const SHARED_STALL_WEIGHT: f64 = 0.1;

/// One region a request could be served at, as the deciding node sees it right now.
///
/// The driver fills it from its own measurements (RTT), the peer's last summary
/// (`cached_tokens`), the peer's last queue stats and its own [`ForwardLedger`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// Which node serves if this candidate is chosen.
    pub node: NodeId,
    /// True for the deciding node itself (RTT term is 0, serving needs no forward).
    pub is_local: bool,
    /// False when the node or its engine is known to be unable to serve; never chosen.
    pub healthy: bool,
    /// Measured round-trip time to the node (EWMA of QUIC path RTT), ms.
    pub rtt_ms: f64,
    /// Longest prefix of this request the node is believed to have cached, tokens.
    pub cached_tokens: u64,
    /// The node's last gossiped load signals.
    pub stats: QueueStats,
    /// Requests this node forwarded there since those stats were produced.
    pub inflight_forwards: u32,
    /// Prefill tokens those forwards add ahead of a new request (the driver records the
    /// uncached estimate at decision time; raw prompt tokens are a safe over-estimate).
    pub inflight_forward_prompt_tokens: u64,
    /// Raw prompt tokens of those forwards, cached part included: what `gorgo-paper`'s
    /// queued tokens count ([`QueueStats::queued_prompt_tokens`] is raw prompt tokens
    /// too; adding the forwards' prefill tokens to it mixed two counts).
    #[serde(default)]
    pub inflight_forward_raw_prompt_tokens: u64,
    /// How much later than predicted this node's recent forwards to the candidate got
    /// their first byte, ms ([`ForwardLedger::forward_bias_ms`]); 0 for the local one.
    #[serde(default)]
    pub forward_bias_ms: f64,
    /// Nodes that decide on the same stale stats of this candidate, this one included
    /// (1 for the local candidate; for a peer, every live node but the peer). The
    /// `gorgo` cost assumes each of them forwards there as this node did since the
    /// stats ([`Candidate::expected_forwards`]).
    #[serde(default = "one")]
    pub deciders: u32,
}

fn one() -> u32 {
    1
}

impl Candidate {
    /// A healthy, idle candidate with no cache: a convenient starting point for drivers
    /// and tests, which then set the fields they know.
    pub fn idle(node: impl Into<NodeId>, is_local: bool, rtt_ms: f64) -> Self {
        Candidate {
            node: node.into(),
            is_local,
            healthy: true,
            rtt_ms,
            cached_tokens: 0,
            stats: QueueStats::default(),
            inflight_forwards: 0,
            inflight_forward_prompt_tokens: 0,
            inflight_forward_raw_prompt_tokens: 0,
            forward_bias_ms: 0.0,
            deciders: 1,
        }
    }

    /// Forwards (count, prefill tokens) the `gorgo` cost expects at this candidate
    /// beyond its stats: this node's own since the stats, times [`Candidate::deciders`].
    ///
    /// Between two gossip rounds every node sees the same stats of a peer; when a burst
    /// reaches all of them at once, each one's ledger counts only its own forwards, and
    /// all of them pick the same peer. Assuming the others behave as this node did
    /// damps that (docs/policy.md, "Herding": on the Mooncake conversation trace p95
    /// TTFT 1.17-1.24x round-robin's at x3-x2 without it, 1.10 with it).
    pub fn expected_forwards(&self) -> (f64, u64) {
        let k = self.deciders.max(1);
        (
            self.inflight_forwards as f64 * k as f64,
            self.inflight_forward_prompt_tokens.saturating_mul(k as u64),
        )
    }

    /// The candidate's prefill cost per token, or [`FALLBACK_T_P_MS`] when the reported
    /// one is missing or not a positive finite number.
    pub fn t_p_ms(&self) -> f64 {
        let t = self.stats.t_p_ms;
        if t.is_finite() && t > 0.0 {
            t
        } else {
            FALLBACK_T_P_MS
        }
    }

    /// Requests at the node as this node knows it: running, waiting, and own forwards
    /// not yet reflected in its stats. The load signal of the count-based baselines.
    pub fn inflight_requests(&self) -> u64 {
        self.stats.running as u64 + self.stats.waiting as u64 + self.inflight_forwards as u64
    }
}

/// One candidate's cost, term by term, so decisions can be explained
/// (`/admin/decisions`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CostTerms {
    /// `w_rtt * RTT_ms` (0 for the local candidate).
    pub rtt_ms: f64,
    /// `t_p * uncached_tokens`.
    pub prefill_ms: f64,
    /// `w_queue * queue_ms`.
    pub queue_ms: f64,
    /// The delay this request's prefill inflicts on the requests running at the
    /// candidate ([`stall_ms`]); 0 for `gorgo-paper`, which has no such term.
    #[serde(default)]
    pub stall_ms: f64,
    /// The sum of the terms: the score the `gorgo` policy minimises.
    pub total_ms: f64,
    /// Prompt tokens believed cached at the candidate.
    pub cached_tokens: u64,
    /// Prompt tokens the candidate would have to prefill.
    pub uncached_tokens: u64,
    /// The part of `uncached_tokens` that another candidate of the decision has cached
    /// (what choosing this one prefills again); the stall weighs it in full.
    #[serde(default)]
    pub reprefill_tokens: u64,
    /// The `t_p` used, ms per token.
    pub t_p_ms: f64,
    /// Unweighted queueing estimate, ms: [`queue_ms`] plus the forward bias.
    pub raw_queue_ms: f64,
    /// The part of `raw_queue_ms` that is the candidate's forward bias
    /// ([`ForwardLedger::forward_bias_ms`]), ms: the bias `estimated_ttft_ms` holds.
    /// (`gorgo-paper`'s `raw_queue_ms` is its score's queued tokens, which hold no
    /// bias; its `estimated_ttft_ms` is the `gorgo` model's, which does.)
    #[serde(default)]
    pub forward_bias_ms: f64,
    /// The wait for a slot ([`slot_wait_ms`]), ms: 0 unless the candidate's
    /// concurrency limit is known and its slots are full. `raw_queue_ms` holds it in
    /// full at a serial engine, and at a batching one only where it is longer than the
    /// prefill ahead ([`queue_ms`]).
    #[serde(default)]
    pub slot_wait_ms: f64,
    /// Prefill tokens estimated ahead of this request.
    pub tokens_ahead: u64,
    /// The model's unweighted TTFT prediction for this candidate, ms
    /// ([`estimated_ttft_ms`]); what reports compare with the measured TTFT.
    /// Non-finite (no measured RTT) is written as `null`.
    #[serde(default)]
    pub estimated_ttft_ms: Option<f64>,
}

impl CostTerms {
    /// [`CostTerms::estimated_ttft_ms`] without the forward bias in it: what the
    /// forward ledger compares a forward's measured first byte with
    /// ([`ForwardLedger::observe_forward_ttft`]). Learning from the biased estimate
    /// would settle the bias at half the lateness it is there to learn.
    pub fn unbiased_estimated_ttft_ms(&self) -> Option<f64> {
        self.estimated_ttft_ms.map(|e| e - self.forward_bias_ms)
    }

    /// These terms, a local engine's from a decision that chose a forward, as the
    /// request met them when the forward was refused or failed before its first byte
    /// and the engine served it `elapsed_ms` after the decision: the time lost stands
    /// as the RTT term (`weights.w_rtt` times it, as a peer's RTT is weighted, so that
    /// [`crate::tuning::TermSample::new`] reads it back unweighted) and adds to the
    /// estimated TTFT (what the node then predicts for the client). `None` for an
    /// elapsed time that is not a finite number >= 0. The node also uses it for a
    /// request tried again after an engine or a peer failed it before its first byte:
    /// the time the earlier tries took is lost the same way.
    ///
    /// Why: the start fit (`tuning::TermSums`) regresses the measured TTFT on the
    /// chosen candidate's RTT and queue terms. Fed the peer's terms for a request the
    /// local engine served, it matched the local wait with the peer's queue estimate,
    /// and a forward is refused precisely when that estimate was too low: evidence
    /// biased towards higher weights. Both drivers call this, so the node and the
    /// simulator feed the fit the same sample. With `w_rtt = 0` the RTT term is 0 and
    /// the time lost is taken out of the sample's residual instead.
    pub fn served_locally_after(&self, elapsed_ms: f64, weights: Weights) -> Option<CostTerms> {
        if !(elapsed_ms.is_finite() && elapsed_ms >= 0.0) {
            return None;
        }
        let rtt_ms = self.rtt_ms + weights.w_rtt * elapsed_ms;
        Some(CostTerms {
            rtt_ms,
            total_ms: self.total_ms - self.rtt_ms + rtt_ms,
            estimated_ttft_ms: self.estimated_ttft_ms.map(|e| e + elapsed_ms),
            ..*self
        })
    }
}

/// Unweighted estimate of the wait before `c`'s engine starts this request's prefill.
///
/// Two parts, both in ms:
///
/// - **prefill ahead**: `t_p x tokens ahead` (unfinished prefill tokens from its stats
///   plus the forwards expected there, [`Candidate::expected_forwards`]);
/// - **decode steps interleaved** with that prefill when it has a running batch: one
///   decode step per prefill chunk ahead (`ceil(tokens_ahead / PREFILL_CHUNK_TOKENS)`)
///   plus, on average, half of the step in progress when the request arrives.
///
/// - **the slot wait** ([`slot_wait_ms`]) where the engine's concurrency limit is
///   known (configured, or reported by the engine): the decode of the requests ahead
///   that hold its slots. An engine that runs one request at a time prefills and
///   decodes one after the other, so the two add up. One that batches prefills the
///   requests it admits inside the decode steps of those running (chunked prefill),
///   so the decode time that frees its slots already contains the prefill ahead: the
///   wait is the longer of the two, not their sum. (Measured at saturation with four
///   engines per region, Azure x0.0625: the sum over-predicts the median request by
///   18%, the longer under-predicts by 23%, prefill alone by 36%; docs/policy.md, "The
///   limit the engine reports".)
///
/// A decode-bound admission wait guessed from a fixed output length, without a
/// configured limit, was measured and dropped (docs/simulator.md, "Cost model fixes":
/// p95 TTFT +4% to +18% on every workload tried): at an engine that batches hundreds,
/// what gates admission is the prefill of the backlog, already counted.
///
/// Returns `(queue_ms, tokens_ahead)`.
pub fn queue_ms(c: &Candidate) -> (f64, u64) {
    let w = queue_wait(c);
    (w.ms, w.tokens_ahead)
}

/// [`queue_ms`] with the part of it that is decode of the requests ahead: what
/// learns a decode time from a wait it priced needs to know how much of the wait was
/// the decode time ([`crate::accounting::EngineView::finish`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueueWait {
    /// The whole wait, ms ([`queue_ms`]).
    pub ms: f64,
    /// Prefill tokens ahead ([`queue_ms`]).
    pub tokens_ahead: u64,
    /// Of `ms`, the slot wait ([`slot_wait_ms`]) where it counts: always at a serial
    /// engine, where it adds to the prefill ahead; at one that batches, only where it
    /// is the larger of the two.
    pub slot_wait_ms: f64,
}

/// [`queue_ms`] in its parts ([`QueueWait`]).
pub fn queue_wait(c: &Candidate) -> QueueWait {
    let tokens_ahead = c
        .stats
        .unfinished_prefill_tokens
        .saturating_add(c.expected_forwards().1);
    let prefill = c.t_p_ms() * tokens_ahead as f64;
    let step = c.stats.decode_step_ms;
    let decode = if c.stats.running > 0 && step.is_finite() && step > 0.0 {
        let chunks = tokens_ahead.div_ceil(PREFILL_CHUNK_TOKENS) as f64;
        (chunks + 0.5) * step
    } else {
        0.0
    };
    let slot_wait = slot_wait_ms(c);
    let batches = c.stats.slots.is_some_and(|s| s.max_running > 1);
    let (ahead, slot_wait_ms) = if !batches {
        (prefill + slot_wait, slot_wait)
    } else if slot_wait > prefill {
        (slot_wait, slot_wait)
    } else {
        (prefill, 0.0)
    };
    QueueWait {
        ms: ahead + decode,
        tokens_ahead,
        slot_wait_ms,
    }
}

/// Expected wait for a slot, ms: the decode of the requests ahead that hold the
/// engine's slots; 0 when its concurrency limit is not known ([`QueueStats::slots`]),
/// it reports running fewer requests than its limit, no decode time is measured yet,
/// or a slot is free.
///
/// An engine runs at most `M` requests at once (llama-cpp-python's server runs one). A
/// request that arrives when `ahead` requests are running or waiting there (its
/// `running + waiting` plus the forwards expected since, [`Candidate::expected_forwards`])
/// starts its prefill only after `n = ahead + 1 - M` of them have finished decoding.
/// With every slot busy they finish about one per `D / M` (`D`: the node's measured
/// decode time per request, [`EngineSlots::decode_ms`]), and the one furthest along is
/// on average half done, so
///
/// ```text
/// slot_wait = (n - 1/2) * D / M        when n > 0
/// ```
///
/// At a serial engine (`M` = 1) with `k` requests ahead this is the rest of the one
/// decoding plus the whole decode of the `k - 1` waiting, which the prefill queue does
/// not count (docs/policy.md, "A serial engine's queue"). The prefill of the waiting
/// requests is in `unfinished_prefill_tokens` already.
pub fn slot_wait_ms(c: &Candidate) -> f64 {
    let Some(EngineSlots {
        max_running: slots,
        decode_ms: d,
    }) = c.stats.slots
    else {
        return 0.0;
    };
    if slots == 0 || !(d.is_finite() && d > 0.0) {
        return 0.0;
    }
    // An engine that says it runs fewer than its limit is not short of slots: what
    // holds its waiting requests back is prefill (counted in the queue) or KV.
    // Charging the slot wait for them anyway made the saturated points worse
    // (docs/policy.md, "The limit the engine reports"). The forwards sent there since
    // still take its free slots first, and wait for one once those are gone. An
    // engine that reports no running count (no metrics: our requests all count as
    // waiting) is taken at its limit's word.
    let slot_bound = c.stats.running == 0 || c.stats.running >= slots;
    let waiting = if slot_bound {
        c.stats.waiting as f64
    } else {
        0.0
    };
    let ahead = c.stats.running as f64 + waiting + c.expected_forwards().0;
    let n = ahead + 1.0 - slots as f64;
    if n <= 0.0 {
        return 0.0;
    }
    (n - 0.5) * d / slots as f64
}

/// The delay, ms, that prefilling `uncached_tokens` at `c` inflicts on other requests
/// there, weighted by part: [`REPREFILL_STALL_WEIGHT`] for the `reprefill_tokens`
/// another candidate has cached, [`SHARED_STALL_WEIGHT`] for the rest (the prefill the
/// request needs wherever it goes).
///
/// An engine that has prefill work interleaves it with its decode steps (SGLang's
/// chunked prefill; the emulator alternates a prefill chunk and a decode step), so
/// every request decoding at `c` gets its next tokens that much later. Running
/// requests are the candidate's last reported `running` plus the forwards expected
/// since ([`Candidate::expected_forwards`]; they will be running by the time this
/// request is prefilled). The re-prefill, work the cluster does only because of this
/// choice, also delays the requests that queue behind it; by Little's law the
/// candidate's `waiting` is how many arrive during a wait like the one it reports, so
/// that part is charged to `running + waiting` (docs/policy.md, "The queue estimate at
/// saturation"). The term is 0 at an idle engine, so at light load the rule is the TTFT
/// minimiser; under load it grows with the batch and the queue, and the re-prefill it
/// weighs in full is what makes moving a session off its cache expensive.
pub fn stall_ms(c: &Candidate, uncached_tokens: u64, reprefill_tokens: u64) -> f64 {
    let running = c.stats.running as f64 + c.expected_forwards().0;
    let behind = running + c.stats.waiting as f64;
    let reprefill = reprefill_tokens.min(uncached_tokens);
    let shared = uncached_tokens - reprefill;
    c.t_p_ms()
        * (REPREFILL_STALL_WEIGHT * reprefill as f64 * behind
            + SHARED_STALL_WEIGHT * shared as f64 * running)
}

/// The fewest prompt tokens any candidate that can be chosen (healthy, and local or at
/// a measured RTT) would have to prefill for a `prompt_tokens`-token request: the
/// prefill the cluster needs wherever it goes (the rest of a candidate's uncached
/// tokens is re-prefill, [`stall_ms`]). The prompt itself when none can. A peer whose
/// RTT is not measured yet costs infinitely much; its cache must not make every other
/// candidate's prefill look like re-prefill.
pub fn fewest_uncached_tokens(prompt_tokens: u64, candidates: &[Candidate]) -> u64 {
    candidates
        .iter()
        .filter(|c| c.healthy && (c.is_local || (c.rtt_ms.is_finite() && c.rtt_ms >= 0.0)))
        .map(|c| prompt_tokens - c.cached_tokens.min(prompt_tokens))
        .min()
        .unwrap_or(prompt_tokens)
}

/// The TTFT the cost model predicts for a `prompt_tokens`-token request served at `c`,
/// ms, unweighted: what the model says the deciding node will see, so reports can check
/// the model against measurements (median absolute percentage error, rank correlation).
///
/// ```text
/// estimated_ttft = RTT_ms(self -> c)     0 for the local candidate (a forward costs
///                                        one round trip before the first token)
///                + base_ms(c)            the node's fitted fixed TTFT cost (0 if unknown)
///                + t_p(c) * uncached     prefill of what c has not cached
///                + queue_ms(c)           [`queue_ms`], unweighted
/// ```
///
/// Unlike [`cost_terms`]' `total_ms` it carries no weights (the tuner's weights trade
/// terms off, they are not part of the prediction) and it includes the fixed cost, which
/// is the same at every candidate and so irrelevant to the choice. It does not include
/// the client's own link to its home node, which no node measures: a client far from its
/// node sees that round trip on top. Non-finite when a peer's RTT is not measured.
pub fn estimated_ttft_ms(prompt_tokens: u64, c: &Candidate) -> f64 {
    let uncached = prompt_tokens.saturating_sub(c.cached_tokens.min(prompt_tokens));
    let rtt = if c.is_local {
        0.0
    } else if c.rtt_ms.is_finite() && c.rtt_ms >= 0.0 {
        c.rtt_ms
    } else {
        f64::INFINITY
    };
    let base = c.stats.base_ms;
    let base = if base.is_finite() && base >= 0.0 {
        base
    } else {
        0.0
    };
    rtt + base + c.t_p_ms() * uncached as f64 + biased_queue_ms(c)
}

/// [`queue_ms`] plus the candidate's forward bias (the wait this node's forwards there
/// met beyond what its stats showed), never below 0.
pub(crate) fn biased_queue_ms(c: &Candidate) -> f64 {
    let bias = if c.is_local || !c.forward_bias_ms.is_finite() {
        0.0
    } else {
        c.forward_bias_ms
    };
    (queue_ms(c).0 + bias).max(0.0)
}

/// The `gorgo` cost of serving a `prompt_tokens`-token request at `c` under `weights`,
/// when the best candidate of the decision has `fewest_uncached` tokens to prefill
/// ([`fewest_uncached_tokens`]; pass `prompt_tokens` to judge `c` with no re-prefill).
///
/// Non-finite or negative RTTs to a peer make the candidate infinitely expensive (never
/// preferred over a measured one); the local candidate's RTT term is always 0.
pub fn cost_terms(
    prompt_tokens: u64,
    c: &Candidate,
    weights: Weights,
    fewest_uncached: u64,
) -> CostTerms {
    let cached_tokens = c.cached_tokens.min(prompt_tokens);
    let uncached_tokens = prompt_tokens - cached_tokens;
    let reprefill_tokens = uncached_tokens.saturating_sub(fewest_uncached);
    let t_p_ms = c.t_p_ms();
    let rtt_ms = if c.is_local {
        0.0
    } else if c.rtt_ms.is_finite() && c.rtt_ms >= 0.0 {
        weights.w_rtt * c.rtt_ms
    } else {
        f64::INFINITY
    };
    let prefill_ms = t_p_ms * uncached_tokens as f64;
    let (unbiased_queue_ms, tokens_ahead) = queue_ms(c);
    let raw_queue_ms = biased_queue_ms(c);
    let forward_bias_ms = raw_queue_ms - unbiased_queue_ms;
    let queue_ms = weights.w_queue * raw_queue_ms;
    let stall_ms = stall_ms(c, uncached_tokens, reprefill_tokens);
    CostTerms {
        rtt_ms,
        prefill_ms,
        queue_ms,
        stall_ms,
        total_ms: rtt_ms + prefill_ms + queue_ms + stall_ms,
        cached_tokens,
        uncached_tokens,
        reprefill_tokens,
        t_p_ms,
        raw_queue_ms,
        forward_bias_ms,
        slot_wait_ms: slot_wait_ms(c),
        tokens_ahead,
        estimated_ttft_ms: finite(estimated_ttft_ms(prompt_tokens, c)),
    }
}

/// `Some(v)` for a finite `v`: estimates that cannot be made are absent, not infinite
/// (JSON has no infinity).
pub(crate) fn finite(v: f64) -> Option<f64> {
    v.is_finite().then_some(v)
}

/// Most forwards remembered per peer; beyond this the oldest are dropped, which only
/// under-counts a peer that has sent no stats for a very long time (likely dead).
pub const MAX_LEDGER_ENTRIES_PER_PEER: usize = 4096;

/// Weight of one forward's residual in a peer's forward bias (an EWMA).
pub const FORWARD_BIAS_GAIN: f64 = 0.125;
/// Half-life of a peer's forward bias while no forward to it reports, ms: a bias learnt
/// in a bad minute must not keep a peer out of routing for good (it would never get the
/// forwards that correct it).
pub const FORWARD_BIAS_HALF_LIFE_MS: f64 = 10_000.0;
/// Bound on a peer's forward bias, either sign, ms.
pub const MAX_FORWARD_BIAS_MS: f64 = 60_000.0;

#[derive(Debug, Clone, Default)]
struct PeerLedger {
    /// Highest stats [`QueueStats::order`] seen from the peer, if any.
    stats_order: Option<(u64, u64)>,
    /// `(sent_at_ms, prefill_tokens, prompt_tokens)` of forwards not yet reflected in
    /// its stats.
    forwards: VecDeque<(u64, u64, u64)>,
    prefill_tokens: u64,
    prompt_tokens: u64,
    /// Forward bias as of `bias_at_ms`, ms.
    bias_ms: f64,
    bias_at_ms: u64,
}

impl PeerLedger {
    /// Take the forward at `i` off the ledger.
    fn remove(&mut self, i: usize) {
        if let Some((_, prefill, prompt)) = self.forwards.remove(i) {
            self.prefill_tokens -= prefill;
            self.prompt_tokens -= prompt;
        }
    }

    fn bias_at(&self, now_ms: u64) -> f64 {
        let age = now_ms.saturating_sub(self.bias_at_ms) as f64;
        self.bias_ms * 0.5f64.powf(age / FORWARD_BIAS_HALF_LIFE_MS)
    }
}

/// This node's forwards to each peer since that peer's last stats (anti-herding).
///
/// Between two gossip rounds several nodes would otherwise all see the same idle peer
/// and all send it work; counting our own forwards into its queue damps that. A forward
/// sent at `t` reaches the peer at about `t + rtt/2`, and stats that arrive at `now`
/// were produced at about `now - rtt/2`, so new stats reflect the forwards sent before
/// `now - rtt`; only those are cleared.
///
/// It also learns each peer's **forward bias**: how much later than the cost model
/// predicted this node's forwards there got their first byte. Forwards meet work the
/// peer's stats could not show (requests that reached the peer while the forward was in
/// transit, other nodes' forwards of the same moment); measured on the Mooncake
/// conversation trace the model under-predicted forwards by a median 49% and local
/// requests by 3% (docs/policy.md). The bias is added to the peer's queue term, so the
/// rule stops preferring a peer because it looks better than it turns out to be.
#[derive(Debug, Clone, Default)]
pub struct ForwardLedger {
    /// Per peer, per engine of it ([`QueueStats::replica`]): each engine gossips its
    /// own stats, so forwards are cleared against the stats of the engine they were
    /// sent to.
    peers: HashMap<NodeId, Vec<PeerLedger>>,
}

impl ForwardLedger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// The entry of `peer`'s engine `replica`, made on first use; `None` for a replica
    /// past [`MAX_REPLICAS`] (nothing is kept for it).
    fn entry(&mut self, peer: &NodeId, replica: u16) -> Option<&mut PeerLedger> {
        if replica >= MAX_REPLICAS {
            return None;
        }
        // Looked up before inserting: this runs per peer per request, and `entry` would
        // clone the id every time.
        if !self.peers.contains_key(peer) {
            self.peers.insert(peer.clone(), Vec::new());
        }
        let engines = self.peers.get_mut(peer).expect("inserted above");
        let i = replica as usize;
        if engines.len() <= i {
            engines.resize_with(i + 1, PeerLedger::default);
        }
        Some(&mut engines[i])
    }

    fn get(&self, peer: &NodeId, replica: u16) -> Option<&PeerLedger> {
        self.peers.get(peer)?.get(replica as usize)
    }

    /// Note a forward to `peer`'s engine `replica` of a request of `prompt_tokens` raw
    /// prompt tokens, `prefill_tokens` of them expected to need prefill there.
    pub fn record_forward(
        &mut self,
        peer: &NodeId,
        replica: u16,
        prefill_tokens: u64,
        prompt_tokens: u64,
        now_ms: u64,
    ) {
        let Some(entry) = self.entry(peer, replica) else {
            return;
        };
        if entry.forwards.len() >= MAX_LEDGER_ENTRIES_PER_PEER {
            entry.remove(0);
        }
        // In send order, which `observe_stats` clears from the front: two requests
        // decided at once (in the node, on different tasks) may record out of order,
        // and an entry behind a later one stayed pending past the stats that cleared it.
        let at = entry.forwards.partition_point(|&(sent, ..)| sent <= now_ms);
        entry
            .forwards
            .insert(at, (now_ms, prefill_tokens, prompt_tokens));
        entry.prefill_tokens += prefill_tokens;
        entry.prompt_tokens += prompt_tokens;
    }

    /// New stats from `peer` (of its engine `stats.replica`) arrived at `now_ms`: if
    /// they are newer than the last seen (a later version of the same run, or another
    /// run: a restarted peer), clear the forwards they already reflect (those sent
    /// before `now_ms - rtt_ms`). Pass `rtt_ms = 0` to clear every forward. The first
    /// stats of another run also clear the forward bias: what the dead run's forwards
    /// met says nothing of a fresh process. Returns true when they were new.
    ///
    /// Another run is taken as it comes, whatever its incarnation: these are the stats
    /// the peer's gossip holds ([`crate::gossip::PeerRun`] decides which run is heard,
    /// and a dead run's late copies never get there), and a restart on a clock that
    /// reads earlier has a lower incarnation once membership vouches for it. Ordered by
    /// incarnation here, its stats were never new: its forwards were never cleared and
    /// it was priced out.
    pub fn observe_stats(
        &mut self,
        peer: &NodeId,
        stats: &QueueStats,
        now_ms: u64,
        rtt_ms: f64,
    ) -> bool {
        let Some(entry) = self.entry(peer, stats.replica) else {
            return false;
        };
        let order = stats.order();
        match entry.stats_order {
            Some((run, version)) if run == order.0 && order.1 <= version => return false,
            Some((run, _)) if run != order.0 => entry.bias_ms = 0.0,
            _ => {}
        }
        entry.stats_order = Some(order);
        let rtt = if rtt_ms.is_finite() && rtt_ms > 0.0 {
            rtt_ms as u64
        } else {
            0
        };
        let cutoff = now_ms.saturating_sub(rtt);
        while entry
            .forwards
            .front()
            .is_some_and(|&(sent, ..)| sent <= cutoff)
        {
            entry.remove(0);
        }
        true
    }

    /// A forward recorded at `sent_ms` with `prefill_tokens` and `prompt_tokens` for
    /// `peer`'s engine `replica` ([`ForwardLedger::record_forward`]) never ran there
    /// (the peer refused it, [`crate::decision::refuse_forward`]): it no longer counts
    /// as pending. Nothing happens if the peer's stats already cleared it.
    pub fn cancel_forward(
        &mut self,
        peer: &NodeId,
        replica: u16,
        prefill_tokens: u64,
        prompt_tokens: u64,
        sent_ms: u64,
    ) {
        let Some(entry) = self
            .peers
            .get_mut(peer)
            .and_then(|e| e.get_mut(replica as usize))
        else {
            return;
        };
        if let Some(i) = entry
            .forwards
            .iter()
            .position(|&f| f == (sent_ms, prefill_tokens, prompt_tokens))
        {
            entry.remove(i);
        }
    }

    /// `(forwards, prefill_tokens)` not yet reflected in the stats of `peer`'s engine
    /// `replica`.
    pub fn pending(&self, peer: &NodeId, replica: u16) -> (u32, u64) {
        self.get(peer, replica)
            .map(|e| (e.forwards.len() as u32, e.prefill_tokens))
            .unwrap_or((0, 0))
    }

    /// A forward to `peer`'s engine `replica` got its first byte: the cost model had
    /// predicted `unbiased_predicted_ms` for it before its forward bias
    /// ([`CostTerms::unbiased_estimated_ttft_ms`]) and it took `measured_ms` from the
    /// decision (both as this node sees them: RTT included). The bias is an average of
    /// `measured - unbiased prediction`: fed the biased prediction instead, it would
    /// chase its own value and settle at half the lateness. Non-finite values are
    /// ignored.
    pub fn observe_forward_ttft(
        &mut self,
        peer: &NodeId,
        replica: u16,
        unbiased_predicted_ms: f64,
        measured_ms: f64,
        now_ms: u64,
    ) {
        if !(unbiased_predicted_ms.is_finite() && measured_ms.is_finite()) {
            return;
        }
        let Some(entry) = self.entry(peer, replica) else {
            return;
        };
        let bias = entry.bias_at(now_ms);
        let lateness = measured_ms - unbiased_predicted_ms;
        entry.bias_ms = (bias + FORWARD_BIAS_GAIN * (lateness - bias))
            .clamp(-MAX_FORWARD_BIAS_MS, MAX_FORWARD_BIAS_MS);
        entry.bias_at_ms = now_ms;
    }

    /// The forward bias of `peer`'s engine `replica` at `now_ms`, ms (0 when nothing
    /// was observed).
    pub fn forward_bias_ms(&self, peer: &NodeId, replica: u16, now_ms: u64) -> f64 {
        self.get(peer, replica).map_or(0.0, |e| e.bias_at(now_ms))
    }

    /// Copy the pending counts and the forward bias into a candidate built for
    /// `candidate.node`'s engine `candidate.stats.replica`.
    pub fn apply(&self, candidate: &mut Candidate, now_ms: u64) {
        let Some(e) = self.get(&candidate.node, candidate.stats.replica) else {
            candidate.inflight_forwards = 0;
            candidate.inflight_forward_prompt_tokens = 0;
            candidate.inflight_forward_raw_prompt_tokens = 0;
            candidate.forward_bias_ms = 0.0;
            return;
        };
        candidate.inflight_forwards = e.forwards.len() as u32;
        candidate.inflight_forward_prompt_tokens = e.prefill_tokens;
        candidate.inflight_forward_raw_prompt_tokens = e.prompt_tokens;
        candidate.forward_bias_ms = if e.bias_ms == 0.0 {
            0.0
        } else {
            e.bias_at(now_ms)
        };
    }

    /// Drop everything about a peer that left the cluster.
    pub fn forget(&mut self, peer: &NodeId) {
        self.peers.remove(peer);
    }

    /// Keep only the peers `known` says the cluster still knows, and
    /// [`ForwardLedger::forget`] the others: what a driver calls as its cluster's
    /// membership changes. Without it the ledger kept, for every peer id it ever
    /// heard of, its pending forwards (up to [`MAX_LEDGER_ENTRIES_PER_PEER`] per
    /// engine) and its forward bias.
    pub fn retain_peers(&mut self, mut known: impl FnMut(&NodeId) -> bool) {
        self.peers.retain(|peer, _| known(peer));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(rtt: f64, cached: u64) -> Candidate {
        let mut c = Candidate::idle("peer", false, rtt);
        c.cached_tokens = cached;
        c.stats.t_p_ms = 0.094;
        c
    }

    /// A forward refused or failed and served by the local engine 300 ms after the
    /// decision: the start fit's sample is the local engine's, with the 300 ms as its
    /// RTT, not the peer's RTT and queue set against the local engine's wait.
    #[test]
    fn a_refused_forward_served_here_is_sampled_with_the_local_terms() {
        use crate::tuning::TermSample;
        let w = Weights {
            w_rtt: 0.5,
            w_queue: 2.0,
        };
        let mut local = Candidate::idle("a", true, 0.0);
        local.stats.t_p_ms = 0.1;
        local.stats.base_ms = 100.0;
        local.stats.unfinished_prefill_tokens = 20_000; // 2,000 ms of queue
        let mut peer = peer(80.0, 0);
        peer.stats.t_p_ms = 0.1;
        peer.stats.unfinished_prefill_tokens = 500; // 50 ms
        let (lt, pt) = (
            cost_terms(1000, &local, w, 1000),
            cost_terms(1000, &peer, w, 1000),
        );
        let met = lt.served_locally_after(300.0, w).unwrap();
        assert_eq!(met.rtt_ms, 150.0);
        assert_eq!(met.total_ms, lt.total_ms + 150.0);
        assert_eq!(met.estimated_ttft_ms, Some(100.0 + 100.0 + 2_000.0 + 300.0));
        assert_eq!(
            (met.queue_ms, met.raw_queue_ms),
            (lt.queue_ms, lt.raw_queue_ms)
        );
        // The client saw 2,500 ms: 300 lost, 2,000 queued, 200 of base and prefill.
        let s = TermSample::new(&met, w, 2_500.0).unwrap();
        assert_eq!((s.rtt_ms, s.queue_ms), (300.0, 2_000.0));
        assert!((s.residual_ms - 2_300.0).abs() < 1e-9, "{s:?}");
        // The peer's terms said 80 ms and 50 ms of queue came to 2,300 or so.
        let wrong = TermSample::new(&pt, w, 2_500.0).unwrap();
        assert_eq!((wrong.rtt_ms, wrong.queue_ms), (80.0, 50.0));
        // With w_rtt = 0 the time lost is out of the residual instead.
        let unweighted = Weights { w_rtt: 0.0, ..w };
        let met = lt.served_locally_after(300.0, unweighted).unwrap();
        let s = TermSample::new(&met, unweighted, 2_500.0).unwrap();
        assert_eq!(s.rtt_ms, 0.0);
        assert!((s.residual_ms - 2_000.0).abs() < 1e-9, "{s:?}");
        // A time that is no time gives no terms.
        for bad in [f64::NAN, f64::INFINITY, -1.0] {
            assert!(lt.served_locally_after(bad, w).is_none());
        }
    }

    #[test]
    fn terms_add_up_and_local_has_no_rtt() {
        let mut local = peer(50.0, 0);
        local.is_local = true;
        let t = cost_terms(1000, &local, Weights::default(), 1000);
        assert_eq!(t.rtt_ms, 0.0);
        assert!((t.prefill_ms - 94.0).abs() < 1e-9);
        assert_eq!(
            t.total_ms,
            t.rtt_ms + t.prefill_ms + t.queue_ms + t.stall_ms
        );
    }

    #[test]
    fn estimated_ttft_is_unweighted_sum_with_base() {
        let mut c = peer(40.0, 200);
        c.stats.base_ms = 15.0;
        c.stats.unfinished_prefill_tokens = 1000;
        let w = Weights {
            w_rtt: 3.0,
            w_queue: 0.5,
        };
        let t = cost_terms(1200, &c, w, 1200);
        let expected = 40.0 + 15.0 + 0.094 * 1000.0 + 0.094 * 1000.0;
        assert!((estimated_ttft_ms(1200, &c) - expected).abs() < 1e-9);
        assert_eq!(t.estimated_ttft_ms, Some(estimated_ttft_ms(1200, &c)));
        c.rtt_ms = f64::NAN;
        assert_eq!(cost_terms(1200, &c, w, 1200).estimated_ttft_ms, None);
        c.is_local = true;
        c.stats.base_ms = f64::NAN;
        assert!((estimated_ttft_ms(1200, &c) - 188.0).abs() < 1e-9);
    }

    #[test]
    fn stall_is_zero_when_idle_and_grows_with_the_batch_and_the_prefill() {
        let mut c = peer(10.0, 0);
        let w = Weights::default();
        let idle = cost_terms(1000, &c, w, 1000);
        assert_eq!(idle.stall_ms, 0.0);
        c.stats.running = 8;
        // Judged alone, all of the prefill is shared: the shared weight.
        let t8 = cost_terms(1000, &c, w, 1000);
        assert_eq!(t8.reprefill_tokens, 0);
        assert!((t8.stall_ms - SHARED_STALL_WEIGHT * t8.prefill_ms * 8.0).abs() < 1e-9);
        // Another candidate has 600 of the 1,000 tokens cached: those are re-prefill.
        let t8r = cost_terms(1000, &c, w, 400);
        assert_eq!(t8r.reprefill_tokens, 600);
        let want =
            t8r.t_p_ms * 8.0 * (REPREFILL_STALL_WEIGHT * 600.0 + SHARED_STALL_WEIGHT * 400.0);
        assert!((t8r.stall_ms - want).abs() < 1e-9);
        // Requests waiting there queue behind the re-prefill, not behind the shared part.
        c.stats.waiting = 4;
        let t8w = cost_terms(1000, &c, w, 1000);
        assert!((t8w.stall_ms - t8.stall_ms).abs() < 1e-9);
        let t8rw = cost_terms(1000, &c, w, 400);
        let want = t8rw.t_p_ms
            * (REPREFILL_STALL_WEIGHT * 600.0 * 12.0 + SHARED_STALL_WEIGHT * 400.0 * 8.0);
        assert!((t8rw.stall_ms - want).abs() < 1e-9);
        c.stats.waiting = 0;
        // Our own forwards since the stats count as running too.
        c.inflight_forwards = 2;
        let t10 = cost_terms(1000, &c, w, 1000);
        assert!((t10.stall_ms - t8.stall_ms * 10.0 / 8.0).abs() < 1e-9);
        // A cached prefix is prefill nobody waits for.
        c.cached_tokens = 1000;
        assert_eq!(cost_terms(1000, &c, w, 0).stall_ms, 0.0);
        // The prediction of TTFT does not include what others wait.
        let base = c.stats.base_ms;
        let want = t10.rtt_ms + base + t10.prefill_ms + t10.raw_queue_ms;
        assert!((t10.estimated_ttft_ms.unwrap() - want).abs() < 1e-9);
    }

    #[test]
    fn fewest_uncached_counts_healthy_candidates_only() {
        let mut warm = peer(10.0, 700);
        let cold = peer(10.0, 100);
        assert_eq!(
            fewest_uncached_tokens(1000, &[cold.clone(), warm.clone()]),
            300
        );
        warm.healthy = false;
        assert_eq!(fewest_uncached_tokens(1000, &[cold, warm.clone()]), 900);
        assert_eq!(fewest_uncached_tokens(1000, &[warm]), 1000);
        assert_eq!(fewest_uncached_tokens(1000, &[]), 1000);
        // A peer that cannot be chosen yet (no RTT measured) sets no floor either.
        let unmeasured = peer(f64::INFINITY, 900);
        let cold = peer(10.0, 100);
        assert_eq!(fewest_uncached_tokens(1000, &[cold, unmeasured]), 900);
        let mut local = Candidate::idle("me", true, f64::NAN);
        local.cached_tokens = 500;
        assert_eq!(fewest_uncached_tokens(1000, &[local]), 500);
    }

    #[test]
    fn under_load_the_stall_keeps_a_session_on_its_cache() {
        // The session's cache is at a busy candidate (24 running, 2 s of prefill queued);
        // an idle-queue peer 40 ms away has 16 running and nothing cached. The greedy TTFT
        // (the first three terms) prefers the peer; with the stall the cached one wins,
        // because moving re-prefills 7,000 tokens while 16 requests wait.
        let mut home = Candidate::idle("home", true, 0.0);
        home.cached_tokens = 7000;
        home.stats.running = 24;
        home.stats.unfinished_prefill_tokens = 20_000;
        let mut away = peer(40.0, 0);
        away.stats.running = 16;
        let fewest = fewest_uncached_tokens(8000, &[home.clone(), away.clone()]);
        assert_eq!(fewest, 1000);
        let (h, a) = (
            cost_terms(8000, &home, Weights::default(), fewest),
            cost_terms(8000, &away, Weights::default(), fewest),
        );
        assert_eq!((h.reprefill_tokens, a.reprefill_tokens), (0, 7000));
        let ttft = |t: &CostTerms| t.rtt_ms + t.prefill_ms + t.queue_ms;
        assert!(ttft(&a) < ttft(&h), "greedy TTFT moves: {a:?} vs {h:?}");
        assert!(
            h.total_ms < a.total_ms,
            "the stall keeps it: {a:?} vs {h:?}"
        );
    }

    #[test]
    fn with_nothing_cached_anywhere_a_smaller_batch_wins_only_by_the_shared_weight() {
        // No reuse: every candidate prefills the whole prompt. Batches of 20 and 14, equal
        // queues: the stall prefers the smaller batch by 0.1 x P x 6 (0.6 P), not by the
        // 0.5 x P x 6 (3 P) of the previous rule, which outweighed three queued prefills.
        let mut a = peer(0.0, 0);
        a.is_local = true;
        a.stats.running = 20;
        let mut b = peer(0.0, 0);
        b.stats.running = 14;
        let fewest = fewest_uncached_tokens(7000, &[a.clone(), b.clone()]);
        let (ta, tb) = (
            cost_terms(7000, &a, Weights::default(), fewest),
            cost_terms(7000, &b, Weights::default(), fewest),
        );
        let p = ta.prefill_ms;
        assert!((ta.stall_ms - tb.stall_ms - SHARED_STALL_WEIGHT * p * 6.0).abs() < 1e-6);
        // One queued prefill of the same size at the smaller batch outweighs it.
        b.stats.unfinished_prefill_tokens = 7000;
        let tb = cost_terms(7000, &b, Weights::default(), fewest);
        assert!(ta.total_ms < tb.total_ms, "{ta:?} vs {tb:?}");
    }

    proptest::proptest! {
        /// More running or waiting requests or more uncached tokens never make a
        /// candidate cheaper, whatever the decision's fewest uncached tokens.
        #[test]
        fn stall_is_monotone(
            running in 0u32..512,
            more_running in 0u32..64,
            waiting in 0u32..512,
            more_waiting in 0u32..64,
            prompt in 0u64..40_000,
            cached in 0u64..40_000,
            fewer_cached in 0u64..40_000,
            fewest in 0u64..40_000,
        ) {
            let mut c = peer(20.0, cached);
            c.stats.running = running;
            c.stats.waiting = waiting;
            let base = cost_terms(prompt, &c, Weights::default(), fewest);
            let mut busier = c.clone();
            busier.stats.running = running + more_running;
            proptest::prop_assert!(cost_terms(prompt, &busier, Weights::default(), fewest).stall_ms >= base.stall_ms);
            let mut queued = c.clone();
            queued.stats.waiting = waiting + more_waiting;
            proptest::prop_assert!(cost_terms(prompt, &queued, Weights::default(), fewest).stall_ms >= base.stall_ms);
            let mut colder = c.clone();
            colder.cached_tokens = cached.saturating_sub(fewer_cached);
            proptest::prop_assert!(cost_terms(prompt, &colder, Weights::default(), fewest).stall_ms >= base.stall_ms);
            proptest::prop_assert!(base.stall_ms >= 0.0 && base.stall_ms.is_finite());
        }
    }

    #[test]
    fn cached_tokens_never_exceed_prompt() {
        let t = cost_terms(100, &peer(10.0, 1000), Weights::default(), 100);
        assert_eq!(t.cached_tokens, 100);
        assert_eq!(t.uncached_tokens, 0);
    }

    #[test]
    fn bad_rtt_or_t_p_is_guarded() {
        let mut c = peer(f64::NAN, 0);
        c.stats.t_p_ms = f64::NAN;
        let t = cost_terms(10, &c, Weights::default(), 10);
        assert_eq!(t.t_p_ms, FALLBACK_T_P_MS);
        assert!(t.total_ms.is_infinite());
    }

    #[test]
    fn queue_counts_decode_steps_when_running() {
        let mut c = peer(0.0, 0);
        c.stats.unfinished_prefill_tokens = 10_000;
        c.stats.decode_step_ms = 20.0;
        assert!((queue_ms(&c).0 - 940.0).abs() < 1e-9);
        c.stats.running = 4;
        // Two chunks ahead plus half a step in progress.
        assert!((queue_ms(&c).0 - (940.0 + 2.5 * 20.0)).abs() < 1e-9);
        c.inflight_forward_prompt_tokens = 1000;
        assert_eq!(queue_ms(&c).1, 11_000);
    }

    #[test]
    fn slot_wait_counts_the_decode_of_the_requests_holding_the_slots() {
        let mut c = peer(0.0, 0);
        c.stats.waiting = 3;
        // No configured limit: no slot wait, however long the queue.
        assert_eq!(slot_wait_ms(&c), 0.0);
        let slots = |max_running, decode_ms| {
            Some(EngineSlots {
                max_running,
                decode_ms,
            })
        };
        // A serial engine with three requests ahead (the scrape shows none running, as
        // an engine without metrics does): half of the first's decode, then two whole.
        c.stats.slots = slots(1, 400.0);
        assert!((slot_wait_ms(&c) - 2.5 * 400.0).abs() < 1e-9);
        // It is part of the queue estimate, and shown on its own in the decision.
        assert!((queue_ms(&c).0 - 2.5 * 400.0).abs() < 1e-9);
        let unit = Weights {
            w_rtt: 1.0,
            w_queue: 1.0,
        };
        let terms = cost_terms(100, &c, unit, 100);
        assert!((terms.slot_wait_ms - 2.5 * 400.0).abs() < 1e-9);
        assert!((terms.raw_queue_ms - 2.5 * 400.0).abs() < 1e-9);
        // A forward expected since the stats holds a slot too.
        c.inflight_forwards = 1;
        assert!((slot_wait_ms(&c) - 3.5 * 400.0).abs() < 1e-9);
        // Four slots all running, the forward ahead: two must finish, one per D / 4.
        c.stats.slots = slots(4, 400.0);
        c.stats.running = 4;
        c.stats.waiting = 0;
        assert!((slot_wait_ms(&c) - 1.5 * 100.0).abs() < 1e-9);
        // A free slot: no wait.
        c.inflight_forwards = 0;
        c.stats.running = 3;
        assert_eq!(slot_wait_ms(&c), 0.0);
        // Fewer running than the limit with requests waiting: KV or prefill holds
        // them back, not slots.
        c.stats.running = 2;
        c.stats.waiting = 9;
        assert_eq!(slot_wait_ms(&c), 0.0);
        // But forwards sent since take the free slots, and those beyond them wait:
        // three running of four, five forwards ahead, so four wait for a slot.
        c.stats.running = 3;
        c.stats.waiting = 0;
        c.inflight_forwards = 5;
        assert!((slot_wait_ms(&c) - 4.5 * 100.0).abs() < 1e-9);
        c.inflight_forwards = 0;
        // No decode measured yet: no estimate.
        c.stats.running = 4;
        c.stats.slots = slots(4, 0.0);
        assert_eq!(slot_wait_ms(&c), 0.0);
        c.stats.slots = slots(4, f64::NAN);
        assert_eq!(slot_wait_ms(&c), 0.0);
    }

    #[test]
    fn a_batching_engine_prefills_its_queue_inside_the_decode_that_frees_its_slots() {
        let mut c = peer(0.0, 0);
        c.stats.t_p_ms = 0.1;
        c.stats.decode_step_ms = 0.0;
        c.stats.unfinished_prefill_tokens = 10_000; // 1,000 ms of prefill ahead
        c.stats.waiting = 4;
        // Serial, one running and four waiting: the prefill and the decode of those
        // ahead add up.
        c.stats.running = 1;
        c.stats.slots = Some(EngineSlots {
            max_running: 1,
            decode_ms: 400.0,
        });
        let serial = 1_000.0 + 4.5 * 400.0;
        assert!((queue_ms(&c).0 - serial).abs() < 1e-9, "{}", queue_ms(&c).0);
        // Four slots, full, four waiting: the slots free in 4.5 x D / 4, against
        // 1,000 ms of prefill ahead; the longer counts. Fast decode (450 ms): the
        // prefill; slow decode (4,500 ms): the slots.
        c.stats.running = 4;
        for (decode_ms, queue) in [(400.0, 1_000.0), (4_000.0, 4_500.0)] {
            c.stats.slots = Some(EngineSlots {
                max_running: 4,
                decode_ms,
            });
            assert!((queue_ms(&c).0 - queue).abs() < 1e-9, "{}", queue_ms(&c).0);
        }
    }

    fn stats_v(incarnation: u64, version: u64) -> QueueStats {
        QueueStats {
            incarnation,
            version,
            ..QueueStats::default()
        }
    }

    #[test]
    fn ledger_clears_on_newer_stats_only() {
        let p = NodeId::from("b");
        let mut l = ForwardLedger::new();
        l.observe_stats(&p, &stats_v(0, 5), 0, 0.0);
        l.record_forward(&p, 0, 100, 100, 1000);
        l.record_forward(&p, 0, 50, 50, 1100);
        assert_eq!(l.pending(&p, 0), (2, 150));
        assert!(!l.observe_stats(&p, &stats_v(0, 5), 2000, 0.0));
        assert_eq!(l.pending(&p, 0), (2, 150));
        // Stats produced ~rtt/2 ago cannot reflect the forward sent 50 ms ago.
        assert!(l.observe_stats(&p, &stats_v(0, 6), 1150, 80.0));
        assert_eq!(l.pending(&p, 0), (1, 50));
        assert!(l.observe_stats(&p, &stats_v(0, 7), 1300, 80.0));
        assert_eq!(l.pending(&p, 0), (0, 0));
        let mut c = Candidate::idle("b", false, 1.0);
        l.record_forward(&p, 0, 7, 7, 1400);
        l.apply(&mut c, 0);
        assert_eq!(
            (c.inflight_forwards, c.inflight_forward_prompt_tokens),
            (1, 7)
        );
        l.forget(&p);
        assert_eq!(l.pending(&p, 0), (0, 0));
    }

    /// Two requests decided at once may record their forwards out of send order (the
    /// later one first): stats that reflect the earlier one clear it all the same.
    #[test]
    fn forwards_recorded_out_of_order_clear_in_send_order() {
        let p = NodeId::from("b");
        let mut l = ForwardLedger::new();
        l.record_forward(&p, 0, 500, 500, 104);
        l.record_forward(&p, 0, 1000, 1000, 100);
        assert!(l.observe_stats(&p, &stats_v(0, 1), 122, 20.0));
        assert_eq!(l.pending(&p, 0), (1, 500));
    }

    #[test]
    fn a_restarted_peers_first_stats_clear_what_its_dead_run_never_reflected() {
        // The dead run got far in versions; the restarted one counts from 1. Before
        // incarnations, its stats were "old" here for as long as the dead run had been
        // up, and the forwards sent meanwhile piled up against it: it was never chosen.
        let p = NodeId::from("b");
        let mut l = ForwardLedger::new();
        assert!(l.observe_stats(&p, &stats_v(100, 2_272), 0, 0.0));
        l.record_forward(&p, 0, 500, 500, 1000);
        assert!(l.observe_stats(&p, &stats_v(200, 1), 2000, 0.0));
        assert_eq!(l.pending(&p, 0), (0, 0));
        // An older copy of the run it follows changes nothing.
        l.record_forward(&p, 0, 500, 500, 2100);
        assert!(!l.observe_stats(&p, &stats_v(200, 1), 3000, 0.0));
        assert_eq!(l.pending(&p, 0), (1, 500));
        // A restart on a clock that reads earlier (a lower incarnation, which the
        // peer's gossip hears once membership vouches for it) is a new run here too:
        // its first stats clear what the dead run never reflected, and the bias.
        l.observe_forward_ttft(&p, 0, 100.0, 1100.0, 3000);
        assert!(l.forward_bias_ms(&p, 0, 3000) > 0.0);
        assert!(l.observe_stats(&p, &stats_v(150, 1), 4000, 0.0));
        assert_eq!(l.pending(&p, 0), (0, 0));
        assert_eq!(l.forward_bias_ms(&p, 0, 4000), 0.0);
    }

    /// A peer the cluster has forgotten leaves the ledger (`forget` had no caller: the
    /// ledger kept every peer id it ever heard of, pending forwards and bias), and a
    /// restarted one starts with no forward bias (the dead run's lateness is no
    /// evidence about a fresh process); new stats of the same run keep it.
    #[test]
    fn a_forgotten_peer_leaves_the_ledger_and_a_restarted_one_its_bias() {
        let (b, c) = (NodeId::from("b"), NodeId::from("c"));
        let mut l = ForwardLedger::new();
        for p in [&b, &c] {
            assert!(l.observe_stats(p, &stats_v(1, 1), 0, 0.0));
            l.record_forward(p, 0, 100, 100, 10);
            l.observe_forward_ttft(p, 0, 100.0, 1100.0, 10);
        }
        l.retain_peers(|p| *p == c);
        assert_eq!(l.pending(&b, 0), (0, 0));
        assert_eq!(l.forward_bias_ms(&b, 0, 10), 0.0);
        assert_eq!(l.pending(&c, 0), (1, 100));
        let bias = l.forward_bias_ms(&c, 0, 10);
        assert!(bias > 0.0);
        assert!(l.observe_stats(&c, &stats_v(1, 2), 5, 0.0));
        assert_eq!(l.forward_bias_ms(&c, 0, 10), bias);
        assert!(l.observe_stats(&c, &stats_v(2, 1), 20, 0.0));
        assert_eq!(l.forward_bias_ms(&c, 0, 20), 0.0);
    }

    #[test]
    fn other_deciders_are_assumed_to_forward_as_we_did() {
        let mut c = peer(10.0, 0);
        c.stats.running = 4;
        c.inflight_forwards = 2;
        c.inflight_forward_prompt_tokens = 3000;
        let alone = cost_terms(1000, &c, Weights::default(), 1000);
        c.deciders = 3;
        assert_eq!(c.expected_forwards(), (6.0, 9000));
        let three = cost_terms(1000, &c, Weights::default(), 1000);
        assert_eq!(three.tokens_ahead, 9000);
        assert!(three.queue_ms > alone.queue_ms && three.stall_ms > alone.stall_ms);
        // Without forwards of our own there is nothing to multiply.
        c.inflight_forwards = 0;
        c.inflight_forward_prompt_tokens = 0;
        assert_eq!(c.expected_forwards(), (0.0, 0));
        // The count-based baselines keep their own definition.
        assert_eq!(c.inflight_requests(), 4);
    }

    #[test]
    fn forward_bias_learns_decays_and_is_bounded() {
        let mut l = ForwardLedger::new();
        let b = NodeId::from("peer");
        assert_eq!(l.forward_bias_ms(&b, 0, 0), 0.0);
        // Forwards that take 1 s longer than predicted pull the bias towards +1 s.
        for i in 0..64 {
            l.observe_forward_ttft(&b, 0, 500.0, 1500.0, i * 10);
        }
        let learnt = l.forward_bias_ms(&b, 0, 640);
        assert!((learnt - 1000.0).abs() < 10.0, "{learnt}");
        // It enters the peer's queue term and the prediction, never the local one's.
        let mut c = peer(10.0, 0);
        l.apply(&mut c, 640);
        let t = cost_terms(100, &c, Weights::default(), 100);
        assert!((t.forward_bias_ms - learnt).abs() < 1e-6, "{t:?} {learnt}");
        assert!((t.raw_queue_ms - queue_ms(&c).0 - learnt).abs() < 1e-9);
        let mut local = Candidate::idle("a", true, 0.0);
        local.forward_bias_ms = 5000.0;
        assert_eq!(
            cost_terms(100, &local, Weights::default(), 100).forward_bias_ms,
            0.0
        );
        // Without new forwards it halves every half-life, so a peer is never shut out.
        let later = l.forward_bias_ms(&b, 0, 640 + FORWARD_BIAS_HALF_LIFE_MS as u64);
        assert!((later - learnt / 2.0).abs() < 1.0, "{later}");
        // Garbage is ignored, and one huge residual cannot push it past the bound.
        l.observe_forward_ttft(&b, 0, f64::NAN, 1.0, 700);
        l.observe_forward_ttft(&b, 0, 0.0, 1e12, 700);
        assert!(l.forward_bias_ms(&b, 0, 700) <= MAX_FORWARD_BIAS_MS);
        // A negative bias never makes the queue negative.
        let mut fast = peer(10.0, 0);
        fast.forward_bias_ms = -1e6;
        assert_eq!(
            cost_terms(100, &fast, Weights::default(), 100).raw_queue_ms,
            0.0
        );
    }

    #[test]
    fn forward_bias_learns_the_whole_lateness_in_closed_loop() {
        // The node predicts with the bias it has learnt so far and learns from the
        // prediction without it: forwards that always land 1 s after the model's
        // unbiased prediction end up predicted right, not half a second short.
        let mut l = ForwardLedger::new();
        let mut c = peer(10.0, 0);
        for i in 0..64u64 {
            l.apply(&mut c, i * 10);
            let t = cost_terms(1000, &c, Weights::default(), 1000);
            let unbiased = t.unbiased_estimated_ttft_ms().unwrap();
            let measured = unbiased + 1000.0;
            l.observe_forward_ttft(&c.node, 0, unbiased, measured, i * 10);
        }
        l.apply(&mut c, 640);
        let t = cost_terms(1000, &c, Weights::default(), 1000);
        let predicted = t.estimated_ttft_ms.unwrap();
        let measured = t.unbiased_estimated_ttft_ms().unwrap() + 1000.0;
        assert!(
            (measured - predicted).abs() < 10.0,
            "{predicted} against {measured}"
        );
    }

    #[test]
    fn ledger_is_bounded() {
        let p = NodeId::from("b");
        let mut l = ForwardLedger::new();
        for i in 0..(MAX_LEDGER_ENTRIES_PER_PEER as u64 + 10) {
            l.record_forward(&p, 0, 1, 1, i);
        }
        assert_eq!(
            l.pending(&p, 0),
            (
                MAX_LEDGER_ENTRIES_PER_PEER as u32,
                MAX_LEDGER_ENTRIES_PER_PEER as u64
            )
        );
    }

    #[test]
    fn ledger_keeps_each_engine_of_a_peer_apart() {
        let p = NodeId::from("b");
        let mut l = ForwardLedger::new();
        l.record_forward(&p, 0, 100, 100, 1000);
        l.record_forward(&p, 2, 40, 40, 1000);
        assert_eq!(
            (l.pending(&p, 0), l.pending(&p, 1), l.pending(&p, 2)),
            ((1, 100), (0, 0), (1, 40))
        );
        // Stats of engine 2 clear only engine 2's forwards.
        let stats = QueueStats {
            version: 1,
            replica: 2,
            ..QueueStats::default()
        };
        assert!(l.observe_stats(&p, &stats, 2000, 0.0));
        assert_eq!((l.pending(&p, 0), l.pending(&p, 2)), ((1, 100), (0, 0)));
        let mut c = Candidate::idle("b", false, 10.0);
        l.apply(&mut c, 2000);
        assert_eq!(c.inflight_forwards, 1);
        c.stats.replica = 2;
        l.apply(&mut c, 2000);
        assert_eq!(c.inflight_forwards, 0);
        // Engines past the bound keep nothing.
        l.record_forward(&p, MAX_REPLICAS, 5, 5, 3000);
        assert_eq!(l.pending(&p, MAX_REPLICAS), (0, 0));
        l.cancel_forward(&p, 0, 100, 100, 1000);
        assert_eq!(l.pending(&p, 0), (0, 0));
    }
}
