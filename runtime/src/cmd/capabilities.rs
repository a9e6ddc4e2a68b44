//! `krasis-runtime capabilities [--json]`: what this build implements, and
//! which backends can run on this machine right now. The launcher offers only
//! what is listed here, so the report must be exactly what the code does.

use krasis_common::Capabilities;
use krasis_model::arch::registry;

#[derive(clap::Args)]
pub struct Args {
    /// Print the report as one JSON object (for the launcher and scripts).
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let caps = report();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&caps)?);
    } else {
        print!("{}", human(&caps));
    }
    Ok(())
}

/// The capability report of this build on this machine.
pub fn report() -> Capabilities {
    of_this_build(env!("CARGO_PKG_VERSION"), cuda_availability())
}

/// The report of this build with the cuda backend's availability given
/// (tests use it as the report of a runtime with or without a GPU). The
/// architectures are the registry's, never restated.
pub fn of_this_build(runtime_version: &str, cuda: Result<(), String>) -> Capabilities {
    let mut c = Capabilities::new(runtime_version, cuda, registry::caps());
    // Both engines batch (`Engine::batch`), every family (the CUDA
    // engine's sliding layers keep a ring per sequence), and take a KV
    // budget (the reference's KV tokens, the CUDA engine's KV arena rows).
    let reference = krasis_model::reference::BATCH_CAPACITY as u32;
    c.set_batching(krasis_common::Backend::Reference, reference, true);
    let cuda = krasis_gpu::options::MAX_PARALLEL as u32;
    c.set_batching(krasis_common::Backend::Cuda, cuda, true);
    c.structured_output = krasis_server::structured_output_caps();
    c
}

/// Loads the CUDA driver library dynamically (cudarc) and counts devices, so a
/// machine without a driver or GPU gets a reason instead of a crash.
fn cuda_availability() -> Result<(), String> {
    // SAFETY: only tries to dlopen the driver library; no CUDA call is made
    // unless it loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("the NVIDIA CUDA driver library (libcuda) was not found; install the NVIDIA driver to use the GPU".into());
    }
    cudarc::driver::result::init()
        .map_err(|e| format!("the CUDA driver failed to initialise: {e}"))?;
    let n = cudarc::driver::result::device::get_count()
        .map_err(|e| format!("could not count CUDA devices: {e}"))?;
    if n == 0 {
        return Err("the CUDA driver reports no GPU".into());
    }
    Ok(())
}

fn human(c: &Capabilities) -> String {
    let mut s = format!(
        "krasis-runtime {} (protocol {})\nbackends:\n",
        c.runtime_version, c.protocol_version
    );
    for b in &c.backends {
        match &b.reason {
            None => s += &format!("  {:<10} available", b.name),
            Some(r) => s += &format!("  {:<10} unavailable: {r}", b.name),
        }
        s += &format!(
            " (up to {} parallel request(s){})\n",
            b.max_parallel,
            if b.kv_tokens { ", --kv-tokens" } else { "" }
        );
    }
    let so = &c.structured_output;
    // An empty list says "none" rather than nothing.
    let list = |v: &[String]| match v.is_empty() {
        true => "none".to_string(),
        false => v.join(", "),
    };
    s += &format!(
        "structured output (both backends):\n  response_format: {}\n  tool calls constrained: {}\n  tool calls constrained when forced (auto parsed as written): {}\n  tool calls parsed as written: {}\n",
        list(&so.response_formats),
        list(&so.constrained_tool_grammars),
        list(&so.forced_only_tool_grammars),
        list(&so.parsed_tool_grammars)
    );
    s += "architectures:\n";
    for a in &c.architectures {
        s += &format!(
            "  {} ({})\n    backends: {}\n    experts: {}\n    attention: {}\n    kv: {}\n    mlp: {}\n    hcs: {}\n    prefix cache: {}\n    pruning: {}\n    multi-gpu: {}\n",
            a.model_type,
            a.display_name,
            a.backends.join(", "),
            a.expert_precisions.join(", "),
            a.attention_precisions.join(", "),
            a.kv_formats.join(", "),
            a.mlp_precisions.join(", "),
            if a.hcs { "yes (cuda backend)" } else { "no" },
            a.prefix_cache_backends.join(", "),
            a.pruning_modes.join(", "),
            a.multi_gpu_modes.join(", "),
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the report says of the reference backend's batching is what
    /// its engine does.
    #[test]
    fn the_reported_batching_is_the_engines() {
        use krasis_model::Engine;
        let c = report();
        let b = c.backend("reference").unwrap();
        let dir = krasis_model::testutil::tiny_checkpoint("tiny");
        let mut e =
            krasis_model::reference::ReferenceEngine::load(&dir, Default::default()).unwrap();
        assert_eq!(b.max_parallel as usize, e.batch().unwrap().capacity());
        assert!(b.kv_tokens);
        // The CUDA engine's: the most rows its decode kernels take (its
        // GPU tests run that many sequences together).
        let cuda = c.backend("cuda").unwrap();
        assert_eq!(
            cuda.max_parallel as usize,
            krasis_gpu::options::MAX_PARALLEL
        );
        assert!(cuda.kv_tokens);
    }

    #[test]
    fn report_defaults_are_offered_and_validate() {
        let c = report();
        assert!(c.backend("reference").unwrap().available);
        let cuda = c.backend("cuda").unwrap();
        assert_eq!(cuda.available, cuda.reason.is_none());
        let mut o = c.default_options("qwen3_moe").unwrap();
        o.model = "m".into();
        c.check_options(&o, "qwen3_moe").unwrap();
        let json = serde_json::to_string(&c).unwrap();
        let back: Capabilities = serde_json::from_str(&json).unwrap();
        assert_eq!(back, c);
        assert!(human(&c).contains("qwen3_moe"));
    }

    /// Every registered architecture is in the report with the backends
    /// that build it, and with options the report's own check accepts.
    #[test]
    fn report_lists_every_registry_entry_with_its_backends() {
        for cuda in [Ok(()), Err("no GPU".to_string())] {
            let c = of_this_build("test", cuda);
            assert_eq!(c.architectures.len(), registry::ARCHITECTURES.len());
            for arch in registry::ARCHITECTURES {
                let a = c.architecture(arch.model_type).unwrap();
                let want: Vec<&str> = arch.backends.iter().map(|b| b.as_str()).collect();
                assert_eq!(a.backends, want, "{}", arch.model_type);
                for b in &a.backends {
                    assert!(
                        c.backend(b).is_some(),
                        "{}: unknown backend {b}",
                        a.model_type
                    );
                }
                let mut o = c.default_options(arch.model_type).unwrap();
                o.model = "m".into();
                c.check_options(&o, arch.model_type).unwrap();
            }
        }
    }

    /// `common/fixtures/architectures.json` (the report the launcher's and
    /// common's unit tests use in place of a runtime process) is exactly
    /// what the registry reports.
    #[test]
    fn common_fixture_is_the_registry() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../common/fixtures/architectures.json"
        );
        let fixture: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let now = serde_json::to_value(registry::caps()).unwrap();
        assert_eq!(
            fixture,
            now,
            "{path} is stale; regenerate it with\n  krasis-runtime capabilities --json | jq .architectures > common/fixtures/architectures.json\nwhich gives:\n{}",
            serde_json::to_string_pretty(&now).unwrap()
        );
    }
}
