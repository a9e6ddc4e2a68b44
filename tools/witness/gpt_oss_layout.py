"""gpt-oss MXFP4 experts -> transformers' unquantized GptOssExperts layout (NumPy only).

The published gpt-oss checkpoints store each layer's experts as
  mlp.experts.gate_up_proj_blocks  u8 [E, 2I, H/32, 16]   rows interleaved: 2j gate_j, 2j+1 up_j
  mlp.experts.gate_up_proj_scales  u8 [E, 2I, H/32]
  mlp.experts.down_proj_blocks     u8 [E, H, I/32, 16]
  mlp.experts.down_proj_scales     u8 [E, H, I/32]
(nn.Linear orientation: a row per output, the input along the last axis),
plus gate_up_proj_bias [E, 2I] and down_proj_bias [E, H].

transformers 5.17 `GptOssExperts` (models/gpt_oss/modeling_gpt_oss.py) holds
  gate_up_proj [E, H, 2I]   used as  x @ gate_up_proj[e]   then gate = [..., ::2], up = [..., 1::2]
  down_proj    [E, I, H]    used as  act @ down_proj[e]
so each dequantized [E, R, K] tensor is transposed to [E, K, R] and the gate/up
interleave stays, now along the columns. transformers' own MXFP4 dequantizer
does the same (integrations/mxfp4.py `_convert_moe_packed_tensors` ends with
`out.transpose(1, 2)` and assigns the result unchanged); we do not call it: the
values come from our spec-derived decoder (mxfp4_oracle.py), so the witness does
not share the format decode it is meant to check.

Only NumPy is needed, so test_gpt_oss_layout.py runs without torch.
"""

import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mxfp4_oracle as mx  # noqa: E402

PACKED = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj))_(blocks|scales)$")
# transformers hard-codes these in GptOssExperts (it ignores config.swiglu_limit).
ALPHA = 1.702
LIMIT = 7.0


class LayoutError(ValueError):
    pass


def dequantize(blocks, scales):
    """float32 [E, R, K] from MXFP4 blocks/scales, refusing what the loader must refuse."""
    refused = mx.first_refusal(blocks, scales)
    if refused is not None:
        e, r, b, why = refused
        raise LayoutError(f"MXFP4 block (expert {e}, row {r}, block {b}) is refused: {why}")
    values = mx.decode(blocks, scales)
    # Exact: an E2M1 element has at most two significant bits (f32_bits raises otherwise).
    return mx.f32_bits(values).view(np.float32).reshape(values.shape)


def to_transformers(which, blocks, scales, hidden, intermediate, experts):
    """transformers' GptOssExperts parameter `which` (gate_up_proj or down_proj), float32."""
    rows, cols = (2 * intermediate, hidden) if which == "gate_up_proj" else (hidden, intermediate)
    want_b = (experts, rows, cols // mx.BLOCK, mx.BLOCK // 2)
    if tuple(blocks.shape) != want_b or tuple(scales.shape) != want_b[:3]:
        raise LayoutError(
            f"{which}: blocks {tuple(blocks.shape)} / scales {tuple(scales.shape)}, "
            f"the config needs {want_b} / {want_b[:3]}"
        )
    w = dequantize(blocks, scales)  # [E, rows, cols], nn.Linear orientation
    return np.ascontiguousarray(w.transpose(0, 2, 1))  # [E, cols, rows]


def convert(packed, hidden, intermediate, experts):
    """{name: array} of `*_blocks`/`*_scales` (u8) -> {transformers name: float32 array}.

    Every layer's projection must come with both its blocks and its scales."""
    parts = {}
    for name, arr in packed.items():
        m = PACKED.match(name)
        if not m:
            raise LayoutError(f"{name} is not a packed MXFP4 expert tensor")
        parts.setdefault(m.group(1), {})[m.group(4)] = np.asarray(arr, dtype=np.uint8)
    out = {}
    for base, p in sorted(parts.items()):
        if set(p) != {"blocks", "scales"}:
            raise LayoutError(f"{base}: has only {sorted(p)}; needs blocks and scales")
        which = base.rsplit(".", 1)[1]
        out[base] = to_transformers(which, p["blocks"], p["scales"], hidden, intermediate, experts)
    return out


def expert_reference(x, w_gate_up, b_gate_up, w_down, b_down):
    """One expert on rows x [T, H], in the checkpoint's orientation (w_gate_up
    [2I, H] with interleaved rows, w_down [H, I]), float64. This is OpenAI's
    reference (gpt_oss/torch/model.py MLPBlock + swiglu) written out, so it
    checks transformers' layout without going through our conversion."""
    x = np.asarray(x, dtype=np.float64)
    h = x @ np.asarray(w_gate_up, dtype=np.float64).T + b_gate_up
    gate, up = h[:, 0::2], h[:, 1::2]
    gate = np.minimum(gate, LIMIT)
    up = np.clip(up, -LIMIT, LIMIT)
    act = gate / (1.0 + np.exp(-ALPHA * gate)) * (up + 1.0)
    return act @ np.asarray(w_down, dtype=np.float64).T + b_down
