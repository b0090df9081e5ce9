//! Routing: candidates from local state and the peer table, the core cost model, and
//! a bounded log of recent decisions for `/admin/decisions`.

use std::collections::{HashMap, VecDeque};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use gorgo_core::cost::{Candidate, ForwardLedger};
pub use gorgo_core::decision::DecisionRecord;
use gorgo_core::decision::{decide, refuse_forward, ForwardOffer, ForwardOrigin, Refusal};
use gorgo_core::policy::{build, Policy, PolicyKind, RouteRequest};
use gorgo_core::{HashChain, NodeId, Weights};
use parking_lot::Mutex;

/// Parse a policy name as docs/design.md spells it; `oracle` is simulator-only.
pub fn parse_policy(name: &str) -> Result<PolicyKind, String> {
    match PolicyKind::from_str(name) {
        Ok(PolicyKind::Oracle) => Err("policy `oracle` exists only in the simulator".into()),
        Ok(k) => Ok(k),
        Err(e) => Err(match e {
            gorgo_core::CoreError::InvalidConfig { reason, .. } => reason,
            other => other.to_string(),
        }),
    }
}

/// The outcome of a decision.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    /// Serve on this local engine (replica).
    Local(u16),
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
    /// The policy.
    pub policy: PolicyKind,
    /// Hops taken so far.
    pub hops: u8,
    /// The max-hops guard.
    pub max_hops: u8,
    /// The prompt's chain.
    pub chain: &'a HashChain,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Hash of `x-session-id`, when sent.
    pub session_key: Option<u64>,
    /// Weights in force.
    pub weights: Weights,
    /// Milliseconds since the node started.
    pub now_ms: u64,
    /// For a peer's forward: where it came from (kept in the decision's record).
    pub origin: Option<ForwardOrigin>,
}

/// The router's own state: policy instances, decision log, forward ledger.
pub struct Router {
    policies: Mutex<HashMap<PolicyKind, Box<dyn Policy>>>,
    log: Mutex<VecDeque<Arc<DecisionRecord>>>,
    log_capacity: usize,
    /// This node's forwards to each peer not yet visible in their stats.
    pub ledger: Mutex<ForwardLedger>,
    rng: AtomicU64,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("log_capacity", &self.log_capacity)
            .finish_non_exhaustive()
    }
}

impl Router {
    /// A router keeping the last `log_capacity` decisions; `seed` seeds tie-breaks.
    pub fn new(log_capacity: usize, seed: u64) -> Self {
        Router {
            policies: Mutex::new(HashMap::new()),
            log: Mutex::new(VecDeque::with_capacity(log_capacity.min(4096))),
            log_capacity: log_capacity.max(1),
            ledger: Mutex::new(ForwardLedger::new()),
            rng: AtomicU64::new(seed),
        }
    }

    /// `limit` decisions, newest first, after the newest `offset`: pages through the
    /// whole log, however long `routing.decision_log` makes it. Shared, not copied:
    /// every decision takes the log's lock, and a page of 1,000 records, each with
    /// every candidate of the cluster, deep-copied under it stalled routing.
    pub fn recent(&self, offset: usize, limit: usize) -> Vec<Arc<DecisionRecord>> {
        self.log
            .lock()
            .iter()
            .rev()
            .skip(offset)
            .take(limit)
            .cloned()
            .collect()
    }

    fn next_random(&self) -> u64 {
        // splitmix64 over a counter: cheap, lock-free, good enough for tie-breaks.
        let mut z = self.rng.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Decide where to serve through the core decision (policy + max-hops guard), and
    /// record it. The candidates come from [`gorgo_core::candidates::build_candidates`],
    /// which has already applied this node's pending forwards; a forward decided here
    /// is recorded in the ledger.
    pub fn decide(
        &self,
        input: &DecisionInput<'_>,
        candidates: Vec<Candidate>,
    ) -> (Target, DecisionRecord) {
        let req = route_request(input);
        let rng = self.next_random();
        let outcome = self.with_policy(input.policy, |policy| {
            decide(
                &req,
                input.hops,
                input.max_hops,
                &candidates,
                policy,
                input.weights,
                rng,
            )
        });
        let target = match &outcome {
            Ok(d) if d.is_local => Target::Local(d.target_replica),
            Ok(d) => Target::Peer(d.target.clone()),
            Err(_) => Target::Nothing,
        };
        let mut record = DecisionRecord::of_outcome(
            input.request_id,
            input.now_ms,
            input.prompt_tokens,
            input.weights,
            outcome,
        );
        record.origin = input.origin.clone();
        if let Target::Peer(peer) = &target {
            let chosen = record.candidates.iter().find(|c| c.chosen);
            let cached = chosen.map_or(0, |c| c.cached_tokens);
            self.ledger.lock().record_forward(
                peer,
                chosen.map_or(0, |c| c.replica),
                input.prompt_tokens.saturating_sub(cached),
                input.prompt_tokens,
                input.now_ms,
            );
        }
        self.log(record.clone());
        (target, record)
    }

    /// Check a peer's forward against the cost it said serving it there would have
    /// (`gorgo_core::decision::refuse_forward`, priced with the offer's weights). A
    /// refusal is logged as a decision with no winner and reason `refused`, each
    /// candidate's terms and the offer's weights shown.
    pub fn refuse(
        &self,
        input: &DecisionInput<'_>,
        candidates: &[Candidate],
        offer: &ForwardOffer,
    ) -> Option<Refusal> {
        let req = route_request(input);
        let (refusal, explained) = self.with_policy(input.policy, |policy| {
            refuse_forward(&req, candidates, policy, offer)
        })?;
        let mut record = DecisionRecord::of_refusal(
            input.request_id,
            input.now_ms,
            input.policy,
            input.hops,
            input.prompt_tokens,
            offer,
            explained,
        );
        record.origin = input.origin.clone();
        self.log(record);
        Some(refusal)
    }

    /// Run `f` with this router's instance of `kind` (built on first use).
    fn with_policy<R>(&self, kind: PolicyKind, f: impl FnOnce(&mut dyn Policy) -> R) -> R {
        let mut policies = self.policies.lock();
        let policy = policies.entry(kind).or_insert_with(|| build(kind));
        f(policy.as_mut())
    }

    /// Keep `record` in the bounded decision log.
    fn log(&self, record: DecisionRecord) {
        let mut log = self.log.lock();
        if log.len() >= self.log_capacity {
            log.pop_front();
        }
        log.push_back(Arc::new(record));
    }

    /// The forward that decision `request_id`'s record (made at `at_ms`) chose did not
    /// go as decided ([`DecisionRecord::forward_outcome`]): say so in the log, where
    /// the record is still kept (it is one of the most recent).
    fn note_forward_outcome(&self, request_id: u64, at_ms: u64, outcome: &str) {
        let mut log = self.log.lock();
        if let Some(r) = log
            .iter_mut()
            .rev()
            .find(|r| r.request_id == request_id && r.at_ms == at_ms)
        {
            // A copy only while a page being served shares it.
            Arc::make_mut(r).forward_outcome = Some(outcome.to_owned());
        }
    }

    /// `peer` refused a forward decided by `record`: it no longer counts as pending
    /// there, and the peer's forward bias learns from the refusal as from a first
    /// byte, with the peer's own estimate in place of the TTFT (`elapsed_ms` since the
    /// decision, plus what the peer estimated serving it would take).
    pub fn forward_refused(
        &self,
        peer: &NodeId,
        record: &DecisionRecord,
        refusal: &Refusal,
        elapsed_ms: f64,
        now_ms: u64,
    ) {
        let chosen = record.candidates.iter().find(|c| c.chosen);
        let replica = chosen.map_or(0, |c| c.replica);
        self.note_forward_outcome(record.request_id, record.at_ms, "forward-refused");
        let mut ledger = self.ledger.lock();
        Self::cancel_in(&mut ledger, peer, record);
        let predicted = chosen.and_then(|c| c.terms?.unbiased_estimated_ttft_ms());
        if let (Some(predicted), Some(estimate)) = (predicted, refusal.local_estimated_ttft_ms) {
            ledger.observe_forward_ttft(peer, replica, predicted, elapsed_ms + estimate, now_ms);
        }
    }

    /// A forward to `peer` failed before its first byte (the peer went away, answered
    /// an error head, timed out): it never became work there, so it leaves the
    /// ledger at once instead of counting in the peer's queue until its next stats
    /// (which a peer that stopped answering may never send).
    pub fn forward_failed(&self, peer: &NodeId, record: &DecisionRecord) {
        self.note_forward_outcome(record.request_id, record.at_ms, "forward-failed");
        Self::cancel_in(&mut self.ledger.lock(), peer, record);
    }

    /// The client left while a forward to `peer` waited for its head: the stream's
    /// reset cancels the work there, so it leaves the ledger at once instead of
    /// counting in the peer's queue until the peer's next stats.
    pub fn forward_cancelled(&self, peer: &NodeId, record: &DecisionRecord) {
        self.note_forward_outcome(record.request_id, record.at_ms, "forward-cancelled");
        Self::cancel_in(&mut self.ledger.lock(), peer, record);
    }

    /// Take the forward `record` chose off `peer`'s ledger entry.
    fn cancel_in(ledger: &mut ForwardLedger, peer: &NodeId, record: &DecisionRecord) {
        let chosen = record.candidates.iter().find(|c| c.chosen);
        let cached = chosen.map_or(0, |c| c.cached_tokens);
        ledger.cancel_forward(
            peer,
            chosen.map_or(0, |c| c.replica),
            record.prompt_tokens.saturating_sub(cached),
            record.prompt_tokens,
            record.at_ms,
        );
    }
}

/// The core's view of the request being decided.
fn route_request<'a>(input: &DecisionInput<'a>) -> RouteRequest<'a> {
    RouteRequest {
        chain: input.chain,
        prompt_tokens: input.prompt_tokens,
        session_key: input.session_key,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(hops: u8, chain: &HashChain) -> DecisionInput<'_> {
        DecisionInput {
            request_id: 1,
            policy: PolicyKind::Gorgo,
            hops,
            max_hops: 1,
            chain,
            prompt_tokens: 4000,
            session_key: None,
            weights: Weights::default(),
            now_ms: 0,
            origin: None,
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
        let r = Router::new(8, 1);
        let chain = HashChain::default();
        assert_eq!(
            r.decide(&input(0, &chain), cands()).0,
            Target::Peer(NodeId::from("b"))
        );
        let log = r.recent(0, 10);
        assert_eq!(log.len(), 1);
        assert_eq!(log[0].candidates.len(), 2);
    }

    #[test]
    fn max_hops_serves_locally() {
        let r = Router::new(8, 1);
        let chain = HashChain::default();
        assert_eq!(r.decide(&input(1, &chain), cands()).0, Target::Local(0));
        let mut c = cands();
        c[0].healthy = false;
        assert_eq!(r.decide(&input(1, &chain), c).0, Target::Nothing);
    }

    #[test]
    fn oracle_and_unknown_policies_are_rejected() {
        assert!(parse_policy("oracle").is_err());
        assert!(parse_policy("nope").unwrap_err().contains("least-load"));
        assert_eq!(parse_policy("least-load").unwrap(), PolicyKind::LeastLoad);
    }

    #[test]
    fn log_is_bounded() {
        let r = Router::new(2, 1);
        let chain = HashChain::default();
        for _ in 0..5 {
            r.decide(&input(1, &chain), cands());
        }
        assert_eq!(r.recent(0, 10).len(), 2);
    }

    /// Pages of the log, newest first: an offset reaches decisions past the first
    /// page (the API had only `limit`, at most 1,000, of a log of up to 100,000).
    #[test]
    fn the_log_pages_newest_first() {
        let r = Router::new(8, 1);
        let chain = HashChain::default();
        for id in 0..5 {
            let mut i = input(1, &chain);
            i.request_id = id;
            r.decide(&i, cands());
        }
        let ids =
            |page: Vec<Arc<DecisionRecord>>| page.iter().map(|d| d.request_id).collect::<Vec<_>>();
        assert_eq!(ids(r.recent(0, 2)), [4, 3]);
        assert_eq!(ids(r.recent(2, 2)), [2, 1]);
        assert_eq!(ids(r.recent(4, 2)), [0]);
        assert!(r.recent(5, 2).is_empty());
    }

    /// A page shares the log's records rather than copying them under the lock every
    /// decision takes; a record a page holds still takes its forward's outcome (in
    /// the log, not in the page already served).
    #[test]
    fn a_page_shares_the_logs_records() {
        let r = Router::new(8, 1);
        let chain = HashChain::default();
        r.decide(&input(1, &chain), cands());
        let (a, b) = (r.recent(0, 1), r.recent(0, 1));
        assert!(Arc::ptr_eq(&a[0], &b[0]));
        r.note_forward_outcome(a[0].request_id, a[0].at_ms, "forward-refused");
        assert_eq!(a[0].forward_outcome, None);
        assert_eq!(
            r.recent(0, 1)[0].forward_outcome.as_deref(),
            Some("forward-refused")
        );
    }
}
