//! From trace records to replay items: rebasing, the context clamp, home-region
//! assignment and the lazy request-body builder. Which requests a run replays is
//! `gorgo_workload::select_requests`, shared with the simulator.

use std::sync::Arc;

use bytes::Bytes;
use gorgo_workload::TraceRequest;

use crate::replay::{BodyBuilder, ReplayItem};

/// Rebase timestamps so the first request arrives at 0 (a window cut from the middle
/// of a trace would otherwise start with idle time).
pub fn rebase(requests: &mut [TraceRequest]) {
    let Some(first) = requests.iter().map(|r| r.timestamp_ms).min() else {
        return;
    };
    for r in requests {
        r.timestamp_ms -= first;
    }
}

/// Shorten prompts so that prompt + output fits an engine context of `max_context`
/// tokens (the convention of [`gorgo_workload::clamp_to_context`], shared with
/// `gorgo sim`); returns how many were shortened.
pub fn clamp_context(requests: &mut [TraceRequest], max_context: u64) -> usize {
    let mut clamped = 0;
    for r in requests {
        clamped += usize::from(gorgo_workload::clamp_to_context(r, max_context));
    }
    clamped
}

/// Replay items for `requests`, each assigned its home region among `regions`.
pub fn replay_items(requests: &[TraceRequest], regions: &[String]) -> Vec<ReplayItem> {
    requests
        .iter()
        .enumerate()
        .map(|(i, r)| ReplayItem {
            request_id: r.request_id.clone().unwrap_or_else(|| format!("r{i}")),
            // The convention shared with `gorgo sim` (unsalted).
            region: regions
                .get(gorgo_workload::home_region(r, i as u64, regions, None))
                .cloned()
                .unwrap_or_default(),
            arrival_ms: r.timestamp_ms,
            input_tokens: r.input_tokens,
            output_tokens: r.output_tokens,
            session: gorgo_workload::session_id(r),
        })
        .collect()
}

/// Builds each request's OpenAI chat body when it is sent (prompts are synthesised from
/// block ids, so they never all sit in memory). `ignore_eos` asks the engine to produce
/// exactly `max_tokens` (an SGLang/vLLM extension).
pub fn body_builder(
    requests: Arc<Vec<TraceRequest>>,
    model: String,
    ignore_eos: bool,
) -> BodyBuilder {
    Arc::new(move |i| {
        let req = requests
            .get(i)
            .ok_or_else(|| format!("no request at index {i}"))?;
        let mut body = gorgo_workload::chat_body(req, &model);
        if ignore_eos {
            body["ignore_eos"] = serde_json::Value::Bool(true);
        }
        serde_json::to_vec(&body)
            .map(Bytes::from)
            .map_err(|e| e.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gorgo_workload::BlockIds;

    fn req(ts: u64, user: Option<&str>, home: Option<&str>) -> TraceRequest {
        TraceRequest {
            timestamp_ms: ts,
            input_tokens: 40,
            output_tokens: 3,
            blocks: BlockIds::Int(vec![1, 2]),
            tokens_per_block: 16,
            user: user.map(str::to_owned),
            session: None,
            home_region: home.map(str::to_owned),
            request_id: None,
            system_prompt_hash: None,
        }
    }

    #[test]
    fn items_take_the_shared_home_region() {
        let regions = vec!["a".to_owned(), "b".to_owned(), "c".to_owned()];
        let reqs: Vec<TraceRequest> = (0..30).map(|i| req(i, None, None)).collect();
        let items = replay_items(&reqs, &regions);
        for (i, (item, r)) in items.iter().zip(&reqs).enumerate() {
            let home = gorgo_workload::home_region(r, i as u64, &regions, None);
            assert_eq!(item.region, regions[home]);
        }
        assert_eq!(
            replay_items(&[req(0, None, Some("b"))], &regions)[0].region,
            "b"
        );
    }

    #[test]
    fn clamping_keeps_prompt_and_output_within_the_context() {
        let mut reqs = vec![req(0, None, None), req(1, None, None)];
        reqs[1].input_tokens = 5000;
        assert_eq!(clamp_context(&mut reqs, 1000), 1);
        assert_eq!(reqs[0].input_tokens, 40);
        assert_eq!(
            reqs[1].input_tokens,
            1000 - 3 - gorgo_workload::CHAT_TEMPLATE_TOKENS
        );
    }

    #[test]
    fn bodies_are_openai_chat_requests() {
        let mut reqs = vec![req(500, Some("u"), None), req(700, None, None)];
        rebase(&mut reqs);
        assert_eq!(reqs[0].timestamp_ms, 0);
        let items = replay_items(&reqs, &["x".to_owned()]);
        assert_eq!(items[1].arrival_ms, 200);
        assert_eq!(items[0].session.as_deref(), Some("u"));
        assert_eq!(items[1].request_id, "r1");
        let build = body_builder(Arc::new(reqs), "m".into(), true);
        let v: serde_json::Value = serde_json::from_slice(&build(0).unwrap()).unwrap();
        assert_eq!(v["max_tokens"], 3);
        assert_eq!(v["stream"], true);
        assert_eq!(v["ignore_eos"], true);
        assert_eq!(v["messages"][0]["content"].as_str().unwrap().len(), 160);
        assert!(build(7).is_err());
    }
}
