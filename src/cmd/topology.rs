//! `gorgo topology`: write a generated topology file (regions on a sphere, one-way
//! delay from great-circle distance, `gorgo_netem::sphere`) for simulations at scales
//! the shipped, measured topologies do not reach.

use std::path::PathBuf;

use anyhow::Context;
use gorgo_netem::sphere::{generate, to_toml, SphereSpec};

/// Arguments of this subcommand.
#[derive(clap::Args, Debug)]
pub struct TopologyArgs {
    /// Number of regions.
    #[arg(long)]
    regions: usize,
    /// Seed of the region positions.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// One-way client-to-node delay of every region, ms.
    #[arg(long, default_value_t = 5.0)]
    client_delay_ms: f64,
    /// Where to write the topology TOML (`-`: stdout).
    #[arg(long)]
    out: PathBuf,
}

/// Generate and write the topology.
pub fn run(args: TopologyArgs) -> anyhow::Result<()> {
    let spec = SphereSpec {
        regions: args.regions,
        seed: args.seed,
        client_delay_ms: args.client_delay_ms,
    };
    let (topology, placed) = generate(&spec).context("generating the topology")?;
    let text = to_toml(&spec, &topology, &placed);
    if args.out.as_os_str() == "-" {
        print!("{text}");
    } else {
        std::fs::write(&args.out, text)
            .with_context(|| format!("writing {}", args.out.display()))?;
        eprintln!(
            "wrote {} ({} regions)",
            args.out.display(),
            topology.regions.len()
        );
    }
    Ok(())
}
