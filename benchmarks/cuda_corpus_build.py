"""Issue 12's CUDA coverage check, build only (no GPU needed): compile every corpus model for a CUDA arch
through ``tvmfuse.compile`` and count, per model, the kernels a ``cuda_*`` template scheduled and those that
fell elsewhere; a model that fails to build is recorded with its error.  nvcc runs as part of the build.

    python benchmarks/cuda_corpus_build.py [--arch sm_80] [--models resnet18 ...] [--json out.json] [--sass]

``--sass`` also exports each build (``tvmfuse.export``: nvcc compiles the kernels to the arch's machine
code), so ptxas checks every kernel's registers and shared memory; ``tvm.compile`` alone stops at PTX, and
a kernel over the block's shared memory then fails only when a GPU loads it.

benchmarks/cuda_corpus_build.json (sm_80) and cuda_corpus_build_sm90.json (sm_90) are its records.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "corpus"))

import corpus_io  # noqa: E402

import tvmfuse  # noqa: E402
from tvmfuse import _compat as C  # noqa: E402


def build(entry: dict, arch: str, sass: bool = False) -> dict:
    import tempfile

    target = C.Target({"kind": "cuda", "arch": arch}, host=tvmfuse.host_target())
    start = time.time()
    try:
        cm = tvmfuse.compile(corpus_io.model_path(entry, "static"), target=target)
        if sass:
            with tempfile.TemporaryDirectory() as tmp:
                tvmfuse.export(cm, os.path.join(tmp, "artifact"))
    except Exception as e:      # recorded per model: the check goes on with the next one
        lines = [ln for ln in str(e).splitlines() if "error" in ln.lower()] or str(e).splitlines() or [""]
        return {"error": f"{type(e).__name__}: {lines[0][:300]}", "s": round(time.time() - start, 1)}
    scheds = cm.report.schedules
    others = collections.Counter(s["template"] for s in scheds if not s["template"].startswith("cuda_"))
    return {"kernels": len(scheds), "cuda_templates": len(scheds) - sum(others.values()),
            "other_schedules": dict(others), "s": round(time.time() - start, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_80")
    ap.add_argument("--models", nargs="*", help="corpus model names (default: all)")
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--sass", action="store_true", help="also export: nvcc to machine code (ptxas checks)")
    args = ap.parse_args(argv)
    entries = corpus_io.load_manifest()["models"]
    if args.models:
        entries = [e for e in entries if e["name"] in set(args.models)]
    check = ("build and export (tvm.compile, then nvcc to %s machine code: ptxas checked every kernel); "
             "nothing ran on a GPU" % args.arch) if args.sass else "build only (tvm.compile with nvcc); nothing ran on a GPU"
    out = {"arch": args.arch, "check": check,
           "date": time.strftime("%Y-%m-%d"), "models": {}}
    for e in entries:
        out["models"][e["name"]] = rec = build(e, args.arch, args.sass)
        print(e["name"], json.dumps(rec), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    failed = [n for n, r in out["models"].items() if "error" in r or r["other_schedules"]]
    print(f"{len(out['models']) - len(failed)} of {len(out['models'])} models build with every kernel on a "
          f"cuda_ template" + (f"; not: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
