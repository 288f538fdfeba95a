"""Graph-level (Relax) passes of tvmfuse."""
from __future__ import annotations

from .. import _compat as C


def pre_legalize_passes(target: C.Target, options) -> list:
    """Cleanups on high-level ops before legalization."""
    return [C.relax_transform.FoldConstant(), C.relax_transform.DeadCodeElimination()]


def grouping_passes(target: C.Target, options) -> list:
    """Decide fusion groups on the legalized module."""
    from .grouping import FuseGroups

    return [FuseGroups(target)]
