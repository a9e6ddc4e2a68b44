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
        let geom = KvGeom {
            n_kv_heads: g.num_kv_heads,
            head_dim: g.head_dim,
            capacity,
        };
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
    if g.mlp_kinds.contains(&MlpKind::Moe) && cap > gemv_tokens {
        per_token += k * (2 * h + 2 * 2 * i + 2 * i + 4 * h + 8);
    }
    if g.mlp_kinds.contains(&MlpKind::Dense) {
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
    let free = gpu.free_in_budget()? as usize;
    let floor = want.min(256);
    let mut cap = want;
    while cap > floor && bytes_for(g, cap, crate::options::GEMV_MAX_TOKENS) > free / 4 {
        cap = (cap / 2).max(floor);
    }
    Ok(cap)
}

impl Scratch {
    pub fn new(gpu: &Gpu, g: &Geometry, cap: usize, gemv_tokens: usize) -> Result<Self> {
        let (h, q, kv, e, k) = (g.hidden, g.q_dim(), g.kv_dim(), g.num_experts, g.top_k);
        let i = g.expert_intermediate;
        let has_moe = g.mlp_kinds.contains(&MlpKind::Moe);
        let has_dense = g.mlp_kinds.contains(&MlpKind::Dense);
        let grouped = if has_moe && cap > gemv_tokens {
            let pairs = cap * k;
            let dq = dequant_batch(e, h, i);
            let iota: Vec<u32> = (0..e as u32).collect();
            Some(GroupedScratch {
                counts: gpu.alloc(e, "expert counts")?,
                offsets: gpu.alloc(e + 1, "expert offsets")?,
                row_pair: gpu.alloc(pairs, "grouped row -> pair")?,
                pair_row: gpu.alloc(pairs, "pair -> grouped row")?,
                iota: gpu.upload(&iota, "expert ids")?,
                xg: gpu.alloc(pairs * h, "grouped expert inputs")?,
                h13: gpu.alloc(pairs * 2 * i, "grouped gate/up outputs")?,
                hact: gpu.alloc(pairs * i, "grouped SwiGLU outputs")?,
                y: gpu.alloc(pairs * h, "grouped expert outputs")?,
                dequant_experts: dq,
                w13: gpu.alloc(dq * 2 * i * h, "dequantized gate/up experts (one batch)")?,
                w2: gpu.alloc(dq * h * i, "dequantized down experts (one batch)")?,
            })
        } else {
            None
        };
        let dense = if has_dense {
            Some(DenseScratch {
                gate_up: gpu.alloc(cap * 2 * g.intermediate, "dense MLP gate/up")?,
                act: gpu.alloc(cap * g.intermediate, "dense MLP activations")?,
            })
        } else {
            None
        };
        let router_cols = e.max(1);
        Ok(Scratch {
            cap,
            ids: gpu.alloc_zeros(cap, "token ids")?,
            pos: gpu.alloc_zeros(1, "decode position")?,
            residual: gpu.alloc(cap * h, "residual stream")?,
            normed: gpu.alloc(cap * h, "normalized hidden state")?,
            qkv: gpu.alloc(cap * (q + 2 * kv), "q/k/v projections")?,
            attn: gpu.alloc(cap * q, "attention output")?,
            attn_ws: gpu.alloc(
                decode_workspace_len(g.num_heads, g.head_dim),
                "decode attention workspace",
            )?,
            router: gpu.alloc(cap * router_cols, "router logits")?,
            topk_ids: gpu.alloc(cap * k.max(1), "selected experts")?,
            topk_w: gpu.alloc(cap * k.max(1), "expert weights")?,
            act: gpu.alloc(
                gemv_tokens.min(cap) * k.max(1) * i.max(1),
                "expert activations",
            )?,
            logits: gpu.alloc(LOGIT_ROWS * g.vocab_size, "logits")?,
            counts: gpu.alloc_zeros(g.vocab_size, "sampling token counts")?,
            sample_ws: gpu.alloc(
                krasis_kernels::sample_workspace_len(g.vocab_size),
                "sampler workspace",
            )?,
            grouped,
            dense,
        })
    }
}
