//! `gorgo trace`.

/// Arguments of this subcommand.
#[derive(clap::Args, Debug)]
pub struct TraceArgs {}

/// Not implemented yet.
pub fn run(_args: TraceArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
