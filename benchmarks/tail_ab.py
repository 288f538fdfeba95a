"""Softmax [rows, d] kernels with the row-reduction template's elementwise tails as one vector (now) or as
a scalar loop (before, ``common.vectorize_inner``), against rows padded to a multiple of 16 (issue 11).

    TVM_NUM_THREADS=1 python benchmarks/tail_ab.py --d 3071 104 1000    # -> benchmarks/tail_ab.json

One process; each softmax compiled both ways (``reduction._vectorize_pass`` swapped for the scalar-tail
schedule while compiling "before"), the outputs of the two compared, and the padded width compiled once.
The VM call on device tensors, thread CPU time per call (one thread: the kernel's own time), blocks of
``--calls`` calls interleaved round by round; per kernel min / p10 / median us and the paired per-round
ratios new / before and new / padded (median, p25, p75).
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
from tvmfuse.schedules.cpu import common as U
from tvmfuse.schedules.cpu import reduction as R

HERE = os.path.dirname(os.path.abspath(__file__))
PAD = 16


def _scalar_tail(sch, block, lanes, unroll):
    U.vectorize_inner(sch, block, lanes, unroll)


def _compile(rows: int, d: int, vector_tail: bool):
    real = R._vectorize_pass
    R._vectorize_pass = real if vector_tail else _scalar_tail
    try:
        return tvmfuse.compile(M.softmax(rows=rows, d=d, decomposed=False), tuning_log=None)
    finally:
        R._vectorize_pass = real


def _block(fn, calls: int) -> float:
    t = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - t) / calls * 1e6


def _ratio(a, b) -> dict:
    r = np.array(a) / np.array(b)
    return {"median": float(np.median(r)), "p25": float(np.percentile(r, 25)), "p75": float(np.percentile(r, 75))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--d", type=int, nargs="+", default=[3071, 104, 1000])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--json", default=os.path.join(HERE, "tail_ab.json"))
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    paths, out = {}, {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": C.llvm_system_cpu(),
                      "threads": os.environ.get("TVM_NUM_THREADS"), "load_avg_start": os.getloadavg(),
                      "rows": args.rows, "rounds": args.rounds, "calls": args.calls, "kernels": {}, "ratios": {}}
    for d in args.d:
        x = rng.standard_normal((args.rows, d)).astype(np.float32)
        padded = -(-d // PAD) * PAD
        xp = np.concatenate([x, np.full((args.rows, padded - d), -1e30, np.float32)], axis=1)
        got = {}
        for key, width, vector_tail, inp in ((f"{d}_new", d, True, x), (f"{d}_before", d, False, x),
                                             (f"{padded}_padded", padded, True, xp)):
            f = _compile(args.rows, width, vector_tail)._main()
            t = C.tensor(inp)
            got[key] = f(t).numpy()[:, :d]
            paths[key] = (lambda f, t: lambda: f(t))(f, t)
        np.testing.assert_allclose(got[f"{d}_new"], got[f"{d}_before"], rtol=1e-5, atol=1e-8)
        np.testing.assert_allclose(got[f"{d}_new"], got[f"{padded}_padded"], rtol=1e-5, atol=1e-8)
    times = {k: [] for k in paths}
    keys = list(paths)
    for r in range(args.rounds):
        k0 = r % len(keys)
        for k in keys[k0:] + keys[:k0]:
            times[k].append(_block(paths[k], args.calls))
    for k, v in times.items():
        out["kernels"][k] = {"min_us": min(v), "p10_us": float(np.percentile(v, 10)),
                             "median_us": float(np.median(v)), "us_by_round": v}
        print(f"{k:14s} min {min(v):8.1f}  p10 {np.percentile(v, 10):8.1f}  median {np.median(v):8.1f} us")
    for d in args.d:
        padded = -(-d // PAD) * PAD
        for name, other in (("new/before", f"{d}_before"), ("new/padded", f"{padded}_padded")):
            r = out["ratios"][f"{d} {name}"] = _ratio(times[f"{d}_new"], times[other])
            print(f"{d} {name:11s} paired median {r['median']:.3f} (p25 {r['p25']:.3f}, p75 {r['p75']:.3f})")
    out["load_avg_end"] = os.getloadavg()
    with open(args.json, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
