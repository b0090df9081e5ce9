//! `/metrics` in the names and text format of the engine the emulator passes for.
//!
//! Hand-formatted rather than through a registry so the names, label sets and bucket
//! bounds are exactly the engine's: SGLang's as in
//! `../shared/data/reference/sglang_metrics_sample.txt`, vLLM's as its V1 engine
//! registers them (`vllm/v1/metrics/loggers.py`), labels in the sorted order
//! `prometheus_client` writes them. Routers written against a real scrape read the
//! emulator unchanged, and a node reads the same queue stats from either kind.

use std::fmt::Write;

use gorgo_core::EngineMetrics;

use crate::{EmulatedKind, EngineStats};

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

/// vLLM's TTFT histogram bounds (`vllm:time_to_first_token_seconds`), seconds.
pub const VLLM_TTFT_BUCKETS_S: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// vLLM's request latency bounds (`vllm:e2e_request_latency_seconds`), seconds.
pub const VLLM_E2E_BUCKETS_S: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
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

    /// Write the histogram as `name`, each series labelled `{before}le="..",{after}`
    /// and `_sum`/`_count` `{before}{after}`: `prometheus_client` sorts labels, so
    /// where `le` falls depends on the engine's other label names.
    fn write(&self, out: &mut String, name: &str, help: &str, before: &str, after: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let _ = writeln!(out, "{name}_sum{{{before}{after}}} {:?}", self.sum);
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{{before}le=\"{b:?}\",{after}}} {cum}.0");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{before}le=\"+Inf\",{after}}} {}.0",
            self.count
        );
        let _ = writeln!(out, "{name}_count{{{before}{after}}} {}.0", self.count);
    }
}

/// Everything `/metrics` shows, gathered by the engine driver.
#[derive(Debug, Clone)]
pub struct MetricsSnapshot {
    /// Whose names, labels and histogram bounds the page uses.
    pub kind: EmulatedKind,
    /// The engine model's figures.
    pub stats: EngineStats,
    /// TTFT as the engine sees it (arrival to first token), seconds.
    pub ttft: Histogram,
    /// Arrival to last token, seconds.
    pub e2e: Histogram,
    /// Requests that finished.
    pub requests_total: u64,
}

/// One sample of a gauge or counter: its name without the engine's prefix, its help
/// text and its value.
type Sample = (&'static str, &'static str, f64);

impl MetricsSnapshot {
    /// An empty snapshot of an engine of `kind` (its histogram bounds).
    pub fn new(kind: EmulatedKind) -> Self {
        let (ttft, e2e) = match kind {
            EmulatedKind::Sglang => (TTFT_BUCKETS_S, E2E_BUCKETS_S),
            EmulatedKind::Vllm => (VLLM_TTFT_BUCKETS_S, VLLM_E2E_BUCKETS_S),
        };
        MetricsSnapshot {
            kind,
            stats: EngineStats::default(),
            ttft: Histogram::new(ttft),
            e2e: Histogram::new(e2e),
            requests_total: 0,
        }
    }

    /// Render in Prometheus text format with the kind's names and labels (the model
    /// name escaped as a label value, so any name keeps the page parseable).
    /// `block_tokens` is the prefix cache's page: vLLM states its KV capacity as
    /// blocks of that many tokens (`vllm:cache_config_info`).
    pub fn render(&self, model: &str, block_tokens: u64) -> String {
        let model = &*escape_label_value(model);
        let mut out = String::with_capacity(4096);
        match self.kind {
            EmulatedKind::Sglang => self.render_sglang(&mut out, model),
            EmulatedKind::Vllm => self.render_vllm(&mut out, model, block_tokens),
        }
        out
    }

    /// SGLang's page: counters by model, gauges by model and rank.
    fn render_sglang(&self, out: &mut String, model: &str) {
        let s = &self.stats;
        let counters: [Sample; 4] = [
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
        ];
        let by_model = format!("model_name=\"{model}\"");
        write_samples(out, "sglang:", "counter", &by_model, &counters);
        let ranks = format!(
            "engine_type=\"unified\",model_name=\"{model}\",moe_ep_rank=\"0\",pp_rank=\"0\",tp_rank=\"0\""
        );
        let gauges: [Sample; 9] = [
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
            ("token_usage", "The token usage.", token_usage(s)),
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
            UNFINISHED_PREFILL.with(s.unfinished_prefill_tokens as f64),
            DECODE_STEP.with(s.decode_step_ms),
        ];
        write_samples(out, "sglang:", "gauge", &ranks, &gauges);
        self.ttft.write(
            out,
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            "",
            &by_model,
        );
        self.e2e.write(
            out,
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            "",
            &by_model,
        );
    }

    /// vLLM's page (V1 engine, one engine core: `engine="0"`): what its adapter in a
    /// node reads (running, waiting, KV usage, the cache config's blocks, prefix-cache
    /// queries and hits, TTFT) and its token counters.
    fn render_vllm(&self, out: &mut String, model: &str, block_tokens: u64) {
        let s = &self.stats;
        let labels = format!("engine=\"0\",model_name=\"{model}\"");
        let gauges: [Sample; 5] = [
            (
                "num_requests_running",
                "Number of requests in model execution batches.",
                s.running as f64,
            ),
            (
                "num_requests_waiting",
                "Number of requests waiting to be processed.",
                s.waiting as f64,
            ),
            (
                "kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                token_usage(s),
            ),
            UNFINISHED_PREFILL.with(s.unfinished_prefill_tokens as f64),
            DECODE_STEP.with(s.decode_step_ms),
        ];
        write_samples(out, "vllm:", "gauge", &labels, &gauges);
        // vLLM counts the tokens its prefix cache was asked for and found: the
        // emulator's hit rate is the same ratio, so a node reads the same rate.
        let counters: [Sample; 4] = [
            (
                "prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.",
                s.prompt_tokens_total as f64,
            ),
            (
                "prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.",
                s.cached_prompt_tokens_total as f64,
            ),
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
        ];
        write_samples(out, "vllm:", "counter", &labels, &counters);
        // The KV capacity in whole blocks, as vLLM allocates it: a capacity that is
        // not a multiple of the block reads as the blocks it holds.
        let block_tokens = block_tokens.max(1);
        let _ = writeln!(
            out,
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig"
        );
        let _ = writeln!(out, "# TYPE vllm:cache_config_info gauge");
        let _ = writeln!(
            out,
            "vllm:cache_config_info{{block_size=\"{block_tokens}\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"{}\"}} 1.0",
            s.capacity / block_tokens
        );
        let before = "engine=\"0\",";
        let after = format!("model_name=\"{model}\"");
        self.ttft.write(
            out,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            before,
            &after,
        );
        self.e2e.write(
            out,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            before,
            &after,
        );
    }
}

/// A gauge of the emulator's own (name and help), the same under either kind's
/// prefix, so a page stays one engine's names throughout.
struct Extension(&'static str, &'static str);

impl Extension {
    fn with(&self, v: f64) -> Sample {
        (self.0, self.1, v)
    }
}

/// Prompt tokens not yet prefilled (an extension: no engine states it).
const UNFINISHED_PREFILL: Extension = Extension(
    "num_unfinished_prefill_tokens",
    "Prompt tokens admitted or queued and not yet prefilled (gorgo extension).",
);

/// The model's decode-step cost over the current batch (an extension too).
const DECODE_STEP: Extension = Extension(
    "decode_step_ms",
    "Modelled cost of one decode step over the current batch, ms (gorgo extension).",
);

/// Write each sample as a metric of its own (`# HELP`, `# TYPE`, one series labelled
/// `labels`), named `prefix` + its name.
fn write_samples(out: &mut String, prefix: &str, kind: &str, labels: &str, samples: &[Sample]) {
    for (name, help, v) in samples {
        let _ = writeln!(out, "# HELP {prefix}{name} {help}");
        let _ = writeln!(out, "# TYPE {prefix}{name} {kind}");
        let _ = writeln!(out, "{prefix}{name}{{{labels}}} {v:?}");
    }
}

impl EngineStats {
    /// What a node's scrape of this engine's `/metrics` reads: the fields of
    /// [`MetricsSnapshot::render`] that the node's parser
    /// ([`gorgo_core::engine_metrics::parse_engine_metrics`]) turns into
    /// [`EngineMetrics`] under either kind, without the text round trip. The simulator's `/metrics`
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

/// SGLang's `token_usage` gauge and vLLM's `kv_cache_usage_perc`: used over capacity
/// (0 with no capacity). vLLM counts cached blocks no request holds as free, as
/// [`EngineStats::used_tokens`] leaves them out.
fn token_usage(s: &EngineStats) -> f64 {
    if s.capacity == 0 {
        0.0
    } else {
        s.used_tokens as f64 / s.capacity as f64
    }
}

impl Default for MetricsSnapshot {
    fn default() -> Self {
        Self::new(EmulatedKind::default())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use super::*;
    use gorgo_core::engine_metrics::parse_engine_metrics;
    use gorgo_core::EngineKind;

    /// A snapshot of an engine of `kind` with some load: a capacity of whole 16-token
    /// blocks and figures whose ratios are exact in binary, two TTFTs observed.
    fn loaded(kind: EmulatedKind) -> MetricsSnapshot {
        let mut snap = MetricsSnapshot::new(kind);
        snap.stats = EngineStats {
            running: 3,
            waiting: 5,
            used_tokens: 1024,
            capacity: 4096,
            cache_hit_rate: 0.25,
            prompt_tokens_total: 4000,
            cached_prompt_tokens_total: 1000,
            ..EngineStats::default()
        };
        snap.ttft.observe(0.5);
        snap.ttft.observe(1.5);
        snap
    }

    /// `snap`'s page as a node configured with the emulator's kind reads it.
    fn read(snap: &MetricsSnapshot, model: &str) -> EngineMetrics {
        parse_engine_metrics(&snap.render(model, 16), snap.kind.into())
    }

    /// What the page says beyond the model's state (the server's TTFT histogram) left
    /// out.
    fn without_ttft(m: EngineMetrics) -> EngineMetrics {
        EngineMetrics {
            ttft_seconds_sum: None,
            ttft_count: None,
            ..m
        }
    }

    #[test]
    fn scrape_equals_parsing_the_rendered_page_of_either_kind() {
        for kind in EmulatedKind::ALL {
            let snap = loaded(kind);
            let parsed = read(&snap, "m");
            assert_eq!(
                (parsed.ttft_count, parsed.ttft_seconds_sum),
                (Some(2.0), Some(2.0)),
                "{kind}"
            );
            assert_eq!(without_ttft(parsed), snap.stats.scrape(), "{kind}");
        }
    }

    /// A node fronting either kind reads the same queue stats from it (each page read
    /// by the parser of its own kind), and nothing from the other kind's names.
    #[test]
    fn a_node_reads_the_same_stats_from_either_kind() {
        let [sglang, vllm] = EmulatedKind::ALL.map(|kind| read(&loaded(kind), "m"));
        assert_eq!(sglang, vllm);
        assert_eq!(
            (vllm.running, vllm.waiting, vllm.kv_capacity_tokens),
            (Some(3.0), Some(5.0), Some(4096.0))
        );
        for (page, other) in [
            (loaded(EmulatedKind::Sglang), EngineKind::Vllm),
            (loaded(EmulatedKind::Vllm), EngineKind::Sglang),
        ] {
            assert_eq!(
                parse_engine_metrics(&page.render("m", 16), other),
                EngineMetrics::default(),
                "{} read as {other}",
                page.kind
            );
        }
        // vLLM states its capacity in whole blocks: what a block short of full holds
        // is not counted.
        let mut snap = loaded(EmulatedKind::Vllm);
        snap.stats.capacity = 4096 + 15;
        assert_eq!(read(&snap, "m").kv_capacity_tokens, Some(4096.0));
    }

    #[test]
    fn any_model_name_keeps_the_page_parseable() {
        for kind in EmulatedKind::ALL {
            let snap = loaded(kind);
            let name = "org/we\"ird\\name\nline2";
            let page = snap.render(name, 16);
            let parsed = parse_engine_metrics(&page, kind.into());
            assert_eq!(without_ttft(parsed.clone()), snap.stats.scrape(), "{page}");
            assert_eq!(parsed.ttft_count, Some(2.0), "{page}");
            // Every line is a comment or one whole sample carrying the escaped name
            // (but vLLM's cache config, which names no model).
            let escaped = "model_name=\"org/we\\\"ird\\\\name\\nline2\"";
            for line in page
                .lines()
                .filter(|l| !l.starts_with('#') && !l.starts_with("vllm:cache_config_info"))
            {
                assert!(line.contains(escaped), "{line}");
            }
        }
    }

    /// Each sample name of a Prometheus page with the label keys of its series (`le`
    /// aside), and each metric's help text.
    type Shape = (BTreeMap<String, BTreeSet<String>>, BTreeMap<String, String>);

    fn shape(page: &str) -> Shape {
        let (mut labels, mut help) = (BTreeMap::new(), BTreeMap::new());
        for line in page.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
                help.insert(name.to_owned(), text.to_owned());
                continue;
            }
            if line.starts_with('#') || line.is_empty() {
                continue;
            }
            let name_end = line.find(['{', ' ']).unwrap_or(line.len());
            let mut keys = BTreeSet::new();
            if let Some(body) = line[name_end..].strip_prefix('{') {
                // `k="v",...}`: keys end at `=`, values at an unescaped quote.
                let mut rest = body;
                while let Some(eq) = rest.find("=\"") {
                    let key = rest[..eq].trim_start_matches(',');
                    if key != "le" {
                        keys.insert(key.to_owned());
                    }
                    let value = &rest[eq + 2..];
                    let mut escaped = false;
                    let end = value
                        .char_indices()
                        .find(|&(_, c)| {
                            let end = c == '"' && !escaped;
                            escaped = c == '\\' && !escaped;
                            end
                        })
                        .map_or(value.len(), |(i, _)| i);
                    rest = &value[(end + 1).min(value.len())..];
                }
            }
            labels.insert(line[..name_end].to_owned(), keys);
        }
        (labels, help)
    }

    /// The SGLang page uses the names, label keys and help texts of a real SGLang
    /// scrape for every metric the scrape has; the only others are the emulator's
    /// extensions and SGLang's cached-token counter.
    #[test]
    fn the_sglang_page_has_a_real_scrapes_names_and_labels() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/data/reference/sglang_metrics_sample.txt"
        );
        let Ok(real) = std::fs::read_to_string(path) else {
            eprintln!("skipping: {path} missing");
            return;
        };
        let (real_labels, real_help) = shape(&real);
        let (labels, help) = shape(&loaded(EmulatedKind::Sglang).render("m", 16));
        let ours_only = [
            "sglang:cached_tokens_total",
            "sglang:num_unfinished_prefill_tokens",
            "sglang:decode_step_ms",
        ];
        for (name, keys) in &labels {
            match real_labels.get(name) {
                Some(real_keys) => assert_eq!(keys, real_keys, "{name}"),
                None => assert!(ours_only.contains(&name.as_str()), "{name} is not SGLang's"),
            }
        }
        for (name, text) in &help {
            if let Some(real_text) = real_help.get(name) {
                assert_eq!(text, real_text, "{name}");
            }
        }
    }

    /// The vLLM page uses vLLM's names and label keys: those of the parser's vLLM
    /// fixture (written from vLLM's metric definitions), the cache config's labels a
    /// subset of vLLM's (which has more), and no SGLang name.
    #[test]
    fn the_vllm_page_has_vllms_names_and_labels() {
        let fixture = include_str!("../../gorgo-core/tests/fixtures/vllm_metrics_sample.txt");
        let (fixture_labels, fixture_help) = shape(fixture);
        let (labels, help) = shape(&loaded(EmulatedKind::Vllm).render("m", 16));
        let ours_only = [
            "vllm:num_unfinished_prefill_tokens",
            "vllm:decode_step_ms",
            "vllm:generation_tokens_total",
            "vllm:e2e_request_latency_seconds_sum",
            "vllm:e2e_request_latency_seconds_bucket",
            "vllm:e2e_request_latency_seconds_count",
        ];
        for (name, keys) in &labels {
            assert!(name.starts_with("vllm:"), "{name}");
            if name == "vllm:cache_config_info" {
                for key in ["block_size", "num_gpu_blocks", "engine"] {
                    assert!(keys.contains(key), "{key}: {keys:?}");
                }
                continue;
            }
            match fixture_labels.get(name) {
                Some(fixture_keys) => assert_eq!(keys, fixture_keys, "{name}"),
                None => assert!(ours_only.contains(&name.as_str()), "{name} is not vLLM's"),
            }
        }
        for (name, text) in &help {
            if let Some(fixture_text) = fixture_help.get(name) {
                assert_eq!(text, fixture_text, "{name}");
            }
        }
    }
}
