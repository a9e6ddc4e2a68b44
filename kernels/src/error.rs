use std::path::PathBuf;

/// Everything that can go wrong compiling, loading or launching a kernel.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("CUDA driver error during {during}: {source}")]
    Driver {
        during: String,
        #[source]
        source: cudarc::driver::DriverError,
    },
    #[error(
        "NVRTC failed to compile kernel module `{module}` for {arch} (options {options:?}):\n{log}\n\
         This is a bug in the kernel source or an NVRTC too old for it; report it with this log."
    )]
    Compile {
        module: &'static str,
        arch: String,
        options: Vec<String>,
        log: String,
    },
    #[error("NVRTC error for module `{module}`: {message}")]
    Nvrtc {
        module: &'static str,
        message: String,
    },
    #[error(
        "GPU compute capability {major}.{minor} is not supported: krasis kernels need 8.0 or newer (Ampere+)"
    )]
    UnsupportedDevice { major: i32, minor: i32 },
    #[error(
        "kernel module `{module}` is built for {target}, which a device of compute capability \
         {major}.{minor} cannot run"
    )]
    WrongTarget {
        module: &'static str,
        target: &'static str,
        major: i32,
        minor: i32,
    },
    #[error("kernel cache at {path}: {source}")]
    Cache {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("kernel `{name}` is missing from the loaded modules (source list out of date)")]
    MissingKernel { name: String },
    #[error("invalid launch of `{kernel}`: {message}")]
    Shape {
        kernel: &'static str,
        message: String,
    },
}

impl KernelError {
    pub(crate) fn driver(
        during: impl Into<String>,
    ) -> impl FnOnce(cudarc::driver::DriverError) -> Self {
        let during = during.into();
        move |source| KernelError::Driver { during, source }
    }
}

pub type Result<T, E = KernelError> = std::result::Result<T, E>;
