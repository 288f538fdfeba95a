"""Tuning logs: JSON lines, one record per measurement, appended and fsync'ed per record.

Two kinds of line (field ``type``):

- ``"measure"``: one measurement of one configuration of one workload on one target::

    {"type": "measure", "v": 1, "tvmfuse": "0.1.0", "tvm": "0.27.0.post1",
     "target_key": "llvm,mcpu=znver3,...", "target": {...full target...},
     "workload_key": "3f0c...", "workload": {"name": "fused_matmul_add", "params": [[shape, dtype], ...]},
     "template": "matmul_epilogue", "config": {...knobs...},
     "costs": [seconds, ...] | null, "error": null | {"kind": "build|run|crash|timeout|wrong_result", "message": "..."},
     "device": "local" | "rpc:KEY@HOST:PORT", "time": unix seconds}

- ``"workload"``: the PrimFunc of a workload (``tvm.ir.save_json``), written once before its first
  measurement, so that the cost model can featurize the records of other workloads (warm start, transfer)
  and a workload can be re-tuned without its model.  Target independent.

A line that does not parse (a job killed mid-write, a hand edit) is skipped with a warning naming the file
and the line number; the rest of the file loads.  Records of other targets are ignored unless asked for.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from .. import _compat as C
from ..errors import TuningLogError

log = logging.getLogger("tvmfuse.tune")

LOG_VERSION = 1
ERROR_KINDS = ("build", "run", "crash", "timeout", "wrong_result", "rpc")


def _tvmfuse_version() -> str:
    from .. import __version__

    return __version__


def median_cost(rec: dict) -> float | None:
    """The cost of a successful measure record (median of its repeats), None for an error record."""
    costs = rec.get("costs")
    if rec.get("error") is not None or not costs:
        return None
    return float(statistics.median(costs))


def config_id(config: dict) -> str:
    """Canonical text of a configuration: the key that says 'this config was measured already'."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def make_measure_record(*, target, workload_key: str, workload: dict, template: str, config: dict,
                        costs: list[float] | None = None, error: dict | None = None,
                        device: str = "local", extra: dict | None = None) -> dict:
    """A measure record; exactly one of ``costs`` / ``error`` (``{"kind", "message"}``) is given."""
    from ..schedules.base import target_key

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


@dataclass
class TuningLog:
    """The records of one or more log files (measure records filtered by target unless asked)."""

    measures: list[dict] = field(default_factory=list)
    workloads: dict[str, dict] = field(default_factory=dict)   # workload_key -> workload record
    skipped: list[str] = field(default_factory=list)           # "file:line: reason" of unreadable lines
    other_targets: int = 0                                     # measure records ignored (other target)
    other_tvm: int = 0                                         # ignored: made with another TVM version

    def measured(self, workload_key: str) -> dict[str, dict]:
        """config_id -> record of every configuration already measured for a workload."""
        return {config_id(r["config"]): r for r in self.measures if r["workload_key"] == workload_key}

    def best(self) -> dict[str, dict]:
        """workload_key -> the successful record of least median cost."""
        out: dict[str, dict] = {}
        for r in self.measures:
            c = median_cost(r)
            if c is None:
                continue
            cur = out.get(r["workload_key"])
            if cur is None or c < median_cost(cur):
                out[r["workload_key"]] = r
        return out


def _check_record(rec) -> str | None:
    """None when ``rec`` is a well-formed record, else the reason it is not."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    kind = rec.get("type")
    if kind == "workload":
        missing = [k for k in ("workload_key", "func") if k not in rec]
    elif kind == "measure":
        missing = [k for k in ("target_key", "workload_key", "template", "config") if k not in rec]
        if not missing:
            if not isinstance(rec["config"], dict):
                return "config is not an object"
            if rec.get("error") is None and not (isinstance(rec.get("costs"), list) and rec["costs"]
                                                 and all(isinstance(c, (int, float)) for c in rec["costs"])):
                return "neither costs nor an error"
    else:
        return f"unknown record type {kind!r}"
    return f"missing field(s) {missing}" if missing else None


def read_records(path: str | os.PathLike, skipped: list[str] | None = None) -> Iterable[dict]:
    """Every well-formed record of one file, in order; bad lines are skipped with a warning."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise TuningLogError(f"cannot read tuning log {path}: {e}") from None
    with f:
        for lineno, raw in enumerate(f, start=1):
            text = raw.strip()
            if not text:
                continue
            try:
                rec = json.loads(text.decode("utf-8"))
                reason = _check_record(rec)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                reason = f"not valid JSON ({e})"
            if reason is not None:
                msg = f"{path}:{lineno}: skipped corrupt tuning-log line: {reason}"
                log.warning(msg)
                if skipped is not None:
                    skipped.append(msg)
                continue
            yield rec


def load(paths, target=None, *, all_targets: bool = False, check_tvm: bool = False) -> TuningLog:
    """Load one or more logs; measure records of other targets than ``target`` are dropped unless
    ``all_targets``; with ``check_tvm``, measure records made with another TVM version are dropped too,
    with one warning per file (a config measured on another TVM may not apply, or not be the best).
    A missing file is an error (``TuningLogError``)."""
    from ..schedules.base import target_key

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    tkey = target_key(target) if target is not None else None
    out = TuningLog()
    for p in paths:
        versions: dict[str, int] = {}
        for rec in read_records(p, out.skipped):
            if rec["type"] == "workload":
                out.workloads.setdefault(rec["workload_key"], rec)
            elif check_tvm and rec.get("tvm") != C.TVM_VERSION:
                versions[str(rec.get("tvm"))] = versions.get(str(rec.get("tvm")), 0) + 1
            elif all_targets or tkey is None or rec["target_key"] == tkey:
                out.measures.append(rec)
            else:
                out.other_targets += 1
        if versions:
            n = sum(versions.values())
            out.other_tvm += n
            log.warning("%s: skipped %d tuning record(s) made with another TVM version (%s; this is %s)",
                        p, n, ", ".join(f"{v}: {c}" for v, c in sorted(versions.items())), C.TVM_VERSION)
    return out


# --------------------------------------------------------------------------- shipped records
def shipped_log_dirs() -> list[Path]:
    """Where the shipped records live: ``tuning_logs/`` of a source checkout (editable install), or the
    data directory a wheel installs them to (``[tool.setuptools.data-files]`` in pyproject.toml)."""
    from ..target import data_dirs

    return data_dirs("tuning_logs")


SHIPPED = "shipped"   # tuning_log value (and ``--tuning-log shipped``) that applies the shipped records


def shipped_logs() -> list[Path]:
    return [p for d in shipped_log_dirs() for p in sorted(d.glob("*.jsonl"))]


def best_configs(tuning_log, target) -> dict[str, dict]:
    """``{workload_key: {"template": family, "config": {...}, "cost": s, "source": file}}`` for ``target``.

    ``tuning_log``: None (no records: every kernel gets its template's untuned target default),
    ``"shipped"`` (:data:`SHIPPED`: the records shipped in ``tuning_logs/``, applied only when asked for),
    or the path of a log.  Records of another target or another TVM version are not applied.
    Used by the schedule pass (``tvmfuse.schedules._load_records``).
    """
    if tuning_log is None:
        return {}
    if str(tuning_log) == SHIPPED:
        sources = [(p, "shipped") for p in shipped_logs()]
        if not sources:
            raise TuningLogError(f"tuning_log={SHIPPED!r}, but no shipped tuning records are installed "
                                 f"(looked for tuning_logs/*.jsonl in {[str(d) for d in shipped_log_dirs()]})")
    else:
        if not Path(tuning_log).exists():
            raise TuningLogError(f"tuning log not found: {tuning_log}")
        sources = [(Path(tuning_log), "user")]
    out: dict[str, dict] = {}
    for path, kind in sources:
        for wk, rec in load(path, target, check_tvm=True).best().items():
            out[wk] = {"template": rec["template"], "config": rec["config"], "cost": median_cost(rec),
                       "source": f"{kind}:{path}"}
    return out


# --------------------------------------------------------------------------- merge / best / show
def merge(paths, out_path, *, best_only: bool = False) -> dict:
    """Write the records of ``paths`` to ``out_path`` (all targets), without exact duplicates;
    ``best_only`` keeps one record per (workload, target): the fastest.  Returns counts."""
    tl = TuningLog()
    for p in paths:
        for rec in read_records(p, tl.skipped):
            if rec["type"] == "workload":
                tl.workloads.setdefault(rec["workload_key"], rec)
            else:
                tl.measures.append(rec)
    measures = tl.measures
    if best_only:
        best: dict[tuple, dict] = {}
        for r in measures:
            c = median_cost(r)
            if c is None:
                continue
            k = (r["workload_key"], r["target_key"])
            if k not in best or c < median_cost(best[k]):
                best[k] = r
        measures = list(best.values())
    seen, kept = set(), []
    for r in measures:
        k = (r["workload_key"], r["target_key"], config_id(r["config"]), json.dumps(r.get("costs")),
             json.dumps(r.get("error"), sort_keys=True), r.get("time"))
        if k not in seen:
            seen.add(k)
            kept.append(r)
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
    return {"records": len(kept), "workloads": len(used), "skipped_lines": len(tl.skipped)}


def summary(paths, target=None, *, all_targets: bool = True) -> list[dict]:
    """One row per (target, workload): name, template, trials, errors by kind, best cost and its knobs."""
    tl = load(paths, target, all_targets=all_targets)
    rows: dict[tuple, dict] = {}
    for r in tl.measures:
        k = (r["target_key"], r["workload_key"])
        row = rows.setdefault(k, {"target_key": k[0], "workload_key": k[1],
                                  "name": (r.get("workload") or {}).get("name", ""),
                                  "template": r["template"], "trials": 0, "errors": {}, "best": None,
                                  "best_config": None})
        row["trials"] += 1
        c = median_cost(r)
        if c is None:
            kind = (r.get("error") or {}).get("kind", "?")
            row["errors"][kind] = row["errors"].get(kind, 0) + 1
        elif row["best"] is None or c < row["best"]:
            row["best"], row["best_config"] = c, r["config"]
    return sorted(rows.values(), key=lambda r: (r["target_key"], r["name"], r["workload_key"]))
