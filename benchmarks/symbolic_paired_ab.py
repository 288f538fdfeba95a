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
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_common import (corpus_io, interleaved_us, manifest_entry, new_old_static_summary,  # noqa: E402
                       parse_dims, vm_calls, write_json)


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

    entry = manifest_entry(a.model)
    dims = parse_dims(a.dims)
    path = corpus_io.model_path(entry, "dynamic")
    threads = 1 if a.thread_time else None
    builds = {"new": tvmfuse.compile(path, num_threads=threads), "old": build_old(path, threads),
              "static": tvmfuse.compile(path, input_shapes=dims, num_threads=threads)}
    feeds = corpus_io.random_feeds(entry, np.random.default_rng(0), dims=dims)
    got = {n: cm.run(feeds) for n, cm in builds.items()}
    for k in got["new"]:
        np.testing.assert_allclose(got["new"][k], got["old"][k], rtol=1e-4, atol=1e-5, err_msg=k)
    clock = time.thread_time if a.thread_time else time.perf_counter
    ts = interleaved_us(vm_calls(builds, feeds, warmup=2), a.rounds, a.repeat, clock)
    rec = {"model": a.model, "dims": dims, "clock": "thread_time, 1 thread" if a.thread_time else "wall",
           "note": "measured under load", **new_old_static_summary(ts, 1)}
    print(json.dumps(rec))
    write_json(rec, a.json, append_line=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
