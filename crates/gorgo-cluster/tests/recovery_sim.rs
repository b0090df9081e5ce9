//! Recovery on turmoil: a node cut off long enough to be declared down rejoins under a
//! new generation, a lone node never gives up its identity, and a peer is routable
//! (has an RTT) as soon as it joins.

mod common;

use std::time::Duration;

use common::*;
use gorgo_cluster::MembershipEvent;
use gorgo_core::NodeId;

const NAMES: [&str; 3] = ["n0", "n1", "n2"];

fn three_nodes(seed: u64) -> (turmoil::Sim<'static>, Handles) {
    let mut sim = sim(seed, Duration::from_secs(600));
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
                churn: None,
                generation: 1,
            },
            handles.clone(),
        );
    }
    set_wan_latencies(&mut sim, &NAMES);
    (sim, handles)
}

/// Cut `victim` off from everyone until both sides declared the other down, keep the
/// link down a while longer, heal, and check the victim is back under a new generation
/// in every view.
fn isolated_node_rejoins(seed: u64, victim: &str) {
    let (mut sim, handles) = three_nodes(seed);
    run_until(&mut sim, Duration::from_secs(10), |_| {
        converged(&handles, &NAMES)
    })
    .expect("converge");
    let before = handles.lock()[victim].identity().generation;
    let others: Vec<&str> = NAMES.iter().copied().filter(|n| *n != victim).collect();
    for o in &others {
        sim.partition(victim, *o);
    }
    let v = NodeId::from(victim);
    run_until(&mut sim, Duration::from_secs(15), |_| {
        let h = handles.lock();
        others.iter().all(|o| !h[*o].alive_peers().contains(&v))
            && h[victim].alive_peers().is_empty()
    })
    .expect("both sides declare the other down");
    run_for(&mut sim, Duration::from_secs(5));
    for o in &others {
        sim.repair(victim, *o);
    }
    let healed = run_until(&mut sim, Duration::from_secs(30), |_| {
        let h = handles.lock();
        let me = h[victim].identity();
        me.generation > before
            && converged(&handles_view(&h), &NAMES)
            && others.iter().all(|o| {
                h[*o]
                    .peers()
                    .iter()
                    .any(|p| p.id == v && p.alive && p.generation == me.generation)
            })
    });
    let h = handles.lock();
    assert!(
        healed.is_some(),
        "{victim} back under a new generation; its log: {:?}; views: {:?}",
        h[victim].membership_log(),
        others.iter().map(|o| h[*o].peers()).collect::<Vec<_>>()
    );
    assert!(h[victim]
        .membership_log()
        .iter()
        .any(|(_, e)| matches!(e, MembershipEvent::Rejoined(g) if *g > before)));
}

/// `converged` takes the shared map; this re-wraps a locked view of it.
fn handles_view(h: &std::collections::BTreeMap<String, gorgo_cluster::ClusterHandle>) -> Handles {
    std::sync::Arc::new(parking_lot::Mutex::new(h.clone()))
}

#[test]
fn isolated_node_with_a_seed_rejoins_with_a_new_generation() {
    isolated_node_rejoins(41, "n2");
}

#[test]
fn isolated_node_without_seeds_rejoins_with_a_new_generation() {
    // n0 has no seeds: once it knows nobody alive, it can only rejoin through the
    // members it saw go down.
    isolated_node_rejoins(43, "n0");
}

#[test]
fn lone_node_never_goes_defunct() {
    let mut sim = sim(47, Duration::from_secs(600));
    let creds = credentials(&["solo"]);
    let handles = Handles::default();
    add_node(
        &mut sim,
        NodeSpec {
            name: "solo".to_owned(),
            region: "region-0".to_owned(),
            credentials: creds["solo"].clone(),
            // A seed host that never answers (its node is not running).
            seeds: vec!["ghost".to_owned()],
            churn: None,
            generation: 1,
        },
        handles.clone(),
    );
    sim.host("ghost", || async {
        std::future::pending::<()>().await;
        Ok(())
    });
    run_for(&mut sim, Duration::from_secs(240));
    let h = handles.lock();
    let solo = &h["solo"];
    assert!(!solo.is_stopped());
    assert_eq!(solo.identity().generation, 1, "{:?}", solo.membership_log());
    assert!(
        solo.membership_log().is_empty(),
        "{:?}",
        solo.membership_log()
    );
}

#[test]
fn a_joined_peer_has_an_rtt_before_any_gossip_round() {
    let mut sim = sim(53, Duration::from_secs(60));
    let names = &NAMES[..2];
    let creds = credentials(names);
    let handles = Handles::default();
    for (i, n) in names.iter().enumerate() {
        let spec = NodeSpec {
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
        };
        let handles = handles.clone();
        sim.host(*n, move || {
            let spec = spec.clone();
            let handles = handles.clone();
            async move {
                // Gossip rounds (which sample RTTs) only at start, then in a minute.
                let (h, _) = start_node_with(&spec, |c| {
                    c.gossip_interval = Duration::from_secs(60);
                })
                .await?;
                handles.lock().insert(spec.name.clone(), h);
                std::future::pending::<()>().await;
                Ok(())
            }
        });
    }
    set_wan_latencies(&mut sim, names);
    run_until(&mut sim, Duration::from_secs(10), |_| {
        converged(&handles, names)
    })
    .expect("converge");
    let want = 2.0 * one_way_ms(0, 1) as f64;
    let h = handles.lock();
    for (me, other) in [("n0", "n1"), ("n1", "n0")] {
        let p = h[me]
            .peers()
            .into_iter()
            .find(|p| p.id == NodeId::from(other))
            .unwrap();
        let rtt = p
            .rtt_ms
            .unwrap_or_else(|| panic!("{me} has no rtt for {other}"));
        assert!(
            (want - 5.0..=want + 25.0).contains(&rtt),
            "{me}->{other} rtt {rtt}, links say {want}"
        );
    }
}

#[test]
fn a_stalled_node_is_suspected_but_not_declared_down() {
    // n2 stalls (heavy CPU load, a long GC-like pause): nothing it sends or receives
    // moves for STALL, then the backlog goes through (held links). Its peers suspect it
    // and it suspects them; each side refutes once the backlog arrives. Before: a
    // refuted suspect still got foca's "you were declared down" notice and renewed its
    // identity, and an 800 ms suspicion timeout declared a 2 s stall down.
    const STALL: Duration = Duration::from_millis(2000);
    let (mut sim, handles) = three_nodes(59);
    run_until(&mut sim, Duration::from_secs(10), |_| {
        converged(&handles, &NAMES)
    })
    .expect("converge");
    let n2 = NodeId::from("n2");
    let lost = |handles: &Handles| {
        let h = handles.lock();
        ["n0", "n1"]
            .iter()
            .any(|o| !h[*o].alive_peers().contains(&n2))
    };
    for round in 0..3 {
        for o in ["n0", "n1"] {
            sim.hold("n2", o);
        }
        let during = run_until(&mut sim, STALL, |_| lost(&handles));
        for o in ["n0", "n1"] {
            sim.release("n2", o);
        }
        let after =
            during.or_else(|| run_until(&mut sim, Duration::from_secs(5), |_| lost(&handles)));
        let h = handles.lock();
        assert!(
            after.is_none(),
            "stall {round}: n2 declared down at {after:?}; n0 log: {:?}",
            h["n0"].membership_log()
        );
        assert_eq!(
            h["n2"].identity().generation,
            1,
            "stall {round}: n2 log: {:?}",
            h["n2"].membership_log()
        );
    }
}
