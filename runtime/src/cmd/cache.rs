//! `krasis-runtime cache` (being written).

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_a: Args) -> anyhow::Result<()> {
    anyhow::bail!("'cache' is not implemented in this build")
}
