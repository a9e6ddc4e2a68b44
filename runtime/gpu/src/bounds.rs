//! Physical lower bounds on prefill and decode time, so every measured
//! figure can be reported beside what the hardware allows: bytes that must
//! cross HBM per decode token over the copy bandwidth, and FLOPs per
//! prefill over the BF16 matrix rate.

use krasis_model::arch::AttentionKind;
use krasis_model::{Geometry, MlpKind};
use serde::Serialize;

/// Device-to-device copy bandwidth (read + write bytes) measured on the H200
/// this engine is benchmarked on.
pub const H200_HBM_BYTES_PER_S: f64 = 4.3e12;
/// Dense BF16 GEMM rate measured on the same H200 (8192³, random data).
pub const H200_BF16_FLOP_PER_S: f64 = 790e12;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Bound {
    /// Bytes (decode) or FLOPs (prefill) per token.
    pub per_token: f64,
    /// Tokens/s the bound allows.
    pub max_tok_s: f64,
}

/// Bytes one decode token must read at context `ctx` with all experts
/// resident: every non-expert weight once (a MoE layer's shared expert
/// among them), `top_k` experts (INT4 or MXFP4,
/// `expert_bytes` each) per MoE layer, the KV cache up to `ctx` (a sliding
/// layer's window of it), and the LM head.
pub fn decode_bytes_per_token(g: &Geometry, expert_bytes: usize, ctx: usize) -> f64 {
    decode_bytes_per_step(g, expert_bytes, ctx, 1, g.top_k as f64)
}

/// Distinct experts `rows` rows are expected to read in one MoE layer when
/// each row routes to `top_k` of `num_experts` independently and uniformly:
/// `E * (1 - (1 - k/E)^rows)` (8, 15.5, 29.1 and 51.8 for a3b's 128 / 8 at
/// 1, 2, 4 and 8 rows).
pub fn expected_distinct_experts(g: &Geometry, rows: usize) -> f64 {
    let (e, k) = (g.num_experts.max(1) as f64, g.top_k as f64);
    e * (1.0 - (1.0 - k / e).powi(rows as i32))
}

/// Bytes one decode step of `rows` rows (sequences, each at context `ctx`)
/// must read with all experts resident: the non-expert weights and the LM
/// head once for all rows, `experts_per_layer` distinct experts per MoE
/// layer (the union of the rows' routes), and every row's own KV.
pub fn decode_bytes_per_step(
    g: &Geometry,
    expert_bytes: usize,
    ctx: usize,
    rows: usize,
    experts_per_layer: f64,
) -> f64 {
    let (h, q, kv) = (g.hidden as f64, g.q_dim() as f64, g.kv_dim() as f64);
    let rows = rows.max(1) as f64;
    let shared = g.shared_intermediate.unwrap_or(0);
    let mut b = 0.0;
    for l in &g.layers {
        let keys = match l.attention {
            AttentionKind::Full => ctx,
            AttentionKind::Sliding { window } => ctx.min(window),
        };
        b += 2.0 * ((q + 2.0 * kv) * h + h * q); // qkv + o_proj, bf16
        b += rows * 2.0 * 2.0 * keys as f64 * kv; // K and V, bf16
        b += match l.mlp {
            MlpKind::Moe => {
                2.0 * g.num_experts as f64 * h
                    + experts_per_layer * expert_bytes as f64
                    + 2.0 * 3.0 * h * shared as f64
            }
            MlpKind::Dense => 2.0 * 3.0 * h * g.intermediate as f64,
        };
    }
    b + 2.0 * g.vocab_size as f64 * h
}

/// FLOPs of prefilling `tokens` tokens from an empty cache (matrix products
/// and attention; the LM head runs for the last token only).
pub fn prefill_flops(g: &Geometry, tokens: usize) -> f64 {
    let (h, q, kv, t) = (
        g.hidden as f64,
        g.q_dim() as f64,
        g.kv_dim() as f64,
        tokens as f64,
    );
    let mut per_token = 0.0;
    for kind in g.layers.iter().map(|l| l.mlp) {
        per_token += 2.0 * ((q + 2.0 * kv) * h + h * q);
        per_token += match kind {
            MlpKind::Moe => {
                2.0 * (g.num_experts as f64 * h
                    + g.top_k as f64 * 3.0 * h * g.expert_intermediate as f64
                    + 3.0 * h * g.shared_intermediate.unwrap_or(0) as f64)
            }
            MlpKind::Dense => 2.0 * 3.0 * h * g.intermediate as f64,
        };
    }
    // Causal attention: QKᵀ and PV over on average t/2 keys per query (a
    // sliding layer's query over at most its window).
    let full = g
        .layers
        .iter()
        .filter(|l| l.attention == AttentionKind::Full)
        .count();
    let mut keys = full as f64 * (t * (t + 1.0) / 2.0);
    for l in &g.layers {
        if let AttentionKind::Sliding { window } = l.attention {
            let w = window.min(tokens) as f64;
            keys += w * (w + 1.0) / 2.0 + (t - w) * w;
        }
    }
    let attn = 2.0 * 2.0 * q * keys;
    per_token * t + attn + 2.0 * g.vocab_size as f64 * h
}

pub fn decode_bound(g: &Geometry, expert_bytes: usize, ctx: usize) -> Bound {
    let b = decode_bytes_per_token(g, expert_bytes, ctx);
    Bound {
        per_token: b,
        max_tok_s: H200_HBM_BYTES_PER_S / b,
    }
}

pub fn prefill_bound(g: &Geometry, tokens: usize) -> Bound {
    let f = prefill_flops(g, tokens);
    Bound {
        per_token: f / tokens.max(1) as f64,
        max_tok_s: tokens as f64 * H200_BF16_FLOP_PER_S / f,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a3b_24l() -> Geometry {
        krasis_model::synth::preset_geometry("a3b-24l").expect("a3b-24l is a preset")
    }

    #[test]
    fn a3b_24l_decode_bytes_are_about_1_8_gb() {
        let expert = krasis_cache::ExpertLayout::int4(2048, 768)
            .unwrap()
            .used_bytes;
        let b = decode_bytes_per_token(&a3b_24l(), expert, 0);
        // 24 x (37.7 MB attention + 0.5 MB router + 8 x 2.4 MB experts) + 622 MB head.
        assert!((1.9e9..2.1e9).contains(&b), "{b}");
        let kv = decode_bytes_per_token(&a3b_24l(), expert, 1000) - b;
        assert_eq!(kv, 24.0 * 4.0 * 1000.0 * 512.0);
    }

    /// M rows share the dense weights and read the union of their experts.
    #[test]
    fn a_step_of_rows_shares_the_dense_bytes() {
        let g = a3b_24l();
        let expert = krasis_cache::ExpertLayout::int4(2048, 768)
            .unwrap()
            .used_bytes;
        let one = decode_bytes_per_token(&g, expert, 0);
        assert!((expected_distinct_experts(&g, 1) - 8.0).abs() < 1e-9);
        let e4 = expected_distinct_experts(&g, 4);
        assert!((29.0..29.2).contains(&e4), "{e4}");
        let four = decode_bytes_per_step(&g, expert, 0, 4, e4);
        let extra = 24.0 * (e4 - 8.0) * expert as f64;
        assert!((four - one - extra).abs() < 1.0, "{four} {one} {extra}");
        // KV is per row.
        let kv4 = decode_bytes_per_step(&g, expert, 1000, 4, e4) - four;
        assert_eq!(kv4, 4.0 * 24.0 * 4.0 * 1000.0 * 512.0);
    }

    /// A sliding layer reads (and attends over) only its window.
    #[test]
    fn sliding_layers_are_bounded_by_their_window() {
        let g = krasis_model::synth::preset_geometry("gpt-oss-20b").unwrap();
        let kv_per_key = 2.0 * 2.0 * g.kv_dim() as f64;
        let b = |ctx| decode_bytes_per_token(&g, 0, ctx);
        // 12 full layers grow with the context, 12 sliding ones stop at 128.
        assert_eq!(b(1000) - b(0), (12 * 1000 + 12 * 128) as f64 * kv_per_key);
        assert_eq!(b(100) - b(0), (24 * 100) as f64 * kv_per_key);
        let q = g.q_dim() as f64;
        let linear = |t: usize| {
            prefill_flops(&g, t)
                - 2.0 * 2.0 * q * {
                    let t = t as f64;
                    12.0 * t * (t + 1.0) / 2.0 + 12.0 * (128.0 * 129.0 / 2.0 + (t - 128.0) * 128.0)
                }
        };
        // What remains after the attention terms is linear in the tokens.
        let (l1, l2) = (linear(1000), linear(2000));
        let head = 2.0 * g.vocab_size as f64 * g.hidden as f64;
        assert!(((l2 - head) / (l1 - head) - 2.0).abs() < 1e-9, "{l1} {l2}");
    }

    #[test]
    fn prefill_flops_scale_with_active_params() {
        let g = a3b_24l();
        let f1 = prefill_flops(&g, 1000);
        let f2 = prefill_flops(&g, 2000);
        // Linear part dominates at these lengths; attention adds the rest.
        assert!(f2 > 2.0 * f1 - 2.0 * 2.0 * 151936.0 * 2048.0);
        // ~1.5 B active params per token -> ~3 GFLOP per token.
        assert!((2.5e9..4.0e9).contains(&(f1 / 1000.0)), "{}", f1 / 1000.0);
    }

    /// A shared expert is read (and multiplied) once per token per MoE
    /// layer, like the non-expert weights: GLM-4.5-Air-12l's bounds are
    /// those of the same plan without it plus its 3 S H per MoE layer.
    #[test]
    fn bounds_count_the_shared_expert() {
        let json = krasis_model::synth::preset_config("glm-4.5-air-12l")
            .unwrap()
            .to_string();
        let g = krasis_model::ModelConfig::from_json_str(&json, std::path::Path::new("glm"))
            .unwrap()
            .geometry();
        let mut plain = g.clone();
        plain.shared_intermediate = None;
        let per_layer = 3.0 * g.hidden as f64 * g.shared_intermediate.unwrap() as f64;
        let moe = g.num_moe_layers() as f64;
        let bytes =
            decode_bytes_per_token(&g, 1000, 100) - decode_bytes_per_token(&plain, 1000, 100);
        assert_eq!(bytes, 2.0 * per_layer * moe);
        let flops = prefill_flops(&g, 64) - prefill_flops(&plain, 64);
        assert!((flops - 2.0 * per_layer * moe * 64.0).abs() < 1e-3 * flops);
    }
}
