//! `krasis-runtime generate` (being written).

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_a: Args) -> anyhow::Result<()> {
    anyhow::bail!("'generate' is not implemented in this build")
}
