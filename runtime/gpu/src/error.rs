//! Typed errors of the CUDA engine. Every variant names what was being done
//! so a failure on the GPU machine can be acted on without a debugger.

use krasis_model::EngineError;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// No usable CUDA driver or device. Callers on CPU-only machines test for
    /// this with [`GpuError::is_no_device`] and skip instead of failing.
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    #[error("CUDA driver call failed while {what}: {source}")]
    Driver {
        what: String,
        #[source]
        source: cudarc::driver::DriverError,
    },
    #[error("cuBLAS call failed while {what}: {source}")]
    Blas {
        what: String,
        #[source]
        source: cudarc::cublas::result::CublasError,
    },
    #[error("cuBLASLt call failed while {what}: {source}")]
    BlasLt {
        what: String,
        #[source]
        source: cudarc::cublaslt::result::CublasError,
    },
    #[error(
        "out of GPU memory allocating {requested} bytes for {what} ({free} of {total} bytes free); \
         use a smaller --context-length or a GPU with more memory"
    )]
    OutOfMemory {
        what: String,
        requested: usize,
        free: usize,
        total: usize,
    },
    #[error(
        "the VRAM limit of {limit} bytes leaves {left} bytes but {what} needs {requested}; \
         raise --vram-limit, lower --context-length, or free GPU memory"
    )]
    OverLimit {
        what: String,
        requested: u64,
        left: u64,
        limit: u64,
    },
    /// The expert cache on the GPU (HCS) could not do what was asked.
    #[error("GPU expert cache: {0}")]
    Hcs(String),
    #[error(transparent)]
    Kernel(#[from] krasis_kernels::KernelError),
    #[error(transparent)]
    Model(#[from] krasis_model::ModelError),
    #[error(transparent)]
    CacheOpen(#[from] krasis_cache::CacheError),
    #[error("INT4 expert cache: {0}")]
    Cache(String),
    /// A logit was ±inf or NaN where a token was to be chosen (an
    /// activation overflowed, e.g. past FP16's ±65504): no token is
    /// produced, and the engine is retired as after any backend failure.
    #[error(
        "non-finite logits at {0} (an activation overflowed its 16-bit format); no token was \
         produced"
    )]
    NonFiniteLogits(String),
    /// The model or cache does not fit what this engine implements.
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error(transparent)]
    PrefixFile(#[from] krasis_model::prefix_cache::persist::PersistError),
    #[error(transparent)]
    Engine(#[from] EngineError),
}

impl GpuError {
    pub fn is_no_device(&self) -> bool {
        matches!(self, GpuError::NoDevice(_))
    }

    pub(crate) fn driver(
        what: impl Into<String>,
    ) -> impl FnOnce(cudarc::driver::DriverError) -> Self {
        let what = what.into();
        move |source| GpuError::Driver { what, source }
    }

    pub(crate) fn blas(
        what: impl Into<String>,
    ) -> impl FnOnce(cudarc::cublas::result::CublasError) -> Self {
        let what = what.into();
        move |source| GpuError::Blas { what, source }
    }
}

impl From<GpuError> for EngineError {
    fn from(e: GpuError) -> Self {
        match e {
            GpuError::OutOfMemory { .. } | GpuError::OverLimit { .. } => {
                EngineError::OutOfMemory(e.to_string())
            }
            GpuError::Engine(inner) => inner,
            other => EngineError::Backend(other.to_string()),
        }
    }
}

pub type Result<T, E = GpuError> = std::result::Result<T, E>;
