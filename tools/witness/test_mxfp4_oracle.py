"""Hand-computed checks of mxfp4_oracle.py (run: python3 -m unittest tools/witness/test_mxfp4_oracle.py)."""

import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mxfp4_oracle as mx  # noqa: E402


class Mxfp4OracleTest(unittest.TestCase):
    def test_e2m1_matches_the_spec_table(self):
        # OCP MX v1.0 table for FP4 E2M1: 0, 0.5 (subnormal), 1, 1.5, 2, 3, 4, 6; sign in bit 3.
        want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
        np.testing.assert_array_equal(mx.e2m1_value(range(8)), want)
        np.testing.assert_array_equal(mx.e2m1_value(range(8, 16)), [-v for v in want])
        self.assertTrue(np.signbit(mx.e2m1_value(8)))

    def test_e8m0_is_a_power_of_two_with_bias_127_and_255_is_nan(self):
        self.assertEqual(mx.e8m0_value(127), 1.0)
        self.assertEqual(mx.e8m0_value(0), 2.0**-127)
        self.assertEqual(mx.e8m0_value(254), 2.0**127)
        self.assertTrue(np.isnan(mx.e8m0_value(255)))

    def test_low_nibble_is_the_even_element(self):
        blocks = np.zeros((1, 1, 1, 16), dtype=np.uint8)
        blocks[0, 0, 0, 0] = 0x2F  # element 0: 0xF = -6, element 1: 0x2 = 1
        out = mx.decode(blocks, np.array([[[128]]], dtype=np.uint8))
        self.assertEqual(out[0, 0, 0], -12.0)
        self.assertEqual(out[0, 0, 1], 2.0)

    def test_refusals(self):
        blocks = np.full((1, 1, 1, 16), 0x11, dtype=np.uint8)  # all 0.5
        self.assertIsNone(mx.first_refusal(blocks, np.array([[[254]]], dtype=np.uint8)))
        self.assertEqual(mx.first_refusal(blocks, np.array([[[255]]], dtype=np.uint8)), (0, 0, 0, "nan_scale"))
        blocks[0, 0, 0, 5] = 0x60  # 4.0 * 2^126 = 2^128
        self.assertEqual(mx.first_refusal(blocks, np.array([[[253]]], dtype=np.uint8)), (0, 0, 0, "overflow"))


if __name__ == "__main__":
    unittest.main()
