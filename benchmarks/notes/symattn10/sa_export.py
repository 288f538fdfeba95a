"""Export the symbolic build and builds pinned to batch 1 and 3 of mobilevit_dyn and swin_dyn (one tree)."""
import sys, os
sys.path.insert(0, "corpus")
import corpus_io
import tvmfuse
out = sys.argv[1]
entries = {e["name"]: e for e in corpus_io.load_manifest()["models"]}
for name in ("mobilevit", "swin"):
    path = corpus_io.model_path(entries[name], "dynamic")
    for tag, shapes in (("sym", None), ("b1", {"batch": 1}), ("b3", {"batch": 3})):
        cm = tvmfuse.compile(path, input_shapes=shapes, num_threads=1)
        tvmfuse.export(cm, os.path.join(out, f"{name}_{tag}"))
        print(name, tag, cm.kernel_count, flush=True)
