"""tvmfuse's tuner vs MetaSchedule (tvm.s_tir.meta_schedule, XGBoost cost model) at equal trial budgets.

For each workload, the one fused kernel that matters (MatMul+Bias+GELU; Conv+BN+ReLU+residual) is taken
from tvmfuse's graph stage, so both tuners tune the *same* PrimFunc, on the kernel's real arguments: the
arrays it receives when the model runs on normally distributed inputs (``kernel_inputs_from_samples``).

- tvmfuse: ``Tuner`` with the kernel's template, up to the largest budget; the best after B trials is
  read from the log (records are in measurement order), the wall time to B trials from the records' times.
- MetaSchedule: ``tune_tir(..., cost_model="xgb", strategy="evolutionary")`` up to the largest budget
  (``--budgets`` up to MAX_TRIALS), ``--ms-trials-per-iter`` trials per iteration, a measure callback
  noting the time and every trial's cost.

Curves (best cost so far after each trial, the tuners' own measurements) come in two forms for both tuners:
``cold`` (only the tuner's search trials; tvmfuse's first trial, its template default, left out) and
``from default`` (never worse than tvmfuse's template default, which tvmfuse measures as its first
trial and a user of either tuner keeps when tuning finds nothing better).  ``--seeds`` repeats the study.

The default schedule and both tuners' best schedules at each budget are then built and timed by the same
runner on the same inputs, in interleaved rounds (``--rounds`` x ``--repeat`` runs, median), and every
one's outputs are checked against the ONNX reference (onnx.reference.ReferenceEvaluator on the model's
inputs), not against tvmfuse's default schedule.

``--transfer`` adds the warm-start study (tvmfuse): the workload's shape tuned with ``--budgets`` trials
from scratch, and again after the records of TRANSFER_SOURCES shapes (tuned first, ``--transfer-source-
trials`` each) are given as ``transfer_logs`` (the cost model trains on them, and the ``--transfer-seeds``
best configurations of each source that fit the shape's space are measured first); both curves are kept,
and each budget's pick of both runs is timed and checked like the main study's.  ``--transfer-only``: that
study alone.  The run "without records" is the main study's tvmfuse run of the same seed (same kernel, seed
and trial count), so when the study holds that run (this run's study piece, or the ``--merge-into`` file's)
it is reused instead of tuned again (``study_tvmfuse_run``; its picks are still timed again beside the warm
run's); ``--no-reuse-study-run`` tunes it again.  MetaSchedule keys its database by the workload's
structural hash, so records of other shapes do not carry over; it has no such row.

Cost-model quality on held-out records (``cost_model_quality``, off with ``--no-cost-model``): the records
of each tvmfuse run (every measured configuration of the kernel, with its program features) are split
CM_SPLITS times at random into CM_TRAIN_FRACTION for training the tuner's XGBoost model (``CostModel``, its
parameters, trained from scratch) and the rest; on the rest it reports the Spearman rank correlation of
predicted vs measured speed, the recall of the true k fastest among the model's k picks (CM_TOP_K), and
``ranking_quality``'s TenSet top-k score and pairwise accuracy; mean and range over the splits.

``--plot DIR`` writes the curves as PNG (``benchmarks/plot_tuner.py``, needs matplotlib: ``pip install -e
'.[plot]'``; or afterwards from the JSON alone: ``/work/venv-corpus/bin/python benchmarks/plot_tuner.py
STUDY.json --out DIR``).

    python benchmarks/bench_tuner.py -o benchmarks/bench_tuner.json         # issue shapes, budgets 32 64 128
    python benchmarks/bench_tuner.py --small --budgets 64 256 1000 --seeds 0 1 2 --transfer \
        -o benchmarks/bench_tuner_small.json --plot benchmarks/plots       # the long study
    python benchmarks/bench_tuner.py --quick                                # smoke run (minutes)
    python benchmarks/bench_tuner.py --quick --skip-ms --workloads matmul_bias_gelu   # + cost model, quickest

The long study in pieces: with ``--merge-into STUDY.json`` every (part, workload, seed) piece (part: the
study, or the transfer study) is merged into the file as soon as it is done (``merge_results``), so an
interrupted run keeps every finished piece and the same command, run again, skips the pieces the file holds
(same shape, every budget asked, no error; ``--redo`` reruns them) and retries those recorded as errors.
A study of another target, shape set or check is refused before any tuning.  A failure inside a piece
(a tuner crash, a budget with no successful trial, a pick that fails its check) is recorded as an error in
the JSON; the run goes on and exits 1 naming the failed pieces.

    python benchmarks/bench_tuner.py --workloads matmul_bias_gelu --seeds 0 --budgets 64 256 1000 \
        --merge-into benchmarks/bench_tuner_study.json
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
from tvmfuse.tune.cost_model import CostModel, Sample, held_out_split, ranking_quality
from tvmfuse.tune.measure import Measurer, compare_outputs
from tvmfuse.tune.search import confirm_candidates, run_confirm
from tvmfuse.tune.tasks import extract_tasks, kernel_inputs_from_samples

MAX_TRIALS = 1000         # the largest budget the study is meant for (MetaSchedule's tutorials use 1000+)
CHECK_RTOL, CHECK_ATOL = 1e-3, 1e-4   # vs the ONNX reference; atol scaled by the largest |reference| (>= 1)

WORKLOADS = {
    # name: (model builder, kernel template family, full-size args, small args)
    "matmul_bias_gelu": (M.matmul_bias_gelu, "cpu.matmul_epilogue",
                         dict(m=512, k=768, n=3072), dict(m=128, k=256, n=512)),
    "conv_bn_relu_residual": (M.conv_bn_relu_residual, "cpu.conv2d_epilogue",
                              dict(channels=64, size=56), dict(channels=32, size=32)),
}
# cost-model quality on held-out records (cost_model_quality)
CM_TRAIN_FRACTION = 0.6   # share of a run's records the model is trained on (as the tests' held_out_quality)
CM_SPLITS = 5             # random train/test splits, reported as mean and range
CM_TOP_K = (1, 5, 10)     # recall of the true k fastest among the model's k best-scored (k capped at the test size)

# (a conv below 32x32 is cpu.conv2d_lanes' on x86, not cpu.conv2d_epilogue's: below 16x16 by plane size, 28x28 since
# conv11 because 28 columns fill under 0.9 of the vector lanes; the small, quick and source shapes use 32)
QUICK_ARGS = {"matmul_bias_gelu": dict(m=32, k=64, n=128), "conv_bn_relu_residual": dict(channels=16, size=32)}
# warm-start study: other shapes of the same workload whose records are given to the tuner of the main shape
TRANSFER_SOURCES = {
    "matmul_bias_gelu": [dict(m=64, k=256, n=512), dict(m=128, k=128, n=256)],
    "conv_bn_relu_residual": [dict(channels=16, size=32), dict(channels=64, size=32)],
}
QUICK_TRANSFER_SOURCES = {"matmul_bias_gelu": [dict(m=16, k=64, n=128)],
                          "conv_bn_relu_residual": [dict(channels=8, size=32)]}


def _measure_callback(apply):
    """A MetaSchedule measure callback calling ``apply(task_scheduler, task_id, candidates, builder_results,
    runner_results)``: how MetaSchedule's progress is noted at each budget."""
    derived_object, py_measure_callback = C.ms_py_measure_callback()

    @derived_object
    class _Callback(py_measure_callback):
        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
            apply(task_scheduler, task_id, measure_candidates, builder_results, runner_results)

    return _Callback()


def main_task(name: str, shape: dict, target):
    build, family, _, _ = WORKLOADS[name]
    model = build(**shape)
    tasks = [t for t in extract_tasks(model, target) if t.family == family]
    if not tasks:
        raise LookupError(f"no kernel matches the {family} template on this target")
    return max(tasks, key=lambda t: t.space.size()), model


def best_curve(costs: list, start=None) -> list:
    """Best cost so far after each trial (None until one trial succeeded); ``start`` seeds the minimum."""
    out, best = [], start
    for c in costs:
        if c is not None and (best is None or c < best):
            best = c
        out.append(best)
    return out


def run_tvmfuse(task, target, budgets, work, seed, inputs, transfer_logs=(), tag="tvmfuse", transfer_seeds=2):
    """tvmfuse's tuner to ``max(budgets)`` trials: per budget the best record of the first B trials (or an
    ``error`` when none of them succeeded), the curves, the log's path (and the warm start's summary in
    ``curves["warm_start"]`` when ``transfer_logs`` are given)."""
    log_path = os.path.join(work, f"{tag}_{seed}_{task.workload_key}.jsonl")
    t0 = time.time()
    # the tuner's own end-of-job confirm is off here: the study confirms each budget's head (confirm_budgets)
    res = Tuner([task], target, log_path, TuneOptions(trials=max(budgets), seed=seed,
                                                      transfer_logs=tuple(transfer_logs),
                                                      transfer_seeds=transfer_seeds, confirm_top=0),
                MeasureOptions(), inputs={task.workload_key: inputs}).run()
    recs = L.load(log_path, target).measures
    costs = [L.median_cost(r) for r in recs]
    default_cost = next((c for r, c in zip(recs, costs) if r["config"] == task.default_config), None)
    search = [None if r["config"] == task.default_config else c for r, c in zip(recs, costs)]
    out = {}
    for b in budgets:
        head = recs[:b]
        ok = [r for r in head if L.median_cost(r) is not None]
        errors = {}
        for r in head:
            if r["error"]:
                errors[r["error"]["kind"]] = errors.get(r["error"]["kind"], 0) + 1
        out[b] = {"wall_s": head[-1]["time"] - t0 if head else None, "errors": sum(errors.values()),
                  "error_kinds": errors, "trials_run": len(head)}
        if ok:
            best = min(ok, key=L.median_cost)
            out[b].update(config=best["config"], tuner_cost=L.median_cost(best))
        else:        # recorded, and the final timing of this budget is skipped
            out[b].update(config=None, tuner_cost=None,
                          error=f"none of the first {len(head)} trials succeeded ({errors or 'no trial ran'})")
    curves = {"trial_costs": costs, "trial_wall_s": [r["time"] - t0 for r in recs], "default_cost": default_cost,
              "cold": best_curve(search), "from_default": best_curve(costs)}
    if transfer_logs:
        curves["warm_start"] = res.warm_start
    return out, curves, log_path


def rank_correlation(scores, costs) -> float:
    """Spearman's rank correlation between ``scores`` (higher: predicted faster) and measured speed
    (``-costs``); ties get their average rank; nan for fewer than two values or no spread."""
    def ranks(v):
        v = np.asarray(v, float)
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for x in np.unique(v):          # ties: the mean of their ranks
            m = v == x
            r[m] = r[m].mean()
        return r

    if len(scores) < 2:
        return float("nan")
    a, b = ranks(scores), ranks(-np.asarray(costs, float))
    if a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


def top_k_recall(scores, costs, k: int) -> float:
    """Of the k fastest measured configurations, the fraction among the k the model scores highest (k
    capped at the number of configurations)."""
    k = min(k, len(costs))
    picked = set(np.argsort(-np.asarray(scores, float), kind="stable")[:k].tolist())
    fastest = set(np.argsort(np.asarray(costs, float), kind="stable")[:k].tolist())
    return len(picked & fastest) / k


def cost_model_quality(samples: list, train_fraction: float = CM_TRAIN_FRACTION, splits: int = CM_SPLITS,
                       ks=CM_TOP_K, seed: int = 0) -> dict:
    """The tuner's cost model trained on ``train_fraction`` of each workload's samples, judged on the rest,
    over ``splits`` random splits: per split and mean/min/max of each measure (module docstring)."""
    per_split = []
    for i in range(splits):
        train, test = held_out_split(samples, train_fraction, seed + i)
        model = CostModel(seed=seed + i)
        if not model.fit(train) or len(test) < 2:
            raise ValueError(f"too few records for a held-out split: {len(train)} to train, {len(test)} to test "
                             f"(need two of one workload in each)")
        scores = model.predict([s.program for s in test], [s.config for s in test])
        groups = sorted({s.group for s in test})
        row = {"train": len(train), "test": len(test)}
        for name, fn in [("spearman", rank_correlation)] + [(f"recall@{k}", lambda sc, c, k=k: top_k_recall(sc, c, k))
                                                             for k in ks]:
            vals = []
            for g in groups:
                m = [j for j, s in enumerate(test) if s.group == g]
                vals.append(fn(scores[m], [test[j].cost for j in m]))
            row[name] = float(np.nanmean(vals)) if not all(np.isnan(vals)) else float("nan")
        q = ranking_quality(scores, [s.cost for s in test], [s.group for s in test])
        row.update(tenset_top1=q.top1, tenset_top5=q.top5, pairwise_accuracy=q.pairwise_accuracy)
        per_split.append(row)
    summary = {}
    for key in per_split[0]:
        vals = [r[key] for r in per_split]
        summary[key] = {"mean": float(np.mean(vals)), "min": float(np.min(vals)), "max": float(np.max(vals))}
    return {"train_fraction": train_fraction, "splits": per_split, "summary": summary,
            "samples": len(samples), "workloads": len({s.group for s in samples})}


def log_samples(measurer, task, log_path, target, inputs: list) -> list:
    """A tuning log's measured records of ``task`` as cost-model samples (program features of each config).
    ``inputs``: the kernel's arguments, registered with the task as the later timing of the picks needs them
    (a measurer keeps the first registration of a task)."""
    recs = [r for r in L.load(log_path, target).measures if L.median_cost(r) is not None]
    measurer.register(task, inputs)
    feats = measurer.features(task, [r["config"] for r in recs])
    return [Sample(task.workload_key, np.asarray(f["features"]), r["config"], L.median_cost(r))
            for r, f in zip(recs, feats) if f.get("ok")]


def run_metaschedule(task, target, budgets, work, seed, per_iter, default_cost=None):
    ms = C.meta_schedule
    t_import = time.time()
    C.import_tensor_intrin()         # TuneContext imports it first: ~40 s on this host, timed apart
    import_s = time.time() - t_import
    seen = {"n": 0, "best": None, "best_mod": None, "points": {}, "costs": [], "wall": []}
    t0 = [0.0]

    def checkpoints(task_scheduler, task_id, measure_candidates, builder_results, runner_results):
        for cand, res in zip(measure_candidates, runner_results):
            seen["n"] += 1
            c = None
            if res.error_msg is None and res.run_secs:
                c = float(np.median([float(x) for x in res.run_secs]))
                if seen["best"] is None or c < seen["best"]:
                    seen["best"], seen["best_mod"] = c, cand.sch.mod
            seen["costs"].append(c)
            seen["wall"].append(time.time() - t0[0])
            if seen["n"] in budgets:
                seen["points"][seen["n"]] = {"tuner_cost": seen["best"], "mod": seen["best_mod"],
                                             "wall_s": time.time() - t0[0]}

    mod = C.IRModule({"main": task.func.with_attr("global_symbol", "main")})
    d = os.path.join(work, f"ms_{seed}")
    t0[0] = time.time()
    ms.tune_tir(mod, target, d, max_trials_global=max(budgets), num_trials_per_iter=per_iter,
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
    curves = {"trial_costs": seen["costs"], "trial_wall_s": seen["wall"], "cold": best_curve(seen["costs"]),
              "from_default": best_curve(seen["costs"], default_cost)}
    return seen["points"], import_s, curves


def confirm_budgets(task, target, log_path, budgets, inputs) -> dict:
    """What the tuner's end-of-job confirm (``TuneOptions.confirm_top``/``confirm_rounds`` at their defaults)
    would apply had the job stopped after each budget: its best configurations among the first B trials
    re-timed with the default in interleaved rounds, in a measurer with the tuner's own options."""
    recs = L.load(log_path, target).measures
    o = TuneOptions(trials=1)
    out = {}
    measurer = Measurer(target, MeasureOptions())
    try:
        measurer.prepare(task, inputs)
        for b in budgets:
            cands = confirm_candidates(recs[:b], task.default_config, o.confirm_top)
            if not cands:
                out[b] = {"chosen": task.default_config, "confirm_s": 0.0, "note": "the default leads the search"}
                continue
            t0 = time.time()
            entries, chosen = run_confirm(measurer, task, cands, o.confirm_rounds)
            out[b] = {"chosen": chosen, "confirm_s": time.time() - t0, "rounds": o.confirm_rounds,
                      "candidates": [{"config": e["config"], "costs": e["costs"], "error": e["error"]}
                                     for e in entries]}
    finally:
        measurer.close()
    return out


def build_final(measurer, mod, work, tag) -> str:
    lib = os.path.join(work, f"final_{tag}.so")
    C.build_prim_module(C.IRModule({"main": mod["main"].with_attr("global_symbol", "main")}),
                        measurer.target).export_library(lib)
    return lib


def onnx_reference_args(task, inputs: list, model, feeds) -> list:
    """The kernel's arguments as they must be after it runs: its inputs as given, its outputs (the last
    arguments) the ONNX reference's outputs of the model (the kernel must compute the model's outputs)."""
    ref = list(M.reference_outputs(model, feeds).values())
    n_in = len(inputs) - len(ref)
    outs = inputs[n_in:]
    if n_in < 0 or any(o.shape != r.shape or o.dtype != r.dtype for o, r in zip(outs, ref)):
        raise LookupError(f"{task.name}: its outputs {[(o.dtype, o.shape) for o in outs]} are not the model's "
                          f"{[(r.dtype, r.shape) for r in ref]}; cannot check it against the ONNX reference")
    return list(inputs[:n_in]) + ref


def time_finals(measurer, task, libs: dict, work, repeat, rounds, inputs, reference) -> dict:
    """Time every final schedule in interleaved rounds (A B C A B C ...: a load change on this shared
    host hits all of them alike) in the measurer's runner on the kernel's real inputs; median of the
    rounds' medians; outputs checked against the ONNX reference (``reference``)."""
    tf = measurer.prepare(task, inputs)
    tf.reference = reference
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
            diff = compare_outputs(tf.reference, outs, CHECK_RTOL, CHECK_ATOL)
            if diff is not None:
                out[tag] = {"error": diff}
                continue
            per[tag].append(statistics.median(r["costs"]))
    for tag, ts in per.items():
        if tag not in out:
            out[tag] = {"median_s": statistics.median(ts), "rounds_s": ts, "check": "ok vs ONNX reference"}
    return out


def _feeds(model, seed=0):
    return {k: np.random.default_rng(seed).standard_normal(v.shape).astype(v.dtype)
            for k, v in M.random_feeds(model).items()}


def study(name, shape, args, target, budgets, seeds) -> dict:
    """Both tuners on one workload's kernel, per seed; the final picks timed and checked."""
    task, model = main_task(name, shape, target)
    feeds = _feeds(model)
    inputs = kernel_inputs_from_samples(model, target, feeds, [task])[task.workload_key]
    reference = onnx_reference_args(task, inputs, model, feeds)
    print(f"== {name}: {task.name} [{task.family}] space {task.space.size()} "
          f"params {task.workload['params']}", flush=True)
    row = {"kernel": task.name, "shape": shape, "params": task.workload["params"], "seeds": {}}
    for seed in seeds:
        work = tempfile.mkdtemp(prefix=f"bench_tuner_{name}_{seed}_")
        measurer = Measurer(target, MeasureOptions(repeat=args.repeat))
        cell_seed = {"budgets": {}}
        t_seed = time.time()
        try:
            tf_points, tf_curves, tf_log = run_tvmfuse(task, target, budgets, work, seed, inputs)
            cell_seed["tvmfuse_curves"] = tf_curves
            confirmed = confirm_budgets(task, target, tf_log, budgets, inputs)
            if args.cost_model:
                cm = cost_model_quality(log_samples(measurer, task, tf_log, target, inputs), seed=seed)
                cell_seed["cost_model"] = cm
                print(f"== {name} seed {seed}: cost model on held-out records ({cm['samples']} records, "
                      f"{CM_SPLITS} splits): " + ", ".join(f"{k} {v['mean']:.2f} [{v['min']:.2f}-{v['max']:.2f}]"
                                                           for k, v in cm["summary"].items()
                                                           if k not in ("train", "test")), flush=True)
            if not args.skip_ms:
                try:
                    ms_points, ms_import, ms_curves = run_metaschedule(task, target, budgets, work, seed,
                                                                       args.ms_trials_per_iter or min(budgets),
                                                                       tf_curves["default_cost"])
                    cell_seed["ms_tensor_intrin_import_s"] = ms_import
                    cell_seed["ms_curves"] = ms_curves
                except Exception as e:  # noqa: BLE001  MetaSchedule's failure is recorded in the cell
                    msg = f"MetaSchedule tuning failed: {type(e).__name__}: {str(e)[:2000]}"
                    print(f"== {name} seed {seed}: {msg}", flush=True)
                    ms_points = {b: {"tuner_cost": None, "mod": None, "error": msg} for b in budgets}
            libs = {"default": build_final(measurer, C.IRModule({"main": _default_func(task)}), work, "default")}
            for b in budgets:
                if tf_points[b]["config"] is not None:
                    libs[f"tvmfuse{b}"] = build_final(measurer, C.IRModule(
                        {"main": _scheduled(task, tf_points[b]["config"])}), work, f"tvmfuse{b}")
                ch = confirmed[b]["chosen"]
                if ch is not None and ch not in (tf_points[b]["config"], task.default_config):
                    libs[f"tvmfuse{b}c"] = build_final(measurer, C.IRModule(
                        {"main": _scheduled(task, ch)}), work, f"tvmfuse{b}c")
                if not args.skip_ms and ms_points[b]["mod"] is not None:
                    libs[f"ms{b}"] = build_final(measurer, ms_points[b]["mod"], work, f"ms{b}")
            finals = time_finals(measurer, task, libs, work, args.repeat, args.rounds, inputs, reference)
            cell_seed["default"] = finals["default"]
            for b in budgets:
                cell = {"tvmfuse": {**tf_points[b], **finals.get(f"tvmfuse{b}", {})}}
                ch = confirmed[b]["chosen"]
                timed = (finals.get(f"tvmfuse{b}", {}) if ch == tf_points[b]["config"] else
                         finals["default"] if ch == task.default_config else finals.get(f"tvmfuse{b}c", {}))
                cell["tvmfuse_confirmed"] = {**confirmed[b], "config": ch,
                                             "is_search_pick": ch == tf_points[b]["config"],
                                             "is_default": ch == task.default_config, **timed}
                if not args.skip_ms:
                    mp = ms_points[b]
                    cell["metaschedule"] = ({k: v for k, v in mp.items() if k != "mod"}
                                            | finals.get(f"ms{b}", {} if "error" in mp else
                                                         {"error": "no valid schedule"}))
                cell_seed["budgets"][b] = cell
                print(json.dumps({"seed": seed, b: cell}, default=float), flush=True)
            cell_seed["piece_s"] = time.time() - t_seed
        finally:
            measurer.close()
            if args.keep:
                print(f"work directory kept: {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)
        row["seeds"][seed] = cell_seed
    return row


POINT_KEYS = ("wall_s", "errors", "error_kinds", "trials_run", "config", "tuner_cost")  # run_tvmfuse's, per budget


def study_tvmfuse_run(cell: dict | None, budgets: list, where: str):
    """The main study's tvmfuse run of one seed as the transfer study's run "without records" (it is the
    same run: ``run_tvmfuse`` on the same kernel, seed and ``max(budgets)`` trials, no transfer logs):
    ``(points, curves, note)``, or ``(None, None, why not)`` when ``cell`` (a study seed cell, as in this
    run's results or read back from a study JSON) is missing, an error, of another trial count, or holds a
    budget's pick from another piece than its curves."""
    if not cell:
        return None, None, f"no study run of this seed in {where}"
    cell = json.loads(json.dumps(cell, default=float))          # int keys -> str, as read back from JSON
    if "error" in cell:
        return None, None, f"the study run of this seed in {where} is an error"
    costs = cell.get("tvmfuse_curves", {}).get("trial_costs")
    if costs is None or len(costs) != max(budgets):
        return None, None, (f"the study run of this seed in {where} ran {None if costs is None else len(costs)} "
                            f"trials, not {max(budgets)}")
    points = {}
    for b in budgets:
        bc = cell.get("budgets", {}).get(str(b))
        if not bc or "tvmfuse" not in bc:
            return None, None, f"the study run of this seed in {where} has no budget {b}"
        if bc.get("piece") != cell.get("piece"):
            return None, None, (f"budget {b}'s pick in {where} is of piece {bc.get('piece')}, the curves of piece "
                                f"{cell.get('piece')}")
        tf = bc["tvmfuse"]
        points[b] = {k: tf[k] for k in POINT_KEYS if k in tf}
        if tf.get("config") is None and "error" in tf:
            points[b]["error"] = tf["error"]
    piece = f" (piece {cell['piece']})" if "piece" in cell else ""
    return points, cell["tvmfuse_curves"], f"reused: the study's tvmfuse run of this seed in {where}{piece}"


def transfer_study(name, shape, sources, args, target, budgets, seeds, cold_runs=None) -> dict:
    """tvmfuse on ``shape`` from scratch vs with the records of ``sources`` (other shapes) as transfer logs;
    each budget's pick of both runs (and the default) then built, timed in interleaved rounds and checked
    against the ONNX reference like the main study's.  ``cold_runs`` ({seed: (points, curves, note)}, from
    ``study_tvmfuse_run``) gives a seed's run from scratch instead of tuning it again."""
    task, model = main_task(name, shape, target)
    feeds = _feeds(model)
    inputs = kernel_inputs_from_samples(model, target, feeds, [task])[task.workload_key]
    reference = onnx_reference_args(task, inputs, model, feeds)
    out = {"shape": shape, "sources": sources, "source_trials": args.transfer_source_trials,
           "transfer_seeds": args.transfer_seeds, "seeds": {}}
    for seed in seeds:
        work = tempfile.mkdtemp(prefix=f"bench_transfer_{name}_{seed}_")
        t_seed = time.time()
        measurer = None
        try:
            logs = []
            for i, src in enumerate(sources):
                st, sm = main_task(name, src, target)
                si = kernel_inputs_from_samples(sm, target, _feeds(sm), [st])[st.workload_key]
                _, _, lp = run_tvmfuse(st, target, [args.transfer_source_trials], work, seed, si, tag=f"source{i}")
                logs.append(lp)
            t_main = time.time()
            cold_pts, cold, cold_note = (cold_runs or {}).get(seed) or (None, None, None)
            if cold_pts is None:
                cold_pts, cold, _ = run_tvmfuse(task, target, budgets, work, seed, inputs, tag="cold")
                cold_note = "tuned in this piece"
            warm_pts, warm, _ = run_tvmfuse(task, target, budgets, work, seed, inputs, transfer_logs=logs,
                                            tag="warm", transfer_seeds=args.transfer_seeds)
            measurer = Measurer(target, MeasureOptions(repeat=args.repeat))
            libs = {"default": build_final(measurer, C.IRModule({"main": _default_func(task)}), work, "default")}
            for form, pts in (("without_records", cold_pts), ("with_records", warm_pts)):
                for b in budgets:
                    if pts[b]["config"] is not None:
                        libs[f"{form}{b}"] = build_final(measurer, C.IRModule(
                            {"main": _scheduled(task, pts[b]["config"])}), work, f"{form}{b}")
            finals = time_finals(measurer, task, libs, work, args.repeat, args.rounds, inputs, reference)
            out["seeds"][seed] = {"without_records": cold, "with_records": warm, "default": finals["default"],
                                  "budgets": {b: {"without_records": {**cold_pts[b],
                                                                      **finals.get(f"without_records{b}", {})},
                                                  "with_records": {**warm_pts[b], **finals.get(f"with_records{b}", {})}}
                                              for b in budgets},
                                  "budgets_run": budgets, "piece_s": time.time() - t_seed,
                                  "without_records_run": cold_note,
                                  "sources_s": t_main - t_seed}
            print(f"== transfer {name} seed {seed}: best after {max(budgets)} trials "
                  f"{cold['from_default'][-1]} s without, {warm['from_default'][-1]} s with other shapes' records "
                  f"(warm start: {warm.get('warm_start')})", flush=True)
        finally:
            if measurer is not None:
                measurer.close()
            shutil.rmtree(work, ignore_errors=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", type=int, nargs="+", default=[32, 64, 128],
                   help=f"trial budgets (each 1..{MAX_TRIALS}); the largest is what each tuner runs")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--small", action="store_true", help="smaller shapes")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny shapes, budgets 8 16, 2 rounds")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="repeat the study with these seeds")
    p.add_argument("--ms-trials-per-iter", type=int, default=0,
                   help="MetaSchedule trials per search iteration (default: the smallest budget, at most 64)")
    p.add_argument("--repeat", type=int, default=10, help="timed runs of each final schedule per round")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the final timing")
    p.add_argument("--skip-ms", action="store_true", help="tvmfuse only")
    p.add_argument("--cost-model", action=argparse.BooleanOptionalAction, default=True,
                   help="cost-model quality on held-out records of each tvmfuse run (default: on)")
    p.add_argument("--transfer", action="store_true", help="add the warm-start study (tvmfuse)")
    p.add_argument("--transfer-source-trials", type=int, default=64, help="trials per source shape")
    p.add_argument("--transfer-seeds", type=int, default=2,
                   help="best configurations per source shape measured first in the warm run (0: cost model only)")
    p.add_argument("--transfer-only", action="store_true", help="only the warm-start study (with --transfer)")
    p.add_argument("--reuse-study-run", action=argparse.BooleanOptionalAction, default=True,
                   help="the warm-start study's run without records is the main study's tvmfuse run of the same "
                   "seed: reuse it when this run or the --merge-into study holds it (default: on)")
    p.add_argument("--redo", action="store_true",
                   help="with --merge-into: rerun pieces the study already holds (default: skip them)")
    p.add_argument("--plot", default=None, help="write the curves as PNG into this folder (matplotlib)")
    p.add_argument("-o", "--output", default=None, help="write the results as JSON here")
    p.add_argument("--merge-into", default=None,
                   help="merge this run (a piece of the study) into this JSON, created if missing")
    p.add_argument("--keep", action="store_true", help="keep the work directories (logs of both tuners)")
    args = p.parse_args(argv)
    if args.transfer_only and not args.transfer:
        p.error("--transfer-only needs --transfer")
    if args.quick:
        args.budgets = [8, 16] if args.budgets == [32, 64, 128] else args.budgets
        args.rounds, args.repeat = min(args.rounds, 2), min(args.repeat, 3)
        args.transfer_source_trials = min(args.transfer_source_trials, 8)
    budgets = sorted(args.budgets)
    if budgets[0] < 1 or budgets[-1] > MAX_TRIALS:
        p.error(f"--budgets must lie in 1..{MAX_TRIALS}, got {budgets}")
    if not args.ms_trials_per_iter:
        args.ms_trials_per_iter = min(budgets[0], 64)
    target = tvmfuse.host_target()
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "host": platform.processor() or platform.machine(), "target": str(target),
               "cpus": os.cpu_count(), "load_avg_start": os.getloadavg(), "budgets": budgets,
               "seeds": args.seeds, "small": args.small, "quick": args.quick,
               "ms_trials_per_iter": None if args.skip_ms else args.ms_trials_per_iter,
               "check": {"reference": "onnx.reference.ReferenceEvaluator", "rtol": CHECK_RTOL, "atol": CHECK_ATOL},
               "command": " ".join(["python", "benchmarks/bench_tuner.py"] + list(argv if argv is not None
                                                                                 else sys.argv[1:])),
               "workloads": {}, "transfer": {}}

    def save():                      # after each study: a crash later keeps what was measured
        if args.output:
            with open(args.output, "w") as f:
                f.write(json.dumps(results, indent=2, default=float) + "\n")

    study_doc = None
    if args.merge_into and os.path.exists(args.merge_into):
        with open(args.merge_into) as f:
            study_doc = json.load(f)
        check_mergeable(study_doc, results)          # before any tuning: a piece of another study is refused
    failed = []

    def piece(part: str, name: str, seed: int, payload: dict, load_start) -> None:
        """One (workload, seed) piece done: into this run's results and, with --merge-into, the study file
        at once (an interrupted run keeps every finished piece)."""
        nonlocal study_doc
        key = "workloads" if part == "study" else "transfer"
        dst = results[key].setdefault(name, {k: v for k, v in payload.items() if k != "seeds"} | {"seeds": {}})
        dst["seeds"].update(payload.get("seeds", {}))
        if "skipped" in payload:
            results[key][name] = payload
        save()
        if args.merge_into:
            one = {**results, "workloads": {}, "transfer": {}, "seeds": [seed], "part": part,
                   "run_started": results["date"], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "load_avg_start": load_start, "load_avg_end": os.getloadavg(), key: {name: payload}}
            study_doc = merge_results(study_doc, one)
            write_json_atomic(args.merge_into, study_doc)
            print(f"merged {part} {name} seed {seed} into {args.merge_into} (piece {len(study_doc['pieces']) - 1})",
                  flush=True)

    for name in args.workloads:
        _, _, full, little = WORKLOADS[name]
        shape = QUICK_ARGS[name] if args.quick else little if args.small else full
        parts = ([] if args.transfer_only else ["study"]) + (["transfer"] if args.transfer else [])
        for part in parts:
            for seed in args.seeds:
                have = piece_done(study_doc, part, name, seed, budgets, shape)
                if have and not args.redo:
                    print(f"== {part} {name} seed {seed}: already in {args.merge_into} ({have}); skipped "
                          f"(--redo runs it again)", flush=True)
                    continue
                load_start = os.getloadavg()
                try:
                    if part == "study":
                        payload = study(name, shape, args, target, budgets, [seed])
                    else:
                        sources = (QUICK_TRANSFER_SOURCES if args.quick else TRANSFER_SOURCES)[name]
                        cold_runs = None
                        if args.reuse_study_run:
                            pts, curves, note = find_study_run(results, study_doc, args.merge_into, name, seed,
                                                               shape, budgets)
                            print(f"== transfer {name} seed {seed}: run without records: "
                                  f"{note if pts is not None else 'tuned again (' + note + ')'}", flush=True)
                            cold_runs = {seed: (pts, curves, note)} if pts is not None else None
                        payload = transfer_study(name, shape, sources, args, target, budgets, [seed], cold_runs)
                except LookupError as e:
                    print(f"== {name}: skipped: {e}", flush=True)
                    piece(part, name, seed, {"shape": shape, "skipped": str(e)}, load_start)
                    break
                except Exception as e:  # noqa: BLE001  recorded in the study as this piece's error, run fails
                    msg = f"{type(e).__name__}: {str(e)[:2000]}"
                    print(f"== {part} {name} seed {seed}: FAILED: {msg}", flush=True)
                    failed.append(f"{part} {name} seed {seed}: {msg}")
                    payload = {"shape": shape, "seeds": {seed: {"error": msg, "budgets": {}}}}
                piece(part, name, seed, payload, load_start)
    results["load_avg_end"] = os.getloadavg()
    save()
    print_table(study_doc if args.merge_into and study_doc else results)
    if args.plot:
        from plot_tuner import plot_study

        try:
            plot_study(study_doc if args.merge_into and study_doc else results, args.plot)
        except ImportError as e:
            print(f"no plots: matplotlib does not import here ({e}); draw them from the JSON with an interpreter "
                  f"that has it: /work/venv-corpus/bin/python benchmarks/plot_tuner.py "
                  f"{args.merge_into or args.output or 'STUDY.json'} --out {args.plot}")
    if failed:
        print("failed pieces (recorded as errors; rerun the command to retry them):\n  " + "\n  ".join(failed))
        return 1
    return 0


def find_study_run(results: dict, study_doc: dict | None, study_path, name: str, seed: int, shape: dict,
                   budgets: list):
    """``study_tvmfuse_run`` of (``name``, ``seed``) from this run's study piece, else from the study file;
    only for the same shape (the study file's target, shape set and check were checked by check_mergeable)."""
    why = []
    for doc, where in ((results, "this run"), (study_doc, study_path)):
        row = (doc or {}).get("workloads", {}).get(name)
        if not row or "seeds" not in row:
            why.append(f"no study row of {name} in {where}")
            continue
        if json.loads(json.dumps(row.get("shape"))) != json.loads(json.dumps(shape)):
            why.append(f"the study row of {name} in {where} has shape {row.get('shape')}, not {shape}")
            continue
        seeds = json.loads(json.dumps(row["seeds"], default=float))
        pts, curves, note = study_tvmfuse_run(seeds.get(str(seed)), budgets, where)
        if pts is not None:
            return pts, curves, note
        why.append(note)
    return None, None, "; ".join(why)


def write_json_atomic(path: str, doc: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(doc, indent=2, default=float) + "\n")
    os.replace(tmp, path)


def check_mergeable(study_doc: dict, run: dict) -> None:
    for k in SAME_KEYS:
        if study_doc.get(k) != json.loads(json.dumps(run.get(k), default=float)):
            raise SystemExit(f"cannot merge into this study: this run's {k} is {run.get(k)!r}, the study's is "
                             f"{study_doc.get(k)!r} (another host, shape set or check; write a new study JSON)")


def piece_done(study_doc: dict | None, part: str, name: str, seed: int, budgets: list, shape: dict) -> str | None:
    """Why the (part, workload, seed) piece need not run again: the study holds it, without an error, for
    the same shape and every budget asked (None: run it)."""
    if not study_doc:
        return None
    row = study_doc.get("workloads" if part == "study" else "transfer", {}).get(name)
    if row and "skipped" in row and row.get("shape") == json.loads(json.dumps(shape)):
        return f"skipped on this target: {row['skipped']}"
    if not row or "seeds" not in row or row.get("shape") != json.loads(json.dumps(shape)):
        return None
    cell = row["seeds"].get(str(seed))
    if not cell or "error" in cell:
        return None
    if part == "study":
        have = {int(b) for b in cell.get("budgets", {})}
    else:
        have = set(cell.get("budgets_run") or []) or {len(cell.get("with_records", {}).get("trial_costs", []))}
        have = {b for b in budgets if any(h >= b for h in have)} if not cell.get("budgets_run") else have
    if not set(budgets) <= have:
        return None
    return f"piece {cell.get('piece')}, budgets {sorted(have)}"


PIECE_KEYS = ("date", "command", "host", "cpus", "load_avg_start", "load_avg_end", "budgets", "seeds",
              "ms_trials_per_iter", "part", "run_started")
SAME_KEYS = ("target", "small", "quick", "check")   # pieces merged into one study must agree on these


def merge_results(old: dict | None, new: dict) -> dict:
    """One study from pieces: ``new`` (this run's results) merged into ``old`` (a study JSON, or None).
    Each run is a piece (``pieces``: its date, command, load, budgets, seeds); every budget cell and
    transfer cell records the piece it came from.  Cells of a (workload, seed) already present are kept
    unless this piece has the same budget (then replaced); the seed's curves and default timing are the
    piece's with the longest curve.  A seed recorded as an error (``{"error": ...}``) is replaced by the
    next piece of that seed; an error never replaces a seed that has results (it is kept as
    ``later_errors``).  Pieces of another target, shape set or check are refused."""
    new = json.loads(json.dumps(new, default=float))            # int keys -> str, as read back from JSON
    if old is None:
        old = {**{k: new[k] for k in SAME_KEYS}, "pieces": [], "workloads": {}, "transfer": {}}
    for k in SAME_KEYS:
        if old.get(k) != new.get(k):
            raise ValueError(f"cannot merge: this run's {k} is {new.get(k)!r}, the study's is {old.get(k)!r}")
    idx = len(old["pieces"])
    old["pieces"].append({k: new.get(k) for k in PIECE_KEYS}
                         | {"workloads": sorted({*new["workloads"], *new.get("transfer", {})})})
    for name, row in new["workloads"].items():
        if "seeds" not in row:
            old["workloads"].setdefault(name, row | {"piece": idx})
            continue
        dst = old["workloads"].setdefault(name, {k: v for k, v in row.items() if k != "seeds"} | {"seeds": {}})
        if dst.get("shape") != row["shape"]:
            raise ValueError(f"cannot merge {name}: shape {row['shape']} vs the study's {dst.get('shape')}")
        for seed, cell in row["seeds"].items():
            for c in cell["budgets"].values():
                c["piece"] = idx
            cell["piece"] = idx
            have = dst["seeds"].get(seed)
            if have is None or "error" in have:
                dst["seeds"][seed] = cell
                continue
            if "error" in cell:
                have.setdefault("later_errors", []).append({"piece": idx, "error": cell["error"]})
                continue
            n = lambda c: len(c.get("tvmfuse_curves", {}).get("trial_costs", []))  # noqa: E731
            longer = cell if n(cell) >= n(have) else have
            budgets = {**have["budgets"], **cell["budgets"]}
            dst["seeds"][seed] = {**longer, "budgets": dict(sorted(budgets.items(), key=lambda kv: int(kv[0])))}
    for name, tr in new.get("transfer", {}).items():
        if "seeds" not in tr:
            old["transfer"].setdefault(name, tr | {"piece": idx})
            continue
        dst = old["transfer"].setdefault(name, {k: v for k, v in tr.items() if k != "seeds"} | {"seeds": {}})
        for k in ("shape", "sources", "source_trials", "transfer_seeds"):
            if k in dst and k in tr and dst[k] != tr[k]:
                raise ValueError(f"cannot merge the transfer study of {name}: {k} {tr[k]} vs the study's {dst[k]}")
        for seed, cell in tr["seeds"].items():
            have = dst.setdefault("seeds", {}).get(seed)
            if "error" in cell and have is not None and "error" not in have:
                have.setdefault("later_errors", []).append({"piece": idx, "error": cell["error"]})
                continue
            dst["seeds"][seed] = cell | {"piece": idx}
    return old


def _default_func(task):
    return _scheduled(task, task.default_config)


def _scheduled(task, config):
    from tvmfuse.schedules.base import schedule_with

    return schedule_with(task.template, task.match, task.func, config)


def print_table(results) -> None:
    if any(row.get("seeds") for row in results["workloads"].values()):
        print("\n| workload | seed | trials | tvmfuse (ms) | after confirm (ms) | tvmfuse tuning (s) | "
              "MetaSchedule (ms) | MetaSchedule tuning (s) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
    fmt = lambda d: f"{d['median_s'] * 1e3:.3f}" if "median_s" in d else "err"  # noqa: E731
    sec = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
    for name, row in results["workloads"].items():
        for seed, cs in row.get("seeds", {}).items():
            if "error" in cs:
                print(f"| {name} | {seed} | error | {cs['error'][:100]} | | | |")
                continue
            for b, cell in cs["budgets"].items():
                t = cell["tvmfuse"]
                m = cell.get("metaschedule", {})
                c = cell.get("tvmfuse_confirmed")
                print(f"| {name} | {seed} | {b} | {fmt(t)} | {fmt(c) if c else '-'} | {sec(t.get('wall_s'))} | "
                      f"{fmt(m) if m else '-'} | {sec(m.get('wall_s'))} |")
            print(f"| {name} | {seed} | default | {fmt(cs['default'])} | | | | |")
    for name, tr in results.get("transfer", {}).items():
        for seed, cs in tr.get("seeds", {}).items():
            if "error" in cs:
                print(f"transfer {name} seed {seed}: error {cs['error'][:100]}")
                continue
            best = lambda c: "-" if not c["from_default"] or c["from_default"][-1] is None else (  # noqa: E731
                f"{c['from_default'][-1] * 1e3:.3f} ms")
            print(f"transfer {name} seed {seed}: best after {len(cs['without_records']['trial_costs'])} trials "
                  f"{best(cs['without_records'])} without, {best(cs['with_records'])} with the other shapes' "
                  f"records (tuner's measurements; warm start {cs['with_records'].get('warm_start')}; run without "
                  f"records: {cs.get('without_records_run', 'tuned in this piece')})")
            for b, cell in cs.get("budgets", {}).items():
                w, c = cell["with_records"], cell["without_records"]
                print(f"  {b} trials, picks timed and checked: without {fmt(c)} ms, with {fmt(w)} ms"
                      + (f", default {fmt(cs['default'])} ms" if "default" in cs else ""))
    cms = [(name, seed, cs["cost_model"]) for name, row in results["workloads"].items()
           for seed, cs in row.get("seeds", {}).items() if "cost_model" in cs]
    if cms:
        keys = [k for k in cms[0][2]["summary"] if k not in ("train", "test")]
        print(f"\ncost model on held-out records (trained on {CM_TRAIN_FRACTION:.0%} of each run's records, "
              f"mean [min-max] over {CM_SPLITS} splits):")
        print("| workload | seed | records | " + " | ".join(keys) + " |")
        print("|---|---:|---:|" + "---:|" * len(keys))
        for name, seed, cm in cms:
            print(f"| {name} | {seed} | {cm['samples']} | " + " | ".join(
                f"{cm['summary'][k]['mean']:.2f} [{cm['summary'][k]['min']:.2f}-{cm['summary'][k]['max']:.2f}]"
                for k in keys) + " |")


if __name__ == "__main__":
    sys.exit(main())
