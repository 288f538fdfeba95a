"""The last-resort CPU schedule: any kernel no template and no dlight rule scheduled (pooling, reductions
over any axis, gathers, concats, resizes, mixed kernels...).

It is always legal: every step is one schedule primitive that TVM checks, and a step TVM refuses on a
block is skipped for that block (the block keeps its loops; the refusal is logged), never the kernel.
Per block, after folding elementwise producers into their consumers (``common.inline_elementwise``):

1. loops bound only to spatial iterators go outside those bound to reduction iterators; the innermost
   spatial loop stays innermost (below the reduction) when it walks the last index of the output and of
   an input (a channel reduction in NCHW, a pooling window: the reduction runs on vectors of outputs),
   else the reduction stays innermost, serial (a row reduction over contiguous elements);
2. the leading spatial loops are fused into one parallel loop until it has ``parallel_iters_per_core``
   iterations per core (kernels under ``min_parallel_elements`` stay serial: a fork costs more);
3. the innermost spatial loop is vectorized: whole when short, else split by the widest vector that
   divides it (no predicated tail, which TVM would turn into scalar code); a loop no vector width
   divides is left to LLVM's loop vectorizer (which peels a tail);
4. a spatial producer left standalone (e.g. the padding of a pooling window) is computed inside its
   consumer's parallel loop when TVM allows it, and vectorized there.

No loop is unrolled (code size stays bounded by the kernel's own loop nest).  The numbers it uses are a
typed ``GenericConfig`` from the target (``cpu_info``, and ``template_defaults`` of ``cpu.generic`` in
schedules/cpu_targets.json), recorded with the schedule.

In the fusion gate (``schedules.accepting_template``) the generic schedule is asked last on CPU
(``accepts``): it takes any group but one with a matmul anchor that no matmul family accepted.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ... import _compat as C
from ...target import cpu_info, template_defaults
from ..base import Config, knob
from . import common as U

log = logging.getLogger("tvmfuse.schedule")

FAMILY = "cpu.generic"


@dataclass(frozen=True)
class GenericConfig(Config):
    """What the generic schedule sizes its loops by: the target's vector width and cores, and the table's
    thresholds (not tuned: the generic schedule has no knob space)."""

    lanes: int = knob("float32 lanes per vector (target)")
    cores: int = knob("cores the parallel loop is sized for (the target's num-cores)")
    parallel_iters_per_core: int = knob("parallel loop wanted: this many iterations per core (load balance)")
    min_parallel_elements: int = knob("below this many scalar iterations (spatial x reduction) a block stays "
                                      "serial: a fork costs more")
    max_whole_vectors: int = knob("an innermost loop up to this many vectors long is vectorized whole")
    unit_nest: bool = knob("over symbolic extents, a nest with every shape variable 1 when the serial nest "
                           "allocates a buffer of symbolic size (schedules.buckets.unit_nest)")

    @classmethod
    def for_target(cls, target: C.Target) -> "GenericConfig":
        info = cpu_info(target)
        return cls.from_dict({"lanes": info.float32_lanes, "cores": info.cores,
                              **template_defaults(target, FAMILY)})


def accepts(group, target: C.Target) -> str | None:
    """The generic schedule as the last family the fusion gate asks on CPU: it takes any group except one
    with a matmul anchor (``C += A * B`` with one i, j and k axis: ``matmul.matmul_roles``) that the matmul
    families declined: it does not register-block a matmul, so such a group would run slower fused than
    its matmul apart (which cpu.matmul_epilogue tiles).  Other contractions (a conv1d, a vector-matrix
    product) stay with the families that take them or with the generic schedule, fused as before."""
    from .matmul import matmul_roles

    for m in U.matmul_anchors(group):
        if m.func is not None and matmul_roles(m.func) is not None:
            return (f"{m.name} is a matmul, which the generic schedule does not register-block (apart, "
                    "cpu.matmul_epilogue tiles it)")
    return None


def _loop_kinds(sch: C.Schedule, block) -> list[str] | None:
    """'S' / 'R' per loop of ``block``: whether the loop variable feeds only spatial or only reduction
    iterators; None when a loop feeds both (a fused or mixed binding) or the block is not directly under
    its innermost loop."""
    loops = sch.get_loops(block)
    if not loops:
        return []
    realize = sch.get(loops[-1]).body
    if not isinstance(realize, C.SBlockRealize):
        return None
    blk = sch.get(block)
    uses: dict[str, set] = {}
    for iv, value in zip(blk.iter_vars, realize.iter_values):
        kind = "S" if int(iv.iter_type) == U.SPATIAL else ("R" if int(iv.iter_type) == U.REDUCE else "O")
        C.post_order_visit(value, lambda n, k=kind: uses.setdefault(str(n.name), set()).add(k)
                           if isinstance(n, C.tirx.Var) else None)
    kinds = []
    for loop in loops:
        used = uses.get(str(sch.get(loop).loop_var.name), {"S"})   # an unused (unit) loop is spatial
        if len(used) != 1 or "O" in used:
            return None
        kinds.append(next(iter(used)))
    return kinds


def _last_index_vars(sch: C.Schedule, block) -> tuple[set, set]:
    """Names of the block iterators in the last index of its write, and of any of its reads."""
    blk = sch.get(block)

    def names(region) -> set:
        out = set()
        if region.region:
            C.post_order_visit(region.region[-1].min,
                               lambda n: out.add(str(n.name)) if isinstance(n, C.tirx.Var) else None)
        return out

    write = set().union(*[names(w) for w in blk.writes]) if blk.writes else set()
    read = set().union(*[names(r) for r in blk.reads]) if blk.reads else set()
    return write, read


def _iter_of_loop(sch: C.Schedule, block, loop) -> set:
    """Block iterator names bound to ``loop``'s variable."""
    realize = sch.get(sch.get_loops(block)[-1]).body
    var = str(sch.get(loop).loop_var.name)
    out = set()
    for iv, value in zip(sch.get(block).iter_vars, realize.iter_values):
        found = []
        C.post_order_visit(value, lambda n: found.append(n) if isinstance(n, C.tirx.Var) and
                           str(n.name) == var else None)
        if found:
            out.add(str(iv.var.name))
    return out


def _extent(sch: C.Schedule, loop) -> int:
    ext = sch.get(loop).extent
    return int(ext) if isinstance(ext, C.tirx.IntImm) else -1


def vector_width(extent: int, lanes: int, whole_vectors: int) -> int:
    """Vector split of an innermost loop of ``extent``: the whole loop when at most ``whole_vectors``
    vectors, else the widest power-of-two width from ``lanes`` down to 2 that divides it; 0: none."""
    if extent < 2:
        return 0
    if extent <= whole_vectors * lanes:
        return extent
    w = lanes
    while w >= 2:
        if extent % w == 0:
            return w
        w //= 2
    return 0


def _vectorize(sch: C.Schedule, loop, cfg: GenericConfig) -> bool:
    ext = _extent(sch, loop)
    w = vector_width(ext, cfg.lanes, cfg.max_whole_vectors)
    if w == 0:
        return False
    if w == ext:
        sch.vectorize(loop)
    else:
        _, inner = sch.split(loop, factors=[None, w])
        sch.vectorize(inner)
    return True


def _try(what: str, name: str, fn, *args) -> tuple[bool, object]:
    """Run one schedule primitive; a refusal by TVM (ScheduleError) skips the step for this block."""
    try:
        return True, fn(*args)
    except C.ScheduleError as e:
        log.debug("generic schedule: %s of %s refused (%s)", what, name,
                  (str(e).strip().splitlines() or [""])[0][:120])
        return False, None


def _schedule_block(sch: C.Schedule, block, cfg: GenericConfig, symbolic_parallel: bool = False) -> dict:
    """Steps 1-3 on one block; returns what was done (data, for the record and the tests).
    ``symbolic_parallel``: the nest runs only when the kernel's output has ``min_parallel_elements`` or more
    (``schedule_generic``): a block with a symbolic loop is then taken as large enough to fork, and its
    leading spatial loops but the last one are fused into the parallel loop (the last spatial loop stays
    serial inside: a fused index split by symbolic extents costs a division per element)."""
    name = U.block_name(sch, block)
    done = {"block": name, "parallel": 0, "vector": 0, "reduction_inner": False}
    if U.has_shift(sch, block):
        done["skipped"] = "integer shift (see common.has_shift): loops left as they are"
        return done
    kinds = _loop_kinds(sch, block)
    if not kinds:
        done["skipped"] = "no loops" if kinds == [] else "loops bound to mixed iterators"
        return done
    loops = list(sch.get_loops(block))
    spatial = [lp for lp, k in zip(loops, kinds) if k == "S"]
    reduce = [lp for lp, k in zip(loops, kinds) if k == "R"]
    total = 1
    for lp in loops:
        total *= max(_extent(sch, lp), 1)
    done["elements"] = total

    # Step 1. Spatial loops outside, reduction inside; the last spatial loop innermost when it is the
    # contiguous axis of the output and of an input.
    vec = False
    if spatial and U.vectorizable(sch, block):
        last = spatial[-1]
        write_last, read_last = _last_index_vars(sch, block)
        its = _iter_of_loop(sch, block, last)
        vec = bool(its & write_last) and (not reduce or bool(its & read_last)) and \
            vector_width(_extent(sch, last), cfg.lanes, cfg.max_whole_vectors) > 0
    if reduce:
        order = spatial[:-1] + reduce + [spatial[-1]] if vec else spatial + reduce
        if any(a is not b for a, b in zip(order, loops)):
            ok, _ = _try("reorder", name, sch.reorder, *order)
            if not ok:
                vec = vec and loops[-1] is spatial[-1]
        done["reduction_inner"] = not vec

    # Step 2. Leading spatial loops (the top of the nest) fused into one parallel loop.
    loops = list(sch.get_loops(block))
    kinds = _loop_kinds(sch, block) or []
    lead = 0
    while lead < len(loops) and kinds[lead] == "S":
        lead += 1
    if vec and lead == len(loops):
        lead -= 1                       # the innermost loop is the vector loop
    symbolic = symbolic_parallel and any(_extent(sch, lp) < 0 for lp in loops[:lead])
    if (total >= cfg.min_parallel_elements or symbolic) and lead > 0:
        want = cfg.parallel_iters_per_core * cfg.cores
        take, prod = [], 1
        for lp in loops[:lead - 1] if symbolic and lead > 1 else loops[:lead]:
            take.append(lp)
            prod *= max(_extent(sch, lp), 1)
            if prod >= want:
                break
        if symbolic and any(_extent(sch, lp) < 0 for lp in take):
            prod = -1                     # a symbolic trip count: done["parallel"] is -1 (known at run time)
        if prod > 1 or prod == -1:
            ok, fused = (True, take[0]) if len(take) == 1 else _try("fuse", name, sch.fuse, *take)
            if ok and _try("parallel", name, sch.parallel, fused)[0]:
                done["parallel"] = prod
                done["parallel_loop"] = fused

    # Step 3. The innermost spatial loop on vectors.  A reduction keeps its init inside (lowered to a
    # lane-invariant `if` on the reduction loops): a decomposed update block is no longer a reduction
    # block, which vectorize refuses.
    if vec:
        inner = sch.get_loops(block)[-1]
        ext = _extent(sch, inner)
        ok, vectorized = _try("vectorize", name, _vectorize, sch, inner, cfg)
        if ok and vectorized:
            done["vector"] = vector_width(ext, cfg.lanes, cfg.max_whole_vectors)
    return done


def schedule_generic(func: C.PrimFunc, target: C.Target) -> tuple[C.PrimFunc, dict]:
    """The generic schedule of ``func`` for ``target``; returns (scheduled func, what was done per block).

    Symbolic extents (a loop over ``sequence``): the element count is known at run time only, so the kernel
    holds two nests joined by a run-time branch on its output's element count (``schedules.buckets``): under
    the table's ``min_parallel_elements`` the serial nest (every symbolic loop counted as one iteration, as
    before), above it the same steps with the leading spatial loops parallel (``_schedule_block``'s
    ``symbolic_parallel``).  t5_encoder_dyn's relative-position bias (4 x sequence^2 elements per batch, a log
    per element) ran serial at every size before (240 us at 128, the static build's folded one 63 us)."""
    from ..index_bounds import drop_wrapless_modulo

    cfg = GenericConfig.for_target(target)
    # before inlining too, as schedule_with does (a gather's index in place of a bounded iterator)
    func = drop_wrapless_modulo(func)
    serial, report = _schedule_nest(func, cfg, symbolic_parallel=False)
    elements = _symbolic_output_elements(func)
    if elements is None:
        return drop_wrapless_modulo(serial), report
    from ..buckets import Bucket, join_buckets, join_unit, symbolic_workspace, unit_nest, value_at

    parallel, preport = _schedule_nest(func, cfg, symbolic_parallel=True)
    bound = cfg.min_parallel_elements - 1
    at_one = value_at(elements)
    if not any(r.get("parallel") for r in preport.values()):
        joined, at_unit = serial, serial
    else:
        joined = join_buckets([serial, parallel], (Bucket(f"elements<={bound}", bound),
                                                   Bucket(f"elements>{bound}", None)), elements)
        at_unit = serial if at_one <= bound else parallel
        for r in preport.values():
            r["serial_up_to_elements"] = bound
        report = preport
    # the unit nest: when the nest run at every shape variable 1 allocates a buffer of symbolic size (a
    # run-time workspace allocation per call), a copy of it with the variables 1 (static buffers) runs there
    if cfg.unit_nest and symbolic_workspace(at_unit):
        joined = join_unit(joined, unit_nest(at_unit))
        for r in report.values():
            r["unit_nest"] = True
    # index divisions by a symbolic extent that cannot wrap dropped, as schedule_with does for the templates
    # (a reshape's flat index over [batch * 4, sequence, sequence]: deberta_v2_dyn's masked softmax)
    return drop_wrapless_modulo(joined), report


def _symbolic_output_elements(func: C.PrimFunc):
    """The element count of the kernel's largest output (its last buffer parameter; TVM's convention) when
    it is symbolic, else None."""
    bufs = [p for p in func.params if hasattr(p, "shape")]
    if not bufs:
        return None
    n = None
    for d in bufs[-1].shape:
        n = d if n is None else n * d
    return None if n is None or isinstance(n, C.tirx.IntImm) or all(isinstance(d, C.tirx.IntImm)
                                                                    for d in bufs[-1].shape) else n


# Calls TVM lowers to a libm call per element (scalar): a block computing one is not folded into consumers
# that read it more than once (each read would call it again; ``_recomputed_if_folded``).
LIBM_CALLS = frozenset({"tirx.log", "tirx.log2", "tirx.log10", "tirx.exp", "tirx.exp2", "tirx.tanh",
                        "tirx.erf", "tirx.pow", "tirx.sin", "tirx.cos"})


def _recomputed_if_folded(sch: C.Schedule, block, consumers) -> bool:
    """Folding ``block`` into its consumers would repeat its work: it computes a libm call
    (``LIBM_CALLS``, after earlier folds) read at more than one place, or more than a cheap expression
    (``common.is_cheap``) read by a consumer that iterates over more than the producer's indices (a
    broadcast: the value computed again for every element of the axes it does not depend on).
    t5_encoder_dyn's relative-position bias: the log bucket of ``j - i`` ([sequence, sequence]) was
    recomputed per batch and head of the [batch, 4, sequence, sequence] output, and its log three times per
    element (an isfinite test reads it twice, a where once)."""
    value = U.store_value(sch, block)
    if value is None:
        return False
    if _costly_indexing(value) and _reread(sch, block, consumers):
        return True
    calls = []
    C.post_order_visit(value, lambda n: calls.append(n) if isinstance(n, C.Call) and hasattr(n.op, "name")
                       and str(n.op.name) in LIBM_CALLS else None)
    if not calls and U.is_cheap(sch, block):
        return False
    buf = sch.get(block).writes[0].source
    reads = 0
    for c in consumers:
        blk = sch.get(c)
        loads = []
        C.post_order_visit(blk.body, lambda n: loads.append(n) if isinstance(n, C.TensorLoad)
                           and n.source.same_as(buf) else None)
        reads += len(loads)
        spatial = {str(iv.var.name) for iv in blk.iter_vars if int(iv.iter_type) == U.SPATIAL
                   and not (isinstance(iv.dom.extent, C.tirx.IntImm) and int(iv.dom.extent) == 1)}
        for load in loads:
            used = set()
            for idx in load.indices:
                C.post_order_visit(idx, lambda n: used.add(str(n.name)) if isinstance(n, C.tirx.Var) else None)
            if spatial - used:
                return True            # a broadcast read: recomputed per element of the missing axes
    return bool(calls) and reads > 1


def _costly_indexing(value) -> bool:
    """``value`` reads a buffer at an index that is itself loaded (a gather: a table lookup) or divides by
    a symbolic extent (a reshape over a symbolic axis): work ``common.count_ops`` does not count, since it
    sees loads as free."""
    found = []

    def index_visit(n):
        if isinstance(n, C.TensorLoad):
            found.append("gather")
        elif isinstance(n, (C.tirx.FloorDiv, C.tirx.FloorMod, C.tirx.Div, C.tirx.Mod)) and \
                not isinstance(n.b, C.tirx.IntImm):
            found.append("division")

    def visit(n):
        if isinstance(n, C.TensorLoad):
            for idx in n.indices:
                C.post_order_visit(idx, index_visit)

    C.post_order_visit(value, visit)
    return bool(found)


def _reread(sch: C.Schedule, block, consumers) -> bool:
    """A consumer reads ``block``'s buffer at indices built of more of its own spatial loop variables (of
    extent other than 1) than the buffer has axes: each element is read for many consumer elements (a
    per-diagonal table ``F[h, j - i + s]`` read by a [b, h, i, j] bias: vars b, h, i, j for 2 axes), so
    folding the producer in computes each of its elements again per read."""
    buf = sch.get(block).writes[0].source
    rank = sum(1 for d in buf.shape if not (isinstance(d, C.tirx.IntImm) and int(d) == 1))
    for c in consumers:
        blk = sch.get(c)
        spatial = {str(iv.var.name) for iv in blk.iter_vars if int(iv.iter_type) == U.SPATIAL
                   and not (isinstance(iv.dom.extent, C.tirx.IntImm) and int(iv.dom.extent) == 1)}
        loads = []
        C.post_order_visit(blk.body, lambda n: loads.append(n) if isinstance(n, C.TensorLoad)
                           and n.source.same_as(buf) else None)
        for load in loads:
            used = set()
            for idx in load.indices:
                C.post_order_visit(idx, lambda n: used.add(str(n.name)) if isinstance(n, C.tirx.Var) else None)
            if len(used & spatial) > rank:
                return True
    return False


def _schedule_nest(func: C.PrimFunc, cfg: GenericConfig, symbolic_parallel: bool) -> tuple[C.PrimFunc, dict]:
    sch = C.Schedule(func)
    U.inline_elementwise(sch, keep_if=_recomputed_if_folded)
    report: dict[str, dict] = {}
    order = [U.block_name(sch, b) for b in U.top_blocks(sch)]
    outputs = U.output_names(sch)
    # consumers first: a producer can then be computed inside its consumer's parallel loop (Step 4)
    for name in reversed(order):
        block = sch.get_sblock(name)
        consumers = list(sch.get_consumers(block))
        # (not a producer kept because folding it would recompute it: computed inside the consumer's
        # parallel loop it would be recomputed per iteration of that loop just the same)
        if len(consumers) == 1 and U.is_spatial(sch, block) and name not in outputs and \
                not _recomputed_if_folded(sch, block, consumers):
            consumer = U.block_name(sch, consumers[0])
            at = report.get(consumer, {}).get("parallel_loop")
            if at is not None and _try("compute_at", name, sch.compute_at, block, at, True)[0]:
                inner = sch.get_loops(block)[-1]
                if U.vectorizable(sch, block):
                    _try("vectorize", name, _vectorize, sch, inner, cfg)
                report[name] = {"block": name, "computed_at": consumer}
                continue
        report[name] = _schedule_block(sch, block, cfg, symbolic_parallel)
    for r in report.values():
        r.pop("parallel_loop", None)
    return sch.mod["main"], report
