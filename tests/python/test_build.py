"""cometctl's build machinery: source verification, the patch series, the tree sync, --help."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
import time
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from cometctl import build, patches, paths, upstream
from cometctl.cli import main
from cometctl.errors import CometError

PIN = upstream.Pin.load()
CACHED = paths.CACHE_DIR / "downloads" / PIN.orig_name


def make_tree(root: Path) -> Path:
    (root / "src").mkdir(parents=True)
    (root / "CMakeLists.txt").write_text("project(x)\n")
    (root / "src" / "a.cpp").write_text("int a() {\n  return 1;\n}\n")
    (root / "src" / "b.cpp").write_text("int b() { return 2; }\n")
    return root


def tar_dir(src: Path, out: Path, prefix: str = "", mode: str = "w:gz") -> Path:
    with tarfile.open(out, mode) as tar:
        for p in sorted(src.rglob("*")):
            tar.add(p, arcname=os.path.join(prefix, p.relative_to(src).as_posix()), recursive=False)
    return out


def fake_pin(tree: Path, orig_sha: str = "0" * 64) -> upstream.Pin:
    return replace(PIN, orig_sha256=orig_sha, tree_sha256=upstream.tree_digest(tree))


# ---------------------------------------------------------------- source verification

def test_content_digest_accepts_any_archive_of_the_same_tree(tmp_path):
    tree = make_tree(tmp_path / "tree")
    pin = fake_pin(tree)
    flat = tar_dir(tree, tmp_path / "flat.tar.gz")
    github_like = tar_dir(tree, tmp_path / "gh.tar.xz", prefix="caffe-99bd997", mode="w:xz")
    assert "content digest" in upstream.verify_archive(flat, pin)
    assert "content digest" in upstream.verify_archive(github_like, pin)


def test_tampered_tarball_is_refused(tmp_path):
    tree = make_tree(tmp_path / "tree")
    pin = fake_pin(tree)
    (tree / "src" / "a.cpp").write_text("int a() {\n  return 2;\n}\n")  # one byte changed
    bad = tar_dir(tree, tmp_path / "bad.tar.gz")
    with pytest.raises(CometError, match="does not match the pinned Caffe"):
        upstream.verify_archive(bad, pin)


def test_truncated_and_missing_archives_are_refused(tmp_path):
    tree = make_tree(tmp_path / "tree")
    pin = fake_pin(tree)
    good = tar_dir(tree, tmp_path / "good.tar.gz").read_bytes()
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(good[: len(good) // 2])
    with pytest.raises(CometError):
        upstream.verify_archive(cut, pin)
    with pytest.raises(CometError, match="not found"):
        upstream.verify_archive(tmp_path / "nope.tar.gz", pin)


def test_archive_escaping_its_folder_is_refused(tmp_path):
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        data = b"x"
        info = tarfile.TarInfo("../outside.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(CometError, match="outside the tree"):
        upstream.unpack(evil, tmp_path / "dest")
    assert not (tmp_path / "outside.txt").exists()


@pytest.mark.skipif(not CACHED.exists(), reason="pinned upstream not fetched yet (cometctl build fetches it)")
def test_pinned_tarball_verifies_and_a_tampered_copy_does_not(tmp_path):
    assert "sha256" in upstream.verify_archive(CACHED, PIN)
    root = upstream.unpack(CACHED, tmp_path / "u")
    assert upstream.tree_digest(root) == PIN.tree_sha256
    with open(root / "src" / "caffe" / "net.cpp", "a") as f:
        f.write("// tampered\n")
    bad = tar_dir(root, tmp_path / "tampered.tar.gz")
    with pytest.raises(CometError, match="refusing to build"):
        upstream.verify_archive(bad, PIN)


# ---------------------------------------------------------------- the patch series

def write_patch(d: Path, name: str, subject: str, diff: str) -> None:
    (d / name).write_text(f"Subject: {subject}\n\nWhy it exists.\n---\n{diff}")


GOOD_DIFF = """diff --git a/src/a.cpp b/src/a.cpp
--- a/src/a.cpp
+++ b/src/a.cpp
@@ -1,3 +1,3 @@
 int a() {
-  return 1;
+  return 10;
 }
"""
STALE_DIFF = GOOD_DIFF.replace("  return 1;", "  return 7;")


def test_series_applies_in_order(tmp_path):
    tree = make_tree(tmp_path / "tree")
    pd = tmp_path / "patches"
    pd.mkdir()
    write_patch(pd, "0001-ten.patch", "a returns ten", GOOD_DIFF)
    (pd / "series").write_text("# comment\n0001-ten.patch\n")
    assert patches.apply_series(tree, pd) == ["0001-ten.patch"]
    assert "return 10;" in (tree / "src" / "a.cpp").read_text()


def test_patch_that_no_longer_applies_fails_with_its_name_and_touches_nothing(tmp_path):
    tree = make_tree(tmp_path / "tree")
    pd = tmp_path / "patches"
    pd.mkdir()
    write_patch(pd, "0001-ten.patch", "a returns ten", GOOD_DIFF)
    write_patch(pd, "0002-stale-hook.patch", "stale", STALE_DIFF.replace("return 10", "return 11"))
    (pd / "series").write_text("0001-ten.patch\n0002-stale-hook.patch\n")
    with pytest.raises(CometError, match="0002-stale-hook.patch does not apply"):
        patches.apply_series(tree, pd)
    assert "return 10;" in (tree / "src" / "a.cpp").read_text()  # first applied, second left nothing
    assert not list(tree.rglob("*.rej")) and not list(tree.rglob("*.orig"))


def test_series_listing_a_missing_patch_is_an_error(tmp_path):
    pd = tmp_path / "patches"
    pd.mkdir()
    (pd / "series").write_text("0001-gone.patch\n")
    with pytest.raises(CometError, match="0001-gone.patch"):
        patches.read_series(pd)


def test_edit_then_export_round_trips_the_series(tmp_path):
    tree = make_tree(tmp_path / "tree")
    pd = tmp_path / "patches"
    pd.mkdir()
    write_patch(pd, "0001-a-returns-ten.patch", "a returns ten", GOOD_DIFF)
    (pd / "series").write_text("0001-a-returns-ten.patch\n")
    work = patches.make_worktree(tree, tmp_path / "work", pd)
    # A developer adds a second patch as a commit.
    (work / "src" / "b.cpp").write_text("int b() { return 3; }\n")
    subprocess.run(["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t", "commit",
                    "-qam", "Subject: b returns three\n\nBecause tests say so."], check=True)
    names = patches.export_worktree(work, pd)
    assert names == ["0001-a-returns-ten.patch", "0002-b-returns-three.patch"]
    fresh = make_tree(tmp_path / "fresh")
    patches.apply_series(fresh, pd)
    assert (fresh / "src" / "b.cpp").read_text() == "int b() { return 3; }\n"
    assert "return 10;" in (fresh / "src" / "a.cpp").read_text()
    assert (pd / "0002-b-returns-three.patch").read_text().startswith("Subject: b returns three")


def test_patches_edit_makes_the_work_tree_from_a_verified_archive(tmp_path, monkeypatch):
    tree = make_tree(tmp_path / "tree")
    pin = fake_pin(tree)
    monkeypatch.setattr(upstream.Pin, "load", classmethod(lambda cls, path=None: pin))
    pd = tmp_path / "patches"
    pd.mkdir()
    write_patch(pd, "0001-a-returns-ten.patch", "a returns ten", GOOD_DIFF)
    (pd / "series").write_text("0001-a-returns-ten.patch\n")
    archive = tar_dir(tree, tmp_path / "caffe.tar.gz", prefix="caffe-99bd997")
    assert patches.edit(tmp_path / "work", str(archive), pd) == 1
    assert "return 10;" in (tmp_path / "work" / "src" / "a.cpp").read_text()
    (tree / "src" / "b.cpp").write_text("int b() { return 9; }\n")
    with pytest.raises(CometError, match="refusing to build"):
        patches.edit(tmp_path / "work2", str(tar_dir(tree, tmp_path / "bad.tar.gz")), pd)
    assert not (tmp_path / "work2").exists()


def test_real_series_headers_say_why():
    for p in patches.read_series():
        header, diff = patches.split_patch(p.read_text())
        assert header.startswith("Subject: "), p.name
        assert len(header.strip().splitlines()) >= 3, f"{p.name} needs a paragraph saying why"
        assert diff.startswith("diff --git"), p.name


@pytest.mark.skipif(not CACHED.exists(), reason="pinned upstream not fetched yet")
def test_real_series_applies_to_pinned_upstream(tmp_path):
    staged, applied = build.stage_tree(CACHED, tmp_path / "stage")
    assert applied == [p.name for p in patches.read_series()]
    assert "CV_LOAD_IMAGE" not in (staged / "src/caffe/util/io.cpp").read_text()


# ---------------------------------------------------------------- overlay and tree sync

def test_our_files_may_not_replace_upstream_files(tmp_path):
    tree = make_tree(tmp_path / "tree")
    archive = tar_dir(tree, tmp_path / "u.tar.gz")
    ours = tmp_path / "caffe"
    (ours / "src").mkdir(parents=True)
    (ours / "src" / "a.cpp").write_text("// ours\n")
    with pytest.raises(CometError, match="would replace an upstream file"):
        build.stage_tree(archive, tmp_path / "stage", tmp_path / "nopatches", ours)
    (ours / "src" / "a.cpp").unlink()
    (ours / "src" / "comet.cpp").write_text("// ours\n")
    staged, _ = build.stage_tree(archive, tmp_path / "stage", tmp_path / "nopatches", ours)
    assert (staged / "src" / "comet.cpp").read_text() == "// ours\n"


def test_sync_rewrites_only_changed_files(tmp_path):
    staged = make_tree(tmp_path / "staged")
    target = tmp_path / "target"
    assert build.sync_tree(staged, target) == 3
    a, b = target / "src" / "a.cpp", target / "src" / "b.cpp"
    old = {p: p.stat().st_mtime_ns for p in (a, b)}
    time.sleep(0.02)
    assert build.sync_tree(staged, target) == 0          # nothing changed: nothing rewritten
    (staged / "src" / "b.cpp").write_text("int b() { return 5; }\n")
    (target / "build-product.so").write_text("kept")
    assert build.sync_tree(staged, target) == 1
    assert a.stat().st_mtime_ns == old[a] and b.stat().st_mtime_ns > old[b]
    (staged / "src" / "a.cpp").unlink()
    assert build.sync_tree(staged, target) == 1
    assert not a.exists() and (target / "build-product.so").exists()


# ---------------------------------------------------------------- CLI

def all_commands(group, prefix=()):
    for name, cmd in group.commands.items():
        yield prefix + (name,)
        if hasattr(cmd, "commands"):
            yield from all_commands(cmd, prefix + (name,))


@pytest.mark.parametrize("argv", [()] + list(all_commands(main)), ids=lambda a: " ".join(a) or "main")
def test_every_command_has_help(argv):
    r = CliRunner().invoke(main, [*argv, "--help"])
    assert r.exit_code == 0, r.output
    assert "Usage:" in r.output and len(r.output.splitlines()) > 4


@pytest.mark.parametrize("argv", [("build",), ("prepare-dogs", "--synthetic"), ("prepare-imagenet",),
                                  ("prepare-images", ".")], ids=lambda a: a[0])
@pytest.mark.parametrize("jobs", ["0", "-2"])
def test_jobs_below_one_are_refused_before_any_work(argv, jobs):
    # `build -j -2` reached cmake as `-j -2`; the prepare commands quietly took one process. A usage
    # error (exit 2) comes from click's parsing, before the command's body runs.
    r = CliRunner().invoke(main, [*argv, "--jobs", jobs])
    assert r.exit_code == 2, r.output
    assert "Invalid value for '--jobs' / '-j'" in r.output and ">=1" in r.output, r.output


def test_errors_are_one_line_without_traceback():
    r = subprocess.run([str(Path(os.sys.executable).parent / "cometctl"), "build", "--cudnn"],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("cometctl: error:")


# ---------------------------------------------------------------- fetching

def test_fetch_from_debian_with_a_private_apt_state(tmp_path, monkeypatch):
    """What a fresh machine does: apt-get source with our own sources list and state folder."""
    if os.environ.get("COMET_OFFLINE"):
        pytest.skip("COMET_OFFLINE set")
    with open(tmp_path / "log", "w") as log:
        got = upstream.fetch_debian(PIN, tmp_path / "dl", log)
    assert "sha256" in upstream.verify_archive(got, PIN)
    assert not (tmp_path / "lists").exists()  # nothing written outside the temporary state


def test_download_of_an_archive_then_verification(tmp_path):
    """The GitHub path: any archive of the commit verifies by content; a tampered one does not."""
    import functools
    import http.server
    import threading

    tree = make_tree(tmp_path / "tree")
    pin = fake_pin(tree)
    serve = tmp_path / "www"
    serve.mkdir()
    tar_dir(tree, serve / "good.tar.gz", prefix="caffe-99bd997")
    (tree / "src" / "b.cpp").write_text("int b() { return 9; }\n")
    tar_dir(tree, serve / "bad.tar.gz", prefix="caffe-99bd997")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(serve))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        good = upstream.fetch_url(f"{base}/good.tar.gz", tmp_path / "good.tar.gz")
        assert "content digest" in upstream.verify_archive(good, pin)
        bad = upstream.fetch_url(f"{base}/bad.tar.gz", tmp_path / "bad.tar.gz")
        with pytest.raises(CometError, match="refusing to build"):
            upstream.verify_archive(bad, pin)
        with pytest.raises(CometError, match="cannot download"):  # download.fetch's wording
            upstream.fetch_url(f"{base}/missing.tar.gz", tmp_path / "m.tar.gz")
        assert not (tmp_path / "m.tar.gz.part").exists()
    finally:
        httpd.shutdown()


def test_one_build_at_a_time_per_build_folder(tmp_path):
    """A second `cometctl build` of the same variant would run CMake in the same tree: refused at once."""
    from conftest import held_by_another_process

    opts = build.BuildOptions(build_dir=str(tmp_path / "b"), install_deps=False)
    _, cmake_dir = paths.variant_dirs("cpu", opts.build_dir, ())
    cmake_dir.mkdir(parents=True)
    with held_by_another_process(cmake_dir.parent):
        with pytest.raises(CometError, match="another cometctl command is building the cpu variant there"):
            build.build(opts)
    assert not (cmake_dir.parent / "build.log").exists()  # nothing started
