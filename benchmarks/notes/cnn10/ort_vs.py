"""tvmfuse (new), tvmfuse (before: lanes_plane_pixels_below 0) and onnxruntime, interleaved rounds.
usage: ort_vs.py MODEL THREADS ROUNDS   (1 thread: thread CPU time; 2 threads: wall time)"""
import os, sys, time, statistics, json
model, threads, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.environ["TVM_NUM_THREADS"] = str(threads)
import numpy as np, onnxruntime as ort
sys.path.insert(0, os.getcwd())
import tvmfuse
from tvmfuse import target as TG
path = f"corpus/{model}.onnx"
tgt = tvmfuse.parse_target(None)
new = tvmfuse.compile(path, tgt, tuning_log=None)
real = TG.cpu_table
table = json.loads(json.dumps(real())); table["template_defaults"]["cpu.depthwise_conv2d_epilogue"]["lanes_plane_pixels_below"] = 0
TG.cpu_table = lambda: table
before = tvmfuse.compile(path, tgt, tuning_log=None)
TG.cpu_table = real
so = ort.SessionOptions(); so.intra_op_num_threads = threads; so.inter_op_num_threads = 1
s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
inp = s.get_inputs()[0]
x = np.random.default_rng(0).standard_normal([d if isinstance(d, int) else 1 for d in inp.shape]).astype("float32")
feeds = {inp.name: x}
want = s.run(None, feeds)[0]
for cm in (new, before):
    np.testing.assert_allclose(np.array(list(cm.run(feeds).values())[0]), want, rtol=1e-3, atol=1e-3)
clock = time.thread_time if threads == 1 else time.perf_counter
def t(fn, n=40):
    t0 = clock()
    for _ in range(n): fn()
    return (clock() - t0) / n * 1e6
fns = {"new": lambda: new.run(feeds), "before": lambda: before.run(feeds), "ort": lambda: s.run(None, feeds)}
T = {k: [] for k in fns}
for f in fns.values():
    for _ in range(20): f()
for r in range(rounds):
    order = list(fns) if r % 2 == 0 else list(reversed(list(fns)))
    for k in order:
        T[k].append(t(fns[k]))
ratio = lambda a, b: round(statistics.median([x / y for x, y in zip(T[a], T[b])]), 3)
out = {"model": model, "threads": threads, "clock": "thread_time" if threads == 1 else "wall",
       "us_min_median": {k: [round(min(v), 1), round(statistics.median(v), 1)] for k, v in T.items()},
       "ort_over_new": ratio("ort", "new"), "ort_over_before": ratio("ort", "before"), "new_over_before": ratio("new", "before"),
       "rounds": rounds, "load_avg_1min": os.getloadavg()[0], "utc": time.strftime("%H:%M", time.gmtime())}
print(json.dumps(out))
