"""benchmarks/confirm_policy.py: the confirm rules replayed on a study's records (its every-round rule calls
the tuner's ``search.choose_confirmed``), and the committed Table 5d JSON is what the script computes from
the committed study."""
import importlib.util
import json
import os

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("confirm_policy", os.path.join(_ROOT, "benchmarks", "confirm_policy.py"))
P = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(P)

A, B, D = {"k": 1}, {"k": 2}, {"k": 0}


def _study(cands, chosen, pick, final):
    """One workload, one seed, one budget: the confirm's candidates (default last), the final timing's
    rounds of the default and of the configurations ``final`` names."""
    cell = {"tvmfuse": {"config": pick, "rounds_s": final.get(json.dumps(pick)), "median_s": 1.0},
            "tvmfuse_confirmed": {"chosen": chosen, "config": chosen, "candidates": cands,
                                  "rounds_s": final.get(json.dumps(chosen))}}
    for c in cell.values():
        if c["rounds_s"] is None:
            del c["rounds_s"]
    return {"workloads": {"w": {"seeds": {"0": {"default": {"rounds_s": final[json.dumps(D)]},
                                                 "budgets": {"16": cell}}}}}}


def test_rules_on_a_lucky_median():
    # A: lower median but slower than the default in round 1; B: faster in every round, larger median
    cands = [{"config": A, "costs": [3.0, 1.0, 1.0]}, {"config": B, "costs": [1.9, 1.9, 1.9]},
             {"config": D, "costs": [2.0, 2.0, 2.0]}]
    final = {json.dumps(D): [2.0] * 7, json.dumps(A): [2.2] * 6 + [1.0]}
    rows = P.cases(_study(cands, A, A, final))
    assert len(rows) == 1
    r = rows[0]
    assert r["least-median"]["kept"] == "pick" and r["least-median"]["final_ratio"] == pytest.approx(1.1)
    assert r["least-median"]["confirm_wins"] == 2 and r["least-median"]["final_wins"] == 1
    assert r["every-round"]["kept"] == "pick" and r["every-round"]["final_ratio"] is None, "B was not timed"
    assert r["beyond-spread"]["kept"] == "pick"        # A's median 1.0 is 1.0 under the default's, spread 0
    s = P.summary(rows)
    assert s["least-median"]["picks_resolved_slower"] == 1 and s["least-median"]["worst_final_ratio"] == pytest.approx(1.1)
    assert s["every-round"]["picks_not_timed"] == 1 and s["every-round"]["mean_final_ratio"] is None


def test_default_kept_when_nothing_beats_it_every_round():
    cands = [{"config": A, "costs": [2.1, 1.0, 1.0]}, {"config": D, "costs": [2.0, 2.0, 2.0]}]
    rows = P.cases(_study(cands, A, A, {json.dumps(D): [2.0] * 7, json.dumps(A): [1.5] * 7}))
    assert rows[0]["every-round"] == {"kept": "default", "final_ratio": 1.0, "confirm_ratio": 1.0}
    assert rows[0]["least-median"]["final_ratio"] == pytest.approx(0.75)


def test_committed_table_5d_is_the_replay_of_the_committed_study():
    with open(os.path.join(_ROOT, "benchmarks", "confirm_policy_znver3.json")) as f:
        committed = json.load(f)
    with open(os.path.join(_ROOT, committed["study"])) as f:
        study = json.load(f)
    rows = P.cases(study)
    assert P.summary(rows) == committed["summary"] and len(rows) == len(committed["rows"])
