"""benchmarks/bench_tuner.py's study in pieces: runs merged into one JSON (no tuning here)."""
import importlib.util
import json
import os

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
