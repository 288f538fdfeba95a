"""What is ``run()``'s extra over the VM call on the ``bench_cpu.py --io`` workloads? (issue 11, io10)

    TVM_NUM_THREADS=1 python benchmarks/io_gap.py                  # -> benchmarks/io_gap.json
    python benchmarks/io_gap.py --clock wall --json /tmp/io_gap_wall.json    # default threads, wall time

Table 3 read layernorm's ``run()`` / VM call at 1.07 (about 3 us of a 45 us call) where ``run()``'s own
steps cost about 0.9 us on a tiny model (Table 3c, warm caches).  This script separates the candidates in
one process, per model and size (a fixed cost per call stays the same when the data grows; an effect of
the memory grows with it):

- ``vm_views``: the VM's ``main`` on DLPack views of the numpy inputs (the baseline of every difference);
- ``run``: ``run(feeds)`` on those very arrays (numpy in, numpy out, the result dropped);
- ``vm_numpy_out``: ``vm_views`` plus what ``run()`` does after the kernels (the result's numpy view in
  a dict), without its input checks;
- ``vm_tensor``: the VM call on ``C.tensor`` copies (TVM's 64-byte-aligned memory: Table 3's VM-call
  column), ``vm_aligned`` / ``run_aligned``: the VM call / ``run()`` on ``tvmfuse.empty`` copies;
- ``vm_then_steps``: ``vm_views`` followed by a replica of ``run()``'s Python steps on other objects (the
  same work run after the kernel but not on its result: a cost of the steps in caches the kernel swept);
- ``tiny_*``: the same pair on a 2x16 LayerNorm after a numpy sweep of ``--sweep-mb`` megabytes each call
  (``tiny_vm_swept``, ``tiny_run_swept``) and without it (``tiny_vm``, ``tiny_run``): run()'s steps with
  warm and with swept caches, no large kernel involved.

Also per path: minor page faults per call (``getrusage``, after warm-up) and how many distinct result
addresses six calls return (the VM's pool alternates two buffers while results are dropped).  Timing:
blocks of back-to-back calls, every path once per round in a fresh seeded order, one untimed call before each
block; reported per path: the median per-call time and the paired per-round difference to the round's
baseline (``vm_views``; ``tiny_vm`` / ``tiny_vm_swept`` for the tiny pairs), median [p25, p75], in us.
Clock: the calling thread's CPU time (``--clock thread``, with ``TVM_NUM_THREADS=1``) or wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import time

import numpy as np

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M

HERE = os.path.dirname(os.path.abspath(__file__))

MODELS = {
    "layernorm_64": lambda: M.layernorm(rows=64, d=768, decomposed=False),
    "layernorm_512": lambda: M.layernorm(rows=512, d=768, decomposed=False),
    "layernorm_2048": lambda: M.layernorm(rows=2048, d=768, decomposed=False),
    "softmax_128": lambda: M.softmax(rows=128, d=3072, decomposed=False),
    "softmax_512": lambda: M.softmax(rows=512, d=3072, decomposed=False),
    "sigmoid_chain_1m": lambda: M.elementwise_chain(n=1024 * 1024),
    "sigmoid_chain_4m": lambda: M.elementwise_chain(n=4 * 1024 * 1024),
}
DEFAULT_MODELS = ("layernorm_64", "layernorm_512", "layernorm_2048", "softmax_512", "sigmoid_chain_4m")


def _aligned_copies(feeds: dict) -> dict:
    out = {}
    for k, v in feeds.items():
        out[k] = tvmfuse.empty(v.shape, v.dtype)
        out[k][...] = v
    return out


def _steps_replica(feeds: dict, name: str, other):
    """run()'s Python steps (input tests, the reference-count read, a numpy view, a dict) on objects the
    kernel does not produce: ``other`` is a tensor made once."""
    refs = C.strong_ref_count

    def steps():
        for v in feeds.values():
            type(v) is np.ndarray and v.shape == v.shape and v.flags.carray
        refs(other) <= 2 and other.data_ptr() != 0
        return {name: np.from_dlpack(other)}
    return steps


def _other_run(cm, io_path: str):
    """``run`` of model ``cm`` as the ``tvmfuse/io.py`` at ``io_path`` (e.g. the file at an earlier commit:
    ``git show REV:tvmfuse/io.py > /tmp/io_before.py``) makes it: its ``_Plan`` built on the same model
    and VM, so the two runs differ only in that file's code (a same-process A/B)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("tvmfuse._io_baseline", io_path)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "tvmfuse"
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    plan = mod._Plan(cm)
    fast = plan.run_static or plan.run_symbolic
    if fast is None:
        raise SystemExit(f"{io_path}: no fast path for this model (path {plan.path!r})")
    return fast


def paths(cm, feeds: dict, baseline_io: str | None = None) -> dict:
    f = cm._main()
    name = cm.outputs[0].name
    views = [C.from_dlpack(feeds[s.name]) for s in cm.inputs]
    tensors = [C.tensor(feeds[s.name]) for s in cm.inputs]
    aligned = _aligned_copies(feeds)
    aligned_views = [C.from_dlpack(aligned[s.name]) for s in cm.inputs]
    other = C.tensor(np.zeros(16, np.float32))
    steps = _steps_replica(feeds, name, other)
    ps = {
        "vm_views": lambda: f(*views),
        "run": lambda: cm.run(feeds),
        "vm_numpy_out": lambda: {name: np.from_dlpack(f(*views))},
        "vm_then_steps": lambda: (f(*views), steps()),
        "vm_tensor": lambda: f(*tensors),
        "vm_aligned": lambda: f(*aligned_views),
        "run_aligned": lambda: cm.run(aligned),
    }
    if baseline_io:
        other = _other_run(cm, baseline_io)
        ps["run_baseline_io"] = lambda: other(feeds)
    return ps


def tiny_paths(sweep_mb: float, baseline_io: str | None = None) -> dict:
    cm = tvmfuse.compile(M.layernorm(rows=2, d=16, decomposed=False), tuning_log=None)
    feeds = {s.name: np.random.default_rng(1).standard_normal(tuple(s.shape)).astype(np.float32)
             for s in cm.inputs}
    f = cm._main()
    views = [C.from_dlpack(feeds[s.name]) for s in cm.inputs]
    buf = np.zeros(int(sweep_mb * 1e6) // 4, np.float32)

    def sweep():
        np.add(buf, 1.0, out=buf)                 # reads and writes the buffer: the caches hold it after

    ps = {"tiny_vm": lambda: f(*views), "tiny_run": lambda: cm.run(feeds),
          "tiny_vm_swept": lambda: (sweep(), f(*views)), "tiny_run_swept": lambda: (sweep(), cm.run(feeds))}
    if baseline_io:
        other = _other_run(cm, baseline_io)
        ps["tiny_run_baseline_io"] = lambda: other(feeds)
        ps["tiny_run_swept_baseline_io"] = lambda: (sweep(), other(feeds))
    return ps


def _block(fn, calls: int, clock) -> float:
    fn()
    t = clock()
    for _ in range(calls):
        fn()
    return (clock() - t) / calls / 1e3


def page_faults(ps: dict, calls: int = 20) -> dict:
    out = {}
    for k, fn in ps.items():
        for _ in range(5):
            fn()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(calls):
            fn()
        out[k] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls
    return out


def result_addresses(ps: dict) -> dict:
    out = {}
    for k, fn in ps.items():
        seen = set()
        for _ in range(6):
            r = fn()
            if isinstance(r, tuple):                       # (sweep, call) or (call, steps)
                r = r[1] if r[0] is None else r[0]
            a = next(iter(r.values())) if isinstance(r, dict) else r
            seen.add(a.ctypes.data if isinstance(a, np.ndarray) else a.data_ptr())
            del r, a
        out[k] = len(seen)
    return out


def measure(ps: dict, calls: dict, rounds: int, clock, baselines: dict) -> dict:
    for k, fn in ps.items():
        _block(fn, max(1, calls[k] // 10), clock)
    times = {k: [] for k in ps}
    keys = list(ps)
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(keys)                      # a fresh seeded order each round (no path always after another)
        for k in keys:
            times[k].append(_block(ps[k], calls[k], clock))
    out = {}
    for k, v in times.items():
        base = np.array(times[baselines[k]])
        d = np.array(v) - base
        out[k] = {"median_us": float(np.median(v)), "baseline": baselines[k],
                  "minus_baseline_us": [float(np.median(d)), float(np.percentile(d, 25)), float(np.percentile(d, 75))],
                  "ratio": float(np.median(np.array(v) / base)), "us_by_round": v}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=sorted(MODELS))
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--block-ms", type=float, default=10.0, help="about this long per block")
    ap.add_argument("--sweep-mb", type=float, default=3.0, help="tiny_*_swept: megabytes swept per call")
    ap.add_argument("--no-tiny", action="store_true")
    ap.add_argument("--only-tiny", action="store_true")
    ap.add_argument("--paths", nargs="+", default=None, help="only these paths (and their baselines)")
    ap.add_argument("--baseline-io", default=None, help="also time run() as the tvmfuse/io.py at this path "
                    "makes it (run_baseline_io: a same-process A/B of two versions of io.py)")
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread")
    ap.add_argument("--json", default=os.path.join(HERE, "io_gap.json"))
    args = ap.parse_args(argv)
    clock = time.thread_time_ns if args.clock == "thread" else time.perf_counter_ns
    out = {"command": "python benchmarks/io_gap.py " + " ".join(argv or os.sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "clock": args.clock,
           "threads": os.environ.get("TVM_NUM_THREADS"), "rounds": args.rounds,
           "load_avg_start": os.getloadavg(), "models": {}}
    todo = ([] if args.only_tiny else [(m, MODELS[m]) for m in args.models]) + \
        ([] if args.no_tiny else [("tiny_layernorm_2x16", None)])
    for label, make in todo:
        if make is None:
            ps = tiny_paths(args.sweep_mb, args.baseline_io)
            baselines = {k: "tiny_vm_swept" if "swept" in k else "tiny_vm" for k in ps}
        else:
            cm = tvmfuse.compile(make(), tuning_log=None)
            feeds = {s.name: np.random.default_rng(0).standard_normal(tuple(s.shape)).astype(np.float32)
                     for s in cm.inputs}
            ps = paths(cm, feeds, args.baseline_io)
            baselines = {k: "vm_views" for k in ps}
        if args.paths:
            keep = set(args.paths) | {baselines[k] for k in args.paths if k in baselines}
            ps = {k: v for k, v in ps.items() if k in keep}
        one = {k: _block(fn, 3, time.perf_counter_ns) for k, fn in ps.items()}
        calls = {k: max(3, int(args.block_ms * 1e3 / max(us, 0.05))) for k, us in one.items()}
        res = measure(ps, calls, args.rounds, clock, baselines)
        faults, addrs = page_faults(ps), result_addresses(ps)
        out["models"][label] = {"paths": res, "page_faults_per_call": faults, "distinct_result_addresses": addrs,
                                "calls_per_block": calls}
        print(f"{label}  (load {os.getloadavg()[0]:.1f})")
        for k, v in res.items():
            m, p25, p75 = v["minus_baseline_us"]
            print(f"  {k:15s} {v['median_us']:9.2f} us   - {v['baseline']:13s} {m:+7.2f} [{p25:+.2f}, {p75:+.2f}]"
                  f"  ratio {v['ratio']:.3f}  faults/call {faults[k]:.1f}  result addresses {addrs[k]}")
    out["load_avg_end"] = os.getloadavg()
    with open(args.json, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
