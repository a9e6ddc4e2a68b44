//! A persistent pool of spinning workers with a sense-reversing barrier,
//! and the scratch buffers a call's phases share between barriers.

use std::cell::UnsafeCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::*};

/// Sense-reversing spin barrier.
pub(super) struct Barrier {
    n: usize,
    count: AtomicUsize,
    sense: AtomicUsize,
}
impl Barrier {
    pub(super) fn wait(&self) {
        let s = self.sense.load(Acquire);
        if self.count.fetch_add(1, AcqRel) + 1 == self.n {
            self.count.store(0, Relaxed);
            self.sense.store(s + 1, Release);
        } else {
            while self.sense.load(Acquire) == s {
                std::hint::spin_loop();
            }
        }
    }
}

type Job = &'static (dyn Fn(usize) + Sync);
struct PoolShared {
    n: usize,
    gen_: AtomicUsize,
    left: AtomicUsize,
    stop: AtomicBool,
    job: UnsafeCell<Option<Job>>,
    bar: Barrier,
}
// SAFETY: `job` is written only by `run` while no worker reads it (before the
// generation bump, after all finished).
unsafe impl Sync for PoolShared {}

/// Persistent workers spinning on a generation counter: a miss must be
/// served in microseconds (no spawn, no futex wake-up). The caller is thread 0.
pub(super) struct Pool {
    sh: Arc<PoolShared>,
    workers: Vec<std::thread::JoinHandle<()>>,
}
impl Pool {
    pub(super) fn new(n: usize) -> Self {
        let bar = Barrier {
            n,
            count: AtomicUsize::new(0),
            sense: AtomicUsize::new(0),
        };
        let sh = Arc::new(PoolShared {
            n,
            gen_: AtomicUsize::new(0),
            left: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            job: UnsafeCell::new(None),
            bar,
        });
        let workers = (1..n)
            .map(|tid| {
                let sh = sh.clone();
                std::thread::spawn(move || {
                    let mut seen = 0;
                    loop {
                        while sh.gen_.load(Acquire) == seen {
                            std::hint::spin_loop();
                        }
                        seen = sh.gen_.load(Acquire);
                        if sh.stop.load(Acquire) {
                            return;
                        }
                        // SAFETY: set before the generation bump we observed.
                        (unsafe { (*sh.job.get()).unwrap() })(tid);
                        sh.left.fetch_sub(1, Release);
                    }
                })
            })
            .collect();
        Pool { sh, workers }
    }
    pub(super) fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        // SAFETY: `f` outlives every use: run returns after all workers finished.
        let f: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
        // SAFETY: no worker reads `job` until the bump below.
        unsafe { *self.sh.job.get() = Some(f) };
        self.sh.left.store(self.sh.n - 1, Relaxed);
        self.sh.gen_.fetch_add(1, Release);
        f(0);
        while self.sh.left.load(Acquire) != 0 {
            std::hint::spin_loop();
        }
    }
    /// Threads, the caller's included.
    pub(super) fn threads(&self) -> usize {
        self.sh.n
    }
    /// The barrier of all `threads()`, for phases inside one `run`.
    pub(super) fn barrier(&self) -> &Barrier {
        &self.sh.bar
    }
}
impl Drop for Pool {
    fn drop(&mut self) {
        self.sh.stop.store(true, Release);
        self.sh.gen_.fetch_add(1, Release);
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

pub(super) struct Buf<T>(UnsafeCell<Vec<T>>);
impl<T: Clone + Default> Buf<T> {
    pub(super) fn new(n: usize) -> Self {
        Buf(UnsafeCell::new(vec![T::default(); n]))
    }
    pub(super) fn p(&self) -> *mut T {
        // SAFETY: phases write disjoint ranges, separated by barriers.
        unsafe { (*self.0.get()).as_mut_ptr() }
    }
    pub(super) fn get(&self) -> &[T] {
        // SAFETY: read between calls only.
        unsafe { &*self.0.get() }
    }
}
