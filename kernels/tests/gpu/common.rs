//! Shared setup for the GPU tests: one `Kernels` per test binary, visible
//! skipping on machines without an NVIDIA driver (and a failure, with the
//! reason, on machines with one where the device or the kernels cannot be
//! used), time-seeded RNGs, NaN-poisoned outputs and norm-wise comparisons.

use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr};
use half::bf16;
use krasis_kernels::{CacheDir, GpuTestDevice, Kernels};
use rand::{Rng, SeedableRng, rngs::StdRng};

pub struct Gpu {
    pub kernels: Kernels,
    pub ctx: Arc<CudaContext>,
}

/// `Ok(None)`: skip (no NVIDIA driver); `Err`: why the GPU cannot be used.
static GPU: OnceLock<Result<Option<Gpu>, String>> = OnceLock::new();

fn open() -> Result<Gpu, String> {
    let ctx = krasis_kernels::open_device(0)?;
    let dir = std::env::temp_dir().join("krasis-kernel-test-cache");
    let started = std::time::Instant::now();
    let kernels = Kernels::new(&ctx, &CacheDir::At(dir))
        .map_err(|e| format!("compiling and loading the kernels: {e}"))?;
    eprintln!("kernels loaded in {:?}: {kernels:?}", started.elapsed());
    Ok(Gpu { kernels, ctx })
}

/// The shared kernels, or `None` after printing the SKIPPED line on a
/// machine without an NVIDIA driver. Panics with the reason when a driver
/// is present but the device cannot be opened or the kernels not loaded.
pub fn gpu(test: &str) -> Option<(&'static Gpu, Arc<CudaStream>)> {
    let g = GPU.get_or_init(|| {
        match krasis_kernels::gpu_test_device(krasis_kernels::nvidia_driver_present(), open()) {
            GpuTestDevice::Run(g) => Ok(Some(g)),
            GpuTestDevice::Skip => Ok(None),
            GpuTestDevice::Fail(why) => Err(why),
        }
    });
    match g {
        Ok(Some(g)) => Some((g, g.ctx.new_stream().expect("new stream"))),
        Ok(None) => {
            // Straight to the stderr handle: the test harness captures
            // `eprintln!`, and this line must stay visible in CI logs.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED (no CUDA device): {test} (no NVIDIA driver)"
            );
            None
        }
        Err(why) => panic!("{test}: {why}"),
    }
}

/// RNG seeded from the clock; the seed is printed so failures reproduce.
pub fn rng(test: &str) -> StdRng {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    eprintln!("{test}: seed {seed}");
    StdRng::seed_from_u64(seed)
}

pub fn randn(rng: &mut StdRng, n: usize, std: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            // Box-Muller; plenty for test data.
            let u1: f32 = rng.random_range(1e-7f32..1.0);
            let u2: f32 = rng.random();
            std * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
        })
        .collect()
}

pub fn randn_bf16(rng: &mut StdRng, n: usize, std: f32) -> Vec<bf16> {
    randn_act(rng, n, std)
}

/// [`randn`] rounded to an attention activation format (bf16 or f16).
pub fn randn_act<A: krasis_kernels::Act16>(rng: &mut StdRng, n: usize, std: f32) -> Vec<A> {
    randn(rng, n, std).into_iter().map(A::from_f32).collect()
}

pub fn up<T: DeviceRepr>(s: &Arc<CudaStream>, x: &[T]) -> CudaSlice<T> {
    s.clone_htod(x).expect("htod")
}

pub fn down<T: DeviceRepr + Default + Clone>(s: &Arc<CudaStream>, x: &CudaSlice<T>) -> Vec<T> {
    s.clone_dtoh(x).expect("dtoh")
}

pub fn poison_f32(s: &Arc<CudaStream>, n: usize) -> CudaSlice<f32> {
    up(s, &vec![f32::NAN; n])
}

pub fn poison_bf16(s: &Arc<CudaStream>, n: usize) -> CudaSlice<bf16> {
    up(s, &vec![bf16::NAN; n])
}

pub fn poison_f16(s: &Arc<CudaStream>, n: usize) -> CudaSlice<half::f16> {
    up(s, &vec![half::f16::NAN; n])
}

pub fn poison_u32(s: &Arc<CudaStream>, n: usize) -> CudaSlice<u32> {
    up(s, &vec![u32::MAX; n])
}

/// Runs `launch` on a bf16 output of `n` values followed by `guard`
/// NaN-poisoned ones, asserts the guard is untouched (`what` names the
/// launch) and returns the `n` values as f32.
pub fn guarded_bf16(
    s: &Arc<CudaStream>,
    n: usize,
    guard: usize,
    what: &str,
    launch: impl FnOnce(&mut CudaSlice<bf16>),
) -> Vec<f32> {
    let mut out = poison_bf16(s, n + guard);
    launch(&mut out);
    let all = down(s, &out);
    assert!(
        all[n..].iter().all(|x| x.is_nan()),
        "{what}: wrote past the last row"
    );
    f32s(&all[..n])
}

/// The f32 values of bf16 or f16 data.
pub fn f32s<A: krasis_kernels::Act16>(x: &[A]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

pub fn f16_bits(v: &[half::f16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Fails on any NaN/inf in `got` and when ||got - want|| / ||want|| > tol.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!(
            "{what}: element {i} is {} (unwritten or overflow); want {}",
            got[i], want[i]
        );
    }
    let (mut num, mut den, mut worst, mut wi) = (0f64, 0f64, 0f64, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let d = (g as f64 - w as f64).abs();
        num += d * d;
        den += (w as f64) * (w as f64);
        if d > worst {
            worst = d;
            wi = i;
        }
    }
    let rel = (num / den.max(1e-30)).sqrt();
    eprintln!("{what}: rel err {rel:.3e}, max abs err {worst:.3e} at {wi}");
    assert!(
        rel <= tol,
        "{what}: relative error {rel:.3e} > {tol:.1e} (worst at {wi}: got {} want {})",
        got[wi],
        want[wi]
    );
}

pub fn sync(s: &Arc<CudaStream>) {
    s.synchronize().expect("stream sync (a kernel faulted?)");
}

/// Row offsets `[E + 1]` of a grouping with `counts[e]` rows per expert.
pub fn offsets_of(counts: &[usize]) -> Vec<u32> {
    let mut o = vec![0u32];
    for c in counts {
        o.push(o.last().unwrap() + *c as u32);
    }
    o
}

/// `w · x` in f64 (the grouped GEMMs' reference dot product).
pub fn dot(w: &[f32], x: &[f32]) -> f64 {
    w.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64).sum()
}

/// Whether two f32 outputs are the same bits element for element.
pub fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
}
