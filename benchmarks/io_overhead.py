"""The fixed cost of ``run()`` over the VM call, step by step (issue 11: ``run()`` within 5% of the VM call).

    python benchmarks/io_overhead.py                 # -> benchmarks/io_overhead.json

Tiny models (the kernels take about a microsecond, so what is timed is the Python around them): LayerNorm
over [2, 16] (one input) and the sigmoid chain over 64 elements (three inputs), each compiled and as an
exported artifact.  Per model, microseconds per call of: the VM call on device tensors, ``run()`` on numpy,
``bind(...).run()``, and run()'s steps on their own: the per-model plan's checks and DLPack imports
(``_Plan.in_place_args``), the full checks that feeds failing it take (``validate_feeds`` + ``_to_device``),
and the output views (``_finish`` of a fresh result).  Each figure: the minimum over ``--rounds`` blocks of
``--calls`` calls (min: the machine's other load only adds), steps interleaved round by round.
"""
from __future__ import annotations

import argparse
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


def _steps(m, feeds) -> dict:
    """name -> callable: the VM call, the public calls, and run()'s steps."""
    f = m._main()
    device_args = [C.tensor(feeds[s.name]) for s in m.inputs]
    bound = m.bind(feeds)
    plan = m._io_plan()

    def full_checks():
        return [m._to_device(v)[0] for v in IO.validate_feeds(feeds, m.inputs)]

    def finish():                      # a fresh result each time: as run() sees it
        args = plan.in_place_args(feeds)
        return m._finish(f(*args), None, args)

    return {"vm_call": lambda: f(*device_args), "run": lambda: m.run(feeds), "bind_run": bound.run,
            "plan_checks": lambda: plan.in_place_args(feeds), "full_checks": full_checks,
            "plan_checks+vm_call+finish": finish}


def _block(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5000, help="calls per timed block")
    ap.add_argument("--rounds", type=int, default=15, help="blocks per step (interleaved)")
    ap.add_argument("--json", default=os.path.join(HERE, "io_overhead.json"))
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="io-overhead-")
    rows = []
    for name, model in [("layernorm_2x16", M.layernorm(rows=2, d=16, decomposed=False)),
                        ("sigmoid_chain_64", M.elementwise_chain(n=64))]:
        feeds = {k: np.random.default_rng(0).standard_normal(v.shape).astype(v.dtype)
                 for k, v in M.random_feeds(model).items()}
        cm = tvmfuse.compile(model, tuning_log=None)
        for kind, m in [("compiled", cm), ("artifact", tvmfuse.load(tvmfuse.export(cm, os.path.join(work, name))))]:
            steps = _steps(m, feeds)
            times = {k: [] for k in steps}
            for _ in range(args.rounds):
                for k, fn in steps.items():
                    times[k].append(_block(fn, args.calls))
            us = {k: min(v) for k, v in times.items()}
            rows.append({"model": name, "kind": kind, "inputs": len(m.inputs), "us_min": us,
                         "run_over_vm_us": us["run"] - us["vm_call"]})
            print(f"{name:18s} {kind:9s} " + "  ".join(f"{k} {v:.2f}" for k, v in us.items())
                  + f"  | run - vm_call {us['run'] - us['vm_call']:.2f} us", flush=True)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": C.llvm_system_cpu(),
           "load_avg": os.getloadavg(), "calls": args.calls, "rounds": args.rounds, "rows": rows}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
