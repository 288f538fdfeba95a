"""Whole-model A/B of fusion rules, one thread, paired rounds: the model compiled with every rule ("new") and
with the named rules taken out of ``passes.rules.RULES`` ("before"), in one process, the outputs of the two
compared, then ``run()`` timed alternately (``model_knob_ab.paired_ab``).

    TVM_NUM_THREADS=1 PYTHONPATH=. python benchmarks/rule_ab.py regnet_y --without scale_prologue \
        [--variant dynamic --dims batch=3] [--rounds 15 --number 40 --json out.json]

Only the pairs a removed rule would join change: they stay separate kernels ("no rule" refusals).  The
calling thread's CPU time per call, min / median over rounds and the median of the per-round ratios
new / before.  Every number is measured under whatever load the machine had: it ranks, it is not a figure
to quote.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


corpus_io = _load("corpus_io", os.path.join(ROOT, "corpus", "corpus_io.py"))
knob_ab = _load("model_knob_ab", os.path.join(ROOT, "benchmarks", "model_knob_ab.py"))


def build(path: str, without: tuple = ()):
    """tvmfuse.compile(path) with the rules named in ``without`` taken out of the rule table."""
    import tvmfuse
    from tvmfuse.passes import rules as R

    unknown = set(without) - set(R.RULES_BY_NAME)
    if unknown:
        raise SystemExit(f"no rule(s) {sorted(unknown)}; the rules: {sorted(R.RULES_BY_NAME)}")
    real = R.RULES
    R.RULES = tuple(r for r in real if r.name not in without)
    try:
        return tvmfuse.compile(path, tvmfuse.parse_target(None), tuning_log=None)
    finally:
        R.RULES = real


def main(argv=None) -> int:
    names = [e["name"] for e in corpus_io.load_manifest()["models"]]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=names)
    ap.add_argument("--without", nargs="+", required=True, help="rule names left out of the 'before' build")
    ap.add_argument("--variant", default="static", choices=("static", "dynamic"))
    ap.add_argument("--dims", default="", help="sizes of the dynamic variant's symbols: batch=3,sequence=17")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--number", type=int, default=40, help="calls per timed round")
    ap.add_argument("--json", help="write the result to this JSON file")
    a = ap.parse_args(argv)
    os.environ.setdefault("TVM_NUM_THREADS", "1")     # before TVM starts its thread pool
    entry = {e["name"]: e for e in corpus_io.load_manifest()["models"]}[a.model]
    dims = {k: int(v) for k, v in (p.split("=") for p in a.dims.split(",") if p)} or None
    if a.variant == "dynamic" and dims is None:
        raise SystemExit("--variant dynamic needs --dims (batch=3, ...)")
    feeds = corpus_io.random_feeds(entry, np.random.default_rng(0), dims)
    path = corpus_io.model_path(entry, a.variant)
    builds = {"new": build(path), "before": build(path, tuple(a.without))}
    return knob_ab.report(knob_ab.paired_ab(builds, feeds, a.rounds, a.number, {
        "model": a.model, "variant": a.variant, "dims": dims, "without": a.without,
        "kernels": {k: cm.kernel_count for k, cm in builds.items()}}), a.json)


if __name__ == "__main__":
    sys.exit(main())
