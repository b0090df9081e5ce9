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
//! delay), so each simulated request is at least its floor. One interaction is
//! counted, because bursty traces are made of it: requests arriving at the same
//! instant share the cluster's prefill capacity (`burst_floor`); that bound holds
//! for a burst's sorted TTFTs rather than for each request. Either way each percentile
//! over the run is at least the floor's (`floor_is_below_every_request_of_every_policy`
//! checks both).
//!
//! The cache bound is not the cache the TTFT floor prices. The TTFT floor prices the
//! blocks of earlier arrivals as cached; but an engine caches each block as soon as a
//! prefill chunk computes it, and admits a waiting request only when a prefill batch has
//! room, so a request may also find blocks that a request arriving at the same instant
//! computed first (its TTFT floor still holds: that prefill ran after their common
//! arrival). Each request's cache bound (`cache_bound_tokens`) therefore counts the
//! blocks of every request that arrived at or before it; the run's bound
//! ([`summarize_floors`]) counts a block first computed within a burst for every request
//! of the burst that holds it but one, since one of them computes it. The run's bound
//! holds in any order of service; a request's own does not hold for a forward, which
//! reaches its engine after requests that arrived later may have computed its blocks
//! there (those then found fewer than their own bound).
//!
//! A request no engine of the topology admits (over every context length or KV
//! capacity, [`Profile::refusal`]) fails in every policy, and the policies' percentiles
//! count completed requests only: the floor's aggregates leave it out too, or a trace
//! with refused prompts would put the floor above every policy. It caches nothing
//! either, as no engine ever computes it.

use gorgo_core::sketch::summarize;
use gorgo_engine::Profile;
use gorgo_report::LatencyFloor;
use gorgo_workload::{TraceRequest, WorkloadError};
use std::collections::{HashMap, HashSet};

use crate::sim::{prompt, SimConfig};
use crate::Result;

/// One request's floor, by trace index.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestFloor {
    /// The request's index in the trace (as in [`crate::Row::index`]).
    pub index: u64,
    /// When it arrived, trace ms: requests with the same arrival are one burst.
    pub arrival_ms: u64,
    /// Its TTFT floor, ms: alone on an engine, raised within a burst to the burst's
    /// bound for its rank (a bound on the burst's sorted TTFTs, see `burst_floor`).
    pub ttft_ms: f64,
    /// Lowest possible end-to-end latency, ms.
    pub e2e_ms: f64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens an unbounded shared cache holds when it arrives (blocks of every
    /// request that arrived strictly earlier; all of the prompt but its last token at
    /// most): what its TTFT floor prices as cached, the rest it prefills.
    pub cached_tokens: u64,
    /// The most prompt tokens its engine can report cached: `cached_tokens`' blocks and
    /// those of the requests arriving at the same instant (an engine may admit a
    /// burst-mate first and reuse the blocks it computed), all but its last token at
    /// most. What `floor_is_below_every_request_of_every_policy` holds every request
    /// of its trace to. Not a bound for every request of every run: a forward reaches
    /// its engine a link's delay after it arrived, and may find there the blocks of a
    /// request that arrived after it and reached the engine first. That request
    /// computed them itself, so the run's bound ([`summarize_floors`]), which counts
    /// each block's first computation once whoever makes it, still holds.
    pub cache_bound_tokens: u64,
    /// Its part of the run's cache bound ([`summarize_floors`]): `cached_tokens`, plus
    /// the tokens of its blocks that an earlier request of its burst (in trace order)
    /// also holds. A block first computed within a burst is computed by at least one of
    /// the requests holding it, so the parts sum to a bound on the cached tokens of the
    /// burst, where the requests' own bounds would count such a block for each of them.
    /// Not a bound for this request alone.
    pub cache_share_tokens: u64,
    /// False when no engine of the topology admits the request ([`Profile::refusal`]):
    /// every policy fails it, so [`summarize_floors`] leaves it out, as the policies'
    /// percentiles do. Its floor is then priced on the fastest engine regardless, for
    /// the record.
    pub servable: bool,
}

/// Every request's floor, in trace order. Reads the trace as the simulator does
/// (`max_requests`, `max_context_tokens`, `live_chains` apply); a request's TTFT floor
/// uses the blocks of every request that arrived strictly earlier (one arriving at the
/// same instant has computed nothing yet when it arrives), its cache bound those of the
/// requests arriving at the same instant too ([`RequestFloor::cache_bound_tokens`]).
/// Rows out of time order count as arriving with the latest row before them, as the
/// event loop sends them.
///
/// Requests that arrive at the same instant (a burst) also share the engines: see
/// `burst_floor`.
pub fn request_floors<I>(cfg: &SimConfig, trace: I) -> Result<Vec<RequestFloor>>
where
    I: IntoIterator<Item = std::result::Result<TraceRequest, WorkloadError>>,
{
    cfg.validate()?;
    let capacity = Capacity::of(cfg);
    let mut seen: HashSet<u64> = HashSet::new();
    // The requests arriving at `now` and their uncached blocks: usable by others from
    // the next instant on.
    let mut burst = Burst::default();
    let mut now: Option<u64> = None;
    let mut out: Vec<RequestFloor> = Vec::new();
    for (index, row) in trace.into_iter().enumerate() {
        if cfg.max_requests.is_some_and(|m| index as u64 >= m) {
            break;
        }
        let mut row = row?;
        let at = now.map_or(row.timestamp_ms, |t| t.max(row.timestamp_ms));
        if now != Some(at) {
            burst.close(&capacity, &mut out, &mut seen);
            now = Some(at);
        }
        let (chain, prompt_tokens) = prompt(cfg, &mut row);
        let matched = chain.hashes.iter().take_while(|h| seen.contains(h)).count();
        // A fully cached prompt still computes its last token, as the engine does.
        let cached = chain.prefix_tokens(matched).min(prompt_tokens - 1);
        let output = u64::from(row.output_tokens.max(1));
        // Only the engines that admit it can serve it; none: it fails everywhere.
        let admits = |p: &&Profile| p.refusal(prompt_tokens, output).is_none();
        let servable = cfg.profiles.iter().any(|p| admits(&p));
        let (ttft_ms, e2e_ms) = cfg
            .profiles
            .iter()
            .filter(|p| !servable || admits(p))
            .map(|p| request_floor(p, prompt_tokens, cached, output))
            .fold((f64::INFINITY, f64::INFINITY), |(t, e), (pt, pe)| {
                (t.min(pt), e.min(pe))
            });
        out.push(RequestFloor {
            index: index as u64,
            arrival_ms: at,
            ttft_ms,
            e2e_ms,
            prompt_tokens,
            cached_tokens: cached,
            // Raised when its burst closes, by the blocks of its burst-mates.
            cache_bound_tokens: cached,
            cache_share_tokens: cached,
            servable,
        });
        if !servable {
            // Refused everywhere: it takes no prefill capacity and caches nothing.
            continue;
        }
        burst.members.push(Member {
            at: out.len() - 1,
            blocks: chain.hashes[matched..]
                .iter()
                .copied()
                .zip(chain.block_tokens[matched..].iter().map(|&t| u64::from(t)))
                .collect(),
            // Tokens past the chain are computed but never cached: its own.
            tail_tokens: prompt_tokens.saturating_sub(chain.total_tokens()),
        });
    }
    burst.close(&capacity, &mut out, &mut seen);
    Ok(out)
}

/// The requests of one arrival instant, while it is read.
#[derive(Default)]
struct Burst {
    members: Vec<Member>,
}

/// One request of a [`Burst`].
struct Member {
    /// Its place in the output.
    at: usize,
    /// Its blocks no earlier request had: (hash, tokens).
    blocks: Vec<(u64, u64)>,
    /// Its tokens past its chain.
    tail_tokens: u64,
}

impl Burst {
    /// The burst is complete: raise its floors ([`burst_floor`]) and cache bounds
    /// ([`burst_cache_bounds`]), and make its blocks cached for every later request.
    fn close(&mut self, capacity: &Capacity, out: &mut [RequestFloor], seen: &mut HashSet<u64>) {
        burst_floor(capacity, &self.members, out);
        burst_cache_bounds(&self.members, out);
        for m in self.members.drain(..) {
            seen.extend(m.blocks.iter().map(|&(h, _)| h));
        }
    }
}

/// What the whole cluster can prefill at best: its engines, and the smallest costs of
/// any of them (one engine's slowness never lowers the bound).
struct Capacity {
    engines: f64,
    overhead_ms: f64,
    prefill_base_ms: f64,
    t_p_ms: f64,
}

impl Capacity {
    fn of(cfg: &SimConfig) -> Self {
        let min = |f: fn(&Profile) -> f64| cfg.profiles.iter().map(f).fold(f64::INFINITY, f64::min);
        Capacity {
            engines: (cfg.profiles.len() * cfg.replicas) as f64,
            overhead_ms: min(|p| p.request_overhead_ms),
            prefill_base_ms: min(|p| p.prefill_base_ms),
            t_p_ms: min(|p| p.t_p_ms_per_token),
        }
    }
}

/// Raise the TTFT floors of one burst (requests arriving at the same instant) by
/// what the engines can do together. The k requests of the burst that get their first
/// token first need at least their own private tokens prefilled (the uncached tokens
/// of blocks no other request of the burst has, so no other request can compute them
/// for it), and no set of k has fewer than the k smallest private counts; at best
/// every engine of the cluster shares that work. So the k-th first token of the burst
/// comes no sooner than the request overhead, one prefill iteration and `t_p` x the k
/// smallest private counts / engines after the burst arrived (a batch shares the
/// iteration's fixed cost, never the per-token one).
///
/// This bounds the burst's order statistics, not one named request (the engines may
/// serve the longest prompt first): the k-th floor of the burst, ordered by uncached
/// tokens, becomes the larger of its own and the k-th bound. Both grow with k, so the
/// sorted floors are exactly the larger of the two sorted bounds, each sorted TTFT of
/// a burst is at least its sorted floor, and so is every percentile over the run. A
/// request's own floor stays at least its alone-on-an-engine floor. E2E floors stay
/// those of a request alone: a burst's order in first tokens says nothing of its order
/// in last tokens.
fn burst_floor(capacity: &Capacity, members: &[Member], out: &mut [RequestFloor]) {
    if members.len() < 2 {
        return;
    }
    let mut holders: HashMap<u64, u32> = HashMap::new();
    for m in members {
        for &(h, _) in &m.blocks {
            *holders.entry(h).or_default() += 1;
        }
    }
    let mut private: Vec<u64> = members
        .iter()
        .map(|m| {
            let own: u64 = m
                .blocks
                .iter()
                .filter(|(h, _)| holders[h] == 1)
                .map(|&(_, t)| t)
                .sum();
            let f = &out[m.at];
            (own + m.tail_tokens).min(f.prompt_tokens - f.cached_tokens)
        })
        .collect();
    private.sort_unstable();
    let mut by_uncached: Vec<usize> = members.iter().map(|m| m.at).collect();
    by_uncached.sort_by_key(|&i| (out[i].prompt_tokens - out[i].cached_tokens, i));
    let mut work_tokens = 0u64;
    for (i, own) in by_uncached.into_iter().zip(private) {
        work_tokens += own;
        let shared = capacity.overhead_ms
            + capacity.prefill_base_ms
            + capacity.t_p_ms * work_tokens as f64 / capacity.engines;
        out[i].ttft_ms = out[i].ttft_ms.max(shared);
    }
}

/// Raise the cache bounds of one burst by the blocks its requests share. A request's
/// engine may have computed, before admitting it, a block that a burst-mate holds (the
/// mate admitted first: the engine caches a block as soon as a prefill chunk computes
/// it), so its own bound counts the leading blocks some burst-mate also holds. Across
/// the burst one of the requests holding a block computes it: its part of the run's
/// bound counts the blocks an earlier request of the burst holds (trace order; any
/// order gives the same sum).
fn burst_cache_bounds(members: &[Member], out: &mut [RequestFloor]) {
    if members.len() < 2 {
        return;
    }
    // Per block first computed in this burst: how many of its requests hold it.
    let mut holders: HashMap<u64, u32> = HashMap::new();
    for m in members {
        for &(h, _) in &m.blocks {
            *holders.entry(h).or_default() += 1;
        }
    }
    let mut before: HashSet<u64> = HashSet::new();
    for m in members {
        let f = &mut out[m.at];
        // The blocks past those of earlier arrivals, while a burst-mate holds them:
        // one chain, so a block shared means its whole prefix is.
        let shared: u64 = m
            .blocks
            .iter()
            .take_while(|(h, _)| holders[h] > 1)
            .map(|&(_, t)| t)
            .sum();
        f.cache_bound_tokens = (f.cached_tokens + shared).min(f.prompt_tokens - 1);
        let after_earlier: u64 = m
            .blocks
            .iter()
            .filter(|(h, _)| before.contains(h))
            .map(|&(_, t)| t)
            .sum();
        f.cache_share_tokens = f.cached_tokens + after_earlier;
        before.extend(m.blocks.iter().map(|&(h, _)| h));
    }
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

/// The floor's aggregates over the servable requests of `floors` (the ones the
/// policies' percentiles and cache hit ratios can count): what `gorgo sim` writes to
/// `sim.json` and `gorgo sweep` beside every load.
pub fn summarize_floors(floors: &[RequestFloor]) -> LatencyFloor {
    let servable: Vec<&RequestFloor> = floors.iter().filter(|f| f.servable).collect();
    let mut ttft: Vec<f64> = servable.iter().map(|f| f.ttft_ms).collect();
    let mut e2e: Vec<f64> = servable.iter().map(|f| f.e2e_ms).collect();
    let prompt: u64 = servable.iter().map(|f| f.prompt_tokens).sum();
    let cached: u64 = servable.iter().map(|f| f.cache_share_tokens).sum();
    LatencyFloor {
        requests: servable.len() as u64,
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

    fn row(timestamp_ms: u64, input_tokens: u64, blocks: Vec<u64>) -> TraceRequest {
        TraceRequest {
            timestamp_ms,
            input_tokens,
            output_tokens: 1,
            blocks: gorgo_workload::BlockIds::Int(blocks),
            tokens_per_block: 512,
            user: None,
            session: None,
            home_region: None,
            request_id: None,
            system_prompt_hash: None,
        }
    }

    /// A prompt over every engine's context length fails in every policy, and the
    /// policies' p95 counts completed requests only: the floor leaves it out too, or
    /// its ~19 s prefill becomes a "floor" every policy beats. Its prompt tokens stay
    /// out of the cache bound's denominator for the same reason.
    #[test]
    fn requests_no_engine_admits_are_left_out() {
        let p = Profile::by_name("paper-a100-mistral7b").unwrap();
        let cfg = SimConfig::new(crate::Network::uniform(2, 40.0, 3.0), p.clone());
        let trace = [
            row(0, 1024, vec![1, 2]),
            row(1000, 200_000, vec![]),
            // The first prompt again: all cached but its last token.
            row(2000, 1024, vec![1, 2]),
        ];
        let floors = request_floors(&cfg, trace.iter().cloned().map(Ok)).unwrap();
        assert_eq!(floors.len(), 3, "floor.csv keeps every row");
        let servable: Vec<bool> = floors.iter().map(|f| f.servable).collect();
        assert_eq!(servable, [true, false, true]);
        let floor = latency_floor(&cfg, trace.iter().cloned().map(Ok)).unwrap();
        assert_eq!(floor.requests, 2);
        // Nearest-rank p95 of two: the slower, the uncached first prompt.
        let alone = request_floor(&p, 1024, 0, 1).0;
        assert_eq!(floor.ttft_ms.p95, alone);
        assert_eq!(floor.e2e_ms.p95, alone);
        assert_eq!(floor.cache_hit_ratio, Some(1023.0 / 2048.0));
    }

    /// Two identical prompts at the same instant: either may find what the other
    /// computed (its engine admits it once the other's prefill ran), so each request's
    /// bound is all of its prompt but the last token; across the two, one computes the
    /// blocks, so the run's bound counts them once. Their TTFT floors price nothing
    /// cached, as before; a later request finds both blocks cached either way.
    #[test]
    fn a_burst_mate_s_blocks_bound_each_request_and_count_once() {
        let p = Profile::by_name("paper-a100-mistral7b").unwrap();
        let cfg = SimConfig::new(crate::Network::uniform(1, 0.0, 3.0), p.clone());
        let trace = [
            row(0, 1024, vec![1, 2]),
            row(0, 1024, vec![1, 2]),
            row(1000, 1536, vec![1, 2, 3]),
        ];
        let floors = request_floors(&cfg, trace.iter().cloned().map(Ok)).unwrap();
        let field = |f: fn(&RequestFloor) -> u64| floors.iter().map(f).collect::<Vec<_>>();
        assert_eq!(field(|f| f.cached_tokens), [0, 0, 1024]);
        assert_eq!(field(|f| f.cache_bound_tokens), [1023, 1023, 1024]);
        assert_eq!(field(|f| f.cache_share_tokens), [0, 1024, 1024]);
        let alone = request_floor(&p, 1024, 0, 1).0;
        assert!(floors[0].ttft_ms >= alone && floors[1].ttft_ms >= alone);
        let floor = summarize_floors(&floors);
        assert_eq!(floor.cache_hit_ratio, Some(2048.0 / 3584.0));
    }
}
