//! MXFP4 (OCP Microscaling Formats v1.0, "MXFP4"): the routed-expert format of
//! gpt-oss checkpoints, described and decoded exactly.
//!
//! # The format, as gpt-oss ships it
//! Each expert projection is three tensors (checked against Hugging Face
//! transformers' `integrations/mxfp4.py` and OpenAI's `gpt_oss/torch/weights.py`):
//! - `<proj>_blocks`: U8 `[experts, rows, cols/32, 16]`. `rows` is the output
//!   dimension and `cols` (K, the input dimension) is the reduction axis, as in
//!   an `nn.Linear` weight: `gate_up_proj` is `[E, 2*I, H/32, 16]`,
//!   `down_proj` is `[E, H, I/32, 16]`. The 16 bytes of a block hold 32
//!   consecutive K elements of one row; element `2j` is the LOW nibble of byte
//!   `j`, element `2j+1` the HIGH nibble.
//! - `<proj>_scales`: U8 `[experts, rows, cols/32]`, one E8M0 scale per block:
//!   the value `2^(s-127)`; `s = 255` is NaN (OCP MX v1.0: E8M0 has no
//!   zero, sign or infinity).
//! - `<proj>_bias`: BF16 `[experts, rows]`, not quantized (read it as any BF16
//!   tensor; it is not part of this format).
//!
//! A nibble is E2M1: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0,
//! no infinity or NaN. Its sixteen values are [`E2M1_VALUES`]:
//! `±{0, 0.5, 1, 1.5, 2, 3, 4, 6}`, codes 0..=7 positive, 8..=15 their
//! negatives (code 8 is negative zero). A weight is `e2m1(code) * 2^(s-127)`.
//!
//! gpt-oss interleaves gate and up in `gate_up_proj`'s output rows: row `2i`
//! is gate row `i`, row `2i+1` is up row `i` (`gate_up[..., ::2]`,
//! `gate_up[..., 1::2]` in both references). [`Mxfp4Matrix::dequant_gate_up`]
//! splits them that way; the bias `gate_up_proj_bias` interleaves the same way.
//!
//! # Exactness
//! Every finite product `e2m1 * 2^(s-127)` is exactly an f32: an E2M1 value
//! has at most two significant bits, and the products span `2^-128`
//! (`0.5 * 2^-127`, an f32 subnormal, far above the smallest, `2^-149`) up to
//! `6 * 2^125` for `s <= 252`. So decoding is a table look-up times a power of
//! two, with no rounding anywhere, and it is also exactly what the references
//! produce in BF16 (8 significant bits, same exponent range). The only
//! inexpressible results are the NaN scale and, for `s >= 253`
//! ([`FIRST_SCALE_THAT_CAN_OVERFLOW`]), products of `2^128` or more
//! (`4 * 2^126`, `2 * 2^127`), which are infinite in f32 and BF16.
//!
//! # Refusal
//! [`Mxfp4Tensor::new`] and [`Mxfp4Matrix::new`] check every scale before any
//! weight is used and refuse, naming tensor, expert, row and block:
//! a NaN scale (255) — a real checkpoint has none, so one means a corrupt or
//! foreign file, and computing with NaN weights would poison every token that
//! routes to the expert — and any block whose products overflow f32. A
//! validated matrix therefore decodes to finite values only, and decoding
//! needs no error path.
//!
//! # How the native expert cache and the GPU kernels use this (design)
//! The issue requires MXFP4 experts stored natively: exact to the checkpoint,
//! no re-quantisation to INT4 (which would also not fit: gpt-oss's hidden 2880
//! is not a multiple of the INT4 group of 128, but is of 32).
//! - Cache (format v2, precision `mxfp4`, group 32): per expert the
//!   checkpoint's bytes are copied verbatim — `gate_up` blocks
//!   (`2*I*H/2` bytes) and scales (`2*I*H/32`), `down` blocks (`H*I/2`) and
//!   scales (`H*I/32`), plus the two BF16 biases — each array on the INT4
//!   layout's 256-byte boundary and the expert padded to 4096 bytes, so HCS,
//!   demand copies and streamed prefill move one expert in one copy exactly as
//!   for INT4. [`Mxfp4Shape`] gives the byte counts (4.25 bits per weight,
//!   [`BITS_PER_WEIGHT`]); [`Mxfp4Matrix::new`] validates an expert's slices
//!   when the cache is opened or built, so kernels never see a NaN scale.
//! - Kernels: a 16-byte block is one 128-bit load holding 32 consecutive K
//!   elements of one row — the same unit as the INT4 layout's load — and its
//!   scale is one byte next to it. Decode GEMV: a 16-entry f32 table in
//!   registers/shared memory, scale built from its bits
//!   (`__int_as_float(s << 23)`, with `s == 0` as the subnormal `2^-127`),
//!   product in f32 (never f16, whose range would overflow), accumulate in
//!   f32. Built without `--use_fast_math`/flush-to-zero for this multiply, the
//!   GPU weight equals [`Mxfp4Matrix::dequant_row`] bit for bit, so the CPU
//!   reference over this decode is the oracle for the kernels as it is for
//!   INT4 today. Prefill kernels decode a tile to BF16 (also exact) for the
//!   tensor cores. The nibble order is the checkpoint's, not the spec's (the
//!   spec leaves packing open): llama.cpp's GGML MXFP4 block is different
//!   (scale byte first, element `j` low and `j+16` high), so kernels modelled
//!   on it must re-index, not re-pack the cache.

use thiserror::Error;

mod encode;
pub use encode::{MAX_ENCODED_SCALE, encode_block, encode_rows, quantize_block, scale_for};

/// Values per block (the MX "k", 32 for every OCP MX format).
pub const BLOCK_VALUES: usize = 32;
/// Bytes of packed E2M1 values per block (two values per byte).
pub const BLOCK_BYTES: usize = BLOCK_VALUES / 2;
/// E8M0 exponent bias: scale byte `s` means `2^(s - SCALE_BIAS)`.
pub const SCALE_BIAS: i32 = 127;
/// The E8M0 encoding of NaN (OCP MX v1.0): refused, see the module docs.
pub const SCALE_NAN: u8 = 0xFF;
/// Smallest scale byte at which some E2M1 value times the scale is no longer
/// a finite f32: `4 * 2^(253-127) = 2^128`. Below it every product is finite.
pub const FIRST_SCALE_THAT_CAN_OVERFLOW: u8 = 253;
/// Storage cost: 16 value bytes plus one scale byte per 32 weights = 4.25.
pub const BITS_PER_WEIGHT: f64 = ((BLOCK_BYTES + 1) * 8) as f64 / BLOCK_VALUES as f64;
/// Safetensors dtype of both `_blocks` and `_scales`.
pub const STORAGE_DTYPE: &str = "U8";

/// E2M1 code (0..=15) to value; bit 3 is the sign.
pub const E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The value of E8M0 scale byte `s` as f32: `2^(s-127)` exactly, NaN for 255.
#[inline]
pub fn e8m0_to_f32(s: u8) -> f32 {
    match s {
        SCALE_NAN => f32::NAN,
        // 2^-127 is below the smallest normal f32 (2^-126): the subnormal with
        // only the top mantissa bit set.
        0 => f32::from_bits(1 << 22),
        // A normal f32 with biased exponent s (f32's bias is also 127).
        _ => f32::from_bits(u32::from(s) << 23),
    }
}

/// One weight: E2M1 `code` (low 4 bits) times E8M0 `scale`, exactly as the
/// spec defines it (NaN for scale 255, infinite where the product overflows).
#[inline]
pub fn decode(code: u8, scale: u8) -> f32 {
    E2M1_VALUES[usize::from(code & 0x0F)] * e8m0_to_f32(scale)
}

/// Decode one block: 16 bytes and its scale to 32 f32 values, element `2j`
/// from the low nibble of byte `j`.
#[inline]
pub fn decode_block(block: &[u8], scale: u8, out: &mut [f32]) {
    assert_eq!(block.len(), BLOCK_BYTES, "an MXFP4 block is 16 bytes");
    assert_eq!(out.len(), BLOCK_VALUES, "an MXFP4 block holds 32 values");
    let s = e8m0_to_f32(scale);
    for (pair, &byte) in out.chunks_exact_mut(2).zip(block) {
        pair[0] = E2M1_VALUES[usize::from(byte & 0x0F)] * s;
        pair[1] = E2M1_VALUES[usize::from(byte >> 4)] * s;
    }
}

/// Why MXFP4 tensors cannot be used. Every message names the tensor (the
/// projection's name without the `_blocks`/`_scales` suffix) and the fix.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum Mxfp4Error {
    #[error(
        "tensor '{tensor}': {part} have dtype {found}, MXFP4 {part} are U8; the checkpoint does not hold MXFP4 experts in the gpt-oss layout (re-download it)"
    )]
    DType {
        tensor: String,
        part: &'static str,
        found: String,
    },
    #[error(
        "tensor '{tensor}': {part} have shape {found:?}, expected {expected}; the checkpoint does not match its config (re-download it)"
    )]
    Shape {
        tensor: String,
        part: &'static str,
        found: Vec<usize>,
        expected: String,
    },
    #[error(
        "tensor '{tensor}': {part} hold {found} bytes, their shape needs {expected}; the file is truncated or corrupt (re-download it)"
    )]
    Length {
        tensor: String,
        part: &'static str,
        found: usize,
        expected: usize,
    },
    #[error(
        "tensor '{tensor}': expert {expert}, row {row}, block {block} (input features {}..{}) has E8M0 scale 0xFF, which is NaN in OCP MX v1.0; refusing NaN weights (the checkpoint is corrupt: re-download it)",
        block * BLOCK_VALUES, (block + 1) * BLOCK_VALUES
    )]
    NanScale {
        tensor: String,
        expert: usize,
        row: usize,
        block: usize,
    },
    #[error(
        "tensor '{tensor}': expert {expert}, row {row}, block {block}: E2M1 value {value} times 2^{} (scale byte {scale}) exceeds the f32 range; refusing infinite weights (the checkpoint is corrupt: re-download it)",
        i32::from(*scale) - SCALE_BIAS
    )]
    Overflow {
        tensor: String,
        expert: usize,
        row: usize,
        block: usize,
        scale: u8,
        value: f32,
    },
}

/// Shape of an MXFP4 expert tensor: `experts` matrices of `[rows, cols]`
/// logical weights, `cols` (the reduction axis) a multiple of 32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mxfp4Shape {
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
}

impl Mxfp4Shape {
    /// `None` unless all three are positive and `cols` is a multiple of 32.
    pub fn new(experts: usize, rows: usize, cols: usize) -> Option<Self> {
        (experts > 0 && rows > 0 && cols > 0 && cols.is_multiple_of(BLOCK_VALUES)).then_some(
            Mxfp4Shape {
                experts,
                rows,
                cols,
            },
        )
    }
    pub fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK_VALUES
    }
    /// The `_blocks` tensor's shape: `[experts, rows, cols/32, 16]`.
    pub fn blocks_shape(&self) -> [usize; 4] {
        [self.experts, self.rows, self.blocks_per_row(), BLOCK_BYTES]
    }
    /// The `_scales` tensor's shape: `[experts, rows, cols/32]`.
    pub fn scales_shape(&self) -> [usize; 3] {
        [self.experts, self.rows, self.blocks_per_row()]
    }
    pub fn weights(&self) -> usize {
        self.experts * self.rows * self.cols
    }
    /// Bytes of packed values of one expert (`rows * cols / 2`).
    pub fn expert_blocks_bytes(&self) -> usize {
        self.rows * self.blocks_per_row() * BLOCK_BYTES
    }
    /// Bytes of scales of one expert (`rows * cols / 32`).
    pub fn expert_scales_bytes(&self) -> usize {
        self.rows * self.blocks_per_row()
    }
    pub fn blocks_bytes(&self) -> usize {
        self.experts * self.expert_blocks_bytes()
    }
    pub fn scales_bytes(&self) -> usize {
        self.experts * self.expert_scales_bytes()
    }
    /// Blocks plus scales: `weights * 4.25 / 8` bytes (biases not included).
    pub fn total_bytes(&self) -> usize {
        self.blocks_bytes() + self.scales_bytes()
    }
}

/// A raw safetensors tensor as the checkpoint reader sees it; the dtype is
/// the header's string because the reader's `DType` has no U8. The header
/// fields may live shorter than the bytes (`'h` vs `'a`).
#[derive(Debug, Clone, Copy)]
pub struct RawTensor<'h, 'a> {
    pub dtype: &'h str,
    pub shape: &'h [usize],
    pub bytes: &'a [u8],
}

/// A validated MXFP4 expert tensor (all experts of one projection).
#[derive(Debug, Clone)]
pub struct Mxfp4Tensor<'a> {
    name: String,
    shape: Mxfp4Shape,
    blocks: &'a [u8],
    scales: &'a [u8],
}

impl<'a> Mxfp4Tensor<'a> {
    /// Checks both byte lengths against `shape` and every scale (see the
    /// module docs' "Refusal").
    pub fn new(
        name: &str,
        shape: Mxfp4Shape,
        blocks: &'a [u8],
        scales: &'a [u8],
    ) -> Result<Self, Mxfp4Error> {
        check_len(name, "blocks", blocks.len(), shape.blocks_bytes())?;
        check_len(name, "scales", scales.len(), shape.scales_bytes())?;
        let t = Mxfp4Tensor {
            name: name.to_string(),
            shape,
            blocks,
            scales,
        };
        for e in 0..shape.experts {
            let (b, s) = t.expert_bytes(e);
            validate(name, e, shape.rows, shape.cols, b, s)?;
        }
        Ok(t)
    }

    /// From the `_blocks` and `_scales` tensors of a checkpoint: both U8, with
    /// shapes `[E, R, K/32, 16]` and `[E, R, K/32]`. `name` is the projection
    /// (for example `model.layers.0.mlp.experts.gate_up_proj`).
    pub fn from_safetensors(
        name: &str,
        blocks: RawTensor<'_, 'a>,
        scales: RawTensor<'_, 'a>,
    ) -> Result<Self, Mxfp4Error> {
        for (part, t) in [("blocks", &blocks), ("scales", &scales)] {
            if t.dtype != STORAGE_DTYPE {
                return Err(Mxfp4Error::DType {
                    tensor: name.to_string(),
                    part,
                    found: t.dtype.to_string(),
                });
            }
        }
        let shape_err = |part, found: &[usize], expected: String| Mxfp4Error::Shape {
            tensor: name.to_string(),
            part,
            found: found.to_vec(),
            expected,
        };
        let shape = match *blocks.shape {
            [e, r, g, BLOCK_BYTES] => Mxfp4Shape::new(e, r, g * BLOCK_VALUES),
            _ => None,
        }
        .ok_or_else(|| {
            shape_err(
                "blocks",
                blocks.shape,
                "[experts, rows, cols/32, 16], all positive".to_string(),
            )
        })?;
        if scales.shape != shape.scales_shape() {
            return Err(shape_err(
                "scales",
                scales.shape,
                format!("{:?} (one per block)", shape.scales_shape()),
            ));
        }
        Mxfp4Tensor::new(name, shape, blocks.bytes, scales.bytes)
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn shape(&self) -> Mxfp4Shape {
        self.shape
    }
    /// Expert `e`'s packed values and scales, as the native cache stores them.
    pub fn expert_bytes(&self, e: usize) -> (&'a [u8], &'a [u8]) {
        let (nb, ns) = (
            self.shape.expert_blocks_bytes(),
            self.shape.expert_scales_bytes(),
        );
        (
            &self.blocks[e * nb..(e + 1) * nb],
            &self.scales[e * ns..(e + 1) * ns],
        )
    }
    /// Expert `e` as a matrix (already validated); `None` past the last.
    pub fn expert(&self, e: usize) -> Option<Mxfp4Matrix<'a>> {
        (e < self.shape.experts).then(|| {
            let (blocks, scales) = self.expert_bytes(e);
            Mxfp4Matrix {
                rows: self.shape.rows,
                cols: self.shape.cols,
                blocks,
                scales,
            }
        })
    }
}

/// One validated expert matrix `[rows, cols]` in MXFP4.
#[derive(Debug, Clone, Copy)]
pub struct Mxfp4Matrix<'a> {
    rows: usize,
    cols: usize,
    blocks: &'a [u8],
    scales: &'a [u8],
}

impl<'a> Mxfp4Matrix<'a> {
    /// One expert's bytes (for example an expert block of the native cache);
    /// validated like [`Mxfp4Tensor::new`]. `expert` only labels errors.
    pub fn new(
        name: &str,
        expert: usize,
        rows: usize,
        cols: usize,
        blocks: &'a [u8],
        scales: &'a [u8],
    ) -> Result<Self, Mxfp4Error> {
        let shape = Mxfp4Shape::new(1, rows, cols).ok_or_else(|| Mxfp4Error::Shape {
            tensor: name.to_string(),
            part: "matrix",
            found: vec![rows, cols],
            expected: "[rows, cols], positive, cols a multiple of 32".to_string(),
        })?;
        check_len(name, "blocks", blocks.len(), shape.blocks_bytes())?;
        check_len(name, "scales", scales.len(), shape.scales_bytes())?;
        validate(name, expert, rows, cols, blocks, scales)?;
        Ok(Mxfp4Matrix {
            rows,
            cols,
            blocks,
            scales,
        })
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Row `row` decoded exactly into `out` (`cols` values).
    pub fn dequant_row(&self, row: usize, out: &mut [f32]) {
        assert!(row < self.rows, "row {row} of {}", self.rows);
        assert_eq!(out.len(), self.cols, "output row length");
        let g = self.cols / BLOCK_VALUES;
        let blocks = &self.blocks[row * g * BLOCK_BYTES..(row + 1) * g * BLOCK_BYTES];
        let scales = &self.scales[row * g..(row + 1) * g];
        for ((o, b), &s) in out
            .chunks_exact_mut(BLOCK_VALUES)
            .zip(blocks.chunks_exact(BLOCK_BYTES))
            .zip(scales)
        {
            decode_block(b, s, o);
        }
    }

    /// The whole matrix, row-major `[rows, cols]`.
    pub fn dequant(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, o) in out.chunks_exact_mut(self.cols).enumerate() {
            self.dequant_row(r, o);
        }
        out
    }

    /// gpt-oss `gate_up_proj` split into `(gate, up)`, each `[rows/2, cols]`:
    /// even rows are gate, odd rows are up (see the module docs).
    pub fn dequant_gate_up(&self) -> (Vec<f32>, Vec<f32>) {
        assert!(
            self.rows.is_multiple_of(2),
            "gate_up has an even number of rows"
        );
        let half = self.rows / 2 * self.cols;
        let (mut gate, mut up) = (vec![0.0; half], vec![0.0; half]);
        for (i, (g, u)) in gate
            .chunks_exact_mut(self.cols)
            .zip(up.chunks_exact_mut(self.cols))
            .enumerate()
        {
            self.dequant_row(2 * i, g);
            self.dequant_row(2 * i + 1, u);
        }
        (gate, up)
    }
}

fn check_len(
    name: &str,
    part: &'static str,
    found: usize,
    expected: usize,
) -> Result<(), Mxfp4Error> {
    if found == expected {
        Ok(())
    } else {
        Err(Mxfp4Error::Length {
            tensor: name.to_string(),
            part,
            found,
            expected,
        })
    }
}

/// Refuse NaN scales and blocks whose products overflow f32 (module docs).
/// Only scales at or above [`FIRST_SCALE_THAT_CAN_OVERFLOW`] need their
/// block's values inspected, so this is one pass over the scales in practice.
fn validate(
    name: &str,
    expert: usize,
    rows: usize,
    cols: usize,
    blocks: &[u8],
    scales: &[u8],
) -> Result<(), Mxfp4Error> {
    let g = cols / BLOCK_VALUES;
    debug_assert_eq!(scales.len(), rows * g);
    for (i, &s) in scales.iter().enumerate() {
        if s < FIRST_SCALE_THAT_CAN_OVERFLOW {
            continue;
        }
        let (row, block) = (i / g, i % g);
        if s == SCALE_NAN {
            return Err(Mxfp4Error::NanScale {
                tensor: name.to_string(),
                expert,
                row,
                block,
            });
        }
        let bytes = &blocks[i * BLOCK_BYTES..(i + 1) * BLOCK_BYTES];
        for &byte in bytes {
            for code in [byte & 0x0F, byte >> 4] {
                if !decode(code, s).is_finite() {
                    return Err(Mxfp4Error::Overflow {
                        tensor: name.to_string(),
                        expert,
                        row,
                        block,
                        scale: s,
                        value: E2M1_VALUES[usize::from(code)],
                    });
                }
            }
        }
    }
    Ok(())
}
