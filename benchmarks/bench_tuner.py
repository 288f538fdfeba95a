"""tvmfuse's tuner vs MetaSchedule (tvm.s_tir.meta_schedule, XGBoost cost model) at equal trial budgets.

For each workload, the one fused kernel that matters (MatMul+Bias+GELU; Conv+BN+ReLU+residual) is taken
from tvmfuse's graph stage, so both tuners tune the *same* PrimFunc:

- tvmfuse: ``Tuner`` with the kernel's template, up to the largest budget; the best after B trials is
  read from the log (records are in measurement order), the wall time to B trials from the records' times.
- MetaSchedule: ``tune_tir(..., cost_model="xgb", strategy="evolutionary")`` up to the largest budget,
  ``num_trials_per_iter`` = the smallest budget, a measure callback noting the time and the best
  schedule after each batch of trials.

The default schedule and both tuners' best schedules at each budget are then built and timed by the same
runner on the same normally distributed inputs, in interleaved rounds (``--rounds`` x ``--repeat`` runs,
median), and checked against the default schedule's output.  The tuners' own numbers during tuning
(``tuner_cost``) are kept too: MetaSchedule measures on uniform [0, 1) inputs, tvmfuse on normal ones.

    python benchmarks/bench_tuner.py                       # the issue's shapes, budgets 32 64 128
    python benchmarks/bench_tuner.py --small --budgets 16 32  # quick check
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.tune import MeasureOptions, TuneOptions, Tuner
from tvmfuse.tune import log as L
from tvmfuse.tune.measure import Measurer, compare_outputs
from tvmfuse.tune.tasks import extract_tasks

WORKLOADS = {
    # name: (model builder, kernel template family, full-size args, small args)
    "matmul_bias_gelu": (M.matmul_bias_gelu, "cpu.matmul_epilogue",
                         dict(m=512, k=768, n=3072), dict(m=128, k=256, n=512)),
    "conv_bn_relu_residual": (M.conv_bn_relu_residual, "cpu.conv2d_epilogue",
                              dict(channels=64, size=56), dict(channels=32, size=28)),
}


def _measure_callback(apply):
    """A MetaSchedule measure callback calling ``apply(task_scheduler, task_id, candidates, builder_results,
    runner_results)``: how MetaSchedule's progress is noted at each budget."""
    derived_object, py_measure_callback = C.ms_py_measure_callback()

    @derived_object
    class _Callback(py_measure_callback):
        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
            apply(task_scheduler, task_id, measure_candidates, builder_results, runner_results)

    return _Callback()


def main_task(name: str, small: bool, target):
    build, family, full, little = WORKLOADS[name]
    model = build(**(little if small else full))
    tasks = [t for t in extract_tasks(model, target) if t.family == family]
    if not tasks:
        raise LookupError(f"no kernel matches the {family} template on this target")
    return max(tasks, key=lambda t: t.space.size()), model


def run_tvmfuse(task, target, budgets, work, seed):
    log_path = os.path.join(work, f"tvmfuse_{task.workload_key}.jsonl")
    t0 = time.time()
    Tuner([task], target, log_path, TuneOptions(trials=max(budgets), seed=seed),
          MeasureOptions()).run()
    recs = L.load(log_path, target).measures
    out = {}
    for b in budgets:
        head = recs[:b]
        ok = [r for r in head if L.median_cost(r) is not None]
        best = min(ok, key=L.median_cost)
        out[b] = {"config": best["config"], "tuner_cost": L.median_cost(best),
                  "wall_s": head[-1]["time"] - t0, "errors": sum(1 for r in head if r["error"])}
    return out


def run_metaschedule(task, target, budgets, work, seed):
    ms = C.meta_schedule
    t_import = time.time()
    C.import_tensor_intrin()         # TuneContext imports it first: ~40 s on this host, timed apart
    import_s = time.time() - t_import
    seen = {"n": 0, "best": None, "best_mod": None, "points": {}}
    t0 = [0.0]

    def checkpoints(task_scheduler, task_id, measure_candidates, builder_results, runner_results):
        for cand, res in zip(measure_candidates, runner_results):
            seen["n"] += 1
            if res.error_msg is None and res.run_secs:
                c = float(np.median([float(x) for x in res.run_secs]))
                if seen["best"] is None or c < seen["best"]:
                    seen["best"], seen["best_mod"] = c, cand.sch.mod
            if seen["n"] in budgets:
                seen["points"][seen["n"]] = {"tuner_cost": seen["best"], "mod": seen["best_mod"],
                                             "wall_s": time.time() - t0[0]}

    mod = C.IRModule({"main": task.func.with_attr("global_symbol", "main")})
    d = os.path.join(work, "ms")
    t0[0] = time.time()
    ms.tune_tir(mod, target, d, max_trials_global=max(budgets), num_trials_per_iter=min(budgets),
                # MetaSchedule's default 30 s build limit includes each new builder process importing TVM
                # (minutes on this loaded host): every build timed out; the limit is raised, not the trials
                builder=ms.builder.LocalBuilder(timeout_sec=600), runner=ms.runner.LocalRunner(timeout_sec=120),
                cost_model="xgb", measure_callbacks=[*ms.measure_callback.MeasureCallback.create("default"),
                                                     _measure_callback(checkpoints)],
                seed=seed)
    total = time.time() - t0[0]
    for b in budgets:      # MetaSchedule may stop early when its space is exhausted
        if b not in seen["points"]:
            seen["points"][b] = {"tuner_cost": seen["best"], "mod": seen["best_mod"], "wall_s": total,
                                 "note": f"stopped after {seen['n']} trials"}
    return seen["points"], import_s


def build_final(measurer, mod, work, tag) -> str:
    lib = os.path.join(work, f"final_{tag}.so")
    C.build_prim_module(C.IRModule({"main": mod["main"].with_attr("global_symbol", "main")}),
                        measurer.target).export_library(lib)
    return lib


def time_finals(measurer, task, libs: dict, work, repeat, rounds) -> dict:
    """Time every final schedule in interleaved rounds (A B C A B C ...: a load change on this shared
    host hits all of them alike) in the measurer's runner on the task's normal inputs; median of the
    rounds' medians; outputs checked against the default schedule's."""
    tf = measurer.prepare(task)
    per: dict = {tag: [] for tag in libs}
    out: dict = {}
    for _ in range(rounds):
        for tag, lib in libs.items():
            if tag in out:
                continue
            res = os.path.join(work, f"final_{tag}.npz")
            req = measurer._run_request(tf, lib, res)
            req["repeat"], req["min_repeat_ms"] = repeat, 50
            r = measurer.runners.call(req, 300)
            if not r.get("ok"):
                out[tag] = {"error": r}
                continue
            with np.load(res) as z:
                outs = [z[f"arg{i}"] for i in range(len(z.files))]
            diff = compare_outputs(tf.reference, outs, 1e-3, 1e-4)
            if diff is not None:
                out[tag] = {"error": diff}
                continue
            per[tag].append(statistics.median(r["costs"]))
    for tag, ts in per.items():
        if tag not in out:
            out[tag] = {"median_s": statistics.median(ts), "rounds_s": ts, "check": "ok"}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--small", action="store_true", help="smaller shapes (a quick check)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=10, help="timed runs of each final schedule per round")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the final timing")
    p.add_argument("--skip-ms", action="store_true", help="tvmfuse only")
    p.add_argument("-o", "--output", default=None, help="write the results as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the work directories (logs of both tuners)")
    args = p.parse_args(argv)
    budgets = sorted(args.budgets)
    target = tvmfuse.host_target()
    results = {"host": platform.processor() or platform.machine(), "target": str(target),
               "cpus": os.cpu_count(), "load_avg_start": os.getloadavg(), "budgets": budgets,
               "small": args.small, "workloads": {}}
    for name in args.workloads:
        try:
            task, _ = main_task(name, args.small, target)
        except LookupError as e:
            print(f"== {name}: skipped: {e}", flush=True)
            results["workloads"][name] = {"skipped": str(e)}
            continue
        work = tempfile.mkdtemp(prefix=f"bench_tuner_{name}_")
        print(f"== {name}: {task.name} [{task.family}] space {task.space.size()} "
              f"params {task.workload['params']}", flush=True)
        row = {"kernel": task.name, "params": task.workload["params"], "budgets": {}}
        measurer = Measurer(target, MeasureOptions(repeat=args.repeat))
        try:
            tf_points = run_tvmfuse(task, target, budgets, work, args.seed)
            ms_points, ms_import = ({}, 0.0) if args.skip_ms else run_metaschedule(task, target, budgets, work,
                                                                                   args.seed)
            row["ms_tensor_intrin_import_s"] = ms_import
            libs = {"default": build_final(measurer, C.IRModule({"main": _default_func(task)}), work, "default")}
            for b in budgets:
                libs[f"tvmfuse{b}"] = build_final(
                    measurer, C.IRModule({"main": _scheduled(task, tf_points[b]["config"])}), work, f"tvmfuse{b}")
                if not args.skip_ms and ms_points[b]["mod"] is not None:
                    libs[f"ms{b}"] = build_final(measurer, ms_points[b]["mod"], work, f"ms{b}")
            finals = time_finals(measurer, task, libs, work, args.repeat, args.rounds)
            row["default"] = finals["default"]
            for b in budgets:
                cell = {"tvmfuse": {**tf_points[b], **finals[f"tvmfuse{b}"]}}
                if not args.skip_ms:
                    mp = ms_points[b]
                    cell["metaschedule"] = {k: v for k, v in mp.items() if k != "mod"} | finals.get(
                        f"ms{b}", {"error": "no valid schedule"})
                row["budgets"][b] = cell
                print(json.dumps({b: cell}, default=float), flush=True)
        finally:
            measurer.close()
            if args.keep:
                print(f"work directory kept: {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)
        results["workloads"][name] = row
        if args.output:                      # after each workload: a crash later keeps what was measured
            with open(args.output, "w") as f:
                f.write(json.dumps(results, indent=2, default=float) + "\n")
    results["load_avg_end"] = os.getloadavg()
    text = json.dumps(results, indent=2, default=float)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(text)
    print_table(results)
    return 0


def _default_func(task):
    return _scheduled(task, task.default_config)


def _scheduled(task, config):
    from tvmfuse.schedules.base import schedule_with

    return schedule_with(task.template, task.match, task.func, config)


def print_table(results) -> None:
    print("\n| workload | trials | tvmfuse (ms) | tvmfuse tuning (s) | MetaSchedule (ms) | MetaSchedule tuning (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, row in results["workloads"].items():
        for b, cell in row.get("budgets", {}).items():
            t = cell["tvmfuse"]
            m = cell.get("metaschedule", {})
            fmt = lambda d: f"{d['median_s'] * 1e3:.3f}" if "median_s" in d else "err"  # noqa: E731
            print(f"| {name} | {b} | {fmt(t)} | {t['wall_s']:.0f} | {fmt(m) if m else '-'} | "
                  f"{m.get('wall_s', float('nan')):.0f} |")


if __name__ == "__main__":
    sys.exit(main())
