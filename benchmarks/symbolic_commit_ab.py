"""Paired A/B of a corpus model's symbolic build at two commits (issue 13, branch sym9): the ``_dyn`` variant
compiled by this tree ("new") and by another checkout of tvmfuse ("old", exported as an artifact by a child
process whose ``PYTHONPATH`` is ``--old-tree``), next to the build pinned to the size ("static", this tree),
all three called in one process in interleaved rounds of back-to-back VM calls on inputs placed once.
Outputs of old and new are compared.  ``--threads 1``: one runtime thread, timed on the calling thread's
CPU time; otherwise wall time with the default threads.  On a shared machine the numbers are measured
under load.

    git archive <commit> | tar -x -C /tmp/base
    PYTHONPATH=. python benchmarks/symbolic_commit_ab.py llama --dims batch=1,sequence=1 --old-tree /tmp/base
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_common import (corpus_io, interleaved_us, manifest_entry, new_old_static_summary, paired_median,  # noqa: E402
                       parse_dims, vm_calls, write_json)

_EXPORT = ("import sys, tvmfuse; cm = tvmfuse.compile(sys.argv[1]); tvmfuse.export(cm, sys.argv[2])")


def export_old(tree: str, model_path: str, out: str) -> None:
    """The symbolic build of ``model_path`` by the tvmfuse in ``tree``, exported to ``out`` (a child process)."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    subprocess.run([sys.executable, "-c", _EXPORT, model_path, out], env=env, check=True, cwd=tree)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--dims", required=True, help="batch=1,sequence=1")
    ap.add_argument("--old-tree", required=True, help="a checkout of tvmfuse (the 'old' side)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="1: one thread, thread CPU time")
    ap.add_argument("--json", help="append the record (one JSON line) to this file")
    a = ap.parse_args(argv)
    import tvmfuse

    entry = manifest_entry(a.model)
    dims = parse_dims(a.dims)
    path = os.path.abspath(corpus_io.model_path(entry, "dynamic"))
    with tempfile.TemporaryDirectory(prefix="sym-ab-") as tmp:
        old_path = os.path.join(tmp, "old")
        export_old(a.old_tree, path, old_path)
        builds = {"new": tvmfuse.compile(path, num_threads=a.threads),
                  "old": tvmfuse.load(old_path, num_threads=a.threads),
                  "static": tvmfuse.compile(path, input_shapes=dims, num_threads=a.threads)}
        feeds = corpus_io.random_feeds(entry, np.random.default_rng(0), dims=dims)
        got = {n: cm.run(feeds) for n, cm in builds.items()}
        for k in got["new"]:
            np.testing.assert_allclose(got["new"][k], got["old"][k], rtol=1e-4, atol=1e-5, err_msg=k)
            np.testing.assert_allclose(got["new"][k], got["static"][k], rtol=1e-4, atol=1e-5, err_msg=k)
        clock = time.thread_time if a.threads == 1 else time.perf_counter
        ts = interleaved_us(vm_calls(builds, feeds, warmup=3), a.rounds, a.repeat, clock)
    load = os.getloadavg()[0]
    rec = {"model": a.model, "dims": dims, "old_tree": a.old_tree,
           "clock": "thread_time, 1 thread" if a.threads == 1 else f"wall, threads {a.threads or 'default'}",
           "note": "measured under load", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_1min_end": round(load, 2), "rounds": a.rounds, "repeat": a.repeat,
           **new_old_static_summary(ts, 2),
           "paired_median_to_static": {n: paired_median(ts[n], ts["static"]) for n in ("new", "old")}}
    print(json.dumps(rec))
    write_json(rec, a.json, append_line=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
