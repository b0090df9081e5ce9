//! One module per subcommand; each owns its arguments and its driver.
pub mod bench;
pub mod certs;
pub mod engine;
pub mod netem;
pub mod node;
pub mod sim;
pub mod sweep;
pub mod topology;
pub mod trace;
pub mod tune_offline;
pub mod up;

use anyhow::Context as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::Layer as _;

/// A layer of the process' subscriber beside its log lines (the node's OpenTelemetry
/// layer).
pub type ExtraLayer =
    Box<dyn tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync>;

/// Initialise `tracing` once for a long-running subcommand (`RUST_LOG` filters).
pub fn init_tracing() {
    init_tracing_with(None);
}

/// [`init_tracing`] with one more layer, which filters for itself: `RUST_LOG` filters
/// the log lines only.
pub fn init_tracing_with(extra: Option<ExtraLayer>) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::registry()
        .with(extra)
        .with(tracing_subscriber::fmt::layer().with_filter(filter))
        .try_init();
}

/// Resolves on Ctrl-C or SIGTERM (what `gorgo down`, `kill` and CI timeouts send): the
/// one way every long-running subcommand waits to stop.
pub async fn shutdown_signal() -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r.context("waiting for Ctrl-C")?,
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    tokio::signal::ctrl_c()
        .await
        .context("waiting for Ctrl-C")?;
    Ok(())
}
