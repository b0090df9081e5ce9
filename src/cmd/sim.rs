//! `gorgo sim`.

/// Arguments of this subcommand.
#[derive(clap::Args, Debug)]
pub struct SimArgs {}

/// Not implemented yet.
pub fn run(_args: SimArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
