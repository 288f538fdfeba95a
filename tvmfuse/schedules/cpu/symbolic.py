"""Kernels over symbolic extents (``batch``, ``seq``) that hold a reduction (matmul, conv, softmax, norm)
on CPUs: the static-shape templates tile known extents, so these otherwise get dlight's fallback or no
schedule at all.

Matches a PrimFunc with a symbolic loop extent and a reduction block when, after folding elementwise
blocks, every remaining block feeds exactly one output block and can be computed per "row" of it.
Schedule: per output block, its leading spatial loops (all but the innermost spatial one; fewer
when a producer would otherwise be recomputed) are fused into one parallel row loop; every producer
(the matmul, the reduction) is computed inside it, on one row; inside a row the reduction loops go
outside the spatial ones and the innermost spatial loop is vectorized (split by the vector lanes; over a
symbolic extent, such as a softmax over ``seq``, the last vector is predicated).

A row reduction over a static row (a norm's mean and variance) is computed on vector partial sums
(rfactor by the lanes), as ``cpu.row_reduction`` does for static rows.

Size buckets (``schedules.buckets``): a fork of the thread pool costs more than a few rows of a norm or a
softmax (``cpu.row_reduction`` keeps a static kernel serial below ``min_rows_per_core`` rows per core), so
a kernel whose row count is symbolic holds two nests, picked at run time by the rows: below
``min_rows_per_core`` x cores (the family's template_defaults in schedules/cpu_targets.json) the row loop
is serial, above it parallel.  Each nest's intermediates are its own buffers (see ``_own_intermediates``):
a buffer of both nests would be allocated whole at the kernel's root.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from ... import _compat as C
from ...analysis import CONTRACTION, REDUCTION
from ...target import cpu_info
from ..base import Config, KnobSpace, Match, knob
from ..buckets import Bucket
from . import common as U
from .matmul import is_contraction

VECTOR_MULT = (1, 2)       # vector registers per step of the innermost loop
OWN_SCOPE = "global"       # each nest's intermediate buffers (``_own_intermediates``): small ones on the stack

log = logging.getLogger("tvmfuse.schedule")


@dataclass(frozen=True)
class SymbolicRowsConfig(Config):
    """The knobs of ``cpu.symbolic_rows``."""

    lanes: int = knob("float32 lanes per vector (target)")
    vector_mult: int = knob("vector registers per step")


def _symbolic(sch: C.Schedule, block) -> list[bool]:
    return [not isinstance(sch.get(loop).extent, C.tirx.IntImm) for loop in sch.get_loops(block)]


def _chains(sch: C.Schedule) -> dict[str, list[str]] | None:
    """Output block name -> the names of the blocks that feed only it (program order); None when a block
    feeds several outputs (sibling chains sharing a producer are not split here)."""
    outputs = U.output_names(sch)
    owner: dict[str, str] = {}
    blocks = U.top_blocks(sch)
    for block in reversed(blocks):
        name = U.block_name(sch, block)
        if name in outputs:
            owner[name] = name
            continue
        owners = {owner.get(U.block_name(sch, c)) for c in sch.get_consumers(block)}
        if len(owners) != 1 or None in owners:
            return None
        owner[name] = owners.pop()
    chains: dict[str, list[str]] = {o: [] for o in outputs}
    for block in blocks:
        name = U.block_name(sch, block)
        if name not in outputs:
            chains[owner[name]].append(name)
    return chains


def _row_loop(sch: C.Schedule, out_block, drop: int):
    """Fuse the output block's leading spatial loops (all but the innermost, less ``drop`` of them) into
    the row loop; returns it."""
    loops = sch.get_loops(out_block)
    kinds = U.iter_kinds(sch, out_block)
    spatial_lead = len(kinds) - len(kinds.lstrip("S"))          # leading spatial loops
    n = max(1, spatial_lead - 1 - drop)          # the innermost spatial loop stays for the vector lanes
    if n > spatial_lead:
        raise ValueError("the output block has no leading spatial loop")
    if n == 1:
        # a fresh loop variable even for one loop: the size buckets' nests (schedules of one func) must not
        # share a loop variable bound differently in each (TVM's simplifier refuses a rebinding)
        return sch.fuse(sch.add_unit_loop(loops[0]), loops[0])
    return sch.fuse(*loops[:n])


def _own_intermediates(sch: C.Schedule) -> None:
    """Every intermediate buffer replaced by one of this schedule (``set_scope`` makes a new buffer): the
    size buckets' nests are schedules of one func, and a buffer both of them used could not shrink to one
    row (the common ancestor of its accesses would be the kernel's root).  The new buffer's scope is
    ``OWN_SCOPE`` ("global"): TVM 0.27 puts a "global" buffer under ``C.MAX_STACK_ALLOCA_BYTES`` on the
    stack, while a "local" one is a TVMBackendAllocWorkspace call (and a free) wherever it is declared,
    here once per row of the parallel row loop (gpt2_dyn's layer norms, four row buffers: 23.7 us per call
    at 128 rows vs 8.5 us static; tests/test_symbolic_index.py checks there is none per row)."""
    func = sch.mod["main"]
    params = {str(p.name) for p in func.params}
    names = []
    C.post_order_visit(func.body, lambda n: names.append(str(n.name_hint))
                       if isinstance(n, C.SBlock) and str(n.name_hint) != "root" else None)
    done = set()
    for name in names:
        block = sch.get_sblock(name)
        for i, region in enumerate(sch.get(block).writes):
            buf = str(region.source.name)
            if buf not in params and buf not in done:
                # two steps: set_scope to the scope a buffer already has keeps that (shared) buffer
                sch.set_scope(block, i, "local")
                sch.set_scope(block, i, OWN_SCOPE)
                done.add(str(sch.get(block).writes[i].source.name))
                done.add(buf)


def _schedule_row(sch: C.Schedule, block, lanes: int) -> None:
    """Inside one row: reduction loops outside, the innermost spatial loop vectorized."""
    if U.is_reduction(sch, block):
        # the loops under the row loop: one per block iterator (a producer computed at the row keeps unit
        # loops), or the output block's iterators after the ones fused into the row loop
        inner = sch.get_loops(block)[1:]
        kinds = U.iter_kinds(sch, block)
        if len(inner) > len(kinds):
            return
        kinds = kinds[len(kinds) - len(inner):]
        spatial = [lp for lp, k in zip(inner, kinds) if k == "S" and not _is_unit(sch, lp)]
        reduce = [lp for lp, k in zip(inner, kinds) if k == "R"]
        if not spatial or not reduce:
            return
        sch.reorder(*reduce, *spatial)   # the init stays in the block: "if k == 0", outside the vector
    loops = sch.get_loops(block)
    ext = sch.get(loops[-1]).extent
    if isinstance(ext, C.tirx.IntImm):
        if int(ext) > 1:
            U.vectorize_inner(sch, block, lanes)
    elif U.vectorizable(sch, block):
        _vectorize_symbolic(sch, loops[-1], lanes)   # whole vectors, then a scalar tail


PARTITION_HINT = "pragma_loop_partition_hint"


def _vectorize_symbolic(sch: C.Schedule, loop, lanes: int) -> None:
    """A loop of symbolic extent split by ``lanes``, the lanes vectorized and the outer loop hinted for
    TVM's LoopPartition: the vectors that lie wholly inside the extent run without the split's predicate
    (left on them, TVM 0.27's VectorizeLoop stores lane by lane: the whole loop scalar), the last one under
    it.  (``loop_partition``, the schedule primitive, refuses a symbolic extent.)"""
    outer, vec = sch.split(loop, factors=[None, lanes])
    sch.vectorize(vec)
    sch.annotate(outer, PARTITION_HINT, 1)


def _product(extents):
    out = extents[0] if extents else 1
    for e in extents[1:]:
        out = out * e
    return out


def _same_product(a: list, b: list) -> bool:
    """Whether the products of the extents ``a`` and ``b`` are provably equal; the factors the two share
    are cancelled first (the simplifier does not prove ``8 * ((seq + 7) // 8) * (batch * seq)`` equal to
    ``8 * batch * seq * ((seq + 7) // 8)``: an rf block of a symbolic row)."""
    ana = C.Analyzer()
    rest = list(b)
    left = []
    for x in a:
        i = next((i for i, y in enumerate(rest) if ana.can_prove_equal(x, y)), None)
        if i is None:
            left.append(x)
        else:
            rest.pop(i)
    return ana.can_prove_equal(_product(left or [1]), _product(rest or [1]))


def _is_unit(sch: C.Schedule, loop) -> bool:
    ext = sch.get(loop).extent
    return isinstance(ext, C.tirx.IntImm) and int(ext) == 1


def _row_rfactor(sch: C.Schedule, lanes: int) -> tuple[list[str], dict]:
    """Vector partial results for every plain row reduction (leading spatial iterators, then one reduction
    axis; not a matmul): its reduction split by ``lanes`` and rfactored, so each row is reduced in ``lanes``
    independent accumulators (vector steps) and then across them (as ``cpu.row_reduction`` does for static
    rows).  A static axis qualifies when longer than and a multiple of ``lanes`` (a norm's mean and
    variance); a symbolic one (a softmax's max and sum over ``sequence`` keys) when its value vectorizes:
    the last vector is under the split's predicate, kept off the whole vectors by a LoopPartition hint in
    Step 4.  Without it a symbolic row is one chain of dependent scalar steps (deberta's masked softmax at
    128 keys: 4x the time of ``cpu.generic``, benchmarks/notes/deberta19.md).
    Returns the static rows' rf block names and {symbolic rows' rf block name: row length}: the split's
    predicate is ``k_outer * lanes + k_lane < row length``, which TVM 0.27's compute_at drops
    (``_restore_predicate``)."""
    static, symbolic = [], {}
    for block in U.top_blocks(sch):
        if not U.is_reduction(sch, block) or is_contraction(sch, block):
            continue
        kinds = U.iter_kinds(sch, block)
        lead = len(kinds) - len(kinds.lstrip("S"))
        loops = sch.get_loops(block)
        if kinds[lead:] != "R" or len(loops) != len(kinds):
            continue
        extent = sch.get(loops[-1]).extent
        if isinstance(extent, C.tirx.IntImm):
            if int(extent) % lanes or int(extent) <= lanes:
                continue
        elif not U.vectorizable(sch, block):
            continue
        _, ri = sch.split(loops[-1], factors=[None, lanes])
        try:
            rf = U.block_name(sch, sch.rfactor(ri, factor_axis=lead))
        except C.ScheduleError:    # a reducer rfactor does not know: the scalar reduction stays
            continue
        if isinstance(extent, C.tirx.IntImm):
            static.append(rf)
        else:
            symbolic[rf] = extent
    return static, symbolic


def _restore_predicate(sch: C.Schedule, block, extent, lanes: int) -> None:
    """Put back the predicate ``k_outer * lanes + k_lane < extent`` of an rf block from
    ``_row_rfactor`` (a symbolic row) after compute_at, which rebuilds the block's predicate from its consumers'
    region only (TVM 0.27): without it the last vector reads past the row (the next row's values, or past
    the buffer on the last row).  The block's innermost loop is rebuilt around it (the block itself is
    unchanged and keeps its sref)."""
    loops = sch.get_loops(block)
    loop = sch.get(loops[-1])
    realize = loop.body
    blk = sch.get(block)
    if not isinstance(realize, C.SBlockRealize) or not realize.block.same_as(blk):
        raise ValueError(f"{blk.name_hint}: not the only statement of its innermost loop")
    lane_var = blk.body.indices[-1]               # the rf buffer's last axis: the partial result's lane
    pairs = list(zip(blk.iter_vars, realize.iter_values))
    lane = next(v for iv, v in pairs if iv.var.same_as(lane_var))
    outer = next(v for iv, v in pairs if int(iv.iter_type) == U.REDUCE)
    bound = outer * lanes + lane < extent
    pred = realize.predicate
    pred = bound if isinstance(pred, C.tirx.IntImm) and int(pred) == 1 else C.tirx.And(pred, bound)
    new_loop = C.tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind,
                          C.SBlockRealize(realize.iter_values, pred, blk), loop.thread_binding,
                          loop.annotations)
    sch.state.replace(sch.get_sref(loops[-1]), new_loop, {})


def _vectorize_rf(sch: C.Schedule, block):
    """An rf block computed at its row: the lanes loop innermost and vectorized, the init split off;
    returns the reduction loop outside the lanes."""
    blk = sch.get(block)
    ivs = list(blk.iter_vars)
    loops = sch.get_loops(block)[-len(ivs):]       # compute_at kept one loop per iterator (unit loops too)
    lanes_var = blk.body.indices[-1]               # the rf buffer's last axis: the partial sum's lane
    lanes_loop = loops[next(i for i, iv in enumerate(ivs) if iv.var.same_as(lanes_var))]
    outer = loops[next(i for i, iv in enumerate(ivs) if int(iv.iter_type) == U.REDUCE)]
    sch.reorder(outer, lanes_loop)
    sch.vectorize(lanes_loop)
    init = sch.decompose_reduction(block, outer)
    sch.vectorize(sch.get_loops(init)[-1])
    return outer


def _apply(sch: C.Schedule, lanes: int, drop: int, parallel: bool = True):
    """The schedule; returns the extent of the first output's row loop (what the size buckets split)."""
    # Step 1. Fold elementwise blocks into their consumers; row reductions on vector partial sums.
    U.inline_elementwise(sch)
    rf_blocks, symbolic_rf = _row_rfactor(sch, lanes)
    chains = _chains(sch)
    if chains is None:
        raise ValueError("a block feeds several outputs")
    rows, restore = [], []
    for out_name, producers in chains.items():
        out_block = sch.get_sblock(out_name)
        # Step 2. The output's row loop (parallel in Step 4 unless the bucket is serial).
        row = _row_loop(sch, out_block, drop)
        rows.append(sch.get(row).extent)
        # Step 3. Every producer computed per row (last first); a reduction computes each element once (the
        # rows times its iterations per row are its whole domain); a spatial one (a pad) may redo a halo.
        for name in reversed(producers):
            block = sch.get_sblock(name)
            sch.compute_at(block, row, preserve_unit_loops=True)
            if U.is_spatial(sch, block):
                continue
            below = sch.get_loops(block)[1:]        # the row loop is the outermost loop of the kernel
            if not _same_product([sch.get(lp).extent for lp in below] + [sch.get(row).extent],
                                 [iv.dom.extent for iv in sch.get(block).iter_vars]):
                raise ValueError(f"{name} computed per row would recompute elements")
        # Step 4. The row loop parallel (before any init is split off: `parallel` needs complete blocks);
        # inside a row: reductions outside, vector lanes inside.
        if parallel:
            sch.parallel(sch.get_loops(sch.get_sblock(out_name))[0])
        for name in producers + [out_name]:
            block = sch.get_sblock(name)
            if name in rf_blocks or name in symbolic_rf:
                outer = _vectorize_rf(sch, block)
                if name in symbolic_rf:   # the last vector under the split's predicate, whole ones without
                    sch.annotate(outer, PARTITION_HINT, 1)
                    restore.append((block, symbolic_rf[name]))
            elif U.is_reduction(sch, block) or len(sch.get_loops(block)) > 1:
                _schedule_row(sch, block, lanes)
    # Step 5. The symbolic rows' rfactor predicates back (last: a predicate over the fused lanes makes the
    # binding non-affine for the primitives above).
    for block, extent in restore:
        _restore_predicate(sch, block, extent, lanes)
    _own_intermediates(sch)
    return rows[0]


def _vars_of(expr) -> dict:
    found = {}

    def visit(node):
        if isinstance(node, C.tirx.Var):
            found.setdefault(str(node.name), node)

    C.post_order_visit(expr, visit)
    return found


def _at(expr, variables: dict, sizes: dict) -> int:
    """``expr`` with its shape variables bound to ``sizes`` (by name), as an int."""
    ana = C.Analyzer()
    for name, var in variables.items():
        ana.bind(var, C.tirx.IntImm(str(var.ty), sizes[name]))
    return int(ana.simplify(expr))


# the size each shape variable is set to, alone, to see whether a block's elements per row grow with it
_PROBE_SIZE = 8


def _row_length(func: C.PrimFunc, rows) -> int | None:
    """The most elements per row (``rows``: the row loop's extent) of any block of ``func``, at the sizes
    where that is largest: each block's domain over the rows' own shape variables (a norm's
    ``batch x sequence x 64``: 64; gpt2's position lookup ``sequence x 64`` over ``batch x sequence``
    rows: 64 / batch, at most 64) whose elements per row do not grow with any of them; blocks over static
    extents only (a few parameters) are skipped.  None when a block's domain has another shape variable
    or grows faster than the rows (a softmax over ``sequence``: symbolic per row)."""
    variables = _vars_of(rows)
    ones = {name: 1 for name in variables}
    best = None
    sch = C.Schedule(func)
    for block in U.top_blocks(sch):
        domain = _product([iv.dom.extent for iv in sch.get(block).iter_vars])
        used = _vars_of(domain)
        if not used:
            continue
        if not set(used) <= set(variables):
            return None
        base = _at(domain, variables, ones) / max(1, _at(rows, variables, ones))
        for name in variables:
            probe = {**ones, name: _PROBE_SIZE}
            if _at(domain, variables, probe) / _at(rows, variables, probe) > base:
                return None
        best = max(best or 0, math.ceil(base))
    return best


class SymbolicRows(U.CpuTemplate, family="cpu.symbolic_rows", config=SymbolicRowsConfig):
    def accepts(self, group, target: C.Target) -> str | None:
        """A group with a symbolic extent and a reduction or matmul/conv.  Whether every block can be
        computed per row of its output only the schedule tells (``match`` tries it on the fused kernel);
        a kernel it refuses gets the generic schedule, which is what the unfused ops would get too."""
        if group.is_static():
            return "static extents (the static templates take those)"
        if not group.of_kind(REDUCTION, CONTRACTION):
            return "no reduction (cpu.elementwise takes symbolic elementwise kernels)"
        return None

    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        sch = C.Schedule(func)
        blocks = U.top_blocks(sch)
        if not any(any(_symbolic(sch, b)) for b in blocks):
            return None
        if not any(U.is_reduction(sch, b) for b in blocks):
            return None   # all spatial: the elementwise template takes symbolic extents already
        if not all(U.is_spatial(sch, b) or U.is_reduction(sch, b) for b in blocks):
            return None
        # The schedule itself is the check (compute-at regions, loop kinds), tried on copies: the widest
        # row loop first, then with fewer loops fused into it, until every producer fits in a row.
        depth = max(len(sch.get_loops(b)) for b in blocks)
        for drop in range(depth):
            try:
                rows = _apply(C.Schedule(func), cpu_info(target).float32_lanes, drop)
            except (ValueError,) + C.TVMError as e:
                log.debug("%s, row loop less %d: %s", self.family, drop,
                          (str(e).strip().splitlines() or [""])[-1])
                continue
            return Match(self.family, {"drop": drop, "rows": rows, "row_len": _row_length(func, rows)})
        return None

    # ------------------------------------------------------------------ size buckets
    def buckets(self, match: Match, target: C.Target) -> tuple[Bucket, ...]:
        """Symbolic rows: a serial nest up to ``min_rows_per_core`` x cores - 1 rows, or (more) the rows
        whose elements stay under the fork/join cost (``common.serial_batches`` of the static row length,
        ``row_len``: what a static build's ``parallel`` default decides at those sizes, and
        ``cpu.row_reduction``'s bound over symbolic rows), a parallel one above (static rows, or a target
        with one core and one row per core: one parallel nest).  gpt2_dyn's LayerNorm kernels at 17 rows of
        64: two parallel loops (two thread-pool launches) on 1k elements, 3.7 us per call against the
        static build's serial 0.9 (2 threads, in the model, under load; benchmarks/notes/symmm11.md)."""
        serial = int(self.table_defaults(target)["min_rows_per_core"]) * cpu_info(target).cores - 1
        if serial >= 1 and match.info.get("row_len"):
            serial = max(serial, U.serial_batches(match.info["row_len"], target))
        if isinstance(match.info["rows"], C.tirx.IntImm) or serial < 1:
            return ()
        return Bucket(f"rows<={serial}", serial), Bucket(f"rows>{serial}", None)

    def bucket_match(self, match: Match, bucket: Bucket) -> Match:
        """A bounded bucket's nest is serial."""
        return Match(self.family, {**match.info, "bucket": bucket.name, "parallel": bucket.max_extent is None})

    def dispatch_extent(self, match: Match):
        return match.info["rows"]

    def bucket_sizes(self, match: Match, bucket: Bucket, target: C.Target) -> dict[str, int]:
        """The shape variables a tuner binds to measure ``bucket``'s nest: the rows at the bucket's bound
        (the open one: one more than the bound) on one symbol of the row count, the others 1."""
        bound = max(b.max_extent for b in self.buckets(match, target) if b.max_extent is not None)
        rows = bucket.max_extent if bucket.max_extent is not None else bound + 1
        names = []
        C.post_order_visit(match.info["rows"], lambda n: names.append(str(n.name))
                           if isinstance(n, C.tirx.Var) and str(n.name) not in names else None)
        if not names:
            raise ValueError(f"row extent {match.info['rows']}: no shape variable to bind")
        return {n: (rows if i == len(names) - 1 else 1) for i, n in enumerate(names)}

    def space(self, match: Match, target: C.Target) -> KnobSpace:
        return SymbolicRowsConfig.space(lanes=(cpu_info(target).float32_lanes,), vector_mult=VECTOR_MULT)

    def default_config(self, match: Match, target: C.Target) -> dict:
        d = self.table_defaults(target)
        return SymbolicRowsConfig(lanes=cpu_info(target).float32_lanes,
                                  vector_mult=U.nearest_choice(VECTOR_MULT, d["vector_mult"])).asdict()

    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        cfg = SymbolicRowsConfig.from_dict(config)
        _apply(sch, cfg.lanes * cfg.vector_mult, match.info["drop"], match.info.get("parallel", True))
