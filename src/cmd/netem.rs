//! `gorgo netem`.

/// Arguments of this subcommand.
#[derive(clap::Args, Debug)]
pub struct NetemArgs {}

/// Not implemented yet.
pub fn run(_args: NetemArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
