//! A node following its engine's KV events (`engine.kv_events`): over the emulator's
//! publisher, and over a hand-driven one for the bad streams (garbage, oversized
//! batches, a restart, silence), which are counted, resynced and never a panic.
mod common;

use std::time::Duration;

use common::*;
use gorgo_core::kv_wire::{encode_batch, encode_seq, KvEvent, KvEventBatch};
use gorgo_core::{HashChain, IndexSource};
use gorgo_engine::kv_events::KvPublisher;
use gorgo_engine::profile::Profile;
use gorgo_engine::server::EmulatorConfig;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketSend};

/// `[engine]` keys subscribing to `pub_ep` (and replaying from `replay_ep`), with
/// short warm-up and silence so the test runs quickly.
fn kv_config(pub_ep: &str, replay_ep: Option<&str>) -> String {
    let mut extra = format!("kv_events = \"{pub_ep}\"\n");
    if let Some(r) = replay_ep {
        extra.push_str(&format!("kv_events_replay = \"{r}\"\n"));
    }
    extra.push_str("kv_events_warmup_ms = 300\nkv_events_silence_ms = 500\n");
    extra
}

/// Serve 20 requests through `node` while its engine publishes nothing (more than the
/// 16 dispatches a silence needs), until the follower counts the silence.
async fn serve_until_silent(node: &TestNode, kv: &gorgo_node::kv_events::KvEvents, tag: &str) {
    let c = client();
    for i in 0..20 {
        let resp = c
            .post(format!("{}/v1/chat/completions", node.base))
            .json(&chat_body(&prompt(&format!("{tag} {i}"), 300), false))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
    }
    until("the silence to be noticed", || {
        kv.view(0).counters.silences == 1
    })
    .await;
}

/// 4-byte chunks of `bytes` as token ids: how a byte-hashing engine publishes.
fn chunk_ids(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// A `BlockStored` of `bytes` (a multiple of 64) in 16-token engine blocks from the
/// start of a sequence; returns the event and the engine hashes.
fn stored(bytes: &[u8], salt: u64) -> (KvEvent, Vec<u64>) {
    let ids = chunk_ids(bytes);
    let hashes: Vec<u64> = (0..ids.len() / 16)
        .map(|i| salt * 1_000 + i as u64)
        .collect();
    (
        KvEvent::BlockStored {
            block_hashes: hashes.clone(),
            parent: None,
            token_ids: ids,
            block_size: 16,
            lora_id: None,
            medium: Some("GPU".into()),
            extra_keys_from: None,
        },
        hashes,
    )
}

fn text(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| b'a' + ((i * 7 + seed as usize * 13) % 26) as u8)
        .collect()
}

#[tokio::test]
async fn bad_streams_resync_onto_the_shadow_model_and_recover() {
    let stop = CancellationToken::new();
    let engine = StubEngine::start("a").await;
    let mut publisher = KvPublisher::bind("tcp://127.0.0.1:0", Some("tcp://127.0.0.1:0"), 16)
        .await
        .unwrap();
    let extra = kv_config(&publisher.endpoint, publisher.replay_endpoint.as_deref())
        + "kv_events_max_message_bytes = 65536\n";
    let node = start_node(config_with_engine("a", &engine.url(), &extra), None).await;
    let state = node.state().clone();
    let engine0 = state.engine(0).unwrap();
    let kv = engine0.kv_events.as_ref().unwrap();

    // Batches published before the SUB socket joined are lost: the replay from 0 gets
    // them, so the node sees the whole history and follows at once.
    let a = text(1, 512);
    let (ev, _) = stored(&a, 1);
    publisher.publish(vec![ev], 0.0);
    until("the node to follow the events", || {
        if kv.view(0).counters.batches == 0 {
            publisher.publish(vec![], 0.0);
        }
        kv.source() == IndexSource::Events
    })
    .await;
    let chain_a = HashChain::from_bytes(&a, 256, 4);
    until("the stored blocks in the index", || {
        state
            .engine(0)
            .unwrap()
            .shadow
            .lock()
            .longest_match(&chain_a)
            == 128
    })
    .await;

    // The publisher goes away and a raw one on its address sends garbage.
    let endpoint = publisher.endpoint.clone();
    let replay = publisher.replay_endpoint.clone();
    drop(publisher);
    let mut raw = zeromq::PubSocket::new();
    // The port may take a moment to be free again.
    let mut bound = false;
    for _ in 0..200 {
        if raw.bind(&endpoint).await.is_ok() {
            bound = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(bound, "rebinding {endpoint}");
    let resyncs_before = kv.view(0).counters.resyncs;
    let garbage = |seq: i64, payload: Vec<u8>| {
        zeromq::ZmqMessage::try_from(vec![
            bytes::Bytes::new(),
            bytes::Bytes::copy_from_slice(&encode_seq(seq)),
            bytes::Bytes::from(payload),
        ])
        .unwrap()
    };
    // Sent until the node has counted it (the SUB reconnects to the new socket).
    let mut sent = 0;
    loop {
        raw.send(garbage(1, b"\xc1\xc1 not msgpack".to_vec()))
            .await
            .unwrap();
        raw.send(garbage(2, vec![0x90; 100_000])).await.unwrap();
        raw.send(zeromq::ZmqMessage::from("one frame"))
            .await
            .unwrap();
        sent += 1;
        let c = kv.view(0).counters;
        if c.decode_errors >= 3 && c.oversized >= 1 {
            break;
        }
        assert!(sent < 2_000, "the node never heard the raw publisher");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let view = kv.view(0);
    assert!(view.counters.resyncs > resyncs_before, "{view:?}");
    assert_eq!(kv.source(), IndexSource::Shadow);
    // The shadow model carries on from the events' picture.
    assert_eq!(
        state.engine(0).unwrap().shadow.lock().source(),
        IndexSource::Shadow
    );
    let admin = admin_json(&node, "/admin/state").await;
    assert_eq!(admin["prefix_index_source"], "shadow", "{admin}");
    assert!(admin["kv_events"]["fallback_reason"].is_string(), "{admin}");
    drop(raw);

    // The real publisher comes back (seq from 0): its stream is followed again after
    // the warm-up (the node did not see its start: the batches before the SUB socket
    // reconnected are lost and the replay cannot tell a restart from a gap).
    let mut publisher = None;
    for _ in 0..200 {
        if let Ok(p) = KvPublisher::bind(&endpoint, replay.as_deref(), 16).await {
            publisher = Some(p);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut publisher = publisher.expect("rebinding the publisher");
    // Heard once the SUB socket has reconnected.
    let batches = kv.view(0).counters.batches;
    until("the node to hear the new publisher", || {
        publisher.publish(vec![], 1.0);
        kv.view(0).counters.batches > batches
    })
    .await;
    let b = text(2, 768);
    let (ev, b_hashes) = stored(&b, 2);
    publisher.publish(vec![ev], 1.0);
    let chain_b = HashChain::from_bytes(&b, 256, 4);
    until("the new publisher's blocks", || {
        kv.source() == IndexSource::Events
            && state
                .engine(0)
                .unwrap()
                .shadow
                .lock()
                .longest_match(&chain_b)
                == 192
    })
    .await;
    // The old blocks went with the resync and the restart.
    assert_eq!(
        state
            .engine(0)
            .unwrap()
            .shadow
            .lock()
            .longest_match(&chain_a),
        0
    );
    // An eviction in the middle cuts the chain there.
    publisher.publish(
        vec![KvEvent::BlockRemoved {
            block_hashes: vec![b_hashes[5]],
            medium: None,
        }],
        2.0,
    );
    until("the eviction", || {
        state
            .engine(0)
            .unwrap()
            .shadow
            .lock()
            .longest_match(&chain_b)
            == 64
    })
    .await;

    // Silence while requests are served: a resync onto the shadow model.
    serve_until_silent(&node, kv, "silence").await;
    assert_eq!(kv.source(), IndexSource::Shadow);
    let metrics = metrics_text(&node).await;
    for name in [
        "gorgo_kv_event_batches_total",
        "gorgo_kv_event_resyncs_total",
        "gorgo_kv_event_decode_errors_total",
        "gorgo_kv_event_silences_total",
        "gorgo_kv_event_fallback_seconds_total",
        "gorgo_kv_event_source_events 0",
    ] {
        assert!(metrics.contains(name), "{name} missing:\n{metrics}");
    }
    stop.cancel();
    node.shutdown.cancel();
}

/// The emulator publishes its cache's events; the node's index follows them, and a
/// repeated prompt's predicted cached tokens are the engine's, to the node's block.
#[tokio::test]
async fn the_node_follows_the_emulators_cache() {
    let stop = CancellationToken::new();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cfg = EmulatorConfig::new(Profile::by_name("h200-dense-1.5b").unwrap());
    let publisher = KvPublisher::bind("tcp://127.0.0.1:0", Some("tcp://127.0.0.1:0"), 16)
        .await
        .unwrap();
    let extra = kv_config(&publisher.endpoint, publisher.replay_endpoint.as_deref());
    let sd = stop.clone();
    tokio::spawn(async move {
        gorgo_engine::serve_with_kv_events(listener, cfg, Some(publisher), async move {
            sd.cancelled().await
        })
        .await
    });
    let node = start_node(
        config_with_engine("a", &format!("http://{addr}"), &extra),
        None,
    )
    .await;
    let state = node.state().clone();
    let engine0 = state.engine(0).unwrap();
    let kv = engine0.kv_events.as_ref().unwrap();
    let c = client();
    let mut engine_cached = Vec::new();
    for round in 0..2 {
        for i in 0..3 {
            let mut body = chat_body(&prompt(&format!("emulated prompt {i}"), 3000), false);
            body["model"] = "Qwen/Qwen2.5-1.5B-Instruct".into();
            let cached = {
                let resp = c
                    .post(format!("{}/v1/chat/completions", node.base))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), 200);
                let v: serde_json::Value = resp.json().await.unwrap();
                v["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap()
            };
            if round == 1 {
                engine_cached.push(cached);
            }
        }
        // Wait for the events of this round before the next.
        until("the emulator's events", || {
            kv.source() == IndexSource::Events && state.engine(0).unwrap().shadow.lock().len() >= 30
        })
        .await;
    }
    // Second round: every prompt was cached by the engine.
    assert!(
        engine_cached.iter().all(|&c| c >= 2900 / 4),
        "{engine_cached:?}"
    );
    let metrics = metrics_text(&node).await;
    assert!(
        metrics.contains("gorgo_kv_event_source_events 1"),
        "{metrics}"
    );
    // The node's predictions against the engine's counts, all six requests: the
    // first round none cached, the second all but the tail below one node block
    // (64 tokens of a 750-token prompt).
    let hist = metrics
        .lines()
        .find(|l| l.starts_with("gorgo_cache_estimate_error_ratio_bucket{le=\"0.1\"}"))
        .unwrap()
        .to_owned();
    let within: u64 = hist.rsplit(' ').next().unwrap().parse().unwrap();
    assert_eq!(within, 6, "{hist}\n{metrics}");
    let view = kv.view(state.now_ms());
    assert_eq!(view.counters.resyncs, 0, "{view:?}");
    assert_eq!(view.counters.decode_errors, 0, "{view:?}");
    stop.cancel();
    node.shutdown.cancel();
}

/// A ZMTP 3.0 NULL greeting, as a server.
fn zmtp_greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g[32] = 1;
    g
}

/// A short command frame with `body`.
fn zmtp_command(body: &[u8]) -> Vec<u8> {
    let mut f = vec![0x04, body.len() as u8];
    f.extend_from_slice(body);
    f
}

/// A message frame with `body` (`more`: another frame of the message follows).
fn zmtp_frame(body: &[u8], more: bool) -> Vec<u8> {
    let mut f = if body.len() < 256 {
        vec![more as u8, body.len() as u8]
    } else {
        let mut f = vec![more as u8 | 0x02];
        f.extend_from_slice(&(body.len() as u64).to_be_bytes());
        f
    };
    f.extend_from_slice(body);
    f
}

/// What a PUB socket sends on a new connection (its greeting and READY), then one
/// KV-event message `[topic, seq, batch of events]`: a subscriber gets the message
/// whenever it connects, with no need to wait for its subscription to arrive.
fn zmtp_publish_on_connect(seq: i64, events: Vec<KvEvent>) -> Vec<u8> {
    let payload = encode_batch(&KvEventBatch {
        ts: 0.0,
        events,
        data_parallel_rank: None,
        unknown_events: 0,
    });
    let mut out = zmtp_greeting().to_vec();
    out.extend(zmtp_command(b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB"));
    out.extend(zmtp_frame(b"", true));
    out.extend(zmtp_frame(&encode_seq(seq), true));
    out.extend(zmtp_frame(&payload, false));
    out
}

/// An engine that closes its connection may have restarted: publisher A stores X and
/// its connection closes; publisher B on the same port (the engine back, its first
/// batches lost while the node was away) goes on at seq 1, which reads as no gap at
/// all. The node stopped trusting its picture when the connection closed: X is gone,
/// and B's blocks are followed after the warm-up. Before, the SUB socket reconnected
/// without a word, seq 1 was applied in order, and the dead engine's X stayed for good.
#[tokio::test]
async fn a_connection_the_engine_closed_is_a_possible_restart() {
    use tokio::io::AsyncWriteExt;
    let engine = StubEngine::start("a").await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let (x, y) = (text(1, 512), text(2, 768));
    let from_a = zmtp_publish_on_connect(0, vec![stored(&x, 1).0]);
    let from_b = zmtp_publish_on_connect(1, vec![stored(&y, 2).0]);
    let close_a = std::sync::Arc::new(tokio::sync::Notify::new());
    let close = close_a.clone();
    let publishers = tokio::spawn(async move {
        // A: the first connection, closed when the test says.
        let (mut a, _) = listener.accept().await.unwrap();
        a.write_all(&from_a).await.unwrap();
        close.notified().await;
        drop(a);
        // B: every later connection, held open.
        let mut held = Vec::new();
        loop {
            let (mut b, _) = listener.accept().await.unwrap();
            let _ = b.write_all(&from_b).await;
            held.push(b);
        }
    });
    let node = start_node(
        config_with_engine("a", &engine.url(), &kv_config(&endpoint, None)),
        None,
    )
    .await;
    let state = node.state().clone();
    let engine0 = state.engine(0).unwrap();
    let kv = engine0.kv_events.as_ref().unwrap();
    let held = |chain: &HashChain| state.engine(0).unwrap().shadow.lock().longest_match(chain);
    let (chain_x, chain_y) = (
        HashChain::from_bytes(&x, 256, 4),
        HashChain::from_bytes(&y, 256, 4),
    );
    until("A's blocks in the index", || {
        kv.source() == IndexSource::Events && held(&chain_x) == 128
    })
    .await;
    close_a.notify_one();
    until("B's blocks in the index", || {
        kv.source() == IndexSource::Events && held(&chain_y) == 192
    })
    .await;
    assert_eq!(held(&chain_x), 0, "the dead engine's blocks stayed");
    let view = kv.view(state.now_ms());
    assert!(view.counters.disconnects >= 1, "{view:?}");
    let metrics = metrics_text(&node).await;
    assert!(
        metrics.contains("gorgo_kv_event_disconnects_total"),
        "{metrics}"
    );
    publishers.abort();
    node.shutdown.cancel();
}

/// A publisher that sends what the `zeromq` decoder must never read: on its first
/// connection a valid handshake and then a frame header announcing a terabyte (the
/// decoder would reserve it and abort the process), on its second a READY whose
/// property length runs past the frame (the decoder would slice past its end and
/// panic). The node's relay cuts both connections; the node keeps serving.
#[tokio::test]
async fn frames_the_decoder_must_not_read_are_cut_before_it() {
    let engine = StubEngine::start("a").await;
    let hostile = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", hostile.local_addr().unwrap());
    let connections = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = connections.clone();
    let publisher = tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        let mut held = Vec::new();
        loop {
            let (mut s, _) = hostile.accept().await.unwrap();
            let n = seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut out = zmtp_greeting().to_vec();
            if n == 0 {
                out.extend(zmtp_command(b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB"));
                out.push(0x03); // MORE | LONG
                out.extend_from_slice(&(1u64 << 40).to_be_bytes());
            } else if n == 1 {
                out.extend(zmtp_command(b"\x05READY\x0bSocket-Type\x00\x00\xff\xffPUB"));
            }
            let _ = s.write_all(&out).await;
            held.push(s);
        }
    });
    let node = start_node(
        config_with_engine("a", &engine.url(), &kv_config(&endpoint, None)),
        None,
    )
    .await;
    let state = node.state().clone();
    let engine0 = state.engine(0).unwrap();
    let kv = engine0.kv_events.as_ref().unwrap();
    until("both hostile connections cut", || {
        kv.view(state.now_ms()).refused_frames >= 2
    })
    .await;
    // The subscriber came back for more: the task that owns it is alive.
    until("a third connection", || {
        connections.load(std::sync::atomic::Ordering::SeqCst) >= 3
    })
    .await;
    let resp = client()
        .post(format!("{}/v1/chat/completions", node.base))
        .json(&chat_body("still serving", false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let metrics = metrics_text(&node).await;
    assert!(
        metrics.contains("gorgo_kv_event_refused_frames_total 2"),
        "{metrics}"
    );
    assert_eq!(kv.source(), IndexSource::Shadow);
    publisher.abort();
    node.shutdown.cancel();
}

/// A TCP relay to `target` that counts the connections it accepted and, once `cut` is
/// set, stops passing bytes on the connections it had (keeping them open: a flow a
/// NAT dropped without a word), while new ones pass.
async fn black_holing_relay(
    target: String,
    cut: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> String {
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let target = target.trim_start_matches("tcp://").to_owned();
    tokio::spawn(async move {
        while let Ok((down, _)) = listener.accept().await {
            let n = accepted.fetch_add(1, Ordering::SeqCst);
            let Ok(up) = tokio::net::TcpStream::connect(&target).await else {
                continue;
            };
            let cut = cut.clone();
            let passes = move || cut.load(Ordering::SeqCst) <= n;
            let (mut dr, mut dw) = down.into_split();
            let (mut ur, mut uw) = up.into_split();
            let p = passes.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 << 10];
                while let Ok(k) = dr.read(&mut buf).await {
                    if k == 0 || (p() && uw.write_all(&buf[..k]).await.is_err()) {
                        break;
                    }
                }
            });
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 << 10];
                while let Ok(k) = ur.read(&mut buf).await {
                    if k == 0 || (passes() && dw.write_all(&buf[..k]).await.is_err()) {
                        break;
                    }
                }
            });
        }
    });
    format!("tcp://{addr}")
}

/// A connection to the publisher that dies without a word (no FIN, no RST: a dropped
/// NAT flow) is noticed as a silence while requests are served, and the node
/// subscribes again on a new connection and follows the events again (before, the
/// dead connection stayed, and the index stayed on the shadow model for good).
#[tokio::test]
async fn a_silently_dead_connection_is_replaced_after_a_silence() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let engine = StubEngine::start("a").await;
    let mut publisher = KvPublisher::bind("tcp://127.0.0.1:0", None, 16)
        .await
        .unwrap();
    let (cut, accepted) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let relayed =
        black_holing_relay(publisher.endpoint.clone(), cut.clone(), accepted.clone()).await;
    let node = start_node(
        config_with_engine("a", &engine.url(), &kv_config(&relayed, None)),
        None,
    )
    .await;
    let state = node.state().clone();
    let engine0 = state.engine(0).unwrap();
    let kv = engine0.kv_events.as_ref().unwrap();
    until("the node to hear the publisher", || {
        publisher.publish(vec![], 0.0);
        kv.view(0).counters.batches > 0
    })
    .await;
    // Every connection so far goes dark.
    cut.store(accepted.load(Ordering::SeqCst), Ordering::SeqCst);
    let before = accepted.load(Ordering::SeqCst);
    serve_until_silent(&node, kv, "dark").await;
    until("a new connection to the publisher", || {
        accepted.load(Ordering::SeqCst) > before
    })
    .await;
    let heard = kv.view(0).counters.batches;
    until("batches over the new connection", || {
        publisher.publish(vec![], 1.0);
        kv.view(0).counters.batches > heard
    })
    .await;
    node.shutdown.cancel();
}

/// A hot prefix (a shared system prompt the engine keeps cached and never stores
/// again) stored before a lost batch is still matched once the index returns to the
/// events after the resync, kept unconfirmed; the engine's `BlockRemoved` still takes
/// it out. Before, the resync forgot it and the return to the events cleared it from
/// the index for good, so routing stopped sending its requests to this engine.
#[tokio::test]
async fn a_hot_prefix_stored_before_a_gap_is_matched_after_the_resync() {
    let engine = StubEngine::start("a").await;
    let mut raw = zeromq::PubSocket::new();
    let endpoint = raw.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let node = start_node(
        config_with_engine("a", &engine.url(), &kv_config(&endpoint, None)),
        None,
    )
    .await;
    let state = node.state().clone();
    let engine0 = state.engine(0).unwrap();
    let kv = engine0.kv_events.as_ref().unwrap();
    let held = |chain: &HashChain| state.engine(0).unwrap().shadow.lock().longest_match(chain);
    let batch = |seq: i64, events: Vec<KvEvent>| {
        let payload = encode_batch(&KvEventBatch {
            ts: 0.0,
            events,
            data_parallel_rank: None,
            unknown_events: 0,
        });
        zeromq::ZmqMessage::try_from(vec![
            bytes::Bytes::new(),
            bytes::Bytes::copy_from_slice(&encode_seq(seq)),
            bytes::Bytes::from(payload),
        ])
        .unwrap()
    };
    // Empty batches until the node hears the stream (a PUB drops what it sends before
    // the subscription takes effect).
    let mut seq = 0;
    let mut sent = 0;
    while kv.view(0).counters.batches == 0 {
        raw.send(batch(seq, vec![])).await.unwrap();
        seq += 1;
        sent += 1;
        assert!(sent < 2_000, "the node never heard the publisher");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let hot = text(3, 512);
    let (ev, hashes) = stored(&hot, 3);
    raw.send(batch(seq, vec![ev])).await.unwrap();
    seq += 1;
    let chain = HashChain::from_bytes(&hot, 256, 4);
    // Followed after the warm-up (the stream's start was not seen).
    let mut sent = 0;
    while !(kv.source() == IndexSource::Events && held(&chain) == 128) {
        raw.send(batch(seq, vec![])).await.unwrap();
        seq += 1;
        sent += 1;
        assert!(sent < 2_000, "the hot prefix never reached the index");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A batch lost (no replay socket): a resync onto the shadow model, and back to
    // the events after the warm-up.
    seq += 1;
    let mut sent = 0;
    loop {
        raw.send(batch(seq, vec![])).await.unwrap();
        seq += 1;
        let view = kv.view(state.now_ms());
        if view.counters.resyncs >= 1 && view.source == IndexSource::Events {
            break;
        }
        sent += 1;
        assert!(sent < 2_000, "never back on the events: {view:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let view = kv.view(state.now_ms());
    assert_eq!(view.counters.gaps, 1, "{view:?}");
    assert_eq!(view.unconfirmed_blocks, 8, "{view:?}");
    assert_eq!(held(&chain), 128, "the hot prefix dropped out of the index");
    let admin = admin_json(&node, "/admin/state").await;
    assert_eq!(admin["kv_events"]["unconfirmed_blocks"], 8, "{admin}");
    // The engine evicts it: out of the index.
    raw.send(batch(
        seq,
        vec![KvEvent::BlockRemoved {
            block_hashes: vec![hashes[0]],
            medium: None,
        }],
    ))
    .await
    .unwrap();
    until("the eviction of the hot prefix", || held(&chain) == 0).await;
    assert_eq!(kv.view(state.now_ms()).unconfirmed_blocks, 0);
    node.shutdown.cancel();
}
