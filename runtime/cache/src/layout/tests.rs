use super::*;

/// The format-1 arrays, written out independently: format 2 INT4 group 128
/// must be byte-identical to them.
fn v1_offsets(h: usize, i: usize) -> [usize; 5] {
    let a = |x: usize| x.div_ceil(256) * 256;
    let w13_s = a(i * h);
    let w2_q = a(w13_s + 2 * i * (h / 128) * 2);
    let w2_s = a(w2_q + h * i / 2);
    let used = w2_s + h * (i / 128) * 2;
    [w13_s, w2_q, w2_s, used, used.div_ceil(4096) * 4096]
}

#[test]
fn int4_group_128_is_the_format_1_layout() {
    for (h, i) in [(2048, 768), (4096, 1536), (128, 128), (5120, 1408)] {
        let Some(l) = ExpertLayout::int4(h, i) else {
            continue;
        };
        if l.group() != 128 {
            continue;
        }
        assert_eq!(
            [l.w13_s, l.w2_q, l.w2_s, l.used_bytes, l.expert_stride],
            v1_offsets(h, i),
            "{h}x{i}"
        );
        assert_eq!(l.w13_b, l.w2_q, "no bias array between w13_s and w2_q");
    }
    let l = ExpertLayout::int4(2048, 768).unwrap();
    assert_eq!(l.w13_s, 2 * 768 * 2048 / 2);
    assert!(ExpertLayout::int4(2048, 100).is_none());
}

#[test]
fn int4_group_is_the_largest_dividing_both() {
    let g = |h, i| ExpertFormat::int4_for(h, i).map(|f| f.group());
    assert_eq!(g(2048, 768), Some(128));
    assert_eq!(g(4096, 1408), Some(128));
    assert_eq!(g(192, 64), Some(64));
    assert_eq!(g(2880, 2880), Some(64));
    assert_eq!(g(96, 160), Some(32));
    assert_eq!(g(2880, 1440), Some(32));
    assert_eq!(g(100, 128), None);
    assert_eq!(g(0, 128), None);
}

#[test]
fn int4_group_64_offsets_by_hand() {
    let l = ExpertLayout::new(ExpertFormat::Int4 { group: 64 }, 192, 64, false).unwrap();
    // w13_q: 2*64 rows x 96 bytes; w13_s: 128 rows x 3 f16; w2_q: 192 x 32;
    // w2_s: 192 rows x 1 f16.
    assert_eq!((l.w13_q, l.w13_s, l.w13_b), (0, 12288, 13056));
    assert_eq!((l.w2_q, l.w2_s), (13056, 19200));
    assert_eq!((l.used_bytes, l.expert_stride), (19584, 20480));
    assert!(ExpertLayout::new(ExpertFormat::Int4 { group: 64 }, 192, 96, false).is_none());
    // Format 2 defines biases for MXFP4 only.
    assert!(ExpertLayout::new(ExpertFormat::Int4 { group: 64 }, 192, 64, true).is_none());
}

#[test]
fn mxfp4_offsets_by_hand() {
    let b = ExpertLayout::new(ExpertFormat::Mxfp4, 64, 32, true).unwrap();
    // w13_q 64 rows x 32 B = 2048; w13_s 64 x 2 = 128 -> w13_b at 2304 (2I
    // bf16 = 128) -> w2_q at 2560 (64 x 16 = 1024) -> w2_s at 3584 (64 x 1)
    // -> w2_b at 3840 (H bf16 = 128) -> used 3968.
    assert_eq!(
        [b.w13_q, b.w13_s, b.w13_b, b.w2_q, b.w2_s, b.w2_b],
        [0, 2048, 2304, 2560, 3584, 3840]
    );
    assert_eq!((b.used_bytes, b.expert_stride), (3968, 4096));
    assert_eq!((b.w13_b_bytes(), b.w2_b_bytes()), (128, 128));
    let n = ExpertLayout::new(ExpertFormat::Mxfp4, 64, 32, false).unwrap();
    assert_eq!(
        [n.w13_q, n.w13_s, n.w13_b, n.w2_q, n.w2_s],
        [0, 2048, 2304, 2304, 3328]
    );
    assert_eq!(
        (n.w13_b_bytes(), n.w2_b_bytes(), n.used_bytes),
        (0, 0, 3392)
    );
    // gpt-oss-20b: 2880 x 2880 experts are a multiple of 32.
    let g = ExpertLayout::new(ExpertFormat::Mxfp4, 2880, 2880, true).unwrap();
    assert_eq!(g.w13_s - g.w13_q, 2 * 2880 * 2880 / 2);
    assert!(ExpertLayout::new(ExpertFormat::Mxfp4, 2880, 48, true).is_none());
    for off in [g.w13_s, g.w13_b, g.w2_q, g.w2_s, g.w2_b] {
        assert_eq!(off % 256, 0);
    }
}

#[test]
fn format_serializes_explicitly_and_refuses_unknown_records() {
    let s = |f: ExpertFormat| serde_json::to_string(&f).unwrap();
    assert_eq!(
        s(ExpertFormat::Int4 { group: 64 }),
        r#"{"precision":"int4","group":64}"#
    );
    assert_eq!(
        s(ExpertFormat::Mxfp4),
        r#"{"precision":"mxfp4","group":32}"#
    );
    for f in [ExpertFormat::Int4 { group: 32 }, ExpertFormat::Mxfp4] {
        assert_eq!(serde_json::from_str::<ExpertFormat>(&s(f)).unwrap(), f);
    }
    for bad in [
        r#"{"precision":"int4","group":16}"#,
        r#"{"precision":"mxfp4","group":64}"#,
        r#"{"precision":"fp8","group":128}"#,
        r#"{"precision":"int4"}"#,
    ] {
        assert!(serde_json::from_str::<ExpertFormat>(bad).is_err(), "{bad}");
    }
}
