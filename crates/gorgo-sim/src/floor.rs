//! The latency floor of a workload: what no routing policy can beat.
//!
//! A ratio to the best baseline says how much better a policy is; it does not say how
//! much better any policy *could* be. At light load every cache-keeping policy serves
//! nearly every request at once, and the p95 is the prefill of the longest prompts
//! nobody has seen before: a bar like "0.85x the best baseline's p95" can then lie
//! below what physics allows. The floor makes that checkable (docs/policy.md, "The
//! floor").
//!
//! Each request's floor is its TTFT and E2E on the fastest engine of the topology with
//! every advantage at once: an unbounded prefix cache shared by every engine, holding
//! every block of every request that arrived before it; no queue and nothing else in
//! the batch; no network (neither the client's link nor a forward). The engine model's
//! own costs price it ([`Profile::idle_ttft_ms`] for the prefill, one
//! [`Profile::decode_step_ms`] at batch 1 per further token), and the prompt is built
//! by the event loop's own function. Every term only grows in the real run (a batch or
//! a queue only adds, a finite or a remote cache only misses more, a link only adds
//! delay), so each simulated request is at least its floor, and so is each percentile
//! over the same requests (`floor_is_below_every_request_of_every_policy` checks it).

use gorgo_core::sketch::summarize;
use gorgo_engine::Profile;
use gorgo_report::LatencyFloor;
use gorgo_workload::{TraceRequest, WorkloadError};
use std::collections::HashSet;

use crate::sim::{prompt, SimConfig};
use crate::Result;

/// One request's floor, by trace index.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestFloor {
    /// The request's index in the trace (as in [`crate::Row::index`]).
    pub index: u64,
    /// Lowest possible time to first token, ms.
    pub ttft_ms: f64,
    /// Lowest possible end-to-end latency, ms.
    pub e2e_ms: f64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens an unbounded shared cache would hold.
    pub cached_tokens: u64,
}

/// Every request's floor, in trace order. Reads the trace as the simulator does
/// (`max_requests`, `max_context_tokens`, `live_chains` apply); a request may use the
/// blocks of every request that arrived strictly earlier (a request arriving at the
/// same instant has not computed anything yet). Rows out of time order count as
/// arriving with the latest row before them, as the event loop sends them.
pub fn request_floors<I>(cfg: &SimConfig, trace: I) -> Result<Vec<RequestFloor>>
where
    I: IntoIterator<Item = std::result::Result<TraceRequest, WorkloadError>>,
{
    cfg.validate()?;
    let mut seen: HashSet<u64> = HashSet::new();
    // Blocks of the requests arriving at `now`: usable from the next instant on.
    let mut arriving: Vec<u64> = Vec::new();
    let mut now: Option<u64> = None;
    let mut out = Vec::new();
    for (index, row) in trace.into_iter().enumerate() {
        if cfg.max_requests.is_some_and(|m| index as u64 >= m) {
            break;
        }
        let mut row = row?;
        let at = now.map_or(row.timestamp_ms, |t| t.max(row.timestamp_ms));
        if now != Some(at) {
            seen.extend(arriving.drain(..));
            now = Some(at);
        }
        let (chain, prompt_tokens) = prompt(cfg, &mut row);
        let matched = chain.hashes.iter().take_while(|h| seen.contains(h)).count();
        // A fully cached prompt still computes its last token, as the engine does.
        let cached = chain.prefix_tokens(matched).min(prompt_tokens - 1);
        arriving.extend_from_slice(&chain.hashes);
        let output = u64::from(row.output_tokens.max(1));
        let (ttft_ms, e2e_ms) = cfg
            .profiles
            .iter()
            .map(|p| request_floor(p, prompt_tokens, cached, output))
            .fold((f64::INFINITY, f64::INFINITY), |(t, e), (pt, pe)| {
                (t.min(pt), e.min(pe))
            });
        out.push(RequestFloor {
            index: index as u64,
            ttft_ms,
            e2e_ms,
            prompt_tokens,
            cached_tokens: cached,
        });
    }
    Ok(out)
}

/// TTFT and E2E of one request alone on an idle engine of `profile` with `cached`
/// of its `prompt` tokens already cached: the engine model's iteration costs, one
/// prefill chunk after another, then one decode step at batch 1 per further token
/// (its context growing by one each step, as the engine counts it).
fn request_floor(profile: &Profile, prompt: u64, cached: u64, output: u64) -> (f64, f64) {
    let ttft = profile.idle_ttft_ms(prompt - cached);
    let steps = output - 1;
    // Sum over generated = 1..=steps of decode_step_ms(1, prompt + generated).
    let per_step = profile.decode_step_ms(1, 0);
    let context = steps as f64 * prompt as f64 + (steps * (steps + 1) / 2) as f64;
    let decode = steps as f64 * per_step + profile.per_ctx_token_ms * context;
    (ttft, ttft + decode)
}

/// The floor's aggregates over `floors`: what `gorgo sim` writes to `sim.json` and
/// `gorgo sweep` beside every load.
pub fn summarize_floors(floors: &[RequestFloor]) -> LatencyFloor {
    let mut ttft: Vec<f64> = floors.iter().map(|f| f.ttft_ms).collect();
    let mut e2e: Vec<f64> = floors.iter().map(|f| f.e2e_ms).collect();
    let prompt: u64 = floors.iter().map(|f| f.prompt_tokens).sum();
    let cached: u64 = floors.iter().map(|f| f.cached_tokens).sum();
    LatencyFloor {
        requests: floors.len() as u64,
        ttft_ms: summarize(&mut ttft),
        e2e_ms: summarize(&mut e2e),
        cache_hit_ratio: (prompt > 0).then(|| cached as f64 / prompt as f64),
    }
}

/// [`request_floors`] summarised: the workload's floor.
pub fn latency_floor<I>(cfg: &SimConfig, trace: I) -> Result<LatencyFloor>
where
    I: IntoIterator<Item = std::result::Result<TraceRequest, WorkloadError>>,
{
    Ok(summarize_floors(&request_floors(cfg, trace)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_alone_costs_the_engine_models_iterations() {
        let p = Profile::by_name("paper-a100-mistral7b").unwrap();
        let (ttft, e2e) = request_floor(&p, 1000, 0, 1);
        assert_eq!(ttft, p.idle_ttft_ms(1000));
        assert_eq!(e2e, ttft);
        let (ttft, e2e) = request_floor(&p, 1000, 400, 3);
        assert_eq!(ttft, p.idle_ttft_ms(600));
        let decode = p.decode_step_ms(1, 1001) + p.decode_step_ms(1, 1002);
        assert!((e2e - ttft - decode).abs() < 1e-9, "{e2e} {ttft} {decode}");
    }
}
