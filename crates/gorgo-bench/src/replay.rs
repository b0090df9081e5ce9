//! The replay scheduler: open loop at `arrival x time_scale` (with an optional cap on
//! requests in flight, the wait for a free slot recorded as slip) or closed loop at a
//! fixed concurrency. Each request goes to its home region's URL.
//!
//! Clock origin. In open loop every request's TTFT and E2E count from its *scheduled*
//! send time, as the simulator's do (`send_ms` in crates/gorgo-sim/src/sim.rs; see
//! [`client::send_streaming`]): the dispatcher's lateness, the task's spawn, building
//! the body, waiting for a `max_in_flight` slot and a busy client runtime are all
//! inside the latency, and the slip (when it actually went out, minus when it was
//! due) is recorded per request. Closed loop has no schedule: there the origin stays
//! the send itself (after the body is built) and the slip is 0; such runs, like
//! capped ones, have no counterpart in the simulator, which has neither.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::client::{self, Measured, POLICY_HEADER, SESSION_HEADER};
use crate::cluster::ClusterInfo;
use crate::BenchError;

/// One request of the workload, already assigned to a home region.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayItem {
    /// Identifier carried into the results.
    pub request_id: String,
    /// The client's home region: the request goes to this region's URL.
    pub region: String,
    /// Arrival time in the trace, ms from the trace start (before time scaling).
    pub arrival_ms: u64,
    /// Prompt tokens according to the trace (used when the server reports no usage).
    pub input_tokens: u64,
    /// Requested output tokens.
    pub output_tokens: u32,
    /// Session key, sent as `x-session-id` for session-affinity policies.
    pub session: Option<String>,
}

/// Builds the request body of item `i` when it is sent, so that a long trace's prompts
/// are never all in memory at once.
pub type BodyBuilder = Arc<dyn Fn(usize) -> Result<Bytes, String> + Send + Sync>;

/// How far ahead of its send time an open-loop request's body is built (a synthesised
/// prompt of up to tens of thousands of tokens, serialised), so that sending it at its
/// time costs only the send.
const BODY_LOOKAHEAD: Duration = Duration::from_millis(200);

/// How load is offered.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LoadMode {
    /// Send item i at `arrival_ms x time_scale` after the start; its TTFT and E2E
    /// count from that scheduled time.
    Open {
        /// Multiplies trace timestamps (0.5 = twice as fast).
        time_scale: f64,
    },
    /// `concurrency` clients, each sending its next request when the last finished.
    /// There is no schedule, so TTFT and E2E count from the send itself (once the body
    /// is built) and slip is 0; the simulator has no closed loop to compare with.
    Closed {
        /// Number of concurrent clients.
        concurrency: usize,
    },
}

/// Most clients a closed loop may run, and most requests an open loop may cap in
/// flight (`--concurrency`): far past what one client machine drives. Each closed-loop
/// client is a task: two million of them took 6 GB to send one request.
pub const MAX_CONCURRENCY: usize = 65_536;

/// Everything that shapes a replay besides the workload and the cluster.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// Open or closed loop.
    pub mode: LoadMode,
    /// Open loop only: at most this many requests in flight (a wait for a slot counts
    /// as slip, and in TTFT and E2E, which count from the schedule).
    pub max_in_flight: Option<usize>,
    /// Stop dispatching this long after the start (in-flight requests still finish).
    pub duration: Option<Duration>,
    /// Send at most this many requests.
    pub max_requests: Option<usize>,
    /// Per-request cap on the whole exchange.
    pub request_timeout: Duration,
    /// Per-connection cap on establishing TCP.
    pub connect_timeout: Duration,
    /// Sent as `x-gorgo-policy` when set.
    pub policy_header: Option<String>,
    /// Request path on the node (`/v1/chat/completions`).
    pub path: String,
    /// Progress bar to drive (its length is set to the number of requests); `None`
    /// draws nothing. Callers running several replays pass bars of one
    /// `indicatif::MultiProgress`.
    pub progress: Option<indicatif::ProgressBar>,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            mode: LoadMode::Open { time_scale: 1.0 },
            max_in_flight: None,
            duration: None,
            max_requests: None,
            request_timeout: Duration::from_secs(600),
            connect_timeout: Duration::from_secs(10),
            policy_header: None,
            path: "/v1/chat/completions".into(),
            progress: None,
        }
    }
}

/// The measured result of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOutcome {
    /// Index of the item in the workload.
    pub index: usize,
    /// The item's request id.
    pub request_id: String,
    /// The client's home region.
    pub region: String,
    /// Session key, when the workload has one.
    pub session: Option<String>,
    /// The origin of its times, ms after the replay start: its scheduled send time
    /// in open loop (what the simulator's `start_ms` is), the send itself in closed
    /// loop. `start_ms + e2e_ms` is when it ended.
    pub start_ms: f64,
    /// How late it actually went out against its schedule, ms: the start of its
    /// first attempt minus its scheduled time (dispatch, spawn, body building, a slot
    /// wait, client lag; all of it inside TTFT and E2E too); for one that never went
    /// out (no body, or the replay stopped first), how late it was when it gave up.
    /// Never its time in flight. 0 in closed loop, which has no schedule.
    pub slip_ms: f64,
    /// Prompt tokens (server's usage, else the trace's).
    pub input_tokens: u64,
    /// Output tokens (server's usage, else content chunks).
    pub output_tokens: u64,
    /// What the client measured.
    pub measured: Measured,
}

impl RequestOutcome {
    /// Succeeded end to end.
    pub fn ok(&self) -> bool {
        self.measured.error.is_none()
    }

    /// Inter-token latency: (E2E - TTFT) / (output tokens - 1), when defined.
    pub fn itl_ms(&self) -> Option<f64> {
        match (self.measured.ttft_ms, self.measured.e2e_ms) {
            (Some(t), Some(e)) if self.output_tokens > 1 && self.ok() => {
                Some((e - t) / (self.output_tokens - 1) as f64)
            }
            _ => None,
        }
    }
}

/// What a replay produced.
#[derive(Debug, Clone)]
pub struct ReplayOutput {
    /// One outcome per request sent, in workload order; a stopped open-loop run also
    /// has one per request that was due but never went out (failed, no `sent_ms`).
    pub outcomes: Vec<RequestOutcome>,
    /// Wall time from the start to the last request's end.
    pub wall: Duration,
    /// The start (what every `start_ms` counts from) on the system clock, ms since
    /// the Unix epoch: lines the requests up with events logged elsewhere, such as
    /// a chaos run's faults.
    pub started_unix_ms: f64,
    /// The run was stopped by the shutdown signal before it finished.
    pub cancelled: bool,
    /// Open loop without a cap on requests in flight: the load the simulator models
    /// (it has neither a closed loop nor a client-side cap), so its results compare
    /// with `gorgo sim`'s.
    pub sim_comparable: bool,
}

impl ReplayOutput {
    /// Requests that failed.
    pub fn failed(&self) -> usize {
        self.outcomes.iter().filter(|o| !o.ok()).count()
    }

    /// Largest dispatch slip, ms.
    pub fn max_slip_ms(&self) -> f64 {
        self.outcomes.iter().map(|o| o.slip_ms).fold(0.0, f64::max)
    }

    /// Mean dispatch slip, ms.
    pub fn mean_slip_ms(&self) -> f64 {
        if self.outcomes.is_empty() {
            return 0.0;
        }
        self.outcomes.iter().map(|o| o.slip_ms).sum::<f64>() / self.outcomes.len() as f64
    }
}

struct Shared {
    items: Vec<ReplayItem>,
    body: BodyBuilder,
    targets: HashMap<String, (reqwest::Client, String)>,
    policy_header: Option<String>,
    start: Instant,
    /// Open loop: each item's scheduled send time (`start + arrival x time_scale`).
    schedule: Vec<Instant>,
    progress: indicatif::ProgressBar,
    failures: AtomicUsize,
    /// Cancelled when the replay is stopped: requests in flight end at once as failed
    /// ("cancelled"), at the time they had taken, keeping what they had measured (a
    /// first token, the serving region), and closed-loop workers send no more, so what
    /// every request measured is kept (aborting the tasks lost them: a closed-loop
    /// worker's whole list, and an open-loop request's place in the statistics, the
    /// longest ones of the run).
    stop: tokio_util::sync::CancellationToken,
}

/// Replay `items` against `cluster`. Stops early when `shutdown` completes, returning
/// what finished, the requests in flight as cancelled failures (with what they had
/// measured: [`client::send_streaming`]) and, in open loop, the requests already due
/// but not yet sent as cancelled failures that never went out. Fails only on a bad
/// configuration or an item whose region the cluster lacks; request failures are
/// recorded in the outcomes.
pub async fn replay(
    cluster: &ClusterInfo,
    mut items: Vec<ReplayItem>,
    body: BodyBuilder,
    config: &ReplayConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<ReplayOutput, BenchError> {
    config.validate()?;
    if let Some(n) = config.max_requests {
        items.truncate(n);
    }
    if let (LoadMode::Open { time_scale }, Some(d)) = (config.mode, config.duration) {
        // Open loop: a request whose scheduled time falls after the window is never sent.
        let limit_ms = d.as_secs_f64() * 1000.0;
        items.retain(|it| it.arrival_ms as f64 * time_scale < limit_ms);
    }
    let mut targets = HashMap::new();
    for region in &cluster.regions {
        let c = client::build_client(config.connect_timeout, config.request_timeout)
            .map_err(|e| BenchError::Client(e.to_string()))?;
        let url = format!("{}{}", region.client_url.trim_end_matches('/'), config.path);
        targets.insert(region.name.clone(), (c, url));
    }
    if let Some(bad) = items.iter().find(|it| !targets.contains_key(&it.region)) {
        return Err(BenchError::UnknownRegion(bad.region.clone()));
    }
    let progress = match &config.progress {
        Some(pb) => {
            pb.set_length(items.len() as u64);
            pb.set_position(0);
            pb.clone()
        }
        None => indicatif::ProgressBar::hidden(),
    };
    let offsets = match config.mode {
        LoadMode::Open { time_scale } => schedule_offsets(&items, time_scale)?,
        LoadMode::Closed { .. } => Vec::new(),
    };
    let started_unix_ms = unix_ms_now();
    let start = Instant::now();
    let schedule = offsets
        .iter()
        .map(|o| start.checked_add(*o))
        .collect::<Option<Vec<Instant>>>()
        .ok_or_else(|| BenchError::InvalidConfig {
            field: "time_scale",
            reason: "the scaled trace ends beyond what the clock can represent".into(),
        })?;
    let shared = Arc::new(Shared {
        items,
        body,
        targets,
        policy_header: config.policy_header.clone(),
        start,
        schedule,
        progress,
        failures: AtomicUsize::new(0),
        stop: tokio_util::sync::CancellationToken::new(),
    });
    let mut tasks: JoinSet<Vec<RequestOutcome>> = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let mut cancelled = false;
    let mut outcomes = Vec::new();
    match config.mode {
        LoadMode::Open { .. } => {
            let sem = Arc::new(Semaphore::new(
                config
                    .max_in_flight
                    .unwrap_or(Semaphore::MAX_PERMITS)
                    .min(Semaphore::MAX_PERMITS),
            ));
            // Bodies built ahead of their send time, in order: the front is `index`'s.
            let mut built: std::collections::VecDeque<Result<Bytes, String>> =
                std::collections::VecDeque::new();
            for index in 0..shared.items.len() {
                let scheduled = shared.schedule[index];
                // Build what falls due within the lookahead of this item's time now,
                // while waiting for it, not at each due time: `compare` runs every policy's replay in one task, in
                // list order, so bodies built at a burst's instant delayed each policy
                // by the bodies of the policies before it (slip 1.9 ms for the first
                // listed, 17 ms for the fourth), and its TTFT with it.
                let horizon = scheduled + BODY_LOOKAHEAD;
                while index + built.len() < shared.items.len()
                    && (built.is_empty() || shared.schedule[index + built.len()] <= horizon)
                {
                    built.push_back((shared.body)(index + built.len()));
                }
                let body = built.pop_front().expect("built above");
                let acquired = tokio::select! {
                    _ = &mut shutdown => None,
                    permit = async {
                        tokio::time::sleep_until(scheduled.into()).await;
                        sem.clone().acquire_owned().await
                    } => permit.ok(),
                };
                let Some(permit) = acquired else {
                    cancelled = true;
                    // Those already due are recorded as never sent; the rest were
                    // never due in this run.
                    let now = Instant::now();
                    outcomes.extend(
                        (index..shared.items.len())
                            .filter(|&i| shared.schedule[i] <= now)
                            .map(|i| unsent(&shared, i, now)),
                    );
                    break;
                };
                let shared = shared.clone();
                tasks.spawn(async move {
                    let outcome = send_item(&shared, index, body, Some(scheduled)).await;
                    drop(permit);
                    vec![outcome]
                });
                // Finished requests are collected as the replay goes: a task not joined
                // keeps its whole cell, so a long trace held one per request sent.
                while let Some(joined) = tasks.try_join_next() {
                    match joined {
                        Ok(batch) => outcomes.extend(batch),
                        Err(e) => tracing::error!("replay task failed: {e}"),
                    }
                }
            }
        }
        LoadMode::Closed { concurrency } => {
            let next = Arc::new(AtomicUsize::new(0));
            // A duration past what the clock can hold is no deadline.
            let deadline = config.duration.and_then(|d| shared.start.checked_add(d));
            // A client more than there are requests would never send one.
            for _ in 0..closed_loop_clients(concurrency, shared.items.len()) {
                let shared = shared.clone();
                let next = next.clone();
                tasks.spawn(async move {
                    let mut out = Vec::new();
                    loop {
                        if deadline.is_some_and(|d| Instant::now() >= d)
                            || shared.stop.is_cancelled()
                        {
                            break;
                        }
                        let index = next.fetch_add(1, Ordering::Relaxed);
                        if index >= shared.items.len() {
                            break;
                        }
                        let body = (shared.body)(index);
                        out.push(send_item(&shared, index, body, None).await);
                    }
                    out
                });
            }
        }
    }
    if !cancelled {
        loop {
            tokio::select! {
                _ = &mut shutdown => { cancelled = true; break; }
                joined = tasks.join_next() => match joined {
                    Some(Ok(batch)) => outcomes.extend(batch),
                    // A request task cannot panic by design; a join error is recorded
                    // by its absence from the outcomes.
                    Some(Err(e)) => tracing::error!("replay task failed: {e}"),
                    None => break,
                },
            }
        }
    }
    if cancelled {
        // Every task ends at once (its request records itself as cancelled).
        shared.stop.cancel();
        while let Some(joined) = tasks.join_next().await {
            if let Ok(batch) = joined {
                outcomes.extend(batch);
            }
        }
    }
    shared.progress.finish();
    outcomes.sort_by_key(|o| o.index);
    Ok(ReplayOutput {
        outcomes,
        wall: shared.start.elapsed(),
        started_unix_ms,
        cancelled,
        sim_comparable: matches!(config.mode, LoadMode::Open { .. })
            && config.max_in_flight.is_none(),
    })
}

/// `to - from` in ms, 0 when `to` is earlier.
fn ms_between(from: Instant, to: Instant) -> f64 {
    to.saturating_duration_since(from).as_secs_f64() * 1000.0
}

/// The system clock, ms since the Unix epoch (0 on a clock set before 1970).
fn unix_ms_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

/// Each item's send time after the start, `arrival x time_scale`; an error (not a
/// panic) when one does not fit a `Duration`.
fn schedule_offsets(items: &[ReplayItem], time_scale: f64) -> Result<Vec<Duration>, BenchError> {
    items
        .iter()
        .map(|it| {
            Duration::try_from_secs_f64(it.arrival_ms as f64 * time_scale / 1000.0).map_err(|e| {
                BenchError::InvalidConfig {
                    field: "time_scale",
                    reason: format!(
                        "request `{}` at {} ms x {time_scale}: {e}",
                        it.request_id, it.arrival_ms
                    ),
                }
            })
        })
        .collect()
}

/// Clients a closed loop of `concurrency` runs for `requests` requests: no more than
/// there are requests.
fn closed_loop_clients(concurrency: usize, requests: usize) -> usize {
    concurrency.min(requests)
}

impl ReplayConfig {
    /// Check the load's values, naming the field: [`replay`] refuses what this refuses.
    pub fn validate(&self) -> Result<(), BenchError> {
        let within = |n: usize| (1..=MAX_CONCURRENCY).contains(&n);
        let range = format!("must be in [1, {MAX_CONCURRENCY}]");
        match self.mode {
            LoadMode::Open { time_scale } if !(time_scale.is_finite() && time_scale >= 0.0) => {
                return Err(BenchError::InvalidConfig {
                    field: "time_scale",
                    reason: format!("must be a finite number >= 0, got {time_scale}"),
                })
            }
            LoadMode::Closed { concurrency } if !within(concurrency) => {
                return Err(BenchError::InvalidConfig {
                    field: "concurrency",
                    reason: range,
                })
            }
            _ => {}
        }
        if self.max_in_flight.is_some_and(|n| !within(n)) {
            return Err(BenchError::InvalidConfig {
                field: "max_in_flight",
                reason: range,
            });
        }
        Ok(())
    }
}

/// Build item `index`'s body and send it. `scheduled` is its due time in open loop,
/// the origin of every time it measures (the simulator's); `None` in closed loop,
/// where the origin is the send itself, once the body is built.
async fn send_item(
    shared: &Shared,
    index: usize,
    body: Result<Bytes, String>,
    scheduled: Option<Instant>,
) -> RequestOutcome {
    let item = &shared.items[index];
    let origin = scheduled.unwrap_or_else(Instant::now);
    let measured = match body {
        Err(e) => Measured {
            error: Some(format!("building the request body: {e}")),
            e2e_ms: Some(ms_between(origin, Instant::now())),
            ..Measured::default()
        },
        Ok(body) => {
            // Checked at the start of the replay: every item's region has a target.
            let (client, url) = &shared.targets[&item.region];
            let mut headers = Vec::with_capacity(2);
            if let Some(p) = &shared.policy_header {
                headers.push((POLICY_HEADER, p.clone()));
            }
            if let Some(s) = &item.session {
                headers.push((SESSION_HEADER, s.clone()));
            }
            client::send_streaming(client, url, body, &headers, origin, &shared.stop).await
        }
    };
    record(shared, index, origin, scheduled.is_some(), measured)
}

/// Open loop: item `index`, due at its scheduled time but never sent because the
/// replay was stopped at `now` (the dispatcher waiting for a `max_in_flight` slot, or
/// behind its schedule): a failure at its due time, as late as it got, so the most
/// delayed requests of a stopped run are not left out of it.
fn unsent(shared: &Shared, index: usize, now: Instant) -> RequestOutcome {
    let origin = shared.schedule[index];
    let measured = Measured {
        error: Some(client::CANCELLED_UNSENT.into()),
        e2e_ms: Some(ms_between(origin, now)),
        ..Measured::default()
    };
    record(shared, index, origin, true, measured)
}

/// Item `index`'s outcome from what it measured, counted in the progress bar.
/// `origin` is the origin of its times; `scheduled` tells an open-loop request (whose
/// slip is measured) from a closed-loop one.
fn record(
    shared: &Shared,
    index: usize,
    origin: Instant,
    scheduled: bool,
    measured: Measured,
) -> RequestOutcome {
    let item = &shared.items[index];
    let start_ms = ms_between(shared.start, origin);
    // The send slip, never the time in flight (a request stopped in flight keeps its
    // send time); one never sent was as late as it got when it gave up.
    let slip_ms = if scheduled {
        measured.sent_ms.or(measured.e2e_ms).unwrap_or(0.0)
    } else {
        0.0
    };
    if measured.error.is_some() {
        let failed = shared.failures.fetch_add(1, Ordering::Relaxed) + 1;
        shared.progress.set_message(format!("{failed} failed"));
    }
    shared.progress.inc(1);
    RequestOutcome {
        index,
        request_id: item.request_id.clone(),
        region: item.region.clone(),
        session: item.session.clone(),
        start_ms,
        slip_ms,
        input_tokens: measured.prompt_tokens.unwrap_or(item.input_tokens),
        output_tokens: measured
            .completion_tokens
            .unwrap_or(measured.content_chunks),
        measured,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--concurrency` is bounded, closed loop or open, naming the field (two million
    /// closed-loop clients took 6 GB to send one request); a closed loop never runs
    /// more clients than requests.
    #[test]
    fn concurrency_is_bounded_and_clients_never_outnumber_requests() {
        for concurrency in [MAX_CONCURRENCY + 1, 2_000_000, usize::MAX] {
            let closed = ReplayConfig {
                mode: LoadMode::Closed { concurrency },
                ..ReplayConfig::default()
            };
            let e = closed.validate().unwrap_err().to_string();
            assert!(e.contains("concurrency") && e.contains("65536"), "{e}");
            let open = ReplayConfig {
                max_in_flight: Some(concurrency),
                ..ReplayConfig::default()
            };
            let e = open.validate().unwrap_err().to_string();
            assert!(e.contains("max_in_flight"), "{e}");
        }
        let at_most = ReplayConfig {
            mode: LoadMode::Closed {
                concurrency: MAX_CONCURRENCY,
            },
            ..ReplayConfig::default()
        };
        at_most.validate().unwrap();
        assert_eq!(closed_loop_clients(MAX_CONCURRENCY, 1), 1);
        assert_eq!(closed_loop_clients(2, 9), 2);
    }
}
