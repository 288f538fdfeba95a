"""symconv11: a symbolic kernel (joined bucket nests) with and without conv2d.unroll_copy_rows, interleaved, thread time,
min of 11 rounds of 20 calls.  TVM_NUM_THREADS=1 PYTHONPATH=. python benchmarks/notes/symconv11/row_unroll_ab.py mobilenet_v2 1 fused_conv2d8_"""
import sys, time, json
sys.path.insert(0, "benchmarks")
import numpy as np
import symbolic_kernel_ab as SA
import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu import depthwise as D
model, b = sys.argv[1], int(sys.argv[2])
target = tvmfuse.host_target()
entry = {e["name"]: e for e in SA.corpus_io.load_manifest()["models"]}[model]
path = SA.corpus_io.model_path(entry, "dynamic")
for kname in sys.argv[3:]:
    func = list(SA._kernels(path, None, target, [kname]).values())[0]
    built = {"new": SA._build(schedule_prim_func(func, target).func, target)}
    orig = D.unroll_copy_rows
    D.unroll_copy_rows = lambda *a: False
    built["no_row_unroll"] = SA._build(schedule_prim_func(func, target).func, target)
    D.unroll_copy_rows = orig
    bufs = SA._buffers(func)
    shape = lambda x: [SA._eval(d, {"batch": b}) for d in x.shape]
    rng = np.random.default_rng(0)
    ins = [C.tensor(rng.standard_normal(shape(x)).astype("float32")) for x in bufs]
    it = iter(ins); args = [next(it) if hasattr(p, "shape") else b for p in func.params]
    times = {k: [] for k in built}
    for _ in range(11):
        for k, f in built.items():
            t0 = time.thread_time()
            for _ in range(20):
                f(*args)
            times[k].append((time.thread_time() - t0) / 20 * 1e6)
    print(json.dumps({"model": model, "batch": b, "kernel": kname, "us_min": {k: round(min(v), 2) for k, v in times.items()}, "load": round(__import__("os").getloadavg()[0], 1)}))
