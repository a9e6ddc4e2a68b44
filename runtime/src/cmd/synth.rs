//! `krasis-runtime synth` (being written).

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_a: Args) -> anyhow::Result<()> {
    anyhow::bail!("'synth' is not implemented in this build")
}
