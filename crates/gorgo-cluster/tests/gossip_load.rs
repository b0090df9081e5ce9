//! The measured run behind `docs/cluster.md`: 8 nodes, 50 requests/s each, 100k-block
//! shadow indexes with synthetic churn, on turmoil's simulated WAN. Reports gossip
//! bytes/s per node, summary staleness p50/p99 and failure-detection time.
//!
//! `cargo test -p gorgo-cluster --release --test gossip_load -- --ignored --nocapture`

mod common;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use gorgo_cluster::{ClusterConfig, ClusterSocket, SharedSummary};
use gorgo_core::summary::LocalSummary;
use gorgo_core::{HashChain, NodeId, ShadowIndex};
use quinn::AsyncUdpSocket;

const NODES: usize = 8;
const RATE_PER_S: u64 = 50;
const CAPACITY_BLOCKS: u64 = 100_000;
const TOKENS_PER_BLOCK: u32 = 64;
/// Each request: a shared prefix (one of `SHARED_PREFIXES` system prompts of
/// `SHARED_BLOCKS` blocks, the same on every node) then `NEW_BLOCKS` blocks of its own.
const SHARED_PREFIXES: u64 = 500;
const SHARED_BLOCKS: u64 = 16;
const NEW_BLOCKS: u64 = 8;

fn request_chain(node: u64, n: u64) -> HashChain {
    let prefix = (n.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 7) % SHARED_PREFIXES;
    let mut ids: Vec<u64> = (0..SHARED_BLOCKS).map(|b| prefix * 1000 + b).collect();
    ids.extend((0..NEW_BLOCKS).map(|b| (1 << 62) | (node << 48) | (n << 4) | b));
    let blocks = ids.len() as u64;
    HashChain::from_int_block_ids(&ids, TOKENS_PER_BLOCK, blocks * TOKENS_PER_BLOCK as u64)
}

#[test]
#[ignore = "measurement for docs/cluster.md; run with --ignored --nocapture"]
fn eight_nodes_fifty_rps_hundred_k_blocks() {
    let names: Vec<String> = (0..NODES).map(|i| format!("n{i}")).collect();
    let name_refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut sim = sim(1, Duration::from_secs(600));
    let creds = credentials(&name_refs);
    let handles = Handles::default();
    for (i, host) in names.iter().enumerate() {
        let name = host.clone();
        let cred = creds[&name].clone();
        let handles = handles.clone();
        sim.host(host.as_str(), move || {
            let name = name.clone();
            let cred = cred.clone();
            let handles = handles.clone();
            async move {
                let socket = TurmoilUdp::bind(&name, PORT).await?;
                let mut cfg = ClusterConfig::new(
                    NodeId(name.clone()),
                    format!("r{i}"),
                    socket.local_addr()?,
                    cred,
                );
                if i > 0 {
                    cfg.seeds = vec![SocketAddr::new(turmoil::lookup("n0"), PORT)];
                }
                cfg.generation = Some(1);
                cfg.rng_seed = Some(i as u64 + 1);
                cfg.wall_clock = sim_clock();
                // A full 100k-block cache before joining.
                let mut index = ShadowIndex::with_summary(
                    CAPACITY_BLOCKS * TOKENS_PER_BLOCK as u64,
                    LocalSummary::new().starting_at(1_000),
                );
                let mut n = 0u64;
                while (index.len() as u64) < CAPACITY_BLOCKS {
                    index.insert(&request_chain(i as u64, n), 0);
                    n += 1;
                }
                let shared = SharedSummary::new(index, sim_clock());
                let handle = gorgo_cluster::start(
                    cfg,
                    ClusterSocket::Custom {
                        socket,
                        runtime: Arc::new(quinn::TokioRuntime),
                    },
                    shared.clone(),
                    gorgo_cluster::CancellationToken::new(),
                )
                .await?;
                handles.lock().insert(name.clone(), handle.clone());
                let mut tick = tokio::time::interval(Duration::from_millis(1000 / RATE_PER_S));
                let mut stats = gorgo_core::QueueStats::default();
                loop {
                    tick.tick().await;
                    let now_ms = turmoil::elapsed().as_millis() as u64;
                    let chain = request_chain(i as u64, n);
                    n += 1;
                    shared.update(|idx| idx.insert(&chain, now_ms));
                    if n.is_multiple_of(5) {
                        stats.running = (n % 17) as u32;
                        let _ = handle.broadcast_stats(stats.clone());
                    }
                }
            }
        });
    }
    set_wan_latencies(&mut sim, &name_refs);
    let joined = run_until(&mut sim, Duration::from_secs(30), |_| {
        converged(&handles, &name_refs)
    })
    .expect("converge");
    // Initial snapshots (7 x ~500 KB per node) ride QUIC slow start over 90-250 ms RTTs.
    run_until(&mut sim, Duration::from_secs(60), |_| {
        all_have_summaries(&handles)
    })
    .expect("snapshots delivered");
    let warm = sim.elapsed();
    run_for(&mut sim, Duration::from_secs(5));
    let t1 = sim.elapsed();
    let (b1, s1, u1) = bytes(&handles);
    let window = Duration::from_secs(30);
    run_for(&mut sim, window);
    let t2 = sim.elapsed();
    let (b2, s2, u2) = bytes(&handles);
    let secs = (t2 - t1).as_secs_f64();
    let mut stale: Vec<f64> = Vec::new();
    {
        let h = handles.lock();
        for handle in h.values() {
            stale.extend(
                handle
                    .metrics()
                    .staleness_samples()
                    .iter()
                    .map(|&x| x as f64),
            );
        }
    }
    stale.sort_by(f64::total_cmp);
    let p50 = gorgo_core::percentile(&stale, 50.0).unwrap_or(f64::NAN);
    let p99 = gorgo_core::percentile(&stale, 99.0).unwrap_or(f64::NAN);
    let max = stale.last().copied().unwrap_or(f64::NAN);

    let crashed_at = sim.elapsed();
    sim.crash("n7");
    let down = run_until(&mut sim, Duration::from_secs(20), |_| {
        let h = handles.lock();
        name_refs[..NODES - 1]
            .iter()
            .all(|n| !h[*n].alive_peers().contains(&NodeId::from("n7")))
    })
    .expect("n7 declared down");

    println!("joined (full membership) at {joined:?}; snapshots delivered by {warm:?}");
    println!("window {secs:.1} s simulated, {NODES} nodes, {RATE_PER_S} req/s each");
    for (n, (a, b)) in b1.iter().zip(&b2).enumerate() {
        let swim = (s2[n] - s1[n]) as f64 / secs;
        let udp = (u2[n] - u1[n]) as f64 / secs;
        println!(
            "n{n}: gossip payload sent {:.1} KiB/s (swim {:.2} KiB/s); on the wire (UDP, QUIC overhead) {:.1} KiB/s",
            (b - a) as f64 / secs / 1024.0,
            swim / 1024.0,
            udp / 1024.0
        );
    }
    let mean =
        b1.iter().zip(&b2).map(|(a, b)| (b - a) as f64).sum::<f64>() / NODES as f64 / secs / 1024.0;
    let mean_udp =
        u1.iter().zip(&u2).map(|(a, b)| (b - a) as f64).sum::<f64>() / NODES as f64 / secs / 1024.0;
    println!("mean sent per node: payload {mean:.1} KiB/s, UDP {mean_udp:.1} KiB/s");
    println!(
        "staleness: {} samples, p50 {p50} ms, p99 {p99} ms, max {max} ms",
        stale.len()
    );
    println!(
        "failure detection (all 7 survivors): {:?}",
        down - crashed_at
    );
    assert!(p99 < 1000.0, "staleness p99 {p99} ms");
    assert!(mean_udp < 64.0, "{mean_udp} KiB/s per node on the wire");
}

fn all_have_summaries(handles: &Handles) -> bool {
    let h = handles.lock();
    h.values()
        .all(|handle| handle.peers().iter().all(|p| p.summary_len > 50_000))
        && h.len() == NODES
}

/// (total gossip bytes sent, SWIM bytes sent, UDP bytes sent) per node, in node order.
fn bytes(handles: &Handles) -> (Vec<u64>, Vec<u64>, Vec<u64>) {
    let h = handles.lock();
    let mut names: Vec<&String> = h.keys().collect();
    names.sort_by_key(|n| n[1..].parse::<usize>().unwrap_or(0));
    names
        .iter()
        .map(|n| {
            let m = h[*n].metrics();
            (
                m.total_bytes_sent(),
                m.swim_bytes_sent.load(Ordering::Relaxed),
                h[*n].udp_bytes_sent(),
            )
        })
        .fold((vec![], vec![], vec![]), |mut acc, (a, b, c)| {
            acc.0.push(a);
            acc.1.push(b);
            acc.2.push(c);
            acc
        })
}
