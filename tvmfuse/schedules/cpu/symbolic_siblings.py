"""Sibling matmuls (Q/K/V, SwiGLU's gate/up: several matmuls of one input) over a symbolic number of rows
(``[batch, seq, K] @ [K, N_s]``: rows = batch x seq known only at run time, every N_s and K static).

``cpu.sibling_matmuls`` needs static rows; without this family such a kernel gets ``cpu.symbolic_rows``
(one row at a time: every row reads every weight, no register tile).  Here ``cpu.sibling_matmuls``'s
schedule (its ``SiblingsConfig`` and ``apply``: chains tiled on register tiles, the row-block loops of the
chains merged so the shared input's row block is read once) runs over the symbolic rows the way
``cpu.symbolic_matmul`` runs ``cpu.matmul_epilogue``'s: batch and sequence flattened into one row axis,
the last row tile predicated, and the same size buckets (``symbolic_matmul.RowBuckets``): up to
``small_rows`` a GEMV-like nest (one row per register tile, one parallel loop over the rows), above it
the row-tiled nest with the loop-partition hint (whole row tiles lose the per-row predicate); below
``serial_rows_per_core`` rows per core the GEMV-like nest is serial (``RowBuckets.buckets``: a fork of the
thread pool costs more than the work of a row or two).

Matches what ``cpu.sibling_matmuls`` matches when every matmul is ``analyze_symbolic_matmul``'s (symbolic
rows, static N and K, a weight shared by the batches).  Where no register tile divides N (llama's SwiGLU,
172 columns) the row-tiled nest pads the columns (``pad_n``, as ``cpu.sibling_matmuls`` does) and the
GEMV-like nests take the widest vector that divides N (``small_lanes``); before, such a kernel got
``cpu.symbolic_rows`` (608 us per call at 128 rows against 70 us now; tests/test_symbolic_index.py).
"""
from __future__ import annotations

from ... import _compat as C
from ...target import cpu_info
from ..base import KnobSpace, Match
from . import matmul as MM
from .siblings import SiblingMatmuls, SiblingsConfig
from .symbolic_matmul import SYM_MR_CHOICES, RowBuckets, analyze_symbolic_matmul, partition_row_tiles


class SymbolicSiblings(RowBuckets, SiblingMatmuls, family="cpu.symbolic_siblings"):
    """``cpu.sibling_matmuls``'s schedule over a symbolic row count (see the module docstring)."""

    def analyze(self, sch: C.Schedule, red, target: C.Target) -> dict | None:
        # N need not be a multiple of the vector width: such siblings get their columns padded (pad_n)
        return analyze_symbolic_matmul(sch, red)

    def finish(self, func: C.PrimFunc, match: Match, target: C.Target) -> Match | None:
        # the register tiles are sized for the table's nominal row count (rows are known at run time only)
        return self.if_every_bucket_schedules(func, self.match_rows(match, target), target)

    def wrong_extents(self, group) -> str | None:
        return "static extents (cpu.sibling_matmuls takes those)" if group.is_static() else None

    # ------------------------------------------------------------------ knobs
    def space(self, match: Match, target: C.Target) -> KnobSpace:
        ns, k, m = set(match.info["Ns"].values()), match.info["K"], match.info["rows"]
        small = match.info.get("small", False)
        lanes = small_lanes(ns, cpu_info(target).float32_lanes) if small else cpu_info(target).float32_lanes
        choices = MM.register_tile_choices(m, max(ns), k, lanes)
        dividing = tuple(v for v in MM.NVEC_CHOICES if all(n % (v * lanes) == 0 for n in ns))
        return SiblingsConfig.space(**{
            **choices,
            # few rows: one row per register tile and per row block (no row tiling, no wasted rows)
            **({"mr": (1,), "mc_tiles": (1,)} if small else {"mr": SYM_MR_CHOICES, "mc_tiles": MM.MC_TILES}),
            # register tiles that divide every sibling's N: no column tail; where none does (SwiGLU's
            # 172 columns), any register tile, the columns padded to it
            "nvec": dividing or MM.NVEC_CHOICES[:max(1, min(len(MM.NVEC_CHOICES), -(-max(ns) // lanes)))],
            "lanes": (lanes,),
            "share_rows": (True, False) if len(match.info["chains"]) > 1 else (False,),
            "pad_n": (False,) if dividing else (True,),
            "flatten_batch": (bool(match.info.get("flattenable")),)})   # batch x sequence as one row axis

    def default_config(self, match: Match, target: C.Target) -> dict:
        cfg = super().default_config(match, target)
        ch = {kb.name: kb.choices for kb in self.space(match, target).knobs}
        # no register tile divides the columns: padded (the space's only pad_n choice); the GEMV-like nests
        # take a narrower vector that divides them where one does (small_lanes)
        cfg["pad_n"] = ch["pad_n"][0]
        if cfg["lanes"] not in ch["lanes"] or cfg["nvec"] not in ch["nvec"]:
            cfg["lanes"], cfg["nvec"] = ch["lanes"][0], max(ch["nvec"])
        # a macro tile no wider than the narrowest sibling (wider ones only add always-false column
        # predicates, next to the row predicate)
        panel = max(1, min(match.info["Ns"].values()) // (cfg["nvec"] * cfg["lanes"]))
        cfg["nc_tiles"] = max(c for c in ch["nc_tiles"] if c <= max(min(ch["nc_tiles"]), min(cfg["nc_tiles"], panel)))
        if not match.info.get("small", False):
            # the row-tiled nest: the last macro tile of rows is the predicated one (RowBuckets.row_macro_tiles)
            # and the last register tile keeps a per-row predicate in its k loop (no padded rows here): a
            # register tile of at most the table's predicated_mr_max rows (AVX2's 6-row tile ran bert_dyn's
            # Q/K/V at 17 rows in 10.6 us, 4 rows 6.9 us, static 7.8; one thread, under load,
            # benchmarks/notes/padrows12.md)
            cap = int(self.table_defaults(target)["predicated_mr_max"])
            if cfg["mr"] > cap:
                cfg["mr"] = max(m for m in ch["mr"] if m <= cap)
            return {**cfg, "mc_tiles": self.row_macro_tiles(cfg["mc_tiles"], ch, target)}
        # GEMV-like: one parallel loop over the few rows with every chain inside it (one thread-pool
        # launch: the chains' own column-panel loops would be one launch each, which costs more than the
        # few rows' work; measured under load, Q/K/V 64x64 at 1 row: 7.5 -> 3.2 us), B unpacked (a packed
        # panel would cost as much as the few rows using it)
        return {**cfg, "order": "rows", "share_rows": len(match.info["chains"]) > 1, "pack_b": False}

    # ------------------------------------------------------------------ apply
    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        super().apply(sch, match, config)
        if not match.info.get("small", False):
            # the parallel loop split too (two thread-pool launches, as before symmm11) with one register tile
            # per macro tile (no row loop inside the parallel one) or zero-padded columns: llama_dyn's gate/up
            # (N = 172 padded) with the hint inside the macro tiles only ran 8.2 -> 10.1 us per call at 17
            # rows, one thread (under load, benchmarks/notes/symmm11.md)
            nr = int(config["nvec"]) * int(config["lanes"])
            padded = bool(config.get("pad_n")) and any(n % nr for n in match.info["Ns"].values())
            partition_row_tiles(sch, parallel_too=int(config["mc_tiles"]) == 1 or padded)


def small_lanes(ns, lanes: int) -> int:
    """The vector width of the GEMV-like nests (few rows): the widest of the target's, its half and its
    quarter that divides every sibling's N, else the target's (the columns then padded).  Padding copies
    each B panel zero-padded once per row block, which for one row costs more than its multiply-adds
    (llama's SwiGLU, 2 x 172 columns: 4-lane vectors, no copy)."""
    for width in (lanes, lanes // 2, lanes // 4):
        if width >= 4 and all(n % width == 0 for n in ns):
            return width
    return lanes
