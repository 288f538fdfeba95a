"""What a user sees on corpus models through the public API (session 8's unseen architectures by default):
per model, ``tvmfuse.compile(path).run(feeds)`` against onnxruntime on fresh random inputs, the kernel count
next to TVM's own FuseOps (``tvmfuse.stock_pipeline``'s grouping, counted before any schedule), the template
each kernel got (``fallback`` / ``unscheduled`` / ``generic`` named), and the ``_dyn`` variant at a few batch
sizes.  No timing (``bench_models.py --models ...`` times them, in separate worker processes).

    PYTHONPATH=. python benchmarks/new_models_check.py                       # NEW_MODELS
    PYTHONPATH=. python benchmarks/new_models_check.py swin --json out.json  # named corpus models
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_common import corpus_io  # noqa: E402

NEW_MODELS = corpus_io.OPT_IN_MODELS     # session 8's unseen architectures (corpus/make_corpus.py)
REL_TOL = 1e-4            # the corpus target (tests/test_corpus.py)
DYN_BATCHES = (1, 3)
# templates that mean "no fused-kernel template matched": the kernels to look at first
WEAK_TEMPLATES = ("fallback", "unscheduled", "generic")


def fuseops_kernels(path: str, target) -> int:
    """Kernels per call of TVM's own grouping (LegalizeOps + FuseOps + FuseTIR), counted as the report
    counts tvmfuse's."""
    import tvmfuse
    from tvmfuse import _compat as C
    from tvmfuse.pipeline import PipelineOptions, Stages
    from tvmfuse.report import graph_stats

    st = Stages(target, PipelineOptions(fusion=False, schedules=False, fast_math=False,
                                        element_aligned_args=False))
    with st.target:
        mod = C.Sequential(st.graph())(tvmfuse.load_onnx(path))
    return graph_stats(mod).kernels


def _ort(path: str, entry: dict, feeds: dict) -> dict:
    import onnxruntime as ort

    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return dict(zip(entry["outputs"], sess.run(entry["outputs"], feeds)))


def _errors(got: dict, want: dict) -> dict:
    return {k: corpus_io.relative_error(got[k], v) for k, v in want.items()}


def check(entry: dict, seed: int = 0) -> dict:
    import tvmfuse

    rng = np.random.default_rng(seed)
    rec: dict = {"model": entry["name"]}
    path = corpus_io.model_path(entry, "static")
    try:
        t0 = time.perf_counter()
        cm = tvmfuse.compile(path)
        rec["compile_s"] = round(time.perf_counter() - t0, 1)
        feeds = corpus_io.random_feeds(entry, rng)
        rec["rel_err"] = _errors(cm.run(feeds), _ort(path, entry, feeds))
        rec["kernels_unfused"] = cm.report.kernels_before
        rec["kernels"] = cm.kernel_count
        rec["kernels_fuseops"] = fuseops_kernels(path, tvmfuse.host_target())
        rec["templates"] = dict(collections.Counter(s.get("template", "?") for s in cm.report.schedules))
        rec["weak"] = [{"kernel": s["kernel"], "template": s.get("template"), "reason": s.get("reason", "")}
                       for s in cm.report.schedules
                       if str(s.get("template")).rsplit(".", 1)[-1] in WEAK_TEMPLATES]
        rec["refused"] = len(cm.report.refused)
    except Exception as e:  # noqa: BLE001 - the failure is the finding, recorded with its traceback
        rec["error"] = f"{type(e).__name__}: {str(e).strip()[:500]}"
        rec["traceback"] = traceback.format_exc()[-3000:]
        return rec
    dpath = corpus_io.model_path(entry, "dynamic")
    try:
        t0 = time.perf_counter()
        dm = tvmfuse.compile(dpath)
        rec["dyn_compile_s"] = round(time.perf_counter() - t0, 1)
        rec["dyn_kernels"] = dm.kernel_count
        rec["dyn_templates"] = dict(collections.Counter(s.get("template", "?") for s in dm.report.schedules))
        rec["dyn_rel_err"] = {}
        for b in DYN_BATCHES:
            dims = {"batch": b, "sequence": 17}
            feeds = corpus_io.random_feeds(entry, rng, dims=dims)
            rec["dyn_rel_err"][b] = max(_errors(dm.run(feeds), _ort(dpath, entry, feeds)).values())
    except Exception as e:  # noqa: BLE001 - the failure is the finding
        rec["dyn_error"] = f"{type(e).__name__}: {str(e).strip()[:500]}"
        rec["dyn_traceback"] = traceback.format_exc()[-3000:]
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help=f"corpus model names (default: {' '.join(NEW_MODELS)})")
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    entries = {e["name"]: e for e in corpus_io.load_manifest()["models"]}
    names = args.models or [n for n in NEW_MODELS if n in entries]
    unknown = sorted(set(names) - set(entries))
    if unknown:
        ap.error(f"unknown model(s) {unknown}; the corpus has {sorted(entries)}")
    recs = []
    for name in names:
        rec = check(entries[name], args.seed)
        recs.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if "traceback" not in k}), flush=True)
        for k in ("traceback", "dyn_traceback"):
            if k in rec:
                print(rec[k], file=sys.stderr)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(recs, f, indent=1)
            f.write("\n")
    bad = [r["model"] for r in recs if "error" in r or "dyn_error" in r
           or max(r.get("rel_err", {}).values(), default=0) > REL_TOL]
    print(f"{len(recs)} models; failing: {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
