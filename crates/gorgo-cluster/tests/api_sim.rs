//! The node-facing API on turmoil: forwarded-request bi-streams, app messages, stats
//! broadcasts and graceful leave.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use gorgo_core::{NodeId, QueueStats};
use parking_lot::Mutex;

const NAMES: [&str; 3] = ["n0", "n1", "n2"];

fn spec(
    i: usize,
    creds: &std::collections::BTreeMap<String, gorgo_cluster::NodeCredentials>,
) -> NodeSpec {
    seeded_spec(&NAMES, i, creds, 1)
}

#[test]
fn forwards_app_messages_stats_and_leave() {
    let mut sim = sim(17, Duration::from_secs(60));
    let creds = credentials(&NAMES);
    let handles = Handles::default();
    let echoed = Arc::new(Mutex::new(None::<Vec<u8>>));
    let app_seen = Arc::new(Mutex::new(Vec::new()));
    let leave = Arc::new(AtomicBool::new(false));

    // n0 serves forwards by echoing the request, upper-cased, and records app messages.
    {
        let s = spec(0, &creds);
        let handles = handles.clone();
        let app_seen = app_seen.clone();
        sim.host("n0", move || {
            let s = s.clone();
            let handles = handles.clone();
            let app_seen = app_seen.clone();
            async move {
                let (h, _) = start_node(&s).await?;
                handles.lock().insert(s.name.clone(), h.clone());
                let mut forwards = h.incoming_forwards().expect("first take");
                assert!(h.incoming_forwards().is_none(), "taken once");
                let mut inbox = h.app_inbox().expect("first take");
                tokio::spawn(async move {
                    while let Some(m) = inbox.recv().await {
                        app_seen
                            .lock()
                            .push((m.from.0.clone(), m.kind, m.payload.to_vec()));
                    }
                });
                while let Some(mut f) = forwards.recv().await {
                    assert_eq!(f.from, NodeId::from("n1"));
                    let req = f.recv.read_to_end(1024).await?;
                    f.send.write_all(&req.to_ascii_uppercase()).await?;
                    f.send.finish()?;
                }
                Ok(())
            }
        });
    }
    // n1 forwards a request to n0, sends it app messages, broadcasts stats.
    {
        let s = spec(1, &creds);
        let handles = handles.clone();
        let echoed = echoed.clone();
        sim.host("n1", move || {
            let s = s.clone();
            let handles = handles.clone();
            let echoed = echoed.clone();
            async move {
                let (h, _) = start_node(&s).await?;
                handles.lock().insert(s.name.clone(), h.clone());
                let n0 = NodeId::from("n0");
                while !h.alive_peers().contains(&n0) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                let (mut send, mut recv) = h.open_forward(&n0).await?;
                send.write_all(b"hello").await?;
                send.finish()?;
                *echoed.lock() = Some(recv.read_to_end(1024).await?);
                h.send_to(&n0, 7, b"proposal").await?;
                assert!(h
                    .send_to(&n0, 7, &vec![0u8; gorgo_cluster::MAX_APP_MESSAGE + 1])
                    .await
                    .is_err());
                h.broadcast_stats(QueueStats {
                    running: 42,
                    ..Default::default()
                })?;
                std::future::pending::<()>().await;
                Ok(())
            }
        });
    }
    // n2 leaves gracefully when told.
    {
        let s = spec(2, &creds);
        let handles = handles.clone();
        let leave = leave.clone();
        sim.host("n2", move || {
            let s = s.clone();
            let handles = handles.clone();
            let leave = leave.clone();
            async move {
                let (h, _) = start_node(&s).await?;
                handles.lock().insert(s.name.clone(), h.clone());
                while !leave.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                h.leave().await?;
                assert!(h.is_stopped());
                std::future::pending::<()>().await;
                Ok(())
            }
        });
    }
    set_wan_latencies(&mut sim, &NAMES);
    run_until(&mut sim, Duration::from_secs(10), |_| {
        converged(&handles, &NAMES)
    })
    .expect("converge");
    run_until(&mut sim, Duration::from_secs(10), |_| {
        echoed.lock().is_some() && !app_seen.lock().is_empty() && {
            let h = handles.lock();
            ["n0", "n2"].iter().all(|n| {
                h[*n]
                    .peers()
                    .iter()
                    .any(|p| p.id.0 == "n1" && p.stats.as_ref().is_some_and(|s| s.running == 42))
            })
        }
    })
    .expect("forward, app message and stats arrive");
    assert_eq!(echoed.lock().as_deref(), Some(&b"HELLO"[..]));
    assert_eq!(
        app_seen.lock()[0],
        ("n1".to_owned(), 7, b"proposal".to_vec())
    );

    // A graceful leave is seen well before failure detection would fire.
    leave.store(true, Ordering::SeqCst);
    let asked = sim.elapsed();
    let gone = run_until(&mut sim, Duration::from_secs(5), |_| {
        let h = handles.lock();
        ["n0", "n1"]
            .iter()
            .all(|n| !h[*n].alive_peers().contains(&NodeId::from("n2")))
    })
    .expect("leave seen");
    let took = gone - asked;
    eprintln!("converged+forwarded by {asked:?}, leave seen after {took:?}");
    assert!(took < Duration::from_millis(800), "leave took {took:?}");
}

#[test]
fn peer_gone_resolves_when_the_peer_dies_or_restarts_and_not_before() {
    let mut sim = sim(19, Duration::from_secs(60));
    let creds = credentials(&NAMES);
    let handles = Handles::default();
    // When n0's `peer_gone` resolved for each peer, in simulated time.
    let gone_at = Arc::new(Mutex::new(std::collections::BTreeMap::new()));
    {
        let s = spec(0, &creds);
        let handles = handles.clone();
        let gone_at = gone_at.clone();
        sim.host("n0", move || {
            let s = s.clone();
            let handles = handles.clone();
            let gone_at = gone_at.clone();
            async move {
                let (h, _) = start_node(&s).await?;
                handles.lock().insert(s.name.clone(), h.clone());
                let mut changes = h.subscribe_membership();
                while h.alive_peers().len() < 2 {
                    changes.changed().await?;
                }
                for peer in ["n1", "n2"] {
                    let gone = h.peer_gone(&NodeId::from(peer));
                    let gone_at = gone_at.clone();
                    tokio::spawn(async move {
                        gone.await;
                        gone_at.lock().insert(peer, turmoil::elapsed());
                    });
                }
                std::future::pending::<()>().await;
                Ok(())
            }
        });
    }
    for i in [1, 2] {
        // The wall clock: a restart takes a newer generation, as a real one does.
        add_node(&mut sim, seeded_spec(&NAMES, i, &creds, 0), handles.clone());
    }
    set_wan_latencies(&mut sim, &NAMES);
    converge(&mut sim, &handles, &NAMES);
    run_for(&mut sim, Duration::from_secs(2));
    assert!(gone_at.lock().is_empty(), "{:?}", gone_at.lock());

    // n1 dies (kill -9): gone the moment n0's membership declares it down.
    sim.crash("n1");
    let n1 = NodeId::from("n1");
    let down_at = run_until(&mut sim, Duration::from_secs(10), |_| {
        !handles.lock()["n0"].alive_peers().contains(&n1)
    })
    .expect("n1 declared down at n0");
    run_for(&mut sim, Duration::from_millis(1));
    let at = gone_at.lock().get("n1").copied();
    assert!(
        at.is_some_and(|t| t <= down_at + Duration::from_millis(1)),
        "declared down at {down_at:?}, gone at {at:?}"
    );
    assert!(!gone_at.lock().contains_key("n2"));

    // n2 restarts at its address before failure detection could fire: its old run is
    // gone as soon as n0 sees the new one, although n2 was never seen down.
    let old = handles.lock().remove("n2").unwrap().identity().generation;
    sim.bounce("n2");
    let n2 = NodeId::from("n2");
    let renamed_at = run_until(&mut sim, Duration::from_secs(10), |_| {
        handles.lock()["n0"]
            .peers()
            .iter()
            .any(|p| p.id == n2 && p.alive && p.generation > old)
    })
    .expect("n0 sees n2's new run");
    run_for(&mut sim, Duration::from_millis(1));
    let at = gone_at.lock().get("n2").copied();
    assert!(
        at.is_some_and(|t| t <= renamed_at + Duration::from_millis(1)),
        "new run seen at {renamed_at:?}, gone at {at:?}"
    );
}

#[test]
fn a_draining_node_stops_being_a_candidate_at_once_but_stays_a_member() {
    let mut sim = sim(23, Duration::from_secs(60));
    let creds = credentials(&NAMES);
    let handles = Handles::default();
    converged_cluster(&mut sim, &NAMES, &creds, 1, &handles);
    handles.lock()["n1"]
        .broadcast_stats(QueueStats {
            running: 3,
            ..Default::default()
        })
        .unwrap();
    let n1 = NodeId::from("n1");
    let n1_says = |draining: bool| {
        let h = handles.lock();
        ["n0", "n2"].iter().all(|o| {
            h[*o]
                .peers()
                .iter()
                .any(|p| p.id == n1 && p.stats.as_ref().is_some_and(|s| s.draining == draining))
        })
    };
    run_until(&mut sim, Duration::from_secs(5), |_| n1_says(false)).expect("stats arrive");

    // SIGTERM at n1: drain first.
    let asked = sim.elapsed();
    handles.lock()["n1"].drain().unwrap();
    assert!(handles.lock()["n1"].is_draining());
    let seen = run_until(&mut sim, Duration::from_secs(5), |_| n1_says(true))
        .expect("peers see n1 draining");
    let took = seen - asked;
    eprintln!("draining seen after {took:?}");
    // The broadcast goes out at once: about one one-way delay (45-125 ms), well
    // before a gossip round or failure detection would tell.
    assert!(took < Duration::from_millis(400), "took {took:?}");
    // Still a member everywhere (forwards in flight there finish), and the stats it
    // publishes from now on keep saying so.
    handles.lock()["n1"]
        .broadcast_stats(QueueStats::default())
        .unwrap();
    let left = run_until(&mut sim, Duration::from_secs(5), |_| {
        !n1_says(true) || {
            let h = handles.lock();
            ["n0", "n2"]
                .iter()
                .any(|o| !h[*o].alive_peers().contains(&n1))
        }
    });
    assert!(left.is_none(), "n1 stopped draining or left at {left:?}");
}

/// A node fronting several engines gossips each as its own stream: peers hold every
/// engine's summary and stats by replica, a replica's draining stats take only that
/// engine out, and a replica added later arrives as a snapshot.
#[test]
fn each_engine_of_a_node_is_gossiped_as_its_own_replica() {
    use gorgo_cluster::SharedSummary;
    use gorgo_core::summary::LocalSummary;
    let mut sim = sim(29, Duration::from_secs(60));
    let creds = credentials(&NAMES);
    let handles = Handles::default();
    converged_cluster(&mut sim, &NAMES, &creds, 1, &handles);
    let n1 = NodeId::from("n1");
    {
        let h = handles.lock();
        let extra = SharedSummary::new(LocalSummary::new(), sim_clock());
        extra.update(|s| {
            s.record_add(11);
            s.record_add(12);
        });
        h["n1"].set_engine(2, extra).unwrap();
        for (replica, running) in [(0u16, 1u32), (2, 7)] {
            h["n1"]
                .broadcast_stats(QueueStats {
                    replica,
                    running,
                    ..Default::default()
                })
                .unwrap();
        }
        // An engine that is not gossiped has no stats to publish.
        assert!(h["n1"]
            .broadcast_stats(QueueStats {
                replica: 5,
                ..Default::default()
            })
            .is_err());
    }
    let heard = |replica: u16, check: &dyn Fn(&QueueStats) -> bool| {
        let h = handles.lock();
        ["n0", "n2"].iter().all(|o| {
            h[*o].peers().iter().any(|p| {
                p.id == n1
                    && p.engines
                        .get(replica as usize)
                        .and_then(|e| e.stats.as_ref())
                        .is_some_and(check)
            })
        })
    };
    run_until(&mut sim, Duration::from_secs(5), |_| {
        heard(0, &|s| s.running == 1)
            && heard(2, &|s| s.running == 7)
            && handles.lock()["n0"]
                .with_peer_summary(&n1, 2, |s| s.len())
                .is_some_and(|n| n == 2)
    })
    .expect("both engines' stats and engine 2's summary arrive");
    {
        let h = handles.lock();
        let v = h["n0"].peers().into_iter().find(|p| p.id == n1).unwrap();
        // Engine 1 was never gossiped: a slot with nothing in it.
        assert!(v.engines[1].stats.is_none());
        assert_eq!(
            v.stats.as_ref().map(|s| s.running),
            Some(1),
            "top level is engine 0"
        );
        assert_eq!(h["n0"].with_peer_summary(&n1, 0, |s| s.len()), Some(0));
    }
    // Engine 2 drains: its stats say so, engine 0's do not.
    handles.lock()["n1"]
        .broadcast_stats(QueueStats {
            replica: 2,
            draining: true,
            ..Default::default()
        })
        .unwrap();
    run_until(&mut sim, Duration::from_secs(5), |_| {
        heard(2, &|s| s.draining)
    })
    .expect("engine 2's drain arrives");
    assert!(heard(0, &|s| !s.draining));
}

/// A removed engine leaves its peers' tables: its stream ends with stats that say so
/// (`ClusterHandle::remove_engine`), the peers let go of its summary and list it in
/// no view, and its node sends nothing more of it; an engine added after it (the next
/// replica number) is heard as any. Before, the removed engine's last stats and
/// summary went out every round for the rest of the run, and every peer listed it.
#[test]
fn a_removed_engine_leaves_its_peers_tables_and_is_sent_no_more() {
    use gorgo_cluster::SharedSummary;
    use gorgo_core::summary::LocalSummary;
    let mut sim = sim(31, Duration::from_secs(60));
    let creds = credentials(&NAMES);
    let handles = Handles::default();
    converged_cluster(&mut sim, &NAMES, &creds, 1, &handles);
    let n1 = NodeId::from("n1");
    let engine = || {
        let summary = SharedSummary::new(LocalSummary::new(), sim_clock());
        summary.update(|s| s.record_add(11));
        summary
    };
    let n1h = handles.lock()["n1"].clone();
    n1h.set_engine(1, engine()).unwrap();
    for replica in [0, 1] {
        n1h.broadcast_stats(QueueStats {
            replica,
            ..Default::default()
        })
        .unwrap();
    }
    // The replicas of n1 each peer lists, and whether it holds engine 1's summary.
    let listed = |replica: u16| {
        let h = handles.lock();
        ["n0", "n2"].map(|o| {
            let view = h[o].peers().into_iter().find(|p| p.id == n1).unwrap();
            let replicas: Vec<u16> = view
                .engines
                .iter()
                .filter(|e| e.stats.is_some())
                .map(|e| e.replica)
                .collect();
            (replicas, h[o].with_peer_summary(&n1, replica, |s| s.len()))
        })
    };
    run_until(&mut sim, Duration::from_secs(5), |_| {
        listed(1) == [(vec![0, 1], Some(1)), (vec![0, 1], Some(1))]
    })
    .expect("engine 1 is heard");
    let sent = || {
        let m = n1h.metrics();
        m.deltas_sent.load(Ordering::Relaxed) + m.snapshots_sent.load(Ordering::Relaxed)
    };
    let window = Duration::from_secs(10);
    let before = sent();
    run_for(&mut sim, window);
    let two_engines = sent() - before;

    n1h.remove_engine(1).unwrap();
    run_until(&mut sim, Duration::from_secs(5), |_| {
        listed(1) == [(vec![0], None), (vec![0], None)]
    })
    .expect("engine 1 leaves every peer's view");
    let before = sent();
    run_for(&mut sim, window);
    let one_engine = sent() - before;
    // Engine 0's stream alone: about half of what two engines sent.
    assert!(
        one_engine * 4 < two_engines * 3,
        "{one_engine} messages in {window:?} after the removal, {two_engines} before"
    );
    // Its stats are refused, it cannot leave twice, and its number is not reused.
    assert!(n1h
        .broadcast_stats(QueueStats {
            replica: 1,
            ..Default::default()
        })
        .is_err());
    assert!(n1h.remove_engine(1).is_err());
    assert!(n1h.set_engine(1, engine()).is_err());
    // The next engine comes in as any.
    n1h.set_engine(2, engine()).unwrap();
    n1h.broadcast_stats(QueueStats {
        replica: 2,
        ..Default::default()
    })
    .unwrap();
    run_until(&mut sim, Duration::from_secs(5), |_| {
        listed(2) == [(vec![0, 2], Some(1)), (vec![0, 2], Some(1))]
    })
    .expect("engine 2 is heard");
}

/// Published stats go out on a gossip round at once, to a peer that is up to date too
/// (an empty delta carries them), not on the next tick of the round's own timer: here
/// that timer fires once a minute, and each publication is still sent within a second
/// of simulated time (docs/cluster.md, "Stats every round").
#[test]
fn published_stats_go_out_on_a_round_at_once() {
    let mut sim = sim(23, Duration::from_secs(60));
    let creds = credentials(&NAMES[..2]);
    let handles = Handles::default();
    for (i, name) in NAMES[..2].iter().enumerate() {
        let s = seeded_spec(&NAMES[..2], i, &creds, 1);
        let handles = handles.clone();
        sim.host(*name, move || {
            let s = s.clone();
            let handles = handles.clone();
            async move {
                let (h, _) =
                    start_node_with(&s, |c| c.gossip_interval = Duration::from_secs(60)).await?;
                handles.lock().insert(s.name.clone(), h);
                std::future::pending::<()>().await;
                Ok(())
            }
        });
    }
    set_wan_latencies(&mut sim, &NAMES[..2]);
    run_until(&mut sim, Duration::from_secs(10), |_| {
        converged(&handles, &NAMES[..2])
    })
    .expect("converge");
    let n0 = handles.lock()["n0"].clone();
    let sent = || {
        let m = n0.metrics();
        m.deltas_sent.load(Ordering::Relaxed) + m.snapshots_sent.load(Ordering::Relaxed)
    };
    for running in 1..=3 {
        let before = sent();
        n0.broadcast_stats(QueueStats {
            running,
            ..Default::default()
        })
        .expect("engine 0 is gossiped");
        run_until(&mut sim, Duration::from_secs(1), |_| sent() > before)
            .expect("a round follows the publication");
    }
    run_until(&mut sim, Duration::from_secs(1), |_| {
        handles.lock()["n1"]
            .peers()
            .iter()
            .any(|p| p.id.0 == "n0" && p.stats.as_ref().is_some_and(|s| s.running == 3))
    })
    .expect("the last stats arrive");
}

/// A forwarded request of a long prompt crosses in about one round trip, not the
/// several of QUIC's slow start: links between nodes carry mostly small gossip, so a
/// window left at QUIC's default (about 14 KB) never grows, and every large forward
/// would start from it.
#[test]
fn a_large_forward_crosses_in_about_one_round_trip() {
    const BODY: usize = 512 * 1024;
    let mut sim = sim(23, Duration::from_secs(60));
    let creds = credentials(&NAMES);
    let handles = Handles::default();
    let took = Arc::new(Mutex::new(None::<Duration>));
    {
        let s = spec(0, &creds);
        let handles = handles.clone();
        sim.host("n0", move || {
            let s = s.clone();
            let handles = handles.clone();
            async move {
                let (h, _) = start_node(&s).await?;
                handles.lock().insert(s.name.clone(), h.clone());
                let mut forwards = h.incoming_forwards().expect("first take");
                while let Some(mut f) = forwards.recv().await {
                    let req = f.recv.read_to_end(BODY).await?;
                    f.send.write_all(&[(req.len() == BODY) as u8]).await?;
                    f.send.finish()?;
                }
                Ok(())
            }
        });
    }
    {
        let s = spec(1, &creds);
        let handles = handles.clone();
        let took = took.clone();
        sim.host("n1", move || {
            let s = s.clone();
            let handles = handles.clone();
            let took = took.clone();
            async move {
                let (h, _) = start_node(&s).await?;
                handles.lock().insert(s.name.clone(), h.clone());
                let n0 = NodeId::from("n0");
                while !h.alive_peers().contains(&n0) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                // A first forward: the connection is up and its RTT measured.
                let (mut send, mut recv) = h.open_forward(&n0).await?;
                send.write_all(&vec![7u8; BODY]).await?;
                send.finish()?;
                recv.read_to_end(16).await?;
                tokio::time::sleep(Duration::from_secs(2)).await;
                let started = tokio::time::Instant::now();
                let (mut send, mut recv) = h.open_forward(&n0).await?;
                send.write_all(&vec![7u8; BODY]).await?;
                send.finish()?;
                let answer = recv.read_to_end(16).await?;
                assert_eq!(answer, [1]);
                *took.lock() = Some(started.elapsed());
                std::future::pending::<()>().await;
                Ok(())
            }
        });
    }
    {
        let s = spec(2, &creds);
        let handles = handles.clone();
        sim.host("n2", move || {
            let s = s.clone();
            let handles = handles.clone();
            async move {
                let (h, _) = start_node(&s).await?;
                handles.lock().insert(s.name.clone(), h.clone());
                std::future::pending::<()>().await;
                Ok(())
            }
        });
    }
    set_wan_latencies(&mut sim, &NAMES);
    run_until(&mut sim, Duration::from_secs(30), |_| took.lock().is_some())
        .expect("the forwards are answered");
    let rtt = Duration::from_millis(2 * one_way_ms(0, 1));
    let took = took.lock().unwrap();
    eprintln!("{BODY} bytes and a 1-byte answer took {took:?} at RTT {rtt:?}");
    assert!(took < rtt * 2, "took {took:?} at RTT {rtt:?}");
}
