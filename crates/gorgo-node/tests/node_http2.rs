//! HTTP/2 with prior knowledge (h2c) clients at the connection level, spoken frame by
//! frame: what a node does with a request head sent by halves after a first request.
//! (`node_limits.rs` holds the first head's and HTTP/1's cases.)
mod common;

use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// An HTTP/2 frame: length, type, flags, stream, payload.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u32).to_be_bytes();
    let mut f = vec![len[1], len[2], len[3], kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// The preface, an empty SETTINGS and `GET /v1/models` on stream 1, whole (HPACK:
/// `:method GET`, `:scheme http` indexed, `:path` literal).
fn open_with_a_request() -> Vec<u8> {
    let mut b = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    b.extend(frame(0x4, 0, 0, &[]));
    let mut head = vec![0x82, 0x86, 0x04, 10];
    head.extend_from_slice(b"/v1/models");
    // END_STREAM | END_HEADERS.
    b.extend(frame(0x1, 0x5, 1, &head));
    b
}

/// Whether the server's frames in `got` end `stream` (END_STREAM on its HEADERS or
/// DATA).
fn ended(got: &[u8], stream: u32) -> bool {
    let mut rest = got;
    while rest.len() >= 9 {
        let len = (usize::from(rest[0]) << 16) | (usize::from(rest[1]) << 8) | usize::from(rest[2]);
        if rest.len() < 9 + len {
            return false;
        }
        let id = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]) & 0x7fff_ffff;
        if matches!(rest[3], 0x0 | 0x1) && rest[4] & 0x1 != 0 && id == stream {
            return true;
        }
        rest = &rest[9 + len..];
    }
    false
}

/// After a first request served whole, a client sends half a head on stream 3 (a
/// HEADERS frame without END_HEADERS, and no CONTINUATION): the node closes the
/// connection after `header_timeout_ms` and counts it as `header_timeout`, as it does a
/// first head sent by halves. Hyper times no HTTP/2 head, and the node timed only the
/// first: a later one held the connection until `idle_timeout_ms` (an hour here).
#[tokio::test]
async fn a_later_http2_head_sent_by_halves_is_closed_at_the_header_timeout() {
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
    let mut s = TcpStream::connect(node.handle.http_addr).await.unwrap();
    s.write_all(&open_with_a_request()).await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), async {
        while !ended(&got, 1) {
            let mut buf = [0u8; 4096];
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before the first response ended");
            got.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .expect("the first response");
    // HEADERS on stream 3, one byte of header block (`:method GET`), END_STREAM only.
    s.write_all(&frame(0x1, 0x1, 3, &[0x82])).await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut rest))
        .await
        .expect("the node closes the connection")
        .ok();
    let metrics = metrics_text(&node).await;
    assert!(
        metrics.contains(
            "gorgo_connections_refused_total{port=\"client\",reason=\"header_timeout\"} 1"
        ),
        "{metrics}"
    );
    assert!(!metrics.contains(r#"reason="idle""#), "{metrics}");
    node.shutdown.cancel();
}
