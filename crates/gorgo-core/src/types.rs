//! Small value types shared by every module and by the drivers.

use serde::{Deserialize, Serialize};

/// A node's identity in the cluster. Ordered: the smallest live id leads tuning.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NodeId(pub String);

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for NodeId {
    fn from(s: &str) -> Self {
        NodeId(s.to_owned())
    }
}

/// The tunable weights of the cost model (`w_rtt`, `w_queue`). Unknown keys are
/// refused: `routing.weights = { w_prefill = 2.0, .. }` was dropped without a word.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Weights {
    /// Multiplies the network RTT term.
    pub w_rtt: f64,
    /// Multiplies the queueing term.
    pub w_queue: f64,
}

impl Default for Weights {
    /// docs/design.md: if every estimate were exact the ideal weights would both be 1.0.
    fn default() -> Self {
        Weights {
            w_rtt: 1.0,
            w_queue: 1.0,
        }
    }
}

/// Largest weight a person may set (`routing.weights`, `PUT /admin/weights`): far
/// beyond any the tuner's bounds reach, and one rule for both, so that weights the
/// config took can be put back through the admin API.
pub const MAX_WEIGHT: f64 = 100.0;

impl Weights {
    /// The first weight (`"w_rtt"` or `"w_queue"`) that is not a finite number in
    /// `[0, MAX_WEIGHT]`, if any.
    pub fn out_of_range(&self) -> Option<&'static str> {
        [("w_rtt", self.w_rtt), ("w_queue", self.w_queue)]
            .into_iter()
            .find(|(_, w)| !(w.is_finite() && (0.0..=MAX_WEIGHT).contains(w)))
            .map(|(name, _)| name)
    }
}

/// Most model ids a node's stats carry (vLLM lists every LoRA adapter as a model): a
/// bound on what one peer's stats can make every other node hold and scan.
pub const MAX_MODELS: usize = 64;

/// Longest model id a node's stats carry, bytes.
pub const MAX_MODEL_ID_BYTES: usize = 256;

/// A node's load signals, gossiped to peers (foca broadcast and with each summary).
///
/// Versioned per run of the origin's process so that a receiver drops a stale copy:
/// copies are ordered by [`QueueStats::order`], incarnation first.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct QueueStats {
    /// Monotonic per incarnation of the origin; higher wins.
    pub version: u64,
    /// Prompt tokens admitted and not yet prefilled (the prefill queue).
    pub unfinished_prefill_tokens: u64,
    /// Requests running on the engine.
    pub running: u32,
    /// Requests waiting for admission.
    pub waiting: u32,
    /// KV tokens in use.
    pub kv_used_tokens: u64,
    /// KV capacity in tokens.
    pub kv_capacity_tokens: u64,
    /// Raw prompt tokens of requests dispatched and not finished (for `gorgo-paper`).
    pub queued_prompt_tokens: u64,
    /// The node's fitted prefill cost per uncached token, ms.
    pub t_p_ms: f64,
    /// The node's fitted fixed TTFT cost, ms.
    pub base_ms: f64,
    /// The node's fitted cost of one decode step at its current batch, ms.
    pub decode_step_ms: f64,
    /// The tuning epoch the node routes with.
    pub epoch: u64,
    /// Which run of the origin's process these come from (the cluster stamps its start
    /// time, ms): a restarted node counts `version` afresh, so without it a receiver
    /// would keep the dead run's higher versions (docs/cluster.md, "Incarnations").
    /// 0 where nodes never restart (the simulator).
    #[serde(default)]
    pub incarnation: u64,
    /// The origin is draining (about to shut down): peers route nothing new to it,
    /// while what is in flight there finishes (docs/cluster.md, "Leaving").
    #[serde(default)]
    pub draining: bool,
    /// The model ids the origin's engine serves (its `/v1/models`), so that a request
    /// naming a model goes only where it is served. Empty: not known (yet), or a driver
    /// without models (the simulator); such a node is taken to serve any model.
    #[serde(default)]
    pub models: Vec<String>,
    /// Which of the origin's engines (replicas, numbered from 0 in its config) these
    /// describe: a node fronting several engines gossips one stats stream and one
    /// summary per engine, so that every peer decides over every engine of the cluster
    /// (docs/design.md, "Replicas"). Below [`MAX_REPLICAS`]; 0 for a one-engine node.
    #[serde(default)]
    pub replica: u16,
    /// The engine's slots, where its concurrency limit is known (configured, or
    /// reported by the engine): with them the queue estimate counts the decode of the
    /// requests ahead that hold the slots ([`crate::cost::slot_wait_ms`]). `None` (one
    /// byte on the wire) otherwise.
    #[serde(default)]
    pub slots: Option<EngineSlots>,
}

/// An engine's concurrency limit and how long a request holds a slot there: what the
/// slot wait ([`crate::cost::slot_wait_ms`]) needs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EngineSlots {
    /// How many requests the engine runs at once, from the node's config (llama.cpp's
    /// `--parallel`, vLLM's `--max-num-seqs`, SGLang's `--max-running-requests`).
    pub max_running: u32,
    /// How long the node's requests decoded at this engine (first token to finish),
    /// an average over its recent ones, ms; 0 before the first finishes.
    pub decode_ms: f64,
}

/// Most engines one node fronts: a bound on per-replica state kept for a peer (a
/// peer's stats naming a higher replica are dropped on receipt).
pub const MAX_REPLICAS: u16 = 64;

impl QueueStats {
    /// Where this copy stands among its origin's copies, `(incarnation, version)`:
    /// the one comparison every receiver makes (peer gossip, the forward ledger).
    pub fn order(&self) -> (u64, u64) {
        (self.incarnation, self.version)
    }

    /// Whether the origin serves `model`: it lists it, or it lists no models at all
    /// (unknown is not "no": an engine whose model list could not be read still
    /// serves, and the engine itself answers a wrong name).
    pub fn serves(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|m| m == model)
    }

    /// Replace each figure a receiver prices a peer by (`t_p_ms`, `base_ms`,
    /// `decode_step_ms`, the slots' `decode_ms`) that is not a finite number >= 0 by 0,
    /// which every reader takes as "not reported" (the fallback `t_p`, no fixed cost, no
    /// decode steps, no slot wait): what a receiver does to stats from the network
    /// before holding them. Why: the cost model guards each use, but a figure held as
    /// NaN or negative is one guard away from every decision, in every driver that
    /// reads it (the decision log and the admin API show what is held, too).
    pub fn bound_figures(&mut self) {
        let sane = |v: &mut f64| {
            if !(v.is_finite() && *v >= 0.0) {
                *v = 0.0;
            }
        };
        sane(&mut self.t_p_ms);
        sane(&mut self.base_ms);
        sane(&mut self.decode_step_ms);
        if let Some(s) = self.slots.as_mut() {
            sane(&mut s.decode_ms);
        }
    }

    /// Keep at most [`MAX_MODELS`] model ids of at most [`MAX_MODEL_ID_BYTES`]: what a
    /// receiver does to stats from the network before holding them.
    pub fn bound_models(&mut self) {
        self.models
            .retain(|m| !m.is_empty() && m.len() <= MAX_MODEL_ID_BYTES);
        self.models.truncate(MAX_MODELS);
    }
}
