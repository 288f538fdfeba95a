"""Kernel-only A/B of CPU attention knob variants (issue 14): the attention kernel of
``bench_attention.attention_model`` (batch 1, heads-interleaved [b, s, heads * dim] tensors, as exported),
scheduled with the target default and with each ``--variant`` (a JSON object of knobs over the default),
built for the host, timed interleaved with TVM's time evaluator (rounds x variants, order rotated each round).
Output: one JSON line per variant (median and min ms over rounds, GFLOP/s of the QK^T and PV multiply-adds,
and the median over rounds of its time / the default's time in the same round).

    PYTHONPATH=. python benchmarks/attention_ab.py --seq 512 --variant '{"k_block": 64}' --threads 2

Each kernel goes through tvmfuse.fastmath after scheduling, as the pipeline's kernels do.
    PYTHONPATH=. python benchmarks/attention_ab.py --seq 512 --quick      # a check that it runs

``--models`` also times, in the same interleaved rounds, the whole compiled model through
``CompiledModel.run`` with the attention rule on (``model:fused``) and off (``model:unfused``, the S x S
scores through memory): issue 14's ratio, paired per round (``unfused_over_fused_paired_median``).

With ``--threads 1`` the figure is the calling thread's CPU time (``time.thread_time``: time the thread
spent descheduled by other load does not count).  Timings are only comparable within one run (interleaved); under load only large differences count.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bench_attention", os.path.join(ROOT, "benchmarks", "bench_attention.py"))
bench_attention = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_attention)


def attention_kernel(seq: int, heads: int, head_dim: int, causal: bool, target):
    """The attention PrimFunc of the benchmark's ONNX graph (unscheduled), and its template match."""
    import tvmfuse
    from tvmfuse import _compat as C
    from tvmfuse.schedules.cpu.attention import ATTR, Attention

    cm = tvmfuse.compile(bench_attention.attention_model(seq, heads, head_dim, causal), target, schedules=False)
    funcs = [f for f in cm.fused_module.functions.values()
             if isinstance(f, C.PrimFunc) and f.attrs is not None and ATTR in f.attrs]
    if len(funcs) != 1:
        raise RuntimeError(f"expected one attention kernel, found {len(funcs)}")
    t = Attention()
    return t, t.match(funcs[0], target), funcs[0]


def main() -> None:
    from tvmfuse import _compat as C
    from tvmfuse import target as TG
    from tvmfuse.fastmath import rewrite
    from tvmfuse.schedules.base import schedule_with

    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="TVM threads (default: the host's cores)")
    ap.add_argument("--variant", action="append", default=[], help="JSON knobs over the default")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--number", type=int, default=0, help="calls per timing (0: about 0.1 s)")
    ap.add_argument("--quick", action="store_true", help="small shapes, 2 rounds: a check that it runs")
    ap.add_argument("--models", action="store_true",
                    help="also time the compiled model with the attention rule on and off (CompiledModel.run)")
    ap.add_argument("--mattr", default=None, help="LLVM -mattr for the host target (e.g. -avx512f: AVX2 code)")
    args = ap.parse_args()
    if args.threads:
        os.environ["TVM_NUM_THREADS"] = str(args.threads)      # before TVM's thread pool exists
    if args.quick:
        args.seq, args.heads, args.head_dim, args.rounds = 40, 2, 16, 2
    target = TG.host_target(args.threads)
    if args.mattr:
        target = C.Target({**{k: v for k, v in target.export().items() if k in ("kind", "mcpu", "mtriple", "num-cores")},
                           "mattr": args.mattr.split(",")})
    if args.threads:
        C.set_runtime_threads(args.threads)
    t, match, func = attention_kernel(args.seq, args.heads, args.head_dim, args.causal, target)
    default = t.default_config(match, target)
    space = t.space(match, target)
    variants = [("default", default)]
    for v in args.variant:
        cfg = {**default, **json.loads(v)}
        if not space.contains(cfg):
            raise SystemExit(f"variant {v} is outside the knob space")
        variants.append((v, cfg))
    rng = np.random.default_rng(0)
    shapes = [[int(d) for d in C.tensor_shape(p)] for p in func.params]
    inputs = [rng.standard_normal(s).astype(np.float32) for s in shapes[:-1]]
    expect = None
    runs = []
    for name, cfg in variants:
        fast, _ = rewrite(schedule_with(t, match, func, cfg))      # tvmfuse.fastmath, as the pipeline does
        lib = C.build_prim_module(C.IRModule({"main": fast.with_attr("global_symbol", "main")}), target)
        arr = [C.tensor(a) for a in inputs] + [C.tensor(np.zeros(shapes[-1], np.float32))]
        lib["main"](*arr)
        out = arr[-1].numpy()
        if expect is None:
            expect = out
        elif not np.allclose(out, expect, rtol=1e-4, atol=1e-5):
            raise SystemExit(f"variant {name} disagrees with the default")
        runs.append((name, cfg, lib, arr))
    model_runs = []
    if args.models:
        import tvmfuse

        onnx_model = bench_attention.attention_model(args.seq, args.heads, args.head_dim, args.causal)
        feeds = dict(zip("qkv", inputs[:3])) if len(inputs) == 3 else None
        if feeds is None:
            raise SystemExit("--models needs the q, k, v kernel (no mask operand)")
        for name, on in (("model:fused", True), ("model:unfused", False)):
            cm = tvmfuse.compile(onnx_model, target, num_threads=args.threads, attention=on)
            out = cm.run(feeds)
            y = out["y"] if isinstance(out, dict) else out[0]
            if not np.allclose(np.asarray(y).reshape(expect.shape), expect, rtol=1e-4, atol=1e-5):
                raise SystemExit(f"{name} disagrees with the kernel")
            model_runs.append((name, {"attention": on, "kernels": cm.kernel_count}, cm, feeds))
    number = args.number
    if not number:
        f, a = runs[0][2]["main"], runs[0][3]
        t0 = time.perf_counter()
        f(*a)
        number = max(1, int(0.1 / max(time.perf_counter() - t0, 1e-6)))
    everything = runs + model_runs
    times = {name: [] for name, *_ in everything}
    for r in range(args.rounds):
        order = everything[r % len(everything):] + everything[:r % len(everything)]
        for name, cfg, lib, arr in order:
            if name.startswith("model:"):      # CompiledModel.run(feeds): calls per timing as the kernel's
                clock = time.thread_time if args.threads == 1 else time.perf_counter
                t0 = clock()
                for _ in range(number):
                    lib.run(arr)
                times[name].append((clock() - t0) / number * 1e3)
            elif args.threads == 1:      # the calling thread runs the kernel: its CPU time (not the wall clock)
                f = lib["main"]
                t0 = time.thread_time()
                for _ in range(number):
                    f(*arr)
                times[name].append((time.thread_time() - t0) / number * 1e3)
            else:
                ev = C.time_function(lib.mod if hasattr(lib, "mod") else lib, "main", arr[0].device,
                                     number=number, repeat=1)
                times[name].append(ev(*arr).mean * 1e3)
    flops = 4.0 * args.heads * args.seq * args.seq * args.head_dim * (0.5 if args.causal else 1.0)
    base = times["default"]
    for name, cfg, *_ in everything:
        med = statistics.median(times[name])
        # per round, this variant's time over the default's (the same round: load drifts cancel)
        paired = statistics.median(t / b for t, b in zip(times[name], base))
        print(json.dumps({"variant": name, "seq": args.seq, "causal": args.causal, "threads": args.threads,
                          "target": str(target),
                          "median_ms": round(med, 4), "min_ms": round(min(times[name]), 4),
                          "gflops_median": round(flops / med / 1e6, 1),
                          "vs_default_paired_median": round(paired, 4), "config": cfg,
                          **({"unfused_over_fused_paired_median": round(statistics.median(
                              u / f for u, f in zip(times["model:unfused"], times["model:fused"])), 4)}
                             if name == "model:unfused" else {}),
                          "clock": "thread_time (one thread)" if args.threads == 1 else "wall (time evaluator)",
                          "note": ("CompiledModel.run" if name.startswith("model:") else "kernel only")
                          + ", interleaved, measured under load"}))


if __name__ == "__main__":
    main()
