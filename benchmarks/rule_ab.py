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

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_common import model_parser, one_thread_model, parse_dims  # noqa: E402
import model_knob_ab as knob_ab  # noqa: E402


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
    ap = model_parser(__doc__.splitlines()[0])
    ap.add_argument("--without", nargs="+", required=True, help="rule names left out of the 'before' build")
    ap.add_argument("--variant", default="static", choices=("static", "dynamic"))
    ap.add_argument("--dims", default="", help="sizes of the dynamic variant's symbols: batch=3,sequence=17")
    a = ap.parse_args(argv)
    dims = parse_dims(a.dims)
    if a.variant == "dynamic" and dims is None:
        raise SystemExit("--variant dynamic needs --dims (batch=3, ...)")
    feeds, path = one_thread_model(a.model, a.variant, dims)
    builds = {"new": build(path), "before": build(path, tuple(a.without))}
    return knob_ab.report(knob_ab.paired_ab(builds, feeds, a.rounds, a.number, {
        "model": a.model, "variant": a.variant, "dims": dims, "without": a.without,
        "kernels": {k: cm.kernel_count for k, cm in builds.items()}}), a.json)


if __name__ == "__main__":
    sys.exit(main())
