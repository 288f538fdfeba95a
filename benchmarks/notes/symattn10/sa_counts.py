"""Kernel count (tvmfuse explain, graph stage) of every corpus model, static and dynamic: python sa_counts.py OUT.json
(run from a tree's root with PYTHONPATH=. ; symattn10.md section 3)."""
import json, sys, os
sys.path.insert(0, "corpus")
import corpus_io
from tvmfuse.explain_cli import explain
out = {}
for e in corpus_io.load_manifest()["models"]:
    for var in ("static", "dynamic"):
        p = corpus_io.model_path(e, var)
        if not os.path.exists(p):
            continue
        try:
            d = explain(p)
            out[f"{e['name']}:{var}"] = d["kernels_fused"]
        except Exception as ex:
            out[f"{e['name']}:{var}"] = f"error {type(ex).__name__}: {str(ex)[:200]}"
        print(e["name"], var, out[f"{e['name']}:{var}"], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
