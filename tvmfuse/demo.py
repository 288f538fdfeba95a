"""``tvmfuse demo``: compile the built-in example models, check them against the op-by-op reference,
print the fusion report and the latency next to onnxruntime (when installed) and TVM's unscheduled builds.

Every latency column is the median of the same number of calls (``repeat``), timed one engine after the
other with a pause between engines (PAUSE_S) so that one runtime's idle workers do not slow the next.
This is a quick look, not a benchmark: ``benchmarks/bench_cpu.py`` times engines in separate processes in
interleaved rounds, against TVM's scheduled routes (dlight, MetaSchedule) too.
"""
from __future__ import annotations

import json
import time

import numpy as np

from . import _compat as C
from .compiled import compile as tvmfuse_compile
from .models import DEMO_MODELS, reference_outputs, random_feeds
from .pipeline import stock_pipeline, unfused_pipeline
from .target import configure_threads, is_gpu, parse_target

# float32, op-by-op reference vs. fused kernels that reorder sums and use approximations of exp/erf.
DEMO_RTOL, DEMO_ATOL = 1e-4, 1e-5
PAUSE_S = 0.2   # between two engines' timings: lets idle spinning worker threads go to sleep


def _median_s(fn, repeat: int, sync=None, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - t0)
    time.sleep(PAUSE_S)
    return float(np.median(times))


def _baseline_latency(model, pipeline_factory, target, feeds, repeat: int) -> float:
    from .frontend import load_onnx

    mod = load_onnx(model)
    ex = C.compile_module(mod, target, relax_pipeline=pipeline_factory(target))
    dev = C.device_for(target)
    vm = C.VirtualMachine(ex, dev)
    args = [C.tensor(v, dev) for v in feeds.values()]
    f = vm["main"]
    return _median_s(lambda: f(*args), repeat, sync=dev.sync)


def _onnxruntime():
    """The onnxruntime module, or None when it is not installed (it is only in the test/bench extras)."""
    try:
        import onnxruntime
    except ImportError:
        return None
    return onnxruntime


def _ort_session(ort, model):
    """onnxruntime's CPU session with its default session options (threads: its default, physical cores)."""
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _ratio(r: float) -> str:
    return f"{r:.1f}x" if r >= 1 else f"{r:.2g}x"


def columns(tuning_log: str | None, ort_available: bool) -> list[tuple[str, str]]:
    """(name, what it is) of every latency column the demo prints."""
    tuned = ("untuned: each kernel's template default for the target" if tuning_log is None else
             "with the tuning records shipped in tuning_logs/" if tuning_log == "shipped" else
             f"with the tuning records of {tuning_log}")
    cols = [("tvmfuse", f"tvmfuse, {tuned}")]
    if ort_available:
        cols.append(("onnxruntime", "onnxruntime CPU, default session options"))
    cols += [("TVM unfused", "TVM, every op its own kernel, no schedule (TVM's default loop nests)"),
             ("TVM FuseOps", "TVM's own fusion (FuseOps + FuseTIR), no schedule")]
    return cols


def run_demo(target=None, json_out: bool = False, small: bool = False, repeat: int = 10,
             tuning_log: str | None = None) -> int:
    tgt = parse_target(target)
    configure_threads(None)
    ort = _onnxruntime()
    cols = columns(tuning_log, ort is not None)
    if not json_out:
        print("latency columns (ms per call, median of %d calls each, after 2 warm-up calls):" % repeat)
        for name, what in cols:
            print(f"  {name:12s} {what}")
        if ort is None:
            print("  (onnxruntime is not installed: `pip install onnxruntime` to see it beside tvmfuse)")
        print("  (x) = that column's time / tvmfuse's time (> 1: tvmfuse faster). Neither TVM column is how TVM "
              "is deployed on a CPU\n  (dlight rules or MetaSchedule): benchmarks/bench_cpu.py compares "
              "against those.\n")
    ok = True
    results = []
    for name, build in DEMO_MODELS.items():
        model = build(**({"seq": 32, "hidden": 64, "ffn": 256} if small and name == "transformer_block" else {}))
        feeds = random_feeds(model, seed=1)
        t0 = time.perf_counter()
        cm = tvmfuse_compile(model, target=tgt, name=name, tuning_log=tuning_log)
        compile_s = time.perf_counter() - t0
        ref = reference_outputs(model, feeds)
        out = cm.run(feeds)
        errs = {k: float(np.max(np.abs(out[k] - ref[k]))) for k in ref}
        passed = all(np.allclose(out[k], ref[k], rtol=DEMO_RTOL, atol=DEMO_ATOL) for k in ref)
        ok &= passed
        lat = {"tvmfuse": cm.benchmark(feeds, repeat=repeat)}
        time.sleep(PAUSE_S)
        if ort is not None:
            sess = _ort_session(ort, model)
            lat["onnxruntime"] = _median_s(lambda: sess.run(None, feeds), repeat)
        lat["TVM unfused"] = _baseline_latency(model, unfused_pipeline, tgt, feeds, repeat)
        lat["TVM FuseOps"] = _baseline_latency(model, stock_pipeline, tgt, feeds, repeat)
        entry = {"model": name, "check": "pass" if passed else "FAIL", "max_abs_error": errs,
                 "compile_s": round(compile_s, 2), "repeat": repeat,
                 "columns": dict(cols), "latency_ms": {k: v * 1e3 for k, v in lat.items()},
                 "report": cm.report.to_dict()}
        results.append(entry)
        if not json_out:
            print(cm.report.table())
            print(f"check vs onnx ReferenceEvaluator (rtol {DEMO_RTOL}, atol {DEMO_ATOL}): "
                  f"{'pass' if passed else 'FAIL'}  max abs error {max(errs.values()):.2e}")
            cells = [f"tvmfuse {lat['tvmfuse'] * 1e3:.3f}"] + [
                f"{k} {v * 1e3:.3f} ({_ratio(v / lat['tvmfuse'])})" for k, v in lat.items() if k != "tvmfuse"]
            where = " (onnxruntime on the CPU)" if ort is not None and is_gpu(tgt) else ""
            print(f"latency ms, median of {repeat} calls each{where}: " + " | ".join(cells)
                  + f"   compile {compile_s:.1f} s\n")
    if json_out:
        print(json.dumps(results, indent=2))
    print("demo: all checks passed" if ok else "demo: CHECK FAILED")
    return 0 if ok else 1
