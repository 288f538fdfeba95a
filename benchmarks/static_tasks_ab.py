"""Whole-model A/B of a table change on builds pinned to one size (issue 13, staticmm13b): a corpus model's
``_dyn`` variant compiled with ``input_shapes`` twice in one process, with the family's target defaults
("new") and with some of its ``template_defaults`` replaced ("before", ``model_knob_ab.build``), outputs
compared, then ``run()`` timed in interleaved rounds on the wall clock with the runtime's default threads (a
kernel's parallel split shows only there). Paired median of per-round ratios new / before with its spread.
Every number is measured under whatever load the machine had.

    PYTHONPATH=. python benchmarks/static_tasks_ab.py bert --dims batch=1,sequence=128 \
        --family cpu.matmul_epilogue --before '{"template_defaults": {"row_blocks_per_core": 0}}'
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model_knob_ab as MK  # noqa: E402
from ab_common import corpus_io, write_json  # noqa: E402


def _dims(text: str) -> dict:
    return {k: int(v) for k, v in (p.split("=") for p in text.split(","))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a corpus model (its _dyn variant pinned to --dims) or workload:NAME "
                    "(benchmarks/bench_cpu.py)")
    ap.add_argument("--dims", required=True, action="append", help="batch=1,sequence=128 (repeatable)")
    ap.add_argument("--family", required=True)
    ap.add_argument("--before", required=True, help="JSON overrides of the 'before' build (model_knob_ab)")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--number", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import tvmfuse

    out = []
    if a.model.startswith("workload:"):      # a bench_cpu.py workload (static shapes; --dims ignored)
        path, wl_feeds = MK._workload(a.model.split(":", 1)[1])
        entry, a.dims = None, ["-"]
    else:
        entry = {e["name"]: e for e in corpus_io.load_manifest()["models"]}[a.model]
        path = corpus_io.model_path(entry, "dynamic")
    for text in a.dims:
        dims = None if entry is None else _dims(text)
        real = tvmfuse.compile
        builds = {}
        for name, before in (("new", None), ("before", json.loads(a.before))):
            # model_knob_ab.build compiles without input_shapes: pin them here
            tvmfuse.compile = lambda p, t, tuning_log=None, _r=real: _r(p, t, tuning_log=tuning_log, input_shapes=dims)
            try:
                builds[name] = MK.build(path, a.family, before)
            finally:
                tvmfuse.compile = real
        feeds = wl_feeds if entry is None else corpus_io.random_feeds(entry, np.random.default_rng(0), dims=dims)
        ref = builds["before"].run(feeds)
        got = builds["new"].run(feeds)
        err = max(corpus_io.relative_error(np.asarray(got[o]), np.asarray(ref[o])) for o in ref)
        times = {k: [] for k in builds}
        for r in range(a.rounds):
            for k in (list(builds) if r % 2 == 0 else list(reversed(list(builds)))):
                cm = builds[k]
                t0 = time.perf_counter()
                for _ in range(a.number):
                    cm.run(feeds)
                times[k].append((time.perf_counter() - t0) / a.number * 1e6)
        ratios = sorted(n / b for n, b in zip(times["new"], times["before"]))
        q = len(ratios) // 4
        rec = {"model": a.model, "dims": dims, "family": a.family, "before": json.loads(a.before),
               "rel_err_new_vs_before": err,
               "us_min_median": {k: [round(min(v), 1), round(statistics.median(v), 1)] for k, v in times.items()},
               "ratio_new_over_before_median": round(statistics.median(ratios), 3),
               "ratio_quartiles": [round(ratios[q], 3), round(ratios[-q - 1], 3)],
               "clock": f"wall (perf_counter), default threads, {a.rounds} interleaved rounds x {a.number} "
                        f"run() calls, measured under load", "load_1min": round(os.getloadavg()[0], 2)}
        print(json.dumps(rec), flush=True)
        out.append(rec)
    write_json(out, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
