//! 10,000 random datagrams and streams at a node: no panic, no membership change.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use rand::{Rng, SeedableRng};

const NAMES: [&str; 3] = ["n0", "n1", "n2"];

/// A SWIM datagram (kind byte, then a header alone) from the `fuzz` host, a member
/// under its own id and address, to `dst`.
fn swim_from_fuzz(
    dst: gorgo_cluster::MemberId,
    message: foca::Message<gorgo_cluster::MemberId>,
) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
    let header = foca::Header {
        src: gorgo_cluster::MemberId {
            node: gorgo_core::NodeId::from("fuzz"),
            region: "fuzz".to_owned(),
            addr: SocketAddr::new(turmoil::lookup("fuzz"), 9001),
            generation: 1,
        },
        src_incarnation: 0,
        dst,
        message,
    };
    let mut packet = vec![1u8];
    foca::Codec::encode_header(
        &mut gorgo_cluster::identity::BincodeCodec,
        &header,
        &mut packet,
    )?;
    Ok(packet)
}

#[test]
fn random_traffic_changes_nothing() {
    let mut sim = sim(3, Duration::from_secs(300));
    let creds = credentials(&["n0", "n1", "n2", "fuzz"]);
    let handles = Handles::default();
    for (i, n) in NAMES.iter().enumerate() {
        add_node(
            &mut sim,
            NodeSpec {
                name: (*n).to_owned(),
                region: format!("region-{i}"),
                credentials: creds[*n].clone(),
                seeds: if i == 0 {
                    vec![]
                } else {
                    vec!["n0".to_owned()]
                },
                churn: None,
                generation: 1,
            },
            handles.clone(),
        );
    }
    set_wan_latencies(&mut sim, &NAMES);
    run_until(&mut sim, Duration::from_secs(10), |_| {
        converged(&handles, &NAMES)
    })
    .expect("converge");
    let logs_before: Vec<_> = handles
        .lock()
        .values()
        .map(|h| h.membership_log())
        .collect();

    let done = Arc::new(AtomicBool::new(false));
    let fuzz_creds = creds["fuzz"].clone();
    let finished = done.clone();
    sim.client("fuzz", async move {
        let mut rng = rand::rngs::StdRng::seed_from_u64(42);
        let target = SocketAddr::new(turmoil::lookup("n0"), PORT);
        // 4,000 raw UDP datagrams: not QUIC at all, or QUIC-looking headers.
        let raw = turmoil::net::UdpSocket::bind((IpAddr::V4(Ipv4Addr::UNSPECIFIED), 9000)).await?;
        for i in 0..4000u32 {
            let len = rng.random_range(1..1500);
            let mut d: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            if i.is_multiple_of(2) {
                d[0] = 0xc0 | (d[0] & 0x0f); // long header, version bytes random
            }
            raw.send_to(&d, target).await?;
            if i.is_multiple_of(100) {
                tokio::task::yield_now().await;
            }
        }
        // An authenticated peer (cert from the cluster CA) that speaks garbage:
        // 3,000 datagrams, 2,000 uni-streams, 1,000 bi-streams.
        let (_endpoint, conn) = raw_connection("fuzz", &fuzz_creds, target).await?;
        // A SWIM packet claiming its own id and address first, addressed to nobody
        // here (so foca takes nothing from it): the node takes a connection's streams
        // only once it has made such a claim, and the garbage must reach the decoders.
        let nobody = gorgo_cluster::MemberId {
            node: gorgo_core::NodeId::from("nobody"),
            region: String::new(),
            addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 1),
            generation: 0,
        };
        conn.send_datagram(swim_from_fuzz(nobody, foca::Message::Gossip)?.into())?;
        for i in 0..3000u32 {
            let len = rng.random_range(1..1000);
            let mut d: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            if i.is_multiple_of(2) {
                d[0] = 1; // the SWIM datagram kind
            }
            let _ = conn.send_datagram(d.into());
            if i.is_multiple_of(50) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        for i in 0..3000 {
            let len = rng.random_range(0..3000);
            let mut d: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            if !d.is_empty() {
                d[0] = [1u8, 2, 3][i % 3]; // gossip, app, unknown kinds
            }
            if i.is_multiple_of(3) {
                let (mut send, _recv) = conn.open_bi().await?;
                let _ = send.write_all(&d).await;
                let _ = send.finish();
            } else {
                let mut send = conn.open_uni().await?;
                let _ = send.write_all(&d).await;
                let _ = send.finish();
            }
        }
        // A stream that sends its kind and then stalls is stopped once the node's
        // stream timeout (30 s) passes, rather than holding a task for ever.
        let mut stalled = conn.open_uni().await?;
        stalled.write_all(&[2u8]).await?;
        let stopped = tokio::time::timeout(Duration::from_secs(60), stalled.stopped()).await;
        assert!(matches!(stopped, Ok(Ok(Some(_)))), "{stopped:?}");
        tokio::time::sleep(Duration::from_secs(1)).await;
        finished.store(true, Ordering::SeqCst);
        Ok(())
    });
    run_until(&mut sim, Duration::from_secs(180), |_| {
        done.load(Ordering::SeqCst)
    })
    .expect("fuzzer finishes");
    run_for(&mut sim, Duration::from_secs(3));

    assert!(converged(&handles, &NAMES));
    let h = handles.lock();
    let logs_after: Vec<_> = h.values().map(|h| h.membership_log()).collect();
    assert_eq!(logs_before, logs_after, "membership changed under fuzzing");
    for n in NAMES {
        assert!(
            h[n].peers().iter().all(|p| p.id.0 != "fuzz"),
            "{n} took the fuzzer in"
        );
    }
    let m = h["n0"].metrics();
    assert!(m.malformed_received.load(Ordering::Relaxed) > 1000, "{m:?}");
}

/// n0 and n1 converged, then the `fuzz` member (a certificate from the cluster's CA)
/// connected to n0 runs `script` on that connection (with the nodes' handles) to its
/// end; the handles to check after.
fn a_member_at_n0<F, Fut>(seed: u64, script: F) -> Handles
where
    F: FnOnce(quinn::Connection, Handles) -> Fut + 'static,
    Fut: std::future::Future<Output = Result<(), Box<dyn std::error::Error>>> + 'static,
{
    let mut sim = sim(seed, Duration::from_secs(120));
    let creds = credentials(&["n0", "n1", "fuzz"]);
    let handles = Handles::default();
    converged_cluster(&mut sim, &["n0", "n1"], &creds, 1, &handles);
    let done = Arc::new(AtomicBool::new(false));
    let finished = done.clone();
    let fuzz_creds = creds["fuzz"].clone();
    let nodes = handles.clone();
    sim.client("fuzz", async move {
        let target = SocketAddr::new(turmoil::lookup("n0"), PORT);
        let (_endpoint, conn) = raw_connection("fuzz", &fuzz_creds, target).await?;
        script(conn, nodes).await?;
        finished.store(true, Ordering::SeqCst);
        Ok(())
    });
    run_until(&mut sim, Duration::from_secs(60), |_| {
        done.load(Ordering::SeqCst)
    })
    .expect("the member finishes");
    handles
}

/// A member with a certificate that keeps declaring n0 down (`TurnUndead` to n0's
/// current identity, five times a second for 5 s) makes it renew at most once per
/// suspicion's length (probe, indirect probe, suspicion timeout: 2.4 s), not at every
/// packet (25 renewals before): each renewal makes every peer forget n0's summaries
/// and cut their forwards there.
#[test]
fn a_member_declaring_a_node_down_again_and_again_gets_a_renewal_per_suspicion() {
    let handles = a_member_at_n0(3, |conn, nodes| async move {
        for _ in 0..25 {
            let dst = nodes.lock()["n0"].identity();
            conn.send_datagram(swim_from_fuzz(dst, foca::Message::TurnUndead)?.into())?;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(())
    });
    let h = handles.lock();
    let generation = h["n0"].identity().generation;
    assert!((2..=4).contains(&generation), "{generation}");
    let m = h["n0"].metrics();
    assert!(
        m.spurious_turn_undead_dropped.load(Ordering::Relaxed) >= 20,
        "{m:?}"
    );
}

/// A member that announces itself to n0 at an address n0 does not advertise (a peer
/// seeding it at an address that reaches it while it advertises another) is counted,
/// and warned about: foca ignores such an announce, and the peer re-announced for ever
/// with nothing said on either side.
#[test]
fn an_announce_to_an_address_not_advertised_is_counted() {
    let handles = a_member_at_n0(4, |conn, _| async move {
        let elsewhere = gorgo_cluster::MemberId {
            node: gorgo_core::NodeId::from("n0"),
            region: String::new(),
            addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 9, 9, 9)), PORT),
            generation: 0,
        };
        conn.send_datagram(swim_from_fuzz(elsewhere, foca::Message::Announce)?.into())?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        Ok(())
    });
    let h = handles.lock();
    let m = h["n0"].metrics();
    assert_eq!(m.misaddressed_announces.load(Ordering::Relaxed), 1, "{m:?}");
}
