"""Vectorizable float32 ``exp``, ``erf``, ``tanh``, ``sigmoid`` and small integer powers for CPU kernels.

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
exp    the same reduction and polynomial, for an argument     relative 2.0e-7 where the result is normal
(x<=0) proved <= 0 (softmax's x - rowmax, see below): n in    (6.9e-8 measured); absolute 1.1755e-38
       [-126, 0] from the magic number's low bits in one      (FLT_MIN) below it: 0 for x < -87.33655
       shift, no clamp, no overflow, flush below FLT_MIN      (e^x < FLT_MIN); 1 at 0, 0 at -inf, NaN kept
exp2   2^x = 2^n 2^f, n = round(x) by the magic number       relative 2.0e-7 where the result is normal
(x<=0) (f = x - n exact, no ln 2 reduction), degree-5 fit    (1.6e-7 measured); absolute 1.1755e-38
       for 2^f on |f| <= 1/2 (5 FMAs), 2^n one shift; only   (FLT_MIN) below it: 0 for x < -126; 2^n
       where x is proved <= 0 (cpu.attention's exp2 knob:    exact for integers, 1 at 0, 0 at -inf,
       a base-2 softmax); any other exp2 keeps libm's        NaN kept
pow    pow(x, n) for a constant integer n in [1,             relative (n - 1) 2^-24 where the result is
(x, n) MAX_INTEGER_POWER] (GPT-2's GELU: x^3): n - 1          normal (x^3: 1.2e-7, x^4: 1.8e-7); absolute
       multiplies, x^4 as (x x)(x x); pow(x, 0) is 1        FLT_MIN below it; +-0, +-inf, NaN as powf
a / b  in a vectorized block, b the same in every lane (a     relative 2^-23 (1.2e-7) against the exact
       row sum, a row scale): a * (1/b), 1/b once per row     quotient (the division: 2^-24) where the
       (LLVM hoists it), guarded by 2^-126 <= |b| <= 2^126    result is normal; outside the guard (0, inf,
       (1/b normal); else the division itself                 NaN, subnormal or huge b) bit-exact division
====== ===================================================== ==========================================

All four return NaN for NaN and the right limits for +-inf, with no NaN test: the clamps are selects
that keep a NaN (see ``_clamp``) and every later step propagates it.  Everything is plain vector
arithmetic for TVM's VectorizeLoop: the ``isnan`` intrinsic (no vector rule: TVM scalarizes the whole
loop around it) and float->int conversions (poison on NaN) are avoided.  These bounds are inside the tolerances the
tests use for whole models (rtol 1e-5, atol 1e-5), so ``PipelineOptions.fast_math`` is on by default;
``fast_math=False`` keeps TVM's libm calls.

The cheaper exp (15 vector instructions per 8 values instead of 24) is used only where the rewriter can
prove the argument <= 0 (or NaN) from the TIR itself (``_NonPositive``): ``min(x, c)`` with a constant
c <= 0 (a kernel that knows the sign writes it so), or ``X[e] - M[g]`` where M is
written by exactly one max-reduction (plus constant initial values), possibly through rfactor's partial
buffers, whose reduced elements of X, by the blocks' iteration domains, cover the whole of X's reduced
axes for the row ``g`` that equals X's other indices ``e``: then ``M[g] >= X[e]`` and ``X[e] - M[g]`` rounds
to <= 0.  Any other exp keeps the full variant.

The reciprocal multiply may turn a quotient within 2 ulp of FLT_MAX into inf; NaN/inf results are those
of the division.  On the 1-thread Softmax [512, 3072] the normalize pass was measured memory-bound either
way (the same share of the profile with vdivps and with vmulps): the rewrite removes the divider as a
ceiling (3.5 cycles per 8 lanes on Zen 3) rather than speeding up that run.
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

# exp of an argument proved <= 0: below this the result is flushed to 0 (float32 nearest ln(FLT_MIN) =
# -87.3365447..., just below it: e^EXP_FLUSH < FLT_MIN); from it up to 0, n = round(x / ln2) is in [-126, 0]
EXP_FLUSH = -87.3365478515625
# 1.5 * 2^23 + 127: x / ln2 + this holds n + 127 in [1, 127] in its low mantissa bits, so its bits shifted
# left by 23 are the float 2^n (the high bits of 1.5 * 2^23 shift out)
ROUND_MAGIC_POW2 = ROUND_MAGIC + 127.0
# 2^x for x proved <= 0 (a base-2 softmax: cpu.attention's exp2 knob): x = n + f with n = round(x) (the magic
# number above, no ln 2 reduction: f = x - n is exact), 2^f ~= 1 + f (c1 + c2 f + ... + c5 f^4) on |f| <= 1/2:
# a degree-5 fit of the relative error (9.1e-8 in exact arithmetic), highest degree first; below EXP2_FLUSH
# (2^x < FLT_MIN) the result is 0
EXP2_POLY = (1.3264726899e-3, 9.6715126606e-3, 5.5507337442e-2, 2.4022242085e-1, 6.9314697760e-1)
EXP2_FLUSH = -126.0

# a / b -> a * (1/b) where 1/b is a normal float: 2^-126 <= |b| <= 2^126 (outside: the division is kept)
RECIP_MIN = 2.0 ** -126
RECIP_MAX = 2.0 ** 126
# Fast-math expansions nested deeper than this in one expression keep TVM's libm call for the outer ones.
# TVM's simplifier (Analyzer::Bind, which the LLVM code generator calls on every Let) substitutes each bound
# value into the next, so building a kernel costs about the product of the nested expansions' sizes:
# tanh(tanh(x)) on [3, 8] builds in 2-3 s, tanh(tanh(tanh(x))) did not finish in 15 min (the stall of
# tests/test_fusion_property.py: Erf(Exp(Tanh(y))) in one fused kernel).
MAX_NESTED_EXPANSIONS = 2
# pow(x, n) with a constant integer exponent up to this is rewritten into multiplies (libm's powf does
# not vectorize; each further multiply adds 2^-24 of relative error: 4 keeps it within 1.8e-7)
MAX_INTEGER_POWER = 4
# calls a lane-invariant divisor may contain (pure, no lane-dependent state)
_PURE = ("tirx.sqrt", "tirx.rsqrt", "tirx.fabs")

# Maximum errors the tests hold the approximations to (see the table above).
MAX_ERROR = {
    "exp": {"rel": 2.0e-7, "abs_subnormal": 1.5e-45},
    "exp_nonpositive": {"rel": 2.0e-7, "abs_subnormal": 1.1755e-38},
    "exp2_nonpositive": {"rel": 2.0e-7, "abs_subnormal": 1.1755e-38},
    "erf": {"abs": 3.5e-7},
    "tanh": {"abs": 3.0e-7},
    "sigmoid": {"rel": 4.0e-7},
    "pow": {"rel_per_multiply": 2.0 ** -24, "abs_subnormal": 1.1755e-38},
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


def _expansion_depth(e) -> int:
    """How many fast-math expansions are nested in ``e`` (the outermost Let of each one binds ``fm1``)."""
    t = C.tirx
    if isinstance(e, t.Let):
        own = 1 if str(e.var.name) == "fm1" else 0
        return max(own + _expansion_depth(e.value), _expansion_depth(e.body))
    if isinstance(e, t.Select):
        return max(_expansion_depth(e.condition), _expansion_depth(e.true_value), _expansion_depth(e.false_value))
    if isinstance(e, C.Call):
        return max((_expansion_depth(a) for a in e.args), default=0)
    if isinstance(e, (t.Cast,)):
        return _expansion_depth(e.value)
    if isinstance(e, t.Not):
        return _expansion_depth(e.a)
    if hasattr(e, "a") and hasattr(e, "b"):
        return max(_expansion_depth(e.a), _expansion_depth(e.b))
    return 0


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


def _exp_nonpositive(lets: _Lets, x):
    """e^x for x <= 0, -inf or NaN only (a positive x gives garbage): 15 vector instructions.

    No clamp: from EXP_FLUSH up to 0, n is in [-126, 0] and 2^n is one shift of the rounded value's bits;
    below EXP_FLUSH (where -inf's NaN reduction and a huge n's garbage land) the final select gives 0.  A
    NaN compares false and goes through every step.  Integer steps are a reinterpret and a shift only (no
    signed add that could overflow into poison)."""
    t = C.tirx
    tn = lets.bind(x * _f(LOG2E) + _f(ROUND_MAGIC_POW2))
    nf = lets.bind(tn - _f(ROUND_MAGIC_POW2))
    # r = x - n ln2 as two FMAs (Add of a Mul: TVM emits fmuladd); n * LN2_HI is exact
    r = lets.bind(nf * _f(-LN2_HI) + x)
    r = lets.bind(nf * _f(-LN2_LO) + r)
    p = _horner(r, EXP_POLY) * r + _f(1.0)
    p = p * r + _f(1.0)
    pow2 = t.reinterpret(F32, t.shift_left(t.reinterpret("int32", tn), t.const(23, "int32")))
    return t.Select(x < _f(EXP_FLUSH), _f(0.0), p * pow2)


def _exp2_nonpositive(lets: _Lets, x):
    """2^x for x <= 0, -inf or NaN only: 12 vector instructions (``_exp_nonpositive``'s rounding and shift,
    without the ln 2 reduction: x is already in base 2).  From EXP2_FLUSH up to 0, n = round(x) is in
    [-126, 0] and 2^n is one shift of the rounded value's bits; below it the final select gives 0 (-inf's
    NaN reduction included).  A NaN compares false and goes through every step."""
    t = C.tirx
    tn = lets.bind(x + _f(ROUND_MAGIC_POW2))
    nf = lets.bind(tn - _f(ROUND_MAGIC_POW2))
    f = lets.bind(x - nf)           # exact: |x - n| <= 1/2 and n an integer near x
    p = _horner(f, EXP2_POLY) * f + _f(1.0)
    pow2 = t.reinterpret(F32, t.shift_left(t.reinterpret("int32", tn), t.const(23, "int32")))
    return t.Select(x < _f(EXP2_FLUSH), _f(0.0), p * pow2)


def _expanded(expansion, x):
    """``expansion(lets, x)`` (one of the exp expansions above) with ``x`` bound once and the expansion's
    intermediates let-bound around the result."""
    lets = _Lets()
    return lets.wrap(expansion(lets, lets.bind(x)))


def fast_exp2_nonpositive(x):
    """2^x where x is known to be <= 0 or NaN (see ``_NonPositive``); other exp2 calls keep libm's."""
    return _expanded(_exp2_nonpositive, x)


def fast_exp(x):
    return _expanded(_exp, x)


def fast_exp_nonpositive(x):
    """e^x where x is known to be <= 0 or NaN (see ``_NonPositive``)."""
    return _expanded(_exp_nonpositive, x)


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


def integer_power(x, n: int):
    """``x ** n`` for a constant integer ``0 <= n <= MAX_INTEGER_POWER`` as multiplies (``x`` bound once
    when it is not a plain load or variable); ``pow(x, 0)`` is 1 for every x, NaN included, as powf."""
    if not 0 <= n <= MAX_INTEGER_POWER:
        raise ValueError(f"integer_power: exponent {n} outside [0, {MAX_INTEGER_POWER}]")
    if n == 0:
        return _f(1.0)
    lets = _Lets()
    xv = x if isinstance(x, C.TensorLoad) else lets.bind(x)
    if n == 4:
        sq = lets.bind(xv * xv)
        return lets.wrap(sq * sq)
    out = xv
    for _ in range(n - 1):
        out = out * xv
    return lets.wrap(out)


def _integer_exponent(e) -> int | None:
    """The exponent of a float32 ``pow(x, c)`` whose ``c`` is a constant integer in [0, MAX_INTEGER_POWER];
    None for any other call."""
    if len(e.args) != 2 or str(e.args[0].ty.dtype) != F32:
        return None
    c = e.args[1]
    if not isinstance(c, (C.tirx.FloatImm, C.tirx.IntImm)):
        return None
    v = float(c.value)
    return int(v) if v.is_integer() and 0 <= v <= MAX_INTEGER_POWER else None


# One row per rewritten intrinsic: op name -> builder (float32 calls only).
REWRITES = {
    "tirx.exp": fast_exp,
    "tirx.erf": fast_erf,
    "tirx.tanh": fast_tanh,
    "tirx.sigmoid": fast_sigmoid,
}


# ----------------------------------------------------------------------------- argument <= 0
def _const_extent(dom):
    return int(dom.extent) if isinstance(dom.extent, C.tirx.IntImm) and isinstance(dom.min, C.tirx.IntImm) \
        and int(dom.min) == 0 else None


class _NonPositive:
    """Proves an exp argument ``X[e] - M[g]`` <= 0 (or NaN) from the PrimFunc's blocks.

    M must be written by one block whose store is ``M[s] = max(M[s], V)`` (a max reduction; V a load of X or
    of another buffer with the same kind of writer: rfactor's partial maxima, one of whose writers may
    store to lanes ``k - c`` of them only: a row's tail folded into the partial maxima, issue 11, its
    lanes narrowing the reading reduction's range on that path), or by several such blocks
    over disjoint intervals of one reduced axis that add up to it (a row cut into a vector main part and a
    scalar tail: cpu.row_reduction over 3071 floats), plus constant stores (its initial value) that come
    before them; its store indices are distinct spatial iterators over the whole of
    M's axes (or constants).  Substituting the read indices ``g`` for them through the chain leaves X's
    indices as functions of the chain's reduction iterators; the axes that do not depend on them must equal
    ``e``, the axes that do must depend on nothing else and be covered whole: a bijective iterator map of
    as many points as those axes hold, inside their bounds.  Then M[g] is the max over a set containing
    X[e] and the difference rounds to <= 0 (NaN if either is NaN; -inf - -inf is NaN too).  The values read
    are the final ones because schedule primitives keep TensorIR's dataflow (a reduction block reduces its
    whole iteration domain before a consumer reads it); X must not be written after the reductions.
    Anything else (a store of another form, M a parameter, a partial domain, a row-dependent reduced
    index): not proved, the full exp is kept.
    """

    MAX_CHAIN = 8          # max reductions followed from M back to X (rfactor adds one per level)

    def __init__(self, func: C.PrimFunc):
        self._func = func
        self._stores = None      # [(buffer var, textual order, store, its block or None)]

    def _index(self):
        if self._stores is None:
            owners = []

            def visit_block(node):
                if isinstance(node, C.SBlock) and isinstance(node.body, C.BufferStore):
                    owners.append((node.body, node))

            C.post_order_visit(self._func.body, visit_block)
            stores = []

            def visit_store(node):
                if isinstance(node, C.BufferStore):
                    blk = next((b for st, b in owners if st.same_as(node)), None)
                    stores.append((node.buffer, len(stores), node, blk))

            C.post_order_visit(self._func.body, visit_store)
            self._stores = stores
        return self._stores

    def _writes(self, buf):
        return [(o, st, blk) for b, o, st, blk in self._index() if b.same_as(buf)]

    def _max_writers(self, buf):
        """[(textual order, block, V)] of the max reductions writing ``buf`` (one, or several covering parts
        of the reduced axes: a row cut into a vector main part and a scalar tail), every other store a
        constant before all of them; None otherwise."""
        updates = []
        for order, st, blk in self._writes(buf):
            v = st.value
            if isinstance(v, (C.tirx.FloatImm, C.tirx.IntImm)):
                if updates:
                    return None                  # a constant stored after a reduction (a reset)
                continue
            if blk is None or not isinstance(v, C.tirx.Max):
                return None
            own = [o for o in (v.a, v.b) if isinstance(o, C.TensorLoad) and o.source.same_as(buf)
                   and len(o.indices) == len(st.indices)
                   and all(i.same_as(j) or C.structural_equal(i, j) for i, j in zip(o.indices, st.indices))]
            if len(own) != 1:
                return None
            updates.append((order, blk, v.b if own[0].same_as(v.a) else v.a))
        return updates or None

    def proves(self, arg) -> bool:
        # min(x, c) with a constant c <= 0 is <= 0 (or NaN) whatever x is: the form a kernel writes where it
        # knows the sign of x by construction (cpu.attention's score minus its running max)
        if isinstance(arg, C.tirx.Min) and any(isinstance(o, C.tirx.FloatImm) and o.value <= 0
                                               for o in (arg.a, arg.b)):
            return True
        if not (isinstance(arg, C.tirx.Sub) and isinstance(arg.a, C.TensorLoad)
                and isinstance(arg.b, C.TensorLoad)):
            return False
        return self._covered(arg.a, arg.b)

    def _chains(self, x, buf, idx: list, red: list, updates: list):
        """The max-reduction chains from ``buf`` read at ``idx`` back to X (``x.source``): [(reduction
        iterators [(var, Range)], X's indices in them, the updates' textual orders)], one per path through
        the writers (several where a buffer has several, see _max_writers); None when one is not of the
        form the class docstring asks for."""
        if len(updates) >= self.MAX_CHAIN:
            return None
        found = self._max_writers(buf)
        if found is None:
            return None
        out = []
        for order, blk, v in found:
            if order in updates:
                return None                            # a cycle of reductions
            ana = C.Analyzer()
            st = blk.body
            spatial = [iv.var for iv in blk.iter_vars if int(iv.iter_type) == 0]
            # the writer's store indices: distinct spatial iterators over whole axes, or constants
            bound_vars, path_red = [], list(red)
            for d, (si, gi) in enumerate(zip(st.indices, idx)):
                if isinstance(si, C.tirx.IntImm):
                    if not ana.can_prove_equal(gi, si):
                        return None
                    continue
                si, shift = _shifted(si)
                iv = next((iv for iv in blk.iter_vars if iv.var.same_as(si)), None)
                if iv is None or not any(si.same_as(u) for u in spatial) or any(si.same_as(u) for u in bound_vars):
                    return None
                if shift is None and (_const_extent(iv.dom) is None
                                      or not ana.can_prove_equal(iv.dom.extent, buf.shape[d])):
                    return None
                if shift is not None and not (isinstance(iv.dom.min, C.tirx.IntImm)
                                              and isinstance(iv.dom.extent, C.tirx.IntImm)):
                    return None
                if shift is not None:
                    # a writer of lanes [dom.min - shift, dom.max - shift) of the axis only (a row's tail
                    # folded into rfactor's partial maxima: rf[r, k - 3040] over k in [3040, 3071)): the
                    # reader's index must be one of its reduction iterators, whose range on this path is
                    # narrowed to those lanes
                    path_red = _narrowed(path_red, gi, int(iv.dom.min) - shift, int(iv.dom.extent))
                    if path_red is None:
                        return None
                    gi = gi + shift
                bound_vars.append(si)
                ana.bind(si, gi)
            own = []
            for iv in blk.iter_vars:
                if int(iv.iter_type) == 2:             # CommReduce: a constant range (a tail starts past 0)
                    if not (isinstance(iv.dom.min, C.tirx.IntImm) and isinstance(iv.dom.extent, C.tirx.IntImm)):
                        return None
                    own.append((iv.var, iv.dom))
                elif int(iv.iter_type) != 0:           # ordered / opaque iterators: not a plain reduction
                    return None
            if not isinstance(v, C.TensorLoad):
                return None
            nidx = [ana.simplify(i) for i in v.indices]
            if v.source.same_as(x.source):
                out.append((path_red + own, nidx, updates + [order]))
                continue
            sub = self._chains(x, v.source, nidx, path_red + own, updates + [order])
            if sub is None:
                return None
            out.extend(sub)
        return out

    def _covered(self, x, m) -> bool:
        """Whether ``m``'s value is a max over a set of X elements that contains ``x``: each chain from M
        to X covers the reduced axes of X bijectively inside their bounds, and together they cover them
        whole (one chain over all of them, or chains over disjoint intervals of one axis summing to it)."""
        chains = self._chains(x, m.source, list(m.indices), [], [])
        if not chains:
            return False
        # X is not written after the first reduction of the chains read it
        first = min(o for _, _, orders in chains for o in orders)
        if any(o > first for o, _, _ in self._writes(x.source)):
            return False
        axes, spans = None, []
        for red, idx, _ in chains:
            ana = C.Analyzer()
            reduced, rvars = [], []
            for d, (h, e) in enumerate(zip(idx, x.indices)):
                vs = _free_vars(h)
                rv = [(u, r) for u, r in red if any(u.same_as(w) for w in vs)]
                if not rv:
                    if not ana.can_prove_equal(h, e):
                        return False
                    continue
                if len(rv) != len(vs):
                    return False          # a reduced index that also depends on the row: not covered whole
                reduced.append((d, h, x.source.shape[d]))
                rvars += [(u, r) for u, r in rv if not any(u.same_as(w) for w, _ in rvars)]
            if not reduced or any(not isinstance(n, C.tirx.IntImm) for _, _, n in reduced):
                return False
            if axes is None:
                axes = [d for d, _, _ in reduced]
            elif axes != [d for d, _, _ in reduced]:
                return False
            doms = {u: r for u, r in rvars}
            if not C.detect_iter_map([h for _, h, _ in reduced], doms, check_level="bijective").indices:
                return False
            within = C.Analyzer()
            for u, r in rvars:
                within.bind(u, r)
            points = 1
            for _, r in rvars:
                points *= int(r.extent)
            bounds = []
            for _, h, n in reduced:
                b = within.const_int_bound(h)
                if b.min_value < 0 or b.max_value > int(n) - 1:
                    return False
                bounds.append((b.min_value, b.max_value))
            spans.append((bounds, points))
        cells = 1
        for d in axes:
            cells *= int(x.source.shape[d])
        if len(spans) == 1:
            return spans[0][1] == cells      # injective into as many cells as it has points: onto
        if len(axes) != 1:
            return False                     # several chains over several axes: not proved disjoint here
        # injective chains over disjoint intervals of one axis whose points add up to it: onto
        ivals = sorted((b[0], p) for b, p in spans)
        if any(a[0][1] >= c[0][0] for a, c in zip(ivals, ivals[1:])):
            return False
        return sum(p for _, p in ivals) == cells


def _shifted(index):
    """``(var, c)`` for a store index ``var - c`` (c a constant), else ``(index, None)``."""
    if isinstance(index, C.tirx.Sub) and isinstance(index.a, C.tirx.Var) and isinstance(index.b, C.tirx.IntImm):
        return index.a, int(index.b)
    return index, None


def _narrowed(red: list, index, lo: int, extent: int):
    """``red`` (reduction iterators [(var, Range)]) with the one that ``index`` is narrowed to [lo, lo +
    extent) of its range; None when ``index`` is not one of them or the lanes leave its range."""
    out, hit = [], False
    for u, r in red:
        if index.same_as(u):
            if not (isinstance(r.min, C.tirx.IntImm) and isinstance(r.extent, C.tirx.IntImm)):
                return None
            if lo < int(r.min) or lo + extent > int(r.min) + int(r.extent):
                return None
            r, hit = C.Range.from_min_extent(C.tirx.IntImm(str(r.min.ty.dtype), lo),
                                             C.tirx.IntImm(str(r.extent.ty.dtype), extent)), True
        out.append((u, r))
    return out if hit else None


def _free_vars(expr) -> list:
    found = []

    def visit(node):
        if isinstance(node, C.tirx.Var) and not any(node.same_as(f) for f in found):
            found.append(node)

    C.post_order_visit(expr, visit)
    return found


# ----------------------------------------------------------------------------- the rewriter
ROUNDING_CALLS = ("tirx.round", "tirx.nearbyint", "tirx.floor", "tirx.ceil", "tirx.trunc")


def _rounds_to_integer(store) -> bool:
    """Does a store round its value or make it an integer (quantization: ``round(x / scale)``)?  There a
    reciprocal multiply (within 1 ulp of the quotient) can flip the rounded result, so divisions stay exact
    (ONNX DynamicQuantizeLinear, conformance gate)."""
    if not str(store.buffer.dtype).startswith(("float", "bfloat")):
        return True
    found = [False]

    def visit(node):
        if isinstance(node, C.Call) and hasattr(node.op, "name") and str(node.op.name) in ROUNDING_CALLS:
            found[0] = True
        elif isinstance(node, C.tirx.Cast) and not str(node.ty.dtype).startswith(("float", "bfloat")):
            found[0] = True

    C.post_order_visit(store.value, visit)
    return found[0]


_BINARY = ("Add", "Sub", "Mul", "Div", "Mod", "FloorDiv", "FloorMod", "Min", "Max", "EQ", "NE", "LT",
           "LE", "GT", "GE", "And", "Or")


class _Rewriter:
    """Rebuilds a PrimFunc body with the calls of ``REWRITES`` replaced (TIR has no Python mutator in 0.27)."""

    def __init__(self, nonpositive: _NonPositive | None = None):
        self.count = 0
        self.cheap = 0           # exps of an argument proved <= 0 (the cheaper variant)
        self.kept_nested = 0     # calls left to libm: nested in MAX_NESTED_EXPANSIONS expansions already
        self.reciprocals = 0     # stores whose lane-invariant divisions became reciprocal multiplies
        self._nonpositive = nonpositive
        self._binary = tuple(getattr(C.tirx, n) for n in _BINARY)
        self._vectorized = []    # loop vars of the enclosing vectorized loops
        self._blocks = []        # (iter vars that do not vary across lanes) of the enclosing blocks
        self._divisors = None    # while a store's fast value is built: its lane-invariant divisors

    def _lane_invariant(self, b) -> bool:
        """Whether ``b`` is the same in every lane: loads, constants and arithmetic over the block's
        iterators that no vectorized loop drives (softmax's row sum, LayerNorm's row scale)."""
        if not self._blocks or self._blocks[-1] is None:
            return False
        uniform = self._blocks[-1]
        sources, names, ok = [], [], [True]

        def visit(node):
            if isinstance(node, C.TensorLoad):
                sources.append(node.source)
            elif isinstance(node, C.tirx.Var):
                names.append(node)
            elif isinstance(node, (C.tirx.Let, C.tirx.Ramp, C.tirx.Broadcast, C.tirx.Select)) or \
                    (isinstance(node, C.Call) and not (hasattr(node.op, "name") and str(node.op.name) in _PURE)):
                ok[0] = False

        C.post_order_visit(b, visit)
        return ok[0] and all(any(v.same_as(u) for u in uniform) or any(v.same_as(u) for u in sources)
                             for v in names)

    # -- expressions
    def expr(self, e):
        t = C.tirx
        if isinstance(e, t.Div) and self._divisors is not None and str(e.ty.dtype) == F32 \
                and self._lane_invariant(e.b):
            a, b = self.expr(e.a), self.expr(e.b)
            self._divisors.append(b)
            return t.Mul(a, t.Div(_f(1.0), b))
        if isinstance(e, C.Call):
            args = [self.expr(a) for a in e.args]
            name = str(e.op.name) if hasattr(e.op, "name") else ""
            if name == "tirx.pow" and _integer_exponent(e) is not None:
                self.count += 1
                return integer_power(args[0], _integer_exponent(e))
            if name == "tirx.exp2" and len(args) == 1 and str(args[0].ty.dtype) == F32 \
                    and self._nonpositive is not None and _expansion_depth(args[0]) < MAX_NESTED_EXPANSIONS \
                    and self._nonpositive.proves(args[0]):
                self.count += 1
                self.cheap += 1
                return fast_exp2_nonpositive(args[0])
            if name in REWRITES and len(args) == 1 and str(args[0].ty.dtype) == F32 \
                    and _expansion_depth(args[0]) >= MAX_NESTED_EXPANSIONS:
                self.kept_nested += 1
            elif name in REWRITES and len(args) == 1 and str(args[0].ty.dtype) == F32:
                self.count += 1
                if name == "tirx.exp" and self._nonpositive is not None and self._nonpositive.proves(args[0]):
                    self.cheap += 1
                    return fast_exp_nonpositive(args[0])
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
            return self._store(s)
        if isinstance(s, t.SeqStmt):
            return t.SeqStmt([self.stmt(x) for x in s.seq])
        if isinstance(s, t.For):
            vec = int(s.kind) == int(C.ForKind.VECTORIZED)
            if vec:
                self._vectorized.append(s.loop_var)
            body = self.stmt(s.body)
            if vec:
                self._vectorized.pop()
            return t.For(s.loop_var, s.min, s.extent, s.kind, body, s.thread_binding, s.annotations, s.step)
        if isinstance(s, C.SBlockRealize):
            uniform = None
            if self._vectorized:       # a block inside a vectorized loop: its iterators that no lane drives
                uniform = [iv.var for iv, v in zip(s.block.iter_vars, s.iter_values)
                           if not any(w.same_as(u) for w in _free_vars(v) for u in self._vectorized)]
                if len(uniform) == len(s.block.iter_vars):
                    uniform = None
            self._blocks.append(uniform)
            block = self.stmt(s.block)
            self._blocks.pop()
            return C.SBlockRealize(s.iter_values, s.predicate, block)
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


    def _store(self, s):
        """A store with its calls rewritten; in a vectorized block, a float32 division by a lane-invariant
        divisor b becomes a multiply by 1/b (one division per row once LLVM hoists it out of the loop),
        guarded by ``2^-126 <= |b| <= 2^126`` where 1/b is a normal float: the store is
        ``if guard: a * (1/b) else: a / b`` (the guard is lane-invariant: no vector select of both)."""
        t = C.tirx
        if not (self._blocks and self._blocks[-1] is not None) or _rounds_to_integer(s):
            v = self.expr(s.value)
            return s if v.same_as(s.value) else C.BufferStore(s.buffer, v, s.indices)
        counts = (self.count, self.cheap)
        self._divisors = []
        fast = self.expr(s.value)
        divisors, self._divisors = self._divisors, None
        if not divisors:
            return s if fast.same_as(s.value) else C.BufferStore(s.buffer, fast, s.indices)
        self.count, self.cheap = counts          # the exact branch rewrites the same calls again
        exact = self.expr(s.value)
        self.reciprocals += 1
        guard = None
        for b in divisors:
            mag = t.abs(b)
            ok = t.And(t.GE(mag, _f(RECIP_MIN)), t.LE(mag, _f(RECIP_MAX)))
            guard = ok if guard is None else t.And(guard, ok)
        return t.IfThenElse(guard, C.BufferStore(s.buffer, fast, s.indices),
                            C.BufferStore(s.buffer, exact, s.indices))


def rewrite(func: C.PrimFunc, stats: dict | None = None) -> tuple[C.PrimFunc, int]:
    """``func`` with float32 exp/erf/tanh/sigmoid and small integer powers replaced; returns (new func, number of calls replaced).
    ``stats``, when given, receives ``nonpositive_exp``: how many exps took the cheaper variant (their
    argument proved <= 0)."""
    rw = _Rewriter(_NonPositive(func))
    body = rw.stmt(func.body)
    if stats is not None:
        stats["nonpositive_exp"] = rw.cheap
        stats["reciprocal_stores"] = rw.reciprocals
        stats["kept_nested"] = rw.kept_nested
    if rw.count == 0 and rw.reciprocals == 0:
        return func, 0
    return func.with_body(body), rw.count + rw.reciprocals


def fast_math_pass(target: C.Target) -> C.ir_transform.Pass:
    """The named pass: every PrimFunc of the module rewritten (CPU targets; GPUs have fast intrinsics)."""

    @C.module_pass(opt_level=0, name="tvmfuse.fast_math")
    def _fast_math(mod, _ctx):
        updates = {}
        for gv, func in mod.functions.items():
            if isinstance(func, C.PrimFunc):
                stats = {}
                new, n = rewrite(func, stats)
                if n:
                    log.debug("%s: fast math rewrote %d calls and divisions (%d exps of an argument <= 0, "
                              "%d stores dividing by a lane-invariant)", gv.name_hint, n,
                              stats["nonpositive_exp"], stats["reciprocal_stores"])
                    updates[gv] = new
                if stats["kept_nested"]:
                    log.info("%s: fast math left %d calls to libm (nested in %d fast-math expansions already; "
                             "deeper nesting makes TVM's simplifier blow up)", gv.name_hint,
                             stats["kept_nested"], MAX_NESTED_EXPANSIONS)
        for gv, func in updates.items():
            mod[gv] = func
        return mod

    return _fast_math
