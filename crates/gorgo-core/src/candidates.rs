//! The candidate list of one routing decision, built one way for every driver.
//!
//! The local engines first (one per replica the node fronts: each its health, the
//! match in its shadow index, its own [`crate::accounting::EngineView`] stats), then
//! every engine of every live peer whose queue stats have arrived and that may take
//! the request ([`PeerState::eligible`]) (their last stats,
//! the match in their last summary, the measured RTT to the peer), with this node's
//! [`ForwardLedger`] brought up to date with those stats and its pending forwards
//! added. The live node and the simulator both call [`build_candidates`]; neither
//! assembles candidates itself.

use std::ops::DerefMut;

use crate::cost::{Candidate, ForwardLedger};
use crate::types::{NodeId, QueueStats};

/// What the deciding node knows about one of its own engines.
#[derive(Debug, Clone)]
pub struct LocalState {
    /// This node.
    pub node: NodeId,
    /// Whether this engine can serve.
    pub healthy: bool,
    /// Prompt tokens its shadow index believes the engine has cached.
    pub cached_tokens: u64,
    /// Its queue stats (their `replica` says which engine this is).
    pub stats: QueueStats,
}

/// What the deciding node knows about one engine of one peer.
#[derive(Debug, Clone, Copy)]
pub struct PeerState<'a> {
    /// The peer.
    pub node: &'a NodeId,
    /// Whether membership says it is alive: alive, it decides on the same stale stats
    /// of the other peers as this node ([`Candidate::deciders`]) whether or not this
    /// request may go there.
    pub alive: bool,
    /// Whether this request may go there: it serves the request's model, it has not
    /// failed this request, and the request has not left it. An alive peer that may
    /// not take the request is no candidate, but still one of the deciders.
    pub eligible: bool,
    /// Measured RTT to it, ms.
    pub rtt_ms: f64,
    /// The engine's last queue stats (their `replica` says which engine); it is a
    /// candidate only once they arrived.
    pub stats: Option<&'a QueueStats>,
    /// How long ago those stats arrived at this node, ms. The ledger clears the
    /// forwards they can reflect by when they arrived, not by when a decision next
    /// looked at them: a quiet node's next decision can come long after.
    pub stats_age_ms: u64,
}

/// Build the candidates of one decision at `now_ms`. `matched_tokens(peer, replica)`
/// gives the prompt tokens the last summary of that peer engine matches (asked only
/// for candidates). Peer engines whose node is dead, that have sent no stats, say they
/// are draining (about to shut down: what is in flight there finishes, nothing new
/// goes there), or carry the local node's id are left out. The ledger observes every
/// candidate's stats version (clearing the forwards those stats already reflect) and
/// its pending forwards are applied. A peer's engines come one after another (the
/// count of peer nodes, which sets [`Candidate::deciders`], relies on it).
///
/// `ledger` gives access to the forward ledger: the node passes a closure that locks
/// its shared ledger, the simulator one that hands out its own. It is called once,
/// after every `matched_tokens` call and only when a peer engine is a candidate: the
/// summary walks (up to 16 peers' summaries against an 8k-token prompt's chain) do not
/// depend on the ledger, and while the node's lock is held every other request's
/// decision and every forward's record and settle wait on it.
pub fn build_candidates<'a, L: DerefMut<Target = ForwardLedger>>(
    locals: impl IntoIterator<Item = LocalState>,
    peers: impl IntoIterator<Item = PeerState<'a>>,
    mut matched_tokens: impl FnMut(&NodeId, u16) -> u64,
    ledger: impl FnOnce() -> L,
    now_ms: u64,
) -> Vec<Candidate> {
    let mut out: Vec<Candidate> = locals
        .into_iter()
        .map(|l| Candidate {
            node: l.node,
            is_local: true,
            healthy: l.healthy,
            rtt_ms: 0.0,
            cached_tokens: l.cached_tokens,
            stats: l.stats,
            inflight_forwards: 0,
            inflight_forward_prompt_tokens: 0,
            inflight_forward_raw_prompt_tokens: 0,
            forward_bias_ms: 0.0,
            deciders: 1,
        })
        .collect();
    let n_local = out.len();
    let me = out.first().map(|c| c.node.clone());
    // Live peer nodes whose stats have come (their engines come one after another):
    // the nodes that decide on each peer's stats, this one included.
    let mut peer_nodes = 0u32;
    let mut last_peer: Option<&NodeId> = None;
    // The peer candidates with their matches and when their stats arrived, in order,
    // before the ledger is touched.
    let mut arrived_at = Vec::new();
    for p in peers {
        if !p.alive || me.as_ref() == Some(p.node) {
            continue;
        }
        let Some(stats) = p.stats.filter(|s| !s.draining) else {
            continue;
        };
        if last_peer != Some(p.node) {
            peer_nodes += 1;
            last_peer = Some(p.node);
        }
        if !p.eligible {
            continue;
        }
        out.push(Candidate {
            node: p.node.clone(),
            is_local: false,
            healthy: true,
            rtt_ms: p.rtt_ms,
            cached_tokens: matched_tokens(p.node, stats.replica),
            stats: stats.clone(),
            inflight_forwards: 0,
            inflight_forward_prompt_tokens: 0,
            inflight_forward_raw_prompt_tokens: 0,
            forward_bias_ms: 0.0,
            deciders: 1,
        });
        arrived_at.push(now_ms.saturating_sub(p.stats_age_ms));
    }
    if !arrived_at.is_empty() {
        // Each engine's stats observed, then its pending forwards applied, one engine
        // after another (as the ledger saw them before the matches moved out).
        let mut ledger = ledger();
        for (c, at) in out[n_local..].iter_mut().zip(arrived_at) {
            ledger.observe_stats(&c.node, &c.stats, at, c.rtt_ms);
            ledger.apply(c, now_ms);
        }
    }
    // Every node but the peer itself decides on the same stale stats of that peer.
    let deciders = peer_nodes.max(1);
    for c in out.iter_mut().skip(n_local) {
        c.deciders = deciders;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn local() -> LocalState {
        LocalState {
            node: NodeId::from("a"),
            healthy: true,
            cached_tokens: 7,
            stats: QueueStats::default(),
        }
    }

    #[test]
    fn local_first_then_live_peers_with_stats_not_draining() {
        let (b, c, d, a) = (
            NodeId::from("b"),
            NodeId::from("c"),
            NodeId::from("d"),
            NodeId::from("a"),
        );
        let stats = QueueStats {
            version: 3,
            ..QueueStats::default()
        };
        let e = NodeId::from("e");
        let draining = QueueStats {
            draining: true,
            ..stats.clone()
        };
        let peers = [
            PeerState {
                node: &b,
                alive: true,
                eligible: true,
                rtt_ms: 20.0,
                stats: Some(&stats),
                stats_age_ms: 0,
            },
            PeerState {
                node: &c,
                alive: false,
                eligible: true,
                rtt_ms: 20.0,
                stats: Some(&stats),
                stats_age_ms: 0,
            },
            PeerState {
                node: &d,
                alive: true,
                eligible: true,
                rtt_ms: 20.0,
                stats: None,
                stats_age_ms: 0,
            },
            PeerState {
                node: &a,
                alive: true,
                eligible: true,
                rtt_ms: 0.0,
                stats: Some(&stats),
                stats_age_ms: 0,
            },
            PeerState {
                node: &e,
                alive: true,
                eligible: true,
                rtt_ms: 20.0,
                stats: Some(&draining),
                stats_age_ms: 0,
            },
        ];
        let mut ledger = ForwardLedger::new();
        let out = build_candidates([local()], peers, |_, _| 42, || &mut ledger, 100);
        assert_eq!(out.len(), 2);
        assert!(out[0].is_local && out[0].cached_tokens == 7);
        // Two nodes in the decision: the peer is judged by one node (this one).
        assert_eq!((out[0].deciders, out[1].deciders), (1, 1));
        assert_eq!(
            (out[1].node.0.as_str(), out[1].cached_tokens, out[1].rtt_ms),
            ("b", 42, 20.0)
        );
    }

    /// A live peer this request may not go to (another model, or it failed this
    /// request) is no candidate but still decides on the others' stats: every live
    /// node but the peer, as `Candidate::deciders` says (it was 2 here, the candidates).
    #[test]
    fn a_live_peer_that_may_not_take_the_request_still_decides() {
        let (b, c, d) = (NodeId::from("b"), NodeId::from("c"), NodeId::from("d"));
        let stats = QueueStats::default();
        let peer = |node, eligible| PeerState {
            node,
            alive: true,
            eligible,
            rtt_ms: 20.0,
            stats: Some(&stats),
            stats_age_ms: 0,
        };
        let peers = [peer(&b, true), peer(&c, false), peer(&d, true)];
        let mut ledger = ForwardLedger::new();
        let out = build_candidates([local()], peers, |_, _| 0, || &mut ledger, 100);
        let nodes: Vec<&str> = out.iter().map(|c| c.node.0.as_str()).collect();
        assert_eq!(nodes, ["a", "b", "d"]);
        assert_eq!((out[1].deciders, out[2].deciders), (3, 3));
    }

    /// The node's ledger is one mutex every decision and every forward's record and
    /// settle take: the summary walks run before it is locked, and a decision without
    /// a peer candidate does not lock it at all.
    #[test]
    fn the_ledger_is_locked_once_after_every_match() {
        let (b, c) = (NodeId::from("b"), NodeId::from("c"));
        let stats = QueueStats::default();
        let peer = |node| PeerState {
            node,
            alive: true,
            eligible: true,
            rtt_ms: 20.0,
            stats: Some(&stats),
            stats_age_ms: 0,
        };
        let ledger = std::sync::Mutex::new(ForwardLedger::new());
        let (mut matches, mut locks) = (0, 0);
        let out = build_candidates(
            [local()],
            [peer(&b), peer(&c)],
            |_, _| {
                assert!(ledger.try_lock().is_ok(), "matched under the ledger lock");
                matches += 1;
                5
            },
            || {
                locks += 1;
                ledger.lock().unwrap()
            },
            100,
        );
        assert_eq!((out.len(), matches, locks), (3, 2, 1));
        let out = build_candidates(
            [local()],
            [],
            |_, _| 0,
            || -> &mut ForwardLedger { unreachable!("no peer candidate, no ledger") },
            100,
        );
        assert_eq!(out.len(), 1);
    }

    #[test]
    fn the_ledger_is_observed_then_applied() {
        let b = NodeId::from("b");
        let mut ledger = ForwardLedger::new();
        // Sent at 10 and 95; stats v1 arriving at 100 with rtt 20 reflect only the first.
        ledger.record_forward(&b, 0, 1000, 1000, 10);
        ledger.record_forward(&b, 0, 500, 500, 95);
        let stats = QueueStats {
            version: 1,
            ..QueueStats::default()
        };
        let peer = PeerState {
            node: &b,
            alive: true,
            eligible: true,
            rtt_ms: 20.0,
            stats: Some(&stats),
            stats_age_ms: 0,
        };
        let out = build_candidates([local()], [peer], |_, _| 0, || &mut ledger, 100);
        assert_eq!(out[1].inflight_forwards, 1);
        assert_eq!(out[1].inflight_forward_prompt_tokens, 500);
        // The same version again clears nothing more.
        let out = build_candidates([local()], [peer], |_, _| 0, || &mut ledger, 1000);
        assert_eq!(out[1].inflight_forward_prompt_tokens, 500);
    }

    #[test]
    fn the_ledger_clears_by_when_the_stats_arrived_not_when_a_decision_looked() {
        let b = NodeId::from("b");
        let stats = QueueStats {
            version: 1,
            ..QueueStats::default()
        };
        // Forwards sent at 10 and 95; stats that arrived at 100 (rtt 20) reflect only
        // the first. The next decision comes at 400: with the stats 300 ms old it still
        // clears only the first; taking them as arriving at 400 would clear both.
        for (age, pending) in [(300, 500), (0, 0)] {
            let mut ledger = ForwardLedger::new();
            ledger.record_forward(&b, 0, 1000, 1000, 10);
            ledger.record_forward(&b, 0, 500, 500, 95);
            let peer = PeerState {
                node: &b,
                alive: true,
                eligible: true,
                rtt_ms: 20.0,
                stats: Some(&stats),
                stats_age_ms: age,
            };
            let out = build_candidates([local()], [peer], |_, _| 0, || &mut ledger, 400);
            assert_eq!(out[1].inflight_forward_prompt_tokens, pending, "age {age}");
        }
    }
}
