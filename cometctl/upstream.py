"""Fetch and verify the pinned upstream Caffe source.

The pin lives in caffe/upstream.lock. A source is accepted only if it verifies: the Debian orig tarball
by its sha256, any other archive of the same commit (GitHub's, a local one) by the digest of its unpacked
content, which does not depend on how the archive was compressed or named.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import paths
from .download import fetch, file_digest
from .errors import CometError
from .ui import console, step


@dataclass(frozen=True)
class Pin:
    commit: str
    debian_package: str
    debian_version: str
    debian_suite: str
    orig_name: str
    orig_sha256: str
    tree_sha256: str
    github_url: str
    snapshot_url: str

    @classmethod
    def load(cls, path: Path = paths.UPSTREAM_LOCK) -> "Pin":
        data = json.loads(Path(path).read_text())
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


def sha256_file(path: Path) -> str:
    # no bar: callers may already show one (rich allows one live display at a time)
    return file_digest(path, "sha256", bar=False)


def tree_digest(root: Path) -> str:
    """Digest of a source tree's content: every regular file's relative path and sha256, and every
    symlink's target, in sorted order. Independent of archive format, compression and mtimes."""
    root = Path(root)
    lines = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]):
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if full.is_symlink():
                lines.append(f"L {rel} {os.readlink(full)}")
            elif full.is_file():
                lines.append(f"F {rel} {sha256_file(full)}")
    lines.sort()
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _safe_members(tar: tarfile.TarFile, dest: Path):
    dest = dest.resolve()
    for m in tar.getmembers():
        target = (dest / m.name).resolve()
        if not str(target).startswith(str(dest) + os.sep) and target != dest:
            raise CometError(f"refusing archive member outside the tree: {m.name}")
        if m.isdev():
            raise CometError(f"refusing device file in archive: {m.name}")
        yield m


def unpack(archive: Path, dest: Path) -> Path:
    """Unpack a tarball into dest and return the tree root (a single top-level folder is stripped)."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(dest, members=_safe_members(tar, dest))
    except (tarfile.TarError, EOFError, OSError, ValueError) as e:
        raise CometError(f"cannot unpack {archive}: {e} (truncated or not a tarball?)") from e
    entries = [p for p in dest.iterdir()]
    if len(entries) == 1 and entries[0].is_dir() and not (dest / "CMakeLists.txt").exists():
        return entries[0]
    return dest


def verify_archive(archive: Path, pin: Pin) -> str:
    """Check an archive against the pin. Returns how it verified; raises CometError when it does not."""
    archive = Path(archive)
    if not archive.is_file():
        raise CometError(f"upstream archive not found: {archive}")
    digest = sha256_file(archive)
    if digest == pin.orig_sha256:
        return "sha256 of the Debian orig tarball"
    with tempfile.TemporaryDirectory(prefix="comet-verify-") as tmp:
        root = unpack(archive, Path(tmp))
        content = tree_digest(root)
    if content == pin.tree_sha256:
        return "content digest of the unpacked tree"
    raise CometError(
        f"{archive} does not match the pinned Caffe {pin.commit[:12]}: sha256 {digest[:16]}..., "
        f"content digest {content[:16]}... (expected {pin.orig_sha256[:16]}... or "
        f"{pin.tree_sha256[:16]}...); refusing to build from it"
    )


def _system_debian_mirror() -> str | None:
    """The Debian mirror the system's apt already uses, so the user's mirror choice wins."""
    candidates = []
    for f in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        try:
            text = f.read_text()
        except OSError:
            continue
        candidates += re.findall(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+/debian)/?\s", text, re.M)
        candidates += re.findall(r"^URIs:\s*(\S+/debian)/?\s*$", text, re.M)
    for c in candidates:
        if "security" not in c:
            return c
    return None


def debian_mirrors(pin: Pin) -> list[str]:
    env = os.environ.get("COMET_DEBIAN_MIRROR")
    mirrors = [env] if env else []
    system = _system_debian_mirror()
    for m in (system, "http://deb.debian.org/debian", "http://archive.debian.org/debian", pin.snapshot_url):
        if m and m not in mirrors:
            mirrors.append(m)
    return mirrors


def fetch_debian(pin: Pin, dest_dir: Path, log) -> Path:
    """`apt-get source --download-only` with a private sources list and state directory, so the system's
    apt configuration is never touched. Only the orig tarball (upstream's source) is used."""
    if not shutil.which("apt-get"):
        raise CometError("apt-get not found")
    errors = []
    for mirror in debian_mirrors(pin):
        with tempfile.TemporaryDirectory(prefix="comet-apt-") as tmp:
            t = Path(tmp)
            for d in ("lists/partial", "cache/archives/partial", "parts", "dl"):
                (t / d).mkdir(parents=True)
            (t / "sources.list").write_text(
                f"deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {mirror} "
                f"{pin.debian_suite} main\n")
            opts = [
                "-o", f"Dir::Etc::SourceList={t}/sources.list", "-o", f"Dir::Etc::SourceParts={t}/parts",
                "-o", f"Dir::State::Lists={t}/lists", "-o", f"Dir::Cache={t}/cache",
                "-o", "Debug::NoLocking=1", "-o", "Acquire::Retries=2",
            ]
            if os.geteuid() == 0:  # root: no _apt user can read our private folders
                opts += ["-o", "APT::Sandbox::User=root"]
            log.write(f"\n== apt-get source from {mirror}\n")
            log.flush()
            up = subprocess.run(["apt-get", *opts, "update"], stdout=log, stderr=subprocess.STDOUT)
            src = subprocess.run(
                ["apt-get", *opts, "source", "--download-only",
                 f"{pin.debian_package}={pin.debian_version}"],
                cwd=t / "dl", stdout=log, stderr=subprocess.STDOUT)
            orig = t / "dl" / pin.orig_name
            if up.returncode == 0 and src.returncode == 0 and orig.is_file():
                dest_dir.mkdir(parents=True, exist_ok=True)
                out = dest_dir / pin.orig_name
                shutil.copyfile(orig, out)
                return out
            errors.append(mirror)
    raise CometError(f"could not fetch Debian source package {pin.debian_package} "
                     f"{pin.debian_version} from: {', '.join(errors)}")


def fetch_url(url: str, out: Path) -> Path:
    """Download `url` to `out` (resumable); obtain() verifies it against the pin afterwards."""
    return fetch(url, out)


def obtain(pin: Pin, upstream: str | None, log) -> tuple[Path, str]:
    """Return a verified archive of the pinned upstream and a line saying where it came from.

    Order: --upstream PATH (only that); the cache; Debian's source package; GitHub's archive."""
    if upstream:
        how = verify_archive(Path(upstream), pin)
        return Path(upstream), f"{upstream} (verified by {how})"
    cache = paths.CACHE_DIR / "downloads"
    cached = cache / pin.orig_name
    if cached.is_file():
        try:
            return cached, f"cache {cached} (verified by {verify_archive(cached, pin)})"
        except CometError as e:
            console.print(f"[yellow]cached upstream archive refused, fetching again: {e}[/]")
            cached.unlink()
    failures = []
    with step("fetch upstream Caffe (Debian source package)"):
        try:
            got = fetch_debian(pin, cache, log)
            return got, f"Debian source package (verified by {verify_archive(got, pin)})"
        except CometError as e:
            failures.append(str(e))
            cached.unlink(missing_ok=True)
    gh = cache / f"caffe-{pin.commit}.tar.gz"
    try:
        fetch_url(pin.github_url, gh)
        return gh, f"{pin.github_url} (verified by {verify_archive(gh, pin)})"
    except CometError as e:
        gh.unlink(missing_ok=True)
        failures.append(str(e))
    raise CometError("no verified upstream source: " + "; ".join(failures)
                     + f". Download {pin.github_url} elsewhere and pass it with --upstream PATH")
