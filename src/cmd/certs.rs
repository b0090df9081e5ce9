//! `gorgo certs`: generate a cluster CA and one certificate per node.

use std::path::PathBuf;

use anyhow::Context;
use gorgo_core::NodeId;

/// Arguments of this subcommand.
#[derive(clap::Args, Debug)]
pub struct CertsArgs {
    /// Directory to write `ca.pem`, `ca.key`, `<node>.pem` and `<node>.key` into.
    #[arg(long)]
    pub out: PathBuf,
    /// Node ids, comma separated (each becomes the TLS name of its certificate).
    #[arg(long, value_delimiter = ',', required = true)]
    pub nodes: Vec<String>,
}

/// Write the CA and node certificates, then list what was written.
pub fn run(args: CertsArgs) -> anyhow::Result<()> {
    let nodes: Vec<NodeId> = args
        .nodes
        .iter()
        .map(|n| NodeId(n.trim().to_owned()))
        .collect();
    let written = gorgo_cluster::write_cluster_certs(&args.out, &nodes)
        .with_context(|| format!("writing certificates to {}", args.out.display()))?;
    println!("CA: {}", args.out.join("ca.pem").display());
    for (node, files) in written {
        println!(
            "{node}: cert {} key {}",
            files.cert.display(),
            files.key.display()
        );
    }
    Ok(())
}
