//! Byte layout of one routed expert in the expert cache (format version 2),
//! for both expert precisions, exactly as `notes/layout_spec.md` defines it.
//!
//! Shared by the builder, the CPU dequantizers and the CUDA kernels; the GPU
//! kernels hard-code the same rules, so any change here bumps
//! `FORMAT_VERSION` in the cache header.
//!
//! An expert is stored as two matrices, both row-major with the reduction
//! dimension K contiguous:
//! - `w13`: gate and up fused, shape `[2*I, H]` (rows `0..I` are gate_proj,
//!   rows `I..2I` are up_proj, never interleaved: the builder de-interleaves
//!   checkpoints that alternate them), K = H. One GEMV over `w13` gives both
//!   halves of SwiGLU, so decode reads one contiguous block per expert.
//! - `w2`: down_proj, shape `[H, I]`, K = I.
//!
//! # INT4, group g in {32, 64, 128} (precision "int4")
//! Symmetric INT4 with group size g along K: for each row and each run of g
//! consecutive K elements one f16 scale `s`, and values `q` in 0..=15 that
//! dequantize to `(q - 8) * s`. Exact rule (the witness script re-implements
//! it independently in NumPy, so keep it bit-exact): `amax = max |w|` over
//! the group in f32; `s = f16(amax / 7.0)` (round to nearest even); if
//! `s == 0` every `q = 8`; else `q = clamp(round_ties_even(w / f32(s)) + 8, 0, 15)`
//! with the division in f32. Symmetric because expert weights are
//! zero-centred; a zero point would add 2 bytes per group to every
//! cold-expert copy for no measured gain. The scale is rounded to f16 before
//! quantizing so CPU and GPU dequantization agree exactly. Scales are
//! `[rows, K/g]` f16, row-major. The group is the largest of 128/64/32 that
//! divides both H and I ([`ExpertFormat::int4_for`]): qwen3 geometries keep
//! 128 (byte-identical to the format-1 arrays), a 2880-wide model gets 32.
//!
//! # MXFP4, group 32 (precision "mxfp4")
//! Exactly the checkpoint's bits (see `krasis_model::formats::mxfp4`): two
//! E2M1 codes per byte, `[rows, K/32]` E8M0 scale bytes, and, when the
//! architecture has expert biases, one BF16 bias per output row
//! (`w13_b` `[2I]` in w13's row order, `w2_b` `[H]`).
//!
//! # Packing and placement
//! Element `k` of a row is in byte `k / 2`, low nibble for even `k`, high
//! nibble for odd `k` (both precisions). A 16-byte load therefore holds 32
//! consecutive K elements of one row.
//!
//! Within an expert block the arrays follow each other in the order
//! `w13_q, w13_s, w13_b, w2_q, w2_s, w2_b`, each starting on a 256-byte
//! boundary; absent bias arrays have size 0. The block is padded to a
//! multiple of 4096 bytes (`expert_stride`), so expert `e` of a layer starts
//! at `layer_offset + e * expert_stride` and one expert moves in one copy.

use serde::{Deserialize, Serialize};

/// The INT4 group of format 1, and the largest INT4 group of format 2.
pub const GROUP_SIZE: usize = 128;
/// INT4 groups format 2 allows, largest first (the order of preference).
pub const INT4_GROUPS: [usize; 3] = [128, 64, 32];
/// The MXFP4 block size (OCP MX "k").
pub const MXFP4_GROUP: usize = krasis_model::formats::mxfp4::BLOCK_VALUES;
const ARRAY_ALIGN: usize = 256;
const EXPERT_ALIGN: usize = 4096;

fn align(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// Precision of the cached experts, as a user or engine names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExpertPrecision {
    Int4,
    Mxfp4,
}

impl ExpertPrecision {
    pub fn name(self) -> &'static str {
        match self {
            ExpertPrecision::Int4 => "int4",
            ExpertPrecision::Mxfp4 => "mxfp4",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "int4" => Some(ExpertPrecision::Int4),
            "mxfp4" => Some(ExpertPrecision::Mxfp4),
            _ => None,
        }
    }
}

impl std::fmt::Display for ExpertPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Precision and group size of the cached experts, recorded in the header
/// as `{"precision": "int4", "group": 128}` / `{"precision": "mxfp4",
/// "group": 32}` and checked on read (an unknown precision or a group the
/// precision does not allow is refused).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "FormatRecord", into = "FormatRecord")]
pub enum ExpertFormat {
    /// Symmetric INT4, f16 scale per `group` K elements (32, 64 or 128).
    Int4 { group: usize },
    /// The checkpoint's MXFP4 bits (group 32, E8M0 scales).
    Mxfp4,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FormatRecord {
    precision: String,
    group: usize,
}

impl TryFrom<FormatRecord> for ExpertFormat {
    type Error = String;
    fn try_from(r: FormatRecord) -> Result<Self, String> {
        match (r.precision.as_str(), r.group) {
            ("int4", g) if INT4_GROUPS.contains(&g) => Ok(ExpertFormat::Int4 { group: g }),
            ("mxfp4", MXFP4_GROUP) => Ok(ExpertFormat::Mxfp4),
            (p, g) => Err(format!(
                "unknown expert format: precision {p:?} with group {g} (this build knows int4 with group 128/64/32 and mxfp4 with group 32)"
            )),
        }
    }
}

impl From<ExpertFormat> for FormatRecord {
    fn from(f: ExpertFormat) -> Self {
        FormatRecord {
            precision: f.precision().name().to_string(),
            group: f.group(),
        }
    }
}

impl ExpertFormat {
    pub fn precision(self) -> ExpertPrecision {
        match self {
            ExpertFormat::Int4 { .. } => ExpertPrecision::Int4,
            ExpertFormat::Mxfp4 => ExpertPrecision::Mxfp4,
        }
    }
    /// K elements per scale.
    pub fn group(self) -> usize {
        match self {
            ExpertFormat::Int4 { group } => group,
            ExpertFormat::Mxfp4 => MXFP4_GROUP,
        }
    }
    /// INT4 with the largest group of [`INT4_GROUPS`] dividing both `h` and
    /// `i`; `None` when none does (or either is 0).
    pub fn int4_for(h: usize, i: usize) -> Option<Self> {
        (h > 0 && i > 0)
            .then(|| {
                INT4_GROUPS
                    .into_iter()
                    .find(|&g| h.is_multiple_of(g) && i.is_multiple_of(g))
            })
            .flatten()
            .map(|group| ExpertFormat::Int4 { group })
    }
}

impl std::fmt::Display for ExpertFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} group {}", self.precision(), self.group())
    }
}

/// Offsets (bytes, relative to the expert block) and sizes of one expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertLayout {
    pub format: ExpertFormat,
    pub hidden: usize,
    pub intermediate: usize,
    /// Whether the bias arrays are present (MXFP4 of gpt_oss only).
    pub has_bias: bool,
    pub w13_q: usize,
    pub w13_s: usize,
    /// Offset of the w13 bias (size 0 without biases).
    pub w13_b: usize,
    pub w2_q: usize,
    pub w2_s: usize,
    /// Offset of the w2 bias (size 0 without biases).
    pub w2_b: usize,
    /// Bytes used by the arrays (without the final padding).
    pub used_bytes: usize,
    /// Distance between consecutive experts of a layer.
    pub expert_stride: usize,
}

impl ExpertLayout {
    /// Layout of `format` for hidden size `h` and expert FFN width `i`;
    /// `None` unless both are positive multiples of the format's group, or
    /// when INT4 is asked to carry biases (format 2 defines biases for MXFP4
    /// only).
    pub fn new(format: ExpertFormat, h: usize, i: usize, has_bias: bool) -> Option<Self> {
        let g = format.group();
        if h == 0 || i == 0 || !h.is_multiple_of(g) || !i.is_multiple_of(g) {
            return None;
        }
        if has_bias && format.precision() == ExpertPrecision::Int4 {
            return None;
        }
        let mut l = ExpertLayout {
            format,
            hidden: h,
            intermediate: i,
            has_bias,
            w13_q: 0,
            w13_s: 0,
            w13_b: 0,
            w2_q: 0,
            w2_s: 0,
            w2_b: 0,
            used_bytes: 0,
            expert_stride: 0,
        };
        l.w13_s = align(l.w13_q + l.w13_q_bytes(), ARRAY_ALIGN);
        l.w13_b = align(l.w13_s + l.w13_s_bytes(), ARRAY_ALIGN);
        l.w2_q = align(l.w13_b + l.w13_b_bytes(), ARRAY_ALIGN);
        l.w2_s = align(l.w2_q + l.w2_q_bytes(), ARRAY_ALIGN);
        l.w2_b = align(l.w2_s + l.w2_s_bytes(), ARRAY_ALIGN);
        l.used_bytes = if has_bias {
            l.w2_b + l.w2_b_bytes()
        } else {
            l.w2_s + l.w2_s_bytes()
        };
        l.expert_stride = align(l.used_bytes, EXPERT_ALIGN);
        Some(l)
    }
    /// The INT4 layout with the largest group that fits (no biases).
    pub fn int4(h: usize, i: usize) -> Option<Self> {
        ExpertLayout::new(ExpertFormat::int4_for(h, i)?, h, i, false)
    }
    pub fn group(&self) -> usize {
        self.format.group()
    }
    /// Bytes of one scale: f16 for INT4, one E8M0 byte for MXFP4.
    pub fn scale_bytes(&self) -> usize {
        match self.format {
            ExpertFormat::Int4 { .. } => 2,
            ExpertFormat::Mxfp4 => 1,
        }
    }
    pub fn w13_q_bytes(&self) -> usize {
        self.intermediate * self.hidden
    }
    /// Number of w13 scales (`2I * H/g`).
    pub fn w13_s_len(&self) -> usize {
        2 * self.intermediate * (self.hidden / self.group())
    }
    pub fn w13_s_bytes(&self) -> usize {
        self.w13_s_len() * self.scale_bytes()
    }
    /// `2I` BF16 values with biases, else 0.
    pub fn w13_b_bytes(&self) -> usize {
        if self.has_bias {
            2 * self.intermediate * 2
        } else {
            0
        }
    }
    pub fn w2_q_bytes(&self) -> usize {
        self.hidden * self.intermediate / 2
    }
    /// Number of w2 scales (`H * I/g`).
    pub fn w2_s_len(&self) -> usize {
        self.hidden * (self.intermediate / self.group())
    }
    pub fn w2_s_bytes(&self) -> usize {
        self.w2_s_len() * self.scale_bytes()
    }
    /// `H` BF16 values with biases, else 0.
    pub fn w2_b_bytes(&self) -> usize {
        if self.has_bias { self.hidden * 2 } else { 0 }
    }
}

#[cfg(test)]
mod tests;
