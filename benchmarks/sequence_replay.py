"""Where a model's run() time goes beyond its kernels' warm times, at one thread: ``run()`` against the same
kernel calls replayed from Python in the model's order (each call timed) and each kernel called alone.

    TVM_NUM_THREADS=1 PYTHONPATH=. python benchmarks/sequence_replay.py squeezenet1_1 [--rounds 5] [--json out.json]

The calls and their arguments are captured from one instrumented run of a second build of the model (the
instrument stays on that VM; ``run()`` is timed on an uninstrumented one).  Per call: the kernel's time
inside the sequence (the kernels before it ran just before: the caches hold what they left) against the
same call repeated alone (its weights and inputs warm), both the calling thread's CPU time
(``time.thread_time``, min over rounds; TVM_NUM_THREADS=1: ``main`` sets it unless the caller did), so a
kernel's "in sequence - alone" is what cold caches cost it, and "run - in-sequence sum" is what the VM and
``run()`` add around the kernels.  ``profile_kernels.py``'s in-model column instead times each kernel from
a Python VM instrument called on every VM instruction (its callbacks run between the kernels, and a kernel
called twice per run is summed over its calls): it overstates the in-model cost.
Every number is measured under whatever load the machine had: relative shares, not figures to quote.
"""
from __future__ import annotations

import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_common import model_parser, one_thread_model, write_json  # noqa: E402


def capture(cm, feeds: dict) -> list:
    """(kernel name, argument copies) of every kernel call of one run, in order (instrumented)."""
    from tvmfuse import _compat as C

    kernels = {gv.name_hint for gv, f in cm.fused_module.functions.items() if isinstance(f, C.PrimFunc)}
    seq = []

    def instrument(func, symbol, before_run, ret_value, *args):
        if before_run and str(symbol) in kernels:
            seq.append((str(symbol), [a.numpy().copy() for a in args]))
        return 0      # VMInstrumentReturnKind.NO_OP: run the call

    cm.vm.set_instrument(instrument)
    cm.run(feeds)
    return seq


def _cpu_us(fn, number: int) -> float:
    t0 = time.thread_time()
    for _ in range(number):
        fn()
    return (time.thread_time() - t0) / number * 1e6


def profile(path: str, feeds: dict, rounds: int, number: int) -> dict:
    import tvmfuse
    from tvmfuse import _compat as C

    cm = tvmfuse.compile(path)
    probe = tvmfuse.compile(path)                 # instrumented (its instrument cannot be removed)
    lib = probe.executable.mod.imports[0]
    calls = [(name, lib[name], [C.tensor(a, probe.device) for a in args]) for name, args in capture(probe, feeds)]

    def run():
        cm.run(feeds)

    def sequence() -> list:
        ts = []
        for _, f, a in calls:
            t0 = time.thread_time()
            f(*a)
            ts.append(time.thread_time() - t0)
        return ts

    run()
    sequence()
    run_us, seq_us, alone_us = [], [[] for _ in calls], [[] for _ in calls]
    for _ in range(rounds):                       # interleaved: run, the sequence, each call alone
        run_us.append(_cpu_us(run, number))
        best = None
        for _ in range(number):
            ts = sequence()
            best = ts if best is None else [min(x, y) for x, y in zip(best, ts)]
        for i, t in enumerate(best):
            seq_us[i].append(t * 1e6)
        for i, (_, f, a) in enumerate(calls):
            alone_us[i].append(_cpu_us(lambda f=f, a=a: f(*a), number))
    rows = [{"kernel": name, "alone_us": round(min(alone_us[i]), 1), "in_sequence_us": round(min(seq_us[i]), 1),
             "other_inputs_kB": round(sum(x.numpy().nbytes for x in a[1:-1]) / 1e3)}
            for i, (name, _, a) in enumerate(calls)]
    return {"calls": rows, "run_min_us": round(min(run_us), 1),
            "in_sequence_sum_us": round(sum(r["in_sequence_us"] for r in rows), 1),
            "alone_sum_us": round(sum(r["alone_us"] for r in rows), 1),
            "clock": "thread_time, TVM_NUM_THREADS=" + os.environ.get("TVM_NUM_THREADS", "?")
                     + ", min over rounds, measured under load"}


def main(argv=None) -> int:
    a = model_parser(__doc__.splitlines()[0], rounds=5, number=20,
                     json_help="write the profile to this JSON file").parse_args(argv)
    feeds, path = one_thread_model(a.model)
    out = {"model": a.model, **profile(path, feeds, a.rounds, a.number)}
    by_kernel = collections.defaultdict(lambda: [0.0, 0.0])
    for r in out["calls"]:
        by_kernel[r["kernel"]][0] += r["alone_us"]
        by_kernel[r["kernel"]][1] += r["in_sequence_us"]
    print(f"run() {out['run_min_us']} us; kernels in sequence {out['in_sequence_sum_us']} us; "
          f"alone {out['alone_sum_us']} us ({out['clock']})")
    for k, (al, sq) in sorted(by_kernel.items(), key=lambda kv: kv[1][0] - kv[1][1]):
        print(f"  {k:45s} alone {al:7.1f}  in sequence {sq:7.1f}  (+{sq - al:.1f})")
    write_json(out, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
