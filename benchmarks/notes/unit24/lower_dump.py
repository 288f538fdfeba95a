"""Per scheduled kernel of a corpus model: its template and the run-time workspace allocations its built
code makes (calls through __TVMBackendAllocWorkspace in the LLVM IR; each counted once per call site).

    python benchmarks/notes/unit24/lower_dump.py deberta_v2_dyn [name-substring ...]
    SHOW=<kernel> python ...   # also print that kernel's scheduled TIR
"""
import os
import sys

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.pipeline import Stages

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
model = sys.argv[1]
path = os.path.join(ROOT, "corpus", f"{model}.onnx")
cm = tvmfuse.compile(path, target={"kind": "llvm", "mcpu": "znver3", "num-cores": 2})
tmpl = {s["kernel"]: s["template"] for s in cm.report.schedules}
st = Stages(cm.target)
with st.target:
    mod = C.Sequential(st.graph() + st.schedule())(tvmfuse.load_onnx(path))
want = sys.argv[2:]
for gv, f in mod.functions.items():
    if not isinstance(f, C.PrimFunc):
        continue
    name = str(gv.name_hint)
    if want and not any(w in name for w in want):
        continue
    lib = C.build_prim_module(C.IRModule({"main": f.with_attr("global_symbol", "main")}), cm.target)
    ll = (lib.mod if hasattr(lib, "mod") else lib).inspect_source("ll")
    print(f"{name:70s} {tmpl.get(name, '?'):28s} alloc_workspace_sites={ll.count('@__TVMBackendAllocWorkspace')}")
    if os.environ.get("SHOW") == name:
        print(f.script())
