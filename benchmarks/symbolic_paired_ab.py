"""Paired A/B of the session-8 symbolic-build changes (issue 13, branch sym8) on a corpus model's ``_dyn``
variant at one size: the symbolic build as it is ("new"), the same build with the changes switched off in
this process ("old": ``cpu.symbolic_norm_matmul`` packing B for any row block, ``cpu.generic`` folding every
producer and keeping symbolic nests serial) and the build pinned to the size ("static"), timed in
interleaved rounds of back-to-back VM calls: one runtime thread on the calling thread's CPU time
(``--thread-time``, a loaded machine) or wall time with the default threads.  Outputs of old and new are
compared.  On a shared machine the numbers are measured under load.

    PYTHONPATH=. python benchmarks/symbolic_paired_ab.py t5_encoder --dims batch=1,sequence=128 --thread-time
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("corpus_io", os.path.join(ROOT, "corpus", "corpus_io.py"))
corpus_io = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(corpus_io)


def build_old(path: str, threads):
    """The symbolic build with this branch's schedule changes switched off (monkeypatched for the call)."""
    import tvmfuse
    from tvmfuse.schedules.cpu import generic as G
    from tvmfuse.schedules.cpu.symbolic_prologue import SymbolicNormMatmul

    saved = (G._symbolic_output_elements, G._recomputed_if_folded, SymbolicNormMatmul.table_defaults)
    table = SymbolicNormMatmul.table_defaults
    G._symbolic_output_elements = lambda func: None
    G._recomputed_if_folded = lambda sch, block, consumers: False
    SymbolicNormMatmul.table_defaults = lambda self, target: {**table(self, target), "pack_min_block_rows": 1}
    try:
        return tvmfuse.compile(path, num_threads=threads)
    finally:
        G._symbolic_output_elements, G._recomputed_if_folded, SymbolicNormMatmul.table_defaults = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--dims", required=True, help="batch=1,sequence=128")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--thread-time", action="store_true", help="one runtime thread, thread CPU time")
    ap.add_argument("--json", help="append the record (one JSON line) to this file")
    a = ap.parse_args(argv)
    import tvmfuse
    from tvmfuse.io import validate_feeds

    entry = {e["name"]: e for e in corpus_io.load_manifest()["models"]}[a.model]
    dims = {k: int(v) for k, v in (p.split("=") for p in a.dims.split(","))}
    path = corpus_io.model_path(entry, "dynamic")
    threads = 1 if a.thread_time else None
    builds = {"new": tvmfuse.compile(path, num_threads=threads), "old": build_old(path, threads),
              "static": tvmfuse.compile(path, input_shapes=dims, num_threads=threads)}
    feeds = corpus_io.random_feeds(entry, np.random.default_rng(0), dims=dims)
    got = {n: cm.run(feeds) for n, cm in builds.items()}
    for k in got["new"]:
        np.testing.assert_allclose(got["new"][k], got["old"][k], rtol=1e-4, atol=1e-5, err_msg=k)
    clock = time.thread_time if a.thread_time else time.perf_counter
    calls = {}
    for n, cm in builds.items():
        args = [cm._to_device(v)[0] for v in validate_feeds(feeds, cm.inputs, cm.shape_upper_bounds)]
        f = cm._main()
        f(*args)
        f(*args)
        calls[n] = (f, args)
    ts = {n: [] for n in calls}
    for _ in range(a.rounds):
        for n, (f, args) in calls.items():
            t0 = clock()
            for _ in range(a.repeat):
                f(*args)
            ts[n].append((clock() - t0) / a.repeat * 1e6)
    rec = {"model": a.model, "dims": dims, "clock": "thread_time, 1 thread" if a.thread_time else "wall",
           "note": "measured under load", "min_us": {n: round(min(t), 1) for n, t in ts.items()},
           "median_us": {n: round(float(np.median(t)), 1) for n, t in ts.items()},
           "ratio_to_static_min": {n: round(min(ts[n]) / min(ts["static"]), 3) for n in ("new", "old")},
           "paired_median_new_over_old": round(float(np.median(np.array(ts["new"]) / np.array(ts["old"]))), 3)}
    print(json.dumps(rec))
    if a.json:
        with open(a.json, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
