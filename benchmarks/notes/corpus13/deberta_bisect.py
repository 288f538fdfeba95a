"""deberta_v2_dyn vs onnxruntime at batch 1, sequence 5 with one graph rewrite left out per run (which one makes
the symbolic build wrong).  PYTHONPATH=. python this.py row:take_of_symbolic_shape pass:tvmfuse.DiagonalRelativePosition
(row: a PEEPHOLES row; pass: a pre-legalize pass by its name)."""
import os
import sys

import numpy as np
import onnxruntime as ort

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "corpus"))
import corpus_io  # noqa: E402

import tvmfuse  # noqa: E402
import tvmfuse.passes as passes  # noqa: E402
from tvmfuse.passes import rewrites  # noqa: E402

entry = {e["name"]: e for e in corpus_io.load_manifest()["models"]}[os.environ.get("MODEL", "deberta_v2")]
path = corpus_io.model_path(entry, "dynamic")
sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
original_pre = passes.pre_legalize_passes
original_rows = {k: list(v) for k, v in rewrites._PEEPHOLE_BY_OP.items()}
for arg in sys.argv[1:] or ["none"]:
    kind, _, name = arg.partition(":")
    rewrites._PEEPHOLE_BY_OP.clear()
    rewrites._PEEPHOLE_BY_OP.update({k: [r for r in v if not (kind == "row" and r.name == name)]
                                     for k, v in original_rows.items()})
    passes.pre_legalize_passes = (lambda t, o: [p for p in original_pre(t, o) if p.info.name != name]) \
        if kind == "pass" else original_pre
    cm = tvmfuse.compile(path)
    for dims in ({"batch": 1, "sequence": 5}, {"batch": 2, "sequence": 17}):
        feeds = corpus_io.random_feeds(entry, np.random.default_rng(0), dims)
        got = cm.run(feeds)[entry["outputs"][0]]
        print(arg, dims, "kernels", cm.kernel_count, "rel_err",
              corpus_io.relative_error(got, sess.run(entry["outputs"], feeds)[0]), flush=True)
