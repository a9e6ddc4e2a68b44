//! `krasis-runtime serve` (being written).

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_a: Args) -> anyhow::Result<()> {
    anyhow::bail!("'serve' is not implemented in this build")
}
