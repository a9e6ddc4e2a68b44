//! Grouped MXFP4 expert GEMMs for prefill (`cuda/mxfp4_gemm.cu`): all
//! experts of a MoE layer in one launch per projection, reading the expert
//! cache's MXFP4 blocks through the pointer table, decoding codes and
//! scales in registers and multiplying on tensor cores, with the biases and
//! the expert activation fused. The grid design of the grouped INT4 GEMMs
//! ([`crate::ops::int4`]).
//!
//! Rows are grouped by expert and covered in tiles of one expert's rows as
//! for every grouped format ([`crate::ops::grouped`]). Every layout
//! [`Mxfp4Layout`] accepts (widths multiples of 32, gpt-oss's 2880 too) is
//! implemented.

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

use super::{ExpertActivation, Mxfp4Layout};
use crate::launch::{builder, cfg, check_len, dim_u32, submit};
use crate::ops::grouped::{GROUPED_ROWS, GroupedDims, grouped_tiles};
use crate::{Kernels, Result};

/// Rows of one expert a block of the grouped kernels covers.
pub const MXFP4_GROUPED_ROWS: usize = GROUPED_ROWS;
/// Threads per block (8 warps).
const THREADS: u32 = 256;
/// Output features per block: gate/up 64 `i` (64 gate + 64 up rows), down
/// 128 rows.
const W13_BLOCK_FEATURES: usize = 64;
const W2_BLOCK_FEATURES: usize = 128;

/// The token tiles of a grouping ([`grouped_tiles`]).
pub fn mxfp4_grouped_tiles(offsets: &[u32]) -> usize {
    grouped_tiles(offsets)
}

/// One grouped launch's input, grouping and output, as the kernels take
/// them (the two projections differ only in these).
struct Projection {
    /// Reduction width of `x`'s rows (H for gate/up, I for down).
    kdim: usize,
    /// Output width (I for gate/up, H for down) and blocks along it.
    n_out: usize,
    blocks_x: usize,
    /// The output's device address.
    out: u64,
    /// Weight, scale and bias offsets in an expert block.
    oq: usize,
    os: usize,
    ob: usize,
    /// (kind, limit, alpha) of the activation: gate/up only, whose entry
    /// point takes them.
    act: Option<(u32, f32, f32)>,
}

impl Kernels {
    /// Grouped gate/up GEMM with the biases and the expert activation
    /// fused: for every expert `e` and grouped row `r` in
    /// `offsets[e]..offsets[e + 1]`,
    /// `hact[r, i] = bf16(activation(W13_e[i] · x[r] + b13_e[i], W13_e[I + i] · x[r] + b13_e[I + i]))`
    /// (bias terms only when the layout has biases), the dot products in
    /// f32 (exact decoded weights times `x` on tensor cores, each 128-wide
    /// K step summed and added in K order), the activation taken in f32 and
    /// rounded once. A row's result depends only on its own `x` and expert.
    ///
    /// - `x`: bf16 `[rows, H]` (grouped, normalized rows); `hact`: bf16
    ///   `[rows, I]`.
    /// - `offsets`: u32 `[n_experts + 1]`, `offsets[n_experts] == rows`;
    ///   `tiles` = [`mxfp4_grouped_tiles`] of those offsets.
    /// - `table`: u64 `[n_table]`, expert `e` at `table[e]`; a missing or
    ///   misaligned entry makes its rows NaN.
    #[allow(clippy::too_many_arguments)]
    pub fn mxfp4_grouped_w13_act(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<bf16>,
        rows: usize,
        offsets: &impl DevicePtr<u32>,
        n_experts: usize,
        tiles: usize,
        table: &impl DevicePtr<u64>,
        layout: &Mxfp4Layout,
        activation: ExpertActivation,
        hact: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        const K: &str = "mxfp4_grouped_w13_act";
        let (h, i) = (layout.hidden, layout.intermediate);
        let act = activation.args(K)?;
        check_len(K, "hact", hact.len(), rows * i)?;
        let (hp, _g) = hact.device_ptr_mut(stream);
        self.grouped_mx(
            K,
            stream,
            (x, rows),
            (offsets, n_experts, tiles),
            table,
            layout,
            Projection {
                kdim: h,
                n_out: i,
                blocks_x: i.div_ceil(W13_BLOCK_FEATURES),
                out: hp,
                oq: layout.w13_q,
                os: layout.w13_s,
                ob: layout.w13_b,
                act: Some(act),
            },
        )
    }

    /// Grouped down GEMM with the down bias fused: for every expert `e` and
    /// grouped row `r` of it, `y[r, n] = W2_e[n] · x[r] + b2_e[n]` in f32
    /// (bias only when the layout has biases), the dot products as
    /// [`Kernels::mxfp4_grouped_w13_act`] computes them.
    ///
    /// - `x`: bf16 `[rows, I]` (the activation rows); `y`: f32 `[rows, H]`.
    #[allow(clippy::too_many_arguments)]
    pub fn mxfp4_grouped_w2(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<bf16>,
        rows: usize,
        offsets: &impl DevicePtr<u32>,
        n_experts: usize,
        tiles: usize,
        table: &impl DevicePtr<u64>,
        layout: &Mxfp4Layout,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        const K: &str = "mxfp4_grouped_w2";
        let (h, i) = (layout.hidden, layout.intermediate);
        check_len(K, "y", y.len(), rows * h)?;
        let (yp, _g) = y.device_ptr_mut(stream);
        self.grouped_mx(
            K,
            stream,
            (x, rows),
            (offsets, n_experts, tiles),
            table,
            layout,
            Projection {
                kdim: i,
                n_out: h,
                blocks_x: h.div_ceil(W2_BLOCK_FEATURES),
                out: yp,
                oq: layout.w2_q,
                os: layout.w2_s,
                ob: layout.w2_b,
                act: None,
            },
        )
    }

    /// Launches grouped kernel `k` over `x` `[rows, p.kdim]` into `p.out`.
    #[allow(clippy::too_many_arguments)]
    fn grouped_mx(
        &self,
        k: &'static str,
        stream: &CudaStream,
        (x, rows): (&impl DevicePtr<bf16>, usize),
        (offsets, n_experts, tiles): (&impl DevicePtr<u32>, usize, usize),
        table: &impl DevicePtr<u64>,
        layout: &Mxfp4Layout,
        p: Projection,
    ) -> Result<()> {
        layout.validate(k)?;
        let Some(d) = GroupedDims::check(
            k,
            (x.len(), rows, p.kdim),
            (offsets.len(), n_experts, tiles),
            table.len(),
            layout.intermediate,
            p.n_out,
        )?
        else {
            return Ok(());
        };
        let (oq, os, ob) = (p.oq as u64, p.os as u64, p.ob as u64);
        let hb = u32::from(layout.has_bias);
        let (xp, _g1) = x.device_ptr(stream);
        let (op, _g2) = offsets.device_ptr(stream);
        let (tp, _g3) = table.device_ptr(stream);
        let f = self.func(k)?;
        let mut b = builder(stream, f);
        b.arg(&xp)
            .arg(&op)
            .arg(&d.n_experts)
            .arg(&tp)
            .arg(&d.n_table);
        b.arg(&d.k)
            .arg(&d.i)
            .arg(&d.n)
            .arg(&oq)
            .arg(&os)
            .arg(&ob)
            .arg(&hb);
        if let Some((kind, limit, alpha)) = &p.act {
            b.arg(kind).arg(limit).arg(alpha);
        }
        b.arg(&p.out);
        let bx = dim_u32(k, "feature blocks", p.blocks_x)?;
        submit(k, b, cfg((bx, d.tiles, 1), THREADS, 0))
    }
}
