//! The consensus-free distributed tuning protocol (docs/design.md, "Online tuning"), one
//! sans-IO state machine per node.
//!
//! - Leader: the smallest node id in the local membership view. No election: a node
//!   leads when it is the smallest live id it knows of; it steps down when it sees a
//!   smaller live id or a proposal that supersedes its own. A leader it heard from
//!   itself within `leader_lease_ms` keeps its line even where the view calls it dead
//!   (views can be asymmetric).
//! - Every proposal carries `(epoch, leader)` and the whole tuner state. Nodes follow
//!   the highest epoch they have seen, ties to the smaller leader id. A node that
//!   becomes leader continues from the last proposal it follows, at its epoch + 1, so
//!   no epoch is decided twice on one line and the search never restarts.
//! - A trial is one window in which every node routes each request with the incumbent
//!   or the candidate by a hash of the request's id ([`Phase::Interleaved`], the
//!   default), or, with [`TrialDesign::Sequential`], a pair of adjacent windows: the
//!   incumbent re-measured ([`Phase::MeasureIncumbent`]), then the candidate
//!   ([`Phase::MeasureCandidate`]). One [`TuningRecord`] is written per decided
//!   candidate epoch (the `tuning.jsonl` line).
//! - Every node records client-side TTFT and E2E of requests admitted under the
//!   proposal it follows, matched by `(epoch, leader)` ([`EpochKey`]), into mergeable
//!   sketches, one per [`Cell`] (arm and half), and sends them (cumulatively) to the
//!   leader each tick; the leader closes the window when the cluster-wide count
//!   reaches `window`, or after `time_cap_ms` with at least `min_samples` (else it
//!   extends the window).
//!
//! Inputs: [`Tuner::set_membership`], [`Tuner::handle_proposal`],
//! [`Tuner::handle_report`], [`Tuner::record`], [`Tuner::tick`]; outputs: the returned
//! [`TuningOutput`]s, [`Tuner::admit`] (a request's weights and cell) and
//! [`Tuner::weights`].

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use crate::cost::CostTerms;
use crate::error::CoreError;
use crate::es::{
    EsState, Measurement, TrialDesign, TuningConfig, TuningMode, Verdict, TAIL_QUANTILE,
};
use crate::sketch::LatencySketch;
use crate::types::{NodeId, Weights};

/// Records kept in memory for `/admin/tuning`.
pub const HISTORY_LEN: usize = 1024;
/// Measurement cells per epoch: two arms (incumbent, candidate) by two halves.
pub const CELLS: usize = 4;

/// Where a request's latencies are counted: `arm * 2 + half`. The arm is the weight
/// set it was routed with (0 the incumbent, 1 the candidate; always 0 outside an
/// interleaved trial); the half, a second bit of its key, splits each arm in two so
/// every window also measures two halves with the same weights (the noise).
pub type Cell = u8;

/// The cell of a request routed in a trial but measured in none: one admitted in the
/// first half of a switchback block, while the queues still hold the other arm's work.
pub const UNMEASURED: Cell = u8::MAX;

/// The proposal a request was admitted under: its epoch *and* its leader.
///
/// Two partitions can both run an epoch `e`, with different leaders and different
/// weights; after they heal, a node switches from `(e, B)` to `(e, A)` while requests
/// admitted under `(e, B)` are still in flight. Matching a finished request by the
/// epoch number alone would count them in `(e, A)`'s cells although they were routed
/// with `B`'s weights. Only [`Tuner::admit`] makes a key that can match (the default
/// key matches no proposal), so a caller passes back what it was given, whole.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct EpochKey {
    epoch: u64,
    /// `None` before any proposal (and in static mode): such a key is never counted.
    leader: Option<NodeId>,
    /// The leader's incarnation ([`Proposal::incarnation`]).
    incarnation: u64,
}

impl EpochKey {
    fn of(p: &Proposal) -> EpochKey {
        EpochKey {
            epoch: p.epoch,
            leader: Some(p.leader.clone()),
            incarnation: p.incarnation,
        }
    }

    /// The epoch number (0 before any proposal).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The epoch's leader (`None` before any proposal).
    pub fn leader(&self) -> Option<&NodeId> {
        self.leader.as_ref()
    }

    fn is(&self, p: &Proposal) -> bool {
        self.epoch == p.epoch
            && self.leader.as_ref() == Some(&p.leader)
            && self.incarnation == p.incarnation
    }
}

/// What a new request is routed and measured under.
#[derive(Debug, Clone, PartialEq)]
pub struct Assignment {
    /// The proposal it is admitted under, to pass back to
    /// [`Tuner::record_first_token`], [`Tuner::record_finish`] and
    /// [`Tuner::record_terms`].
    pub epoch: EpochKey,
    /// The cell to pass back to [`Tuner::record_first_token`] and
    /// [`Tuner::record_finish`].
    pub cell: Cell,
    /// The weights to route with.
    pub weights: Weights,
}

/// TTFT and E2E sketches of one cell.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CellSketches {
    /// Client-side TTFT, ms.
    pub ttft: LatencySketch,
    /// E2E latency of the requests that finished, ms.
    pub e2e: LatencySketch,
    /// Time so far of the requests that had their first token and had not finished
    /// when the sketches were taken, ms: lower bounds on their E2E. Without them the
    /// E2E guard judged an arm by the requests that ended before the window closed,
    /// and missed most of the slow ones it exists for (docs/tuning.md, "The E2E guard
    /// sees the requests still running").
    pub e2e_open: LatencySketch,
}

impl CellSketches {
    fn merge(&mut self, other: &CellSketches) {
        self.ttft.merge(&other.ttft);
        self.e2e.merge(&other.e2e);
        self.e2e_open.merge(&other.e2e_open);
    }
}

/// A request whose first token a [`Tuner`] counted and whose end it awaits: what
/// [`Tuner::record_first_token`] returns, to hand back to [`Tuner::record_finish`]
/// when the request ends well, or to [`Tuner::abandon`] when it does not. Until then
/// its time so far is in every report, as a lower bound on its E2E.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenRequest {
    epoch: EpochKey,
    cell: Cell,
    id: u64,
}

/// Open requests a node tracks at most (one epoch's: the registry is emptied at each
/// new epoch). Beyond it a request still counts for TTFT and, if it ends in time, for
/// E2E, but not as a lower bound while it runs.
pub const MAX_OPEN_REQUESTS: usize = 1 << 16;

/// One request's evidence for the start fit ([`TermSums`]), from the decision that
/// placed it and its measured TTFT.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TermSample {
    /// The chosen candidate's RTT, unweighted, ms (0 for the local candidate).
    pub rtt_ms: f64,
    /// Its unweighted queue term (`raw_queue_ms`: the queue plus the forward bias), ms.
    pub queue_ms: f64,
    /// Measured TTFT minus the rest of the prediction (fixed cost and prefill), ms:
    /// what the two terms above should add up to.
    pub residual_ms: f64,
    /// Its prefill term, ms: the service time a queue's wait is measured against in
    /// [`TermSums::queue_cost_factor`].
    pub prefill_ms: f64,
}

impl TermSample {
    /// The sample of a request placed on a candidate with `terms` (priced under
    /// `weights`) whose client-side TTFT was `ttft_ms`. `None` when the decision made
    /// no TTFT prediction.
    pub fn new(terms: &CostTerms, weights: Weights, ttft_ms: f64) -> Option<TermSample> {
        let predicted = terms.estimated_ttft_ms?;
        let rtt_ms = if terms.rtt_ms == 0.0 {
            0.0
        } else if weights.w_rtt > 0.0 {
            terms.rtt_ms / weights.w_rtt
        } else {
            return None;
        };
        let queue_ms = terms.raw_queue_ms;
        let sample = TermSample {
            rtt_ms,
            queue_ms,
            residual_ms: ttft_ms - (predicted - rtt_ms - queue_ms),
            prefill_ms: terms.prefill_ms,
        };
        sample.is_usable().then_some(sample)
    }

    fn is_usable(&self) -> bool {
        [
            self.rtt_ms,
            self.queue_ms,
            self.residual_ms,
            self.prefill_ms,
        ]
        .iter()
        .all(|v| v.is_finite() && v.abs() <= MAX_TERM_MS)
            && self.rtt_ms >= 0.0
            && self.queue_ms >= 0.0
            && self.prefill_ms >= 0.0
    }
}

/// Terms and residuals beyond this (ms, an hour) are not evidence but garbage.
const MAX_TERM_MS: f64 = 3.6e6;

/// A fitted weight moves the incumbent only when it is this many standard errors from
/// it, and its standard error is under [`FIT_MAX_REL_SE`] of it.
pub const FIT_Z: f64 = 2.0;
/// The largest standard error, relative to the fitted weight, at which the start fit
/// counts a weight as pinned down (see [`FIT_Z`]).
pub const FIT_MAX_REL_SE: f64 = 0.25;

/// The start fit waits for evidence at most this many windows: until then a window whose
/// fit neither moves the incumbent nor pins every varying term leaves the line unfitted
/// and the next window's requests are added. One window (60-90 requests) left three of
/// ten bad-start runs of one simulated workload (skew x2, seeds 6, 7 and 9) without a
/// fit for the whole run, `w_queue` at its 0.05 start (docs/tuning.md, "A start fit
/// that waits for its evidence"). A fit that eight windows cannot pin is not there.
pub const FIT_MAX_WINDOWS: u32 = 8;

/// Sufficient statistics of the least-squares fit `residual ~ a * rtt + b * queue` (no
/// intercept: the fixed cost is already in the prediction), mergeable across nodes by
/// addition. `a` and `b` are the weights that make the cost's RTT and queue terms
/// unbiased predictors of the TTFT they stand for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TermSums {
    /// Samples.
    pub n: u64,
    /// Sum of rtt^2.
    pub rr: f64,
    /// Sum of rtt * queue.
    pub rq: f64,
    /// Sum of queue^2.
    pub qq: f64,
    /// Sum of rtt * residual.
    pub ry: f64,
    /// Sum of queue * residual.
    pub qy: f64,
    /// Sum of residual^2.
    pub yy: f64,
    /// Sum of queue (the mean wait W of [`TermSums::queue_cost_factor`]).
    pub q: f64,
    /// Sum of prefill (the mean service time S).
    pub p: f64,
}

impl TermSums {
    /// Count one request.
    pub fn add(&mut self, s: TermSample) {
        if !s.is_usable() {
            return;
        }
        self.n += 1;
        self.rr += s.rtt_ms * s.rtt_ms;
        self.rq += s.rtt_ms * s.queue_ms;
        self.qq += s.queue_ms * s.queue_ms;
        self.ry += s.rtt_ms * s.residual_ms;
        self.qy += s.queue_ms * s.residual_ms;
        self.yy += s.residual_ms * s.residual_ms;
        self.q += s.queue_ms;
        self.p += s.prefill_ms;
    }

    fn merge(&mut self, o: &TermSums) {
        if !o.is_valid() {
            return;
        }
        self.n = self.n.saturating_add(o.n);
        self.rr += o.rr;
        self.rq += o.rq;
        self.qq += o.qq;
        self.ry += o.ry;
        self.qy += o.qy;
        self.yy += o.yy;
        self.q += o.q;
        self.p += o.p;
    }

    /// Finite, and the squares and the sums of non-negative terms non-negative (a
    /// report from the network may carry anything).
    fn is_valid(&self) -> bool {
        let v = [
            self.rr, self.rq, self.qq, self.ry, self.qy, self.yy, self.q, self.p,
        ];
        v.iter().all(|x| x.is_finite())
            && [self.rr, self.qq, self.yy, self.q, self.p]
                .iter()
                .all(|&x| x >= 0.0)
    }

    /// The fitted `(w_rtt, w_queue)`, each with its standard error, where the data
    /// determine it: a weight whose term never varied (no forwards, no queue) is `None`.
    pub fn fit(&self) -> [Option<(f64, f64)>; 2] {
        if self.n < 3 || !self.is_valid() {
            return [None, None];
        }
        let n = self.n as f64;
        let det = self.rr * self.qq - self.rq * self.rq;
        let both = self.rr > 0.0 && self.qq > 0.0 && det > 1e-9 * self.rr * self.qq;
        if both {
            let a = (self.qq * self.ry - self.rq * self.qy) / det;
            let b = (self.rr * self.qy - self.rq * self.ry) / det;
            let sse = self.yy - 2.0 * (a * self.ry + b * self.qy)
                + a * a * self.rr
                + 2.0 * a * b * self.rq
                + b * b * self.qq;
            let var = sse.max(0.0) / (n - 2.0);
            return [
                Some((a, (var * self.qq / det).sqrt())),
                Some((b, (var * self.rr / det).sqrt())),
            ];
        }
        let one = |xx: f64, xy: f64| {
            (xx > 0.0).then(|| {
                let w = xy / xx;
                let var = (self.yy - w * xy).max(0.0) / (n - 1.0);
                (w, (var / xx).sqrt())
            })
        };
        if self.qq > 0.0 && self.rr <= 0.0 {
            [None, one(self.qq, self.qy)]
        } else if self.rr > 0.0 && self.qq <= 0.0 {
            [one(self.rr, self.ry), None]
        } else {
            [None, None]
        }
    }

    /// True when the fit has said all it will: every term that varied has a fit whose
    /// standard error is under [`FIT_MAX_REL_SE`] of it. Until then more windows may
    /// still pin a weight ([`FIT_MAX_WINDOWS`]).
    pub fn is_conclusive(&self) -> bool {
        let pinned =
            |fit: Option<(f64, f64)>| fit.is_none_or(|(w, se)| se < FIT_MAX_REL_SE * w.abs());
        let fit = self.fit();
        fit.iter().any(Option::is_some) && fit.into_iter().all(pinned)
    }

    /// What joining a queue costs everyone, as a multiple of the queue's wait: `2 +
    /// W / S`, with `W` and `S` the mean queue and prefill terms of these requests.
    /// In an M/M/1 queue the marginal cost of one more arrival, summed over every
    /// request, is `T / (1 - rho) = (S + W)(1 + W / S) = S + (2 + W / S) W` (the
    /// requests that arrive behind it wait for it too, and those behind them). The
    /// request's own share is `S + W`; the rest is what it costs the others. 2 when
    /// no prefill was seen.
    pub fn queue_cost_factor(&self) -> f64 {
        if self.p > 0.0 {
            2.0 + self.q / self.p
        } else {
            2.0
        }
    }

    /// `incumbent` with each weight the fit pins down ([`FIT_Z`], [`FIT_MAX_REL_SE`])
    /// above it raised: `w_rtt` to its fit, `w_queue` to its fit times
    /// [`TermSums::queue_cost_factor`], each at least at its face value (1.0, the
    /// weight at which a term counts the milliseconds it computes), clipped to `cfg`'s
    /// bounds; `None` when nothing moves.
    ///
    /// Raised only, never lowered: a weight under its fitted value prices a term below
    /// the TTFT it adds to this very request, and what a choice costs the requests
    /// behind it only adds to that, so no better weight lies below it for the start to
    /// move to. For the same reason the fit is a floor, not an estimate, of the weight
    /// the tail wants: it sees only the request's own TTFT. So a weight the data show
    /// too low goes to at least face value, even when its fit is below 1 (measured: the
    /// grid's best fixed weights sit at or above the fitted ones on 19 of 20 weights,
    /// docs/tuning.md, "The start fit"; a fitted `w_queue` of 0.35-0.73 left the bad
    /// start 4-18% above the best weights within the E2E bar, "Face value as the
    /// floor"). What the request costs the others is a network delay for no one, but a
    /// queue's wait for everyone behind it, so the queue weight the data show too low
    /// goes to the whole cost of joining the queue, not the request's own share: its
    /// fit times [`TermSums::queue_cost_factor`] (docs/tuning.md, "The cost of joining
    /// a queue"). Above that the trials search.
    pub fn fitted_start(&self, cfg: &TuningConfig, incumbent: Weights) -> Option<Weights> {
        let face = Weights::default();
        let pinned = |fit: Option<(f64, f64)>, current: f64, face: f64| {
            fit.filter(|&(w, se)| w > current + FIT_Z * se && se < FIT_MAX_REL_SE * w)
                .map(|(w, _)| w.max(face))
        };
        let [rtt, queue] = self.fit();
        let rtt = pinned(rtt, incumbent.w_rtt, face.w_rtt);
        let queue =
            pinned(queue, incumbent.w_queue, face.w_queue).map(|w| w * self.queue_cost_factor());
        if rtt.is_none() && queue.is_none() {
            return None;
        }
        let w = cfg.clip(Weights {
            w_rtt: rtt.unwrap_or(incumbent.w_rtt),
            w_queue: queue.unwrap_or(incumbent.w_queue),
        });
        (w != incumbent).then_some(w)
    }
}

/// What the start fit found after the last window this node decided while its line was
/// unfitted (`/admin/tuning`): the fit it made, or the evidence so far.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StartFit {
    /// The epoch of the last window in the fit.
    pub epoch: u64,
    /// Requests in the fit (over all its windows).
    pub samples: u64,
    /// Fitted `w_rtt` and its standard error, where the data determine it.
    pub w_rtt: Option<(f64, f64)>,
    /// Fitted `w_queue` and its standard error, where the data determine it.
    pub w_queue: Option<(f64, f64)>,
    /// [`TermSums::queue_cost_factor`] of the same requests: what a raised `w_queue`
    /// is multiplied by.
    pub queue_cost_factor: f64,
    /// The incumbent it moved to, if it moved it.
    pub moved_to: Option<Weights>,
}

/// What an epoch measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// Re-measure the incumbent in the window just before its challenger.
    MeasureIncumbent,
    /// Measure the candidate; the leader decides it at the end of the window.
    MeasureCandidate,
    /// Route each request with the incumbent or the candidate by its key, measure
    /// both in this one window; the leader decides at its end.
    Interleaved,
    /// Tuning is over (`tune-then-freeze`): route with the incumbent.
    Frozen,
}

/// A leader's announcement of an epoch: the weights every node routes with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Proposal {
    /// Epoch number, increasing along a line of proposals.
    pub epoch: u64,
    /// The node that leads this epoch.
    pub leader: NodeId,
    /// Which run of the leader's tuner issued it ([`Tuner::with_incarnation`]; the
    /// node's start time). A leader that restarts between deciding an epoch and
    /// announcing the next takes its line over again from a peer's older copy, and
    /// would issue a second, different proposal under the epoch and leader some peers
    /// already hold: neither would supersede the other, and requests routed with two
    /// weight sets would be judged as one. Of two such proposals the later run's
    /// wins, and only its own reports count.
    pub incarnation: u64,
    /// Weights to route with during the epoch (in an interleaved trial: the
    /// incumbent's arm).
    pub weights: Weights,
    /// The candidate's arm of an interleaved trial.
    #[serde(default)]
    pub candidate: Option<Weights>,
    /// What the epoch measures.
    pub phase: Phase,
    /// The whole tuner state, so any node can take over.
    pub state: EsState,
    /// An interleaved epoch of a switchback line: the length of its blocks of time, ms
    /// (every node routes a block with one arm); `None`: the arm is the request key's.
    /// The leader's design, so every follower assigns arms alike whatever its own
    /// configuration says.
    #[serde(default)]
    pub switchback_block_ms: Option<u64>,
}

/// Bound on a proposal's epoch and counters: a line advances one epoch per window, so
/// anything near it comes from a faulty or hostile member, and would overflow the
/// `+ 1` of the next epoch or trial.
pub const MAX_PROPOSAL_COUNTER: u64 = 1 << 48;

/// Bound on a proposal's switchback block length, ms: the configuration's own bound,
/// so that a line the config allows is one followers take.
pub use crate::es::MAX_SWITCHBACK_BLOCK_MS;

/// Bounds on a line's state (the E2E drift, the trial noise): [`EsState::bound`].
pub use crate::es::{MAX_E2E_DRIFT, MAX_NOISE_VAR};

impl Proposal {
    /// Whether the proposal could come from an honest line: epoch and counters below
    /// [`MAX_PROPOSAL_COUNTER`], at most [`crate::es::SUCCESS_WINDOW`] outcomes.
    /// Anything else is ignored (neither adopted nor answered).
    pub fn is_plausible(&self) -> bool {
        let s = &self.state;
        [self.epoch, s.epoch, s.trials, s.draws, s.noise_samples]
            .iter()
            .all(|&c| c < MAX_PROPOSAL_COUNTER)
            && s.outcomes.len() <= crate::es::SUCCESS_WINDOW
            && self
                .switchback_block_ms
                .is_none_or(|b| (1..=MAX_SWITCHBACK_BLOCK_MS).contains(&b))
            && s.pending_trial.as_ref().is_none_or(|t| {
                t.windows.max(t.valid) < u32::MAX / 2
                    && t.cand_samples.max(t.inc_samples) < MAX_PROPOSAL_COUNTER
            })
    }

    /// True when `self` should be followed instead of `other`: higher epoch, or the
    /// same epoch from a smaller leader id.
    pub fn supersedes(&self, other: &Proposal) -> bool {
        (self.epoch, Reverse(&self.leader), self.incarnation)
            > (other.epoch, Reverse(&other.leader), other.incarnation)
    }
}

/// A node's measurements of one epoch, sent to its leader (cumulative: a later report
/// for the same epoch replaces an earlier one).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpochReport {
    /// The epoch measured.
    pub epoch: u64,
    /// The leader of that epoch (two partitions may both have an epoch `e`).
    pub leader: NodeId,
    /// That epoch's leader's incarnation ([`Proposal::incarnation`]).
    pub incarnation: u64,
    /// The reporting node.
    pub from: NodeId,
    /// Client-side TTFT and E2E of requests admitted under the epoch, by [`Cell`].
    pub cells: Box<[CellSketches; CELLS]>,
    /// Requests measured.
    pub samples: u64,
    /// The start fit's sums over the same requests.
    #[serde(default)]
    pub terms: TermSums,
    /// When the reporting node built it, on its clock: of two reports with the same
    /// requests counted, the later one is the newer (its running requests' time so
    /// far has grown, its E2Es may be in), and reports can arrive out of order.
    pub at_ms: u64,
}

impl EpochReport {
    fn count(&self) -> u64 {
        saturating_sum(self.cells.iter().map(|c| c.ttft.count()))
    }

    /// Whether this report replaces `old` from the same node: reports are cumulative,
    /// so more requests counted is newer, and at the same count the later one.
    fn replaces(&self, old: &EpochReport) -> bool {
        (self.count(), self.at_ms) >= (old.count(), old.at_ms)
    }
}

/// Counts from the network add up without overflowing (a report's sketch may claim
/// any count that fits a `u64`).
fn saturating_sum(counts: impl Iterator<Item = u64>) -> u64 {
    counts.fold(0, u64::saturating_add)
}

/// Everything the protocol puts on the wire.
// A message lives from decode to its handling only; boxing the proposal would buy
// nothing but an allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum TuningMessage {
    /// Broadcast by the leader.
    Proposal(Proposal),
    /// Sent to the leader.
    Report(EpochReport),
}

/// The keys every line of `tuning.jsonl` carries (docs/design.md's format; a line may
/// carry more): one list, so that the node, the simulator and their tests check the
/// same format.
pub const TUNING_JSONL_KEYS: [&str; 10] = [
    "epoch",
    "leader",
    "candidate",
    "incumbent",
    "score_p95_ttft_ms",
    "incumbent_p95_ttft_ms",
    "p95_e2e_ms",
    "sigma",
    "accepted",
    "samples",
];

/// One decided trial: a line of `tuning.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TuningRecord {
    /// The candidate's epoch.
    pub epoch: u64,
    /// Who decided.
    pub leader: NodeId,
    /// Weights tried.
    pub candidate: Weights,
    /// Weights they were compared with.
    pub incumbent: Weights,
    /// Candidate p95 TTFT, ms.
    pub score_p95_ttft_ms: f64,
    /// Incumbent p95 TTFT in the adjacent window, ms.
    pub incumbent_p95_ttft_ms: f64,
    /// Candidate p95 E2E, ms.
    pub p95_e2e_ms: f64,
    /// Incumbent p95 E2E in the adjacent window, ms.
    pub incumbent_p95_e2e_ms: f64,
    /// Step size the candidate was drawn with.
    pub sigma: f64,
    /// Whether the candidate became the incumbent.
    pub accepted: bool,
    /// Why.
    pub verdict: Verdict,
    /// Requests measured for the candidate (its window, or its arm of the window).
    pub samples: u64,
    /// Requests measured for the incumbent.
    #[serde(default)]
    pub incumbent_samples: u64,
    /// What the trial compared: the candidate's mean TTFT of its slowest 20%, ms
    /// (geometric mean over the trial's windows).
    #[serde(default)]
    pub score_tail_ttft_ms: Option<f64>,
    /// The incumbent's.
    #[serde(default)]
    pub incumbent_tail_ttft_ms: Option<f64>,
    /// The line's E2E drift after the decision (`EsState::e2e_drift`).
    #[serde(default)]
    pub e2e_drift: f64,
    /// The measured noise after the decision: the standard deviation of the log ratio
    /// of p95 TTFT a comparison of equal weights shows (`EsState::noise_sd`).
    #[serde(default)]
    pub noise_sd: Option<f64>,
}

/// What the driver must do after an input.
#[derive(Debug, Clone, PartialEq)]
pub enum TuningOutput {
    /// Send this proposal to every peer.
    Broadcast(Proposal),
    /// Send this report to `to` (the epoch's leader).
    SendReport {
        /// The leader.
        to: NodeId,
        /// The report.
        report: EpochReport,
    },
    /// Send this proposal to `to` only (a newer line than the one `to` leads).
    SendProposal {
        /// The stale leader.
        to: NodeId,
        /// The proposal this node follows.
        proposal: Proposal,
    },
    /// A trial was decided: append to `tuning.jsonl`.
    Record(TuningRecord),
}

/// The leader's bookkeeping of the epoch it runs.
#[derive(Debug, Clone)]
struct Lead {
    epoch: u64,
    window_started_ms: u64,
    reports: BTreeMap<NodeId, EpochReport>,
}

/// One node's side of the tuning protocol.
#[derive(Debug, Clone)]
pub struct Tuner {
    id: NodeId,
    /// This run's incarnation ([`Proposal::incarnation`]; 0 unless set).
    incarnation: u64,
    cfg: TuningConfig,
    live: BTreeSet<NodeId>,
    current: Option<Proposal>,
    cells: [CellSketches; CELLS],
    /// The requests of the followed epoch that had their first token and have not
    /// ended, by id: their cell and when they started (ms, the `now_ms` clock).
    open: BTreeMap<u64, (Cell, f64)>,
    next_open_id: u64,
    terms: TermSums,
    unreported: bool,
    lead: Option<Lead>,
    /// The last node heard proposing from itself (sender and leader the same), and
    /// when (ms): while that is the followed line's leader and within
    /// `leader_lease_ms`, its line is not taken over ([`TuningConfig::leader_lease_ms`]).
    leader_heard: Option<(NodeId, u64)>,
    last_decided: Option<u64>,
    first_tick_ms: Option<u64>,
    history: VecDeque<TuningRecord>,
    start_fit: Option<StartFit>,
    /// The start fit's evidence over the windows this node has decided while its line
    /// was unfitted, and how many. Leader-local: a new leader after a failover starts
    /// its evidence again (the windows it decides are as good).
    fit_evidence: (TermSums, u32),
}

impl Tuner {
    /// A node that knows only itself.
    pub fn new(id: NodeId, cfg: TuningConfig) -> Result<Self, CoreError> {
        cfg.validate()?;
        let live = BTreeSet::from([id.clone()]);
        Ok(Tuner {
            id,
            incarnation: 0,
            cfg,
            live,
            current: None,
            cells: Default::default(),
            open: BTreeMap::new(),
            next_open_id: 0,
            terms: TermSums::default(),
            unreported: false,
            lead: None,
            leader_heard: None,
            last_decided: None,
            first_tick_ms: None,
            history: VecDeque::new(),
            start_fit: None,
            fit_evidence: (TermSums::default(), 0),
        })
    }

    /// This tuner with incarnation `incarnation`: larger for a later run of the same
    /// node (its start time, ms), so that a proposal it issues wins over one an earlier
    /// run issued under the same epoch ([`Proposal::incarnation`]). Drivers whose
    /// nodes never restart (the simulator) leave it at 0.
    pub fn with_incarnation(mut self, incarnation: u64) -> Self {
        self.incarnation = incarnation;
        self
    }

    /// Switch mode in place (`PUT /admin/weights`), keeping everything else: the line
    /// followed, the requests still open and their handles, the measurements of the
    /// window. A tuner built anew lost them mid-epoch (the running requests stopped
    /// counting for the E2E guard, and old handles could close new requests), and a
    /// leader switched back from `static` started a new line at epoch 1. While
    /// `static`, proposals and reports are ignored, nothing is measured and nothing is
    /// led: a leader switched to `static` stops leading, since its own requests are
    /// routed with the static weights and no longer measure the line's. Back in a
    /// tuning mode the node follows the next newer proposal, or, still the smallest
    /// live id, takes its line over at the next epoch.
    pub fn set_mode(&mut self, mode: TuningMode) {
        self.cfg.mode = mode;
        if mode == TuningMode::Static {
            // The epoch it led was measured partly under static weights, and the
            // reports for it would still close it: it is never decided.
            self.stop_leading();
        }
    }

    /// The local membership view changed: `live` are the members believed alive (this
    /// node is always included).
    pub fn set_membership<I: IntoIterator<Item = NodeId>>(&mut self, live: I) {
        self.live = live.into_iter().collect();
        self.live.insert(self.id.clone());
        if !self.is_smallest_live() {
            self.stop_leading();
        }
    }

    /// A proposal arrived from peer `from` (authenticated by the transport) at
    /// `now_ms`. Adopts it when it supersedes the one followed; when the one followed
    /// supersedes it, answers its sender (the leader of a stale line, e.g. on the other
    /// side of a healed partition) with the newer proposal, so lines merge even if the
    /// newer line's leader has stepped down. A leader's own proposal, the one followed
    /// or a newer one, renews its lease; one relayed by another node does not.
    pub fn handle_proposal(
        &mut self,
        from: &NodeId,
        mut p: Proposal,
        now_ms: u64,
    ) -> Vec<TuningOutput> {
        if self.cfg.mode == TuningMode::Static || !p.is_plausible() {
            return Vec::new();
        }
        if let Some(cur) = &self.current {
            if cur.supersedes(&p) {
                return vec![TuningOutput::SendProposal {
                    to: p.leader,
                    proposal: cur.clone(),
                }];
            }
            if !p.supersedes(cur) {
                // The followed proposal again (a leader re-announces it every tick).
                if EpochKey::of(&p).is(cur) && &p.leader == from {
                    self.leader_heard = Some((p.leader, now_ms));
                }
                return Vec::new();
            }
        }
        if &p.leader == from {
            self.leader_heard = Some((p.leader.clone(), now_ms));
        }
        // Never route with out-of-bounds or non-finite weights, whoever sent them.
        p.weights = self.cfg.clip(p.weights);
        p.candidate = p.candidate.map(|c| self.cfg.clip(c));
        p.state.bound(&self.cfg);
        self.adopt(p);
        self.stop_leading();
        Vec::new()
    }

    /// A report arrived. Only the leader of the report's epoch uses it; the window may
    /// close as a result.
    pub fn handle_report(&mut self, r: EpochReport, now_ms: u64) -> Vec<TuningOutput> {
        // A static node leads nothing (`set_mode`); the check keeps it so.
        if self.cfg.mode == TuningMode::Static {
            return Vec::new();
        }
        let Some(lead) = self.lead.as_mut() else {
            return Vec::new();
        };
        if r.epoch != lead.epoch
            || r.leader != self.id
            || r.incarnation != self.incarnation
            || r.from == self.id
        {
            return Vec::new();
        }
        let newer = lead.reports.get(&r.from).is_none_or(|old| r.replaces(old));
        if newer {
            lead.reports.insert(r.from.clone(), r);
        }
        let mut out = Vec::new();
        self.maybe_close(now_ms, false, &mut out);
        out
    }

    /// A new request: the epoch, cell and weights it is routed and measured under.
    /// `key` is a hash of the request's id (any well-mixed 64 bits; its low bit picks
    /// the arm of an interleaved trial, the next one the half); `now_ms` is the clock
    /// every node shares (the wall clock live), whose blocks pick the arm and half of
    /// a switchback trial instead.
    pub fn admit(&self, key: u64, now_ms: u64) -> Assignment {
        let (arm, half, measured) = self.arm_and_half(key, now_ms);
        let key = arm | (key & !1);
        let half = half as Cell;
        let measured_in = |cell: Cell| if measured { cell } else { UNMEASURED };
        match (&self.current, self.cfg.mode) {
            (Some(p), TuningMode::Online | TuningMode::TuneThenFreeze) => {
                match (p.phase, p.candidate) {
                    // A settled line's window has no candidate: both arms run the
                    // incumbent, and their halves still measure the noise.
                    (Phase::Interleaved, c) if key & 1 == 1 => Assignment {
                        epoch: EpochKey::of(p),
                        cell: measured_in(2 + half),
                        weights: c.unwrap_or(p.weights),
                    },
                    _ => Assignment {
                        epoch: EpochKey::of(p),
                        cell: measured_in(half),
                        weights: p.weights,
                    },
                }
            }
            // Static, or before any proposal: routed with the start weights, so
            // counted in no epoch's cells (the default key matches no proposal).
            _ => Assignment {
                epoch: EpochKey::default(),
                cell: half,
                weights: self.cfg.start_weights(),
            },
        }
    }

    /// A request admitted under `epoch` (its [`Assignment::epoch`]) had its first
    /// token: its start-fit evidence ([`TermSample`]). Counted like
    /// [`Tuner::record_first_token`]'s TTFT (same rule); true when counted.
    pub fn record_terms(&mut self, epoch: &EpochKey, sample: TermSample) -> bool {
        let counts = sample.is_usable() && self.measures(epoch);
        if counts {
            self.terms.add(sample);
        }
        counts
    }

    /// A request admitted under `epoch` (its [`Assignment::epoch`]) in `cell` had its
    /// first token after `ttft_ms`. Counted only while this node still follows the
    /// very proposal it was admitted under, same epoch and same leader, and that
    /// proposal measures (not frozen): the request was routed with that proposal's
    /// weights. Recorded at the first token, not at the end, so that a window counts
    /// every request whose TTFT it saw: at the end, the requests still decoding when
    /// the window closes were lost (4-28% of them at the sweep points, the ones with
    /// the longest E2E), and the arm whose requests decode longer lost more of its
    /// tail (docs/tuning.md, "TTFT at the first token").
    ///
    /// `now_ms` is the clock [`Tuner::tick`] is given. The request is open until it is
    /// handed back to [`Tuner::record_finish`] or [`Tuner::abandon`]: meanwhile its
    /// time so far goes into this node's reports as a lower bound on its E2E, so that
    /// a window's E2E guard sees the requests still decoding at its close. `None` when
    /// the TTFT did not count.
    #[must_use = "hand the request back to record_finish or abandon when it ends"]
    pub fn record_first_token(
        &mut self,
        epoch: &EpochKey,
        cell: Cell,
        ttft_ms: f64,
        now_ms: u64,
    ) -> Option<OpenRequest> {
        if !self.measures(epoch) || !ttft_ms.is_finite() {
            return None;
        }
        // UNMEASURED, or no cell at all: not counted.
        let c = self.cells.get_mut(cell as usize)?;
        c.ttft.add(ttft_ms);
        self.unreported = true;
        let id = self.next_open_id;
        self.next_open_id += 1;
        if self.open.len() < MAX_OPEN_REQUESTS {
            self.open.insert(id, (cell, now_ms as f64 - ttft_ms));
        }
        Some(OpenRequest {
            epoch: epoch.clone(),
            cell,
            id,
        })
    }

    /// The request `open` finished after `e2e_ms`: counted for the E2E guard under the
    /// same rule as [`Tuner::record_first_token`] (so one that ends after its window
    /// closed counted there only by its time so far).
    pub fn record_finish(&mut self, open: OpenRequest, e2e_ms: f64) {
        self.open.remove(&open.id);
        if !self.measures(&open.epoch) || !e2e_ms.is_finite() {
            return;
        }
        if let Some(c) = self.cells.get_mut(open.cell as usize) {
            c.e2e.add(e2e_ms);
            self.unreported = true;
        }
    }

    /// The request `open` ended without an E2E to count (it failed, or its client went
    /// away): it stops being a lower bound.
    pub fn abandon(&mut self, open: OpenRequest) {
        if self.open.remove(&open.id).is_some() {
            self.unreported = true;
        }
    }

    /// [`Tuner::record_first_token`] and [`Tuner::record_finish`] at once, for a
    /// request whose first token and end are observed together.
    pub fn record(&mut self, epoch: &EpochKey, cell: Cell, ttft_ms: f64, e2e_ms: f64) {
        if let Some(open) = self.record_first_token(epoch, cell, ttft_ms, 0) {
            self.record_finish(open, e2e_ms);
        }
    }

    /// The arm (low bit) and half of a request with `key` admitted at `now_ms`: by the
    /// key's two low bits in an interleaved trial; in a switchback trial (the
    /// proposal's [`Proposal::switchback_block_ms`]), by its block of time. Blocks
    /// come in pairs, one of each arm in an order drawn per pair (a hash of the pair
    /// and the epoch: every node draws the same), and the halves are the even and odd
    /// pairs, so the noise the halves measure is the noise of comparing blocks, not
    /// requests. The third value is false for a request in the
    /// first half of its block: routed with the block's arm, measured in no cell, as
    /// the queues then still hold the last block's work (the carryover that would
    /// otherwise mix the arms).
    fn arm_and_half(&self, key: u64, now_ms: u64) -> (u64, u64, bool) {
        let Some((block_ms, epoch)) = self
            .current
            .as_ref()
            .and_then(|p| Some((p.switchback_block_ms?, p.epoch)))
        else {
            return (key & 1, (key >> 1) & 1, true);
        };
        let block_ms = block_ms.max(1);
        let block = now_ms / block_ms;
        let pair = block / 2;
        let mut seed = [0u8; 16];
        seed[..8].copy_from_slice(&pair.to_le_bytes());
        seed[8..].copy_from_slice(&epoch.to_le_bytes());
        let first = crate::hash::hash_bytes(&seed) & 1;
        let settled = now_ms % block_ms >= block_ms / 2;
        ((block & 1) ^ first, pair & 1, settled)
    }

    /// Periodic work (call every gossip interval): lead, take over, or report.
    pub fn tick(&mut self, now_ms: u64) -> Vec<TuningOutput> {
        let mut out = Vec::new();
        if self.cfg.mode == TuningMode::Static {
            return out;
        }
        let first = *self.first_tick_ms.get_or_insert(now_ms);
        if self.is_smallest_live() && !self.leased_elsewhere(now_ms) {
            let leading = matches!((&self.lead, &self.current), (Some(l), Some(c)) if l.epoch == c.epoch && c.leader == self.id);
            if leading {
                self.maybe_close(now_ms, true, &mut out);
                if let Some(cur) = &self.current {
                    // Re-announce, for peers that missed it or just joined.
                    if !out.iter().any(|o| matches!(o, TuningOutput::Broadcast(_))) {
                        out.push(TuningOutput::Broadcast(cur.clone()));
                    }
                }
            } else if let Some(cur) = self.current.clone() {
                self.take_over(cur, now_ms, &mut out);
            } else if now_ms.saturating_sub(first) >= self.cfg.startup_grace_ms {
                // Nobody has proposed anything yet: start the line.
                let p = self.trial_proposal(1, EsState::new(&self.cfg));
                self.start_leading(p, now_ms, &mut out);
            }
        } else if let Some(cur) = &self.current {
            // Open requests' time so far grows: report it every tick while there are any.
            let news = self.unreported || !self.open.is_empty();
            if news && cur.phase != Phase::Frozen && cur.leader != self.id {
                out.push(TuningOutput::SendReport {
                    to: cur.leader.clone(),
                    report: self.report(cur, now_ms),
                });
                self.unreported = false;
            }
        }
        out
    }

    /// The weights to route with now.
    pub fn weights(&self) -> Weights {
        match (&self.current, self.cfg.mode) {
            (Some(p), TuningMode::Online | TuningMode::TuneThenFreeze) => p.weights,
            _ => self.cfg.start_weights(),
        }
    }

    /// The epoch requests are admitted under now (0 before any proposal). Finished
    /// requests are matched by their [`Assignment::epoch`], not by this number.
    pub fn epoch(&self) -> u64 {
        self.current.as_ref().map_or(0, |p| p.epoch)
    }

    /// The proposal this node follows.
    pub fn current(&self) -> Option<&Proposal> {
        self.current.as_ref()
    }

    /// True while this node leads the epoch it follows.
    pub fn is_leader(&self) -> bool {
        self.lead.is_some() && self.current.as_ref().is_some_and(|c| c.leader == self.id)
    }

    /// This node's id.
    pub fn id(&self) -> &NodeId {
        &self.id
    }

    /// The configuration.
    pub fn config(&self) -> &TuningConfig {
        &self.cfg
    }

    /// Requests whose first token counted and whose end is not in yet: their time so
    /// far is a lower bound on their E2E in this node's reports (the E2E guard's
    /// censored evidence), so a request that never ends must be abandoned.
    pub fn open_requests(&self) -> usize {
        self.open.len()
    }

    /// What the start fit found, if this node led while its line was unfitted.
    pub fn start_fit(&self) -> Option<&StartFit> {
        self.start_fit.as_ref()
    }

    /// Trials this node decided, oldest first (at most [`HISTORY_LEN`]).
    pub fn history(&self) -> impl Iterator<Item = &TuningRecord> {
        self.history.iter()
    }

    /// True when a request admitted under `epoch` is measured now: never in `static`
    /// mode, whose node neither reports nor leads.
    fn measures(&self, epoch: &EpochKey) -> bool {
        self.cfg.mode != TuningMode::Static
            && self
                .current
                .as_ref()
                .is_some_and(|c| epoch.is(c) && c.phase != Phase::Frozen)
    }

    fn is_smallest_live(&self) -> bool {
        self.live.first() == Some(&self.id)
    }

    /// True while the followed line's leader, which this node's view calls dead (a
    /// live one is a larger id, whose line the smallest live id takes over), was
    /// heard from itself within `leader_lease_ms`: it is alive, whatever the view says.
    fn leased_elsewhere(&self, now_ms: u64) -> bool {
        let Some(cur) = &self.current else {
            return false;
        };
        cur.leader != self.id
            && !self.live.contains(&cur.leader)
            && self.leader_heard.as_ref().is_some_and(|(id, at)| {
                id == &cur.leader && now_ms.saturating_sub(*at) < self.cfg.leader_lease_ms
            })
    }

    fn report(&self, cur: &Proposal, now_ms: u64) -> EpochReport {
        EpochReport {
            epoch: cur.epoch,
            leader: cur.leader.clone(),
            incarnation: cur.incarnation,
            from: self.id.clone(),
            cells: Box::new(with_open(&self.cells, &self.open, now_ms)),
            samples: self.cells.iter().map(|c| c.ttft.count()).sum(),
            terms: self.terms,
            at_ms: now_ms,
        }
    }

    fn adopt(&mut self, p: Proposal) {
        // The whole key, incarnation included: a restarted leader's proposal at the
        // epoch its earlier run held routes with other weights, so what was measured
        // under the earlier one is no evidence for it.
        let key = EpochKey::of(&p);
        let new_epoch = self.current.as_ref().is_none_or(|c| !key.is(c));
        if new_epoch {
            self.cells = Default::default();
            self.open.clear();
            self.terms = TermSums::default();
            self.unreported = false;
        }
        self.current = Some(p);
    }

    /// Another node leads now: drop the leader's bookkeeping, the start fit's evidence
    /// included.
    fn stop_leading(&mut self) {
        self.lead = None;
        self.fit_evidence = (TermSums::default(), 0);
    }

    fn start_leading(&mut self, mut p: Proposal, now_ms: u64, out: &mut Vec<TuningOutput>) {
        // The bounds its followers hold the line's state to, on the leader's own copy
        // too: a window's freak (or a crafted report's) evidence could otherwise take
        // its drift past them and switch the E2E guard off for as long as it leads,
        // and its state and its followers' would part.
        p.state.bound(&self.cfg);
        self.lead = Some(Lead {
            epoch: p.epoch,
            window_started_ms: now_ms,
            reports: BTreeMap::new(),
        });
        self.adopt(p.clone());
        out.push(TuningOutput::Broadcast(p));
    }

    /// Continue the line `cur` (led by someone else, or by this node before a restart)
    /// at the next epoch. The interrupted epoch is never decided: its reports went to
    /// the old leader. The trial pair restarts with a fresh incumbent measurement,
    /// since the old one is no longer adjacent.
    fn take_over(&mut self, cur: Proposal, now_ms: u64, out: &mut Vec<TuningOutput>) {
        let mut state = cur.state;
        state.pending_incumbent = None;
        // A multi-window trial is not continued: its next window's reports went to
        // the old leader too.
        state.pending_trial = None;
        let p = self.trial_proposal(cur.epoch + 1, state);
        self.start_leading(p, now_ms, out);
    }

    /// The proposal that starts a trial at `epoch` from `state`: the incumbent and a
    /// fresh candidate together (interleaved), the incumbent alone in both arms (an
    /// interleaved line whose noise is not measured yet or that has settled,
    /// [`EsState::trial_hold`]), the incumbent's re-measurement (sequential), or the
    /// frozen incumbent.
    fn trial_proposal(&self, epoch: u64, mut state: EsState) -> Proposal {
        let weights = self.cfg.clip(state.incumbent);
        if state.should_freeze(&self.cfg) {
            // As converged as trials can tell, so `tune-then-freeze` stops here (and
            // its node writes the learned weights).
            state.frozen = true;
        }
        let (phase, candidate) = if state.frozen {
            (Phase::Frozen, None)
        } else {
            match self.cfg.trial {
                TrialDesign::Sequential => (Phase::MeasureIncumbent, None),
                // The noise not yet measured, or settled: a trial then can only pass
                // by luck, and its candidate arm costs traffic; both arms run the
                // incumbent and their halves measure the noise.
                TrialDesign::Interleaved | TrialDesign::Switchback
                    if state.trial_hold(&self.cfg).is_some() =>
                {
                    (Phase::Interleaved, None)
                }
                TrialDesign::Interleaved | TrialDesign::Switchback => {
                    (Phase::Interleaved, Some(state.mutate(&self.cfg)))
                }
            }
        };
        Proposal {
            epoch,
            leader: self.id.clone(),
            incarnation: self.incarnation,
            weights,
            candidate,
            phase,
            state,
            switchback_block_ms: self.switchback_block_ms(phase),
        }
    }

    /// The block length a proposal of `phase` carries: a switchback line's interleaved
    /// epochs have one.
    fn switchback_block_ms(&self, phase: Phase) -> Option<u64> {
        (phase == Phase::Interleaved && self.cfg.trial == TrialDesign::Switchback)
            .then_some(self.cfg.switchback_block_ms)
    }

    /// Close the window if it is full (or timed out with enough samples), decide, and
    /// propose the next epoch. `on_tick` enables the time-cap check.
    fn maybe_close(&mut self, now_ms: u64, on_tick: bool, out: &mut Vec<TuningOutput>) {
        let (Some(lead), Some(cur)) = (self.lead.as_mut(), self.current.as_ref()) else {
            return;
        };
        if cur.phase == Phase::Frozen || lead.epoch != cur.epoch {
            return;
        }
        let samples = saturating_sum(
            self.cells
                .iter()
                .map(|c| c.ttft.count())
                .chain(lead.reports.values().map(EpochReport::count)),
        );
        // A switchback window also spans two pairs of blocks, so that each arm has
        // blocks in both halves.
        let spans_blocks = cur
            .switchback_block_ms
            .is_none_or(|b| now_ms.saturating_sub(lead.window_started_ms) >= 4 * b);
        let full = samples >= self.cfg.window as u64 && spans_blocks;
        let timed_out =
            on_tick && now_ms.saturating_sub(lead.window_started_ms) >= self.cfg.time_cap_ms;
        let closes = full || (timed_out && samples >= self.cfg.min_samples as u64);
        if !closes {
            if timed_out {
                // Too few requests to score: extend the window.
                lead.window_started_ms = now_ms;
            }
            return;
        }
        if self.last_decided.is_some_and(|d| d >= cur.epoch) {
            return;
        }
        let mut cells = with_open(&self.cells, &self.open, now_ms);
        for r in lead.reports.values() {
            for (c, rc) in cells.iter_mut().zip(r.cells.iter()) {
                c.merge(rc);
            }
        }
        let mut terms = self.terms;
        for r in lead.reports.values() {
            terms.merge(&r.terms);
        }
        let cur = cur.clone();
        self.last_decided = Some(cur.epoch);
        let mut state = cur.state.clone();
        state.epoch = cur.epoch;
        if cur.phase == Phase::Interleaved {
            // Every interleaved window measures the noise, the start fit's too: the
            // two halves of each arm ran the same weights.
            for arm in 0..2 {
                let half = |h: usize| cells[arm * 2 + h].ttft.tail_mean(TAIL_QUANTILE);
                if let (Some(a), Some(b)) = (half(0), half(1)) {
                    state.observe_halves(a, b);
                }
            }
        }
        if self.cfg.fit_start && !state.start_fitted {
            // The fit takes every window until it moves the incumbent, has pinned what
            // varies, or has had FIT_MAX_WINDOWS; the trials run meanwhile (their
            // requests are evidence too: the terms are unweighted).
            let (evidence, windows) = &mut self.fit_evidence;
            evidence.merge(&terms);
            *windows += 1;
            let terms = *evidence;
            let [w_rtt, w_queue] = terms.fit();
            let moved_to = terms.fitted_start(&self.cfg, state.incumbent);
            state.start_fitted =
                moved_to.is_some() || terms.is_conclusive() || *windows >= FIT_MAX_WINDOWS;
            if state.start_fitted {
                self.fit_evidence = (TermSums::default(), 0);
            }
            self.start_fit = Some(StartFit {
                epoch: cur.epoch,
                samples: terms.n,
                w_rtt,
                w_queue,
                queue_cost_factor: terms.queue_cost_factor(),
                moved_to,
            });
            if let Some(fitted) = moved_to {
                // The window measured the old start; no trial is decided on it. The
                // line starts again from the fitted weights, with a fresh trial.
                let before = (state.incumbent, state.sigma);
                state.incumbent = fitted;
                state.pending_incumbent = None;
                state.pending_trial = None;
                state.incumbent_score = None;
                state.last_incumbent_p95_ms = None;
                let meas = measure(&cells, 0..CELLS);
                let decided = (Verdict::StartFit, meas, meas);
                self.write_record(&state, &cur, fitted, before, decided, out);
                let next = self.trial_proposal(cur.epoch + 1, state);
                self.start_leading(next, now_ms, out);
                return;
            }
        }
        let next = match (cur.phase, cur.candidate) {
            (Phase::MeasureIncumbent, _) => {
                let meas = measure(&cells, 0..CELLS);
                state.pending_incumbent = Some(meas);
                state.incumbent_score = Some(meas.p95_ttft_ms);
                let weights = state.mutate(&self.cfg);
                Proposal {
                    epoch: cur.epoch + 1,
                    leader: self.id.clone(),
                    incarnation: self.incarnation,
                    weights,
                    candidate: None,
                    phase: Phase::MeasureCandidate,
                    state,
                    switchback_block_ms: None,
                }
            }
            (Phase::Interleaved, Some(candidate)) => {
                let inc = measure(&cells, 0..2);
                let cand = measure(&cells, 2..CELLS);
                let before = (state.incumbent, state.sigma);
                match state.observe_window(&self.cfg, candidate, cand, inc) {
                    Some(decided) => {
                        self.write_record(&state, &cur, candidate, before, decided, out);
                        self.trial_proposal(cur.epoch + 1, state)
                    }
                    // Not decided yet: the same two arms for another window.
                    None => Proposal {
                        epoch: cur.epoch + 1,
                        leader: self.id.clone(),
                        incarnation: self.incarnation,
                        weights: cur.weights,
                        candidate: Some(candidate),
                        phase: Phase::Interleaved,
                        state,
                        switchback_block_ms: cur.switchback_block_ms,
                    },
                }
            }
            _ => {
                let meas = measure(&cells, 0..CELLS);
                if let Some(inc) = state.pending_incumbent.take() {
                    let before = (state.incumbent, state.sigma);
                    let verdict = state.conclude(&self.cfg, cur.weights, meas, inc);
                    let decided = (verdict, meas, inc);
                    self.write_record(&state, &cur, cur.weights, before, decided, out);
                }
                self.trial_proposal(cur.epoch + 1, state)
            }
        };
        self.start_leading(next, now_ms, out);
    }

    /// The record of the trial of `candidate` decided at epoch `cur`: `before` is the
    /// incumbent and step size it was judged against, `decided` the verdict and the two
    /// arms' measurements, `state` the tuner after the decision.
    fn write_record(
        &mut self,
        state: &EsState,
        cur: &Proposal,
        candidate: Weights,
        (incumbent, sigma): (Weights, f64),
        (verdict, cand, inc): (Verdict, Measurement, Measurement),
        out: &mut Vec<TuningOutput>,
    ) {
        let record = TuningRecord {
            epoch: cur.epoch,
            leader: self.id.clone(),
            candidate,
            incumbent,
            score_p95_ttft_ms: cand.p95_ttft_ms,
            incumbent_p95_ttft_ms: inc.p95_ttft_ms,
            p95_e2e_ms: cand.p95_e2e_ms,
            incumbent_p95_e2e_ms: inc.p95_e2e_ms,
            sigma,
            // A start fit, like an accepted trial, makes its candidate the incumbent.
            accepted: matches!(verdict, Verdict::Accepted | Verdict::StartFit),
            verdict,
            samples: cand.samples,
            incumbent_samples: inc.samples,
            score_tail_ttft_ms: cand.tail_ttft_ms,
            incumbent_tail_ttft_ms: inc.tail_ttft_ms,
            e2e_drift: state.e2e_drift,
            noise_sd: state.noise_sd(),
        };
        if self.history.len() == HISTORY_LEN {
            self.history.pop_front();
        }
        self.history.push_back(record.clone());
        out.push(TuningOutput::Record(record));
    }
}

/// `cells` with the `open` requests' time so far at `now_ms` (see [`Tuner`]'s `open`).
fn with_open(
    cells: &[CellSketches; CELLS],
    open: &BTreeMap<u64, (Cell, f64)>,
    now_ms: u64,
) -> [CellSketches; CELLS] {
    let mut cells = cells.clone();
    for &(cell, started_ms) in open.values() {
        if let Some(c) = cells.get_mut(cell as usize) {
            c.e2e_open.add((now_ms as f64 - started_ms).max(0.0));
        }
    }
    cells
}

/// p95 TTFT and E2E, and the tail mean, over `range` of the cells.
fn measure(cells: &[CellSketches; CELLS], range: std::ops::Range<usize>) -> Measurement {
    let mut all = CellSketches::default();
    for c in &cells[range] {
        all.merge(c);
    }
    Measurement {
        p95_ttft_ms: all.ttft.quantile(0.95).unwrap_or(f64::NAN),
        // The requests still running are right-censored at their time so far.
        p95_e2e_ms: all
            .e2e
            .censored_quantile(&all.e2e_open, 0.95)
            .unwrap_or(f64::NAN),
        samples: all.ttft.count(),
        tail_ttft_ms: all.ttft.tail_mean(TAIL_QUANTILE),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> TuningConfig {
        TuningConfig {
            window: 10,
            min_samples: 4,
            time_cap_ms: 1000,
            startup_grace_ms: 0,
            ..TuningConfig::gorgo()
        }
    }

    /// A leader that restarts between deciding an epoch and announcing the next takes
    /// its line over from a peer's older copy and issues the next epoch again, with
    /// another candidate: the later run's proposal wins at the peer that holds the
    /// earlier run's, and that peer's reports under the earlier one do not count.
    /// (Before, neither proposal superseded the other: the peer routed with the old
    /// candidate and its reports were judged as the new one's.)
    #[test]
    fn a_restarted_leaders_proposal_wins_over_its_earlier_runs_at_the_same_epoch() {
        let members = || ["a".into(), "x".into(), "y".into()];
        let mut a = Tuner::new("a".into(), cfg()).unwrap().with_incarnation(1);
        a.set_membership(members());
        let first = broadcasts(&a.tick(0))[0].clone();
        // The earlier run decided epoch 1; only x heard its epoch 2.
        let mut x = Tuner::new("x".into(), cfg()).unwrap();
        x.set_membership(members());
        x.handle_proposal(&"relay".into(), first.clone(), 0);
        let old = Proposal {
            epoch: 2,
            candidate: Some(Weights {
                w_rtt: 3.0,
                w_queue: 3.0,
            }),
            ..first.clone()
        };
        x.handle_proposal(&"relay".into(), old.clone(), 0);
        assert_eq!(x.epoch(), 2);
        // x measures a request under it.
        let adm = x.admit(1, 0);
        x.record(&adm.epoch, adm.cell, 100.0, 500.0);
        // The new run hears y's copy of epoch 1 first and takes the line over.
        let mut a = Tuner::new("a".into(), cfg()).unwrap().with_incarnation(2);
        a.set_membership(members());
        a.handle_proposal(&"relay".into(), first, 0);
        let new = broadcasts(&a.tick(10))[0].clone();
        assert_eq!((new.epoch, new.incarnation), (2, 2));
        // x takes the new run's proposal; the new run answers the old one with its own.
        x.handle_proposal(&"relay".into(), new.clone(), 0);
        assert_eq!(x.current(), Some(&new));
        assert!(matches!(
            a.handle_proposal(&"relay".into(), old.clone(), 0).as_slice(),
            [TuningOutput::SendProposal { proposal, .. }] if *proposal == new
        ));
        // x's measurement under the old one is no evidence for the new one.
        let report = EpochReport {
            cells: Box::new(x.cells.clone()),
            samples: 1,
            ..x.report(&old, 20)
        };
        a.handle_report(report, 20);
        assert!(a.lead.as_ref().unwrap().reports.is_empty());
    }

    /// A restarted leader's proposal at the epoch its earlier run held (same epoch and
    /// leader, a later incarnation) starts a follower's measurements afresh: what it
    /// measured was routed with the earlier run's weights. (Before, the cells, open
    /// requests and start-fit sums were kept, and the next report gave them to the
    /// new run.)
    #[test]
    fn a_restarted_leaders_proposal_at_the_same_epoch_starts_the_measurements_afresh() {
        let mut a = Tuner::new("a".into(), cfg()).unwrap().with_incarnation(1);
        let old = broadcasts(&a.tick(0))[0].clone();
        let mut x = Tuner::new("x".into(), cfg()).unwrap();
        x.set_membership(["a".into(), "x".into()]);
        x.handle_proposal(&"relay".into(), old.clone(), 0);
        // One request finished, one still running, with start-fit evidence.
        let adm = x.admit(1, 0);
        x.record(&adm.epoch, adm.cell, 100.0, 500.0);
        let _running = x.record_first_token(&adm.epoch, adm.cell, 100.0, 0);
        let sample = TermSample {
            rtt_ms: 10.0,
            queue_ms: 20.0,
            residual_ms: 30.0,
            prefill_ms: 40.0,
        };
        assert!(x.record_terms(&adm.epoch, sample));
        assert_eq!((x.report(&old, 10).count(), x.open_requests()), (2, 1));
        let new = Proposal {
            incarnation: 2,
            ..old
        };
        x.handle_proposal(&"relay".into(), new.clone(), 0);
        assert_eq!(x.current(), Some(&new));
        let r = x.report(&new, 20);
        assert_eq!((r.count(), r.samples, r.terms.n), (0, 0, 0));
        assert!(r.cells.iter().all(|c| c.e2e_open.is_empty()));
        assert_eq!(x.open_requests(), 0);
    }

    /// Reports travel as separate messages and can overtake each other: of two with
    /// the same requests counted, the leader keeps the one built later (before, the
    /// one that arrived later: a stale report, its running requests' time so far
    /// shorter, replaced the newer one until the next).
    #[test]
    fn a_report_overtaken_by_a_newer_one_does_not_replace_it() {
        let mut t = Tuner::new("a".into(), cfg()).unwrap();
        t.set_membership(["a".into(), "b".into()]);
        t.tick(0);
        let p = t.current().unwrap().clone();
        let report = |open_ms: f64, at_ms: u64| {
            let mut cells: Box<[CellSketches; CELLS]> = Box::default();
            cells[0].ttft.add(100.0);
            cells[0].e2e_open.add(open_ms);
            EpochReport {
                epoch: p.epoch,
                leader: "a".into(),
                incarnation: 0,
                from: "b".into(),
                cells,
                samples: 1,
                terms: TermSums::default(),
                at_ms,
            }
        };
        t.handle_report(report(900.0, 20), 21);
        t.handle_report(report(300.0, 10), 22);
        let held = &t.lead.as_ref().unwrap().reports[&NodeId::from("b")];
        assert_eq!(held.at_ms, 20, "the stale report replaced the newer one");
        // More requests counted is newer whatever the clock says.
        let mut more = report(50.0, 5);
        more.cells[1].ttft.add(100.0);
        t.handle_report(more, 23);
        assert_eq!(
            t.lead.as_ref().unwrap().reports[&NodeId::from("b")].at_ms,
            5
        );
    }

    fn broadcasts(out: &[TuningOutput]) -> Vec<&Proposal> {
        out.iter()
            .filter_map(|o| match o {
                TuningOutput::Broadcast(p) => Some(p),
                _ => None,
            })
            .collect()
    }

    /// The first trial record among `out`.
    fn first_record(out: &[TuningOutput]) -> Option<TuningRecord> {
        out.iter().find_map(|o| match o {
            TuningOutput::Record(r) => Some(r.clone()),
            _ => None,
        })
    }

    fn sequential() -> TuningConfig {
        TuningConfig {
            trial: TrialDesign::Sequential,
            ..cfg()
        }
    }

    /// `n` requests admitted now on `t`, each finishing with `ttft(weights)`.
    fn serve(t: &mut Tuner, keys: std::ops::Range<u64>, ttft: impl Fn(Weights) -> f64) {
        for k in keys {
            let a = t.admit(crate::hash::hash_bytes(&k.to_le_bytes()), 0);
            t.record(&a.epoch, a.cell, ttft(a.weights), 1000.0);
        }
    }

    #[test]
    fn single_node_runs_interleaved_trials() {
        let mut t = Tuner::new("a".into(), cfg()).unwrap();
        let out = t.tick(0);
        let p = broadcasts(&out)[0].clone();
        assert_eq!((p.epoch, p.phase), (1, Phase::Interleaved));
        // No trial before the noise is measured: both arms run the incumbent, and their
        // halves measure the noise. One window gives too few samples of it.
        assert_eq!(p.candidate, None, "no trial on unmeasured noise");
        for w in 0..2u64 {
            for k in w * 100..w * 100 + 64 {
                let a = t.admit(crate::hash::hash_bytes(&k.to_le_bytes()), 0);
                assert_eq!(a.weights, p.weights);
            }
            serve(&mut t, w * 10..w * 10 + 10, |_| 100.0);
            let out = t.tick(w * 10 + 10);
            assert!(
                first_record(&out).is_none(),
                "a noise window decides nothing"
            );
        }
        let p = t.current().unwrap().clone();
        assert_eq!(p.epoch, 3);
        let cand = p.candidate.expect("a trial once the noise is known");
        assert_eq!(t.weights(), p.weights, "weights() is the incumbent's arm");
        // Both arms are routed, each with its own weights, in every cell.
        let mut seen = [0; CELLS];
        for k in 1000..1064u64 {
            let a = t.admit(crate::hash::hash_bytes(&k.to_le_bytes()), 0);
            seen[a.cell as usize] += 1;
            let want = if a.cell >= 2 { cand } else { p.weights };
            assert_eq!(a.weights, want);
        }
        assert!(seen.iter().all(|&n| n > 5), "{seen:?}");
        // The candidate's arm is faster in the same window, beyond the measured noise
        // (none: equal halves): accepted after one window.
        serve(&mut t, 20..30, |w| if w == cand { 50.0 } else { 100.0 });
        let out = t.tick(30);
        let rec = first_record(&out).expect("a decision on the measured noise");
        assert!(rec.accepted, "{rec:?}");
        assert_eq!((rec.epoch, rec.candidate), (3, cand));
        assert_eq!(rec.samples + rec.incumbent_samples, 10);
        let next = t.current().unwrap();
        assert_eq!((next.epoch, next.phase), (4, Phase::Interleaved));
        assert_eq!(next.weights, cand, "the winner is the next incumbent");
        assert_ne!(next.candidate, Some(cand));
    }

    /// One window of `n` requests from `keys` on `t`, each finishing with `ttft(cell)`,
    /// then the tick that closes it.
    fn serve_cells(
        t: &mut Tuner,
        keys: std::ops::Range<u64>,
        now_ms: u64,
        ttft: impl Fn(Cell) -> f64,
    ) -> Vec<TuningOutput> {
        for k in keys {
            let a = t.admit(crate::hash::hash_bytes(&k.to_le_bytes()), 0);
            t.record(&a.epoch, a.cell, ttft(a.cell), 1000.0);
        }
        t.tick(now_ms)
    }

    #[test]
    fn a_line_that_cannot_decide_settles_and_trials_again_once_it_can() {
        let cfg = TuningConfig {
            fit_start: false,
            ..cfg()
        };
        let mut t = Tuner::new("a".into(), cfg).unwrap();
        t.tick(0);
        assert!(
            t.current().unwrap().candidate.is_none(),
            "the noise is measured first"
        );
        assert_eq!(
            t.current().unwrap().state.trial_hold(t.config()),
            Some(crate::es::TrialHold::MeasuringNoise)
        );
        // Halves of the same weights 2x apart: a trial would need far more than
        // `settle_margin` of improvement. The line measures the noise for two windows...
        let noisy = |c: Cell| if c.is_multiple_of(2) { 100.0 } else { 200.0 };
        let mut key = 0;
        for w in 1..=2 {
            serve_cells(&mut t, key..key + 10, w * 10, noisy);
            key += 10;
        }
        // ...then the line settles: no candidate, both arms run the incumbent, and
        // its windows keep measuring the noise.
        let state = &t.current().unwrap().state;
        let need = state.required_improvement(t.config()).unwrap();
        assert!(need > t.config().settle_margin, "{need}");
        assert_eq!(
            state.trial_hold(t.config()),
            Some(crate::es::TrialHold::Settled)
        );
        let p = t.current().unwrap().clone();
        assert_eq!((p.phase, p.candidate), (Phase::Interleaved, None));
        let mut cells = [0; CELLS];
        for k in 1000..1064u64 {
            let a = t.admit(crate::hash::hash_bytes(&k.to_le_bytes()), 0);
            assert_eq!(a.weights, p.weights);
            cells[a.cell as usize] += 1;
        }
        assert!(cells.iter().all(|&n| n > 5), "{cells:?}");
        // Quiet windows: the noise estimate falls, and once a trial can be decided
        // again the line proposes candidates again; settled windows decide nothing.
        let mut windows = 0;
        while t.current().unwrap().candidate.is_none() {
            windows += 1;
            assert!(windows < 60, "never trials again");
            let out = serve_cells(&mut t, key..key + 10, 100 + windows * 10, |_| 100.0);
            key += 10;
            assert!(
                first_record(&out).is_none(),
                "a settled window decides nothing"
            );
        }
        let state = &t.current().unwrap().state;
        let need = state.required_improvement(t.config()).unwrap();
        assert!(need <= t.config().settle_margin, "{need}");
        assert_eq!(state.trial_hold(t.config()), None);
        // `tune-then-freeze`: the same line freezes where it would settle.
        let freeze = TuningConfig {
            mode: TuningMode::TuneThenFreeze,
            ..*t.config()
        };
        let mut f = Tuner::new("a".into(), freeze).unwrap();
        f.tick(0);
        let mut fkey = 0;
        for w in 1..=2 {
            serve_cells(&mut f, fkey..fkey + 10, w * 10, noisy);
            fkey += 10;
        }
        assert_eq!(f.current().unwrap().phase, Phase::Frozen);
        // Sequential trials never settle (their windows are the incumbent's anyway).
        let mut seq = state.clone();
        let seq_cfg = sequential();
        seq.noise_var = 1.0;
        assert!(!seq.is_settled(&seq_cfg));
        assert_eq!(
            seq.trial_hold(&seq_cfg),
            None,
            "a sequential line always trials"
        );
    }

    #[test]
    fn single_node_runs_trial_pairs() {
        // The adaptive margin off: sequential noise needs four incumbent pairs before
        // anything is accepted (es.rs, `no_acceptance_on_unmeasured_noise`).
        let cfg = TuningConfig {
            noise_z: 0.0,
            ..sequential()
        };
        let mut t = Tuner::new("a".into(), cfg).unwrap();
        let out = t.tick(0);
        assert_eq!(broadcasts(&out)[0].epoch, 1);
        assert!(t.is_leader());
        let epoch = t.admit(0, 0).epoch;
        for i in 0..10 {
            t.record(&epoch, 0, 100.0 + i as f64, 1000.0);
        }
        let out = t.tick(10);
        let p = broadcasts(&out)[0];
        assert_eq!((p.epoch, p.phase), (2, Phase::MeasureCandidate));
        assert_eq!(t.weights(), p.weights);
        let epoch = t.admit(0, 0).epoch;
        for _ in 0..10 {
            t.record(&epoch, 1, 50.0, 1000.0);
        }
        let out = t.tick(20);
        let rec = first_record(&out);
        let rec = rec.expect("a decision");
        assert!(rec.accepted);
        assert_eq!(rec.epoch, 2);
        assert_eq!(t.weights(), rec.candidate);
        assert_eq!(t.current().unwrap().phase, Phase::MeasureIncumbent);
        let line = serde_json::to_value(&rec).unwrap();
        for k in TUNING_JSONL_KEYS {
            assert!(line.get(k).is_some(), "{k}");
        }
    }

    /// A single node leading a sequential line from its first tick, with neither the
    /// adaptive noise margin nor the start fit: trials judged on their two windows.
    fn plain_sequential_leader() -> Tuner {
        let cfg = TuningConfig {
            noise_z: 0.0,
            fit_start: false,
            ..sequential()
        };
        let mut t = Tuner::new("a".into(), cfg).unwrap();
        t.tick(0);
        t
    }

    /// A leader's own windows are held to the bounds its followers hold a proposal
    /// to: a trial accepted on a freak E2E ratio (1 ms against 1e6) took the leader's
    /// drift to -13.8, which let every later step that worsens E2E by up to the guard
    /// pass for as long as it led, and its state and its followers' parted.
    #[test]
    fn a_leaders_own_window_keeps_its_state_in_bounds() {
        let mut t = plain_sequential_leader();
        let epoch = t.admit(0, 0).epoch;
        for i in 0..10 {
            t.record(&epoch, 0, 100.0 + i as f64, 1e6);
        }
        t.tick(10);
        let epoch = t.admit(0, 0).epoch;
        for _ in 0..10 {
            t.record(&epoch, 1, 50.0, 1.0);
        }
        let rec = first_record(&t.tick(20)).expect("a decision");
        assert!(rec.accepted);
        let drift = t.current().unwrap().state.e2e_drift;
        assert_eq!(drift, -MAX_E2E_DRIFT, "{drift}");
    }

    /// A window counts a request at its first token: one still decoding when the window
    /// closes is in its TTFT, and its end, reported after the close, is dropped.
    #[test]
    fn a_window_counts_requests_still_decoding_at_its_close() {
        let mut t = plain_sequential_leader();
        let first = t.admit(0, 0).epoch;
        let mut running = Vec::new();
        for i in 0..10 {
            let open = t.record_first_token(&first, 0, 100.0 + i as f64, 0);
            let open = open.expect("counted");
            if i % 2 == 0 {
                t.record_finish(open, 1000.0);
            } else {
                running.push(open);
            }
        }
        // Ten first tokens fill the window although only five requests ended.
        let p = broadcasts(&t.tick(10))[0].clone();
        assert_eq!((p.epoch, p.phase), (2, Phase::MeasureCandidate));
        for open in running {
            t.record_finish(open, 1e6);
        }
        let second = t.admit(0, 0).epoch;
        for _ in 0..10 {
            t.record(&second, 1, 50.0, 1000.0);
        }
        let rec = first_record(&t.tick(20)).expect("a decision");
        assert_eq!((rec.samples, rec.incumbent_samples), (10, 10));
        assert!((rec.incumbent_p95_ttft_ms - 109.0).abs() < 3.0);
        // The late ends (1e6 ms) counted for neither window.
        assert!(rec.p95_e2e_ms < 1100.0 && rec.incumbent_p95_e2e_ms < 1100.0);
        assert!(rec.accepted);
    }

    /// The first trial of an interleaved line where one request in ten of the
    /// candidate's arm is slow twice over (TTFT 300 ms, then 5 s of decode) and one in
    /// ten of the incumbent's has a TTFT of 150 ms, one request every 20 ms. Recorded
    /// at the end, the candidate's slow requests were still decoding when each window
    /// closed, so its measured tail was that of its fast ones (100 ms against 150) and
    /// it was accepted. Recorded at the first token, its tail is seen.
    #[test]
    fn an_arm_whose_slow_requests_decode_long_is_judged_by_them() {
        let rec = first_trial_of(20, |candidate, slow| match (candidate, slow) {
            (true, true) => (300.0, 5000),
            (false, true) => (150.0, 0),
            _ => (100.0, 0),
        });
        assert_ne!(rec.verdict, Verdict::Accepted, "{rec:?}");
        assert!(rec.score_p95_ttft_ms > 250.0, "{rec:?}");
    }

    /// A candidate whose TTFT is better (80 ms against 100) but one of whose requests
    /// in ten then decodes for 100 s, against 1 s for all others, one request every
    /// 200 ms: a window of 50 first tokens lasts 10 s, so none of those long requests
    /// has ended when it closes. Judged by the requests that ended, the two arms'
    /// p95 E2E were the same and the candidate was accepted (checked by leaving the
    /// open requests out of `measure`: it fails); with the ones still running
    /// right-censored at their time so far, the guard sees them.
    #[test]
    fn the_e2e_guard_sees_the_requests_still_running() {
        let rec = first_trial_of(200, |candidate, slow| match (candidate, slow) {
            (true, true) => (80.0, 100_000),
            (true, false) => (80.0, 1000),
            _ => (100.0, 1000),
        });
        assert_eq!(rec.verdict, Verdict::E2eGuard, "{rec:?}");
        assert!(rec.score_p95_ttft_ms < 90.0, "{rec:?}");
        assert!(rec.p95_e2e_ms > 2.0 * rec.incumbent_p95_e2e_ms, "{rec:?}");
    }

    /// The first trial a single-node line decides, one request every `every_ms`, each
    /// with the TTFT and decode time (ms) `profile(routed with the candidate, slow)`
    /// gives it (one request in ten is slow, by its key); TTFT recorded at the first
    /// token, E2E (TTFT plus decode) at the end, as the node does. Windows of 50 first
    /// tokens (time cap 60 s), no noise margin, no start fit: the first trial decides.
    fn first_trial_of(every_ms: u64, profile: impl Fn(bool, bool) -> (f64, u64)) -> TuningRecord {
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        let cfg = TuningConfig {
            window: 50,
            noise_z: 0.0,
            fit_start: false,
            time_cap_ms: 60_000,
            ..cfg()
        };
        let mut t = Tuner::new("a".into(), cfg).unwrap();
        // (at, sequence, first token?, request)
        let mut due: BinaryHeap<Reverse<(u64, usize, bool, usize)>> = BinaryHeap::new();
        let mut admitted: Vec<(EpochKey, Cell, f64, u64, Option<OpenRequest>)> = Vec::new();
        for now in (0..2_000_000u64).step_by(10) {
            while let Some(Reverse((at, _, first, i))) = due.peek().copied() {
                if at > now {
                    break;
                }
                due.pop();
                let (epoch, cell, ttft, decode, open) = &mut admitted[i];
                if first {
                    *open = t.record_first_token(epoch, *cell, *ttft, now);
                } else if let Some(open) = open.take() {
                    t.record_finish(open, *ttft + *decode as f64);
                }
            }
            if let Some(rec) = first_record(&t.tick(now)) {
                return rec;
            }
            if now % every_ms != 0 {
                continue;
            }
            let key = crate::hash::hash_bytes(&now.to_le_bytes());
            let a = t.admit(key, now);
            let candidate = Some(a.weights) == t.current().unwrap().candidate;
            let (ttft, decode) = profile(candidate, (key >> 8).is_multiple_of(10));
            let i = admitted.len();
            admitted.push((a.epoch, a.cell, ttft, decode, None));
            let first_at = now + ttft as u64;
            due.push(Reverse((first_at, 2 * i, true, i)));
            due.push(Reverse((first_at + decode, 2 * i + 1, false, i)));
        }
        panic!("no trial decided");
    }

    /// The first trial a single-node line of `design` decides, one request per ms, each
    /// finishing at once with a TTFT of 100 ms times `own` for the candidate's arm (1.0
    /// for the incumbent's) times `1 + spill` x the share of the last 50 requests routed
    /// with the candidate: a candidate that helps its own requests by making a queue
    /// everyone shares longer.
    fn first_trial_under_spill(design: TrialDesign, own: f64, spill: f64) -> TuningRecord {
        let cfg = TuningConfig {
            trial: design,
            switchback_block_ms: 100,
            fit_start: false,
            ..cfg()
        };
        let mut t = Tuner::new("a".into(), cfg).unwrap();
        let mut recent = std::collections::VecDeque::new();
        for now in 0..20_000u64 {
            if now % 10 == 0 {
                if let Some(rec) = first_record(&t.tick(now)) {
                    return rec;
                }
            }
            let a = t.admit(crate::hash::hash_bytes(&now.to_le_bytes()), now);
            let candidate = Some(a.weights) == t.current().unwrap().candidate;
            recent.push_back(candidate);
            if recent.len() > 50 {
                recent.pop_front();
            }
            let share = recent.iter().filter(|&&c| c).count() as f64 / recent.len() as f64;
            let own = if candidate { own } else { 1.0 };
            t.record(
                &a.epoch,
                a.cell,
                100.0 * own * (1.0 + spill * share),
                1000.0,
            );
        }
        panic!("no trial decided");
    }

    #[test]
    fn a_switchback_trial_sees_what_a_candidate_costs_the_others() {
        // 10% faster for its own requests, and a queue that makes everyone 50% slower
        // when all traffic runs it: worse for the cluster.
        let interleaved = first_trial_under_spill(TrialDesign::Interleaved, 0.9, 0.5);
        assert!(
            interleaved.accepted,
            "interleaving is fooled: {interleaved:?}"
        );
        let switchback = first_trial_under_spill(TrialDesign::Switchback, 0.9, 0.5);
        assert_eq!(switchback.verdict, Verdict::NotBetter, "{switchback:?}");
        assert!(
            switchback.score_p95_ttft_ms > switchback.incumbent_p95_ttft_ms * 1.2,
            "the whole cost is seen: {switchback:?}"
        );
        // Without the spill both designs accept the faster candidate.
        let switchback = first_trial_under_spill(TrialDesign::Switchback, 0.9, 0.0);
        assert!(switchback.accepted, "{switchback:?}");
    }

    /// A leader renews its lease only with proposals it sends itself: a node whose view
    /// holds the leader dead follows it while it hears from it, and takes the line over
    /// once `leader_lease_ms` passes without; a proposal relayed by another node is no
    /// sign of the leader's life.
    #[test]
    fn only_a_leaders_own_proposals_renew_its_lease() {
        let lease = cfg().leader_lease_ms;
        let mut a = Tuner::new("a".into(), cfg()).unwrap();
        let p = broadcasts(&a.tick(0))[0].clone();
        let leader_of =
            |out: &[TuningOutput]| broadcasts(out).first().map(|p| (p.epoch, p.leader.clone()));
        // Heard from a itself: followed (b only reports) until the lease runs out.
        let mut b = Tuner::new("b".into(), cfg()).unwrap();
        b.handle_proposal(&"a".into(), p.clone(), 0);
        assert_eq!(leader_of(&b.tick(lease - 1)), None);
        assert!(!b.is_leader());
        // Another copy from a renews it.
        b.handle_proposal(&"a".into(), p.clone(), lease - 1);
        assert_eq!(leader_of(&b.tick(2 * lease - 2)), None);
        assert_eq!(
            leader_of(&b.tick(2 * lease - 1)),
            Some((p.epoch + 1, "b".into()))
        );
        // Relayed by c: taken over at the first tick.
        let mut b = Tuner::new("b".into(), cfg()).unwrap();
        b.handle_proposal(&"c".into(), p.clone(), 0);
        assert_eq!(leader_of(&b.tick(1)), Some((p.epoch + 1, "b".into())));
        // A leader the view holds alive is a larger id, never leased: taken over at once.
        let mut b = Tuner::new("b".into(), cfg()).unwrap();
        let mut z = Tuner::new("z".into(), cfg()).unwrap();
        let pz = broadcasts(&z.tick(0))[0].clone();
        b.set_membership(["z".into()]);
        b.handle_proposal(&"z".into(), pz.clone(), 0);
        assert_eq!(leader_of(&b.tick(1)), Some((pz.epoch + 1, "b".into())));
    }

    #[test]
    fn switchback_blocks_alternate_in_pairs_and_agree_across_nodes() {
        let cfg = TuningConfig {
            trial: TrialDesign::Switchback,
            switchback_block_ms: 100,
            ..cfg()
        };
        let mut a = Tuner::new("a".into(), cfg).unwrap();
        let mut b = Tuner::new("b".into(), cfg).unwrap();
        b.handle_proposal(&"relay".into(), broadcasts(&a.tick(0))[0].clone(), 0);
        for block in 0..40u64 {
            // Every request of a block, whatever its key, on every node: one arm.
            let at = |t: &Tuner, k: u64| t.arm_and_half(k, block * 100 + k % 100);
            let (first, half, _) = at(&a, 0);
            assert!((0..64).all(|k| at(&a, k).0 == first && at(&b, k).0 == first));
            if block % 2 == 1 {
                let (prev, _, _) = a.arm_and_half(0, (block - 1) * 100);
                assert_ne!(first, prev, "one of each per pair");
            }
            // The halves are the even and odd pairs.
            assert_eq!(half, (block / 2) & 1);
            // Only the second half of a block is measured.
            assert!((0..64).all(|k| at(&a, k).2 == (k % 100 >= 50)));
            let cell = |ms| a.admit(0, block * 100 + ms).cell;
            assert_eq!(cell(49), UNMEASURED);
            assert_eq!(cell(50), (first * 2 + half) as Cell);
        }
    }

    #[test]
    fn time_cap_extends_until_min_samples() {
        let mut t = Tuner::new("a".into(), cfg()).unwrap();
        t.tick(0);
        let epoch = t.admit(0, 0).epoch;
        t.record(&epoch, 0, 100.0, 1000.0);
        // Cap passed with 1 < 4 samples: extended, still epoch 1.
        t.tick(1500);
        assert_eq!(t.epoch(), 1);
        for _ in 0..3 {
            t.record(&epoch, 3, 100.0, 1000.0);
        }
        t.tick(2000);
        assert_eq!(t.epoch(), 1, "window restarted at 1500");
        t.tick(2600);
        assert_eq!(t.epoch(), 2);
    }

    #[test]
    fn static_mode_never_moves() {
        let c = TuningConfig {
            mode: TuningMode::Static,
            ..cfg()
        };
        let mut t = Tuner::new("a".into(), c).unwrap();
        assert!(t.tick(0).is_empty());
        let p = Proposal {
            epoch: 9,
            leader: "0".into(),
            incarnation: 0,
            weights: Weights {
                w_rtt: 3.0,
                w_queue: 3.0,
            },
            candidate: None,
            phase: Phase::MeasureCandidate,
            state: EsState::new(&c),
            switchback_block_ms: None,
        };
        assert!(t.handle_proposal(&"relay".into(), p, 0).is_empty());
        assert!(t.current().is_none());
        assert_eq!(t.weights(), c.start_weights());
    }

    /// A leader switched to `static` stops leading and measures nothing: its requests
    /// are routed with the static weights, so counting them in the incumbent's arm, or
    /// closing the window on its peers' reports, judged the line by weights it did
    /// not route with. Back online it takes its line over at the next epoch.
    #[test]
    fn a_leader_switched_to_static_stops_leading_and_counts_nothing() {
        let mut a = Tuner::new("a".into(), cfg()).unwrap();
        a.set_membership(["a".into(), "b".into()]);
        let p = broadcasts(&a.tick(0))[0].clone();
        let online = a.admit(0, 0);
        a.set_mode(TuningMode::Static);
        assert!(!a.is_leader());
        let adm = a.admit(0, 0);
        assert_eq!(adm.weights, cfg().start_weights());
        assert_eq!(adm.epoch, EpochKey::default());
        assert!(a
            .record_first_token(&adm.epoch, adm.cell, 100.0, 0)
            .is_none());
        // Nor a request admitted before the switch that has its first token after.
        assert!(a
            .record_first_token(&online.epoch, online.cell, 100.0, 0)
            .is_none());
        // Twice the window from b, for the epoch a led: nothing is decided.
        let mut cells: Box<[CellSketches; CELLS]> = Box::default();
        for i in 0..20 {
            cells[i % CELLS].ttft.add(100.0);
            cells[i % CELLS].e2e.add(1000.0);
        }
        let report = EpochReport {
            epoch: p.epoch,
            leader: "a".into(),
            incarnation: 0,
            from: "b".into(),
            cells,
            samples: 20,
            terms: TermSums::default(),
            at_ms: 5,
        };
        assert!(a.handle_report(report, 5).is_empty());
        assert_eq!(a.current(), Some(&p));
        assert!(a.tick(6).is_empty());
        // Back online, the line goes on at the next epoch.
        a.set_mode(TuningMode::Online);
        let next = broadcasts(&a.tick(10))[0].clone();
        assert_eq!((next.epoch, next.leader.0.as_str()), (p.epoch + 1, "a"));
        assert!(a.is_leader());
    }

    /// A follower reports its open requests' time so far every tick, growing, until
    /// they end; one that failed stops counting.
    #[test]
    fn a_follower_reports_its_running_requests_until_they_end() {
        let mut a = Tuner::new("a".into(), cfg()).unwrap();
        let mut b = Tuner::new("b".into(), cfg()).unwrap();
        b.set_membership(["a".into()]);
        let p = broadcasts(&a.tick(0))[0].clone();
        b.handle_proposal(&"relay".into(), p, 0);
        let report = |out: Vec<TuningOutput>| {
            out.into_iter().find_map(|o| match o {
                TuningOutput::SendReport { report, .. } => Some(report),
                _ => None,
            })
        };
        let adm = b.admit(0, 0);
        let ended = b
            .record_first_token(&adm.epoch, adm.cell, 100.0, 1000)
            .unwrap();
        let failed = b
            .record_first_token(&adm.epoch, adm.cell, 200.0, 1000)
            .unwrap();
        let open = |r: &EpochReport| r.cells[adm.cell as usize].e2e_open.clone();
        let r = report(b.tick(5000)).expect("a report");
        assert_eq!(open(&r).count(), 2);
        assert!((open(&r).quantile(1.0).unwrap() - 4200.0).abs() < 42.0);
        // Nothing new recorded, but the open requests are older: reported again.
        let r = report(b.tick(9000)).expect("a report");
        assert!((open(&r).quantile(1.0).unwrap() - 8200.0).abs() < 82.0);
        b.record_finish(ended, 8100.0);
        b.abandon(failed);
        let r = report(b.tick(10_000)).expect("a report");
        assert!(open(&r).is_empty());
        assert_eq!(r.cells[adm.cell as usize].e2e.count(), 1);
        // Nothing open and nothing new: no report.
        assert!(report(b.tick(11_000)).is_none());
    }

    #[test]
    fn hostile_proposals_are_clipped() {
        let mut t = Tuner::new("b".into(), cfg()).unwrap();
        let mut state = EsState::new(&cfg());
        state.sigma = f64::NAN;
        let p = Proposal {
            epoch: 3,
            leader: "a".into(),
            incarnation: 0,
            weights: Weights {
                w_rtt: f64::NAN,
                w_queue: 1e9,
            },
            candidate: None,
            phase: Phase::MeasureCandidate,
            state,
            switchback_block_ms: None,
        };
        assert!(t.handle_proposal(&"relay".into(), p.clone(), 0).is_empty());
        assert_eq!(
            t.weights(),
            Weights {
                w_rtt: 1.0,
                w_queue: 4.0
            }
        );
        assert_eq!(t.current().unwrap().state.sigma, cfg().sigma0);
        // A stale proposal is answered with the newer one.
        let stale = Proposal {
            epoch: 2,
            leader: "c".into(),
            incarnation: 0,
            ..p
        };
        match t.handle_proposal(&"relay".into(), stale, 0).as_slice() {
            [TuningOutput::SendProposal { to, proposal }] => {
                assert_eq!(to, &NodeId::from("c"));
                assert_eq!(proposal.epoch, 3);
            }
            other => panic!("{other:?}"),
        }
    }

    /// A proposal's step size is bounded to this node's `[sigma_min, sigma_max]`, as
    /// its weights are clipped (before, only a non-finite or non-positive one was
    /// replaced).
    #[test]
    fn a_proposals_step_size_is_bounded() {
        for (sigma, epoch, want) in [(1e-9, 3, cfg().sigma_min), (1e9, 4, cfg().sigma_max)] {
            let mut t = Tuner::new("b".into(), cfg()).unwrap();
            let mut state = EsState::new(&cfg());
            state.sigma = sigma;
            let p = Proposal {
                epoch,
                leader: "a".into(),
                incarnation: 0,
                weights: cfg().start_weights(),
                candidate: None,
                phase: Phase::MeasureCandidate,
                state,
                switchback_block_ms: None,
            };
            assert!(t.handle_proposal(&"relay".into(), p, 0).is_empty());
            assert_eq!(t.current().unwrap().state.sigma, want, "{sigma}");
        }
    }

    #[test]
    fn implausible_proposals_are_ignored_and_extreme_state_is_bounded() {
        let mut t = Tuner::new("b".into(), cfg()).unwrap();
        let base = Proposal {
            epoch: 3,
            leader: "a".into(),
            incarnation: 0,
            weights: Weights::default(),
            candidate: None,
            phase: Phase::MeasureCandidate,
            state: EsState::new(&cfg()),
            switchback_block_ms: None,
        };
        // An epoch no line reaches (its successor would overflow), more outcomes than
        // the success window, counters at their ends: neither adopted nor answered.
        let mut huge = base.clone();
        huge.epoch = u64::MAX;
        let mut outcomes = base.clone();
        outcomes.state.outcomes = std::iter::repeat_n(true, 9).collect();
        let mut draws = base.clone();
        draws.state.draws = u64::MAX;
        // Switchback blocks of nothing (every request its own block) or of more than
        // an hour (a window of one arm).
        let mut no_block = base.clone();
        no_block.switchback_block_ms = Some(0);
        let mut long_block = base.clone();
        long_block.switchback_block_ms = Some(MAX_SWITCHBACK_BLOCK_MS + 1);
        for p in [huge, outcomes, draws, no_block, long_block] {
            assert!(!p.is_plausible());
            assert!(t.handle_proposal(&"relay".into(), p, 0).is_empty());
            assert!(t.current().is_none());
        }
        // Finite but extreme drift and noise are bounded where they would switch the
        // guard off or settle the line for good.
        let mut extreme = base;
        extreme.state.e2e_drift = -1e300;
        extreme.state.noise_var = f64::INFINITY;
        extreme.state.last_incumbent_p95_ms = Some(f64::INFINITY);
        extreme.state.incumbent_score = Some(-1.0);
        assert!(t.handle_proposal(&"relay".into(), extreme, 0).is_empty());
        let s = &t.current().unwrap().state;
        assert_eq!(s.e2e_drift, -MAX_E2E_DRIFT);
        assert_eq!(s.noise_var, 0.0);
        assert_eq!(s.last_incumbent_p95_ms, None);
        assert_eq!(s.incumbent_score, None);
        assert_eq!(saturating_sum([u64::MAX, 2].into_iter()), u64::MAX);
    }

    #[test]
    fn non_finite_trial_evidence_from_a_peer_is_dropped() {
        let mut t = Tuner::new("b".into(), cfg()).unwrap();
        let mut state = EsState::new(&cfg());
        state.e2e_drift = f64::INFINITY;
        state.pending_trial = Some(Box::new(crate::es::TrialEvidence {
            windows: 1,
            valid: 1,
            sum_log_score: f64::NAN,
            ..Default::default()
        }));
        let p = Proposal {
            epoch: 3,
            leader: "a".into(),
            incarnation: 0,
            weights: cfg().start_weights(),
            candidate: Some(cfg().start_weights()),
            phase: Phase::Interleaved,
            state,
            switchback_block_ms: None,
        };
        assert!(t.handle_proposal(&"relay".into(), p, 0).is_empty());
        let cur = t.current().unwrap();
        assert_eq!(cur.state.pending_trial, None);
        assert_eq!(cur.state.e2e_drift, 0.0);
    }

    #[test]
    fn tune_then_freeze_stops_measuring() {
        let c = TuningConfig {
            mode: TuningMode::TuneThenFreeze,
            sigma0: 0.04,
            // One window per trial: a neutral candidate is decided at once.
            max_trial_windows: 1,
            // No start fit to wait for (`should_freeze`).
            fit_start: false,
            ..cfg()
        };
        let mut t = Tuner::new("a".into(), c).unwrap();
        t.tick(0);
        // Two windows measure the noise, the third decides a trial.
        for epoch in 1..=3u64 {
            serve(&mut t, epoch * 100..epoch * 100 + 10, |_| 100.0);
            t.tick(epoch * 10);
        }
        let cur = t.current().unwrap().clone();
        assert_eq!(cur.phase, Phase::Frozen);
        assert!(cur.state.frozen);
        assert_eq!(t.weights(), cur.state.incumbent);
        // Nothing more is measured or decided; the leader keeps announcing the result.
        for k in 0..20 {
            let a = t.admit(k, 0);
            assert_eq!(
                (a.epoch.epoch(), a.epoch.leader()),
                (cur.epoch, Some(&cur.leader))
            );
            t.record(&a.epoch, a.cell, 1.0, 1.0);
        }
        let out = t.tick(100);
        assert_eq!(t.epoch(), cur.epoch);
        assert!(matches!(out.as_slice(), [TuningOutput::Broadcast(p)] if p.phase == Phase::Frozen));
    }

    /// Samples whose residual is `a * rtt + b * queue` plus a deterministic wobble;
    /// each one's prefill equals its queue, so `queue_cost_factor` is 3.
    fn sums(a: f64, b: f64, n: u64, with_forwards: bool) -> TermSums {
        let mut t = TermSums::default();
        for i in 0..n {
            let rtt = if with_forwards && i % 3 == 0 {
                50.0 + (i % 7) as f64 * 20.0
            } else {
                0.0
            };
            let queue = (i % 11) as f64 * 100.0;
            let wobble = ((i * 7919) % 13) as f64 - 6.0;
            t.add(TermSample {
                rtt_ms: rtt,
                queue_ms: queue,
                residual_ms: a * rtt + b * queue + wobble,
                prefill_ms: queue,
            });
        }
        t
    }

    #[test]
    fn the_fit_recovers_the_weights_and_says_what_it_cannot_see() {
        let [rtt, queue] = sums(2.5, 0.8, 400, true).fit();
        let (a, se_a) = rtt.expect("forwards vary the RTT term");
        let (b, se_b) = queue.expect("the queue varies");
        assert!((a - 2.5).abs() < 0.05 && se_a < 0.05, "{a} {se_a}");
        assert!((b - 0.8).abs() < 0.01 && se_b < 0.01, "{b} {se_b}");
        // No forwards: nothing is known about w_rtt.
        let [rtt, queue] = sums(2.5, 0.8, 400, false).fit();
        assert!(rtt.is_none());
        assert!((queue.unwrap().0 - 0.8).abs() < 0.01);
        // Too few samples, or garbage from the network: no fit, nothing merged.
        assert_eq!(sums(1.0, 1.0, 2, true).fit(), [None, None]);
        let mut t = sums(1.0, 1.0, 100, true);
        let before = t;
        t.merge(&TermSums {
            rr: f64::NAN,
            n: 5,
            ..TermSums::default()
        });
        t.merge(&TermSums {
            qq: -1.0,
            n: 5,
            ..TermSums::default()
        });
        assert_eq!(t, before);
        t.add(TermSample {
            rtt_ms: f64::INFINITY,
            queue_ms: 1.0,
            residual_ms: 1.0,
            prefill_ms: 1.0,
        });
        t.add(TermSample {
            rtt_ms: 0.0,
            queue_ms: -5.0,
            residual_ms: 1.0,
            prefill_ms: 1.0,
        });
        t.add(TermSample {
            rtt_ms: 0.0,
            queue_ms: 5.0,
            residual_ms: 1.0,
            prefill_ms: f64::NAN,
        });
        t.merge(&TermSums {
            p: -1.0,
            n: 5,
            ..TermSums::default()
        });
        assert_eq!(t, before);
    }

    #[test]
    fn the_start_fit_only_raises_a_weight_the_data_pin_down() {
        let cfg = cfg();
        let bad = Weights {
            w_rtt: 2.0,
            w_queue: 0.05,
        };
        // Each request's prefill equals its queue: joining a queue costs everyone
        // 2 + W / S = 3 times its wait.
        assert!((sums(2.5, 1.2, 400, true).queue_cost_factor() - 3.0).abs() < 1e-9);
        // Residual = 2.5 x RTT + 1.2 x queue: both weights are raised, w_rtt to its
        // fit, w_queue to its fit times the cost of joining the queue.
        let w = sums(2.5, 1.2, 400, true).fitted_start(&cfg, bad).unwrap();
        assert!(
            (w.w_rtt - 2.5).abs() < 0.05 && (w.w_queue - 3.6).abs() < 0.03,
            "{w:?}"
        );
        // Residual = 2.5 x RTT + 0.8 x queue: w_queue is pinned above 0.05 but below
        // face value; it goes to 1.0 (the floor of the request's own share) times 3.
        let w = sums(2.5, 0.8, 400, true).fitted_start(&cfg, bad).unwrap();
        assert!(
            (w.w_rtt - 2.5).abs() < 0.05 && (w.w_queue - 3.0).abs() < 1e-9,
            "{w:?}"
        );
        // From below face value a weight moves only when the data pin it above where
        // it is: a fit of 0.04 +- little under a start of 0.05 moves nothing.
        assert_eq!(sums(2.0, 0.04, 400, false).fitted_start(&cfg, bad), None);
        // A fit below the incumbent never lowers it.
        let high = Weights {
            w_rtt: 4.0,
            w_queue: 1.0,
        };
        assert_eq!(sums(2.5, 0.8, 400, true).fitted_start(&cfg, high), None);
        // Without forwards w_rtt keeps its start; fits past the bounds are clipped.
        let w = sums(9.0, 9.0, 400, false).fitted_start(&cfg, bad).unwrap();
        assert_eq!(
            w,
            Weights {
                w_rtt: 2.0,
                w_queue: cfg.w_queue.max
            }
        );
    }

    /// A leader whose line starts at `w_queue` 0.05 (the issue's bad start).
    fn bad_start_tuner() -> Tuner {
        let cfg = TuningConfig {
            w_queue: crate::es::ParamBounds {
                start: 0.05,
                ..cfg().w_queue
            },
            ..cfg()
        };
        let mut t = Tuner::new("a".into(), cfg).unwrap();
        let p = broadcasts(&t.tick(0))[0].clone();
        assert_eq!(p.weights.w_queue, 0.05);
        t
    }

    /// Serve `keys` locally; `residual(k, queue)` is the TTFT request `k` waited beyond
    /// its prefill (300 ms) with a queue term of `queue` ms (0-800 by key).
    fn serve_terms(t: &mut Tuner, keys: std::ops::Range<u64>, residual: impl Fn(u64, f64) -> f64) {
        serve_terms_measured(t, keys, residual, |_, r| 300.0 + r);
    }

    /// [`serve_terms`] with the TTFT each arm's halves measure given apart:
    /// `ttft(cell, residual)`.
    fn serve_terms_measured(
        t: &mut Tuner,
        keys: std::ops::Range<u64>,
        residual: impl Fn(u64, f64) -> f64,
        ttft: impl Fn(Cell, f64) -> f64,
    ) {
        for k in keys {
            let a = t.admit(crate::hash::hash_bytes(&k.to_le_bytes()), 0);
            let queue = (k % 5) as f64 * 200.0;
            let residual_ms = residual(k, queue);
            t.record(&a.epoch, a.cell, ttft(a.cell, residual_ms), 1000.0);
            t.record_terms(
                &a.epoch,
                TermSample {
                    rtt_ms: 0.0,
                    queue_ms: queue,
                    residual_ms,
                    prefill_ms: 300.0,
                },
            );
        }
    }

    fn start_fit_records(out: &[TuningOutput]) -> usize {
        out.iter()
            .filter(|o| matches!(o, TuningOutput::Record(r) if r.verdict == Verdict::StartFit))
            .count()
    }

    #[test]
    fn a_line_starts_from_the_fitted_weights_once() {
        let mut t = bad_start_tuner();
        // Every request's TTFT is 300 ms of prefill plus its queue term in full.
        let serve_fit = |t: &mut Tuner, keys| serve_terms(t, keys, |_, queue| queue);
        serve_fit(&mut t, 0..10);
        let out = t.tick(10);
        let rec = first_record(&out).expect("the start fit is recorded");
        assert_eq!(rec.verdict, Verdict::StartFit);
        assert!(rec.accepted);
        // The fit (1.0) times the cost of joining the queue: 2 + a mean queue of 400 ms
        // over a prefill of 300.
        assert_eq!(rec.candidate.w_rtt, 1.0);
        assert!(
            (rec.candidate.w_queue - (2.0 + 400.0 / 300.0)).abs() < 1e-9,
            "{:?}",
            rec.candidate
        );
        let next = t.current().unwrap().clone();
        assert_eq!(next.weights, rec.candidate, "the line goes on from the fit");
        assert_eq!(next.phase, Phase::Interleaved);
        assert!(next.state.start_fitted);
        let fit = t.start_fit().expect("the leader keeps what it fitted");
        assert_eq!((fit.epoch, fit.samples, fit.w_rtt), (1, 10, None));
        assert!((fit.queue_cost_factor - (2.0 + 400.0 / 300.0)).abs() < 1e-9);
        assert_eq!(fit.moved_to, Some(rec.candidate));
        // The next window is a trial, not another fit.
        serve_fit(&mut t, 10..20);
        assert_eq!(start_fit_records(&t.tick(20)), 0);
    }

    #[test]
    fn a_start_fit_one_window_cannot_pin_takes_the_next_windows_too() {
        let mut t = bad_start_tuner();
        // Window 1: the queue term is right on average, +-600 ms of noise around it:
        // its fit (1.0 +- 0.41) pins nothing, and the line stays unfitted.
        serve_terms(&mut t, 0..10, |k, q| {
            if k % 2 == 0 {
                q + 600.0
            } else {
                q - 600.0
            }
        });
        assert_eq!(start_fit_records(&t.tick(10)), 0);
        assert!(!t.current().unwrap().state.start_fitted);
        let fit = t.start_fit().expect("the leader shows the fit so far");
        assert_eq!((fit.samples, fit.moved_to), (10, None));
        // Window 2 adds ten clean requests: over both windows w_queue is pinned at 1.0,
        // and raised to that times the cost of joining the queue (2 + 400 / 300).
        serve_terms(&mut t, 10..20, |_, q| q);
        let out = t.tick(20);
        assert_eq!(start_fit_records(&out), 1);
        let fit = t.start_fit().unwrap();
        assert_eq!(fit.samples, 20, "the fit is over both windows");
        let moved = fit.moved_to.expect("w_queue is raised");
        assert!(
            (moved.w_queue - (2.0 + 400.0 / 300.0)).abs() < 1e-9,
            "{moved:?}"
        );
        assert!(t.current().unwrap().state.start_fitted);
    }

    /// A `tune-then-freeze` line that settles before its start fit has pinned anything
    /// goes on fitting, and freezes at the fitted weights, not at the start.
    #[test]
    fn tune_then_freeze_freezes_only_once_the_start_fit_is_done() {
        let cfg = TuningConfig {
            mode: TuningMode::TuneThenFreeze,
            w_queue: crate::es::ParamBounds {
                start: 0.05,
                ..cfg().w_queue
            },
            ..cfg()
        };
        let mut t = Tuner::new("a".into(), cfg).unwrap();
        t.tick(0);
        // Halves 2x apart (the line settles once it has measured that), and a queue
        // term right on average with +-600 ms around it (nothing pinned) or exact.
        let serve = |t: &mut Tuner, keys: std::ops::Range<u64>, noisy_fit: bool| {
            let residual = |k: u64, queue: f64| match (noisy_fit, k % 2) {
                (true, 0) => queue + 600.0,
                (true, _) => queue - 600.0,
                (false, _) => queue,
            };
            let halves = |cell: Cell, _| if cell.is_multiple_of(2) { 100.0 } else { 200.0 };
            serve_terms_measured(t, keys, residual, halves);
        };
        for w in 1..=2u64 {
            serve(&mut t, (w - 1) * 10..w * 10, true);
            assert_eq!(start_fit_records(&t.tick(w * 10)), 0, "window {w}");
        }
        let p = t.current().unwrap();
        assert!(p.state.is_settled(t.config()));
        assert!(!p.state.start_fitted);
        assert_ne!(p.phase, Phase::Frozen, "frozen before the start fit");
        let mut w = 2u64;
        while !t.current().unwrap().state.start_fitted {
            w += 1;
            assert!(w <= u64::from(FIT_MAX_WINDOWS), "never fitted");
            serve(&mut t, (w - 1) * 10..w * 10, false);
            t.tick(w * 10);
        }
        let p = t.current().unwrap();
        assert_eq!(p.phase, Phase::Frozen);
        assert!(p.weights.w_queue > 1.0, "{:?}", p.weights);
    }

    #[test]
    fn a_start_fit_gives_up_after_its_windows() {
        let mut t = bad_start_tuner();
        // No forwards and no queue: nothing to fit, ever.
        for w in 0..u64::from(FIT_MAX_WINDOWS) {
            assert!(!t.current().unwrap().state.start_fitted, "window {w}");
            let keys = w * 10..w * 10 + 10;
            for k in keys {
                let a = t.admit(crate::hash::hash_bytes(&k.to_le_bytes()), 0);
                t.record(&a.epoch, a.cell, 300.0, 1000.0);
                t.record_terms(
                    &a.epoch,
                    TermSample {
                        rtt_ms: 0.0,
                        queue_ms: 0.0,
                        residual_ms: 5.0,
                        prefill_ms: 300.0,
                    },
                );
            }
            assert_eq!(start_fit_records(&t.tick(w * 10 + 10)), 0);
        }
        assert!(t.current().unwrap().state.start_fitted);
        assert_eq!(t.current().unwrap().state.incumbent.w_queue, 0.05);
    }

    #[test]
    fn term_samples_come_from_the_decision_terms() {
        let terms = CostTerms {
            rtt_ms: 200.0,
            prefill_ms: 300.0,
            queue_ms: 50.0,
            stall_ms: 0.0,
            total_ms: 550.0,
            cached_tokens: 0,
            uncached_tokens: 1000,
            reprefill_tokens: 0,
            t_p_ms: 0.3,
            raw_queue_ms: 100.0,
            forward_bias_ms: 0.0,
            slot_wait_ms: 0.0,
            tokens_ahead: 0,
            // RTT 100 + base 20 + prefill 300 + queue 100.
            estimated_ttft_ms: Some(520.0),
        };
        let w = Weights {
            w_rtt: 2.0,
            w_queue: 0.5,
        };
        let s = TermSample::new(&terms, w, 700.0).unwrap();
        assert_eq!((s.rtt_ms, s.queue_ms, s.residual_ms), (100.0, 100.0, 380.0));
        let no_prediction = CostTerms {
            estimated_ttft_ms: None,
            ..terms
        };
        assert!(TermSample::new(&no_prediction, w, 700.0).is_none());
    }
}
