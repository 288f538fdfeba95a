"""Strided max pooling (NCHW, any window, column stride of 2 or more, padding / ceil_mode) on CPUs.

Matches, after folding elementwise producers (a concatenation feeding the pool) into the padding block, one
reduction block

    pool[n, c, y, x] = max over (ry, rx) of data[n, c, y*sh + ry, x*sw + rx]          (sw >= 2)

whose ``data`` is a padding block (``pad_temp``: explicit pads or ceil_mode) or a parameter, of a width
the column stride divides, and nothing else.  ``cpu.row_reduction`` took it as a row of KH x KW elements
(a 9-long reduction on partial-sum vectors) and the generic schedule vectorizes the output columns, whose
window reads are stride-``sw`` gathers: SqueezeNet's 3x3/2 ceil_mode pool on 64x31x31 ran 4x slower than onnxruntime (benchmarks/
gaps_cnn.md, measured under load).

Schedule: one parallel loop over the (n, c) planes.  Default (``rows='shuffle'``): per output row one
block of vector expressions: for each group of ``lanes`` output columns, the max over the window rows of
contiguous vector loads of the columns the group's windows span, then per window column a register
shuffle picking column ``x*sw + rx`` of each output, and the max of the shuffles (LLVM ``shufflevector``:
``vpermt2ps`` on AVX-512).  Where the windows read no padded row or column (SqueezeNet's ceil_mode pool on
31x31 reads rows and columns 0-30 of a 32-wide padded plane) or there is no padding, the rows are read from
the input itself and no copy is made; otherwise the plane's padded input is copied per plane as it is.
64x31x31, one core, CPU time, measured under load: 7.0 us vs 18.6-20.2 us for the column-phase copy below
(the scatter of every padded element to its phase, one scalar store each, was most of its time).
``rows='deinterleave'``: the plane's padded input written by column phase (``pad[n, c, y, x]`` at ``[n, c,
y, x % sw, x // sw]``, as ``conv2d.deinterleave_pad``), the max on vectors of output columns (window loops
outside, the column loop innermost and vectorized) with plain vector loads.  ``rows='gather'``: the padded
input as it is, the window columns read by strided gathers.
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import _compat as C
from ...analysis import var_names
from ...target import cpu_info, template_defaults
from ..base import Config, KnobSpace, Match, knob
from ..buckets import BatchBuckets
from . import common as U

FAMILY = "cpu.window_pool"
ROWS = ("shuffle", "deinterleave", "gather")


@dataclass(frozen=True)
class WindowPoolConfig(Config):
    """The knobs of ``cpu.window_pool``."""

    lanes: int = knob("float32 lanes per vector (the target's width)")
    rows: str = knob("how a window column of consecutive outputs is read: 'shuffle' (contiguous vector loads "
                     "of each window row's max, the columns picked by register shuffles), 'deinterleave' "
                     "(padded input stored by column phase, vector loads) or 'gather' (strided gathers)",
                     ROWS)
    parallel: bool = U.parallel_knob()


def _is_max_update(store):
    """The data load of ``out = max(out, data[...])`` (a TensorLoad), else None."""
    v = store.value
    if type(v).__name__ != "Max":
        return None
    out = str(store.buffer.name)
    loads = [o for o in (v.a, v.b) if isinstance(o, C.TensorLoad)]
    acc = [o for o in loads if str(o.source.name) == out]
    data = [o for o in loads if str(o.source.name) != out]
    return data[0] if len(acc) == 1 and len(data) == 1 else None


def analyze_pool(sch: C.Schedule, block) -> dict | None:
    """The roles of a reduction block if it is a strided NCHW max pool; None otherwise (raises nothing)."""
    blk = sch.get(block)
    store = blk.body
    if U.iter_kinds(sch, block) != "SSSSRR" or blk.init is None or not isinstance(store, C.BufferStore):
        return None
    data = _is_max_update(store)
    if data is None or len(data.indices) != 4:
        return None
    n, c, y, x, ry, rx = [str(iv.var.name) for iv in blk.iter_vars]
    if [getattr(i, "name", None) for i in store.indices] != [n, c, y, x]:
        return None
    if [var_names(i) for i in data.indices] != [{n}, {c}, {y, ry}, {x, rx}]:
        return None
    coef = C.detect_linear_equation(data.indices[3], [blk.iter_vars[3].var])
    if len(coef) != 2 or not isinstance(coef[0], C.tirx.IntImm) or int(coef[0]) < 2:
        return None                 # stride 1 (or not affine): contiguous windows, nothing to deinterleave
    # the (padded) input's width a multiple of the stride: every column phase equally long
    stride, width = int(coef[0]), data.source.shape[3]
    if not isinstance(width, C.tirx.IntImm) or int(width) % stride:
        return None                 # a phase shorter than the others: transform_layout would need padding
    # the window (rows, columns, column dilation) and the output width: the size of a 'shuffle' row block
    dil = C.detect_linear_equation(data.indices[3], [blk.iter_vars[5].var])
    dims = [blk.iter_vars[i].dom.extent for i in (4, 5, 3)]
    window = None
    if len(dil) == 2 and isinstance(dil[0], C.tirx.IntImm) and all(isinstance(d, C.tirx.IntImm) for d in dims):
        window = {"kh": int(dims[0]), "kw": int(dims[1]), "out_w": int(dims[2]), "dilation_w": int(dil[0])}
    return {"stride_w": stride, "data_buffer": str(data.source.name), "pool": U.block_name(sch, block),
            "window": window}


def find_pool(func: C.PrimFunc) -> dict | None:
    """The pool block and its padding block (None: the pool reads a parameter), or None."""
    found = U.window_reduction(func, analyze_pool)
    if found is None:
        return None
    sch, _, info, pad, left = found
    if any(b not in (info["pool"], pad) for b in left) or info["pool"] not in U.output_names(sch):
        return None                 # an epilogue or another kernel in the group: not this family's structure
    info["pad"] = pad
    extents = U.loop_extents(sch, sch.get_sblock(info["pool"]))
    work = 1
    for e in extents:
        work *= e
    info["work"] = None if -1 in extents else work      # window steps (outputs x window); None: symbolic
    if extents[0] == -1 and -1 not in extents[1:]:
        # a symbolic batch: size buckets over it (BatchBuckets), the window steps of one batch
        info.update(batch=sch.get(sch.get_loops(sch.get_sblock(info["pool"]))[0]).extent,
                    batch_work=work // extents[0])      # the other extents' product
    return info


def shuffle_loads(info: dict, lanes: int) -> int | None:
    """The vector loads in one output row's block under ``rows='shuffle'`` (:func:`shuffle_rows`, unrolled:
    per group of ``lanes`` output columns, the vectors of the columns its windows span, each loaded once per
    window row); None where the window or the output width is not constant."""
    w = info.get("window")
    if w is None:
        return None
    loads = 0
    for x0 in range(0, w["out_w"], lanes):
        group = min(lanes, w["out_w"] - x0)
        span = info["stride_w"] * (group - 1) + w["dilation_w"] * (w["kw"] - 1) + 1
        loads += -(-span // lanes) * w["kh"]
    return loads


def shuffle_max_loads(target: C.Target) -> int:
    """The most vector loads one output row's unrolled 'shuffle' block may hold on ``target``
    (``template_defaults["cpu.window_pool"]["shuffle_max_loads"]``, schedules/cpu_targets.json)."""
    return int(template_defaults(target, FAMILY)["shuffle_max_loads"])


def _row_choices(match: Match, target: C.Target) -> tuple:
    """The ``rows`` layouts for this pool, the default first: 'shuffle' only where its unrolled row block
    holds at most ``shuffle_max_loads(target)`` vector loads."""
    loads = shuffle_loads(match.info, cpu_info(target).float32_lanes)
    if loads is not None and loads <= shuffle_max_loads(target):
        return ROWS
    return tuple(r for r in ROWS if r != "shuffle")


class WindowPool(BatchBuckets, U.CpuTemplate, family=FAMILY, config=WindowPoolConfig):
    # ------------------------------------------------------------------ match
    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        info = find_pool(func)
        if info is not None and "batch" in info:
            # over a symbolic batch: a serial nest while the window steps stay under the fork/join cost
            info["serial_batches_work"] = U.serial_batches(info["batch_work"], target)
        return None if info is None else Match(self.family, info)

    # ------------------------------------------------------------------ size buckets (BatchBuckets)
    def batch_info(self, match: Match, batch: int) -> dict:
        return {"work": match.info["batch_work"] * batch}

    # ------------------------------------------------------------------ knobs
    def space(self, match: Match, target: C.Target) -> KnobSpace:
        return WindowPoolConfig.space(lanes=(cpu_info(target).float32_lanes,), rows=_row_choices(match, target))

    def default_config(self, match: Match, target: C.Target) -> dict:
        return WindowPoolConfig(lanes=cpu_info(target).float32_lanes, rows=_row_choices(match, target)[0],
                                parallel=U.parallel_default(match.info["work"], target)).asdict()

    # ------------------------------------------------------------------ apply
    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        info, cfg = match.info, WindowPoolConfig.from_dict(config)
        s = info["stride_w"]

        # Step 1. Fold elementwise producers into the padding block; without one, a copy of the input to
        # lay out (cache_read).
        U.inline_elementwise(sch, keep=frozenset({info["pad"]} if info["pad"] else ()))
        pool = sch.get_sblock(info["pool"])
        if info["pad"]:
            data = sch.get_sblock(info["pad"])
        elif cfg.rows == "shuffle":
            data = None                 # the rows are read from the input itself: no copy
        else:
            reads = [str(r.source.name) for r in sch.get(pool).reads]
            data = sch.cache_read(pool, reads.index(info["data_buffer"]), "global")

        # Step 2. 'deinterleave': the padded input by column phase, a window column of consecutive outputs
        # contiguous.  ('shuffle' keeps the rows as they are: contiguous loads, the columns picked in
        # registers, step 5.)
        if cfg.rows == "deinterleave":
            sch.transform_layout(data, ("write", 0), lambda n, c, y, x: (n, c, y, x % s, x // s))

        # Step 3. One (parallel) loop over the planes; per output row the window loops outside and the output
        # columns innermost.
        n, c, y, x, ry, rx = sch.get_loops(pool)
        sch.reorder(n, c, y, ry, rx, x)
        plane = sch.fuse(n, c)
        if cfg.parallel:              # a pool under the target's fork/join cost stays serial (common.py)
            sch.parallel(plane)

        if data is None:
            shuffle_rows(sch, pool, cfg.lanes)          # Step 4'. (no padding: the input's rows)
            return
        if cfg.rows == "shuffle":
            read = padding_never_read(sch, data, pool)
            if read is not None:
                # Step 4'. The pool's windows lie inside the unpadded input (SqueezeNet's ceil_mode pad is
                # a column and a row it never reads): its rows read the input, no copy (see shuffle_rows).
                shuffle_rows(sch, pool, cfg.lanes, read)
                sch.compute_inline(data)
                return

        # Step 4. The plane's padded input inside the parallel loop, vectorized along its rows.
        sch.compute_at(data, plane, preserve_unit_loops=True)
        if cfg.rows == "shuffle":
            # Step 5. Each output row is one block of vector expressions (see shuffle_rows).
            shuffle_rows(sch, pool, cfg.lanes)
        else:
            # the output columns vectorized (before the init is split off: a reduction block vectorizes)
            sch.vectorize(x)
            init = sch.decompose_reduction(pool, ry)
            sch.vectorize(sch.get_loops(init)[-1])
        U.vectorize_inner(sch, data, cfg.lanes)


def _linear(expr, variables, what: str) -> list[int]:
    """The integer coefficients (then the constant) of ``expr`` in ``variables``; raises if not affine."""
    coef = C.detect_linear_equation(expr, variables)
    if len(coef) != len(variables) + 1 or not all(isinstance(k, C.tirx.IntImm) for k in coef):
        raise ValueError(f"{FAMILY}: the pool's {what} index {expr} is not affine with constant coefficients")
    return [int(k) for k in coef]


def _in_place(expr, n, c, y, x) -> bool:
    """Whether ``expr`` (a pad block's in-bounds value) is a load of its input at the block's own indices,
    ``X[n, c, y, x]``.  (A folded concatenation, an if_then_else on the channel between two such loads,
    read in place per vector was slower than its copy: 128x15x15 5.7 vs 5.0 us, 256x7x7 3.0 vs 2.7 us, one
    core, measured under load; it is copied.)"""
    if not isinstance(expr, C.TensorLoad):
        return False
    i = list(expr.indices)
    return len(i) == 4 and all(a.same_as(v) for a, v in zip(i, (n, c, y, x)))


def padding_never_read(sch: C.Schedule, pad, pool):
    """Where the pool's windows read only the part of the padding block's copy that is its input itself:
    a reader ``read(n, c, row, col)`` of that input in place (``col`` a ramp: a vector), else None.  The pad
    block must store ``if_then_else(cond, X[n, c, y, x], pad_value)`` at its own indices (no top/left
    offset, :func:`_in_place`) and ``cond`` must be provably true over the rows and columns the windows
    span.  None: a padded row or column read, an offset, a folded producer (a concatenation)."""
    t = C.tirx
    blk, pool_blk = sch.get(pad), sch.get(pool)
    store, value = blk.body, blk.body.value
    if not isinstance(store, C.BufferStore) or not isinstance(value, C.Call) or \
            getattr(value.op, "name", "") != "prim.if_then_else":
        return None
    iters = [iv.var for iv in blk.iter_vars]
    if len(iters) != 4 or not all(a.same_as(v) for a, v in zip(store.indices, iters)) or \
            not _in_place(value.args[1], *iters):
        return None
    # the rows and columns the windows span (the pool's data index at its extremes)
    data = _is_max_update(pool_blk.body)
    ana = C.Analyzer()
    for iv in pool_blk.iter_vars:
        ana.bind(iv.var, iv.dom)
    span = [ana.int_set(i) for i in data.indices]
    check = C.Analyzer()
    for v, sp in zip(iters, span):
        lo, hi = sp.min_value, sp.max_value
        if not isinstance(lo, C.tirx.IntImm) or not isinstance(hi, C.tirx.IntImm):
            if v.same_as(iters[0]):
                continue            # a symbolic batch: the batch index is never padded here (identity load)
            return None
        check.bind(v, C.Range.from_min_extent(lo, int(hi) - int(lo) + 1))
    if not check.can_prove(value.args[0]):
        return None
    src = value.args[1].source

    def read(n, c, row, col):
        return t.BufferLoad(src, [n, c, row, col])

    return read


def shuffle_rows(sch: C.Schedule, pool, lanes: int, read=None) -> None:
    """Replace the pool's loops under the plane loop by one block per output row whose body is vector
    expressions: for each group of ``lanes`` output columns, the max over the window rows of contiguous
    vector loads of the input columns the group's windows span (for a 3-wide window of stride 2, 2 x lanes
    + 1 columns: three loads per row), then, per window column ``rx``, a register shuffle picking column
    ``x * stride + rx`` of each output ``x`` from those vectors, and the max of the shuffles.  No strided
    access and no copy by column phase: the loads are plain vector loads and the picking is LLVM's
    ``shufflevector`` (``vpermt2ps`` on AVX-512, ``vpermps`` / blends on AVX2).  The loop nest must be
    ``plane, y, ry, rx, x`` (``apply``'s step 3).  ``read``: ``read(n, c, row, col)`` the rows' values
    instead of the pool's data buffer (the inputs in place, where :func:`padding_never_read` found the
    padding unread)."""
    t = C.tirx
    blk = sch.get(pool)
    loops = sch.get_loops(pool)
    if len(loops) != 5:
        raise ValueError(f"{FAMILY}: shuffle_rows needs the loops plane, y, ry, rx, x; got {len(loops)}")
    realize = []
    C.post_order_visit(sch.get(loops[1]), lambda o: realize.append(o) if isinstance(o, C.SBlockRealize) else None)
    if len(realize) != 1:
        raise ValueError(f"{FAMILY}: shuffle_rows expects one block under the row loop, found {len(realize)}")
    binding = list(realize[0].iter_values)
    vn, vc, vy, vx, vry, vrx = [iv.var for iv in blk.iter_vars]
    kh, kw, ow = (int(blk.iter_vars[i].dom.extent) for i in (4, 5, 3))
    store = blk.body
    load = _is_max_update(store)
    src = load.source
    own_read = read is None
    if read is None:
        def read(n, c, row, col):
            return t.BufferLoad(src, [n, c, row, col])
    ni, ci, yi, xi = load.indices
    n_k = _linear(ni, [vn], "batch")
    c_k = _linear(ci, [vc], "channel")
    y_k = _linear(yi, [vy, vry], "row")
    x_k = _linear(xi, [vx, vrx], "column")

    # the new block: spatial iterators n, c, y bound as the pool's were (y to a fresh row loop)
    y_loop = sch.get(loops[1])
    dtype = str(y_loop.extent.ty)
    row = t.Var("oy", dtype)
    iters = [t.IterVar(blk.iter_vars[i].dom, t.Var(f"v_{name}", str(blk.iter_vars[i].dom.extent.ty)), 0)
             for i, name in enumerate(("n", "c", "y"))]
    bn, bc, by = (iv.var for iv in iters)

    def const(v):
        return t.IntImm(dtype, v)

    in_n = bn * const(n_k[0]) + const(n_k[1])
    in_c = bc * const(c_k[0]) + const(c_k[1])
    row0 = by * const(y_k[0]) + const(y_k[2])

    stmts = []
    for x0 in range(0, ow, lanes):
        xs = range(x0, min(ow, x0 + lanes))
        cols = {(ox, r): x_k[0] * ox + x_k[1] * r + x_k[2] for ox in xs for r in range(kw)}
        lo, hi = min(cols.values()), max(cols.values())
        # Each chunk (the max over the window rows of one vector of columns) is bound to a variable once
        # (tirx.Bind) and each pick shuffles only the chunks its columns lie in.  Inlined into every pick,
        # the chunks made the body kw x chunks x kh loads: the ONNX gate's 60x80 window of dilation and
        # stride 10 (test_MaxPool2d_stride_padding_dilation) built 13 million TIR nodes and ran past the
        # gate's 60 s limit in lowering; bound, it is chunks x kh loads and kw shuffles.
        chunks = []
        for k, start in enumerate(range(lo, hi + 1, lanes)):
            width = min(lanes, hi + 1 - start)
            col = t.Ramp(const(start), const(1), width) if width > 1 else const(start)
            vec = None
            for r in range(kh):
                v = read(in_n, in_c, row0 + const(y_k[1] * r), col)
                vec = v if vec is None else t.Max(vec, v)
            var = t.Var(f"rows_max_{x0}_{k}", str(vec.ty))
            stmts.append(t.Bind(var, vec))
            chunks.append(var)
        value = None
        for r in range(kw):
            offsets = [cols[(ox, r)] - lo for ox in xs]
            first, last = min(offsets) // lanes, max(offsets) // lanes
            pick = t.Shuffle(chunks[first:last + 1], [t.IntImm("int32", o - first * lanes) for o in offsets])
            value = pick if value is None else t.Max(value, pick)
        out_col = t.Ramp(const(x0), const(1), len(xs)) if len(xs) > 1 else const(x0)
        stmts.append(t.BufferStore(store.buffer, value, [bn, bc, by, out_col]))
    body = t.SeqStmt(stmts)

    rows_read = [C.Range.from_min_extent(in_n, const(1)), C.Range.from_min_extent(in_c, const(1)),
                 C.Range.from_min_extent(row0, const(y_k[1] * (kh - 1) + 1)),
                 C.Range.from_min_extent(const(0), src.shape[3])]
    out_shape = store.buffer.shape
    written = [C.Range.from_min_extent(bn, const(1)), C.Range.from_min_extent(bc, const(1)),
               C.Range.from_min_extent(by, const(1)), C.Range.from_min_extent(const(0), out_shape[3])]
    if own_read:
        reads = [t.BufferRegion(src, rows_read)]
    else:       # the inputs read in place (function parameters): their whole extent
        read_bufs = []
        C.post_order_visit(body, lambda e: read_bufs.append(e.source) if isinstance(e, C.TensorLoad) and
                           not any(b.same_as(e.source) for b in read_bufs) else None)
        reads = [t.BufferRegion(b, [C.Range.from_min_extent(const(0), d) for d in b.shape]) for b in read_bufs]
    new = C.SBlock(iters, reads, [t.BufferRegion(store.buffer, written)],
                   f"{blk.name_hint}_rows", body)
    nest = t.For(row, y_loop.min, y_loop.extent, C.ForKind.SERIAL,
                 C.SBlockRealize([binding[0], binding[1], row], True, new))
    sch.state.replace(sch.get_sref(loops[1]), nest, {})
