//! The node's side of online tuning: a thin driver around the sans-IO
//! [`gorgo_core::tuning::Tuner`] (docs/design.md, "Online tuning").
//!
//! What the driver adds to the core state machine:
//! - admission: the `(epoch, weights)` pair a client request is routed and attributed
//!   under, read under one lock so the two always match;
//! - the mode switch of `PUT /admin/weights` (`online`, `static`, `tune-then-freeze`),
//!   which switches the tuner in place, keeping the line of proposals it follows;
//! - the trajectory shown by `GET /admin/tuning`: every trial this node decided, with
//!   the tuner state after the decision, in docs/design.md's `tuning.jsonl` shape and in
//!   the paper's `es_tune_trace` shape;
//! - the learned-weights file (the paper's `paper_learned_weights.json` format).
//!
//! Moving messages is the caller's job ([`crate::NodeState::tuning_tick`] and
//! [`crate::NodeState::on_tuning_message`]): the driver returns [`TuningSend`]s.

use std::collections::{BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use gorgo_core::es::{
    TrialHold, TuningConfig, TuningMode, Verdict, SIGMA_DECAY, SUCCESS_WINDOW, TARGET_SUCCESS_RATE,
};
use gorgo_core::tuning::{
    Cell, EpochKey, OpenRequest, Phase, StartFit, TermSample, Tuner, TuningMessage, TuningOutput,
    TuningRecord, HISTORY_LEN,
};
use gorgo_core::{NodeId, Weights};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::error::NodeError;

/// Kind byte of tuning messages on the cluster's application channel.
pub const TUNING_APP_KIND: u8 = 0x54;

/// Largest learned-weights file read, bytes.
const MAX_WEIGHTS_FILE: u64 = 64 * 1024;

/// The learned-weights file: the paper's `paper_learned_weights.json` format. GORGO's
/// cost has no prefill or load weight (both terms enter with 1.0), so those two are
/// written as 1.0 and must be 1.0 when read.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LearnedWeights {
    /// `w_rtt`.
    pub rtt_weight: f64,
    /// Fixed at 1.0 in GORGO.
    #[serde(default = "one")]
    pub prefill_weight: f64,
    /// Fixed at 1.0 in GORGO.
    #[serde(default = "one")]
    pub load_weight: f64,
    /// `w_queue`.
    pub queue_weight: f64,
}

fn one() -> f64 {
    1.0
}

impl From<Weights> for LearnedWeights {
    fn from(w: Weights) -> Self {
        LearnedWeights {
            rtt_weight: w.w_rtt,
            prefill_weight: 1.0,
            load_weight: 1.0,
            queue_weight: w.w_queue,
        }
    }
}

/// Read a learned-weights file. Errors name the file and the field.
pub fn read_learned_weights(path: &Path) -> Result<Weights, NodeError> {
    let bad = |m: String| NodeError::Config(format!("tuning.weights_file {}: {m}", path.display()));
    // Capped while reading: a length checked beforehand says 0 for `/dev/zero`.
    let text = gorgo_files::read_capped(path, MAX_WEIGHTS_FILE).map_err(|e| bad(e.to_string()))?;
    let lw: LearnedWeights = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    for (name, v) in [
        ("rtt_weight", lw.rtt_weight),
        ("queue_weight", lw.queue_weight),
    ] {
        // The one rule for weights a person gives (`routing.weights`, `PUT
        // /admin/weights`), so that weights the file set can be put back.
        if !(v.is_finite() && (0.0..=gorgo_core::types::MAX_WEIGHT).contains(&v)) {
            return Err(bad(format!(
                "`{name}` must be in [0, {}]",
                gorgo_core::types::MAX_WEIGHT
            )));
        }
    }
    for (name, v) in [
        ("prefill_weight", lw.prefill_weight),
        ("load_weight", lw.load_weight),
    ] {
        if v != 1.0 {
            return Err(bad(format!(
                "`{name}` must be 1.0 (GORGO's cost has no such weight)"
            )));
        }
    }
    Ok(Weights {
        w_rtt: lw.rtt_weight,
        w_queue: lw.queue_weight,
    })
}

/// Write a learned-weights file (pretty JSON, the paper's format), atomically
/// ([`gorgo_files::write_atomic`]: into a temporary file beside it, then renamed over
/// it), so that a reader (a node started from it) never finds it half written, and a
/// failed write leaves the old one whole.
pub fn write_learned_weights(path: &Path, w: Weights) -> Result<(), NodeError> {
    let text = serde_json::to_string_pretty(&LearnedWeights::from(w))
        .map_err(|e| NodeError::Config(e.to_string()))?;
    if path.file_name().is_none() {
        return Err(NodeError::Config(format!(
            "tuning.learned_weights_out {}: not a file",
            path.display()
        )));
    }
    gorgo_files::write_atomic(path, (text + "\n").as_bytes()).map_err(NodeError::from)
}

/// Where the learned weights go once tuning freezes, and whether they are there yet:
/// shared with the write in flight ([`LearnedWrite`]), which runs away from the
/// driver's lock, so that file work never holds up admission.
#[derive(Debug)]
struct LearnedOut {
    path: PathBuf,
    state: Mutex<LearnedState>,
    written: watch::Sender<Option<Weights>>,
}

#[derive(Debug, Default)]
struct LearnedState {
    /// Weights frozen on and not yet written.
    pending: Option<Weights>,
    /// A [`LearnedWrite`] is out: one write at a time.
    in_flight: bool,
    /// Failed writes in a row (the first is a warning, the rest quieter).
    failures: u32,
}

impl LearnedOut {
    /// The write to do now, if the frozen weights are not written and no write is out.
    fn next_write(self: &Arc<Self>) -> Option<LearnedWrite> {
        let mut s = self.state.lock();
        let weights = s.pending.filter(|_| !s.in_flight)?;
        s.in_flight = true;
        Some(LearnedWrite {
            out: Arc::clone(self),
            weights,
        })
    }
}

/// The learned-weights file to write ([`Effects::learned_write`]): handed out by every
/// step of the driver once tuning has frozen, one at a time, until a write succeeds.
/// It holds no lock; [`LearnedWrite::write`] does the blocking file work, so the
/// caller runs it where blocking is allowed.
#[derive(Debug)]
pub struct LearnedWrite {
    out: Arc<LearnedOut>,
    weights: Weights,
}

impl LearnedWrite {
    /// Write the file (atomically, [`write_learned_weights`]) and log the outcome. A
    /// failed write is handed out again at a later step of the driver.
    pub fn write(self) -> Result<(), NodeError> {
        let path = &self.out.path;
        let result = write_learned_weights(path, self.weights);
        let mut s = self.out.state.lock();
        match &result {
            Ok(()) => {
                if s.pending == Some(self.weights) {
                    s.pending = None;
                }
                if s.failures > 0 {
                    tracing::info!(path = %path.display(), "learned weights written after all");
                }
                s.failures = 0;
                self.out.written.send_replace(Some(self.weights));
            }
            Err(e) => {
                s.failures += 1;
                if s.failures == 1 {
                    tracing::warn!(path = %path.display(), error = %e, "cannot write learned weights; retrying each tick");
                } else {
                    tracing::debug!(path = %path.display(), error = %e, "cannot write learned weights");
                }
            }
        }
        result
    }
}

impl Drop for LearnedWrite {
    /// Written or not (a write dropped unrun, e.g. at shutdown): the next may go out.
    fn drop(&mut self) {
        self.out.state.lock().in_flight = false;
    }
}

/// One trial this node decided, with the tuner state right after the decision: a line
/// of `GET /admin/tuning`'s `history` (docs/design.md's `tuning.jsonl` fields first).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrialEntry {
    /// The core's record (epoch, leader, candidate, incumbent, scores, sigma,
    /// accepted, verdict, samples).
    #[serde(flatten)]
    pub record: TuningRecord,
    /// Wall-clock time of the decision, RFC 3339 UTC.
    pub wall_ts: String,
    /// Node uptime at the decision, s.
    pub monotonic_s: f64,
    /// The record's running index, as the paper's trace numbers its lines: one past
    /// this node's previous record, and at least the trials decided along the line
    /// (this one included), so that a new leader's steps count on from the line's
    /// trials. A start fit or an invalid measurement is a record but not a trial: by
    /// the line's trial count alone it repeated the step before it.
    pub step: u64,
    /// Requests measured in the windows of this node's decisions so far, both arms (a
    /// start fit's one window once).
    pub total_samples: u64,
    /// Best weights after the decision.
    pub best: Weights,
    /// Their p95 TTFT in this trial, ms (`None` when the record measured none).
    pub best_p95_ttft_ms: Option<f64>,
    /// Step size after the decision (the 1/5 rule applied).
    pub sigma_after: f64,
    /// Share of accepted outcomes in the 1/5 rule's window.
    pub success_rate: Option<f64>,
    /// That window, oldest first.
    pub recent_outcomes: Vec<bool>,
    /// The next candidate this node proposed on the line, once it did.
    pub next_candidate: Option<Weights>,
    /// Sigma has fallen below `freeze_sigma`.
    pub converged: bool,
}

impl TrialEntry {
    /// The line in the paper's format (`paper_es_tune_trace_apr5.jsonl`): score is
    /// -p95 TTFT in seconds, params are `rtt_weight` / `queue_weight`.
    pub fn paper_line(&self, cfg: &TuningConfig) -> Value {
        let params = |w: Weights| json!({"rtt_weight": w.w_rtt, "queue_weight": w.w_queue});
        let neg_s = |ms: f64| -ms / 1000.0;
        json!({
            "kind": "tune",
            "mode": "online-es",
            "wall_ts": self.wall_ts,
            "monotonic_s": self.monotonic_s,
            "step": self.step,
            "total_samples": self.total_samples,
            "window_size": cfg.window,
            "converged": self.converged,
            "accepted": self.record.accepted,
            "candidate": params(self.record.candidate),
            "score": neg_s(self.record.score_p95_ttft_ms),
            "best_score": self.best_p95_ttft_ms.map(neg_s),
            "best_params": params(self.best),
            "proposal": self.next_candidate.map(params),
            "sigma": self.sigma_after,
            "success_rate": self.success_rate,
            "objective_metric": "neg_p95_ttft",
            "rechenberg": {
                "recent_outcomes": self.recent_outcomes,
                "success_window": SUCCESS_WINDOW,
                "target_rate": TARGET_SUCCESS_RATE,
                "sigma_decay": SIGMA_DECAY,
                "sigma_min": cfg.sigma_min,
                "evaluated_after_baseline": self.step,
            },
            // GORGO's extensions, which the paper's trace does not have.
            "epoch": self.record.epoch,
            "leader": self.record.leader,
            "incumbent_score": neg_s(self.record.incumbent_p95_ttft_ms),
            "verdict": self.record.verdict,
        })
    }
}

/// A tuning message to move.
#[derive(Debug, Clone, PartialEq)]
pub enum TuningSend {
    /// To every live peer.
    All(TuningMessage),
    /// To one peer.
    To(NodeId, TuningMessage),
}

/// The weights, epoch and measurement cell a client request is routed and attributed
/// under (the core's assignment; in static mode, the static weights).
pub type Admission = gorgo_core::tuning::Assignment;

/// What a step of the driver asks the caller to do.
#[derive(Debug, Default)]
pub struct Effects {
    /// Messages to send.
    pub sends: Vec<TuningSend>,
    /// Trials decided in this step.
    pub decided: Vec<TuningRecord>,
    /// Tuning just froze on these weights (`tune-then-freeze`).
    pub frozen: Option<Weights>,
    /// The learned-weights file to write, when one is configured and tuning has
    /// frozen: in every step's effects, one at a time, until written.
    pub learned_write: Option<LearnedWrite>,
}

/// `GET /admin/tuning`.
#[derive(Debug, Clone, Serialize)]
pub struct TuningView {
    /// The node.
    pub node: NodeId,
    /// Its mode.
    pub mode: TuningMode,
    /// The epoch it routes under (0 before any proposal).
    pub epoch: u64,
    /// That epoch's leader.
    pub leader: Option<NodeId>,
    /// True while this node leads.
    pub is_leader: bool,
    /// What the epoch measures.
    pub phase: Option<Phase>,
    /// The weights it routes with (the incumbent's arm of an interleaved trial).
    pub weights: Weights,
    /// The candidate's arm of an interleaved trial.
    pub candidate: Option<Weights>,
    /// A switchback epoch's block length, ms (absent when arms go by request).
    pub switchback_block_ms: Option<u64>,
    /// Best weights along the line.
    pub incumbent: Option<Weights>,
    /// Current step size.
    pub sigma: Option<f64>,
    /// Trials decided along the line.
    pub trials: Option<u64>,
    /// Why this interleaved window runs no candidate (`measuring-noise`, `settled`);
    /// absent while a trial runs.
    pub trial_hold: Option<TrialHold>,
    /// The line's measured noise: sd of the log ratio of the two halves' tail TTFT
    /// under the same weights (absent before any sample).
    pub noise_sd: Option<f64>,
    /// The improvement a trial must show to be accepted at that noise (a fraction of
    /// the incumbent's score; absent while the noise is not measured).
    pub required_improvement: Option<f64>,
    /// The window's size: samples, cluster-wide, that close it (`window_requests`).
    pub window_requests: usize,
    /// Requests this node measures that have had their first token and not their end:
    /// lower bounds on their E2E in its reports.
    pub open_requests: usize,
    /// Requests whose decision terms this node has given the start fit, since it
    /// started (docs/tuning.md, "The start fit").
    pub fit_samples: u64,
    /// What the start fit found, when this node made it as leader.
    pub start_fit: Option<StartFit>,
    /// Trials this node decided, oldest first.
    pub history: Vec<TrialEntry>,
    /// The same trials in the paper's trace format.
    pub es_trace: Vec<Value>,
}

struct Inner {
    tuner: Tuner,
    cfg: TuningConfig,
    static_weights: Weights,
    live: BTreeSet<NodeId>,
    trace: VecDeque<TrialEntry>,
    total_samples: u64,
    fit_samples: u64,
    froze_at_epoch: Option<u64>,
    learned_out: Option<Arc<LearnedOut>>,
}

/// One node's tuning: the core tuner plus what the node needs around it.
pub struct TuningDriver {
    id: NodeId,
    inner: Mutex<Inner>,
    epoch_tx: watch::Sender<u64>,
}

impl std::fmt::Debug for TuningDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TuningDriver")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl TuningDriver {
    /// A driver for node `id`. `static_weights` are routed with in `static` mode.
    pub fn new(id: NodeId, cfg: TuningConfig, static_weights: Weights) -> Result<Self, NodeError> {
        // This run's start, µs: a later run of the node has a larger one, so what it
        // proposes wins over what an earlier run proposed under the same epoch.
        let incarnation = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_micros() as u64;
        let tuner = Tuner::new(id.clone(), cfg)
            .map_err(|e| NodeError::Config(format!("invalid `tuning`: {e}")))?
            .with_incarnation(incarnation);
        Ok(TuningDriver {
            id,
            inner: Mutex::new(Inner {
                tuner,
                cfg,
                static_weights,
                live: BTreeSet::new(),
                trace: VecDeque::new(),
                total_samples: 0,
                fit_samples: 0,
                froze_at_epoch: None,
                learned_out: None,
            }),
            epoch_tx: watch::channel(0).0,
        })
    }

    /// Write the weights to `path` when `tune-then-freeze` freezes: the driver hands
    /// the write out in its effects ([`Effects::learned_write`]) until it succeeds, and
    /// [`TuningDriver::learned_weights_written`] says when it has.
    pub fn with_learned_weights_out(self, path: Option<PathBuf>) -> Self {
        self.inner.lock().learned_out = path.map(|path| {
            Arc::new(LearnedOut {
                path,
                state: Mutex::new(LearnedState::default()),
                written: watch::channel(None).0,
            })
        });
        self
    }

    /// The weights last written to the learned-weights file (`None` until one is):
    /// the phase shows frozen before the file is there, so whoever needs the file
    /// waits on this. Closed when no file is configured.
    pub fn learned_weights_written(&self) -> watch::Receiver<Option<Weights>> {
        match &self.inner.lock().learned_out {
            Some(out) => out.written.subscribe(),
            None => watch::channel(None).1,
        }
    }

    /// The epoch, cell and weights to route a new client request with. `key` is a
    /// well-mixed hash of the request's id: in an interleaved trial it picks the arm.
    ///
    /// A switchback trial's blocks are read off the wall clock: every node's clock,
    /// within its NTP error, so every node routes a block with the same arm.
    pub fn admit(&self, key: u64) -> Admission {
        let unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis() as u64;
        let inner = self.inner.lock();
        let a = inner.tuner.admit(key, unix_ms);
        match inner.cfg.mode {
            TuningMode::Static => Admission {
                weights: inner.static_weights,
                ..a
            },
            _ => a,
        }
    }

    /// The weights routing uses now.
    pub fn weights(&self) -> Weights {
        self.inner.lock().weights()
    }

    /// The mode in force.
    pub fn mode(&self) -> TuningMode {
        self.inner.lock().cfg.mode
    }

    /// The epoch requests are admitted under now.
    pub fn epoch(&self) -> u64 {
        self.inner.lock().tuner.epoch()
    }

    /// The tuner configuration in force.
    pub fn config(&self) -> TuningConfig {
        self.inner.lock().cfg
    }

    /// The leader of the epoch this node follows.
    pub fn leader(&self) -> Option<NodeId> {
        self.inner.lock().tuner.current().map(|p| p.leader.clone())
    }

    /// True while this node leads the epoch it follows.
    pub fn is_leader(&self) -> bool {
        self.inner.lock().tuner.is_leader()
    }

    /// Changes whenever the followed epoch does (tests wait on it; no polling).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.epoch_tx.subscribe()
    }

    /// A request admitted under `epoch` (its [`Admission::epoch`]: epoch and leader)
    /// in `cell` sent its first byte to the client after `ttft_ms`, with the same
    /// request's start-fit evidence (`Tuner::record_terms`), if it has any: one lock
    /// per first byte. Recorded then, not at the end, so that a request still decoding
    /// when the window closes counts for its TTFT (`Tuner::record_first_token`).
    /// `now_ms` is the clock of [`TuningDriver::tick`]. The handle, when the TTFT
    /// counted, goes back to [`TuningDriver::record_finish`] or
    /// [`TuningDriver::abandon`] when the response ends; until then the request's time
    /// so far is a lower bound on its E2E in the reports.
    pub fn record_first_token(
        &self,
        epoch: &EpochKey,
        cell: Cell,
        ttft_ms: f64,
        now_ms: u64,
        terms: Option<TermSample>,
    ) -> Option<OpenRequest> {
        let mut inner = self.inner.lock();
        let open = inner.tuner.record_first_token(epoch, cell, ttft_ms, now_ms);
        if let Some(sample) = terms {
            if inner.tuner.record_terms(epoch, sample) {
                inner.fit_samples += 1;
            }
        }
        open
    }

    /// A request admitted under `epoch` in `cell` timed out before its first token,
    /// after `waited_ms`: that wait counts as its TTFT and its E2E, a lower bound on
    /// each. Left out, an arm whose requests ran into the deadline had its slowest
    /// requests taken out of its p95, and looked better for it.
    pub fn record_timed_out(&self, epoch: &EpochKey, cell: Cell, waited_ms: f64) {
        self.inner
            .lock()
            .tuner
            .record(epoch, cell, waited_ms, waited_ms);
    }

    /// The same request finished after `e2e_ms` (the E2E guard's evidence).
    pub fn record_finish(&self, open: OpenRequest, e2e_ms: f64) {
        self.inner.lock().tuner.record_finish(open, e2e_ms);
    }

    /// The same request ended without an E2E to count (failed, or its client left).
    pub fn abandon(&self, open: OpenRequest) {
        self.inner.lock().tuner.abandon(open);
    }

    /// Periodic work: follow the membership view (`live`: peers believed alive), then
    /// lead, take over or report.
    pub fn tick(&self, live: impl IntoIterator<Item = NodeId>, now_ms: u64) -> Effects {
        let mut inner = self.inner.lock();
        inner.live = live.into_iter().collect();
        let view: Vec<NodeId> = inner.live.iter().cloned().collect();
        inner.tuner.set_membership(view);
        let outs = inner.tuner.tick(now_ms);
        self.absorb(&mut inner, outs, now_ms)
    }

    /// A tuning message from peer `from` (authenticated by the transport). A report
    /// claiming to come from another node is dropped.
    pub fn handle(&self, from: &NodeId, msg: TuningMessage, now_ms: u64) -> Effects {
        let mut inner = self.inner.lock();
        let outs = match msg {
            TuningMessage::Proposal(p) => inner.tuner.handle_proposal(from, p, now_ms),
            TuningMessage::Report(r) => {
                if &r.from != from {
                    tracing::debug!(%from, claimed = %r.from, "tuning report with a spoofed sender dropped");
                    return Effects::default();
                }
                inner.tuner.handle_report(r, now_ms)
            }
        };
        self.absorb(&mut inner, outs, now_ms)
    }

    /// Switch mode (`PUT /admin/weights`). `static` routes with `weights` (or the
    /// current weights when `None`); `online` and `tune-then-freeze` keep following the
    /// line of proposals this node knows of, and ignore `weights`.
    pub fn set_mode(&self, mode: TuningMode, weights: Option<Weights>) -> Result<(), NodeError> {
        let mut inner = self.inner.lock();
        let current_weights = inner.weights();
        // In place: the line, the open requests and the window's measurements stay (a
        // tune-then-freeze line that froze stays frozen).
        inner.tuner.set_mode(mode);
        inner.cfg.mode = mode;
        inner.static_weights = weights.unwrap_or(current_weights);
        let epoch = inner.tuner.epoch();
        drop(inner);
        self.epoch_tx.send_replace(epoch);
        Ok(())
    }

    /// Everything `GET /admin/tuning` shows.
    pub fn view(&self) -> TuningView {
        let inner = self.inner.lock();
        let cur = inner.tuner.current();
        let history: Vec<TrialEntry> = inner.trace.iter().cloned().collect();
        let es_trace = history.iter().map(|e| e.paper_line(&inner.cfg)).collect();
        TuningView {
            node: self.id.clone(),
            mode: inner.cfg.mode,
            epoch: inner.tuner.epoch(),
            leader: cur.map(|p| p.leader.clone()),
            is_leader: inner.tuner.is_leader(),
            phase: cur.map(|p| p.phase),
            weights: inner.weights(),
            candidate: cur
                .filter(|_| inner.cfg.mode != TuningMode::Static)
                .and_then(|p| p.candidate),
            switchback_block_ms: cur.and_then(|p| p.switchback_block_ms),
            incumbent: cur.map(|p| p.state.incumbent),
            sigma: cur.map(|p| p.state.sigma),
            trials: cur.map(|p| p.state.trials),
            trial_hold: cur
                .filter(|p| p.phase == Phase::Interleaved && p.candidate.is_none())
                .and_then(|p| p.state.trial_hold(&inner.cfg)),
            noise_sd: cur.and_then(|p| p.state.noise_sd()),
            required_improvement: cur.and_then(|p| p.state.required_improvement(&inner.cfg)),
            window_requests: inner.cfg.window,
            open_requests: inner.tuner.open_requests(),
            fit_samples: inner.fit_samples,
            start_fit: inner.tuner.start_fit().copied(),
            history,
            es_trace,
        }
    }

    /// Turn the core's outputs into sends, keep the trajectory, notice a freeze.
    fn absorb(&self, inner: &mut Inner, outs: Vec<TuningOutput>, now_ms: u64) -> Effects {
        let mut fx = Effects::default();
        for o in outs {
            match o {
                TuningOutput::Broadcast(p) => {
                    let candidate = match p.phase {
                        Phase::MeasureCandidate => Some(p.weights),
                        Phase::Interleaved => p.candidate,
                        _ => None,
                    };
                    if let (Some(c), true) = (candidate, p.leader == self.id) {
                        if let Some(last) = inner.trace.back_mut() {
                            if last.next_candidate.is_none() && p.epoch > last.record.epoch {
                                last.next_candidate = Some(c);
                            }
                        }
                    }
                    fx.sends.push(TuningSend::All(TuningMessage::Proposal(p)));
                }
                TuningOutput::SendProposal { to, proposal } => {
                    fx.sends
                        .push(TuningSend::To(to, TuningMessage::Proposal(proposal)));
                }
                TuningOutput::SendReport { to, report } => {
                    fx.sends
                        .push(TuningSend::To(to, TuningMessage::Report(report)));
                }
                TuningOutput::Record(r) => {
                    // A start fit's record gives its one window as both arms'
                    // measurement: counted once.
                    // Saturating: the counts come from peers' reports.
                    inner.total_samples =
                        inner
                            .total_samples
                            .saturating_add(if r.verdict == Verdict::StartFit {
                                r.samples
                            } else {
                                r.samples.saturating_add(r.incumbent_samples)
                            });
                    let state = inner.tuner.current().map(|p| p.state.clone());
                    let trials = state.as_ref().map_or(0, |s| s.trials);
                    let step = inner.trace.back().map_or(0, |e| e.step) + 1;
                    let entry = TrialEntry {
                        wall_ts: rfc3339_now(),
                        monotonic_s: now_ms as f64 / 1000.0,
                        step: step.max(trials),
                        total_samples: inner.total_samples,
                        best: state.as_ref().map_or(r.incumbent, |s| s.incumbent),
                        // The p95 of whichever arm is the incumbent now, as measured
                        // in this trial (the state's score is the tail mean the trials
                        // compare, not a p95).
                        best_p95_ttft_ms: Some(if r.accepted {
                            r.score_p95_ttft_ms
                        } else {
                            r.incumbent_p95_ttft_ms
                        })
                        .filter(|p| p.is_finite() && *p > 0.0),
                        sigma_after: state.as_ref().map_or(r.sigma, |s| s.sigma),
                        success_rate: state.as_ref().and_then(|s| s.success_rate()),
                        recent_outcomes: state
                            .as_ref()
                            .map(|s| s.outcomes.iter().copied().collect())
                            .unwrap_or_default(),
                        next_candidate: None,
                        converged: state
                            .as_ref()
                            .is_some_and(|s| s.sigma < inner.cfg.freeze_sigma),
                        record: r.clone(),
                    };
                    if inner.trace.len() >= HISTORY_LEN {
                        inner.trace.pop_front();
                    }
                    inner.trace.push_back(entry);
                    fx.decided.push(r);
                }
            }
        }
        // Once per line: a mode switch keeps the line, frozen or not, and with it
        // whether its freeze was reported.
        if let Some(p) = inner.tuner.current() {
            if p.phase == Phase::Frozen && inner.froze_at_epoch.is_none() {
                inner.froze_at_epoch = Some(p.epoch);
                fx.frozen = Some(p.weights);
                if let Some(out) = &inner.learned_out {
                    out.state.lock().pending = Some(p.weights);
                }
            }
        }
        // Not here, under the lock every admission takes: the caller writes.
        fx.learned_write = inner.learned_out.as_ref().and_then(LearnedOut::next_write);
        self.epoch_tx.send_if_modified(|e| {
            let now = inner.tuner.epoch();
            let changed = *e != now;
            *e = now;
            changed
        });
        fx
    }
}

impl Inner {
    fn weights(&self) -> Weights {
        match self.cfg.mode {
            TuningMode::Static => self.static_weights,
            _ => self.tuner.weights(),
        }
    }
}

/// Now as RFC 3339 UTC with microseconds (the paper's `wall_ts`).
fn rfc3339_now() -> String {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    rfc3339(d.as_secs(), d.subsec_micros())
}

fn rfc3339(secs: u64, micros: u32) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (year, month, day) = gorgo_core::calendar::civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{micros:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> TuningConfig {
        TuningConfig {
            window: 4,
            min_samples: 2,
            startup_grace_ms: 0,
            // Every window decides its trial (a neutral one would take four).
            max_trial_windows: 1,
            ..TuningConfig::gorgo()
        }
    }

    /// Requests `keys` admitted and finished now, each with `ttft` ms.
    fn serve(d: &TuningDriver, keys: std::ops::Range<u64>, ttft: f64) {
        for k in keys {
            let a = d.admit(gorgo_core::hash::hash_bytes(&k.to_le_bytes()));
            if let Some(open) = d.record_first_token(&a.epoch, a.cell, ttft, 0, None) {
                d.record_finish(open, 500.0);
            }
        }
    }

    /// A request that timed out before its first token counts its wait as its TTFT
    /// and E2E: a candidate whose requests all run into the deadline is measured at
    /// that wait, and refused. Left out, its arm held no sample at all.
    #[test]
    fn requests_that_time_out_count_their_wait() {
        let c = TuningConfig {
            settle_margin: 1.0,
            fit_start: false,
            ..cfg()
        };
        let d = TuningDriver::new("a".into(), c, Weights::default()).unwrap();
        d.tick([], 0);
        let mut key = 0u64;
        for t in 1..200 {
            let candidate = d.view().candidate;
            for _ in 0..8 {
                key += 1;
                let a = d.admit(gorgo_core::hash::hash_bytes(&key.to_le_bytes()));
                if candidate.is_some_and(|w| w == a.weights) {
                    d.record_timed_out(&a.epoch, a.cell, 30_000.0);
                } else if let Some(open) = d.record_first_token(&a.epoch, a.cell, 100.0, 0, None) {
                    d.record_finish(open, 500.0);
                }
            }
            d.tick([], t);
            if let Some(trial) = d.view().history.iter().find(|e| e.record.samples > 0) {
                assert!(trial.record.score_p95_ttft_ms >= 29_000.0, "{trial:?}");
                assert!(trial.record.p95_e2e_ms >= 29_000.0, "{trial:?}");
                assert!(!trial.record.accepted);
                return;
            }
        }
        panic!("no trial decided: {:?}", d.view().history);
    }

    /// A learned-weights file reads back the very weights written: a node started
    /// from it routes exactly as the line that froze did (serde_json's default float
    /// parser is off by an ulp on some values, e.g. this one).
    #[test]
    fn learned_weights_round_trip_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.json");
        let w = Weights {
            w_rtt: 0.9421398653953702,
            w_queue: 0.9900567990041419,
        };
        write_learned_weights(&path, w).unwrap();
        assert_eq!(read_learned_weights(&path).unwrap(), w);
    }

    #[test]
    fn rfc3339_dates() {
        assert_eq!(rfc3339(0, 0), "1970-01-01T00:00:00.000000Z");
        assert_eq!(
            rfc3339(1_781_394_640, 478_901),
            "2026-06-13T23:50:40.478901Z"
        );
        assert_eq!(rfc3339(951_782_400, 5), "2000-02-29T00:00:00.000005Z");
    }

    #[test]
    fn learned_weights_round_trip_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("w.json");
        let w = Weights {
            w_rtt: 0.3,
            w_queue: 0.7,
        };
        write_learned_weights(&p, w).unwrap();
        assert_eq!(read_learned_weights(&p).unwrap(), w);
        let paper = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/data/reference/paper_learned_weights.json"
        );
        if Path::new(paper).exists() {
            let w = read_learned_weights(Path::new(paper)).unwrap();
            assert!((w.w_rtt - 0.276).abs() < 1e-3 && w.w_queue == 0.5);
        } else {
            eprintln!("skipping the paper's file: {paper} missing");
        }
        std::fs::write(&p, r#"{"rtt_weight": 1, "queue_weight": 1, "extra": 2}"#).unwrap();
        assert!(read_learned_weights(&p)
            .unwrap_err()
            .to_string()
            .contains("extra"));
        std::fs::write(&p, r#"{"rtt_weight": -1, "queue_weight": 1}"#).unwrap();
        assert!(read_learned_weights(&p)
            .unwrap_err()
            .to_string()
            .contains("rtt_weight"));
        // Above what `PUT /admin/weights` takes: it could not be put back.
        std::fs::write(&p, r#"{"rtt_weight": 1, "queue_weight": 1000}"#).unwrap();
        assert!(read_learned_weights(&p)
            .unwrap_err()
            .to_string()
            .contains("queue_weight"));
        assert!(read_learned_weights(&dir.path().join("none.json")).is_err());
        // Its length says 0: only a capped read stops it.
        if Path::new("/dev/zero").exists() {
            let e = read_learned_weights(Path::new("/dev/zero")).unwrap_err();
            assert!(e.to_string().contains("larger than"), "{e}");
        }
    }

    #[test]
    fn single_node_trajectory_and_paper_lines() {
        let d = TuningDriver::new("a".into(), cfg(), Weights::default()).unwrap();
        let rx = d.subscribe();
        let fx = d.tick([], 0);
        assert!(
            matches!(fx.sends.as_slice(), [TuningSend::All(TuningMessage::Proposal(p))] if p.epoch == 1)
        );
        assert!(rx.has_changed().unwrap());
        let v = d.view();
        assert_eq!(
            (
                v.candidate,
                v.trial_hold,
                v.noise_sd,
                v.required_improvement
            ),
            (None, Some(TrialHold::MeasuringNoise), None, None)
        );
        for round in 0..6u64 {
            serve(&d, round * 8..round * 8 + 8, 100.0 - round as f64);
            d.tick([], 10 * (round + 1));
            if round == 1 {
                // Two windows measured the noise: a trial runs, and the view says what
                // it must show.
                let v = d.view();
                assert!(v.candidate.is_some() && v.trial_hold.is_none(), "{v:?}");
                assert!(v.noise_sd.is_some() && v.required_improvement.is_some());
            }
        }
        let v = d.view();
        assert_eq!(v.epoch, 7);
        // Interleaved: the first two epochs measure the noise, every later one is a
        // trial of both arms.
        assert_eq!(v.history.len(), 4);
        assert!(v.is_leader);
        let line = &v.es_trace[0];
        assert_eq!(line["kind"], "tune");
        assert_eq!(line["window_size"], 4);
        assert!(line["score"].as_f64().unwrap() < 0.0);
        assert!(line["candidate"]["rtt_weight"].is_number());
        assert!(line["proposal"]["queue_weight"].is_number());
        // The best score is a p95 as the score is (the incumbent's, as measured in
        // the same trial), not the tail mean the trials compare.
        for (e, line) in v.history.iter().zip(&v.es_trace) {
            let r = &e.record;
            let p95 = if r.accepted {
                r.score_p95_ttft_ms
            } else {
                r.incumbent_p95_ttft_ms
            };
            assert_eq!(line["best_score"].as_f64(), Some(-p95 / 1000.0), "{line}");
        }
        assert_eq!(v.history[0].step, 1);
        assert_eq!(v.history[2].total_samples, 24);
        let j = serde_json::to_value(&v.history[0]).unwrap();
        for k in gorgo_core::tuning::TUNING_JSONL_KEYS {
            assert!(j.get(k).is_some(), "{k}");
        }
    }

    /// A start fit's window counts once in `total_samples` (its record gives the
    /// window as both arms' measurement), and `step` runs on over records that are not
    /// trials (by the line's trial count, a start fit after a trial repeated its step).
    #[test]
    fn a_start_fit_window_counts_once_and_steps_run_on() {
        let c = TuningConfig {
            w_queue: gorgo_core::es::ParamBounds {
                start: 0.05,
                ..cfg().w_queue
            },
            ..cfg()
        };
        let d = TuningDriver::new("a".into(), c, Weights::default()).unwrap();
        d.tick([], 0);
        // Two windows measure the noise, the third decides a trial; none has start-fit
        // evidence.
        for w in 1..=3u64 {
            serve(&d, w * 100..w * 100 + 16, 100.0);
            d.tick([], w);
        }
        // A window whose every TTFT is its queue term in full: the fit moves w_queue.
        for k in 400..416u64 {
            let a = d.admit(gorgo_core::hash::hash_bytes(&k.to_le_bytes()));
            let queue_ms = (k % 5) as f64 * 200.0;
            let terms = TermSample {
                rtt_ms: 0.0,
                queue_ms,
                residual_ms: queue_ms,
                prefill_ms: 300.0,
            };
            if let Some(open) =
                d.record_first_token(&a.epoch, a.cell, 300.0 + queue_ms, 0, Some(terms))
            {
                d.record_finish(open, 500.0);
            }
        }
        d.tick([], 4);
        let v = d.view();
        let verdicts: Vec<Verdict> = v.history.iter().map(|e| e.record.verdict).collect();
        assert_eq!(verdicts.last(), Some(&Verdict::StartFit), "{verdicts:?}");
        assert!(verdicts.len() >= 2, "{verdicts:?}");
        let mut total = 0;
        for e in &v.history {
            let r = &e.record;
            total += if r.verdict == Verdict::StartFit {
                assert_eq!(r.samples, 16);
                r.samples
            } else {
                r.samples + r.incumbent_samples
            };
            assert_eq!(e.total_samples, total, "{verdicts:?}");
        }
        for pair in v.history.windows(2) {
            assert!(pair[0].step < pair[1].step, "{verdicts:?}");
        }
    }

    #[test]
    fn static_mode_and_switching_back_keep_the_line() {
        let d = TuningDriver::new("a".into(), cfg(), Weights::default()).unwrap();
        d.tick([], 0);
        serve(&d, 0..4, 100.0);
        d.tick([], 1);
        assert_eq!(d.epoch(), 2);
        let fixed = Weights {
            w_rtt: 0.25,
            w_queue: 3.0,
        };
        d.set_mode(TuningMode::Static, Some(fixed)).unwrap();
        assert_eq!(d.admit(1).weights, fixed);
        assert_eq!(d.admit(2).weights, fixed);
        assert!(d.tick([], 2).sends.is_empty());
        d.set_mode(TuningMode::Online, None).unwrap();
        // Static mode follows no line and leads nothing; back online the leader takes
        // its line over at the next epoch (it used to start a new line at epoch 1).
        assert!(!d.is_leader());
        let fx = d.tick([], 3);
        assert_eq!(fx.sends.len(), 1);
        assert_eq!(d.epoch(), 3);
    }

    #[test]
    fn spoofed_reports_are_dropped() {
        let d = TuningDriver::new("a".into(), cfg(), Weights::default()).unwrap();
        d.tick([NodeId::from("b")], 0);
        let p = match &d.tick([NodeId::from("b")], 1).sends[0] {
            TuningSend::All(TuningMessage::Proposal(p)) => p.clone(),
            other => panic!("{other:?}"),
        };
        let mut cells: [gorgo_core::tuning::CellSketches; 4] = Default::default();
        for i in 0..10 {
            cells[i % 4].ttft.add(1.0);
            cells[i % 4].e2e.add(1.0);
        }
        let report = gorgo_core::tuning::EpochReport {
            epoch: p.epoch,
            leader: p.leader.clone(),
            incarnation: p.incarnation,
            from: "b".into(),
            cells: Box::new(cells),
            samples: 10,
            terms: Default::default(),
            at_ms: 2,
        };
        let fx = d.handle(&"c".into(), TuningMessage::Report(report.clone()), 2);
        assert!(fx.sends.is_empty());
        assert_eq!(d.epoch(), p.epoch);
        let fx = d.handle(&"b".into(), TuningMessage::Report(report), 3);
        assert_eq!(d.epoch(), p.epoch + 1);
        assert!(!fx.sends.is_empty());
    }

    #[test]
    fn freeze_is_reported_once() {
        let c = TuningConfig {
            mode: TuningMode::TuneThenFreeze,
            sigma0: 0.04,
            ..cfg()
        };
        let d = TuningDriver::new("a".into(), c, Weights::default()).unwrap();
        d.tick([], 0);
        let mut frozen = Vec::new();
        for t in 1..10 {
            serve(&d, t * 8..t * 8 + 8, 100.0);
            if let Some(w) = d.tick([], t).frozen {
                frozen.push(w);
            }
        }
        assert_eq!(frozen, vec![c.start_weights()]);
        assert_eq!(d.view().phase, Some(Phase::Frozen));
    }

    /// The learned-weights file is written where the driver's effects are carried
    /// out, not under its lock; a write that failed is handed out again until one
    /// succeeds (before, it only warned, and the file never came), and a mode switch
    /// neither reports the freeze again nor rewrites the file (before, it did both).
    #[test]
    fn a_failed_learned_weights_write_is_retried_until_written() {
        let c = TuningConfig {
            mode: TuningMode::TuneThenFreeze,
            sigma0: 0.04,
            ..cfg()
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("later").join("w.json");
        let d = TuningDriver::new("a".into(), c, Weights::default())
            .unwrap()
            .with_learned_weights_out(Some(path.clone()));
        let written = d.learned_weights_written();
        d.tick([], 0);
        let mut t = 0;
        let (frozen, write) = loop {
            t += 1;
            assert!(t < 10, "never froze");
            serve(&d, t * 8..t * 8 + 8, 100.0);
            let fx = d.tick([], t);
            if let Some(write) = fx.learned_write {
                break (fx.frozen.expect("written as it freezes"), write);
            }
        };
        // One write at a time: none while this one is out.
        assert!(d.tick([], 100).learned_write.is_none());
        // Its directory is not there yet.
        assert!(write.write().is_err());
        assert!(written.borrow().is_none());
        std::fs::create_dir(path.parent().unwrap()).unwrap();
        let again = d.tick([], 101).learned_write.expect("the write comes back");
        again.write().unwrap();
        assert_eq!(read_learned_weights(&path).unwrap(), frozen);
        assert_eq!(*written.borrow(), Some(frozen));
        assert!(d.tick([], 102).learned_write.is_none());
        // The line stays frozen across a mode switch: nothing reported or written again.
        d.set_mode(TuningMode::Static, None).unwrap();
        d.set_mode(TuningMode::TuneThenFreeze, None).unwrap();
        let fx = d.tick([], 103);
        assert_eq!(d.view().phase, Some(Phase::Frozen));
        assert!(fx.frozen.is_none() && fx.learned_write.is_none(), "{fx:?}");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Tick(u8, u16),
        Record(u8, u8, f64, f64),
        Proposal(u8, u8, f64, f64, f64),
        Report(u8, u8, u8, u16),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        let w = prop_oneof![
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(-1.0),
            0.0..10.0f64
        ];
        prop_oneof![
            (any::<u8>(), 0..5000u16).prop_map(|(m, dt)| Op::Tick(m, dt)),
            (0..4u8, any::<u8>(), w.clone(), w.clone())
                .prop_map(|(e, c, t, x)| Op::Record(e, c, t, x)),
            (0..40u8, 0..4u8, w.clone(), w.clone(), w)
                .prop_map(|(e, l, a, b, s)| Op::Proposal(e, l, a, b, s)),
            (0..40u8, 0..4u8, 0..4u8, 0..300u16).prop_map(|(e, l, f, n)| Op::Report(e, l, f, n)),
        ]
    }

    proptest::proptest! {
        /// Whatever peers send, in any order: no panic, the weights routed with stay
        /// finite and inside the bounds, and the followed epoch never goes back.
        #[test]
        fn hostile_sequences_keep_weights_in_bounds(ops in proptest::collection::vec(op(), 1..80)) {
            let ids = ["a", "b", "c", "d"];
            let c = cfg();
            let d = TuningDriver::new("b".into(), c, Weights::default()).unwrap();
            let mut now = 0u64;
            let mut last_epoch = 0;
            // What requests were admitted under after each op, newest last.
            let mut admitted: Vec<EpochKey> = Vec::new();
            for o in ops {
                match o {
                    Op::Tick(mask, dt) => {
                        now += u64::from(dt);
                        let live = ids.iter().enumerate().filter(|(i, _)| mask & (1 << i) != 0).map(|(_, id)| NodeId::from(*id));
                        d.tick(live, now);
                    }
                    Op::Record(back, cell, t, e) => {
                        let epoch = admitted.iter().rev().nth(usize::from(back)).cloned().unwrap_or_default();
                        if let Some(open) = d.record_first_token(&epoch, cell, t, now, None) {
                            d.record_finish(open, e);
                        }
                    }
                    Op::Proposal(epoch, leader, a, b, sigma) => {
                        let mut state = gorgo_core::es::EsState::new(&c);
                        state.sigma = sigma;
                        state.incumbent = Weights { w_rtt: b, w_queue: a };
                        let p = gorgo_core::tuning::Proposal {
                            epoch: u64::from(epoch),
                            leader: ids[leader as usize].into(),
                            incarnation: 0,
                            weights: Weights { w_rtt: a, w_queue: b },
                            candidate: Some(Weights { w_rtt: sigma, w_queue: a }),
                            phase: if sigma > 1.0 { Phase::Interleaved } else { Phase::MeasureCandidate },
                            state,
                            // 0 and hour-long blocks included: implausible, ignored.
                            switchback_block_ms: (sigma > 2.0).then_some(u64::from(epoch) * 1_000_000),
                        };
                        d.handle(&ids[leader as usize].into(), TuningMessage::Proposal(p), now);
                    }
                    Op::Report(epoch, leader, from, n) => {
                        let mut cells: [gorgo_core::tuning::CellSketches; 4] = Default::default();
                        for i in 0..n {
                            let c = &mut cells[usize::from(i) % 4];
                            c.ttft.add(f64::from(i));
                            c.e2e.add(f64::from(i) * 2.0);
                        }
                        let r = gorgo_core::tuning::EpochReport {
                            epoch: u64::from(epoch),
                            leader: ids[leader as usize].into(),
                            incarnation: 0,
                            from: ids[from as usize].into(),
                            cells: Box::new(cells),
                            samples: u64::from(n),
                            // Start-fit sums as a hostile peer might send them.
                            terms: gorgo_core::tuning::TermSums {
                                n: u64::from(n) * 1000,
                                rr: f64::from(n) * 1e12,
                                rq: -f64::from(n) * 1e12,
                                qq: if n % 2 == 0 { f64::NAN } else { f64::from(n) },
                                ry: f64::from(n) * 1e300,
                                qy: -f64::from(n),
                                yy: 1.0,
                                q: f64::from(n),
                                p: if n % 3 == 0 { -1.0 } else { f64::INFINITY },
                            },
                            at_ms: now,
                        };
                        d.handle(&ids[from as usize].into(), TuningMessage::Report(r), now);
                    }
                }
                for key in 0..4 {
                let w = d.admit(key).weights;
                proptest::prop_assert!(w.w_rtt.is_finite() && w.w_rtt >= c.w_rtt.min && w.w_rtt <= c.w_rtt.max, "{w:?}");
                proptest::prop_assert!(w.w_queue.is_finite() && w.w_queue >= c.w_queue.min && w.w_queue <= c.w_queue.max, "{w:?}");
                }
                proptest::prop_assert!(d.epoch() >= last_epoch);
                last_epoch = d.epoch();
                admitted.push(d.admit(0).epoch);
                let _ = d.view();
            }
        }

        /// Arbitrary bytes as a learned-weights file: an error or weights, never a panic.
        #[test]
        fn learned_weights_reader_never_panics(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200)) {
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("w.json");
            std::fs::write(&p, &bytes).unwrap();
            if let Ok(w) = read_learned_weights(&p) {
                proptest::prop_assert!(w.w_rtt.is_finite() && w.w_queue.is_finite());
            }
        }
    }
}
