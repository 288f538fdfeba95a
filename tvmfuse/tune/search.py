"""The tuning loop: tasks share a trial budget; each round ranks unmeasured configurations of one task
with the cost model, measures the top of the ranking plus some random ones, logs every result at once,
and retrains the model.

- Budget by expected gain: after one batch per task, the next round goes to the task with the largest
  ``weight x best latency x (recent relative improvement + 1/sqrt(rounds))`` (a task that is called
  often, is slow, and still improves gets the trials; the last term keeps every task explored).
- Never twice: a configuration already in the log for this workload and target is never measured again,
  so rerunning a killed job resumes where it stopped, and a finished job re-spends nothing.
- Exploration: ``epsilon`` of each batch (at least one configuration) is drawn at random from the
  candidates the model did not pick.
- Warm start: the model first trains on the log's records of the same template families (other
  workloads, other shapes: their PrimFunc is in the log's workload records), then on each measurement.
  ``transfer_logs`` (``tvmfuse tune --warm-start LOG``) adds the records of other logs (read only), and
  the ``transfer_seeds`` best configurations of each of their workloads that the task's own knob space
  holds are measured first (on the task: a record of another workload is never taken as a measurement
  of this one).  Unreadable lines of those logs are skipped and named (file:line) in the result.
- Confirm: the search keeps the least of thousands of noisy single measurements, which favours a lucky
  one (on Zen 3 the conv's picks of one seed were 9-12% slower than the default in a final timing that the
  search had ranked 8-17% faster).  At the end of a job, each task's ``confirm_top`` best configurations
  and its default are built once and re-timed in ``confirm_rounds`` interleaved rounds; a configuration
  replaces the default only when faster in every round (of several, the least median;
  ``choose_confirmed``), and the choice is written as a ``confirm`` record, which is what compiling
  applies.
  A job whose best is the default, or whose best is covered by an earlier confirm, re-times nothing.
"""
from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import _compat as C
from .cost_model import CostModel, Sample
from ..records import confirmed_choice, record_key
from .log import (LogWriter, TuningLog, config_id, load, make_confirm_record, make_measure_record,
                  make_workload_record, median_cost)
from .measure import MeasureOptions, Measurer
from .tasks import Task, task_for

log = logging.getLogger("tvmfuse.tune")


@dataclass(frozen=True)
class TuneOptions:
    trials: int                          # measurements in all, over all tasks, including those in the log
    batch: int = 8                       # configurations measured per round
    epsilon: float = 0.25                # share of each batch drawn at random (at least one)
    refresh: int = 32                    # new candidates featurized per round (spaces larger than 4x this)
    seed: int = 0
    warm_start: bool = True              # train on the log's records of the same template families first
    transfer_logs: tuple = ()            # more logs to warm-start from (read only)
    transfer_seeds: int = 2              # best configs per workload of transfer_logs measured first
    confirm_top: int = 3                 # best configs re-timed against the default at the end (0: off)
    confirm_rounds: int = 3              # interleaved rounds of that re-timing


@dataclass
class TaskState:
    task: Task
    measured: dict = field(default_factory=dict)     # config_id -> record (this job and the log)
    features: dict = field(default_factory=dict)     # config_id -> program features | None (failed)
    pool: dict = field(default_factory=dict)         # config_id -> unmeasured candidate config
    rounds: int = 0
    history: list = field(default_factory=list)      # best cost after each round
    exhausted: bool = False
    seeds: list = field(default_factory=list)        # configs to measure first (transfer_seeds)
    confirm: dict | None = None                      # the key's last confirm record (log or this job)

    @property
    def best(self) -> tuple[float | None, dict | None]:
        best_c, best_cfg = None, None
        for r in self.measured.values():
            c = median_cost(r)
            if c is not None and (best_c is None or c < best_c):
                best_c, best_cfg = c, r["config"]
        return best_c, best_cfg


def choose_confirmed(candidates: list[dict], default_config: dict) -> dict | None:
    """The config a confirm keeps, given its ``candidates`` (``{"config", "costs" | "error"}``, costs one
    median per round, rounds in order): the default, unless a candidate was faster than the default in
    every round (the rounds are interleaved, so each compares them under the same load); of several such,
    the least median.  Where the default failed in the rounds, the least median of those that ran.  None
    when no candidate has costs.

    Why every round and not the least median: replayed on the tuner study's 28 confirms (Zen 3, 2 cores;
    ``benchmarks/confirm_policy.py``, benchmarks/README.md Table 5d), the least median kept picks up to
    7.6% slower than the default in the final timing, this rule none over 1.4%, and its kept / default
    ratio is no worse on average (0.985 against 0.991) (``test_choose_confirmed_*``)."""
    ok = [c for c in candidates if c.get("costs")]
    if not ok:
        return None
    dcid = config_id(default_config)
    default = next((c for c in ok if config_id(c["config"]) == dcid), None)
    if default is None:
        return min(ok, key=lambda c: float(np.median(c["costs"])))["config"]
    beats = [c for c in ok if c is not default and len(c["costs"]) == len(default["costs"])
             and all(x < d for x, d in zip(c["costs"], default["costs"]))]
    if not beats:
        return default["config"]
    return min(beats, key=lambda c: float(np.median(c["costs"])))["config"]


def confirm_candidates(records, default_config: dict, top: int) -> list[dict]:
    """The configs a confirm re-times, given a task's measure records: the ``top`` best by median cost
    (the default excluded) and then the default; [] when the default leads or nothing succeeded."""
    ranked = sorted((r for r in records if median_cost(r) is not None), key=median_cost)
    dcid = config_id(default_config)
    if top <= 0 or not ranked or config_id(ranked[0]["config"]) == dcid:
        return []
    return [r["config"] for r in ranked if config_id(r["config"]) != dcid][:top] + [default_config]


def run_confirm(measurer: Measurer, task: Task, configs: list[dict], rounds: int) -> tuple[list[dict], dict | None]:
    """Re-time ``configs`` of a prepared task in ``rounds`` interleaved rounds: the candidate entries
    (``{"config", "costs" | "error"}``) and the chosen config (None when none ran)."""
    results = measurer.confirm(task, configs, rounds)
    entries = [{"config": c, "costs": r.costs, "error": r.error, "device": r.device}
               for c, r in zip(configs, results)]
    return entries, choose_confirmed(entries, task.default_config)


@dataclass
class TuneResult:
    tasks: list[dict]
    trials_run: int
    trials_total: int
    seconds: float
    curve: list[tuple[int, float]]   # (trials done, weighted sum of best latencies), this job's points
    warm_start: dict = field(default_factory=dict)   # what the warm start used (``Tuner.warm_info``)

    def to_dict(self) -> dict:
        return {"tasks": self.tasks, "trials_run": self.trials_run, "trials_total": self.trials_total,
                "seconds": self.seconds, "curve": self.curve, "warm_start": dict(self.warm_start)}


class Tuner:
    def __init__(self, tasks: list[Task], target, log_path, options: TuneOptions,
                 measure_options: MeasureOptions | None = None, progress=None,
                 inputs: dict | None = None, templates=None, measurer: Measurer | None = None):
        self.tasks = tasks
        self.measurer = measurer            # a caller's measurer (worker pools kept across jobs), else own
        self.templates = templates          # None: the target's templates (warm start looks them up)
        self.target = target
        self.log_path = Path(log_path)
        self.options = options
        self.measure_options = measure_options or MeasureOptions()
        self.progress = progress or (lambda event: None)
        self.inputs = inputs or {}
        self.rng = random.Random(options.seed)
        self.model = CostModel(seed=options.seed)
        self.warm: list[Sample] = []
        # records: warm-start samples; workloads: other workloads they came from; seeds: configs measured
        # first; skipped_lines: "file:line: reason" of unreadable lines of the transfer logs
        self.warm_info: dict = {"records": 0, "workloads": 0, "seeds": 0, "skipped_lines": []}

    # ------------------------------------------------------------------ helpers
    def _weighted_total(self, states) -> float | None:
        tot = 0.0
        for s in states:
            c, _ = s.best
            if c is None and s.exhausted:
                continue           # a task that could not be tuned (no reference): left out
            if c is None:
                return None
            tot += s.task.weight * c
        return tot

    def _featurize(self, measurer: Measurer, st: TaskState, configs: list[dict]) -> None:
        todo = [c for c in configs if config_id(c) not in st.features]
        for c, r in zip(todo, measurer.features(st.task, todo)):
            st.features[config_id(c)] = np.asarray(r["features"]) if r.get("ok") else None
            if not r.get("ok"):
                log.info("%s: config %s does not apply (%s: %s)", st.task.name, config_id(c), r["kind"],
                         r["message"][:200])

    def _samples(self, states) -> list[Sample]:
        out = list(self.warm)
        for st in states:
            for cid, rec in st.measured.items():
                c = median_cost(rec)
                f = st.features.get(cid)
                if c is not None and f is not None:
                    out.append(Sample(st.task.key, f, rec["config"], c))
        return out

    def _warm_start(self, measurer: Measurer, tl: TuningLog, states) -> None:
        """Samples from the other workloads of the same template families (transfer), in this job's log and
        in ``transfer_logs``; the best ``transfer_seeds`` configurations of each workload of the transfer
        logs that a task's space contains become that task's seeds (measured first, on the task)."""
        families = {s.task.family for s in states}
        own = {s.task.key for s in states}
        logs = [tl]
        for p in self.options.transfer_logs:
            t = load(p, self.target)
            for msg in t.skipped:
                log.warning("warm start: %s", msg)
            self.warm_info["skipped_lines"] += t.skipped
            logs.append(t)
        by_wk: dict[str, list[dict]] = {}
        from_transfer: set[str] = set()
        workloads: dict[str, dict] = {}
        for i, t in enumerate(logs):
            workloads.update(t.workloads)
            for r in t.measures:
                if record_key(r) not in own and r["template"] in families and median_cost(r) is not None:
                    by_wk.setdefault(record_key(r), []).append(r)
                    if i > 0:
                        from_transfer.add(record_key(r))
        used = set()
        for key, recs in by_wk.items():
            wk = recs[0]["workload_key"]
            if wk not in workloads or len(recs) < 2:
                continue
            func = C.load_json(workloads[wk]["func"])
            task = task_for(func, self.target, workloads[wk].get("workload", {}).get("name", wk),
                            templates=self.templates, bucket=recs[0].get("bucket"))
            if task is None or task.family != recs[0]["template"]:
                continue
            measurer.register(task)
            feats = measurer.features(task, [r["config"] for r in recs])
            for r, f in zip(recs, feats):
                if f.get("ok"):
                    self.warm.append(Sample(key, np.asarray(f["features"]), r["config"], median_cost(r)))
                    used.add(key)
        self.warm_info.update(records=len(self.warm), workloads=len(used))
        if self.options.transfer_seeds > 0:
            for st in states:
                have = set(st.measured) | {config_id(st.task.default_config)}
                for key in sorted(from_transfer):
                    recs = [r for r in by_wk[key] if r["template"] == st.task.family]
                    best: dict[str, dict] = {}
                    for r in sorted(recs, key=median_cost):
                        cid = config_id(r["config"])
                        if cid not in have and cid not in best and st.task.space.contains(r["config"]):
                            best[cid] = r["config"]
                        if len(best) >= self.options.transfer_seeds:
                            break
                    for cid, cfg in best.items():
                        st.seeds.append(dict(cfg))
                        have.add(cid)
                self.warm_info["seeds"] += len(st.seeds)
        if self.warm:
            log.info("warm start: %d records of %d other workloads, %d seed configuration(s)", len(self.warm),
                     len(used), self.warm_info["seeds"])

    def _candidates(self, st: TaskState) -> list[dict]:
        """The task's candidate pool, topped up: a small space whole; a large one keeps its unmeasured
        candidates from earlier rounds and gains the unmeasured neighbours of the best three so far and
        random configurations, ``refresh`` new ones in all (each new one is featurized once)."""
        space, refresh = st.task.space, self.options.refresh
        for cid in [k for k in st.pool if k in st.measured]:
            del st.pool[cid]
        if space.size() <= 4 * refresh:
            return [c for c in space.all_configs() if config_id(c) not in st.measured]
        new: list[dict] = []

        def add(c) -> None:
            k = config_id(c)
            if k not in st.measured and k not in st.pool:
                st.pool[k] = c
                new.append(c)

        ranked = sorted((r for r in st.measured.values() if median_cost(r) is not None), key=median_cost)
        neighbours = [n for r in ranked[:3] for n in space.neighbors(r["config"])]
        self.rng.shuffle(neighbours)
        for n in neighbours[: refresh * 3 // 4]:    # local moves around the best so far
            add(n)
        tries = 0
        while len(new) < refresh and tries < refresh * 20:
            add(space.sample(self.rng))
            tries += 1
        return list(st.pool.values())

    def _pick(self, st: TaskState, measurer: Measurer, n: int) -> list[dict]:
        seeds = [c for c in st.seeds if config_id(c) not in st.measured][:n]
        if seeds:                     # the transfer logs' best configurations go first, alone in their round
            st.seeds = [c for c in st.seeds if config_id(c) not in st.measured and c not in seeds]
            return seeds
        cands = self._candidates(st)
        if not cands:
            return []
        n = min(n, len(cands))
        if not self.model.trained:
            return self.rng.sample(cands, n)
        self._featurize(measurer, st, cands)
        ok = [c for c in cands if st.features[config_id(c)] is not None]
        scores = {}
        if ok:
            pred = self.model.predict([st.features[config_id(c)] for c in ok], ok)
            scores = {config_id(c): float(s) for c, s in zip(ok, pred)}
        # configs whose template application failed rank last; exploration may still pick (and log) them
        ranked = sorted(cands, key=lambda c: -scores.get(config_id(c), -math.inf))
        n_explore = max(1, int(round(self.options.epsilon * n))) if len(cands) > n else 0
        picks = ranked[:n - n_explore]
        rest = ranked[n - n_explore:]
        picks += self.rng.sample(rest, min(n_explore, len(rest)))
        return picks

    def _choose_task(self, states) -> TaskState | None:
        live = [s for s in states if not s.exhausted]
        if not live:
            return None
        fresh = [s for s in live if s.rounds == 0 and len(s.measured) <= 1]
        if fresh:
            return fresh[0]

        def gain(s: TaskState) -> float:
            best, _ = s.best
            if best is None:
                return math.inf          # nothing works yet: keep trying
            h = s.history
            if len(h) < 2:
                recent = 0.0
            elif not math.isfinite(h[-2]):
                recent = 1.0             # its first working configuration came in the last round
            else:
                recent = (h[-2] - h[-1]) / h[-2]
            return s.task.weight * best * (recent + 1.0 / math.sqrt(1 + s.rounds))

        return max(live, key=gain)

    # ------------------------------------------------------------------ the job
    def run(self) -> TuneResult:
        t_start = time.perf_counter()
        opts = self.options
        tl = load(self.log_path, self.target) if self.log_path.exists() else TuningLog()
        states = []
        confirms = tl.latest_confirms()
        for t in self.tasks:
            st = TaskState(t)
            for cid, rec in tl.measured(t.workload_key, t.bucket).items():
                if rec["template"] == t.family:
                    st.measured[cid] = rec
            st.confirm = confirms.get(record_key({"workload_key": t.workload_key, "bucket": t.bucket}))
            states.append(st)
        done = sum(len(s.measured) for s in states)
        resumed = done
        curve: list[tuple[int, float]] = []
        measurer = self.measurer or Measurer(self.target, self.measure_options)
        writer = LogWriter(self.log_path)
        try:
            written = set(tl.workloads)      # the size buckets of one kernel share its workload record
            for s in states:
                if s.task.workload_key not in written:
                    writer.write(make_workload_record(s.task.workload_key, s.task.func, s.task.workload))
                    written.add(s.task.workload_key)
            if done >= opts.trials:
                self.progress({"event": "done", "done": done, "total": opts.trials, "resumed": resumed})
                self._confirm(measurer, writer, states)
                return self._result(states, 0, done, t_start, curve)
            for s in states:
                try:
                    # a size bucket is measured at its own sizes (Task.sizes), not the samples' size
                    measurer.prepare(s.task, self.inputs.get(s.task.workload_key) if s.task.bucket is None
                                     else None)
                except RuntimeError as e:   # no reference output: candidates cannot be checked
                    log.warning("%s: not tuned: %s", s.task.name, e)
                    s.exhausted = True
            states_ok = [s for s in states if not s.exhausted]
            if opts.warm_start:
                self._warm_start(measurer, tl, states)
            for s in states_ok:       # resumed measurements train the model (errors are not rows)
                ok = [r["config"] for r in s.measured.values() if median_cost(r) is not None]
                if ok:
                    self._featurize(measurer, s, ok)
            if self._samples(states):
                self.model.fit(self._samples(states))
            # the default configuration was measured as the reference: log it as the first trial
            for s in states_ok:
                cid = config_id(s.task.default_config)
                if done < opts.trials and cid not in s.measured:
                    self._record(writer, s, s.task.default_config, s.task.reference_costs,
                                 s.task.reference_error if s.task.reference_costs is None else None,
                                 measurer.device_name)
                    done += 1
            self._report(states, done, resumed, t_start, curve)
            while done < opts.trials:
                st = self._choose_task(states)
                if st is None:
                    break
                picks = self._pick(st, measurer, min(opts.batch, opts.trials - done))
                if not picks:
                    st.exhausted = True
                    continue
                for cfg, res in zip(picks, measurer.measure(st.task, picks)):
                    if res.features is not None:
                        st.features.setdefault(config_id(cfg), np.asarray(res.features))
                    self._record(writer, st, cfg, res.costs, res.error, res.device)
                    done += 1
                    self._report(states, done, resumed, t_start, curve)
                st.rounds += 1
                st.history.append(st.best[0] if st.best[0] is not None else math.inf)
                samples = self._samples(states)
                if samples:
                    self.model.fit(samples)
            self._confirm(measurer, writer, states)
        finally:
            writer.close()
            if measurer is not self.measurer:
                measurer.close()
        return self._result(states, done - resumed, done, t_start, curve)

    def _confirm_candidates(self, st: TaskState) -> list[dict]:
        """The configs to re-time for a task: its ``confirm_top`` best (default excluded) and the default;
        [] when there is nothing to confirm (off, the default leads, nothing measured, or the current best
        is a candidate of the key's last confirm record)."""
        o = self.options
        if o.confirm_rounds <= 0:
            return []
        cands = confirm_candidates(st.measured.values(), st.task.default_config, o.confirm_top)
        if not cands:
            return []
        ranked = min((r for r in st.measured.values() if median_cost(r) is not None), key=median_cost)
        return [] if confirmed_choice(ranked, st.confirm) is not None else cands

    def _confirm(self, measurer: Measurer, writer, states) -> None:
        for st in states:
            cands = self._confirm_candidates(st)
            if not cands:
                continue
            try:
                measurer.prepare(st.task, self.inputs.get(st.task.workload_key) if st.task.bucket is None
                                 else None)
            except RuntimeError as e:
                log.warning("%s: not confirmed: %s", st.task.name, e)
                continue
            self.progress({"event": "confirm", "task": st.task.name, "configs": len(cands),
                           "rounds": self.options.confirm_rounds})
            entries, chosen = run_confirm(measurer, st.task, cands, self.options.confirm_rounds)
            if chosen is None:
                log.warning("%s: no configuration ran in the confirm rounds (%s); the search's best stays",
                            st.task.name, "; ".join(f"{e['error']['kind']}: {e['error']['message'][:120]}"
                                                    for e in entries if e["error"]))
                continue
            if len(entries) - sum(1 for e in entries if e["error"]) < 2:
                log.warning("%s: only one configuration ran in the confirm rounds", st.task.name)
            rec = make_confirm_record(target=self.target, workload_key=st.task.workload_key,
                                      workload=st.task.workload, template=st.task.family, candidates=entries,
                                      chosen=chosen, rounds=self.options.confirm_rounds,
                                      device=entries[0]["device"], bucket=st.task.bucket)
            writer.write(rec)
            st.confirm = rec
            log.info("%s: confirm rounds keep %s", st.task.name,
                     "the default" if chosen == st.task.default_config else config_id(chosen))

    def _record(self, writer, st: TaskState, config, costs, error, device) -> None:
        rec = make_measure_record(target=self.target, workload_key=st.task.workload_key,
                                  workload=st.task.workload, template=st.task.family, config=config,
                                  costs=costs, error=error, device=device,
                                  extra={"bucket": st.task.bucket} if st.task.bucket else None)
        writer.write(rec)
        st.measured[config_id(config)] = rec
        if error is not None:
            log.info("%s: %s error for %s: %s", st.task.name, error["kind"], config_id(config),
                     error["message"][:300])

    def _report(self, states, done, resumed, t_start, curve) -> None:
        total = self._weighted_total(states)
        if total is not None:
            curve.append((done, total))
        elapsed = time.perf_counter() - t_start
        ran = done - resumed
        left = self.options.trials - done
        self.progress({"event": "trial", "done": done, "total": self.options.trials, "resumed": resumed,
                       "best_total": total, "elapsed": elapsed,
                       "eta": elapsed / ran * left if ran > 0 else None})

    def _result(self, states, ran, done, t_start, curve) -> TuneResult:
        rows = []
        for s in states:
            best, cfg = s.best
            searched = best
            confirm = None
            ranked = sorted((r for r in s.measured.values() if median_cost(r) is not None), key=median_cost)
            chosen = confirmed_choice(ranked[0], s.confirm) if ranked else None
            if chosen is not None:      # what compiling applies: the confirm's choice, at its re-timed cost
                best, cfg = median_cost(chosen), chosen["config"]
                confirm = {"chosen_is_default": cfg == s.task.default_config,
                           "candidates": [{"config": c["config"], "median": median_cost(c) if c["costs"] else None,
                                           "error": c["error"]} for c in s.confirm["candidates"]],
                           "rounds": s.confirm.get("rounds")}
            default = next((median_cost(r) for r in s.measured.values()
                            if r["config"] == s.task.default_config and median_cost(r) is not None), None)
            if confirm is not None:     # the default beside its re-timed cost, measured in the same rounds
                default = next((c["median"] for c in confirm["candidates"]
                                if c["config"] == s.task.default_config and c["median"] is not None), default)
            errors: dict[str, int] = {}
            for r in s.measured.values():
                if r.get("error"):
                    errors[r["error"]["kind"]] = errors.get(r["error"]["kind"], 0) + 1
            rows.append({"name": s.task.name, "workload_key": s.task.workload_key, "bucket": s.task.bucket,
                         "template": s.task.family,
                         "weight": s.task.weight, "trials": len(s.measured), "errors": errors,
                         "best": best, "default": default, "best_config": cfg,
                         "searched_best": searched, "confirm": confirm,
                         "space_size": s.task.space.size()})
        return TuneResult(rows, ran, done, time.perf_counter() - t_start, curve,
                          {**self.warm_info, "skipped_lines": list(self.warm_info["skipped_lines"])})


def tune(model, target=None, *, trials: int, log_path, tracker: str | None = None, key: str | None = None,
         measure_options: MeasureOptions | None = None, progress=None, templates=None,
         **tune_options) -> TuneResult:
    """Tune every template-matched kernel of ``model`` for ``target``; records go to ``log_path``."""
    from dataclasses import replace

    from ..target import parse_target
    from .tasks import extract_tasks

    target = parse_target(target)
    tasks = extract_tasks(model, target, templates=templates)
    mo = measure_options or MeasureOptions()
    if tracker:
        mo = replace(mo, tracker=tracker, key=key)
    return Tuner(tasks, target, log_path, TuneOptions(trials=trials, **tune_options), mo, progress,
                 templates=templates).run()
