"""Index arithmetic over symbolic extents: ``floormod`` / ``floordiv`` by a symbolic extent that can never
wrap, dropped from a scheduled kernel.

A reshape over symbolic dims (``[batch * sequence, 192] -> [batch, sequence, 192]``) indexes its input with
``(b * sequence + s) % (batch * sequence)``, and a fused loop over ``batch x sequence`` binds the batch
index as ``fused // sequence % batch``.  With static extents TVM's simplifier proves the ``%`` a no-op and
removes it (and then ``fused // 128 * 128 + fused % 128`` folds back to ``fused``); with symbolic ones it
cannot (the bound ``(batch - 1) * sequence + sequence - 1 < batch * sequence`` is not linear), so every
row, or every element, of the symbolic kernel pays 64-bit divisions by ``sequence`` and ``batch`` that the
static build does not (gpt2_dyn at sequence 128: its Q/K/V head split 27 us per call vs 5.6 static, its
layer norms 22.5 vs 7.3; ``benchmarks/profile_kernels.py --dims``, one thread, under load).

``drop_wrapless_modulo(func)`` proves ``0 <= a < b`` for each ``floormod(a, b)`` / ``floordiv(a, b)``
whose divisor ``b`` holds no loop or block variable: ``a`` must be a sum of products of non-negative terms
(so its largest value is where every loop / block variable takes its largest value, which is substituted),
and ``floordiv(x, c) < b`` is proved as ``x < b * c``.  A proved ``floormod(a, b)`` becomes ``a`` and a
proved ``floordiv(a, b)`` becomes 0.  An ``a = q * b + r`` with ``0 <= r < b`` proved (a reshape's flattened
index over two symbolic dims: deberta_v2_dyn's masked softmax read ``x // sequence // sequence``,
``x // sequence % sequence`` and ``x % sequence`` per element, 16x its static kernel; notes/corpus13.md)
gives ``floordiv(a, b) = q`` and ``floormod(a, b) = r``.  Anything it cannot prove stays as it is.

A gather's negative-index wrap (ONNX Gather / take: ``where(i < 0, i + n, i)``) folds into its index as
``Select(0 < int64(a < 0), a + n, a)``; with static extents TVM proves ``a >= 0`` and keeps ``a``, with
symbolic ones it cannot, and the select then hides the flat index from the split above.  A select whose
test is ``a < 0`` (or ``0 <= a``) of such a non-negative ``a`` becomes its taken branch (albert_dyn's padding
mask, ``mask[b * sequence + kv]`` gathered from the flattened mask: three 64-bit divisions per element and no
vector loop, 92 us per call at sequence 128 vs 9.4 static; notes/albert14.md).  ``x + 0`` terms (TVM's
inlining leaves them) are dropped first, so the divisor and the flat index compare structurally.
"""
from __future__ import annotations

from .. import _compat as C

T = C.tirx


def _ranges(func: C.PrimFunc) -> dict:
    """Loop and block variables -> (min, extent); a variable bound twice with different ranges (the nests
    of size buckets may share one) is left out."""
    found, clash = {}, set()

    def add(var, lo, ext):
        old = found.get(var)
        if old is not None and not (C.structural_equal(old[0], lo) and C.structural_equal(old[1], ext)):
            clash.add(var)
        found[var] = (lo, ext)

    def visit(n):
        if isinstance(n, T.For):
            add(n.loop_var, n.min, n.extent)
        elif isinstance(n, C.SBlock):
            for iv in n.iter_vars:
                add(iv.var, iv.dom.min, iv.dom.extent)

    C.post_order_visit(func.body, visit)
    return {v: r for v, r in found.items() if v not in clash}


def _shape_vars(func: C.PrimFunc) -> set:
    """The kernel's symbolic extents (integer scalar parameters and variables in parameter shapes): >= 0."""
    out = set()
    for p in func.params:
        if not C.is_buffer_var(p):
            out.add(p)
            continue
        for d in p.ty.shape:
            C.post_order_visit(d, lambda n: out.add(n) if isinstance(n, T.Var) else None)
    return out


class _Bounds:
    def __init__(self, func: C.PrimFunc, shapes: set):
        self.shapes = shapes
        self.ranges = _ranges(func)
        self.analyzer = C.Analyzer()

    def invariant(self, e) -> bool:
        """``e`` is a non-negative expression of the symbolic extents and constants (no loop variable)."""
        if isinstance(e, T.IntImm):
            return e.value >= 0
        if isinstance(e, T.Var):
            return e in self.shapes
        if isinstance(e, (T.Add, T.Mul, T.FloorDiv)):
            return self.invariant(e.a) and self.invariant(e.b)
        return False

    def upper(self, e):
        """The largest value of ``e`` (an expression), or None where ``e`` is not a non-negative
        monotone expression of bounded variables."""
        if self.invariant(e):
            return e
        if isinstance(e, T.Var):
            r = self.ranges.get(e)
            if r is None or not self.invariant(r[0]) or not self.invariant(r[1]):
                return None
            return r[0] + r[1] - 1
        if isinstance(e, (T.Add, T.Mul)):
            a, b = self.upper(e.a), self.upper(e.b)
            if a is None or b is None:
                return None
            return a + b if isinstance(e, T.Add) else a * b
        if isinstance(e, T.FloorDiv) and self.invariant(e.b):
            a = self.upper(e.a)
            return None if a is None else T.floordiv(a, e.b)
        if isinstance(e, T.FloorMod) and self.invariant(e.b):
            return None if self.upper(e.a) is None else e.b - 1
        return None

    def below(self, a, b) -> bool:
        """Proves ``0 <= a < b``."""
        if isinstance(a, T.FloorDiv) and self.invariant(a.b):
            return self.below(a.a, b * a.b)          # x < b * c  =>  x // c < b  (c > 0)
        up = self.upper(a)
        return up is not None and bool(self.analyzer.can_prove(up < b))


    def non_negative(self, a) -> bool:
        """``a >= 0`` proved: a sum of products of non-negative terms (what ``upper`` bounds)."""
        return self.upper(a) is not None

    def truth(self, cond):
        """True / False where ``cond`` is a sign test of a non-negative index (``a < 0``: False, ``0 <= a``
        or ``a >= 0``: True), or such a test seen through ``0 < int(test)`` (a where over a bool tensor);
        None otherwise."""
        zero = lambda e: isinstance(e, T.IntImm) and e.value == 0      # noqa: E731
        if isinstance(cond, T.LT) and zero(cond.b) and self.non_negative(cond.a):
            return False
        if isinstance(cond, T.LE) and zero(cond.a) and self.non_negative(cond.b):
            return True
        if isinstance(cond, T.GE) and zero(cond.b) and self.non_negative(cond.a):
            return True
        if isinstance(cond, T.LT) and zero(cond.a) and isinstance(cond.b, T.Cast) \
                and str(cond.b.value.ty) == "bool":
            return self.truth(cond.b.value)
        return None

    def quotient_remainder(self, a, b):
        """``(q, r)`` with ``a == q * b + r``, ``q >= 0`` and ``0 <= r < b`` proved (a reshape's flat index
        ``(x * sequence + k) // sequence`` is ``x``, its ``% sequence`` is ``k``, when ``k < sequence``), else
        None."""
        if not isinstance(a, T.Add):
            return None
        for prod, rest in ((a.a, a.b), (a.b, a.a)):
            if not isinstance(prod, T.Mul):
                continue
            for q, d in ((prod.a, prod.b), (prod.b, prod.a)):
                if C.structural_equal(d, b) and self.upper(q) is not None and self.below(rest, b):
                    return q, rest
        return None


def drop_wrapless_modulo(func: C.PrimFunc) -> C.PrimFunc:
    """``func`` with every ``floormod(a, b)`` proved a no-op replaced by ``a`` and every ``floordiv(a, b)``
    proved 0 replaced by 0, where ``b`` is a symbolic extent (see the module docstring); ``func`` itself when
    it has no symbolic extent or nothing is proved."""
    shapes = _shape_vars(func)
    if not shapes:
        return func
    bounds = _Bounds(func, shapes)
    changed = []

    def rewrite(e):
        if not bounds.invariant(e.b) or isinstance(e.b, T.IntImm) and e.b.value <= 0:
            return e
        if bounds.below(e.a, e.b):
            changed.append(e)
            return e.a if isinstance(e, T.FloorMod) else T.IntImm(str(e.ty), 0)
        if isinstance(e.b, T.IntImm):
            # a static divisor: only the proved no-op above (TVM's simplifier folds the rest); a reshape's
            # ``(k // 32 + x) // sequence`` over k < 32, before inlining (``schedule_with``) puts a gathered
            # index in place of k, where nothing bounds it any more
            return e
        split = bounds.quotient_remainder(e.a, e.b)
        if split is None:
            return e
        changed.append(e)
        return split[1] if isinstance(e, T.FloorMod) else split[0]

    def plus_zero(e):
        # ``x + 0`` -> ``x`` (not a change by itself: only a proof below makes the rewritten function)
        for keep, other in ((e.a, e.b), (e.b, e.a)):
            if isinstance(other, T.IntImm) and other.value == 0 and str(keep.ty) == str(e.ty):
                return keep
        return e

    def select(e):
        taken = bounds.truth(e.condition)
        if taken is None:
            return e
        changed.append(e)
        return e.true_value if taken else e.false_value

    # post-order: an index's ``+ 0`` terms and wrap selects are gone before its divisions are looked at
    out = C.structural_map(func, [(T.Add, plus_zero), (T.Select, select), ((T.FloorMod, T.FloorDiv), rewrite)])
    return out if changed else func
