"""direct default vs cpu.conv2d_lanes (plane_pixels_below raised), kernel only, one thread, interleaved."""
import os, sys, json
os.environ.setdefault("TVM_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
import numpy as np
import conv_kernel_ab as K
from tvmfuse import target as TG

def patched(entries):
    t = json.loads(json.dumps(TG.cpu_table()))
    for fam, d in entries.items():
        t["template_defaults"][fam].update(d)
    return t

target = TG.host_target(2)
from tvmfuse.schedules.cpu import conv_lanes as CL
CL.MAX_TILE_PIXELS = int(os.environ.get("MAXPIX", "9"))
real = TG.cpu_table
out = {}
for name in sys.argv[1].split(","):
    model = K.conv_relu(*K.CASES[name])
    cont, cfgs = {}, {}
    func, tpl, m = K.conv_kernel(model, target)
    cfg = tpl.default_config(m, target)
    fn, args, o = K.build(func, tpl, m, cfg, target); cont["direct"] = lambda fn=fn, a=args: fn(*a); cfgs["direct"] = cfg
    tbl = patched({"cpu.conv2d_lanes": {"plane_pixels_below": 1 << 20}})
    TG.cpu_table = lambda: tbl
    try:
        func2, tpl2, m2 = K.conv_kernel(model, target)
        base = tpl2.default_config(m2, target)
        variants = [base] + [{**base, **v} for v in json.loads(sys.argv[2]).get(name, [])]
        for i, c in enumerate(variants):
            fn2, args2, o2 = K.build(func2, tpl2, m2, c, target)
            cont[f"lanes{i}"] = lambda fn=fn2, a=args2: fn(*a); cfgs[f"lanes{i}"] = c
    finally:
        TG.cpu_table = real
    print(name, tpl.family, tpl2.family, json.dumps(cfgs))
    r = K.interleaved(cont, int(sys.argv[3]), int(sys.argv[4]))
    print(name, r, flush=True)
    out[name] = {"configs": cfgs, "us_min_median": r}
json.dump(out, open(sys.argv[5], "w"), indent=1)
