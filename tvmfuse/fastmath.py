"""Vectorizable float32 ``exp``, ``erf``, ``tanh`` and ``sigmoid`` for CPU kernels.

TVM lowers these intrinsics to scalar libm calls (``expf``, ``erff``, ``tanhf``): an epilogue that uses
them does not vectorize and its speed depends on the data.  This module rewrites every float32 call in
a PrimFunc into polynomial/rational arithmetic (plus integer exponent tricks) that LLVM vectorizes.

Accuracy over the whole float32 range, against numpy/scipy in float64 (tests/test_fastmath.py checks
these bounds on about 4 million inputs spread over every exponent, plus 0, +-inf, NaN, the largest and
the smallest finite values):

====== ===================================================== ==========================================
func   method                                                maximum error (measured, float32 inputs)
====== ===================================================== ==========================================
exp    Cody-Waite reduction x = n ln2 + r (n rounded by the   relative 2.0e-7 where the result is a normal
       1.5*2^23 magic number), degree-6 minimax polynomial   float (7.4e-8 measured); absolute 1.5e-45
       for e^r (Horner, 6 FMAs), 2^n applied as two exact    where it is subnormal (1.1e-45 measured);
       powers of two (gradual underflow, overflow to inf)    inf above 88.72, 0 below -103.97
erf    x * P(x^2) / Q(x^2), P degree 13 (odd), Q degree 8,   absolute 3.5e-7 (3.3e-7 measured)
       x clamped to [-4, 4] (|erf| rounds to 1 beyond)
tanh   x * P(x^2) / Q(x^2), P degree 13 (odd), Q degree 6,   absolute 3e-7 (2.4e-7 measured)
       x clamped to [-9, 9]; x itself for |x| < 4e-4
sigmoid 1 / (1 + exp(-x)) with the exp above                 relative 4e-7 where the result is normal (1.3e-7 measured)
====== ===================================================== ==========================================

All four return NaN for NaN and the right limits for +-inf, with no NaN test: the clamps are selects
that keep a NaN (see ``_clamp``) and every later step propagates it.  Everything is plain vector
arithmetic for TVM's VectorizeLoop: the ``isnan`` intrinsic (no vector rule: TVM scalarizes the whole
loop around it) and float->int conversions (poison on NaN) are avoided.  These bounds are inside the tolerances the
tests use for whole models (rtol 1e-5, atol 1e-5), so ``PipelineOptions.fast_math`` is on by default;
``fast_math=False`` keeps TVM's libm calls.
"""
from __future__ import annotations

import logging

from . import _compat as C

log = logging.getLogger("tvmfuse.schedule")

F32 = "float32"
LOG2E = 1.44269504088896341
LN2_HI = 0.693359375          # Cody-Waite split of ln 2: hi has few mantissa bits, so n * hi is exact
LN2_LO = -2.12194440e-4
EXP_LO = -104.0               # below: the result underflows to 0 (e^-103.97 is half the smallest subnormal)
EXP_HI = 89.0                 # above: the result overflows to inf (e^88.73 > FLT_MAX)
# e^r ~= 1 + r + r^2 (c2 + c3 r + ... + c6 r^4) on |r| <= ln2 / 2: a degree-6 minimax fit of the relative
# error (3.1e-9 in exact arithmetic, 6.2e-8 with float32 Horner FMAs), highest degree first
EXP_POLY = (1.3814539416e-3, 8.3687454462e-3, 4.1668388993e-2, 1.6666521132e-1, 4.9999994040e-1)
# 1.5 * 2^23: x + ROUND_MAGIC rounds x to an integer (|x| < 2^22) held in the low mantissa bits
ROUND_MAGIC = 12582912.0
# erf(x) ~= x * P(x^2) / Q(x^2) on [-4, 4] (the coefficients of Eigen's / TVM's fast_erf)
ERF_CLAMP = 4.0
ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
         -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
         -1.42647390514189e-02)
# tanh(x) ~= x * P(x^2) / Q(x^2) on [-9, 9] (Eigen's / TVM's fast_tanh)
TANH_CLAMP = 9.0
TANH_TINY = 0.0004
TANH_P = (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11, 5.12229709037114e-08,
          1.48572235717979e-05, 6.37261928875436e-04, 4.89352455891786e-03)
TANH_Q = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03)

# Maximum errors the tests hold the approximations to (see the table above).
MAX_ERROR = {
    "exp": {"rel": 2.0e-7, "abs_subnormal": 1.5e-45},
    "erf": {"abs": 3.5e-7},
    "tanh": {"abs": 3.0e-7},
    "sigmoid": {"rel": 4.0e-7},
}


def _f(v: float):
    return C.tirx.const(v, F32)


class _Lets:
    """Binds sub-expressions to variables (``Let``) so an argument used several times is computed once."""

    def __init__(self):
        self.binds: list = []
        self._n = 0

    def bind(self, expr, dtype=F32):
        if isinstance(expr, (C.tirx.Var, C.tirx.FloatImm, C.tirx.IntImm)):
            return expr
        self._n += 1
        v = C.tirx.Var(f"fm{self._n}", dtype)
        self.binds.append((v, expr))
        return v

    def wrap(self, body):
        for v, e in reversed(self.binds):
            body = C.tirx.Let(v, e, body)
        return body


def _horner(x, coeffs):
    acc = _f(coeffs[0])
    for c in coeffs[1:]:
        acc = acc * x + _f(c)
    return acc


def _clamp(x, lo, hi):
    """``x`` limited to [lo, hi], NaN kept: ``select(x < lo, lo, x)`` is false for a NaN (x86 maxps with
    ``x`` as its second operand), where ``max(x, lo)`` would turn a NaN into ``lo``.  No NaN test needed."""
    lo, hi = _f(lo), _f(hi)
    y = C.tirx.Select(hi < x, hi, x)
    return C.tirx.Select(y < lo, lo, y)


def _pow2(n_int):
    """2^n as float32 for an int32 n in [-126, 127], from its exponent bits."""
    return C.tirx.reinterpret(F32, C.tirx.shift_left(n_int + C.tirx.const(127, "int32"),
                                                      C.tirx.const(23, "int32")))


def _exp(lets: _Lets, x):
    """e^x on float32, about 21 vector instructions; a NaN goes through (every step keeps it)."""
    t = C.tirx
    xc = lets.bind(_clamp(x, EXP_LO, EXP_HI))
    # n = round(x / ln2) by the magic-number trick: no float->int conversion (a NaN converted is poison)
    tn = lets.bind(xc * _f(LOG2E) + _f(ROUND_MAGIC))
    nf = lets.bind(tn - _f(ROUND_MAGIC))
    r = lets.bind(xc - nf * _f(LN2_HI) - nf * _f(LN2_LO))
    p = _horner(r, EXP_POLY) * r + _f(1.0)
    p = p * r + _f(1.0)
    magic_bits = t.reinterpret("int32", _f(ROUND_MAGIC))
    n = lets.bind(t.reinterpret("int32", tn) - magic_bits, "int32")
    # 2^n as two exact powers of two: n in [-150, 128] spans more than the normal exponents
    n1 = lets.bind(t.shift_right(n, t.const(1, "int32")), "int32")
    return p * _pow2(n1) * _pow2(n - n1)


def fast_exp(x):
    lets = _Lets()
    xv = lets.bind(x)
    return lets.wrap(_exp(lets, xv))


def fast_erf(x):
    lets = _Lets()
    xv = lets.bind(x)
    xc = lets.bind(_clamp(xv, -ERF_CLAMP, ERF_CLAMP))
    x2 = lets.bind(xc * xc)
    return lets.wrap(xc * _horner(x2, ERF_P) / _horner(x2, ERF_Q))


def fast_tanh(x):
    lets = _Lets()
    xv = lets.bind(x)
    xc = lets.bind(_clamp(xv, -TANH_CLAMP, TANH_CLAMP))
    x2 = lets.bind(xc * xc)
    approx = xc * _horner(x2, TANH_P) / _horner(x2, TANH_Q)
    small = C.tirx.abs(xv) < _f(TANH_TINY)
    return lets.wrap(C.tirx.Select(small, xv, approx))


def fast_sigmoid(x):
    lets = _Lets()
    xv = lets.bind(x)
    e = _exp(lets, C.tirx.const(0.0, F32) - xv)
    return lets.wrap(_f(1.0) / (_f(1.0) + e))


# One row per rewritten intrinsic: op name -> builder (float32 calls only).
REWRITES = {
    "tirx.exp": fast_exp,
    "tirx.erf": fast_erf,
    "tirx.tanh": fast_tanh,
    "tirx.sigmoid": fast_sigmoid,
}


# ----------------------------------------------------------------------------- the rewriter
_BINARY = ("Add", "Sub", "Mul", "Div", "Mod", "FloorDiv", "FloorMod", "Min", "Max", "EQ", "NE", "LT",
           "LE", "GT", "GE", "And", "Or")


class _Rewriter:
    """Rebuilds a PrimFunc body with the calls of ``REWRITES`` replaced (TIR has no Python mutator in 0.27)."""

    def __init__(self):
        self.count = 0
        self._binary = tuple(getattr(C.tirx, n) for n in _BINARY)

    # -- expressions
    def expr(self, e):
        t = C.tirx
        if isinstance(e, C.Call):
            args = [self.expr(a) for a in e.args]
            name = str(e.op.name) if hasattr(e.op, "name") else ""
            if name in REWRITES and len(args) == 1 and str(args[0].ty.dtype) == F32:
                self.count += 1
                return REWRITES[name](args[0])
            if all(a.same_as(b) for a, b in zip(args, e.args)):
                return e
            return C.Call(e.op, args, ret_ty=e.ty) if name else e
        if isinstance(e, self._binary):
            a, b = self.expr(e.a), self.expr(e.b)
            return e if (a.same_as(e.a) and b.same_as(e.b)) else type(e)(a, b)
        if isinstance(e, t.Cast):
            v = self.expr(e.value)
            return e if v.same_as(e.value) else t.Cast(e.ty.dtype, v)
        if isinstance(e, t.Not):
            v = self.expr(e.a)
            return e if v.same_as(e.a) else t.Not(v)
        if isinstance(e, t.Select):
            c, a, b = self.expr(e.condition), self.expr(e.true_value), self.expr(e.false_value)
            return t.Select(c, a, b)
        if isinstance(e, t.Let):
            return t.Let(e.var, self.expr(e.value), self.expr(e.body))
        return e       # loads, constants, vars, ramps, broadcasts: no calls to rewrite inside indices

    # -- statements
    def stmt(self, s):
        t = C.tirx
        if s is None:
            return None
        if isinstance(s, C.BufferStore):
            v = self.expr(s.value)
            return s if v.same_as(s.value) else C.BufferStore(s.buffer, v, s.indices)
        if isinstance(s, t.SeqStmt):
            return t.SeqStmt([self.stmt(x) for x in s.seq])
        if isinstance(s, t.For):
            return t.For(s.loop_var, s.min, s.extent, s.kind, self.stmt(s.body), s.thread_binding,
                         s.annotations, s.step)
        if isinstance(s, C.SBlockRealize):
            return C.SBlockRealize(s.iter_values, s.predicate, self.stmt(s.block))
        if isinstance(s, C.SBlock):
            return C.SBlock(s.iter_vars, s.reads, s.writes, s.name_hint, self.stmt(s.body),
                            self.stmt(s.init), s.alloc_buffers, s.match_buffers, s.annotations)
        if isinstance(s, t.IfThenElse):
            return t.IfThenElse(self.expr(s.condition), self.stmt(s.then_case), self.stmt(s.else_case))
        if isinstance(s, t.Evaluate):
            return t.Evaluate(self.expr(s.value))
        if isinstance(s, t.AttrStmt):
            return t.AttrStmt(s.node, s.attr_key, s.value, self.stmt(s.body))
        if isinstance(s, t.Bind):
            return t.Bind(s.var, self.expr(s.value))
        if isinstance(s, (t.AllocBuffer, t.DeclBuffer)):
            return s
        raise TypeError(f"fast math: unhandled TIR statement {type(s).__name__}")


def rewrite(func: C.PrimFunc) -> tuple[C.PrimFunc, int]:
    """``func`` with float32 exp/erf/tanh/sigmoid replaced; returns (new func, number of calls replaced)."""
    rw = _Rewriter()
    body = rw.stmt(func.body)
    if rw.count == 0:
        return func, 0
    return func.with_body(body), rw.count


def fast_math_pass(target: C.Target) -> C.ir_transform.Pass:
    """The named pass: every PrimFunc of the module rewritten (CPU targets; GPUs have fast intrinsics)."""

    @C.module_pass(opt_level=0, name="tvmfuse.fast_math")
    def _fast_math(mod, _ctx):
        updates = {}
        for gv, func in mod.functions.items():
            if isinstance(func, C.PrimFunc):
                new, n = rewrite(func)
                if n:
                    log.debug("%s: fast math rewrote %d calls", gv.name_hint, n)
                    updates[gv] = new
        for gv, func in updates.items():
            mod[gv] = func
        return mod

    return _fast_math
