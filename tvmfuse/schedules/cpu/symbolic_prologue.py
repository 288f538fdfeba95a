"""A row normalisation (LayerNorm, RMSNorm) computed while packing the A panel of the matmul(s) it feeds,
over a symbolic number of rows (``[batch, seq, K]``: rows = batch x seq known only at run time, K and every
matmul's N static): T5's RMSNorm before Q/K/V and before its FFN, GPT-2/BERT-style LayerNorms where the
``norm_prologue`` rule fuses them.

``cpu.norm_matmul`` needs static rows; without this family the ``norm_prologue`` rule could not form these
groups over symbolic shapes (the norm would be a kernel of its own writing the normalised tensor, and the
matmuls another).  Here ``cpu.norm_matmul``'s schedule (its ``NormMatmulConfig`` and ``apply``: per row
block the statistics, then the normalised ``mc x K`` panel every sibling reads, the chains tiled on register
tiles under one row-block loop) runs over the symbolic rows the way ``cpu.symbolic_siblings`` runs
``cpu.sibling_matmuls``': the batch axes and i flattened into one row axis (``b * M + i``: the statistics,
the norm block and the matmuls alike, so a row block is a contiguous range of rows), the last row block
predicated, and the same size buckets (``symbolic_matmul.RowBuckets``): up to ``small_rows`` one row per
row block (``mr = mc_tiles = 1``: no predicated rows), serial below ``serial_rows``; above, the row-tiled
nest with the loop-partition hint (whole row blocks lose the per-row predicate).

Matches what ``cpu.norm_matmul`` matches when every matmul is ``analyze_symbolic_matmul``'s (symbolic rows,
static N and K, a weight shared by the batches) with N a multiple of the vector width (no column padding:
``pad_einsum`` of a symbolic domain is not used here), and the statistics and the norm block iterate the
rows first (``prologue.rows_lead``).
"""
from __future__ import annotations

from ... import _compat as C
from ...analysis import CONTRACTION, REDUCTION
from ...target import cpu_info
from ..base import KnobSpace, Match
from . import matmul as MM
from . import common as U
from .prologue import PACK_STRIP_L1_FRACTION, NormMatmul, NormMatmulConfig, fold_norm_kernel, rows_lead
from .reduction import rf_widths
from .symbolic_matmul import SYM_MR_CHOICES, RowBuckets, analyze_symbolic_rows_matmul

FAMILY = "cpu.symbolic_norm_matmul"


class SymbolicNormMatmul(RowBuckets, NormMatmul, family=FAMILY, config=NormMatmulConfig):
    """``cpu.norm_matmul``'s schedule over a symbolic row count (see the module docstring)."""

    # ------------------------------------------------------------------ match
    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        if all(isinstance(d, C.tirx.IntImm) for p in func.params if hasattr(p, "shape") for d in p.shape):
            return None                   # static kernels belong to cpu.norm_matmul
        found = self.match_roles(func, lambda sch, b: analyze_symbolic_rows_matmul(sch, b, target))
        if found is None:
            return None
        info = found.info
        info["flatten"], info["symbolic"] = bool(info["batch"]), True
        if info["flatten"]:
            sch = C.Schedule(func)
            fold_norm_kernel(sch, info["norm"])
            if not all(rows_lead(sch, n, info) for n in [info["norm"], *info["stats"]]):
                return None
        info["partition_rows"] = True
        return self.if_every_bucket_schedules(func, self.match_rows(found, target), target)

    def accepts(self, group, target: C.Target) -> str | None:
        """Symbolic rows, only matmul anchors (each ``analyze_symbolic_rows_matmul``: static N and K, N a
        multiple of the vector width) and row reductions before them: the group the ``norm_prologue``
        rule forms (its check decides the rest)."""
        anchors, contractions = U.matmul_anchors(group), group.of_kind(CONTRACTION)
        if group.is_static():
            return "static extents (cpu.norm_matmul takes those)"
        if not anchors or len(anchors) != len(contractions):
            return f"{len(contractions)} matmul/conv anchors, {len(anchors)} of them matmuls (this family " \
                   "normalises the A panel of matmuls)"
        if not group.of_kind(REDUCTION):
            return "no row normalisation before the matmuls"
        bad = [m.name for m in anchors
               if MM.matmul_roles(m.func, lambda sch, red: analyze_symbolic_rows_matmul(sch, red, target)) is None]
        if bad:
            return (f"{bad[0]} is not [rows, K] @ [K, N] with symbolic rows, static N, K and N a multiple of "
                    "the vector width")
        return None

    # ------------------------------------------------------------------ knobs
    def space(self, match: Match, target: C.Target) -> KnobSpace:
        ns, k, m = set(match.info["Ns"].values()), match.info["K"], match.info["rows"]
        lanes = cpu_info(target).float32_lanes
        small = match.info.get("small", False)
        widths = rf_widths(lanes, match.info["stat_len"])
        choices = MM.register_tile_choices(m, max(ns), k, lanes)
        return NormMatmulConfig.space(**{
            **choices,
            # few rows: one row per register tile and per row block (no row tiling, no wasted rows)
            **({"mr": (1,), "mc_tiles": (1,)} if small else {"mr": SYM_MR_CHOICES, "mc_tiles": MM.MC_TILES}),
            # register tiles that divide every sibling's N: no column tail
            "nvec": tuple(v for v in MM.NVEC_CHOICES if all(n % (v * lanes) == 0 for n in ns)),
            "lanes": (lanes,),
            "pad_n": (False,),                                    # N is a multiple of the vector width
            "rf_width": widths or (lanes,),
            "vectorize_stats": (True, False) if widths else (False,),
            # the rows flattened when the match has batch axes (info["flatten"]: apply's symbolic path)
            "flatten_batch": (bool(match.info.get("flatten")),),
            "pad_once": (False,)})                                # no padded columns

    def default_config(self, match: Match, target: C.Target) -> dict:
        info, d = cpu_info(target), self.table_defaults(target)
        ch = {kb.name: kb.choices for kb in self.space(match, target).knobs}
        k, lanes, rows = match.info["K"], info.float32_lanes, match.info["rows"]
        n = min(match.info["Ns"].values())
        tile = MM.register_tile_default(rows, max(match.info["Ns"].values()), k, lanes, info, ch, d,
                                        self.accumulator_cap(lanes))
        nr = tile["nvec"] * lanes
        # no wider column panel than the narrowest sibling (wider ones only add always-false predicates)
        nc_tiles = max([c for c in ch["nc_tiles"] if c <= max(1, n // nr)] or [min(ch["nc_tiles"])])
        # B panels read in place: a packed panel is made once per row block, and a few rows do not repay it
        pack = False
        if not match.info.get("small", False):
            # the row-tiled nest: the last macro tile of rows is the predicated one (RowBuckets.row_macro_tiles)
            mc_tiles = self.row_macro_tiles(tile["mc_tiles"], ch, target)
            # packed only when a row block has the table's pack_min_block_rows rows: the row macro tile is
            # short here (row_mc_tiles), and T5's FFN at 128 rows re-packed its 64 x 256 B every 6 rows
            # (mr 3 x 2 tiles): 55 us per call against 33 us read in place (35 us static, which packs once
            # per 32 rows; benchmarks/symbolic_kernel_ab.py, one thread, measured under load)
            pack = (tile["mr"] * mc_tiles >= int(d["pack_min_block_rows"])
                    and match.info["chain_len"] * k * nr * 4 > PACK_STRIP_L1_FRACTION * info.l1d_bytes
                    and True in ch["pack_b"])
        else:
            mc_tiles = 1
        rf = [w for w in ch["rf_width"] if w <= d["max_rf_vectors"] * lanes]
        return NormMatmulConfig(**{**tile, "mc_tiles": mc_tiles, "nc_tiles": min(ch["nc_tiles"]) if pack
                                   else nc_tiles},
                                pad_n=False, pack_b=pack, rf_width=rf[-1] if rf else ch["rf_width"][0],
                                vectorize_stats=True in ch["vectorize_stats"],
                                flatten_batch=bool(match.info.get("flatten")), pad_once=False).asdict()

    def bucket_match(self, match: Match, bucket) -> Match:
        """``RowBuckets.bucket_match``; the row-tiled bucket gets the loop-partition hint."""
        bm = super().bucket_match(match, bucket)
        bm.info["partition_rows"] = not bm.info["small"]
        return bm
