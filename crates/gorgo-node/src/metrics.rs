//! The node's Prometheus metrics (`GET /metrics` on the admin listener).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Labels of request counts.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// `ok`, `bad_request`, `too_large`, `engine_failed`, `unavailable`, `timeout`,
    /// `stream_error`, `cancelled`.
    pub outcome: String,
    /// The region that served it (empty when none did).
    pub served_by: String,
}

/// Labels of forward counts.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ForwardLabels {
    /// The peer.
    pub peer: String,
    /// `ok`, `fallback` (failed before the first byte), `failed`.
    pub result: String,
}

/// Labels of cost terms.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TermLabels {
    /// `rtt`, `prefill`, `queue`, `total`.
    pub term: String,
}

/// Labels of per-peer gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PeerLabels {
    /// The peer.
    pub peer: String,
}

/// Labels of tuning decisions.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerdictLabels {
    /// `accepted`, `not-better`, `e2e-guard`, `invalid-measurement`.
    pub verdict: String,
}

/// Every metric the node exports.
#[derive(Debug)]
pub struct NodeMetrics {
    registry: Registry,
    /// Requests by outcome and serving region.
    pub requests: Family<RequestLabels, Counter>,
    /// Time to first content byte at the client, seconds.
    pub ttft: Histogram,
    /// End to end, seconds.
    pub e2e: Histogram,
    /// Forwards sent, by peer and result.
    pub forwards: Family<ForwardLabels, Counter>,
    /// Forwards received from peers.
    pub forwards_received: Counter,
    /// Cost terms of the chosen candidate, ms.
    pub cost_terms: Family<TermLabels, Histogram>,
    /// Gossip bytes sent.
    pub gossip_bytes_sent: Gauge,
    /// Gossip bytes received.
    pub gossip_bytes_received: Gauge,
    /// Claims of a peer's node id from a second address, refused (an impostor with
    /// its certificate, or a node restarted elsewhere before its old self was
    /// declared down): nonzero means two processes run with one certificate.
    pub cluster_identity_conflicts: Gauge,
    /// Claims of this node's own id by another process, refused.
    pub cluster_own_id_claimed: Gauge,
    /// Age of each peer's summary, ms (staleness).
    pub summary_age_ms: Family<PeerLabels, Gauge>,
    /// Age of each peer's queue stats, ms.
    pub stats_age_ms: Family<PeerLabels, Gauge>,
    /// Requests in flight through the ingress.
    pub inflight: Gauge,
    /// 1 when the local engine is healthy.
    pub engine_healthy: Gauge,
    /// Live peers.
    pub peers_alive: Gauge,
    /// The tuning epoch this node routes under.
    pub tuning_epoch: Gauge,
    /// 1 while this node leads the tuning epoch it follows.
    pub tuning_leader: Gauge,
    /// Trials this node decided as leader, by verdict.
    pub tuning_trials: Family<VerdictLabels, Counter>,
    /// Client and admin connections: open, and refused or closed by a limit.
    pub connections: crate::listen::ConnMetrics,
    /// State of the engine's circuit breaker: 0 closed, 1 open, 2 half-open.
    pub engine_breaker: Gauge,
    /// Failures of real requests to the engine that count towards its breaker.
    pub engine_failures: Counter,
    /// The bytes-per-token ratio the node counts with (learned from the engine without
    /// a tokenizer).
    pub bytes_per_token: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// |node's prompt-token count - engine's `usage.prompt_tokens`| / engine's, per
    /// request served locally whose response reported usage.
    pub prompt_token_error: Histogram,
}

impl Default for NodeMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl NodeMetrics {
    /// Register every metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("gorgo");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "Requests by outcome and serving region",
            requests.clone(),
        );
        let ttft = Histogram::new(exponential_buckets(0.005, 1.6, 20));
        registry.register(
            "ttft_seconds",
            "Time to first content byte at the client",
            ttft.clone(),
        );
        let e2e = Histogram::new(exponential_buckets(0.01, 1.6, 24));
        registry.register("e2e_seconds", "End-to-end request latency", e2e.clone());
        let forwards = Family::<ForwardLabels, Counter>::default();
        registry.register(
            "forwards",
            "Forwards sent to peers by result",
            forwards.clone(),
        );
        let forwards_received = Counter::default();
        registry.register(
            "forwards_received",
            "Forwards received from peers",
            forwards_received.clone(),
        );
        let cost_terms = Family::<TermLabels, Histogram>::new_with_constructor(
            (|| Histogram::new(exponential_buckets(1.0, 2.0, 16))) as fn() -> Histogram,
        );
        registry.register(
            "cost_term_ms",
            "Cost terms of the chosen candidate, ms",
            cost_terms.clone(),
        );
        let gossip_bytes_sent = Gauge::default();
        registry.register(
            "gossip_bytes_sent",
            "Gossip bytes sent",
            gossip_bytes_sent.clone(),
        );
        let gossip_bytes_received = Gauge::default();
        registry.register(
            "gossip_bytes_received",
            "Gossip bytes received",
            gossip_bytes_received.clone(),
        );
        let cluster_identity_conflicts = Gauge::default();
        registry.register(
            "cluster_identity_conflicts",
            "Claims of a peer's node id from a second address, refused",
            cluster_identity_conflicts.clone(),
        );
        let cluster_own_id_claimed = Gauge::default();
        registry.register(
            "cluster_own_id_claimed",
            "Claims of this node's own id by another process, refused",
            cluster_own_id_claimed.clone(),
        );
        let summary_age_ms = Family::<PeerLabels, Gauge>::default();
        registry.register(
            "peer_summary_age_ms",
            "Age of each peer's prefix summary",
            summary_age_ms.clone(),
        );
        let stats_age_ms = Family::<PeerLabels, Gauge>::default();
        registry.register(
            "peer_stats_age_ms",
            "Age of each peer's queue stats",
            stats_age_ms.clone(),
        );
        let inflight = Gauge::default();
        registry.register(
            "inflight_requests",
            "Requests in flight through the ingress",
            inflight.clone(),
        );
        let engine_healthy = Gauge::default();
        registry.register(
            "engine_healthy",
            "1 when the local engine passes health checks",
            engine_healthy.clone(),
        );
        let peers_alive = Gauge::default();
        registry.register(
            "peers_alive",
            "Live peers in the membership view",
            peers_alive.clone(),
        );
        let tuning_epoch = Gauge::default();
        registry.register(
            "tuning_epoch",
            "Tuning epoch this node routes under",
            tuning_epoch.clone(),
        );
        let tuning_leader = Gauge::default();
        registry.register(
            "tuning_leader",
            "1 while this node leads the tuning epoch it follows",
            tuning_leader.clone(),
        );
        let tuning_trials = Family::<VerdictLabels, Counter>::default();
        registry.register(
            "tuning_trials",
            "Tuning trials this node decided as leader, by verdict",
            tuning_trials.clone(),
        );
        let connections = crate::listen::ConnMetrics::default();
        registry.register(
            "connections_open",
            "Connections open, by port",
            connections.open.clone(),
        );
        registry.register(
            "connections_refused",
            "Connections refused or closed by a limit, by port and reason",
            connections.refused.clone(),
        );
        let engine_breaker = Gauge::default();
        registry.register(
            "engine_breaker_state",
            "Engine circuit breaker: 0 closed, 1 open, 2 half-open",
            engine_breaker.clone(),
        );
        let engine_failures = Counter::default();
        registry.register(
            "engine_failures",
            "Failures of real requests to the engine (connect, timeout, 5xx)",
            engine_failures.clone(),
        );
        let bytes_per_token = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "bytes_per_token",
            "Bytes per prompt token the node estimates with (learned without a tokenizer)",
            bytes_per_token.clone(),
        );
        let prompt_token_error =
            Histogram::new([0.0, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]);
        registry.register(
            "prompt_token_error_ratio",
            "Relative error of the node's prompt-token count against the engine's usage.prompt_tokens",
            prompt_token_error.clone(),
        );
        NodeMetrics {
            bytes_per_token,
            prompt_token_error,
            connections,
            engine_breaker,
            engine_failures,
            registry,
            requests,
            ttft,
            e2e,
            forwards,
            forwards_received,
            cost_terms,
            gossip_bytes_sent,
            gossip_bytes_received,
            cluster_identity_conflicts,
            cluster_own_id_claimed,
            summary_age_ms,
            stats_age_ms,
            inflight,
            engine_healthy,
            peers_alive,
            tuning_epoch,
            tuning_leader,
            tuning_trials,
        }
    }

    /// Count one finished request.
    pub fn request(&self, outcome: &str, served_by: &str) {
        self.requests
            .get_or_create(&RequestLabels {
                outcome: outcome.to_owned(),
                served_by: served_by.to_owned(),
            })
            .inc();
    }

    /// Count one forward.
    pub fn forward(&self, peer: &str, result: &str) {
        self.forwards
            .get_or_create(&ForwardLabels {
                peer: peer.to_owned(),
                result: result.to_owned(),
            })
            .inc();
    }

    /// Record the chosen candidate's cost terms.
    pub fn terms(&self, t: &gorgo_core::cost::CostTerms) {
        for (name, v) in [
            ("rtt", t.rtt_ms),
            ("prefill", t.prefill_ms),
            ("queue", t.queue_ms),
            ("stall", t.stall_ms),
            ("total", t.total_ms),
        ] {
            if v.is_finite() {
                self.cost_terms
                    .get_or_create(&TermLabels {
                        term: name.to_owned(),
                    })
                    .observe(v.max(0.0));
            }
        }
    }

    /// Render the text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
