//! BF16 (or FP16) GEMM with f32 accumulation, in the row-major convention
//! of the rest of the engine: `Y[M,N] = X[M,K] · W[N,K]ᵀ`, where `W` is an
//! `nn.Linear` weight exactly as stored in the checkpoint (FP16 inputs: the
//! QKV projection of an FP16 attention block and every projection of an
//! FP16 MLP block, their weights converted at upload, the routed experts
//! dequantized to FP16). A 16-bit output is the f32 accumulation rounded to
//! the input's format (the gate/up GEMMs of SwiGLU MLPs and experts); the
//! rest write f32.
//!
//! **Row invariance.** Every row of `Y` is computed the same way whatever
//! `M` is, so a prompt's rows come out bit for bit the same whichever
//! prefill chunk they fall in and wherever it starts (the prefix cache's
//! blocks are smaller than the chunk and a hit resumes prefill at any block
//! boundary: `docs/notes/prefix-cache.md`). cuBLAS's own choice
//! (`cublasGemmEx`, `CUBLAS_GEMM_DEFAULT`) does not give that: it picks a
//! kernel per shape, and for some `M` a split-K or stream-K kernel whose
//! partial sums over `K` are added in another order. So every GEMM runs
//! through cuBLASLt with ONE algorithm per (reference rows, N, K, input and
//! output types, beta), chosen once by the heuristic at the site's reference
//! row count ([`DENSE_REF_ROWS`], [`expert_ref_rows`]) and reused for every
//! `M`:
//! - with no workspace for partial tiles (split-K and stream-K kernels
//!   need one of at least a tile of f32 per split, so the heuristic is
//!   offered none and a call at most [`SMALL_WORKSPACE`] bytes, far below
//!   any tile: Hopper's kernels ask `cublasLtMatmulAlgoCheck` for 4 bytes
//!   at some row counts, measured on the H200) and a split-K count of 1,
//!   read back from the algorithm: an output element is one thread block's
//!   K loop, whose order depends on the algorithm and `K` only;
//! - checked valid (`cublasLtMatmulAlgoCheck`) for every `M` it runs at,
//!   once per `M`; an `M` it does not serve is an error naming the GEMM,
//!   never another algorithm;
//! - at least 16-byte aligned operands (asked of the heuristic, checked per
//!   call), so the algorithm never depends on where a row starts.
//!
//! The reference row count picks a kernel suited to the rows the site
//! usually sees (a full prefill chunk for dense projections, a chunk's
//! share per expert for the grouped experts); it depends on the geometry
//! only, never on options, so two engines of one model compute the same
//! rows. `runtime/gpu/tests/row_invariance.rs` checks row `r` of an
//! `M`-row GEMM against the 1-row GEMM of that row for `M = 1..300` and
//! sampled rows up to a full 8192-row chunk on the engine's shapes (it
//! passes on the H200), and [`Selection::PerShape`] (the old per-shape choice, a planted
//! fault for tests) shows what that test catches.

use crate::error::{GpuError, Result};
use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublaslt::{result as lt, sys as ltsys};
use cudarc::driver::CudaStream;
use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Element type of a GEMM output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutType {
    Bf16,
    F16,
    F32,
}

/// Element type of a GEMM's inputs X and W (both the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InType {
    Bf16,
    F16,
}

/// Reference rows of the dense projections (QKV, o_proj, router, dense and
/// shared MLPs, LM head): half the default prefill chunk, where the
/// heuristic's choice is a large-tile kernel that also serves full chunks.
pub const DENSE_REF_ROWS: usize = 4096;

/// Reference rows of a routed expert's grouped GEMMs: its share of a full
/// default prefill chunk (8192 tokens × top-k / experts: 512 for
/// Qwen3-30B-A3B and GLM-4.5-Air), within 16..=4096.
pub fn expert_ref_rows(top_k: usize, num_experts: usize) -> usize {
    (8192 * top_k / num_experts.max(1)).clamp(16, 4096)
}

/// One GEMM's shape and addresses (device pointers).
#[derive(Debug, Clone, Copy)]
pub struct Gemm {
    /// Rows of X and Y (tokens).
    pub m: usize,
    /// Output features (rows of W).
    pub n: usize,
    /// Input features.
    pub k: usize,
    pub x: u64,
    pub w: u64,
    pub y: u64,
    pub input: InType,
    pub out: OutType,
    /// 0 overwrites Y; 1 adds into it (residual connections).
    pub beta: f32,
    /// The rows the site's algorithm is chosen for ([`DENSE_REF_ROWS`],
    /// [`expert_ref_rows`]); the same for every call of the site.
    pub ref_rows: usize,
}

/// How GEMMs choose their kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selection {
    /// One cuBLASLt algorithm per site and shape, reused for every `M`
    /// (the module doc): row invariant.
    Fixed,
    /// `cublasGemmEx` with `CUBLAS_GEMM_DEFAULT`, cuBLAS choosing per call
    /// by shape (what the engine ran before): a planted fault for the row
    /// invariance tests, never used otherwise.
    PerShape,
}

/// The GEMM handles of one device: cuBLASLt with the fixed algorithms, and
/// cuBLAS for [`Selection::PerShape`].
pub struct Blas {
    /// cuBLAS (its workspace is set by `Gpu::open_limited`).
    pub legacy: CudaBlas,
    lt: ltsys::cublasLtHandle_t,
    /// The cuBLASLt calls' workspace of [`SMALL_WORKSPACE`] bytes.
    workspace: cudarc::driver::CudaSlice<u8>,
    stream: Arc<CudaStream>,
    plans: Mutex<HashMap<Key, Plan>>,
    per_shape: AtomicBool,
}

// SAFETY: the cuBLASLt handle and every descriptor are only used under the
// `plans` mutex (the handle itself is thread-safe in cuBLASLt; descriptors
// are plain host structures mutated under the lock).
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    ref_rows: usize,
    n: usize,
    k: usize,
    input: InType,
    out: OutType,
    beta_bits: u32,
}

/// One site's descriptors and algorithm. `b` and `c` (X and Y) have their
/// column count (`M`) set per call.
struct Plan {
    desc: ltsys::cublasLtMatmulDesc_t,
    a: ltsys::cublasLtMatrixLayout_t,
    b: ltsys::cublasLtMatrixLayout_t,
    c: ltsys::cublasLtMatrixLayout_t,
    algo: ltsys::cublasLtMatmulAlgo_t,
    /// Row counts the algorithm was checked valid for.
    checked: HashSet<usize>,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created in `Plan::new`, destroyed once here.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.c);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

fn lt_err(what: impl Into<String>) -> impl FnOnce(lt::CublasError) -> GpuError {
    let what = what.into();
    move |source| GpuError::BlasLt { what, source }
}

fn data_type(t: OutType) -> ltsys::cudaDataType {
    match t {
        OutType::Bf16 => ltsys::cudaDataType::CUDA_R_16BF,
        OutType::F16 => ltsys::cudaDataType::CUDA_R_16F,
        OutType::F32 => ltsys::cudaDataType::CUDA_R_32F,
    }
}

fn in_data_type(t: InType) -> ltsys::cudaDataType {
    match t {
        InType::Bf16 => ltsys::cudaDataType::CUDA_R_16BF,
        InType::F16 => ltsys::cudaDataType::CUDA_R_16F,
    }
}

/// Sets a cuBLASLt attribute from a plain value.
macro_rules! set_attr {
    ($f:path, $obj:expr, $attr:expr, $v:expr, $what:expr) => {{
        let v = $v;
        // SAFETY: `$obj` is a live descriptor and `v` outlives the call,
        // which copies it.
        unsafe {
            $f(
                $obj,
                $attr,
                (&v) as *const _ as *const c_void,
                std::mem::size_of_val(&v),
            )
        }
        .map_err(lt_err($what))
    }};
}

impl Plan {
    /// The descriptors of `key` and its algorithm: the first of the
    /// heuristic's candidates at `key.ref_rows` rows that needs no
    /// workspace, does not split K, and is valid for one row and for the
    /// reference rows.
    fn new(handle: ltsys::cublasLtHandle_t, key: Key) -> Result<Self> {
        let what = format!(
            "choosing the GEMM algorithm for N={} K={} ({:?} in, {:?} out, beta {}) at {} rows",
            key.n,
            key.k,
            key.input,
            key.out,
            f32::from_bits(key.beta_bits),
            key.ref_rows
        );
        let desc = lt::create_matmul_desc(
            ltsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ltsys::cudaDataType::CUDA_R_32F,
        )
        .map_err(lt_err(what.clone()))?;
        let ab = in_data_type(key.input);
        let (n, k, r) = (key.n as u64, key.k as u64, key.ref_rows as u64);
        // Column-major view: Yᵀ[N,M] = (Wᵀ)ᵀ[N,K] · Xᵀ[K,M], with W seen as
        // a K×N column-major matrix (ld K, transposed) and X as K×M (ld K).
        let layouts = (|| {
            Ok::<_, lt::CublasError>((
                lt::create_matrix_layout(ab, k, n, k as i64)?,
                lt::create_matrix_layout(ab, k, r, k as i64)?,
                lt::create_matrix_layout(data_type(key.out), n, r, n as i64)?,
            ))
        })()
        .map_err(lt_err(what.clone()));
        let (a, b, c) = match layouts {
            Ok(l) => l,
            Err(e) => {
                // SAFETY: created above, not used elsewhere.
                unsafe {
                    let _ = lt::destroy_matmul_desc(desc);
                }
                return Err(e);
            }
        };
        let mut plan = Plan {
            desc,
            a,
            b,
            c,
            algo: ltsys::cublasLtMatmulAlgo_t { data: [0; 8] },
            checked: HashSet::new(),
        };
        use ltsys::cublasLtMatmulDescAttributes_t as D;
        set_attr!(
            lt::set_matmul_desc_attribute,
            desc,
            D::CUBLASLT_MATMUL_DESC_TRANSA,
            1i32,
            what.clone()
        )?;
        set_attr!(
            lt::set_matmul_desc_attribute,
            desc,
            D::CUBLASLT_MATMUL_DESC_TRANSB,
            0i32,
            what.clone()
        )?;
        let pref = lt::create_matmul_pref().map_err(lt_err(what.clone()))?;
        let found = plan.search(handle, pref, key, &what);
        // SAFETY: created above, used only by `search`.
        unsafe {
            let _ = lt::destroy_matmul_pref(pref);
        }
        plan.algo = found?;
        Ok(plan)
    }

    fn search(
        &mut self,
        handle: ltsys::cublasLtHandle_t,
        pref: ltsys::cublasLtMatmulPreference_t,
        key: Key,
        what: &str,
    ) -> Result<ltsys::cublasLtMatmulAlgo_t> {
        use ltsys::cublasLtMatmulPreferenceAttributes_t as P;
        set_attr!(
            lt::set_matmul_pref_attribute,
            pref,
            P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            0u64,
            what
        )?;
        for attr in [
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
        ] {
            set_attr!(
                lt::set_matmul_pref_attribute,
                pref,
                attr,
                ALIGN as u32,
                what
            )?;
        }
        const WANT: usize = 16;
        // SAFETY: plain C structs; the heuristic writes `count` of them.
        let mut found: [ltsys::cublasLtMatmulHeuristicResult_t; WANT] =
            unsafe { std::mem::zeroed() };
        let mut count = 0i32;
        // SAFETY: live descriptors; `found` holds WANT results.
        unsafe {
            ltsys::cublasLtMatmulAlgoGetHeuristic(
                handle,
                self.desc,
                self.a,
                self.b,
                self.c,
                self.c,
                pref,
                WANT as i32,
                found.as_mut_ptr(),
                &mut count,
            )
        }
        .result()
        .map_err(lt_err(what))?;
        let mut why = Vec::new();
        for cand in found.iter().take(count.max(0) as usize) {
            if cand.state != ltsys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                continue;
            }
            let splits = algo_config(&cand.algo, ALGO_SPLITK).unwrap_or(u32::MAX);
            if cand.workspaceSize != 0 || splits > 1 {
                why.push(format!("workspace {} split-K {splits}", cand.workspaceSize));
                continue;
            }
            self.algo = cand.algo;
            match (
                self.valid_at(handle, 1),
                self.valid_at(handle, key.ref_rows),
            ) {
                (Ok(()), Ok(())) => {
                    self.checked.extend([1, key.ref_rows]);
                    return Ok(cand.algo);
                }
                (one, reference) => {
                    let say = |r: Result<()>| r.err().map_or("valid".into(), |e| e.to_string());
                    why.push(format!(
                        "algorithm {:?}: 1 row {}, {} rows {}",
                        algo_config(&cand.algo, ALGO_ID),
                        say(one),
                        key.ref_rows,
                        say(reference)
                    ));
                }
            }
        }
        Err(GpuError::Unsupported(format!(
            "{what}: no algorithm without a workspace or split-K among cuBLASLt's {count} \
             candidates ({})",
            why.join("; ")
        )))
    }

    /// Sets the row count `m` on X's and Y's layouts.
    fn set_rows(&self, m: usize, what: &str) -> Result<()> {
        use ltsys::cublasLtMatrixLayoutAttribute_t as L;
        for l in [self.b, self.c] {
            set_attr!(
                lt::set_matrix_layout_attribute,
                l,
                L::CUBLASLT_MATRIX_LAYOUT_COLS,
                m as u64,
                what
            )?;
        }
        Ok(())
    }

    /// Whether the algorithm serves `m` rows with no workspace (sets `m`).
    fn valid_at(&self, handle: ltsys::cublasLtHandle_t, m: usize) -> Result<()> {
        let what = format!("checking the GEMM algorithm at {m} rows");
        self.set_rows(m, &what)?;
        // SAFETY: plain C struct written by the check.
        let mut res: ltsys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        // SAFETY: live descriptors and algorithm.
        unsafe {
            ltsys::cublasLtMatmulAlgoCheck(
                handle, self.desc, self.a, self.b, self.c, self.c, &self.algo, &mut res,
            )
        }
        .result()
        .map_err(lt_err(what.clone()))?;
        res.state.result().map_err(lt_err(what.clone()))?;
        if res.workspaceSize > SMALL_WORKSPACE {
            return Err(GpuError::Unsupported(format!(
                "{what}: it needs {} bytes of workspace (at most {SMALL_WORKSPACE}: no partial \
                 tiles)",
                res.workspaceSize
            )));
        }
        Ok(())
    }
}

/// Workspace bytes a fixed algorithm may use: room for the few bytes some
/// Hopper kernels ask for (4 at 4096 rows, measured), none for a split-K
/// or stream-K partial tile (a 64x64 f32 tile is 16 KiB).
pub const SMALL_WORKSPACE: usize = 1024;

/// Operand alignment every algorithm is chosen for and every call checked
/// against (what TMA loads need on Hopper).
const ALIGN: u64 = 16;

const ALGO_ID: ltsys::cublasLtMatmulAlgoConfigAttributes_t =
    ltsys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_ID;

const ALGO_SPLITK: ltsys::cublasLtMatmulAlgoConfigAttributes_t =
    ltsys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_SPLITK_NUM;

/// A 32-bit configuration attribute of `algo`.
fn algo_config(
    algo: &ltsys::cublasLtMatmulAlgo_t,
    attr: ltsys::cublasLtMatmulAlgoConfigAttributes_t,
) -> Option<u32> {
    let mut v = 0u32;
    let mut written = 0usize;
    // SAFETY: `v` holds the 4 bytes the attribute has.
    unsafe {
        ltsys::cublasLtMatmulAlgoConfigGetAttribute(
            algo,
            attr,
            (&mut v) as *mut u32 as *mut c_void,
            4,
            &mut written,
        )
    }
    .result()
    .ok()
    .map(|_| v)
}

impl Blas {
    /// The handles of `stream`'s device; `legacy` is the cuBLAS handle.
    pub fn new(stream: Arc<CudaStream>, legacy: CudaBlas) -> Result<Self> {
        stream
            .context()
            .bind_to_thread()
            .map_err(GpuError::driver("binding the CUDA context"))?;
        let workspace = stream
            .alloc_zeros::<u8>(SMALL_WORKSPACE)
            .map_err(GpuError::driver("allocating the cuBLASLt workspace"))?;
        let lt = lt::create_handle().map_err(lt_err("creating the cuBLASLt handle"))?;
        Ok(Blas {
            legacy,
            lt,
            workspace,
            stream,
            plans: Mutex::new(HashMap::new()),
            per_shape: AtomicBool::new(false),
        })
    }

    pub fn selection(&self) -> Selection {
        if self.per_shape.load(Ordering::Relaxed) {
            Selection::PerShape
        } else {
            Selection::Fixed
        }
    }

    /// Plants (or removes) [`Selection::PerShape`]. Tests only.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn set_selection(&self, s: Selection) {
        self.per_shape
            .store(s == Selection::PerShape, Ordering::Relaxed);
    }

    fn run_fixed(&self, g: &Gemm, what: &str) -> Result<()> {
        if let Some(p) = [g.x, g.w, g.y].iter().find(|&&p| p % ALIGN != 0) {
            return Err(GpuError::Unsupported(format!(
                "GEMM {what}: operand at {p:#x} is not {ALIGN}-byte aligned (every algorithm \
                 is chosen for {ALIGN}-byte aligned rows)"
            )));
        }
        let key = Key {
            ref_rows: g.ref_rows.max(1),
            n: g.n,
            k: g.k,
            input: g.input,
            out: g.out,
            beta_bits: g.beta.to_bits(),
        };
        self.stream
            .context()
            .bind_to_thread()
            .map_err(GpuError::driver("binding the CUDA context"))?;
        let mut plans = self
            .plans
            .lock()
            .map_err(|_| GpuError::Unsupported("a GEMM panicked while holding its plans".into()))?;
        let plan = match plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => v.insert(Plan::new(self.lt, key)?),
        };
        if !plan.checked.contains(&g.m) {
            plan.valid_at(self.lt, g.m).map_err(|e| {
                GpuError::Unsupported(format!(
                    "GEMM {what} ({}x{}x{}): the site's algorithm does not serve {} rows and no \
                     other may be used (row invariance): {e}",
                    g.m, g.n, g.k, g.m
                ))
            })?;
            plan.checked.insert(g.m);
        }
        plan.set_rows(g.m, what)?;
        let alpha = 1.0f32;
        let beta = g.beta;
        // The kernels' own scratch, ordered on this stream like the GEMMs.
        let (ws, _ws_guard) = cudarc::driver::DevicePtr::device_ptr(&self.workspace, &self.stream);
        // SAFETY: live descriptors set for these shapes; the caller passes
        // live device buffers of the stated shapes; the workspace holds
        // SMALL_WORKSPACE bytes, at least what the check allowed.
        unsafe {
            lt::matmul(
                self.lt,
                plan.desc,
                (&alpha) as *const f32 as *const c_void,
                (&beta) as *const f32 as *const c_void,
                g.w as *const c_void,
                plan.a,
                g.x as *const c_void,
                plan.b,
                g.y as *const c_void,
                plan.c,
                g.y as *mut c_void,
                plan.c,
                &plan.algo,
                ws as *mut c_void,
                SMALL_WORKSPACE,
                self.stream.cu_stream() as ltsys::cudaStream_t,
            )
        }
        .map_err(lt_err(format!("GEMM {what} ({}x{}x{})", g.m, g.n, g.k)))
    }

    fn run_per_shape(&self, g: &Gemm, what: &str) -> Result<()> {
        let alpha = 1.0f32;
        let beta = g.beta;
        let ab_type = match g.input {
            InType::Bf16 => cudaDataType::CUDA_R_16BF,
            InType::F16 => cudaDataType::CUDA_R_16F,
        };
        let c_type = match g.out {
            OutType::Bf16 => cudaDataType::CUDA_R_16BF,
            OutType::F16 => cudaDataType::CUDA_R_16F,
            OutType::F32 => cudaDataType::CUDA_R_32F,
        };
        // SAFETY: the caller passes live device buffers of the stated shapes.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.legacy.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                g.n as i32,
                g.m as i32,
                g.k as i32,
                (&alpha) as *const f32 as *const _,
                g.w as *const _,
                ab_type,
                g.k as i32,
                g.x as *const _,
                ab_type,
                g.k as i32,
                (&beta) as *const f32 as *const _,
                g.y as *mut _,
                c_type,
                g.n as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(GpuError::blas(format!(
            "GEMM {what} ({}x{}x{})",
            g.m, g.n, g.k
        )))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        if let Ok(p) = self.plans.get_mut() {
            p.clear();
        }
        // SAFETY: created in `new`, destroyed once; no plan is left.
        unsafe {
            let _ = lt::destroy_handle(self.lt);
        }
    }
}

/// Runs `g` on the handle's stream.
pub fn gemm(blas: &Blas, g: &Gemm, what: &str) -> Result<()> {
    if g.m == 0 {
        return Ok(());
    }
    let dims = [g.m, g.n, g.k];
    if dims.iter().any(|&d| d > i32::MAX as usize) {
        return Err(GpuError::Unsupported(format!(
            "GEMM {what} of {}x{}x{} exceeds cuBLAS's 32-bit dimensions",
            g.m, g.n, g.k
        )));
    }
    let sixteen = |o: OutType| matches!(o, OutType::Bf16 | OutType::F16);
    let out_matches = match g.input {
        InType::Bf16 => g.out != OutType::F16,
        InType::F16 => g.out != OutType::Bf16,
    };
    if !out_matches || (sixteen(g.out) && g.beta != 0.0) {
        return Err(GpuError::Unsupported(format!(
            "GEMM {what}: {:?} inputs with a {:?} output and beta {} (a 16-bit output is the \
             inputs' format, written once)",
            g.input, g.out, g.beta
        )));
    }
    match blas.selection() {
        Selection::Fixed => blas.run_fixed(g, what),
        Selection::PerShape => blas.run_per_shape(g, what),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_reference_rows_are_a_chunks_share_per_expert() {
        assert_eq!(expert_ref_rows(8, 128), 512);
        assert_eq!(expert_ref_rows(4, 32), 1024);
        // Bounded both ways (tiny test models, huge top-k).
        assert_eq!(expert_ref_rows(1, 1024), 16);
        assert_eq!(expert_ref_rows(8, 8), 4096);
        assert_eq!(expert_ref_rows(2, 0), 4096);
    }
}
