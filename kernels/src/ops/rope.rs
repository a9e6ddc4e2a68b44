//! Per-head q/k RMSNorm fused with RoPE, RoPE from a frequency table, and
//! KV-cache append (`cuda/rope.cu`, `cuda/kv_cache.cu`), plus the geometry
//! types shared with the attention wrappers.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use half::bf16;

use crate::launch::{Act16, KArgs, by_act, cfg, check_len, dim_u32, ensure, shape_err, submit_pdl};
use crate::{Kernels, Result};

/// Shape of the fused QKV projection output, bf16 or f16 ([`Act16`])
/// `[n_tokens, row_stride]`
/// with each row `[q: n_q_heads*head_dim | k: n_kv_heads*head_dim |
/// v: n_kv_heads*head_dim]` and each head's `head_dim` values contiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QkvGeom {
    pub n_tokens: usize,
    pub n_q_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl QkvGeom {
    /// Elements per token row: `(n_q_heads + 2*n_kv_heads) * head_dim`.
    pub fn row_stride(&self) -> usize {
        (self.n_q_heads + 2 * self.n_kv_heads) * self.head_dim
    }
    /// Total elements of the QKV buffer.
    pub fn len(&self) -> usize {
        self.n_tokens * self.row_stride()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub(crate) fn validate(&self, k: &'static str) -> Result<()> {
        ensure(k, self.n_q_heads > 0 && self.n_kv_heads > 0, || {
            "head counts must be positive".into()
        })?;
        ensure(k, self.n_q_heads.is_multiple_of(self.n_kv_heads), || {
            format!(
                "n_q_heads = {} is not a multiple of n_kv_heads = {}",
                self.n_q_heads, self.n_kv_heads
            )
        })?;
        ensure(
            k,
            self.head_dim >= 64 && self.head_dim <= 256 && self.head_dim.is_multiple_of(64),
            || format!("head_dim = {} must be 64, 128, 192 or 256", self.head_dim),
        )?;
        dim_u32(k, "qkv elements", self.len())?;
        Ok(())
    }
}

/// One layer's KV cache: two bf16 buffers (K and V), each laid out
/// `[n_kv_heads][capacity][head_dim]` (head-major so one head's keys are
/// contiguous for attention). The engine keeps one pair per layer (or one
/// allocation sliced per layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeom {
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Positions the cache can hold.
    pub capacity: usize,
}

impl KvGeom {
    /// Elements of one of the two buffers.
    pub fn len(&self) -> usize {
        self.n_kv_heads * self.capacity * self.head_dim
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub(crate) fn validate(&self, k: &'static str, qkv: &QkvGeom) -> Result<()> {
        if self.n_kv_heads != qkv.n_kv_heads || self.head_dim != qkv.head_dim {
            return Err(shape_err(
                k,
                format!("KV cache geometry {self:?} does not match the QKV geometry {qkv:?}"),
            ));
        }
        ensure(k, self.capacity > 0, || {
            "KV capacity must be positive".into()
        })?;
        dim_u32(k, "kv cache elements", self.len())?;
        Ok(())
    }
}

/// Where the absolute positions of a launch's tokens come from.
#[derive(Debug, Clone, Copy)]
pub enum StartPos<'a> {
    /// Token `t` is at `start + t` (a prefill chunk).
    Host(u32),
    /// Token (decode row) `t` is at `pos[t]`, read from the device at run
    /// time: each row of a batched decode step is its own sequence's next
    /// position, and a captured CUDA graph is replayed for every step. The
    /// host cannot bounds-check them, so kernels skip writes at rows
    /// `>= capacity`.
    Device(&'a CudaSlice<u32>),
}

/// Where each token's sequence starts in a layer's KV buffers: position
/// `p` of a sequence whose first row is `b` lives in row `b + p` (ring
/// caches: one sequence, base 0). Continuous batching gives every running
/// sequence its own contiguous rows of the shared buffers.
#[derive(Debug, Clone, Copy)]
pub enum KvBase<'a> {
    /// Every token of the launch belongs to the sequence whose rows start
    /// here (the wrapper offsets the buffers; the kernels see row 0).
    Host(usize),
    /// Token (decode row) `t` belongs to the sequence whose rows start at
    /// `base[t]`, read from the device at run time (a batched decode step).
    /// Only with [`StartPos::Device`] positions.
    Device(&'a CudaSlice<u32>),
}

impl KvBase<'_> {
    /// Checks `base` against a launch of `n_tokens` tokens at `start` over
    /// `capacity` rows: a host base with host positions must hold them all
    /// (`base + start + n_tokens <= capacity`), a host base with device
    /// positions must be a row of the buffer, a device base needs device
    /// positions and one entry per token.
    pub(crate) fn check(
        &self,
        k: &'static str,
        start: &StartPos<'_>,
        n_tokens: usize,
        capacity: usize,
    ) -> Result<()> {
        match (self, start) {
            (KvBase::Host(b), StartPos::Host(p)) => {
                ensure(k, b + *p as usize + n_tokens <= capacity, || {
                    format!(
                        "positions {p}..{} of a sequence at KV row {b} exceed the KV capacity {capacity}",
                        *p as usize + n_tokens
                    )
                })
            }
            (KvBase::Host(b), StartPos::Device(_)) => ensure(k, *b < capacity, || {
                format!("KV row {b} is outside the KV capacity {capacity}")
            }),
            (KvBase::Device(d), StartPos::Device(_)) => check_len(k, "kv_base", d.len(), n_tokens),
            (KvBase::Device(_), StartPos::Host(_)) => Err(shape_err(
                k,
                "per-token KV bases need per-token device positions (a batched decode step)",
            )),
        }
    }

    /// The kernels' `kv_base` pointer (0 for a host base) and the host
    /// base in rows (0 for a device one).
    pub(crate) fn kernel_args<'s>(
        &'s self,
        stream: &'s CudaStream,
    ) -> (u64, usize, Option<SyncOnDrop<'s>>) {
        match self {
            KvBase::Host(b) => (0, *b, None),
            KvBase::Device(s) => {
                let (ptr, guard) = s.device_ptr(stream);
                (ptr, 0, Some(guard))
            }
        }
    }
}

/// `ptr` (a KV buffer of 16-bit elements) advanced by `rows` rows of
/// `head_dim`: where a sequence starting at that row begins.
pub(crate) fn kv_rows_ptr(ptr: u64, rows: usize, head_dim: usize) -> u64 {
    ptr + (rows * head_dim * 2) as u64
}

impl StartPos<'_> {
    /// Fails unless device positions hold one entry per token.
    pub(crate) fn check(&self, k: &'static str, n_tokens: usize) -> Result<()> {
        match self {
            StartPos::Host(_) => Ok(()),
            StartPos::Device(p) => check_len(k, "positions", p.len(), n_tokens),
        }
    }

    /// (device pointer or 0, host base) as the kernels take them.
    pub(crate) fn kernel_args<'s>(
        &'s self,
        stream: &'s CudaStream,
    ) -> (u64, u32, Option<SyncOnDrop<'s>>) {
        match self {
            StartPos::Host(p) => (0, *p, None),
            StartPos::Device(s) => {
                let (ptr, guard) = s.device_ptr(stream);
                (ptr, 0, Some(guard))
            }
        }
    }
}

impl Kernels {
    /// In place on the q and k heads of `qkv`: per-head RMSNorm over
    /// `head_dim` with `q_norm`/`k_norm` (bf16 `[head_dim]`), then RoPE
    /// (HF rotate_half: pairs `(i, i + d/2)`, `inv_freq_i = theta^(-2i/d)`,
    /// angle `pos * inv_freq_i` in f32) at position `start + t` for token
    /// `t`. v is untouched. All math in f32, one rounding to bf16.
    #[allow(clippy::too_many_arguments)]
    pub fn qk_norm_rope(
        &self,
        stream: &CudaStream,
        qkv: &mut impl DevicePtrMut<bf16>,
        geom: QkvGeom,
        start: StartPos<'_>,
        q_norm: &impl DevicePtr<bf16>,
        k_norm: &impl DevicePtr<bf16>,
        theta: f32,
        eps: f32,
    ) -> Result<()> {
        const K: &str = "qk_norm_rope_bf16";
        geom.validate(K)?;
        ensure(K, theta > 1.0 && theta.is_finite(), || {
            format!("rope theta = {theta} must be > 1")
        })?;
        check_len(K, "qkv", qkv.len(), geom.len())?;
        check_len(K, "q_norm", q_norm.len(), geom.head_dim)?;
        check_len(K, "k_norm", k_norm.len(), geom.head_dim)?;
        let heads = (geom.n_q_heads + geom.n_kv_heads) as u32;
        let (t, nq, nkv, d) = (
            dim_u32(K, "n_tokens", geom.n_tokens)?,
            geom.n_q_heads as u32,
            geom.n_kv_heads as u32,
            geom.head_dim as u32,
        );
        let f = self.func(K)?;
        start.check(K, geom.n_tokens)?;
        let (pos_ptr, pos_base, _gp) = start.kernel_args(stream);
        let (qp, _g1) = qkv.device_ptr_mut(stream);
        let (qn, _g2) = q_norm.device_ptr(stream);
        let (kn, _g3) = k_norm.device_ptr(stream);
        let mut b = KArgs::new();
        b.arg(&qp).arg(&qn).arg(&kn).arg(&pos_ptr).arg(&pos_base);
        b.arg(&t).arg(&nq).arg(&nkv).arg(&d).arg(&theta).arg(&eps);
        // x = token, y = group of 4 heads (one warp each).
        // SAFETY: the arguments match the kernel's parameters in order and
        // type; the kernel waits for the grid before it (pdl_wait) first.
        unsafe {
            submit_pdl(
                K,
                stream,
                f,
                cfg((t, heads.div_ceil(4), 1), 128, 0),
                b,
                self.pdl(),
            )
        }
    }

    /// In place on the q and k heads of `qkv` (no norm): RoPE (HF
    /// rotate_half: pairs `(i, i + d/2)`) at position `start + t` for token
    /// `t`, with angle `f32(pos) * inv_freq[i]` (one f32 multiply) and
    /// `cos`/`sin` of it multiplied by `scale`. v is untouched. All math in
    /// f32 with the reference engine's rounding points, one rounding to
    /// `A` (bf16, or f16: `rope_table_f16`); see `cuda/rope.cu` for the
    /// cosf/sinf tolerance.
    ///
    /// - `inv_freq`: f32 `[head_dim / 2]`, the model's frequencies (default
    ///   `theta^(-2i/d)` or YaRN's blend) computed once on the host by
    ///   `krasis_model::layers::rope::inv_freq`, which also gives `scale`
    ///   (YaRN's attention factor, 1 for default RoPE).
    #[allow(clippy::too_many_arguments)]
    pub fn rope_table<A: Act16>(
        &self,
        stream: &CudaStream,
        qkv: &mut impl DevicePtrMut<A>,
        geom: QkvGeom,
        start: StartPos<'_>,
        inv_freq: &impl DevicePtr<f32>,
        scale: f32,
    ) -> Result<()> {
        let kn = by_act::<A>("rope_table_bf16", "rope_table_f16");
        geom.validate(kn)?;
        ensure(kn, scale > 0.0 && scale.is_finite(), || {
            format!("rope scale = {scale} must be positive and finite")
        })?;
        check_len(kn, "qkv", qkv.len(), geom.len())?;
        check_len(kn, "inv_freq", inv_freq.len(), geom.head_dim / 2)?;
        let heads = (geom.n_q_heads + geom.n_kv_heads) as u32;
        let (t, nq, nkv, d) = (
            dim_u32(kn, "n_tokens", geom.n_tokens)?,
            geom.n_q_heads as u32,
            geom.n_kv_heads as u32,
            geom.head_dim as u32,
        );
        let f = self.func(kn)?;
        start.check(kn, geom.n_tokens)?;
        let (pos_ptr, pos_base, _gp) = start.kernel_args(stream);
        let (qp, _g1) = qkv.device_ptr_mut(stream);
        let (fp, _g2) = inv_freq.device_ptr(stream);
        let mut b = KArgs::new();
        b.arg(&qp).arg(&fp).arg(&scale).arg(&pos_ptr).arg(&pos_base);
        b.arg(&t).arg(&nq).arg(&nkv).arg(&d);
        // x = token, y = group of 4 heads (one warp each).
        // SAFETY: the arguments match the kernel's parameters in order and
        // type; the kernel waits for the grid before it (pdl_wait) first.
        unsafe {
            submit_pdl(
                kn,
                stream,
                f,
                cfg((t, heads.div_ceil(4), 1), 128, 0),
                b,
                self.pdl(),
            )
        }
    }

    /// Copy the k and v heads of `qkv` (after [`Kernels::qk_norm_rope`]) into
    /// the layer's caches: token `t` at its position (`start`) in its
    /// sequence's rows (`base`). With host positions and base the host
    /// checks `base + start + n_tokens <= capacity`. Bits are copied, so
    /// one kernel serves bf16 and f16 (`A`).
    #[allow(clippy::too_many_arguments)]
    pub fn kv_append<A: Act16>(
        &self,
        stream: &CudaStream,
        qkv: &impl DevicePtr<A>,
        geom: QkvGeom,
        start: StartPos<'_>,
        kv: KvGeom,
        base: KvBase<'_>,
        k_cache: &mut impl DevicePtrMut<A>,
        v_cache: &mut impl DevicePtrMut<A>,
    ) -> Result<()> {
        // Copies 16-bit patterns: one entry point for both formats.
        const K: &str = "kv_append_bf16";
        geom.validate(K)?;
        kv.validate(K, &geom)?;
        check_len(K, "qkv", qkv.len(), geom.len())?;
        check_len(K, "k_cache", k_cache.len(), kv.len())?;
        check_len(K, "v_cache", v_cache.len(), kv.len())?;
        start.check(K, geom.n_tokens)?;
        base.check(K, &start, geom.n_tokens, kv.capacity)?;
        let (t, nq, nkv, d, cap) = (
            dim_u32(K, "n_tokens", geom.n_tokens)?,
            geom.n_q_heads as u32,
            geom.n_kv_heads as u32,
            geom.head_dim as u32,
            dim_u32(K, "capacity", kv.capacity)?,
        );
        let f = self.func(K)?;
        let (pos_ptr, pos_base, _gp) = start.kernel_args(stream);
        let (base_ptr, rows, _gb) = base.kernel_args(stream);
        let (qp, _g1) = qkv.device_ptr(stream);
        let (kp, _g2) = k_cache.device_ptr_mut(stream);
        let (vp, _g3) = v_cache.device_ptr_mut(stream);
        let (kp, vp) = (
            kv_rows_ptr(kp, rows, geom.head_dim),
            kv_rows_ptr(vp, rows, geom.head_dim),
        );
        let mut b = KArgs::new();
        b.arg(&qp).arg(&kp).arg(&vp).arg(&pos_ptr).arg(&pos_base);
        b.arg(&base_ptr);
        b.arg(&t).arg(&nq).arg(&nkv).arg(&d).arg(&cap);
        // SAFETY: the arguments match the kernel's parameters in order and
        // type; the kernel waits for the grid before it (pdl_wait) first.
        unsafe { submit_pdl(K, stream, f, cfg((t, nkv, 1), 64, 0), b, self.pdl()) }
    }
}

/// The per-head q/k RMSNorm weights a partial-rotary launch normalises
/// with first (bf16 `[head_dim]` each), and the norm's epsilon.
#[derive(Clone, Copy)]
pub struct QkNormArgs<'a> {
    pub q: &'a CudaSlice<bf16>,
    pub k: &'a CudaSlice<bf16>,
    pub eps: f32,
}

impl Kernels {
    /// Partial rotary (glm4_moe), in place on the q and k heads of `qkv`:
    /// with `norm`, the per-head RMSNorm over the whole `head_dim` first
    /// (as [`Kernels::qk_norm_rope`]); then only the first `rotary_dim`
    /// dimensions of each head rotate, HF rotate_half within them (pairs
    /// `(i, i + rotary_dim/2)`), with angle `f32(pos) * inv_freq[i]` and
    /// cos/sin times `scale` (the arithmetic of [`Kernels::rope_table`]);
    /// the other dimensions pass through (normed, if `norm`). v is
    /// untouched. One rounding to bf16.
    ///
    /// - `inv_freq`: f32 `[rotary_dim / 2]`, frequencies computed over
    ///   `rotary_dim` by `krasis_model::layers::rope::inv_freq`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_partial(
        &self,
        stream: &CudaStream,
        qkv: &mut impl DevicePtrMut<bf16>,
        geom: QkvGeom,
        start: StartPos<'_>,
        norm: Option<QkNormArgs<'_>>,
        inv_freq: &impl DevicePtr<f32>,
        scale: f32,
        rotary_dim: usize,
    ) -> Result<()> {
        const K: &str = "rope_partial_bf16";
        geom.validate(K)?;
        ensure(
            K,
            rotary_dim >= 2 && rotary_dim.is_multiple_of(2) && rotary_dim <= geom.head_dim,
            || {
                format!(
                    "rotary_dim = {rotary_dim} must be even, >= 2 and <= head_dim {}",
                    geom.head_dim
                )
            },
        )?;
        ensure(K, scale > 0.0 && scale.is_finite(), || {
            format!("rope scale = {scale} must be positive and finite")
        })?;
        check_len(K, "qkv", qkv.len(), geom.len())?;
        check_len(K, "inv_freq", inv_freq.len(), rotary_dim / 2)?;
        let eps = match norm {
            Some(n) => {
                check_len(K, "q_norm", n.q.len(), geom.head_dim)?;
                check_len(K, "k_norm", n.k.len(), geom.head_dim)?;
                n.eps
            }
            None => 0.0,
        };
        let heads = (geom.n_q_heads + geom.n_kv_heads) as u32;
        let (t, nq, nkv, d, rot) = (
            dim_u32(K, "n_tokens", geom.n_tokens)?,
            geom.n_q_heads as u32,
            geom.n_kv_heads as u32,
            geom.head_dim as u32,
            rotary_dim as u32,
        );
        let f = self.func(K)?;
        start.check(K, geom.n_tokens)?;
        let (pos_ptr, pos_base, _gp) = start.kernel_args(stream);
        let (qp, _g1) = qkv.device_ptr_mut(stream);
        let (fp, _g2) = inv_freq.device_ptr(stream);
        let ((qn, _g3), (kn, _g4)) = match norm {
            Some(n) => {
                let (q, gq) = n.q.device_ptr(stream);
                let (k, gk) = n.k.device_ptr(stream);
                ((q, Some(gq)), (k, Some(gk)))
            }
            None => ((0, None), (0, None)),
        };
        let mut b = KArgs::new();
        b.arg(&qp).arg(&qn).arg(&kn).arg(&fp).arg(&scale);
        b.arg(&pos_ptr).arg(&pos_base).arg(&t).arg(&nq).arg(&nkv);
        b.arg(&d).arg(&rot).arg(&eps);
        // x = token, y = group of 4 heads (one warp each).
        // SAFETY: the arguments match the kernel's parameters in order and
        // type; the kernel waits for the grid before it (pdl_wait) first.
        unsafe {
            submit_pdl(
                K,
                stream,
                f,
                cfg((t, heads.div_ceil(4), 1), 128, 0),
                b,
                self.pdl(),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geom(nq: usize, nkv: usize, d: usize) -> QkvGeom {
        QkvGeom {
            n_tokens: 3,
            n_q_heads: nq,
            n_kv_heads: nkv,
            head_dim: d,
        }
    }

    #[test]
    fn qkv_geometry_is_validated() {
        assert!(geom(32, 4, 128).validate("t").is_ok());
        assert_eq!(geom(32, 4, 128).row_stride(), 40 * 128);
        assert!(
            geom(30, 4, 128).validate("t").is_err(),
            "q heads not a multiple of kv heads"
        );
        assert!(
            geom(32, 4, 96).validate("t").is_err(),
            "head_dim not a multiple of 64"
        );
        assert!(geom(32, 0, 128).validate("t").is_err());
        let err = geom(32, 4, 320)
            .validate("qk_norm_rope_bf16")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("qk_norm_rope_bf16") && err.contains("head_dim"),
            "{err}"
        );
    }

    #[test]
    fn kv_geometry_must_match_qkv() {
        let g = geom(8, 2, 128);
        let kv = KvGeom {
            n_kv_heads: 2,
            head_dim: 128,
            capacity: 16,
        };
        assert!(kv.validate("t", &g).is_ok());
        assert_eq!(kv.len(), 2 * 16 * 128);
        assert!(
            KvGeom {
                n_kv_heads: 4,
                ..kv
            }
            .validate("t", &g)
            .is_err()
        );
        assert!(KvGeom { capacity: 0, ..kv }.validate("t", &g).is_err());
    }
}
