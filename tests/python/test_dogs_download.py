"""The download path of prepare-dogs against a local HTTP server (with Range support) and file:// URLs."""

from __future__ import annotations

import hashlib
import http.server
import re
import socket
import threading

import pytest

from cometctl import dogs
from cometctl.download import fetch, verify_md5
from cometctl.errors import CometError


class _Handler(http.server.BaseHTTPRequestHandler):
    files: dict[str, bytes] = {}
    ranges: list[str] = []

    def log_message(self, *args):  # keep pytest's output clean
        pass

    def do_GET(self):
        data = self.files.get(self.path.rsplit("/", 1)[-1])
        if data is None:
            self.send_error(404)
            return
        start = 0
        rng = self.headers.get("Range")
        if rng:
            self.ranges.append(rng)
            start = int(re.match(r"bytes=(\d+)-", rng).group(1))
            if start >= len(data):
                self.send_response(416)
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        self.wfile.write(data[start:])


@pytest.fixture
def server():
    _Handler.files = {}
    _Handler.ranges = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/", _Handler
    httpd.shutdown()
    httpd.server_close()
    t.join()


def test_download_resumes_a_partial_file_and_checks_md5(tmp_path, server):
    url, handler = server
    payload = bytes(range(256)) * 4096  # 1 MiB
    handler.files["images.tar"] = payload
    md5 = hashlib.md5(payload).hexdigest()
    (tmp_path / "images.tar.part").write_bytes(payload[:300_000])
    got = fetch(url + "images.tar", tmp_path / "images.tar", md5=md5)
    assert got.read_bytes() == payload
    assert handler.ranges == ["bytes=300000-"]
    assert not (tmp_path / "images.tar.part").exists()
    # a second call uses the file on disk without asking the server
    handler.files.clear()
    assert fetch(url + "images.tar", tmp_path / "images.tar", md5=md5) == got


def test_wrong_checksum_keeps_the_data_and_says_so(tmp_path, server):
    url, handler = server
    handler.files["lists.tar"] = b"x" * 5000
    with pytest.raises(CometError, match="wrong checksum") as e:
        fetch(url + "lists.tar", tmp_path / "lists.tar", md5="0" * 32)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "lists.tar").exists()
    assert (tmp_path / "lists.tar.bad-checksum").read_bytes() == b"x" * 5000
    (tmp_path / "other").write_bytes(b"y")
    with pytest.raises(CometError, match="wrong checksum"):
        verify_md5(tmp_path / "other", "0" * 32)


def test_file_url_and_missing_file(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"abc" * 1000)
    out = fetch(src.as_uri(), tmp_path / "dest.bin", md5=hashlib.md5(src.read_bytes()).hexdigest())
    assert out.read_bytes() == src.read_bytes()
    with pytest.raises(CometError, match="cannot download"):
        fetch((tmp_path / "absent.bin").as_uri(), tmp_path / "x.bin")


def test_http_error_is_one_clear_line(tmp_path, server):
    url, _ = server
    with pytest.raises(CometError, match="HTTP 404"):
        fetch(url + "images.tar", tmp_path / "images.tar")


def test_offline_machine_is_told_which_files_to_fetch(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(CometError) as e:
        dogs.prepare_dogs(tmp_path, url=f"http://127.0.0.1:{port}/")
    msg = str(e.value)
    assert "images.tar" in msg and "lists.tar" in msg and dogs.HOME_PAGE in msg and "--archive" in msg


def test_prepare_downloads_both_archives_with_the_published_checksums(tmp_path, server, monkeypatch,
                                                                      wf_synthetic_archives, wf_pb2):
    url, handler = server
    images, lists = wf_synthetic_archives
    handler.files["images.tar"] = images.read_bytes()
    handler.files["lists.tar"] = lists.read_bytes()
    # the real checksums would refuse our stand-ins: pin theirs for this test
    monkeypatch.setattr(dogs, "ARCHIVES", {"images.tar": hashlib.md5(images.read_bytes()).hexdigest(),
                                           "lists.tar": hashlib.md5(lists.read_bytes()).hexdigest()})
    r = dogs.prepare_dogs(tmp_path, url=url, size=16, jobs=1)
    assert (r.train, r.val, r.split) == (400, 200, "official")
    assert (tmp_path / "images.tar").read_bytes() == images.read_bytes()


def test_real_checksums_are_pinned():
    assert dogs.ARCHIVES == {"images.tar": "1bb1f2a596ae7057f99d7d75860002ef",
                             "lists.tar": "edbb9f16854ec66506b5f09b583e0656"}


def test_full_archives_on_disk_are_compared_with_the_published_checksums(tmp_path, monkeypatch, capsys,
                                                                         wf_synthetic_archives, wf_pb2):
    images, lists = wf_synthetic_archives
    monkeypatch.setattr(dogs, "FULL_CLASSES", 10)  # let the 10-class stand-in pass for the full dataset
    r = dogs.prepare_dogs(tmp_path / "a", archive=images, lists=lists, size=16, jobs=1)
    assert r.train == 400
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "is not the published images.tar" in err and "is not the published lists.tar" in err
    monkeypatch.setattr(dogs, "ARCHIVES", {"images.tar": hashlib.md5(images.read_bytes()).hexdigest(),
                                           "lists.tar": hashlib.md5(lists.read_bytes()).hexdigest()})
    dogs.prepare_dogs(tmp_path / "b", archive=images, lists=lists, size=16, jobs=1)
    assert "not the published" not in capsys.readouterr().err
