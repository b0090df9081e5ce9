//! The whole client path against the real engine emulator (in process, port 0): trace
//! records -> synthesised chat bodies -> streaming replay -> report records. Asserts
//! counts and fields only; the emulator runs on the real clock, so nothing about speed.

use std::sync::Arc;

use gorgo_bench::workload::{body_builder, replay_items};
use gorgo_bench::{replay, ClusterInfo, LoadMode, ReplayConfig};
use gorgo_workload::{BlockIds, TraceRequest};

#[tokio::test]
async fn replays_against_the_engine_emulator() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let profile = gorgo_engine::Profile::by_name("h200-dense-1.5b").unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(gorgo_engine::serve(
        listener,
        gorgo_engine::EmulatorConfig::new(profile),
        async {
            let _ = stopped.await;
        },
    ));

    // Two identical prompts, sent one after the other (closed loop, one client): the
    // second finds the first's prefix cached.
    let request = |i: u64| TraceRequest {
        timestamp_ms: i,
        input_tokens: 512,
        output_tokens: 5,
        blocks: BlockIds::Int(vec![7, 8]),
        tokens_per_block: 256,
        user: Some("u".into()),
        session: None,
        home_region: None,
        request_id: Some("same".into()),
        system_prompt_hash: None,
    };
    let requests = Arc::new(vec![request(0), request(0)]);
    let cluster = ClusterInfo::from_list(&format!("local={url}")).unwrap();
    let items = replay_items(&requests, &cluster.region_names());
    let bodies = body_builder(requests.clone(), "m".into(), true);
    let config = ReplayConfig {
        mode: LoadMode::Closed { concurrency: 1 },
        ..ReplayConfig::default()
    };
    let out = replay(&cluster, items, bodies, &config, std::future::pending())
        .await
        .unwrap();
    assert_eq!(out.outcomes.len(), 2);
    for o in &out.outcomes {
        assert!(o.ok(), "{:?}", o.measured.error);
        assert_eq!(o.output_tokens, 5);
        assert!(o.measured.ttft_ms.unwrap() <= o.measured.e2e_ms.unwrap());
        assert!(o.itl_ms().is_some());
    }
    let cached = out.outcomes[1].measured.cached_tokens.unwrap_or(0);
    assert!(cached >= 256, "second request cached {cached} tokens");

    let _ = stop.send(());
    server.await.unwrap().unwrap();
}
