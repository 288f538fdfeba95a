"""Export bloom's and swin's static build and their _dyn symbolic build (one tree: run with that tree's
PYTHONPATH).  python a11_export.py OUT_DIR"""
import os
import sys

sys.path.insert(0, "corpus")
import corpus_io  # noqa: E402
import tvmfuse  # noqa: E402

out = sys.argv[1]
entries = {e["name"]: e for e in corpus_io.load_manifest()["models"]}
for name in ("bloom", "swin"):
    for tag, kind in (("static", "static"), ("sym", "dynamic")):
        cm = tvmfuse.compile(corpus_io.model_path(entries[name], kind), num_threads=1)
        tvmfuse.export(cm, os.path.join(out, f"{name}_{tag}"))
        print(name, tag, cm.kernel_count, flush=True)
