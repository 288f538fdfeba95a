"""A row normalisation (LayerNorm, RMSNorm) computed while packing the A panel of the matmul(s) it feeds.

Matches the kernels of the ``norm_prologue`` rule (passes/rules.py): after folding elementwise blocks, a
*norm block* (spatial) writes the tensor that one or more matmuls (``matmul.analyze_matmul``: Q/K/V,
gate/up) read as their A operand and nothing else reads; *statistics* (row sums: mean, variance, mean
square; ``analysis.is_sum_reduction``) feed the norm block; each matmul belongs to one output chain as in
``cpu.sibling_matmuls`` (an elementwise epilogue, or the matmul itself as an output).

Schedule: the chains are tiled like ``cpu.sibling_matmuls`` in row order (row block ``i0`` outermost,
then column panels, macro tiles, ``mr x nr`` register tiles with the matmuls' accumulators), their row-block
loops merged into one parallel loop.  Under it, per row block of ``mc`` rows: the statistics of those rows
(vector partial sums by an rfactor over ``rf_width`` lanes, then one horizontal sum per row), then the
normalised rows written into an ``mc x K`` panel (vectorized along K), which every sibling matmul reads as
its A panel.  The normalised tensor of full size never exists: the panel is all that is written.

Weights shared by the batches (``flatten_batch``): the statistics, the panel, the matmuls and their
epilogues run over one row index b * M + i, so register tiles divide batch x M rows (llama's 8 x 17) and no
register tile carries a row predicate.  Columns padded to the register tile (``pad_n``): the zero-padded B
copied once per call where it fits L2 (``pad_once``), and an epilogue of the accumulators alone computed
over the padded columns with a crop to the real ones (``matmul.pad_epilogue``): full-width vectors.
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import _compat as C
from ...analysis import CONTRACTION, REDUCTION, is_sum_reduction
from ...target import cpu_info
from ..base import Exclusion, KnobSpace, Match, knob
from . import common as U
from .matmul import (FLATTEN_BATCH, PAD_N, RegisterTileConfig, analyze_matmul, column_lanes,
                     compute_on_register_tile, flatten_matmul, flattenable, is_contraction, matmul_roles,
                     pad_epilogue, pick_lanes, predicated_tile_exclusion, register_tile_choices,
                     register_tile_default, row_map, rows_macro_tiles, table_accumulator_cap)
from .reduction import rf_widths
from .siblings import chain_output_block, output_chains, rows_key

FAMILY = "cpu.norm_matmul"
VECTORIZE_STATS = (True, False)      # rfactor the statistics into vector partial sums (needs rf_width | K)
PACK_B = (False, True)               # copy each matmul's B strip (K x nc) contiguously once per row block
# Pack B when one register-tile strip of every matmul of a chain (K rows of nr floats, N floats apart) takes
# more than this fraction of L1: read in place, each k step then touches new cache lines and pages
# (the rule cpu.sibling_matmuls uses; measured there: SwiGLU 512x768x2048 155 -> 46 ms).
PACK_STRIP_L1_FRACTION = 0.25
PAD_ONCE = (True, False)             # the zero-padded B copies made once per call, before the row blocks


@dataclass(frozen=True)
class NormMatmulConfig(RegisterTileConfig):
    """The knobs of ``cpu.norm_matmul``: the register tile of the sibling matmuls (``mc_tiles``: register
    tiles per row block, one normalised A panel of mc x K shared by every sibling), how their B panels are
    read, and the row statistics' partial sums."""

    pad_n: bool = knob("columns not a multiple of the register tile: pad j (B panel zero-padded) instead of "
                       "a per-lane predicate (scalar code) on the register tile", PAD_N)
    pack_b: bool = knob("copy each matmul's B panel into a contiguous buffer at the panel loop, once per row "
                        "block (weights with a long row stride)", PACK_B)
    rf_width: int = knob("partial sums per row statistic (rfactor; divides the row)")
    vectorize_stats: bool = knob("row statistics as vector partial sums (an rfactor) instead of one scalar "
                                 "chain per row")
    flatten_batch: bool = knob("weights shared by the batches: their rows as one M (the statistics, the "
                               "normalised panel and the matmuls over batch x rows)", FLATTEN_BATCH)
    pad_once: bool = knob("padded columns (pad_n): each matmul's zero-padded B copied once per call, before the "
                          "parallel row blocks, instead of per column panel of every row block", PAD_ONCE)


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _writer(sch: C.Schedule, buffer: str):
    for b in U.top_blocks(sch):
        if any(str(w.source.name) == buffer for w in sch.get(b).writes):
            return b
    return None


def fold_norm_kernel(sch: C.Schedule, norm: str) -> list[str] | None:
    """Fold every elementwise block but the norm block and the outputs into its consumers, the costly
    ones too (a norm's (x - mean)^2 is computed inside the variance sum, once per element of the row as
    the unfused kernel does): the blocks left, or None when one cannot be folded."""
    U.inline_elementwise(sch, keep=frozenset({norm}))
    outputs = U.output_names(sch)
    for b in U.top_blocks(sch):
        name = U.block_name(sch, b)
        if name == norm or name in outputs or not U.is_spatial(sch, b):
            continue
        try:
            sch.compute_inline(b)
        except C.ScheduleError:
            return None
    return [U.block_name(sch, b) for b in U.top_blocks(sch)]


def _roles(sch: C.Schedule, analyze=analyze_matmul) -> dict | None:
    """The blocks' roles in a norm + matmul kernel, on a fresh schedule (it folds the elementwise blocks
    the same way on every call): None when the kernel is not one.  ``analyze(sch, block)``: a matmul
    block's roles (``matmul.analyze_matmul``: static extents; cpu.symbolic_norm_matmul: symbolic rows)."""
    matmuls = {}
    for b in U.top_blocks(sch):
        if U.is_reduction(sch, b):
            info = analyze(sch, b)
            if info is not None:
                matmuls[U.block_name(sch, b)] = info
    if not matmuls:
        return None
    first = next(iter(matmuls.values()))
    if any(r["a_buffer"] != first["a_buffer"] or rows_key(r) != rows_key(first) or r["K"] != first["K"]
           for r in matmuls.values()):
        return None
    norm = _writer(sch, first["a_buffer"])
    if norm is None or not U.is_spatial(sch, norm):
        return None
    norm_name = U.block_name(sch, norm)
    if norm_name in U.output_names(sch):
        return None                       # the normalised tensor is an output: it must be written whole
    left = fold_norm_kernel(sch, norm_name)
    if left is None:
        return None
    norm = sch.get_sblock(norm_name)
    if any(U.block_name(sch, c) not in matmuls for c in sch.get_consumers(norm)):
        return None
    stats = [n for n in left if n not in matmuls and not U.is_spatial(sch, sch.get_sblock(n))]
    if not stats:
        return None
    for n in stats:
        blk = sch.get_sblock(n)
        kinds = U.iter_kinds(sch, blk)
        # one reduction loop, innermost, as long as every other statistic's (one partial-sum width)
        if not U.is_reduction(sch, blk) or kinds.count("R") != 1 or not kinds.endswith("R") or \
                U.loop_extents(sch, blk)[-1] != U.loop_extents(sch, sch.get_sblock(stats[0]))[-1]:
            return None
        # statistics feed the norm (or another statistic) only: they live per row block
        if any(U.block_name(sch, c) not in stats + [norm_name] for c in sch.get_consumers(blk)):
            return None
    reductions = [(sch.get_sblock(n), info) for n, info in matmuls.items()]
    chains = output_chains(sch, reductions)
    if chains is None:
        return None
    for anchor, reds in chains:
        if len({matmuls[r]["N"] for r in reds}) != 1:
            return None
        if anchor is not None and len(U.loop_extents(sch, sch.get_sblock(anchor))) != len(first["batch"]) + 2:
            return None
    placed = {a for a, _ in chains if a is not None} | set(matmuls) | set(stats) | {norm_name}
    if any(n not in placed for n in left):
        return None
    k_len = U.loop_extents(sch, sch.get_sblock(stats[0]))[-1]
    nbatch = len(first["batch"])
    flat = bool(first["batch"]) and all(flattenable(r) for r in matmuls.values()) and all(
        _batch_major(sch, sch.get_sblock(n), nbatch) for n in stats + [norm_name] + [a for a, _ in chains if a])
    return {"matmuls": matmuls, "norm": norm_name, "stats": stats, "chains": [[a, list(r)] for a, r in chains],
            "M": first["M"], "batch": first["batch"], "K": first["K"], "stat_len": k_len,
            "N": max(r["N"] for r in matmuls.values()), "flattenable": flat}


def _batch_major(sch: C.Schedule, block, nbatch: int) -> bool:
    """Whether ``block`` iterates (batch.., row, ...) and writes its buffer at (batch.., row, ...) with those
    same variables first: its rows can be flattened with the matmuls' (``matmul.row_map``)."""
    blk = sch.get(block)
    ivs = [iv.var for iv in blk.iter_vars]
    idx = list(blk.body.indices) if isinstance(blk.body, C.BufferStore) else []
    if len(ivs) < nbatch + 1 or len(idx) < nbatch + 1:
        return False
    return all(isinstance(e, C.tirx.Var) and e.same_as(v) for e, v in zip(idx[:nbatch + 1], ivs[:nbatch + 1]))


def _pad_once_exclusion(ns) -> Exclusion:
    """``pad_once`` only where a register tile leaves columns to pad (else the same kernel as without)."""
    ns = tuple(ns)

    def nothing_padded(nvec: int, lanes: int, pad_n: bool, pad_once: bool) -> str | None:
        if pad_once and (not pad_n or all(n % (nvec * lanes) == 0 for n in ns)):
            return "pad_once without padded columns"
        return None

    return Exclusion(("nvec", "lanes", "pad_n", "pad_once"), nothing_padded)


def _pad_whole_vectors(sch: C.Schedule, pad, n: int, lanes: int) -> None:
    """A zero-padded B copy left at the root (``pad_once``) on ``lanes``-wide vectors: the whole vectors of
    N split from the rest (``loop_partition``: no predicate left on them), the vector holding N's last
    columns and the zero vectors after it under the predicate (TVM runs those lanes scalar, once per call)."""
    outer, vec = sch.split(sch.get_loops(pad)[-1], factors=[None, lanes])
    sch.vectorize(vec)
    whole = n // lanes
    if 0 < whole < U.static_extent(sch, outer):
        sch.loop_partition(outer, factors=[whole, None])


def _rf_loops(sch: C.Schedule, block) -> tuple[list, object, object]:
    """(row loops, outer reduction loop, partial-sum lanes loop) of an rfactor block moved under the row
    block (``compute_at`` made one loop per iterator, in iterator order: the lanes iterator is the last
    index of the partial-sum buffer it writes)."""
    blk = sch.get(block)
    ivs = list(blk.iter_vars)
    loops = list(sch.get_loops(block))[-len(ivs):]
    lane_var = blk.body.indices[-1]
    lanes = next(i for i, iv in enumerate(ivs) if iv.var.same_as(lane_var))
    red = next(i for i, iv in enumerate(ivs) if int(iv.iter_type) == U.REDUCE)
    rows = [lp for i, lp in enumerate(loops) if i not in (lanes, red)]
    return rows, loops[red], loops[lanes]


class NormMatmul(U.CpuTemplate, family=FAMILY, config=NormMatmulConfig):

    # ------------------------------------------------------------------ match
    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        return self.match_roles(func, analyze_matmul)

    def match_roles(self, func: C.PrimFunc, analyze) -> Match | None:
        """The match of a norm + matmul kernel whose matmuls ``analyze(sch, block)`` recognizes (static
        extents here; symbolic rows in cpu.symbolic_norm_matmul)."""
        if not is_sum_reduction(func):        # every reduction sums (the matmuls, mean, variance)
            return None
        roles = _roles(C.Schedule(func), analyze)
        if roles is None:
            return None
        m = roles["matmuls"]
        return Match(self.family, {
            "M": roles["M"], "batch": roles["batch"], "N": roles["N"], "K": roles["K"],
            "rows": roles["M"] * _prod(roles["batch"]) if roles["flattenable"] else roles["M"],
            "flattenable": roles["flattenable"],
            "norm": roles["norm"], "stats": roles["stats"], "stat_len": roles["stat_len"],
            "chains": roles["chains"], "chain_len": max(len(r) for _, r in roles["chains"]),
            "Ns": {name: r["N"] for name, r in m.items()},
            "b_buffers": {name: r["b_buffer"] for name, r in m.items()},
            "infos": {name: {"j_iter": r["j_iter"], "n_iters": r["n_iters"]} for name, r in m.items()},
        })

    def accepts(self, group, target: C.Target) -> str | None:
        """Static shapes, only matmul anchors (one or more, no conv; each ``C += A * B`` by
        ``matmul.matmul_roles`` on its PrimFunc) and row reductions before them: the group the
        ``norm_prologue`` rule forms (its check decides the rest)."""
        anchors, contractions = U.matmul_anchors(group), group.of_kind(CONTRACTION)
        if not group.is_static():
            return "symbolic extents (the norm prologue tiles static rows)"
        if not anchors or len(anchors) != len(contractions):
            return f"{len(contractions)} matmul/conv anchors, {len(anchors)} of them matmuls (this family " \
                   "normalises the A panel of matmuls)"
        if not group.of_kind(REDUCTION):
            return "no row normalisation before the matmuls"
        bad = [m.name for m in anchors if matmul_roles(m.func) is None]
        if bad:
            return f"{bad[0]} is not C += A * B with one i, j and k axis"
        return None

    # ------------------------------------------------------------------ knobs
    def space(self, match: Match, target: C.Target) -> KnobSpace:
        m, n, k = match.info["rows"], match.info["N"], match.info["K"]
        lanes = cpu_info(target).float32_lanes
        widths = rf_widths(lanes, match.info["stat_len"])
        return NormMatmulConfig.space(**register_tile_choices(m, n, k, lanes), rf_width=widths or (lanes,),
                                      vectorize_stats=VECTORIZE_STATS if widths else (False,),
                                      **({} if match.info["flattenable"] else {"flatten_batch": (False,)}),
                                      exclusions=(predicated_tile_exclusion(match.info["Ns"].values()),
                                                  _pad_once_exclusion(match.info["Ns"].values())))

    def default_config(self, match: Match, target: C.Target) -> dict:
        info, d = cpu_info(target), self.table_defaults(target)
        ch = self.space(match, target).to_dict()
        flat = True in ch["flatten_batch"]
        m, n, k = match.info["rows"] if flat else match.info["M"], match.info["N"], match.info["K"]
        ns = set(match.info["Ns"].values())
        lanes = pick_lanes(m, ns.pop(), info.float32_lanes) if len(ns) == 1 else info.float32_lanes
        tile = register_tile_default(m, n, k, lanes, info, ch, d, table_accumulator_cap(d, lanes), whole_rows=True)
        mr, nr, mc_tiles = tile["mr"], tile["nvec"] * lanes, rows_macro_tiles(m, tile, ch)
        # no wider column panel than the columns (a panel past N leaves a predicate on every register tile)
        nc_tiles = max([c for c in ch["nc_tiles"] if c <= -(-n // nr)] or [min(ch["nc_tiles"])])
        pack = match.info["chain_len"] * k * nr * 4 > PACK_STRIP_L1_FRACTION * info.l1d_bytes
        if pack:
            nc_tiles = min(ch["nc_tiles"])    # one register-tile strip per panel: the packed strip is contiguous
        # the row-block loop is the parallel one: keep enough row blocks for every core
        batch = 1 if flat else _prod(match.info["batch"])
        while mc_tiles > min(ch["mc_tiles"]) and \
                batch * -(-m // (mr * mc_tiles)) < d["row_blocks_per_core"] * info.cores:
            mc_tiles = max(c for c in ch["mc_tiles"] if c < mc_tiles)
        # register tiles that divide the rows: row blocks of whole tiles (a row block past the rows puts a
        # row predicate on its register tiles, and LLVM then keeps their accumulators in memory: llama's
        # gate/up at 8 x 17 rows ~3x the symbolic kernel, measured under load)
        # (one-row tiles: a row block past the rows predicates whole tiles, which LLVM hoists out of the k
        # loop; 17 row blocks of one row were slower than 16-row blocks at 17 rows)
        if m % mr == 0 and mr > 1:
            mc_tiles = max(c for c in ch["mc_tiles"] if c <= mc_tiles and (m // mr) % c == 0)
        # a few vectors of partial sums (the table's max_rf_vectors): independent add chains per statistic
        # hide the add latency
        rf = [w for w in ch["rf_width"] if w <= d["max_rf_vectors"] * info.float32_lanes]
        # padded B copies once per call when they all fit the table's share of L2 (they are then read from
        # L2 by every row block; per row block, few rows pay a copy per panel: llama's 8 x 17 rows in
        # 17 row blocks of 8)
        padded = [-(-c // nr) * nr for c in match.info["Ns"].values() if c % nr]
        once = d["pad_n"] and bool(padded) and \
            sum(k * c * 4 for c in padded) <= d["pad_once_l2_share"] * info.l2_bytes
        return NormMatmulConfig(**{**tile, "mc_tiles": mc_tiles, "nc_tiles": nc_tiles}, pad_n=d["pad_n"],
                                pack_b=pack, rf_width=rf[-1] if rf else ch["rf_width"][0],
                                vectorize_stats=True in ch["vectorize_stats"], flatten_batch=flat,
                                pad_once=once).asdict()

    # ------------------------------------------------------------------ apply
    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        info, cfg = match.info, NormMatmulConfig.from_dict(config)
        mr, lanes = cfg.mr, cfg.lanes
        nr = cfg.nvec * lanes

        # Step 1. Fold the elementwise blocks (the same folding as match()): the norm block stays.
        fold_norm_kernel(sch, info["norm"])
        # One row-flattening decision per path (never both): symbolic rows (cpu.symbolic_norm_matmul) flatten
        # when the match says so (``info["flatten"]``: batch axes), static rows by the flatten_batch knob where
        # the weights are shared by the batches (``info["flattenable"]``).
        symbolic = bool(info.get("symbolic"))
        flat = bool(info.get("flatten")) if symbolic else bool(cfg.flatten_batch and info["flattenable"])
        # Step 1b. Symbolic rows over batch axes: the statistics and the norm block iterate one flat row
        # axis b * M + i (their buffers 2-D), so a row block is a contiguous range of rows whatever batch it
        # crosses; the matmuls follow in Step 3.
        # (Without batch axes the buffers stay the kernel's: the size buckets' nests, joined in one kernel by
        # ``buckets.join_buckets``, then share them, and buffer compaction leaves them at full size.  Known
        # limitation: buffers made anew by an identity transform_layout keep their data variable, and
        # the joined kernel then freed it twice.)
        if symbolic and flat:
            for name in [info["norm"], *info["stats"]]:
                _flatten_rows_block(sch, sch.get_sblock(name), info)

        # Step 2. Columns not a multiple of the register tile: pad each matmul's j domain (its B panel
        # zero-padded in Step 5); a matmul that is an output accumulates into a cache block.
        # Step 2b. Padded columns and an epilogue of the accumulators only: the epilogue over the padded
        # columns too, and a crop to the N real ones per row block (Step 6).
        outs, pads, crops = [], {}, []
        for anchor, reds in info["chains"]:
            epi = chain_output_block(sch, info, anchor, reds, nr, cfg.pad_n, pads)
            width = column_lanes(info["Ns"][reds[0]], lanes)    # the epilogue's vectors: whole ones of N
            crop = None
            if anchor is not None and reds[0] in pads:
                crop = pad_epilogue(sch, epi, nr)
                if crop is not None:
                    crops.append(crop)
                    epi, width = sch.get_sblock(anchor), lanes
            outs.append((U.block_name(sch, epi), crop, reds, width))

        # Step 3. Symbolic rows: each chain's matmuls and output block over the flat row axis too (no
        # column padding there, hence no crop).
        if symbolic and flat:
            for epi, _, reds, _ in outs:
                for red in reds:
                    flatten_matmul(sch, sch.get_sblock(red), info)
                sch.transform_block_layout(sch.get_sblock(epi), row_map(info, 1))
        # Static rows, weights shared by the batches: the statistics, the normalised rows, the matmuls and
        # their epilogues (or write-backs, crops) over one row index b * M + i, so that register tiles divide
        # the batch x M rows (after the padding: pad_einsum needs plain indices).
        elif flat:
            rows = {"batch": info["batch"], "M": info["M"]}
            for name in list(info["stats"]) + [info["norm"]]:
                _flatten_rows_block(sch, sch.get_sblock(name), rows)
            for epi, crop, reds, _ in outs:
                for red in reds:
                    flatten_matmul(sch, sch.get_sblock(red), rows)
                outputs = U.output_names(sch)
                for name in [epi] + ([crop] if crop else []):
                    if name in outputs:
                        sch.transform_block_layout(sch.get_sblock(name), row_map(rows, 1))
                    else:
                        _flatten_rows_block(sch, sch.get_sblock(name), rows)
        nbatch = 0 if flat else len(info["batch"])

        # Step 3b. Row statistics as vector partial sums: rfactor each over `rf_width` lanes (at the root,
        # before anything moves; the partial sums and their horizontal sum move under the row block in Step 6).
        stat_blocks = list(info["stats"])
        rf_blocks = []
        if cfg.vectorize_stats:
            for name in info["stats"]:
                blk = sch.get_sblock(name)
                loops = sch.get_loops(blk)
                _, ri = sch.split(loops[-1], factors=[None, cfg.rf_width])
                rf = sch.rfactor(ri, factor_axis=len(loops) - 1)
                rf_blocks.append(U.block_name(sch, rf))
        # producers before consumers: the order compute_at must take them in reverse
        order = {U.block_name(sch, b): i for i, b in enumerate(U.top_blocks(sch))}
        stat_blocks = sorted(stat_blocks + rf_blocks, key=order.get)

        tops, tiles = [], []
        for epi, _, reds, width in outs:
            # Step 4. Tile the chain's output: [batch, row block i0], j0, i1, j1, register tile (i2, j2).
            loops = sch.get_loops(sch.get_sblock(epi))
            b_loops, i_loop, j_loop = loops[:nbatch], loops[nbatch], loops[nbatch + 1]
            i0, i1, i2 = sch.split(i_loop, factors=[None, cfg.mc_tiles, mr])
            j0, j1, j2 = sch.split(j_loop, factors=[None, cfg.nc_tiles, nr])
            sch.reorder(*b_loops, i0, j0, i1, j1, i2, j2)
            tops.append(sch.fuse(*b_loops, i0) if b_loops else i0)
            tiles.append((reds, j1, j2, j0, width))

        # One parallel row-block loop for every chain: the normalised panel is made once per row block.
        # (Before the matmuls move in: `parallel` needs complete blocks, not split-off inits.)
        # A bucket of few rows (cpu.symbolic_norm_matmul's serial one) keeps it serial: a fork of the thread
        # pool costs more than the work of a row or two.
        top = sch.merge(*tops) if len(tops) > 1 else tops[0]
        if not info.get("serial", False):
            sch.parallel(top)

        once = []
        for reds, j1, j2, panel, width in tiles:
            # Step 5. Every matmul of the chain on the register tile (accumulators, init vectorized), its
            # zero-padded (pad_n) or packed (pack_b) B panel made once per column panel of the row block.
            for red in reds:
                blk = sch.get_sblock(red)        # after this step: the update block (the init split off)
                compute_on_register_tile(sch, blk, j1, lanes, cfg.k_unroll)
                pack = None
                if red in pads and cfg.pad_once:
                    once.append((pads[red], info["Ns"][red]))      # at the root: vectorized last (Step 8)
                elif red in pads:
                    pack = sch.get_sblock(pads[red])
                elif cfg.pack_b:
                    reads = [str(r.source.name) for r in sch.get(blk).reads]
                    pack = sch.cache_read(blk, reads.index(info["b_buffers"][red]), "global")
                if pack is not None:
                    sch.compute_at(pack, panel, preserve_unit_loops=True)
                    # a padded copy stops at N: vectors that divide it (matmul.column_lanes)
                    U.vectorize_inner(sch, pack, column_lanes(info["Ns"][red], lanes) if red in pads else lanes)
            # The epilogue (or write-back) on the register tile, vectorized along j (whole vectors of N).
            _, e_jv = sch.split(j2, factors=[None, width])
            sch.vectorize(e_jv)

        # Step 5b. A row count known at run time only (cpu.symbolic_norm_matmul's row-tiled bucket): the
        # panel laid out by row block ([row block, row in block, K], the last block zero-padded: its rows
        # past the end are 0 by a branch, never read from the input), so that each row block's part is one
        # index of the outer axis and the whole static inner one: buffer compaction shrinks it to mc x K
        # (a range of rows predicated "row exists" against a symbolic count it keeps at full size).
        padded = bool(info.get("partition_rows")) and mr * cfg.mc_tiles > 1
        if padded:
            block_rows = mr * cfg.mc_tiles
            blk = sch.get_sblock(info["norm"])
            nd = len(sch.get(blk).writes[0].source.shape)
            sch.transform_layout(blk, ("write", 0), C.IndexMap.from_func(
                lambda r, *rest: (r // block_rows, r % block_rows, *rest), ndim=nd), pad_value=0.0)

        # Step 6. Per row block: the normalised rows into the A panel (mc x K), and before them the
        # statistics of those rows; each shrinks to the row block (no tensor of full size is left).  With
        # the padded panel (Step 5b) the statistics go one row deeper, under the panel's row loop: one row's
        # statistics at a time (a point that compaction shrinks; rows past the end are skipped).
        # After the panels: the padded epilogues' crops to the real columns (whole vectors, a short tail).
        for name in crops:
            sch.reverse_compute_at(sch.get_sblock(name), top, preserve_unit_loops=True)
            U.vectorize_inner(sch, sch.get_sblock(name), lanes)
        norm = sch.get_sblock(info["norm"])
        sch.compute_at(norm, top, preserve_unit_loops=True)
        stats_at = top
        if padded:
            loops = list(sch.get_loops(norm))
            top_var = sch.get(top).loop_var
            under = loops[next(i for i, lp in enumerate(loops) if sch.get(lp).loop_var.same_as(top_var)) + 1:]
            stats_at = next(lp for lp in under if _static_extent(sch, lp) == block_rows)
        for name in reversed(stat_blocks):
            sch.compute_at(sch.get_sblock(name), stats_at, preserve_unit_loops=True)

        # Step 7. Vectorize: the partial sums along their lanes, the panel along K (a scalar tail when the
        # vector width does not divide K).
        for name in rf_blocks:
            blk = sch.get_sblock(name)
            rows, ro, ri = _rf_loops(sch, blk)
            sch.reorder(*rows, ro, ri)          # per row: the partial-sum vector over contiguous elements
            sch.vectorize(ri)
            init = sch.decompose_reduction(blk, ro)
            sch.vectorize(sch.get_loops(init)[-1])
        U.vectorize_inner(sch, sch.get_sblock(info["norm"]), lanes)

        # Step 8. A row count known at run time only (the row-tiled bucket of cpu.symbolic_norm_matmul):
        # the whole register tiles split from the predicated last macro tile, by loop partitioning inside
        # the row block only (``_partition_tiles_in_row_block``).
        if info.get("partition_rows"):
            _partition_tiles_in_row_block(sch, top)

        # Step 8b. Padded B copies made once per call (pad_once; static rows: the symbolic family pads no
        # columns), before the row blocks: whole vectors of N split from the last columns (loop_partition:
        # last, as nothing moves into the root scope after it).
        for name, n in once:
            _pad_whole_vectors(sch, sch.get_sblock(name), n, lanes)


def _partition_tiles_in_row_block(sch: C.Schedule, top) -> None:
    """``matmul.partition_row_tiles`` for the norm kernel: the loop-partition hint on each matmul's loops
    *under* the row-block loop ``top`` (the whole register tiles of a row block lose the "row exists"
    predicate; the last row block's tail keeps it), never on ``top`` itself nor on the statistics' loops.
    TVM 0.27's LoopPartition splits a hinted row-block loop that also holds the statistics and the
    zero-padded panel wrongly: its tail partition runs even when the row count is a multiple of the row
    block, with the statistics' row guards dropped, so it writes past the end of the statistics buffers
    (heap corruption: ``free(): invalid pointer`` in t5_encoder_dyn; tests/test_symbolic_norm_prologue.py
    ``test_lowered_kernel_stays_in_bounds``).

    Only the row loops get the hint (those bound to a block iterator over the symbolic row count), never a
    column-tile loop: when N is whole vectors but no whole column tile (Qwen2's FFN, N = 176 = 11 x 16 on
    AVX-512), the column-tile loop carries the "column exists" predicate, and TVM 0.27's LoopPartition
    replaces its int64 variable by an int32 0 in the one-tile partition, which HoistIfThenElse then rejects
    ("mismatched types. int32 vs. int64": qwen2_dyn did not compile; tests/test_symbolic_norm_prologue.py
    ``test_columns_off_the_column_tile_compile``)."""
    top_var = sch.get(top).loop_var
    names = []
    C.post_order_visit(sch.mod["main"].body, lambda n: names.append(str(n.name_hint))
                       if isinstance(n, C.SBlock) and str(n.name_hint) != "root" else None)
    for name in names:
        block = sch.get_sblock(name)
        if not is_contraction(sch, block):
            continue
        loops = list(sch.get_loops(block))
        depth = next(i for i, lp in enumerate(loops) if sch.get(lp).loop_var.same_as(top_var))
        row_vars = _row_loop_vars(sch, block)
        for loop in loops[depth + 1:]:
            lp = sch.get(loop)
            if lp.kind == C.ForKind.SERIAL and str(lp.loop_var.name) in row_vars:
                sch.annotate(loop, "pragma_loop_partition_hint", 1)


def _row_loop_vars(sch: C.Schedule, block) -> set[str]:
    """Names of the loop variables bound to ``block``'s iterators whose domain is symbolic (the rows)."""
    realize = sch.get(sch.get_loops(block)[-1]).body
    out: set[str] = set()
    if not isinstance(realize, C.SBlockRealize):
        return out
    for iv, value in zip(sch.get(block).iter_vars, realize.iter_values):
        if isinstance(iv.dom.extent, C.IntImm):
            continue
        C.post_order_visit(value, lambda n: out.add(str(n.name)) if isinstance(n, C.tirx.Var) else None)
    return out


def _static_extent(sch: C.Schedule, loop) -> int | None:
    ext = sch.get(loop).extent
    return int(ext) if isinstance(ext, C.tirx.IntImm) else None


def _flatten_rows_block(sch: C.Schedule, block, info: dict) -> None:
    """A block writing over (batch.., row, ...) (a statistic, the norm block; static rows: also a padded
    epilogue or crop that is no output) made to iterate ``b * M + i`` (``matmul.row_map``; ``info`` needs
    ``batch`` and ``M``) and to write a buffer with that one row axis (its readers' indices follow; its reads
    of kernel inputs keep their shape, indexed row // M, row % M)."""
    nb = len(info["batch"])
    blk = sch.get(block)
    sch.transform_layout(block, ("write", 0), row_map(info, len(blk.writes[0].source.shape) - nb - 1))
    sch.transform_block_layout(block, row_map(info, len(blk.iter_vars) - nb - 1))


def rows_lead(sch: C.Schedule, name: str, info: dict) -> bool:
    """The block's first iterators are the rows (batch axes then i, as extents) and index its output's
    first axes in that order: what ``_flatten_rows_block`` maps."""
    blk = sch.get(sch.get_sblock(name))
    nb = len(info["batch"])
    rows = [*info["batch"], info["M"]]
    ivs = list(blk.iter_vars)[:nb + 1]
    idx = list(blk.body.indices)[:nb + 1] if isinstance(blk.body, C.BufferStore) else []
    if len(ivs) != nb + 1 or len(idx) != nb + 1:
        return False
    ana = C.Analyzer()
    return all(int(iv.iter_type) != U.REDUCE and ana.can_prove_equal(iv.dom.extent, r) and ix.same_as(iv.var)
               for iv, ix, r in zip(ivs, idx, rows))
