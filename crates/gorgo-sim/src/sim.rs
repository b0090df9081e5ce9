//! The event loop: one binary heap of `(time, seq, event)` over virtual milliseconds.
//!
//! Events: a request reaching its home node (after the client delay), a forward
//! reaching its peer (after the one-way delay), an engine's next iteration end (only
//! the one [`Engine::next_event_time`] reports is scheduled; stale ones are skipped),
//! a node's gossip tick, a gossip or tuning message reaching its peer, and a request's
//! last byte reaching the client. First tokens need no event of their own: the engine
//! reports when they happen and the client sees them a fixed delay later.
//!
//! The trace is streamed: a row is read only when virtual time reaches its send time,
//! so memory follows the requests in flight and the engines' caches, not trace length.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use gorgo_core::cost::{Candidate, ForwardLedger};
use gorgo_core::decision::decide;
use gorgo_core::es::TuningConfig;
use gorgo_core::fit::{FitConfig, PrefillFit};
use gorgo_core::policy::{Policy, PolicyKind, RouteRequest};
use gorgo_core::summary::{SummaryDelta, SummarySnapshot};
use gorgo_core::tuning::{EpochReport, Proposal, Tuner, TuningOutput};
use gorgo_core::{hash::hash_bytes, HashChain, NodeId, PeerSummary, QueueStats, ShadowIndex};
use gorgo_engine::{Engine, EngineEvent, EngineRequest, Profile};
use gorgo_workload::{TraceRequest, WorkloadError};
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::collect::{Collector, PolicyRun, Row, TuningLine};
use crate::network::Network;
use crate::{invalid, Result};

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
    /// Period of each node's gossip (summary delta + queue stats) and tuning tick, ms.
    pub gossip_interval_ms: f64,
    /// Extra transit delay of gossip on top of the one-way delay, ms.
    pub gossip_extra_delay_ms: f64,
    /// The max-hops guard (DESIGN.md default 1).
    pub max_hops: u8,
    /// Multiplies trace inter-arrival times (< 1 compresses and loads the engines).
    pub time_scale: f64,
    /// Seeds jitter, gossip phases, tie-breaks and the tuner's mutations.
    pub seed: u64,
    /// Run the distributed tuning protocol (for the policies that use weights).
    pub tune: bool,
    /// Trial window in requests cluster-wide (`None`: the core's default).
    pub tuning_window: Option<usize>,
    /// Salt of the home-region hash (`None`: the same assignment as `gorgo bench`).
    pub region_seed: Option<u64>,
    /// Per-request rows kept per policy; past this only sketches are kept.
    pub max_rows: usize,
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
    /// Build each node's own queue stats the way the live node does (its accounting of
    /// the requests it dispatched: expected prefill tokens until the first token, the
    /// in-flight count; the engine's `/metrics` scraped every
    /// [`LIVE_METRICS_INTERVAL_MS`], the configured decode-step seed) instead of from
    /// its engine's exact state. For side-by-side comparisons with `gorgo compare`.
    pub live_node_stats: bool,
}

/// The live node's default `/metrics` scrape interval (`engine.metrics_interval_ms`).
pub const LIVE_METRICS_INTERVAL_MS: f64 = 250.0;
/// The live node's default decode-step seed (`engine.decode_step_ms`).
pub const LIVE_DECODE_STEP_MS: f64 = 20.0;
/// The live node's starting guess of the prompt size of requests it did not send.
const LIVE_DEFAULT_MEAN_PROMPT_TOKENS: u64 = 1024;

/// Tokens `gorgo bench` keeps free for the chat template when it shortens prompts to a
/// context (its `CHAT_TEMPLATE_TOKENS`), so both shorten the same way.
pub const CHAT_TEMPLATE_TOKENS: u64 = 64;

impl SimConfig {
    /// Defaults of DESIGN.md around a network, one profile for every region.
    pub fn new(network: Network, profile: Profile) -> Self {
        let profiles = vec![profile; network.regions.len()];
        SimConfig {
            network,
            profiles,
            gossip_interval_ms: 250.0,
            gossip_extra_delay_ms: 0.0,
            max_hops: 1,
            time_scale: 1.0,
            seed: 0,
            tune: false,
            tuning_window: None,
            region_seed: None,
            max_rows: 200_000,
            max_requests: None,
            max_context_tokens: None,
            live_chains: false,
            live_node_stats: false,
        }
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
        if !(self.gossip_interval_ms.is_finite() && self.gossip_interval_ms > 0.0) {
            return Err(invalid("gossip_interval_ms", "must be > 0"));
        }
        if !(self.gossip_extra_delay_ms.is_finite() && self.gossip_extra_delay_ms >= 0.0) {
            return Err(invalid("gossip_extra_delay_ms", "must be >= 0"));
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(invalid("time_scale", "must be > 0"));
        }
        if self.tuning_window == Some(0) {
            return Err(invalid("tuning_window", "must be > 0"));
        }
        Ok(())
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

/// The home region of a trace request: its own `home_region` when the network has it;
/// else a hash of its user, else of its session, else of its position, over the
/// regions. With `salt = None` this is exactly `gorgo bench`'s assignment, so a
/// simulation and a live replay of one trace put every client in the same region.
pub fn home_region(req: &TraceRequest, index: u64, regions: &[String], salt: Option<u64>) -> usize {
    if let Some(r) = &req.home_region {
        if let Some(i) = regions.iter().position(|n| n == r) {
            return i;
        }
    }
    let mut key = match (&req.user, &req.session) {
        (Some(u), _) => u.as_bytes().to_vec(),
        (None, Some(s)) => s.as_bytes().to_vec(),
        (None, None) => index.to_le_bytes().to_vec(),
    };
    if let Some(s) = salt {
        key.extend_from_slice(&s.to_le_bytes());
    }
    (hash_bytes(&key) % regions.len().max(1) as u64) as usize
}

/// The session key the bench client sends as `x-session-id` (conversation within
/// user, else user), hashed as the node hashes the header.
fn session_key(req: &TraceRequest) -> Option<u64> {
    let s = match (&req.session, &req.user) {
        (Some(s), Some(u)) => Some(format!("{u}/{s}")),
        (Some(s), None) => Some(s.clone()),
        (None, u) => u.clone(),
    };
    s.map(|s| hash_bytes(s.as_bytes()))
}

/// The `model` field `gorgo bench` sends by default.
const BENCH_MODEL: &str = "gorgo-emulated";

/// The chain and prompt tokens the node computes for the body `gorgo bench` sends.
fn live_chain(row: &TraceRequest) -> (HashChain, u64) {
    let body = gorgo_workload::chat_body(row, BENCH_MODEL);
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
    /// The engine of a region may have finished an iteration.
    EngineWake(u8),
    /// A node's gossip and tuning tick.
    Tick(u8),
    /// A message reached its destination.
    Deliver(u32),
    /// A request's last byte reached its client.
    Complete(u32),
    /// A node scrapes its engine's metrics (`live_node_stats`).
    Scrape(u8),
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

/// A request between its arrival and its last byte.
#[derive(Debug)]
struct Flight {
    index: u64,
    chain: HashChain,
    session_key: Option<u64>,
    prompt_tokens: u64,
    output_tokens: u32,
    home: u8,
    served: Option<u8>,
    hops: u8,
    send_ms: f64,
    dispatched_ms: f64,
    epoch: u64,
    ttft_ms: f64,
    cached_tokens: u64,
    first_token_seen: bool,
    /// Expected prefill tokens counted in the oracle's in-transit figure.
    transit_tokens: u64,
    /// Prefill work the serving node accounted at dispatch (`live_node_stats`).
    acct_prefill_tokens: u64,
    /// The serving node's own queueing estimate at dispatch, ms: subtracted from the
    /// engine-side TTFT its `PrefillFit` sees (as the live node does).
    queued_est_ms: f64,
    /// The TTFT the client's node's decision predicted for its chosen candidate, ms
    /// (cost-based policies only).
    predicted_ttft_ms: Option<f32>,
}

enum Payload {
    Gossip {
        stats: QueueStats,
        delta: Option<SummaryDelta>,
        snapshot: Option<SummarySnapshot>,
    },
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
    shadow: ShadowIndex,
    peer_summaries: Vec<PeerSummary>,
    peer_stats: Vec<Option<QueueStats>>,
    ledger: ForwardLedger,
    fit: PrefillFit,
    stats_version: u64,
    /// Summary version last sent to each peer (`None`: send a snapshot).
    sent_version: Vec<Option<u64>>,
    /// When the last gossip message to each peer is delivered (links are FIFO).
    last_gossip_at: Vec<f64>,
    tuner: Option<Tuner>,
}

/// The state every region has whatever the mode.
struct Region {
    engine: Engine,
    /// Raw prompt tokens dispatched here and not finished (`gorgo-paper`'s signal).
    queued_prompt_tokens: u64,
    /// Next wakeup scheduled for the engine.
    wake_at: Option<f64>,
    /// The live node's accounting (used with `live_node_stats`): requests dispatched
    /// and not finished...
    acct_inflight: u64,
    /// ...expected prefill tokens (prompt less the shadow index's match) of those not
    /// yet past their first token...
    acct_unprefilled_tokens: u64,
    /// ...the EWMA of that expected prefill work per dispatch...
    acct_mean_prompt: u64,
    /// ...and the engine's state at the last scrape.
    scraped: Option<gorgo_engine::EngineStats>,
}

/// The central router of `oracle` mode: exact state of every engine, instantly.
struct Oracle {
    policy: Box<dyn Policy>,
    /// Per region: the engine's prefix cache as the oracle tracks it (inserted on
    /// dispatch, corrected with the engine's own cached-token count at first token).
    index: Vec<ShadowIndex>,
    /// Per region: requests on their way there, and their expected prefill tokens.
    in_transit: Vec<(u32, u64)>,
}

struct Sim<'a> {
    cfg: &'a SimConfig,
    kind: PolicyKind,
    names: Vec<String>,
    node_ids: Vec<NodeId>,
    regions: Vec<Region>,
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
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ hash_bytes(kind.as_str().as_bytes()));
        let regions = cfg
            .profiles
            .iter()
            .map(|p| {
                let mut engine = Engine::new(p.clone());
                engine.set_emit_decode_steps(false);
                Region {
                    engine,
                    queued_prompt_tokens: 0,
                    wake_at: None,
                    acct_inflight: 0,
                    acct_unprefilled_tokens: 0,
                    acct_mean_prompt: LIVE_DEFAULT_MEAN_PROMPT_TOKENS,
                    scraped: None,
                }
            })
            .collect();
        let mut out = Collector::new(kind.as_str(), names.clone(), cfg.max_rows);
        for (i, p) in cfg.profiles.iter().enumerate() {
            out.run.counters.capacity_tokens[i] = p.max_total_tokens;
        }
        let mut sim = Sim {
            cfg,
            kind,
            names,
            node_ids: node_ids.clone(),
            regions,
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
        };
        if kind == PolicyKind::Oracle {
            sim.oracle = Some(Oracle {
                policy: kind.build(),
                index: cfg
                    .profiles
                    .iter()
                    .map(|p| ShadowIndex::new(p.max_total_tokens))
                    .collect(),
                in_transit: vec![(0, 0); n],
            });
        } else {
            let tune = cfg.tune && kind.uses_weights();
            for (i, p) in cfg.profiles.iter().enumerate() {
                let tuner = if tune {
                    let mut tc = TuningConfig::for_policy(kind);
                    tc.seed = cfg.seed.wrapping_add(i as u64);
                    if let Some(w) = cfg.tuning_window {
                        tc.window = w;
                        tc.min_samples = tc.min_samples.min(w);
                    }
                    let mut t = Tuner::new(node_ids[i].clone(), tc)?;
                    t.set_membership(node_ids.iter().cloned());
                    Some(t)
                } else {
                    None
                };
                sim.nodes.push(Node {
                    id: node_ids[i].clone(),
                    policy: kind.build(),
                    shadow: ShadowIndex::new(p.max_total_tokens),
                    peer_summaries: vec![PeerSummary::new(); n],
                    peer_stats: vec![None; n],
                    ledger: ForwardLedger::new(),
                    fit: PrefillFit::new(
                        p.idle_ttft_ms(0),
                        p.t_p_ms_per_token,
                        FitConfig::default(),
                    )?,
                    stats_version: 0,
                    sent_version: vec![None; n],
                    last_gossip_at: vec![0.0; n],
                    tuner,
                });
            }
            // Nodes do not tick in lockstep: each starts at its own phase.
            for i in 0..n {
                let phase = rng.random::<f64>() * cfg.gossip_interval_ms;
                sim.push(phase, Ev::Tick(i as u8));
                if cfg.live_node_stats {
                    let phase = rng.random::<f64>() * LIVE_METRICS_INTERVAL_MS;
                    sim.push(phase, Ev::Scrape(i as u8));
                }
            }
        }
        sim.rng = rng;
        Ok(sim)
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
                            let send =
                                row.timestamp_ms.saturating_sub(o) as f64 * self.cfg.time_scale;
                            next = Some((send, row));
                        }
                    }
                }
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
            self.now = at;
            self.out.run.counters.events += 1;
            match ev {
                Ev::Arrival(slot) => self.route(slot, at),
                Ev::ForwardArrival(slot) => self.forward_arrival(slot, at),
                Ev::EngineWake(r) => self.engine_wake(r as usize, at),
                Ev::Tick(r) => self.tick(r as usize, at),
                Ev::Scrape(r) => {
                    let r = r as usize;
                    self.regions[r].scraped = Some(self.regions[r].engine.stats());
                    if !(self.trace_done && self.live == 0) {
                        self.push(at + LIVE_METRICS_INTERVAL_MS, Ev::Scrape(r as u8));
                    }
                }
                Ev::Deliver(m) => self.deliver(m, at),
                Ev::Complete(slot) => self.complete(slot, at),
            }
            let finished = self.out.run.counters.completed + self.out.run.counters.failed;
            if finished >= reported + 4096 {
                reported = finished;
                progress(self.progress());
            }
        }
        self.out.run.counters.end_ms = self.now;
        progress(self.progress());
        Ok(())
    }

    fn progress(&self) -> Progress {
        let c = &self.out.run.counters;
        Progress {
            requests: c.requests,
            finished: c.completed + c.failed,
            in_flight: self.live,
            now_ms: self.now,
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
        let home = home_region(&row, index, &self.names, self.cfg.region_seed);
        let mut row = row;
        if let Some(max) = self.cfg.max_context_tokens {
            let limit = max
                .saturating_sub(u64::from(row.output_tokens))
                .saturating_sub(CHAT_TEMPLATE_TOKENS)
                .max(1);
            row.input_tokens = row.input_tokens.min(limit);
        }
        let (chain, prompt_tokens) = if self.cfg.live_chains {
            live_chain(&row)
        } else {
            let mut chain = row.chain();
            // Blocks listed past the prompt's length (a trace's rounding, or a
            // shortened prompt) are not part of the prompt.
            let input = row.input_tokens.max(1);
            while chain.len() > 1 && chain.prefix_tokens(chain.len() - 1) >= input {
                chain.hashes.pop();
                chain.block_tokens.pop();
            }
            // Tokens past the chain are computed but never cached; with no block ids
            // the prompt is all "past the chain".
            let prompt_tokens = input.max(chain.total_tokens());
            (chain, prompt_tokens)
        };
        let flight = Flight {
            index,
            chain,
            session_key: session_key(&row),
            prompt_tokens,
            output_tokens: row.output_tokens.max(1),
            home: home as u8,
            served: None,
            hops: 0,
            send_ms: send,
            dispatched_ms: send,
            epoch: 0,
            ttft_ms: f64::NAN,
            cached_tokens: 0,
            predicted_ttft_ms: None,
            first_token_seen: false,
            transit_tokens: 0,
            acct_prefill_tokens: 0,
            queued_est_ms: 0.0,
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

    /// Exact local load signals of region `r`'s engine, as its node reports them.
    fn local_stats(&self, r: usize) -> QueueStats {
        let s = self.regions[r].engine.stats();
        let (t_p_ms, base_ms, version, epoch) = match self.nodes.get(r) {
            Some(n) => (
                n.fit.t_p_ms(),
                n.fit.base_ms(),
                n.stats_version,
                n.tuner.as_ref().map_or(0, |t| t.epoch()),
            ),
            None => {
                let p = &self.cfg.profiles[r];
                (p.t_p_ms_per_token, p.idle_ttft_ms(0), 0, 0)
            }
        };
        if self.cfg.live_node_stats && self.oracle.is_none() {
            // EngineAdapter::queue_stats: scraped engine state made fresher by the
            // node's own accounting.
            let reg = &self.regions[r];
            let m = reg.scraped.clone().unwrap_or_default();
            let running = m.running as u64;
            let waiting = (m.waiting as u64).max(reg.acct_inflight.saturating_sub(running));
            let unfinished = reg
                .acct_unprefilled_tokens
                .max((m.waiting as u64).saturating_mul(reg.acct_mean_prompt));
            return QueueStats {
                version,
                unfinished_prefill_tokens: unfinished,
                running: running.min(u32::MAX as u64) as u32,
                waiting: waiting.min(u32::MAX as u64) as u32,
                kv_used_tokens: m.used_tokens,
                kv_capacity_tokens: s.capacity,
                queued_prompt_tokens: reg.queued_prompt_tokens,
                t_p_ms,
                base_ms,
                decode_step_ms: LIVE_DECODE_STEP_MS,
                epoch,
            };
        }
        QueueStats {
            version,
            unfinished_prefill_tokens: s.unfinished_prefill_tokens,
            running: s.running.min(u32::MAX as usize) as u32,
            waiting: s.waiting.min(u32::MAX as usize) as u32,
            kv_used_tokens: s.used_tokens,
            kv_capacity_tokens: s.capacity,
            queued_prompt_tokens: self.regions[r].queued_prompt_tokens,
            t_p_ms,
            base_ms,
            decode_step_ms: s.decode_step_ms,
            epoch,
        }
    }

    /// Candidates as node `at_node` sees them (distributed), or as the oracle sees
    /// them from `at_node` (exact). Returns candidates and their region indices.
    fn candidates(&self, at_node: usize, chain: &HashChain) -> (Vec<Candidate>, Vec<usize>) {
        let n = self.names.len();
        let mut cands = Vec::with_capacity(n);
        let mut regions = Vec::with_capacity(n);
        if let Some(o) = &self.oracle {
            for r in 0..n {
                let mut c = Candidate::idle(
                    self.node_ids[r].clone(),
                    r == at_node,
                    self.cfg.network.rtt_ms(at_node, r),
                );
                c.cached_tokens = o.index[r].longest_match(chain);
                c.stats = self.local_stats(r);
                c.inflight_forwards = o.in_transit[r].0;
                c.inflight_forward_prompt_tokens = o.in_transit[r].1;
                cands.push(c);
                regions.push(r);
            }
            return (cands, regions);
        }
        let node = &self.nodes[at_node];
        let mut local = Candidate::idle(node.id.clone(), true, 0.0);
        local.cached_tokens = node.shadow.longest_match(chain);
        local.stats = self.local_stats(at_node);
        cands.push(local);
        regions.push(at_node);
        for p in 0..n {
            if p == at_node {
                continue;
            }
            // Like the live node: a peer is a candidate once its stats have arrived.
            let Some(stats) = &node.peer_stats[p] else {
                continue;
            };
            let mut c = Candidate::idle(
                self.node_ids[p].clone(),
                false,
                self.cfg.network.rtt_ms(at_node, p),
            );
            c.cached_tokens = node.peer_summaries[p].matched_tokens(chain);
            c.stats = stats.clone();
            node.ledger.apply(&mut c);
            cands.push(c);
            regions.push(p);
        }
        (cands, regions)
    }

    /// Decide where a request that is at node `r` is served, and send it there.
    fn route(&mut self, slot: u32, now: f64) {
        let r = self.flight(slot).home as usize;
        self.route_at(slot, r, now);
    }

    fn route_at(&mut self, slot: u32, r: usize, now: f64) {
        let f = self.flight(slot);
        let hops = f.hops;
        let prompt_tokens = f.prompt_tokens;
        let session = f.session_key;
        // Take the chain out while deciding (borrows), then put it back.
        let chain = std::mem::take(&mut self.flight_mut(slot).chain);
        let (cands, cand_regions) = self.candidates(r, &chain);
        let weights = match (&self.oracle, self.nodes.get(r)) {
            (None, Some(n)) => n
                .tuner
                .as_ref()
                .map_or(self.kind.default_weights(), |t| t.weights()),
            _ => self.kind.default_weights(),
        };
        let epoch = self
            .nodes
            .get(r)
            .and_then(|n| n.tuner.as_ref())
            .map_or(0, |t| t.epoch());
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
        let predicted = outcome.as_ref().ok().and_then(|d| {
            d.candidates
                .iter()
                .find(|c| c.chosen)
                .and_then(|c| c.terms?.estimated_ttft_ms)
        });
        let target = outcome.map(|d| {
            (
                cand_regions[d.target_index],
                cands[d.target_index].cached_tokens,
            )
        });
        if hops == 0 {
            let f = self.flight_mut(slot);
            f.epoch = epoch;
            f.predicted_ttft_ms = predicted.map(|v| v as f32);
        }
        match target {
            Err(_) => {
                self.flight_mut(slot).chain = chain;
                self.fail(slot, now, "no candidate can serve");
            }
            Ok((t, _)) if t == r => {
                self.flight_mut(slot).chain = chain;
                self.dispatch(slot, r, now);
            }
            Ok((t, believed_cached)) => {
                let uncached = prompt_tokens.saturating_sub(believed_cached);
                match self.oracle.as_mut() {
                    Some(o) => {
                        o.in_transit[t].0 += 1;
                        o.in_transit[t].1 += uncached;
                    }
                    None => {
                        let peer = self.node_ids[t].clone();
                        self.nodes[r]
                            .ledger
                            .record_forward(&peer, uncached, now as u64);
                    }
                }
                let f = self.flight_mut(slot);
                f.chain = chain;
                f.transit_tokens = uncached;
                f.hops += 1;
                f.served = Some(t as u8);
                let at = now + self.link_delay(r, t);
                self.push(at, Ev::ForwardArrival(slot));
            }
        }
    }

    fn forward_arrival(&mut self, slot: u32, now: f64) {
        let t = self.flight(slot).served.expect("set when forwarded") as usize;
        if let Some(o) = self.oracle.as_mut() {
            // The oracle serves where it decided; nothing is in transit any more.
            let uncached = self.flights[slot as usize]
                .as_ref()
                .expect("live")
                .transit_tokens;
            o.in_transit[t].0 = o.in_transit[t].0.saturating_sub(1);
            o.in_transit[t].1 = o.in_transit[t].1.saturating_sub(uncached);
            self.dispatch(slot, t, now);
        } else {
            self.route_at(slot, t, now);
        }
    }

    /// Submit a request to region `r`'s engine.
    fn dispatch(&mut self, slot: u32, r: usize, now: f64) {
        let nowu = now as u64;
        let queued_est_ms = gorgo_core::cost::queue_ms(&Candidate {
            stats: self.local_stats(r),
            ..Candidate::idle("local", true, 0.0)
        })
        .0;
        let f = self.flights[slot as usize].as_mut().expect("live");
        f.queued_est_ms = queued_est_ms;
        f.served = Some(r as u8);
        f.dispatched_ms = now;
        let req = EngineRequest {
            id: slot as u64,
            chain: f.chain.clone(),
            prompt_tokens: f.prompt_tokens,
            max_output_tokens: f.output_tokens,
            arrival_ms: now,
        };
        let prompt_tokens = f.prompt_tokens;
        // The live node accounts the prefill work it expects: the prompt less the
        // prefix its shadow index believes cached, looked up before inserting.
        let prefill_tokens = match self.oracle.as_mut() {
            Some(o) => {
                o.index[r].insert(&f.chain, nowu);
                prompt_tokens
            }
            None => {
                let shadow = &mut self.nodes[r].shadow;
                let cached = shadow.longest_match(&f.chain).min(prompt_tokens);
                shadow.insert(&f.chain, nowu);
                prompt_tokens - cached
            }
        };
        f.acct_prefill_tokens = prefill_tokens;
        let region = &mut self.regions[r];
        match region.engine.submit(req, now) {
            Ok(()) => {
                region.queued_prompt_tokens += prompt_tokens;
                region.acct_inflight += 1;
                region.acct_unprefilled_tokens += prompt_tokens;
                region.acct_mean_prompt =
                    ((region.acct_mean_prompt * 7 + prompt_tokens) / 8).max(1);
            }
            Err(reason) => {
                let msg = format!("engine refused: {reason}");
                self.fail(slot, now, &msg);
            }
        }
        self.drain_engine(r, now);
    }

    fn engine_wake(&mut self, r: usize, now: f64) {
        if self.regions[r].wake_at != Some(now) {
            return; // superseded
        }
        self.regions[r].wake_at = None;
        self.drain_engine(r, now);
    }

    /// Handle what region `r`'s engine did up to `now` and schedule its next wakeup.
    fn drain_engine(&mut self, r: usize, now: f64) {
        let mut events = std::mem::take(&mut self.engine_events);
        self.regions[r].engine.step_into(now, &mut events);
        for ev in events.drain(..) {
            match ev {
                EngineEvent::FirstToken {
                    id,
                    at_ms,
                    cached_tokens,
                } => self.first_token(r, id as u32, at_ms, cached_tokens),
                EngineEvent::Finished { id, at_ms, .. } => self.finished(r, id as u32, at_ms),
                // Refusals are handled where `submit` returns them; decode steps are off.
                EngineEvent::Rejected { .. } | EngineEvent::DecodeStep { .. } => {}
            }
        }
        self.engine_events = events;
        let s = self.regions[r].engine.stats();
        let c = &mut self.out.run.counters;
        c.max_used_tokens[r] = c.max_used_tokens[r].max(s.used_tokens);
        c.max_cached_tokens[r] = c.max_cached_tokens[r].max(s.cached_tokens);
        let next = self.regions[r].engine.next_event_time();
        if let Some(t) = next {
            let t = t.max(now);
            if self.regions[r].wake_at != Some(t) {
                self.regions[r].wake_at = Some(t);
                self.push(t, Ev::EngineWake(r as u8));
            }
        }
    }

    fn valid_on(&self, slot: u32, r: usize) -> bool {
        self.flights
            .get(slot as usize)
            .and_then(|f| f.as_ref())
            .is_some_and(|f| f.served == Some(r as u8))
    }

    fn first_token(&mut self, r: usize, slot: u32, at: f64, cached: u64) {
        if !self.valid_on(slot, r) || self.flight(slot).first_token_seen {
            self.out.run.counters.unexpected_events += 1;
            return;
        }
        self.out.run.counters.first_tokens += 1;
        let home = self.flight(slot).home as usize;
        let back = self.link_delay(r, home) + self.client_delay(home);
        let f = self.flight_mut(slot);
        f.first_token_seen = true;
        f.cached_tokens = cached;
        f.ttft_ms = at + back - f.send_ms;
        let engine_ttft = at - f.dispatched_ms;
        let queued_est_ms = f.queued_est_ms;
        let uncached = f.prompt_tokens.saturating_sub(cached);
        let prefill = f.acct_prefill_tokens;
        let reg = &mut self.regions[r];
        reg.acct_unprefilled_tokens = reg.acct_unprefilled_tokens.saturating_sub(prefill);
        match self.oracle.as_mut() {
            Some(o) => {
                let f = self.flights[slot as usize].as_ref().expect("live");
                o.index[r].correct(&f.chain, cached, at as u64);
            }
            None => {
                self.nodes[r]
                    .fit
                    .observe_after_wait(engine_ttft, 0.0, queued_est_ms, uncached);
            }
        }
    }

    fn finished(&mut self, r: usize, slot: u32, at: f64) {
        if !self.valid_on(slot, r) || !self.flight(slot).first_token_seen {
            self.out.run.counters.unexpected_events += 1;
            return;
        }
        self.out.run.counters.finishes += 1;
        let f = self.flight(slot);
        let (home, prompt, out_tokens) = (f.home as usize, f.prompt_tokens, f.output_tokens);
        self.regions[r].queued_prompt_tokens -= prompt;
        self.regions[r].acct_inflight -= 1;
        let mut back = self.client_delay(home);
        if r != home {
            back += self.link_delay(r, home);
            if let Some(rate) = self.cfg.network.rate_mbps {
                back += out_tokens as f64 * SSE_BYTES_PER_TOKEN * 8.0 / (rate * 1000.0);
            }
        }
        self.push(at + back, Ev::Complete(slot));
    }

    fn release(&mut self, slot: u32) -> Flight {
        let f = self.flights[slot as usize].take().expect("live");
        self.free.push(slot);
        self.live -= 1;
        f
    }

    fn fail(&mut self, slot: u32, now: f64, why: &str) {
        let f = self.release(slot);
        self.out.push(Row {
            index: f.index,
            home: f.home,
            served: None,
            hops: f.hops,
            ok: false,
            error: Some(why.into()),
            ttft_ms: 0.0,
            e2e_ms: (now - f.send_ms) as f32,
            start_ms: f.send_ms,
            input_tokens: f.prompt_tokens.min(u32::MAX as u64) as u32,
            output_tokens: 0,
            cached_tokens: 0,
            predicted_ttft_ms: f.predicted_ttft_ms,
        });
    }

    fn complete(&mut self, slot: u32, now: f64) {
        let f = self.release(slot);
        let e2e = now - f.send_ms;
        if let Some(t) = self
            .nodes
            .get_mut(f.home as usize)
            .and_then(|n| n.tuner.as_mut())
        {
            t.record(f.epoch, f.ttft_ms, e2e);
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
            start_ms: f.send_ms,
            input_tokens: f.prompt_tokens.min(u32::MAX as u64) as u32,
            output_tokens: f.output_tokens,
            cached_tokens: f.cached_tokens.min(u32::MAX as u64) as u32,
            predicted_ttft_ms: f.predicted_ttft_ms,
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

    /// Node `r` gossips its stats and summary to every peer and runs its tuner.
    fn tick(&mut self, r: usize, now: f64) {
        let n = self.names.len();
        self.nodes[r].stats_version += 1;
        let stats = self.local_stats(r);
        for p in 0..n {
            if p == r {
                continue;
            }
            let node = &self.nodes[r];
            let summary = node.shadow.summary();
            let (delta, snapshot) = match node.sent_version[p].and_then(|v| summary.delta_since(v))
            {
                Some(d) => (Some(d), None),
                None => (None, Some(summary.snapshot())),
            };
            let bytes = 96
                + delta.as_ref().map_or(0, |d| d.encoded_len())
                + snapshot.as_ref().map_or(0, |s| s.encoded_len());
            let version = summary.version();
            let delay = self.link_delay(r, p) + self.cfg.gossip_extra_delay_ms;
            let node = &mut self.nodes[r];
            node.sent_version[p] = Some(version);
            // One QUIC stream per peer: deliveries keep their order.
            let at = (now + delay).max(node.last_gossip_at[p]);
            node.last_gossip_at[p] = at;
            self.out.run.counters.gossip_messages += 1;
            self.out.run.counters.gossip_bytes += bytes as u64;
            self.send(
                r,
                p,
                Payload::Gossip {
                    stats: stats.clone(),
                    delta,
                    snapshot,
                },
                at,
            );
        }
        let outputs = match self.nodes[r].tuner.as_mut() {
            Some(t) => t.tick(now as u64),
            None => Vec::new(),
        };
        self.tuning_outputs(r, outputs, now);
        if !(self.trace_done && self.live == 0) {
            self.push(now + self.cfg.gossip_interval_ms, Ev::Tick(r as u8));
        }
    }

    fn deliver(&mut self, id: u32, now: f64) {
        let m = self.messages[id as usize].take().expect("live message");
        self.free_messages.push(id);
        let (from, to) = (m.from as usize, m.to as usize);
        match m.payload {
            Payload::Gossip {
                stats,
                delta,
                snapshot,
            } => {
                let rtt = self.cfg.network.rtt_ms(to, from);
                let peer = self.node_ids[from].clone();
                let node = &mut self.nodes[to];
                node.ledger
                    .observe_stats(&peer, stats.version, now as u64, rtt);
                node.peer_stats[from] = Some(stats);
                let gap = match (delta, snapshot) {
                    (Some(d), _) => node.peer_summaries[from].apply_delta(&d).is_err(),
                    (None, Some(s)) => {
                        node.peer_summaries[from].apply_snapshot(s);
                        false
                    }
                    (None, None) => false,
                };
                if gap {
                    // The receiver asks for a snapshot; the sender's next tick sends one.
                    self.nodes[from].sent_version[to] = None;
                }
            }
            Payload::Proposal(p) => {
                let outputs = match self.nodes[to].tuner.as_mut() {
                    Some(t) => t.handle_proposal(p),
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
                    record,
                }),
            }
        }
    }

    fn finish(mut self) -> PolicyRun {
        let c = &mut self.out.run.counters;
        c.fitted_t_p_ms = self.nodes.iter().map(|n| n.fit.t_p_ms()).collect();
        c.fitted_base_ms = self.nodes.iter().map(|n| n.fit.base_ms()).collect();
        self.out.run
    }
}
