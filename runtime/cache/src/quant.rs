//! The INT4 quantizer and dequantizer: the exact rule of [`crate::layout`].
//!
//! This is the hot path of a cache build (every routed-expert weight passes
//! through it once), so the group kernel works on fixed-size arrays (one
//! monomorphised copy per group size 128/64/32) that LLVM vectorises: integer abs-max on the f32 bit patterns (which also
//! catches NaN/Inf in one compare), one f32 division per element as the rule
//! requires (a reciprocal multiply would round differently), and
//! round-half-even by the 1.5·2^23 add/subtract trick, which is exact for
//! |x| < 2^22 (here |x| ≤ ~10.5, see `round_ties_even_small`).

use crate::layout::{ExpertFormat, ExpertLayout, INT4_GROUPS};
use half::f16;
use krasis_model::{DType, ExpertF32};

/// Version of the quantization rule; stored in the cache header so a cache
/// written by a different rule is never read.
pub const QUANTIZER_VERSION: u32 = 1;

/// Why a group of weights cannot be quantized.
#[derive(Debug, Clone, PartialEq)]
pub enum GroupError {
    /// A NaN or infinity at this element index within the matrix.
    NonFinite { index: usize },
    /// `amax / 7` exceeds the f16 range, so the scale would be infinite.
    ScaleOverflow { index: usize, amax: f32 },
}

impl std::fmt::Display for GroupError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GroupError::NonFinite { index } => {
                write!(
                    f,
                    "non-finite value (NaN or Inf) in the group starting at element {index}"
                )
            }
            GroupError::ScaleOverflow { index, amax } => write!(
                f,
                "|w| up to {amax} in the group starting at element {index} exceeds the f16 scale range (|w| must stay below 7 x 65504)"
            ),
        }
    }
}

/// A row-major source matrix `[rows, k]` in checkpoint precision.
#[derive(Debug, Clone, Copy)]
pub struct SourceMatrix<'a> {
    pub dtype: DType,
    pub bytes: &'a [u8],
}

const ROUND_MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23

/// Round half to even for |x| < 2^22: adding 1.5·2^23 moves x into
/// [2^23, 2^24) where the f32 ulp is 1, so the hardware's round-to-nearest-even
/// of the sum is the rounding of x (1.5·2^23 is even); the subtraction is exact.
#[inline(always)]
fn round_ties_even_small(x: f32) -> f32 {
    (x + ROUND_MAGIC) - ROUND_MAGIC
}

#[inline(always)]
fn load_group<const G: usize>(dtype: DType, src: &[u8], out: &mut [f32; G]) {
    match dtype {
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
    }
}

/// Quantizes one group: writes `G / 2` packed bytes to `q` and returns the
/// f16 scale bits. `index` is only used in error reports.
#[inline(always)]
fn quantize_group<const G: usize>(
    w: &[f32; G],
    q: &mut [u8],
    index: usize,
) -> Result<u16, GroupError> {
    let mut amax_bits = 0u32;
    for x in w {
        amax_bits = amax_bits.max(x.to_bits() & 0x7fff_ffff);
    }
    if amax_bits >= 0x7f80_0000 {
        return Err(GroupError::NonFinite { index });
    }
    let amax = f32::from_bits(amax_bits);
    let s = f16::from_f32(amax / 7.0);
    if s.is_infinite() {
        return Err(GroupError::ScaleOverflow { index, amax });
    }
    if s.to_bits() == 0 {
        q[..G / 2].fill(0x88);
        return Ok(0);
    }
    let sf = s.to_f32();
    let mut qi = [0u8; G];
    for (o, x) in qi.iter_mut().zip(w) {
        let r = (round_ties_even_small(x / sf) + 8.0).clamp(0.0, 15.0);
        // SAFETY: r is finite and in [0, 15] (w is finite, sf > 0, clamped).
        *o = unsafe { r.to_int_unchecked::<i32>() } as u8;
    }
    // Two nibbles per byte: with lo, hi < 16, the u16 lo + 256*hi shifted
    // right by 4 puts hi at bits 4..8, so (v | v >> 4) as u8 == lo | hi << 4.
    for (b, pair) in q[..G / 2].iter_mut().zip(qi.chunks_exact(2)) {
        let v = u16::from_le_bytes([pair[0], pair[1]]);
        *b = (v | (v >> 4)) as u8;
    }
    Ok(s.to_bits())
}

/// Quantizes `src` (`rows` × `k`, row-major) into packed nibbles `q`
/// (`rows * k / 2` bytes) and little-endian f16 scales `s`
/// (`rows * k / group * 2` bytes). `group` is one of 128/64/32 and divides `k`.
///
/// # Panics
/// On any other group (a caller bug: groups come from a validated layout).
pub fn quantize_rows(
    src: SourceMatrix<'_>,
    rows: usize,
    k: usize,
    group: usize,
    q: &mut [u8],
    s: &mut [u8],
) -> Result<(), GroupError> {
    match group {
        128 => quantize_rows_dispatch::<128>(src, rows, k, q, s),
        64 => quantize_rows_dispatch::<64>(src, rows, k, q, s),
        32 => quantize_rows_dispatch::<32>(src, rows, k, q, s),
        g => panic!("INT4 group {g} is not one of {INT4_GROUPS:?}"),
    }
}

fn quantize_rows_dispatch<const G: usize>(
    src: SourceMatrix<'_>,
    rows: usize,
    k: usize,
    q: &mut [u8],
    s: &mut [u8],
) -> Result<(), GroupError> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { quantize_rows_avx2::<G>(src, rows, k, q, s) };
        }
    }
    quantize_rows_portable::<G>(src, rows, k, q, s)
}

/// The same code compiled with AVX2 (8-wide division, u32 max, conversions):
/// bit-identical results, since Rust never contracts or reassociates float ops.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_rows_avx2<const G: usize>(
    src: SourceMatrix<'_>,
    rows: usize,
    k: usize,
    q: &mut [u8],
    s: &mut [u8],
) -> Result<(), GroupError> {
    quantize_rows_portable::<G>(src, rows, k, q, s)
}

#[inline(always)]
fn quantize_rows_portable<const G: usize>(
    src: SourceMatrix<'_>,
    rows: usize,
    k: usize,
    q: &mut [u8],
    s: &mut [u8],
) -> Result<(), GroupError> {
    assert_eq!(k % G, 0, "K is a multiple of the group");
    let esz = src.dtype.size();
    let groups = rows * k / G;
    assert_eq!(src.bytes.len(), rows * k * esz, "source matrix size");
    assert_eq!(q.len(), rows * k / 2, "packed output size");
    assert_eq!(s.len(), groups * 2, "scale output size");
    let mut w = [0f32; G];
    for (g, ((src_g, q_g), s_g)) in src
        .bytes
        .chunks_exact(G * esz)
        .zip(q.chunks_exact_mut(G / 2))
        .zip(s.chunks_exact_mut(2))
        .enumerate()
    {
        load_group(src.dtype, src_g, &mut w);
        let bits = quantize_group(&w, q_g, g * G)?;
        s_g.copy_from_slice(&bits.to_le_bytes());
    }
    Ok(())
}

/// Inverse of [`quantize_rows`]: `out[i] = (q[i] - 8) * f32(s[group(i)])`,
/// which is exact in f32 (a 4-bit integer times an 11-bit mantissa).
pub fn dequantize_rows(q: &[u8], s: &[u8], group: usize, out: &mut [f32]) {
    assert!(INT4_GROUPS.contains(&group), "INT4 group {group}");
    assert_eq!(q.len() * 2, out.len(), "packed input size");
    assert_eq!(s.len() * group / 2, out.len(), "scale input size");
    for ((o_g, q_g), s_g) in out
        .chunks_exact_mut(group)
        .zip(q.chunks_exact(group / 2))
        .zip(s.chunks_exact(2))
    {
        let sf = f16::from_bits(u16::from_le_bytes([s_g[0], s_g[1]])).to_f32();
        for (o, &b) in o_g.chunks_exact_mut(2).zip(q_g) {
            o[0] = ((b & 0x0f) as f32 - 8.0) * sf;
            o[1] = ((b >> 4) as f32 - 8.0) * sf;
        }
    }
}

/// Which source matrix of an expert a [`GroupError`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertPart {
    Gate,
    Up,
    Down,
}

/// Quantizes one expert into `out` (exactly `layout.expert_stride` bytes):
/// `gate`/`up` are `[I, H]`, `down` is `[H, I]`. Padding is zeroed so the
/// file content is a pure function of the source.
pub fn quantize_expert(
    layout: &ExpertLayout,
    gate: SourceMatrix<'_>,
    up: SourceMatrix<'_>,
    down: SourceMatrix<'_>,
    out: &mut [u8],
) -> Result<(), (ExpertPart, GroupError)> {
    let (h, i, g) = (layout.hidden, layout.intermediate, layout.group());
    assert!(
        matches!(layout.format, ExpertFormat::Int4 { .. }),
        "quantize_expert writes INT4 blocks, the layout is {}",
        layout.format
    );
    assert_eq!(out.len(), layout.expert_stride, "expert block size");
    let half_q = layout.w13_q_bytes() / 2;
    let half_s = layout.w13_s_bytes() / 2;
    {
        let (w13_q, rest) = out[layout.w13_q..].split_at_mut(layout.w13_q_bytes());
        let (gate_q, up_q) = w13_q.split_at_mut(half_q);
        let s_off = layout.w13_s - layout.w13_q - layout.w13_q_bytes();
        rest[..s_off].fill(0);
        let w13_s = &mut rest[s_off..s_off + layout.w13_s_bytes()];
        let (gate_s, up_s) = w13_s.split_at_mut(half_s);
        quantize_rows(gate, i, h, g, gate_q, gate_s).map_err(|e| (ExpertPart::Gate, e))?;
        quantize_rows(up, i, h, g, up_q, up_s).map_err(|e| (ExpertPart::Up, e))?;
    }
    let w13_s_end = layout.w13_s + layout.w13_s_bytes();
    out[w13_s_end..layout.w2_q].fill(0);
    let w2_q_end = layout.w2_q + layout.w2_q_bytes();
    out[w2_q_end..layout.w2_s].fill(0);
    let (head, w2_s_and_pad) = out.split_at_mut(layout.w2_s);
    let (w2_s, pad) = w2_s_and_pad.split_at_mut(layout.w2_s_bytes());
    pad.fill(0);
    quantize_rows(down, h, i, g, &mut head[layout.w2_q..w2_q_end], w2_s)
        .map_err(|e| (ExpertPart::Down, e))?;
    Ok(())
}

/// Dequantizes one INT4 expert block (at least `layout.used_bytes` long) to
/// the Hugging Face layout of [`ExpertF32`].
pub fn dequantize_expert(layout: &ExpertLayout, block: &[u8]) -> ExpertF32 {
    let (h, i, g) = (layout.hidden, layout.intermediate, layout.group());
    assert!(
        matches!(layout.format, ExpertFormat::Int4 { .. }),
        "dequantize_expert reads INT4 blocks, the layout is {}",
        layout.format
    );
    let half_q = layout.w13_q_bytes() / 2;
    let half_s = layout.w13_s_bytes() / 2;
    let w13_q = &block[layout.w13_q..layout.w13_q + layout.w13_q_bytes()];
    let w13_s = &block[layout.w13_s..layout.w13_s + layout.w13_s_bytes()];
    let mut gate = vec![0f32; i * h];
    let mut up = vec![0f32; i * h];
    let mut down = vec![0f32; h * i];
    dequantize_rows(&w13_q[..half_q], &w13_s[..half_s], g, &mut gate);
    dequantize_rows(&w13_q[half_q..], &w13_s[half_s..], g, &mut up);
    dequantize_rows(
        &block[layout.w2_q..layout.w2_q + layout.w2_q_bytes()],
        &block[layout.w2_s..layout.w2_s + layout.w2_s_bytes()],
        g,
        &mut down,
    );
    ExpertF32 {
        gate,
        up,
        down,
        bias: None,
    }
}

#[cfg(test)]
mod tests;
