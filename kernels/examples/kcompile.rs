//! Compile every kernel module with NVRTC (no GPU needed), check that each
//! listed entry point is in the image, and report sizes, compile times and
//! (with `-v`) ptxas register/spill usage and warnings (e.g. wgmma
//! serialized); `--dump DIR` writes each module's
//! cubin to `DIR/<module>.cubin` (to compare the machine code of two source
//! versions, e.g. that a template leaves an entry point's code unchanged).
//! `--module NAME` compiles that module only.
//! Usage: `kcompile [--arch 90] [-v] [--dump DIR] [--module NAME]`.

use krasis_kernels::{compile_module, sources::MODULES};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (mut arch, mut verbose) = (90, false);
    let mut dump: Option<std::path::PathBuf> = None;
    let mut only: Option<String> = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--arch" => {
                arch = args
                    .next()
                    .ok_or_else(|| anyhow::anyhow!("--arch needs a value"))?
                    .parse()?
            }
            "-v" => verbose = true,
            "--dump" => {
                let dir = args
                    .next()
                    .ok_or_else(|| anyhow::anyhow!("--dump needs a directory"))?;
                std::fs::create_dir_all(&dir)?;
                dump = Some(dir.into());
            }
            "--module" => {
                only = Some(
                    args.next()
                        .ok_or_else(|| anyhow::anyhow!("--module needs a name"))?,
                )
            }
            other => anyhow::bail!("unknown argument {other}"),
        }
    }
    // SAFETY: only probes whether the NVRTC library can be loaded.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        anyhow::bail!("libnvrtc not found; install the CUDA NVRTC runtime or set LD_LIBRARY_PATH");
    }
    println!(
        "NVRTC {:?}, target sm_{arch}",
        krasis_kernels::nvrtc_version()?
    );
    let cc = (arch / 10, arch % 10);
    let extra: &[&str] = if verbose { &["-Xptxas=-v"] } else { &[] };
    if let Some(name) = &only {
        anyhow::ensure!(MODULES.iter().any(|m| m.name == name), "no module {name}");
    }
    for m in MODULES
        .iter()
        .filter(|m| only.as_ref().is_none_or(|n| m.name == n))
    {
        if m.target.arch(cc).is_none() {
            println!("{:<20} skipped: built for {} only", m.name, m.target.name());
            continue;
        }
        let t = std::time::Instant::now();
        let c = compile_module(m, cc, extra)?;
        println!(
            "{:<20} {:>8} bytes, {:>5} ms",
            m.name,
            c.cubin.len(),
            t.elapsed().as_millis()
        );
        if let Some(dir) = &dump {
            std::fs::write(dir.join(format!("{}.cubin", m.name)), &c.cubin)?;
        }
        for k in m.kernels {
            let needle = k.as_bytes();
            anyhow::ensure!(
                c.cubin.windows(needle.len()).any(|w| w == needle),
                "{k} missing from the image of {}",
                m.name
            );
        }
        if verbose {
            let mut entry = String::new();
            for line in c.log.lines() {
                if let Some(rest) = line.split("Compiling entry function '").nth(1) {
                    entry = rest.split('\'').next().unwrap_or("").to_string();
                } else if line.contains("Used")
                    || line.contains("arning")
                    // ptxas reports serialized wgmma (C7513-C7515,
                    // "Potential Performance Loss") as info, before the
                    // entry function's other lines; the text names it.
                    || line.contains("Performance Loss")
                    || (line.contains("spill") && !line.contains(" 0 bytes spill stores"))
                {
                    println!("    {entry}: {}", line.trim());
                }
            }
        }
    }
    Ok(())
}
