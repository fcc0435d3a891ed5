"""gpu_plan_check.py - `cometctl plan --gpu` itself on the lent GPU machine (gpu-check's plan-cometctl step).

scripts/gpu-bundle ships it as gpu-check/python/plan_check.py beside cometctl's source, the fork's
caffe_pb2 and comet_pb2, and the pure-Python protobuf runtime, so that the GPU machine's own Python
(3.12, with none of the project's packages) can run the planner's code, not a copy of its method:

    PYTHONPATH=gpu-check/python PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python \
    COMET_CAFFE_PB2=gpu-check/python python3 gpu-check/python/plan_check.py \
        --solver S --caffe gpu-check/bin/caffe --gpu 0 --measure 16,32 --batch 256 [--json FILE]

It measures the solver's net at the --measure batches, COMET off and on (nvidia-smi's peaks, as
`cometctl plan --gpu` does), predicts --batch, runs --batch off and on to check, and prints one line
per mode. Exit status: 0 when both predictions are within --tolerance (5%) of the measured peaks and
the peaks were measured (not the store's bytes), 1 when not, 2 when the plan could not be made.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--solver", required=True)
    ap.add_argument("--caffe", required=True, help="the caffe binary (the bundle's wrapper)")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--measure", default="16,32", help="batch sizes to fit, comma-separated")
    ap.add_argument("--batch", type=int, required=True, help="the batch size to predict and check")
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--json", help="also write the plan's JSON document here")
    ap.add_argument("--synthetic-input", action="store_true",
                    help="DummyData of the data layers' shapes (as `cometctl plan --synthetic-input`)")
    args = ap.parse_args(argv)

    try:
        from cometctl.errors import CometError
        from cometctl.plan import make_plan, render
    except ImportError as e:
        print(f"plan-cometctl: error: cannot import cometctl's planner here ({e})")
        return 2
    try:
        plan = make_plan(args.solver, gpu=args.gpu, check=[args.batch], caffe_bin=args.caffe,
                         synthetic=args.synthetic_input,
                         measure_batches=tuple(int(b) for b in args.measure.split(",")),
                         progress=lambda text: print(f"plan-cometctl: measuring {text}", flush=True))
    except CometError as e:
        print(f"plan-cometctl: error: {e}")
        return 2
    for line in render(plan):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan, f, indent=1, default=str)
    ok = bool(plan.get("measured"))
    if not ok:
        print(f"plan-cometctl: error: the peaks were not measured ({plan.get('figure')})")
    for check in plan["checks"]:
        within = abs(check["error"]) <= args.tolerance
        ok = ok and within
        print(f"plan-cometctl: COMET {check['comet']} at batch {check['batch']}: predicted "
              f"{check['predicted_bytes'] / 2**20:.0f} MiB, measured {check['measured_bytes'] / 2**20:.0f} MiB "
              f"({100 * check['error']:+.1f}%){'' if within else ' OUT OF TOLERANCE'}")
    if len(plan["checks"]) != 2:
        print(f"plan-cometctl: error: expected 2 checks (COMET off and on), got {len(plan['checks'])}")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
