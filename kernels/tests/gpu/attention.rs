use half::{bf16, f16};
use krasis_kernels::{
    Act16, KvBase, KvGeom, QkvGeom, StartPos, decode_workspace_len, reference as cpu,
};

use crate::common::*;

mod hopper;
mod ring;

/// Random cache contents for positions `0..start`, plus random QKV for the
/// new tokens appended at `start..start + n_tokens`.
struct Case<A> {
    kv: KvGeom,
    start: usize,
    qkv: Vec<A>,
    kc: Vec<A>,
    vc: Vec<A>,
}

fn case<A: Act16>(
    rng: &mut rand::rngs::StdRng,
    geom: QkvGeom,
    start: usize,
    capacity: usize,
) -> Case<A> {
    let kv = KvGeom {
        n_kv_heads: geom.n_kv_heads,
        head_dim: geom.head_dim,
        capacity,
    };
    let qkv = randn_act::<A>(rng, geom.len(), 1.0);
    let mut kc = vec![A::from_f32(f32::NAN); kv.len()];
    let mut vc = vec![A::from_f32(f32::NAN); kv.len()];
    let d = geom.head_dim;
    for h in 0..kv.n_kv_heads {
        let base = h * capacity * d;
        let k = randn_act::<A>(rng, start * d, 1.0);
        let v = randn_act::<A>(rng, start * d, 1.0);
        kc[base..base + start * d].copy_from_slice(&k);
        vc[base..base + start * d].copy_from_slice(&v);
    }
    cpu::kv_append(&qkv, geom, start as u32, kv, &mut kc, &mut vc);
    Case {
        kv,
        start,
        qkv,
        kc,
        vc,
    }
}

/// Reference output rows `rows` of a prefill (the cache already holds every
/// position, so a window of queries is a prefill of its own at a later start).
fn reference_rows<A: Act16>(
    c: &Case<A>,
    geom: QkvGeom,
    rows: std::ops::Range<usize>,
    scale: f32,
) -> Vec<f32> {
    let rs = geom.row_stride();
    let g = QkvGeom {
        n_tokens: rows.len(),
        ..geom
    };
    let q = &c.qkv[rows.start * rs..rows.end * rs];
    cpu::attention(q, g, c.start + rows.start, c.kv, &c.kc, &c.vc, scale)
}

/// Tensor-core prefill (D 64/128/256) and the SIMT kernel against the CPU
/// reference and against each other: chunked prefill (start > 0), n_tokens
/// not a multiple of the 64-row tile, GQA groups 1..16, T up to 1500.
/// Outputs are NaN-poisoned with a poisoned guard past the last row (rows
/// past n_tokens must not be stored), and a second launch must match bit
/// for bit (fixed reduction order).
#[test]
fn attention_prefill_matches_reference() {
    prefill_matches_reference::<bf16>("attention_prefill_matches_reference");
}

/// The FP16 entry points (`_f16`: f16 q/K/V, f16 MMAs and P) on the same
/// cases (every head dim of the bf16 kernels).
#[test]
fn attention_prefill_f16_matches_reference() {
    prefill_matches_reference::<f16>("attention_prefill_f16_matches_reference");
}

fn prefill_matches_reference<A: Act16>(name: &str) {
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    // (head_dim, n_tokens, start, n_q_heads, n_kv_heads)
    for (d, t, start, nq, nkv) in [
        (128usize, 150usize, 70usize, 8usize, 2usize),
        (128, 64, 0, 8, 2),
        (128, 1, 300, 8, 2),
        (128, 1000, 500, 16, 2),
        (128, 129, 63, 16, 1),
        (64, 77, 20, 8, 2),
        (64, 1, 0, 4, 4),
        (64, 200, 0, 16, 1),
        (64, 1100, 300, 16, 8),
        (256, 77, 20, 16, 2),
        (256, 1, 0, 2, 2),
        (256, 64, 64, 2, 1),
        (256, 130, 1000, 4, 4),
        (256, 300, 129, 16, 1),
        (256, 1500, 37, 16, 2),
    ] {
        let geom = QkvGeom {
            n_tokens: t,
            n_q_heads: nq,
            n_kv_heads: nkv,
            head_dim: d,
        };
        let what = format!("d={d} T={t} start={start} nq={nq} nkv={nkv} f16={}", A::F16);
        let c = case::<A>(&mut rng, geom, start, start + t + 13);
        let scale = 1.0 / (d as f32).sqrt();
        let (q, k, v) = (up(&s, &c.qkv), up(&s, &c.kc), up(&s, &c.vc));
        let n = t * nq * d;
        let guard = 64 * nq * d;
        let run = |simt: bool| {
            let label = format!("prefill {what} simt={simt}");
            guarded_bf16(&s, n, guard, &label, |out| {
                if simt {
                    g.kernels
                        .attention_prefill_simt(&s, &q, geom, start, c.kv, 0, &k, &v, scale, out)
                        .unwrap();
                } else {
                    g.kernels
                        .attention_prefill(&s, &q, geom, start, c.kv, 0, &k, &v, scale, out)
                        .unwrap();
                }
            })
        };
        let mma = run(false);
        let simt = run(true);
        assert!(
            run(false)
                .iter()
                .zip(&mma)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "prefill {what}: two launches differ"
        );
        // The whole output for small cases; for long ones the first rows and
        // the last 70 (the longest contexts, across a 64-row tile edge); the
        // SIMT comparison below covers every row.
        let windows: Vec<std::ops::Range<usize>> = if t <= 300 {
            std::iter::once(0..t).collect()
        } else {
            vec![0..20, t - 70..t]
        };
        let row = nq * d;
        for w in windows {
            let want = reference_rows(&c, geom, w.clone(), scale);
            let span = w.start * row..w.end * row;
            assert_close(
                &format!("prefill mma {what} rows {w:?}"),
                &mma[span.clone()],
                &want,
                1e-2,
            );
            assert_close(
                &format!("prefill simt {what} rows {w:?}"),
                &simt[span],
                &want,
                5e-3,
            );
        }
        assert_close(&format!("prefill mma vs simt {what}"), &mma, &simt, 1e-2);
    }
}

#[test]
fn attention_decode_matches_reference() {
    decode_matches_reference::<bf16>("attention_decode_matches_reference");
}

/// The FP16 split kernel (`attn_decode_split_f16`) on the same cases.
#[test]
fn attention_decode_f16_matches_reference() {
    decode_matches_reference::<f16>("attention_decode_f16_matches_reference");
}

fn decode_matches_reference<A: Act16>(name: &str) {
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let cases = [
        (5usize, 64usize, false, 32usize, 4usize, 128usize),
        (2500, 3000, false, 32, 4, 128),
        (2500, 3000, true, 32, 4, 128),
        (0, 8, true, 32, 4, 128),
        (700, 1000, false, 16, 1, 128),
        (333, 400, true, 8, 2, 64),
        (150, 200, false, 8, 1, 256),
        // Device positions: the kernels spread the live keys over the
        // splits (tile-aligned chunks), short contexts in a long capacity
        // and the edges of a 64-key tile included.
        (1000, 32768, true, 32, 4, 128),
        (63, 4096, true, 32, 4, 128),
        (64, 4096, true, 32, 4, 128),
        (4095, 4096, true, 16, 2, 256),
    ];
    for (pos, capacity, device_pos, nq, nkv, d) in cases {
        let geom = QkvGeom {
            n_tokens: 1,
            n_q_heads: nq,
            n_kv_heads: nkv,
            head_dim: d,
        };
        let c = case::<A>(&mut rng, geom, pos, capacity);
        let scale = 0.088;
        let want = cpu::attention(&c.qkv, geom, pos, c.kv, &c.kc, &c.vc, scale);
        let (q, k, v) = (up(&s, &c.qkv), up(&s, &c.kc), up(&s, &c.vc));
        let mut ws = poison_f32(&s, decode_workspace_len(nq, d));
        let mut out = poison_bf16(&s, nq * d);
        let pos_buf = up(&s, &[pos as u32]);
        let sp = if device_pos {
            StartPos::Device(&pos_buf)
        } else {
            StartPos::Host(pos as u32)
        };
        g.kernels
            .attention_decode(
                &s,
                &q,
                geom,
                sp,
                c.kv,
                KvBase::Host(0),
                &k,
                &v,
                scale,
                &mut ws,
                &mut out,
            )
            .unwrap();
        assert_close(
            &format!(
                "decode pos={pos} device={device_pos} nq={nq} nkv={nkv} d={d} f16={}",
                A::F16
            ),
            &f32s(&down(&s, &out)),
            &want,
            5e-3,
        );
    }
    // A GQA group whose q (group x head_dim values) would not fit the
    // split kernel's staging is refused before anything runs, and so is a
    // qkv view that is not 16-byte aligned (its q is read as vectors).
    let geom = QkvGeom {
        n_tokens: 1,
        n_q_heads: 16,
        n_kv_heads: 1,
        head_dim: 256,
    };
    let c = case::<A>(&mut rng, geom, 10, 64);
    let (q, k, v) = (up(&s, &c.qkv), up(&s, &c.kc), up(&s, &c.vc));
    let mut ws = poison_f32(&s, decode_workspace_len(16, 256));
    let mut out = poison_bf16(&s, 16 * 256);
    let err = g
        .kernels
        .attention_decode(
            &s,
            &q,
            geom,
            StartPos::Host(10),
            c.kv,
            KvBase::Host(0),
            &k,
            &v,
            0.06,
            &mut ws,
            &mut out,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("q values"), "{err}");
    let geom = QkvGeom {
        n_tokens: 1,
        n_q_heads: 8,
        n_kv_heads: 1,
        head_dim: 64,
    };
    let c = case::<A>(&mut rng, geom, 10, 64);
    let mut padded = vec![c.qkv[0]];
    padded.extend_from_slice(&c.qkv);
    let (q, k, v) = (up(&s, &padded), up(&s, &c.kc), up(&s, &c.vc));
    let mut ws = poison_f32(&s, decode_workspace_len(8, 64));
    let mut out = poison_bf16(&s, 8 * 64);
    let err = g
        .kernels
        .attention_decode(
            &s,
            &q.slice(1..),
            geom,
            StartPos::Host(10),
            c.kv,
            KvBase::Host(0),
            &k,
            &v,
            0.06,
            &mut ws,
            &mut out,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("16-byte aligned"), "{err}");
}

/// The prefix cache's premise for attention (design header of
/// `attention_prefill.cu`, "Chunk invariance"): a query row's output is the
/// same bits whichever prefill chunk holds it and wherever that chunk
/// starts. One launch over every row against chunkings with starts that
/// are not multiples of the 64-row tile (and single rows), both formats,
/// every head dim of the mma kernel and the SIMT kernel.
#[test]
fn attention_prefill_rows_are_chunk_invariant() {
    rows_are_chunk_invariant::<bf16>("attention_prefill_rows_are_chunk_invariant");
    rows_are_chunk_invariant::<f16>("attention_prefill_rows_are_chunk_invariant (f16)");
}

fn rows_are_chunk_invariant<A: Act16>(name: &str) {
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let t = 300usize;
    // Chunk boundaries over 0..t: one chunk, tile-aligned, odd starts
    // (what a resume at a block boundary followed by chunks gives), and
    // single rows around a tile edge.
    let chunkings: [&[usize]; 4] = [
        &[0, 64, 128, 192, 256, 300],
        &[0, 37, 100, 163, 290, 300],
        &[0, 1, 2, 63, 64, 65, 130, 131, 299, 300],
        &[0, 256, 299, 300],
    ];
    for (d, nq, nkv) in [(64usize, 8usize, 2usize), (128, 16, 2), (256, 4, 1)] {
        let geom = QkvGeom {
            n_tokens: t,
            n_q_heads: nq,
            n_kv_heads: nkv,
            head_dim: d,
        };
        let c = case::<A>(&mut rng, geom, 0, t + 11);
        let scale = 1.0 / (d as f32).sqrt();
        let (k, v) = (up(&s, &c.kc), up(&s, &c.vc));
        let rs = geom.row_stride();
        let row = nq * d;
        for simt in [false, true] {
            let run = |a: usize, b: usize| {
                let q = up(&s, &c.qkv[a * rs..b * rs]);
                let gg = QkvGeom {
                    n_tokens: b - a,
                    ..geom
                };
                let mut out = poison_bf16(&s, (b - a) * row);
                if simt {
                    g.kernels
                        .attention_prefill_simt(&s, &q, gg, a, c.kv, 0, &k, &v, scale, &mut out)
                        .unwrap();
                } else {
                    g.kernels
                        .attention_prefill(&s, &q, gg, a, c.kv, 0, &k, &v, scale, &mut out)
                        .unwrap();
                }
                down(&s, &out)
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<u16>>()
            };
            let whole = run(0, t);
            for bounds in chunkings {
                let mut got = Vec::with_capacity(whole.len());
                for w in bounds.windows(2) {
                    got.extend(run(w[0], w[1]));
                }
                let first =
                    (0..t).find(|&r| got[r * row..(r + 1) * row] != whole[r * row..(r + 1) * row]);
                assert!(
                    first.is_none(),
                    "{name}: d={d} nq={nq} nkv={nkv} simt={simt} chunks {bounds:?}: row {:?} \
                     differs from the one-chunk prefill",
                    first
                );
            }
        }
    }
}
