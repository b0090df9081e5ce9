//! `gorgo engine`.

/// Arguments of this subcommand.
#[derive(clap::Args, Debug)]
pub struct EngineArgs {}

/// Not implemented yet.
pub fn run(_args: EngineArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
