//! What the node does with clients that misbehave at the connection level (slow
//! bodies, idle connections, many connections from one address, HTTP/2 with prior
//! knowledge), with prompts its engine cannot hold, and with an engine that hangs.
mod common;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use gorgo_node::mesh::Mesh;
use gorgo_node::ValidatedConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// A connection from `from` (a 127.0.0.x address) to `to`.
async fn connect_from(from: &str, to: SocketAddr) -> TcpStream {
    let sock = TcpSocket::new_v4().unwrap();
    sock.bind(format!("{from}:0").parse().unwrap()).unwrap();
    sock.connect(to).await.unwrap()
}

fn http_addr(node: &TestNode) -> SocketAddr {
    node.handle.http_addr
}

/// A client from another address than the misbehaving ones.
fn client_from(ip: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .local_address(ip.parse::<IpAddr>().unwrap())
        .build()
        .unwrap()
}

/// Start a request whose body never finishes: the head announces 100 bytes, one is
/// sent.
async fn slow_body(from: &str, to: SocketAddr) -> TcpStream {
    let mut s = connect_from(from, to).await;
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{",
    )
    .await
    .unwrap();
    s
}

/// Whether `n` holds stats of a live peer.
fn has_peer_stats(n: &TestNode) -> bool {
    n.state()
        .peers
        .peers()
        .iter()
        .any(|p| p.alive && p.stats.is_some())
}

/// Read what the server sends until it closes, within `limit`.
async fn read_to_close(s: &mut TcpStream, limit: Duration) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(limit, s.read_to_end(&mut out))
        .await
        .expect("the node closes the connection");
    out
}

#[tokio::test]
async fn slow_bodies_do_not_take_the_slots_of_ready_requests() {
    let engine = StubEngine::start("e").await;
    let node = start_node(
        config("a", &engine.url(), "[limits]\nmax_concurrency = 4\n"),
        None,
    )
    .await;
    let mut slow = Vec::new();
    for _ in 0..16 {
        slow.push(slow_body("127.0.0.2", http_addr(&node)).await);
    }
    // Wait until the node holds all 16 (their heads are parsed as soon as they are).
    while open_connections(&node).await < 16 {
        tokio::task::yield_now().await;
    }
    let resp = client_from("127.0.0.3")
        .post(format!("{}/v1/chat/completions", node.base))
        .json(&chat_body("hi", false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "a ready request is served");
    drop(slow);
    node.shutdown.cancel();
}

/// A raw HTTP/1 connection to `node` from 127.0.0.2 with a 4 KiB receive buffer, so a
/// response it does not read fills the socket soon.
async fn small_window_connection(node: &TestNode) -> TcpStream {
    let sock = TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    sock.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    sock.connect(http_addr(node)).await.unwrap()
}

/// Send a streamed chat completion on `s` (and read nothing).
async fn send_streamed_chat(s: &mut TcpStream) {
    let body = chat_body("x", true).to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body.as_bytes()).await.unwrap();
}

/// An HTTP/2 (prior knowledge) client connection to `node` whose streams may each hold
/// 64 KiB unread and all together `connection_window` bytes.
async fn h2_client(
    node: &TestNode,
    connection_window: u32,
) -> hyper::client::conn::http2::SendRequest<http_body_util::Full<bytes::Bytes>> {
    let tcp = TcpStream::connect(http_addr(node)).await.unwrap();
    let (sender, conn) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .initial_stream_window_size(65_535)
            .initial_connection_window_size(connection_window)
            .handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .expect("an HTTP/2 handshake");
    tokio::spawn(conn);
    sender
}

/// A streamed completion request for [`h2_client`].
fn streamed_completion(node: &TestNode) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    let body = r#"{"model":"m","prompt":"hi","stream":true}"#;
    http::Request::post(format!("http://{}/v1/completions", http_addr(node)))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap()
}

/// The node's `gorgo_connections_open{port="client"}`.
async fn open_connections(node: &TestNode) -> u64 {
    let text = metrics_text(node).await;
    metric_value(&text, "gorgo_connections_open{port=\"client\"}").map_or(0, |v| v as u64)
}

#[tokio::test]
async fn a_body_that_never_arrives_gets_408_in_openai_json() {
    let engine = StubEngine::start("e").await;
    let node = start_node(
        config("a", &engine.url(), "[limits]\nbody_timeout_ms = 200\n"),
        None,
    )
    .await;
    let mut s = slow_body("127.0.0.2", http_addr(&node)).await;
    let out = read_to_close(&mut s, Duration::from_secs(10)).await;
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("\"request_timeout\""), "{text}");
    assert_eq!(engine.requests(), 0);
    node.shutdown.cancel();
}

#[tokio::test]
async fn idle_and_silent_connections_are_closed() {
    let engine = StubEngine::start("e").await;
    let node = start_node(
        config(
            "a",
            &engine.url(),
            "[limits]\nheader_timeout_ms = 200\nidle_timeout_ms = 300\n",
        ),
        None,
    )
    .await;
    // Never sends a byte.
    let mut silent = connect_from("127.0.0.2", http_addr(&node)).await;
    // Sends half a request head.
    let mut half = connect_from("127.0.0.2", http_addr(&node)).await;
    half.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost:")
        .await
        .unwrap();
    read_to_close(&mut silent, Duration::from_secs(10)).await;
    read_to_close(&mut half, Duration::from_secs(10)).await;
    node.shutdown.cancel();
}

/// A keep-alive HTTP/1 connection that served a request and then went quiet is closed
/// at the header timeout (hyper's timer runs again after each response) and counted
/// as `idle`: a client slow to send a head is what `header_timeout` counts, and a
/// pool's idle connections there hid it.
#[tokio::test]
async fn a_quiet_keep_alive_connection_is_counted_idle() {
    let engine = StubEngine::start("e").await;
    let node = start_node(
        config(
            "a",
            &engine.url(),
            "[limits]\nheader_timeout_ms = 200\nidle_timeout_ms = 3600000\n",
        ),
        None,
    )
    .await;
    let mut s = connect_from("127.0.0.2", http_addr(&node)).await;
    s.write_all(b"GET /v1/models HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let out = read_to_close(&mut s, Duration::from_secs(20)).await;
    assert!(
        out.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&out)
    );
    let metrics = metrics_text(&node).await;
    assert!(
        metrics.contains(r#"gorgo_connections_refused_total{port="client",reason="idle"} 1"#),
        "{metrics}"
    );
    assert!(!metrics.contains(r#"reason="header_timeout""#), "{metrics}");
    node.shutdown.cancel();
}

/// An HTTP/2 (h2c) client that sends the preface and half a request head (a HEADERS
/// frame without END_HEADERS, and no CONTINUATION) is closed after
/// `header_timeout_ms`, as an HTTP/1 client with half a head is: hyper's header
/// timeout is HTTP/1's alone, and only the idle check (an hour here) closed it.
#[tokio::test]
async fn a_half_sent_http2_head_is_closed_at_the_header_timeout() {
    let engine = StubEngine::start("e").await;
    let node = start_node(
        config(
            "a",
            &engine.url(),
            "[limits]\nheader_timeout_ms = 200\nidle_timeout_ms = 3600000\n",
        ),
        None,
    )
    .await;
    let mut s = connect_from("127.0.0.2", http_addr(&node)).await;
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    // SETTINGS, empty: length 0, type 4, no flags, stream 0.
    s.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await.unwrap();
    // HEADERS on stream 1 with one byte of header block (`:method: GET`), flags
    // END_STREAM only: the head goes on in a CONTINUATION that never comes.
    s.write_all(&[0, 0, 1, 1, 0x1, 0, 0, 0, 1, 0x82])
        .await
        .unwrap();
    read_to_close(&mut s, Duration::from_secs(20)).await;
    let metrics = metrics_text(&node).await;
    assert!(
        metrics.contains(
            "gorgo_connections_refused_total{port=\"client\",reason=\"header_timeout\"} 1"
        ),
        "{metrics}"
    );
    node.shutdown.cancel();
}

/// A token holder's body that never arrives on the admin port gets a 408 after
/// `body_timeout_ms`, as on the client port: it had no deadline, and held an admin
/// connection (busy, so never evicted) for as long as the sender liked.
#[tokio::test]
async fn an_admin_body_that_never_arrives_gets_408() {
    let engine = StubEngine::start("e").await;
    let node = start_node(
        config("a", &engine.url(), "[limits]\nbody_timeout_ms = 200\n"),
        None,
    )
    .await;
    let mut s = connect_from("127.0.0.2", node.handle.admin_addr).await;
    let head = format!(
        "PUT /admin/weights HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{{"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let out = read_to_close(&mut s, Duration::from_secs(10)).await;
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("\"request_timeout\""), "{text}");
    node.shutdown.cancel();
}

#[tokio::test]
async fn one_address_cannot_take_every_connection() {
    let engine = StubEngine::start("e").await;
    let node = start_node(
        config(
            "a",
            &engine.url(),
            "[limits]\nmax_connections = 64\nmax_connections_per_ip = 8\n",
        ),
        None,
    )
    .await;
    let mut idle = Vec::new();
    for _ in 0..40 {
        idle.push(connect_from("127.0.0.2", http_addr(&node)).await);
    }
    // Past its cap, the address's idle connections make room for its new ones: the
    // oldest are closed.
    let closed = futures::future::join_all(idle.iter_mut().map(|s| async move {
        let mut b = [0u8; 1];
        matches!(
            tokio::time::timeout(Duration::from_millis(500), s.read(&mut b)).await,
            Ok(Ok(0))
        )
    }))
    .await;
    let refused = closed.iter().filter(|&&c| c).count();
    assert_eq!(refused, 32, "8 kept, 32 closed");
    let resp = client_from("127.0.0.3")
        .post(format!("{}/v1/chat/completions", node.base))
        .json(&chat_body("hi", false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "another address is served");
    let metrics = metrics_text(&node).await;
    assert!(
        metrics.contains(
            "gorgo_connections_refused_total{port=\"client\",reason=\"evicted_per_ip\"} 32"
        ),
        "{metrics}"
    );
    node.shutdown.cancel();
}

#[tokio::test]
async fn http2_with_prior_knowledge_is_served() {
    let engine = StubEngine::start("e").await;
    let node = start_node(config("a", &engine.url(), ""), None).await;
    let tcp = TcpStream::connect(http_addr(&node)).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .expect("an HTTP/2 handshake");
    tokio::spawn(conn);
    let body = chat_body("hi", false).to_string();
    let req = http::Request::post(format!("http://{}/v1/chat/completions", http_addr(&node)))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap();
    let resp = sender.send_request(req).await.expect("an HTTP/2 response");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-gorgo-served-by"], "a");
    node.shutdown.cancel();
}

#[tokio::test]
async fn a_prompt_over_the_context_is_refused_before_routing_and_never_cached() {
    let ea = StubEngine::start("a").await;
    let eb = StubEngine::start("b").await;
    let (a, b) = pair(
        config_with_engine("a", &ea.url(), "max_context_tokens = 1000\n"),
        config_with_engine("b", &eb.url(), "max_context_tokens = 1000\n"),
    )
    .await;
    let big = prompt("huge", 64 * 1024);
    let resp = client()
        .post(format!("{}/v1/chat/completions", a.base))
        .json(&chat_body(&big, false))
        .send()
        .await
        .unwrap();
    let (status, err) = error_of(resp).await;
    assert_eq!(status, 400);
    assert_eq!(err["error"]["code"], "context_length_exceeded", "{err}");
    assert_eq!((ea.requests(), eb.requests()), (0, 0), "no engine saw it");
    for n in [&a, &b] {
        assert_eq!(
            n.state().engine(0).unwrap().shadow.lock().longest_match(
                &n.state().hasher.chain(
                    &gorgo_core::prompt::canonicalize(
                        gorgo_core::Endpoint::Chat,
                        &chat_body(&big, false),
                    )
                    .unwrap(),
                )
            ),
            0
        );
    }
    a.shutdown.cancel();
    b.shutdown.cancel();
}

/// Without a tokenizer the node's count is an estimate: a prompt it estimates a few
/// percent over the context goes to the engine, which counts exactly (its refusal
/// reaches the client as it gave it); one well over is refused before routing. The
/// node refused a prompt llama.cpp served (estimated 2,130 tokens against a 2,048
/// context, 1,967 by the engine's count).
#[tokio::test]
async fn an_estimate_near_the_context_is_left_to_the_engine() {
    let engine = StubEngine::start("e").await;
    let p = prompt("near the edge", 16 * 1024);
    // The node's estimate of the prompt, read from a node with room to spare.
    let roomy = start_node(config("a", &engine.url(), ""), None).await;
    let resp = post_chat(&roomy, &p, false).await;
    assert_eq!(resp.status(), 200);
    let d = admin_json(&roomy, "/admin/decisions?limit=1").await;
    let estimate = d[0]["prompt_tokens"].as_u64().unwrap();
    roomy.shutdown.cancel();
    for (context, status) in [(estimate * 19 / 20, 200), (estimate * 4 / 5, 400)] {
        let extra = format!("max_context_tokens = {context}\n");
        let node = start_node(config_with_engine("a", &engine.url(), &extra), None).await;
        let before = engine.requests();
        let resp = post_chat(&node, &p, false).await;
        assert_eq!(
            resp.status(),
            status,
            "{estimate} estimated, context {context}"
        );
        let reached = engine.requests() - before;
        assert_eq!(reached, u64::from(status == 200), "context {context}");
        node.shutdown.cancel();
    }
}

#[tokio::test]
async fn what_the_engine_refuses_is_not_put_in_the_cache_model() {
    let engine = StubEngine::start("e").await;
    engine.set_mode(REJECT);
    let node = start_node(config("a", &engine.url(), ""), None).await;
    let body = chat_body(&prompt("refused", 8000), false);
    let resp = client()
        .post(format!("{}/v1/chat/completions", node.base))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400, "the engine's answer is relayed");
    let chain = node
        .state()
        .hasher
        .chain(&gorgo_core::prompt::canonicalize(gorgo_core::Endpoint::Chat, &body).unwrap());
    assert_eq!(
        node.state()
            .engine(0)
            .unwrap()
            .shadow
            .lock()
            .longest_match(&chain),
        0
    );
    engine.set_mode(NORMAL);
    let resp = client()
        .post(format!("{}/v1/chat/completions", node.base))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(
        node.state()
            .engine(0)
            .unwrap()
            .shadow
            .lock()
            .longest_match(&chain)
            > 0,
        "accepted: cached"
    );
    node.shutdown.cancel();
}

#[tokio::test]
async fn requests_waiting_on_a_hung_engine_fall_back_to_a_peer_when_its_breaker_opens() {
    let ea = StubEngine::start("a").await;
    let eb = StubEngine::start("b").await;
    let checks = "health_interval_ms = 100\nhealth_timeout_ms = 200\n";
    let (a, b) = pair(
        config_with_engine("a", &ea.url(), checks),
        config_with_engine("b", &eb.url(), checks),
    )
    .await;
    // Both engines confirmed healthy, and each node has the other's stats.
    for n in [&a, &b] {
        until("engines confirmed and peers' stats in", || {
            n.state().engine(0).unwrap().adapter.is_ready() && has_peer_stats(n)
        })
        .await;
    }
    // a's engine stops answering anything (SIGSTOP); a request sent to a now would
    // wait for the first-byte timeout (120 s) without the breaker.
    ea.set_mode(HANG_ALL);
    let resp = tokio::time::timeout(
        Duration::from_secs(20),
        client()
            .post(format!("{}/v1/chat/completions", a.base))
            .json(&chat_body(&prompt("fresh", 200), false))
            .send(),
    )
    .await
    .expect("answered long before the first-byte timeout")
    .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-gorgo-served-by"], "b");
    assert!(!a.state().engine(0).unwrap().adapter.is_healthy());
    ea.release.notify_waiters();
    a.shutdown.cancel();
    b.shutdown.cancel();
}

#[tokio::test]
async fn a_draining_node_finishes_what_it_has_and_sends_new_work_to_peers() {
    let ea = StubEngine::start("a").await;
    let eb = StubEngine::start("b").await;
    let (a, b) = pair(config("a", &ea.url(), ""), config("b", &eb.url(), "")).await;
    until("a has b's stats", || has_peer_stats(&a)).await;
    // One request in flight at a's engine, held there.
    ea.set_mode(HANG);
    let url = format!("{}/v1/chat/completions", a.base);
    let held = tokio::spawn({
        let url = url.clone();
        async move {
            client()
                .post(url)
                .json(&chat_body(&prompt("held", 200), false))
                .send()
                .await
                .unwrap()
                .status()
        }
    });
    until("the held request is at a's engine", || ea.requests() >= 1).await;
    let drain = tokio::spawn({
        let state = a.state().clone();
        async move { gorgo_node::drain(&state, Duration::from_secs(30)).await }
    });
    until("a is draining", || a.state().is_draining()).await;
    let ready = client()
        .get(format!("{}/readyz", a.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 503, "not ready while draining");
    // New work goes to the peer.
    let resp = client()
        .post(&url)
        .json(&chat_body(&prompt("new", 200), false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-gorgo-served-by"], "b");
    // Work only its own engine can take (a passthrough route) is refused with a
    // retry hint: a keep-alive client's embeddings held the drain to its deadline.
    let seen = ea.requests();
    let resp = client()
        .post(format!("{}/v1/embeddings", a.base))
        .json(&serde_json::json!({"model": "m", "input": "x"}))
        .send()
        .await
        .unwrap();
    assert!(resp.headers().contains_key("retry-after"));
    assert_eq!(error_of(resp).await.0, 503);
    assert_eq!(ea.requests(), seen, "the engine took no new work");
    assert!(!drain.is_finished(), "the held request is still in flight");
    // The held request finishes: the drain ends clean.
    ea.set_mode(NORMAL);
    ea.release.notify_waiters();
    assert_eq!(held.await.unwrap(), 200);
    assert_eq!(drain.await.unwrap(), 0, "nothing left in flight");
    a.shutdown.cancel();
    b.shutdown.cancel();
}

/// A node with no live peer and its ingress full answers "too many requests in flight"
/// (503, `Retry-After`) at once. Before, the request took an overflow slot for a relay
/// no peer could take: parsed and tokenised, logged with its healthy engine excluded,
/// and answered "no healthy engine and no live peer".
#[tokio::test]
async fn a_full_node_without_peers_does_not_overflow() {
    let engine = StubEngine::start("e").await;
    engine.set_mode(HANG);
    let node = start_node(
        config("a", &engine.url(), "[limits]\nmax_concurrency = 1\n"),
        None,
    )
    .await;
    let url = format!("{}/v1/chat/completions", node.base);
    let first = tokio::spawn({
        let url = url.clone();
        async move {
            client()
                .post(url)
                .json(&chat_body("first", false))
                .send()
                .await
                .map(|r| r.status())
        }
    });
    until("the first holds the slot", || engine.requests() >= 1).await;
    let resp = client()
        .post(&url)
        .json(&chat_body("second", false))
        .send()
        .await
        .unwrap();
    assert!(resp.headers().contains_key("retry-after"));
    let (status, err) = error_of(resp).await;
    assert_eq!(status, 503);
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("too many requests in flight"),
        "{err}"
    );
    let decisions = admin_json(&node, "/admin/decisions").await;
    assert_eq!(decisions.as_array().unwrap().len(), 1, "{decisions}");
    engine.release.notify_waiters();
    assert_eq!(first.await.unwrap().unwrap(), 200);
    node.shutdown.cancel();
}

/// A drain closes the client listener once the work only this node can finish is done,
/// though client requests it relays to peers are still in flight: an overflow relay
/// (the ingress cap full, the request sent on to a peer) holds a forward slot, and was
/// counted as a peer's forward served here, so under load the drain ran to its deadline.
#[tokio::test]
async fn a_drain_does_not_wait_on_overflow_relays_as_local_work() {
    let ea = StubEngine::start("a").await;
    let eb = StubEngine::start("b").await;
    let (a, b) = pair(
        config("a", &ea.url(), "[limits]\nmax_concurrency = 1\n"),
        config("b", &eb.url(), ""),
    )
    .await;
    until("a has b's stats", || has_peer_stats(&a)).await;
    // a's engine looks busy, so a sends its requests to b, whose engine holds them.
    ea.waiting.store(50, std::sync::atomic::Ordering::SeqCst);
    a.state().engine(0).unwrap().adapter.scrape().await;
    eb.set_mode(HANG);
    let send = |name: &'static str| {
        let url = format!("{}/v1/chat/completions", a.base);
        tokio::spawn(async move {
            client()
                .post(url)
                .json(&chat_body(&prompt(name, 200), false))
                .send()
                .await
                .map(|r| r.status())
        })
    };
    // The first holds a's one ingress slot; the second overflows to b.
    let first = send("routed");
    until("the first is at b's engine", || eb.requests() >= 1).await;
    let second = send("overflow");
    until("the overflow is at b's engine", || eb.requests() >= 2).await;
    assert_eq!(ea.requests(), 0);
    let drain = tokio::spawn({
        let state = a.state().clone();
        async move { gorgo_node::drain(&state, Duration::from_secs(60)).await }
    });
    until("a closes its listener, its own work done", || {
        a.state().is_closing()
    })
    .await;
    assert!(
        !drain.is_finished(),
        "the relayed requests are still in flight"
    );
    eb.set_mode(NORMAL);
    eb.release.notify_waiters();
    assert_eq!(first.await.unwrap().unwrap(), 200);
    assert_eq!(second.await.unwrap().unwrap(), 200);
    assert_eq!(drain.await.unwrap(), 0, "nothing left in flight");
    a.shutdown.cancel();
    b.shutdown.cancel();
}

/// A draining node whose peer fails the request before its first byte serves it
/// itself, and does not try that peer again: the peer's engine sees it once. Before,
/// the local fallback routed it afresh, and a peer that looked cheaper got it again.
#[tokio::test]
async fn a_draining_node_does_not_retry_the_peer_that_failed_it() {
    let ea = StubEngine::start("a").await;
    let eb = StubEngine::start("b").await;
    let (a, b) = pair(
        config("a", &ea.url(), ""),
        config("b", &eb.url(), "[limits]\nfirst_byte_timeout_ms = 200\n"),
    )
    .await;
    until("a has b's stats", || has_peer_stats(&a)).await;
    // a's engine looks busy, so b is the cheaper place for it; b's engine hangs, and b
    // answers the forward 504 at its first-byte timeout.
    ea.waiting.store(50, std::sync::atomic::Ordering::SeqCst);
    a.state().engine(0).unwrap().adapter.scrape().await;
    eb.set_mode(HANG);
    a.state().start_draining();
    let resp = client()
        .post(format!("{}/v1/chat/completions", a.base))
        .json(&chat_body(&prompt("drained", 200), true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-gorgo-served-by"], "a");
    assert_eq!(eb.requests(), 1, "b was tried once");
    assert_eq!(ea.requests(), 1);
    eb.release.notify_waiters();
    a.shutdown.cancel();
    b.shutdown.cancel();
}

/// A request relayed to a peer that answers 504 (its engine sent no head in time), with
/// nowhere else to go, is a 504 for its client: a wait, not a full node (it was a 503
/// "forward failed and no local engine", with a hint to retry at once).
#[tokio::test]
async fn an_overflow_relay_that_times_out_at_the_peer_is_a_504() {
    let ea = StubEngine::start("a").await;
    let eb = StubEngine::start("b").await;
    let (a, b) = pair(
        config("a", &ea.url(), "[limits]\nmax_concurrency = 1\n"),
        config("b", &eb.url(), "[limits]\nfirst_byte_timeout_ms = 200\n"),
    )
    .await;
    until("a has b's stats", || has_peer_stats(&a)).await;
    // a's one ingress slot is held at its own engine; the next request overflows to b,
    // whose engine sends no head.
    ea.set_mode(HANG);
    eb.set_mode(HANG);
    let held = tokio::spawn(post_chat_owned(a.base.clone(), "held"));
    until("a's slot is held at its engine", || ea.requests() >= 1).await;
    let resp = client()
        .post(format!("{}/v1/chat/completions", a.base))
        .json(&chat_body(&prompt("overflow", 200), true))
        .send()
        .await
        .unwrap();
    assert_eq!(eb.requests(), 1, "relayed to b");
    let (status, body) = error_of(resp).await;
    assert_eq!(status, 504, "{body}");
    ea.release.notify_waiters();
    eb.release.notify_waiters();
    let _ = held.await;
    a.shutdown.cancel();
    b.shutdown.cancel();
}

/// POST a small chat to `base`, its status (a task may own it).
async fn post_chat_owned(base: String, name: &'static str) -> Option<u16> {
    client()
        .post(format!("{base}/v1/chat/completions"))
        .json(&chat_body(&prompt(name, 200), false))
        .send()
        .await
        .ok()
        .map(|r| r.status().as_u16())
}

/// A client that stops reading a response relayed from a peer is still cut at
/// `write_timeout_ms` once the node drains and its connections are closing: the write
/// watchdog used to stop at the close, so the request kept its ingress slot and the
/// drain waited out its deadline and ended unclean (here a's own engine is out of
/// rotation, so the drain's first phase, local work, passes at once).
#[tokio::test]
async fn a_drain_still_cuts_a_client_that_stopped_reading() {
    let ea = StubEngine::start("a").await;
    let eb = StubEngine::start("b").await;
    eb.set_mode(FLOOD);
    let (a, b) = pair(
        config("a", &ea.url(), "[limits]\nwrite_timeout_ms = 2000\n"),
        config("b", &eb.url(), ""),
    )
    .await;
    until("a has b's stats", || has_peer_stats(&a)).await;
    a.state().engine(0).unwrap().start_draining();
    let mut s = small_window_connection(&a).await;
    send_streamed_chat(&mut s).await;
    let flowing = eb.active.clone();
    until("b's engine streams to a", || {
        flowing.load(std::sync::atomic::Ordering::SeqCst) == 1
    })
    .await;
    assert_eq!(a.state().engine_inflight(), 0, "nothing at a's own engine");
    let left = gorgo_node::drain(a.state(), Duration::from_secs(20)).await;
    assert_eq!(
        left, 0,
        "the stalled client held its slot to the drain's end"
    );
    let metrics = metrics_text(&a).await;
    assert!(metrics.contains(r#"reason="write_timeout""#), "{metrics}");
    drop(s);
    a.shutdown.cancel();
    b.shutdown.cancel();
}

#[tokio::test]
async fn an_engine_failing_mid_stream_opens_its_breaker() {
    let engine = StubEngine::start("e").await;
    engine.set_mode(FAIL_MID_STREAM);
    let node = start_node(
        config_with_engine("a", &engine.url(), "breaker_failures = 2\n"),
        None,
    )
    .await;
    // The node's first health check passes and resets the failure count: let it land
    // before the failures, not between them (the next is an hour away).
    let state = node.state().clone();
    tokio::time::timeout(std::time::Duration::from_secs(10), async move {
        while !state.engine(0).unwrap().adapter.is_ready() {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the first health check");
    for i in 0..2 {
        assert!(
            node.state().engine(0).unwrap().adapter.is_healthy(),
            "closed before failure {i}"
        );
        let resp = client()
            .post(format!("{}/v1/chat/completions", node.base))
            .json(&chat_body(&prompt(&format!("s{i}"), 100), true))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "the head had come");
        let mut resp = resp;
        let first = resp.chunk().await.unwrap().unwrap();
        assert!(String::from_utf8_lossy(&first).contains("hello"));
        engine.release.notify_one();
        let mut rest = Vec::new();
        while let Ok(Some(c)) = resp.chunk().await {
            rest.extend_from_slice(&c);
        }
        let text = String::from_utf8_lossy(&rest);
        assert!(text.contains("error"), "the stream says it was cut: {text}");
    }
    assert!(
        !node.state().engine(0).unwrap().adapter.is_healthy(),
        "two streams cut by the engine open its breaker"
    );
    node.shutdown.cancel();
}

/// Request heads waiting for their bodies hold the budget too: eighteen heads of about
/// 60 KB whose bodies never come take it, and the next request gets a 503 at once
/// instead of its head joining them. Before, heads were not counted (an HTTP/2 client
/// could hold 256 of them a connection, 1,024 connections an address).
#[tokio::test]
async fn heads_waiting_for_their_bodies_hold_the_budget() {
    let (_engine, node) = smallest_budget_node().await;
    let reading = |n: &TestNode| n.state().metrics.body_bytes_reading.get();
    let head = |pad: usize| {
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-pad: {}\r\ncontent-type: application/json\r\ncontent-length: 10\r\n\r\n",
            "p".repeat(pad)
        )
    };
    let mut waiting = Vec::new();
    for _ in 0..18 {
        let mut s = connect_from("127.0.0.2", http_addr(&node)).await;
        s.write_all(head(60_000).as_bytes()).await.unwrap();
        waiting.push(s);
    }
    until("the heads take the budget", || {
        reading(&node) >= 18 * 60_000
    })
    .await;
    let mut s = connect_from("127.0.0.3", http_addr(&node)).await;
    s.write_all(head(60_000).as_bytes()).await.unwrap();
    let mut answer = vec![0u8; 64];
    let n = s.read(&mut answer).await.unwrap();
    let line = String::from_utf8_lossy(&answer[..n]);
    assert!(line.starts_with("HTTP/1.1 503"), "{line}");
    drop(waiting);
    until("the heads give the budget back", || reading(&node) == 0).await;
    node.shutdown.cancel();
}

/// Nodes `a` and `b`, configured by `config_a` and `config_b`, on a mesh 5 ms apart
/// (the nodes hold the mesh).
async fn pair(config_a: ValidatedConfig, config_b: ValidatedConfig) -> (TestNode, TestNode) {
    let mesh = Mesh::new();
    mesh.set_rtt("a", "b", 5.0);
    let a = start_node(config_a, Some(&mesh)).await;
    let b = start_node(config_b, Some(&mesh)).await;
    (a, b)
}

/// A node with a 64 KiB body cap and the smallest budget of bodies being read that
/// allows (64 KiB + 1 MiB: one largest forwarded request), and its engine.
async fn smallest_budget_node() -> (Arc<StubEngine>, TestNode) {
    let engine = StubEngine::start("e").await;
    let node = start_node(
        config(
            "a",
            &engine.url(),
            "[limits]\nmax_body_bytes = 65536\nmax_body_bytes_in_flight = 1114112\n",
        ),
        None,
    )
    .await;
    (engine, node)
}

/// A client body being read with `sent` of its announced `len` bytes sent.
async fn partial_body(from: &str, to: SocketAddr, len: usize, sent: usize) -> TcpStream {
    let mut s = connect_from(from, to).await;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len}\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(&vec![b' '; sent]).await.unwrap();
    s
}

#[tokio::test]
async fn bodies_being_read_share_one_byte_budget() {
    // The smallest budget a 64 KiB body cap allows: one largest forwarded request.
    let budget: i64 = 65_536 + 1_048_576;
    let (engine, node) = smallest_budget_node().await;
    let reading = |n: &TestNode| n.state().metrics.body_bytes_reading.get();
    // Clients hold their heads and what they have sent, to the byte, not what they
    // announce. `partial_body`'s head holds 148 bytes (each header's name and value,
    // and 32 for its entry): sixteen that sent 64 KiB - 1 of 64 KiB and one that sent
    // 63,036 bytes take the whole budget.
    const HEAD: usize = 148;
    let mut slow = Vec::new();
    for _ in 0..16 {
        slow.push(partial_body("127.0.0.2", http_addr(&node), 65_536, 65_535).await);
    }
    let rest = budget as usize - 16 * (HEAD + 65_535) - HEAD;
    assert_eq!(rest, 63_036);
    slow.push(partial_body("127.0.0.2", http_addr(&node), 65_536, rest).await);
    until("the slow bodies take the budget", || {
        reading(&node) >= budget
    })
    .await;
    let resp = client_from("127.0.0.3")
        .post(format!("{}/v1/chat/completions", node.base))
        .json(&chat_body("hi", false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503, "no budget left for another body");
    assert!(resp.headers().contains_key("retry-after"));
    let err: serde_json::Value = resp.json().await.unwrap();
    let message = err["error"]["message"].as_str().unwrap();
    assert!(message.contains("limits.max_body_bytes_in_flight"), "{err}");
    // A peer's forward takes its announced length first: none fits now.
    assert_eq!(
        forward_head_status(&node, &4096u32.to_be_bytes()).await,
        503
    );
    // Bodies that go away give their share back; then a request is served.
    drop(slow);
    until("closed bodies give the budget back", || reading(&node) == 0).await;
    let resp = client_from("127.0.0.3")
        .post(format!("{}/v1/chat/completions", node.base))
        .json(&chat_body("hi", false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(engine.requests(), 1);
    node.shutdown.cancel();
}

/// A client that stops reading a response the node still has bytes for is cut off
/// after `write_timeout_ms`, long before the request's own deadline: its connection
/// slot and the engine's stream are freed (hyper has no write timeout of its own).
#[tokio::test]
async fn a_client_that_stops_reading_is_cut_off() {
    let (engine, node) = flooding_node("[limits]\nwrite_timeout_ms = 300\n").await;
    let mut s = small_window_connection(&node).await;
    send_streamed_chat(&mut s).await;
    // Never read: the node's buffers and the socket's fill, then it must give up.
    let engine_active = engine.active.clone();
    until("the engine to stream", || {
        engine_active.load(std::sync::atomic::Ordering::SeqCst) == 1
    })
    .await;
    let mut open = u64::MAX;
    for _ in 0..2000 {
        open = open_connections(&node).await;
        if open == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(open, 0, "the stalled connection is still open");
    let metrics = metrics_text(&node).await;
    assert!(metrics.contains(r#"reason="write_timeout""#), "{metrics}");
    until("the engine stream to be dropped", || {
        engine_active.load(std::sync::atomic::Ordering::SeqCst) == 0
    })
    .await;
    drop(s);
    node.shutdown.cancel();
}

/// A connection that sat idle before its request stalls is checked within the write
/// timeout too, not at the idle deadline (60 s by default) the idle watchdog had
/// armed for.
#[tokio::test]
async fn a_stall_after_an_idle_spell_is_seen_within_the_write_timeout() {
    let (engine, node) = flooding_node("[limits]\nwrite_timeout_ms = 300\n").await;
    let mut s = small_window_connection(&node).await;
    // Idle past the first watchdog check (the scenario, not a synchronisation).
    tokio::time::sleep(Duration::from_millis(500)).await;
    send_streamed_chat(&mut s).await;
    let engine_active = engine.active.clone();
    until("the engine to stream", || {
        engine_active.load(std::sync::atomic::Ordering::SeqCst) == 1
    })
    .await;
    until("the stalled stream to be dropped", || {
        engine_active.load(std::sync::atomic::Ordering::SeqCst) == 0
    })
    .await;
    let metrics = metrics_text(&node).await;
    assert!(metrics.contains(r#"reason="write_timeout""#), "{metrics}");
    drop(s);
    node.shutdown.cancel();
}

/// The write timeout is about bytes the client does not take, not about a response that
/// takes long to start: on a kept-alive connection whose last response ended (a whole
/// error body, not asked past its last frame), a request whose engine takes longer than the write
/// timeout to answer is served, not cut off.
#[tokio::test]
async fn a_slow_head_on_a_kept_alive_connection_is_not_a_write_stall() {
    let engine = StubEngine::start("e").await;
    let node = start_node(
        config("a", &engine.url(), "[limits]\nwrite_timeout_ms = 100\n"),
        None,
    )
    .await;
    let c = client_from("127.0.0.3");
    let send = || {
        c.post(format!("{}/v1/chat/completions", node.base))
            .json(&chat_body("x", false))
            .send()
    };
    // An error answer first: a whole body, which hyper does not ask past its frame.
    let bad = c
        .post(format!("{}/v1/chat/completions", node.base))
        .header("content-type", "application/json")
        .body("{")
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    bad.bytes().await.unwrap();
    engine.set_mode(HANG);
    let before = engine.requests();
    let pending = send();
    let held = async {
        until("the engine to hold the request", || {
            engine.requests() > before
        })
        .await;
        // Several write-timeout checks pass while the engine holds it (not a
        // synchronisation: the time a stall would need to be noticed).
        tokio::time::sleep(Duration::from_millis(500)).await;
        engine.release.notify_waiters();
    };
    let (resp, ()) = tokio::join!(pending, held);
    assert_eq!(resp.unwrap().status(), 200);
    let metrics = metrics_text(&node).await;
    assert!(!metrics.contains(r#"reason="write_timeout""#), "{metrics}");
    node.shutdown.cancel();
}

/// An HTTP/2 client that stops reading (its stream window full) stops the node polling
/// the response body, so only the deadline's own task ends it: that task must also
/// take the request out of the tuner's open requests, or its time so far would be
/// reported as a lower bound on its E2E, growing, for as long as the client stays.
#[tokio::test]
async fn a_stalled_http2_response_leaves_the_tuners_open_requests_at_its_deadline() {
    let (_engine, node) = flooding_tuned_node().await;
    let slots = node.state().permits.available_permits();
    let mut sender = h2_client(&node, 65_535).await;
    let resp = sender
        .send_request(streamed_completion(&node))
        .await
        .expect("an HTTP/2 response");
    assert_eq!(resp.status(), 200);
    // Never read: the window fills and the node stops polling the body.
    let open = || node.state().tuning.view().open_requests;
    until("its first token counts for tuning", || open() == 1).await;
    until("the slot is freed at the deadline", || {
        node.state().permits.available_permits() == slots
    })
    .await;
    assert_eq!(open(), 0, "still open past its deadline");
    drop(resp);
    node.shutdown.cancel();
}

/// A streamed request whose engine sent its head and then nothing until the deadline
/// counts its wait for tuning, a lower bound on its TTFT and E2E: the one sample of a
/// one-request window closes it. (Counted only where no head came, it counted nothing
/// on real engines, which send a stream's head before prefill: an arm whose requests
/// ran into the deadline lost its slowest.) A sequential trial: a paired one needs
/// two requests a window.
#[tokio::test]
async fn a_stream_cut_at_its_deadline_before_its_first_token_counts_its_wait() {
    let engine = StubEngine::start("e").await;
    engine.set_mode(HEAD_THEN_HANG);
    let node = start_node(
        config(
            "a",
            &engine.url(),
            "[limits]\nrequest_timeout_ms = 300\n[tuning]\nmode = \"online\"\nstartup_grace_ms = 0\ntrial = \"sequential\"\nwindow_requests = 1\nmin_samples = 1\nfit_start = false\n",
        ),
        None,
    )
    .await;
    let epoch = || node.state().tuning.epoch();
    until("the node leads its tuning line", || epoch() > 0).await;
    let before = epoch();
    let resp = post_chat(&node, "stuck", true).await;
    let text = resp.text().await.unwrap();
    assert!(text.contains("timed out"), "{text}");
    until("the window closes on the request's wait", || {
        epoch() > before
    })
    .await;
    node.shutdown.cancel();
}

/// On HTTP/2 one stream whose client stopped reading is cut after `write_timeout_ms`
/// while the connection's other streams go on: the stalled one's engine stream is
/// dropped, the other is still served. (The wait was tracked per connection, so the
/// flowing stream's frames hid the stalled one until its deadline.) Once the others
/// end, the cut stream no longer counts as in flight: the connection goes idle and is
/// closed, though its client still holds the stream.
#[tokio::test]
async fn a_stalled_http2_stream_is_cut_while_the_others_flow() {
    let (engine, node) =
        flooding_node("[limits]\nwrite_timeout_ms = 300\nidle_timeout_ms = 500\n").await;
    // Each stream may hold 64 KiB unread; the connection room for many more, so the
    // stalled stream does not hold up the other.
    let mut sender = h2_client(&node, 64 << 20).await;
    let stalled = sender
        .send_request(streamed_completion(&node))
        .await
        .unwrap();
    assert_eq!(stalled.status(), 200);
    let flowing = sender
        .send_request(streamed_completion(&node))
        .await
        .unwrap();
    assert_eq!(flowing.status(), 200);
    // Read the flowing stream for as long as the test runs; count what arrives.
    let read = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let reader = {
        let read = read.clone();
        tokio::spawn(async move {
            use http_body_util::BodyExt;
            let mut body = flowing.into_body();
            while let Some(Ok(frame)) = body.frame().await {
                if let Some(data) = frame.data_ref() {
                    read.fetch_add(data.len() as u64, std::sync::atomic::Ordering::SeqCst);
                }
            }
        })
    };
    let active = engine.active.clone();
    let engines = || active.load(std::sync::atomic::Ordering::SeqCst);
    until("both engine streams to run", || engines() == 2).await;
    until("the stalled stream's engine stream to be dropped", || {
        engines() == 1
    })
    .await;
    // The other stream is still served on the same connection.
    let before = read.load(std::sync::atomic::Ordering::SeqCst);
    until("the flowing stream to go on", || {
        read.load(std::sync::atomic::Ordering::SeqCst) > before + (1 << 20)
    })
    .await;
    assert!(!reader.is_finished());
    let metrics = metrics_text(&node).await;
    assert!(
        metrics.contains(r#"reason="write_timeout_stream""#),
        "{metrics}"
    );
    assert!(!metrics.contains(r#"reason="write_timeout""#), "{metrics}");
    // The flowing stream ends (its client resets it); the stalled one is still held.
    reader.abort();
    until("the flowing stream's engine stream to be dropped", || {
        engines() == 0
    })
    .await;
    for _ in 0..2000 {
        if sender.is_closed() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        sender.is_closed(),
        "a connection of cut streams is never idle"
    );
    let metrics = metrics_text(&node).await;
    assert!(metrics.contains(r#"reason="idle""#), "{metrics}");
    drop(stalled);
    node.shutdown.cancel();
}

/// A route the node passes to its engine unrouted (SGLang's `/generate`) waits for
/// its head under the request's deadline, as routed requests do: a 504 when it passes.
/// It waited the first-byte timeout (120 s here) from the send, and a head that came
/// after the deadline was relayed as a 200 whose body was cut at once.
#[tokio::test]
async fn a_passthrough_request_waits_for_its_head_within_its_deadline() {
    let engine = StubEngine::start("e").await;
    let node = start_node(
        config("a", &engine.url(), "[limits]\nrequest_timeout_ms = 300\n"),
        None,
    )
    .await;
    engine.set_mode(HANG);
    let resp = tokio::time::timeout(
        Duration::from_secs(20),
        client()
            .post(format!("{}/generate", node.base))
            .json(&serde_json::json!({"text": "hello", "sampling_params": {"max_new_tokens": 4}}))
            .send(),
    )
    .await
    .expect("answered at its deadline, long before the first-byte timeout")
    .unwrap();
    assert_eq!(resp.status(), 504);
    engine.release.notify_waiters();
    node.shutdown.cancel();
}

/// A connection from 127.0.0.2 with a small, fixed send buffer: what the node does not
/// read of a body cannot hide in the client's kernel buffers, so a node that closes on
/// an unread body resets the client's writes every time.
async fn small_send_buffer(to: SocketAddr) -> TcpStream {
    let sock = TcpSocket::new_v4().unwrap();
    sock.set_send_buffer_size(16 * 1024).unwrap();
    sock.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    sock.connect(to).await.unwrap()
}

/// What the node sends up to the end of the response head (and whatever came with
/// it), or until it closes or resets the connection.
async fn read_head(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let read = async {
        while !out.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut buf).await {
                Ok(n) if n > 0 => out.extend_from_slice(&buf[..n]),
                _ => break,
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(20), read)
        .await
        .expect("the node answers");
    String::from_utf8_lossy(&out).into_owned()
}

/// One whole response with a `content-length`, head and body, off a kept-alive
/// connection: the next read starts at the next response.
async fn read_response(s: &mut TcpStream) -> String {
    let mut text = read_head(s).await;
    let head_end = text.find("\r\n\r\n").expect("a response head") + 4;
    let len: usize = text[..head_end]
        .to_ascii_lowercase()
        .split("content-length: ")
        .nth(1)
        .and_then(|v| v.split("\r\n").next()?.parse().ok())
        .expect("a content-length");
    let mut rest = vec![0u8; (head_end + len).saturating_sub(text.len())];
    s.read_exact(&mut rest).await.unwrap();
    text.push_str(&String::from_utf8_lossy(&rest));
    text
}

/// A client that sends its whole body before it reads (as `gorgo bench` replaying a
/// 67 MB trace row did, through hyper) gets the node's 413, not a reset: the node
/// reads on, and throws away, what the client still sends after the answer (a
/// lingering close) instead of closing on unread bytes, which makes the kernel reset
/// the connection under the client's writes. Both ways a body is found too large: by
/// its announced length (answered at once, nothing of it read), and by its bytes (a
/// chunked body read to the cap).
#[tokio::test]
async fn a_client_still_sending_a_body_over_the_cap_gets_the_413() {
    let engine = StubEngine::start("e").await;
    let node = start_node(
        config("a", &engine.url(), "[limits]\nmax_body_bytes = 1048576\n"),
        None,
    )
    .await;
    let cap = 1usize << 20;

    // Announced one byte over the cap: 413 before a byte of it is read.
    let mut s = small_send_buffer(http_addr(&node)).await;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        cap + 1
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(&vec![b' '; cap + 1])
        .await
        .expect("the whole body is taken, not reset");
    let text = read_head(&mut s).await;
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(
        text.to_ascii_lowercase().contains("connection: close"),
        "{text}"
    );

    // Chunked, half as much again as the cap: 413 once the cap is read; the rest is
    // read to its end, and the node then closes cleanly.
    let mut s = small_send_buffer(http_addr(&node)).await;
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n",
    )
    .await
    .unwrap();
    let chunk = [
        format!("{:x}\r\n", 64 * 1024).into_bytes(),
        vec![b' '; 64 * 1024],
        b"\r\n".to_vec(),
    ]
    .concat();
    for _ in 0..(cap + cap / 2) / (64 * 1024) {
        s.write_all(&chunk)
            .await
            .expect("the whole body is taken, not reset");
    }
    s.write_all(b"0\r\n\r\n").await.unwrap();
    let out = read_to_close(&mut s, Duration::from_secs(20)).await;
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("\"request_too_large\""), "{text}");
    assert_eq!(engine.requests(), 0);
    node.shutdown.cancel();
}

/// A client that stops sending after a 413 but keeps its connection open is closed
/// once the reading on is over (`limits.body_timeout_ms` here, under the 5 s it lasts
/// at most), not held to the idle timeout.
#[tokio::test]
async fn a_client_that_stalls_after_a_413_is_closed() {
    let engine = StubEngine::start("e").await;
    let node = start_node(
        config(
            "a",
            &engine.url(),
            "[limits]\nmax_body_bytes = 65536\nbody_timeout_ms = 300\n",
        ),
        None,
    )
    .await;
    let mut s = partial_body("127.0.0.2", http_addr(&node), 1 << 30, 4096).await;
    let out = read_to_close(&mut s, Duration::from_secs(20)).await;
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    node.shutdown.cancel();
}

/// A small body the answer left unread is read to its end, and its connection goes on
/// serving: the reading on closes only a connection whose body may hold more than it
/// reads.
#[tokio::test]
async fn a_small_unread_body_keeps_its_connection() {
    let engine = StubEngine::start("e").await;
    let node = start_node(config("a", &engine.url(), ""), None).await;
    let mut s = connect_from("127.0.0.2", http_addr(&node)).await;
    for _ in 0..2 {
        s.write_all(
            b"POST /no/such/route HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n0123456789",
        )
        .await
        .unwrap();
        let text = read_response(&mut s).await;
        assert!(text.starts_with("HTTP/1.1 404"), "{text}");
        assert!(
            !text.to_ascii_lowercase().contains("connection: close"),
            "{text}"
        );
        assert!(text.ends_with('}'), "{text}");
    }
    node.shutdown.cancel();
}

/// A completions `prompt` of `n` token ids (below 151,000, as a large vocabulary's).
fn token_id_prompt(n: usize) -> String {
    let ids: Vec<String> = (0..n).map(|i| (i * 7919 % 151_000).to_string()).collect();
    format!(
        r#"{{"model":"m","max_tokens":1,"prompt":[{}]}}"#,
        ids.join(",")
    )
}

/// A body of more JSON values than the node parses (scalars count: 8 MiB of `0,` is
/// 128 MB parsed) is refused before it is parsed, with a message naming the cap, on
/// the routed and the passed-through routes alike; a completions prompt of token ids
/// filling a 1M-token context is routed.
#[tokio::test]
async fn a_body_of_too_many_json_values_is_refused_and_a_1m_token_prompt_is_not() {
    let engine = StubEngine::start("e").await;
    let node = start_node(config("a", &engine.url(), ""), None).await;
    let cap = gorgo_node::validate::MAX_JSON_VALUES;
    // The object, its 3 keys, `model`'s and `max_tokens`' values and the array: 7.
    let zeros = format!(
        r#"{{"model":"m","max_tokens":1,"prompt":[{}0]}}"#,
        "0,".repeat(cap - 7)
    );
    for path in ["/v1/completions", "/v1/embeddings"] {
        let resp = client()
            .post(format!("{}{path}", node.base))
            .header("content-type", "application/json")
            .body(zeros.clone())
            .send()
            .await
            .unwrap();
        let (status, err) = error_of(resp).await;
        assert_eq!(status, 400, "{path}");
        let message = err["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("too many JSON values: more than {cap}")),
            "{path}: {message}"
        );
        assert_eq!(err["error"]["type"], "invalid_request_error", "{err}");
    }
    assert_eq!(engine.requests(), 0);
    let resp = client()
        .post(format!("{}/v1/completions", node.base))
        .header("content-type", "application/json")
        .body(token_id_prompt(1 << 20))
        .send()
        .await
        .unwrap();
    // The stub engine's own body limit (axum's 2 MB) may answer it; the node parsed,
    // counted and routed it.
    assert_ne!(resp.status(), 400, "{}", resp.text().await.unwrap());
    let d = admin_json(&node, "/admin/decisions?limit=1").await;
    assert_eq!(d[0]["prompt_tokens"], 1 << 20, "{d}");
    node.shutdown.cancel();
}
