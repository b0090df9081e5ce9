//! Test helpers: a tiny OpenAI-style SSE server bound to 127.0.0.1:0, and ([`stub`]) a
//! stand-in `gorgo` binary.
#![allow(dead_code)]

pub mod stub;

use axum::body::Body;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use futures::StreamExt;

/// One SSE event's frame.
fn frame(s: &str) -> Result<Bytes, std::io::Error> {
    Ok(Bytes::from(s.to_owned()))
}

/// A streaming 200 response of `frames`.
fn stream_response(
    frames: impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
) -> Response {
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(frames))
        .unwrap()
}

const FIRST_TOKEN: &str =
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"t\"}}]}\n\n";

/// A chat endpoint in OpenAI's streaming shape. `max_tokens` picks the behaviour:
/// 0 -> HTTP 400, 999 -> stream cut before `[DONE]`, 998 -> a first token, then a
/// stall for ever, 997 -> HTTP 500 with an endless body, 996 -> a complete stream
/// whose body is then held open for ever, 995 -> a complete stream followed by an SSE
/// comment every 100 ms for ever, else that many content chunks.
async fn chat(
    axum::extract::State(received): axum::extract::State<Received>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    received.send_modify(|n| *n += 1);
    let v: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(_) => return (StatusCode::BAD_REQUEST, "bad json").into_response(),
    };
    let n = v["max_tokens"].as_u64().unwrap_or(1);
    if n == 0 {
        return (
            StatusCode::BAD_REQUEST,
            r#"{"error":{"message":"max_tokens must be positive"}}"#,
        )
            .into_response();
    }
    match n {
        998 => {
            let head = futures::stream::iter([frame(FIRST_TOKEN)]);
            return stream_response(head.chain(futures::stream::pending()));
        }
        997 => {
            let endless = futures::stream::repeat_with(|| frame(&"x".repeat(4096)));
            return Response::builder()
                .status(StatusCode::INTERNAL_SERVER_ERROR)
                .body(Body::from_stream(endless))
                .unwrap();
        }
        995 => {
            let done = futures::stream::iter([frame(FIRST_TOKEN), frame("data: [DONE]\n\n")]);
            let keep_alive = futures::stream::unfold((), |()| async {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                Some((frame(": ka\n\n"), ()))
            });
            return stream_response(done.chain(keep_alive));
        }
        996 => {
            let done = futures::stream::iter([frame(FIRST_TOKEN), frame("data: [DONE]\n\n")]);
            return stream_response(done.chain(futures::stream::pending()));
        }
        _ => {}
    }
    let served_by = v["served_by"].as_str().unwrap_or("here").to_owned();
    let session = headers
        .get("x-session-id")
        .and_then(|h| h.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let mut s = String::new();
    s.push_str("data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\n");
    let content_chunks = if n == 999 { 2 } else { n };
    for i in 0..content_chunks {
        s.push_str(&format!(
            "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i}{session}\"}}}}]}}\n\n"
        ));
    }
    if n != 999 {
        s.push_str(&format!(
            "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":7,\"completion_tokens\":{n},\
             \"prompt_tokens_details\":{{\"cached_tokens\":3}}}}}}\n\ndata: [DONE]\n\n"
        ));
    }
    // Send the events as separate body frames, as a real streaming server would.
    let frames: Vec<Result<Bytes, std::io::Error>> = s
        .split_inclusive("\n\n")
        .map(|f| Ok(Bytes::from(f.to_owned())))
        .collect();
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("x-gorgo-served-by", served_by)
        .header("x-gorgo-hops", "1")
        .body(Body::from_stream(futures::stream::iter(frames)))
        .unwrap()
}

/// A node's tuning view: two decisions, one of them reported twice, behind a token.
async fn tuning(headers: HeaderMap) -> Response {
    if headers.get("authorization").and_then(|h| h.to_str().ok()) != Some("Bearer t") {
        return (StatusCode::UNAUTHORIZED, "token").into_response();
    }
    axum::Json(serde_json::json!({"history": [
        {"epoch": 2, "accepted": false},
        {"epoch": 1, "accepted": true},
        {"epoch": 2, "accepted": false},
    ]}))
    .into_response()
}

/// How many chat requests the server has received so far.
type Received = std::sync::Arc<tokio::sync::watch::Sender<usize>>;

pub struct Server {
    pub url: String,
    /// How many chat requests reached the handler: a test waits on it to act once a
    /// request is known to be in flight.
    pub received: tokio::sync::watch::Receiver<usize>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    pub async fn start() -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (counter, received) = tokio::sync::watch::channel(0);
        let app = axum::Router::new()
            .route("/v1/chat/completions", post(chat))
            .route("/admin/tuning", axum::routing::get(tuning))
            .with_state(std::sync::Arc::new(counter));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = rx.await;
                })
                .await
                .unwrap();
        });
        Server {
            url,
            received,
            stop: Some(tx),
            task,
        }
    }

    /// Completes once `n` chat requests have reached the handler (for ever if they
    /// never do).
    pub fn received_at_least(&self, n: usize) -> impl std::future::Future<Output = ()> {
        let mut received = self.received.clone();
        async move {
            if received.wait_for(|r| *r >= n).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    pub async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap();
    }
}
