"""Row-wise reduction chains on CPUs: LayerNorm, RMSNorm, Softmax, norm + activation, mean & variance.

Matches a PrimFunc with at least one reduction block where every block (reductions and elementwise)
starts with the same spatial "row" loops and every reduction reduces only trailing axes: several
reductions over the row in one kernel.  After folding the elementwise blocks, each output chain is
computed row by row: all its blocks are moved under the row loop of its last block (the row stays in
L1/L2 between the passes), the row loop is parallel, elementwise passes are vectorized, and reductions
are vectorized by an rfactor over ``rf_width`` partial sums (independent accumulators).  A row whose
length the vector width does not divide keeps full vectors in its main loops: the elementwise passes run
on whole vectors and one vector of the row's last row_len % lanes elements finishes it (_vectorize_pass;
common.partition_tail cuts it off); the partial sums take a
width that divides the row (whole, half or quarter vectors: 104 floats on AVX-512 are 13 x 8), and several
of the narrower ones where one would be a single dependent chain over a long row (1000 floats: 40 = 5 x 8
lanes, default_rf_width).  A row with
no such divisor (65 keys of a ViT softmax, 97, a prime length) reduces its main part on vector partial
sums and the last ``row_len % rf_width`` elements in one vector of that many lanes into the same partial
sums before their write-back (_rfactor_with_tail: the reduction loop is cut first, the tail's init
dropped, the main part rfactored, then the tail folded into the partial sums: no scalar chain of
dependent steps per row): an rfactor over a width that does not divide the row would put a predicate in
its vector loop (stored lane by lane), and a tail cut off the rf block afterwards (loop_partition) loses
that predicate in TVM 0.27 and reads past the row.
Knobs: a typed ``RowReductionConfig``; default values come from the target (``cpu_info``) and the family's
``template_defaults`` in schedules/cpu_targets.json.
The outermost of several row loops may be a symbolic batch (pooling and global pooling of a model
exported with a dynamic batch): it is only fused into the row loop, which is parallel where the static
default would make it so at that batch (a serial nest for the batches with too few rows, a parallel one
for the others: size buckets, ``schedules.buckets``).  Several row axes may be symbolic (BERT's norms and
embedding over [batch, sequence, hidden]): they are fused into one row loop the same way and the buckets
split the product of their extents.  A single symbolic row axis ([sequence, hidden]) or a symbolic row
length goes to ``cpu.symbolic_rows``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import _compat as C
from ...analysis import CONTRACTION, INJECTIVE, REDUCTION
from ...target import cpu_info, template_defaults
from ..base import Config, KnobSpace, Match, knob
from ..buckets import BatchBuckets
from . import common as U
from .matmul import is_contraction

RF_VECTORS = (1, 2, 4)           # partial-sum vectors per reduction (independent FMA chains)
# Partial sums per reduction at most among the multiples of the widths above that divide the row
# (rf_chain_widths; 1000 floats: 40 = 5 x 8 lanes): the write-back adds the partial sums one by one, a
# chain of this many dependent scalar steps per row.
MAX_RF_WIDTH = 64
RF_LANE_DIVISORS = (1, 2, 4)     # or a partial-sum vector of target lanes / this (at least MIN_RF_LANES)
MIN_RF_LANES = 4
UNROLL = (1, 2, 4)               # unroll of the vectorized elementwise passes
FAMILY = "cpu.row_reduction"     # its defaults (min_rows_per_core, max_rf_vectors, unroll): the target table
# Calls that cost tens of vector instructions each (after tvmfuse.fastmath): a block computing one of them
# and read by a reduction and another consumer (softmax's exp, read by the sum and by the division) is
# computed once into a row buffer instead of being recomputed in each consumer.
EXPENSIVE_CALLS = ("exp", "erf", "tanh", "sigmoid", "log")
PARALLEL = (True, False)         # parallel row loop (False: few rows, a fork costs more)


@dataclass(frozen=True)
class RowReductionConfig(Config):
    """The knobs of ``cpu.row_reduction``: the partial sums of each reduction, the elementwise passes' unroll
    and whether the row loop is parallel."""

    lanes: int = knob("float32 lanes per vector (target)")
    rf_width: int = knob("partial sums per reduction (rfactor; divides the row, else a main part and a scalar "
                         "tail)")
    vectorize_reductions: bool = knob("rfactor the reductions into vector partial sums")
    unroll: int = knob("unroll of the vectorized elementwise passes", UNROLL)
    parallel: bool = knob("parallel row loop", PARALLEL)


def _expensive(sch: C.Schedule, block) -> bool:
    value = U.store_value(sch, block)
    if value is None:
        return False
    found = []

    def visit(node):
        if isinstance(node, C.Call) and hasattr(node.op, "name") and \
                str(node.op.name).rsplit(".", 1)[-1] in EXPENSIVE_CALLS:
            found.append(node)

    C.post_order_visit(value, visit)
    return bool(found)


def _shared_expensive(sch: C.Schedule) -> frozenset:
    """Names of spatial, non-output blocks with an expensive call that a reduction and at least one other
    block read: they stay as blocks (a row buffer each) so that the call runs once per element."""
    outputs = U.output_names(sch)
    keep = set()
    for b in U.top_blocks(sch):
        name = U.block_name(sch, b)
        if name in outputs or not U.is_spatial(sch, b):
            continue
        consumers = list(sch.get_consumers(b))
        if len(consumers) >= 2 and any(U.is_reduction(sch, c) for c in consumers) and _expensive(sch, b):
            keep.add(name)
    return frozenset(keep)


def _reads_each_once(sch: C.Schedule, producer, consumer) -> bool:
    """Whether ``consumer`` reads every element of ``producer``'s output at most once: each of its loads
    of that buffer is indexed by distinct plain iterators covering all of the consumer's iterators (a row
    sum of (x - mean)^2 does; a matmul reading A for every j does not).  Unit iterators are left out."""
    buf = str(sch.get(producer).writes[0].source.name)
    blk = sch.get(consumer)
    own = {str(iv.var.name) for iv in blk.iter_vars          # unit iterators (keepdims axes) repeat nothing
           if not (isinstance(iv.dom.extent, C.tirx.IntImm) and int(iv.dom.extent) == 1)}
    store = blk.body
    if not isinstance(store, C.BufferStore):
        return False
    found = []

    def visit(node):
        if isinstance(node, C.TensorLoad) and str(node.source.name) == buf:
            names = [str(i.name) if isinstance(i, C.tirx.Var) else None for i in node.indices]
            found.append(None not in names and len(set(names)) == len(names) and own <= set(names))

    C.post_order_visit(store.value, visit)
    return bool(found) and all(found)


def _fold(sch: C.Schedule) -> list[str]:
    """The folding every step of this template uses: elementwise blocks inlined, shared expensive kept.

    On top of ``inline_elementwise`` (which keeps a costly producer of a reduction, computed once): a
    spatial block read only by row reductions that read each of its elements once is inlined into them
    too (InstanceNorm's (x - mean)^2 into the variance sum): the same arithmetic, without a row buffer
    written and read back in a pass of its own.
    """
    keep = _shared_expensive(sch)
    U.inline_elementwise(sch, keep=keep)
    outputs = U.output_names(sch)
    changed = True
    while changed:
        changed = False
        for b in U.top_blocks(sch):
            name = U.block_name(sch, b)
            if name in outputs or name in keep or not U.is_spatial(sch, b) or not U.vectorizable(sch, b):
                continue
            consumers = list(sch.get_consumers(b))
            if not consumers or not all(U.is_reduction(sch, c) and not is_contraction(sch, c)
                                        and _reads_each_once(sch, b, c) for c in consumers):
                continue
            try:
                sch.compute_inline(b)
            except C.ScheduleError:
                continue     # several stores, a non-injective read: the block stays (see inline_elementwise)
            changed = True
    return [U.block_name(sch, b) for b in U.top_blocks(sch)]


def _leading_spatial(kinds: str) -> int:
    return len(kinds) - len(kinds.lstrip("S"))


def _row_extents(sch: C.Schedule, block, lead: int) -> list | None:
    """The extents of the block's ``lead`` leading loops: ints, and a symbolic one (batch, sequence) as its
    expression."""
    ext = [sch.get(lp).extent for lp in sch.get_loops(block)[:lead]]
    return [int(e) if isinstance(e, C.tirx.IntImm) else e for e in ext]


def _same_extent(a, b) -> bool:
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return C.Analyzer().can_prove_equal(a, b)


def _row_axes(sch: C.Schedule, names: list[str]) -> int | None:
    """Number of leading spatial loops shared (same extents) by all blocks, or None.  Any of them may be
    symbolic (a batch, a sequence: the same expression in every block); the row itself is static."""
    nrow, extents = None, None
    for n in names:
        b = sch.get_sblock(n)
        kinds = U.iter_kinds(sch, b)
        if "O" in kinds:
            return None
        lead = _leading_spatial(kinds)
        if "R" in kinds and "S" in kinds[lead:]:
            return None          # a reduction followed by spatial axes: not a trailing reduction
        ext = _row_extents(sch, b, lead)
        if lead == 0 or ext is None or any(e < 0 for e in U.loop_extents(sch, b)[lead:]):
            return None
        if extents is None:
            nrow, extents = lead, ext
        else:
            nrow = min(nrow, lead)
            k = 0
            while k < nrow and _same_extent(ext[k], extents[k]):
                k += 1
            nrow = k
        if not nrow:
            return None
    return nrow


def _reads_rows_in_place(sch: C.Schedule, names: list[str], reductions: list[str], nrow: int) -> bool:
    """Whether every block reads each reduction's result at its own leading ``nrow`` iterators, in order
    (a unit iterator may read index 0): then its row loops are the reductions' rows.  Equal extents alone
    can be a coincidence: ConvNeXt's LayerNorm over the channels of a [1, 16, 16, 16] NCHW tensor reads
    sum[n, h, w] from the loops (n, c, h, w), and computing it row by row recomputed the sums per element
    (995 us against 3.5 us for the generic schedule, measured under load)."""
    results = {str(sch.get(sch.get_sblock(r)).writes[0].source.name) for r in reductions}
    ok = True
    for n in names:
        blk = sch.get(sch.get_sblock(n))
        ivs = list(blk.iter_vars)[:nrow]
        ana = C.Analyzer()
        for iv in blk.iter_vars:
            ana.bind(iv.var, iv.dom)        # a reshape's `i % 64` over i < 64 reads row i

        def visit(node, ivs=ivs, ana=ana):
            nonlocal ok
            if not (isinstance(node, C.TensorLoad) and str(node.source.name) in results):
                return
            idx = [_in_range(ana, ana.simplify(i)) for i in list(node.indices)[:nrow]]
            for i, iv in zip(idx, ivs):
                unit = isinstance(iv.dom.extent, C.tirx.IntImm) and int(iv.dom.extent) == 1
                if not (i.same_as(iv.var) or (unit and isinstance(i, C.tirx.IntImm) and int(i) == 0)):
                    ok = False

        C.post_order_visit(blk.body, visit)
    return ok


def _in_range(ana: C.Analyzer, index):
    """``a % m`` as ``a`` where ``0 <= a < m`` is provable: a reshape over a symbolic batch reads
    ``(i // 64 + n) % batch``, which the simplifier leaves as ``n % batch`` (it folds a modulus by a
    constant only)."""
    if isinstance(index, C.tirx.FloorMod) and ana.can_prove(index.a >= 0) and ana.can_prove(index.a < index.b):
        return index.a
    return index


def _rfactor_ok(func: C.PrimFunc, name: str, nrow: int, lanes: int) -> bool:
    """Whether TVM's rfactor accepts this reduction (its reducer must be a known commutative one)."""
    sch = C.Schedule(func)
    _fold(sch)
    try:
        _rfactor(sch, sch.get_sblock(name), nrow, lanes)
    except C.ScheduleError:
        return False
    return True


def _rfactor(sch: C.Schedule, block, nrow: int, width: int):
    """Fuse the reduction loops, split off ``width`` lanes, rfactor them: returns the rf block."""
    loops = sch.get_loops(block)
    red = loops[nrow:]
    r = sch.fuse(*red) if len(red) > 1 else red[0]
    _, ri = sch.split(r, factors=[None, width])
    return sch.rfactor(ri, factor_axis=nrow)


class RowReduction(BatchBuckets, U.CpuTemplate, family=FAMILY, config=RowReductionConfig):

    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        sch = C.Schedule(func)
        left = _fold(sch)
        blocks = [sch.get_sblock(n) for n in left]
        reductions = [U.block_name(sch, b) for b in blocks if U.is_reduction(sch, b)]
        if not reductions or any(not (U.is_spatial(sch, b) or U.is_reduction(sch, b)) for b in blocks):
            return None
        # a matmul or conv is a trailing reduction too, but row by row it would run as scalar dot products
        if any(is_contraction(sch, sch.get_sblock(n)) for n in reductions):
            return None
        nrow = _row_axes(sch, left)
        if nrow is None or not _reads_rows_in_place(sch, left, reductions, nrow):
            return None
        row_extents = [sch.get(lp).extent for lp in sch.get_loops(blocks[-1])[:nrow]]
        if nrow < 2 and not isinstance(row_extents[0], C.tirx.IntImm):
            # a symbolic row count alone ([seq, d] norms of token models) is cpu.symbolic_rows': the size
            # buckets' nests need a row loop of their own each (a fuse of several row axes makes one; one
            # loop shared by both nests gets two different bounds in TVM's analyzer, an InternalError)
            return None
        rows = 1        # a symbolic extent counts as common.SYMBOLIC_BATCH_NOMINAL rows (the defaults)
        symbolic = []   # the symbolic row extents (batch, sequence): their product is the size buckets' extent
        for e in row_extents:
            rows *= U.batch_extent(e)
            if not isinstance(e, C.tirx.IntImm):
                symbolic.append(e)
        row_len = 1
        for e in U.loop_extents(sch, sch.get_sblock(reductions[0]))[nrow:]:
            row_len *= e
        lanes = cpu_info(target).float32_lanes
        rfactorable = [n for n in reductions if _rfactor_ok(func, n, nrow, lanes)]
        info = {"blocks": left, "reductions": reductions, "rfactor": rfactorable,
                "row_axes": nrow, "rows": rows, "row_len": row_len, "outputs": sorted(U.output_names(sch))}
        if symbolic:
            # symbolic rows (a batch, batch x sequence): the row counts too small for a parallel loop get a
            # serial nest; the "batch" the buckets split is the product of the symbolic row extents
            per_batch = rows // U.SYMBOLIC_BATCH_NOMINAL ** len(symbolic)
            need = template_defaults(target, FAMILY)["min_rows_per_core"] * cpu_info(target).cores
            batch = symbolic[0]
            for e in symbolic[1:]:
                batch = batch * e
            # serial also while the rows' elements stay under the fork/join cost (common.serial_batches: what
            # the static default decides at those sizes)
            serial = max((need - 1) // per_batch, U.serial_batches(per_batch * row_len, target))
            info.update(batch=batch, rows_per_batch=per_batch, serial_batches=serial)
        return Match(self.family, info)

    # ------------------------------------------------------------------ size buckets (BatchBuckets)
    # over a symbolic batch whose smallest sizes have fewer rows than a parallel loop needs (the table's
    # ``min_rows_per_core`` per core): a serial nest for those batches, a parallel one for the others, as the
    # static default decides at each batch
    small_key = "serial_batches"

    def batch_info(self, match: Match, batch: int) -> dict:
        return {"rows": match.info["rows_per_batch"] * batch}

    def accepts(self, group, target: C.Target) -> str | None:
        """Static shapes; row reductions only (no matmul/conv), each over the innermost axes of the same
        leading rows and writing one value per row (a mean) or the rows themselves (a fused layer_norm or
        softmax); every op of the group over those rows first (its output
        starts with their extents): the kernel ``match`` computes row by row (``_row_axes``)."""
        if not group.is_static():
            return "symbolic extents (cpu.symbolic_rows takes those)"
        if group.of_kind(CONTRACTION):
            return "a matmul/conv anchor (the matmul and conv families' kernel)"
        rows, rank = None, 0
        for r in group.of_kind(REDUCTION):
            for shape, axes in sorted(r.row_keys):
                lead, rank = len(shape) - len(axes), len(shape)
                if axes != tuple(range(lead, len(shape))):
                    return f"{r.name} reduces axes {list(axes)} of {list(shape)}, not the innermost ones"
                if lead == 0:
                    return f"{r.name} reduces every axis of {list(shape)}: no rows"
                if rows is not None and tuple(shape[:lead]) != rows:
                    return f"reductions over different rows ({list(rows)} and {list(shape[:lead])})"
                rows = tuple(shape[:lead])
                if r.out_shape not in (rows, rows + (1,) * len(axes), tuple(shape)):
                    return f"{r.name} writes {r.out_shape}: neither one value per row of {list(rows)} nor the " \
                           "rows it reads (a window reduction: pooling)"
        if rows is None:
            return "no row reduction (cpu.elementwise takes elementwise kernels)"
        for m in group.members:
            if not isinstance(m.out_shape, tuple) or tuple(m.out_shape[:len(rows)]) != rows:
                return f"{m.name} {m.out_shape} does not run over the rows {list(rows)} first"
        # after the reductions, an op must read their results at its own row indices: a layout op may move
        # the rows (ConvNeXt's transpose back to NCHW, whose extents can equal the rows' by chance) and an
        # op of another rank broadcasts them along other axes
        for m in _after_reductions(group):
            if m.kind == INJECTIVE or len(m.out_shape) != rank:
                return f"{m.name} {list(m.out_shape)} after the reductions may read them off its own rows " \
                       f"{list(rows)} (a layout op, or another rank than the rows read)"
        return None

    def space(self, match: Match, target: C.Target) -> KnobSpace:
        lanes = cpu_info(target).float32_lanes
        # partial sums at most one row wide (a row that does not fill them has no vector step at all);
        # a width that does not divide the row ends with one tail vector into the partial sums
        # (_rfactor_with_tail); full vectors that do not divide it are choices too (the default's tail rule)
        widths = rf_chain_widths(lanes, match.info["row_len"]) or rf_tail_widths(lanes, match.info["row_len"])
        widths = tuple(sorted(set(widths) | set(full_vector_tail_widths(lanes, match.info["row_len"]))))
        return RowReductionConfig.space(lanes=(lanes,), rf_width=widths or (lanes,),
                                        vectorize_reductions=(True, False) if match.info["rfactor"] and widths
                                        else (False,))

    def default_config(self, match: Match, target: C.Target) -> dict:
        info, d = cpu_info(target), self.table_defaults(target)
        space = self.space(match, target).to_dict()
        return RowReductionConfig(
            lanes=info.float32_lanes,
            rf_width=default_rf_width(space["rf_width"], info.float32_lanes,
                                      info.float32_lanes * d["max_rf_vectors"],
                                      match.info["row_len"], float(d["rf_chain_gain"]),
                                      float(d["rf_tail_gain"])),
            vectorize_reductions=True in space["vectorize_reductions"],
            unroll=U.nearest_choice(UNROLL, d["unroll"]),
            # enough rows to split over the cores, and (a static kernel) its input over the target's fork/join
            # cost (common.parallel_default; a symbolic batch's size bucket at its rows, a nest outside one
            # by rows alone)
            parallel=match.info["rows"] >= d["min_rows_per_core"] * info.cores and U.parallel_default(
                None if "batch" in match.info and "bucket" not in match.info
                else match.info["rows"] * match.info["row_len"], target)).asdict()

    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        info, cfg = match.info, RowReductionConfig.from_dict(config)
        lanes, nrow = cfg.lanes, info["row_axes"]
        width = cfg.rf_width

        # Step 1. Fold the elementwise blocks (the same folding as match()); an expensive block read by a
        # reduction and by another block stays, computed once per element into a row buffer (Step 3).
        _fold(sch)

        # Step 2. Vector partial sums: rfactor each reduction over `width` lanes (a width that does not
        # divide the row: Step 5).
        rf_blocks = []
        with_tail = cfg.vectorize_reductions and info["row_len"] % width != 0
        if cfg.vectorize_reductions and not with_tail:
            for name in info["rfactor"]:
                rf_blocks.append(U.block_name(sch, _rfactor(sch, sch.get_sblock(name), nrow, width)))

        # Step 3. One row loop per output chain, parallel; the chain's blocks move under it.
        names = [U.block_name(sch, b) for b in U.top_blocks(sch)]
        anchors = [n for n in names if n in info["outputs"]]
        placed = set()
        for anchor in reversed(anchors):
            a = sch.get_sblock(anchor)
            loops = sch.get_loops(a)
            row = sch.fuse(*loops[:nrow]) if nrow > 1 else loops[0]
            if cfg.parallel:
                sch.parallel(row)
            placed.add(anchor)
            for n in reversed(names):
                if n in placed or n in anchors:
                    continue
                blk = sch.get_sblock(n)
                try:
                    sch.compute_at(blk, row, preserve_unit_loops=False)
                except C.ScheduleError:
                    continue     # not a producer of this chain: it belongs to another output's chain
                placed.add(n)

        # Step 4. Inner loops: vectorize elementwise passes (vector main loop, one tail vector) and the rf
        # partial sums.
        for n in names:
            blk = sch.get_sblock(n)
            if n in rf_blocks:
                loops = sch.get_loops(blk)
                if _unit_outer_dropped(sch, loops, info["row_len"], width):
                    # a row of exactly `width` elements: the outer reduction loop had extent 1 and
                    # compute_at (preserve_unit_loops=False) removed it, the lanes loop is the last one
                    ri = loops[-1]
                    sch.vectorize(ri)
                    init = sch.decompose_reduction(blk, ri)
                else:
                    ri, ro = loops[-2], loops[-1]
                    sch.reorder(ro, ri)
                    sch.vectorize(ri)      # before the init is split off: a reduction block vectorizes
                    init = sch.decompose_reduction(blk, ro)
                sch.vectorize(sch.get_loops(init)[-1])
            elif U.is_spatial(sch, blk):
                loops = sch.get_loops(blk)
                # only the block's own inner loops: the row loop holds the whole chain (vectorizing it
                # gave wrong results, conformance node/test_globalaveragepool, test_mean_*, test_argmax_*)
                if len(loops) > 1:
                    _vectorize_pass(sch, blk, lanes, cfg.unroll)

        # Step 5. A row no partial-sum width divides: each reduction's main part on vector partial sums,
        # the rest as one vector folded into them (_rfactor_with_tail; last: loop_partition replaces the block).
        if with_tail:
            for name in info["rfactor"]:
                _rfactor_with_tail(sch, sch.get_sblock(name), nrow, info["row_len"], width)

        # Step 6. A row buffer (softmax's exp) that the output's pass reads at its own index, after every
        # other reader: written into the output row itself, which that pass then rewrites in place (as
        # onnxruntime's softmax does): no row buffer, so no workspace allocated and freed per row.  Not
        # where the partial sums are narrower than a vector (`rf_width` < `lanes`): rows of 104 on AVX-512
        # (8-lane partial sums reading the 16-lane stores of the output row just written) ran 2x slower in
        # the output than in the row buffer, while rows of 1000 (40-lane partial sums) ran 1.25x faster in
        # the output (bench_cpu --tails, 2026-12-01, alone, both ways);
        # test_schedules_cpu::test_softmax_rows_not_a_multiple_of_the_vector_keep_full_vectors
        if width >= lanes:
            _row_buffer_into_output(sch)


def _after_reductions(group) -> list:
    """The ops of a graph-level group (``analysis.GroupInfo``) that read a reduction's result, directly or
    through other ops of the group (``NodeInfo.readers``), in member order."""
    inside = {id(m) for m in group.members}
    after, todo = set(), list(group.of_kind(REDUCTION))
    while todo:
        for r in todo.pop().readers:
            if r is not None and id(r) in inside and id(r) not in after:
                after.add(id(r))
                todo.append(r)
    return [m for m in group.members if id(m) in after and m.kind != REDUCTION]


def _vectorize_pass(sch: C.Schedule, block, lanes: int, unroll: int) -> None:
    """An elementwise pass over the row (``common.vectorize_inner``): full vectors in its main loop and,
    where ``lanes`` does not divide the row, its last ``row_len % lanes`` elements as **one vector of that
    many lanes** rather than a scalar loop (issue 11: softmax rows of 3071 on AVX-512 ran 15 scalar exps of
    ~20 instructions each per row, about the cost of 15 more vectors, and 15 divisions in the scale pass,
    where fast math gives a vectorized block one reciprocal per row; LLVM computes a 15-lane vector on one
    16-lane register and moves it in 8 + 4 + 2 + 1 lanes).  The tail's cost is then one vector step."""
    if not U.vectorizable(sch, block):
        return
    inner = sch.get_loops(block)[-1]
    n = U.static_extent(sch, inner)
    if n is None or n <= lanes or n % lanes == 0:
        U.vectorize_inner(sch, block, lanes, unroll)
        return
    parts = U.partition_tail(sch, inner, lanes)
    U.vectorize_parts(sch, parts, lanes, unroll)
    for kind, loop in parts:
        if kind == "scalar" and U.static_extent(sch, loop) > 1:
            sch.vectorize(loop)


def _unit_outer_dropped(sch: C.Schedule, loops, row_len: int, width: int) -> bool:
    """Whether the rf block's outer reduction loop (extent row_len / width) is gone: it had extent 1 and a
    compute_at without unit loops dropped it, leaving the ``width`` lanes loop innermost."""
    if row_len != width:
        return False
    last = sch.get(loops[-1]).extent
    return isinstance(last, C.tirx.IntImm) and int(last) == width != 1


def _rfactor_with_tail(sch: C.Schedule, block, nrow: int, row_len: int, width: int) -> bool:
    """Reduce the first ``row_len // width * width`` elements of each row of ``block`` (under its row
    loop, after compute_at) on ``width`` vector partial sums and the rest in one vector of
    ``row_len % width`` lanes into the same partial sums (_fold_tail_into_partial_sums; where the blocks
    are not of its shape, a scalar tail after the write-back); False (block
    unchanged, its reduction stays scalar) when the row is shorter than ``width`` or is not the block's
    one innermost loop (a reduction over several axes, InstanceNorm's H x W: their fused loop cut short of
    a whole number of rows has bindings rfactor refuses).

    The reduction loop is cut in two (loop_partition) before the rfactor, so the vector loop has no
    predicate; the tail's copy of the block loses its init (common.drop_init) and accumulates onto the
    result of the main part's write-back, which runs before it.
    """
    main_len = row_len // width * width
    r = sch.get_loops(block)[-1]
    if main_len == 0 or U.static_extent(sch, r) != row_len:
        return False
    main, tail = sch.loop_partition(r, factors=[main_len, None])
    U.drop_init(sch, sch.get_child_blocks(tail)[0])
    _, ri = sch.split(main, factors=[None, width])
    rf = sch.rfactor(ri, factor_axis=nrow)
    # the rf block's loops: the one bound to its new spatial (lanes) iterator is vectorized, innermost
    loops = sch.get_loops(rf)
    realize = sch.get(loops[-1]).body
    lane_vars = [v for iv, v in zip(realize.block.iter_vars, realize.iter_values)
                 if int(iv.iter_type) == int(C.IterVar.DataPar) and isinstance(v, C.Var)
                 and isinstance(iv.dom.extent, C.IntImm) and int(iv.dom.extent) == width]
    ri = next(lp for lp in loops[-2:] if any(sch.get(lp).loop_var.same_as(v) for v in lane_vars))
    ro = next(lp for lp in loops[-2:] if not sch.get(lp).loop_var.same_as(sch.get(ri).loop_var))
    sch.reorder(ro, ri)
    sch.vectorize(ri)
    init = sch.decompose_reduction(rf, ro)
    sch.vectorize(sch.get_loops(init)[-1])
    _fold_tail_into_partial_sums(sch, tail, rf, nrow, main_len)
    return True


def _enclosing_block(sref):
    """The sref of the nearest block above ``sref``."""
    p = sref.parent
    while p is not None and not isinstance(p.stmt, C.SBlock):
        p = p.parent
    return p


def _fold_tail_into_partial_sums(sch: C.Schedule, tail_loop, rf, nrow: int, main_len: int) -> bool:
    """Move a row's reduction tail (``_rfactor_with_tail``: ``M[r] = op(M[r], V(k))`` for k in [main_len,
    row_len), a scalar loop after the partial sums' write-back) into the partial sums, as one vector of
    ``row_len - main_len`` lanes before the write-back: ``rf[r, k - main_len] = op(rf[r, k - main_len], V(k))``.
    The tail's elements then take a vector step in independent lanes (the tail is shorter than the partial
    sums' width) instead of a chain of dependent scalar steps (2 x 31 per row of 3071 floats on AVX-512,
    issue 11).  False (nothing changed) when the blocks are not of that shape.

    Done on the IR (TVM's schedule primitives cannot move a block into another partition's scope): the
    partition block holding the partial sums gets the new loop before its write-back, the tail's partition
    block is dropped.
    """
    tail_sref = sch.get_sref(tail_loop)
    tail_for = tail_sref.stmt
    realize = tail_for.body
    if not (isinstance(realize, C.SBlockRealize) and isinstance(realize.block.body, C.BufferStore)):
        return False
    blk, store = realize.block, realize.block.body
    v = store.value
    own = [o for o in (getattr(v, "a", None), getattr(v, "b", None))
           if isinstance(o, C.TensorLoad) and o.source.same_as(store.buffer)
           and all(i.same_as(j) for i, j in zip(o.indices, store.indices))]
    red = [iv for iv in blk.iter_vars if int(iv.iter_type) == int(C.IterVar.CommReduce)]
    rf_store = sch.get(rf).body
    if len(own) != 1 or len(red) != 1 or not isinstance(rf_store, C.BufferStore) \
            or len(rf_store.indices) != len(store.indices) + 1:
        return False
    lane = red[0].var - C.tirx.IntImm(str(red[0].var.ty.dtype), main_len)
    idx = list(store.indices[:nrow]) + [lane] + list(store.indices[nrow:])
    load = C.tirx.BufferLoad(rf_store.buffer, idx)
    value = type(v)(load, v.b) if own[0].same_as(v.a) else type(v)(v.a, load)
    ivs = [C.tirx.IterVar(iv.dom, iv.var, int(C.IterVar.DataPar)) if iv.same_as(red[0]) else iv
           for iv in blk.iter_vars]
    m_region = next(r for r in blk.writes if r.source.same_as(store.buffer))
    lanes = C.Range.from_min_extent(red[0].dom.min - main_len, red[0].dom.extent)
    region = C.tirx.BufferRegion(rf_store.buffer, list(m_region.region[:nrow]) + [lanes]
                                 + list(m_region.region[nrow:]))
    reads = [r for r in blk.reads if not r.source.same_as(store.buffer)] + [region]
    new_blk = C.SBlock(ivs, reads, [region], blk.name_hint + "_rf_tail",
                       C.BufferStore(rf_store.buffer, value, idx), None, [], [], blk.annotations)
    new_loop = C.tirx.For(tail_for.loop_var, tail_for.min, tail_for.extent, C.ForKind.VECTORIZED,
                          C.SBlockRealize(realize.iter_values, realize.predicate, new_blk))
    # the write-back (the rf block's consumer) follows the partial sums in their partition block
    main_sref, tail_part = _enclosing_block(sch.get_sref(rf)), _enclosing_block(tail_sref)
    common = _enclosing_block(main_sref)
    if common is None or not common.same_as(_enclosing_block(tail_part)):
        return False
    main_blk = main_sref.stmt
    writeback = sch.get(sch.get_consumers(rf)[0])
    seq = list(main_blk.body.seq) if isinstance(main_blk.body, C.tirx.SeqStmt) else None
    if not seq:
        return False
    at = next((i for i, s in enumerate(seq) if _contains(s, writeback)), None)
    if at is None:
        return False
    new_main = C.SBlock(main_blk.iter_vars, main_blk.reads, main_blk.writes, main_blk.name_hint,
                        C.tirx.SeqStmt(seq[:at] + [new_loop] + seq[at:]), main_blk.init, main_blk.alloc_buffers,
                        main_blk.match_buffers, main_blk.annotations)
    old = common.stmt
    body = []
    for s in (old.body.seq if isinstance(old.body, C.tirx.SeqStmt) else [old.body]):
        if isinstance(s, C.SBlockRealize) and s.block.same_as(main_blk):
            body.append(C.SBlockRealize(s.iter_values, s.predicate, new_main))
        elif not (isinstance(s, C.SBlockRealize) and s.block.same_as(tail_part.stmt)):
            body.append(s)
    new_common = C.SBlock(old.iter_vars, old.reads, old.writes, old.name_hint,
                          body[0] if len(body) == 1 else C.tirx.SeqStmt(body), old.init, old.alloc_buffers,
                          old.match_buffers, old.annotations)
    sch.state.replace(common, new_common, {old: new_common, main_blk: new_main})
    return True


class _Unhandled(Exception):
    """A node _BufferSwap does not rebuild: the row buffer stays."""


class _BufferSwap:
    """Rebuilds a block-form TIR body with every access to buffer ``old`` made to ``new`` (same shape,
    dtype and indices); ``blocks`` maps each rebuilt block to its replacement (schedule state reuse)."""

    def __init__(self, old, new):
        self.old, self.new, self.blocks = old, new, {}

    def expr(self, e):
        """``e`` with the loads of ``old`` made loads of ``new``; the very same node where nothing in it
        changes (fast math's proofs compare indices by identity)."""
        t = C.tirx
        if isinstance(e, (t.IntImm, t.FloatImm, t.Var)):
            return e
        if isinstance(e, C.TensorLoad):
            idx = [self.expr(i) for i in e.indices]
            if e.source.same_as(self.old):
                return t.BufferLoad(self.new, idx)
            return e if _same(idx, e.indices) else t.BufferLoad(e.source, idx)
        if isinstance(e, C.Call):
            args = [self.expr(a) for a in e.args]
            return e if _same(args, e.args) else C.Call(e.op, args, ret_ty=e.ty)
        if isinstance(e, t.Cast):
            v = self.expr(e.value)
            return e if v.same_as(e.value) else t.Cast(e.ty.dtype, v)
        if isinstance(e, t.Select):
            parts = [self.expr(x) for x in (e.condition, e.true_value, e.false_value)]
            return e if _same(parts, (e.condition, e.true_value, e.false_value)) else t.Select(*parts)
        if isinstance(e, t.Not):
            a = self.expr(e.a)
            return e if a.same_as(e.a) else t.Not(a)
        if type(e).__name__ in _BINARY_OPS:
            a, b = self.expr(e.a), self.expr(e.b)
            return e if a.same_as(e.a) and b.same_as(e.b) else type(e)(a, b)
        raise _Unhandled(type(e).__name__)

    def region(self, r):
        return C.tirx.BufferRegion(self.new, list(r.region)) if r.source.same_as(self.old) else r

    def stmt(self, s):
        t = C.tirx
        if s is None:
            return None
        if isinstance(s, C.BufferStore):
            buf = self.new if s.buffer.same_as(self.old) else s.buffer
            value, idx = self.expr(s.value), [self.expr(i) for i in s.indices]
            if buf.same_as(s.buffer) and value.same_as(s.value) and _same(idx, s.indices):
                return s
            return C.BufferStore(buf, value, idx)
        if isinstance(s, t.SeqStmt):
            return t.SeqStmt([self.stmt(x) for x in s.seq])
        if isinstance(s, t.For):
            return t.For(s.loop_var, s.min, s.extent, s.kind, self.stmt(s.body), s.thread_binding, s.annotations,
                         s.step)
        if isinstance(s, C.SBlockRealize):
            return C.SBlockRealize(s.iter_values, s.predicate, self.stmt(s.block))
        if isinstance(s, C.SBlock):
            allocs = [b for b in s.alloc_buffers if not b.same_as(self.old)]
            new = C.SBlock(s.iter_vars, [self.region(r) for r in s.reads], [self.region(r) for r in s.writes],
                           s.name_hint, self.stmt(s.body), self.stmt(s.init), allocs, s.match_buffers,
                           s.annotations)
            self.blocks[s] = new
            return new
        raise _Unhandled(type(s).__name__)


def _static_shape(buf) -> tuple | None:
    """A buffer's shape as ints, or None where an extent is symbolic (a batch)."""
    dims = list(buf.shape)
    return tuple(int(d) for d in dims) if all(isinstance(d, C.tirx.IntImm) for d in dims) else None


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x.same_as(y) for x, y in zip(a, b))


_BINARY_OPS = ("Add", "Sub", "Mul", "Div", "Mod", "FloorDiv", "FloorMod", "Min", "Max", "EQ", "NE", "LT", "LE",
               "GT", "GE", "And", "Or")


def _row_buffer_into_output(sch: C.Schedule) -> bool:
    """Store the row buffer kept by ``_shared_expensive`` (softmax's exp) in the output instead, when
    that is the same computation: the buffer (allocated at the root) and an output have the same static
    shape and dtype, the whole kernel is one row loop (every access inside it is to that row), the output
    is written only by stores that read the buffer at the store's own index, and no access to the buffer
    comes after the first store to the output (in program order within the row) other than those
    reads.  Then each output store reads and rewrites its own element (``y = y * (1 / sum)``).  False
    (nothing changed) otherwise."""
    root = sch.get(U.root(sch))
    func = sch.mod["main"]
    if not isinstance(root.body, C.tirx.For) or len(root.alloc_buffers) == 0:
        return False
    params = list(func.params)
    events = []            # (kind, buffer, store or load, enclosing store) in program order (post order)
    stores = []

    def visit(n):
        if isinstance(n, C.BufferStore):
            stores.append(n)

    C.post_order_visit(root.body, visit)
    for cand in root.alloc_buffers:
        shape = _static_shape(cand)
        outs = [p for p in params if shape is not None and _static_shape(p) == shape
                and str(p.dtype) == str(cand.dtype) and any(st.buffer.same_as(p) for st in stores)]
        if len(outs) != 1:
            continue
        out = outs[0]
        first_out = next(i for i, st in enumerate(stores) if st.buffer.same_as(out))
        ok = True
        for i, st in enumerate(stores):
            loads = []
            C.post_order_visit(st.value, lambda n, loads=loads: loads.append(n) if isinstance(n, C.TensorLoad)
                               else None)
            if any(ld.source.same_as(out) for ld in loads):
                ok = False                      # the output is read: not a write-only output
            if st.buffer.same_as(out):
                own = [ld for ld in loads if ld.source.same_as(cand)]
                if not own or not all(len(ld.indices) == len(st.indices)
                                      and all(a.same_as(b) for a, b in zip(ld.indices, st.indices)) for ld in own):
                    ok = False                  # an output store that does not read the buffer at its index
            elif i > first_out and (st.buffer.same_as(cand) or any(ld.source.same_as(cand) for ld in loads)):
                ok = False                      # the buffer used after the output's pass began
        if not ok:
            continue
        swap = _BufferSwap(cand, out)
        try:
            new_root = swap.stmt(root)
        except _Unhandled:
            return False
        sch.state.replace(sch.get_sref(U.root(sch)), new_root, swap.blocks)
        return True
    return False


def _contains(stmt, block) -> bool:
    found = []
    C.post_order_visit(stmt, lambda n: found.append(n) if n.same_as(block) else None)
    return bool(found)


def rf_tail_widths(lanes: int, row_len: int) -> tuple:
    """Partial-sum widths for a row none of ``rf_widths`` divides: the same candidates, at most one row
    long (the main part takes whole partial-sum steps, a scalar tail the rest), ascending."""
    return tuple(w for w in _rf_candidates(lanes) if w <= row_len)


def _rf_candidates(lanes: int) -> list:
    vectors = [lanes // d for d in RF_LANE_DIVISORS if lanes % d == 0 and lanes // d >= MIN_RF_LANES]
    return sorted({w * v for w in vectors for v in RF_VECTORS if w * v <= lanes * max(RF_VECTORS)})


def rf_chain_widths(lanes: int, row_len: int) -> tuple:
    """``rf_widths`` and the multiples of them, up to MAX_RF_WIDTH, that divide the row, ascending: several
    vectors of one width (1000 floats on AVX-512, where no multiple of a full vector divides the row: 20 =
    16 + 4 and 40 = 16 + 16 + 8 lanes beside 4 and 8; 768: 12, 24 and 48 too).  The knob's choices; the
    default is ``default_rf_width``'s."""
    base = rf_widths(lanes, row_len)
    more = {w * c for w in base for c in range(2, MAX_RF_WIDTH // w + 1) if row_len % (w * c) == 0}
    return tuple(sorted(set(base) | more))


def full_vector_tail_widths(lanes: int, row_len: int) -> tuple:
    """1, 2 or 4 full vectors that do not divide the row but fit in it at least twice: partial sums over the
    row's whole steps and one vector of its last ``row_len % width`` elements (``_rfactor_with_tail``)."""
    return tuple(lanes * v for v in RF_VECTORS if row_len % (lanes * v) and row_len >= 2 * lanes * v)


def default_rf_width(widths, lanes: int, limit: int, row_len: int, chain_gain: float,
                     tail_gain: float = float("inf")) -> int:
    """The default partial-sum width among ``widths`` (the knob's choices): the widest up to ``limit`` lanes
    (the target table's max_rf_vectors full vectors) among the whole, half or quarter vectors
    and their 1, 2 or 4 copies (``rf_widths``).  Where that is narrower than ``limit`` and divides a
    long row (1000 floats on AVX-512: 8 lanes, one dependent chain of 125 max or add steps per row, latency
    bound: twice the time of the 63 steps over rows of 1008 on 16), a wider width that divides the row when
    it takes at most 1 / ``chain_gain`` of the dependent steps per row (the table's ``rf_chain_gain``):
    row_len / width in the main loop plus width in the write-back (104 keeps 8: 13 + 8 against 2 + 52).
    Tried first: ``limit`` full vectors with one tail vector (``full_vector_tail_widths``) where that cuts
    the steps by ``tail_gain`` (the table's ``rf_tail_gain``; infinite: never): 1000 floats take 16 lanes +
    a tail on AVX2 and 32 + a tail on AVX-512, not the chain rule's 40 (measured slowest on AVX2)."""
    base = [w for w in widths if w in _rf_candidates(lanes) and row_len % w == 0] or \
        [w for w in widths if w in _rf_candidates(lanes)] or list(widths)
    w0 = U.choices_upto(base, limit)[-1]
    if w0 >= limit or row_len % w0:
        return w0
    # ``limit`` lanes of full vectors with one tail vector, where that cuts the dependent steps per row by
    # ``tail_gain`` (the table's rf_tail_gain): 1000 floats on AVX2, 16 lanes (62 + 1 + 16 steps) against 8
    # (125 + 8); kernel-only, alone, Zen 3: 137 us against 154 (8 lanes) and 167 (40 = 5 x 8 lanes, the
    # chain below), rows padded to 1008 on 16 lanes 143 (benchmarks/notes/coord14.md)
    if limit in widths and row_len % limit and row_len >= 2 * limit and \
            (row_len // limit + 1 + limit) * tail_gain <= row_len // w0 + w0:
        return limit

    def steps(w):
        return row_len // w + w

    best = min((w for w in widths if w > w0 and row_len % w == 0), key=lambda w: (steps(w), w), default=w0)
    return best if steps(best) * chain_gain <= steps(w0) else w0


def rf_widths(lanes: int, row_len: int) -> tuple:
    """Partial-sum widths that divide the row, ascending: 1, 2 or 4 vectors of the target's lanes, or a
    half or quarter vector (at least MIN_RF_LANES lanes); empty when none divides (a prime row length)."""
    return tuple(w for w in _rf_candidates(lanes) if row_len % w == 0)
