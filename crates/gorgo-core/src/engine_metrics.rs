//! What a scrape of an engine's `/metrics` says, and the parser of its Prometheus text.
//!
//! Pure so that every driver of [`crate::accounting::EngineView`] feeds it the same
//! thing: the live node parses the engine's text, the simulator converts its engine
//! model's state (gorgo-engine `EngineStats::scrape`) into the same struct.

use serde::{Deserialize, Serialize};

/// The kind of engine, which decides the `/metrics` names we read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// SGLang (and the GORGO emulator by default, `gorgo engine --kind sglang`).
    Sglang,
    /// vLLM (`vllm:` metric names; the emulator with `gorgo engine --kind vllm`).
    Vllm,
    /// Any OpenAI-compatible server without usable metrics: local accounting only.
    Openai,
}

impl std::fmt::Display for EngineKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EngineKind::Sglang => "sglang",
            EngineKind::Vllm => "vllm",
            EngineKind::Openai => "openai",
        })
    }
}

impl std::str::FromStr for EngineKind {
    type Err = crate::CoreError;

    /// The config's spelling (`sglang`, `vllm`, `openai`), for CLI flags.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "sglang" => Ok(EngineKind::Sglang),
            "vllm" => Ok(EngineKind::Vllm),
            "openai" => Ok(EngineKind::Openai),
            other => Err(crate::CoreError::InvalidConfig {
                field: "engine.kind".into(),
                reason: format!("unknown engine kind `{other}` (expected sglang, vllm or openai)"),
            }),
        }
    }
}

/// What a scrape of the engine's `/metrics` tells us. Absent values stay `None`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
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

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM_FIXTURE: &str = include_str!("../tests/fixtures/vllm_metrics_sample.txt");

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
