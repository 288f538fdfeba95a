"""The tuner on a kernel with size buckets (``cpu.symbolic_matmul``): one task per bucket, each measured at
a size inside its bucket, its records carrying the bucket; the compiled model applies each bucket's best
record to that bucket's nest only.  No timing is asserted."""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import records as R
from tvmfuse import target as TG
from tvmfuse.schedules.cpu.symbolic_matmul import SymbolicMatmulEpilogue
from tvmfuse.tune import MeasureOptions, TuneOptions, Tuner, extract_tasks, task_for
from tvmfuse.tune import log as L
from tvmfuse.tune.measure import Measurer, concrete_shapes, normal_inputs

from test_symbolic_matmul import _kernels, _mlp, _proj3d

FAMILY = SymbolicMatmulEpilogue.family
FAST = MeasureOptions(repeat=2, min_repeat_ms=1, build_timeout=60.0, run_timeout=30.0, n_build=1)


def _bounds(target):
    d = TG.template_defaults(target, FAMILY)
    return int(d["small_rows"]), int(d["nominal_rows"])


def _names(model, target) -> list[str]:
    """The kernel's buckets: a serial one first where a few rows are under the fork/join cost
    (tests/test_symbolic_buckets.py checks the bounds), the GEMV-like one, the row-tiled one."""
    (_, func), = _kernels(model, target).items()
    t = SymbolicMatmulEpilogue()
    return [b.name for b in t.buckets(t.match(func, target), target)]


def test_one_task_per_bucket_measured_inside_its_bucket(host):
    small, nominal = _bounds(host)
    tasks = extract_tasks(_mlp(), host)
    names = _names(_mlp(), host)
    assert names[-2:] == [f"rows<={small}", f"rows>{small}"]
    assert [(t.family, t.bucket) for t in tasks] == [(FAMILY, n) for n in names]
    assert len({t.workload_key for t in tasks}) == 1
    assert [t.key for t in tasks] == [R.bucket_key(t.workload_key, t.bucket) for t in tasks]
    bounds = [int(n.split("<=")[1]) for n in names[:-1]]
    assert [t.sizes for t in tasks] == [{"batch": b} for b in bounds] + [{"batch": max(nominal, small + 1)}]
    # each bucket's own space: the bounded ones are not row-tiled
    assert all({c["mr"] for c in t.space.all_configs()} == {1} for t in tasks[:-1])
    assert tasks[-1].default_config["mr"] > 1
    tasks = [t for t in tasks if t.bucket == f"rows<={small}"]
    x, w, b, y = normal_inputs(tasks[0].func, sizes=tasks[0].sizes)
    assert x.shape == (small, 64) and y.shape == (small, 32) and w.shape == (64, 32)
    with pytest.raises(ValueError, match=r"\['batch'\] of the kernel have no size"):
        concrete_shapes(tasks[0].func)
    # rows = batch x sequence: all of the rows on the innermost symbolic extent
    (_, func), = _kernels(_proj3d(), host).items()
    t = task_for(func, host, bucket=f"rows<={small}")
    assert t.sizes == {"batch": 1, "sequence": small}
    assert task_for(func, host, bucket="rows<=3") is None


def test_tuned_buckets_are_logged_by_bucket_and_applied_per_nest(tmp_path, host, rng):
    small, _ = _bounds(host)
    model = _mlp()
    tasks = extract_tasks(model, host)
    log_path = tmp_path / "buckets.jsonl"
    m = Measurer(host, FAST)
    try:
        res = Tuner(tasks, host, log_path, TuneOptions(trials=6, batch=2, seed=0), FAST, measurer=m).run()
    finally:
        m.close()
    assert res.trials_run == 6
    recs = L.load(log_path, host).measures
    by_bucket = {}
    for r in recs:
        by_bucket.setdefault(r.get("bucket"), []).append(r)
    names = _names(model, host)
    assert set(by_bucket) == set(names)
    assert all(r["config"]["mr"] == 1 for n in names[:-1] for r in by_bucket[n])
    assert all(r["error"] is None for r in recs), [r["error"] for r in recs if r["error"]]
    # one workload record for the buckets
    assert len(L.load(log_path, host).workloads) == 1
    best = R.best_configs(str(log_path), host)
    wk = tasks[0].workload_key
    assert set(best) == {f"{wk}@{n}" for n in names}
    cm = tvmfuse.compile(model, target=host, tuning_log=str(log_path))
    (sched,) = cm.report.schedules
    got = sched["knobs"]["buckets"]
    assert [(g["bucket"], g["source"]) for g in got] == [(n, "tuned") for n in names]
    assert [g["config"] for g in got] == [best[f"{wk}@{n}"]["config"] for n in names]
    from tvmfuse import models as M

    for n in (1, small, small + 1, 100):
        x = rng.standard_normal((n, 64)).astype(np.float32)
        np.testing.assert_allclose(cm.run({"x": x})["y"], M.reference_outputs(model, {"x": x})["y"],
                                   rtol=1e-4, atol=1e-4, err_msg=f"rows={n}")
