//! The grouped INT4 prefill GEMMs on Hopper (`cuda/int4_gemm_sm90.cu`):
//! warpgroup MMA (wgmma) with the weights dequantized in registers as the A
//! operand and the tile's tokens staged in shared memory as B. Compiled for
//! sm_90a and loaded only on compute capability 9.0
//! ([`crate::sources::Target::Sm90a`]); elsewhere the wrappers refuse with
//! [`crate::KernelError::WrongTarget`] and [`Kernels::has_int4_grouped_wgmma`]
//! says so.
//!
//! The arguments, checks, grid (the same 64-row token tiles,
//! [`super::int4_grouped_tiles`]) and outputs are those of
//! [`Kernels::int4_grouped_w13_swiglu`] and [`Kernels::int4_grouped_w2`].
//! Not yet the engine's kernels: they must first pass the device tests
//! (`kernels/tests/gpu/int4_grouped_sm90.rs`) and measure faster
//! (`kbench --grouped`). Their bits must be taken to differ from the
//! portable kernels' (how the tensor core sums a k16 step is not specified
//! to match between mma.sync and wgmma), so an engine must use one of the
//! two for every chunk of a model.

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

use super::Int4Layout;
use super::grouped::GroupedKernels;
use crate::launch::{Act16, by_act};
use crate::{Kernels, Result};

/// The Hopper entry points; dynamic shared memory: 4 buffers of one 128-K
/// step of x (64 tokens x 128 x 2 bytes), then the tile lookup's 3 words
/// (`GW_SMEM`; the kernel traps on less).
const HOPPER: GroupedKernels = GroupedKernels {
    w13: [
        "int4_grouped_w13_swiglu_wgmma_bf16",
        "int4_grouped_w13_swiglu_wgmma_f16",
    ],
    w2: ["int4_grouped_w2_wgmma_bf16", "int4_grouped_w2_wgmma_f16"],
    smem: 4 * 64 * 128 * 2 + 16,
};

impl Kernels {
    /// Whether the Hopper grouped INT4 GEMMs run here (a compute capability
    /// 9.0 device, whose sm_90a module is loaded).
    pub fn has_int4_grouped_wgmma(&self) -> bool {
        HOPPER.w13.iter().chain(&HOPPER.w2).all(|k| self.has(k))
    }

    /// [`Kernels::int4_grouped_w13_swiglu`] on Hopper's warpgroup MMA: the
    /// same arguments and output (`hact` `[rows, I]` in `A`), NaN rows for
    /// a missing expert, group 128 only. Refused with
    /// [`crate::KernelError::WrongTarget`] on a device that is not compute
    /// capability 9.0.
    #[allow(clippy::too_many_arguments)]
    pub fn int4_grouped_w13_swiglu_wgmma<A: Act16>(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<A>,
        rows: usize,
        offsets: &impl DevicePtr<u32>,
        n_experts: usize,
        tiles: usize,
        table: &impl DevicePtr<u64>,
        layout: &Int4Layout,
        hact: &mut impl DevicePtrMut<A>,
    ) -> Result<()> {
        self.require(by_act::<A>(HOPPER.w13[0], HOPPER.w13[1]))?;
        self.grouped_w13(
            &HOPPER, stream, x, rows, offsets, n_experts, tiles, table, layout, hact,
        )
    }

    /// [`Kernels::int4_grouped_w2`] on Hopper's warpgroup MMA: `y` f32
    /// `[rows, H]`, as [`Kernels::int4_grouped_w13_swiglu_wgmma`].
    #[allow(clippy::too_many_arguments)]
    pub fn int4_grouped_w2_wgmma<A: Act16>(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<A>,
        rows: usize,
        offsets: &impl DevicePtr<u32>,
        n_experts: usize,
        tiles: usize,
        table: &impl DevicePtr<u64>,
        layout: &Int4Layout,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.require(by_act::<A>(HOPPER.w2[0], HOPPER.w2[1]))?;
        self.grouped_w2(
            &HOPPER, stream, x, rows, offsets, n_experts, tiles, table, layout, y,
        )
    }
}

#[cfg(test)]
mod tests {
    //! A host model of the kernel's operands (header of
    //! `cuda/int4_gemm_sm90.cu`): which weight nibble each A register
    //! element of a lane holds (dq8's pairs in mma.m16n8k16's A fragment
    //! layout), where the staging writes each element of x, and where
    //! wgmma reads B through the descriptors, per the PTX ISA's canonical
    //! K-major layout with the 128-byte swizzle (rows 128 bytes apart,
    //! 8-row groups SBO apart, address bits 4-6 XORed with bits 7-9). A and
    //! B must name the same physical K at every logical k of every step.

    /// The header's map: logical k (0..16) of k16 step s (0..8) -> the
    /// physical K (0..128) inside a 128-K step.
    fn phys_k(s: u32, k: u32) -> u32 {
        let (i, h) = (s >> 1, s & 1);
        let (t, hi, lo) = ((k >> 1) & 3, k >> 3, k & 1);
        32 * t + 8 * i + 2 * h + hi + 4 * lo
    }

    /// A side: register `r` (0..4) half `e` (0 low, 1 high) of lane
    /// (g, tq) at k16 step s, as the kernel fills it (`dequant`: a0 / a2 =
    /// dq8 pairs 2h / 2h + 1 of row g's word i, a1 / a3 of row g + 8's;
    /// dq8 pair j = (nibble j, nibble j + 4); nibble n of word i of the
    /// lane's 16 bytes is K 32 tq + 8 i + n). Returns (tile row, K).
    fn a_holds(g: u32, tq: u32, s: u32, r: u32, e: u32) -> (u32, u32) {
        let (i, h) = (s >> 1, s & 1);
        let row = g + 8 * (r & 1);
        let pair = 2 * h + (r >> 1);
        let nibble = pair + 4 * e;
        (row, 32 * tq + 8 * i + nibble)
    }

    /// What mma.m16n8k16's (and wgmma's per-warp) A fragment layout puts in
    /// register r half e of lane (g, tq): (row, logical k).
    fn a_fragment(g: u32, tq: u32, r: u32, e: u32) -> (u32, u32) {
        (g + 8 * (r & 1), 2 * tq + e + 8 * (r >> 1))
    }

    /// The staging (`store_x`): the byte offset in a buffer of every
    /// element thread (token xt, quarter xi) writes, with the physical K
    /// it holds: logical chunk c (perm8 words, transposed) position
    /// 2t + lo = x[32t + 8 xi + c + 4 lo].
    fn staging() -> Vec<(u32, u32, u32)> {
        let mut out = Vec::new();
        for xt in 0..64u32 {
            for xi in 0..4u32 {
                for c in 0..4u32 {
                    let chunk =
                        (xi >> 1) * 8192 + xt * 128 + (((4 * (xi & 1) + c) ^ (xt & 7)) << 4);
                    for t in 0..4u32 {
                        for lo in 0..2u32 {
                            let byte = chunk + (2 * t + lo) * 2;
                            out.push((byte, xt, 32 * t + 8 * xi + c + 4 * lo));
                        }
                    }
                }
            }
        }
        out
    }

    fn swizzle(a: u32) -> u32 {
        a ^ (((a >> 7) & 7) << 4)
    }

    /// K-major B: element (token, k) of the k16 step whose descriptor
    /// starts at `start`, SBO `sbo`.
    fn k_major(start: u32, sbo: u32, token: u32, k: u32) -> u32 {
        assert!(k < 16);
        swizzle(start + (token / 8) * sbo + (token % 8) * 128 + k * 2)
    }

    /// The kernel's B descriptor start for k16 step s (buffer offset 0).
    fn b_start(s: u32) -> u32 {
        (s >> 2) * 8192 + (s & 3) * 32
    }

    #[test]
    fn int4_wgmma_k_permutation_matches_the_fragments() {
        // The map is a bijection of the 128 K of a step.
        let mut seen = [false; 128];
        for s in 0..8 {
            for k in 0..16 {
                let p = phys_k(s, k) as usize;
                assert!(!seen[p], "K {p} twice");
                seen[p] = true;
            }
        }
        // Every A register element holds the nibble of its fragment
        // position's row at the map's K.
        for g in 0..8 {
            for tq in 0..4 {
                for s in 0..8 {
                    for r in 0..4 {
                        for e in 0..2 {
                            let (row, k) = a_fragment(g, tq, r, e);
                            assert_eq!(
                                a_holds(g, tq, s, r, e),
                                (row, phys_k(s, k)),
                                "lane ({g}, {tq}) step {s} a{r}.{e}"
                            );
                        }
                    }
                }
            }
        }
        // B reads x at the same K: the staged element under (token, k) of
        // step s is x[token][phys_k(s, k)].
        let mut mem = vec![None; 8192];
        for (byte, token, kk) in staging() {
            mem[byte as usize / 2] = Some((token, kk));
        }
        for s in 0..8 {
            for token in 0..64 {
                for k in 0..16 {
                    let a = k_major(b_start(s), 1024, token, k) as usize;
                    assert_eq!(mem[a / 2], Some((token, phys_k(s, k))), "step {s}");
                }
            }
        }
    }

    #[test]
    fn int4_wgmma_swizzle_matches_the_canonical_layout() {
        // The staging writes every byte of a 16 KB buffer exactly once,
        // each 16-byte chunk whole (8 elements of one token row).
        let mut hits = vec![0u8; 16384];
        for (byte, token, _) in staging() {
            assert_eq!(byte / 128 % 64, token, "token rows are 128 bytes apart");
            hits[byte as usize] += 1;
            hits[byte as usize + 1] += 1;
        }
        assert!(hits.iter().all(|&h| h == 1));
        // The descriptors' reads cover the buffer exactly once over the 8
        // k16 steps, and each step's stays inside its 64-K half.
        let mut read = vec![0u8; 16384];
        for s in 0..8 {
            for token in 0..64 {
                for k in 0..16 {
                    let a = k_major(b_start(s), 1024, token, k);
                    assert_eq!(a / 8192, s >> 2);
                    read[a as usize] += 1;
                }
            }
        }
        assert!(read.iter().step_by(2).all(|&r| r == 1));
        // A quarter-warp's 16-byte stores (8 tokens, one quarter, one chunk
        // c) hit 8 distinct bank groups: no conflicts.
        for warp in 0..8u32 {
            for xi in 0..4u32 {
                for c in 0..4u32 {
                    let mut banks: Vec<u32> = (0..8u32)
                        .map(|l| {
                            let xt = warp * 8 + l;
                            ((4 * (xi & 1) + c) ^ (xt & 7)) % 8
                        })
                        .collect();
                    banks.sort();
                    banks.dedup();
                    assert_eq!(banks.len(), 8);
                }
            }
        }
    }
}
