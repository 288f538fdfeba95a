"""Features of a scheduled candidate for the cost model.

Two parts, concatenated by the cost model:
- program features: MetaSchedule's ``PerStoreFeature`` (164 numbers per buffer store of the scheduled
  PrimFunc: loop structure, vectorization, parallelism, buffer access and reuse, arithmetic intensity),
  reduced over the stores by mean and max so that schedules with different numbers of stores (cache
  writes) compare; these carry the shape, which is what lets records of one workload help another.
- knob features: each knob of the template as a number (log2 of an integer choice, 0/1 for a bool, the
  choice's index otherwise), by knob name.
"""
from __future__ import annotations

import math
import zlib

import numpy as np

PER_STORE_LEN = 164
PROGRAM_LEN = 2 * PER_STORE_LEN


def program_features(per_store: np.ndarray) -> np.ndarray:
    """(stores x 164) -> (328,): mean and max over the stores (zeros for a program with no store)."""
    per_store = np.asarray(per_store, dtype=np.float64)
    if per_store.ndim != 2 or per_store.shape[0] == 0:
        return np.zeros(PROGRAM_LEN)
    return np.concatenate([per_store.mean(axis=0), per_store.max(axis=0)])


def knob_value(value, choices=None) -> float:
    """One knob choice as a number."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return math.copysign(math.log2(1.0 + abs(float(value))), float(value))
    if isinstance(value, (list, tuple)):
        return float(sum(knob_value(v) for v in value))
    if choices is not None and value in choices:
        return float(list(choices).index(value))
    return float(zlib.crc32(str(value).encode()) % 997) / 997.0


class KnobVocabulary:
    """Column order of knob features across workloads of a template family (by knob name)."""

    def __init__(self):
        self.columns: dict[str, int] = {}

    def add(self, config: dict) -> None:
        for name in sorted(config):
            self.columns.setdefault(name, len(self.columns))

    def vector(self, config: dict) -> np.ndarray:
        v = np.full(len(self.columns), -1.0)
        for name, value in config.items():
            col = self.columns.get(name)
            if col is not None:
                v[col] = knob_value(value)
        return v


_FEATURE_CONTEXTS: dict = {}


def _feature_context(target):
    """A bare TuneContext (target only) for feature extraction.  ``TuneContext.__init__`` first imports
    ``tvm.s_tir.tensor_intrin`` (parses ~500 TVMScript intrinsics: 40 s on this host), which features
    never use, so the object is made through its FFI constructor as that __init__ would make it."""
    from .. import _compat as C

    key = str(target)
    if key not in _FEATURE_CONTEXTS:
        ms_api, _, get_logger, get_logging_func = C.ms_internals()
        ctx = C.meta_schedule.TuneContext.__new__(C.meta_schedule.TuneContext)
        ctx.__init_handle_by_constructor__(ms_api.TuneContext, None, target, None, None, "main", 1, -1,
                                           get_logging_func(get_logger("tvmfuse.tune.features")))
        ms_api.TuneContextInitialize(ctx)
        _FEATURE_CONTEXTS[key] = ctx
    return _FEATURE_CONTEXTS[key]


def concrete_shapes(func, sizes: dict | None = None) -> list[tuple[list[int], str]]:
    """(shape, dtype) of each PrimFunc parameter, symbolic dimensions evaluated with ``sizes`` (shape
    variable name -> size); a symbolic dimension with a variable ``sizes`` does not give is an error."""
    from .. import _compat as C

    sizes = sizes or {}
    found: dict[str, object] = {}

    def visit(node):
        if isinstance(node, C.tirx.Var):
            found.setdefault(str(node.name), node)

    for p in func.params:
        for d in p.shape:
            C.post_order_visit(d, visit)
    missing = sorted(n for n in found if n not in sizes)
    if missing:
        raise ValueError(f"symbolic dimension(s) {missing} of the kernel have no size to measure it at")
    ana = C.Analyzer()
    for name, var in found.items():
        ana.bind(var, int(sizes[name]))
    return [([int(ana.simplify(d)) for d in p.shape], str(p.dtype)) for p in func.params]


def per_store_features(mod, target, sizes: dict | None = None) -> np.ndarray:
    """MetaSchedule's PerStoreFeature of a scheduled module: a (stores x 164) numpy array.  A kernel over
    symbolic shapes (a size bucket's nest) describes its arguments at ``sizes`` (``concrete_shapes``)."""
    from .. import _compat as C

    _, arg_info, _, _ = C.ms_internals()
    sch = C.Schedule(mod)
    if sizes:
        args = [C.ms_tensor_info(dtype, shape) for shape, dtype in concrete_shapes(mod["main"], sizes)]
    else:
        args = arg_info.from_prim_func(mod["main"])
    cand = C.meta_schedule.MeasureCandidate(sch, args)
    fx = C.meta_schedule.feature_extractor.PerStoreFeature()
    return fx.extract_from(_feature_context(target), [cand])[0].numpy()
