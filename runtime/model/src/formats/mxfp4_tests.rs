//! Tests of the MXFP4 decoder: hand-computed values from the OCP MX v1.0
//! tables, and bit-for-bit agreement with the independent NumPy oracle's
//! fixture (`tools/witness/mxfp4_oracle.py` → `tests/fixtures/mxfp4/decode.json`).

use super::mxfp4::*;
use serde::Deserialize;
use std::path::Path;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn raw<'h, 'a>(shape: &'h [usize], bytes: &'a [u8]) -> RawTensor<'h, 'a> {
    RawTensor {
        dtype: "U8",
        shape,
        bytes,
    }
}

#[test]
fn hand_computed_values_from_the_spec_tables() {
    // E8M0: 2^(s-127); 0 is the f32 subnormal 2^-127; 255 is NaN.
    assert_eq!(e8m0_to_f32(127), 1.0);
    assert_eq!(e8m0_to_f32(128), 2.0);
    assert_eq!(e8m0_to_f32(120), 1.0 / 128.0);
    assert_eq!(e8m0_to_f32(1), f32::MIN_POSITIVE); // 2^-126
    assert_eq!(e8m0_to_f32(0), f32::MIN_POSITIVE / 2.0);
    assert_eq!(e8m0_to_f32(254), 2.0f32.powi(127));
    assert!(e8m0_to_f32(255).is_nan());
    // E2M1 by bit fields: 0b0101 = exponent 2 (2^1), mantissa 1 → 3;
    // 0b0001 = subnormal 0.5; 0b1111 = -(2^2 * 1.5) = -6; 0b1000 = -0.
    assert_eq!(decode(0b0101, 127), 3.0);
    assert_eq!(decode(0b0001, 127), 0.5);
    assert_eq!(decode(0b1111, 127), -6.0);
    assert_eq!(decode(0b1000, 127).to_bits(), (-0.0f32).to_bits());
    assert_eq!(decode(0b0111, 125), 1.5); // 6 * 2^-2
    assert_eq!(decode(0b0001, 0), 2.0f32.powi(-128)); // smallest non-zero weight
    // Byte 0x2F: element 0 is the LOW nibble (0xF = -6), element 1 the high (0x2 = 1).
    let mut block = [0u8; 16];
    block[0] = 0x2F;
    block[15] = 0x90; // element 30: 0 → +0, element 31: 0x9 → -0.5
    let mut out = [7.0f32; 32];
    decode_block(&block, 128, &mut out);
    assert_eq!(out[0], -12.0);
    assert_eq!(out[1], 2.0);
    assert_eq!(out[30].to_bits(), 0.0f32.to_bits());
    assert_eq!(out[31], -1.0);
    assert!(out[2..30].iter().all(|v| v.to_bits() == 0));
}

#[test]
fn every_finite_product_is_exact_and_the_overflow_edge_is_where_documented() {
    // Exact: each finite product divided by its scale gives back the table
    // value (true only without rounding), for every scale and code.
    for s in 0..=254u8 {
        for code in 0..16u8 {
            let v = decode(code, s);
            if v.is_finite() {
                let back = (f64::from(v) / 2f64.powi(i32::from(s) - 127)) as f32;
                assert_eq!(back.to_bits(), E2M1_VALUES[usize::from(code)].to_bits());
            } else {
                assert!(s >= FIRST_SCALE_THAT_CAN_OVERFLOW, "code {code} scale {s}");
            }
        }
    }
    assert!(decode(7, FIRST_SCALE_THAT_CAN_OVERFLOW - 1).is_finite()); // 6 * 2^125
    assert!(decode(6, FIRST_SCALE_THAT_CAN_OVERFLOW).is_infinite()); // 4 * 2^126
    assert!(decode(5, FIRST_SCALE_THAT_CAN_OVERFLOW).is_finite()); // 3 * 2^126
}

#[test]
fn byte_accounting_is_4_25_bits_per_weight() {
    assert_eq!(BITS_PER_WEIGHT, 4.25);
    // gpt-oss-20b: 32 experts, hidden 2880, expert FFN 2880.
    let gate_up = Mxfp4Shape::new(32, 2 * 2880, 2880).unwrap();
    assert_eq!(gate_up.blocks_shape(), [32, 5760, 90, 16]);
    assert_eq!(gate_up.scales_shape(), [32, 5760, 90]);
    assert_eq!(gate_up.expert_blocks_bytes(), 5760 * 2880 / 2);
    assert_eq!(gate_up.expert_scales_bytes(), 5760 * 90);
    assert_eq!(gate_up.total_bytes(), 282_009_600);
    assert_eq!(
        gate_up.total_bytes() as f64 * 8.0 / gate_up.weights() as f64,
        4.25
    );
    assert!(Mxfp4Shape::new(1, 4, 48).is_none());
    assert!(Mxfp4Shape::new(0, 4, 32).is_none());
}

#[derive(Deserialize)]
struct Case {
    name: String,
    experts: usize,
    rows: usize,
    cols: usize,
    blocks: String,
    scales: Vec<u8>,
    #[serde(default)]
    expected_f32_bits: Vec<u32>,
    #[serde(default)]
    expert: usize,
    #[serde(default)]
    row: usize,
    #[serde(default)]
    block: usize,
    #[serde(default)]
    reason: String,
}

#[derive(Deserialize)]
struct Fixture {
    decoded: Vec<Case>,
    refused: Vec<Case>,
}

fn fixture() -> Fixture {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/mxfp4/decode.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run tools/witness/mxfp4_oracle.py)",
            path.display()
        )
    });
    serde_json::from_str(&text).unwrap()
}

impl Case {
    fn tensor<'a>(&'a self, blocks: &'a [u8]) -> Result<Mxfp4Tensor<'a>, Mxfp4Error> {
        let g = self.cols / 32;
        Mxfp4Tensor::from_safetensors(
            &self.name,
            raw(&[self.experts, self.rows, g, 16], blocks),
            raw(&[self.experts, self.rows, g], &self.scales),
        )
    }
}

#[test]
fn decode_matches_the_numpy_oracle_bit_for_bit() {
    let fx = fixture();
    assert!(fx.decoded.len() >= 5);
    for case in &fx.decoded {
        let blocks = hex(&case.blocks);
        let t = case.tensor(&blocks).unwrap();
        let mut got = Vec::new();
        for e in 0..case.experts {
            got.extend(t.expert(e).unwrap().dequant().iter().map(|v| v.to_bits()));
        }
        assert!(t.expert(case.experts).is_none());
        assert_eq!(got.len(), case.expected_f32_bits.len(), "{}", case.name);
        for (i, (g, w)) in got.iter().zip(&case.expected_f32_bits).enumerate() {
            assert_eq!(
                g,
                w,
                "{}: element {i}: Rust {} vs oracle {}",
                case.name,
                f32::from_bits(*g),
                f32::from_bits(*w)
            );
        }
    }
}

#[test]
fn refusals_match_the_numpy_oracle() {
    let fx = fixture();
    assert!(fx.refused.len() >= 3);
    for case in &fx.refused {
        let blocks = hex(&case.blocks);
        let err = case.tensor(&blocks).unwrap_err();
        let (expert, row, block, reason) = match &err {
            Mxfp4Error::NanScale {
                expert, row, block, ..
            } => (*expert, *row, *block, "nan_scale"),
            Mxfp4Error::Overflow {
                expert, row, block, ..
            } => (*expert, *row, *block, "overflow"),
            other => panic!("{}: unexpected error {other}", case.name),
        };
        assert_eq!(
            (expert, row, block, reason),
            (case.expert, case.row, case.block, case.reason.as_str()),
            "{}: {err}",
            case.name
        );
        // The same expert's bytes refused on their own (the cache's path).
        let shape = Mxfp4Shape::new(case.experts, case.rows, case.cols).unwrap();
        let (nb, ns) = (shape.expert_blocks_bytes(), shape.expert_scales_bytes());
        let e = case.expert;
        let m = Mxfp4Matrix::new(
            &case.name,
            e,
            case.rows,
            case.cols,
            &blocks[e * nb..(e + 1) * nb],
            &case.scales[e * ns..(e + 1) * ns],
        );
        assert_eq!(m.unwrap_err(), err, "{}", case.name);
    }
}

#[test]
fn the_nan_scale_message_names_the_place_and_the_fix() {
    let blocks = [0u8; 32];
    let err = Mxfp4Matrix::new("m.experts.down_proj", 3, 1, 64, &blocks, &[127, 255]).unwrap_err();
    let msg = err.to_string();
    for want in [
        "m.experts.down_proj",
        "expert 3",
        "row 0",
        "block 1",
        "32..64",
        "NaN",
        "re-download",
    ] {
        assert!(msg.contains(want), "{msg}");
    }
}

#[test]
fn wrong_dtype_shape_or_length_is_refused() {
    let blocks = vec![0u8; 2 * 3 * 16];
    let scales = vec![127u8; 2 * 3];
    let ok =
        Mxfp4Tensor::from_safetensors("p", raw(&[2, 3, 1, 16], &blocks), raw(&[2, 3, 1], &scales));
    assert_eq!(ok.unwrap().shape(), Mxfp4Shape::new(2, 3, 32).unwrap());

    let bf16 = RawTensor {
        dtype: "BF16",
        ..raw(&[2, 3, 1], &scales)
    };
    let err = Mxfp4Tensor::from_safetensors("p", raw(&[2, 3, 1, 16], &blocks), bf16).unwrap_err();
    assert!(
        matches!(err, Mxfp4Error::DType { part: "scales", .. }),
        "{err}"
    );

    for bad in [&[2, 3, 2, 8][..], &[6, 1, 16], &[2, 3, 0, 16]] {
        let err = Mxfp4Tensor::from_safetensors("p", raw(bad, &blocks), raw(&[2, 3, 1], &scales))
            .unwrap_err();
        assert!(
            matches!(err, Mxfp4Error::Shape { part: "blocks", .. }),
            "{err}"
        );
    }
    let err =
        Mxfp4Tensor::from_safetensors("p", raw(&[2, 3, 1, 16], &blocks), raw(&[2, 1, 3], &scales))
            .unwrap_err();
    assert!(
        matches!(err, Mxfp4Error::Shape { part: "scales", .. }),
        "{err}"
    );

    let err = Mxfp4Tensor::from_safetensors(
        "p",
        raw(&[2, 3, 1, 16], &blocks[1..]),
        raw(&[2, 3, 1], &scales),
    )
    .unwrap_err();
    assert_eq!(
        err,
        Mxfp4Error::Length {
            tensor: "p".into(),
            part: "blocks",
            found: 95,
            expected: 96
        }
    );
    assert!(Mxfp4Matrix::new("p", 0, 3, 32, &blocks[..48], &scales[..2]).is_err());
    assert!(Mxfp4Matrix::new("p", 0, 3, 40, &blocks[..48], &scales[..3]).is_err());
}

#[test]
fn gate_up_rows_are_interleaved_even_gate_odd_up() {
    // Two gate/up pairs, K = 32: row r is all code 1 (0.5) times 2^r.
    let blocks: Vec<u8> = (0..4).flat_map(|_| [0x11u8; 16]).collect();
    let scales = [127, 128, 129, 130];
    let m = Mxfp4Matrix::new("gate_up", 0, 4, 32, &blocks, &scales).unwrap();
    let (gate, up) = m.dequant_gate_up();
    assert_eq!(gate.len(), 64);
    assert!(gate[..32].iter().all(|&v| v == 0.5) && gate[32..].iter().all(|&v| v == 2.0));
    assert!(up[..32].iter().all(|&v| v == 1.0) && up[32..].iter().all(|&v| v == 4.0));
    let mut row = vec![0.0; 32];
    m.dequant_row(3, &mut row);
    assert_eq!(row, up[32..]);
}
