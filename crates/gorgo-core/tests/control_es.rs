//! The (1+1)-ES on a synthetic noisy quadratic: it must get close to the optimum from
//! the paper's start point within 200 trials, deterministically under a seed.

use gorgo_core::es::{EsState, Measurement, TuningConfig, Verdict};
use gorgo_core::Weights;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;

const OPT: Weights = Weights {
    w_rtt: 1.2,
    w_queue: 0.35,
};

/// p95 TTFT of the synthetic cluster under `w`, without noise.
fn objective(w: Weights) -> f64 {
    400.0 + 300.0 * (w.w_rtt - OPT.w_rtt).powi(2) + 3000.0 * (w.w_queue - OPT.w_queue).powi(2)
}

fn measure(w: Weights, rng: &mut ChaCha8Rng) -> Measurement {
    let noise: f64 = rng.sample(StandardNormal);
    Measurement {
        p95_ttft_ms: objective(w) + 3.0 * noise,
        p95_e2e_ms: 2000.0,
        samples: 128,
    }
}

fn run(seed: u64, trials: usize) -> (EsState, usize) {
    let cfg = TuningConfig {
        seed,
        ..TuningConfig::gorgo_paper()
    };
    let mut es = EsState::new(&cfg);
    assert_eq!(
        es.incumbent,
        Weights {
            w_rtt: 0.5,
            w_queue: 0.1
        }
    );
    let mut noise = ChaCha8Rng::seed_from_u64(seed ^ 0xdead_beef);
    let mut accepted = 0;
    for _ in 0..trials {
        let cand = es.mutate(&cfg);
        // The incumbent is re-measured in the window adjacent to the candidate's.
        let inc = measure(es.incumbent, &mut noise);
        let c = measure(cand, &mut noise);
        if es.conclude(&cfg, cand, c, inc) == Verdict::Accepted {
            accepted += 1;
        }
    }
    (es, accepted)
}

#[test]
fn converges_on_a_noisy_quadratic_within_200_trials() {
    let start_gap = objective(Weights {
        w_rtt: 0.5,
        w_queue: 0.1,
    }) - objective(OPT);
    for seed in 1..=5u64 {
        let (es, accepted) = run(seed, 200);
        let gap = objective(es.incumbent) - objective(OPT);
        assert!(
            gap < 0.05 * start_gap,
            "seed {seed}: gap {gap:.1} of {start_gap:.1}, incumbent {:?}, sigma {:.3}, {accepted} accepted",
            es.incumbent,
            es.sigma
        );
        assert!(
            (es.incumbent.w_rtt - OPT.w_rtt).abs() < 0.3,
            "{:?}",
            es.incumbent
        );
        assert!(
            (es.incumbent.w_queue - OPT.w_queue).abs() < 0.08,
            "{:?}",
            es.incumbent
        );
    }
}

#[test]
fn deterministic_under_a_seed() {
    let (a, _) = run(42, 50);
    let (b, _) = run(42, 50);
    assert_eq!(a, b);
    let (c, _) = run(43, 50);
    assert_ne!(a.incumbent, c.incumbent);
}
