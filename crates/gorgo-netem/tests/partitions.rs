//! Partitions: a cut link drops datagrams both ways and refuses or cuts TCP
//! connections; a healed one carries traffic again; the control API of a
//! planned cluster cuts and heals region pairs by name and names what is wrong
//! with a bad request.
//!
//! No test waits on time: a drop is observed on the relay's counters (which
//! wake waiters on every change), delivery by receiving the next datagram.

use std::net::SocketAddr;
use std::time::Duration;

use gorgo_netem::{
    plan_cluster, serve_control, DuplexLink, LinkGate, LinkParams, NetemCluster, PlanOptions,
    SourceRoutes, TcpRelay, Topology, UdpRelay, UdpRelayOptions, CLIENTS,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

/// Guard against a hang: no test here should come near it.
const TEST_TIMEOUT: Duration = Duration::from_secs(60);

fn localhost() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

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

async fn tcp_echo() -> SocketAddr {
    let listener = TcpListener::bind(localhost()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = conn.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
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
        let relay = TcpRelay::start(localhost(), tcp_echo().await, link(&gate), 1)
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

/// A planned three-region cluster with its control API: partitioning a from b
/// drops a's datagrams at b's relay (and only those: c still reaches b), healing
/// lets them through again; bad requests get errors naming what is wrong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_api_partitions_and_heals_a_planned_cluster() {
    let text = r#"
        [[regions]]
        name = "a"
        client_delay_ms = 1
        [[regions]]
        name = "b"
        client_delay_ms = 1
        [[regions]]
        name = "c"
        client_delay_ms = 1
        [one_way_ms]
        a = { b = 2, c = 2 }
        b = { c = 2 }
    "#;
    let topology = Topology::from_toml(text).unwrap();
    // Addresses unlikely to clash with anything else on the machine (relays.rs
    // uses 201-202).
    let options = PlanOptions {
        ip_base: 205,
        base_port: 47_400,
    };
    let plan = plan_cluster(&topology, &options).unwrap();
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
            .find(|r| r.name == "peers->b")
            .unwrap()
            .handle
            .stats()
            .clone();

        let (status, body) = http(api, "POST /partition?a=b&b=a", "").await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["a"], "a");
        assert_eq!(body["b"], "b");
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
        stats_b.wait_until(|c| c.partitioned == 1).await;
        node_c.send_to(b"from c", relay_b).await.unwrap();
        assert_eq!(recv(&node_b).await.0, b"from c", "c - b is still up");

        let (status, body) = http(api, "POST /heal?a=a&b=b", "").await;
        assert_eq!((status, &body["up"]), (200, &serde_json::Value::Bool(true)));
        node_a.send_to(b"from a, healed", relay_b).await.unwrap();
        assert_eq!(recv(&node_b).await.0, b"from a, healed");

        // Errors name what is wrong.
        let (status, body) = http(api, "POST /partition?a=a&b=mars", "").await;
        assert_eq!(status, 400);
        let msg = body["error"].as_str().unwrap();
        assert!(msg.contains("`mars`") && msg.contains(CLIENTS), "{msg}");
        let (status, body) = http(api, "POST /partition?a=a", "").await;
        assert_eq!(status, 400, "{body}");
        let (status, _) = http(api, "POST /partition?a=a&b=a", "").await;
        assert_eq!(status, 400);
        let (status, _) = http(api, "GET /partition?a=a&b=b", "").await;
        assert_eq!(status, 405);
        let (status, _) = http(api, "POST /split", "").await;
        assert_eq!(status, 404);
        let (status, _) = http(api, "POST /heal?a=a&b=b", "Content-Length: 5\r\n").await;
        assert_eq!(status, 413);
        let long = format!("POST /heal?a={}&b=b", "x".repeat(2000));
        let (status, _) = http(api, &long, "").await;
        assert_eq!(status, 414);
        assert!(cluster.links.links().iter().all(|l| l.up));

        control.abort();
        cluster.shutdown().await;
    })
    .await
    .expect("test timed out");
}
