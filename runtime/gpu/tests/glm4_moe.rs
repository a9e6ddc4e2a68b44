//! The CUDA engine builds glm4_moe from its description: `tiny-glm4-moe`
//! (`krasis_model::testutil::tiny_glm4_moe_checkpoint`: partial rotary 0.5
//! with q/k norms, q/k/v biases, a dense first layer, 8 experts in 4
//! groups keeping 2, top-2 by sigmoid scores plus the F32 selection bias,
//! routed scaling 2.5, one shared expert, an MTP layer on disk; head_dim
//! 64), and the same without q/k norms (GLM-4.5-Air's attention: the
//! partial rotary from the table alone), against the CPU reference engine
//! over the same INT4 expert cache, under the criterion of `bench --check`
//! (`check::followed`: the f32 reference takes the GPU's experts at its
//! own router near-ties, measured on the choice scores, then every
//! position must be within 1% of the largest logit).
//!
//! Its MLP block runs in FP16 (`MlpSpec::activations`): the post-attention
//! norm's output, the router, dense and shared-expert weights, the routed
//! experts' f16 GEMVs and dequantized weights, gate/up and SwiGLU.
//!
//! Every planted bug that applies (`Fault::applicable`: RoPE sign on the
//! rotated part, swapped GQA heads, a dropped expert, the selection bias
//! ignored, the shared expert skipped) must fail the criterion. HCS decode
//! and streamed prefill must be bit-identical to all resident. On a
//! machine without an NVIDIA driver every test prints `SKIPPED (no CUDA
//! device): <name> (no NVIDIA driver)`.

mod support;

use krasis_gpu::CudaEngine;
use krasis_gpu::check::{FidelityReport, pooled};
use krasis_gpu::forward::Fault;
use krasis_model::reference::ReferenceEngine;
use krasis_model::{Engine, ModelConfig};
use std::path::PathBuf;
use support::{
    assert_hcs_bit_identical, bits, check_followed, cuda_options, gpu_or_skip, load, reference,
    tokens,
};

const CONTEXT: usize = 512;

/// tiny-glm4-moe with q/k norms (`qk_norm`) or without (GLM-4.5-Air's).
fn model(qk_norm: bool) -> PathBuf {
    let dir = krasis_model::testutil::tiny_checkpoint_with(
        "tiny-glm4-moe",
        &[("use_qk_norm", serde_json::json!(qk_norm))],
    );
    let g = ModelConfig::load(&dir).expect("config").geometry();
    // What these tests are about: the components glm4_moe brought.
    assert!(g.rope.rotary_dim.is_some_and(|r| r < g.head_dim));
    assert!(g.router.selection_bias && g.shared_intermediate.is_some());
    assert!(g.num_moe_layers() < g.num_layers, "a dense first layer");
    assert_eq!(g.attention.qk_norm, qk_norm);
    assert_eq!(g.head_dim, 64);
    // The FP16 MLP block (and the reference's emulation of it), BF16
    // attention.
    assert_eq!(g.mlp.activations, krasis_model::arch::ActFormat::F16);
    assert_eq!(g.attention.activations, krasis_model::arch::ActFormat::Bf16);
    dir
}

/// Prompts of 5 (expert GEMVs), 100 and 300 tokens (grouped experts over
/// 37-token chunks), judged pooled.
fn prompts_report(label: &str, gpu: &mut CudaEngine, r: &mut ReferenceEngine) -> FidelityReport {
    let vocab = r.info().vocab_size;
    let mut reps = Vec::new();
    for (n, seed) in [(5usize, 1u64), (100, 2), (300, 3)] {
        let toks = tokens(n, vocab, seed);
        let (g, routes) = gpu.prompt_logits_with_routes(&toks).expect("gpu logits");
        reps.push(check_followed(
            &format!("{label}, {n} tokens"),
            r,
            &toks,
            0,
            &g,
            &routes,
        ));
    }
    let all = pooled(&format!("{label}, pooled"), &mut reps);
    eprintln!("{}", all.line());
    all
}

#[test]
fn glm4_moe_prompt_logits_match_reference() {
    if !gpu_or_skip("glm4_moe_prompt_logits_match_reference") {
        return;
    }
    for qk_norm in [true, false] {
        let model = model(qk_norm);
        let tmp = tempfile::tempdir().unwrap();
        let cache = tmp.path().join("cache");
        let mut gpu = load(&model, &cuda_options(&cache, CONTEXT, 37));
        assert!(!gpu.hcs_active(), "the tiny model's experts all fit");
        let mut r = reference(&model, &cache, CONTEXT);
        let rep = prompts_report(
            &format!("tiny-glm4-moe qk_norm={qk_norm}"),
            &mut gpu,
            &mut r,
        );
        assert!(rep.passed(), "{}", rep.line());
    }
}

/// Greedy decode (the router, shared expert and dense-layer GEMVs, the
/// partial rotary at a device position) against the reference over the
/// same tokens.
#[test]
fn glm4_moe_greedy_decode_matches_reference() {
    if !gpu_or_skip("glm4_moe_greedy_decode_matches_reference") {
        return;
    }
    for qk_norm in [true, false] {
        let model = model(qk_norm);
        let tmp = tempfile::tempdir().unwrap();
        let cache = tmp.path().join("cache");
        let mut gpu = load(&model, &cuda_options(&cache, CONTEXT, 37));
        let mut r = reference(&model, &cache, CONTEXT);
        let prompt = tokens(30, r.info().vocab_size, 11);
        let n = 40;
        let (toks, rows, routes) = gpu.greedy_logits_with_routes(&prompt, n).expect("greedy");
        let mut seq = prompt.clone();
        seq.extend_from_slice(&toks[..n - 1]);
        let rep = check_followed(
            &format!("tiny-glm4-moe qk_norm={qk_norm} greedy decode"),
            &mut r,
            &seq,
            prompt.len() - 1,
            &rows,
            &routes,
        );
        assert!(rep.passed(), "{}", rep.line());
    }
}

/// Decode as one CUDA graph per step gives the bits of eager decode.
#[test]
fn glm4_moe_decode_graphs_equal_eager() {
    if !gpu_or_skip("glm4_moe_decode_graphs_equal_eager") {
        return;
    }
    let model = model(true);
    let tmp = tempfile::tempdir().unwrap();
    let mut gpu = load(
        &model,
        &cuda_options(&tmp.path().join("cache"), CONTEXT, 64),
    );
    let prompt = tokens(20, gpu.info().vocab_size, 9);
    let (graphs, graph_rows) = gpu.greedy_logits(&prompt, 40).expect("graphs");
    gpu.set_cuda_graphs(false);
    let (eager, eager_rows) = gpu.greedy_logits(&prompt, 40).expect("eager");
    assert_eq!(graphs, eager, "CUDA-graph decode differs from eager decode");
    assert!(
        bits(&graph_rows) == bits(&eager_rows),
        "decode logits differ between graphs and eager"
    );
}

/// With HCS forced on and nothing resident (streamed prefill through the
/// layer groups, every decode expert demand-copied), prompt logits, greedy
/// tokens and decode logits are bit-identical to all-resident; so is a
/// prompt streamed one chunk per span. The shared expert and dense layer
/// are resident weights either way.
#[test]
fn glm4_moe_hcs_and_streamed_prefill_are_bit_identical() {
    if !gpu_or_skip("glm4_moe_hcs_and_streamed_prefill_are_bit_identical") {
        return;
    }
    for qk_norm in [true, false] {
        let tmp = tempfile::tempdir().unwrap();
        assert_hcs_bit_identical(
            &format!("qk_norm={qk_norm}"),
            &model(qk_norm),
            &tmp.path().join("cache"),
            CONTEXT,
            37,
        );
    }
}

/// The load uploads what the plan sized: the shared experts, the dense
/// layer, the selection biases and the partial rotary's table.
#[test]
fn glm4_moe_weights_are_uploaded_as_planned() {
    if !gpu_or_skip("glm4_moe_weights_are_uploaded_as_planned") {
        return;
    }
    for qk_norm in [true, false] {
        let model = model(qk_norm);
        let tmp = tempfile::tempdir().unwrap();
        let gpu = load(
            &model,
            &cuda_options(&tmp.path().join("cache"), CONTEXT, 37),
        );
        let g = gpu.geometry().clone();
        assert_eq!(
            gpu.load_report().weight_bytes,
            krasis_gpu::weights::weight_bytes(&g).device,
            "qk_norm={qk_norm}"
        );
    }
}

/// The criterion can fail on glm4_moe: the engine with each planted bug
/// that applies (the selection bias ignored and the shared expert skipped
/// among them) fails it, and passes again with the bug removed.
#[test]
fn glm4_moe_check_fails_with_each_planted_bug() {
    if !gpu_or_skip("glm4_moe_check_fails_with_each_planted_bug") {
        return;
    }
    let model = model(true);
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let mut gpu = load(&model, &cuda_options(&cache, CONTEXT, 37));
    let mut r = reference(&model, &cache, CONTEXT);
    let faults = Fault::applicable(gpu.geometry());
    for f in [
        Fault::RopeSign,
        Fault::SwapGqa,
        Fault::DropExpert,
        Fault::IgnoreSelectionBias,
        Fault::NoSharedExpert,
    ] {
        assert!(faults.contains(&f), "{f:?} does not apply to tiny-glm4-moe");
    }
    for f in faults {
        gpu.set_fault(f).expect("plant");
        let rep = prompts_report(&format!("tiny-glm4-moe with {f:?}"), &mut gpu, &mut r);
        assert!(!rep.passed(), "{f:?} passed the check: {}", rep.line());
    }
    gpu.set_fault(Fault::None).expect("remove");
    let rep = prompts_report("tiny-glm4-moe without a fault", &mut gpu, &mut r);
    assert!(rep.passed(), "{}", rep.line());
}
