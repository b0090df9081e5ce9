//! Forward or serve: the rules around a policy's pick that keep routing safe.
//!
//! - A request that arrived with `hops >= max_hops` is served where it is (no
//!   forwarding loops, no ping-pong between nodes with different views); a node with
//!   several engines lets the policy pick among them alone.
//! - Unhealthy candidates are never chosen.
//! - When nothing can serve, the outcome says so ([`NoCandidate`]) and the driver
//!   answers 503.
//!
//! Both outcomes are serde so the node can show them at `/admin/decisions`.

use serde::{Deserialize, Serialize};

use crate::cost::{Candidate, CostTerms};
use crate::policy::{rank, Policy, PolicyKind, RouteRequest};
use crate::types::{NodeId, Weights};

/// Why the target was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DecisionReason {
    /// The policy's pick.
    Policy,
    /// The request had used its hops: served here (the policy asked only to pick among
    /// this node's engines, when it has several).
    MaxHops,
    /// The policy picked an unhealthy or unknown candidate; the local one (else the
    /// first healthy one) was used instead.
    PolicyFallback,
    /// `gorgo` picked the session's home over a cheaper candidate its queue estimate
    /// could not tell apart from it ([`crate::policy::SessionHomes`]).
    SessionHome,
}

/// Why nothing can serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NoCandidateReason {
    /// No candidate is healthy.
    NoneHealthy,
    /// The request must be served here (max hops) and the local engine is unhealthy.
    LocalUnhealthyAtMaxHops,
    /// The policy declined every candidate (e.g. `local-only` with the local engine
    /// down).
    PolicyDeclined,
}

/// One candidate as the decision saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CandidateExplain {
    /// The candidate node.
    pub node: NodeId,
    /// Which of its engines ([`crate::QueueStats::replica`]).
    #[serde(default)]
    pub replica: u16,
    /// True for the deciding node.
    pub is_local: bool,
    /// Whether it could be chosen.
    pub healthy: bool,
    /// Whether it was chosen.
    pub chosen: bool,
    /// Measured RTT, ms.
    pub rtt_ms: f64,
    /// Prompt tokens believed cached there.
    pub cached_tokens: u64,
    /// Requests running there, as last reported (the deciding node's own view for a
    /// local engine, the gossiped stats for a peer's): with `waiting` and
    /// `inflight_forwards`, the load the count-based policies compare.
    #[serde(default)]
    pub running: u32,
    /// Requests waiting there, as last reported.
    #[serde(default)]
    pub waiting: u32,
    /// This node's forwards to it not yet reflected in its stats.
    #[serde(default)]
    pub inflight_forwards: u32,
    /// Cost terms, for the cost-based policies.
    pub terms: Option<CostTerms>,
}

/// Where a request goes, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// Policy that decided.
    pub policy: PolicyKind,
    /// Index of the target in the candidate slice.
    pub target_index: usize,
    /// The node that serves.
    pub target: NodeId,
    /// Which of its engines the decision priced (a forward's target picks its engine
    /// again when the request arrives).
    #[serde(default)]
    pub target_replica: u16,
    /// True when served by the deciding node's own engine.
    pub is_local: bool,
    /// Hops the request had taken when it arrived here.
    pub hops: u8,
    /// Weights used.
    pub weights: Weights,
    /// Why this target.
    pub reason: DecisionReason,
    /// Every candidate considered.
    pub candidates: Vec<CandidateExplain>,
}

/// One routing decision as an operator reads it: an entry of a node's
/// `/admin/decisions` and a line of `gorgo sim --decisions N`'s `decisions.jsonl`, one
/// type so that the two can be compared decision by decision (docs/simulator.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecisionRecord {
    /// Request id on the deciding node (the simulator: the request's trace index).
    pub request_id: u64,
    /// Milliseconds since the node started (the simulator: since the run started).
    pub at_ms: u64,
    /// The policy used.
    pub policy: PolicyKind,
    /// Hops the request had taken when it arrived.
    pub hops: u8,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// The weights used (a refusal: the offer's).
    pub weights: Weights,
    /// Every candidate considered, with its rtt/prefill/queue terms.
    pub candidates: Vec<CandidateExplain>,
    /// The chosen node, `None` when nothing could serve or the forward was refused.
    pub winner: Option<NodeId>,
    /// Why (`policy`, `max-hops`, `policy-fallback`, `refused`, or why nothing could
    /// serve).
    pub reason: String,
    /// What became of a forward this decision chose, when it did not go as decided:
    /// `forward-refused` (the peer refused it) or `forward-failed` (it failed before
    /// its first byte); the request was then served locally or decided again. Absent
    /// otherwise: the record alone would name a winner that never served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forward_outcome: Option<String>,
    /// For a peer's forward decided (or refused) here: the node it came from and its
    /// request id there, which joins the two nodes' `/admin/decisions`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<ForwardOrigin>,
}

/// Where a forward came from ([`DecisionRecord::origin`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForwardOrigin {
    /// The node the client called.
    pub node: NodeId,
    /// The request's id on that node (its `/admin/decisions` `request_id`).
    pub request_id: u64,
}

impl DecisionRecord {
    /// The record of [`decide`]'s outcome for a request of `prompt_tokens` decided
    /// with `weights` at `at_ms`.
    pub fn of_outcome(
        request_id: u64,
        at_ms: u64,
        prompt_tokens: u64,
        weights: Weights,
        outcome: Result<Decision, NoCandidate>,
    ) -> Self {
        let (policy, hops, candidates, winner, reason) = match outcome {
            Ok(d) => (
                d.policy,
                d.hops,
                d.candidates,
                Some(d.target),
                kebab(d.reason),
            ),
            Err(n) => (n.policy, n.hops, n.candidates, None, kebab(n.reason)),
        };
        DecisionRecord {
            request_id,
            at_ms,
            policy,
            hops,
            prompt_tokens,
            weights,
            candidates,
            winner,
            reason,
            forward_outcome: None,
            origin: None,
        }
    }

    /// The record of a forward refused at `at_ms` ([`refuse_forward`]): no winner,
    /// reason `refused`, priced with the offer's weights.
    pub fn of_refusal(
        request_id: u64,
        at_ms: u64,
        policy: PolicyKind,
        hops: u8,
        prompt_tokens: u64,
        offer: &ForwardOffer,
        candidates: Vec<CandidateExplain>,
    ) -> Self {
        DecisionRecord {
            request_id,
            at_ms,
            policy,
            hops,
            prompt_tokens,
            weights: offer.weights,
            candidates,
            winner: None,
            reason: "refused".to_owned(),
            forward_outcome: None,
            origin: None,
        }
    }
}

/// A reason's serde name (`max-hops`, ...).
fn kebab(reason: impl Serialize) -> String {
    serde_json::to_value(reason)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// Nothing can serve the request: the driver answers 503.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NoCandidate {
    /// Policy that was asked.
    pub policy: PolicyKind,
    /// Hops the request had taken.
    pub hops: u8,
    /// Why nothing can serve.
    pub reason: NoCandidateReason,
    /// Every candidate considered.
    pub candidates: Vec<CandidateExplain>,
}

fn explain(
    candidates: &[Candidate],
    terms: Option<&[CostTerms]>,
    chosen: Option<usize>,
) -> Vec<CandidateExplain> {
    candidates
        .iter()
        .enumerate()
        .map(|(i, c)| CandidateExplain {
            node: c.node.clone(),
            replica: c.stats.replica,
            is_local: c.is_local,
            healthy: c.healthy,
            chosen: chosen == Some(i),
            rtt_ms: c.rtt_ms,
            cached_tokens: c.cached_tokens,
            running: c.stats.running,
            waiting: c.stats.waiting,
            inflight_forwards: c.inflight_forwards,
            terms: terms.and_then(|t| t.get(i).copied()),
        })
        .collect()
}

/// Decide where `req` is served. `hops` is how many times it has been forwarded
/// already; `rng_u64` is a fresh random number for the policy's tie-breaks.
pub fn decide(
    req: &RouteRequest<'_>,
    hops: u8,
    max_hops: u8,
    candidates: &[Candidate],
    policy: &mut dyn Policy,
    weights: Weights,
    rng_u64: u64,
) -> Result<Decision, NoCandidate> {
    let kind = policy.kind();
    let local = candidates.iter().position(|c| c.is_local && c.healthy);
    let no_candidate = |reason, terms: Option<&[CostTerms]>| NoCandidate {
        policy: kind,
        hops,
        reason,
        candidates: explain(candidates, terms, None),
    };
    let decision = |index: usize, reason, terms: Option<&[CostTerms]>| Decision {
        policy: kind,
        target_index: index,
        target: candidates[index].node.clone(),
        target_replica: candidates[index].stats.replica,
        is_local: candidates[index].is_local,
        hops,
        weights,
        reason,
        candidates: explain(candidates, terms, Some(index)),
    };

    if hops >= max_hops {
        let Some(first) = local else {
            // Nothing here takes requests and the peers cannot be chosen. The local
            // engines are priced among themselves all the same, as at none-healthy:
            // the record shows what serving here would have cost.
            let locals: Vec<usize> = (0..candidates.len())
                .filter(|&i| candidates[i].is_local)
                .collect();
            let subset: Vec<Candidate> = locals.iter().map(|&i| candidates[i].clone()).collect();
            let terms = policy.terms(req, &subset, weights);
            let mut err = no_candidate(NoCandidateReason::LocalUnhealthyAtMaxHops, None);
            for (&i, t) in locals.iter().zip(terms.into_iter().flatten()) {
                err.candidates[i].terms = Some(t);
            }
            return Err(err);
        };
        // Several local engines: the policy picks among them alone. The local engines
        // are priced among themselves either way (one engine too: nothing to choose,
        // but the record shows what serving here costs); the peers, which the request
        // cannot go to, are not.
        let locals: Vec<usize> = (0..candidates.len())
            .filter(|&i| candidates[i].is_local && candidates[i].healthy)
            .collect();
        let subset: Vec<Candidate> = locals.iter().map(|&i| candidates[i].clone()).collect();
        let (index, terms) = if locals.len() == 1 {
            (first, policy.terms(req, &subset, weights))
        } else {
            let choice = policy.choose(req, &subset, weights, rng_u64);
            let index = choice
                .index
                .and_then(|i| locals.get(i).copied())
                .unwrap_or(first);
            (index, choice.terms)
        };
        let mut d = decision(index, DecisionReason::MaxHops, None);
        for (&i, t) in locals.iter().zip(terms.into_iter().flatten()) {
            d.candidates[i].terms = Some(t);
        }
        return Ok(d);
    }
    if !candidates.iter().any(|c| c.healthy) {
        // Priced all the same (under the policies that price): what each would have
        // cost shows why none was missed.
        let terms = policy.terms(req, candidates, weights);
        return Err(no_candidate(
            NoCandidateReason::NoneHealthy,
            terms.as_deref(),
        ));
    }
    let choice = policy.choose(req, candidates, weights, rng_u64);
    let terms = choice.terms.as_deref();
    match choice.index {
        Some(i) if candidates.get(i).is_some_and(|c| c.healthy) => {
            let reason = if choice.session_home {
                DecisionReason::SessionHome
            } else {
                DecisionReason::Policy
            };
            Ok(decision(i, reason, terms))
        }
        Some(_) => {
            let fallback = local.or_else(|| candidates.iter().position(|c| c.healthy));
            // At least one candidate is healthy (checked above).
            match fallback {
                Some(i) => Ok(decision(i, DecisionReason::PolicyFallback, terms)),
                None => Err(no_candidate(NoCandidateReason::NoneHealthy, terms)),
            }
        }
        None => Err(no_candidate(NoCandidateReason::PolicyDeclined, terms)),
    }
}

/// What a forwarding node offers the target as its alternative: its own cost of
/// serving the request, and the weights and policy it priced it with, so that the
/// target prices its own cost on the same scale (under online tuning a request's
/// weights are its trial arm's, which need not be the target's incumbent; and two
/// nodes may run different policies, as during a change of `routing.policy`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ForwardOffer {
    /// The total of the forwarding node's local candidate, ms.
    pub cost_ms: f64,
    /// The weights of that decision.
    pub weights: Weights,
    /// The policy of that decision: a target deciding with another one does not
    /// compare (`gorgo`'s total holds a stall term that `gorgo-ttft`'s does not).
    pub policy: PolicyKind,
}

impl ForwardOffer {
    /// An offer, when its figures can be compared with: a finite, non-negative cost
    /// and weights `routing.weights` allows (in `[0, MAX_WEIGHT]`:
    /// [`Weights::out_of_range`]); a peer's garbage is ignored, not refused on (a
    /// `w_queue` of 1e300 priced any queue here past every offer). A weight of 0, an
    /// operator's choice to ignore a term, is a figure like any other.
    pub fn new(cost_ms: f64, weights: Weights, policy: PolicyKind) -> Option<Self> {
        (cost_ms.is_finite() && cost_ms >= 0.0 && weights.out_of_range().is_none()).then_some(
            ForwardOffer {
                cost_ms,
                weights,
                policy,
            },
        )
    }
}

/// A forward the target declined before serving a byte of it: serving it there would
/// cost more than the forwarding node's own engine, as the target sees its queue now.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Refusal {
    /// The target's `gorgo` cost of serving the request itself, ms.
    pub local_cost_ms: f64,
    /// The target's TTFT estimate for serving it itself, ms (what the forwarding
    /// node's forward bias learns from).
    pub local_estimated_ttft_ms: Option<f64>,
    /// What the forwarding node said serving it there would cost, ms.
    pub origin_cost_ms: f64,
}

/// How much dearer than the forwarding node's offer serving here must be before a
/// forward is refused, as a fraction of the offer: the cost model's own relative noise
/// ([`crate::fit::DEFAULT_NOISE_CV`]). The offer is also stale by the forward's round
/// trip: at a burst the forwarding node has taken more of it itself since.
pub const REFUSAL_MARGIN: f64 = crate::fit::DEFAULT_NOISE_CV;

/// Check a forward where it arrived, before it is served (`hops >= max_hops`).
///
/// Why: a node forwards on its peers' last gossiped stats, which cannot show what
/// reached the peer since, in particular the other nodes' forwards of the same burst:
/// on bursty traffic forwards met queues about 40% longer than predicted
/// (docs/policy.md, "Refusal at the target"). The target knows its own queue now. The
/// forwarding node sends the cost of its alternative, serving the request itself
/// ([`ForwardOffer`]: the total of its local candidate and the weights it used), and
/// the target refuses when its own local cost under `policy` and the same weights is
/// higher by more than the cost model's noise
/// ([`REFUSAL_MARGIN`]): the request then goes back and is served at the forwarding
/// node. Both ways the response travels the same link back, so the comparison needs
/// no RTT term. A refusal happens at most once per request: the forwarding node
/// serves a refused request itself.
///
/// `None` (serve here) for policies without a millisecond cost (only `gorgo` and
/// `gorgo-ttft` refuse), an offer priced by another policy than `policy`'s, a
/// non-finite offer, or no healthy local candidate (the
/// decision reports that). A refusal comes with every candidate as the check saw it
/// (none chosen), for `/admin/decisions`.
pub fn refuse_forward(
    req: &RouteRequest<'_>,
    candidates: &[Candidate],
    policy: &dyn Policy,
    offer: &ForwardOffer,
) -> Option<(Refusal, Vec<CandidateExplain>)> {
    let origin_cost_ms = offer.cost_ms;
    if !matches!(policy.kind(), PolicyKind::Gorgo | PolicyKind::GorgoTtft)
        || policy.kind() != offer.policy
        || !origin_cost_ms.is_finite()
    {
        return None;
    }
    // Priced, not decided: the decision (here, or among this node's engines at
    // max hops) is counted where it is made.
    let all = policy.terms(req, candidates, offer.weights)?;
    // The target serves on its cheapest engine (one it cannot price, a NaN or infinite
    // total, is never the cheapest over one it can; `policy::rank`). If it can price
    // none, the offer's finite cost wins: refused.
    let terms = candidates
        .iter()
        .zip(&all)
        .filter(|(c, _)| c.is_local && c.healthy)
        .map(|(_, t)| *t)
        .min_by(|a, b| rank(a.total_ms).total_cmp(&rank(b.total_ms)))?;
    if terms.total_ms <= origin_cost_ms * (1.0 + REFUSAL_MARGIN) {
        return None;
    }
    let refusal = Refusal {
        local_cost_ms: terms.total_ms,
        local_estimated_ttft_ms: terms.estimated_ttft_ms,
        origin_cost_ms,
    };
    Some((refusal, explain(candidates, Some(&all), None)))
}

/// The index of the local engine a decision priced cheapest among those that could
/// serve: where a forward that fails or is refused is served instead, what a forward
/// offers the peer as the cost of serving here ([`ForwardOffer`]), and whose estimate
/// the node then reports. One function, so that the node and the simulator send a
/// refused forward to the same engine.
pub fn best_local(candidates: &[CandidateExplain]) -> Option<usize> {
    candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| c.is_local && c.healthy)
        .filter_map(|(i, c)| Some((i, c.terms?.total_ms)))
        .filter(|(_, total)| total.is_finite())
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(i, _)| i)
}

impl Decision {
    /// The cost of serving at the deciding node itself (its [`best_local`] engine's
    /// `gorgo` total), when the policy computed one: what a forward offers
    /// ([`ForwardOffer`], [`refuse_forward`]).
    pub fn local_cost_ms(&self) -> Option<f64> {
        self.best_local_terms().map(|t| t.total_ms)
    }

    /// The estimated TTFT ([`CostTerms::estimated_ttft_ms`]) of the [`best_local`]
    /// engine: where a refused or failed forward is served, so what the node predicts
    /// for it then (plus the time the forward took), rather than the peer's estimate
    /// that proved wrong.
    pub fn local_estimated_ttft_ms(&self) -> Option<f64> {
        self.best_local_terms().and_then(|t| t.estimated_ttft_ms)
    }

    /// The terms of the [`best_local`] engine, when the policy priced it: what a
    /// refused or failed forward meets once it is served there
    /// ([`CostTerms::served_locally_after`]).
    pub fn best_local_terms(&self) -> Option<CostTerms> {
        best_local(&self.candidates).and_then(|i| self.candidates[i].terms)
    }
}
