"""model at dims: static, symbolic (orig), symbolic with the small nests at nvec from a preference list; one process, interleaved."""
import sys, os, time, json
sys.path.insert(0, "benchmarks")
import numpy as np
import tvmfuse
from tvmfuse.schedules.cpu import symbolic_matmul as SM
from ab_common import corpus_io
model=sys.argv[1]; dims={k:int(v) for k,v in (kv.split("=") for kv in sys.argv[2].split(","))}
rounds=int(sys.argv[3]); repeat=int(sys.argv[4]); variants=sys.argv[5].split(";")
entry = {e["name"]: e for e in corpus_io.load_manifest()["models"]}[model]
path = corpus_io.model_path(entry, "dynamic")
feeds = corpus_io.random_feeds(entry, np.random.default_rng(0), dims=dims)
cms = {"static": tvmfuse.compile(path, input_shapes=dims), "sym": tvmfuse.compile(path)}
orig = SM.SymbolicMatmulEpilogue._small_default
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
    cm = cms["nv" + var.replace(",", "")] = tvmfuse.compile(path)
    print(var, [(s["kernel"], [b["config"]["nvec"] for b in s["knobs"]["buckets"]]) for s in cm.report.schedules if s["template"] == "cpu.symbolic_matmul"])
SM.SymbolicMatmulEpilogue._small_default = orig
ref = cms["static"].run(feeds)
for k, cm in cms.items():
    out = cm.run(feeds)
    print(k, "max abs diff vs static", max(float(np.max(np.abs(np.asarray(out[n]) - np.asarray(ref[n])))) for n in ref))
    for _ in range(20): cm.run(feeds)
ts = {k: [] for k in cms}
names = list(cms)
for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for k in order:
        cm = cms[k]
        t0 = time.perf_counter()
        for _ in range(repeat): cm.run(feeds)
        ts[k].append((time.perf_counter() - t0) / repeat * 1e6)
rng = np.random.default_rng(1)
def boot(a):
    m = [np.median(rng.choice(a, len(a))) for _ in range(2000)]; return np.percentile(m, [5, 95]).round(3)
for k in names[1:]:
    a = np.array(ts[k]) / np.array(ts["static"]); b = np.array(ts[k]) / np.array(ts["sym"])
    print(f"{k:8s}: min {min(ts[k]):.2f} med {np.median(ts[k]):.2f} | /static: mins {min(ts[k])/min(ts['static']):.3f} paired {np.median(a):.3f} {boot(a)} | /sym paired {np.median(b):.3f} {boot(b)}")
print(f"static  : min {min(ts['static']):.2f} med {np.median(ts['static']):.2f}")
json.dump({"model": model, "dims": dims, "rounds": rounds, "repeat": repeat, "us_per_call": ts}, open(sys.argv[6], "w"))
