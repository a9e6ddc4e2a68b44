//! Routed experts of one MoE layer, after the router has written
//! `scratch.topk_ids` / `scratch.topk_w`. Both paths add
//! `sum_j w_j * expert_j(x)` into the f32 residual in a fixed order (no
//! float atomics), so results are reproducible run to run.
//!
//! - GEMV path (decode, and the prefill of prompts of at most
//!   `GEMV_MAX_TOKENS` tokens): each selected expert's block
//!   (INT4 or MXFP4, `expert_ffn.rs`) is read once per token through the
//!   pointer table; the activation, biases and the weighted combine are
//!   fused into the two kernels. No host sync, so it
//!   is what the decode CUDA graph captures.
//! - Grouped path (prefill of longer prompts, every chunk of them whatever
//!   its length, so each row is computed as in any other chunking):
//!   (token, expert) pairs are grouped by expert on the GPU and the rows
//!   gathered in the MLP block's format (BF16, or FP16:
//!   `MlpSpec::activations`). INT4 experts with group 128, and MXFP4
//!   experts of a prompt that takes them in place (`cx.mxfp4_in_place`,
//!   `expert_ffn::MXFP4_IN_PLACE_MAX_TOKENS`), then run two grouped GEMMs,
//!   all experts in one launch each, reading the expert blocks in place
//!   (`cuda/int4_gemm.cu`, `cuda/mxfp4_gemm.cu`). Otherwise the layer's
//!   experts are dequantized to 16-bit a batch at a time and run two
//!   cuBLAS GEMMs per expert with rows (an expert's biases are added to its
//!   own rows, before the combine). The per-expert row offsets are read
//!   back once per layer (one small sync) to size the launches.

use crate::act::{in_type, out16, view_mut};
use crate::blas::OutType;
use crate::error::{GpuError, Result};
use crate::expert_ffn::ExpertFfn;
use crate::forward::{Ctx, Positions};
use crate::hcs::TailLaunch;
use crate::scratch::Scratch;
use crate::weights::Weight16;
use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use krasis_kernels::Act16;
use krasis_kernels::TailMode;
use krasis_kernels::ops::moe::RouterMode;
use krasis_model::arch::{ActFormat, RouterKind};

fn table_parts<'a>(
    cx: &'a Ctx<'_>,
    moe_index: usize,
) -> Result<(cudarc::driver::CudaView<'a, u64>, &'a ExpertFfn)> {
    let experts = cx
        .experts
        .ok_or_else(|| GpuError::Unsupported("MoE layer but no expert table loaded".into()))?;
    Ok((experts.layer(moe_index), cx.ffn()?))
}

/// The routed experts of MoE layer `moe_index` for `t` tokens whose routes
/// are in `scratch.topk_ids`/`topk_w`, added into the residual. Expert
/// residency is the layer's pointer table: every expert's VRAM block when
/// all are resident; under HCS a decode step's table names each expert's
/// slot or its mapped host bytes, and streamed prefill's names the staging
/// buffers (`hcs/mod.rs`).
pub(crate) fn routed_experts(
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    moe_index: usize,
    t: usize,
    at: Positions,
) -> Result<()> {
    match at {
        Positions::Decode => experts_gemv(cx, sc, moe_index, t, true),
        // The path is the prompt's, not the chunk's: a chunk's rows must be
        // computed as they are in any other chunking (the prefix cache
        // resumes prefill at any block boundary), and the GEMV path (f32
        // gate/up, no dequantized weights) differs from the grouped one. A
        // prompt short enough for it is shorter than any cache block.
        Positions::Prefill { .. } if t <= cx.gemv_tokens && !cx.grouped_prefill => {
            experts_gemv(cx, sc, moe_index, t, false)
        }
        _ => experts_grouped(cx, sc, moe_index, t),
    }
}

/// Router GEMM (f32 logits) and top-k (the plan's router kind, plus its
/// logit bias or its selection bias) of decoder layer `l` over
/// `scratch.normed[..t]` (in the MLP block's format, as the router weight
/// is); in decode the post-attention RMSNorm is folded into the router
/// GEMV, which also writes `scratch.normed`.
/// `ignore_selection_bias` is `Fault::IgnoreSelectionBias` (tests only;
/// always false otherwise).
pub(crate) fn router(
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    l: usize,
    t: usize,
    at: Positions,
    ignore_selection_bias: bool,
) -> Result<()> {
    let Scratch {
        residual,
        normed,
        router,
        topk_ids,
        topk_w,
        ..
    } = sc;
    let out = RouterOut {
        normed,
        logits: router,
        ids: topk_ids,
        w: topk_w,
    };
    route(cx, l, t, at, ignore_selection_bias, residual, out)
}

/// Where a router launch writes: the normed input (decode, whose RMSNorm
/// is folded into the router GEMV; prefill reads it from here), f32
/// logits, the selected experts and their weights.
struct RouterOut<'a> {
    normed: &'a mut CudaSlice<bf16>,
    logits: &'a mut CudaSlice<f32>,
    ids: &'a mut CudaSlice<u32>,
    w: &'a mut CudaSlice<f32>,
}

/// [`router`] over `residual` into `out`: the step's own scratch, or
/// decode prefetch's prediction buffers (`scratch::Prediction`).
fn route(
    cx: &Ctx<'_>,
    l: usize,
    t: usize,
    at: Positions,
    ignore_selection_bias: bool,
    residual: &CudaSlice<f32>,
    out: RouterOut<'_>,
) -> Result<()> {
    let g = cx.g;
    let lw = &cx.w.layers[l];
    let crate::weights::MlpWeights::Moe {
        router,
        router_bias,
        selection_bias,
        ..
    } = &lw.mlp
    else {
        return Err(GpuError::Unsupported(format!("layer {l} has no router")));
    };
    let RouterOut {
        normed,
        logits,
        ids,
        w,
    } = out;
    match g.mlp.activations {
        ActFormat::Bf16 => router_logits::<bf16>(cx, l, t, at, router, residual, normed, logits)?,
        ActFormat::F16 => router_logits::<f16>(cx, l, t, at, router, residual, normed, logits)?,
    }
    let logits = &*logits;
    match (g.router.kind, router_bias) {
        // qwen3_moe: the softmax-first kernel, no bias.
        (RouterKind::SoftmaxTopK { renormalize }, None) => cx.kn.router_topk::<f32>(
            &cx.gpu.stream,
            logits,
            t,
            g.num_experts,
            g.top_k,
            renormalize,
            ids,
            w,
        )?,
        // glm4_moe: the kernel takes the selection bias in the bias slot
        // (added to the sigmoid scores for the choice only; see
        // `cuda/router.cu`). A logit bias as well is refused by
        // `support::check_supported`.
        (
            RouterKind::SigmoidGroupedTopK {
                groups,
                topk_groups,
                renormalize,
                scale,
            },
            None,
        ) => cx.kn.router_topk_with::<f32>(
            &cx.gpu.stream,
            logits,
            selection_bias.as_ref().filter(|_| !ignore_selection_bias),
            t,
            g.num_experts,
            g.top_k,
            RouterMode::SigmoidGrouped {
                groups,
                topk_groups,
                normalize: renormalize,
                scale,
            },
            ids,
            w,
        )?,
        (kind, bias) => cx.kn.router_topk_with::<f32>(
            &cx.gpu.stream,
            logits,
            bias.as_ref(),
            t,
            g.num_experts,
            g.top_k,
            match kind {
                RouterKind::SoftmaxTopK { renormalize } => RouterMode::SoftmaxTopK {
                    normalize: renormalize,
                },
                RouterKind::TopKSoftmax => RouterMode::TopKSoftmax,
                // Refused by `support::check_supported` before any upload.
                RouterKind::SigmoidGroupedTopK { .. } => {
                    return Err(GpuError::Unsupported(
                        "a router logit bias with the sigmoid group-limited router".into(),
                    ));
                }
            },
            ids,
            w,
        )?,
    }
    Ok(())
}

/// The router's f32 logits of layer `l` into `logits`, the block's
/// normed input (`normed`; decode writes it from `residual`) and weight in
/// `A`.
#[allow(clippy::too_many_arguments)]
fn router_logits<A: Act16>(
    cx: &Ctx<'_>,
    l: usize,
    t: usize,
    at: Positions,
    router: &Weight16,
    residual: &CudaSlice<f32>,
    normed: &mut CudaSlice<bf16>,
    logits: &mut CudaSlice<f32>,
) -> Result<()> {
    let (g, lw) = (cx.g, &cx.w.layers[l]);
    let w = router.get::<A>("the router weight")?;
    if matches!(at, Positions::Decode) {
        cx.norm_gemv::<A, f32>(
            residual,
            &lw.post_attention_norm,
            &w,
            t,
            g.num_experts,
            &mut view_mut::<A>(normed),
            &mut logits.slice_mut(..),
        )
    } else {
        cx.gemm_as(
            in_type::<A>(),
            (t, g.num_experts, g.hidden),
            cx.p(normed, 0),
            router.ptr(cx.gpu, 0),
            cx.p(logits, 0),
            OutType::F32,
            0.0,
            "router",
        )
    }
}

/// `decode`: a decode step, whose misses the HCS tail (when there is one)
/// brings to the GPU first.
fn experts_gemv(
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    moe_index: usize,
    t: usize,
    decode: bool,
) -> Result<()> {
    let (table, ffn) = table_parts(cx, moe_index)?;
    let mut after_fetch = false;
    if let (true, Some(tail)) = (decode, &cx.tail) {
        after_fetch = tail_step(cx, sc, tail, moe_index, t)?;
    }
    let ids = &sc.topk_ids;
    ffn.gate_up_act(
        cx,
        &sc.normed,
        &table,
        ids,
        t,
        u32::MAX,
        after_fetch,
        &mut sc.act,
    )?;
    ffn.down_combine(cx, &sc.act, &table, ids, &sc.topk_w, t, &mut sc.residual)
}

/// HCS decode, before MoE layer `moe_index`'s GEMVs read the table: the
/// layer's misses promoted into the tail and copied there; with prefetch,
/// first the wait for this layer's prefetch, and after the copies the next
/// MoE layer's predicted experts promoted on the side stream
/// (`hcs/tail.rs`). Returns whether the last kernel it launched on the
/// compute stream is the fetch, which the w13 GEMV then overlaps
/// (`cuda/expert_tail.cu`).
fn tail_step(
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    tail: &TailLaunch<'_>,
    moe_index: usize,
    t: usize,
) -> Result<bool> {
    let (s, k) = (&cx.gpu.stream, cx.g.top_k);
    let n = t * k;
    let driver = GpuError::driver;
    if let (Some(p), true) = (&tail.prefetch, moe_index > 0) {
        // The previous MoE layer prefetched for this one.
        s.wait(p.done)
            .map_err(driver("waiting for the expert prefetch"))?;
    }
    let ids = sc.topk_ids.slice(..n);
    let mode = if cx.unmarked_fetch {
        TailMode::DemandUnmarked
    } else {
        TailMode::Demand
    };
    cx.kn
        .tail_lookup(s, &tail.demand, moe_index, &ids, n, mode)?;
    if !cx.stale_tail {
        cx.kn.tail_fetch(s, &tail.demand)?;
    }
    let Some(p) = &tail.prefetch else {
        return Ok(!cx.stale_tail);
    };
    let Some(&next) = p.moe_layers.get(moe_index + 1) else {
        return Ok(!cx.stale_tail);
    };
    // The prediction: the next layer's router over this layer's residual
    // (before its experts and the next attention add to it), into buffers
    // of its own (the side stream reads its ids while the compute stream
    // routes the next layer).
    let Scratch {
        residual, predict, ..
    } = sc;
    let out = RouterOut {
        normed: &mut predict.normed,
        logits: &mut predict.logits,
        ids: &mut predict.ids,
        w: &mut predict.w,
    };
    route(cx, next, t, Positions::Decode, false, residual, out)?;
    p.fork
        .record(s)
        .map_err(driver("forking the expert prefetch"))?;
    p.stream
        .wait(p.fork)
        .map_err(driver("forking the expert prefetch"))?;
    let guess = predict.ids.slice(..n);
    let mode = TailMode::Prefetch { max: p.max };
    cx.kn
        .tail_lookup(p.stream, &p.args, moe_index + 1, &guess, n, mode)?;
    if !cx.stale_prefetch {
        cx.kn.tail_fetch(p.stream, &p.args)?;
    }
    p.done
        .record(p.stream)
        .map_err(driver("joining the expert prefetch"))?;
    Ok(false)
}

fn experts_grouped(cx: &Ctx<'_>, sc: &mut Scratch, moe_index: usize, t: usize) -> Result<()> {
    let (table, ffn) = table_parts(cx, moe_index)?;
    let (s, kn, g) = (&cx.gpu.stream, cx.kn, cx.g);
    let (e, k, h) = (g.num_experts, g.top_k, g.hidden);
    let pairs = t * k;
    let gs = sc
        .grouped
        .as_mut()
        .ok_or_else(|| GpuError::Unsupported("grouped expert path without its scratch".into()))?;
    kn.moe_group(
        s,
        &sc.topk_ids,
        pairs,
        e,
        &mut gs.counts,
        &mut gs.offsets,
        &mut gs.row_pair,
        &mut gs.pair_row,
    )?;
    // The gather copies 16-bit patterns: the MLP block's format either way.
    kn.gather_rows(s, &sc.normed, t, h, &gs.row_pair, k, pairs, &mut gs.xg)?;
    let mut offsets = vec![0u32; e + 1];
    s.memcpy_dtoh(&gs.offsets, &mut offsets)
        .map_err(GpuError::driver("reading expert row offsets"))?;
    if offsets[e] as usize != pairs {
        return Err(GpuError::Unsupported(format!(
            "expert grouping covered {} of {pairs} (token, expert) pairs in MoE layer {moe_index}; \
             the router produced an out-of-range expert id",
            offsets[e]
        )));
    }
    if !ffn.grouped_gemms(cx, &table, gs, &offsets)? {
        dequant_gemms(cx, &table, ffn, gs, &offsets)?;
    }
    kn.moe_combine::<f32>(
        s,
        &mut sc.residual,
        &gs.y,
        &gs.pair_row,
        &sc.topk_w,
        t,
        k,
        h,
    )?;
    Ok(())
}

/// The grouped path of an expert format without grouped kernels: experts
/// dequantized to 16-bit a batch at a time, then per-expert cuBLAS GEMMs.
fn dequant_gemms(
    cx: &Ctx<'_>,
    table: &cudarc::driver::CudaView<'_, u64>,
    ffn: &ExpertFfn,
    gs: &mut crate::scratch::GroupedScratch,
    offsets: &[u32],
) -> Result<()> {
    let (e, h, i) = (cx.g.num_experts, cx.g.hidden, cx.g.expert_intermediate);
    let (input, gate_up_out) = match cx.g.mlp.activations {
        ActFormat::Bf16 => (in_type::<bf16>(), out16::<bf16>()),
        ActFormat::F16 => (in_type::<f16>(), out16::<f16>()),
    };
    // Experts are dequantized `batch` at a time so the 16-bit workspace stays
    // bounded (a whole 512-expert layer would be 3.2 GB); each batch's
    // GEMMs finish on the stream before the next batch overwrites it.
    let batch = gs.dequantizing()?.dequant_experts;
    for b0 in (0..e).step_by(batch) {
        let b1 = (b0 + batch).min(e);
        if offsets[b1] == offsets[b0] {
            continue;
        }
        ffn.dequant(cx, table, (b0, b1), gs)?;
        let dq = gs.dequantizing()?;
        for x in b0..b1 {
            let (a, b) = (offsets[x] as usize, offsets[x + 1] as usize);
            if b <= a {
                continue;
            }
            expert_gemm(
                cx,
                input,
                (b - a, 2 * i, h),
                (
                    cx.p(&gs.xg, a * h),
                    cx.p(&dq.w13, (x - b0) * 2 * i * h),
                    cx.p(&dq.h13, a * 2 * i),
                ),
                gate_up_out,
                "expert gate/up",
            )?;
        }
        ffn.activate(cx, gs, offsets, (b0, b1))?;
        let dq = gs.dequantizing()?;
        for x in b0..b1 {
            let (a, b) = (offsets[x] as usize, offsets[x + 1] as usize);
            if b <= a {
                continue;
            }
            expert_gemm(
                cx,
                input,
                (b - a, h, i),
                (
                    cx.p(&gs.hact, a * i),
                    cx.p(&dq.w2, (x - b0) * h * i),
                    cx.p(&gs.y, a * h),
                ),
                OutType::F32,
                "expert down",
            )?;
        }
        ffn.down_bias(cx, gs, offsets, (b0, b1))?;
    }
    Ok(())
}

/// One expert's GEMM over its grouped rows `(x, w, y)` (device addresses):
/// the algorithm is chosen for a chunk's share of rows per expert
/// ([`crate::blas::expert_ref_rows`]) and serves every row count the same
/// way, so a token's expert output does not depend on which other tokens
/// share its chunk.
fn expert_gemm(
    cx: &Ctx<'_>,
    input: crate::blas::InType,
    (m, n, k): (usize, usize, usize),
    (x, w, y): (u64, u64, u64),
    out: OutType,
    what: &str,
) -> Result<()> {
    crate::blas::gemm(
        &cx.gpu.blas,
        &crate::blas::Gemm {
            m,
            n,
            k,
            x,
            w,
            y,
            input,
            out,
            beta: 0.0,
            ref_rows: crate::blas::expert_ref_rows(cx.g.top_k, cx.g.num_experts),
        },
        what,
    )
}

/// Adds the experts `t` tokens selected (`scratch.topk_ids`) to `counts`.
/// Heatmap recording only: it reads the ids back, a sync per layer.
pub(crate) fn record_routes(
    cx: &Ctx<'_>,
    sc: &Scratch,
    t: usize,
    counts: &mut [u64],
) -> Result<()> {
    let k = cx.g.top_k;
    let ids = cx.gpu.download(&sc.topk_ids, t * k, "selected experts")?;
    let n = counts.len();
    for id in ids {
        let c = counts
            .get_mut(id as usize)
            .ok_or_else(|| GpuError::Unsupported(format!("router selected expert {id} of {n}")))?;
        *c += 1;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Per-token route recording for `bench --check`. Nothing here runs unless
// `Model::token_routes` is set, which only the two methods below do; the
// normal prefill and decode paths are unchanged.

/// The router's choice of every token of one run, `[moe layer][position]`,
/// with the gap of its router logits (see [`crate::check::Route`]).
#[derive(Debug, Default)]
pub struct RouteLog {
    pub layers: crate::check::Routes,
}

/// Copies the `t` tokens' selected ids and router logits of decoder layer
/// `l` (MoE layer `moe_index`) to the host (a sync per MoE layer), with the
/// router bias added as the top-k kernel adds it, and each decision's gap
/// and k-th value measured as the reference measures its near-ties
/// (`layers::router::decision_gap`: the logits of the softmax routers; the
/// choice scores with the selection bias, and the group gap, of the sigmoid
/// grouped router), so the gaps are those of what the experts were chosen
/// by. Prefill chunks land at their
/// absolute positions; a decode token is appended after the positions
/// logged so far.
#[allow(clippy::too_many_arguments)]
pub(crate) fn log_token_routes(
    cx: &Ctx<'_>,
    sc: &Scratch,
    l: usize,
    moe_index: usize,
    t: usize,
    at: Positions,
    log: &mut RouteLog,
) -> Result<()> {
    let (k, ne) = (cx.g.top_k, cx.g.num_experts);
    let ids = cx.gpu.download(&sc.topk_ids, t * k, "selected experts")?;
    let mut logits = cx.gpu.download(&sc.router, t * ne, "router logits")?;
    if let crate::weights::MlpWeights::Moe {
        router_bias: Some(b),
        ..
    } = &cx.w.layers[l].mlp
    {
        let bias = cx.gpu.download(b, ne, "router bias")?;
        for row in logits.chunks_exact_mut(ne) {
            for (v, b) in row.iter_mut().zip(&bias) {
                *v += b;
            }
        }
    }
    let selection = match &cx.w.layers[l].mlp {
        crate::weights::MlpWeights::Moe {
            selection_bias: Some(b),
            ..
        } => Some(cx.gpu.download(b, ne, "router selection bias")?),
        _ => None,
    };
    let rows = log
        .layers
        .get_mut(moe_index)
        .ok_or_else(|| GpuError::Unsupported(format!("route log has no MoE layer {moe_index}")))?;
    let first = match at {
        Positions::Prefill { start, .. } => start,
        Positions::Decode => rows.len(),
        Positions::Packed => {
            return Err(GpuError::Unsupported(
                "route logging of a packed prefill (it logs one sequence)".into(),
            ));
        }
    };
    if rows.len() < first + t {
        rows.resize(first + t, crate::check::Route::default());
    }
    for (i, row) in rows[first..first + t].iter_mut().enumerate() {
        let (kth, gap) = krasis_model::layers::router::decision_gap(
            cx.g.router.kind,
            &logits[i * ne..(i + 1) * ne],
            selection.as_deref(),
            k,
        );
        *row = crate::check::Route {
            experts: ids[i * k..(i + 1) * k].to_vec(),
            gap,
            kth,
        };
    }
    Ok(())
}

impl crate::engine::CudaEngine {
    fn start_route_log(&mut self) {
        let layers = self.geometry().num_moe_layers();
        self.model_mut().token_routes = Some(RouteLog {
            layers: vec![Vec::new(); layers],
        });
    }

    /// Takes the log and checks that it covers positions `0..positions`
    /// of every MoE layer.
    fn finish_route_log(&mut self, positions: usize) -> Result<crate::check::Routes> {
        let log = self.model_mut().token_routes.take().unwrap_or_default();
        for (m, rows) in log.layers.iter().enumerate() {
            if rows.len() != positions || rows.iter().any(|r| r.experts.is_empty()) {
                return Err(GpuError::Unsupported(format!(
                    "route log of MoE layer {m} covers {} of {positions} positions (decode ran \
                     as a CUDA graph?)",
                    rows.iter().filter(|r| !r.experts.is_empty()).count()
                )));
            }
        }
        Ok(log.layers)
    }

    /// [`krasis_model::Engine::prompt_logits`] that also returns the
    /// experts the router selected for every token at every MoE layer
    /// (`[moe layer][position]`) and its router-logit gap there. For
    /// `bench --check`: it copies each layer's router output to the host
    /// (a sync per layer and chunk), so it is slower than `prompt_logits`,
    /// whose path it leaves untouched.
    pub fn prompt_logits_with_routes(
        &mut self,
        tokens: &[u32],
    ) -> Result<(Vec<Vec<f32>>, crate::check::Routes)> {
        self.start_route_log();
        let logits = krasis_model::Engine::prompt_logits(self, tokens);
        let routes = self.finish_route_log(tokens.len());
        Ok((logits?, routes?))
    }

    /// [`Self::greedy_logits`] that also returns the routes of positions
    /// `0..prompt.len() + n - 1` (the prompt's from prefill, every fed-back
    /// token's from its decode step). Decode must run eagerly for the
    /// routes to be seen, so this turns CUDA graphs off and leaves them off
    /// (`set_cuda_graphs(true)` turns them back on; the logits are the same
    /// either way).
    pub fn greedy_logits_with_routes(
        &mut self,
        prompt: &[u32],
        n: usize,
    ) -> Result<(Vec<u32>, Vec<Vec<f32>>, crate::check::Routes)> {
        self.set_cuda_graphs(false);
        self.start_route_log();
        let out = self.greedy_logits(prompt, n);
        let routes = self.finish_route_log(prompt.len() + n.saturating_sub(1));
        let (toks, rows) = out?;
        Ok((toks, rows, routes?))
    }
}
