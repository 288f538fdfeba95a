"""Pre-legalize rewrites: before/expected Relax (assert_structural_equal), one case per row where the
rewrite fires and one where it must not (expected = before)."""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.passes.rewrites import PEEPHOLES, FoldBatchNorm, Peephole

relax = C.relax
F32 = "float32"


def _mod(shapes, body):
    """main(x0: shapes[0], ...) whose dataflow block computes ``body(*params)`` (a list of exprs to emit)."""
    bb = C.BlockBuilder()
    xs = [relax.Var(f"x{i}", relax.TensorType(s, F32)) for i, s in enumerate(shapes)]
    with bb.function("main", xs):
        with bb.dataflow():
            out = None
            for e in body(*xs):
                out = bb.emit(e)
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get()


def _run(passes, mod, host):
    with host:
        return C.Sequential(passes + [C.relax_transform.CanonicalizeBindings(),
                                      C.relax_transform.DeadCodeElimination()])(mod)


def _c(v):
    return relax.const(np.asarray(v, np.float32))


ONES, ZEROS = np.ones((4, 8), np.float32), np.zeros((8,), np.float32)
op = relax.op

# name -> (before body, expected body) over x0: (4, 8)
FIRES = {
    "mul_one": (lambda x: [op.nn.relu(op.multiply(x, _c(ONES)))], lambda x: [op.nn.relu(x)]),
    "add_zero": (lambda x: [op.nn.relu(op.add(_c(ZEROS), x))], lambda x: [op.nn.relu(x)]),
    "sub_zero": (lambda x: [op.nn.relu(op.subtract(x, _c(ZEROS)))], lambda x: [op.nn.relu(x)]),
    "div_const": (lambda x: [op.divide(x, _c(4.0))], lambda x: [op.multiply(x, _c(0.25))]),
    "integer_power": (lambda x: [op.power(x, _c(3.0))],
                      lambda x: [op.multiply(op.multiply(x, x), x)]),
    "identity_reshape": (lambda x: [op.nn.relu(op.reshape(x, (4, 8)))], lambda x: [op.nn.relu(x)]),
    "identity_transpose": (lambda x: [op.nn.relu(op.permute_dims(x, [0, 1]))], lambda x: [op.nn.relu(x)]),
    "identity_cast": (lambda x: [op.nn.relu(op.astype(x, F32))], lambda x: [op.nn.relu(x)]),
    # [4, 8] -> [32, 1] (a column) @ [1, 3] (a row): their broadcast product
    "outer_product_matmul": (lambda x: [op.matmul(op.reshape(x, (32, 1)), _c(np.arange(3.0).reshape(1, 3)))],
                             lambda x: [op.multiply(op.reshape(x, (32, 1)), _c(np.arange(3.0).reshape(1, 3)))]),
}
NOT_FIRES = {
    "mul_one": lambda x: [op.multiply(op.reshape(x, (32, 1)), _c(np.ones((1, 3), np.float32)))],  # broadcasts
    "add_zero": lambda x: [op.add(x, _c(np.full((8,), 0.5, np.float32)))],
    "sub_zero": lambda x: [op.subtract(_c(ZEROS), x)],                                          # 0 - x
    "div_const": lambda x: [op.divide(x, _c(0.0))],                                            # x / 0 stays
    "integer_power": lambda x: [op.power(x, _c(2.5))],                                      # not an integer
    "identity_reshape": lambda x: [op.reshape(x, (8, 4))],
    "identity_transpose": lambda x: [op.permute_dims(x, [1, 0])],
    "identity_cast": lambda x: [op.astype(x, "float16")],
    "outer_product_matmul": lambda x: [op.matmul(x, _c(np.ones((8, 3), np.float32)))],        # K = 8
}


# rows whose pattern needs a symbolic shape: before/expected in tests/test_symbolic_shape_peepholes.py
SYMBOLIC_ROWS = ("take_of_symbolic_shape", "cumsum_of_ones", "matmul_of_broadcast_constant")


def test_every_peephole_row_is_tested():
    assert {r.name for r in PEEPHOLES} - set(SYMBOLIC_ROWS) == set(FIRES) == set(NOT_FIRES)


@pytest.mark.parametrize("name", sorted(FIRES))
def test_peephole(name, host):
    before, expected = FIRES[name]
    C.assert_structural_equal(_run([Peephole()], _mod([(4, 8)], before), host),
                              _run([], _mod([(4, 8)], expected), host))


@pytest.mark.parametrize("name", sorted(NOT_FIRES))
def test_peephole_must_not_fire(name, host):
    before = _mod([(4, 8)], NOT_FIRES[name])
    C.assert_structural_equal(_run([Peephole()], before, host), _run([], before, host))


# ----------------------------------------------------------------------------------- batch-norm folding
RNG = np.random.default_rng(0)
W = RNG.standard_normal((6, 3, 3, 3)).astype(np.float32)
GAMMA, BETA, MEAN = (RNG.standard_normal(6).astype(np.float32) for _ in range(3))
VAR = (1 + np.abs(RNG.standard_normal(6))).astype(np.float32)


def _conv_bn(x, w=W, params=None):
    conv = op.nn.conv2d(x, _c(w), padding=[1, 1, 1, 1])
    p = params or [_c(GAMMA), _c(BETA), _c(MEAN), _c(VAR)]
    return conv, op.nn.batch_norm(conv, *p, axis=1, epsilon=1e-5, training=False)


def test_fold_batch_norm_into_conv(host):
    mod = _mod([(1, 3, 8, 8)], lambda x: [relax.TupleGetItem(_conv_bn(x)[1], 0)])
    s = GAMMA.astype(np.float64) / np.sqrt(VAR.astype(np.float64) + 1e-5)
    w2 = (W.astype(np.float64) * s.reshape(-1, 1, 1, 1)).astype(np.float32)
    b2 = (BETA - MEAN * s).reshape(1, -1, 1, 1).astype(np.float32)

    bb = C.BlockBuilder()
    x = relax.Var("x0", relax.TensorType((1, 3, 8, 8), F32))
    with bb.function("main", [x]):
        with bb.dataflow():
            c = bb.emit(op.nn.conv2d(x, relax.const(w2), padding=[1, 1, 1, 1]))
            gv = bb.emit_output(op.add(c, relax.const(b2)))
        bb.emit_func_output(gv)
    C.assert_structural_equal(_run([FoldBatchNorm()], mod, host), _run([], bb.get(), host))


def test_fold_batch_norm_into_conv1d(host):
    """A BatchNorm1d after a conv1d (NCW/OIW) folds the same way, before Conv1dAsConv2d moves it to 4-D."""
    w1 = W[:, :, 1, :]                                    # [6, 3, 3]: O, I, W
    mod = _mod([(1, 3, 8)], lambda x: [relax.TupleGetItem(op.nn.batch_norm(
        op.nn.conv1d(x, _c(w1), padding=1), _c(GAMMA), _c(BETA), _c(MEAN), _c(VAR), axis=1, epsilon=1e-5,
        training=False), 0)])
    s = GAMMA.astype(np.float64) / np.sqrt(VAR.astype(np.float64) + 1e-5)
    w2 = (w1.astype(np.float64) * s.reshape(-1, 1, 1)).astype(np.float32)
    b2 = (BETA - MEAN * s).reshape(1, -1, 1).astype(np.float32)

    bb = C.BlockBuilder()
    x = relax.Var("x0", relax.TensorType((1, 3, 8), F32))
    with bb.function("main", [x]):
        with bb.dataflow():
            c = bb.emit(op.nn.conv1d(x, relax.const(w2), padding=1))
            gv = bb.emit_output(op.add(c, relax.const(b2)))
        bb.emit_func_output(gv)
    C.assert_structural_equal(_run([FoldBatchNorm()], mod, host), _run([], bb.get(), host))


def test_fold_batch_norm_must_not_fire_on_non_constant_params(host):
    shapes = [(1, 3, 8, 8), (6,), (6,), (6,), (6,)]
    before = _mod(shapes, lambda x, g, b, m, v: [relax.TupleGetItem(_conv_bn(x, params=[g, b, m, v])[1], 0)])
    C.assert_structural_equal(_run([FoldBatchNorm()], before, host), _run([], before, host))


def test_fold_batch_norm_must_not_fire_when_conv_output_has_other_users(host):
    bb = C.BlockBuilder()
    x = relax.Var("x0", relax.TensorType((1, 3, 8, 8), F32))
    with bb.function("main", [x]):
        with bb.dataflow():
            conv = bb.emit(op.nn.conv2d(x, _c(W), padding=[1, 1, 1, 1]))
            bn = bb.emit(op.nn.batch_norm(conv, _c(GAMMA), _c(BETA), _c(MEAN), _c(VAR), axis=1, epsilon=1e-5,
                                          training=False))
            y = bb.emit(relax.TupleGetItem(bn, 0))
            gv = bb.emit_output(op.add(y, conv))  # the conv output is needed un-normalized too
        bb.emit_func_output(gv)
    before = bb.get()
    C.assert_structural_equal(_run([FoldBatchNorm()], before, host), _run([], before, host))


@pytest.mark.parametrize("depthwise", [False, True])
def test_folded_conv_bn_matches_reference(depthwise, rng, host):
    """No batch-norm arithmetic left at run time, and the numbers agree (rtol 1e-4: the scale is applied
    to the weights before the accumulation instead of after it)."""
    from conftest import assert_close_to_reference

    model = M.conv_bn_relu_residual(channels=8, size=6, depthwise=depthwise)
    cm = tvmfuse.compile(model, host, schedules=False)
    assert not any("batch_norm" in n for n in cm.report.after.kernel_names)
    assert cm.kernel_count == 1
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 17])
def test_outer_product_matmul_matches_the_matmul(rows, rng, host):
    """The rewritten outer product (a symbolic row count: a column of positions times a row of
    frequencies, as a symbolic Llama's rotary angles) against numpy's matmul on fresh random inputs."""
    n = C.tirx.Var("n", "int64")
    bb = C.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, 1), F32))
    w = rng.standard_normal((1, 24)).astype(np.float32)
    with bb.function("main", [x]):
        with bb.dataflow():
            gv = bb.emit_output(op.matmul(x, relax.const(w)))
        bb.emit_func_output(gv)
    mod = bb.get()
    rewritten = _run([Peephole()], mod, host)
    assert "R.matmul" not in str(rewritten["main"]) and "R.multiply" in str(rewritten["main"])
    cm = tvmfuse.compile(mod, host)
    xs = rng.standard_normal((rows, 1)).astype(np.float32)
    (got,) = cm.run({"x": xs}).values()
    np.testing.assert_allclose(got, xs @ w, rtol=1e-6, atol=0)


# --------------------------------------------------------------------------- OutputReshapeView
def _reshape_output_module(of_param: bool):
    """``main(x)`` whose result is ``reshape(exp(x))`` (a kernel's output) or ``reshape(x)`` (the parameter),
    legalized: the reshape a call_tir bound to the dataflow block's output var."""
    relax, op = C.relax, C.relax.op
    bb = C.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 3, 1, 4), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            src = x if of_param else bb.emit(op.exp(x))
            gv = bb.emit_output(op.reshape(src, (2, 3, 4)))
        bb.emit_func_output(gv)
    return C.relax_transform.LegalizeOps()(bb.get())


def _reshape_kernels(mod) -> int:
    return sum(1 for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc) and "reshape" in gv.name_hint)


@pytest.mark.parametrize("of_param", [False, True], ids=["kernel_output", "parameter"])
def test_output_reshape_view(of_param, host):
    """A reshape of a kernel's output that is the function's result becomes a view (no reshape kernel left);
    a reshape of a parameter stays a kernel (a view would hand the caller the input's storage).  Run through
    the pipeline's reshape_view_passes; numerics through TVM's build on both."""
    from tvmfuse.pipeline import reshape_view_passes

    mod = _reshape_output_module(of_param)
    assert _reshape_kernels(mod) == 1
    out = C.Sequential(reshape_view_passes())(mod)
    assert _reshape_kernels(out) == (1 if of_param else 0), out.script()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 1, 4)).astype(np.float32)
    vm = C.VirtualMachine(C.build_vm(out, host), C.cpu())
    want = (x if of_param else np.exp(x)).reshape(2, 3, 4)
    np.testing.assert_allclose(vm["main"](C.tensor(x)).numpy(), want, rtol=1e-6)
