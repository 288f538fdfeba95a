"""A batched matmul over symbolic extents (attention's score and value products: ``[b h, S, d] @ [b h, d, S]``,
``[b h, S, S] @ [b h, S, d]``, a weight per head ``[b, h, S, d] @ [h, d, n]``) with at most one elementwise
epilogue, on x86/ARM CPUs.

``cpu.symbolic_matmul`` takes a weight shared by every batch with static N and K; a matmul whose second
operand follows a batch axis, or whose N or K is the sequence, otherwise went to ``cpu.symbolic_rows``:
one output row at a time, its accumulator a row of the whole ``[b h, S, S]`` buffer in memory and its
vector loop over a symbolic N predicated lane by lane (TVM's vectorizer then runs it scalar).
deberta_v2_dyn's QK^T + relative-position bias at b1 s128: 545 us against 31 us for the static build
(kernel-only, one thread, under load; benchmarks/notes/deberta14.md).

Matches a kernel whose one reduction block is ``C[b.., i, j] += A[.., i, k] * B[.., k, j]`` (plain index
variables; A reads no j, B no i, each reads a subset of the batch axes in C's order), with a symbolic
extent somewhere and B following at least one batch axis (a weight shared by all batches is
``cpu.symbolic_matmul``'s), and at most one other block: the elementwise epilogue writing the output
over C's domain.

Schedule (``# Step N.`` in ``apply``):
the matmul's i and j domains zero-padded to whole register tiles (``pad_einsum``: A and B copied per batch
with zeros past M and N, the accumulator over ceil(M / mr) x mr rows and ceil(N / nr) x nr columns), so
the k loop has no predicate and the mr x nr accumulator stays a small static buffer (registers); the
epilogue alone keeps the "row / column exists" test, on whole vectors.  The batch axes are fused into the
parallel loop; inside a batch, row tiles then column tiles (serial, under a loop-partition hint that splits
the whole tiles from the last one), k outermost on the register tile.

Size buckets (``schedules.buckets``) over the multiply-adds, ``batch extents x M x N x K``: up to the
target's fork/join cost (``common.serial_batches``), a serial nest with one-row register tiles (no row
padding: A read in place) and column tiles outside the rows, B's padded copy per column tile (``K x nr``:
a stack buffer when K is static) instead of per batch.  The per-batch padded copies of symbolic size are a
workspace allocation each, and with the thread pool's fork they cost more than a few hundred FLOPs:
deberta_v2_dyn's QK^T at b1 s1 1.8-2.0 us a call against 0.1 us for its static build (notes/debsmall16.md).
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import _compat as C
from ...target import cpu_info
from ..base import Config, KnobSpace, Match, knob
from ..buckets import Bucket, shape_vars, value_at
from . import common as U
from . import matmul as MM

MR_CHOICES = (1, 2, 3, 4, 6, 8)       # register-tile rows
NVEC_CHOICES = (1, 2, 3, 4)           # register-tile vectors per row
K_UNROLL_CHOICES = (1, 2, 4)


@dataclass(frozen=True)
class SymbolicBatchMatmulConfig(Config):
    """The knobs of ``cpu.symbolic_batch_matmul``."""

    mr: int = knob("register-tile rows (the matmul's i padded to a multiple of it)", MR_CHOICES)
    nvec: int = knob("register-tile vectors per row (j padded to a multiple of nvec x lanes)", NVEC_CHOICES)
    lanes: int = knob("float32 lanes per vector (target)")
    k_unroll: int = knob("k steps unrolled on the register tile", K_UNROLL_CHOICES)
    parallel: bool = U.parallel_knob(True)


def _static(e) -> bool:
    return isinstance(e, C.tirx.IntImm)


def analyze_batch_matmul(sch: C.Schedule, block) -> dict | None:
    """The roles of ``C[b.., i, j] += A[.., i, k] * B[.., k, j]`` (see the module docstring), with some
    extent symbolic and B following a batch axis; None otherwise."""
    found = MM.mac_operands(sch, block, operand_consts=False)
    if found is None:
        return None
    blk, a, b, c_idx, a_idx, b_idx = found
    ivs = blk.iter_vars
    if [iv.var.name for iv in ivs[:-1]] != [v.name for v in c_idx] or int(ivs[-1].iter_type) != U.REDUCE:
        return None      # iterators (b.., i, j, k) in C's order, k last
    k = ivs[-1].var.name
    i_var, j_var = c_idx[-2].name, c_idx[-1].name
    a_names, b_names = [v.name for v in a_idx], [v.name for v in b_idx]
    if j_var in a_names and i_var in b_names:
        a, b, a_names, b_names = b, a, b_names, a_names          # written B * A
    batch = [v.name for v in c_idx[:-2]]
    if a_names[-2:] != [i_var, k] or b_names[-2:] != [k, j_var]:
        return None
    for names in (a_names[:-2], b_names[:-2]):
        if names != [v for v in batch if v in names]:
            return None  # operands' batch axes: a subset of C's, in C's order
    if not batch or not b_names[:-2]:
        return None      # no batch, or a weight shared by every batch (cpu.symbolic_matmul's)
    dom = [iv.dom.extent for iv in ivs]
    if all(_static(e) for e in dom):
        return None      # all static: cpu.matmul_epilogue's
    return {"M": dom[-3], "N": dom[-2], "K": dom[-1], "batch": dom[:-3], "n_iters": len(ivs),
            "a_buffer": str(a.source.name), "b_buffer": str(b.source.name), "c_buffer": str(blk.body.buffer.name)}


def _macs(info: dict):
    """The kernel's multiply-adds: batch extents x M x N x K (an expression of its shape variables)."""
    macs = info["M"] * info["N"] * info["K"]
    for b in info["batch"]:
        macs = b * macs
    return macs


def _buckets(info: dict) -> tuple:
    """``SymbolicBatchMatmul.buckets``: bounds from the match (``tiny_macs`` of the table, ``serial_macs`` of
    the target's fork/join cost)."""
    tiny, bound = int(info.get("tiny_macs", 0)), int(info.get("serial_macs", 0))
    out = []
    if tiny >= 1:
        out.append(Bucket(f"macs<={tiny}", tiny))
    if bound > max(tiny, 0):
        out.append(Bucket(f"macs<={bound}", bound))
    return (*out, Bucket(f"macs>{out[-1].max_extent}", None)) if out else ()


def _pad_axes(info: dict, mr: int, nr: int) -> list[int]:
    """``pad_einsum``'s padding of the matmul's iterators: i to ``mr``, j to ``nr`` where the extent is
    symbolic or not a multiple (1: unpadded)."""
    padding = [1] * info["n_iters"]
    for pos, ext, tile in ((-3, info["M"], mr), (-2, info["N"], nr)):
        if tile > 1 and not (_static(ext) and int(ext) % tile == 0):
            padding[pos] = tile
    return padding


class SymbolicBatchMatmul(U.CpuTemplate, family="cpu.symbolic_batch_matmul", config=SymbolicBatchMatmulConfig):
    def accepts(self, group, target: C.Target) -> str | None:
        """One matmul anchor over symbolic extents whose anchor PrimFunc ``analyze_batch_matmul`` reads as a
        batched matmul (B following a batch axis); the epilogue is checked on the fused kernel (``match``)."""
        why = MM.one_matmul_anchor(group, static=False)
        if why is not None:
            return why
        anchor, sch, reds = U.anchor_reductions(group)
        if len(reds) != 1 or analyze_batch_matmul(sch, reds[0]) is None:
            return f"{anchor.name} is not a batched matmul C[b.., i, j] += A[.., i, k] * B[b.., k, j]"
        return None

    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        sch = C.Schedule(func)
        U.inline_elementwise(sch)
        blocks = U.top_blocks(sch)
        reds = [b for b in blocks if not U.is_spatial(sch, b)]
        if len(reds) != 1 or len(blocks) > 2:
            return None
        info = analyze_batch_matmul(sch, reds[0])
        if info is None:
            return None
        outputs = U.output_names(sch)
        epi = [b for b in blocks if b not in reds]
        if epi and (U.block_name(sch, epi[0]) not in outputs
                    or len(sch.get(epi[0]).iter_vars) != info["n_iters"] - 1):
            return None  # the one other block: the epilogue over C's domain, writing the output
        info.update(reduction=U.block_name(sch, reds[0]), epilogue=U.block_name(sch, epi[0]) if epi else None,
                    serial_macs=U.serial_batches(1, target),
                    tiny_macs=int(self.table_defaults(target).get("tiny_macs", 0)))
        match = Match(self.family, info)
        try:     # the schedule is the last check (pad_einsum, compute-at regions), on a copy, every bucket's
            for m in [self.bucket_match(match, b) for b in self.buckets(match, target)] or [match]:
                self.apply(C.Schedule(func), m, self.default_config(m, target))
        except (ValueError,) + C.TVMError:
            return None
        return match

    def wants_unit_nest(self, match: Match, target: C.Target, func: C.PrimFunc, scheduled: C.PrimFunc) -> bool:
        """With the table's ``unit_nest``: at every shape variable 1 the bucket's nest with static loops (its
        row and column tile loops one iteration, no tile tests)."""
        return bool(self.table_defaults(target).get("unit_nest")) and bool(shape_vars(func))

    # ------------------------------------------------------------------ size buckets
    def buckets(self, match: Match, target: C.Target) -> tuple:
        """Up to ``tiny_macs`` multiply-adds (the table's; 0: none): the plain scalar nest (no copies, no
        register tile); up to ``serial_macs`` (under the target's fork/join cost; none on a 1-core target):
        the serial few-rows nest; more: the padded, parallel one."""
        return _buckets(match.info)

    def bucket_match(self, match: Match, bucket: Bucket) -> Match:
        bounds = [b.max_extent for b in _buckets(match.info)[:-1]]
        tiny = bucket.max_extent is not None and bucket.max_extent == int(match.info.get("tiny_macs", 0))
        below = [b for b in bounds if bucket.max_extent is None or b < bucket.max_extent]
        return Match(self.family, {**match.info, "bucket": bucket.name, "tiny": tiny,
                                   "few": bucket.max_extent is not None and not tiny,
                                   "above_macs": max(below, default=0)})

    def dispatch_extent(self, match: Match):
        return _macs(match.info)

    def bucket_sizes(self, match: Match, bucket: Bucket, target: C.Target) -> dict[str, int]:
        """The shape variables a tuner measures ``bucket``'s nest at: every one at 1 for the first bucket (its
        fewest multiply-adds); for a later one the last variable at the smallest size past the bucket below
        (the others 1), held under the bucket's own bound where it has one."""
        macs, names = _macs(match.info), []
        C.post_order_visit(macs, lambda n: names.append(str(n.name))
                           if isinstance(n, C.tirx.Var) and str(n.name) not in names else None)
        sizes = {n: 1 for n in names}
        below = int(self.bucket_match(match, bucket).info["above_macs"])
        if below < 1 or not names:
            return sizes

        def count(v: int) -> int:
            return value_at(macs, {names[-1]: v})

        lo, hi = 1, 2                      # the smallest v with count(v) > below: doubling, then bisection
        while count(hi) <= below:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if count(mid) <= below else (lo, mid)
        sizes[names[-1]] = hi
        return sizes

    def space(self, match: Match, target: C.Target) -> KnobSpace:
        lanes = cpu_info(target).float32_lanes
        n = match.info["N"]
        nvec = tuple(v for v in NVEC_CHOICES if not _static(n) or v == 1 or (v - 1) * lanes < int(n))
        if match.info.get("tiny"):    # the scalar nest: no register tile; only the k loop's unroll varies
            return SymbolicBatchMatmulConfig.space(lanes=(lanes,), nvec=(1,), mr=(1,), parallel=(False,))
        if match.info.get("few"):     # the serial nest: one-row register tiles, no parallel loop
            return SymbolicBatchMatmulConfig.space(lanes=(lanes,), nvec=nvec, mr=(1,), parallel=(False,))
        return SymbolicBatchMatmulConfig.space(lanes=(lanes,), nvec=nvec)

    def default_config(self, match: Match, target: C.Target) -> dict:
        """The table's register tile (``mr`` rows of ``tile_floats`` floats, in vectors of the target's
        lanes; a static N narrower than that: the vectors that cover it)."""
        d, lanes = self.table_defaults(target), cpu_info(target).float32_lanes
        ch = {kb.name: kb.choices for kb in self.space(match, target).knobs}
        nvec = max(1, int(d["tile_floats"]) // lanes)
        if _static(match.info["N"]):
            nvec = min(nvec, -(-int(match.info["N"]) // lanes))
        return SymbolicBatchMatmulConfig(
            mr=U.nearest_choice(ch["mr"], int(d["mr"])), nvec=U.nearest_choice(ch["nvec"], nvec), lanes=lanes,
            k_unroll=U.nearest_choice(ch["k_unroll"], int(d["k_unroll"])),
            parallel=not (match.info.get("few") or match.info.get("tiny"))).asdict()

    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        info, cfg = match.info, SymbolicBatchMatmulConfig.from_dict(config)
        nr = cfg.nvec * cfg.lanes
        U.inline_elementwise(sch)
        red = sch.get_sblock(info["reduction"])
        if info.get("tiny"):
            _apply_tiny(sch, info, red, cfg)
            return

        # Step 1. Pad the matmul's i and j domains to whole register tiles (A and B copied with zeros past
        # M and N; C padded, its crop folded into the epilogue or made the write-back).
        padding = _pad_axes(info, cfg.mr, nr)
        pads = []
        if any(p > 1 for p in padding):
            before = {U.block_name(sch, b) for b in U.top_blocks(sch)}
            sch.pad_einsum(red, padding)
            new = [b for b in U.top_blocks(sch) if U.block_name(sch, b) not in before]
            crop = [b for b in new if any(U.block_name(sch, p) == info["reduction"] for p in sch.get_producers(b))]
            if len(crop) != 1:
                raise ValueError(f"pad_einsum of {info['reduction']} made {len(new)} blocks, no single crop")
            pads = [U.block_name(sch, b) for b in new if b not in crop]
            if U.block_name(sch, crop[0]) in U.output_names(sch):
                epi = crop[0]                                    # no epilogue: the crop writes the output
            else:
                sch.compute_inline(crop[0])
                epi = sch.get_sblock(info["epilogue"])
        elif info["epilogue"] is None:
            epi = sch.cache_write(red, 0, "global")              # the write-back from the accumulator
        else:
            epi = sch.get_sblock(info["epilogue"])

        # Step 2. Tile the epilogue: fused batch axes (parallel), row tiles, column tiles, register tile.
        loops = sch.get_loops(epi)
        b_loops, i_loop, j_loop = loops[:-2], loops[-2], loops[-1]
        io, ii = sch.split(i_loop, factors=[None, cfg.mr])
        jo, ji = sch.split(j_loop, factors=[None, nr])
        few = bool(match.info.get("few"))          # the serial few-MACs bucket: columns outside rows
        sch.reorder(*b_loops, *((jo, io) if few else (io, jo)), ii, ji)
        batch = sch.fuse(*b_loops) if len(b_loops) > 1 else b_loops[0]
        if cfg.parallel:
            sch.parallel(batch)

        # Step 3. The matmul on the register tile: k outermost, mr x nr accumulator, vector lanes inside.
        MM.compute_on_register_tile(sch, red, io if few else jo, cfg.lanes, cfg.k_unroll)

        # Step 4. The epilogue on the register tile, vectorized (its predicate tests whole vectors when N is
        # a multiple of the lanes).
        _, e_jv = sch.split(ji, factors=[None, cfg.lanes])
        sch.vectorize(e_jv)

        # Step 5. The padded copies of A and B once per batch (the few-MACs nest: once per column tile, the
        # K x nr panel of B the rows share), vectorized along their last axis.
        for name in pads:
            block = sch.get_sblock(name)
            sch.compute_at(block, jo if few else batch, preserve_unit_loops=True)
            U.vectorize_inner(sch, block, cfg.lanes)

        # Step 6. The row and column tile loops split into whole tiles and the last one (serial loops:
        # matmul.partition_row_tiles' reasons); without it the epilogue's test sits on every tile.  Only a
        # loop over a symbolic extent: over a static one (N = 24; deberta's position keys at a static M = 17
        # under a symbolic batch) TVM 0.27's LoopPartition writes the predicated part's start as an int32 0
        # for the int64 loop and the build fails ("int32 vs. int64"; matmul._column_loop_vars; the hint
        # does nothing on a static kernel anyway: ARCHITECTURE.md).  tests/test_symbolic_batch_matmul.py
        for loop, extent in ((io, info["M"]), (jo, info["N"])):
            if not _static(extent):
                sch.annotate(loop, "pragma_loop_partition_hint", 1)


def _apply_tiny(sch: C.Schedule, info: dict, red, cfg: SymbolicBatchMatmulConfig) -> None:
    """The tiny bucket's nest (a few hundred multiply-adds: deberta_v2_dyn's QK^T + bias at sequence 1, 64):
    every output element a scalar dot product over k, serial, operands read in place.  The padded nests copy
    a ``K x nr`` panel of B with a per-element column test (nr floats per column even when N is 1): at b1
    s1 that copy was the kernel's time (0.53 us a call against 0.05 for the static build's)."""
    # Step 1. The matmul computed per output element inside the epilogue's loops (its accumulator then one
    # element, a register); without an epilogue it writes the output itself.
    if info["epilogue"] is not None:
        epi = sch.get_sblock(info["epilogue"])
        sch.compute_at(red, sch.get_loops(epi)[-1], preserve_unit_loops=True)
    # (Step 2. None: the loops stay as they are, serial, unfused: a fused batch index would divide by the
    # symbolic extents; no predicate anywhere.)
    # Step 3. The k loop (innermost) unrolled by ``k_unroll`` (the accumulator chain stays one: the sum's
    # order is the reference's).
    if cfg.k_unroll > 1:
        k = sch.get_loops(red)[-1]
        _, ki = sch.split(k, factors=[None, cfg.k_unroll])
        sch.unroll(ki)
