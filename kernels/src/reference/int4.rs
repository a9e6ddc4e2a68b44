use half::f16;

use crate::ops::int4::Int4Layout;

/// Quantize `[rows, k]` f32 with the cache's INT4 rule: per `group`
/// elements of a row `s = f16(amax / 7)`,
/// `q = clamp(round_ties_even(w / s) + 8, 0, 15)` (all 8 when `s == 0`).
/// Returns (nibble-packed bytes, f16 scales `[rows, k / group]`).
/// `k` must be a multiple of `group`.
pub fn quantize_rows(w: &[f32], rows: usize, k: usize, group: usize) -> (Vec<u8>, Vec<f16>) {
    assert!(
        group > 0 && k.is_multiple_of(group),
        "k = {k} is not a multiple of the group {group}"
    );
    let mut q = vec![0u8; rows * k / 2];
    let mut s = Vec::with_capacity(rows * k / group);
    for r in 0..rows {
        for g in 0..k / group {
            let grp = &w[r * k + g * group..][..group];
            let amax = grp.iter().fold(0f32, |a, v| a.max(v.abs()));
            let sc = f16::from_f32(amax / 7.0);
            s.push(sc);
            let sf = sc.to_f32();
            for (e, &v) in grp.iter().enumerate() {
                let qv = if sf == 0.0 {
                    8u8
                } else {
                    ((v / sf).round_ties_even() + 8.0).clamp(0.0, 15.0) as u8
                };
                let col = g * group + e;
                let byte = &mut q[r * k / 2 + col / 2];
                *byte |= if col.is_multiple_of(2) { qv } else { qv << 4 };
            }
        }
    }
    (q, s)
}

/// `(q - 8) * s` for a packed `[rows, k]` matrix with `group`-wide scales.
pub fn dequant_rows(q: &[u8], s: &[f16], rows: usize, k: usize, group: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * k);
    for r in 0..rows {
        for col in 0..k {
            let byte = q[r * k / 2 + col / 2];
            let nib = if col % 2 == 0 { byte & 15 } else { byte >> 4 };
            out.push((nib as f32 - 8.0) * s[r * (k / group) + col / group].to_f32());
        }
    }
    out
}

/// Quantize an expert (`w13` f32 `[2I, H]`, `w2` f32 `[H, I]`) into `block`
/// at the layout's offsets, with its group. Returns the dequantized (w13, w2) the GPU sees.
pub fn write_expert(
    block: &mut [u8],
    layout: &Int4Layout,
    w13: &[f32],
    w2: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let (h, i, g) = (layout.hidden, layout.intermediate, layout.group);
    let (q13, s13) = quantize_rows(w13, 2 * i, h, g);
    let (q2, s2) = quantize_rows(w2, h, i, g);
    block[layout.w13_q..][..q13.len()].copy_from_slice(&q13);
    block[layout.w13_s..][..s13.len() * 2].copy_from_slice(bytemuck::cast_slice(&s13));
    block[layout.w2_q..][..q2.len()].copy_from_slice(&q2);
    block[layout.w2_s..][..s2.len() * 2].copy_from_slice(bytemuck::cast_slice(&s2));
    (
        dequant_rows(&q13, &s13, 2 * i, h, g),
        dequant_rows(&q2, &s2, h, i, g),
    )
}

/// Decode FFN of one expert in f64 from dequantized weights:
/// returns (act `[I]` = silu(W1 x) * (W3 x), y `[H]` = W2 act).
pub fn expert_forward(
    w13: &[f32],
    w2: &[f32],
    h: usize,
    i: usize,
    x: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let dot = |row: &[f32], v: &[f32]| {
        row.iter()
            .zip(v)
            .map(|(a, b)| *a as f64 * *b as f64)
            .sum::<f64>()
    };
    let act: Vec<f32> = (0..i)
        .map(|r| {
            let g = dot(&w13[r * h..][..h], x);
            let u = dot(&w13[(i + r) * h..][..h], x);
            (g / (1.0 + (-g).exp()) * u) as f32
        })
        .collect();
    let y = (0..h)
        .map(|n| dot(&w2[n * i..][..i], &act) as f32)
        .collect();
    (act, y)
}
