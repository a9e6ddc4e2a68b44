//! A second, deliberately naive implementation of the `Qwen3MoeForCausalLM`
//! forward pass, written from the transformers source without using any of
//! the engine's layers: every position is recomputed from scratch (no KV
//! cache), heads are expanded like `repeat_kv`, RoPE uses full-width cos/sin
//! and `rotate_half`. (Planted bugs live in the engine itself:
//! `reference::Fault`.)

// Index loops mirror the formulas they implement, which is the point here.
#![allow(clippy::needless_range_loop)]

use krasis_model::arch::qwen3_moe::TensorNames;
use krasis_model::{Checkpoint, MlpKind, ModelConfig};
use std::path::Path;

struct Model {
    ckpt: Checkpoint,
}

impl Model {
    fn t(&self, name: &str) -> Vec<f32> {
        self.ckpt
            .get(name)
            .unwrap_or_else(|e| panic!("{e}"))
            .to_f32()
    }
}

fn linear(w: &[f32], x: &[f32]) -> Vec<f32> {
    w.chunks(x.len())
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

fn rms(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let var = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let s = 1.0 / (var + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * s * w).collect()
}

fn rope(x: &mut [f32], pos: usize, theta: f64) {
    let d = x.len();
    let half = d / 2;
    let emb: Vec<f32> = (0..d)
        .map(|j| pos as f32 * (1.0 / (theta as f32).powf((2 * (j % half)) as f32 / d as f32)))
        .collect();
    let rotated: Vec<f32> = (0..d)
        .map(|j| if j < half { -x[j + half] } else { x[j - half] })
        .collect();
    for j in 0..d {
        x[j] = x[j] * emb[j].cos() + rotated[j] * emb[j].sin();
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn mlp(gate: &[f32], up: &[f32], down: &[f32], x: &[f32]) -> Vec<f32> {
    let g = linear(gate, x);
    let u = linear(up, x);
    let h: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
    linear(down, &h)
}

/// Logits at every position of `tokens`.
pub fn logits(dir: &Path, tokens: &[u32]) -> Vec<Vec<f32>> {
    let cfg = ModelConfig::load(dir).unwrap();
    let g = cfg.geometry();
    let m = Model {
        ckpt: Checkpoint::open(dir).unwrap(),
    };
    let (h, d, eps) = (g.hidden, g.head_dim, g.rms_norm_eps);
    let n_rep = g.num_heads / g.num_kv_heads;
    let embed = m.t(TensorNames::EMBED);
    let mut xs: Vec<Vec<f32>> = tokens
        .iter()
        .map(|&t| embed[t as usize * h..][..h].to_vec())
        .collect();
    for layer in 0..g.num_layers {
        let t = TensorNames::layer(layer);
        let (wq, wk, wv, wo) = (
            m.t(&t.q_proj()),
            m.t(&t.k_proj()),
            m.t(&t.v_proj()),
            m.t(&t.o_proj()),
        );
        let (qn, kn) = (m.t(&t.q_norm()), m.t(&t.k_norm()));
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let xn = rms(x, &m.t(&t.input_norm()), eps);
            let (mut q, mut k, mut v) = (linear(&wq, &xn), linear(&wk, &xn), linear(&wv, &xn));
            if g.attention.qkv_bias {
                for (y, b) in [
                    (&mut q, t.q_bias()),
                    (&mut k, t.k_bias()),
                    (&mut v, t.v_bias()),
                ] {
                    for (y, b) in y.iter_mut().zip(m.t(&b)) {
                        *y += b;
                    }
                }
            }
            let mut q: Vec<Vec<f32>> = q.chunks(d).map(|c| rms(c, &qn, eps)).collect();
            let mut k: Vec<Vec<f32>> = k.chunks(d).map(|c| rms(c, &kn, eps)).collect();
            for head in q.iter_mut().chain(k.iter_mut()) {
                rope(head, pos, g.rope.theta);
            }
            qs.push(q);
            ks.push(k);
            vs.push(v.chunks(d).map(<[f32]>::to_vec).collect::<Vec<_>>());
        }
        for (pos, x) in xs.iter_mut().enumerate() {
            let mut attn = Vec::with_capacity(g.q_dim());
            for head in 0..g.num_heads {
                let kvh = head / n_rep;
                let scores: Vec<f32> = (0..=pos)
                    .map(|j| {
                        qs[pos][head]
                            .iter()
                            .zip(&ks[j][kvh])
                            .map(|(a, b)| a * b)
                            .sum::<f32>()
                            / (d as f32).sqrt()
                    })
                    .collect();
                let mx = scores.iter().cloned().fold(f32::MIN, f32::max);
                let e: Vec<f32> = scores.iter().map(|s| (s - mx).exp()).collect();
                let z: f32 = e.iter().sum();
                for c in 0..d {
                    attn.push((0..=pos).map(|j| e[j] / z * vs[j][kvh][c]).sum::<f32>());
                }
            }
            let mut o = linear(&wo, &attn);
            if g.attention.o_bias {
                for (o, b) in o.iter_mut().zip(m.t(&t.o_bias())) {
                    *o += b;
                }
            }
            for (xv, o) in x.iter_mut().zip(o) {
                *xv += o;
            }
            let xn = rms(x, &m.t(&t.post_attention_norm()), eps);
            let y = match g.mlp_kind(layer) {
                MlpKind::Dense => mlp(
                    &m.t(&t.dense_gate()),
                    &m.t(&t.dense_up()),
                    &m.t(&t.dense_down()),
                    &xn,
                ),
                MlpKind::Moe => {
                    let logits = linear(&m.t(&t.router()), &xn);
                    let mx = logits.iter().cloned().fold(f32::MIN, f32::max);
                    let z: f32 = logits.iter().map(|l| (l - mx).exp()).sum();
                    let p: Vec<f32> = logits.iter().map(|l| (l - mx).exp() / z).collect();
                    let mut order: Vec<usize> = (0..p.len()).collect();
                    order.sort_by(|a, b| p[*b].partial_cmp(&p[*a]).unwrap());
                    let mut chosen: Vec<usize> = order[..g.top_k].to_vec();
                    let norm: f32 = if g.router.kind
                        == (krasis_model::arch::RouterKind::SoftmaxTopK { renormalize: true })
                    {
                        chosen.iter().map(|&e| p[e]).sum()
                    } else {
                        1.0
                    };
                    chosen.sort();
                    let mut y = vec![0f32; h];
                    for e in chosen {
                        let out = mlp(
                            &m.t(&t.expert_gate(e)),
                            &m.t(&t.expert_up(e)),
                            &m.t(&t.expert_down(e)),
                            &xn,
                        );
                        for (y, o) in y.iter_mut().zip(out) {
                            *y += o * (p[e] / norm);
                        }
                    }
                    y
                }
            };
            for (xv, yv) in x.iter_mut().zip(y) {
                *xv += yv;
            }
        }
    }
    let head = if g.tie_word_embeddings {
        embed
    } else {
        m.t(TensorNames::LM_HEAD)
    };
    let final_norm = m.t(TensorNames::FINAL_NORM);
    xs.iter()
        .map(|x| linear(&head, &rms(x, &final_norm, eps)))
        .collect()
}
