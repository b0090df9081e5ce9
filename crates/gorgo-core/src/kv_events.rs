//! Following an engine's own KV events: its prefix cache as the engine says it is.
//!
//! The shadow index ([`crate::ShadowIndex`]) models the engine's cache from what the
//! node dispatches; an engine that publishes KV events (vLLM `--kv-events-config`,
//! SGLang, the emulator's `--kv-events`) tells what it stored and evicted instead.
//! [`KvEventFollower`] is the sans-IO state machine between the two: the raw messages
//! of the SUB socket and the replay socket go in with `now`, and out come
//!
//! - the changes of the node's index ([`NodeBlockChange`]), in the node's own blocks:
//!   engine blocks (16 tokens in vLLM, one in SGLang) are re-chained into blocks of
//!   `routing.block_tokens` with [`chain_step`] over their token ids, the way
//!   [`crate::HashChain::from_token_ids`] hashes a tokenised prompt, so a new request's
//!   chain matches them;
//! - the replay requests to send ([`FollowerAction`]);
//! - which source the index follows ([`IndexSource`]): the events while the stream is
//!   healthy, the shadow model otherwise.
//!
//! The stream: batches carry a seq from 0. A gap asks the replay socket for the
//! missing batches (the live ones are held meanwhile, within a byte budget); a long
//! gap, a failed or incomplete replay, an undecodable batch, a stream that went
//! silent while requests were served or a closed connection to the publisher (the
//! engine may have restarted) is a resync: fall back to the shadow model until the
//! stream has been continuous for the warm-up time (or from its seq 0: then it has
//! told everything). A resync for lost events of a publisher that carries on keeps
//! the blocks known before it as *unconfirmed*: the engine stores a block once and
//! serves it from cache after, so a hot prefix (a shared system prompt) is never
//! stored again, and forgetting it dropped it from the index for good. Unconfirmed
//! blocks leave by an explicit `BlockRemoved` (one copy is all they are taken to
//! have), `AllBlocksCleared`, a publisher restart, or eviction at the block cap, where
//! they go first; storing one again confirms it. A resync that may hide another
//! engine process (a closed connection, a silent stream, a seq that goes back: a
//! restarted vLLM hashes with a new seed and never removes the old blocks) forgets
//! every block. A seq that goes back is a publisher restart: from seq 0 its cache
//! starts empty.
//!
//! The block cap (`max_engine_blocks`) bounds memory: at it, the least recently
//! stored leaf block (unconfirmed ones first) is evicted to make room, so the index
//! keeps the engine's newest blocks rather than freezing on its oldest.
//!
//! The mapping: an engine block is kept with its own token ids, where it ends in the
//! sequence and the node chain up to the last node-block boundary it reaches, so a
//! child's tokens extend its parent's. A node block exists while some stored engine
//! block completes it (its ancestors are stored too: a block whose parent is unknown
//! is ignored). `BlockRemoved` drops the engine block and everything stored below it
//! (the engine matches no further), with the node blocks no other engine block keeps.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use serde::Serialize;

use crate::error::CoreError;
use crate::hash::{chain_step, CHAIN_SEED};
use crate::kv_wire::{decode_batch, decode_seq, KvEvent, DEFAULT_MAX_PAYLOAD_BYTES, MEDIUM_GPU};
use crate::summary::FingerprintBuildHasher;

/// What one batch held during a replay counts against `max_pending_bytes` beyond its
/// payload: its map entry.
const PENDING_ENTRY_BYTES: usize = 64;

/// Limits and timings of a [`KvEventFollower`]; every one bounds what a bad stream
/// can cost.
#[derive(Debug, Clone, PartialEq)]
pub struct KvFollowerConfig {
    /// The node's block size in tokens (`routing.block_tokens`): a multiple of the
    /// engine's block size, or the engine's blocks are ignored.
    pub node_block_tokens: usize,
    /// Engine blocks tracked at most: at the cap the least recently stored leaf block
    /// (unconfirmed ones first) is evicted for a new one, and counted.
    pub max_engine_blocks: usize,
    /// Largest batch payload decoded.
    pub max_payload_bytes: usize,
    /// Bytes of live batches held while a replay runs (64 more per batch); past it, a
    /// resync.
    pub max_pending_bytes: usize,
    /// Longest gap (in batches) worth a replay; longer is a resync. vLLM keeps
    /// 10 000 batches for replay by default.
    pub max_replay_gap: u64,
    /// Whether a replay socket is configured.
    pub replay: bool,
    /// How long a replay may take before it counts as failed, ms.
    pub replay_timeout_ms: u64,
    /// Continuous stream needed before the index follows a stream whose start it did
    /// not see, ms.
    pub warmup_ms: u64,
    /// A stream with no batch for this long while requests were served is silent, ms.
    pub silence_ms: u64,
    /// Requests dispatched since the last batch before silence counts (an engine that
    /// serves only cache hits stores nothing).
    pub silence_dispatches: u64,
}

impl KvFollowerConfig {
    /// Defaults for a node whose blocks hold `node_block_tokens` tokens.
    pub fn new(node_block_tokens: usize) -> Self {
        KvFollowerConfig {
            node_block_tokens,
            max_engine_blocks: 1 << 20,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            max_pending_bytes: 64 << 20,
            max_replay_gap: 10_000,
            replay: false,
            replay_timeout_ms: 2_000,
            warmup_ms: 30_000,
            silence_ms: 30_000,
            silence_dispatches: 16,
        }
    }

    /// Check the ranges (errors name the field).
    pub fn validate(&self) -> Result<(), CoreError> {
        let bad = |field: &str, reason: &str| {
            Err(CoreError::InvalidConfig {
                field: field.into(),
                reason: reason.into(),
            })
        };
        if self.node_block_tokens == 0 || self.node_block_tokens > 4096 {
            return bad("node_block_tokens", "must be in 1..=4096");
        }
        if self.max_engine_blocks == 0 {
            return bad("max_engine_blocks", "must be at least 1");
        }
        if self.max_payload_bytes == 0 {
            return bad("max_payload_bytes", "must be at least 1");
        }
        Ok(())
    }
}

/// Where the node's prefix index comes from now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IndexSource {
    /// The shadow model: inserted at dispatch, evicted by its LRU.
    Shadow,
    /// The engine's KV events.
    Events,
}

/// A change of the node's index, in node blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeBlockChange {
    /// The engine holds this node block (`parent`: the node block before it).
    Added {
        /// The node's chained hash of the block.
        hash: u64,
        /// The previous block of its chain, `None` for a first block.
        parent: Option<u64>,
        /// Tokens in it (the node's block size).
        tokens: u32,
    },
    /// The engine no longer matches this node block (nor anything below it).
    Removed {
        /// The node's chained hash of the block.
        hash: u64,
    },
    /// Forget every block (the list of `Added` that follows, if any, is all there is).
    Cleared,
}

/// A cache change of an engine that hashes the node's own chain (the simulator's
/// engines: their blocks are the node's blocks), so nothing needs re-chaining.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AlignedBlockEvent {
    /// The engine stored block `hash` below `parent`.
    Stored {
        /// The block's chained hash (the node's).
        hash: u64,
        /// The block before it.
        parent: Option<u64>,
        /// Tokens it holds.
        tokens: u32,
    },
    /// The engine evicted block `hash`.
    Removed {
        /// The block's chained hash.
        hash: u64,
    },
}

/// What the follower asks its driver to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FollowerAction {
    /// Ask the replay socket for every batch from `from_seq` on.
    RequestReplay {
        /// First seq wanted.
        from_seq: u64,
    },
}

/// What happened on the stream so far (the node's metrics and `/admin/state`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct KvEventCounters {
    /// Batches applied.
    pub batches: u64,
    /// Events applied.
    pub events: u64,
    /// Events of a type this version does not know, skipped.
    pub unknown_events: u64,
    /// Engine blocks stored that the index cannot use: LoRA blocks, blocks whose hash
    /// folds in extra keys (a cache salt, multimodal hashes) and those after them,
    /// token-pair blocks (SGLang's EAGLE), other tiers, an unknown parent, token
    /// counts that do not fit the block size, a block size that does not divide the
    /// node's.
    pub ignored_blocks: u64,
    /// Engine blocks forgotten for `max_engine_blocks`: evicted to make room, or new
    /// ones not tracked when nothing could be evicted (the cap filled by the chain
    /// being stored).
    pub dropped_blocks: u64,
    /// Gaps in the seq.
    pub gaps: u64,
    /// Replays asked for.
    pub replays: u64,
    /// Replays that timed out, came back broken or incomplete.
    pub replay_failures: u64,
    /// Publisher restarts (the seq went back).
    pub restarts: u64,
    /// Resyncs: back to the shadow model, the blocks kept unconfirmed (events lost)
    /// or forgotten (the engine may have restarted).
    pub resyncs: u64,
    /// Messages or batches that did not decode (oversized ones included).
    pub decode_errors: u64,
    /// Messages over `max_payload_bytes`.
    pub oversized: u64,
    /// Times the stream went silent while requests were served.
    pub silences: u64,
    /// Times the connection to the publisher closed (the engine may have restarted):
    /// each a resync.
    pub disconnects: u64,
}

/// The position of the stream.
#[derive(Debug)]
enum Stream {
    /// Nothing in order yet (start, or after a resync). `full_replay`: ask for the
    /// publisher's whole buffer when the first batch is not seq 0.
    Fresh { full_replay: bool },
    /// In order; `next` is the seq expected.
    Live { next: u64 },
    /// Waiting for the replay of `next..` (asked from `from`); live batches held.
    Replaying {
        from: u64,
        next: u64,
        first_seen: bool,
        deadline_ms: u64,
        pending: BTreeMap<u64, Vec<u8>>,
        pending_bytes: usize,
    },
}

/// What a resync does with the blocks known before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Picture {
    /// Events of a publisher that carries on were lost: keep the blocks, unconfirmed
    /// (the engine will not store its hot prefixes again).
    Keep,
    /// The publisher may be another engine process (a restart hashes anew and never
    /// removes the old blocks): forget them.
    Forget,
}

/// The state machine of the module docs.
#[derive(Debug)]
pub struct KvEventFollower {
    config: KvFollowerConfig,
    tracker: BlockTracker,
    stream: Stream,
    /// The tracker holds everything the engine stored since its start (we saw seq 0,
    /// or an `AllBlocksCleared`, since the last resync).
    history_complete: bool,
    /// When the stream became continuous after the last resync.
    continuous_since_ms: Option<u64>,
    source: IndexSource,
    source_since_ms: u64,
    fallback_reason: &'static str,
    fallback_ms_before: u64,
    last_batch_ms: u64,
    dispatches_since_batch: u64,
    changes: Vec<NodeBlockChange>,
    actions: Vec<FollowerAction>,
    counters: KvEventCounters,
    /// While the batches a failed replay held are fed again: a gap among them resyncs
    /// instead of asking for another replay. Asking again held the rest once more, so
    /// a backlog of gapped batches was re-fed once per entry it freed: quadratic work,
    /// and a stack frame each, under the lock the request path takes.
    refeeding: bool,
}

impl KvEventFollower {
    /// A follower that has heard nothing yet (the index follows the shadow model).
    pub fn new(config: KvFollowerConfig, now_ms: u64) -> Result<Self, CoreError> {
        config.validate()?;
        Ok(KvEventFollower {
            tracker: BlockTracker::new(config.node_block_tokens, config.max_engine_blocks),
            config,
            stream: Stream::Fresh { full_replay: true },
            history_complete: false,
            continuous_since_ms: None,
            source: IndexSource::Shadow,
            source_since_ms: now_ms,
            fallback_reason: "no events yet",
            fallback_ms_before: 0,
            last_batch_ms: now_ms,
            dispatches_since_batch: 0,
            changes: Vec::new(),
            actions: Vec::new(),
            counters: KvEventCounters::default(),
            refeeding: false,
        })
    }

    /// The source the index follows now.
    pub fn source(&self) -> IndexSource {
        self.source
    }

    /// Since when (`now_ms` of the change).
    pub fn source_since_ms(&self) -> u64 {
        self.source_since_ms
    }

    /// Why the index follows the shadow model, when it does.
    pub fn fallback_reason(&self) -> Option<&'static str> {
        (self.source == IndexSource::Shadow).then_some(self.fallback_reason)
    }

    /// Milliseconds spent on the shadow model so far (from the start: no events yet
    /// counts).
    pub fn fallback_ms(&self, now_ms: u64) -> u64 {
        self.fallback_ms_before
            + match self.source {
                IndexSource::Shadow => now_ms.saturating_sub(self.source_since_ms),
                IndexSource::Events => 0,
            }
    }

    /// The counters.
    pub fn counters(&self) -> &KvEventCounters {
        &self.counters
    }

    /// Engine blocks tracked.
    pub fn engine_blocks(&self) -> usize {
        self.tracker.engine.len()
    }

    /// Engine blocks kept unconfirmed by a resync for lost events: held until the
    /// engine removes them, stores them again (confirmed), or the cap evicts them.
    pub fn unconfirmed_blocks(&self) -> usize {
        self.tracker.unconfirmed
    }

    /// Node blocks the engine holds, as far as the events told.
    pub fn node_blocks(&self) -> usize {
        self.tracker.nodes.len()
    }

    /// Whether the node block `hash` is held (tests and checks).
    pub fn contains_node_block(&self, hash: u64) -> bool {
        self.tracker.nodes.contains_key(&hash)
    }

    /// The index changes since the last call: only while the source is the events
    /// (a switch to them starts with `Cleared` and every block held).
    pub fn take_changes(&mut self) -> Vec<NodeBlockChange> {
        std::mem::take(&mut self.changes)
    }

    /// The actions since the last call.
    pub fn take_actions(&mut self) -> Vec<FollowerAction> {
        std::mem::take(&mut self.actions)
    }

    /// The node dispatched a request to the engine (the silence check).
    pub fn on_dispatch(&mut self) {
        self.on_dispatches(1);
    }

    /// The node dispatched `n` requests to the engine since it last said so.
    pub fn on_dispatches(&mut self, n: u64) {
        self.dispatches_since_batch = self.dispatches_since_batch.saturating_add(n);
    }

    /// The SUB socket is subscribed (at start, or again): with a replay socket and no
    /// batch seen yet, ask for everything the publisher still buffers, so that what
    /// it published before the subscription took effect (a PUB drops what no
    /// subscriber takes) is not waited for until the next batch shows a gap. An
    /// empty answer means it has published nothing: the index follows the events,
    /// which start with the next batch, seq 0.
    pub fn on_subscribed(&mut self, now_ms: u64) {
        // A new connection starts its silence clock: what was sent on the old one is
        // no sign against it.
        self.last_batch_ms = now_ms;
        self.dispatches_since_batch = 0;
        if let Stream::Fresh { full_replay: true } = self.stream {
            if self.config.replay {
                self.counters.replays += 1;
                self.stream = Stream::Replaying {
                    from: 0,
                    next: 0,
                    first_seen: false,
                    deadline_ms: now_ms.saturating_add(self.config.replay_timeout_ms),
                    pending: BTreeMap::new(),
                    pending_bytes: 0,
                };
                self.actions
                    .push(FollowerAction::RequestReplay { from_seq: 0 });
            }
        }
    }

    /// The connection to the publisher closed. The engine may have restarted: vLLM
    /// seeds its block hashes per process, so a restarted engine never removes the
    /// old blocks, and the batches it publishes before the SUB socket is back are
    /// lost, after which its seq can read as an ordinary gap (or no gap at all) and
    /// the dead engine's blocks would stay for good. So the picture is not trusted:
    /// a resync onto the shadow model, and the next subscription asks for the
    /// publisher's whole buffer as at the start ([`Self::on_subscribed`]); the events
    /// are followed again by the usual rules (a history seen from seq 0, or the
    /// warm-up).
    pub fn on_disconnected(&mut self, now_ms: u64) {
        self.counters.disconnects += 1;
        self.resync(now_ms, "publisher connection closed", Picture::Forget);
        self.stream = Stream::Fresh { full_replay: true };
    }

    /// A message of the SUB socket: `[topic, seq, payload]`.
    pub fn on_message(&mut self, frames: &[&[u8]], now_ms: u64) {
        let (seq, payload) = match self.parse_frames(frames, 3) {
            Ok(v) => v,
            Err(reason) => return self.resync(now_ms, reason, Picture::Keep),
        };
        self.on_batch(seq, payload, now_ms);
    }

    /// A message of the replay socket: `[seq, payload]` (after the ROUTER envelope;
    /// a leading empty delimiter frame is skipped).
    pub fn on_replay_message(&mut self, frames: &[&[u8]], now_ms: u64) {
        let Stream::Replaying { .. } = self.stream else {
            return; // a late answer to a replay given up on
        };
        let frames = match frames {
            [empty, rest @ ..] if empty.is_empty() && rest.len() == 2 => rest,
            _ => frames,
        };
        if frames.len() == 2 && frames[0] == crate::kv_wire::encode_seq(-1) {
            return self.finish_replay(now_ms);
        }
        let (seq, payload) = match self.parse_frames(frames, 2) {
            Ok(v) => v,
            Err(reason) => return self.replay_failed(now_ms, reason),
        };
        let Stream::Replaying {
            from,
            next,
            first_seen,
            ..
        } = &mut self.stream
        else {
            return;
        };
        let startup = *from == 0 && !*first_seen;
        *first_seen = true;
        if seq < *next {
            return; // already applied
        }
        let whole_history = startup && seq == *next;
        if seq > *next {
            if !startup {
                return self.replay_failed(now_ms, "replay misses batches");
            }
            // The publisher's buffer no longer starts at 0: the cache's start is lost.
            self.history_complete = false;
            self.continuous_since_ms = Some(now_ms);
        }
        *next = seq + 1;
        if whole_history {
            // The whole history comes: what was known before (unconfirmed blocks kept
            // by a resync) is rebuilt from it or was evicted in it.
            self.forget_blocks();
            self.history_complete = true;
        }
        // An undecodable batch resyncs inside: the replay is then over.
        self.apply(payload, now_ms);
    }

    /// A batch of an in-process stream that loses nothing and whose blocks are the
    /// node's already (the simulator: its engine's changes after the transit delay).
    /// The stream starts with the engine, so its history is complete.
    pub fn apply_aligned(&mut self, events: &[AlignedBlockEvent], now_ms: u64) {
        if let Stream::Fresh { .. } = self.stream {
            self.history_complete = true;
            self.continuous_since_ms = Some(now_ms);
            self.stream = Stream::Live { next: 0 };
        }
        self.counters.batches += 1;
        self.last_batch_ms = now_ms;
        self.dispatches_since_batch = 0;
        let mut out = Vec::new();
        for event in events {
            self.counters.events += 1;
            match *event {
                AlignedBlockEvent::Stored {
                    hash,
                    parent,
                    tokens,
                } => self
                    .tracker
                    .store_aligned(hash, parent, tokens, &mut out, &mut self.counters),
                AlignedBlockEvent::Removed { hash } => self.tracker.remove(hash, &mut out),
            }
        }
        if self.source == IndexSource::Events {
            self.changes.extend(out);
        }
        self.update_source(now_ms);
    }

    /// Time passes: replay deadlines, silence, the warm-up.
    pub fn tick(&mut self, now_ms: u64) {
        if let Stream::Replaying { deadline_ms, .. } = self.stream {
            if now_ms >= deadline_ms {
                self.replay_failed(now_ms, "replay timed out");
            }
        }
        // Checked on either source: a connection that died without a word while the
        // index was on the shadow model (waiting for its first batch, or after a
        // resync) was never replaced, and the index stayed on the model for good.
        if now_ms.saturating_sub(self.last_batch_ms) >= self.config.silence_ms
            && self.dispatches_since_batch >= self.config.silence_dispatches
        {
            self.counters.silences += 1;
            // The node subscribes again on a new connection (`on_subscribed` starts
            // the clock anew); until then, one silence per `silence_ms`.
            self.last_batch_ms = now_ms;
            self.dispatches_since_batch = 0;
            // A connection dead without a word may hide an engine that restarted.
            self.resync(now_ms, "silent stream", Picture::Forget);
        }
        self.update_source(now_ms);
    }

    fn parse_frames<'a>(
        &mut self,
        frames: &[&'a [u8]],
        parts: usize,
    ) -> Result<(u64, &'a [u8]), &'static str> {
        if frames.len() != parts {
            self.counters.decode_errors += 1;
            return Err("malformed message");
        }
        let seq = match decode_seq(frames[parts - 2]) {
            Ok(s) if s >= 0 => s as u64,
            _ => {
                self.counters.decode_errors += 1;
                return Err("malformed seq");
            }
        };
        let payload = frames[parts - 1];
        if payload.len() > self.config.max_payload_bytes {
            self.counters.decode_errors += 1;
            self.counters.oversized += 1;
            return Err("oversized batch");
        }
        Ok((seq, payload))
    }

    fn on_batch(&mut self, seq: u64, payload: &[u8], now_ms: u64) {
        match &mut self.stream {
            Stream::Fresh { full_replay } => {
                if seq == 0 {
                    // A publisher from its start: its cache was empty then, so the
                    // blocks a resync kept unconfirmed belong to a previous one.
                    self.forget_blocks();
                    self.history_complete = true;
                } else if *full_replay
                    && self.config.replay
                    && !self.refeeding
                    && seq <= self.config.max_replay_gap
                {
                    return self.start_replay(0, seq, payload, now_ms);
                } else {
                    self.history_complete = false;
                }
                self.continuous_since_ms = Some(now_ms);
                self.stream = Stream::Live { next: seq + 1 };
                self.apply(payload, now_ms);
            }
            Stream::Live { next } => {
                let next = *next;
                if seq == next {
                    self.stream = Stream::Live { next: seq + 1 };
                    self.apply(payload, now_ms);
                } else if seq > next {
                    self.counters.gaps += 1;
                    if self.config.replay
                        && !self.refeeding
                        && seq - next <= self.config.max_replay_gap
                    {
                        self.start_replay(next, seq, payload, now_ms);
                    } else {
                        self.resync(now_ms, "gap without replay", Picture::Keep);
                        self.on_batch(seq, payload, now_ms);
                    }
                } else {
                    self.counters.restarts += 1;
                    if seq == 0 {
                        // A new publisher: its cache starts empty.
                        self.forget_blocks();
                        self.history_complete = true;
                        self.stream = Stream::Live { next: 1 };
                        self.apply(payload, now_ms);
                    } else {
                        // A new publisher whose first batches were lost: its engine
                        // restarted, so its cache starts empty too. Kept, the dead
                        // engine's blocks stayed in the index (and in what peers hold
                        // of it) while the shadow model carried on from them.
                        self.forget_blocks();
                        self.resync(now_ms, "publisher restarted", Picture::Forget);
                        self.stream = Stream::Fresh { full_replay: true };
                        self.on_batch(seq, payload, now_ms);
                    }
                }
            }
            Stream::Replaying {
                pending,
                pending_bytes,
                ..
            } => {
                // Each held batch costs its bytes and its entry, so a flood of tiny
                // messages is bounded too.
                let cost = payload.len() + PENDING_ENTRY_BYTES;
                if *pending_bytes + cost > self.config.max_pending_bytes {
                    self.replay_failed(now_ms, "replay backlog full");
                    return self.on_batch(seq, payload, now_ms);
                }
                *pending_bytes += cost;
                pending.insert(seq, payload.to_vec());
            }
        }
    }

    fn start_replay(&mut self, from: u64, seq: u64, payload: &[u8], now_ms: u64) {
        self.counters.replays += 1;
        let mut pending = BTreeMap::new();
        pending.insert(seq, payload.to_vec());
        self.stream = Stream::Replaying {
            from,
            next: from,
            first_seen: false,
            deadline_ms: now_ms.saturating_add(self.config.replay_timeout_ms),
            pending,
            pending_bytes: payload.len() + PENDING_ENTRY_BYTES,
        };
        self.actions
            .push(FollowerAction::RequestReplay { from_seq: from });
    }

    /// The end marker: carry on with the batches held.
    fn finish_replay(&mut self, now_ms: u64) {
        let Stream::Replaying {
            next,
            pending,
            first_seen,
            from,
            ..
        } = std::mem::replace(&mut self.stream, Stream::Live { next: 0 })
        else {
            return;
        };
        if from == 0 && !first_seen && pending.is_empty() {
            // Asked on subscribing, before any batch: nothing published yet, so the
            // cache is empty and the stream starts at seq 0.
            self.history_complete = true;
            self.continuous_since_ms = Some(now_ms);
            self.stream = Stream::Live { next: 0 };
        } else if from == 0 && !first_seen {
            // An empty replay buffer behind live batches: the start is not there to see.
            self.history_complete = false;
            self.continuous_since_ms = Some(now_ms);
            self.stream = Stream::Fresh { full_replay: false };
        } else if pending.keys().next().is_some_and(|&first| first > next) {
            // The replay ended short of the batches held: what lies between is not
            // there to get (the replay socket holds less, or is another engine's).
            // Asking again would get the same, at once and for ever.
            return self.abandon_replay(pending, now_ms, "replay incomplete");
        } else {
            self.stream = Stream::Live { next };
        }
        self.update_source(now_ms);
        for (seq, payload) in pending {
            // Only what the replay could have brought is a repeat: a seq below the
            // one asked for is the publisher starting again (it restarted meanwhile).
            if (from..next).contains(&seq) {
                continue; // the replay had it already
            }
            self.on_batch(seq, &payload, now_ms);
        }
    }

    fn replay_failed(&mut self, now_ms: u64, reason: &'static str) {
        let pending =
            match std::mem::replace(&mut self.stream, Stream::Fresh { full_replay: false }) {
                Stream::Replaying { pending, .. } => pending,
                _ => BTreeMap::new(),
            };
        self.abandon_replay(pending, now_ms, reason);
    }

    /// A replay that failed or came back short: counted, every block forgotten (the
    /// shadow model meanwhile), and the batches held fed again as a new stream whose
    /// start was not seen (a gap among them resyncs instead of asking again).
    fn abandon_replay(
        &mut self,
        pending: BTreeMap<u64, Vec<u8>>,
        now_ms: u64,
        reason: &'static str,
    ) {
        self.counters.replay_failures += 1;
        self.resync(now_ms, reason, Picture::Keep);
        self.refeeding = true;
        for (seq, payload) in pending {
            self.on_batch(seq, &payload, now_ms);
        }
        self.refeeding = false;
    }

    /// Every block forgotten: the engine's cache starts empty (a publisher restart),
    /// or a whole history follows.
    fn forget_blocks(&mut self) {
        self.tracker.clear(&mut Vec::new());
        if self.source == IndexSource::Events {
            self.changes.push(NodeBlockChange::Cleared);
        }
    }

    /// Fall back to the shadow model, with the blocks known so far kept unconfirmed or
    /// forgotten (`picture`); the next batch starts a stream whose beginning we did
    /// not see. Before, every resync forgot every block, and the return to the events
    /// cleared the index: a prefix the engine kept cached and never stored again (a
    /// shared system prompt) was gone from it for good.
    fn resync(&mut self, now_ms: u64, reason: &'static str, picture: Picture) {
        self.counters.resyncs += 1;
        match picture {
            Picture::Keep => self.tracker.mark_unconfirmed(),
            Picture::Forget => self.tracker.clear(&mut Vec::new()),
        }
        self.history_complete = false;
        self.continuous_since_ms = None;
        self.stream = Stream::Fresh { full_replay: false };
        if self.source == IndexSource::Events {
            self.source = IndexSource::Shadow;
            self.source_since_ms = now_ms;
        }
        self.fallback_reason = reason;
    }

    /// Decode and apply one batch in order; false when it did not decode (a resync).
    fn apply(&mut self, payload: &[u8], now_ms: u64) -> bool {
        let batch = match decode_batch(payload, self.config.max_payload_bytes) {
            Ok(b) => b,
            Err(_) => {
                self.counters.decode_errors += 1;
                self.resync(now_ms, "undecodable batch", Picture::Keep);
                return false;
            }
        };
        self.counters.batches += 1;
        self.last_batch_ms = now_ms;
        self.dispatches_since_batch = 0;
        self.counters.events += batch.unknown_events;
        self.counters.unknown_events += batch.unknown_events;
        let mut out = Vec::new();
        for event in batch.events {
            self.counters.events += 1;
            match event {
                KvEvent::BlockStored {
                    block_hashes,
                    parent,
                    token_ids,
                    block_size,
                    lora_id,
                    medium,
                    extra_keys_from,
                } => {
                    if lora_id.is_some() || !is_gpu(medium.as_deref()) {
                        self.counters.ignored_blocks += block_hashes.len() as u64;
                        continue;
                    }
                    // A block whose hash folds in extra keys (a cache salt, an image's
                    // hash) is not the token block a prompt's chain names: the engine
                    // shares it with no request that lacks those keys. Like a LoRA
                    // block it is ignored, and so are the blocks after it in the event,
                    // whose hashes chain from it (a later event below any of them has
                    // an unknown parent and is ignored too); the plain blocks before it
                    // are kept.
                    let n = block_hashes.len();
                    let plain = extra_keys_from.map_or(n, |i| i.min(n));
                    let (hashes, tokens) = if plain == n {
                        (&block_hashes[..], &token_ids[..])
                    } else {
                        let size = block_size as usize;
                        match plain.checked_mul(size) {
                            Some(end) if n.checked_mul(size) == Some(token_ids.len()) => {
                                self.counters.ignored_blocks += (n - plain) as u64;
                                (&block_hashes[..plain], &token_ids[..end])
                            }
                            // Token ids that do not fit the blocks: the tracker would
                            // ignore every one of them.
                            _ => {
                                self.counters.ignored_blocks += n as u64;
                                continue;
                            }
                        }
                    };
                    self.tracker.store(
                        hashes,
                        parent,
                        tokens,
                        block_size as usize,
                        &mut out,
                        &mut self.counters,
                    );
                }
                KvEvent::TokenPairsStored { blocks } => self.counters.ignored_blocks += blocks,
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } => {
                    if is_gpu(medium.as_deref()) {
                        for h in block_hashes {
                            self.tracker.remove(h, &mut out);
                        }
                    }
                }
                KvEvent::AllBlocksCleared => {
                    self.tracker.clear(&mut out);
                    // The cache is empty now: from here on the tracker sees everything.
                    self.history_complete = true;
                }
                KvEvent::Unknown => self.counters.unknown_events += 1,
            }
        }
        if self.source == IndexSource::Events {
            self.changes.extend(out);
        }
        self.update_source(now_ms);
        true
    }

    fn update_source(&mut self, now_ms: u64) {
        let flowing = matches!(self.stream, Stream::Live { .. } | Stream::Replaying { .. });
        let warm = self
            .continuous_since_ms
            .is_some_and(|t| now_ms.saturating_sub(t) >= self.config.warmup_ms);
        if self.source == IndexSource::Shadow && flowing && (self.history_complete || warm) {
            self.fallback_ms_before += now_ms.saturating_sub(self.source_since_ms);
            self.source = IndexSource::Events;
            self.source_since_ms = now_ms;
            self.changes.clear();
            self.changes.push(NodeBlockChange::Cleared);
            self.changes.extend(self.tracker.snapshot());
        }
    }
}

fn is_gpu(medium: Option<&str>) -> bool {
    medium.is_none_or(|m| m == MEDIUM_GPU)
}

/// One engine block as the tracker keeps it.
#[derive(Debug, Clone)]
struct EngineBlock {
    parent: Option<u64>,
    /// Tokens of the sequence up to and including this block.
    end: u64,
    /// This block's token ids.
    tokens: Box<[u32]>,
    /// The node chain's last full block at or before `end` (`None`: none yet).
    chain_end: Option<u64>,
    /// The node blocks whose last token is in this block.
    completes: Vec<u64>,
    /// The blocks stored below it. A set, not a list: one prefix may have many
    /// continuations (a system prompt's last block, SGLang's 1-token blocks), and
    /// evicting each must not scan its siblings (a list made that quadratic, under
    /// the lock the request path takes; `kv_events/evict_20k_siblings_one_by_one` in
    /// benches/hot_path.rs).
    children: HashSet<u64, FingerprintBuildHasher>,
    /// How many times the engine stored it and has not removed it since: vLLM keeps
    /// duplicate physical blocks of one hash (two requests with the same new prefix
    /// in one step), storing and evicting each, so the first eviction must not take a
    /// prefix the engine still holds out of the index. An unconfirmed block counts as
    /// one: the removals of the others may be among the events lost.
    copies: u32,
    /// The tracker's epoch when it was last stored: older than the tracker's is
    /// unconfirmed (kept across a resync for lost events).
    epoch: u32,
    /// When it was last stored (the tracker's store clock): the cap evicts the least
    /// recent leaf.
    stamp: u64,
}

impl EngineBlock {
    /// Its key among the leaves: unconfirmed (older epochs) first, then least
    /// recently stored.
    fn leaf_key(&self, hash: u64) -> (u32, u64, u64) {
        (self.epoch, self.stamp, hash)
    }
}

/// One node block: held while `refs` engine blocks complete it.
#[derive(Debug, Clone)]
struct NodeBlock {
    refs: u32,
    parent: Option<u64>,
    tokens: u32,
    depth: u32,
}

/// Engine blocks re-chained into node blocks (the module docs' mapping).
#[derive(Debug)]
struct BlockTracker {
    node_block_tokens: usize,
    max_engine_blocks: usize,
    engine: HashMap<u64, EngineBlock, FingerprintBuildHasher>,
    nodes: HashMap<u64, NodeBlock, FingerprintBuildHasher>,
    /// Bumped by each resync that keeps the blocks: those stored before are
    /// unconfirmed.
    epoch: u32,
    /// The store clock (`EngineBlock::stamp`).
    clock: u64,
    /// Blocks with nothing stored below them, by [`EngineBlock::leaf_key`]: what the
    /// cap evicts first. Only leaves, so that an eviction never cuts a chain the
    /// engine holds below it.
    leaves: BTreeSet<(u32, u64, u64)>,
    /// Blocks whose epoch is older than `epoch`.
    unconfirmed: usize,
}

impl BlockTracker {
    fn new(node_block_tokens: usize, max_engine_blocks: usize) -> Self {
        BlockTracker {
            node_block_tokens,
            max_engine_blocks,
            engine: HashMap::default(),
            nodes: HashMap::default(),
            epoch: 0,
            clock: 0,
            leaves: BTreeSet::new(),
            unconfirmed: 0,
        }
    }

    /// A resync for lost events: every block known so far becomes unconfirmed.
    fn mark_unconfirmed(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            // Four billion resyncs: start the epochs again rather than let the old
            // blocks read as confirmed.
            self.clear(&mut Vec::new());
            return;
        }
        self.unconfirmed = self.engine.len();
    }

    /// The engine stored block `hash` again (or stored below it): it holds it now.
    /// Confirms it and its unconfirmed ancestors (each block flips once per resync,
    /// so the walk costs nothing over time) and refreshes its stamp. An unconfirmed
    /// block comes back as one copy: the engine most likely evicted it among the
    /// events lost and computed it again.
    fn touch(&mut self, hash: u64) {
        self.clock += 1;
        let (epoch, clock) = (self.epoch, self.clock);
        let mut cur = Some(hash);
        let mut first = true;
        while let Some(h) = cur {
            let Some(b) = self.engine.get_mut(&h) else {
                return;
            };
            let stale = b.epoch != epoch;
            if !first && !stale {
                return;
            }
            let leaf = b.children.is_empty();
            if leaf {
                self.leaves.remove(&b.leaf_key(h));
            }
            if stale {
                b.copies = 1;
                b.epoch = epoch;
                self.unconfirmed = self.unconfirmed.saturating_sub(1);
            }
            if first {
                b.stamp = clock;
            }
            if leaf {
                self.leaves.insert(b.leaf_key(h));
            }
            first = false;
            cur = b.parent;
        }
    }

    /// Room for one more block at the cap: evict the first leaf (unconfirmed, then
    /// least recently stored) other than `keep` (the parent of the block to store);
    /// false when there is none.
    fn make_room(
        &mut self,
        keep: Option<u64>,
        out: &mut Vec<NodeBlockChange>,
        counters: &mut KvEventCounters,
    ) -> bool {
        while self.engine.len() >= self.max_engine_blocks {
            let victim = self
                .leaves
                .iter()
                .map(|&(_, _, h)| h)
                .find(|&h| Some(h) != keep);
            let Some(victim) = victim else {
                return false;
            };
            counters.dropped_blocks += 1;
            self.remove_all(victim, out);
        }
        true
    }

    /// The last `n` tokens of the sequence that ends with `block`.
    fn tail_tokens(&self, block: Option<u64>, n: usize) -> Vec<u32> {
        let mut chunks: Vec<&[u32]> = Vec::new();
        let (mut cur, mut need) = (block, n);
        while need > 0 {
            let Some(b) = cur.and_then(|h| self.engine.get(&h)) else {
                break;
            };
            let take = need.min(b.tokens.len());
            chunks.push(&b.tokens[b.tokens.len() - take..]);
            need -= take;
            cur = b.parent;
        }
        chunks
            .iter()
            .rev()
            .flat_map(|c| c.iter().copied())
            .collect()
    }

    fn store(
        &mut self,
        hashes: &[u64],
        parent: Option<u64>,
        token_ids: &[u32],
        block_size: usize,
        out: &mut Vec<NodeBlockChange>,
        counters: &mut KvEventCounters,
    ) {
        // A node block must end on an engine block's end: the engine matches whole
        // blocks, so a node block cut inside one would claim tokens the engine may not
        // match (node blocks are 64 tokens by default; vLLM's are 16, SGLang's 1).
        if block_size == 0
            || !self.node_block_tokens.is_multiple_of(block_size)
            || Some(token_ids.len()) != hashes.len().checked_mul(block_size)
        {
            counters.ignored_blocks += hashes.len() as u64;
            return;
        }
        let b = self.node_block_tokens;
        let (mut end, mut chain_end) = match parent {
            None => (0, None),
            // The parent must end on a block of this size too: after blocks of 16, one
            // of 32 starts at 16, and a node block of 64 ended inside the third such
            // block ([48, 80]), claiming 16 tokens the engine may not match.
            Some(p) => match self.engine.get(&p) {
                Some(pb) if pb.end.is_multiple_of(block_size as u64) => (pb.end, pb.chain_end),
                _ => {
                    counters.ignored_blocks += hashes.len() as u64;
                    return;
                }
            },
        };
        // The engine stored below it: it holds the parent.
        if let Some(p) = parent {
            self.touch(p);
        }
        let mut prev = parent;
        // The tokens of the node block in progress, looked up only when a new block
        // needs them: a batch that restores known blocks (or names one many times)
        // must not walk their parents once each.
        let mut partial: Option<Vec<u32>> = None;
        let mut bytes = Vec::with_capacity(b * 4);
        for (i, &h) in hashes.iter().enumerate() {
            if let Some(existing) = self.engine.get_mut(&h) {
                // Known, under another parent: the engine's hashes do not name a block
                // by its prefix (a page hashed by its own tokens alone), so this hash
                // says nothing of where the chain is. Following it chained the next
                // blocks from the wrong place and claimed a prefix the engine does not
                // hold; the rest of the event is not read.
                if existing.parent != prev {
                    counters.ignored_blocks += (hashes.len() - i) as u64;
                    return;
                }
                // Stored already (another request got there first, or a duplicate
                // physical block): one more copy (an unconfirmed one is confirmed as
                // one copy); follow it.
                if existing.epoch == self.epoch {
                    existing.copies = existing.copies.saturating_add(1);
                }
                end = existing.end;
                chain_end = existing.chain_end;
                self.touch(h);
                prev = Some(h);
                partial = None;
                continue;
            }
            if !self.make_room(prev, out, counters) {
                counters.dropped_blocks += (hashes.len() - i) as u64;
                return;
            }
            let tokens = &token_ids[i * block_size..(i + 1) * block_size];
            let partial =
                partial.get_or_insert_with(|| self.tail_tokens(prev, (end % b as u64) as usize));
            let mut completes = Vec::new();
            for &t in tokens {
                partial.push(t);
                if partial.len() == b {
                    bytes.clear();
                    for id in partial.iter() {
                        bytes.extend_from_slice(&id.to_le_bytes());
                    }
                    let node = chain_step(chain_end.unwrap_or(CHAIN_SEED), &bytes);
                    self.add_node_ref(node, chain_end, b as u32, out);
                    completes.push(node);
                    chain_end = Some(node);
                    partial.clear();
                }
            }
            end += block_size as u64;
            self.insert_block(
                h,
                EngineBlock {
                    parent: prev,
                    end,
                    tokens: tokens.into(),
                    chain_end,
                    completes,
                    children: HashSet::default(),
                    copies: 1,
                    epoch: self.epoch,
                    stamp: 0,
                },
            );
            prev = Some(h);
        }
    }

    /// Track a new block below its parent (stamped now, a leaf).
    fn insert_block(&mut self, hash: u64, mut block: EngineBlock) {
        self.clock += 1;
        block.stamp = self.clock;
        if let Some(p) = block.parent.and_then(|p| self.engine.get_mut(&p)) {
            if p.children.is_empty() {
                self.leaves
                    .remove(&p.leaf_key(block.parent.unwrap_or_default()));
            }
            p.children.insert(hash);
        }
        self.leaves.insert(block.leaf_key(hash));
        self.engine.insert(hash, block);
    }

    /// One engine block that is a node block (see [`AlignedBlockEvent`]).
    fn store_aligned(
        &mut self,
        hash: u64,
        parent: Option<u64>,
        tokens: u32,
        out: &mut Vec<NodeBlockChange>,
        counters: &mut KvEventCounters,
    ) {
        if let Some(existing) = self.engine.get_mut(&hash) {
            if existing.epoch == self.epoch {
                existing.copies = existing.copies.saturating_add(1);
            }
            self.touch(hash);
            return;
        }
        if parent.is_some_and(|p| !self.engine.contains_key(&p)) {
            counters.ignored_blocks += 1;
            return;
        }
        if let Some(p) = parent {
            self.touch(p);
        }
        if !self.make_room(parent, out, counters) {
            counters.dropped_blocks += 1;
            return;
        }
        self.add_node_ref(hash, parent, tokens, out);
        self.insert_block(
            hash,
            EngineBlock {
                parent,
                end: 0,
                tokens: Box::new([]),
                chain_end: Some(hash),
                completes: vec![hash],
                children: HashSet::default(),
                copies: 1,
                epoch: self.epoch,
                stamp: 0,
            },
        );
    }

    fn add_node_ref(
        &mut self,
        hash: u64,
        parent: Option<u64>,
        tokens: u32,
        out: &mut Vec<NodeBlockChange>,
    ) {
        let depth = parent
            .and_then(|p| self.nodes.get(&p))
            .map_or(0, |p| p.depth + 1);
        let node = self.nodes.entry(hash).or_insert_with(|| {
            out.push(NodeBlockChange::Added {
                hash,
                parent,
                tokens,
            });
            NodeBlock {
                refs: 0,
                parent,
                tokens,
                depth,
            }
        });
        node.refs += 1;
    }

    /// Drop one copy of engine block `hash` (an unconfirmed block has one); with the
    /// last, the block and everything stored below it.
    fn remove(&mut self, hash: u64, out: &mut Vec<NodeBlockChange>) {
        let Some(block) = self.engine.get_mut(&hash) else {
            return;
        };
        if block.copies > 1 && block.epoch == self.epoch {
            block.copies -= 1;
            return;
        }
        self.remove_all(hash, out);
    }

    /// Drop engine block `hash`, every copy, and everything stored below it.
    fn remove_all(&mut self, hash: u64, out: &mut Vec<NodeBlockChange>) {
        let Some(parent) = self.engine.get(&hash).map(|b| b.parent) else {
            return;
        };
        if let Some(p) = parent.and_then(|p| self.engine.get_mut(&p)) {
            p.children.remove(&hash);
            if p.children.is_empty() {
                self.leaves.insert(p.leaf_key(parent.unwrap_or_default()));
            }
        }
        let mut stack = vec![hash];
        while let Some(h) = stack.pop() {
            let Some(b) = self.engine.remove(&h) else {
                continue;
            };
            if b.children.is_empty() {
                self.leaves.remove(&b.leaf_key(h));
            }
            if b.epoch != self.epoch {
                self.unconfirmed = self.unconfirmed.saturating_sub(1);
            }
            stack.extend(b.children);
            for node in b.completes {
                if let Some(n) = self.nodes.get_mut(&node) {
                    n.refs -= 1;
                    if n.refs == 0 {
                        self.nodes.remove(&node);
                        out.push(NodeBlockChange::Removed { hash: node });
                    }
                }
            }
        }
    }

    fn clear(&mut self, out: &mut Vec<NodeBlockChange>) {
        self.engine.clear();
        self.nodes.clear();
        self.leaves.clear();
        self.unconfirmed = 0;
        out.push(NodeBlockChange::Cleared);
    }

    /// Every node block, parents before children.
    fn snapshot(&self) -> Vec<NodeBlockChange> {
        let mut blocks: Vec<(&u64, &NodeBlock)> = self.nodes.iter().collect();
        blocks.sort_unstable_by_key(|(h, n)| (n.depth, **h));
        blocks
            .into_iter()
            .map(|(&hash, n)| NodeBlockChange::Added {
                hash,
                parent: n.parent,
                tokens: n.tokens,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_wire::{encode_batch, encode_seq, KvEventBatch};
    use crate::HashChain;

    /// Node and engine blocks of 4 tokens: one engine block per node block.
    const B: usize = 4;

    fn cfg() -> KvFollowerConfig {
        KvFollowerConfig {
            warmup_ms: 100,
            ..KvFollowerConfig::new(B)
        }
    }

    fn store(hashes: &[u64], parent: Option<u64>, first_token: u32) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.to_vec(),
            parent,
            token_ids: (first_token..first_token + (hashes.len() * B) as u32).collect(),
            block_size: B as u32,
            lora_id: None,
            medium: None,
            extra_keys_from: None,
        }
    }

    fn removed(hashes: &[u64]) -> KvEvent {
        KvEvent::BlockRemoved {
            block_hashes: hashes.to_vec(),
            medium: None,
        }
    }

    fn send(f: &mut KvEventFollower, seq: u64, events: Vec<KvEvent>, now: u64) {
        let payload = encode_batch(&KvEventBatch {
            ts: 0.0,
            events,
            data_parallel_rank: None,
            unknown_events: 0,
        });
        f.on_message(&[b"kv", &encode_seq(seq as i64), &payload], now);
    }

    /// Leading node blocks of the token run `from..to` the follower holds.
    fn held(f: &KvEventFollower, from: u32, to: u32) -> usize {
        let ids: Vec<u32> = (from..to).collect();
        let chain = HashChain::from_token_ids(&ids, B);
        chain
            .hashes
            .iter()
            .take_while(|h| f.contains_node_block(**h))
            .count()
    }

    /// A hot prefix (a shared system prompt) stored before a gap and never stored
    /// again, since the engine serves it from cache, is still held when the index
    /// returns to the events after the resync; a request stored below it after the
    /// gap chains from it; the engine's `BlockRemoved` still takes it out. Before, the
    /// resync forgot it, the child was an orphan, and the return to the events
    /// cleared it from the index for good.
    #[test]
    fn a_hot_prefix_stored_before_a_gap_is_held_after_the_resync() {
        let mut f = KvEventFollower::new(cfg(), 0).unwrap();
        send(&mut f, 0, vec![store(&[11, 12], None, 0)], 0);
        send(&mut f, 1, vec![store(&[21], None, 100)], 1);
        assert_eq!(f.source(), IndexSource::Events);
        f.take_changes();
        // Batch 2 is lost; batch 3 stores a request below the hot prefix.
        send(&mut f, 3, vec![store(&[13], Some(12), 8)], 10);
        assert_eq!(f.counters().resyncs, 1);
        assert_eq!(f.source(), IndexSource::Shadow);
        assert_eq!(f.counters().ignored_blocks, 0, "the child chained");
        assert_eq!(f.unconfirmed_blocks(), 1, "11 and 12 confirmed below 13");
        f.tick(110);
        assert_eq!(f.source(), IndexSource::Events);
        let changes = f.take_changes();
        assert_eq!(changes[0], NodeBlockChange::Cleared);
        assert_eq!(changes.len(), 1 + 4, "{changes:?}");
        assert_eq!(held(&f, 0, 12), 3, "the hot prefix and its child");
        assert_eq!(held(&f, 100, 104), 1, "kept, unconfirmed");
        // The engine evicts the hot prefix: it leaves with everything below it.
        send(&mut f, 4, vec![removed(&[11])], 120);
        assert_eq!(held(&f, 0, 12), 0);
        let gone = f
            .take_changes()
            .into_iter()
            .filter(|c| matches!(c, NodeBlockChange::Removed { .. }))
            .count();
        assert_eq!(gone, 3);
        assert_eq!(f.engine_blocks(), 1);
    }

    /// An unconfirmed block counts as one copy (the other copies' removals may be
    /// among the events lost); storing it again confirms it as one copy.
    #[test]
    fn an_unconfirmed_block_is_one_copy_until_stored_again() {
        let mut f = KvEventFollower::new(cfg(), 0).unwrap();
        let twice = vec![store(&[11], None, 0), store(&[11], None, 0)];
        send(&mut f, 0, twice.clone(), 0);
        send(&mut f, 1, vec![store(&[21], None, 100)], 0);
        send(&mut f, 3, vec![], 1); // 2 lost: a resync, both kept
        assert_eq!(f.unconfirmed_blocks(), 2);
        send(&mut f, 4, vec![removed(&[11])], 2);
        assert_eq!(held(&f, 0, 4), 0, "one removal takes an unconfirmed block");
        // Stored again: confirmed, one copy.
        send(&mut f, 5, vec![store(&[21], None, 100)], 3);
        assert_eq!(f.unconfirmed_blocks(), 0);
        send(&mut f, 6, vec![removed(&[21])], 4);
        assert_eq!(held(&f, 100, 104), 0);
        assert_eq!(f.engine_blocks(), 0);
    }

    /// After a resync that kept the blocks, a stream from seq 0 is a publisher from
    /// its start, whose cache was empty: the kept blocks belong to an older one.
    #[test]
    fn a_stream_from_seq_0_after_a_resync_forgets_the_kept_blocks() {
        let mut f = KvEventFollower::new(cfg(), 0).unwrap();
        send(&mut f, 0, vec![store(&[11, 12], None, 0)], 0);
        f.on_message(&[b"kv", &encode_seq(1), b"\xc1 not msgpack"], 1);
        assert_eq!(f.fallback_reason(), Some("undecodable batch"));
        assert_eq!(held(&f, 0, 8), 2, "kept, unconfirmed");
        send(&mut f, 0, vec![store(&[31], None, 200)], 2);
        assert_eq!(f.source(), IndexSource::Events, "the whole history");
        assert_eq!(held(&f, 0, 8), 0);
        assert_eq!(held(&f, 200, 204), 1);
        assert_eq!(f.unconfirmed_blocks(), 0);
    }

    /// At the block cap the least recently stored leaf makes room for a new block
    /// (a leaf only: the engine holds a chain's start while it holds its end), and
    /// unconfirmed leaves go first. Before, the new blocks were dropped and the index
    /// froze on the oldest.
    #[test]
    fn at_the_cap_the_least_recently_stored_leaf_makes_room() {
        let capped = KvFollowerConfig {
            max_engine_blocks: 3,
            ..cfg()
        };
        let mut f = KvEventFollower::new(capped, 0).unwrap();
        send(&mut f, 0, vec![store(&[11, 12], None, 0)], 0);
        send(&mut f, 1, vec![store(&[21], None, 100)], 1);
        send(&mut f, 2, vec![store(&[31], None, 200)], 2);
        assert_eq!(held(&f, 200, 204), 1, "the new block is held");
        assert_eq!(held(&f, 0, 8), 1, "12, the oldest leaf, made room");
        assert_eq!(f.counters().dropped_blocks, 1);
        // 21 stored again is recent: 11 (a leaf now, and older) goes next.
        send(&mut f, 3, vec![store(&[21], None, 100)], 3);
        send(&mut f, 4, vec![store(&[41], None, 300)], 4);
        assert_eq!(held(&f, 0, 8), 0);
        assert_eq!((held(&f, 100, 104), held(&f, 300, 304)), (1, 1));
        assert_eq!(f.engine_blocks(), 3);

        // Unconfirmed first: 21, kept by a resync, goes before 11, confirmed (below 13)
        // but stored earlier.
        let four = KvFollowerConfig {
            max_engine_blocks: 4,
            ..cfg()
        };
        let mut f = KvEventFollower::new(four, 0).unwrap();
        send(&mut f, 0, vec![store(&[11, 12], None, 0)], 0);
        send(&mut f, 1, vec![store(&[21], None, 100)], 1);
        send(&mut f, 3, vec![store(&[13], Some(12), 8)], 2); // 2 lost: a resync
        assert_eq!(f.unconfirmed_blocks(), 1);
        send(&mut f, 4, vec![removed(&[12])], 3); // 11 is a leaf again
        send(&mut f, 5, vec![store(&[31], None, 200)], 4);
        send(&mut f, 6, vec![store(&[41], None, 300)], 5);
        send(&mut f, 7, vec![store(&[51], None, 400)], 6);
        assert_eq!(held(&f, 100, 104), 0, "the unconfirmed leaf went");
        assert_eq!(held(&f, 0, 4), 1);
        assert_eq!(f.engine_blocks(), 4);

        // A chain longer than the cap keeps its start: its own parent is never the
        // one evicted for it.
        let one = KvFollowerConfig {
            max_engine_blocks: 1,
            ..cfg()
        };
        let mut f = KvEventFollower::new(one, 0).unwrap();
        send(&mut f, 0, vec![store(&[11, 12], None, 0)], 0);
        assert_eq!(held(&f, 0, 8), 1);
        assert_eq!(f.counters().dropped_blocks, 1);
    }
}
