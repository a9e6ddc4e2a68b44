//! `krasis-runtime capabilities` (being written).

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_a: Args) -> anyhow::Result<()> {
    anyhow::bail!("'capabilities' is not implemented in this build")
}
