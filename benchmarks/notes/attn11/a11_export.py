"""Export the static build and the _dyn symbolic build of bloom and swin (env MODELS: others), one tree: run
with that tree's PYTHONPATH.  python a11_export.py OUT_DIR"""
import os
import sys

sys.path.insert(0, "corpus")
import corpus_io  # noqa: E402
import tvmfuse  # noqa: E402

out = sys.argv[1]
entries = {e["name"]: e for e in corpus_io.load_manifest()["models"]}
for name in os.environ.get("MODELS", "bloom,swin").split(","):
    for tag, kind in (("static", "static"), ("sym", "dynamic")):
        cm = tvmfuse.compile(corpus_io.model_path(entries[name], kind), num_threads=1)
        tvmfuse.export(cm, os.path.join(out, f"{name}_{tag}"))
        print(name, tag, cm.kernel_count, flush=True)
