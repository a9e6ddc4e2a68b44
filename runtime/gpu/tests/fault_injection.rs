//! The GPU check can fail: the CUDA engine with a bug planted in its own
//! setup or launches (`krasis_gpu::forward::Fault`: wrong RoPE sign,
//! swapped GQA heads, a dropped expert) must fail the comparison against
//! the CPU reference (`check::compare_full` + `LogitReport::passed`, the
//! thresholds `tests/gpu_engine.rs` holds the engine to, and the criterion
//! of `bench --check`, `check::classify_followed_full` against the f32
//! reference following the engine's near-tie choices), and pass without one. Each planted GPU bug must also match the same bug planted in the
//! reference engine (`reference::Fault`), which shows it is the bug its
//! name says.
//!
//! On a machine without an NVIDIA driver the GPU tests print `SKIPPED (no
//! CUDA device): <name> (no NVIDIA driver)`;
//! `thresholds_catch_every_fault_on_the_cpu` runs everywhere.

mod support;

use krasis_gpu::CudaEngine;
use krasis_gpu::check::{
    FidelityReport, Following, LogitReport, Traced, classify_followed_full, compare_full, pooled,
    routes_from_trace,
};
use krasis_gpu::forward::Fault;
use krasis_model::Engine;
use krasis_model::reference::{Fault as RefFault, ReferenceEngine};
use support::{bound, cuda, cuda_options, gpu_or_skip, reference, synth, tokens};

/// Prompt lengths checked: 5 tokens take the INT4 GEMV expert path, 100
/// take three 37-token chunks (grouped experts, attention across chunks).
const PROMPTS: [(usize, u64); 2] = [(5, 1), (100, 2)];

fn ref_fault(f: Fault) -> RefFault {
    match f {
        Fault::None => RefFault::None,
        Fault::RopeSign => RefFault::RopeSign,
        Fault::SwapGqa => RefFault::SwapGqa,
        Fault::DropExpert => RefFault::DropExpert,
        Fault::IgnoreSelectionBias => RefFault::IgnoreSelectionBias,
        Fault::NoSharedExpert => RefFault::NoSharedExpert,
        // Batching's faults change nothing a sequence alone computes, and
        // these tests' engines have every expert resident (no tail).
        Fault::SwapRowPositions
        | Fault::ShiftRowKv
        | Fault::SwapRowRings
        | Fault::SkipRingRestore
        | Fault::PackedBase
        | Fault::StaleTail
        | Fault::StalePrefetch
        | Fault::UnmarkedFetch
        | Fault::SkipReload => RefFault::None,
        // A sampler fault: no logit changes.
        Fault::IgnoreMask => RefFault::IgnoreMask,
    }
}

fn compare(label: &str, got: &[Vec<f32>], want: &[Vec<f32>]) -> LogitReport {
    let rep = compare_full(label, got, want, bound(want));
    eprintln!("{}", rep.line());
    rep
}

/// `bench --check`'s criterion over every prompt (pooled, as the witness
/// sequences are): the engine's logits against the fault-free f32
/// reference following its near-tie choices (near-tie width measured by
/// `refs`, the reference's f32 and BF16-emulation runs).
fn criterion(
    label: &str,
    gpu: &mut CudaEngine,
    r: &mut ReferenceEngine,
    refs: &[Traced],
    prompts: &[Vec<u32>],
) -> FidelityReport {
    let moe_layers: Vec<usize> = gpu.geometry().moe_layers().collect();
    let mut parts: Vec<FidelityReport> = prompts
        .iter()
        .zip(refs)
        .map(|(p, t)| {
            let (got, routes) = gpu
                .prompt_logits_with_routes(p)
                .expect("gpu logits and routes");
            let f = Following::after(r, t, p, &moe_layers, &routes).expect("following reference");
            classify_followed_full(
                &format!("{label}, {} tokens", p.len()),
                &got,
                &routes,
                &f,
                &moe_layers,
            )
        })
        .collect();
    let rep = pooled(label, &mut parts);
    eprintln!("{}", rep.line());
    rep
}

fn reference_logits(r: &mut ReferenceEngine, f: RefFault, toks: &[u32]) -> Vec<Vec<f32>> {
    r.set_fault(f);
    r.prompt_logits(toks).expect("reference logits")
}

/// The comparison's thresholds against the reference engine's own planted
/// bugs (no GPU needed): each fault fails the check that the GPU engine is
/// held to, on every prompt length the GPU test uses.
#[test]
fn thresholds_catch_every_fault_on_the_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny");
    let mut r = reference(&model, &tmp.path().join("cache"), 512);
    let vocab = r.info().vocab_size;
    let moe_layers: Vec<usize> = krasis_model::ModelConfig::load(&model)
        .expect("config")
        .geometry()
        .moe_layers()
        .collect();
    for (n, seed) in PROMPTS {
        let toks = tokens(n, vocab, seed);
        let clean = reference_logits(&mut r, RefFault::None, &toks);
        r.set_fault(RefFault::None);
        let traced = Traced::new(&mut r, &toks, &moe_layers).expect("traced reference");
        // The faults that change this model (tiny has no sinks or windows).
        for f in RefFault::applicable(r.geometry()) {
            let bad = reference_logits(&mut r, f, &toks);
            let rep = compare(&format!("reference {f:?} {n} tokens"), &bad, &clean);
            assert!(!rep.passed(), "{f:?} passes the GPU check: {}", rep.line());
            // `bench --check`'s criterion, the faulty engine's own routes
            // standing for the GPU's.
            let (bad, trace) = r
                .prompt_logits_traced(&toks)
                .expect("traced faulty reference");
            let routes = routes_from_trace(&trace, &moe_layers);
            r.set_fault(RefFault::None);
            let follow = Following::after(&mut r, &traced, &toks, &moe_layers, &routes)
                .expect("following reference");
            let rep = classify_followed_full(
                &format!("criterion, reference {f:?} {n} tokens"),
                &bad,
                &routes,
                &follow,
                &moe_layers,
            );
            eprintln!("{}", rep.line());
            assert!(
                rep.unexplained > 0 && !rep.passed(),
                "{f:?} is not caught by the criterion's bug rule: {}",
                rep.line()
            );
        }
    }
}

#[test]
fn gpu_check_fails_on_every_planted_fault() {
    if !gpu_or_skip("gpu_check_fails_on_every_planted_fault") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny");
    let cache = tmp.path().join("cache");
    let mut r = reference(&model, &cache, 512);
    let vocab = r.info().vocab_size;
    let mut gpu = cuda(&model, &cuda_options(&cache, 512, 37));
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|&(n, seed)| tokens(n, vocab, seed))
        .collect();
    let clean: Vec<Vec<Vec<f32>>> = prompts
        .iter()
        .map(|p| reference_logits(&mut r, RefFault::None, p))
        .collect();
    let moe_layers: Vec<usize> = gpu.geometry().moe_layers().collect();
    r.set_fault(RefFault::None);
    let traced: Vec<Traced> = prompts
        .iter()
        .map(|p| Traced::new(&mut r, p, &moe_layers).expect("traced reference"))
        .collect();
    // The correct engine passes the whole criterion: within the bound of
    // the following reference everywhere, few followed decisions.
    let rep = criterion("criterion, no fault", &mut gpu, &mut r, &traced, &prompts);
    assert!(
        rep.passed(),
        "the correct engine fails the criterion: {}",
        rep.line()
    );
    let mut first = Vec::new();
    for (p, want) in prompts.iter().zip(&clean) {
        let got = gpu.prompt_logits(p).expect("gpu logits");
        let rep = compare(&format!("no fault, {} tokens", p.len()), &got, want);
        assert!(rep.passed(), "the correct engine fails: {}", rep.line());
        first.push(got);
    }
    let faults = Fault::applicable(gpu.geometry());
    assert_eq!(faults.len(), 3, "tiny: RoPE sign, GQA swap, dropped expert");
    for f in faults {
        gpu.set_fault(f).expect("planting a fault");
        let rep = criterion(
            &format!("criterion, {f:?}"),
            &mut gpu,
            &mut r,
            &traced,
            &prompts,
        );
        assert!(
            rep.unexplained > 0 && !rep.passed(),
            "{f:?} planted in the CUDA engine is not caught by the criterion's bug rule: {}",
            rep.line()
        );
        for (p, want) in prompts.iter().zip(&clean) {
            let got = gpu.prompt_logits(p).expect("gpu logits");
            let rep = compare(&format!("{f:?} vs correct, {} tokens", p.len()), &got, want);
            assert!(
                !rep.passed(),
                "{f:?} planted in the CUDA engine passes the check: {}",
                rep.line()
            );
            // The same bug in the reference: the GPU fault is what it says.
            let same = reference_logits(&mut r, ref_fault(f), p);
            let rep = compare(
                &format!("{f:?} vs reference {f:?}, {} tokens", p.len()),
                &got,
                &same,
            );
            assert!(
                rep.passed(),
                "{f:?} in the CUDA engine is not the reference's {f:?}: {}",
                rep.line()
            );
        }
    }
    // Removing the fault restores the engine bit for bit.
    gpu.set_fault(Fault::None).expect("removing the fault");
    for (p, want) in prompts.iter().zip(&first) {
        let got = gpu.prompt_logits(p).expect("gpu logits");
        assert!(
            got == *want,
            "{} tokens: logits after Fault::None differ from the engine's before any fault",
            p.len()
        );
    }
}
