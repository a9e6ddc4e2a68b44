//! Causal GQA attention: tensor-core flash attention for prefill and
//! split-K flash-decoding for one new token (`cuda/attention_*.cu`), over
//! q/K/V in bf16 or f16 ([`Act16`]; the output is bf16 either way).
//! The gpt-oss variant (sinks, sliding window, ring-indexed cache) is
//! [`RingAttn`] with the `*_ring` methods (`attention/ring.rs`).

mod hopper;
mod ring;

pub use ring::{RingAttn, ring_min_capacity};

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, PushKernelArg};
use half::bf16;

use super::rope::{KvBase, KvGeom, QkvGeom, StartPos, kv_rows_ptr};
use crate::launch::{
    Act16, KArgs, builder, by_act, cfg, check_len, dim_u32, ensure, submit, submit_pdl,
};
use crate::{Kernels, Result};

/// Most KV splits one decode launch uses (the workspace holds this many
/// partial outputs per row); mirrored by `DEC_MAX_SPLITS` in
/// `cuda/attention_decode.cu`, whose header says why 128.
pub const DECODE_MAX_SPLITS: usize = 128;
/// Smallest number of keys a decode split handles (below this, splitting
/// costs more in the combine than it gains).
const DECODE_MIN_CHUNK: usize = 128;
/// With a device-side position: fewest keys per split (one staged tile),
/// mirrored by `DEC_MIN_DYN_CHUNK` in `cuda/attention_decode.cu`.
const DECODE_MIN_DYN_CHUNK: usize = 64;
/// Query rows per block of the tensor-core prefill kernels.
const PREFILL_BLOCK_M: usize = 64;

/// A tensor-core prefill kernel: its head_dim, entry point, keys per staged
/// tile and whether Q is staged in shared memory (else held in registers).
/// Mirrors the entry points of `cuda/attention_prefill.cu`.
struct PrefillMma {
    head_dim: usize,
    name: &'static str,
    /// The f16 entry point (the same template with f16 q/K/V and P).
    name_f16: &'static str,
    block_n: usize,
    q_in_smem: bool,
}

const PREFILL_MMA: &[PrefillMma] = &[
    PrefillMma {
        head_dim: 64,
        name: "attn_prefill_mma_d64",
        name_f16: "attn_prefill_mma_d64_f16",
        block_n: 64,
        q_in_smem: false,
    },
    PrefillMma {
        head_dim: 128,
        name: "attn_prefill_mma_d128",
        name_f16: "attn_prefill_mma_d128_f16",
        block_n: 64,
        q_in_smem: false,
    },
    PrefillMma {
        head_dim: 256,
        name: "attn_prefill_mma_d256",
        name_f16: "attn_prefill_mma_d256_f16",
        block_n: 64,
        q_in_smem: true,
    },
];

impl PrefillMma {
    fn entry<A: Act16>(&self) -> &'static str {
        by_act::<A>(self.name, self.name_f16)
    }

    /// Dynamic shared memory per block (`pf_smem_bytes` in the kernel,
    /// which traps if launched with less): K and V tiles, plus Q.
    fn smem_bytes(&self) -> u32 {
        let rows = 2 * self.block_n + if self.q_in_smem { PREFILL_BLOCK_M } else { 0 };
        // 2 bytes per element in either format.
        (rows * self.head_dim * std::mem::size_of::<bf16>()) as u32
    }
}

/// f32 elements of the workspace [`Kernels::attention_decode`] needs:
/// `DECODE_MAX_SPLITS * n_q_heads * (head_dim + 2)` (partial outputs, then
/// per-split running max and sum).
pub fn decode_workspace_len(n_q_heads: usize, head_dim: usize) -> usize {
    DECODE_MAX_SPLITS * n_q_heads * (head_dim + 2)
}

fn log2_scale(scale: f32) -> f32 {
    scale * std::f32::consts::LOG2_E
}

impl Kernels {
    /// Causal prefill attention over the layer's KV cache.
    ///
    /// Query `t` (at absolute position `start_pos + t`) of q head `h`
    /// attends keys `0..=start_pos + t` of kv head `h / (n_q/n_kv)`;
    /// the cache must already hold positions `0..start_pos + n_tokens`
    /// (call [`Kernels::kv_append`] first), those of the sequence whose
    /// rows start at row `base` (position `p` in row `base + p`;
    /// `base + start_pos + n_tokens <= capacity`). Softmax is online in f32 with
    /// `scores * scale`; P is rounded to bf16 for the P·V product (as in
    /// flash attention); output rounded to bf16 once.
    ///
    /// - `qkv`: `A` `[n_tokens, geom.row_stride()]` (q read from it).
    /// - `k_cache`, `v_cache`: `A` `[n_kv][capacity][head_dim]`.
    /// - `out`: bf16 `[n_tokens, n_q_heads * head_dim]`.
    ///
    /// `A` is bf16, or f16 (the `_f16` entry points: f16 MMAs, P rounded
    /// to f16; the same launch shapes). Every wrapper here and in `ring`
    /// takes either.
    ///
    /// head_dim 64, 128 and 256 use the tensor-core (mma.sync bf16)
    /// kernels (head_dim 256 needs 96 KB of shared memory per block); other
    /// head dims fall back to [`Kernels::attention_prefill_simt`].
    #[allow(clippy::too_many_arguments)]
    pub fn attention_prefill<A: Act16>(
        &self,
        stream: &CudaStream,
        qkv: &impl DevicePtr<A>,
        geom: QkvGeom,
        start_pos: usize,
        kv: KvGeom,
        base: usize,
        k_cache: &impl DevicePtr<A>,
        v_cache: &impl DevicePtr<A>,
        scale: f32,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        let Some(mma) = PREFILL_MMA.iter().find(|m| m.head_dim == geom.head_dim) else {
            return self.attention_prefill_simt(
                stream, qkv, geom, start_pos, kv, base, k_cache, v_cache, scale, out,
            );
        };
        self.launch_prefill(
            mma.entry::<A>(),
            stream,
            qkv,
            geom,
            start_pos,
            kv,
            base,
            (k_cache, v_cache),
            scale,
            out,
            (PREFILL_BLOCK_M, 128, mma.smem_bytes()),
        )
    }

    /// Launches `kn`, a linear-cache prefill entry point with the plain
    /// argument list (the mma and Hopper kernels), over tiles of
    /// `shape.0` query rows with `shape.1` threads and `shape.2` bytes of
    /// dynamic shared memory per block.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_prefill<A: Act16>(
        &self,
        kn: &'static str,
        stream: &CudaStream,
        qkv: &impl DevicePtr<A>,
        geom: QkvGeom,
        start_pos: usize,
        kv: KvGeom,
        base: usize,
        (k_cache, v_cache): (&impl DevicePtr<A>, &impl DevicePtr<A>),
        scale: f32,
        out: &mut impl DevicePtrMut<bf16>,
        (block_m, threads, smem): (usize, u32, u32),
    ) -> Result<()> {
        let args = PrefillArgs::check(
            kn, qkv, geom, start_pos, kv, base, k_cache, v_cache, out, None,
        )?;
        let f = self.func(kn)?;
        self.allow_smem(kn, f, smem)?;
        let (qp, _g1) = qkv.device_ptr(stream);
        let (kp, _g2) = k_cache.device_ptr(stream);
        let (vp, _g3) = v_cache.device_ptr(stream);
        let (kp, vp) = (
            kv_rows_ptr(kp, base, geom.head_dim),
            kv_rows_ptr(vp, base, geom.head_dim),
        );
        let (op, _g4) = out.device_ptr_mut(stream);
        let sl2 = log2_scale(scale);
        let mut b = builder(stream, f);
        b.arg(&qp).arg(&kp).arg(&vp).arg(&op);
        b.arg(&args.t)
            .arg(&args.start)
            .arg(&args.nq)
            .arg(&args.nkv)
            .arg(&args.cap)
            .arg(&sl2);
        let m_tiles = geom.n_tokens.div_ceil(block_m) as u32;
        submit(kn, b, cfg((m_tiles, args.nq, 1), threads, smem))
    }

    /// Plain SIMT (no tensor cores) causal prefill attention with the same
    /// contract as [`Kernels::attention_prefill`]; any supported head_dim.
    /// Slower; kept for head dims without a tensor-core kernel and as a
    /// second implementation the tests compare against.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_prefill_simt<A: Act16>(
        &self,
        stream: &CudaStream,
        qkv: &impl DevicePtr<A>,
        geom: QkvGeom,
        start_pos: usize,
        kv: KvGeom,
        base: usize,
        k_cache: &impl DevicePtr<A>,
        v_cache: &impl DevicePtr<A>,
        scale: f32,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        let kn = by_act::<A>("attn_prefill_simt", "attn_prefill_simt_f16");
        let args = PrefillArgs::check(
            kn, qkv, geom, start_pos, kv, base, k_cache, v_cache, out, None,
        )?;
        let f = self.func(kn)?;
        let (qp, _g1) = qkv.device_ptr(stream);
        let (kp, _g2) = k_cache.device_ptr(stream);
        let (vp, _g3) = v_cache.device_ptr(stream);
        let (kp, vp) = (
            kv_rows_ptr(kp, base, geom.head_dim),
            kv_rows_ptr(vp, base, geom.head_dim),
        );
        let (op, _g4) = out.device_ptr_mut(stream);
        let sl2 = log2_scale(scale);
        let d = geom.head_dim as u32;
        let mut b = builder(stream, f);
        b.arg(&qp).arg(&kp).arg(&vp).arg(&op);
        b.arg(&args.t)
            .arg(&args.start)
            .arg(&args.nq)
            .arg(&args.nkv)
            .arg(&args.cap)
            .arg(&sl2)
            .arg(&d);
        // One warp per query row, 4 rows per block.
        submit(kn, b, cfg((args.t.div_ceil(4), args.nq, 1), 128, 0))
    }

    /// Attention of new tokens (decode) against their sequences' keys
    /// `0..=pos` (each token's k/v must already be appended). Token (row)
    /// `t` of the launch is its own sequence: at position `pos[t]`
    /// (`start`), over the rows from `base[t]` on (`base`), so one launch
    /// decodes a step of several sequences (continuous batching); with
    /// host positions, one token. Flash-decoding: the keys are split into
    /// chunks, each split (chunk, kv head, row) a partial softmax for the
    /// whole GQA group into the row's part of `workspace` (a block runs
    /// every [`splits_grid`]-th split of its kv head and row), then a
    /// combine kernel merges the splits in a fixed order. The split count
    /// is the launch's, so a row's result is bit-identical to a launch of
    /// that row alone (with the same capacity), whatever the other rows.
    ///
    /// - `qkv`: `A` (bf16 or f16) `[rows, geom.row_stride()]`
    ///   (`geom.n_tokens` = rows); the caches `A` as for prefill.
    /// - `workspace`: f32, at least `rows *` [`decode_workspace_len`].
    /// - `out`: bf16 `[rows, n_q_heads * head_dim]`.
    ///
    /// With `StartPos::Device` the split count is derived from the capacity
    /// (the launch shape never depends on the positions, so it can be
    /// graph-captured); with `StartPos::Host` from the actual length.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_decode<A: Act16>(
        &self,
        stream: &CudaStream,
        qkv: &impl DevicePtr<A>,
        geom: QkvGeom,
        start: StartPos<'_>,
        kv: KvGeom,
        base: KvBase<'_>,
        k_cache: &impl DevicePtr<A>,
        v_cache: &impl DevicePtr<A>,
        scale: f32,
        workspace: &mut impl DevicePtrMut<f32>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        let kn = by_act::<A>("attn_decode_split", "attn_decode_split_f16");
        let rows = geom.n_tokens;
        check_decode(kn, qkv, geom, kv, k_cache, v_cache, workspace, out)?;
        start.check(kn, rows)?;
        let span = match start {
            StartPos::Host(p) => {
                ensure(kn, rows == 1, || {
                    format!("{rows} decode rows need device positions (one each)")
                })?;
                p as usize + 1
            }
            StartPos::Device(_) => kv.capacity,
        };
        // Every row's keys (a host position's: through it) in the buffer.
        base.check(kn, &start, rows, kv.capacity)?;
        let (splits, chunk) = self.decode_splits(&start, geom.n_kv_heads, span);
        let (nq, nkv, d, cap) = (
            geom.n_q_heads as u32,
            geom.n_kv_heads as u32,
            geom.head_dim as u32,
            kv.capacity as u32,
        );
        let sl2 = log2_scale(scale);
        let nrows = dim_u32(kn, "rows", rows)?;
        let (pos_ptr, pos_base, _gp) = start.kernel_args(stream);
        let (base_ptr, base_rows, _gb) = base.kernel_args(stream);
        let (qp, _g1) = qkv.device_ptr(stream);
        check_qkv_align(kn, qp)?;
        let (kp, _g2) = k_cache.device_ptr(stream);
        let (vp, _g3) = v_cache.device_ptr(stream);
        let (kp, vp) = (
            kv_rows_ptr(kp, base_rows, geom.head_dim),
            kv_rows_ptr(vp, base_rows, geom.head_dim),
        );
        let (wp, _g4) = workspace.device_ptr_mut(stream);
        let f = self.func(kn)?;
        let mut b = KArgs::new();
        b.arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&wp)
            .arg(&pos_ptr)
            .arg(&pos_base)
            .arg(&base_ptr);
        b.arg(&nq)
            .arg(&nkv)
            .arg(&d)
            .arg(&cap)
            .arg(&chunk)
            .arg(&splits);
        b.arg(&sl2);
        // Each block runs splits x, x + grid, ... of its (kv head, row), so
        // the blocks stay at about the one-row count whatever the rows (a
        // grid of every split for every row launched mostly empty blocks
        // at short contexts: 2,048 at 4 rows for a3b, 256 with keys at 1K).
        let grid = splits_grid(splits, nrows);
        // SAFETY: the arguments match the kernel's parameters in order and
        // type; the kernel waits for the grid before it (pdl_wait) first.
        unsafe {
            submit_pdl(
                kn,
                stream,
                f,
                cfg((grid, nkv, nrows), 128, 0),
                b,
                self.pdl(),
            )
        }?;

        const C: &str = "attn_decode_combine";
        let (op, _g5) = out.device_ptr_mut(stream);
        let f = self.func(C)?;
        let mut b = KArgs::new();
        b.arg(&wp)
            .arg(&op)
            .arg(&pos_ptr)
            .arg(&pos_base)
            .arg(&nq)
            .arg(&d)
            .arg(&splits)
            .arg(&chunk);
        // SAFETY: the arguments match the kernel's parameters in order and
        // type; the kernel waits for the grid before it (pdl_wait) first.
        unsafe { submit_pdl(C, stream, f, cfg((nq, nrows, 1), d, 0), b, self.pdl()) }
    }
}

/// Blocks per (kv head, row) of a decode split launch of `splits` splits
/// over `rows` rows: `splits / rows` rounded up, so a launch keeps about the
/// one-row block count (each block runs every `grid`-th split; a row's
/// splits, and so its result, do not depend on it).
pub(crate) fn splits_grid(splits: u32, rows: u32) -> u32 {
    splits.div_ceil(rows.max(1))
}

/// Most q values of one GQA group (`group * head_dim`) the decode split
/// kernel stages (its `qs`, 8 KB of f32): Qwen3-235B's 16 x 128 and
/// Qwen3-Next's 8 x 256 reach it.
const DECODE_MAX_GROUP_DIM: usize = 2048;

/// Fails unless `qkv` starts 16-byte aligned: the decode split kernels
/// read a group's q as 16-byte vectors.
pub(crate) fn check_qkv_align(k: &'static str, ptr: u64) -> Result<()> {
    ensure(k, ptr.is_multiple_of(16), || {
        format!(
            "qkv starts at {ptr:#x}, not 16-byte aligned (a view must start at a multiple of 8 elements of an aligned allocation)"
        )
    })
}

/// Shapes and buffer lengths of a decode launch of `geom.n_tokens` rows
/// (both variants; the ring one takes one row).
#[allow(clippy::too_many_arguments)]
fn check_decode<A: Act16>(
    k: &'static str,
    qkv: &impl DeviceSlice<A>,
    geom: QkvGeom,
    kv: KvGeom,
    k_cache: &impl DeviceSlice<A>,
    v_cache: &impl DeviceSlice<A>,
    workspace: &impl DeviceSlice<f32>,
    out: &impl DeviceSlice<bf16>,
) -> Result<()> {
    geom.validate(k)?;
    kv.validate(k, &geom)?;
    ensure(k, geom.n_tokens >= 1, || {
        "decode takes at least one row".to_string()
    })?;
    let group = geom.n_q_heads / geom.n_kv_heads;
    ensure(k, group <= 16, || {
        format!("GQA group {group} > 16 is not supported")
    })?;
    ensure(k, group * geom.head_dim <= DECODE_MAX_GROUP_DIM, || {
        format!(
            "GQA group {group} x head_dim {} = {} q values exceed the {DECODE_MAX_GROUP_DIM} the decode kernel stages",
            geom.head_dim,
            group * geom.head_dim
        )
    })?;
    check_len(k, "qkv", qkv.len(), geom.len())?;
    check_len(k, "k_cache", k_cache.len(), kv.len())?;
    check_len(k, "v_cache", v_cache.len(), kv.len())?;
    check_len(
        k,
        "workspace",
        workspace.len(),
        geom.n_tokens * decode_workspace_len(geom.n_q_heads, geom.head_dim),
    )?;
    check_len(
        k,
        "out",
        out.len(),
        geom.n_tokens * geom.n_q_heads * geom.head_dim,
    )
}

impl Kernels {
    /// (splits, keys per split) of a decode launch over `span` keys (the
    /// live keys with a host position; their upper bound with a device one).
    fn decode_splits(&self, start: &StartPos<'_>, n_kv_heads: usize, span: usize) -> (u32, u32) {
        // About four latency-bound blocks per SM (the kernel's header).
        let want = (4 * self.sm_count() as usize).div_ceil(n_kv_heads);
        match start {
            StartPos::Host(_) => {
                let splits = want
                    .min(span.div_ceil(DECODE_MIN_CHUNK))
                    .clamp(1, DECODE_MAX_SPLITS);
                let chunk = span.div_ceil(splits);
                (span.div_ceil(chunk) as u32, chunk as u32)
            }
            // The kernels spread the live keys over the splits themselves
            // (chunk 0), so a short context in a long capacity still uses
            // many blocks.
            StartPos::Device(_) => (
                want.min(span.div_ceil(DECODE_MIN_DYN_CHUNK))
                    .clamp(1, DECODE_MAX_SPLITS) as u32,
                0,
            ),
        }
    }
}

struct PrefillArgs {
    t: u32,
    start: u32,
    nq: u32,
    nkv: u32,
    cap: u32,
}

impl PrefillArgs {
    #[allow(clippy::too_many_arguments)]
    fn check<A: Act16>(
        k: &'static str,
        qkv: &impl DevicePtr<A>,
        geom: QkvGeom,
        start_pos: usize,
        kv: KvGeom,
        base: usize,
        k_cache: &impl DevicePtr<A>,
        v_cache: &impl DevicePtr<A>,
        out: &impl DeviceSlice<bf16>,
        ring: Option<(usize, usize)>,
    ) -> Result<Self> {
        geom.validate(k)?;
        kv.validate(k, &geom)?;
        let linear = || {
            ensure(k, base + start_pos + geom.n_tokens <= kv.capacity, || {
                format!(
                    "positions {start_pos}..{} of a sequence at KV row {base} exceed the KV capacity {}",
                    start_pos + geom.n_tokens,
                    kv.capacity
                )
            })
        };
        match ring {
            // Linear rows from `base` (a plain layer, or a ring layer with
            // ring 0): every position up to the last query is a row.
            None | Some((_, 0)) => linear()?,
            Some((window, rows)) => {
                ensure(k, base + rows <= kv.capacity, || {
                    format!(
                        "a ring of {rows} rows at KV row {base} exceeds the KV capacity {}",
                        kv.capacity
                    )
                })?;
                match window {
                    // A full layer in a ring: p % rows == p for every position.
                    0 => ensure(k, start_pos + geom.n_tokens <= rows, || {
                        format!(
                            "positions {start_pos}..{} of a full layer exceed its ring of {rows} rows",
                            start_pos + geom.n_tokens
                        )
                    })?,
                    w => ring::check_window_fits(k, w, geom.n_tokens, rows)?,
                }
            }
        }
        check_len(k, "qkv", qkv.len(), geom.len())?;
        check_len(k, "k_cache", k_cache.len(), kv.len())?;
        check_len(k, "v_cache", v_cache.len(), kv.len())?;
        check_len(
            k,
            "out",
            out.len(),
            geom.n_tokens * geom.n_q_heads * geom.head_dim,
        )?;
        Ok(PrefillArgs {
            t: dim_u32(k, "n_tokens", geom.n_tokens)?,
            start: dim_u32(k, "start_pos", start_pos)?,
            nq: geom.n_q_heads as u32,
            nkv: geom.n_kv_heads as u32,
            cap: dim_u32(k, "capacity", kv.capacity)?,
        })
    }
}
