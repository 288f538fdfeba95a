"""Kernel A/B of cpu.scan's ``parallel`` knob against TVM's unscheduled scan kernel (benchmarks/notes/corpus11.md):
roberta's position-id scan (1 x 32 int32) and a 4 x 512 one, each built alone; back-to-back calls from Python,
15 interleaved rounds, median ns per call (the FFI call's overhead included).

    TVM_NUM_THREADS=1 PYTHONPATH=. python benchmarks/scan_ab.py
"""
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.schedules.base import schedule_with
from tvmfuse.schedules.cpu.scan import Scan, scan_nest
import schedule_cases as S
from test_schedules_cpu_scan import position_ids
tgt = tvmfuse.host_target()
out = {}
for shape in [(1, 32), (4, 512)]:
    funcs = S.graph_funcs(position_ids(shape), tgt)
    f = [f for f in funcs.values() if scan_nest(f) is not None][0]
    t = Scan(); m = t.match(f, tgt)
    libs = {}
    for name, func in [("tvm_unscheduled", f), ("serial", schedule_with(t, m, f, {"parallel": False})),
                       ("parallel", schedule_with(t, m, f, {"parallel": True}))]:
        libs[name] = C.build_prim_module(C.IRModule({"main": func.with_attr("global_symbol", "main")}), tgt)
    x = C.tensor(np.ones(shape, np.int32)); y = C.tensor(np.zeros(shape, np.int32))
    res = {k: [] for k in libs}
    for r in range(15):
        for k, lib in libs.items():
            fn = lib["main"]
            fn(x, y)
            t0 = time.perf_counter()
            for _ in range(2000):
                fn(x, y)
            res[k].append((time.perf_counter() - t0) / 2000 * 1e9)
    out[str(shape)] = {k: round(statistics.median(v), 1) for k, v in res.items()}
    print(shape, out[str(shape)], flush=True)
print(json.dumps(out))
