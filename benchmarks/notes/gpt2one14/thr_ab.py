"""sym vs static at 1 and 2 runtime threads, one process, interleaved rounds, wall clock, run() on numpy."""
import sys, os, time, json
os.environ["TVM_NUM_THREADS"] = "2"
sys.path.insert(0, "benchmarks")
import numpy as np
import tvmfuse
from tvmfuse import _compat as C
from ab_common import corpus_io
model=sys.argv[1]; dims={k:int(v) for k,v in (kv.split("=") for kv in sys.argv[2].split(","))}
rounds=int(sys.argv[3]); repeat=int(sys.argv[4])
entry = {e["name"]: e for e in corpus_io.load_manifest()["models"]}[model]
path = corpus_io.model_path(entry, "dynamic")
feeds = corpus_io.random_feeds(entry, np.random.default_rng(0), dims=dims)
cms = {"static": tvmfuse.compile(path, input_shapes=dims, num_threads=2), "sym": tvmfuse.compile(path, num_threads=2)}
for cm in cms.values():
    for _ in range(20): cm.run(feeds)
ts = {(k,t): [] for k in cms for t in (1,2)}
rng = np.random.default_rng(1)
for r in range(rounds):
    for t in ((1,2) if r%2 else (2,1)):
        C.set_runtime_threads(t)
        for k in (("sym","static") if (r//2)%2 else ("static","sym")):
            cm=cms[k]
            for _ in range(3): cm.run(feeds)
            t0=time.perf_counter()
            for _ in range(repeat): cm.run(feeds)
            ts[(k,t)].append((time.perf_counter()-t0)/repeat*1e6)
def boot(a):
    a=np.array(a); m=[np.median(rng.choice(a,len(a))) for _ in range(2000)]; return np.percentile(m,[5,95])
for t in (1,2):
    s,st=np.array(ts[("sym",t)]),np.array(ts[("static",t)])
    r=s/st
    print(f"threads {t}: sym min {s.min():.1f} med {np.median(s):.1f}  static min {st.min():.1f} med {np.median(st):.1f}  "
          f"ratio of mins {s.min()/st.min():.3f} paired median {np.median(r):.3f} {boot(r).round(3)}")
json.dump({f"{k}_t{t}": v for (k,t),v in ts.items()}, open(sys.argv[5],"w"))
