"""Reading `caffe train` logs, line by line: the live view of `cometctl train` and the CSVs of `report`.

The train and test tables have the columns of upstream's tools/extra/parse_log.py (NumIters, Seconds,
LearningRate, then one column per net output such as loss or accuracy). COMET's statistics lines,

    COMET conv2: ratio 14.2x, eb 3.1e-03, 4.1 ms
    COMET total: ratio 9.8x, 812.0 MB -> 82.9 MB, 31.0 ms

are read tolerantly: after "COMET <layer>:" come items separated by commas, semicolons or parentheses, each "<key> <number>[unit]",
"<number> <unit>" or "<size> -> <size>". Sizes become MiB (columns ending in _mb), times milliseconds
(columns ending in _ms), "x" marks a ratio. Unknown items are kept under their own key; items without a
number are ignored. A glog prefix before any line is fine.

One log may hold several sessions of the same run: `cometctl train` appends a resumed run to its
caffe.log after a marker line (`resume_marker`). What the earlier session logged at or after the
iteration the run resumed from is dropped (the resumed session logs it again), and Seconds go on from
where the earlier session stopped instead of counting the time in between.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta

GLOG = re.compile(r"^[IWEF](\d{4})?(\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})\.(\d+)")  # glog >= 0.6 adds the year
ITERATION = re.compile(r"Iteration (\d+)")
LR = re.compile(r"Iteration (\d+), lr = ([-+]?[\d.]+(?:[eE][-+]?\d+)?)")
NET_OUTPUT = re.compile(r"(Train|Test) net output #(\d+): (\S+) = ([-+]?(?:[\d.]+(?:[eE][-+]?\d+)?|nan|inf))",
                        re.IGNORECASE)
TESTING = re.compile(r"Iteration (\d+), Testing net \(#(\d+)\)")
SNAPSHOT = re.compile(r"Snapshotting (?:solver state )?to (?:binary proto|HDF5) file (\S+)")
COMET = re.compile(r"\bCOMET\s+([^:]+?)\s*:\s*(.*)$")
NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
ITEM = re.compile(rf"^(?:(?P<key>[A-Za-z_][\w ./-]*?)\s*[:=]?\s*)?(?P<num>{NUMBER})\s*(?P<unit>[A-Za-z%]*)$")
PAIR = re.compile(rf"^(?:(?P<key>[A-Za-z_][\w ./-]*?)\s*[:=]?\s*)?(?P<a>{NUMBER})\s*(?P<ua>[A-Za-z]*)\s*->\s*"
                  rf"(?P<b>{NUMBER})\s*(?P<ub>[A-Za-z]*)$")
SIZE_UNITS = {"b": 1 / 2**20, "kb": 1 / 1024, "kib": 1 / 1024, "mb": 1.0, "mib": 1.0, "gb": 1024.0,
              "gib": 1024.0, "tb": 2**20, "tib": 2**20}
TIME_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "sec": 1e3}
RESUMED = re.compile(r"^cometctl: resuming from (.+) at iteration (\d+)\s*$")


def resume_marker(state, iteration: int | None) -> str:
    """The line `cometctl train` writes into caffe.log before the output of a resumed session."""
    return f"cometctl: resuming from {state} at iteration {iteration if iteration is not None else 0}"


def _key(text: str) -> str:
    return re.sub(r"\W+", "_", text.strip().lower()).strip("_")


def parse_comet_items(rest: str) -> dict[str, float]:
    """"ratio 14.2x, eb 3.1e-03, 4.1 ms" -> {"ratio": 14.2, "eb": 0.0031, "time_ms": 4.1}."""
    out: dict[str, float] = {}
    # parentheses group items ("... -> 82.9 MB (9.8x), peak memory 1.2 GB (weights 230 MB, ...)"):
    # read what is inside as items of their own
    for item in re.split(r"\s*[,;()]\s*", rest.strip()):
        item = item.strip().rstrip(".")
        if not item:
            continue
        m = PAIR.match(item)
        if m:
            base = _key(m["key"]) if m["key"] else "mem"
            for suffix, num, unit in (("before", m["a"], m["ua"] or m["ub"]), ("after", m["b"], m["ub"])):
                factor = SIZE_UNITS.get(unit.lower())
                if factor is not None:
                    out[f"{base}_{suffix}_mb"] = float(num) * factor
                else:
                    out[f"{base}_{suffix}"] = float(num)
            continue
        m = ITEM.match(item)
        if not m:
            continue
        key, value, unit = (_key(m["key"]) if m["key"] else ""), float(m["num"]), m["unit"].lower()
        if unit == "x":
            out[key or "ratio"] = value
        elif unit in SIZE_UNITS:
            out[(key + "_mb") if key else "mem_mb"] = value * SIZE_UNITS[unit]
        elif unit in TIME_UNITS:
            out[(key + "_ms") if key and key != "time" else "time_ms"] = value * TIME_UNITS[unit]
        elif unit == "%":
            out[(key or "percent") + "_pct"] = value
        elif key:
            out[key if not unit else f"{key}_{unit}"] = value
    return out


@dataclass
class Event:
    kind: str  # "train" | "test" | "lr" | "comet" | "warning" | "snapshot" | "fatal" | "done" | "resumed"
    iteration: int
    values: dict = field(default_factory=dict)
    text: str = ""


class LogParser:
    """Feed it lines; it keeps the tables and returns the events each line produced."""

    def __init__(self):
        self.iteration = -1
        self.lr = math.nan
        self.start: datetime | None = None
        self.last: datetime | None = None
        self.seconds = 0.0
        self._year_offset = 0
        self.train: dict[int, dict] = {}
        self.test: dict[int, dict] = {}
        self.test_net = 0  # the test net whose outputs follow ("Testing net (#1)")
        self.comet: list[dict] = []
        self.snapshots: list[str] = []
        self.fatal: list[str] = []
        self.warnings: list[str] = []  # the store's (COMET) warnings, without glog's prefix
        self.started = False  # caffe logged an iteration in the current session
        self._elapsed_before = 0.0  # seconds of the earlier sessions of a resumed run

    def _time(self, line: str) -> None:
        m = GLOG.match(line)
        if not m:
            return
        year, mo, d, h, mi, s, frac = m.groups()
        try:
            t = datetime(int(year) if year else 2000 + self._year_offset, int(mo), int(d), int(h), int(mi),
                         int(s), int(frac[:6].ljust(6, "0")))
        except ValueError:
            return
        if not year and self.last is not None and t < self.last - timedelta(days=1):  # crossed new year
            self._year_offset += 1
            t = t.replace(year=t.year + 1)
        if self.start is None:
            self.start = t
        self.last = t
        self.seconds = self._elapsed_before + (t - self.start).total_seconds()

    def _resumed(self, iteration: int) -> None:
        """A new session that goes on from `iteration`: forget what came at or after it."""
        self.train = {k: v for k, v in self.train.items() if k < iteration}
        self.test = {k: v for k, v in self.test.items() if k < iteration}
        self.comet = [r for r in self.comet if r["NumIters"] < iteration]
        self._elapsed_before = self.seconds
        self.start = None
        self.iteration = iteration
        self.started = False

    def _row(self, table: dict, iteration: int) -> dict:
        row = table.get(iteration)
        if row is None:
            row = table[iteration] = {"NumIters": iteration, "Seconds": self.seconds, "LearningRate": self.lr}
        return row

    def feed(self, line: str) -> list[Event]:
        line = line.rstrip("\n")
        m = RESUMED.match(line)
        if m:
            self._resumed(int(m[2]))
            return [Event("resumed", int(m[2]), text=m[1])]
        self._time(line)
        events: list[Event] = []
        m = LR.search(line)
        if m:
            it, self.lr = int(m[1]), float(m[2])
            if it in self.train:
                self.train[it]["LearningRate"] = self.lr
            events.append(Event("lr", it, {"lr": self.lr}))
        m = ITERATION.search(line)
        if m:
            self.iteration = int(m[1])
            self.started = True
        m = TESTING.search(line)
        if m:
            self.test_net = int(m[2])
        m = NET_OUTPUT.search(line)
        if m and self.iteration >= 0:
            test = m[1].lower() == "test"
            table = self.test if test else self.train
            # a solver's second and later test nets print the same output names: "accuracy #1"
            name = f"{m[3]} #{self.test_net}" if test and self.test_net else m[3]
            row = self._row(table, self.iteration)
            row[name] = float(m[4])
            events.append(Event(m[1].lower(), self.iteration, {name: float(m[4])}))
        m = COMET.search(line)
        if m and m[1].strip().lower() != "plan":  # "COMET plan: blob x -> ..." describes, not measures
            values = parse_comet_items(m[2])
            if values:
                row = {"NumIters": max(self.iteration, 0), "Seconds": self.seconds, "layer": m[1].strip()}
                row.update(values)
                self.comet.append(row)
                events.append(Event("comet", row["NumIters"], values, m[1].strip()))
        m = SNAPSHOT.search(line)
        if m:
            self.snapshots.append(m[1])
            events.append(Event("snapshot", self.iteration, text=m[1]))
        if line.startswith("W") and GLOG.match(line) and "] COMET" in line:
            # the store's warnings (a fixed bound estimated far off, a blob of NaN kept dense, a
            # missing .cometstate): few by design, and what a user should see without the log
            text = line.split("] ", 1)[1].strip()
            self.warnings.append(text)
            events.append(Event("warning", self.iteration, text=text))
        if line.startswith("F") and GLOG.match(line) or "Check failed" in line:
            self.fatal.append(line)
            events.append(Event("fatal", self.iteration, text=line))
        if "Optimization Done" in line:
            events.append(Event("done", self.iteration))
        return events

    # tables ---------------------------------------------------------------------------------------------
    @staticmethod
    def _rows(table: dict) -> list[dict]:
        rows = [table[k] for k in sorted(table)]
        # Caffe prints the first learning rate after the first outputs: take it from the next row
        if len(rows) > 1 and math.isnan(rows[0]["LearningRate"]):
            rows[0]["LearningRate"] = rows[1]["LearningRate"]
        return rows

    def train_rows(self) -> list[dict]:
        return self._rows(self.train)

    def test_rows(self) -> list[dict]:
        return self._rows(self.test)


def parse_file(path) -> LogParser:
    p = LogParser()
    with open(path, errors="replace") as f:
        for line in f:
            p.feed(line)
    return p


STACK_LINE = re.compile(r"^\s*(@\s+0x|\*\*\*|PC: @|terminate called after throwing)")
PY_ERROR = re.compile(r"^\w+(\.\w+)*(Error|Exception|Exit): ")


def why_it_stopped(parser: LogParser, tail: list[str]) -> str:
    """The first fatal line caffe printed, without glog's prefix; else the last Python error (a Python
    layer's, e.g. "ModuleNotFoundError: ..."); else its last line that is not part of a stack trace."""
    said = [t for t in tail if t.strip() and not STACK_LINE.match(t)]
    lines = parser.fatal or [t for t in said if PY_ERROR.match(t.strip())][-1:] or said[-1:]
    if not lines:
        return "it printed nothing"
    text = lines[0].strip()
    m = GLOG.match(text)
    if m:
        text = text[m.end():].split("] ", 1)[-1]
    return text
