//! Deterministic cluster tests on turmoil: quinn over simulated UDP, five nodes on a
//! WAN-like topology (45-125 ms one way), simulated time.

mod common;

use std::time::Duration;

use common::*;
use gorgo_cluster::MembershipEvent;
use gorgo_core::NodeId;

const NAMES: [&str; 5] = ["n0", "n1", "n2", "n3", "n4"];

fn five_nodes(seed: u64, churn: Option<Churn>) -> (turmoil::Sim<'static>, Handles) {
    let mut sim = sim(seed, Duration::from_secs(120));
    let creds = credentials(&NAMES);
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
                churn,
                generation: 1,
            },
            handles.clone(),
        );
    }
    set_wan_latencies(&mut sim, &NAMES);
    (sim, handles)
}

#[test]
fn five_nodes_converge_to_full_membership() {
    let (mut sim, handles) = five_nodes(7, None);
    let at = run_until(&mut sim, Duration::from_secs(10), |_| {
        converged(&handles, &NAMES)
    });
    let at = at.expect("full membership within 10 s of simulated time");
    eprintln!("converged at {at:?}");
    // RTTs are measured and near the configured links.
    run_for(&mut sim, Duration::from_secs(2));
    let h = handles.lock();
    let n0 = h["n0"].peers();
    let n1 = n0.iter().find(|p| p.id == NodeId::from("n1")).unwrap();
    let rtt = n1.rtt_ms.expect("rtt sampled");
    let want = 2.0 * one_way_ms(0, 1) as f64;
    assert!(
        (want - 5.0..=want + 25.0).contains(&rtt),
        "n0-n1 rtt {rtt}, links say {want}"
    );
    assert_eq!(n1.region, "region-1");
}

#[test]
fn crashed_node_is_down_within_4s() {
    let (mut sim, handles) = five_nodes(11, None);
    run_until(&mut sim, Duration::from_secs(10), |_| {
        converged(&handles, &NAMES)
    })
    .expect("converge");
    run_for(&mut sim, Duration::from_secs(1));
    let crashed_at = sim.elapsed();
    sim.crash("n4");
    let n4 = NodeId::from("n4");
    let down_at = run_until(&mut sim, Duration::from_secs(10), |_| {
        let h = handles.lock();
        NAMES[..4]
            .iter()
            .all(|n| !h[*n].alive_peers().contains(&n4))
    })
    .expect("n4 declared down");
    let detect = down_at - crashed_at;
    eprintln!("failure detection: {detect:?}");
    // Bound: 0.8 + 0.8 + 1.6 s (SwimTimings) plus a gossip hop.
    assert!(detect < Duration::from_secs(4), "took {detect:?}");
    // The survivors still see each other.
    assert!(converged(&handles, &NAMES[..4]));
}

#[test]
fn partition_heals_and_summaries_resync() {
    let churn = Churn {
        period: Duration::from_millis(100),
        adds: 8,
        shared: 4,
        capacity: 2000,
        until: Duration::from_secs(16),
    };
    let (mut sim, handles) = five_nodes(23, Some(churn));
    run_until(&mut sim, Duration::from_secs(10), |_| {
        converged(&handles, &NAMES)
    })
    .expect("converge");
    let (a, b) = (&NAMES[..2], &NAMES[2..]);
    for x in a {
        for y in b {
            sim.partition(*x, *y);
        }
    }
    // Both sides declare the other down.
    run_until(&mut sim, Duration::from_secs(10), |_| {
        let h = handles.lock();
        a.iter().all(|x| {
            b.iter()
                .all(|y| !h[*x].alive_peers().contains(&NodeId::from(*y)))
        }) && b.iter().all(|y| {
            a.iter()
                .all(|x| !h[*y].alive_peers().contains(&NodeId::from(*x)))
        })
    })
    .expect("partition detected");
    for x in a {
        for y in b {
            sim.repair(*x, *y);
        }
    }
    run_until(&mut sim, Duration::from_secs(20), |_| {
        converged(&handles, &NAMES)
    })
    .expect("partition heals");
    // Churn stops at 16 s; then every node holds every peer's current summary.
    let synced = run_until(&mut sim, Duration::from_secs(20), |t| {
        t > churn.until && summaries_synced(&handles)
    });
    assert!(synced.is_some(), "summaries resync after the partition");
    let h = handles.lock();
    let m = h["n0"].metrics();
    assert!(m.snapshots_sent.load(std::sync::atomic::Ordering::Relaxed) > 0);
    assert!(!m.staleness_samples().is_empty());
}

/// True when every node's view of every peer's summary has that peer's current version
/// and size.
fn summaries_synced(handles: &Handles) -> bool {
    let h = handles.lock();
    h.iter().all(|(name, handle)| {
        h.iter()
            .filter(|(other, _)| *other != name)
            .all(|(other, oh)| {
                let (v, len) = (oh.local_summary().version(), oh.local_summary().len());
                handle
                    .with_peer_summary(&NodeId(other.clone()), 0, |p| {
                        p.version() == v && p.len() == len
                    })
                    .unwrap_or(false)
            })
    })
}

#[test]
fn foreign_certificate_never_joins() {
    let mut sim = sim(5, Duration::from_secs(60));
    let creds = credentials(&NAMES[..3]);
    let foreign = credentials(&["rogue"]);
    let handles = Handles::default();
    for (i, n) in NAMES[..3].iter().enumerate() {
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
    add_node(
        &mut sim,
        NodeSpec {
            name: "rogue".to_owned(),
            region: "nowhere".to_owned(),
            credentials: foreign["rogue"].clone(),
            seeds: vec!["n0".to_owned(), "n1".to_owned()],
            churn: None,
            generation: 1,
        },
        handles.clone(),
    );
    run_until(&mut sim, Duration::from_secs(10), |_| {
        converged(&handles, &NAMES[..3])
    })
    .expect("converge");
    run_for(&mut sim, Duration::from_secs(5));
    let h = handles.lock();
    for n in &NAMES[..3] {
        assert!(
            h[*n].peers().iter().all(|p| p.id.0 != "rogue"),
            "{n} let rogue in"
        );
    }
    assert!(
        h["rogue"].peers().is_empty(),
        "rogue sees {:?}",
        h["rogue"].peers()
    );
    let refused = h["n0"]
        .metrics()
        .handshakes_failed
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(refused > 0, "n0 refused no handshake");
    // Both sides know why: the cause an operator must act on, counted (and warned of
    // once per address), not only a failed handshake.
    for n in ["n0", "rogue"] {
        let foreign = h[n]
            .metrics()
            .handshakes_foreign_certificate
            .load(std::sync::atomic::Ordering::Relaxed);
        assert!(foreign > 0, "{n} did not tell a foreign certificate");
    }
}

#[test]
fn same_seed_same_trace() {
    let trace = |seed| {
        let (mut sim, handles) = five_nodes(seed, None);
        run_until(&mut sim, Duration::from_secs(10), |_| {
            converged(&handles, &NAMES)
        })
        .expect("converge");
        run_for(&mut sim, Duration::from_millis(500));
        sim.crash("n3");
        run_for(&mut sim, Duration::from_secs(4));
        let h = handles.lock();
        h.iter()
            .map(|(n, handle)| (n.clone(), handle.membership_log()))
            .collect::<Vec<_>>()
    };
    let first = trace(99);
    // The trace holds the joins and n3's failure, with simulated timestamps.
    let downs = first
        .iter()
        .flat_map(|(_, log)| log)
        .filter(|(_, e)| matches!(e, MembershipEvent::Down(..)))
        .count();
    assert_eq!(downs, 4, "{first:?}");
    assert_eq!(first, trace(99));
}

#[test]
fn restarted_node_rejoins_with_a_new_generation_and_resyncs() {
    let churn = Churn {
        period: Duration::from_millis(100),
        adds: 4,
        shared: 2,
        capacity: 500,
        until: Duration::from_secs(30),
    };
    let mut sim = sim(31, Duration::from_secs(120));
    let creds = credentials(&NAMES);
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
                churn: Some(churn),
                generation: 0,
            },
            handles.clone(),
        );
    }
    set_wan_latencies(&mut sim, &NAMES);
    run_until(&mut sim, Duration::from_secs(10), |_| {
        converged(&handles, &NAMES)
    })
    .expect("converge");
    run_for(&mut sim, Duration::from_secs(1));
    // Drop the test's handle first: it owns the old endpoint and so its socket's port.
    let old_generation = handles.lock().remove("n4").unwrap().identity().generation;
    sim.bounce("n4");
    let n4 = NodeId::from("n4");
    run_until(&mut sim, Duration::from_secs(15), |_| {
        let h = handles.lock();
        let Some(new_generation) = h.get("n4").map(|n| n.identity().generation) else {
            return false;
        };
        new_generation > old_generation
            && NAMES[..4].iter().all(|n| {
                h[*n]
                    .peers()
                    .iter()
                    .any(|p| p.id == n4 && p.alive && p.generation == new_generation)
            })
    })
    .expect("the restarted n4 is a member under its new generation");
    run_until(&mut sim, Duration::from_secs(30), |t| {
        t > churn.until && summaries_synced(&handles)
    })
    .expect("summaries resync with the restarted node");
}

/// A node whose seeds include 40 addresses nothing answers at (a seed list that
/// outlived its hosts, pods rescheduled to new IPs) dials each of them at start; once
/// those dials have failed (the 5 s idle timeout) and their 500 ms backoff is over, the
/// node keeps no dial state for any of them, nor for the seed that answered. Before,
/// a dial slot stayed for every address the node had ever dialed.
#[test]
fn dial_state_of_addresses_no_longer_dialed_is_dropped() {
    let mut sim = sim(37, Duration::from_secs(60));
    let names = ["n0", "n1"];
    let creds = credentials(&names);
    let handles = Handles::default();
    add_node(&mut sim, seeded_spec(&names, 0, &creds, 1), handles.clone());
    {
        let spec = seeded_spec(&names, 1, &creds, 1);
        let handles = handles.clone();
        sim.host("n1", move || {
            let spec = spec.clone();
            let handles = handles.clone();
            async move {
                let (h, _) = start_node_with(&spec, |c| {
                    // Ports on n0's host where nothing listens: datagrams to them
                    // are dropped, so each dial waits out the handshake's timeout.
                    let dead = turmoil::lookup("n0");
                    c.seeds
                        .extend((1..=40).map(|i| std::net::SocketAddr::new(dead, PORT + i)));
                })
                .await?;
                handles.lock().insert(spec.name.clone(), h);
                std::future::pending::<()>().await;
                Ok(())
            }
        });
    }
    set_wan_latencies(&mut sim, &names);
    let slots = |handles: &Handles| handles.lock().get("n1").map_or(0, |h| h.dial_slots());
    run_until(&mut sim, Duration::from_secs(2), |_| slots(&handles) >= 40)
        .expect("n1 dials its 40 dead seeds");
    converge(&mut sim, &handles, &names);
    let dropped = run_until(&mut sim, Duration::from_secs(15), |_| slots(&handles) == 0);
    assert!(
        dropped.is_some(),
        "n1 still holds {} dial slots",
        slots(&handles)
    );
    eprintln!("dial state dropped at {dropped:?}");
    // And the membership it made through the live seed is as it was.
    run_for(&mut sim, Duration::from_secs(2));
    assert!(converged(&handles, &names));
}
