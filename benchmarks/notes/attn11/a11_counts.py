"""Kernel count (tvmfuse explain, graph stage) and attention kernels of the corpus transformers, static and
dynamic: python a11_counts.py OUT.json  (run from a tree's root with PYTHONPATH=.; notes/attn11.md)."""
import json
import os
import sys

sys.path.insert(0, "corpus")
import corpus_io  # noqa: E402
from tvmfuse.explain_cli import explain  # noqa: E402

MODELS = ("bert", "gpt2", "llama", "vit", "t5_encoder", "whisper_encoder", "wav2vec2", "mobilevit", "swin",
          "albert", "opt", "bloom", "phi", "qwen2")
out = {}
for e in corpus_io.load_manifest()["models"]:
    if e["name"] not in MODELS:
        continue
    for var in ("static", "dynamic"):
        p = corpus_io.model_path(e, var)
        if not os.path.exists(p):
            continue
        d = explain(p)
        out[f"{e['name']}:{var}"] = {"kernels": d["kernels_fused"],
                                     "attention": sum(g["rule"] == "attention" for g in d["groups"]),
                                     "attention_refused": [r["reason"] for r in d["refused"]
                                                           if r.get("rule") == "attention"]}
        print(e["name"], var, out[f"{e['name']}:{var}"], flush=True)
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)
