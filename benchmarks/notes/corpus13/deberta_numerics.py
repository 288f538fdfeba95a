"""deberta_v2_dyn vs onnxruntime at a few sizes, optionally with tvmfuse's DiagonalRelativePosition pass off
(``--no-relpos``): which pass makes the symbolic build wrong.  PYTHONPATH=. python this.py [--no-relpos]"""
import os
import sys
import time

import numpy as np
import onnxruntime as ort

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "corpus"))
import corpus_io  # noqa: E402

import tvmfuse  # noqa: E402
from tvmfuse.passes import relpos  # noqa: E402

if "--no-relpos" in sys.argv:
    relpos.DiagonalRelativePosition.transform_module = lambda self, mod, ctx: mod
entry = {e["name"]: e for e in corpus_io.load_manifest()["models"]}[sys.argv[1] if len(sys.argv) > 1
                                                                       and not sys.argv[1].startswith("-")
                                                                       else "deberta_v2"]
path = corpus_io.model_path(entry, "dynamic")
t0 = time.time()
cm = tvmfuse.compile(path)
print("compiled", round(time.time() - t0, 1), "s, kernels", cm.kernel_count, flush=True)
sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
rng = np.random.default_rng(0)
for dims in ({"batch": 1, "sequence": 1}, {"batch": 1, "sequence": 2}, {"batch": 1, "sequence": 5},
             {"batch": 1, "sequence": 9}, {"batch": 1, "sequence": 17}, {"batch": 2, "sequence": 17}):
    feeds = corpus_io.random_feeds(entry, rng, dims)
    want = sess.run(entry["outputs"], feeds)[0]
    got = cm.run(feeds)[entry["outputs"][0]]
    print(dims, corpus_io.relative_error(got, want), flush=True)
