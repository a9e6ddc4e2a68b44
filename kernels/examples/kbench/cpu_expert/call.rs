//! One call: a token through up to `ne` experts on the pool (x permuted,
//! w13 + SwiGLU, act as bf16 hi / lo, w2 and the combine), on the best ISA
//! of this CPU.

use super::model::{BIG, Ex2, Model, lead, lsb, perm, scale, silu, tile_row};
use super::pool::{Barrier, Buf, Pool};
#[cfg(target_arch = "x86_64")]
use super::simd;
use half::bf16;
use krasis_kernels::Int4Layout;
use std::sync::Arc;

/// What the CPU reproduces of the GPU: the mma model and MUFU.EX2.
pub(super) struct Order {
    pub(super) m: Model,
    pub(super) ex2: Arc<Ex2>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Isa {
    Avx512,
    Avx2,
    Scalar,
}

/// The ISAs this CPU runs, best first (runtime-detected).
pub(super) fn isas() -> Vec<Isa> {
    let mut v = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        let (avx2, fma) = (
            is_x86_feature_detected!("avx2"),
            is_x86_feature_detected!("fma"),
        );
        if avx2 && fma && is_x86_feature_detected!("avx512f") {
            v.push(Isa::Avx512);
        }
        if avx2 && fma {
            v.push(Isa::Avx2);
        }
    }
    v.push(Isa::Scalar);
    v
}

/// One token x up to `ne` experts: inputs and the scratch the phases share.
pub(super) struct Call {
    m: Model,
    pub(super) lay: Int4Layout,
    pub(super) isa: Isa,
    ex2: Arc<Ex2>,
    pub(super) experts: Vec<(*const u8, f32)>,
    pub(super) x: Vec<f32>,
    b13: Buf<f32>,
    st13: Buf<[i32; 2]>,
    pub(super) act: Buf<f32>,
    b2: Buf<f32>,
    st2: Buf<[i32; 2]>,
    pub(super) y: Buf<f32>,
    /// Where y goes (`y`'s own buffer unless set: the round trip's mailbox).
    pub(super) out: *mut f32,
}
// SAFETY: the expert pointers are read-only host memory that outlives the call.
unsafe impl Sync for Call {}

impl Call {
    /// On the best ISA of this CPU (`isa` may be changed).
    pub(super) fn new(o: &Order, lay: Int4Layout, ne: usize) -> Self {
        let (h, i) = (lay.hidden, lay.intermediate);
        let y = Buf::new(h);
        let out = y.p();
        Call {
            m: o.m,
            lay,
            isa: isas()[0],
            ex2: o.ex2.clone(),
            experts: Vec::new(),
            x: vec![0.0; h],
            b13: Buf::new(h),
            st13: Buf::new(h),
            act: Buf::new(ne * i),
            b2: Buf::new(2 * ne * i),
            st2: Buf::new(2 * ne * i),
            y,
            out,
        }
    }
    pub(super) fn serve(&self, pool: &Pool) {
        let (nt, bar) = (pool.threads(), pool.barrier());
        pool.run(&|tid| match self.isa {
            // SAFETY: the features were detected (`isas`).
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { job_avx512(self, tid, nt, bar) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { job_avx2(self, tid, nt, bar) },
            _ => job(self, tid, nt, bar),
        });
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn job_avx512(c: &Call, tid: usize, nt: usize, bar: &Barrier) {
    job(c, tid, nt, bar)
}
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn job_avx2(c: &Call, tid: usize, nt: usize, bar: &Barrier) {
    job(c, tid, nt, bar)
}

/// B of one 128-K group in mma step order, and per pass [max exponent,
/// min lsb] of its nonzero values (the fast-path bounds).
#[inline(always)]
fn prep(n: usize, v: impl Fn(usize) -> f32, b: *mut f32, st: *mut [i32; 2]) {
    for p in 0..128 / n {
        let mut s = [-BIG, BIG];
        for q in p * n..(p + 1) * n {
            let x = v(perm(q / 16, q % 16));
            // SAFETY: the caller's ranges hold 128 values and 128 / n bounds.
            unsafe { *b.add(q) = x };
            if x != 0.0 {
                s = [s[0].max(lead(x as f64)), s[1].min(lsb(x as f64))];
            }
        }
        // SAFETY: as above.
        unsafe { *st.add(p) = s };
    }
}

/// C of 16 rows of one tile on this call's ISA.
#[inline(always)]
fn tile16(
    c: &Call,
    base: *const u8,
    off: usize,
    rb: usize,
    g: usize,
    b: &Buf<f32>,
    st: &Buf<[i32; 2]>,
) -> [f32; 16] {
    let nb = 128 / c.m.n;
    // SAFETY: b and st hold the group's 128 values / nb bounds at g.
    let (b, st) = unsafe {
        (
            std::slice::from_raw_parts(b.p().add(g * 128), 128),
            std::slice::from_raw_parts(st.p().add(g * nb), nb),
        )
    };
    // SAFETY: 16 rows of 64 bytes at base + off + l * rb lie inside the expert.
    let row = |l: usize| unsafe { std::slice::from_raw_parts(base.add(off + l * rb), 64) };
    // Each row's group chunk is one cache line; fetch the rows' line two
    // groups ahead (16 streams at once defeat the hardware prefetcher).
    #[cfg(target_arch = "x86_64")]
    for l in 0..16 {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: a prefetch never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(off + 128 + l * rb) as *const i8) };
    }
    let mut out = [0f32; 16];
    match c.isa {
        // SAFETY: features detected; rows as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { simd::tile_avx512(&c.m, base, off, rb, b, st, &mut out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe {
            simd::tile_avx2(&c.m, base, off, rb, b, st, &mut out[..8]);
            simd::tile_avx2(&c.m, base, off + 8 * rb, rb, b, st, &mut out[8..]);
        },
        _ => {
            for (l, o) in out.iter_mut().enumerate() {
                *o = tile_row(&c.m, row(l), b, st);
            }
        }
    }
    out
}

/// One call on thread `tid` of `nt`: x permuted | w13 + SwiGLU, 16 act rows
/// per unit | act as bf16 hi / lo permuted | w2 rows and the combine.
#[inline(always)]
fn job(c: &Call, tid: usize, nt: usize, bar: &Barrier) {
    let (lay, h, i, n) = (&c.lay, c.lay.hidden, c.lay.intermediate, c.m.n);
    let (ng, ng2, ne) = (h / 128, i / 128, c.experts.len());
    let part = |units: usize| units * tid / nt..units * (tid + 1) / nt;
    // SAFETY (all `blk`): each expert pointer addresses a whole block.
    let blk =
        |e: usize| unsafe { std::slice::from_raw_parts(c.experts[e].0, lay.w2_s + h * ng2 * 2) };
    for g in part(ng) {
        // SAFETY: group g's ranges.
        prep(
            n,
            |k| c.x[g * 128 + k],
            unsafe { c.b13.p().add(g * 128) },
            unsafe { c.st13.p().add(g * 128 / n) },
        );
    }
    bar.wait();
    let ncl = ng.div_ceil(8);
    for u in part(ne * i / 16) {
        let (e, i0) = (u / (i / 16), u % (i / 16) * 16);
        let (mut gs, mut us) = ([0f32; 16], [0f32; 16]);
        for wp in 0..ng.div_ceil(ncl) {
            let (mut ag, mut au) = ([0f32; 16], [0f32; 16]);
            for g in (wp * ncl..(wp + 1) * ncl).filter(|&g| g < ng) {
                for (acc, r0) in [(&mut ag, i0), (&mut au, i + i0)] {
                    let t = tile16(
                        c,
                        c.experts[e].0,
                        lay.w13_q + r0 * h / 2 + g * 64,
                        h / 2,
                        g,
                        &c.b13,
                        &c.st13,
                    );
                    for l in 0..16 {
                        acc[l] = t[l].mul_add(scale(blk(e), lay.w13_s, (r0 + l) * ng + g), acc[l]);
                    }
                }
            }
            for l in 0..16 {
                gs[l] += ag[l];
                us[l] += au[l];
            }
        }
        for l in 0..16 {
            // SAFETY: this unit's 16 act rows.
            unsafe { *c.act.p().add(e * i + i0 + l) = silu(gs[l], &c.ex2) * us[l] };
        }
    }
    bar.wait();
    for u in part(ne * 2 * ng2) {
        let (e, lo, g) = (u / (2 * ng2), u / ng2 % 2, u % ng2);
        // SAFETY: act is complete (barrier); this unit's ranges.
        let a = |k: usize| unsafe { *c.act.p().add(e * i + g * 128 + k) };
        let v = |k: usize| {
            let hi = bf16::from_f32(a(k)).to_f32();
            if lo == 1 {
                bf16::from_f32(a(k) - hi).to_f32()
            } else {
                hi
            }
        };
        let o = (2 * e + lo) * i + g * 128;
        prep(n, v, unsafe { c.b2.p().add(o) }, unsafe {
            c.st2.p().add(o / n)
        });
    }
    bar.wait();
    for t in part(h / 16) {
        let mut sum = [0f32; 16];
        for (e, &(base, w)) in c.experts.iter().enumerate() {
            let mut ev = [0f32; 16];
            for kp in 0..ng2.div_ceil(2) {
                let mut acc = [0f32; 16];
                for g in (2 * kp..2 * kp + 2).filter(|&g| g < ng2) {
                    let off = lay.w2_q + t * 16 * i / 2 + g * 64;
                    let hi = tile16(c, base, off, i / 2, 2 * e * ng2 + g, &c.b2, &c.st2);
                    let lo = tile16(c, base, off, i / 2, (2 * e + 1) * ng2 + g, &c.b2, &c.st2);
                    for l in 0..16 {
                        acc[l] = scale(blk(e), lay.w2_s, (t * 16 + l) * ng2 + g)
                            .mul_add(hi[l] + lo[l], acc[l]);
                    }
                }
                for l in 0..16 {
                    ev[l] += acc[l];
                }
            }
            for l in 0..16 {
                sum[l] = w.mul_add(ev[l], sum[l]);
            }
        }
        for (l, s) in sum.iter().enumerate() {
            // SAFETY: this unit's 16 outputs.
            unsafe { *c.out.add(t * 16 + l) = 0.0 + s };
        }
    }
}
