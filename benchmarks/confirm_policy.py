"""How the tuner's end-of-job confirm chose, replayed against the study's final timing.

The tuner study (``bench_tuner.py``) records, for every seed and budget, what the confirm rounds re-timed
(the search's best configurations and the default, ``confirm_rounds`` interleaved rounds, one median each)
and which one they kept; the final timing then times that choice beside the default in 7 interleaved
rounds, checked against the ONNX reference.  This script asks, from those records alone (no timing is
run), how often the kept choice was slower than the default in the final timing and what a stricter rule
would have kept:

- ``least-median``: the tuner's rule of the twentieth to twenty-seventh sessions: least median of the rounds.
- ``every-round``: the tuner's rule since the twenty-eighth (``search.choose_confirmed``, called here): a
  configuration replaces the default only when it is faster than the default in every confirm round
  (rounds are interleaved, so a round compares both under the same load).
- ``beyond-spread``: only when its median is under the default's by more than the default's own spread
  over the rounds (max - min).

For each rule: what it keeps at every seed x budget, that choice's final ratio (kept / default, the final
timing's medians; "not timed" where a rule keeps a candidate the study did not time), and how many of its
picks the final timing's own rounds resolve (slower, or faster, than the default in at least 6 of the 7
paired rounds).

    python benchmarks/confirm_policy.py benchmarks/bench_tuner_study_znver3.json [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from tvmfuse.tune.search import choose_confirmed


def _median(xs):
    return statistics.median(xs)


def least_median(cands, default):
    """The rule of the twentieth to twenty-seventh sessions: least median, the default on a tie."""
    return min(cands, key=lambda c: (_median(c["costs"]), c is not default))


def every_round(cands, default):
    """The tuner's own rule (``search.choose_confirmed``): the default unless a candidate is faster in
    every round; of several, the least median."""
    chosen = choose_confirmed(cands, default["config"])
    return default if chosen == default["config"] else next(c for c in cands if c["config"] == chosen)


def beyond_spread(cands, default):
    """The default unless a candidate's median is under the default's by more than the default's own
    spread over the rounds (max - min); of several, the least median."""
    gap = max(default["costs"]) - min(default["costs"])
    beats = [c for c in cands if c is not default and _median(default["costs"]) - _median(c["costs"]) > gap]
    return min(beats, key=lambda c: _median(c["costs"])) if beats else default


RULES = {"least-median": least_median, "every-round": every_round, "beyond-spread": beyond_spread}
RESOLVED_WINS = 6          # of the final timing's 7 paired rounds: "resolved" slower / faster


def _final(cell, conf, config):
    """The final timing's rounds of ``config`` in this budget's cell: the search's pick or the confirm's
    choice (the only configurations besides the default that the study times); None when neither."""
    for timed in (cell["tvmfuse"], conf):
        if timed.get("config") == config and "rounds_s" in timed:
            return timed["rounds_s"]
    return None


def cases(study: dict) -> list[dict]:
    """One row per workload x seed x budget whose confirm re-timed configurations against the default:
    what each rule keeps, and that choice's final ratio against the default (None: not timed)."""
    rows = []
    for wl, w in study["workloads"].items():
        for seed, sd in w["seeds"].items():
            fin_d = sd["default"]["rounds_s"]
            for budget, cell in sd["budgets"].items():
                conf = cell.get("tvmfuse_confirmed") or {}
                if "candidates" not in conf:
                    continue          # the default led the search: nothing was re-timed
                default = conf["candidates"][-1]          # search.confirm_candidates puts the default last
                cands = [c for c in conf["candidates"] if c.get("costs")]
                if not default.get("costs") or len(cands) < 2:
                    continue
                row = {"workload": wl, "seed": int(seed), "budget": int(budget),
                       "rounds": len(default["costs"]), "final_rounds": len(fin_d)}
                for rule, f in RULES.items():
                    ch = f(cands, default)
                    if ch is default:
                        row[rule] = {"kept": "default", "final_ratio": 1.0, "confirm_ratio": 1.0}
                        continue
                    fin = _final(cell, conf, ch["config"])
                    row[rule] = {"kept": "pick", "confirm_ratio": _median(ch["costs"]) / _median(default["costs"]),
                                 "confirm_wins": sum(x < d for x, d in zip(ch["costs"], default["costs"])),
                                 "final_ratio": None if fin is None else _median(fin) / _median(fin_d),
                                 "final_wins": None if fin is None else sum(x < d for x, d in zip(fin, fin_d))}
                rows.append(row)
    return rows


def summary(rows: list[dict]) -> dict:
    out = {}
    for rule in RULES:
        picks = [(r[rule], r["final_rounds"]) for r in rows if r[rule]["kept"] == "pick"]
        timed = [r[rule]["final_ratio"] for r in rows if r[rule]["final_ratio"] is not None]
        out[rule] = {"cases": len(rows), "picks": len(picks),
                     "picks_not_timed": sum(p["final_ratio"] is None for p, _ in picks),
                     "mean_final_ratio": statistics.fmean(timed) if timed else None,
                     "worst_final_ratio": max(timed, default=None), "best_final_ratio": min(timed, default=None),
                     "picks_resolved_slower": sum(p["final_wins"] is not None and n - p["final_wins"] >= RESOLVED_WINS
                                                  for p, n in picks),
                     "picks_resolved_faster": sum(p["final_wins"] is not None and p["final_wins"] >= RESOLVED_WINS
                                                  for p, _ in picks)}
    return out


def _cell(c: dict) -> str:
    if c["kept"] == "default":
        return "default"
    fin = "not timed" if c["final_ratio"] is None else f"{c['final_ratio']:.3f} ({c['final_wins']})"
    return f"{c['confirm_ratio']:.3f} ({c['confirm_wins']}) -> {fin}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("study", help="a bench_tuner.py study JSON")
    p.add_argument("--json", help="write the rows and the summary here")
    a = p.parse_args(argv)
    with open(a.study) as f:
        study = json.load(f)
    rows = cases(study)
    if not rows:
        print(f"{a.study}: no confirm re-timed a configuration against the default", file=sys.stderr)
        return 1
    print("per rule: the kept pick's confirm ratio to the default (rounds faster) -> its final ratio "
          "(final rounds faster), or 'default'")
    print(f"{'workload':22s} seed budget  " + "".join(f"{k:32s}" for k in RULES))
    for r in rows:
        print(f"{r['workload']:22s} {r['seed']:4d} {r['budget']:6d}  " + "".join(f"{_cell(r[k]):32s}" for k in RULES))
    s = summary(rows)
    print()
    for rule, v in s.items():
        r3 = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        print(f"{rule:14s} picks {v['picks']:2d} of {v['cases']} ({v['picks_not_timed']} not timed); final ratio "
              f"kept/default: mean {r3(v['mean_final_ratio'])}, worst {r3(v['worst_final_ratio'])}, best "
              f"{r3(v['best_final_ratio'])}; picks slower than the default in >= {RESOLVED_WINS} of the final "
              f"rounds {v['picks_resolved_slower']}, faster {v['picks_resolved_faster']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"study": a.study, "rules": list(RULES), "resolved_wins": RESOLVED_WINS,
                       "rows": rows, "summary": s}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
