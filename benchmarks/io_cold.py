"""run()'s own steps after a kernel that streams megabytes (issue 11, layernorm [512, 768] through run()).

    TVM_NUM_THREADS=1 python benchmarks/io_cold.py          # -> benchmarks/io_cold.json

One process, one thread, thread CPU time per call.  A tiny LayerNorm ([4, 16], a microsecond kernel) timed
four ways, interleaved round by round: the VM call and ``run()``, each alone and each after a sweep that
streams as many bytes as layernorm [512, 768] does (a 1.5 MB multiply into a 1.5 MB array: 3 MB through
the caches).  ``run() - VM call`` alone is run()'s Python with warm caches; after the sweep, the same
steps with the caches holding the sweep's lines instead of the interpreter's.  Reported: per path the
min / p10 / median us, and the paired per-round differences (median, p25, p75).
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

HERE = os.path.dirname(os.path.abspath(__file__))


def _block(fn, calls: int) -> float:
    t = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - t) / calls * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--calls", type=int, default=100, help="calls per block")
    ap.add_argument("--sweep-floats", type=int, default=512 * 768, help="floats per array of the sweep")
    ap.add_argument("--json", default=os.path.join(HERE, "io_cold.json"))
    args = ap.parse_args(argv)
    cm = tvmfuse.compile(M.layernorm(rows=4, d=16, decomposed=False), tuning_log=None)
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    feeds, f, view = {"x": x}, cm._main(), C.from_dlpack(x)
    a = np.ones(args.sweep_floats, np.float32)
    b = np.empty_like(a)

    def sweep():
        np.multiply(a, 1.0001, out=b)

    paths = {"sweep": sweep, "sweep+vm": lambda: (sweep(), f(view)), "sweep+run": lambda: (sweep(), cm.run(feeds)),
             "vm": lambda: f(view), "run": lambda: cm.run(feeds)}
    times = {k: [] for k in paths}
    keys = list(paths)
    for r in range(args.rounds):
        k0 = r % len(keys)
        for k in keys[k0:] + keys[:k0]:
            times[k].append(_block(paths[k], args.calls))
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": C.llvm_system_cpu(),
           "threads": os.environ.get("TVM_NUM_THREADS"), "load_avg": os.getloadavg(), "rounds": args.rounds,
           "calls": args.calls, "paths": {}, "differences_us": {}}
    for k, v in times.items():
        out["paths"][k] = {"min_us": min(v), "p10_us": float(np.percentile(v, 10)), "median_us": float(np.median(v)),
                           "us_by_round": v}
        print(f"{k:10s} min {min(v):8.2f}  p10 {np.percentile(v, 10):8.2f}  median {np.median(v):8.2f} us")
    for name, (p, q) in {"run_over_vm_warm": ("run", "vm"), "run_over_vm_after_sweep": ("sweep+run", "sweep+vm"),
                         "vm_call_after_sweep": ("sweep+vm", "sweep")}.items():
        d = np.array(times[p]) - np.array(times[q])
        out["differences_us"][name] = {"median": float(np.median(d)), "p25": float(np.percentile(d, 25)),
                                       "p75": float(np.percentile(d, 75))}
        print(f"{name:24s} {np.median(d):6.2f} us (p25 {np.percentile(d, 25):.2f}, p75 {np.percentile(d, 75):.2f})")
    with open(args.json, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
