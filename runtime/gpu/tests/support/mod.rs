//! Shared by the GPU test binaries `gpu_engine`, `cancel`, `fault_injection`,
//! `live`, `gpt_oss` and `glm4_moe`: the visible skip without a device, tiny
//! synthetic checkpoints, prompts, requests, the engines over one INT4 cache,
//! the check against the reference following the engine's near-ties, and the
//! HCS / streamed-prefill bit-identity every family must show.

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
    synth_head_dim(dir, preset, 64)
}

/// [`synth`] with another head_dim (128: the Hopper prefill attention's).
pub fn synth_head_dim(dir: &Path, preset: &str, head_dim: usize) -> PathBuf {
    let ov: Vec<(String, serde_json::Value)> =
        vec![("head_dim".into(), serde_json::json!(head_dim))];
    let spec = SynthSpec::new(preset, 7, SynthDtype::Bf16, 0.0, &ov).expect("synth spec");
    let mut opts = SynthOptions::new(spec);
    opts.tokenizer = TokenizerSource::None;
    let out = dir.join(format!("{preset}-hd{head_dim}"));
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
        cache_prompt: false,
        constraint: None,
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

/// [`cuda`], printing the load report (kept in a failing test's output).
pub fn load(model: &Path, opts: &CudaEngineOptions) -> CudaEngine {
    let e = cuda(model, opts);
    eprintln!("loaded: {:?}", e.load_report());
    e
}

/// The logits' bit patterns, for bit-identity assertions.
pub fn bits(rows: &[Vec<f32>]) -> Vec<u32> {
    rows.iter().flatten().map(|v| v.to_bits()).collect()
}

/// The GPU's logits of `seq` positions `from..` (and its routes over all of
/// `seq`) against the reference following its near-ties.
pub fn check_followed(
    label: &str,
    reference: &mut ReferenceEngine,
    seq: &[u32],
    from: usize,
    gpu: &[Vec<f32>],
    routes: &krasis_gpu::check::Routes,
) -> krasis_gpu::check::FidelityReport {
    use krasis_gpu::check::{Following, Traced, classify_followed_full, routes_window};
    let moe: Vec<usize> = reference.geometry().moe_layers().collect();
    let traced = Traced::new(reference, seq, &moe).expect("traced reference");
    let f = Following::after(reference, &traced, seq, &moe, routes).expect("following reference");
    let f = f.window(from..seq.len());
    let window = routes_window(routes, from..seq.len());
    let rep = classify_followed_full(label, gpu, &window, &f, &moe);
    eprintln!("{}", rep.line());
    rep
}

/// With HCS forced on and nothing resident (streamed prefill through the
/// layer groups, every decode expert demand-copied), prompt logits, greedy
/// tokens and decode logits are bit-identical to all-resident; so is a
/// prompt streamed one chunk per span. Returns the HCS engine.
pub fn assert_hcs_bit_identical(
    what: &str,
    model: &Path,
    cache: &Path,
    context: usize,
    chunk: usize,
) -> CudaEngine {
    let all = CudaEngineOptions {
        hcs: false,
        ..cuda_options(cache, context, chunk)
    };
    let mut resident = load(model, &all);
    let toks = tokens(300, resident.info().vocab_size, 21);
    let base_prompt = resident.prompt_logits(&toks).expect("resident prompt");
    let (base_tokens, base_decode) = resident.greedy_logits(&toks[..100], 32).expect("greedy");
    drop(resident);

    let mut hcs = load(model, &no_resident_options(cache, context, chunk));
    assert!(hcs.hcs_active(), "{what}: HCS was not forced on");
    let prompt = hcs.prompt_logits(&toks).expect("HCS prompt");
    assert!(
        bits(&prompt) == bits(&base_prompt),
        "{what}: streamed prefill differs from all-resident prefill"
    );
    let (t, decode) = hcs.greedy_logits(&toks[..100], 32).expect("HCS greedy");
    assert_eq!(t, base_tokens, "{what}: HCS greedy tokens");
    assert!(
        bits(&decode) == bits(&base_decode),
        "{what}: HCS decode logits differ from all-resident decode"
    );
    let chunk = hcs.load_report().prefill_chunk;
    hcs.set_prefill_span(Some(chunk));
    let spans = hcs.prompt_logits(&toks).expect("spans");
    assert!(
        bits(&spans) == bits(&base_prompt),
        "{what}: prefill in one-chunk spans differs from all-resident prefill"
    );
    hcs
}
