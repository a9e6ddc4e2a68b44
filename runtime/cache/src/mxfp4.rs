//! Native MXFP4 experts: the builder copies each expert's checkpoint bits
//! into the MXFP4 block layout of [`crate::layout`] (de-interleaving gate/up
//! rows where the checkpoint alternates them), and the CPU dequantizer
//! decodes a cache block exactly (`krasis_model::formats::mxfp4`). Nothing
//! is re-quantised: every E2M1 code, E8M0 scale and BF16 bias byte in the
//! cache is one of the checkpoint's.

use crate::error::CacheError;
use crate::layout::{ExpertFormat, ExpertLayout};
use krasis_model::checkpoint::{RawTensorView, StoredDType};
use krasis_model::formats::mxfp4::{BLOCK_BYTES, BLOCK_VALUES, Mxfp4Matrix};
use krasis_model::{Checkpoint, DType, ExpertBias, ExpertF32, FusedMxfp4Names, ModelError};

/// One MoE layer's fused MXFP4 tensors, shape-checked against the layout.
pub struct FusedLayer<'a> {
    names: &'a FusedMxfp4Names,
    interleaved: bool,
    gate_up_blocks: &'a [u8],
    gate_up_scales: &'a [u8],
    gate_up_bias: Option<&'a [u8]>,
    down_blocks: &'a [u8],
    down_scales: &'a [u8],
    down_bias: Option<&'a [u8]>,
}

/// The tensors of a fused layer in hashing order, with their expected dtype
/// and shape for experts of `layout` (`e` experts per layer).
pub fn fused_tensors(
    names: &FusedMxfp4Names,
    e: usize,
    layout: &ExpertLayout,
) -> Vec<(String, StoredDType, Vec<usize>)> {
    let (h, i) = (layout.hidden, layout.intermediate);
    let u8_ = StoredDType::U8;
    let bf16 = StoredDType::Float(DType::BF16);
    let mut v = vec![
        (
            names.gate_up_blocks.clone(),
            u8_,
            vec![e, 2 * i, h / BLOCK_VALUES, BLOCK_BYTES],
        ),
        (
            names.gate_up_scales.clone(),
            u8_,
            vec![e, 2 * i, h / BLOCK_VALUES],
        ),
    ];
    if let Some(b) = &names.gate_up_bias {
        v.push((b.clone(), bf16, vec![e, 2 * i]));
    }
    v.push((
        names.down_blocks.clone(),
        u8_,
        vec![e, h, i / BLOCK_VALUES, BLOCK_BYTES],
    ));
    v.push((names.down_scales.clone(), u8_, vec![e, h, i / BLOCK_VALUES]));
    if let Some(b) = &names.down_bias {
        v.push((b.clone(), bf16, vec![e, h]));
    }
    v
}

/// Looks up `name` and checks its dtype and shape.
pub fn expect_tensor<'a>(
    ckpt: &'a Checkpoint,
    name: &str,
    dtype: StoredDType,
    shape: &[usize],
) -> Result<RawTensorView<'a>, CacheError> {
    let t = ckpt.expect_raw(name, shape)?;
    if t.dtype != dtype {
        return Err(ModelError::WrongDtype {
            tensor: name.to_string(),
            file: t.file.to_path_buf(),
            found: format!(
                "{} (the MXFP4 expert layout stores it as {})",
                t.dtype.name(),
                dtype.name()
            ),
        }
        .into());
    }
    Ok(t)
}

impl<'a> FusedLayer<'a> {
    /// Checks every tensor's dtype and shape (no weight data is read).
    pub fn open(
        ckpt: &'a Checkpoint,
        names: &'a FusedMxfp4Names,
        experts: usize,
        layout: &ExpertLayout,
    ) -> Result<Self, CacheError> {
        let specs = fused_tensors(names, experts, layout);
        let mut bytes = Vec::with_capacity(specs.len());
        for (name, dtype, shape) in &specs {
            bytes.push(expect_tensor(ckpt, name, *dtype, shape)?.bytes);
        }
        let mut it = bytes.into_iter();
        let mut next = || it.next().expect("one slice per tensor");
        let gate_up_blocks = next();
        let gate_up_scales = next();
        let gate_up_bias = names.gate_up_bias.as_ref().map(|_| next());
        let down_blocks = next();
        let down_scales = next();
        let down_bias = names.down_bias.as_ref().map(|_| next());
        Ok(FusedLayer {
            names,
            interleaved: names.gate_up_interleaved,
            gate_up_blocks,
            gate_up_scales,
            gate_up_bias,
            down_blocks,
            down_scales,
            down_bias,
        })
    }

    /// Expert `e`'s slices of every tensor, in hashing order.
    fn expert_parts(&self, e: usize, layout: &ExpertLayout) -> [&'a [u8]; 6] {
        let slice = |t: Option<&'a [u8]>, n: usize| t.map_or(&[][..], |t| &t[e * n..(e + 1) * n]);
        [
            slice(Some(self.gate_up_blocks), layout.w13_q_bytes()),
            slice(Some(self.gate_up_scales), layout.w13_s_bytes()),
            slice(self.gate_up_bias, 2 * layout.intermediate * 2),
            slice(Some(self.down_blocks), layout.w2_q_bytes()),
            slice(Some(self.down_scales), layout.w2_s_bytes()),
            slice(self.down_bias, layout.hidden * 2),
        ]
    }

    /// Copies expert `e` into `out` (one `expert_stride` block, padding
    /// zeroed) and returns the blake3 of its checkpoint bytes (gate_up
    /// blocks ‖ scales ‖ bias ‖ down blocks ‖ scales ‖ bias as stored).
    /// Every scale is validated first (NaN or overflowing blocks refused).
    pub fn copy_expert(
        &self,
        e: usize,
        layout: &ExpertLayout,
        out: &mut [u8],
    ) -> Result<blake3::Hash, CacheError> {
        assert_eq!(layout.format, ExpertFormat::Mxfp4, "an MXFP4 layout");
        assert_eq!(out.len(), layout.expert_stride, "expert block size");
        let (h, i) = (layout.hidden, layout.intermediate);
        let [gub, gus, gubias, db, ds, dbias] = self.expert_parts(e, layout);
        Mxfp4Matrix::new(&self.names.gate_up_blocks, e, 2 * i, h, gub, gus)?;
        Mxfp4Matrix::new(&self.names.down_blocks, e, h, i, db, ds)?;
        out.fill(0);
        // Rows of w13 in the cache order (gate 0..I, then up 0..I) from the
        // checkpoint's rows (interleaved: gate j = 2j, up j = 2j + 1).
        let src_row = |r: usize| match (self.interleaved, r < i) {
            (false, _) => r,
            (true, true) => 2 * r,
            (true, false) => 2 * (r - i) + 1,
        };
        let copy_rows = |out: &mut [u8], src: &[u8], row_bytes: usize| {
            for (r, dst) in out.chunks_exact_mut(row_bytes).enumerate() {
                let s = src_row(r);
                dst.copy_from_slice(&src[s * row_bytes..(s + 1) * row_bytes]);
            }
        };
        let at = |off: usize, n: usize| off..off + n;
        copy_rows(&mut out[at(layout.w13_q, gub.len())], gub, h / 2);
        copy_rows(&mut out[at(layout.w13_s, gus.len())], gus, h / BLOCK_VALUES);
        copy_rows(&mut out[at(layout.w13_b, gubias.len())], gubias, 2);
        out[at(layout.w2_q, db.len())].copy_from_slice(db);
        out[at(layout.w2_s, ds.len())].copy_from_slice(ds);
        out[at(layout.w2_b, dbias.len())].copy_from_slice(dbias);
        let mut hasher = blake3::Hasher::new();
        for part in [gub, gus, gubias, db, ds, dbias] {
            hasher.update(part);
        }
        Ok(hasher.finalize())
    }

    /// Source bytes of one expert (blocks, scales and biases).
    pub fn expert_bytes(layout: &ExpertLayout) -> u64 {
        (layout.w13_q_bytes()
            + layout.w13_s_bytes()
            + layout.w13_b_bytes()
            + layout.w2_q_bytes()
            + layout.w2_s_bytes()
            + layout.w2_b_bytes()) as u64
    }
}

fn bf16_to_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
        .collect()
}

/// Decodes one MXFP4 cache block exactly (weights and, when the layout has
/// them, biases). The block's scales are validated first, so a corrupt
/// block is refused rather than decoded to NaN or infinite weights.
pub fn dequantize_expert(layout: &ExpertLayout, block: &[u8]) -> Result<ExpertF32, CacheError> {
    assert_eq!(layout.format, ExpertFormat::Mxfp4, "an MXFP4 layout");
    let (h, i) = (layout.hidden, layout.intermediate);
    let part = |off: usize, n: usize| &block[off..off + n];
    let w13 = Mxfp4Matrix::new(
        "cache w13",
        0,
        2 * i,
        h,
        part(layout.w13_q, layout.w13_q_bytes()),
        part(layout.w13_s, layout.w13_s_bytes()),
    )?;
    let w2 = Mxfp4Matrix::new(
        "cache w2",
        0,
        h,
        i,
        part(layout.w2_q, layout.w2_q_bytes()),
        part(layout.w2_s, layout.w2_s_bytes()),
    )?;
    let mut up = w13.dequant();
    let gate: Vec<f32> = up.drain(..i * h).collect();
    let bias = layout.has_bias.then(|| {
        let mut up_b = bf16_to_f32(part(layout.w13_b, layout.w13_b_bytes()));
        let gate_b: Vec<f32> = up_b.drain(..i).collect();
        ExpertBias {
            gate: gate_b,
            up: up_b,
            down: bf16_to_f32(part(layout.w2_b, layout.w2_b_bytes())),
        }
    });
    Ok(ExpertF32 {
        gate,
        up,
        down: w2.dequant(),
        bias,
    })
}
