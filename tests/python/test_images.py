"""prepare-images: a dataset kept as one folder per class (a folder, a tar or a zip), with or without train/
and val/ folders; the shared pipeline's streaming, parallel and resume behaviour; bad input."""

from __future__ import annotations

import json
import subprocess
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from cometctl import folders, imagedb
from cometctl.cli import main
from cometctl.errors import CometError

from conftest import WF_NEEDS_BUILD, wf_datums, wf_encode, wf_odd_image, wf_picture, wf_unreadable

CLASSES = {"daisy": 7, "rose": 5, "tulip": 9}


def _tree(root: Path, split: bool = False) -> Path:
    """root/<class>/<image> (or root/train/<class>/..., root/val/<class>/...) with a few odd entries:
    a nested folder, hidden files, an image outside any class, a PNG."""
    root.mkdir(parents=True)
    seed = 0
    for cls, n in CLASSES.items():
        for i in range(n):
            part = ("val" if i % 4 == 0 else "train") if split else ""
            d = root / part / cls / ("more" if i == 3 else "")
            d.mkdir(parents=True, exist_ok=True)
            fmt = "PNG" if i == 2 else "JPEG"
            (d / f"{cls}_{i}.{fmt.lower()}").write_bytes(wf_encode(wf_picture(seed, 120 + 10 * i, 100), fmt))
            seed += 1
    base = root / ("train" if split else "")
    (base / "daisy" / ".DS_Store").write_bytes(b"\0" * 10)
    (base / "daisy" / "._daisy_0.jpeg").write_bytes(b"AppleDouble")  # macOS resource fork, not an image
    (root / "loose.jpeg").write_bytes(wf_encode(wf_picture(99)))
    (base / "tulip" / "blink.gif").write_bytes(b"GIF89a")  # no Caffe reader decodes it: a note, not data
    return root


def _listing(path: Path):
    return [tuple(line.rsplit(" ", 1)) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------- layouts
def test_class_folders_get_a_seeded_stratified_split(tmp_path, wf_pb2, capsys):
    src = _tree(tmp_path / "flowers")
    r = folders.prepare_images(src, tmp_path / "out", size=32, jobs=1, val_fraction=0.25)
    out = tmp_path / "out"
    shown = " ".join(capsys.readouterr().err.split())
    assert "ignored 1 image(s) outside a class folder (first: loose.jpeg)" in shown
    assert "ignored 1 file(s) in class folders that are not images Caffe reads (jpg, jpeg, png" in shown
    assert "first: tulip/blink.gif)" in shown  # .DS_Store and macOS' ._ files are not worth a note
    assert f"point the Data layers at {tmp_path / 'out'}/train_lmdb" in shown and "num_output: 3" in shown
    assert (r.train + r.val, r.classes) == (sum(CLASSES.values()), 3) and not r.skipped
    assert (out / "synset_words.txt").read_text().splitlines() == sorted(CLASSES)
    train, val = _listing(out / "train.txt"), _listing(out / "val.txt")
    for i, cls in enumerate(sorted(CLASSES)):
        t = [n for n, lab in train if n.startswith(cls + "/")]
        v = [n for n, lab in val if n.startswith(cls + "/")]
        assert len(v) == round(CLASSES[cls] * 0.25) and len(t) + len(v) == CLASSES[cls]
        assert all(lab == str(i) for n, lab in train + val if n.startswith(cls + "/"))
    assert ("daisy/more/daisy_3.jpeg", "0") in train + val  # deeper folders belong to their class
    assert not any(".DS_Store" in n or "/._" in n for n, _ in train + val)
    keys = {k.split("_", 1)[1]: d.label for k, d in imagedb.iter_datums(out / "val_lmdb")}
    assert keys == {n: int(lab) for n, lab in val}
    # the same seed gives the same split; another seed another one
    again = folders.prepare_images(src, tmp_path / "again", size=32, jobs=1, val_fraction=0.25)
    assert again.val == r.val and (tmp_path / "again" / "val.txt").read_text() == (out / "val.txt").read_text()
    folders.prepare_images(src, tmp_path / "other", size=32, jobs=1, val_fraction=0.25, seed=5)
    assert (tmp_path / "other" / "val.txt").read_text() != (out / "val.txt").read_text()
    assert json.loads((out / "prepare.json").read_text())["split"].startswith("seeded stratified (seed 1701")


def test_one_prepare_at_a_time_per_data_folder(tmp_path, wf_pb2):
    """Two commands preparing one data folder would interleave their LMDBs and manifests: the second is
    refused at once, and the folder is whole afterwards (a finished one is left exactly as it was)."""
    from conftest import held_by_another_process

    src, out = _tree(tmp_path / "flowers"), tmp_path / "out"
    out.mkdir()
    with held_by_another_process(out):
        with pytest.raises(CometError, match="another cometctl command is preparing a dataset there"):
            folders.prepare_images(src, out, size=24, jobs=1)
    assert list(out.iterdir()) == []
    r = folders.prepare_images(src, out, size=24, jobs=1)
    assert r.train and r.val
    # within one process the commands' steps nest (prepare-dogs holds the folder while it downloads,
    # then prepares): the same folder again passes
    from cometctl.locks import folder_lock

    with folder_lock(out, "preparing a dataset"):
        assert folders.prepare_images(src, out, size=24, jobs=1).up_to_date


def test_train_and_val_folders_are_the_split(tmp_path, wf_pb2):
    src = _tree(tmp_path / "ds", split=True)
    r = folders.prepare_images(src, tmp_path / "out", size=32, jobs=1)
    out = tmp_path / "out"
    expected_val = sorted(str(p.relative_to(src / "val")) for p in (src / "val").rglob("*.*"))
    assert [n for n, _ in _listing(out / "val.txt")] == expected_val and r.val == len(expected_val)
    assert r.split == "the train/ and val/ folders"
    assert all(not n.startswith(("train/", "val/")) for n, _ in _listing(out / "train.txt"))  # relative to train/
    (src / "val" / "lily").mkdir()
    (src / "val" / "lily" / "x.jpeg").write_bytes(wf_encode(wf_picture(1)))
    with pytest.raises(CometError, match=r"val/lily is a class without train images"):
        folders.prepare_images(src, tmp_path / "o2", size=32)


def test_a_tar_or_zip_of_the_tree_gives_the_same_lmdbs_as_the_folder(tmp_path, wf_pb2):
    src = _tree(tmp_path / "flowers")
    a = tmp_path / "a"
    folders.prepare_images(src, a, size=24, jobs=1)
    tar = tmp_path / "flowers.tar"
    with tarfile.open(tar, "w") as t:
        t.add(src, arcname="flowers")  # with the folder around it, as people pack it
    z = tmp_path / "flowers.zip"
    with zipfile.ZipFile(z, "w") as zf:
        for p in sorted(src.rglob("*")):
            if p.is_file():
                zf.write(p, "flowers/" + str(p.relative_to(src)))
        zf.writestr("__MACOSX/flowers/daisy/._daisy_1.jpeg", b"resource fork")
    for archive in (tar, z):
        out = tmp_path / archive.suffix[1:]
        folders.prepare_images(archive, out, size=24, jobs=1)
        for part in ("train_lmdb", "val_lmdb"):
            assert imagedb.lmdb_digest(out / part) == imagedb.lmdb_digest(a / part), (archive, part)
        for f in ("train.txt", "val.txt", "mean.binaryproto", "synset_words.txt"):
            assert (out / f).read_bytes() == (a / f).read_bytes(), (archive, f)
    assert folders.default_data_dir(tar).name == "flowers" and folders.default_data_dir(z).name == "flowers"


# -------------------------------------------------------------------------------------------- bad input
def _cli(*args) -> tuple[int, str]:
    r = CliRunner().invoke(main, ["prepare-images", *map(str, args)])
    assert "Traceback" not in r.output
    return r.exit_code, r.output.rstrip("\n").split("\n")[-1]


def test_a_folder_without_images_or_classes_is_refused(tmp_path):
    (tmp_path / "empty" / "cats").mkdir(parents=True)
    (tmp_path / "empty" / "cats" / "notes.txt").write_text("no pictures here")
    code, msg = _cli(tmp_path / "empty", "--data-dir", tmp_path / "o")
    assert code == 1 and msg.startswith("cometctl: error: ") and "no images found" in msg
    assert "expected one folder per class (<class>/<image>)" in msg
    one = tmp_path / "one" / "cats"
    one.mkdir(parents=True)
    (one / "a.jpg").write_bytes(wf_encode(wf_picture(1)))
    code, msg = _cli(tmp_path / "one", "--data-dir", tmp_path / "o")
    assert code == 1 and "found 1 class folder with images; expected at least two classes" in msg
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "a.jpg").write_bytes(wf_encode(wf_picture(1)))
    code, msg = _cli(flat, "--data-dir", tmp_path / "o")
    assert code == 1 and "found 0 class folders" in msg
    code, msg = _cli(tmp_path / "missing")
    assert code == 1 and "no such file or folder" in msg
    gz = tmp_path / "x.tar.gz"
    with tarfile.open(gz, "w:gz") as t:
        t.add(one, arcname="cats")
    code, msg = _cli(gz, "--data-dir", tmp_path / "o")
    assert code == 1 and "a compressed archive cannot be read in place" in msg
    assert not (tmp_path / "o").exists()  # nothing written


def test_unreadable_images_are_skipped_listed_and_never_in_an_lmdb(tmp_path, wf_pb2):
    src = _tree(tmp_path / "flowers")
    good = (src / "rose" / "rose_0.jpeg").read_bytes()
    bad = {"rose/empty.jpg": wf_unreadable("empty"), "rose/text.jpg": wf_unreadable("text"),
           "tulip/cut.png": wf_unreadable("cut", wf_odd_image("png", 5, (300, 240)), keep=300),
           "daisy/half.jpg": wf_unreadable("cut", good, keep=len(good) // 3)}
    for name, data in bad.items():
        (src / name).write_bytes(data)
    code, _ = _cli(src, "--data-dir", tmp_path / "out", "--size", "16", "--jobs", "2")
    assert code == 0
    out = tmp_path / "out"
    listed = dict(line.split("\t") for line in (out / "skipped.txt").read_text().splitlines())
    assert sorted(listed) == sorted(bad) and all(listed.values())
    stored = {k.split("_", 1)[1] for p in ("train_lmdb", "val_lmdb") for k, _ in imagedb.iter_datums(out / p)}
    assert not stored & set(bad) and len(stored) == sum(CLASSES.values())
    lists = (out / "train.txt").read_text() + (out / "val.txt").read_text()
    assert not any(n in lists for n in bad)
    assert json.loads((out / "prepare.json").read_text())["skipped"]


# --------------------------------------------------------------------------- the pipeline's machinery
def test_resume_with_decoding_processes_equals_a_clean_run(tmp_path, wf_pb2, monkeypatch):
    monkeypatch.setattr(imagedb, "BATCH", 5)
    monkeypatch.setattr(imagedb, "POOL_MIN", 0)
    monkeypatch.setattr(imagedb, "CHUNK", 2)
    monkeypatch.setattr(imagedb, "REOPEN_EVERY", 4)  # the LMDB is closed and reopened between batches too
    src = _tree(tmp_path / "flowers")
    out = tmp_path / "out"
    with pytest.raises(CometError, match="interrupted") as e:
        folders.prepare_images(src, out, size=20, jobs=2, _stop_after=5)
    assert e.value.exit_code == 130 and (out / "train_lmdb.partial").exists()
    r = folders.prepare_images(src, out, size=20, jobs=2)
    assert r.resumed_from["train"] == 5
    clean = tmp_path / "clean"
    folders.prepare_images(src, clean, size=20, jobs=1)
    for part in ("train_lmdb", "val_lmdb"):
        assert wf_datums(out / part) == wf_datums(clean / part)
    assert (out / "mean.binaryproto").read_bytes() == (clean / "mean.binaryproto").read_bytes()
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert folders.prepare_images(src, out, size=20, jobs=2).up_to_date
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_a_partial_lmdb_that_disagrees_with_its_record_is_started_afresh(tmp_path, wf_pb2, monkeypatch, capsys):
    monkeypatch.setattr(imagedb, "BATCH", 4)
    src = _tree(tmp_path / "flowers")
    out = tmp_path / "out"
    with pytest.raises(CometError, match="interrupted"):
        folders.prepare_images(src, out, size=20, jobs=1, _stop_after=4)
    record = json.loads((out / "train_lmdb.partial.json").read_text())
    record["written"] += 1  # what a machine crash between a commit and its record could leave
    (out / "train_lmdb.partial.json").write_text(json.dumps(record))
    capsys.readouterr()
    r = folders.prepare_images(src, out, size=20, jobs=1)
    shown = " ".join(capsys.readouterr().err.split())
    assert f"holds {record['written'] - 1} entries where {record['written']} were recorded" in shown
    assert "starting it afresh" in shown and r.resumed_from["train"] == 0
    clean = tmp_path / "clean"
    folders.prepare_images(src, clean, size=20, jobs=1)
    assert wf_datums(out / "train_lmdb") == wf_datums(clean / "train_lmdb")


def test_decoding_streams_with_a_bounded_number_of_images_in_flight(tmp_path, monkeypatch):
    """However long the list, the pool is fed only jobs x IN_FLIGHT_PER_JOB tasks ahead of the writer,
    and results come back in order: memory does not grow with the dataset."""
    img = tmp_path / "a.jpg"
    img.write_bytes(wf_encode(wf_picture(3, 40, 30)))
    pulled = 0

    def items():
        nonlocal pulled
        for i in range(400):
            pulled += 1
            yield i, ("file", str(img), 0, -1), 8, i % 3

    ahead = []
    got = []
    decoder = imagedb._decoded(items(), 2, 400)
    assert len(decoder.workers) == 2
    try:
        for index, value, digest, offset in decoder:
            ahead.append(pulled - len(got))
            got.append(index)
            assert value is not None and len(digest) == 32 and isinstance(offset, int)
    finally:
        decoder.close()
    assert got == list(range(400))
    limit = (2 * imagedb.IN_FLIGHT_PER_JOB + 1) * imagedb.CHUNK
    assert max(ahead) <= limit < 400


def test_odd_pixel_formats_decode_to_bgr(tmp_path):
    from PIL import Image

    rgb = wf_picture(7, 64, 48)
    ours = imagedb.decode_image(wf_odd_image("png", 7, rgb.size), 32)
    assert ours.shape == (3, 32, 32)
    # B, G, R planes of the image, resized (another bilinear filter differs by a level or two)
    ref = np.asarray(rgb.resize((32, 32), Image.BILINEAR)).astype(int)
    assert np.abs(ours.transpose(1, 2, 0)[:, :, ::-1] - ref).mean() < 1
    assert np.abs(ours.transpose(1, 2, 0) - ref).mean() > 10  # RGB order would be far off
    same = {kind: wf_odd_image(kind, 7, rgb.size) for kind in ("rgba", "bmp", "tiff")}
    for name, data in same.items():
        assert np.array_equal(imagedb.decode_image(data, 32), ours), name
    palette = imagedb.decode_image(wf_odd_image("palette", 7, rgb.size), 32)
    assert np.abs(palette.astype(int) - ours).mean() < 6
    # 16-bit greyscale: the top 8 bits, in all three channels
    g16 = (np.arange(48 * 64, dtype=np.uint16).reshape(48, 64) * 20)
    out = imagedb.decode_image(wf_encode(Image.fromarray(g16), "PNG"), 64)
    assert out.shape == (3, 64, 64) and (out[0] == out[1]).all() and (out[1] == out[2]).all()
    top = np.asarray(Image.fromarray((g16 >> 8).astype(np.uint8)).resize((64, 64), Image.BILINEAR))
    assert np.abs(out[0].astype(int) - top).max() <= 1


@WF_NEEDS_BUILD
def test_upstream_convert_imageset_reads_our_listing_to_the_same_datums(tmp_path, wf_pb2):
    """The names in train.txt are relative to the split's root: convert_imageset reads them from there and,
    given our key order, writes the same keys and labels, and the same pixels up to a JPEG decoder's
    rounding (the same resize: OpenCV's INTER_LINEAR)."""
    from cometctl.paths import tool_path

    src = _tree(tmp_path / "ds", split=True)
    out = tmp_path / "out"
    folders.prepare_images(src, out, size=64, jobs=1)
    ours = dict(imagedb.iter_datums(out / "train_lmdb"))
    labels = dict(_listing(out / "train.txt"))
    listing = tmp_path / "listing.txt"
    listing.write_text("".join(f"{k.split('_', 1)[1]} {labels[k.split('_', 1)[1]]}\n" for k in ours))
    db = tmp_path / "upstream"
    run = subprocess.run([str(tool_path("convert_imageset")), "--resize_height=64", "--resize_width=64",
                          f"{src / 'train'}/", str(listing), str(db)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = dict(imagedb.iter_datums(db))
    assert list(theirs) == list(ours)
    for key, d in ours.items():
        assert theirs[key].label == d.label
        diff = np.abs(imagedb.datum_array(d).astype(int) - imagedb.datum_array(theirs[key]))
        assert diff.mean() < 0.25 and diff.max() <= 2, (key, diff.mean(), diff.max())


def test_cli_help_explains():
    r = CliRunner().invoke(main, ["prepare-images", "--help"])
    assert r.exit_code == 0
    text = " ".join(r.output.split()).lower()
    for word in ("one folder per class", "train/", "zip", "--val-fraction", "--size", "--jobs", "resumable"):
        assert word in text, word


def test_a_file_system_without_flock_goes_on_unguarded(tmp_path, monkeypatch):
    """flock(2) fails with ENOLCK on some network file systems: the lock and the train-side check go
    on rather than stopping with a traceback."""
    import errno

    from cometctl import locks

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(locks.fcntl, "flock", no_flock)
    with locks.folder_lock(tmp_path / "data", "preparing a dataset"):
        (tmp_path / "data" / "x").write_text("written")
    assert (tmp_path / "data" / "x").exists()
    assert locks.busy(tmp_path / "data") is False
