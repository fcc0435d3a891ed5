"""Command-line entry point. Parses options and delegates; each command's logic lives in its module."""

from __future__ import annotations

import contextlib
import sys

import click

from .errors import CometError


class _Group(click.Group):
    """Turns CometError into one clear line and its exit code instead of a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except CometError as e:
            click.secho(f"cometctl: error: {e}", fg="red", err=True)
            sys.exit(e.exit_code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="cometctl")
def main():
    """COMET-Caffe: train CNNs with compressed activations.

    \b
    Typical use:
      cometctl build                       # fetch pinned Caffe, patch, build, pycaffe
      cometctl prepare-dogs --synthetic    # or --archive images.tar --lists lists.tar
      cometctl prepare-imagenet --train ILSVRC2012_img_train.tar --val ILSVRC2012_img_val.tar --devkit DEVKIT
      cometctl prepare-images DIR          # one folder per class
      cometctl train --solver models/bvlc_reference_caffenet/solver.prototxt
    """


@main.command()
@click.option("--cuda", "variant", flag_value="cuda", help="Build the CUDA variant (CUDA 12 or 13, sm_75+).")
@click.option("--cpu-only", "variant", flag_value="cpu", default=True,
              help="Build the CPU-only variant (the default).")
@click.option("--cudnn/--no-cudnn", default=None,
              help="CUDA variant: use cuDNN (8 or 9) for convolution, pooling, ReLU, Sigmoid, TanH, "
                   "Softmax, LRN [default: when found; --cudnn makes a missing cuDNN an error].")
@click.option("--nccl/--no-nccl", default=None,
              help="CUDA variant: build with NCCL 2 so one `caffe train -gpu 0,1` trains on several GPUs "
                   "[default: when found; --nccl makes a missing NCCL an error].")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None, help="Parallel compile jobs [default: all cores].")
@click.option("--build-dir", type=click.Path(file_okay=False), default=None,
              help="Where sources and objects go [default: ./build or $COMET_BUILD_DIR].")
@click.option("--upstream", type=click.Path(dir_okay=False), default=None,
              help="Use this local tarball of upstream Caffe instead of fetching it (it is verified).")
@click.option("--install-deps/--no-install-deps", default=True, show_default=True,
              help="Install missing Debian packages with apt-get (as root or with password-less "
                   "sudo); otherwise print the exact apt-get line.")
@click.option("--tests", is_flag=True, help="Also build upstream's gtest binary (test.testbin).")
@click.option("--cuda-arch", default=None,
              help="CUDA architectures, e.g. '90' or '75 80 90' [default: 75 80 86 89 90].")
@click.option("--no-activate", is_flag=True,
              help="Build only; do not point `import caffe` and the venv's caffe tools at this build.")
def build(variant, cudnn, nccl, jobs, build_dir, upstream, install_deps, tests, cuda_arch, no_activate):
    """Build the fork: fetch the pinned upstream Caffe, verify it, apply our patch series, lay our
    files over it, and build libcaffe, the tools (caffe, convert_imageset, compute_image_mean) and
    pycaffe with CMake. Re-running after a change rebuilds only what changed.

    The CUDA variant goes to build/cuda, or build/cuda-cudnn-nccl (cuda-cudnn, cuda-nccl) when it
    uses cuDNN and NCCL, so each configuration keeps its own objects."""
    import os

    from .build import DEFAULT_CUDA_ARCHS, BuildOptions, build as run_build

    for flag, on in (("--cudnn", cudnn), ("--nccl", nccl)):
        if on and variant != "cuda":
            raise CometError(f"{flag} needs --cuda")
    run_build(BuildOptions(variant=variant, cudnn=cudnn, nccl=nccl, jobs=jobs or os.cpu_count() or 2,
                           build_dir=build_dir, upstream=upstream, install_deps=install_deps,
                           tests=tests, activate=not no_activate,
                           cuda_archs=cuda_arch or DEFAULT_CUDA_ARCHS))


@main.group()
def patches():
    """Work on our patch series over upstream Caffe (caffe/patches/)."""


@patches.command("edit")
@click.option("--dir", "dest", type=click.Path(file_okay=False), default="build/patchwork",
              show_default=True, help="Where to create the git work tree.")
@click.option("--upstream", type=click.Path(dir_okay=False), default=None,
              help="Local tarball of upstream Caffe (verified) instead of the cache/fetch.")
def patches_edit(dest, upstream):
    """Create a git work tree: upstream as the first commit (tag `upstream`), then one commit per
    patch. Edit, commit (one commit = one patch; amend or rebase to change one), then run
    `cometctl patches export`."""
    from . import patches as p
    from .ui import console

    count = p.edit(dest, upstream)
    console.print(f"work tree ready in {dest} ({count} patches as commits)")


@patches.command("export")
@click.option("--dir", "src", type=click.Path(file_okay=False, exists=True), default="build/patchwork",
              show_default=True, help="The git work tree made by `cometctl patches edit`.")
def patches_export(src):
    """Write the work tree's commits after `upstream` back to caffe/patches/ and its series file."""
    from pathlib import Path

    from . import patches as p
    from .ui import console

    names = p.export_worktree(Path(src).resolve())
    console.print(f"wrote {len(names)} patches and caffe/patches/series")


# ---- researcher workflow: prepare-*, train, report (logic in dogs.py, imagenet.py, folders.py, train.py, report.py)
@main.command("prepare-dogs")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Output folder [default: data/dogs, or data/synthetic with --synthetic].")
@click.option("--archive", type=click.Path(), default=None,
              help="Stanford Dogs images.tar already on disk (or its unpacked folder). Without it, "
                   "images.tar and lists.tar are downloaded into the data folder (resumable, checksummed).")
@click.option("--lists", type=click.Path(), default=None,
              help="Stanford Dogs lists.tar: use its official split (12,000 train / 8,580 test). Without "
                   "it, a seeded, stratified split (--seed, --val-fraction).")
@click.option("--size", type=int, default=None,
              help="Images are resized to SIZE x SIZE in the LMDBs [default: 256; 64 with --synthetic].")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None, help="Decoding processes [default: all cores].")
@click.option("--synthetic", is_flag=True,
              help="Generate the small embedded stand-in (10 classes, 600 JPEGs in an images.tar and "
                   "lists.tar like the real ones) and prepare it the same way.")
@click.option("--seed", type=int, default=1701, show_default=True, help="Seed of the shuffle and split.")
@click.option("--val-fraction", type=float, default=0.2, show_default=True,
              help="Share of each class held out when there is no lists.tar.")
@click.option("--url", default=None,
              help="Base URL to download from [default: the dataset's home page at Stanford, or "
                   "$COMET_DOGS_URL].")
def prepare_dogs(data_dir, archive, lists, size, jobs, synthetic, seed, val_fraction, url):
    """Turn Stanford Dogs (120 breeds, 20,580 images) into Caffe's format: train/val LMDBs of Datums
    (BGR, resized, shuffled), the mean image (mean.binaryproto, as compute_image_mean writes it),
    train.txt/val.txt and synset_words.txt. Resumable and idempotent: rerun after an interruption and
    it continues; rerun when done and it does nothing. Unreadable images are skipped and listed in
    skipped.txt."""
    from .dogs import prepare_dogs as run

    run(data_dir=data_dir, archive=archive, lists=lists, size=size, jobs=jobs, synthetic=synthetic,
        seed=seed, val_fraction=val_fraction, url=url)


@main.command("prepare-imagenet")
@click.option("--train", "train", required=True, type=click.Path(),
              help="ILSVRC2012_img_train.tar (a tar of 1,000 nXXXXXXXX.tar, read in place) or its unpacked "
                   "folder (one folder per WordNet ID).")
@click.option("--val", "val", required=True, type=click.Path(),
              help="ILSVRC2012_img_val.tar (flat ILSVRC2012_val_*.JPEG, read in place) or its folder.")
@click.option("--devkit", type=click.Path(), default=None,
              help="ILSVRC2012_devkit_t12.tar.gz (or unpacked): val labels from its "
                   "data/ILSVRC2012_validation_ground_truth.txt and data/meta.mat.")
@click.option("--val-labels", type=click.Path(dir_okay=False), default=None,
              help="Instead of --devkit: Caffe's val.txt ('ILSVRC2012_val_00000001.JPEG 65', labels in "
                   "sorted-WNID order).")
@click.option("--synsets", type=click.Path(dir_okay=False), default=None,
              help="With --val-labels: synsets.txt or synset_words.txt, the WNID of each val.txt label "
                   "(and words for synset_words.txt).")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Output folder [default: data/imagenet].")
@click.option("--size", type=int, default=256, show_default=True,
              help="Images are resized to SIZE x SIZE (create_imagenet.sh's RESIZE=true).")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None, help="Decoding processes [default: all cores].")
@click.option("--seed", type=int, default=1701, show_default=True, help="Seed of the shuffle.")
def prepare_imagenet(train, val, devkit, val_labels, synsets, data_dir, size, jobs, seed):
    """Turn ILSVRC-2012 (ImageNet, 1,000 classes) into Caffe's format, reading the archives as
    published without unpacking them: train/val LMDBs of Datums (BGR, resized, shuffled), the mean
    image (mean.binaryproto), train.txt/val.txt, synsets.txt and synset_words.txt. Labels are the
    WordNet IDs in sorted order, as upstream Caffe's synsets.txt, so upstream's models agree. Val
    labels come from the devkit (--devkit) or Caffe's val.txt (--val-labels). Resumable and
    idempotent; unreadable images are skipped and listed in skipped.txt."""
    from .imagenet import prepare_imagenet as run

    run(train, val, data_dir=data_dir, devkit=devkit, val_labels=val_labels, synsets=synsets, size=size,
        jobs=jobs, seed=seed)


@main.command("prepare-images")
@click.argument("path", type=click.Path())
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Output folder [default: data/<name of PATH>].")
@click.option("--size", type=int, default=256, show_default=True, help="Images are resized to SIZE x SIZE.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None, help="Decoding processes [default: all cores].")
@click.option("--seed", type=int, default=1701, show_default=True, help="Seed of the shuffle and split.")
@click.option("--val-fraction", type=float, default=0.2, show_default=True,
              help="Share of each class held out for val when PATH has no train/ and val/ folders.")
def prepare_images(path, data_dir, size, jobs, seed, val_fraction):
    """Turn a dataset kept as one folder per class (PATH: a folder, an uncompressed tar or a zip;
    <class>/<image>, or train/<class>/... and val/<class>/...) into Caffe's format: train/val LMDBs,
    mean.binaryproto, train.txt/val.txt and synset_words.txt (label i: the i-th class folder in
    sorted order). Without train/ and val/, a seeded, stratified split. Resumable and idempotent;
    unreadable images are skipped and listed in skipped.txt."""
    from .folders import prepare_images as run

    run(path, data_dir=data_dir, size=size, jobs=jobs, seed=seed, val_fraction=val_fraction)


@main.command()
@click.option("--solver", required=True, type=click.Path(dir_okay=False),
              help="Solver prototxt, e.g. models/comet_tiny/solver.prototxt.")
@click.option("--gpu", default=None, metavar="ID|all",
              help="Train on these GPUs (caffe's -gpu: 0, 0,1 or all) [default: as the solver says].")
@click.option("--cpu", is_flag=True, help="Train on the CPU (a copy of the solver gets solver_mode: CPU).")
@click.option("--snapshot", type=click.Path(dir_okay=False), default=None,
              help="Resume from this .solverstate (e.g. the one written when a run was stopped with Ctrl-C). "
                   "With --run-dir the folder it lies in, the run goes on there (same log and statistics).")
@click.option("--weights", default=None, metavar="FILE[,FILE...]",
              help="Fine-tune: start from the weights of these .caffemodel files (caffe's -weights; layers "
                   "are matched by name, others start from their fillers). Not with --snapshot.")
@click.option("--iters", type=int, default=None, help="Stop after this many iterations (max_iter).")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="Where the log, the solver as run and the snapshots go [default: runs/<time>-<model>].")
def train(solver, gpu, cpu, snapshot, weights, iters, run_dir):
    """Run the fork's `caffe train` and show a compact view: iteration, loss, learning rate, test
    accuracy and COMET's compression figures. The full log, the adjusted solver, its nets and the
    snapshots go to a run folder. Any solver caffe takes works (net, net_param, train_net/test_net);
    relative paths resolve from the current folder when the solver's net is found there, as for
    `caffe train` started there, else from the repository root. A GPU run is refused before it starts when no GPU is
    usable (with the reason). Ctrl-C stops after writing a snapshot and prints the command that
    resumes the run in the same folder (--snapshot with --run-dir); it exits 130. Otherwise exits with
    caffe's status."""
    from .train import train as run

    sys.exit(run(solver, gpu=gpu, cpu=cpu, snapshot=snapshot, weights=weights, iters=iters, run_dir=run_dir))


@main.command()
@click.argument("run_dir", type=click.Path(), required=False)
@click.option("--compare", type=click.Path(), default=None,
              help="Another run folder: its curves go on the same axes.")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Output folder [default: RUN_DIR/report].")
@click.option("--plan", "plan_json", type=click.Path(dir_okay=False), default=None,
              help="A `cometctl plan --json` file: draw its predicted peak against the measured ones "
                   "(plan.png in --out, else beside the file); without RUN_DIR only this.")
def report(run_dir, compare, out, plan_json):
    """Parse a run's caffe.log (RUN_DIR, default: the latest run in runs/) into CSV (train.csv and
    test.csv with parse_log.py's columns, comet.csv) and draw PNG plots: loss and accuracy against
    iteration and, when the log has COMET lines, compression ratio, error bound, memory and time per
    layer. --compare puts a second run on the same axes."""
    from pathlib import Path

    from .report import plan_plot, report as run

    if plan_json:
        plan_plot(plan_json, Path(out) / "plan.png" if out else None)
        if not run_dir:
            return
    run(run_dir, compare=compare, out=out)


def _batches(ctx, param, value):
    """--measure 8,16,32 -> (8, 16, 32); not given: None."""
    if value is None:
        return None
    out = []
    for v in value if isinstance(value, tuple) else (value,):
        for part in str(v).replace(" ", ",").split(","):
            if not part:
                continue
            try:
                out.append(int(part))
            except ValueError:
                raise click.BadParameter(f"{v!r}: batch sizes are whole numbers, e.g. 64 or 8,16,32") from None
    return tuple(out)


def _checks(ctx, param, value):
    """--batch 256 (COMET off and on), --batch 1100:on, --batch 64,256 -> ((256, ('off', 'on')), ...)."""
    out = []
    for v in value:
        for part in str(v).replace(" ", ",").split(","):
            if not part:
                continue
            num, _, mode = part.partition(":")
            if mode not in ("", "on", "off") or not num.isdigit():
                raise click.BadParameter(f"{part!r}: write N, N:on or N:off, e.g. 256 or 1100:on")
            out.append((int(num), (mode,) if mode else ("off", "on")))
    return tuple(out)


@main.command()
@click.option("--solver", required=True, type=click.Path(dir_okay=False),
              help="Solver prototxt, e.g. models/bvlc_reference_caffenet/solver.prototxt.")
@click.option("--cpu", is_flag=True, help="Plan for the CPU [default: as the solver says].")
@click.option("--gpu", type=int, default=None, metavar="ID",
              help="Plan for this GPU (figures are nvidia-smi's peaks; without nvidia-smi the store's "
                   "device bytes, printed as unmeasured).")
@click.option("--memory", default=None, metavar="SIZE",
              help="A budget, e.g. 8GiB, 4096MiB or 500MB: print the largest batch that fits, COMET off and on.")
@click.option("--batch", "check", multiple=True, callback=_checks, metavar="N[:on|:off]",
              help="Also run batch N (COMET off and on, or only the one named) and print the prediction "
                   "against the measurement (repeat, or 64,256).")
@click.option("--verify", is_flag=True,
              help="With --memory: also run each mode at its largest batch and print the measured peak.")
@click.option("--json", "json_out", default=None, metavar="FILE",
              help="Write the plan as JSON to FILE ('-': stdout; the text then goes to stderr).")
@click.option("--synthetic-input", is_flag=True,
              help="Feed DummyData of the data layers' shapes instead of their sources (Gaussian noise, labels 0).")
@click.option("--input-shape", multiple=True, metavar="TOP=CxHxW",
              help="Shape of a data top without the batch, when plan cannot read it (repeatable).")
@click.option("--measure", default=None, callback=_batches, metavar="B1,B2,...",
              help="Batch sizes to measure and fit (two or more, small).  [default: 8,16,32, and twice the "
                   "largest, again and again up to 1024, in a mode whose peak grows less than 16 MiB over them]")
@click.option("--iters", type=int, default=2, show_default=True, help="Training iterations per measured run.")
@click.option("--keep", type=click.Path(file_okay=False), default=None,
              help="Keep the generated nets, solvers and logs in this folder.")
def plan(solver, cpu, gpu, memory, check, verify, json_out, synthetic_input, input_shape, measure, iters, keep):
    """Will this net fit, and how large a batch can it train in this much memory?

    Runs a few real training iterations of the solver's TRAIN net at small batch sizes (--measure),
    COMET off and on, each in its own `caffe train` process, and fits every memory figure as
    fixed + per sample x batch from the measured peaks (peak RSS on the CPU; on a GPU the device's
    memory in use that nvidia-smi reports, sampled every 20 ms, or without nvidia-smi the store's
    device bytes, printed as unmeasured). Prints the store's plan per blob (bytes dense, action, bytes
    stored, error bound), the parts of the peak (weights, weight gradients, solver history,
    activations and COMET's copies, mapped files, runtime), the predicted peak at the solver's batch
    size COMET off and on and, with --memory, the largest batch that fits each way and the factor
    between them. A data source that is not there stops it with a hint to use --synthetic-input; a
    net that does not run reports caffe's own error line; a budget below the fixed part says so.

    \b
    Example (CaffeNet on 2 CPU cores: about 35 s):
      cometctl plan --solver models/bvlc_reference_caffenet/solver.prototxt --cpu \\
          --synthetic-input --memory 4GiB --json plan.json
      cometctl report --plan plan.json      # plan.png: predicted against measured
    """
    from .plan import budget_problem, make_plan, render, write_json
    from .ui import console, counter

    total = 2 * len(set(measure or (8, 16, 32))) + sum(len(modes) for _, modes in check) + (2 if verify else 0)
    with contextlib.ExitStack() as stack:
        bar = []  # the progress bar starts with the first run: a refused request draws none

        def progress(text, more=0):
            nonlocal total
            total += more
            if not bar:
                bar.append(stack.enter_context(counter("measuring", total)))
            else:
                bar[0](1, total=total)
            bar[0](0, description=f"measuring: {text}")

        result = make_plan(solver, cpu=cpu, gpu=gpu, memory=memory, check=check, synthetic=synthetic_input,
                           input_shapes=input_shape, measure_batches=measure, iters=iters, keep=keep,
                           progress=progress, verify=verify)
        if bar:
            bar[0](1, description="measured")
    lines = render(result)
    if json_out:
        write_json(result, json_out)
    if json_out == "-":
        for line in lines:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    else:
        click.echo("\n".join(lines))
    problem = budget_problem(result)
    if problem:
        raise CometError(problem)
