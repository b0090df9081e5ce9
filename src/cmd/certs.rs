//! `gorgo certs`.

/// Arguments of this subcommand.
#[derive(clap::Args, Debug)]
pub struct CertsArgs {}

/// Not implemented yet.
pub fn run(_args: CertsArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
