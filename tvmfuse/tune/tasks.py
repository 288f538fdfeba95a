"""Task extraction: the distinct fused PrimFuncs of a model that a schedule template matches.

A task is one workload (structural hash of the PrimFunc, ``workload_key``) on one target
(``target_key``), weighted by how many times an inference calls it; a kernel whose template dispatches on a
symbolic extent gives one task per size bucket (``Task.bucket``; its records carry the bucket, measured
with the symbolic sizes of ``Task.sizes``).  Kernels no template matches are
left to the fallback schedule and are not tuned (``extract_tasks`` says which, on the ``tvmfuse.tune``
logger).
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from .. import _compat as C
from ..pipeline import PipelineOptions, Stages
from ..report import graph_stats
from ..schedules import templates_for
from ..records import bucket_key, target_key, workload_key
from ..schedules.base import KnobSpace, Match, Template, find_template
from ..target import parse_target

log = logging.getLogger("tvmfuse.tune")


@dataclass
class Task:
    name: str                      # the kernel's name in the model (first one if several share the workload)
    workload_key: str
    target_key: str
    func: C.PrimFunc               # the fused, unscheduled PrimFunc
    template: Template
    match: Match
    space: KnobSpace
    default_config: dict
    weight: int = 1                # calls per inference
    workload: dict = field(default_factory=dict)    # name and parameter shapes, for the log
    reference_costs: list | None = None             # the default schedule's costs (set by the measurer)
    reference_error: dict | None = None             # ... or why the default failed
    bucket: str | None = None      # the size bucket of a kernel that dispatches on a symbolic extent
    sizes: dict = field(default_factory=dict)       # symbolic shape variable -> size it is measured at

    @property
    def family(self) -> str:
        return self.template.family

    @property
    def key(self) -> str:
        """The key its records apply under (``records.bucket_key``: the workload, and its bucket)."""
        return bucket_key(self.workload_key, self.bucket)


def workload_info(name: str, func: C.PrimFunc) -> dict:
    """Name and parameter shapes of a workload, for the log (a symbolic dimension as its expression's text)."""
    return {"name": name, "params": [[[int(d) if isinstance(d, C.IntImm) else str(d) for d in p.shape],
                                      str(p.dtype)] for p in func.params]}


def tasks_for(func: C.PrimFunc, target, name: str = "main", weight: int = 1, templates=None) -> list[Task]:
    """The tasks of one PrimFunc: none when no template of the target matches it, one per size bucket
    when its template dispatches on a symbolic extent (``schedules.buckets``), else one."""
    target = parse_target(target)
    found = find_template(func, target, templates if templates is not None else templates_for(target))
    if found is None:
        return []
    template, match = found
    common = dict(name=name, workload_key=workload_key(func), target_key=target_key(target), func=func,
                  template=template, weight=weight, workload=workload_info(name, func))
    buckets = template.buckets(match, target)
    if not buckets:
        return [Task(**common, match=match, space=template.space(match, target),
                     default_config=template.default_config(match, target))]
    out = []
    for b in buckets:
        bm = template.bucket_match(match, b)
        out.append(Task(**common, match=bm, space=template.space(bm, target),
                        default_config=template.default_config(bm, target), bucket=b.name,
                        sizes=template.bucket_sizes(match, b, target)))
    return out


def task_for(func: C.PrimFunc, target, name: str = "main", weight: int = 1, templates=None,
             bucket: str | None = None) -> Task | None:
    """The task of one PrimFunc (of its size ``bucket`` when its template has buckets), or None when no
    template of the target matches it (or it has no such bucket)."""
    return next((t for t in tasks_for(func, target, name, weight, templates) if t.bucket == bucket), None)


def fused_module(model, target, options: PipelineOptions | None = None):
    """The model after tvmfuse's graph stage (fused, unscheduled PrimFuncs), under ``target``."""
    from ..frontend import load_onnx

    mod = model if isinstance(model, C.IRModule) else load_onnx(model)
    with target:
        return C.Sequential(Stages(target, options).graph(), name="tvmfuse.tune.graph_stage")(mod)


def extract_tasks(model, target=None, templates=None, options: PipelineOptions | None = None) -> list[Task]:
    """Distinct template-matched PrimFuncs of ``model`` (ONNX path/ModelProto or Relax IRModule), weighted
    by their call count, heaviest first."""
    target = parse_target(target)
    mod = fused_module(model, target, options)
    calls = Counter(graph_stats(mod).kernel_names)
    by_wk: dict[str, list[Task]] = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, C.PrimFunc):
            continue
        name = str(gv.name_hint)
        n = calls.get(name, 0)
        if n == 0:
            continue
        wk = workload_key(func)
        if wk in by_wk:
            for t in by_wk[wk]:
                t.weight += n
            continue
        tasks = tasks_for(func, target, name, n, templates)
        if not tasks:
            log.info("%s: no schedule template matches; not tuned (fallback schedule)", name)
            continue
        by_wk[wk] = tasks
    return sorted((t for ts in by_wk.values() for t in ts), key=lambda t: (-t.weight, t.name, t.bucket or ""))


def kernel_inputs_from_samples(model, target, feeds: dict, tasks: list[Task],
                               options: PipelineOptions | None = None) -> dict[str, list]:
    """Real arguments of each task's kernel, captured while the fused (unscheduled) model runs on the
    user's sample inputs ``feeds``: ``{workload_key: [one array per PrimFunc parameter]}``.

    Tuning then measures and checks every kernel on data like the model's, not on random numbers."""
    import numpy as np

    from ..compiled import relax_io, validate_feeds
    from ..frontend import load_onnx, onnx_io, read_model

    target = parse_target(target)
    mod = fused_module(model, target, options)
    if isinstance(model, C.IRModule):
        specs, _ = relax_io(mod)
    else:
        src = read_model(model)
        ins, _ = onnx_io(src)
        r_in, _ = relax_io(load_onnx(src))
        from ..compiled import TensorSpec

        specs = [TensorSpec(o["name"], r.shape, r.dtype) for o, r in zip(ins, r_in)]
    arrays = validate_feeds(feeds, specs)
    with target:
        ex = C.compile_module(mod, target, relax_pipeline=C.Sequential(Stages(target, options).lower()))
    dev = C.device_for(target)
    vm = C.VirtualMachine(ex, dev)
    wanted = {t.name: t.workload_key for t in tasks}
    captured: dict[str, list] = {}

    def instrument(func, symbol, before_run, ret_value, *args):
        wk = wanted.get(str(symbol))
        if before_run and wk is not None and wk not in captured:
            captured[wk] = [np.array(a.numpy()) for a in args if hasattr(a, "numpy")]
        return 0   # VMInstrumentReturnKind.NO_OP: run the call

    vm.set_instrument(instrument)
    vm["main"](*[C.tensor(a, dev) for a in arrays])
    missing = [t.name for t in tasks if t.workload_key not in captured]
    if missing:
        log.warning("kernels %s did not run on the sample inputs; they are tuned on random normal data",
                    missing)
    return captured
