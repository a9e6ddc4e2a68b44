//! Activation buffers and the KV cache, allocated once at load for the
//! largest prefill chunk and the most sequences a decode step runs, so
//! neither prefill nor decode allocates and the decode graphs' addresses
//! never change.

use crate::device::Gpu;
use crate::error::Result;
use cudarc::driver::CudaSlice;
use half::bf16;
use krasis_kernels::ops::attention::ring_min_capacity;
use krasis_kernels::{KvGeom, decode_workspace_len};
use krasis_model::arch::AttentionKind;
use krasis_model::{Geometry, MlpKind};

/// Rows of logits computed per LM-head GEMM when every position's logits
/// are wanted (`prompt_logits`): bounds that buffer to `LOGIT_ROWS * vocab`.
pub const LOGIT_ROWS: usize = 256;

pub struct Scratch {
    /// Most tokens one forward pass handles.
    pub cap: usize,
    /// Most rows (sequences) one decode step runs.
    pub seqs: usize,
    /// u32 `[cap]` input token ids (decode: row r's token; the sampler
    /// writes row r's next one to `[r]`).
    pub ids: CudaSlice<u32>,
    /// u32 `[seqs]`: each decode row's position (read by the captured
    /// graphs: `StartPos::Device`).
    pub pos: CudaSlice<u32>,
    /// u32 `[seqs]`: each decode row's first KV row, its sequence's place
    /// in the arena (`KvBase::Device`, `arena.rs`).
    pub kv_base: CudaSlice<u32>,
    /// u32 `[seqs]`: each decode row's first row in the sliding layers,
    /// its sequence's ring (`KvCache::ring` x its slot); unused by models
    /// without sliding layers.
    pub ring_base: CudaSlice<u32>,
    /// f32 `[cap, H]` residual stream.
    pub residual: CudaSlice<f32>,
    /// 16-bit `[cap, H]` normalized hidden state (GEMM input), in the
    /// format of the block that reads it (`act.rs`: BF16, or FP16 for an
    /// FP16 attention or MLP block; 2 bytes either way).
    pub normed: CudaSlice<bf16>,
    /// bf16 `[cap, q + 2kv]`.
    pub qkv: CudaSlice<bf16>,
    /// f32 `[cap, q + 2kv]`: the q/k/v projection before its bias (models
    /// with q/k/v biases), so the sum is rounded to BF16 once.
    pub qkv_f32: Option<CudaSlice<f32>>,
    /// bf16 `[cap, q]`.
    pub attn: CudaSlice<bf16>,
    /// f32 decode attention split workspace, `[seqs]` rows of
    /// `decode_workspace_len`.
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
    /// Sampling state: u32 `[seqs, V]` token counts, one row per sequence
    /// slot (its presence/frequency penalties), and the sampler workspace,
    /// one row per decode row (`SeqLens::sample_ws`).
    pub counts: CudaSlice<u32>,
    pub sample_ws: CudaSlice<u32>,
    /// u32 `[seqs, ceil(V / 32)]`: each sequence slot's grammar mask for
    /// its next token (structured output; rows of unconstrained sequences
    /// are never read; zeroed at allocation, so words past the tokenizer's
    /// vocabulary refuse their tokens).
    pub masks: CudaSlice<u32>,
    /// HCS decode prefetch's predicted routes.
    pub predict: Prediction,
    pub grouped: Option<GroupedScratch>,
    pub dense: Option<DenseScratch>,
    /// The segments of the current `Positions::Packed` pass (host side).
    pub packed: Vec<crate::forward::PackedSegment>,
    /// The element counts it was allocated with.
    pub lens: ScratchLens,
}

/// How prefill computes a chunk's routed experts once their rows are
/// grouped by expert; the expert format decides
/// (`ExpertFfn::grouped_path`), and with it the grouped scratch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupedPath {
    /// The grouped INT4 GEMMs read the expert blocks where they are: no
    /// dequantized copies, no gate/up rows.
    InPlace,
    /// A batch of experts dequantized to 16-bit at a time, per-expert
    /// GEMMs, the gate/up rows kept for the activation ([`DequantScratch`]).
    Dequantize,
}

impl GroupedPath {
    /// The path of INT4 experts of `g`'s dims in the cache's layout (the
    /// group it picks for them), for the pre-flight plan, which assumes
    /// INT4 experts.
    pub fn int4(g: &Geometry) -> Self {
        krasis_cache::ExpertLayout::int4(g.hidden, g.expert_intermediate)
            .and_then(|l| crate::expert_ffn::ExpertFfn::for_cache(&l, g).ok())
            .map_or(GroupedPath::Dequantize, |f| f.grouped_path())
    }
}

/// Buffers of the grouped routed-expert path.
pub struct GroupedScratch {
    pub counts: CudaSlice<u32>,
    pub offsets: CudaSlice<u32>,
    pub row_pair: CudaSlice<u32>,
    pub pair_row: CudaSlice<u32>,
    /// `[cap*top_k, H]` token rows gathered in expert order. This and the
    /// other 16-bit buffers of the grouped path hold the MLP block's format
    /// (BF16, or FP16: `MlpSpec::activations`).
    pub xg: CudaSlice<bf16>,
    /// `[cap*top_k, I]`: the activation (SwiGLU) rows.
    pub hact: CudaSlice<bf16>,
    /// f32 `[cap*top_k, H]` expert outputs in grouped-row order.
    pub y: CudaSlice<f32>,
    /// The dequantizing path's buffers ([`GroupedPath::Dequantize`]).
    pub dequant: Option<DequantScratch>,
}

impl GroupedScratch {
    /// The dequantizing path's buffers, which exist exactly when the expert
    /// format's path is [`GroupedPath::Dequantize`] (the engine sizes the
    /// scratch from `ExpertFfn::grouped_path`).
    pub(crate) fn dequantizing(&self) -> Result<&DequantScratch> {
        self.dequant.as_ref().ok_or_else(no_dequant_scratch)
    }
}

/// The internal error of a dequantizing step on the in-place path's scratch.
pub(crate) fn no_dequant_scratch() -> crate::error::GpuError {
    crate::error::GpuError::Unsupported(
        "internal: the grouped scratch has no dequantization buffers for an expert format that needs them"
            .into(),
    )
}

/// The buffers only the dequantizing grouped path needs.
pub struct DequantScratch {
    /// u32 `[E]` = 0..E (dequantize every expert of a layer).
    pub iota: CudaSlice<u32>,
    /// `[cap*top_k, 2I]` gate/up rows.
    pub h13: CudaSlice<bf16>,
    /// Experts dequantized at a time ([`dequant_batch`]).
    pub dequant_experts: usize,
    /// `[batch, 2I, H]` and `[batch, H, I]` dequantized experts.
    pub w13: CudaSlice<bf16>,
    pub w2: CudaSlice<bf16>,
    /// f32 `[batch, 2I]` and `[batch, H]`: the batch's expert biases
    /// (experts with biases).
    pub bias: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
}

/// The SwiGLU MLP's buffers, in the MLP block's 16-bit format.
pub struct DenseScratch {
    /// `[cap, 2*intermediate]`.
    pub gate_up: CudaSlice<bf16>,
    /// `[cap, intermediate]`.
    pub act: CudaSlice<bf16>,
}

/// One K and one V buffer per layer, each `[n_kv][capacity][head_dim]` bf16;
/// the capacity is per layer ([`kv_capacity`]): a full layer's rows are the
/// arena the running sequences share (`arena.rs`), a sliding layer's one
/// ring of [`KvCache::ring`] rows per sequence that can run at once (a
/// sequence's ring is the one of its sampler slot: rows `slot * ring ..
/// (slot + 1) * ring`, whatever its arena rows).
pub struct KvCache {
    /// Each layer's buffer shape.
    pub geoms: Vec<KvGeom>,
    pub k: Vec<CudaSlice<bf16>>,
    pub v: Vec<CudaSlice<bf16>>,
    /// Rows of one sequence's ring in every sliding layer ([`ring_rows`]);
    /// 0 without sliding layers.
    pub ring: usize,
    /// Rings per sliding layer: the most sequences that run at once.
    pub rings: usize,
}

impl KvCache {
    /// The cache of `shape` (a ring per sequence that may run in each
    /// sliding layer, the arena's rows in the full ones).
    pub fn new(gpu: &Gpu, g: &Geometry, shape: KvShape) -> Result<Self> {
        let mut k = Vec::with_capacity(g.num_layers);
        let mut v = Vec::with_capacity(g.num_layers);
        let mut geoms = Vec::with_capacity(g.num_layers);
        for l in 0..g.num_layers {
            let geom = kv_geom(g, shape.capacity(g, l));
            k.push(gpu.alloc_zeros(geom.len(), &format!("K cache of layer {l}"))?);
            v.push(gpu.alloc_zeros(geom.len(), &format!("V cache of layer {l}"))?);
            geoms.push(geom);
        }
        Ok(KvCache {
            geoms,
            k,
            v,
            ring: shape.ring,
            rings: shape.rings,
        })
    }

    pub fn bytes(&self) -> usize {
        self.geoms.iter().map(|g| 2 * g.len() * 2).sum()
    }

    /// Rows of one sequence's ring in layer `l` (0: a full layer, whose
    /// sequences hold linear rows of the arena).
    pub fn layer_ring(&self, g: &Geometry, l: usize) -> usize {
        match g.layers[l].attention {
            AttentionKind::Full => 0,
            AttentionKind::Sliding { .. } => self.ring,
        }
    }
}

/// Most new keys a sliding layer's prefill appends before it attends: a
/// longer segment runs in pieces (`attention.rs`), so a ring holds about
/// `window + 511` rows whatever the prefill chunk. (Sized by the chunk,
/// gpt-oss-120b's rings at the default 8,192-token chunk would take 2.4 GiB
/// for 8 sequences; pieces cost only launches: the ring kernels' rows are
/// chunk-invariant.)
pub const RING_PIECE_TOKENS: usize = 512;

/// The shape of a load's KV cache ([`KvCache::new`] allocates it; the plan
/// counts [`KvShape::bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    /// Positions of a full layer: the arena the running sequences share.
    pub rows: usize,
    /// Rows of one sequence's ring in every sliding layer (0: none).
    pub ring: usize,
    /// Rings per sliding layer: the most sequences that run at once.
    pub rings: usize,
}

impl KvShape {
    /// The cache of an arena of `rows`, prefill chunks of at most
    /// `max_chunk` tokens and up to `seqs` sequences at once, its rings
    /// whole multiples of `ring_block` rows (the prefix cache's block, so
    /// a block is contiguous in a ring; 1: no rounding). With blocks, a
    /// ring also holds a window more than a block, so at a prompt's end it
    /// still holds the window before its last whole block (what a later
    /// prompt resumes after: `prefix.rs`).
    pub fn new(
        g: &Geometry,
        rows: usize,
        max_chunk: usize,
        seqs: usize,
        ring_block: usize,
    ) -> Self {
        let b = ring_block.max(1);
        let ring = match ring_rows(g, max_chunk) {
            0 => 0,
            r if b > 1 => r.max(b + max_window(g) - 1).next_multiple_of(b),
            r => r,
        };
        KvShape {
            rows,
            ring,
            rings: seqs.max(1),
        }
    }

    /// Positions layer `l`'s KV buffers hold: a full layer the arena's
    /// rows; a sliding layer a ring for each sequence that can run at once.
    /// The ring is used even where it exceeds a short context, so the ring
    /// kernels' bound always holds.
    pub fn capacity(&self, g: &Geometry, l: usize) -> usize {
        match g.layers[l].attention {
            AttentionKind::Full => self.rows,
            AttentionKind::Sliding { .. } => self.rings * self.ring,
        }
    }

    /// Device bytes of the cache: K and V, 16-bit, every layer.
    pub fn bytes(&self, g: &Geometry) -> usize {
        (0..g.num_layers)
            .map(|l| 2 * kv_geom(g, self.capacity(g, l)).len() * 2)
            .sum()
    }
}

/// Rows of one sequence's ring in every sliding layer of `g`: what the
/// largest window needs when prefill appends up to `max_chunk` (at most
/// [`RING_PIECE_TOKENS`]) keys before it attends (the first of them looks
/// `window - 1` keys back), whatever the context; 0 for a model without
/// sliding layers. One size for every sliding layer, so a decode row's
/// ring base (its slot times this) serves them all.
pub fn ring_rows(g: &Geometry, max_chunk: usize) -> usize {
    match max_window(g) {
        0 => 0,
        w => ring_min_capacity(w, max_chunk.min(RING_PIECE_TOKENS)),
    }
}

/// The largest sliding window of `g` (0: no sliding layer).
pub fn max_window(g: &Geometry) -> usize {
    g.layers
        .iter()
        .filter_map(|l| match l.attention {
            AttentionKind::Sliding { window } => Some(window),
            AttentionKind::Full => None,
        })
        .max()
        .unwrap_or(0)
}

/// The shape of one K (or V) buffer of `capacity` positions.
pub fn kv_geom(g: &Geometry, capacity: usize) -> KvGeom {
    KvGeom {
        n_kv_heads: g.num_kv_heads,
        head_dim: g.head_dim,
        capacity,
    }
}

/// Bytes the prefill path may spend on dequantized (16-bit) experts at once.
pub const DEQUANT_BUDGET_BYTES: usize = 256 << 20;

/// Experts per dequantization batch: as many as fit [`DEQUANT_BUDGET_BYTES`]
/// (at least one, at most the layer).
pub fn dequant_batch(experts: usize, hidden: usize, inter: usize) -> usize {
    (DEQUANT_BUDGET_BYTES / (3 * hidden * inter * 2).max(1)).clamp(1, experts.max(1))
}

/// Device bytes of a scratch for `cap` tokens (the parts that grow with it).
pub fn bytes_for(g: &Geometry, cap: usize, gemv_tokens: usize, path: GroupedPath) -> usize {
    let (h, q, kv, e, k) = (
        g.hidden,
        g.q_dim(),
        g.kv_dim(),
        g.num_experts,
        g.top_k.max(1),
    );
    let i = g.expert_intermediate;
    let mut per_token = 4 * h + 2 * h + 2 * (q + 2 * kv) + 2 * q + 4 * e.max(1) + 8 * k + 4;
    if g.attention.qkv_bias {
        per_token += 4 * (q + 2 * kv);
    }
    if g.has_mlp(MlpKind::Moe) && cap > gemv_tokens {
        per_token += k * (2 * h + 2 * i + 4 * h + 8);
        if path == GroupedPath::Dequantize {
            per_token += k * 2 * 2 * i;
        }
    }
    if let Some(w) = swiglu_width(g) {
        per_token += 6 * w;
    }
    per_token * cap
}

/// Width of the SwiGLU MLP scratch ([`DenseScratch`]): the larger of the
/// dense layers' intermediate and the shared expert's, which both run
/// through `mlp::swiglu_mlp` on the same buffers; `None` without either.
pub(crate) fn swiglu_width(g: &Geometry) -> Option<usize> {
    let dense = g.has_mlp(MlpKind::Dense).then_some(g.intermediate);
    let shared = g.shared_intermediate.filter(|_| g.has_mlp(MlpKind::Moe));
    dense.max(shared)
}

/// The prefill chunk: `want` tokens, halved while its scratch would take
/// more than a quarter of the free memory in the budget (floor 256 tokens,
/// or `want` if smaller). Only matters under a VRAM limit or on small
/// cards, where every byte of scratch is a byte HCS cannot hold experts in:
/// with HCS, experts cross PCIe once per prompt whatever the chunk, so a
/// smaller chunk costs GEMM efficiency only, while coverage buys decode.
pub fn chunk_for_budget(gpu: &Gpu, g: &Geometry, want: usize, path: GroupedPath) -> Result<usize> {
    Ok(chunk_for_free(gpu.free_in_budget()?, g, want, path))
}

/// [`chunk_for_budget`] for `free` bytes in the budget (the plan calls it
/// with the free memory it predicts at that point of the load).
pub fn chunk_for_free(free: u64, g: &Geometry, want: usize, path: GroupedPath) -> usize {
    let free = free as usize;
    let floor = want.min(256);
    let mut cap = want;
    while cap > floor && bytes_for(g, cap, crate::options::GEMV_MAX_TOKENS, path) > free / 4 {
        cap = (cap / 2).max(floor);
    }
    cap
}

/// A scratch buffer HCS may lend (part of) to decode's experts
/// ([`ScratchLens::lendable`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LentBuffer {
    GroupedXg,
    GroupedHact,
    GroupedY,
    DequantH13,
    DequantW13,
    DequantW2,
    Residual,
    Normed,
    Qkv,
    QkvF32,
    Attn,
    Router,
    DenseGateUp,
    DenseAct,
}

/// Bytes `offset..offset + bytes` of one scratch buffer, lent to decode's
/// experts under HCS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lent {
    pub buffer: LentBuffer,
    pub offset: usize,
    pub bytes: usize,
}

/// Where a lent part of a per-row buffer starts: 256-byte aligned, like a
/// device allocation, so the expert slots carved from it keep the
/// alignment the GEMV kernels' vector loads need.
const LENT_ALIGN: usize = 256;

/// Rows of the per-row scratch buffers that decode keeps under HCS: a
/// step's rows (`seqs`), and at least the GEMV expert path's `gemv_tokens`
/// (a short prompt's rows). The rows past them are written only by prefill
/// chunks, and under HCS every prefill streams (`streamed.rs`): it lends
/// the reclaimable tier first and reloads it after, so they can hold
/// decode's experts in between.
pub fn decode_rows_kept(seqs: usize, gemv_tokens: usize) -> usize {
    seqs.max(gemv_tokens).max(1)
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
    /// f32 q/k/v before the bias (0 without q/k/v biases).
    pub qkv_f32: usize,
    pub attn: usize,
    pub router: usize,
    pub topk: usize,
    pub act: usize,
    pub logits: usize,
    pub grouped: Option<GroupedLens>,
    /// `(gate_up, act)` of the dense MLP and the shared expert.
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
    /// f32 expert biases of one batch: `[batch, 2I]` and `[batch, H]` (0
    /// without expert biases).
    pub b13: usize,
    pub b2: usize,
}

impl ScratchLens {
    pub fn new(g: &Geometry, cap: usize, gemv_tokens: usize, path: GroupedPath) -> Self {
        let (h, q, kv, e, k) = (g.hidden, g.q_dim(), g.kv_dim(), g.num_experts, g.top_k);
        let i = g.expert_intermediate;
        let grouped = (g.has_mlp(MlpKind::Moe) && cap > gemv_tokens).then(|| {
            let pairs = cap * k;
            let dq = match path {
                GroupedPath::InPlace => 0,
                GroupedPath::Dequantize => dequant_batch(e, h, i),
            };
            GroupedLens {
                experts: e,
                pairs,
                xg: pairs * h,
                h13: if dq > 0 { pairs * 2 * i } else { 0 },
                hact: pairs * i,
                y: pairs * h,
                dequant_experts: dq,
                w13: dq * 2 * i * h,
                w2: dq * h * i,
                b13: if g.experts.bias { dq * 2 * i } else { 0 },
                b2: if g.experts.bias { dq * h } else { 0 },
            }
        });
        let dense = swiglu_width(g).map(|w| (cap * 2 * w, cap * w));
        ScratchLens {
            cap,
            ids: cap,
            residual: cap * h,
            normed: cap * h,
            qkv: cap * (q + 2 * kv),
            qkv_f32: if g.attention.qkv_bias {
                cap * (q + 2 * kv)
            } else {
                0
            },
            attn: cap * q,
            router: cap * e.max(1),
            topk: cap * k.max(1),
            act: gemv_tokens.min(cap) * k.max(1) * i.max(1),
            logits: LOGIT_ROWS * g.vocab_size,
            grouped,
            dense,
        }
    }

    /// Device bytes of all the buffers (every element is 4 bytes but the
    /// BF16 ones, which are 2).
    pub fn bytes(&self) -> usize {
        let f32s = self.residual + self.qkv_f32 + self.router + self.topk + self.act + self.logits;
        let u32s = self.ids + self.topk;
        let bf16s = self.normed + self.qkv + self.attn;
        let mut b = 4 * (f32s + u32s) + 2 * bf16s;
        if let Some(gr) = &self.grouped {
            let iota = if gr.dequant_experts > 0 {
                gr.experts
            } else {
                0
            };
            let u32s = gr.experts + (gr.experts + 1) + 2 * gr.pairs + iota;
            b += 4 * (u32s + gr.y + gr.b13 + gr.b2)
                + 2 * (gr.xg + gr.h13 + gr.hact + gr.w13 + gr.w2);
        }
        if let Some((gu, act)) = self.dense {
            b += 2 * (gu + act);
        }
        b
    }

    /// The parts of the scratch only prefill uses, which HCS lends to
    /// decode's experts (`Hcs::new` carves whole expert slots of each, in
    /// this order): the grouped path's buffers whole, then every per-row
    /// buffer past its first `kept` rows ([`decode_rows_kept`]).
    pub fn lendable(&self, kept: usize) -> Vec<Lent> {
        use LentBuffer::*;
        let mut whole = Vec::new();
        if let Some(gr) = &self.grouped {
            whole.extend([
                (GroupedXg, 2 * gr.xg),
                (GroupedHact, 2 * gr.hact),
                (GroupedY, 4 * gr.y),
            ]);
            if gr.dequant_experts > 0 {
                whole.extend([
                    (DequantH13, 2 * gr.h13),
                    (DequantW13, 2 * gr.w13),
                    (DequantW2, 2 * gr.w2),
                ]);
            }
        }
        let mut v: Vec<Lent> = whole
            .into_iter()
            .filter(|&(_, bytes)| bytes > 0)
            .map(|(buffer, bytes)| Lent {
                buffer,
                offset: 0,
                bytes,
            })
            .collect();
        let (gate_up, dense_act) = self.dense.unwrap_or((0, 0));
        let rows = [
            (Residual, 4 * self.residual),
            (Normed, 2 * self.normed),
            (Qkv, 2 * self.qkv),
            (QkvF32, 4 * self.qkv_f32),
            (Attn, 2 * self.attn),
            (Router, 4 * self.router),
            (DenseGateUp, 2 * gate_up),
            (DenseAct, 2 * dense_act),
        ];
        let kept = kept.min(self.cap);
        for (buffer, bytes) in rows {
            let row = bytes / self.cap.max(1);
            let offset = (kept * row).next_multiple_of(LENT_ALIGN);
            if bytes > offset {
                v.push(Lent {
                    buffer,
                    offset,
                    bytes: bytes - offset,
                });
            }
        }
        v
    }
}

/// Element counts of the per-sequence decode state for `seqs` sequences
/// (what [`Scratch::new`] allocates besides [`ScratchLens`], and the plan's
/// item for it): each decode row's position and KV base, its attention
/// split workspace, its sequence's sampling counts and sampler workspace,
/// and its row of the next layer's predicted routes ([`Prediction`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqLens {
    pub seqs: usize,
    /// u32 `[seqs]` each: positions, KV bases (arena rows) and ring bases
    /// (sliding layers' rows).
    pub pos: usize,
    pub kv_base: usize,
    pub ring_base: usize,
    /// f32 `[seqs, decode_workspace_len]`.
    pub attn_ws: usize,
    /// u32 `[seqs, V]`.
    pub counts: usize,
    /// u32 `[seqs, ceil(V / 32)]`.
    pub masks: usize,
    /// u32 `[min(seqs, SAMPLE_MAX_ROWS), sample_workspace_len(V)]`: a
    /// decode step's rows are sampled in one launch, each in its own row.
    pub sample_ws: usize,
    /// [`Prediction`]: 16-bit `[seqs, H]`, f32 `[seqs, E]`, u32 and f32
    /// `[seqs, top_k]`.
    pub predict_normed: usize,
    pub predict_logits: usize,
    pub predict_topk: usize,
}

impl SeqLens {
    pub fn new(g: &Geometry, seqs: usize) -> Self {
        let seqs = seqs.max(1);
        SeqLens {
            seqs,
            pos: seqs,
            kv_base: seqs,
            ring_base: seqs,
            attn_ws: seqs * decode_workspace_len(g.num_heads, g.head_dim),
            counts: seqs * g.vocab_size,
            masks: seqs * g.vocab_size.div_ceil(32),
            sample_ws: seqs.min(krasis_kernels::SAMPLE_MAX_ROWS)
                * krasis_kernels::sample_workspace_len(g.vocab_size),
            predict_normed: seqs * g.hidden,
            predict_logits: seqs * g.num_experts.max(1),
            predict_topk: seqs * g.top_k.max(1),
        }
    }

    /// Device bytes (every element is 4 bytes but the normed rows, 2).
    pub fn bytes(&self) -> usize {
        4 * (self.pos
            + self.kv_base
            + self.ring_base
            + self.attn_ws
            + self.counts
            + self.masks
            + self.sample_ws
            + self.predict_logits
            + 2 * self.predict_topk)
            + 2 * self.predict_normed
    }
}

/// HCS decode prefetch's guess at the next MoE layer's routes, one row per
/// decode row: the next router's normed input, logits, experts and weights
/// (`moe.rs`). Apart from the step's own router outputs because the
/// prefetch stream reads `ids` while the compute stream routes on.
pub struct Prediction {
    pub normed: CudaSlice<bf16>,
    pub logits: CudaSlice<f32>,
    pub ids: CudaSlice<u32>,
    pub w: CudaSlice<f32>,
}

impl Scratch {
    /// The scratch of `cap`-token prefill chunks and decode steps of up to
    /// `seqs` sequences (`seqs <= cap`).
    pub fn new(
        gpu: &Gpu,
        g: &Geometry,
        cap: usize,
        gemv_tokens: usize,
        seqs: usize,
        path: GroupedPath,
    ) -> Result<Self> {
        let n = ScratchLens::new(g, cap, gemv_tokens, path);
        let sq = SeqLens::new(g, seqs);
        let grouped = match n.grouped {
            Some(gr) => Some(GroupedScratch {
                counts: gpu.alloc(gr.experts, "expert counts")?,
                offsets: gpu.alloc(gr.experts + 1, "expert offsets")?,
                row_pair: gpu.alloc(gr.pairs, "grouped row -> pair")?,
                pair_row: gpu.alloc(gr.pairs, "pair -> grouped row")?,
                xg: gpu.alloc(gr.xg, "grouped expert inputs")?,
                hact: gpu.alloc(gr.hact, "grouped SwiGLU outputs")?,
                y: gpu.alloc(gr.y, "grouped expert outputs")?,
                dequant: match gr.dequant_experts {
                    0 => None,
                    _ => Some(DequantScratch::new(gpu, &gr)?),
                },
            }),
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
            seqs: sq.seqs,
            ids: gpu.alloc_zeros(n.ids, "token ids")?,
            pos: gpu.alloc_zeros(sq.pos, "decode positions")?,
            kv_base: gpu.alloc_zeros(sq.kv_base, "decode rows' KV bases")?,
            ring_base: gpu.alloc_zeros(sq.ring_base, "decode rows' ring bases")?,
            residual: gpu.alloc(n.residual, "residual stream")?,
            normed: gpu.alloc(n.normed, "normalized hidden state")?,
            qkv: gpu.alloc(n.qkv, "q/k/v projections")?,
            qkv_f32: match n.qkv_f32 {
                0 => None,
                len => Some(gpu.alloc(len, "q/k/v projections before their bias")?),
            },
            attn: gpu.alloc(n.attn, "attention output")?,
            attn_ws: gpu.alloc(sq.attn_ws, "decode attention workspace")?,
            router: gpu.alloc(n.router, "router logits")?,
            topk_ids: gpu.alloc(n.topk, "selected experts")?,
            topk_w: gpu.alloc(n.topk, "expert weights")?,
            act: gpu.alloc(n.act, "expert activations")?,
            logits: gpu.alloc(n.logits, "logits")?,
            counts: gpu.alloc_zeros(sq.counts, "sampling token counts")?,
            sample_ws: gpu.alloc(sq.sample_ws, "sampler workspace")?,
            // Zeroed: a row's words past the tokenizer's are never written.
            masks: gpu.alloc_zeros(sq.masks, "grammar masks")?,
            predict: Prediction {
                normed: gpu.alloc(sq.predict_normed, "predicted routes: normed rows")?,
                logits: gpu.alloc(sq.predict_logits, "predicted routes: logits")?,
                ids: gpu.alloc(sq.predict_topk, "predicted routes: experts")?,
                w: gpu.alloc(sq.predict_topk, "predicted routes: weights")?,
            },
            grouped,
            dense,
            packed: Vec::new(),
            lens: n,
        })
    }
}

impl Scratch {
    /// (device address, bytes) of the parts only prefill uses
    /// ([`ScratchLens::lendable`], same order), decode keeping the first
    /// `kept` rows: HCS keeps experts in them while decode runs
    /// (`hcs/mod.rs`). Every other use of them is a prefill chunk, and
    /// under HCS every prefill lends the reclaimable tier first and
    /// reloads it after.
    pub(crate) fn lendable(&self, gpu: &Gpu, kept: usize) -> Vec<(u64, usize)> {
        use crate::device::addr;
        use LentBuffer::*;
        let s = &gpu.stream;
        let gr = self.grouped.as_ref();
        let dq = gr.and_then(|g| g.dequant.as_ref());
        let dense = self.dense.as_ref();
        self.lens
            .lendable(kept)
            .into_iter()
            .filter_map(|l| {
                let base = match l.buffer {
                    GroupedXg => addr(&gr?.xg, s),
                    GroupedHact => addr(&gr?.hact, s),
                    GroupedY => addr(&gr?.y, s),
                    DequantH13 => addr(&dq?.h13, s),
                    DequantW13 => addr(&dq?.w13, s),
                    DequantW2 => addr(&dq?.w2, s),
                    Residual => addr(&self.residual, s),
                    Normed => addr(&self.normed, s),
                    Qkv => addr(&self.qkv, s),
                    QkvF32 => addr(self.qkv_f32.as_ref()?, s),
                    Attn => addr(&self.attn, s),
                    Router => addr(&self.router, s),
                    DenseGateUp => addr(&dense?.gate_up, s),
                    DenseAct => addr(&dense?.act, s),
                };
                Some((base + l.offset as u64, l.bytes))
            })
            .collect()
    }
}

impl DequantScratch {
    fn new(gpu: &Gpu, gr: &GroupedLens) -> Result<Self> {
        let iota: Vec<u32> = (0..gr.experts as u32).collect();
        Ok(DequantScratch {
            iota: gpu.upload(&iota, "expert ids")?,
            h13: gpu.alloc(gr.h13, "grouped gate/up outputs")?,
            dequant_experts: gr.dequant_experts,
            w13: gpu.alloc(gr.w13, "dequantized gate/up experts (one batch)")?,
            w2: gpu.alloc(gr.w2, "dequantized down experts (one batch)")?,
            bias: match gr.b13 {
                0 => None,
                _ => Some((
                    gpu.alloc(gr.b13, "gate/up biases (one batch)")?,
                    gpu.alloc(gr.b2, "down biases (one batch)")?,
                )),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use krasis_model::synth::preset_geometry;

    /// gpt-oss's sliding layers keep a ring of window + chunk - 1
    /// positions per sequence that runs at once, its full layers the arena;
    /// a model without sliding layers keeps the arena everywhere, whatever
    /// the chunk and the sequences.
    #[test]
    fn sliding_layers_keep_only_their_rings() {
        let g = preset_geometry("gpt-oss-20b").unwrap();
        let (ctx, chunk) = (32768, 512);
        let per_pos = 2 * g.kv_dim() * 2;
        assert_eq!(ring_rows(&g, chunk), 128 + 512 - 1);
        // Longer chunks run their sliding attention in 512-token pieces;
        // shorter ones need less.
        assert_eq!(ring_rows(&g, 8192), 128 + 512 - 1);
        assert_eq!(ring_rows(&g, 100), 128 + 100 - 1);
        for seqs in [1, 4] {
            let shape = KvShape::new(&g, ctx, chunk, seqs, 1);
            let mut want = 0;
            for l in 0..g.num_layers {
                let cap = shape.capacity(&g, l);
                match g.layers[l].attention {
                    AttentionKind::Full => assert_eq!(cap, ctx, "layer {l}"),
                    AttentionKind::Sliding { window } => {
                        assert_eq!(window, 128);
                        assert_eq!(cap, seqs * (128 + 512 - 1), "layer {l}");
                    }
                }
                want += cap * per_pos;
            }
            assert_eq!(shape.bytes(&g), want);
            // 12 full layers of 32768 and 12 layers of `seqs` rings of 639.
            assert_eq!(want, 12 * (32768 + seqs * 639) * per_pos);
        }
        // The ring holds a chunk's window even past a short context.
        assert_eq!(KvShape::new(&g, 100, 512, 1, 1).capacity(&g, 0), 639);
        // With the prefix cache, a ring is whole blocks, and at least a
        // block and a window (tiny-gpt-oss: window 16, 32-token chunks).
        let blocks = KvShape::new(&g, ctx, 8192, 2, 256);
        assert_eq!((blocks.ring, blocks.rings), (768, 2));
        let tiny = preset_geometry("tiny-gpt-oss").unwrap();
        assert_eq!(ring_rows(&tiny, 32), 16 + 32 - 1);
        assert_eq!(KvShape::new(&tiny, 1024, 32, 1, 64).ring, 128);
        assert_eq!(KvShape::new(&tiny, 1024, 32, 1, 1).ring, 47);
        let a3b = preset_geometry("a3b").unwrap();
        assert_eq!(ring_rows(&a3b, 512), 0);
        for chunk in [1, 512, 8192] {
            assert_eq!(
                KvShape::new(&a3b, 4096, chunk, 8, 256).bytes(&a3b),
                2 * a3b.num_layers * a3b.kv_dim() * 4096 * 2
            );
        }
    }

    /// What `bytes_for` says a chunk costs per token is what the buffers
    /// `Scratch::new` allocates add per token, with and without q/k/v
    /// biases, on either grouped path, and the biased experts' batch
    /// buffers are counted.
    #[test]
    fn per_token_scratch_matches_the_buffers() {
        for (preset, path) in [
            ("a3b", GroupedPath::InPlace),
            ("a3b", GroupedPath::Dequantize),
            ("gpt-oss-20b", GroupedPath::Dequantize),
            ("tiny-gpt-oss", GroupedPath::Dequantize),
        ] {
            let g = preset_geometry(preset).unwrap();
            let gemv = crate::options::GEMV_MAX_TOKENS;
            let (a, b) = (64, 256);
            let lens = |cap| ScratchLens::new(&g, cap, gemv, path).bytes();
            assert_eq!(
                bytes_for(&g, b, gemv, path) - bytes_for(&g, a, gemv, path),
                lens(b) - lens(a),
                "{preset} {path:?}"
            );
            let n = ScratchLens::new(&g, a, gemv, path);
            let (q, kv) = (g.q_dim(), g.kv_dim());
            assert_eq!(
                n.qkv_f32,
                if g.attention.qkv_bias {
                    a * (q + 2 * kv)
                } else {
                    0
                }
            );
            let gr = n.grouped.unwrap();
            let (h, i) = (g.hidden, g.expert_intermediate);
            // In place: no dequantized experts, no gate/up rows.
            assert_eq!(
                path == GroupedPath::InPlace,
                (gr.dequant_experts, gr.w13, gr.w2, gr.h13) == (0, 0, 0, 0),
                "{preset} {path:?}"
            );
            if g.experts.bias {
                assert_eq!(
                    (gr.b13, gr.b2),
                    (gr.dequant_experts * 2 * i, gr.dequant_experts * h)
                );
            } else {
                assert_eq!((gr.b13, gr.b2), (0, 0));
            }
        }
    }
}

#[cfg(test)]
mod path_tests {
    use super::GroupedPath;
    use krasis_model::synth::preset_geometry;

    /// The plan's INT4 assumption: group-128 dims read in place, the
    /// group-32 dims of gpt-oss (2880) dequantized.
    #[test]
    fn the_int4_group_decides_the_plans_path() {
        assert_eq!(
            GroupedPath::int4(&preset_geometry("a3b").unwrap()),
            GroupedPath::InPlace
        );
        assert_eq!(
            GroupedPath::int4(&preset_geometry("gpt-oss-20b").unwrap()),
            GroupedPath::Dequantize
        );
    }
}
