//! The emulator: an OpenAI-compatible HTTP server in front of one [`Engine`].
//!
//! One tokio task owns the `Engine` and drives it on the real clock: it sleeps until
//! the engine's next event or a new command, steps the engine, and pushes each token to
//! the request's channel. HTTP handlers only stamp the arrival, parse, submit and
//! stream; the engine queues by the arrival stamp. A handler or response body that is
//! dropped once the request was submitted (client gone) aborts its request, freeing its
//! slot and KV reference.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::{Future, IntoFuture};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::Router;
use gorgo_core::kv_wire::KvEvent;
use gorgo_core::prompt::Endpoint;
use gorgo_core::HashChain;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::metrics::MetricsSnapshot;
use crate::openai::{self, BadRequest, ResponseMeta};
use crate::{EmulatedKind, Engine, EngineError, EngineEvent, EngineRequest, Profile, RejectReason};

/// How the emulator serves.
#[derive(Debug, Clone)]
pub struct EmulatorConfig {
    /// Costs and limits of the emulated engine.
    pub profile: Profile,
    /// The engine it passes for: `/metrics` names, `/get_server_info` (SGLang only),
    /// API defaults and error bodies.
    pub kind: EmulatedKind,
    /// Model name to report; `None`: the profile's `model`.
    pub model_name: Option<String>,
    /// Prefix-cache block size over prompt bytes (64 bytes = 16 tokens, SGLang-like pages).
    pub block_bytes: usize,
    /// Requests allowed to wait for admission; beyond it new requests get 503. Every
    /// request waits there before admission, so 0 refuses them all (`gorgo engine`
    /// refuses `--max-queue 0`).
    pub max_queue: usize,
    /// Largest request body accepted, bytes (413 beyond).
    pub max_body_bytes: usize,
    /// Output tokens when a request gives no limit (a chat request without
    /// `max_tokens`, whose output both engines let take what the context leaves) nor
    /// `gorgo_output_tokens`: where the emulated answer ends, cut to the context's room.
    /// A completions request without `max_tokens` gets OpenAI's 16
    /// ([`openai::COMPLETIONS_DEFAULT_MAX_TOKENS`]).
    pub default_max_tokens: u32,
    /// Count prompt tokens with the model's tokenizer and chat template, as a real
    /// engine does, instead of canonical bytes / 4: `usage.prompt_tokens`, the context
    /// check and the prefix cache (blocks of `block_bytes / 4` token ids) follow it.
    pub tokenizer: Option<Arc<gorgo_tokenizer::EngineTokenizer>>,
    /// How long a shutdown waits for the requests in flight to finish before it cuts
    /// the connections left: a client that stopped reading a stream must not keep
    /// the emulator up forever.
    pub drain_timeout: Duration,
}

impl EmulatorConfig {
    /// Defaults around `profile`: SGLang, 64-byte blocks, queue limit 1024, 16 MiB
    /// bodies, 128 output tokens where a request sets no limit (the paper's
    /// `max_tokens`), a 30 s drain (a node's default drain deadline).
    pub fn new(profile: Profile) -> Self {
        EmulatorConfig {
            profile,
            kind: EmulatedKind::default(),
            model_name: None,
            block_bytes: 64,
            max_queue: 1024,
            max_body_bytes: 16 << 20,
            default_max_tokens: 128,
            tokenizer: None,
            drain_timeout: Duration::from_secs(30),
        }
    }

    /// Most prompts one completions batch may hold: each waits in the queue as a
    /// request of its own, so a batch larger than the queue could never be admitted,
    /// and beyond [`MAX_BATCH_PROMPTS`] one body would hold the engine alone.
    fn max_batch_prompts(&self) -> usize {
        self.max_queue.min(MAX_BATCH_PROMPTS)
    }

    fn model(&self) -> String {
        self.model_name
            .clone()
            .unwrap_or_else(|| self.profile.model.clone())
    }

    /// Tokens per prefix-cache block (vLLM's page states its capacity in them).
    fn block_tokens(&self) -> u64 {
        (self.block_bytes / gorgo_core::hash::BYTES_PER_TOKEN) as u64
    }
}

/// Most prompts in one completions batch, whatever the queue allows.
pub const MAX_BATCH_PROMPTS: usize = 1024;

/// What the driver tells one request's HTTP stream.
#[derive(Debug)]
enum Progress {
    First { cached_tokens: u64 },
    Token,
    Done { output_tokens: u32 },
}

/// One sequence of a submission: a request's prompt, or one prompt of a completions
/// batch (each its own engine request, as vLLM and SGLang serve a batch).
struct Sequence {
    req: EngineRequest,
    /// The prompt's token ids, for the KV events (only when they are published).
    token_ids: Option<Arc<[u32]>>,
}

/// What one request's stream hears: which choice (the prompt's index in its batch)
/// and what happened to it.
type ChoiceProgress = (usize, Progress);

enum Command {
    /// A request's sequences, admitted all or none (a batch that is half queued
    /// could only be half answered).
    Submit {
        seqs: Vec<Sequence>,
        /// When the handler had read the body: the engine queues by it, not by when
        /// the driver gets the command after the body was parsed and hashed (that
        /// takes longer for larger prompts).
        received: Instant,
        progress: mpsc::UnboundedSender<ChoiceProgress>,
        reply: oneshot::Sender<Result<(), RejectReason>>,
    },
    Abort {
        id: u64,
    },
    Metrics {
        reply: oneshot::Sender<MetricsSnapshot>,
    },
}

#[derive(Clone)]
struct AppState {
    commands: mpsc::UnboundedSender<Command>,
    config: Arc<EmulatorConfig>,
    model: Arc<str>,
    next_id: Arc<AtomicU64>,
    /// Whether KV events are published (requests then carry their token ids).
    kv_events: bool,
}

/// Serve the emulator on `listener` until `shutdown` resolves, then drain: no new
/// connections, the requests in flight finish, for at most
/// [`EmulatorConfig::drain_timeout`]; past it the connections left are cut.
pub async fn serve(
    listener: tokio::net::TcpListener,
    config: EmulatorConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), EngineError> {
    serve_with_kv_events(listener, config, None, shutdown).await
}

/// [`serve`], publishing the cache's KV events on `kv_events` (bound by the caller, so
/// it knows the ports: [`crate::kv_events::KvPublisher::bind`]).
pub async fn serve_with_kv_events(
    listener: tokio::net::TcpListener,
    config: EmulatorConfig,
    kv_events: Option<crate::kv_events::KvPublisher>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), EngineError> {
    let (commands, rx) = mpsc::unbounded_channel();
    let drain_timeout = config.drain_timeout;
    let mut engine = Engine::new(config.profile.clone());
    engine.set_max_waiting(Some(config.max_queue));
    engine.set_record_cache_changes(kv_events.is_some());
    // The model's time 0, fixed before any handler can stamp a request.
    let driver = Driver::new(
        engine,
        Instant::now(),
        kv_events.as_ref().map(|p| p.block_tokens()),
        config.kind,
    );
    let state = AppState {
        kv_events: kv_events.is_some(),
        commands,
        model: config.model().into(),
        config: Arc::new(config),
        next_id: Arc::new(AtomicU64::new(1)),
    };
    let driver = tokio::spawn(drive(driver, rx, kv_events));
    let app = router(state);
    let listener = listener.tap_io(|tcp| {
        // Tokens go out one small SSE chunk at a time: never wait for Nagle.
        let _ = tcp.set_nodelay(true);
    });
    let (stopping, stopped) = oneshot::channel::<()>();
    let server = axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown.await;
            let _ = stopping.send(());
        })
        .into_future();
    let deadline = async move {
        match stopped.await {
            Ok(()) => tokio::time::sleep(drain_timeout).await,
            // The server ended by itself: its own result decides.
            Err(_) => std::future::pending().await,
        }
    };
    let result = tokio::select! {
        result = server => result.map_err(EngineError::Serve),
        () = deadline => {
            tracing::warn!(
                deadline_s = drain_timeout.as_secs_f64(),
                "drain deadline passed: cutting the connections left"
            );
            Ok(())
        }
    };
    // Without the driver, every stream still open ends at once (an error event); the
    // connection tasks go with the runtime.
    driver.abort();
    result
}

fn router(state: AppState) -> Router {
    let router = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics));
    // SGLang's own route; vLLM has none (404), and a node of kind `vllm` never asks.
    let router = match state.config.kind {
        EmulatedKind::Sglang => router.route("/get_server_info", get(server_info)),
        EmulatedKind::Vllm => router,
    };
    router
        // After the routes: it applies to the routes registered so far.
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        .with_state(state)
}

/// One live request as the driver knows it.
struct Live {
    progress: mpsc::UnboundedSender<ChoiceProgress>,
    /// Its index among its request's choices.
    choice: usize,
    /// Its arrival stamp, model ms (TTFT and E2E are measured from it).
    arrival_ms: f64,
}

/// The engine task's state and logic, without the sockets and the real clock: what it
/// does on each command and after each wakeup, synchronous so that tests can run it
/// at chosen instants.
struct Driver {
    engine: Engine,
    /// The model's time 0.
    start: Instant,
    /// Token ids of the live requests, for the KV events (bounded by the queue and the
    /// running slots: entries leave with their request).
    token_ids: HashMap<u64, Arc<[u32]>>,
    /// Requests aborted since the last step. Their token ids stay until that step has
    /// encoded its cache changes: the abort itself can complete a prefill iteration
    /// that stored the request's blocks.
    aborted: Vec<u64>,
    streams: HashMap<u64, Live>,
    snapshot: MetricsSnapshot,
    events: Vec<EngineEvent>,
    /// Tokens per KV-event block; `None`: no KV events.
    kv_block_tokens: Option<usize>,
}

impl Driver {
    fn new(
        engine: Engine,
        start: Instant,
        kv_block_tokens: Option<usize>,
        kind: EmulatedKind,
    ) -> Self {
        Driver {
            engine,
            start,
            token_ids: HashMap::new(),
            aborted: Vec::new(),
            streams: HashMap::new(),
            snapshot: MetricsSnapshot::new(kind),
            events: Vec::new(),
            kv_block_tokens,
        }
    }

    /// Model time of `t`, ms (0 for instants before the start).
    fn ms(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.start).as_secs_f64() * 1000.0
    }

    /// When the engine next needs a step; `None`: nothing to do (or too far away to
    /// represent, which is as good as never). One microsecond late on purpose: the
    /// round trip through `Duration` may truncate, and a step at a model time a hair
    /// before the event would do nothing and wake again at once (a busy loop).
    fn wake(&self) -> Option<Instant> {
        let t = self.engine.next_event_time()?;
        let after = Duration::try_from_secs_f64(t.max(0.0) / 1000.0).ok()?;
        self.start
            .checked_add(after)?
            .checked_add(Duration::from_micros(1))
    }

    /// Apply one command at `now`; returns the KV events of a step it had to take
    /// (empty unless it stepped, and without KV events).
    fn handle(&mut self, cmd: Command, now: Instant) -> Vec<KvEvent> {
        let now_ms = self.ms(now);
        match cmd {
            Command::Submit {
                seqs,
                received,
                progress,
                reply,
            } => {
                let arrival_ms = self.ms(received).min(now_ms);
                let mut result = Ok(());
                let mut admitted = Vec::with_capacity(seqs.len());
                for (choice, Sequence { req, token_ids }) in seqs.into_iter().enumerate() {
                    let id = req.id;
                    result = self.engine.submit_at(req, arrival_ms, now_ms);
                    if result.is_err() {
                        break;
                    }
                    admitted.push(id);
                    self.streams.insert(
                        id,
                        Live {
                            progress: progress.clone(),
                            choice,
                            arrival_ms,
                        },
                    );
                    if let Some(ids) = token_ids {
                        self.token_ids.insert(id, ids);
                    }
                }
                if result.is_err() {
                    // All or none: the sequences queued before the refused one leave.
                    for id in admitted {
                        self.abort(id, now_ms);
                    }
                }
                let _ = reply.send(result);
                Vec::new()
            }
            Command::Abort { id } => {
                self.abort(id, now_ms);
                Vec::new()
            }
            Command::Metrics { reply } => {
                // A full step, not only the engine's: the requests this advance
                // finished must be in the counters and histograms of the same scrape
                // as the gauges they left.
                let kv = self.step(now);
                self.snapshot.stats = self.engine.stats();
                let _ = reply.send(self.snapshot.clone());
                kv
            }
        }
    }

    /// Abort request `id` (if still live) at model time `now_ms`.
    fn abort(&mut self, id: u64, now_ms: f64) {
        if self.streams.remove(&id).is_some() {
            self.engine.abort(id, now_ms);
        }
        if self.token_ids.contains_key(&id) {
            self.aborted.push(id);
        }
    }

    /// Run the engine up to `now`, tell each request's stream what happened to it, and
    /// return the KV events of the cache changes since the last step (empty without
    /// KV events).
    fn step(&mut self, now: Instant) -> Vec<KvEvent> {
        self.engine.step_into(self.ms(now), &mut self.events);
        let kv = match self.kv_block_tokens {
            Some(block_tokens) => {
                let changes = self.engine.take_cache_changes();
                crate::kv_events::encode_changes(&changes, &self.token_ids, block_tokens)
            }
            None => Vec::new(),
        };
        for id in self.aborted.drain(..) {
            self.token_ids.remove(&id);
        }
        for event in self.events.drain(..) {
            match event {
                EngineEvent::FirstToken {
                    id,
                    at_ms,
                    cached_tokens,
                } => {
                    if let Some(live) = self.streams.get(&id) {
                        self.snapshot
                            .ttft
                            .observe((at_ms - live.arrival_ms) / 1000.0);
                        let _ = live
                            .progress
                            .send((live.choice, Progress::First { cached_tokens }));
                    }
                }
                EngineEvent::DecodeStep { ids, .. } => {
                    for id in ids {
                        if let Some(live) = self.streams.get(&id) {
                            let _ = live.progress.send((live.choice, Progress::Token));
                        }
                    }
                }
                EngineEvent::Finished {
                    id,
                    at_ms,
                    output_tokens,
                } => {
                    self.token_ids.remove(&id);
                    if let Some(live) = self.streams.remove(&id) {
                        self.snapshot
                            .e2e
                            .observe((at_ms - live.arrival_ms) / 1000.0);
                        self.snapshot.requests_total += 1;
                        let _ = live
                            .progress
                            .send((live.choice, Progress::Done { output_tokens }));
                    }
                }
                EngineEvent::Rejected { id, .. } => {
                    self.token_ids.remove(&id);
                }
            }
        }
        kv
    }
}

/// The engine task: owns the model, runs it on the real clock.
async fn drive(
    mut driver: Driver,
    mut rx: mpsc::UnboundedReceiver<Command>,
    mut kv_events: Option<crate::kv_events::KvPublisher>,
) {
    loop {
        let wake = driver.wake();
        let mut kv = Vec::new();
        tokio::select! {
            cmd = rx.recv() => {
                let Some(cmd) = cmd else { return };
                kv = driver.handle(cmd, Instant::now());
            }
            _ = sleep_until(wake) => {}
        }
        let now = Instant::now();
        kv.extend(driver.step(now));
        if let (Some(publisher), false) = (&mut kv_events, kv.is_empty()) {
            // vLLM stamps a batch with `time.time()`: consumers measure event lag by it.
            let unix_s = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            publisher.publish(kv, unix_s);
        }
    }
}

/// A byte prompt as little-endian `u32` "token ids" of 4 bytes each. Trailing bytes
/// short of 4 get no id: the block holding them counts them as a token (the chain
/// rounds up) but has fewer ids than tokens, so it is not published. A padded id would
/// publish it with ids that do not hash back to the block's hash, which covers the
/// bytes as they are.
fn byte_chunk_ids(bytes: &[u8]) -> Arc<[u32]> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("chunks of 4 bytes")))
        .collect()
}

async fn sleep_until(wake: Option<Instant>) {
    match wake {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// An error answer in the body shape of the engine `kind` passes for.
fn error_response(
    kind: EmulatedKind,
    status: StatusCode,
    message: &str,
    err_type: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> Response {
    (
        status,
        axum::Json(openai::error_body(kind, message, err_type, param, code)),
    )
        .into_response()
}

fn bad_request(kind: EmulatedKind, e: BadRequest) -> Response {
    error_response(
        kind,
        StatusCode::BAD_REQUEST,
        &e.message,
        "invalid_request_error",
        e.param,
        e.code,
    )
}

async fn not_found(State(state): State<AppState>, req: Request) -> Response {
    error_response(
        state.config.kind,
        StatusCode::NOT_FOUND,
        &format!("no route for {} {}", req.method(), req.uri().path()),
        "invalid_request_error",
        None,
        Some("not_found"),
    )
}

/// `GET /health`: 200 while the engine's driver task runs, 503 once it has stopped
/// (it panicked or returned), so a node's health probe takes a dead emulator out of
/// rotation instead of routing requests that can only fail.
async fn health(State(state): State<AppState>) -> Response {
    if state.commands.is_closed() {
        return error_response(
            state.config.kind,
            StatusCode::SERVICE_UNAVAILABLE,
            "the engine has stopped",
            "server_error",
            None,
            Some("unavailable"),
        );
    }
    StatusCode::OK.into_response()
}

/// A known route with the wrong method: OpenAI's error JSON rather than an empty 405.
async fn method_not_allowed(State(state): State<AppState>, req: Request) -> Response {
    error_response(
        state.config.kind,
        StatusCode::METHOD_NOT_ALLOWED,
        &format!(
            "method {} not allowed on {}",
            req.method(),
            req.uri().path()
        ),
        "invalid_request_error",
        None,
        Some("method_not_allowed"),
    )
}

async fn models(State(state): State<AppState>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": &*state.model,
            "object": "model",
            "created": 0,
            "owned_by": "gorgo-engine",
            "root": &*state.model,
            "max_model_len": state.config.profile.context_length,
        }],
    }))
    .into_response()
}

/// `GET /get_server_info`: the profile's limits under SGLang's names, so a node learns
/// the emulator's concurrency limit the way it learns a real SGLang server's.
async fn server_info(State(state): State<AppState>) -> Response {
    let p = &state.config.profile;
    axum::Json(json!({
        "model_path": &*state.model,
        "served_model_name": &*state.model,
        "max_running_requests": p.max_running_requests,
        "max_total_num_tokens": p.max_total_tokens,
        "chunked_prefill_size": p.chunked_prefill_size,
        "context_length": p.context_length,
        "version": concat!("gorgo-engine ", env!("CARGO_PKG_VERSION")),
    }))
    .into_response()
}

async fn metrics(State(state): State<AppState>) -> Response {
    let (reply, rx) = oneshot::channel();
    if state.commands.send(Command::Metrics { reply }).is_err() {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    match rx.await {
        Ok(snapshot) => (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            snapshot.render(&state.model, state.config.block_tokens()),
        )
            .into_response(),
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

async fn chat(State(state): State<AppState>, req: Request) -> Response {
    complete(state, Endpoint::Chat, req).await
}

async fn completions(State(state): State<AppState>, req: Request) -> Response {
    complete(state, Endpoint::Completions, req).await
}

/// Sends `Abort` for its request's sequences when dropped armed: the client went
/// away. (Aborting a sequence that has finished changes nothing.)
struct AbortOnDrop {
    ids: std::ops::Range<u64>,
    commands: mpsc::UnboundedSender<Command>,
    armed: bool,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if self.armed {
            for id in self.ids.clone() {
                let _ = self.commands.send(Command::Abort { id });
            }
        }
    }
}

/// Why a request body could not be read: the two get different statuses.
enum BodyError {
    /// Over the configured limit: 413.
    TooLarge,
    /// The body itself is broken (a malformed chunked encoding, a connection cut
    /// mid-body): the client's fault, 400.
    Read(axum::Error),
}

/// Read a request body of at most `limit` bytes. Not `axum::body::to_bytes`: its one
/// error type does not say whether the limit or the read failed.
async fn read_body(body: Body, limit: usize) -> Result<Bytes, BodyError> {
    use futures::StreamExt;
    let mut stream = body.into_data_stream();
    let mut out = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(BodyError::Read)?;
        if out.len() + chunk.len() > limit {
            return Err(BodyError::TooLarge);
        }
        out.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(out))
}

async fn complete(state: AppState, endpoint: Endpoint, req: Request) -> Response {
    let kind = state.config.kind;
    let limit = state.config.max_body_bytes;
    let body = match read_body(req.into_body(), limit).await {
        Ok(b) => b,
        Err(BodyError::TooLarge) => {
            return error_response(
                kind,
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("request body over {limit} bytes"),
                "invalid_request_error",
                None,
                Some("request_too_large"),
            )
        }
        Err(BodyError::Read(e)) => {
            return error_response(
                kind,
                StatusCode::BAD_REQUEST,
                &format!("cannot read the request body: {e}"),
                "invalid_request_error",
                None,
                None,
            )
        }
    };
    // The request has arrived once its body has: a slow upload must not hold a place
    // in the queue it was not ready for, nor count its upload in TTFT. Stamped before
    // parsing and hashing, which take longer for larger prompts and must not change
    // the queue order (docs/engine-profiles.md, "Arrival").
    let received = Instant::now();
    let parsed = match openai::parse(
        kind,
        endpoint,
        &body,
        state.config.default_max_tokens,
        state.config.max_batch_prompts(),
    ) {
        Ok(p) => p,
        Err(e) => return bad_request(kind, e),
    };
    let param = openai::prompt_param(endpoint);
    // Each prompt's chain and KV-event token ids.
    let prompts: Vec<(HashChain, Option<Arc<[u32]>>)> = match &state.config.tokenizer {
        None => parsed
            .prompts
            .iter()
            .map(|prompt| {
                (
                    HashChain::from_bytes(
                        prompt,
                        state.config.block_bytes,
                        gorgo_core::hash::BYTES_PER_TOKEN,
                    ),
                    // The KV events' "token ids" of a byte-hashed prompt: its 4-byte
                    // chunks, which hash to the same chain (docs/kv-events.md).
                    state.kv_events.then(|| byte_chunk_ids(prompt)),
                )
            })
            .collect(),
        Some(tokenizer) => match tokenizer.each_prompt_ids(endpoint, &body) {
            Ok(each) => each
                .into_iter()
                .map(|ids| {
                    (
                        HashChain::from_token_ids(
                            &ids,
                            state.config.block_bytes / gorgo_core::hash::BYTES_PER_TOKEN,
                        ),
                        state.kv_events.then(|| Arc::from(ids)),
                    )
                })
                .collect(),
            Err(e) => {
                return bad_request(
                    kind,
                    BadRequest {
                        message: e.to_string(),
                        param: Some(param),
                        code: None,
                    },
                )
            }
        },
    };
    let context_length = state.config.profile.context_length;
    // Each prompt against the context on its own, with a budget of its own, as vLLM
    // checks a batch.
    let mut budgets = Vec::with_capacity(prompts.len());
    for (chain, _) in &prompts {
        match parsed.budget(chain.total_tokens().max(1), context_length) {
            Ok(b) => budgets.push(b),
            Err(e) => return bad_request(kind, e),
        }
    }
    let choices = prompts.len();
    let first_id = state.next_id.fetch_add(choices as u64, Ordering::Relaxed);
    let ids = first_id..first_id + choices as u64;
    let prompt_tokens: u64 = prompts
        .iter()
        .map(|(chain, _)| chain.total_tokens().max(1))
        .sum();
    let seqs = ids
        .clone()
        .zip(prompts)
        .zip(&budgets)
        .map(|((id, (chain, token_ids)), budget)| Sequence {
            req: EngineRequest {
                id,
                prompt_tokens: chain.total_tokens().max(1),
                chain,
                max_output_tokens: budget.output_tokens,
                arrival_ms: 0.0,
            },
            token_ids,
        })
        .collect();
    let (progress, mut progress_rx) = mpsc::unbounded_channel();
    let (reply, reply_rx) = oneshot::channel();
    let submitted = state.commands.send(Command::Submit {
        seqs,
        received,
        progress,
        reply,
    });
    let unavailable = || {
        error_response(
            kind,
            StatusCode::SERVICE_UNAVAILABLE,
            "engine is shutting down",
            "server_error",
            None,
            Some("unavailable"),
        )
    };
    if submitted.is_err() {
        return unavailable();
    }
    // Armed from here: a client that leaves while the driver has not answered yet
    // still aborts its request (the channel is FIFO, so the abort comes after the
    // submission, and aborting a refused request changes nothing).
    let mut guard = AbortOnDrop {
        ids,
        commands: state.commands.clone(),
        armed: true,
    };
    let refused = match reply_rx.await {
        Ok(Ok(())) => None,
        Ok(Err(RejectReason::QueueFull { limit })) => Some(error_response(
            kind,
            StatusCode::SERVICE_UNAVAILABLE,
            &format!("engine overloaded: {limit} requests already waiting"),
            "server_error",
            None,
            Some("overloaded"),
        )),
        Ok(Err(reason)) => Some(error_response(
            kind,
            StatusCode::BAD_REQUEST,
            &reason.to_string(),
            "invalid_request_error",
            None,
            Some("context_length_exceeded"),
        )),
        Err(_) => Some(unavailable()),
    };
    if let Some(response) = refused {
        guard.armed = false;
        return response;
    }
    let model = parsed
        .model
        .clone()
        .unwrap_or_else(|| state.model.to_string());
    let meta = ResponseMeta::new(endpoint, first_id, model, parsed.include_usage);
    let finish_reasons: Vec<&'static str> = budgets.iter().map(|b| b.finish_reason).collect();
    let mut choices = Choices::new(choices, prompt_tokens);
    if !parsed.stream {
        while let Some((choice, p)) = progress_rx.recv().await {
            if choices.record(choice, &p) {
                guard.armed = false;
                break;
            }
        }
        if guard.armed {
            return unavailable();
        }
        let texts: Vec<String> = choices
            .produced
            .iter()
            .map(|&n| openai::filler_text(n))
            .collect();
        let body = meta.full(&texts, &finish_reasons, choices.usage());
        return axum::Json(body).into_response();
    }
    let stream = SseStream {
        kind,
        rx: progress_rx,
        guard,
        meta,
        choices,
        finish_reasons,
        done: false,
    };
    let body = futures::stream::unfold(stream, |mut s| async move {
        let bytes = s.next_chunk().await?;
        Some((Ok::<Bytes, Infallible>(bytes), s))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .expect("static response parts")
}

/// What a request's choices have produced so far: one per prompt of a batch.
struct Choices {
    /// Tokens produced, per choice.
    produced: Vec<u32>,
    /// Choices not finished yet.
    left: usize,
    /// Prompt tokens found cached, summed over the choices.
    cached: u64,
    /// Prompt tokens, summed over the choices.
    prompt_tokens: u64,
}

impl Choices {
    fn new(n: usize, prompt_tokens: u64) -> Self {
        Choices {
            produced: vec![0; n],
            left: n,
            cached: 0,
            prompt_tokens,
        }
    }

    /// Count `progress` of `choice`; true once every choice is done.
    fn record(&mut self, choice: usize, progress: &Progress) -> bool {
        match *progress {
            Progress::First { cached_tokens } => {
                self.cached += cached_tokens;
                self.produced[choice] = 1;
            }
            Progress::Token => self.produced[choice] += 1,
            Progress::Done { output_tokens } => {
                self.produced[choice] = output_tokens;
                self.left -= 1;
            }
        }
        self.left == 0
    }

    /// `usage`, summed over the choices as vLLM sums a batch's.
    fn usage(&self) -> Value {
        let completion: u32 = self.produced.iter().sum();
        openai::usage(self.prompt_tokens, completion, self.cached)
    }
}

/// State of one SSE response: turns engine progress into `data:` chunks.
struct SseStream {
    /// Whose error event ends a stream the engine left.
    kind: EmulatedKind,
    rx: mpsc::UnboundedReceiver<ChoiceProgress>,
    guard: AbortOnDrop,
    meta: ResponseMeta,
    choices: Choices,
    /// Each choice's `finish_reason` (its own budget: [`openai::Budget`]).
    finish_reasons: Vec<&'static str>,
    done: bool,
}

impl SseStream {
    fn data(out: &mut Vec<u8>, v: &Value) {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(v.to_string().as_bytes());
        out.extend_from_slice(b"\n\n");
    }

    /// The next bytes to write, or `None` at the end of the stream: every event the
    /// engine has produced for this request by now (up to [`MAX_EVENTS_PER_WRITE`]),
    /// each its own SSE event, in one write. A stream that fell behind the model
    /// catches up with one write, not one per token (which, on a busy machine, made
    /// the lag grow with the work it caused).
    async fn next_chunk(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        let mut out = Vec::new();
        let first = self.rx.recv().await;
        self.render(first, &mut out);
        for _ in 1..MAX_EVENTS_PER_WRITE {
            if self.done {
                break;
            }
            match self.rx.try_recv() {
                Ok(p) => self.render(Some(p), &mut out),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => self.render(None, &mut out),
            }
        }
        Some(Bytes::from(out))
    }

    /// Append the SSE event(s) for `progress` (`None`: the engine went away).
    fn render(&mut self, progress: Option<ChoiceProgress>, out: &mut Vec<u8>) {
        let Some((choice, progress)) = progress else {
            // The engine went away mid-stream: an error event, then the end of the
            // stream as vLLM ends it (`[DONE]` after the error chunk).
            self.done = true;
            let v = openai::stream_error_body(
                self.kind,
                "engine stopped",
                "server_error",
                Some("unavailable"),
            );
            Self::data(out, &v);
            out.extend_from_slice(b"data: [DONE]\n\n");
            return;
        };
        // The token this event carries, counted before it is recorded.
        let k = self.choices.produced[choice];
        let all_done = self.choices.record(choice, &progress);
        let v = match progress {
            Progress::First { .. } => self.meta.chunk(choice, openai::token_text(0), true, None),
            Progress::Token => self.meta.chunk(choice, openai::token_text(k), false, None),
            Progress::Done { .. } => {
                self.meta
                    .chunk(choice, "", false, Some(self.finish_reasons[choice]))
            }
        };
        Self::data(out, &v);
        if all_done {
            self.guard.armed = false;
            self.done = true;
            if self.meta.include_usage {
                Self::data(out, &self.meta.usage_chunk(self.choices.usage()));
            }
            out.extend_from_slice(b"data: [DONE]\n\n");
        }
    }
}

/// Most SSE events one write of a stream carries ([`SseStream::next_chunk`]).
const MAX_EVENTS_PER_WRITE: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    /// A chat stream of one choice of request 1, fed by `rx`.
    fn one_choice_stream(
        rx: mpsc::UnboundedReceiver<ChoiceProgress>,
        commands: mpsc::UnboundedSender<Command>,
    ) -> SseStream {
        SseStream {
            kind: EmulatedKind::Vllm,
            rx,
            guard: AbortOnDrop {
                ids: 1..2,
                commands,
                armed: true,
            },
            meta: openai::ResponseMeta::new(Endpoint::Chat, 1, "m".into(), false),
            choices: Choices::new(1, 10),
            finish_reasons: vec!["length"],
            done: false,
        }
    }

    /// Events the engine produced while the stream was not polled go out in one write,
    /// each its own SSE event, in order, ending the stream when the request is done.
    #[test]
    fn a_stream_behind_the_model_catches_up_in_one_write() {
        let (tx, rx) = mpsc::unbounded_channel();
        let (commands, _commands_rx) = mpsc::unbounded_channel();
        let mut s = one_choice_stream(rx, commands);
        tx.send((0, Progress::First { cached_tokens: 0 })).unwrap();
        let first = s.next_chunk().now_or_never().flatten().unwrap();
        assert_eq!(first.windows(6).filter(|w| w == b"data: ").count(), 1);
        for _ in 0..3 {
            tx.send((0, Progress::Token)).unwrap();
        }
        tx.send((0, Progress::Done { output_tokens: 4 })).unwrap();
        let rest = s.next_chunk().now_or_never().flatten().unwrap();
        let text = std::str::from_utf8(&rest).unwrap();
        // Three tokens, the finish chunk, [DONE].
        assert_eq!(text.matches("data: ").count(), 5, "{text}");
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        assert!(!s.guard.armed);
        assert!(s.next_chunk().now_or_never().flatten().is_none());
    }

    /// An engine that goes away mid-stream ends the stream as vLLM ends a failed one:
    /// an error event, then `[DONE]` (a client waiting for it no longer hangs on).
    #[test]
    fn a_stream_the_engine_leaves_ends_with_an_error_then_done() {
        let (tx, rx) = mpsc::unbounded_channel();
        let (commands, _commands_rx) = mpsc::unbounded_channel();
        let mut s = one_choice_stream(rx, commands);
        tx.send((0, Progress::First { cached_tokens: 0 })).unwrap();
        drop(tx);
        let mut text = String::new();
        while let Some(chunk) = s.next_chunk().now_or_never().flatten() {
            text.push_str(std::str::from_utf8(&chunk).unwrap());
        }
        let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(events.len(), 3, "{text}");
        assert!(events[1].contains("engine stopped"), "{text}");
        assert_eq!(events[2], "data: [DONE]");
    }

    fn at(start: Instant, ms: f64) -> Instant {
        start + Duration::from_secs_f64(ms / 1000.0)
    }

    /// `tokens` tokens of prompt bytes unique to `seed`.
    fn prompt(seed: u8, tokens: usize) -> Vec<u8> {
        (0..tokens * 4)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect()
    }

    /// Hand `driver` a submission of `bytes` stamped at `received`, at `now`; returns
    /// the request's progress channel.
    fn submit(
        driver: &mut Driver,
        id: u64,
        bytes: &[u8],
        received: Instant,
        now: Instant,
    ) -> mpsc::UnboundedReceiver<ChoiceProgress> {
        let chain = HashChain::from_bytes(bytes, 64, gorgo_core::hash::BYTES_PER_TOKEN);
        let (progress, progress_rx) = mpsc::unbounded_channel();
        let (reply, mut reply_rx) = oneshot::channel();
        driver.handle(
            Command::Submit {
                seqs: vec![Sequence {
                    req: EngineRequest {
                        id,
                        prompt_tokens: chain.total_tokens(),
                        chain,
                        max_output_tokens: 8,
                        arrival_ms: 0.0,
                    },
                    token_ids: Some(byte_chunk_ids(bytes)),
                }],
                received,
                progress,
                reply,
            },
            now,
        );
        assert_eq!(reply_rx.try_recv().expect("driver replied"), Ok(()));
        progress_rx
    }

    /// A driver over the built-in profile without request overhead that records the
    /// cache's changes and publishes them as KV events in 16-token blocks.
    fn publishing_driver(start: Instant) -> Driver {
        let mut profile = Profile::by_name("h200-mistral7b").expect("built-in profile");
        profile.request_overhead_ms = 0.0;
        let mut engine = Engine::new(profile);
        engine.set_record_cache_changes(true);
        Driver::new(engine, start, Some(16), EmulatedKind::default())
    }

    #[test]
    fn an_abort_that_completes_a_prefill_keeps_its_stored_blocks_events() {
        let start = Instant::now();
        let mut driver = publishing_driver(start);
        // 64 tokens: four full 16-token blocks.
        let bytes = prompt(7, 64);
        let _progress = submit(&mut driver, 1, &bytes, start, start);
        assert!(driver.step(start).is_empty(), "prefill still running");
        let prefill_end = driver.wake().expect("prefill in flight");
        // The driver is late: the abort itself completes the prefill, which caches
        // the request's blocks; no step ran in between.
        let late = prefill_end + Duration::from_millis(1);
        driver.handle(Command::Abort { id: 1 }, late);
        let kv = driver.step(late);
        let ids = byte_chunk_ids(&bytes);
        let stored: Vec<&[u32]> = kv
            .iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored { token_ids, .. } => Some(token_ids.as_slice()),
                _ => None,
            })
            .collect();
        assert_eq!(stored, ids.chunks(16).collect::<Vec<_>>(), "{kv:?}");
        // The blocks stay cached after the abort, as the events say.
        assert_eq!(driver.engine.cached_blocks().count(), 4);
        // And the request's token ids are gone once published.
        assert!(driver.token_ids.is_empty() && driver.aborted.is_empty());
    }

    /// A node hashes a published block's token ids with the function that hashes a
    /// tokenised prompt: every published block must hash back to the engine's own
    /// hash. A prompt whose bytes end short of a 4-byte id has a last block that is
    /// counted full (its tokens round up) but cannot be published as it is.
    #[test]
    fn published_blocks_hash_back_from_their_token_ids() {
        for len in [61, 62, 63, 254] {
            let start = Instant::now();
            let mut driver = publishing_driver(start);
            let bytes = &prompt(3, 64)[..len];
            let _progress = submit(&mut driver, 1, bytes, start, start);
            let mut kv = Vec::new();
            while let Some(wake) = driver.wake() {
                kv.extend(driver.step(wake));
            }
            let (mut hashes, mut ids) = (Vec::new(), Vec::new());
            for e in &kv {
                if let KvEvent::BlockStored {
                    block_hashes,
                    parent,
                    token_ids,
                    ..
                } = e
                {
                    assert_eq!(parent.as_ref(), hashes.last(), "{len} bytes: in order");
                    hashes.extend(block_hashes);
                    ids.extend(token_ids);
                }
            }
            assert_eq!(
                HashChain::from_token_ids(&ids, 16).hashes,
                hashes,
                "{len} bytes"
            );
            assert_eq!(hashes.len(), len / 64, "{len} bytes: whole blocks only");
        }
    }

    #[test]
    fn the_driver_queues_by_the_handler_stamp() {
        let mut profile = Profile::by_name("h200-mistral7b").expect("built-in profile");
        profile.request_overhead_ms = 50.0;
        profile.max_running_requests = 1;
        let start = Instant::now();
        let mut driver = Driver::new(Engine::new(profile), start, None, EmulatedKind::default());
        // The large request's handler started first but hashed longer.
        let mut small = submit(
            &mut driver,
            2,
            &prompt(2, 50),
            at(start, 2.0),
            at(start, 3.0),
        );
        let mut large = submit(
            &mut driver,
            1,
            &prompt(1, 3000),
            at(start, 1.0),
            at(start, 9.0),
        );
        let mut firsts = Vec::new();
        let mut steps = 0;
        while let Some(wake) = driver.wake() {
            steps += 1;
            assert!(steps < 1000, "stepping at each wake makes progress");
            driver.step(wake);
            for (id, rx) in [(1, &mut large), (2, &mut small)] {
                while let Ok(p) = rx.try_recv() {
                    if matches!(p, (_, Progress::First { .. })) {
                        firsts.push(id);
                    }
                }
            }
        }
        assert_eq!(firsts, [1, 2]);
    }

    /// The requests that the scrape's own advance finished are counted in that scrape:
    /// no step runs between the submission and the scrape.
    #[test]
    fn a_scrape_counts_the_requests_its_advance_finished() {
        let start = Instant::now();
        let mut driver = publishing_driver(start);
        let _progress = submit(&mut driver, 1, &prompt(5, 64), start, start);
        let (reply, mut reply_rx) = oneshot::channel();
        let kv = driver.handle(Command::Metrics { reply }, at(start, 10_000.0));
        let snap = reply_rx.try_recv().expect("scrape answered");
        assert_eq!(snap.stats.finished_total, 1);
        assert_eq!(snap.requests_total, snap.stats.finished_total);
        // The cache changes of that advance come back to be published.
        assert!(!kv.is_empty());
    }

    /// A request whose body trickles in is stamped when its body is in, not at its
    /// headers: it does not hold a place in the queue it was not ready for.
    #[test]
    fn a_request_is_stamped_once_its_body_is_in() {
        let (commands, mut rx) = mpsc::unbounded_channel();
        let state = app_state(commands);
        let (body_tx, body_rx) = futures::channel::mpsc::unbounded::<Result<Bytes, Infallible>>();
        let req = Request::builder()
            .method("POST")
            .uri("/v1/completions")
            .body(Body::from_stream(body_rx))
            .expect("request");
        let mut handler = Box::pin(complete(state, Endpoint::Completions, req));
        assert!(
            (&mut handler).now_or_never().is_none(),
            "waits for the body"
        );
        let headers_in = Instant::now();
        // The monotonic clock moves on before the body comes (no sleep: a spin of
        // nanoseconds on a clock that cannot go back).
        let mut body_in = Instant::now();
        while body_in <= headers_in {
            body_in = Instant::now();
        }
        body_tx
            .unbounded_send(Ok(Bytes::from_static(br#"{"prompt":"hello"}"#)))
            .expect("body channel");
        drop(body_tx);
        assert!(
            (&mut handler).now_or_never().is_none(),
            "waits for the driver"
        );
        let Ok(Command::Submit { received, .. }) = rx.try_recv() else {
            panic!("the handler submits");
        };
        assert!(received >= body_in, "stamped before its body was in");
    }

    fn app_state(commands: mpsc::UnboundedSender<Command>) -> AppState {
        let profile = Profile::by_name("h200-mistral7b").expect("built-in profile");
        AppState {
            commands,
            config: Arc::new(EmulatorConfig::new(profile)),
            model: "m".into(),
            next_id: Arc::new(AtomicU64::new(1)),
            kv_events: false,
        }
    }

    #[tokio::test]
    async fn health_is_503_once_the_driver_is_gone() {
        let (commands, rx) = mpsc::unbounded_channel();
        let state = app_state(commands);
        assert_eq!(health(State(state.clone())).await.status(), StatusCode::OK);
        // What a driver task that panicked or returned leaves behind.
        drop(rx);
        let resp = health(State(state)).await;
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body = axum::body::to_bytes(resp.into_body(), 1 << 16)
            .await
            .expect("body");
        let v: Value = serde_json::from_slice(&body).expect("JSON body");
        // SGLang's flat error body, the default kind's.
        assert_eq!(v["object"], "error", "{v}");
        assert_eq!(v["code"], "unavailable", "{v}");
        assert_eq!(v["type"], "server_error", "{v}");
    }

    #[test]
    fn a_client_gone_before_the_driver_answers_aborts_its_request() {
        let (commands, mut rx) = mpsc::unbounded_channel();
        let state = app_state(commands);
        let body = json!({"messages": [{"role": "user", "content": "hello there"}]});
        let req = Request::builder()
            .method("POST")
            .uri("/v1/chat/completions")
            .body(Body::from(body.to_string()))
            .expect("request");
        // One poll runs the handler up to waiting for the driver's reply; then the
        // connection goes away and the handler future is dropped.
        assert!(complete(state, Endpoint::Chat, req)
            .now_or_never()
            .is_none());
        let Ok(Command::Submit { seqs, .. }) = rx.try_recv() else {
            panic!("the handler submits first");
        };
        let Ok(Command::Abort { id }) = rx.try_recv() else {
            panic!("then aborts");
        };
        assert_eq!(id, seqs[0].req.id);
    }
}
