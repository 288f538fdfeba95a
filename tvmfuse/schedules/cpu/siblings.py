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

from ... import _compat as C
from ...target import cpu_info
from ..base import Knob, KnobSpace, Match, Template
from . import common as U
from .matmul import (FLATTEN_BATCH, K_UNROLL, MC_TILES, MR_CHOICES, NC_TILES, NVEC_CHOICES, PAD_N, epilogue_of,
                     row_map, analyze_matmul, compute_on_register_tile, flatten_matmul, flattenable,
                     lane_choices, pad_columns, pick_lanes, pick_macro_tiles, pick_register_tile)

SHARE_ROWS = (True, False)       # merge the siblings' row-block loops (one A row block for all of them)
ORDERS = ("rows", "cols")        # outer loop of each chain: row blocks of A, or column panels of B
PACK_B = (False, True)           # copy each matmul's B panel (K x nc) into a contiguous buffer first
# Row blocks per core the default aims for when it sizes mc (load balance of the parallel row loop).
ROW_BLOCKS_PER_CORE = 2


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


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


class SiblingMatmuls(Template):
    family = "cpu.sibling_matmuls"
    target_kinds = ("llvm",)

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
            info = analyze_matmul(sch, b)
            if info is None:
                return None
            reductions.append((b, info))
        first = reductions[0][1]
        if any(r["M"] != first["M"] or r["batch"] != first["batch"] for _, r in reductions):
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
        return Match(self.family, {
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
        })

    # ------------------------------------------------------------------ knobs
    def space(self, match: Match, target: C.Target) -> KnobSpace:
        m, n, k = match.info.get("rows", match.info["M"]), match.info["N"], match.info["K"]
        lanes = cpu_info(target).float32_lanes
        return KnobSpace((
            Knob("mr", U.choices_upto(MR_CHOICES, m), "rows of the register tile"),
            Knob("nvec", U.choices_upto(NVEC_CHOICES, max(1, -(-n // lanes))), "vectors per register-tile row"),
            Knob("lanes", lane_choices(lanes), "float32 lanes per vector (the target's width, or half)"),
            Knob("mc_tiles", U.choices_upto(MC_TILES, max(1, m)), "register tiles per row block (shared A)"),
            Knob("nc_tiles", U.choices_upto(NC_TILES, max(1, -(-n // lanes))), "register tiles per macro tile along j"),
            Knob("k_unroll", U.choices_upto(K_UNROLL, k), "unroll of the reduction loop"),
            Knob("share_rows", SHARE_ROWS if len(match.info["chains"]) > 1 else (False,),
                 "merge the siblings' row-block loops: A's row block is loaded once for all of them"),
            Knob("order", ORDERS, "outer (parallel) loop of each chain: 'rows' (A row blocks, shared by the "
                 "siblings with share_rows) or 'cols' (B column panels: each panel read, or packed, once)"),
            Knob("pack_b", PACK_B, "copy each matmul's B panel into a contiguous buffer at the panel loop "
                 "(weights with a long row stride: one cache line and page per k step otherwise)"),
            Knob("pad_n", PAD_N, "columns not a multiple of the register tile: pad j (B panel zero-padded) "
                 "instead of a per-lane predicate (scalar code) on the register tile"),
            Knob("flatten_batch", FLATTEN_BATCH if match.info.get("flattenable") else (False,),
                 "weights shared by the batches: their rows as one M (each B panel read once)"),
        ))

    def default_config(self, match: Match, target: C.Target) -> dict:
        info = cpu_info(target)
        regs = U.Registers.for_bits(info.vector_bits).count
        ch = {kb.name: kb.choices for kb in self.space(match, target).knobs}
        m, n, k = match.info.get("rows", match.info["M"]), match.info["N"], match.info["K"]
        ns = set(match.info["Ns"].values())
        lanes = pick_lanes(m, ns.pop(), info.float32_lanes) if len(ns) == 1 else info.float32_lanes
        mr, nvec = pick_register_tile(m, n, lanes, regs, ch["mr"], ch["nvec"])
        nr = nvec * lanes
        mc_tiles, nc_tiles = pick_macro_tiles(k, mr, nr, info.l2_bytes, ch["mc_tiles"], ch["nc_tiles"])
        # the row-block loop is the parallel one: keep enough row blocks for every core
        batch = 1 if match.info.get("flattenable") else _prod(match.info["batch"])
        want_blocks = ROW_BLOCKS_PER_CORE * info.cores
        while mc_tiles > min(ch["mc_tiles"]) and batch * -(-m // (mr * mc_tiles)) < want_blocks:
            mc_tiles = max(c for c in ch["mc_tiles"] if c < mc_tiles)
        order, pack = _default_order_pack(match, info, k, n, nr)
        if pack:
            nc_tiles = min(ch["nc_tiles"])    # one register-tile strip per panel: the packed strip is contiguous
        share = True in ch["share_rows"] and order == "rows"
        return {"mr": mr, "nvec": nvec, "lanes": lanes, "mc_tiles": mc_tiles, "nc_tiles": nc_tiles,
                "k_unroll": U.nearest_choice(ch["k_unroll"], 4 if k % 4 == 0 else 1),
                "share_rows": share, "order": order, "pack_b": pack, "pad_n": True,
                "flatten_batch": bool(match.info.get("flattenable"))}

    # ------------------------------------------------------------------ apply
    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        info = match.info
        mr, lanes = config["mr"], config["lanes"]
        nr = config["nvec"] * lanes
        nbatch = len(info["batch"])
        cols = config.get("order", "rows") == "cols"

        # Step 1. Fold the elementwise chains into their epilogue blocks (same folding as match()).
        U.inline_elementwise(sch)

        tops, tiles, pads = [], [], {}
        flat = config.get("flatten_batch", False) and info.get("flattenable", False)
        row_info = {"batch": info["batch"], "M": info["M_rows"]}
        if flat:
            nbatch = 0
        for anchor, reds in info["chains"]:
            # Step 2. Columns not a multiple of the register tile: pad each matmul's j domain (its B
            # panel zero-padded in Step 5), so the register tile has no per-lane predicate.
            # Step 2b. A matmul that is an output accumulates into a cache block written back from it.
            writeback = None
            if config.get("pad_n", False) and info["Ns"][reds[0]] % nr:
                for red in reds:
                    wb, pads[red] = pad_columns(sch, sch.get_sblock(red), info["infos"][red], nr)
                    writeback = writeback or wb
            if writeback is not None:
                epi = sch.get_sblock(writeback)
            elif anchor is None:
                epi = sch.cache_write(sch.get_sblock(reds[0]), 0, "global")
            else:
                epi = sch.get_sblock(anchor)

            # Step 2c. Weights shared by the batches: the batch rows flattened into M (2-D from here on).
            if flat:
                for red in reds:
                    flatten_matmul(sch, sch.get_sblock(red), row_info)
                sch.transform_block_layout(epi, row_map(row_info, 1))

            # Step 3. Tile the chain's output: [batch, row block i0], j0, i1, j1, register tile (i2, j2).
            loops = sch.get_loops(epi)
            b_loops, i_loop, j_loop = loops[:nbatch], loops[nbatch], loops[nbatch + 1]
            i0, i1, i2 = sch.split(i_loop, factors=[None, config["mc_tiles"], mr])
            j0, j1, j2 = sch.split(j_loop, factors=[None, config["nc_tiles"], nr])
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
        if config["share_rows"] and len(tops) > 1 and not cols:
            sch.parallel(sch.merge(*tops))
        else:
            for top in tops:
                sch.parallel(top)

        for reds, j1, j2, panel in tiles:
            # Step 5. Every matmul of the chain on the register tile (accumulators, init vectorized);
            # with pack_b, its B panel (K x nc) is first copied contiguously, once per panel iteration.
            for red in reds:
                blk = sch.get_sblock(red)        # after this step: the update block (the init split off)
                compute_on_register_tile(sch, blk, j1, lanes, config["k_unroll"])
                if red in pads:
                    pack = sch.get_sblock(pads[red])
                    sch.compute_at(pack, panel, preserve_unit_loops=True)
                    U.vectorize_inner(sch, pack, lanes)
                elif config.get("pack_b"):
                    reads = [str(r.source.name) for r in sch.get(blk).reads]
                    pack = sch.cache_read(blk, reads.index(info["b_buffers"][red]), "global")
                    sch.compute_at(pack, panel, preserve_unit_loops=True)
                    U.vectorize_inner(sch, pack, lanes)

            # Step 6. The epilogue (or write-back) on the register tile, vectorized along j.
            _, e_jv = sch.split(j2, factors=[None, lanes])
            sch.vectorize(e_jv)

        # Step 7. Leftover elementwise producers: fused, parallel, vectorized on their own.
        for name in info["others"]:
            U.schedule_injective(sch, sch.get_sblock(name), lanes)


def _default_order_pack(match: Match, info, k: int, n: int, nr: int) -> tuple[str, bool]:
    """('cols', True) when the chain's register-tile strips of B (K rows of nr floats each, N floats apart)
    take more than a quarter of L1: each B panel is then packed once and read contiguously, where 'rows'
    re-reads it with its long row stride (a cache line and often a page per k step) for every row block.
    Measured (2-core znver3, 1 thread): SwiGLU 512x768x2048 155 -> 46 ms, Q/K/V 128x192 0.44 -> 0.35 ms.
    Else ('rows', False): a short K keeps the strips in L1 and the shared row blocks win."""
    strip = match.info["chain_len"] * k * nr * 4
    batch = 1 if match.info.get("flattenable") else _prod(match.info["batch"])
    panels = batch * -(-n // nr)          # iterations of the parallel panel loop (nc_tiles = 1)
    if strip > info.l1d_bytes // 4 and panels >= ROW_BLOCKS_PER_CORE * info.cores:
        return "cols", True
    return "rows", False
