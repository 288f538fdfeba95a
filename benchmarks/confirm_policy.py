"""How the tuner's end-of-job confirm chose, replayed against the study's final timing.

The tuner study (``bench_tuner.py``) records, for every seed and budget, what the confirm rounds re-timed
(the search's best configurations and the default, ``confirm_rounds`` interleaved rounds, one median each)
and which one they kept; the final timing then times that choice beside the default in 7 interleaved
rounds, checked against the ONNX reference.  This script asks, from those records alone (no timing is
run), how often the kept choice was slower than the default in the final timing and what a stricter rule
would have kept:

- ``least-median``: the rule the tuner uses (``search.choose_confirmed``): least median of the rounds.
- ``every-round``: a configuration replaces the default only when it is faster than the default in
  every confirm round (rounds are interleaved, so a round compares both under the same load).
- ``beyond-spread``: only when its median is under the default's by more than the default's own spread
  over the rounds (max - min).

For each rule: the final ratio (applied / default, final timing's medians) of every seed x budget, and
how many of those the final timing's own rounds resolve (the applied choice slower, or faster, than the
default in at least 6 of the 7 paired rounds).

    python benchmarks/confirm_policy.py benchmarks/bench_tuner_study_znver3.json [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys


def _median(xs):
    return statistics.median(xs)


def least_median(pick, default) -> bool:
    return _median(pick) < _median(default)


def every_round(pick, default) -> bool:
    return all(p < d for p, d in zip(pick, default))


def beyond_spread(pick, default) -> bool:
    return _median(default) - _median(pick) > max(default) - min(default)


RULES = {"least-median": least_median, "every-round": every_round, "beyond-spread": beyond_spread}
RESOLVED_WINS = 6          # of the final timing's 7 paired rounds: "resolved" slower / faster


def cases(study: dict) -> list[dict]:
    """One row per workload x seed x budget whose confirm re-timed a configuration against the default."""
    rows = []
    for wl, w in study["workloads"].items():
        for seed, sd in w["seeds"].items():
            default_final = sd["default"]
            for budget, cell in sd["budgets"].items():
                conf = cell.get("tvmfuse_confirmed") or {}
                if "candidates" not in conf:
                    continue          # the default led the search: nothing was re-timed
                cands = [c for c in conf["candidates"] if c.get("costs")]
                default = conf["candidates"][-1]          # search.confirm_candidates puts the default last
                if not default.get("costs") or len(cands) < 2:
                    continue
                best = min((c for c in cands if c is not default), key=lambda c: _median(c["costs"]))
                timed = (cell["tvmfuse"] if best["config"] == cell["tvmfuse"].get("config") else
                         conf if best["config"] == conf.get("config") else None)
                if timed is None or "rounds_s" not in timed:
                    continue          # the confirm's best candidate was not timed in the final rounds
                fin_p, fin_d = timed["rounds_s"], default_final["rounds_s"]
                rows.append({"workload": wl, "seed": int(seed), "budget": int(budget),
                             "confirm_ratio": _median(best["costs"]) / _median(default["costs"]),
                             "confirm_wins": sum(p < d for p, d in zip(best["costs"], default["costs"])),
                             "confirm_rounds": len(default["costs"]),
                             "final_ratio": _median(fin_p) / _median(fin_d),
                             "final_wins": sum(p < d for p, d in zip(fin_p, fin_d)),
                             "final_rounds": min(len(fin_p), len(fin_d)),
                             **{rule: f(best["costs"], default["costs"]) for rule, f in RULES.items()}})
    return rows


def summary(rows: list[dict]) -> dict:
    out = {}
    for rule in RULES:
        applied = [r["final_ratio"] if r[rule] else 1.0 for r in rows]
        slower = [r for r in rows if r[rule] and r["final_rounds"] - r["final_wins"] >= RESOLVED_WINS]
        faster = [r for r in rows if r[rule] and r["final_wins"] >= RESOLVED_WINS]
        out[rule] = {"picks": sum(r[rule] for r in rows), "cases": len(rows),
                     "mean_final_ratio": statistics.fmean(applied), "worst_final_ratio": max(applied),
                     "best_final_ratio": min(applied),
                     "picks_resolved_slower": len(slower), "picks_resolved_faster": len(faster)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("study", help="a bench_tuner.py study JSON")
    p.add_argument("--json", help="write the rows and the summary here")
    a = p.parse_args(argv)
    with open(a.study) as f:
        study = json.load(f)
    rows = cases(study)
    if not rows:
        print(f"{a.study}: no confirm re-timed a configuration that the final timing timed", file=sys.stderr)
        return 1
    print(f"{'workload':24s} seed budget  confirm (wins)   final (wins)  " + "  ".join(RULES))
    for r in rows:
        print(f"{r['workload']:24s} {r['seed']:4d} {r['budget']:6d}  {r['confirm_ratio']:.3f} "
              f"({r['confirm_wins']}/{r['confirm_rounds']})   {r['final_ratio']:.3f} "
              f"({r['final_wins']}/{r['final_rounds']})  "
              + "  ".join(f"{'pick' if r[k] else 'default':>{len(k)}s}" for k in RULES))
    s = summary(rows)
    print()
    for rule, v in s.items():
        print(f"{rule:14s} picks {v['picks']:2d}/{v['cases']}  final ratio applied/default: mean "
              f"{v['mean_final_ratio']:.3f}, worst {v['worst_final_ratio']:.3f}, best {v['best_final_ratio']:.3f}; "
              f"picks slower in >= {RESOLVED_WINS} of the final rounds {v['picks_resolved_slower']}, "
              f"faster {v['picks_resolved_faster']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"study": a.study, "rules": list(RULES), "resolved_wins": RESOLVED_WINS,
                       "rows": rows, "summary": s}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
