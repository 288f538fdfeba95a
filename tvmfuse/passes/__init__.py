"""Graph-level (Relax) passes of tvmfuse."""
from __future__ import annotations

from .. import _compat as C


def pre_legalize_passes(target: C.Target, options) -> list:
    """Cleanups on high-level ops before legalization.

    NOTE: TVM's FoldConstant must not run before LegalizeOps: on a dynamic strided slice it leaves a
    call to a ``shape_func`` PrimFunc it never adds to the module, and RewriteDataflowReshape then fails
    (8 ONNX conformance regressions: node/test_slice*). FoldConstant runs after LegalizeOps instead.
    """
    return [C.relax_transform.DeadCodeElimination()]


def grouping_passes(target: C.Target, options) -> list:
    """Decide fusion groups on the legalized module."""
    return [C.relax_transform.FuseOps()]
