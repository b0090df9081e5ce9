//! `gorgo engine`: the OpenAI-compatible engine emulator (model in `gorgo-engine`).

use anyhow::Context;
use gorgo_engine::{EmulatorConfig, Profile};

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
    /// Model name to report (default: the profile's model).
    #[arg(long)]
    pub model: Option<String>,
    /// Prefix-cache block size over prompt bytes (64 bytes = 16 tokens).
    #[arg(long, default_value_t = 64)]
    pub block_bytes: usize,
    /// Requests allowed to wait for admission; beyond it the emulator answers 503.
    #[arg(long, default_value_t = 1024)]
    pub max_queue: usize,
    /// Output tokens when a request sets neither `max_tokens` nor `gorgo_output_tokens`.
    #[arg(long, default_value_t = 128)]
    pub default_max_tokens: u32,
}

/// Serve until Ctrl-C.
pub fn run(args: EngineArgs) -> anyhow::Result<()> {
    super::init_tracing();
    let profile = Profile::by_name_or_file(&args.profile)?;
    anyhow::ensure!(args.block_bytes > 0, "--block-bytes must be > 0");
    let mut config = EmulatorConfig::new(profile);
    config.model_name = args.model;
    config.block_bytes = args.block_bytes;
    config.max_queue = args.max_queue;
    config.default_max_tokens = args.default_max_tokens.max(1);
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?;
        tracing::info!(
            addr = %listener.local_addr()?,
            profile = %config.profile.name,
            "engine emulator listening"
        );
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        gorgo_engine::serve(listener, config, shutdown).await?;
        Ok(())
    })
}
