"""The XGBoost cost model: ranks candidate configurations of a workload by predicted speed.

Objective ``rank:pairwise``: only the order of configurations *within* a workload matters (one query group
per workload), so measurements of workloads of very different sizes train one model together, and records
of other shapes of the same template family warm-start it (transfer).  The label of a measurement is its
throughput relative to the best of its workload (``best / cost``, in (0, 1]); failed measurements are not
training rows (an error is not a cost).

Quality on held-out measurements (``ranking_quality``): top-k score as TenSet reports it (per workload,
the true best latency over the best latency among the model's top-k picks, 1.0 = the model's first k
picks contain the best; averaged over workloads), and pairwise ranking accuracy (the fraction of pairs
of configurations of one workload, with different latencies, that the model orders correctly; chance
is 0.5).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .features import KnobVocabulary

XGB_PARAMS = {
    "objective": "rank:pairwise",
    "eta": 0.2,
    "max_depth": 4,
    "min_child_weight": 1,
    "subsample": 1.0,          # row/column subsampling made fits 15x slower here and ranked no better
    "colsample_bytree": 1.0,
    "tree_method": "hist",
    "max_bin": 64,             # few hundred rows: coarse bins train 5x faster than exact, rank the same
    "nthread": 2,
}
BOOST_ROUNDS = 60


@dataclass
class Sample:
    """One measured configuration: its workload (query group), program features, knobs, cost."""

    group: str
    program: np.ndarray
    config: dict
    cost: float


class CostModel:
    def __init__(self, seed: int = 0, rounds: int = BOOST_ROUNDS, params: dict | None = None):
        self.seed, self.rounds = seed, rounds
        self.params = {**XGB_PARAMS, **(params or {}), "seed": seed}
        self.vocab = KnobVocabulary()
        self.booster = None
        self.n_train = 0

    @property
    def trained(self) -> bool:
        return self.booster is not None

    def _matrix(self, programs, configs) -> np.ndarray:
        return np.stack([np.concatenate([np.asarray(p, dtype=np.float64), self.vocab.vector(c)])
                         for p, c in zip(programs, configs)])

    def fit(self, samples: list[Sample]) -> bool:
        """Train from scratch on ``samples``; False (and untrained) when no workload has two costs."""
        import xgboost as xgb

        by_group: dict[str, list[Sample]] = {}
        for s in samples:
            by_group.setdefault(s.group, []).append(s)
        rows = [s for g in sorted(by_group) if len(by_group[g]) >= 2 for s in by_group[g]]
        if not rows:
            self.booster = None
            return False
        self.vocab = KnobVocabulary()
        for s in rows:
            self.vocab.add(s.config)
        best = {g: min(s.cost for s in ss) for g, ss in by_group.items()}
        X = self._matrix([s.program for s in rows], [s.config for s in rows])
        y = np.array([best[s.group] / s.cost for s in rows])
        qid_of = {g: i for i, g in enumerate(sorted(by_group))}
        qid = np.array([qid_of[s.group] for s in rows])
        self.booster = xgb.train(self.params, xgb.DMatrix(X, label=y, qid=qid), self.rounds)
        self.n_train = len(rows)
        return True

    def predict(self, programs, configs) -> np.ndarray:
        """Scores (higher: predicted faster); comparable only within one workload."""
        import xgboost as xgb

        if self.booster is None:
            raise RuntimeError("the cost model is not trained")
        return self.booster.predict(xgb.DMatrix(self._matrix(programs, configs)))


@dataclass
class Quality:
    top1: float
    top5: float
    pairwise_accuracy: float
    workloads: int
    samples: int
    per_workload: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"top1": self.top1, "top5": self.top5, "pairwise_accuracy": self.pairwise_accuracy,
                "workloads": self.workloads, "samples": self.samples}


def ranking_quality(scores, costs, groups) -> Quality:
    """Top-1/top-5 score and pairwise accuracy of ``scores`` (higher = predicted faster) against measured
    ``costs`` (seconds), per workload ``groups``; see the module docstring."""
    scores, costs, groups = np.asarray(scores, float), np.asarray(costs, float), np.asarray(groups)
    top = {1: [], 5: []}
    agree = total = 0
    per = {}
    for g in sorted(set(groups.tolist())):
        m = groups == g
        s, c = scores[m], costs[m]
        order = np.argsort(-s, kind="stable")
        true_best = c.min()
        row = {}
        for k in top:
            v = float(true_best / c[order[:k]].min())
            top[k].append(v)
            row[f"top{k}"] = v
        i, j = np.triu_indices(len(c), k=1)
        differ = c[i] != c[j]
        ok = np.sign(s[i] - s[j]) == np.sign(c[j] - c[i])   # higher score <-> lower cost
        agree += int((ok & differ).sum())
        total += int(differ.sum())
        row["pairs"] = int(differ.sum())
        per[str(g)] = row
    return Quality(top1=float(np.mean(top[1])) if top[1] else float("nan"),
                   top5=float(np.mean(top[5])) if top[5] else float("nan"),
                   pairwise_accuracy=agree / total if total else float("nan"),
                   workloads=len(per), samples=int(len(costs)), per_workload=per)


def held_out_split(samples: list[Sample], train_fraction: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    """(train, test): ``train_fraction`` of each workload's measurements drawn at random, and the rest."""
    rng = np.random.default_rng(seed)
    by_group: dict[str, list[Sample]] = {}
    for s in samples:
        by_group.setdefault(s.group, []).append(s)
    train, test = [], []
    for g in sorted(by_group):
        ss = by_group[g]
        idx = rng.permutation(len(ss))
        cut = int(round(train_fraction * len(ss)))
        train += [ss[i] for i in idx[:cut]]
        test += [ss[i] for i in idx[cut:]]
    return train, test


def held_out_quality(samples: list[Sample], train_fraction: float = 0.6, seed: int = 0,
                     model: CostModel | None = None) -> Quality:
    """Fit on ``train_fraction`` of each workload's measurements (drawn at random), report the ranking
    quality on the rest."""
    train, test = held_out_split(samples, train_fraction, seed)
    model = model or CostModel(seed=seed)
    if not model.fit(train):
        raise ValueError("no workload has two training measurements")
    scores = model.predict([s.program for s in test], [s.config for s in test])
    return ranking_quality(scores, [s.cost for s in test], [s.group for s in test])
