//! The emulator: an OpenAI-compatible HTTP server in front of one [`Engine`].
//!
//! One tokio task owns the `Engine` and drives it on the real clock: it sleeps until
//! the engine's next event or a new command, steps the engine, and pushes each token to
//! the request's channel. HTTP handlers only parse, submit and stream. A response body
//! that is dropped (client gone) aborts its request, freeing its slot and KV reference.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
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
use gorgo_core::prompt::Endpoint;
use gorgo_core::HashChain;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::metrics::MetricsSnapshot;
use crate::openai::{self, BadRequest, ResponseMeta};
use crate::{Engine, EngineError, EngineEvent, EngineRequest, Profile, RejectReason};

/// How the emulator serves.
#[derive(Debug, Clone)]
pub struct EmulatorConfig {
    /// Costs and limits of the emulated engine.
    pub profile: Profile,
    /// Model name to report; `None`: the profile's `model`.
    pub model_name: Option<String>,
    /// Prefix-cache block size over prompt bytes (64 bytes = 16 tokens, SGLang-like pages).
    pub block_bytes: usize,
    /// Requests allowed to wait for admission; beyond it new requests get 503.
    pub max_queue: usize,
    /// Largest request body accepted, bytes (413 beyond).
    pub max_body_bytes: usize,
    /// Output tokens when a request gives neither `max_tokens` nor `gorgo_output_tokens`.
    pub default_max_tokens: u32,
    /// Count prompt tokens with the model's tokenizer and chat template, as a real
    /// engine does, instead of canonical bytes / 4: `usage.prompt_tokens`, the context
    /// check and the prefix cache (blocks of `block_bytes / 4` token ids) follow it.
    pub tokenizer: Option<Arc<gorgo_tokenizer::EngineTokenizer>>,
}

impl EmulatorConfig {
    /// Defaults around `profile`: 64-byte blocks, queue limit 1024, 16 MiB bodies,
    /// 128 output tokens by default (the paper's `max_tokens`).
    pub fn new(profile: Profile) -> Self {
        EmulatorConfig {
            profile,
            model_name: None,
            block_bytes: 64,
            max_queue: 1024,
            max_body_bytes: 16 << 20,
            default_max_tokens: 128,
            tokenizer: None,
        }
    }

    fn model(&self) -> String {
        self.model_name
            .clone()
            .unwrap_or_else(|| self.profile.model.clone())
    }
}

/// What the driver tells one request's HTTP stream.
#[derive(Debug)]
enum Progress {
    First { cached_tokens: u64 },
    Token,
    Done { output_tokens: u32 },
}

enum Command {
    Submit {
        req: EngineRequest,
        /// The prompt's token ids, for the KV events (only when they are published).
        token_ids: Option<Arc<[u32]>>,
        progress: mpsc::UnboundedSender<Progress>,
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

/// Serve the emulator on `listener` until `shutdown` resolves (then drain connections).
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
    let mut engine = Engine::new(config.profile.clone());
    engine.set_max_waiting(Some(config.max_queue));
    engine.set_record_cache_changes(kv_events.is_some());
    let state = AppState {
        kv_events: kv_events.is_some(),
        commands,
        model: config.model().into(),
        config: Arc::new(config),
        next_id: Arc::new(AtomicU64::new(1)),
    };
    let driver = tokio::spawn(drive(engine, rx, kv_events));
    let app = router(state);
    let listener = listener.tap_io(|tcp| {
        // Tokens go out one small SSE chunk at a time: never wait for Nagle.
        let _ = tcp.set_nodelay(true);
    });
    let result = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await;
    driver.abort();
    result.map_err(EngineError::Serve)
}

fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/get_server_info", get(server_info))
        .fallback(not_found)
        .with_state(state)
}

/// The engine task: owns the model, runs it on the real clock.
async fn drive(
    mut engine: Engine,
    mut rx: mpsc::UnboundedReceiver<Command>,
    mut kv_events: Option<crate::kv_events::KvPublisher>,
) {
    let start = Instant::now();
    // Token ids of the live requests, for the KV events (bounded by the queue and the
    // running slots: entries leave with their request).
    let mut token_ids: HashMap<u64, Arc<[u32]>> = HashMap::new();
    let now_ms = |start: Instant| start.elapsed().as_secs_f64() * 1000.0;
    let mut streams: HashMap<u64, (mpsc::UnboundedSender<Progress>, f64)> = HashMap::new();
    let mut snapshot = MetricsSnapshot::new();
    let mut events = Vec::new();
    loop {
        let wake = engine
            .next_event_time()
            .map(|t| start + Duration::from_secs_f64(t.max(0.0) / 1000.0));
        tokio::select! {
            cmd = rx.recv() => {
                let Some(cmd) = cmd else { return };
                let now = now_ms(start);
                match cmd {
                    Command::Submit { mut req, token_ids: ids, progress, reply } => {
                        req.arrival_ms = now;
                        let id = req.id;
                        let result = engine.submit(req, now);
                        if result.is_ok() {
                            streams.insert(id, (progress, now));
                            if let Some(ids) = ids {
                                token_ids.insert(id, ids);
                            }
                        }
                        let _ = reply.send(result);
                    }
                    Command::Abort { id } => {
                        if streams.remove(&id).is_some() {
                            engine.abort(id, now);
                        }
                        token_ids.remove(&id);
                    }
                    Command::Metrics { reply } => {
                        engine.step_into(now, &mut events);
                        snapshot.stats = engine.stats();
                        let _ = reply.send(snapshot.clone());
                    }
                }
            }
            _ = sleep_until(wake) => {}
        }
        engine.step_into(now_ms(start), &mut events);
        if let Some(publisher) = &mut kv_events {
            let changes = engine.take_cache_changes();
            if !changes.is_empty() {
                publisher.publish_changes(&changes, &token_ids, now_ms(start) / 1000.0);
            }
        }
        for event in events.drain(..) {
            match event {
                EngineEvent::FirstToken {
                    id,
                    at_ms,
                    cached_tokens,
                } => {
                    if let Some((tx, arrival)) = streams.get(&id) {
                        snapshot.ttft.observe((at_ms - arrival) / 1000.0);
                        let _ = tx.send(Progress::First { cached_tokens });
                    }
                }
                EngineEvent::DecodeStep { ids, .. } => {
                    for id in ids {
                        if let Some((tx, _)) = streams.get(&id) {
                            let _ = tx.send(Progress::Token);
                        }
                    }
                }
                EngineEvent::Finished {
                    id,
                    at_ms,
                    output_tokens,
                } => {
                    token_ids.remove(&id);
                    if let Some((tx, arrival)) = streams.remove(&id) {
                        snapshot.e2e.observe((at_ms - arrival) / 1000.0);
                        snapshot.requests_total += 1;
                        let _ = tx.send(Progress::Done { output_tokens });
                    }
                }
                EngineEvent::Rejected { id, .. } => {
                    token_ids.remove(&id);
                }
            }
        }
    }
}

/// A byte prompt as little-endian `u32` "token ids" of 4 bytes each (the last chunk
/// zero-padded; it only ever falls in a partial block, which is not published).
fn byte_chunk_ids(bytes: &[u8]) -> Arc<[u32]> {
    bytes
        .chunks(4)
        .map(|c| {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(b)
        })
        .collect()
}

async fn sleep_until(wake: Option<Instant>) {
    match wake {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn error_response(
    status: StatusCode,
    message: &str,
    kind: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> Response {
    (
        status,
        axum::Json(openai::error_body(message, kind, param, code)),
    )
        .into_response()
}

fn bad_request(e: BadRequest) -> Response {
    error_response(
        StatusCode::BAD_REQUEST,
        &e.message,
        "invalid_request_error",
        e.param,
        e.code,
    )
}

async fn not_found(req: Request) -> Response {
    error_response(
        StatusCode::NOT_FOUND,
        &format!("no route for {} {}", req.method(), req.uri().path()),
        "invalid_request_error",
        None,
        Some("not_found"),
    )
}

async fn health() -> StatusCode {
    StatusCode::OK
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
            snapshot.render(&state.model),
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

/// Sends `Abort` for its request when dropped armed: the client went away.
struct AbortOnDrop {
    id: u64,
    commands: mpsc::UnboundedSender<Command>,
    armed: bool,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.commands.send(Command::Abort { id: self.id });
        }
    }
}

async fn complete(state: AppState, endpoint: Endpoint, req: Request) -> Response {
    let limit = state.config.max_body_bytes;
    let body = match axum::body::to_bytes(req.into_body(), limit).await {
        Ok(b) => b,
        Err(_) => {
            return error_response(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("request body over {limit} bytes"),
                "invalid_request_error",
                None,
                Some("request_too_large"),
            )
        }
    };
    let parsed = match openai::parse(endpoint, &body, state.config.default_max_tokens) {
        Ok(p) => p,
        Err(e) => return bad_request(e),
    };
    let (chain, token_ids) = match &state.config.tokenizer {
        None => (
            HashChain::from_bytes(
                &parsed.prompt,
                state.config.block_bytes,
                gorgo_core::hash::BYTES_PER_TOKEN,
            ),
            // The KV events' "token ids" of a byte-hashed prompt: its 4-byte chunks,
            // which hash to the same chain (docs/kv-events.md).
            state.kv_events.then(|| byte_chunk_ids(&parsed.prompt)),
        ),
        Some(tokenizer) => match tokenizer.prompt_ids(endpoint, &body) {
            Ok(ids) => (
                HashChain::from_token_ids(
                    &ids,
                    state.config.block_bytes / gorgo_core::hash::BYTES_PER_TOKEN,
                ),
                state.kv_events.then(|| Arc::from(ids.as_slice())),
            ),
            Err(e) => {
                return bad_request(BadRequest {
                    message: e.to_string(),
                    param: Some(match endpoint {
                        Endpoint::Chat => "messages",
                        Endpoint::Completions => "prompt",
                    }),
                    code: None,
                })
            }
        },
    };
    let prompt_tokens = chain.total_tokens().max(1);
    let profile = &state.config.profile;
    let requested = prompt_tokens + parsed.output_tokens as u64;
    if requested > profile.context_length {
        let param = match endpoint {
            Endpoint::Chat => "messages",
            Endpoint::Completions => "prompt",
        };
        return error_response(
            StatusCode::BAD_REQUEST,
            &format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the prompt, {} for the completion). Please reduce the length of the prompt or completion.",
                profile.context_length, requested, prompt_tokens, parsed.output_tokens
            ),
            "invalid_request_error",
            Some(param),
            Some("context_length_exceeded"),
        );
    }
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    let (progress, mut progress_rx) = mpsc::unbounded_channel();
    let (reply, reply_rx) = oneshot::channel();
    let submitted = state.commands.send(Command::Submit {
        token_ids,
        req: EngineRequest {
            id,
            chain,
            prompt_tokens,
            max_output_tokens: parsed.output_tokens,
            arrival_ms: 0.0,
        },
        progress,
        reply,
    });
    let unavailable = || {
        error_response(
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
    match reply_rx.await {
        Ok(Ok(())) => {}
        Ok(Err(RejectReason::QueueFull { limit })) => {
            return error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("engine overloaded: {limit} requests already waiting"),
                "server_error",
                None,
                Some("overloaded"),
            )
        }
        Ok(Err(reason)) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                &reason.to_string(),
                "invalid_request_error",
                None,
                Some("context_length_exceeded"),
            )
        }
        Err(_) => return unavailable(),
    }
    let guard = AbortOnDrop {
        id,
        commands: state.commands.clone(),
        armed: true,
    };
    let model = parsed
        .model
        .clone()
        .unwrap_or_else(|| state.model.to_string());
    let meta = ResponseMeta::new(endpoint, id, model, parsed.include_usage);
    let finish_reason = if parsed.output_tokens >= parsed.max_tokens {
        "length"
    } else {
        "stop"
    };
    if !parsed.stream {
        let mut guard = guard;
        let mut cached = 0;
        let mut produced = 0;
        while let Some(p) = progress_rx.recv().await {
            match p {
                Progress::First { cached_tokens } => cached = cached_tokens,
                Progress::Token => {}
                Progress::Done { output_tokens } => {
                    produced = output_tokens;
                    guard.armed = false;
                    break;
                }
            }
        }
        if guard.armed {
            return unavailable();
        }
        let body = meta.full(
            &openai::filler_text(produced),
            finish_reason,
            openai::usage(prompt_tokens, produced, cached),
        );
        return axum::Json(body).into_response();
    }
    let stream = SseStream {
        rx: progress_rx,
        guard,
        meta,
        produced: 0,
        cached: 0,
        prompt_tokens,
        finish_reason,
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

/// State of one SSE response: turns engine progress into `data:` chunks.
struct SseStream {
    rx: mpsc::UnboundedReceiver<Progress>,
    guard: AbortOnDrop,
    meta: ResponseMeta,
    produced: u32,
    cached: u64,
    prompt_tokens: u64,
    finish_reason: &'static str,
    done: bool,
}

impl SseStream {
    fn data(out: &mut Vec<u8>, v: &Value) {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(v.to_string().as_bytes());
        out.extend_from_slice(b"\n\n");
    }

    /// The next bytes to write, or `None` at the end of the stream.
    async fn next_chunk(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        let mut out = Vec::new();
        match self.rx.recv().await {
            Some(Progress::First { cached_tokens }) => {
                self.cached = cached_tokens;
                let v = self.meta.chunk(openai::token_text(0), true, None);
                self.produced = 1;
                Self::data(&mut out, &v);
            }
            Some(Progress::Token) => {
                let v = self
                    .meta
                    .chunk(openai::token_text(self.produced), false, None);
                self.produced += 1;
                Self::data(&mut out, &v);
            }
            Some(Progress::Done { output_tokens }) => {
                self.guard.armed = false;
                self.done = true;
                self.produced = output_tokens;
                let v = self.meta.chunk("", false, Some(self.finish_reason));
                Self::data(&mut out, &v);
                if self.meta.include_usage {
                    let usage = openai::usage(self.prompt_tokens, output_tokens, self.cached);
                    Self::data(&mut out, &self.meta.usage_chunk(usage));
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
            }
            None => {
                // The engine went away mid-stream: end with an error event.
                self.done = true;
                let v =
                    openai::error_body("engine stopped", "server_error", None, Some("unavailable"));
                Self::data(&mut out, &v);
            }
        }
        Some(Bytes::from(out))
    }
}
