//! The attention block of one decoder layer, wired from the layer plan:
//! each part (q/k/v and o biases, q/k norms or table RoPE, sinks, a sliding
//! window) is launched only where the plan has it, so a plan without them
//! runs exactly the kernels it ran before they existed.

use crate::blas::OutType;
use crate::error::{GpuError, Result};
use crate::forward::{Ctx, Positions};
use crate::scratch::{KvCache, Scratch};
use half::bf16;
use krasis_kernels::StartPos;
use krasis_kernels::ops::attention::RingAttn;
use krasis_model::arch::AttentionKind;

/// Attention block of layer `l`: reads `scratch.normed`, adds the o_proj
/// output (and its bias) into `scratch.residual`.
///
/// The plan's parts, each only where the layer has it: q/k/v projected to
/// f32 and its bias added with one rounding to BF16; q/k RMSNorm fused with
/// RoPE, or RoPE from the model's frequency table; plain causal attention
/// over a linear KV cache, or (sliding window or sinks) the ring kernels.
pub(crate) fn attention(
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    kv: &mut KvCache,
    l: usize,
    t: usize,
    at: Positions,
) -> Result<()> {
    let g = cx.g;
    let (h, q, kvd) = (g.hidden, g.q_dim(), g.kv_dim());
    let (s, kn) = (&cx.gpu.stream, cx.kn);
    let lw = &cx.w.layers[l];
    let geom = cx.qkv_geom(t);
    let eps = g.rms_norm_eps;
    let decode = matches!(at, Positions::Decode);
    match (&lw.qkv_bias, decode) {
        // The input RMSNorm folded in (the caller skipped it).
        (None, true) => cx.norm_gemv::<bf16>(
            &sc.residual,
            &lw.input_norm,
            &lw.qkv,
            q + 2 * kvd,
            &mut sc.normed,
            &mut sc.qkv,
        )?,
        (None, false) => cx.gemm(
            (t, q + 2 * kvd, h),
            cx.p(&sc.normed, 0),
            cx.p(&lw.qkv, 0),
            cx.p(&sc.qkv, 0),
            OutType::Bf16,
            0.0,
            "qkv projection",
        )?,
        (Some(bias), _) => {
            let wide = sc.qkv_f32.as_mut().ok_or_else(|| {
                GpuError::Unsupported("q/k/v biases without their f32 scratch".into())
            })?;
            if decode {
                cx.norm_gemv::<f32>(
                    &sc.residual,
                    &lw.input_norm,
                    &lw.qkv,
                    q + 2 * kvd,
                    &mut sc.normed,
                    wide,
                )?;
            } else {
                cx.gemm(
                    (t, q + 2 * kvd, h),
                    cx.p(&sc.normed, 0),
                    cx.p(&lw.qkv, 0),
                    cx.p(wide, 0),
                    OutType::F32,
                    0.0,
                    "qkv projection",
                )?;
            }
            kn.bias_cast_f32_to_bf16(s, wide, bias, t, q + 2 * kvd, &mut sc.qkv)?;
        }
    }
    let theta = g.rope.theta as f32;
    let scale = 1.0 / (g.head_dim as f32).sqrt();
    let kvg = kv.geoms[l];
    let (kc, vc) = (&mut kv.k[l], &mut kv.v[l]);
    let sp = match at {
        Positions::Prefill(start) => StartPos::Host(
            u32::try_from(start)
                .map_err(|_| GpuError::Unsupported(format!("position {start} exceeds u32")))?,
        ),
        Positions::Decode => StartPos::Device(&sc.pos),
    };
    match (&lw.qk_norm, &cx.w.rope) {
        // Partial rotary (glm4_moe): its own kernel, with or without norm.
        (n, Some(r)) if r.rotary_dim < g.head_dim => {
            let norm = n.as_ref().map(|n| krasis_kernels::QkNormArgs {
                q: &n.q,
                k: &n.k,
                eps,
            });
            kn.rope_partial(
                s,
                &mut sc.qkv,
                geom,
                sp,
                norm,
                &r.inv_freq,
                r.scale,
                r.rotary_dim,
            )?
        }
        (Some(n), _) => kn.qk_norm_rope(s, &mut sc.qkv, geom, sp, &n.q, &n.k, theta, eps)?,
        (None, Some(r)) => kn.rope_table(s, &mut sc.qkv, geom, sp, &r.inv_freq, r.scale)?,
        (None, None) => {
            return Err(GpuError::Unsupported(
                "attention without q/k norms but no RoPE table loaded".into(),
            ));
        }
    }
    let window = match g.layers[l].attention {
        AttentionKind::Full => 0,
        AttentionKind::Sliding { window } => window,
    };
    if window == 0 && lw.sinks.is_none() {
        kn.kv_append(s, &sc.qkv, geom, sp, kvg, kc, vc)?;
        match at {
            Positions::Prefill(start) => {
                kn.attention_prefill(s, &sc.qkv, geom, start, kvg, kc, vc, scale, &mut sc.attn)?
            }
            Positions::Decode => kn.attention_decode(
                s,
                &sc.qkv,
                geom,
                sp,
                kvg,
                kc,
                vc,
                scale,
                &mut sc.attn_ws,
                &mut sc.attn,
            )?,
        }
    } else {
        let ring = RingAttn {
            sinks: lw.sinks.as_ref(),
            window,
        };
        kn.kv_append_ring(s, &sc.qkv, geom, sp, kvg, kc, vc)?;
        match at {
            Positions::Prefill(start) => kn.attention_prefill_ring(
                s,
                &sc.qkv,
                geom,
                start,
                kvg,
                kc,
                vc,
                scale,
                ring,
                &mut sc.attn,
            )?,
            Positions::Decode => kn.attention_decode_ring(
                s,
                &sc.qkv,
                geom,
                sp,
                kvg,
                kc,
                vc,
                scale,
                ring,
                &mut sc.attn_ws,
                &mut sc.attn,
            )?,
        }
    }
    if decode {
        kn.gemv_bf16::<f32>(s, &sc.attn, &lw.o_proj, 1, h, q, true, &mut sc.residual)?;
    } else {
        cx.gemm(
            (t, h, q),
            cx.p(&sc.attn, 0),
            cx.p(&lw.o_proj, 0),
            cx.p(&sc.residual, 0),
            OutType::F32,
            1.0,
            "o_proj",
        )?;
    }
    if let Some(b) = &lw.o_bias {
        kn.add_bias_rows::<f32>(s, &mut sc.residual, b, t, h)?;
    }
    Ok(())
}
