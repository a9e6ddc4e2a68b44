//! BF16 (or FP16) GEMM through cuBLAS with f32 accumulation, in the
//! row-major convention of the rest of the engine: `Y[M,N] = X[M,K] ·
//! W[N,K]ᵀ`, where `W` is an `nn.Linear` weight exactly as stored in the
//! checkpoint (FP16 inputs: the QKV projection of an FP16 attention block
//! and every projection of an FP16 MLP block, their weights converted at
//! upload, the routed experts dequantized to FP16). A 16-bit output is the
//! f32 accumulation rounded to the input's format (the gate/up GEMMs of
//! SwiGLU MLPs and experts); the rest write f32.

use crate::error::{GpuError, Result};
use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};

/// Element type of a GEMM output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutType {
    Bf16,
    F16,
    F32,
}

/// Element type of a GEMM's inputs X and W (both the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InType {
    Bf16,
    F16,
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
}

/// Runs `g` on the handle's stream.
pub fn gemm(blas: &CudaBlas, g: &Gemm, what: &str) -> Result<()> {
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
            "GEMM {what}: {:?} inputs with a {:?} output and beta {} (a 16-bit output is the              inputs' format, written once)",
            g.input, g.out, g.beta
        )));
    }
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
    // Column-major view: Yᵀ[N,M] = (Wᵀ)ᵀ[N,K] · Xᵀ[K,M], with W seen as a
    // K×N column-major matrix (lda = K) and X as K×M (ldb = K).
    // SAFETY: the caller passes live device buffers of the stated shapes.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
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
