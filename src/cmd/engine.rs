//! `gorgo engine`: the OpenAI-compatible engine emulator (model in `gorgo-engine`).

use anyhow::Context;
use gorgo_engine::{EmulatedKind, EmulatorConfig, Profile};

/// Arguments of this subcommand.
#[derive(clap::Args, Debug)]
pub struct EngineArgs {
    /// Built-in profile name (paper-a100-mistral7b, h200-mistral7b, h200-dense-1.5b,
    /// paper-l40s-qwen35b-a3b) or the path of a profile TOML file.
    #[arg(long, default_value = "paper-a100-mistral7b")]
    pub profile: String,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:30000")]
    pub listen: std::net::SocketAddr,
    /// The engine to pass for, throughout: `sglang` (the default: SGLang's `/metrics`
    /// names and `/get_server_info`, what `gorgo up` and a node of kind `sglang`
    /// read) or `vllm` (vLLM's names, for a node of kind `vllm`); each with that
    /// engine's API defaults and error bodies (docs/engine-profiles.md).
    #[arg(long, default_value = "sglang", value_parser = parse_kind)]
    pub kind: EmulatedKind,
    /// Model name to report (default: the profile's model): not blank, no control
    /// characters, at most 256 bytes (what a node's peers keep of a model id).
    #[arg(long, value_parser = parse_model)]
    pub model: Option<String>,
    /// Prefix-cache block size over prompt bytes (64 bytes = 16 tokens): a positive
    /// multiple of 4, so that a block holds whole 4-byte tokens (the chain rounds a
    /// partial token up, and 6-byte blocks would count a 24-byte prompt as 8 tokens).
    #[arg(long, default_value_t = 64, value_parser = parse_block_bytes)]
    pub block_bytes: usize,
    /// Requests allowed to wait for admission; beyond it the emulator answers 503.
    /// At least 1: every request waits in the queue before admission, even on an
    /// idle engine, so 0 would refuse them all.
    #[arg(
        long,
        default_value_t = 1024,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
    )]
    pub max_queue: usize,
    /// Output tokens of a chat request that sets neither `max_tokens` nor
    /// `gorgo_output_tokens` (at least 1), cut to the room its context leaves;
    /// completions default to 16, as vLLM's and SGLang's do.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    pub default_max_tokens: u32,
    /// Count prompt tokens (`usage.prompt_tokens`, context, cache) with this HF
    /// `tokenizer.json` and its chat template, as a real engine does, instead of
    /// canonical bytes / 4.
    #[arg(long)]
    pub tokenizer: Option<std::path::PathBuf>,
    /// The chat template for `--tokenizer` (default: `tokenizer_config.json`'s).
    #[arg(long, requires = "tokenizer")]
    pub chat_template: Option<std::path::PathBuf>,
    /// Add the tokenizer's special tokens (BOS) to rendered chat prompts, as
    /// llama-cpp-python's built-in chat formats do.
    #[arg(long, requires = "tokenizer")]
    pub chat_add_special_tokens: bool,
    /// Publish the prefix cache's KV events in vLLM's wire format on a ZeroMQ PUB
    /// socket bound here, e.g. `tcp://127.0.0.1:5557` (docs/kv-events.md).
    #[arg(long)]
    pub kv_events: Option<String>,
    /// Answer replay requests for missed KV-event batches on a ZeroMQ ROUTER bound
    /// here, e.g. `tcp://127.0.0.1:5558`.
    #[arg(long, requires = "kv_events")]
    pub kv_events_replay: Option<String>,
    /// On Ctrl-C or SIGTERM, how long the requests in flight may take to finish
    /// before the connections left are cut and the emulator exits, ms (a node's
    /// default `limits.drain_timeout_ms`). A second signal stops at once.
    #[arg(long, default_value_t = 30_000)]
    pub drain_timeout_ms: u64,
}

/// Serve until Ctrl-C or SIGTERM (what `gorgo down` sends), then drain (see
/// `--drain-timeout-ms`).
pub fn run(args: EngineArgs) -> anyhow::Result<()> {
    super::init_tracing();
    let profile = Profile::by_name_or_file(&args.profile)
        .with_context(|| format!("--profile {}", args.profile))?;
    let mut config = EmulatorConfig::new(profile);
    config.kind = args.kind;
    config.model_name = args.model;
    config.block_bytes = args.block_bytes;
    config.max_queue = args.max_queue;
    config.default_max_tokens = args.default_max_tokens;
    config.drain_timeout = std::time::Duration::from_millis(args.drain_timeout_ms);
    if let Some(path) = &args.tokenizer {
        let tokenizer = gorgo_tokenizer::EngineTokenizer::load(
            path,
            args.chat_template.as_deref(),
            args.chat_add_special_tokens,
        )
        .map_err(|e| match e {
            gorgo_tokenizer::TokenizerError::Config { field, reason } => {
                anyhow::anyhow!("--{}: {reason}", field.replace('_', "-"))
            }
            other => anyhow::anyhow!("--tokenizer: {other}"),
        })?
        // Chat prompts built as the engine it passes for builds them.
        .for_engine(args.kind.into());
        config.tokenizer = Some(std::sync::Arc::new(tokenizer));
    }
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    let served = runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?;
        tracing::info!(
            addr = %listener.local_addr()?,
            profile = %config.profile.name,
            kind = %config.kind,
            "engine emulator listening"
        );
        let (first_signal, first_signal_rx) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async move {
            signalled().await;
            tracing::info!("draining");
            let _ = first_signal.send(());
        };
        let second_signal = async move {
            match first_signal_rx.await {
                Ok(()) => signalled().await,
                Err(_) => std::future::pending().await,
            }
        };
        let kv_events = match &args.kv_events {
            None => None,
            Some(endpoint) => {
                let publisher = gorgo_engine::kv_events::KvPublisher::bind(
                    endpoint,
                    args.kv_events_replay.as_deref(),
                    config.block_bytes / gorgo_core::hash::BYTES_PER_TOKEN,
                )
                .await
                .with_context(|| format!("--kv-events {endpoint}"))?;
                tracing::info!(
                    endpoint = %publisher.endpoint,
                    replay = ?publisher.replay_endpoint,
                    "publishing KV events"
                );
                Some(publisher)
            }
        };
        tokio::select! {
            served = gorgo_engine::serve_with_kv_events(listener, config, kv_events, shutdown) => served?,
            () = second_signal => tracing::warn!("second signal: stopping now"),
        }
        Ok::<_, anyhow::Error>(())
    });
    // Connections still open past the drain deadline (a client that stopped reading)
    // are cut here: their tasks are dropped with the runtime.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    served
}

/// Resolves on Ctrl-C or SIGTERM. Where the handlers cannot be installed it never
/// resolves: stopping at once would be worse than serving until killed.
async fn signalled() {
    if let Err(e) = super::shutdown_signal().await {
        tracing::warn!(error = %e, "cannot wait for signals: serving until killed");
        std::future::pending::<()>().await;
    }
}

/// `--model`: a name clients can send and a node's peers keep. An empty one was
/// served (`/v1/models` listed `""`, which no client names and which peers drop from
/// gossip, as they drop ids over `MAX_MODEL_ID_BYTES`); a blank one or one with a
/// control character is no better.
fn parse_model(s: &str) -> Result<String, String> {
    let max = gorgo_core::types::MAX_MODEL_ID_BYTES;
    if s.trim().is_empty() {
        return Err("must name a model, got an empty or blank name".into());
    }
    if let Some(c) = s.chars().find(|c| c.is_control()) {
        return Err(format!(
            "{s:?} holds control character U+{:04X}",
            u32::from(c)
        ));
    }
    if s.len() > max {
        return Err(format!(
            "{} bytes, over the {max} a model id may have",
            s.len()
        ));
    }
    Ok(s.to_owned())
}

/// `--kind`: one of the engines the emulator can pass for (clap's error then names the
/// flag and the choices).
fn parse_kind(s: &str) -> Result<EmulatedKind, String> {
    s.parse()
        .map_err(|e: gorgo_engine::EngineError| e.to_string())
}

/// `--block-bytes`: refused unless a positive multiple of 4 (clap's error then names
/// the flag), whatever other flags are given.
fn parse_block_bytes(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|e| format!("{e}"))?;
    if n == 0 || !n.is_multiple_of(gorgo_core::hash::BYTES_PER_TOKEN) {
        return Err(format!(
            "must be a positive multiple of {} (blocks of whole tokens), got {n}",
            gorgo_core::hash::BYTES_PER_TOKEN
        ));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: EngineArgs,
    }

    fn parse(argv: &[&str]) -> Result<EngineArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("engine").chain(argv.iter().copied())).map(|c| c.args)
    }

    #[test]
    fn a_queue_limit_of_zero_is_refused_naming_the_flag() {
        let e = parse(&["--max-queue", "0"]).expect_err("0 is refused");
        assert!(e.to_string().contains("--max-queue"), "{e}");
        assert_eq!(parse(&["--max-queue", "1"]).unwrap().max_queue, 1);
        assert_eq!(parse(&[]).unwrap().max_queue, 1024);
        // Zero output tokens is refused too, rather than quietly made 1.
        let e = parse(&["--default-max-tokens", "0"]).expect_err("0 is refused");
        assert!(e.to_string().contains("--default-max-tokens"), "{e}");
    }

    /// An empty, blank or control-character model name is refused naming `--model`
    /// (an empty one was served as the model's id).
    #[test]
    fn a_model_name_no_client_can_send_is_refused_naming_the_flag() {
        let long = "m".repeat(gorgo_core::types::MAX_MODEL_ID_BYTES + 1);
        for bad in ["", "  ", "a\nb", "tab\there", long.as_str()] {
            let e = parse(&["--model", bad]).expect_err(bad);
            assert!(e.to_string().contains("--model"), "{bad:?}: {e}");
        }
        assert_eq!(
            parse(&["--model", "org/My Model-7B"])
                .unwrap()
                .model
                .as_deref(),
            Some("org/My Model-7B")
        );
        assert_eq!(parse(&[]).unwrap().model, None);
    }

    /// `--kind` takes the two engines the emulator passes for, SGLang by default (what
    /// `gorgo up` and nodes of kind `sglang` read); anything else is refused naming
    /// the flag and the choices.
    #[test]
    fn kind_is_sglang_or_vllm() {
        assert_eq!(parse(&[]).unwrap().kind, EmulatedKind::Sglang);
        assert_eq!(parse(&["--kind", "vllm"]).unwrap().kind, EmulatedKind::Vllm);
        for bad in ["openai", "VLLM", ""] {
            let e = parse(&["--kind", bad]).expect_err(bad).to_string();
            assert!(
                e.contains("--kind") && e.contains("sglang or vllm"),
                "{bad:?}: {e}"
            );
        }
    }

    /// Blocks of partial tokens would round each block's count up: refused with or
    /// without `--kv-events`.
    #[test]
    fn block_bytes_must_be_a_positive_multiple_of_4() {
        for bad in ["6", "0", "x"] {
            let e = parse(&["--block-bytes", bad]).expect_err(bad);
            assert!(e.to_string().contains("--block-bytes"), "{bad}: {e}");
        }
        assert_eq!(parse(&["--block-bytes", "8"]).unwrap().block_bytes, 8);
        assert_eq!(parse(&[]).unwrap().block_bytes, 64);
    }
}
