//! Every routing policy of GORGO behind one object-safe trait.
//!
//! A policy only picks among the candidates it is given; the forward-or-serve rules
//! (max hops, health, no candidate) live in [`crate::decision`]. Policies never pick an
//! unhealthy candidate and return `None` when there is no healthy one.
//!
//! Ties are broken the same way everywhere: the local candidate if it is among the
//! best (serving locally costs no forward), else one of the best chosen by `rng_u64`.
//! `gorgo` widens its ties by the queue estimate's own error, and breaks those by the
//! session's home ([`SessionHomes`]).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::cost::{cost_terms, fewest_uncached_tokens, Candidate, CostTerms};
use crate::error::CoreError;
use crate::hash::{hash_bytes, HashChain};
use crate::types::Weights;

/// What a policy needs to know about the request being routed.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    /// The prompt's block hash chain (prefix identity).
    pub chain: &'a HashChain,
    /// Prompt length in tokens (tokenizer count, or the bytes-per-token estimate).
    pub prompt_tokens: u64,
    /// Hash of the client's session id (`x-session-id`), when it sent one.
    pub session_key: Option<u64>,
}

/// A policy's pick.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    /// Index into the candidate slice; `None` when no candidate is healthy.
    pub index: Option<usize>,
    /// Each candidate's cost terms, in candidate order, for the cost-based policies.
    pub terms: Option<Vec<CostTerms>>,
    /// `gorgo` picked the session's home over a cheaper candidate that the queue
    /// estimate could not tell apart from it ([`SessionHomes`]); the decision says so
    /// (`reason` `session-home`).
    #[serde(default)]
    pub session_home: bool,
}

impl Choice {
    fn pick(index: Option<usize>) -> Self {
        Choice {
            index,
            terms: None,
            session_home: false,
        }
    }
}

/// A routing rule. Object safe so a node can switch policy per request.
pub trait Policy: Send {
    /// Which policy this is (for explanation and metrics labels).
    fn kind(&self) -> PolicyKind;

    /// Pick one healthy candidate for `req`. `rng_u64` is a fresh random number from
    /// the caller, so policies stay deterministic under a seeded driver.
    fn choose(
        &mut self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        weights: Weights,
        rng_u64: u64,
    ) -> Choice;

    /// Every candidate's cost terms for `req`, when the policy prices candidates
    /// (`gorgo` and `gorgo-ttft` in milliseconds, `gorgo-paper` its mixed-unit score's
    /// parts; `None` for the others), without deciding anything: what a decision
    /// record shows where the policy made no choice (one engine at max hops, nothing
    /// healthy). A check that only prices (a forward's target weighing a refusal,
    /// [`crate::decision::refuse_forward`]) must not count as a decision where the
    /// policy keeps state of its decisions
    /// ([`SessionHomes`]: a forward counted there and again by the target's own choice
    /// among its engines weighed twice).
    fn terms(
        &self,
        _req: &RouteRequest<'_>,
        _candidates: &[Candidate],
        _weights: Weights,
    ) -> Option<Vec<CostTerms>> {
        None
    }
}

/// The names of every policy, as used in configs, CLI flags and the `x-gorgo-policy`
/// header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    /// [`Gorgo`]: the millisecond cost model.
    Gorgo,
    /// [`Gorgo`] without its decode-stall term: the greedy TTFT minimiser `gorgo` was
    /// before docs/policy.md's analysis, kept for comparison.
    GorgoTtft,
    /// [`GorgoPaper`]: the paper's mixed-unit score.
    GorgoPaper,
    /// [`LeastLoad`].
    LeastLoad,
    /// [`LeastRequest`].
    LeastRequest,
    /// [`PrefixCache`].
    PrefixCache,
    /// [`SessionAffinity`].
    SessionAffinity,
    /// [`SimpleSessionAffinity`].
    SimpleSessionAffinity,
    /// [`CacheAware`].
    CacheAware,
    /// [`RoundRobin`].
    RoundRobin,
    /// [`Random`].
    Random,
    /// [`LocalOnly`].
    LocalOnly,
    /// A central router with perfect instantaneous state (simulator only). The
    /// simulator feeds exact state; the rule itself is [`Gorgo`]'s.
    Oracle,
}

impl PolicyKind {
    /// Every policy, in a stable order.
    pub const ALL: [PolicyKind; 13] = [
        PolicyKind::Gorgo,
        PolicyKind::GorgoTtft,
        PolicyKind::GorgoPaper,
        PolicyKind::LeastLoad,
        PolicyKind::LeastRequest,
        PolicyKind::PrefixCache,
        PolicyKind::SessionAffinity,
        PolicyKind::SimpleSessionAffinity,
        PolicyKind::CacheAware,
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::LocalOnly,
        PolicyKind::Oracle,
    ];

    /// The kebab-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Gorgo => "gorgo",
            PolicyKind::GorgoTtft => "gorgo-ttft",
            PolicyKind::GorgoPaper => "gorgo-paper",
            PolicyKind::LeastLoad => "least-load",
            PolicyKind::LeastRequest => "least-request",
            PolicyKind::PrefixCache => "prefix-cache",
            PolicyKind::SessionAffinity => "session-affinity",
            PolicyKind::SimpleSessionAffinity => "simple-session-affinity",
            PolicyKind::CacheAware => "cache-aware",
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::Random => "random",
            PolicyKind::LocalOnly => "local-only",
            PolicyKind::Oracle => "oracle",
        }
    }

    /// The weights a policy starts with when not tuned: 1.0/1.0 for the millisecond
    /// model, the paper's learned 0.276/0.5 for `gorgo-paper`. Others ignore weights.
    pub fn default_weights(self) -> Weights {
        match self {
            PolicyKind::GorgoPaper => Weights {
                w_rtt: 0.276,
                w_queue: 0.5,
            },
            _ => Weights::default(),
        }
    }

    /// True for the policies whose score uses the weights (the ones worth tuning).
    pub fn uses_weights(self) -> bool {
        matches!(
            self,
            PolicyKind::Gorgo | PolicyKind::GorgoTtft | PolicyKind::GorgoPaper | PolicyKind::Oracle
        )
    }

    /// True for the policies whose decision terms are milliseconds: all but
    /// `gorgo-paper`, whose prefill and queue terms count tokens.
    pub fn terms_in_ms(self) -> bool {
        self != PolicyKind::GorgoPaper
    }

    /// A fresh instance of this policy.
    pub fn build(self) -> Box<dyn Policy> {
        build(self)
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PolicyKind {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = PolicyKind::ALL.iter().map(|k| k.as_str()).collect();
                CoreError::InvalidConfig {
                    field: "policy".into(),
                    reason: format!(
                        "unknown policy `{s}` (expected one of {})",
                        names.join(", ")
                    ),
                }
            })
    }
}

/// A fresh instance of the policy `kind`.
pub fn build(kind: PolicyKind) -> Box<dyn Policy> {
    match kind {
        PolicyKind::Gorgo => Box::new(Gorgo::default()),
        PolicyKind::Oracle => Box::new(Gorgo::new(PolicyKind::Oracle)),
        PolicyKind::GorgoTtft => Box::new(Gorgo::new(PolicyKind::GorgoTtft)),
        PolicyKind::GorgoPaper => Box::new(GorgoPaper),
        PolicyKind::LeastLoad => Box::new(LeastLoad),
        PolicyKind::LeastRequest => Box::new(LeastRequest),
        PolicyKind::PrefixCache => Box::new(PrefixCache::default()),
        PolicyKind::SessionAffinity => Box::new(SessionAffinity),
        PolicyKind::SimpleSessionAffinity => Box::new(SimpleSessionAffinity),
        PolicyKind::CacheAware => Box::new(CacheAware::default()),
        PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
        PolicyKind::Random => Box::new(Random),
        PolicyKind::LocalOnly => Box::new(LocalOnly),
    }
}

/// A score as the policies rank it, smallest first: a finite score as it is, any other
/// (NaN, either infinity) as `+inf`, so that a candidate a policy cannot price is never
/// preferred over one it can.
///
/// Why: a weight of 0 (`routing.weights.w_queue = 0` is allowed) times a term that
/// prices to infinity (a peer's gossiped `t_p_ms` finite but absurd, 1e306) is NaN, and
/// on x86-64 that NaN has its sign bit set: `f64::total_cmp` alone puts it before every
/// number, so the one candidate that cannot be priced was the cheapest.
pub(crate) fn rank(score: f64) -> f64 {
    if score.is_finite() {
        score
    } else {
        f64::INFINITY
    }
}

/// Index of the healthy candidate with the smallest key, compared lexicographically
/// element by element as [`rank`]ed (a NaN or infinite element never beats a finite
/// one). Ties: the local candidate if tied, else the `rng_u64`-th of the tied ones.
fn pick_min<const N: usize>(
    candidates: &[Candidate],
    rng_u64: u64,
    key: impl Fn(usize, &Candidate) -> [f64; N],
) -> Option<usize> {
    let cmp = |a: &[f64; N], b: &[f64; N]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| rank(*x).total_cmp(&rank(*y)))
            .find(|o| o.is_ne())
            .unwrap_or(std::cmp::Ordering::Equal)
    };
    let mut best: Option<[f64; N]> = None;
    let mut ties = 0u64;
    let mut local_ties = 0u64;
    for (i, c) in candidates.iter().enumerate().filter(|(_, c)| c.healthy) {
        let k = key(i, c);
        match best.as_ref().map(|b| cmp(&k, b)) {
            Some(std::cmp::Ordering::Greater) => continue,
            Some(std::cmp::Ordering::Equal) => ties += 1,
            _ => {
                best = Some(k);
                ties = 1;
                local_ties = 0;
            }
        }
        if c.is_local {
            local_ties += 1;
        }
    }
    let best = best?;
    // A tie that includes local engines stays local (no forward for nothing); among
    // tied local engines, or tied peers, the draw is random.
    let local_only = local_ties > 0;
    let mut nth = rng_u64 % if local_only { local_ties } else { ties };
    for (i, c) in candidates.iter().enumerate().filter(|(_, c)| c.healthy) {
        if (!local_only || c.is_local) && cmp(&key(i, c), &best).is_eq() {
            if nth == 0 {
                return Some(i);
            }
            nth -= 1;
        }
    }
    None
}

/// Matched prefix tokens, capped at the prompt.
fn matched(req: &RouteRequest<'_>, c: &Candidate) -> u64 {
    c.cached_tokens.min(req.prompt_tokens)
}

/// How much of the best candidate's queue estimate `gorgo` treats as a tie: the cost
/// model's own relative noise ([`crate::fit::DEFAULT_NOISE_CV`], the forward refusals'
/// margin too). Under load a queue estimate is off by about this much (docs/policy.md,
/// "Session homes"), so candidates whose totals differ by less are not told apart by
/// it.
pub const SESSION_HOME_WINDOW: f64 = crate::fit::DEFAULT_NOISE_CV;

/// Slots of [`SessionHomes`]' table of session keys: enough to hold every key that
/// carries a share of one engine among a cluster's engines many times over.
const SESSION_KEY_SLOTS: usize = 4096;

/// Decisions between two halvings of [`SessionHomes`]' counts: the table measures
/// the recent traffic, not the whole run's.
const SESSION_KEY_HALF_LIFE: u32 = 4096;

/// Where `gorgo` sends a request when its cost model cannot tell the cheapest
/// candidates apart: the session's home, by rendezvous hashing of its session key
/// (`x-session-id`, else the first block hash), as `session-affinity` does.
///
/// Why: under load the queue term dominates every candidate's cost and is itself off
/// by a quarter or so ([`SESSION_HOME_WINDOW`]); picking the cheapest by that noise
/// scatters a session's turns, and a returning turn whose prefix the view has
/// forgotten (the prefix index models what the engine holds, which at saturation is
/// little) then lands where nothing of it is left, re-prefilling what its home still
/// holds. The home is the same on every node without a message, so nodes deciding the
/// same burst agree too. It never costs a visible cache hit (only candidates caching at
/// least as much as the cheapest qualify) and never more than the window.
///
/// A key that carries more than one engine's share of the recent decisions is no
/// session: it is a prefix that every request shares (a system prompt as the first
/// block, as on the Mooncake conversation trace, or no block at all), and pinning it
/// would send everything to one engine. Such keys are counted (a heavy-hitter table:
/// a slot keeps its key while its count is above zero, a colliding key wears it down)
/// and routed by cost alone.
#[derive(Debug, Clone)]
pub struct SessionHomes {
    slots: Vec<(u64, u32)>,
    decisions: u32,
}

impl Default for SessionHomes {
    fn default() -> Self {
        SessionHomes {
            slots: vec![(0, 0); SESSION_KEY_SLOTS],
            decisions: 0,
        }
    }
}

impl SessionHomes {
    /// Count one decision for `key`; true when the key is a session's (it carries at
    /// most `1 / engines` of the recent decisions).
    pub fn observe(&mut self, key: u64, engines: usize) -> bool {
        let slot =
            &mut self.slots[(hash_bytes(&key.to_le_bytes()) % SESSION_KEY_SLOTS as u64) as usize];
        if slot.0 == key {
            slot.1 = slot.1.saturating_add(1);
        } else if slot.1 == 0 {
            *slot = (key, 1);
        } else {
            slot.1 -= 1;
        }
        let count = if slot.0 == key { slot.1 } else { 0 };
        self.decisions += 1;
        if self.decisions >= SESSION_KEY_HALF_LIFE {
            self.decisions /= 2;
            for s in &mut self.slots {
                s.1 /= 2;
            }
        }
        (count as f64) * (engines.max(1) as f64) <= self.decisions as f64
    }
}

/// `gorgo`: minimise, in milliseconds, the estimated TTFT plus the stall the request's
/// prefill inflicts on the batch running there,
/// `w_rtt * RTT + t_p * uncached + w_queue * queue_ms + stall_ms` (docs/design.md and
/// docs/policy.md; see [`crate::cost`]). Among the candidates whose total exceeds the
/// cheapest's by at most [`SESSION_HOME_WINDOW`] times the cheapest's (weighted) queue
/// term, caching no less than it, the session's home ([`SessionHomes`]). Also serves as
/// `oracle` when the simulator feeds it exact state, and as `gorgo-ttft` (the same
/// without the stall term).
#[derive(Debug, Clone)]
pub struct Gorgo {
    kind: PolicyKind,
    homes: SessionHomes,
}

impl Default for Gorgo {
    fn default() -> Self {
        Gorgo::new(PolicyKind::Gorgo)
    }
}

impl Gorgo {
    fn new(kind: PolicyKind) -> Self {
        Gorgo {
            kind,
            homes: SessionHomes::default(),
        }
    }

    /// Every candidate's terms (`gorgo-ttft`: without the stall).
    fn priced(
        &self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        weights: Weights,
    ) -> Vec<CostTerms> {
        let greedy = self.kind == PolicyKind::GorgoTtft;
        let fewest = fewest_uncached_tokens(req.prompt_tokens, candidates);
        candidates
            .iter()
            .map(|c| {
                let mut t = cost_terms(req.prompt_tokens, c, weights, fewest);
                if greedy {
                    t.stall_ms = 0.0;
                    t.total_ms = t.rtt_ms + t.prefill_ms + t.queue_ms;
                }
                t
            })
            .collect()
    }
}

impl Policy for Gorgo {
    fn kind(&self) -> PolicyKind {
        self.kind
    }

    fn terms(
        &self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        weights: Weights,
    ) -> Option<Vec<CostTerms>> {
        Some(self.priced(req, candidates, weights))
    }

    fn choose(
        &mut self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        weights: Weights,
        rng_u64: u64,
    ) -> Choice {
        let terms = self.priced(req, candidates, weights);
        let cheapest = pick_min(candidates, rng_u64, |i, _| [terms[i].total_ms]);
        let key = session_key(req);
        let engines = candidates.iter().filter(|c| c.healthy).count();
        let is_session = self.homes.observe(key, engines);
        // No queue, no window: exact ties keep their rule (stay local). The window is
        // the weighted queue term, in the total's units: with `w_queue` below 1 the raw
        // estimate could let a home cost more than the refusal margin over the
        // cheapest, and the target would refuse what it was sent on the same stats.
        let window = |b: usize| SESSION_HOME_WINDOW * terms[b].queue_ms;
        let home = cheapest
            .filter(|&b| is_session && window(b) > 0.0)
            .and_then(|b| {
                let best = &terms[b];
                let limit = best.total_ms + window(b);
                candidates
                    .iter()
                    .enumerate()
                    .filter(|&(i, c)| {
                        c.healthy
                            && terms[i].cached_tokens >= best.cached_tokens
                            && terms[i].total_ms <= limit
                    })
                    .max_by_key(|&(_, c)| rendezvous(key, c))
                    .map(|(i, _)| i)
            });
        let session_home = home.is_some() && home != cheapest;
        Choice {
            index: home.or(cheapest),
            terms: Some(terms),
            session_home,
        }
    }
}

/// `gorgo-paper`: the paper's score, `w_rtt * RTT_ms + uncached_tokens + w_queue *
/// queued_prompt_tokens` (mixed units: ms and tokens). Queued tokens are the raw prompt
/// tokens dispatched and not finished, plus the raw prompt tokens of this node's own
/// forwards since the stats ([`Candidate::inflight_forward_raw_prompt_tokens`]).
/// The returned terms carry the score's parts (`prefill_ms` holds uncached tokens,
/// `queue_ms` weighted queued tokens), and the `gorgo` model's TTFT prediction with the
/// forward bias it holds (`forward_bias_ms`), as `gorgo`'s terms do.
#[derive(Debug, Clone, Default)]
pub struct GorgoPaper;

impl GorgoPaper {
    /// Each candidate's score, its parts as terms.
    fn scored(
        &self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        weights: Weights,
    ) -> Vec<CostTerms> {
        candidates
            .iter()
            .map(|c| {
                let cached_tokens = matched(req, c);
                let uncached_tokens = req.prompt_tokens - cached_tokens;
                let rtt = if c.is_local {
                    0.0
                } else if c.rtt_ms.is_finite() && c.rtt_ms >= 0.0 {
                    weights.w_rtt * c.rtt_ms
                } else {
                    f64::INFINITY
                };
                // Raw prompt tokens, as the stats count them (the forwards' prefill
                // tokens, what `gorgo` counts, would mix two counts).
                let queued = c
                    .stats
                    .queued_prompt_tokens
                    .saturating_add(c.inflight_forward_raw_prompt_tokens);
                let queue = weights.w_queue * queued as f64;
                CostTerms {
                    rtt_ms: rtt,
                    prefill_ms: uncached_tokens as f64,
                    queue_ms: queue,
                    stall_ms: 0.0,
                    total_ms: rtt + uncached_tokens as f64 + queue,
                    cached_tokens,
                    uncached_tokens,
                    reprefill_tokens: 0,
                    t_p_ms: 1.0,
                    raw_queue_ms: queued as f64,
                    // The bias the prediction below holds (the score holds none): what
                    // `unbiased_estimated_ttft_ms` takes out before the forward ledger
                    // learns from it. Left at 0, the ledger learnt from the biased
                    // prediction, and the bias settled at half the lateness.
                    forward_bias_ms: crate::cost::biased_queue_ms(c) - crate::cost::queue_ms(c).0,
                    slot_wait_ms: 0.0,
                    tokens_ahead: queued,
                    // The paper's score is in tokens; the prediction is the gorgo
                    // model's, so both cost-based policies are checked the same way.
                    estimated_ttft_ms: crate::cost::finite(crate::cost::estimated_ttft_ms(
                        req.prompt_tokens,
                        c,
                    )),
                }
            })
            .collect()
    }
}

impl Policy for GorgoPaper {
    fn kind(&self) -> PolicyKind {
        PolicyKind::GorgoPaper
    }

    fn terms(
        &self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        weights: Weights,
    ) -> Option<Vec<CostTerms>> {
        Some(self.scored(req, candidates, weights))
    }

    fn choose(
        &mut self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        weights: Weights,
        rng_u64: u64,
    ) -> Choice {
        let terms = self.scored(req, candidates, weights);
        let index = pick_min(candidates, rng_u64, |i, _| [terms[i].total_ms]);
        Choice {
            index,
            terms: Some(terms),
            session_home: false,
        }
    }
}

/// `least-load`: fewest running + waiting requests + used KV tokens (the paper's
/// baseline, AIBrix's definition). This node's forwards since the stats count as
/// requests, and their prompt tokens as KV they will use.
#[derive(Debug, Clone, Default)]
pub struct LeastLoad;

impl Policy for LeastLoad {
    fn kind(&self) -> PolicyKind {
        PolicyKind::LeastLoad
    }

    fn choose(
        &mut self,
        _req: &RouteRequest<'_>,
        candidates: &[Candidate],
        _w: Weights,
        rng_u64: u64,
    ) -> Choice {
        // Saturating: a peer's gossiped KV gauge is not range-checked, and an engine's
        // report of 1.8e19 or more reads as `u64::MAX` in a node's own view; a plain sum
        // panicked in debug builds and wrapped to nearly 0 in release, making the
        // broken engine the least loaded.
        Choice::pick(pick_min(candidates, rng_u64, |_, c| {
            [c.inflight_requests()
                .saturating_add(c.stats.kv_used_tokens)
                .saturating_add(c.inflight_forward_prompt_tokens) as f64]
        }))
    }
}

/// `least-request`: fewest in-flight requests (running + waiting + this node's
/// forwards since the stats).
#[derive(Debug, Clone, Default)]
pub struct LeastRequest;

impl Policy for LeastRequest {
    fn kind(&self) -> PolicyKind {
        PolicyKind::LeastRequest
    }

    fn choose(
        &mut self,
        _req: &RouteRequest<'_>,
        candidates: &[Candidate],
        _w: Weights,
        rng_u64: u64,
    ) -> Choice {
        Choice::pick(pick_min(candidates, rng_u64, |_, c| {
            [c.inflight_requests() as f64]
        }))
    }
}

/// `prefix-cache`: the AIBrix/Preble rule. If the spread of in-flight requests
/// (max - min) exceeds `imbalance_requests` (16), route as `least-request`; otherwise
/// keep the candidates whose load is at most mean + 2 standard deviations, and pick the
/// longest matched prefix, ties by fewest in-flight requests.
#[derive(Debug, Clone)]
pub struct PrefixCache {
    /// Load spread above which cache affinity yields to balance.
    pub imbalance_requests: u64,
}

impl Default for PrefixCache {
    fn default() -> Self {
        PrefixCache {
            imbalance_requests: 16,
        }
    }
}

impl Policy for PrefixCache {
    fn kind(&self) -> PolicyKind {
        PolicyKind::PrefixCache
    }

    fn choose(
        &mut self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        _w: Weights,
        rng_u64: u64,
    ) -> Choice {
        let loads = || {
            candidates
                .iter()
                .filter(|c| c.healthy)
                .map(|c| c.inflight_requests())
        };
        let (Some(max), Some(min)) = (loads().max(), loads().min()) else {
            return Choice::pick(None);
        };
        if max - min > self.imbalance_requests {
            return Choice::pick(pick_min(candidates, rng_u64, |_, c| {
                [c.inflight_requests() as f64]
            }));
        }
        let n = loads().count() as f64;
        let mean = loads().map(|l| l as f64).sum::<f64>() / n;
        let var = loads().map(|l| (l as f64 - mean).powi(2)).sum::<f64>() / n;
        let limit = mean + 2.0 * var.sqrt();
        Choice::pick(pick_min(candidates, rng_u64, |_, c| {
            let load = c.inflight_requests() as f64;
            let excluded = if load <= limit + 1e-9 { 0.0 } else { 1.0 };
            [excluded, -(matched(req, c) as f64), load]
        }))
    }
}

/// The session key of a request: the client's session id, else the first block hash
/// (a conversation's turns share their first block).
fn session_key(req: &RouteRequest<'_>) -> u64 {
    req.session_key
        .or_else(|| req.chain.hashes.first().copied())
        .unwrap_or(0)
}

/// Rendezvous (highest random weight) score of `node` for `key`.
/// A node's engines other than the first add their replica number to the node's
/// hash, so one-engine clusters map sessions as before replicas existed.
fn rendezvous(key: u64, c: &Candidate) -> u64 {
    let mut buf = [0u8; 18];
    buf[..8].copy_from_slice(&key.to_le_bytes());
    buf[8..16].copy_from_slice(&hash_bytes(c.node.0.as_bytes()).to_le_bytes());
    buf[16..].copy_from_slice(&c.stats.replica.to_le_bytes());
    let len = if c.stats.replica == 0 { 16 } else { 18 };
    hash_bytes(&buf[..len])
}

/// `session-affinity`: rendezvous hashing of the session key (`x-session-id`, else the
/// first block hash): every node maps a session to the same healthy candidate, and a
/// node leaving only moves the sessions it held.
#[derive(Debug, Clone, Default)]
pub struct SessionAffinity;

impl Policy for SessionAffinity {
    fn kind(&self) -> PolicyKind {
        PolicyKind::SessionAffinity
    }

    fn choose(
        &mut self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        _w: Weights,
        _rng: u64,
    ) -> Choice {
        let key = session_key(req);
        let index = candidates
            .iter()
            .enumerate()
            .filter(|(_, c)| c.healthy)
            .max_by_key(|(_, c)| rendezvous(key, c))
            .map(|(i, _)| i);
        Choice::pick(index)
    }
}

/// Tokens hashed by `simple-session-affinity`.
pub const SIMPLE_AFFINITY_TOKENS: u64 = 256;

/// `simple-session-affinity`: the paper's baseline, `hash(first 256 tokens) mod n` over
/// the healthy candidates ordered by node id. The hash is the chain hash of the block
/// that completes the first 256 tokens (the whole prompt's last hash if shorter).
#[derive(Debug, Clone, Default)]
pub struct SimpleSessionAffinity;

impl Policy for SimpleSessionAffinity {
    fn kind(&self) -> PolicyKind {
        PolicyKind::SimpleSessionAffinity
    }

    fn choose(
        &mut self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        _w: Weights,
        _rng: u64,
    ) -> Choice {
        let chain = req.chain;
        let mut covered = 0u64;
        let mut key = 0u64;
        for (h, &t) in chain.hashes.iter().zip(&chain.block_tokens) {
            key = *h;
            covered += t as u64;
            if covered >= SIMPLE_AFFINITY_TOKENS {
                break;
            }
        }
        let mut healthy: Vec<usize> = (0..candidates.len())
            .filter(|&i| candidates[i].healthy)
            .collect();
        if healthy.is_empty() {
            return Choice::pick(None);
        }
        healthy.sort_by(|&a, &b| {
            let key = |i: usize| (&candidates[i].node, candidates[i].stats.replica);
            key(a).cmp(&key(b))
        });
        Choice::pick(Some(healthy[(key % healthy.len() as u64) as usize]))
    }
}

/// `cache-aware`: the SGLang router's rule. The system is imbalanced when
/// `max_load - min_load > balance_abs` (64) and `max_load > balance_rel * min_load`
/// (1.5); then route to the least loaded. Otherwise, if the best match covers more than
/// `cache_threshold` (0.3) of the prompt, route to the longest match; else to the
/// candidate with the smallest cache (fewest used KV tokens), where new prefixes cost
/// the least eviction. Load is in-flight requests.
#[derive(Debug, Clone)]
pub struct CacheAware {
    /// Absolute load spread for imbalance, requests.
    pub balance_abs: u64,
    /// Relative load ratio for imbalance.
    pub balance_rel: f64,
    /// Matched share of the prompt above which cache affinity wins.
    pub cache_threshold: f64,
}

impl Default for CacheAware {
    fn default() -> Self {
        CacheAware {
            balance_abs: 64,
            balance_rel: 1.5,
            cache_threshold: 0.3,
        }
    }
}

impl Policy for CacheAware {
    fn kind(&self) -> PolicyKind {
        PolicyKind::CacheAware
    }

    fn choose(
        &mut self,
        req: &RouteRequest<'_>,
        candidates: &[Candidate],
        _w: Weights,
        rng_u64: u64,
    ) -> Choice {
        let healthy = || candidates.iter().filter(|c| c.healthy);
        let (Some(max), Some(min)) = (
            healthy().map(|c| c.inflight_requests()).max(),
            healthy().map(|c| c.inflight_requests()).min(),
        ) else {
            return Choice::pick(None);
        };
        if max - min > self.balance_abs && max as f64 > self.balance_rel * min as f64 {
            return Choice::pick(pick_min(candidates, rng_u64, |_, c| {
                [c.inflight_requests() as f64]
            }));
        }
        let best_match = healthy().map(|c| matched(req, c)).max().unwrap_or(0);
        let rate = if req.prompt_tokens == 0 {
            0.0
        } else {
            best_match as f64 / req.prompt_tokens as f64
        };
        let index = if rate > self.cache_threshold {
            pick_min(candidates, rng_u64, |_, c| {
                [-(matched(req, c) as f64), c.inflight_requests() as f64]
            })
        } else {
            pick_min(candidates, rng_u64, |_, c| {
                [c.stats.kv_used_tokens as f64, c.inflight_requests() as f64]
            })
        };
        Choice::pick(index)
    }
}

/// `round-robin`: the next healthy candidate in turn.
#[derive(Debug, Clone, Default)]
pub struct RoundRobin {
    next: u64,
}

impl Policy for RoundRobin {
    fn kind(&self) -> PolicyKind {
        PolicyKind::RoundRobin
    }

    fn choose(
        &mut self,
        _req: &RouteRequest<'_>,
        candidates: &[Candidate],
        _w: Weights,
        _rng: u64,
    ) -> Choice {
        let n = candidates.iter().filter(|c| c.healthy).count() as u64;
        if n == 0 {
            return Choice::pick(None);
        }
        let nth = (self.next % n) as usize;
        self.next = self.next.wrapping_add(1);
        Choice::pick(
            candidates
                .iter()
                .enumerate()
                .filter(|(_, c)| c.healthy)
                .nth(nth)
                .map(|(i, _)| i),
        )
    }
}

/// `random`: a uniformly random healthy candidate.
#[derive(Debug, Clone, Default)]
pub struct Random;

impl Policy for Random {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Random
    }

    fn choose(
        &mut self,
        _req: &RouteRequest<'_>,
        candidates: &[Candidate],
        _w: Weights,
        rng_u64: u64,
    ) -> Choice {
        let n = candidates.iter().filter(|c| c.healthy).count() as u64;
        if n == 0 {
            return Choice::pick(None);
        }
        let nth = (rng_u64 % n) as usize;
        Choice::pick(
            candidates
                .iter()
                .enumerate()
                .filter(|(_, c)| c.healthy)
                .nth(nth)
                .map(|(i, _)| i),
        )
    }
}

/// `local-only`: never forward (reference mode: what a region alone would do).
#[derive(Debug, Clone, Default)]
pub struct LocalOnly;

impl Policy for LocalOnly {
    fn kind(&self) -> PolicyKind {
        PolicyKind::LocalOnly
    }

    fn choose(
        &mut self,
        _req: &RouteRequest<'_>,
        candidates: &[Candidate],
        _w: Weights,
        _rng: u64,
    ) -> Choice {
        // Among several local engines, the one with the fewest requests (what a
        // region's own load balancer would do).
        Choice::pick(
            candidates
                .iter()
                .enumerate()
                .filter(|(_, c)| c.is_local && c.healthy)
                .min_by_key(|(_, c)| c.stats.running as u64 + c.stats.waiting as u64)
                .map(|(i, _)| i),
        )
    }
}
