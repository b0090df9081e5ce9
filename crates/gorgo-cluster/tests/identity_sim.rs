//! Who a node is, on turmoil: a node restarted under the same config replaces what its
//! peers held of its previous run at once, and a second process with the same node id
//! (the same certificate, another address) never pushes the genuine node out.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use gorgo_core::{NodeId, QueueStats};

const NAMES: [&str; 3] = ["n0", "n1", "n2"];
// Every node here takes generation 0 (`seeded_spec`): the simulated wall clock, so a
// restart takes a newer generation, as a real one does.

/// What the restarted node's peers must hold of it: the stats and the summary of
/// the run that is alive now.
fn holds_current_run(handles: &Handles, running: u32) -> bool {
    let h = handles.lock();
    let Some(n1) = h.get("n1") else {
        return false;
    };
    let (version, len) = (n1.local_summary().version(), n1.local_summary().len());
    let id = NodeId::from("n1");
    ["n0", "n2"].iter().all(|o| {
        h[*o].peers().iter().any(|p| {
            p.id == id
                && p.alive
                && p.generation == n1.identity().generation
                && p.incarnation == Some(n1.incarnation())
                && p.stats.as_ref().is_some_and(|s| s.running == running)
                && p.summary_version == Some(version)
                && p.summary_len == len
        })
    })
}

/// What every node is and holds, for failure messages.
fn dump(handles: &Handles) -> String {
    let h = handles.lock();
    h.iter()
        .map(|(name, n)| {
            format!(
                "{name} is {:?} (run {}) at summary {}, holds {:?}",
                n.identity(),
                n.incarnation(),
                n.local_summary().version(),
                n.peers()
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn a_restarted_node_replaces_its_previous_run_at_once() {
    let mut sim = sim(61, Duration::from_secs(120));
    let creds = credentials(&NAMES);
    let handles = Handles::default();
    for i in [0, 2] {
        add_node(&mut sim, seeded_spec(&NAMES, i, &creds, 0), handles.clone());
    }
    // n1: its first run publishes stats every 10 ms (so its stats versions run far
    // ahead) with 4 running; the restarted run every 100 ms with 0 running. Each run
    // has its own summary.
    let runs = Arc::new(AtomicU32::new(0));
    {
        let s = seeded_spec(&NAMES, 1, &creds, 0);
        let handles = handles.clone();
        let runs = runs.clone();
        sim.host("n1", move || {
            let s = s.clone();
            let handles = handles.clone();
            let run = runs.fetch_add(1, Ordering::SeqCst);
            async move {
                let (h, summary) = start_node(&s).await?;
                handles.lock().insert(s.name.clone(), h.clone());
                let (base, n) = if run == 0 { (1, 50) } else { (1_000, 7) };
                summary.update(|sm| {
                    for fp in base..base + n {
                        sm.record_add(fp);
                    }
                });
                let (every, running) = if run == 0 { (10, 4) } else { (100, 0) };
                let mut tick = tokio::time::interval(Duration::from_millis(every));
                loop {
                    tick.tick().await;
                    h.broadcast_stats(QueueStats {
                        running,
                        ..Default::default()
                    })?;
                }
            }
        });
    }
    set_wan_latencies(&mut sim, &NAMES);
    converge(&mut sim, &handles, &NAMES);
    let first = run_until(&mut sim, Duration::from_secs(10), |_| {
        holds_current_run(&handles, 4)
    });
    assert!(
        first.is_some(),
        "the first run's stats and summary reach its peers: {}",
        dump(&handles)
    );
    // Let its stats versions run well ahead of what the restarted run will reach.
    run_for(&mut sim, Duration::from_secs(8));

    // kill -9 and restart with the same config. Drop the test's handle first: it owns
    // the old endpoint and so its socket's port.
    handles.lock().remove("n1");
    let restarted_at = sim.elapsed();
    sim.bounce("n1");
    let replaced = run_until(&mut sim, Duration::from_secs(10), |_| {
        holds_current_run(&handles, 0)
    });
    let replaced = replaced.unwrap_or_else(|| {
        panic!(
            "peers do not hold the restarted run's stats and summary: {}",
            dump(&handles)
        )
    });
    let took = replaced - restarted_at;
    eprintln!("restarted run's state everywhere after {took:?}");
    // Within a few gossip rounds and one-way delays, not after the old run's stats
    // versions are overtaken (that would take 80 s here).
    assert!(took < Duration::from_secs(3), "took {took:?}");
    // And what the old run said never comes back.
    let reverted = run_until(&mut sim, Duration::from_secs(10), |_| {
        !holds_current_run(&handles, 0)
    });
    assert!(
        reverted.is_none(),
        "the old run's state returned at {reverted:?}"
    );
}

/// One peer's view of `id`, as `viewer` holds it.
fn view_of(handles: &Handles, viewer: &str, id: &str) -> Option<gorgo_cluster::PeerView> {
    handles.lock()[viewer]
        .peers()
        .into_iter()
        .find(|p| p.id.0 == id)
}

/// Everything the genuine n1 must keep while an impostor runs and after it is gone:
/// alive at its own address and region in every view, at its WAN RTT, and never
/// listed among its own peers. `None` when all holds.
fn genuine_n1_violation(handles: &Handles, n1_addr: SocketAddr) -> Option<String> {
    for (viewer, one_way) in [("n0", one_way_ms(0, 1)), ("n2", one_way_ms(1, 2))] {
        let Some(v) = view_of(handles, viewer, "n1") else {
            return Some(format!("{viewer} does not know n1"));
        };
        if !v.alive || v.addr != n1_addr || v.region != "region-1" {
            return Some(format!("{viewer} sees n1 as {v:?}"));
        }
        // Links to the genuine n1 are 45 ms or more one way; the impostor is 1 ms away.
        if v.rtt_ms.is_some_and(|r| r < one_way as f64) {
            return Some(format!("{viewer} measures n1 at {:?} ms", v.rtt_ms));
        }
    }
    let own = handles.lock()["n1"].peers();
    if own.iter().any(|p| p.id.0 == "n1") {
        return Some(format!("n1 lists itself among its peers: {own:?}"));
    }
    None
}

#[test]
fn an_impostor_with_the_same_id_never_pushes_the_genuine_node_out() {
    let mut sim = sim(67, Duration::from_secs(120));
    let creds = credentials(&NAMES);
    let handles = Handles::default();
    converged_cluster(&mut sim, &NAMES, &creds, 0, &handles);
    run_for(&mut sim, Duration::from_secs(2));
    let n1_addr = handles.lock()["n1"].identity().addr;
    assert_eq!(genuine_n1_violation(&handles, n1_addr), None);

    // A second process with n1's certificate and id, another region name and its own
    // address, 1 ms from everyone, joining through n0 and n2.
    let impostor = Handles::default();
    {
        let mut s = seeded_spec(&NAMES, 1, &creds, 0);
        s.name = "imp".to_owned();
        s.region = "elsewhere".to_owned();
        s.seeds = vec!["n0".to_owned(), "n2".to_owned()];
        let impostor = impostor.clone();
        sim.host("imp", move || {
            let s = s.clone();
            let impostor = impostor.clone();
            async move {
                let (h, _) = start_node_with(&s, |c| c.node_id = NodeId::from("n1")).await?;
                impostor.lock().insert("imp".to_owned(), h.clone());
                let mut tick = tokio::time::interval(Duration::from_millis(100));
                loop {
                    tick.tick().await;
                    h.broadcast_stats(QueueStats {
                        running: 99,
                        ..Default::default()
                    })?;
                }
            }
        });
    }
    genuine_n1_kept(
        &mut sim,
        &handles,
        n1_addr,
        Duration::from_secs(23),
        "while the impostor runs",
    );
    for viewer in ["n0", "n2"] {
        let stats = view_of(&handles, viewer, "n1").and_then(|v| v.stats);
        assert!(
            stats.is_none_or(|s| s.running != 99),
            "{viewer} holds the impostor's stats"
        );
        // Refused, and counted where it was refused.
        let conflicts = handles.lock()[viewer]
            .metrics()
            .identity_conflicts
            .load(Ordering::Relaxed);
        assert!(conflicts > 0, "{viewer} counted no identity conflict");
    }
    // The impostor got nowhere: nobody answered it.
    assert!(
        impostor.lock()["imp"].alive_peers().is_empty(),
        "the impostor sees {:?}",
        impostor.lock()["imp"].peers()
    );
    sim.crash("imp");
    genuine_n1_kept(
        &mut sim,
        &handles,
        n1_addr,
        Duration::from_secs(20),
        "after the impostor died",
    );
}

/// Run `for_` of simulated time, failing the test the first moment the genuine n1 is
/// not kept ([`genuine_n1_violation`]).
fn genuine_n1_kept(
    sim: &mut turmoil::Sim<'_>,
    handles: &Handles,
    n1_addr: SocketAddr,
    for_: Duration,
    phase: &str,
) {
    let broken = run_until(sim, for_, |_| {
        genuine_n1_violation(handles, n1_addr).is_some()
    });
    assert!(
        broken.is_none(),
        "{phase}, at {broken:?}: {:?}",
        genuine_n1_violation(handles, n1_addr)
    );
}
