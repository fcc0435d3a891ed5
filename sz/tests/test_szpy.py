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

    def test_refuses_non_float32_unless_asked(self):
        big = np.array([16777217, 3, -7], dtype=np.int32)  # not a float32 value
        cases = [big, big.astype(np.float64), np.arange(10, dtype=np.uint8),
                 np.ones(4, np.float16), np.zeros(3, bool), [1.0, 2.0]]
        for x in cases:
            with self.assertRaises(szpy.SzDtypeError) as cm:
                self.lib.compress(x, 1e-3)
            self.assertIsInstance(cm.exception, szpy.SzError)
            self.assertIsInstance(cm.exception, TypeError)
            self.assertIn("float32", str(cm.exception))
            self.assertIn("allow_cast=True", str(cm.exception))
        # told to convert: the bound holds against the float32 values, not the originals
        y = self.lib.decompress(self.lib.compress(big.astype(np.float64), 1e-3, allow_cast=True))
        self.assertEqual(y.dtype, np.float32)
        self.assertEqual(float(y[0]), 16777216.0)
        y = self.lib.decompress(self.lib.compress(np.arange(10, dtype=np.uint8), 1e-3, allow_cast=True))
        self.assertTrue(np.all(np.abs(y - np.arange(10)) <= 1e-3))
        # float32 of the other byte order is float32: no cast needed, values kept
        x = np.linspace(-1, 1, 100).astype(">f4")
        y = self.lib.decompress(self.lib.compress(x, 1e-4))
        self.assertLessEqual(float(np.max(np.abs(x.astype(np.float64) - y))), 1e-4)
        self.assertIn("allow_cast", szpy.Library.compress.__doc__)
        self.assertIn("allow_cast", szpy.__doc__)

    def test_trailing_empty_and_prefix(self):
        x = np.maximum(np.random.default_rng(1).standard_normal(300), 0).astype(np.float32)
        s = self.lib.compress(x, 1e-3)
        with self.assertRaises(szpy.SzError) as cm:
            self.lib.decompress(s + b"\0")
        self.assertEqual(cm.exception.status, -10)
        self.assertIn("trailing", str(cm.exception))
        with self.assertRaises(szpy.SzError) as cm:
            self.lib.decompress(b"")
        self.assertEqual(cm.exception.status, -11)
        self.assertIn("empty", str(cm.exception))
        s2 = self.lib.compress(np.arange(7, dtype=np.float32), 1e-2, zstd=False)
        y, used = self.lib.decompress_prefix(s + s2)
        self.assertEqual(used, len(s))
        self.assertTrue(np.array_equal(y, self.lib.decompress(s)))
        y2, used2 = self.lib.decompress_prefix((s + s2)[used:])
        self.assertEqual(used2, len(s2))
        self.assertEqual(y2.shape, (7,))


if __name__ == "__main__":
    unittest.main()
