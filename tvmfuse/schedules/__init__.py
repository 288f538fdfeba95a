"""Schedule templates for fused PrimFuncs, one family per file, one folder per target family
(``cpu/`` for llvm targets, ``cuda/`` for NVIDIA GPUs), and the pass that applies them."""
from __future__ import annotations

import logging
from dataclasses import replace

from .. import _compat as C
from ..explain import record_schedule
from ..records import best_configs, bucket_key, workload_key
from ..target import is_gpu
from .base import Scheduled, Template, find_template, schedule_with
from .buckets import join_buckets, join_unit, unit_nest, value_at

log = logging.getLogger("tvmfuse.schedule")


def templates_for(target: C.Target) -> list:
    """The ordered template list of the target's family (first match wins)."""
    if is_gpu(target):
        from .cuda import TEMPLATES
    else:
        from .cpu import TEMPLATES
    return list(TEMPLATES)


def declares_accepts(template: Template) -> bool:
    """Whether a family answers ``accepts`` (one that does not is never asked)."""
    return type(template).accepts is not Template.accepts


def accepting_template(group, target: C.Target, prefer: str = "") -> tuple[str | None, str | None]:
    """Which template family of the target will schedule a graph-level group (``analysis.GroupInfo``):
    (family, None), the first in match order whose ``accepts`` says yes.  When none does: on CPU, where the
    families that declare no ``accepts`` and at last the generic schedule take any other kernel,
    (None, None) unless the generic schedule declines too (``cpu.generic.accepts``: a matmul group that no
    matmul family took); else (None, the reason of each family that declined, those whose name contains
    ``prefer`` first).  A target none of whose families declares ``accepts`` gates nothing: (None, None)."""
    family, refusal, _ = template_gate(group, target, prefer)
    return family, refusal


def template_gate(group, target: C.Target, prefer: str = "", named: tuple = ()) -> tuple[str | None, str | None, str]:
    """``accepting_template`` and, for a group it lets pass without a family (the generic schedule takes
    it), why the families named by ``named`` (default: ``prefer``; the templates of the rules that formed
    the group) declined: ``"cpu.row_reduction: ..."``, for the report ("" when none of them declined)."""
    named = tuple(n for n in (named or (prefer,)) if n)
    templates = [t for t in templates_for(target) if declares_accepts(t)]
    if not templates:
        return None, None, ""
    reasons = []
    for t in templates:
        why = t.accepts(group, target)
        if why is None:
            return t.family, None, ""
        reasons.append((t.family, why))
    if not is_gpu(target):
        from .cpu import generic

        why = generic.accepts(group, target)
        if why is None:
            return None, None, "; ".join(f"{f}: {w}" for f, w in reasons if any(n in f for n in named))
        reasons.append((generic.FAMILY, why))
    declined = sorted(reasons, key=lambda r: prefer not in r[0] if prefer else False)    # the rule's family first
    return None, "no template schedules the group (" + "; ".join(f"{f}: {why}" for f, why in declined) + ")", ""


def schedule_prim_func(func: C.PrimFunc, target: C.Target, records: dict | None = None,
                       name: str = "") -> Scheduled | None:
    """Schedule one PrimFunc: its tuned record if any, else its template's target default.  A template
    with size buckets gets one nest per bucket (each its tuned record or default), joined in one kernel
    that branches on the extent at run time (``schedules.buckets``); the config is then
    ``{"buckets": [{"bucket", "source", "config"}, ...]}`` and the source "tuned" when any nest is.

    Returns None when no template matches (the caller applies the safe fallback and says so).
    """
    found = find_template(func, target, templates_for(target))
    if found is None:
        return None
    template, match = found
    done, nests = _schedule_buckets(template, match, func, target, records, name)
    if template.wants_unit_nest(match, target, func, done.func):
        # a nest with every shape variable 1 (static buffers, no index division by a symbolic extent), run
        # when the shapes are all 1 (schedules.buckets.join_unit): the nest of the size bucket holding that size
        nest = nests[unit_bucket(template, match, target)] if nests else done.func
        return replace(done, func=join_unit(done.func, unit_nest(nest)))
    return done


def unit_bucket(template, match, target: C.Target) -> int:
    """Index of the size bucket whose range holds the dispatch extent at every shape variable 1."""
    one = value_at(template.dispatch_extent(match))
    for i, b in enumerate(template.buckets(match, target)):
        if b.max_extent is None or one <= b.max_extent:
            return i
    raise ValueError(f"size buckets of {template.family}: none holds {one}")


def _schedule_buckets(template, match, func: C.PrimFunc, target: C.Target, records: dict | None,
                      name: str) -> tuple[Scheduled, tuple]:
    """The scheduled kernel and, for a template with size buckets, each bucket's nest alone (else ())."""
    key = workload_key(func)
    buckets = template.buckets(match, target)
    if not buckets:
        return _schedule_one(template, match, func, target, (records or {}).get(key), name, key), ()
    # one nest per size bucket (each with its own record), joined under a run-time branch on the extent
    done = []
    for bucket in buckets:
        bkey = bucket_key(key, bucket.name)
        done.append(_schedule_one(template, template.bucket_match(match, bucket), func, target,
                                  (records or {}).get(bkey), name, bkey))
    joined = join_buckets([d.func for d in done], buckets, template.dispatch_extent(match))
    sources = {d.source for d in done}
    scheduled = Scheduled(joined, template.family,
                          {"buckets": [{"bucket": b.name, "source": d.source, "config": d.config}
                                       for b, d in zip(buckets, done)]},
                          sources.pop() if len(sources) == 1 else "tuned",
                          "; ".join(f"{b.name}: {d.reason}" for b, d in zip(buckets, done) if d.reason))
    return scheduled, tuple(d.func for d in done)


def _schedule_one(template, match, func: C.PrimFunc, target: C.Target, rec: dict | None, name: str,
                  key: str) -> Scheduled:
    """``func`` under ``template``: with the tuned record ``rec`` (of ``key``) when it applies, else the
    template's target default (its ``reason`` then says why the record was not used)."""
    why = ""
    if rec is not None and rec.get("template") == template.family:
        rec = {**rec, "config": _with_new_knobs(template, match, target, rec["config"])}
    if rec is not None and rec.get("template") == template.family and \
            not template.space(match, target).contains(rec["config"]):
        # a record from an older knob space of this template (knobs added or choices changed)
        log.info("%s: tuned record for %s is outside the template's current knob space; using the "
                 "default", name, key)
        why = f"tuned record for {key} is outside {template.family}'s current knob space"
        rec = None
    if rec is not None and rec.get("template") == template.family:
        try:
            return Scheduled(schedule_with(template, match, func, rec["config"]), template.family,
                             rec["config"], "tuned")
        except Exception as e:  # a record from another version of the template: fall back to default
            log.warning("%s: tuned record for %s does not apply (%s); using the default", name, key, e)
            first = (str(e).strip().splitlines() or [""])[0][:200]
            why = f"tuned record for {key} does not apply ({type(e).__name__}: {first})"
    config = template.default_config(match, target)
    return Scheduled(schedule_with(template, match, func, config), template.family, config, "default", why)


def _with_new_knobs(template, match, target: C.Target, config: dict) -> dict:
    """A record made before knobs were added to its template gets, for each missing knob, the value its
    typed config declares as the knob's pre-knob behaviour (``knob(before=...)``: cpu.attention's exp2 0,
    the base-e kernel such a record was measured with), else the target default (e.g. ``pad_n``); any
    other difference is left for the knob-space check."""
    names = template.space(match, target).names
    missing = [k for k in names if k not in config]
    if not missing or not set(config) <= set(names):
        return config
    default = template.default_config(match, target)
    before = template.config_type.pre_knob_values() if template.config_type is not None else {}
    return {**config, **{k: before.get(k, default[k]) for k in missing}}


def _load_records(options, target: C.Target) -> dict:
    """Best tuning record per workload for this target from ``options.tuning_log``: none when it is None
    (untuned target defaults), the shipped records when it is ``"shipped"``, else the records of that log."""
    if options.tuning_log is None:
        return {}
    return best_configs(options.tuning_log, target)


def _dlight_rules(target: C.Target) -> list:
    dl = C.dlight
    if is_gpu(target):
        from .cuda.fallback import dlight_rules

        return dlight_rules()
    # not dlight's cpu.Reduction: what reaches the fallback on CPU is a reduction cpu.row_reduction refuses
    # (rows that do not lead the output's loops: ConvNeXt's LayerNorm over the channels of an NCHW
    # tensor), where it ran 50x slower than the generic schedule (265 vs 5.5 us), or raised (several outputs)
    return [dl.cpu.GEMV()]


FALLBACK_REASON = "tvmfuse.fallback_reason"   # PrimFunc attr: why no template scheduled the kernel


def fallback_passes(target: C.Target) -> list:
    """What a PrimFunc no template scheduled gets: dlight's generic rules, one function at a time, and on
    CPU, where no dlight rule applies or one fails (dlight's CPU Reduction raises on some kernels, e.g. a
    reduction block with several outputs), the generic schedule (``cpu/generic.py``): no kernel is left
    with its naive loops.  On a GPU, ``cuda/fallback.py``: the first dlight rule whose schedule TVM can
    lower, else one thread per root block (legal for any kernel).  One schedule record per kernel: template
    "fallback" (dlight or the serial schedule, source "fallback", ``config["by"]`` says which) or
    "cpu.generic" (source "generic"), with the reason no template matched.
    """
    rules = _dlight_rules(target)

    @C.module_pass(opt_level=0, name="tvmfuse.fallback_schedules")
    def _fallback(mod, _ctx):
        updates = {}
        for gv, func in mod.functions.items():
            if not isinstance(func, C.PrimFunc) or (func.attrs is not None and "tirx.is_scheduled" in func.attrs):
                continue
            name = str(gv.name_hint)
            why = str(func.attrs[FALLBACK_REASON]) if func.attrs is not None and FALLBACK_REASON in func.attrs \
                else "no template matches this kernel"
            if is_gpu(target):      # dlight's rules, each result checked to lower, else the serial schedule
                from .cuda.fallback import schedule_fallback

                done, by, notes = schedule_fallback(func, target)
                updates[gv] = done
                record_schedule(name, "fallback", "fallback", {"by": by}, reason=f"{why}; {notes}" if notes else why)
                continue
            single = C.IRModule({gv: func})
            try:
                done = C.dlight.ApplyDefaultSchedule(*rules)(single)[gv]
            except Exception as e:  # dlight raises ScheduleError/TVMError on kernels its rules misjudge
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                log.info("%s: dlight fallback failed (%s); generic schedule", name, first)
                done, why = None, f"{why}; dlight failed: {first}"
            if done is not None and done.attrs is not None and "tirx.is_scheduled" in done.attrs:
                updates[gv] = done
                record_schedule(name, "fallback", "fallback", {"by": "dlight"}, reason=why)
                continue
            from .cpu.generic import FAMILY, GenericConfig, schedule_generic

            try:
                scheduled, blocks = schedule_generic(func, target)
            except Exception as e:  # a bug of the generic schedule: keep the (correct) naive loops, say so
                log.warning("%s: generic schedule failed (%s: %s); left unscheduled", name, type(e).__name__, e)
                record_schedule(name, "unscheduled", "unscheduled", reason=f"{why}; generic schedule failed: {e}")
                continue
            updates[gv] = scheduled.with_attr("tirx.is_scheduled", True)
            record_schedule(name, FAMILY, "generic", {**GenericConfig.for_target(target).asdict(),
                                                      "blocks": list(blocks.values())},
                            reason=why if done is None else f"{why}; no dlight rule applies")
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
                updates[gv] = func.with_attr(FALLBACK_REASON, f"template error: {e}"[:300])
                continue
            if res is None:
                continue                     # the fallback passes schedule it and record why
            if is_gpu(target):
                # a GPU template's schedule that TVM cannot lower is a template bug: the build must not
                # fail on it, the fallback takes the kernel and the report says why
                from .cuda.fallback import lowering_error

                why = lowering_error(res.func, target)
                if why is not None:
                    log.warning("%s: %s schedule does not lower (%s); using the fallback schedule", name,
                                res.template, why)
                    updates[gv] = func.with_attr(FALLBACK_REASON, f"template error: {res.template} schedule "
                                                                  f"does not lower: {why}"[:300])
                    continue
            updates[gv] = res.func.with_attr("tirx.is_scheduled", True)
            record_schedule(name, res.template, res.source, res.config, reason=res.reason)
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
