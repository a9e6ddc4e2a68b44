//! Grouped INT4 expert GEMMs for prefill (`cuda/int4_gemm.cu`): all experts
//! of a MoE layer in one launch per projection, reading the expert cache's
//! INT4 blocks (group 128) through the pointer table, dequantizing in
//! registers and multiplying on tensor cores.
//!
//! Rows are grouped by expert and covered in tiles of one expert's rows as
//! for every grouped format ([`crate::ops::grouped`]).

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};

use super::Int4Layout;
use crate::launch::{Act16, builder, by_act, cfg, check_len, dim_u32, ensure, submit};
use crate::ops::grouped::{GROUPED_ROWS, GroupedDims, grouped_tiles};
use crate::{Kernels, Result};

/// Rows of one expert a block of the grouped kernels covers.
pub const INT4_GROUPED_ROWS: usize = GROUPED_ROWS;
/// Threads per block (8 warps).
const THREADS: u32 = 256;

/// The token tiles of a grouping ([`grouped_tiles`]).
pub fn int4_grouped_tiles(offsets: &[u32]) -> usize {
    grouped_tiles(offsets)
}

/// Whether the grouped kernels implement this layout: group 128 (one
/// scale per 128-wide K step). Other groups run the dequantize + GEMM path.
pub fn int4_grouped_supports(layout: &Int4Layout) -> bool {
    layout.group == 128
        && layout.hidden.is_multiple_of(128)
        && layout.intermediate.is_multiple_of(128)
}

/// One implementation of the grouped INT4 GEMMs: its gate/up and down entry
/// points (bf16, f16) and the dynamic shared memory a block takes.
pub(super) struct GroupedKernels {
    pub w13: [&'static str; 2],
    pub w2: [&'static str; 2],
    pub smem: u32,
}

/// The portable kernels (`cuda/int4_gemm.cu`; static shared memory only).
const PORTABLE: GroupedKernels = GroupedKernels {
    w13: [
        "int4_grouped_w13_swiglu_bf16",
        "int4_grouped_w13_swiglu_f16",
    ],
    w2: ["int4_grouped_w2_bf16", "int4_grouped_w2_f16"],
    smem: 0,
};

impl Kernels {
    /// Grouped gate/up GEMM with SwiGLU: for every expert `e` and grouped row
    /// `r` in `offsets[e]..offsets[e + 1]`,
    /// `hact[r, i] = A(silu(W13_e[i] · x[r]) * (W13_e[I + i] · x[r]))`, the
    /// dot products in f32 (exact `q - 8` times `x` on tensor cores, each
    /// 128-wide scale group summed, scaled and added in K order) and rounded
    /// once to `A`. A row's result depends only on its own `x` and expert.
    ///
    /// - `x`: `A` `[rows, H]` (grouped, normalized rows); `hact`: `A` `[rows, I]`.
    /// - `offsets`: u32 `[n_experts + 1]`, `offsets[n_experts] == rows`;
    ///   `tiles` = [`int4_grouped_tiles`] of those offsets.
    /// - `table`: u64 `[n_table]`, expert `e` at `table[e]`; a missing or
    ///   misaligned entry makes its rows NaN.
    #[allow(clippy::too_many_arguments)]
    pub fn int4_grouped_w13_swiglu<A: Act16>(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<A>,
        rows: usize,
        offsets: &impl DevicePtr<u32>,
        n_experts: usize,
        tiles: usize,
        table: &impl DevicePtr<u64>,
        layout: &Int4Layout,
        hact: &mut impl DevicePtrMut<A>,
    ) -> Result<()> {
        self.grouped_w13(
            &PORTABLE, stream, x, rows, offsets, n_experts, tiles, table, layout, hact,
        )
    }

    /// Grouped down GEMM: for every expert `e` and grouped row `r` of it,
    /// `y[r, n] = W2_e[n] · x[r]` in f32, as [`Kernels::int4_grouped_w13_swiglu`]
    /// computes its dot products.
    ///
    /// - `x`: `A` `[rows, I]` (the SwiGLU rows); `y`: f32 `[rows, H]`.
    #[allow(clippy::too_many_arguments)]
    pub fn int4_grouped_w2<A: Act16>(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<A>,
        rows: usize,
        offsets: &impl DevicePtr<u32>,
        n_experts: usize,
        tiles: usize,
        table: &impl DevicePtr<u64>,
        layout: &Int4Layout,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.grouped_w2(
            &PORTABLE, stream, x, rows, offsets, n_experts, tiles, table, layout, y,
        )
    }

    /// The gate/up launch of implementation `kn` (the portable kernels or
    /// the Hopper ones, `grouped_sm90.rs`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn grouped_w13<A: Act16>(
        &self,
        kn: &GroupedKernels,
        stream: &CudaStream,
        x: &impl DevicePtr<A>,
        rows: usize,
        offsets: &impl DevicePtr<u32>,
        n_experts: usize,
        tiles: usize,
        table: &impl DevicePtr<u64>,
        layout: &Int4Layout,
        hact: &mut impl DevicePtrMut<A>,
    ) -> Result<()> {
        let k = by_act::<A>(kn.w13[0], kn.w13[1]);
        let (h, i) = (layout.hidden, layout.intermediate);
        check_len(k, "hact", hact.len(), rows * i)?;
        let (hp, _g) = hact.device_ptr_mut(stream);
        self.grouped(
            k,
            stream,
            (x, rows, h),
            (offsets, n_experts, tiles),
            table,
            layout,
            (i / 64, i, hp, layout.w13_q, layout.w13_s),
            kn.smem,
        )
    }

    /// The down launch of implementation `kn`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn grouped_w2<A: Act16>(
        &self,
        kn: &GroupedKernels,
        stream: &CudaStream,
        x: &impl DevicePtr<A>,
        rows: usize,
        offsets: &impl DevicePtr<u32>,
        n_experts: usize,
        tiles: usize,
        table: &impl DevicePtr<u64>,
        layout: &Int4Layout,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let k = by_act::<A>(kn.w2[0], kn.w2[1]);
        let (h, i) = (layout.hidden, layout.intermediate);
        check_len(k, "y", y.len(), rows * h)?;
        let (yp, _g) = y.device_ptr_mut(stream);
        self.grouped(
            k,
            stream,
            (x, rows, i),
            (offsets, n_experts, tiles),
            table,
            layout,
            (h / 128, h, yp, layout.w2_q, layout.w2_s),
            kn.smem,
        )
    }

    /// Launches grouped kernel `k` over `x` `[rows, kdim]`: `out` = (blocks
    /// along the output features, output width, output address, the
    /// projection's weight and scale offsets in an expert block), with
    /// `smem` bytes of dynamic shared memory (the Hopper kernels',
    /// `grouped_sm90.rs`; 0 for these).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn grouped<A: Act16>(
        &self,
        k: &'static str,
        stream: &CudaStream,
        (x, rows, kdim): (&impl DevicePtr<A>, usize, usize),
        (offsets, n_experts, tiles): (&impl DevicePtr<u32>, usize, usize),
        table: &impl DevicePtr<u64>,
        layout: &Int4Layout,
        (blocks_x, n_out, out, oq, os): (usize, usize, u64, usize, usize),
        smem: u32,
    ) -> Result<()> {
        layout.validate(k)?;
        ensure(k, int4_grouped_supports(layout), || {
            format!(
                "group {} with hidden {} and intermediate {}: the grouped kernels need group 128",
                layout.group, layout.hidden, layout.intermediate
            )
        })?;
        let Some(d) = GroupedDims::check(
            k,
            (x.len(), rows, kdim),
            (offsets.len(), n_experts, tiles),
            table.len(),
            layout.intermediate,
            n_out,
        )?
        else {
            return Ok(());
        };
        let (oq, os) = (oq as u64, os as u64);
        let (xp, _g1) = x.device_ptr(stream);
        let (op, _g2) = offsets.device_ptr(stream);
        let (tp, _g3) = table.device_ptr(stream);
        let f = self.func(k)?;
        if smem > 0 {
            self.allow_smem(k, f, smem)?;
        }
        let mut b = builder(stream, f);
        b.arg(&xp)
            .arg(&op)
            .arg(&d.n_experts)
            .arg(&tp)
            .arg(&d.n_table);
        b.arg(&d.k).arg(&d.i).arg(&d.n).arg(&oq).arg(&os).arg(&out);
        let bx = dim_u32(k, "feature blocks", blocks_x)?;
        submit(k, b, cfg((bx, d.tiles, 1), THREADS, smem))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_group_128_is_grouped() {
        assert!(int4_grouped_supports(
            &Int4Layout::new(2048, 768, 128).unwrap()
        ));
        assert!(!int4_grouped_supports(
            &Int4Layout::new(2880, 1440, 32).unwrap()
        ));
        assert!(!int4_grouped_supports(
            &Int4Layout::new(2048, 768, 64).unwrap()
        ));
    }
}
