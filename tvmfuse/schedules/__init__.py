"""Schedule templates for fused PrimFuncs, one family per file, one folder per target family
(``cpu/`` for llvm targets, ``cuda/`` for NVIDIA GPUs), and the pass that applies them."""
from __future__ import annotations

import logging

from .. import _compat as C
from ..explain import record_schedule
from ..target import is_gpu
from .base import Scheduled, find_template, schedule_with, target_key, workload_key

log = logging.getLogger("tvmfuse.schedule")


def templates_for(target: C.Target) -> list:
    """The ordered template list of the target's family (first match wins)."""
    if is_gpu(target):
        from .cuda import TEMPLATES
    else:
        from .cpu import TEMPLATES
    return list(TEMPLATES)


def schedule_prim_func(func: C.PrimFunc, target: C.Target, records: dict | None = None,
                       name: str = "") -> Scheduled | None:
    """Schedule one PrimFunc: its tuned record if any, else its template's target default.

    Returns None when no template matches (the caller applies the safe fallback and says so).
    """
    found = find_template(func, target, templates_for(target))
    if found is None:
        return None
    template, match = found
    key = workload_key(func)
    rec = (records or {}).get(key)
    if rec is not None and rec.get("template") == template.family and \
            not template.space(match, target).contains(rec["config"]):
        # a record from an older knob space of this template (knobs added or choices changed)
        log.info("%s: tuned record for %s is outside the template's current knob space; using the "
                 "default", name, key)
        rec = None
    if rec is not None and rec.get("template") == template.family:
        try:
            return Scheduled(schedule_with(template, match, func, rec["config"]), template.family,
                             rec["config"], "tuned")
        except Exception as e:  # a record from another version of the template: fall back to default
            log.warning("%s: tuned record for %s does not apply (%s); using the default", name, key, e)
    config = template.default_config(match, target)
    return Scheduled(schedule_with(template, match, func, config), template.family, config, "default")


def _load_records(options, target: C.Target) -> dict:
    """Best tuning record per workload for this target from ``options.tuning_log``: none when it is None
    (untuned target defaults), the shipped records when it is ``"shipped"``, else the records of that log."""
    if options.tuning_log is None:
        return {}
    try:
        from ..tune.log import best_configs
    except ModuleNotFoundError as e:
        if e.name != "tvmfuse.tune.log":
            raise
        return {}
    return best_configs(options.tuning_log, target)


def _dlight_rules(target: C.Target) -> list:
    dl = C.dlight
    if is_gpu(target):
        return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
    return [dl.cpu.GEMV(), dl.cpu.Reduction()]


def fallback_passes(target: C.Target) -> list:
    """What a PrimFunc no template scheduled gets: dlight's generic rules, one function at a time.

    dlight's CPU Reduction rule raises on some kernels (e.g. a reduction block with several outputs);
    on CPU such a kernel then stays unscheduled (correct, naive loops) and the reason is recorded. A GPU
    kernel must have thread bindings, so there a failure is an error that names the kernel.
    """
    rules = _dlight_rules(target)

    @C.module_pass(opt_level=0, name="tvmfuse.fallback_schedules")
    def _fallback(mod, _ctx):
        updates = {}
        for gv, func in mod.functions.items():
            if not isinstance(func, C.PrimFunc) or (func.attrs is not None and "tirx.is_scheduled" in func.attrs):
                continue
            single = C.IRModule({gv: func})
            try:
                updates[gv] = C.dlight.ApplyDefaultSchedule(*rules)(single)[gv]
            except Exception as e:  # dlight raises ScheduleError/TVMError on kernels its rules misjudge
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                if is_gpu(target):
                    raise RuntimeError(f"kernel {gv.name_hint}: no template matched and dlight's fallback "
                                       f"failed: {first}") from e
                log.warning("%s: dlight fallback failed (%s); left unscheduled", gv.name_hint, first)
                record_schedule(str(gv.name_hint), "unscheduled", "fallback",
                                reason=f"dlight fallback failed: {first}")
        if updates:
            mod = mod.clone()   # a pass returns a new module: the caller's stays unscheduled
        for gv, func in updates.items():
            mod[gv] = func
        return mod

    return [_fallback]


def apply_schedules(target: C.Target, options) -> C.ir_transform.Pass:
    """A named pass: schedule every PrimFunc of the module (tuned record > default > fallback)."""

    @C.module_pass(opt_level=0, name="tvmfuse.apply_schedules")
    def _apply(mod, _ctx):
        records = _load_records(options, target)
        updates = {}
        for gv, func in mod.functions.items():
            if not isinstance(func, C.PrimFunc):
                continue
            if func.attrs is not None and "tirx.is_scheduled" in func.attrs:
                continue
            name = str(gv.name_hint)
            try:
                res = schedule_prim_func(func, target, records, name)
            except Exception as e:  # a template that breaks on a match is a bug: say so, stay correct
                log.warning("%s: template failed (%s: %s); using the fallback schedule", name,
                            type(e).__name__, e)
                record_schedule(name, "fallback", "fallback", reason=f"template error: {e}")
                continue
            if res is None:
                record_schedule(name, "fallback", "fallback", reason="no template matches this kernel")
                continue
            updates[gv] = res.func.with_attr("tirx.is_scheduled", True)
            record_schedule(name, res.template, res.source, res.config)
        if updates:
            mod = mod.clone()   # a pass returns a new module: the caller's stays unscheduled
        for gv, func in updates.items():
            mod[gv] = func
        return mod

    return _apply


def schedule_passes(target: C.Target, options) -> list:
    """Passes that schedule every PrimFunc of the module for ``target``, then (CPU, ``options.fast_math``)
    rewrite exp/erf/tanh/sigmoid into vectorizable arithmetic (tvmfuse.fastmath)."""
    fast = []
    if getattr(options, "fast_math", False) and not is_gpu(target):
        from ..fastmath import fast_math_pass

        fast = [fast_math_pass(target)]
    if not options.schedules:
        return (fallback_passes(target) if is_gpu(target) else []) + fast
    return [apply_schedules(target, options)] + fallback_passes(target) + fast
