"""Our patch series over upstream Caffe, quilt style: caffe/patches/series lists patch files in order.

Each patch file starts with a header (a `Subject:` line and a paragraph saying why it exists), then
`---`, then a unified diff with a/ and b/ prefixes. Patches are applied with GNU patch after a dry
run, so a patch that no longer applies fails with its name and leaves nothing half-applied.

Developers never edit patch files by hand: `cometctl patches edit` makes a git work tree with one
commit per patch; edit, commit (or amend/fixup/rebase), then `cometctl patches export` writes the
commits back as the series.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from . import paths, upstream
from .errors import CometError

UPSTREAM_TAG = "upstream"


def read_series(patches_dir: Path = paths.PATCHES_DIR) -> list[Path]:
    series = patches_dir / "series"
    if not series.is_file():
        return []
    out = []
    for line in series.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        p = patches_dir / line
        if not p.is_file():
            raise CometError(f"patch '{line}' is listed in {series} but does not exist")
        out.append(p)
    return out


def _run_patch(tree: Path, patch: Path, dry_run: bool) -> subprocess.CompletedProcess:
    if not shutil.which("patch"):
        raise CometError("GNU patch not found: apt-get install patch")
    cmd = ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-r", "-",
           "-i", str(patch)]
    if dry_run:
        cmd.append("--dry-run")
    return subprocess.run(cmd, cwd=tree, capture_output=True, text=True)


def apply_series(tree: Path, patches_dir: Path = paths.PATCHES_DIR) -> list[str]:
    """Apply every patch of the series to tree, in order. Returns the names applied."""
    applied = []
    for patch in read_series(patches_dir):
        check = _run_patch(tree, patch, dry_run=True)
        if check.returncode != 0:
            detail = (check.stdout + check.stderr).strip().splitlines()[-3:]
            raise CometError(f"patch {patch.name} does not apply to upstream: " + " | ".join(detail))
        done = _run_patch(tree, patch, dry_run=False)
        if done.returncode != 0:  # cannot happen after a clean dry run, but never hide it
            raise CometError(f"patch {patch.name} failed: {done.stdout.strip()[-300:]}")
        applied.append(patch.name)
    return applied


def split_patch(text: str) -> tuple[str, str]:
    """(header, diff) of a patch file."""
    m = re.search(r"^---\s*$\n(?=diff |--- )", text, re.M)
    if not m:
        raise CometError("patch has no '---' line between its header and its diff")
    return text[: m.start()].rstrip() + "\n", text[m.end():]


def _git(repo: Path, *args: str, **kw) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="COMET-Caffe", GIT_AUTHOR_EMAIL="comet@localhost",
               GIT_COMMITTER_NAME="COMET-Caffe", GIT_COMMITTER_EMAIL="comet@localhost")
    r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, **kw)
    if r.returncode != 0:
        raise CometError(f"git {' '.join(args[:2])} failed in {repo}: {r.stderr.strip()[-300:]}")
    return r.stdout


def make_worktree(upstream_root: Path, dest: Path, patches_dir: Path = paths.PATCHES_DIR) -> Path:
    """A git repo at dest: upstream as the first commit (tag `upstream`), then one commit per patch
    whose message is the patch header."""
    if dest.exists():
        raise CometError(f"{dest} exists; export or remove it first")
    shutil.copytree(upstream_root, dest, symlinks=True)
    _git(dest, "init", "-q")
    _git(dest, "add", "-A")
    _git(dest, "commit", "-q", "-m", "upstream Caffe (pinned; see caffe/upstream.lock)")
    _git(dest, "tag", UPSTREAM_TAG)
    for patch in read_series(patches_dir):
        header, _ = split_patch(patch.read_text())
        r = _run_patch(dest, patch, dry_run=False)
        if r.returncode != 0:
            raise CometError(f"patch {patch.name} does not apply: {r.stdout.strip()[-300:]}")
        _git(dest, "add", "-A")
        _git(dest, "commit", "-q", "-F", "-", input=header)
    return dest


def edit(dest: str | os.PathLike, upstream_archive: str | None = None,
         patches_dir: Path = paths.PATCHES_DIR) -> int:
    """`cometctl patches edit`: the verified pinned upstream (`upstream_archive` or the cache/fetch),
    unpacked and turned into make_worktree's repo at dest. Returns the number of patches committed."""
    pin = upstream.Pin.load()
    with tempfile.TemporaryDirectory(prefix="comet-patchwork-") as tmp, open(Path(tmp) / "log", "w") as log:
        archive, _origin = upstream.obtain(pin, upstream_archive, log)
        root = upstream.unpack(archive, Path(tmp) / "upstream")
        make_worktree(root, Path(dest).resolve(), patches_dir)
    return len(read_series(patches_dir))


def _slug(subject: str) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")
    return s[:60].rstrip("-") or "patch"


def export_worktree(repo: Path, patches_dir: Path = paths.PATCHES_DIR) -> list[str]:
    """Write each commit after the `upstream` tag as a patch file and rewrite the series."""
    commits = _git(repo, "rev-list", "--reverse", f"{UPSTREAM_TAG}..HEAD").split()
    if _git(repo, "status", "--porcelain").strip():
        raise CometError(f"{repo} has uncommitted changes; commit them first")
    names = []
    patches_dir.mkdir(parents=True, exist_ok=True)
    for i, c in enumerate(commits, 1):
        message = _git(repo, "log", "-1", "--format=%B", c).strip() + "\n"
        subject = message.splitlines()[0].removeprefix("Subject:").strip()
        if not message.startswith("Subject:"):
            message = f"Subject: {message}"
        diff = _git(repo, "diff", "--no-color", "--no-ext-diff", f"{c}^", c)
        name = f"{i:04d}-{_slug(subject)}.patch"
        (patches_dir / name).write_text(f"{message}---\n{diff}")
        names.append(name)
    for old in patches_dir.glob("*.patch"):
        if old.name not in names:
            old.unlink()
    (patches_dir / "series").write_text(
        "# Applied in order over upstream Caffe. Generated by `cometctl patches export`.\n"
        + "".join(n + "\n" for n in names))
    return names
