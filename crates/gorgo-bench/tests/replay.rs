//! The replay engine against a tiny in-process SSE server: counts, fields and error
//! paths, never speed.

mod common;

use std::sync::Arc;

use bytes::Bytes;
use common::Server;
use gorgo_bench::{
    replay, BodyBuilder, ClusterInfo, LoadMode, ReplayConfig, ReplayItem, ReplayOutput,
};

fn item(i: usize, region: &str, out: u32) -> ReplayItem {
    ReplayItem {
        request_id: format!("r{i}"),
        region: region.to_owned(),
        arrival_ms: i as u64 * 1000,
        input_tokens: 100,
        output_tokens: out,
        session: Some(format!("s{}", i % 2)),
    }
}

fn bodies(items: &[ReplayItem]) -> BodyBuilder {
    let specs: Vec<(u32, String)> = items
        .iter()
        .map(|it| (it.output_tokens, format!("srv-{}", it.region)))
        .collect();
    Arc::new(move |i| {
        let (n, by) = &specs[i];
        Ok(Bytes::from(
            serde_json::json!({"max_tokens": n, "served_by": by, "stream": true}).to_string(),
        ))
    })
}

async fn run(cluster: &ClusterInfo, items: Vec<ReplayItem>, config: ReplayConfig) -> ReplayOutput {
    let b = bodies(&items);
    replay(cluster, items, b, &config, std::future::pending())
        .await
        .unwrap()
}

fn open_now() -> ReplayConfig {
    // Time scale 0: every request is due at once, so the test never waits on a clock.
    ReplayConfig {
        mode: LoadMode::Open { time_scale: 0.0 },
        ..ReplayConfig::default()
    }
}

#[tokio::test]
async fn open_loop_measures_every_request() {
    let (a, b) = (Server::start().await, Server::start().await);
    let cluster = ClusterInfo::from_list(&format!("us={},eu={}", a.url, b.url)).unwrap();
    let items: Vec<_> = (0..6)
        .map(|i| item(i, if i % 2 == 0 { "us" } else { "eu" }, 4))
        .collect();
    let out = run(&cluster, items, open_now()).await;
    assert_eq!(out.outcomes.len(), 6);
    assert_eq!(out.failed(), 0);
    assert!(!out.cancelled);
    for (i, o) in out.outcomes.iter().enumerate() {
        assert_eq!(o.index, i);
        assert!(o.ok(), "{:?}", o.measured.error);
        assert_eq!(o.output_tokens, 4);
        assert_eq!(o.input_tokens, 7);
        assert_eq!(o.measured.cached_tokens, Some(3));
        assert_eq!(o.measured.content_chunks, 4);
        assert_eq!(o.measured.hops, Some(1));
        assert_eq!(
            o.measured.served_by.as_deref(),
            Some(format!("srv-{}", o.region).as_str())
        );
        let (t, e) = (o.measured.ttft_ms.unwrap(), o.measured.e2e_ms.unwrap());
        assert!(t <= e);
        assert!(o.itl_ms().is_some());
        assert!(o.slip_ms >= 0.0);
    }
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn failures_are_recorded_not_raised() {
    let a = Server::start().await;
    // A port nobody listens on: bind, learn the port, close.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let cluster = ClusterInfo::from_list(&format!("us={},gone={dead}", a.url)).unwrap();
    let items = vec![
        item(0, "us", 0),
        item(1, "us", 999),
        item(2, "gone", 3),
        item(3, "us", 1),
    ];
    let out = run(&cluster, items, open_now()).await;
    assert_eq!(out.outcomes.len(), 4);
    assert_eq!(out.failed(), 3);
    let err = |i: usize| out.outcomes[i].measured.error.clone().unwrap_or_default();
    assert!(err(0).starts_with("HTTP 400"), "{}", err(0));
    assert!(err(1).contains("[DONE]"), "{}", err(1));
    assert!(err(2).starts_with("connect"), "{}", err(2));
    assert!(out.outcomes[3].ok());
    // A single-token answer has no inter-token latency.
    assert_eq!(out.outcomes[3].itl_ms(), None);
    a.stop().await;
}

#[tokio::test]
async fn closed_loop_and_limits() {
    let a = Server::start().await;
    let cluster = ClusterInfo::from_list(&format!("us={}", a.url)).unwrap();
    let items: Vec<_> = (0..9).map(|i| item(i, "us", 2)).collect();
    let config = ReplayConfig {
        mode: LoadMode::Closed { concurrency: 2 },
        max_requests: Some(5),
        ..ReplayConfig::default()
    };
    let out = run(&cluster, items, config).await;
    assert_eq!(out.outcomes.len(), 5);
    assert_eq!(out.failed(), 0);
    assert!(out.outcomes.iter().all(|o| o.slip_ms == 0.0));
    assert_eq!(
        out.outcomes.iter().map(|o| o.index).collect::<Vec<_>>(),
        vec![0, 1, 2, 3, 4]
    );

    // Open loop with a window: arrivals at 0 s, 1 s, 2 s scaled by 0.001 -> 0, 1, 2 ms;
    // a 1.5 ms window keeps the first two.
    let items: Vec<_> = (0..3).map(|i| item(i, "us", 2)).collect();
    let config = ReplayConfig {
        mode: LoadMode::Open { time_scale: 0.001 },
        duration: Some(std::time::Duration::from_micros(1500)),
        max_in_flight: Some(1),
        ..ReplayConfig::default()
    };
    let out = run(&cluster, items, config).await;
    assert_eq!(out.outcomes.len(), 2);
    a.stop().await;
}

#[tokio::test]
async fn bad_config_and_unknown_region_fail_up_front() {
    let cluster = ClusterInfo::from_list("us=http://127.0.0.1:9").unwrap();
    let items = vec![item(0, "mars", 1)];
    let b = bodies(&items);
    let err = replay(&cluster, items, b, &open_now(), std::future::pending())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("mars"));
    let config = ReplayConfig {
        mode: LoadMode::Closed { concurrency: 0 },
        ..ReplayConfig::default()
    };
    let items = vec![item(0, "us", 1)];
    let b = bodies(&items);
    let err = replay(&cluster, items, b, &config, std::future::pending())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("concurrency"));
    // A time scale that puts a request beyond any clock: an error, not a panic.
    let config = ReplayConfig {
        mode: LoadMode::Open { time_scale: 1e300 },
        ..ReplayConfig::default()
    };
    let items = vec![item(1, "us", 1)];
    let b = bodies(&items);
    let err = replay(&cluster, items, b, &config, std::future::pending())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("time_scale"), "{err}");
}

#[tokio::test]
async fn shutdown_stops_the_replay() {
    let a = Server::start().await;
    let cluster = ClusterInfo::from_list(&format!("us={}", a.url)).unwrap();
    // Arrivals an hour apart: without the shutdown this would never end.
    let items: Vec<_> = (0..3)
        .map(|i| ReplayItem {
            arrival_ms: i as u64 * 3_600_000,
            ..item(i, "us", 1)
        })
        .collect();
    let b = bodies(&items);
    let config = ReplayConfig {
        mode: LoadMode::Open { time_scale: 1.0 },
        ..ReplayConfig::default()
    };
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(async move {
        replay(&cluster, items, b, &config, async {
            let _ = rx.await;
        })
        .await
        .unwrap()
    });
    tx.send(()).unwrap();
    let out = run.await.unwrap();
    assert!(out.cancelled);
    assert!(out.outcomes.len() <= 1);
    a.stop().await;
}

#[tokio::test]
async fn a_stream_stalled_after_its_first_token_keeps_its_ttft() {
    let a = Server::start().await;
    let cluster = ClusterInfo::from_list(&format!("us={}", a.url)).unwrap();
    // 20 requests, 4 of which get a first token and then stall until the timeout.
    let items: Vec<_> = (0..20)
        .map(|i| item(i, "us", if i % 5 == 0 { 998 } else { 3 }))
        .collect();
    let config = ReplayConfig {
        request_timeout: std::time::Duration::from_secs(1),
        ..open_now()
    };
    let out = run(&cluster, items, config).await;
    assert_eq!(out.failed(), 4);
    for o in out.outcomes.iter().filter(|o| !o.ok()) {
        let err = o.measured.error.as_deref().unwrap_or_default();
        assert!(err.starts_with("timeout"), "{err}");
        assert!(o.measured.ttft_ms.is_some());
    }
    let dir = tempfile::tempdir().unwrap();
    let run = gorgo_bench::PolicyRun {
        policy: "p".into(),
        regions: vec!["us".into()],
        output: out,
        tuning: Vec::new(),
    };
    gorgo_bench::report::write_report(dir.path(), serde_json::json!({}), &[run]).unwrap();
    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("results.json")).unwrap())
            .unwrap();
    let cfg = &results["config"];
    // Every request measured its TTFT: nothing censored there. 4 of 20 did not
    // complete: E2E p95 and p99 are censored (p50 is not), at least the timeout.
    assert_eq!(cfg["censored"]["p"]["ttft_ms"]["measured"], 20);
    assert_eq!(
        cfg["censored"]["p"]["ttft_ms"]["censored"],
        serde_json::json!([])
    );
    assert_eq!(
        cfg["censored"]["p"]["e2e_ms"]["censored"],
        serde_json::json!(["p95", "p99"])
    );
    let e2e_p95 = results["policies"]["p"]["e2e_ms"]["p95"].as_f64().unwrap();
    assert!(e2e_p95 >= 1000.0, "{e2e_p95}");
    assert_eq!(cfg["failures"]["p"]["timeouts"], 4);
    assert_eq!(cfg["failures"]["p"]["failed_share"], 0.2);
    assert_eq!(cfg["sim_comparable"], true);
}

#[tokio::test]
async fn an_endless_error_body_is_read_up_to_the_cap() {
    let a = Server::start().await;
    let cluster = ClusterInfo::from_list(&format!("us={}", a.url)).unwrap();
    let config = ReplayConfig {
        // What an unbounded read would end with instead.
        request_timeout: std::time::Duration::from_secs(30),
        ..open_now()
    };
    let out = run(&cluster, vec![item(0, "us", 997)], config).await;
    let err = out.outcomes[0].measured.error.clone().unwrap_or_default();
    assert!(
        err.starts_with("HTTP 500: xxx"),
        "{}",
        &err[..err.len().min(80)]
    );
    assert!(err.len() <= "HTTP 500: ".len() + 512, "{}", err.len());
}

/// A body that keeps sending after `[DONE]` (keep-alive comments) is drained for the
/// grace in all, not per chunk: the request ends, and its closed-loop worker takes the
/// next, instead of both waiting out the request timeout.
#[tokio::test]
async fn a_body_that_keeps_talking_after_done_is_let_go() {
    let a = Server::start().await;
    let cluster = ClusterInfo::from_list(&format!("us={}", a.url)).unwrap();
    let config = ReplayConfig {
        mode: LoadMode::Closed { concurrency: 1 },
        request_timeout: std::time::Duration::from_secs(600),
        ..ReplayConfig::default()
    };
    let items = vec![item(0, "us", 995), item(1, "us", 2)];
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        run(&cluster, items, config),
    )
    .await
    .expect("the replay ends long before the request timeout");
    assert_eq!(out.outcomes.len(), 2);
    assert_eq!(out.failed(), 0);
    a.stop().await;
}

#[tokio::test]
async fn a_body_held_open_after_done_still_completes() {
    let a = Server::start().await;
    let cluster = ClusterInfo::from_list(&format!("us={}", a.url)).unwrap();
    let config = ReplayConfig {
        // Past the drain's grace: reading to the end of the body would time out.
        request_timeout: std::time::Duration::from_secs(3),
        ..open_now()
    };
    let out = run(&cluster, vec![item(0, "us", 996)], config).await;
    let o = &out.outcomes[0];
    assert!(o.ok(), "{:?}", o.measured.error);
    assert!(o.measured.e2e_ms.unwrap() >= o.measured.ttft_ms.unwrap());
}

/// An open-loop request's body is built before its send time, while the dispatcher
/// waits: a burst's bodies are all ready when it falls due. Built at the send time,
/// `compare`'s replays (every policy's in one task, in list order) delayed each
/// policy's burst by the bodies of the policies listed before it.
#[tokio::test]
async fn bodies_are_built_before_their_send_time() {
    let server = Server::start().await;
    let cluster = ClusterInfo::from_list(&format!("us={}", server.url)).unwrap();
    let items: Vec<_> = [0, 300, 300, 300]
        .iter()
        .enumerate()
        .map(|(i, &at)| ReplayItem {
            arrival_ms: at,
            ..item(i, "us", 2)
        })
        .collect();
    let inner = bodies(&items);
    let built = Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = built.clone();
    let b: BodyBuilder = Arc::new(move |i| {
        record.lock().unwrap().push((i, std::time::Instant::now()));
        inner(i)
    });
    let config = ReplayConfig {
        mode: LoadMode::Open { time_scale: 1.0 },
        ..ReplayConfig::default()
    };
    let out = replay(&cluster, items, b, &config, std::future::pending())
        .await
        .unwrap();
    assert_eq!(out.failed(), 0);
    let built = built.lock().unwrap().clone();
    assert_eq!(
        built.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    // Items 1-3 are due 300 ms after the start, and item 0 was built at the start: they
    // are built long before (at send time, at least 300 ms after item 0).
    let early = built[0].1 + std::time::Duration::from_millis(150);
    for (i, at) in &built[1..] {
        assert!(
            *at < early,
            "item {i} built {:?} after item 0",
            *at - built[0].1
        );
    }
}

#[tokio::test]
async fn latency_counts_from_the_scheduled_time() {
    // A single-threaded runtime and a body builder that takes 20 ms: five requests
    // due at once go out one body after the other, each later than the last.
    let a = Server::start().await;
    let cluster = ClusterInfo::from_list(&format!("us={}", a.url)).unwrap();
    let items: Vec<_> = (0..5).map(|i| item(i, "us", 2)).collect();
    let inner = bodies(&items);
    let slow: BodyBuilder = Arc::new(move |i| {
        std::thread::sleep(std::time::Duration::from_millis(20));
        inner(i)
    });
    let out = replay(&cluster, items, slow, &open_now(), std::future::pending())
        .await
        .unwrap();
    assert_eq!(out.failed(), 0);
    let mut slips: Vec<f64> = out.outcomes.iter().map(|o| o.slip_ms).collect();
    slips.sort_by(f64::total_cmp);
    for (k, slip) in slips.iter().enumerate() {
        // The k-th to go out waited for k + 1 bodies (thread::sleep sleeps at least
        // its time; 0.5 ms for the clocks' rounding).
        assert!(*slip >= 20.0 * (k + 1) as f64 - 0.5, "{slips:?}");
    }
    for o in &out.outcomes {
        // Due at the start (time scale 0): the origin of its times.
        assert_eq!(o.start_ms, 0.0);
        let (t, e) = (o.measured.ttft_ms.unwrap(), o.measured.e2e_ms.unwrap());
        // The lateness is inside TTFT and E2E, as in the simulator.
        assert!(
            o.slip_ms <= t && t <= e,
            "slip {} ttft {t} e2e {e}",
            o.slip_ms
        );
        assert_eq!(Some(o.slip_ms), o.measured.sent_ms);
    }
    a.stop().await;
}

#[tokio::test]
async fn the_client_measures_from_the_origin_it_is_given() {
    let a = Server::start().await;
    let client = gorgo_bench::client::build_client(
        std::time::Duration::from_secs(5),
        std::time::Duration::from_secs(30),
    )
    .unwrap();
    let origin = std::time::Instant::now()
        .checked_sub(std::time::Duration::from_millis(50))
        .unwrap();
    let body = Bytes::from(r#"{"max_tokens":2}"#);
    let url = format!("{}/v1/chat/completions", a.url);
    let stop = gorgo_bench::CancellationToken::new();
    let m = gorgo_bench::client::send_streaming(&client, &url, body, &[], origin, &stop).await;
    assert_eq!(m.error, None);
    let sent = m.sent_ms.unwrap();
    assert!(sent >= 50.0, "{sent}");
    assert!(sent <= m.first_byte_ms.unwrap());
    assert!(m.first_byte_ms.unwrap() <= m.ttft_ms.unwrap());
    assert!(m.ttft_ms.unwrap() <= m.e2e_ms.unwrap());
    a.stop().await;
}

/// A replay stopped while requests are in flight keeps what every request measured:
/// the ones done (a closed-loop worker's whole list was lost when its task was
/// aborted) and the ones in flight, as failed ("cancelled") at the time they had taken.
#[tokio::test]
async fn a_stopped_replay_keeps_what_finished_and_what_was_in_flight() {
    let a = Server::start().await;
    let cluster = ClusterInfo::from_list(&format!("us={}", a.url)).unwrap();
    // Four that complete, then two that stall after a first token, then more.
    let items: Vec<_> = (0..10)
        .map(|i| item(i, "us", if i == 4 || i == 5 { 998 } else { 2 }))
        .collect();
    let inner = bodies(&items);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let tx = std::sync::Mutex::new(Some(tx));
    // The stop comes once the second stalling request is being sent: both workers
    // are then held by a stall.
    let b: BodyBuilder = Arc::new(move |i| {
        if i == 5 {
            if let Some(tx) = tx.lock().unwrap().take() {
                let _ = tx.send(());
            }
        }
        inner(i)
    });
    let config = ReplayConfig {
        mode: LoadMode::Closed { concurrency: 2 },
        ..ReplayConfig::default()
    };
    let out = replay(&cluster, items, b, &config, async {
        let _ = rx.await;
    })
    .await
    .unwrap();
    assert!(out.cancelled);
    let indices: Vec<usize> = out.outcomes.iter().map(|o| o.index).collect();
    assert_eq!(indices, [0, 1, 2, 3, 4, 5]);
    assert_eq!(out.failed(), 2);
    for o in out.outcomes.iter().filter(|o| !o.ok()) {
        let err = o.measured.error.as_deref().unwrap_or_default();
        assert!(err.starts_with("cancelled"), "{err}");
        assert!(o.measured.e2e_ms.is_some_and(|v| v >= 0.0));
    }
    a.stop().await;
}

/// An open-loop request stopped in flight keeps its send slip: how late it went out,
/// not how long it had been in flight when the stop came.
#[tokio::test]
async fn a_request_stopped_in_flight_keeps_its_send_slip() {
    let a = Server::start().await;
    let cluster = ClusterInfo::from_list(&format!("us={}", a.url)).unwrap();
    // A first token, then a stall: in flight until the stop, which comes once the
    // server has the request.
    let items = vec![item(0, "us", 998)];
    let b = bodies(&items);
    let out = replay(&cluster, items, b, &open_now(), a.received_at_least(1))
        .await
        .unwrap();
    assert!(out.cancelled);
    let o = &out.outcomes[0];
    let err = o.measured.error.as_deref().unwrap_or_default();
    assert!(err.starts_with("cancelled"), "{err}");
    assert_eq!(o.measured.sent_ms, Some(o.slip_ms), "{o:?}");
    assert!(o.slip_ms <= o.measured.e2e_ms.unwrap());
    assert_eq!(o.start_ms, 0.0);
    a.stop().await;
}

/// A capped open loop stopped while requests wait for a slot records those already
/// due as never sent, at their due time, instead of dropping them: they are the most
/// delayed requests of the run. Those not yet due are not part of it.
#[tokio::test]
async fn a_stopped_capped_open_loop_records_the_requests_it_never_sent() {
    let a = Server::start().await;
    let cluster = ClusterInfo::from_list(&format!("us={}", a.url)).unwrap();
    // Three due at the start, one an hour later; one slot, held by the first (a
    // stall) until the stop, which comes once the server has it.
    let items: Vec<_> = (0..4)
        .map(|i| ReplayItem {
            arrival_ms: if i == 3 { 3_600_000 } else { 0 },
            ..item(i, "us", if i == 0 { 998 } else { 2 })
        })
        .collect();
    let b = bodies(&items);
    let config = ReplayConfig {
        mode: LoadMode::Open { time_scale: 1.0 },
        max_in_flight: Some(1),
        ..ReplayConfig::default()
    };
    let out = replay(&cluster, items, b, &config, a.received_at_least(1))
        .await
        .unwrap();
    assert!(out.cancelled);
    let indices: Vec<usize> = out.outcomes.iter().map(|o| o.index).collect();
    assert_eq!(indices, [0, 1, 2]);
    assert_eq!(out.failed(), 3);
    assert!(out.outcomes[0].measured.sent_ms.is_some());
    for o in &out.outcomes[1..] {
        let err = o.measured.error.as_deref().unwrap_or_default();
        assert!(err.starts_with("cancelled"), "{err}");
        assert_eq!(o.measured.sent_ms, None);
        assert_eq!(o.measured.ttft_ms, None);
        assert_eq!(o.start_ms, 0.0);
        // As late as it got: until the stop.
        assert_eq!(Some(o.slip_ms), o.measured.e2e_ms);
    }
    // One request was sent in all.
    assert_eq!(*a.received.borrow(), 1);
    a.stop().await;
}
