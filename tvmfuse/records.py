"""Tuning records, read side: keys of a workload and a target, reading JSON-lines logs (ours and the shipped
ones), the best configuration per workload.  The schedules read records through here; the tuner
(``tvmfuse.tune.log``) writes them and re-exports these names.  The record format is described in
``tvmfuse/tune/log.py``.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from . import _compat as C
from .errors import TuningLogError

log = logging.getLogger("tvmfuse.tune")


def workload_key(func: C.PrimFunc) -> str:
    """Stable key of a PrimFunc's computation: its structural hash, without its name attributes."""
    f = func
    if f.attrs is not None and "global_symbol" in f.attrs:
        f = f.without_attr("global_symbol")
    return format(int(C.structural_hash(f)) & ((1 << 64) - 1), "016x")


def target_key(target: C.Target) -> str:
    """The part of a target that decides whether a tuning record applies: kind, cpu/arch, features."""
    kind = target.kind.name
    parts = [kind]
    for attr in ("mcpu", "arch", "mtriple"):
        if attr in target.attrs:
            parts.append(f"{attr}={target.attrs[attr]}")
    return ",".join(parts)


def bucket_key(workload_key: str, bucket: str | None = None) -> str:
    """The key a record applies under: the workload's, and for one size bucket of a kernel that dispatches
    on a symbolic extent (``schedules.buckets``), the bucket's name after an ``@`` (``<hash>@rows<=16``)."""
    return f"{workload_key}@{bucket}" if bucket else workload_key


def record_key(rec: dict) -> str:
    """``bucket_key`` of a measure record (its optional ``bucket`` field)."""
    return bucket_key(rec["workload_key"], rec.get("bucket"))


def median_cost(rec: dict) -> float | None:
    """The cost of a successful measure record (median of its repeats), None for an error record."""
    costs = rec.get("costs")
    if rec.get("error") is not None or not costs:
        return None
    return float(statistics.median(costs))


def config_id(config: dict) -> str:
    """Canonical text of a configuration: the key that says 'this config was measured already'."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


@dataclass
class TuningLog:
    """The records of one or more log files (measure records filtered by target unless asked)."""

    measures: list[dict] = field(default_factory=list)
    workloads: dict[str, dict] = field(default_factory=dict)   # workload_key -> workload record
    confirms: list[dict] = field(default_factory=list)         # confirm records (filtered like measures)
    skipped: list[str] = field(default_factory=list)           # "file:line: reason" of unreadable lines
    other_targets: int = 0                                     # measure records ignored (other target)
    other_tvm: int = 0                                         # ignored: made with another TVM version

    def measured(self, workload_key: str, bucket: str | None = None) -> dict[str, dict]:
        """config_id -> record of every configuration already measured for a workload (and size bucket)."""
        key = bucket_key(workload_key, bucket)
        return {config_id(r["config"]): r for r in self.measures if record_key(r) == key}

    def latest_confirms(self) -> dict[str, dict]:
        """``record_key`` -> the last confirm record of that key (in file order)."""
        return {record_key(c): c for c in self.confirms}

    def best(self) -> dict[str, dict]:
        """``record_key`` (workload key, ``@bucket`` for a size bucket) -> the record to apply: the successful
        record of least median cost, or, where the key's last confirm record re-timed that configuration
        against its runners-up and the default, the confirm's choice (``confirmed_choice``)."""
        return {key: applied for (_, key), (_, applied, _) in
                applied_records(self.measures, self.confirms).items()}


def applied_records(measures, confirms) -> dict[tuple, tuple]:
    """``(target_key, record_key)`` -> ``(searched, applied, confirm)``: the successful measure record of least
    median cost, the record that applies (the last covering confirm record's choice, else ``searched``), and
    that confirm record (None when none applies).  The one place that decides which record a log applies
    (``TuningLog.best``, ``tune.log.summary``, ``tune.log.merge(best_only=True)``)."""
    searched: dict[tuple, dict] = {}
    for r in measures:
        c = median_cost(r)
        k = (r["target_key"], record_key(r))
        if c is not None and (k not in searched or c < median_cost(searched[k])):
            searched[k] = r
    last = {(c["target_key"], record_key(c)): c for c in confirms}
    out = {}
    for k, r in searched.items():
        chosen = confirmed_choice(r, last.get(k))
        out[k] = (r, chosen, last[k]) if chosen is not None else (r, r, None)
    return out


def confirm_candidate(confirm: dict, config: dict) -> dict | None:
    """The candidate entry of ``config`` in a confirm record, or None."""
    cid = config_id(config)
    return next((c for c in confirm["candidates"] if config_id(c["config"]) == cid), None)


def confirmed_choice(best: dict | None, confirm: dict | None) -> dict | None:
    """The record that a confirm record picks for its key, as a measure record whose costs are the
    confirm's per-round medians (``"confirmed": true``); None when it does not apply: no confirm, or the
    search's best (``best``) is not among its candidates (a later search found a new best; it is applied
    as measured until a new confirm covers it), or another template family."""
    if best is None or confirm is None or confirm["template"] != best["template"]:
        return None
    if confirm_candidate(confirm, best["config"]) is None:
        return None
    ch = confirm_candidate(confirm, confirm["chosen"])
    rec = {"type": "measure", "v": confirm.get("v"), "tvmfuse": confirm.get("tvmfuse"), "tvm": confirm.get("tvm"),
           "target_key": confirm["target_key"], "target": confirm.get("target"),
           "workload_key": confirm["workload_key"], "workload": confirm.get("workload"),
           "template": confirm["template"], "config": ch["config"], "costs": list(ch["costs"]), "error": None,
           "device": confirm.get("device", "local"), "time": confirm.get("time"), "confirmed": True}
    if confirm.get("bucket"):
        rec["bucket"] = confirm["bucket"]
    return rec


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
            if rec.get("bucket") is not None and not (isinstance(rec["bucket"], str) and rec["bucket"]):
                return "bucket is not a non-empty string"
            if rec.get("error") is None and not (isinstance(rec.get("costs"), list) and rec["costs"]
                                                 and all(isinstance(c, (int, float)) for c in rec["costs"])):
                return "neither costs nor an error"
    elif kind == "confirm":
        missing = [k for k in ("target_key", "workload_key", "template", "candidates", "chosen") if k not in rec]
        if not missing:
            return check_confirm(rec)
    else:
        return f"unknown record type {kind!r}"
    return f"missing field(s) {missing}" if missing else None


def check_confirm(rec: dict) -> str | None:
    """None when a confirm record's candidates and choice are well formed, else the reason they are not."""
    cands = rec["candidates"]
    if not isinstance(cands, list) or len(cands) < 2:
        return "candidates is not a list of at least two entries"
    for c in cands:
        if not isinstance(c, dict) or not isinstance(c.get("config"), dict):
            return "a candidate without a config object"
        ok = isinstance(c.get("costs"), list) and c["costs"] and all(isinstance(x, (int, float)) for x in c["costs"])
        if ok == (c.get("error") is not None):
            return "a candidate needs either costs or an error"
    if rec.get("bucket") is not None and not (isinstance(rec["bucket"], str) and rec["bucket"]):
        return "bucket is not a non-empty string"
    if not isinstance(rec["chosen"], dict):
        return "chosen is not a config object"
    ch = confirm_candidate(rec, rec["chosen"])
    if ch is None or ch.get("error") is not None:
        return "chosen is not a candidate with costs"
    return None


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
                (out.confirms if rec["type"] == "confirm" else out.measures).append(rec)
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
    from .target import data_dirs

    return data_dirs("tuning_logs")


SHIPPED = "shipped"   # tuning_log value (and ``--tuning-log shipped``) that applies the shipped records
TUNING_LOG_HELP = ("tuning records to apply: a tuning log (JSON lines), or 'shipped' for the records shipped "
                   "in tuning_logs/ (default: none, every kernel gets its untuned default for the target)")



def shipped_logs() -> list[Path]:
    return [p for d in shipped_log_dirs() for p in sorted(d.glob("*.jsonl"))]


def best_configs(tuning_log, target) -> dict[str, dict]:
    """``{record_key: {"template": family, "config": {...}, "cost": s, "source": file}}`` for ``target``.

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
