"""``tvmfuse demo``: compile the built-in example models, check them against the op-by-op reference,
print the fusion report and the latency next to TVM's unfused and stock-fused builds."""
from __future__ import annotations

import json
import time

import numpy as np

from . import _compat as C
from .compiled import compile as tvmfuse_compile
from .models import DEMO_MODELS, reference_outputs, random_feeds
from .pipeline import stock_pipeline, unfused_pipeline
from .target import configure_threads, parse_target

# float32, op-by-op reference vs. fused kernels that reorder sums and use approximations of exp/erf.
DEMO_RTOL, DEMO_ATOL = 1e-4, 1e-5


def _baseline_latency(model, pipeline_factory, target, feeds, repeat: int) -> float:
    from .frontend import load_onnx

    mod = load_onnx(model)
    ex = C.compile_module(mod, target, relax_pipeline=pipeline_factory(target))
    dev = C.device_for(target)
    vm = C.VirtualMachine(ex, dev)
    args = [C.tensor(v, dev) for v in feeds.values()]
    vm["main"](*args)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        vm["main"](*args)
        dev.sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def run_demo(target=None, json_out: bool = False, small: bool = False, repeat: int = 10,
             tuning_log: str | None = None) -> int:
    tgt = parse_target(target)
    configure_threads(None)
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
        lat = cm.benchmark(feeds, repeat=repeat)
        lat_unfused = _baseline_latency(model, unfused_pipeline, tgt, feeds, max(3, repeat // 3))
        lat_stock = _baseline_latency(model, stock_pipeline, tgt, feeds, max(3, repeat // 3))
        entry = {"model": name, "check": "pass" if passed else "FAIL", "max_abs_error": errs,
                 "compile_s": round(compile_s, 2), "latency_ms": {"tvmfuse": lat * 1e3,
                 "tvm_unfused": lat_unfused * 1e3, "tvm_stock_fusion": lat_stock * 1e3},
                 "report": cm.report.to_dict()}
        results.append(entry)
        if not json_out:
            print(cm.report.table())
            print(f"check vs onnx ReferenceEvaluator (rtol {DEMO_RTOL}, atol {DEMO_ATOL}): "
                  f"{'pass' if passed else 'FAIL'}  max abs error {max(errs.values()):.2e}")
            print(f"latency (median of {repeat}): tvmfuse {lat * 1e3:.3f} ms | TVM unfused "
                  f"{lat_unfused * 1e3:.3f} ms ({lat_unfused / lat:.1f}x) | TVM stock fusion "
                  f"{lat_stock * 1e3:.3f} ms ({lat_stock / lat:.1f}x)   compile {compile_s:.1f} s\n")
    if json_out:
        print(json.dumps(results, indent=2))
    print("demo: all checks passed" if ok else "demo: CHECK FAILED")
    return 0 if ok else 1
