//! `/metrics` in SGLang's names and text format.
//!
//! Hand-formatted rather than through a registry so the names, label sets and bucket
//! bounds are exactly SGLang's (see `../shared/data/reference/sglang_metrics_sample.txt`):
//! routers written against a real SGLang scrape read the emulator unchanged.

use std::fmt::Write;

use gorgo_core::EngineMetrics;

use crate::EngineStats;

/// SGLang's TTFT histogram bounds, seconds.
pub const TTFT_BUCKETS_S: &[f64] = &[
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0,
    400.0,
];

/// SGLang's end-to-end latency histogram bounds, seconds.
pub const E2E_BUCKETS_S: &[f64] = &[
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0,
    400.0, 600.0, 1200.0, 1800.0, 2400.0,
];

/// A cumulative Prometheus histogram over fixed bounds.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// Empty histogram over `bounds` (ascending).
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    /// Record one observation.
    pub fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    fn write(&self, out: &mut String, name: &str, help: &str, model: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let _ = writeln!(out, "{name}_sum{{model_name=\"{model}\"}} {}", self.sum);
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c;
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{b:?}\",model_name=\"{model}\"}} {cum}.0"
            );
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"+Inf\",model_name=\"{model}\"}} {}.0",
            self.count
        );
        let _ = writeln!(
            out,
            "{name}_count{{model_name=\"{model}\"}} {}.0",
            self.count
        );
    }
}

/// Everything `/metrics` shows, gathered by the engine driver.
#[derive(Debug, Clone)]
pub struct MetricsSnapshot {
    /// The engine model's figures.
    pub stats: EngineStats,
    /// TTFT as the engine sees it (arrival to first token), seconds.
    pub ttft: Histogram,
    /// Arrival to last token, seconds.
    pub e2e: Histogram,
    /// Requests that finished.
    pub requests_total: u64,
}

impl MetricsSnapshot {
    /// An empty snapshot.
    pub fn new() -> Self {
        MetricsSnapshot {
            stats: EngineStats::default(),
            ttft: Histogram::new(TTFT_BUCKETS_S),
            e2e: Histogram::new(E2E_BUCKETS_S),
            requests_total: 0,
        }
    }

    /// Render in Prometheus text format with SGLang's names and labels (the model name
    /// escaped as a label value, so any name keeps the page parseable).
    pub fn render(&self, model: &str) -> String {
        let model = &*escape_label_value(model);
        let mut out = String::with_capacity(4096);
        let s = &self.stats;
        for (name, help, v) in [
            (
                "prompt_tokens_total",
                "Number of prefill tokens processed.",
                s.prompt_tokens_total as f64,
            ),
            (
                "generation_tokens_total",
                "Number of generation tokens processed.",
                s.generation_tokens_total as f64,
            ),
            (
                "num_requests_total",
                "Number of requests processed.",
                self.requests_total as f64,
            ),
            (
                "cached_tokens_total",
                "Number of cached prompt tokens.",
                s.cached_prompt_tokens_total as f64,
            ),
        ] {
            let _ = writeln!(out, "# HELP sglang:{name} {help}");
            let _ = writeln!(out, "# TYPE sglang:{name} counter");
            let _ = writeln!(out, "sglang:{name}{{model_name=\"{model}\"}} {v:?}");
        }
        let labels = format!(
            "engine_type=\"unified\",model_name=\"{model}\",moe_ep_rank=\"0\",pp_rank=\"0\",tp_rank=\"0\""
        );
        let usage = token_usage(s);
        for (name, help, v) in [
            (
                "num_running_reqs",
                "The number of running requests.",
                s.running as f64,
            ),
            (
                "num_used_tokens",
                "The number of used tokens.",
                s.used_tokens as f64,
            ),
            ("token_usage", "The token usage.", usage),
            (
                "decode_sum_seq_lens",
                "The sum of all sequence lengths in decode.",
                s.decode_context_tokens as f64,
            ),
            (
                "num_queue_reqs",
                "The number of requests in the waiting queue.",
                s.waiting as f64,
            ),
            (
                "cache_hit_rate",
                "The prefix cache hit rate.",
                s.cache_hit_rate,
            ),
            (
                "max_total_num_tokens",
                "Maximum total number of tokens in the KV cache pool.",
                s.capacity as f64,
            ),
            (
                "num_unfinished_prefill_tokens",
                "Prompt tokens admitted or queued and not yet prefilled (gorgo extension).",
                s.unfinished_prefill_tokens as f64,
            ),
            (
                "decode_step_ms",
                "Modelled cost of one decode step over the current batch, ms (gorgo extension).",
                s.decode_step_ms,
            ),
        ] {
            let _ = writeln!(out, "# HELP sglang:{name} {help}");
            let _ = writeln!(out, "# TYPE sglang:{name} gauge");
            let _ = writeln!(out, "sglang:{name}{{{labels}}} {v:?}");
        }
        self.ttft.write(
            &mut out,
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            model,
        );
        self.e2e.write(
            &mut out,
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            model,
        );
        out
    }
}

impl EngineStats {
    /// What a node's scrape of this engine's `/metrics` reads: the fields of
    /// [`MetricsSnapshot::render`] that the SGLang parser
    /// ([`gorgo_core::engine_metrics::parse_engine_metrics`]) turns into
    /// [`EngineMetrics`], without the text round trip. The simulator's `/metrics`
    /// scrape; the TTFT histogram is the server's, not the model's, so it is absent.
    pub fn scrape(&self) -> EngineMetrics {
        EngineMetrics {
            running: Some(self.running as f64),
            waiting: Some(self.waiting as f64),
            kv_used_tokens: Some(self.used_tokens as f64),
            kv_usage: Some(token_usage(self)),
            kv_capacity_tokens: Some(self.capacity as f64),
            cache_hit_rate: Some(self.cache_hit_rate),
            ttft_seconds_sum: None,
            ttft_count: None,
        }
    }
}

/// `value` as the Prometheus text format wants a label value between its quotes:
/// backslash, double quote and line feed escaped.
fn escape_label_value(value: &str) -> std::borrow::Cow<'_, str> {
    if !value.contains(['\\', '"', '\n']) {
        return value.into();
    }
    let mut out = String::with_capacity(value.len() + 8);
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.into()
}

/// SGLang's `token_usage` gauge: used over capacity (0 with no capacity).
fn token_usage(s: &EngineStats) -> f64 {
    if s.capacity == 0 {
        0.0
    } else {
        s.used_tokens as f64 / s.capacity as f64
    }
}

impl Default for MetricsSnapshot {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gorgo_core::engine_metrics::parse_engine_metrics;
    use gorgo_core::EngineKind;

    /// A snapshot of an engine with some load.
    fn loaded() -> MetricsSnapshot {
        let mut snap = MetricsSnapshot::new();
        snap.stats = EngineStats {
            running: 3,
            waiting: 5,
            used_tokens: 1234,
            capacity: 4096,
            cache_hit_rate: 0.25,
            ..EngineStats::default()
        };
        snap
    }

    #[test]
    fn scrape_equals_parsing_the_rendered_page() {
        let snap = loaded();
        let parsed = parse_engine_metrics(&snap.render("m"), EngineKind::Sglang);
        let direct = snap.stats.scrape();
        assert_eq!(
            EngineMetrics {
                ttft_seconds_sum: None,
                ttft_count: None,
                ..parsed
            },
            direct
        );
    }

    #[test]
    fn any_model_name_keeps_the_page_parseable() {
        let mut snap = loaded();
        snap.ttft.observe(0.5);
        let name = "org/we\"ird\\name\nline2";
        let page = snap.render(name);
        let parsed = parse_engine_metrics(&page, EngineKind::Sglang);
        assert_eq!(
            EngineMetrics {
                ttft_seconds_sum: None,
                ttft_count: None,
                ..parsed
            },
            snap.stats.scrape(),
            "{page}"
        );
        assert_eq!(parsed.ttft_count, Some(1.0), "{page}");
        // Every line is a comment or one whole sample carrying the escaped name.
        let escaped = "model_name=\"org/we\\\"ird\\\\name\\nline2\"";
        for line in page.lines().filter(|l| !l.starts_with('#')) {
            assert!(line.contains(escaped), "{line}");
        }
    }
}
