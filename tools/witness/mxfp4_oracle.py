"""Independent MXFP4 decode (OCP Microscaling Formats v1.0) and its fixture.

Written from the spec, not from the Rust decoder (runtime/model/src/formats/mxfp4.rs):
- E2M1 element: bit 3 sign, bits 2..1 exponent with bias 1, bit 0 mantissa;
  exponent 0 is subnormal, value (-1)^s * 2^(1-1) * (m/2); otherwise
  (-1)^s * 2^(e-1) * (1 + m/2). No infinity or NaN encodings.
- E8M0 scale: 2^(x-127) for x in 0..=254, x = 255 is NaN.
- A weight is element * scale, computed here in float64 (exact: at most two
  significant bits times a power of two within float64's range) and then
  checked to be representable in float32 without rounding.
The packing is the gpt-oss checkpoint convention (the spec leaves it to the
container): `_blocks` [E, R, K/32, 16] u8, element 2j in the low nibble of
byte j, element 2j+1 in the high nibble; `_scales` [E, R, K/32] u8.

A block is refused (the Rust loader must refuse it too) when its scale is NaN
or any product is outside float32's finite range; the fixture records the
first refused (expert, row, block) in row-major order and why.

Usage (only NumPy is needed, except for --transformers):
  python tools/witness/mxfp4_oracle.py          # rewrite the fixture
  python tools/witness/mxfp4_oracle.py --check  # regenerate, compare, exit 1 on difference
  python tools/witness/mxfp4_oracle.py --transformers
      # a second witness where torch and transformers are installed (the GPU
      # machine): decode the committed fixture's cases with transformers'
      # convert_moe_packed_tensors in float32 and bfloat16 and compare bit for bit
"""

import argparse
import json
import os
import sys

import numpy as np

BLOCK = 32
SEED = 20261201
FIXTURE = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "mxfp4", "decode.json")
)
F32_MAX = float(np.finfo(np.float32).max)


def e2m1_value(code):
    """float64 value of E2M1 codes (array of ints 0..15), by the bit fields."""
    code = np.asarray(code, dtype=np.int64)
    sign = (code >> 3) & 1
    exp = (code >> 1) & 3
    man = code & 1
    magnitude = np.where(exp == 0, man * 0.5, np.ldexp(1.0 + man * 0.5, exp - 1))
    return np.where(sign == 1, -magnitude, magnitude)


def e8m0_value(x):
    """float64 value of E8M0 scale bytes; NaN for 255."""
    x = np.asarray(x, dtype=np.int64)
    return np.where(x == 255, np.nan, np.ldexp(1.0, x - 127))


def decode(blocks, scales):
    """float64 weights [E, R, K] from u8 blocks [E, R, K/32, 16] and scales [E, R, K/32]."""
    blocks = np.asarray(blocks, dtype=np.uint8)
    scales = np.asarray(scales, dtype=np.uint8)
    e, r, g, b = blocks.shape
    assert b == BLOCK // 2 and scales.shape == (e, r, g)
    low = blocks.astype(np.int64) % 16
    high = blocks.astype(np.int64) // 16
    codes = np.empty((e, r, g, BLOCK), dtype=np.int64)
    codes[..., 0::2] = low
    codes[..., 1::2] = high
    with np.errstate(invalid="ignore"):
        values = e2m1_value(codes) * e8m0_value(scales)[..., None]
    return values.reshape(e, r, g * BLOCK)


def first_refusal(blocks, scales):
    """(expert, row, block, reason) of the first refused block, or None."""
    values = decode(blocks, scales)
    e, r, g, _ = np.asarray(blocks).shape
    bad = ~(np.abs(values) <= F32_MAX)  # NaN compares false
    bad = bad.reshape(e, r, g, BLOCK).any(axis=3)
    if not bad.any():
        return None
    ie, ir, ib = (int(i) for i in np.argwhere(bad)[0])
    reason = "nan_scale" if int(np.asarray(scales)[ie, ir, ib]) == 255 else "overflow"
    return ie, ir, ib, reason


def f32_bits(values):
    """float32 bit patterns of float64 values that must be exact in float32."""
    f32 = values.astype(np.float32)
    if not np.array_equal(f32.astype(np.float64), values):
        raise AssertionError("an MXFP4 product is not exactly representable in float32")
    return f32.view(np.uint32)


def random_blocks(rng, shape, max_code=15):
    """u8 blocks whose nibbles have magnitude code <= max_code & 7 when max_code < 8."""
    if max_code >= 15:
        return rng.integers(0, 256, size=shape, dtype=np.uint8)
    lo = rng.integers(0, max_code + 1, size=shape) | (rng.integers(0, 2, size=shape) << 3)
    hi = rng.integers(0, max_code + 1, size=shape) | (rng.integers(0, 2, size=shape) << 3)
    return (lo | (hi << 4)).astype(np.uint8)


def cases(rng):
    out = []
    # Every code in both nibble positions at scale 1: byte j = j | (15-j) << 4.
    blocks = np.array([[[[j | ((15 - j) << 4) for j in range(16)]]]], dtype=np.uint8)
    out.append(("all_codes_scale_one", blocks, np.array([[[127]]], dtype=np.uint8)))
    # Zeros and negative zeros at the smallest, a middle and the largest scale.
    blocks = np.array([[[[0x00] * 16], [[0x88] * 16], [[0x80] * 16], [[0x08] * 16]]], dtype=np.uint8)
    out.append(("zeros_and_negative_zeros", blocks, np.array([[[0], [127], [254], [200]]], dtype=np.uint8)))
    # Edge exponents that stay finite in float32: 2^-127 (subnormal scale),
    # 2^-126, around 1, 2^125 with every code (6 * 2^125 is the largest
    # product), 2^126 with |v| <= 3, 2^127 with |v| <= 1.5.
    rows = []
    scales = []
    for s, max_code in [(0, 15), (1, 15), (126, 15), (127, 15), (128, 15), (252, 15), (253, 5), (254, 3)]:
        rows.append(random_blocks(rng, (1, 16), max_code))
        scales.append([s])
    # The largest magnitudes exactly: +-6 at 2^125, +-3 at 2^126, +-1.5 at 2^127.
    rows.append(np.array([[0x7F] * 8 + [0xF7] * 8], dtype=np.uint8))
    scales.append([252])
    rows.append(np.array([[0x5D] * 16], dtype=np.uint8))
    scales.append([253])
    rows.append(np.array([[0x3B] * 16], dtype=np.uint8))
    scales.append([254])
    out.append(("edge_exponents", np.array([rows]), np.array([scales], dtype=np.uint8)))
    # Random bytes, gpt-oss-like scales (around 2^-7..2^3), two experts, 3 blocks a row.
    blocks = rng.integers(0, 256, size=(2, 5, 3, 16), dtype=np.uint8)
    scales = rng.integers(112, 131, size=(2, 5, 3), dtype=np.uint8)
    out.append(("random_two_experts", blocks, scales))
    # Random bytes with any scale below the overflow range.
    blocks = rng.integers(0, 256, size=(1, 4, 2, 16), dtype=np.uint8)
    scales = rng.integers(0, 253, size=(1, 4, 2), dtype=np.uint8)
    out.append(("random_any_finite_scale", blocks, scales))
    return out


def refused(rng):
    out = []
    blocks = rng.integers(0, 256, size=(2, 2, 2, 16), dtype=np.uint8)
    scales = np.full((2, 2, 2), 120, dtype=np.uint8)
    scales[1, 0, 1] = 255
    out.append(("nan_scale", blocks, scales))
    # 2.0 * 2^127 = 2^128: the first float32 overflow at the largest scale.
    blocks = np.zeros((1, 2, 1, 16), dtype=np.uint8)
    blocks[0, 1, 0, 7] = 0x40
    scales = np.array([[[254], [254]]], dtype=np.uint8)
    out.append(("overflow_two_at_scale_254", blocks, scales))
    # -4.0 * 2^126 = -2^128 in the high nibble.
    blocks = np.zeros((1, 1, 2, 16), dtype=np.uint8)
    blocks[0, 0, 1, 3] = 0xE0
    scales = np.array([[[253, 253]]], dtype=np.uint8)
    out.append(("overflow_minus_four_at_scale_253", blocks, scales))
    return out


def entry(name, blocks, scales):
    e, r, g, _ = blocks.shape
    return {
        "name": name,
        "experts": e,
        "rows": r,
        "cols": g * BLOCK,
        "blocks": blocks.reshape(-1).tobytes().hex(),
        "scales": [int(x) for x in scales.reshape(-1)],
    }


def build():
    rng = np.random.default_rng(SEED)
    decoded = []
    for name, blocks, scales in cases(rng):
        if first_refusal(blocks, scales) is not None:
            raise AssertionError(f"case {name} must decode to finite float32 values")
        d = entry(name, blocks, scales)
        d["expected_f32_bits"] = [int(x) for x in f32_bits(decode(blocks, scales)).reshape(-1)]
        decoded.append(d)
    refusals = []
    for name, blocks, scales in refused(rng):
        found = first_refusal(blocks, scales)
        if found is None:
            raise AssertionError(f"refused case {name} decodes to finite values")
        d = entry(name, blocks, scales)
        d["expert"], d["row"], d["block"], d["reason"] = found
        refusals.append(d)
    return {
        "about": "MXFP4 (OCP MX v1.0) decode witness, gpt-oss packing; written by tools/witness/mxfp4_oracle.py",
        "seed": SEED,
        "numpy": np.__version__,
        "decoded": decoded,
        "refused": refusals,
    }


def cross_check_transformers():
    """Compare the committed fixture with transformers' own MXFP4 decode; 0 when equal."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    with open(FIXTURE, encoding="utf-8") as f:
        doc = json.load(f)
    failures = 0
    for case in doc["decoded"]:
        e, r, k = case["experts"], case["rows"], case["cols"]
        blocks = np.frombuffer(bytes.fromhex(case["blocks"]), dtype=np.uint8).reshape(e, r, k // BLOCK, 16)
        scales = np.array(case["scales"], dtype=np.uint8).reshape(e, r, k // BLOCK)
        want = np.array(case["expected_f32_bits"], dtype=np.uint32)
        for dtype in (torch.float32, torch.bfloat16):
            # transformers returns [E, K, R] (the transposed nn.Linear weight).
            out = convert_moe_packed_tensors(torch.from_numpy(blocks.copy()), torch.from_numpy(scales.copy()), dtype=dtype)
            got = out.transpose(1, 2).to(torch.float32).contiguous().cpu().numpy().view(np.uint32).reshape(-1)
            bad = np.flatnonzero(got != want)
            if bad.size:
                failures += 1
                i = int(bad[0])
                print(
                    f"{case['name']} ({dtype}): {bad.size} elements differ, first {i}: "
                    f"transformers {got[i:i + 1].view(np.float32)[0]!r} vs fixture {want[i:i + 1].view(np.float32)[0]!r}",
                    file=sys.stderr,
                )
            else:
                print(f"{case['name']} ({dtype}): {want.size} values equal")
    return 1 if failures else 0


def dump(doc):
    return json.dumps(doc, indent=1) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed fixture instead of writing it")
    ap.add_argument(
        "--transformers", action="store_true", help="cross-check the fixture with transformers (needs torch)"
    )
    args = ap.parse_args()
    if args.transformers:
        return cross_check_transformers()
    doc = build()
    if args.check:
        with open(FIXTURE, encoding="utf-8") as f:
            committed = json.load(f)
        committed.pop("numpy", None)
        doc.pop("numpy")
        if committed != doc:
            print(f"{FIXTURE} differs from the oracle's output; rerun without --check", file=sys.stderr)
            return 1
        print(f"{FIXTURE}: matches the oracle")
        return 0
    os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
    with open(FIXTURE, "w", encoding="utf-8") as f:
        f.write(dump(doc))
    print(f"wrote {os.path.normpath(FIXTURE)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
