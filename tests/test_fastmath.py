"""Fast math: maximum error over the whole float32 range against float64 references (tvmfuse.fastmath)."""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import fastmath as F

from schedule_cases import store_lanes

te = C.te

special = pytest.importorskip("scipy.special")

REFERENCE = {"exp": np.exp, "erf": special.erf, "tanh": np.tanh, "sigmoid": special.expit}
SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4028235e38, -3.4028235e38, 1e-45, -1e-45,
                     1.17549435e-38, 88.72, 88.73, -87.3, -103.9, -104.1, 1e-3, 4e-4, -4e-4, 3.99, 4.01,
                     8.99, 9.01], np.float32)


def _inputs():
    # every 1021st float32 bit pattern: all exponents and signs, about 4.2 million values
    bits = np.arange(0, 2**32, 1021, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([bits.view(np.float32), SPECIALS])


def _kernel(name, target):
    n = te.var("n", "int64")
    a = te.placeholder((n,), "float32", name="A")
    b = te.compute((n,), lambda i: getattr(C.tirx, name)(a[i]), name="B")
    func, count = F.rewrite(te.create_prim_func([a, b]))
    assert count == 1, f"{name}: the call was not rewritten"
    sch = C.Schedule(func)
    (i,) = sch.get_loops(sch.get_sblock("B"))
    _, v = sch.split(i, [None, 8])
    sch.vectorize(v)
    return C.build_prim_module(C.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=target)


@pytest.mark.parametrize("name", ["exp", "erf", "tanh", "sigmoid"])
def test_max_error_whole_float32_range(name, host):
    x = _inputs()
    out = C.tensor(np.zeros_like(x))
    _kernel(name, host)["main"](C.tensor(x), out)
    y = out.numpy().astype(np.float64)
    with np.errstate(all="ignore"):
        r = REFERENCE[name](x.astype(np.float64))
        r32 = r.astype(np.float32).astype(np.float64)   # what a correctly rounded float32 result is
    np.testing.assert_array_equal(np.isnan(y), np.isnan(r), err_msg=f"{name}: NaN in != NaN out")
    inf = np.isinf(r32)
    np.testing.assert_array_equal(y[inf], r32[inf], err_msg=f"{name}: infinite limits")
    fin = np.isfinite(r32)
    assert np.isfinite(y[fin]).all(), f"{name}: overflow where the result is finite"
    bound = F.MAX_ERROR[name]
    err = np.abs(y[fin] - r[fin])
    tiny = np.finfo(np.float32).tiny
    normal = np.abs(r[fin]) >= tiny
    if "rel" in bound:
        rel = err[normal] / np.abs(r[fin][normal])
        assert rel.max() <= bound["rel"], f"{name}: relative error {rel.max():.3g}"
        sub = ~normal
        limit = bound.get("abs_subnormal", tiny)
        assert err[sub].max(initial=0) <= limit, f"{name}: subnormal-range error {err[sub].max():.3g}"
    else:
        assert err.max() <= bound["abs"], f"{name}: absolute error {err.max():.3g}"


def asm(cm) -> str:
    """The assembly of a compiled model's kernels."""
    lib = cm.executable.mod
    return "".join(m.inspect_source("asm") for m in lib.imports) if lib.imports else lib.inspect_source("asm")


def test_pipeline_switch_removes_libm_calls(host):
    """fast_math=True leaves no scalar expf/erff call in a GELU kernel; False keeps TVM's calls."""
    from tvmfuse import models as M

    model = M.matmul_bias_gelu(m=8, k=16, n=16)
    on = tvmfuse.compile(model, host, fusion=False, fast_math=True)
    off = tvmfuse.compile(model, host, fusion=False, fast_math=False)

    assert "erff" not in asm(on)
    assert "erff" in asm(off)
    feeds = M.random_feeds(model)
    np.testing.assert_allclose(on.run(feeds)["y"], off.run(feeds)["y"], rtol=1e-5, atol=1e-5)


def _vectorized_stores(func, target):
    """The lanes of the stores to B (each width once) after TVM's lowering up to and including VectorizeLoop."""
    return sorted({n for name, lanes in store_lanes(func, target).items() if name.startswith("B") for n in lanes})


@pytest.mark.parametrize("name", ["exp", "erf", "tanh", "sigmoid"])
def test_rewritten_call_stays_vectorized_in_a_row_kernel(name, host):
    """B[i, j] = f(A[i, j] - M[i]) with j split by 8 and vectorized: TVM's VectorizeLoop must keep the
    rewritten body on vectors (an ``isnan`` test made it scalarize the loop: softmax ran one lane at a time)."""
    a = te.placeholder((5, 64), "float32", name="A")
    m = te.placeholder((5,), "float32", name="M")
    b = te.compute((5, 64), lambda i, j: getattr(C.tirx, name)(a[i, j] - m[i]), name="B")
    func, count = F.rewrite(te.create_prim_func([a, m, b]))
    assert count == 1
    sch = C.Schedule(func)
    _, j = sch.get_loops(sch.get_sblock("B"))
    _, v = sch.split(j, [None, 8])
    sch.vectorize(v)
    lanes = _vectorized_stores(sch.mod["main"], host)
    assert lanes and all(n == 8 for n in lanes), f"{name}: stores of {lanes} lanes (scalarized loop)"
    x = np.random.default_rng(0).standard_normal((5, 64)).astype("float32") * 4
    x[1, 3], x[2, 5], x[3, 7] = np.nan, np.inf, -np.inf
    mv = np.float32([0.5, -1, 2, 0, 3])
    lib = C.build_prim_module(C.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=host)
    out = C.tensor(np.zeros_like(x))
    lib["main"](C.tensor(x), C.tensor(mv), out)
    with np.errstate(all="ignore"):
        want = REFERENCE[name]((x - mv[:, None]).astype(np.float64))
    np.testing.assert_allclose(out.numpy(), want, rtol=4e-7, atol=4e-7)


# ----------------------------------------------------------------------------- exp of an argument <= 0
def _nonpositive_inputs():
    # every 1021st bit pattern with the sign bit set: every negative exponent, about 2.1 million values
    bits = np.arange(2**31, 2**32, 1021, dtype=np.uint64).astype(np.uint32)
    flush = np.float32(F.EXP_FLUSH)
    near = [flush, np.nextafter(flush, np.float32(0)), np.nextafter(flush, np.float32(-100)),
            np.float32(np.log(np.finfo(np.float32).tiny)), -87.0, -88.0, -103.9, -104.1, -126 * np.log(2)]
    specials = [0.0, -0.0, -np.inf, np.nan, -np.nan, -1e-45, -1e-38, -1e-30, -1e-7, -1e-3, -0.3465736,
                -0.3465737, -1.0, -3.4028235e38]
    return np.concatenate([bits.view(np.float32), np.float32(near + specials)])


def _nonpositive_kernel(target, n, fn=F.fast_exp_nonpositive):
    a = te.placeholder((n,), "float32", name="A")
    b = te.compute((n,), lambda i: fn(a[i]), name="B")
    sch = C.Schedule(te.create_prim_func([a, b]))
    (i,) = sch.get_loops(sch.get_sblock("B"))
    _, v = sch.split(i, [None, 8])
    sch.vectorize(v)
    func = sch.mod["main"]
    lib = C.build_prim_module(C.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    return func, lib


def _run_nonpositive(host, x, fn, reference):
    """``x`` (zero-padded to a multiple of 8, a static length) through ``fn``'s kernel, checked to store 8 lanes
    at a time: (padded x, the kernel's output and ``reference(x)``, both float64)."""
    x = np.concatenate([x, np.zeros(-len(x) % 8, np.float32)])
    func, lib = _nonpositive_kernel(host, len(x), fn)
    lanes = _vectorized_stores(func, host)
    assert lanes and all(n == 8 for n in lanes), f"stores of {lanes} lanes"
    out = C.tensor(np.zeros_like(x))
    lib["main"](C.tensor(x), out)
    with np.errstate(invalid="ignore"):
        return x, out.numpy().astype(np.float64), reference(x.astype(np.float64))


def _assert_nonpositive_error(x, y, r, bound, flush):
    """NaN -> NaN, -inf -> 0, 0 -> 1 exactly; relative error <= ``bound["rel"]`` where the reference is a normal
    float32, absolute error <= ``bound["abs_subnormal"]`` below it, and 0 below the ``flush`` threshold."""
    np.testing.assert_array_equal(np.isnan(y), np.isnan(x), err_msg="NaN in != NaN out")
    assert (y[np.isneginf(x)] == 0).all() and (y[x == 0] == 1).all()
    fin = ~np.isnan(x)
    err = np.abs(y[fin] - r[fin])
    normal = r[fin] >= np.finfo(np.float32).tiny
    rel = err[normal] / r[fin][normal]
    assert rel.max() <= bound["rel"], f"relative error {rel.max():.3g}"
    assert err[~normal].max() <= bound["abs_subnormal"], f"absolute error below FLT_MIN {err[~normal].max():.3g}"
    assert (y[fin][x[fin] < np.float32(flush)] == 0).all(), "below the flush threshold: not 0"


def test_nonpositive_exp_max_error_whole_range(host):
    """The cheaper exp over every non-positive float32 (vectorized by 8): NaN -> NaN, -inf -> 0, 0 -> 1
    exactly, relative error <= MAX_ERROR where e^x is normal, absolute error <= FLT_MIN below it."""
    x, y, r = _run_nonpositive(host, _nonpositive_inputs(), F.fast_exp_nonpositive, np.exp)
    _assert_nonpositive_error(x, y, r, F.MAX_ERROR["exp_nonpositive"], F.EXP_FLUSH)
    assert F.MAX_ERROR["exp_nonpositive"]["abs_subnormal"] <= 1.2e-38
    fin = ~np.isnan(x)
    assert (y[fin] >= 0).all() and (y[fin] <= 1).all()


def test_nonpositive_exp2_max_error_whole_range(host):
    """The base-2 exp (cpu.attention's exp2 knob) over every non-positive float32 (vectorized by 8): NaN ->
    NaN, -inf -> 0, 0 -> 1 and the integers down to -126 -> 2^x exactly, relative error <= MAX_ERROR where
    2^x is normal, 0 below EXP2_FLUSH."""
    x = np.concatenate([_nonpositive_inputs(), -np.arange(127, dtype=np.float32), np.float32([-126.5, -127.0])])
    x, y, r = _run_nonpositive(host, x, F.fast_exp2_nonpositive, np.exp2)
    _assert_nonpositive_error(x, y, r, F.MAX_ERROR["exp2_nonpositive"], F.EXP2_FLUSH)
    with np.errstate(invalid="ignore"):
        ints = (x == np.round(x)) & (x >= F.EXP2_FLUSH)
    np.testing.assert_array_equal(y[ints], r[ints], err_msg="2^n not exact")


def test_exp2_rewritten_only_where_proved_nonpositive(host):
    """exp2(min(x, c)), c <= 0, takes the base-2 expansion (counted as a cheaper exp) and computes 2^min(x, c);
    an exp2 not proved <= 0 keeps TVM's call (no general fast exp2)."""
    t = C.tirx
    a = te.placeholder((64,), "float32", name="A")
    proved = te.create_prim_func([a, te.compute((64,), lambda i: t.exp2(t.min(a[i], t.const(0.0, "float32"))),
                                                name="B")])
    plain = te.create_prim_func([a, te.compute((64,), lambda i: t.exp2(a[i]), name="B")])
    assert _cheap_count(proved) == 1 and _cheap_count(plain) == 0
    assert F.rewrite(plain)[1] == 0
    new, count = F.rewrite(proved)
    assert count == 1
    x = np.random.default_rng(4).uniform(-130, 3, 64).astype(np.float32)
    x[:3] = (-np.inf, 0.0, 2.0)
    lib = C.build_prim_module(C.IRModule({"main": new.with_attr("global_symbol", "main")}), host)
    out = C.tensor(np.zeros_like(x))
    lib["main"](C.tensor(x), out)
    np.testing.assert_allclose(out.numpy(), np.exp2(np.minimum(x, 0).astype(np.float64)),
                               rtol=F.MAX_ERROR["exp2_nonpositive"]["rel"], atol=1.2e-38)


def test_nonpositive_exp_of_a_min_with_a_nonpositive_constant(host):
    """exp(min(x, c)) with a constant c <= 0 takes the cheaper exp (the argument is <= 0 whatever x is) and
    computes e^min(x, c) on both sides of c; min(x, c) with c > 0 keeps the full exp."""
    t = C.tirx
    a = te.placeholder((64,), "float32", name="A")
    funcs = {c: te.create_prim_func([a, te.compute((64,), lambda i: t.exp(t.min(a[i], t.const(c, "float32"))),
                                                  name="B")]) for c in (0.0, -0.5, 0.5)}
    assert _cheap_count(funcs[0.0]) == 1 and _cheap_count(funcs[-0.5]) == 1
    assert _cheap_count(funcs[0.5]) == 0
    x = np.random.default_rng(3).uniform(-100, 3, 64).astype(np.float32)
    x[:3] = (-np.inf, 0.0, 2.0)
    for c in (0.0, -0.5):
        new, _ = F.rewrite(funcs[c])
        lib = C.build_prim_module(C.IRModule({"main": new.with_attr("global_symbol", "main")}), host)
        out = C.tensor(np.zeros_like(x))
        lib["main"](C.tensor(x), out)
        np.testing.assert_allclose(out.numpy(), np.exp(np.minimum(x, np.float32(c)).astype(np.float64)),
                                   rtol=F.MAX_ERROR["exp_nonpositive"]["rel"], atol=1.2e-38)


def _row_exp_func(make_m, exp_arg=None):
    """B[i, j] = exp(A[i, j] - M[i]) with M built by ``make_m(a)`` (a te tensor or a placeholder)."""
    a = te.placeholder((5, 64), "float32", name="A")
    m, params = make_m(a)
    arg = exp_arg or (lambda a, m, i, j: a[i, j] - m[i])
    b = te.compute((5, 64), lambda i, j: C.tirx.exp(arg(a, m, i, j)), name="B")
    return te.create_prim_func([a, *params, b])


def _row_max(lo=0, hi=64, src=None):
    def make(a):
        s = src if src is not None else a
        k = te.reduce_axis((lo, hi), name="k")
        m = te.compute((5,), lambda i: te.max(s[i, k], axis=k), name="M")
        return m, ([s] if src is not None else [])
    return make


def _cheap_count(func):
    stats = {}
    F.rewrite(func, stats)
    return stats["nonpositive_exp"]


def test_nonpositive_exp_only_where_proved(host):
    """The cheaper exp is used for exp(A - rowmax(A)) only: a max over the whole row of the same buffer
    (also after rfactor, as the row-reduction template leaves it); anything else keeps the full exp."""
    proved = _row_exp_func(_row_max())
    assert _cheap_count(proved) == 1
    # the same after rfactor + vectorized partial maxima (the CPU row-reduction shape)
    sch = C.Schedule(proved)
    blk = sch.get_sblock("M")
    _, k = sch.get_loops(blk)
    _, ki = sch.split(k, [None, 16])
    sch.rfactor(ki, factor_axis=1)
    assert _cheap_count(sch.mod["main"]) == 1
    other = te.placeholder((5, 64), "float32", name="O")
    not_proved = {
        "M a parameter": _row_exp_func(_param_m),
        "max over part of the row": _row_exp_func(_row_max(0, 63)),
        "max of another buffer": _row_exp_func(_row_max(src=other)),
        "reversed difference": _row_exp_func(_row_max(), exp_arg=lambda a, m, i, j: m[i] - a[i, j]),
        "another row": _row_exp_func(_row_max(), exp_arg=lambda a, m, i, j: a[(i + 1) % 5, j] - m[i]),
        "a min, not a max": _row_exp_func(_row_min()),
        "x + m": _row_exp_func(_row_max(), exp_arg=lambda a, m, i, j: a[i, j] + m[i]),
    }
    for what, func in not_proved.items():
        assert _cheap_count(func) == 0, f"{what}: the cheaper exp was used"
        _, count = F.rewrite(func)
        assert count >= 1, f"{what}: the exp was not rewritten at all"


def _param_m(a):
    m = te.placeholder((5,), "float32", name="M")
    return m, [m]


def _row_min():
    def make(a):
        k = te.reduce_axis((0, 64), name="k")
        return te.compute((5,), lambda i: te.min(a[i, k], axis=k), name="M"), []
    return make


def test_lane_invariant_division_becomes_reciprocal_multiply(host):
    """B[i, j] = A[i, j] / D[i], j vectorized: one 1/D[i] per row and multiplies where 2^-126 <= |D| <=
    2^126 (relative error <= 2^-23 against the exact quotient, the division's is 2^-24); the division
    itself elsewhere (0, inf, NaN, subnormal and huge divisors: bit for bit); stores stay 8 lanes."""
    rows = np.float32([3.0, -7.5, 1.0, 3071.9, 1e-39, 2.0 ** -127, 2.0 ** 126, 1e38, 0.0, np.inf, np.nan,
                       2.0 ** -126, -(2.0 ** 126)])
    a = te.placeholder((len(rows), 64), "float32", name="A")
    d = te.placeholder((len(rows),), "float32", name="D")
    b = te.compute((len(rows), 64), lambda i, j: a[i, j] / d[i], name="B")
    sch = C.Schedule(te.create_prim_func([a, d, b]))
    _, j = sch.get_loops(sch.get_sblock("B"))
    _, v = sch.split(j, [None, 8])
    sch.vectorize(v)
    stats = {}
    func, count = F.rewrite(sch.mod["main"], stats)
    assert count == 1 and stats["reciprocal_stores"] == 1
    lanes = _vectorized_stores(func, host)
    assert lanes and all(n == 8 for n in lanes), f"stores of {lanes} lanes"
    lib = C.build_prim_module(C.IRModule({"main": func.with_attr("global_symbol", "main")}), target=host)
    x = np.random.default_rng(0).standard_normal((len(rows), 64)).astype(np.float32) * 1e3
    x[:, :4] = [0.0, np.inf, -np.inf, 1e-40]
    out = C.tensor(np.zeros_like(x))
    lib["main"](C.tensor(x), C.tensor(rows), out)
    y = out.numpy()
    with np.errstate(all="ignore"):
        exact32 = x / rows[:, None]
        exact = x.astype(np.float64) / rows[:, None].astype(np.float64)
    guarded = (np.abs(rows) >= 2.0 ** -126) & (np.abs(rows) <= 2.0 ** 126)
    np.testing.assert_array_equal(y[~guarded], exact32[~guarded])          # division kept, NaNs equal
    g, e = y[guarded].astype(np.float64), exact[guarded]
    np.testing.assert_array_equal(np.isnan(g), np.isnan(e))
    f32 = np.finfo(np.float32)
    fin = np.isfinite(e) & (np.abs(e) >= f32.tiny) & (np.abs(e) <= f32.max)
    rel = np.abs(g[fin] - e[fin]) / np.abs(e[fin])
    assert rel.max() <= 2.0 ** -23, f"relative error {rel.max():.3g} at {e[fin][rel.argmax()]}"
    over = np.abs(e) > f32.max                          # the quotient overflows float32: inf either way
    np.testing.assert_array_equal(g[over], np.sign(e[over]) * np.inf)
    sub = np.isfinite(e) & (np.abs(e) < f32.tiny)
    assert (np.abs(g[sub] - e[sub]) <= 2.0 ** -149 * 2).all()


def test_division_by_a_lane_varying_value_is_kept(host):
    """A[i, j] / D[i, j] (a divisor per lane) and an unvectorized A[i, j] / D[i] keep the division."""
    a = te.placeholder((5, 64), "float32", name="A")
    d2 = te.placeholder((5, 64), "float32", name="D")
    b = te.compute((5, 64), lambda i, j: a[i, j] / d2[i, j], name="B")
    sch = C.Schedule(te.create_prim_func([a, d2, b]))
    _, j = sch.get_loops(sch.get_sblock("B"))
    _, v = sch.split(j, [None, 8])
    sch.vectorize(v)
    stats = {}
    assert F.rewrite(sch.mod["main"], stats) == (sch.mod["main"], 0) and stats["reciprocal_stores"] == 0
    d1 = te.placeholder((5,), "float32", name="D")
    b1 = te.compute((5, 64), lambda i, j: a[i, j] / d1[i], name="B")
    plain = te.create_prim_func([a, d1, b1])
    assert F.rewrite(plain, stats) == (plain, 0) and stats["reciprocal_stores"] == 0


# ----------------------------------------------------------------------------- integer powers
def _pow_func(exponent, arg=lambda a, i: a[i]):
    n = te.var("n", "int64")
    a = te.placeholder((n,), "float32", name="A")
    b = te.compute((n,), lambda i: C.tirx.pow(arg(a, i), exponent), name="B")
    return te.create_prim_func([a, b])


def _calls_named(func, name):
    found = []
    C.post_order_visit(func.body, lambda e: found.append(e) if isinstance(e, C.Call) and
                       hasattr(e.op, "name") and str(e.op.name) == name else None)
    return found


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4])
def test_integer_power_max_error_whole_float32_range(n, host):
    """pow(x, n) for a constant integer n becomes n - 1 multiplies: relative error within (n - 1) 2^-24
    of the exact power where the result is normal, FLT_MIN below it; +-0, +-inf, NaN and overflow as powf."""
    func, count = F.rewrite(_pow_func(C.tirx.const(float(n), "float32")))
    assert count == 1 and not _calls_named(func, "tirx.pow"), "pow(x, n) was not rewritten into multiplies"
    sch = C.Schedule(func)
    (i,) = sch.get_loops(sch.get_sblock("B"))
    _, v = sch.split(i, [None, 8])
    sch.vectorize(v)
    lib = C.build_prim_module(C.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=host)
    x = _inputs()
    out = C.tensor(np.zeros_like(x))
    lib["main"](C.tensor(x), out)
    y = out.numpy().astype(np.float64)
    with np.errstate(all="ignore"):
        r = np.power(x.astype(np.float64), n)
        r32 = np.power(x, np.float32(n))            # numpy's float32 power: the libm-like reference for limits
        rf = r.astype(np.float32)                    # the exact power rounded to float32 (inf where it overflows)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(r32), err_msg=f"x^{n}: NaN in != NaN out")
    inf = np.isinf(rf)
    np.testing.assert_array_equal(y[inf], rf[inf], err_msg=f"x^{n}: infinite limits")
    zero = r == 0
    np.testing.assert_array_equal(np.signbit(y[zero]), np.signbit(r32[zero]), err_msg=f"x^{n}: sign of zero")
    fin = np.isfinite(rf)
    err = np.abs(y[fin] - r[fin])
    normal = np.abs(r[fin]) >= np.finfo(np.float32).tiny
    rel = err[normal] / np.abs(r[fin][normal])
    assert rel.max(initial=0) <= max(n - 1, 0) * F.MAX_ERROR["pow"]["rel_per_multiply"] * (1 + 1e-6), \
        f"x^{n}: relative error {rel.max():.3g}"
    assert err[~normal].max(initial=0) <= F.MAX_ERROR["pow"]["abs_subnormal"], f"x^{n}: subnormal-range error"


def test_integer_power_of_an_expression_is_computed_once(host):
    """pow(a + 1, 3): the base is bound once (a Let), not recomputed per factor; numbers vs numpy."""
    func, count = F.rewrite(_pow_func(C.tirx.const(3.0, "float32"), lambda a, i: a[i] + C.tirx.const(1.0, "float32")))
    assert count == 1 and not _calls_named(func, "tirx.pow")
    lets = []
    C.post_order_visit(func.body, lambda e: lets.append(e) if isinstance(e, C.tirx.Let) else None)
    assert len(lets) == 1, f"expected the base bound once, found {len(lets)} Lets"
    lib = C.build_prim_module(C.IRModule({"main": func.with_attr("global_symbol", "main")}), target=host)
    x = np.random.default_rng(1).standard_normal(1000).astype("float32") * 3
    out = C.tensor(np.zeros_like(x))
    lib["main"](C.tensor(x), out)
    np.testing.assert_allclose(out.numpy(), (x.astype(np.float64) + 1) ** 3, rtol=2.5e-7, atol=1e-6)


@pytest.mark.parametrize("exponent", [2.5, -1.0, 5.0, "load"])
def test_other_powers_are_kept(exponent):
    """Fractional, negative, large or data-dependent exponents keep TVM's pow call."""
    if exponent == "load":
        n = te.var("n", "int64")
        a = te.placeholder((n,), "float32", name="A")
        e = te.placeholder((n,), "float32", name="E")
        b = te.compute((n,), lambda i: C.tirx.pow(a[i], e[i]), name="B")
        func = te.create_prim_func([a, e, b])
    else:
        func = _pow_func(C.tirx.const(exponent, "float32"))
    new, count = F.rewrite(func)
    assert count == 0 and len(_calls_named(new, "tirx.pow")) == 1


def test_integer_power_rejects_out_of_range_exponent():
    with pytest.raises(ValueError, match="exponent 5 outside"):
        F.integer_power(C.tirx.Var("x", "float32"), 5)


def test_gelu_tanh_kernel_has_no_powf(host):
    """GPT-2's GELU (0.5 x (1 + tanh(c (x + 0.044715 pow(x, 3))))) compiles to a kernel without a powf
    call, and matches the unfused, fast_math=False build on fresh random inputs."""
    from onnx import TensorProto, helper

    def const(name, v):
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.FLOAT, [], [v]))

    nodes = [const("three", 3.0), const("k", 0.044715), const("c", 0.7978845608), const("one", 1.0),
             const("half", 0.5),
             helper.make_node("Pow", ["x", "three"], ["p"]), helper.make_node("Mul", ["p", "k"], ["pk"]),
             helper.make_node("Add", ["x", "pk"], ["s"]), helper.make_node("Mul", ["s", "c"], ["sc"]),
             helper.make_node("Tanh", ["sc"], ["t"]), helper.make_node("Add", ["t", "one"], ["t1"]),
             helper.make_node("Mul", ["x", "t1"], ["xt"]), helper.make_node("Mul", ["xt", "half"], ["y"])]
    graph = helper.make_graph(nodes, "gelu_tanh", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [32, 256])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    on = tvmfuse.compile(model, host, fast_math=True)
    off = tvmfuse.compile(model, host, fusion=False, fast_math=False)

    assert "powf" not in asm(on)
    assert "powf" in asm(off)
    x = np.random.default_rng().standard_normal((32, 256)).astype("float32") * 3
    np.testing.assert_allclose(on.run({"x": x})["y"], off.run({"x": x})["y"], rtol=1e-5, atol=1e-5)


def _row_max_in_parts(parts):
    """B[i, j] = exp(A[i, j] - M[i]), M[i] = -FLT_MAX then maxed over A[i, lo:hi] for each (lo, hi) in
    ``parts``, one block each (TVMScript)."""
    T = C.script_tir
    (lo1, hi1), (lo2, hi2) = parts

    @T.prim_func(private=True, s_tir=True)
    def func(a: T.Buffer((5, 64), "float32"), b: T.Buffer((5, 64), "float32")):
        m = T.sblock_alloc_buffer((5,))
        for i in range(5):
            with T.sblock("init"):
                vi = T.axis.spatial(5, i)
                m[vi] = T.float32(-3.4028234663852886e38)
        for i, k in T.grid(5, hi1 - lo1):
            with T.sblock("part1"):
                vi = T.axis.spatial(5, i)
                vk = T.axis.reduce((lo1, hi1), k + lo1)
                m[vi] = T.max(m[vi], a[vi, vk])
        for i, k in T.grid(5, hi2 - lo2):
            with T.sblock("part2"):
                vi = T.axis.spatial(5, i)
                vk = T.axis.reduce((lo2, hi2), k + lo2)
                m[vi] = T.max(m[vi], a[vi, vk])
        for i, j in T.grid(5, 64):
            with T.sblock("B"):
                vi, vj = T.axis.remap("SS", [i, j])
                b[vi, vj] = T.exp(a[vi, vj] - m[vi])

    return func


def test_nonpositive_exp_over_a_row_max_cut_in_parts(host):
    """A row max cut into a vector main part and a scalar tail (cpu.row_reduction over rows no partial-sum
    width divides: 3071 floats, 65 keys) still proves exp(A - M) <= 0: the parts' intervals are disjoint
    and add up to the row.  A gap, an overlap that leaves the row's count wrong, or a tail that resets M
    with its own init: the full exp (issue 11: rows of 3071 ran the full-range exp, 1.2x rows of 3072)."""
    assert _cheap_count(_row_max_in_parts([(0, 48), (48, 64)])) == 1
    assert _cheap_count(_row_max_in_parts([(48, 64), (0, 48)])) == 1
    for what, parts in {"a gap": [(0, 40), (41, 64)], "an overlap": [(0, 40), (39, 64)],
                        "part of the row": [(0, 32), (32, 63)]}.items():
        assert _cheap_count(_row_max_in_parts(parts)) == 0, what
    # the template's shape: loop_partition, the tail's init dropped, the main part rfactored over 16 lanes
    from tvmfuse.schedules.cpu import common as U

    def cut(drop_init: bool):
        sch = C.Schedule(_row_exp_func(_row_max()))
        blk = sch.get_sblock("M")
        _, k = sch.get_loops(blk)
        main, tail = sch.loop_partition(k, factors=[48, None])
        if drop_init:
            U.drop_init(sch, sch.get_child_blocks(tail)[0])
        _, ki = sch.split(main, [None, 16])
        sch.rfactor(ki, factor_axis=1)
        return sch.mod["main"]

    assert _cheap_count(cut(drop_init=True)) == 1
    assert _cheap_count(cut(drop_init=False)) == 0, "a tail with its own init resets the max: not proved"


def _row_max_tail_in_partial_maxima(lo: int, hi: int, shift: int):
    """cpu.row_reduction's shape for a row no partial-max width divides (issue 11): M[i] = max over 16 partial
    maxima rf[i, l], which hold A[i, 16 k + l] for k < 3 and then A[i, k] for k in [lo, hi) at lane k - shift
    (the row's tail folded into the partial maxima as one vector), B = exp(A - M)."""
    T = C.script_tir

    @T.prim_func(private=True, s_tir=True)
    def func(a: T.Buffer((5, 64), "float32"), b: T.Buffer((5, 64), "float32")):
        m = T.sblock_alloc_buffer((5,))
        rf = T.sblock_alloc_buffer((5, 16))
        for i, l in T.grid(5, 16):
            with T.sblock("rf_init"):
                vi, vl = T.axis.remap("SS", [i, l])
                rf[vi, vl] = T.float32(-3.4028234663852886e38)
        for i, k, l in T.grid(5, 3, 16):
            with T.sblock("rf_update"):
                vi, vk, vl = T.axis.remap("SRS", [i, k, l])
                rf[vi, vl] = T.max(rf[vi, vl], a[vi, vk * 16 + vl])
        for i, k in T.grid(5, hi - lo):
            with T.sblock("rf_tail"):
                vi = T.axis.spatial(5, i)
                vk = T.axis.spatial((lo, hi), k + lo)
                rf[vi, vk - shift] = T.max(rf[vi, vk - shift], a[vi, vk])
        for i, l in T.grid(5, 16):
            with T.sblock("M"):
                vi, vl = T.axis.remap("SR", [i, l])
                with T.init():
                    m[vi] = T.float32(-3.4028234663852886e38)
                m[vi] = T.max(m[vi], rf[vi, vl])
        for i, j in T.grid(5, 64):
            with T.sblock("B"):
                vi, vj = T.axis.remap("SS", [i, j])
                b[vi, vj] = T.exp(a[vi, vj] - m[vi])

    return func


def test_nonpositive_exp_over_a_tail_folded_into_the_partial_maxima():
    """The row's tail written into lanes [lo - shift, hi - shift) of the partial maxima before their
    write-back (cpu.row_reduction, issue 11) still proves exp(A - M) <= 0 when the lanes read the rest of
    the row; a tail that misses an element, or lanes past the partial maxima: the full exp."""
    assert _cheap_count(_row_max_tail_in_partial_maxima(48, 64, 48)) == 1
    assert _cheap_count(_row_max_tail_in_partial_maxima(48, 63, 48)) == 0, "element 63 not covered"
    assert _cheap_count(_row_max_tail_in_partial_maxima(48, 64, 47)) == 0, "lanes 1..16 of 16 partial maxima"
