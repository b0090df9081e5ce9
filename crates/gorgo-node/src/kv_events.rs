//! The engine's KV events (`engine.kv_events`): a ZeroMQ SUB task feeding the core's
//! [`KvEventFollower`], whose changes drive the node's prefix index instead of the
//! shadow model while the stream is healthy (docs/kv-events.md).
//!
//! The task owns the sockets and the clock; the follower decides. Replays run on their
//! own DEALER socket, one per request, and hand their messages back through a bounded
//! channel; their wait is capped by the follower's replay timeout. Nothing a publisher
//! sends panics the node: the follower counts it and resyncs, and both sockets
//! connect through [`crate::kv_guard`]'s relay, which cuts a connection at a frame
//! header over the limits before the `zeromq` decoder reserves memory for it.
//!
//! The relay also says when the engine closes the SUB connection: the engine may have
//! restarted, so the follower stops trusting its picture
//! ([`KvEventFollower::on_disconnected`]) and the task subscribes again on a new
//! socket after a pause (`TICK`), retrying every `CONNECT_RETRY`. Left to itself, the `zeromq`
//! SUB socket reconnects with a backoff that grows to 30 s (its `ReconnectConfig`,
//! which 0.6 does not let a socket set), and whatever a restarted engine published
//! meanwhile was lost without a sign.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gorgo_core::kv_events::{FollowerAction, IndexSource, KvEventFollower, KvFollowerConfig};
use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::config::{EngineSection, ValidatedConfig};
use crate::error::NodeError;
use crate::kv_guard::{self, RejectCounters};
use crate::shadow::LocalCache;
use crate::NodeState;

/// How often the follower's clock is advanced (replay deadlines, silence, warm-up).
const TICK: Duration = Duration::from_millis(200);

/// Replay messages waiting for the follower at most; the replay task waits beyond.
/// Each may be a batch of `kv_events_max_message_bytes` (8 MiB by default), so 8 of
/// them hold about what the live backlog may (64 MiB); 256 let a fast replay queue
/// two gigabytes ahead of a follower still applying them.
const REPLAY_CHANNEL: usize = 8;

/// How long a connect to the publisher may take (the socket retries within it)
/// before it is started again.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The pause between two connects that timed out.
const CONNECT_RETRY: Duration = Duration::from_secs(1);

/// The node's blocks in tokens: with a tokenizer, `routing.block_tokens`; without,
/// the byte blocks at 4 bytes per "token" (an engine that hashes bytes, like the
/// emulator without a tokenizer, publishes 4-byte chunks as token ids).
pub fn node_block_tokens(config: &ValidatedConfig) -> usize {
    match config.shared_engine().tokenizer {
        Some(_) => config.routing.block_tokens,
        None => config.routing.block_bytes / gorgo_core::hash::BYTES_PER_TOKEN,
    }
}

/// The follower and what `/admin/state` shows of it.
#[derive(Debug)]
pub struct KvEvents {
    follower: Mutex<KvEventFollower>,
    /// Dispatches not yet handed to the follower: counted here by the request path,
    /// which must not wait on the follower's lock (held while a batch of up to 8 MiB
    /// decodes, or a replay's held batches are fed again), and handed over by the
    /// event task each time it takes the lock ([`KvEvents::follower`]).
    dispatched: AtomicU64,
    endpoint: String,
    replay_endpoint: Option<String>,
    replay_timeout: Duration,
    /// The frame limits of the relay in front of both sockets.
    frame_limits: gorgo_core::zmtp::FrameLimits,
    /// Connections the relay cut at a frame it refused.
    refused_frames: Arc<AtomicU64>,
}

/// What `/admin/state` shows under `kv_events`.
#[derive(Debug, Clone, Serialize)]
pub struct KvEventsView {
    /// The publisher subscribed to.
    pub endpoint: String,
    /// Its replay socket.
    pub replay_endpoint: Option<String>,
    /// The source the prefix index follows now: `events` or `shadow`.
    pub source: IndexSource,
    /// Since when, node milliseconds (`uptime_ms` of the switch).
    pub source_since_ms: u64,
    /// Why the index follows the shadow model, when it does.
    pub fallback_reason: Option<&'static str>,
    /// Seconds on the shadow model since the node started.
    pub fallback_seconds: f64,
    /// Engine blocks tracked.
    pub engine_blocks: usize,
    /// Of those, the blocks a resync for lost events kept unconfirmed: the engine may
    /// hold them without storing them again (a hot prefix), so they stay until it
    /// removes them, stores them again, or the block cap evicts them.
    pub unconfirmed_blocks: usize,
    /// Node blocks the events say the engine holds.
    pub node_blocks: usize,
    /// The stream's counters.
    pub counters: gorgo_core::kv_events::KvEventCounters,
    /// Connections to the publisher cut by the relay at a frame the decoder must not
    /// read: a header over the limits (a message over `kv_events_max_message_bytes`
    /// plus 64 KiB, or over 8 frames) or a command whose lengths overrun it.
    pub refused_frames: u64,
}

impl KvEvents {
    /// The follower for `engine`'s `kv_events`, when configured.
    pub fn from_config(
        config: &ValidatedConfig,
        engine: &EngineSection,
        now_ms: u64,
    ) -> Result<Option<Self>, NodeError> {
        let Some(endpoint) = engine.kv_events.clone() else {
            return Ok(None);
        };
        let node_block_tokens = node_block_tokens(config);
        let follower_config = KvFollowerConfig {
            max_engine_blocks: engine.kv_events_max_blocks,
            max_payload_bytes: engine.kv_events_max_message_bytes,
            replay: engine.kv_events_replay.is_some(),
            warmup_ms: engine.kv_events_warmup_ms,
            silence_ms: engine.kv_events_silence_ms,
            ..KvFollowerConfig::new(node_block_tokens)
        };
        let follower = KvEventFollower::new(follower_config.clone(), now_ms).map_err(|e| match e {
            gorgo_core::CoreError::InvalidConfig { field, reason } if field == "node_block_tokens" => {
                NodeError::Config(format!(
                    "invalid `routing.block_tokens` (or `routing.block_bytes` / 4) for engine.kv_events: {reason}"
                ))
            }
            other => NodeError::Config(format!("invalid `engine.kv_events`: {other}")),
        })?;
        Ok(Some(KvEvents {
            replay_timeout: Duration::from_millis(follower_config.replay_timeout_ms),
            follower: Mutex::new(follower),
            dispatched: AtomicU64::new(0),
            endpoint,
            replay_endpoint: engine.kv_events_replay.clone(),
            frame_limits: gorgo_core::zmtp::FrameLimits::for_kv_events(
                follower_config.max_payload_bytes,
            ),
            refused_frames: Arc::default(),
        }))
    }

    /// The node dispatched a request to its engine (the silence check).
    pub fn on_dispatch(&self) {
        self.dispatched.fetch_add(1, Ordering::Relaxed);
    }

    /// The follower, told of the dispatches since it last was: before a batch it is
    /// to apply (which resets the count) and before a tick (which reads it).
    fn follower(&self) -> parking_lot::MutexGuard<'_, KvEventFollower> {
        let mut f = self.follower.lock();
        f.on_dispatches(self.dispatched.swap(0, Ordering::Relaxed));
        f
    }

    /// The source the index follows now.
    pub fn source(&self) -> IndexSource {
        self.follower.lock().source()
    }

    /// The `/admin/state` view at `now_ms`.
    pub fn view(&self, now_ms: u64) -> KvEventsView {
        let f = self.follower.lock();
        KvEventsView {
            endpoint: self.endpoint.clone(),
            replay_endpoint: self.replay_endpoint.clone(),
            source: f.source(),
            source_since_ms: f.source_since_ms(),
            fallback_reason: f.fallback_reason(),
            fallback_seconds: f.fallback_ms(now_ms) as f64 / 1000.0,
            engine_blocks: f.engine_blocks(),
            unconfirmed_blocks: f.unconfirmed_blocks(),
            node_blocks: f.node_blocks(),
            counters: *f.counters(),
            refused_frames: self.refused_frames.load(Ordering::Relaxed),
        }
    }
}

/// The engine whose events a [`run`] follows: its number and its prefix index (the
/// caller's `LocalEngine` lends them; this module does not know that type, so that the
/// engine may own its [`KvEvents`] without the two modules importing each other).
#[derive(Clone, Copy)]
pub struct FollowedEngine<'a> {
    /// The engine's replica number (metrics, gossip).
    pub replica: u16,
    /// The index the events drive.
    pub shadow: &'a Mutex<LocalCache>,
}

/// Subscribe to the engine's KV events until `shutdown`, feeding the follower and the
/// node's index. Connection failures are retried (the publisher may start later than
/// the node, or restart); the follower's view of them is what the metrics show.
pub async fn run(
    state: Arc<NodeState>,
    engine: FollowedEngine<'_>,
    kv: &KvEvents,
    shutdown: CancellationToken,
) {
    let rejects = RejectCounters {
        engine: kv.refused_frames.clone(),
        node: state.metrics.kv_events.refused_frames.clone(),
    };
    // Told when the engine closes the SUB connection (not the replay ones: a replay's
    // connection ends with it).
    let engine_closed = kv_guard::EngineClosed::default();
    let guarded = |upstream: String, closed: Option<kv_guard::EngineClosed>| {
        let (rejects, shutdown) = (rejects.clone(), shutdown.clone());
        async move {
            match kv_guard::start(&upstream, kv.frame_limits, rejects, closed, shutdown).await {
                Ok(g) => Some(g.endpoint),
                Err(e) => {
                    tracing::error!(upstream, error = %e, "kv events: cannot start the frame relay; events not followed");
                    None
                }
            }
        }
    };
    let Some(endpoint) = guarded(kv.endpoint.clone(), Some(engine_closed.clone())).await else {
        return;
    };
    let replay_endpoint = match kv.replay_endpoint.clone() {
        Some(upstream) => match guarded(upstream, None).await {
            Some(local) => Some(local),
            None => return,
        },
        None => None,
    };
    let Some(mut sub) = subscribe(&endpoint, &kv.endpoint, &shutdown).await else {
        return;
    };
    kv.follower.lock().on_subscribed(state.now_ms());
    let mut silences = kv.follower.lock().counters().silences;
    // A channel per replay: what an aborted replay left queued goes with it (its end
    // marker would otherwise end the next replay early).
    let (_, mut replay_rx) = mpsc::channel::<Vec<bytes::Bytes>>(REPLAY_CHANNEL);
    let mut replay_task: Option<tokio::task::JoinHandle<()>> = None;
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut actions = apply_follower(&state, engine, kv);
    loop {
        for FollowerAction::RequestReplay { from_seq } in actions {
            let Some(replay_endpoint) = replay_endpoint.clone() else {
                continue;
            };
            if let Some(old) = replay_task.take() {
                old.abort();
            }
            let (replay_tx, rx) = mpsc::channel(REPLAY_CHANNEL);
            replay_rx = rx;
            tracing::info!(from_seq, "kv events: asking for a replay");
            replay_task = Some(tokio::spawn(replay(
                replay_endpoint,
                from_seq,
                kv.replay_timeout,
                replay_tx,
            )));
        }
        let mut closed = false;
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = engine_closed.notified() => {
                closed = true;
                let now = state.now_ms();
                kv.follower().on_disconnected(now);
            }
            msg = sub.recv() => match msg {
                Ok(msg) => {
                    let frames = msg.into_vec();
                    let parts: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
                    let now = state.now_ms();
                    kv.follower().on_message(&parts, now);
                }
                Err(e) => {
                    // The socket reconnects by itself; do not spin on a broken one.
                    tracing::warn!(error = %e, "kv events: receive failed");
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(TICK) => {}
                    }
                }
            },
            Some(frames) = replay_rx.recv() => {
                let parts: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
                let now = state.now_ms();
                kv.follower().on_replay_message(&parts, now);
            }
            _ = tick.tick() => {
                let now = state.now_ms();
                kv.follower().tick(now);
            }
        }
        actions = apply_follower(&state, engine, kv);
        // A silent stream while requests were served: the connection may be dead
        // without a word (a NAT or load balancer dropped the flow, the engine's host
        // went away), which TCP and ZeroMQ would not notice while nothing is sent.
        // A connection the engine closed: it may have restarted, and the socket's own
        // reconnect backs off up to 30 s. Either way, subscribe again on a new
        // connection now.
        let now_silences = kv.follower.lock().counters().silences;
        let silent = now_silences > silences;
        if silent || closed {
            silences = now_silences;
            if silent {
                tracing::warn!(
                    endpoint = kv.endpoint,
                    "kv events: the stream went silent; subscribing again"
                );
            } else {
                tracing::warn!(
                    endpoint = kv.endpoint,
                    "kv events: the engine closed the connection (it may have restarted); subscribing again"
                );
            }
            drop(sub);
            if closed {
                // A pause first, so an engine that takes a connection and closes it at
                // once is not reconnected to in a loop.
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(TICK) => {}
                }
            }
            let Some(again) = subscribe(&endpoint, &kv.endpoint, &shutdown).await else {
                break;
            };
            sub = again;
            kv.follower.lock().on_subscribed(state.now_ms());
            actions.extend(apply_follower(&state, engine, kv));
        }
    }
    if let Some(task) = replay_task {
        task.abort();
    }
}

/// A SUB socket on `endpoint` (the relay before `upstream`, named in the logs),
/// retried until it connects; `None` at `shutdown`.
async fn subscribe(
    endpoint: &str,
    upstream: &str,
    shutdown: &CancellationToken,
) -> Option<zeromq::SubSocket> {
    loop {
        match connect_sub(endpoint).await {
            Ok(sub) => {
                tracing::info!(endpoint = upstream, "kv events: subscribed");
                return Some(sub);
            }
            Err(e) => {
                tracing::warn!(endpoint = upstream, error = %e, "kv events: cannot subscribe yet");
                tokio::select! {
                    _ = shutdown.cancelled() => return None,
                    _ = tokio::time::sleep(CONNECT_RETRY) => {}
                }
            }
        }
    }
}

/// Hand the follower's changes to the node's index and gossip; returns its actions.
fn apply_follower(
    state: &NodeState,
    engine: FollowedEngine<'_>,
    kv: &KvEvents,
) -> Vec<FollowerAction> {
    let (actions, changes, source, counters, fallback_ms, reason) = {
        let mut f = kv.follower.lock();
        let now = state.now_ms();
        (
            f.take_actions(),
            f.take_changes(),
            f.source(),
            *f.counters(),
            f.fallback_ms(now),
            f.fallback_reason(),
        )
    };
    // The engine left the node while this batch was on its way: nothing of it counts,
    // and its index is gossiped no more.
    let Some(was) = state
        .metrics
        .kv_events
        .observe(engine.replica, &counters, fallback_ms, source)
    else {
        return Vec::new();
    };
    if counters.resyncs > was.resyncs {
        tracing::warn!(
            reason = reason.unwrap_or("resync"),
            resyncs = counters.resyncs,
            decode_errors = counters.decode_errors,
            "kv events: resync onto the shadow model"
        );
    }
    if counters.restarts > was.restarts {
        tracing::warn!(
            restarts = counters.restarts,
            "kv events: the publisher restarted"
        );
    }
    if counters.gaps > was.gaps {
        tracing::info!(gaps = counters.gaps, "kv events: a gap in the sequence");
    }
    let now = state.now_ms();
    state.change_index(engine.replica, engine.shadow, |cache| {
        let switched = (cache.source() != source).then(|| {
            tracing::info!(
                ?source,
                reason = reason.unwrap_or(""),
                "kv events: the prefix index follows a new source"
            );
            cache.set_source(source)
        });
        let applied = (!changes.is_empty()).then(|| cache.apply_kv_changes(&changes, now));
        [switched.flatten(), applied.flatten()]
    });
    actions
}

async fn connect_sub(endpoint: &str) -> Result<zeromq::SubSocket, zeromq::ZmqError> {
    let mut options = zeromq::SocketOptions::default();
    options.connect_timeout(CONNECT_TIMEOUT);
    let mut sub = zeromq::SubSocket::with_options(options);
    sub.connect(endpoint).await?;
    sub.subscribe("").await?;
    Ok(sub)
}

/// One replay: ask `endpoint` for every batch from `from_seq`, pass each answer on
/// until the end marker, within `timeout` in all.
async fn replay(
    endpoint: String,
    from_seq: u64,
    timeout: Duration,
    out: mpsc::Sender<Vec<bytes::Bytes>>,
) {
    let work = async {
        let mut options = zeromq::SocketOptions::default();
        options.connect_timeout(timeout);
        let mut dealer = zeromq::DealerSocket::with_options(options);
        dealer.connect(&endpoint).await?;
        // A DEALER speaks to the ROUTER as a REQ would: an empty delimiter first.
        let mut request = ZmqMessage::from(Vec::<u8>::new());
        request.push_back(bytes::Bytes::copy_from_slice(
            &gorgo_core::kv_wire::encode_seq(from_seq as i64),
        ));
        dealer.send(request).await?;
        loop {
            let frames = dealer.recv().await?.into_vec();
            let end = frames
                .iter()
                .rev()
                .nth(1)
                .is_some_and(|seq| seq.as_ref() == gorgo_core::kv_wire::encode_seq(-1));
            if out.send(frames).await.is_err() || end {
                return Ok::<(), zeromq::ZmqError>(());
            }
        }
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(endpoint, error = %e, "kv events: replay failed"),
        Err(_) => tracing::warn!(endpoint, "kv events: replay timed out"),
    }
}
