"""Curves of the tuner study (``benchmarks/bench_tuner.py``'s JSON) as PNG, and the times to reach two marks.

Per workload, one PNG (``tuner_<workload>.png``) with two panels: the best kernel time so far against
trials and against wall-clock seconds, one line per tuner and seed (tvmfuse from its template default, as
it runs: its first trial is the default; MetaSchedule from cold, as it runs), and the untuned default (the
template default's time in tvmfuse's measurement) as a horizontal line.  Per workload with a warm-start
study, ``transfer_<workload>.png``: tvmfuse on the shape without and with the other shapes' records.

Printed per workload and seed (``--tolerance`` lets "reach" mean "within that fraction of"):

- time to reach the untuned default: the first trial whose best so far is at most the default's time,
  and the wall time to it, for each tuner (tvmfuse reaches it at its first trial by construction);
- time to reach MetaSchedule's best: the first trial at which each tuner's best so far is at most the best
  MetaSchedule found in its whole run.

The figures are the tuners' own measurements during tuning (tvmfuse's measurer, MetaSchedule's
LocalRunner: two harnesses on the same kernel and inputs), not the study's final timing of the picks
(that is the JSON's ``budgets`` cells).  Wall time starts when each tuner starts (tvmfuse: with its worker
processes' start-up; MetaSchedule: after its tensor-intrinsic import, ``ms_tensor_intrin_import_s``).

Needs only the standard library and matplotlib (not TVM), e.g. the corpus venv:

    /work/venv-corpus/bin/python benchmarks/plot_tuner.py benchmarks/bench_tuner_study.json --out benchmarks/plots
    python benchmarks/plot_tuner.py STUDY.json --no-png        # the times only (no matplotlib needed)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_STUDY = os.path.join(HERE, "bench_tuner_study.json")


def first_reach(curve: list, walls: list, mark: float | None, tolerance: float = 0.0):
    """(trial number from 1, wall seconds) of the first point of ``curve`` (best so far, None before the
    first success) at or under ``mark * (1 + tolerance)``; None when it never gets there (or no mark)."""
    if mark is None:
        return None
    limit = mark * (1.0 + tolerance)
    for i, c in enumerate(curve):
        if c is not None and c <= limit:
            return i + 1, (walls[i] if i < len(walls) else None)
    return None


def _best(curve: list):
    vals = [c for c in curve if c is not None]
    return min(vals) if vals else None


def _fmt_reach(r, curve) -> str:
    if r is None:
        return f"not reached in {len(curve)} trials"
    trial, wall = r
    return f"trial {trial}" + ("" if wall is None else f", {wall:.1f} s")


def tuner_curves(cell: dict) -> dict:
    """tuner name -> (best-so-far curve, wall seconds per trial) of one seed's cell, as each tuner runs."""
    out = {}
    tf = cell.get("tvmfuse_curves")
    if tf and tf.get("from_default"):
        out["tvmfuse"] = (tf["from_default"], tf.get("trial_wall_s", []))
    ms = cell.get("ms_curves")
    if ms and ms.get("cold"):
        out["MetaSchedule"] = (ms["cold"], ms.get("trial_wall_s", []))
    return out


def marks(study: dict, tolerance: float = 0.0) -> list[dict]:
    """Per workload and seed: the default's and MetaSchedule's best times, and when each tuner got there."""
    rows = []
    for name, row in study.get("workloads", {}).items():
        for seed, cell in row.get("seeds", {}).items():
            if "error" in cell:
                rows.append({"workload": name, "seed": seed, "error": cell["error"]})
                continue
            curves = tuner_curves(cell)
            default = (cell.get("tvmfuse_curves") or {}).get("default_cost")
            ms_best = _best(curves["MetaSchedule"][0]) if "MetaSchedule" in curves else None
            r = {"workload": name, "seed": seed, "default_s": default, "ms_best_s": ms_best, "tuners": {}}
            for tuner, (curve, walls) in curves.items():
                r["tuners"][tuner] = {
                    "trials": len(curve), "best_s": _best(curve),
                    "reach_default": first_reach(curve, walls, default, tolerance),
                    "reach_ms_best": first_reach(curve, walls, ms_best, tolerance)}
            rows.append(r)
    return rows


def print_marks(study: dict, tolerance: float = 0.0) -> None:
    tol = f" (within {tolerance:.0%})" if tolerance else ""
    print("times to reach the untuned default and MetaSchedule's best" + tol
          + " (the tuners' own measurements during tuning):")
    print("| workload | seed | tuner | trials | best ms | default ms | reach default | MetaSchedule best ms | "
          "reach MetaSchedule's best |")
    print("|---|---:|---|---:|---:|---:|---|---:|---|")
    ms = lambda x: "-" if x is None else f"{x * 1e3:.3f}"  # noqa: E731
    for r in marks(study, tolerance):
        if "error" in r:
            print(f"| {r['workload']} | {r['seed']} | error: {r['error'][:80]} | | | | | | |")
            continue
        for tuner, t in r["tuners"].items():
            curve = [None] * t["trials"]
            print(f"| {r['workload']} | {r['seed']} | {tuner} | {t['trials']} | {ms(t['best_s'])} | "
                  f"{ms(r['default_s'])} | {_fmt_reach(t['reach_default'], curve)} | {ms(r['ms_best_s'])} | "
                  f"{_fmt_reach(t['reach_ms_best'], curve) if r['ms_best_s'] is not None else '-'} |")
    for name, tr in study.get("transfer", {}).items():
        for seed, cell in tr.get("seeds", {}).items():
            if "error" in cell:
                print(f"transfer {name} seed {seed}: error: {cell['error'][:100]}")
                continue
            cold, warm = cell["without_records"], cell["with_records"]
            target = _best(cold["from_default"])
            reach = first_reach(warm["from_default"], warm.get("trial_wall_s", []), target, tolerance)
            print(f"transfer {name} seed {seed}: best {ms(target)} ms without the other shapes' records "
                  f"({len(cold['from_default'])} trials), {ms(_best(warm['from_default']))} ms with them; "
                  f"with them the no-records best is reached at {_fmt_reach(reach, warm['from_default'])}"
                  f"; warm start {warm.get('warm_start')}")


def _ms_list(curve):
    return [math.nan if c is None else c * 1e3 for c in curve]


def plot_study(study: dict, folder: str) -> list[str]:
    """Write the PNGs (module docstring) into ``folder``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    written = []
    styles = {"tvmfuse": "-", "MetaSchedule": "--"}
    for name, row in study.get("workloads", {}).items():
        seeds = {s: c for s, c in row.get("seeds", {}).items() if "error" not in c}
        if not seeds:
            continue
        fig, (ax_t, ax_w) = plt.subplots(1, 2, figsize=(11, 4.2))
        default = None
        for i, (seed, cell) in enumerate(sorted(seeds.items())):
            default = default or (cell.get("tvmfuse_curves") or {}).get("default_cost")
            for tuner, (curve, walls) in tuner_curves(cell).items():
                color = f"C{(0 if tuner == 'tvmfuse' else 1) * 3 + i % 3}"
                ys = _ms_list(curve)
                label = f"{tuner} seed {seed}"
                ax_t.plot(range(1, len(ys) + 1), ys, styles[tuner], color=color, label=label, drawstyle="steps-post")
                if len(walls) == len(ys):
                    ax_w.plot(walls, ys, styles[tuner], color=color, label=label, drawstyle="steps-post")
        for ax in (ax_t, ax_w):
            if default:
                ax.axhline(default * 1e3, color="grey", lw=0.8, ls=":", label="untuned default")
            ax.set_yscale("log")
            ax.set_ylabel("best kernel time so far (ms)")
            ax.grid(alpha=0.3, which="both")
        ax_t.set(xlabel="trials", xscale="log")
        ax_w.set(xlabel="wall time since the tuner started (s)", xscale="log")
        ax_t.legend(fontsize=7)
        shape = "x".join(str(v) for v in row.get("shape", {}).values())
        fig.suptitle(f"{name} {shape}: tvmfuse (from its default) vs MetaSchedule (cold), tuners' own measurements",
                     fontsize=9)
        fig.tight_layout()
        path = os.path.join(folder, f"tuner_{name}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    for name, tr in study.get("transfer", {}).items():
        seeds = {s: c for s, c in tr.get("seeds", {}).items() if "error" not in c}
        if not seeds:
            continue
        fig, (ax_t, ax_w) = plt.subplots(1, 2, figsize=(11, 4.2))
        for i, (seed, cell) in enumerate(sorted(seeds.items())):
            for form, style in (("without_records", "--"), ("with_records", "-")):
                cur = cell[form]
                ys = _ms_list(cur["from_default"])
                label = f"{form.replace('_', ' ')} seed {seed}"
                ax_t.plot(range(1, len(ys) + 1), ys, style, color=f"C{i}", label=label, drawstyle="steps-post")
                walls = cur.get("trial_wall_s", [])
                if len(walls) == len(ys):
                    ax_w.plot(walls, ys, style, color=f"C{i}", label=label, drawstyle="steps-post")
        for ax in (ax_t, ax_w):
            ax.set_ylabel("best kernel time so far (ms)")
            ax.grid(alpha=0.3, which="both")
        ax_t.set(xlabel="trials", xscale="log")
        ax_w.set(xlabel="wall time since the tuner started (s)", xscale="log")
        ax_t.legend(fontsize=7)
        fig.suptitle(f"tvmfuse warm start: {name} {tr.get('shape')} with records of {tr.get('sources')}", fontsize=9)
        fig.tight_layout()
        path = os.path.join(folder, f"transfer_{name}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    for p in written:
        print(f"wrote {p} ({os.path.getsize(p) / 1e3:.0f} kB)")
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("study", nargs="?", default=DEFAULT_STUDY, help="the study JSON (default: %(default)s)")
    ap.add_argument("--out", default=os.path.join(HERE, "plots"), help="folder of the PNGs (default: %(default)s)")
    ap.add_argument("--no-png", action="store_true", help="print the times only")
    ap.add_argument("--tolerance", type=float, default=0.0,
                    help="'reach' = at most mark x (1 + tolerance) (default 0: at most the mark)")
    args = ap.parse_args(argv)
    if not os.path.isfile(args.study):
        ap.error(f"{args.study}: no such study JSON (bench_tuner.py -o / --merge-into writes one)")
    if args.tolerance < 0:
        ap.error("--tolerance must be 0 or more")
    with open(args.study) as f:
        try:
            study = json.load(f)
        except json.JSONDecodeError as e:
            ap.error(f"{args.study} is not JSON: {e}")
    if "workloads" not in study:
        ap.error(f"{args.study} has no 'workloads': not a bench_tuner.py study")
    print_marks(study, args.tolerance)
    if not args.no_png:
        try:
            plot_study(study, args.out)
        except ImportError as e:
            print(f"no PNG: matplotlib does not import here ({e}); run with an interpreter that has it, e.g. "
                  "/work/venv-corpus/bin/python, or pass --no-png", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
