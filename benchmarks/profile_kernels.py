"""Per-kernel profile of a corpus model: each tvmfuse kernel timed alone, and onnxruntime's per-node profile.

    python benchmarks/profile_kernels.py squeezenet1_1 [--repeat 15] [--rounds 3] [--json out.json]

tvmfuse: every PrimFunc of the compiled module is timed with TVM's time evaluator on random arguments of its
own shapes (min over ``--rounds`` x ``--repeat`` repeats of ``--number`` calls), times the calls ``main``
makes of it.  The kernel runs with warm caches and a spinning thread pool, so the sum of the kernels is
below ``run()``'s time: the difference is the VM's call overhead, the thread pool's wake-ups and cold
caches (printed as "run min - sum of kernels").
onnxruntime: ``SessionOptions.enable_profiling``, min over ``--ort-runs`` runs of each node's kernel time
(its profiler adds about a microsecond per node).
Relative shares are what this is for: on a loaded machine absolute times are not measurements to quote
(benchmarks/gaps_cnn.md labels its numbers so).
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("corpus_io", os.path.join(ROOT, "corpus", "corpus_io.py"))
corpus_io = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(corpus_io)


def _call_counts(main) -> collections.Counter:
    """How many times ``main`` calls each PrimFunc (call_tir)."""
    from tvmfuse import _compat as C

    counts = collections.Counter()

    def visit(e):
        if isinstance(e, C.relax.Call) and getattr(e.op, "name", None) == "relax.call_tir":
            counts[e.args[0].name_hint] += 1

    C.relax.analysis.post_order_visit(main.body, visit)
    return counts


def tvmfuse_kernels(path: str, feeds: dict, number: int, repeat: int, rounds: int, runs: int) -> dict:
    import tvmfuse
    from tvmfuse import _compat as C

    cm = tvmfuse.compile(path)
    lib = cm.executable.mod.imports[0]          # the kernels' library inside the VM executable
    templates = {s["kernel"]: s["template"] for s in cm.report.schedules}
    calls = _call_counts(cm.fused_module["main"])
    rng = np.random.default_rng(0)
    rows = []
    for gv, func in cm.fused_module.functions.items():
        if not isinstance(func, C.PrimFunc):
            continue
        name = gv.name_hint
        shapes = C.prim_func_params(func)
        args = [C.tensor(np.asarray(rng.random(s)).astype(d), cm.device) for s, d in shapes]
        timer = C.time_function(lib, name, cm.device, number=number, repeat=repeat)
        t = min(min(timer(*args).results) for _ in range(rounds))
        n = calls.get(name, 1)
        rows.append({"kernel": name, "template": templates.get(name), "calls": n, "us_per_call": t * 1e6,
                     "us": t * n * 1e6, "shapes": [s for s, _ in shapes]})
    rows.sort(key=lambda r: -r["us"])
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        cm.run(feeds)
        ts.append(time.perf_counter() - t0)
    return {"kernels": rows, "kernel_count": cm.kernel_count, "sum_us": sum(r["us"] for r in rows),
            "run_min_us": min(ts) * 1e6, "run_median_us": float(np.median(ts)) * 1e6}


def ort_nodes(path: str, feeds: dict, runs: int) -> dict:
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tmp, "ort")
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        for _ in range(runs):
            sess.run(None, feeds)
        with open(sess.end_profiling(), encoding="utf-8") as f:
            events = json.load(f)
    per, info = collections.defaultdict(list), {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            n = e["name"][:-len("_kernel_time")]
            per[n].append(e["dur"])
            info[n] = (e["args"].get("op_name"), e["args"].get("output_type_shape"))
    rows = sorted(({"node": n, "op": info[n][0], "out": info[n][1], "us": float(min(v))} for n, v in per.items()),
                  key=lambda r: -r["us"])
    return {"nodes": rows, "sum_us": sum(r["us"] for r in rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [e["name"] for e in corpus_io.load_manifest()["models"]]
    ap.add_argument("model", choices=names)
    ap.add_argument("--number", type=int, default=20, help="calls per timed repeat")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=200, help="run() calls for the whole-model time")
    ap.add_argument("--ort-runs", type=int, default=300)
    ap.add_argument("--json", help="write both profiles to this JSON file")
    a = ap.parse_args(argv)
    entry = {e["name"]: e for e in corpus_io.load_manifest()["models"]}[a.model]
    path = corpus_io.model_path(entry, "static")
    feeds = corpus_io.random_feeds(entry, np.random.default_rng(0))
    tv = tvmfuse_kernels(path, feeds, a.number, a.repeat, a.rounds, a.runs)
    print(f"== tvmfuse {a.model}: {tv['kernel_count']} kernels, sum of kernels {tv['sum_us']:.1f} us, run min "
          f"{tv['run_min_us']:.1f} us (run min - sum of kernels {tv['run_min_us'] - tv['sum_us']:.1f} us)")
    for r in tv["kernels"]:
        print(f"{r['us']:8.1f} us  {r['us_per_call']:7.1f} x{r['calls']}  {r['kernel']} [{r['template']}] "
              f"{r['shapes']}")
    on = ort_nodes(path, feeds, a.ort_runs)
    print(f"== onnxruntime {a.model}: {len(on['nodes'])} nodes, sum of node mins {on['sum_us']:.1f} us")
    for r in on["nodes"]:
        print(f"{r['us']:8.1f} us  {r['op']} {r['node']} {r['out']}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"model": a.model, "tvmfuse": tv, "onnxruntime": on,
                       "note": "per-kernel mins; relative shares only on a loaded machine"}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
