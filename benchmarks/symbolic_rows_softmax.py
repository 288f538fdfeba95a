"""Softmax over [rows, seq], both symbolic (``cpu.symbolic_rows``), against a build pinned to each size
(``cpu.row_reduction``): ``run()`` on numpy, interleaved rounds of back-to-back calls, median per call.
Outputs checked against numpy.  Run it from the tree to measure (``PYTHONPATH=<tree>``) to compare two
commits.

    PYTHONPATH=. python benchmarks/symbolic_rows_softmax.py --seq 7 17 33 128 1000 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import tvmfuse
from tvmfuse import models as M


def softmax_model():
    g = M._G("softmax_rows")
    g.op("Softmax", g.input("x", ("rows", "seq")), axis=-1)
    g.rename_last("y", ("rows", "seq"))
    return g.model()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--seq", type=int, nargs="+", default=[7, 17, 33, 128, 1000])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    sym = tvmfuse.compile(softmax_model())
    out = {"tvmfuse": os.path.dirname(tvmfuse.__file__), "rows": args.rows, "rounds": args.rounds,
           "repeat": args.repeat, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_1min_start": os.getloadavg()[0], "template": [s["template"] for s in sym.report.schedules],
           "sizes": []}
    for seq in args.seq:
        pinned = tvmfuse.compile(softmax_model(), input_shapes={"rows": args.rows, "seq": seq})
        x = np.random.default_rng(0).standard_normal((args.rows, seq)).astype("float32")
        ref = np.exp(x - x.max(-1, keepdims=True))
        ref /= ref.sum(-1, keepdims=True)
        for m in (sym, pinned):
            np.testing.assert_allclose(m.run({"x": x})["y"], ref, rtol=1e-5, atol=1e-6)
        times = {"symbolic": [], "pinned": []}
        for r in range(args.rounds):
            order = (("symbolic", sym), ("pinned", pinned))
            for name, m in (order if r % 2 == 0 else order[::-1]):
                t0 = time.perf_counter()
                for _ in range(args.repeat):
                    m.run({"x": x})
                times[name].append((time.perf_counter() - t0) / args.repeat * 1e6)
        row = {"seq": seq, "symbolic_us": float(np.median(times["symbolic"])),
               "pinned_us": float(np.median(times["pinned"])), "rounds_us": times}
        row["ratio"] = row["symbolic_us"] / row["pinned_us"]
        out["sizes"].append(row)
        print(f"seq {seq}: symbolic {row['symbolic_us']:.1f} us, pinned {row['pinned_us']:.1f} us, "
              f"ratio {row['ratio']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
