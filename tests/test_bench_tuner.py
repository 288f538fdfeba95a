"""benchmarks/bench_tuner.py without tuning: the study in pieces merged into one JSON; the cost-model quality
measures on synthetic records of a known order."""
import importlib.util
import json
import math
import os

import numpy as np
import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bench_tuner", os.path.join(_ROOT, "benchmarks", "bench_tuner.py"))
T = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(T)


def _piece(budgets, seed=0, trials=None, target="llvm -mcpu=x", shape=(("m", 8),), date="d"):
    trials = trials or max(budgets)
    cell = {"budgets": {b: {"tvmfuse": {"median_s": 1e-3 / b}} for b in budgets},
            "tvmfuse_curves": {"trial_costs": [1.0] * trials}, "default": {"median_s": 2e-3}}
    return {"date": date, "command": f"piece {budgets}", "target": target, "small": False, "quick": True,
            "check": {"rtol": 1e-3}, "budgets": budgets, "seeds": [seed],
            "workloads": {"mm": {"kernel": "k", "shape": dict(shape), "seeds": {seed: cell}}},
            "transfer": {"mm": {"shape": dict(shape), "sources": [], "seeds": {seed: {"with_records": trials}}}}}


def test_pieces_merge_into_one_study():
    study = T.merge_results(None, _piece([64], date="first"))
    study = T.merge_results(study, _piece([256], date="second"))
    study = T.merge_results(study, _piece([64], seed=1, date="third"))
    study = json.loads(json.dumps(study))                          # what the file holds
    cells = study["workloads"]["mm"]["seeds"]
    assert sorted(cells) == ["0", "1"]
    assert list(cells["0"]["budgets"]) == ["64", "256"]
    assert [cells["0"]["budgets"][b]["piece"] for b in ("64", "256")] == [0, 1]
    assert len(cells["0"]["tvmfuse_curves"]["trial_costs"]) == 256   # the curve of the longer run
    assert [p["date"] for p in study["pieces"]] == ["first", "second", "third"]
    assert study["transfer"]["mm"]["seeds"]["0"]["piece"] == 1


def test_a_rerun_budget_replaces_the_cell():
    study = T.merge_results(None, _piece([64]))
    new = _piece([64])
    new["workloads"]["mm"]["seeds"][0]["budgets"][64]["tvmfuse"]["median_s"] = 5.0
    study = T.merge_results(study, new)
    assert study["workloads"]["mm"]["seeds"]["0"]["budgets"]["64"] == {"tvmfuse": {"median_s": 5.0}, "piece": 1}


@pytest.mark.parametrize("change, what", [({"target": "llvm -mcpu=other"}, "target"),
                                          ({"shape": (("m", 16),)}, "shape")])
def test_pieces_of_another_study_are_refused(change, what):
    study = T.merge_results(None, _piece([64]))
    with pytest.raises(ValueError, match=what):
        T.merge_results(study, _piece([256], **change))


# ---- cost-model quality on held-out records (no tuning: synthetic records with a known order) ----

def test_rank_measures_on_known_orderings():
    costs = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    faster_first = [-c for c in costs]
    assert T.rank_correlation(faster_first, costs) == pytest.approx(1.0)
    assert T.rank_correlation(costs, costs) == pytest.approx(-1.0)            # ranked exactly backwards
    assert T.top_k_recall(faster_first, costs, 2) == 1.0
    assert T.top_k_recall(costs, costs, 2) == 0.0                              # picks the two slowest
    assert T.top_k_recall([6, 1, 5, 2, 3, 4], costs, 2) == 0.5                 # picks #1 and #3
    assert T.top_k_recall(faster_first, costs, 10) == 1.0                      # k capped at 6
    assert math.isnan(T.rank_correlation([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))   # constant scores: undefined


def _synthetic_records(n=60, seed=0):
    """Records of one workload whose cost grows with one program feature and one knob: a learnable order."""
    from tvmfuse.tune.cost_model import Sample

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        x, tile = rng.uniform(0, 1), int(rng.choice([4, 8, 16, 32]))
        cost = 1e-3 * (1 + 3 * x + tile / 16)
        out.append(Sample("wk", np.array([x, 0.5]), {"tile": tile}, cost))
    return out


def test_cost_model_quality_learns_a_known_ordering():
    q = T.cost_model_quality(_synthetic_records(), train_fraction=0.6, splits=3, ks=(1, 5), seed=0)
    assert q["samples"] == 60 and q["workloads"] == 1 and len(q["splits"]) == 3
    assert all(r["train"] == 36 and r["test"] == 24 for r in q["splits"])
    s = q["summary"]
    assert s["spearman"]["min"] > 0.9 and s["pairwise_accuracy"]["min"] > 0.85
    assert s["recall@5"]["mean"] >= 0.6


def test_cost_model_quality_of_an_unlearnable_set_is_near_chance():
    """Costs independent of the features: the same measures drop to chance (the test above can fail)."""
    recs = _synthetic_records(n=80)
    rng = np.random.default_rng(1)
    for r in recs:
        r.cost = float(rng.uniform(1e-3, 2e-3))
    q = T.cost_model_quality(recs, splits=3, ks=(5,), seed=0)
    assert abs(q["summary"]["spearman"]["mean"]) < 0.4


def test_cost_model_quality_refuses_too_few_records():
    with pytest.raises(ValueError, match="too few records"):
        T.cost_model_quality(_synthetic_records(n=2), splits=1)


# ---- resuming a study: pieces already in the JSON are skipped, errors are recorded and retried ----

def test_piece_done_skips_only_complete_error_free_pieces():
    study = json.loads(json.dumps(T.merge_results(None, _piece([64, 256]))))
    shape = {"m": 8}
    assert T.piece_done(study, "study", "mm", 0, [64, 256], shape)          # held: skipped
    assert T.piece_done(study, "study", "mm", 0, [64], shape)
    assert T.piece_done(study, "study", "mm", 0, [64, 1000], shape) is None  # a budget it lacks: run
    assert T.piece_done(study, "study", "mm", 1, [64], shape) is None        # another seed: run
    assert T.piece_done(study, "study", "mm", 0, [64], {"m": 16}) is None    # another shape: run
    assert T.piece_done(None, "study", "mm", 0, [64], shape) is None
    failed = {**_piece([1000], seed=2), "transfer": {}}
    failed["workloads"]["mm"]["seeds"] = {2: {"error": "RuntimeError: worker died", "budgets": {}}}
    study = json.loads(json.dumps(T.merge_results(study, failed)))
    assert study["workloads"]["mm"]["seeds"]["2"]["error"].startswith("RuntimeError")
    assert T.piece_done(study, "study", "mm", 2, [1000], shape) is None      # an error is retried
    # the retry replaces the error; a later error never replaces results (kept as later_errors)
    study = T.merge_results(study, _piece([1000], seed=2))
    assert "error" not in study["workloads"]["mm"]["seeds"]["2"]
    study = T.merge_results(study, failed)
    cell = study["workloads"]["mm"]["seeds"]["2"]
    assert "error" not in cell and cell["later_errors"][0]["error"].startswith("RuntimeError")
    assert list(cell["budgets"]) == ["1000"]


def test_transfer_piece_done_and_seeds_added_without_losing_entries():
    study = T.merge_results(None, _piece([64]))
    tr = {"shape": {"m": 8}, "sources": [], "seeds": {"1": {"with_records": {"trial_costs": [1.0] * 64},
                                                            "without_records": {}, "budgets_run": [64]}}}
    piece = {**_piece([64], seed=1), "transfer": {"mm": tr}}
    study = json.loads(json.dumps(T.merge_results(study, piece)))
    assert sorted(study["workloads"]["mm"]["seeds"]) == ["0", "1"]
    assert sorted(study["transfer"]["mm"]["seeds"]) == ["0", "1"]
    assert T.piece_done(study, "transfer", "mm", 1, [64], {"m": 8})
    assert T.piece_done(study, "transfer", "mm", 1, [256], {"m": 8}) is None


def test_check_mergeable_refuses_another_study_before_tuning():
    study = T.merge_results(None, _piece([64]))
    with pytest.raises(SystemExit, match="target"):
        T.check_mergeable(study, {"target": "llvm -mcpu=other", "small": False, "quick": True,
                                  "check": {"rtol": 1e-3}})
    T.check_mergeable(study, {"target": "llvm -mcpu=x", "small": False, "quick": True, "check": {"rtol": 1e-3}})


# ---- plot_tuner: the marks it prints (no matplotlib needed) ----

_pspec = importlib.util.spec_from_file_location("plot_tuner", os.path.join(_ROOT, "benchmarks", "plot_tuner.py"))
P = importlib.util.module_from_spec(_pspec)
_pspec.loader.exec_module(P)


def test_first_reach_and_marks():
    assert P.first_reach([None, 5.0, 3.0, 2.0], [1, 2, 3, 4], 3.0) == (3, 3)
    assert P.first_reach([None, 5.0, 3.3], [1, 2, 3], 3.0) is None
    assert P.first_reach([None, 5.0, 3.3], [1, 2, 3], 3.0, tolerance=0.1) == (3, 3)
    assert P.first_reach([1.0], [1], None) is None
    cell = {"tvmfuse_curves": {"default_cost": 2.0, "from_default": [2.0, 2.0, 1.5], "trial_wall_s": [1, 2, 3]},
            "ms_curves": {"cold": [None, 9.0, 4.0, 1.8], "trial_wall_s": [10, 20, 30, 40]}}
    study = {"workloads": {"mm": {"shape": {"m": 8}, "seeds": {"0": cell, "1": {"error": "boom"}}}}}
    rows = P.marks(study)
    assert rows[1] == {"workload": "mm", "seed": "1", "error": "boom"}
    r = rows[0]
    assert r["default_s"] == 2.0 and r["ms_best_s"] == 1.8
    assert r["tuners"]["tvmfuse"]["reach_default"] == (1, 1)
    assert r["tuners"]["tvmfuse"]["reach_ms_best"] == (3, 3)
    assert r["tuners"]["MetaSchedule"]["reach_default"] == (4, 40)
    assert r["tuners"]["MetaSchedule"]["reach_ms_best"] == (4, 40)


@pytest.mark.parametrize("mcpu", ["znver3", "skylake-avx512"])
def test_transfer_sources_are_kernels_of_the_same_template(mcpu):
    """Every shape of the study (small, quick, and the warm-start sources) is a kernel of its workload's
    template on x86 targets: a source of another template would add no records (a conv below 32x32 goes to
    cpu.conv2d_lanes on x86)."""
    from tvmfuse.target import parse_target

    target = parse_target(f"llvm -mtriple=x86_64-linux-gnu -mcpu={mcpu} -num-cores=2")
    for name in T.WORKLOADS:
        shapes = [T.WORKLOADS[name][3], T.QUICK_ARGS[name], *T.QUICK_TRANSFER_SOURCES[name], *T.TRANSFER_SOURCES[name]]
        main_shapes = [T.WORKLOADS[name][2], T.WORKLOADS[name][3], T.QUICK_ARGS[name]]
        for shape in shapes:
            task, _ = T.main_task(name, shape, target)
            assert task.family == T.WORKLOADS[name][1]
        for src in T.TRANSFER_SOURCES[name]:
            assert src not in main_shapes[:2], f"{name}: source {src} is a main shape (its records would be its own)"


# ---- main(): pieces merged as they finish, failures recorded, a rerun resumes (tuning stubbed out) ----

def test_main_records_a_failed_piece_and_a_rerun_resumes(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_study(name, shape, args, target, budgets, seeds):
        (seed,) = seeds
        calls.append(seed)
        if seed == 1 and calls.count(1) == 1:
            raise RuntimeError("the measurer's worker died")
        cell = {"budgets": {b: {"tvmfuse": {"median_s": 1e-3, "wall_s": 1.0}} for b in budgets},
                "tvmfuse_curves": {"trial_costs": [1e-3] * max(budgets)}, "default": {"median_s": 2e-3}}
        return {"kernel": "k", "shape": shape, "seeds": {seed: cell}}

    monkeypatch.setattr(T, "study", fake_study)
    out = str(tmp_path / "study.json")
    argv = ["--quick", "--skip-ms", "--workloads", "matmul_bias_gelu", "--seeds", "0", "1", "--budgets", "4",
            "--merge-into", out]
    assert T.main(argv) == 1                                  # a failed piece: the run says so
    study = json.load(open(out))
    seeds = study["workloads"]["matmul_bias_gelu"]["seeds"]
    assert "error" not in seeds["0"] and "worker died" in seeds["1"]["error"]
    assert "failed pieces" in capsys.readouterr().out
    assert T.main(argv) == 0                                  # the rerun: seed 0 skipped, seed 1 retried
    assert calls == [0, 1, 1]
    study = json.load(open(out))
    assert sorted(study["workloads"]["matmul_bias_gelu"]["seeds"]) == ["0", "1"]
    assert "error" not in study["workloads"]["matmul_bias_gelu"]["seeds"]["1"]
    assert [p["seeds"] for p in study["pieces"]] == [[0], [1], [1]]


def test_run_tvmfuse_records_a_budget_without_a_successful_trial(tmp_path, monkeypatch):
    """Every trial of the first budget failed: that budget is an error (no config), the next has a pick."""
    import tvmfuse
    from tvmfuse.tune import log as L

    target = tvmfuse.host_target()

    class Task:
        workload_key, default_config = "wk", {"a": 0}

    class FakeTuner:
        def __init__(self, tasks, target, log_path, options, *a, **k):
            self.log_path, self.options = log_path, options

        def run(self):
            with L.LogWriter(self.log_path) as w:
                for i in range(self.options.trials):
                    ok = i >= 2
                    w.write(L.make_measure_record(target=target, workload_key="wk", workload={}, template="t",
                                                  config={"a": i}, costs=[1e-3 / (i + 1)] if ok else None,
                                                  error=None if ok else {"kind": "build", "message": "no"}))

            class R:
                warm_start = {}
            return R()

    monkeypatch.setattr(T, "Tuner", FakeTuner)
    pts, curves, _ = T.run_tvmfuse(Task(), target, [2, 4], str(tmp_path), 0, [])
    assert pts[2]["config"] is None and "none of the first 2 trials succeeded" in pts[2]["error"]
    assert pts[2]["error_kinds"] == {"build": 2}
    assert pts[4]["config"] == {"a": 3} and pts[4]["errors"] == 2
    assert curves["from_default"][:2] == [None, None]


# ---- the warm-start study reuses the main study's tvmfuse run of the same seed as its run without records ----

def _study_cell(budgets, trials=None, piece=None):
    trials = trials or max(budgets)
    cell = {"budgets": {b: {"tvmfuse": {"config": {"tile": b}, "tuner_cost": 1e-3 / b, "wall_s": float(b),
                                        "errors": 0, "error_kinds": {}, "trials_run": b, "median_s": 2e-3,
                                        "check": "ok vs ONNX reference"}} for b in budgets},
            "tvmfuse_curves": {"trial_costs": [1e-3] * trials, "from_default": [1e-3] * trials},
            "default": {"median_s": 2e-3}}
    if piece is not None:
        cell["piece"] = piece
        for c in cell["budgets"].values():
            c["piece"] = piece
    return cell


def test_study_tvmfuse_run_gives_run_tvmfuse_points_or_says_why_not():
    pts, curves, note = T.study_tvmfuse_run(_study_cell([4, 8]), [4, 8], "this run")
    assert pts == {b: {"config": {"tile": b}, "tuner_cost": 1e-3 / b, "wall_s": float(b), "errors": 0,
                       "error_kinds": {}, "trials_run": b} for b in (4, 8)}     # the picks, not their timings
    assert curves["trial_costs"] == [1e-3] * 8 and note.startswith("reused")
    for cell, budgets, why in ((None, [4, 8], "no study run"),
                               ({"error": "died", "budgets": {}}, [4, 8], "is an error"),
                               (_study_cell([4, 16]), [4, 8], "ran 16 trials, not 8"),
                               (_study_cell([8]), [4, 8], "has no budget 4")):
        assert T.study_tvmfuse_run(cell, budgets, "f.json")[0] is None
        assert why in T.study_tvmfuse_run(cell, budgets, "f.json")[2]
    mixed = _study_cell([4, 8], piece=2)                    # budget 4 merged from another piece than the curves
    mixed["budgets"][4]["piece"] = 0
    assert "of piece 0, the curves of piece 2" in T.study_tvmfuse_run(mixed, [4, 8], "f.json")[2]
    assert T.study_tvmfuse_run(_study_cell([4, 8], piece=2), [4, 8], "f.json")[2].endswith("f.json (piece 2)")


def test_transfer_study_tunes_no_run_without_records_when_given_one(monkeypatch):
    """transfer_study with the study's run: only the sources and the warm run are tuned; the reused picks are
    still built and timed beside the warm run's, and the cell says where its run without records came from."""
    import types

    tuned = []

    class Task:
        workload_key, default_config = "wk", {"tile": 0}

    def fake_run_tvmfuse(task, target, budgets, work, seed, inputs, transfer_logs=(), tag="tvmfuse",
                         transfer_seeds=2):
        tuned.append(tag)
        pts = {b: {"config": {"tile": 100 + b}, "tuner_cost": 1e-4} for b in budgets}
        return pts, {"from_default": [1e-4] * max(budgets), "trial_costs": [1e-4] * max(budgets)}, f"{tag}.jsonl"

    class FakeMeasurer:
        def __init__(self, *a, **k):
            pass

        def close(self):
            pass

    timed = []

    def fake_time_finals(measurer, task, libs, *a):
        timed.append(sorted(libs))
        return {tag: {"median_s": 1e-3, "check": "ok vs ONNX reference"} for tag in libs}

    monkeypatch.setattr(T, "main_task", lambda name, shape, target: (Task(), None))
    monkeypatch.setattr(T, "_feeds", lambda model: {})
    monkeypatch.setattr(T, "kernel_inputs_from_samples", lambda model, target, feeds, tasks: {"wk": []})
    monkeypatch.setattr(T, "onnx_reference_args", lambda task, inputs, model, feeds: [])
    monkeypatch.setattr(T, "run_tvmfuse", fake_run_tvmfuse)
    monkeypatch.setattr(T, "Measurer", FakeMeasurer)
    monkeypatch.setattr(T, "build_final", lambda measurer, mod, work, tag: tag)
    monkeypatch.setattr(T, "_scheduled", lambda task, config: config)
    monkeypatch.setattr(T, "_default_func", lambda task: task.default_config)
    monkeypatch.setattr(T, "C", types.SimpleNamespace(IRModule=dict))
    monkeypatch.setattr(T, "time_finals", fake_time_finals)
    args = types.SimpleNamespace(transfer_source_trials=4, transfer_seeds=2, repeat=1, rounds=1)
    sources = [{"m": 1}, {"m": 2}]

    reused = T.study_tvmfuse_run(_study_cell([4, 8]), [4, 8], "this run")
    out = T.transfer_study("mm", {"m": 8}, sources, args, None, [4, 8], [0], cold_runs={0: reused})
    assert tuned == ["source0", "source1", "warm"]
    assert timed == [["default", "with_records4", "with_records8", "without_records4", "without_records8"]]
    cell = out["seeds"][0]
    assert cell["without_records_run"] == "reused: the study's tvmfuse run of this seed in this run"
    assert cell["budgets"][8]["without_records"]["config"] == {"tile": 8}          # the study's pick, timed here
    assert cell["budgets"][8]["without_records"]["median_s"] == 1e-3

    tuned.clear()
    out = T.transfer_study("mm", {"m": 8}, sources, args, None, [4, 8], [0])
    assert tuned == ["source0", "source1", "cold", "warm"]
    assert out["seeds"][0]["without_records_run"] == "tuned in this piece"


def test_main_hands_the_transfer_study_this_runs_or_the_files_study_run(tmp_path, monkeypatch):
    got = []

    def fake_study(name, shape, args, target, budgets, seeds):
        (seed,) = seeds
        return {"kernel": "k", "shape": shape, "seeds": {seed: _study_cell(budgets)}}

    def fake_transfer(name, shape, sources, args, target, budgets, seeds, cold_runs=None):
        (seed,) = seeds
        got.append(None if cold_runs is None else cold_runs[seed][2])
        curve = {"trial_costs": [1.0] * max(budgets), "from_default": [1.0] * max(budgets)}
        cell = {"without_records": curve, "with_records": curve,
                "budgets": {}, "budgets_run": budgets}
        return {"shape": shape, "sources": sources, "source_trials": 8, "transfer_seeds": 2, "seeds": {seed: cell}}

    monkeypatch.setattr(T, "study", fake_study)
    monkeypatch.setattr(T, "transfer_study", fake_transfer)
    out = str(tmp_path / "study.json")
    base = ["--quick", "--skip-ms", "--workloads", "matmul_bias_gelu", "--budgets", "4", "8", "--merge-into", out]
    assert T.main(base + ["--seeds", "0", "--transfer"]) == 0
    assert got == ["reused: the study's tvmfuse run of this seed in this run"]
    assert T.main(base + ["--seeds", "0", "--transfer", "--transfer-only", "--redo"]) == 0
    assert got[1] == f"reused: the study's tvmfuse run of this seed in {out} (piece 0)"
    assert T.main(base + ["--seeds", "0", "--transfer", "--transfer-only", "--redo", "--no-reuse-study-run"]) == 0
    assert got[2] is None
    assert T.main(base + ["--seeds", "1", "--transfer", "--transfer-only"]) == 0       # seed 1 never studied
    assert got[3] is None


def test_matmul_seeds_one_at_a_time_merge_into_the_committed_znver5_study(tmp_path, monkeypatch, capsys):
    """The coordinator's plan for Tables 4-5's missing matmul seeds: one seed per command, each merged into
    (a copy of) the committed bench_tuner_study_znver5.json.  The file's target is used as the host's (tuning
    stubbed out), so this runs on any host: each seed lands beside seed 0 without touching the pieces already
    there, a rerun of a merged seed is skipped, and asking for all three seeds then tunes nothing."""
    import shutil

    committed = os.path.join(_ROOT, "benchmarks", "bench_tuner_study_znver5.json")
    out = str(tmp_path / "study.json")
    shutil.copy(committed, out)
    before = json.load(open(committed))
    assert sorted(before["workloads"]["matmul_bias_gelu"]["seeds"]) == ["0"]     # what is missing today

    class FileTarget:                                    # str() of the host target = the study file's target
        def __str__(self):
            return before["target"]

    monkeypatch.setattr(T.tvmfuse, "host_target", FileTarget)
    calls = []

    def fake_study(name, shape, args, target, budgets, seeds):
        (seed,) = seeds
        calls.append((name, seed, tuple(budgets), args.merge_into))
        assert str(target) == before["target"] and shape == {"m": 512, "k": 768, "n": 3072}
        return {"kernel": "k", "shape": shape, "seeds": {seed: _study_cell(budgets)}}

    monkeypatch.setattr(T, "study", fake_study)
    cmd = ["--workloads", "matmul_bias_gelu", "--budgets", "16", "32", "64", "--merge-into", out]
    assert T.main(cmd + ["--seeds", "1"]) == 0
    assert T.main(cmd + ["--seeds", "1"]) == 0                                     # merged: skipped
    assert "matmul_bias_gelu seed 1: already in" in capsys.readouterr().out
    assert T.main(cmd + ["--seeds", "2"]) == 0
    assert T.main(cmd + ["--seeds", "0", "1", "2"]) == 0                           # all there: nothing tuned
    assert calls == [("matmul_bias_gelu", 1, (16, 32, 64), out), ("matmul_bias_gelu", 2, (16, 32, 64), out)]
    after = json.load(open(out))
    assert after["pieces"][:len(before["pieces"])] == before["pieces"]
    assert [(p["seeds"], p["part"]) for p in after["pieces"][len(before["pieces"]):]] == [([1], "study"),
                                                                                          ([2], "study")]
    mm = after["workloads"]["matmul_bias_gelu"]["seeds"]
    assert sorted(mm) == ["0", "1", "2"] and mm["0"] == before["workloads"]["matmul_bias_gelu"]["seeds"]["0"]
    n = len(before["pieces"])
    assert [mm[s]["piece"] for s in ("1", "2")] == [n, n + 1]
    assert all(c["piece"] == mm[s]["piece"] for s in ("1", "2") for c in mm[s]["budgets"].values())
    assert sorted(mm["1"]["budgets"]) == ["16", "32", "64"]
    assert after["workloads"]["conv_bn_relu_residual"] == before["workloads"]["conv_bn_relu_residual"]
    assert after["transfer"] == before["transfer"]
    assert {k: after[k] for k in T.SAME_KEYS} == {k: before[k] for k in T.SAME_KEYS}
