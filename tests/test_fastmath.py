"""Fast math: maximum error over the whole float32 range against float64 references (tvmfuse.fastmath)."""
import numpy as np
import pytest
import tvm
from tvm import te

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import fastmath as F

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
    return tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=target)


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


def test_pipeline_switch_removes_libm_calls(host):
    """fast_math=True leaves no scalar expf/erff call in a GELU kernel; False keeps TVM's calls."""
    from tvmfuse import models as M

    model = M.matmul_bias_gelu(m=8, k=16, n=16)
    on = tvmfuse.compile(model, host, fusion=False, fast_math=True)
    off = tvmfuse.compile(model, host, fusion=False, fast_math=False)

    def asm(cm):
        lib = cm.executable.mod
        return "".join(m.inspect_source("asm") for m in lib.imports) if lib.imports else lib.inspect_source("asm")

    assert "erff" not in asm(on)
    assert "erff" in asm(off)
    feeds = M.random_feeds(model)
    np.testing.assert_allclose(on.run(feeds)["y"], off.run(feeds)["y"], rtol=1e-5, atol=1e-5)


def _vectorized_stores(func, target):
    """(lanes of every store to B) after TVM's lowering up to and including VectorizeLoop."""
    S = C.s_tir.transform
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main").with_attr("target", target)})
    passes = [S.CanonicalizeLoop(), S.LowerInitBlock(), S.PlanAndUpdateBufferAllocationLocation(),
              S.ConvertBlocksToOpaque(), S.CompactBufferAllocation(), S.LowerMatchBuffer(), S.StmtSimplify(),
              S.LowerOpaqueBlock(), C.tirx.transform.FlattenBuffer(), C.tirx.transform.NarrowDataType(32),
              C.tirx.transform.VectorizeLoop(True)]
    with target:
        mod = C.Sequential(passes)(mod)
    lanes = []
    C.post_order_visit(mod["main"].body, lambda s: lanes.append(int(s.value.ty.dtype.lanes))
                       if isinstance(s, C.BufferStore) and str(s.buffer.name).startswith("B") else None)
    return lanes


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
    lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=host)
    out = C.tensor(np.zeros_like(x))
    lib["main"](C.tensor(x), C.tensor(mv), out)
    with np.errstate(all="ignore"):
        want = REFERENCE[name]((x - mv[:, None]).astype(np.float64))
    np.testing.assert_allclose(out.numpy(), want, rtol=4e-7, atol=4e-7)
