"""deberta_v2_dyn vs onnxruntime at batch 1, sequence 5 under pipeline options turned off one at a time (which
stage makes the symbolic build wrong).  PYTHONPATH=. python this.py OPTION=VALUE ... (e.g. fast_math=0)"""
import os
import sys

import numpy as np
import onnxruntime as ort

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "corpus"))
import corpus_io  # noqa: E402

import tvmfuse  # noqa: E402

entry = {e["name"]: e for e in corpus_io.load_manifest()["models"]}["deberta_v2"]
path = corpus_io.model_path(entry, "dynamic")
sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
for arg in sys.argv[1:] or ["none"]:
    opts = {} if arg == "none" else {k: bool(int(v)) for k, v in (p.split("=") for p in arg.split(","))}
    cm = tvmfuse.compile(path, **opts)
    feeds = corpus_io.random_feeds(entry, np.random.default_rng(0), {"batch": 1, "sequence": 5})
    got = cm.run(feeds)[entry["outputs"][0]]
    print(arg, "kernels", cm.kernel_count, "rel_err", corpus_io.relative_error(got, sess.run(entry["outputs"], feeds)[0]), flush=True)
