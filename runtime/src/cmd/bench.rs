//! `krasis-runtime bench` (being written).

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_a: Args) -> anyhow::Result<()> {
    anyhow::bail!("'bench' is not implemented in this build")
}
