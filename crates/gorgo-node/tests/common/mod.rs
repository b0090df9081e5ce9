//! Test harness: a controllable stub engine and in-process nodes on loopback.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::response::Response;
use axum::routing::{get, post};
use bytes::Bytes;
use futures::StreamExt;
use gorgo_node::mesh::Mesh;
use gorgo_node::{NodeConfig, NodeHandle, NodeListeners, NodeState, ValidatedConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// How the stub engine answers completions.
pub const NORMAL: u8 = 0;
/// Never send response headers (until released).
pub const HANG: u8 = 1;
/// Send the first SSE chunk, then hang (until released), then end.
pub const STREAM_THEN_HANG: u8 = 2;
/// Refuse every completion with 400 (as an engine refuses a prompt over its context).
pub const REJECT: u8 = 3;
/// Answer nothing at all, health checks included (a SIGSTOPped engine), until released.
pub const HANG_ALL: u8 = 4;
/// Send the first SSE chunk, wait to be released (`release.notify_one()`), then break
/// the connection (an engine dying mid-stream).
pub const FAIL_MID_STREAM: u8 = 5;
/// Answer a non-streamed completion 200 with a body that never says its length and
/// runs past 1 MiB (an engine gone wrong mid-answer).
pub const ENDLESS_BODY: u8 = 6;
/// Stream completions without end (64 KiB SSE comments after the first chunk), counted
/// in `active` while the stream lives.
pub const FLOOD: u8 = 7;
/// Send the first SSE chunk, wait to be released, then send half of the next event
/// and break the connection (an engine dying inside an event).
pub const FAIL_MID_EVENT: u8 = 8;
/// Answer the native routes, chat and completions 500 with an OpenAI error body and an
/// `x-request-id` (an engine failing them, or llama-cpp-python refusing a body it
/// cannot parse: [`SERVER_ERROR_BODY`]).
pub const SERVER_ERROR: u8 = 9;
/// The body of a `SERVER_ERROR` answer.
pub const SERVER_ERROR_BODY: &str = r#"{"error":{"message":"1 validation error: messages.0.role: Input should be 'user'","type":"internal_server_error","param":null,"code":null}}"#;
/// Send a stream's head at once (as vLLM and SGLang do, before prefill), then nothing
/// until released: an engine whose scheduler is stuck.
pub const HEAD_THEN_HANG: u8 = 10;
/// Answer the native routes, chat and completions 503 (an engine that cannot serve:
/// a gateway failure, which counts against the breaker).
pub const UNAVAILABLE: u8 = 11;
/// The `Retry-After` of an `UNAVAILABLE` answer (not the node's default of 1).
pub const UNAVAILABLE_RETRY_AFTER: &str = "7";

/// A stub OpenAI-compatible engine whose load and behaviour the test sets.
pub struct StubEngine {
    pub addr: std::net::SocketAddr,
    pub mode: AtomicU8,
    pub waiting: AtomicU32,
    pub requests: AtomicU64,
    /// Handlers of the native routes running now (a dropped one was cancelled).
    pub active: Arc<AtomicU64>,
    /// The `traceparent` header of each completion request, in arrival order.
    pub traceparents: parking_lot::Mutex<Vec<String>>,
    pub release: Notify,
    pub name: String,
    /// The model ids its `/v1/models` lists (`["m"]`, what the tests' bodies name).
    pub models: std::sync::Mutex<Vec<String>>,
    /// How SGLang's `/get_server_info` answers: a status and a body (404 by default;
    /// status 0: never, until `release`).
    pub server_info: std::sync::Mutex<(u16, serde_json::Value)>,
    /// `/get_server_info` requests received.
    pub server_info_requests: AtomicU64,
    /// `/v1/models` requests received.
    pub models_requests: AtomicU64,
    /// `/health` answers 503 while set.
    pub unhealthy: std::sync::atomic::AtomicBool,
    pub shutdown: CancellationToken,
}

impl StubEngine {
    pub async fn start(name: &str) -> Arc<StubEngine> {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let shutdown = CancellationToken::new();
        let engine = Arc::new(StubEngine {
            addr: listener.local_addr().unwrap(),
            mode: AtomicU8::new(NORMAL),
            waiting: AtomicU32::new(0),
            requests: AtomicU64::new(0),
            active: Arc::new(AtomicU64::new(0)),
            traceparents: parking_lot::Mutex::new(Vec::new()),
            release: Notify::new(),
            name: name.to_owned(),
            models: std::sync::Mutex::new(vec!["m".to_owned()]),
            server_info: std::sync::Mutex::new((404, serde_json::Value::Null)),
            server_info_requests: AtomicU64::new(0),
            models_requests: AtomicU64::new(0),
            unhealthy: std::sync::atomic::AtomicBool::new(false),
            shutdown: shutdown.clone(),
        });
        let app = axum::Router::new()
            .route(
                "/health",
                get(|State(e): State<Arc<StubEngine>>| async move {
                    if e.mode.load(Ordering::SeqCst) == HANG_ALL {
                        e.release.notified().await;
                    }
                    if e.unhealthy.load(Ordering::SeqCst) {
                        return (axum::http::StatusCode::SERVICE_UNAVAILABLE, "down");
                    }
                    (axum::http::StatusCode::OK, "ok")
                }),
            )
            .route("/metrics", get(metrics))
            .route(
                "/v1/models",
                get(|State(e): State<Arc<StubEngine>>| async move {
                    e.models_requests.fetch_add(1, Ordering::SeqCst);
                    let data: Vec<_> = e.models.lock().unwrap().iter()
                    .map(|id| serde_json::json!({"id": id, "object": "model", "owned_by": e.name}))
                    .collect();
                    axum::Json(serde_json::json!({"object": "list", "data": data}))
                }),
            )
            .route(
                "/get_server_info",
                get(|State(e): State<Arc<StubEngine>>| async move {
                    e.server_info_requests.fetch_add(1, Ordering::SeqCst);
                    let (status, body) = e.server_info.lock().unwrap().clone();
                    if status == 0 {
                        e.release.notified().await;
                    }
                    let status = axum::http::StatusCode::from_u16(status).unwrap();
                    (status, axum::Json(body))
                }),
            )
            .route("/v1/chat/completions", post(complete))
            .route("/v1/completions", post(complete))
            .route("/tokenize", post(native))
            .route("/v1/embeddings", post(native))
            .route("/v1/responses", post(native))
            .route("/generate", post(native))
            .route("/detokenize", post(native))
            .with_state(engine.clone());
        tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move { shutdown.cancelled().await })
                .await
                .unwrap();
        });
        engine
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Serve these models (what `/v1/models` lists from now on).
    pub fn set_models(&self, models: &[&str]) {
        *self.models.lock().unwrap() = models.iter().map(|m| m.to_string()).collect();
    }

    /// Answer `/get_server_info` with `status` and `body` from now on.
    pub fn set_server_info(&self, status: u16, body: serde_json::Value) {
        *self.server_info.lock().unwrap() = (status, body);
    }

    pub fn set_mode(&self, mode: u8) {
        self.mode.store(mode, Ordering::SeqCst);
    }

    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }
}

async fn metrics(State(e): State<Arc<StubEngine>>) -> String {
    format!(
        "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{{tp_rank=\"0\"}} 0.0\n\
         # TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{{tp_rank=\"0\"}} {}.0\n\
         # TYPE sglang:max_total_num_tokens gauge\nsglang:max_total_num_tokens{{tp_rank=\"0\"}} 100000.0\n",
        e.waiting.load(Ordering::SeqCst)
    )
}

async fn complete(
    State(e): State<Arc<StubEngine>>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    e.requests.fetch_add(1, Ordering::SeqCst);
    if let Some(tp) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
        e.traceparents.lock().push(tp.to_owned());
    }
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let stream = v.get("stream").and_then(|s| s.as_bool()).unwrap_or(false);
    let is_chat = v.get("messages").is_some();
    match e.mode.load(Ordering::SeqCst) {
        HANG | HANG_ALL => e.release.notified().await,
        SERVER_ERROR => return server_error(),
        UNAVAILABLE => return unavailable(),
        REJECT => {
            return Response::builder()
                .status(400)
                .header("content-type", "application/json")
                .body(Body::from(
                    r#"{"error":{"message":"prompt too long","type":"invalid_request_error","param":null,"code":null}}"#,
                ))
                .unwrap()
        }
        ENDLESS_BODY if !stream => {
            let chunks = futures::stream::iter(
                (0..64).map(|_| Ok::<_, std::io::Error>(Bytes::from(vec![b' '; 65_536]))),
            );
            return Response::builder()
                .header("content-type", "application/json")
                .body(Body::from_stream(chunks))
                .unwrap();
        }
        _ => {}
    }
    if stream {
        let mode = e.mode.load(Ordering::SeqCst);
        let e2 = e.clone();
        let chunk = |text: &str| {
            let delta = if is_chat {
                serde_json::json!({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": e2.name,
                    "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]})
            } else {
                serde_json::json!({"id": "x", "object": "text_completion", "created": 0, "model": e2.name,
                    "choices": [{"index": 0, "text": text, "finish_reason": null}]})
            };
            Bytes::from(format!("data: {delta}\n\n"))
        };
        let first = chunk("hello");
        let second = chunk(" world");
        if mode == FLOOD {
            let active = Active::new(&e.active);
            let flood = futures::stream::iter(std::iter::once(first).chain(std::iter::repeat(
                Bytes::from(format!(": {}\n\n", "x".repeat(65_536))),
            )))
            .map(move |b| {
                let _active = &active;
                Ok::<_, std::io::Error>(b)
            });
            return Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(flood))
                .unwrap();
        }
        let stream = async_stream(first, second, mode, e.clone());
        // As llama-cpp-python's server (sse-starlette) sends its streams.
        return Response::builder()
            .header("content-type", "text/event-stream")
            .header("x-accel-buffering", "no")
            .body(Body::from_stream(stream))
            .unwrap();
    }
    let body = if is_chat {
        serde_json::json!({"id": "x", "object": "chat.completion", "created": 0, "model": e.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello world"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}})
    } else {
        serde_json::json!({"id": "x", "object": "text_completion", "created": 0, "model": e.name,
            "choices": [{"index": 0, "text": "hello world", "finish_reason": "stop", "logprobs": null}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}})
    };
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap()
}

/// The answer of an engine in `SERVER_ERROR` mode.
fn server_error() -> Response {
    Response::builder()
        .status(500)
        .header("content-type", "application/json")
        .header("x-request-id", "engine-request-7")
        .body(Body::from(SERVER_ERROR_BODY))
        .unwrap()
}

/// The answer of an engine in `UNAVAILABLE` mode, with the back-off it asks for.
fn unavailable() -> Response {
    Response::builder()
        .status(503)
        .header("content-type", "application/json")
        .header("retry-after", UNAVAILABLE_RETRY_AFTER)
        .body(Body::from(r#"{"error":{"message":"engine unavailable"}}"#))
        .unwrap()
}

fn async_stream(
    first: Bytes,
    second: Bytes,
    mode: u8,
    e: Arc<StubEngine>,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send {
    futures::stream::unfold(0u8, move |step| {
        let (first, second, e) = (first.clone(), second.clone(), e.clone());
        async move {
            match step {
                0 => {
                    if mode == HEAD_THEN_HANG {
                        e.release.notified().await;
                    }
                    Some((Ok(first), 1))
                }
                1 if mode == FAIL_MID_EVENT => {
                    e.release.notified().await;
                    Some((Ok(Bytes::from_static(b"data: {\"id\":\"x\",\"cho")), 4))
                }
                4 => Some((Err(std::io::Error::other("engine died")), 3)),
                1 if mode == FAIL_MID_STREAM => {
                    e.release.notified().await;
                    Some((Err(std::io::Error::other("engine died")), 3))
                }
                1 => {
                    if mode == STREAM_THEN_HANG {
                        e.release.notified().await;
                    }
                    Some((Ok(second), 2))
                }
                2 => Some((Ok(Bytes::from_static(b"data: [DONE]\n\n")), 3)),
                _ => None,
            }
        }
    })
}

/// Counts a running handler while alive.
struct Active(Arc<AtomicU64>);
impl Active {
    fn new(n: &Arc<AtomicU64>) -> Active {
        n.fetch_add(1, Ordering::SeqCst);
        Active(n.clone())
    }
}
impl Drop for Active {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The engine's native routes (`/v1/embeddings`, `/v1/responses`, SGLang's
/// `/generate`, `/tokenize` (one token per word), `/detokenize`): a JSON answer naming the route and echoing the body,
/// or with `"stream": true` two SSE events and `[DONE]`. `HANG` holds them.
async fn native(State(e): State<Arc<StubEngine>>, uri: axum::http::Uri, body: Bytes) -> Response {
    let active = Active::new(&e.active);
    e.requests.fetch_add(1, Ordering::SeqCst);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let mode = e.mode.load(Ordering::SeqCst);
    if mode == HANG {
        e.release.notified().await;
    }
    if mode == SERVER_ERROR {
        return server_error();
    }
    if mode == UNAVAILABLE {
        return unavailable();
    }
    let path = uri.path().to_owned();
    if v.get("stream").and_then(|s| s.as_bool()).unwrap_or(false) {
        let first = Bytes::from(format!(
            "data: {}\n\n",
            serde_json::json!({"route": path, "text": "hello"})
        ));
        let second = Bytes::from(format!(
            "data: {}\n\n",
            serde_json::json!({"route": path, "text": " world"})
        ));
        let stream = async_stream(first, second, mode, e.clone()).map(move |c| {
            let _active = &active;
            c
        });
        return Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from_stream(stream))
            .unwrap();
    }
    drop(active);
    let mut answer = serde_json::json!({"route": path, "engine": e.name, "echo": v});
    if path == "/tokenize" {
        // One token per word.
        let n = v["prompt"]
            .as_str()
            .map_or(0, |p| p.split_whitespace().count());
        answer["tokens"] = (0..n).collect::<Vec<usize>>().into();
        answer["count"] = n.into();
    }
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from(answer.to_string()))
        .unwrap()
}

/// A TCP server that answers health checks and drops every other request: an engine
/// that fails after accepting work (502).
pub async fn broken_engine() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                let mut got = Vec::new();
                loop {
                    let Ok(n) = sock.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..n]);
                    if got.windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                if got.starts_with(b"GET /health") {
                    let _ = sock
                        .write_all(
                            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                        )
                        .await;
                }
                // Anything else: drop the connection without an answer.
            });
        }
    });
    addr
}

pub const TOKEN: &str = "test-admin-token";

/// The engine emulator (`h200-dense-1.5b`) on 127.0.0.1, port 0, until `shutdown`: a
/// real OpenAI-compatible engine (SGLang's metrics, `stream_options.include_usage`)
/// for tests the stub engine cannot stand in for. Returns its base URL.
pub async fn emulator(shutdown: &CancellationToken) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cfg = gorgo_engine::server::EmulatorConfig::new(
        gorgo_engine::profile::Profile::by_name("h200-dense-1.5b").unwrap(),
    );
    let sd = shutdown.clone();
    tokio::spawn(async move {
        gorgo_engine::server::serve(listener, cfg, async move { sd.cancelled().await }).await
    });
    format!("http://{addr}")
}

/// A config for a test node; sockets are bound separately on port 0.
pub fn config(id: &str, engine_url: &str, extra: &str) -> ValidatedConfig {
    config_full(id, engine_url, "", extra)
}

/// [`config`] with more keys in `[engine]`.
#[allow(dead_code)]
pub fn config_with_engine(id: &str, engine_url: &str, engine_extra: &str) -> ValidatedConfig {
    config_full(id, engine_url, engine_extra, "")
}

fn config_full(id: &str, engine_url: &str, engine_extra: &str, extra: &str) -> ValidatedConfig {
    let health = if engine_extra.contains("health_interval_ms") {
        ""
    } else {
        "health_interval_ms = 3600000\n"
    };
    let engine = format!(
        "[engine]\nurl = \"{engine_url}\"\nkind = \"sglang\"\nmetrics_interval_ms = 0\n{health}{engine_extra}\n"
    );
    config_text(id, &engine, extra)
}

/// A config for a test node fronting the engines at `urls` (`[[engines]]`, replicas
/// in that order), gossip every 50 ms, `extra` appended.
#[allow(dead_code)]
pub fn config_with_engines(id: &str, urls: &[String], extra: &str) -> ValidatedConfig {
    let engines: String = urls
        .iter()
        .map(|u| {
            format!(
                "[[engines]]\nurl = \"{u}\"\nkind = \"sglang\"\nmetrics_interval_ms = 0\nhealth_interval_ms = 3600000\n"
            )
        })
        .collect();
    config_text(
        id,
        &engines,
        &format!("[cluster]\ngossip_interval_ms = 50\n{extra}"),
    )
}

/// The config of node `id` with `engines` (its engine tables) and `extra` appended.
pub fn config_text(id: &str, engines: &str, extra: &str) -> ValidatedConfig {
    let text = format!(
        r#"
[node]
id = "{id}"
region = "{id}"
[listen]
http = "127.0.0.1:0"
quic = "127.0.0.1:0"
admin = "127.0.0.1:0"
{engines}
[tls]
ca = "ca.pem"
cert = "cert.pem"
key = "key.pem"
[admin]
token = "{TOKEN}"
{extra}
"#
    );
    NodeConfig::from_toml_str(&text).unwrap()
}

/// A running in-process node.
pub struct TestNode {
    pub handle: NodeHandle,
    pub shutdown: CancellationToken,
    pub base: String,
    pub admin: String,
}

impl TestNode {
    pub fn state(&self) -> &Arc<NodeState> {
        &self.handle.state
    }
}

/// Start a node on the mesh (or alone when `mesh` is `None`).
pub async fn start_node(config: ValidatedConfig, mesh: Option<&Arc<Mesh>>) -> TestNode {
    match mesh {
        Some(mesh) => {
            let peers = mesh.peer_source(&config.node.id);
            start_node_seeing(config, mesh, peers).await
        }
        None => {
            let state = NodeState::new(config, Arc::new(gorgo_node::NoPeers)).unwrap();
            let (_tx, rx) = tokio::sync::mpsc::channel(1);
            start_state(state, rx).await
        }
    }
}

/// Start a node on the mesh that sees the cluster through `peers` (the mesh's view of
/// it, wrapped by the test to change what peers say).
pub async fn start_node_seeing(
    config: ValidatedConfig,
    mesh: &Arc<Mesh>,
    peers: Arc<dyn gorgo_node::PeerSource>,
) -> TestNode {
    let state = NodeState::new(config, peers).unwrap();
    let rx = mesh.join(&state);
    start_state(state, rx).await
}

/// Start `state`'s node on port 0, serving the forwards `incoming` carries.
async fn start_state(
    state: Arc<NodeState>,
    incoming: tokio::sync::mpsc::Receiver<gorgo_node::IncomingForward>,
) -> TestNode {
    let shutdown = CancellationToken::new();
    let listeners = NodeListeners {
        http: TcpListener::bind("127.0.0.1:0").await.unwrap(),
        admin: TcpListener::bind("127.0.0.1:0").await.unwrap(),
    };
    let handle = gorgo_node::start(state, listeners, incoming, shutdown.clone())
        .await
        .unwrap();
    let base = format!("http://{}", handle.http_addr);
    let admin = format!("http://{}", handle.admin_addr);
    TestNode {
        handle,
        shutdown,
        base,
        admin,
    }
}

/// Nodes on one in-process mesh, each beside its own stub engine (in the order of
/// the ids).
pub struct MeshCluster {
    pub mesh: Arc<Mesh>,
    pub engines: Vec<Arc<StubEngine>>,
    pub nodes: Vec<TestNode>,
}

/// Start a stub engine and a node for each id on a new mesh, with the RTTs given
/// (both ways, ms); `extra(id)` is node `id`'s config beyond [`config`]'s.
pub async fn mesh_cluster(
    ids: &[&str],
    rtts: &[(&str, &str, f64)],
    extra: impl Fn(&str) -> String,
) -> MeshCluster {
    let mesh = Mesh::new();
    for (a, b, rtt_ms) in rtts {
        mesh.set_rtt(a, b, *rtt_ms);
    }
    let mut engines = Vec::new();
    let mut nodes = Vec::new();
    for id in ids {
        let engine = StubEngine::start(id).await;
        nodes.push(start_node(config(id, &engine.url(), &extra(id)), Some(&mesh)).await);
        engines.push(engine);
    }
    MeshCluster {
        mesh,
        engines,
        nodes,
    }
}

/// A node's `/metrics` as a plain HTTP client gets it (Prometheus text 0.0.4).
pub async fn metrics_text(node: &TestNode) -> String {
    metrics_at(&node.admin).await
}

/// `/metrics` of the admin API at `admin` (`http://host:port`).
pub async fn metrics_at(admin: &str) -> String {
    client()
        .get(format!("{admin}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The value of one series (`name{labels}`, exactly as exposed) in a `/metrics` text,
/// `None` when it is not there.
pub fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// A prompt of about `bytes` bytes, distinct per `seed`.
pub fn prompt(seed: &str, bytes: usize) -> String {
    let mut s = String::new();
    while s.len() < bytes {
        s.push_str(seed);
        s.push(' ');
    }
    s
}

pub fn chat_body(prompt: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({"model": "m", "messages": [{"role": "user", "content": prompt}], "stream": stream, "max_tokens": 8})
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().build().unwrap()
}

/// The status and body of an error answer, checked to be OpenAI's error shape.
#[allow(dead_code)]
/// POST a chat completion of `prompt` to `node` (streamed or not) and return its
/// response, whatever the status.
pub async fn post_chat(node: &TestNode, prompt: &str, stream: bool) -> reqwest::Response {
    client()
        .post(format!("{}/v1/chat/completions", node.base))
        .json(&chat_body(prompt, stream))
        .send()
        .await
        .unwrap()
}

pub async fn error_of(resp: reqwest::Response) -> (u16, serde_json::Value) {
    let status = resp.status().as_u16();
    let body: serde_json::Value = resp.json().await.expect("OpenAI error JSON");
    assert!(body["error"]["message"].is_string(), "{body}");
    assert!(body["error"]["type"].is_string(), "{body}");
    (status, body)
}

/// GET an admin route of `node` (`/admin/state`, `/admin/decisions?limit=1`, ...) with
/// the admin token, as JSON.
pub async fn admin_json(node: &TestNode, path: &str) -> serde_json::Value {
    client()
        .get(format!("{}{path}", node.admin))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Wait until `cond` holds, polling every 10 ms (what it waits for, gossip or a
/// socket on the real clock, has no event to await); fail after 20 s naming `what`.
#[allow(dead_code)]
pub async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting: {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// The status of the head `node` answers a peer's forward whose stream carries
/// `first_bytes` and then stays open without more (the peer's end is held until the
/// head is read). Nothing is served: the serve step never completes.
#[allow(dead_code)]
pub async fn forward_head_status(node: &TestNode, first_bytes: &[u8]) -> u16 {
    use gorgo_node::api::{ServeError, Upstream};
    let ex = forward_exchange(node.state(), first_bytes, |_, _| {
        std::future::pending::<Result<Upstream, ServeError>>()
    })
    .await;
    ex.served.abort();
    ex.head.status
}

/// A one-hop forward from node `from` (its `via`) of `body` to `endpoint`.
#[allow(dead_code)]
pub fn forward_request(
    from: &str,
    endpoint: gorgo_core::Endpoint,
    body: Vec<u8>,
) -> gorgo_core::wire::ForwardRequest {
    gorgo_core::wire::ForwardRequest {
        request_id: 7,
        hops: 1,
        origin: gorgo_core::NodeId::from(from),
        via: vec![gorgo_core::NodeId::from(from)],
        endpoint,
        chain: gorgo_core::HashChain::from_bytes(&body, 256, 4),
        body,
        headers: vec![("content-type".into(), "application/json".into())],
        model: None,
        offer: None,
    }
}

/// The frame a peer opens a forward stream with.
#[allow(dead_code)]
pub async fn forward_frame(request: &gorgo_core::wire::ForwardRequest) -> Vec<u8> {
    let mut frame = Vec::new();
    gorgo_node::forward::write_frame(&mut frame, request)
        .await
        .unwrap();
    frame
}

/// A peer's forward stream to a node's forward server, once its head is in.
#[allow(dead_code)]
pub struct ForwardExchange {
    /// The response head.
    pub head: gorgo_core::wire::ForwardResponseHead,
    /// What follows the head (chunk frames).
    pub from_node: tokio::io::DuplexStream,
    /// The peer's sending half, held open (closing it cancels the forward).
    pub to_node: tokio::io::DuplexStream,
    /// The server's task.
    pub served: tokio::task::JoinHandle<()>,
}

/// Open a forward stream from peer "b" to `state`'s forward server, send
/// `first_bytes` on it, serve with `serve`, and read the head.
#[allow(dead_code)]
pub async fn forward_exchange<F, Fut>(
    state: &Arc<NodeState>,
    first_bytes: &[u8],
    serve: F,
) -> ForwardExchange
where
    F: FnOnce(Arc<NodeState>, gorgo_node::api::RoutedRequest) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<gorgo_node::api::Upstream, gorgo_node::api::ServeError>>
        + Send
        + 'static,
{
    let (mut to_node, from_peer) = tokio::io::duplex(1 << 16);
    let (to_peer, mut from_node) = tokio::io::duplex(1 << 16);
    to_node.write_all(first_bytes).await.unwrap();
    let incoming = gorgo_node::peers::IncomingForward {
        from: gorgo_core::NodeId::from("b"),
        send: Box::pin(to_peer),
        recv: Box::pin(from_peer),
    };
    let served = tokio::spawn(gorgo_node::forward::handle_incoming(
        state.clone(),
        incoming,
        serve,
    ));
    let head = gorgo_node::forward::read_frame(&mut from_node, 1 << 20)
        .await
        .unwrap();
    ForwardExchange {
        head,
        from_node,
        to_node,
        served,
    }
}

/// A node in front of a stub engine that floods its answers (`FLOOD`), configured by
/// `extra` (TOML sections): for clients that stop reading.
#[allow(dead_code)]
pub async fn flooding_node(extra: &str) -> (Arc<StubEngine>, TestNode) {
    let engine = StubEngine::start("e").await;
    engine.set_mode(FLOOD);
    let node = start_node(config("a", &engine.url(), extra), None).await;
    (engine, node)
}

/// [`flooding_node`] with a 300 ms request deadline and online tuning it leads.
#[allow(dead_code)]
pub async fn flooding_tuned_node() -> (Arc<StubEngine>, TestNode) {
    let (engine, node) = flooding_node(
        "[limits]\nrequest_timeout_ms = 300\n[tuning]\nmode = \"online\"\nstartup_grace_ms = 0\n",
    )
    .await;
    until("the node leads its tuning line", || {
        node.state().tuning.epoch() > 0
    })
    .await;
    (engine, node)
}

/// A node whose engine's breaker (one failure opens it, 50 ms cooldown) was opened by
/// a failure and has cooled down to half-open: its next request is the probe.
#[allow(dead_code)]
pub async fn half_open_node() -> (
    Arc<StubEngine>,
    TestNode,
    Arc<gorgo_node::engine::EngineAdapter>,
) {
    use gorgo_core::health::{BreakerState, RequestOutcome};
    let engine = StubEngine::start("e").await;
    let node = start_node(
        config_with_engine(
            "a",
            &engine.url(),
            "breaker_failures = 1\nbreaker_cooldown_ms = 50\n",
        ),
        None,
    )
    .await;
    let adapter = node.state().engine(0).unwrap().adapter.clone();
    // After the first health check (the next is an hour away).
    until("the engine is confirmed", || adapter.is_ready()).await;
    adapter.record(RequestOutcome::Failed);
    assert!(matches!(adapter.breaker(), BreakerState::Open { .. }));
    until("the cooldown passes", || {
        adapter.breaker() == BreakerState::HalfOpen { probing: false }
    })
    .await;
    (engine, node, adapter)
}
