//! Synthetic MXFP4 experts (gpt_oss): which tensors of a fused-MXFP4 layer
//! are encoded from which drawn values, and one expert regenerated on its
//! own ([`expert_mxfp4`]), byte-identical to what the shard writer stores.
//!
//! A projection's f32 values are drawn like any weight (std `1/sqrt(fan_in)`)
//! under the projection's name without the `_blocks`/`_scales` suffix, over
//! its fused row-major `[E, rows, cols]` (for `gate_up_proj`, rows alternate
//! gate and up as stored), and are NOT rounded through `--dtype`: the encoder
//! ([`crate::formats::mxfp4::encode_rows`]) turns them into the blocks and
//! scales, and those bytes are the checkpoint's values. Expert biases are
//! ordinary float tensors of the dtype.

use super::spec::{BIAS_STD, Mxfp4Part, Storage, SynthSpec};
use super::values::{Init, fill_f32};
use crate::arch::{ExpertStorage, FusedMxfp4Names, Geometry, ModelConfig};
use crate::experts::{ExpertBias, ExpertF32};
use crate::formats::mxfp4::{BLOCK_VALUES, Mxfp4Shape, Mxfp4Tensor, encode_rows};
use std::collections::HashMap;

/// The rule recorded in `krasis_synth.json` of checkpoints with MXFP4 experts.
pub const MXFP4_RULE: &str = "MXFP4 experts (TENSOR_blocks/TENSOR_scales): the f32 values of \
element i of the projection TENSOR's row-major [E, rows, cols] are drawn by the value rule under \
the name TENSOR with std 1/sqrt(cols) and not rounded to the dtype; each 32-value block along a \
row gets E8M0 scale byte e+127, e the smallest integer with max|w| <= 6*2^e (at least -127), and \
each value the nearest E2M1 code of |w|/2^e, ties to the even code, with the sign of w; element 2j \
is the low nibble of byte j. Expert biases (TENSOR_bias) are float tensors of std 0.1";

/// Drawing rules of every tensor of the fused-MXFP4 layers, by name.
pub(super) fn fused_expert_tensors(
    config: &ModelConfig,
    g: &Geometry,
) -> HashMap<String, (Init, Storage)> {
    let mut m = HashMap::new();
    for l in g.moe_layers() {
        let ExpertStorage::FusedMxfp4(n) = config.expert_storage(l) else {
            continue;
        };
        for (blocks, scales, cols) in [
            (&n.gate_up_blocks, &n.gate_up_scales, g.hidden),
            (&n.down_blocks, &n.down_scales, g.expert_intermediate),
        ] {
            let init = Init::Normal {
                std: 1.0 / (cols as f32).sqrt(),
            };
            let source = source_name(blocks);
            for (name, part) in [(blocks, Mxfp4Part::Blocks), (scales, Mxfp4Part::Scales)] {
                let storage = Storage::Mxfp4 {
                    part,
                    source: source.clone(),
                };
                m.insert(name.clone(), (init.clone(), storage));
            }
        }
        for bias in [&n.gate_up_bias, &n.down_bias].into_iter().flatten() {
            m.insert(
                bias.clone(),
                (Init::Normal { std: BIAS_STD }, Storage::Float),
            );
        }
    }
    m
}

/// `...gate_up_proj_blocks` → `...gate_up_proj`.
fn source_name(blocks: &str) -> String {
    blocks.strip_suffix("_blocks").unwrap_or(blocks).to_string()
}

/// Encodes source values `start..start + len` (whole blocks) of an MXFP4
/// projection and returns the bytes of `part` for them.
pub(super) fn encode_piece(
    seed: u64,
    source: &str,
    init: &Init,
    part: Mxfp4Part,
    start: usize,
    len: usize,
) -> Vec<u8> {
    debug_assert!(start.is_multiple_of(BLOCK_VALUES) && len.is_multiple_of(BLOCK_VALUES));
    let mut vals = vec![0f32; len];
    // Row length only matters to router inits, never used for experts.
    fill_f32(
        seed,
        source,
        init,
        super::SynthDtype::F32,
        1,
        start,
        &mut vals,
    );
    let mut blocks = vec![0u8; len / 2];
    let mut scales = vec![0u8; len / BLOCK_VALUES];
    encode_rows(&vals, BLOCK_VALUES, &mut blocks, &mut scales)
        .expect("drawn values are finite and bounded (|w| < 3.5 std)");
    match part {
        Mxfp4Part::Blocks => blocks,
        Mxfp4Part::Scales => scales,
    }
}

/// One expert of a fused-MXFP4 layer exactly as the checkpoint stores it.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertMxfp4 {
    /// `[2I, H/32, 16]`: gate/up rows as stored (interleaved for gpt_oss,
    /// see [`FusedMxfp4Names::gate_up_interleaved`]).
    pub gate_up_blocks: Vec<u8>,
    /// `[2I, H/32]` E8M0 bytes.
    pub gate_up_scales: Vec<u8>,
    /// `[H, I/32, 16]`.
    pub down_blocks: Vec<u8>,
    /// `[H, I/32]`.
    pub down_scales: Vec<u8>,
    /// `[2I]` as stored (same row order as the blocks), already rounded
    /// through the dtype; `None` when the layer has no such bias.
    pub gate_up_bias: Option<Vec<f32>>,
    /// `[H]`, rounded through the dtype.
    pub down_bias: Option<Vec<f32>>,
}

fn fused_names(spec: &SynthSpec, layer: usize) -> Option<FusedMxfp4Names> {
    let g = spec.geometry();
    if layer >= g.num_layers || g.mlp_kind(layer) != crate::MlpKind::Moe {
        return None;
    }
    match spec.config().expert_storage(layer) {
        ExpertStorage::FusedMxfp4(n) => Some(n),
        ExpertStorage::PerExpert => None,
    }
}

/// The raw MXFP4 blocks, scales and biases of one routed expert, generated
/// on their own and identical to the checkpoint's bytes; `None` unless
/// `layer` is a MoE layer whose experts are stored as fused MXFP4.
pub fn expert_mxfp4(spec: &SynthSpec, layer: usize, expert: usize) -> Option<ExpertMxfp4> {
    let n = fused_names(spec, layer)?;
    let g = spec.geometry();
    let (h, i) = (g.hidden, g.expert_intermediate);
    let proj = |blocks: &str, rows: usize, cols: usize| {
        let t = spec.tensor(blocks).expect("blocks tensor of the layer");
        let Storage::Mxfp4 { source, .. } = &t.storage else {
            unreachable!("fused expert blocks are MXFP4 parts");
        };
        let (start, len) = (expert * rows * cols, rows * cols);
        let enc = |part| encode_piece(spec.seed, source, &t.init, part, start, len);
        (enc(Mxfp4Part::Blocks), enc(Mxfp4Part::Scales))
    };
    let (gate_up_blocks, gate_up_scales) = proj(&n.gate_up_blocks, 2 * i, h);
    let (down_blocks, down_scales) = proj(&n.down_blocks, h, i);
    let bias = |name: &Option<String>, len: usize| {
        name.as_ref().map(|name| {
            let t = spec.tensor(name).expect("bias tensor of the layer");
            let mut v = vec![0f32; len];
            fill_f32(
                spec.seed,
                name,
                &t.init,
                spec.dtype,
                t.row_len(),
                expert * len,
                &mut v,
            );
            v
        })
    };
    Some(ExpertMxfp4 {
        gate_up_blocks,
        gate_up_scales,
        down_blocks,
        down_scales,
        gate_up_bias: bias(&n.gate_up_bias, 2 * i),
        down_bias: bias(&n.down_bias, h),
    })
}

/// The f32 weights an [`ExpertMxfp4`] of `layer` stands for: the exact MXFP4
/// decode, gate/up split by the layer's row order, biases split likewise.
pub(super) fn decode_expert(spec: &SynthSpec, layer: usize, raw: &ExpertMxfp4) -> ExpertF32 {
    let n = fused_names(spec, layer).expect("a fused MXFP4 layer");
    let g = spec.geometry();
    let (h, i) = (g.hidden, g.expert_intermediate);
    let matrix = |name: &str, gate_up: bool, rows, cols, blocks: &[u8], scales: &[u8]| {
        let shape = Mxfp4Shape::new(1, rows, cols).expect("MXFP4 widths are whole blocks");
        let t = Mxfp4Tensor::new(name, shape, blocks, scales)
            .expect("the encoder writes only scales the decoder accepts");
        let m = t.expert(0).expect("expert 0 of a one-expert tensor");
        if gate_up && n.gate_up_interleaved {
            m.dequant_gate_up()
        } else if gate_up {
            let mut all = m.dequant();
            let up = all.split_off(i * cols);
            (all, up)
        } else {
            (m.dequant(), Vec::new())
        }
    };
    let (gate, up) = matrix(
        &n.gate_up_blocks,
        true,
        2 * i,
        h,
        &raw.gate_up_blocks,
        &raw.gate_up_scales,
    );
    let (down, _) = matrix(
        &n.down_blocks,
        false,
        h,
        i,
        &raw.down_blocks,
        &raw.down_scales,
    );
    let bias = match (&raw.gate_up_bias, &raw.down_bias) {
        (Some(gu), Some(d)) => {
            let (bg, bu) = if n.gate_up_interleaved {
                (
                    gu.iter().step_by(2).copied().collect(),
                    gu.iter().skip(1).step_by(2).copied().collect(),
                )
            } else {
                (gu[..i].to_vec(), gu[i..].to_vec())
            };
            Some(ExpertBias {
                gate: bg,
                up: bu,
                down: d.clone(),
            })
        }
        _ => None,
    };
    ExpertF32 {
        gate,
        up,
        down,
        bias,
    }
}
