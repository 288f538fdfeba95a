"""Per corpus model: the kernel count and each kernel's schedule (template, source, reason), and with
``--profile`` the time each kernel takes in ``CompiledModel.run`` (VM instrumentation), to find the kernels
left to dlight's fallback or the generic schedule and the ones that cost the most.

    python corpus/survey.py [--models bert gpt2] [--profile] [--runs 20] [--json out.json]

Kernel times come from the VM's instrument hook (a Python call before and after each kernel), so they carry
a few microseconds of overhead each and, on a shared machine, all of its noise: they rank kernels, they are
not measurements to quote.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("corpus_io", os.path.join(HERE, "corpus_io.py"))
corpus_io = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(corpus_io)


def kernel_times(cm, feeds: dict, runs: int) -> dict[str, float]:
    """Median seconds per call of each kernel symbol over ``runs`` runs (summed over its calls in one run)."""
    from tvmfuse import _compat as C
    from tvmfuse.io import validate_feeds

    vm = C.VirtualMachine(cm.executable, cm.device)
    args = [C.tensor(np.ascontiguousarray(v), cm.device) for v in validate_feeds(feeds, cm.inputs)]
    per_run: list[dict[str, float]] = []
    cur: dict[str, float] = collections.defaultdict(float)
    start: dict[str, float] = {}

    def instrument(func, symbol, before, ret, *a):
        now = time.perf_counter()
        if before:
            start[symbol] = now
        else:
            cur[symbol] += now - start.pop(symbol, now)
        return 0

    vm.set_instrument(instrument)
    main = vm["main"]
    main(*args)                     # warm-up
    for _ in range(runs):
        cur.clear()
        main(*args)
        per_run.append(dict(cur))
    names = set().union(*per_run)
    return {n: float(np.median([r.get(n, 0.0) for r in per_run])) for n in names}


def survey(name: str, profile: bool, runs: int, threads: int | None = None) -> dict:
    import tvmfuse

    entry = {e["name"]: e for e in corpus_io.load_manifest()["models"]}[name]
    path = corpus_io.model_path(entry, "static")
    t0 = time.perf_counter()
    cm = tvmfuse.compile(path, num_threads=threads)
    out = {"model": name, "compile_s": round(time.perf_counter() - t0, 2), "kernels": cm.kernel_count,
           "schedules": cm.report.schedules, "schedule_sources": cm.report.to_dict()["schedule_sources"]}
    if profile:
        feeds = corpus_io.random_feeds(entry, np.random.default_rng(0))
        out["kernel_s"] = kernel_times(cm, feeds, runs)
        t = []
        for _ in range(runs):
            t0 = time.perf_counter()
            cm.run(feeds)
            t.append(time.perf_counter() - t0)
        out["run_s"] = float(np.median(t))
        try:
            import onnxruntime as ort
        except ImportError:
            ort = None
        if ort is not None:
            so = ort.SessionOptions()
            if threads:
                so.intra_op_num_threads = threads
            sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
            sess.run(None, feeds)
            t = []
            for _ in range(runs):
                t0 = time.perf_counter()
                sess.run(None, feeds)
                t.append(time.perf_counter() - t0)
            out["ort_s"] = float(np.median(t))
    return out


def show(r: dict) -> None:
    print(f"== {r['model']}: {r['kernels']} kernels, compile {r['compile_s']} s, sources {r['schedule_sources']}")
    times = r.get("kernel_s", {})
    if "run_s" in r:
        ort = r.get("ort_s")
        print(f"   run {r['run_s'] * 1e3:.3f} ms" + (f", onnxruntime {ort * 1e3:.3f} ms, ratio ort/tvmfuse "
                                                    f"{ort / r['run_s']:.2f}" if ort else ""))
    for s in sorted(r["schedules"], key=lambda s: -times.get(s["kernel"], 0.0)):
        t = times.get(s["kernel"])
        ts = f"{t * 1e6:9.1f} us " if t is not None else ""
        why = f"  -- {s['reason'].splitlines()[0][:160]}" if s.get("reason") and s["source"] != "default" else ""
        print(f"   {ts}{s['kernel']}: {s['template']} ({s['source']}){why}")
    others = {k: v for k, v in times.items() if k not in {s["kernel"] for s in r["schedules"]}}
    if others:
        print("   not scheduled by tvmfuse (VM builtins / TVM kernels): " + ", ".join(
            f"{k} {v * 1e6:.1f} us" for k, v in sorted(others.items(), key=lambda kv: -kv[1])[:8]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [e["name"] for e in corpus_io.load_manifest()["models"]]
    ap.add_argument("--models", nargs="*", default=names, choices=names)
    ap.add_argument("--profile", action="store_true", help="time each kernel (ranking only)")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--threads", type=int, help="threads of both engines (default: each one's own)")
    ap.add_argument("--json", help="write every model's record to this JSON file")
    a = ap.parse_args(argv)
    results = []
    for n in a.models:
        r = survey(n, a.profile, a.runs, a.threads)
        show(r)
        sys.stdout.flush()
        results.append(r)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
