//! Build / open / validate / rebuild behaviour of the INT4 expert cache.

mod common;

use common::*;
use half::f16;
use krasis_cache::quant::{SourceMatrix, quantize_rows};
use krasis_cache::{
    BuildOptions, CacheError, CacheExperts, ExpertCache, LockWait, ModelSource, SourceIdentity,
    Verify, build, ensure_cache_at,
};
use krasis_model::{DType, ExpertWeights};
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn quiet() -> BuildOptions<'static> {
    BuildOptions {
        progress_bar: false,
        ..BuildOptions::default()
    }
}

fn cache_file(tmp: &Path) -> PathBuf {
    tmp.join("cache").join(krasis_cache::FILE_NAME)
}

fn flip_byte(path: &Path, offset: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, offset).unwrap();
    f.write_all_at(&[b[0] ^ 0x10], offset).unwrap();
}

#[test]
fn build_open_and_one_copy_per_expert() {
    let tmp = tempfile::tempdir().unwrap();
    let model = small_model(tmp.path());
    let source = ModelSource::open(&model).unwrap();
    let path = cache_file(tmp.path());
    let first = ensure_cache_at(&source, &path, &quiet()).unwrap();
    let report = first.built.expect("first call builds");
    assert!(report.source_bytes > 0 && report.file_bytes > 0);
    let second = ensure_cache_at(&source, &path, &quiet()).unwrap();
    assert!(second.built.is_none(), "a valid cache is reused");
    let cache = second.cache;
    assert!(cache.checksum_time().is_some());

    let g = source.config().geometry();
    assert_eq!(cache.moe_layers(), &[0, 1, 2]);
    assert_eq!(cache.num_experts(), g.num_experts);
    let layout = cache.layout();
    let base = cache.file_bytes().as_ptr() as usize;
    for (j, &l) in cache.moe_layers().iter().enumerate() {
        assert_eq!(
            cache.layer_offset(l),
            cache.data_offset() + (j * cache.layer_len()) as u64
        );
        assert_eq!(
            cache.layer_bytes(l).len(),
            g.num_experts * layout.expert_stride
        );
        for e in 0..g.num_experts {
            let block = cache.expert_bytes(l, e);
            // One contiguous copy at the computable offset.
            assert_eq!(
                block.as_ptr() as usize - base,
                (cache.layer_offset(l) as usize) + e * layout.expert_stride
            );
            assert_eq!(block.len(), layout.expert_stride);
        }
    }
    assert!(cache.try_expert_bytes(0, g.num_experts).is_none());
    assert!(cache.try_layer_bytes(3).is_none());

    // The stored bytes are the quantization of the checkpoint's tensors, at
    // the offsets layout.rs defines.
    let ckpt = krasis_model::Checkpoint::open(&model).unwrap();
    let (h, i) = (g.hidden, g.expert_intermediate);
    let [gate_name, up_name, down_name] = source.config().expert_tensor_names(1, 5);
    let block = cache.expert_bytes(1, 5);
    let quant = |name: &str, rows: usize, k: usize| {
        let t = ckpt.get(name).unwrap();
        assert_eq!(t.dtype, DType::BF16);
        let mut q = vec![0u8; rows * k / 2];
        let mut s = vec![0u8; rows * k / 64];
        quantize_rows(
            SourceMatrix {
                dtype: t.dtype,
                bytes: t.bytes,
            },
            rows,
            k,
            128,
            &mut q,
            &mut s,
        )
        .unwrap();
        (q, s)
    };
    let (gq, gs) = quant(&gate_name, i, h);
    let (uq, us) = quant(&up_name, i, h);
    let (dq, ds) = quant(&down_name, h, i);
    assert_eq!(&block[layout.w13_q..layout.w13_q + gq.len()], &gq[..]);
    assert_eq!(
        &block[layout.w13_q + gq.len()..layout.w13_q + 2 * gq.len()],
        &uq[..]
    );
    assert_eq!(&block[layout.w13_s..layout.w13_s + gs.len()], &gs[..]);
    assert_eq!(
        &block[layout.w13_s + gs.len()..layout.w13_s + 2 * gs.len()],
        &us[..]
    );
    assert_eq!(&block[layout.w2_q..layout.w2_q + dq.len()], &dq[..]);
    assert_eq!(&block[layout.w2_s..layout.w2_s + ds.len()], &ds[..]);

    // Dequantized weights are within half a step of the source.
    let int4 = CacheExperts::new(Arc::new(cache));
    let w = int4.expert_f32(1, 5).unwrap();
    let src = ckpt.get(&down_name).unwrap().to_f32();
    for (j, (a, b)) in src.iter().zip(&w.down).enumerate() {
        let s = f16::from_bits(u16::from_le_bytes([
            ds[2 * (j / 128)],
            ds[2 * (j / 128) + 1],
        ]))
        .to_f32();
        assert!((a - b).abs() <= s / 2.0, "down[{j}]: {a} vs {b}");
    }
    assert!(int4.expert_f32(0, g.num_experts).is_err());
    assert!(int4.expert_f32(5, 0).is_err());
}

#[test]
fn truncated_file_is_refused_then_rebuilt() {
    let tmp = tempfile::tempdir().unwrap();
    let source = ModelSource::open(&small_model(tmp.path())).unwrap();
    let path = cache_file(tmp.path());
    build(&source, &path, &quiet()).unwrap();
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 4096)
        .unwrap();
    let e = ExpertCache::open(&path, source.config(), source.format()).unwrap_err();
    assert!(matches!(e, CacheError::Invalid { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("truncated") && msg.contains("build-cache"),
        "{msg}"
    );
    let again = ensure_cache_at(&source, &path, &quiet()).unwrap();
    assert!(again.built.is_some());
    assert_eq!(std::fs::metadata(&path).unwrap().len(), len);
}

#[test]
fn flipped_byte_names_the_layer_and_is_rebuilt() {
    let tmp = tempfile::tempdir().unwrap();
    let source = ModelSource::open(&small_model(tmp.path())).unwrap();
    let path = cache_file(tmp.path());
    build(&source, &path, &quiet()).unwrap();
    let good = ExpertCache::open(&path, source.config(), source.format()).unwrap();
    let target = good.layer_offset(1) + 12345;
    let len = good.layer_len() as u64;
    drop(good);
    flip_byte(&path, target);
    let e = ExpertCache::open(&path, source.config(), source.format()).unwrap_err();
    match &e {
        CacheError::Checksum {
            layer, offset, end, ..
        } => {
            assert_eq!(*layer, 1);
            assert!(*offset <= target && target < *end && end - offset == len);
        }
        other => panic!("expected a checksum error, got {other}"),
    }
    assert!(e.to_string().contains("decoder layer 1"), "{e}");
    // The explicit fast mode skips layer checksums (documented), nothing else.
    assert!(
        ExpertCache::open_with(&path, source.config(), source.format(), Verify::HeaderOnly).is_ok()
    );
    let again = ensure_cache_at(&source, &path, &quiet()).unwrap();
    assert!(again.built.is_some());
    // A flipped header byte is caught by the header checksum.
    flip_byte(&path, 200);
    let e = ExpertCache::open_with(&path, source.config(), source.format(), Verify::HeaderOnly)
        .unwrap_err();
    assert!(e.to_string().contains("header"), "{e}");
}

#[test]
fn changed_source_config_makes_the_cache_stale() {
    let tmp = tempfile::tempdir().unwrap();
    let model = small_model(tmp.path());
    let source = ModelSource::open(&model).unwrap();
    let path = cache_file(tmp.path());
    build(&source, &path, &quiet()).unwrap();
    let cfg_path = model.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    cfg["rms_norm_eps"] = serde_json::json!(1e-5);
    std::fs::write(&cfg_path, serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
    let changed = ModelSource::open(&model).unwrap();
    assert_ne!(changed.identity(), source.identity());
    let e = krasis_cache::open_for_source(&path, &changed).unwrap_err();
    assert!(matches!(e, CacheError::Stale { .. }), "{e}");
    let again = ensure_cache_at(&changed, &path, &quiet()).unwrap();
    assert!(again.built.is_some());
    assert_eq!(again.cache.source(), changed.identity());
    // The default location is per source, so the two never share a file.
    let root = tmp.path().join("root");
    assert_ne!(
        krasis_cache::cache_path(&source, Some(&root)).unwrap(),
        krasis_cache::cache_path(&changed, Some(&root)).unwrap()
    );
}

#[test]
fn different_geometry_is_a_mismatch() {
    let tmp = tempfile::tempdir().unwrap();
    let source = ModelSource::open(&small_model(tmp.path())).unwrap();
    let path = cache_file(tmp.path());
    build(&source, &path, &quiet()).unwrap();
    let mut o = small_overrides();
    o.push(("num_experts".into(), serde_json::json!(16)));
    let other = spec("tiny", 7, &o);
    let e = ExpertCache::open(&path, other.config(), source.format()).unwrap_err();
    assert!(matches!(e, CacheError::Mismatch { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("num_experts is 8 in the cache but 16"),
        "{e}"
    );
}

#[test]
fn aborted_build_leaves_nothing_and_next_build_succeeds() {
    let tmp = tempfile::tempdir().unwrap();
    let source = ModelSource::open(&small_model(tmp.path())).unwrap();
    let path = cache_file(tmp.path());
    let fail = |d: &krasis_cache::LayerDone| {
        if d.index == 1 {
            Err("injected failure".to_string())
        } else {
            Ok(())
        }
    };
    let opts = BuildOptions {
        on_layer: Some(&fail),
        ..quiet()
    };
    let e = build(&source, &path, &opts).unwrap_err();
    assert!(matches!(e, CacheError::Aborted { .. }), "{e}");
    assert!(!path.exists());
    let leftovers: Vec<_> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp."))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    assert!(
        ensure_cache_at(&source, &path, &quiet())
            .unwrap()
            .built
            .is_some()
    );
}

#[test]
fn concurrent_builders_wait_or_fail_cleanly() {
    use std::sync::mpsc;
    let tmp = tempfile::tempdir().unwrap();
    let source = ModelSource::open(&small_model(tmp.path())).unwrap();
    let path = cache_file(tmp.path());
    let (source, path) = (&source, path.as_path());
    let (started_tx, started_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    std::thread::scope(|s| {
        // Moved in, so a builder that fails early drops them and the
        // main thread's recv fails instead of hanging.
        let (started_tx, go_rx) = (
            std::sync::Mutex::new(started_tx),
            std::sync::Mutex::new(go_rx),
        );
        let a = s.spawn(move || {
            // Holds the lock mid-build until the main thread has tried.
            let hook = |d: &krasis_cache::LayerDone| {
                if d.index == 0 {
                    started_tx.lock().unwrap().send(()).unwrap();
                    go_rx.lock().unwrap().recv().unwrap();
                }
                Ok(())
            };
            let opts = BuildOptions {
                on_layer: Some(&hook),
                ..quiet()
            };
            build(source, path, &opts)
        });
        if started_rx.recv().is_err() {
            panic!("first builder failed: {:?}", a.join().unwrap().unwrap_err());
        }
        let refuse = BuildOptions {
            wait: LockWait::Fail,
            ..quiet()
        };
        let e = build(source, path, &refuse).unwrap_err();
        assert!(matches!(e, CacheError::Busy { .. }), "{e}");
        assert!(e.to_string().contains("another process is building"), "{e}");
        let waiter = s.spawn(|| ensure_cache_at(source, path, &quiet()));
        std::thread::sleep(std::time::Duration::from_millis(100));
        go_tx.send(()).unwrap();
        a.join().unwrap().unwrap();
        let w = waiter.join().unwrap().unwrap();
        assert!(w.built.is_none(), "the waiter reuses the finished cache");
    });
    ExpertCache::open(path, source.config(), source.format()).unwrap();
}

#[test]
fn synthetic_source_quantizes_to_the_same_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let full = write_synth(
        tmp.path(),
        "full",
        spec("tiny", 3, &small_overrides()),
        false,
    );
    let lean = write_synth(
        tmp.path(),
        "lean",
        spec("tiny", 3, &small_overrides()),
        true,
    );
    let a = ModelSource::open(&full).unwrap();
    let b = ModelSource::open(&lean).unwrap();
    assert!(!a.is_synthetic() && b.is_synthetic());
    assert!(matches!(b.identity(), SourceIdentity::Synthetic { .. }));
    let pa = tmp.path().join("a").join(krasis_cache::FILE_NAME);
    let pb = tmp.path().join("b").join(krasis_cache::FILE_NAME);
    let ca = ensure_cache_at(&a, &pa, &quiet()).unwrap().cache;
    let cb = ensure_cache_at(&b, &pb, &quiet()).unwrap().cache;
    assert_eq!(ca.data(), cb.data());
    assert!(ca.header().source_content_blake3.is_some());
    assert!(cb.header().source_content_blake3.is_none());
    krasis_cache::verify_against_source(&ca, &a).unwrap();
    krasis_cache::verify_against_source(&cb, &b).unwrap();
    // Without the recipe the lean checkpoint has nothing to quantize.
    std::fs::remove_file(lean.join(krasis_model::synth::RECORD_FILE)).unwrap();
    let e = ModelSource::open(&lean).unwrap_err();
    assert!(e.to_string().contains("mlp.experts.0"), "{e}");
}

/// File and absolute byte offset of `tensor`'s data in a safetensors checkpoint.
fn tensor_file_offset(model: &Path, tensor: &str) -> (PathBuf, u64) {
    let index = model.join("model.safetensors.index.json");
    let file = if index.exists() {
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&index).unwrap()).unwrap();
        model.join(v["weight_map"][tensor].as_str().unwrap())
    } else {
        model.join("model.safetensors")
    };
    let bytes = std::fs::read(&file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n as usize]).unwrap();
    let start = header[tensor]["data_offsets"][0].as_u64().unwrap();
    (file, 8 + n + start)
}

#[test]
fn verify_requantizes_and_catches_changed_source_content() {
    let tmp = tempfile::tempdir().unwrap();
    let model = small_model(tmp.path());
    let source = ModelSource::open(&model).unwrap();
    let path = cache_file(tmp.path());
    let cache = ensure_cache_at(&source, &path, &quiet()).unwrap().cache;
    let report = krasis_cache::verify_against_source(&cache, &source).unwrap();
    assert_eq!(report.experts, 3 * 8);
    drop(cache);
    // Change one weight of an expert the open-time sample does not cover:
    // the cheap identity still matches, the full verification does not.
    let [gate, _, _] = source.config().expert_tensor_names(1, 3);
    let (file, off) = tensor_file_offset(&model, &gate);
    drop(source);
    {
        use std::os::unix::fs::FileExt;
        // Element 500 becomes BF16 1.0, far above the group's other values.
        let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
        f.write_all_at(&[0x80, 0x3F], off + 1000).unwrap();
    }
    let source = ModelSource::open(&model).unwrap();
    let cache = krasis_cache::open_for_source(&path, &source).unwrap();
    let e = krasis_cache::verify_against_source(&cache, &source).unwrap_err();
    assert!(e.to_string().contains("expert 3 of layer 1"), "{e}");
    // A different seed with identical names and shapes is caught at open.
    let other = write_synth(
        tmp.path(),
        "seed8",
        spec("tiny", 8, &small_overrides()),
        false,
    );
    let other = ModelSource::open(&other).unwrap();
    assert_ne!(other.identity(), source.identity());
}
