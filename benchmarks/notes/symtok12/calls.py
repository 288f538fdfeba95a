"""The kernel calls of a corpus model's main after tvmfuse's graph stage, static and dynamic, one line each
(callee and its output shape): python calls.py MODEL [MODEL...]  (run from a tree's root with PYTHONPATH=.;
symtok12.md section 2)."""
import sys
sys.path.insert(0, "corpus")
import corpus_io
from tvmfuse import _compat as C
from tvmfuse.frontend import load_onnx, read_model
from tvmfuse.pipeline import PipelineOptions, Stages
from tvmfuse.target import parse_target

entries = {e["name"]: e for e in corpus_io.load_manifest()["models"]}
tgt = parse_target(None)
for name in sys.argv[1:]:
    for var in ("static", "dynamic"):
        mod = load_onnx(read_model(corpus_io.model_path(entries[name], var)))
        with tgt:
            fused = C.Sequential(Stages(tgt, PipelineOptions()).graph(), name="calls")(mod)
        print(f"== {name} {var}")
        for line in fused["main"].script().splitlines():
            if "call_tir" in line or "call_packed" in line or "R.call" in line:
                print("  ", line.strip()[:200])
