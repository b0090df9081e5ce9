//! `gorgo netem`: runs every user-space WAN relay a topology calls for (one
//! client TCP relay per region, one UDP relay per ordered pair of regions) on
//! the loopback plan of `gorgo_netem::plan_cluster`, until Ctrl-C or SIGTERM.

use std::path::PathBuf;

use anyhow::Context;
use gorgo_netem::{plan_cluster, tc_script, NetemCluster, PlanOptions, Topology};

/// Arguments of this subcommand.
#[derive(clap::Args, Debug)]
pub struct NetemArgs {
    /// Topology file (configs/topologies/*.toml).
    #[arg(long)]
    pub topology: PathBuf,
    /// Last octet of region 0's loopback address 127.0.0.<ip-base>.
    #[arg(long, default_value_t = PlanOptions::default().ip_base)]
    pub ip_base: u8,
    /// First port of each region's block of ports.
    #[arg(long, default_value_t = PlanOptions::default().base_port)]
    pub base_port: u16,
    /// Seed of every relay's loss and jitter draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print the address plan as JSON and exit.
    #[arg(long, conflicts_with = "tc_script")]
    pub plan: bool,
    /// Print the equivalent `tc netem` + network namespace script and exit.
    #[arg(long)]
    pub tc_script: bool,
}

/// Runs the relays, or prints the plan or tc script.
pub fn run(args: NetemArgs) -> anyhow::Result<()> {
    let topology = Topology::from_file(&args.topology)?;
    if args.tc_script {
        let name = args
            .topology
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "topology".to_owned());
        print!("{}", tc_script(&topology, &name));
        return Ok(());
    }
    let options = PlanOptions {
        ip_base: args.ip_base,
        base_port: args.base_port,
    };
    let plan = plan_cluster(&topology, &options)?;
    if args.plan {
        println!("{}", serde_json::to_string_pretty(&plan)?);
        return Ok(());
    }
    super::init_tracing();
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    runtime.block_on(async {
        let cluster = NetemCluster::start(&topology, &plan, args.seed).await?;
        println!("{:<34} {:<5} {:<22} target", "relay", "proto", "listen");
        for relay in &cluster.relays {
            println!(
                "{:<34} {:<5} {:<22} {}",
                relay.name,
                relay.protocol,
                relay.handle.local_addr(),
                relay.target
            );
        }
        println!("relays running; Ctrl-C to stop");
        wait_for_shutdown_signal().await?;
        tracing::info!("stopping relays");
        cluster.shutdown().await;
        Ok(())
    })
}

/// Resolves on Ctrl-C or SIGTERM (what `gorgo down` sends).
pub async fn wait_for_shutdown_signal() -> anyhow::Result<()> {
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
