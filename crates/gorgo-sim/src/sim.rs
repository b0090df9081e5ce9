//! The event loop: one binary heap of `(time, seq, event)` over virtual milliseconds.
//!
//! Events: a request reaching its home node (after the client delay), a forward
//! reaching its peer (after the one-way delay), an engine's next iteration end (only
//! the one [`Engine::next_event_time`] reports is scheduled; stale ones are skipped),
//! a node's gossip tick, a gossip or tuning message reaching its peer, and a request's
//! last byte reaching the client. First tokens need no event of their own: the engine
//! reports when they happen and the client sees them a fixed delay later; only a
//! forwarded request's first byte reaching each node that forwarded it is an event
//! (`FirstByte`), because that node learns its forward bias from it then. A response
//! goes back the way its request came, through every node that forwarded it.
//!
//! The trace is streamed: a row is read only when virtual time reaches its send time,
//! so memory follows the requests in flight and the engines' caches, not trace length.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use gorgo_core::accounting::{
    EngineView, ViewConfig, DEFAULT_DECODE_STEP_MS, DEFAULT_METRICS_INTERVAL_MS,
};
use gorgo_core::candidates::{build_candidates, LocalState, PeerState};
use gorgo_core::cost::{Candidate, CostTerms, ForwardLedger};
use gorgo_core::decision::{
    best_local, decide, refuse_forward, DecisionRecord, ForwardOffer, ForwardOrigin,
};
use gorgo_core::es::{TrialDesign, TuningConfig};
use gorgo_core::fit::FitConfig;
use gorgo_core::gossip::{self as core_gossip, GossipConfig, GossipSender, PeerGossip, PeerRun};
use gorgo_core::hold::{Held, HoldConfig, HoldQueue};
use gorgo_core::kv_events::{AlignedBlockEvent, KvEventFollower, KvFollowerConfig};
use gorgo_core::policy::{Policy, PolicyKind, RouteRequest};
use gorgo_core::summary::{SampleChooser, SampleSetting, SummarySample};
use gorgo_core::tuning::{
    Assignment, Cell, EpochKey, EpochReport, OpenRequest, Proposal, TermSample, Tuner, TuningOutput,
};
use gorgo_core::types::MAX_REPLICAS;
use gorgo_core::wire::GossipMessage;
use gorgo_core::{hash::hash_bytes, HashChain, NodeId, QueueStats, ShadowIndex, Weights};
use gorgo_core::{IndexSource, NodeBlockChange};
use gorgo_engine::{CacheChange, Engine, EngineEvent, EngineRequest, Profile};
use gorgo_workload::{TraceRequest, WorkloadError};
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::collect::{Collector, DecisionLine, PolicyRun, Row, TuningLine};
use crate::network::Network;
use crate::{invalid, Result, SimError};

/// Bytes on the wire per streamed output token (one SSE `data:` chunk of an OpenAI
/// chat completion), for the response transfer time over rate-limited links.
pub const SSE_BYTES_PER_TOKEN: f64 = 160.0;

/// How a simulation runs, whatever the policy.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Regions and delays.
    pub network: Network,
    /// One engine profile per region, in the network's order.
    pub profiles: Vec<Profile>,
    /// Engines per region (replicas, each with the region's profile). Every node
    /// decides over its own engines and every peer's, each with its own view, prefix
    /// index and gossip stream (docs/design.md, "Replicas"); 1 by default.
    pub replicas: usize,
    /// Period of each node's gossip (summary delta + queue stats) and tuning tick, ms
    /// (at least 1).
    pub gossip_interval_ms: f64,
    /// Extra transit delay of gossip on top of the one-way delay, ms.
    pub gossip_extra_delay_ms: f64,
    /// Probability that a gossip message (summary, stats, snapshot request) is lost,
    /// drawn per message from a per-node generator seeded by `seed` (the rest of the
    /// run's randomness is unchanged by it). Exercises the receivers' reorder buffers
    /// and snapshot requests.
    pub gossip_loss: f64,
    /// The max-hops guard (docs/design.md default 1).
    pub max_hops: u8,
    /// Multiplies trace inter-arrival times (< 1 compresses and loads the engines).
    pub time_scale: f64,
    /// Seeds jitter, gossip phases, tie-breaks and the tuner's mutations.
    pub seed: u64,
    /// Run the distributed tuning protocol (for the policies that use weights).
    pub tune: bool,
    /// Trial window in requests cluster-wide (`None`: the core's default).
    pub tuning_window: Option<usize>,
    /// How tuning trials compare candidate and incumbent.
    pub trial: TrialDesign,
    /// The tuner's initial step size (`None`: the core's `sigma0`); also lowers
    /// `sigma_min` to it when smaller.
    pub tuning_sigma: Option<f64>,
    /// `[tuning]` keys set on the policy's tuning defaults (the node config's names and
    /// values, e.g. `("max_trial_windows", 2)`), applied after `tuning_sigma` and
    /// checked then; `weights` and `tuning_window` are applied after them and win.
    pub tuning_set: Vec<(String, serde_json::Value)>,
    /// Fixed weights for the policies that use weights, and the start of tuning
    /// (`None`: the policy's defaults).
    pub weights: Option<Weights>,
    /// Salt of the home-region hash (`None`: the same assignment as `gorgo bench`).
    pub region_seed: Option<u64>,
    /// Per-request rows kept per policy; past this only sketches are kept.
    pub max_rows: usize,
    /// Decisions kept per policy for `decisions.jsonl` (the first this many, client
    /// requests, forwards and refusals alike, as the nodes' `/admin/decisions` logs
    /// them); 0 keeps none.
    pub decision_log: usize,
    /// Stop after this many trace rows (`None`: all).
    pub max_requests: Option<u64>,
    /// Shorten prompts so prompt + output fit this context, as `gorgo bench
    /// --max-context-tokens` does (`None`: leave them; too long ones fail).
    pub max_context_tokens: Option<u64>,
    /// Build each prompt's chain the way a live replay does (synthesise the chat body
    /// like `gorgo bench`, render and hash it like the node: 256-byte blocks, 4 bytes
    /// per token) instead of from the trace's block ids. Slower; for side-by-side
    /// comparisons with `gorgo compare`, where hash-keyed policies then pick the same
    /// regions.
    pub live_chains: bool,
    /// Idealisation: each node decides on and gossips its engine's exact state
    /// instead of its own view of it. By default (`false`) a node knows what a deployed
    /// node knows: its [`EngineView`] fed by its own dispatches, first tokens and
    /// finishes and by its engine's `/metrics` scraped every `metrics_interval_ms`.
    /// Either way the prefill fit is the view's.
    pub exact_state: bool,
    /// A bound for distributed routers, not a realisable policy: the oracle counts a
    /// forward that another region decided as in transit to its target only once
    /// news of it could have reached the deciding region (the topology's one-way
    /// delay from the forwarding region), as if every node broadcast each forward the
    /// moment it decided it; its own forwards at once. Engine state stays exact. By
    /// default (`false`) the oracle knows every forward in transit at once, which no
    /// set of nodes apart from each other can know (docs/policy.md, "What the oracle
    /// knows that no node can").
    pub causal_oracle: bool,
    /// The engines do not report their concurrency limit and no node is told it (vLLM,
    /// llama-cpp-python's server). By default (`false`) each node's view knows its
    /// engine's limit (the profile's `max_running_requests`), as a node learns it from
    /// SGLang's `/get_server_info`, llama.cpp's `/props` or the emulator, and its queue
    /// estimate counts the decode of the requests holding the slots
    /// ([`gorgo_core::cost::slot_wait_ms`]).
    pub unreported_max_running: bool,
    /// Period of each node's scrape of its engine's `/metrics`, ms (the node's
    /// `engine.metrics_interval_ms`; at least 1).
    pub metrics_interval_ms: f64,
    /// Late binding (a candidate mechanism the live node does not have yet; 0, the
    /// default: off): each node holds a request it decided for its own engine while
    /// that engine has more than this many prefill tokens dispatched, and decides it
    /// again when an engine has room or once per gossip interval
    /// ([`gorgo_core::hold`]; docs/policy.md, "Late binding").
    pub hold_tokens: u64,
    /// The decode-step cost each node reports in its stats, ms (the node's
    /// `engine.decode_step_ms` seed; engines do not report it).
    pub decode_step_ms: f64,
    /// The nodes' `cluster.summary_sample`: each node's [`SampleChooser`] follows the
    /// topology's peer count (every region but its own, all live), as a live node
    /// follows its membership.
    pub summary_sample: SampleSetting,
    /// Each node's prefix index follows its engine's cache changes (KV events,
    /// docs/kv-events.md) delivered `kv_events_delay_ms` after they happen, through
    /// the core's [`KvEventFollower`], instead of its shadow model.
    pub kv_events: bool,
    /// The engine-to-node transit delay of the KV events, ms.
    pub kv_events_delay_ms: f64,
    /// Targets check forwards against the forwarding node's own cost and refuse the
    /// ones they would serve at a higher cost ([`refuse_forward`]; the node's
    /// `routing.refuse_forwards`).
    pub refuse_forwards: bool,
    /// Share of requests whose client does not stream (`stream: false`, the OpenAI
    /// default), drawn by a hash of the request's index and the seed. Their nodes see
    /// no first token, only the end (`EngineView::dispatch_unobserved`), learn no
    /// forward lateness and record no TTFT for tuning, as the live node; the serving
    /// node's prefix index (and so its peers' summaries) learns their prompt only with
    /// the whole response, when the live node gets the engine's response head. Their
    /// TTFT in the report is still when the first token would have reached the client.
    pub non_streamed_share: f64,
}

/// Period of the samples of every engine's cache that count blocks held twice
/// (`SimCounters::kv_unique_tokens_sampled`), virtual ms.
pub const KV_SAMPLE_MS: f64 = 10_000.0;

/// Bytes the live cluster puts before each gossip message on its uni-stream (kind
/// byte and staleness stamp, `gorgo-cluster`'s gossip frame).
pub const GOSSIP_FRAME_HEADER: usize = 9;

/// Shortest `gossip_interval_ms` and `metrics_interval_ms`, ms: a shorter one added to
/// a late event time in f64 ms can leave it unchanged (`now + 1e-20 == now`), and the
/// run would never end; no live node gossips or scrapes more often than this.
const MIN_INTERVAL_MS: f64 = 1.0;

/// Longest `gossip_interval_ms`, `metrics_interval_ms`, `gossip_extra_delay_ms` and
/// `kv_events_delay_ms`, ms: an hour, far past any deployment's. A `1e12` interval
/// ticked a run for ever, and a `1e8` gossip delay held every message of the run in
/// flight at once.
pub const MAX_INTERVAL_MS: f64 = 3_600_000.0;

/// Largest `time_scale`: stretching a trace ten thousand times leaves its engines idle
/// (the sweeps run 0.0625 to 8). Virtual time is f64 ms: a trace stretched `1e14`
/// times reached 9e18 ms, where a 250 ms tick no longer moves it, and ran for ever.
pub const MAX_TIME_SCALE: f64 = 10_000.0;

/// Latest virtual time a run may reach, ms (about 317 years): f64 ms still resolve
/// microseconds there. A run past it (a trace too long for its time scale, costs or
/// delays too large for the bounds to catch together) fails naming the cause rather
/// than report figures rounded to nonsense, or tick at one instant for ever.
pub const MAX_VIRTUAL_MS: f64 = 1e13;

/// Events a run may handle at one virtual instant before it counts as stuck (time no
/// longer advancing): far more than any trace's burst makes (a few per request).
const MAX_EVENTS_AT_ONE_INSTANT: u64 = 100_000_000;

/// `time_scale` within (0, [`MAX_TIME_SCALE`]]: the rule [`SimConfig::validate`]
/// applies, for a caller that names the value otherwise (`gorgo sweep --rates`).
pub fn check_time_scale(time_scale: f64) -> Result<()> {
    if time_scale.is_finite() && time_scale > 0.0 && time_scale <= MAX_TIME_SCALE {
        Ok(())
    } else {
        Err(invalid(
            "time_scale",
            format!("must be a finite number in (0, {MAX_TIME_SCALE}]"),
        ))
    }
}

impl SimConfig {
    /// Defaults of docs/design.md around a network, one profile for every region.
    pub fn new(network: Network, profile: Profile) -> Self {
        let profiles = vec![profile; network.regions.len()];
        SimConfig {
            network,
            profiles,
            replicas: 1,
            gossip_interval_ms: 250.0,
            gossip_extra_delay_ms: 0.0,
            gossip_loss: 0.0,
            max_hops: 1,
            time_scale: 1.0,
            seed: 0,
            tune: false,
            tuning_window: None,
            trial: TrialDesign::default(),
            tuning_sigma: None,
            tuning_set: Vec::new(),
            weights: None,
            region_seed: None,
            max_rows: 200_000,
            decision_log: 0,
            max_requests: None,
            max_context_tokens: None,
            live_chains: false,
            exact_state: false,
            causal_oracle: false,
            unreported_max_running: false,
            metrics_interval_ms: DEFAULT_METRICS_INTERVAL_MS as f64,
            hold_tokens: 0,
            decode_step_ms: DEFAULT_DECODE_STEP_MS,
            summary_sample: SampleSetting::Auto,
            kv_events: false,
            kv_events_delay_ms: 2.0,
            refuse_forwards: true,
            non_streamed_share: 0.0,
        }
    }

    /// The summary sample the nodes run with: what `summary_sample` gives the
    /// topology's peer count (for the report).
    pub fn summary_sample_rate(&self) -> SummarySample {
        SampleChooser::new(self.summary_sample, self.peer_count()).current()
    }

    /// Peers of every node: all the other regions.
    fn peer_count(&self) -> usize {
        self.network.regions.len().saturating_sub(1)
    }

    /// Check every field; errors name it.
    pub fn validate(&self) -> Result<()> {
        self.network.validate()?;
        if self.profiles.len() != self.network.regions.len() {
            return Err(invalid("profiles", "need one engine profile per region"));
        }
        for p in &self.profiles {
            p.validate().map_err(|e| invalid("engine_profile", e))?;
        }
        if !(1..=MAX_REPLICAS as usize).contains(&self.replicas) {
            return Err(invalid(
                "replicas",
                format!("must be in 1..={MAX_REPLICAS}"),
            ));
        }
        // At least a millisecond: events are times in ms, and an interval so small
        // that `now + interval == now` ticked at one instant for ever. At most an
        // hour, as every delay: a larger one ran for ever or held the run's gossip.
        let interval = format!("must be in [{MIN_INTERVAL_MS}, {MAX_INTERVAL_MS}] (ms)");
        let delay = format!("must be in [0, {MAX_INTERVAL_MS}] (ms)");
        for (field, v, min, reason) in [
            (
                "gossip_interval_ms",
                self.gossip_interval_ms,
                MIN_INTERVAL_MS,
                &interval,
            ),
            (
                "metrics_interval_ms",
                self.metrics_interval_ms,
                MIN_INTERVAL_MS,
                &interval,
            ),
            (
                "gossip_extra_delay_ms",
                self.gossip_extra_delay_ms,
                0.0,
                &delay,
            ),
            ("kv_events_delay_ms", self.kv_events_delay_ms, 0.0, &delay),
        ] {
            if !(v.is_finite() && (min..=MAX_INTERVAL_MS).contains(&v)) {
                return Err(invalid(field, reason.as_str()));
            }
        }
        if !(self.gossip_loss.is_finite() && (0.0..1.0).contains(&self.gossip_loss)) {
            return Err(invalid("gossip_loss", "must be in [0, 1)"));
        }
        check_time_scale(self.time_scale)?;
        if !(self.decode_step_ms.is_finite() && self.decode_step_ms >= 0.0) {
            return Err(invalid("decode_step_ms", "must be >= 0"));
        }
        if self
            .tuning_sigma
            .is_some_and(|s| !(s.is_finite() && s > 0.0))
        {
            return Err(invalid("tuning_sigma", "must be > 0"));
        }
        if let Some(w) = self.weights {
            let ok = |x: f64| x.is_finite() && x > 0.0;
            if !(ok(w.w_rtt) && ok(w.w_queue)) {
                return Err(invalid("weights", "must be finite and > 0"));
            }
        }
        if self.tuning_window == Some(0) {
            return Err(invalid("tuning_window", "must be > 0"));
        }
        // The nodes' tuning, checked as they will build it (the window, the trial
        // design and `tuning_set` together), before any run.
        if self.tune {
            self.tuning_config(PolicyKind::Gorgo, self.seed)?;
        }
        if !(0.0..=1.0).contains(&self.non_streamed_share) {
            return Err(invalid("non_streamed_share", "must be in [0, 1]"));
        }
        Ok(())
    }
}

impl SimConfig {
    /// Whether a run of `kind` tunes its weights: with `tune`, a policy that uses
    /// weights, but not the oracle (which is not tuned).
    pub fn tunes(&self, kind: PolicyKind) -> bool {
        self.tune && kind.uses_weights() && kind != PolicyKind::Oracle
    }

    /// The tuning configuration of a node of `kind` whose mutations are seeded by
    /// `seed`, checked: the policy's defaults, then `trial`, `tuning_sigma`,
    /// `tuning_set` (which may set the seed too), `weights` and `tuning_window`. A
    /// window the trial cannot use is blamed on `tuning_window` when that set it.
    fn tuning_config(&self, kind: PolicyKind, seed: u64) -> Result<TuningConfig> {
        let mut tc = TuningConfig::for_policy(kind);
        tc.seed = seed;
        tc.trial = self.trial;
        if let Some(sigma) = self.tuning_sigma {
            tc.sigma_min = tc.sigma_min.min(sigma);
            tc.sigma0 = sigma.min(tc.sigma_max);
        }
        if !self.tuning_set.is_empty() {
            tc = with_tuning_keys(tc, &self.tuning_set)?;
        }
        if let Some(w) = self.weights {
            tc.w_rtt.start = w.w_rtt.clamp(tc.w_rtt.min, tc.w_rtt.max);
            tc.w_queue.start = w.w_queue.clamp(tc.w_queue.min, tc.w_queue.max);
        }
        if let Some(w) = self.tuning_window {
            tc.window = w;
            tc.min_samples = tc.min_samples.min(w);
        }
        tc.validate().map_err(|e| match e {
            gorgo_core::CoreError::InvalidConfig { field, reason }
                if field == "window_requests" && self.tuning_window.is_some() =>
            {
                invalid("tuning_window", reason)
            }
            e => e.into(),
        })?;
        Ok(tc)
    }
}

/// Where a run stands, for progress lines.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// Trace rows read so far.
    pub requests: u64,
    /// Requests finished (completed or failed).
    pub finished: u64,
    /// Requests in flight.
    pub in_flight: usize,
    /// Virtual time, ms.
    pub now_ms: f64,
}

/// The prompt of a trace row as the engines see it: clamped to the context (which
/// shortens `row`), its chain and its length in tokens. One function for the event
/// loop and the latency floor, so both price the same prompt.
pub(crate) fn prompt(cfg: &SimConfig, row: &mut TraceRequest) -> (HashChain, u64) {
    if let Some(max) = cfg.max_context_tokens {
        gorgo_workload::clamp_to_context(row, max);
    }
    if cfg.live_chains {
        return live_chain(row);
    }
    let mut chain = row.chain();
    let input = row.input_tokens.max(1);
    trim_to_prompt(&mut chain, input);
    // Tokens past the chain are computed but never cached; with no block ids the prompt
    // is all "past the chain".
    let prompt_tokens = input.max(chain.total_tokens());
    (chain, prompt_tokens)
}

/// Drop the blocks listed past a prompt of `input` tokens (a trace's rounding, or a
/// shortened prompt): keep the fewest blocks, at least one, that reach `input`, or all
/// of them. One pass: a row may list far more ids than its length needs (a trace's
/// bad row), and popping one block at a time while re-summing the rest took time
/// quadratic in them (a million ids on a 1-token row: hours).
fn trim_to_prompt(chain: &mut HashChain, input: u64) {
    let mut keep = 1;
    let mut reached = 0u64;
    for (i, &tokens) in chain.block_tokens.iter().enumerate() {
        // The last block stays whatever it holds.
        if i + 1 >= chain.block_tokens.len() {
            break;
        }
        reached += u64::from(tokens);
        if reached >= input {
            break;
        }
        keep = i + 2;
    }
    chain.hashes.truncate(keep);
    chain.block_tokens.truncate(keep);
}

/// The chain and prompt tokens the node computes for the body `gorgo bench` sends.
fn live_chain(row: &TraceRequest) -> (HashChain, u64) {
    let body = gorgo_workload::chat_body(row, gorgo_workload::DEFAULT_MODEL);
    match gorgo_core::prompt::canonicalize(gorgo_core::Endpoint::Chat, &body) {
        Ok(canonical) => {
            let chain = gorgo_core::PromptHasher::default().chain(&canonical);
            let tokens = chain.total_tokens().max(1);
            (chain, tokens)
        }
        // Cannot happen for a body we built; fall back to an uncacheable prompt.
        Err(_) => (HashChain::default(), row.input_tokens.max(1)),
    }
}

#[derive(Debug, Clone, Copy)]
enum Ev {
    /// A request reached its home node.
    Arrival(u32),
    /// A forwarded request reached the node that will serve it.
    ForwardArrival(u32),
    /// An engine (region-major index) may have finished an iteration.
    EngineWake(u16),
    /// A node's gossip and tuning tick.
    Tick(u8),
    /// A message reached its destination.
    Deliver(u32),
    /// A request's last byte reached its client.
    Complete(u32),
    /// A node scrapes one of its engines' `/metrics` (region-major engine index).
    Scrape(u16),
    /// The first byte of a forwarded request reached a node that forwarded it: the
    /// one of its `path` at this index.
    FirstByte(u32, u8),
    /// An engine's KV events reach its node (`kv_events`; region-major engine index).
    KvEvents(u16),
    /// The target's refusal of a forward reached the node that forwarded it.
    Refused(u32),
    /// A node looks at the requests it holds ([`SimConfig::hold_tokens`]).
    HoldTick(u8),
}

struct Scheduled {
    at: f64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    /// Reversed: the heap's top is the earliest event, ties in scheduling order.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .at
            .total_cmp(&self.at)
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

/// `tc` with `keys` set as a node's `[tuning]` table would set them (errors name the
/// key).
fn with_tuning_keys(
    tc: TuningConfig,
    keys: &[(String, serde_json::Value)],
) -> Result<TuningConfig> {
    let mut v = serde_json::to_value(tc).map_err(|e| invalid("tuning_set", e.to_string()))?;
    for (k, val) in keys {
        v[k.as_str()] = val.clone();
    }
    // A value of the wrong type names its key (serde alone said only "invalid type:
    // string \"abc\", expected u32").
    let tc: TuningConfig = serde_path_to_error::deserialize(v).map_err(|e| {
        let key = e.path().to_string();
        let reason = e.into_inner().to_string();
        invalid(
            "tuning_set",
            if key == "." {
                reason
            } else {
                format!("`{key}`: {reason}")
            },
        )
    })?;
    tc.validate()
        .map_err(|e| invalid("tuning_set", e.to_string()))?;
    Ok(tc)
}

/// A request between its arrival and its last byte.
#[derive(Debug)]
struct Flight {
    index: u64,
    chain: HashChain,
    session_key: Option<u64>,
    prompt_tokens: u64,
    output_tokens: u32,
    home: u8,
    /// The region serving it (for a forward on its way: its target).
    served: Option<u8>,
    /// Which engine of `served` serves it (for a forward on its way: the one the
    /// deciding node priced, until the target picks its own).
    replica: u16,
    hops: u8,
    /// Its forwards so far, from its home node on: the way its response comes back,
    /// and the nodes it has left (a forward's `via`).
    path: Vec<Hop>,
    send_ms: f64,
    /// When it reached its home node, ms (its first decision there).
    arrived_ms: f64,
    dispatched_ms: f64,
    epoch: EpochKey,
    /// The tuning cell it is measured in (its arm of an interleaved trial, and half).
    cell: Cell,
    /// The home tuner's handle once the TTFT counted (`Tuner::record_first_token`),
    /// handed back at the end.
    open: Option<OpenRequest>,
    ttft_ms: f64,
    cached_tokens: u64,
    first_token_seen: bool,
    /// Whether its client streams ([`SimConfig::non_streamed_share`]): only then does
    /// a node see its first token.
    streamed: bool,
    /// The TTFT the client's node's decision predicted for its chosen candidate, ms
    /// (cost-based policies only).
    predicted_ttft_ms: Option<f32>,
    /// How long it had waited at its node when it was last decided, ms: held
    /// ([`SimConfig::hold_tokens`]) and decided again. Not part of what the decision's
    /// terms priced, so the start fit's residual leaves it out.
    held_ms: f64,
    /// The target's own TTFT estimate carried by its refusal, ms.
    refusal_estimate_ms: Option<f64>,
    /// What the serving engine's index predicted cached when it was dispatched there:
    /// what the engine's own count corrects.
    dispatch_cached_tokens: u64,
    /// When its first byte reaches the client, ms: one stream's bytes arrive in order,
    /// so its last byte ([`Ev::Complete`]) arrives no earlier, whatever the jitter.
    first_byte_at_client_ms: f64,
    /// When its first byte leaves its home node for the client, ms: where the live node
    /// measures the TTFT its tuner takes (from `arrived_ms`; a node cannot see its
    /// client's delay).
    first_byte_at_node_ms: f64,
    /// When its last byte leaves its home node, ms: the end of the E2E its tuner takes.
    last_byte_at_node_ms: f64,
    /// The cached tokens the client's node believed its chosen candidate holds.
    predicted_cached_tokens: Option<u64>,
    /// The client's node's terms for its chosen candidate and the weights it priced
    /// them with: the tuner's start-fit evidence once the TTFT is known.
    chosen_terms: Option<(CostTerms, Weights)>,
    /// The longest prefix of the prompt any engine of the cluster held when the
    /// client's node decided (the truth, which no node has; a diagnostic).
    cached_anywhere_tokens: u64,
}

impl Flight {
    /// The start fit's sample of this request: its decision's terms against its TTFT
    /// less the time it was held before that decision (which the terms did not price,
    /// and which grows with the very queues the queue term prices: left in, it pushed
    /// the fitted `w_queue` up, and the node holds nothing).
    fn term_sample(&self) -> Option<TermSample> {
        let (terms, w) = self.chosen_terms?;
        TermSample::new(&terms, w, self.node_ttft_ms() - self.held_ms)
    }

    /// Its TTFT as its home node measures it: from its arrival there to its first byte
    /// leaving it (the client's delay both ways left out, as the live node's tuner
    /// cannot see it).
    fn node_ttft_ms(&self) -> f64 {
        self.first_byte_at_node_ms - self.arrived_ms
    }
}

/// One forward of a request, as the node that made it keeps it. Live, a forward's
/// response relays back through the node that sent it (its `forward` reads the peer's
/// stream and passes it on), which learns its forward bias for that peer from the
/// first byte (`learn_forward_bias`) and keys its forward ledger by that peer; a
/// refusal goes back to it, and it serves the request itself (`route_and_serve`).
#[derive(Debug, Clone, Copy)]
struct Hop {
    /// The region whose node forwarded it.
    from: u8,
    /// The region it was forwarded to.
    to: u8,
    /// The engine of `to` that `from` priced: its forward-ledger key for this forward
    /// (the oracle: the engine it is sent to).
    replica: u16,
    /// The prefill tokens `from` expected there (its ledger entry; the oracle's
    /// in-transit figure).
    uncached_tokens: u64,
    /// When `from` decided it, ms.
    decided_ms: f64,
    /// `from`'s TTFT estimate for `to` before its forward bias, ms (what that bias
    /// learns against; cost-based policies only).
    unbiased_predicted_ttft_ms: Option<f64>,
    /// The engine of `from` its decision priced cheapest
    /// (`gorgo_core::decision::best_local`): where a refused forward is served, as the
    /// node serves it.
    local_engine: Option<usize>,
    /// `from`'s terms for serving it itself (its best local engine's,
    /// `Decision::best_local_terms`), from the same decision: what a refusal brings it
    /// back to ([`Sim::refused`]: the prediction and the start fit's evidence then).
    local_terms: Option<CostTerms>,
    /// The prompt tokens `from` believed that engine holds: the client's node's
    /// predicted cached tokens once a refusal brings it back.
    local_cached_tokens: Option<u64>,
    /// What `from` said serving it itself would cost, sent with the forward
    /// (`SimConfig::refuse_forwards`, [`refuse_forward`]).
    offer: Option<ForwardOffer>,
    /// `from`'s decision to forward it in `decisions.jsonl`, when kept: a refusal
    /// marks it, as the live node marks its `/admin/decisions` record.
    decision: Option<usize>,
    /// When the first byte reaches `from` ([`Ev::FirstByte`]), ms.
    first_byte_due_ms: Option<f64>,
}

enum Payload {
    /// A message of the core's gossip state machine, as the wire carries it.
    Gossip(GossipMessage),
    Proposal(Proposal),
    Report(EpochReport),
}

struct Message {
    from: u8,
    to: u8,
    payload: Payload,
}

/// One region's router node (distributed mode).
struct Node {
    id: NodeId,
    policy: Box<dyn Policy>,
    /// Per replica: what the node knows of that engine of its region.
    engines: Vec<NodeEngine>,
    /// Per region, per replica: that peer engine's summary and stats as heard (the
    /// core's receiver state; the own region's entries stay empty).
    peers: Vec<Vec<PeerGossip>>,
    /// Per region: which run of that node all of its engines' state is of (one run
    /// per node here: nodes never restart).
    peer_runs: Vec<PeerRun>,
    /// Per region, per replica: when that peer engine's stats last arrived, ms (as the
    /// live cluster stamps them; the ledger clears forwards by it).
    stats_at_ms: Vec<Vec<f64>>,
    ledger: ForwardLedger,
    /// Draws the loss of this node's outgoing gossip (`gossip_loss`).
    gossip_loss_rng: ChaCha8Rng,
    tuner: Option<Tuner>,
    /// The rate of the summaries the shadows publish (`SimConfig::summary_sample`).
    summary_sample: SampleChooser,
    /// The requests it holds back from its engines (`SimConfig::hold_tokens`).
    hold: Option<HoldQueue>,
    /// A [`Ev::HoldTick`] is scheduled.
    hold_tick_pending: bool,
    /// It is deciding its held requests again ([`HoldQueue::drain`]).
    in_hold_pass: bool,
}

/// How often a node with held requests looks at them, ms: well inside a prefill batch,
/// so that an engine with room gets its next request before it runs dry.
const HOLD_TICK_MS: f64 = 50.0;

/// Most requests a node holds at once ([`gorgo_core::hold::HoldConfig::max_held`]).
const MAX_HELD: usize = 1 << 16;

/// What a node knows and sends about one of its engines.
struct NodeEngine {
    shadow: ShadowIndex,
    /// The node's view of the engine (the live node's accounting and prefill fit).
    view: EngineView,
    stats_version: u64,
    /// What this engine's stream sends each peer next (the core's sender state).
    gossip: GossipSender,
    /// Follows the engine's KV events into `shadow` (`SimConfig::kv_events`).
    kv: Option<KvEventFollower>,
}

impl NodeEngine {
    /// Whether the node models the engine's cache itself (dispatches insert, counts
    /// correct), as the live node's shadow index does unless the engine's KV events
    /// rule it.
    fn models_cache(&self) -> bool {
        self.kv
            .as_ref()
            .is_none_or(|kv| kv.source() == IndexSource::Shadow)
    }
}

/// The state every engine has whatever the mode.
struct Replica {
    engine: Engine,
    /// Raw prompt tokens dispatched here and not finished (`gorgo-paper`'s signal).
    queued_prompt_tokens: u64,
    /// Next wakeup scheduled for the engine.
    wake_at: Option<f64>,
    /// KV-event batches on their way to the node, with their arrival times (one
    /// delay for all: first in, first out).
    kv_in_transit: std::collections::VecDeque<(f64, Vec<AlignedBlockEvent>)>,
}

/// The central router of `oracle` mode: exact state of every engine, instantly.
struct Oracle {
    policy: Box<dyn Policy>,
    /// Per engine: its prefix cache as the oracle tracks it (inserted on dispatch,
    /// corrected with the engine's own cached-token count at first token, by the same
    /// rule as the nodes': a count only removes).
    index: Vec<ShadowIndex>,
    /// Per engine: requests on their way there, and their expected prefill tokens.
    in_transit: Vec<(u32, u64)>,
    /// With [`SimConfig::causal_oracle`]: every forward in transit, to count at each
    /// deciding region only those it could know of.
    forwards: Vec<OracleForward>,
}

/// The forwards in transit to `engine` that region `at` can know of at `now`: its own
/// at once, another region's once news of it could have come (the one-way delay from
/// where it was decided). Their count and expected prefill tokens.
fn known_in_transit(
    forwards: &[OracleForward],
    engine: usize,
    at: usize,
    now: f64,
    one_way_ms: &[Vec<f64>],
) -> (u32, u64) {
    forwards
        .iter()
        .filter(|f| {
            f.engine == engine && (f.from == at || now >= f.decided_ms + one_way_ms[f.from][at])
        })
        .fold((0, 0), |(n, t), f| (n + 1, t + f.uncached))
}

/// A forward in transit, as the causal oracle sees it.
struct OracleForward {
    slot: u32,
    /// Where it was decided, and when (virtual ms).
    from: usize,
    decided_ms: f64,
    /// The engine it goes to, and its expected prefill tokens there.
    engine: usize,
    uncached: u64,
}

struct Sim<'a> {
    cfg: &'a SimConfig,
    kind: PolicyKind,
    names: Vec<String>,
    node_ids: Vec<NodeId>,
    /// Every engine, region-major ([`Sim::engine_index`]).
    engines: Vec<Replica>,
    nodes: Vec<Node>,
    oracle: Option<Oracle>,
    heap: BinaryHeap<Scheduled>,
    seq: u64,
    flights: Vec<Option<Flight>>,
    free: Vec<u32>,
    live: usize,
    messages: Vec<Option<Message>>,
    free_messages: Vec<u32>,
    rng: ChaCha8Rng,
    out: Collector,
    engine_events: Vec<EngineEvent>,
    trace_done: bool,
    now: f64,
    /// When the cluster's caches are next sampled for copies ([`KV_SAMPLE_MS`]).
    next_kv_sample_ms: f64,
    /// Virtual time the trace starts at ([`warm_up_ms`]): the nodes gossip and scrape
    /// from 0, so that the first requests find every peer known, as live.
    warm_ms: f64,
    /// When the next trace row not yet admitted is sent, if any: ticks and scrapes
    /// skip a long idle gap up to its warm-up.
    next_send_ms: Option<f64>,
}

/// Ticks of gossip a simulated cluster runs before its trace starts.
const WARM_UP_TICKS: f64 = 4.0;

/// An idle stretch (nothing in flight) longer than this before the next row is
/// skipped by ticks and scrapes, up to that row's warm-up ([`Sim::next_periodic`]).
const IDLE_SKIP_MS: f64 = 60_000.0;

/// How long before its trace a simulated cluster starts: a few gossip ticks and two
/// scrapes, plus twice the longest one-way delay (a stats message and a snapshot
/// request's answer on the way). Live, `gorgo up` starts a replay only once every
/// node lists every other alive with stats; a cluster starting cold at the first row
/// served the first burst locally under every policy, and (in short windows) every
/// later decision saw a different view than live.
fn warm_up_ms(cfg: &SimConfig) -> f64 {
    let longest = cfg
        .network
        .one_way_ms
        .iter()
        .flatten()
        .fold(0.0f64, |m, &d| m.max(d));
    (WARM_UP_TICKS * cfg.gossip_interval_ms).max(2.0 * cfg.metrics_interval_ms)
        + 2.0 * (longest + cfg.network.jitter_ms + cfg.gossip_extra_delay_ms)
}

/// Run `policy` over `trace` and collect its results. `progress` is called every few
/// thousand finished requests and at the end.
pub fn simulate<I>(
    cfg: &SimConfig,
    policy: PolicyKind,
    trace: I,
    progress: &mut dyn FnMut(Progress),
) -> Result<PolicyRun>
where
    I: IntoIterator<Item = std::result::Result<TraceRequest, WorkloadError>>,
{
    cfg.validate()?;
    let mut sim = Sim::new(cfg, policy)?;
    sim.run(trace.into_iter(), progress)?;
    Ok(sim.finish())
}

impl<'a> Sim<'a> {
    fn new(cfg: &'a SimConfig, kind: PolicyKind) -> Result<Self> {
        let names = cfg.network.names();
        let n = names.len();
        let node_ids: Vec<NodeId> = names.iter().map(|s| NodeId(s.clone())).collect();
        let rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ hash_bytes(kind.as_str().as_bytes()));
        let replicas = cfg.replicas;
        let engine_profiles: Vec<&Profile> = cfg
            .profiles
            .iter()
            .flat_map(|p| std::iter::repeat_n(p, replicas))
            .collect();
        let engines = engine_profiles
            .iter()
            .map(|p| {
                let mut engine = Engine::new((*p).clone());
                engine.set_emit_decode_steps(false);
                engine.set_record_cache_changes(cfg.kv_events && kind != PolicyKind::Oracle);
                Replica {
                    engine,
                    queued_prompt_tokens: 0,
                    wake_at: None,
                    kv_in_transit: Default::default(),
                }
            })
            .collect();
        let mut out = Collector::new(
            kind.as_str(),
            names.clone(),
            engine_profiles.len(),
            cfg.max_rows,
        );
        for (e, p) in engine_profiles.iter().enumerate() {
            out.run.counters.capacity_tokens[e] = p.max_total_tokens;
        }
        let mut sim = Sim {
            cfg,
            kind,
            names,
            node_ids: node_ids.clone(),
            engines,
            nodes: Vec::new(),
            oracle: None,
            heap: BinaryHeap::new(),
            seq: 0,
            flights: Vec::new(),
            free: Vec::new(),
            live: 0,
            messages: Vec::new(),
            free_messages: Vec::new(),
            rng: ChaCha8Rng::seed_from_u64(0),
            out,
            engine_events: Vec::new(),
            trace_done: false,
            now: 0.0,
            next_kv_sample_ms: warm_up_ms(cfg),
            warm_ms: warm_up_ms(cfg),
            next_send_ms: None,
        };
        if kind == PolicyKind::Oracle {
            sim.oracle = Some(Oracle {
                policy: kind.build(),
                index: engine_profiles
                    .iter()
                    .map(|p| ShadowIndex::new(p.max_total_tokens))
                    .collect(),
                in_transit: vec![(0, 0); engine_profiles.len()],
                forwards: Vec::new(),
            });
        } else {
            let tune = cfg.tunes(kind);
            for (i, p) in cfg.profiles.iter().enumerate() {
                let tuner = if tune {
                    let tc = cfg.tuning_config(kind, cfg.seed.wrapping_add(i as u64))?;
                    let mut t = Tuner::new(node_ids[i].clone(), tc)?;
                    t.set_membership(node_ids.iter().cloned());
                    Some(t)
                } else {
                    None
                };
                let summary_sample = SampleChooser::new(cfg.summary_sample, cfg.peer_count());
                let hold = if cfg.hold_tokens > 0 {
                    let redecide = cfg.gossip_interval_ms.max(1.0) as u64;
                    Some(HoldQueue::new(HoldConfig::new(
                        cfg.hold_tokens,
                        redecide,
                        MAX_HELD,
                    )?))
                } else {
                    None
                };
                let node_engines = (0..replicas)
                    .map(|k| {
                        let mut view = EngineView::new(ViewConfig {
                            kv_capacity_tokens: None,
                            decode_step_ms: cfg.decode_step_ms,
                            seed_base_ms: p.idle_ttft_ms(0),
                            seed_t_p_ms: p.t_p_ms_per_token,
                            fit: FitConfig::default(),
                            replica: k as u16,
                            max_running_requests: None,
                        })?;
                        // What a node reads from its engine's server info at start.
                        if !cfg.unreported_max_running {
                            view.engine_reports_max_running(Some(p.max_running_requests));
                        }
                        Ok(NodeEngine {
                            shadow: ShadowIndex::with_sample(
                                p.max_total_tokens,
                                summary_sample.current(),
                            ),
                            view,
                            stats_version: 0,
                            gossip: GossipSender::new(node_ids[i].clone(), GossipConfig::default()),
                            kv: cfg
                                .kv_events
                                .then(|| KvEventFollower::new(KvFollowerConfig::new(1), 0))
                                .transpose()?,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                sim.nodes.push(Node {
                    id: node_ids[i].clone(),
                    policy: kind.build(),
                    engines: node_engines,
                    peers: vec![vec![PeerGossip::new(); replicas]; n],
                    peer_runs: vec![PeerRun::new(); n],
                    stats_at_ms: vec![vec![0.0; replicas]; n],
                    ledger: ForwardLedger::new(),
                    gossip_loss_rng: ChaCha8Rng::seed_from_u64(
                        cfg.seed ^ hash_bytes(format!("gossip-loss/{i}").as_bytes()),
                    ),
                    tuner,
                    summary_sample,
                    hold,
                    hold_tick_pending: false,
                    in_hold_pass: false,
                });
            }
            // Nodes do not tick in lockstep, nor scrape their engines together: each
            // starts at its own phase. The phases are the seed's, not the policy's, so
            // that every policy of a comparison meets the same staleness at each
            // arrival (paired, as live runs of one cluster are); drawn per policy, a
            // trace on a grid (Mooncake's bursts 3 s apart, 12 gossip intervals)
            // fixed a different staleness at every burst for each policy.
            let mut phases = ChaCha8Rng::seed_from_u64(cfg.seed ^ hash_bytes(b"phases"));
            for i in 0..n {
                let phase = phases.random::<f64>() * cfg.gossip_interval_ms;
                sim.push(phase, Ev::Tick(i as u8));
                for k in 0..replicas {
                    let phase = phases.random::<f64>() * cfg.metrics_interval_ms;
                    let e = sim.engine_index(i, k);
                    sim.push(phase, Ev::Scrape(e as u16));
                }
            }
        }
        sim.rng = rng;
        Ok(sim)
    }

    /// Region `r`'s engine `k` among all engines.
    fn engine_index(&self, r: usize, k: usize) -> usize {
        r * self.cfg.replicas + k
    }

    /// The region and replica of engine `e`.
    fn engine_of(&self, e: usize) -> (usize, usize) {
        (e / self.cfg.replicas, e % self.cfg.replicas)
    }

    fn push(&mut self, at: f64, ev: Ev) {
        self.seq += 1;
        self.heap.push(Scheduled {
            at,
            seq: self.seq,
            ev,
        });
    }

    fn jitter(&mut self, j: f64) -> f64 {
        if j > 0.0 {
            (self.rng.random::<f64>() * 2.0 - 1.0) * j
        } else {
            0.0
        }
    }

    /// One-way delay from region `a` to region `b` for one message, ms.
    fn link_delay(&mut self, a: usize, b: usize) -> f64 {
        if a == b {
            return 0.0;
        }
        let d = self.cfg.network.one_way_ms[a][b];
        let j = self.cfg.network.jitter_ms;
        (d + self.jitter(j)).max(0.0)
    }

    /// Delay between a client of region `r` and its node, ms.
    fn client_delay(&mut self, r: usize) -> f64 {
        let reg = &self.cfg.network.regions[r];
        let (d, j) = (reg.client_delay_ms, reg.client_jitter_ms);
        (d + self.jitter(j)).max(0.0)
    }

    fn run(
        &mut self,
        mut trace: impl Iterator<Item = std::result::Result<TraceRequest, WorkloadError>>,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<()> {
        let mut origin: Option<u64> = None;
        let mut index: u64 = 0;
        let mut next: Option<(f64, TraceRequest)> = None;
        let mut reported = 0u64;
        // Events handled since virtual time last advanced.
        let mut at_this_instant = 0u64;
        loop {
            // Read the trace up to the next event's time, so rows never sit in memory
            // ahead of when they matter.
            loop {
                if next.is_none() && !self.trace_done {
                    let limit_hit = self.cfg.max_requests.is_some_and(|m| index >= m);
                    match if limit_hit { None } else { trace.next() } {
                        None => self.trace_done = true,
                        Some(row) => {
                            let row = row?;
                            let o = *origin.get_or_insert(row.timestamp_ms);
                            let send = self.warm_ms
                                + row.timestamp_ms.saturating_sub(o) as f64 * self.cfg.time_scale;
                            if send > MAX_VIRTUAL_MS {
                                return Err(SimError::VirtualTime(format!(
                                    "of trace row {} would be {send:.3e} ms, past the \
                                     {MAX_VIRTUAL_MS:e} ms a run may reach: the trace is too \
                                     long for time_scale {}",
                                    index + 1,
                                    self.cfg.time_scale
                                )));
                            }
                            next = Some((send, row));
                        }
                    }
                }
                self.next_send_ms = next.as_ref().map(|(send, _)| *send);
                let Some((send, _)) = &next else { break };
                if self.heap.peek().is_some_and(|top| top.at < *send) {
                    break;
                }
                let (send, row) = next.take().expect("checked above");
                self.admit(index, send, row);
                index += 1;
            }
            let Some(Scheduled { at, ev, .. }) = self.heap.pop() else {
                break;
            };
            if at > self.now {
                at_this_instant = 0;
            } else {
                at_this_instant += 1;
            }
            if at > MAX_VIRTUAL_MS || at_this_instant > MAX_EVENTS_AT_ONE_INSTANT {
                let what = if at > MAX_VIRTUAL_MS {
                    format!("reached {at:.3e} ms, past the {MAX_VIRTUAL_MS:e} ms a run may reach")
                } else {
                    format!("stopped advancing at {at:.3e} ms ({at_this_instant} events at that instant)")
                };
                return Err(SimError::VirtualTime(format!(
                    "{what}: the engine profile's costs, or the delays, are too large"
                )));
            }
            self.now = at;
            self.out.run.counters.events += 1;
            match ev {
                Ev::Arrival(slot) => self.route(slot, at),
                Ev::ForwardArrival(slot) => self.forward_arrival(slot, at),
                Ev::EngineWake(e) => self.engine_wake(e as usize, at),
                Ev::Tick(r) => self.tick(r as usize, at),
                Ev::Scrape(e) => self.scrape(e as usize, at),
                Ev::FirstByte(slot, hop) => self.first_byte(slot, hop as usize, at),
                Ev::Refused(slot) => self.refused(slot, at),
                Ev::Deliver(m) => self.deliver(m, at),
                Ev::Complete(slot) => self.complete(slot, at),
                Ev::KvEvents(e) => self.kv_events(e as usize, at),
                Ev::HoldTick(r) => self.hold_pass(r as usize, at),
            }
            let finished = self.out.run.counters.completed + self.out.run.counters.failed;
            if finished >= reported + 4096 {
                reported = finished;
                progress(self.progress());
            }
        }
        self.out.run.counters.end_ms = self.now - self.warm_ms;
        progress(self.progress());
        Ok(())
    }

    fn progress(&self) -> Progress {
        let c = &self.out.run.counters;
        Progress {
            requests: c.requests,
            finished: c.completed + c.failed,
            in_flight: self.live,
            now_ms: self.now - self.warm_ms,
        }
    }

    /// A trace row is sent by its client at `send` ms.
    fn admit(&mut self, index: u64, send: f64, row: TraceRequest) {
        self.out.run.counters.requests += 1;
        let send = if send < self.now {
            self.out.run.counters.reordered_rows += 1;
            self.now
        } else {
            send
        };
        let home = gorgo_workload::home_region(&row, index, &self.names, self.cfg.region_seed);
        let mut row = row;
        let (chain, prompt_tokens) = prompt(self.cfg, &mut row);
        let draw = gorgo_core::hash::hash_bytes(
            &[index.to_le_bytes(), self.cfg.seed.to_le_bytes()].concat(),
        );
        let streamed = (draw as f64 / u64::MAX as f64) >= self.cfg.non_streamed_share;
        let flight = Flight {
            index,
            chain,
            session_key: gorgo_workload::session_key(&row),
            prompt_tokens,
            output_tokens: row.output_tokens.max(1),
            home: home as u8,
            served: None,
            replica: 0,
            hops: 0,
            path: Vec::new(),
            send_ms: send,
            arrived_ms: send,
            dispatched_ms: send,
            epoch: EpochKey::default(),
            cell: 0,
            open: None,
            ttft_ms: f64::NAN,
            cached_tokens: 0,
            predicted_ttft_ms: None,
            held_ms: 0.0,
            refusal_estimate_ms: None,
            dispatch_cached_tokens: 0,
            chosen_terms: None,
            first_byte_at_client_ms: f64::NEG_INFINITY,
            first_byte_at_node_ms: f64::NAN,
            last_byte_at_node_ms: f64::NAN,
            predicted_cached_tokens: None,
            cached_anywhere_tokens: 0,
            first_token_seen: false,
            streamed,
        };
        let slot = match self.free.pop() {
            Some(s) => {
                self.flights[s as usize] = Some(flight);
                s
            }
            None => {
                self.flights.push(Some(flight));
                (self.flights.len() - 1) as u32
            }
        };
        self.live += 1;
        let c = &mut self.out.run.counters;
        c.max_in_flight = c.max_in_flight.max(self.live);
        let at = send + self.client_delay(home);
        self.flight_mut(slot).arrived_ms = at;
        self.push(at, Ev::Arrival(slot));
    }

    fn flight(&self, slot: u32) -> &Flight {
        self.flights[slot as usize]
            .as_ref()
            .expect("events only name live flights")
    }

    fn flight_mut(&mut self, slot: u32) -> &mut Flight {
        self.flights[slot as usize]
            .as_mut()
            .expect("events only name live flights")
    }

    /// Engine `e`'s node scrapes its `/metrics` (the simulated scrape,
    /// [`gorgo_engine::EngineStats::scrape`]) into its view of it.
    fn scrape(&mut self, e: usize, now: f64) {
        let (r, k) = self.engine_of(e);
        let metrics = self.engines[e].engine.stats().scrape();
        if let Some(node) = self.nodes.get_mut(r) {
            // Taken and back at once: the simulated scrape has no flight.
            let view = &mut node.engines[k].view;
            view.scrape(metrics, view.scrape_started(), now as u64);
        }
        if let Some(at) = self.next_periodic(now, self.cfg.metrics_interval_ms) {
            self.push(at, Ev::Scrape(e as u16));
        }
    }

    /// Engine `e`'s queue stats as its node reports them: its view of the engine, or,
    /// with `exact_state` and for the oracle, the engine's exact state.
    fn local_stats(&mut self, e: usize) -> QueueStats {
        let (r, k) = self.engine_of(e);
        let epoch = self
            .nodes
            .get(r)
            .and_then(|n| n.tuner.as_ref())
            .map_or(0, |t| t.epoch());
        let held = self.held_share(r, k);
        if !self.cfg.exact_state {
            if let Some(n) = self.nodes.get_mut(r) {
                let mut stats = n.engines[k].view.queue_stats(epoch, self.now as u64);
                stats.unfinished_prefill_tokens += held;
                return stats;
            }
        }
        let s = self.engines[e].engine.stats();
        let (t_p_ms, base_ms, version, slots) = match self.nodes.get(r) {
            Some(n) => {
                let v = &n.engines[k].view;
                (
                    v.fit().t_p_ms(),
                    v.fit().base_ms(),
                    n.engines[k].stats_version,
                    v.slots(),
                )
            }
            None => {
                let p = &self.cfg.profiles[r];
                (p.t_p_ms_per_token, p.idle_ttft_ms(0), 0, None)
            }
        };
        QueueStats {
            version,
            replica: k as u16,
            unfinished_prefill_tokens: s.unfinished_prefill_tokens + held,
            running: s.running.min(u32::MAX as usize) as u32,
            waiting: s.waiting.min(u32::MAX as usize) as u32,
            kv_used_tokens: s.used_tokens,
            kv_capacity_tokens: s.capacity,
            queued_prompt_tokens: self.engines[e].queued_prompt_tokens,
            t_p_ms,
            base_ms,
            decode_step_ms: s.decode_step_ms,
            epoch,
            // Simulated nodes neither restart nor drain, and serve the one model.
            incarnation: 0,
            draining: false,
            models: Vec::new(),
            slots,
        }
    }

    /// Engine `k` of region `r`'s share of the prefill its node holds back: held work
    /// goes to whichever engine has room first, so each counts an equal part of it.
    fn held_share(&self, r: usize, k: usize) -> u64 {
        let Some(q) = self.nodes.get(r).and_then(|n| n.hold.as_ref()) else {
            return 0;
        };
        let n = self.cfg.replicas.max(1) as u64;
        q.tokens() / n + u64::from((k as u64) < q.tokens() % n)
    }

    /// Candidates as node `at_node` sees them (the core's [`build_candidates`], as the
    /// live node builds them: its own engines, then every engine of every peer), or as
    /// the oracle sees them from `at_node` (exact state of every engine). Returns
    /// candidates and their engine indices.
    fn candidates(
        &mut self,
        at_node: usize,
        chain: &HashChain,
        via: &[u8],
        now: f64,
    ) -> (Vec<Candidate>, Vec<usize>) {
        let n = self.names.len();
        let replicas = self.cfg.replicas;
        if self.oracle.is_some() {
            let mut cands = Vec::with_capacity(self.engines.len());
            for e in 0..self.engines.len() {
                let r = self.engine_of(e).0;
                let mut c = Candidate::idle(
                    self.node_ids[r].clone(),
                    r == at_node,
                    self.cfg.network.rtt_ms(at_node, r),
                );
                c.stats = self.local_stats(e);
                let o = self.oracle.as_ref().expect("checked above");
                c.cached_tokens = o.index[e].longest_match(chain);
                let (count, tokens) = if self.cfg.causal_oracle {
                    known_in_transit(&o.forwards, e, at_node, now, &self.cfg.network.one_way_ms)
                } else {
                    o.in_transit[e]
                };
                c.inflight_forwards = count;
                c.inflight_forward_prompt_tokens = tokens;
                cands.push(c);
            }
            return (cands, (0..self.engines.len()).collect());
        }
        let locals: Vec<LocalState> = (0..replicas)
            .map(|k| LocalState {
                node: self.nodes[at_node].id.clone(),
                healthy: true,
                cached_tokens: self.nodes[at_node].engines[k].shadow.longest_match(chain),
                stats: self.local_stats(self.engine_index(at_node, k)),
            })
            .collect();
        let rtts: Vec<f64> = (0..n)
            .map(|p| self.cfg.network.rtt_ms(at_node, p))
            .collect();
        let node_ids = &self.node_ids;
        let node = &mut self.nodes[at_node];
        let gossip_peers = &node.peers;
        let stats_at = &node.stats_at_ms;
        let peers = (0..n)
            .filter(|&p| p != at_node)
            .flat_map(|p| (0..replicas).map(move |k| (p, k)))
            .map(|(p, k)| PeerState {
                node: &node_ids[p],
                alive: true,
                // As the node's `Excluded`: a forward never goes back.
                eligible: !via.contains(&(p as u8)),
                rtt_ms: rtts[p],
                stats: gossip_peers[p][k].stats(),
                stats_age_ms: (now - stats_at[p][k]).max(0.0) as u64,
            });
        let cands = build_candidates(
            locals,
            peers,
            |peer, replica| {
                node_ids.iter().position(|id| id == peer).map_or(0, |p| {
                    gossip_peers[p]
                        .get(replica as usize)
                        .and_then(|g| g.summary())
                        .map_or(0, |s| s.matched_tokens(chain))
                })
            },
            || &mut node.ledger,
            now as u64,
        );
        let engines = cands
            .iter()
            .map(|c| {
                let r = node_ids
                    .iter()
                    .position(|id| *id == c.node)
                    .expect("candidates are cluster nodes");
                r * replicas + c.stats.replica as usize
            })
            .collect();
        (cands, engines)
    }

    /// Count the tokens every engine's cache holds, and those of distinct blocks: what
    /// the cluster spends on copies of the same prefix (a diagnostic: the floor's
    /// eviction term is what copies crowd out).
    fn sample_kv(&mut self) {
        let mut unique: std::collections::HashMap<u64, u32> = Default::default();
        let mut cached = 0u64;
        for e in &self.engines {
            for (h, t) in e.engine.cached_blocks() {
                cached += u64::from(t);
                unique.insert(h, t);
            }
        }
        let c = &mut self.out.run.counters;
        c.kv_cached_tokens_sampled += cached;
        c.kv_unique_tokens_sampled += unique.values().map(|&t| u64::from(t)).sum::<u64>();
    }

    /// Decide where a request that is at node `r` is served, and send it there.
    fn route(&mut self, slot: u32, now: f64) {
        let r = self.flight(slot).home as usize;
        // As the live node's `check_context`, before any decision: a prompt longer than
        // the node's engines take is refused at its door (400), never routed.
        let prompt_tokens = self.flight(slot).prompt_tokens;
        let context = self.cfg.profiles[r].context_length;
        if prompt_tokens > context {
            let msg = format!("context length is {context} tokens; the prompt has {prompt_tokens}");
            self.fail(slot, now, &msg);
            return;
        }
        self.route_at(slot, r, now);
    }

    /// Hold a request decided for engine `k` of node `r` instead of dispatching it, if
    /// the node holds requests and that engine is busy or others wait already
    /// ([`HoldQueue::should_hold`]). True when held.
    fn hold(&mut self, slot: u32, r: usize, k: usize, uncached_tokens: u64, now: f64) -> bool {
        if self.oracle.is_some() {
            return false;
        }
        let send_ms = self.flight(slot).send_ms as u64;
        let node = &mut self.nodes[r];
        let unfinished = node.engines[k]
            .view
            .counters_at(now as u64)
            .unfinished_prefill_tokens;
        let in_pass = node.in_hold_pass;
        let Some(q) = node.hold.as_mut() else {
            return false;
        };
        if !q.should_hold(unfinished, in_pass) {
            return false;
        }
        q.hold(Held {
            id: slot as u64,
            send_ms,
            uncached_tokens,
            decided_ms: now as u64,
        });
        if !node.hold_tick_pending {
            node.hold_tick_pending = true;
            self.push(now + HOLD_TICK_MS, Ev::HoldTick(r as u8));
        }
        self.out.run.counters.holds += 1;
        true
    }

    /// Node `r` looks at the requests it holds, oldest first: each one due
    /// ([`HoldQueue::is_due`]) is decided again, with the older ones still held
    /// counted ahead of it; the others keep their place.
    fn hold_pass(&mut self, r: usize, now: f64) {
        let Some(list) = self.nodes[r].hold.as_mut().map(HoldQueue::drain) else {
            return;
        };
        self.nodes[r].hold_tick_pending = false;
        self.nodes[r].in_hold_pass = true;
        for h in list {
            let node = &mut self.nodes[r];
            let q = node.hold.as_ref().expect("checked above");
            let free = node
                .engines
                .iter_mut()
                .any(|e| !q.engine_busy(e.view.counters_at(now as u64).unfinished_prefill_tokens));
            if q.is_due(&h, now as u64, free) {
                self.route_at(h.id as u32, r, now);
            } else if let Some(q) = self.nodes[r].hold.as_mut() {
                q.hold(h);
            }
        }
        let node = &mut self.nodes[r];
        node.in_hold_pass = false;
        if node.hold.as_ref().is_some_and(|q| !q.is_empty()) && !node.hold_tick_pending {
            node.hold_tick_pending = true;
            self.push(now + HOLD_TICK_MS, Ev::HoldTick(r as u8));
        }
    }

    fn route_at(&mut self, slot: u32, r: usize, now: f64) {
        let f = self.flight(slot);
        let hops = f.hops;
        let prompt_tokens = f.prompt_tokens;
        let session = f.session_key;
        // Take the chain out while deciding (borrows), then put it back.
        let chain = std::mem::take(&mut self.flight_mut(slot).chain);
        let via = self.leaving_out(slot);
        let (cands, cand_engines) = self.candidates(r, &chain, &via, now);
        // A client request is routed on its arm of the trial (a hash of its index
        // picks it, as a node hashes its request id); a forwarded one with the
        // receiving node's incumbent, as a node does.
        let f = self.flight(slot);
        let key = hash_bytes(&f.index.to_le_bytes());
        let admission = match (&self.oracle, self.nodes.get(r)) {
            (None, Some(n)) => n.tuner.as_ref().map(|t| {
                if hops == 0 {
                    t.admit(key, now as u64)
                } else {
                    Assignment {
                        epoch: EpochKey::default(),
                        cell: 0,
                        weights: t.weights(),
                    }
                }
            }),
            _ => None,
        };
        let weights = admission
            .as_ref()
            .map_or(self.default_weights(), |a| a.weights);
        let (epoch, cell) = admission.map_or((EpochKey::default(), 0), |a| (a.epoch, a.cell));
        let rng = self.rng.next_u64();
        let req = RouteRequest {
            chain: &chain,
            prompt_tokens,
            session_key: session,
        };
        let max_hops = self.cfg.max_hops;
        let outcome = match self.oracle.as_mut() {
            Some(o) => decide(
                &req,
                hops,
                max_hops,
                &cands,
                o.policy.as_mut(),
                weights,
                rng,
            ),
            None => decide(
                &req,
                hops,
                max_hops,
                &cands,
                self.nodes[r].policy.as_mut(),
                weights,
                rng,
            ),
        };
        // The client's node's prediction for its choice (a forward keeps the first).
        let chosen_terms = outcome
            .as_ref()
            .ok()
            .and_then(|d| d.candidates.iter().find(|c| c.chosen))
            .and_then(|c| c.terms);
        let predicted = chosen_terms.and_then(|t| t.estimated_ttft_ms);
        let local_terms = outcome.as_ref().ok().and_then(|d| d.best_local_terms());
        let local = outcome
            .as_ref()
            .ok()
            .and_then(|d| best_local(&d.candidates).map(|i| (i, d.candidates[i].cached_tokens)));
        let local_engine = local.map(|(i, _)| cand_engines[i]);
        // Sent with any forward, as the live node sends it: the target checks it at
        // max hops ([`Sim::refuse`]).
        let offer = outcome
            .as_ref()
            .ok()
            .filter(|_| self.cfg.refuse_forwards && self.oracle.is_none())
            .and_then(|d| d.local_cost_ms())
            .and_then(|c| ForwardOffer::new(c, weights, self.kind));
        let target = outcome
            .as_ref()
            .map(|d| {
                (
                    cand_engines[d.target_index],
                    cands[d.target_index].cached_tokens,
                )
            })
            .map_err(|_| ());
        let logged = (self.out.run.decisions.len() < self.cfg.decision_log).then(|| {
            let index = self.flight(slot).index;
            let mut record =
                DecisionRecord::of_outcome(index, now as u64, prompt_tokens, weights, outcome);
            record.origin = self.origin(slot);
            self.log_decision(r, record)
        });
        if hops == 0 {
            let anywhere = self
                .engines
                .iter()
                .map(|e| e.engine.cached_prefix_tokens(&chain))
                .max()
                .unwrap_or(0)
                .min(prompt_tokens.saturating_sub(1));
            let f = self.flight_mut(slot);
            f.cached_anywhere_tokens = anywhere;
            f.epoch = epoch;
            f.cell = cell;
            // A request decided again after a hold ([`SimConfig::hold_tokens`]) has
            // waited at the node since it arrived.
            let held_ms = (now - f.arrived_ms).max(0.0);
            f.held_ms = held_ms;
            f.predicted_ttft_ms = predicted.map(|v| (v + held_ms) as f32);
            f.predicted_cached_tokens = target.as_ref().ok().map(|&(_, c)| c);
            f.chosen_terms = chosen_terms.map(|t| (t, weights));
        }
        match target {
            Err(_) => {
                self.flight_mut(slot).chain = chain;
                self.fail(slot, now, "no candidate can serve");
            }
            Ok((e, believed_cached)) if self.engine_of(e).0 == r => {
                self.flight_mut(slot).chain = chain;
                if self.hold(
                    slot,
                    r,
                    self.engine_of(e).1,
                    prompt_tokens - believed_cached.min(prompt_tokens),
                    now,
                ) {
                    return;
                }
                self.dispatch(slot, e, now);
            }
            Ok((e, believed_cached)) => {
                let (t, k) = self.engine_of(e);
                let uncached = prompt_tokens.saturating_sub(believed_cached);
                match self.oracle.as_mut() {
                    Some(o) => {
                        o.in_transit[e].0 += 1;
                        o.in_transit[e].1 += uncached;
                        if self.cfg.causal_oracle {
                            o.forwards.push(OracleForward {
                                slot,
                                from: r,
                                decided_ms: now,
                                engine: e,
                                uncached,
                            });
                        }
                    }
                    None => {
                        let peer = self.node_ids[t].clone();
                        self.nodes[r].ledger.record_forward(
                            &peer,
                            k as u16,
                            uncached,
                            prompt_tokens,
                            now as u64,
                        );
                    }
                }
                let f = self.flight_mut(slot);
                f.path.push(Hop {
                    from: r as u8,
                    to: t as u8,
                    replica: k as u16,
                    uncached_tokens: uncached,
                    decided_ms: now,
                    unbiased_predicted_ttft_ms: chosen_terms
                        .and_then(|c| c.unbiased_estimated_ttft_ms()),
                    local_engine,
                    local_terms,
                    local_cached_tokens: local.map(|(_, c)| c),
                    offer,
                    decision: logged,
                    first_byte_due_ms: None,
                });
                f.chain = chain;
                f.hops += 1;
                f.served = Some(t as u8);
                f.replica = k as u16;
                let at = now + self.link_delay(r, t);
                self.push(at, Ev::ForwardArrival(slot));
            }
        }
    }

    fn forward_arrival(&mut self, slot: u32, now: f64) {
        let f = self.flight(slot);
        let t = f.served.expect("set when forwarded") as usize;
        let uncached = f.path.last().map_or(0, |h| h.uncached_tokens);
        let replica = f.replica as usize;
        let e = self.engine_index(t, replica);
        if let Some(o) = self.oracle.as_mut() {
            // The oracle serves on the engine it decided; nothing is in transit any more.
            o.in_transit[e].0 = o.in_transit[e].0.saturating_sub(1);
            o.in_transit[e].1 = o.in_transit[e].1.saturating_sub(uncached);
            o.forwards.retain(|f| f.slot != slot);
            self.dispatch(slot, e, now);
        } else if !self.refuse(slot, t, now) {
            self.route_at(slot, t, now);
        }
    }

    /// The regions a request at `slot` may not go to from where it is now: those it has
    /// left while it may still be forwarded, none at `max_hops` (the peers then stay
    /// candidates, priced for the refusal check and the decision log), as the live
    /// node's `Excluded::leaving_out_path`.
    fn leaving_out(&self, slot: u32) -> Vec<u8> {
        let f = self.flight(slot);
        if f.hops < self.cfg.max_hops {
            f.path.iter().map(|h| h.from).collect()
        } else {
            Vec::new()
        }
    }

    /// As a live node's forward server does before serving a forward at `max_hops`
    /// (one it may not forward again): refuse it when serving it here costs more than
    /// the alternative of the node that forwarded it ([`refuse_forward`]); the refusal
    /// travels back to that node ([`Ev::Refused`]). True when refused.
    fn refuse(&mut self, slot: u32, t: usize, now: f64) -> bool {
        let f = self.flight(slot);
        if f.hops < self.cfg.max_hops {
            return false;
        }
        let Some(offer) = f.path.last().and_then(|h| h.offer) else {
            return false;
        };
        let chain = std::mem::take(&mut self.flight_mut(slot).chain);
        let via = self.leaving_out(slot);
        let (cands, _) = self.candidates(t, &chain, &via, now);
        let f = self.flight(slot);
        let req = RouteRequest {
            chain: &chain,
            prompt_tokens: f.prompt_tokens,
            session_key: f.session_key,
        };
        let refusal = refuse_forward(&req, &cands, self.nodes[t].policy.as_ref(), &offer);
        self.flight_mut(slot).chain = chain;
        let Some((refusal, explained)) = refusal else {
            return false;
        };
        if self.out.run.decisions.len() < self.cfg.decision_log {
            let f = self.flight(slot);
            let mut record = DecisionRecord::of_refusal(
                f.index,
                now as u64,
                self.kind,
                f.hops,
                f.prompt_tokens,
                &offer,
                explained,
            );
            record.origin = self.origin(slot);
            self.log_decision(t, record);
        }
        self.out.run.counters.refused_forwards += 1;
        let f = self.flight_mut(slot);
        // The refusal carries the target's own estimate, which the forwarding node
        // learns its forward bias from when the refusal reaches it ([`Sim::refused`]).
        f.refusal_estimate_ms = refusal.local_estimated_ttft_ms;
        let from = f.path.last().expect("an offer came with a forward").from as usize;
        let back = self.link_delay(t, from);
        self.push(now + back, Ev::Refused(slot));
        true
    }

    /// Keep one decision of node `r` for `decisions.jsonl`; returns its place there.
    fn log_decision(&mut self, r: usize, record: DecisionRecord) -> usize {
        self.out.run.decisions.push(DecisionLine {
            node: self.names[r].clone(),
            record,
        });
        self.out.run.decisions.len() - 1
    }

    /// Where a forwarded request came from, for its decisions' records at the nodes
    /// it was forwarded to (the live node's `DecisionRecord::origin`, from the
    /// forward's origin and request id): its home node and its id there, which is its
    /// trace index at every simulated node. `None` at its home node.
    fn origin(&self, slot: u32) -> Option<ForwardOrigin> {
        let f = self.flight(slot);
        (f.hops > 0).then(|| ForwardOrigin {
            node: self.node_ids[f.home as usize].clone(),
            request_id: f.index,
        })
    }

    /// A refusal reached the node that forwarded the request: it serves the request
    /// itself and reports the hops that took it there (as the live node's
    /// `x-gorgo-hops`: the client's node reports it unforwarded), and its own ledger
    /// drops the forward it recorded for that peer and learns from the refusal.
    fn refused(&mut self, slot: u32, now: f64) {
        let f = self.flight_mut(slot);
        let hop = f.path.pop().expect("only a forward is refused");
        // Served by the node that forwarded it, with the hops that took it there.
        f.hops = f.path.len() as u8;
        if f.path.is_empty() {
            // Served here after all: what the request meets is this node's own engine,
            // after the round trip the refusal took. That is the prediction (its own
            // estimate plus the round trip) and the start fit's evidence (the local
            // terms with the round trip as their RTT, not the peer's terms that proved
            // wrong), as the node does (`CostTerms::served_locally_after`).
            let met = f.chosen_terms.and_then(|(_, w)| {
                let t = hop
                    .local_terms?
                    .served_locally_after(now - hop.decided_ms, w)?;
                Some((t, w))
            });
            if let Some(p) = met.and_then(|(t, _)| t.estimated_ttft_ms) {
                f.predicted_ttft_ms = Some(p as f32);
            }
            f.chosen_terms = met;
            f.predicted_cached_tokens = hop.local_cached_tokens;
        }
        let (from, sent) = (hop.from as usize, hop.decided_ms);
        let (estimate, prompt) = (f.refusal_estimate_ms, f.prompt_tokens);
        // As the live node's `Router::forward_refused`: the record of the decision that
        // chose the peer says the forward did not go as decided.
        if let Some(i) = hop.decision {
            self.out.run.decisions[i].record.forward_outcome = Some("forward-refused".into());
        }
        let peer = self.node_ids[hop.to as usize].clone();
        let ledger = &mut self.nodes[from].ledger;
        ledger.cancel_forward(&peer, hop.replica, hop.uncached_tokens, prompt, sent as u64);
        // As the live node (`Router::forward_refused`): the forward "took" the
        // refusal's round trip plus what the target estimated for serving it.
        if let (Some(pred), Some(est)) = (hop.unbiased_predicted_ttft_ms, estimate) {
            ledger.observe_forward_ttft(&peer, hop.replica, pred, now - sent + est, now as u64);
        }
        // Only a forward with an offer can be refused, and an offer is the best local
        // engine's cost, so the engine is always known.
        let e = hop.local_engine.unwrap_or(self.engine_index(from, 0));
        self.dispatch(slot, e, now);
    }

    /// Submit a request to engine `e`.
    fn dispatch(&mut self, slot: u32, e: usize, now: f64) {
        let nowu = now as u64;
        let (r, k) = self.engine_of(e);
        let f = self.flights[slot as usize].as_mut().expect("live");
        f.served = Some(r as u8);
        f.replica = k as u16;
        f.dispatched_ms = now;
        let req = EngineRequest {
            id: slot as u64,
            chain: f.chain.clone(),
            prompt_tokens: f.prompt_tokens,
            max_output_tokens: f.output_tokens,
            arrival_ms: now,
        };
        let prompt_tokens = f.prompt_tokens;
        // As the live node's `serve_local`: the prefill work it expects is the prompt
        // less the prefix its shadow index believes cached, looked up before inserting;
        // its view records the dispatch before the engine sees it.
        match self.oracle.as_mut() {
            Some(o) => {
                f.dispatch_cached_tokens = o.index[e].longest_match(&f.chain);
            }
            None => {
                let node = &mut self.nodes[r].engines[k];
                let cached = node.shadow.longest_match(&f.chain).min(prompt_tokens);
                f.dispatch_cached_tokens = cached;
                let uncached = prompt_tokens - cached;
                if f.streamed {
                    node.view
                        .dispatch(slot as u64, prompt_tokens, uncached, nowu);
                } else {
                    node.view
                        .dispatch_unobserved(slot as u64, prompt_tokens, uncached, nowu);
                }
            }
        }
        let engine = &mut self.engines[e];
        match engine.engine.submit(req, now) {
            Ok(()) => {
                engine.queued_prompt_tokens += prompt_tokens;
                // The index learns the prompt with the engine's response head (a success
                // head: the engine accepted it), as the live node's does: at once for a
                // stream, with the whole response for a client that does not stream
                // (the engine sends that head with the body, at the end: `finished`).
                // Following the engine's events, the node models nothing. A prompt the
                // engine refused never enters it (it evicted the model's whole cache).
                let f = self.flights[slot as usize].as_ref().expect("live");
                match self.oracle.as_mut() {
                    Some(o) => o.index[e].insert(&f.chain, nowu),
                    None => {
                        let node = &mut self.nodes[r].engines[k];
                        if node.models_cache() && f.streamed {
                            node.shadow.insert(&f.chain, nowu);
                        }
                    }
                }
            }
            Err(reason) => {
                // A failure, as the node's ticket of an error answer: released, no
                // decode time learnt.
                if let Some(node) = self.nodes.get_mut(r) {
                    node.engines[k].view.cancel(slot as u64);
                }
                let msg = format!("engine refused: {reason}");
                self.fail(slot, now, &msg);
            }
        }
        self.drain_engine(e, now);
    }

    fn engine_wake(&mut self, e: usize, now: f64) {
        if self.engines[e].wake_at != Some(now) {
            return; // superseded
        }
        self.engines[e].wake_at = None;
        self.drain_engine(e, now);
    }

    /// Handle what engine `e` did up to `now` and schedule its next wakeup.
    fn drain_engine(&mut self, e: usize, now: f64) {
        let mut events = std::mem::take(&mut self.engine_events);
        self.engines[e].engine.step_into(now, &mut events);
        if self.cfg.kv_events && self.oracle.is_none() {
            let batch: Vec<AlignedBlockEvent> = self.engines[e]
                .engine
                .take_cache_changes()
                .into_iter()
                .map(|c| match c {
                    CacheChange::Stored {
                        hash,
                        parent,
                        tokens,
                        ..
                    } => AlignedBlockEvent::Stored {
                        hash,
                        parent,
                        tokens,
                    },
                    CacheChange::Removed { hash } => AlignedBlockEvent::Removed { hash },
                })
                .collect();
            if !batch.is_empty() {
                let at = now + self.cfg.kv_events_delay_ms;
                self.engines[e].kv_in_transit.push_back((at, batch));
                self.push(at, Ev::KvEvents(e as u16));
            }
        }
        for ev in events.drain(..) {
            match ev {
                EngineEvent::FirstToken {
                    id,
                    at_ms,
                    cached_tokens,
                } => self.first_token(e, id as u32, at_ms, cached_tokens),
                EngineEvent::Finished { id, at_ms, .. } => self.finished(e, id as u32, at_ms),
                // Refusals are handled where `submit` returns them; decode steps are off.
                EngineEvent::Rejected { .. } | EngineEvent::DecodeStep { .. } => {}
            }
        }
        self.engine_events = events;
        let s = self.engines[e].engine.stats();
        let c = &mut self.out.run.counters;
        c.max_used_tokens[e] = c.max_used_tokens[e].max(s.used_tokens);
        c.max_cached_tokens[e] = c.max_cached_tokens[e].max(s.cached_tokens);
        let next = self.engines[e].engine.next_event_time();
        if let Some(t) = next {
            let t = t.max(now);
            if self.engines[e].wake_at != Some(t) {
                self.engines[e].wake_at = Some(t);
                self.push(t, Ev::EngineWake(e as u16));
            }
        }
    }

    /// Engine `e`'s KV-event batches due by `now` reach its node: through the
    /// follower into the node's index of it (as the live node's `kv_events` task does).
    fn kv_events(&mut self, e: usize, now: f64) {
        let (r, k) = self.engine_of(e);
        while self.engines[e]
            .kv_in_transit
            .front()
            .is_some_and(|(at, _)| *at <= now)
        {
            let (_, batch) = self.engines[e].kv_in_transit.pop_front().expect("checked");
            let node = &mut self.nodes[r].engines[k];
            let Some(kv) = node.kv.as_mut() else { return };
            kv.apply_aligned(&batch, now as u64);
            for change in kv.take_changes() {
                match change {
                    NodeBlockChange::Added {
                        hash,
                        parent,
                        tokens,
                    } => node.shadow.insert_block(hash, parent, tokens, now as u64),
                    NodeBlockChange::Removed { hash } => {
                        node.shadow.remove_block(hash);
                    }
                    NodeBlockChange::Cleared => node.shadow.clear(),
                }
            }
        }
    }

    fn valid_on(&self, slot: u32, e: usize) -> bool {
        let (r, k) = self.engine_of(e);
        self.flights
            .get(slot as usize)
            .and_then(|f| f.as_ref())
            .is_some_and(|f| f.served == Some(r as u8) && f.replica == k as u16)
    }

    fn first_token(&mut self, e: usize, slot: u32, at: f64, cached: u64) {
        let (r, k) = self.engine_of(e);
        if !self.valid_on(slot, e) || self.flight(slot).first_token_seen {
            self.out.run.counters.unexpected_events += 1;
            return;
        }
        self.out.run.counters.first_tokens += 1;
        let home = self.flight(slot).home as usize;
        // A response that is not streamed shows its nodes nothing until its end.
        let streamed = self.flight(slot).streamed;
        let observed = streamed && self.oracle.is_none();
        // The first byte goes back the way the request came, each node that forwarded
        // it relaying it to the one before; each learns its forward's TTFT when the
        // byte reaches it.
        let mut link = 0.0;
        for h in (0..self.flight(slot).path.len()).rev() {
            let hop = self.flight(slot).path[h];
            link += self.link_delay(hop.to as usize, hop.from as usize);
            if observed {
                self.push(at + link, Ev::FirstByte(slot, h as u8));
                self.flight_mut(slot).path[h].first_byte_due_ms = Some(at + link);
            }
        }
        let relayed = observed && !self.flight(slot).path.is_empty();
        let back = link + self.client_delay(home);
        let f = self.flight_mut(slot);
        f.first_token_seen = true;
        f.cached_tokens = cached;
        f.ttft_ms = at + back - f.send_ms;
        f.first_byte_at_client_ms = at + back;
        f.first_byte_at_node_ms = at + link;
        let engine_ttft = at - f.dispatched_ms;
        match self.oracle.as_mut() {
            Some(o) => {
                let f = self.flights[slot as usize].as_ref().expect("live");
                o.index[e].correct(
                    &f.chain,
                    cached,
                    f.dispatch_cached_tokens,
                    f.dispatched_ms as u64,
                );
            }
            None if streamed => {
                self.nodes[r].engines[k]
                    .view
                    .first_token(slot as u64, Some(engine_ttft), at as u64)
            }
            None => {}
        }
        if streamed && !relayed {
            self.record_first_token(slot);
        }
    }

    /// A forward's first byte reached the node that made hop `h` of its path: that
    /// node's forward ledger learns how late it was against its prediction for the
    /// peer it forwarded to (as the live node does when the first chunk of a forwarded
    /// stream arrives); at the client's node (hop 0) its tuner records the TTFT too.
    fn first_byte(&mut self, slot: u32, h: usize, now: f64) {
        let Some(f) = self.flights.get_mut(slot as usize).and_then(|f| f.as_mut()) else {
            return;
        };
        let Some(hop) = f.path.get_mut(h) else {
            return; // the slot was released and reused
        };
        if hop.first_byte_due_ms != Some(now) {
            return; // the slot was released and reused
        }
        hop.first_byte_due_ms = None;
        let hop = *hop;
        if h == 0 {
            self.record_first_token(slot);
        }
        let Some(pred) = hop.unbiased_predicted_ttft_ms else {
            return;
        };
        let (from, sent) = (hop.from as usize, hop.decided_ms);
        let peer = self.node_ids[hop.to as usize].clone();
        if let Some(node) = self.nodes.get_mut(from) {
            node.ledger
                .observe_forward_ttft(&peer, hop.replica, pred, now - sent, now as u64);
        }
    }

    /// The home node sees a request's first byte (the client's TTFT is known there):
    /// its tuner records the TTFT and the decision's start-fit evidence, as the live
    /// node does when the first byte goes out.
    fn record_first_token(&mut self, slot: u32) {
        let Some(f) = self.flights.get_mut(slot as usize).and_then(|f| f.as_mut()) else {
            return;
        };
        // As the live node measures it: from the request's arrival at the node to its
        // first byte leaving the node, at that moment (the client's delay both ways,
        // which the node cannot see, left out: it put 2-12 ms of constant residual
        // into the start fit, which has no intercept, and shifted every trial's p95).
        let now = f.first_byte_at_node_ms;
        let ttft_ms = f.node_ttft_ms();
        let Some(t) = self
            .nodes
            .get_mut(f.home as usize)
            .and_then(|n| n.tuner.as_mut())
        else {
            return;
        };
        f.open = t.record_first_token(&f.epoch, f.cell, ttft_ms, now as u64);
        if let Some(sample) = f.term_sample() {
            t.record_terms(&f.epoch, sample);
        }
    }

    fn finished(&mut self, e: usize, slot: u32, at: f64) {
        let (r, k) = self.engine_of(e);
        if !self.valid_on(slot, e) || !self.flight(slot).first_token_seen {
            self.out.run.counters.unexpected_events += 1;
            return;
        }
        self.out.run.counters.finishes += 1;
        let f = self.flights[slot as usize]
            .as_ref()
            .expect("events only name live flights");
        let (home, prompt, out_tokens) = (f.home as usize, f.prompt_tokens, f.output_tokens);
        self.engines[e].queued_prompt_tokens -= prompt;
        let views_learn = self.oracle.is_none();
        if let Some(node) = self.nodes.get_mut(r) {
            let engine = &mut node.engines[k];
            // A response that is not streamed comes whole now: its first byte is the
            // end, which the live node takes as its first token (`first_token` with no
            // prefill time), so one that ends before its prefill was expected to
            // teaches a decode time too (`EngineView::finish`), not none.
            if !f.streamed && views_learn {
                engine.view.first_token(slot as u64, None, at as u64);
            }
            engine.view.finish(slot as u64, at as u64);
            // As the live node on the engine's usage (its last chunk): the engine's count
            // of cached prompt tokens corrects the shadow index (`ShadowIndex::correct`),
            // unless the index follows the engine's events. A response that is not
            // streamed brings its head only now, with its body: the index learns the
            // prompt first (stamped at the dispatch, as the live node stamps it).
            if engine.models_cache() {
                if !f.streamed {
                    engine.shadow.insert(&f.chain, f.dispatched_ms as u64);
                }
                engine.shadow.correct(
                    &f.chain,
                    f.cached_tokens,
                    f.dispatch_cached_tokens,
                    f.dispatched_ms as u64,
                );
            }
        }
        let first_at_client = f.first_byte_at_client_ms;
        let first_at_node = f.first_byte_at_node_ms;
        let hops_back = f.path.len();
        let client = self.client_delay(home);
        let mut back = 0.0;
        // Back the way the request came, as the first byte; the relays pass the stream
        // on as it comes, so the transfer at the links' rate counts once.
        for h in (0..hops_back).rev() {
            let hop = self.flight(slot).path[h];
            back += self.link_delay(hop.to as usize, hop.from as usize);
        }
        if hops_back > 0 {
            if let Some(rate) = self.cfg.network.rate_mbps {
                back += out_tokens as f64 * SSE_BYTES_PER_TOKEN * 8.0 / (rate * 1000.0);
            }
        }
        // Where the live node's tuner measures the E2E: the last byte leaving the node.
        self.flight_mut(slot).last_byte_at_node_ms = (at + back).max(first_at_node);
        let back = back + client;
        // The last byte follows the first on the same stream: its own delay draws
        // cannot overtake it. (The forwarding nodes' first bytes, `Ev::FirstByte`, are
        // due no later than the client's and were scheduled first, so they are handled
        // before this completion even at the same instant.)
        self.push((at + back).max(first_at_client), Ev::Complete(slot));
    }

    fn release(&mut self, slot: u32) -> Flight {
        let f = self.flights[slot as usize].take().expect("live");
        self.free.push(slot);
        self.live -= 1;
        f
    }

    fn fail(&mut self, slot: u32, now: f64, why: &str) {
        let mut f = self.release(slot);
        if let (Some(open), Some(t)) = (
            f.open.take(),
            self.nodes
                .get_mut(f.home as usize)
                .and_then(|n| n.tuner.as_mut()),
        ) {
            t.abandon(open);
        }
        self.out.push(Row {
            index: f.index,
            home: f.home,
            served: None,
            hops: f.hops,
            ok: false,
            error: Some(why.into()),
            ttft_ms: 0.0,
            e2e_ms: (now - f.send_ms) as f32,
            start_ms: f.send_ms - self.warm_ms,
            input_tokens: f.prompt_tokens.min(u32::MAX as u64) as u32,
            output_tokens: 0,
            cached_tokens: 0,
            predicted_ttft_ms: f.predicted_ttft_ms,
            predicted_cached_tokens: None,
            cached_anywhere_tokens: f.cached_anywhere_tokens.min(u32::MAX as u64) as u32,
        });
    }

    /// The weights of an untuned run: `--weights`, else the policy's own.
    fn default_weights(&self) -> Weights {
        self.cfg.weights.unwrap_or(self.kind.default_weights())
    }

    fn complete(&mut self, slot: u32, now: f64) {
        let mut f = self.release(slot);
        if f.path.iter().any(|h| h.first_byte_due_ms.is_some()) {
            // The forwarding node would never see the first byte (its tuner and
            // forward ledger would miss the request): the stream's order was broken.
            self.out.run.counters.unexpected_events += 1;
        }
        let e2e = now - f.send_ms;
        if let (Some(open), Some(t)) = (
            f.open.take(),
            self.nodes
                .get_mut(f.home as usize)
                .and_then(|n| n.tuner.as_mut()),
        ) {
            // At the node, as the live node's tuner takes it (`node_ttft_ms`).
            t.record_finish(open, f.last_byte_at_node_ms - f.arrived_ms);
        }
        self.out.push(Row {
            index: f.index,
            home: f.home,
            served: f.served,
            hops: f.hops,
            ok: true,
            error: None,
            ttft_ms: f.ttft_ms as f32,
            e2e_ms: e2e as f32,
            start_ms: f.send_ms - self.warm_ms,
            input_tokens: f.prompt_tokens.min(u32::MAX as u64) as u32,
            output_tokens: f.output_tokens,
            cached_tokens: f.cached_tokens.min(u32::MAX as u64) as u32,
            predicted_ttft_ms: f.predicted_ttft_ms,
            predicted_cached_tokens: f
                .predicted_cached_tokens
                .map(|c| c.min(u32::MAX as u64) as u32),
            cached_anywhere_tokens: f.cached_anywhere_tokens.min(u32::MAX as u64) as u32,
        });
    }

    fn send(&mut self, from: usize, to: usize, payload: Payload, at: f64) {
        let m = Message {
            from: from as u8,
            to: to as u8,
            payload,
        };
        let id = match self.free_messages.pop() {
            Some(i) => {
                self.messages[i as usize] = Some(m);
                i
            }
            None => {
                self.messages.push(Some(m));
                (self.messages.len() - 1) as u32
            }
        };
        self.push(at, Ev::Deliver(id));
    }

    /// Node `r` gossips each of its engines' stats and summary to every peer and runs
    /// its tuner.
    fn tick(&mut self, r: usize, now: f64) {
        if r == 0 && now >= self.next_kv_sample_ms {
            self.next_kv_sample_ms = now + KV_SAMPLE_MS;
            self.sample_kv();
        }
        let n = self.names.len();
        // As the cluster's round: reorder buffers whose gap outlived its timeout go,
        // and the peer is asked for a snapshot (every peer is alive here).
        let config = GossipConfig::default();
        for p in (0..n).filter(|&p| p != r) {
            for k in 0..self.nodes[r].peers[p].len() {
                let me = &self.node_ids[r];
                if let Some(request) =
                    self.nodes[r].peers[p][k].tick(me, k as u16, now as u64, &config)
                {
                    self.out.run.counters.snapshot_requests += 1;
                    self.send_gossip(r, p, request, now);
                }
            }
        }
        // Follow the cluster's size (constant here: every peer stays live).
        let peers = self.cfg.peer_count();
        let sample = self.nodes[r].summary_sample.observe(peers, now as u64);
        for k in 0..self.cfg.replicas {
            let engine = &mut self.nodes[r].engines[k];
            engine.stats_version += 1;
            engine.shadow.set_summary_sample(sample);
            let stats = self.local_stats(self.engine_index(r, k));
            for p in 0..n {
                if p == r {
                    continue;
                }
                let engine = &mut self.nodes[r].engines[k];
                let Some(out) =
                    engine
                        .gossip
                        .poll(&self.node_ids[p], engine.shadow.summary(), &stats)
                else {
                    continue;
                };
                // The transport took it (one uni-stream per message, as live); a loss
                // below is repaired by the receiver's snapshot request.
                engine.gossip.on_sent(&self.node_ids[p], out.id, true);
                self.send_gossip(r, p, out.message, now);
            }
        }
        let outputs = match self.nodes[r].tuner.as_mut() {
            Some(t) => t.tick(now as u64),
            None => Vec::new(),
        };
        self.tuning_outputs(r, outputs, now);
        if let Some(at) = self.next_periodic(now, self.cfg.gossip_interval_ms) {
            self.push(at, Ev::Tick(r as u8));
        }
    }

    /// When a periodic event (a tick, a scrape) at `now` comes next, `interval` on:
    /// `None` once the trace is done and nothing is in flight. With nothing in flight
    /// and the next row over [`IDLE_SKIP_MS`] away, the whole intervals up to that
    /// row's warm-up are skipped (its phase kept): an outlier timestamp (an epoch-ms
    /// row in a relative trace) had the nodes tick for centuries of virtual time.
    fn next_periodic(&self, now: f64, interval: f64) -> Option<f64> {
        if self.trace_done && self.live == 0 {
            return None;
        }
        let next = now + interval;
        match self.next_send_ms {
            Some(send) if self.live == 0 && send - next > IDLE_SKIP_MS + self.warm_ms => {
                let skipped = ((send - self.warm_ms - next) / interval).floor();
                Some(next + skipped * interval)
            }
            _ => Some(next),
        }
    }

    /// Put gossip message `msg` from `r` to `p` on the wire at `now`: count its bytes
    /// as the live cluster frames it, and lose it with probability `gossip_loss`.
    fn send_gossip(&mut self, r: usize, p: usize, msg: GossipMessage, now: f64) {
        let delay = self.link_delay(r, p) + self.cfg.gossip_extra_delay_ms;
        let c = &mut self.out.run.counters;
        let bytes = (core_gossip::encoded_len(&msg) + GOSSIP_FRAME_HEADER) as u64;
        // Over the run, not its warm-up (the per-second figure is over the run).
        if now >= self.warm_ms {
            c.gossip_messages += 1;
            c.gossip_bytes += bytes;
        }
        if !self.trace_done && now >= self.warm_ms {
            // While requests still arrive: the load the gossip figure is quoted at.
            c.gossip_bytes_arriving += bytes;
            c.gossip_arriving_until_ms = now - self.warm_ms;
        }
        if self.cfg.gossip_loss > 0.0
            && self.nodes[r].gossip_loss_rng.random::<f64>() < self.cfg.gossip_loss
        {
            c.gossip_lost += 1;
            return;
        }
        self.send(r, p, Payload::Gossip(msg), now + delay);
    }

    fn deliver(&mut self, id: u32, now: f64) {
        let m = self.messages[id as usize].take().expect("live message");
        self.free_messages.push(id);
        let (from, to) = (m.from as usize, m.to as usize);
        match m.payload {
            Payload::Gossip(msg) => {
                // A summary speaks for one of the sender's engines; a snapshot request
                // asks for one of the receiver's (any receiver state of the asker
                // takes it).
                let k = core_gossip::replica(&msg) as usize;
                let asks = matches!(msg, GossipMessage::SnapshotRequest { .. });
                let node = &mut self.nodes[to];
                let config = GossipConfig::default();
                // The peer's summaries, all its engines together, within their cap,
                // as the cluster keeps them.
                let received = core_gossip::receive_from_peer(
                    &mut node.peers[from],
                    |g| g,
                    &mut node.peer_runs[from],
                    &self.node_ids[to],
                    &self.node_ids[from],
                    msg,
                    now as u64,
                    &config,
                );
                // Honest nodes' messages, but a cluster of many large engines can still
                // take a peer over the fingerprint cap: refused, as live.
                let received = match received {
                    Ok(received) => received,
                    Err(_) => {
                        self.out.run.counters.gossip_refused += 1;
                        return;
                    }
                };
                // The ledger observes these stats when the next decision builds its
                // candidates (core `build_candidates`), as of their arrival now, as on
                // the live node.
                if received.stats_updated {
                    node.stats_at_ms[from][k] = now;
                }
                if received.snapshot_requested {
                    node.engines[k]
                        .gossip
                        .on_snapshot_request(&self.node_ids[from], now as u64);
                }
                // The peer's reorder buffers, all its engines together, within their
                // cap, as the cluster keeps them.
                let over_cap = (!asks)
                    .then(|| {
                        core_gossip::limit_peer_pending(
                            &mut node.peers[from],
                            |g| g,
                            k as u16,
                            &self.node_ids[to],
                            now as u64,
                            &config,
                        )
                    })
                    .flatten();
                for reply in received.reply.into_iter().chain(over_cap) {
                    self.out.run.counters.snapshot_requests += 1;
                    self.send_gossip(to, from, reply, now);
                }
            }
            Payload::Proposal(p) => {
                let outputs = match self.nodes[to].tuner.as_mut() {
                    Some(t) => t.handle_proposal(&self.node_ids[from], p, now as u64),
                    None => Vec::new(),
                };
                self.tuning_outputs(to, outputs, now);
            }
            Payload::Report(rep) => {
                let outputs = match self.nodes[to].tuner.as_mut() {
                    Some(t) => t.handle_report(rep, now as u64),
                    None => Vec::new(),
                };
                self.tuning_outputs(to, outputs, now);
            }
        }
    }

    fn tuning_outputs(&mut self, r: usize, outputs: Vec<TuningOutput>, now: f64) {
        for o in outputs {
            match o {
                TuningOutput::Broadcast(p) => {
                    for q in 0..self.names.len() {
                        if q != r {
                            let at = now + self.link_delay(r, q);
                            self.send(r, q, Payload::Proposal(p.clone()), at);
                        }
                    }
                }
                TuningOutput::SendReport { to, report } => {
                    if let Some(q) = self.node_ids.iter().position(|id| *id == to) {
                        let at = now + self.link_delay(r, q);
                        self.send(r, q, Payload::Report(report), at);
                    }
                }
                TuningOutput::SendProposal { to, proposal } => {
                    if let Some(q) = self.node_ids.iter().position(|id| *id == to) {
                        let at = now + self.link_delay(r, q);
                        self.send(r, q, Payload::Proposal(proposal), at);
                    }
                }
                TuningOutput::Record(record) => self.out.run.tuning.push(TuningLine {
                    policy: self.kind.as_str().to_owned(),
                    at_ms: now - self.warm_ms,
                    record,
                }),
            }
        }
    }

    fn finish(mut self) -> PolicyRun {
        let c = &mut self.out.run.counters;
        let views = || {
            self.nodes
                .iter()
                .flat_map(|n| n.engines.iter().map(|e| &e.view))
        };
        c.fitted_t_p_ms = views().map(|v| v.fit().t_p_ms()).collect();
        c.fitted_base_ms = views().map(|v| v.fit().base_ms()).collect();
        c.view_counters_end = views().map(|v| v.counters()).collect();
        self.out.run
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The one-pass trim keeps what dropping the last block while the others
        /// still reach the prompt kept (the loop it replaced).
        #[test]
        fn trimming_in_one_pass_keeps_what_popping_kept(
            tokens in proptest::collection::vec(0u32..600, 0..40),
            input in 1u64..20_000,
        ) {
            let ids: Vec<[u8; 8]> = (0..tokens.len() as u64).map(u64::to_be_bytes).collect();
            let mut chain = HashChain::from_block_ids(&ids, 512, 512 * ids.len() as u64);
            chain.block_tokens = tokens;
            let mut popped = chain.clone();
            while popped.len() > 1 && popped.prefix_tokens(popped.len() - 1) >= input {
                popped.hashes.pop();
                popped.block_tokens.pop();
            }
            trim_to_prompt(&mut chain, input);
            prop_assert_eq!(chain, popped);
        }
    }

    /// Every policy of a comparison meets the same gossip and scrape phases (paired,
    /// as the policies of one live cluster do): they were drawn per policy, so each
    /// met its own staleness at every burst of a gridded trace.
    #[test]
    fn policies_of_one_seed_share_their_gossip_and_scrape_phases() {
        let profile = Profile::by_name("paper-a100-mistral7b").unwrap();
        let cfg = SimConfig::new(crate::Network::uniform(3, 40.0, 3.0), profile);
        let phases = |kind| {
            let sim = Sim::new(&cfg, kind).unwrap();
            let mut at: Vec<(String, u64)> = sim
                .heap
                .iter()
                .map(|s| (format!("{:?}", s.ev), s.at.to_bits()))
                .collect();
            at.sort();
            at
        };
        let gorgo = phases(PolicyKind::Gorgo);
        assert_eq!(gorgo.len(), 6, "a tick and a scrape per node");
        assert_eq!(gorgo, phases(PolicyKind::LeastLoad));
        assert_eq!(gorgo, phases(PolicyKind::PrefixCache));
    }

    /// An interval so small that `now + interval == now` never let the run end: the
    /// gossip and scrape periods are at least a millisecond, refused naming the field
    /// (the CLI names the flag from it).
    #[test]
    fn intervals_under_a_millisecond_are_refused_naming_the_field() {
        let profile = Profile::by_name("paper-a100-mistral7b").unwrap();
        let cfg = SimConfig::new(Network::uniform(2, 40.0, 3.0), profile);
        cfg.validate().unwrap();
        for (field, set) in [
            (
                "gossip_interval_ms",
                (|c, v| c.gossip_interval_ms = v) as fn(&mut SimConfig, f64),
            ),
            ("metrics_interval_ms", |c, v| c.metrics_interval_ms = v),
        ] {
            for v in [1e-20, 0.5, 0.0, f64::NAN] {
                let mut c = cfg.clone();
                set(&mut c, v);
                match c.validate() {
                    Err(crate::SimError::InvalidConfig { field: f, .. }) => {
                        assert_eq!(f, field, "{v}")
                    }
                    other => panic!("{field} = {v}: {other:?}"),
                }
            }
            let mut c = cfg.clone();
            set(&mut c, 1.0);
            c.validate().unwrap();
        }
    }

    /// Magnitudes past their documented bounds are refused naming the field: a time
    /// scale of `1e14` or a gossip interval of `1e12` ran for ever, a gossip delay of
    /// `1e8` held all the run's gossip in flight, an infinite time scale was said to
    /// be "not > 0"; values at the bounds are accepted.
    #[test]
    fn magnitudes_past_their_bounds_are_refused_naming_the_field() {
        let profile = Profile::by_name("paper-a100-mistral7b").unwrap();
        let cfg = SimConfig::new(Network::uniform(2, 40.0, 3.0), profile);
        type Set = fn(&mut SimConfig, f64);
        let cases: [(&str, Set, &[f64], f64); 5] = [
            (
                "time_scale",
                |c, v| c.time_scale = v,
                &[1e14, 1e16, 1e300, f64::INFINITY, 10_000.5],
                MAX_TIME_SCALE,
            ),
            (
                "gossip_interval_ms",
                |c, v| c.gossip_interval_ms = v,
                &[1e12, 1e300, 3_600_001.0],
                MAX_INTERVAL_MS,
            ),
            (
                "metrics_interval_ms",
                |c, v| c.metrics_interval_ms = v,
                &[1e300, 3_600_001.0],
                MAX_INTERVAL_MS,
            ),
            (
                "gossip_extra_delay_ms",
                |c, v| c.gossip_extra_delay_ms = v,
                &[1e8, 1e9, f64::INFINITY],
                MAX_INTERVAL_MS,
            ),
            (
                "kv_events_delay_ms",
                |c, v| c.kv_events_delay_ms = v,
                &[1e300, 3_600_001.0],
                MAX_INTERVAL_MS,
            ),
        ];
        for (field, set, bad, max) in cases {
            for &v in bad {
                let mut c = cfg.clone();
                set(&mut c, v);
                match c.validate() {
                    Err(crate::SimError::InvalidConfig { field: f, reason }) => {
                        assert_eq!(f, field, "{v}");
                        assert!(
                            reason.contains("finite") || field != "time_scale",
                            "{reason}"
                        );
                    }
                    other => panic!("{field} = {v}: {other:?}"),
                }
            }
            let mut c = cfg.clone();
            set(&mut c, max);
            c.validate().unwrap();
        }
    }

    /// A trace stretched past the virtual time f64 milliseconds resolve fails naming
    /// the time scale, instead of reporting figures rounded away (or, further out,
    /// ticking at one instant for ever).
    #[test]
    fn a_trace_stretched_past_the_last_resolvable_time_is_an_error() {
        let profile = Profile::by_name("paper-a100-mistral7b").unwrap();
        let mut cfg = SimConfig::new(Network::uniform(2, 40.0, 3.0), profile);
        cfg.time_scale = MAX_TIME_SCALE;
        let row = |timestamp_ms| TraceRequest {
            timestamp_ms,
            input_tokens: 100,
            output_tokens: 4,
            tokens_per_block: 256,
            blocks: gorgo_workload::BlockIds::Int(vec![1]),
            user: None,
            session: None,
            home_region: None,
            request_id: None,
            system_prompt_hash: None,
        };
        let trace = |last| vec![Ok(row(0)), Ok(row(last))];
        // 2.7e12 ms of trace (85 years) x 10,000 is past the limit.
        let e = simulate(
            &cfg,
            PolicyKind::LeastLoad,
            trace(2_700_000_000_000),
            &mut |_| {},
        )
        .unwrap_err();
        assert!(
            matches!(e, SimError::VirtualTime(_)) && e.to_string().contains("time_scale"),
            "{e}"
        );
        // A day of it is fine.
        let run = simulate(&cfg, PolicyKind::LeastLoad, trace(8_640_000), &mut |_| {}).unwrap();
        assert_eq!(run.counters.completed, 2);
    }

    /// A tuning window the trial cannot split between its arms is refused before the
    /// run, naming `tuning_window` (a window of 1 tuned nothing, silently, where
    /// `window_requests = 1` in `tuning_set` was refused).
    #[test]
    fn a_one_request_window_of_a_paired_trial_is_refused() {
        let profile = Profile::by_name("paper-a100-mistral7b").unwrap();
        let mut cfg = SimConfig::new(Network::uniform(2, 40.0, 3.0), profile);
        cfg.tune = true;
        cfg.tuning_window = Some(1);
        match cfg.validate() {
            Err(SimError::InvalidConfig { field, .. }) => assert_eq!(field, "tuning_window"),
            other => panic!("{other:?}"),
        }
        cfg.tuning_window = Some(2);
        cfg.validate().unwrap();
        cfg.tuning_window = Some(1);
        cfg.trial = TrialDesign::Sequential;
        cfg.validate().unwrap();
    }

    /// A `tuning_set` value of the wrong type names its key: serde said only
    /// "invalid type: string \"abc\", expected u32".
    #[test]
    fn a_tuning_set_value_of_the_wrong_type_names_its_key() {
        let profile = Profile::by_name("paper-a100-mistral7b").unwrap();
        let mut cfg = SimConfig::new(Network::uniform(2, 40.0, 3.0), profile);
        cfg.tune = true;
        cfg.tuning_set = vec![("max_trial_windows".into(), serde_json::json!("abc"))];
        match cfg.validate() {
            Err(SimError::InvalidConfig { field, reason }) => {
                assert_eq!(field, "tuning_set");
                assert!(
                    reason.contains("`max_trial_windows`") && reason.contains("u32"),
                    "{reason}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    /// The causal oracle counts its own forward at once and another region's only
    /// once the one-way delay from there has passed, and only those to the engine
    /// asked about.
    #[test]
    fn forwards_are_known_once_news_of_them_could_arrive() {
        let one_way = vec![
            vec![0.0, 40.0, 90.0],
            vec![40.0, 0.0, 60.0],
            vec![90.0, 60.0, 0.0],
        ];
        let fwd = |slot, from, engine| OracleForward {
            slot,
            from,
            decided_ms: 100.0,
            engine,
            uncached: 1000 + u64::from(slot),
        };
        // From region 0 to engine 2, from region 1 to engine 2, from 1 to engine 0.
        let forwards = [fwd(1, 0, 2), fwd(2, 1, 2), fwd(3, 1, 0)];
        assert_eq!(
            known_in_transit(&forwards, 2, 0, 100.0, &one_way),
            (1, 1001)
        );
        assert_eq!(
            known_in_transit(&forwards, 2, 0, 139.9, &one_way),
            (1, 1001)
        );
        assert_eq!(
            known_in_transit(&forwards, 2, 0, 140.0, &one_way),
            (2, 2003)
        );
        assert_eq!(
            known_in_transit(&forwards, 2, 1, 100.0, &one_way),
            (1, 1002)
        );
        assert_eq!(
            known_in_transit(&forwards, 2, 1, 140.0, &one_way),
            (2, 2003)
        );
        assert_eq!(known_in_transit(&forwards, 0, 2, 159.0, &one_way), (0, 0));
        assert_eq!(
            known_in_transit(&forwards, 0, 2, 160.0, &one_way),
            (1, 1003)
        );
    }

    /// A forward its target refused is served by the home node's own engine: the
    /// start fit's evidence is that engine's terms with the refusal's round trip as
    /// their RTT, as the node's (`CostTerms::served_locally_after`); it was the peer's
    /// RTT and queue estimate, set against the local engine's wait.
    #[test]
    fn a_refused_forward_is_sampled_with_the_local_engines_terms() {
        let profile = Profile::by_name("paper-a100-mistral7b").unwrap();
        let cfg = SimConfig::new(Network::uniform(2, 40.0, 3.0), profile);
        let mut sim = Sim::new(&cfg, PolicyKind::Gorgo).unwrap();
        let row = row_at(&sim, 0, 1000, 10, gorgo_workload::BlockIds::None);
        sim.admit(0, 0.0, row);
        let w = Weights {
            w_rtt: 0.5,
            w_queue: 1.0,
        };
        let mut local = Candidate::idle("r0", true, 0.0);
        local.stats.t_p_ms = 0.1;
        local.stats.unfinished_prefill_tokens = 20_000;
        let mut peer = Candidate::idle("r1", false, 80.0);
        peer.stats.t_p_ms = 0.1;
        peer.stats.unfinished_prefill_tokens = 500;
        let local = gorgo_core::cost::cost_terms(1000, &local, w, 1000);
        let peer = gorgo_core::cost::cost_terms(1000, &peer, w, 1000);
        // Node 0 forwarded it to region 1 at 100 ms; the refusal is back at 400.
        let f = sim.flight_mut(0);
        assert_eq!(f.home, 0);
        f.chosen_terms = Some((peer, w));
        f.path.push(Hop {
            from: 0,
            to: 1,
            replica: 0,
            uncached_tokens: 1000,
            decided_ms: 100.0,
            unbiased_predicted_ttft_ms: peer.unbiased_estimated_ttft_ms(),
            local_engine: Some(0),
            local_terms: Some(local),
            local_cached_tokens: Some(0),
            offer: None,
            decision: None,
            first_byte_due_ms: None,
        });
        f.served = Some(1);
        f.hops = 1;
        sim.refused(0, 400.0);
        let f = sim.flight(0);
        let (terms, weights) = f.chosen_terms.expect("the local engine's terms");
        assert_eq!(weights, w);
        assert_eq!(terms.rtt_ms, 0.5 * 300.0);
        assert_eq!(terms.raw_queue_ms, local.raw_queue_ms);
        let predicted = local.estimated_ttft_ms.unwrap() + 300.0;
        assert_eq!(terms.estimated_ttft_ms, Some(predicted));
        assert_eq!(f.predicted_ttft_ms, Some(predicted as f32));
        assert_eq!((f.served, f.hops), (Some(0), 0));
        let sample = TermSample::new(&terms, w, 2_600.0).unwrap();
        assert_eq!(
            (sample.rtt_ms, sample.queue_ms),
            (300.0, local.raw_queue_ms)
        );
        // A request held 500 ms before its decision: the start fit's residual is what
        // the terms priced, not the hold (which the node never has).
        let f = sim.flight_mut(0);
        f.first_byte_at_node_ms = f.arrived_ms + 2_600.0;
        let unheld = f.term_sample().unwrap();
        assert_eq!(
            unheld.residual_ms, sample.residual_ms,
            "measured at the node"
        );
        f.held_ms = 500.0;
        f.first_byte_at_node_ms += 500.0;
        let held = f.term_sample().unwrap();
        assert_eq!(held.residual_ms, unheld.residual_ms);
    }

    /// A row of `input` and `output` tokens whose home is region `home` of `sim`, its
    /// blocks of 256 tokens `blocks`.
    fn row_at(
        sim: &Sim<'_>,
        home: usize,
        input: u64,
        output: u32,
        blocks: gorgo_workload::BlockIds,
    ) -> TraceRequest {
        TraceRequest {
            input_tokens: input,
            output_tokens: output,
            tokens_per_block: 256,
            blocks,
            user: None,
            session: None,
            home_region: Some(sim.names[home].clone()),
            request_id: None,
            system_prompt_hash: None,
            timestamp_ms: 0,
        }
    }

    /// A prompt the engine refuses (prompt and output over its context, the prompt
    /// alone within it) never enters the node's index, as the live node learns a prompt
    /// only from a success head: inserted at dispatch, a prompt near the engine's
    /// capacity evicted the node's whole model of its cache, and peers heard it.
    #[test]
    fn a_prompt_the_engine_refuses_leaves_the_index_as_it_was() {
        let profile = Profile::by_name("paper-a100-mistral7b").unwrap();
        let context = profile.context_length;
        let cfg = SimConfig::new(Network::uniform(1, 40.0, 3.0), profile);
        let mut sim = Sim::new(&cfg, PolicyKind::Gorgo).unwrap();
        let blocks = (context / 16) as usize;
        let ids = gorgo_workload::BlockIds::Int((0..blocks as u64).collect());
        let mut row = row_at(&sim, 0, context - 16, 1000, ids);
        row.tokens_per_block = 16;
        sim.admit(0, 0.0, row);
        let chain = sim.flight(0).chain.clone();
        assert!(!chain.hashes.is_empty());
        sim.dispatch(0, 0, 10.0);
        assert!(sim.flights[0].is_none(), "refused: failed and released");
        assert_eq!(sim.nodes[0].engines[0].shadow.longest_match(&chain), 0);
    }

    /// A row listing a million block ids for a one-token prompt keeps one block.
    #[test]
    fn a_row_with_far_more_ids_than_tokens_keeps_one_block() {
        let ids: Vec<[u8; 8]> = (0..1_000_000u64).map(u64::to_be_bytes).collect();
        let mut chain = HashChain::from_block_ids(&ids, 1, 1_000_000);
        chain.block_tokens.iter_mut().for_each(|t| *t = 1);
        trim_to_prompt(&mut chain, 1);
        assert_eq!(chain.len(), 1);
    }
}
