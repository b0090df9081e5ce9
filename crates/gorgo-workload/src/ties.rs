//! Spreading requests that share a timestamp (`gorgo trace convert --spread-ties`).
//!
//! Some traces record arrivals on a coarse clock. The Mooncake conversation trace's
//! 12,031 requests sit on 1,180 distinct stamps 2,997-3,003 ms apart, so a replay sends
//! each stamp's 2-28 requests in the same millisecond, to every region at once, and
//! results at light load are made of those bursts (docs/policy.md, "The Mooncake
//! conversation trace's 3-second grid"). Spreading each stamp's requests over the
//! interval to the next stamp gives arrivals a service could have seen, for checking
//! which results depend on the grid. It is a transformation of the workload, so it is
//! an explicit step that writes a new trace, never a default of the replay.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::record::TraceRequest;

/// Spread every run of consecutive requests with the same timestamp (two or more)
/// uniformly over `[t, t_next)`, `t_next` being the next run's timestamp, keeping the
/// rows' order: the run's offsets are sorted uniform draws from a ChaCha8 stream
/// seeded with `seed`. The last run (no next stamp) is spread over the median interval
/// between runs. A run followed by an earlier stamp (an out-of-order trace), a run
/// with no interval to spread over, and lone requests keep their timestamps. Returns
/// how many requests moved.
pub fn spread_ties(requests: &mut [TraceRequest], seed: u64) -> usize {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    let mut start = 0;
    for i in 1..=requests.len() {
        if i == requests.len() || requests[i].timestamp_ms != requests[start].timestamp_ms {
            runs.push((start, i));
            start = i;
        }
    }
    let stamps: Vec<u64> = runs.iter().map(|r| requests[r.0].timestamp_ms).collect();
    let mut intervals: Vec<u64> = stamps
        .windows(2)
        .filter_map(|w| w[1].checked_sub(w[0]))
        .filter(|gap| *gap > 0)
        .collect();
    intervals.sort_unstable();
    let median = intervals.get(intervals.len() / 2).copied();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut moved = 0;
    for (k, run) in runs.iter().enumerate() {
        let (lo, hi) = *run;
        if hi - lo < 2 {
            continue;
        }
        let t = stamps[k];
        let interval = match stamps.get(k + 1) {
            Some(next) => next.saturating_sub(t),
            None => median.unwrap_or(0),
        };
        if interval < 2 {
            continue;
        }
        let mut offsets: Vec<u64> = (lo..hi).map(|_| rng.random_range(0..interval)).collect();
        offsets.sort_unstable();
        for (req, offset) in requests[lo..hi].iter_mut().zip(offsets) {
            req.timestamp_ms = t + offset;
            moved += usize::from(offset > 0);
        }
    }
    moved
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn at(t: u64) -> TraceRequest {
        TraceRequest::at_ms(t)
    }

    fn stamps(rs: &[TraceRequest]) -> Vec<u64> {
        rs.iter().map(|r| r.timestamp_ms).collect()
    }

    #[test]
    fn a_grid_of_bursts_becomes_arrivals_within_each_interval() {
        let mut rs: Vec<TraceRequest> = [0, 0, 0, 0, 3000, 3000, 3000, 6000, 6000]
            .into_iter()
            .map(at)
            .collect();
        let moved = spread_ties(&mut rs, 7);
        let t = stamps(&rs);
        assert!(moved >= 6, "{t:?}");
        assert!(t[..4].iter().all(|s| *s < 3000), "{t:?}");
        assert!(t[4..7].iter().all(|s| (3000..6000).contains(s)), "{t:?}");
        // The last run: the median interval between runs (3,000 ms).
        assert!(t[7..].iter().all(|s| (6000..9000).contains(s)), "{t:?}");
        assert!(t.windows(2).all(|w| w[0] <= w[1]), "order kept: {t:?}");
        // The same seed, the same trace.
        let mut again: Vec<TraceRequest> = [0, 0, 0, 0, 3000, 3000, 3000, 6000, 6000]
            .into_iter()
            .map(at)
            .collect();
        spread_ties(&mut again, 7);
        assert_eq!(stamps(&again), t);
    }

    #[test]
    fn lone_requests_and_out_of_order_runs_keep_their_stamps() {
        let mut rs: Vec<TraceRequest> = [10, 20, 20, 5, 30].into_iter().map(at).collect();
        assert_eq!(spread_ties(&mut rs, 1), 0);
        assert_eq!(stamps(&rs), [10, 20, 20, 5, 30]);
        let mut one: Vec<TraceRequest> = [4, 4, 4].into_iter().map(at).collect();
        assert_eq!(spread_ties(&mut one, 1), 0, "no interval to spread over");
    }

    proptest! {
        #[test]
        fn a_sorted_trace_stays_sorted_and_every_request_stays_before_the_next_stamp(
            gaps in proptest::collection::vec((0u64..5000, 1usize..6), 1..40),
            seed in any::<u64>(),
        ) {
            let mut t = 0;
            let mut rs = Vec::new();
            for (gap, n) in gaps {
                t += gap;
                rs.extend((0..n).map(|_| at(t)));
            }
            let before = stamps(&rs);
            spread_ties(&mut rs, seed);
            let after = stamps(&rs);
            prop_assert!(after.windows(2).all(|w| w[0] <= w[1]));
            let last = *before.last().unwrap();
            for (b, a) in before.iter().zip(&after) {
                prop_assert!(a >= b);
                // Before the next distinct stamp (the last run: within the median gap).
                if let Some(next) = before.iter().find(|s| *s > b) {
                    prop_assert!(a < next);
                } else {
                    prop_assert!(*a - last < 5000);
                }
            }
        }
    }
}
