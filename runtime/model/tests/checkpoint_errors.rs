//! A bad checkpoint is reported with the file, the tensor and what was
//! expected; it never panics. Files are written by hand here so every
//! defect is exact.

use krasis_model::{Checkpoint, ModelConfig, ModelError};
use std::path::Path;

/// Writes a safetensors file from (name, dtype, shape) with zero data.
fn write_st(path: &Path, tensors: &[(&str, &str, &[usize])]) {
    let mut header = serde_json::Map::new();
    let mut off = 0usize;
    for (name, dtype, shape) in tensors {
        let el = match *dtype {
            "F32" | "I32" => 4,
            _ => 2,
        };
        let n = shape.iter().product::<usize>() * el;
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}),
        );
        off += n;
    }
    let h = serde_json::to_vec(&header).unwrap();
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&h);
    bytes.resize(bytes.len() + off, 0);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn truncated_shard_names_tensor_and_file() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("model.safetensors");
    write_st(&p, &[("a", "BF16", &[4, 4]), ("b", "F32", &[8])]);
    let len = std::fs::metadata(&p).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(len - 3)
        .unwrap();
    let e = Checkpoint::open(d.path()).unwrap_err();
    assert!(
        matches!(&e, ModelError::Truncated { tensor, .. } if tensor == "b"),
        "{e}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("model.safetensors") && msg.contains("'b'"),
        "{msg}"
    );
}

#[test]
fn wrong_shape_and_dtype_are_reported_with_expected_and_found() {
    let d = tempfile::tempdir().unwrap();
    write_st(
        &d.path().join("model.safetensors"),
        &[("w", "BF16", &[2, 3]), ("i", "I32", &[2])],
    );
    let c = Checkpoint::open(d.path()).unwrap();
    let e = c.expect("w", &[3, 2]).unwrap_err().to_string();
    assert!(
        e.contains("'w'") && e.contains("[3, 2]") && e.contains("[2, 3]"),
        "{e}"
    );
    let e = c.get("i").unwrap_err().to_string();
    assert!(e.contains("I32") && e.contains("BF16, F16 or F32"), "{e}");
    let e = c.get("nope").unwrap_err();
    assert!(matches!(e, ModelError::MissingTensor { .. }));
}

#[test]
fn validate_reports_missing_and_unexpected_tensors() {
    let d = tempfile::tempdir().unwrap();
    write_st(
        &d.path().join("model.safetensors"),
        &[("a", "F32", &[2]), ("extra", "F32", &[1])],
    );
    let c = Checkpoint::open(d.path()).unwrap();
    let e = c
        .validate(&[("a".into(), vec![2]), ("b".into(), vec![2])])
        .unwrap_err();
    assert!(
        matches!(&e, ModelError::MissingTensor { tensor, .. } if tensor == "b"),
        "{e}"
    );
    let e = c
        .validate(&[("a".into(), vec![2])])
        .unwrap_err()
        .to_string();
    assert!(e.contains("extra"), "{e}");
}

#[test]
fn sharded_index_with_missing_shard_or_misplaced_tensor() {
    let d = tempfile::tempdir().unwrap();
    write_st(
        &d.path().join("model-00001-of-00002.safetensors"),
        &[("a", "F32", &[2])],
    );
    let index = serde_json::json!({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}});
    std::fs::write(
        d.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let e = Checkpoint::open(d.path()).unwrap_err();
    assert!(matches!(e, ModelError::MissingFile { .. }), "{e}");
    write_st(
        &d.path().join("model-00002-of-00002.safetensors"),
        &[("c", "F32", &[2])],
    );
    let e = Checkpoint::open(d.path()).unwrap_err().to_string();
    assert!(e.contains("'b'") && e.contains("does not list it"), "{e}");
}

#[test]
fn garbage_and_missing_files_are_errors_not_panics() {
    let d = tempfile::tempdir().unwrap();
    let e = Checkpoint::open(d.path()).unwrap_err();
    assert!(matches!(e, ModelError::MissingFile { .. }), "{e}");
    std::fs::write(
        d.path().join("model.safetensors"),
        b"\x05\0\0\0\0\0\0\0{nope",
    )
    .unwrap();
    let e = Checkpoint::open(d.path()).unwrap_err().to_string();
    assert!(e.contains("not valid JSON"), "{e}");
    std::fs::write(
        d.path().join("model.safetensors"),
        b"\xff\xff\xff\xff\0\0\0\0",
    )
    .unwrap();
    let e = Checkpoint::open(d.path()).unwrap_err().to_string();
    assert!(e.contains("does not fit"), "{e}");
}

#[test]
fn config_errors_name_the_problem() {
    let d = tempfile::tempdir().unwrap();
    let e = ModelConfig::load(d.path()).unwrap_err();
    assert!(matches!(e, ModelError::MissingFile { .. }), "{e}");
    std::fs::write(d.path().join("config.json"), r#"{"model_type": "llama"}"#).unwrap();
    let e = ModelConfig::load(d.path()).unwrap_err().to_string();
    assert!(e.contains("'llama'") && e.contains("qwen3_moe"), "{e}");
    std::fs::write(
        d.path().join("config.json"),
        r#"{"model_type": "qwen3_moe", "hidden_size": 8}"#,
    )
    .unwrap();
    let e = ModelConfig::load(d.path()).unwrap_err().to_string();
    assert!(e.contains("invalid config"), "{e}");
}

#[test]
fn synthetic_checkpoint_with_a_truncated_shard_is_refused() {
    let src = krasis_model::testutil::tiny_checkpoint("tiny");
    let d = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let p = entry.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, d.path().join(p.file_name().unwrap())).unwrap();
        }
    }
    let cfg = ModelConfig::load(d.path()).unwrap();
    Checkpoint::open(d.path())
        .unwrap()
        .validate(&cfg.expected_tensors())
        .unwrap();
    let shard = std::fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .unwrap();
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let e = Checkpoint::open(d.path()).unwrap_err();
    assert!(matches!(e, ModelError::Truncated { .. }), "{e}");
}
