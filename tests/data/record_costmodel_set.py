"""Record the cost-model test set (tests/data/costmodel_set.json) once: random configurations of a few
fused kernels, measured on this host, with their program features.  Random, not tuner-picked, so the
held-out ranking quality is not flattered by the search's own choices.

    python tests/data/record_costmodel_set.py [--per-workload 40] [-o tests/data/costmodel_set.json]
"""
import argparse
import json
import os
import random
import time

import numpy as np

import tvmfuse
from tvmfuse import models as M
from tvmfuse.tune.measure import MeasureOptions, Measurer
from tvmfuse.tune.tasks import extract_tasks

MODELS = [M.matmul_bias_gelu(64, 128, 256), M.matmul_bias_act(128, 96, 192, act="Relu"),
          M.matmul_bias_gelu(32, 256, 128)]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--per-workload", type=int, default=40)
    p.add_argument("-o", "--output", default=os.path.join(os.path.dirname(__file__), "costmodel_set.json"))
    args = p.parse_args()
    target = tvmfuse.host_target()
    rng = random.Random(0)
    rows = []
    m = Measurer(target, MeasureOptions(repeat=5))
    t0 = time.time()
    try:
        for model in MODELS:
            task = [t for t in extract_tasks(model, target) if t.family == "cpu.matmul_epilogue"][0]
            m.prepare(task)
            configs, seen = [], set()
            while len(configs) < args.per_workload:
                c = task.space.sample(rng)
                k = json.dumps(c, sort_keys=True)
                if k not in seen:
                    seen.add(k)
                    configs.append(c)
            for c, r in zip(configs, m.measure(task, configs)):
                if r.ok and r.features is not None:
                    rows.append({"group": task.workload_key, "config": c, "program": r.features,
                                 "cost": float(np.median(r.costs))})
            print(task.name, task.workload["params"], len(rows), flush=True)
    finally:
        m.close()
    prog = np.array([r["program"] for r in rows])
    varying = [int(i) for i in np.where(prog.max(axis=0) != prog.min(axis=0))[0]]
    constants = {int(i): float(prog[0, i]) for i in range(prog.shape[1]) if i not in set(varying)}
    out = {"about": "random configurations of cpu.matmul_epilogue kernels measured by tvmfuse's runner",
           "target": str(target), "recorded": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - t0),
           "load_avg": os.getloadavg(), "program_len": int(prog.shape[1]), "varying": varying,
           "constants": constants,
           "samples": [{"group": r["group"], "config": r["config"], "cost": r["cost"],
                        "program": [round(float(r["program"][i]), 4) for i in varying]} for r in rows]}
    with open(args.output, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print(f"{len(rows)} samples, {len(varying)} varying feature columns -> {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
