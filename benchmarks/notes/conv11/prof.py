import sys, os, json, numpy as np, onnx
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
import profile_kernels as P
from tvmfuse import models as M
wl = {"conv3x3_bn_relu_res": M.conv_bn_relu_residual(channels=64, size=56), "resnet_block": M.resnet_block()}
out = {}
for name in sys.argv[1].split(","):
    m = wl[name]; import tempfile; path = os.path.join(tempfile.mkdtemp(), f"{name}.onnx"); onnx.save(m, path)
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32) for i in m.graph.input}
    tv = P.tvmfuse_kernels(path, feeds, 20, 10, 3, 200)
    P._print_tvmfuse(name, tv)
    on = P.ort_nodes(path, feeds, 300)
    print("ort sum", on["sum_us"])
    for r in on["nodes"]: print(f"{r['us']:8.1f} {r['op']} {r['node']} {r['out']}")
    out[name] = {"tvmfuse": tv, "ort": on}
json.dump(out, open(sys.argv[2], "w"), indent=1)
