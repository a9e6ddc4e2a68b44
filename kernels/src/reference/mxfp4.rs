//! MXFP4 experts on the CPU, written to be obviously correct: the E2M1
//! table, the E8M0 scale as a power of two, the two activations, and the
//! expert FFN in f64 over the decoded weights, per token (the decode
//! GEMVs) and over rows grouped by expert (the grouped prefill GEMMs).

use half::bf16;

use crate::ops::mxfp4::{ExpertActivation, Mxfp4Layout};

/// E2M1 code (0..=15) to value; bit 3 is the sign (code 8 is -0).
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// E8M0 scale byte to its value: `2^(s - 127)`, NaN for 255 (OCP MX v1.0).
pub fn e8m0(s: u8) -> f32 {
    if s == 255 {
        f32::NAN
    } else {
        // Exact: 2^(s-127) is >= 2^-127, representable in f32 (as a
        // subnormal for s = 0), and powi of 2 in f64 is exact.
        2f64.powi(i32::from(s) - 127) as f32
    }
}

/// Decode a `[rows, k]` MXFP4 matrix: element `c` of row `r` is
/// `E2M1[nibble] * e8m0(s[r, c/32])`, the nibble of byte `c/2` (low for
/// even `c`). Every value is exact in f32 (or NaN for scale 255).
pub fn mxfp4_decode_rows(q: &[u8], s: &[u8], rows: usize, k: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * k);
    for r in 0..rows {
        for c in 0..k {
            let byte = q[r * k / 2 + c / 2];
            let code = if c % 2 == 0 { byte & 15 } else { byte >> 4 };
            out.push(E2M1[code as usize] * e8m0(s[r * (k / 32) + c / 32]));
        }
    }
    out
}

/// The activation of one (gate, up) pair, in f64.
pub fn expert_activation(a: ExpertActivation, gate: f64, up: f64) -> f64 {
    let sigmoid = |z: f64| 1.0 / (1.0 + (-z).exp());
    match a {
        ExpertActivation::Swiglu => gate * sigmoid(gate) * up,
        ExpertActivation::ClampedSwiglu { limit, alpha } => {
            let l = limit as f64;
            // Written with comparisons so a NaN stays NaN, as in torch.clamp.
            let g = if gate > l { l } else { gate };
            let u = if up > l {
                l
            } else if up < -l {
                -l
            } else {
                up
            };
            (u + 1.0) * g * sigmoid(alpha as f64 * g)
        }
    }
}

/// One MXFP4 expert on the host, in cache order (w13 rows `0..I` gate,
/// `I..2I` up). Biases are empty when the architecture has none.
#[derive(Debug, Clone, Default)]
pub struct Mxfp4Expert {
    pub w13_q: Vec<u8>,
    pub w13_s: Vec<u8>,
    pub w13_b: Vec<bf16>,
    pub w2_q: Vec<u8>,
    pub w2_s: Vec<u8>,
    pub w2_b: Vec<bf16>,
}

/// An expert's decoded weights: w13 `[2I, H]`, w2 `[H, I]`, biases as f32
/// (zeros without biases).
#[derive(Debug, Clone)]
pub struct Mxfp4Decoded {
    pub w13: Vec<f32>,
    pub w2: Vec<f32>,
    pub b13: Vec<f32>,
    pub b2: Vec<f32>,
}

impl Mxfp4Expert {
    /// Copy the arrays into `block` at the layout's offsets.
    pub fn write(&self, block: &mut [u8], l: &Mxfp4Layout) {
        block[l.w13_q..][..self.w13_q.len()].copy_from_slice(&self.w13_q);
        block[l.w13_s..][..self.w13_s.len()].copy_from_slice(&self.w13_s);
        block[l.w2_q..][..self.w2_q.len()].copy_from_slice(&self.w2_q);
        block[l.w2_s..][..self.w2_s.len()].copy_from_slice(&self.w2_s);
        if l.has_bias {
            let b13: &[u8] = bytemuck::cast_slice(&self.w13_b);
            let b2: &[u8] = bytemuck::cast_slice(&self.w2_b);
            block[l.w13_b..][..b13.len()].copy_from_slice(b13);
            block[l.w2_b..][..b2.len()].copy_from_slice(b2);
        }
    }

    pub fn decode(&self, l: &Mxfp4Layout) -> Mxfp4Decoded {
        let (h, i) = (l.hidden, l.intermediate);
        let bias = |b: &[bf16], n: usize| {
            if l.has_bias {
                b.iter().map(|v| v.to_f32()).collect()
            } else {
                vec![0.0; n]
            }
        };
        Mxfp4Decoded {
            w13: mxfp4_decode_rows(&self.w13_q, &self.w13_s, 2 * i, h),
            w2: mxfp4_decode_rows(&self.w2_q, &self.w2_s, h, i),
            b13: bias(&self.w13_b, 2 * i),
            b2: bias(&self.w2_b, h),
        }
    }
}

/// Decode FFN of one expert in f64 from decoded weights: returns
/// (act `[I]` = activation(W1 x + b1, W3 x + b3), y `[H]` = W2 act + b2).
pub fn mxfp4_expert_forward(
    d: &Mxfp4Decoded,
    h: usize,
    i: usize,
    x: &[f32],
    a: ExpertActivation,
) -> (Vec<f32>, Vec<f32>) {
    let dot = |row: &[f32], v: &[f32]| {
        row.iter()
            .zip(v)
            .map(|(p, q)| *p as f64 * *q as f64)
            .sum::<f64>()
    };
    let act: Vec<f32> = (0..i)
        .map(|r| {
            let g = dot(&d.w13[r * h..][..h], x) + d.b13[r] as f64;
            let u = dot(&d.w13[(i + r) * h..][..h], x) + d.b13[i + r] as f64;
            expert_activation(a, g, u) as f32
        })
        .collect();
    let y = (0..h)
        .map(|n| (dot(&d.w2[n * i..][..i], &act) + d.b2[n] as f64) as f32)
        .collect();
    (act, y)
}

/// The grouped prefill gate/up GEMM with bias and activation
/// (`Kernels::mxfp4_grouped_w13_act`) in f64: rows
/// `offsets[e]..offsets[e + 1]` of `x` (`[rows, H]`) are expert `e`'s,
/// `act[r, i] = activation(W13_e[i] · x[r] + b13_e[i], W13_e[I + i] · x[r] + b13_e[I + i])`
/// (before the kernel's bf16 rounding). `experts[e]`: `None` for an expert
/// missing from the pointer table, whose rows are NaN. Each expert with rows
/// is decoded once, one at a time (gpt-oss-sized experts are 100 MB each
/// decoded).
pub fn mxfp4_grouped_w13_act(
    experts: &[Option<&Mxfp4Expert>],
    l: &Mxfp4Layout,
    x: &[f32],
    offsets: &[u32],
    a: ExpertActivation,
) -> Vec<f32> {
    let (h, i) = (l.hidden, l.intermediate);
    grouped_rows(experts, l, x, h, offsets, i, |d, xr, out| {
        for (c, o) in out.iter_mut().enumerate() {
            let g = dot(&d.w13[c * h..][..h], xr) + d.b13[c] as f64;
            let u = dot(&d.w13[(i + c) * h..][..h], xr) + d.b13[i + c] as f64;
            *o = expert_activation(a, g, u) as f32;
        }
    })
}

/// The grouped prefill down GEMM with bias (`Kernels::mxfp4_grouped_w2`)
/// in f64: `y[r, n] = W2_e[n] · act[r] + b2_e[n]` for the rows of each
/// expert `e` (`act` `[rows, I]`, `y` `[rows, H]`); NaN rows for a missing
/// expert, as [`mxfp4_grouped_w13_act`].
pub fn mxfp4_grouped_w2(
    experts: &[Option<&Mxfp4Expert>],
    l: &Mxfp4Layout,
    act: &[f32],
    offsets: &[u32],
) -> Vec<f32> {
    let (h, i) = (l.hidden, l.intermediate);
    grouped_rows(experts, l, act, i, offsets, h, |d, ar, out| {
        for (n, o) in out.iter_mut().enumerate() {
            *o = (dot(&d.w2[n * i..][..i], ar) + d.b2[n] as f64) as f32;
        }
    })
}

fn dot(w: &[f32], x: &[f32]) -> f64 {
    w.iter().zip(x).map(|(p, q)| *p as f64 * *q as f64).sum()
}

/// Output `[rows, n_out]` of `row` applied to every grouped row of `input`
/// (`[rows, k]`) with its expert's decoded weights.
fn grouped_rows(
    experts: &[Option<&Mxfp4Expert>],
    l: &Mxfp4Layout,
    input: &[f32],
    k: usize,
    offsets: &[u32],
    n_out: usize,
    row: impl Fn(&Mxfp4Decoded, &[f32], &mut [f32]),
) -> Vec<f32> {
    assert_eq!(offsets.len(), experts.len() + 1, "offsets are [E + 1]");
    assert!(
        offsets.windows(2).all(|w| w[0] <= w[1]),
        "offsets must not decrease"
    );
    let rows = offsets[experts.len()] as usize;
    assert_eq!(input.len(), rows * k, "input is not [rows, {k}]");
    let mut out = vec![f32::NAN; rows * n_out];
    for (e, ex) in experts.iter().enumerate() {
        let (a, b) = (offsets[e] as usize, offsets[e + 1] as usize);
        let Some(ex) = ex.filter(|_| b > a) else {
            continue;
        };
        let d = ex.decode(l);
        for r in a..b {
            row(&d, &input[r * k..][..k], &mut out[r * n_out..][..n_out]);
        }
    }
    out
}
