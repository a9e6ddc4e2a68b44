"""gpt_oss_layout.py against a hand-built 2-expert example (NumPy only).

Run: python3 -m unittest tools/witness/test_gpt_oss_layout.py
"""

import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_oss_layout as gl  # noqa: E402

# E2M1 code of each representable magnitude (OCP MX v1.0), for packing by hand.
CODE = {0.0: 0, 0.5: 1, 1.0: 2, 1.5: 3, 2.0: 4, 3.0: 5, 4.0: 6, 6.0: 7}
H, I, E = 32, 32, 2  # one MXFP4 block per row of both projections


def pack(w, scale_exp=0):
    """u8 blocks [E, R, K/32, 16] and scales of w [E, R, K] (each w / 2^scale_exp an E2M1 value)."""
    e, r, k = w.shape
    v = w / 2.0**scale_exp
    codes = np.vectorize(lambda x: CODE[abs(float(x))] | (8 if x < 0 else 0))(v).astype(np.uint8)
    codes = codes.reshape(e, r, k // 32, 32)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # even element in the low nibble
    scales = np.full((e, r, k // 32), 127 + scale_exp, dtype=np.uint8)
    return blocks.astype(np.uint8), scales


def e2m1_weights(rng, shape):
    vals = np.array(sorted(CODE))
    return rng.choice(vals, size=shape) * rng.choice([-1.0, 1.0], size=shape)


class HandBuilt(unittest.TestCase):
    def setUp(self):
        rng = np.random.default_rng(7)
        # Per expert: gate and up [I, H], down [H, I] (nn.Linear: out x in).
        self.gate = e2m1_weights(rng, (E, I, H))
        self.up = e2m1_weights(rng, (E, I, H))
        self.down = e2m1_weights(rng, (E, H, I))
        # Marked entries, so a swapped axis or gate/up lands somewhere else.
        self.gate[1, 3, 5] = 6.0
        self.up[1, 3, 5] = -0.5
        self.down[0, 7, 2] = 4.0
        gate_up = np.empty((E, 2 * I, H))
        gate_up[:, 0::2], gate_up[:, 1::2] = self.gate, self.up  # the checkpoint's interleave
        self.gate_up = gate_up
        self.down_scaled = self.down * 2.0  # down is packed at scale 2^1
        self.packed = {}
        for name, w, s in (("gate_up_proj", gate_up, 0), ("down_proj", self.down_scaled, 1)):
            b, sc = pack(w, s)
            self.packed[f"model.layers.0.mlp.experts.{name}_blocks"] = b
            self.packed[f"model.layers.0.mlp.experts.{name}_scales"] = sc
        self.out = gl.convert(self.packed, H, I, E)

    def test_names_shapes_dtype(self):
        gu = self.out["model.layers.0.mlp.experts.gate_up_proj"]
        dn = self.out["model.layers.0.mlp.experts.down_proj"]
        self.assertEqual(
            sorted(self.out), ["model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj"]
        )
        self.assertEqual(gu.shape, (E, H, 2 * I))  # GptOssExperts.gate_up_proj
        self.assertEqual(dn.shape, (E, I, H))  # GptOssExperts.down_proj
        self.assertEqual((gu.dtype, dn.dtype), (np.float32, np.float32))

    def test_marked_entries(self):
        gu = self.out["model.layers.0.mlp.experts.gate_up_proj"]
        dn = self.out["model.layers.0.mlp.experts.down_proj"]
        # gate unit 3 of expert 1 is column 6, up unit 3 column 7; input 5 is row 5.
        self.assertEqual(gu[1, 5, 6], 6.0)
        self.assertEqual(gu[1, 5, 7], -0.5)
        # down output 7 from unit 2 of expert 0: [E, I, H] -> [0, 2, 7], times the scale 2.
        self.assertEqual(dn[0, 2, 7], 8.0)

    def test_deinterleave_and_transposes(self):
        gu = self.out["model.layers.0.mlp.experts.gate_up_proj"]
        dn = self.out["model.layers.0.mlp.experts.down_proj"]
        # transformers' _apply_gate: gate = gate_up[..., ::2], up = gate_up[..., 1::2].
        np.testing.assert_array_equal(gu[..., 0::2], self.gate.transpose(0, 2, 1))
        np.testing.assert_array_equal(gu[..., 1::2], self.up.transpose(0, 2, 1))
        np.testing.assert_array_equal(dn, self.down_scaled.transpose(0, 2, 1))

    def test_transformers_forward_equals_the_checkpoint_reference(self):
        gu = self.out["model.layers.0.mlp.experts.gate_up_proj"].astype(np.float64)
        dn = self.out["model.layers.0.mlp.experts.down_proj"].astype(np.float64)
        rng = np.random.default_rng(8)
        x = rng.standard_normal((5, H)) * 0.3
        b_gu = rng.standard_normal((E, 2 * I))
        b_dn = rng.standard_normal((E, H))
        for e in range(E):
            # GptOssExperts.forward for one expert, transcribed.
            h = x @ gu[e] + b_gu[e]
            gate, up = np.minimum(h[:, ::2], gl.LIMIT), np.clip(h[:, 1::2], -gl.LIMIT, gl.LIMIT)
            got = ((up + 1) * gate / (1 + np.exp(-gl.ALPHA * gate))) @ dn[e] + b_dn[e]
            want = gl.expert_reference(x, self.gate_up[e], b_gu[e], self.down_scaled[e], b_dn[e])
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        # The clamp is exercised: some pre-activations are outside +-7.
        self.assertGreater(np.abs(x @ gu[0]).max(), gl.LIMIT)

    def test_refusals(self):
        bad = dict(self.packed)
        del bad["model.layers.0.mlp.experts.down_proj_scales"]
        with self.assertRaisesRegex(gl.LayoutError, "needs blocks and scales"):
            gl.convert(bad, H, I, E)
        with self.assertRaisesRegex(gl.LayoutError, "the config needs"):
            gl.convert(self.packed, H, 2 * I, E)  # gate_up rows 64 where the config needs 128
        nan = dict(self.packed)
        s = nan["model.layers.0.mlp.experts.gate_up_proj_scales"].copy()
        s[1, 9, 0] = 255
        nan["model.layers.0.mlp.experts.gate_up_proj_scales"] = s
        with self.assertRaisesRegex(gl.LayoutError, r"expert 1, row 9, block 0\) is refused: nan_scale"):
            gl.convert(nan, H, I, E)
        with self.assertRaisesRegex(gl.LayoutError, "not a packed"):
            gl.convert({"model.layers.0.mlp.experts.gate_up_proj_bias": np.zeros(1)}, H, I, E)


if __name__ == "__main__":
    unittest.main()
