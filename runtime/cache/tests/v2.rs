//! Cache format 2 for INT4: the group recorded in the header (128 for qwen3
//! geometries, 64 or 32 where 128 does not divide), the format checked on
//! open, and format-1 caches refused with the exact rebuild command.

mod common;

use common::*;
use krasis_cache::quant::{SourceMatrix, dequantize_rows, quantize_rows};
use krasis_cache::{
    BuildOptions, CacheError, CacheExperts, ExpertCache, ExpertFormat, ModelSource, V1_FILE_NAME,
    cache_path, ensure_cache_at, verify_against_source,
};
use krasis_model::{Checkpoint, ExpertWeights};
use serde_json::json;
use std::path::Path;
use std::sync::Arc;

fn quiet() -> BuildOptions<'static> {
    BuildOptions {
        progress_bar: false,
        ..BuildOptions::default()
    }
}

/// A hand-written BF16 checkpoint (2 MoE layers x 6 experts of `h` x `i`,
/// expert tensors only: the cache reads nothing else). The synth writer
/// keeps hidden a multiple of 128, so widths like 96 or 192 are written here.
fn bf16_model(parent: &Path, h: usize, i: usize) -> std::path::PathBuf {
    let dir = write_config(
        parent,
        "m",
        &[
            ("hidden_size", json!(h)),
            ("moe_intermediate_size", json!(i)),
            ("num_experts", json!(6)),
            ("num_hidden_layers", json!(2)),
            ("max_window_layers", json!(2)),
        ],
    );
    let config = krasis_model::ModelConfig::load(&dir).unwrap();
    let mut t = Vec::new();
    for l in 0..2 {
        for e in 0..6 {
            let names = config.expert_tensor_names(l, e);
            for (k, (name, shape)) in names.into_iter().zip([[i, h], [i, h], [h, i]]).enumerate() {
                let salt = (l * 100 + e * 10 + k) as f32;
                let vals: Vec<u8> = (0..h * i)
                    .flat_map(|j| {
                        half::bf16::from_f32(((j as f32 * 0.61 + salt).sin()) * 0.03)
                            .to_bits()
                            .to_le_bytes()
                    })
                    .collect();
                t.push((name, "BF16", shape.to_vec(), vals));
            }
        }
    }
    write_safetensors(&dir, &t);
    dir
}

/// Builds a tiny BF16 model of hidden `h` and expert width `i` and checks
/// the group, the stored bytes of one expert and the decode.
fn int4_round_trip(h: usize, i: usize, group: usize) {
    let tmp = tempfile::tempdir().unwrap();
    let model = bf16_model(tmp.path(), h, i);
    let source = ModelSource::open(&model).unwrap();
    assert_eq!(source.format(), ExpertFormat::Int4 { group });
    // Reports derive the same layout from the config alone.
    assert_eq!(
        krasis_cache::model_layout(source.config(), &model).unwrap(),
        source.layout()
    );
    let path = tmp.path().join("c").join(krasis_cache::FILE_NAME);
    let cache = ensure_cache_at(&source, &path, &quiet()).unwrap().cache;
    assert_eq!(cache.header().expert_format, ExpertFormat::Int4 { group });
    assert_eq!(cache.header().format_version, 2);
    let l = cache.layout();
    assert_eq!(l.group(), group);

    // Expert 5 of layer 1: down_proj quantized with this group, by hand.
    let ckpt = Checkpoint::open(&model).unwrap();
    let [_, up_name, down_name] = source.config().expert_tensor_names(1, 5);
    let block = cache.expert_bytes(1, 5);
    let quant = |name: &str, rows: usize, k: usize| {
        let t = ckpt.get(name).unwrap();
        let mut q = vec![0u8; rows * k / 2];
        let mut s = vec![0u8; rows * k / group * 2];
        let m = SourceMatrix {
            dtype: t.dtype,
            bytes: t.bytes,
        };
        quantize_rows(m, rows, k, group, &mut q, &mut s).unwrap();
        (q, s)
    };
    let (dq, ds) = quant(&down_name, h, i);
    assert_eq!(&block[l.w2_q..l.w2_q + dq.len()], &dq[..]);
    assert_eq!(&block[l.w2_s..l.w2_s + ds.len()], &ds[..]);
    let (uq, us) = quant(&up_name, i, h);
    let (hq, hs) = (l.w13_q_bytes() / 2, l.w13_s_bytes() / 2);
    assert_eq!(&block[hq..2 * hq], &uq[..]);
    assert_eq!(&block[l.w13_s + hs..l.w13_s + 2 * hs], &us[..]);
    let mut down = vec![0f32; h * i];
    dequantize_rows(&dq, &ds, group, &mut down);
    let got = CacheExperts::new(Arc::new(cache)).expert_f32(1, 5).unwrap();
    assert_eq!(got.down, down);
    assert!(got.bias.is_none());
    let cache = ExpertCache::open(&path, source.config(), source.format()).unwrap();
    verify_against_source(&cache, &source).unwrap();
}

#[test]
fn int4_group_128_round_trip() {
    int4_round_trip(128, 128, 128);
}

#[test]
fn int4_group_64_round_trip() {
    int4_round_trip(192, 64, 64);
}

#[test]
fn int4_group_32_round_trip() {
    int4_round_trip(96, 160, 32);
}

#[test]
fn a_cache_of_another_format_is_refused_naming_both() {
    let tmp = tempfile::tempdir().unwrap();
    let model = small_model(tmp.path());
    let source = ModelSource::open(&model).unwrap();
    let path = tmp.path().join("c").join(krasis_cache::FILE_NAME);
    ensure_cache_at(&source, &path, &quiet()).unwrap();
    let e =
        ExpertCache::open(&path, source.config(), ExpertFormat::Int4 { group: 64 }).unwrap_err();
    assert!(matches!(e, CacheError::FormatMismatch { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("int4 group 128") && msg.contains("int4 group 64"),
        "{msg}"
    );
    // A header whose recorded format was edited (checksummed header intact
    // otherwise) is refused too: the format is part of the header contract.
    assert!(ExpertCache::open(&path, source.config(), ExpertFormat::Mxfp4).is_err());
}

/// Writes a file that looks like a format-1 cache (its magic and version).
fn write_v1(path: &Path) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut b = b"KRSXINT4".to_vec();
    b.extend_from_slice(&1u32.to_le_bytes());
    b.resize(4096, 0);
    std::fs::write(path, b).unwrap();
}

#[test]
fn format_1_file_beside_is_refused_with_the_rebuild_command() {
    let tmp = tempfile::tempdir().unwrap();
    let model = small_model(tmp.path());
    let source = ModelSource::open(&model).unwrap();
    let root = tmp.path().join("root");
    let path = cache_path(&source, Some(&root)).unwrap();
    let old = path.with_file_name(V1_FILE_NAME);
    write_v1(&old);
    let old_lock = old.with_file_name(format!("{V1_FILE_NAME}.lock"));
    std::fs::write(&old_lock, b"").unwrap();
    let e = ensure_cache_at(&source, &path, &quiet()).unwrap_err();
    let msg = e.to_string();
    match &e {
        CacheError::OldFormat {
            path: p,
            version,
            command,
        } => {
            assert_eq!(p, &old);
            assert_eq!(*version, 1);
            assert_eq!(
                command,
                &format!(
                    "krasis-runtime build-cache --model {} --cache-dir {}",
                    model.display(),
                    root.display()
                )
            );
        }
        e => panic!("expected OldFormat, got {e}"),
    }
    assert!(
        msg.contains("format-1") && msg.contains("krasis-runtime build-cache --model"),
        "{msg}"
    );
    assert!(!e.is_rebuildable());
    // Nothing was built over it or beside it.
    assert!(!path.exists());
    assert_eq!(std::fs::read(&old).unwrap().len(), 4096);

    // The named command (build-cache sets replace_format_1) replaces it.
    let opts = BuildOptions {
        replace_format_1: true,
        ..quiet()
    };
    let built = ensure_cache_at(&source, &path, &opts).unwrap();
    assert!(built.built.is_some());
    assert!(!old.exists(), "the format-1 file is removed");
    assert!(!old_lock.exists(), "and its lock file");
    assert!(ensure_cache_at(&source, &path, &quiet()).is_ok());
}

#[test]
fn format_1_magic_at_the_cache_path_is_refused_not_overwritten() {
    let tmp = tempfile::tempdir().unwrap();
    let model = small_model(tmp.path());
    let source = ModelSource::open(&model).unwrap();
    let path = tmp.path().join("c").join(krasis_cache::FILE_NAME);
    write_v1(&path);
    let e = ExpertCache::open(&path, source.config(), source.format()).unwrap_err();
    assert!(matches!(e, CacheError::OldFormat { version: 1, .. }), "{e}");
    let e = ensure_cache_at(&source, &path, &quiet()).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains(&format!(
            "krasis-runtime build-cache --model {}",
            model.display()
        )),
        "{msg}"
    );
    assert_eq!(
        &std::fs::read(&path).unwrap()[..8],
        b"KRSXINT4",
        "untouched"
    );
    let opts = BuildOptions {
        replace_format_1: true,
        ..quiet()
    };
    ensure_cache_at(&source, &path, &opts).unwrap();
    assert_eq!(&std::fs::read(&path).unwrap()[..8], b"KRSXEXP2");
}
