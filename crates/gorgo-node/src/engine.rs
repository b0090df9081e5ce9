//! The engine adapter: one pooled HTTP client to the local engine, its health, its
//! `/metrics` (SGLang or vLLM names), and the node's view of the engine.
//!
//! The IO lives here; what the node knows about its engine (scrapes combined with its
//! own accounting of the work it sent, and the prefill fit) is the core's
//! [`EngineView`], the very state machine the simulator runs, behind one mutex.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use gorgo_core::accounting::{LimitSource, ViewConfig, ViewCounters};
use gorgo_core::engine_metrics::parse_engine_metrics;
use gorgo_core::fit::{FitConfig, PrefillFit};
use gorgo_core::health::{
    Admission, BreakerState, EngineHealth, HealthChange, HealthConfig, RequestOutcome,
};
use gorgo_core::types::{MAX_MODELS, MAX_MODEL_ID_BYTES};
use gorgo_core::{EngineMetrics, EngineView, QueueStats};
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use crate::config::{EngineKind, EngineSection, LimitsSection};
use crate::error::NodeError;
use crate::metrics::EngineFailureKind;

/// Largest `/metrics` page we read from the engine.
const MAX_METRICS_BYTES: usize = 4 * 1024 * 1024;
/// Cap on a `/v1/models` answer read from the engine.
const MAX_MODELS_BYTES: usize = 1 << 20;
/// How often a known model list (and the engine's concurrency limit) is read again
/// (adapters come and go, an engine restarts with other settings).
const MODELS_REFRESH: Duration = Duration::from_secs(30);
/// How soon a concurrency-limit read that got no answer is tried again.
const LIMIT_RETRY: Duration = Duration::from_secs(5);
/// Cap on a server-info answer read from the engine (SGLang's `/get_server_info`
/// lists every server argument: about 200 KB).
const MAX_SERVER_INFO_BYTES: usize = 1 << 20;

/// Why a call to the engine failed; the ingress maps it to a status.
#[derive(Debug)]
pub enum EngineFailure {
    /// The engine did not answer in time (504).
    Timeout,
    /// Connection refused, reset, or a broken response (502).
    Failed(String),
    /// Not sent: the breaker is open, or its half-open probe is out (503). No failure
    /// of the engine's, so not counted as one (`gorgo_engine_failures_total`).
    Refused(String),
}

impl EngineFailure {
    /// Whether the engine failed the request (not refused before sending it).
    pub fn is_engine_failure(&self) -> bool {
        !matches!(self, EngineFailure::Refused(_))
    }
}

impl From<EngineFailure> for crate::api::ServeError {
    /// The one mapping from an engine call's failure to the request path's error (and
    /// through [`crate::api::ServeError::status`] to the client's status).
    fn from(e: EngineFailure) -> Self {
        match e {
            EngineFailure::Timeout => {
                crate::api::ServeError::Timeout("engine did not answer in time".into())
            }
            EngineFailure::Failed(m) => {
                crate::api::ServeError::Failed(format!("engine failed: {m}"))
            }
            EngineFailure::Refused(m) => {
                crate::api::ServeError::Unavailable(format!("engine unavailable: {m}"))
            }
        }
    }
}

/// The local engine: client, health, and the node's view of it.
#[derive(Debug)]
pub struct EngineAdapter {
    client: reqwest::Client,
    /// The engine's URL in its normal form, path prefix included: every URL sent to
    /// is this and a path (`/v1/...`, `/metrics`, the health path) appended.
    base: String,
    kind: EngineKind,
    health_path: String,
    health_timeout: Duration,
    /// The breaker (core state machine): checks and real requests in, routable out.
    health: Mutex<EngineHealth>,
    /// `true` while the breaker is open; requests waiting for the engine's head watch
    /// it so they can fall back the moment it opens.
    opened: tokio::sync::watch::Sender<bool>,
    /// Bumped each time the engine fails again while its breaker is open (a health
    /// check, or the half-open probe): requests not streamed, whose head comes only
    /// with the whole answer, watch this instead of the first opening
    /// ([`EngineAdapter::send_streamed`]).
    failing_again: tokio::sync::watch::Sender<u64>,
    /// The engine's context length, once known (config, or `/v1/models`).
    max_context_tokens: AtomicU64,
    /// When the concurrency limit was last asked for, and whether the engine answered
    /// (a failed read is retried sooner than an answered one is refreshed).
    limit_read: Mutex<Option<(u64, bool)>>,
    /// When a request last asked for the model list while it was unknown, ms (0:
    /// never): see [`EngineAdapter::learn_models_if_unknown`].
    models_asked_ms: AtomicU64,
    /// What the engine's `/v1/models` last listed.
    models: Mutex<EngineModels>,
    /// [`LimitsSection::head_timeout`] of a streamed response and of one that is not.
    head_timeouts: (Duration, Duration),
    view: Mutex<EngineView>,
    /// Ids of dispatches in the view, unique per adapter.
    next_ticket: AtomicU64,
    started: Instant,
}

impl EngineAdapter {
    /// Build the adapter, its pooled client (TCP_NODELAY, keep-alive) and its view,
    /// seeded from its `[engine]` (or `[[engines]]` entry); `replica` is which of the
    /// node's engines it is, named in its queue stats.
    pub fn new(
        engine: &EngineSection,
        replica: u16,
        limits: &LimitsSection,
    ) -> Result<Self, NodeError> {
        let client = reqwest::Client::builder()
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_millis(limits.connect_timeout_ms))
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(1024)
            .build()
            .map_err(|e| NodeError::Config(format!("engine client: {e}")))?;
        let view = EngineView::new(ViewConfig {
            kv_capacity_tokens: engine.kv_capacity_tokens,
            decode_step_ms: engine.decode_step_ms,
            seed_base_ms: engine.base_ms,
            seed_t_p_ms: engine.t_p_ms,
            fit: FitConfig::default(),
            replica,
            max_running_requests: engine.max_running_requests,
        })
        .map_err(|e| NodeError::Config(format!("engine seeds: {e}")))?;
        Ok(EngineAdapter {
            client,
            base: crate::config::normalize_engine_url(&engine.url),
            kind: engine.kind,
            health_path: engine.health_path().to_owned(),
            health_timeout: Duration::from_millis(engine.health_timeout_ms),
            health: Mutex::new(EngineHealth::new(HealthConfig {
                failures_to_open: engine.breaker_failures,
                cooldown_ms: engine.breaker_cooldown_ms,
            })),
            opened: tokio::sync::watch::Sender::new(false),
            failing_again: tokio::sync::watch::Sender::new(0),
            max_context_tokens: AtomicU64::new(engine.max_context_tokens.unwrap_or(0)),
            models: Mutex::new(EngineModels::default()),
            limit_read: Mutex::new(None),
            models_asked_ms: AtomicU64::new(0),
            head_timeouts: (limits.head_timeout(true), limits.head_timeout(false)),
            view: Mutex::new(view),
            next_ticket: AtomicU64::new(1),
            started: Instant::now(),
        })
    }

    /// The engine kind.
    pub fn kind(&self) -> EngineKind {
        self.kind
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Whether routing may count on the engine now: the breaker is closed, or
    /// half-open with its probe slot free.
    pub fn is_healthy(&self) -> bool {
        self.health.lock().routable(self.now_ms())
    }

    /// The breaker's state now (for `/admin/state` and the gauge).
    pub fn breaker(&self) -> BreakerState {
        self.health.lock().state(self.now_ms())
    }

    /// Act on a change of the breaker: wake requests waiting for a head.
    fn changed(&self, change: Option<HealthChange>) {
        match change {
            Some(HealthChange::Opened) => {
                tracing::warn!(engine = %self.base, "engine breaker opened: no new work until a probe passes");
                self.opened.send_replace(true);
            }
            Some(HealthChange::Closed) => {
                tracing::info!(engine = %self.base, "engine breaker closed");
                self.opened.send_replace(false);
            }
            // Still open: wake the probe that was out (its outcome decides nothing).
            Some(HealthChange::Reopened) => {
                self.opened.send_replace(true);
                self.failing_again.send_modify(|n| *n = n.wrapping_add(1));
            }
            None => {}
        }
    }

    /// Count a real request's outcome towards the breaker.
    pub fn record(&self, outcome: RequestOutcome) {
        let now = self.now_ms();
        let change = self.health.lock().on_request(outcome, now);
        self.changed(change);
    }

    /// A future that resolves once the breaker opens from now on. Not at once when it
    /// is open now: a request is sent only when the breaker admitted it, and the one
    /// it admits while it still reads open is its half-open probe, which must reach
    /// the engine (resolving at once failed every probe unsent, and re-opened the
    /// breaker).
    pub fn opened(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.opened.subscribe();
        rx.borrow_and_update();
        async move {
            while rx.changed().await.is_ok() {
                if *rx.borrow_and_update() {
                    return;
                }
            }
            // The adapter is gone: it will not open any more.
            std::future::pending::<()>().await;
        }
    }

    /// A future that resolves once the engine fails again while its breaker is open,
    /// from now on: two health checks failed in a row, or a failed half-open probe.
    fn failed_again(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.failing_again.subscribe();
        rx.borrow_and_update();
        async move {
            if rx.changed().await.is_err() {
                // The adapter is gone: it will not fail any more.
                std::future::pending::<()>().await;
            }
        }
    }

    /// The engine's context length in tokens, when known.
    pub fn max_context_tokens(&self) -> Option<u64> {
        Some(self.max_context_tokens.load(Ordering::Relaxed)).filter(|&n| n > 0)
    }

    /// The last scrape.
    pub fn scraped(&self) -> EngineMetrics {
        self.view.lock().scraped().clone()
    }

    /// KV capacity: config first, then the engine's own report, then a default.
    pub fn kv_capacity_tokens(&self) -> u64 {
        self.view.lock().kv_capacity_tokens()
    }

    /// Requests we sent and that have not finished.
    pub fn inflight(&self) -> u64 {
        self.view.lock().inflight()
    }

    /// The view's accounting counters.
    pub fn counters(&self) -> ViewCounters {
        self.view.lock().counters()
    }

    /// The local queue signal now (see [`EngineView::queue_stats`]), with the models
    /// the engine serves.
    pub fn queue_stats(&self, epoch: u64) -> QueueStats {
        let now_ms = self.now_ms();
        let mut stats = self.view.lock().queue_stats(epoch, now_ms);
        stats.models = self.models.lock().ids.clone();
        stats
    }

    /// The model ids the engine listed last; empty until a list was read.
    pub fn models(&self) -> Vec<String> {
        self.models.lock().ids.clone()
    }

    /// The engine's own `/v1/models` entries (ids and whatever else it says of them,
    /// e.g. `max_model_len`), as last read.
    pub fn model_entries(&self) -> Vec<serde_json::Value> {
        self.models.lock().entries.clone()
    }

    /// A copy of the node's prefill fit.
    pub fn fit(&self) -> PrefillFit {
        self.view.lock().fit().clone()
    }

    /// Record a dispatch now (see [`EngineView::dispatch`]); the returned ticket
    /// releases it as the request progresses (first byte: prefill done, or its
    /// expected end when the response is not streamed, [`FirstToken`]; drop: finished
    /// or cancelled). The view's events are all stamped by this adapter's clock, so the
    /// decode time it measures (first byte to finish) is on one clock.
    pub fn dispatch(
        self: &Arc<Self>,
        prompt_tokens: u64,
        uncached_tokens: u64,
        first_token: FirstToken,
    ) -> EngineTicket {
        let id = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        let now_ms = self.now_ms();
        let mut view = self.view.lock();
        match first_token {
            FirstToken::Streamed => view.dispatch(id, prompt_tokens, uncached_tokens, now_ms),
            FirstToken::AtTheEnd => {
                view.dispatch_unobserved(id, prompt_tokens, uncached_tokens, now_ms)
            }
        };
        drop(view);
        EngineTicket {
            engine: self.clone(),
            id,
        }
    }

    /// Send a real request (one the breaker judges the engine by) and wait for its
    /// head: refused at once while the breaker is open, abandoned the moment it opens
    /// (so the caller can fall back before the first byte), its outcome counted: a
    /// failure or a gateway failure's head ([`EngineAdapter::is_gateway_failure`]) as a
    /// failure, another 5xx not at all, any other head as a success.
    pub async fn send_request(
        &self,
        method: http::Method,
        path: &str,
        headers: &[(String, String)],
        body: Bytes,
    ) -> Result<reqwest::Response, EngineFailure> {
        let result = self
            .send_streamed(method, path, headers, body, FirstToken::Streamed)
            .await;
        if matches!(&result, Ok(resp) if !resp.status().is_server_error()) {
            self.record(RequestOutcome::Answered);
        }
        result
    }

    /// Whether an engine's response head says the engine, not the request, failed: a
    /// 502, 503 or 504 (Envoy's "gateway failures"), which count against the breaker.
    /// Another 5xx is the engine answering for the request: llama-cpp-python answers
    /// 500 to a body it cannot parse, so counting it would let one client's three bad
    /// requests shut the engine off for everyone for a cooldown. It counts neither way
    /// (the request is still routed elsewhere, and a client with nowhere else to go
    /// gets the answer); an engine that fails every request so is the health check's
    /// to find.
    pub fn is_gateway_failure(status: http::StatusCode) -> bool {
        matches!(status.as_u16(), 502..=504)
    }

    /// What an engine's 5xx head is to `gorgo_engine_failures_total`: a gateway
    /// failure ([`EngineAdapter::is_gateway_failure`]) or the engine answering for the
    /// request.
    pub fn failure_kind(status: http::StatusCode) -> EngineFailureKind {
        if Self::is_gateway_failure(status) {
            EngineFailureKind::Gateway
        } else {
            EngineFailureKind::Answered
        }
    }

    /// [`EngineAdapter::send_request`] for a response whose body the caller relays:
    /// failures before the head and gateway failures' heads are counted here, the
    /// success is not (nor another 5xx, [`EngineAdapter::is_gateway_failure`]);
    /// the caller records the outcome when the body ends ([`EngineAdapter::record`]),
    /// so an engine that dies mid-stream counts as failing. `first_token` says when the
    /// head is due ([`EngineAdapter::head_timeout`]). A streamed request is abandoned
    /// the moment the breaker opens; one not streamed, whose head comes only with the
    /// whole answer, once the engine fails again while the breaker is open (a second
    /// health check in a row, or the probe): abandoning it at the first opening threw
    /// away minutes of generation (run again elsewhere, or failed) on one health check
    /// that timed out, while a hung engine still fails the next check a health interval
    /// later.
    pub async fn send_streamed(
        &self,
        method: http::Method,
        path: &str,
        headers: &[(String, String)],
        body: Bytes,
        first_token: FirstToken,
    ) -> Result<reqwest::Response, EngineFailure> {
        let head_timeout = self.head_timeout(first_token);
        let now = self.now_ms();
        let (admission, probe_id) = {
            let mut health = self.health.lock();
            let admission = health.admit(now);
            (admission, health.probe())
        };
        if !admission.may_send() {
            return Err(EngineFailure::Refused(
                "engine circuit breaker is open".into(),
            ));
        }
        // The half-open probe holds the only slot until its outcome is in: given up
        // (this future dropped: its client went away) it frees the slot, or the engine
        // would get nothing until the next health check.
        let mut probe = ProbeSlot {
            adapter: self,
            held: admission == Admission::Probe,
            id: probe_id,
        };
        // Subscribed now, before the send: an opening from here on counts.
        let opened = match first_token {
            FirstToken::Streamed => futures::future::Either::Left(self.opened()),
            FirstToken::AtTheEnd => futures::future::Either::Right(self.failed_again()),
        };
        let result = tokio::select! {
            r = self.send(method, path, headers, body, head_timeout) => r,
            _ = opened => Err(EngineFailure::Failed("engine circuit breaker opened".into())),
        };
        probe.held = false;
        let failed = match &result {
            Ok(resp) => Self::is_gateway_failure(resp.status()),
            Err(_) => true,
        };
        match &result {
            // The probe's failure opens the breaker again, if it still holds the slot.
            _ if failed && admission == Admission::Probe => {
                let change = self.health.lock().on_probe_failed(probe_id, self.now_ms());
                self.changed(change);
            }
            _ if failed => self.record(RequestOutcome::Failed),
            // A probe's answer is its head: it closes the breaker now, not when a long
            // body ends (or never, if its client leaves first).
            Ok(_) if admission == Admission::Probe => self.record(RequestOutcome::Answered),
            _ => {}
        }
        result
    }

    /// How long to wait for the engine's response head
    /// ([`LimitsSection::head_timeout`]).
    pub fn head_timeout(&self, first_token: FirstToken) -> Duration {
        match first_token {
            FirstToken::Streamed => self.head_timeouts.0,
            FirstToken::AtTheEnd => self.head_timeouts.1,
        }
    }

    /// Send a request to the engine and wait for its response head, at most
    /// `head_timeout` ([`EngineAdapter::head_timeout`]). The body streams from the
    /// returned response.
    pub async fn send(
        &self,
        method: http::Method,
        path: &str,
        headers: &[(String, String)],
        body: Bytes,
        head_timeout: Duration,
    ) -> Result<reqwest::Response, EngineFailure> {
        let mut req = self
            .client
            .request(method, format!("{}{}", self.base, path));
        for (k, v) in headers {
            req = req.header(k.as_str(), v.as_str());
        }
        let fut = req.body(body).send();
        match tokio::time::timeout(head_timeout, fut).await {
            Err(_) => Err(EngineFailure::Timeout),
            Ok(Err(e)) if e.is_timeout() => Err(EngineFailure::Timeout),
            // Without its URL: the message reaches clients (and peers' clients), who
            // must not learn the engine's address or any credentials in it.
            Ok(Err(e)) => Err(EngineFailure::Failed(e.without_url().to_string())),
            Ok(Ok(resp)) => Ok(resp),
        }
    }

    /// One health check: GET the health path within the health timeout, 2xx is
    /// healthy; the result goes to the breaker.
    pub async fn check_health(&self) -> bool {
        let url = format!("{}{}", self.base, self.health_path);
        let ok = matches!(
            tokio::time::timeout(self.health_timeout, self.client.get(url).send()).await,
            Ok(Ok(r)) if r.status().is_success()
        );
        let now = self.now_ms();
        let (change, again) = {
            let mut health = self.health.lock();
            let open = !matches!(health.state(now), BreakerState::Closed);
            (health.on_check(ok, now), open && !ok)
        };
        self.changed(change);
        if again {
            self.failing_again.send_modify(|n| *n = n.wrapping_add(1));
        }
        ok
    }

    /// True when the engine is routable and at least one health check has confirmed
    /// it.
    pub fn is_ready(&self) -> bool {
        self.health_checked() && self.is_healthy()
    }

    /// Whether a health check of the engine has ever passed.
    pub fn health_checked(&self) -> bool {
        self.health.lock().confirmed()
    }

    /// [`EngineAdapter::learn_models`] for a client's request while no list is known:
    /// at most one such read per `LIMIT_RETRY` whatever the number of requests (an
    /// engine whose list does not parse would otherwise get one read per `/v1/models`
    /// call, from callers who need no token); the periodic task keeps trying anyway.
    pub async fn learn_models_if_unknown(&self) {
        if !self.models().is_empty() {
            return;
        }
        let now = self.now_ms().max(1);
        let asked = self.models_asked_ms.load(Ordering::Relaxed);
        let due = asked == 0 || now.saturating_sub(asked) >= LIMIT_RETRY.as_millis() as u64;
        if due
            && self
                .models_asked_ms
                .compare_exchange(asked, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.learn_models().await;
        }
    }

    /// Read the engine's `/v1/models`: the models it serves (gossiped, so requests
    /// naming a model go where it is served) and, unless the config gave one, its
    /// context length (vLLM's `max_model_len`, SGLang's and others' `context_length` /
    /// `max_context_length`). Failures keep what was known: an answer that cannot be
    /// read (over the cap, not JSON, not a model list, or a 404) is logged once until
    /// the reason changes, and read again at the normal refresh (30 s); a read that
    /// got no answer sooner (5 s). Returns true when a list was read.
    pub async fn learn_models(&self) -> bool {
        let fetched = self.get_json("/v1/models", MAX_MODELS_BYTES).await;
        let (answered, why) = match fetched {
            Fetched::Json(v) => match ModelList::parse(&v) {
                Some(list) => {
                    self.models_read(&v, list);
                    return true;
                }
                None => (
                    true,
                    "not an OpenAI model list ({\"data\": [...]})".to_owned(),
                ),
            },
            Fetched::Refused(why) | Fetched::Unreadable(why) => (true, why),
            Fetched::Failed(why) => (false, why),
        };
        let mut held = self.models.lock();
        held.asked = Some((self.now_ms(), answered));
        if held.error.as_deref() != Some(why.as_str()) {
            if answered {
                tracing::warn!(engine = %self.base, error = %why, kept = ?held.ids, "engine's /v1/models answer cannot be read; the models known are kept, read again in 30 s");
            } else {
                tracing::debug!(engine = %self.base, error = %why, "engine's /v1/models not read");
            }
            held.error = Some(why);
        }
        false
    }

    /// Take the model list `list` the engine's `/v1/models` answer `v` gave.
    fn models_read(&self, v: &serde_json::Value, list: ModelList) {
        if self.max_context_tokens().is_none() {
            if let Some(n) = context_length_of(v) {
                self.max_context_tokens.store(n, Ordering::Relaxed);
                tracing::info!(engine = %self.base, max_context_tokens = n, "engine context length");
            }
        }
        let now = self.now_ms();
        let mut held = self.models.lock();
        if held.ids != list.ids {
            tracing::info!(engine = %self.base, models = ?list.ids, "engine models");
        }
        if held.error.is_some() {
            tracing::info!(engine = %self.base, "engine's /v1/models read again");
        }
        *held = EngineModels {
            ids: list.ids,
            entries: list.entries,
            asked: Some((now, true)),
            error: None,
        };
    }

    /// Read how many requests the engine runs at once, where it says: SGLang's
    /// `/get_server_info` (`effective_max_running_requests_per_dp` summed over its
    /// ranks, else `max_running_requests`), llama.cpp's `/props` (`total_slots`); vLLM
    /// states it nowhere a client can read. An answer without it (or a 404, 405 or
    /// 501: not that kind of server) withdraws an earlier report; a failed or busy read
    /// (no answer, 5xx, 429, ...) keeps it. The config's `max_running_requests`, when set, wins anyway
    /// ([`EngineView::max_running_requests`]).
    pub async fn learn_max_running(&self) {
        let path = match self.kind {
            EngineKind::Sglang => "/get_server_info",
            EngineKind::Openai => "/props",
            EngineKind::Vllm => return,
        };
        let fetched = self.get_json(path, MAX_SERVER_INFO_BYTES).await;
        let answered = matches!(fetched, Fetched::Json(_) | Fetched::Refused(_));
        *self.limit_read.lock() = Some((self.now_ms(), answered));
        let reported = match fetched {
            Fetched::Json(v) => reported_max_running(self.kind, &v),
            Fetched::Refused(_) => None,
            Fetched::Unreadable(_) | Fetched::Failed(_) => return,
        };
        let mut view = self.view.lock();
        let before = view.max_running_requests();
        view.engine_reports_max_running(reported);
        let after = view.max_running_requests();
        drop(view);
        match after {
            _ if before == after => {}
            Some((n, source)) => {
                tracing::info!(engine = %self.base, max_running_requests = n, ?source, "engine concurrency limit");
            }
            None => tracing::info!(engine = %self.base, "engine concurrency limit unknown"),
        }
    }

    /// The concurrency limit the node counts with for this engine, and its source.
    pub fn max_running_requests(&self) -> Option<(u32, LimitSource)> {
        self.view.lock().max_running_requests()
    }

    /// How long a `/health_generate` probe may take, head and answer together: twenty
    /// health timeouts (20 s by default, SGLang's own deadline for that route). A
    /// generation that hangs fails the probe then, not at the first-byte timeout,
    /// while every other probe waits for its answer.
    pub fn generation_probe_deadline(&self) -> Duration {
        self.health_timeout * 20
    }

    /// The body of an answer the node reads itself (not one it streams to a client),
    /// or `None` past `cap` bytes or five health timeouts: an engine that streams
    /// without end or stalls mid-body costs a bounded buffer and a bounded wait.
    pub async fn read_answer(&self, resp: reqwest::Response, cap: usize) -> Option<Vec<u8>> {
        tokio::time::timeout(self.health_timeout * 5, read_capped(resp, cap))
            .await
            .ok()
            .flatten()
    }

    /// GET `path` from the engine as JSON, at most `cap` bytes, within five health
    /// timeouts.
    async fn get_json(&self, path: &str, cap: usize) -> Fetched {
        let url = format!("{}{}", self.base, path);
        let deadline = self.health_timeout * 5;
        // One deadline for the answer and its body together.
        tokio::time::timeout(deadline, self.fetch_json(url, cap))
            .await
            .unwrap_or_else(|_| {
                Fetched::Failed(format!("no answer within {} ms", deadline.as_millis()))
            })
    }

    async fn fetch_json(&self, url: String, cap: usize) -> Fetched {
        let resp = match self.client.get(url).send().await {
            Ok(resp) => resp,
            Err(e) => return Fetched::Failed(e.without_url().to_string()),
        };
        let status = resp.status();
        // Only "no such endpoint" says the engine does not have it; a busy engine's 429
        // or 408 (or an auth error) says nothing about what it has.
        if matches!(status.as_u16(), 404 | 405 | 501) {
            return Fetched::Refused(format!("status {status}"));
        }
        if !status.is_success() {
            return Fetched::Failed(format!("status {status}"));
        }
        let body = match read_capped_or_why(resp, cap).await {
            Ok(body) => body,
            Err(Unread::OverCap) => {
                return Fetched::Unreadable(format!("the answer is over the {cap}-byte cap"))
            }
            Err(Unread::Broken(why)) => return Fetched::Failed(why),
        };
        match serde_json::from_slice::<serde_json::Value>(&body) {
            Ok(v) => Fetched::Json(v),
            Err(e) => Fetched::Refused(format!("not JSON: {e}")),
        }
    }

    /// True when the concurrency limit is to be read again ([`read_due`]).
    fn limit_due(&self) -> bool {
        read_due(*self.limit_read.lock(), self.now_ms())
    }

    /// True when the model list is to be read again ([`read_due`]): an answer that
    /// could not be read is not asked for again at every health check.
    fn models_due(&self) -> bool {
        read_due(self.models.lock().asked, self.now_ms())
    }

    /// One scrape of `/metrics`; a failure keeps the previous values for a while
    /// ([`EngineView::scrape_failed`]).
    pub async fn scrape(&self) {
        if self.kind == EngineKind::Openai {
            return;
        }
        // What the view counts as the engine takes its gauges (see `scrape_started`).
        let mark = self.view.lock().scrape_started();
        let metrics = self.read_metrics().await;
        let now_ms = self.now_ms();
        let mut view = self.view.lock();
        match metrics {
            Some(metrics) => view.scrape(metrics, mark, now_ms),
            None => view.scrape_failed(mark, now_ms),
        }
    }

    /// The engine's `/metrics`, parsed; `None` when it could not be read.
    async fn read_metrics(&self) -> Option<EngineMetrics> {
        let url = format!("{}/metrics", self.base);
        let Ok(Ok(resp)) =
            tokio::time::timeout(Duration::from_secs(5), self.client.get(url).send()).await
        else {
            return None;
        };
        if !resp.status().is_success() {
            return None;
        }
        let Ok(Some(body)) =
            tokio::time::timeout(Duration::from_secs(5), read_capped(resp, MAX_METRICS_BYTES))
                .await
        else {
            return None;
        };
        // Lossy, as reading it as text did before the cap: one bad byte in a label
        // value must not cost the whole scrape.
        let text = String::from_utf8_lossy(&body);
        Some(parse_engine_metrics(&text, self.kind))
    }

    /// Run health checks, scrapes, and the reads of the model list and concurrency
    /// limit until `shutdown`. The reads run beside the health checks, not in their
    /// loop: an engine slow to answer them (SGLang's server info waits on its
    /// scheduler) must not hold back the checks that take it out of routing.
    pub async fn run_background(
        self: Arc<Self>,
        health_interval: Duration,
        metrics_interval: Option<Duration>,
        shutdown: CancellationToken,
    ) {
        let me = &self;
        let health = every(health_interval, &shutdown, || async move {
            me.check_health().await;
        });
        let learn = every(health_interval, &shutdown, || async move {
            if !me.is_healthy() {
                return;
            }
            if me.models_due() {
                me.learn_models().await;
            }
            if me.limit_due() {
                me.learn_max_running().await;
            }
        });
        let scrape = async {
            if let Some(interval) = metrics_interval {
                every(interval, &shutdown, || me.scrape()).await;
            }
        };
        tokio::join!(health, learn, scrape);
    }
}

/// Run `step` every `interval` until `shutdown` (a tick missed while a step ran is
/// not made up).
async fn every<F, Fut>(interval: Duration, shutdown: &CancellationToken, mut step: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => step().await,
        }
    }
}

/// Whether a periodic read of the engine (its model list, its concurrency limit)
/// last `asked` at (ms, whether the engine answered) is due at `now`: never asked;
/// answered (a list, or an answer that could not be read) longer than
/// [`MODELS_REFRESH`] ago; or no answer longer than [`LIMIT_RETRY`] ago.
fn read_due(asked: Option<(u64, bool)>, now: u64) -> bool {
    match asked {
        None => true,
        Some((at, answered)) => {
            let every = if answered {
                MODELS_REFRESH
            } else {
                LIMIT_RETRY
            };
            now.saturating_sub(at) >= every.as_millis() as u64
        }
    }
}

/// What the node holds of its engine's model list.
#[derive(Debug, Default)]
struct EngineModels {
    ids: Vec<String>,
    entries: Vec<serde_json::Value>,
    /// When the list was last asked for (ms), and whether the engine answered: see
    /// [`read_due`].
    asked: Option<(u64, bool)>,
    /// Why the last read gave no list, as logged (once until it changes).
    error: Option<String>,
}

/// A `/v1/models` answer, bounded: at most [`MAX_MODELS`] entries with a string `id`
/// of at most [`MAX_MODEL_ID_BYTES`], duplicates dropped.
#[derive(Debug, PartialEq)]
struct ModelList {
    ids: Vec<String>,
    entries: Vec<serde_json::Value>,
}

impl ModelList {
    /// `None` when the answer is not an OpenAI model list (`{"data": [...]}`).
    fn parse(v: &serde_json::Value) -> Option<ModelList> {
        let data = v.get("data")?.as_array()?;
        let mut out = ModelList {
            ids: Vec::new(),
            entries: Vec::new(),
        };
        for entry in data {
            let Some(id) = entry.get("id").and_then(serde_json::Value::as_str) else {
                continue;
            };
            if id.is_empty() || id.len() > MAX_MODEL_ID_BYTES || out.ids.iter().any(|k| k == id) {
                continue;
            }
            if out.ids.len() == MAX_MODELS {
                tracing::warn!(kept = MAX_MODELS, "engine lists more models than are kept");
                break;
            }
            out.ids.push(id.to_owned());
            out.entries.push(entry.clone());
        }
        Some(out)
    }
}

/// The context length a `/v1/models` answer states for its first model.
fn context_length_of(models: &serde_json::Value) -> Option<u64> {
    let first = models.get("data")?.as_array()?.first()?;
    ["max_model_len", "context_length", "max_context_length"]
        .iter()
        .find_map(|k| first.get(*k).and_then(serde_json::Value::as_u64))
        .filter(|&n| n > 0)
}

/// `resp`'s body, or `None` once it passes `cap` bytes (read chunk by chunk, so an
/// engine that streams more than it announced, or announces nothing, is cut off there)
/// or breaks. Every answer the node reads whole from a server it calls (its engines,
/// the OTLP collector) goes through here.
pub(crate) async fn read_capped(resp: reqwest::Response, cap: usize) -> Option<Vec<u8>> {
    read_capped_or_why(resp, cap).await.ok()
}

/// Why [`read_capped`] read no body.
#[derive(Debug)]
enum Unread {
    /// The body is over the cap (announced, or as it came).
    OverCap,
    /// The body broke off.
    Broken(String),
}

/// [`read_capped`], saying why it read nothing.
async fn read_capped_or_why(mut resp: reqwest::Response, cap: usize) -> Result<Vec<u8>, Unread> {
    if resp.content_length().is_some_and(|n| n > cap as u64) {
        return Err(Unread::OverCap);
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| Unread::Broken(e.without_url().to_string()))?
    {
        if body.len() + chunk.len() > cap {
            return Err(Unread::OverCap);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// What a GET of an engine's JSON endpoint gave; each failure with why, for the log.
#[derive(Debug)]
enum Fetched {
    /// A JSON answer.
    Json(serde_json::Value),
    /// The engine answered, but not with it (404, 405 or 501, or a body that is not
    /// JSON): it does not have this.
    Refused(String),
    /// An answer over the cap: it has this, and more of it than is read.
    Unreadable(String),
    /// No answer, any other error status (a busy 429, a 5xx), or a body that broke
    /// off: nothing learnt either way.
    Failed(String),
}

/// The concurrency limit a server-info answer states (0 or absent: none). SGLang puts
/// its server arguments at the top level (`max_running_requests`, null when left to
/// the server) and what each data-parallel scheduler runs with in `internal_states`
/// (`effective_max_running_requests_per_dp`; older servers `max_running_requests`),
/// which wins: the scheduler lowers the argument to what its pools hold; llama.cpp's
/// `/props` has `total_slots`.
fn reported_max_running(kind: EngineKind, info: &serde_json::Value) -> Option<u32> {
    let limit = |v: &serde_json::Value, key: &str| {
        v.get(key)
            .and_then(serde_json::Value::as_u64)
            .filter(|&n| n > 0)
            .map(|n| n.min(u32::MAX as u64) as u32)
    };
    match kind {
        EngineKind::Sglang => {
            let states = info
                .get("internal_states")
                .and_then(serde_json::Value::as_array)
                .map(Vec::as_slice)
                .unwrap_or_default();
            // What the scheduler runs with (the argument lowered to what its pools
            // hold), one entry per data-parallel rank: the engine runs their sum.
            let effective: Vec<u32> = states
                .iter()
                .filter_map(|s| limit(s, "effective_max_running_requests_per_dp"))
                .collect();
            if !effective.is_empty() {
                return Some(effective.iter().fold(0u32, |a, &n| a.saturating_add(n)));
            }
            // Older servers: the scheduler's settled value, then the argument asked for.
            states
                .iter()
                .find_map(|s| limit(s, "max_running_requests"))
                .or_else(|| limit(info, "max_running_requests"))
        }
        EngineKind::Openai => limit(info, "total_slots"),
        EngineKind::Vllm => None,
    }
}

/// Whether the node will see a dispatched request's first token
/// ([`EngineAdapter::dispatch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FirstToken {
    /// A streamed response: its first chunk comes with the first token (and an
    /// embedding's whole body comes when its prompt is prefilled).
    Streamed,
    /// A response that is not streamed (`stream: false`, the OpenAI default) comes
    /// whole once the request has finished decoding: the view takes its prefill as
    /// done when it is expected to end ([`EngineView::dispatch_unobserved`]).
    AtTheEnd,
}

/// The breaker's half-open probe slot while its request waits for a head: dropped
/// still `held` (the request was given up), it frees the slot.
struct ProbeSlot<'a> {
    adapter: &'a EngineAdapter,
    held: bool,
    /// Which probe ([`gorgo_core::health::EngineHealth::probe`]).
    id: u64,
}

impl Drop for ProbeSlot<'_> {
    fn drop(&mut self) {
        if self.held {
            self.adapter.health.lock().abandon_probe(self.id);
        }
    }
}

/// One dispatch in the view, released in steps. Dropped without
/// [`EngineTicket::completed`], it counts as cancelled or failed
/// ([`EngineView::cancel`]).
#[derive(Debug)]
pub struct EngineTicket {
    engine: Arc<EngineAdapter>,
    id: u64,
}

impl EngineTicket {
    /// The first response byte arrived now: the prompt is prefilled. Pass the
    /// measured engine-side TTFT for the fit when the response is a success, `None`
    /// otherwise. Repeats are ignored.
    pub fn prefilled(&mut self, engine_ttft_ms: Option<f64>) {
        let now_ms = self.engine.now_ms();
        self.engine
            .view
            .lock()
            .first_token(self.id, engine_ttft_ms, now_ms);
    }
}

impl EngineTicket {
    /// The first response byte of a success arrived now, with no prefill time the fit
    /// can use ([`EngineView::first_token_unmeasured`]). Repeats are ignored.
    pub fn prefilled_unmeasured(&mut self) {
        let now_ms = self.engine.now_ms();
        self.engine
            .view
            .lock()
            .first_token_unmeasured(self.id, now_ms);
    }

    /// The response ran to its end with a success status: release it, and let its
    /// decode time count ([`EngineView::finish`]). An error response is dropped
    /// instead (cancelled): its body is no decode.
    pub fn completed(self) {
        let now_ms = self.engine.now_ms();
        self.engine.view.lock().finish(self.id, now_ms);
        // Drop's cancel then finds nothing left to release.
    }
}

impl Drop for EngineTicket {
    fn drop(&mut self) {
        self.engine.view.lock().cancel(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_not_streamed_waits_for_its_head_as_long_as_the_request() {
        let section: EngineSection =
            toml::from_str("url = \"http://127.0.0.1:9\"\nkind = \"sglang\"").unwrap();
        let limits = crate::config::LimitsSection::default();
        let engine = EngineAdapter::new(&section, 0, &limits).unwrap();
        assert_eq!(
            engine.head_timeout(FirstToken::Streamed),
            limits.head_timeout(true)
        );
        assert_eq!(
            engine.head_timeout(FirstToken::AtTheEnd),
            limits.head_timeout(false)
        );
        assert!(
            engine.head_timeout(FirstToken::AtTheEnd) > engine.head_timeout(FirstToken::Streamed)
        );
    }

    #[test]
    fn tickets_drive_the_view() {
        let section: EngineSection =
            toml::from_str("url = \"http://127.0.0.1:9\"\nkind = \"openai\"").unwrap();
        let engine = Arc::new(
            EngineAdapter::new(&section, 0, &crate::config::LimitsSection::default()).unwrap(),
        );
        let mut ticket = engine.dispatch(1000, 150, FirstToken::Streamed);
        let stats = engine.queue_stats(0);
        assert_eq!(stats.unfinished_prefill_tokens, 150);
        assert_eq!(stats.queued_prompt_tokens, 1000);
        assert_eq!(engine.inflight(), 1);
        ticket.prefilled(None);
        assert_eq!(engine.queue_stats(0).unfinished_prefill_tokens, 0);
        drop(ticket);
        let stats = engine.queue_stats(0);
        assert_eq!((stats.queued_prompt_tokens, engine.inflight()), (0, 0));
        // Dropped before the first byte (a cancel): everything is released too.
        drop(engine.dispatch(10, 50, FirstToken::Streamed));
        assert_eq!(engine.counters().unfinished_prefill_tokens, 0);
    }

    #[test]
    fn model_lists_are_bounded_and_deduplicated() {
        let v = serde_json::json!({"object": "list", "data": [
            {"id": "base", "object": "model", "max_model_len": 4096},
            {"id": "base"},
            {"id": "lora-a", "parent": "base"},
            {"object": "model"},
            {"id": ""},
            {"id": "x".repeat(MAX_MODEL_ID_BYTES + 1)},
        ]});
        let list = ModelList::parse(&v).unwrap();
        assert_eq!(list.ids, ["base", "lora-a"]);
        assert_eq!(list.entries[0]["max_model_len"], 4096);
        let many: Vec<_> = (0..MAX_MODELS + 10)
            .map(|i| serde_json::json!({"id": format!("m{i}")}))
            .collect();
        let list = ModelList::parse(&serde_json::json!({ "data": many })).unwrap();
        assert_eq!(list.ids.len(), MAX_MODELS);
        assert_eq!(ModelList::parse(&serde_json::json!({"models": []})), None);
    }

    #[test]
    fn context_length_is_read_from_vllm_and_sglang_model_lists() {
        let vllm = serde_json::json!({"data": [{"id": "m", "max_model_len": 32768}]});
        let sglang = serde_json::json!({"data": [{"id": "m", "context_length": 8192}]});
        let none = serde_json::json!({"data": [{"id": "m"}]});
        assert_eq!(context_length_of(&vllm), Some(32768));
        assert_eq!(context_length_of(&sglang), Some(8192));
        assert_eq!(context_length_of(&none), None);
        assert_eq!(context_length_of(&serde_json::json!({"data": []})), None);
    }

    /// An engine answering with a body that never says its length is cut off at the
    /// cap, not read to the end; one under the cap is read whole.
    #[tokio::test]
    async fn bodies_without_a_length_are_cut_off_at_the_cap() {
        use axum::body::Body;
        use futures::stream;
        let app = axum::Router::new()
            .route(
                "/endless",
                axum::routing::get(|| async {
                    let chunks = stream::iter(
                        (0..64).map(|_| Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; 65_536]))),
                    );
                    Body::from_stream(chunks)
                }),
            )
            .route(
                "/small",
                axum::routing::get(|| async {
                    Body::from_stream(stream::iter([Ok::<_, std::io::Error>(Bytes::from("{}"))]))
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let client = reqwest::Client::new();
        let get = |path: &str| client.get(format!("http://{addr}{path}")).send();
        let endless = get("/endless").await.unwrap();
        assert_eq!(endless.content_length(), None);
        assert_eq!(read_capped(endless, 1 << 20).await, None);
        let small = get("/small").await.unwrap();
        assert_eq!(
            read_capped(small, 1 << 20).await.as_deref(),
            Some(&b"{}"[..])
        );
        server.abort();
    }

    /// An engine's `/v1/models` answer that cannot be read (not JSON, over the cap) is
    /// warned of once until the reason changes, and not read again before the normal
    /// refresh: it failed silently, and was read again at every health check.
    #[tokio::test]
    async fn an_unreadable_model_list_is_warned_of_once_per_reason() {
        use std::sync::Mutex as StdMutex;
        let answer = Arc::new(StdMutex::new(b"{not json".to_vec()));
        let served = answer.clone();
        let app = axum::Router::new().route(
            "/v1/models",
            axum::routing::get(move || {
                let body = served.lock().unwrap().clone();
                async move { body }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        /// The log lines, kept.
        struct Logs(Arc<StdMutex<Vec<u8>>>);
        impl std::io::Write for Logs {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let logs = Arc::new(StdMutex::new(Vec::<u8>::new()));
        let kept = logs.clone();
        let _subscriber = tracing::subscriber::set_default(
            tracing_subscriber::fmt()
                .with_writer(move || Logs(kept.clone()))
                .with_ansi(false)
                .finish(),
        );
        let section: EngineSection =
            toml::from_str(&format!("url = \"http://{addr}\"\nkind = \"sglang\"")).unwrap();
        let engine =
            EngineAdapter::new(&section, 0, &crate::config::LimitsSection::default()).unwrap();
        assert!(engine.models_due());
        for _ in 0..3 {
            assert!(!engine.learn_models().await);
            assert!(!engine.models_due(), "read again before the refresh");
        }
        *answer.lock().unwrap() = vec![b' '; MAX_MODELS_BYTES + 1];
        for _ in 0..2 {
            assert!(!engine.learn_models().await);
        }
        *answer.lock().unwrap() = br#"{"data": [{"id": "m"}]}"#.to_vec();
        assert!(engine.learn_models().await);
        assert_eq!(engine.models(), ["m"]);
        let text = String::from_utf8(logs.lock().unwrap().clone()).unwrap();
        let warnings: Vec<&str> = text.lines().filter(|l| l.contains("WARN")).collect();
        assert_eq!(warnings.len(), 2, "{text}");
        assert!(warnings[0].contains("not JSON"), "{text}");
        assert!(
            warnings[1].contains(&format!("over the {MAX_MODELS_BYTES}-byte cap")),
            "{text}"
        );
        assert!(text.contains("read again"), "{text}");
        server.abort();
    }

    #[test]
    fn the_concurrency_limit_is_read_where_each_engine_states_it() {
        use serde_json::json;
        let sglang = json!({"max_running_requests": 128, "chunked_prefill_size": 8192});
        // Left to the server: null among the arguments, the scheduler's in its state.
        let settled = json!({"max_running_requests": null,
            "internal_states": [{"max_running_requests": 4096, "last_gen_throughput": 0.0}]});
        // What current SGLang answers: the argument asked for 64, the scheduler runs 52
        // per rank (its state pool), on two data-parallel ranks.
        let effective = json!({"max_running_requests": 64, "internal_states": [
            {"effective_max_running_requests_per_dp": 52, "max_running_requests": 64},
            {"effective_max_running_requests_per_dp": 52}]});
        let llama_cpp = json!({"total_slots": 1, "default_generation_settings": {}});
        assert_eq!(reported_max_running(EngineKind::Sglang, &sglang), Some(128));
        assert_eq!(
            reported_max_running(EngineKind::Sglang, &effective),
            Some(104)
        );
        assert_eq!(
            reported_max_running(EngineKind::Sglang, &settled),
            Some(4096)
        );
        assert_eq!(
            reported_max_running(EngineKind::Openai, &llama_cpp),
            Some(1)
        );
        for (kind, v) in [
            (EngineKind::Sglang, json!({"max_running_requests": 0})),
            (EngineKind::Sglang, json!({"max_running_requests": "128"})),
            (EngineKind::Sglang, json!({"max_running_requests": -1})),
            (EngineKind::Openai, json!({"total_slots": null})),
            (EngineKind::Openai, json!([1, 2])),
            (EngineKind::Vllm, sglang.clone()),
        ] {
            assert_eq!(reported_max_running(kind, &v), None, "{v}");
        }
        let huge = json!({"max_running_requests": u64::MAX});
        assert_eq!(
            reported_max_running(EngineKind::Sglang, &huge),
            Some(u32::MAX)
        );
    }
}
