"""Before/after of the GEMV-like nest's wide register tile (gpt2one14), one process: static build pinned to
the dims, the symbolic build as before (``_gemv_vectors`` returning the GEMM row's tile) and after, run() on
numpy, wall clock (``--clock thread``: the thread's CPU time), runtime threads as TVM_NUM_THREADS (tvmfuse default: physical cores), interleaved rounds
in rotating order.  Prints min / median per build and paired medians with a 90% bootstrap interval.

    PYTHONPATH=. python benchmarks/notes/gpt2one14/gemv_ab.py gpt2 batch=1,sequence=1 --rounds 60 --repeat 50 --json out.json
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import numpy as np  # noqa: E402

import tvmfuse  # noqa: E402
from tvmfuse.schedules.cpu import symbolic_matmul as SM  # noqa: E402
from ab_common import corpus_io, parse_dims  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("dims")
ap.add_argument("--rounds", type=int, default=60)
ap.add_argument("--repeat", type=int, default=50)
ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                help="thread: time.thread_time (with TVM_NUM_THREADS=1: a loaded machine's time-sharing left out)")
ap.add_argument("--json")
a = ap.parse_args()
dims = parse_dims(a.dims)
entry = {e["name"]: e for e in corpus_io.load_manifest()["models"]}[a.model]
path = corpus_io.model_path(entry, "dynamic")
feeds = corpus_io.random_feeds(entry, np.random.default_rng(0), dims=dims)
cms = {"static": tvmfuse.compile(path, input_shapes=dims), "after": tvmfuse.compile(path)}
new = SM.SymbolicMatmulEpilogue._gemv_vectors
SM.SymbolicMatmulEpilogue._gemv_vectors = staticmethod(lambda n, lanes, choices, narrow, *rest: narrow)
cms["before"] = tvmfuse.compile(path)
SM.SymbolicMatmulEpilogue._gemv_vectors = new


def tiles(cm):
    return {s["kernel"]: [b["config"]["nvec"] for b in s["knobs"]["buckets"]]
            for s in cm.report.schedules if s["template"] == SM.SymbolicMatmulEpilogue.family}


ref = cms["static"].run(feeds)
rec = {"model": a.model, "dims": dims, "rounds": a.rounds, "repeat": a.repeat, "clock": a.clock,
       "threads": tvmfuse._compat.runtime_threads(), "nvec_per_bucket": {k: tiles(cm) for k, cm in cms.items()
                                                                           if k != "static"},
       "max_abs_diff_vs_static": {}, "us_per_call": {k: [] for k in cms}}
for k, cm in cms.items():
    out = cm.run(feeds)
    rec["max_abs_diff_vs_static"][k] = max(float(np.max(np.abs(out[n] - ref[n]))) for n in ref)
    for _ in range(20):
        cm.run(feeds)
names = list(cms)
ts = rec["us_per_call"]
clock = time.perf_counter if a.clock == "wall" else time.thread_time
for r in range(a.rounds):
    for k in names[r % 3:] + names[:r % 3]:
        cm = cms[k]
        t0 = clock()
        for _ in range(a.repeat):
            cm.run(feeds)
        ts[k].append((clock() - t0) / a.repeat * 1e6)
rng = np.random.default_rng(1)


def paired(x, y):
    r = np.array(ts[x]) / np.array(ts[y])
    boot = [np.median(rng.choice(r, len(r))) for _ in range(2000)]
    return {"median": round(float(np.median(r)), 3), "ci90": [round(float(v), 3) for v in np.percentile(boot, [5, 95])]}


rec["summary"] = {"min_us": {k: round(min(v), 2) for k, v in ts.items()},
                  "median_us": {k: round(float(np.median(v)), 2) for k, v in ts.items()},
                  "ratio_of_mins_to_static": {k: round(min(ts[k]) / min(ts["static"]), 3) for k in ("before", "after")},
                  "paired_to_static": {k: paired(k, "static") for k in ("before", "after")},
                  "paired_after_over_before": paired("after", "before")}
print(a.model, dims, "threads", rec["threads"], json.dumps(rec["summary"]), json.dumps(rec["nvec_per_bucket"]))
if a.json:
    with open(a.json, "w", encoding="utf-8") as f:
        json.dump(rec, f, indent=1)
