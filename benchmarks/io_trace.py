"""What of ``run()``'s per-call work costs time on a real-size model (issue 11: layernorm [512, 768] through
``run()`` was 1.2-1.3x the VM call, +20-30 us that run()'s own steps, 4-6 us, do not explain).

    python benchmarks/io_trace.py                    # -> benchmarks/io_trace.json

One process, one compile; paths timed in blocks of back-to-back calls, interleaved round by round (the
order rotated), each round's block of every path divided by the same round's block of the VM call on
DLPack views of the very numpy input ``run()`` gets (paired ratios: the machine's load cancels in them).
Paths, each adding one of run()'s differences to that VM call: a fresh DLPack import of the input per call
(run() imports its feeds each call), a numpy view of the result per call (run() returns views), the result
kept until the next call (a caller keeps run()'s output; the VM keeps its last result either way), and
``run()`` itself, dropped and kept; ``run_general``: what run() did before its short path for one fresh
output and its reuse of an input array's DLPack view (a fresh import, the plan's checks, ``_finish``).  Report: per path, median us per call and the median, p25 and p75 of
its per-round ratios.  Run it alone: under load the ratios' spread is wider than the differences sought.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M

from io_overhead import _block  # noqa: E402  (same directory: run as a script)

HERE = os.path.dirname(os.path.abspath(__file__))


def paths(cm, x) -> dict:
    name = cm.inputs[0].name
    feeds = {name: x}
    f = cm._main()
    view = C.from_dlpack(x)
    keep = [None]
    plan = cm._io_plan()

    def general():        # run() before its short path: a fresh import, the plan's checks, _finish
        args = [C.from_dlpack(x)]
        plan.in_place(feeds)
        return cm._finish(f(*args), None, args)

    return {
        "vm_views": lambda: f(view),
        "vm_fresh_import": lambda: f(C.from_dlpack(x)),
        "vm_numpy_view": lambda: np.from_dlpack(f(view)),
        "vm_kept": lambda: keep.__setitem__(0, f(view)),
        "run": lambda: cm.run(feeds),
        "run_kept": lambda: keep.__setitem__(0, cm.run(feeds)),
        "run_general": general,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=200, help="calls per block")
    ap.add_argument("--artifact", action="store_true", help="time the exported artifact's Runner instead")
    ap.add_argument("--model", choices=("layernorm", "resnet_block"), default="layernorm",
                    help="layernorm [rows, d], or bench_cpu's resnet_block (--rows/--d unused)")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: the calling thread's CPU time (with TVM_NUM_THREADS=1 the whole call)")
    ap.add_argument("--json", default=os.path.join(HERE, "io_trace.json"))
    args = ap.parse_args(argv)
    if args.model == "resnet_block":
        model, label = M.resnet_block(), "resnet_block (bench_cpu's)"
    else:
        model, label = M.layernorm(rows=args.rows, d=args.d, decomposed=False), f"layernorm [{args.rows}, {args.d}]"
    cm = tvmfuse.compile(model, tuning_log=None)
    if args.artifact:
        import tempfile

        cm = tvmfuse.load(tvmfuse.export(cm, os.path.join(tempfile.mkdtemp(prefix="io-trace-"), args.model)))
    x = np.random.default_rng(0).standard_normal(tuple(cm.inputs[0].shape)).astype(np.float32)
    ps = paths(cm, x)
    clock = time.thread_time_ns if args.clock == "thread" else time.perf_counter_ns
    for fn in ps.values():
        _block(fn, max(1, args.calls // 10), clock)
    times = {k: [] for k in ps}
    keys = list(ps)
    for r in range(args.rounds):
        k0 = r % len(keys)
        for k in keys[k0:] + keys[:k0]:
            times[k].append(_block(ps[k], args.calls, clock))
    base = np.array(times["vm_views"])
    out = {"model": label, "artifact": args.artifact, "rounds": args.rounds, "clock": args.clock,
           "threads": os.environ.get("TVM_NUM_THREADS"), "calls": args.calls,
           "load_avg": os.getloadavg(), "paths": {}}
    for k, v in times.items():
        r = np.array(v) / base
        out["paths"][k] = {"median_us": float(np.median(v)), "ratio_median": float(np.median(r)),
                           "ratio_p25": float(np.percentile(r, 25)), "ratio_p75": float(np.percentile(r, 75)),
                           "us_by_round": v}
        d = np.array(v) - base
        out["paths"][k]["minus_vm_views_us"] = {"median": float(np.median(d)), "p25": float(np.percentile(d, 25)),
                                                "p75": float(np.percentile(d, 75))}
        print(f"{k:16s} {np.median(v):8.1f} us   paired ratio {np.median(r):.3f} "
              f"({np.percentile(r, 25):.2f}-{np.percentile(r, 75):.2f})   - vm_views {np.median(d):+6.1f} us "
              f"({np.percentile(d, 25):+.1f} {np.percentile(d, 75):+.1f})")
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
