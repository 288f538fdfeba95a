"""Is a 5% gap between run() and the VM call measurable at all on a workload? (issue 11, io11)

    python benchmarks/io_control.py                                  # benchmarks/bench_cpu_io.json
    python benchmarks/io_control.py A.json B.json --json out.json    # several runs of bench_cpu.py --io

Reads the per-round block times that ``bench_cpu.py --io`` stores (``engines[*].ms.by_round``) and, per
workload, sets the issue's pairs beside **control pairs**: two engines that do the same work, whose ratio
would be 1.000 if the method resolved a few percent.

- ``artifact_vm/vm``: the VM call of the exported artifact against the compiled model's VM call: the same
  kernels (compiled once, written to a library and loaded again), each on its own TVM copies of the inputs,
  its own output pool.  Nothing of run() in either; what this ratio reads is what two identical calls on
  different buffers (and a different copy of the code) differ by.
- ``vm_views/vm``: the VM call on views of the numpy inputs against the one on TVM's copies: the same VM,
  other input memory.
- ``artifact_run/run``: ``Runner.run`` of the artifact against ``CompiledModel.run``, both on the same numpy
  arrays: the same Python function (``_static_run``) over the two VMs; what is left is the libraries'
  kernels and output pools (issue 11's second half: why the artifact's ratios differ from run()'s).

For every pair: the median of the per-round ratios with a 90% bootstrap interval (``paired_ratio``, as the
table), and its **split-half repeatability**: the same median over the first and over the second half of
the rounds, and their difference (a pair that moves by as much between two halves of one run as the gap
it is meant to show does not resolve that gap).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_cpu import IO_PAIRS, paired_ratio  # noqa: E402

CONTROL_PAIRS = {"artifact_vm/vm": ("io_artifact_vm", "io_vm"), "vm_views/vm": ("io_vm_views", "io_vm"),
                 "artifact_run/run": ("io_artifact_run_numpy", "io_run_numpy")}
ISSUE_PAIRS = ("run/vm", "artifact_run/vm", "run_same/vm", "artifact_run_same/vm")


def pair_stats(num: list, den: list) -> dict | None:
    """paired_ratio over all rounds and over each half of them."""
    whole = paired_ratio(num, den)
    if whole is None:
        return None
    h = len(num) // 2
    first, second = paired_ratio(num[:h], den[:h]), paired_ratio(num[h:], den[h:])
    return {"median": whole["median"], "ci": whole["ci"], "rounds": whole["rounds"],
            "first_half": first["median"], "second_half": second["median"],
            "halves_differ_by": abs(first["median"] - second["median"])}


def analyse(data: dict) -> dict:
    pairs = {**CONTROL_PAIRS, **{k: IO_PAIRS[k] for k in ISSUE_PAIRS}}
    out = {}
    for row in data["rows"]:
        rounds = {e: d["ms"].get("by_round") for e, d in row["engines"].items() if "ms" in d}
        per = {}
        for label, (a, b) in pairs.items():
            if rounds.get(a) and rounds.get(b):
                per[label] = pair_stats(rounds[a], rounds[b])
        per["vm_ms"] = sorted(rounds["io_vm"])[len(rounds["io_vm"]) // 2] if rounds.get("io_vm") else None
        out[row["workload"]] = per
    return out


def _cell(s: dict | None) -> str:
    if s is None:
        return "-"
    return (f"{s['median']:.3f} [{s['ci'][0]:.3f}-{s['ci'][1]:.3f}] "
            f"(halves {s['first_half']:.3f} / {s['second_half']:.3f})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", default=[os.path.join(HERE, "bench_cpu_io.json")],
                    help="JSON of bench_cpu.py --io runs (default: Table 3's)")
    ap.add_argument("--workloads", nargs="*", help="only these workloads")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    report = {}
    for path in args.files:
        with open(path) as f:
            data = json.load(f)
        res = analyse(data)
        report[path] = {"date": data.get("date"), "command": data.get("command"), "load_avg_start":
                        data.get("load_avg_start"), "workloads": res}
        print(f"\n{path} ({data.get('date')}, {data.get('cpu')}, {data.get('repeat')} rounds, "
              f"load {data.get('load_avg_start', ['?'])[0]})")
        labels = list(CONTROL_PAIRS) + list(ISSUE_PAIRS)
        print("| workload | " + " | ".join(labels) + " |")
        print("|---|" + "---:|" * len(labels))
        for w, per in res.items():
            if args.workloads and w not in args.workloads:
                continue
            print(f"| {w} | " + " | ".join(_cell(per.get(k)) for k in labels) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
