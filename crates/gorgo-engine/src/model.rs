//! The sans-IO engine model: an SGLang-like scheduler over a radix prefix cache.
//!
//! One [`Engine`] is one inference server. Requests go in with [`Engine::submit`]
//! (or [`Engine::submit_at`], which queues by an earlier arrival stamp);
//! the driver calls [`Engine::step`] at (or after) [`Engine::next_event_time`] and gets
//! the events that happened up to then. Time is an argument (`f64` milliseconds on any
//! clock), so the emulator runs this on the real clock and the simulator on virtual time.
//!
//! Each scheduler iteration is either a prefill batch (up to `chunked_prefill_size` new
//! prompt tokens, FCFS over admitted requests, long prompts chunked) or one decode step
//! for every request past its prefill; when both kinds of work exist they alternate
//! (or prefill goes first: the profile's [`Schedule`]).
//! Admission is FCFS into the next prefill batch (as SGLang's `PrefillAdder`: no more
//! than `chunked_prefill_size` new tokens ahead) and bounded by `max_running_requests`
//! and by KV capacity: a request reserves its uncached prompt plus its whole output
//! budget, evicting unreferenced cached blocks LRU-first if it must.

use std::collections::VecDeque;

use gorgo_core::HashChain;

use crate::cache::{PrefixMatch, RadixCache};
use crate::{Profile, Schedule};

/// One request as the engine sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineRequest {
    /// Caller-chosen id, unique among live requests; events carry it back.
    pub id: u64,
    /// The prompt as chained block hashes (what the prefix cache matches on).
    pub chain: HashChain,
    /// Prompt tokens. Tokens past the chain's end are computed but never cached.
    pub prompt_tokens: u64,
    /// Output tokens to generate (the first one comes out of the prefill).
    pub max_output_tokens: u32,
    /// When the request reached the engine, ms: the waiting queue's FCFS order.
    /// [`Engine::submit`] and [`Engine::submit_at`] set it from their arguments.
    pub arrival_ms: f64,
}

/// Why a request was refused at submission.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RejectReason {
    /// Prompt plus output exceed the profile's `context_length`.
    #[error("{requested} tokens requested, context length is {limit}")]
    ContextLength {
        /// Prompt plus output tokens asked for.
        requested: u64,
        /// The profile's context length.
        limit: u64,
    },
    /// Prompt plus output could never fit in the KV cache.
    #[error("{requested} tokens requested, KV capacity is {capacity}")]
    OverCapacity {
        /// Prompt plus output tokens asked for.
        requested: u64,
        /// The profile's `max_total_tokens`.
        capacity: u64,
    },
    /// The waiting queue is at its configured limit.
    #[error("waiting queue full ({limit} requests)")]
    QueueFull {
        /// The configured limit.
        limit: usize,
    },
}

/// What happened inside the engine, in time order.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// Prefill finished: the first output token exists.
    FirstToken {
        /// Request id.
        id: u64,
        /// When, ms.
        at_ms: f64,
        /// Prompt tokens served from the prefix cache.
        cached_tokens: u64,
    },
    /// One decode step produced one more token for each of `ids` (only when
    /// decode-step events are enabled, see [`Engine::set_emit_decode_steps`]).
    DecodeStep {
        /// Requests that got a token.
        ids: Vec<u64>,
        /// When, ms.
        at_ms: f64,
    },
    /// The request produced its last token and released its resources.
    Finished {
        /// Request id.
        id: u64,
        /// When, ms.
        at_ms: f64,
        /// Output tokens produced.
        output_tokens: u32,
    },
    /// The request was refused at submission (also returned by `submit`).
    Rejected {
        /// Request id.
        id: u64,
        /// Why.
        reason: RejectReason,
    },
}

/// A snapshot of the engine's load, as `/metrics` and the router's queue stats need it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    /// Requests admitted and not finished.
    pub running: usize,
    /// Requests waiting for admission.
    pub waiting: usize,
    /// KV tokens in use and not reclaimable, as SGLang counts `num_used_tokens`:
    /// running requests' reservations plus cached blocks they reference (unreferenced
    /// cached blocks are free to evict, so they do not count).
    pub used_tokens: u64,
    /// KV capacity in tokens.
    pub capacity: u64,
    /// Tokens held by the prefix cache (referenced or not).
    pub cached_tokens: u64,
    /// Cached tokens no running request references (reclaimable).
    pub evictable_tokens: u64,
    /// Prompt tokens not yet prefilled: running remainders plus whole waiting prompts.
    pub unfinished_prefill_tokens: u64,
    /// Cached / total prompt tokens over every admitted request so far.
    pub cache_hit_rate: f64,
    /// Prompt tokens of every admitted request.
    pub prompt_tokens_total: u64,
    /// Of which served from the cache.
    pub cached_prompt_tokens_total: u64,
    /// Output tokens produced.
    pub generation_tokens_total: u64,
    /// Requests finished.
    pub finished_total: u64,
    /// Cost of a decode step over the current decoding batch, ms.
    pub decode_step_ms: f64,
    /// Requests currently past prefill and decoding.
    pub decoding: usize,
    /// Context tokens (prompt + generated) summed over the decoding requests.
    pub decode_context_tokens: u64,
}

#[derive(Debug)]
struct Waiting {
    req: EngineRequest,
    ready_ms: f64,
}

#[derive(Debug)]
struct Running {
    req: EngineRequest,
    /// Prompt tokens reported as served from cache.
    cached_tokens: u64,
    /// Prompt tokens computed or cached so far.
    computed: u64,
    /// Leading chain blocks this request references in the cache.
    held_blocks: usize,
    /// Tokens of those blocks, as far as the cache holds them.
    held_tokens: u64,
    /// Tokens of the last held block its cached node lacks (a shorter prompt cached
    /// it): computed by this request, they grow the node once its prefill has them.
    short_tail: u64,
    /// KV tokens reserved outside the cache (uncached prompt not yet cached + output).
    reserved: u64,
    /// Tokens of this request in the prefill batch now running.
    chunk: u64,
    /// Output tokens produced.
    generated: u32,
}

impl Running {
    fn prefilling(&self) -> bool {
        self.computed < self.req.prompt_tokens
    }
    fn decoding(&self) -> bool {
        !self.prefilling() && self.generated >= 1 && self.generated < self.req.max_output_tokens
    }
}

/// What a request admitted now takes ([`Engine::fit`]).
#[derive(Debug, Clone, Copy)]
struct Fit {
    /// Prompt tokens served from the cache.
    cached: u64,
    /// KV tokens it reserves outside the cache: uncached prompt and whole output.
    need: u64,
    /// KV tokens free before any eviction.
    free: u64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum IterationKind {
    Prefill,
    Decode,
}

#[derive(Debug, Clone, Copy)]
struct Iteration {
    kind: IterationKind,
    end_ms: f64,
}

/// A change of the engine's prefix cache, for its KV events (vLLM's `BlockStored` and
/// `BlockRemoved`), recorded when asked ([`Engine::set_record_cache_changes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheChange {
    /// Block `block` of request `request`'s chain entered the cache.
    Stored {
        /// The block's chained hash.
        hash: u64,
        /// The block before it, `None` for a first block.
        parent: Option<u64>,
        /// Tokens it holds.
        tokens: u32,
        /// The request whose prefill computed it.
        request: u64,
        /// Its index in that request's chain.
        block: usize,
    },
    /// The block left the cache (evicted).
    Removed {
        /// The block's chained hash.
        hash: u64,
    },
}

/// One inference engine: scheduler, KV accounting and prefix cache.
#[derive(Debug)]
pub struct Engine {
    profile: Profile,
    cache: RadixCache,
    waiting: VecDeque<Waiting>,
    waiting_prompt_tokens: u64,
    running: Vec<Running>,
    /// Empty buffer swapped with `running` when finished requests leave.
    spare: Vec<Running>,
    inflight: Option<Iteration>,
    last_was_prefill: bool,
    idle_since_ms: f64,
    /// When the latest iteration started (the latest admission decision), ms: the
    /// model's clock never goes back before it.
    decided_ms: f64,
    private_tokens: u64,
    events: Vec<EngineEvent>,
    max_waiting: Option<usize>,
    emit_decode_steps: bool,
    prompt_tokens_total: u64,
    cached_prompt_tokens_total: u64,
    generation_tokens_total: u64,
    finished_total: u64,
    /// Cache changes since the last take, when recorded.
    cache_changes: Option<Vec<CacheChange>>,
}

impl Engine {
    /// An idle engine with an empty cache.
    pub fn new(profile: Profile) -> Self {
        Engine {
            profile,
            cache: RadixCache::new(),
            waiting: VecDeque::new(),
            waiting_prompt_tokens: 0,
            running: Vec::new(),
            spare: Vec::new(),
            inflight: None,
            last_was_prefill: false,
            idle_since_ms: f64::NEG_INFINITY,
            decided_ms: f64::NEG_INFINITY,
            private_tokens: 0,
            events: Vec::new(),
            max_waiting: None,
            emit_decode_steps: true,
            prompt_tokens_total: 0,
            cached_prompt_tokens_total: 0,
            generation_tokens_total: 0,
            finished_total: 0,
            cache_changes: None,
        }
    }

    /// Record every change of the prefix cache (default off): what an engine
    /// publishing KV events tells. Take them with
    /// [`take_cache_changes`](Self::take_cache_changes) after each step.
    pub fn set_record_cache_changes(&mut self, on: bool) {
        self.cache_changes = on.then(Vec::new);
        self.cache.set_record_evictions(on);
    }

    /// The cache changes since the last call, in order.
    pub fn take_cache_changes(&mut self) -> Vec<CacheChange> {
        self.cache_changes
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Move the evictions just made into the change log, in order with the stores.
    fn record_evictions(&mut self) {
        let evicted = self.cache.take_evicted();
        if let Some(log) = &mut self.cache_changes {
            log.extend(
                evicted
                    .into_iter()
                    .map(|hash| CacheChange::Removed { hash }),
            );
        }
    }

    /// Tokens of the longest prefix of `chain` this engine's cache holds now. For
    /// diagnostics that need the truth no node has (the simulator's `cached_anywhere`).
    pub fn cached_prefix_tokens(&self, chain: &HashChain) -> u64 {
        self.cache
            .match_prefix(&chain.hashes, &chain.block_tokens)
            .tokens
    }

    /// Every block of this engine's cache: (chained hash, tokens), in no order. For
    /// diagnostics across engines (how many prefixes the cluster holds twice).
    pub fn cached_blocks(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.cache.blocks()
    }

    /// The profile this engine runs.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// Refuse submissions while `limit` requests wait (`None`: unbounded, the default).
    pub fn set_max_waiting(&mut self, limit: Option<usize>) {
        self.max_waiting = limit;
    }

    /// Whether to emit a [`EngineEvent::DecodeStep`] per decode step (default true).
    /// A simulator that only needs TTFT and E2E turns it off to stay allocation-light.
    pub fn set_emit_decode_steps(&mut self, emit: bool) {
        self.emit_decode_steps = emit;
    }

    /// Queue a request that arrives at `now_ms`. Refusals are returned and also
    /// emitted as [`EngineEvent::Rejected`].
    pub fn submit(&mut self, req: EngineRequest, now_ms: f64) -> Result<(), RejectReason> {
        self.submit_at(req, now_ms, now_ms)
    }

    /// Queue a request that arrived at `arrival_ms` but is handed over only at
    /// `now_ms`: a driver that stamps a request when it arrives and submits it after
    /// reading and hashing its body (the emulator) queues it by that stamp, so a burst
    /// keeps its arrival order whatever each request's handling cost.
    ///
    /// The waiting queue is FCFS by arrival stamp (equal stamps in submission order),
    /// and the request becomes schedulable `request_overhead_ms` after its stamp. The
    /// model never revisits a decision: a request whose schedulable time falls before
    /// the start of the latest iteration counts as schedulable at that start (it joins
    /// the next admission, not one already made). A stamp that is not finite counts as
    /// `now_ms`. `req.arrival_ms` is overwritten with the stamp used.
    pub fn submit_at(
        &mut self,
        mut req: EngineRequest,
        arrival_ms: f64,
        now_ms: f64,
    ) -> Result<(), RejectReason> {
        self.advance(now_ms);
        req.arrival_ms = if arrival_ms.is_finite() {
            arrival_ms
        } else {
            now_ms
        };
        req.prompt_tokens = req.prompt_tokens.max(1);
        req.max_output_tokens = req.max_output_tokens.max(1);
        // A chain may list more tokens than the prompt has (trace block ids pad the
        // last block): keep only the blocks inside the prompt, so cached tokens never
        // exceed it.
        let mut inside = 0u64;
        let keep = req
            .chain
            .block_tokens
            .iter()
            .take_while(|&&t| {
                inside += t as u64;
                inside <= req.prompt_tokens
            })
            .count();
        req.chain.hashes.truncate(keep);
        req.chain.block_tokens.truncate(keep);
        let queue_full = match self.max_waiting {
            Some(limit) if self.waiting.len() >= limit => Some(RejectReason::QueueFull { limit }),
            _ => None,
        };
        let refusal = self
            .profile
            .refusal(req.prompt_tokens, u64::from(req.max_output_tokens))
            .or(queue_full);
        if let Some(reason) = refusal {
            self.events.push(EngineEvent::Rejected {
                id: req.id,
                reason: reason.clone(),
            });
            return Err(reason);
        }
        self.waiting_prompt_tokens += req.prompt_tokens;
        let ready_ms = (req.arrival_ms + self.profile.request_overhead_ms).max(self.decided_ms);
        // FCFS by stamp: after every request stamped no later (the queue stays sorted).
        let at = self
            .waiting
            .partition_point(|w| w.req.arrival_ms <= req.arrival_ms);
        self.waiting.insert(at, Waiting { req, ready_ms });
        self.advance(now_ms);
        Ok(())
    }

    /// Drop a request (client gone): it leaves the queue or frees its slot, its KV
    /// reservation and its cache references now. Returns false if it was not live.
    /// An aborted request produces no further events.
    pub fn abort(&mut self, id: u64, now_ms: f64) -> bool {
        self.advance(now_ms);
        if let Some(i) = self.waiting.iter().position(|w| w.req.id == id) {
            let w = self.waiting.remove(i).expect("index from position");
            self.waiting_prompt_tokens -= w.req.prompt_tokens;
            return true;
        }
        if let Some(i) = self.running.iter().position(|r| r.req.id == id) {
            // `remove`, not `swap_remove`: prefill batches follow admission order.
            let r = self.running.remove(i);
            self.release(&r);
            // The iteration in flight still costs its time; if nothing is left to do
            // after it, the engine simply goes idle at its end.
            return true;
        }
        false
    }

    /// When the next thing happens (an iteration ends or a queued request becomes
    /// schedulable), ms; `None` when idle with nothing queued.
    pub fn next_event_time(&self) -> Option<f64> {
        match self.inflight {
            Some(it) => Some(it.end_ms),
            None => self
                .waiting
                .front()
                .map(|w| w.ready_ms.max(self.idle_since_ms).max(self.decided_ms)),
        }
    }

    /// Advance to `now_ms`, running every iteration that ends by then, and return the
    /// events that happened, in time order.
    pub fn step(&mut self, now_ms: f64) -> Vec<EngineEvent> {
        self.advance(now_ms);
        std::mem::take(&mut self.events)
    }

    /// Like [`step`](Self::step) but appends to `out`, so a hot loop reuses one buffer.
    pub fn step_into(&mut self, now_ms: f64, out: &mut Vec<EngineEvent>) {
        self.advance(now_ms);
        out.append(&mut self.events);
    }

    /// Current load and cache figures.
    pub fn stats(&self) -> EngineStats {
        let mut decoding = 0usize;
        let mut context = 0u64;
        let mut unfinished = self.waiting_prompt_tokens;
        for r in &self.running {
            unfinished += r.req.prompt_tokens - r.computed;
            if r.decoding() {
                decoding += 1;
                context += r.req.prompt_tokens + r.generated as u64;
            }
        }
        EngineStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            used_tokens: self.cache.cached_tokens() - self.cache.evictable_tokens()
                + self.private_tokens,
            capacity: self.profile.max_total_tokens,
            cached_tokens: self.cache.cached_tokens(),
            evictable_tokens: self.cache.evictable_tokens(),
            unfinished_prefill_tokens: unfinished,
            cache_hit_rate: if self.prompt_tokens_total == 0 {
                0.0
            } else {
                self.cached_prompt_tokens_total as f64 / self.prompt_tokens_total as f64
            },
            prompt_tokens_total: self.prompt_tokens_total,
            cached_prompt_tokens_total: self.cached_prompt_tokens_total,
            generation_tokens_total: self.generation_tokens_total,
            finished_total: self.finished_total,
            decode_step_ms: if decoding == 0 {
                0.0
            } else {
                self.profile.decode_step_ms(decoding, context)
            },
            decoding,
            decode_context_tokens: context,
        }
    }

    /// Run every iteration that ends by `now_ms`; start the next one when idle.
    fn advance(&mut self, now_ms: f64) {
        loop {
            match self.inflight {
                Some(it) if it.end_ms <= now_ms => {
                    self.inflight = None;
                    self.complete(it);
                    self.idle_since_ms = it.end_ms;
                    self.start_iteration(it.end_ms);
                }
                Some(_) => return,
                None => {
                    let Some(head) = self.waiting.front() else {
                        return;
                    };
                    let start = head.ready_ms.max(self.idle_since_ms).max(self.decided_ms);
                    if start > now_ms {
                        return;
                    }
                    self.start_iteration(start);
                    if self.inflight.is_none() {
                        // Nothing could start. With nothing in flight nothing runs, and
                        // an idle engine admits any request the profile accepts
                        // (`admit`), so this cannot happen; do not spin if it did.
                        debug_assert!(false, "idle engine with a ready request it cannot admit");
                        return;
                    }
                }
            }
        }
    }

    /// Admit what fits, then start a prefill batch or a decode step at `t`.
    fn start_iteration(&mut self, t: f64) {
        debug_assert!(
            t >= self.decided_ms,
            "iteration at {t} before {}",
            self.decided_ms
        );
        self.decided_ms = self.decided_ms.max(t);
        self.admit(t);
        let has_prefill = self.running.iter().any(Running::prefilling);
        let has_decode = self.running.iter().any(Running::decoding);
        let prefill_turn = match self.profile.schedule {
            Schedule::Alternate => !self.last_was_prefill,
            Schedule::PrefillFirst => true,
        };
        let kind = if has_prefill && (!has_decode || prefill_turn) {
            IterationKind::Prefill
        } else if has_decode {
            IterationKind::Decode
        } else {
            return;
        };
        let cost = match kind {
            IterationKind::Prefill => {
                let mut budget = self.profile.chunked_prefill_size;
                let mut total = 0;
                for r in self.running.iter_mut().filter(|r| r.prefilling()) {
                    if budget == 0 {
                        break;
                    }
                    let take = (r.req.prompt_tokens - r.computed).min(budget);
                    r.chunk = take;
                    budget -= take;
                    total += take;
                }
                self.profile.prefill_batch_ms(total)
            }
            IterationKind::Decode => {
                let (mut batch, mut context) = (0usize, 0u64);
                for r in self.running.iter().filter(|r| r.decoding()) {
                    batch += 1;
                    context += r.req.prompt_tokens + r.generated as u64;
                }
                self.profile.decode_step_ms(batch, context)
            }
        };
        self.last_was_prefill = kind == IterationKind::Prefill;
        self.inflight = Some(Iteration {
            kind,
            end_ms: t + cost,
        });
    }

    /// FCFS admission of ready waiting requests into the next prefill batch, while
    /// slots and KV allow.
    ///
    /// As in SGLang's `PrefillAdder`, a request leaves the waiting queue (and reserves
    /// KV) only when the next prefill batch has room for its first tokens: the batch
    /// takes at most `chunked_prefill_size` new tokens, and the last request admitted
    /// may be chunked over later batches. Admitting further ahead would hold KV for
    /// prompts whose prefill has not begun, evicting cached prefixes at saturation.
    fn admit(&mut self, t: f64) {
        let mut batch_tokens: u64 = self
            .running
            .iter()
            .filter(|r| r.prefilling())
            .map(|r| r.req.prompt_tokens - r.computed)
            .sum();
        while self.running.len() < self.profile.max_running_requests as usize
            && batch_tokens < self.profile.chunked_prefill_size
        {
            let Some(head) = self.waiting.front() else {
                return;
            };
            if head.ready_ms > t {
                return;
            }
            let req = &head.req;
            let full = self
                .cache
                .match_prefix(&req.chain.hashes, &req.chain.block_tokens);
            let mut plan = self.fit(req, full).map(|fit| (full, fit));
            if plan.is_none() && full.long > 0 {
                // The last matched block's node holds more than the prompt's block (a
                // longer prompt with the same block id cached it): referencing it
                // would hold its unused tokens too, which within a block of the KV
                // capacity never fit, not even on an idle engine. The request computes
                // that block itself instead, as a radix cache would split the node and
                // evict its unused tail. Without the block it fits any engine that is
                // idle (the profile refuses prompt + output >= capacity), so the queue
                // never stalls.
                let last = req.chain.block_tokens[full.blocks - 1] as u64;
                let without = PrefixMatch {
                    blocks: full.blocks - 1,
                    tokens: full.tokens - last,
                    short: 0,
                    long: 0,
                };
                plan = self.fit(req, without).map(|fit| (without, fit));
            }
            let Some((m, Fit { cached, need, free })) = plan else {
                return;
            };
            let (matched, matched_tokens) = (m.blocks, m.tokens);
            let head = self.waiting.pop_front().expect("front exists");
            let req = head.req;
            for &h in &req.chain.hashes[..matched] {
                self.cache.acquire(h);
            }
            if free < need {
                self.cache.evict(need - free);
                self.record_evictions();
            }
            self.private_tokens += need;
            batch_tokens += req.prompt_tokens - cached;
            self.waiting_prompt_tokens -= req.prompt_tokens;
            self.prompt_tokens_total += req.prompt_tokens;
            self.cached_prompt_tokens_total += cached;
            self.running.push(Running {
                cached_tokens: cached,
                computed: cached,
                held_blocks: matched,
                held_tokens: matched_tokens,
                short_tail: m.short as u64,
                reserved: need,
                chunk: 0,
                generated: 0,
                req,
            });
        }
    }

    /// What admitting `req` with the cached prefix `m` takes, or `None` when it does
    /// not fit now, even after evicting every unreferenced block it does not use.
    fn fit(&self, req: &EngineRequest, m: PrefixMatch) -> Option<Fit> {
        // A fully cached prompt still computes its last token (as SGLang does).
        let cached = m.tokens.min(req.prompt_tokens - 1);
        let need = req.prompt_tokens - cached + req.max_output_tokens as u64;
        // What referencing the matched blocks takes out of the evictable total:
        // the cached nodes' tokens, whatever the request's own block sizes.
        let unreferenced_matched: u64 = req.chain.hashes[..m.blocks]
            .iter()
            .filter(|h| self.cache.refs(**h) == 0)
            .map(|h| self.cache.tokens(*h) as u64)
            .sum();
        let used = self.cache.cached_tokens() + self.private_tokens;
        let free = self.profile.max_total_tokens.saturating_sub(used);
        // Saturating: a hash repeated within a chain counts twice above.
        let reclaimable = self
            .cache
            .evictable_tokens()
            .saturating_sub(unreferenced_matched);
        (free + reclaimable >= need).then_some(Fit { cached, need, free })
    }

    /// Apply the effects of an iteration that just ended.
    fn complete(&mut self, it: Iteration) {
        let at_ms = it.end_ms;
        let mut finished = false;
        match it.kind {
            IterationKind::Prefill => {
                for r in self.running.iter_mut().filter(|r| r.chunk > 0) {
                    r.computed += r.chunk;
                    r.chunk = 0;
                    let chain = &r.req.chain;
                    // A held block cached short by a shorter prompt: once computed in
                    // full here, the node grows to it and the reservation gives the
                    // tokens to the cache. (Another request may have grown it first;
                    // then the cache gains less than the reservation gives back, as
                    // when a block is computed twice.) No KV event tells it: vLLM's
                    // events have no such change, and a byte-hashed block never grows
                    // (its hash covers its bytes).
                    if r.short_tail > 0 && r.held_tokens + r.short_tail <= r.computed {
                        let b = r.held_blocks - 1;
                        self.cache.grow(chain.hashes[b], chain.block_tokens[b]);
                        r.held_tokens += r.short_tail;
                        r.reserved -= r.short_tail;
                        self.private_tokens -= r.short_tail;
                        r.short_tail = 0;
                    }
                    // Cache every block now fully computed, below a whole parent.
                    while r.short_tail == 0 && r.held_blocks < chain.len() {
                        let tokens = chain.block_tokens[r.held_blocks] as u64;
                        if r.held_tokens + tokens > r.computed {
                            break;
                        }
                        let parent = r.held_blocks.checked_sub(1).map(|p| chain.hashes[p]);
                        let hash = chain.hashes[r.held_blocks];
                        let added = self.cache.insert(hash, parent, tokens as u32);
                        if let (true, Some(log)) = (added, &mut self.cache_changes) {
                            log.push(CacheChange::Stored {
                                hash,
                                parent,
                                tokens: tokens as u32,
                                request: r.req.id,
                                block: r.held_blocks,
                            });
                        }
                        r.held_blocks += 1;
                        r.held_tokens += tokens;
                        r.reserved -= tokens;
                        self.private_tokens -= tokens;
                    }
                    if !r.prefilling() {
                        r.generated = 1;
                        self.generation_tokens_total += 1;
                        self.events.push(EngineEvent::FirstToken {
                            id: r.req.id,
                            at_ms,
                            cached_tokens: r.cached_tokens,
                        });
                        finished |= r.generated >= r.req.max_output_tokens;
                    }
                }
            }
            IterationKind::Decode => {
                let mut ids = Vec::new();
                for r in self.running.iter_mut().filter(|r| r.decoding()) {
                    r.generated += 1;
                    self.generation_tokens_total += 1;
                    if self.emit_decode_steps {
                        ids.push(r.req.id);
                    }
                    finished |= r.generated >= r.req.max_output_tokens;
                }
                if self.emit_decode_steps && !ids.is_empty() {
                    self.events.push(EngineEvent::DecodeStep { ids, at_ms });
                }
            }
        }
        if finished {
            // Order-preserving compaction through a reused buffer.
            let mut all = std::mem::take(&mut self.running);
            let mut kept = std::mem::take(&mut self.spare);
            for r in all.drain(..) {
                if !r.prefilling() && r.generated >= r.req.max_output_tokens {
                    self.events.push(EngineEvent::Finished {
                        id: r.req.id,
                        at_ms,
                        output_tokens: r.generated,
                    });
                    self.finished_total += 1;
                    self.release(&r);
                } else {
                    kept.push(r);
                }
            }
            self.running = kept;
            self.spare = all;
        }
    }

    /// Give back a request's cache references and KV reservation.
    fn release(&mut self, r: &Running) {
        for &h in r.req.chain.hashes[..r.held_blocks].iter().rev() {
            self.cache.release(h);
        }
        self.private_tokens -= r.reserved;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Round costs: prefill 10 ms + 0.01 ms/token, decode 5 ms; one request at a time.
    fn profile(overhead_ms: f64, max_running: u32) -> Profile {
        let mut p = Profile::by_name("h200-mistral7b").expect("built-in profile");
        p.request_overhead_ms = overhead_ms;
        p.prefill_base_ms = 10.0;
        p.t_p_ms_per_token = 0.01;
        p.decode_base_ms = 5.0;
        p.per_seq_ms = 0.0;
        p.per_ctx_token_ms = 0.0;
        p.max_running_requests = max_running;
        p
    }

    fn request(id: u64, tokens: usize) -> EngineRequest {
        let bytes: Vec<u8> = (0..tokens * 4)
            .map(|i| (i as u64 * 31 + id) as u8)
            .collect();
        let chain = HashChain::from_bytes(&bytes, 64, 4);
        EngineRequest {
            id,
            prompt_tokens: chain.total_tokens(),
            chain,
            max_output_tokens: 2,
            arrival_ms: f64::NAN,
        }
    }

    fn drain(engine: &mut Engine) -> Vec<EngineEvent> {
        let mut events = Vec::new();
        while let Some(t) = engine.next_event_time() {
            engine.step_into(t, &mut events);
        }
        events
    }

    /// (id, at_ms) of every first token, in event order.
    fn first_tokens(events: &[EngineEvent]) -> Vec<(u64, f64)> {
        events
            .iter()
            .filter_map(|e| match e {
                EngineEvent::FirstToken { id, at_ms, .. } => Some((*id, *at_ms)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn submissions_out_of_order_are_admitted_by_arrival_stamp() {
        // One slot: the first admitted runs alone until done, so the order shows.
        let mut engine = Engine::new(profile(20.0, 1));
        // The large request (id 1) arrived first but its submit comes last, as when
        // its handler spent longer reading and hashing the body.
        engine.submit_at(request(2, 50), 1.0, 3.0).unwrap();
        engine.submit_at(request(1, 3000), 0.0, 4.0).unwrap();
        let firsts = first_tokens(&drain(&mut engine));
        assert_eq!(firsts.iter().map(|f| f.0).collect::<Vec<_>>(), [1, 2]);
        // Schedulable at stamp + overhead, not at submission + overhead.
        let expected = 0.0 + 20.0 + 10.0 + 0.01 * 3000.0;
        assert!((firsts[0].1 - expected).abs() < 1e-9, "{firsts:?}");
    }

    #[test]
    fn equal_stamps_keep_submission_order() {
        let mut engine = Engine::new(profile(20.0, 1));
        engine.submit_at(request(1, 50), 5.0, 6.0).unwrap();
        engine.submit_at(request(2, 50), 5.0, 7.0).unwrap();
        engine.submit_at(request(3, 50), 4.0, 8.0).unwrap();
        let firsts = first_tokens(&drain(&mut engine));
        assert_eq!(firsts.iter().map(|f| f.0).collect::<Vec<_>>(), [3, 1, 2]);
    }

    #[test]
    fn a_stamp_before_the_latest_decision_joins_the_next_admission() {
        // No overhead: a request stamped before the iteration in flight started
        // cannot join it after the fact; it waits for the next start.
        let mut engine = Engine::new(profile(0.0, 8));
        engine.submit_at(request(1, 1000), 10.0, 10.5).unwrap();
        // Request 1's prefill started at 10 and ends at 30.
        assert_eq!(engine.next_event_time(), Some(30.0));
        engine.submit_at(request(2, 1000), 5.0, 11.0).unwrap();
        let events = drain(&mut engine);
        let firsts = first_tokens(&events);
        assert_eq!(firsts[0], (1, 30.0));
        assert_eq!(firsts[1].0, 2);
        assert!(firsts[1].1 > 30.0, "{firsts:?}");
        // Time never goes back: events come in time order.
        let times: Vec<f64> = events
            .iter()
            .filter_map(|e| match e {
                EngineEvent::FirstToken { at_ms, .. }
                | EngineEvent::DecodeStep { at_ms, .. }
                | EngineEvent::Finished { at_ms, .. } => Some(*at_ms),
                EngineEvent::Rejected { .. } => None,
            })
            .collect();
        assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    }

    #[test]
    fn an_old_stamp_on_an_idle_engine_never_starts_before_its_last_iteration() {
        let mut engine = Engine::new(profile(0.0, 8));
        engine.submit(request(1, 1000), 0.0).unwrap();
        let first = drain(&mut engine);
        let Some(EngineEvent::Finished { at_ms: done, .. }) = first.last().cloned() else {
            panic!("request 1 finishes: {first:?}");
        };
        // Stamped before request 1 even finished, handed over much later.
        let now = done + 100.0;
        engine
            .submit_at(request(2, 1000), done - 10.0, now)
            .unwrap();
        // Its whole life fits before `now`: the events wait for the next step.
        assert_eq!(engine.next_event_time(), None);
        let firsts = first_tokens(&engine.step(now));
        // It starts when the engine went idle, never earlier.
        assert_eq!(firsts, [(2, done + 10.0 + 0.01 * 1000.0)]);
    }

    #[test]
    fn a_non_finite_stamp_counts_as_now() {
        let mut engine = Engine::new(profile(20.0, 1));
        engine.submit_at(request(1, 50), f64::NAN, 100.0).unwrap();
        engine
            .submit_at(request(2, 50), f64::INFINITY, 100.0)
            .unwrap();
        let firsts = first_tokens(&drain(&mut engine));
        assert_eq!(firsts.iter().map(|f| f.0).collect::<Vec<_>>(), [1, 2]);
        assert!((firsts[0].1 - (100.0 + 20.0 + 10.0 + 0.5)).abs() < 1e-9);
    }

    /// When request 1 first decodes and request 2 gets its first token, under `schedule`:
    /// request 1 (50 tokens) finishes its prefill in the first batch, request 2 (1,000
    /// tokens) needs ten chunks of 100 after it.
    fn first_decode_and_long_prefill(schedule: Schedule) -> (f64, f64) {
        let mut p = profile(0.0, 8);
        p.chunked_prefill_size = 100;
        p.schedule = schedule;
        let mut engine = Engine::new(p);
        let mut short = request(1, 50);
        short.max_output_tokens = 20;
        engine.submit(short, 0.0).unwrap();
        engine.submit(request(2, 1000), 0.0).unwrap();
        let events = drain(&mut engine);
        let decode = events.iter().find_map(|e| match e {
            EngineEvent::DecodeStep { ids, at_ms } if ids.contains(&1) => Some(*at_ms),
            _ => None,
        });
        let long_first = first_tokens(&events)
            .into_iter()
            .find(|f| f.0 == 2)
            .map(|f| f.1);
        (
            decode.expect("request 1 decodes"),
            long_first.expect("request 2 starts"),
        )
    }

    /// A trace-style request: block ids `ids` of 64 tokens over a prompt of `tokens`
    /// (its last block holds what is left), as the simulator builds them.
    fn trace_request(id: u64, ids: &[u64], tokens: u64, out: u32) -> EngineRequest {
        EngineRequest {
            id,
            chain: HashChain::from_int_block_ids(ids, 64, tokens),
            prompt_tokens: tokens,
            max_output_tokens: out,
            arrival_ms: f64::NAN,
        }
    }

    /// [`drain`], failing on a stall: nothing in flight while the queue's head is
    /// ready to start (an idle engine that would wait for ever).
    fn drain_or_stall(engine: &mut Engine) -> Result<Vec<EngineEvent>, String> {
        let mut events = Vec::new();
        while let Some(t) = engine.next_event_time() {
            engine.step_into(t, &mut events);
            if engine.inflight.is_none() && engine.next_event_time().is_some_and(|n| n <= t) {
                return Err(format!(
                    "stalled at {t} ms: {} waiting, {} running, {} cached",
                    engine.waiting.len(),
                    engine.running.len(),
                    engine.cache.cached_tokens()
                ));
            }
        }
        Ok(events)
    }

    /// A prompt whose shortened last block matches a block a longer prompt cached in
    /// full would hold that block's unused tokens too; within a block of the KV
    /// capacity they do not fit, even on an idle engine, which waited for ever. It
    /// computes that block itself instead, as a radix cache evicts a split node's
    /// unused tail.
    #[test]
    fn a_longer_cached_last_block_never_stalls_an_idle_engine() {
        let mut p = profile(0.0, 8);
        p.max_total_tokens = 130;
        let mut engine = Engine::new(p);
        // 128 prompt tokens (two full blocks) + 1 output: 129 of 130.
        engine
            .submit(trace_request(1, &[1, 2], 128, 1), 0.0)
            .unwrap();
        drain_or_stall(&mut engine).unwrap();
        assert_eq!(engine.stats().cached_tokens, 128);
        // The same two ids over 100 tokens (block 2 holds 36 of the cached 64) + 10
        // output: 110 of 130, which the profile accepts.
        engine
            .submit(trace_request(2, &[1, 2], 100, 10), 1_000.0)
            .unwrap();
        let events = drain_or_stall(&mut engine).unwrap();
        let cached = events.iter().find_map(|e| match e {
            EngineEvent::FirstToken {
                id: 2,
                cached_tokens,
                ..
            } => Some(*cached_tokens),
            _ => None,
        });
        assert_eq!(
            cached,
            Some(64),
            "block 1 reused, block 2 computed: {events:?}"
        );
        assert!(events
            .iter()
            .any(|e| matches!(e, EngineEvent::Finished { id: 2, .. })));
        let s = engine.stats();
        assert_eq!((s.used_tokens, s.running, s.waiting), (0, 0, 0));
        assert!(s.cached_tokens <= 130, "{s:?}");
    }

    proptest::proptest! {
        /// Whatever the requests and however tight the KV capacity (down to one token
        /// over the largest request, which the profile accepts), an engine never sits
        /// idle with a request ready to start, and every request finishes.
        #[test]
        fn an_idle_engine_never_stalls_with_a_request_queued(
            reqs in proptest::collection::vec((0u64..3, 1u64..300, 1u32..40, 0.0f64..300.0), 1..30),
            slack in 1u64..80,
            chunk in 16u64..512,
            max_running in 1u32..6,
        ) {
            let largest = reqs.iter().map(|r| r.1 + r.2 as u64).max().unwrap_or(0);
            let mut p = profile(0.0, max_running);
            p.max_total_tokens = largest + slack;
            p.chunked_prefill_size = chunk;
            let mut engine = Engine::new(p);
            let mut reqs = reqs;
            reqs.sort_by(|a, b| a.3.total_cmp(&b.3));
            let n = reqs.len();
            let mut events = Vec::new();
            for (i, (family, tokens, out, at)) in reqs.into_iter().enumerate() {
                // Prompts of a family share block ids at any length: a block is cached
                // short by one prompt and in full by another.
                let ids: Vec<u64> = (0..tokens.div_ceil(64)).map(|b| family * 1000 + b).collect();
                while let Some(t) = engine.next_event_time().filter(|&t| t <= at) {
                    engine.step_into(t, &mut events);
                }
                engine.submit(trace_request(i as u64, &ids, tokens, out), at).unwrap();
            }
            events.extend(drain_or_stall(&mut engine).map_err(proptest::test_runner::TestCaseError::fail)?);
            let finished = events.iter().filter(|e| matches!(e, EngineEvent::Finished { .. })).count();
            proptest::prop_assert_eq!(finished, n);
        }
    }

    #[test]
    fn prefill_first_holds_decode_until_no_prefill_is_pending() {
        let (decode, long_first) = first_decode_and_long_prefill(Schedule::Alternate);
        assert!(decode < long_first, "alternate: {decode} >= {long_first}");
        let (decode, long_first) = first_decode_and_long_prefill(Schedule::PrefillFirst);
        assert!(
            decode > long_first,
            "prefill-first: {decode} <= {long_first}"
        );
    }
}
