"""Lower each scheduled kernel of a corpus model's dynamic variant alone (TVM's TIR pipeline), printing the
ones that fail and their schedule template: python lower_each.py MODEL [static|dynamic]  (from a tree's root,
PYTHONPATH=.; visionsym13.md)."""
import sys
sys.path.insert(0, "corpus")
import corpus_io
from tvmfuse import _compat as C
from tvmfuse.frontend import load_onnx, read_model
from tvmfuse.pipeline import PipelineOptions, Stages
from tvmfuse.target import parse_target

entries = {e["name"]: e for e in corpus_io.load_manifest()["models"]}
name = sys.argv[1]
var = sys.argv[2] if len(sys.argv) > 2 else "dynamic"
tgt = parse_target(None)
st = Stages(tgt, PipelineOptions())
mod = load_onnx(read_model(corpus_io.model_path(entries[name], var)))
with tgt:
    mod = C.Sequential(st.graph() + st.schedule(), name="lower_each")(mod)
bad = 0
for gv, f in mod.functions.items():
    if not isinstance(f, C.PrimFunc):
        continue
    try:
        C.lower_tir(C.IRModule({"main": f.with_attr("global_symbol", "main")}), tgt)
    except Exception as e:  # the finding: which kernel does not lower
        bad += 1
        print("FAIL", gv.name_hint, str(e).splitlines()[0][:300])
        if "--script" in sys.argv:
            print(f.script())
print("failed", bad)
