//! `gorgo netem`: runs every user-space WAN relay a topology calls for (one
//! client TCP relay per region, one UDP relay in front of each node) on the
//! loopback plan of `gorgo_netem::plan_cluster`, and the control API that cuts,
//! heals and reshapes their links, until Ctrl-C or SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use gorgo_netem::{plan_cluster, serve_control, tc_script, NetemCluster, PlanOptions, Topology};

/// Arguments of this subcommand.
#[derive(clap::Args, Debug)]
pub struct NetemArgs {
    /// Topology file (configs/topologies/*.toml).
    #[arg(long)]
    pub topology: PathBuf,
    /// Last octet N of region 0's loopback address, 127.0.0.N (region i gets N + i).
    #[arg(long, default_value_t = PlanOptions::default().ip_base)]
    pub ip_base: u8,
    /// First port of each region's block of ports.
    #[arg(long, default_value_t = PlanOptions::default().base_port)]
    pub base_port: u16,
    /// Address of the control API (`POST /partition?a=X&b=Y`, `POST /heal?a=X&b=Y`,
    /// `POST /shape?a=X&b=Y&delay_ms=D&rate_mbps=R&loss=L`, `GET /links`); default:
    /// the plan's `control_addr`, base port + 6 on region 0's address. A loopback
    /// address: the API takes no token.
    #[arg(long)]
    pub control: Option<SocketAddr>,
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
    // Checked first, `--plan` or not: whoever reaches the API cuts the cluster's links.
    if let Some(control) = args.control.filter(|a| !a.ip().is_loopback()) {
        anyhow::bail!(
            "--control {control}: the control API takes no token, so it listens on loopback only (127.0.0.0/8 or [::1])"
        );
    }
    let topology = Topology::from_file(&args.topology)?;
    if args.tc_script {
        out!(
            "{}",
            tc_script(&topology, &args.topology.display().to_string())
        );
        return Ok(());
    }
    let options = PlanOptions {
        ip_base: args.ip_base,
        base_port: args.base_port,
    };
    let plan = plan_cluster(&topology, &options)?;
    if args.plan {
        outln!("{}", serde_json::to_string_pretty(&plan)?);
        return Ok(());
    }
    super::init_tracing();
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    runtime.block_on(async {
        let cluster = NetemCluster::start(&topology, &plan, args.seed).await?;
        let control_addr = args.control.unwrap_or(plan.control_addr);
        let listener = tokio::net::TcpListener::bind(control_addr)
            .await
            .with_context(|| format!("binding the control API on {control_addr}"))?;
        // Runs until the signal; dropping it at the end closes the listener.
        let control = serve_control(listener, cluster.links.clone(), std::future::pending());
        // The relays run whatever stdout does: a closed one must not stop them.
        tellln!("{:<34} {:<5} {:<22} target", "relay", "proto", "listen");
        for relay in &cluster.relays {
            tellln!(
                "{:<34} {:<5} {:<22} {}",
                relay.name,
                relay.protocol,
                relay.handle.local_addr(),
                relay.target
            );
        }
        tellln!("control API: http://{control_addr} (POST /partition?a=X&b=Y, POST /heal?a=X&b=Y, POST /shape?a=X&b=Y&delay_ms=D, GET /links)");
        tellln!("relays running; Ctrl-C to stop");
        // A relay that stopped on its own (its socket failed) would leave its link
        // silently dead: the run stops with an error instead.
        let stopped = tokio::select! {
            r = super::shutdown_signal() => { r?; false }
            r = control => { r.context("control API failed")?; false }
            _ = a_relay_stops(&cluster) => true,
        };
        tracing::info!("stopping relays");
        cluster.shutdown().await;
        if stopped {
            anyhow::bail!("a relay stopped on its own (its socket failed): the links it emulated were down");
        }
        Ok(())
    })
}

/// Resolves once any relay of `cluster` has stopped on its own.
async fn a_relay_stops(cluster: &NetemCluster) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    loop {
        tick.tick().await;
        if cluster.any_stopped() {
            return;
        }
    }
}
