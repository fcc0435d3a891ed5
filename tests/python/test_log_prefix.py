"""The fork's tools and pycaffe log in Caffe's classic prefix (I1130 14:09:39.659379 ...), which
upstream's tools/extra parsers read; Debian 12's glog 0.6 would add the year (patch 0016)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import WF_NEEDS_BUILD

CLASSIC = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} ", re.M)
WITH_YEAR = re.compile(r"^[IWEF]\d{8} \d\d:\d\d:\d\d\.\d{6} ", re.M)

NET = """name: "tiny"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } shape { dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def _check(text: str) -> None:
    assert CLASSIC.search(text), text[-2000:]
    assert not WITH_YEAR.search(text), WITH_YEAR.search(text)[0]


@WF_NEEDS_BUILD
def test_caffe_tool_logs_the_classic_prefix(tmp_path):
    from cometctl.paths import tool_path

    net = tmp_path / "net.prototxt"
    net.write_text(NET)
    out = subprocess.run([str(tool_path("caffe")), "time", "-model", str(net), "-iterations", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    _check(out.stderr)
    # glog's own flag still restores the year
    out = subprocess.run([str(tool_path("caffe")), "time", "-model", str(net), "-iterations", "1",
                          "-log_year_in_prefix=true"], capture_output=True, text=True, timeout=120)
    assert WITH_YEAR.search(out.stderr), out.stderr[-2000:]


@WF_NEEDS_BUILD
def test_pycaffe_logs_the_classic_prefix(tmp_path):
    from cometctl.paths import pycaffe_dir

    net = tmp_path / "net.prototxt"
    net.write_text(NET)
    code = f"import caffe; caffe.set_mode_cpu(); caffe.Net({str(net)!r}, caffe.TRAIN)"
    env = dict(os.environ, GLOG_logtostderr="1", GLOG_minloglevel="0",
               PYTHONPATH=str(pycaffe_dir()))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    _check(out.stderr)
