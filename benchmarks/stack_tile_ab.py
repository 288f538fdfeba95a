"""Kernel-only A/B of a template-table knob (default: ``stack_accumulator``, the register tile under TVM's
stack-alloca limit) or of a template module's constant (``--constant attention.BUFFER_SCOPE global local``)
on representative kernels of tests/schedule_cases.py: each kernel scheduled with its template's default under
either value, built for the host with one core, timed interleaved on the calling thread's CPU time
(``time.thread_time``; TVM_NUM_THREADS=1), min of rounds.  Output: JSON lines ("on": the first value).

    TVM_NUM_THREADS=1 PYTHONPATH=. python benchmarks/stack_tile_ab.py --family cpu.matmul_epilogue
    TVM_NUM_THREADS=1 PYTHONPATH=. python benchmarks/stack_tile_ab.py --family cpu.attention \
        --constant attention.BUFFER_SCOPE global local
"""
import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import schedule_cases as S  # noqa: E402

import tvmfuse  # noqa: E402
from tvmfuse import _compat as C  # noqa: E402
from tvmfuse import target as TG  # noqa: E402
from tvmfuse.schedules import schedule_prim_func  # noqa: E402

MODELS = {
    "matmul_3d_128x128x512": lambda: S.matmul_3d(b=2, s=64, k=128, n=512),
    "matmul_3d_100x256x256": lambda: S.matmul_3d(b=1, s=100, k=256, n=256),
    "qkv_64x64": lambda: S.qkv_3d(b=2, s=32, h=64),
    "swiglu_64x64x128": lambda: S.swiglu_3d(b=2, s=32, h=64, f=128),
    "vit_block": lambda: S.vit_block(),
    "vit_block_128x64": lambda: S.vit_block(s=128, d=128, h=2, f=256),
}


def _table(knob: str, family: str, value):
    table = json.loads(json.dumps(TG.cpu_table()))
    table["template_defaults"][family][knob] = value
    return table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", required=True)
    ap.add_argument("--knob", default="stack_accumulator")
    ap.add_argument("--constant", nargs=3, metavar=("MODULE.NAME", "ON", "OFF"),
                    help="A/B a constant of tvmfuse.schedules.cpu.MODULE instead of the table knob")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    base = TG.host_target(1)
    original = TG.cpu_table
    for mname, build in MODELS.items():
        for kname, func in S.graph_funcs(build(), base).items():
            runs = {}
            for value in (True, False):
                if args.constant:
                    mod_name, const = args.constant[0].rsplit(".", 1)
                    mod = importlib.import_module(f"tvmfuse.schedules.cpu.{mod_name}")
                    before = getattr(mod, const)
                    setattr(mod, const, args.constant[1] if value else args.constant[2])
                else:
                    table = _table(args.knob, args.family, value)
                    TG.cpu_table = lambda table=table: table
                try:
                    res = schedule_prim_func(func, base, {}, kname)
                finally:
                    TG.cpu_table = original
                    if args.constant:
                        setattr(mod, const, before)
                if res is None or res.template != args.family:
                    break
                lib = C.build_prim_module(C.IRModule({"main": res.func.with_attr("global_symbol", "main")}), base)
                rng = np.random.default_rng(0)
                ins = [C.tensor(a) for a in S.random_args(res.func, rng)]
                outs = [C.tensor(np.zeros([int(d) for d in p.shape], str(p.dtype))) for p in res.func.params[-1:]]
                runs[value] = (lib["main"], ins + outs, res.config)
            if len(runs) != 2 or (runs[True][2] == runs[False][2] and not args.constant):
                continue
            times = {v: [] for v in runs}
            for f, a, _ in runs.values():
                f(*a)
            for _ in range(args.rounds):
                for v, (f, a, _) in runs.items():
                    t0 = time.thread_time()
                    for _ in range(args.repeat):
                        f(*a)
                    times[v].append((time.thread_time() - t0) / args.repeat * 1e6)
            print(json.dumps({"model": mname, "kernel": kname, "family": args.family, "knob": args.constant or args.knob,
                              "on_us": round(min(times[True]), 2), "off_us": round(min(times[False]), 2),
                              "on_config": runs[True][2], "off_config": runs[False][2],
                              "clock": "thread_time, min of rounds, one thread, measured under load"}))


if __name__ == "__main__":
    main()
