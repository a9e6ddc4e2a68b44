//! Activation buffers and the KV cache, allocated once at load for the
//! largest prefill chunk, so neither prefill nor decode allocates and the
//! decode graph's addresses never change.

use crate::device::Gpu;
use crate::error::Result;
use cudarc::driver::CudaSlice;
use half::bf16;
use krasis_kernels::{KvGeom, decode_workspace_len};
use krasis_model::{Geometry, MlpKind};

/// Rows of logits computed per LM-head GEMM when every position's logits
/// are wanted (`prompt_logits`): bounds that buffer to `LOGIT_ROWS * vocab`.
pub const LOGIT_ROWS: usize = 256;

pub struct Scratch {
    /// Most tokens one forward pass handles.
    pub cap: usize,
    /// u32 `[cap]` input token ids (decode: `[0]` is also the sampled token).
    pub ids: CudaSlice<u32>,
    /// u32 `[1]` position of the decode token (read by the captured graph).
    pub pos: CudaSlice<u32>,
    /// f32 `[cap, H]` residual stream.
    pub residual: CudaSlice<f32>,
    /// bf16 `[cap, H]` normalized hidden state (GEMM input).
    pub normed: CudaSlice<bf16>,
    /// bf16 `[cap, q + 2kv]`.
    pub qkv: CudaSlice<bf16>,
    /// bf16 `[cap, q]`.
    pub attn: CudaSlice<bf16>,
    /// f32 decode attention split workspace.
    pub attn_ws: CudaSlice<f32>,
    /// f32 `[cap, E]` router logits.
    pub router: CudaSlice<f32>,
    /// u32 / f32 `[cap, top_k]` selected experts and their weights.
    pub topk_ids: CudaSlice<u32>,
    pub topk_w: CudaSlice<f32>,
    /// f32 `[gemv_tokens * top_k, I]` SwiGLU output of the INT4 GEMV path.
    pub act: CudaSlice<f32>,
    /// f32 `[LOGIT_ROWS, V]`.
    pub logits: CudaSlice<f32>,
    /// Sampling state: u32 `[V]` token counts and the sampler workspace.
    pub counts: CudaSlice<u32>,
    pub sample_ws: CudaSlice<u32>,
    pub grouped: Option<GroupedScratch>,
    pub dense: Option<DenseScratch>,
}

/// Buffers of the grouped (dequantize + cuBLAS) routed-expert path.
pub struct GroupedScratch {
    pub counts: CudaSlice<u32>,
    pub offsets: CudaSlice<u32>,
    pub row_pair: CudaSlice<u32>,
    pub pair_row: CudaSlice<u32>,
    /// u32 `[E]` = 0..E (dequantize every expert of a layer).
    pub iota: CudaSlice<u32>,
    /// bf16 `[cap*top_k, H]` token rows gathered in expert order.
    pub xg: CudaSlice<bf16>,
    /// bf16 `[cap*top_k, 2I]`.
    pub h13: CudaSlice<bf16>,
    /// bf16 `[cap*top_k, I]`.
    pub hact: CudaSlice<bf16>,
    /// f32 `[cap*top_k, H]` expert outputs in grouped-row order.
    pub y: CudaSlice<f32>,
    /// Experts dequantized at a time ([`dequant_batch`]).
    pub dequant_experts: usize,
    /// bf16 `[batch, 2I, H]` and `[batch, H, I]` dequantized experts.
    pub w13: CudaSlice<bf16>,
    pub w2: CudaSlice<bf16>,
}

pub struct DenseScratch {
    /// bf16 `[cap, 2*intermediate]`.
    pub gate_up: CudaSlice<bf16>,
    /// bf16 `[cap, intermediate]`.
    pub act: CudaSlice<bf16>,
}

/// One K and one V buffer per layer, each `[n_kv][capacity][head_dim]` bf16.
pub struct KvCache {
    pub geom: KvGeom,
    pub k: Vec<CudaSlice<bf16>>,
    pub v: Vec<CudaSlice<bf16>>,
}

impl KvCache {
    pub fn new(gpu: &Gpu, g: &Geometry, capacity: usize) -> Result<Self> {
        let geom = kv_geom(g, capacity);
        let mut k = Vec::with_capacity(g.num_layers);
        let mut v = Vec::with_capacity(g.num_layers);
        for l in 0..g.num_layers {
            k.push(gpu.alloc_zeros(geom.len(), &format!("K cache of layer {l}"))?);
            v.push(gpu.alloc_zeros(geom.len(), &format!("V cache of layer {l}"))?);
        }
        Ok(KvCache { geom, k, v })
    }

    pub fn bytes(&self) -> usize {
        2 * self.k.len() * self.geom.len() * 2
    }
}

/// The shape of each layer's K (and V) buffer for `capacity` positions.
pub fn kv_geom(g: &Geometry, capacity: usize) -> KvGeom {
    KvGeom {
        n_kv_heads: g.num_kv_heads,
        head_dim: g.head_dim,
        capacity,
    }
}

/// Device bytes of the KV cache [`KvCache::new`] allocates: K and V, BF16,
/// every layer.
pub fn kv_bytes(g: &Geometry, capacity: usize) -> usize {
    2 * g.num_layers * kv_geom(g, capacity).len() * 2
}

/// BF16 bytes the prefill path may spend on dequantized experts at once.
pub const DEQUANT_BUDGET_BYTES: usize = 256 << 20;

/// Experts per dequantization batch: as many as fit [`DEQUANT_BUDGET_BYTES`]
/// (at least one, at most the layer).
pub fn dequant_batch(experts: usize, hidden: usize, inter: usize) -> usize {
    (DEQUANT_BUDGET_BYTES / (3 * hidden * inter * 2).max(1)).clamp(1, experts.max(1))
}

/// Device bytes of a scratch for `cap` tokens (the parts that grow with it).
pub fn bytes_for(g: &Geometry, cap: usize, gemv_tokens: usize) -> usize {
    let (h, q, kv, e, k) = (
        g.hidden,
        g.q_dim(),
        g.kv_dim(),
        g.num_experts,
        g.top_k.max(1),
    );
    let i = g.expert_intermediate;
    let mut per_token = 4 * h + 2 * h + 2 * (q + 2 * kv) + 2 * q + 4 * e.max(1) + 8 * k + 4;
    if g.has_mlp(MlpKind::Moe) && cap > gemv_tokens {
        per_token += k * (2 * h + 2 * 2 * i + 2 * i + 4 * h + 8);
    }
    if g.has_mlp(MlpKind::Dense) {
        per_token += 6 * g.intermediate;
    }
    per_token * cap
}

/// The prefill chunk: `want` tokens, halved while its scratch would take
/// more than a quarter of the free memory in the budget (floor 256 tokens,
/// or `want` if smaller). Only matters under a VRAM limit or on small
/// cards, where every byte of scratch is a byte HCS cannot hold experts in:
/// with HCS, experts cross PCIe once per prompt whatever the chunk, so a
/// smaller chunk costs GEMM efficiency only, while coverage buys decode.
pub fn chunk_for_budget(gpu: &Gpu, g: &Geometry, want: usize) -> Result<usize> {
    Ok(chunk_for_free(gpu.free_in_budget()?, g, want))
}

/// [`chunk_for_budget`] for `free` bytes in the budget (the plan calls it
/// with the free memory it predicts at that point of the load).
pub fn chunk_for_free(free: u64, g: &Geometry, want: usize) -> usize {
    let free = free as usize;
    let floor = want.min(256);
    let mut cap = want;
    while cap > floor && bytes_for(g, cap, crate::options::GEMV_MAX_TOKENS) > free / 4 {
        cap = (cap / 2).max(floor);
    }
    cap
}

/// Element counts of every scratch buffer for `cap` tokens: what
/// [`Scratch::new`] allocates, and what the pre-flight plan adds up, so the
/// two cannot differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScratchLens {
    pub cap: usize,
    pub ids: usize,
    pub residual: usize,
    pub normed: usize,
    pub qkv: usize,
    pub attn: usize,
    pub attn_ws: usize,
    pub router: usize,
    pub topk: usize,
    pub act: usize,
    pub logits: usize,
    pub counts: usize,
    pub sample_ws: usize,
    pub grouped: Option<GroupedLens>,
    /// `(gate_up, act)` of the dense MLP.
    pub dense: Option<(usize, usize)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupedLens {
    pub experts: usize,
    pub pairs: usize,
    pub xg: usize,
    pub h13: usize,
    pub hact: usize,
    pub y: usize,
    pub dequant_experts: usize,
    pub w13: usize,
    pub w2: usize,
}

impl ScratchLens {
    pub fn new(g: &Geometry, cap: usize, gemv_tokens: usize) -> Self {
        let (h, q, kv, e, k) = (g.hidden, g.q_dim(), g.kv_dim(), g.num_experts, g.top_k);
        let i = g.expert_intermediate;
        let grouped = (g.has_mlp(MlpKind::Moe) && cap > gemv_tokens).then(|| {
            let pairs = cap * k;
            let dq = dequant_batch(e, h, i);
            GroupedLens {
                experts: e,
                pairs,
                xg: pairs * h,
                h13: pairs * 2 * i,
                hact: pairs * i,
                y: pairs * h,
                dequant_experts: dq,
                w13: dq * 2 * i * h,
                w2: dq * h * i,
            }
        });
        let dense = g
            .has_mlp(MlpKind::Dense)
            .then(|| (cap * 2 * g.intermediate, cap * g.intermediate));
        ScratchLens {
            cap,
            ids: cap,
            residual: cap * h,
            normed: cap * h,
            qkv: cap * (q + 2 * kv),
            attn: cap * q,
            attn_ws: decode_workspace_len(g.num_heads, g.head_dim),
            router: cap * e.max(1),
            topk: cap * k.max(1),
            act: gemv_tokens.min(cap) * k.max(1) * i.max(1),
            logits: LOGIT_ROWS * g.vocab_size,
            counts: g.vocab_size,
            sample_ws: krasis_kernels::sample_workspace_len(g.vocab_size),
            grouped,
            dense,
        }
    }

    /// Device bytes of all the buffers (every element is 4 bytes but the
    /// BF16 ones, which are 2).
    pub fn bytes(&self) -> usize {
        let f32s = self.residual + self.attn_ws + self.router + self.topk + self.act + self.logits;
        let u32s = self.ids + 1 + self.topk + self.counts + self.sample_ws;
        let bf16s = self.normed + self.qkv + self.attn;
        let mut b = 4 * (f32s + u32s) + 2 * bf16s;
        if let Some(gr) = &self.grouped {
            let u32s = gr.experts + (gr.experts + 1) + 2 * gr.pairs + gr.experts;
            b += 4 * (u32s + gr.y) + 2 * (gr.xg + gr.h13 + gr.hact + gr.w13 + gr.w2);
        }
        if let Some((gu, act)) = self.dense {
            b += 2 * (gu + act);
        }
        b
    }
}

impl Scratch {
    pub fn new(gpu: &Gpu, g: &Geometry, cap: usize, gemv_tokens: usize) -> Result<Self> {
        let n = ScratchLens::new(g, cap, gemv_tokens);
        let grouped = match n.grouped {
            Some(gr) => {
                let iota: Vec<u32> = (0..gr.experts as u32).collect();
                Some(GroupedScratch {
                    counts: gpu.alloc(gr.experts, "expert counts")?,
                    offsets: gpu.alloc(gr.experts + 1, "expert offsets")?,
                    row_pair: gpu.alloc(gr.pairs, "grouped row -> pair")?,
                    pair_row: gpu.alloc(gr.pairs, "pair -> grouped row")?,
                    iota: gpu.upload(&iota, "expert ids")?,
                    xg: gpu.alloc(gr.xg, "grouped expert inputs")?,
                    h13: gpu.alloc(gr.h13, "grouped gate/up outputs")?,
                    hact: gpu.alloc(gr.hact, "grouped SwiGLU outputs")?,
                    y: gpu.alloc(gr.y, "grouped expert outputs")?,
                    dequant_experts: gr.dequant_experts,
                    w13: gpu.alloc(gr.w13, "dequantized gate/up experts (one batch)")?,
                    w2: gpu.alloc(gr.w2, "dequantized down experts (one batch)")?,
                })
            }
            None => None,
        };
        let dense = match n.dense {
            Some((gate_up, act)) => Some(DenseScratch {
                gate_up: gpu.alloc(gate_up, "dense MLP gate/up")?,
                act: gpu.alloc(act, "dense MLP activations")?,
            }),
            None => None,
        };
        Ok(Scratch {
            cap,
            ids: gpu.alloc_zeros(n.ids, "token ids")?,
            pos: gpu.alloc_zeros(1, "decode position")?,
            residual: gpu.alloc(n.residual, "residual stream")?,
            normed: gpu.alloc(n.normed, "normalized hidden state")?,
            qkv: gpu.alloc(n.qkv, "q/k/v projections")?,
            attn: gpu.alloc(n.attn, "attention output")?,
            attn_ws: gpu.alloc(n.attn_ws, "decode attention workspace")?,
            router: gpu.alloc(n.router, "router logits")?,
            topk_ids: gpu.alloc(n.topk, "selected experts")?,
            topk_w: gpu.alloc(n.topk, "expert weights")?,
            act: gpu.alloc(n.act, "expert activations")?,
            logits: gpu.alloc(n.logits, "logits")?,
            counts: gpu.alloc_zeros(n.counts, "sampling token counts")?,
            sample_ws: gpu.alloc(n.sample_ws, "sampler workspace")?,
            grouped,
            dense,
        })
    }
}
