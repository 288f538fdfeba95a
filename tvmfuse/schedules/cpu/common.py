"""Structure analysis and schedule steps shared by the CPU templates.

Everything here works on an ``s_tir.Schedule`` of one fused PrimFunc: which blocks are spatial or
reductions, which elementwise blocks can be folded into their neighbours (loop fusion at the block level),
and the steps every family ends with (vectorize the innermost loop, parallelize the outer one).
"""
from __future__ import annotations

import math

from dataclasses import dataclass

from ... import _compat as C
from ...analysis import CONTRACTION
from ...analysis import epilogue_of as own_index_consumer, nearest as nearest_choice  # noqa: F401 (shared helpers)
from ...target import cpu_info, template_defaults
from ..base import Template, knob

SPATIAL = 0   # IterVar.iter_type of a data-parallel block iterator (kDataPar)
REDUCE = 2    # IterVar.iter_type of a reduction block iterator (kCommReduce)

# A block with at most this many scalar operations in its stored value may be inlined into a reduction
# that reads it (a pad, a cast, a transpose): recomputing it per use costs less than materializing it.
CHEAP_PRODUCER_OPS = 4

# inline_elementwise keeps a producer apart rather than nest more than this many conditionals (Select,
# if_then_else) on one path of a consumer's expression (``nests_conditionals``).  TVM's TIR lowering of
# t5_encoder_dyn's relative-position kernel: 0.3 s at 2, 12 s at 3, 16 s at 4, 62-185 s unlimited.  In the
# corpus it keeps apart only position-id and bucket computations ([batch, sequence] or [2, sequence]
# integers: albert_dyn, roberta, opt_dyn, t5_encoder_dyn).
MAX_CONDITIONAL_DEPTH = 2


# A kernel over a symbolic batch (the outermost axis of its data and output; every other extent static)
# takes the defaults of a batch of this size: the smallest one, whose parallel loop must find its
# iterations in the other axes; a larger batch only adds iterations to the parallel loop.
SYMBOLIC_BATCH_NOMINAL = 1


def batch_extent(extent) -> int:
    """A static extent, or ``SYMBOLIC_BATCH_NOMINAL`` for a symbolic (batch) extent."""
    return int(extent) if isinstance(extent, C.tirx.IntImm) else SYMBOLIC_BATCH_NOMINAL


class CpuTemplate(Template):
    """A CPU (llvm) family.  A subclass names itself and its typed config in the class line:
    ``class MatmulEpilogue(CpuTemplate, family="cpu.matmul_epilogue", config=MatmulConfig)``; a subclass of
    a family that names neither keeps its parent's.  ``table_defaults(target)``: the family's default knob
    values and thresholds for the target (``template_defaults`` in schedules/cpu_targets.json)."""

    target_kinds = ("llvm",)

    def __init_subclass__(cls, family: str = "", config: type | None = None, **kw):
        super().__init_subclass__(**kw)
        if family:
            cls.family = family
        if config is not None:
            cls.config_type = config

    def table_defaults(self, target: C.Target) -> dict:
        return template_defaults(target, self.family)


# ---------------------------------------------------------------- the parallel decision (issues 11/12)
# One rule for every CPU family: a kernel whose work is under the target's fork/join cost runs serial.
# The cost is ``template_defaults["cpu.parallel"]["fork_join_work_per_core"]`` (schedules/cpu_targets.json,
# per target) times the target's cores: a launch on more threads wakes and joins more of them.  Work is
# counted in scalar operations of the kernel's loop nest (multiply-adds of a conv or matmul, window steps
# of a pooling, elements of an elementwise kernel or a reduction's input).  The decision is a knob
# (``parallel``) of each family's config, so the chosen config records it and the tuner may flip it.
PARALLEL_FAMILY = "cpu.parallel"
PARALLEL = (True, False)


def parallel_knob(default: bool | None = None):
    """The ``parallel`` field of a family's typed config (see :func:`parallel_default`); ``default``: for a
    config that other families construct without it (``cpu.symbolic_matmul``'s ``MatmulConfig``: True)."""
    f = knob("parallel outer loop (False: the kernel's work is under the target's fork/join cost)", PARALLEL)
    if default is not None:
        f.default = default
    return f


def min_parallel_work(target: C.Target) -> int:
    """Scalar operations below which a kernel runs serial on ``target``: the table's
    ``fork_join_work_per_core`` x the target's cores (a 1-core target: never parallel)."""
    cores = cpu_info(target).cores
    if cores <= 1:
        return 1 << 62
    return int(template_defaults(target, PARALLEL_FAMILY)["fork_join_work_per_core"]) * cores


def parallel_why_not(work: int | None, target: C.Target, unit: str = "scalar operations") -> str | None:
    """None when a kernel of ``work`` operations is worth a parallel loop on ``target``, else why it runs
    serial.  ``work`` None (a symbolic extent: the work grows with the batch) is always parallel."""
    if work is None:
        return None
    limit = min_parallel_work(target)
    if work < limit:
        return (f"{work} {unit}, under the fork/join cost of {limit} ({PARALLEL_FAMILY}.fork_join_work_per_core x "
                f"{cpu_info(target).cores} cores)")
    return None


def serial_batches(work_per_batch: int, target: C.Target) -> int:
    """Over a symbolic batch (or row count) of ``work_per_batch`` scalar operations each: the largest batch
    still under the target's fork/join cost (:func:`min_parallel_work`), the bound of a serial size bucket
    (``schedules.buckets``) whose nest gets the static default's ``parallel=False``; 0 for none (a batch of
    1 already over the cost, or a 1-core target: no fork to save)."""
    if work_per_batch < 1 or cpu_info(target).cores <= 1:
        return 0
    return (min_parallel_work(target) - 1) // work_per_batch


def parallel_default(work: int | None, target: C.Target) -> bool:
    """The default of the ``parallel`` knob: :func:`parallel_why_not` found nothing against it."""
    return parallel_why_not(work, target) is None


def matmul_anchors(group) -> list:
    """The matmul anchors of a graph-level group (``analysis.GroupInfo``): contractions with one reduced
    axis (a conv reduces over its channels and window: three)."""
    return [m for m in group.of_kind(CONTRACTION) if m.reduce_axes == 1]


def anchor_reductions(group) -> tuple:
    """(the first matmul anchor, a schedule of its PrimFunc with elementwise blocks folded, its reduction
    blocks): what the symbolic matmul families' ``accepts`` read the anchor's shape from."""
    anchor = matmul_anchors(group)[0]
    sch = C.Schedule(anchor.func)
    inline_elementwise(sch)
    return anchor, sch, [b for b in top_blocks(sch) if not is_spatial(sch, b)]


@dataclass(frozen=True)
class Registers:
    """Vector registers of the target, from its vector width (AVX-512 has 32, AVX2/SSE/NEON 16)."""

    count: int

    @staticmethod
    def for_bits(vector_bits: int) -> "Registers":
        return Registers(32 if vector_bits >= 512 else 16)


# TVM's LowerTVMBuiltin keeps a CPU allocation on the stack (an LLVM alloca, which LLVM promotes to registers)
# only when its storage scope is "global" and it has fewer bytes than this (runtime::kMaxStackAlloca); any
# other allocation becomes a TVMBackendAllocWorkspace call.  A register tile's accumulator therefore keeps the
# "global" scope: in the "local" scope every tile paid a workspace allocation, a memset for its init and
# stores/reloads around the epilogue (the pointer escapes into the call), e.g. a 1x1 conv on a 2x2 plane
# 2.4 -> 2.1 us (one thread, CPU time, under load; tests/test_schedules_cpu_accumulators.py).
MAX_STACK_ALLOCA_BYTES = C.MAX_STACK_ALLOCA_BYTES   # one value, defined in _compat (TVM's limit)


# Most copies of a loop body a template's unrolling may make (register tile x unrolled reduction steps):
# a 7x7 stem conv with its window fully unrolled made 784 copies of a strided-gather tile and 18 s of LLVM
# codegen, a 16x16 patch conv 4096 copies and 62 s; a 3x3 window on a 16-accumulator tile is 144.
MAX_UNROLLED_COPIES = 256


def unroll_bounded(sch: C.Schedule, loops, copies: int, limit: int = MAX_UNROLLED_COPIES) -> list:
    """Unroll ``loops`` in the given order while the body's copies stay within ``limit``: ``copies`` is what
    one iteration already holds (an unrolled register tile), each unrolled loop multiplies it by its extent.
    Stops at the first loop that would exceed the limit (outer loops of a window are not unrolled when an
    inner one is not).  Returns the loops unrolled."""
    done = []
    for loop in loops:
        ext = sch.get(loop).extent
        if not isinstance(ext, C.tirx.IntImm) or copies * int(ext) > limit:
            break
        sch.unroll(loop)
        copies *= int(ext)
        done.append(loop)
    return done


def root(sch: C.Schedule) -> C.SBlockRV:
    return sch.get_sblock("root")


def top_blocks(sch: C.Schedule) -> list:
    """The blocks directly under the root block, in program order."""
    return list(sch.get_child_blocks(root(sch)))


def block_name(sch: C.Schedule, block) -> str:
    return str(sch.get(block).name_hint)


def iter_kinds(sch: C.Schedule, block) -> str:
    """'S'/'R' per block iterator, e.g. 'SSR' for a matmul."""
    kinds = []
    for iv in sch.get(block).iter_vars:
        t = int(iv.iter_type)
        if t == SPATIAL:
            kinds.append("S")
        elif t == REDUCE:
            kinds.append("R")
        else:
            kinds.append("O")
    return "".join(kinds)


def is_spatial(sch: C.Schedule, block) -> bool:
    return set(iter_kinds(sch, block)) <= {"S"}


def is_reduction(sch: C.Schedule, block) -> bool:
    kinds = iter_kinds(sch, block)
    return "R" in kinds and set(kinds) <= {"S", "R"}


def output_names(sch: C.Schedule) -> set[str]:
    return {block_name(sch, b) for b in sch.get_output_blocks(root(sch))}


def count_ops(expr) -> int:
    """Number of arithmetic nodes and calls in an expression (loads and constants count zero)."""
    if isinstance(expr, (C.tirx.IntImm, C.tirx.FloatImm, C.tirx.Var, C.TensorLoad)):
        return 0
    return 1 + sum(count_ops(c) for c in _operands(expr))


_CHILD_ATTRS = ("a", "b", "value", "condition", "true_value", "false_value")


def _operands(expr):
    """An expression's operands (a load's indices not among them)."""
    for attr in _CHILD_ATTRS:
        child = getattr(expr, attr, None)
        if child is not None and not isinstance(child, (int, float, str)) and hasattr(child, "ty"):
            yield child
    yield from getattr(expr, "args", ()) or ()


def _children(expr):
    """An expression's operands and, for a load, its indices."""
    yield from _operands(expr)
    yield from getattr(expr, "indices", ()) or ()


def _conditional(expr) -> bool:
    return isinstance(expr, C.tirx.Select) or (isinstance(expr, C.Call) and hasattr(expr.op, "name") and
                                                 str(expr.op.name) == "tirx.if_then_else")


def conditional_depth(expr, memo: dict | None = None) -> int:
    """The most conditionals (``Select``, ``if_then_else``) on one path from the root of ``expr`` to a leaf
    (load indices included), memoized by node so the walk stays linear in the expression's DAG."""
    memo = {} if memo is None else memo
    if isinstance(expr, (C.tirx.IntImm, C.tirx.FloatImm, C.tirx.Var)):
        return 0
    key = expr.__chandle__()   # the node's address (PrimExpr's == builds an expression)
    if key not in memo:
        memo[key] = int(_conditional(expr)) + max((conditional_depth(c, memo) for c in _children(expr)), default=0)
    return memo[key]


def _conditionals_above(expr, buffer, memo: dict) -> int:
    """The most conditionals on one path from the root of ``expr`` down to a load of ``buffer`` (-1: no
    such load)."""
    if isinstance(expr, (C.tirx.IntImm, C.tirx.FloatImm, C.tirx.Var)):
        return -1
    key = expr.__chandle__()
    if key not in memo:
        if isinstance(expr, C.TensorLoad) and expr.source.same_as(buffer):
            memo[key] = 0
        else:
            below = max((_conditionals_above(c, buffer, memo) for c in _children(expr)), default=-1)
            memo[key] = below + int(_conditional(expr)) if below >= 0 else -1
    return memo[key]


def nests_conditionals(sch: C.Schedule, block, consumers) -> bool:
    """Folding ``block`` could put more than ``MAX_CONDITIONAL_DEPTH`` conditionals on one path of a
    consumer's expression: TVM's simplifier (StmtSimplify, HoistIfThenElse, FlattenBuffer's) re-simplifies
    a conditional's operands under its condition, at a cost that grows steeply with the nesting
    (t5_encoder_dyn's relative-position bucket, ``where`` over ``where`` over an ``if_then_else``
    index: 62-185 s to lower one kernel; tests/test_schedules_cpu_inline_conditionals.py).  The value is
    then computed once into its buffer, as the graph wrote it."""
    value = store_value(sch, block)
    if value is None:
        return False
    depth = conditional_depth(value)
    if depth == 0:
        return False
    buffer = sch.get(block).writes[0].source
    for consumer in consumers:
        target = store_value(sch, consumer)
        if target is not None and _conditionals_above(target, buffer, {}) + depth > MAX_CONDITIONAL_DEPTH:
            return True
    return False


def store_value(sch: C.Schedule, block):
    body = sch.get(block).body
    return body.value if isinstance(body, C.BufferStore) else None


def is_cheap(sch: C.Schedule, block) -> bool:
    value = store_value(sch, block)
    return value is not None and count_ops(value) <= CHEAP_PRODUCER_OPS


def inline_elementwise(sch: C.Schedule, keep=frozenset(), keep_if=None) -> list[str]:
    """Fold every spatial, non-output block into its consumers (repeat until nothing changes).

    A producer read by a reduction is folded only when cheap (a pad or a transpose): an exp feeding a
    matmul is computed once, not once per use.  ``keep`` names blocks that must stay, ``keep_if(sch,
    block, consumers)`` decides others at the time they would be folded.  Returns the
    names of the blocks left, in order.  A block the schedule refuses to inline (several stores, a
    non-injective read) simply stays: that is a property of the kernel, not an error.
    """
    outputs = output_names(sch)
    changed = True
    while changed:
        changed = False
        for block in top_blocks(sch):
            name = block_name(sch, block)
            if name in outputs or name in keep or not is_spatial(sch, block):
                continue
            consumers = sch.get_consumers(block)
            if any(is_reduction(sch, c) for c in consumers) and not is_cheap(sch, block):
                continue
            if keep_if is not None and keep_if(sch, block, consumers):
                continue
            if nests_conditionals(sch, block, consumers):
                continue   # (MAX_CONDITIONAL_DEPTH)
            try:
                sch.compute_inline(block)
            except C.ScheduleError:
                continue
            changed = True
    return [block_name(sch, b) for b in top_blocks(sch)]


def loop_extents(sch: C.Schedule, block) -> list[int]:
    out = []
    for loop in sch.get_loops(block):
        ext = sch.get(loop).extent
        out.append(int(ext) if isinstance(ext, C.tirx.IntImm) else -1)
    return out


def choices_upto(candidates, limit: int) -> tuple:
    """The candidates not above ``limit`` (always at least the smallest one): a legal knob choice list."""
    kept = tuple(c for c in candidates if c <= limit)
    return kept or (min(candidates),)


# Calls TVM's LLVM backend cannot lower on vectors ("unknown intrinsic tirx.cosh": conformance
# node/test_cosh); blocks using them stay scalar. Shifts: see has_shift.


def _calls(expr, out: set) -> set:
    op = getattr(expr, "op", None)
    if op is not None and hasattr(op, "name"):
        out.add(str(op.name))
    for child in _operands(expr):
        _calls(child, out)
    return out


SHIFT_CALLS = frozenset({"tirx.shift_left", "tirx.shift_right"})


def has_shift(sch: C.Schedule, block) -> bool:
    """Integer shifts: LLVM leaves a shift by >= the bit width undefined, and any loop transformation
    changes what it yields (TVM's plain loop happens to give the 0 ONNX expects). Not scheduled."""
    value = store_value(sch, block)
    if value is None:
        return False
    return bool(_calls(value, set()) & SHIFT_CALLS) or "<<" in str(value) or ">>" in str(value)


def func_shifts(func: C.PrimFunc) -> bool:
    """Whether any block of ``func`` computes an integer shift (see :func:`has_shift`): for ``accepts``,
    on an op's PrimFunc before its group's kernel exists."""
    found = []
    C.post_order_visit(func.body, lambda n: found.append(n) if isinstance(n, (C.tirx.LShift, C.tirx.RShift)) or (
        isinstance(n, C.Call) and str(getattr(n.op, "name", "")) in SHIFT_CALLS) else None)
    return bool(found)


def vectorizable(sch: C.Schedule, block) -> bool:
    """Whether the block's stored value may be computed on vectors (not cosh/sinh, not shifts)."""
    value = store_value(sch, block)
    if value is None:
        return True
    return not (_calls(value, set()) & {"tirx.cosh", "tirx.sinh"}) and not has_shift(sch, block)


def static_extent(sch: C.Schedule, loop) -> int | None:
    ext = sch.get(loop).extent
    return int(ext) if isinstance(ext, C.tirx.IntImm) else None


def tail_parts(n: int, lanes: int) -> list[tuple[str, int]]:
    """How a loop of ``n`` iterations runs on ``lanes``-wide vectors without a predicate in a vector loop:
    ``("main", m)`` (the whole vectors) and ``("scalar", s)`` (the last ``n % lanes``), each part only
    when not empty."""
    main = n // lanes * lanes
    return [(kind, size) for kind, size in (("main", main), ("scalar", n - main)) if size > 0]


def partition_tail(sch: C.Schedule, loop, lanes: int) -> list[tuple[str, object]]:
    """Cut ``loop`` (a static extent) into the parts of :func:`tail_parts`: ``[(kind, loop), ...]``.

    A split by ``lanes`` of a loop that ``lanes`` does not divide puts a predicate in the vector loop,
    and TVM's VectorizeLoop then stores one lane at a time (the whole loop runs scalar: 104 floats on
    16-lane AVX-512, tests/test_schedules_cpu.py test_softmax_*); a separate tail keeps the main loop
    full vectors.  The block under ``loop`` is replaced by one copy per part (``loop_partition``): call
    this as the block's last step.
    """
    n = static_extent(sch, loop)
    if n is None:
        raise ValueError("partition_tail needs a loop of static extent")
    parts = tail_parts(n, lanes)
    if len(parts) == 1:
        return [(parts[0][0], loop)]
    main, tail = sch.loop_partition(loop, factors=[parts[0][1], None])
    return [("main", main), ("scalar", tail)]


def drop_init(sch: C.Schedule, block) -> None:
    """Replace reduction ``block`` by a copy without its init: an update that accumulates onto what the
    blocks before it left in its output.

    For the tail of a reduction cut by ``loop_partition``: the partition copies the block with its init
    into every part, and TVM 0.27 lowers each copy's init at that part's own first iteration (``v_k ==
    64`` for the part [64, 65)), which would reset what the main part reduced.
    """
    old = sch.get(block)
    if old.init is None:
        return
    new = C.SBlock(old.iter_vars, old.reads, old.writes, old.name_hint, old.body, None, old.alloc_buffers,
                   old.match_buffers, old.annotations)
    sch.state.replace(sch.get_sref(block), new, {old: new})


def vectorize_parts(sch: C.Schedule, parts, lanes: int, unroll: int = 1, parallel: bool = False) -> None:
    """Schedule the parts of :func:`partition_tail`: the main part [parallel outer][unrolled][vector
    lanes], the scalar tail as it is.  The main part is split by ``lanes`` first (it divides) and its
    outer loop then by ``unroll``: a predicate from that second split tests whole vectors, never lanes."""
    for kind, loop in parts:
        if kind != "main":
            continue
        outer, vec = sch.split(loop, factors=[None, lanes])
        sch.vectorize(vec)
        if unroll > 1:
            outer, mid = sch.split(outer, factors=[None, unroll])
            sch.unroll(mid)
        if parallel:
            sch.parallel(outer)


def vectorize_inner(sch: C.Schedule, block, lanes: int, unroll: int = 1) -> None:
    """Vectorize the innermost loop of ``block`` by ``lanes`` (``unroll`` vectors per step): a loop of at
    most ``lanes`` iterations is one vector; a longer one of static extent gets a vector main loop and a
    short tail (:func:`partition_tail`: the block is replaced, so this is its last step); one of dynamic
    extent a predicated split."""
    if not vectorizable(sch, block):
        return
    inner = sch.get_loops(block)[-1]
    n = static_extent(sch, inner)
    if n is not None and n <= lanes:
        sch.vectorize(inner)
        return
    if n is None:
        _, vec = sch.split(inner, factors=[None, lanes])
        sch.vectorize(vec)
        return
    vectorize_parts(sch, partition_tail(sch, inner, lanes), lanes, unroll)


def schedule_injective(sch: C.Schedule, block, lanes: int, unroll: int = 1, parallel: bool = True,
                       min_parallel: int = 1) -> None:
    """An elementwise block on its own: fuse all loops, [parallel outer][unrolled][vector lanes], and the
    elements that do not fill a vector in a short scalar tail (see :func:`partition_tail`)."""
    loops = sch.get_loops(block)
    if not loops:
        return
    if not vectorizable(sch, block):
        lanes = 1
    if lanes > 1 and _symbolic_outer_static_inner(sch, block, loops, lanes, unroll, parallel):
        return
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    total = static_extent(sch, fused)
    if total is not None and total <= lanes and lanes > 1:
        sch.vectorize(fused)
        return
    go_parallel = parallel and (total is None or total // (unroll * lanes) >= min_parallel)
    if total is None or lanes == 1:
        outer, mid, vec = sch.split(fused, factors=[None, unroll, lanes])
        if lanes > 1:
            sch.vectorize(vec)
        if unroll > 1:
            sch.unroll(mid)
        if go_parallel:
            sch.parallel(outer)
        return
    vectorize_parts(sch, partition_tail(sch, fused, lanes), lanes, unroll, parallel=go_parallel)


def _symbolic_outer_static_inner(sch: C.Schedule, block, loops, lanes: int, unroll: int,
                                 parallel: bool) -> bool:
    """An injective block whose loops are symbolic outside and static inside (``[batch, heads, sequence,
    16]``): the symbolic loops fused into one (parallel) outer loop, the trailing static ones (whole vectors
    of them) fused into the vector part.  Fusing everything instead puts a
    division by the symbolic extents in every lane's index, and the vector loads become gathers (gpt2_dyn's
    Q/K/V head split: 175 us per call vs 5 us static, profile_kernels --dims, 2026-12-01).  False (nothing
    changed) when the loops are not of that form.  tests/test_symbolic.py::
    test_symbolic_injective_keeps_static_inner_axes_as_vectors"""
    split = len(loops)
    inner = 1
    while split > 0 and static_extent(sch, loops[split - 1]) is not None:
        inner *= static_extent(sch, loops[split - 1])
        split -= 1
    if split == len(loops) and len(loops) >= 3:
        # the innermost loop symbolic (a transposed output [batch, heads, 16, sequence]): the loops outside
        # it fused into the (parallel) outer loop, the symbolic one left a plain inner loop, so no lane
        # divides by a symbolic extent (gpt2_dyn's K^T head split, with the Q split: 175 -> 11 us per call)
        outer = sch.fuse(*loops[:-1])
        _fresh_loop(sch, [loops[-1]])            # a variable of its own in each size bucket's nest
        if parallel:
            sch.parallel(outer)
        return True
    if split < 2 or split == len(loops) or inner % lanes != 0:
        # (one symbolic loop outside: kept as it is, its loop var would be shared by the nests of the size
        # buckets (BatchBuckets), which TVM's lowering refuses: "Trying to update var 'ax0' with a different
        # const bound"; a static tail: the predicated split as before)
        return False
    groups = _constant_division_groups(sch, loops[:split])
    first = [static_extent(sch, lp) for lp in groups[0]]
    if len(groups) > 1 and len(first) > 1 and (None in first or math.prod(first) > 1):
        # [batch, heads, sequence | 16] (llama's rotary, gpt2's head split): (batch x heads) the parallel
        # loop and sequence a serial loop inside it, so no index divides by a symbolic extent; one fused
        # loop over all three divides each vector's index by sequence x heads and sequence (3 64-bit
        # divisions per 16-lane vector: llama_dyn's rotary kernels 42 + 21 us per call at sequence 128,
        # 2.8 + 1.6 static)
        outer = [_fresh_loop(sch, g) for g in groups]
    else:
        outer = [sch.fuse(*loops[:split]) if split > 1 else loops[0]]
    bounds = lane_condition_bounds(sch, block, len(loops) - split)
    vec = sch.fuse(*loops[split:]) if len(loops) - split > 1 else loops[split]
    if parallel:
        sch.parallel(outer[0])
    piece = math.gcd(inner, *bounds) if bounds else inner
    if 1 < piece < inner:
        # a select on the inner axes (llama's rotate-half: concat(-x[8:], x[:8]) over 16 lanes, its
        # other half read at (h * 16 + i + 8) % 32): the vector loop split where the condition changes, a
        # loop-partition hint on the pieces' loop, so each piece has the condition constant and the index
        # affine.  Without it TVM's vectorizer scalarized the lane loop (llama_dyn's rotary kernels
        # 14.9 -> 1.15 us at sequence 128, kernel-only, one thread, under load).
        pieces, vec = sch.split(vec, factors=[None, piece])
        sch.annotate(pieces, "pragma_loop_partition_hint", 1)
        if piece <= lanes or piece % lanes:
            _, vec = sch.split(vec, factors=[None, math.gcd(piece, lanes) if piece > lanes else piece])
            sch.vectorize(vec)
            return True
    vectorize_parts(sch, [("main", vec)], lanes, unroll)
    return True


def lane_condition_bounds(sch: C.Schedule, block, n_inner: int) -> list[int]:
    """Where a select in ``block``'s value changes along its ``n_inner`` innermost iterators (static ones,
    fused into the vector loop): for each ``if_then_else`` / ``Select`` condition comparing one of them
    with a constant (``8 <= v_ax3``: a folded concat), that constant times the extents inside that
    iterator, i.e. an offset in the fused inner index at which the condition flips (it flips there again in
    each period of the fused index).  Empty: no such condition."""
    iters = list(sch.get(block).iter_vars)
    inner = iters[len(iters) - n_inner:] if n_inner else []
    strides, stride = {}, 1
    for iv in reversed(inner):
        ext = iv.dom.extent
        if not isinstance(ext, C.tirx.IntImm):
            return []
        strides[iv.var] = (stride, int(ext))
        stride *= int(ext)
    conds = []

    def visit(node):
        if isinstance(node, C.tirx.Select):
            conds.append(node.condition)
        elif getattr(getattr(node, "op", None), "name", "") == "prim.if_then_else":
            conds.append(node.args[0])

    C.post_order_visit(sch.get(block).body, visit)
    bounds = []
    for cond in conds:
        if not isinstance(cond, (C.tirx.LE, C.tirx.LT, C.tirx.GE, C.tirx.GT, C.tirx.EQ, C.tirx.NE)):
            continue
        for var_is_a, (var, const) in ((True, (cond.a, cond.b)), (False, (cond.b, cond.a))):
            if not (isinstance(var, C.tirx.Var) and isinstance(const, C.tirx.IntImm)):
                continue
            found = [(s, e) for v, (s, e) in strides.items() if v.same_as(var)]
            if not found:
                continue
            stride, extent = found[0]
            c = int(const.value)
            if isinstance(cond, (C.tirx.EQ, C.tirx.NE)):
                flips = [c, c + 1]
            else:   # v < c, c <= v, v >= c, c > v flip at c; v <= c, c < v, v > c, c >= v at c + 1
                flips = [c + 1 if isinstance(cond, (C.tirx.LE, C.tirx.GT)) == var_is_a else c]
            bounds += [f * stride for f in flips if 0 < f < extent]
    return bounds


def _constant_division_groups(sch: C.Schedule, loops) -> list[list]:
    """``loops`` cut before each symbolic loop but the first: fusing a group divides only by static
    extents (a fused loop's index is divided by the extents of the loops after each one)."""
    groups = [[loops[0]]]
    for lp in loops[1:]:
        if static_extent(sch, lp) is None:
            groups.append([lp])
        else:
            groups[-1].append(lp)
    return groups


def _fresh_loop(sch: C.Schedule, group):
    """The group's loops fused into one loop with a variable of its own: the nests of the size buckets
    (BatchBuckets) are schedules of one func, and an unfused loop's variable shared by two of them is
    refused by TVM's lowering ("Trying to update var ... with a different const bound")."""
    if len(group) > 1:
        return sch.fuse(*group)
    return sch.split(group[0], factors=[1, None])[1]


def window_reduction(func: C.PrimFunc, analyze):
    """The shared start of the window families' match (conv, pooling): a schedule of ``func`` with one
    top-level reduction block, analysed by ``analyze(sch, block)`` (its info, holding the ``data_buffer``
    it reads, or None); the spatial block producing that data (padding) kept, every other elementwise block
    folded.  Returns (sch, the reduction's name, info, the padding block's name or None, the blocks left)
    or None."""
    sch = C.Schedule(func)
    reductions = [b for b in top_blocks(sch) if not is_spatial(sch, b)]
    if len(reductions) != 1:
        return None
    info = analyze(sch, reductions[0])
    if info is None:
        return None
    name = block_name(sch, reductions[0])
    producers = [b for b in sch.get_producers(reductions[0])
                 if str(sch.get(b).writes[0].source.name) == info["data_buffer"]]
    pad = block_name(sch, producers[0]) if producers and is_spatial(sch, producers[0]) else None
    left = inline_elementwise(sch, keep=frozenset({pad} if pad else ()))
    return sch, name, info, pad, left
