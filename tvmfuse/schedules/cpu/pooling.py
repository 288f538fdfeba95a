"""Strided max pooling (NCHW, any window, column stride of 2 or more, padding / ceil_mode) on CPUs.

Matches, after folding elementwise producers (a concatenation feeding the pool) into the padding block, one
reduction block

    pool[n, c, y, x] = max over (ry, rx) of data[n, c, y*sh + ry, x*sw + rx]          (sw >= 2)

whose ``data`` is a padding block (``pad_temp``: explicit pads or ceil_mode) or a parameter, of a width
the column stride divides, and nothing else.  ``cpu.row_reduction`` took it as a row of KH x KW elements
(a 9-long reduction on partial-sum vectors) and the generic schedule vectorizes the output columns, whose
window reads are stride-``sw`` gathers: SqueezeNet's 3x3/2 ceil_mode pool on 64x31x31 ran 4x slower than onnxruntime (benchmarks/
gaps_cnn.md, measured under load).

Schedule: one parallel loop over the (n, c) planes; in it the plane's padded input is written by column
phase (``pad[n, c, y, x]`` at ``[n, c, y, x % sw, x // sw]``, as ``conv2d.deinterleave_pad``), so the window
column ``x*sw + rx`` of consecutive outputs is one contiguous run: the max runs on vectors of output
columns (window loops outside, the column loop innermost and vectorized) with plain vector loads.
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import _compat as C
from ...analysis import var_names
from ...target import cpu_info
from ..base import Config, KnobSpace, Match, knob
from ..buckets import BatchBuckets
from . import common as U

FAMILY = "cpu.window_pool"


@dataclass(frozen=True)
class WindowPoolConfig(Config):
    """The knobs of ``cpu.window_pool``."""

    lanes: int = knob("float32 lanes per vector (the target's width)")
    deinterleave: bool = knob("padded input stored by column phase (vector loads; else strided gathers)",
                              (True, False))
    parallel: bool = U.parallel_knob()


def _is_max_update(store):
    """The data load of ``out = max(out, data[...])`` (a TensorLoad), else None."""
    v = store.value
    if type(v).__name__ != "Max":
        return None
    out = str(store.buffer.name)
    loads = [o for o in (v.a, v.b) if isinstance(o, C.TensorLoad)]
    acc = [o for o in loads if str(o.source.name) == out]
    data = [o for o in loads if str(o.source.name) != out]
    return data[0] if len(acc) == 1 and len(data) == 1 else None


def analyze_pool(sch: C.Schedule, block) -> dict | None:
    """The roles of a reduction block if it is a strided NCHW max pool; None otherwise (raises nothing)."""
    blk = sch.get(block)
    store = blk.body
    if U.iter_kinds(sch, block) != "SSSSRR" or blk.init is None or not isinstance(store, C.BufferStore):
        return None
    data = _is_max_update(store)
    if data is None or len(data.indices) != 4:
        return None
    n, c, y, x, ry, rx = [str(iv.var.name) for iv in blk.iter_vars]
    if [getattr(i, "name", None) for i in store.indices] != [n, c, y, x]:
        return None
    if [var_names(i) for i in data.indices] != [{n}, {c}, {y, ry}, {x, rx}]:
        return None
    coef = C.detect_linear_equation(data.indices[3], [blk.iter_vars[3].var])
    if len(coef) != 2 or not isinstance(coef[0], C.tirx.IntImm) or int(coef[0]) < 2:
        return None                 # stride 1 (or not affine): contiguous windows, nothing to deinterleave
    # the (padded) input's width a multiple of the stride: every column phase equally long
    stride, width = int(coef[0]), data.source.shape[3]
    if not isinstance(width, C.tirx.IntImm) or int(width) % stride:
        return None                 # a phase shorter than the others: transform_layout would need padding
    return {"stride_w": stride, "data_buffer": str(data.source.name), "pool": U.block_name(sch, block)}


def find_pool(func: C.PrimFunc) -> dict | None:
    """The pool block and its padding block (None: the pool reads a parameter), or None."""
    found = U.window_reduction(func, analyze_pool)
    if found is None:
        return None
    sch, _, info, pad, left = found
    if any(b not in (info["pool"], pad) for b in left) or info["pool"] not in U.output_names(sch):
        return None                 # an epilogue or another kernel in the group: not this family's structure
    info["pad"] = pad
    extents = U.loop_extents(sch, sch.get_sblock(info["pool"]))
    work = 1
    for e in extents:
        work *= e
    info["work"] = None if -1 in extents else work      # window steps (outputs x window); None: symbolic
    if extents[0] == -1 and -1 not in extents[1:]:
        # a symbolic batch: size buckets over it (BatchBuckets), the window steps of one batch
        info.update(batch=sch.get(sch.get_loops(sch.get_sblock(info["pool"]))[0]).extent,
                    batch_work=work // extents[0])      # the other extents' product
    return info


class WindowPool(BatchBuckets, U.CpuTemplate, family=FAMILY, config=WindowPoolConfig):
    # ------------------------------------------------------------------ match
    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        info = find_pool(func)
        if info is not None and "batch" in info:
            # over a symbolic batch: a serial nest while the window steps stay under the fork/join cost
            info["serial_batches_work"] = U.serial_batches(info["batch_work"], target)
        return None if info is None else Match(self.family, info)

    # ------------------------------------------------------------------ size buckets (BatchBuckets)
    def batch_info(self, match: Match, batch: int) -> dict:
        return {"work": match.info["batch_work"] * batch}

    # ------------------------------------------------------------------ knobs
    def space(self, match: Match, target: C.Target) -> KnobSpace:
        return WindowPoolConfig.space(lanes=(cpu_info(target).float32_lanes,))

    def default_config(self, match: Match, target: C.Target) -> dict:
        return WindowPoolConfig(lanes=cpu_info(target).float32_lanes, deinterleave=True,
                                parallel=U.parallel_default(match.info["work"], target)).asdict()

    # ------------------------------------------------------------------ apply
    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        info, cfg = match.info, WindowPoolConfig.from_dict(config)
        s = info["stride_w"]

        # Step 1. Fold elementwise producers into the padding block; without one, a copy of the input to
        # lay out (cache_read).
        U.inline_elementwise(sch, keep=frozenset({info["pad"]} if info["pad"] else ()))
        pool = sch.get_sblock(info["pool"])
        if info["pad"]:
            data = sch.get_sblock(info["pad"])
        else:
            reads = [str(r.source.name) for r in sch.get(pool).reads]
            data = sch.cache_read(pool, reads.index(info["data_buffer"]), "global")

        # Step 2. The padded input by column phase: a window column of consecutive outputs is contiguous.
        if cfg.deinterleave:
            sch.transform_layout(data, ("write", 0), lambda n, c, y, x: (n, c, y, x % s, x // s))

        # Step 3. One (parallel) loop over the planes; per output row the window loops outside and the output
        # columns innermost, vectorized (before the init is split off: a reduction block vectorizes).
        n, c, y, x, ry, rx = sch.get_loops(pool)
        sch.reorder(n, c, y, ry, rx, x)
        plane = sch.fuse(n, c)
        if cfg.parallel:              # a pool under the target's fork/join cost stays serial (common.py)
            sch.parallel(plane)
        sch.vectorize(x)
        init = sch.decompose_reduction(pool, ry)
        sch.vectorize(sch.get_loops(init)[-1])

        # Step 4. The plane's padded input inside the parallel loop, vectorized along its rows.
        sch.compute_at(data, plane, preserve_unit_loops=True)
        U.vectorize_inner(sch, data, cfg.lanes)
