"""Schedule templates for fused PrimFuncs, one family per file, one folder per target family."""
from __future__ import annotations

from .. import _compat as C
from ..target import is_gpu


def schedule_passes(target: C.Target, options) -> list:
    """Passes that schedule every PrimFunc of the module for ``target``."""
    if is_gpu(target):
        from ..pipeline import _gpu_default_rules

        return [C.dlight.ApplyDefaultSchedule(*_gpu_default_rules())]
    return []
