//! The node's Prometheus metrics (`GET /metrics` on the admin listener).
//!
//! Names follow Prometheus' conventions so that `promtool check metrics` finds nothing
//! to lint: base units (seconds, bytes) spelled out, `_total` on counters, help text on
//! every family. [`NodeMetrics::encode`] writes OpenMetrics (what Prometheus asks for),
//! [`NodeMetrics::encode_prometheus_text`] the older text format that `promtool` and
//! plain HTTP clients read.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// Labels of request counts.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// `ok`, `engine_error` (the client got the engine's own error status: relayed, or
    /// a 5xx passed on where nothing else could serve it, from this node's engine or
    /// through a forward a peer's), `bad_request`,
    /// `too_large`, `engine_failed`, `unavailable`, `timeout`, `model_not_found`,
    /// `stream_error`, `cancelled` (the client left, before or after the head),
    /// `internal_error`.
    pub outcome: String,
    /// The routing policy that placed it (`gorgo`, `round-robin`, ...; empty when the
    /// request was refused before it was routed).
    pub policy: String,
    /// The region that served it (empty when none did).
    pub served_by: String,
}

/// Labels of forward counts.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ForwardLabels {
    /// The peer.
    pub peer: String,
    /// `ok`, `fallback` (failed before the first byte), `refused` (the peer would have
    /// served it later than this node: served here).
    pub result: String,
}

/// Labels of cost terms.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TermLabels {
    /// `rtt`, `prefill`, `queue`, `stall`, `total`.
    pub term: String,
}

/// Labels of per-peer gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PeerLabels {
    /// The peer.
    pub peer: String,
}

/// Labels of what the cluster transport refused or dropped from the network.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusedLabels {
    /// `malformed` (messages that did not decode or were over their cap), `spoofed`
    /// (SWIM packets whose sender is not their connection's certificate),
    /// `handshake` (connections refused at the handshake), `other_protocol`,
    /// `foreign_certificate` and `expired_certificate` (handshakes, dialed or accepted,
    /// that failed because the other node speaks another cluster protocol version, or
    /// one side's certificate is from another CA, or has expired), `unbound_stream`
    /// (streams
    /// on a connection no accepted claim vouches for), `excess_connection` (inbound
    /// connections closed over the per-certificate cap).
    pub what: String,
}

/// A count as a gauge's value: prometheus-client's gauges are `i64`, and a count
/// past `i64::MAX` reads as the largest, not as a negative number.
pub fn gauge_value(count: u64) -> i64 {
    i64::try_from(count).unwrap_or(i64::MAX)
}

/// Labels of cluster bytes by traffic kind.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TrafficLabels {
    /// `swim` (membership), `summary` (prefix summaries and queue stats), `app`
    /// (tuning messages).
    pub traffic: String,
    /// `sent` or `received`.
    pub direction: String,
}

/// Labels of summary gossip messages sent.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GossipSentLabels {
    /// `delta`, `snapshot`, `snapshot_request`.
    pub kind: String,
}

/// Labels of per-engine gauges: which of the node's engines (docs/design.md,
/// "Replicas").
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplicaLabels {
    /// The engine's replica number.
    pub replica: String,
}

/// Labels of tuning decisions.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerdictLabels {
    /// `accepted`, `not-better`, `e2e-guard`, `invalid-measurement`.
    pub verdict: String,
}

/// What an engine failure was, the `kind` label of `engine_failures_total`: what the
/// breaker counts, and what it does not count at once, kept apart so that an alert on
/// a failing engine is not set off by one client's bad requests.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum EngineFailureKind {
    /// The engine failed the request: no answer (connect error, reset, first-byte
    /// timeout), a stream it broke mid-way, or a 502, 503 or 504 head
    /// (`crate::engine::EngineAdapter::is_gateway_failure`). Each counts against its
    /// breaker.
    Gateway,
    /// The engine answered for the request with another 5xx (a 500: llama-cpp-python's
    /// answer to a body it cannot parse). Its breaker counts it only once another engine
    /// or a peer serves the same request.
    Answered,
}

impl EngineFailureKind {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            EngineFailureKind::Gateway => "gateway",
            EngineFailureKind::Answered => "answered",
        }
    }
}

impl prometheus_client::encoding::EncodeLabelValue for EngineFailureKind {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelValueEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        prometheus_client::encoding::EncodeLabelValue::encode(&self.as_str(), encoder)
    }
}

/// Labels of engine failures.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EngineFailureLabels {
    /// `gateway` or `answered` ([`EngineFailureKind`]).
    pub kind: EngineFailureKind,
}

/// Every metric the node exports.
#[derive(Debug)]
pub struct NodeMetrics {
    registry: Registry,
    /// Held while the families rebuilt at each scrape are cleared and refilled
    /// ([`crate::NodeState::refresh_gauges`]) and while the registry is encoded: a
    /// second scrape at the same moment (an HA pair of Prometheus servers) would
    /// otherwise encode between the clear and the refill, and miss those series.
    refill: parking_lot::Mutex<()>,
    /// Requests by outcome, routing policy and serving region.
    pub requests: Family<RequestLabels, Counter>,
    /// Time to first content byte at the client, seconds.
    pub ttft: Histogram,
    /// End to end, seconds.
    pub e2e: Histogram,
    /// Forwards sent, by peer and result.
    pub forwards: Family<ForwardLabels, Counter>,
    /// Forwards received from peers.
    pub forwards_received: Counter,
    /// Forwards from peers this node refused (serving them here would cost more).
    pub forwards_refused: Counter,
    /// Cost terms of the chosen candidate, seconds.
    pub cost_terms: Family<TermLabels, Histogram>,
    /// Gossip bytes sent (the cluster's running total, mirrored at each scrape:
    /// `NodeMetrics::observe_gossip`).
    pub gossip_sent_bytes: Counter,
    /// Gossip bytes received.
    pub gossip_received_bytes: Counter,
    /// Claims of a peer's node id from a second address, refused (an impostor with
    /// its certificate, or a node restarted elsewhere before its old self was
    /// declared down): nonzero means two processes run with one certificate.
    pub cluster_identity_conflicts: Counter,
    /// Claims of this node's own id by another process, refused.
    pub cluster_own_id_claimed: Counter,
    /// Connections peers closed because they hold this node's own id alive at another
    /// address: nonzero means this process is a second one with a live node's id.
    pub cluster_own_id_refused: Counter,
    /// What the cluster transport refused or dropped, by kind (garbage on the gossip
    /// port, a wrong certificate, a certificate holder opening too many connections).
    pub cluster_refused: Family<RefusedLabels, Counter>,
    /// Cluster payload bytes, by traffic kind and direction (the split of
    /// `gossip_sent_bytes` and `gossip_received_bytes`).
    pub cluster_bytes: Family<TrafficLabels, Counter>,
    /// Summary gossip messages sent, by kind.
    pub gossip_messages_sent: Family<GossipSentLabels, Counter>,
    /// "You were declared down" notices dropped for members that refuted in time.
    pub cluster_spurious_turn_undead_dropped: Counter,
    /// Age of each peer's gossiped prefix summary, seconds (staleness).
    pub prefixes_age: Family<PeerLabels, Gauge<f64, AtomicU64>>,
    /// Age of each peer's queue stats, seconds.
    pub stats_age: Family<PeerLabels, Gauge<f64, AtomicU64>>,
    /// Requests in flight through the ingress.
    pub inflight: Gauge,
    /// How many of the node's engines are healthy (1 or 0 for a one-engine node).
    pub engine_healthy: Gauge,
    /// Per engine: 1 while it takes requests (healthy and not drained).
    pub replica_serving: Family<ReplicaLabels, Gauge>,
    /// Per engine: requests dispatched to it and not finished.
    pub replica_inflight: Family<ReplicaLabels, Gauge>,
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
    /// Bytes of request bodies being read, held from `limits.max_body_bytes_in_flight`.
    pub body_bytes_reading: Gauge,
    /// State of the engine's circuit breaker: 0 closed, 1 open, 2 half-open.
    pub engine_breaker: Gauge,
    /// Failures of real requests to the engines, by kind: those that count towards the
    /// breaker at once (`gateway`) and the engines' other 5xx answers (`answered`).
    /// Counted through [`NodeMetrics::engine_failed`].
    pub engine_failures: Family<EngineFailureLabels, Counter>,
    /// The bytes-per-token ratio the node counts with (learned from the engine without
    /// a tokenizer).
    pub bytes_per_token: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// |node's prompt-token count - engine's `usage.prompt_tokens`| / engine's, per
    /// request served locally whose response reported usage.
    pub prompt_token_error: Histogram,
    /// |cached tokens the index predicted at dispatch - the engine's reported
    /// `cached_tokens`| / prompt tokens, per request served locally that reported it:
    /// how well the prefix index knows the engine's cache.
    pub cache_estimate_error: Histogram,
    /// The KV-event stream (`engine.kv_events`).
    pub kv_events: KvEventMetrics,
}

/// The KV-event stream's metrics: the follower's counters, mirrored at each step.
#[derive(Debug, Default)]
pub struct KvEventMetrics {
    /// 1 while the prefix index follows the engine's events, 0 on the shadow model.
    pub source_events: Gauge,
    /// Seconds the index followed the shadow model though events were configured.
    pub fallback_seconds: Counter<f64, AtomicU64>,
    /// Batches applied.
    pub batches: Counter,
    /// Events applied.
    pub events: Counter,
    /// Seq gaps.
    pub gaps: Counter,
    /// Replays asked for.
    pub replays: Counter,
    /// Replays failed (timeout, broken, incomplete).
    pub replay_failures: Counter,
    /// Resyncs (every block forgotten, back to the shadow model).
    pub resyncs: Counter,
    /// Publisher restarts.
    pub restarts: Counter,
    /// Messages that did not decode, oversized ones included.
    pub decode_errors: Counter,
    /// Silent streams.
    pub silences: Counter,
    /// Connections to the publisher the engine closed (each a resync: it may have
    /// restarted).
    pub disconnects: Counter,
    /// Engine blocks ignored (LoRA, other tiers, unknown parents, odd sizes) or
    /// dropped over `engine.kv_events_max_blocks`.
    pub ignored_blocks: Counter,
    /// Connections to a publisher cut at a frame the decoder must not read (counted by
    /// the relay, `kv_guard`, not the follower).
    pub refused_frames: Counter,
    /// Each engine's totals mirrored so far, and its source, by replica.
    last: parking_lot::Mutex<
        std::collections::BTreeMap<
            u16,
            (
                gorgo_core::kv_events::KvEventCounters,
                u64,
                gorgo_core::IndexSource,
            ),
        >,
    >,
    /// Replicas that left the node. Replica numbers are never reused within a run, so
    /// a report of one of them is its event task's last, racing its removal: mirrored,
    /// it would add the engine's whole totals again and count its source once more.
    forgotten: parking_lot::Mutex<std::collections::BTreeSet<u16>>,
}

impl KvEventMetrics {
    fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("kv_event");
        r.register(
            "source_events",
            "1 while the prefix index follows the engine's KV events, 0 on the shadow model",
            self.source_events.clone(),
        );
        r.register(
            "fallback_seconds",
            "Time the prefix index followed the shadow model though KV events are configured",
            self.fallback_seconds.clone(),
        );
        for (name, help, c) in [
            ("batches", "KV event batches applied", &self.batches),
            ("events", "KV events applied", &self.events),
            ("gaps", "Gaps in the KV event sequence", &self.gaps),
            ("replays", "KV event replays asked for", &self.replays),
            (
                "replay_failures",
                "KV event replays that timed out, broke or came back incomplete",
                &self.replay_failures,
            ),
            (
                "resyncs",
                "KV event resyncs: every block forgotten, back to the shadow model",
                &self.resyncs,
            ),
            (
                "restarts",
                "KV event publisher restarts (the sequence went back)",
                &self.restarts,
            ),
            (
                "decode_errors",
                "KV event messages that did not decode, oversized ones included",
                &self.decode_errors,
            ),
            (
                "silences",
                "KV event streams gone silent while requests were served",
                &self.silences,
            ),
            (
                "disconnects",
                "Connections to a KV event publisher its engine closed (each a resync: it may have restarted)",
                &self.disconnects,
            ),
            (
                "ignored_blocks",
                "Engine blocks the index cannot use or track (LoRA, other tiers, unknown parent, over the cap)",
                &self.ignored_blocks,
            ),
            (
                "refused_frames",
                "Connections to a KV event publisher cut at a frame over the size limits or a malformed command",
                &self.refused_frames,
            ),
        ] {
            r.register(name, help, c.clone());
        }
    }

    /// Engine `replica` left the node: its last source no longer counts towards
    /// `source_events` (a removed engine that had fallen back to the shadow model held
    /// the gauge at 0 for good). The counters keep what it added.
    pub fn forget(&self, replica: u16) {
        let mut all = self.last.lock();
        self.forgotten.lock().insert(replica);
        all.remove(&replica);
        self.source_events.set(Self::following(&all) as i64);
    }

    /// Whether the node's index follows engine events: some engine has them, and every
    /// engine that has them follows them (with none, `all` over nothing was true).
    fn following(
        all: &std::collections::BTreeMap<
            u16,
            (
                gorgo_core::kv_events::KvEventCounters,
                u64,
                gorgo_core::IndexSource,
            ),
        >,
    ) -> bool {
        !all.is_empty()
            && all
                .values()
                .all(|(_, _, s)| *s == gorgo_core::IndexSource::Events)
    }

    /// Mirror the totals of engine `replica`'s follower into the node's (counters
    /// only ever move forward; the node's are the sum over its engines); returns the
    /// totals mirrored before, so the caller can log what moved; `None` for an engine
    /// that has left the node ([`KvEventMetrics::forget`]), whose reports count no
    /// more. `source_events` is 1 while every engine with KV events follows them.
    pub fn observe(
        &self,
        replica: u16,
        now: &gorgo_core::kv_events::KvEventCounters,
        fallback_ms: u64,
        source: gorgo_core::IndexSource,
    ) -> Option<gorgo_core::kv_events::KvEventCounters> {
        let mut all = self.last.lock();
        if self.forgotten.lock().contains(&replica) {
            return None;
        }
        let last = all.entry(replica).or_insert((
            gorgo_core::kv_events::KvEventCounters::default(),
            0,
            source,
        ));
        let (was, was_fallback_ms, _) = *last;
        let up = |c: &Counter, now: u64, was: u64| {
            c.inc_by(now.saturating_sub(was));
        };
        up(&self.batches, now.batches, was.batches);
        up(&self.events, now.events, was.events);
        up(&self.gaps, now.gaps, was.gaps);
        up(&self.replays, now.replays, was.replays);
        up(
            &self.replay_failures,
            now.replay_failures,
            was.replay_failures,
        );
        up(&self.resyncs, now.resyncs, was.resyncs);
        up(&self.restarts, now.restarts, was.restarts);
        up(&self.decode_errors, now.decode_errors, was.decode_errors);
        up(&self.silences, now.silences, was.silences);
        up(&self.disconnects, now.disconnects, was.disconnects);
        up(
            &self.ignored_blocks,
            now.ignored_blocks + now.dropped_blocks,
            was.ignored_blocks + was.dropped_blocks,
        );
        self.fallback_seconds
            .inc_by(fallback_ms.saturating_sub(was_fallback_ms) as f64 / 1000.0);
        *last = (*now, fallback_ms.max(was_fallback_ms), source);
        self.source_events.set(Self::following(&all) as i64);
        Some(was)
    }
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
            "Client requests by outcome, routing policy and serving region",
            requests.clone(),
        );
        let ttft = Histogram::new(exponential_buckets(0.005, 1.6, 20));
        registry.register(
            "ttft_seconds",
            "Time to first content byte at the client, of streamed responses",
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
        let forwards_refused = Counter::default();
        registry.register(
            "forwards_refused",
            "Forwards from peers refused: serving them here would cost more than at the forwarding node",
            forwards_refused.clone(),
        );
        // 1 ms to about 33 s.
        let cost_terms = Family::<TermLabels, Histogram>::new_with_constructor(
            (|| Histogram::new(exponential_buckets(0.001, 2.0, 16))) as fn() -> Histogram,
        );
        registry.register(
            "cost_term_seconds",
            "Cost terms of the chosen candidate, as the cost model estimated them",
            cost_terms.clone(),
        );
        // Counters (`_total` on their samples), mirrored from the cluster's running
        // totals at each scrape; the unit ends the name.
        let gossip_sent_bytes = Counter::default();
        registry.register(
            "gossip_sent_bytes",
            "Gossip bytes sent",
            gossip_sent_bytes.clone(),
        );
        let gossip_received_bytes = Counter::default();
        registry.register(
            "gossip_received_bytes",
            "Gossip bytes received",
            gossip_received_bytes.clone(),
        );
        let cluster_identity_conflicts = Counter::default();
        registry.register(
            "cluster_identity_conflicts",
            "Claims of a peer's node id from a second address, refused",
            cluster_identity_conflicts.clone(),
        );
        let cluster_own_id_claimed = Counter::default();
        registry.register(
            "cluster_own_id_claimed",
            "Claims of this node's own id by another process, refused",
            cluster_own_id_claimed.clone(),
        );
        let cluster_own_id_refused = Counter::default();
        registry.register(
            "cluster_own_id_refused",
            "Connections peers closed because they hold this node's own id alive at another address",
            cluster_own_id_refused.clone(),
        );
        let cluster_refused = Family::<RefusedLabels, Counter>::default();
        registry.register(
            "cluster_refused",
            "What the cluster transport refused or dropped from the network, by kind",
            cluster_refused.clone(),
        );
        let cluster_bytes = Family::<TrafficLabels, Counter>::default();
        registry.register(
            "cluster_bytes",
            "Cluster payload bytes, by traffic kind and direction",
            cluster_bytes.clone(),
        );
        let gossip_messages_sent = Family::<GossipSentLabels, Counter>::default();
        registry.register(
            "gossip_messages_sent",
            "Summary gossip messages sent, by kind",
            gossip_messages_sent.clone(),
        );
        let cluster_spurious_turn_undead_dropped = Counter::default();
        registry.register(
            "cluster_spurious_turn_undead_dropped",
            "Declared-down notices dropped for members that refuted their suspicion in time",
            cluster_spurious_turn_undead_dropped.clone(),
        );
        // Not `..._summary_...`: promtool reads that as the name of a summary metric.
        let prefixes_age = Family::<PeerLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "peer_prefixes_age_seconds",
            "Age of each peer's gossiped prefix summary",
            prefixes_age.clone(),
        );
        let stats_age = Family::<PeerLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "peer_stats_age_seconds",
            "Age of each peer's queue stats",
            stats_age.clone(),
        );
        let inflight = Gauge::default();
        registry.register(
            "inflight_requests",
            "Client requests in flight through the ingress, from admission to the body's end",
            inflight.clone(),
        );
        let engine_healthy = Gauge::default();
        registry.register(
            "engine_healthy",
            "How many of the node's engines pass health checks",
            engine_healthy.clone(),
        );
        let replica_serving = Family::<ReplicaLabels, Gauge>::default();
        registry.register(
            "engine_replica_serving",
            "1 while this engine of the node takes requests (healthy, not drained)",
            replica_serving.clone(),
        );
        let replica_inflight = Family::<ReplicaLabels, Gauge>::default();
        registry.register(
            "engine_replica_inflight_requests",
            "Requests dispatched to this engine of the node and not finished",
            replica_inflight.clone(),
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
        let body_bytes_reading = Gauge::default();
        registry.register(
            "request_body_reading_bytes",
            "Bytes of request bodies (clients' and peers' forwards) being read, held from limits.max_body_bytes_in_flight",
            body_bytes_reading.clone(),
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
        let engine_failures = Family::<EngineFailureLabels, Counter>::default();
        // Both series from the start: an alert's rate() has a zero to start from.
        for kind in [EngineFailureKind::Gateway, EngineFailureKind::Answered] {
            let _ = engine_failures.get_or_create(&EngineFailureLabels { kind });
        }
        registry.register(
            "engine_failures",
            "Failures of real requests to the engines: gateway (no answer, a broken stream, a 502/503/504: counted by the breaker) or answered (another 5xx)",
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
        let cache_estimate_error =
            Histogram::new([0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0]);
        registry.register(
            "cache_estimate_error_ratio",
            "|cached tokens the prefix index predicted - the engine's cached_tokens| / prompt tokens, per local request",
            cache_estimate_error.clone(),
        );
        let kv_events = KvEventMetrics::default();
        kv_events.register(&mut registry);
        NodeMetrics {
            refill: parking_lot::Mutex::new(()),
            cache_estimate_error,
            kv_events,
            bytes_per_token,
            prompt_token_error,
            connections,
            body_bytes_reading,
            engine_breaker,
            engine_failures,
            registry,
            requests,
            ttft,
            e2e,
            forwards,
            forwards_received,
            forwards_refused,
            cost_terms,
            gossip_sent_bytes,
            gossip_received_bytes,
            cluster_identity_conflicts,
            cluster_refused,
            cluster_bytes,
            gossip_messages_sent,
            cluster_spurious_turn_undead_dropped,
            cluster_own_id_claimed,
            cluster_own_id_refused,
            prefixes_age,
            stats_age,
            inflight,
            engine_healthy,
            replica_serving,
            replica_inflight,
            peers_alive,
            tuning_epoch,
            tuning_leader,
            tuning_trials,
        }
    }

    /// Count one request refused before it was routed (no policy placed it).
    pub fn request(&self, outcome: &str, served_by: &str) {
        self.routed_request(outcome, "", served_by);
    }

    /// Count one finished request that `policy` routed.
    pub fn routed_request(&self, outcome: &str, policy: &str, served_by: &str) {
        self.requests
            .get_or_create(&RequestLabels {
                outcome: outcome.to_owned(),
                policy: policy.to_owned(),
                served_by: served_by.to_owned(),
            })
            .inc();
    }

    /// Mirror the cluster's running totals (`g`, counts since the node started) into
    /// their counters: each moves up by what its total grew since the last scrape
    /// (a counter holds the last total mirrored, nothing else moves it). Called under
    /// [`refilling`](Self::refilling), so two scrapes at once do not both add the
    /// same growth.
    pub(crate) fn observe_gossip(&self, g: &crate::peers::GossipCounters) {
        let mirror = |c: &Counter, total: u64| c.inc_by(total.saturating_sub(c.get()));
        mirror(&self.gossip_sent_bytes, g.bytes_sent);
        mirror(&self.gossip_received_bytes, g.bytes_received);
        mirror(&self.cluster_identity_conflicts, g.identity_conflicts);
        mirror(&self.cluster_own_id_claimed, g.own_id_claimed);
        mirror(&self.cluster_own_id_refused, g.own_id_refused);
        mirror(
            &self.cluster_spurious_turn_undead_dropped,
            g.spurious_turn_undead_dropped,
        );
        let r = g.refused;
        for (what, total) in [
            ("malformed", r.malformed),
            ("spoofed", r.spoofed),
            ("handshake", r.handshake),
            ("other_protocol", r.other_protocol),
            ("foreign_certificate", r.foreign_certificate),
            ("expired_certificate", r.expired_certificate),
            ("unbound_stream", r.unbound_stream),
            ("excess_connection", r.excess_connection),
            ("misaddressed_announce", r.misaddressed_announce),
        ] {
            let labels = RefusedLabels {
                what: what.to_owned(),
            };
            mirror(&self.cluster_refused.get_or_create(&labels), total);
        }
        let t = g.traffic;
        for (traffic, (sent, received)) in
            [("swim", t.swim), ("summary", t.summary), ("app", t.app)]
        {
            for (direction, total) in [("sent", sent), ("received", received)] {
                let labels = TrafficLabels {
                    traffic: traffic.to_owned(),
                    direction: direction.to_owned(),
                };
                mirror(&self.cluster_bytes.get_or_create(&labels), total);
            }
        }
        let s = g.messages_sent;
        for (kind, total) in [
            ("delta", s.deltas),
            ("snapshot", s.snapshots),
            ("snapshot_request", s.snapshot_requests),
        ] {
            let labels = GossipSentLabels {
                kind: kind.to_owned(),
            };
            mirror(&self.gossip_messages_sent.get_or_create(&labels), total);
        }
    }

    /// Count one failure of a real request to an engine.
    pub fn engine_failed(&self, kind: EngineFailureKind) {
        self.engine_failures
            .get_or_create(&EngineFailureLabels { kind })
            .inc();
    }

    /// The engine failures of `kind` counted so far.
    pub fn engine_failures_of(&self, kind: EngineFailureKind) -> u64 {
        self.engine_failures
            .get_or_create(&EngineFailureLabels { kind })
            .get()
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

    /// Record the chosen candidate's cost terms (the core's are in ms).
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
                    .observe(v.max(0.0) / 1000.0);
            }
        }
    }

    /// Hold off [`encode`](Self::encode) while the families that are cleared and
    /// refilled at each scrape are rebuilt (release it once they are whole again).
    pub fn refilling(&self) -> parking_lot::MutexGuard<'_, ()> {
        self.refill.lock()
    }

    /// Render the OpenMetrics text format (what Prometheus asks for).
    pub fn encode(&self) -> String {
        // Never between a clear and its refill.
        let _whole = self.refill.lock();
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// Render the Prometheus text format 0.0.4, for readers that know no OpenMetrics
    /// (`promtool check metrics`, `curl`). The two differ, for these metrics, only in
    /// how a counter family is named: OpenMetrics names it without the `_total` of its
    /// samples, which the older format reads as a second family with no help text.
    pub fn encode_prometheus_text(&self) -> String {
        openmetrics_to_prometheus_text(&self.encode())
    }
}

/// Rewrite OpenMetrics text as Prometheus text 0.0.4: counter families take their
/// samples' `_total` name, and the `# EOF` and `# UNIT` lines (0.0.4 has neither) go.
fn openmetrics_to_prometheus_text(open: &str) -> String {
    let counters: std::collections::HashSet<&str> = open
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(open.len() + 16 * counters.len());
    for line in open.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta.and_then(|(p, rest)| Some((p, rest.split_once(' ')?))) {
            Some((prefix, (name, rest))) if counters.contains(name) => {
                out.push_str(prefix);
                out.push_str(name);
                out.push_str("_total ");
                out.push_str(rest);
            }
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `source_events` says whether every engine with KV events follows them: an
    /// engine that left no longer counts, whatever its last source was.
    #[test]
    fn a_removed_engine_no_longer_holds_the_kv_source_gauge() {
        use gorgo_core::kv_events::KvEventCounters;
        use gorgo_core::IndexSource;
        let m = KvEventMetrics::default();
        let none = KvEventCounters::default();
        m.observe(1, &none, 0, IndexSource::Shadow);
        m.observe(0, &none, 0, IndexSource::Events);
        assert_eq!(m.source_events.get(), 0);
        m.forget(1);
        assert_eq!(m.source_events.get(), 1);
        m.observe(0, &none, 0, IndexSource::Events);
        assert_eq!(m.source_events.get(), 1);
        // The last engine with events leaves: nothing follows events any more.
        m.forget(0);
        assert_eq!(m.source_events.get(), 0);
    }

    /// An engine without KV events leaving a node that has none leaves the gauge at 0
    /// (`all` over no engine was true: it said 1); a report of an engine's event task
    /// that lands after the engine left counts nothing (mirrored against nothing, it
    /// added the engine's whole totals again, and its source counted once more).
    #[test]
    fn a_node_without_kv_events_and_an_engine_gone_count_nothing() {
        use gorgo_core::kv_events::KvEventCounters;
        use gorgo_core::IndexSource;
        let m = KvEventMetrics::default();
        m.forget(3);
        assert_eq!(m.source_events.get(), 0);
        let five = KvEventCounters {
            batches: 5,
            ..KvEventCounters::default()
        };
        assert!(m.observe(1, &five, 0, IndexSource::Events).is_some());
        assert_eq!(m.batches.get(), 5);
        m.forget(1);
        assert!(m.observe(1, &five, 0, IndexSource::Shadow).is_none());
        assert_eq!(m.batches.get(), 5);
        assert_eq!(m.source_events.get(), 0);
    }

    #[test]
    fn prometheus_text_names_counter_families_by_their_samples() {
        let m = NodeMetrics::new();
        m.routed_request("ok", "gorgo", "a");
        m.ttft.observe(0.1);
        let text = m.encode_prometheus_text();
        assert!(
            text.contains("# HELP gorgo_requests_total Client requests"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE gorgo_requests_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains(r#"gorgo_requests_total{outcome="ok",policy="gorgo",served_by="a"} 1"#),
            "{text}"
        );
        // Histograms and gauges are named alike in both formats.
        assert!(
            text.contains("# TYPE gorgo_ttft_seconds histogram\n"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE gorgo_inflight_requests gauge\n"),
            "{text}"
        );
        assert!(!text.contains("# EOF"), "{text}");
        assert!(m.encode().ends_with("# EOF\n"));
    }
}
