//! `gorgo certs`: one certificate per node, under the cluster CA in `--out` (a new one
//! where there is none).

use std::path::PathBuf;

use anyhow::Context;
use gorgo_core::NodeId;

/// Arguments of this subcommand.
#[derive(clap::Args, Debug)]
pub struct CertsArgs {
    /// Directory to write `<node>.pem` and `<node>.key` into, under its `ca.pem` and
    /// `ca.key` (written first where neither is there).
    #[arg(long)]
    pub out: PathBuf,
    /// Node ids, comma separated (each becomes the TLS name of its certificate).
    #[arg(long, value_delimiter = ',', required = true)]
    pub nodes: Vec<String>,
    /// Days each node certificate is valid (1 to 36500): re-issue a node under the
    /// same CA (`--nodes <id>` into the same `--out`) and restart it before then.
    #[arg(
        long,
        default_value_t = gorgo_cluster::NODE_CERT_DAYS,
        value_parser = clap::value_parser!(u32).range(1..=i64::from(gorgo_cluster::MAX_NODE_CERT_DAYS))
    )]
    pub days: u32,
}

/// Write the CA and node certificates, then list what was written.
pub fn run(args: CertsArgs) -> anyhow::Result<()> {
    let nodes: Vec<NodeId> = args
        .nodes
        .iter()
        .map(|n| NodeId(n.trim().to_owned()))
        .collect();
    let existing = args.out.join("ca.key").exists();
    let written = gorgo_cluster::write_cluster_certs(&args.out, &nodes, args.days)
        .with_context(|| format!("writing certificates to {}", args.out.display()))?;
    let ca = args.out.join("ca.pem");
    if existing {
        outln!("CA: {} (already there: issued under it)", ca.display());
    } else {
        outln!("CA: {} (new)", ca.display());
    }
    for (node, files) in written {
        outln!(
            "{node}: cert {} key {}",
            files.cert.display(),
            files.key.display()
        );
    }
    Ok(())
}
