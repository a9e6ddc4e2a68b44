use half::bf16;

use crate::launch::Act16;
use crate::ops::rope::{KvGeom, QkvGeom};

pub fn to_f32(x: &[bf16]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

pub fn to_bf16(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}

/// Rows of `table` ([vocab, hidden]) widened to f32; NaN rows for bad ids.
pub fn embed(table: &[bf16], hidden: usize, ids: &[u32]) -> Vec<f32> {
    let vocab = table.len() / hidden;
    let mut out = Vec::with_capacity(ids.len() * hidden);
    for &id in ids {
        if (id as usize) < vocab {
            out.extend(
                table[id as usize * hidden..][..hidden]
                    .iter()
                    .map(|v| v.to_f32()),
            );
        } else {
            out.extend(std::iter::repeat_n(f32::NAN, hidden));
        }
    }
    out
}

/// Per row: `bf16(x * (1/sqrt(mean(x^2) + eps)) * w)`, f64 statistics.
pub fn rmsnorm(x: &[f32], w: &[bf16], hidden: usize, eps: f32) -> Vec<bf16> {
    rmsnorm_as(x, w, hidden, eps)
}

/// [`rmsnorm`] rounded to `A` (f16: `rmsnorm_f32_to_f16`).
pub fn rmsnorm_as<A: Act16>(x: &[f32], w: &[bf16], hidden: usize, eps: f32) -> Vec<A> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(hidden) {
        let ss: f64 = row.iter().map(|&v| v as f64 * v as f64).sum();
        let inv = 1.0 / (ss / hidden as f64 + eps as f64).sqrt();
        out.extend(
            row.iter()
                .zip(w)
                .map(|(&v, &wi)| A::from_f64(v as f64 * inv * wi.to_f64())),
        );
    }
    out
}

/// `residual += delta`, then [`rmsnorm`] of the updated residual.
pub fn add_rmsnorm(
    residual: &mut [f32],
    delta: &[f32],
    w: &[bf16],
    hidden: usize,
    eps: f32,
) -> Vec<bf16> {
    for (r, d) in residual.iter_mut().zip(delta) {
        *r += *d;
    }
    rmsnorm(residual, w, hidden, eps)
}

/// `bf16(x[r, c] + bias[c])` per row of `bias.len()` columns: one rounding
/// of the f32 sum.
pub fn bias_cast(x: &[f32], bias: &[f32]) -> Vec<bf16> {
    bias_cast_as(x, bias)
}

/// [`bias_cast`] rounded to `A` (f16: `bias_cast_f32_to_f16`).
pub fn bias_cast_as<A: Act16>(x: &[f32], bias: &[f32]) -> Vec<A> {
    x.chunks(bias.len())
        .flat_map(|row| row.iter().zip(bias).map(|(v, b)| A::from_f32(v + b)))
        .collect()
}

/// `silu(gate) * up` over `[rows, 2*inter]` rows.
pub fn swiglu(gate_up: &[f32], inter: usize) -> Vec<bf16> {
    swiglu_as(gate_up, inter)
}

/// [`swiglu`] rounded to `A` (f16: `swiglu_f16`, an FP16 MLP block's).
pub fn swiglu_as<A: Act16>(gate_up: &[f32], inter: usize) -> Vec<A> {
    let mut out = Vec::with_capacity(gate_up.len() / 2);
    for row in gate_up.chunks(2 * inter) {
        for i in 0..inter {
            let g = row[i] as f64;
            let u = row[inter + i] as f64;
            out.push(A::from_f64(g / (1.0 + (-g).exp()) * u));
        }
    }
    out
}

/// Per-head RMSNorm + HF rotate_half RoPE on the q and k heads, in place.
pub fn qk_norm_rope(
    qkv: &mut [bf16],
    geom: QkvGeom,
    start_pos: u32,
    q_norm: &[bf16],
    k_norm: &[bf16],
    theta: f32,
    eps: f32,
) {
    let d = geom.head_dim;
    let half = d / 2;
    for t in 0..geom.n_tokens {
        let pos = (start_pos as usize + t) as f32;
        for hh in 0..geom.n_q_heads + geom.n_kv_heads {
            let w = if hh < geom.n_q_heads { q_norm } else { k_norm };
            let x = &mut qkv[t * geom.row_stride() + hh * d..][..d];
            let v: Vec<f64> = x.iter().map(|e| e.to_f64()).collect();
            let ss: f64 = v.iter().map(|a| a * a).sum();
            let inv = 1.0 / (ss / d as f64 + eps as f64).sqrt();
            let n: Vec<f64> = (0..d).map(|i| v[i] * inv * w[i].to_f64()).collect();
            for i in 0..half {
                // Same f32 formula as HF for the angle, then exact trig.
                let inv_freq = 1.0f32 / theta.powf((2 * i) as f32 / d as f32);
                let ang = (pos * inv_freq) as f64;
                let (s, c) = ang.sin_cos();
                x[i] = bf16::from_f64(n[i] * c - n[i + half] * s);
                x[i + half] = bf16::from_f64(n[i + half] * c + n[i] * s);
            }
        }
    }
}

/// HF rotate_half RoPE on the q and k heads, in place, from a frequency
/// table: the reference engine's arithmetic (`krasis_model::layers::rope`):
/// angle `f32(pos) * inv_freq[i]`, `c = cos(angle) * scale`,
/// `s = sin(angle) * scale` in f32, each product and difference rounded
/// to f32, one rounding to bf16 (to f16 for an f16 `qkv`: `rope_table_f16`).
pub fn rope_table<A: Act16>(
    qkv: &mut [A],
    geom: QkvGeom,
    start_pos: u32,
    inv_freq: &[f32],
    scale: f32,
) {
    let d = geom.head_dim;
    let half = d / 2;
    assert_eq!(inv_freq.len(), half, "rope_table: inv_freq length");
    for t in 0..geom.n_tokens {
        let pos = (start_pos as usize + t) as f32;
        for hh in 0..geom.n_q_heads + geom.n_kv_heads {
            let x = &mut qkv[t * geom.row_stride() + hh * d..][..d];
            for (i, &f) in inv_freq.iter().enumerate() {
                let angle = pos * f;
                let (c, s) = (angle.cos() * scale, angle.sin() * scale);
                let (a, b) = (x[i].to_f32(), x[i + half].to_f32());
                x[i] = A::from_f32(a * c - b * s);
                x[i + half] = A::from_f32(b * c + a * s);
            }
        }
    }
}

/// Copy k/v heads of token `t` into the caches at `start_pos + t`.
pub fn kv_append<A: Act16>(
    qkv: &[A],
    geom: QkvGeom,
    start_pos: u32,
    kv: KvGeom,
    k_cache: &mut [A],
    v_cache: &mut [A],
) {
    let d = geom.head_dim;
    for t in 0..geom.n_tokens {
        let pos = start_pos as usize + t;
        for h in 0..geom.n_kv_heads {
            let row = &qkv[t * geom.row_stride()..];
            let dst = (h * kv.capacity + pos) * d;
            k_cache[dst..dst + d].copy_from_slice(&row[(geom.n_q_heads + h) * d..][..d]);
            v_cache[dst..dst + d]
                .copy_from_slice(&row[(geom.n_q_heads + geom.n_kv_heads + h) * d..][..d]);
        }
    }
}
