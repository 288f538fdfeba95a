"""Sibling matmuls in one PrimFunc on CPUs: Q/K/V projections, SwiGLU's gate/up, several heads of one input.

Matches, after folding elementwise blocks, two or more matmul reduction blocks (``C_s += A[.., i, k] *
B_s[.., k, j]``, each recognized by ``matmul.analyze_matmul``) with the same rows (the same M and batch)
grouped into *chains*: a chain ends in one output block, either an elementwise epilogue that reads each of
its matmuls at its own indices (bias, activation; SwiGLU's ``silu(gate) * up`` reads two), or a matmul
that is itself an output (Q, K, V).  Every matmul belongs to exactly one chain.

The rows may carry batch axes (Q/K/V over [B, S, H] activations; see ``matmul.analyze_matmul``); columns
that no register-tile width divides are padded as in ``MatmulEpilogue`` (``pad_n``).

Schedule: each chain is tiled like ``MatmulEpilogue`` (macro tiles ``mc x nc``, register tiles
``mr x nr``, its matmuls computed on the register tile so that no C of full size is left and the epilogue
runs on the accumulators).  The chains' outer row loops (batch and the row block ``i0``) are then merged
into one parallel loop: one block of rows of the shared input ``A`` (``mc x K``) is loaded into cache once
and used by every sibling before the next row block is touched.
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import _compat as C
from ...analysis import CONTRACTION, REDUCTION
from ...target import cpu_info
from ..base import KnobSpace, Match, knob
from . import common as U
from .matmul import (FLATTEN_BATCH, PAD_N, RegisterTileConfig, analyze_matmul, compute_on_register_tile,
                     epilogue_of, flatten_matmul, flattenable, matmul_roles, pad_columns, pick_lanes,
                     predicated_tile_exclusion, register_tile_choices, register_tile_default, row_map,
                     table_accumulator_cap)

SHARE_ROWS = (True, False)       # merge the siblings' row-block loops (one A row block for all of them)
ORDERS = ("rows", "cols")        # outer loop of each chain: row blocks of A, or column panels of B
PACK_B = (False, True)           # copy each matmul's B panel (K x nc) into a contiguous buffer first
# The row blocks per core the default aims for when it sizes mc (load balance of the parallel row loop):
# ``row_blocks_per_core`` of the family's template_defaults in schedules/cpu_targets.json.


@dataclass(frozen=True)
class SiblingsConfig(RegisterTileConfig):
    """The knobs of ``cpu.sibling_matmuls``: the register tile of every chain, and how the chains share rows."""

    share_rows: bool = knob("merge the siblings' row-block loops: A's row block is loaded once for all of them",
                            SHARE_ROWS)
    order: str = knob("outer (parallel) loop of each chain: 'rows' (A row blocks, shared by the siblings with "
                      "share_rows) or 'cols' (B column panels: each panel read, or packed, once)", ORDERS)
    pack_b: bool = knob("copy each matmul's B panel into a contiguous buffer at the panel loop (weights with a "
                        "long row stride: one cache line and page per k step otherwise)", PACK_B)
    pad_n: bool = knob("columns not a multiple of the register tile: pad j (B panel zero-padded) instead of "
                       "a per-lane predicate (scalar code) on the register tile", PAD_N)
    flatten_batch: bool = knob("weights shared by the batches: their rows as one M (each B panel read once)",
                               FLATTEN_BATCH)


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def rows_key(info: dict) -> tuple[str, ...]:
    """The rows of an analysed matmul (M and the batch extents, static or symbolic) as a comparable key."""
    return (str(info["M"]), *(str(b) for b in info["batch"]))


def output_chains(sch: C.Schedule, reductions: list) -> list[tuple[str | None, list[str]]] | None:
    """[(output block or None, [matmul names])]: None as the output means the matmul is the output."""
    outputs = U.output_names(sch)
    by_anchor: dict[str, list[str]] = {}
    chains: list[tuple[str | None, list[str]]] = []
    for red, info in reductions:
        name = U.block_name(sch, red)
        epi = epilogue_of(sch, red, info["c_buffer"])
        if epi is None:
            return None
        if epi == "none":
            if name not in outputs:
                return None
            chains.append((None, [name]))
            continue
        if name in outputs:
            return None          # C is both an output and read by an epilogue: it cannot shrink to a tile
        epi_name = U.block_name(sch, epi)
        if epi_name not in outputs or sch.get_consumers(epi):
            return None
        if epi_name not in by_anchor:
            by_anchor[epi_name] = []
            chains.append((epi_name, by_anchor[epi_name]))
        by_anchor[epi_name].append(name)
    return chains


class SiblingMatmuls(U.CpuTemplate, family="cpu.sibling_matmuls", config=SiblingsConfig):
    # ------------------------------------------------------------------ match
    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        sch = C.Schedule(func)
        left = U.inline_elementwise(sch)
        blocks = [sch.get_sblock(n) for n in left]
        non_spatial = [b for b in blocks if not U.is_spatial(sch, b)]
        if len(non_spatial) < 2:
            return None
        reductions = []
        for b in non_spatial:
            if not U.is_reduction(sch, b):
                return None
            info = self.analyze(sch, b, target)
            if info is None:
                return None
            reductions.append((b, info))
        first = reductions[0][1]
        if len({rows_key(r) for _, r in reductions}) != 1:
            return None
        chains = output_chains(sch, reductions)
        if chains is None:
            return None
        infos = {U.block_name(sch, b): r for b, r in reductions}
        for anchor, reds in chains:
            if len({infos[r]["N"] for r in reds}) != 1:
                return None
            if anchor is not None and len(U.loop_extents(sch, sch.get_sblock(anchor))) != len(first["batch"]) + 2:
                return None
        in_chain = {a for a, _ in chains if a is not None} | set(infos)
        others = [n for n in left if n not in in_chain]
        if any(not U.is_spatial(sch, sch.get_sblock(n)) for n in others):
            return None
        return self.finish(func, Match(self.family, {
            "M": first["M"], "batch": first["batch"],
            "N": max(r["N"] for r in infos.values()), "K": max(r["K"] for r in infos.values()),
            "chains": [[a, list(r)] for a, r in chains], "others": others,
            "inputs": sorted({r["a_buffer"] for r in infos.values()}),
            "b_buffers": {name: r["b_buffer"] for name, r in infos.items()},
            "chain_len": max(len(r) for _, r in chains),
            "Ns": {name: r["N"] for name, r in infos.items()},
            "infos": {name: {"j_iter": r["j_iter"], "n_iters": r["n_iters"]} for name, r in infos.items()},
            "flattenable": all(flattenable(r) for r in infos.values()),
            "M_rows": first["M"],
            "rows": first["M"] * _prod(first["batch"]) if all(flattenable(r) for r in infos.values())
            else first["M"],
        }), target)

    def analyze(self, sch: C.Schedule, red, target: C.Target) -> dict | None:
        """The roles of one matmul block (``analyze_matmul``: static extents; a subclass matches others)."""
        return analyze_matmul(sch, red)

    def finish(self, func: C.PrimFunc, match: Match, target: C.Target) -> Match | None:
        """The match of the siblings' roles (a subclass completes or refuses it)."""
        return match

    def wrong_extents(self, group) -> str | None:
        """For ``accepts``: why the group's extents are not this family's (static ones), or None."""
        return None if group.is_static() else "symbolic extents (cpu.symbolic_siblings takes those)"

    def accepts(self, group, target: C.Target) -> str | None:
        """Static shapes (``wrong_extents``), two or more matmul anchors (each ``analyze`` on its PrimFunc)
        over the same rows, only matmuls (no conv) and no row reduction."""
        anchors, contractions = U.matmul_anchors(group), group.of_kind(CONTRACTION)
        why = self.wrong_extents(group)
        if why is not None:
            return why
        if len(anchors) < 2 or len(anchors) != len(contractions):
            return f"{len(contractions)} matmul/conv anchors, {len(anchors)} of them matmuls (this family " \
                   "tiles two or more matmuls of one input)"
        if group.of_kind(REDUCTION):
            return "a row reduction beside the matmuls"
        roles = [(m.name, matmul_roles(m.func, lambda sch, red: self.analyze(sch, red, target))) for m in anchors]
        bad = [name for name, r in roles if r is None]
        if bad:
            return f"{bad[0]} is not C += A * B with one i, j and k axis ({self.family}'s extents)"
        if len({rows_key(r) for _, r in roles}) != 1:
            return "the matmuls have different rows (M or batch)"
        return None

    # ------------------------------------------------------------------ knobs
    def space(self, match: Match, target: C.Target) -> KnobSpace:
        m, n, k = match.info.get("rows", match.info["M"]), match.info["N"], match.info["K"]
        only = {"share_rows": (False,)} if len(match.info["chains"]) < 2 else {}     # one chain: nothing to share
        if not match.info.get("flattenable"):
            only["flatten_batch"] = (False,)
        return SiblingsConfig.space(**register_tile_choices(m, n, k, cpu_info(target).float32_lanes), **only,
                                    exclusions=(predicated_tile_exclusion(match.info["Ns"].values()),))

    def accumulator_cap(self, lanes: int) -> int | None:
        """The most accumulator vectors a default register tile may hold (None: the table's
        ``stack_accumulator`` decides, ``matmul.table_accumulator_cap``; cpu.symbolic_siblings keeps them on
        the stack)."""
        return None

    def default_config(self, match: Match, target: C.Target) -> dict:
        info, d = cpu_info(target), self.table_defaults(target)
        ch = {kb.name: kb.choices for kb in self.space(match, target).knobs}
        m, n, k = match.info.get("rows", match.info["M"]), match.info["N"], match.info["K"]
        ns = set(match.info["Ns"].values())
        lanes = pick_lanes(m, ns.pop(), info.float32_lanes) if len(ns) == 1 else info.float32_lanes
        cap = self.accumulator_cap(lanes)
        tile = register_tile_default(m, n, k, lanes, info, ch, d,
                                     cap if cap is not None else table_accumulator_cap(d, lanes),
                                     whole_rows=not self.buckets(match, target))
        mr, nr, mc_tiles = tile["mr"], tile["nvec"] * lanes, tile["mc_tiles"]
        # the row-block loop is the parallel one: keep enough row blocks for every core
        batch = 1 if match.info.get("flattenable") else _prod(match.info["batch"])
        want_blocks = d["row_blocks_per_core"] * info.cores
        while mc_tiles > min(ch["mc_tiles"]) and batch * -(-m // (mr * mc_tiles)) < want_blocks:
            mc_tiles = max(c for c in ch["mc_tiles"] if c < mc_tiles)
        order, pack = _default_order_pack(match, info, k, n, nr, d["row_blocks_per_core"])
        # one register-tile strip per panel when packed: the packed strip is contiguous
        nc_tiles = min(ch["nc_tiles"]) if pack else tile["nc_tiles"]
        share = True in ch["share_rows"] and order == "rows"
        return SiblingsConfig(**{**tile, "mc_tiles": mc_tiles, "nc_tiles": nc_tiles}, share_rows=share,
                              order=order, pack_b=pack, pad_n=d["pad_n"],
                              flatten_batch=bool(match.info.get("flattenable"))).asdict()

    # ------------------------------------------------------------------ apply
    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        info, cfg = match.info, SiblingsConfig.from_dict(config)
        mr, lanes = cfg.mr, cfg.lanes
        nr = cfg.nvec * lanes
        nbatch = len(info["batch"])
        cols = cfg.order == "cols"

        # Step 1. Fold the elementwise chains into their epilogue blocks (same folding as match()).
        U.inline_elementwise(sch)

        tops, tiles, pads = [], [], {}
        flat = cfg.flatten_batch and info.get("flattenable", False)
        row_info = {"batch": info["batch"], "M": info["M_rows"]}
        if flat:
            nbatch = 0
        for anchor, reds in info["chains"]:
            # Step 2. Columns not a multiple of the register tile: pad each matmul's j domain (its B
            # panel zero-padded in Step 5), so the register tile has no per-lane predicate.
            # Step 2b. A matmul that is an output accumulates into a cache block written back from it.
            epi = chain_output_block(sch, info, anchor, reds, nr, cfg.pad_n, pads)

            # Step 2c. Weights shared by the batches: the batch rows flattened into M (2-D from here on).
            if flat:
                for red in reds:
                    flatten_matmul(sch, sch.get_sblock(red), row_info)
                sch.transform_block_layout(epi, row_map(row_info, 1))

            # Step 3. Tile the chain's output: [batch, row block i0], j0, i1, j1, register tile (i2, j2).
            loops = sch.get_loops(epi)
            b_loops, i_loop, j_loop = loops[:nbatch], loops[nbatch], loops[nbatch + 1]
            i0, i1, i2 = sch.split(i_loop, factors=[None, cfg.mc_tiles, mr])
            j0, j1, j2 = sch.split(j_loop, factors=[None, cfg.nc_tiles, nr])
            if cols:
                sch.reorder(*b_loops, j0, i0, i1, j1, i2, j2)
                tops.append(sch.fuse(*b_loops, j0) if b_loops else j0)
                panel = tops[-1]
            else:
                sch.reorder(*b_loops, i0, j0, i1, j1, i2, j2)
                tops.append(sch.fuse(*b_loops, i0) if b_loops else i0)
                panel = j0
            tiles.append((reds, j1, j2, panel))

        # Step 4. One parallel row-block loop for all siblings (A's row block shared), or one each.
        # (Before the matmuls move in: `parallel` needs complete blocks, not split-off inits.)
        # A subclass's match may mark a nest serial (a few rows: a fork of the thread pool costs more).
        if cfg.share_rows and len(tops) > 1 and not cols:
            tops = [sch.merge(*tops)]
        for top in ([] if info.get("serial", False) else tops):
            sch.parallel(top)

        packs = []
        for reds, j1, j2, panel in tiles:
            # Step 5. Every matmul of the chain on the register tile (accumulators, init vectorized);
            # with pack_b, its B panel (K x nc) is first copied contiguously, once per panel iteration.
            # The copies are vectorized after every matmul is in place: a copy's vector main loop and
            # tail (``partition_tail``) leave opaque blocks under the panel loop, and a later compute_at
            # into that scope would fail (panels wider than N with two or more matmuls, or chains
            # sharing one panel loop).
            for red in reds:
                blk = sch.get_sblock(red)        # after this step: the update block (the init split off)
                compute_on_register_tile(sch, blk, j1, lanes, cfg.k_unroll)
                if red in pads:
                    pack = sch.get_sblock(pads[red])
                    sch.compute_at(pack, panel, preserve_unit_loops=True)
                    packs.append(pack)
                elif cfg.pack_b:
                    reads = [str(r.source.name) for r in sch.get(blk).reads]
                    pack = sch.cache_read(blk, reads.index(info["b_buffers"][red]), "global")
                    sch.compute_at(pack, panel, preserve_unit_loops=True)
                    packs.append(pack)

            # Step 6. The epilogue (or write-back) on the register tile, vectorized along j.
            _, e_jv = sch.split(j2, factors=[None, lanes])
            sch.vectorize(e_jv)
        for pack in packs:
            U.vectorize_inner(sch, pack, lanes)

        # Step 7. Leftover elementwise producers: fused, parallel, vectorized on their own.
        for name in info["others"]:
            U.schedule_injective(sch, sch.get_sblock(name), lanes)


def chain_output_block(sch: C.Schedule, info: dict, anchor, reds: list, nr: int, pad_n: bool, pads: dict):
    """The block a matmul chain's register tile is computed at (shared with cpu.norm_matmul): with
    ``pad_n`` and N not a multiple of ``nr``, each matmul's j domain padded (``pads[red]`` gets its padded
    B buffer) and the padded accumulator's write-back; else a cache block for a chain with no epilogue
    (the matmul is an output), else the epilogue ``anchor``."""
    writeback = None
    if pad_n and info["Ns"][reds[0]] % nr:
        for red in reds:
            wb, pads[red] = pad_columns(sch, sch.get_sblock(red), info["infos"][red], nr)
            writeback = writeback or wb
    if writeback is not None:
        return sch.get_sblock(writeback)
    if anchor is None:
        return sch.cache_write(sch.get_sblock(reds[0]), 0, "global")
    return sch.get_sblock(anchor)


def _default_order_pack(match: Match, info, k: int, n: int, nr: int, row_blocks_per_core: int) -> tuple[str, bool]:
    """('cols', True) when the chain's register-tile strips of B (K rows of nr floats each, N floats apart)
    take more than a quarter of L1: each B panel is then packed once and read contiguously, where 'rows'
    re-reads it with its long row stride (a cache line and often a page per k step) for every row block.
    Measured (2-core znver3, 1 thread): SwiGLU 512x768x2048 155 -> 46 ms, Q/K/V 128x192 0.44 -> 0.35 ms.
    Else ('rows', False): a short K keeps the strips in L1 and the shared row blocks win."""
    strip = match.info["chain_len"] * k * nr * 4
    batch = 1 if match.info.get("flattenable") else _prod(match.info["batch"])
    panels = batch * -(-n // nr)          # iterations of the parallel panel loop (nc_tiles = 1)
    if strip > info.l1d_bytes // 4 and panels >= row_blocks_per_core * info.cores:
        return "cols", True
    return "rows", False
