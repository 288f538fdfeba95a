"""Decisions made by the passes, recorded so the user can see them.

Passes call ``record_refusal`` / ``record_schedule``; each call logs one line on the ``tvmfuse.fusion``
or ``tvmfuse.schedule`` logger and, inside a ``Recorder`` context, is kept for the report.
"""
from __future__ import annotations

import logging
import threading

fusion_log = logging.getLogger("tvmfuse.fusion")
schedule_log = logging.getLogger("tvmfuse.schedule")

_local = threading.local()


def _recorders() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


class Recorder:
    """Collects the refusals, groups and schedule choices made while it is active (nests)."""

    def __init__(self):
        self.refused: list[dict] = []
        self.schedules: list[dict] = []
        self.groups: list[dict] = []

    def __enter__(self) -> "Recorder":
        _recorders().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _recorders().remove(self)


def record_refusal(producer: str, consumer: str, reason: str, rule: str = "") -> None:
    """A fusion that was considered and not done, with the reason a user can act on."""
    entry = {"producer": producer, "consumer": consumer, "reason": reason, "rule": rule}
    fusion_log.info("refused %s -> %s%s: %s", producer, consumer, f" ({rule})" if rule else "", reason)
    for r in _recorders():
        r.refused.append(entry)


def record_group(kernel: str, ops: list[str], rule: str, outputs: int = 1, template: str = "",
                 declined: str = "") -> None:
    """A fusion group formed by a pass: its kernel's name, its ops (in order), the rule(s), its outputs,
    and the template family that accepted it (empty where the target's families gate no fusion); a group
    no family accepted that the CPU generic schedule takes: why the rule's family declined (``declined``)."""
    fusion_log.debug("group %s: %s [%s]%s", kernel, " + ".join(ops), rule, f" -> {template}" if template else "")
    entry = {"kernel": kernel, "ops": list(ops), "rule": rule, "outputs": int(outputs)}
    if template:
        entry["template"] = template
    if declined:
        entry["declined"] = declined
    for r in _recorders():
        r.groups.append(entry)


def retract_groups(kernels: set[str]) -> None:
    """Forget recorded groups that were not built after all (TVM failed on the module; it stays unfused)."""
    for r in _recorders():
        r.groups = [g for g in r.groups if g["kernel"] not in kernels]


def record_schedule(kernel: str, template: str, source: str, knobs: dict | None = None,
                    reason: str = "") -> None:
    """Which template scheduled a kernel, from where (tuned record / target default / fallback), why."""
    entry = {"kernel": kernel, "template": template, "source": source, "knobs": dict(knobs or {})}
    if reason:
        entry["reason"] = reason
    schedule_log.info("%s: %s (%s)%s", kernel, template, source, f": {reason}" if reason else "")
    for r in _recorders():
        r.schedules.append(entry)
