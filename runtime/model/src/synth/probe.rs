//! Test-only single-token forward pass straight from a spec (no checkpoint
//! files): at position 0 attention reduces to `o_proj(v)`, so hidden-state
//! scale and router behaviour can be checked cheaply at any model size
//! without depending on the reference engine.

use super::{SynthSpec, expert_weights};
use crate::MlpKind;
use crate::arch::qwen3_moe::TensorNames;
use std::collections::HashMap;

pub struct Probe {
    /// RMS of the residual stream after each layer (averaged over tokens).
    pub layer_rms: Vec<f32>,
    /// Per layer, how often each expert was chosen.
    pub expert_counts: Vec<Vec<usize>>,
    /// Std of the final logits (over tokens and vocab), if computed.
    pub logit_std: Option<f32>,
}

fn matvec(w: &[f32], x: &[f32]) -> Vec<f32> {
    w.chunks_exact(x.len())
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

fn rms(x: &[f32]) -> f32 {
    (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32).sqrt()
}

fn rmsnorm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let r = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32 + eps).sqrt();
    x.iter().zip(w).map(|(a, b)| a * r * b).collect()
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn swiglu(gate: &[f32], up: &[f32], down: &[f32], x: &[f32]) -> Vec<f32> {
    let g = matvec(gate, x);
    let u = matvec(up, x);
    let a: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
    matvec(down, &a)
}

/// Runs each token alone (position 0) through the whole model.
pub fn probe(spec: &SynthSpec, tokens: &[usize], with_logits: bool) -> Probe {
    let g = spec.geometry();
    let t = |name: &str| spec.tensor_f32(name).expect("tensor exists");
    let mut hs: Vec<Vec<f32>> = tokens
        .iter()
        .map(|&tok| spec.tensor_row_f32(TensorNames::EMBED, tok).expect("row"))
        .collect();
    let mut layer_rms = Vec::new();
    let mut expert_counts = Vec::new();
    let group = g.num_heads / g.num_kv_heads;
    for (l, kind) in g.layers.iter().map(|s| &s.mlp).enumerate() {
        let n = TensorNames::layer(l);
        let (in_norm, post_norm) = (t(&n.input_norm()), t(&n.post_attention_norm()));
        let (wv, wo) = (t(&n.v_proj()), t(&n.o_proj()));
        let mut counts = vec![0usize; g.num_experts];
        let router = (*kind == MlpKind::Moe).then(|| t(&n.router()));
        let dense = (*kind == MlpKind::Dense)
            .then(|| (t(&n.dense_gate()), t(&n.dense_up()), t(&n.dense_down())));
        let mut experts = HashMap::new();
        for h in hs.iter_mut() {
            let x = rmsnorm(h, &in_norm, g.rms_norm_eps);
            let v = matvec(&wv, &x);
            let attn: Vec<f32> = (0..g.num_heads)
                .flat_map(|head| {
                    let kv = head / group;
                    v[kv * g.head_dim..(kv + 1) * g.head_dim].to_vec()
                })
                .collect();
            for (a, b) in h.iter_mut().zip(matvec(&wo, &attn)) {
                *a += b;
            }
            let x = rmsnorm(h, &post_norm, g.rms_norm_eps);
            let out = if let Some(r) = &router {
                let logits = matvec(r, &x);
                let m = logits.iter().cloned().fold(f32::MIN, f32::max);
                let p: Vec<f32> = logits.iter().map(|z| (z - m).exp()).collect();
                let mut order: Vec<usize> = (0..p.len()).collect();
                order.sort_by(|a, b| p[*b].total_cmp(&p[*a]));
                let top = &order[..g.top_k];
                let norm: f32 = if g.router.kind
                    == (crate::arch::RouterKind::SoftmaxTopK { renormalize: true })
                {
                    top.iter().map(|e| p[*e]).sum()
                } else {
                    p.iter().sum()
                };
                let mut out = vec![0f32; g.hidden];
                for &e in top {
                    counts[e] += 1;
                    let w = experts
                        .entry(e)
                        .or_insert_with(|| expert_weights(spec, l, e));
                    let y = swiglu(&w.gate, &w.up, &w.down, &x);
                    for (o, yv) in out.iter_mut().zip(y) {
                        *o += p[e] / norm * yv;
                    }
                }
                out
            } else {
                let (gw, uw, dw) = dense.as_ref().expect("dense weights");
                swiglu(gw, uw, dw, &x)
            };
            for (a, b) in h.iter_mut().zip(out) {
                *a += b;
            }
        }
        layer_rms.push(hs.iter().map(|h| rms(h)).sum::<f32>() / hs.len() as f32);
        expert_counts.push(counts);
    }
    let logit_std = with_logits.then(|| {
        let fnorm = t(TensorNames::FINAL_NORM);
        let head = if g.tie_word_embeddings {
            t(TensorNames::EMBED)
        } else {
            t(TensorNames::LM_HEAD)
        };
        let all: Vec<f32> = hs
            .iter()
            .flat_map(|h| matvec(&head, &rmsnorm(h, &fnorm, g.rms_norm_eps)))
            .collect();
        let mean = all.iter().sum::<f32>() / all.len() as f32;
        (all.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / all.len() as f32).sqrt()
    });
    Probe {
        layer_rms,
        expert_counts,
        logit_std,
    }
}
