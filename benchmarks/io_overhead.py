"""The fixed cost of ``run()`` over the VM call, step by step (issue 11: ``run()`` within 5% of the VM call).

    TVM_NUM_THREADS=1 python benchmarks/io_overhead.py     # -> benchmarks/io_overhead.json
    python benchmarks/io_overhead.py --quick --json /tmp/io_overhead.json

Models: two tiny ones (the kernels take about a microsecond, so what is timed is the Python around them):
LayerNorm over [2, 16] (one input) and the sigmoid chain over 64 elements (three inputs); and the
``resnet_block`` workload of ``bench_cpu.py`` (one input of 100 KB, a kernel of a few hundred us: there
run()'s steps run after the kernel has swept the caches).  Each compiled and as an exported artifact
(``Runner.run``).  Per model, microseconds per call of:

- ``vm_call``: the VM's ``main`` on device tensors (TVM's own copies of the inputs; Table 3's baseline),
  ``vm_views``: on DLPack views of the very numpy arrays ``run()`` gets (the same memory);
- ``run``: ``run(feeds)`` (numpy in, numpy out; the result dropped before the next call),
  ``run_kept``: the same with each result kept until the next call (a caller that holds its outputs),
  ``run_out``: ``run(feeds, outputs=...)`` into preallocated arrays (one copy per output),
  ``bind_run``: ``bind(feeds).run()``, ``run_general``: ``run()`` without the static path
  (``_Plan.run_static``; the checks every model took before it: the A/B pair of ``run``);
- run()'s steps on their own: ``checks`` (the per-model plan's input checks and DLPack views,
  ``_Plan.in_place``: the symbolic path's; the static path does the same compares inline, without the
  per-dim loop), ``dlpack_import`` (a fresh DLPack import of every input: what an array not seen
  in the last call costs), ``full_checks`` (``validate_feeds`` + ``_to_device``: feeds that fail the
  plan), ``output_view`` (``np.from_dlpack`` of a result), ``output_refs`` (the reference count read
  that tells a fresh result from a shared one).

Also per path, minor page faults per call (``run_keep_all``: a caller that keeps 50 results before
letting them go) and the Python and C function calls one call makes (``sys.setprofile``): counts, not
timings, the same under any load.

Table: per model, the medians over rounds and the paired per-round differences ``run - vm_views`` and
``run - vm_call`` (median [p25-p75]): run()'s fixed cost.  Clock: with ``TVM_NUM_THREADS=1`` the calling
thread's CPU time (other processes' load does not count in it); else wall time.  Paths are timed in
blocks of back-to-back calls, interleaved round by round with the order rotated.  Under load, read the
paired differences, not the absolute figures.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time

import numpy as np

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import io as IO
from tvmfuse import models as M

HERE = os.path.dirname(os.path.abspath(__file__))

MODELS = {
    "layernorm_2x16": (lambda: M.layernorm(rows=2, d=16, decomposed=False), 2000),
    "sigmoid_chain_64": (lambda: M.elementwise_chain(n=64), 2000),
    "resnet_block": (lambda: M.resnet_block(), 40),
}
STEPS = ("checks", "dlpack_import", "full_checks", "output_view", "output_refs")


def paths(m, feeds) -> dict:
    """name -> callable: the VM calls, the public calls, and run()'s steps."""
    f = m._main()
    device_args = [C.tensor(feeds[s.name]) for s in m.inputs]
    views = [C.from_dlpack(feeds[s.name]) for s in m.inputs]
    bound = m.bind(feeds)
    plan = m._io_plan()
    held = f(*views)
    outs = {s.name: np.empty(s.shape, s.dtype) for s in m.outputs}
    kept = [None]
    general = _without_static_path(m)
    arrays = [feeds[s.name] for s in m.inputs]
    return {
        "vm_call": lambda: f(*device_args),
        "vm_views": lambda: f(*views),
        "run": lambda: m.run(feeds),
        "run_general": lambda: general.run(feeds),
        "run_kept": lambda: kept.__setitem__(0, m.run(feeds)),
        "run_out": lambda: m.run(feeds, outputs=outs),
        "bind_run": bound.run,
        "checks": lambda: plan.in_place(feeds),
        "dlpack_import": lambda: [C.from_dlpack(a) for a in arrays],
        "full_checks": lambda: [m._to_device(v)[0] for v in IO.validate_feeds(feeds, m.inputs)],
        "output_view": lambda: np.from_dlpack(held) if type(held) is C.Tensor else None,
        "output_refs": lambda: C.strong_ref_count(held),
    }


def _without_static_path(m):
    """A copy of ``m`` (the same VM) whose ``run()`` does not take the static path: the A/B pair of run()."""
    g = copy.copy(m)
    g.__dict__.pop("_plan", None)
    g._io_plan().run_static = None
    return g


def _block(fn, calls: int, clock=time.perf_counter_ns) -> float:
    """Microseconds per call of ``calls`` back-to-back calls of ``fn``."""
    t = clock()
    for _ in range(calls):
        fn()
    return (clock() - t) / calls / 1e3


FAULT_PATHS = ("vm_call", "vm_views", "run", "run_kept", "run_out", "bind_run", "run_keep_all")


def page_faults(ps: dict, calls: int = 200) -> dict:
    """Minor page faults per call of each path after 20 warm-up calls (``getrusage``; not a timing, so
    load does not blur it): 0 where the outputs' memory comes back from the VM's pool every call."""
    import resource

    out = {}
    for k in FAULT_PATHS:
        for _ in range(20):
            ps[k]()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(calls):
            ps[k]()
        out[k] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls
    return out


CALL_PATHS = ("vm_views", "run", "run_general", "run_out", "bind_run")


def function_calls(ps: dict) -> dict:
    """Python and C function calls made by one call of each path (``sys.setprofile``; the path's own
    callable not counted): a count of run()'s steps that load does not change."""
    import sys

    out = {}
    for k in CALL_PATHS:
        ps[k]()
        count = [0]

        def profile(frame, event, arg):
            if event in ("call", "c_call"):
                count[0] += 1

        sys.setprofile(profile)
        try:
            ps[k]()
        finally:
            sys.setprofile(None)
        out[k] = count[0] - 1
    return out


def measure(m, feeds, calls: int, rounds: int, clock) -> dict:
    ps = paths(m, feeds)
    keep_all = []                        # a caller that keeps every result (up to 50, then lets them go)
    ps_faults = {**ps, "run_keep_all": lambda: keep_all.append(m.run(feeds)) if len(keep_all) < 50
                 else keep_all.clear()}
    keys = list(ps)
    for fn in ps.values():
        _block(fn, max(1, calls // 4), clock)
    times = {k: [] for k in keys}
    for r in range(rounds):
        k0 = r % len(keys)
        for k in keys[k0:] + keys[:k0]:
            times[k].append(_block(ps[k], calls, clock))
    run = np.array(times["run"])
    faults = page_faults(ps_faults)
    fcalls = function_calls(ps)
    out = {"us_median": {k: float(np.median(v)) for k, v in times.items()},
           "us_min": {k: float(min(v)) for k, v in times.items()}, "us_by_round": times,
           "minor_faults_per_call": faults, "function_calls_per_call": fcalls}
    for base in ("vm_views", "vm_call"):
        d = run - np.array(times[base])
        out[f"run_minus_{base}_us"] = [float(np.median(d)), float(np.percentile(d, 25)), float(np.percentile(d, 75))]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=21, help="blocks per path (interleaved)")
    ap.add_argument("--scale", type=float, default=1.0, help="calls per block: this times each model's default")
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--quick", action="store_true", help="5 rounds of a tenth of the calls (a smoke run)")
    ap.add_argument("--json", default=os.path.join(HERE, "io_overhead.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.scale = 5, 0.1
    threads = os.environ.get("TVM_NUM_THREADS")
    clock, clock_name = ((time.thread_time_ns, "thread CPU time") if threads == "1"
                         else (time.perf_counter_ns, "wall time"))
    work = tempfile.mkdtemp(prefix="io-overhead-")
    rows = []
    print(f"TVM_NUM_THREADS={threads or '(default)'}, clock: {clock_name}, load average {os.getloadavg()}")
    head = (f"{'model':17s} {'kind':9s} {'vm_call':>8s} {'vm_views':>8s} {'run':>8s} {'run_kept':>8s} "
            f"{'run_out':>8s} {'bind_run':>8s} {'run_gen':>8s} | {'run - vm_views [p25-p75]':>25s} "
            f"{'run - vm_call':>14s} | "
            + " ".join(f"{s:>13s}" for s in STEPS))
    print(head)
    for name in args.models:
        make, calls = MODELS[name]
        model = make()
        rng = np.random.default_rng(0)
        feeds = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in M.random_feeds(model).items()}
        cm = tvmfuse.compile(model, tuning_log=None)
        for kind, m in [("compiled", cm), ("artifact", tvmfuse.load(tvmfuse.export(cm, os.path.join(work, name))))]:
            r = measure(m, feeds, max(1, int(calls * args.scale)), args.rounds, clock)
            us, dv, dc = r["us_median"], r["run_minus_vm_views_us"], r["run_minus_vm_call_us"]
            rows.append({"model": name, "kind": kind, "inputs": len(m.inputs), "calls": max(1, int(calls * args.scale)),
                         "fast_path": m._io_plan().path, **r})
            print(f"{name:17s} {kind:9s} " + " ".join(f"{us[k]:8.2f}" for k in
                                                     ("vm_call", "vm_views", "run", "run_kept", "run_out", "bind_run",
                                                      "run_general"))
                  + f" | {dv[0]:9.2f} [{dv[1]:6.2f}-{dv[2]:6.2f}] {dc[0]:14.2f} | "
                  + " ".join(f"{us[s]:13.3f}" for s in STEPS), flush=True)
            print(f"{'':27s} minor page faults per call: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in r["minor_faults_per_call"].items())
                  + "; function calls per call: "
                  + ", ".join(f"{k} {v}" for k, v in r["function_calls_per_call"].items()), flush=True)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": C.llvm_system_cpu(),
           "tvm_num_threads": threads, "clock": clock_name, "load_avg_end": os.getloadavg(),
           "rounds": args.rounds, "quick": args.quick, "rows": rows}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
