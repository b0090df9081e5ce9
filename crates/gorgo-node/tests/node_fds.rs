//! A node whose process is short of file descriptors: idle connections from one
//! address must not take the last ones, so other clients and the admin port are still
//! served. Its own test binary: it lowers the process's descriptor limit.
mod common;

use std::net::{IpAddr, SocketAddr};

use common::*;
use tokio::net::{TcpSocket, TcpStream};

async fn connect_from(from: &str, to: SocketAddr) -> Option<TcpStream> {
    let sock = TcpSocket::new_v4().ok()?;
    sock.bind(format!("{from}:0").parse().unwrap()).ok()?;
    sock.connect(to).await.ok()
}

#[tokio::test]
async fn idle_connections_cannot_exhaust_descriptors() {
    // 1,400 descriptors for the whole process: the node's client cap comes out at
    // (1,400 - 1,024 reserved) / 2 = 188 connections.
    rlimit::setrlimit(rlimit::Resource::NOFILE, 1_400, 1_400).unwrap();
    let engine = StubEngine::start("e").await;
    let node = start_node(
        config(
            "a",
            &engine.url(),
            "[limits]\nmax_connections_per_ip = 100\n",
        ),
        None,
    )
    .await;
    let addr = node.handle.http_addr;
    // 700 idle connections from one address: without caps the node would hold 700
    // descriptors for them and this process would run out.
    let mut idle = Vec::new();
    for i in 0..700 {
        // Spread over addresses so the per-address cap alone does not save the node.
        let from = format!("127.0.1.{}", 1 + i % 7);
        if let Some(s) = connect_from(&from, addr).await {
            idle.push(s);
        }
    }
    assert!(
        idle.len() >= 650,
        "the test opened its connections ({})",
        idle.len()
    );
    let good = reqwest::Client::builder()
        .local_address("127.0.0.3".parse::<IpAddr>().unwrap())
        .build()
        .unwrap();
    let admin = good
        .get(format!("{}/readyz", node.admin))
        .send()
        .await
        .expect("the admin port answers");
    assert!(admin.status().is_success() || admin.status() == 503);
    // The client port is full of idle connections: the oldest yields its place.
    let resp = good
        .post(format!("{}/v1/chat/completions", node.base))
        .json(&chat_body("hi", false))
        .send()
        .await
        .expect("a new client is served");
    assert_eq!(resp.status(), 200);
    let metrics = good
        .get(format!("{}/metrics", node.admin))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("reason=\"evicted_max_connections\""),
        "the global cap evicted idle connections: {metrics}"
    );
    drop(idle);
    node.shutdown.cancel();
}
