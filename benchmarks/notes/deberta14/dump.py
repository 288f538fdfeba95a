import sys, time
from tvmfuse import _compat as C
from tvmfuse.frontend import load_onnx, read_model
from tvmfuse.pipeline import PipelineOptions, Stages
from tvmfuse.target import parse_target
from tvmfuse.explain import Recorder
t=time.time()
tgt = parse_target(None)
mod = load_onnx(read_model("corpus/deberta_v2_dyn.onnx"))
with tgt:
    st = Stages(tgt, PipelineOptions())
    with Recorder() as rec:
        fused = C.Sequential(st.graph(), name="x")(mod)
print(time.time()-t)
for gv, f in fused.functions.items():
    n = gv.name_hint
    if any(n.startswith(p) for p in sys.argv[1:]):
        print("=====", n); print(f.script())
