use half::bf16;
use krasis_kernels::{KvGeom, QkvGeom, StartPos, decode_workspace_len, reference as cpu};

use crate::common::*;

/// Random cache contents for positions `0..start`, plus random QKV for the
/// new tokens appended at `start..start + n_tokens`.
struct Case {
    kv: KvGeom,
    start: usize,
    qkv: Vec<bf16>,
    kc: Vec<bf16>,
    vc: Vec<bf16>,
}

fn case(rng: &mut rand::rngs::StdRng, geom: QkvGeom, start: usize, capacity: usize) -> Case {
    let kv = KvGeom {
        n_kv_heads: geom.n_kv_heads,
        head_dim: geom.head_dim,
        capacity,
    };
    let qkv = randn_bf16(rng, geom.len(), 1.0);
    let mut kc = vec![bf16::NAN; kv.len()];
    let mut vc = vec![bf16::NAN; kv.len()];
    let d = geom.head_dim;
    for h in 0..kv.n_kv_heads {
        let base = h * capacity * d;
        let k = randn_bf16(rng, start * d, 1.0);
        let v = randn_bf16(rng, start * d, 1.0);
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

#[test]
fn attention_prefill_matches_reference() {
    let name = "attention_prefill_matches_reference";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    for (d, t, start) in [
        (128usize, 150usize, 70usize),
        (128, 64, 0),
        (128, 1, 300),
        (64, 77, 20),
    ] {
        let geom = QkvGeom {
            n_tokens: t,
            n_q_heads: 8,
            n_kv_heads: 2,
            head_dim: d,
        };
        let c = case(&mut rng, geom, start, start + t + 13);
        let scale = 1.0 / (d as f32).sqrt();
        let want = cpu::attention(&c.qkv, geom, c.start, c.kv, &c.kc, &c.vc, scale);
        let (q, k, v) = (up(&s, &c.qkv), up(&s, &c.kc), up(&s, &c.vc));
        let mut out = poison_bf16(&s, t * geom.n_q_heads * d);
        g.kernels
            .attention_prefill(&s, &q, geom, start, c.kv, &k, &v, scale, &mut out)
            .unwrap();
        assert_close(
            &format!("prefill d={d} T={t} start={start}"),
            &f32s(&down(&s, &out)),
            &want,
            1e-2,
        );
        let mut out = poison_bf16(&s, t * geom.n_q_heads * d);
        g.kernels
            .attention_prefill_simt(&s, &q, geom, start, c.kv, &k, &v, scale, &mut out)
            .unwrap();
        assert_close(
            &format!("prefill simt d={d} T={t} start={start}"),
            &f32s(&down(&s, &out)),
            &want,
            5e-3,
        );
    }
}

#[test]
fn attention_decode_matches_reference() {
    let name = "attention_decode_matches_reference";
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
        let c = case(&mut rng, geom, pos, capacity);
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
            .attention_decode(&s, &q, geom, sp, c.kv, &k, &v, scale, &mut ws, &mut out)
            .unwrap();
        assert_close(
            &format!("decode pos={pos} device={device_pos} nq={nq} nkv={nkv} d={d}"),
            &f32s(&down(&s, &out)),
            &want,
            5e-3,
        );
    }
}
