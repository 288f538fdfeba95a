"""The cost model ranks better than chance on a recorded set; the quality metrics; shipped records apply."""
import json
import os

import numpy as np
import pytest

import tvmfuse
from tvmfuse import models as M
from tvmfuse.tune import log as L
from tvmfuse.tune.cost_model import CostModel, Sample, held_out_quality, ranking_quality

DATA = os.path.join(os.path.dirname(__file__), "data", "costmodel_set.json")


def load_set(path=DATA) -> list[Sample]:
    with open(path) as f:
        d = json.load(f)
    out = []
    for s in d["samples"]:
        prog = np.zeros(d["program_len"])
        for i, v in d["constants"].items():
            prog[int(i)] = v
        prog[d["varying"]] = s["program"]
        out.append(Sample(s["group"], prog, s["config"], s["cost"]))
    return out


def test_quality_metrics_on_known_rankings():
    costs = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 1.0, 3.0]
    groups = ["a"] * 6 + ["b"] * 2
    perfect = ranking_quality([-c for c in costs], costs, groups)
    assert perfect.top1 == 1.0 and perfect.top5 == 1.0 and perfect.pairwise_accuracy == 1.0
    worst = ranking_quality(costs, costs, groups)
    assert worst.pairwise_accuracy == 0.0
    assert worst.per_workload["a"]["top1"] == pytest.approx(1 / 6)      # picked the 6x slower one
    assert worst.per_workload["a"]["top5"] == pytest.approx(1 / 2)      # best of its top 5 is 2x slower
    assert worst.workloads == 2 and worst.samples == 8


def test_model_ranks_recorded_measurements_better_than_chance():
    samples = load_set()
    assert len({s.group for s in samples}) >= 3 and len(samples) >= 60
    qs = [held_out_quality(samples, 0.6, seed=seed) for seed in (0, 1, 2)]
    acc = float(np.mean([q.pairwise_accuracy for q in qs]))
    top1 = float(np.mean([q.top1 for q in qs]))
    # chance: random scores on the same measurements (expected pairwise accuracy 0.5)
    rng = np.random.default_rng(0)
    chance = float(np.mean([ranking_quality(rng.standard_normal(len(samples)), [s.cost for s in samples],
                                            [s.group for s in samples]).pairwise_accuracy for _ in range(20)]))
    print(f"held-out pairwise accuracy {acc:.3f} (random {chance:.3f}), top-1 {top1:.3f}, "
          f"top-5 {np.mean([q.top5 for q in qs]):.3f}")
    # recorded set (tests/data/costmodel_set.json, measured on a loaded 2-core host): 0.63 vs 0.50
    assert acc > chance + 0.08, (acc, chance)
    assert top1 > 0.5


def test_model_trains_only_on_pairs():
    m = CostModel()
    assert not m.fit([Sample("a", np.zeros(4), {"x": 1}, 1.0)])
    with pytest.raises(RuntimeError, match="not trained"):
        m.predict([np.zeros(4)], [{"x": 1}])


def test_shipped_records_apply_without_a_log(host):
    shipped = L.shipped_logs()
    assert shipped, "tuning_logs/ has the shipped records"
    mine = [p for p in shipped if L.load(p, host).measures]
    if not mine:
        pytest.skip(f"no shipped records for this host's target ({L.load(shipped[0], all_targets=True).measures[0]['target_key']} shipped)")
    best = L.best_configs(None, host)
    assert best and all(v["source"].startswith("shipped:") for v in best.values())
    cm = tvmfuse.compile(M.transformer_block())
    tuned = [s for s in cm.report.schedules if s["source"] == "tuned"]
    assert tuned, cm.report.schedules
    assert all(s["knobs"] == next(v["config"] for v in best.values() if v["template"] == s["template"]
                                  and v["config"] == s["knobs"]) for s in tuned)
    # and the model still computes the right numbers with the tuned schedules
    feeds = M.random_feeds(M.transformer_block())
    ref = M.reference_outputs(M.transformer_block(), feeds)
    out = cm.run(feeds)
    for k, v in ref.items():
        np.testing.assert_allclose(out[k], v, rtol=1e-4, atol=1e-4)
