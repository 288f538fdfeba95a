"""Whole-model A/B of one template family's default knobs, one thread, paired rounds: the model compiled with
the family's target defaults ("new") and with some of its default knobs overridden ("before"), in one
process, the outputs of the two compared, then ``run()`` timed alternately.

    TVM_NUM_THREADS=1 PYTHONPATH=. python benchmarks/model_knob_ab.py squeezenet1_1 \
        --family cpu.conv2d_lanes --before '{"pad_in_loads": false}' [--rounds 15 --number 40 --json out.json]
    TVM_NUM_THREADS=1 PYTHONPATH=. python benchmarks/model_knob_ab.py --workload resnet_block \
        --family cpu.conv2d_lanes --before '{"template_defaults": {"wide_lane_use_below": 0}}'

``--workload`` takes one of ``benchmarks/bench_cpu.py``'s workloads (full size) instead of a corpus model,
on random normal inputs (seed 0).

A ``template_defaults`` entry in ``--before`` is not a knob: "before" compiles with those entries of the
family's ``template_defaults`` in ``schedules/cpu_targets.json`` replaced (the defaults before a table change:
``--before '{"template_defaults": {"lanes_plane_pixels_below": 0}}'``), then its other overrides applied.

The override replaces the family's ``default_config`` while "before" compiles (configs from a tuning log are
not touched: compile with none).  Per round each build runs ``--number`` calls; the calling thread's CPU
time per call (``time.thread_time``; TVM_NUM_THREADS=1, set here unless the caller did, so the kernels run
on that thread), min / median over rounds and the median of the per-round ratios new / before.  Every
number is measured under whatever load the machine had: it ranks, it is not a figure to quote.
"""
from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_common import ROOT, corpus_io, model_parser, one_thread_model, write_json  # noqa: E402,F401


def _template_class(family: str, target):
    from tvmfuse.schedules import templates_for

    found = [type(t) for t in templates_for(target) if t.family == family]
    if not found:
        raise SystemExit(f"no template of family {family!r} for {target}")
    return found[0]


def build(path: str, family: str, before: dict | None):
    """tvmfuse.compile(path), with ``before`` merged into ``family``'s default configs when given."""
    import tvmfuse
    from tvmfuse import target as TG

    target = tvmfuse.parse_target(None)
    cls = _template_class(family, target)
    real, real_table = cls.default_config, TG.cpu_table
    before = dict(before or {})
    entries = before.pop("template_defaults", None)
    if entries:
        table = json.loads(json.dumps(real_table()))
        unknown = sorted(set(entries) - set(table["template_defaults"][family]))
        if unknown:
            raise SystemExit(f"template_defaults of {family} has no {unknown}")
        table["template_defaults"][family].update(entries)
        TG.cpu_table = lambda: table
    if before:
        def patched(self, match, tgt):
            cfg = real(self, match, tgt)
            unknown = set(before) - set(cfg)
            if unknown:
                raise SystemExit(f"{family} has no knob(s) {sorted(unknown)}; its knobs: {sorted(cfg)}")
            return {**cfg, **before}
        cls.default_config = patched
    try:
        return tvmfuse.compile(path, target, tuning_log=None)
    finally:
        cls.default_config = real
        TG.cpu_table = real_table


def _cpu_us(fn, number: int) -> float:
    t0 = time.thread_time()
    for _ in range(number):
        fn()
    return (time.thread_time() - t0) / number * 1e6


def _outputs(cm, feeds) -> list:
    out = cm.run(feeds)           # {output name: array}
    return [np.array(out[k]) for k in sorted(out)]


def paired_ab(builds: dict, feeds: dict, rounds: int, number: int, extra: dict) -> dict:
    """The A/B both scripts run: ``builds["new"]`` and ``builds["before"]`` checked against each other on
    ``feeds``, then ``run()`` timed in ``rounds`` alternating rounds of ``number`` calls; ``extra`` (model,
    what differs) heads the result."""
    ref = _outputs(builds["before"], feeds)
    for got, want in zip(_outputs(builds["new"], feeds), ref):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    times = {k: [] for k in builds}
    for cm in builds.values():
        cm.run(feeds)
    for r in range(rounds):
        order = list(builds) if r % 2 == 0 else list(reversed(list(builds)))
        for k in order:
            times[k].append(_cpu_us(lambda cm=builds[k]: cm.run(feeds), number))
    ratios = [n / b for n, b in zip(times["new"], times["before"])]
    return {**extra,
            "us_min_median": {k: [round(min(v), 1), round(statistics.median(v), 1)] for k, v in times.items()},
            "ratio_new_over_before_median": round(statistics.median(ratios), 3),
            "clock": "thread_time, TVM_NUM_THREADS=" + os.environ.get("TVM_NUM_THREADS", "?")
                     + f", {rounds} alternating rounds x {number} run() calls, measured under load"}


def report(out: dict, path: str | None) -> int:
    print(json.dumps(out))
    write_json(out, path)
    return 0


def _workload(name: str) -> tuple[str, dict]:
    """(ONNX file in a temporary folder, random inputs) of a ``bench_cpu.py`` workload at its full size."""
    import tempfile

    import onnx

    spec = importlib.util.spec_from_file_location("bench_cpu", os.path.join(ROOT, "benchmarks", "bench_cpu.py"))
    bench_cpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_cpu)
    found = {w[0]: w[1] for w in bench_cpu.workloads(quick=False, models=True)}
    if name not in found:
        raise SystemExit(f"--workload {name!r}: not a bench_cpu.py workload ({sorted(found)})")
    model = found[name]
    path = os.path.join(tempfile.mkdtemp(prefix="model_knob_ab-"), f"{name}.onnx")
    onnx.save(model, path)
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype("float32")
             for i in model.graph.input}
    return path, feeds


def main(argv=None) -> int:
    ap = model_parser(__doc__.splitlines()[0], model_optional=True)
    ap.add_argument("--workload", help="a benchmarks/bench_cpu.py workload instead of a corpus model")
    ap.add_argument("--family", required=True, help="template family, e.g. cpu.conv2d_lanes")
    ap.add_argument("--before", required=True, help="JSON knob overrides of the 'before' build")
    a = ap.parse_args(argv)
    if (a.model is None) == (a.workload is None):
        ap.error("give a corpus model or --workload, not both")
    if a.workload:
        os.environ.setdefault("TVM_NUM_THREADS", "1")     # before TVM starts its thread pool
        path, feeds = _workload(a.workload)
    else:
        feeds, path = one_thread_model(a.model)
    before = json.loads(a.before)
    builds = {"new": build(path, a.family, None), "before": build(path, a.family, before)}
    return report(paired_ab(builds, feeds, a.rounds, a.number, {
        "model": a.model or a.workload, "family": a.family, "before": before,
        "scheduled_kernels": {k: len(cm.report.schedules) for k, cm in builds.items()}}), a.json)


if __name__ == "__main__":
    sys.exit(main())
