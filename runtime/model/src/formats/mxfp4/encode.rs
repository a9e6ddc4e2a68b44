//! A deterministic MXFP4 encoder (f32 → E2M1 codes + E8M0 scales), the
//! inverse of the decoder next to it. Published gpt-oss checkpoints are
//! quantized by OpenAI's own tooling; this encoder exists so synthetic
//! checkpoints (`krasis-runtime synth`) can hold MXFP4 experts in the
//! published layout. Whatever it writes, the MXFP4 bytes are the
//! checkpoint's truth: readers decode them, never the f32 values they came
//! from.
//!
//! # The rule (documented so another implementation can reproduce the bytes)
//! For each block of 32 consecutive values along a row:
//! 1. `amax` = the largest `|w|` of the block.
//! 2. The scale exponent `e` is the smallest integer with
//!    `amax <= 6 * 2^e` (so the block's largest magnitude fits E2M1's ±6
//!    without clipping), clamped below at `-127` (scale byte 0, whose
//!    `2^-127` already represents every smaller block as well as any
//!    scale could); an all-zero block gets byte 0 too. The scale byte is
//!    `e + 127`. (OCP MX v1.0's example rule, `floor(log2(amax)) - 2`, may
//!    instead clip the largest values to ±6; this one never clips.)
//! 3. Each value's code is the E2M1 value nearest to `|w| / 2^e`, ties to
//!    the even code (mantissa bit 0), as IEEE round-to-nearest-even does;
//!    the sign bit is the sign of `w` (so a negative value that rounds to
//!    zero becomes code 8, negative zero).
//!
//! All arithmetic is exact: `|w| / 2^e` is computed in f64, where dividing an
//! f32 by a power of two in `2^-127..2^125` loses nothing, and the midpoints
//! between E2M1 values are exact binary fractions.

use super::{BLOCK_BYTES, BLOCK_VALUES, FIRST_SCALE_THAT_CAN_OVERFLOW, SCALE_BIAS};

/// Magnitudes of the positive E2M1 codes 0..=7.
const MAGNITUDES: [f64; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
/// The largest E2M1 magnitude.
const E2M1_MAX: f64 = 6.0;
/// The largest scale byte the encoder uses: at
/// [`FIRST_SCALE_THAT_CAN_OVERFLOW`] and above some decoded values are no
/// longer finite f32s, and the decoder refuses such blocks.
pub const MAX_ENCODED_SCALE: u8 = FIRST_SCALE_THAT_CAN_OVERFLOW - 1;

/// The E8M0 scale byte the rule above gives a block whose largest magnitude
/// is `amax`, or `None` when `amax` is not finite or too large for a scale
/// the decoder accepts (`amax > 6 * 2^125`).
pub fn scale_for(amax: f32) -> Option<u8> {
    if !amax.is_finite() || amax < 0.0 {
        return None;
    }
    let amax = f64::from(amax);
    let min_e = -SCALE_BIAS;
    let max_e = i32::from(MAX_ENCODED_SCALE) - SCALE_BIAS;
    if amax <= E2M1_MAX * 2f64.powi(min_e) {
        return Some(0);
    }
    // An estimate from log2, then corrected with exact comparisons (powers
    // of two and their products with 6 are exact in f64).
    let mut e = ((amax / E2M1_MAX).log2().ceil() as i32).clamp(min_e, max_e + 1);
    while e > min_e && amax <= E2M1_MAX * 2f64.powi(e - 1) {
        e -= 1;
    }
    while amax > E2M1_MAX * 2f64.powi(e) {
        e += 1;
    }
    (e <= max_e).then(|| (e + SCALE_BIAS) as u8)
}

/// The E2M1 code (0..=15) nearest to `w / 2^(scale - 127)`, ties to even.
/// The caller chose `scale` so the quotient's magnitude is at most 6.
fn code_for(w: f32, scale: u8) -> u8 {
    let x = f64::from(w.abs()) * 2f64.powi(SCALE_BIAS - i32::from(scale));
    let mut best = 0usize;
    for (c, &m) in MAGNITUDES.iter().enumerate().skip(1) {
        let (d, bd) = ((x - m).abs(), (x - MAGNITUDES[best]).abs());
        // Strictly nearer, or a tie won by the even code.
        if d < bd || (d == bd && c % 2 == 0) {
            best = c;
        }
    }
    let sign = if w.is_sign_negative() { 8 } else { 0 };
    best as u8 | sign
}

/// Encodes one block of 32 values into 16 bytes (element `2j` in the low
/// nibble of byte `j`, as the checkpoints pack them) and returns its scale
/// byte; `None` (block untouched) when a value is not finite or the block
/// is too large for MXFP4 (see [`scale_for`]).
pub fn encode_block(values: &[f32], block: &mut [u8]) -> Option<u8> {
    assert_eq!(values.len(), BLOCK_VALUES, "an MXFP4 block holds 32 values");
    assert_eq!(block.len(), BLOCK_BYTES, "an MXFP4 block is 16 bytes");
    if values.iter().any(|v| !v.is_finite()) {
        return None;
    }
    let amax = values.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = scale_for(amax)?;
    for (byte, pair) in block.iter_mut().zip(values.chunks_exact(2)) {
        *byte = code_for(pair[0], scale) | (code_for(pair[1], scale) << 4);
    }
    Some(scale)
}

/// Encodes rows of `cols` values (`values.len()` a multiple of `cols`,
/// `cols` a multiple of 32) into `blocks` (`values.len() / 2` bytes) and
/// `scales` (`values.len() / 32` bytes), row-major like the checkpoint's
/// `*_blocks` / `*_scales`. Returns the index of the first block that
/// cannot be encoded (see [`encode_block`]); the output is then partial.
pub fn encode_rows(
    values: &[f32],
    cols: usize,
    blocks: &mut [u8],
    scales: &mut [u8],
) -> Result<(), usize> {
    assert!(
        cols > 0 && cols.is_multiple_of(BLOCK_VALUES) && values.len().is_multiple_of(cols),
        "MXFP4 rows must be whole blocks"
    );
    assert_eq!(blocks.len(), values.len() / 2, "blocks buffer size");
    assert_eq!(
        scales.len(),
        values.len() / BLOCK_VALUES,
        "scales buffer size"
    );
    for (i, ((v, b), s)) in values
        .chunks_exact(BLOCK_VALUES)
        .zip(blocks.chunks_exact_mut(BLOCK_BYTES))
        .zip(scales.iter_mut())
        .enumerate()
    {
        *s = encode_block(v, b).ok_or(i)?;
    }
    Ok(())
}

/// The values [`encode_block`] represents `values` by (what the decoder
/// returns for its output), for tests and for callers that want the
/// quantized values without the bytes.
pub fn quantize_block(values: &[f32]) -> Option<[f32; BLOCK_VALUES]> {
    let mut block = [0u8; BLOCK_BYTES];
    let scale = encode_block(values, &mut block)?;
    let mut out = [0f32; BLOCK_VALUES];
    super::decode_block(&block, scale, &mut out);
    debug_assert!(out.iter().all(|v| v.is_finite()));
    Some(out)
}
