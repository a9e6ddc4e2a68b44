//! A thread that samples free device memory (cuMemGetInfo) off the token
//! path and keeps the minimum, for bench reports and the stats endpoint.

use cudarc::driver::CudaContext;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

pub struct VramMonitor {
    stop: Arc<AtomicBool>,
    min_free: Arc<AtomicU64>,
    handle: Option<JoinHandle<()>>,
}

impl VramMonitor {
    /// Starts sampling every `period`; reports driver-visible free memory.
    pub fn start(ctx: Arc<CudaContext>, period: Duration) -> Self {
        Self::start_in_budget(ctx, period, None)
    }

    /// Like [`VramMonitor::start`], but reports free memory within `budget`
    /// (the engine's VRAM limit), which is what the safety margin protects.
    pub fn start_in_budget(
        ctx: Arc<CudaContext>,
        period: Duration,
        budget: Option<crate::device::Budget>,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let min_free = Arc::new(AtomicU64::new(u64::MAX));
        let (s, m) = (stop.clone(), min_free.clone());
        let handle = std::thread::Builder::new()
            .name("krasis-vram-monitor".into())
            .spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    if let Ok((free, _)) = ctx.mem_get_info() {
                        let free = budget.map_or(free as u64, |b| b.free(free as u64));
                        m.fetch_min(free, Ordering::Relaxed);
                    }
                    std::thread::sleep(period);
                }
            })
            .ok();
        VramMonitor {
            stop,
            min_free,
            handle,
        }
    }

    /// Lowest free byte count seen so far (`None` before the first sample).
    pub fn min_free(&self) -> Option<u64> {
        match self.min_free.load(Ordering::Relaxed) {
            u64::MAX => None,
            v => Some(v),
        }
    }
}

impl Drop for VramMonitor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
