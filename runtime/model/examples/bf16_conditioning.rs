//! Are the isolated large GPU-vs-reference logit errors on the synthetic
//! `tiny` / `tiny-dense` models (head_dim 64, seed 1, BF16) what BF16
//! activations alone produce, or a GPU bug? Runs the CPU reference engine
//! twice over the same INT4 experts, in f32 and in its emulation of the CUDA
//! engine's BF16 rounding (`Activations::Bf16`), and reports the logit
//! differences per sequence with what is special at the worst positions.
//!
//! ```text
//! cargo run -p krasis-model --example bf16_conditioning -- [--tokens 2000] [--presets tiny,tiny-dense]
//! ```
//!
//! Needs the Qwen vocabulary (`bash tools/vocab.sh`). Checkpoints are written
//! once under `target/krasis-testdata/`.
//!
//! The routed experts are the INT4 round trip of the checkpoint's experts by
//! the cache's exact rule (runtime/cache/src/layout.rs; re-implemented here
//! as tools/witness/int4.py does, since krasis-model cannot depend on
//! krasis-cache), i.e. what `krasis_cache::Int4Experts` returns.

use krasis_model::reference::{
    Activations, CheckpointExperts, ReferenceEngine, ReferenceOptions, Trace,
};
use krasis_model::tokenizer::Tokenizer;
use krasis_model::{Checkpoint, MlpKind, ModelConfig};
use serde_json::Value;
use shared::{Int4RoundTrip, checkpoint};
use std::path::Path;
use std::sync::Arc;

mod shared;

/// The `bench --check` bound: 3% of the largest |logit| of the sequence.
const REL_BOUND: f32 = 0.03;

fn sequences(dir: &Path, long_tokens: usize) -> Vec<(String, Vec<u32>)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let s: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("tools/witness/sequences.json")).unwrap(),
    )
    .unwrap();
    let mut out: Vec<(String, Vec<u32>)> = s["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, q)| {
            let ids = q["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32);
            (
                format!("seq{i} ({})", q["name"].as_str().unwrap()),
                ids.collect(),
            )
        })
        .collect();
    let text = std::fs::read_to_string(root.join("assets/text/kjv-genesis-exodus.txt")).unwrap();
    let ids = Tokenizer::from_dir(dir).unwrap().encode(&text).unwrap();
    assert!(
        ids.len() >= long_tokens,
        "the text has only {} tokens",
        ids.len()
    );
    out.push((
        format!("kjv {long_tokens} tokens"),
        ids[..long_tokens].to_vec(),
    ));
    out
}

fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(f32::total_cmp);
    v[v.len() / 2]
}

fn argmax(v: &[f32]) -> usize {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b })
}

/// Per-position facts, from the f32 trace unless noted.
fn describe(t: usize, f: &Trace, b: &Trace, moe: &[usize]) -> String {
    let flips: Vec<String> = moe
        .iter()
        .filter(|&&l| {
            let (mut x, mut y) = (f.experts[l][t].clone(), b.experts[l][t].clone());
            x.sort_unstable();
            y.sort_unstable();
            x != y
        })
        .map(|&l| format!("L{l} {:?}->{:?}", f.experts[l][t], b.experts[l][t]))
        .collect();
    let margin = moe
        .iter()
        .map(|&l| f.router_margin[l][t])
        .fold(f32::INFINITY, f32::min);
    let min_rms = (0..f.layer_input_rms.len())
        .flat_map(|l| [f.layer_input_rms[l][t], f.mlp_input_rms[l][t]])
        .fold(f32::INFINITY, f32::min);
    let peak = f.attn_peak.iter().map(|p| p[t]).fold(0f32, f32::max);
    format!(
        "final rms {:.2} (x{:.2} of layer-0 input), min norm-input rms {:.3}, attn peak {:.3}, min router margin {:.4}, route flips: {}",
        f.final_rms[t],
        f.final_rms[t] / f.layer_input_rms[0][t],
        min_rms,
        peak,
        margin,
        if flips.is_empty() {
            "none".into()
        } else {
            flips.join(", ")
        }
    )
}

fn any_flip(t: usize, f: &Trace, b: &Trace, moe: &[usize]) -> bool {
    moe.iter().any(|&l| {
        let (mut x, mut y) = (f.experts[l][t].clone(), b.experts[l][t].clone());
        x.sort_unstable();
        y.sort_unstable();
        x != y
    })
}

fn run_preset(preset: &str, long_tokens: usize) {
    let dir = checkpoint(preset);
    let config = ModelConfig::load(&dir).unwrap();
    let g = config.geometry();
    let moe: Vec<usize> = (0..g.num_layers)
        .filter(|&l| g.mlp_kind(l) == MlpKind::Moe)
        .collect();
    let experts = Arc::new(Int4RoundTrip(CheckpointExperts::new(
        Arc::new(Checkpoint::open(&dir).unwrap()),
        &config,
    )));
    let opts = ReferenceOptions {
        context_length: Some(long_tokens + 64),
    };
    let mut e = ReferenceEngine::with_experts(&dir, opts, experts).unwrap();
    println!(
        "\n## {preset} (head_dim {}, layers {:?}, top-{} of {} experts; {})",
        g.head_dim,
        g.layers.iter().map(|l| l.mlp).collect::<Vec<_>>(),
        g.top_k,
        g.num_experts,
        dir.display()
    );
    for (label, tokens) in sequences(&dir, long_tokens) {
        e.set_activations(Activations::F32);
        let (lf, tf) = e.prompt_logits_traced(&tokens).unwrap();
        e.set_activations(Activations::Bf16);
        let (lb, tb) = e.prompt_logits_traced(&tokens).unwrap();
        let scale = lf.iter().flatten().fold(1f32, |m, v| m.max(v.abs()));
        let bound = REL_BOUND * scale;
        let errs: Vec<f32> = lf
            .iter()
            .zip(&lb)
            .map(|(a, b)| a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())))
            .collect();
        let n = errs.len();
        let over: Vec<usize> = (0..n).filter(|&t| errs[t] > bound).collect();
        let flipped: Vec<usize> = (0..n).filter(|&t| any_flip(t, &tf, &tb, &moe)).collect();
        let max_no_flip = (0..n)
            .filter(|t| !flipped.contains(t))
            .map(|t| errs[t])
            .fold(0f32, f32::max);
        let argmax_diff = (0..n).filter(|&t| argmax(&lf[t]) != argmax(&lb[t])).count();
        let max = errs.iter().copied().fold(0f32, f32::max);
        println!(
            "\n### {label}: {n} positions, max |logit| {scale:.2}, bound {bound:.3}\n\
             max err {max:.4} (rel {:.4}), median {:.4}, over bound {}, argmax differs {argmax_diff}, \
             positions with a route flip {} (over bound with a flip: {}), max err without any flip {max_no_flip:.4}",
            max / scale,
            median(errs.clone()),
            over.len(),
            flipped.len(),
            over.iter().filter(|t| flipped.contains(t)).count(),
        );
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| errs[b].total_cmp(&errs[a]));
        for &t in order.iter().take(6) {
            println!(
                "  pos {t:4} err {:8.4}: {}",
                errs[t],
                describe(t, &tf, &tb, &moe)
            );
        }
        let med_final = median(tf.final_rms.clone());
        let med_peak = median(
            (0..n)
                .map(|t| tf.attn_peak.iter().map(|p| p[t]).fold(0f32, f32::max))
                .collect(),
        );
        let margins: Vec<f32> = (0..n)
            .map(|t| {
                moe.iter()
                    .map(|&l| tf.router_margin[l][t])
                    .fold(f32::INFINITY, f32::min)
            })
            .collect();
        println!(
            "  sequence medians: final rms {med_final:.2}, attn peak {med_peak:.3}, min router margin {:.4}",
            median(margins.clone())
        );
        if moe.is_empty() {
            continue;
        }
        // How far BF16 rounding moves the top-k margin where the choice held:
        // margins below that can flip in any BF16 implementation.
        let mut noise: Vec<f32> = moe
            .iter()
            .flat_map(|&l| (0..n).map(move |t| (l, t)))
            .filter(|&(_, t)| !flipped.contains(&t))
            .map(|(l, t)| (tf.router_margin[l][t] - tb.router_margin[l][t]).abs())
            .collect();
        noise.sort_by(f32::total_cmp);
        let q = |f: f64| noise[((noise.len() - 1) as f64 * f) as usize];
        let max_noise = q(1.0);
        println!(
            "  |margin change| F32->BF16 where routing held: median {:.4}, p99 {:.4}, max {max_noise:.4}; \
             positions with min margin < {max_noise:.4}: {}",
            q(0.5),
            q(0.99),
            margins.iter().filter(|&&m| m < max_noise).count()
        );
        let mut by_margin: Vec<usize> = (0..n).collect();
        by_margin.sort_by(|&a, &b| margins[a].total_cmp(&margins[b]));
        let tight: Vec<String> = by_margin
            .iter()
            .take(4)
            .map(|&t| {
                let f = if flipped.contains(&t) { "flip" } else { "held" };
                format!("pos {t} margin {:.4} {f} err {:.3}", margins[t], errs[t])
            })
            .collect();
        println!("  tightest: {}", tight.join("; "));
    }
}

fn main() {
    let mut long_tokens = 2000;
    let mut presets = vec!["tiny".to_string(), "tiny-dense".to_string()];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--tokens" => long_tokens = args.next().unwrap().parse().unwrap(),
            "--presets" => presets = args.next().unwrap().split(',').map(String::from).collect(),
            _ => panic!("unknown argument {a}; use --tokens N --presets a,b"),
        }
    }
    for p in &presets {
        run_preset(p, long_tokens);
    }
}
