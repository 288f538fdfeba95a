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
