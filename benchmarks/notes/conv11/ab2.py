"""new default (table as committed) vs direct (wide_lane_use_below 0) + knob variants; kernel only, 1 thread."""
import os, sys, json
os.environ.setdefault("TVM_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
import conv_kernel_ab as K, tvmfuse
from tvmfuse import target as TG
tstr = sys.argv[2]
target = tvmfuse.parse_target(json.loads(tstr)) if tstr != "host" else TG.host_target(2)
real = TG.cpu_table
old = json.loads(json.dumps(real())); old["template_defaults"]["cpu.conv2d_lanes"]["wide_lane_use_below"] = 0
out = {}
for name in sys.argv[1].split(","):
    model = K.conv_relu(*K.CASES[name]); cont, cfgs = {}, {}
    TG.cpu_table = lambda: old
    try:
        f0, t0, m0 = K.conv_kernel(model, target); c0 = t0.default_config(m0, target)
    finally:
        TG.cpu_table = real
    fn, a, _ = K.build(f0, t0, m0, c0, target); cont["before_direct"] = lambda fn=fn, a=a: fn(*a); cfgs["before_direct"] = [t0.family, c0]
    for i, v in enumerate(json.loads(sys.argv[7]).get(name, []) if len(sys.argv) > 7 else []):
        c = {**c0, **v}
        fn, a, _ = K.build(f0, t0, m0, c, target); cont[f"direct{i}"] = lambda fn=fn, a=a: fn(*a); cfgs[f"direct{i}"] = [t0.family, c]
    f1, t1, m1 = K.conv_kernel(model, target); c1 = t1.default_config(m1, target)
    for i, v in enumerate([{}] + json.loads(sys.argv[3]).get(name, [])):
        c = {**c1, **v}
        fn, a, _ = K.build(f1, t1, m1, c, target); cont[f"new{i}"] = lambda fn=fn, a=a: fn(*a); cfgs[f"new{i}"] = [t1.family, c]
    r = K.interleaved(cont, int(sys.argv[4]), int(sys.argv[5]))
    print(name, {k: (v[0], {q: v[1][q] for q in ("oh_tile", "ow_tile", "nvec", "oc_tile", "parallel_depth") if q in v[1]}) for k, v in cfgs.items()})
    print(name, r, flush=True)
    out[name] = {"target": tstr, "configs": cfgs, "us_min_median": r}
json.dump(out, open(sys.argv[6], "w"), indent=1)
