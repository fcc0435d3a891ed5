"""Caffe's protobuf messages (Datum, BlobProto, NetParameter, SolverParameter), taken from the built fork.

The messages come from the pycaffe that `cometctl build` produced, so what we write is exactly what the
fork's C++ reads. Importing is lazy: commands that do not touch Caffe's formats work without a build.

For development before a build exists, COMET_CAFFE_PB2 may name a directory that protoc wrote the
same protos into (`protoc --python_out DIR --proto_path src src/caffe/proto/*.proto` in the patched
tree: DIR/caffe/proto/caffe_pb2.py and comet_pb2.py, which caffe_pb2 imports as caffe.proto.comet_pb2);
it is never used when unset.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

from .errors import CometError

_pb2: ModuleType | None = None


def caffe_pb2() -> ModuleType:
    """The caffe_pb2 module of the built pycaffe (imported once)."""
    global _pb2
    if _pb2 is not None:
        return _pb2
    override = os.environ.get("COMET_CAFFE_PB2")
    if override:
        if override not in sys.path:
            sys.path.insert(0, override)
        try:
            _pb2 = importlib.import_module("caffe.proto.caffe_pb2")
        except ImportError as e:
            raise CometError(f"COMET_CAFFE_PB2={override}: no usable caffe/proto/caffe_pb2.py there "
                             f"({e})") from None
        return _pb2
    _pb2 = import_caffe().proto.caffe_pb2
    return _pb2


def import_caffe() -> ModuleType:
    """`import caffe` from the fork's pycaffe, with a clear error when it is not built."""
    from .paths import pycaffe_dir

    directory = str(pycaffe_dir())  # raises CometError when not built
    if directory not in sys.path:
        sys.path.insert(0, directory)
    # keep pycaffe's glog quiet in our process (glog reads this when the library loads), without
    # leaking the setting into the environment of caffe processes we start later
    saved = os.environ.get("GLOG_minloglevel")
    os.environ.setdefault("GLOG_minloglevel", "2")
    try:
        caffe = importlib.import_module("caffe")
        importlib.import_module("caffe.proto.caffe_pb2")
    except ImportError as e:
        raise CometError(f"pycaffe in {directory} does not import: {e}") from None
    finally:
        if saved is None:
            os.environ.pop("GLOG_minloglevel", None)
    return caffe


def read_text_proto(path, message):
    """Parse a prototxt file into `message` (a fresh protobuf message); CometError on syntax errors."""
    from google.protobuf import text_format

    try:
        with open(path) as f:
            text_format.Merge(f.read(), message)
    except FileNotFoundError:
        raise CometError(f"{path}: no such file") from None
    except text_format.ParseError as e:
        raise CometError(f"{path}: not a valid {type(message).__name__} prototxt: {e}") from None
    return message


def write_text_proto(path, message) -> None:
    from google.protobuf import text_format

    with open(path, "w") as f:
        f.write(text_format.MessageToString(message))


# Layer types that produce a net's input (what a planner or a harness replaces by DummyData).
DATA_LAYER_TYPES = ("Data", "ImageData", "HDF5Data", "WindowData", "MemoryData", "Input")


def meets_train_rule(rule, pb2) -> bool:
    """Caffe's StateMeetsRule for the state {phase: TRAIN, level: 0, no stages}."""
    if rule.HasField("phase") and rule.phase != pb2.TRAIN:
        return False
    if rule.HasField("min_level") and rule.min_level > 0:
        return False
    if rule.HasField("max_level") and rule.max_level < 0:
        return False
    return not rule.stage  # a rule that needs a stage is not met (not_stage: none of ours)


def in_train_phase(layer, pb2) -> bool:
    """Whether Caffe keeps `layer` in the TRAIN net (its include and exclude rules)."""
    if layer.include:
        return any(meets_train_rule(r, pb2) for r in layer.include)
    return not any(meets_train_rule(r, pb2) for r in layer.exclude)


def read_solver(solver, pb2):
    """The solver the user named and its net: (solver path, SolverParameter, net path, NetParameter).
    Only `net:` solvers (what cometctl writes and upstream's models use); a missing net is named."""
    from .paths import REPO_ROOT, from_root, user_file

    solver_path = user_file(solver)
    param = read_text_proto(solver_path, pb2.SolverParameter())
    if not param.net:
        raise CometError(f"{solver_path}: the solver has no `net:` (train_net/net_param are not supported here)")
    net_path = from_root(param.net)
    if not net_path.exists():
        raise CometError(f"{solver_path}: net {param.net} not found (relative paths start at {REPO_ROOT})")
    return solver_path, param, net_path, read_text_proto(net_path, pb2.NetParameter())
