//! The routed-expert FFN component: the arithmetic of one expert format
//! and activation, behind the calls the MoE paths and the expert residency
//! (all resident, HCS, streamed prefill) make. Residency decides where an
//! expert's bytes are and hands the kernels a pointer table; this decides
//! what the bytes mean. So a new expert format or activation is added
//! here and never touches HCS or streaming.
//!
//! Today: INT4 experts (`cuda/int4.cu`) with SwiGLU. `support.rs` refuses
//! every other expert activation before a model is built.

use crate::error::Result;
use crate::forward::Ctx;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;
use krasis_kernels::Int4Layout;

/// How one routed expert is stored on the device and computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertFfn {
    /// INT4 blocks of the expert cache, SwiGLU.
    Int4Swiglu(Int4Layout),
}

impl ExpertFfn {
    /// Bytes of one expert's arrays (the part a copy must move).
    pub fn used_bytes(&self) -> usize {
        match self {
            ExpertFfn::Int4Swiglu(l) => l.used_bytes(),
        }
    }

    /// Gate/up GEMV with the activation fused, for `t` tokens' `k` pairs
    /// (`ids` index `table`), only the slots set in `mask`: `act[p]` f32
    /// `[t*k, I]`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gate_up_act(
        &self,
        cx: &Ctx<'_>,
        x: &CudaSlice<bf16>,
        table: &impl DevicePtr<u64>,
        ids: &impl DevicePtr<u32>,
        t: usize,
        mask: u32,
        act: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (s, k) = (&cx.gpu.stream, cx.g.top_k);
        match self {
            ExpertFfn::Int4Swiglu(l) => Ok(cx
                .kn
                .int4_w13_swiglu(s, x, table, ids, t, k, l, mask, act)?),
        }
    }

    /// Down GEMV of every pair and the routing-weighted combine into the
    /// f32 residual, in a fixed order.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn down_combine(
        &self,
        cx: &Ctx<'_>,
        act: &CudaSlice<f32>,
        table: &impl DevicePtr<u64>,
        ids: &impl DevicePtr<u32>,
        weights: &CudaSlice<f32>,
        t: usize,
        residual: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (s, k) = (&cx.gpu.stream, cx.g.top_k);
        match self {
            ExpertFfn::Int4Swiglu(l) => Ok(cx
                .kn
                .int4_w2_combine(s, act, table, ids, weights, t, k, l, residual)?),
        }
    }

    /// Dequantizes `n` experts (`table[ids[x]]`) to BF16 `w13` `[n, 2I, H]`
    /// and `w2` `[n, H, I]` for the grouped prefill GEMMs.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dequant(
        &self,
        cx: &Ctx<'_>,
        table: &impl DevicePtr<u64>,
        ids: &impl DevicePtr<u32>,
        n: usize,
        w13: &mut impl DevicePtrMut<bf16>,
        w2: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        match self {
            ExpertFfn::Int4Swiglu(l) => {
                Ok(cx
                    .kn
                    .int4_dequant(&cx.gpu.stream, table, ids, n, l, w13, w2)?)
            }
        }
    }

    /// The activation over `rows` gate/up GEMM rows (`[rows, 2I]` BF16,
    /// gate half first) into `[rows, I]` BF16, for the grouped path.
    pub(crate) fn activate_rows(
        &self,
        cx: &Ctx<'_>,
        gate_up: &impl DevicePtr<bf16>,
        rows: usize,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        let i = cx.g.expert_intermediate;
        match self {
            ExpertFfn::Int4Swiglu(_) => Ok(cx.kn.swiglu(&cx.gpu.stream, gate_up, rows, i, out)?),
        }
    }
}
