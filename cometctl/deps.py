"""System dependencies: the Debian packages the fork builds against, checked and installed with apt-get."""

from __future__ import annotations

import os
import shutil
import subprocess

from .errors import CometError

# What the fork needs from Debian 12 to build (CPU variant): compilers, upstream Caffe's libraries,
# Python headers for pycaffe, graphviz for pycaffe's draw_net (pydot runs its `dot`), and our own
# needs (zstd for sz/, patch for the series).
BUILD_PACKAGES = [
    "build-essential", "cmake", "ccache", "pkg-config", "patch", "git", "ca-certificates",
    "libboost-system-dev", "libboost-thread-dev", "libboost-filesystem-dev", "libboost-regex-dev",
    "libboost-python-dev", "libgoogle-glog-dev", "libgflags-dev", "libprotobuf-dev",
    "protobuf-compiler", "libhdf5-dev", "liblmdb-dev", "libleveldb-dev", "libsnappy-dev",
    "libopencv-dev", "libopenblas-dev", "python3-dev", "python3-venv", "libzstd-dev",
    "libgtest-dev", "debian-archive-keyring", "graphviz",
]


def missing_packages(packages: list[str]) -> list[str]:
    if not shutil.which("dpkg-query"):
        raise CometError("dpkg-query not found: cometctl build supports Debian and its derivatives")
    r = subprocess.run(["dpkg-query", "-W", "-f=${Package} ${db:Status-Abbrev}\n", *packages],
                       capture_output=True, text=True)
    installed = {line.split()[0] for line in r.stdout.splitlines()
                 if len(line.split()) > 1 and line.split()[1].startswith("ii")}
    return [p for p in packages if p not in installed]


def apt_line(packages: list[str]) -> str:
    return "apt-get install -y --no-install-recommends " + " ".join(packages)


def ensure(packages: list[str], install: bool, log) -> list[str]:
    """Install what is missing when allowed (root, or password-less sudo), else say exactly what to run."""
    missing = missing_packages(packages)
    if not missing:
        return []
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    if not install or (sudo and not shutil.which("sudo")):
        raise CometError(f"missing Debian packages; run: sudo {apt_line(missing)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update"], apt_line(missing).split()):
        r = subprocess.run(sudo + cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        if r.returncode != 0:
            raise CometError(f"'{' '.join(sudo + cmd)}' failed (see {log.name}); "
                             f"run: sudo {apt_line(missing)}")
    still = missing_packages(missing)
    if still:
        raise CometError(f"packages still missing after apt-get: {' '.join(still)}")
    return missing
