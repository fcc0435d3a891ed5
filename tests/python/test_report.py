"""report: log -> CSV (parse_log.py's columns) and PNG plots, with and without COMET lines, --compare."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from cometctl.caffelog import LogParser, parse_comet_items
from cometctl.cli import main
from cometctl.errors import CometError
from cometctl.report import report

PNG = b"\x89PNG\r\n\x1a\n"


def fake_log(comet: bool = True, loss0: float = 2.3) -> str:
    """A log in the shape `caffe train` writes (glog prefixes, solver.cpp messages)."""
    lines = ["I1130 10:00:00.000000  4242 caffe.cpp:218] Using CPUs.",
             "I1130 10:00:00.500000  4242 solver.cpp:330] Iteration 0, Testing net (#0)",
             "I1130 10:00:01.000000  4242 solver.cpp:397]     Test net output #0: accuracy = 0.1",
             "I1130 10:00:01.000000  4242 solver.cpp:397]     Test net output #1: loss = 2.30259 (* 1 = 2.30259 loss)"]
    t = 1.0
    for it in range(0, 40, 10):
        t += 2.0
        loss = loss0 / (1 + it / 10)
        lines += [f"I1130 10:00:{t:09.6f}  4242 solver.cpp:218] Iteration {it} (5 iter/s, 2s/10 iters), loss = {loss}",
                  f"I1130 10:00:{t:09.6f}  4242 solver.cpp:237]     Train net output #0: loss = {loss} (* 1 = {loss} loss)",
                  f"I1130 10:00:{t:09.6f}  4242 sgd_solver.cpp:105] Iteration {it}, lr = {0.01 * 0.5 ** (it // 10)}"]
        if comet and it:
            lines += [f"I1130 10:00:{t:09.6f}  4242 comet.cpp:99] COMET conv1: ratio {10 + it / 10:.1f}x, eb 1.0e-03, 2.5 ms",
                      f"I1130 10:00:{t:09.6f}  4242 comet.cpp:99] COMET conv2: ratio {14 + it / 10:.1f}x, eb 3.1e-03, 4.1 ms",
                      f"I1130 10:00:{t:09.6f}  4242 comet.cpp:99] COMET total: ratio 9.8x, 812.0 MB -> 82.9 MB, 6.6 ms"]
        if it == 20:
            lines += ["I1130 10:00:08.000000  4242 solver.cpp:330] Iteration 20, Testing net (#0)",
                      "I1130 10:00:08.500000  4242 solver.cpp:397]     Test net output #0: accuracy = 0.55",
                      "I1130 10:00:08.500000  4242 solver.cpp:397]     Test net output #1: loss = 1.2 (* 1 = 1.2 loss)"]
    lines.append("I1130 10:00:12.000000  4242 solver.cpp:464] Snapshotting to binary proto file /r/s_iter_40.caffemodel")
    lines.append("I1130 10:00:12.000000  4242 caffe.cpp:259] Optimization Done.")
    return "\n".join(lines) + "\n"


def _csv(path: Path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_parser_tables_have_parse_log_columns():
    p = LogParser()
    for line in fake_log().splitlines():
        p.feed(line)
    train, test = p.train_rows(), p.test_rows()
    assert [r["NumIters"] for r in train] == [0, 10, 20, 30]
    assert list(train[0]) == ["NumIters", "Seconds", "LearningRate", "loss"]
    assert train[1]["Seconds"] == pytest.approx(5.0)
    assert [r["LearningRate"] for r in train] == [0.01, 0.005, 0.0025, 0.00125]  # each row its own lr
    assert [r["NumIters"] for r in test] == [0, 20]
    assert test[1]["accuracy"] == 0.55 and test[1]["loss"] == 1.2
    assert not math.isnan(test[0]["LearningRate"])
    assert p.snapshots == ["/r/s_iter_40.caffemodel"]
    assert {r["layer"] for r in p.comet} == {"conv1", "conv2", "total"}


def test_a_solvers_second_test_net_keeps_its_own_columns():
    """Each test net prints 'Test net output #0: accuracy' (upstream's lenet_consolidated_solver tests on the
    test set and on the train set): the second overwrote the first, so the train set's accuracy was shown
    as the test accuracy."""
    p = LogParser()
    log = ["I1130 10:00:00.000000  4242 solver.cpp:218] Iteration 0 (0 iter/s), loss = 2.3",
           "I1130 10:00:00.000000  4242 solver.cpp:237]     Train net output #0: loss = 2.3 (* 1 = 2.3 loss)",
           "I1130 10:00:01.000000  4242 solver.cpp:330] Iteration 10, Testing net (#0)",
           "I1130 10:00:01.000000  4242 solver.cpp:397]     Test net output #0: accuracy = 0.4",
           "I1130 10:00:02.000000  4242 solver.cpp:330] Iteration 10, Testing net (#1)",
           "I1130 10:00:02.000000  4242 solver.cpp:397]     Test net output #0: accuracy = 0.9",
           "I1130 10:00:02.000000  4242 solver.cpp:397]     Test net output #1: loss = 0.3 (* 1 = 0.3 loss)",
           "I1130 10:00:03.000000  4242 solver.cpp:218] Iteration 10 (10 iter/s), loss = 1.1",
           "I1130 10:00:03.000000  4242 solver.cpp:237]     Train net output #0: loss = 1.1 (* 1 = 1.1 loss)"]
    events = [e for line in log for e in p.feed(line)]
    test = p.test_rows()
    assert len(test) == 1 and test[0]["accuracy"] == 0.4 and test[0]["accuracy #1"] == 0.9
    assert test[0]["loss #1"] == 0.3 and "loss" not in test[0]
    assert [r["loss"] for r in p.train_rows()] == [2.3, 1.1]
    assert [e.values for e in events if e.kind == "test"] == [{"accuracy": 0.4}, {"accuracy #1": 0.9},
                                                             {"loss #1": 0.3}]


def test_comet_lines_are_read_tolerantly():
    assert parse_comet_items("ratio 14.2x, eb 3.1e-03, 4.1 ms") == {"ratio": 14.2, "eb": 3.1e-3, "time_ms": 4.1}
    got = parse_comet_items("ratio 9.8x, 812.0 MB -> 82.9 MB, peak 1.5 GiB; time=500us, zeros 61%")
    assert got == {"ratio": 9.8, "mem_before_mb": 812.0, "mem_after_mb": 82.9, "peak_mb": 1536.0,
                   "time_ms": 0.5, "zeros_pct": 61.0}
    assert parse_comet_items("compression on, nothing numeric") == {}
    # the lines the fork's activation store prints (caffe/src/caffe/comet/store.cpp)
    assert parse_comet_items("ratio 32.0x, mask, 0.1 ms") == {"ratio": 32.0, "time_ms": 0.1}
    total = parse_comet_items("activations 812.0 MB -> 82.9 MB (9.8x), peak memory 1.25 GB (weights 230.0 MB, "
                              "activations 400.0 MB, gradients 300.0 MB, compressed 80.0 MB, scratch 512.0 KB)")
    assert total == {"activations_before_mb": 812.0, "activations_after_mb": 82.9, "ratio": 9.8,
                     "peak_memory_mb": 1280.0, "weights_mb": 230.0, "activations_mb": 400.0,
                     "gradients_mb": 300.0, "compressed_mb": 80.0, "scratch_mb": 0.5}
    p = LogParser()
    assert p.feed("COMET pool1:ratio: 3x") and p.comet[0] == {"NumIters": 0, "Seconds": 0.0, "layer": "pool1",
                                                            "ratio": 3.0}
    assert p.feed("COMET: no layer, no numbers") == []
    assert p.feed("  COMET plan: blob conv1 -> LOSSY after pool1 forward, for conv2") == []
    # the store's warnings become events of their own, without glog's prefix; other warnings do not
    w = "W1207 08:12:54.346052 13493 bounds.cpp:338] COMET: layer conv9's fixed error bound 0.001 puts ..."
    assert [(e.kind, e.text) for e in p.feed(w)] == [
        ("warning", "COMET: layer conv9's fixed error bound 0.001 puts ...")]
    assert p.feed("W1207 08:12:54.346052 13493 net.cpp:10] a warning of Caffe's own") == []
    assert p.feed("I1207 08:12:54.346052 13493 bounds.cpp:322] COMET: layer fc8's fixed error bound") == []
    assert p.warnings == ["COMET: layer conv9's fixed error bound 0.001 puts ..."]


def test_report_writes_csvs_and_plots(tmp_path):
    (tmp_path / "caffe.log").write_text(fake_log())
    written = report(tmp_path)
    out = tmp_path / "report"
    names = {p.name for p in written}
    assert {"train.csv", "test.csv", "comet.csv", "loss.png", "accuracy.png", "comet_ratio.png", "comet_eb.png",
            "comet_memory.png", "comet_time.png"} <= names
    train = _csv(out / "train.csv")
    assert list(train[0]) == ["NumIters", "Seconds", "LearningRate", "loss"]
    assert float(train[-1]["loss"]) < float(train[0]["loss"])
    test = _csv(out / "test.csv")
    assert list(test[0])[:3] == ["NumIters", "Seconds", "LearningRate"] and test[1]["accuracy"] == "0.55"
    comet = _csv(out / "comet.csv")
    assert list(comet[0])[:3] == ["NumIters", "Seconds", "layer"]
    assert {r["layer"] for r in comet} == {"conv1", "conv2", "total"}
    assert [float(r["ratio"]) for r in comet if r["layer"] == "conv2"] == [15.0, 16.0, 17.0]
    for name in names:
        if name.endswith(".png"):
            assert (out / name).read_bytes()[:8] == PNG
    from cometctl.report import _Run, summary

    lines = summary(_Run(tmp_path))
    assert lines[0].startswith("last train iteration 30: loss 0.575")
    assert lines[1] == "last test at iteration 20: accuracy 0.55, loss 1.2"
    assert "  conv2: ratio 17.0x, eb 3.10e-03, 4.1 ms" in lines
    assert "  total: ratio 9.8x, 6.6 ms" in lines


STORE_CSV = ("iter,layer,blob,kind,ratio,eb,ms,dense_bytes,stored_bytes,peak_bytes,weights_bytes,"
             "activations_bytes,gradients_bytes,compressed_bytes,scratch_bytes,buffers_dense_bytes,"
             "buffers_stored_bytes\n"
             "10,conv2,pool1,lossy,4.89343,0.00312,4.25,1605632,328120,,,,,,,,\n"
             "10,relu1,conv1,mask,32,0,3,6422528,200704,,,,,,,,\n"
             "10,total,,total,9.87654,,,8028160,528824,9437184,1048576,6291456,1048576,524288,524288,"
             "2097152,131072\n")


def test_a_run_with_the_stores_csv_reports_its_exact_figures(tmp_path):
    """The store's <prefix>_comet.csv in snapshots/ is what report reads for COMET (the log's lines are
    rounded); the log still gives each iteration's time and the lines the file does not hold."""
    (tmp_path / "caffe.log").write_text(fake_log().replace(
        "COMET total: ratio 9.8x", "COMET memory pool: reused 4, allocated 22, returned 5, cached 9.2 MB\n"
        "I1130 10:00:05.000000  4242 comet.cpp:99] COMET total: ratio 9.8x"))
    (tmp_path / "snapshots").mkdir()
    (tmp_path / "snapshots" / "m_comet.csv").write_text(STORE_CSV)
    report(tmp_path)
    rows = _csv(tmp_path / "report" / "comet.csv")
    conv2 = [r for r in rows if r["layer"] == "conv2"]
    assert [(r["NumIters"], float(r["ratio"]), float(r["eb"]), float(r["time_ms"])) for r in conv2] == \
        [("10", 4.89343, 0.00312, 4.25)]  # the file's, not the log's three rounded lines
    assert float(conv2[0]["Seconds"]) == pytest.approx(5.0)  # iteration 10's time, from the log
    (total,) = [r for r in rows if r["layer"] == "total"]
    assert float(total["ratio"]) == 9.87654
    assert float(total["activations_before_mb"]) * 2**20 == 8028160
    assert float(total["layer_buffers_before_mb"]) == 2.0 and float(total["layer_buffers_after_mb"]) == 0.125
    assert float(total["peak_memory_mb"]) == 9.0
    assert any(r["layer"] == "memory pool" for r in rows)  # only the log has it
    assert (tmp_path / "report" / "comet_memory.png").read_bytes()[:8] == PNG


def test_log_without_comet_lines_plots_only_what_exists(tmp_path):
    (tmp_path / "caffe.log").write_text(fake_log(comet=False))
    names = {p.name for p in report(tmp_path)}
    assert names == {"train.csv", "test.csv", "loss.png", "accuracy.png"}
    assert not list((tmp_path / "report").glob("comet*"))


def test_compare_draws_two_runs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "caffe.log").write_text(fake_log(comet=True))
    (b / "caffe.log").write_text(fake_log(comet=False, loss0=3.0))
    r = CliRunner().invoke(main, ["report", str(a), "--compare", str(b)])
    assert r.exit_code == 0, r.output
    plots = a / "report" / "compare-b"
    assert (plots / "loss.png").read_bytes()[:8] == PNG
    assert (plots / "comet_ratio.png").exists()  # a's COMET figures still drawn


def test_errors(tmp_path):
    r = CliRunner().invoke(main, ["report", str(tmp_path / "nope")])
    assert r.exit_code != 0 and "no such run folder" in r.output and "Traceback" not in r.output
    with pytest.raises(CometError, match="no caffe.log"):
        report(tmp_path)
    (tmp_path / "caffe.log").write_text("I1130 10:00:00.000000 1 caffe.cpp:1] starting\n")
    with pytest.raises(CometError, match="no training iterations"):
        report(tmp_path)


def test_report_of_a_real_run(wf_short_run):
    written = {p.name for p in report(wf_short_run)}
    assert {"train.csv", "test.csv", "loss.png", "accuracy.png"} <= written
    train = _csv(wf_short_run / "report" / "train.csv")
    assert list(train[0])[:4] == ["NumIters", "Seconds", "LearningRate", "loss"]
    assert [int(float(r["NumIters"])) for r in train][:3] == [0, 5, 10]
    test = _csv(wf_short_run / "report" / "test.csv")
    assert {"accuracy", "loss"} <= set(test[0])
    assert [int(float(r["NumIters"])) for r in test] == [0, 15, 30]


def test_without_a_run_folder_the_latest_run_is_reported(tmp_path, monkeypatch):
    import os

    from cometctl import report as rep

    runs = tmp_path / "runs"
    for i, name in enumerate(["20260101-000000-a", "20260102-000000-b"]):
        (runs / name).mkdir(parents=True)
        (runs / name / "caffe.log").write_text(fake_log())
        os.utime(runs / name / "caffe.log", (1000 + i, 1000 + i))
    assert rep.latest_run(runs) == runs / "20260102-000000-b"
    with pytest.raises(CometError, match="no runs"):
        rep.latest_run(tmp_path / "empty")


def test_report_of_a_real_comet_run(tmp_path, wf_pb2, wf_synthetic):
    """comet_tiny with the solver's commented comet block switched on: the fork's own COMET lines."""
    from conftest import WF_REPO as REPO, WF_BUILT, wf_point_model_at

    from cometctl.caffeproto import read_text_proto, write_text_proto
    from cometctl.train import train

    if not WF_BUILT:
        pytest.skip("the Caffe build is absent: run `cometctl build` (CI always builds it first)")
    if "comet" not in wf_pb2.SolverParameter.DESCRIPTOR.fields_by_name:
        pytest.skip("this build's caffe.proto has no COMET settings")
    solver = wf_point_model_at(wf_pb2, REPO / "models" / "comet_tiny", wf_synthetic, tmp_path / "m",
                               display=5, test_interval=20, snapshot=0)
    param = read_text_proto(solver, wf_pb2.SolverParameter())
    param.comet.error_bound = 1e-3
    write_text_proto(solver, param)
    assert train(solver, cpu=True, iters=20, run_dir=tmp_path / "run") == 0
    names = {p.name for p in report(tmp_path / "run")}
    assert {"comet.csv", "comet_ratio.png", "comet_eb.png", "comet_memory.png"} <= names
    rows = _csv(tmp_path / "run" / "report" / "comet.csv")
    layers = {r["layer"] for r in rows}
    assert {"conv2", "conv3", "total"} <= layers
    total = [r for r in rows if r["layer"] == "total"]
    assert all(float(r["ratio"]) > 1 for r in total)
    assert all(float(r["activations_after_mb"]) < float(r["activations_before_mb"]) for r in total)
    assert all(0 < float(r["eb"]) <= 0.1 for r in rows if r["layer"] == "conv2")
    # the figures are the store's own file's, unrounded
    from cometctl import cometstats

    store = cometstats.read(cometstats.find(tmp_path / "run"))
    assert [float(r["ratio"]) for r in rows if r["layer"] == "conv2"] == \
        [r["ratio"] for r in store if r["layer"] == "conv2"]
    assert any(r["layer"] == "total" and "buffers_dense_bytes" in r for r in store)
