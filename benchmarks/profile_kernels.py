"""Per-kernel profile of a corpus model: each tvmfuse kernel timed alone, and onnxruntime's per-node profile.

    python benchmarks/profile_kernels.py squeezenet1_1 [--repeat 15] [--rounds 3] [--json out.json]
    python benchmarks/profile_kernels.py bert --dims batch=3,sequence=17 --no-ort   # symbolic vs pinned

tvmfuse: every kernel of the compiled model is timed with TVM's time evaluator on the arguments the model's
run gives it (captured by a VM instrument: a model with symbolic shapes is profiled at the sizes of its
inputs; min over ``--rounds`` x ``--repeat`` repeats of ``--number`` calls), times the calls ``main``
makes of it; the "in-model" column is its time inside ``run()`` (instrumented, min over runs: includes a
Python callback's few microseconds).  ``--dims`` profiles the corpus model's ``_dyn`` variant at those sizes
next to a build pinned to them (``input_shapes``).  The kernel runs with warm caches and a spinning thread pool, so the sum of the kernels is
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
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_common import corpus_io, write_json  # noqa: E402


def _call_counts(main) -> collections.Counter:
    """How many times ``main`` calls each PrimFunc (call_tir)."""
    from tvmfuse import _compat as C

    counts = collections.Counter()

    def visit(e):
        if isinstance(e, C.relax.Call) and getattr(e.op, "name", None) == "relax.call_tir":
            counts[e.args[0].name_hint] += 1

    C.relax.analysis.post_order_visit(main.body, visit)
    return counts


def _capture_calls(cm, feeds: dict, runs: int) -> tuple[dict, dict]:
    """Run the model with a VM instrument: the arguments of each kernel's first call (copies: the VM
    reuses its buffers) and the minimum over ``runs`` runs of each kernel's time inside the model (from
    the instrument's before/after callbacks: includes a Python callback's overhead, a few microseconds)."""
    from tvmfuse import _compat as C

    kernels = {gv.name_hint for gv, f in cm.fused_module.functions.items() if isinstance(f, C.PrimFunc)}
    captured, in_model, started = {}, collections.defaultdict(lambda: float("inf")), {}
    per_run = collections.defaultdict(float)

    def instrument(func, symbol, before_run, ret_value, *args):
        name = str(symbol)
        if name not in kernels:
            return 0
        if before_run:
            if name not in captured:
                captured[name] = [a.numpy().copy() if hasattr(a, "numpy") else a for a in args]
            started[name] = time.perf_counter()
        else:
            per_run[name] += time.perf_counter() - started.pop(name)
        return 0      # VMInstrumentReturnKind.NO_OP: run the call

    cm.vm.set_instrument(instrument)
    try:
        for _ in range(runs):
            per_run.clear()
            cm.run(feeds)
            for k, t in per_run.items():
                in_model[k] = min(in_model[k], t)
    finally:
        cm.vm.set_instrument(lambda *a: 0)
    return captured, dict(in_model)


def tvmfuse_kernels(path: str, feeds: dict, number: int, repeat: int, rounds: int, runs: int,
                    input_shapes: dict | None = None) -> dict:
    """Each kernel timed alone on the arguments the model's run gives it (so a model with symbolic shapes
    is profiled at the sizes of ``feeds``), and inside the model (instrumented runs)."""
    import tvmfuse
    from tvmfuse import _compat as C

    cm = tvmfuse.compile(path, input_shapes=input_shapes)
    lib = cm.executable.mod.imports[0]          # the kernels' library inside the VM executable
    templates = {s["kernel"]: s["template"] for s in cm.report.schedules}
    calls = _call_counts(cm.fused_module["main"])
    captured, in_model = _capture_calls(cm, feeds, max(3, runs // 20))
    rows = []
    for name, args in captured.items():
        dev_args = [C.tensor(a, cm.device) if isinstance(a, np.ndarray) else a for a in args]
        timer = C.time_function(lib, name, cm.device, number=number, repeat=repeat)
        t = min(min(timer(*dev_args).results) for _ in range(rounds))
        n = calls.get(name, 1)
        rows.append({"kernel": name, "template": templates.get(name), "calls": n, "us_per_call": t * 1e6,
                     "us": t * n * 1e6, "in_model_us": in_model.get(name, float("nan")) * 1e6,
                     "shapes": [list(a.shape) if isinstance(a, np.ndarray) else a for a in args]})
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


def _parse_dims(text: str | None) -> dict | None:
    """``batch=3,sequence=17`` -> {"batch": 3, "sequence": 17}."""
    if not text:
        return None
    dims = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if not name or not value.strip().isdigit():
            raise SystemExit(f"--dims {text!r}: expected NAME=INT[,NAME=INT...]")
        dims[name.strip()] = int(value)
    return dims


def _print_tvmfuse(title: str, tv: dict) -> None:
    print(f"== {title}: {tv['kernel_count']} kernels, sum of kernels {tv['sum_us']:.1f} us, run min "
          f"{tv['run_min_us']:.1f} us (run min - sum of kernels {tv['run_min_us'] - tv['sum_us']:.1f} us)")
    print("   alone us  us/call calls  in-model us/call  kernel [template] shapes")
    for r in tv["kernels"]:
        print(f"{r['us']:10.1f} {r['us_per_call']:8.1f} x{r['calls']}  {r['in_model_us']:8.1f}  {r['kernel']} "
              f"[{r['template']}] {r['shapes']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [e["name"] for e in corpus_io.load_manifest()["models"]]
    ap.add_argument("model", choices=names)
    ap.add_argument("--number", type=int, default=20, help="calls per timed repeat")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=200, help="run() calls for the whole-model time")
    ap.add_argument("--ort-runs", type=int, default=300)
    ap.add_argument("--no-ort", action="store_true", help="skip onnxruntime's profile")
    ap.add_argument("--dims", help="the symbolic corpus variant (<model>_dyn) at these sizes, e.g. "
                                   "batch=3,sequence=17, next to a build pinned to them (input_shapes)")
    ap.add_argument("--json", help="write the profiles to this JSON file")
    a = ap.parse_args(argv)
    entry = {e["name"]: e for e in corpus_io.load_manifest()["models"]}[a.model]
    dims = _parse_dims(a.dims)
    timing = (a.number, a.repeat, a.rounds, a.runs)
    out = {"model": a.model, "note": "per-kernel mins; relative shares only on a loaded machine"}
    if dims is None:
        path = corpus_io.model_path(entry, "static")
        feeds = corpus_io.random_feeds(entry, np.random.default_rng(0))
        out["tvmfuse"] = tvmfuse_kernels(path, feeds, *timing)
        _print_tvmfuse(f"tvmfuse {a.model}", out["tvmfuse"])
    else:
        path = corpus_io.model_path(entry, "dynamic")
        feeds = corpus_io.random_feeds(entry, np.random.default_rng(0), dims=dims)
        out["dims"] = dims
        out["tvmfuse_symbolic"] = tvmfuse_kernels(path, feeds, *timing)
        out["tvmfuse_pinned"] = tvmfuse_kernels(path, feeds, *timing, input_shapes=dims)
        _print_tvmfuse(f"tvmfuse {a.model}_dyn symbolic at {dims}", out["tvmfuse_symbolic"])
        _print_tvmfuse(f"tvmfuse {a.model}_dyn pinned to {dims}", out["tvmfuse_pinned"])
    if not a.no_ort:
        on = out["onnxruntime"] = ort_nodes(path, feeds, a.ort_runs)
        print(f"== onnxruntime {a.model}: {len(on['nodes'])} nodes, sum of node mins {on['sum_us']:.1f} us")
        for r in on["nodes"]:
            print(f"{r['us']:8.1f} us  {r['op']} {r['node']} {r['out']}")
    write_json(out, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
