//! The engine adapter: one pooled HTTP client to the local engine, its health, its
//! `/metrics` (SGLang or vLLM names), and local accounting of work we sent it.
//!
//! Scrapes lag by up to an interval; the local accounting (in-flight requests and
//! prompt tokens not yet prefilled) changes the instant we dispatch, so the routing
//! signal combines both.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use gorgo_core::QueueStats;
use parking_lot::RwLock;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::config::{EngineKind, EngineSection, LimitsSection, DEFAULT_KV_CAPACITY_TOKENS};

/// Largest `/metrics` page we read from the engine.
const MAX_METRICS_BYTES: usize = 4 * 1024 * 1024;

/// What a scrape of the engine's `/metrics` tells us. Absent values stay `None`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct EngineMetrics {
    /// Requests running (in the batch).
    pub running: Option<f64>,
    /// Requests waiting for admission.
    pub waiting: Option<f64>,
    /// KV tokens in use.
    pub kv_used_tokens: Option<f64>,
    /// KV usage as a fraction of capacity.
    pub kv_usage: Option<f64>,
    /// KV capacity in tokens.
    pub kv_capacity_tokens: Option<f64>,
    /// Prefix cache hit rate (0..1), directly or from hits / queries.
    pub cache_hit_rate: Option<f64>,
    /// Sum of TTFT seconds over the engine's life.
    pub ttft_seconds_sum: Option<f64>,
    /// Count of TTFT observations.
    pub ttft_count: Option<f64>,
}

/// Parse an engine's Prometheus text into [`EngineMetrics`], reading SGLang's or
/// vLLM's names depending on `kind`. Gauges with several label sets (ranks) are summed
/// for counts and averaged for fractions. Unparseable lines are skipped: an engine
/// upgrade must not take routing down.
pub fn parse_engine_metrics(text: &str, kind: EngineKind) -> EngineMetrics {
    let samples: Vec<PromSample<'_>> = text.lines().filter_map(parse_prom_line).collect();
    let values = |name: &str| -> Vec<f64> {
        samples
            .iter()
            .filter(|s| s.name == name)
            .map(|s| s.value)
            .collect()
    };
    let sum = |name: &str| {
        let v = values(name);
        (!v.is_empty()).then(|| v.iter().sum::<f64>())
    };
    let mean = |name: &str| {
        let v = values(name);
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    };
    let first = |names: &[&str], f: &dyn Fn(&str) -> Option<f64>| names.iter().find_map(|n| f(n));
    let label_product = |name: &str, a: &str, b: &str| -> Option<f64> {
        samples.iter().filter(|s| s.name == name).find_map(|s| {
            let x: f64 = s.label(a)?.parse().ok()?;
            let y: f64 = s.label(b)?.parse().ok()?;
            Some(x * y)
        })
    };
    match kind {
        EngineKind::Sglang => EngineMetrics {
            running: sum("sglang:num_running_reqs"),
            waiting: sum("sglang:num_queue_reqs"),
            kv_used_tokens: sum("sglang:num_used_tokens"),
            kv_usage: mean("sglang:token_usage"),
            kv_capacity_tokens: sum("sglang:max_total_num_tokens")
                .or_else(|| label_product("sglang:cache_config_info", "num_pages", "page_size")),
            cache_hit_rate: mean("sglang:cache_hit_rate"),
            ttft_seconds_sum: sum("sglang:time_to_first_token_seconds_sum"),
            ttft_count: sum("sglang:time_to_first_token_seconds_count"),
        },
        EngineKind::Vllm => {
            let kv_usage = first(
                &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
                &mean,
            );
            let kv_capacity_tokens =
                label_product("vllm:cache_config_info", "num_gpu_blocks", "block_size");
            let hits = first(
                &["vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"],
                &sum,
            );
            let queries = first(
                &[
                    "vllm:prefix_cache_queries_total",
                    "vllm:prefix_cache_queries",
                ],
                &sum,
            );
            let cache_hit_rate = match (hits, queries) {
                (Some(h), Some(q)) if q > 0.0 => Some(h / q),
                (Some(_), Some(_)) => Some(0.0),
                _ => first(&["vllm:gpu_prefix_cache_hit_rate"], &mean),
            };
            EngineMetrics {
                running: sum("vllm:num_requests_running"),
                waiting: sum("vllm:num_requests_waiting"),
                kv_used_tokens: match (kv_usage, kv_capacity_tokens) {
                    (Some(u), Some(c)) => Some(u * c),
                    _ => None,
                },
                kv_usage,
                kv_capacity_tokens,
                cache_hit_rate,
                ttft_seconds_sum: sum("vllm:time_to_first_token_seconds_sum"),
                ttft_count: sum("vllm:time_to_first_token_seconds_count"),
            }
        }
        EngineKind::Openai => EngineMetrics::default(),
    }
}

/// One sample line of the Prometheus text format.
#[derive(Debug)]
struct PromSample<'a> {
    name: &'a str,
    labels: Vec<(&'a str, String)>,
    value: f64,
}

impl PromSample<'_> {
    fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// Parse one sample line (`name{k="v",...} value [timestamp]`). Comments, blank and
/// malformed lines give `None`. Written here because metric names with colons
/// (`sglang:...`, `vllm:...`) are legal Prometheus but not every parser accepts them.
fn parse_prom_line(line: &str) -> Option<PromSample<'_>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(mut body) = rest.strip_prefix('{') {
        loop {
            body = body.trim_start_matches(|c: char| c == ',' || c.is_whitespace());
            if let Some(after) = body.strip_prefix('}') {
                rest = after;
                break;
            }
            let eq = body.find('=')?;
            let key = body[..eq].trim();
            let quoted = body[eq + 1..].trim_start().strip_prefix('"')?;
            let mut value = String::new();
            let mut escaped = false;
            let mut end = None;
            for (i, ch) in quoted.char_indices() {
                match (escaped, ch) {
                    (true, 'n') => {
                        value.push('\n');
                        escaped = false;
                    }
                    (true, other) => {
                        value.push(other);
                        escaped = false;
                    }
                    (false, '\\') => escaped = true,
                    (false, '"') => {
                        end = Some(i);
                        break;
                    }
                    (false, other) => value.push(other),
                }
            }
            labels.push((key, value));
            body = &quoted[end? + 1..];
        }
    }
    let raw = rest.split_whitespace().next()?;
    let value = match raw {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        other => other.parse::<f64>().ok()?,
    };
    if name.is_empty() || !value.is_finite() {
        return None;
    }
    Some(PromSample {
        name,
        labels,
        value,
    })
}

/// Why a call to the engine failed; the ingress maps it to a status.
#[derive(Debug)]
pub enum EngineFailure {
    /// The engine did not answer in time (504).
    Timeout,
    /// Connection refused, reset, or a broken response (502).
    Failed(String),
}

/// The local engine: client, health, scraped metrics and local accounting.
#[derive(Debug)]
pub struct EngineAdapter {
    client: reqwest::Client,
    base: String,
    kind: EngineKind,
    health_path: String,
    healthy: AtomicBool,
    /// True once a health check has succeeded: readiness needs evidence, not optimism.
    confirmed: AtomicBool,
    scraped: RwLock<EngineMetrics>,
    kv_capacity_config: Option<u64>,
    first_byte_timeout: Duration,
    inflight: AtomicU64,
    unfinished_prefill_tokens: AtomicU64,
    queued_prompt_tokens: AtomicU64,
    seed_t_p_ms: f64,
    seed_base_ms: f64,
    seed_decode_step_ms: f64,
    stats_version: AtomicU64,
    mean_prompt_tokens: AtomicU64,
}

/// Prompt size assumed for requests the engine queues that we know nothing about,
/// until we have seen our own.
const DEFAULT_MEAN_PROMPT_TOKENS: u64 = 1024;

impl EngineAdapter {
    /// Build the adapter and its pooled client (TCP_NODELAY, keep-alive).
    pub fn new(engine: &EngineSection, limits: &LimitsSection) -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder()
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_millis(limits.connect_timeout_ms))
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(1024)
            .build()?;
        Ok(EngineAdapter {
            client,
            base: engine.url.trim_end_matches('/').to_owned(),
            kind: engine.kind,
            health_path: engine.health_path().to_owned(),
            // Optimistic until the first check: a node that starts beside a live engine
            // should serve at once; the first failed check flips it.
            healthy: AtomicBool::new(true),
            confirmed: AtomicBool::new(false),
            scraped: RwLock::new(EngineMetrics::default()),
            kv_capacity_config: engine.kv_capacity_tokens,
            first_byte_timeout: Duration::from_millis(limits.first_byte_timeout_ms),
            inflight: AtomicU64::new(0),
            unfinished_prefill_tokens: AtomicU64::new(0),
            queued_prompt_tokens: AtomicU64::new(0),
            seed_t_p_ms: engine.t_p_ms,
            seed_base_ms: engine.base_ms,
            seed_decode_step_ms: engine.decode_step_ms,
            stats_version: AtomicU64::new(0),
            mean_prompt_tokens: AtomicU64::new(DEFAULT_MEAN_PROMPT_TOKENS),
        })
    }

    /// The engine kind.
    pub fn kind(&self) -> EngineKind {
        self.kind
    }

    /// Whether the last health check passed.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Mark health (from the checker, or from a failed proxy call).
    pub fn set_healthy(&self, healthy: bool) {
        self.healthy.store(healthy, Ordering::Relaxed);
    }

    /// The last scrape.
    pub fn scraped(&self) -> EngineMetrics {
        self.scraped.read().clone()
    }

    /// KV capacity: config first, then the engine's own report, then a default.
    pub fn kv_capacity_tokens(&self) -> u64 {
        self.kv_capacity_config
            .or_else(|| self.scraped.read().kv_capacity_tokens.map(|c| c as u64))
            .filter(|&c| c > 0)
            .unwrap_or(DEFAULT_KV_CAPACITY_TOKENS)
    }

    /// Requests we sent and that have not finished.
    pub fn inflight(&self) -> u64 {
        self.inflight.load(Ordering::Relaxed)
    }

    /// The local queue signal: scraped engine state made fresher by local accounting.
    pub fn queue_stats(&self, t_p_ms: f64, base_ms: f64, epoch: u64) -> QueueStats {
        let m = self.scraped.read().clone();
        let inflight = self.inflight();
        let running = m.running.unwrap_or(0.0).max(0.0) as u64;
        let waiting = m.waiting.unwrap_or(0.0).max(0.0) as u64;
        // Work we dispatched that the last scrape does not show yet counts as waiting.
        let waiting = waiting.max(inflight.saturating_sub(running));
        let capacity = self.kv_capacity_tokens();
        let kv_used = m
            .kv_used_tokens
            .or_else(|| m.kv_usage.map(|u| u * capacity as f64))
            .unwrap_or(0.0)
            .max(0.0) as u64;
        // The engine's own waiting queue may hold work we did not send (other routers,
        // direct clients): count it at our mean prompt size, and trust whichever of
        // that and our accounting is larger.
        let scraped_waiting = m.waiting.unwrap_or(0.0).max(0.0) as u64;
        let mean = self.mean_prompt_tokens.load(Ordering::Relaxed);
        let unfinished = self
            .unfinished_prefill_tokens
            .load(Ordering::Relaxed)
            .max(scraped_waiting.saturating_mul(mean));
        QueueStats {
            version: self.stats_version.fetch_add(1, Ordering::Relaxed) + 1,
            unfinished_prefill_tokens: unfinished,
            running: running.min(u32::MAX as u64) as u32,
            waiting: waiting.min(u32::MAX as u64) as u32,
            kv_used_tokens: kv_used,
            kv_capacity_tokens: capacity,
            queued_prompt_tokens: self.queued_prompt_tokens.load(Ordering::Relaxed),
            t_p_ms,
            base_ms,
            decode_step_ms: self.seed_decode_step_ms,
            epoch,
        }
    }

    /// Seeds of the fitted costs from config: (t_p, base).
    pub fn seed_costs(&self) -> (f64, f64) {
        (self.seed_t_p_ms, self.seed_base_ms)
    }

    /// Record a dispatch; the returned ticket releases the accounting as the request
    /// progresses (first byte: prefill done; drop: finished). `uncached_tokens` is what
    /// the engine must prefill (the prompt less the prefix the shadow index expects it
    /// to have cached): that is the queue's work, while the raw prompt size is what the
    /// `gorgo-paper` score counts.
    pub fn dispatch(self: &Arc<Self>, prompt_tokens: u64, uncached_tokens: u64) -> EngineTicket {
        let prefill_tokens = uncached_tokens.min(prompt_tokens);
        self.inflight.fetch_add(1, Ordering::Relaxed);
        // EWMA (1/8) of the prefill work we dispatch; races between updates only blur it.
        let mean = self.mean_prompt_tokens.load(Ordering::Relaxed);
        let next = (mean * 7 + prefill_tokens) / 8;
        self.mean_prompt_tokens
            .store(next.max(1), Ordering::Relaxed);
        self.unfinished_prefill_tokens
            .fetch_add(prefill_tokens, Ordering::Relaxed);
        self.queued_prompt_tokens
            .fetch_add(prompt_tokens, Ordering::Relaxed);
        EngineTicket {
            engine: self.clone(),
            prompt_tokens,
            prefill_tokens,
            prefilled: false,
        }
    }

    /// Send a request to the engine and wait for its response head (bounded by the
    /// first-byte timeout). The body streams from the returned response.
    pub async fn send(
        &self,
        method: http::Method,
        path: &str,
        headers: &[(String, String)],
        body: Bytes,
    ) -> Result<reqwest::Response, EngineFailure> {
        let mut req = self
            .client
            .request(method, format!("{}{}", self.base, path));
        for (k, v) in headers {
            req = req.header(k.as_str(), v.as_str());
        }
        let fut = req.body(body).send();
        match tokio::time::timeout(self.first_byte_timeout, fut).await {
            Err(_) => Err(EngineFailure::Timeout),
            Ok(Err(e)) if e.is_timeout() => Err(EngineFailure::Timeout),
            Ok(Err(e)) => {
                if e.is_connect() {
                    self.set_healthy(false);
                }
                Err(EngineFailure::Failed(e.to_string()))
            }
            Ok(Ok(resp)) => Ok(resp),
        }
    }

    /// One health check: GET the health path, 2xx is healthy.
    pub async fn check_health(&self) -> bool {
        let url = format!("{}{}", self.base, self.health_path);
        let ok = matches!(
            tokio::time::timeout(Duration::from_secs(5), self.client.get(url).send()).await,
            Ok(Ok(r)) if r.status().is_success()
        );
        self.set_healthy(ok);
        if ok {
            self.confirmed.store(true, Ordering::Relaxed);
        }
        ok
    }

    /// True when the engine is healthy and at least one health check has confirmed it
    /// (what `/readyz` reports).
    pub fn is_ready(&self) -> bool {
        self.confirmed.load(Ordering::Relaxed) && self.is_healthy()
    }

    /// One scrape of `/metrics`; failures keep the previous values.
    pub async fn scrape(&self) {
        if self.kind == EngineKind::Openai {
            return;
        }
        let url = format!("{}/metrics", self.base);
        let Ok(Ok(resp)) =
            tokio::time::timeout(Duration::from_secs(5), self.client.get(url).send()).await
        else {
            return;
        };
        if !resp.status().is_success() {
            return;
        }
        if resp
            .content_length()
            .is_some_and(|l| l as usize > MAX_METRICS_BYTES)
        {
            return;
        }
        let Ok(text) = resp.text().await else { return };
        if text.len() > MAX_METRICS_BYTES {
            return;
        }
        *self.scraped.write() = parse_engine_metrics(&text, self.kind);
    }

    /// Run health checks and scrapes until `shutdown`.
    pub async fn run_background(
        self: Arc<Self>,
        health_interval: Duration,
        metrics_interval: Option<Duration>,
        shutdown: CancellationToken,
    ) {
        let health = {
            let me = self.clone();
            let shutdown = shutdown.clone();
            async move {
                let mut tick = tokio::time::interval(health_interval);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tick.tick() => { me.check_health().await; }
                    }
                }
            }
        };
        let scrape = async move {
            let Some(every) = metrics_interval else {
                return;
            };
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tick.tick() => self.scrape().await,
                }
            }
        };
        tokio::join!(health, scrape);
    }
}

/// Local accounting of one request at the engine; released in steps.
#[derive(Debug)]
pub struct EngineTicket {
    engine: Arc<EngineAdapter>,
    prompt_tokens: u64,
    prefill_tokens: u64,
    prefilled: bool,
}

impl EngineTicket {
    /// The first response byte arrived: the prompt is prefilled.
    pub fn prefilled(&mut self) {
        if !self.prefilled {
            self.prefilled = true;
            self.engine
                .unfinished_prefill_tokens
                .fetch_sub(self.prefill_tokens, Ordering::Relaxed);
        }
    }
}

impl Drop for EngineTicket {
    fn drop(&mut self) {
        self.prefilled();
        self.engine.inflight.fetch_sub(1, Ordering::Relaxed);
        self.engine
            .queued_prompt_tokens
            .fetch_sub(self.prompt_tokens, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM_FIXTURE: &str = include_str!("../tests/fixtures/vllm_metrics_sample.txt");

    #[test]
    fn dispatch_counts_uncached_tokens_as_prefill_work() {
        let section: EngineSection =
            toml::from_str("url = \"http://127.0.0.1:9\"\nkind = \"openai\"").unwrap();
        let engine = Arc::new(
            EngineAdapter::new(&section, &crate::config::LimitsSection::default()).unwrap(),
        );
        let mut ticket = engine.dispatch(1000, 150);
        let stats = engine.queue_stats(1.0, 0.0, 0);
        assert_eq!(stats.unfinished_prefill_tokens, 150);
        assert_eq!(stats.queued_prompt_tokens, 1000);
        assert_eq!(engine.inflight(), 1);
        ticket.prefilled();
        assert_eq!(engine.queue_stats(1.0, 0.0, 0).unfinished_prefill_tokens, 0);
        drop(ticket);
        let stats = engine.queue_stats(1.0, 0.0, 0);
        assert_eq!((stats.queued_prompt_tokens, engine.inflight()), (0, 0));
        // More uncached than prompt (a stale count) is clamped to the prompt.
        let _t = engine.dispatch(10, 50);
        assert_eq!(
            engine.queue_stats(1.0, 0.0, 0).unfinished_prefill_tokens,
            10
        );
    }

    #[test]
    fn parses_the_real_sglang_sample() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/data/reference/sglang_metrics_sample.txt"
        );
        let Ok(text) = std::fs::read_to_string(path) else {
            eprintln!("skipping: {path} missing");
            return;
        };
        let m = parse_engine_metrics(&text, EngineKind::Sglang);
        assert_eq!(m.running, Some(0.0));
        assert_eq!(m.waiting, Some(0.0));
        assert_eq!(m.kv_used_tokens, Some(0.0));
        assert_eq!(m.kv_capacity_tokens, Some(788766.0));
        assert_eq!(m.cache_hit_rate, Some(0.0));
        assert_eq!(m.ttft_count, Some(2.0));
        assert!((m.ttft_seconds_sum.unwrap() - 35.315967517999994).abs() < 1e-9);
    }

    #[test]
    fn parses_the_vllm_fixture() {
        let m = parse_engine_metrics(VLLM_FIXTURE, EngineKind::Vllm);
        assert_eq!(m.running, Some(3.0));
        assert_eq!(m.waiting, Some(2.0));
        assert_eq!(m.kv_usage, Some(0.25));
        assert_eq!(m.kv_capacity_tokens, Some(16.0 * 4096.0));
        assert_eq!(m.kv_used_tokens, Some(0.25 * 16.0 * 4096.0));
        assert_eq!(m.cache_hit_rate, Some(0.5));
        assert_eq!(m.ttft_count, Some(10.0));
    }

    #[test]
    fn older_vllm_gpu_cache_name_is_read() {
        let text = "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name=\"m\"} 0.5\n";
        let m = parse_engine_metrics(text, EngineKind::Vllm);
        assert_eq!(m.kv_usage, Some(0.5));
    }

    #[test]
    fn garbage_gives_empty_metrics_not_a_panic() {
        let m = parse_engine_metrics("{{{ not prometheus\n\u{0}\nfoo bar baz", EngineKind::Sglang);
        assert_eq!(m, EngineMetrics::default());
    }

    proptest::proptest! {
        #[test]
        fn any_text_parses_without_panic(text in "\\PC{0,400}") {
            let _ = parse_engine_metrics(&text, EngineKind::Sglang);
            let _ = parse_engine_metrics(&text, EngineKind::Vllm);
        }

        #[test]
        fn gauge_lines_round_trip(running in 0u32..100_000, waiting in 0u32..100_000, ranks in 1usize..4) {
            let mut text = String::from("# TYPE sglang:num_running_reqs gauge\n");
            for r in 0..ranks {
                text += &format!("sglang:num_running_reqs{{tp_rank=\"{r}\",model_name=\"a,b}}\"}} {running}.0\n");
                text += &format!("sglang:num_queue_reqs{{tp_rank=\"{r}\"}} {waiting}\n");
            }
            let m = parse_engine_metrics(&text, EngineKind::Sglang);
            proptest::prop_assert_eq!(m.running, Some(running as f64 * ranks as f64));
            proptest::prop_assert_eq!(m.waiting, Some(waiting as f64 * ranks as f64));
        }
    }
}
