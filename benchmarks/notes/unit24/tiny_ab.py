"""QK^T + bias (tests/test_symbolic_batch_matmul._scores: [b, 4, S, 16] @ [b, 4, 16, S] + bias) at batch 1:
the tiny nest alone vs the few-MACs nest alone, per S; kernel time (time_evaluator min of 7 x 200 calls)."""
import sys, json
import os
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import numpy as np
from tvmfuse import _compat as C
from tvmfuse.target import parse_target
import test_symbolic_batch_matmul as T
tgt = parse_target("llvm -mcpu=znver3 -num-cores=2") if False else parse_target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2})
(kname, func), = T._kernels(T._scores(), tgt).items()
mods = {}
for kind in ("tiny", "few"):
    nest = T._bucket_nest(func, tgt, kind).func
    mods[kind] = C.build_prim_module(C.IRModule({"main": nest.with_attr("global_symbol", "main")}), tgt)
bufs = [p for p in func.params if hasattr(p, "shape")]
out = {}
rng = np.random.default_rng(0)
for s in (1, 2, 3, 4, 6, 8):
    sizes = {"batch": 1, "sequence": s}
    shp = lambda b: [int(d) if isinstance(d, C.IntImm) else sizes[str(d)] for d in b.shape]
    args = [C.tensor(rng.standard_normal(shp(b)).astype("float32")) for b in bufs]
    row = {}
    for kind, m in mods.items():
        f = (m.mod if hasattr(m, "mod") else m).time_evaluator("main", C.device_for(tgt), number=200, repeat=7)
        res = f(*args)
        row[kind] = round(min(res.results) * 1e6, 4)
    row["macs"] = 64 * s * s
    out[s] = row
    print(s, row, flush=True)
json.dump(out, open(sys.argv[1] if len(sys.argv) > 1 else "/tmp/s24/tiny_ab.json", "w"), indent=1)
