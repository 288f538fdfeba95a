"""MatMul with its epilogue over a symbolic number of rows (``[batch, seq, K] @ [K, N]``: rows = batch x seq
known only at run time, N and K static) on x86/ARM CPUs.

``cpu.matmul_epilogue`` needs every extent static; without this template such a kernel gets
``cpu.symbolic_rows`` (one row at a time: every row reads the whole weight, no register blocking across
rows).  Here the static dimensions are tiled as in ``cpu.matmul_epilogue`` and the symbolic ones are
looped over with a tail:

Matches what ``cpu.matmul_epilogue`` matches (one ``C += A * B`` block, at most one elementwise epilogue)
when the extents of C's leading axes (batch axes and i) may be symbolic but j (N) and k (K) are static, the
weight B is shared by every batch (it follows none of the batch axes) and N is a multiple of the vector
width (no column tail: a per-lane predicate makes TVM's vectorizer emit scalar code).

Schedule: the batch axes and i flattened into one row axis (``b * M + i``, symbolic); rows tiled by the
register tile ``mr`` (the last tile predicated: rows past the end are skipped, whole vectors at a time), the
columns by macro and register tiles as in ``cpu.matmul_epilogue`` (same steps, its ``apply``), the row
tiles parallel.

Size buckets (``schedules.buckets``): the kernel holds two nests and picks one at run time by the row
count: up to ``small_rows`` rows (the family's template_defaults in schedules/cpu_targets.json) a GEMV-like
nest (one row per register tile, no row tiling and so no predicated rows wasted, the column macro tiles
parallel), above it the row-tiled nest.  Each bucket has its own knob space, default and tuning record.
"""
from __future__ import annotations

from ... import _compat as C
from ...target import cpu_info
from ..base import KnobSpace, Match
from ..buckets import Bucket
from . import common as U
from . import matmul as MM

# The row count the untuned default is sized for (``nominal_rows`` of the family's template_defaults in
# schedules/cpu_targets.json, 48: a multiple of every choice here, so no register tile is preferred for
# dividing a row count only known at run time): a register tile of this many rows or fewer keeps the
# predicated last tile short (at most mr - 1 wasted rows).
SYM_MR_CHOICES = (1, 2, 3, 4, 6, 8)
# The GEMV-like nest's vectors per register tile (one row): each B vector is the memory operand of one FMA,
# so a one-row tile holds up to all but one vector register in accumulators, more than MatmulConfig's
# NVEC_CHOICES (sized for tiles of several rows, whose B vectors are each loaded once for mr FMAs).
GEMV_NVEC_CHOICES = (1, 2, 3, 4, 6, 8)


def _is_static(e) -> bool:
    return isinstance(e, C.tirx.IntImm)


def analyze_symbolic_matmul(sch: C.Schedule, block) -> dict | None:
    """The roles of ``C[b.., i, j] += A[b.., i, k] * B[k, j]`` with symbolic b/i extents, static N/K and a
    weight shared by the batches; None otherwise (all-static ones belong to ``cpu.matmul_epilogue``)."""
    found = MM.mac_operands(sch, block, operand_consts=False)
    if found is None:
        return None
    blk, a, b, c_idx, a_idx, b_idx = found
    ivs = blk.iter_vars
    k = next(iv.var for iv in ivs if int(iv.iter_type) == U.REDUCE)
    i_var, j_var = c_idx[-2], c_idx[-1]
    a_names, b_names = [v.name for v in a_idx], [v.name for v in b_idx]
    if b_names == [i_var.name, k.name] or (len(a_names) == 2 and j_var.name in a_names):
        a, b, a_idx, b_idx, a_names, b_names = b, a, b_idx, a_idx, b_names, a_names   # written B * A
    # A read at exactly C's row axes then k; B a 2-D weight [k, j] or [j, k]
    if a_names != [v.name for v in c_idx[:-1]] + [k.name] or sorted(b_names) != sorted([k.name, j_var.name]):
        return None
    if [iv.var.name for iv in ivs] != [v.name for v in c_idx] + [k.name]:
        return None
    dom = {iv.var.name: iv.dom.extent for iv in ivs}
    rows = [dom[v.name] for v in c_idx[:-1]]
    if all(_is_static(r) for r in rows) or not (_is_static(dom[j_var.name]) and _is_static(dom[k.name])):
        return None
    return {
        # M and the batch extents as TIR expressions (symbolic); MM.row_map flattens with them
        "M": rows[-1], "N": int(dom[j_var.name]), "K": int(dom[k.name]), "batch": rows[:-1],
        "b_batch": [False] * (len(rows) - 1), "b_buffer": str(b.source.name),
        "b_contiguous_j": b_names[-1] == j_var.name, "b_j_pos": b_names.index(j_var.name),
        "b_k_pos": b_names.index(k.name), "b_ndim": 2, "a_buffer": str(a.source.name),
        "c_buffer": str(blk.body.buffer.name), "j_iter": len(c_idx) - 1, "n_iters": len(ivs),
        "iters_ordered": True,
    }


def analyze_symbolic_rows_matmul(sch: C.Schedule, block, target: C.Target) -> dict | None:
    """``analyze_symbolic_matmul`` when N is also a multiple of the target's vector width (no column tail:
    a per-lane predicate makes TVM's vectorizer emit scalar code), else None."""
    info = analyze_symbolic_matmul(sch, block)
    if info is None or info["N"] % cpu_info(target).float32_lanes:
        return None
    return info


class RowBuckets:
    """Size buckets over a symbolic row count (a mixin of the templates over symbolic rows whose match has
    ``M`` and ``batch``, the row extents, and whose family's template_defaults have ``small_rows`` and
    ``nominal_rows``): this module's ``cpu.symbolic_matmul`` and ``cpu.symbolic_siblings``."""

    def match_rows(self, match: Match, target: C.Target) -> Match:
        """``match`` with the row counts its buckets read: ``rows`` (the table's ``nominal_rows``: what the
        open bucket's register tiles are sized for) and ``small_rows``."""
        d = self.table_defaults(target)
        match.info.update(rows=int(d["nominal_rows"]), small_rows=int(d["small_rows"]),
                          serial_rows=self.serial_rows(match, target))
        return match

    def serial_rows(self, match: Match, target: C.Target) -> int:
        """The most rows a serial nest takes: the table's ``serial_rows_per_core`` per core (less one), or
        the rows whose multiply-adds stay under the target's fork/join cost (``common.serial_batches``:
        a static build of that size runs serial too), whichever is more."""
        d = self.table_defaults(target)
        table = int(d.get("serial_rows_per_core", 0)) * cpu_info(target).cores - 1
        n = sum(match.info["Ns"].values()) if "Ns" in match.info else match.info["N"]
        return max(table, U.serial_batches(n * match.info["K"], target))

    def if_every_bucket_schedules(self, func: C.PrimFunc, match: Match, target: C.Target) -> Match | None:
        """``match`` if every bucket's default config schedules ``func`` (tried on copies: symbolic layouts
        can refuse), else None."""
        try:
            for bucket in self.buckets(match, target):
                bm = self.bucket_match(match, bucket)
                self.apply(C.Schedule(func), bm, self.default_config(bm, target))
        except (ValueError,) + C.TVMError:
            return None
        return match

    def accumulator_cap(self, lanes: int) -> int | None:
        """The register tile's accumulator stays a stack array (``matmul.stack_accumulator_vectors``)."""
        return MM.stack_accumulator_vectors(lanes)

    def row_macro_tiles(self, want: int, choices: dict, target: C.Target) -> int:
        """The row-tiled nest's macro tile in register tiles of rows: at most the table's ``row_mc_tiles``
        (and ``want``).  The row count is known at run time only.  The cap was set when TVM's loop
        partition split off the last *macro* tile of rows (the hint was on the parallel loop): every
        register tile in it kept the "row exists" predicate inside its k loop (partial sums in memory, ~5x
        the time per row, measured under load), so a macro tile of 8 register tiles put up to 31 rows on
        that path (BERT's FFN at 51 rows: 19 of them, the kernel at 2x the static one).  Since symmm11 the
        hint is on the serial register-tile loop inside each macro tile (``partition_row_tiles``), so only
        the last register tile keeps the predicate; the cap was not re-measured since.  The table's 2, not 1: with one register tile per macro tile TVM's
        CompactBufferAllocation no longer shrinks the accumulator to the tile (it stays a rows x N
        buffer from the workspace allocator, and LLVM stores every partial sum: the kernel slower
        still; tests/test_symbolic_token_models.py checks the accumulator's static size)."""
        cap = min(want, int(self.table_defaults(target)["row_mc_tiles"]))
        return max([c for c in choices["mc_tiles"] if c <= cap] or [min(choices["mc_tiles"])])

    # ------------------------------------------------------------------ size buckets
    def buckets(self, match: Match, target: C.Target) -> tuple[Bucket, ...]:
        """Few rows (at most the table's ``small_rows``): the GEMV-like nest; more: the row-tiled one.  Up to
        ``serial_rows`` (when fewer than ``small_rows``) a serial GEMV-like nest first (a fork of the thread
        pool costs more than its work); with ``serial_rows`` at least ``small_rows`` the GEMV-like nest is
        the serial one."""
        small = int(self.table_defaults(target)["small_rows"])
        serial = match.info["serial_rows"] if "serial_rows" in match.info else self.serial_rows(match, target)
        first = (Bucket(f"rows<={serial}", serial),) if 0 < serial < small else ()
        return (*first, Bucket(f"rows<={small}", small), Bucket(f"rows>{small}", None))

    def bucket_match(self, match: Match, bucket: Bucket) -> Match:
        """The match a bucket's space, default and apply read: ``small`` for a bounded bucket, ``serial``
        for a bound within ``serial_rows`` (``match_rows`` put both in the match)."""
        bounded = bucket.max_extent is not None
        serial = bounded and bucket.max_extent <= match.info["serial_rows"]
        return Match(self.family, {**match.info, "bucket": bucket.name, "small": bounded, "serial": serial,
                                   **({"rows": bucket.max_extent} if bounded else {})})

    def dispatch_extent(self, match: Match):
        """The run-time row count the buckets split: batch extents x M (an expression of the kernel's
        symbolic shape variables)."""
        rows = match.info["M"]
        for b in match.info["batch"]:
            rows = b * rows
        return rows

    def bucket_sizes(self, match: Match, bucket: Bucket, target: C.Target) -> dict[str, int]:
        """The symbolic shape variables a tuner binds to measure ``bucket``'s nest: a row count inside the
        bucket (its bound; the open bucket: the table's ``nominal_rows``, or one more than the last bound),
        all of it on the innermost symbolic row extent, the others 1."""
        buckets = self.buckets(match, target)
        if bucket.max_extent is not None:
            rows = bucket.max_extent
        else:
            last = max(b.max_extent for b in buckets if b.max_extent is not None)
            rows = max(int(self.table_defaults(target)["nominal_rows"]), last + 1)
        symbolic = [e for e in [*match.info["batch"], match.info["M"]] if not _is_static(e)]
        if not all(isinstance(e, C.tirx.Var) for e in symbolic):
            raise ValueError(f"row extents {symbolic}: a bucket's measured size needs plain shape variables")
        return {str(v.name): (rows if i == len(symbolic) - 1 else 1) for i, v in enumerate(symbolic)}


class SymbolicMatmulEpilogue(RowBuckets, MM.MatmulEpilogue, family="cpu.symbolic_matmul"):
    """``cpu.matmul_epilogue``'s schedule (and its ``MatmulConfig``) over a symbolic row count (see the module
    docstring)."""

    def accepts(self, group, target: C.Target) -> str | None:
        """One matmul anchor with symbolic rows, no row reduction, and (``analyze`` on its PrimFunc) static
        N and K, a weight shared by the batches and N a multiple of the vector width."""
        why = MM.one_matmul_anchor(group, static=False)
        if why is not None:
            return why
        anchor, sch, reds = U.anchor_reductions(group)
        if len(reds) != 1 or self.analyze(sch, reds[0], target) is None:
            return f"{anchor.name} is not [rows, K] @ [K, N] with static N, K and N a multiple of the vector width"
        return None

    def analyze(self, sch: C.Schedule, red, target: C.Target) -> dict | None:
        return analyze_symbolic_rows_matmul(sch, red, target)

    def buckets(self, match: Match, target: C.Target) -> tuple[Bucket, ...]:
        """``RowBuckets.buckets``, except for a weight over the table's ``gemv_weight_l1_share`` of L1: the
        GEMV-like nest reads the whole weight again for every row, so it keeps the rows under the fork/join
        cost (``serial_rows``: the serial nest; one row at least) and more rows take the row-tiled nest (convnext_dyn b1's
        MLPs at 16 and 4 rows: 2-3x faster row-tiled, kernel-only, measured under load).
        tests/test_symbolic_buckets.py::test_a_weight_over_the_l1_share_leaves_the_gemv_nest_at_the_serial_bound"""
        d = self.table_defaults(target)
        weight = match.info["N"] * match.info["K"] * 4
        if weight <= float(d["gemv_weight_l1_share"]) * cpu_info(target).l1d_bytes:
            return super().buckets(match, target)
        serial = match.info["serial_rows"] if "serial_rows" in match.info else self.serial_rows(match, target)
        # one row at least (a tuner's task per bucket needs a bounded one): a single row reads the weight
        # once either way, and the GEMV-like nest has no predicated rows
        small = max(1, min(serial, int(d["small_rows"])))
        return Bucket(f"rows<={small}", small), Bucket(f"rows>{small}", None)

    def finish(self, func: C.PrimFunc, info: dict, target: C.Target) -> Match | None:
        return self.if_every_bucket_schedules(func, self.match_rows(Match(self.family, info), target), target)

    def space(self, match: Match, target: C.Target) -> KnobSpace:
        n, k = match.info["N"], match.info["K"]
        lanes = cpu_info(target).float32_lanes
        small = match.info.get("small", False)
        return MM.MatmulConfig.space(
            # few rows: one row per register tile and per macro tile (no row tiling, no wasted rows)
            **({"mr": (1,), "mc_tiles": (1,)} if small else {"mr": SYM_MR_CHOICES, "mc_tiles": MM.MC_TILES}),
            nvec=tuple(v for v in (GEMV_NVEC_CHOICES if small else MM.NVEC_CHOICES) if n % (v * lanes) == 0),
            lanes=(lanes,),
            nc_tiles=U.choices_upto(MM.NC_TILES, max(1, n // lanes)),
            k_unroll=U.choices_upto(MM.K_UNROLL, k),   # order, parallel_depth: MatmulConfig's candidates
            pack_b=(False,),          # B is shared by every row tile; no packing over symbolic rows
            pad_n=(False,),           # N is a multiple of the vector width (match)
            flatten_batch=(True,),    # batch and sequence rows as one symbolic row axis
            # rows padded to the register tile (matmul.pads_symbolic_rows); the GEMV-like nest has none
            pad_m=(False,) if small else (False, True))

    def default_config(self, match: Match, target: C.Target) -> dict:
        info, d = cpu_info(target), self.table_defaults(target)
        ch = {kb.name: kb.choices for kb in self.space(match, target).knobs}
        n, k, lanes, rows = match.info["N"], match.info["K"], info.float32_lanes, d["nominal_rows"]
        if match.info.get("small", False):
            return self._small_default(match, target, ch)
        tile = MM.register_tile_default(rows, n, k, lanes, info, ch, d, self.accumulator_cap(lanes))
        mr, nr = tile["mr"], tile["nvec"] * lanes
        # a macro tile no wider than N (wider ones only add always-false column predicates), and one that
        # divides N's register tiles where a choice does (no column predicate in the row nest: levit_dyn's
        # N = 160, 10 tiles of 16, in macro tiles of 5, not 8; notes/visionsym13.md).  That predicate once
        # made TVM's lowering fail ("int32 vs. int64"); the cause, the loop-partition hint on the predicated
        # column loop, is fixed in matmul.partition_row_tiles, so any nc_tiles of the space builds
        # (tests/test_symbolic_matmul_rows.py::test_column_predicate_with_row_tiles_builds)
        fits = [c for c in ch["nc_tiles"] if c <= max(1, min(tile["nc_tiles"], n // nr))]
        dividing = [c for c in fits if (-(-n // nr)) % c == 0]
        nc_tiles = max(dividing or fits)
        # rows are the parallel dimension (their count is unknown): a macro tile of the table's
        # row_mc_tiles register tiles per task (RowBuckets.row_macro_tiles)
        mc_tiles = self.row_macro_tiles(min(tile["mc_tiles"], max(1, rows // (mr * info.cores))), ch, target)
        return MM.MatmulConfig(**{**tile, "mc_tiles": mc_tiles, "nc_tiles": nc_tiles}, order=d["order"],
                               parallel_depth=1, pack_b=False, pad_n=False, flatten_batch=True,
                               pad_m=bool(d["pad_m"]) and tile["mr"] > 1).asdict()

    def _small_default(self, match: Match, target: C.Target, ch: dict) -> dict:
        """GEMV-like: one row per tile, rows looped inside the column macro tiles, which are the parallel
        loop (the table's ``small_order``, "ji": j outer): as many macro tiles as cores where N allows, each
        no larger than L2 allows."""
        info, d = cpu_info(target), self.table_defaults(target)
        n, k, lanes = match.info["N"], match.info["K"], info.float32_lanes
        serial = match.info.get("serial", False)
        # the register tile of a GEMM row (MatmulConfig's vectors), then widened for one row's FMA chains
        narrow = MM.register_tile_default(1, n, k, lanes, info, {**ch, "nvec": tuple(
            v for v in ch["nvec"] if v in MM.NVEC_CHOICES)}, d, self.accumulator_cap(lanes))["nvec"]
        nvec = self._gemv_vectors(n, lanes, ch["nvec"], narrow, info, d, serial)
        tile = MM.register_tile_default(1, n, k, lanes, info, {**ch, "nvec": (nvec,)}, d,
                                        self.accumulator_cap(lanes))
        nr = tile["nvec"] * lanes
        enough = [c for c in ch["nc_tiles"] if c <= tile["nc_tiles"] and n // (nr * c) >= info.cores]
        nc_tiles = max(enough) if enough else min(ch["nc_tiles"])
        # a serial bucket (RowBuckets.serial_rows: under the fork/join cost) keeps the nest serial
        return MM.MatmulConfig(**{**tile, "nc_tiles": nc_tiles}, order=d["small_order"], parallel_depth=1,
                               pack_b=False, pad_n=False, flatten_batch=True, parallel=not serial).asdict()

    @staticmethod
    def _gemv_vectors(n: int, lanes: int, choices, narrow: int, info, d: dict, serial: bool) -> int:
        """The GEMV-like nest's vectors per register tile: one row, so each accumulator is one FMA chain and
        each B vector an FMA's memory operand.  A serial nest takes the most accumulators that divide N
        (``choices``: the space's, N-dividing), at most the table's ``gemv_accumulators`` (the chains that
        hide the FMA latency) and the vector registers less one (A's broadcast), and never fewer than
        ``narrow``.  A parallel nest (its
        parallel loop is over column tiles) widens ``narrow`` (the GEMM row's tile) only as far as a column
        tile per core remains: measured at one row only (serial), notes/gpt2one14.md.
        tests/test_symbolic_gemv_tile.py"""
        regs = U.Registers.for_bits(info.vector_bits).count
        fit = [v for v in choices if v <= int(d["gemv_accumulators"]) and v + 1 <= regs]
        if not serial:
            fit = [v for v in fit if n // (v * lanes) >= info.cores]
        return max([narrow, *fit])

    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        # cpu.matmul_epilogue's steps; flattenable(info) holds (shared weight, ordered iterators), so its
        # Step 2c makes one symbolic row axis and Step 3 splits it with a predicated last tile.
        super().apply(sch, match, config)
        if not match.info.get("small", False):
            # one register tile per macro tile: no row loop inside the parallel one, which is split then
            partition_row_tiles(sch, parallel_too=MM.MatmulConfig.from_dict(config).mc_tiles == 1)


# the row-tiled nest's loop-partition hint: shared with cpu.matmul_epilogue (a static row count that is not a
# multiple of the macro tile), defined there
partition_row_tiles = MM.partition_row_tiles
