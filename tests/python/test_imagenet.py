"""prepare-imagenet on small archives in ILSVRC-2012's published layout: a train tar of per-class tars, a flat
val tar, a devkit (tar.gz with the ground truth and a MATLAB meta.mat) or Caffe's val.txt/synsets.txt;
labels, listings, odd images, resume, bad input, upstream's convert_imageset side by side, and the
ImageNet variants of CaffeNet and AlexNet."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from cometctl import imagedb, imagenet
from cometctl.cli import main
from cometctl.errors import CometError

from conftest import WF_NEEDS_BUILD, WF_REPO, wf_datums, wf_odd_image, wf_tar, wf_unreadable

# three real ILSVRC-2012 classes; the devkit numbers them in another order than sorted WNIDs
WORDS = {"n01440764": "tench, Tinca tinca", "n01443537": "goldfish, Carassius auratus",
         "n01484850": "great white shark, white shark, man-eater, man-eating shark, Carcharodon carcharias"}
WNIDS = sorted(WORDS)
ILSVRC_ID = {"n01484850": 1, "n01440764": 2, "n01443537": 3}  # ID 4 is an inner node (not a class)
VAL_CLASSES = ["n01443537", "n01484850", "n01440764", "n01440764", "n01484850", "n01443537",
               "n01484850", "n01440764", "n01443537"]  # of ILSVRC2012_val_00000001 ... 09
TRAIN_PER_CLASS = 6
CORRUPT = "n01443537/n01443537_9999.JPEG"


def _meta_mat(synsets: list[tuple[int, str, str, int]], id_field: str = "ILSVRC2012_ID") -> bytes:
    """A MATLAB v5 meta.mat with the devkit's `synsets` struct array (ID, WNID, words, num_children)."""
    from scipy.io import savemat

    dt = [(id_field, "O"), ("WNID", "O"), ("words", "O"), ("gloss", "O"), ("num_children", "O")]
    arr = np.zeros((len(synsets), 1), dtype=dt)
    for i, (ident, wnid, words, children) in enumerate(synsets):
        arr[i, 0] = (np.array([[ident]], dtype=np.uint16), wnid, words, "a gloss", np.array([[children]], dtype=np.uint8))
    buf = io.BytesIO()
    savemat(buf, {"synsets": arr})
    return buf.getvalue()


def make_ilsvrc(root: Path) -> dict:
    """ILSVRC2012_img_train.tar, ILSVRC2012_img_val.tar, ILSVRC2012_devkit_t12.tar.gz and Caffe's
    val.txt / synsets.txt / synset_words.txt for them, in `root`."""
    root.mkdir(parents=True, exist_ok=True)
    inner = {}
    # the odd files ILSVRC-2012 really has (greyscale and CMYK JPEGs, a PNG named .JPEG) and a photo that
    # EXIF says to turn (cameras do that)
    kinds = ["rgb", "gray", "cmyk", "png", "exif", "rgb"]
    for c, wnid in enumerate(WNIDS):
        members = {f"{wnid}_{100 + i}.JPEG": wf_odd_image(kinds[(i + c) % len(kinds)], 100 * c + i)
                   for i in range(TRAIN_PER_CLASS)}
        if wnid == CORRUPT.split("/")[0]:
            members[CORRUPT.split("/")[1]] = wf_unreadable("cut", members[f"{wnid}_100.JPEG"], keep=500)
        wf_tar(root / f"{wnid}.tar", members)
        inner[f"{wnid}.tar"] = (root / f"{wnid}.tar").read_bytes()
        (root / f"{wnid}.tar").unlink()
    train = wf_tar(root / "ILSVRC2012_img_train.tar", inner)
    sizes = [(280, 210), (500, 375), (1024, 768)]  # up- and downscaled, the last one decoded at 1/2 scale
    val_members = {f"ILSVRC2012_val_{i + 1:08d}.JPEG": wf_odd_image(kinds[i % len(kinds)], 1000 + i, sizes[i % 3])
                   for i in range(len(VAL_CLASSES))}
    val = wf_tar(root / "ILSVRC2012_img_val.tar", val_members)
    synsets = [(ILSVRC_ID[w], w, WORDS[w], 0) for w in WNIDS] + [(4, "n01473806", "aquatic vertebrate", 2)]
    gt = "".join(f"{ILSVRC_ID[w]}\n" for w in VAL_CLASSES)
    devkit = wf_tar(root / "ILSVRC2012_devkit_t12.tar.gz", {
        "ILSVRC2012_devkit_t12/data/meta.mat": _meta_mat(sorted(synsets)),
        "ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt": gt.encode(),
        "ILSVRC2012_devkit_t12/readme.txt": b"devkit\n"}, "w:gz")
    (root / "val.txt").write_text("".join(f"ILSVRC2012_val_{i + 1:08d}.JPEG {WNIDS.index(w)}\n"
                                          for i, w in enumerate(VAL_CLASSES)))
    (root / "synsets.txt").write_text("".join(w + "\n" for w in WNIDS))
    return {"train": train, "val": val, "devkit": devkit, "val_labels": root / "val.txt",
            "synsets": root / "synsets.txt", "val_members": val_members}


@pytest.fixture(scope="module")
def ilsvrc(tmp_path_factory):
    return make_ilsvrc(tmp_path_factory.mktemp("ilsvrc"))


@pytest.fixture(scope="module")
def prepared(wf_pb2, ilsvrc, tmp_path_factory):
    """prepare-imagenet at the default 256x256 with the devkit."""
    out = tmp_path_factory.mktemp("imagenet") / "imagenet"
    r = imagenet.prepare_imagenet(ilsvrc["train"], ilsvrc["val"], out, devkit=ilsvrc["devkit"], jobs=1)
    return out, r


# ---------------------------------------------------------------------------------------- the outputs
def test_labels_follow_sorted_wnids_and_the_devkit_ground_truth(prepared):
    out, r = prepared
    assert (r.train, r.val, r.classes) == (3 * TRAIN_PER_CLASS, len(VAL_CLASSES), 3)
    assert [n for n, _ in r.skipped] == [CORRUPT]
    # val labels: devkit ID -> WNID (meta.mat) -> position among the sorted WNIDs
    val = [line.split() for line in (out / "val.txt").read_text().splitlines()]
    assert val == [[f"ILSVRC2012_val_{i + 1:08d}.JPEG", str(WNIDS.index(w))] for i, w in enumerate(VAL_CLASSES)]
    for key, d in imagedb.iter_datums(out / "val_lmdb"):
        n = int(key.split("_")[-1].split(".")[0])
        assert d.label == WNIDS.index(VAL_CLASSES[n - 1]), key
    train = [line.split() for line in (out / "train.txt").read_text().splitlines()]
    assert len(train) == 3 * TRAIN_PER_CLASS and train == sorted(train)
    assert train[0] == ["n01440764/n01440764_100.JPEG", "0"]
    assert all(name.split("/")[0] == WNIDS[int(lab)] for name, lab in train)
    assert CORRUPT not in (out / "train.txt").read_text()
    keys = {k.split("_", 1)[1]: d.label for k, d in imagedb.iter_datums(out / "train_lmdb")}
    assert keys == {name: int(lab) for name, lab in train}
    assert (out / "synsets.txt").read_text().split() == WNIDS
    assert (out / "synset_words.txt").read_text().splitlines() == [f"{w} {WORDS[w]}" for w in WNIDS]
    assert CORRUPT in (out / "skipped.txt").read_text()
    manifest = json.loads((out / "prepare.json").read_text())
    assert manifest["layout"] == "imagenet" and manifest["train"] == 18 and manifest["val"] == 9


def test_datums_are_256px_bgr_and_odd_images_are_handled(prepared, ilsvrc):
    from PIL import Image, ImageOps

    out, _ = prepared
    datums = dict(imagedb.iter_datums(out / "val_lmdb"))
    keys = list(datums)
    assert keys == sorted(keys) and [int(k[:8]) for k in keys] == list(range(len(VAL_CLASSES)))
    assert [k.split("_", 1)[1] for k in keys] != sorted(ilsvrc["val_members"]), "not shuffled"
    for key, d in datums.items():
        assert (d.channels, d.height, d.width, d.encoded) == (3, 256, 256, False)
        raw = ilsvrc["val_members"][key.split("_", 1)[1]]
        ref = ImageOps.exif_transpose(Image.open(io.BytesIO(raw))).convert("RGB").resize((256, 256), Image.BILINEAR)
        diff = np.abs(imagedb.datum_array(d).transpose(1, 2, 0)[:, :, ::-1].astype(int) - np.asarray(ref))
        assert diff.mean() < 1 and np.percentile(diff, 99) <= 3, key  # Pillow's filter is not OpenCV's
    # the EXIF-turned photo (val 5: kinds[4]) is stored upright: rotated, not merely resized
    d = datums[next(k for k in keys if k.endswith("00000005.JPEG"))]
    stored = Image.open(io.BytesIO(ilsvrc["val_members"]["ILSVRC2012_val_00000005.JPEG"])).convert("RGB")
    as_stored = np.asarray(stored.resize((256, 256), Image.BILINEAR))[:, :, ::-1].transpose(2, 0, 1)
    assert np.abs(imagedb.datum_array(d).astype(int) - as_stored).mean() > 5


def test_mean_is_the_train_mean_in_compute_image_mean_arithmetic(prepared, wf_pb2):
    out, _ = prepared
    blob = wf_pb2.BlobProto()
    blob.ParseFromString((out / "mean.binaryproto").read_bytes())
    assert (blob.num, blob.channels, blob.height, blob.width) == (1, 3, 256, 256)
    acc = np.zeros((3, 256, 256), np.float32)
    n = 0
    for _, d in imagedb.iter_datums(out / "train_lmdb"):
        acc += imagedb.datum_array(d)
        n += 1
    assert np.array_equal(np.array(blob.data, np.float32).reshape(3, 256, 256), acc / np.float32(n))


def test_val_txt_and_synsets_give_the_same_lmdbs_as_the_devkit(prepared, ilsvrc, tmp_path):
    out, _ = prepared
    other = tmp_path / "viatxt"
    # synset_words.txt in a shuffled order: val.txt's labels are mapped through it by WNID
    order = [WNIDS[2], WNIDS[0], WNIDS[1]]
    synsets = tmp_path / "synset_words.txt"
    synsets.write_text("".join(f"{w} {WORDS[w]}\n" for w in order))
    labels = tmp_path / "val.txt"
    labels.write_text("".join(f"ILSVRC2012_val_{i + 1:08d}.JPEG {order.index(w)}\n" for i, w in enumerate(VAL_CLASSES)))
    r = imagenet.prepare_imagenet(ilsvrc["train"], ilsvrc["val"], other, val_labels=labels, synsets=synsets, jobs=1)
    assert r.val == len(VAL_CLASSES)
    for part in ("train_lmdb", "val_lmdb"):
        assert imagedb.lmdb_digest(other / part) == imagedb.lmdb_digest(out / part), part
    for f in ("train.txt", "val.txt", "synset_words.txt", "synsets.txt", "mean.binaryproto"):
        assert (other / f).read_bytes() == (out / f).read_bytes(), f
    # Caffe's own val.txt without synsets: labels already in sorted-WNID order
    plain = tmp_path / "plain"
    imagenet.prepare_imagenet(ilsvrc["train"], ilsvrc["val"], plain, val_labels=ilsvrc["val_labels"], jobs=1)
    assert imagedb.lmdb_digest(plain / "val_lmdb") == imagedb.lmdb_digest(out / "val_lmdb")


def test_rerun_does_nothing(prepared, ilsvrc):
    out, _ = prepared
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    r = imagenet.prepare_imagenet(ilsvrc["train"], ilsvrc["val"], out, devkit=ilsvrc["devkit"], jobs=1)
    assert r.up_to_date
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_nested_tar_is_read_in_place_at_absolute_offsets(ilsvrc):
    src = imagenet.open_train(ilsvrc["train"])
    names = src.names()
    assert len(names) == 3 * TRAIN_PER_CLASS + 1 and names[0] == "n01440764/n01440764_100.JPEG"
    kind, path, offset, size = src.job(names[0])
    assert (kind, path) == ("tar", str(ilsvrc["train"]))
    with tarfile.open(ilsvrc["train"]) as outer:
        inner = tarfile.open(fileobj=outer.extractfile("n01440764.tar"))
        expected = inner.extractfile("n01440764_100.JPEG").read()
    with open(ilsvrc["train"], "rb") as f:
        f.seek(offset)
        assert f.read(size) == expected


# ------------------------------------------------------------------------------------- resume, parallel
def test_interrupted_run_resumes_byte_identically(ilsvrc, wf_pb2, tmp_path, monkeypatch):
    monkeypatch.setattr(imagedb, "BATCH", 4)
    out = tmp_path / "out"
    args = (ilsvrc["train"], ilsvrc["val"])
    with pytest.raises(CometError, match="interrupted.*resume") as e:
        imagenet.prepare_imagenet(*args, out, devkit=ilsvrc["devkit"], size=48, jobs=1, _stop_after=4)
    assert e.value.exit_code == 130
    assert not (out / "train_lmdb").exists() and (out / "train_lmdb.partial").exists()
    done = json.loads((out / "train_lmdb.partial.json").read_text())["done"]
    assert 4 <= done < 18
    r = imagenet.prepare_imagenet(*args, out, devkit=ilsvrc["devkit"], size=48, jobs=1)
    assert r.resumed_from == {"train": done, "val": 0} and r.train == 18
    monkeypatch.setattr(imagedb, "BATCH", 256)
    clean = tmp_path / "clean"
    imagenet.prepare_imagenet(*args, clean, devkit=ilsvrc["devkit"], size=48, jobs=1)
    for part in ("train_lmdb", "val_lmdb"):
        assert imagedb.lmdb_digest(out / part) == imagedb.lmdb_digest(clean / part)
    for f in ("mean.binaryproto", "train.txt", "val.txt", "skipped.txt", "synset_words.txt"):
        assert (out / f).read_bytes() == (clean / f).read_bytes(), f
    assert json.loads((out / "train_lmdb.done.json").read_text())["sha256"] == imagedb.lmdb_digest(out / "train_lmdb")[1]


def test_decoding_processes_give_the_same_lmdb(ilsvrc, wf_pb2, tmp_path, monkeypatch):
    monkeypatch.setattr(imagedb, "POOL_MIN", 0)  # use the pool even for these few images
    monkeypatch.setattr(imagedb, "CHUNK", 2)
    a, b = tmp_path / "a", tmp_path / "b"
    imagenet.prepare_imagenet(ilsvrc["train"], ilsvrc["val"], a, devkit=ilsvrc["devkit"], size=40, jobs=1)
    r = imagenet.prepare_imagenet(ilsvrc["train"], ilsvrc["val"], b, devkit=ilsvrc["devkit"], size=40, jobs=3)
    assert [n for n, _ in r.skipped] == [CORRUPT]
    for part in ("train_lmdb", "val_lmdb"):
        assert wf_datums(a / part) == wf_datums(b / part)
    assert (a / "mean.binaryproto").read_bytes() == (b / "mean.binaryproto").read_bytes()


# ------------------------------------------------------------------------------------------- bad input
def _cli(*args) -> str:
    r = CliRunner().invoke(main, ["prepare-imagenet", *map(str, args)])
    assert r.exit_code == 1, r.output
    last = r.output.rstrip("\n").split("\n")[-1]
    assert "Traceback" not in r.output and last.startswith("cometctl: error: "), r.output
    return last  # the whole message on one line


def test_inner_tars_that_are_not_wordnet_ids_are_refused(ilsvrc, tmp_path):
    bad = wf_tar(tmp_path / "train.tar", {"cats.tar": (ilsvrc["train"].read_bytes()[:10240]),
                                          "n01440764.tar": b"\0" * 10240})
    msg = _cli("--train", bad, "--val", ilsvrc["val"], "--devkit", ilsvrc["devkit"], "--data-dir", tmp_path / "o")
    assert "1 of its 2 inner tars are not named after a WordNet ID (first: 'cats.tar')" in msg
    assert "n01440764.tar" in msg  # what was expected
    # the val archive given as the train archive
    msg = _cli("--train", ilsvrc["val"], "--val", ilsvrc["val"], "--devkit", ilsvrc["devkit"])
    assert "holds 9 images directly and no per-class tars (is it the val archive?" in msg
    assert not (tmp_path / "o").exists()


def test_val_archive_without_labels_is_refused(ilsvrc, tmp_path):
    msg = _cli("--train", ilsvrc["train"], "--val", ilsvrc["val"], "--data-dir", tmp_path / "o")
    assert "the val images carry no labels" in msg and "--devkit ILSVRC2012_devkit_t12.tar.gz" in msg
    assert "--val-labels val.txt" in msg
    short = tmp_path / "short.txt"
    short.write_text("ILSVRC2012_val_00000001.JPEG 0\n")
    msg = _cli("--train", ilsvrc["train"], "--val", ilsvrc["val"], "--val-labels", short)
    assert "has no label for 8 val image(s)" in msg
    msg = _cli("--train", ilsvrc["train"], "--val", ilsvrc["train"], "--devkit", ilsvrc["devkit"])
    assert "holds no images (it holds tars: is it the train archive?)" in msg
    assert not (tmp_path / "o").exists()


def test_devkit_of_another_year_is_refused(ilsvrc, tmp_path):
    old = wf_tar(tmp_path / "ILSVRC2010_devkit-1.0.tar.gz", {
        "devkit-1.0/data/meta.mat": _meta_mat([(1, "n01440764", "tench", 0)], id_field="ILSVRC2010_ID"),
        "devkit-1.0/data/ILSVRC2010_validation_ground_truth.txt": b"1\n"}, "w:gz")
    msg = _cli("--train", ilsvrc["train"], "--val", ilsvrc["val"], "--devkit", old)
    assert "this is the devkit of ILSVRC2010 (ILSVRC2010_validation_ground_truth.txt)" in msg
    assert "expected the ILSVRC2012 devkit" in msg
    # a 2012 ground truth beside another year's meta.mat
    mixed = wf_tar(tmp_path / "mixed.tar.gz", {
        "d/data/meta.mat": _meta_mat([(1, "n01440764", "tench", 0)], id_field="ILSVRC2010_ID"),
        "d/data/ILSVRC2012_validation_ground_truth.txt": b"1\n"}, "w:gz")
    msg = _cli("--train", ilsvrc["train"], "--val", ilsvrc["val"], "--devkit", mixed)
    assert "meta.mat has no ILSVRC2012_ID/WNID table (it has ILSVRC2010_ID: the devkit of another year)" in msg
    nothing = wf_tar(tmp_path / "nothing.tar.gz", {"readme.txt": b"hi\n"}, "w:gz")
    assert "has no data/ILSVRC2012_validation_ground_truth.txt" in _cli(
        "--train", ilsvrc["train"], "--val", ilsvrc["val"], "--devkit", nothing)


def test_classes_that_disagree_with_the_devkit_are_refused(ilsvrc, tmp_path):
    devkit = wf_tar(tmp_path / "dk.tar.gz", {
        "d/data/meta.mat": _meta_mat([(1, "n01440764", "tench", 0), (2, "n09999999", "other", 0)]),
        "d/data/ILSVRC2012_validation_ground_truth.txt": b"1\n" * 9}, "w:gz")
    msg = _cli("--train", ilsvrc["train"], "--val", ilsvrc["val"], "--devkit", devkit)
    assert "its 2 synsets and the 3 classes of" in msg and "n09999999 has no train images" in msg


# ------------------------------------------------------------------------------ upstream side by side
@WF_NEEDS_BUILD
def test_same_keys_labels_and_pixels_as_upstream_convert_imageset(prepared, ilsvrc, tmp_path):
    """convert_imageset on the unpacked val images with our val listing in our key order: the same keys,
    labels and Datum shape; pixels equal up to JPEG decoding differences: the same resize (OpenCV's
    INTER_LINEAR), greyscale, PNG and EXIF-turned images byte for byte here, CMYK within a level, and the
    1024 x 768 ones (which we decode at 1/2 scale first) within two."""
    from cometctl.paths import tool_path

    out, _ = prepared
    ours = dict(imagedb.iter_datums(out / "val_lmdb"))
    labels = dict(line.split() for line in (out / "val.txt").read_text().splitlines())
    root = tmp_path / "val"
    with tarfile.open(ilsvrc["val"]) as tar:
        tar.extractall(root)  # the baseline needs files; ours read the tar
    listing = tmp_path / "listing.txt"
    listing.write_text("".join(f"{k.split('_', 1)[1]} {labels[k.split('_', 1)[1]]}\n" for k in ours))
    db = tmp_path / "upstream_lmdb"
    run = subprocess.run([str(tool_path("convert_imageset")), "--resize_height=256", "--resize_width=256",
                          f"{root}/", str(listing), str(db)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = dict(imagedb.iter_datums(db))
    assert list(theirs) == list(ours)
    for key, d in ours.items():
        t = theirs[key]
        assert (t.label, t.channels, t.height, t.width, t.encoded) == (d.label, d.channels, d.height, d.width, False)
        diff = np.abs(imagedb.datum_array(d).astype(int) - imagedb.datum_array(t))
        assert diff.mean() < 0.25 and diff.max() <= 2, (key, diff.mean(), diff.max())


# ---------------------------------------------------------------------------------------------- models
NETS = {"bvlc_reference_caffenet": "CaffeNet", "bvlc_alexnet": "AlexNet"}


@pytest.mark.parametrize("model", sorted(NETS))
def test_imagenet_models_point_at_prepare_imagenet_and_have_1000_classes(model, wf_pb2):
    from cometctl.caffeproto import read_text_proto

    d = WF_REPO / "models" / model
    solver = read_text_proto(d / "imagenet_solver.prototxt", wf_pb2.SolverParameter())
    assert solver.net == f"models/{model}/imagenet_train_val.prototxt"
    assert solver.HasField("comet") and solver.comet.eb_mode == wf_pb2.CometParameter.ADAPTIVE
    assert list(solver.test_iter) == [1000] and solver.solver_mode == wf_pb2.SolverParameter.GPU
    net = read_text_proto(WF_REPO / solver.net, wf_pb2.NetParameter())
    data = [l for l in net.layer if l.type == "Data"]
    assert sorted(l.data_param.source for l in data) == ["data/imagenet/train_lmdb", "data/imagenet/val_lmdb"]
    assert {l.transform_param.mean_file for l in data} == {"data/imagenet/mean.binaryproto"}
    assert {l.transform_param.crop_size for l in data} == {227}
    assert sorted(l.data_param.batch_size for l in data) == [50, 256]  # 1000 x 50 = the 50,000 val images
    deploy = read_text_proto(d / "imagenet_deploy.prototxt", wf_pb2.NetParameter())
    for n in (net, deploy):
        ips = [l for l in n.layer if l.type == "InnerProduct"]
        assert [l.inner_product_param.num_output for l in ips] == [4096, 4096, 1000]
        convs = [l.convolution_param for l in n.layer if l.type == "Convolution"]
        assert [(c.num_output, c.kernel_size[0], c.group) for c in convs] == \
            [(96, 11, 1), (256, 5, 2), (384, 3, 1), (384, 3, 2), (256, 3, 2)]
    # CaffeNet pools before it normalizes, AlexNet the other way round
    order = [l.type for l in net.layer if l.type in ("Pooling", "LRN")][:2]
    assert order == (["Pooling", "LRN"] if model == "bvlc_reference_caffenet" else ["LRN", "Pooling"])


def test_imagenet_model_files_are_what_the_generator_writes():
    import sys

    subprocess.run([sys.executable, str(WF_REPO / "models" / "make_imagenet_models.py"), "--check"], check=True)


@WF_NEEDS_BUILD
@pytest.mark.parametrize("model", sorted(NETS))
def test_cometctl_train_runs_the_imagenet_models(model, prepared, wf_pb2, tmp_path):
    """Two iterations at batch 2, COMET on (the solvers' block), on the 256x256 LMDBs made above; then the
    deploy net gives 1,000 probabilities."""
    from conftest import wf_point_model_at
    from cometctl.train import train

    out, _ = prepared
    solver = wf_point_model_at(wf_pb2, WF_REPO / "models" / model, out, tmp_path / "m", batch=2,
                               solver_name="imagenet_solver.prototxt", test_iter=1, test_interval=1000,
                               test_initialization=False, display=1, snapshot=0, snapshot_after_train=False)
    code = train(solver, cpu=True, iters=2, run_dir=tmp_path / "run")
    log = (tmp_path / "run" / "caffe.log").read_text()
    assert code == 0, log[-3000:]
    assert "Iteration 1" in log and "Optimization Done" in log and "COMET total" in log
    assert "Top shape: 2 1000 (2000)" in log  # fc8 of a batch of 2
    from cometctl.caffeproto import import_caffe

    caffe = import_caffe()
    caffe.set_mode_cpu()
    net = caffe.Net(str(WF_REPO / "models" / model / "imagenet_deploy.prototxt"), caffe.TEST)
    net.blobs["data"].reshape(1, 3, 227, 227)
    prob = net.forward(data=np.random.default_rng(0).normal(size=(1, 3, 227, 227)).astype(np.float32))["prob"]
    assert prob.shape == (1, 1000) and abs(prob.sum() - 1) < 1e-4
