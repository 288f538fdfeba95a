"""Per-kernel launch cost of the Relax VM on the CPU (issues 11/12: run() minus the sum of its kernels).

    python benchmarks/launch_cost.py [--size 64] [--chain 64] [--rounds 30]

``main`` = a chain of ``--chain`` elementwise adds of ``--size`` floats (each a separate kernel, each output
a planned buffer: alloc_tensor + call + kill per kernel, as in a compiled model), against a chain of one.
The difference per kernel is the VM's cost of one launch plus the (tiny) add, for:
  * ``serial``: the kernel's loop serial;
  * ``parallel``: the same loop ``parallel`` (each call a fork/join of TVM's thread pool);
  * ``compiled``: the serial chain built with ``exec_mode="compiled"`` (the VM function compiled to machine
    code instead of interpreted bytecode).
Run it with ``TVM_NUM_THREADS`` set to the pool size to look at.  Min over ``--rounds`` repeats of 200 calls;
on a loaded machine the numbers rank costs, they are not latencies to quote (label them "under load").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tvmfuse import _compat as C  # noqa: E402


def chain(n: int, size: int, parallel: bool, exec_mode: str):
    """The VM function ``main`` of ``n`` chained adds of ``size`` floats."""
    bb = C.BlockBuilder()
    x = C.relax.Var("x", C.TensorType((size,), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = x
            for _ in range(n):
                y = bb.emit(C.relax.op.add(y, y))
            gv = bb.emit_output(y)
        bb.emit_func_output(gv)
    mod = C.relax_transform.LegalizeOps()(bb.get())
    for gvar, func in list(mod.functions.items()):
        if isinstance(func, C.PrimFunc):
            sch = C.Schedule(func)
            (loop,) = sch.get_loops(sch.get_sblock("T_add"))
            if parallel:
                sch.parallel(loop)
            mod[gvar] = sch.mod["main"]
    ex = C.build_vm(mod, C.Target("llvm"), exec_mode)
    return C.VirtualMachine(ex, C.cpu())["main"]


def per_call_us(f, arg, rounds: int, number: int = 200) -> float:
    for _ in range(50):
        f(arg)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(number):
            f(arg)
        best = min(best, (time.perf_counter() - t0) / number)
    return best * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--chain", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--json", help="write the results to this JSON file")
    a = ap.parse_args(argv)
    arg = C.tensor(np.ones(a.size, "float32"))
    out = {"threads": C.runtime_threads(), "size": a.size, "chain": a.chain, "per_kernel_us": {}}
    variants = {"serial": (False, "bytecode"), "parallel": (True, "bytecode"), "compiled": (False, "compiled")}
    for _ in range(2):                      # interleaved: each variant twice, the min kept
        for name, (par, mode) in variants.items():
            one = per_call_us(chain(1, a.size, par, mode), arg, a.rounds)
            many = per_call_us(chain(a.chain, a.size, par, mode), arg, a.rounds)
            cost = (many - one) / (a.chain - 1)
            out["per_kernel_us"][name] = min(cost, out["per_kernel_us"].get(name, float("inf")))
    for name, us in out["per_kernel_us"].items():
        print(f"{name:9s} {us:6.3f} us per kernel ({out['threads']} threads, {a.size} floats)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
