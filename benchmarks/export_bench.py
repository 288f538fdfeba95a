"""Size and load time of exported artifacts (directory and .tar) of the demo models.

Each load is timed in a fresh interpreter: `import tvmfuse` and `tvmfuse.load(...)` separately, then the
first and the median of 10 further inferences.

    python benchmarks/export_bench.py [--quick] [--target T] [--json benchmarks/export_bench.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import tvmfuse
from tvmfuse import models as M
from tvmfuse.export import artifact_size

SMALL = {"transformer_block": dict(seq=16, hidden=32, heads=2, ffn=64), "resnet_block": dict(channels=8, size=8)}

_TIMER = r"""
import json, sys, time
t0 = time.perf_counter()
import tvmfuse
t1 = time.perf_counter()
r = tvmfuse.load(sys.argv[1])
t2 = time.perf_counter()
feeds = r.random_feeds()
r.run(feeds)
t3 = time.perf_counter()
runs = []
for _ in range(10):
    s = time.perf_counter(); r.run(feeds); runs.append(time.perf_counter() - s)
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_run_s": t3 - t2,
                  "run_s": sorted(runs)[len(runs) // 2]}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small models")
    p.add_argument("--target", default=None)
    p.add_argument("--json", default=None, help="also write the rows, date, machine and command here")
    args = p.parse_args(argv)
    rows = []
    print(f"{'model':18} {'form':5} {'size':>10} {'import':>9} {'load':>9} {'1st run':>9} {'run':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, build in M.DEMO_MODELS.items():
            cm = tvmfuse.compile(build(**SMALL[name]) if args.quick else build(), target=args.target, name=name)
            for form, suffix in (("dir", ""), ("tar", ".tar")):
                out = tvmfuse.export(cm, f"{tmp}/{name}{suffix}")
                r = subprocess.run([sys.executable, "-c", _TIMER, out], capture_output=True, text=True,
                                   check=True)
                t = json.loads(r.stdout.strip().splitlines()[-1])
                rows.append({"model": name, "form": form, "bytes": artifact_size(out), **t})
                print(f"{name:18} {form:5} {artifact_size(out) / 1e3:>7.1f} kB {t['import_s']:>8.2f}s "
                      f"{t['load_s'] * 1e3:>7.1f}ms {t['first_run_s'] * 1e3:>7.2f}ms {t['run_s'] * 1e3:>7.3f}ms")
    if args.json:
        doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
               "load_avg_end": os.getloadavg(), "target": args.target or "host", "quick": args.quick,
               "command": " ".join(["python", "benchmarks/export_bench.py"]
                                   + (argv if argv is not None else sys.argv[1:])), "rows": rows}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
