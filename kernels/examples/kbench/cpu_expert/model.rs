//! The GPU's arithmetic, scalar: the tensor core's sum inside one `mma`
//! (`Model`), `MUFU.EX2` (`Ex2`), SwiGLU's `silu` as compiled, and the decode
//! kernels written out with scalar loops (`expert_ref`).

use half::{bf16, f16};
use krasis_kernels::Int4Layout;

/// Exponent bounds of a pass with no nonzero value: [max exponent, min lsb]
/// start at [-BIG, BIG].
pub(super) const BIG: i32 = 1 << 20;

/// Accumulation inside one tensor-core `mma` (D = C + A.B, 16 products per
/// output), undocumented by NVIDIA, so a parameter: products exact; per pass
/// C and `n` products aligned to the largest exponent `top` (of the values,
/// or with `unnorm` of the factors' exponent sums), bits below
/// 2^(top-23-neab) truncated, the sum rounded once to f32 (RZ or RNE).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Model {
    pub(super) n: usize,
    pub(super) neab: i32,
    pub(super) unnorm: bool,
    pub(super) rz: bool,
}
/// Used without a device (host-only): a guess (one 16-product pass, RZ), unverified.
pub(super) const DEFAULT_MODEL: Model = Model {
    n: 16,
    neab: 3,
    unnorm: false,
    rz: true,
};

pub(super) fn lead(v: f64) -> i32 {
    ((v.to_bits() >> 52) & 0x7ff) as i32 - 1023
}
pub(super) fn lsb(v: f64) -> i32 {
    lead(v) - 52 + ((v.to_bits() & ((1 << 52) - 1)) | 1 << 52).trailing_zeros() as i32
}
pub(super) fn pow2(e: i32) -> f64 {
    f64::from_bits(((e + 1023) as u64) << 52)
}
fn round(m: &Model, v: f64) -> f32 {
    let r = v as f32;
    let up = (r as f64).abs() > v.abs();
    if m.rz && up {
        f32::from_bits(r.to_bits() - 1)
    } else {
        r
    }
}

/// One pass of the model: `c + sum a[k] * b[k]`.
pub(super) fn mma_block(m: &Model, c: f32, a: &[i32], b: &[f64]) -> f32 {
    let terms = a.iter().zip(b).filter(|&(&x, &y)| x != 0 && y != 0.0);
    let top = terms.clone().map(|(&x, &y)| {
        if m.unnorm {
            lead(x as f64) + lead(y)
        } else {
            lead(x as f64 * y)
        }
    });
    let Some(top) = top.chain((c != 0.0).then(|| lead(c as f64))).max() else {
        return c;
    };
    let (l, sc) = (top - 23 - m.neab, pow2(23 + m.neab - top));
    let s = terms.fold((c as f64 * sc).trunc(), |s, (&x, &y)| {
        s + (x as f64 * y * sc).trunc()
    });
    round(m, s * pow2(l))
}

/// Whether a pass's exact sum is the model's result: no term has bits below
/// its window (bounds from |a| <= 8 and `st` = [max exponent, min lsb] of b).
/// Then an f64 sum is exact, one FMA chain serves all 16 rows.
fn fast_ok(m: &Model, c: f32, st: [i32; 2]) -> bool {
    let (ec, lc) = if c == 0.0 {
        (-BIG, BIG)
    } else {
        (lead(c as f64), lsb(c as f64))
    };
    lc.min(st[1]) + 23 + m.neab >= ec.max(st[0] + 3)
}

/// Nibble of lane tq = (k % 8) / 2's word that mma k of half `h` reads:
/// dq8 pairs nibbles j, j+4 in one bf16x2, a0 holds k = 2tq, 2tq+1 (register
/// j = 2h), a2 k = 2tq+8, 2tq+9 (j = 2h+1); perm8 pairs x the same way.
pub(super) fn nu(k: usize, h: usize) -> usize {
    2 * h + k / 8 + 4 * (k % 2)
}
/// K offset in a 128-wide group of k in mma step s (word s / 2 of lane tq).
pub(super) fn perm(s: usize, k: usize) -> usize {
    32 * ((k % 8) / 2) + 8 * (s / 2) + nu(k, s % 2)
}

/// C of one row of a 16 x 128 tile (`row`: its 64 bytes of the group): the
/// 8 chained mma of `tile16` in int4.cu from C = 0, `b` in step order.
pub(super) fn tile_row(m: &Model, row: &[u8], b: &[f32], st: &[[i32; 2]]) -> f32 {
    let nb = 16 / m.n;
    let mut c = 0f32;
    for s in 0..8 {
        let a: [i32; 16] = std::array::from_fn(|k| {
            let o = (k % 8) / 2 * 16 + 4 * (s / 2);
            let w = u32::from_le_bytes([row[o], row[o + 1], row[o + 2], row[o + 3]]);
            ((w >> (4 * nu(k, s % 2))) & 15) as i32 - 8
        });
        for p in 0..nb {
            let r = p * m.n..(p + 1) * m.n;
            let bs: [f64; 16] = std::array::from_fn(|k| b[s * 16 + k] as f64);
            c = if fast_ok(m, c, st[s * nb + p]) {
                round(m, r.fold(c as f64, |acc, k| acc + a[k] as f64 * bs[k]))
            } else {
                mma_block(m, c, &a[r.clone()], &bs[r])
            };
        }
    }
    c
}

/// `MUFU.EX2` (ex2.approx.ftz.f32): a table read from the device when
/// `probe_ex2` finds it a function of the input floored (or rounded) to `f`
/// fraction bits, else 2^r correctly rounded (a stand-in, not the hardware).
pub(super) struct Ex2 {
    pub(super) f: i32,
    pub(super) rint: bool,
    pub(super) table: Vec<f32>,
}
impl Ex2 {
    fn get(&self, r: f32) -> f32 {
        let r = if r.is_subnormal() { 0.0 } else { r };
        let q = r as f64 * pow2(self.f);
        let i = if self.rint {
            q.round_ties_even()
        } else {
            q.floor()
        } + pow2(self.f);
        match self.table.get(i as usize) {
            Some(&e) if i >= 0.0 => e,
            _ => (r as f64).exp2() as f32,
        }
    }
}

/// `silu` of common.cuh as compiled (SASS): expf's range reduction
/// (FFMA.SAT, FFMA.RM, FADD, two FFMA), MUFU.EX2, 2^n * e + 1 in one FFMA,
/// then an IEEE division (prec-div; no fast-math flags).
#[inline(always)]
pub(super) fn silu(g: f32, ex2: &Ex2) -> f32 {
    let ng = -g;
    let t = ng.mul_add(f32::from_bits(0x3bbb_989d), 0.5);
    let t = if t.is_nan() { 0.0 } else { t.clamp(0.0, 1.0) };
    let j = (t as f64 * 252.0 + 12_582_913.0).floor() as f32; // RM; exact in f64
    let n = j - 12_583_039.0;
    let r = ng.mul_add(f32::from_bits(0x3fb8_aa3b), -n);
    let r = ng.mul_add(f32::from_bits(0x32a5_7060), r);
    g / f32::from_bits(j.to_bits() << 23).mul_add(ex2.get(r), 1.0)
}

pub(super) fn scale(blk: &[u8], off: usize, idx: usize) -> f32 {
    f16::from_le_bytes([blk[off + 2 * idx], blk[off + 2 * idx + 1]]).to_f32()
}

/// The decode kernels for one (token, expert) written out from int4.cu with
/// scalar loops and no fast path: each mma's 16 (a, b) from the fragment
/// layout, w13 per warp over its NCL = ceil(H/1024) groups (FFMA from 0),
/// warps summed in order, SwiGLU, act as bf16 hi + lo, w2 items of 2 groups
/// (`int4_w2_combine_1`) summed in K-part order, weighted. Returns (act, y).
pub(super) fn expert_ref(
    m: &Model,
    lay: &Int4Layout,
    blk: &[u8],
    x: &[f32],
    w: f32,
    ex2: &Ex2,
) -> (Vec<f32>, Vec<f32>) {
    let (h, i) = (lay.hidden, lay.intermediate);
    let tile = |q: usize, kw: usize, row: usize, g: usize, bv: &dyn Fn(usize) -> f32| {
        let mut c = 0f32;
        for (wi, half) in (0..4).flat_map(|wi| [(wi, 0), (wi, 1)]) {
            let (mut a, mut b) = ([0i32; 16], [0f64; 16]);
            for k in 0..16 {
                let j = 2 * half + k / 8; // dq8 register: a0 (k < 8) or a2
                let kk = g * 128 + 32 * ((k % 8) / 2) + 8 * wi + j + 4 * (k % 2);
                let byte = blk[q + row * kw / 2 + kk / 2];
                a[k] = (if kk.is_multiple_of(2) {
                    byte & 15
                } else {
                    byte >> 4
                }) as i32
                    - 8;
                b[k] = bv(kk) as f64;
            }
            for p in (0..16).step_by(m.n) {
                c = mma_block(m, c, &a[p..p + m.n], &b[p..p + m.n]);
            }
        }
        c
    };
    let (ng, ng2) = (h / 128, i / 128);
    let ncl = ng.div_ceil(8);
    let act: Vec<f32> = (0..i)
        .map(|r| {
            let (mut gs, mut us) = (0f32, 0f32);
            for wp in 0..ng.div_ceil(ncl) {
                let (mut ag, mut au) = (0f32, 0f32);
                for g in (wp * ncl..(wp + 1) * ncl).filter(|&g| g < ng) {
                    let xs = |k: usize| x[k];
                    ag = tile(lay.w13_q, h, r, g, &xs)
                        .mul_add(scale(blk, lay.w13_s, r * ng + g), ag);
                    let s = scale(blk, lay.w13_s, (i + r) * ng + g);
                    au = tile(lay.w13_q, h, i + r, g, &xs).mul_add(s, au);
                }
                gs += ag;
                us += au;
            }
            silu(gs, ex2) * us
        })
        .collect();
    let hi: Vec<f32> = act.iter().map(|&a| bf16::from_f32(a).to_f32()).collect();
    let lo: Vec<f32> = act
        .iter()
        .zip(&hi)
        .map(|(&a, &b)| bf16::from_f32(a - b).to_f32())
        .collect();
    let y = (0..h)
        .map(|n| {
            let mut e = 0f32;
            for kp in 0..ng2.div_ceil(2) {
                let mut acc = 0f32;
                for g in (2 * kp..2 * kp + 2).filter(|&g| g < ng2) {
                    let c =
                        tile(lay.w2_q, i, n, g, &|k| hi[k]) + tile(lay.w2_q, i, n, g, &|k| lo[k]);
                    acc = scale(blk, lay.w2_s, n * ng2 + g).mul_add(c, acc);
                }
                e += acc;
            }
            0.0 + w.mul_add(e, 0.0)
        })
        .collect();
    (act, y)
}
