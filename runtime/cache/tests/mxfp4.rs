//! Native MXFP4 experts in cache format 2: the checkpoint's bits copied
//! exactly (gate/up de-interleaved), decoded exactly, verified, and
//! refused where an exact cache is impossible.

mod common;

use common::*;
use krasis_cache::{
    BuildOptions, CacheError, CacheExperts, ExpertCache, ExpertFormat, ExpertPrecision,
    ModelSource, ensure_cache_at, verify_against_source,
};
use krasis_model::formats::mxfp4::Mxfp4Matrix;
use krasis_model::{ExpertStorage, ExpertWeights, FusedMxfp4Names};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const H: usize = 64;
const I: usize = 32;
const E: usize = 2;

fn quiet() -> BuildOptions<'static> {
    BuildOptions {
        progress_bar: false,
        ..BuildOptions::default()
    }
}

fn names(layer: usize, bias: bool, interleaved: bool) -> FusedMxfp4Names {
    let p = format!("model.layers.{layer}.mlp.experts");
    FusedMxfp4Names {
        gate_up_blocks: format!("{p}.gate_up_proj_blocks"),
        gate_up_scales: format!("{p}.gate_up_proj_scales"),
        gate_up_bias: bias.then(|| format!("{p}.gate_up_proj_bias")),
        down_blocks: format!("{p}.down_proj_blocks"),
        down_scales: format!("{p}.down_proj_scales"),
        down_bias: bias.then(|| format!("{p}.down_proj_bias")),
        gate_up_interleaved: interleaved,
    }
}

/// Scales in 120..=134 (finite, varied); the MoE layer's salt keeps layers apart.
fn scales(n: usize, salt: u64) -> Vec<u8> {
    bytes(n, salt).into_iter().map(|b| 120 + b % 15).collect()
}

fn bf16s(n: usize, salt: u64) -> Vec<u8> {
    (0..n)
        .flat_map(|j| {
            half::bf16::from_f32(((j as f32 + salt as f32) * 0.37).sin())
                .to_bits()
                .to_le_bytes()
        })
        .collect()
}

/// The checkpoint's tensors of one layer, by name.
struct Layer {
    gub: Vec<u8>,
    gus: Vec<u8>,
    gubias: Vec<u8>,
    db: Vec<u8>,
    ds: Vec<u8>,
    dbias: Vec<u8>,
}

/// A one-MoE-layer tiny model (H 64, I 32, 2 experts) whose experts are
/// fused MXFP4 tensors; returns its directory and the tensors.
fn mxfp4_model(parent: &Path, name: &str, bias: bool, interleaved: bool) -> (PathBuf, Layer) {
    let dir = write_config(
        parent,
        name,
        &[
            ("hidden_size", json!(H)),
            ("moe_intermediate_size", json!(I)),
            ("num_experts", json!(E)),
            ("num_experts_per_tok", json!(2)),
            ("num_hidden_layers", json!(1)),
            ("max_window_layers", json!(1)),
        ],
    );
    let l = Layer {
        gub: bytes(E * 2 * I * H / 2, 1),
        gus: scales(E * 2 * I * H / 32, 2),
        gubias: bf16s(E * 2 * I, 3),
        db: bytes(E * H * I / 2, 4),
        ds: scales(E * H * I / 32, 5),
        dbias: bf16s(E * H, 6),
    };
    let n = names(0, bias, interleaved);
    let mut t = vec![
        (
            n.gate_up_blocks.clone(),
            "U8",
            vec![E, 2 * I, H / 32, 16],
            l.gub.clone(),
        ),
        (
            n.gate_up_scales.clone(),
            "U8",
            vec![E, 2 * I, H / 32],
            l.gus.clone(),
        ),
        (
            n.down_blocks.clone(),
            "U8",
            vec![E, H, I / 32, 16],
            l.db.clone(),
        ),
        (
            n.down_scales.clone(),
            "U8",
            vec![E, H, I / 32],
            l.ds.clone(),
        ),
    ];
    if bias {
        t.push((
            n.gate_up_bias.clone().unwrap(),
            "BF16",
            vec![E, 2 * I],
            l.gubias.clone(),
        ));
        t.push((
            n.down_bias.clone().unwrap(),
            "BF16",
            vec![E, H],
            l.dbias.clone(),
        ));
    }
    write_safetensors(&dir, &t);
    (dir, l)
}

fn open(dir: &Path, bias: bool, interleaved: bool) -> Result<ModelSource, CacheError> {
    open_as(dir, None, bias, interleaved)
}

fn open_as(
    dir: &Path,
    precision: Option<ExpertPrecision>,
    bias: bool,
    interleaved: bool,
) -> Result<ModelSource, CacheError> {
    let storage = move |l: usize| ExpertStorage::FusedMxfp4(names(l, bias, interleaved));
    ModelSource::open_described(dir, precision, &storage)
}

fn bf16_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
        .collect()
}

fn round_trip(bias: bool, interleaved: bool) {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, src) = mxfp4_model(tmp.path(), "m", bias, interleaved);
    let source = open(&dir, bias, interleaved).unwrap();
    assert_eq!(source.format(), ExpertFormat::Mxfp4);
    let path = tmp.path().join("cache").join(krasis_cache::FILE_NAME);
    let cache = ensure_cache_at(&source, &path, &quiet()).unwrap().cache;
    let h = cache.header();
    assert_eq!(h.expert_format, ExpertFormat::Mxfp4);
    assert_eq!(h.expert_bias, bias);
    assert!(h.source_content_blake3.is_some());
    let l = cache.layout();
    assert_eq!(l.has_bias, bias);

    // Bit-exact copy, rows of w13 checked one by one against the
    // checkpoint's (gate j at row 2j and up j at row 2j + 1 when interleaved).
    let src_row = |r: usize| match (interleaved, r < I) {
        (false, _) => r,
        (true, true) => 2 * r,
        (true, false) => 2 * (r - I) + 1,
    };
    for e in 0..E {
        let block = cache.expert_bytes(0, e);
        let (qb, sb) = (H / 2, H / 32);
        for r in 0..2 * I {
            let s = e * 2 * I + src_row(r);
            assert_eq!(
                &block[l.w13_q + r * qb..l.w13_q + (r + 1) * qb],
                &src.gub[s * qb..(s + 1) * qb],
                "expert {e} w13 row {r}"
            );
            assert_eq!(
                &block[l.w13_s + r * sb..l.w13_s + (r + 1) * sb],
                &src.gus[s * sb..(s + 1) * sb]
            );
            if bias {
                assert_eq!(
                    &block[l.w13_b + 2 * r..l.w13_b + 2 * r + 2],
                    &src.gubias[2 * s..2 * s + 2]
                );
            }
        }
        let (nq, ns) = (H * I / 2, H * I / 32);
        assert_eq!(&block[l.w2_q..l.w2_q + nq], &src.db[e * nq..(e + 1) * nq]);
        assert_eq!(&block[l.w2_s..l.w2_s + ns], &src.ds[e * ns..(e + 1) * ns]);
        if bias {
            assert_eq!(
                &block[l.w2_b..l.w2_b + 2 * H],
                &src.dbias[e * 2 * H..(e + 1) * 2 * H]
            );
        }
        assert!(block[l.used_bytes..].iter().all(|&b| b == 0), "padding");

        // Exact decode equals krasis_model's decode of the checkpoint bytes.
        let gu = Mxfp4Matrix::new(
            "gate_up",
            e,
            2 * I,
            H,
            &src.gub[e * I * H..(e + 1) * I * H],
            &src.gus[e * 2 * I * H / 32..(e + 1) * 2 * I * H / 32],
        )
        .unwrap();
        let (gate, up) = if interleaved {
            gu.dequant_gate_up()
        } else {
            let mut all = gu.dequant();
            let gate = all.drain(..I * H).collect();
            (gate, all)
        };
        let down = Mxfp4Matrix::new(
            "down",
            e,
            H,
            I,
            &src.db[e * nq..(e + 1) * nq],
            &src.ds[e * ns..(e + 1) * ns],
        )
        .unwrap()
        .dequant();
        let got = CacheExperts::new(Arc::new(
            ExpertCache::open(&path, source.config(), source.format()).unwrap(),
        ))
        .expert_f32(0, e)
        .unwrap();
        assert_eq!((got.gate, got.up, got.down), (gate, up, down));
        match (bias, got.bias) {
            (false, None) => {}
            (true, Some(b)) => {
                let gub = bf16_f32(&src.gubias[e * 4 * I..(e + 1) * 4 * I]);
                let pick = |up: bool| -> Vec<f32> {
                    (0..I)
                        .map(|j| gub[src_row(j + usize::from(up) * I)])
                        .collect()
                };
                assert_eq!(b.gate, pick(false));
                assert_eq!(b.up, pick(true));
                assert_eq!(b.down, bf16_f32(&src.dbias[e * 2 * H..(e + 1) * 2 * H]));
            }
            (want, got) => panic!("bias expected {want}, got {got:?}"),
        }
    }
    verify_against_source(&cache, &source).unwrap();
    // The heatmap binding reads an MXFP4 cache's header like an INT4 one's.
    let b = krasis_cache::HeatmapBinding::for_cache(&cache, 2, "fp16", "bf16");
    assert_eq!(b.cache_format_version, 2);
    assert_eq!(b.cache_id, source.identity().id());
}

#[test]
fn mxfp4_copy_is_bit_exact_interleaved_with_bias() {
    round_trip(true, true);
}

#[test]
fn mxfp4_copy_is_bit_exact_plain_without_bias() {
    round_trip(false, false);
}

#[test]
fn mxfp4_hand_checked_de_interleave() {
    // Expert 1, gate row 3 is checkpoint row 6 and up row 3 is row 7: the
    // first bytes of those rows, by hand.
    let tmp = tempfile::tempdir().unwrap();
    let (dir, src) = mxfp4_model(tmp.path(), "m", true, true);
    let source = open(&dir, true, true).unwrap();
    let path = tmp.path().join("c").join(krasis_cache::FILE_NAME);
    let cache = ensure_cache_at(&source, &path, &quiet()).unwrap().cache;
    let (l, b) = (cache.layout(), cache.expert_bytes(0, 1));
    let row = |r: usize| (2 * I + r) * (H / 2); // expert 1's checkpoint row r
    assert_eq!(b[l.w13_q + 3 * 32], src.gub[row(6)]);
    assert_eq!(b[l.w13_q + (I + 3) * 32], src.gub[row(7)]);
    assert_eq!(b[l.w13_s + (I + 3) * 2], src.gus[(2 * I + 7) * 2]);
    assert_eq!(
        &b[l.w13_b + 2 * (I + 3)..l.w13_b + 2 * (I + 4)],
        &src.gubias[2 * (2 * I + 7)..2 * (2 * I + 8)]
    );
}

#[test]
fn corrupt_checkpoint_bytes_change_the_content_hash_and_fail_verify() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, _) = mxfp4_model(tmp.path(), "m", true, true);
    let source = open(&dir, true, true).unwrap();
    let path = tmp.path().join("c").join(krasis_cache::FILE_NAME);
    let cache = ensure_cache_at(&source, &path, &quiet()).unwrap().cache;
    // Flip one bit of a down bias (not in the identity sample window's
    // tensors) in the checkpoint: verify re-reads every byte and refuses.
    let f = dir.join("model.safetensors");
    let mut data = std::fs::read(&f).unwrap();
    let at = data.len() - 1;
    data[at] ^= 0x01;
    std::fs::write(&f, data).unwrap();
    let fresh = open(&dir, true, true).unwrap();
    assert_eq!(
        fresh.identity(),
        source.identity(),
        "names and shapes unchanged"
    );
    let e = verify_against_source(&cache, &fresh).unwrap_err();
    assert!(e.to_string().contains("differs"), "{e}");
}

#[test]
fn nan_scale_in_the_checkpoint_is_refused_at_build() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, _) = mxfp4_model(tmp.path(), "m", false, true);
    let n = names(0, false, true);
    // Rewrite the down scales with one NaN (0xFF).
    let mut ds = scales(E * H * I / 32, 5);
    ds[3] = 0xFF;
    let ck = krasis_model::Checkpoint::open(&dir).unwrap();
    let get = |name: &str| ck.raw(name).unwrap().bytes.to_vec();
    let t = vec![
        (
            n.gate_up_blocks.clone(),
            "U8",
            vec![E, 2 * I, H / 32, 16],
            get(&n.gate_up_blocks),
        ),
        (
            n.gate_up_scales.clone(),
            "U8",
            vec![E, 2 * I, H / 32],
            get(&n.gate_up_scales),
        ),
        (
            n.down_blocks.clone(),
            "U8",
            vec![E, H, I / 32, 16],
            get(&n.down_blocks),
        ),
        (n.down_scales.clone(), "U8", vec![E, H, I / 32], ds),
    ];
    drop(ck);
    write_safetensors(&dir, &t);
    let source = open(&dir, false, true).unwrap();
    let path = tmp.path().join("c").join(krasis_cache::FILE_NAME);
    let e = ensure_cache_at(&source, &path, &quiet()).unwrap_err();
    assert!(matches!(e, CacheError::Mxfp4(_)), "{e}");
    assert!(e.to_string().contains("NaN"), "{e}");
    assert!(!path.exists());
}

#[test]
fn int4_on_an_mxfp4_model_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, _) = mxfp4_model(tmp.path(), "m", true, true);
    let e = open_as(&dir, Some(ExpertPrecision::Int4), true, true).unwrap_err();
    assert!(matches!(e, CacheError::Precision { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("MXFP4") && msg.contains("re-quantise"),
        "{msg}"
    );
    assert!(msg.contains("precision mxfp4"), "{msg}");
    // Its own precision, asked for explicitly, is accepted.
    let ok = open_as(&dir, Some(ExpertPrecision::Mxfp4), true, true).unwrap();
    assert_eq!(ok.format(), ExpertFormat::Mxfp4);
}

#[test]
fn mxfp4_on_a_bf16_model_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let model = small_model(tmp.path());
    let e = ModelSource::open_with(&model, Some(ExpertPrecision::Mxfp4)).unwrap_err();
    assert!(matches!(e, CacheError::Precision { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("not MXFP4") && msg.contains("precision int4"),
        "{msg}"
    );
    assert!(ModelSource::open_with(&model, Some(ExpertPrecision::Int4)).is_ok());
}

#[test]
fn mxfp4_cache_opened_as_int4_is_refused_naming_both() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, _) = mxfp4_model(tmp.path(), "m", true, true);
    let source = open(&dir, true, true).unwrap();
    let path = tmp.path().join("c").join(krasis_cache::FILE_NAME);
    ensure_cache_at(&source, &path, &quiet()).unwrap();
    let want = ExpertFormat::Int4 { group: 32 };
    let e = ExpertCache::open(&path, source.config(), want).unwrap_err();
    assert!(matches!(e, CacheError::FormatMismatch { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("mxfp4 group 32") && msg.contains("int4 group 32"),
        "{msg}"
    );
}

#[test]
fn synthetic_gpt_oss_checkpoint_is_cached_natively_through_its_description() {
    // The real path: the architecture description says FusedMxfp4.
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_synth(tmp.path(), "g", spec("tiny-gpt-oss", 5, &[]), false);
    let source = ModelSource::open(&dir).unwrap();
    assert_eq!(source.format(), ExpertFormat::Mxfp4);
    assert!(source.layout().has_bias);
    let path = tmp.path().join("c").join(krasis_cache::FILE_NAME);
    let cache = ensure_cache_at(&source, &path, &quiet()).unwrap().cache;
    verify_against_source(&cache, &source).unwrap();
    let g = source.config().geometry();
    let (h, i) = (g.hidden, g.expert_intermediate);
    let layer = *cache.moe_layers().last().unwrap();
    let ExpertStorage::FusedMxfp4(n) = source.config().expert_storage(layer) else {
        panic!("gpt_oss stores fused MXFP4 experts");
    };
    assert!(n.gate_up_interleaved);
    let ck = krasis_model::Checkpoint::open(&dir).unwrap();
    let raw = |name: &str| ck.raw(name).unwrap().bytes;
    let e = g.num_experts - 1;
    let (nq, ns) = (2 * i * h / 2, 2 * i * h / 32);
    let gu = Mxfp4Matrix::new(
        "gate_up",
        e,
        2 * i,
        h,
        &raw(&n.gate_up_blocks)[e * nq..(e + 1) * nq],
        &raw(&n.gate_up_scales)[e * ns..(e + 1) * ns],
    )
    .unwrap();
    let (gate, up) = gu.dequant_gate_up();
    let got = CacheExperts::new(Arc::new(cache))
        .expert_f32(layer, e)
        .unwrap();
    assert_eq!((got.gate, got.up), (gate, up));
    let b = bf16_f32(&raw(n.gate_up_bias.as_ref().unwrap())[e * 4 * i..(e + 1) * 4 * i]);
    let bias = got.bias.expect("gpt_oss experts have biases");
    assert_eq!(bias.gate, b.iter().step_by(2).copied().collect::<Vec<_>>());
    assert_eq!(
        bias.up,
        b.iter().skip(1).step_by(2).copied().collect::<Vec<_>>()
    );
}
