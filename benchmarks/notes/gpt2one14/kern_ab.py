"""Kernel-only: each cpu.symbolic_matmul kernel of <model>_dyn at dims, per nvec-preference variant, time_evaluator min, interleaved rounds."""
import sys, os, time, json
sys.path.insert(0, "benchmarks")
import numpy as np
import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.schedules.cpu import symbolic_matmul as SM
from ab_common import corpus_io
import profile_kernels as PK
model=sys.argv[1]; dims={k:int(v) for k,v in (kv.split("=") for kv in sys.argv[2].split(","))}
rounds=int(sys.argv[3]); variants=sys.argv[4].split(";")
entry = {e["name"]: e for e in corpus_io.load_manifest()["models"]}[model]
path = corpus_io.model_path(entry, "dynamic")
feeds = corpus_io.random_feeds(entry, np.random.default_rng(0), dims=dims)
orig = SM.SymbolicMatmulEpilogue._small_default
cms = {}
for var in variants:
    prefs = [int(x) for x in var.split(",")]
    def patched(self, match, target, ch, prefs=prefs):
        cfg = orig(self, match, target, ch)
        n = match.info["N"]; lanes = cfg["lanes"]
        for v in prefs:
            if n % (v * lanes) == 0:
                cfg["nvec"] = v; break
        cfg["nc_tiles"] = max(1, min(cfg["nc_tiles"], n // (cfg["nvec"] * lanes)))
        return cfg
    SM.SymbolicMatmulEpilogue._small_default = patched
    cms[var] = tvmfuse.compile(path)
SM.SymbolicMatmulEpilogue._small_default = orig
timers = {}
for var, cm in cms.items():
    captured, _ = PK._capture_calls(cm, feeds, 3)
    lib = cm.executable.mod.imports[0]
    for s in cm.report.schedules:
        if s["template"] != "cpu.symbolic_matmul" or s["kernel"] not in captured: continue
        args = [C.tensor(a, cm.device) if isinstance(a, np.ndarray) else a for a in captured[s["kernel"]]]
        shape = [list(a.shape) for a in captured[s["kernel"]] if isinstance(a, np.ndarray)]
        timers[(s["kernel"], var)] = (C.time_function(lib, s["kernel"], cm.device, number=200, repeat=5), args, shape)
res = {k: [] for k in timers}
for r in range(rounds):
    for k, (t, args, _) in timers.items():
        res[k].append(min(t(*args).results) * 1e6)
kernels = sorted({k for k, _ in timers})
for kn in kernels:
    base = min(res[(kn, variants[0])])
    print(kn, timers[(kn, variants[0])][2], "  ".join(f"{v}: {min(res[(kn, v)]):.3f} ({min(res[(kn, v)])/base:.2f})" for v in variants))
json.dump({"model": model, "dims": dims, "us_min_per_round": {f"{k}|{v}": x for (k, v), x in res.items()}}, open(sys.argv[5], "w"))
