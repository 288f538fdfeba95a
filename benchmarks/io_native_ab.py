"""run() with and without its native step (``tvmfuse.runtime_native``) against the VM call, paired (io11).

    TVM_NUM_THREADS=1 python benchmarks/io_native_ab.py --rounds 31 --json out.json
    python benchmarks/io_native_ab.py --clock wall --models layernorm_512 softmax_512 sigmoid_chain_4m
    python benchmarks/io_native_ab.py --models layernorm_512 --target "llvm -mcpu=haswell -num-cores=1" --export /tmp/ln
    valgrind --tool=cachegrind ... python benchmarks/io_native_ab.py --drive PATH --artifact /tmp/ln --calls 200

Per model, in one process: the model compiled once and used through three objects (``copy.copy``: each
its own plan over the same VM), whose ``run`` is the native step (``run_native``), the Python path
(``run_python``; the plan made with the native step turned off), and the VM's ``main`` called on the
DLPack view of the same numpy array (``vm``); all three read the same input memory and get their outputs
from the same VM pool.  Timing: blocks of back-to-back calls, every path once per round in a fresh seeded
order, one untimed call before each block; reported: per path the median us per call, and the paired
per-round differences run - vm (us) and ratios run / vm, median [p25, p75] and a 90% bootstrap interval.

``--drive PATH``: no timing; make the path's callable (``vm``, ``run_native``, ``run_python``), call it
``--warmup`` times and then ``--calls`` times (what cachegrind counts: run it with --calls 0 and N and
take the difference).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time

import numpy as np

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse import runtime_native

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_cpu import paired_ratio  # noqa: E402

MODELS = {
    "layernorm_2x16": lambda: M.layernorm(rows=2, d=16, decomposed=False),
    "layernorm_64": lambda: M.layernorm(rows=64, d=768, decomposed=False),
    "layernorm_512": lambda: M.layernorm(rows=512, d=768, decomposed=False),
    "softmax_512": lambda: M.softmax(rows=512, d=3072, decomposed=False),
    "sigmoid_chain_4m": lambda: M.elementwise_chain(n=4 * 1024 * 1024),   # 3 inputs: the Python path only
}
PATHS = ("vm", "run_native", "run_python")
ORDER_SEED = 11


def make_paths(cm) -> tuple[dict, dict]:
    """({path: callable}, feeds): the three paths on one compiled model (or loaded artifact) and one numpy
    input."""
    rng = np.random.default_rng(0)
    feeds = {s.name: rng.standard_normal(s.shape).astype(s.dtype) for s in cm.inputs}
    if len(cm.outputs) != 1:
        raise ValueError(f"the native step takes one-output models, this one has {len(cm.outputs)} outputs")
    py, nat = copy.copy(cm), copy.copy(cm)
    runtime_native._reset_for_tests(enabled=False)
    py.run(feeds)                                        # its plan: the Python path
    runtime_native._reset_for_tests()
    if runtime_native.load() is None:
        raise SystemExit(f"io_native_ab: the native step is unavailable: {runtime_native.reason()}")
    nat.run(feeds)
    if len(cm.inputs) == 1:        # one input: run_native; several: the general loop with call_many
        assert nat.run.__name__ == "run" and "native" in nat.run.__code__.co_name, nat.run.__code__.co_name
        assert "native" not in py.run.__code__.co_name
    ref = py.run(feeds)
    got = nat.run(feeds)
    for k in ref:
        np.testing.assert_array_equal(ref[k], got[k])
    f = cm._main()
    args = [C.from_dlpack(feeds[s.name]) for s in cm.inputs]
    run_native, run_python = nat.run, py.run
    return {"vm": lambda: f(*args), "run_native": lambda: run_native(feeds),
            "run_python": lambda: run_python(feeds)}, feeds


def _time(fn, clock, block_s: float) -> float:
    fn()
    n, t0 = 0, clock()
    while True:
        fn()
        n += 1
        dt = clock() - t0
        if dt >= block_s * 1e9:
            return dt / n / 1e3           # us per call


def measure(paths: dict, rounds: int, clock, block_s: float) -> dict:
    rng = random.Random(ORDER_SEED)
    by_round = {p: [] for p in paths}
    for _ in range(rounds):
        order = list(paths)
        rng.shuffle(order)
        for p in order:
            by_round[p].append(_time(paths[p], clock, block_s))
    out = {"us": {p: float(np.median(v)) for p, v in by_round.items()}, "by_round": by_round}
    for p in ("run_native", "run_python"):
        d = np.array(by_round[p]) - np.array(by_round["vm"])
        out[f"{p}-vm_us"] = {"median": float(np.median(d)), "p25": float(np.percentile(d, 25)),
                             "p75": float(np.percentile(d, 75))}
        r = paired_ratio(by_round[p], by_round["vm"])
        out[f"{p}/vm"] = {k: r[k] for k in ("median", "p25", "p75", "ci")}
    r = paired_ratio(by_round["run_native"], by_round["run_python"])
    out["run_native/run_python"] = {k: r[k] for k in ("median", "p25", "p75", "ci")}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=["layernorm_2x16", "layernorm_512"], choices=sorted(MODELS))
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--block-s", type=float, default=0.05, help="seconds of calls per timed block")
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--drive", choices=PATHS, help="no timing: call this path (for cachegrind)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--target", help="compile for this target (default: the host's)")
    ap.add_argument("--export", help="with --drive: export the model's artifact to this directory and stop")
    ap.add_argument("--artifact", help="with --drive: load this artifact (tvmfuse.load) instead of compiling")
    args = ap.parse_args(argv)

    def build(name):
        return tvmfuse.compile(MODELS[name](), args.target, tuning_log=None)

    if args.export:
        tvmfuse.export(build(args.models[0]), args.export)
        return 0
    if args.drive:
        paths, _ = make_paths(tvmfuse.load(args.artifact) if args.artifact else build(args.models[0]))
        fn = paths[args.drive]
        for _ in range(args.warmup + args.calls):
            fn()
        return 0
    clock = time.thread_time_ns if args.clock == "thread" else time.perf_counter_ns
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_avg_start": os.getloadavg(),
              "clock": args.clock, "threads": os.environ.get("TVM_NUM_THREADS", "default"),
              "rounds": args.rounds, "command": "python benchmarks/io_native_ab.py " + " ".join(argv or sys.argv[1:]),
              "models": {}}
    for name in args.models:
        try:
            paths, _ = make_paths(build(name))
        except ValueError as e:
            print(f"{name}: skipped: {e}", flush=True)
            report["models"][name] = {"skipped": str(e)}
            continue
        res = measure(paths, args.rounds, clock, args.block_s)
        report["models"][name] = res
        print(f"{name}: vm {res['us']['vm']:.2f} us | run native - vm {res['run_native-vm_us']['median']:+.2f} "
              f"[{res['run_native-vm_us']['p25']:+.2f}, {res['run_native-vm_us']['p75']:+.2f}] us, ratio "
              f"{res['run_native/vm']['median']:.3f} [{res['run_native/vm']['ci'][0]:.3f}-"
              f"{res['run_native/vm']['ci'][1]:.3f}] | run python - vm {res['run_python-vm_us']['median']:+.2f} "
              f"[{res['run_python-vm_us']['p25']:+.2f}, {res['run_python-vm_us']['p75']:+.2f}] us, ratio "
              f"{res['run_python/vm']['median']:.3f} [{res['run_python/vm']['ci'][0]:.3f}-"
              f"{res['run_python/vm']['ci'][1]:.3f}] | native/python {res['run_native/run_python']['median']:.3f} "
              f"[{res['run_native/run_python']['ci'][0]:.3f}-{res['run_native/run_python']['ci'][1]:.3f}]",
              flush=True)
    report["load_avg_end"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
