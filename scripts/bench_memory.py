"""COMET off and on side by side, in one run: training iterations of a net on the CPU (or GPU).

For each batch size, the fork's `caffe train` runs the net of --model, first without a comet block,
then with one:
  caffenet (default): the shipped CaffeNet (models/bvlc_reference_caffenet),
  resnet: the shipped ResNet-18 (models/resnet18_dogs: BatchNorm, Scale, Eltwise shortcuts),
  resnet_se: the same with SENet's channel attention on every residual branch (a Scale by a
      second bottom, caffeproto.add_squeeze_excitation),
  resnet_depthwise: the same with MobileNet's convolutions: each 3x3 one but the stem split into a
      depthwise 3x3 (a group per channel) with BatchNorm, Scale and ReLU, and a 1x1
      (caffeproto.make_depthwise_separable),
  googlenet: upstream's GoogLeNet (models/bvlc_googlenet in the patched tree: Inception branches
      through Split and Concat, three losses),
  cifar10_sigmoid: upstream's CIFAR-10 net with Sigmoid and BatchNorm without Scale
      (examples/cifar10/cifar10_full_sigmoid_train_test_bn.prototxt), on random 32x32 crops,
  cifar10_prelu: upstream's CIFAR-10 quick net with its ReLUs made PReLUs (in place), on random
      32x32 crops,
  cifar10_swish: the same with its ReLUs made Swish (not in place, as EfficientNet's), on random
      32x32 crops,
  cifar10_swish_in_place: the same with its ReLUs made Swish in place (as a Caffe user swapping
      the ReLU's type would), on random 32x32 crops,
  cifar10_full: upstream's CIFAR-10 full net (LRN within channels, average pooling), on random
      32x32 crops.
Its input is either
  --data images (default): the shipped Data layer reading the embedded synthetic dataset, made once at
      256x256 (`cometctl prepare-dogs --synthetic --size 256`; picture-like content, as in real
      training), with `prefetch: 1` so that the input batches in memory are the same as with DummyData;
  --data noise: DummyData, Gaussian noise (std 50), the worst case for compression.
TEST-phase layers and Accuracy are dropped; the net is otherwise unchanged. Each run is its own process, so its peak resident set size
(ru_maxrss from wait4) is its own (started through cometctl.plan.run_caffe's small launcher, so the
benchmark's own memory does not count). Reported per run: peak RSS, the store's tracked peak and activation
storage (COMET runs), seconds per iteration after warm-up (wall clock, median), and the CPU seconds
(user + system) of the whole run, which another tenant's load on a shared machine disturbs less.

    scripts/bench_memory [--model caffenet|resnet|resnet_se|resnet_depthwise|googlenet|cifar10_sigmoid|
                                  cifar10_prelu|cifar10_swish|cifar10_swish_in_place|cifar10_full]
                         [--batches 64 256]
                         [--iters 3]
                         [--warmup 1] [--repeat 1] [--data images|noise] [--pool-headroom 0]
                         [--sync] [--also "FIELD: VALUE"] [--set "FIELD: VALUE"] [--gpu 0]
                         [--freeze-before LAYER] [--bn-global-stats] [--markdown out.md]

--sync adds a third run per repetition, COMET with `async: false` (every encode and decode inside
the step), so the table shows what taking COMET's work off the critical path gains. COMET runs
report their codec time per iteration (encode + decode, wherever it ran) and the part of it the
step waited for (the store's CSV: encode_ms, decode_ms, wait_ms). --also "FIELD: VALUE" adds one
more COMET run per repetition with that comet { } setting on top, in a row of its own (repeatable);
--set changes every COMET run. The COMET runs' block, before those, is

    comet { {COMET_SETTINGS} }

and a setting of one of its fields replaces that field's value.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cometctl import caffeproto, cometstats, paths, plan  # noqa: E402

# the COMET runs' comet { } block, before --set and --also
COMET_SETTINGS = "eb_mode: ADAPTIVE error_bound: 1e-3 adaptive_target: 0.05 update_interval: 200"


def comet_block(pb2, text_format, settings: list[str]) -> str:
    """The comet { } block of COMET_SETTINGS with `settings` ("FIELD: VALUE") on top, in order: a
    setting of a field the block already has replaces its value (text_format.Merge keeps the last
    value of a non-repeated field; the same field twice in a prototxt is a parse error in caffe),
    one of a repeated field adds to it. A setting comet { } does not parse ends the benchmark
    before any run, naming it."""
    param = pb2.CometParameter()
    text_format.Merge(COMET_SETTINGS, param)
    for setting in settings:
        try:
            text_format.Merge(setting, param)
        except text_format.ParseError as e:
            raise SystemExit(f"bench_memory: {setting!r} is not a comet {{ }} setting: {e}")
    return "comet {\n" + text_format.MessageToString(param, indent=2) + "}\n"


def make_images(cometctl: Path) -> Path:
    """The embedded synthetic dataset at 256x256, made once under build/bench-data."""
    out = ROOT / "build" / "bench-data" / "synthetic256"
    if not (out / "train_lmdb" / "data.mdb").exists() or not (out / "mean.binaryproto").exists():
        print(f"making the benchmark images in {out} ...", flush=True)
        subprocess.run([str(cometctl), "prepare-dogs", "--synthetic", "--size", "256",
                        "--data-dir", str(out)], check=True, stdout=subprocess.DEVNULL)
    return out


MODELS = {
    "caffenet": ("CaffeNet", "repo", "models/bvlc_reference_caffenet/train_val.prototxt"),
    "resnet": ("ResNet-18", "repo", "models/resnet18_dogs/train_val.prototxt"),
    "resnet_se": ("ResNet-18 with squeeze-and-excitation", "repo", "models/resnet18_dogs/train_val.prototxt"),
    "resnet_depthwise": ("ResNet-18 with depthwise-separable convolutions", "repo",
                         "models/resnet18_dogs/train_val.prototxt"),
    "googlenet": ("GoogLeNet", "upstream", "models/bvlc_googlenet/train_val.prototxt"),
    "cifar10_sigmoid": ("CIFAR-10 (Sigmoid, BatchNorm)", "upstream",
                        "examples/cifar10/cifar10_full_sigmoid_train_test_bn.prototxt"),
    "cifar10_prelu": ("CIFAR-10 quick (ReLUs as PReLUs)", "upstream",
                      "examples/cifar10/cifar10_quick_train_test.prototxt"),
    "cifar10_swish": ("CIFAR-10 quick (ReLUs as Swish)", "upstream",
                      "examples/cifar10/cifar10_quick_train_test.prototxt"),
    "cifar10_swish_in_place": ("CIFAR-10 quick (ReLUs as Swish, in place)", "upstream",
                               "examples/cifar10/cifar10_quick_train_test.prototxt"),
    "cifar10_full": ("CIFAR-10 full (LRN within channels)", "upstream",
                     "examples/cifar10/cifar10_full_train_test.prototxt"),
}
CROP = {"cifar10_sigmoid": 32, "cifar10_prelu": 32, "cifar10_swish": 32, "cifar10_swish_in_place": 32,
        "cifar10_full": 32}  # nets without a crop of their own, for 32x32
# nets whose ReLUs become another neuron (in place, as the ReLUs were, unless OUT_OF_PLACE)
NEURON = {"cifar10_prelu": "PReLU", "cifar10_swish": "Swish", "cifar10_swish_in_place": "Swish"}
OUT_OF_PLACE = {"cifar10_swish"}
SQUEEZE_EXCITATION = {"resnet_se"}  # nets given SENet's channel attention
DEPTHWISE = {"resnet_depthwise"}  # nets given MobileNet's depthwise-separable convolutions


def model_file(model: str, variant: str | None) -> Path:
    _, where, rel = MODELS[model]
    if where == "repo":
        return ROOT / rel
    # upstream's own models live in the patched tree the build lays out (never in this repo)
    return paths.pycaffe_dir(variant).parent / rel


def make_net(pb2, text_format, batch: int, images: Path | None, model_path: Path,
             frozen_before: str | None = None, bn_global_stats: bool = False,
             crop: int | None = None, neuron: str | None = None, out_of_place: bool = False,
             squeeze_excitation: bool = False, depthwise: bool = False) -> str:
    net = pb2.NetParameter()
    text_format.Merge(model_path.read_text(), net)
    layers = []
    for layer in net.layer:
        if any(rule.phase == pb2.TEST for rule in layer.include) or layer.type == "Accuracy":
            continue
        if layer.type == "Data" and images is not None:
            layer.data_param.source = str(images / "train_lmdb")
            layer.data_param.batch_size = batch
            layer.data_param.prefetch = 1
            if not layer.transform_param.mean_value:  # GoogLeNet subtracts per-channel values
                layer.transform_param.mean_file = str(images / "mean.binaryproto")
            if crop:
                layer.transform_param.crop_size = crop
        elif layer.type == "Data":
            crop = crop or layer.transform_param.crop_size or 227
            dummy = pb2.LayerParameter(name="data", type="DummyData", top=["data", "label"])
            p = dummy.dummy_data_param
            p.shape.add(dim=[batch, 3, crop, crop])
            p.shape.add(dim=[batch])
            p.data_filler.add(type="gaussian", std=50)
            p.data_filler.add(type="uniform", min=0, max=119)
            layer = dummy
        layers.append(layer)
    if neuron:
        caffeproto.replace_relus(layers, neuron, out_of_place=out_of_place)
    if squeeze_excitation:
        caffeproto.add_squeeze_excitation(layers)
    if depthwise:
        caffeproto.make_depthwise_separable(layers)
    if frozen_before:
        try:
            caffeproto.freeze_layers_before(layers, frozen_before)
        except ValueError as e:
            raise SystemExit(f"bench_memory: --freeze-before {frozen_before}: {e}")
    if bn_global_stats:
        for layer in layers:
            if layer.type == "BatchNorm":
                layer.batch_norm_param.use_global_stats = True
    del net.layer[:]
    net.layer.extend(layers)
    return text_format.MessageToString(net)


def run(caffe: Path, workdir: Path, name: str, net_text: str, comet: str | None, iters: int, gpu,
        weights: Path | None = None, snapshot: bool = False):
    """`caffe train` of net_text for `iters` iterations (from `weights`; with `snapshot`, the weights it
    ends with are left in workdir/NAME_iter_ITERS.caffemodel)."""
    net = workdir / f"{name}.prototxt"
    net.write_text(net_text)
    (workdir / f"{name}_comet.csv").unlink(missing_ok=True)  # the store appends: no earlier run's rows
    solver = workdir / f"{name}_solver.prototxt"
    solver.write_text(
        f'net: "{net}"\nbase_lr: 0.001\nmomentum: 0.9\nweight_decay: 0.0005\nlr_policy: "fixed"\n'
        f'display: 1\nmax_iter: {iters}\nsnapshot: 0\nsnapshot_after_train: {str(snapshot).lower()}\n'
        f'snapshot_prefix: "{workdir / name}"\n'
        f'solver_mode: {"GPU" if gpu is not None else "CPU"}\nrandom_seed: 1\n'
        + (comet or ""))
    child = plan.run_caffe(caffe, solver, workdir / f"{name}.log", gpu=gpu, cwd=workdir, weights=weights)
    text = child.log.read_text(errors="replace")
    if child.rc != 0:
        raise SystemExit(f"{name} failed; log: {child.log}\n" + "\n".join(text.splitlines()[-15:]))
    return text, child.peak_rss, child.cpu_seconds


def iteration_times(text: str) -> list[float]:
    """Seconds between consecutive 'Iteration N' lines (glog timestamps)."""
    stamps = []
    for m in re.finditer(r"^I\d{4,8} (\d\d:\d\d:\d\d\.\d+) .*solver\.cpp:\d+\] Iteration \d+ \(", text, re.M):
        t = datetime.strptime(m.group(1), "%H:%M:%S.%f")
        stamps.append(t.hour * 3600 + t.minute * 60 + t.second + t.microsecond / 1e6)
    return [b - a for a, b in zip(stamps, stamps[1:])]


def comet_figures(workdir: Path, name: str) -> dict:
    """The store's last total row (<prefix>_comet.csv, prefix = workdir/name) in bytes: dense, stored,
    ratio, tracked_peak, buffers_dense, buffers_stored ({} for a run without COMET)."""
    total, _ = cometstats.last_report(workdir / f"{name}_comet.csv")
    return cometstats.figures(total)


def mb(x: float) -> str:
    return f"{x / 2**20:,.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.replace("{COMET_SETTINGS}", COMET_SETTINGS), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="caffenet",
                    help="the net to train (default: caffenet)")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--iters", type=int, default=3, help="timed iterations after warm-up")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1,
                    help="run COMET off and on this many times, alternating; s/iter is the median")
    ap.add_argument("--gpu", type=int, default=None, help="GPU id (default: CPU)")
    ap.add_argument("--data", choices=["images", "noise"], default="images",
                    help="input: the embedded synthetic images (default) or Gaussian noise")
    ap.add_argument("--pool-headroom", type=float, default=None,
                    help="comet.memory_pool_headroom for the COMET runs (default: the solver default, 0)")
    ap.add_argument("--sync", action="store_true",
                    help="also run COMET with async: false (encodes and decodes in the step)")
    ap.add_argument("--set", dest="settings", action="append", default=[], metavar='"FIELD: VALUE"',
                    help='an extra comet { } setting for the COMET runs, e.g. --set "decode_ahead: 3" (repeatable)')
    ap.add_argument("--also", dest="variants", action="append", default=[], metavar='"FIELD: VALUE"',
                    help='one more COMET run per repetition with this setting on top, in its own row, '
                         'e.g. --also "tiled_gemm: false" (repeatable; --sync is --also "async: false")')
    ap.add_argument("--freeze-before", metavar="LAYER", default=None,
                    help="fine-tuning: every layer before LAYER frozen (lr_mult 0), LAYER and the rest learn")
    ap.add_argument("--bn-global-stats", action="store_true",
                    help="fine-tuning with BatchNorm's statistics frozen: use_global_stats: true on every "
                         "BatchNorm, from weights and statistics of 3 training iterations run first")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    ap.add_argument("--keep", type=Path, default=None, help="keep prototxts and logs in this folder")
    args = ap.parse_args()

    caffe = paths.tool_path("caffe", "cuda" if args.gpu is not None else None)
    sys.path.insert(0, str(paths.pycaffe_dir("cuda" if args.gpu is not None else None)))
    from caffe.proto import caffe_pb2 as pb2
    from google.protobuf import text_format

    # every COMET run's block (the mode's own setting last, over --set's), checked before any run
    shared = ([f"memory_pool_headroom: {args.pool_headroom}"] if args.pool_headroom is not None else []) \
        + args.settings
    blocks = {"on": comet_block(pb2, text_format, shared)}
    for setting in (["async: false"] if args.sync else []) + args.variants:
        blocks["on, " + setting] = comet_block(pb2, text_format, shared + [setting])
    variant = "cuda" if args.gpu is not None else None
    model_path = model_file(args.model, variant)
    title = MODELS[args.model][0] + (f" (layers before {args.freeze_before} frozen)" if args.freeze_before else "") \
        + (" (BatchNorm statistics frozen)" if args.bn_global_stats else "")
    images = make_images(Path(sys.executable).parent / "cometctl") if args.data == "images" else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="comet-bench-") as tmp:
        work = args.keep.resolve() if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        weights = None
        if args.bn_global_stats:  # statistics as a fine-tuned net starts from: a few real batches' averages
            stats = make_net(pb2, text_format, args.batches[0], images, model_path, args.freeze_before,
                             crop=CROP.get(args.model), neuron=NEURON.get(args.model),
                             out_of_place=args.model in OUT_OF_PLACE,
                             squeeze_excitation=args.model in SQUEEZE_EXCITATION,
                             depthwise=args.model in DEPTHWISE)
            run(caffe, work, "statistics", stats, None, 3, args.gpu, snapshot=True)
            weights = work / "statistics_iter_3.caffemodel"
            print(f"BatchNorm statistics of 3 training iterations at batch {args.batches[0]}: {weights.name}",
                  flush=True)
        for batch in args.batches:
            net = make_net(pb2, text_format, batch, images, model_path, args.freeze_before, args.bn_global_stats,
                           crop=CROP.get(args.model), neuron=NEURON.get(args.model),
                           out_of_place=args.model in OUT_OF_PLACE,
                           squeeze_excitation=args.model in SQUEEZE_EXCITATION,
                           depthwise=args.model in DEPTHWISE)
            modes = ["off"] + list(blocks)
            runs = {m: {"times": [], "rss": 0, "cpu": []} for m in modes}
            for rep in range(args.repeat):  # off, on, off, on, ...: drift hits both alike
                for comet in modes:
                    tag = comet if comet in ("off", "on") else f"v{modes.index(comet) - 1}"
                    name = f"{args.model}_b{batch}_{tag}"
                    name += f"_{rep + 1}" if args.repeat > 1 else ""
                    t0 = time.time()
                    block = blocks.get(comet)  # None: COMET off
                    text, rss, cpu = run(caffe, work, name, net, block, args.warmup + args.iters, args.gpu,
                                         weights)
                    times = iteration_times(text)[args.warmup - 1 if args.warmup else 0:]
                    fig = comet_figures(work, name)
                    r = runs[comet]
                    r["times"] += times
                    r["rss"] = max(r["rss"], rss)
                    r["cpu"].append(cpu)
                    r["fig"] = fig
                    per_iter = statistics.median(times) if times else float("nan")
                    print(f"{name}: peak RSS {mb(rss)} MB, {per_iter:.2f} s/iter, {cpu:.0f} CPU s"
                          + (f", activations {mb(fig['dense'])} -> {mb(fig['stored'])} MB "
                             f"({fig['ratio']:.1f}x), tracked peak {mb(fig['tracked_peak'])} MB" if fig else "")
                          + (f", codec {fig['work_ms']:.0f} ms/iter, waited {fig['wait_ms']:.0f}"
                             if "wait_ms" in fig else "")
                          + f"  ({time.time() - t0:.0f} s)", flush=True)
            base = None
            for comet in modes:
                r = runs[comet]
                per_iter = statistics.median(r["times"]) if r["times"] else float("nan")
                row = {"batch": batch, "comet": comet, "rss": r["rss"],
                       "s_per_iter": per_iter, "cpu": statistics.median(r["cpu"]), **r["fig"]}
                if base:
                    row["rss_x"] = base["rss"] / r["rss"]
                    row["time_pct"] = 100 * (per_iter / base["s_per_iter"] - 1)
                    row["cpu_pct"] = 100 * (row["cpu"] / base["cpu"] - 1)
                else:
                    base = row
                rows.append(row)

    device = f"GPU {args.gpu}" if args.gpu is not None else f"CPU ({os.cpu_count()} cores)"
    out = [f"{title} training on {device}, {args.iters} timed iterations after {args.warmup} warm-up"
           + (f", COMET off and on alternated {args.repeat} times (median s/iter)" if args.repeat > 1 else "")
           + "; "
           f"command: `scripts/bench_memory --model {args.model} --batches {' '.join(map(str, args.batches))} "
           f"--iters {args.iters} --warmup {args.warmup} --data {args.data}"
           + (f" --repeat {args.repeat}" if args.repeat > 1 else "")
           + (" --sync" if args.sync else "")
           + (f" --pool-headroom {args.pool_headroom}" if args.pool_headroom is not None else "")
           + (f" --freeze-before {args.freeze_before}" if args.freeze_before else "")
           + (" --bn-global-stats" if args.bn_global_stats else "")
           + "".join(f' --set "{setting}"' for setting in args.settings)
           + "".join(f' --also "{setting}"' for setting in args.variants)
           + (f" --gpu {args.gpu}" if args.gpu is not None else "") + "`",
           "",
           "| batch | COMET | peak RSS (MB) | RSS off/on | stored activations (MB): dense -> compressed | "
           "layer buffers (MB) | tracked peak (MB) | s/iter | time vs off | CPU s per run | CPU vs off | "
           "codec ms/iter (waited) |",
           "|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        act = f"{mb(r['dense'])} -> {mb(r['stored'])} ({r['ratio']:.1f}x)" if "ratio" in r else "-"
        buffers = f"{mb(r['buffers_dense'])} -> {mb(r['buffers_stored'])}" if "buffers_dense" in r else "-"
        out.append(f"| {r['batch']} | {r['comet']} | {mb(r['rss'])} | "
                   f"{r.get('rss_x', 1):.2f}x | {act} | {buffers} | "
                   f"{mb(r['tracked_peak']) if 'tracked_peak' in r else '-'} | {r['s_per_iter']:.2f} | "
                   f"{('%+.1f%%' % r['time_pct']) if 'time_pct' in r else '-'} | {r['cpu']:.0f} | "
                   f"{('%+.1f%%' % r['cpu_pct']) if 'cpu_pct' in r else '-'} | "
                   + (f"{r['work_ms']:.0f} ({r['wait_ms']:.0f}) |" if "wait_ms" in r else "- |"))
    table = "\n".join(out)
    print("\n" + table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
