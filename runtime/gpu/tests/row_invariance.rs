//! Chunk-boundary invariance of the CUDA prefill, which lets the prefix
//! cache's blocks be smaller than the prefill chunk (`blas.rs` module doc,
//! the "Chunk invariance" header of `kernels/cuda/attention_prefill.cu`,
//! `moe::routed_experts`):
//! - every GEMM shape the engine runs (Qwen3-30B-A3B BF16, GLM-4.5-Air's
//!   FP16 MLP block): row `r` of an `M`-row GEMM is bit-identical to the
//!   1-row GEMM of that row, for `M = 1..=300` and sampled rows of
//!   `M` up to a full default chunk (8192) at odd starts;
//! - qwen3_moe and glm4_moe tiny models, all resident and under HCS with
//!   streamed prefill: a prompt prefilled in one chunk and in chunks of 37,
//!   64 and 100 tokens (starts that are not multiples of the 64-row tiles)
//!   gives bit-identical logits at every position, KV and greedy decode;
//! - the same at head_dim 128 (qwen3_moe, all resident and streamed), where
//!   a Hopper device runs the wgmma prefill attention
//!   (`krasis_gpu::prefill_kernels`; asserted chosen on compute capability
//!   9.0), whose 128-key tiles the chunk starts cut too;
//! - the planted per-shape GEMM choice (cuBLAS's `CUBLAS_GEMM_DEFAULT`,
//!   what the engine ran before) is caught by the GEMM test on the real
//!   shapes. Whether it is also caught on the tiny models (whose small K
//!   rarely makes cuBLAS split K) is printed, not asserted.
//!
//! On a machine without an NVIDIA driver every test prints
//! `SKIPPED (no CUDA device): <name> (no NVIDIA driver)`.

mod support;

use half::{bf16, f16};
use krasis_gpu::blas::{DENSE_REF_ROWS, Gemm, InType, OutType, Selection, expert_ref_rows, gemm};
use krasis_gpu::prefill_kernels::Family;
use krasis_gpu::{CudaEngine, CudaEngineOptions, Gpu};
use krasis_model::Engine;
use krasis_model::synth::preset_geometry;
use std::path::Path;
use support::{bits, cuda_options, gpu_or_skip, load, no_resident_options, synth_head_dim, tokens};

/// Rows of the largest GEMM compared.
const MAX_ROWS: usize = 300;

/// One GEMM site of the engine: (label, n, k, input, output, beta,
/// reference rows).
type Site = (String, usize, usize, InType, OutType, f32, usize);

/// The engine's prefill GEMM sites for a preset (the LM head, which only
/// `prompt_logits` runs as a GEMM, is left out for its size).
fn sites(preset: &str) -> Vec<Site> {
    let g = preset_geometry(preset).expect("preset");
    let mlp_in = match g.mlp.activations {
        krasis_model::arch::ActFormat::Bf16 => InType::Bf16,
        krasis_model::arch::ActFormat::F16 => InType::F16,
    };
    let mlp_out16 = match mlp_in {
        InType::Bf16 => OutType::Bf16,
        InType::F16 => OutType::F16,
    };
    let (h, q, kv) = (g.hidden, g.q_dim(), g.kv_dim());
    let qkv_out = if g.attention.qkv_bias {
        OutType::F32
    } else {
        OutType::Bf16
    };
    let er = expert_ref_rows(g.top_k, g.num_experts);
    let i = g.expert_intermediate;
    let mut s = vec![
        (
            "qkv".into(),
            q + 2 * kv,
            h,
            InType::Bf16,
            qkv_out,
            0.0,
            DENSE_REF_ROWS,
        ),
        (
            "o_proj".into(),
            h,
            q,
            InType::Bf16,
            OutType::F32,
            1.0,
            DENSE_REF_ROWS,
        ),
        (
            "router".into(),
            g.num_experts,
            h,
            mlp_in,
            OutType::F32,
            0.0,
            DENSE_REF_ROWS,
        ),
        (
            "expert gate/up".into(),
            2 * i,
            h,
            mlp_in,
            mlp_out16,
            0.0,
            er,
        ),
        ("expert down".into(), h, i, mlp_in, OutType::F32, 0.0, er),
    ];
    if let Some(si) = g.shared_intermediate {
        s.push((
            "shared gate/up".into(),
            2 * si,
            h,
            mlp_in,
            mlp_out16,
            0.0,
            DENSE_REF_ROWS,
        ));
        s.push((
            "shared down".into(),
            h,
            si,
            mlp_in,
            OutType::F32,
            1.0,
            DENSE_REF_ROWS,
        ));
    }
    s.into_iter()
        .map(|(l, n, k, i, o, b, r): (String, _, _, _, _, _, _)| {
            (format!("{preset} {l}"), n, k, i, o, b, r)
        })
        .collect()
}

fn elem_bytes(o: OutType) -> usize {
    match o {
        OutType::F32 => 4,
        _ => 2,
    }
}

/// Random 16-bit values of `t` (bf16 or f16 bits), std ~0.5.
fn random16(n: usize, t: InType, seed: u64) -> Vec<u16> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let v = ((s >> 11) as f64 / (1u64 << 53) as f64 - 0.5) as f32;
            match t {
                InType::Bf16 => bf16::from_f32(v).to_bits(),
                InType::F16 => f16::from_f32(v).to_bits(),
            }
        })
        .collect()
}

/// Row counts past [`MAX_ROWS`] checked on sampled rows (with the first
/// row at these offsets): the reference rows of the sites and a full
/// default prefill chunk, a chunk's share at odd starts.
const BIG: [(usize, usize); 5] = [(0, 512), (37, 1000), (0, 4096), (5, 4097), (0, 8192)];

/// Rows of X and Y the test's buffers hold.
const ROWS: usize = 8192 + 64;

/// For each site: the bytes of every row of every `M`-row GEMM
/// (`M = 1..=MAX_ROWS`, first row 0) and of sampled rows of the [`BIG`]
/// GEMMs against the 1-row GEMM of that row (X and Y at the same row, so
/// beta 1 adds into the same Y values); returns the (site, M, first
/// differing row) triples.
fn rows_that_differ(gpu: &Gpu, sites: &[Site]) -> Vec<(String, usize, usize)> {
    let mut bad = Vec::new();
    for (label, n, k, input, out, beta, ref_rows) in sites {
        let (n, k) = (*n, *k);
        let x = gpu.upload(&random16(ROWS * k, *input, 11), "x").expect("x");
        let w = gpu.upload(&random16(n * k, *input, 13), "w").expect("w");
        let eb = elem_bytes(*out);
        let row = n * eb;
        // Y starts from the same values for every call (beta 1 adds into
        // them): row r's initial bytes depend on r only.
        let init: Vec<u8> = (0..ROWS * row).map(|i| (i % 61) as u8 & 0x3f).collect();
        let mut y = gpu.upload(&init, "y").expect("y");
        let xa = krasis_gpu::device::addr(&x, &gpu.stream);
        let wa = krasis_gpu::device::addr(&w, &gpu.stream);
        let ya = krasis_gpu::device::addr(&y, &gpu.stream);
        // Runs rows [first, first + m) and returns the bytes of `check`
        // (absolute row indices).
        let mut run = |first: usize, m: usize, check: &[usize]| -> Vec<Vec<u8>> {
            let span = first * row..(first + m) * row;
            gpu.stream
                .memcpy_htod(&init[span.clone()], &mut y.slice_mut(span))
                .expect("reset y");
            let g = Gemm {
                m,
                n,
                k,
                x: xa + (first * k * 2) as u64,
                w: wa,
                y: ya + (first * row) as u64,
                input: *input,
                out: *out,
                beta: *beta,
                ref_rows: *ref_rows,
            };
            gemm(&gpu.blas, &g, label).expect("gemm");
            check
                .iter()
                .map(|&r| {
                    let mut h = vec![0u8; row];
                    gpu.stream
                        .memcpy_dtoh(&y.slice(r * row..(r + 1) * row), &mut h)
                        .expect("download");
                    h
                })
                .collect()
        };
        let ones: Vec<Vec<u8>> = (0..MAX_ROWS).map(|r| run(r, 1, &[r]).remove(0)).collect();
        for m in 1..=MAX_ROWS {
            let rows: Vec<usize> = (0..m).collect();
            let got = run(0, m, &rows);
            if let Some(r) = (0..m).find(|&r| got[r] != ones[r]) {
                bad.push((label.clone(), m, r));
            }
        }
        for (first, m) in BIG {
            let mut rows: Vec<usize> = [
                0,
                1,
                2,
                63,
                64,
                127,
                128,
                255,
                256,
                511,
                m / 2,
                m - 2,
                m - 1,
            ]
            .iter()
            .chain((0..m).step_by(97).collect::<Vec<_>>().iter())
            .filter(|&&r| r < m)
            .map(|&r| first + r)
            .collect();
            rows.sort_unstable();
            rows.dedup();
            let got = run(first, m, &rows);
            if let Some(i) = (0..rows.len()).find(|&i| got[i] != run(rows[i], 1, &[rows[i]])[0]) {
                bad.push((label.clone(), m, rows[i] - first));
            }
        }
    }
    bad
}

#[test]
fn gemm_rows_are_invariant_to_the_row_count() {
    if !gpu_or_skip("gemm_rows_are_invariant_to_the_row_count") {
        return;
    }
    let gpu = Gpu::open(0).expect("open");
    let mut all = sites("a3b");
    all.extend(sites("glm-4.5-air"));
    let bad = rows_that_differ(&gpu, &all);
    assert!(
        bad.is_empty(),
        "{} (site, M) pairs where row r of an M-row GEMM differs from the 1-row GEMM, e.g. {:?}",
        bad.len(),
        &bad[..bad.len().min(10)]
    );
    // The planted fault: cuBLAS choosing per shape.
    gpu.blas.set_selection(Selection::PerShape);
    let bad = rows_that_differ(&gpu, &all);
    gpu.blas.set_selection(Selection::Fixed);
    eprintln!(
        "per-shape choice: {} (site, M) pairs differ; sites: {:?}",
        bad.len(),
        bad.iter()
            .map(|b| b.0.as_str())
            .collect::<std::collections::BTreeSet<_>>()
    );
    assert!(
        !bad.is_empty(),
        "the planted per-shape GEMM choice (cuBLAS's CUBLAS_GEMM_DEFAULT) gave row-invariant \
         results on every shape here, so this test has not shown it can catch that bug"
    );
}

const CONTEXT: usize = 1024;
/// Prefill chunks compared (the first holds the whole prompt).
const CHUNKS: [usize; 4] = [512, 37, 64, 100];
const PROMPT: usize = 300;

/// Prompt logits at every position, KV and 6 greedy tokens' logits of one
/// engine.
struct Run {
    logits: Vec<u32>,
    kv: Vec<u16>,
    greedy: Vec<u32>,
}

fn run(e: &mut CudaEngine, prompt: &[u32]) -> Run {
    let logits = bits(&e.prompt_logits(prompt).expect("prompt logits"));
    let kv = e.kv_bits(prompt.len()).expect("kv");
    let (_, g) = e.greedy_logits(prompt, 6).expect("greedy");
    Run {
        logits,
        kv,
        greedy: bits(&g),
    }
}

/// Loads `model` with each of [`CHUNKS`] (`opts` gives the rest) and
/// returns, per chunk, the run of one prompt; with `planted`, under the
/// per-shape GEMM choice.
fn runs(model: &Path, opts: &dyn Fn(usize) -> CudaEngineOptions, planted: bool) -> Vec<Run> {
    CHUNKS
        .iter()
        .map(|&c| {
            let mut e = load(model, &opts(c));
            assert_eq!(e.load_report().prefill_chunk, c);
            // Hopper always takes its own attention kernel; it serves the
            // bf16 head_dim 128 models (prefill_kernels.rs).
            if e.gpu().info.compute_capability == (9, 0) {
                assert_eq!(e.prefill_kernels().attention, Family::Hopper);
            }
            if planted {
                e.set_gemm_selection(Selection::PerShape);
            }
            let prompt = tokens(PROMPT, e.info().vocab_size, 5);
            run(&mut e, &prompt)
        })
        .collect()
}

fn first_diff<T: PartialEq>(a: &[T], b: &[T]) -> Option<usize> {
    (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i))
}

fn chunk_invariant(what: &str, preset: &str, head_dim: usize, streamed: bool) {
    if !gpu_or_skip(what) {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = synth_head_dim(tmp.path(), preset, head_dim);
    let cache = tmp.path().join("cache");
    let opts = |c: usize| {
        if streamed {
            no_resident_options(&cache, CONTEXT, c)
        } else {
            CudaEngineOptions {
                hcs: false,
                ..cuda_options(&cache, CONTEXT, c)
            }
        }
    };
    let r = runs(&model, &opts, false);
    for (i, c) in CHUNKS.iter().enumerate().skip(1) {
        let vocab = r[0].logits.len() / PROMPT;
        assert!(
            first_diff(&r[0].logits, &r[i].logits).is_none(),
            "{what}: chunks of {c}: prompt logits differ from one chunk first at position {:?}",
            first_diff(&r[0].logits, &r[i].logits).map(|p| p / vocab)
        );
        assert!(
            first_diff(&r[0].kv, &r[i].kv).is_none(),
            "{what}: chunks of {c}: KV differs from one chunk (element {:?})",
            first_diff(&r[0].kv, &r[i].kv)
        );
        assert!(
            r[0].greedy == r[i].greedy,
            "{what}: chunks of {c}: greedy decode logits differ"
        );
    }
    // The planted per-shape choice: reported (tiny shapes may not make
    // cuBLAS change kernels with the row count).
    let p = runs(&model, &opts, true);
    let caught = CHUNKS
        .iter()
        .enumerate()
        .skip(1)
        .filter(|&(i, _)| p[0].logits != p[i].logits || p[0].kv != p[i].kv)
        .map(|(_, c)| *c)
        .collect::<Vec<_>>();
    eprintln!(
        "{what}: with the planted per-shape GEMM choice, chunkings {caught:?} differ from one chunk \
         ({} of {})",
        caught.len(),
        CHUNKS.len() - 1
    );
}

#[test]
fn qwen3_moe_prefill_is_chunk_invariant_all_resident() {
    chunk_invariant(
        "qwen3_moe_prefill_is_chunk_invariant_all_resident",
        "tiny",
        64,
        false,
    );
}

#[test]
fn qwen3_moe_prefill_is_chunk_invariant_streamed() {
    chunk_invariant(
        "qwen3_moe_prefill_is_chunk_invariant_streamed",
        "tiny",
        64,
        true,
    );
}

#[test]
fn glm4_moe_prefill_is_chunk_invariant_all_resident() {
    chunk_invariant(
        "glm4_moe_prefill_is_chunk_invariant_all_resident",
        "tiny-glm4-moe",
        64,
        false,
    );
}

#[test]
fn glm4_moe_prefill_is_chunk_invariant_streamed() {
    chunk_invariant(
        "glm4_moe_prefill_is_chunk_invariant_streamed",
        "tiny-glm4-moe",
        64,
        true,
    );
}

#[test]
fn qwen3_moe_hd128_prefill_is_chunk_invariant_all_resident() {
    chunk_invariant(
        "qwen3_moe_hd128_prefill_is_chunk_invariant_all_resident",
        "tiny",
        128,
        false,
    );
}

#[test]
fn qwen3_moe_hd128_prefill_is_chunk_invariant_streamed() {
    chunk_invariant(
        "qwen3_moe_hd128_prefill_is_chunk_invariant_streamed",
        "tiny",
        128,
        true,
    );
}
