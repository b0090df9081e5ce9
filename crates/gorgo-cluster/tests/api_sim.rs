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
    NodeSpec {
        name: NAMES[i].to_owned(),
        region: format!("region-{i}"),
        credentials: creds[NAMES[i]].clone(),
        seeds: if i == 0 {
            vec![]
        } else {
            vec!["n0".to_owned()]
        },
        churn: None,
        generation: 1,
    }
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
