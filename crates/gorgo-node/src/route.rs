//! Routing: candidates from local state and the peer table, the core cost model, and
//! a bounded log of recent decisions for `/admin/decisions`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

use gorgo_core::cost::{cost_terms, Candidate, CostTerms, ForwardLedger};
use gorgo_core::{NodeId, Weights};
use parking_lot::Mutex;
use serde::Serialize;

/// Policy names DESIGN.md defines that a live node can run (`oracle` is simulator-only).
const POLICIES: &[&str] = &[
    "gorgo",
    "gorgo-paper",
    "least-load",
    "least-request",
    "prefix-cache",
    "session-affinity",
    "simple-session-affinity",
    "cache-aware",
    "round-robin",
    "random",
    "local-only",
];

/// Check a policy name; the error lists the valid ones.
pub fn parse_policy(name: &str) -> Result<String, String> {
    if POLICIES.contains(&name) {
        Ok(name.to_owned())
    } else {
        Err(format!(
            "unknown policy `{name}` (expected one of {})",
            POLICIES.join(", ")
        ))
    }
}

/// One candidate in a recorded decision.
#[derive(Debug, Clone, Serialize)]
pub struct CandidateRecord {
    /// The candidate node.
    pub node: NodeId,
    /// This node itself.
    pub is_local: bool,
    /// Whether it could serve.
    pub healthy: bool,
    /// The cost terms (ms) under the weights in force.
    pub terms: CostTerms,
}

/// One routing decision, as `/admin/decisions` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct DecisionRecord {
    /// Request id on this node.
    pub request_id: u64,
    /// Milliseconds since the node started.
    pub at_ms: u64,
    /// The policy used.
    pub policy: String,
    /// Hops the request had taken when it arrived.
    pub hops: u8,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// The weights used.
    pub weights: Weights,
    /// Every candidate considered.
    pub candidates: Vec<CandidateRecord>,
    /// The chosen node, `None` when nothing could serve.
    pub winner: Option<NodeId>,
    /// Why (e.g. `max-hops`, `cheapest`, `no-candidate`).
    pub reason: &'static str,
}

/// The outcome of a decision.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    /// Serve on the local engine.
    Local,
    /// Forward to this peer.
    Peer(NodeId),
    /// Nothing can serve.
    Nothing,
}

/// Inputs of one decision besides the candidates.
#[derive(Debug, Clone)]
pub struct DecisionInput<'a> {
    /// Request id for the log.
    pub request_id: u64,
    /// Policy name (validated).
    pub policy: &'a str,
    /// Hops taken so far.
    pub hops: u8,
    /// The max-hops guard.
    pub max_hops: u8,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Session key hash (header `x-session-id` or the first block hash).
    pub session_key: u64,
    /// Weights in force.
    pub weights: Weights,
    /// Milliseconds since the node started.
    pub now_ms: u64,
}

/// The router's own state: decision log, forward ledger, round-robin cursor.
#[derive(Debug)]
pub struct Router {
    log: Mutex<VecDeque<DecisionRecord>>,
    log_capacity: usize,
    /// This node's forwards to each peer not yet visible in their stats.
    pub ledger: Mutex<ForwardLedger>,
    cursor: AtomicU64,
}

impl Router {
    /// A router keeping the last `log_capacity` decisions.
    pub fn new(log_capacity: usize) -> Self {
        Router {
            log: Mutex::new(VecDeque::with_capacity(log_capacity.min(4096))),
            log_capacity: log_capacity.max(1),
            ledger: Mutex::new(ForwardLedger::new()),
            cursor: AtomicU64::new(0),
        }
    }

    /// The last `limit` decisions, newest first.
    pub fn recent(&self, limit: usize) -> Vec<DecisionRecord> {
        self.log.lock().iter().rev().take(limit).cloned().collect()
    }

    /// Decide where to serve. `candidates[0]` must be the local node. The decision is
    /// recorded in the log.
    pub fn decide(&self, input: &DecisionInput<'_>, mut candidates: Vec<Candidate>) -> Target {
        {
            let ledger = self.ledger.lock();
            for c in candidates.iter_mut().filter(|c| !c.is_local) {
                ledger.apply(c);
            }
        }
        let terms: Vec<CostTerms> = candidates
            .iter()
            .map(|c| cost_terms(input.prompt_tokens, c, input.weights))
            .collect();
        let (winner, reason) = self.pick(input, &candidates, &terms);
        let record = DecisionRecord {
            request_id: input.request_id,
            at_ms: input.now_ms,
            policy: input.policy.to_owned(),
            hops: input.hops,
            prompt_tokens: input.prompt_tokens,
            weights: input.weights,
            candidates: candidates
                .iter()
                .zip(&terms)
                .map(|(c, t)| CandidateRecord {
                    node: c.node.clone(),
                    is_local: c.is_local,
                    healthy: c.healthy,
                    terms: *t,
                })
                .collect(),
            winner: winner.map(|i| candidates[i].node.clone()),
            reason,
        };
        {
            let mut log = self.log.lock();
            if log.len() >= self.log_capacity {
                log.pop_front();
            }
            log.push_back(record);
        }
        match winner {
            None => Target::Nothing,
            Some(i) if candidates[i].is_local => Target::Local,
            Some(i) => {
                let c = &candidates[i];
                let uncached = input.prompt_tokens.saturating_sub(c.cached_tokens);
                self.ledger
                    .lock()
                    .record_forward(&c.node, uncached, input.now_ms);
                Target::Peer(c.node.clone())
            }
        }
    }

    fn pick(
        &self,
        input: &DecisionInput<'_>,
        cands: &[Candidate],
        terms: &[CostTerms],
    ) -> (Option<usize>, &'static str) {
        let local_ok = cands.first().is_some_and(|c| c.is_local && c.healthy);
        // The max-hops guard: a request that has used its hops is served where it is.
        if input.hops >= input.max_hops || input.policy == "local-only" {
            return if local_ok {
                (Some(0), "max-hops")
            } else {
                (None, "no-candidate")
            };
        }
        let healthy: Vec<usize> = (0..cands.len()).filter(|&i| cands[i].healthy).collect();
        if healthy.is_empty() {
            return (None, "no-candidate");
        }
        let by_min = |key: &dyn Fn(usize) -> f64| -> usize {
            // Ties go to the local node (index 0), then to the earlier candidate.
            let mut best = healthy[0];
            for &i in &healthy[1..] {
                if key(i) < key(best) {
                    best = i;
                }
            }
            best
        };
        let inflight = |i: usize| cands[i].inflight_requests() as f64;
        let choice = match input.policy {
            "least-request" => by_min(&inflight),
            "least-load" => by_min(&|i| {
                let s = &cands[i].stats;
                s.running as f64 + s.waiting as f64 + s.kv_used_tokens as f64
            }),
            "round-robin" => {
                healthy[(self.cursor.fetch_add(1, Ordering::Relaxed) as usize) % healthy.len()]
            }
            "random" => {
                let r = gorgo_core::hash::hash_bytes(
                    &(self.cursor.fetch_add(1, Ordering::Relaxed) ^ input.request_id).to_le_bytes(),
                );
                healthy[(r as usize) % healthy.len()]
            }
            "session-affinity" | "simple-session-affinity" => {
                // Rendezvous hashing: stable under membership change.
                let score = |i: usize| {
                    let mut b = input.session_key.to_le_bytes().to_vec();
                    b.extend_from_slice(cands[i].node.0.as_bytes());
                    gorgo_core::hash::hash_bytes(&b)
                };
                *healthy
                    .iter()
                    .max_by_key(|&&i| score(i))
                    .unwrap_or(&healthy[0])
            }
            "prefix-cache" | "cache-aware" => {
                let longest = healthy
                    .iter()
                    .map(|&i| cands[i].cached_tokens)
                    .max()
                    .unwrap_or(0);
                if longest == 0 {
                    by_min(&inflight)
                } else {
                    by_min(&|i| (longest - cands[i].cached_tokens) as f64 * 1e6 + inflight(i))
                }
            }
            // `gorgo` and `gorgo-paper`: the cost model in milliseconds.
            _ => by_min(&|i| terms[i].total_ms),
        };
        (Some(choice), "cheapest")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(hops: u8) -> DecisionInput<'static> {
        DecisionInput {
            request_id: 1,
            policy: "gorgo",
            hops,
            max_hops: 1,
            prompt_tokens: 4000,
            session_key: 0,
            weights: Weights::default(),
            now_ms: 0,
        }
    }

    fn cands() -> Vec<Candidate> {
        let mut local = Candidate::idle("a", true, 0.0);
        local.stats.unfinished_prefill_tokens = 100_000;
        local.stats.t_p_ms = 0.1;
        let mut peer = Candidate::idle("b", false, 20.0);
        peer.cached_tokens = 4000;
        peer.stats.t_p_ms = 0.1;
        vec![local, peer]
    }

    #[test]
    fn forwards_to_the_cheaper_peer() {
        let r = Router::new(8);
        assert_eq!(
            r.decide(&input(0), cands()),
            Target::Peer(NodeId::from("b"))
        );
        let log = r.recent(10);
        assert_eq!(log.len(), 1);
        assert_eq!(log[0].candidates.len(), 2);
    }

    #[test]
    fn max_hops_serves_locally() {
        let r = Router::new(8);
        assert_eq!(r.decide(&input(1), cands()), Target::Local);
        let mut c = cands();
        c[0].healthy = false;
        assert_eq!(r.decide(&input(1), c), Target::Nothing);
    }

    #[test]
    fn log_is_bounded() {
        let r = Router::new(2);
        for _ in 0..5 {
            r.decide(&input(1), cands());
        }
        assert_eq!(r.recent(10).len(), 2);
    }
}
