//! `gorgo node`: run a router node beside a region's inference engine.

use std::path::PathBuf;

use anyhow::Context as _;

/// Arguments of this subcommand.
#[derive(clap::Args, Debug)]
pub struct NodeArgs {
    /// The node's TOML config (see docs/node.md and configs/nodes/).
    #[arg(long)]
    pub config: PathBuf,
    /// Check the config and the files it names (certificates, tokenizer, learned
    /// weights) and exit.
    #[arg(long)]
    pub check: bool,
}

/// Load the config, start the node and its cluster member, serve until Ctrl-C or
/// SIGTERM, then drain (readiness off, peers told, in-flight requests finish up to
/// `limits.drain_timeout_ms`), stop and exit 0. A second signal stops at once.
pub fn run(args: NodeArgs) -> anyhow::Result<()> {
    let config = gorgo_node::NodeConfig::load(&args.config)
        .with_context(|| format!("loading {}", args.config.display()))?;
    if args.check {
        gorgo_node::cluster::preflight(&config)
            .with_context(|| format!("checking {}", args.config.display()))?;
        outln!("{}: ok", args.config.display());
        return Ok(());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    // Traces leave by OTLP only when `[telemetry] otlp_endpoint` is set.
    let traces = gorgo_node::telemetry::otlp_provider(
        &config.telemetry,
        &gorgo_core::NodeId(config.node.id.clone()),
        runtime.handle().clone(),
    )
    .context("setting up trace export")?;
    super::init_tracing_with(
        traces
            .as_ref()
            .map(|p| Box::new(gorgo_node::telemetry::layer(p)) as super::ExtraLayer),
    );
    if let Some(endpoint) = &config.telemetry.otlp_endpoint {
        tracing::info!(%endpoint, "exporting traces by OTLP/HTTP");
    }
    let served = serve(&runtime, config, &args.config);
    if let Some(traces) = traces {
        // The runtime still runs: the last batch can go out.
        if let Err(e) = traces.shutdown() {
            tracing::warn!(error = %e, "flushing traces at exit failed");
        }
    }
    served
}

/// Run the node until a signal, drained and stopped (see [`run`]).
fn serve(
    runtime: &tokio::runtime::Runtime,
    config: gorgo_node::ValidatedConfig,
    config_path: &std::path::Path,
) -> anyhow::Result<()> {
    runtime.block_on(async move {
        // Caught from here on: a SIGHUP while the node starts (tokenizer, cluster) was
        // the default action, which ends the process.
        #[cfg(unix)]
        let hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup());
        let shutdown = gorgo_node::CancellationToken::new();
        let node = gorgo_node::cluster::start_with_cluster(config, shutdown.clone())
            .await
            .context("starting the node")?;
        tracing::info!(http = %node.http_addr, admin = %node.admin_addr, "gorgo node ready");
        #[cfg(unix)]
        tokio::spawn(reload_on_hangup(
            hangups,
            node.state.clone(),
            config_path.to_owned(),
            shutdown.clone(),
        ));
        signal_or_never().await;
        let deadline = std::time::Duration::from_millis(node.state.config.limits.drain_timeout_ms);
        tracing::info!(deadline_ms = deadline.as_millis() as u64, "draining");
        tokio::select! {
            left = node.drain(deadline) => {
                tracing::info!(left_in_flight = left, "drained; leaving the cluster");
                let leave = node.state.peers.leave();
                let _ = tokio::time::timeout(std::time::Duration::from_secs(5), leave).await;
            }
            _ = signal_or_never() => tracing::warn!("second signal: stopping now"),
        }
        shutdown.cancel();
        let _ = tokio::time::timeout(std::time::Duration::from_secs(10), node.wait()).await;
        Ok(())
    })
}

/// Resolves on Ctrl-C or SIGTERM; never where the handlers cannot be installed (that is
/// logged): an error returned at once read as a signal, and the node drained as soon
/// as it was ready (`gorgo engine` waits the same way).
async fn signal_or_never() {
    if let Err(e) = super::shutdown_signal().await {
        tracing::error!(error = %e, "cannot wait for signals: serving until killed");
        std::future::pending::<()>().await;
    }
}

/// On SIGHUP, read the config file again and make the node's engines follow its
/// `[[engines]]` ([`gorgo_node::NodeState::reload_engines`]); a config that does not
/// load is logged and changes nothing. Only the engine list is reloaded; the other
/// tables changed in the file are named in a warning (they need a restart).
#[cfg(unix)]
async fn reload_on_hangup(
    hangups: std::io::Result<tokio::signal::unix::Signal>,
    state: std::sync::Arc<gorgo_node::NodeState>,
    path: PathBuf,
    shutdown: gorgo_node::CancellationToken,
) {
    let Ok(mut hup) = hangups else {
        tracing::warn!("SIGHUP cannot be caught: no config reload");
        return;
    };
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            got = hup.recv() => if got.is_none() { return },
        }
        match gorgo_node::NodeConfig::load(&path) {
            Ok(config) => match state.reload_engines(config.engines()) {
                Ok(done) if !state.config.changed_besides_engines(&config).is_empty() => {
                    let (added, removed) = done;
                    let left = state.config.changed_besides_engines(&config);
                    tracing::warn!(
                        ?added,
                        ?removed,
                        not_applied = ?left,
                        "reloaded the engines of {}; the other tables changed there take a restart",
                        path.display()
                    )
                }
                Ok((added, removed)) => {
                    tracing::info!(
                        ?added,
                        ?removed,
                        "reloaded the engines of {}",
                        path.display()
                    )
                }
                Err(e) => tracing::error!(error = %e, "reloading the engines: nothing changed"),
            },
            Err(e) => {
                tracing::error!(error = %e, "reload: {} does not load; nothing changed", path.display())
            }
        }
    }
}
