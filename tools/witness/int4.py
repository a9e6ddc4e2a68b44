"""INT4 round trip of the Krasis expert cache, re-implemented independently.

The rule (runtime/cache/src/layout.rs, format version 1): symmetric INT4 with
group size 128 along K (the last axis of an nn.Linear weight, i.e. the input
dimension), per row. For each group: amax = max|w| in float32;
s = float16(amax / 7.0) (division in float32, rounded to nearest even);
if s == 0 every q = 8, else q = clip(rint_half_even(w / float32(s)) + 8, 0, 15)
with the division in float32; dequantized value = (q - 8) * s.

Only NumPy is needed, so this file is tested without torch (test_int4.py).
"""

import numpy as np

GROUP_SIZE = 128


def int4_roundtrip(w):
    """Dequantized float32 copy of a [rows, K] weight, K a multiple of 128."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % GROUP_SIZE != 0:
        raise ValueError(
            f"INT4 weights must be [rows, K] with K a multiple of {GROUP_SIZE}, got shape {w.shape}"
        )
    if not np.all(np.isfinite(w)):
        raise ValueError("weight contains NaN or Inf; the cache refuses such experts")
    rows, k = w.shape
    g = w.reshape(rows, k // GROUP_SIZE, GROUP_SIZE)
    amax = np.max(np.abs(g), axis=2, keepdims=True)
    with np.errstate(over="ignore"):
        scale16 = (amax / np.float32(7.0)).astype(np.float32).astype(np.float16)
    if not np.all(np.isfinite(scale16)):
        raise ValueError("|w| too large: amax / 7 overflows the float16 scale")
    scale = scale16.astype(np.float32)
    zero = scale == 0
    safe = np.where(zero, np.float32(1.0), scale).astype(np.float32)
    q = np.rint((g / safe).astype(np.float32)) + np.float32(8.0)
    q = np.clip(q, 0.0, 15.0).astype(np.float32)
    q = np.where(zero, np.float32(8.0), q)
    deq = ((q - np.float32(8.0)) * scale).astype(np.float32)
    return deq.reshape(rows, k)
