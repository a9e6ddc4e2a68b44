//! Throughput of the INT4 quantizer and of whole cache builds.
//!
//! `cargo run --release -p krasis-cache --example quant_bench [-- LAYERS EXPERTS] [--host-modes]`
//!
//! 1. The group kernel on one A3B-sized expert (gate+up+down, 2048x768,
//!    BF16): single thread, and all threads on independent experts.
//! 2. A full build from a synthetic BF16 checkpoint with A3B expert shapes
//!    (LAYERS x EXPERTS, default 4 x 32): from safetensors (mmap), and from
//!    the synthetic generator (experts never written).
//! 3. With `--host-modes` (needs a GPU): both pinned host-backing modes on
//!    the generator-built cache (page cache warm).

use half::bf16;
use krasis_cache::quant::{SourceMatrix, quantize_rows};
use krasis_cache::{BuildOptions, ModelSource, build};
use krasis_model::DType;
use krasis_model::synth::{SynthDtype, SynthOptions, SynthSpec, TokenizerSource, synthesize};
use rayon::prelude::*;
use serde_json::json;
use std::time::Instant;

fn main() {
    let host_modes = std::env::args().any(|a| a == "--host-modes");
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let layers = args.first().copied().unwrap_or(4);
    let experts = args.get(1).copied().unwrap_or(32);
    let (h, i) = (2048usize, 768usize);
    let src: Vec<u8> = (0..3 * h * i)
        .flat_map(|j| bf16::from_f32(((j as f32 * 0.618).sin()) * 0.03).to_le_bytes())
        .collect();
    let quant_one = |q: &mut [u8], s: &mut [u8]| {
        let per = h * i * 2;
        for m in 0..3 {
            let rows = if m == 2 { h } else { i };
            let k = h * i / rows;
            let part = &src[m * per..(m + 1) * per];
            quantize_rows(
                SourceMatrix {
                    dtype: DType::BF16,
                    bytes: part,
                },
                rows,
                k,
                128,
                &mut q[m * h * i / 2..(m + 1) * h * i / 2],
                &mut s[m * h * i / 64..(m + 1) * h * i / 64],
            )
            .unwrap();
        }
    };
    let mut q = vec![0u8; 3 * h * i / 2];
    let mut s = vec![0u8; 3 * h * i / 64];
    quant_one(&mut q, &mut s);
    let reps = 20;
    let t = Instant::now();
    for _ in 0..reps {
        quant_one(&mut q, &mut s);
    }
    let one = (reps * src.len()) as f64 / t.elapsed().as_secs_f64() / 1e9;
    let threads = rayon::current_num_threads();
    let n = threads * 8;
    let t = Instant::now();
    (0..n).into_par_iter().for_each(|_| {
        let mut q = vec![0u8; 3 * h * i / 2];
        let mut s = vec![0u8; 3 * h * i / 64];
        quant_one(&mut q, &mut s);
    });
    let all = (n * src.len()) as f64 / t.elapsed().as_secs_f64() / 1e9;
    println!("kernel: {one:.3} GB/s BF16 source on 1 thread, {all:.3} GB/s on {threads} threads");

    let tmp = tempfile::tempdir().unwrap();
    let overrides = vec![
        ("vocab_size".to_string(), json!(1024)),
        ("num_hidden_layers".to_string(), json!(layers)),
        ("max_window_layers".to_string(), json!(layers)),
        ("num_experts".to_string(), json!(experts)),
    ];
    let spec = SynthSpec::new("a3b", 1, SynthDtype::Bf16, 0.0, &overrides).unwrap();
    for lean in [false, true] {
        let dir = tmp.path().join(if lean { "lean" } else { "full" });
        let mut o = SynthOptions::new(spec.clone());
        o.tokenizer = TokenizerSource::None;
        o.skip_routed_experts = lean;
        let t = Instant::now();
        synthesize(&o, &dir).unwrap();
        let synth_s = t.elapsed().as_secs_f64();
        let source = ModelSource::open(&dir).unwrap();
        let path = tmp.path().join(format!("{lean}.kcache"));
        let r = build(&source, &path, &BuildOptions::default()).unwrap();
        let t = Instant::now();
        let cache =
            krasis_cache::ExpertCache::open(&path, source.config(), source.format()).unwrap();
        let open_s = t.elapsed().as_secs_f64();
        println!(
            "build from {}: {layers} layers x {experts} experts, {:.2} GB source in {:.2} s = {:.3} GB/s on {} threads (synth {synth_s:.1} s); open+checksums {:.3} s ({:.2} GB/s)",
            if lean { "generator" } else { "safetensors" },
            r.source_bytes as f64 / 1e9,
            r.elapsed.as_secs_f64(),
            r.source_gbps(),
            r.threads,
            open_s,
            cache.data().len() as f64 / open_s / 1e9
        );
        if lean && host_modes {
            let reports = krasis_cache::measure_host_modes(
                std::sync::Arc::new(cache),
                0,
                &krasis_cache::HostBacking::ALL,
            )
            .unwrap_or_else(|e| panic!("{e}"));
            for r in reports {
                println!(
                    "{:<15} prepare {:.3} s for {:.2} GiB | {} x {} KiB expert copies: {:.2} GB/s | {} MiB copy: {:.2} GB/s",
                    r.mode.name(),
                    r.prepare.as_secs_f64(),
                    r.big_copy_bytes.max(1) as f64 / (1u64 << 30) as f64,
                    r.expert_copies,
                    r.expert_bytes / 1024,
                    r.expert_gbps,
                    r.big_copy_bytes >> 20,
                    r.big_gbps
                );
            }
        }
    }
}
