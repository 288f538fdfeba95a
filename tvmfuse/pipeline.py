"""tvmfuse's Relax pipeline: graph passes -> fused PrimFuncs -> schedules -> TVM's lowering.

The stages are plain pass lists so that ``compile()`` can stop between them (to report what fusion did)
and a user can take any one of them alone.  ``pipeline(target)`` chains them into one named pass that
``tvm.compile(mod, target, relax_pipeline=...)`` takes; importing tvmfuse also registers it under the
name ``"tvmfuse"``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from . import _compat as C
from .target import is_gpu, parse_target

log = logging.getLogger("tvmfuse.pipeline")


@dataclass(frozen=True)
class PipelineOptions:
    """Switches of the pipeline; every stage reads its settings from here (no environment flags)."""

    fusion: bool = True        # tvmfuse's graph-level fusion rules (False: TVM's FuseOps only)
    schedules: bool = True     # tvmfuse's schedule templates (False: TVM's defaults)
    fast_math: bool = True     # vectorizable exp/erf/tanh/sigmoid approximations in fused kernels
    tuning_log: str | None = None   # None: untuned target defaults; "shipped": the shipped records; a log path
    extra: dict = field(default_factory=dict)


def pre_legalize_passes(target: C.Target, options: PipelineOptions) -> list:
    """Graph cleanups and rewrites on high-level Relax ops (before they become TIR)."""
    if not options.fusion:
        return []
    from .passes import pre_legalize_passes as graph_pre

    return graph_pre(target, options)


def legalize_passes(target: C.Target) -> list:
    """TVM's library dispatch, then every op lowered to its own PrimFunc with its op pattern."""
    return C.backend_passes(target, "library_dispatch") + [
        C.relax_transform.LegalizeOps(),
        C.relax_transform.AnnotateTIROpPattern(),
        C.relax_transform.FoldConstant(),
    ]


def grouping_passes(target: C.Target, options: PipelineOptions) -> list:
    """Decide the fusion groups: each group becomes a Relax function marked Primitive."""
    if not options.fusion:
        return [C.relax_transform.FuseOps()]
    from .passes import grouping_passes as graph_grouping

    return graph_grouping(target, options)


def fuse_tir_passes(target: C.Target, options: PipelineOptions) -> list:
    """Merge each group's PrimFuncs into one PrimFunc (one kernel)."""
    return [C.relax_transform.FuseTIR()]


def schedule_passes(target: C.Target, options: PipelineOptions) -> list:
    """Schedule every fused PrimFunc: a tuned record, else the target's template default."""
    from .schedules import schedule_passes as sched

    return sched(target, options)


def lowering_passes(target: C.Target) -> list:
    """TVM's own dataflow lowering and VM finalization for the target."""
    return C.backend_passes(target, "dataflow_lower") + C.backend_passes(target, "finalize")


def guarded(passes: list, name: str) -> C.ir_transform.Pass:
    """Run ``passes``; if TVM fails inside them, keep the module as it was and record why.

    TVM's own FuseOps/FuseTIR still fail on some graphs (e.g. the shape functions of a dynamic
    strided slice); the model then compiles unfused instead of not at all, and the report says so.
    """

    @C.module_pass(opt_level=0, name=f"tvmfuse.guarded.{name}")
    def _guarded(mod, _ctx):
        try:
            return C.Sequential(passes, name=name)(mod)
        except Exception as e:  # TVM raises InternalError/TVMError/ValueError; all mean "not applied"
            first = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
            log.warning("%s failed (%s: %s); this module is compiled without it", name, type(e).__name__, first)
            from .explain import record_refusal

            record_refusal("<module>", "<module>", f"{name} failed inside TVM ({type(e).__name__}: {first}); "
                           "module left unfused", rule=name)
            return mod

    return _guarded


def fusion_passes(target: C.Target, options: PipelineOptions) -> list:
    """Grouping and FuseTIR as one guarded step: either both apply or the module stays unfused."""
    return [guarded(grouping_passes(target, options) + fuse_tir_passes(target, options), "fusion")]


def graph_stage(target: C.Target, options: PipelineOptions) -> list:
    return pre_legalize_passes(target, options) + legalize_passes(target) + fusion_passes(target, options)


def pipeline(target=None, tuning_log: str | None = None, **option_overrides) -> C.ir_transform.Pass:
    """The whole tvmfuse Relax pipeline as one pass, for ``tvm.compile(..., relax_pipeline=...)``.

    ``target`` may be omitted: the pass then reads the target that tvm.compile enters (``with target:``).
    """
    options = replace(PipelineOptions(tuning_log=tuning_log), **option_overrides)
    fixed = parse_target(target) if target is not None else None

    @C.module_pass(opt_level=0, name="tvmfuse.pipeline")
    def _tvmfuse_pipeline(mod, _ctx):
        tgt = fixed or C.current_target() or parse_target(None)
        with tgt:
            seq = C.Sequential(graph_stage(tgt, options) + schedule_passes(tgt, options)
                               + lowering_passes(tgt), name="tvmfuse.stages")
            return seq(mod)

    return _tvmfuse_pipeline


def stock_pipeline(target=None) -> C.ir_transform.Pass:
    """TVM's own fusion (LegalizeOps + FuseOps + FuseTIR) and defaults: the baseline tvmfuse is compared to."""
    return pipeline(target, fusion=False, schedules=False, fast_math=False)


def unfused_pipeline(target=None) -> C.ir_transform.Pass:
    """No fusion at all: each op its own kernel (TVM's 'default' CPU build; dlight defaults on GPU)."""
    fixed = parse_target(target) if target is not None else None

    @C.module_pass(opt_level=0, name="tvmfuse.unfused_pipeline")
    def _unfused(mod, _ctx):
        tgt = fixed or C.current_target() or parse_target(None)
        with tgt:
            passes = legalize_passes(tgt)
            if is_gpu(tgt):
                passes += [C.dlight.ApplyDefaultSchedule(*_gpu_default_rules())]
            return C.Sequential(passes + lowering_passes(tgt), name="tvmfuse.unfused")(mod)

    return _unfused


def _gpu_default_rules() -> list:
    dl = C.dlight
    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]


def register() -> None:
    """Make ``tvm.compile(mod, target, relax_pipeline="tvmfuse")`` work (TVM calls it with no arguments)."""
    C.register_relax_pipeline("tvmfuse", lambda **kw: pipeline(None, **kw))
