//! The node's configuration: one TOML file, one schema, one loader.
//!
//! [`NodeConfig`] is the schema: `gorgo node` reads it and `gorgo up` writes it (by
//! serialising values, never by formatting TOML). Every table denies unknown fields so
//! that a typo is an error naming it, and every required field is reported by name
//! when missing. `[tuning]` is the core's [`TuningConfig`] itself (plus two file
//! paths), `routing.policy` a [`PolicyKind`]. [`NodeConfig::validate`] checks the
//! ranges serde cannot, once, and returns the checked [`ValidatedConfig`] that the
//! node starts from.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use gorgo_core::policy::PolicyKind;
use gorgo_core::summary::SampleSetting;
use gorgo_core::Weights;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::NodeError;

/// The whole configuration of one `gorgo node`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// Who this node is.
    pub node: NodeSection,
    /// Where it listens.
    pub listen: ListenSection,
    /// The engine it serves from (`[engine]`), when it fronts one: the same as a
    /// `[[engines]]` list of one. Exactly one of the two forms is given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineSection>,
    /// The engines it serves from (`[[engines]]`): replicas of the same model in this
    /// region, each a routing candidate of its own (docs/design.md, "Replicas"). Each
    /// is replica `i` in gossip and in `/admin/decisions`, in the order given.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub engines: Vec<EngineSection>,
    /// Peers and gossip.
    #[serde(default)]
    pub cluster: ClusterSection,
    /// Certificates for the QUIC mutual TLS.
    pub tls: TlsSection,
    /// Routing policy, weights and the hop guard.
    #[serde(default)]
    pub routing: RoutingSection,
    /// Online tuning of the weights.
    #[serde(default)]
    pub tuning: TuningSection,
    /// The admin API.
    pub admin: AdminSection,
    /// Caps on what clients and peers may cost us.
    #[serde(default)]
    pub limits: LimitsSection,
    /// Where traces go.
    #[serde(default)]
    pub telemetry: TelemetrySection,
}

/// `[telemetry]`: traces of the request path (docs/node.md, "Tracing"). Metrics need
/// no config: Prometheus scrapes `/metrics` on the admin port.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetrySection {
    /// The collector's OTLP/HTTP traces URL, used as given (for example
    /// `http://127.0.0.1:4318/v1/traces`); spans go there as protobuf, in batches.
    /// Unset: no exporter, and no trace context is read or passed on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub otlp_endpoint: Option<String>,
    /// `service.name` of the exported spans.
    #[serde(default = "default_service_name")]
    pub service_name: String,
}

fn default_service_name() -> String {
    "gorgo-node".to_owned()
}

impl Default for TelemetrySection {
    fn default() -> Self {
        TelemetrySection {
            otlp_endpoint: None,
            service_name: default_service_name(),
        }
    }
}

/// `[node]`: identity.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSection {
    /// Unique node id in the cluster (the smallest live id leads tuning).
    pub id: String,
    /// The region this node serves (reported in `x-gorgo-served-by` and metrics).
    pub region: String,
}

/// `[listen]`: the three sockets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenSection {
    /// OpenAI-compatible ingress for clients.
    pub http: SocketAddr,
    /// QUIC endpoint for peers (gossip and forwards).
    pub quic: SocketAddr,
    /// Admin API, `/metrics`, `/healthz`, `/readyz`.
    pub admin: SocketAddr,
    /// Address peers should dial to reach this node, when it differs from `quic`
    /// (for example behind a WAN-emulation relay). Defaults to `quic`.
    #[serde(default)]
    pub advertise_quic: Option<SocketAddr>,
}

/// The kind of engine, which decides the `/metrics` names we read (defined in the
/// core, beside the parser that reads them).
pub use gorgo_core::EngineKind;

/// How validation names an engine's fields in its errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EngineFieldNames {
    /// As the config file has them: `engine.url`, `engines[2].url`.
    File,
    /// The last engine is one `POST /admin/engines` adds: its fields bare, as the
    /// request's body names them (`url`); the others as in the file.
    LastAdded,
}

/// An engine URL in the one form every spelling of the same engine shares: `http://`,
/// the host as the node's HTTP client reads it (in lower case; an IPv4 address in any
/// of the WHATWG forms, `2130706433` or `127.1`, as its dotted quad), and the port,
/// the scheme's default left out; then the path prefix, if any, as written (a gateway
/// that routes by path: `http://gw:8080/llama`), without a trailing `/`. Duplicate
/// engines are found on it (config validation, `POST /admin/engines`, a reload) and
/// the engine adapter sends to it, every path it asks for (`/v1/...`, `/metrics`,
/// the health path) appended: one engine added twice would be two candidates with two
/// gossip streams, each counting half of its requests. A URL [`check_engine_url`]
/// refuses comes back only trimmed (validation refuses it before anything sends to
/// it).
pub fn normalize_engine_url(url: &str) -> String {
    parse_engine_url(url).unwrap_or_else(|_| url.trim_end_matches('/').to_owned())
}

/// Why an engine URL cannot be sent to (the reason, without the field's name), or
/// `Ok`: the one check of `engine.url`, `engines[i].url` (the file, a reload,
/// `POST /admin/engines`) and `gorgo up --engine-url`, so that none of them takes a
/// URL every request to would fail at, or one that names the same engine as another
/// in a spelling the duplicate check cannot see through.
pub fn check_engine_url(url: &str) -> Result<(), String> {
    parse_engine_url(url).map(drop)
}

/// The one parse of an engine URL behind [`check_engine_url`] and
/// [`normalize_engine_url`]: `http://host[:port]`, an optional path prefix
/// ([`engine_path_prefix`]) and at most a trailing `/`, checked as written (the
/// WHATWG parser the HTTP client uses would drop a `.` path segment, an empty `?` or
/// `#` and a port `:`, and read `\` as `/`), then read by that parser, whose origin
/// and path are the normal form.
fn parse_engine_url(url: &str) -> Result<String, String> {
    const FORM: &str = "must be http://host:port, or http://host:port/prefix";
    if url
        .get(.."https://".len())
        .is_some_and(|p| p.eq_ignore_ascii_case("https://"))
    {
        // The node's HTTP client is built without TLS: every request would fail.
        return Err(
            "the node speaks plain HTTP to its engine, which runs beside it: use http://".into(),
        );
    }
    let (_, tail) = split_http_url(url).map_err(|e| match e {
        HttpUrlError::Scheme => "must start with http://".to_owned(),
        HttpUrlError::NotVisibleAscii => format!("{FORM}: visible ASCII only, no spaces"),
        HttpUrlError::UserInfo => format!("{FORM}, without user info (`user@`)"),
        HttpUrlError::Port(why) => why,
    })?;
    // The node appends its own paths, and `/v1/...?x` would not carry the query.
    match tail.find(['?', '#']).map(|at| &tail[at..at + 1]) {
        Some("?") => return Err(format!("{FORM}, without a query (`?`)")),
        Some(_) => return Err(format!("{FORM}, without a fragment (`#`)")),
        None => {}
    }
    engine_path_prefix(tail)?;
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("not a valid URL: {e}"))?;
    // The checks above leave the parser nothing to change in the path: its path is
    // the prefix as written (and what every request is sent under).
    let path = parsed.path();
    let prefix = path.strip_suffix('/').unwrap_or(path);
    Ok(format!("{}{prefix}", parsed.origin().ascii_serialization()))
}

/// Why the path of an engine URL (`tail`, what follows the authority; no query or
/// fragment) is no prefix the node can send under as written, or `Ok`: empty or `/`,
/// or `/` and segments of RFC 3986 path characters (letters, digits,
/// `-._~!$&'()*+,;=:@` and `%` with two hex digits: percent-encoding is left as
/// written), with at most a trailing `/`. Refused: an empty segment (`//`), a `.` or
/// `..` segment (also as `%2e`: the HTTP client's parser drops or climbs them, so
/// another path than the one written would be sent, and the duplicate check could
/// not see through it), `\` (read as `/`), characters the parser would
/// percent-encode, and a last segment `v1` (the node appends `/v1/...` itself: an
/// OpenAI client's base URL given here would send `/v1/v1/chat/completions`).
fn engine_path_prefix(tail: &str) -> Result<(), String> {
    if matches!(tail, "" | "/") {
        return Ok(());
    }
    let Some(path) = tail.strip_prefix('/') else {
        return Err(format!("the path `{tail}`: `\\` is read as `/`; write `/`"));
    };
    let path = path.strip_suffix('/').unwrap_or(path);
    let is_dot = |seg: &str| {
        matches!(
            seg.to_ascii_lowercase().replace("%2e", ".").as_str(),
            "." | ".."
        )
    };
    for seg in path.split('/') {
        if seg.is_empty() {
            return Err(format!("the path `{tail}`: an empty segment (`//`)"));
        }
        if is_dot(seg) {
            return Err(format!(
                "the path `{tail}`: a `.` or `..` segment (the HTTP client would drop or climb it)"
            ));
        }
        let bytes = seg.as_bytes();
        for (i, &b) in bytes.iter().enumerate() {
            let ok = b.is_ascii_alphanumeric()
                || b"-._~!$&'()*+,;=:@".contains(&b)
                || (b == b'%'
                    && bytes
                        .get(i + 1..i + 3)
                        .is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)));
            // An escape's hex digits are letters or digits: they pass on their own.
            if ok {
                continue;
            }
            return Err(match b {
                b'%' => format!("the path `{tail}`: `%` must start a two-hex-digit escape (`%2F`)"),
                b'\\' => format!("the path `{tail}`: `\\` is read as `/`; write `/`"),
                _ => format!("the path `{tail}`: `{}` must be percent-encoded", b as char),
            });
        }
    }
    if path.rsplit('/').next() == Some("v1") {
        return Err(format!(
            "the path `{tail}` ends in `/v1`: the node appends `/v1/...` itself; leave it out"
        ));
    }
    Ok(())
}

/// Why [`split_http_url`] refused a URL.
enum HttpUrlError {
    /// Not `http://` (in any case).
    Scheme,
    /// A space or control character: the URL parser drops them where it finds them
    /// (a tab, a line break), so what is sent would not be what was written.
    NotVisibleAscii,
    /// `user@host`.
    UserInfo,
    /// The port, and why it cannot be dialled.
    Port(String),
}

/// An `http://` URL as written, split into its authority and what follows it (path,
/// query, fragment), checked the same way for every URL the node dials: the scheme in
/// any case (RFC 3986), visible ASCII, no user info, and a port in 1..=65535 when one
/// is written (the URL parser takes a port as written, so `:0` is accepted and dialled,
/// and fails at every request, and its message for `:99999` does not say which range
/// is meant).
fn split_http_url(url: &str) -> Result<(&str, &str), HttpUrlError> {
    if !url
        .get(.."http://".len())
        .is_some_and(|p| p.eq_ignore_ascii_case("http://"))
    {
        return Err(HttpUrlError::Scheme);
    }
    if !url.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(HttpUrlError::NotVisibleAscii);
    }
    let rest = &url["http://".len()..];
    let (authority, tail) = rest.split_at(rest.find(['/', '?', '#', '\\']).unwrap_or(rest.len()));
    if authority.contains('@') {
        return Err(HttpUrlError::UserInfo);
    }
    // The port as written: after the host, or after an IPv6 literal's `]`.
    let port = match authority.rsplit_once(']') {
        Some((_, after)) => after.strip_prefix(':'),
        None => authority.rsplit_once(':').map(|(_, port)| port),
    };
    if let Some(port) = port {
        let number = Some(port)
            .filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|p| p.parse::<u16>().ok());
        if number.is_none_or(|p| p == 0) {
            return Err(HttpUrlError::Port(format!(
                "port `{port}`: must be in 1..=65535"
            )));
        }
    }
    Ok((authority, tail))
}

/// Why `telemetry.otlp_endpoint` cannot be posted to as written, or `Ok`: an
/// `http://` URL (the node's HTTP client speaks no TLS: a collector runs beside it)
/// checked as every URL the node dials is ([`split_http_url`]). Unlike an engine URL
/// it is used as given, path included (`/v1/traces`).
fn check_otlp_endpoint(url: &str) -> Result<(), String> {
    split_http_url(url).map_err(|e| match e {
        HttpUrlError::Scheme => "must start with http://".to_owned(),
        HttpUrlError::NotVisibleAscii => "visible ASCII only, no spaces".to_owned(),
        HttpUrlError::UserInfo => "without user info (`user@`)".to_owned(),
        HttpUrlError::Port(why) => why,
    })?;
    match reqwest::Url::parse(url) {
        Ok(parsed) if parsed.host_str().is_some_and(|h| !h.is_empty()) => Ok(()),
        Ok(_) => Err("not a valid URL: no host".into()),
        Err(e) => Err(format!("not a valid URL: {e}")),
    }
}

/// Why a `health_path` cannot be polled as written (the reason, without the field's
/// name), or `Ok`: a path, `/` and then visible ASCII, without `?`, `#` or `\`. The
/// URL parser drops control characters and reads `\` as `/` (a path other than the
/// one configured would be polled), and a query or fragment is not a path.
fn check_health_path(path: &str) -> Result<(), String> {
    if !path.starts_with('/') {
        return Err("must start with /".into());
    }
    if !path.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("must be visible ASCII only: no spaces or control characters".into());
    }
    if let Some(c) = path.chars().find(|c| matches!(c, '?' | '#' | '\\')) {
        return Err(format!("must be a path, without `{c}`"));
    }
    Ok(())
}

/// Most ms of `t_p_ms` (a token's prefill) and `decode_step_ms` (a decode step) a
/// seed may say: a second a token is slower than any engine a node fronts (a CPU
/// llama.cpp takes tens of ms), so more is a typo; and near `f64::MAX` the fit's band
/// around its seed is infinite.
pub const MAX_SEED_MS_PER_TOKEN: f64 = 1_000.0;

/// Most ms of `base_ms` (the fixed part of TTFT) a seed may say: ten minutes, the
/// default `limits.request_timeout_ms`, which no fixed cost of a request approaches.
pub const MAX_SEED_BASE_MS: f64 = 600_000.0;

/// `[engine]`: the local inference engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineSection {
    /// Base URL, e.g. `http://127.0.0.1:30000`, or with the path prefix of a gateway
    /// that routes by path, `http://gw:8080/llama`: every path the node asks for
    /// (`/v1/...`, `/metrics`, the health path) is appended ([`normalize_engine_url`]).
    pub url: String,
    /// `sglang`, `vllm` or `openai`.
    pub kind: EngineKind,
    /// KV capacity in tokens; when absent it is read from the engine's metrics, and
    /// failing that `default_kv_capacity_tokens` is used.
    #[serde(default)]
    pub kv_capacity_tokens: Option<u64>,
    /// How many requests the engine runs at once (llama.cpp's `--parallel`, 1 for
    /// llama-cpp-python's server; vLLM's `--max-num-seqs`; SGLang's
    /// `--max-running-requests`). When set, the queue estimate counts the decode of the
    /// requests that hold the slots ahead of a new one (docs/policy.md, "A serial
    /// engine's queue"); absent, the engine is taken to admit whatever its prefill
    /// queue allows.
    #[serde(default)]
    pub max_running_requests: Option<u32>,
    /// Health check path (GET, expects 2xx), under `url`'s path prefix when it has one.
    /// Default: `/health` for SGLang and vLLM, `/v1/models` for a generic OpenAI server.
    #[serde(default)]
    pub health_path: Option<String>,
    /// How often the engine is health-checked, ms.
    #[serde(default = "default_health_interval_ms")]
    pub health_interval_ms: u64,
    /// How often `/metrics` is scraped, ms (0 disables scraping).
    #[serde(default = "default_metrics_interval_ms")]
    pub metrics_interval_ms: u64,
    /// Seed of the fitted prefill cost per uncached token, ms.
    #[serde(default = "default_t_p_ms")]
    pub t_p_ms: f64,
    /// Seed of the fitted fixed TTFT cost, ms.
    #[serde(default = "default_base_ms")]
    pub base_ms: f64,
    /// Seed of the cost of one decode step, ms.
    #[serde(default = "default_decode_step_ms")]
    pub decode_step_ms: f64,
    /// The model's Hugging Face `tokenizer.json`, for prompt-token counts exactly as the
    /// engine counts them (context check, cost model) and a hash chain over token ids in
    /// blocks of `routing.block_tokens`. Without it, tokens are estimated from canonical
    /// bytes with a bytes-per-token ratio learned from the engine's `usage.prompt_tokens`.
    /// Every node of a cluster must agree on having one (and on the tokenizer), or their
    /// prefix summaries do not match.
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
    /// The chat template (a Jinja file, or a `chat_template.json`); default: the
    /// `chat_template` of `tokenizer_config.json` beside `tokenizer`. Only with
    /// `tokenizer`.
    #[serde(default)]
    pub chat_template: Option<PathBuf>,
    /// Whether the engine adds the tokenizer's special tokens (BOS) to a rendered chat
    /// prompt. `false` for vLLM and SGLang (the template writes `bos_token` itself);
    /// `true` for llama-cpp-python's built-in chat formats (`--chat_format chatml`),
    /// which add BOS to a template that has none.
    #[serde(default)]
    pub chat_add_special_tokens: bool,
    /// The engine's context length in tokens; when absent it is read from the
    /// engine's `/v1/models` (`max_model_len`, or `context_length`). A prompt longer
    /// than this is refused before routing.
    #[serde(default)]
    pub max_context_tokens: Option<u64>,
    /// Time a health check may take, ms; slower counts as a failure (a hung engine
    /// accepts connections and answers nothing).
    #[serde(default = "default_health_timeout_ms")]
    pub health_timeout_ms: u64,
    /// Consecutive failures of real requests (connect errors, first-byte timeouts,
    /// 5xx) that open the engine's circuit breaker.
    #[serde(default = "default_breaker_failures")]
    pub breaker_failures: u32,
    /// How long an open breaker waits before one half-open probe, ms.
    #[serde(default = "default_breaker_cooldown_ms")]
    pub breaker_cooldown_ms: u64,
    /// The engine's KV-event publisher, `tcp://host:port` (vLLM's
    /// `--kv-events-config` `endpoint`, SGLang's, `gorgo engine --kv-events`): the
    /// prefix index then follows the engine's own stored and removed blocks while the
    /// stream is healthy, and the shadow model otherwise (docs/kv-events.md). Unset:
    /// the shadow model only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<String>,
    /// The publisher's replay socket, `tcp://host:port` (vLLM's `replay_endpoint`):
    /// asked for the batches a gap lost. Unset: a gap is a resync. Only with
    /// `kv_events`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_replay: Option<String>,
    /// How long a stream whose start the node did not see must run unbroken before the
    /// index follows it, ms (blocks cached before it are unknown until evicted and
    /// stored again).
    #[serde(default = "default_kv_events_warmup_ms")]
    pub kv_events_warmup_ms: u64,
    /// No event for this long while the node sent the engine requests is a silent
    /// stream: a resync onto the shadow model, ms.
    #[serde(default = "default_kv_events_silence_ms")]
    pub kv_events_silence_ms: u64,
    /// Engine blocks tracked at most (memory bound: about 100 bytes plus 4 per token
    /// each); past it, new blocks are dropped and counted.
    #[serde(default = "default_kv_events_max_blocks")]
    pub kv_events_max_blocks: usize,
    /// Largest event batch accepted, bytes; a larger one is a decode error and a
    /// resync.
    #[serde(default = "default_kv_events_max_message_bytes")]
    pub kv_events_max_message_bytes: usize,
    /// 0 starts this engine drained, out of rotation for every policy until
    /// `POST /admin/engines/{r}/serve`; any value above 0 starts it serving, and all
    /// such values are alike: no policy weighs engines by it (the cost-based ones read
    /// each engine's own fit and queue, the load-blind ones treat engines equally).
    #[serde(default = "default_engine_weight")]
    pub weight: f64,
}

impl EngineSection {
    /// An engine at `url` of `kind` with every other field at its default.
    pub fn new(url: impl Into<String>, kind: EngineKind) -> Self {
        EngineSection {
            url: url.into(),
            kind,
            kv_capacity_tokens: None,
            max_running_requests: None,
            health_path: None,
            health_interval_ms: default_health_interval_ms(),
            metrics_interval_ms: default_metrics_interval_ms(),
            t_p_ms: default_t_p_ms(),
            base_ms: default_base_ms(),
            decode_step_ms: default_decode_step_ms(),
            tokenizer: None,
            chat_template: None,
            chat_add_special_tokens: false,
            max_context_tokens: None,
            health_timeout_ms: default_health_timeout_ms(),
            breaker_failures: default_breaker_failures(),
            breaker_cooldown_ms: default_breaker_cooldown_ms(),
            kv_events: None,
            kv_events_replay: None,
            kv_events_warmup_ms: default_kv_events_warmup_ms(),
            kv_events_silence_ms: default_kv_events_silence_ms(),
            kv_events_max_blocks: default_kv_events_max_blocks(),
            kv_events_max_message_bytes: default_kv_events_max_message_bytes(),
            weight: default_engine_weight(),
        }
    }
}

fn default_engine_weight() -> f64 {
    1.0
}

/// `[cluster]`: peers and gossip.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSection {
    /// QUIC addresses to join through.
    #[serde(default)]
    pub seeds: Vec<SocketAddr>,
    /// Peer addresses by node id: added to the seeds (kept for old configs; a node id
    /// is unknown until the first exchange, so it cannot key a dial override: that is
    /// `dial_overrides`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub peers: BTreeMap<String, SocketAddr>,
    /// Dial addresses by advertised address (`"advertised" = "dial"`): to reach a peer
    /// that advertises the key (seeds included), dial the value instead, e.g. a
    /// WAN-emulation relay or a NAT. Keyed by address, not node id, because a peer's
    /// id is only known after the first exchange, its advertised address before.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub dial_overrides: BTreeMap<SocketAddr, SocketAddr>,
    /// Gossip interval for summaries and queue stats, ms.
    #[serde(default = "default_gossip_interval_ms")]
    pub gossip_interval_ms: u64,
    /// One block in this many enters the summary this node gossips: `"auto"` (the
    /// default: by live peer count, 1 up to 4 peers, 2 up to 8, 4 up to 16, 8 up to 32,
    /// with hysteresis) or a power of two from 1 to 64. Summary bytes grow with the
    /// peer count; sampling bounds them at a small cost in routing precision
    /// (docs/cluster.md, "32 regions"). Nodes need not agree: every summary carries
    /// its sender's rate.
    #[serde(default, with = "summary_sample_setting")]
    pub summary_sample: SampleSetting,
}

impl Default for ClusterSection {
    fn default() -> Self {
        ClusterSection {
            seeds: Vec::new(),
            peers: BTreeMap::new(),
            dial_overrides: BTreeMap::new(),
            gossip_interval_ms: default_gossip_interval_ms(),
            summary_sample: SampleSetting::Auto,
        }
    }
}

/// `cluster.summary_sample` in TOML: the string `"auto"` or an integer rate (a string
/// of digits is accepted too, as the command line writes it).
mod summary_sample_setting {
    use gorgo_core::summary::{SampleSetting, SummarySample};
    use serde::{de, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &SampleSetting, s: S) -> Result<S::Ok, S::Error> {
        match v {
            SampleSetting::Auto => s.serialize_str("auto"),
            SampleSetting::Fixed(rate) => s.serialize_u32(rate.rate()),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SampleSetting, D::Error> {
        struct Setting;
        impl de::Visitor<'_> for Setting {
            type Value = SampleSetting;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("\"auto\" or a power of two from 1 to 64")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<SampleSetting, E> {
                v.parse().map_err(E::custom)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<SampleSetting, E> {
                SummarySample::from_rate(v)
                    .map(SampleSetting::Fixed)
                    .map_err(E::custom)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<SampleSetting, E> {
                let v = u64::try_from(v).map_err(|_| {
                    E::custom(format!(
                        "`summary_sample` must be \"auto\" or a power of two from 1 to 64, got {v}"
                    ))
                })?;
                self.visit_u64(v)
            }
        }
        d.deserialize_any(Setting)
    }
}

/// `[tls]`: PEM files for QUIC mutual TLS (see `gorgo certs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSection {
    /// The cluster CA certificate; peers must present a certificate it signed.
    pub ca: PathBuf,
    /// This node's certificate chain.
    pub cert: PathBuf,
    /// This node's private key.
    pub key: PathBuf,
}

/// `[routing]`: the decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingSection {
    /// The policy, named as in docs/design.md (`gorgo`, `gorgo-paper`, `least-load`, ...);
    /// `oracle` is refused (it exists only in the simulator).
    #[serde(default = "default_policy", deserialize_with = "policy_by_name")]
    pub policy: PolicyKind,
    /// Starting weights of the cost model; unset, the policy's own
    /// ([`PolicyKind::default_weights`]: 1/1, the paper's 0.276/0.5 for `gorgo-paper`),
    /// as the simulator uses them. Read through [`RoutingSection::start_weights`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<Weights>,
    /// A request that arrives with `hops >= max_hops` is served where it is.
    #[serde(default = "default_max_hops")]
    pub max_hops: u8,
    /// Block size of the prompt hash chain over canonical bytes (no tokenizer), bytes.
    /// Every node of a cluster must use the same, or their summaries do not match.
    #[serde(default = "default_block_bytes")]
    pub block_bytes: usize,
    /// Block size of the prompt hash chain over token ids (with `engine.tokenizer`),
    /// tokens: a multiple of the engine's KV page size keeps blocks on page boundaries.
    /// Every node of a cluster must use the same.
    #[serde(default = "default_block_tokens")]
    pub block_tokens: usize,
    /// The starting bytes-per-token ratio without a tokenizer; the node then learns the
    /// ratio from the engine's `usage.prompt_tokens` (`/admin/state` `tokens`).
    #[serde(default = "default_bytes_per_token")]
    pub bytes_per_token: usize,
    /// Whether clients may pick the policy per request with `x-gorgo-policy`. Off by
    /// default: routing is the operator's choice, and a client that picks
    /// `local-only` everywhere defeats it. Benchmarks turn it on.
    #[serde(default)]
    pub allow_policy_header: bool,
    /// How many recent decisions `/admin/decisions` keeps.
    #[serde(default = "default_decision_log")]
    pub decision_log: usize,
    /// A request naming a model that no region's engine lists: refused with 404
    /// `model_not_found` (`reject`, OpenAI's and vLLM's answer), or routed as if it
    /// named none (`any`: for engines that serve whatever name they are sent, as
    /// SGLang and llama.cpp do).
    #[serde(default)]
    pub unlisted_model: UnlistedModel,
    /// Whether this node refuses a forward when serving it here would cost more than
    /// the forwarding node said serving it there would (the forward carries that cost;
    /// the forwarding node then serves the request itself). On by default: the target
    /// knows its own queue now, the forwarding node only its last stats
    /// (docs/policy.md, "Refusal at the target").
    #[serde(default = "default_true")]
    pub refuse_forwards: bool,
}

/// `routing.unlisted_model`: what a model that no region lists gets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum UnlistedModel {
    /// 404 `model_not_found`.
    #[default]
    Reject,
    /// Routed among all regions; the engine answers the name.
    Any,
}

impl RoutingSection {
    /// The weights routing starts with: `weights` when set, else the policy's own.
    pub fn start_weights(&self) -> Weights {
        self.weights.unwrap_or(self.policy.default_weights())
    }
}

impl Default for RoutingSection {
    fn default() -> Self {
        RoutingSection {
            policy: default_policy(),
            weights: None,
            max_hops: default_max_hops(),
            block_bytes: default_block_bytes(),
            block_tokens: default_block_tokens(),
            bytes_per_token: default_bytes_per_token(),
            allow_policy_header: false,
            decision_log: default_decision_log(),
            unlisted_model: UnlistedModel::default(),
            refuse_forwards: true,
        }
    }
}

use gorgo_core::es::TuningConfig;
/// How the weights change over time (`online`, `static`, `tune-then-freeze`): the
/// core's enum, so config, admin API and tuner speak one vocabulary.
pub use gorgo_core::es::TuningMode;

/// The two `[tuning]` keys that are the node's, not the tuner's: file paths.
const TUNING_FILE_KEYS: [&str; 2] = ["weights_file", "learned_weights_out"];

/// `[tuning]`: the distributed (1+1)-ES (docs/design.md, "Online tuning"). Its keys are the
/// core's [`TuningConfig`] (`mode`, `window_requests`, `window_max_ms`, `min_samples`,
/// `e2e_guard`, `sigma0`, `w_rtt`, ...) plus two file paths. Keys left unset take the
/// defaults of the policy being tuned ([`TuningSection::for_policy`]: `gorgo` starts
/// at 1.0 in [0.05, 4.0], `gorgo-paper` at the paper's `w_rtt` 0.5 in [0.05, 2.0] and
/// `w_queue` 0.1 in [0.05, 0.5]), with mode `static`.
#[derive(Debug, Clone, PartialEq)]
pub struct TuningSection {
    /// The tuner's configuration, as the core takes it.
    pub es: TuningConfig,
    /// A learned-weights JSON file (`{"rtt_weight", "queue_weight", ...}`, the format
    /// of the paper's `paper_learned_weights.json`): the fixed weights in `static` mode
    /// (instead of `routing.weights`), the start of tuning otherwise (clipped into the
    /// `w_rtt` / `w_queue` bounds).
    pub weights_file: Option<PathBuf>,
    /// Where `tune-then-freeze` writes the learned weights (same format) once frozen.
    pub learned_weights_out: Option<PathBuf>,
}

impl TuningSection {
    /// The defaults of `[tuning]` for tuning `policy`'s weights: the core's defaults for
    /// that policy, in `static` mode (a node tunes only when told to).
    pub fn for_policy(policy: PolicyKind) -> Self {
        TuningSection {
            es: TuningConfig {
                mode: TuningMode::Static,
                ..TuningConfig::for_policy(policy)
            },
            weights_file: None,
            learned_weights_out: None,
        }
    }

    /// The core tuner's configuration, starting from `learned` (weights read from
    /// `weights_file`, clipped into the bounds) when given.
    pub fn core_config(&self, learned: Option<Weights>) -> TuningConfig {
        let mut c = self.es;
        if let Some(w) = learned {
            let start = c.clip(w);
            c.w_rtt.start = start.w_rtt;
            c.w_queue.start = start.w_queue;
        }
        c
    }
}

impl Default for TuningSection {
    fn default() -> Self {
        TuningSection::for_policy(default_policy())
    }
}

/// `[tuning]` as written: the core's fields with the two paths beside them.
#[derive(Serialize)]
struct TuningToml<'a> {
    #[serde(flatten)]
    es: &'a TuningConfig,
    #[serde(skip_serializing_if = "Option::is_none")]
    weights_file: &'a Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    learned_weights_out: &'a Option<PathBuf>,
}

impl Serialize for TuningSection {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        TuningToml {
            es: &self.es,
            weights_file: &self.weights_file,
            learned_weights_out: &self.learned_weights_out,
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for TuningSection {
    /// The two paths are taken out, the rest deserialises into [`TuningConfig`] (which
    /// denies unknown keys, so a typo names itself). Unset keys take the core's
    /// defaults here; the loader fills in the policy's defaults before this runs.
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let mut table = toml::Table::deserialize(deserializer)?;
        let mut path = |key: &str| {
            table
                .remove(key)
                .map(|v| PathBuf::deserialize(v).map_err(|e| D::Error::custom(toml_error(e))))
                .transpose()
        };
        let weights_file = path(TUNING_FILE_KEYS[0])?;
        let learned_weights_out = path(TUNING_FILE_KEYS[1])?;
        // Normally the loader has filled in the policy's defaults already; this fills
        // in `gorgo`'s (and the node's `static` mode) for any other source.
        fill_tuning_defaults(&mut table, default_policy());
        let es = TuningConfig::deserialize(toml::Value::Table(table))
            .map_err(|e| D::Error::custom(toml_error(e)))?;
        Ok(TuningSection {
            es,
            weights_file,
            learned_weights_out,
        })
    }
}

/// `[tuning]` keys and the alias each is also accepted by (`gorgo_core::TuningConfig`'s
/// serde aliases).
const TUNING_KEY_ALIASES: [(&str, &str); 3] = [
    ("window_requests", "window"),
    ("window_max_ms", "time_cap_ms"),
    ("e2e_guard", "guard"),
];

/// Add to a `[tuning]` table every key it does not set, at the defaults for `policy`.
fn fill_tuning_defaults(table: &mut toml::Table, policy: PolicyKind) {
    // Serialising a value of plain numbers and enums cannot fail.
    if let Ok(defaults) = toml::Table::try_from(TuningSection::for_policy(policy).es) {
        for (key, value) in defaults {
            // A key given by its alias is given: its default under the other name
            // made serde see the field twice ("duplicate field `window_requests`").
            let alias = TUNING_KEY_ALIASES
                .iter()
                .find(|(name, _)| *name == key)
                .map(|(_, alias)| *alias);
            if alias.is_some_and(|a| table.contains_key(a)) {
                continue;
            }
            table.entry(key).or_insert(value);
        }
    }
}

/// A TOML error as one line: the message and, when known, the key it is about.
fn toml_error(e: toml::de::Error) -> String {
    e.to_string().trim().replace('\n', " ")
}

/// A TOML syntax error as one line: its line and message, not the source snippet, and
/// the key or table it is about, which toml's message leaves out ("duplicate key",
/// "u64 value was too large"): ``duplicate key `engine.url` ``, ``duplicate table
/// `[limits]` ``, ``invalid `limits.first_byte_timeout_ms`: ...``.
fn syntax_error(text: &str, e: &toml::de::Error) -> String {
    let Some(span) = e.span().filter(|s| text.is_char_boundary(s.start)) else {
        return e.message().to_owned();
    };
    let at = span.start;
    let line_no = 1 + text.as_bytes()[..at]
        .iter()
        .filter(|&&b| b == b'\n')
        .count();
    let start = text[..at].rfind('\n').map_or(0, |i| i + 1);
    let line = text[start..].lines().next().unwrap_or_default();
    let named = text.get(span.clone()).unwrap_or_default();
    let message = e.message();
    let trimmed = line.trim_start();
    if trimmed.starts_with('[') {
        return match message {
            "duplicate key" => format!(
                "line {line_no}: duplicate table `{}`",
                trimmed.split('#').next().unwrap_or_default().trim_end()
            ),
            _ => format!("line {line_no}: {message}"),
        };
    }
    // `key = value` in the table of the last header above it.
    let Some((key, _)) = line.split_once('=') else {
        return format!("line {line_no}: {message}");
    };
    let mut path = table_at(text, start);
    path.extend(key.trim().split('.').map(|k| k.trim().to_owned()));
    let in_value = at > start + key.len();
    match message {
        // A duplicate inside an inline table value: its own key after the line's.
        "duplicate key" if in_value => {
            format!("line {line_no}: duplicate key `{}.{named}`", path.join("."))
        }
        "duplicate key" => format!("line {line_no}: duplicate key `{}`", path.join(".")),
        _ if in_value => format!("line {line_no}: invalid `{}`: {message}", path.join(".")),
        _ => format!("line {line_no}: {message}"),
    }
}

/// The table whose keys the line at byte `line_start` of `text` sets, as config
/// errors name it: the last `[table]` header above it, or `[[engines]]` entry `i` as
/// `engines[i]`; empty at the top level. Read line by line (a multi-line string that
/// holds a line starting with `[` can mislead it: it names a key for an error
/// message, nothing more).
fn table_at(text: &str, line_start: usize) -> Vec<String> {
    let header = |l: &str| {
        let l = l.split('#').next().unwrap_or_default().trim();
        l.starts_with('[').then(|| l.to_owned())
    };
    let headers: Vec<String> = text[..line_start].lines().filter_map(header).collect();
    let Some(last) = headers.last() else {
        return Vec::new();
    };
    let name = |h: &str| h.trim_matches(|c| c == '[' || c == ']').trim().to_owned();
    let mut path: Vec<String> = name(last).split('.').map(|k| k.trim().to_owned()).collect();
    if last.starts_with("[[") {
        let entry = headers
            .iter()
            .filter(|h| h.starts_with("[[") && name(h) == name(last))
            .count()
            - 1;
        if let Some(tail) = path.last_mut() {
            *tail = format!("{tail}[{entry}]");
        }
    }
    path
}

/// `routing.policy` by its docs/design.md name; `oracle` and unknown names are errors (the
/// deserialiser adds the field's name).
fn policy_by_name<'de, D: Deserializer<'de>>(deserializer: D) -> Result<PolicyKind, D::Error> {
    let name = String::deserialize(deserializer)?;
    crate::route::parse_policy(&name).map_err(serde::de::Error::custom)
}

/// `[admin]`: the admin API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminSection {
    /// Bearer token required on `/admin/*`.
    pub token: String,
}

/// `[limits]`: caps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsSection {
    /// Largest request body accepted from a client or peer, bytes.
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: usize,
    /// Most bytes of request bodies (clients' and peers' forwards) being read at once;
    /// a body that would go over is answered 503 before more of it is read. At least
    /// `max_body_bytes` plus 1 MiB (one largest forwarded request).
    #[serde(default = "default_max_body_bytes_in_flight")]
    pub max_body_bytes_in_flight: usize,
    /// Most requests in flight through the ingress at once; more get 503.
    #[serde(default = "default_max_concurrency")]
    pub max_concurrency: usize,
    /// Time allowed to connect to the engine, ms.
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Time allowed until response headers arrive (engine or peer), ms; 504 after.
    #[serde(default = "default_first_byte_timeout_ms")]
    pub first_byte_timeout_ms: u64,
    /// Time allowed for a whole request, ms.
    #[serde(default = "default_request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// Most forwards in flight from or to peers at once.
    #[serde(default = "default_max_forwards")]
    pub max_forwards: usize,
    /// Time a client has to send a request's headers, ms; also how long an idle
    /// HTTP/1 keep-alive connection stays open (hyper's header-read timer starts when
    /// the connection waits for its next request).
    #[serde(default = "default_header_timeout_ms")]
    pub header_timeout_ms: u64,
    /// Time a client has to send a whole request body, ms (408 after): a slow body
    /// must not hold a connection and its buffer for ever.
    #[serde(default = "default_body_timeout_ms")]
    pub body_timeout_ms: u64,
    /// Time a client has to take the response bytes the node has for it, ms: a
    /// connection whose client has stopped reading (its window closed while the node
    /// has more to send) is closed after this, whatever the request's own deadline;
    /// hyper has no write timeout, and such a client would hold its connection slot.
    #[serde(default = "default_write_timeout_ms")]
    pub write_timeout_ms: u64,
    /// A connection with no request in flight for this long is closed, ms (HTTP/2 has
    /// no header timer between streams).
    #[serde(default = "default_idle_timeout_ms")]
    pub idle_timeout_ms: u64,
    /// Most client connections open at once; more are accepted and closed at once.
    /// Capped further by the process's file-descriptor limit, less a reserve kept for
    /// the admin port, the engine pool and peers.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Most client connections open at once from one IP address.
    #[serde(default = "default_max_connections_per_ip")]
    pub max_connections_per_ip: usize,
    /// Largest request head (request line and headers) answered normally, bytes;
    /// larger gets 431.
    #[serde(default = "default_max_header_bytes")]
    pub max_header_bytes: usize,
    /// How long a draining node (SIGTERM) lets in-flight requests finish, ms.
    #[serde(default = "default_drain_timeout_ms")]
    pub drain_timeout_ms: u64,
    /// `Retry-After` sent with 429 and 503 answers to overload, seconds.
    #[serde(default = "default_retry_after_s")]
    pub retry_after_s: u64,
}

/// Longest a configured timeout or interval may be, ms: a week. Why: `Instant +
/// Duration` and `Duration * n` overflow (a panic per request) for values near
/// `u64::MAX`, a natural way to write "no limit"; none of these waits is meant to
/// last longer.
pub const MAX_TIMEOUT_MS: u64 = 7 * 24 * 3_600_000;

/// A configured timeout or interval `v` (ms) of field `field`: in
/// `1..=MAX_TIMEOUT_MS`.
fn check_timeout(field: &str, v: u64) -> Result<(), NodeError> {
    if (1..=MAX_TIMEOUT_MS).contains(&v) {
        return Ok(());
    }
    Err(NodeError::invalid(
        field,
        format!("must be in 1..={MAX_TIMEOUT_MS} (a week)"),
    ))
}

impl LimitsSection {
    /// How long to wait for a response head from an engine or a peer: the first-byte
    /// timeout for a streamed response, whose head comes with its first token; the
    /// request timeout for one that is not streamed, whose head SGLang and vLLM send
    /// only once the whole answer is generated. Why: bounded by the first-byte timeout
    /// (120 s), a long answer that was not streamed timed out while it was generated,
    /// counted against the engine's breaker, and was generated again elsewhere.
    pub fn head_timeout(&self, streamed: bool) -> std::time::Duration {
        let first_byte = std::time::Duration::from_millis(self.first_byte_timeout_ms);
        if streamed {
            first_byte
        } else {
            std::time::Duration::from_millis(self.request_timeout_ms).max(first_byte)
        }
    }
}

impl Default for LimitsSection {
    fn default() -> Self {
        LimitsSection {
            max_body_bytes: default_max_body_bytes(),
            max_body_bytes_in_flight: default_max_body_bytes_in_flight(),
            max_concurrency: default_max_concurrency(),
            connect_timeout_ms: default_connect_timeout_ms(),
            first_byte_timeout_ms: default_first_byte_timeout_ms(),
            request_timeout_ms: default_request_timeout_ms(),
            max_forwards: default_max_forwards(),
            header_timeout_ms: default_header_timeout_ms(),
            write_timeout_ms: default_write_timeout_ms(),
            body_timeout_ms: default_body_timeout_ms(),
            idle_timeout_ms: default_idle_timeout_ms(),
            max_connections: default_max_connections(),
            max_connections_per_ip: default_max_connections_per_ip(),
            max_header_bytes: default_max_header_bytes(),
            drain_timeout_ms: default_drain_timeout_ms(),
            retry_after_s: default_retry_after_s(),
        }
    }
}

fn default_health_interval_ms() -> u64 {
    1_000
}
fn default_metrics_interval_ms() -> u64 {
    gorgo_core::accounting::DEFAULT_METRICS_INTERVAL_MS
}
fn default_t_p_ms() -> f64 {
    gorgo_core::accounting::DEFAULT_SEED_T_P_MS
}
fn default_base_ms() -> f64 {
    gorgo_core::accounting::DEFAULT_SEED_BASE_MS
}
fn default_decode_step_ms() -> f64 {
    gorgo_core::accounting::DEFAULT_DECODE_STEP_MS
}
fn default_gossip_interval_ms() -> u64 {
    250
}
fn default_policy() -> PolicyKind {
    PolicyKind::Gorgo
}
fn default_true() -> bool {
    true
}
fn default_max_hops() -> u8 {
    1
}
fn default_block_bytes() -> usize {
    gorgo_core::hash::DEFAULT_BLOCK_BYTES
}
fn default_block_tokens() -> usize {
    gorgo_core::hash::DEFAULT_BLOCK_TOKENS
}
fn default_bytes_per_token() -> usize {
    gorgo_core::hash::BYTES_PER_TOKEN
}
fn default_decision_log() -> usize {
    256
}
fn default_max_body_bytes() -> usize {
    8 * 1024 * 1024
}
fn default_max_body_bytes_in_flight() -> usize {
    1024 * 1024 * 1024
}
fn default_max_concurrency() -> usize {
    4096
}
fn default_connect_timeout_ms() -> u64 {
    2_000
}
fn default_first_byte_timeout_ms() -> u64 {
    120_000
}
fn default_request_timeout_ms() -> u64 {
    600_000
}
fn default_max_forwards() -> usize {
    4096
}
fn default_header_timeout_ms() -> u64 {
    20_000
}
fn default_body_timeout_ms() -> u64 {
    30_000
}
fn default_write_timeout_ms() -> u64 {
    30_000
}
fn default_idle_timeout_ms() -> u64 {
    60_000
}
fn default_max_connections() -> usize {
    16_384
}
fn default_max_connections_per_ip() -> usize {
    1_024
}
fn default_max_header_bytes() -> usize {
    64 * 1024
}
fn default_drain_timeout_ms() -> u64 {
    30_000
}
fn default_retry_after_s() -> u64 {
    1
}
fn default_health_timeout_ms() -> u64 {
    1_000
}
fn default_breaker_failures() -> u32 {
    3
}
fn default_breaker_cooldown_ms() -> u64 {
    2_000
}

fn default_kv_events_warmup_ms() -> u64 {
    30_000
}

fn default_kv_events_silence_ms() -> u64 {
    30_000
}

fn default_kv_events_max_blocks() -> usize {
    1 << 20
}

fn default_kv_events_max_message_bytes() -> usize {
    gorgo_core::kv_wire::DEFAULT_MAX_PAYLOAD_BYTES
}

/// Ceiling of `engine.kv_events_max_blocks`: 16M blocks is over a gigabyte.
const KV_EVENTS_MAX_BLOCKS_CEILING: usize = 1 << 24;

/// Ceiling of `engine.kv_events_max_message_bytes`.
const KV_EVENTS_MAX_MESSAGE_CEILING: usize = 256 << 20;

/// Most tokens one prefix block may have (`routing.block_tokens`): engines page their
/// KV cache in blocks of 16 to a few hundred tokens.
pub const MAX_BLOCK_TOKENS: usize = 65_536;

/// Most bytes one prefix block may have (`routing.block_bytes`, prompts hashed
/// without a tokenizer): [`MAX_BLOCK_TOKENS`] at 4 bytes a token.
pub const MAX_BLOCK_BYTES: usize = 4 * MAX_BLOCK_TOKENS;

/// `tcp://host:port` with a non-empty host and a port.
fn is_tcp_endpoint(s: &str) -> bool {
    s.strip_prefix("tcp://")
        .and_then(|rest| rest.rsplit_once(':'))
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
}

/// What a wildcard `kv_events` host is told.
const BIND_ENDPOINT: &str =
    "is the engine's bind address (a wildcard host); give the address the node connects to";

/// True for an endpoint whose host is a wildcard to bind to (`*`, `0.0.0.0`, `::`):
/// the engine's side of a ZMQ endpoint (vLLM's `"endpoint": "tcp://*:5557"`), which
/// the node cannot connect to.
fn is_bind_endpoint(s: &str) -> bool {
    s.strip_prefix("tcp://")
        .and_then(|rest| rest.rsplit_once(':'))
        .is_some_and(|(host, _)| matches!(host, "*" | "0.0.0.0" | "[::]" | "::" | "[*]"))
}

/// Hard ceiling on `max_body_bytes`: nothing from the network is unbounded.
pub const MAX_BODY_CEILING: usize = 256 * 1024 * 1024;

/// The most `limits.max_concurrency` and `limits.max_forwards` may be: each is a
/// semaphore's permits, and tokio panics past its own cap (`usize::MAX >> 3`), which
/// TOML's integers reach.
pub const MAX_PERMITS_SETTING: usize = 1 << 24;

/// Room for a forwarded request's fields besides the body (chain, headers, offer): a
/// peer's forward may be this much larger than a client's body.
pub const FORWARD_OVERHEAD_BYTES: usize = 1024 * 1024;

/// The default KV capacity in tokens when neither config nor engine metrics say.
pub const DEFAULT_KV_CAPACITY_TOKENS: u64 = gorgo_core::accounting::DEFAULT_KV_CAPACITY_TOKENS;

impl EngineSection {
    /// The health-check path, defaulted by engine kind.
    pub fn health_path(&self) -> &str {
        match (&self.health_path, self.kind) {
            (Some(p), _) => p,
            (None, EngineKind::Openai) => "/v1/models",
            (None, _) => "/health",
        }
    }
}

/// A [`NodeConfig`] that passed [`NodeConfig::validate`]: what a node starts from, so
/// validation runs once, where the config is read, and nothing downstream re-checks.
/// Read it through `Deref`; change it only by [`into_inner`](Self::into_inner) and
/// validating again.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(transparent)]
pub struct ValidatedConfig(NodeConfig);

impl ValidatedConfig {
    /// The config itself, to change it (and validate it again).
    pub fn into_inner(self) -> NodeConfig {
        self.0
    }
}

impl std::ops::Deref for ValidatedConfig {
    type Target = NodeConfig;
    fn deref(&self) -> &NodeConfig {
        &self.0
    }
}

impl NodeConfig {
    /// Parse TOML text and validate it. Errors name the field.
    pub fn from_toml_str(text: &str) -> Result<ValidatedConfig, NodeError> {
        NodeConfig::parse_toml(text)
            .map_err(NodeError::Config)?
            .validate()
    }

    /// Read, parse and validate a config file; relative paths (TLS, tuning files) are
    /// resolved against the file's directory so a config works from any working
    /// directory. The file is read with a cap ([`gorgo_files::MAX_CONFIG_FILE_BYTES`]:
    /// `/dev/zero` is refused, not read), at startup and on every SIGHUP reload.
    pub fn load(path: &Path) -> Result<ValidatedConfig, NodeError> {
        let text = gorgo_files::read_capped(path, gorgo_files::MAX_CONFIG_FILE_BYTES)
            .map_err(|e| NodeError::Config(format!("cannot read {}: {e}", path.display())))?;
        let mut config = NodeConfig::parse_toml(&text)
            .map_err(|e| NodeError::Config(format!("{}: {e}", path.display())))?;
        if let Some(dir) = path.parent() {
            config.resolve_paths(dir);
        }
        config.validate()
    }

    /// The config as TOML text (what `gorgo up` writes); [`NodeConfig::from_toml_str`]
    /// reads it back to an equal value.
    pub fn to_toml_string(&self) -> Result<String, NodeError> {
        toml::to_string(self).map_err(|e| NodeError::Config(format!("cannot write TOML: {e}")))
    }

    /// Parse without validating. `[tuning]` keys left unset take the defaults of the
    /// configured policy, filled in before deserialising.
    fn parse_toml(text: &str) -> Result<NodeConfig, String> {
        let mut table: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| syntax_error(text, &e))?;
        // An unreadable policy is reported when the whole config is deserialised.
        let policy = table
            .get("routing")
            .and_then(|r| r.get("policy"))
            .and_then(|p| p.as_str())
            .and_then(|p| crate::route::parse_policy(p).ok())
            .unwrap_or_else(default_policy);
        if let Some(tuning) = table
            .entry("tuning")
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
        {
            fill_tuning_defaults(tuning, policy);
        }
        NodeConfig::deserialize(toml::Value::Table(table)).map_err(toml_error)
    }

    fn resolve_paths(&mut self, dir: &Path) {
        for p in [&mut self.tls.ca, &mut self.tls.cert, &mut self.tls.key] {
            if p.is_relative() {
                *p = dir.join(&*p);
            }
        }
        for p in [
            &mut self.tuning.weights_file,
            &mut self.tuning.learned_weights_out,
        ]
        .into_iter()
        .flatten()
        {
            if p.is_relative() {
                *p = dir.join(&*p);
            }
        }
        for e in self.engine.iter_mut().chain(self.engines.iter_mut()) {
            for t in [&mut e.tokenizer, &mut e.chat_template]
                .into_iter()
                .flatten()
            {
                if t.is_relative() {
                    *t = dir.join(&*t);
                }
            }
        }
    }

    /// Range checks serde cannot express, once: the checked config or an error naming
    /// the field.
    pub fn validate(self) -> Result<ValidatedConfig, NodeError> {
        self.check(EngineFieldNames::File)?;
        Ok(ValidatedConfig(self))
    }

    /// [`validate`](Self::validate) for the config of a node with an engine added at
    /// run time (`POST /admin/engines`) as its last `[[engines]]` entry: errors about
    /// that engine name its field as the request's body does (`url`, not
    /// `engines[3].url` of a list the caller never wrote).
    pub fn validate_added_engine(self) -> Result<ValidatedConfig, NodeError> {
        self.check(EngineFieldNames::LastAdded)?;
        Ok(ValidatedConfig(self))
    }

    fn check(&self, names: EngineFieldNames) -> Result<(), NodeError> {
        let bad = |field: &str, reason: &str| Err(NodeError::invalid(field, reason));
        // The id is the TLS name of the node's certificate: refused here, so `--check`
        // says so, not the cluster when the node starts.
        if let Err(e) = gorgo_cluster::validate_node_id(&gorgo_core::NodeId(self.node.id.clone())) {
            let reason = match e {
                gorgo_cluster::ClusterError::Config { reason, .. } => reason,
                other => other.to_string(),
            };
            return bad("node.id", &reason);
        }
        let advertised = self.advertised_quic();
        if advertised.ip().is_unspecified() {
            // Every node would advertise the same address peers cannot dial, and each
            // peer would take the first such claim and refuse the rest as taken.
            let reason = format!(
                "{advertised} (from listen.quic) is not an address peers can dial; set the one they dial"
            );
            return bad("listen.advertise_quic", &reason);
        }
        // The region travels in every membership id (SWIM packets are capped at 1100
        // bytes: a long one never joins) and in the `x-gorgo-served-by` header (which
        // drops a value that is not visible ASCII): the id's rule, which every
        // region name of `gorgo up` (its nodes' ids) already meets.
        if let Err(e) =
            gorgo_cluster::validate_node_id(&gorgo_core::NodeId(self.node.region.clone()))
        {
            let reason = match e {
                gorgo_cluster::ClusterError::Config { reason, .. } => reason,
                other => other.to_string(),
            };
            return bad("node.region", &reason);
        }
        self.check_engines(names)?;
        if self.cluster.gossip_interval_ms == 0 {
            return bad("cluster.gossip_interval_ms", "must be > 0");
        }
        if self.cluster.peers.contains_key(&self.node.id) {
            return bad("cluster.peers", "must not list this node itself");
        }
        if self.routing.policy == PolicyKind::Oracle {
            // Refused when read; this guards values built in code.
            return bad(
                "routing.policy",
                "policy `oracle` exists only in the simulator",
            );
        }
        if let Some(name) = self.routing.start_weights().out_of_range() {
            return bad(
                &format!("routing.weights.{name}"),
                &format!("must be a number in [0, {}]", gorgo_core::types::MAX_WEIGHT),
            );
        }
        // Chains of forwards beyond this only add latency (and the wire refuses them).
        if self.routing.max_hops > gorgo_core::wire::MAX_HOPS {
            return bad("routing.max_hops", "must be at most 8");
        }
        // Ceilings too: a chain reserves a few bytes per token of a block for every
        // request, so a typo of 10^12 asked for terabytes at the first request.
        if !(1..=MAX_BLOCK_BYTES).contains(&self.routing.block_bytes) {
            return bad(
                "routing.block_bytes",
                &format!("must be in 1..={MAX_BLOCK_BYTES}"),
            );
        }
        if !(1..=64).contains(&self.routing.bytes_per_token) {
            return bad("routing.bytes_per_token", "must be in 1..=64");
        }
        if !(1..=MAX_BLOCK_TOKENS).contains(&self.routing.block_tokens) {
            return bad(
                "routing.block_tokens",
                &format!("must be in 1..={MAX_BLOCK_TOKENS}"),
            );
        }
        // The engine's KV events are re-chained into blocks of this size, which the
        // follower takes up to 4096 tokens (`gorgo_core::kv_events`): checked here, so
        // `--check` says so, not the node after it joined the cluster.
        if self.engines().iter().any(|e| e.kv_events.is_some()) {
            let (field, tokens) = match self.shared_engine().tokenizer {
                Some(_) => ("routing.block_tokens", self.routing.block_tokens),
                None => (
                    "routing.block_bytes",
                    self.routing.block_bytes / gorgo_core::hash::BYTES_PER_TOKEN,
                ),
            };
            if !(1..=4096).contains(&tokens) {
                return bad(
                    field,
                    "must make blocks of 1..=4096 tokens with `kv_events` (block_bytes: 4 bytes a token)",
                );
            }
        }
        if self.routing.decision_log == 0 || self.routing.decision_log > 100_000 {
            return bad("routing.decision_log", "must be in 1..=100000");
        }
        // Windows, bounds, sigmas and starts: the core names the field, by the names
        // `[tuning]` uses.
        self.tuning.es.validate().map_err(|e| match e {
            gorgo_core::CoreError::InvalidConfig { field, reason } => {
                NodeError::invalid(format!("tuning.{field}"), reason)
            }
            other => NodeError::Config(format!("invalid `tuning`: {other}")),
        })?;
        // The leader renews its lease with the proposal it re-announces every gossip
        // interval: a lease shorter than two of them runs out between announcements,
        // and a node whose view holds the leader dead takes the line over each time.
        if self.tuning.es.leader_lease_ms < self.cluster.gossip_interval_ms.saturating_mul(2) {
            return bad(
                "tuning.leader_lease_ms",
                &format!(
                    "must be at least twice cluster.gossip_interval_ms ({} ms): the leader renews it once an interval",
                    self.cluster.gossip_interval_ms
                ),
            );
        }
        // "Never" written as the largest number: capped as the other waits are (0
        // starts a line at the first tick).
        check_timeout("tuning.window_max_ms", self.tuning.es.time_cap_ms)?;
        if self.tuning.es.startup_grace_ms > 0 {
            check_timeout("tuning.startup_grace_ms", self.tuning.es.startup_grace_ms)?;
        }
        // The file is written when tuning freezes, maybe hours in: a directory that is
        // not there, or a path that names a directory, is said now, not then.
        if let Some(out) = &self.tuning.learned_weights_out {
            let names_a_dir = out.file_name().is_none()
                || out
                    .as_os_str()
                    .to_string_lossy()
                    .ends_with(std::path::is_separator)
                || out.is_dir();
            if names_a_dir {
                return bad(
                    "tuning.learned_weights_out",
                    &format!("{}: is a directory; name the file to write", out.display()),
                );
            }
            let dir = out
                .parent()
                .filter(|d| !d.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            if !dir.is_dir() {
                return bad(
                    "tuning.learned_weights_out",
                    &format!("{}: its directory does not exist", out.display()),
                );
            }
        }
        if self.admin.token.len() < 8 {
            return bad("admin.token", "must be at least 8 characters");
        }
        // Two TCP listeners cannot share an address (port 0 asks for any free one).
        // The QUIC port is UDP and may share the number.
        if self.listen.http == self.listen.admin && self.listen.http.port() != 0 {
            return bad("listen.admin", "must differ from listen.http");
        }
        // What an `Authorization` header can carry as it was written: HTTP trims the
        // spaces around a value, and the admin API reads it as visible ASCII.
        if !self.admin.token.bytes().all(|b| b.is_ascii_graphic()) {
            return bad(
                "admin.token",
                "must be visible ASCII characters only (no spaces, no other scripts)",
            );
        }
        if self.limits.max_body_bytes == 0 || self.limits.max_body_bytes > MAX_BODY_CEILING {
            return bad("limits.max_body_bytes", "must be in 1..=268435456");
        }
        if self.limits.max_body_bytes_in_flight
            < self.limits.max_body_bytes + FORWARD_OVERHEAD_BYTES
        {
            return bad(
                "limits.max_body_bytes_in_flight",
                "must be at least limits.max_body_bytes + 1048576 (one largest forwarded request)",
            );
        }
        // Each is a semaphore's permits, which tokio caps (a larger count panics at
        // start); far past what any engine or link serves at once.
        if !(1..=MAX_PERMITS_SETTING).contains(&self.limits.max_concurrency) {
            return bad("limits.max_concurrency", "must be in 1..=16777216");
        }
        if !(1..=MAX_PERMITS_SETTING).contains(&self.limits.max_forwards) {
            return bad("limits.max_forwards", "must be in 1..=16777216");
        }
        if self.limits.max_connections == 0 {
            return bad("limits.max_connections", "must be > 0");
        }
        if self.limits.max_connections_per_ip == 0 {
            return bad("limits.max_connections_per_ip", "must be > 0");
        }
        if !(1024..=16 * 1024 * 1024).contains(&self.limits.max_header_bytes) {
            return bad("limits.max_header_bytes", "must be in 1024..=16777216");
        }
        if let Some(url) = &self.telemetry.otlp_endpoint {
            if let Err(why) = check_otlp_endpoint(url) {
                return bad("telemetry.otlp_endpoint", &why);
            }
        }
        if self.telemetry.service_name.trim().is_empty() {
            return bad("telemetry.service_name", "must not be empty");
        }
        for (name, v) in [
            ("limits.connect_timeout_ms", self.limits.connect_timeout_ms),
            (
                "limits.first_byte_timeout_ms",
                self.limits.first_byte_timeout_ms,
            ),
            ("limits.request_timeout_ms", self.limits.request_timeout_ms),
            ("limits.header_timeout_ms", self.limits.header_timeout_ms),
            ("limits.body_timeout_ms", self.limits.body_timeout_ms),
            ("limits.write_timeout_ms", self.limits.write_timeout_ms),
            ("limits.idle_timeout_ms", self.limits.idle_timeout_ms),
            ("limits.drain_timeout_ms", self.limits.drain_timeout_ms),
        ] {
            check_timeout(name, v)?;
        }
        // Seconds, and 0 is meaningful ("retry at once"); a week at most, as any wait.
        if self.limits.retry_after_s > MAX_TIMEOUT_MS / 1000 {
            return bad(
                "limits.retry_after_s",
                &format!("must be in 0..={} (a week)", MAX_TIMEOUT_MS / 1000),
            );
        }
        Ok(())
    }

    /// The engines this node serves from, in replica order: `[engine]` as a list of
    /// one, or `[[engines]]`. Never empty once validated.
    pub fn engines(&self) -> &[EngineSection] {
        match &self.engine {
            Some(e) => std::slice::from_ref(e),
            None => &self.engines,
        }
    }

    /// The settings every engine of the node shares (tokenizer, chat template:
    /// validation checks they agree): the first engine's.
    pub fn shared_engine(&self) -> &EngineSection {
        &self.engines()[0]
    }

    /// The engine checks, for each engine, errors naming it as `names` says: as the
    /// file does (`engine.url`, or `engines[2].url`), or the engine being added by its
    /// bare field (`url`).
    fn check_engines(&self, names: EngineFieldNames) -> Result<(), NodeError> {
        let bad = |field: &str, reason: &str| Err(NodeError::invalid(field, reason));
        match (&self.engine, self.engines.len()) {
            (Some(_), n) if n > 0 => {
                return bad("engines", "give `[engine]` or `[[engines]]`, not both")
            }
            (None, 0) => {
                return Err(NodeError::Config(
                    "missing field `engine` (or `[[engines]]`)".into(),
                ))
            }
            (None, n) if n > gorgo_core::types::MAX_REPLICAS as usize => {
                return bad("engines", "at most 64 engines per node")
            }
            _ => {}
        }
        let first = self.shared_engine();
        let last = self.engines().len() - 1;
        // Field `name` of engine `i`.
        let field = |i: usize, name: &str| match names {
            EngineFieldNames::LastAdded if i == last => name.to_owned(),
            _ if self.engine.is_some() => format!("engine.{name}"),
            _ => format!("engines[{i}].{name}"),
        };
        for (i, e) in self.engines().iter().enumerate() {
            let f = |name: &str| field(i, name);
            if let Err(reason) = check_engine_url(&e.url) {
                return bad(&f("url"), &reason);
            }
            if let Err(reason) = check_health_path(e.health_path()) {
                return bad(&f("health_path"), &reason);
            }
            check_timeout(&f("health_interval_ms"), e.health_interval_ms)?;
            // 0 turns the scrape off.
            if e.metrics_interval_ms > 0 {
                check_timeout(&f("metrics_interval_ms"), e.metrics_interval_ms)?;
            }
            // The seeds of the engine's fit and view (`EngineAdapter::new`), checked
            // here so that their errors name the engine's field.
            if !(e.t_p_ms > 0.0 && e.t_p_ms <= MAX_SEED_MS_PER_TOKEN) {
                return bad(
                    &f("t_p_ms"),
                    &format!("must be a number in (0, {MAX_SEED_MS_PER_TOKEN}] (ms a token)"),
                );
            }
            if !(e.base_ms >= 0.0 && e.base_ms <= MAX_SEED_BASE_MS) {
                return bad(
                    &f("base_ms"),
                    &format!("must be a number in [0, {MAX_SEED_BASE_MS}] (ms)"),
                );
            }
            if !(e.decode_step_ms >= 0.0 && e.decode_step_ms <= MAX_SEED_MS_PER_TOKEN) {
                return bad(
                    &f("decode_step_ms"),
                    &format!("must be a number in [0, {MAX_SEED_MS_PER_TOKEN}] (ms a step)"),
                );
            }
            // The files themselves are read (and their errors named) when the node starts:
            // `NodeState::new`.
            if e.tokenizer.is_none() {
                if e.chat_template.is_some() {
                    return bad(&f("chat_template"), "needs `tokenizer`");
                }
                if e.chat_add_special_tokens {
                    return bad(&f("chat_add_special_tokens"), "needs `tokenizer`");
                }
            }
            if e.kv_capacity_tokens
                .is_some_and(|c| c == 0 || c > gorgo_core::accounting::MAX_KV_CAPACITY_TOKENS)
            {
                return bad(&f("kv_capacity_tokens"), "must be in 1..=4294967296");
            }
            if e.max_running_requests == Some(0) {
                return bad(&f("max_running_requests"), "must be > 0");
            }
            if let Some(endpoint) = &e.kv_events {
                if !is_tcp_endpoint(endpoint) {
                    return bad(&f("kv_events"), "must be tcp://host:port");
                }
                if is_bind_endpoint(endpoint) {
                    return bad(&f("kv_events"), BIND_ENDPOINT);
                }
                if e.tokenizer.is_none() && !self.routing.block_bytes.is_multiple_of(4) {
                    // Without a tokenizer the node's blocks are bytes, and engine tokens
                    // are matched as 4-byte chunks (docs/kv-events.md).
                    return bad(
                        "routing.block_bytes",
                        "must be a multiple of 4 with `kv_events` and no `tokenizer`",
                    );
                }
            }
            match &e.kv_events_replay {
                Some(_) if e.kv_events.is_none() => {
                    return bad(&f("kv_events_replay"), "needs `kv_events`");
                }
                Some(endpoint) if !is_tcp_endpoint(endpoint) => {
                    return bad(&f("kv_events_replay"), "must be tcp://host:port");
                }
                Some(endpoint) if is_bind_endpoint(endpoint) => {
                    return bad(&f("kv_events_replay"), BIND_ENDPOINT);
                }
                _ => {}
            }
            // 0 follows a stream at once.
            if e.kv_events_warmup_ms > 0 {
                check_timeout(&f("kv_events_warmup_ms"), e.kv_events_warmup_ms)?;
            }
            if !(1..=KV_EVENTS_MAX_BLOCKS_CEILING).contains(&e.kv_events_max_blocks) {
                return bad(&f("kv_events_max_blocks"), "must be in 1..=16777216");
            }
            if !(1..=KV_EVENTS_MAX_MESSAGE_CEILING).contains(&e.kv_events_max_message_bytes) {
                return bad(
                    &f("kv_events_max_message_bytes"),
                    "must be in 1..=268435456",
                );
            }
            if e.breaker_failures == 0 {
                return bad(&f("breaker_failures"), "must be > 0");
            }
            if e.max_context_tokens == Some(0) {
                return bad(&f("max_context_tokens"), "must be > 0");
            }
            for (name, v) in [
                ("health_timeout_ms", e.health_timeout_ms),
                ("breaker_cooldown_ms", e.breaker_cooldown_ms),
                ("kv_events_silence_ms", e.kv_events_silence_ms),
            ] {
                check_timeout(&f(name), v)?;
            }
            if !(e.weight.is_finite() && e.weight >= 0.0) {
                return bad(&f("weight"), "must be a finite number >= 0");
            }
            if i > 0 {
                // One hash chain and one token count per request: every engine must
                // count prompts the same way, or their prefix indexes disagree.
                if e.tokenizer != first.tokenizer {
                    return bad(&f("tokenizer"), "must be the same for every engine");
                }
                if e.chat_template != first.chat_template {
                    return bad(&f("chat_template"), "must be the same for every engine");
                }
                if e.chat_add_special_tokens != first.chat_add_special_tokens {
                    return bad(
                        &f("chat_add_special_tokens"),
                        "must be the same for every engine",
                    );
                }
                // The one tokenizer counts chat prompts by the first engine's kind's
                // rules (`PromptTokens::new`); an engine whose kind builds them another
                // way would have every chat request counted and hashed wrongly.
                if first.tokenizer.is_some()
                    && !gorgo_tokenizer::EngineTokenizer::same_chat_rules(first.kind, e.kind)
                {
                    return bad(
                        &f("kind"),
                        &format!(
                            "`{}` builds chat prompts by other rules than `{}` (`{}`), and the \
                             node counts every engine's prompts with its one `tokenizer`: give \
                             engines that share a tokenizer one kind (`openai` counts as `vllm`)",
                            e.kind,
                            field(0, "kind"),
                            first.kind
                        ),
                    );
                }
            }
        }
        // One publisher is one engine's: two engines given the same KV-event endpoint
        // would each take the other's blocks for its own, and one engine's publisher
        // and replay socket cannot be one socket. The error names the second of the
        // two fields, as the file (or the request's body) has it.
        let mut endpoints = std::collections::HashMap::new();
        for (i, e) in self.engines().iter().enumerate() {
            for (name, endpoint) in [
                ("kv_events", &e.kv_events),
                ("kv_events_replay", &e.kv_events_replay),
            ] {
                let Some(endpoint) = endpoint else { continue };
                let Some((j, other)) = endpoints.insert(endpoint.as_str(), (i, name)) else {
                    continue;
                };
                let reason = if j == i {
                    format!("{endpoint} is also this engine's `{other}`")
                } else if names == EngineFieldNames::LastAdded && i == last {
                    format!("another engine of the node has {endpoint}")
                } else {
                    format!("{endpoint} is also `{}`", field(j, other))
                };
                return bad(&field(i, name), &reason);
            }
        }
        // One engine spelled two ways is one engine. The error names the second entry,
        // as the file (or the request's body) has it, and the first.
        let mut urls = std::collections::HashMap::new();
        for (i, e) in self.engines().iter().enumerate() {
            let Some(j) = urls.insert(normalize_engine_url(&e.url), i) else {
                continue;
            };
            let reason = if names == EngineFieldNames::LastAdded && i == last {
                format!("the node already fronts {}", e.url)
            } else {
                format!("the same engine as `{}` ({})", field(j, "url"), e.url)
            };
            return bad(&field(i, "url"), &reason);
        }
        Ok(())
    }

    /// The tables of `other` that differ from this config's, the engine list aside:
    /// what a reload, which applies only the engines, leaves as it runs (named in its
    /// log, so that an edit it did not apply does not pass for applied).
    pub fn changed_besides_engines(&self, other: &NodeConfig) -> Vec<&'static str> {
        let changed = [
            ("node", self.node != other.node),
            ("listen", self.listen != other.listen),
            ("cluster", self.cluster != other.cluster),
            ("tls", self.tls != other.tls),
            ("routing", self.routing != other.routing),
            ("tuning", self.tuning != other.tuning),
            ("admin", self.admin != other.admin),
            ("limits", self.limits != other.limits),
            ("telemetry", self.telemetry != other.telemetry),
        ];
        changed
            .into_iter()
            .filter(|(_, c)| *c)
            .map(|(name, _)| name)
            .collect()
    }

    /// The address peers should dial to reach this node.
    pub fn advertised_quic(&self) -> SocketAddr {
        self.listen.advertise_quic.unwrap_or(self.listen.quic)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) const MINIMAL: &str = r#"
[node]
id = "a"
region = "us-ashburn"

[listen]
http = "127.0.0.1:8000"
quic = "127.0.0.1:9000"
admin = "127.0.0.1:8100"

[engine]
url = "http://127.0.0.1:30000"
kind = "sglang"

[tls]
ca = "ca.pem"
cert = "a.pem"
key = "a.key"

[admin]
token = "secret-token"
"#;

    /// A response that is not streamed sends its head only when the whole answer is
    /// generated: its head waits for the request timeout, a streamed one's for the
    /// first-byte timeout (never less, whatever the request timeout says).
    #[test]
    fn a_head_that_comes_with_the_whole_answer_waits_for_the_request_timeout() {
        let limits = LimitsSection {
            first_byte_timeout_ms: 300,
            request_timeout_ms: 60_000,
            ..LimitsSection::default()
        };
        let ms = |d: std::time::Duration| d.as_millis();
        assert_eq!(ms(limits.head_timeout(true)), 300);
        assert_eq!(ms(limits.head_timeout(false)), 60_000);
        let short = LimitsSection {
            request_timeout_ms: 100,
            ..limits
        };
        assert_eq!(ms(short.head_timeout(false)), 300);
    }

    /// Every spelling of one engine normalises to one URL; other engines stay apart.
    /// A path prefix (a gateway routing by path) is kept as written, percent-encoding
    /// included, less a trailing `/`.
    #[test]
    fn engine_urls_normalise_to_one_spelling() {
        for (url, want) in [
            ("http://127.0.0.1:30000", "http://127.0.0.1:30000"),
            ("http://gw:8080/llama", "http://gw:8080/llama"),
            ("http://GW:8080/llama/", "http://gw:8080/llama"),
            ("http://gw:80/Llama/a-b_c~d.e", "http://gw/Llama/a-b_c~d.e"),
            (
                "http://gw/serving-endpoints/x/",
                "http://gw/serving-endpoints/x",
            ),
            ("http://gw/a%2Fb/m:1@v;p=1", "http://gw/a%2Fb/m:1@v;p=1"),
            ("http://gw/v1beta/v2", "http://gw/v1beta/v2"),
            ("http://gw/...", "http://gw/..."),
            ("http://127.0.0.1:30000/", "http://127.0.0.1:30000"),
            (
                "HTTP://Engine.Example:30000/",
                "http://engine.example:30000",
            ),
            ("http://engine:80/", "http://engine"),
            ("http://[::1]:8000/", "http://[::1]:8000"),
            // The WHATWG forms of an IPv4 address, as the HTTP client reads them.
            ("http://2130706502:47503", "http://127.0.0.70:47503"),
            ("http://127.70:47503", "http://127.0.0.70:47503"),
            ("http://0x7f.0.0.70:47503/", "http://127.0.0.70:47503"),
        ] {
            assert_eq!(check_engine_url(url), Ok(()), "{url}");
            assert_eq!(normalize_engine_url(url), want, "{url}");
        }
    }

    /// The duplicate check of the file compares normalised URLs, and names both entries
    /// (`engines[1].url` and the first), as docs/node.md promises.
    #[test]
    fn one_engine_spelled_two_ways_in_the_file_is_refused() {
        for (a, b) in [
            ("http://127.0.0.1:1", "http://127.0.0.1:1/"),
            ("http://localhost:1", "HTTP://LOCALHOST:1"),
            ("http://engine", "http://Engine:80/"),
            ("http://127.0.0.1", "http://127.0.0.1:80"),
            ("http://127.0.0.70:47503", "http://2130706502:47503"),
            ("http://gw:1/llama", "http://GW:1/llama/"),
            ("http://gw/a%2Fb", "http://gw:80/a%2Fb/"),
        ] {
            let e = NodeConfig::from_toml_str(&with_engines(&["http://127.0.0.1:9", a, b], ""))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("invalid `engines[2].url`") && e.contains("`engines[1].url`"),
                "{a} {b}: {e}"
            );
        }
    }

    /// Engines behind one gateway that differ only in their path prefix are as many
    /// engines (`location /llama/` and `location /qwen/` of one nginx); a prefix is
    /// case-sensitive, as paths are.
    #[test]
    fn engines_that_differ_only_in_their_path_prefix_are_distinct() {
        let urls = [
            "http://gw:8080",
            "http://gw:8080/llama",
            "http://gw:8080/llama/b",
            "http://gw:8080/Llama",
            "http://gw:8080/qwen/",
        ];
        let c = NodeConfig::from_toml_str(&with_engines(&urls, "")).unwrap();
        assert_eq!(c.engines().len(), urls.len());
        let sent: std::collections::HashSet<_> =
            urls.iter().map(|u| normalize_engine_url(u)).collect();
        assert_eq!(sent.len(), urls.len(), "{sent:?}");
    }

    /// The one tokenizer counts chat prompts by the first engine's kind's rules: an
    /// engine sharing it whose kind builds them otherwise (`sglang` beside `vllm`) is
    /// refused naming its `kind`, in the file and when `POST /admin/engines` adds it;
    /// `openai` counts as `vllm`, and without a tokenizer kinds may mix.
    #[test]
    fn engines_sharing_a_tokenizer_whose_kinds_count_chats_otherwise_are_refused() {
        let mixed = |kinds: &[&str], tokenizer: bool| {
            let list: String = kinds
                .iter()
                .enumerate()
                .map(|(i, kind)| {
                    let tok = if tokenizer {
                        "tokenizer = \"tok/tokenizer.json\"\n"
                    } else {
                        ""
                    };
                    format!(
                        "[[engines]]\nurl = \"http://127.0.0.1:{}\"\nkind = \"{kind}\"\n{tok}\n",
                        i + 1
                    )
                })
                .collect();
            MINIMAL.replace(
                "[engine]\nurl = \"http://127.0.0.1:30000\"\nkind = \"sglang\"\n",
                &list,
            )
        };
        for kinds in [["sglang", "vllm"], ["vllm", "sglang"], ["openai", "sglang"]] {
            let e = NodeConfig::from_toml_str(&mixed(&kinds, true))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("invalid `engines[1].kind`")
                    && e.contains(&format!("`{}` builds chat prompts", kinds[1]))
                    && e.contains(&format!("`engines[0].kind` (`{}`)", kinds[0]))
                    && e.contains("`tokenizer`"),
                "{kinds:?}: {e}"
            );
            // The same validation as `POST /admin/engines`: the added engine's field bare.
            let mut added = NodeConfig::from_toml_str(&mixed(&kinds[..1], true))
                .unwrap()
                .into_inner();
            added.engines.push(
                toml::from_str(&format!(
                "url = \"http://127.0.0.1:9\"\nkind = \"{}\"\ntokenizer = \"tok/tokenizer.json\"",
                kinds[1]
            ))
                .unwrap(),
            );
            let e = added.validate_added_engine().unwrap_err().to_string();
            assert!(e.contains("invalid `kind`"), "{kinds:?}: {e}");
        }
        for kinds in [
            &["vllm", "openai"][..],
            &["openai", "vllm", "openai"],
            &["sglang", "sglang"],
        ] {
            NodeConfig::from_toml_str(&mixed(kinds, true)).unwrap();
        }
        NodeConfig::from_toml_str(&mixed(&["sglang", "vllm", "openai"], false)).unwrap();
    }

    /// An engine URL is `http://host:port`, a path prefix and at most a trailing `/`:
    /// user info, a query or a fragment (even empty), and a path the HTTP client would
    /// send otherwise than written are refused, naming the field. The HTTP client sent
    /// `/x?y=1/v1/chat/completions` for `http://h:p/x?y=1`, and `http://x@h:p`,
    /// `http://h:p/.` or `http://h:p/?` slipped past the duplicate check as a second
    /// engine.
    #[test]
    fn an_engine_url_with_more_than_host_port_and_prefix_is_refused_naming_the_field() {
        for (url, why) in [
            ("http://x@127.0.0.70:47503", "user info"),
            ("http://x:pw@127.0.0.70:47503/", "user info"),
            ("http://127.0.0.70:47503/.", "`.` or `..` segment"),
            ("http://127.0.0.70:47503/a/..", "`.` or `..` segment"),
            ("http://127.0.0.70:47503/a/%2E%2e/b", "`.` or `..` segment"),
            ("http://127.0.0.70:47503/./a", "`.` or `..` segment"),
            ("http://127.0.0.70:47503//", "empty segment"),
            ("http://127.0.0.70:47503/a//b", "empty segment"),
            ("http://127.0.0.70:47503/a//", "empty segment"),
            ("http://127.0.0.70:47503/v1", "ends in `/v1`"),
            ("http://127.0.0.70:47503/llama/v1/", "ends in `/v1`"),
            ("http://127.0.0.70:47503\\x", "is read as `/`"),
            ("http://127.0.0.70:47503/a\\b", "is read as `/`"),
            (
                "http://127.0.0.70:47503/a{b}",
                "`{` must be percent-encoded",
            ),
            (
                "http://127.0.0.70:47503/a\"b",
                "`\"` must be percent-encoded",
            ),
            ("http://127.0.0.70:47503/a%zz", "two-hex-digit escape"),
            ("http://127.0.0.70:47503/a%4", "two-hex-digit escape"),
            ("http://127.0.0.70:47503/?", "query"),
            ("http://127.0.0.70:47503?", "query"),
            ("http://127.0.0.70:47503/x?y=1", "query"),
            ("http://127.0.0.70:47503/x#y", "fragment"),
            ("http://127.0.0.70:47503/x/\u{e9}", "visible ASCII"),
            ("http://127.0.0.70:47503?y=1", "query"),
            ("http://127.0.0.70:47503/#", "fragment"),
            ("http://127.0.0.70:47503#frag", "fragment"),
            ("http://127.0.0.70:47503/\t", "visible ASCII"),
            ("http://127.0.0.70 :1", "visible ASCII"),
            ("http://127.0.0.1:", "port"),
            ("http://127.0.0.1:+1", "port"),
            ("http://:5", "not a valid URL"),
        ] {
            let reason = check_engine_url(url).unwrap_err();
            assert!(reason.contains(why), "{url}: {reason}");
            let text = MINIMAL.replace(
                "\"http://127.0.0.1:30000\"",
                &toml::Value::from(url).to_string(),
            );
            let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
            assert!(e.contains("invalid `engine.url`"), "{url}: {e}");
            let text = with_engines(&["http://127.0.0.1:1", "http://127.0.0.1:2"], "").replace(
                "\"http://127.0.0.1:2\"",
                &toml::Value::from(url).to_string(),
            );
            if let Err(e) = NodeConfig::from_toml_str(&text) {
                assert!(e.to_string().contains("`engines[1].url`"), "{url}: {e}");
            } else {
                panic!("{url} taken in [[engines]]");
            }
        }
    }

    /// `health_path` is a path: `/`, then visible ASCII without `?`, `#` or `\`. One
    /// with a line break was polled as another path (the URL parser dropped it).
    #[test]
    fn a_health_path_that_is_no_path_is_refused_naming_the_field() {
        for path in [
            "/x\r\nEvil: 1",
            "/health check",
            "/x\u{7f}",
            "/h?x=1",
            "/h#x",
            "/h\\x",
            "health",
            "/héalth",
        ] {
            let extra = format!("health_path = {}", toml::Value::from(path));
            let e = NodeConfig::from_toml_str(&with_engine_lines(&extra))
                .unwrap_err()
                .to_string();
            assert!(e.contains("invalid `engine.health_path`"), "{path:?}: {e}");
            let text = with_engines(&["http://127.0.0.1:1", "http://127.0.0.1:2"], &extra);
            let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
            assert!(e.contains("`engines[1].health_path`"), "{path:?}: {e}");
        }
        for path in ["/health", "/health_generate", "/", "/v1/models", "/a%20b"] {
            let extra = format!("health_path = {}", toml::Value::from(path));
            NodeConfig::from_toml_str(&with_engine_lines(&extra))
                .unwrap_or_else(|e| panic!("{path}: {e}"));
        }
    }

    /// A duplicate key or table names it and its line (toml says "duplicate key"
    /// alone), and an integer past TOML's range names its field.
    #[test]
    fn a_duplicate_key_or_an_integer_out_of_range_is_named() {
        let line_of = |text: &str, needle: &str| {
            1 + text
                .lines()
                .enumerate()
                .filter(|(_, l)| l.contains(needle))
                .map(|(i, _)| i)
                .last()
                .unwrap()
        };
        let text = with_engine_lines("url = \"http://127.0.0.1:2\"");
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        let line = line_of(&text, "url =");
        assert!(
            e.contains(&format!("line {line}: duplicate key `engine.url`")),
            "{e}"
        );
        let text = format!("{MINIMAL}\n[limits]\nmax_hops = 1\n[limits]\nmax_body_bytes = 1\n");
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        let line = line_of(&text, "[limits]");
        assert!(
            e.contains(&format!("line {line}: duplicate table `[limits]`")),
            "{e}"
        );
        let text = with_engines(
            &["http://127.0.0.1:1", "http://127.0.0.1:2"],
            "kind = \"vllm\"",
        );
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(e.contains("duplicate key `engines[1].kind`"), "{e}");
        let text = format!("{MINIMAL}\n[limits]\nfirst_byte_timeout_ms = 18446744073709551615\n");
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        let line = line_of(&text, "first_byte_timeout_ms");
        assert!(
            e.contains(&format!(
                "line {line}: invalid `limits.first_byte_timeout_ms`"
            )),
            "{e}"
        );
    }

    #[test]
    fn minimal_config_loads_with_defaults() {
        let c = NodeConfig::from_toml_str(MINIMAL).unwrap();
        assert_eq!(c.node.id, "a");
        assert_eq!(c.routing.max_hops, 1);
        assert_eq!(c.routing.policy, PolicyKind::Gorgo);
        assert_eq!(c.shared_engine().kind, EngineKind::Sglang);
        assert_eq!(c.tuning.es.mode, TuningMode::Static);
    }

    /// A timeout written as "no limit" (the largest TOML integer) is refused, naming the
    /// field: taken, `Instant + Duration` overflowed, a panic per request.
    #[test]
    fn a_timeout_beyond_a_week_is_refused() {
        let text = format!("{MINIMAL}\n[limits]\nrequest_timeout_ms = 9223372036854775807\n");
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(e.contains("limits.request_timeout_ms"), "{e}");
        let text = format!("{MINIMAL}\n[limits]\nrequest_timeout_ms = {MAX_TIMEOUT_MS}\n");
        assert!(NodeConfig::from_toml_str(&text).is_ok());
    }

    /// MINIMAL with `[[engines]]` of `urls` in place of `[engine]`, `extra` lines in
    /// the second entry.
    fn with_engines(urls: &[&str], extra: &str) -> String {
        let list: String = urls
            .iter()
            .enumerate()
            .map(|(i, u)| {
                let more = if i == 1 { extra } else { "" };
                format!("[[engines]]\nurl = \"{u}\"\nkind = \"sglang\"\n{more}\n")
            })
            .collect();
        MINIMAL.replace(
            "[engine]\nurl = \"http://127.0.0.1:30000\"\nkind = \"sglang\"\n",
            &list,
        )
    }

    #[test]
    fn engines_list_loads_in_replica_order_and_errors_name_the_entry() {
        let c = NodeConfig::from_toml_str(&with_engines(
            &["http://127.0.0.1:30000", "http://127.0.0.1:30001"],
            "weight = 2.0",
        ))
        .unwrap();
        assert!(c.engine.is_none());
        assert_eq!(c.engines().len(), 2);
        assert_eq!(c.engines()[1].url, "http://127.0.0.1:30001");
        assert_eq!(c.engines()[1].weight, 2.0);
        assert_eq!(c.engines()[0].weight, 1.0);
        // What `gorgo up` writes reads back the same.
        let back = NodeConfig::from_toml_str(&c.to_toml_string().unwrap()).unwrap();
        assert_eq!(back, c);
        for (extra, field) in [
            ("health_interval_ms = 0", "engines[1].health_interval_ms"),
            // "No limit" written as the largest number: refused, not a panic per
            // request when a deadline overflows.
            (
                "health_timeout_ms = 9223372036854775807",
                "engines[1].health_timeout_ms",
            ),
            ("weight = -1.0", "engines[1].weight"),
            ("kv_capacity_tokens = 0", "engines[1].kv_capacity_tokens"),
            (
                "max_running_requests = 0",
                "engines[1].max_running_requests",
            ),
            ("urll = \"x\"", "urll"),
            ("tokenizer = \"t.json\"", "engines[1].tokenizer"),
        ] {
            let text = with_engines(&["http://127.0.0.1:30000", "http://127.0.0.1:30001"], extra);
            let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
            assert!(e.contains(field), "{extra}: {e}");
        }
        let e = NodeConfig::from_toml_str(&with_engines(&["ftp://x", "http://127.0.0.1:1"], ""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("engines[0].url"), "{e}");
        let e = NodeConfig::from_toml_str(&with_engines(
            &["http://127.0.0.1:1", "http://127.0.0.1:1"],
            "",
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("`engines[1].url`") && e.contains("the same engine as `engines[0].url`"),
            "{e}"
        );
        // Both forms, or neither.
        let both =
            format!("{MINIMAL}\n[[engines]]\nurl = \"http://127.0.0.1:2\"\nkind = \"sglang\"\n");
        let e = NodeConfig::from_toml_str(&both).unwrap_err().to_string();
        assert!(e.contains("not both"), "{e}");
        let e = NodeConfig::from_toml_str(&with_engines(&[], ""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("engine"), "{e}");
    }

    /// Values that parse but would break the node later (a panic at start, a token no
    /// request can carry, an index without bound, a second listener on one address,
    /// KV-event blocks the follower refuses) are refused up front, naming the field.
    #[test]
    fn values_the_node_could_not_run_with_are_refused_naming_the_field() {
        let engine = "[engine]\nurl = \"http://127.0.0.1:30000\"\nkind = \"sglang\"\n";
        let cases = [
            (
                MINIMAL.replace("token = \"secret-token\"", "token = \"contraseña-secreta\""),
                "admin.token",
            ),
            (
                MINIMAL.replace("token = \"secret-token\"", "token = \" secret-token\""),
                "admin.token",
            ),
            (
                format!("{MINIMAL}\n[limits]\nmax_concurrency = 9223372036854775807\n"),
                "limits.max_concurrency",
            ),
            (
                format!("{MINIMAL}\n[limits]\nmax_forwards = 9223372036854775807\n"),
                "limits.max_forwards",
            ),
            (
                MINIMAL.replace(
                    engine,
                    &format!("{engine}kv_capacity_tokens = 1000000000000000\n"),
                ),
                "engine.kv_capacity_tokens",
            ),
            (
                MINIMAL.replace("admin = \"127.0.0.1:8100\"", "admin = \"127.0.0.1:8000\""),
                "listen.admin",
            ),
            (
                format!(
                    "{}\n[routing]\nblock_bytes = 65536\n",
                    MINIMAL.replace(
                        engine,
                        &format!("{engine}kv_events = \"tcp://127.0.0.1:5557\"\n")
                    )
                ),
                "routing.block_bytes",
            ),
        ];
        let kv = |endpoint: &str| {
            MINIMAL.replace(
                engine,
                &format!("{engine}kv_events = \"{endpoint}\"\ntokenizer = \"t.json\"\n"),
            )
        };
        let more = [
            // A block size typo asked for terabytes at the first request.
            (
                format!("{MINIMAL}\n[routing]\nblock_tokens = 1000000000000\n"),
                "routing.block_tokens",
            ),
            (
                format!("{MINIMAL}\n[routing]\nblock_bytes = 1000000000000\n"),
                "routing.block_bytes",
            ),
            // vLLM's bind form, copied from the engine's side.
            (kv("tcp://*:5557"), "engine.kv_events"),
            (kv("tcp://0.0.0.0:5557"), "engine.kv_events"),
            (
                format!(
                    "{MINIMAL}\n[tuning]\nw_rtt = {{ start = 150.0, min = 1.0, max = 200.0 }}\n"
                ),
                "tuning.w_rtt",
            ),
        ];
        for (text, field) in cases.into_iter().chain(more) {
            let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
            assert!(e.contains(&format!("`{field}`")), "{field}: {e}");
        }
        // Unknown keys of the weights are refused, not dropped.
        let text = format!(
            "{MINIMAL}\n[routing]\nweights = {{ w_rtt = 1.0, w_queue = 1.0, w_prefill = 2.0 }}\n"
        );
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(e.contains("w_prefill"), "{e}");
        // The largest accepted values load.
        let ok = format!("{MINIMAL}\n[limits]\nmax_concurrency = 16777216\n");
        NodeConfig::from_toml_str(&ok).unwrap();
    }

    #[test]
    fn typo_is_an_error_naming_the_field() {
        let text = MINIMAL.replace("kind = \"sglang\"", "kind = \"sglang\"\nurll = \"x\"");
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(e.contains("urll"), "{e}");
    }

    #[test]
    fn missing_field_is_an_error_naming_it() {
        let text = MINIMAL.replace("region = \"us-ashburn\"\n", "");
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(e.contains("region"), "{e}");
    }

    #[test]
    fn bad_engine_kind_is_rejected() {
        let text = MINIMAL.replace("kind = \"sglang\"", "kind = \"tgi\"");
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(e.contains("tgi"), "{e}");
    }

    #[test]
    fn unset_weights_are_the_policys_own() {
        let paper = format!("{MINIMAL}\n[routing]\npolicy = \"gorgo-paper\"\n");
        let c = NodeConfig::from_toml_str(&paper).unwrap();
        assert_eq!(
            c.routing.start_weights(),
            PolicyKind::GorgoPaper.default_weights()
        );
        assert_eq!(c.routing.start_weights().w_rtt, 0.276);
        let c = NodeConfig::from_toml_str(MINIMAL).unwrap();
        assert_eq!(c.routing.start_weights(), Weights::default());
        let set = format!("{paper}weights = {{ w_rtt = 2.0, w_queue = 3.0 }}\n");
        let c = NodeConfig::from_toml_str(&set).unwrap();
        assert_eq!(c.routing.start_weights().w_queue, 3.0);
    }

    #[test]
    fn out_of_range_value_names_the_field() {
        let text = format!("{MINIMAL}\n[limits]\nmax_body_bytes = 0\n");
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(e.contains("limits.max_body_bytes"), "{e}");
        let text = format!("{MINIMAL}\n[limits]\nwrite_timeout_ms = 0\n");
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(e.contains("limits.write_timeout_ms"), "{e}");
        // The budget of bodies being read must hold one largest forwarded request.
        let text = format!(
            "{MINIMAL}\n[limits]\nmax_body_bytes = 65536\nmax_body_bytes_in_flight = 1000000\n"
        );
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(e.contains("limits.max_body_bytes_in_flight"), "{e}");
        let text = format!(
            "{MINIMAL}\n[limits]\nmax_body_bytes = 65536\nmax_body_bytes_in_flight = 1114112\n"
        );
        NodeConfig::from_toml_str(&text).unwrap();
        // Weights as the admin API takes them: [0, 100] (the config took any finite
        // weight, which `PUT /admin/weights` then refused to put back).
        for (w, field) in [("-1.0", "w_rtt"), ("150.0", "w_rtt"), ("nan", "w_rtt")] {
            let text =
                format!("{MINIMAL}\n[routing]\nweights = {{ w_rtt = {w}, w_queue = 1.0 }}\n");
            let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
            assert!(e.contains(&format!("routing.weights.{field}")), "{e}");
        }
        let text = format!("{MINIMAL}\n[routing]\nweights = {{ w_rtt = 100.0, w_queue = 0 }}\n");
        NodeConfig::from_toml_str(&text).unwrap();
        for policy in ["nope", "oracle"] {
            let text = format!("{MINIMAL}\n[routing]\npolicy = \"{policy}\"\n");
            let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
            assert!(e.contains("routing.policy") && e.contains(policy), "{e}");
        }
    }

    /// A node id that cannot be a certificate's name, and a QUIC address no peer can
    /// dial, are refused when the config is read (`gorgo node --check`), naming the
    /// key, instead of at cluster start or, for the address, never.
    #[test]
    fn an_id_no_certificate_can_carry_or_an_address_no_peer_can_dial_is_refused() {
        let text = MINIMAL.replace("id = \"a\"", "id = \"US_East\"");
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(e.contains("`node.id`") && e.contains("US_East"), "{e}");
        let text = MINIMAL.replace("127.0.0.1:9000", "0.0.0.0:9000");
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(
            e.contains("listen.advertise_quic") && e.contains("0.0.0.0:9000"),
            "{e}"
        );
        let text = text.replace(
            "admin = \"127.0.0.1:8100\"",
            "admin = \"127.0.0.1:8100\"\nadvertise_quic = \"10.0.0.7:9000\"",
        );
        NodeConfig::from_toml_str(&text).unwrap();
    }

    #[test]
    fn summary_sample_is_auto_or_a_power_of_two() {
        use gorgo_core::summary::SummarySample;
        let c = NodeConfig::from_toml_str(MINIMAL).unwrap();
        assert_eq!(c.cluster.summary_sample, SampleSetting::Auto);
        for (value, want) in [
            ("\"auto\"", SampleSetting::Auto),
            (
                "4",
                SampleSetting::Fixed(SummarySample::from_rate(4).unwrap()),
            ),
            (
                "\"64\"",
                SampleSetting::Fixed(SummarySample::from_rate(64).unwrap()),
            ),
            ("1", SampleSetting::Fixed(SummarySample::EVERY_BLOCK)),
        ] {
            let text = format!("{MINIMAL}\n[cluster]\nsummary_sample = {value}\n");
            let c = NodeConfig::from_toml_str(&text).unwrap();
            assert_eq!(c.cluster.summary_sample, want, "{value}");
            // What `gorgo up` writes reads back the same.
            let back = NodeConfig::from_toml_str(&c.to_toml_string().unwrap()).unwrap();
            assert_eq!(back.cluster.summary_sample, want, "{value}");
        }
        for value in ["3", "0", "128", "-4", "\"often\"", "true"] {
            let text = format!("{MINIMAL}\n[cluster]\nsummary_sample = {value}\n");
            let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
            assert!(e.contains("summary_sample"), "{value}: {e}");
        }
    }

    #[test]
    fn tokenizer_settings_need_a_tokenizer() {
        for (extra, field) in [
            ("chat_template = \"t.jinja\"", "engine.chat_template"),
            (
                "chat_add_special_tokens = true",
                "engine.chat_add_special_tokens",
            ),
        ] {
            let text = MINIMAL.replace("kind = \"sglang\"", &format!("kind = \"sglang\"\n{extra}"));
            let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
        let text = MINIMAL.replace(
            "kind = \"sglang\"",
            "kind = \"sglang\"\ntokenizer = \"tok/tokenizer.json\"\nchat_template = \"t.jinja\"",
        );
        let c = NodeConfig::from_toml_str(&text).unwrap();
        assert_eq!(c.routing.block_tokens, 64);
        let text = format!("{MINIMAL}\n[routing]\nblock_tokens = 0\n");
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(e.contains("routing.block_tokens"), "{e}");
    }

    #[test]
    fn per_peer_dial_addresses_parse() {
        let text = format!(
            "{MINIMAL}\n[cluster]\nseeds = [\"127.0.0.2:9000\"]\n[cluster.peers]\nb = \"127.0.0.9:7001\"\n"
        );
        let c = NodeConfig::from_toml_str(&text).unwrap();
        assert_eq!(c.cluster.peers["b"], "127.0.0.9:7001".parse().unwrap());
        assert_eq!(c.cluster.seeds.len(), 1);
    }

    #[test]
    fn dial_overrides_parse_by_address() {
        let text = format!(
            "{MINIMAL}\n[cluster]\nseeds = [\"127.0.0.12:9000\"]\n[cluster.dial_overrides]\n\"127.0.0.12:9000\" = \"127.0.1.1:9000\"\n"
        );
        let c = NodeConfig::from_toml_str(&text).unwrap();
        assert_eq!(
            c.cluster.dial_overrides[&"127.0.0.12:9000".parse().unwrap()],
            "127.0.1.1:9000".parse().unwrap()
        );
        let text = format!("{MINIMAL}\n[cluster.dial_overrides]\nfrankfurt = \"127.0.1.1:9000\"\n");
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(e.contains("address"), "{e}");
    }

    #[test]
    fn tuning_config_defaults_follow_the_policy() {
        let c = NodeConfig::from_toml_str(MINIMAL).unwrap();
        let t = c.tuning.core_config(None);
        assert_eq!(t.mode, TuningMode::Static);
        assert_eq!((t.w_rtt.start, t.w_rtt.max), (1.0, 4.0));
        let text = format!(
            "{MINIMAL}\n[routing]\npolicy = \"gorgo-paper\"\n[tuning]\nmode = \"online\"\n"
        );
        let c = NodeConfig::from_toml_str(&text).unwrap();
        let t = c.tuning.core_config(None);
        assert_eq!(t.mode, TuningMode::Online);
        assert_eq!((t.window, t.min_samples), (128, 32));
        assert_eq!((t.w_rtt.start, t.w_rtt.min, t.w_rtt.max), (0.5, 0.05, 2.0));
        assert_eq!((t.w_queue.start, t.w_queue.max), (0.1, 0.5));
        // A key that is set wins over the policy's default.
        let text = format!(
            "{MINIMAL}\n[routing]\npolicy = \"gorgo-paper\"\n[tuning]\nw_queue = {{ start = 0.2, min = 0.1, max = 0.3 }}\n"
        );
        let c = NodeConfig::from_toml_str(&text).unwrap();
        assert_eq!(c.tuning.es.w_queue.max, 0.3);
        assert_eq!(c.tuning.es.w_rtt.max, 2.0);
        // A learned start is clipped into the bounds.
        let learned = Weights {
            w_rtt: 0.276,
            w_queue: 9.0,
        };
        let t = c.tuning.core_config(Some(learned));
        assert_eq!((t.w_rtt.start, t.w_queue.start), (0.276, 0.3));
    }

    #[test]
    fn a_config_round_trips_through_toml() {
        let text = format!(
            "{MINIMAL}\n[routing]\npolicy = \"gorgo-paper\"\n[tuning]\nmode = \"tune-then-freeze\"\nwindow_requests = 16\nmin_samples = 8\nlearned_weights_out = \"w.json\"\n[cluster]\nseeds = [\"127.0.0.12:9000\"]\n[cluster.dial_overrides]\n\"127.0.0.12:9000\" = \"127.0.1.1:9000\"\n"
        );
        let c = NodeConfig::from_toml_str(&text).unwrap();
        let written = c.to_toml_string().unwrap();
        let back = NodeConfig::from_toml_str(&written).unwrap_or_else(|e| panic!("{e}\n{written}"));
        assert_eq!(back, c, "{written}");
        assert!(written.contains("window_requests = 16"), "{written}");
        assert!(written.contains("policy = \"gorgo-paper\""), "{written}");
    }

    #[test]
    fn syntax_errors_give_the_line() {
        let text = format!("{MINIMAL}\n[limits]\nmax_body_bytes = = 3\n");
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        let line = text.lines().position(|l| l.contains("= =")).unwrap() + 1;
        assert!(e.contains(&format!("line {line}")), "{e}");
    }

    /// A leader lease that can run out between two of the leader's announcements (one
    /// a gossip interval) is refused, naming it; the default fits the default interval.
    #[test]
    fn a_leader_lease_under_two_gossip_intervals_is_refused() {
        NodeConfig::from_toml_str(MINIMAL).unwrap();
        for (interval, lease) in [(1500, 2000), (250, 0)] {
            let text = format!(
                "{MINIMAL}\n[cluster]\ngossip_interval_ms = {interval}\n[tuning]\nleader_lease_ms = {lease}\n"
            );
            let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
            assert!(e.contains("tuning.leader_lease_ms"), "{e}");
        }
        let text = format!("{MINIMAL}\n[cluster]\ngossip_interval_ms = 1000\n");
        NodeConfig::from_toml_str(&text).unwrap();
    }

    #[test]
    fn tuning_errors_name_the_field() {
        for (extra, field) in [
            ("window_requests = 0", "tuning.window_requests"),
            ("min_samples = 500", "tuning.min_samples"),
            ("sigma0 = -1.0", "tuning.sigma0"),
            ("e2e_guard = -0.5", "tuning.e2e_guard"),
            ("min_improvement = 1.5", "tuning.min_improvement"),
            ("noise_z = -1.0", "tuning.noise_z"),
            (
                "switchback_block_ms = 3600001",
                "tuning.switchback_block_ms",
            ),
            (
                "w_rtt = { start = 5.0, min = 0.05, max = 2.0 }",
                "tuning.w_rtt",
            ),
            ("mode = \"sometimes\"", "sometimes"),
            ("windw = 3", "windw"),
        ] {
            let text = format!("{MINIMAL}\n[tuning]\n{extra}\n");
            let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
            assert!(e.contains(field), "{extra}: {e}");
        }
    }

    /// The aliases of `[tuning]` keys load (`window` was "duplicate field
    /// `window_requests`": the default was filled in under the other name).
    #[test]
    fn tuning_keys_load_by_their_aliases() {
        let text = format!("{MINIMAL}\n[tuning]\nwindow = 64\ntime_cap_ms = 30000\nguard = 0.1\n");
        let c = NodeConfig::from_toml_str(&text).unwrap();
        assert_eq!(c.tuning.es.window, 64);
        assert_eq!(c.tuning.es.time_cap_ms, 30_000);
        assert_eq!(c.tuning.es.guard, 0.1);
    }

    /// A reload applies the engines only; the other tables it was given changed are
    /// named.
    #[test]
    fn a_reload_names_the_tables_it_leaves_as_they_run() {
        let old = NodeConfig::from_toml_str(MINIMAL).unwrap();
        let same_but_engine = NodeConfig::from_toml_str(
            &MINIMAL.replace("http://127.0.0.1:30000", "http://127.0.0.1:30001"),
        )
        .unwrap();
        assert!(old.changed_besides_engines(&same_but_engine).is_empty());
        let text = format!("{MINIMAL}\n[limits]\nmax_concurrency = 7\n[routing]\nmax_hops = 2\n");
        let new = NodeConfig::from_toml_str(&text).unwrap();
        assert_eq!(old.changed_besides_engines(&new), ["routing", "limits"]);
    }

    /// Two engines given one KV-event endpoint would each take the other's blocks.
    #[test]
    fn two_engines_with_one_kv_event_endpoint_are_refused() {
        let engine = "[engine]\nurl = \"http://127.0.0.1:30000\"\nkind = \"sglang\"\n";
        let entry = |port: u16| {
            format!("[[engines]]\nurl = \"http://127.0.0.1:{port}\"\nkind = \"sglang\"\nkv_events = \"tcp://127.0.0.1:5557\"\ntokenizer = \"t.json\"\n")
        };
        let text = MINIMAL.replace(engine, &(entry(30000) + &entry(30001)));
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(
            e.contains("`engines[1].kv_events`")
                && e.contains("5557")
                && e.contains("`engines[0].kv_events`"),
            "{e}"
        );
    }

    /// One socket given as an engine's publisher and as its replay socket: the error
    /// names the field as the file has it, `engine.kv_events_replay` (it said
    /// `engines`, a table a file with `[engine]` does not have), or the entry's.
    #[test]
    fn a_replay_socket_that_is_the_publisher_names_its_field() {
        let engine = "[engine]\nurl = \"http://127.0.0.1:30000\"\nkind = \"sglang\"\n";
        let kv = "kv_events = \"tcp://127.0.0.1:5557\"\ntokenizer = \"t.json\"\n";
        let text = MINIMAL.replace(
            engine,
            &format!("{engine}{kv}kv_events_replay = \"tcp://127.0.0.1:5557\"\n"),
        );
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(e.contains("`engine.kv_events_replay`"), "{e}");
        let entry = |port: u16, more: &str| {
            format!("[[engines]]\nurl = \"http://127.0.0.1:{port}\"\nkind = \"sglang\"\n{more}")
        };
        let second = "kv_events = \"tcp://127.0.0.1:6000\"\ntokenizer = \"t.json\"\nkv_events_replay = \"tcp://127.0.0.1:5557\"\n";
        let text = MINIMAL.replace(engine, &(entry(30000, kv) + &entry(30001, second)));
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(
            e.contains("`engines[1].kv_events_replay`") && e.contains("`engines[0].kv_events`"),
            "{e}"
        );
    }

    /// MINIMAL with `extra` lines in its `[engine]`.
    fn with_engine_lines(extra: &str) -> String {
        MINIMAL.replace("kind = \"sglang\"", &format!("kind = \"sglang\"\n{extra}"))
    }

    /// The node's engine client has no TLS: an `https` engine failed every request
    /// while `--check` said the config was fine. Refused, naming the field, in the
    /// file and in `POST /admin/engines` (its bare field).
    #[test]
    fn an_https_engine_is_refused_naming_the_field() {
        let text = MINIMAL.replace("http://127.0.0.1:30000", "https://127.0.0.1:30000");
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(
            e.contains("`engine.url`") && e.contains("plain HTTP"),
            "{e}"
        );
        let text = with_engines(&["http://127.0.0.1:1", "HTTPS://engine"], "");
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(e.contains("`engines[1].url`"), "{e}");
        let mut added = NodeConfig::from_toml_str(&with_engines(&["http://127.0.0.1:1"], ""))
            .unwrap()
            .into_inner();
        added.engines.push(EngineSection::new(
            "https://127.0.0.1:2",
            EngineKind::Sglang,
        ));
        let e = added.validate_added_engine().unwrap_err().to_string();
        assert!(
            e.contains("invalid `url`") && e.contains("plain HTTP"),
            "{e}"
        );
    }

    /// `http::Uri` takes any digits as a port: `:300000` passed, and the normal form
    /// dropped it (requests went to port 80).
    #[test]
    fn an_engine_port_that_is_no_port_is_refused_naming_the_field() {
        for port in ["300000", "65536", "0"] {
            let url = format!("http://127.0.0.1:{port}");
            let text = MINIMAL.replace("http://127.0.0.1:30000", &url);
            let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
            assert!(
                e.contains("`engine.url`") && e.contains(port),
                "{port}: {e}"
            );
            let text = with_engines(&["http://127.0.0.1:1", &url], "");
            let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
            assert!(e.contains("`engines[1].url`"), "{port}: {e}");
        }
        assert_eq!(
            normalize_engine_url("http://127.0.0.1:300000/"),
            "http://127.0.0.1:300000"
        );
        for url in [
            "http://127.0.0.1:65535",
            "http://[::1]:8000",
            "http://[::1]",
        ] {
            let text = MINIMAL.replace("http://127.0.0.1:30000", url);
            NodeConfig::from_toml_str(&text).unwrap_or_else(|e| panic!("{url}: {e}"));
        }
    }

    /// The seeds of an engine's fit are checked once, naming the engine's field:
    /// `t_p_ms = 0` was refused later by the fit under a name of neither form, and
    /// `1e306` became infinite inside it.
    #[test]
    fn engine_seeds_out_of_range_are_refused_naming_the_field() {
        for (extra, field) in [
            ("t_p_ms = 0.0", "engine.t_p_ms"),
            ("t_p_ms = 1e306", "engine.t_p_ms"),
            ("t_p_ms = nan", "engine.t_p_ms"),
            ("base_ms = 1e306", "engine.base_ms"),
            ("base_ms = -1.0", "engine.base_ms"),
            ("decode_step_ms = 1e306", "engine.decode_step_ms"),
            ("decode_step_ms = inf", "engine.decode_step_ms"),
        ] {
            let e = NodeConfig::from_toml_str(&with_engine_lines(extra))
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("`{field}`")), "{extra}: {e}");
        }
        let text = with_engines(
            &["http://127.0.0.1:1", "http://127.0.0.1:2"],
            "t_p_ms = 0.0",
        );
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(e.contains("`engines[1].t_p_ms`"), "{e}");
        // The ceilings themselves load.
        NodeConfig::from_toml_str(&with_engine_lines(
            "t_p_ms = 1000.0\nbase_ms = 600000.0\ndecode_step_ms = 1000.0",
        ))
        .unwrap();
    }

    /// The config file is read with a cap, at startup and on SIGHUP: a valid one
    /// padded one byte over it, or `/dev/zero` (which says it is empty), is refused
    /// naming the file and the cap, never read whole.
    #[test]
    fn a_config_file_over_the_cap_is_refused() {
        let cap = gorgo_files::MAX_CONFIG_FILE_BYTES;
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("node.toml");
        let padding = " ".repeat(cap as usize + 1 - MINIMAL.len());
        std::fs::write(&big, format!("{MINIMAL}{padding}")).unwrap();
        let zero = Path::new("/dev/zero");
        for path in [big.as_path(), zero].into_iter().filter(|p| p.exists()) {
            let e = NodeConfig::load(path).unwrap_err().to_string();
            assert!(
                e.contains(&path.display().to_string())
                    && e.contains(&format!("larger than {cap} bytes")),
                "{e}"
            );
        }
    }

    /// The learned-weights file is written maybe hours in: a path that names a
    /// directory (one that exists, or one written with a trailing `/`) is refused
    /// when the config is checked, not when tuning freezes.
    #[test]
    fn a_learned_weights_path_that_names_a_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let text = |path: &str| format!("{MINIMAL}\n[tuning]\nlearned_weights_out = \"{path}\"\n");
        let d = dir.path().display().to_string();
        for path in [d.clone(), format!("{d}/new/"), format!("{d}/..")] {
            let e = NodeConfig::from_toml_str(&text(&path))
                .unwrap_err()
                .to_string();
            assert!(e.contains("`tuning.learned_weights_out`"), "{path}: {e}");
        }
        NodeConfig::from_toml_str(&text(&format!("{d}/w.json"))).unwrap();
    }

    /// The region travels in every membership id (SWIM packets are capped) and in a
    /// response header: a long one never joined, a non-ASCII one lost the header,
    /// and neither named the field. The id's rule applies, as for `node.id`.
    #[test]
    fn a_region_no_packet_or_header_can_carry_is_refused_naming_the_field() {
        let long = "r".repeat(1100);
        for region in [long.as_str(), "us east", "région", "", "US_East", "-x"] {
            let text =
                MINIMAL.replace("region = \"us-ashburn\"", &format!("region = \"{region}\""));
            let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
            assert!(e.contains("`node.region`"), "{region}: {e}");
        }
        let text = MINIMAL.replace("us-ashburn", &"r".repeat(63));
        NodeConfig::from_toml_str(&text).unwrap();
        // The id is bounded the same way already (it is a TLS server name).
        let text = MINIMAL.replace("id = \"a\"", &format!("id = \"{}\"", "a".repeat(64)));
        let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
        assert!(e.contains("`node.id`"), "{e}");
    }

    /// Waits written as "never" (the largest TOML integer) are capped at a week as the
    /// timeouts are; 0 stays where it means something (no warm-up, no grace, retry at
    /// once).
    #[test]
    fn waits_written_as_never_are_refused_naming_the_field() {
        let max = "9223372036854775807";
        for (text, field) in [
            (
                with_engine_lines(&format!("kv_events_warmup_ms = {max}")),
                "engine.kv_events_warmup_ms",
            ),
            (
                with_engine_lines(&format!("kv_events_silence_ms = {max}")),
                "engine.kv_events_silence_ms",
            ),
            (
                with_engine_lines("kv_events_silence_ms = 0"),
                "engine.kv_events_silence_ms",
            ),
            (
                format!("{MINIMAL}\n[tuning]\nstartup_grace_ms = {max}\n"),
                "tuning.startup_grace_ms",
            ),
            (
                format!("{MINIMAL}\n[tuning]\nwindow_max_ms = {max}\n"),
                "tuning.window_max_ms",
            ),
            (
                format!("{MINIMAL}\n[limits]\nretry_after_s = {max}\n"),
                "limits.retry_after_s",
            ),
            (
                format!("{MINIMAL}\n[limits]\nretry_after_s = 604801\n"),
                "limits.retry_after_s",
            ),
        ] {
            let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
            assert!(e.contains(&format!("`{field}`")), "{field}: {e}");
        }
        let ok = format!(
            "{}\n[tuning]\nstartup_grace_ms = 0\nwindow_max_ms = {MAX_TIMEOUT_MS}\n[limits]\nretry_after_s = 0\n",
            with_engine_lines("kv_events_warmup_ms = 0")
        );
        NodeConfig::from_toml_str(&ok).unwrap();
        let ok = format!("{MINIMAL}\n[limits]\nretry_after_s = 604800\n");
        NodeConfig::from_toml_str(&ok).unwrap();
    }

    /// The learned-weights file is written when tuning freezes, maybe hours in: a
    /// directory that is not there is refused when the config is checked.
    #[test]
    fn a_learned_weights_file_in_a_missing_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let text = |path: &Path| {
            format!(
                "{MINIMAL}\n[tuning]\nlearned_weights_out = \"{}\"\n",
                path.display()
            )
        };
        let missing = dir.path().join("missing").join("w.json");
        let e = NodeConfig::from_toml_str(&text(&missing))
            .unwrap_err()
            .to_string();
        assert!(e.contains("tuning.learned_weights_out"), "{e}");
        NodeConfig::from_toml_str(&text(&dir.path().join("w.json"))).unwrap();
    }

    #[test]
    fn example_configs_load() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs/nodes");
        let mut n = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                NodeConfig::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                n += 1;
            }
        }
        assert!(n >= 3, "expected three example configs, found {n}");
    }

    #[test]
    fn telemetry_is_off_by_default_and_checked_when_set() {
        let c = NodeConfig::from_toml_str(MINIMAL).unwrap();
        assert_eq!(c.telemetry, TelemetrySection::default());
        assert_eq!(c.telemetry.service_name, "gorgo-node");
        let text = format!(
            "{MINIMAL}\n[telemetry]\notlp_endpoint = \"http://127.0.0.1:4318/v1/traces\"\nservice_name = \"gorgo-eu\"\n"
        );
        let c = NodeConfig::from_toml_str(&text).unwrap();
        let back = NodeConfig::from_toml_str(&c.to_toml_string().unwrap()).unwrap();
        assert_eq!(back.telemetry, c.telemetry);
        for (extra, field) in [
            (
                "otlp_endpoint = \"https://collector:4318/v1/traces\"",
                "telemetry.otlp_endpoint",
            ),
            (
                "otlp_endpoint = \"http://bad host/\"",
                "telemetry.otlp_endpoint",
            ),
            (
                "otlp_endpoint = \"http://127.0.0.1:0/v1/traces\"",
                "port `0`: must be in 1..=65535",
            ),
            (
                "otlp_endpoint = \"http://127.0.0.1:99999/v1/traces\"",
                "port `99999`: must be in 1..=65535",
            ),
            (
                "otlp_endpoint = \"http://u:p@collector:4318/v1/traces\"",
                "without user info",
            ),
            (
                "otlp_endpoint = \"http://collector:4318/v1/traces\\n\"",
                "visible ASCII only",
            ),
            ("service_name = \" \"", "telemetry.service_name"),
            ("otlp_endpont = \"http://x\"", "otlp_endpont"),
        ] {
            let text = format!("{MINIMAL}\n[telemetry]\n{extra}\n");
            let e = NodeConfig::from_toml_str(&text).unwrap_err().to_string();
            assert!(e.contains(field), "{extra}: {e}");
        }
    }
}
