//! gpt-oss attention (sinks, sliding window, ring-indexed KV cache) against
//! the CPU reference, driven like the engine drives a layer: chunks are
//! appended to the ring, then attend; decode steps are chunks of one.

use half::{bf16, f16};
use krasis_kernels::ops::attention::{RingAttn, ring_min_capacity};
use krasis_kernels::{
    Act16, KvBase, KvGeom, QkvGeom, StartPos, decode_workspace_len, reference as cpu,
};
use rand::Rng;

use crate::common::*;

/// gpt-oss-20b's attention heads.
const NQ: usize = 64;
const NKV: usize = 8;
/// gpt-oss's sliding window.
const WINDOW: usize = 128;
/// Chunk sizes of one run: 601 positions, chunks crossing the window and
/// tile edges, single tokens between them (decoded as well as prefilled).
const CHUNKS: &[usize] = &[100, 77, 1, 150, 1, 1, 64, 200, 1, 5, 1];

fn geom(n_tokens: usize, d: usize) -> QkvGeom {
    geom_heads(n_tokens, d, NQ, NKV)
}

fn geom_heads(n_tokens: usize, d: usize, nq: usize, nkv: usize) -> QkvGeom {
    QkvGeom {
        n_tokens,
        n_q_heads: nq,
        n_kv_heads: nkv,
        head_dim: d,
    }
}

fn scale(d: usize) -> f32 {
    1.0 / (d as f32).sqrt()
}

/// Sinks in [-2, 6): with unit-variance scores over a 128-key window the
/// sink's share ranges from negligible to most of the row, so a dropped or
/// doubled sink fails every tolerance below.
fn sinks(rng: &mut rand::rngs::StdRng) -> Vec<f32> {
    (0..NQ).map(|_| rng.random_range(-2.0f32..6.0)).collect()
}

/// The CPU side of one run: ring caches (NaN-poisoned where unwritten, so a
/// kernel reading a row outside the live window shows up as NaN) and the
/// QKV of each chunk.
struct Mirror<A = bf16> {
    kv: KvGeom,
    kc: Vec<A>,
    vc: Vec<A>,
}

impl<A: Act16> Mirror<A> {
    fn new(d: usize, capacity: usize) -> Self {
        Self::with_heads(d, capacity, NKV)
    }

    fn with_heads(d: usize, capacity: usize, nkv: usize) -> Self {
        let kv = KvGeom {
            n_kv_heads: nkv,
            head_dim: d,
            capacity,
        };
        Mirror {
            kv,
            kc: vec![A::from_f32(f32::NAN); kv.len()],
            vc: vec![A::from_f32(f32::NAN); kv.len()],
        }
    }

    fn append(&mut self, qkv: &[A], g: QkvGeom, start: usize) {
        cpu::kv_append_ring(qkv, g, start, self.kv, &mut self.kc, &mut self.vc);
    }

    fn want(&self, qkv: &[A], g: QkvGeom, start: usize, s: Option<&[f32]>, w: usize) -> Vec<f32> {
        let sc = scale(g.head_dim);
        cpu::attention_ring(qkv, g, start, self.kv, &self.kc, &self.vc, sc, s, w)
    }
}

/// The test data tells a correct kernel from the likely wrong ones: over
/// the run below, a window one key too wide or too narrow, a missing sink
/// and an ignored window each miss the reference by more than twice the
/// loosest tolerance the GPU tests use (1e-2). (A kernel reading a row that
/// does not hold the key it wants reads the NaN poison of an unwritten row
/// or another position's key; the first fails `assert_close` outright.)
/// Runs without a GPU, on one GQA group (8 q heads) to keep it quick.
#[test]
fn ring_test_data_exposes_wrong_masks_and_sinks() {
    let mut rng = rng("ring_test_data_exposes_wrong_masks_and_sinks");
    let d = 64;
    let s = sinks(&mut rng);
    let cap = ring_min_capacity(WINDOW, 200);
    let mut m = Mirror::<bf16>::with_heads(d, cap, 1);
    let mut lin = Mirror::<bf16>::with_heads(d, CHUNKS.iter().sum(), 1);
    let mut start = 0;
    let (mut want, mut wide, mut narrow, mut nosink, mut linear) =
        (vec![], vec![], vec![], vec![], vec![]);
    for &n in CHUNKS {
        let g = geom_heads(n, d, NQ / NKV, 1);
        let qkv = randn_bf16(&mut rng, g.len(), 1.0);
        m.append(&qkv, g, start);
        lin.append(&qkv, g, start);
        want.extend(m.want(&qkv, g, start, Some(&s), WINDOW));
        wide.extend(m.want(&qkv, g, start, Some(&s), WINDOW + 1));
        narrow.extend(m.want(&qkv, g, start, Some(&s), WINDOW - 1));
        nosink.extend(m.want(&qkv, g, start, None, WINDOW));
        // A full layer's answer: what a kernel ignoring the window gives.
        linear.extend(lin.want(&qkv, g, start, Some(&s), 0));
        start += n;
    }
    let rel = |got: &[f32]| {
        let (num, den) = got
            .iter()
            .zip(&want)
            .fold((0f64, 0f64), |(n, d), (&g, &w)| {
                let e = (g - w) as f64;
                (n + e * e, d + (w as f64) * (w as f64))
            });
        (num / den).sqrt()
    };
    for (what, got) in [
        ("window + 1", &wide),
        ("window - 1", &narrow),
        ("no sinks", &nosink),
        ("no window", &linear),
    ] {
        let r = rel(got);
        eprintln!("{what}: rel {r:.3e}");
        assert!(r > 2e-2, "{what} is within {r:.1e} of the reference");
    }
}

/// Prefill (tensor-core and SIMT) and decode (host and device position) of
/// gpt-oss layers against the CPU reference: head_dim 64 and 128, GQA 8,
/// sliding (window 128, ring of the smallest allowed and of a rounded-up
/// capacity, wrapping) and full (capacity = context) layers, with and
/// without sinks. After every append the device ring must equal the CPU
/// ring bit for bit (NaN poison included: nothing else is written).
#[test]
fn attention_ring_matches_reference() {
    ring_matches_reference::<bf16>("attention_ring_matches_reference");
}

/// The FP16 ring entry points (`_f16`) on the same runs: the path gpt-oss
/// takes (`ActFormat::F16`).
#[test]
fn attention_ring_f16_matches_reference() {
    ring_matches_reference::<f16>("attention_ring_f16_matches_reference");
}

fn ring_matches_reference<A: Act16>(name: &str) {
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let total: usize = CHUNKS.iter().sum();
    let max_chunk = *CHUNKS.iter().max().unwrap();
    for d in [64usize, 128] {
        for (window, cap) in [
            (WINDOW, ring_min_capacity(WINDOW, max_chunk)),
            (
                WINDOW,
                ring_min_capacity(WINDOW, max_chunk).next_multiple_of(64),
            ),
            (0, total),
        ] {
            for with_sinks in [true, false] {
                let what = format!(
                    "d={d} window={window} cap={cap} sinks={with_sinks} f16={}",
                    A::F16
                );
                let sink_vals = sinks(&mut rng);
                let sinks_host = with_sinks.then_some(&sink_vals[..]);
                let sinks_dev = up(&s, &sink_vals);
                // The full layer in linear rows (ring 0), as the engine
                // has it; the sliding ones in a ring of the whole buffer.
                let attn = RingAttn {
                    sinks: with_sinks.then_some(&sinks_dev),
                    window,
                    ring: if window == 0 { 0 } else { cap },
                };
                run_layer::<A>(g, &s, &mut rng, &what, d, cap, attn, sinks_host);
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn run_layer<A: Act16>(
    g: &Gpu,
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    rng: &mut rand::rngs::StdRng,
    what: &str,
    d: usize,
    cap: usize,
    attn: RingAttn<'_>,
    sinks_host: Option<&[f32]>,
) {
    let k = &g.kernels;
    let mut m = Mirror::<A>::new(d, cap);
    let mut kc = up(s, &m.kc);
    let mut vc = up(s, &m.vc);
    let mut ws = poison_f32(s, decode_workspace_len(NQ, d));
    let sc = scale(d);
    let mut start = 0;
    for (i, &n) in CHUNKS.iter().enumerate() {
        let geo = geom(n, d);
        let qkv = randn_act::<A>(rng, geo.len(), 1.0);
        let q = up(s, &qkv);
        m.append(&qkv, geo, start);
        // Alternate host and device positions for the append.
        // Device positions: one per token of the chunk.
        let pos_buf = up(s, &(start as u32..(start + n) as u32).collect::<Vec<u32>>());
        let sp = if i % 2 == 0 {
            StartPos::Host(start as u32)
        } else {
            StartPos::Device(&pos_buf)
        };
        k.kv_append_ring(
            s,
            &q,
            geo,
            sp,
            m.kv,
            KvBase::Host(0),
            attn.ring,
            &mut kc,
            &mut vc,
        )
        .unwrap();
        let (gk, gv) = (down(s, &kc), down(s, &vc));
        let same = |a: &[A], b: &[A]| {
            a.iter()
                .zip(b)
                .all(|(x, y)| x.to_f32().to_bits() == y.to_f32().to_bits())
        };
        assert!(
            same(&gk, &m.kc) && same(&gv, &m.vc),
            "{what} chunk {i} at {start}: device ring differs from the reference ring"
        );

        let want = m.want(&qkv, geo, start, sinks_host, attn.window);
        let here = format!("{what} chunk {i} (n={n} at {start})");
        let mut out = poison_bf16(s, n * NQ * d);
        k.attention_prefill_ring(s, &q, geo, start, m.kv, 0, &kc, &vc, sc, attn, &mut out)
            .unwrap();
        assert_close(
            &format!("prefill mma {here}"),
            &f32s(&down(s, &out)),
            &want,
            1e-2,
        );
        let mut out = poison_bf16(s, n * NQ * d);
        k.attention_prefill_simt_ring(s, &q, geo, start, m.kv, 0, &kc, &vc, sc, attn, &mut out)
            .unwrap();
        assert_close(
            &format!("prefill simt {here}"),
            &f32s(&down(s, &out)),
            &want,
            5e-3,
        );
        if n == 1 {
            for device in [false, true] {
                let sp = if device {
                    StartPos::Device(&pos_buf)
                } else {
                    StartPos::Host(start as u32)
                };
                let mut out = poison_bf16(s, NQ * d);
                k.attention_decode_ring(
                    s,
                    &q,
                    geo,
                    sp,
                    m.kv,
                    KvBase::Host(0),
                    &kc,
                    &vc,
                    sc,
                    attn,
                    &mut ws,
                    &mut out,
                )
                .unwrap();
                assert_close(
                    &format!("decode device={device} {here}"),
                    &f32s(&down(s, &out)),
                    &want,
                    5e-3,
                );
            }
        }
        start += n;
    }
}

/// Decode only, as after a prompt: a 128-row ring (the decode minimum)
/// wrapped about five times, every step appended and decoded with host and
/// device positions, sinks on; the early steps have fewer keys than the
/// window. Checks every step up to 300, then every 7th.
#[test]
fn attention_decode_ring_wraps() {
    decode_ring_wraps::<bf16>("attention_decode_ring_wraps");
}

/// The same with the FP16 split kernel (`attn_decode_split_ring_f16`).
#[test]
fn attention_decode_ring_f16_wraps() {
    decode_ring_wraps::<f16>("attention_decode_ring_f16_wraps");
}

fn decode_ring_wraps<A: Act16>(name: &str) {
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let k = &g.kernels;
    for d in [64usize, 128] {
        let cap = ring_min_capacity(WINDOW, 1);
        let mut m = Mirror::<A>::new(d, cap);
        let (mut kc, mut vc) = (up(&s, &m.kc), up(&s, &m.vc));
        let mut ws = poison_f32(&s, decode_workspace_len(NQ, d));
        let sink_vals = sinks(&mut rng);
        let sinks_dev = up(&s, &sink_vals);
        let attn = RingAttn {
            sinks: Some(&sinks_dev),
            window: WINDOW,
            ring: cap,
        };
        let geo = geom(1, d);
        for pos in 0..650usize {
            let qkv = randn_act::<A>(&mut rng, geo.len(), 1.0);
            let q = up(&s, &qkv);
            m.append(&qkv, geo, pos);
            let pos_buf = up(&s, &[pos as u32]);
            k.kv_append_ring(
                &s,
                &q,
                geo,
                StartPos::Device(&pos_buf),
                m.kv,
                KvBase::Host(0),
                cap,
                &mut kc,
                &mut vc,
            )
            .unwrap();
            if pos > 300 && pos % 7 != 0 {
                continue;
            }
            let want = m.want(&qkv, geo, pos, Some(&sink_vals), WINDOW);
            for device in [false, true] {
                let sp = if device {
                    StartPos::Device(&pos_buf)
                } else {
                    StartPos::Host(pos as u32)
                };
                let mut out = poison_bf16(&s, NQ * d);
                k.attention_decode_ring(
                    &s,
                    &q,
                    geo,
                    sp,
                    m.kv,
                    KvBase::Host(0),
                    &kc,
                    &vc,
                    scale(d),
                    attn,
                    &mut ws,
                    &mut out,
                )
                .unwrap();
                assert_close(
                    &format!("decode d={d} pos={pos} device={device} f16={}", A::F16),
                    &f32s(&down(&s, &out)),
                    &want,
                    5e-3,
                );
            }
        }
    }
}

/// The wrappers refuse what the ring cannot hold, and accept the smallest
/// ring that can (a refused launch never reaches the GPU).
#[test]
fn attention_ring_refuses_a_ring_too_small_for_the_window() {
    let name = "attention_ring_refuses_a_ring_too_small_for_the_window";
    let Some((g, s)) = gpu(name) else { return };
    let k = &g.kernels;
    let d = 64;
    let n = 64;
    let need = ring_min_capacity(WINDOW, n);
    let geo = geom(n, d);
    let q = up(&s, &vec![bf16::ZERO; geo.len()]);
    let mut out = poison_bf16(&s, n * NQ * d);
    for (cap, ok) in [(need, true), (need - 1, false)] {
        let m = Mirror::new(d, cap);
        let (kc, vc) = (up(&s, &m.kc), up(&s, &m.vc));
        let attn = RingAttn {
            sinks: None,
            window: WINDOW,
            ring: cap,
        };
        let r = k.attention_prefill_ring(&s, &q, geo, 1000, m.kv, 0, &kc, &vc, 0.1, attn, &mut out);
        assert_eq!(r.is_ok(), ok, "prefill n={n} cap={cap}: {r:?}");
        let r = k
            .attention_prefill_simt_ring(&s, &q, geo, 1000, m.kv, 0, &kc, &vc, 0.1, attn, &mut out);
        assert_eq!(r.is_ok(), ok, "simt n={n} cap={cap}: {r:?}");
    }
    // A ring that fits the window but not the buffer from its base.
    let m = Mirror::new(d, 2 * need);
    let (kc, vc) = (up(&s, &m.kc), up(&s, &m.vc));
    let attn = RingAttn {
        sinks: None,
        window: WINDOW,
        ring: need,
    };
    let r = k.attention_prefill_ring(&s, &q, geo, 1000, m.kv, need, &kc, &vc, 0.1, attn, &mut out);
    assert!(r.is_ok(), "the second ring of two: {r:?}");
    let r = k.attention_prefill_ring(
        &s,
        &q,
        geo,
        1000,
        m.kv,
        need + 1,
        &kc,
        &vc,
        0.1,
        attn,
        &mut out,
    );
    assert!(r.is_err(), "a ring one row past the buffer: {r:?}");
    let attn = RingAttn {
        sinks: None,
        window: WINDOW,
        ring: WINDOW - 1,
    };
    // Decode needs the window.
    let m = Mirror::new(d, WINDOW - 1);
    let (kc, vc) = (up(&s, &m.kc), up(&s, &m.vc));
    let g1 = geom(1, d);
    let q1 = up(&s, &vec![bf16::ZERO; g1.len()]);
    let mut ws = poison_f32(&s, decode_workspace_len(NQ, d));
    let mut o1 = poison_bf16(&s, NQ * d);
    let r = k.attention_decode_ring(
        &s,
        &q1,
        g1,
        StartPos::Host(500),
        m.kv,
        KvBase::Host(0),
        &kc,
        &vc,
        0.1,
        attn,
        &mut ws,
        &mut o1,
    );
    assert!(
        r.is_err(),
        "decode with a ring smaller than the window: {r:?}"
    );
    // A chunk longer than the ring would overwrite its own keys.
    let m = Mirror::new(d, n - 1);
    let (mut kc, mut vc) = (up(&s, &m.kc), up(&s, &m.vc));
    let r = k.kv_append_ring(
        &s,
        &q,
        geo,
        StartPos::Host(0),
        m.kv,
        KvBase::Host(0),
        n - 1,
        &mut kc,
        &mut vc,
    );
    assert!(
        r.is_err(),
        "a {n}-token chunk into a {}-row ring: {r:?}",
        n - 1
    );
    let m = Mirror::new(d, n);
    let (mut kc, mut vc) = (up(&s, &m.kc), up(&s, &m.vc));
    k.kv_append_ring(
        &s,
        &q,
        geo,
        StartPos::Host(0),
        m.kv,
        KvBase::Host(0),
        n,
        &mut kc,
        &mut vc,
    )
    .unwrap();
    sync(&s);
}

/// Continuous batching's layout (module docs of `ops/attention/ring.rs`):
/// three sequences share one sliding layer's buffer, each in its own ring
/// of `ring` rows at its slot's base, and one full layer's buffer, each in
/// its own linear rows at an arena base. Every prefill chunk runs at the
/// sequence's host base; then decode steps append and attend all three
/// rows in one launch (device positions and bases). Each sequence's rows
/// must equal its own CPU reference ring bit for bit (rows outside every
/// sequence keep their NaN poison), each batched row's output must be
/// bit-identical to a one-row launch of that row, and close to the CPU
/// reference of the sequence alone.
#[test]
fn attention_ring_rows_at_their_bases_match_each_alone() {
    rows_at_bases::<bf16>("attention_ring_rows_at_their_bases_match_each_alone");
}

/// The same with the FP16 entry points (gpt-oss's `ActFormat::F16`).
#[test]
fn attention_ring_f16_rows_at_their_bases_match_each_alone() {
    rows_at_bases::<f16>("attention_ring_f16_rows_at_their_bases_match_each_alone");
}

fn rows_at_bases<A: Act16>(name: &str) {
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let k = &g.kernels;
    let d = 64;
    // Prompts of different lengths and chunkings, then decode together.
    let prompts: [&[usize]; 3] = [&[100, 77, 150], &[5], &[150, 150, 30]];
    let steps = 40;
    let max_chunk = 150;
    let ring = ring_min_capacity(WINDOW, max_chunk).next_multiple_of(64);
    let lens: Vec<usize> = prompts
        .iter()
        .map(|c| c.iter().sum::<usize>() + steps)
        .collect();
    // Full layer: arena bases with gaps (poisoned rows between).
    let mut full_base = Vec::new();
    let mut at = 3;
    for l in &lens {
        full_base.push(at);
        at += l + 5;
    }
    let n = prompts.len();
    let sink_vals = sinks(&mut rng);
    let sinks_dev = up(&s, &sink_vals);
    for (window, rows, bases) in [
        (
            WINDOW,
            n * ring + 7,
            (0..n).map(|i| i * ring).collect::<Vec<_>>(),
        ),
        (0, at, full_base.clone()),
    ] {
        let attn = RingAttn {
            sinks: Some(&sinks_dev),
            window,
            ring: if window == 0 { 0 } else { ring },
        };
        let what = format!("window={window} f16={}", A::F16);
        let shared = Mirror::<A>::new(d, rows);
        let (mut kc, mut vc) = (up(&s, &shared.kc), up(&s, &shared.vc));
        // Each sequence alone on the CPU: its own ring (or linear rows).
        let mut alone: Vec<Mirror<A>> = lens
            .iter()
            .map(|&l| Mirror::new(d, if window == 0 { l } else { ring }))
            .collect();
        let mut ws = poison_f32(&s, n * decode_workspace_len(NQ, d));
        let sc = scale(d);
        let mut pos = vec![0usize; n];
        for (i, chunks) in prompts.iter().enumerate() {
            for &c in chunks.iter() {
                let geo = geom(c, d);
                let qkv = randn_act::<A>(&mut rng, geo.len(), 1.0);
                let q = up(&s, &qkv);
                alone[i].append(&qkv, geo, pos[i]);
                let sp = StartPos::Host(pos[i] as u32);
                k.kv_append_ring(
                    &s,
                    &q,
                    geo,
                    sp,
                    shared.kv,
                    KvBase::Host(bases[i]),
                    attn.ring,
                    &mut kc,
                    &mut vc,
                )
                .unwrap();
                let want = alone[i].want(&qkv, geo, pos[i], Some(&sink_vals), window);
                let mut out = poison_bf16(&s, c * NQ * d);
                k.attention_prefill_ring(
                    &s, &q, geo, pos[i], shared.kv, bases[i], &kc, &vc, sc, attn, &mut out,
                )
                .unwrap();
                assert_close(
                    &format!("{what} prefill of sequence {i} at {}", pos[i]),
                    &f32s(&down(&s, &out)),
                    &want,
                    1e-2,
                );
                pos[i] += c;
            }
        }
        let base_dev = up(&s, &bases.iter().map(|&b| b as u32).collect::<Vec<_>>());
        for step in 0..steps {
            let geo = geom(n, d);
            let qkv = randn_act::<A>(&mut rng, geo.len(), 1.0);
            let q = up(&s, &qkv);
            let pos_dev = up(&s, &pos.iter().map(|&p| p as u32).collect::<Vec<_>>());
            let rs = geo.row_stride();
            let g1 = geom(1, d);
            for i in 0..n {
                alone[i].append(&qkv[i * rs..(i + 1) * rs], g1, pos[i]);
            }
            k.kv_append_ring(
                &s,
                &q,
                geo,
                StartPos::Device(&pos_dev),
                shared.kv,
                KvBase::Device(&base_dev),
                attn.ring,
                &mut kc,
                &mut vc,
            )
            .unwrap();
            let mut out = poison_bf16(&s, n * NQ * d);
            k.attention_decode_ring(
                &s,
                &q,
                geo,
                StartPos::Device(&pos_dev),
                shared.kv,
                KvBase::Device(&base_dev),
                &kc,
                &vc,
                sc,
                attn,
                &mut ws,
                &mut out,
            )
            .unwrap();
            let batched = down(&s, &out);
            let row = NQ * d;
            for i in 0..n {
                let q1 = up(&s, &qkv[i * rs..(i + 1) * rs]);
                let p1 = up(&s, &[pos[i] as u32]);
                let b1 = up(&s, &[bases[i] as u32]);
                let mut o1 = poison_bf16(&s, row);
                k.attention_decode_ring(
                    &s,
                    &q1,
                    g1,
                    StartPos::Device(&p1),
                    shared.kv,
                    KvBase::Device(&b1),
                    &kc,
                    &vc,
                    sc,
                    attn,
                    &mut ws,
                    &mut o1,
                )
                .unwrap();
                let one = down(&s, &o1);
                let bits = |x: &[bf16]| x.iter().map(|v| v.to_bits()).collect::<Vec<u16>>();
                assert_eq!(
                    bits(&batched[i * row..(i + 1) * row]),
                    bits(&one),
                    "{what} step {step}: row {i} of the batched launch differs from its one-row launch"
                );
                let want = alone[i].want(
                    &qkv[i * rs..(i + 1) * rs],
                    g1,
                    pos[i],
                    Some(&sink_vals),
                    window,
                );
                assert_close(
                    &format!("{what} decode step {step} of sequence {i} at {}", pos[i]),
                    &f32s(&one),
                    &want,
                    5e-3,
                );
            }
            for p in pos.iter_mut() {
                *p += 1;
            }
        }
        // Each sequence's rows are its own ring's, bit for bit; every other
        // row of the shared buffers still holds the poison.
        let (gk, gv) = (down(&s, &kc), down(&s, &vc));
        let bits = |x: &A| x.to_f32().to_bits();
        let mut owned = vec![false; rows];
        for i in 0..n {
            let own = alone[i].kv.capacity;
            for h in 0..NKV {
                for r in 0..own {
                    owned[bases[i] + r] = true;
                    let at = (h * rows + bases[i] + r) * d;
                    let me = (h * own + r) * d;
                    for e in 0..d {
                        assert_eq!(
                            (bits(&gk[at + e]), bits(&gv[at + e])),
                            (bits(&alone[i].kc[me + e]), bits(&alone[i].vc[me + e])),
                            "{what}: sequence {i}'s head {h} row {r} differs from its own ring"
                        );
                    }
                }
            }
        }
        for h in 0..NKV {
            for r in (0..rows).filter(|&r| !owned[r]) {
                let at = (h * rows + r) * d;
                assert!(
                    gk[at..at + d].iter().all(|x| x.to_f32().is_nan()),
                    "{what}: row {r} of head {h} belongs to no sequence but was written"
                );
            }
        }
    }
}

/// The prefix cache resumes a prompt at a block boundary, so a ring
/// prefill row must not depend on the chunk it is in (the kernel's header:
/// the tiles before the row's window are exact no-ops), nor on the ring's
/// size (engines size rings by their own chunk). A 1,000-token prompt in
/// one chunk over a ring that never wraps, and in chunkings of at most 256
/// tokens over the smallest ring that holds such a chunk's window (383
/// rows: positions wrap more than twice, and every chunk reads rows
/// written before the wrap): every output row bit-identical, for the mma
/// and SIMT kernels, sliding (window 128) and full (ring 0) layers, sinks
/// on and off.
#[test]
fn attention_prefill_ring_rows_are_chunk_invariant() {
    let name = "attention_prefill_ring_rows_are_chunk_invariant";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let k = &g.kernels;
    let t = 1000usize;
    let max_chunk = 256usize;
    let even: Vec<usize> = (0..t).step_by(128).chain([t]).collect();
    let chunkings: [&[usize]; 4] = [
        &even,
        &[0, 37, 100, 163, 290, 400, 511, 512, 513, 700, 900, 1000],
        &[
            0, 1, 2, 127, 128, 129, 260, 261, 399, 400, 600, 800, 999, 1000,
        ],
        &[0, 256, 512, 768, 999, 1000],
    ];
    for bounds in chunkings {
        assert!(bounds.windows(2).all(|w| w[1] - w[0] <= max_chunk));
    }
    let sink_vals = sinks(&mut rng);
    let sinks_dev = up(&s, &sink_vals);
    for d in [64usize, 128] {
        let full = geom(t, d);
        let qkv = randn_bf16(&mut rng, full.len(), 1.0);
        let rs = full.row_stride();
        let row = NQ * d;
        // (window, the one-chunk ring, the chunked runs' ring).
        let layers = [
            (
                WINDOW,
                ring_min_capacity(WINDOW, t),
                ring_min_capacity(WINDOW, max_chunk),
            ),
            (0, 0, 0),
        ];
        for (window, whole_ring, chunk_ring) in layers {
            for with_sinks in [true, false] {
                for simt in [false, true] {
                    let what = format!("d={d} window={window} sinks={with_sinks} simt={simt}");
                    let run = |bounds: &[usize], ring: usize| {
                        let attn = RingAttn {
                            sinks: with_sinks.then_some(&sinks_dev),
                            window,
                            ring,
                        };
                        let m = Mirror::<bf16>::new(d, if ring > 0 { ring } else { t });
                        let (mut kc, mut vc) = (up(&s, &m.kc), up(&s, &m.vc));
                        let mut got = Vec::with_capacity(t * row);
                        for w in bounds.windows(2) {
                            let (a, b) = (w[0], w[1]);
                            let geo = geom(b - a, d);
                            let q = up(&s, &qkv[a * rs..b * rs]);
                            k.kv_append_ring(
                                &s,
                                &q,
                                geo,
                                StartPos::Host(a as u32),
                                m.kv,
                                KvBase::Host(0),
                                ring,
                                &mut kc,
                                &mut vc,
                            )
                            .unwrap();
                            let mut out = poison_bf16(&s, (b - a) * row);
                            let sc = scale(d);
                            if simt {
                                k.attention_prefill_simt_ring(
                                    &s, &q, geo, a, m.kv, 0, &kc, &vc, sc, attn, &mut out,
                                )
                            } else {
                                k.attention_prefill_ring(
                                    &s, &q, geo, a, m.kv, 0, &kc, &vc, sc, attn, &mut out,
                                )
                            }
                            .unwrap();
                            got.extend(down(&s, &out).iter().map(|x| x.to_bits()));
                        }
                        got
                    };
                    let whole = run(&[0, t], whole_ring);
                    for bounds in chunkings {
                        let got = run(bounds, chunk_ring);
                        let first = (0..t).find(|&r| {
                            got[r * row..(r + 1) * row] != whole[r * row..(r + 1) * row]
                        });
                        assert!(
                            first.is_none(),
                            "{what}: chunks {bounds:?}: row {first:?} differs from the one-chunk prefill"
                        );
                    }
                }
            }
        }
    }
}
