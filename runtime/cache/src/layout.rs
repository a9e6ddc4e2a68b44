//! Byte layout of one routed expert in the INT4 cache (format version 1).
//!
//! Shared by the builder, the CPU dequantizer and the CUDA kernels; the GPU
//! kernels hard-code the same rules, so any change here bumps
//! `FORMAT_VERSION` in the cache header.
//!
//! An expert is stored as two matrices, both row-major with the reduction
//! dimension K contiguous:
//! - `w13`: gate and up fused, shape `[2*I, H]` (rows `0..I` are gate_proj,
//!   rows `I..2I` are up_proj), K = H. One GEMV over `w13` gives both halves
//!   of SwiGLU, so decode reads one contiguous block per expert.
//! - `w2`: down_proj, shape `[H, I]`, K = I.
//!
//! Quantization is symmetric INT4 with group size 128 along K: for each row
//! and each run of 128 consecutive K elements one f16 scale `s`, and values
//! `q` in 0..=15 that dequantize to `(q - 8) * s`. Exact rule (the witness
//! script re-implements it independently in NumPy, so keep it bit-exact):
//! `amax = max |w|` over the group in f32; `s = f16(amax / 7.0)` (round to
//! nearest even); if `s == 0` every `q = 8`; else
//! `q = clamp(round_ties_even(w / f32(s)) + 8, 0, 15)` with the division in f32. Symmetric because expert
//! weights are zero-centred; a zero point would add 2 bytes per group to every
//! cold-expert copy for no measured gain. The scale is rounded to f16 before
//! quantizing so CPU and GPU dequantization agree exactly.
//!
//! Packing: element `k` of a row is in byte `k / 2`, low nibble for even `k`,
//! high nibble for odd `k`. A 16-byte load therefore holds 32 consecutive K
//! elements of one row, and a 128-element group is exactly four 16-byte loads.
//! Scales are `[rows, K/128]` f16, row-major.
//!
//! Within an expert block the four arrays follow each other, each starting on
//! a 256-byte boundary: `w13_q`, `w13_s`, `w2_q`, `w2_s`. The block is padded
//! to a multiple of 4096 bytes (`expert_stride`), so expert `e` of a layer
//! starts at `layer_offset + e * expert_stride` and one expert moves in one copy.
//! K (H and I) must be multiples of 128.

pub const GROUP_SIZE: usize = 128;
const ARRAY_ALIGN: usize = 256;
const EXPERT_ALIGN: usize = 4096;

fn align(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// Offsets (bytes, relative to the expert block) and sizes of one expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertLayout {
    pub hidden: usize,
    pub intermediate: usize,
    pub w13_q: usize,
    pub w13_s: usize,
    pub w2_q: usize,
    pub w2_s: usize,
    /// Bytes used by the four arrays (without the final padding).
    pub used_bytes: usize,
    /// Distance between consecutive experts of a layer.
    pub expert_stride: usize,
}

impl ExpertLayout {
    /// Layout for hidden size `h` and expert FFN width `i`; `None` unless both
    /// are positive multiples of [`GROUP_SIZE`].
    pub fn new(h: usize, i: usize) -> Option<Self> {
        if h == 0 || i == 0 || !h.is_multiple_of(GROUP_SIZE) || !i.is_multiple_of(GROUP_SIZE) {
            return None;
        }
        let w13_q = 0;
        let w13_s = align(w13_q + 2 * i * h / 2, ARRAY_ALIGN);
        let w2_q = align(w13_s + 2 * i * (h / GROUP_SIZE) * 2, ARRAY_ALIGN);
        let w2_s = align(w2_q + h * i / 2, ARRAY_ALIGN);
        let used_bytes = w2_s + h * (i / GROUP_SIZE) * 2;
        Some(ExpertLayout {
            hidden: h,
            intermediate: i,
            w13_q,
            w13_s,
            w2_q,
            w2_s,
            used_bytes,
            expert_stride: align(used_bytes, EXPERT_ALIGN),
        })
    }
    pub fn w13_q_bytes(&self) -> usize {
        self.intermediate * self.hidden
    }
    pub fn w13_s_len(&self) -> usize {
        2 * self.intermediate * (self.hidden / GROUP_SIZE)
    }
    pub fn w2_q_bytes(&self) -> usize {
        self.hidden * self.intermediate / 2
    }
    pub fn w2_s_len(&self) -> usize {
        self.hidden * (self.intermediate / GROUP_SIZE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a3b_expert_layout() {
        let l = ExpertLayout::new(2048, 768).unwrap();
        assert_eq!(l.w13_s, 2 * 768 * 2048 / 2);
        assert_eq!(l.w2_q % 256, 0);
        assert_eq!(l.expert_stride % 4096, 0);
        assert!(l.expert_stride - l.used_bytes < 4096);
        assert!(ExpertLayout::new(2048, 100).is_none());
    }
}
