//! Shared by the GPU test binaries `gpu_engine`, `cancel`, `fault_injection` and
//! `live`: the visible skip without a device, tiny synthetic checkpoints, prompts,
//! requests, and the engines over one INT4 cache.

#![allow(dead_code)] // each binary uses a subset

use krasis_gpu::{CudaEngine, CudaEngineOptions};
use krasis_kernels::GpuTestDevice;
use krasis_model::reference::{ReferenceEngine, ReferenceOptions};
use krasis_model::synth::{SynthDtype, SynthOptions, SynthSpec, TokenizerSource, synthesize};
use krasis_model::{Engine, GenerateOutcome, GenerateRequest, SamplingParams};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Written to the process's stderr directly (not `eprintln!`, which the
/// test harness captures), so skips are visible in every test run.
pub fn visible(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Whether to run `name`: `false`,
/// after printing `SKIPPED (no CUDA device): <name> (no NVIDIA driver)`,
/// only on a machine without an NVIDIA driver; with one, a device that
/// cannot be opened panics with the reason.
pub fn gpu_or_skip(name: &str) -> bool {
    match krasis_kernels::gpu_test_device(
        krasis_kernels::nvidia_driver_present(),
        krasis_gpu::probe(),
    ) {
        GpuTestDevice::Run(_) => true,
        GpuTestDevice::Skip => {
            visible(&format!(
                "SKIPPED (no CUDA device): {name} (no NVIDIA driver)"
            ));
            false
        }
        GpuTestDevice::Fail(why) => panic!("{name}: {why}"),
    }
}

/// A synthetic checkpoint without tokenizer files (the tests feed ids),
/// with head_dim 64 (the tiny presets' 32 is below what the attention
/// kernels implement).
pub fn synth(dir: &Path, preset: &str) -> PathBuf {
    let ov: Vec<(String, serde_json::Value)> = vec![("head_dim".into(), serde_json::json!(64))];
    let spec = SynthSpec::new(preset, 7, SynthDtype::Bf16, 0.0, &ov).expect("synth spec");
    let mut opts = SynthOptions::new(spec);
    opts.tokenizer = TokenizerSource::None;
    let out = dir.join(preset);
    synthesize(&opts, &out).expect("synthesize");
    out
}

/// `n` pseudo-random ids below `vocab`.
pub fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}

pub fn cuda_options(cache: &Path, context: usize, chunk: usize) -> CudaEngineOptions {
    CudaEngineOptions {
        context_length: Some(context),
        prefill_chunk: chunk,
        cache_root: Some(cache.to_path_buf()),
        ..CudaEngineOptions::default()
    }
}

/// `cuda_options` with HCS forced on and nothing resident: a safety margin
/// larger than any GPU leaves only the reclaimable tier, so prefill streams
/// through the layer groups and every decode lookup outside the prior misses.
pub fn no_resident_options(cache: &Path, context: usize, chunk: usize) -> CudaEngineOptions {
    CudaEngineOptions {
        safety_margin: 1 << 50,
        heatmap: krasis_common::options::HeatmapChoice::Off,
        ..cuda_options(cache, context, chunk)
    }
}

/// A greedy request for `max` tokens with no stop tokens.
pub fn greedy_request(prompt: &[u32], max: usize) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt.to_vec(),
        max_new_tokens: max,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        cancel: Default::default(),
        live: Default::default(),
    }
}

/// Runs `req` to its end: the tokens and the outcome.
pub fn generate_all(e: &mut CudaEngine, req: &GenerateRequest) -> (Vec<u32>, GenerateOutcome) {
    let mut out = Vec::new();
    let o = e
        .generate(req, &mut |t| {
            out.push(t);
            ControlFlow::Continue(())
        })
        .expect("generate");
    (out, o)
}

pub fn cuda(model: &Path, opts: &CudaEngineOptions) -> CudaEngine {
    CudaEngine::load(model, opts).expect("load CUDA engine")
}

/// The CPU reference engine over the same INT4 cache as the CUDA engine.
pub fn reference(model: &Path, cache: &Path, context: usize) -> ReferenceEngine {
    let c = krasis_cache::ensure_cache(model, Some(cache)).expect("INT4 cache");
    let experts = Arc::new(krasis_cache::CacheExperts::new(Arc::new(c)));
    ReferenceEngine::with_experts(
        model,
        ReferenceOptions {
            context_length: Some(context),
        },
        experts,
    )
    .expect("reference engine")
}

/// The logit bound of the GPU check (as `tests/gpu_engine.rs`): 3% of the
/// largest reference logit.
pub fn bound(r: &[Vec<f32>]) -> f32 {
    0.03 * r.iter().flatten().fold(1f32, |m, v| m.max(v.abs()))
}
