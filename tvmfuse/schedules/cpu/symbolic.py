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
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ... import _compat as C
from ...analysis import CONTRACTION, REDUCTION
from ...target import cpu_info
from ..base import Config, KnobSpace, Match, knob
from . import common as U
from .matmul import is_contraction

VECTOR_MULT = (1, 2)       # vector registers per step of the innermost loop

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
    return sch.fuse(*loops[:n]) if n > 1 else loops[0]


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
    if not isinstance(ext, C.tirx.IntImm) or int(ext) > 1:
        U.vectorize_inner(sch, block, lanes)   # a symbolic extent: vector body and a predicated tail


def _product(extents):
    out = extents[0] if extents else 1
    for e in extents[1:]:
        out = out * e
    return out


def _is_unit(sch: C.Schedule, loop) -> bool:
    ext = sch.get(loop).extent
    return isinstance(ext, C.tirx.IntImm) and int(ext) == 1


def _row_rfactor(sch: C.Schedule, lanes: int) -> list[str]:
    """Vector partial sums for every plain row reduction (leading spatial iterators, then one static
    reduction axis longer than and a multiple of ``lanes``; a norm's mean and variance, not a matmul, not
    a softmax over symbolic keys): its reduction split by ``lanes`` and rfactored, so each row is reduced
    in ``lanes`` independent accumulators (vector FMAs) and then across them (as ``cpu.row_reduction`` does
    for static rows).  Returns the rf blocks' names."""
    out = []
    for block in U.top_blocks(sch):
        if not U.is_reduction(sch, block) or is_contraction(sch, block):
            continue
        kinds = U.iter_kinds(sch, block)
        lead = len(kinds) - len(kinds.lstrip("S"))
        loops = sch.get_loops(block)
        if kinds[lead:] != "R" or len(loops) != len(kinds):
            continue
        ext = sch.get(loops[-1]).extent
        if not isinstance(ext, C.tirx.IntImm) or int(ext) % lanes or int(ext) <= lanes:
            continue
        _, ri = sch.split(loops[-1], factors=[None, lanes])
        try:
            out.append(U.block_name(sch, sch.rfactor(ri, factor_axis=lead)))
        except C.ScheduleError:    # a reducer rfactor does not know: the scalar reduction stays
            continue
    return out


def _vectorize_rf(sch: C.Schedule, block) -> None:
    """An rf block computed at its row: the lanes loop innermost and vectorized, the init split off."""
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


def _apply(sch: C.Schedule, lanes: int, drop: int) -> None:
    # Step 1. Fold elementwise blocks into their consumers; row reductions on vector partial sums.
    U.inline_elementwise(sch)
    rf_blocks = _row_rfactor(sch, lanes)
    chains = _chains(sch)
    if chains is None:
        raise ValueError("a block feeds several outputs")
    for out_name, producers in chains.items():
        out_block = sch.get_sblock(out_name)
        # Step 2. The output's row loop (parallel in Step 4).
        row = _row_loop(sch, out_block, drop)
        # Step 3. Every producer computed per row (last first); a reduction computes each element once (the
        # rows times its iterations per row are its whole domain); a spatial one (a pad) may redo a halo.
        for name in reversed(producers):
            block = sch.get_sblock(name)
            sch.compute_at(block, row, preserve_unit_loops=True)
            if U.is_spatial(sch, block):
                continue
            below = sch.get_loops(block)[1:]        # the row loop is the outermost loop of the kernel
            if not C.Analyzer().can_prove_equal(_product([sch.get(lp).extent for lp in below])
                                                * sch.get(row).extent,
                                                _product([iv.dom.extent for iv in sch.get(block).iter_vars])):
                raise ValueError(f"{name} computed per row would recompute elements")
        # Step 4. The row loop parallel (before any init is split off: `parallel` needs complete blocks);
        # inside a row: reductions outside, vector lanes inside.
        sch.parallel(sch.get_loops(sch.get_sblock(out_name))[0])
        for name in producers + [out_name]:
            block = sch.get_sblock(name)
            if name in rf_blocks:
                _vectorize_rf(sch, block)
            elif U.is_reduction(sch, block) or len(sch.get_loops(block)) > 1:
                _schedule_row(sch, block, lanes)


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
                _apply(C.Schedule(func), cpu_info(target).float32_lanes, drop)
            except (ValueError,) + C.TVMError as e:
                log.debug("%s, row loop less %d: %s", self.family, drop,
                          (str(e).strip().splitlines() or [""])[-1])
                continue
            return Match(self.family, {"drop": drop})
        return None

    def space(self, match: Match, target: C.Target) -> KnobSpace:
        return SymbolicRowsConfig.space(lanes=(cpu_info(target).float32_lanes,), vector_mult=VECTOR_MULT)

    def default_config(self, match: Match, target: C.Target) -> dict:
        d = self.table_defaults(target)
        return SymbolicRowsConfig(lanes=cpu_info(target).float32_lanes,
                                  vector_mult=U.nearest_choice(VECTOR_MULT, d["vector_mult"])).asdict()

    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        cfg = SymbolicRowsConfig.from_dict(config)
        _apply(sch, cfg.lanes * cfg.vector_mult, match.info["drop"])
