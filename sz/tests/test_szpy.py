"""ctest: the ctypes binding round-trips numpy arrays and reports errors as SzError."""
import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import szpy  # noqa: E402


class SzpyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.lib = szpy.Library(os.environ.get("SZ_LIBRARY"))

    def test_roundtrip_bound_and_shape(self):
        rng = np.random.default_rng(0)
        x = np.maximum(rng.standard_normal((2, 3, 17, 19)), 0).astype(np.float32)
        x[0, 0, 0, 0] = np.nan
        for mode, eb in (("abs", 1e-3), ("rel", 1e-2)):
            s = self.lib.compress(x, eb, mode)
            h = self.lib.header(s)
            y = self.lib.decompress(s)
            self.assertEqual(y.shape, x.shape)
            fin = np.isfinite(x)
            self.assertLessEqual(float(np.max(np.abs(x[fin].astype(np.float64) - y[fin]))), h["eb_abs"])
            self.assertTrue(np.isnan(y[0, 0, 0, 0]))
            self.assertTrue(np.all(y[x == 0] == 0))

    def test_errors(self):
        s = self.lib.compress(np.ones(100, np.float32), 1e-3)
        with self.assertRaises(szpy.SzError):
            self.lib.decompress(s[:-1])
        bad = bytearray(s)
        bad[-1] ^= 0xFF
        with self.assertRaises(szpy.SzError):
            self.lib.decompress(bytes(bad))
        with self.assertRaises(szpy.SzError):
            self.lib.compress(np.ones(10, np.float32), -1.0)
        with self.assertRaises(szpy.SzError):
            self.lib.decompress(s, out=np.empty(5, np.float32))


if __name__ == "__main__":
    unittest.main()
