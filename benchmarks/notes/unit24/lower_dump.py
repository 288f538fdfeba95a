"""Per kernel of a compiled corpus model: template, and the lowered host code's workspace allocations
and parallel launches (counted in the finalized TIR text)."""
import sys, re, json, os
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import tvmfuse
from tvmfuse import _compat as C
from tvm.tirx.build import split_host_device_mods
import tvm
model = sys.argv[1]
cm = tvmfuse.compile(os.path.join(ROOT, "corpus", f"{model}.onnx"), target="llvm -mcpu=znver3 -num-cores=2")
from tvmfuse.pipeline import Stages
st = Stages(cm.target)
with st.target:
    mod = C.Sequential(st.graph() + st.schedule())(tvmfuse.load_onnx(os.path.join(ROOT, "corpus", f"{model}.onnx")))
tmpl = {s["kernel"]: s["template"] for s in cm.report.schedules} if cm.report.schedules and "kernel" in cm.report.schedules[0] else {}
target = C.Target(cm.target, host=cm.target)
want = sys.argv[2:] 
for gv, f in mod.functions.items():
    if not isinstance(f, C.PrimFunc):
        continue
    name = str(gv.name_hint)
    if want and not any(w in name for w in want):
        continue
    m = C.IRModule({name: f.with_attr("global_symbol", name)})
    m = tvm.tirx.transform.BindTarget(target)(m)
    pipe, fin_host, _ = tvm.tirx.get_default_tir_pipeline(target)
    m = pipe(m)
    host, _ = split_host_device_mods(m)
    host = fin_host()(host)
    txt = host.script()
    print(f"{name:70s} {tmpl.get(name,'?'):28s} alloc_ws={txt.count('TVMBackendAllocWorkspace')} "
          f"parallel={txt.count('TVMBackendParallelLaunch')} lines={txt.count(chr(10))}")
    if "-v" in sys.argv[0:1]:
        pass
import os
if os.environ.get("SHOW"):
    for gv, f in mod.functions.items():
        if str(gv.name_hint) == os.environ["SHOW"]:
            print(f.script())
