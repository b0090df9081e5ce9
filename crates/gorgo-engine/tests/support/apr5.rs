//! Replay of the GORGO paper's Apr 5 arrivals against three emulated engines on
//! virtual time, the way the paper's `simple-session-affinity` run was driven.
//!
//! Shared by `tests/apr5_replay.rs` (the fidelity check) and
//! `examples/apr5_replay.rs` (the comparison table in docs/engine-profiles.md).
//!
//! Rules (documented in docs/engine-profiles.md):
//! - one row per request of the `simple-session-affinity` policy: `scheduled_ms`,
//!   `input_tokens`, `output_tokens`; every prompt unique (the file has no prefixes);
//! - engine = `hash_bytes(request_id) % 3` (stands in for the paper's hash of the first
//!   256 tokens, which spreads unique prompts uniformly too);
//! - the client (the paper's proxy, in us-ashburn) keeps at most 64 requests in flight:
//!   a request leaves at `max(scheduled_ms, first free slot)`;
//! - TTFT and E2E as the proxy sees them: the engine's times plus one round trip from
//!   us-ashburn to the engine's region (5, 90, 180 ms: docs/design.md's three-region RTTs).
#![allow(dead_code)]

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use gorgo_core::hash::hash_bytes;
use gorgo_core::HashChain;
use gorgo_engine::{Engine, EngineEvent, EngineRequest, Profile};

/// One request of the trace.
#[derive(Debug, Clone)]
pub struct TraceRow {
    pub request_id: String,
    pub scheduled_ms: f64,
    pub input_tokens: u64,
    pub output_tokens: u32,
    pub ttft_ms: f64,
    pub e2e_ms: f64,
}

/// Path of the paper's per-request results.
pub fn trace_path() -> std::path::PathBuf {
    std::path::PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/data/reference/paper_apr5_requests.jsonl"
    ))
}

/// The rows of one policy, by `scheduled_ms`. `None` if the file is missing.
pub fn load(policy: &str) -> Option<Vec<TraceRow>> {
    let text = std::fs::read_to_string(trace_path()).ok()?;
    let mut rows = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).expect("trace line is JSON");
        if v["policy"] != policy {
            continue;
        }
        rows.push(TraceRow {
            request_id: v["request_id"].as_str().unwrap_or_default().to_owned(),
            scheduled_ms: v["scheduled_ms"].as_f64().unwrap_or(0.0),
            input_tokens: v["input_tokens"].as_u64().unwrap_or(1),
            output_tokens: v["output_tokens"].as_u64().unwrap_or(1) as u32,
            ttft_ms: v["ttft_ms"].as_f64().unwrap_or(f64::NAN),
            e2e_ms: v["e2e_ms"].as_f64().unwrap_or(f64::NAN),
        });
    }
    rows.sort_by(|a, b| a.scheduled_ms.total_cmp(&b.scheduled_ms));
    Some(rows)
}

/// Round trip from the proxy (us-ashburn) to each engine's region, ms.
pub const REGION_RTT_MS: [f64; 3] = [5.0, 90.0, 180.0];

/// The client's concurrency cap in the paper's run.
pub const CONCURRENCY: usize = 64;

/// What the proxy saw for one request.
#[derive(Debug, Clone, Copy, Default)]
pub struct Outcome {
    pub engine: usize,
    pub ttft_ms: f64,
    pub e2e_ms: f64,
    pub output_tokens: u32,
}

#[derive(Debug, PartialEq)]
struct Timed(f64, usize, bool); // (time, request index, is_arrival_at_engine else slot_free)

impl Eq for Timed {}
impl PartialOrd for Timed {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Timed {
    fn cmp(&self, o: &Self) -> Ordering {
        // Min-heap on time, then index.
        o.0.total_cmp(&self.0).then(o.1.cmp(&self.1))
    }
}

/// Replay `rows` on three engines of `profile`; outcomes in row order.
pub fn replay(rows: &[TraceRow], profile: &Profile) -> Vec<Outcome> {
    let mut engines: Vec<Engine> = (0..3)
        .map(|_| {
            let mut e = Engine::new(profile.clone());
            e.set_emit_decode_steps(false);
            e
        })
        .collect();
    let mut out = vec![Outcome::default(); rows.len()];
    let mut sent_at = vec![0.0f64; rows.len()];
    let mut heap = BinaryHeap::new();
    let mut next = 0usize;
    let mut in_flight = 0usize;
    let mut events = Vec::new();
    let mut last_t = 0.0f64;
    loop {
        let t_dispatch = (in_flight < CONCURRENCY && next < rows.len())
            .then(|| rows[next].scheduled_ms.max(last_t));
        let t_heap = heap.peek().map(|t: &Timed| t.0);
        let (t_engine, which) = engines
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.next_event_time().map(|t| (t, i)))
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .map_or((None, 0), |(t, i)| (Some(t), i));
        let t = [t_dispatch, t_heap, t_engine]
            .into_iter()
            .flatten()
            .min_by(|a, b| a.total_cmp(b));
        let Some(t) = t else { break };
        last_t = t;
        if Some(t) == t_dispatch {
            let i = next;
            next += 1;
            in_flight += 1;
            let engine = (hash_bytes(rows[i].request_id.as_bytes()) % 3) as usize;
            out[i].engine = engine;
            sent_at[i] = t;
            heap.push(Timed(t + REGION_RTT_MS[engine] / 2.0, i, true));
        } else if Some(t) == t_heap {
            let Timed(t, i, arrival) = heap.pop().expect("peeked");
            if arrival {
                let r = &rows[i];
                // A unique prompt: one 256-token block id per block, from the row index.
                let blocks = r.input_tokens.div_ceil(256).max(1);
                let ids: Vec<u64> = (0..blocks).map(|b| ((i as u64) << 24) | b).collect();
                let chain = HashChain::from_int_block_ids(&ids, 256, r.input_tokens);
                let req = EngineRequest {
                    id: i as u64,
                    chain,
                    prompt_tokens: r.input_tokens,
                    max_output_tokens: r.output_tokens.max(1),
                    arrival_ms: t,
                };
                engines[out[i].engine]
                    .submit(req, t)
                    .expect("trace request fits the profile");
            } else {
                in_flight -= 1;
            }
        } else {
            engines[which].step_into(t, &mut events);
            for e in events.drain(..) {
                match e {
                    EngineEvent::FirstToken { id, at_ms, .. } => {
                        let i = id as usize;
                        let rtt = REGION_RTT_MS[out[i].engine];
                        out[i].ttft_ms = at_ms + rtt / 2.0 - sent_at[i];
                    }
                    EngineEvent::Finished {
                        id,
                        at_ms,
                        output_tokens,
                    } => {
                        let i = id as usize;
                        let rtt = REGION_RTT_MS[out[i].engine];
                        out[i].e2e_ms = at_ms + rtt / 2.0 - sent_at[i];
                        out[i].output_tokens = output_tokens;
                        heap.push(Timed(at_ms + rtt / 2.0, i, false));
                    }
                    _ => {}
                }
            }
        }
    }
    out
}

/// Nearest-rank percentiles `(p50, p95)` of `values`.
pub fn p50_p95(values: &[f64]) -> (f64, f64) {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    (
        gorgo_core::percentile(&v, 50.0).unwrap_or(f64::NAN),
        gorgo_core::percentile(&v, 95.0).unwrap_or(f64::NAN),
    )
}

/// ITL per request: (E2E - TTFT) / (output - 1), for outputs over one token.
pub fn itl(ttft: &[f64], e2e: &[f64], out: &[u32]) -> Vec<f64> {
    ttft.iter()
        .zip(e2e)
        .zip(out)
        .filter(|(_, &o)| o > 1)
        .map(|((t, e), &o)| (e - t) / (o - 1) as f64)
        .collect()
}
