"""Which corpus kernels change with conv11 (wide lanes route, shared_pad): compile each model new and old."""
import os, sys, json
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
import model_knob_ab as MK
import tvmfuse
from tvmfuse import target as TG
from tvmfuse.schedules.cpu.conv2d import Conv2DEpilogue
real_table, real_default = TG.cpu_table, Conv2DEpilogue.default_config
def old_build(path):
    t = json.loads(json.dumps(real_table())); t["template_defaults"]["cpu.conv2d_lanes"]["wide_lane_use_below"] = 0
    TG.cpu_table = lambda: t
    Conv2DEpilogue.default_config = lambda self, m, tg: {**real_default(self, m, tg), "shared_pad": False}
    try:
        return tvmfuse.compile(path)
    finally:
        TG.cpu_table, Conv2DEpilogue.default_config = real_table, real_default
entries = {e["name"]: e for e in MK.corpus_io.load_manifest()["models"]}
out = {}
for name in sys.argv[1].split(","):
    path = MK.corpus_io.model_path(entries[name], "static")
    new, old = tvmfuse.compile(path), old_build(path)
    sn = {s["kernel"]: (s["template"], s.get("knobs")) for s in new.report.schedules}
    so = {s["kernel"]: (s["template"], s.get("knobs")) for s in old.report.schedules}
    diff = [(k, so.get(k, (None,))[0], v[0], {q: v[1].get(q) for q in ("parallel_depth", "shared_pad", "oh_tile", "ow_tile", "oc_tile", "nvec")} if v[1] else None)
            for k, v in sn.items() if so.get(k) != v]
    out[name] = {"kernels": [new.kernel_count, old.kernel_count], "changed": diff}
    print(name, new.kernel_count, old.kernel_count, len(diff), diff[:6], flush=True)
json.dump(out, open(sys.argv[2], "w"), indent=1)
