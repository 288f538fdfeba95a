"""The tuner on test-only templates (so these tests do not depend on the real templates' timing):
bad candidates (crash, raise, hang, wrong numbers) are survived with clear records, no config is
measured twice, the cost model and the search run, and a log's best record is applied."""
import json
import os
import signal
import time

import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.schedules.base import Knob, KnobSpace, Match, Template
from tvmfuse.tune import MeasureOptions, TuneOptions, Tuner, task_for
from tvmfuse.tune import log as L
from tvmfuse.tune.measure import Measurer, compare_outputs


def scale_add_func(n=64, m=256):
    """T = A * 2.5 (an intermediate), B = T + 1."""
    te = C.te
    A = te.placeholder((n, m), name="A")
    T = te.compute((n, m), lambda i, j: A[i, j] * 2.5, name="T")
    B = te.compute((n, m), lambda i, j: T[i, j] + 1.0, name="B")
    return te.create_prim_func([A, B])


def _split_vec(sch, inner, vectorize, parallel):
    sch.compute_inline(sch.get_sblock("T"))
    b = sch.get_sblock("B")
    fused = sch.fuse(*sch.get_loops(b))
    outer, lanes = sch.split(fused, [None, inner])
    if vectorize:
        sch.vectorize(lanes)
    if parallel:
        sch.parallel(outer)


class SplitVec(Template):
    """Elementwise split / vectorize / parallel: a small, clean space (48 configs)."""

    family = "test.split_vec"
    target_kinds = ("llvm",)

    def match(self, func, target):
        names = [b.name_hint for b in _blocks(func)]
        return Match(self.family, {}) if names == ["T", "B"] else None

    def space(self, match, target):
        return KnobSpace((Knob("inner", (1, 2, 4, 8, 16, 32)), Knob("vectorize", (False, True)),
                          Knob("parallel", (False, True)), Knob("unused", (0, 1))))

    def default_config(self, match, target):
        return {"inner": 8, "vectorize": True, "parallel": False, "unused": 0}

    def apply(self, sch, match, config):
        _split_vec(sch, config["inner"], config["vectorize"], config["parallel"])


class Faulty(Template):
    """Each ``mode`` is one kind of bad candidate."""

    family = "test.faulty"
    target_kinds = ("llvm",)

    def match(self, func, target):
        return SplitVec().match(func, target) and Match(self.family, {})

    def space(self, match, target):
        return KnobSpace((Knob("mode", ("ok", "segv", "raise", "hang", "wrong")), Knob("inner", (4, 8))))

    def default_config(self, match, target):
        return {"mode": "ok", "inner": 8}

    def apply(self, sch, match, config):
        mode = config["mode"]
        if mode == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if mode == "raise":
            raise ValueError("this configuration is not legal for the test template")
        if mode == "hang":
            time.sleep(3600)
        if mode == "wrong":      # a real wrong-result schedule: the intermediate truncated to int32
            sch.unsafe_set_dtype(sch.get_sblock("T"), 0, "int32")
            sch.compute_inline(sch.get_sblock("T"))
            return
        _split_vec(sch, config["inner"], True, False)


def _blocks(func):
    out = []
    C.post_order_visit(func.body, lambda n: out.append(n) if isinstance(n, C.SBlock) and n.name_hint != "root"
                       else None)
    return out


FAST = MeasureOptions(repeat=3, min_repeat_ms=5, build_timeout=8.0, run_timeout=20.0, n_build=2)


@pytest.fixture(scope="module")
def measurer():
    """One set of worker processes for the module (each worker imports TVM once)."""
    m = Measurer(tvmfuse.host_target(), FAST)
    yield m
    m.close()


def test_bad_candidates_are_survived_with_clear_records(tmp_path, host, measurer):
    task = task_for(scale_add_func(), host, "scale_add", templates=[Faulty()])
    assert task is not None and task.space.size() == 10
    log_path = tmp_path / "faulty.jsonl"
    res = Tuner([task], host, log_path, TuneOptions(trials=10, batch=10), FAST, measurer=measurer).run()
    assert res.trials_total == 10
    recs = {(r["config"]["mode"], r["config"]["inner"]): r for r in L.load(log_path, host).measures}
    assert len(recs) == 10, "every configuration measured exactly once"
    for inner in (4, 8):
        assert recs[("ok", inner)]["costs"] and recs[("ok", inner)]["error"] is None
        crash = recs[("segv", inner)]["error"]
        assert crash["kind"] == "crash" and "SIGSEGV" in crash["message"], crash
        raised = recs[("raise", inner)]["error"]
        assert raised["kind"] == "build" and "not legal for the test template" in raised["message"], raised
        hang = recs[("hang", inner)]["error"]
        assert hang["kind"] == "timeout" and "8 s limit" in hang["message"], hang
        wrong = recs[("wrong", inner)]["error"]
        assert wrong["kind"] == "wrong_result" and "differ from the default schedule" in wrong["message"], wrong
        for r in recs.values():
            assert (r["costs"] is None) == (r["error"] is not None), "an error is never a cost"
    row = res.tasks[0]
    assert row["errors"] == {"crash": 2, "build": 2, "timeout": 2, "wrong_result": 2}
    assert row["best"] is not None


def test_compare_outputs_names_the_difference():
    ref = [np.zeros((2, 3), "float32"), np.arange(6, dtype="float32").reshape(2, 3)]
    assert compare_outputs(ref, [a.copy() for a in ref], 1e-3, 1e-4) is None
    bad = [ref[0].copy(), ref[1].copy()]
    bad[1][1, 2] += 0.5
    msg = compare_outputs(ref, bad, 1e-3, 1e-4)
    assert "arg1" in msg and "(1, 2)" in msg and "1 of 6" in msg
    nan = [ref[0].copy(), ref[1].copy()]
    nan[0][0, 0] = np.nan
    assert "NaN" in compare_outputs(ref, nan, 1e-3, 1e-4)
    assert "float64" in compare_outputs(ref, [ref[0], ref[1].astype("float64")], 1e-3, 1e-4)


def test_search_never_measures_twice_and_applies_best(tmp_path, host, measurer):
    task = task_for(scale_add_func(), host, "scale_add", templates=[SplitVec()])
    log_path = tmp_path / "sv.jsonl"
    events = []
    opts = TuneOptions(trials=20, batch=6, epsilon=0.34, seed=1)
    res = Tuner([task], host, log_path, opts, FAST, progress=events.append, measurer=measurer).run()
    assert res.trials_run == 20
    recs = L.load(log_path, host).measures
    ids = [L.config_id(r["config"]) for r in recs]
    assert len(ids) == 20 and len(set(ids)) == 20
    assert recs[0]["config"] == task.default_config, "the reference (default) is the first trial"
    assert all(r["costs"] and r["error"] is None for r in recs)
    # the model trained after the first round and ranked the later ones
    trials = [e for e in events if e["event"] == "trial"]
    assert trials[-1]["done"] == 20 and trials[-1]["best_total"] == pytest.approx(res.tasks[0]["searched_best"])
    # a rerun of the finished job re-spends nothing
    res2 = Tuner([task], host, log_path, opts, FAST, measurer=measurer).run()
    assert res2.trials_run == 0 and len(L.load(log_path, host).measures) == 20
    # more trials: only new configurations
    res3 = Tuner([task], host, log_path, TuneOptions(trials=26, batch=6, seed=2), FAST, measurer=measurer).run()
    ids = [L.config_id(r["config"]) for r in L.load(log_path, host).measures]
    assert res3.trials_run == 6 and len(ids) == 26 and len(set(ids)) == 26
    best = L.best_configs(str(log_path), host)[task.workload_key]
    assert best["template"] == "test.split_vec" and best["cost"] == pytest.approx(res3.tasks[0]["best"])


def test_workload_record_lets_another_job_featurize(tmp_path, host, measurer):
    """The log keeps each workload's PrimFunc: warm start can featurize records of other shapes."""
    small = task_for(scale_add_func(32, 128), host, "small", templates=[SplitVec()])
    log_path = tmp_path / "w.jsonl"
    Tuner([small], host, log_path, TuneOptions(trials=8, batch=8), FAST, measurer=measurer).run()
    tl = L.load(log_path, host)
    func = C.load_json(tl.workloads[small.workload_key]["func"])
    from tvmfuse.records import workload_key

    assert workload_key(func) == small.workload_key
    big = task_for(scale_add_func(64, 512), host, "big", templates=[SplitVec()])
    tuner = Tuner([big], host, log_path, TuneOptions(trials=8 + 6, batch=6), FAST, templates=[SplitVec()])
    from tvmfuse.tune.search import TaskState

    tuner._warm_start(measurer, tl, [TaskState(big)])
    assert len(tuner.warm) == 8 and {s.group for s in tuner.warm} == {small.workload_key}


def test_progress_line_and_curve_png(tmp_path):
    import io

    from tvmfuse.tune.cli import ProgressBar, plot_curve

    buf = io.StringIO()
    bar = ProgressBar(buf)
    bar({"event": "trial", "done": 1, "total": 4, "resumed": 0, "best_total": 2.5e-3, "elapsed": 3.0,
         "eta": 9.0})
    bar({"event": "trial", "done": 4, "total": 4, "resumed": 0, "best_total": 1.25e-3, "elapsed": 12.0,
         "eta": 0.0})
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("[######..................] 1/4 trials | best 2.5 ms | 00:03 elapsed, 00:09 left")
    assert "4/4 trials | best 1.25 ms" in lines[-1]
    png = tmp_path / "curve.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert plot_curve([(1, 2e-3), (4, 1e-3)], str(png)) is None
        return
    assert plot_curve([(1, 2e-3), (4, 1e-3)], str(png)) == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_warm_start_from_another_shapes_log(tmp_path, host, measurer):
    """``transfer_logs``: the records of another shape train the model and its best configurations (those
    the task's own space holds) are measured first, on the task; a record of the other workload is never
    taken as one of this workload (a fake 1 ns record stays out of the result); a corrupt line, a record of
    another template family and one of another target are left out, the corrupt line named with its number."""
    small = task_for(scale_add_func(32, 128), host, "small", templates=[SplitVec()])
    src = tmp_path / "small.jsonl"
    Tuner([small], host, src, TuneOptions(trials=8, batch=8, seed=3), FAST, measurer=measurer).run()
    recs = L.load(src, host).measures
    assert len(recs) == 8 and all(r["costs"] for r in recs)
    ranked = sorted(recs[1:], key=L.median_cost)         # the default (first record) is never a seed
    fake = ranked[-1]                                    # the slowest becomes a fake 1 ns record
    lines = src.read_text().splitlines()
    out = []
    for line in lines:
        r = json.loads(line)
        if r.get("type") == "measure" and r["config"] == fake["config"]:
            r["costs"] = [1e-9]
        out.append(json.dumps(r))
    outside = dict(fake, config={**fake["config"], "unused": 7}, costs=[1e-10])     # not in the space
    other_family = dict(ranked[0], template="test.faulty", costs=[1e-10])
    other_target = dict(ranked[0], target_key="llvm,mcpu=other", costs=[1e-10])
    out += [json.dumps(outside), json.dumps(other_family), "{not json", json.dumps(other_target)]
    src.write_text("\n".join(out) + "\n")
    corrupt_line = len(lines) + 3

    big = task_for(scale_add_func(64, 512), host, "big", templates=[SplitVec()])
    dst = tmp_path / "big.jsonl"
    res = Tuner([big], host, dst, TuneOptions(trials=6, batch=6, seed=0, transfer_logs=(str(src),),
                                              transfer_seeds=2), FAST, measurer=measurer,
                templates=[SplitVec()]).run()
    ws = res.warm_start
    assert ws["workloads"] == 1 and ws["records"] == 9, ws      # 8 of the other shape + the out-of-space one
    assert ws["seeds"] == 2
    assert len(ws["skipped_lines"]) == 1 and f"{src}:{corrupt_line}:" in ws["skipped_lines"][0]
    mine = L.load(dst, host)
    assert {r["workload_key"] for r in mine.measures} == {big.workload_key}
    assert set(mine.workloads) == {big.workload_key}
    got = [r["config"] for r in mine.measures]
    assert got[0] == big.default_config
    assert got[1:3] == [fake["config"], ranked[0]["config"]], "the other shape's two best (in-space) go first"
    measured_fake = L.median_cost(mine.measures[1])
    assert measured_fake > 1e-7, "the seed is measured on this workload, not copied from the other log"
    assert res.tasks[0]["searched_best"] == min(L.median_cost(r) for r in mine.measures) > 1e-7
    assert res.tasks[0]["best"] > 1e-7
    assert res.tasks[0]["trials"] == 6


def test_warm_start_seeds_off_and_missing_log(tmp_path, host, measurer):
    """``transfer_seeds=0``: the records train the model only; a missing transfer log is a clear error."""
    small = task_for(scale_add_func(32, 128), host, "small", templates=[SplitVec()])
    src = tmp_path / "small.jsonl"
    Tuner([small], host, src, TuneOptions(trials=4, batch=4), FAST, measurer=measurer).run()
    big = task_for(scale_add_func(64, 512), host, "big", templates=[SplitVec()])
    res = Tuner([big], host, tmp_path / "b.jsonl", TuneOptions(trials=1, transfer_logs=(str(src),),
                                                                transfer_seeds=0),
                FAST, measurer=measurer, templates=[SplitVec()]).run()
    assert res.warm_start["records"] == 4 and res.warm_start["seeds"] == 0
    from tvmfuse.errors import TuningLogError

    with pytest.raises(TuningLogError, match="cannot read tuning log .*nope.jsonl"):
        Tuner([big], host, tmp_path / "c.jsonl", TuneOptions(trials=1, transfer_logs=(str(tmp_path / "nope.jsonl"),)),
              FAST, measurer=measurer, templates=[SplitVec()]).run()
