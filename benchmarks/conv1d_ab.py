"""Whole-model A/B of ``passes.conv1d.Conv1dAsConv2d`` (Conv1d on the conv2d templates), one thread, paired
rounds: the model compiled as the pipeline stands ("new") and with that pass left out ("before": its conv1d
kernels on ``cpu.generic``), in one process, the outputs of the two compared, then ``run()`` timed alternately.

    PYTHONPATH=. python benchmarks/conv1d_ab.py whisper_encoder [--rounds 15 --number 40 --json out.json]

Per round each build runs ``--number`` calls; the calling thread's CPU time per call (``time.thread_time``;
TVM_NUM_THREADS=1, set here unless the caller did, so the kernels run on that thread), min / median over
rounds and the median of the per-round ratios new / before.  Every number is measured under whatever load
the machine had: it ranks, it is not a figure to quote.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_common import model_parser, one_thread_model  # noqa: E402
from model_knob_ab import paired_ab, report  # noqa: E402


def build(path: str, rewrite: bool):
    """tvmfuse.compile(path) on the host; without ``rewrite`` the pipeline gets a pass that returns its input
    in place of Conv1dAsConv2d (``passes.pre_legalize_passes`` imports it from ``passes.conv1d`` per build)."""
    import tvmfuse
    from tvmfuse import _compat as C
    from tvmfuse.passes import conv1d

    @C.module_pass(opt_level=0, name="tvmfuse.Conv1dAsConv2d_off")
    class Off:
        def transform_module(self, mod, _ctx):
            return mod

    real = conv1d.Conv1dAsConv2d
    if not rewrite:
        conv1d.Conv1dAsConv2d = Off
    try:
        return tvmfuse.compile(path, tvmfuse.parse_target(None), tuning_log=None)
    finally:
        conv1d.Conv1dAsConv2d = real


def main(argv=None) -> int:
    a = model_parser(__doc__.splitlines()[0]).parse_args(argv)
    feeds, path = one_thread_model(a.model)
    builds = {"new": build(path, True), "before": build(path, False)}
    return report(paired_ab(builds, feeds, a.rounds, a.number, {
        "model": a.model, "kernels": {k: cm.kernel_count for k, cm in builds.items()},
        "templates": {k: sorted({s["template"] for s in cm.report.schedules}) for k, cm in builds.items()}}),
        a.json)


if __name__ == "__main__":
    sys.exit(main())
