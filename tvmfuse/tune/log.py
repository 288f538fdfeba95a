"""Tuning logs: JSON lines, one record per measurement, appended and fsync'ed per record.

Two kinds of line (field ``type``):

- ``"measure"``: one measurement of one configuration of one workload on one target::

    {"type": "measure", "v": 1, "tvmfuse": "0.1.0", "tvm": "0.27.0.post1",
     "target_key": "llvm,mcpu=znver3,...", "target": {...full target...},
     "workload_key": "3f0c...", "workload": {"name": "fused_matmul_add", "params": [[shape, dtype], ...]},
     "template": "matmul_epilogue", "config": {...knobs...},
     "costs": [seconds, ...] | null, "error": null | {"kind": "build|run|crash|timeout|wrong_result", "message": "..."},
     "device": "local" | "rpc:KEY@HOST:PORT", "time": unix seconds}

  A kernel with size buckets (``schedules.buckets``) adds ``"bucket": "rows<=16"``: the record applies to
  that bucket's nest only (``records.bucket_key``: ``<workload_key>@<bucket>``).

- ``"confirm"``: the search's best configurations of one workload (bucket) re-timed against each other and
  the default, built once and run in interleaved rounds (A B C A B C ...), at the end of a tuning job::

    {"type": "confirm", "v": 1, ..., "target_key": ..., "workload_key": ..., "template": ...,
     "candidates": [{"config": {...}, "costs": [round median, ...] | null, "error": null | {...}}, ...],
     "chosen": {...the default, or a candidate faster in every round...}, "rounds": 3, "device": ..., "time": ...}

  The search ranks thousands of single measurements and its best is often the luckiest, not the fastest;
  the confirm's choice is what ``best_configs`` applies while the search's best is among its candidates
  (``records.confirmed_choice``).

- ``"workload"``: the PrimFunc of a workload (``tvm.ir.save_json``), written once before its first
  measurement, so that the cost model can featurize the records of other workloads (warm start, transfer)
  and a workload can be re-tuned without its model.  Target independent.

A line that does not parse (a job killed mid-write, a hand edit) is skipped with a warning naming the file
and the line number; the rest of the file loads.  Records of other targets are ignored unless asked for.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .. import _compat as C
from ..errors import TuningLogError
from ..records import (TuningLog, applied_records, best_configs, check_confirm, config_id,  # noqa: F401
                       confirmed_choice, load, median_cost, read_records, record_key, shipped_log_dirs,
                       shipped_logs, target_key, SHIPPED)

LOG_VERSION = 1
ERROR_KINDS = ("build", "run", "crash", "timeout", "wrong_result", "rpc")


def _tvmfuse_version() -> str:
    from ..version import __version__

    return __version__


def make_measure_record(*, target, workload_key: str, workload: dict, template: str, config: dict,
                        costs: list[float] | None = None, error: dict | None = None,
                        device: str = "local", extra: dict | None = None) -> dict:
    """A measure record; exactly one of ``costs`` / ``error`` (``{"kind", "message"}``) is given."""
    if (costs is None) == (error is None):
        raise ValueError("a measure record has either costs or an error, not both or neither")
    if error is not None and error.get("kind") not in ERROR_KINDS:
        raise ValueError(f"unknown error kind {error.get('kind')!r}; expected one of {ERROR_KINDS}")
    rec = {
        "type": "measure", "v": LOG_VERSION, "tvmfuse": _tvmfuse_version(), "tvm": C.TVM_VERSION,
        "target_key": target_key(target), "target": json.loads(str(target)),
        "workload_key": workload_key, "workload": workload, "template": template,
        "config": config, "costs": [float(c) for c in costs] if costs is not None else None,
        "error": error, "device": device, "time": round(time.time(), 3),
    }
    if extra:
        rec.update(extra)
    return rec


def make_confirm_record(*, target, workload_key: str, workload: dict, template: str, candidates: list[dict],
                        chosen: dict, rounds: int, device: str = "local", bucket: str | None = None) -> dict:
    """A confirm record; ``candidates``: ``{"config", "costs" | "error"}`` each, ``chosen`` one of their
    configs with costs."""
    rec = {
        "type": "confirm", "v": LOG_VERSION, "tvmfuse": _tvmfuse_version(), "tvm": C.TVM_VERSION,
        "target_key": target_key(target), "target": json.loads(str(target)),
        "workload_key": workload_key, "workload": workload, "template": template,
        "candidates": [{"config": c["config"],
                        "costs": [float(x) for x in c["costs"]] if c.get("costs") is not None else None,
                        "error": c.get("error")} for c in candidates],
        "chosen": chosen, "rounds": int(rounds), "device": device, "time": round(time.time(), 3),
    }
    if bucket:
        rec["bucket"] = bucket
    reason = check_confirm(rec)
    if reason is not None:
        raise ValueError(f"malformed confirm record: {reason}")
    return rec


def make_workload_record(workload_key: str, func, workload: dict) -> dict:
    return {"type": "workload", "v": LOG_VERSION, "tvmfuse": _tvmfuse_version(), "tvm": C.TVM_VERSION,
            "workload_key": workload_key, "workload": workload, "func": C.save_json(func)}


class LogWriter:
    """Appends records to a JSONL file; each record is one ``write`` followed by ``fsync``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if self.path.parent and not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise TuningLogError(f"cannot open tuning log {self.path} for writing: {e}") from None
        # A job killed mid-write leaves a line without its newline: start on a fresh line.
        size = os.fstat(self._fd).st_size
        if size:
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    os.write(self._fd, b"\n")

    def write(self, record: dict) -> None:
        line = json.dumps(record, sort_keys=False, separators=(",", ":")) + "\n"
        os.write(self._fd, line.encode())
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "LogWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- merge / best / show
def merge(paths, out_path, *, best_only: bool = False) -> dict:
    """Write the records of ``paths`` to ``out_path`` (all targets), without exact duplicates;
    ``best_only`` keeps one record per (workload, target): the fastest.  Returns counts."""
    tl = TuningLog()
    for p in paths:
        for rec in read_records(p, tl.skipped):
            if rec["type"] == "workload":
                tl.workloads.setdefault(rec["workload_key"], rec)
            elif rec["type"] == "confirm":
                tl.confirms.append(rec)
            else:
                tl.measures.append(rec)
    measures, confirms = tl.measures, tl.confirms
    if best_only:
        # per (target, record key): the search's best, and where a confirm covers it, the confirm and the
        # measure record of its choice, so that the pruned log applies the same configuration
        measures, confirms = [], []
        for searched, applied, confirm in applied_records(tl.measures, tl.confirms).values():
            measures.append(searched)
            if confirm is not None:
                confirms.append(confirm)
                k, cid = (searched["target_key"], record_key(searched)), config_id(applied["config"])
                measures += [m for m in tl.measures if (m["target_key"], record_key(m)) == k
                             and config_id(m["config"]) == cid and median_cost(m) is not None][:1]
    seen, kept = set(), []
    for r in measures:
        k = (record_key(r), r["target_key"], config_id(r["config"]), json.dumps(r.get("costs")),
             json.dumps(r.get("error"), sort_keys=True), r.get("time"))
        if k not in seen:
            seen.add(k)
            kept.append(r)
    for c in confirms:
        k = ("confirm", json.dumps(c, sort_keys=True))
        if k not in seen:
            seen.add(k)
            kept.append(c)
    used = {r["workload_key"] for r in kept}
    out_path = Path(out_path)
    if out_path.exists() and any(out_path.resolve() == Path(p).resolve() for p in paths):
        raise TuningLogError(f"output {out_path} is one of the inputs; write to a new file")
    tmp = out_path.with_name(out_path.name + ".tmp")
    with LogWriter(tmp) as w:
        for wk in sorted(used):
            if wk in tl.workloads:
                w.write(tl.workloads[wk])
        for r in kept:
            w.write(r)
    os.replace(tmp, out_path)
    return {"records": len(kept), "workloads": len(used), "skipped_lines": len(tl.skipped),
            "confirms": sum(1 for r in kept if r["type"] == "confirm")}


def summary(paths, target=None, *, all_targets: bool = True) -> list[dict]:
    """One row per (target, workload and size bucket): name, template, trials, errors by kind, and the
    record that compiling applies: its cost and knobs (``confirmed``: chosen by a confirm record)."""
    tl = load(paths, target, all_targets=all_targets)
    rows: dict[tuple, dict] = {}
    for r in tl.measures:
        k = (r["target_key"], record_key(r))
        row = rows.setdefault(k, {"target_key": k[0], "workload_key": r["workload_key"],
                                  "bucket": r.get("bucket"),
                                  "name": (r.get("workload") or {}).get("name", ""),
                                  "template": r["template"], "trials": 0, "errors": {}, "best": None,
                                  "best_config": None, "confirmed": False})
        row["trials"] += 1
        if median_cost(r) is None:
            kind = (r.get("error") or {}).get("kind", "?")
            row["errors"][kind] = row["errors"].get(kind, 0) + 1
    for k, (_, applied, confirm) in applied_records(tl.measures, tl.confirms).items():
        rows[k].update(best=median_cost(applied), best_config=applied["config"], confirmed=confirm is not None)
    return sorted(rows.values(), key=lambda r: (r["target_key"], r["name"], r["workload_key"], r["bucket"] or ""))
