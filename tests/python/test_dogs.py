"""prepare-dogs: synthetic archives, LMDB/Datum layout, mean file, splits, corrupt images, resume, errors."""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from cometctl import dogs, imagedb, synthetic
from cometctl.cli import main
from cometctl.errors import CometError

from conftest import WF_NEEDS_BUILD, wf_datums, wf_tar, wf_unreadable


# ------------------------------------------------------------------------------------------- synthetic
def test_synthetic_archives_have_the_real_layout_and_are_reproducible(tmp_path, wf_synthetic_archives):
    images, lists = wf_synthetic_archives
    with tarfile.open(images) as tar:
        names = [m.name for m in tar if m.isfile()]
    assert len(names) == 600
    assert all(n.startswith("Images/n0") and n.endswith(".jpg") for n in names)
    assert "Images/n02085620-Chihuahua/n02085620_1000.jpg" in names
    assert len({n.split("/")[1] for n in names}) == 10
    with tarfile.open(lists) as tar:
        assert sorted(m.name for m in tar) == ["file_list.mat", "test_list.mat", "train_list.mat"]
    again = synthetic.generate(tmp_path)
    assert again[0].read_bytes() == images.read_bytes()
    assert again[1].read_bytes() == lists.read_bytes()


def test_synthetic_classes_differ_in_colour_and_shape():
    # the class signal must be there: mean hue family differs between warm and cool classes
    rng = np.random.default_rng(0)
    warm = np.mean([np.asarray(synthetic.render(0, rng)).astype(float) for _ in range(20)], axis=0)
    cool = np.mean([np.asarray(synthetic.render(5, rng)).astype(float) for _ in range(20)], axis=0)
    centre = (slice(16, 48), slice(16, 48))
    assert warm[centre][..., 0].mean() > cool[centre][..., 0].mean() + 15  # more red in the middle
    assert cool[centre][..., 2].mean() > warm[centre][..., 2].mean() + 15  # more blue


# ----------------------------------------------------------------------------------- LMDB and Datums
def test_prepared_lmdbs_hold_shuffled_bgr_datums(wf_synthetic, wf_synthetic_archives):
    d = wf_synthetic
    assert imagedb.lmdb_count(d / "train_lmdb") == 400
    assert imagedb.lmdb_count(d / "val_lmdb") == 200
    assert not (d / "train_lmdb.partial").exists()
    datums = list(imagedb.iter_datums(d / "train_lmdb"))
    keys = [k for k, _ in datums]
    assert keys == sorted(keys) and keys[0].startswith("00000000_")
    labels = [dt.label for _, dt in datums]
    assert labels != sorted(labels), "keys must come in shuffled order"
    assert sorted(set(labels)) == list(range(10))
    k, dt = datums[0]
    assert (dt.channels, dt.height, dt.width, dt.encoded) == (3, 64, 64, False)
    assert len(dt.data) == 3 * 64 * 64
    # the stored bytes are the image in BGR channel order, CHW layout
    name = k.split("_", 1)[1]
    with tarfile.open(wf_synthetic_archives[0]) as tar:
        raw = tar.extractfile("Images/" + name).read()
    from PIL import Image

    rgb = np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))
    chw = imagedb.datum_array(dt)
    assert np.abs(chw.transpose(1, 2, 0)[:, :, ::-1].astype(int) - rgb).max() <= 2
    # labels follow the class folders in sorted order
    assert dt.label == sorted(synthetic.CLASSES).index(name.split("/")[0])


def test_text_outputs(wf_synthetic):
    d = wf_synthetic
    words = (d / "synset_words.txt").read_text().splitlines()
    assert words[0] == "n02085620 Chihuahua" and words[1] == "n02085782 Japanese spaniel"
    train = (d / "train.txt").read_text().splitlines()
    assert len(train) == 400 and train[0] == "n02085620-Chihuahua/n02085620_1000.jpg 0"
    manifest = json.loads((d / "prepare.json").read_text())
    assert manifest["train"] == 400 and manifest["val"] == 200 and manifest["split"] == "official"


def test_mean_file_is_the_mean_of_the_train_lmdb(wf_synthetic, wf_pb2):
    blob = wf_pb2.BlobProto()
    blob.ParseFromString((wf_synthetic / "mean.binaryproto").read_bytes())
    assert (blob.num, blob.channels, blob.height, blob.width) == (1, 3, 64, 64)
    mean = np.array(blob.data, dtype=np.float32).reshape(3, 64, 64)
    stack = np.stack([imagedb.datum_array(dt) for _, dt in imagedb.iter_datums(wf_synthetic / "train_lmdb")])
    assert np.allclose(mean, stack.mean(axis=0), atol=1e-4)


@WF_NEEDS_BUILD
def test_mean_file_loads_with_pycaffe_and_matches_compute_image_mean(wf_synthetic, tmp_path):
    from cometctl.caffeproto import import_caffe
    from cometctl.paths import tool_path

    caffe = import_caffe()
    blob = caffe.proto.caffe_pb2.BlobProto()
    blob.ParseFromString((wf_synthetic / "mean.binaryproto").read_bytes())
    arr = caffe.io.blobproto_to_array(blob)
    assert arr.shape == (1, 3, 64, 64)
    subprocess.run([str(tool_path("compute_image_mean")), str(wf_synthetic / "train_lmdb"),
                    str(tmp_path / "m.binaryproto")], check=True, capture_output=True)
    theirs = caffe.proto.caffe_pb2.BlobProto()
    theirs.ParseFromString((tmp_path / "m.binaryproto").read_bytes())
    assert np.array_equal(caffe.io.blobproto_to_array(theirs), arr)


def test_rerun_is_idempotent(wf_synthetic):
    before = {p.name: p.stat().st_mtime_ns for p in wf_synthetic.iterdir()}
    r = dogs.prepare_dogs(wf_synthetic, archive=wf_synthetic / "images.tar", lists=wf_synthetic / "lists.tar",
                          size=64, jobs=2)
    assert r.up_to_date and r.train == 400
    assert {p.name: p.stat().st_mtime_ns for p in wf_synthetic.iterdir()} == before


# -------------------------------------------------------------------------------------------- splits
def _mat(names, labels=None) -> bytes:
    from scipy.io import savemat

    cell = np.empty((len(names), 1), dtype=object)
    for i, n in enumerate(names):
        cell[i, 0] = np.array([n])
    buf = io.BytesIO()
    data = {"file_list": cell}
    if labels is not None:
        data["labels"] = np.array(labels, dtype=float).reshape(-1, 1)
    savemat(buf, data)
    return buf.getvalue()


def _small_archive(src: Path, dest: Path, per_class: int, classes: int = 3, extra: dict | None = None) -> Path:
    """A smaller images.tar: the first `per_class` images of the first `classes` synthetic classes."""
    keep = {c: 0 for c in synthetic.CLASSES[:classes]}
    with tarfile.open(src) as tin, tarfile.open(dest, "w") as tout:
        for m in tin:
            cls = m.name.split("/")[1]
            if cls in keep and keep[cls] < per_class:
                keep[cls] += 1
                tout.addfile(m, tin.extractfile(m))
        for name, data in (extra or {}).items():
            info = tarfile.TarInfo("Images/" + name)
            info.size = len(data)
            tout.addfile(info, io.BytesIO(data))
    return dest


def test_official_split_comes_from_lists_tar(tmp_path, wf_pb2, wf_synthetic_archives):
    archive = _small_archive(wf_synthetic_archives[0], tmp_path / "images.tar", per_class=6)
    with tarfile.open(archive) as tar:
        names = sorted(m.name[len("Images/"):] for m in tar if m.isfile())
    train_names = [n for n in names if int(n[-8:-4]) % 3 != 0]  # 1001, 1002, 1004, 1005 of each class
    test_names = [n for n in names if n not in train_names]
    label = lambda n: sorted(synthetic.CLASSES).index(n.split("/")[0]) + 1  # noqa: E731
    lists = wf_tar(tmp_path / "lists.tar", {
        "train_list.mat": _mat(train_names, [label(n) for n in train_names]),
        "test_list.mat": _mat(test_names, [label(n) for n in test_names]),
    })
    r = dogs.prepare_dogs(tmp_path / "out", archive=archive, lists=lists, size=32, jobs=1)
    assert (r.train, r.val, r.split) == (len(train_names), len(test_names), "official")
    listed = [line.split()[0] for line in (tmp_path / "out" / "train.txt").read_text().splitlines()]
    assert listed == sorted(train_names)
    val_keys = {k.split("_", 1)[1] for k, _ in imagedb.iter_datums(tmp_path / "out" / "val_lmdb")}
    assert val_keys == set(test_names)


def test_lists_that_disagree_with_the_archive_are_refused(tmp_path, wf_synthetic_archives):
    archive = _small_archive(wf_synthetic_archives[0], tmp_path / "images.tar", per_class=2)
    ok = "n02085620-Chihuahua/n02085620_1000.jpg"
    missing = wf_tar(tmp_path / "a.tar", {"train_list.mat": _mat([ok, "n02085620-Chihuahua/nope.jpg"]),
                                              "test_list.mat": _mat([ok])})
    with pytest.raises(CometError, match="not in"):
        dogs.prepare_dogs(tmp_path / "o1", archive=archive, lists=missing, size=16)
    wrong = wf_tar(tmp_path / "b.tar", {"train_list.mat": _mat([ok], [7]), "test_list.mat": _mat([ok])})
    with pytest.raises(CometError, match="labels disagree"):
        dogs.prepare_dogs(tmp_path / "o2", archive=archive, lists=wrong, size=16)
    incomplete = wf_tar(tmp_path / "c.tar", {"train_list.mat": _mat([ok])})
    with pytest.raises(CometError, match="test_list.mat"):
        dogs.prepare_dogs(tmp_path / "o3", archive=archive, lists=incomplete, size=16)


def test_seeded_split_is_stratified_and_deterministic():
    by_class = {f"c{i}": [f"c{i}/{j}.jpg" for j in range(10 + i)] for i in range(5)}
    a = dogs.seeded_split(by_class, 0.2, seed=3)
    assert a == dogs.seeded_split(by_class, 0.2, seed=3)
    assert a != dogs.seeded_split(by_class, 0.2, seed=4)
    for i in range(5):
        val = [n for n in a["val"] if n.startswith(f"c{i}/")]
        assert len(val) == round((10 + i) * 0.2)
    assert not set(a["train"]) & set(a["val"])
    assert len(a["train"]) + len(a["val"]) == sum(len(v) for v in by_class.values())


# -------------------------------------------------------------------------------- bad input, resume
def test_corrupt_images_are_skipped_counted_and_listed(tmp_path, wf_pb2, wf_synthetic_archives):
    with tarfile.open(wf_synthetic_archives[0]) as tar:
        good = tar.extractfile("Images/n02085620-Chihuahua/n02085620_1000.jpg").read()
    extra = {"n02085620-Chihuahua/n02085620_9001.jpg": wf_unreadable("cut", good, keep=len(good) // 2),
             "n02085782-Japanese_spaniel/n02085782_9002.jpg": wf_unreadable("text")}
    archive = _small_archive(wf_synthetic_archives[0], tmp_path / "images.tar", per_class=5, extra=extra)
    r = dogs.prepare_dogs(tmp_path / "out", archive=archive, size=32, jobs=2, val_fraction=0.4)
    assert sorted(n for n, _ in r.skipped) == sorted(extra)
    assert r.train + r.val == 15
    listed = (tmp_path / "out" / "skipped.txt").read_text()
    assert all(n in listed for n in extra)
    lists = (tmp_path / "out" / "train.txt").read_text() + (tmp_path / "out" / "val.txt").read_text()
    assert not any(n in lists for n in extra)
    assert imagedb.lmdb_count(tmp_path / "out" / "train_lmdb") + \
        imagedb.lmdb_count(tmp_path / "out" / "val_lmdb") == 15


def test_interrupted_conversion_resumes_and_equals_a_clean_run(tmp_path, wf_pb2, wf_synthetic_archives):
    images, lists = wf_synthetic_archives
    out = tmp_path / "out"
    with pytest.raises(CometError, match="interrupted.*resume") as e:  # what Ctrl-C gives the user
        dogs.prepare_dogs(out, archive=images, lists=lists, size=32, jobs=2, _stop_after=imagedb.BATCH)
    assert e.value.exit_code == 130
    assert not (out / "train_lmdb").exists(), "an interrupted LMDB must not look finished"
    assert (out / "train_lmdb.partial").exists() and not (out / "prepare.json").exists()
    assert imagedb.lmdb_count(out / "train_lmdb.partial") == imagedb.BATCH
    r = dogs.prepare_dogs(out, archive=images, lists=lists, size=32, jobs=2)
    assert (r.train, r.val) == (400, 200) and not r.up_to_date
    assert r.resumed_from == {"train": imagedb.BATCH, "val": 0}  # went on from the checkpoint
    assert not (out / "train_lmdb.partial").exists()
    clean = tmp_path / "clean"
    dogs.prepare_dogs(clean, archive=images, lists=lists, size=32, jobs=1)
    for part in ("train_lmdb", "val_lmdb"):
        assert wf_datums(out / part) == wf_datums(clean / part)
    assert (out / "mean.binaryproto").read_bytes() == (clean / "mean.binaryproto").read_bytes()


def _identity(lmdb_dir: Path):
    """What says an LMDB was not rewritten: inodes and mtimes of the folder and its data file, and its bytes."""
    data = lmdb_dir / "data.mdb"
    return (lmdb_dir.stat().st_ino, data.stat().st_ino, data.stat().st_mtime_ns, data.read_bytes())


def test_a_finished_lmdb_is_kept_after_an_interruption(tmp_path, wf_pb2, wf_synthetic_archives, monkeypatch,
                                                      capsys):
    """Issue 15, 4: interrupted once the train LMDB was complete, the rerun verifies it and keeps it."""
    images, lists = wf_synthetic_archives
    out = tmp_path / "out"
    build = imagedb.build_lmdb

    def interrupted_at_val(source, entries, dest, *args, **kwargs):
        if Path(dest).name == "val_lmdb":
            raise KeyboardInterrupt  # the user's Ctrl-C just after train_lmdb was finished
        return build(source, entries, dest, *args, **kwargs)

    monkeypatch.setattr(imagedb, "build_lmdb", interrupted_at_val)
    with pytest.raises(CometError, match="interrupted"):
        dogs.prepare_dogs(out, archive=images, lists=lists, size=32, jobs=1)
    monkeypatch.setattr(imagedb, "build_lmdb", build)
    assert (out / "train_lmdb").is_dir() and not (out / "val_lmdb").exists() and not (out / "prepare.json").exists()
    before = _identity(out / "train_lmdb")
    capsys.readouterr()

    r = dogs.prepare_dogs(out, archive=images, lists=lists, size=32, jobs=1)
    assert _identity(out / "train_lmdb") == before, "the finished train LMDB was rewritten"
    assert r.kept == ["train_lmdb"] and (r.train, r.val) == (400, 200) and not r.up_to_date
    assert r.resumed_from == {"train": 400, "val": 0}
    assert "kept" in capsys.readouterr().err
    for f in ("val_lmdb", "mean.binaryproto", "train.txt", "val.txt", "synset_words.txt", "prepare.json"):
        assert (out / f).exists(), f
    clean = tmp_path / "clean"
    dogs.prepare_dogs(clean, archive=images, lists=lists, size=32, jobs=1)
    for part in ("train_lmdb", "val_lmdb"):
        assert wf_datums(out / part) == wf_datums(clean / part)
    for f in ("mean.binaryproto", "train.txt", "val.txt", "synset_words.txt"):
        assert (out / f).read_bytes() == (clean / f).read_bytes(), f
    assert dogs.prepare_dogs(out, archive=images, lists=lists, size=32, jobs=1).up_to_date


def test_finished_outputs_are_verified_and_rebuilt_when_they_do_not_verify(tmp_path, wf_pb2,
                                                                         wf_synthetic_archives, capsys):
    import lmdb

    images, lists = wf_synthetic_archives
    out = tmp_path / "out"
    dogs.prepare_dogs(out, archive=images, lists=lists, size=32, jobs=1)
    good = {part: wf_datums(out / part) for part in ("train_lmdb", "val_lmdb")}
    mean = (out / "mean.binaryproto").read_bytes()
    stamp = json.loads((out / "train_lmdb.done.json").read_text())
    assert stamp["entries"] == 400 and stamp["sha256"] == imagedb.lmdb_digest(out / "train_lmdb")[1]

    def again():
        (out / "prepare.json").unlink()  # what an interruption after the LMDBs leaves: not "prepared"
        capsys.readouterr()
        r = dogs.prepare_dogs(out, archive=images, lists=lists, size=32, jobs=1)
        return r, " ".join(capsys.readouterr().err.split())

    # untouched: both LMDBs and the mean are kept, nothing rewritten
    ids = {part: _identity(out / part) for part in ("train_lmdb", "val_lmdb")}
    mean_mtime = (out / "mean.binaryproto").stat().st_mtime_ns
    r, _ = again()
    assert r.kept == ["train_lmdb", "val_lmdb", "mean.binaryproto"]
    assert {part: _identity(out / part) for part in ids} == ids
    assert (out / "mean.binaryproto").stat().st_mtime_ns == mean_mtime

    def edit(change):
        env = lmdb.open(str(out / "train_lmdb"), subdir=True)
        with env.begin(write=True) as txn:
            change(txn, next(iter(txn.cursor()))[0])
        env.close()

    cases = [
        (lambda: edit(lambda txn, key: txn.delete(key)), "holds 399 entries, but 400 were written"),
        (lambda: edit(lambda txn, key: txn.put(key, b"x" + bytes(txn.get(key))[1:])),
         "has changed since it was finished (its content digest differs)"),
        (lambda: (out / "train_lmdb.done.json").unlink(), "has no record of being finished"),
    ]
    for damage, message in cases:
        damage()
        r, shown = again()
        assert f"{out / 'train_lmdb'} " + message in shown and "rebuilding it" in shown, shown
        assert r.kept == ["val_lmdb"] and r.resumed_from["train"] == 0
        assert wf_datums(out / "train_lmdb") == good["train_lmdb"]
        assert wf_datums(out / "val_lmdb") == good["val_lmdb"]
        assert (out / "mean.binaryproto").read_bytes() == mean  # recomputed from the rebuilt LMDB
        assert not (out / "train_lmdb.partial").exists() and (out / "train_lmdb.done.json").exists()


def test_truncated_archive_is_refused(tmp_path, wf_synthetic_archives):
    data = wf_synthetic_archives[0].read_bytes()
    (tmp_path / "half.tar").write_bytes(data[: len(data) // 2 + 100])
    with pytest.raises(CometError, match="truncated|not a readable"):
        dogs.prepare_dogs(tmp_path / "o", archive=tmp_path / "half.tar", size=16)
    # cut exactly after a member: tarfile alone would read this silently as a shorter archive
    with tarfile.open(wf_synthetic_archives[0]) as tar:
        members = tar.getmembers()
    cut = members[300].offset  # the header of member 300: members 0..299 are complete
    (tmp_path / "cut.tar").write_bytes(data[:cut])
    with pytest.raises(CometError, match="truncated"):
        dogs.prepare_dogs(tmp_path / "o", archive=tmp_path / "cut.tar", size=16)
    # cut there and followed by garbage: tarfile stops at the bad header without a word
    (tmp_path / "junk.tar").write_bytes(data[:cut] + b"\x7f" * 4096)
    with pytest.raises(CometError, match="truncated"):
        dogs.prepare_dogs(tmp_path / "o", archive=tmp_path / "junk.tar", size=16)
    assert not (tmp_path / "o" / "train_lmdb").exists()


def test_missing_files_give_one_line_errors(tmp_path):
    runner = CliRunner()
    r = runner.invoke(main, ["prepare-dogs", "--data-dir", str(tmp_path), "--archive", str(tmp_path / "no.tar")])
    assert r.exit_code != 0
    assert "no.tar: no such file" in r.output and "Traceback" not in r.output
    assert list(tmp_path.iterdir()) == []  # nothing written
    r = runner.invoke(main, ["prepare-dogs", "--data-dir", str(tmp_path / "new"), "--archive", str(tmp_path / "no.tar")])
    assert r.exit_code != 0 and not (tmp_path / "new").exists()  # not even the data folder
    with pytest.raises(CometError, match="no such file"):
        dogs.read_official_split(tmp_path / "lists.tar")
    with pytest.raises(CometError, match="class folder"):
        (tmp_path / "flat").mkdir()
        (tmp_path / "flat" / "a.jpg").write_bytes(b"x")
        dogs.prepare_dogs(tmp_path / "o", archive=tmp_path / "flat", size=16)


def test_unpacked_folder_works_like_the_archive(tmp_path, wf_pb2, wf_synthetic_archives):
    archive = _small_archive(wf_synthetic_archives[0], tmp_path / "images.tar", per_class=4, classes=2)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "unpacked")  # our own archive
    a = dogs.prepare_dogs(tmp_path / "a", archive=archive, size=16, jobs=1)
    b = dogs.prepare_dogs(tmp_path / "b", archive=tmp_path / "unpacked", size=16, jobs=1)
    assert (a.train, a.val) == (b.train, b.val)
    assert wf_datums(tmp_path / "a" / "train_lmdb") == wf_datums(tmp_path / "b" / "train_lmdb")


def test_cli_help_explains():
    r = CliRunner().invoke(main, ["prepare-dogs", "--help"])
    assert r.exit_code == 0
    for word in ("--archive", "--lists", "--synthetic", "--size", "--jobs", "resumable"):
        assert word.lower() in r.output.lower()


def test_other_options_rebuild_and_replace_the_outputs(tmp_path, wf_pb2, wf_synthetic_archives):
    archive = _small_archive(wf_synthetic_archives[0], tmp_path / "images.tar", per_class=4, classes=2)
    dogs.prepare_dogs(tmp_path / "o", archive=archive, size=16, jobs=1)
    r = dogs.prepare_dogs(tmp_path / "o", archive=archive, size=24, jobs=1)
    assert not r.up_to_date
    _, d = next(imagedb.iter_datums(tmp_path / "o" / "train_lmdb"))
    assert (d.height, d.width) == (24, 24)
    assert sorted(p.name for p in (tmp_path / "o").iterdir() if "lmdb" in p.name) == [
        "train_lmdb", "train_lmdb.done.json", "val_lmdb", "val_lmdb.done.json"]
    assert dogs.prepare_dogs(tmp_path / "o", archive=archive, size=24, jobs=1).up_to_date


def test_ctrl_c_during_conversion_is_one_line_and_resumable(tmp_path, wf_pb2):
    """A real SIGINT to the whole process group (what a terminal sends), workers included."""
    import json as _json
    import signal
    import subprocess
    import sys
    import time

    images, lists = synthetic.generate(tmp_path / "src", per_class=300, train_per_class=250)
    out = tmp_path / "out"
    cmd = [str(Path(sys.executable).parent / "cometctl"), "prepare-dogs", "--archive", str(images),
           "--lists", str(lists), "--data-dir", str(out), "--size", "128", "--jobs", "2"]
    # SIGINT at its default in the child even when this test runs with it ignored (a shell's
    # `cmd &` ignores it, and a Python started so keeps it ignored, as nohup intends)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    sidecar = out / "train_lmdb.partial.json"
    try:
        deadline = time.time() + 60
        while time.time() < deadline and proc.poll() is None:
            try:
                if _json.loads(sidecar.read_text())["done"] > 0:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.01)
        assert proc.poll() is None, "conversion finished before it could be interrupted"
        os.killpg(proc.pid, signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output
    assert "Traceback" not in output
    assert "interrupted" in output and "run the same command again to resume" in " ".join(output.split())
    assert not (out / "train_lmdb").exists() and (out / "train_lmdb.partial").exists()
    r = dogs.prepare_dogs(out, archive=images, lists=lists, size=128, jobs=2)
    assert (r.train, r.val) == (2500, 500) and r.resumed_from["train"] > 0
