use super::*;

/// Writes `model.safetensors` holding `tensors` (name, dtype, shape, bytes).
fn write(dir: &Path, tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape,
                "data_offsets": [data.len(), data.len() + bytes.len()]}),
        );
        data.extend_from_slice(bytes);
    }
    let h = serde_json::to_vec(&header).unwrap();
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&h);
    file.extend_from_slice(&data);
    std::fs::write(dir.join("model.safetensors"), file).unwrap();
}

#[test]
fn checkpoint_u8_tensors_are_raw_bytes_not_floats() {
    let tmp = tempfile::tempdir().unwrap();
    let blocks: Vec<u8> = (0..64).collect();
    let bias = half::bf16::from_f32(1.5).to_le_bytes().repeat(2);
    write(
        tmp.path(),
        &[
            ("e.blocks", "U8", vec![1, 2, 2, 16], blocks.clone()),
            ("e.bias", "BF16", vec![1, 2], bias),
        ],
    );
    let ck = Checkpoint::open(tmp.path()).unwrap();
    let raw = ck.expect_raw("e.blocks", &[1, 2, 2, 16]).unwrap();
    assert_eq!(raw.dtype, StoredDType::U8);
    assert_eq!(raw.bytes, &blocks[..]);
    assert_eq!(raw.as_mxfp4_raw().dtype, "U8");
    // The float view refuses packed bytes with a typed error, no panic.
    match ck.get("e.blocks") {
        Err(ModelError::WrongDtype { tensor, found, .. }) => {
            assert_eq!(tensor, "e.blocks");
            assert!(found.starts_with("U8"), "{found}");
        }
        other => panic!("expected WrongDtype, got {other:?}"),
    }
    assert!(ck.read_f32("e.blocks", &[1, 2, 2, 16]).is_err());
    assert!(ck.expect_raw("e.blocks", &[2, 2, 16]).is_err());
    // Floats read both ways.
    assert_eq!(ck.get("e.bias").unwrap().to_f32(), vec![1.5, 1.5]);
    assert_eq!(
        ck.raw("e.bias").unwrap().dtype,
        StoredDType::Float(DType::BF16)
    );
    // validate() accepts U8 tensors at their shapes.
    ck.validate(&[
        ("e.blocks".into(), vec![1, 2, 2, 16]),
        ("e.bias".into(), vec![1, 2]),
    ])
    .unwrap();
}

#[test]
fn checkpoint_u8_length_is_checked_and_unknown_dtypes_refused() {
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), &[("s", "U8", vec![2, 3], vec![0; 5])]);
    let e = Checkpoint::open(tmp.path()).unwrap_err();
    assert!(e.to_string().contains("needs 6"), "{e}");
    write(tmp.path(), &[("i", "I64", vec![1], vec![0; 8])]);
    let ck = Checkpoint::open(tmp.path()).unwrap();
    assert!(matches!(ck.raw("i"), Err(ModelError::WrongDtype { .. })));
}
