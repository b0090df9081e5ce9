//! What one policy's run produces: compact per-request rows (up to a cap), streaming
//! sketches of every latency (always), counters for conservation checks, and tuning
//! records.
//!
//! Rows are kept only up to [`crate::SimConfig::max_rows`] so memory is bounded by the
//! cap, not by trace length; past it the report is built from the sketches.

use gorgo_core::decision::DecisionRecord;
use gorgo_core::tuning::TuningRecord;
use gorgo_core::LatencySketch;
use serde::Serialize;

/// One finished request, compactly (about 48 bytes): what `requests.csv` needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// Position of the request in the trace (its id is `r<index>`).
    pub index: u64,
    /// Client's home region (index into the network's regions).
    pub home: u8,
    /// Serving region, `None` when nothing served it.
    pub served: Option<u8>,
    /// Forwards between nodes.
    pub hops: u8,
    /// False when the request failed (engine refusal, no candidate).
    pub ok: bool,
    /// Why it failed, when it did.
    pub error: Option<Box<str>>,
    /// Time to first token at the client, ms.
    pub ttft_ms: f32,
    /// End-to-end latency at the client, ms.
    pub e2e_ms: f32,
    /// When the client sent it, ms from the start of the run.
    pub start_ms: f64,
    /// Prompt tokens.
    pub input_tokens: u32,
    /// Output tokens.
    pub output_tokens: u32,
    /// Prompt tokens the engine served from its prefix cache.
    pub cached_tokens: u32,
    /// The cost model's TTFT estimate for the chosen candidate at the client's node, ms
    /// (cost-based policies only).
    pub predicted_ttft_ms: Option<f32>,
    /// The prompt tokens the client's node believed its chosen candidate had cached
    /// (distributed modes).
    pub predicted_cached_tokens: Option<u32>,
    /// The longest prefix of the prompt any engine held when the client's node decided
    /// (the truth no node has: splits a miss into placement and eviction).
    pub cached_anywhere_tokens: u32,
}

/// Counts that let a caller check the run: conservation of requests, the max-hops
/// guard, KV occupancy, and how much work the simulation did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SimCounters {
    /// Requests read from the trace.
    pub requests: u64,
    /// Requests whose last byte reached the client.
    pub completed: u64,
    /// Requests that failed.
    pub failed: u64,
    /// Requests served outside their home region.
    pub forwarded: u64,
    /// Forwards their target refused (served at the forwarding node instead).
    pub refused_forwards: u64,
    /// Largest hop count any request reached.
    pub max_hops_seen: u8,
    /// Engine first-token events (one per served request).
    pub first_tokens: u64,
    /// Engine finish events (one per served request).
    pub finishes: u64,
    /// Engine events for a request already finished or never submitted there (must be 0).
    pub unexpected_events: u64,
    /// Per engine (region-major: region `r`'s replica `k` at `r * replicas + k`): the
    /// most KV tokens it ever had in use.
    pub max_used_tokens: Vec<u64>,
    /// Per engine: the most tokens its prefix cache ever held.
    pub max_cached_tokens: Vec<u64>,
    /// Per engine: its KV capacity.
    pub capacity_tokens: Vec<u64>,
    /// Per region: requests its engine served.
    pub served_by_region: Vec<u64>,
    /// Events processed.
    pub events: u64,
    /// Most requests in flight at once (what memory scales with).
    pub max_in_flight: usize,
    /// Gossip messages sent (summaries with stats, snapshot requests), lost ones
    /// included.
    pub gossip_messages: u64,
    /// Their size as the live cluster frames them (the core's encoded message plus the
    /// frame header), bytes; QUIC and UDP overhead not included.
    pub gossip_bytes: u64,
    /// Of `gossip_bytes`, those sent while trace rows were still arriving (until the
    /// last row was read), bytes.
    pub gossip_bytes_arriving: u64,
    /// When the last of those was sent, virtual ms.
    pub gossip_arriving_until_ms: f64,
    /// Gossip messages lost (`gossip_loss`).
    pub gossip_lost: u64,
    /// Gossip messages the receiver refused, as the live cluster refuses them (a
    /// snapshot that would take a peer's engines together over
    /// `max_peer_fingerprints`): counted, and the run goes on.
    pub gossip_refused: u64,
    /// Snapshot requests sent after a version gap.
    pub snapshot_requests: u64,
    /// Times a node held a request back from its engine (`SimConfig::hold_tokens`),
    /// a request held again after a new decision counted again.
    pub holds: u64,
    /// KV tokens every engine's prefix cache held, summed over engines and over samples
    /// taken every 10 s of virtual time (`KV_SAMPLE_MS` in the event loop).
    pub kv_cached_tokens_sampled: u64,
    /// Of those, the tokens of distinct blocks (a block two engines hold counts once):
    /// `1 - unique / cached` is the share of the cluster's cache spent on copies.
    pub kv_unique_tokens_sampled: u64,
    /// Trace rows that arrived out of order (sent at the current time instead).
    pub reordered_rows: u64,
    /// Virtual time at the end, ms.
    pub end_ms: f64,
    /// Per engine (distributed modes): its node's fitted prefill cost at the end, ms
    /// per token (what it gossiped as `t_p`).
    pub fitted_t_p_ms: Vec<f64>,
    /// Per engine (distributed modes): its node's fitted fixed TTFT cost at the end.
    pub fitted_base_ms: Vec<f64>,
    /// Per engine (distributed modes): its node's view accounting at the end (all zero
    /// once every request finished: the view does not drift).
    pub view_counters_end: Vec<gorgo_core::accounting::ViewCounters>,
}

impl SimCounters {
    /// Gossip sent per node per second of virtual time over the whole run, bytes, for a
    /// cluster of `nodes` (the counters sum every node's).
    pub fn gossip_bytes_per_node_per_s(&self, nodes: usize) -> f64 {
        per_node_per_s(self.gossip_bytes, nodes, self.end_ms)
    }

    /// The same while trace rows still arrived (the load the figure is quoted at; after
    /// the last row the engines drain and little but stats travels).
    pub fn gossip_bytes_per_node_per_s_arriving(&self, nodes: usize) -> f64 {
        per_node_per_s(
            self.gossip_bytes_arriving,
            nodes,
            self.gossip_arriving_until_ms,
        )
    }
}

fn per_node_per_s(bytes: u64, nodes: usize, ms: f64) -> f64 {
    bytes as f64 / nodes.max(1) as f64 / (ms / 1000.0).max(1e-9)
}

/// One `tuning.jsonl` line: the core's record plus the policy it tuned.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TuningLine {
    /// The policy being tuned.
    pub policy: String,
    /// Simulated time of the decision, ms from the trace's start.
    pub at_ms: f64,
    /// The decided trial.
    #[serde(flatten)]
    pub record: TuningRecord,
}

/// Streaming aggregates of one policy's run, kept whatever the row cap.
#[derive(Debug, Clone, Default)]
pub struct Sketches {
    /// TTFT of completed requests, ms.
    pub ttft: LatencySketch,
    /// E2E of completed requests, ms.
    pub e2e: LatencySketch,
    /// ITL of completed requests with two or more output tokens, ms.
    pub itl: LatencySketch,
    /// Earliest send, ms.
    pub first_start_ms: f64,
    /// Latest last byte, ms.
    pub last_end_ms: f64,
    /// Per region (index as `PolicyRun::regions`): `(cached, prompt)` tokens of the
    /// completed requests it served, for cache hit ratios.
    pub hit_tokens: Vec<(u64, u64)>,
    /// Absolute percentage errors of the TTFT estimate, completed requests with one.
    pub prediction_ape: LatencySketch,
    /// The cache-estimate error: |cached tokens the client's node predicted for its
    /// choice - the engine's reported cached tokens| / prompt tokens, in percent,
    /// completed requests with a prediction.
    pub cache_estimate_error_pct: LatencySketch,
    /// Sum and count of the same error in tokens (its mean).
    pub cache_estimate_error_tokens: (u64, u64),
}

/// Everything one policy's run produced.
#[derive(Debug, Clone)]
pub struct PolicyRun {
    /// The policy's name.
    pub policy: String,
    /// Region names, in the network's order (rows refer to them by index).
    pub regions: Vec<String>,
    /// Per-request rows, in completion order; `None` when the row cap was exceeded.
    pub rows: Option<Vec<Row>>,
    /// Streaming aggregates.
    pub sketches: Sketches,
    /// Conservation and work counters.
    pub counters: SimCounters,
    /// Decided tuning trials, in decision order.
    pub tuning: Vec<TuningLine>,
    /// The first `SimConfig::decision_log` decisions, in decision order.
    pub decisions: Vec<DecisionLine>,
}

/// One line of `decisions.jsonl`: a decision as the deciding node's `/admin/decisions`
/// would show it, and which node that is.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DecisionLine {
    /// The deciding node (its region's name).
    pub node: String,
    /// The decision.
    #[serde(flatten)]
    pub record: DecisionRecord,
}

/// Accumulates a run's results as requests finish.
#[derive(Debug)]
pub(crate) struct Collector {
    pub(crate) run: PolicyRun,
    max_rows: usize,
}

impl Collector {
    /// `engines` in all, `regions.len()` of them or a multiple (replicas).
    pub(crate) fn new(policy: &str, regions: Vec<String>, engines: usize, max_rows: usize) -> Self {
        let n = regions.len();
        Collector {
            run: PolicyRun {
                policy: policy.to_owned(),
                regions,
                rows: Some(Vec::new()),
                sketches: Sketches {
                    first_start_ms: f64::INFINITY,
                    last_end_ms: f64::NEG_INFINITY,
                    hit_tokens: vec![(0, 0); n],
                    ..Default::default()
                },
                counters: SimCounters {
                    max_used_tokens: vec![0; engines],
                    max_cached_tokens: vec![0; engines],
                    capacity_tokens: vec![0; engines],
                    served_by_region: vec![0; n],
                    ..Default::default()
                },
                tuning: Vec::new(),
                decisions: Vec::new(),
            },
            max_rows,
        }
    }

    pub(crate) fn push(&mut self, row: Row) {
        let s = &mut self.run.sketches;
        let c = &mut self.run.counters;
        s.first_start_ms = s.first_start_ms.min(row.start_ms);
        if row.ok {
            c.completed += 1;
            s.last_end_ms = s.last_end_ms.max(row.start_ms + row.e2e_ms as f64);
            s.ttft.add(row.ttft_ms as f64);
            s.e2e.add(row.e2e_ms as f64);
            if row.output_tokens >= 2 {
                s.itl.add(
                    (row.e2e_ms - row.ttft_ms).max(0.0) as f64 / (row.output_tokens - 1) as f64,
                );
            }
            if row.hops > 0 {
                c.forwarded += 1;
            }
            if let Some(r) = row.served {
                c.served_by_region[r as usize] += 1;
                let h = &mut s.hit_tokens[r as usize];
                h.0 += row.cached_tokens.min(row.input_tokens) as u64;
                h.1 += row.input_tokens as u64;
            }
            if let Some(p) = row.predicted_cached_tokens {
                let error = p.abs_diff(row.cached_tokens.min(row.input_tokens)) as u64;
                s.cache_estimate_error_pct
                    .add(error as f64 / row.input_tokens.max(1) as f64 * 100.0);
                s.cache_estimate_error_tokens.0 += error;
                s.cache_estimate_error_tokens.1 += 1;
            }
            if let Some(p) = row.predicted_ttft_ms {
                if row.ttft_ms > 0.0 {
                    s.prediction_ape
                        .add(((p - row.ttft_ms).abs() / row.ttft_ms * 100.0) as f64);
                }
            }
        } else {
            c.failed += 1;
            s.last_end_ms = s.last_end_ms.max(row.start_ms);
        }
        c.max_hops_seen = c.max_hops_seen.max(row.hops);
        let keep = self
            .run
            .rows
            .as_ref()
            .is_some_and(|r| r.len() < self.max_rows);
        if keep {
            if let Some(rows) = self.run.rows.as_mut() {
                rows.push(row);
            }
        } else {
            self.run.rows = None;
        }
    }
}
