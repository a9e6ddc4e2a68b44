//! NVRTC compilation with an on-disk CUBIN cache.
//!
//! Modules are compiled straight to machine code for the device's real
//! architecture (`sm_XY`), so loading a cached module costs no driver JIT
//! (the INT4 module's unrolled GEMVs take NVRTC seconds to assemble).
//! Cache key: module source hash (common header included), architecture and
//! NVRTC version. Writes go to a temporary file renamed into place, so
//! concurrent processes never read a torn file.

use std::path::{Path, PathBuf};

use std::ffi::CString;

use crate::error::{KernelError, Result};
use crate::sources::{COMMON, Module, source_hash};

/// Where compiled PTX is cached between processes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum CacheDir {
    /// `ProjectDirs::from("ai", "krasis", "krasis")` cache dir + `kernels/`.
    #[default]
    Platform,
    /// An explicit directory (created if missing).
    At(PathBuf),
    /// Always compile; never read or write a cache.
    Disabled,
}

impl CacheDir {
    pub(crate) fn resolve(&self) -> Option<PathBuf> {
        match self {
            CacheDir::Platform => directories::ProjectDirs::from("ai", "krasis", "krasis")
                .map(|d| d.cache_dir().join("kernels")),
            CacheDir::At(p) => Some(p.clone()),
            CacheDir::Disabled => None,
        }
    }
}

/// NVRTC version as (major, minor). Only call when NVRTC is loadable.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0i32, 0i32);
    // SAFETY: both out-pointers are valid for the duration of the call.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    status.result().map_err(|e| KernelError::Nvrtc {
        module: "-",
        message: format!("nvrtcVersion failed: {e:?}"),
    })?;
    Ok((major, minor))
}

fn options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "--generate-line-info".into(),
        // Precise division/sqrt keep the GPU numerics close to the CPU
        // references; none of these kernels is bound by them.
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
        "--fmad=true".into(),
    ]
}

/// The NVRTC architecture `module` compiles to for a device of compute
/// capability `cc`; refused when its target does not run there.
fn target_arch(module: &Module, cc: (i32, i32)) -> Result<String> {
    module.target.arch(cc).ok_or(KernelError::WrongTarget {
        module: module.name,
        target: module.target.name(),
        major: cc.0,
        minor: cc.1,
    })
}

/// A module compiled to machine code (CUBIN) for one architecture.
#[derive(Debug, Clone)]
pub struct Compiled {
    pub cubin: Vec<u8>,
    /// NVRTC's log (warnings; ptxas resource usage with `-Xptxas=-v`).
    pub log: String,
}

/// Compile `module` to CUBIN for compute capability `cc` (no cache). Needs
/// only NVRTC, not a GPU, so tools can check the sources anywhere.
/// `extra` options are appended (e.g. `-Xptxas=-v`).
/// A module whose target does not run on `cc` (e.g. an sm_90a module for
/// an Ada card) is refused with [`KernelError::WrongTarget`].
pub fn compile_module(module: &Module, cc: (i32, i32), extra: &[&str]) -> Result<Compiled> {
    use cudarc::nvrtc::{result, sys};
    let arch = target_arch(module, cc)?;
    let mut opts = options(&arch);
    opts.extend(extra.iter().map(|s| s.to_string()));
    let nvrtc_err = |what: &str, e: result::NvrtcError| KernelError::Nvrtc {
        module: module.name,
        message: format!("{what}: {e:?}"),
    };
    let src = CString::new(format!(
        "{COMMON}\n#line 1 \"{}.cu\"\n{}",
        module.name, module.source
    ))
    .map_err(|_| {
        nvrtc_err(
            "source",
            result::NvrtcError(sys::nvrtcResult::NVRTC_ERROR_INVALID_INPUT),
        )
    })?;
    let name = CString::new(format!("{}.cu", module.name)).expect("module names have no NUL");
    let prog =
        result::create_program(&src, Some(&name)).map_err(|e| nvrtc_err("create program", e))?;
    // SAFETY: `prog` is live until the destroy below; buffers are sized by
    // the matching *Size calls.
    let outcome = unsafe {
        let compiled = result::compile_program(prog, &opts);
        let log = result::get_program_log(prog)
            .map(|raw| {
                let bytes: Vec<u8> = raw
                    .iter()
                    .take_while(|&&c| c != 0)
                    .map(|&c| c as u8)
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_default();
        match compiled {
            Err(_) => Err(KernelError::Compile {
                module: module.name,
                arch: arch.clone(),
                options: opts.clone(),
                log,
            }),
            Ok(()) => {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| nvrtc_err("cubin size", e))?;
                let mut cubin = vec![0u8; size];
                sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast())
                    .result()
                    .map_err(|e| nvrtc_err("get cubin", e))?;
                Ok(Compiled { cubin, log })
            }
        }
    };
    // SAFETY: created above, destroyed once.
    let _ = unsafe { result::destroy_program(prog) };
    outcome
}

/// CUBIN for `module`, from the cache or freshly compiled (then stored).
pub(crate) fn module_image(
    module: &Module,
    cc: (i32, i32),
    cache: Option<&Path>,
) -> Result<Vec<u8>> {
    let (nv_major, nv_minor) = nvrtc_version()?;
    let arch = target_arch(module, cc)?;
    let key = format!(
        "{}-{}-{arch}-nvrtc{nv_major}.{nv_minor}.cubin",
        module.name,
        source_hash(module),
    );
    if let Some(dir) = cache {
        let path = dir.join(&key);
        if let Ok(bytes) = std::fs::read(&path) {
            // ELF magic: anything else is a torn or foreign file; recompile.
            if bytes.starts_with(b"\x7fELF") {
                tracing::debug!(module = module.name, path = %path.display(), "kernel cache hit");
                return Ok(bytes);
            }
            tracing::warn!(path = %path.display(), "ignoring unusable cached kernel image");
        }
    }
    let started = std::time::Instant::now();
    let compiled = compile_module(module, cc, &[])?;
    tracing::info!(
        module = module.name,
        ms = started.elapsed().as_millis() as u64,
        "compiled kernels"
    );
    if let Some(dir) = cache {
        store(dir, &key, &compiled.cubin)?;
    }
    Ok(compiled.cubin)
}

fn store(dir: &Path, key: &str, bytes: &[u8]) -> Result<()> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| KernelError::Cache { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tmp = dir.join(format!("{key}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(io(&tmp))?;
    let dst = dir.join(key);
    std::fs::rename(&tmp, &dst).map_err(io(&dst))
}
