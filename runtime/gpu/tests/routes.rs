//! The route recording `bench --check` classifies logit differences with:
//! `CudaEngine::prompt_logits_with_routes` and `greedy_logits_with_routes`
//! return the logits and tokens of the normal paths bit for bit, cover
//! every position of every MoE layer, and select (nearly always) the
//! experts the CPU reference selects.
//!
//! On a machine without an NVIDIA driver each test prints `SKIPPED (no
//! CUDA device): <name> (no NVIDIA driver)`.

mod support;

use krasis_gpu::check::{Evidence, Routes, classify_full, routes_from_trace, same_experts};
use krasis_model::Engine;
use krasis_model::reference::Activations;
use support::{cuda, cuda_options, gpu_or_skip, reference, synth, tokens};

fn agreement(a: &Routes, b: &Routes) -> f64 {
    let (mut same, mut all) = (0usize, 0usize);
    for (la, lb) in a.iter().zip(b) {
        for (x, y) in la.iter().zip(lb) {
            all += 1;
            same += usize::from(same_experts(&x.experts, &y.experts));
        }
    }
    same as f64 / all.max(1) as f64
}

#[test]
fn recorded_routes_cover_every_position_and_change_nothing() {
    if !gpu_or_skip("recorded_routes_cover_every_position_and_change_nothing") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny");
    let cache = tmp.path().join("cache");
    // Chunks of 37: several grouped-path chunks and a GEMV-path tail.
    let mut gpu = cuda(&model, &cuda_options(&cache, 512, 37));
    let g = gpu.geometry().clone();
    let moe: Vec<usize> = g.moe_layers().collect();
    let toks = tokens(150, g.vocab_size, 3);

    let plain = gpu.prompt_logits(&toks).unwrap();
    let (logits, routes) = gpu.prompt_logits_with_routes(&toks).unwrap();
    assert!(logits == plain, "recording routes changed the logits");
    assert_eq!(routes.len(), moe.len());
    for rows in &routes {
        assert_eq!(rows.len(), toks.len());
        for r in rows {
            assert_eq!(r.experts.len(), g.top_k);
            assert!(r.experts.iter().all(|&e| (e as usize) < g.num_experts));
            assert!(r.gap >= 0.0, "{r:?}");
        }
    }

    // Against the reference: f32 routes and the BF16 emulation's.
    let mut r = reference(&model, &cache, 512);
    let (rf, tf) = r.prompt_logits_traced(&toks).unwrap();
    r.set_activations(Activations::Bf16);
    let (_, tb) = r.prompt_logits_traced(&toks).unwrap();
    let (f32_routes, bf16_routes) = (routes_from_trace(&tf, &moe), routes_from_trace(&tb, &moe));
    let vs_f32 = agreement(&routes, &f32_routes);
    let vs_bf16 = agreement(&routes, &bf16_routes);
    let rep = classify_full(
        "tiny 150 random tokens",
        &logits,
        &rf,
        &moe,
        Evidence::F32 {
            oracle: &f32_routes,
            emulation: &bf16_routes,
            engine: &routes,
            emulation_err: None,
        },
    );
    eprintln!("route agreement: {vs_f32:.4} with f32, {vs_bf16:.4} with the BF16 emulation");
    eprintln!("{}", rep.line());
    assert!(vs_f32 >= 0.95 && vs_bf16 >= 0.95, "{vs_f32} {vs_bf16}");

    // Decode: the same tokens and logits as greedy_logits, prompt routes as
    // prefill's, and every decode position covered.
    gpu.set_cuda_graphs(false);
    let prompt = &toks[..20];
    let (want_toks, want_rows) = gpu.greedy_logits(prompt, 30).unwrap();
    let (dec_toks, dec_rows, dec_routes) = gpu.greedy_logits_with_routes(prompt, 30).unwrap();
    assert_eq!(dec_toks, want_toks);
    assert!(
        dec_rows == want_rows,
        "recording routes changed decode logits"
    );
    let (_, prompt_routes) = gpu.prompt_logits_with_routes(prompt).unwrap();
    for (d, p) in dec_routes.iter().zip(&prompt_routes) {
        assert_eq!(d.len(), 20 + 29);
        assert_eq!(
            &d[..20],
            &p[..],
            "prompt routes of greedy_logits_with_routes"
        );
    }
    let mut seq = prompt.to_vec();
    seq.extend_from_slice(&dec_toks[..29]);
    let (_, seq_routes) = gpu.prompt_logits_with_routes(&seq).unwrap();
    let a = agreement(&dec_routes, &seq_routes);
    eprintln!("decode vs prefill route agreement: {a:.4}");
    assert!(a >= 0.95, "{a}");
    // Graphs back on: plain decode still runs and matches.
    gpu.set_cuda_graphs(true);
    let (graph_toks, _) = gpu.greedy_logits(prompt, 30).unwrap();
    assert_eq!(graph_toks, want_toks);
}
