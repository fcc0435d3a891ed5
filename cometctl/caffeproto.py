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
from pathlib import Path
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


def learnable_blobs(layer) -> int:
    """How many learnable blobs Caffe gives a layer of this kind (its LayerSetUp); 0 for the kinds that
    have none or that this does not know."""
    t = layer.type
    if t in ("Convolution", "Deconvolution"):
        return 1 + layer.convolution_param.bias_term
    if t == "InnerProduct":
        return 1 + layer.inner_product_param.bias_term
    if t == "Embed":
        return 1 + layer.embed_param.bias_term
    if t == "Scale":  # with a second bottom the factors come from it
        return (len(layer.bottom) == 1) + layer.scale_param.bias_term
    return {"BatchNorm": 3, "Bias": 1, "PReLU": 1}.get(t, 0)


def freeze_layers_before(layers, name: str) -> None:
    """Fine-tuning's freeze, in place: every layer before `name` (in the net's order) learns nothing,
    lr_mult 0 on each of its params (BatchNorm's three too: Net counts a missing ParamSpec as lr_mult
    1 when it decides which layers run a backward). ValueError when no layer has that name."""
    names = [layer.name for layer in layers]
    if name not in names:
        raise ValueError(f"no layer {name} in the net; its layers: " + " ".join(names))
    for layer in layers[:names.index(name)]:
        for i in range(learnable_blobs(layer)):
            (layer.param[i] if i < len(layer.param) else layer.param.add()).lr_mult = 0


def replace_relus(layers, neuron: str, out_of_place: bool = False) -> None:
    """Every ReLU of `layers` (in the net's order) made a `neuron` layer (PReLU, Swish), in place. With
    `out_of_place`, one that was in place writes a blob named after itself instead, and the layers after
    it read that blob (a Swish's backward works from its input, which in place it overwrites)."""
    renamed = {}  # a ReLU's in-place blob -> the output that replaces it for later readers
    for layer in layers:
        layer.bottom[:] = [renamed.get(b, b) for b in layer.bottom]
        if layer.type != "ReLU":
            continue
        layer.type = neuron
        layer.ClearField("relu_param")
        if out_of_place and list(layer.top) == list(layer.bottom):
            renamed[layer.top[0]] = layer.name
            layer.top[:] = [layer.name]


def add_squeeze_excitation(layers, reduction: int = 16) -> int:
    """SENet's channel attention (Hu et al., "Squeeze-and-Excitation Networks") on every residual branch of `layers` (a
    list, changed in place): each Eltwise's bottom named `*_branch2b` (the last BatchNorm and Scale of a ResNet block's
    branch, C channels) is multiplied, per sample and channel, by a gate made from it: global average pooling,
    InnerProduct to C / reduction, ReLU, InnerProduct to C, Sigmoid, and a Scale by that second bottom (axis 0), whose
    output the Eltwise reads instead. Returns how many branches it changed."""
    made = 0
    i = 0
    while i < len(layers):
        eltwise = layers[i]
        branches = [b for b in eltwise.bottom if b.endswith("_branch2b")] if eltwise.type == "Eltwise" else []
        if not branches:
            i += 1
            continue
        blob = branches[0]
        channels = next(layer.convolution_param.num_output for layer in layers[:i]
                        if layer.type == "Convolution" and blob in layer.top)
        new = type(eltwise)
        prefix = blob[:-len("_branch2b")] + "_se"
        gate = [
            new(name=f"{prefix}_squeeze", type="Pooling", bottom=[blob], top=[f"{prefix}_squeeze"]),
            new(name=f"{prefix}_down", type="InnerProduct", bottom=[f"{prefix}_squeeze"], top=[f"{prefix}_down"]),
            new(name=f"{prefix}_down_relu", type="ReLU", bottom=[f"{prefix}_down"], top=[f"{prefix}_down"]),
            new(name=f"{prefix}_up", type="InnerProduct", bottom=[f"{prefix}_down"], top=[f"{prefix}_up"]),
            new(name=f"{prefix}_gate", type="Sigmoid", bottom=[f"{prefix}_up"], top=[f"{prefix}_up"]),
            new(name=prefix, type="Scale", bottom=[blob, f"{prefix}_up"], top=[prefix]),
        ]
        gate[0].pooling_param.pool = gate[0].pooling_param.AVE
        gate[0].pooling_param.global_pooling = True
        for ip, outputs in ((gate[1], max(channels // reduction, 1)), (gate[3], channels)):
            ip.inner_product_param.num_output = outputs
            ip.inner_product_param.weight_filler.type = "msra"
        gate[5].scale_param.axis = 0
        eltwise.bottom[list(eltwise.bottom).index(blob)] = prefix
        layers[i:i] = gate
        i += len(gate) + 1
        made += 1
    return made


def make_depthwise_separable(layers) -> int:
    """MobileNet's convolutions (Howard et al., "MobileNets"), in `layers` (a list, changed in place): every
    Convolution with a kernel larger than 1x1 and no groups, but those that read a data layer's top (the stem
    stays a full convolution), becomes a depthwise one (a group per input channel, the same kernel, stride,
    padding and dilation, no bias) with BatchNorm, Scale and ReLU in place, then the original layer as a 1x1
    pointwise convolution (its name, outputs and weight filler kept: the layers after it are unchanged).
    Input channels are followed through the net: a Convolution's or InnerProduct's top has num_output,
    a Concat's top the sum of its bottoms, any other layer's tops those of its first bottom. Returns how many
    convolutions it split."""
    channels: dict[str, int] = {}
    from_data: set[str] = set()
    made = 0
    i = 0
    while i < len(layers):
        layer = layers[i]
        cp = layer.convolution_param
        kernel = (cp.kernel_h, cp.kernel_w) if cp.kernel_h else (tuple(cp.kernel_size) * 2)[:2]
        if (layer.type == "Convolution" and cp.group == 1 and max(kernel or (1,)) > 1
                and layer.bottom[0] not in from_data and layer.bottom[0] in channels):
            c = channels[layer.bottom[0]]
            new = type(layer)
            dw = f"{layer.name}_dw"
            depthwise = new(name=dw, type="Convolution", bottom=[layer.bottom[0]], top=[dw])
            depthwise.convolution_param.CopyFrom(cp)
            depthwise.convolution_param.num_output = c
            depthwise.convolution_param.group = c
            depthwise.convolution_param.bias_term = False
            depthwise.convolution_param.ClearField("bias_filler")
            depthwise.convolution_param.weight_filler.type = "msra"
            bn = new(name=f"{dw}_bn", type="BatchNorm", bottom=[dw], top=[dw])
            scale = new(name=f"{dw}_scale", type="Scale", bottom=[dw], top=[dw])
            scale.scale_param.bias_term = True
            relu = new(name=f"{dw}_relu", type="ReLU", bottom=[dw], top=[dw])
            for field in ("kernel_size", "stride", "pad", "dilation", "kernel_h", "kernel_w", "stride_h",
                          "stride_w", "pad_h", "pad_w"):
                cp.ClearField(field)
            cp.kernel_size.append(1)
            layer.bottom[0] = dw
            layers[i:i] = [depthwise, bn, scale, relu]
            channels[dw] = c
            i += 4
            made += 1
        if not layer.bottom:
            from_data.update(layer.top)
        elif layer.type in ("Convolution", "InnerProduct"):
            out = cp.num_output if layer.type == "Convolution" else layer.inner_product_param.num_output
            channels.update({t: out for t in layer.top})
        elif layer.type == "Concat" and all(b in channels for b in layer.bottom):
            channels.update({t: sum(channels[b] for b in layer.bottom) for t in layer.top})
        elif layer.bottom[0] in channels:
            channels.update({t: channels[layer.bottom[0]] for t in layer.top})
        i += 1
    return made


def meets_train_rule(rule, pb2, state=None) -> bool:
    """Caffe's StateMeetsRule for `state` (a NetState: net_state below), by default the TRAIN state
    {phase: TRAIN, level: 0, no stages}."""
    phase = state.phase if state is not None else pb2.TRAIN
    level = state.level if state is not None else 0
    stages = set(state.stage) if state is not None else set()
    if rule.HasField("phase") and rule.phase != phase:
        return False
    if rule.HasField("min_level") and level < rule.min_level:
        return False
    if rule.HasField("max_level") and level > rule.max_level:
        return False
    return all(s in stages for s in rule.stage) and not any(s in stages for s in rule.not_stage)


def in_train_phase(layer, pb2, state=None) -> bool:
    """Whether Caffe keeps `layer` in the TRAIN net, or in a net of `state` (its include and exclude rules)."""
    if layer.include:
        return any(meets_train_rule(r, pb2, state) for r in layer.include)
    return not any(meets_train_rule(r, pb2, state) for r in layer.exclude)


def net_state(phase, net, given, pb2):
    """The state Caffe builds a net in (Solver::InitTrainNet, InitTestNets): `phase`, then the net's own
    `state`, then the solver's (`train_state`, or test net i's `test_state[i]`; None when it has none)."""
    state = pb2.NetState()
    state.phase = phase
    state.MergeFrom(net.state)
    if given is not None:
        state.MergeFrom(given)
    return state


def net_in_state(net, state, pb2):
    """`net` (a copy) with only the layers Caffe keeps in a net built in `state` (a NetState), their include
    and exclude rules dropped."""
    out = pb2.NetParameter()
    out.CopyFrom(net)
    del out.layer[:]
    for layer in net.layer:
        if in_train_phase(layer, pb2, state):
            kept = out.layer.add()
            kept.CopyFrom(layer)
            kept.ClearField("include")
            kept.ClearField("exclude")
    out.ClearField("state")
    return out


def train_net_only(net, param, pb2):
    """`net` (a copy) with only the layers Caffe keeps in the train net, their include and exclude rules
    dropped: what later code reads holds for any level and stages the solver trains with."""
    return net_in_state(net, net_state(pb2.TRAIN, net, param.train_state, pb2), pb2)


def nets_caffe_builds(param, net, test_nets, pb2) -> list:
    """The nets a solver makes Caffe build (Solver::InitTrainNet and InitTestNets), each as (NetParameter
    with the layers of its state only, index of the test net or None for the train net): the train net;
    the solver's own test nets (`test_nets`: read_test_nets' pairs); then the train net's file once more
    in phase TEST for each `test_iter` beyond those. Test net i takes `test_state[i]` when given."""
    out = [(train_net_only(net, param, pb2), None)]
    own = [n for n, _ in test_nets]
    generic = [net] * max(0, len(param.test_iter) - len(own))
    for i, test_net in enumerate(own + generic):
        state = net_state(pb2.TEST, test_net, param.test_state[i] if param.test_state else None, pb2)
        out.append((net_in_state(test_net, state, pb2), i))
    return out


# Caffe's four ways of naming the train net (exactly one of them, Solver::InitTrainNet).
TRAIN_NET_FIELDS = ("net", "net_param", "train_net", "train_net_param")


def _given(param, field: str) -> bool:
    return param.HasField(field) if field.endswith("_param") else bool(getattr(param, field))


def read_solver(solver, pb2):
    """The solver the user named and its train net: (solver path, SolverParameter, net path, NetParameter,
    the folder caffe is to run in).

    The train net may be named as Caffe allows: `net:` or `train_net:` (a file) or inline (`net_param { }`,
    `train_net_param { }`: the net path is then the solver's own). Relative paths start at the folder
    that paths.caffe_folder chooses (the current one when the net, or an inline net's data, is found from
    there; else the repository root). A solver with none or more than one train net is refused, as Caffe
    would refuse it, and a missing file is named."""
    from .paths import caffe_folder, user_file

    solver_path = user_file(solver)
    param = read_text_proto(solver_path, pb2.SolverParameter())
    given = [f for f in TRAIN_NET_FIELDS if _given(param, f)]
    if not given:
        raise CometError(f"{solver_path}: the solver names no train net (one of `net:`, `net_param {{ }}`, "
                         f"`train_net:`, `train_net_param {{ }}`)")
    if len(given) > 1:
        raise CometError(f"{solver_path}: the solver names its train net more than once ("
                         f"{', '.join(given)}); Caffe takes exactly one")
    field = given[0]
    if field.endswith("_param"):
        net = getattr(param, field)
        return solver_path, param, solver_path, net, caffe_folder([f for _, f in data_files(net)])
    base = caffe_folder([getattr(param, field)])
    net_path = _net_file(solver_path, getattr(param, field), field, base)
    net = read_text_proto(net_path, pb2.NetParameter())
    if Path(getattr(param, field)).is_absolute():  # then the net's own relative paths decide
        base = caffe_folder([f for _, f in data_files(net)])
    return solver_path, param, net_path, net, base


DATA_SOURCE_PARAMS = ("data_param", "image_data_param", "hdf5_data_param", "window_data_param")


def _file_fields(net):
    """(layer, message, field) for each file a net's layers read: the sources of Data, ImageData, HDF5Data
    and WindowData layers and mean files (V1 layers too)."""
    for layer in list(net.layer) + list(net.layers):
        for name in DATA_SOURCE_PARAMS:
            if layer.HasField(name) and getattr(layer, name).source:
                yield layer, getattr(layer, name), "source"
        if layer.HasField("transform_param") and layer.transform_param.mean_file:
            yield layer, layer.transform_param, "mean_file"


def data_files(net) -> list[tuple[str, str]]:
    """(layer name, file) for each file a net's layers read, as written there (_file_fields)."""
    return [(layer, name) for layer, _, name in data_file_kinds(net)]


def data_file_kinds(net) -> list[tuple[str, str, str]]:
    """(layer name, "source" or "mean file", file) for each file a net's layers read, as written there."""
    return [(layer.name, "mean file" if field == "mean_file" else "source", getattr(message, field))
            for layer, message, field in _file_fields(net)]


def absolute_data_files(net, base):
    """`net` (a copy) with the relative paths that data_files lists made absolute from `base`, for runs
    whose nets are written elsewhere (cometctl plan's work folder)."""
    from .paths import from_root

    out = type(net)()
    out.CopyFrom(net)
    for _, message, field in _file_fields(out):
        setattr(message, field, str(from_root(getattr(message, field), base)))
    return out


def _net_file(solver_path, name: str, field: str, base):
    from .paths import REPO_ROOT, from_root

    path = from_root(name, base)
    if not path.exists():
        where = sorted({str(Path.cwd().resolve()), str(REPO_ROOT)})
        raise CometError(f"{solver_path}: {field} {name} not found (relative paths start at "
                         f"{' or '.join(where)})")
    return path


def read_test_nets(solver_path, param, pb2, base) -> list:
    """The solver's own test nets as (NetParameter, file or None when inline), in Caffe's order
    (`test_net_param`s first, then `test_net` files); the train net's TEST phase is not among them."""
    nets = [(n, None) for n in param.test_net_param]
    for name in param.test_net:
        path = _net_file(solver_path, name, "test_net", base)
        nets.append((read_text_proto(path, pb2.NetParameter()), path))
    return nets


def write_solver_nets(param, folder, solver_path, base, test_nets) -> None:
    """Give every net of the solver a file of its own in `folder` (a run's copy: the run stays
    reproducible when the originals change, and inline nets become files) and point `param` at them:
    `net:` or `net_param` -> train_val.prototxt, `train_net(_param)` -> train_net.prototxt, test nets
    (`test_nets`: read_test_nets' list) -> test_net_<i>.prototxt."""
    folder = Path(folder)

    def place(field_file, field_param, target):
        if param.HasField(field_param):
            write_text_proto(target, getattr(param, field_param))
            param.ClearField(field_param)
        else:
            _copy(_net_file(solver_path, getattr(param, field_file), field_file, base), target)
        setattr(param, field_file, str(target))

    if _given(param, "net") or _given(param, "net_param"):
        place("net", "net_param", folder / "train_val.prototxt")
    else:
        place("train_net", "train_net_param", folder / "train_net.prototxt")
    targets = []
    for i, (net, source) in enumerate(test_nets):  # written before the solver's own fields are cleared
        targets.append(str(folder / f"test_net_{i}.prototxt"))
        if source is None:
            write_text_proto(targets[-1], net)
        else:
            _copy(source, Path(targets[-1]))
    param.ClearField("test_net_param")
    del param.test_net[:]
    param.test_net.extend(targets)


def _copy(source: Path, target: Path) -> None:
    """A net file into a run folder; nothing to do when it is that very file (a run's own solver copy
    given again to go on with that run)."""
    import shutil

    if not (target.exists() and source.resolve() == target.resolve()):
        shutil.copyfile(source, target)


def upgraded_net(net, pb2):
    """`net` in the current format: a net in Caffe's deprecated V1 format (`layers { type: CONVOLUTION }`,
    which caffe upgrades as it loads) goes through upstream's own upgrade_net_proto_text, so that what
    we read of it (layer types, batch sizes) is what caffe will run."""
    import subprocess
    import tempfile

    from .paths import tool_path

    if not net.layers:
        return net
    tool = tool_path("upgrade_net_proto_text")
    with tempfile.TemporaryDirectory(prefix="comet-upgrade-") as tmp:
        old, new = Path(tmp) / "v1.prototxt", Path(tmp) / "upgraded.prototxt"
        write_text_proto(old, net)
        r = subprocess.run([str(tool), str(old), str(new)], capture_output=True, text=True, timeout=120)
        if r.returncode != 0 or not new.exists():
            lines = [ln for ln in r.stderr.splitlines() if ln.startswith(("E", "F")) and "]" in ln]
            why = lines[-1].split("] ", 1)[-1] if lines else f"exit status {r.returncode}"
            raise CometError(f"net '{net.name}' is in Caffe's V1 format and upgrade_net_proto_text failed: {why}")
        return read_text_proto(new, pb2.NetParameter())
