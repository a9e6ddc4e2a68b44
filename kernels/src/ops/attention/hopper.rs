//! Hopper prefill attention (`cuda/attention_prefill_sm90.cu`): warpgroup
//! MMA (wgmma) over 128-row query tiles, head_dim 128, bf16, causal over a
//! linear cache. Compiled for sm_90a and loaded only on compute capability
//! 9.0 ([`crate::sources::Target::Sm90a`]); elsewhere
//! [`Kernels::attention_prefill_wgmma`] is refused
//! ([`crate::KernelError::WrongTarget`]) and [`Kernels::has_prefill_wgmma`]
//! says so.
//!
//! The CUDA engine runs it for every prefill chunk of a model whose
//! attention it serves ([`Kernels::prefill_wgmma_serves`]), on the strength of
//! the device tests (`kernels/tests/gpu/attention/hopper.rs`) and
//! `kbench --prefill`; [`Kernels::attention_prefill`] stays the portable
//! mma.sync kernel. Its bits differ from the portable kernel's (128-key
//! tiles), so an engine uses one of the two for every chunk of a model.

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use crate::launch::{Act16, ensure};
use crate::ops::rope::{KvGeom, QkvGeom};
use crate::{Kernels, Result};

const KERNEL: &str = "attn_prefill_wgmma_d128";
/// Query rows per block (2 warpgroups of 64), `HP_BM` in the kernel.
const BLOCK_M: usize = 128;
/// Dynamic shared memory: Q, and K and V double-buffered, each a 128 x 128
/// bf16 tile (`HP_SMEM`; the kernel traps on less).
const SMEM_BYTES: u32 = 5 * 128 * 128 * 2;
/// The only head_dim the kernel is built for.
const HEAD_DIM: usize = 128;

impl Kernels {
    /// Whether [`Kernels::attention_prefill_wgmma`] runs here (a Hopper
    /// device, whose sm_90a module is loaded).
    pub fn has_prefill_wgmma(&self) -> bool {
        self.has(KERNEL)
    }

    /// Whether [`Kernels::attention_prefill_wgmma`] serves attention in `A`
    /// with `head_dim` (bf16, head_dim 128), on a device that has it
    /// ([`Kernels::has_prefill_wgmma`]).
    pub fn prefill_wgmma_serves<A: Act16>(head_dim: usize) -> bool {
        !A::F16 && head_dim == HEAD_DIM
    }

    /// Causal prefill attention with the contract of
    /// [`Kernels::attention_prefill`] (linear cache, rows from `base`,
    /// output bf16 `[n_tokens, n_q_heads * head_dim]`) on Hopper's
    /// warpgroup MMA; bf16 q/K/V and head_dim 128 only. Refused with
    /// [`crate::KernelError::WrongTarget`] on a device that is not compute
    /// capability 9.0 and with a shape error for f16 or other head dims.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_prefill_wgmma<A: Act16>(
        &self,
        stream: &CudaStream,
        qkv: &impl DevicePtr<A>,
        geom: QkvGeom,
        start_pos: usize,
        kv: KvGeom,
        base: usize,
        k_cache: &impl DevicePtr<A>,
        v_cache: &impl DevicePtr<A>,
        scale: f32,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        self.require(KERNEL)?;
        ensure(
            KERNEL,
            Self::prefill_wgmma_serves::<A>(geom.head_dim),
            || {
                format!(
                    "head_dim {} in {} (the Hopper kernel is built for bf16 and head_dim \
                 {HEAD_DIM}; use attention_prefill)",
                    geom.head_dim,
                    if A::F16 { "f16" } else { "bf16" }
                )
            },
        )?;
        self.launch_prefill(
            KERNEL,
            stream,
            qkv,
            geom,
            start_pos,
            kv,
            base,
            (k_cache, v_cache),
            scale,
            out,
            (BLOCK_M, 256, SMEM_BYTES),
        )
    }
}

#[cfg(test)]
mod tests {
    //! A host model of the kernel's shared-memory addressing: where
    //! `hp_stage` writes element (row, d) of a tile, and where wgmma reads
    //! it through `h_desc`'s descriptors, per the PTX ISA's canonical
    //! 128-byte-swizzle layouts (K-major: rows 128 bytes apart, 8-row
    //! groups SBO apart; MN-major: the contiguous dimension in 64-element
    //! runs LBO apart, rows along K 128 bytes apart, 8-row groups SBO
    //! apart; the swizzle XORs address bits 4-6 with bits 7-9). Both sides
    //! must name the same byte for every element an MMA step reads.

    /// `hp_stage`: byte offset of bf16 element (r, d) of a 128 x 128 tile.
    fn staged(r: u32, d: u32) -> u32 {
        let j = d / 8; // 16-byte chunk of the row
        (j >> 3) * 16384 + r * 128 + (((j & 7) ^ (r & 7)) << 4) + (d % 8) * 2
    }

    /// The 128-byte swizzle applied to an unswizzled byte address.
    fn swizzle(a: u32) -> u32 {
        a ^ (((a >> 7) & 7) << 4)
    }

    /// K-major operand (A or B): element (row, k) of the k16 step whose
    /// descriptor starts at `start` with stride byte offset `sbo`.
    fn k_major(start: u32, sbo: u32, row: u32, k: u32) -> u32 {
        assert!(k < 16);
        swizzle(start + (row / 8) * sbo + (row % 8) * 128 + k * 2)
    }

    /// MN-major B operand: element (k, n) of the k16 step at `start`, with
    /// LBO between 64-element runs of n and SBO between 8-row groups of k.
    fn mn_major(start: u32, lbo: u32, sbo: u32, k: u32, n: u32) -> u32 {
        assert!(k < 16);
        swizzle(start + (n / 64) * lbo + (k / 8) * sbo + (k % 8) * 128 + (n % 64) * 2)
    }

    #[test]
    fn hopper_swizzle_matches_the_canonical_layout() {
        for kk in 0..8u32 {
            let koff = (kk >> 2) * 16384 + (kk & 3) * 32;
            for wg in 0..2u32 {
                // Q as A: 64 rows of warpgroup wg, head dims 16kk..16kk+15.
                for row in 0..64 {
                    for k in 0..16 {
                        let want = staged(wg * 64 + row, kk * 16 + k);
                        assert_eq!(k_major(koff + wg * 8192, 1024, row, k), want);
                    }
                }
            }
            // K as B (N = 128 keys, K = head dims 16kk..).
            for key in 0..128 {
                for k in 0..16 {
                    assert_eq!(k_major(koff, 1024, key, k), staged(key, kk * 16 + k));
                }
            }
            // V as B (K = keys 16kk.., N = 128 head dims), transposed.
            for k in 0..16 {
                for n in 0..128 {
                    assert_eq!(
                        mn_major(kk * 2048, 16384, 1024, k, n),
                        staged(kk * 16 + k, n)
                    );
                }
            }
        }
        // Every byte of the tile is written exactly once.
        let mut seen = vec![false; 32768];
        for r in 0..128 {
            for d in (0..128).step_by(1) {
                let a = staged(r, d) as usize;
                assert!(!seen[a] && !seen[a + 1]);
                seen[a] = true;
                seen[a + 1] = true;
            }
        }
        assert!(seen.iter().all(|&s| s));
    }
}
