//! `gorgo up`.

/// Arguments of this subcommand.
#[derive(clap::Args, Debug)]
pub struct UpArgs {}

/// Not implemented yet.
pub fn run_up(_args: UpArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}

/// Arguments of this subcommand.
#[derive(clap::Args, Debug)]
pub struct DownArgs {}

/// Not implemented yet.
pub fn run_down(_args: DownArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
