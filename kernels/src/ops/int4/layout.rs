//! The INT4 expert block layout (cache format v2, precision "int4") and
//! the shape limits of the decode GEMVs, checkable without a GPU.

use crate::Result;
use crate::launch::{ensure, shape_err};

/// The INT4 group sizes the kernels implement (cache format v2).
pub const INT4_GROUPS: [usize; 3] = [32, 64, 128];
/// Largest hidden size of the INT4 decode GEMVs.
pub const INT4_DECODE_MAX_HIDDEN: usize = 8192;
/// Largest expert FFN width of the INT4 decode GEMVs (with top_k 16 only
/// up to 3072: see [`crate::Kernels::int4_w2_combine`]).
pub const INT4_DECODE_MAX_INTER: usize = 4096;
/// Largest top-k of [`crate::Kernels::int4_w2_combine`].
pub const INT4_DECODE_MAX_TOPK: usize = 16;
/// Shared memory one w2 block may use: sm_90's 227 KiB opt-in less the
/// 4 KiB of static partials.
pub(super) const W2_MAX_DYN_SMEM: usize = 227 * 1024 - 4096;

/// Byte offsets of the four arrays inside one expert block, plus the
/// matrix dims and the scale group. Mirrors the INT4 expert layout of
/// cache format v2 (`krasis_cache::layout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Int4Layout {
    pub hidden: usize,
    pub intermediate: usize,
    /// Elements per f16 scale along K: 32, 64 or 128.
    pub group: usize,
    pub w13_q: usize,
    pub w13_s: usize,
    pub w2_q: usize,
    pub w2_s: usize,
}

impl Int4Layout {
    /// The format-v2 INT4 layout: arrays back to back, each 256-byte
    /// aligned (`group = 128` gives exactly the v1 offsets). `None` unless
    /// `group` is 32, 64 or 128 and both dims are positive multiples of it.
    pub fn new(hidden: usize, intermediate: usize, group: usize) -> Option<Self> {
        let (h, i, g) = (hidden, intermediate, group);
        if !INT4_GROUPS.contains(&g) || h == 0 || i == 0 || h % g != 0 || i % g != 0 {
            return None;
        }
        let align = |x: usize| x.div_ceil(256) * 256;
        let w13_q = 0;
        let w13_s = align(w13_q + i * h);
        let w2_q = align(w13_s + 2 * i * (h / g) * 2);
        let w2_s = align(w2_q + h * i / 2);
        Some(Int4Layout {
            hidden: h,
            intermediate: i,
            group: g,
            w13_q,
            w13_s,
            w2_q,
            w2_s,
        })
    }

    /// Bytes the four arrays span from the block start.
    pub fn used_bytes(&self) -> usize {
        self.w2_s + self.hidden * (self.intermediate / self.group) * 2
    }

    /// Whether the INT4 decode GEMVs ([`crate::Kernels::int4_w13_swiglu`] and
    /// [`crate::Kernels::int4_w2_combine`]) run this expert shape at `top_k`: the
    /// same checks the wrappers make, for a pre-flight refusal without a GPU.
    pub fn check_decode(&self, top_k: usize) -> Result<()> {
        const K: &str = "int4 decode";
        self.check_w13(K, top_k)?;
        self.check_w2(K, top_k).map(|_| ())
    }

    pub(super) fn check_w13(&self, k: &'static str, top_k: usize) -> Result<()> {
        self.validate(k)?;
        let h = self.hidden;
        ensure(k, h <= INT4_DECODE_MAX_HIDDEN, || {
            format!(
                "hidden = {h} exceeds the {INT4_DECODE_MAX_HIDDEN} the INT4 decode GEMV supports (dequantize + GEMM instead)"
            )
        })?;
        check_top_k(k, top_k)
    }

    /// Also returns the w2 block's dynamic shared memory.
    pub(super) fn check_w2(&self, k: &'static str, top_k: usize) -> Result<usize> {
        self.validate(k)?;
        let i = self.intermediate;
        ensure(k, i <= INT4_DECODE_MAX_INTER, || {
            format!(
                "intermediate = {i} exceeds the {INT4_DECODE_MAX_INTER} the INT4 decode GEMV supports (dequantize + GEMM instead)"
            )
        })?;
        check_top_k(k, top_k)?;
        w2_smem(k, top_k, i)
    }

    /// log2(group / 32), the kernels' `gl` argument (valid after `validate`).
    pub(super) fn gl(&self) -> u32 {
        (self.group / 32).trailing_zeros()
    }

    pub(super) fn validate(&self, k: &'static str) -> Result<()> {
        let (h, i, g) = (self.hidden, self.intermediate, self.group);
        ensure(k, INT4_GROUPS.contains(&g), || {
            format!("group = {g} is not one of the INT4 groups 32, 64, 128")
        })?;
        ensure(k, h > 0 && i > 0 && h % g == 0 && i % g == 0, || {
            format!(
                "hidden = {h} and intermediate = {i} must be positive multiples of the group {g}"
            )
        })?;
        for (name, off) in [
            ("w13_q", self.w13_q),
            ("w13_s", self.w13_s),
            ("w2_q", self.w2_q),
            ("w2_s", self.w2_s),
        ] {
            if off % 16 != 0 {
                return Err(shape_err(
                    k,
                    format!("offset {name} = {off} is not 16-byte aligned"),
                ));
            }
        }
        if self.w13_s < self.w13_q + i * h
            || self.w2_q < self.w13_s + 2 * i * (h / g) * 2
            || self.w2_s < self.w2_q + h * i / 2
        {
            return Err(shape_err(k, format!("arrays of {self:?} overlap")));
        }
        Ok(())
    }
}

fn check_top_k(k: &'static str, top_k: usize) -> Result<()> {
    ensure(k, (1..=INT4_DECODE_MAX_TOPK).contains(&top_k), || {
        format!("top_k = {top_k} must be in 1..={INT4_DECODE_MAX_TOPK}")
    })
}

/// Dynamic shared memory of a w2 block: per (expert, tile, lane quad) 36
/// u32 of hi/lo act pairs. Refused past what one block may use.
fn w2_smem(k: &'static str, top_k: usize, i: usize) -> Result<usize> {
    let smem = top_k * i.div_ceil(128) * 4 * 36 * 4;
    ensure(k, smem <= W2_MAX_DYN_SMEM, || {
        format!(
            "top_k = {top_k} x intermediate = {i} needs {smem} bytes of shared memory, more than the {W2_MAX_DYN_SMEM} a block may use (lower top_k or dequantize + GEMM)"
        )
    })?;
    Ok(smem)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_validation_refuses_bad_offsets() {
        let l = Int4Layout::new(2048, 768, 128).unwrap();
        assert!(l.validate("t").is_ok());
        assert!(
            Int4Layout {
                w2_q: l.w2_q + 8,
                ..l
            }
            .validate("t")
            .is_err(),
            "misaligned"
        );
        assert!(
            Int4Layout { w13_s: 16, ..l }.validate("t").is_err(),
            "overlap"
        );
        assert!(
            Int4Layout { hidden: 2000, ..l }.validate("t").is_err(),
            "not a multiple of 128"
        );
        let l = Int4Layout::new(2880, 2880, 64).unwrap();
        assert!(l.validate("t").is_ok());
        assert!(
            Int4Layout { group: 128, ..l }.validate("t").is_err(),
            "2880 is not a multiple of 128"
        );
        assert!(
            Int4Layout { group: 16, ..l }.validate("t").is_err(),
            "group 16"
        );
        assert_eq!(l.gl(), 1);
        assert_eq!(Int4Layout::new(2048, 768, 32).unwrap().gl(), 0);
        assert_eq!(Int4Layout::new(2048, 768, 128).unwrap().gl(), 2);
    }

    #[test]
    fn decode_check_covers_the_families_and_refuses_the_rest() {
        let ok = |h, i, g, k| Int4Layout::new(h, i, g).unwrap().check_decode(k);
        for (h, i, g, k) in [
            (2048, 768, 128, 8),  // Qwen3-30B-A3B
            (2880, 2880, 32, 4),  // gpt-oss-120b
            (2880, 2880, 64, 16), // top_k 16 at 2880
            (4096, 1536, 128, 8), // Qwen3-235B-A22B
            (5120, 1408, 64, 8),  // GLM-4.5
            (7168, 2048, 128, 8), // DeepSeek-V3 / Kimi-K2
            (8192, 4096, 32, 8),  // the limits
        ] {
            assert!(ok(h, i, g, k).is_ok(), "{h}x{i} g{g} top-{k}");
        }
        for (h, i, g, k, why) in [
            (8320, 768, 128, 8, "hidden"),
            (2048, 4224, 128, 8, "intermediate"),
            (2048, 4096, 128, 16, "shared memory"),
            (2048, 768, 128, 17, "top_k"),
            (2048, 768, 128, 0, "top_k"),
        ] {
            let e = ok(h, i, g, k).unwrap_err().to_string();
            assert!(e.contains(why), "{h}x{i} top-{k}: {e}");
        }
    }

    #[test]
    fn w2_shared_memory_is_bounded() {
        assert_eq!(w2_smem("t", 8, 768).unwrap(), 8 * 6 * 576);
        assert!(w2_smem("t", 16, 2880).is_ok());
        assert!(w2_smem("t", 8, 4096).is_ok());
        let e = w2_smem("t", 16, 4096).unwrap_err().to_string();
        assert!(e.contains("shared memory"), "{e}");
    }
}
