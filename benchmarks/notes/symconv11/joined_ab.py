"""symconv11: a symbolic kernel as the model builds it (its size-bucket nests joined under the run-time
branch), the bucket's nest alone, and the static build's kernel, timed interleaved at one size (thread CPU
time, min of rounds; run with TVM_NUM_THREADS=1).  Measured under load.

    TVM_NUM_THREADS=1 PYTHONPATH=. python benchmarks/notes/symconv11/joined_ab.py mobilenet_v2 batch=1 \
        fused_conv2d16_ [--rounds 15 --repeat 50]
"""
import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import symbolic_kernel_ab as SA  # noqa: E402

import tvmfuse  # noqa: E402
from tvmfuse import _compat as C  # noqa: E402
from tvmfuse.schedules import schedule_prim_func, templates_for  # noqa: E402
from tvmfuse.schedules.base import find_template, schedule_with  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("dims")
    ap.add_argument("kernels", nargs="+")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--target", default=None)
    a = ap.parse_args()
    target = tvmfuse.parse_target(a.target) if a.target else tvmfuse.host_target()
    dims = {k: int(v) for k, v in (p.split("=") for p in a.dims.split(","))}
    entry = {e["name"]: e for e in SA.corpus_io.load_manifest()["models"]}[a.model]
    path = SA.corpus_io.model_path(entry, "dynamic")
    sym = SA._kernels(path, None, target, a.kernels)
    static = SA._kernels(path, dims, target, a.kernels)
    for name, func in sorted(sym.items()):
        built = {"joined": SA._build(schedule_prim_func(func, target).func, target)}
        t, m = find_template(func, target, templates_for(target))
        for b in t.buckets(m, target):
            bm = t.bucket_match(m, b)
            if b.max_extent is None or list(dims.values())[0] <= b.max_extent:
                built[f"nest {b.name}"] = SA._build(schedule_with(t, bm, func, t.default_config(bm, target)), target)
                break
        if name in static:
            built["static"] = SA._build(schedule_prim_func(static[name], target).func, target)
        rng = np.random.default_rng(0)
        bufs = SA._buffers(func)
        written = set()
        C.post_order_visit(func.body, lambda n: written.add(str(n.buffer.name)) if isinstance(n, C.BufferStore) else None)
        n_out = sum(1 for b in bufs if str(b.name) in written)
        shape = lambda b: [SA._eval(d, dims) for d in b.shape]  # noqa: E731
        ins = [C.tensor(rng.standard_normal(shape(b)).astype(str(b.dtype))) for b in bufs[:len(bufs) - n_out]]
        scal = [dims[str(p.name)] for p in func.params if not hasattr(p, "shape")]
        outs = {k: [C.tensor(np.zeros(shape(b), str(b.dtype))) for b in bufs[-n_out:]] for k in built}

        def args(k):
            if k == "static":
                return ins + outs[k]
            vals = {p: v for p, v in zip(bufs, ins + outs[k])}
            it = iter(scal)
            return [vals[p] if hasattr(p, "shape") else next(it) for p in func.params]
        for k, f in built.items():
            f(*args(k))
        ref = outs["static" if "static" in outs else "joined"][0].numpy()
        for k in built:
            np.testing.assert_allclose(outs[k][0].numpy(), ref, rtol=1e-4, atol=1e-4, err_msg=k)
        times = {k: [] for k in built}
        for _ in range(a.rounds):
            for k, f in built.items():
                av = args(k)
                t0 = time.thread_time()
                for _ in range(a.repeat):
                    f(*av)
                times[k].append((time.thread_time() - t0) / a.repeat * 1e6)
        print(json.dumps({"model": a.model, "dims": dims, "kernel": name,
                          "us_min": {k: round(min(v), 3) for k, v in times.items()},
                          "us_median": {k: round(float(np.median(v)), 3) for k, v in times.items()},
                          "load": os.getloadavg()[0], "utc": time.strftime("%H:%M", time.gmtime())}))


if __name__ == "__main__":
    main()
