//! `gorgo node`.

/// Arguments of this subcommand.
#[derive(clap::Args, Debug)]
pub struct NodeArgs {}

/// Not implemented yet.
pub fn run(_args: NodeArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
