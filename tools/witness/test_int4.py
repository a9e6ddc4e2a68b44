"""Hand-computed checks of int4.py (run: python3 -m unittest tools/witness/test_int4.py)."""

import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from int4 import int4_roundtrip  # noqa: E402


def row(values, k=128):
    r = np.zeros((1, k), dtype=np.float32)
    r[0, : len(values)] = values
    return r


class Int4Test(unittest.TestCase):
    def test_unit_scale_is_exact_and_ties_go_to_even(self):
        # amax 7 -> s = 1: 3.5 -> 4, -3.5 -> -4, 2.5 -> 2, 0.5 -> 0, -1.5 -> -2.
        out = int4_roundtrip(row([7.0, 3.5, -3.5, 2.5, 0.5, -1.5, -7.0]))
        np.testing.assert_array_equal(out[0, :7], [7.0, 4.0, -4.0, 2.0, 0.0, -2.0, -7.0])
        np.testing.assert_array_equal(out[0, 7:], 0.0)

    def test_scale_is_rounded_to_float16_before_dividing(self):
        # s = f16(1/7) = 1170/1024 * 2^-3 = 0.142822265625;
        # 1/s = 7.0017 -> 7; 0.5/s = 3.5009 -> 4; 0.2/s = 1.4003 -> 1.
        s = 0.142822265625
        out = int4_roundtrip(row([1.0, -1.0, 0.5, 0.2]))
        np.testing.assert_array_equal(out[0, :4], np.float32([7 * s, -7 * s, 4 * s, 1 * s]))

    def test_groups_and_rows_are_independent(self):
        w = np.zeros((2, 256), dtype=np.float32)
        w[0, 0] = 7.0   # row 0 group 0: s = 1
        w[0, 1] = 1.2   # -> 1
        w[0, 128] = 14.0  # row 0 group 1: s = 2
        w[0, 129] = 3.0   # 1.5 -> 2 (tie to even) -> 4
        w[1, 5] = -0.7  # row 1 group 0: s = f16(0.1) = 0.0999755859375; -7 -> q=1
        out = int4_roundtrip(w)
        self.assertEqual(out[0, 1], 1.0)
        self.assertEqual(out[0, 129], 4.0)
        self.assertEqual(out[0, 128], 14.0)
        self.assertEqual(out[1, 5], np.float32(-7 * 0.0999755859375))
        self.assertEqual(np.count_nonzero(out), 5)

    def test_zero_group_stays_zero(self):
        np.testing.assert_array_equal(int4_roundtrip(np.zeros((3, 128))), 0.0)

    def test_subnormal_scale_clamps_to_15(self):
        # amax/7 = 1.4286e-7 rounds to the f16 subnormal 2 * 2^-24; then
        # 1e-6 / s = 8.39 -> 8 -> q = 16, clamped to 15 -> 7 * s.
        s = 2.0 * 2.0**-24
        out = int4_roundtrip(row([1e-6, -1e-6]))
        np.testing.assert_array_equal(out[0, :2], np.float32([7 * s, -8 * s]))

    def test_rejects_bad_shapes_and_values(self):
        with self.assertRaises(ValueError):
            int4_roundtrip(np.zeros((2, 100)))
        with self.assertRaises(ValueError):
            int4_roundtrip(row([np.nan]))
        with self.assertRaises(ValueError):
            int4_roundtrip(row([1e6]))


if __name__ == "__main__":
    unittest.main()
