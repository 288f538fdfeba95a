"""Relative-position tables computed once per diagonal (issue 13: t5_encoder over a symbolic sequence).

A T5 encoder's attention bias is a function of ``j - i`` only: ``rel = arange(s)[None, :] - arange(s)[:, None]``,
then the bucket of each ``rel`` (abs, a float log, clamps, a ``min`` written as ``stack`` + ``min``), then a
gather from the ``[buckets, heads]`` table.  A static build folds all of it to a constant; over a symbolic
``sequence`` it runs per call, a scalar ``log`` per (i, j) pair (s^2: 16384 at s=128).

``DiagonalRelativePosition`` computes that chain once per diagonal, over ``d`` of shape [2, s] (``d[0, m] = m - s``,
``d[1, m] = m``: every extent is ``s`` itself, so the kernel needs no scalar argument, which FuseTIR cannot
join; a [2s - 1] vector would), and reads the ``[s, s, *t]`` result back from that table with the trailing axes
first and the two rows flattened (``F [*t, 2 s]``, ``F[..., m]`` the value at ``j - i = m - s``) at
``F[..., j - i + s]``: an index affine in ``j``, so a row of the [*t, s, s] bias a model makes of it (T5:
heads first) is one contiguous slice of a table row.  The flattening divides by the symbolic ``s``; the
generic CPU schedule keeps ``F`` as its own block (``schedules.cpu.generic._reread``: 2 s divisions and
gathers per head, not one per bias element) and LLVM vectorizes the bias rows (t5bias11; the earlier
``where(j - i >= 0, X[1, j - i], X[0, i - j])`` read-back was two clamped gathers and a select per element,
scalar: notes/attn11.md).  t5_encoder_dyn at 1 x 128 then computes 256
logs per call, not 16384 (``cpu.generic`` keeps the log's [2, sequence] block; notes/sym9.md).  What it rewrites (the "cone" of ``rel``): every binding whose tensor operands are ``rel``,
other cone members or scalars (rank 0), of the ops in ``CONE_OPS``; ``full`` / ``broadcast_to`` of shape
``[s, s]``; ``stack`` on axis 0 and a reduction over that axis; ``take`` from a constant table on axis 0.  It
fires only when the cone holds a transcendental op (``EXPENSIVE``: the log of T5's bucket), and each cone
value read outside the cone (an "exit") is ``[s, s]`` or ``[s, s, t]``.
Tests: tests/test_passes_relpos.py.
"""
from __future__ import annotations

import numpy as np

from .. import _compat as C
from .rewrites import rewrite_functions

# elementwise ops whose result at (i, j) depends only on their operands at (i, j) (scalars broadcast)
CONE_OPS = frozenset({
    "relax.abs", "relax.astype", "relax.log", "relax.exp", "relax.sqrt", "relax.negative", "relax.sign",
    "relax.floor", "relax.ceil", "relax.round", "relax.isfinite", "relax.isnan", "relax.isinf",
    "relax.logical_not", "relax.logical_and", "relax.logical_or", "relax.add", "relax.subtract",
    "relax.multiply", "relax.divide", "relax.floor_divide", "relax.power", "relax.maximum", "relax.minimum",
    "relax.greater", "relax.greater_equal", "relax.less", "relax.less_equal", "relax.equal",
    "relax.not_equal", "relax.where", "relax.clip"})
EXPENSIVE = frozenset({"relax.log", "relax.exp", "relax.power", "relax.sqrt"})
REDUCTIONS = frozenset({"relax.min", "relax.max", "relax.sum"})


def _op(value) -> str | None:
    return value.op.name if isinstance(value, C.relax.Call) and isinstance(value.op, C.Op) else None


def _shape(expr):
    """The static or symbolic dims of a tensor-typed expression, else None."""
    try:
        ty = C.type_of(expr)
    except AttributeError:
        return None
    shape = getattr(ty, "shape", None)
    return list(shape.values) if shape is not None and hasattr(shape, "values") else None


def _same(a, b) -> bool:
    return C.Analyzer().can_prove_equal(a, b)


def _is_square(shape, s) -> bool:
    return shape is not None and len(shape) == 2 and _same(shape[0], s) and _same(shape[1], s)


def _prim(arg):
    """An integer shape expression given as an argument (itself, or a PrimValue's), else None."""
    try:
        ty = C.type_of(arg)
    except AttributeError:
        return None
    if isinstance(ty, C.PrimType) and "int" in str(ty):
        return arg
    return None


def _arange_extent(value):
    """``s`` of ``arange(0, s, 1)`` (integer dtype), else None."""
    if _op(value) != "relax.arange":
        return None
    bounds = [_prim(a) for a in value.args[:3]]
    if any(b is None for b in bounds):
        return None                     # bounds computed at run time (tensors), not shape expressions
    start, end, step = bounds
    if not (_same(start, 0) and _same(step, 1)) or "int" not in str(value.attrs.dtype):
        return None
    return end


class _Cone:
    """The analysis of one function's bindings: ``rel`` vars, the cone members and their exits."""

    def __init__(self, bindings):
        self.aranges, self.rows, self.cols = {}, {}, {}      # var -> s
        # var -> (s, plus operand var, minus operand var, sign): sign +1 for ``j - i`` (T5: memory - context
        # position), -1 for ``i - j`` (DeBERTa: query - key position)
        self.rel = {}
        self.members = {}                                   # var -> s (the rel extent of its cone)
        self.expensive = set()                              # extents whose cone holds an EXPENSIVE op
        self.stacked = set()                                # members made by ``stack`` (axis 0 not (i, j))
        for b in bindings:
            self._visit(b)

    def _visit(self, b):
        var, value = b.var, b.value
        if isinstance(value, C.relax.Var):          # an alias (``lv33 = lv30``, left by Peephole's identities)
            for table in (self.aranges, self.rows, self.cols, self.members):
                if value in table:
                    table[var] = table[value]
            if value in self.rel:
                self.rel[var] = self.rel[value]
            return
        op = _op(value)
        s = _arange_extent(value)
        if s is not None:
            self.aranges[var] = s
            return
        if op == "relax.expand_dims" and value.args[0] in self.aranges:
            axes = [int(a) for a in value.attrs.axis]
            (self.rows if axes == [0] else self.cols if axes == [1] else {})[var] = self.aranges[value.args[0]]
            return
        if op == "relax.astype" and value.args[0] in self.cols and "int" in str(value.attrs.dtype):
            self.cols[var] = self.cols[value.args[0]]
            return
        if op == "relax.subtract":
            a, b_ = value.args
            # ``rows`` vary along j (axis 1), ``cols`` along i (axis 0): a - b is j - i when a is the row,
            # i - j when a is the column (not the other way: the subtraction's own operand order)
            for plus, minus, sign in ((a, b_, 1), (b_, a, -1)):
                if not (plus in self.rows and minus in self.cols and _same(self.rows[plus], self.cols[minus])):
                    continue
                s = self.rows[plus]
                self.rel[var] = (s, a, b_, sign)
                self.members[var] = s
                return
        s = self._member_extent(value, op)
        if s is not None:
            self.members[var] = s
            if op == "relax.stack":
                self.stacked.add(var)
            if op in EXPENSIVE:
                self.expensive.add(str(s))

    def _member_extent(self, value, op):
        if op is None:
            return None
        if op == "relax.full":
            shape = list(value.args[0].values) if isinstance(value.args[0], C.relax.ShapeExpr) else None
            return shape[0] if shape is not None and _is_square(shape, shape[0]) else None
        tensors = [a for a in value.args if isinstance(a, C.relax.Var)]
        if op == "relax.stack":
            fields = value.args[0].fields if isinstance(value.args[0], C.relax.Tuple) else None
            if not fields or int(value.attrs.axis) != 0 or any(f not in self.members for f in fields):
                return None
            return self._one_extent(fields)
        if op in REDUCTIONS:
            x = value.args[0]
            axes = [int(a) for a in value.attrs.axis] if value.attrs.axis is not None else None
            shape = _shape(x)
            # over the stacked axis only (a reduction over i or j would not be a function of j - i)
            if x in self.stacked and axes == [0] and shape is not None and len(shape) == 3 \
                    and not value.attrs.keepdims:
                return self.members[x]
            return None
        if op == "relax.take":
            table, idx = value.args[:2]
            if isinstance(table, C.Constant) and idx in self.members and int(value.attrs.axis) == 0:
                return self.members[idx]
            return None
        if op == "relax.broadcast_to":
            x = value.args[0]
            shape = list(value.args[1].values) if isinstance(value.args[1], C.relax.ShapeExpr) else None
            if x in self.members and shape is not None and _is_square(shape, self.members[x]):
                return self.members[x]
            return None
        if op not in CONE_OPS:
            return None
        cone = [a for a in tensors if a in self.members]
        if not cone:
            return None
        for a in tensors:
            if a not in self.members and (_shape(a) is None or len(_shape(a)) != 0):
                return None                  # a tensor operand that varies over (i, j) but is not j - i's
        for a in value.args:
            if isinstance(a, C.Constant) and C.const_value(a).ndim != 0:
                return None
        return self._one_extent(cone)

    def _one_extent(self, vars_):
        extents = [self.members[v] for v in vars_]
        return extents[0] if all(_same(e, extents[0]) for e in extents[1:]) else None


@C.mutator
class _DiagonalMutator(C.PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.cone = None
        self.exits = set()
        self.diag = {}          # original cone var -> its per-diagonal value
        self.rel_1d = {}        # str(s) -> d, the diagonals [2, s]: d[0, j] = -j, d[1, j] = j

    def visit_function_(self, func):
        bindings = [b for block in func.body.blocks for b in block.bindings] \
            if isinstance(func.body, C.relax.SeqExpr) else []
        self.cone = _Cone(bindings)
        self.exits = set()
        for b in bindings:
            if b.var not in self.cone.members:
                self.exits.update(v for v in C.relax_free_vars(b.value) if v in self.cone.members)
        self.exits.update(v for v in C.relax_free_vars(func.body.body) if v in self.cone.members)
        ok = {}
        # an extent whose cone holds no ``j - i`` (a ``full([s, s])`` and ops on it only) has no diagonal to
        # read the result back by: left alone (test_passes_relpos::test_square_constant_without_j_minus_i_...)
        with_rel = {str(rel[0]) for rel in self.cone.rel.values()}
        for v in self.exits:
            s = self.cone.members[v]
            shape = _shape(v)
            good = str(s) in self.cone.expensive and str(s) in with_rel and v not in self.cone.rel and \
                shape is not None and len(shape) in (2, 3) and _same(shape[0], s) and _same(shape[1], s)
            ok[str(s)] = ok.get(str(s), True) and good
        self.enabled = {k for k, v in ok.items() if v}
        return super().visit_function_(func)

    def _s_enabled(self, var) -> bool:
        return var in self.cone.members and str(self.cone.members[var]) in self.enabled

    def _diag_of(self, s):
        key = str(s)
        if key not in self.rel_1d:
            # the diagonals as [2, s] (every extent ``s`` itself: a kernel over ``2 s - 1`` elements would take
            # ``s`` as a scalar argument, which FuseTIR cannot join): d[0, m] = m - s, d[1, m] = m, so the
            # diagonal j - i sits at j - i + s of d flattened (read back by an index affine in j)
            bb = self.builder_
            ahead = C.relax.op.arange(0, s, 1, dtype="int64")                                # m
            behind = C.relax.op.arange(-s, 0, 1, dtype="int64")                               # m - s
            d = bb.emit(C.relax.op.stack(C.relax.Tuple([behind, ahead]), axis=0))            # [2, s]
            self.rel_1d[key] = d
        return self.rel_1d[key]

    def visit_var_binding_(self, binding):
        var, value = binding.var, binding.value
        if not self._s_enabled(var):
            return super().visit_var_binding_(binding)
        s = self.cone.members[var]
        bb = self.builder_
        d = self._diag_of(s)
        n = s                   # the [s, s] shapes of the chain become [2, n]
        if isinstance(value, C.relax.Var):
            new_diag = self.diag[value]
            self.diag[var] = new_diag
        elif var in self.cone.rel:
            # d holds j - i per diagonal; ``i - j`` is its negative (DeBERTa: the sign picks the bucket's side;
            # test_passes_relpos::test_bias_numbers[i_minus_j])
            signed = d if self.cone.rel[var][3] > 0 else C.relax.op.negative(d)
            new_diag = bb.emit(C.relax.op.astype(signed, C.type_of(var).dtype))
            self.diag[var] = new_diag
        else:
            new_diag = bb.emit(self._rebuild(value, s, n))
            self.diag[var] = new_diag
        if var in self.exits:
            # [s, s, *t] back from the per-diagonal [2, s, *t]: (i, j) reads d flattened at j - i + s
            # (row 1 at j - i >= 0, row 0 at j - i < 0), an index affine in j: the trailing axes go first
            # ([*t, 2 s]), so a row of the [*t, s, s] bias the model makes of it (T5: heads first) is one
            # contiguous run of the table, a vector load, not a gather per element
            # s - i as -(i - s) (TVM 0.27 sizes a negative-step arange s + 2 long)
            col = bb.emit(C.relax.op.expand_dims(C.relax.op.negative(C.relax.op.arange(-s, 0, 1, dtype="int64")),
                                                 axis=[1]))
            row = bb.emit(C.relax.op.expand_dims(C.relax.op.arange(0, s, 1, dtype="int64"), axis=[0]))
            index = bb.emit(C.relax.op.add(row, col))                                     # j - i + s, [s, s]
            extra = len(_shape(var)) - 2
            trailing = list(_shape(var))[2:]
            table = new_diag
            if extra:
                table = bb.emit(C.relax.op.permute_dims(table, [*range(2, 2 + extra), 0, 1]))   # [*t, 2, s]
            flat = bb.emit(C.relax.op.reshape(table, C.relax.ShapeExpr([*trailing, 2 * s])))
            got = bb.emit(C.relax.op.take(flat, index, axis=extra, mode="fast"))           # [*t, s, s]
            picked = C.relax.op.permute_dims(got, [extra, extra + 1, *range(extra)]) if extra else got
            new = bb.emit(picked) if isinstance(var, C.relax.DataflowVar) else bb.emit_output(picked)
            self.set_var_remap(var, new)
        return None

    def _rebuild(self, value, s, n):
        """``value`` with every cone operand replaced by its per-diagonal value and [s, s] shapes by [2, s]."""
        op = _op(value)

        def arg(a):
            if isinstance(a, C.relax.Var) and a in self.diag:
                return self.diag[a]
            if isinstance(a, C.relax.ShapeExpr):
                return C.relax.ShapeExpr([2, n])
            if isinstance(a, C.relax.Tuple):
                return C.relax.Tuple([arg(f) for f in a.fields])
            return self.visit_expr(a)

        if op == "relax.full":
            return C.relax.Call(value.op, [C.relax.ShapeExpr([2, n]), *[arg(a) for a in value.args[1:]]],
                                value.attrs, value.ty_args)
        return C.relax.Call(value.op, [arg(a) for a in value.args], value.attrs, value.ty_args)


@C.module_pass(opt_level=0, name="tvmfuse.DiagonalRelativePosition")
class DiagonalRelativePosition:
    """A chain of elementwise ops on ``arange(s)[None, :] - arange(s)[:, None]`` (T5's relative-position
    bucket) computed once per diagonal ([2, s]: 2s values) and gathered back to [s, s] (see the module doc)."""

    def transform_module(self, mod, _ctx):
        return rewrite_functions(mod, _DiagonalMutator)
