"""Size and load time of exported artifacts (directory and .tar) of the demo models (Table 7).

Each artifact is loaded ``--loads`` times, each time in a fresh interpreter: ``import tvmfuse`` and
``tvmfuse.load(...)`` timed apart, then the first inference and the median of ``--runs`` further ones, on
the same inputs (an .npz written here; no pickle).  The first load's outputs are checked against the ONNX
reference (onnx.reference.ReferenceEvaluator; |out - ref| <= CHECK_ATOL + CHECK_RTOL |ref|): a row says
``pass`` or ``FAIL`` with the largest error.  Figures: the median over the loads [min-max].

    python benchmarks/export_bench.py [--quick] [--loads 5] [--target T] [--json benchmarks/export_bench.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import tvmfuse
from tvmfuse import models as M
from tvmfuse.export import artifact_size

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_readme import table_7_rows  # noqa: E402  (the rows as the README prints them: one copy)

SMALL = {"transformer_block": dict(seq=16, hidden=32, heads=2, ffn=64), "resnet_block": dict(channels=8, size=8)}
CHECK_RTOL, CHECK_ATOL = 1e-3, 1e-4      # as bench_cpu.py
TIMED = ("import_s", "load_s", "first_run_s", "run_s")

_TIMER = r"""
import json, sys, time
t0 = time.perf_counter()
import tvmfuse
t1 = time.perf_counter()
r = tvmfuse.load(sys.argv[1])
t2 = time.perf_counter()
import numpy as np
with np.load(sys.argv[2]) as z:
    feeds = {k: z[k] for k in z.files}
s = time.perf_counter()
out = r.run(feeds)
t3 = time.perf_counter()
runs = []
for _ in range(int(sys.argv[4])):
    s2 = time.perf_counter(); r.run(feeds); runs.append(time.perf_counter() - s2)
if sys.argv[3] != "-":
    np.savez(sys.argv[3], **{f"out{i}": np.asarray(v) for i, v in enumerate(out.values())})
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_run_s": t3 - s,
                  "run_s": sorted(runs)[len(runs) // 2]}))
"""


def check(ref: list, outs_path: str) -> dict:
    with np.load(outs_path) as z:
        outs = [z[f"out{i}"] for i in range(len(z.files))]
    if len(outs) != len(ref):
        return {"check": "FAIL", "why": f"{len(outs)} outputs, the reference has {len(ref)}"}
    worst, ok = 0.0, True
    for o, r in zip(outs, ref):
        if o.shape != r.shape:
            return {"check": "FAIL", "why": f"shape {o.shape} vs the reference's {r.shape}"}
        err = np.abs(o.astype(np.float64) - r)
        worst = max(worst, float(err.max()) if err.size else 0.0)
        ok &= bool(np.all(err <= CHECK_ATOL + CHECK_RTOL * np.abs(r))) and not np.isnan(o).any()
    return {"check": "pass" if ok else "FAIL", "max_abs_error": worst}


def time_artifact(path: str, feeds_path: str, outs_path: str, loads: int, runs: int) -> dict:
    per = []
    for i in range(loads):
        r = subprocess.run([sys.executable, "-c", _TIMER, path, feeds_path, outs_path if i == 0 else "-", str(runs)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"loading {path} in a fresh interpreter failed ({r.returncode}): {r.stderr[-2000:]}")
        per.append(json.loads(r.stdout.strip().splitlines()[-1]))
    out = {"loads": per}
    for k in TIMED:
        vals = [p[k] for p in per]
        out[k] = statistics.median(vals)
        out[k + "_range"] = [min(vals), max(vals)]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small models")
    p.add_argument("--target", default=None)
    p.add_argument("--loads", type=int, default=5, help="fresh interpreters per artifact (median reported)")
    p.add_argument("--runs", type=int, default=10, help="inferences after the first, per load (median)")
    p.add_argument("--json", default=None, help="also write the rows, date, machine and command here")
    args = p.parse_args(argv)
    if args.loads < 1 or args.runs < 1:
        p.error("--loads and --runs must be at least 1")
    rows = []
    load_start = os.getloadavg()
    print(f"{'model':18} {'form':5} {'size':>10} {'import':>9} {'load':>9} {'1st run':>9} {'run':>9}  check")
    with tempfile.TemporaryDirectory() as tmp:
        for name, build in M.DEMO_MODELS.items():
            model = build(**SMALL[name]) if args.quick else build()
            feeds = M.random_feeds(model)
            ref = list(M.reference_outputs(model, feeds).values())
            feeds_path = os.path.join(tmp, f"{name}.feeds.npz")
            np.savez(feeds_path, **feeds)
            cm = tvmfuse.compile(model, target=args.target, name=name)
            for form, suffix in (("dir", ""), ("tar", ".tar")):
                out = tvmfuse.export(cm, f"{tmp}/{name}{suffix}")
                outs_path = os.path.join(tmp, f"{name}_{form}.out.npz")
                t = time_artifact(out, feeds_path, outs_path, args.loads, args.runs)
                row = {"model": name, "form": form, "bytes": artifact_size(out), **t, **check(ref, outs_path)}
                rows.append(row)
                print(f"{name:18} {form:5} {row['bytes'] / 1e3:>7.1f} kB {t['import_s']:>8.2f}s "
                      f"{t['load_s'] * 1e3:>7.1f}ms {t['first_run_s'] * 1e3:>7.2f}ms {t['run_s'] * 1e3:>7.3f}ms  "
                      f"{row['check']}", flush=True)
    doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "load_avg_start": load_start, "load_avg_end": os.getloadavg(), "target": args.target or "host",
           "quick": args.quick, "loads": args.loads, "runs": args.runs,
           "check": {"reference": "onnx.reference.ReferenceEvaluator", "rtol": CHECK_RTOL, "atol": CHECK_ATOL},
           "command": " ".join(["python", "benchmarks/export_bench.py"] + (argv if argv is not None else sys.argv[1:])),
           "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    print()
    for line in table_7_rows(doc):
        print(line)
    return 1 if any(r["check"] != "pass" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
