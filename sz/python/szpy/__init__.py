"""szpy - ctypes binding of libsz (COMET's error-bounded compressor for float32 tensors).

    import numpy as np, szpy
    lib = szpy.Library()                 # finds libsz.so via $SZ_LIBRARY or a path argument
    stream = lib.compress(x, eb=1e-3, mode="rel")   # bytes; x must be float32
    y = lib.decompress(stream)           # numpy float32 array with the original shape
    lib.header(stream)                   # dict: dims, eb_abs, ...
    y, used = lib.decompress_prefix(buf) # a stream at the start of buf, and its size

compress() takes float32 arrays only: any other dtype (float64, float16, ints, bools, a
Python list) raises SzDtypeError, because the conversion to float32 would change values
before the error bound applies (16777217 becomes 16777216). Pass allow_cast=True to
convert anyway; the bound then holds against the converted float32 values.
decompress() and header() take exactly one stream: an empty input, a truncated stream and
bytes after the stream raise SzError (see decompress_prefix for concatenated streams).

No build step: only numpy and a built libsz.so are needed.
"""
import ctypes
import os

import numpy as np

__all__ = ["Library", "SzError", "SzDtypeError", "load"]

_SZ_OK = 0
_SZ_ERR_PARAM = -1
_MODES = {"abs": 0, "rel": 1}


class SzError(RuntimeError):
    """An sz C API call failed; .status holds the negative sz_status."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


class SzDtypeError(SzError, TypeError):
    """compress() was given an array that is not float32 (and no allow_cast=True)."""

    def __init__(self, message):
        super().__init__(_SZ_ERR_PARAM, message)


class _Params(ctypes.Structure):
    _fields_ = [("eb", ctypes.c_double), ("mode", ctypes.c_int), ("lossless", ctypes.c_int),
                ("zstd_level", ctypes.c_int), ("nthreads", ctypes.c_int)]


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("ndims", ctypes.c_uint32),
                ("dims", ctypes.c_uint64 * 4), ("n_elems", ctypes.c_uint64),
                ("mode", ctypes.c_int), ("eb_requested", ctypes.c_double),
                ("eb_abs", ctypes.c_double), ("lossless", ctypes.c_int),
                ("stream_size", ctypes.c_uint64), ("raw_payload_size", ctypes.c_uint64)]


def _find_library(path):
    candidates = []
    if path:
        candidates.append(path)
    if os.environ.get("SZ_LIBRARY"):
        candidates.append(os.environ["SZ_LIBRARY"])
    candidates.append("libsz.so.1")  # the system loader path; libaec's szip is libsz.so.2
    for c in candidates:
        if os.path.isdir(c):
            c = os.path.join(c, "libsz.so")
        try:
            lib = ctypes.CDLL(c)
        except OSError:
            continue
        if hasattr(lib, "sz_compress_host_ex"):  # not another library called libsz
            return lib
    raise SzError(-1, "libsz.so not found: pass its path or set SZ_LIBRARY (tried %s)" % candidates)


class Library:
    """Handle on one libsz.so."""

    def __init__(self, path=None):
        lib = _find_library(path)
        self._lib = lib
        sz_t, p = ctypes.c_size_t, ctypes.c_void_p
        lib.sz_strerror.restype = ctypes.c_char_p
        lib.sz_strerror.argtypes = [ctypes.c_int]
        lib.sz_compress_bound.restype = sz_t
        lib.sz_compress_bound.argtypes = [sz_t]
        lib.sz_params_default.argtypes = [ctypes.POINTER(_Params), ctypes.c_double, ctypes.c_int]
        lib.sz_compress_host_ex.argtypes = [p, ctypes.POINTER(sz_t), ctypes.c_int,
                                            ctypes.POINTER(_Params), p, sz_t, ctypes.POINTER(sz_t)]
        lib.sz_decompress_host_ex.argtypes = [p, sz_t, p, sz_t, ctypes.c_int]
        lib.sz_read_header.argtypes = [p, sz_t, ctypes.POINTER(_Header)]
        lib.sz_peek_header.argtypes = [p, sz_t, ctypes.POINTER(_Header)]
        self._has_prefix = hasattr(lib, "sz_decompress_host_prefix")  # libsz >= strict streams
        if self._has_prefix:
            lib.sz_decompress_host_prefix.argtypes = [p, sz_t, p, sz_t, ctypes.c_int,
                                                      ctypes.POINTER(sz_t)]
        lib.sz_has_cuda.restype = ctypes.c_int

    def _check(self, status, what):
        if status != _SZ_OK:
            raise SzError(status, "%s: %s" % (what, self._lib.sz_strerror(status).decode()))

    @property
    def has_cuda(self):
        return bool(self._lib.sz_has_cuda())

    def compress_bound(self, n_elems):
        return self._lib.sz_compress_bound(n_elems)

    def compress(self, array, eb, mode="abs", zstd=True, threads=0, zstd_level=0,
                 allow_cast=False):
        """Compresses a float32 array of 1-4 dims (innermost last). Returns bytes.

        The array must already be float32 (either byte order): any other dtype raises
        SzDtypeError (a SzError and a TypeError), since converting float64 or int32 to
        float32 may change values by more than eb (16777217 -> 16777216) and uint8 or bool
        data would be inflated silently. allow_cast=True converts with numpy's float32 cast
        first; the error bound then holds against the converted values, not the originals.
        """
        dt = getattr(array, "dtype", None)
        is_f32 = dt is not None and dt.kind == "f" and dt.itemsize == 4
        if not is_f32 and not allow_cast:
            got = str(dt) if dt is not None else type(array).__name__
            raise SzDtypeError("compress takes float32 data, got %s; convert it first or pass "
                               "allow_cast=True (the bound then applies to the float32 values)"
                               % got)
        x = np.ascontiguousarray(array, dtype=np.float32)
        if x.ndim == 0:
            x = x.reshape(1)
        if x.ndim > 4:
            raise SzError(-1, "sz takes 1 to 4 dimensions, got %d" % x.ndim)
        if mode not in _MODES:
            raise SzError(-1, "mode must be 'abs' or 'rel'")
        prm = _Params()
        self._lib.sz_params_default(ctypes.byref(prm), float(eb), _MODES[mode])
        if not zstd:
            prm.lossless = 0
        prm.nthreads = int(threads)
        prm.zstd_level = int(zstd_level)
        dims = (ctypes.c_size_t * x.ndim)(*x.shape)
        cap = self.compress_bound(x.size)
        out = np.empty(cap, dtype=np.uint8)
        size = ctypes.c_size_t(0)
        self._check(self._lib.sz_compress_host_ex(x.ctypes.data, dims, x.ndim, ctypes.byref(prm),
                                                  out.ctypes.data, cap, ctypes.byref(size)),
                    "compress")
        return out[: size.value].tobytes()

    def header(self, stream):
        """Parses and validates a stream header; returns a dict."""
        buf = np.frombuffer(stream, dtype=np.uint8)
        h = _Header()
        self._check(self._lib.sz_read_header(buf.ctypes.data, buf.size, ctypes.byref(h)), "header")
        return {"dims": tuple(int(h.dims[i]) for i in range(h.ndims)), "n_elems": int(h.n_elems),
                "mode": "rel" if h.mode else "abs", "eb_requested": h.eb_requested,
                "eb_abs": h.eb_abs, "lossless": "zstd" if h.lossless else "none",
                "stream_size": int(h.stream_size), "raw_payload_size": int(h.raw_payload_size)}

    def _out(self, info, out):
        if out is None:
            return np.empty(info["dims"], dtype=np.float32)
        if out.dtype != np.float32 or not out.flags.c_contiguous or out.size < info["n_elems"]:
            raise SzError(-2, "out must be a C-contiguous float32 array of >= %d values" % info["n_elems"])
        return out

    def decompress(self, stream, out=None, threads=0):
        """Decompresses a stream into a new (or the given) float32 array of the stream's shape.

        stream must hold exactly one stream: bytes after it raise SzError (status -10), an
        empty input SzError (status -11); use decompress_prefix for a stream followed by
        other data."""
        buf = np.frombuffer(stream, dtype=np.uint8)
        info = self.header(stream)
        out = self._out(info, out)
        self._check(self._lib.sz_decompress_host_ex(buf.ctypes.data, buf.size, out.ctypes.data,
                                                    out.size, int(threads)), "decompress")
        return out

    def decompress_prefix(self, buf, out=None, threads=0):
        """Decompresses the stream at the start of buf, which may go on with other bytes.
        Returns (array, bytes consumed)."""
        if not self._has_prefix:
            raise SzError(-6, "this libsz has no sz_decompress_host_prefix")
        b = np.frombuffer(buf, dtype=np.uint8)
        h = _Header()
        self._check(self._lib.sz_peek_header(b.ctypes.data, b.size, ctypes.byref(h)), "header")
        info = {"dims": tuple(int(h.dims[i]) for i in range(h.ndims)), "n_elems": int(h.n_elems)}
        out = self._out(info, out)
        used = ctypes.c_size_t(0)
        self._check(self._lib.sz_decompress_host_prefix(b.ctypes.data, b.size, out.ctypes.data,
                                                        out.size, int(threads),
                                                        ctypes.byref(used)), "decompress")
        return out, int(used.value)


_default = None


def load(path=None):
    """Returns a cached Library (path or $SZ_LIBRARY)."""
    global _default
    if _default is None or path is not None:
        _default = Library(path)
    return _default
