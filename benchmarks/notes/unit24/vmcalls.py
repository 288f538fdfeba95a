import collections, sys, numpy as np
import tvmfuse
from tvmfuse import _compat as C
import os
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from ab_common import corpus_io
def calls(cm, feeds):
    kernels = {gv.name_hint for gv, f in cm.fused_module.functions.items() if isinstance(f, C.PrimFunc)}
    counts = collections.Counter()
    def instrument(func, symbol, before_run, ret_value, *args):
        if before_run:
            counts["kernel" if str(symbol) in kernels else str(symbol)] += 1
        return 0
    vm = C.VirtualMachine(cm.executable, cm.device)
    vm.set_instrument(instrument)
    vm["main"](*[C.tensor(v, cm.device) for v in feeds.values()])
    return counts
dyn = tvmfuse.compile(os.path.join(ROOT, "corpus", "deberta_v2_dyn.onnx"), target="llvm -mcpu=znver3 -num-cores=2")
pin = tvmfuse.compile(os.path.join(ROOT, "corpus", "deberta_v2_dyn.onnx"), target="llvm -mcpu=znver3 -num-cores=2", input_shapes={"input_ids":[1,1],"attention_mask":[1,1]} )
feeds = {i.name: np.ones((1,1), dtype=np.int64) for i in dyn.inputs}
print([ (i.name, i.shape, i.dtype) for i in dyn.inputs])
a, b = calls(dyn, feeds), calls(pin, feeds)
for k in sorted(set(a)|set(b)):
    print(f"{k:45s} {a.get(k,0):4d} {b.get(k,0):4d}")
print("total", sum(a.values()), sum(b.values()))
