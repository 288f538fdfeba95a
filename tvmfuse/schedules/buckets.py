"""Size-bucket dispatch: one compiled kernel holding a specialised loop nest per range of a symbolic
extent, the choice made at run time inside the kernel.

A template whose schedule needs a known size (``cpu.symbolic_matmul``: a GEMV-like nest for a few rows, a
row-tiled one for many) declares ``buckets(match, target)``: ordered ``Bucket``s, each "extent <= max"
(the last one: every larger extent), and ``bucket_match(match, bucket)``: the match its space, default and
``apply`` read for that bucket.  ``join_buckets`` puts the nests under one root block:
``if rows <= max0: nest0 elif ...: else: nestN``, same parameters, so the kernel count of the model does not
change.  Each bucket has its own tuning record (``records.bucket_key``).
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import _compat as C


@dataclass(frozen=True)
class Bucket:
    """A range of a symbolic extent: ``extent <= max_extent`` (None: any extent the earlier buckets leave)."""

    name: str                 # part of the record key: "rows<=16", "rows>16"
    max_extent: int | None


def check_buckets(buckets) -> None:
    """Buckets must be ordered by bound with exactly one open (last) bucket."""
    bounds = [b.max_extent for b in buckets]
    if len(buckets) < 2 or bounds[-1] is not None or None in bounds[:-1] or bounds[:-1] != sorted(bounds[:-1]):
        raise ValueError(f"size buckets {[b.name for b in buckets]}: need increasing bounds and one last "
                         "open bucket")
    if len({b.name for b in buckets}) != len(buckets):
        raise ValueError(f"size buckets {[b.name for b in buckets]}: names must differ (they key records)")


def _own_buffers(body, buffers, taken: list):
    """``body`` with each of ``buffers`` that an earlier nest allocated (``taken``) replaced by a copy of its
    own, and the nest's buffers.  Each nest then holds every access to its buffers, so lowering places each
    allocation inside the nest's loops where they touch one row (and compacts it to that row): a buffer shared
    by two nests stays at the root, of the symbolic extent's size (the row sums of ``cpu.row_reduction``'s
    nests over batch x sequence: a run-time workspace allocation per call, 2 per layer norm of bert_dyn)."""
    copies = {}
    for buf in buffers:
        if any(buf.same_as(a) for a in taken):
            copies[buf] = C.tirx.decl_buffer(buf.shape, buf.dtype, name=str(buf.name), scope=buf.scope())
    if not copies:
        return body, list(buffers)

    def swap(b):
        return next((new for old, new in copies.items() if b.same_as(old)), b)

    return C.structural_map(body, (C.tirx.Buffer, swap)), [copies.get(b, b) for b in buffers]


def fresh_loop_vars(body):
    """``body`` with a new variable for every loop it holds.  The nests joined in one kernel are schedules of
    one PrimFunc: a loop none of their schedules transformed keeps the original func's variable in each (the
    padding block a conv template computes at the root, unsplit: inception_v3_dyn's 7-tap convs), one
    variable with a different range per nest, which TVM's lowering refuses ("Trying to update var 'i0' with a
    different const bound")."""
    fresh = {}

    def visit(n):
        if isinstance(n, C.tirx.For):
            fresh[n.loop_var] = C.tirx.Var(str(n.loop_var.name), n.loop_var.ty)

    C.post_order_visit(body, visit)
    if not fresh:
        return body
    return C.structural_map(body, (C.tirx.Var, lambda v: fresh.get(v, v)))


def join_buckets(funcs: list, buckets, extent) -> C.PrimFunc:
    """One PrimFunc running ``funcs[i]``'s loop nest when ``extent`` (an expression of the parameters'
    symbolic shapes) falls in ``buckets[i]``.  The funcs are schedules of one PrimFunc (same parameters);
    their root blocks' allocations move to the joined root block, and each nest after the first gets loop
    variables of its own (``fresh_loop_vars``)."""
    check_buckets(buckets)
    if len(funcs) != len(buckets):
        raise ValueError(f"{len(funcs)} loop nests for {len(buckets)} size buckets")
    first = funcs[0]
    allocs, bodies = [], []
    for f in funcs:
        if len(f.params) != len(first.params) or not all(p.same_as(q) for p, q in zip(f.params, first.params)):
            raise ValueError("size buckets: the loop nests do not share the kernel's parameters")
        root = f.body
        if not isinstance(root, C.SBlockRealize) or root.block.iter_vars or root.block.match_buffers:
            raise ValueError("size buckets: a scheduled nest without a plain root block")
        # the root's buffers and those of blocks inside (a nest that is itself a join: its nests' blocks)
        inner = []
        C.post_order_visit(root.block.body, lambda n: inner.extend(n.alloc_buffers)
                           if isinstance(n, C.SBlock) else None)
        body, swapped = _own_buffers(root.block.body, list(root.block.alloc_buffers) + inner, allocs)
        own = swapped[:len(root.block.alloc_buffers)]
        allocs.extend(swapped)
        body = fresh_loop_vars(body) if bodies else body
        # each nest in a block of its own holding its buffers: lowering allocates them inside the nest's
        # branch (buffers of the root block were all allocated at the kernel's entry, whichever nest ran: a
        # workspace allocation per buffer of every nest, 6 in deberta_v2_dyn's masked softmax at b1 s1)
        bodies.append(C.SBlockRealize([], True, C.SBlock([], [], [], f"bucket{len(bodies)}", body,
                                                         alloc_buffers=own)) if own else body)
    body = bodies[-1]
    for b, nest in zip(reversed(buckets[:-1]), reversed(bodies[:-1])):
        body = C.tirx.IfThenElse(extent <= b.max_extent, nest, body)
    return first.with_body(C.SBlockRealize([], True, C.SBlock([], [], [], "root", body)))


class BatchBuckets:
    """Size buckets over a symbolic batch, mixed into a template whose static default changes with the batch
    (the conv families' ``parallel_depth``, the ``parallel`` knob of every CPU family under the fork/join
    cost, ``cpu.row_reduction``'s parallel row loop): a nest per range of batches, each with the static
    default at a batch inside its range.  The template's ``match`` sets ``info["batch"]`` (the batch
    expression) and the largest batches of the bounded ranges: ``info[small_key]`` and
    ``info["serial_batches_work"]`` (the largest batch whose work is under the target's fork/join cost: a
    serial nest), either absent or < 1 for none; ``batch_info(match, batch)`` is what the defaults of a nest at
    ``batch`` read."""

    small_key = "small_batches"
    work_key = "serial_batches_work"

    def batch_info(self, match, batch: int) -> dict:
        raise NotImplementedError

    def batch_bounds(self, match) -> list[int]:
        """The bounded buckets' largest batches, increasing."""
        return sorted({int(b) for b in (match.info.get(self.small_key, 0), match.info.get(self.work_key, 0))
                       if b >= 1})

    def bucket_batch(self, match, bucket: Bucket) -> int:
        """The batch a bucket's defaults assume: its largest, or the open bucket's smallest."""
        return bucket.max_extent if bucket.max_extent is not None else self.batch_bounds(match)[-1] + 1

    def buckets(self, match, target: C.Target) -> tuple:
        bounds = self.batch_bounds(match)
        if not bounds:
            return ()
        return (*(Bucket(f"batch<={b}", b) for b in bounds), Bucket(f"batch>{bounds[-1]}", None))

    def bucket_match(self, match, bucket: Bucket):
        return type(match)(match.family, {**match.info, "bucket": bucket.name,
                                          **self.batch_info(match, self.bucket_batch(match, bucket))})

    def dispatch_extent(self, match):
        return match.info["batch"]

    def bucket_sizes(self, match, bucket: Bucket, target: C.Target) -> dict[str, int]:
        """The batch a tuner measures ``bucket``'s nest at (the one ``bucket_match`` assumes).  A batch that
        is a product of shape variables (``cpu.row_reduction``'s batch x sequence rows) takes that size on
        its last variable, the others 1."""
        batch = match.info["batch"]
        names = []
        C.post_order_visit(batch, lambda n: names.append(str(n.name))
                           if isinstance(n, C.tirx.Var) and str(n.name) not in names else None)
        if not names or not (isinstance(batch, (C.tirx.Var, C.tirx.Mul))):
            raise ValueError(f"batch extent {batch}: a bucket's measured size needs shape variables or "
                             "their product")
        size = self.bucket_batch(match, bucket)
        return {n: (size if i == len(names) - 1 else 1) for i, n in enumerate(names)}


# ---------------------------------------------------------------- the unit bucket: every shape variable 1
def shape_vars(func: C.PrimFunc) -> list:
    """The kernel's symbolic shape variables: its integer parameters and the variables in its buffer
    parameters' shapes, in order of first appearance."""
    out = []

    def add(v):
        if not any(v.same_as(o) for o in out):
            out.append(v)

    for p in func.params:
        if hasattr(p, "shape"):
            for d in p.shape:
                C.post_order_visit(d, lambda n: add(n) if isinstance(n, C.tirx.Var) else None)
        elif isinstance(p, C.tirx.Var) and str(p.ty).startswith("int"):
            add(p)
    return out


def value_at(expr, sizes: dict | None = None, default: int = 1) -> int:
    """``expr`` (an expression of shape variables) with each variable at ``sizes[name]`` (else ``default``)."""
    sizes = sizes or {}
    return int(C.Analyzer().simplify(C.structural_map(
        expr, (C.tirx.Var, lambda v: C.tirx.IntImm(str(v.ty), sizes.get(str(v.name), default))))))


def symbolic_workspace(func: C.PrimFunc) -> bool:
    """A scheduled kernel allocates a buffer of symbolic size (lowered: a run-time workspace allocation and
    free per call, ``TVMBackendAllocWorkspace``; a static one under 1 KiB is a stack buffer)."""
    found = []

    def visit(n):
        if isinstance(n, C.SBlock):
            found.extend(b for b in n.alloc_buffers if not all(isinstance(d, C.tirx.IntImm) for d in b.shape))

    C.post_order_visit(func.body, visit)
    return bool(found)


def symbolic_division(func: C.PrimFunc) -> bool:
    """The kernel divides (or takes a modulo) by a value that is not a constant: a reshape's index over a
    symbolic extent, a few instructions per element."""
    found = []
    C.post_order_visit(func.body, lambda n: found.append(n) if isinstance(
        n, (C.tirx.FloorDiv, C.tirx.FloorMod, C.tirx.Div, C.tirx.Mod)) and not isinstance(n.b, C.tirx.IntImm)
        else None)
    return bool(found)


def unit_nest(func: C.PrimFunc) -> C.PrimFunc:
    """``func``'s loop nest with every shape variable (``shape_vars``) replaced by 1: its loops and its own
    buffers static (the parameters keep their symbolic shapes: the nest runs only when those are all 1,
    ``join_unit``)."""
    vs = shape_vars(func)
    if not vs:
        return func
    params = [p for p in func.params if hasattr(p, "shape")]

    def var(v):
        for s in vs:
            if v.same_as(s):
                return C.tirx.IntImm(str(s.ty), 1)
        return v

    def buf(b):
        for p in params:
            if b.data.same_as(p.data):
                return p
        return b

    unit = func.with_body(C.structural_map(func.body, [(C.tirx.Var, var), (C.tirx.Buffer, buf)]))
    # loop extents and indices of constants folded (``1 * 4``): the nest's loops are then static
    return C.tirx.transform.StmtSimplify()(C.IRModule({"main": unit}))["main"]


def join_unit(func: C.PrimFunc, unit: C.PrimFunc) -> C.PrimFunc:
    """One PrimFunc running ``unit``'s nest when every shape variable of ``func`` is 1 (the test
    ``sum((v - 1)^2) <= 0``: a variable at 0 does not pass it), else ``func``'s (which may itself branch on
    size buckets)."""
    vs = shape_vars(func)
    if not vs:
        return func
    test = None
    for v in vs:
        d = v - C.tirx.IntImm(str(v.ty), 1)
        test = d * d if test is None else test + d * d
    return join_buckets([unit, func], (Bucket("dims=1", 0), Bucket("dims>1", None)), test)
