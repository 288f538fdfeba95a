import glob, os, sys, time
from tvmfuse import _compat as C
from tvmfuse.frontend import load_onnx, read_model
from tvmfuse.pipeline import PipelineOptions, Stages
from tvmfuse.target import parse_target
from tvmfuse.schedules import templates_for
from tvmfuse.schedules.base import find_template
tgt = parse_target("llvm -mcpu=haswell -num-cores=2")
for path in sorted(glob.glob("corpus/*_dyn.onnx")):
    t = time.time()
    try:
        mod = load_onnx(read_model(path))
        with tgt:
            fused = C.Sequential(Stages(tgt, PipelineOptions()).graph(), name="x")(mod)
            hits = []
            for gv, f in fused.functions.items():
                if isinstance(f, C.PrimFunc):
                    found = find_template(f, tgt, templates_for(tgt))
                    if found and found[0].family == "cpu.symbolic_batch_matmul":
                        hits.append(gv.name_hint)
        print(os.path.basename(path), len(hits), hits, round(time.time() - t, 1), flush=True)
    except Exception as e:
        print(os.path.basename(path), "ERROR", type(e).__name__, str(e).splitlines()[-1][:150], flush=True)
