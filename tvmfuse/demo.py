"""``tvmfuse demo``: compile the built-in example models, check them against the op-by-op reference,
print the fusion report and the latency next to onnxruntime (when installed) and TVM's untuned route
(TVM's own fusion, kernels scheduled by dlight's rules for the target: ``tvmfuse.dlight_pipeline``).

Every latency column is the median of the same number of calls (``repeat``, after WARMUP_CALLS), all
measured in this run, timed one engine after the other with a pause between engines (PAUSE_S) so that one
runtime's idle workers do not slow the next.  This is a quick look, not a benchmark: ``benchmarks/
bench_cpu.py`` times engines in separate processes in interleaved rounds, TVM MetaSchedule (tuned: minutes
to hours, not run here) and torch.compile too.
"""
from __future__ import annotations

import json
import time

import numpy as np

from . import _compat as C
from .compiled import compile as tvmfuse_compile
from .models import DEMO_MODELS, reference_outputs, random_feeds
from .pipeline import dlight_pipeline
from .target import configure_threads, is_gpu, parse_target

# float32, op-by-op reference vs. fused kernels that reorder sums and use approximations of exp/erf.
DEMO_RTOL, DEMO_ATOL = 1e-4, 1e-5
PAUSE_S = 0.2   # between two engines' timings: lets idle spinning worker threads go to sleep
WARMUP_CALLS = 2   # untimed calls of every engine before its timed ones


def _median_s(fn, repeat: int, sync=None, warmup: int = WARMUP_CALLS) -> float:
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


def _arrays(res) -> list[np.ndarray]:
    """An engine's outputs (a dict, a list, a VM tensor or tuple of them) as numpy arrays in output order."""
    if isinstance(res, dict):
        return [np.asarray(v) for v in res.values()]
    if hasattr(res, "numpy"):
        return [res.numpy()]
    if isinstance(res, np.ndarray):
        return [res]
    return [a for r in res for a in _arrays(r)]


def check_outputs(outputs, ref: dict) -> dict:
    """``{"check": "pass"|"FAIL", "max_abs_error": ...}`` of an engine's outputs against the reference's
    (same order, shapes, rtol DEMO_RTOL / atol DEMO_ATOL)."""
    outs, refs = _arrays(outputs), list(ref.values())
    if len(outs) != len(refs):
        return {"check": "FAIL", "why": f"{len(outs)} outputs, the reference has {len(refs)}"}
    for o, r in zip(outs, refs):
        if o.shape != r.shape:
            return {"check": "FAIL", "why": f"output shape {o.shape}, the reference's {r.shape}"}
    ok = all(np.allclose(o, r, rtol=DEMO_RTOL, atol=DEMO_ATOL) for o, r in zip(outs, refs))
    err = max(float(np.max(np.abs(o.astype(np.float64) - r))) if o.size else 0.0 for o, r in zip(outs, refs))
    return {"check": "pass" if ok else "FAIL", "max_abs_error": err}


def _baseline(model, pipeline_factory, target, feeds, repeat: int) -> tuple[float, list]:
    """(median seconds per call, outputs of the first call) of ``model`` built by ``pipeline_factory``."""
    from .frontend import load_onnx

    mod = load_onnx(model)
    ex = C.compile_module(mod, target, relax_pipeline=pipeline_factory(target))
    dev = C.device_for(target)
    vm = C.VirtualMachine(ex, dev)
    args = [C.tensor(v, dev) for v in feeds.values()]
    f = vm["main"]
    outputs = _arrays(f(*args))
    return _median_s(lambda: f(*args), repeat, sync=dev.sync), outputs


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


TVM_DLIGHT = "TVM dlight"


def columns(tuning_log: str | None, ort_available: bool, gpu: bool = False) -> list[tuple[str, str]]:
    """(name, what it is) of every latency column the demo prints, tvmfuse's first."""
    tuned = ("untuned: each kernel's template default for the target" if tuning_log is None else
             "with the tuning records shipped in tuning_logs/" if tuning_log == "shipped" else
             f"with the tuning records of {tuning_log}")
    cols = [("tvmfuse", f"tvmfuse, {tuned}")]
    if ort_available:
        cols.append(("onnxruntime", "onnxruntime CPU, default session options (numpy in/out)"))
    rules = ("dlight's GPU rules (Matmul, GEMV, Reduction, GeneralReduction, Fallback)" if gpu else
             "dlight's CPU rules (GEMV, Reduction; a kernel neither matches keeps TVM's default loop nest)")
    cols.append((TVM_DLIGHT, f"TVM untuned: TVM's fusion (FuseOps + FuseTIR), kernels scheduled by {rules}"))
    return cols


def run_demo(target=None, json_out: bool = False, small: bool = False, repeat: int = 10,
             tuning_log: str | None = None) -> int:
    tgt = parse_target(target)
    configure_threads(None)
    ort = _onnxruntime()
    cols = columns(tuning_log, ort is not None, gpu=is_gpu(tgt))
    if not json_out:
        print(f"latency columns (ms per call, median of {repeat} calls each, after {WARMUP_CALLS} warm-up calls, "
              "all measured in this run):")
        for name, what in cols:
            print(f"  {name:12s} {what}")
        if ort is None:
            print("  (onnxruntime is not installed: `pip install onnxruntime` to see it beside tvmfuse)")
        print("  (x) = that column's time / tvmfuse's time (> 1: tvmfuse faster). TVM tuned by MetaSchedule "
              "(minutes to hours of\n  tuning) is not run here: benchmarks/bench_cpu.py --ms-trials N times it "
              "beside these.\n")
    ok = True
    results = []
    for name, build in DEMO_MODELS.items():
        model = build(**({"seq": 32, "hidden": 64, "ffn": 256} if small and name == "transformer_block" else {}))
        feeds = random_feeds(model, seed=1)
        t0 = time.perf_counter()
        cm = tvmfuse_compile(model, target=tgt, name=name, tuning_log=tuning_log)
        compile_s = time.perf_counter() - t0
        ref = reference_outputs(model, feeds)
        checks = {"tvmfuse": check_outputs(cm.run(feeds), ref)}
        lat = {"tvmfuse": cm.benchmark(feeds, repeat=repeat, warmup=WARMUP_CALLS)}
        time.sleep(PAUSE_S)
        if ort is not None:
            sess = _ort_session(ort, model)
            checks["onnxruntime"] = check_outputs(sess.run(None, feeds), ref)
            lat["onnxruntime"] = _median_s(lambda: sess.run(None, feeds), repeat)
        lat[TVM_DLIGHT], outs = _baseline(model, dlight_pipeline, tgt, feeds, repeat)
        checks[TVM_DLIGHT] = check_outputs(outs, ref)
        passed = all(c["check"] == "pass" for c in checks.values())
        ok &= passed
        entry = {"model": name, "check": "pass" if passed else "FAIL", "checks": checks,
                 "compile_s": round(compile_s, 2), "repeat": repeat, "warmup": WARMUP_CALLS,
                 "columns": dict(cols), "latency_ms": {k: v * 1e3 for k, v in lat.items()},
                 "report": cm.report.to_dict()}
        results.append(entry)
        if not json_out:
            print(cm.report.table())
            print(f"check vs onnx ReferenceEvaluator (rtol {DEMO_RTOL}, atol {DEMO_ATOL}): " + " | ".join(
                f"{k} {c['check']} ({'max abs error %.2e' % c['max_abs_error'] if 'max_abs_error' in c else c['why']})"
                for k, c in checks.items()))
            cells = [f"tvmfuse {lat['tvmfuse'] * 1e3:.3f}"] + [
                f"{k} {v * 1e3:.3f} ({_ratio(v / lat['tvmfuse'])})" for k, v in lat.items() if k != "tvmfuse"]
            where = " (onnxruntime on the CPU)" if ort is not None and is_gpu(tgt) else ""
            print(f"latency ms, median of {repeat} calls each{where}: " + " | ".join(cells)
                  + f"   compile {compile_s:.1f} s\n")
    if json_out:
        print(json.dumps(results, indent=2))
    print("demo: all checks passed" if ok else "demo: CHECK FAILED")
    return 0 if ok else 1
