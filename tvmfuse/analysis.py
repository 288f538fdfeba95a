"""Target-neutral analysis of TIR PrimFuncs: what the fusion rules and every schedule template ask about
a kernel, in one place (layer 1: uses ``_compat`` only).

- what a group knows before FuseTIR: ``NodeInfo`` per op (kind, shapes, row keys, data operand, PrimFunc),
  ``GroupInfo`` (its ops and outputs), asked by the rules and by the templates' ``accepts``;
- block roles: ``block_graph`` (the root's blocks, iteration kinds S/R/O, producers/consumers, outputs);
- reductions: ``reduction_blocks`` (each block's reduce vars), ``analyze_reductions`` (contraction or row
  reduction, with the (shape, axes) of each row), ``reduced_axes``;
- multiply-accumulate operands: ``multiply_accumulate`` (the two loads of ``out += a * b``),
  ``index_vars``, ``var_names``, ``buffer_loads``, ``coef`` (a var's stride in an index);
- epilogue blocks: ``epilogue_of`` (the single consumer reading a buffer at its own iterators);
- choices: ``nearest`` (the legal choice closest to a wanted number).

Matching is by structure (iteration kinds, access patterns, who reads whom), never by block names.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import _compat as C

# --------------------------------------------------------------------------- what a graph-level group knows
ELEMWISE, INJECTIVE, REDUCTION, CONTRACTION, OPAQUE = "elemwise", "injective", "reduction", "contraction", \
    "opaque"


@dataclass
class NodeInfo:
    """What the rules (and a template's ``accepts``) know about one call_tir before FuseTIR exists."""

    name: str                   # "<prim func>(<var>)", for the report
    kind: str
    pattern: int
    row_keys: frozenset = frozenset()   # (shape read, axes reduced) of each row reduction
    data_arg: object = None             # contraction: the relax var of its data operand
    reduce_axes: int = 0                # contraction: reduced axes (1: a matmul; 3: a conv's rc, ry, rx)
    out_shape: tuple | None = None      # ints and symbolic TIR expressions (see rules.same_shape)
    why_opaque: str = ""
    func: object = None                 # its PrimFunc (not for an opaque op): block roles, calls
    view: bool = False                  # its PrimFunc is a reshape (TVM's has_reshape_pattern): alone, a free view
    # where it sits in its dataflow block (set by grouping): the relax var of its result, and the op of
    # each binding that reads it (None for a reader that is no call_tir op, or the function's result)
    var: object = field(default=None, repr=False, compare=False)
    readers: tuple = field(default=(), repr=False, compare=False)


@dataclass
class GroupInfo:
    """A candidate fusion group at the graph level: its ops (binding order) and those whose value leaves
    the group (its outputs)."""

    members: list
    outputs: list

    def of_kind(self, *kinds) -> list:
        return [m for m in self.members if m.kind in kinds]

    def is_static(self) -> bool:
        """Every op's output shape known and made of integers (no symbolic extent)."""
        return all(is_static(m.out_shape) for m in self.members)


def is_static(shape) -> bool:
    """A shape (nested for a tuple) of integers only."""
    if isinstance(shape, tuple):
        return all(is_static(d) for d in shape)
    return isinstance(shape, int)


# --------------------------------------------------------------------------- block roles
@dataclass
class BlockNode:
    """One block under the root, as far as the templates care."""

    name: str
    kinds: str                     # one letter per iter var: S spatial, R reduction, O other
    extents: tuple[int, ...]       # per iter var
    reads: list                    # buffers read (not counting its own output)
    writes: list                   # buffers written
    is_output: bool                # writes a buffer of the function's signature
    stmt: object                   # the SBlock

    @property
    def is_spatial(self) -> bool:
        return set(self.kinds) == {"S"} or self.kinds == ""

    @property
    def is_reduction(self) -> bool:
        return "R" in self.kinds and "O" not in self.kinds


@dataclass
class BlockGraph:
    blocks: list[BlockNode]        # in program order
    producers: dict                # block name -> names of blocks whose output it reads
    consumers: dict                # block name -> names of blocks reading its output

    def by_name(self, name: str) -> BlockNode:
        return next(b for b in self.blocks if b.name == name)

    @property
    def outputs(self) -> list[BlockNode]:
        return [b for b in self.blocks if b.is_output]

    def ancestors(self, name: str) -> set[str]:
        seen, todo = set(), [name]
        while todo:
            for p in self.producers[todo.pop()]:
                if p not in seen:
                    seen.add(p)
                    todo.append(p)
        return seen

    def components(self) -> list[list[str]]:
        """Blocks connected through intermediates (shared function inputs do not connect)."""
        comp: dict[str, int] = {}
        groups: list[list[str]] = []
        for b in self.blocks:
            if b.name in comp:
                continue
            idx, todo = len(groups), [b.name]
            groups.append([])
            comp[b.name] = idx
            while todo:
                n = todo.pop()
                groups[idx].append(n)
                for m in list(self.producers[n]) + list(self.consumers[n]):
                    if m not in comp:
                        comp[m] = idx
                        todo.append(m)
        order = {b.name: i for i, b in enumerate(self.blocks)}
        return [sorted(g, key=order.get) for g in groups]


def const_int(x) -> int | None:
    return int(x.value) if isinstance(x, C.IntImm) else None


def block_graph(func: C.PrimFunc) -> BlockGraph | None:
    """The root's child blocks of ``func`` with their producers/consumers; None if the function is not a
    flat list of static-shaped blocks under one root (already scheduled, opaque, or dynamic shapes)."""
    sch = C.Schedule(func)
    root = func.body
    if not isinstance(root, C.SBlockRealize):
        return None
    local = list(root.block.alloc_buffers)      # everything else a block writes is an output
    blocks: list[BlockNode] = []
    for rv in sch.get_child_blocks(sch.get_sblock(root.block.name_hint)):
        blk = sch.get(rv)
        loops = sch.get_loops(rv)
        if len(loops) != len(blk.iter_vars) and blk.iter_vars:
            return None
        kinds, extents = "", []
        for iv in blk.iter_vars:
            ext = const_int(iv.dom.extent)
            if ext is None:
                return None
            kinds += {C.IterVarKind.DataPar: "S", C.IterVarKind.CommReduce: "R"}.get(int(iv.iter_type), "O")
            extents.append(ext)
        writes = [w.source for w in blk.writes]
        reads = [r.source for r in blk.reads if not any(r.source.same_as(w) for w in writes)]
        is_out = any(not any(w.same_as(b) for b in local) for w in writes)
        blocks.append(BlockNode(str(blk.name_hint), kinds, tuple(extents), reads, writes, is_out, blk))
    producers = {b.name: [] for b in blocks}
    consumers = {b.name: [] for b in blocks}
    for b in blocks:
        for other in blocks:
            if other is b:
                continue
            if any(any(r.same_as(w) for w in other.writes) for r in b.reads):
                producers[b.name].append(other.name)
                consumers[other.name].append(b.name)
    return BlockGraph(blocks, producers, consumers)


# --------------------------------------------------------------------------- multiply-accumulate operands
def index_vars(indices) -> list[set]:
    """For each index expression of an access, the block iter vars it uses."""
    out = []
    for e in indices:
        vs = set()
        C.post_order_visit(e, lambda n, vs=vs: vs.add(n) if isinstance(n, C.Var) else None)
        out.append(vs)
    return out


def var_names(expr) -> set[str]:
    """The names of the variables an expression uses."""
    out = set()
    C.post_order_visit(expr, lambda n: out.add(str(n.name)) if isinstance(n, C.Var) else None)
    return out


def buffer_loads(expr) -> list:
    found = []
    C.post_order_visit(expr, lambda n: found.append(n) if isinstance(n, C.TensorLoad) else None)
    return found


def multiply_accumulate(block) -> tuple | None:
    """``out[...] = out[...] + a[...] * b[...]`` (operands possibly cast): the two loads, else None."""
    body = block.body
    if not isinstance(body, C.BufferStore) or block.init is None:
        return None
    val = body.value
    if not isinstance(val, C.Add):
        return None
    lhs, rhs = val.a, val.b
    if isinstance(rhs, C.TensorLoad) and rhs.source.same_as(body.buffer):
        lhs, rhs = rhs, lhs
    if not (isinstance(lhs, C.TensorLoad) and lhs.source.same_as(body.buffer)):
        return None
    if not isinstance(rhs, C.Mul):
        return None
    ops = []
    for side in (rhs.a, rhs.b):
        while isinstance(side, C.Cast):
            side = side.value
        if not isinstance(side, C.TensorLoad):
            return None
        ops.append(side)
    return ops[0], ops[1]


def coef(expr, var) -> int | None:
    """The integer coefficient of ``var`` in an index built of +, * by constants, casts; else None."""
    if isinstance(expr, C.Var):
        return 1 if expr.same_as(var) else 0
    if isinstance(expr, C.IntImm):
        return 0
    if isinstance(expr, C.Cast):
        return coef(expr.value, var)
    if isinstance(expr, C.Add):
        a, b = coef(expr.a, var), coef(expr.b, var)
        return None if a is None or b is None else a + b
    if isinstance(expr, C.Mul):
        for k, e in ((expr.a, expr.b), (expr.b, expr.a)):
            if isinstance(k, C.IntImm):
                c = coef(e, var)
                return None if c is None else int(k.value) * c
    return None



# --------------------------------------------------------------------------- reductions
def reduction_blocks(func):
    """(block, reduce vars) of every block with a reduction iterator; None if the func has no root block."""
    try:
        sch = C.Schedule(func)
        root = sch.get_sblock("root")
    except C.TVMError:  # a PrimFunc without a root block: not analyzable, treated as opaque
        return None
    out = []
    stack = list(sch.get_child_blocks(root))
    while stack:
        rv = stack.pop()
        blk = sch.get(rv)
        rvars = [iv.var for iv in blk.iter_vars if int(iv.iter_type) == C.IterVar.CommReduce]
        if rvars:
            out.append((blk, rvars))
        stack.extend(sch.get_child_blocks(rv))
    return out


def uses(expr, vars_) -> bool:
    used = C.tirx.analysis.undefined_vars(expr, [])
    return any(u.same_as(v) for u in used for v in vars_)


def reduced_axes(func) -> int:
    """Most reduction iterators of one block of ``func`` (1 for a matmul, 3 for a conv2d)."""
    return max((len(rvars) for _, rvars in reduction_blocks(func) or []), default=0)


def analyze_reductions(func) -> tuple[bool, frozenset] | None:
    """(is_contraction, row keys) of a PrimFunc with reductions; None when it cannot be analyzed."""
    blocks = reduction_blocks(func)
    if not blocks:
        return None
    contraction, keys = False, set()
    for blk, rvars in blocks:
        written = [C.region_tensor(w) for w in blk.writes]
        reduced, bufs = [], []
        for r in blk.reads:
            buf = C.region_tensor(r)
            if any(buf.same_as(w) for w in written):
                continue
            axes = tuple(i for i, rng in enumerate(r.region) if uses(rng.min, rvars))
            if axes:
                shape = tuple(int(s) if isinstance(s, C.IntImm) else str(s) for s in C.tensor_shape(buf))
                reduced.append((shape, axes))
                if not any(b.same_as(buf) for b in bufs):
                    bufs.append(buf)
        if len(bufs) >= 2:  # two tensors indexed by the reduced axis: a matmul/conv
            contraction = True
        keys.update(reduced)
    return contraction, frozenset(keys)


def is_sum_reduction(func) -> bool:
    """Every reduction block of ``func`` sums (``acc = acc + f(...)`` from an init of 0): mean, variance,
    mean square; not a max (softmax) or a product.  False when the func cannot be analyzed."""
    blocks = reduction_blocks(func)
    if not blocks:
        return False
    for blk, _ in blocks:
        stores = [blk.body] if isinstance(blk.body, C.BufferStore) else []
        inits = [blk.init] if isinstance(blk.init, C.BufferStore) else []
        if not stores or not inits:
            return False
        store, init = stores[0], inits[0]
        if not (isinstance(init.value, C.tirx.FloatImm) and float(init.value.value) == 0.0):
            return False
        val = store.value
        if not isinstance(val, C.Add):
            return False
        own = [x for x in (val.a, val.b) if isinstance(x, C.TensorLoad) and x.source.same_as(store.buffer)]
        if len(own) != 1:
            return False
    return True


# --------------------------------------------------------------------------- epilogue blocks
def epilogue_of(sch: C.Schedule, block, buffer: str):
    """The single elementwise consumer of ``block`` that reads ``buffer`` only at its own iterators.

    Returns that block, the string "none" when ``block`` has no consumer, or None when the consumers
    are anything else (several, a reduction, a shifted or broadcast read).  Raises nothing.
    """
    consumers = list(sch.get_consumers(block))
    if not consumers:
        return "none"
    if len(consumers) != 1 or not _is_spatial(sch.get(consumers[0])):
        return None
    e = sch.get(consumers[0])
    if not isinstance(e.body, C.BufferStore):
        return None
    own = [str(iv.var.name) for iv in e.iter_vars]
    found = []

    def visit(node):
        if isinstance(node, C.TensorLoad) and str(node.source.name) == buffer:
            found.append([str(i.name) if isinstance(i, C.tirx.Var) else None for i in node.indices])

    C.post_order_visit(e.body.value, visit)
    if not found or any(idx != own for idx in found):
        return None
    return consumers[0]


def _is_spatial(block) -> bool:
    return all(int(iv.iter_type) == C.IterVar.DataPar for iv in block.iter_vars)


# --------------------------------------------------------------------------- choices
def nearest(choices, want):
    """The choice closest to ``want`` (ties: the smaller); defaults must be legal choices."""
    return min(choices, key=lambda c: (abs(c - want), c))
