"""Constant folding in numpy (passes/fold.py): every row of CONSTANT_FOLDS bit-identical to TVM's FoldConstant
(which builds the call's PrimFunc with LLVM and runs it) on fresh random constants, leaving no call behind; a
call with a non-constant argument or a dtype outside its row is left alone; in the pipeline, FoldConstant
finds nothing left to build on a conv-bias-ReLU6 graph and the legalized module is the one it made alone."""
import numpy as np
import pytest

from tvmfuse import _compat as C
from tvmfuse.passes.fold import CONSTANT_FOLDS, FoldConstantsNumpy
from tvmfuse.pipeline import legalize_passes

relax = C.relax
op = relax.op
F32 = "float32"


def _main(params, body):
    """main(params...) whose dataflow block emits ``body(*params)`` and returns the last value."""
    bb = C.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            gv = bb.emit_output(body(*params))
        bb.emit_func_output(gv)
    return bb.get()


def _clean(mod, passes, host):
    with host:
        return C.Sequential(passes + [C.relax_transform.CanonicalizeBindings(),
                                      C.relax_transform.DeadCodeElimination()])(mod)


def _tvm_fold() -> list:
    return [C.relax_transform.LegalizeOps(), C.relax_transform.FoldConstant()]


def _calls(func) -> int:
    n = []
    C.post_order_visit(func, lambda e: n.append(1) if isinstance(e, C.relax.Call) else None)
    return len(n)


def _constants(func) -> list:
    """The distinct constants of ``func`` (numpy), in the order first visited (the visit repeats a node)."""
    seen = []

    def visit(e):
        if isinstance(e, C.Constant) and not C.is_prim_expr(e) and not any(e.same_as(s) for s in seen):
            seen.append(e)

    C.post_order_visit(func, visit)
    return [C.const_value(c) for c in seen]


def _with_nans(rng, shape):
    a = rng.standard_normal(shape).astype(np.float32)
    a.flat[:: 3] = np.nan
    return a


def _specials(rng, shape):
    """Random float32 with zeros, infinities and NaNs mixed in (IEEE special cases of + - * /)."""
    a = rng.standard_normal(shape).astype(np.float32)
    a.flat[1::5], a.flat[2::7], a.flat[3::11] = 0.0, np.inf, np.nan
    return a


# row name -> (constants from rng, body over the constants): the call to fold
CASES = {
    "reshape": (lambda r: [r.standard_normal((2, 3, 4)).astype(np.float32)], lambda a: op.reshape(a, (6, 4))),
    "expand_dims": (lambda r: [r.standard_normal((8,)).astype(np.float32)], lambda a: op.expand_dims(a, [0, 2])),
    "squeeze": (lambda r: [r.standard_normal((1, 8, 1)).astype(np.float32)], lambda a: op.squeeze(a, [0, 2])),
    "flatten": (lambda r: [r.standard_normal((2, 3, 4)).astype(np.float32)], lambda a: op.flatten(a)),
    "permute_dims": (lambda r: [r.standard_normal((2, 3, 4)).astype(np.float32)],
                     lambda a: op.permute_dims(a, [2, 0, 1])),
    "isnan": (lambda r: [_with_nans(r, (4, 5))], lambda a: op.isnan(a)),
    "where": (lambda r: [r.standard_normal((4, 1)) > 0, r.standard_normal((4, 5)).astype(np.float32),
                         np.asarray(r.standard_normal(), np.float32)],
              lambda c, a, b: op.where(c, a, b)),
    "add": (lambda r: [_specials(r, (4, 5)), _specials(r, (5,))], lambda a, b: op.add(a, b)),
    "subtract": (lambda r: [_specials(r, (4, 5)), _specials(r, (4, 5))], lambda a, b: op.subtract(a, b)),
    "multiply": (lambda r: [_specials(r, (4, 5)), _specials(r, (1, 5))], lambda a, b: op.multiply(a, b)),
    "divide": (lambda r: [_specials(r, (4, 5)), _specials(r, (4, 1))], lambda a, b: op.divide(a, b)),
}


def test_every_fold_row_is_tested():
    assert {r.name for r in CONSTANT_FOLDS} == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_fold_is_bit_identical_to_tvm_fold_constant(name, host, rng):
    make, body = CASES[name]
    mod = _main([], lambda: body(*(relax.const(a) for a in make(rng))))
    ours = _clean(mod, [FoldConstantsNumpy()], host)
    tvms = _clean(mod, _tvm_fold(), host)
    assert _calls(ours["main"]) == 0, ours["main"]               # folded: no call left
    assert _calls(tvms["main"]) == 0, tvms["main"]               # (TVM's fold does fold it: a real reference)
    (mine,), (ref,) = _constants(ours["main"]), _constants(tvms["main"])
    assert (mine.dtype, mine.shape) == (ref.dtype, ref.shape)
    assert mine.tobytes() == ref.tobytes()                      # bit-identical, NaNs and signed zeros included


def test_fold_keeps_a_scalar_result_scalar(host):
    """ONNX Clip's bounds: isnan and where on 0-d constants (a 0-d array once came back 1-d)."""
    mod = _main([], lambda: op.where(op.isnan(relax.const(np.float32(6.0))), relax.const(np.float32(np.inf)),
                                     relax.const(np.float32(6.0))))
    (c,) = _constants(_clean(mod, [FoldConstantsNumpy()], host)["main"])
    assert c.shape == () and c.dtype == np.float32 and c == 6.0


@pytest.mark.parametrize("name", sorted(CASES))
def test_fold_must_not_fire_on_a_non_constant_argument(name, host, rng):
    make, body = CASES[name]
    arrays = make(rng)
    x = relax.Var("x", relax.TensorType(arrays[0].shape, str(arrays[0].dtype)))
    before = _main([x], lambda x: body(x, *(relax.const(a) for a in arrays[1:])))
    C.assert_structural_equal(_clean(before, [FoldConstantsNumpy()], host), _clean(before, [], host))


@pytest.mark.parametrize("dtype,fn", [("float16", op.add), ("int32", op.divide), ("float32", op.exp)])
def test_fold_must_not_fire_outside_its_rows(dtype, fn, host, rng):
    """float16 arithmetic, integer division and ops without a row (exp: not exact in numpy) stay for
    TVM's FoldConstant."""
    a = relax.const((rng.standard_normal((3, 4)) * 10).astype(dtype))
    before = _main([], lambda: fn(a) if fn is op.exp else fn(a, a))
    after = _clean(before, [FoldConstantsNumpy()], host)
    assert _calls(after["main"]) == 1
    C.assert_structural_equal(after, _clean(before, [], host))


def _conv_bias_relu6(rng):
    """The ONNX importer's form of Conv(bias) + Clip(0, 6): the bias reshaped, each bound behind isnan/where."""
    w = relax.const(rng.standard_normal((8, 3, 3, 3)).astype(np.float32))
    b = relax.const(rng.standard_normal((8,)).astype(np.float32))
    x = relax.Var("x", relax.TensorType((1, 3, 8, 8), F32))

    def bound(v, inf):
        c = relax.const(np.float32(v))
        return op.where(op.isnan(c), relax.const(np.float32(inf)), c)

    return _main([x], lambda x: op.minimum(op.maximum(op.add(op.nn.conv2d(x, w, padding=[1, 1, 1, 1]),
                                                               op.reshape(b, (1, 8, 1, 1))),
                                                        bound(0.0, -np.inf)), bound(6.0, np.inf)))


def test_legalize_passes_leave_fold_constant_nothing_to_build(host, rng):
    mod = _conv_bias_relu6(rng)
    passes = legalize_passes(host)
    without = [p for p in passes if p.info.name != "tvmfuse.FoldConstantsNumpy"]
    assert len(without) == len(passes) - 1
    ours = _clean(mod, passes, host)
    tvms = _clean(mod, without, host)
    # FoldConstant ran after ours: had it folded a call, the call_tir on constants would be in `unfolded`
    unfolded = _clean(mod, [p for p in passes if p.info.name != "FoldConstant"], host)
    on_constants = []

    def visit(e):
        if isinstance(e, C.relax.Call) and getattr(e.op, "name", None) == "relax.call_tir":
            args = e.args[1].fields
            if all(isinstance(a, C.Constant) for a in args):
                on_constants.append(e.args[0].name_hint)

    C.post_order_visit(unfolded["main"], visit)
    assert on_constants == []
    # the same legalized module as TVM's fold alone: the same kernels, bit-identical constants
    assert _calls(ours["main"]) == _calls(tvms["main"]) == 4       # conv2d, add, maximum, minimum
    assert sorted(C.structural_hash(f) for gv, f in ours.functions.items() if gv.name_hint != "main") == \
        sorted(C.structural_hash(f) for gv, f in tvms.functions.items() if gv.name_hint != "main")
    mine, ref = _constants(ours["main"]), _constants(tvms["main"])
    assert [(a.dtype, a.shape, a.tobytes()) for a in mine] == [(a.dtype, a.shape, a.tobytes()) for a in ref]
