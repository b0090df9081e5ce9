//! Two nodes on real loopback UDP (no simulation): join, see each other, leave.

use std::time::Duration;

use gorgo_cluster::{
    CancellationToken, ClusterConfig, ClusterHandle, ClusterSocket, SharedSummary,
};
use gorgo_core::summary::LocalSummary;
use gorgo_core::NodeId;

async fn node(
    name: &str,
    ca: &gorgo_cluster::ClusterCa,
    seeds: Vec<std::net::SocketAddr>,
) -> (ClusterHandle, CancellationToken) {
    let creds = ca.issue(&NodeId::from(name)).unwrap().credentials;
    let mut cfg = ClusterConfig::new(
        NodeId::from(name),
        "local",
        "127.0.0.1:0".parse().unwrap(),
        creds,
    );
    cfg.seeds = seeds;
    let summary = SharedSummary::new(LocalSummary::new(), gorgo_cluster::system_clock());
    let shutdown = CancellationToken::new();
    let h = gorgo_cluster::start(cfg, ClusterSocket::Bind, summary, shutdown.clone())
        .await
        .unwrap();
    (h, shutdown)
}

/// Wait, on membership notifications (not on a timer), until `h` sees `peer` as `alive`.
async fn until_alive(h: &ClusterHandle, peer: &str, alive: bool) {
    let mut rx = h.subscribe_membership();
    while h.alive_peers().contains(&NodeId::from(peer)) != alive {
        rx.changed().await.unwrap();
    }
}

#[tokio::test]
async fn two_nodes_join_and_leave_on_loopback() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca = gorgo_cluster::ClusterCa::generate("loopback CA").unwrap();
    let (a, _a_stop) = node("a", &ca, vec![]).await;
    let a_addr = a.local_addr().unwrap();
    assert_ne!(a.identity().addr.port(), 0, "advertises the bound port");
    let (b, b_stop) = node("b", &ca, vec![a_addr]).await;
    tokio::time::timeout(Duration::from_secs(20), async {
        until_alive(&a, "b", true).await;
        until_alive(&b, "a", true).await;
    })
    .await
    .expect("join on loopback");
    b_stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), until_alive(&a, "b", false))
        .await
        .expect("leave seen");
}

#[tokio::test]
async fn dial_overrides_reach_a_peer_behind_another_address() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca = gorgo_cluster::ClusterCa::generate("loopback CA").unwrap();
    // `a` advertises an address nothing listens on; `b` knows where to dial instead.
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let real = socket.local_addr().unwrap();
    let advertised: std::net::SocketAddr = "127.0.0.1:9".parse().unwrap();
    let creds = ca.issue(&NodeId::from("a")).unwrap().credentials;
    let mut cfg = ClusterConfig::new(NodeId::from("a"), "local", real, creds);
    cfg.advertise = advertised;
    let summary = SharedSummary::new(LocalSummary::new(), gorgo_cluster::system_clock());
    let a = gorgo_cluster::start(
        cfg,
        ClusterSocket::Std(socket),
        summary,
        CancellationToken::new(),
    )
    .await
    .unwrap();
    let creds = ca.issue(&NodeId::from("b")).unwrap().credentials;
    let mut cfg = ClusterConfig::new(
        NodeId::from("b"),
        "local",
        "127.0.0.1:0".parse().unwrap(),
        creds,
    );
    cfg.seeds = vec![advertised];
    cfg.dial_overrides.insert(advertised, real);
    let summary = SharedSummary::new(LocalSummary::new(), gorgo_cluster::system_clock());
    let b = gorgo_cluster::start(cfg, ClusterSocket::Bind, summary, CancellationToken::new())
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(20), async {
        until_alive(&a, "b", true).await;
        until_alive(&b, "a", true).await;
    })
    .await
    .expect("join through the override");
    let seen = b
        .peers()
        .into_iter()
        .find(|p| p.id == NodeId::from("a"))
        .unwrap();
    assert_eq!(
        seen.addr, advertised,
        "identity keeps the advertised address"
    );
}

#[tokio::test]
async fn shutdown_releases_the_port_even_with_handle_clones_alive() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca = gorgo_cluster::ClusterCa::generate("loopback CA").unwrap();
    let (a, a_stop) = node("a", &ca, vec![]).await;
    let addr = a.local_addr().unwrap();
    // The node (router, admin API, tasks) still holds clones when it shuts down.
    let clone = a.clone();
    a_stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), clone.closed())
        .await
        .expect("endpoint closed");
    assert!(clone.local_addr().is_err(), "no endpoint after shutdown");
    // quinn's driver drops the socket once it runs again after the last endpoint
    // clone is gone: give the scheduler turns, not wall time.
    let mut rebound = None;
    for _ in 0..10_000 {
        match std::net::UdpSocket::bind(addr) {
            Ok(s) => {
                rebound = Some(s);
                break;
            }
            Err(_) => tokio::task::yield_now().await,
        }
    }
    let socket = rebound.expect("port released while handle clones are alive");
    // A node restarted in the same process binds the same port.
    let creds = ca.issue(&NodeId::from("a")).unwrap().credentials;
    let cfg = ClusterConfig::new(NodeId::from("a"), "local", addr, creds);
    drop(socket);
    let summary = SharedSummary::new(LocalSummary::new(), gorgo_cluster::system_clock());
    let restarted =
        gorgo_cluster::start(cfg, ClusterSocket::Bind, summary, CancellationToken::new())
            .await
            .expect("restart on the same port");
    assert_eq!(restarted.local_addr().unwrap(), addr);
    drop(a);
    drop(clone);
}

/// A node of another release (another cluster protocol version, so no ALPN in
/// common) is refused at the handshake, and the node counts why: the cause an
/// operator must act on, not only a failed handshake.
#[tokio::test]
async fn a_dial_speaking_another_protocol_version_is_told_apart() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca = gorgo_cluster::ClusterCa::generate("loopback CA").unwrap();
    let (a, _a_stop) = node("a", &ca, vec![]).await;
    let creds = ca.issue(&NodeId::from("b")).unwrap().credentials;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(creds.ca.clone()).unwrap();
    let mut tls = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_client_auth_cert(creds.cert_chain.clone(), creds.key.clone_key())
        .unwrap();
    tls.alpn_protocols = vec![b"gorgo-cluster/1".to_vec()];
    let quic = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    endpoint.set_default_client_config(quinn::ClientConfig::new(std::sync::Arc::new(quic)));
    let dialed = tokio::time::timeout(
        Duration::from_secs(20),
        endpoint
            .connect(a.local_addr().unwrap(), gorgo_cluster::CLUSTER_SERVER_NAME)
            .unwrap(),
    )
    .await
    .expect("the handshake ends");
    assert!(dialed.is_err(), "a node of another protocol version got in");
    let counted = || {
        a.metrics()
            .handshakes_other_protocol
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    // The node's side of the handshake ends in its own task.
    tokio::time::timeout(Duration::from_secs(20), async {
        while counted() == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the refusal is counted as another protocol version");
}
