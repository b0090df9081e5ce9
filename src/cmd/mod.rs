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
pub mod up;

/// Initialise `tracing` once for a long-running subcommand (`RUST_LOG` filters).
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).try_init();
}
