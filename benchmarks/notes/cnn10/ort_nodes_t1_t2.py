import os, sys, json, tempfile, collections
import numpy as np, onnxruntime as ort
model = sys.argv[1]
path = f"corpus/{model}.onnx"
res, info = {}, {}
for threads in (1, 2):
    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions(); so.enable_profiling = True; so.profile_file_prefix = os.path.join(tmp, "ort")
        so.intra_op_num_threads = threads
        s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        inp = s.get_inputs()[0]
        x = np.random.default_rng(0).standard_normal([d if isinstance(d, int) else 1 for d in inp.shape]).astype("float32")
        for _ in range(300): s.run(None, {inp.name: x})
        ev = json.load(open(s.end_profiling()))
    per = collections.defaultdict(list)
    for e in ev:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            n = e["name"][:-12]
            per[n].append(e["dur"])
            info[n] = (e["args"].get("op_name"), e["args"].get("output_type_shape"), e["args"].get("input_type_shape"))
    res[threads] = {n: min(v) for n, v in per.items()}
print("sum of node mins 1 thread", sum(res[1].values()), "2 threads", sum(res[2].values()), "load", os.getloadavg()[0])
keys = sorted(res[1], key=lambda n: -res[1][n])
for n in keys:
    print(f"{res[1][n]:6.0f} {res[2].get(n, 0):6.0f}  {info[n][0]} {n} in={info[n][2]} out={info[n][1]}")
json.dump({"model": model, "intra_op_threads_1": res[1], "intra_op_threads_2": res[2], "info": info, "load_avg_1min": os.getloadavg()[0]}, open(f"benchmarks/notes/cnn10/ort_{model}.json", "w"), indent=1)
