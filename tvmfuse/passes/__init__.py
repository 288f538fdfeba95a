"""Graph-level (Relax) passes of tvmfuse: pre-legalize rewrites, then the fusion groups."""
from __future__ import annotations

from .. import _compat as C


def pre_legalize_passes(target: C.Target, options) -> list:
    """Rewrites and cleanups on high-level ops before legalization.

    NOTE: TVM's FoldConstant must not run before LegalizeOps: on a dynamic strided slice it leaves a
    call to a ``shape_func`` PrimFunc it never adds to the module, and RewriteDataflowReshape then fails
    (8 ONNX conformance regressions: node/test_slice*). FoldConstant runs after LegalizeOps instead;
    batch-norm folding computes its constants itself.
    """
    from .attention import FuseAttention
    from .conv1d import Conv1dAsConv2d
    from .relpos import DiagonalRelativePosition
    from .rewrites import FoldBatchNorm, Peephole, TransposePointwiseWeights

    attention = [
        C.relax_transform.DeadCodeElimination(),   # FuseAttention counts readers: dead ones must go first
        FuseAttention(target),
    ] if options.attention else []
    cpu_schedules = options.schedules and target.kind.name == "llvm"
    return [
        Peephole(),
        # T5's relative-position bucket over a symbolic sequence: once per diagonal, not per (i, j)
        DiagonalRelativePosition(),
        FoldBatchNorm(),
        # CPU schedules only: no CPU template takes a conv1d anchor, the conv2d ones do; after FoldBatchNorm
        # (a BatchNorm1d folds into the conv1d: its bias then moves to 4-D), before the weight layouts
        *([Conv1dAsConv2d()] if cpu_schedules else []),
        # after FoldBatchNorm (OIHW weights); CPU schedules only (cpu.conv1x1 reads the weights [ci, co])
        *([TransposePointwiseWeights(target)] if cpu_schedules else []),
        *attention,
        C.relax_transform.CanonicalizeBindings(),
        C.relax_transform.EliminateCommonSubexpr(),
        C.relax_transform.DeadCodeElimination(),
    ]


def grouping_passes(target: C.Target, options) -> list:
    """Decide fusion groups on the legalized module (each group a Primitive function for FuseTIR)."""
    from .grouping import FuseGroups

    return [FuseGroups(target)]
