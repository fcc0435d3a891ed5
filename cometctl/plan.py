"""`cometctl plan`: will this net fit, and how large a batch can it train in this much memory?

The answer comes from measurements, not from shapes. For two or three small batch sizes the solver's
TRAIN net runs a few real iterations of `caffe train` in a child process, COMET off and COMET on:

  on   the solver's own `comet { }` block (or the defaults when it has none), enabled;
  off  an observing store: `comet { compress_type: "None" relu_masks: false release_unused: false
       release_diffs: false layer_buffers: false memory_pool: false }` keeps every blob dense and frees
       nothing, exactly as Caffe without COMET, but it samples the memory at every layer boundary, so
       COMET off gets the same breakdown as COMET on. (Its peak RSS equals a run without a comet block
       within 0.2 MB for CaffeNet at batches 4 to 256: docs/comet.md.)

Each run gives its measured peak (CPU: the peak resident set size of the child, `ru_maxrss` from wait4;
GPU: the device's memory in use above its value before the run, sampled by nvidia-smi every 20 ms while
caffe runs (DevicePeak); where there is no nvidia-smi, the store's tracked device bytes, which are not a
measurement of the device: said so in the output) and the store's split of its tracked peak into
weights, activations, gradients, compressed and scratch, from the statistics file it writes
(`stats_file`). The solver's history is a number of copies of the weights given by the solver type (SGD
keeps one); the rest of the peak RSS is the runtime and what the store does not track (libraries, heap,
the data layer's prefetch batches, the pool's cached blocks, mapped pages of the data source). Every
figure is fitted per mode as fixed + per-sample x batch (least squares over the measured batches); the
sum of the fits is the fit of the peak. From the fits: the peak at the solver's batch size, and for a
budget the largest batch that fits, each way. `--batch N` runs batch N and compares.

The per-layer table (blob, bytes dense, action, bytes stored, error bound) comes from the COMET-on
runs: the plan lines the store logs at setup (every blob it acts on), its statistics file (bytes
before and after, the bound used, per blob, for the last measured iteration) and Caffe's `Top shape`
lines (the dense size of blobs the store keeps or frees without storing), fitted to the solver's
batch the same way.

Input: the net's own data layers with their batch size changed, or (`--synthetic-input`) DummyData of
the same shapes: images as Gaussian noise (std 50 times the transform's scale; noise compresses worse
than pictures, so COMET's figures are on the safe side), labels 0. Shapes come from the data source
when it is there (an LMDB's first Datum), else from crop sizes (3 channels assumed) or `--input-shape`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import cometstats
from .childenv import caffe_env
from .errors import CometError
from .paths import REPO_ROOT, from_root

SCHEMA = "cometctl-plan/1"
DEFAULT_MEASURE = (8, 16, 32)
DEFAULT_ITERS = 2  # the first step allocates the solver history, the second runs at the adapted bounds
# With the default batches, a mode whose peak grows less than this from the smallest to the largest
# measured batch is measured at twice the largest too, and so on up to WIDEN_MAX_BATCH: the runtime's own
# peak varies by about a MiB from run to run, which in a growth of a few MiB is a slope wrong by a
# quarter (upstream's CIFAR-10 full net with COMET on grows 3.7 MiB from 8 to 32: batch 512 was
# predicted 12% low from 8, 16, 32 and 3% low with 64 and 128 added).
WIDEN_GROWTH = 16 * 2**20
WIDEN_MAX_BATCH = 1024
OBSERVE_ONLY = ('compress_type: "None" relu_masks: false release_unused: false release_diffs: false '
                'layer_buffers: false memory_pool: false')
# Blobs of solver state per learnable blob, by solver type (upstream's solvers/*.cpp: SGD's history_;
# Nesterov, AdaGrad and RMSProp also write update_; Adam m, v and temp_; AdaDelta two histories,
# update_ and temp_). L1 regularisation adds temp_.
SOLVER_STATE = {"SGD": 1, "Nesterov": 2, "AdaGrad": 2, "RMSProp": 2, "AdaDelta": 4, "Adam": 3}
LEGACY_SOLVER_TYPES = ("SGD", "Nesterov", "AdaGrad", "RMSProp", "AdaDelta", "Adam")
KINDS = ("weights", "activations", "gradients", "compressed", "scratch")
# The parts of a peak, each fitted. The store's split of its tracked peak into activations, blob
# gradients, compressed and scratch belongs to the moment of the peak, which can move from one batch
# size to the next (forward at one, backward at another) while the total grows in a straight line: it
# is fitted as one part ("blobs") and printed as measured at the largest measured batch.
PARTS = ("weights", "weight_gradients", "history", "blobs", "mapped", "untracked")
PART_NAMES = {"weights": "weights", "weight_gradients": "weight gradients", "history": "solver history",
              "blobs": "activations, their gradients, COMET's copies",
              "mapped": "file-backed pages (libraries, data)", "untracked": "runtime and untracked"}
STEP_FIGURES = {"activations_dense": "activations stored per step, dense",
                "activations_stored": "  ... as COMET stores them",
                "buffers_dense": "layer buffers per step, dense", "buffers_stored": "  ... as COMET stores them",
                "pool_cached": "memory pool cached after a step"}
ACTION_NAMES = {"keep": "kept dense", "release": "freed", "lossy": "lossy", "mask": "sign mask",
                "argmax": "argmax codes", "binary": "dropout mask", "scale": "freed, recomputed", "until-backward": "dense until backward",
                "rebuild": "freed, rebuilt"}
MODES = ("off", "on")


# ------------------------------------------------------------------------------------- sizes

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(i)?(b)?|(b))?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'8GiB', '8G', '4096 MiB', '500MB', '123456' -> bytes. K, M, G, T alone or with iB are powers of
    1024; kB, MB, GB, TB powers of 1000; a plain number is bytes."""
    m = _SIZE.match(str(text))
    if not m:
        raise CometError(f"--memory {text}: not a size (write e.g. 8GiB, 4096MiB, 500MB or a number of bytes)")
    num, prefix, binary, b = float(m[1]), (m[2] or "").lower(), m[3], m[4]
    if not prefix:
        return int(num)
    base = 1000 if (b and not binary) else 1024
    return int(num * base ** ("kmgt".index(prefix) + 1))


def fmt_bytes(b: float | None, signed: bool = False) -> str:
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return "-"
    if abs(b) < 0.5:
        return "0 B"
    sign = "+" if signed and b > 0 else ("-" if b < 0 else "")
    a = abs(b)
    if a >= 10 * 2**30:
        return f"{sign}{a / 2**30:,.1f} GiB"
    if a >= 2**20:
        return f"{sign}{a / 2**20:,.1f} MiB"
    if a >= 1024:
        return f"{sign}{a / 1024:,.1f} KiB"
    return f"{sign}{a:,.0f} B"


# ---------------------------------------------------------------------------------- the fit

@dataclass
class Line:
    """fixed + per_sample * batch."""

    fixed: float
    per_sample: float

    def at(self, batch: float) -> float:
        return self.fixed + self.per_sample * batch

    def largest_batch(self, budget: float) -> int | None:
        """The largest batch >= 1 whose figure fits in `budget`; 0 when not even batch 1 does; None when
        the figure does not grow with the batch (no limit)."""
        if self.per_sample <= 0:
            return None if self.fixed <= budget else 0
        n = math.floor((budget - self.fixed) / self.per_sample + 1e-9)
        return max(n, 0)


def predict(fits: dict, batch: float, file_cap: float | None = None) -> float:
    """The peak at `batch` from one mode's fits: the fitted peak, except that the data source's mapped
    pages (the `mapped` part, which grows with the records read) cannot pass `file_cap`, the size of
    the mapped part's fixed share plus the sources' files: a short run at a large batch may read the whole
    database, and then no more."""
    peak = Line(**fits["peak"]).at(batch)
    if file_cap is None or "mapped" not in fits:
        return peak
    mapped = Line(**fits["mapped"])
    return peak - mapped.at(batch) + min(mapped.at(batch), mapped.fixed + file_cap)


def largest_batch(fits: dict, budget: float, file_cap: float | None = None) -> int | None:
    """The largest batch >= 1 that `predict` fits in `budget`; 0 when not even batch 1 does; None when
    the peak does not grow with the batch."""
    line = Line(**fits["peak"])
    if file_cap is None or "mapped" not in fits:
        return line.largest_batch(budget)
    rest = Line(line.fixed - fits["mapped"]["fixed"], line.per_sample - fits["mapped"]["per_sample"])
    if rest.per_sample <= 0:
        return line.largest_batch(budget)
    if predict(fits, 1, file_cap) > budget:
        return 0
    lo, hi = 1, max(1, rest.largest_batch(budget) or 1)  # the rest alone bounds it
    while lo < hi:  # predict grows with the batch: the last one within the budget
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if predict(fits, mid, file_cap) <= budget else (lo, mid - 1)
    return lo


def fit(xs, ys) -> Line:
    """Least squares fixed + per_sample * x through the points (one point: no growth)."""
    xs, ys = [float(x) for x in xs], [float(y) for y in ys]
    if not xs:
        raise ValueError("nothing to fit")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return Line(my, 0.0)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return Line(my - slope * mx, slope)


# ---------------------------------------------------------------------- the net at a batch size

SOURCE_PARAM = {"Data": "data_param", "ImageData": "image_data_param", "WindowData": "window_data_param",
                "HDF5Data": "hdf5_data_param"}
BATCH_PARAM = dict(SOURCE_PARAM, MemoryData="memory_data_param")


def solver_state_copies(param, pb2) -> int:
    kind = param.type if param.HasField("type") else (
        LEGACY_SOLVER_TYPES[param.solver_type] if param.HasField("solver_type") else "SGD")
    return SOLVER_STATE.get(kind, 1) + (1 if param.regularization_type == "L1" else 0)


def train_layers(net, pb2) -> list:
    from .caffeproto import in_train_phase

    return [layer for layer in net.layer if in_train_phase(layer, pb2)]


def _dummy_batch(layer) -> int | None:
    p = layer.dummy_data_param
    if p.shape and p.shape[0].dim:
        return int(p.shape[0].dim[0])
    return int(p.num[0]) if p.num else None


def net_batch(net, pb2) -> int:
    """The batch size the TRAIN net's first data layer makes."""
    for layer in train_layers(net, pb2):
        if layer.type in BATCH_PARAM:
            return int(getattr(layer, BATCH_PARAM[layer.type]).batch_size)
        if layer.type == "DummyData" and _dummy_batch(layer):
            return _dummy_batch(layer)
        if layer.type == "Input" and layer.input_param.shape and layer.input_param.shape[0].dim:
            return int(layer.input_param.shape[0].dim[0])
    if net.input_shape and net.input_shape[0].dim:
        return int(net.input_shape[0].dim[0])
    if net.input_dim:
        return int(net.input_dim[0])
    raise CometError("the TRAIN net has no data layer whose batch size plan can set (Data, ImageData, "
                     "WindowData, HDF5Data, MemoryData, DummyData, Input)")


def missing_sources(net, pb2) -> list[tuple[str, str, str]]:
    """(layer, what, path) of every data source or mean file of the TRAIN net that does not exist ("source",
    "mean file") or that a `prepare-*` command is writing now ("busy": its folder is locked), and of each
    MemoryData layer ("memory")."""
    from .caffeproto import data_file_kinds
    from .locks import busy

    train = {layer.name for layer in train_layers(net, pb2)}
    out = []
    for layer, what, name in data_file_kinds(net):
        if layer not in train:
            continue
        path = from_root(name)
        if not path.exists():
            out.append((layer, what, name))
        elif busy(path.parent):  # the folder prepare-* locks: its LMDBs, lists and mean file
            out.append((layer, "busy", name))
    out += [(layer.name, "memory", "(fed by pycaffe, not by caffe train)")
            for layer in train_layers(net, pb2) if layer.type == "MemoryData"]
    return out


def parse_input_shapes(items) -> dict[str, tuple[int, ...]]:
    """['data=3x227x227', 'pair_data=2,28,28'] -> {'data': (3, 227, 227), ...} (without the batch)."""
    out = {}
    for item in items or ():
        top, _, dims = item.partition("=")
        try:
            shape = tuple(int(d) for d in re.split(r"[x,]", dims.strip()) if d)
        except ValueError:
            shape = ()
        if not top.strip() or not shape or min(shape) < 1:
            raise CometError(f"--input-shape {item}: write TOP=CxHxW (without the batch), e.g. data=3x227x227")
        out[top.strip()] = shape
    return out


def _lmdb_datum_shape(source: Path, pb2) -> tuple[int, int, int] | None:
    """(channels, height, width) of the first Datum of an LMDB, None when it cannot be read."""
    try:
        import lmdb
    except ImportError:
        return None
    try:
        env = lmdb.open(str(source), readonly=True, lock=False, subdir=source.is_dir())
    except lmdb.Error:
        return None
    try:
        with env.begin() as txn:
            cur = txn.cursor()
            if not cur.first():
                return None
            datum = pb2.Datum()
            datum.ParseFromString(cur.value())
    finally:
        env.close()
    if datum.encoded:
        import io

        try:
            from PIL import Image

            im = Image.open(io.BytesIO(datum.data))
            return (1 if im.mode == "L" else 3, im.height, im.width)
        except Exception:
            return None
    return (datum.channels, datum.height, datum.width) if datum.channels else None


def _image_shape(layer, pb2, notes: list[str]) -> tuple[int, ...] | None:
    """The shape (without the batch) of a data layer's first top, as far as it can be told."""
    crop = layer.transform_param.crop_size if layer.HasField("transform_param") else 0
    if layer.type == "Data":
        src = from_root(layer.data_param.source)
        found = _lmdb_datum_shape(src, pb2) if layer.data_param.backend == pb2.DataParameter.LMDB and \
            src.exists() else None
        if found:
            c, h, w = found
            return (c, crop, crop) if crop else (c, h, w)
        if crop:
            notes.append(f"layer '{layer.name}': {crop}x{crop} crops with 3 channels assumed "
                         f"(--input-shape {layer.top[0]}=CxHxW says otherwise)")
            return (3, crop, crop)
        return None
    if layer.type == "ImageData":
        p = layer.image_data_param
        c = 3 if p.is_color else 1
        if crop:
            return (c, crop, crop)
        if p.new_height and p.new_width:
            return (c, p.new_height, p.new_width)
        return None
    if layer.type == "WindowData":
        crop = layer.window_data_param.crop_size or crop
        return (3, crop, crop) if crop else None
    if layer.type == "MemoryData":
        p = layer.memory_data_param
        return (p.channels, crop or p.height, crop or p.width) if p.channels else None
    return None


def _dummy(name: str, tops: list[tuple[str, tuple[int, ...], float | None]], pb2):
    """A DummyData layer; tops: (name, full shape, std of its Gaussian noise, or None for labels 0)."""
    layer = pb2.LayerParameter(name=name, type="DummyData")
    for top, shape, std in tops:
        layer.top.append(top)
        layer.dummy_data_param.shape.add(dim=list(shape))
        f = layer.dummy_data_param.data_filler.add()
        if std is None:
            f.type, f.value = "constant", 0.0
        else:
            f.type, f.mean, f.std = "gaussian", 0.0, float(std)
    return layer


def _input_dims(param_shapes, i: int) -> list[int] | None:
    if not param_shapes:
        return None
    shape = param_shapes[i] if i < len(param_shapes) else param_shapes[0]
    return list(shape.dim)


def net_at_batch(net, pb2, batch: int, synthetic: bool, shapes: dict | None = None,
                 notes: list[str] | None = None):
    """The TRAIN net of `net` (a NetParameter) making batches of `batch`: data layers get the batch
    size; with `synthetic` (and always for Input, MemoryData and the legacy net inputs, which
    `caffe train` cannot feed) they become DummyData of the same shapes."""
    shapes = dict(shapes or {})
    notes = notes if notes is not None else []
    out = pb2.NetParameter()
    out.CopyFrom(net)
    del out.layer[:]
    for fld in ("input", "input_shape", "input_dim"):
        out.ClearField(fld)
    if net.input:  # legacy net-level inputs
        tops = []
        for i, top in enumerate(net.input):
            if top in shapes:
                dims = [batch, *shapes[top]]
            else:
                given = _input_dims(net.input_shape, i) or list(net.input_dim[4 * i:4 * i + 4])
                if not given:
                    raise CometError(f"net input '{top}' has no shape; pass --input-shape {top}=CxHxW")
                dims = [batch, *given[1:]]
            tops.append((top, tuple(dims), 50.0))
        out.layer.append(_dummy("input", tops, pb2))
    seen_data = False
    for layer in train_layers(net, pb2):
        kept = pb2.LayerParameter()
        kept.CopyFrom(layer)
        kept.ClearField("include")
        kept.ClearField("exclude")
        if layer.type == "DummyData":
            p = kept.dummy_data_param
            for s in p.shape:
                if s.dim:
                    s.dim[0] = batch
            for i in range(len(p.num)):
                p.num[i] = batch
            out.layer.append(kept)
            seen_data = True
            continue
        if layer.type == "Input" or layer.type == "MemoryData" or (synthetic and layer.type in SOURCE_PARAM):
            scale = layer.transform_param.scale if layer.HasField("transform_param") and \
                layer.transform_param.HasField("scale") else 1.0
            tops = []
            for i, top in enumerate(layer.top):
                if top in shapes:
                    tops.append((top, (batch, *shapes[top]), 50.0 * scale if i == 0 else None))
                    continue
                if layer.type == "Input":
                    dims = _input_dims(layer.input_param.shape, i)
                    if not dims:
                        raise CometError(f"layer '{layer.name}' (Input): no shape for '{top}'; pass "
                                         f"--input-shape {top}=CxHxW")
                    tops.append((top, (batch, *dims[1:]), 50.0))
                elif i == 0:
                    shape = _image_shape(layer, pb2, notes)
                    if shape is None:
                        raise CometError(
                            f"layer '{layer.name}' ({layer.type}): cannot tell the shape of its top '{top}' "
                            f"without reading its source; pass --input-shape {top}=CxHxW (without the batch)")
                    tops.append((top, (batch, *shape), 50.0 * scale))
                else:  # the label, one per image
                    tops.append((top, (batch,), None))
            out.layer.append(_dummy(layer.name, tops, pb2))
            seen_data = True
            continue
        if layer.type in SOURCE_PARAM:
            getattr(kept, SOURCE_PARAM[layer.type]).batch_size = batch
            seen_data = True
        out.layer.append(kept)
    if not seen_data and not net.input:
        raise CometError("the TRAIN net has no data layer whose batch size plan can set (Data, ImageData, "
                         "WindowData, HDF5Data, MemoryData, DummyData, Input)")
    return out


def run_solver(param, pb2, net_file: Path, prefix: Path, iters: int, comet: bool, gpu: int | None):
    """The user's solver for one measured run: `iters` iterations of the TRAIN net only, statistics every
    iteration, no snapshot, no test net; COMET as the solver says (on) or the observing store (off)."""
    from google.protobuf import text_format

    s = pb2.SolverParameter()
    s.CopyFrom(param)
    for fld in ("net_param", "train_net", "train_net_param", "test_net", "test_net_param", "test_state",
                "test_iter", "train_state"):
        s.ClearField(fld)
    s.net = str(net_file)
    s.test_interval = 0
    s.test_initialization = False
    s.max_iter = iters
    s.display = 1
    s.snapshot = 0
    s.snapshot_after_train = False
    s.snapshot_prefix = str(prefix)
    s.debug_info = False
    if not s.HasField("random_seed"):
        s.random_seed = 1701
    if gpu is None:
        s.solver_mode = pb2.SolverParameter.CPU
    else:
        s.solver_mode = pb2.SolverParameter.GPU
        s.device_id = gpu
    if comet:
        keep = pb2.CometParameter()
        keep.CopyFrom(param.comet)
        s.comet.CopyFrom(keep)
        s.comet.enabled = True
    else:
        s.ClearField("comet")
        text_format.Merge(OBSERVE_ONLY, s.comet)
    s.comet.stats_file = str(prefix) + "_comet.csv"
    return s


# --------------------------------------------------------------------------- one measured run

@dataclass
class ChildRun:
    """What a finished `caffe train` child left: exit code, peaks, times, its log."""

    rc: int
    peak_rss: int        # bytes, ru_maxrss
    cpu_seconds: float   # user + system
    wall_seconds: float
    file_rss_max: int    # bytes of file-backed pages seen mapped (polled /proc/PID/status RssFile)
    log: Path
    device_peak: int | None = None  # GPU runs: nvidia-smi's memory.used peak above its value before, bytes


# The child is started by this small launcher (`python -S`), not by cometctl itself: a process's peak
# RSS (ru_maxrss) never falls below the RSS of the process it was forked from (fork copies the parent's
# page counts, exec keeps the high-water mark), and cometctl with pycaffe loaded holds ~130 MB, more
# than a small net's whole run. The launcher forks caffe from ~8 MB, polls the file-backed pages it maps
# (/proc/PID/status RssFile: the data source's LMDB), waits with wait4 and writes caffe's figures as JSON.
_LAUNCHER = r"""
import json, os, sys, time
out, argv = sys.argv[1], sys.argv[2:]
pid = os.fork()
if pid == 0:
    try:
        os.execv(argv[0], argv)
    finally:
        os._exit(127)
file_max = 0
while True:
    done, status, usage = os.wait4(pid, os.WNOHANG)
    if done:
        break
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("RssFile:"):
                    file_max = max(file_max, int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    time.sleep(0.05)
with open(out, "w") as f:
    json.dump({"status": status, "maxrss": usage.ru_maxrss * 1024, "cpu": usage.ru_utime + usage.ru_stime,
               "file_max": file_max}, f)
"""


NVIDIA_SMI = "nvidia-smi"
# Caffe allocates in the first step and frees nothing before it exits, so the peak is held from the
# first step to the end; a plan's runs are short (two steps), so sample often. Untried on a GPU with
# cometctl (the GPU check's plan-caffenet step sampled every 100 ms over 20 steps).
SAMPLE_MS = 20


class DevicePeak:
    """GPU `gpu`'s memory in use, sampled by `nvidia-smi -lms SAMPLE_MS` while a child runs: the peak above the
    value read just before it started. The same measurement the GPU check's plan-caffenet step fits
    (docs/gpu-check.md: -1.0% and -4.3% at batch 256 from batches 16 and 32 on an H200). Without
    nvidia-smi, or when it answers nothing, `peak()` is None."""

    def __init__(self, gpu: int):
        self.gpu, self.proc, self.base, self.out = gpu, None, None, None
        self.samples: list[int] = []

    def _cmd(self, *extra: str) -> list[str]:
        return [NVIDIA_SMI, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", str(self.gpu), *extra]

    def _query(self) -> list[int]:
        try:
            p = subprocess.run(self._cmd(), capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return []
        return _mib_values(p.stdout) if p.returncode == 0 else []

    def __enter__(self):
        if shutil.which(NVIDIA_SMI) is None:
            return self
        base = self._query()
        if not base:
            return self
        self.base = base[0]
        self.out = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(self._cmd("-lms", str(SAMPLE_MS)), stdout=self.out, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            last = self._query()  # what the child left in use as it ended counts too
            _kill(self.proc)
            self.out.seek(0)
            self.samples = _mib_values(self.out.read()) + last
            self.out.close()
        return False

    def peak(self) -> int | None:
        if not self.samples:
            return None
        return max(0, max(self.samples) - self.base) * 2**20


def _mib_values(text: str) -> list[int]:
    return [int(x) for x in (line.strip() for line in text.splitlines()) if x.isdigit()]


def run_caffe(caffe: Path, solver: Path, log: Path, gpu: int | None = None, cwd: Path | None = None,
              timeout: float | None = None, weights: Path | None = None) -> ChildRun:
    """Run `caffe train -solver SOLVER [-weights WEIGHTS]` in its own process (stdout and stderr into `log`)
    and measure its peak resident set size (wait4's ru_maxrss) and CPU time. Ctrl-C or `timeout` kills it."""
    import sys

    cmd = [str(caffe), "train", "-solver", str(solver)]
    if gpu is not None:
        cmd += ["-gpu", str(gpu)]
    if weights is not None:
        cmd += ["-weights", str(weights)]
    env = caffe_env(caffe, GLOG_logtostderr="1", GLOG_minloglevel="0")
    figures = Path(str(log) + ".rusage.json")
    figures.unlink(missing_ok=True)
    t0 = time.monotonic()
    sampler = DevicePeak(gpu) if gpu is not None else None
    with sampler or contextlib.nullcontext(), _terminate_as_exit():
        with open(log, "w") as f:
            proc = subprocess.Popen([sys.executable, "-S", "-c", _LAUNCHER, str(figures), *cmd], stdout=f,
                                    stderr=subprocess.STDOUT, cwd=str(cwd or REPO_ROOT), env=env,
                                    start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            raise CometError(f"caffe ran longer than {timeout:g} s and was stopped; log: {log}") from None
        except BaseException:  # Ctrl-C: the launcher and caffe go together
            _kill(proc)
            raise
    wall = time.monotonic() - t0
    try:
        got = json.loads(figures.read_text())
    except (OSError, ValueError):
        raise CometError(f"the launcher of caffe failed (exit status {proc.returncode}); log: {log}") from None
    return ChildRun(rc=os.waitstatus_to_exitcode(got["status"]), peak_rss=int(got["maxrss"]),
                    cpu_seconds=float(got["cpu"]), wall_seconds=wall, file_rss_max=int(got["file_max"]), log=log,
                    device_peak=sampler.peak() if sampler else None)


@contextlib.contextmanager
def _terminate_as_exit():
    """SIGTERM (a batch system's, `timeout`'s) raises SystemExit(143) in the main thread while a caffe
    runs, so that its launcher, caffe and the nvidia-smi sampler, each in a session of its own, are killed
    on the way out as on Ctrl-C; Python's default would exit at once and leave them running."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


PLAN_LINE = re.compile(r"\bCOMET plan: blob (?P<blob>.+?) -> (?P<what>.+)$")
TOPS = re.compile(r"\] (?P<layer>\S+) -> (?P<top>\S+)(?: \(in-place\))?$")
SETTING_UP = re.compile(r"\] Setting up (?P<layer>\S+)$")
TOP_SHAPE = re.compile(r"\] Top shape: [\d ]*\((?P<count>\d+)\)$")


def read_log(text: str) -> dict:
    """From a `caffe train` log: the store's plan (blob -> action, in its order), every net blob's element
    count (Caffe's `Top shape` lines), each private buffer's (its layer's first top's) and the pool's
    cached bytes."""
    plan: list[tuple[str, str]] = []
    counts: dict[str, int] = {}
    tops: dict[str, list[str]] = {}
    current, index = None, 0
    for line in text.splitlines():
        m = PLAN_LINE.search(line)
        if m:
            what = m["what"]
            if what.startswith("kept dense"):
                action = "keep"
            elif "rebuilt" in what:
                action = "rebuild"
            elif "not read" in what:
                action = "release"  # LRN's internals, Swish's sigmoid buffers: their backward does without them
            elif re.match(r"freed after \S+ backward", what):
                action = "until-backward"  # LRN's scale without recompute_lrn: dense until LRN's backward
            elif what.startswith("freed after"):
                action = "scale"
            else:
                action = what.split()[0]
            plan.append((m["blob"], action))
            continue
        m = TOPS.search(line)
        if m and "net.cpp" in line:
            tops.setdefault(m["layer"], []).append(m["top"])
            continue
        m = SETTING_UP.search(line)
        if m:
            current, index = m["layer"], 0
            continue
        m = TOP_SHAPE.search(line)
        if m and current is not None:
            names = tops.get(current, [])
            if index < len(names):
                counts.setdefault(names[index], int(m["count"]))
            index += 1
    # a layer's private buffer ("pool1 argmax", "bn1 x_norm") has as many 4-byte values as its first top
    first_top_counts = {layer: counts[names[0]] for layer, names in tops.items() if names and names[0] in counts}
    cached = re.findall(r"\bCOMET memory pool: .*cached (\S+ \wB)", text)
    pool = None
    if cached:
        from .caffelog import parse_comet_items

        pool = parse_comet_items(cached[-1]).get("mem_mb", 0.0) * 2**20
    return {"plan": plan, "counts": counts, "first_top_counts": first_top_counts, "pool_cached": pool}


@dataclass
class Measured:
    """One measured run of the plan: batch, mode and its figures in bytes."""

    batch: int
    comet: str
    peak: float                      # the figure fitted: peak RSS (CPU) or tracked device peak (GPU)
    peak_rss: float
    parts: dict                      # PARTS -> bytes
    at_peak: dict = field(default_factory=dict)    # the store's split of its tracked peak (KINDS)
    file_rss: float = 0.0
    per_step: dict = field(default_factory=dict)   # dense/stored bytes of a step, pool cache
    blobs: list = field(default_factory=list)      # per-blob rows (COMET on)
    seconds: float = 0.0
    log: str = ""
    device_measured: bool = False    # GPU: peak is nvidia-smi's (measured), not the store's tracked bytes

    def brief(self) -> dict:
        d = asdict(self)
        d.pop("blobs")
        return d


def _why(text: str) -> str:
    """caffe's own error line: the first fatal or failed check, without glog's prefix; else its last line."""
    from .caffelog import LogParser, why_it_stopped

    parser = LogParser()
    lines = text.splitlines()
    for line in lines:
        parser.feed(line)
    return why_it_stopped(parser, lines[-20:])


def measure(caffe: Path, work: Path, pb2, param, net, batch: int, comet: bool, *, synthetic: bool,
            shapes: dict, iters: int, gpu: int | None, history_copies: int, notes: list[str],
            timeout: float | None = None, cwd: Path | None = None) -> Measured:
    """Run the net at `batch` with COMET on or off (caffe in `cwd`, default the repository root) and read
    what the run measured."""
    from .caffeproto import write_text_proto

    mode = "on" if comet else "off"
    name = f"b{batch}_{mode}"
    net_file = work / f"{name}_net.prototxt"
    write_text_proto(net_file, net_at_batch(net, pb2, batch, synthetic, shapes, notes))
    solver_file = work / f"{name}_solver.prototxt"
    prefix = work / name
    stats = Path(str(prefix) + "_comet.csv")
    if stats.exists():
        stats.unlink()
    write_text_proto(solver_file, run_solver(param, pb2, net_file, prefix, iters, comet, gpu))
    child = run_caffe(caffe, solver_file, work / f"{name}.log", gpu=gpu, timeout=timeout, cwd=cwd)
    text = child.log.read_text(errors="replace")
    if child.rc != 0:
        how = f"exit status {child.rc}" if child.rc > 0 else f"killed by {signal.Signals(-child.rc).name}" \
            + (" (out of memory?)" if child.rc == -signal.SIGKILL else "")
        given = (" (with --input-shape " + " ".join(
            f"{top}={'x'.join(map(str, dims))}" for top, dims in shapes.items()) + ")") if shapes else ""
        raise CometError(f"caffe train failed at batch {batch} with COMET {mode} ({how}): {_why(text)}{given}; "
                         f"full log: {child.log}")
    total, rows = cometstats.last_report(stats)
    if total is None:
        raise CometError(f"the run at batch {batch} (COMET {mode}) wrote no statistics to {stats}: is this "
                         f"caffe the fork with the activation store? log: {child.log}")
    at_peak = {k: total.get(f"{k}_bytes", 0.0) or 0.0 for k in KINDS}
    tracked = total.get("peak_bytes") or sum(at_peak.values())
    history = history_copies * at_peak["weights"]
    # every learnable blob has its gradient at the peak (the step clears them first): as large as the weights
    parts = {"weights": at_peak["weights"], "weight_gradients": at_peak["weights"], "history": history,
             "blobs": tracked - 2 * at_peak["weights"]}
    if gpu is None:  # file-backed pages seen mapped: at most what was mapped at the peak
        parts["mapped"] = float(child.file_rss_max)
        parts["untracked"] = child.peak_rss - tracked - history - parts["mapped"]
        peak = float(child.peak_rss)
    elif child.device_peak is not None:  # the device, measured: the rest is CUDA's context, cuBLAS, the pool
        parts["mapped"] = 0.0
        parts["untracked"] = child.device_peak - tracked - history
        peak = float(child.device_peak)
    else:  # the device without nvidia-smi: only what the store tracks and the history
        parts["mapped"] = parts["untracked"] = 0.0
        peak = tracked + history
    info = read_log(text)
    figures = cometstats.figures(total)
    per_step = {"activations_dense": total.get("dense_bytes", 0.0), "activations_stored": total.get("stored_bytes", 0.0),
                "buffers_dense": figures.get("buffers_dense", 0.0), "buffers_stored": figures.get("buffers_stored", 0.0),
                "pool_cached": info["pool_cached"] or 0.0}
    blobs = []
    if comet:
        by_blob = {r["blob"]: r for r in rows}
        for blob, action in info["plan"]:
            r = by_blob.get(blob)
            owner = blob.rpartition(" ")[0]  # "pool1 argmax": a private buffer of layer pool1
            if r:
                dense, stored = r["dense_bytes"], r["stored_bytes"]
            elif blob in info["counts"]:  # a net blob the store keeps or frees: its Top shape, as floats
                dense = 4.0 * info["counts"][blob]
                stored = dense if action == "keep" else 0.0
            elif action == "release" and owner in info["first_top_counts"]:  # a frozen layer's buffer, freed
                dense, stored = 4.0 * info["first_top_counts"][owner], 0.0
            elif action == "until-backward" and owner in info["first_top_counts"]:
                # LRN's scale (within a channel its internal outputs): as large as its output, the
                # store does not count what it holds dense until LRN's backward
                dense = stored = 4.0 * info["first_top_counts"][owner]
            else:  # a layer's private buffer the store reports no bytes for
                dense = stored = None
            kind = action if action == "release" or not r else r["kind"]  # the CSV calls any RECOMPUTE "scale"
            blobs.append({"blob": blob, "layer": r["layer"] if r else "", "action": kind,
                          "dense_bytes": dense, "stored_bytes": stored,
                          "error_bound": (r.get("eb") or None) if r and r["kind"] == "lossy" else None})
    return Measured(batch=batch, comet=mode, peak=peak, peak_rss=float(child.peak_rss), parts=parts, at_peak=at_peak,
                    device_measured=gpu is not None and child.device_peak is not None,
                    file_rss=float(child.file_rss_max), per_step=per_step, blobs=blobs,
                    seconds=round(child.wall_seconds, 2), log=str(child.log))


# ------------------------------------------------------------------------------------- the plan

def _table_rows(runs_on: list[Measured], batch: int) -> list[dict]:
    """The per-blob rows of the COMET-on runs fitted to `batch` (the order of the store's plan)."""
    if not runs_on:
        return []
    last = max(runs_on, key=lambda r: r.batch)
    out = []
    for i, row in enumerate(last.blobs):
        pts = [(r.batch, r.blobs[i]) for r in runs_on if i < len(r.blobs) and r.blobs[i]["blob"] == row["blob"]]
        xs = [b for b, _ in pts]

        def at(key):
            ys = [x[key] for _, x in pts]
            return None if any(y is None for y in ys) else max(fit(xs, ys).at(batch), 0.0)

        out.append({"blob": row["blob"], "layer": row["layer"], "action": row["action"],
                    "dense_bytes": at("dense_bytes"), "stored_bytes": at("stored_bytes"),
                    "error_bound": row["error_bound"]})
    return out


def make_plan(solver, *, cpu: bool = False, gpu: int | None = None, memory: str | None = None,
              check=(), synthetic: bool = False, input_shapes=(),
              measure_batches: tuple[int, ...] | None = None, iters: int = DEFAULT_ITERS,
              keep: str | os.PathLike | None = None, caffe_bin=None, progress=None,
              timeout: float | None = None, verify: bool = False) -> dict:
    """Measure, fit and predict; returns the plan as a dict (the --json document). `measure_batches`:
    the batches to fit (None: DEFAULT_MEASURE, widened where a mode's peak grows too little over them,
    see WIDEN_GROWTH). `check`: batch sizes to run after the fit (N, or (N, ("on",)) for one mode);
    `verify`: also run each mode at its largest batch in `memory`. `progress(text, more=0)` is called
    before each run, with the run's description and how many runs were added to the count."""
    from .caffeproto import absolute_data_files, caffe_pb2, read_solver, train_net_only, upgraded_net
    from .paths import prepare_hint

    if cpu and gpu is not None:
        raise CometError("--cpu and --gpu contradict each other; choose one")
    budget = parse_size(memory) if memory is not None else None
    if budget is not None and budget <= 0:
        raise CometError(f"--memory {memory}: must be more than 0 bytes")
    widen = measure_batches is None
    measure_batches = tuple(sorted(set(int(b) for b in (DEFAULT_MEASURE if widen else measure_batches))))
    if len(measure_batches) < 2 or measure_batches[0] < 1:
        raise CometError("--measure needs at least two different batch sizes of 1 or more, e.g. 8,16,32")
    if iters < 1:
        raise CometError(f"--iters {iters}: must be at least 1")
    check = [(int(c), MODES) if isinstance(c, (int, str)) else (int(c[0]), tuple(c[1])) for c in check]
    if any(b < 1 for b, _ in check):
        raise CometError("--batch must be 1 or more")
    if verify and budget is None:
        raise CometError("--verify runs the largest batch that fits in --memory: give --memory too")
    shapes = parse_input_shapes(input_shapes)
    pb2 = caffe_pb2()
    solver_path, param, net_path, net, base = read_solver(solver, pb2)
    net = train_net_only(absolute_data_files(upgraded_net(net, pb2), base), param, pb2)
    solver_batch = net_batch(net, pb2)
    if not synthetic:
        missing = missing_sources(net, pb2)
        if missing:
            layer, what, path = missing[0]
            if what == "memory":
                raise CometError(f"layer '{layer}' is a MemoryData layer, which only pycaffe can feed; run plan "
                                 f"with --synthetic-input to measure on DummyData of the same shapes")
            if what == "busy":
                raise CometError(f"{net_path.name}: layer '{layer}' reads {path}, and another cometctl command is "
                                 f"preparing a dataset in {Path(path).parent} now; wait for it to finish, or run "
                                 f"plan with --synthetic-input to measure on DummyData of the same shapes")
            raise CometError(f"{net_path.name}: layer '{layer}' reads its {what} {path}, which does not exist; "
                             f"run plan with --synthetic-input to measure on DummyData of the same shapes, or "
                             f"{prepare_hint(path, base)}")
    uses_gpu = gpu is not None or (not cpu and param.solver_mode == pb2.SolverParameter.GPU)
    device_id = gpu if gpu is not None else (param.device_id if uses_gpu else None)
    if caffe_bin:
        caffe = Path(caffe_bin)
    else:
        from .train import _caffe_binary

        caffe = _caffe_binary(uses_gpu, str(device_id) if gpu is not None else None,
                              param.device_id if param.HasField("device_id") else 0)
    history_copies = solver_state_copies(param, pb2)
    notes: list[str] = []
    # fail before measuring when the net cannot be built at all (a missing shape)
    net_at_batch(net, pb2, measure_batches[0], synthetic, shapes, notes)

    own = keep is None
    work = Path(tempfile.mkdtemp(prefix="comet-plan-")) if own else Path(keep).resolve()
    work.mkdir(parents=True, exist_ok=True)
    runs: list[Measured] = []
    checks: list[dict] = []
    t0 = time.monotonic()
    failed = True
    try:
        def one(batch, comet, more=0):
            if progress:
                text = f"batch {batch}, COMET {'on' if comet else 'off'}"
                progress(text, more=more) if more else progress(text)
            return measure(caffe, work, pb2, param, net, batch, comet, synthetic=synthetic, shapes=shapes,
                           iters=iters, gpu=device_id if uses_gpu else None, history_copies=history_copies,
                           notes=notes, timeout=timeout, cwd=base)

        for b in measure_batches:
            for comet in (False, True):
                runs.append(one(b, comet))
        widened = {m: [] for m in MODES}
        for comet in (False, True) if widen else ():
            mode = "on" if comet else "off"
            while True:
                rs = sorted((r for r in runs if r.comet == mode), key=lambda r: r.batch)
                growth, nxt = rs[-1].peak - rs[0].peak, 2 * rs[-1].batch
                if growth >= WIDEN_GROWTH or nxt > WIDEN_MAX_BATCH:
                    break
                if not widened[mode]:
                    notes.append(f"COMET {mode}: the peak grew only {fmt_bytes(max(growth, 0.0))} from batch "
                                 f"{rs[0].batch} to {rs[-1].batch}, too little to tell the part that grows "
                                 f"with the batch from the runtime's own variation (about a MiB): measured "
                                 f"at larger batches too, until it grew {fmt_bytes(WIDEN_GROWTH)} "
                                 f"(--measure sets the batches and does not widen them)")
                try:
                    runs.append(one(nxt, comet, more=1))
                except CometError as e:  # the plan from the batches that ran, and why it is not wider
                    notes.append(f"COMET {mode}: not measured beyond batch {rs[-1].batch}: {e}")
                    break
                widened[mode].append(nxt)
        measure_seconds = time.monotonic() - t0
        file_cap = None if (synthetic or uses_gpu) else source_bytes(net, pb2)
        result = _assemble(runs, solver_path, net_path, solver_batch, measure_batches, iters, synthetic,
                           uses_gpu, device_id, budget, memory, history_copies, notes, file_cap)
        result["widened"] = widened
        todo = [(b, mode == "on", False) for b, modes in check for mode in MODES if mode in modes]
        if verify and result["budget"]:
            todo += [(result["budget"][f"largest_batch_{mode}"], mode == "on", True) for mode in MODES
                     if result["budget"][f"largest_batch_{mode}"]]
        for b, comet, is_verify in todo:
            m = one(b, comet)
            predicted = predict(result["fit"][m.comet], m.batch, result["file_cap_bytes"])
            checks.append({"batch": m.batch, "comet": m.comet, "predicted_bytes": predicted,
                           "measured_bytes": m.peak, "error": (predicted - m.peak) / m.peak,
                           "largest_in_budget": is_verify, "run": m.brief()})
        result["checks"] = checks
        result["seconds"] = {"measuring": round(measure_seconds, 1), "total": round(time.monotonic() - t0, 1)}
        result["work_dir"] = None if own else str(work)
        if own:  # the logs go with the temporary folder
            for r in result["runs"] + [c["run"] for c in checks]:
                r["log"] = None
        failed = False
        return result
    finally:
        if own and not failed:
            shutil.rmtree(work, ignore_errors=True)


def source_bytes(net, pb2) -> float | None:
    """Bytes of the files of the TRAIN net's Data layers' sources (LMDB, LevelDB: what the data layer maps
    and reads pages of); None when there are none."""
    total, found = 0, False
    for layer in train_layers(net, pb2):
        if layer.type == "Data" and layer.data_param.source:
            src = from_root(layer.data_param.source)
            files = [src] if src.is_file() else list(src.glob("*")) if src.is_dir() else []
            total += sum(f.stat().st_size for f in files if f.is_file())
            found = found or bool(files)
    return float(total) if found else None


def _assemble(runs, solver_path, net_path, solver_batch, measure_batches, iters, synthetic, uses_gpu,
              device_id, budget, memory, history_copies, notes, file_cap=None) -> dict:
    device_measured = uses_gpu and all(r.device_measured for r in runs)
    if uses_gpu and not device_measured and any(r.device_measured for r in runs):
        raise CometError("nvidia-smi answered for some runs and not for others: the peaks cannot be fitted "
                         "together; run the plan again")
    fits: dict[str, dict] = {}
    for mode in MODES:
        rs = [r for r in runs if r.comet == mode]
        xs = [r.batch for r in rs]
        f = {"peak": fit(xs, [r.peak for r in rs])}
        for part in PARTS:
            f[part] = fit(xs, [r.parts[part] for r in rs])
        if not uses_gpu:
            f["peak_rss"] = f["peak"]
        else:
            f["peak_rss"] = fit(xs, [r.peak_rss for r in rs])
        for k in STEP_FIGURES:
            f[k] = fit(xs, [r.per_step.get(k, 0.0) for r in rs])
        residual = max(abs(f["peak"].at(r.batch) - r.peak) / r.peak for r in rs)
        fits[mode] = {k: asdict(v) for k, v in f.items()}
        fits[mode]["max_residual"] = residual
    predicted = {m: predict(fits[m], solver_batch, file_cap) for m in MODES}
    result = {
        "schema": SCHEMA,
        "solver": str(solver_path),
        "net": str(net_path),
        "device": f"GPU {device_id}" if uses_gpu else "CPU",
        "figure": (("the device's memory in use above its idle value, nvidia-smi's peak (measured)"
                    if device_measured else
                    "the store's tracked device bytes plus the solver history (unmeasured: no device peak "
                    "was read)") if uses_gpu else "peak resident set size of the caffe process (measured)"),
        "measured": not uses_gpu or device_measured,
        "input": "synthetic (DummyData)" if synthetic else "the net's data layers",
        "iters": iters,
        "measure_batches": list(measure_batches),
        "solver_batch": solver_batch,
        "solver_history_copies": history_copies,
        "file_cap_bytes": file_cap,
        "notes": list(dict.fromkeys(notes)),
        "runs": [r.brief() for r in runs],
        "fit": fits,
        "predicted": {"batch": solver_batch, "off_bytes": predicted["off"], "on_bytes": predicted["on"],
                      "factor": predicted["off"] / predicted["on"] if predicted["on"] > 0 else None},
        "layers": _table_rows([r for r in runs if r.comet == "on"], solver_batch),
        "budget": None,
    }
    if budget is not None:
        largest = {m: largest_batch(fits[m], budget, file_cap) for m in MODES}
        off, on = largest["off"], largest["on"]
        result["budget"] = {"text": memory, "bytes": budget, "largest_batch_off": off, "largest_batch_on": on,
                            "factor": (on / off) if (on and off) else None}
    return result


def budget_problem(result: dict) -> str | None:
    """The plain sentence for a budget that not even batch 1 fits in with COMET on (None if it fits)."""
    b = result.get("budget")
    if not b or b["largest_batch_on"] != 0:
        return None
    f = result["fit"]["on"]
    parts = ", ".join(f"{PART_NAMES[p]} {fmt_bytes(f[p]['fixed'])}" for p in PARTS if abs(f[p]["fixed"]) >= 2**20)
    one = predict(f, 1, result.get("file_cap_bytes"))
    return (f"--memory {b['text']} ({fmt_bytes(b['bytes'])}) is smaller than what the net needs before "
            f"any batch: the fixed part is {fmt_bytes(f['peak']['fixed'])} with COMET on ({parts}), "
            f"and batch 1 needs {fmt_bytes(one)}; the weights alone do not fit")


# ---------------------------------------------------------------------------------------- output

def render(result: dict) -> list[str]:
    """The plan as text lines (what the command prints)."""
    out = []
    mb = ", ".join(map(str, result["measure_batches"]))
    more = "".join(f"; COMET {m} also at {', '.join(map(str, bs))}"
                   for m, bs in (result.get("widened") or {}).items() if bs)
    out.append(f"plan for {result['solver']}")
    out.append(f"  {result['device']}, input: {result['input']}, measured at batches {mb} "
               f"({result['iters']} iterations each), COMET off and on{more}")
    out.append(f"  figure: {result['figure']}")
    for n in result["notes"]:
        out.append(f"  note: {n}")
    n = result["solver_batch"]
    if result["layers"]:
        out.append("")
        out.append(f"per blob at batch {n} (COMET on; fitted from the measured batches):")
        w = max([4] + [len(r["blob"]) for r in result["layers"]])
        out.append(f"  {'blob':<{w}}  {'action':<17} {'dense':>11} {'stored':>11} {'ratio':>7}  error bound")
        dense = stored = 0.0
        for r in result["layers"]:
            ratio = r["dense_bytes"] / r["stored_bytes"] if r["stored_bytes"] else None
            eb = f"{r['error_bound']:.2e}" if r["error_bound"] else "-"
            action = ACTION_NAMES.get(r["action"], r["action"])
            out.append(f"  {r['blob']:<{w}}  {action:<17} {fmt_bytes(r['dense_bytes']):>11} "
                       f"{fmt_bytes(r['stored_bytes']):>11} {(f'{ratio:.1f}x' if ratio else '-'):>7}  {eb}")
            dense += r["dense_bytes"] or 0.0
            stored += r["stored_bytes"] or 0.0
        out.append(f"  {'all':<{w}}  {'':<17} {fmt_bytes(dense):>11} {fmt_bytes(stored):>11} "
                   f"{(f'{dense / stored:.1f}x' if stored else '-'):>7}")
    out.append("")
    out.append(f"peak memory = fixed + per sample x batch, and at batch {n}:")
    out.append(f"  {'':<44} {'COMET off':>34}   {'COMET on':>34}")

    def row(name, cells):
        out.append(f"  {name:<44} {cells[0]:>34}   {cells[1]:>34}")

    def cell(f, at):
        sign = "-" if f["per_sample"] < 0 else "+"
        return f"{fmt_bytes(f['fixed'])} {sign} {fmt_bytes(abs(f['per_sample']))} = {fmt_bytes(at):>10}"

    cap = result.get("file_cap_bytes")
    parts = [p for p in PARTS if not (result["device"] != "CPU" and p in ("mapped", "untracked"))]
    for p in parts + ["peak"]:
        name = "total" if p == "peak" else PART_NAMES[p]
        if p == "history":
            name += f" ({result['solver_history_copies']}x weights)"
        cells = []
        for m in MODES:
            f = result["fit"][m][p]
            if p == "peak":
                at = predict(result["fit"][m], n, cap)
            elif p == "mapped" and cap is not None:
                at = min(Line(**f).at(n), f["fixed"] + cap)
            else:
                at = Line(**f).at(n)
            cells.append(cell(f, at))
        row(name, cells)
    on = result["fit"]["on"]
    out.append("  per training step, COMET on:")
    for k, name in STEP_FIGURES.items():
        f = on[k]
        if f["fixed"] or f["per_sample"]:
            out.append(f"    {name:<42} {'':>34}   {cell(f, max(Line(**f).at(n), 0.0)):>34}")
    for m in MODES:
        r = max((r for r in result["runs"] if r["comet"] == m), key=lambda r: r["batch"], default=None)
        top = r["batch"] if r else None
        if r and r.get("at_peak"):
            split = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r["at_peak"].items())
            out.append(f"  the store's peak at batch {top}, COMET {m}: {split}")
    res = max(result["fit"][m]["max_residual"] for m in MODES)
    out.append(f"  (the fit passes within {100 * res:.1f}% of every measured peak)")
    if cap is not None:
        out.append(f"  (file-backed pages grow with the records a run reads, up to the data source's "
                   f"{fmt_bytes(cap)}: counted up to that)")
    p = result["predicted"]
    out.append("")
    out.append(f"predicted peak at the solver's batch {n}: COMET off {fmt_bytes(p['off_bytes'])}, "
               f"COMET on {fmt_bytes(p['on_bytes'])}" + (f" ({p['factor']:.2f}x less)" if p["factor"] else ""))
    b = result.get("budget")
    if b:
        def say(x):
            return "no limit within the fit" if x is None else ("none (not even batch 1)" if x == 0 else f"{x:,}")
        out.append(f"largest batch in {b['text']} ({fmt_bytes(b['bytes'])}): COMET off {say(b['largest_batch_off'])}, "
                   f"COMET on {say(b['largest_batch_on'])}" + (f" ({b['factor']:.2f}x)" if b["factor"] else ""))
    for c in result.get("checks", []):
        line = (f"check at batch {c['batch']}, COMET {c['comet']}: predicted {fmt_bytes(c['predicted_bytes'])}, "
                f"measured {fmt_bytes(c['measured_bytes'])} ({100 * c['error']:+.1f}%)")
        if c.get("largest_in_budget"):
            left = b["bytes"] - c["measured_bytes"]
            line += (f"; the largest batch in {b['text']}: " +
                     (f"fits, {fmt_bytes(left)} to spare" if left >= 0 else f"over the budget by {fmt_bytes(-left)}"))
        out.append(line)
    if result["device"] != "CPU" and not result["measured"]:
        out.append("GPU figures are the store's device bytes, not a measured device peak (unmeasured: no "
                   "nvidia-smi): CUDA's context and cuBLAS workspaces come on top")
    elif result["device"] != "CPU":
        out.append("GPU figures are nvidia-smi's memory in use above its value before each run (measured), "
                   f"sampled every {SAMPLE_MS} ms")
    return out


def write_json(result: dict, path) -> None:
    text = json.dumps(result, indent=1)
    if str(path) == "-":
        print(text)
        return
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)
