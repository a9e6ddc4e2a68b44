//! Whether this machine has an NVIDIA driver, and what a GPU test does when
//! it cannot open the device: only a machine with no NVIDIA driver at all may
//! skip; on a machine with a driver the failure to open the device or load
//! the kernels is a test failure, with its reason.

use std::sync::Arc;

use cudarc::driver::CudaContext;

/// Whether an NVIDIA driver is installed here, by either of:
///
/// - Linux: the NVIDIA kernel module is loaded (`/proc/driver/nvidia/version`
///   exists). This holds on every machine with an NVIDIA GPU and a working
///   (or half-working) driver, even when the user-space library is broken.
/// - Any OS: the CUDA driver library loads (`libcuda.so*` on Linux,
///   `nvcuda.dll` on Windows; what cudarc itself would load), unless it is
///   the CUDA toolkit's link-time stub (`cuInit` answers
///   `CUDA_ERROR_STUB_LIBRARY`), which a CPU-only build machine may have on
///   its loader path.
///
/// `false` means "a CPU-only machine": GPU tests skip there, and fail
/// everywhere else when they cannot use the GPU.
pub fn nvidia_driver_present() -> bool {
    if cfg!(target_os = "linux") && std::path::Path::new("/proc/driver/nvidia/version").exists() {
        return true;
    }
    // SAFETY: only probes whether the shared library can be loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return false;
    }
    !matches!(
        cudarc::driver::result::init(),
        Err(cudarc::driver::DriverError(
            cudarc::driver::sys::CUresult::CUDA_ERROR_STUB_LIBRARY
        ))
    )
}

/// Open CUDA device `ordinal`, with NVRTC available, or say why not.
pub fn open_device(ordinal: usize) -> Result<Arc<CudaContext>, String> {
    // SAFETY: only probe whether the shared libraries can be loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("the CUDA driver library (libcuda) cannot be loaded".into());
    }
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err("the NVRTC library (libnvrtc) cannot be loaded".into());
    }
    let count =
        CudaContext::device_count().map_err(|e| format!("the CUDA driver failed to start: {e}"))?;
    if count <= 0 || count as usize <= ordinal {
        return Err(format!(
            "CUDA device {ordinal} does not exist (the driver reports {count})"
        ));
    }
    CudaContext::new(ordinal).map_err(|e| format!("creating a context on device {ordinal}: {e}"))
}

/// What a GPU test does with the result of opening its device.
#[derive(Debug, PartialEq, Eq)]
pub enum GpuTestDevice<T> {
    /// The device is usable: run the test.
    Run(T),
    /// No NVIDIA driver on this machine: print the SKIPPED line and pass.
    Skip,
    /// A driver is present but the device (or the kernels) could not be
    /// used: the test fails with this reason.
    Fail(String),
}

/// The rule for GPU tests: a device that opened runs; a failure to open
/// skips only where no NVIDIA driver is present (`driver_present`, from
/// [`nvidia_driver_present`]) and fails with its reason everywhere else.
pub fn gpu_test_device<T, E: std::fmt::Display>(
    driver_present: bool,
    open: Result<T, E>,
) -> GpuTestDevice<T> {
    match open {
        Ok(t) => GpuTestDevice::Run(t),
        Err(_) if !driver_present => GpuTestDevice::Skip,
        Err(e) => GpuTestDevice::Fail(format!(
            "an NVIDIA driver is present but the GPU cannot be used: {e}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_failure_skips_only_without_a_driver() {
        let open: Result<u8, &str> = Err("NVRTC missing");
        assert_eq!(gpu_test_device(false, open), GpuTestDevice::Skip);
        match gpu_test_device(true, open) {
            GpuTestDevice::Fail(why) => assert!(why.contains("NVRTC missing"), "{why}"),
            other => panic!("driver present + open failure must fail, got {other:?}"),
        }
    }

    #[test]
    fn an_open_device_runs_with_or_without_the_driver_check() {
        assert_eq!(
            gpu_test_device::<_, String>(true, Ok(3)),
            GpuTestDevice::Run(3)
        );
        assert_eq!(
            gpu_test_device::<_, String>(false, Ok(3)),
            GpuTestDevice::Run(3)
        );
    }

    #[test]
    fn driver_detection_agrees_with_the_machine() {
        // Cheap consistency: a usable device implies a driver.
        if open_device(0).is_ok() {
            assert!(nvidia_driver_present());
        }
        // The kernel module alone is enough on Linux.
        if cfg!(target_os = "linux") && std::path::Path::new("/proc/driver/nvidia/version").exists()
        {
            assert!(nvidia_driver_present());
        }
    }
}
