//! One module per subcommand; each owns its arguments and its driver.

/// `print!` that fails instead of panicking: see [`write_stdout`]. Only in functions
/// returning `anyhow::Result`.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cmd::write_stdout(format_args!($($arg)*))?
    };
}

/// `println!` that fails instead of panicking: see [`write_stdout`].
macro_rules! outln {
    () => {
        $crate::cmd::write_stdout(format_args!("\n"))?
    };
    ($($arg:tt)*) => {
        $crate::cmd::write_stdout(format_args!("{}\n", format_args!($($arg)*)))?
    };
}

/// `println!` for the status lines of a command whose work is done by then (a cluster
/// started, processes stopped): written if stdout takes it, else left out, since a
/// closed stdout must neither panic nor undo the work (`gorgo up --detach | true`
/// tore its cluster down, leaving a stale `cluster.json`).
macro_rules! tellln {
    ($($arg:tt)*) => {
        let _ = $crate::cmd::write_stdout(format_args!("{}\n", format_args!($($arg)*)));
    };
}

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

/// Write a subcommand's output to stdout and flush it, or say why not. `print!`
/// panics when stdout is a closed pipe (`gorgo trace stats t.jsonl | head -1`) or a
/// full disk (exit 101 and a panic message); a subcommand's output is its work, so a
/// failure to write it is an error like any other: exit 1, naming stdout.
pub fn write_stdout(args: std::fmt::Arguments<'_>) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    out.write_fmt(args)
        .and_then(|()| out.flush())
        .context("writing to stdout")
}

/// Create the output directory `out` of flag `--out` (and its parents) before any
/// work, so that a path that cannot be one (an existing file) is an error naming the
/// flag at once, not after every run: `compare`, `demo`, `sim`, `sweep` and
/// `tune-offline`.
pub fn create_out_dir(out: &std::path::Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(out)
        .with_context(|| format!("--out {}: cannot create it as a directory", out.display()))
}

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
