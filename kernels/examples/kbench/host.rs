//! `kbench --host-experts`: what it costs to serve a decode step's cold
//! experts straight from page-locked, device-mapped host memory (the GEMV
//! reads the INT4 blocks over PCIe) against copying them to VRAM first, as
//! HCS decode does (issue 16, "no host round trip").
//!
//! Three measurements:
//! - raw rates from host memory: `cuMemcpyHtoDAsync` of pinned memory, a
//!   kernel that only reads mapped host memory, and one that copies it into
//!   VRAM, at one expert's size up to 256 MiB. Every timed launch reads a
//!   different region of a 1 GiB buffer, so nothing is served from L2;
//! - the INT4 w13 + w2 decode GEMVs (a3b and GLM-4.5-Air shapes, M = 1 and
//!   4 rows) with j of each row's top-8 experts read from host memory, drawn
//!   from a pool of 256 host experts (random routes per launch, so the host
//!   reads rarely repeat inside L2);
//! - the same j experts copied to VRAM first, then the GEMVs (the copy and
//!   the compute serialized on one stream, the shape of a HCS miss before);
//! - a short prefill chunk's grouped INT4 GEMMs (a3b, 8 to 1,024 tokens, random
//!   routes) with every expert in VRAM, every expert read in place from host
//!   memory, and the layer's experts copied first (what layer-group
//!   streaming moves per layer): whether a short prompt under HCS could
//!   skip streaming.

use super::{random_routes, time_graph_ms, time_ms};
use anyhow::Context;
use cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg, result, sys,
};
use krasis_kernels::{Int4Layout, Kernels};
use rand::{Rng, rngs::StdRng};
use std::sync::Arc;

const SRC: &str = r#"
// Reads n16 16-byte words with 8 loads in flight per thread; the xor keeps
// the loads live.
extern "C" __global__ void host_read(const uint4* __restrict__ p, unsigned long long n16,
                                     unsigned int* out) {
    unsigned int acc = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 7 * stride < n16; i += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = p[i + u * stride];
#pragma unroll
        for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n16; i += stride) { uint4 v = p[i]; acc ^= v.x ^ v.y ^ v.z ^ v.w; }
    if (acc == 0x9e3779b9u) out[0] = acc;
}
// Copies n16 16-byte words from mapped host memory into device memory.
extern "C" __global__ void host_copy(const uint4* __restrict__ p, unsigned long long n16,
                                     uint4* __restrict__ d) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 7 * stride < n16; i += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = p[i + u * stride];
#pragma unroll
        for (int u = 0; u < 8; ++u) d[i + u * stride] = v[u];
    }
    for (; i < n16; i += stride) d[i] = p[i];
}
"#;

/// Page-locked host memory mapped into the device's address space.
pub(super) struct Mapped {
    pub(super) host: *mut u8,
    pub(super) dev: u64,
    len: usize,
}

impl Mapped {
    pub(super) fn new(len: usize) -> anyhow::Result<Self> {
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: a fresh allocation owned by the returned value.
        let host = unsafe { result::malloc_host(len, flags) }? as *mut u8;
        let mut dev = 0u64;
        // SAFETY: allocated with DEVICEMAP in the current context.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host as *mut _, 0) }.result()?;
        Ok(Mapped { host, dev, len })
    }
    pub(super) fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: host..host+len is owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.host, self.len) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host in new().
        let _ = unsafe { result::free_host(self.host as *mut _) };
    }
}

pub fn bench_host_experts(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut StdRng,
    rows: &mut Vec<String>,
) -> anyhow::Result<()> {
    let ctx = s.context();
    let module = super::adhoc_module(ctx, "kbench_host", SRC)?;
    let read = module.load_function("host_read")?;
    let copy = module.load_function("host_copy")?;

    let pool = 1usize << 30;
    let mut big = Mapped::new(pool)?;
    rng.fill(big.bytes());
    let mut dst: CudaSlice<u8> = s.alloc_zeros(256 << 20)?;
    let sink: CudaSlice<u32> = s.alloc_zeros(1)?;
    rows.push("raw host -> GPU rates, GB/s (each launch a different region of 1 GiB)".into());
    for size in [2_359_296usize, 4 << 20, 19 << 20, 64 << 20, 256 << 20] {
        let regions = pool / size;
        let at = |it: usize| big.dev + ((it % regions) * size) as u64;
        let gbs = |ms: f64| size as f64 / ms / 1e6;
        let memcpy = time_ms(s, 4, |it| {
            let (d, _g) = dst.device_ptr(s);
            // SAFETY: both ranges are live and `size` bytes long.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    d,
                    big.host.add((it % regions) * size) as *const _,
                    size,
                    s.cu_stream(),
                )
            }
            .result()?;
            Ok(())
        })?;
        let mut line = format!(
            "{:>7.2} MiB: memcpy {:>5.1}",
            size as f64 / 1048576.0,
            gbs(memcpy)
        );
        for blocks in [132u32, 264, 528, 1056] {
            let cfg = LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let n16 = (size / 16) as u64;
            let r = time_ms(s, 4, |it| {
                let p = at(it);
                let mut b = s.launch_builder(&read);
                b.arg(&p).arg(&n16).arg(&sink);
                // SAFETY: p..p+size is mapped host memory; sink holds one u32.
                unsafe { b.launch(cfg) }?;
                Ok(())
            })?;
            let cp = time_ms(s, 4, |it| {
                let p = at(it);
                let mut b = s.launch_builder(&copy);
                b.arg(&p).arg(&n16).arg(&mut dst);
                // SAFETY: dst holds 256 MiB >= size.
                unsafe { b.launch(cfg) }?;
                Ok(())
            })?;
            line.push_str(&format!(
                " | {blocks}x256 read {:>5.1} copy {:>5.1}",
                gbs(r),
                gbs(cp)
            ));
        }
        rows.push(line);
    }
    drop(big);

    rows.push(
        "INT4 w13+w2 decode with j of each row's 8 experts in host memory, us (graph-timed): \
         read by the GEMV from host | copied to VRAM first, then the GEMV"
            .into(),
    );
    for (label, h, i) in [("a3b", 2048usize, 768usize), ("glm-air", 4096, 1408)] {
        let layout = Int4Layout::new(h, i, 128).context("INT4 layout")?;
        let stride = layout.used_bytes().div_ceil(4096) * 4096;
        let (e_dev, e_host, topk) = (128usize, 256usize, 8usize);
        let mut dev_host = vec![0u8; e_dev * stride];
        fill_experts(rng, &layout, stride, &mut dev_host);
        let dev: CudaSlice<u8> = s.clone_htod(&dev_host)?;
        let mut host = Mapped::new(e_host * stride)?;
        fill_experts(rng, &layout, stride, host.bytes());
        // Landing slots for the copy-first form: 8 rows x 8 experts.
        let slots: CudaSlice<u8> = s.alloc_zeros(64 * stride)?;
        let db = dev.device_ptr(s).0;
        let sb = slots.device_ptr(s).0;
        let mut table: Vec<u64> = (0..e_dev).map(|x| db + (x * stride) as u64).collect();
        table.extend((0..e_host).map(|x| host.dev + (x * stride) as u64));
        table.extend((0..64).map(|x| sb + (x * stride) as u64));
        let table = s.clone_htod(&table)?;
        let xb = s.clone_htod(&super::rand_bf16(rng, 8 * h))?;
        let w = s.clone_htod(&vec![0.125f32; 8 * topk])?;
        let mut act = s.alloc_zeros::<f32>(8 * topk * i)?;
        let mut resd = s.alloc_zeros::<f32>(8 * h)?;
        let sets = 64usize;
        for m in [1usize, 4] {
            let mut line = format!("{label} H{h} I{i} m{m}:");
            for j in [0usize, 1, 2, 8] {
                // Routes over the device experts, the first j of each row
                // moved to the host pool (host ids drawn per row).
                let mut ids = random_routes(rng, sets * m, e_dev, topk);
                let mut slot_ids = ids.clone();
                for (r, row) in ids.chunks_mut(topk).enumerate() {
                    for (q, id) in row.iter_mut().take(j).enumerate() {
                        *id = (e_dev + rng.random_range(0..e_host)) as u32;
                        slot_ids[r * topk + q] = (e_dev + e_host + (r % m) * topk + q) as u32;
                    }
                }
                let host_ids: Vec<u32> = ids.clone();
                let ids = s.clone_htod(&ids)?;
                let slot_ids = s.clone_htod(&slot_ids)?;
                fn sl(
                    v: &CudaSlice<u32>,
                    it: usize,
                    n: usize,
                ) -> cudarc::driver::CudaView<'_, u32> {
                    v.slice((it % 64) * n..((it % 64) + 1) * n)
                }
                debug_assert_eq!(sets, 64);
                let gemv = |ids: &cudarc::driver::CudaView<u32>,
                            act: &mut CudaSlice<f32>,
                            resd: &mut CudaSlice<f32>|
                 -> anyhow::Result<()> {
                    k.int4_w13_swiglu(s, &xb, &table, ids, m, topk, &layout, u32::MAX, false, act)?;
                    k.int4_w2_combine(s, act, &table, ids, &w, m, topk, &layout, resd)?;
                    Ok(())
                };
                let direct = time_graph_ms(s, 64, |it| {
                    gemv(&sl(&ids, it, m * topk), &mut act, &mut resd)
                })?;
                let copied = time_graph_ms(s, 64, |it| {
                    let set = it % sets;
                    for r in 0..m {
                        for q in 0..j {
                            let e = host_ids[(set * m + r) * topk + q] as usize - e_dev;
                            let d = sb + ((r * topk + q) * stride) as u64;
                            // SAFETY: the source expert and the slot are
                            // live and `stride` bytes long.
                            unsafe {
                                sys::cuMemcpyHtoDAsync_v2(
                                    d,
                                    host.host.add(e * stride) as *const _,
                                    layout.used_bytes(),
                                    s.cu_stream(),
                                )
                            }
                            .result()?;
                        }
                    }
                    gemv(&sl(&slot_ids, it, m * topk), &mut act, &mut resd)
                })?;
                line.push_str(&format!(
                    "  j{j} {:>7.1} | {:>7.1}",
                    direct * 1e3,
                    copied * 1e3
                ));
            }
            rows.push(line);
        }
    }
    bench_grouped_host(k, s, rng, rows)
}

fn bench_grouped_host(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut StdRng,
    rows: &mut Vec<String>,
) -> anyhow::Result<()> {
    let (h, i, e, topk) = (2048usize, 768usize, 128usize, 8usize);
    let layout = Int4Layout::new(h, i, 128).context("INT4 layout")?;
    let stride = layout.used_bytes().div_ceil(4096) * 4096;
    let mut bytes = vec![0u8; e * stride];
    fill_experts(rng, &layout, stride, &mut bytes);
    let dev: CudaSlice<u8> = s.clone_htod(&bytes)?;
    let mut host = Mapped::new(e * stride)?;
    host.bytes().copy_from_slice(&bytes);
    drop(bytes);
    let db = dev.device_ptr(s).0;
    let t_dev = s.clone_htod(&(0..e).map(|x| db + (x * stride) as u64).collect::<Vec<_>>())?;
    let t_host = s.clone_htod(
        &(0..e)
            .map(|x| host.dev + (x * stride) as u64)
            .collect::<Vec<_>>(),
    )?;
    let mut landing: CudaSlice<u8> = s.alloc_zeros(e * stride)?;
    rows.push(
        "a3b grouped INT4 w13+w2 of one layer, us: experts in VRAM | read in place from host | \
         the layer's 128 experts copied first, then VRAM"
            .into(),
    );
    for t in [8usize, 64, 256, 1024] {
        let pairs = t * topk;
        let ids = random_routes(rng, t, e, topk);
        let (_, offsets, _, _) = krasis_kernels::reference::moe_group(&ids, e);
        let used = offsets.windows(2).filter(|w| w[1] > w[0]).count();
        let tiles = krasis_kernels::int4_grouped_tiles(&offsets);
        let d_off = s.clone_htod(&offsets)?;
        let xg = s.clone_htod(&super::rand_bf16(rng, pairs * h))?;
        let mut hact = s.alloc_zeros::<half::bf16>(pairs * i)?;
        let mut y = s.alloc_zeros::<f32>(pairs * h)?;
        let mut run = |table: &CudaSlice<u64>| -> anyhow::Result<()> {
            k.int4_grouped_w13_swiglu(s, &xg, pairs, &d_off, e, tiles, table, &layout, &mut hact)?;
            k.int4_grouped_w2(s, &hact, pairs, &d_off, e, tiles, table, &layout, &mut y)?;
            Ok(())
        };
        let vram = time_ms(s, 3, |_| run(&t_dev))?;
        let in_place = time_ms(s, 3, |_| run(&t_host))?;
        let (lb, _g) = landing.device_ptr_mut(s);
        let copied = time_ms(s, 3, |_| {
            // SAFETY: both ranges are e * stride bytes.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(lb, host.host as *const _, e * stride, s.cu_stream())
            }
            .result()?;
            run(&t_dev)
        })?;
        rows.push(format!(
            "T={t:<5} ({used:>3} experts used) {:>8.1} | {:>8.1} ({:>4.1} GB/s of used experts) | {:>8.1}",
            vram * 1e3,
            in_place * 1e3,
            (used * layout.used_bytes()) as f64 / in_place / 1e6,
            copied * 1e3
        ));
    }
    Ok(())
}

/// Random nibbles with f16 scales of 0.01 (finite outputs), `stride` apart.
pub(super) fn fill_experts(rng: &mut StdRng, layout: &Int4Layout, stride: usize, buf: &mut [u8]) {
    let (h, i, g) = (layout.hidden, layout.intermediate, layout.group);
    rng.fill(&mut buf[..]);
    for b in buf.chunks_mut(stride) {
        for (off, n) in [(layout.w13_s, 2 * i * h / g), (layout.w2_s, h * i / g)] {
            for j in 0..n {
                b[off + 2 * j..off + 2 * j + 2]
                    .copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
            }
        }
    }
}
