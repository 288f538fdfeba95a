"""Rank tvmfuse's per-kernel profile (profile_kernels.py JSON) and onnxruntime's node profile (ort12.py JSON) by
conv family.  usage: families.py MODEL PROF_OLD.json PROF_NEW.json [ORT.json]"""
import json, sys, collections
model = sys.argv[1]
def fam_from(x, w, out):
    n, c, h, wd = x; f, cg, kh, kw = w[:4] if len(w) == 4 else (None,) * 4
    s = 2 if out[2] <= (h + 1) // 2 and h > 1 else 1
    if cg == 1 and f == c:
        return f"depthwise {kh}x{kh} s{s}"
    if c == 3:
        return f"stem {kh}x{kh} s{s}"
    if kh == 1:
        return "1x1 expand" if f > c else "1x1 project/squeeze"
    return f"{kh}x{kh} conv"
def tv_fam(r):
    sh = r["shapes"]
    if r["template"] and "conv" in (r["kernel"] or "") and len(sh) >= 2 and len(sh[0]) == 4:
        x, w, out = sh[0], sh[1], sh[-1]
        if "concatenate" in r["kernel"]:
            x = [x[0], sum(s[1] for s in sh[:2]), x[2], x[3]]; w = sh[2]
        if len(w) == 5:      # blocked OIHWo: [F/B, C, kh, kw, B]
            w = [w[0] * w[4], w[1], w[2], w[3]]
        return fam_from(x, w, out)
    return "other"
def load_tv(p):
    d = json.load(open(p))["tvmfuse"]
    agg = collections.defaultdict(float)
    for r in d["kernels"]:
        agg[tv_fam(r)] += r["us"]
    return agg, d["sum_us"]
old, old_sum = load_tv(sys.argv[2])
new, new_sum = load_tv(sys.argv[3]) if len(sys.argv) > 3 else ({}, 0)
o = json.load(open(sys.argv[4] if len(sys.argv) > 4 else f"benchmarks/notes/cnn10/ort_{model}.json"))
ort = {1: collections.defaultdict(float), 2: collections.defaultdict(float)}
for node, (op, outs, ins) in o["info"].items():
    fam = "other"
    if op == "Conv" and ins and len(ins) >= 2:
        x = list(ins[0].values())[0]; w = list(ins[1].values())[0]; out = list(outs[0].values())[0]
        if len(x) == 4 and len(w) == 4:
            fam = fam_from(x, w, out)
    for t in (1, 2):
        ort[t][fam] += o[f"intra_op_threads_{t}"].get(node, 0)
fams = sorted(set(old) | set(ort[1]), key=lambda f: -(old.get(f, 0) - ort[1].get(f, 0)))
print(f"{model}: tvmfuse kernel sums old {old_sum:.1f} new {new_sum:.1f} us; ort node sums 1t {sum(ort[1].values()):.0f} 2t {sum(ort[2].values()):.0f} us (load at ort profile {o['load_avg_1min']:.1f})")
print("| family | tvmfuse before (1 thread) | tvmfuse after (1 thread) | ort node sum, 1 thread | ort node sum, 2 threads |")
print("|---|---:|---:|---:|---:|")
for f in fams:
    print(f"| {f} | {old.get(f, 0):.1f} | {new.get(f, 0):.1f} | {ort[1].get(f, 0):.0f} | {ort[2].get(f, 0):.0f} |")
