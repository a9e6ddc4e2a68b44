//! Router top-k, token grouping, row gather and the deterministic weighted
//! combine of routed expert outputs (`cuda/router.cu`, `cuda/moe.cu`).
//!
//! Pair indexing: token `t`'s `j`-th selected expert is pair `p = t*top_k + j`.
//! Grouping sorts pairs by expert (stable: ascending pair index within an
//! expert); grouped row `r` holds pair `row_pair[r]`, and `pair_row[p]` is
//! the inverse. The combine gathers each token's `top_k` rows in `j` order,
//! so no atomics are needed and results are bit-reproducible.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};

use crate::launch::{
    Act16, Elem, KArgs, builder, by_elem, cfg, check_len, dim_u32, ensure, submit, submit_pdl,
};
use crate::{Kernels, Result};

/// Largest expert count the router kernel handles.
pub const ROUTER_MAX_EXPERTS: usize = 1024;
/// Largest top-k the router kernel handles.
pub const ROUTER_MAX_TOPK: usize = 32;

/// How a router turns a token's (biased) logits into its top-k weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RouterMode {
    /// Softmax over all experts, the `top_k` largest probabilities; with
    /// `normalize` (Qwen3 `norm_topk_prob`) divided by their sum.
    SoftmaxTopK { normalize: bool },
    /// The `top_k` largest logits, then a softmax over those `k` only
    /// (gpt-oss `GptOssTopKRouter`).
    TopKSoftmax,
    /// glm4_moe / DeepSeek-V3: sigmoid scores; the bias is a selection
    /// bias (choice only); group-limited choice (`groups` <= 32 equal
    /// groups scored by their two best, the best `topk_groups` kept); the
    /// chosen experts weighted by their scores, renormalised (+1e-20) when
    /// `normalize`, times `scale`.
    SigmoidGrouped {
        groups: usize,
        topk_groups: usize,
        normalize: bool,
        scale: f32,
    },
}

/// Most expert groups the sigmoid grouped router takes (one lane each).
pub const ROUTER_MAX_GROUPS: usize = 32;

impl Kernels {
    /// Softmax over each token's router logits (f32), then the `top_k`
    /// largest probabilities (ties: lower expert index first), in descending
    /// order; with `normalize` (Qwen3 `norm_topk_prob`) the selected weights
    /// are divided by their sum. [`Kernels::router_topk_with`] with no bias
    /// and [`RouterMode::SoftmaxTopK`].
    ///
    /// - `logits`: f32 or bf16 `[n_tokens, n_experts]` (router GEMM output).
    /// - `ids`: u32 `[n_tokens, top_k]`; `weights`: f32 `[n_tokens, top_k]`.
    #[allow(clippy::too_many_arguments)]
    pub fn router_topk<T: Elem>(
        &self,
        stream: &CudaStream,
        logits: &impl DevicePtr<T>,
        n_tokens: usize,
        n_experts: usize,
        top_k: usize,
        normalize: bool,
        ids: &mut impl DevicePtrMut<u32>,
        weights: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let mode = RouterMode::SoftmaxTopK { normalize };
        self.router_topk_with(
            stream, logits, None, n_tokens, n_experts, top_k, mode, ids, weights,
        )
    }

    /// Each token's `top_k` experts and weights under `mode`, from its
    /// router logits plus `bias` (added in f32 before selection; the
    /// engine uploads a bf16 checkpoint bias widened to f32, which is
    /// exact). Ids are in descending order of the selecting value, ties to
    /// the lower expert index. In [`RouterMode::TopKSoftmax`] a NaN logit
    /// makes all of that token's weights NaN.
    ///
    /// - `logits`: f32 or bf16 `[n_tokens, n_experts]` (router GEMM output).
    /// - `bias`: f32 `[n_experts]`.
    /// - `ids`: u32 `[n_tokens, top_k]`; `weights`: f32 `[n_tokens, top_k]`.
    #[allow(clippy::too_many_arguments)]
    pub fn router_topk_with<T: Elem>(
        &self,
        stream: &CudaStream,
        logits: &impl DevicePtr<T>,
        bias: Option<&CudaSlice<f32>>,
        n_tokens: usize,
        n_experts: usize,
        top_k: usize,
        mode: RouterMode,
        ids: &mut impl DevicePtrMut<u32>,
        weights: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let k = match mode {
            RouterMode::SoftmaxTopK { .. } => by_elem::<T>("router_topk_f32", "router_topk_bf16"),
            RouterMode::TopKSoftmax => by_elem::<T>(
                "router_topk_then_softmax_f32",
                "router_topk_then_softmax_bf16",
            ),
            RouterMode::SigmoidGrouped { .. } => {
                by_elem::<T>("router_sigmoid_grouped_f32", "router_sigmoid_grouped_bf16")
            }
        };
        if let RouterMode::SigmoidGrouped {
            groups,
            topk_groups,
            ..
        } = mode
        {
            ensure(
                k,
                (1..=ROUTER_MAX_GROUPS).contains(&groups)
                    && n_experts.is_multiple_of(groups)
                    && (1..=groups).contains(&topk_groups)
                    && (groups == 1 || n_experts / groups >= 2)
                    && top_k <= topk_groups * (n_experts / groups),
                || {
                    format!(
                        "{n_experts} experts in {groups} groups keeping {topk_groups} for top-{top_k}: \
                         groups must be 1..={ROUTER_MAX_GROUPS} equal groups of >= 2 experts, \
                         keeping 1..=groups that hold top_k experts"
                    )
                },
            )?;
        }
        ensure(k, (1..=ROUTER_MAX_EXPERTS).contains(&n_experts), || {
            format!("n_experts = {n_experts} must be in 1..={ROUTER_MAX_EXPERTS}")
        })?;
        ensure(
            k,
            top_k >= 1 && top_k <= n_experts.min(ROUTER_MAX_TOPK),
            || {
                format!(
                    "top_k = {top_k} must be in 1..={}",
                    n_experts.min(ROUTER_MAX_TOPK)
                )
            },
        )?;
        check_len(k, "logits", logits.len(), n_tokens * n_experts)?;
        if let Some(b) = bias {
            check_len(k, "bias", b.len(), n_experts)?;
        }
        check_len(k, "ids", ids.len(), n_tokens * top_k)?;
        check_len(k, "weights", weights.len(), n_tokens * top_k)?;
        let (t, e, kk) = (
            dim_u32(k, "n_tokens", n_tokens)?,
            n_experts as u32,
            top_k as u32,
        );
        let f = self.func(k)?;
        let (lp, _g1) = logits.device_ptr(stream);
        let (bp, _g4) = match bias {
            Some(b) => {
                let (p, g) = b.device_ptr(stream);
                (p, Some(g))
            }
            None => (0, None),
        };
        let (ip, _g2) = ids.device_ptr_mut(stream);
        let (wp, _g3) = weights.device_ptr_mut(stream);
        // Only the softmax-first kernel takes the renormalisation flag.
        let norm = match mode {
            RouterMode::SoftmaxTopK { normalize } => Some(u32::from(normalize)),
            RouterMode::TopKSoftmax | RouterMode::SigmoidGrouped { .. } => None,
        };
        let grouped = match mode {
            RouterMode::SigmoidGrouped {
                groups,
                topk_groups,
                normalize,
                scale,
            } => Some((
                groups as u32,
                topk_groups as u32,
                u32::from(normalize),
                scale,
            )),
            _ => None,
        };
        let mut b = KArgs::new();
        b.arg(&lp)
            .arg(&bp)
            .arg(&ip)
            .arg(&wp)
            .arg(&t)
            .arg(&e)
            .arg(&kk);
        if let Some(n) = &norm {
            b.arg(n);
        }
        if let Some((groups, topk_groups, normalize, scale)) = &grouped {
            b.arg(groups).arg(topk_groups).arg(normalize).arg(scale);
        }
        // One warp per token, 4 tokens per block.
        // SAFETY: the arguments match the kernel's parameters in order and
        // type; the kernel waits for the grid before it (pdl_wait) first.
        unsafe {
            submit_pdl(
                k,
                stream,
                f,
                cfg((t.div_ceil(4), 1, 1), 128, 0),
                b,
                self.pdl(),
            )
        }
    }

    /// Group `n_pairs` (token, expert) pairs by expert on the GPU.
    ///
    /// - `ids`: u32 `[n_pairs]` expert of each pair (router output, flat).
    /// - `counts`: u32 `[n_experts]` pairs routed to each expert.
    /// - `offsets`: u32 `[n_experts + 1]` exclusive prefix sum of `counts`
    ///   (expert `e`'s rows are `offsets[e]..offsets[e+1]`).
    /// - `row_pair`: u32 `[n_pairs]` pair index of each grouped row.
    /// - `pair_row`: u32 `[n_pairs]` grouped row of each pair;
    ///   `u32::MAX` for a pair whose id is `>= n_experts` (never grouped).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_group(
        &self,
        stream: &CudaStream,
        ids: &impl DevicePtr<u32>,
        n_pairs: usize,
        n_experts: usize,
        counts: &mut impl DevicePtrMut<u32>,
        offsets: &mut impl DevicePtrMut<u32>,
        row_pair: &mut impl DevicePtrMut<u32>,
        pair_row: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        const K: &str = "moe_count";
        ensure(K, (1..=65535).contains(&n_experts), || {
            format!("n_experts = {n_experts} must be in 1..=65535")
        })?;
        check_len(K, "ids", ids.len(), n_pairs)?;
        check_len(K, "counts", counts.len(), n_experts)?;
        check_len(K, "offsets", offsets.len(), n_experts + 1)?;
        check_len(K, "row_pair", row_pair.len(), n_pairs)?;
        check_len(K, "pair_row", pair_row.len(), n_pairs)?;
        let (np, e) = (dim_u32(K, "n_pairs", n_pairs)?, n_experts as u32);
        let (ip, _g1) = ids.device_ptr(stream);
        let (cp, _g2) = counts.device_ptr_mut(stream);
        let (op, _g3) = offsets.device_ptr_mut(stream);
        let (rp, _g4) = row_pair.device_ptr_mut(stream);
        let (pp, _g5) = pair_row.device_ptr_mut(stream);
        let f = self.func(K)?;
        let mut b = builder(stream, f);
        b.arg(&ip).arg(&np).arg(&e).arg(&cp).arg(&pp);
        submit(K, b, cfg((e + 1, 1, 1), 256, 0))?;
        const S: &str = "moe_scatter";
        let f = self.func(S)?;
        let mut b = builder(stream, f);
        b.arg(&ip)
            .arg(&np)
            .arg(&e)
            .arg(&cp)
            .arg(&op)
            .arg(&rp)
            .arg(&pp);
        submit(S, b, cfg((e, 1, 1), 1024, 0))
    }

    /// `out[r, :] = src[idx[r] / div, :]` for `r < n_rows` (gather the
    /// tokens routed to an expert: `idx = row_pair`, `div = top_k`).
    /// An index past `n_src` writes a NaN row. One entry point for both
    /// 16-bit formats `A`: it copies bit patterns, and its fill is a NaN in
    /// either.
    ///
    /// - `src`: `A` `[n_src, hidden]`; `out`: `A` `[n_rows, hidden]`;
    ///   `hidden % 8 == 0`.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_rows<A: Act16>(
        &self,
        stream: &CudaStream,
        src: &impl DevicePtr<A>,
        n_src: usize,
        hidden: usize,
        idx: &impl DevicePtr<u32>,
        div: usize,
        n_rows: usize,
        out: &mut impl DevicePtrMut<A>,
    ) -> Result<()> {
        const K: &str = "gather_rows_bf16";
        ensure(K, hidden > 0 && hidden.is_multiple_of(8), || {
            format!("hidden = {hidden} must be a positive multiple of 8")
        })?;
        ensure(K, div >= 1, || "div must be >= 1".into())?;
        check_len(K, "src", src.len(), n_src * hidden)?;
        check_len(K, "idx", idx.len(), n_rows)?;
        check_len(K, "out", out.len(), n_rows * hidden)?;
        let (ns, h, dv, nr) = (
            dim_u32(K, "n_src", n_src)?,
            dim_u32(K, "hidden", hidden)?,
            dim_u32(K, "div", div)?,
            dim_u32(K, "n_rows", n_rows)?,
        );
        let (sp, _g1) = src.device_ptr(stream);
        let (ip, _g2) = idx.device_ptr(stream);
        let (op, _g3) = out.device_ptr_mut(stream);
        let f = self.func(K)?;
        let mut b = builder(stream, f);
        b.arg(&sp)
            .arg(&ip)
            .arg(&dv)
            .arg(&nr)
            .arg(&ns)
            .arg(&h)
            .arg(&op);
        submit(K, b, cfg((nr, 1, 1), 128, 0))
    }

    /// Deterministic weighted combine of grouped expert outputs into the
    /// residual stream: `residual[t, :] += sum_j weights[p] * y[pair_row[p], :]`
    /// with `p = t*top_k + j`, the sum taken in f32 in `j` order and added
    /// once. A `pair_row` entry past `n_pairs` contributes NaN.
    ///
    /// - `residual`: f32 `[n_tokens, hidden]`, updated in place.
    /// - `y`: bf16 or f32 `[n_tokens*top_k, hidden]` in grouped-row order.
    /// - `pair_row`: u32, `weights`: f32, both `[n_tokens*top_k]`.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine<Y: Elem>(
        &self,
        stream: &CudaStream,
        residual: &mut impl DevicePtrMut<f32>,
        y: &impl DevicePtr<Y>,
        pair_row: &impl DevicePtr<u32>,
        weights: &impl DevicePtr<f32>,
        n_tokens: usize,
        top_k: usize,
        hidden: usize,
    ) -> Result<()> {
        let k = by_elem::<Y>("moe_combine_f32", "moe_combine_bf16");
        ensure(k, (1..=ROUTER_MAX_TOPK).contains(&top_k), || {
            format!("top_k = {top_k} must be in 1..={ROUTER_MAX_TOPK}")
        })?;
        ensure(k, hidden > 0 && hidden.is_multiple_of(4), || {
            format!("hidden = {hidden} must be a positive multiple of 4")
        })?;
        let n_pairs = n_tokens * top_k;
        check_len(k, "residual", residual.len(), n_tokens * hidden)?;
        check_len(k, "y", y.len(), n_pairs * hidden)?;
        check_len(k, "pair_row", pair_row.len(), n_pairs)?;
        check_len(k, "weights", weights.len(), n_pairs)?;
        let (t, kk, h) = (
            dim_u32(k, "n_tokens", n_tokens)?,
            top_k as u32,
            dim_u32(k, "hidden", hidden)?,
        );
        dim_u32(k, "n_pairs * hidden", n_pairs * hidden)?;
        let (yp, _g1) = y.device_ptr(stream);
        let (pp, _g2) = pair_row.device_ptr(stream);
        let (wp, _g3) = weights.device_ptr(stream);
        let (rp, _g4) = residual.device_ptr_mut(stream);
        let f = self.func(k)?;
        let mut b = builder(stream, f);
        b.arg(&rp)
            .arg(&yp)
            .arg(&pp)
            .arg(&wp)
            .arg(&t)
            .arg(&kk)
            .arg(&h);
        submit(k, b, cfg((t, 1, 1), 256, 0))
    }
}
