//! `gorgo bench`.

/// Arguments of this subcommand.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {}

/// Not implemented yet.
pub fn run_bench(_args: BenchArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}

/// Arguments of this subcommand.
#[derive(clap::Args, Debug)]
pub struct CompareArgs {}

/// Not implemented yet.
pub fn run_compare(_args: CompareArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}

/// Arguments of this subcommand.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {}

/// Not implemented yet.
pub fn run_demo(_args: DemoArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
