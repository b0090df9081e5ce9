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
    // The spec's fields are this command's flags: name them as such.
    let (topology, placed) = generate(&spec).map_err(|e| match e {
        gorgo_netem::NetemError::Invalid { field, reason }
            if field == "regions" || field == "client_delay_ms" =>
        {
            anyhow::anyhow!("--{} {reason}", field.replace('_', "-"))
        }
        e => anyhow::Error::from(e).context("generating the topology"),
    })?;
    let text = to_toml(&spec, &topology, &placed);
    if args.out.as_os_str() == "-" {
        out!("{text}");
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A bad `--regions` or `--client-delay-ms` is named as the flag, not as a field
    /// of a topology file the user never wrote.
    #[test]
    fn bad_values_name_the_flag() {
        for (regions, client_delay_ms, flag) in
            [(1, 5.0, "--regions"), (3, f64::NAN, "--client-delay-ms")]
        {
            let args = TopologyArgs {
                regions,
                seed: 0,
                client_delay_ms,
                out: "-".into(),
            };
            let e = run(args).unwrap_err().to_string();
            assert!(e.contains(flag) && !e.contains("topology field"), "{e}");
        }
    }
}
