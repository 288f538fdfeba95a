"""symconv11: each kernel's template and knobs in a corpus model's _dyn build and in the build pinned to
``--dims`` (no timing).  PYTHONPATH=. python benchmarks/notes/symconv11/knobs.py MODEL batch=1 [--family F]"""
import argparse
import importlib.util
import json
import os

import tvmfuse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_spec = importlib.util.spec_from_file_location("corpus_io", os.path.join(ROOT, "corpus", "corpus_io.py"))
corpus_io = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(corpus_io)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("dims")
    ap.add_argument("--family", default="")
    ap.add_argument("--json")
    a = ap.parse_args()
    dims = {k: int(v) for k, v in (p.split("=") for p in a.dims.split(","))}
    entry = {e["name"]: e for e in corpus_io.load_manifest()["models"]}[a.model]
    path = corpus_io.model_path(entry, "dynamic")
    out = {}
    for label, shapes in (("symbolic", None), ("pinned", dims)):
        cm = tvmfuse.compile(path, input_shapes=shapes)
        out[label] = [s for s in cm.report.schedules if a.family in s["template"]]
    for label in out:
        print(f"== {label}")
        for s in out[label]:
            print(f"  {s['kernel']:40s} {s['template']:32s} {s['source']:10s} {json.dumps(s['knobs'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
