//! `kv_blocks_copy` against its CPU reference: storing and restoring blocks
//! between random per-layer caches (linear rows, or a sequence's ring) and
//! a pool in device memory and in page-locked host memory mapped into the
//! device, bit for bit, with a layer the launch must leave alone, and
//! pools and caches poisoned where nothing may be written.

use cudarc::driver::{DevicePtr, sys};
use krasis_kernels::{BlockCopy, KvBlockGeom, reference as cpu};
use rand::Rng;

use crate::common::*;

#[test]
fn kv_blocks_copy_matches_reference() {
    let Some((g, s)) = gpu("kv_blocks_copy_matches_reference") else {
        return;
    };
    let mut rng = rng("kv_blocks_copy_matches_reference");
    // (geometry, pool slots, pairs, the sequence's first KV row, a layer
    // the launch leaves alone)
    for (geom, slots, pairs, base, skip) in [
        (
            KvBlockGeom {
                layers: 3,
                heads: 4,
                head_dim: 128,
                block_tokens: 64,
                capacity: 512,
                ring: 0,
            },
            5usize,
            vec![(3u32, 0u32), (0, 7), (4, 2)],
            0usize,
            None,
        ),
        // A batched sequence's rows start off any block boundary.
        (
            KvBlockGeom {
                layers: 2,
                heads: 2,
                head_dim: 64,
                block_tokens: 64,
                capacity: 640,
                ring: 0,
            },
            3,
            vec![(2, 7), (0, 1)],
            72,
            None,
        ),
        (
            KvBlockGeom {
                layers: 2,
                heads: 2,
                head_dim: 64,
                block_tokens: 256,
                capacity: 1024,
                ring: 0,
            },
            2,
            vec![(1, 3), (0, 0)],
            0,
            Some(1),
        ),
        // The second of three rings of 4 blocks (sliding layers): prompt
        // blocks 9 and 4 at ring blocks 1 and 0, the middle layer (a full
        // one) left alone.
        (
            KvBlockGeom {
                layers: 3,
                heads: 2,
                head_dim: 64,
                block_tokens: 64,
                capacity: 3 * 256,
                ring: 256,
            },
            3,
            vec![(2, 9), (0, 4)],
            256,
            Some(1),
        ),
    ] {
        let n = geom.heads * geom.capacity * geom.head_dim;
        let rand16 = |rng: &mut rand::rngs::StdRng, n: usize| -> Vec<u16> {
            (0..n).map(|_| rng.random::<u16>()).collect()
        };
        let k: Vec<Vec<u16>> = (0..geom.layers).map(|_| rand16(&mut rng, n)).collect();
        let v: Vec<Vec<u16>> = (0..geom.layers).map(|_| rand16(&mut rng, n)).collect();
        let pool0 = rand16(&mut rng, slots * geom.slot_elems());
        let flat: Vec<u32> = pairs.iter().flat_map(|&(a, b)| [a, b]).collect();
        let pairs_d = up(&s, &flat);
        for mapped in [false, true] {
            for dir in [BlockCopy::ToPool, BlockCopy::ToSequence] {
                let what = format!("{geom:?} base {base} mapped={mapped} {dir:?}");
                let kd: Vec<_> = k.iter().map(|x| up(&s, x)).collect();
                let vd: Vec<_> = v.iter().map(|x| up(&s, x)).collect();
                let addr = |b: &cudarc::driver::CudaSlice<u16>| b.device_ptr(&s).0;
                // A skipped layer's address is 0 (the reference: no cache).
                let table = |bufs: &[cudarc::driver::CudaSlice<u16>]| {
                    let mut t: Vec<u64> = bufs.iter().map(addr).collect();
                    if let Some(l) = skip {
                        t[l] = 0;
                    }
                    up(&s, &t)
                };
                let (lk, lv) = (table(&kd), table(&vd));
                let pool_dev = up(&s, &pool0);
                let mut host = HostPool::new(&pool0);
                let pool = if mapped { host.dev } else { addr(&pool_dev) };
                g.kernels
                    .kv_blocks_copy(
                        &s,
                        &lk,
                        &lv,
                        geom,
                        base,
                        pool,
                        slots,
                        &pairs_d,
                        pairs.len(),
                        dir,
                    )
                    .unwrap();
                s.synchronize().unwrap();
                let (mut kw, mut vw, mut pw) = (k.clone(), v.clone(), pool0.clone());
                if let Some(l) = skip {
                    kw[l].clear();
                    vw[l].clear();
                }
                cpu::kv_blocks_copy(&mut kw, &mut vw, geom, base, &mut pw, &pairs, dir);
                if let Some(l) = skip {
                    kw[l] = k[l].clone();
                    vw[l] = v[l].clone();
                }
                let got_pool = if mapped {
                    host.read()
                } else {
                    down(&s, &pool_dev)
                };
                assert!(got_pool == pw, "{what}: pool differs");
                for l in 0..geom.layers {
                    assert!(down(&s, &kd[l]) == kw[l], "{what}: K of layer {l} differs");
                    assert!(down(&s, &vd[l]) == vw[l], "{what}: V of layer {l} differs");
                }
                host.free();
            }
        }
    }
}

/// Page-locked host memory mapped into the device, holding `data`.
struct HostPool {
    host: *mut u16,
    dev: u64,
    len: usize,
}

impl HostPool {
    fn new(data: &[u16]) -> Self {
        let bytes = data.len() * 2;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: fresh allocation, filled before any device access.
        let host =
            unsafe { cudarc::driver::result::malloc_host(bytes, flags) }.unwrap() as *mut u16;
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), host, data.len()) };
        let mut dev = 0;
        // SAFETY: allocated with DEVICEMAP above.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host as *mut _, 0) }
            .result()
            .unwrap();
        HostPool {
            host,
            dev,
            len: data.len(),
        }
    }

    fn read(&self) -> Vec<u16> {
        // SAFETY: `len` elements allocated in `new`; the stream was synchronized.
        unsafe { std::slice::from_raw_parts(self.host, self.len) }.to_vec()
    }

    fn free(&mut self) {
        // SAFETY: allocated by malloc_host in `new`, freed once.
        unsafe { cudarc::driver::result::free_host(self.host as *mut _) }.unwrap();
    }
}
