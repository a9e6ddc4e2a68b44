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

// ---- The encoder (`mxfp4/encode.rs`) ----

/// Deterministic test values of assorted magnitudes (no RNG crate needed).
fn lcg_values(seed: u64, n: usize, spread: i32) -> Vec<f32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (x >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
            let e = ((x >> 8) % (2 * spread as u64 + 1)) as i32 - spread;
            (u * 2.0 - 1.0) * 2f32.powi(e)
        })
        .collect()
}

#[test]
fn encoder_scale_is_the_smallest_that_fits_the_block_max() {
    // amax <= 6 * 2^e, smallest e: 6 → 2^0, 6.0001 → 2^1, 3 → 2^-1, 0.75 → 2^-3.
    assert_eq!(scale_for(6.0), Some(127));
    assert_eq!(scale_for(6.000001), Some(128));
    assert_eq!(scale_for(3.0), Some(126));
    assert_eq!(scale_for(3.000001), Some(127));
    assert_eq!(scale_for(0.75), Some(124));
    // Zero and blocks below 6 * 2^-127 take byte 0.
    assert_eq!(scale_for(0.0), Some(0));
    assert_eq!(scale_for(f32::MIN_POSITIVE), Some(0));
    // The largest accepted scale, and refusals above it / for non-finite.
    assert_eq!(scale_for(6.0 * 2f32.powi(125)), Some(MAX_ENCODED_SCALE));
    assert_eq!(scale_for(f32::MAX), None);
    assert_eq!(scale_for(f32::INFINITY), None);
    assert_eq!(scale_for(f32::NAN), None);
    for seed in 0..200 {
        let v = lcg_values(seed, 32, 40);
        let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
        let s = scale_for(amax).unwrap();
        let e = i32::from(s) - SCALE_BIAS;
        assert!(f64::from(amax) <= 6.0 * 2f64.powi(e), "{amax} {s}");
        assert!(
            s == 0 || f64::from(amax) > 6.0 * 2f64.powi(e - 1),
            "{amax} {s}"
        );
    }
}

#[test]
fn encoder_rounds_to_the_nearest_representable_value_ties_to_even() {
    for seed in 0..500 {
        let v = lcg_values(seed, 32, 30);
        let mut block = [0u8; BLOCK_BYTES];
        let s = encode_block(&v, &mut block).unwrap();
        let mut out = [0f32; BLOCK_VALUES];
        decode_block(&block, s, &mut out);
        let scale = f64::from(e8m0_to_f32(s));
        for (x, y) in v.iter().zip(out) {
            // No value of this scale is nearer than the one chosen.
            let err = (f64::from(*x) - f64::from(y)).abs();
            for m in E2M1_VALUES {
                let cand = f64::from(m) * scale;
                assert!(
                    err <= (f64::from(*x) - cand).abs(),
                    "{x} → {y}, {cand} nearer"
                );
            }
        }
    }
    // Ties at scale 1 go to the even code: 0.25→0, 0.75→1, 1.25→1, 1.75→2,
    // 2.5→2, 3.5→4, 5→4 (the block max 6 pins the scale to 2^0).
    let mut v = [0f32; 32];
    v[0] = 6.0;
    let ties = [
        (0.25, 0.0),
        (0.75, 1.0),
        (1.25, 1.0),
        (1.75, 2.0),
        (2.5, 2.0),
        (3.5, 4.0),
        (5.0, 4.0),
    ];
    for (i, (x, _)) in ties.iter().enumerate() {
        v[1 + 2 * i] = *x;
        v[2 + 2 * i] = -*x;
    }
    let q = quantize_block(&v).unwrap();
    for (i, (x, want)) in ties.iter().enumerate() {
        assert_eq!(q[1 + 2 * i], *want, "{x}");
        assert_eq!(q[2 + 2 * i], -*want, "-{x}");
    }
    // A negative value that rounds to zero keeps its sign (code 8).
    v[1] = -0.1;
    let mut block = [0u8; BLOCK_BYTES];
    encode_block(&v, &mut block).unwrap();
    assert_eq!(block[0] >> 4, 8);
    assert_eq!(block[0] & 0x0F, 7); // 6.0 is code 7
}

#[test]
fn encoder_is_exact_for_representable_blocks() {
    for s in [0u8, 1, 100, 127, 140, MAX_ENCODED_SCALE] {
        for seed in 0..50 {
            let codes: Vec<u8> = lcg_values(seed + u64::from(s) * 1000, 32, 0)
                .iter()
                .map(|u| ((u.abs() * 16.0) as u8).min(15))
                .collect();
            let v: Vec<f32> = codes.iter().map(|&c| decode(c, s)).collect();
            let q = quantize_block(&v).unwrap();
            for (a, b) in v.iter().zip(q) {
                assert_eq!(*a, b, "scale {s}");
            }
        }
    }
}

#[test]
fn encode_rows_lays_blocks_out_like_the_checkpoint() {
    let (rows, cols) = (3, 64);
    let v = lcg_values(7, rows * cols, 4);
    let mut blocks = vec![0u8; rows * cols / 2];
    let mut scales = vec![0u8; rows * cols / 32];
    encode_rows(&v, cols, &mut blocks, &mut scales).unwrap();
    let shape = Mxfp4Shape::new(1, rows, cols).unwrap();
    let t = Mxfp4Tensor::new("t", shape, &blocks, &scales).unwrap();
    let m = t.expert(0).unwrap();
    let mut row = vec![0f32; cols];
    for r in 0..rows {
        m.dequant_row(r, &mut row);
        for (k, chunk) in v[r * cols..(r + 1) * cols].chunks(32).enumerate() {
            assert_eq!(
                &row[k * 32..(k + 1) * 32],
                &quantize_block(chunk).unwrap()[..]
            );
        }
    }
    let mut bad = v.clone();
    bad[100] = f32::NAN;
    assert_eq!(encode_rows(&bad, cols, &mut blocks, &mut scales), Err(3));
}
