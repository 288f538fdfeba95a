"""ONNX's function-expanded cases (``node/test_*_expanded`` of the backend suite), rebuilt small.

ONNX expands Attention-23, LayerNormalization-17 and RMSNormalization-23 into their function bodies; those
compute reduce axes, reshape targets and head counts from ``Shape`` (Shape -> Size -> Range -> ReduceMean;
Shape -> Div / Mod -> Where -> Concat -> Expand).  TVM's importer refuses a Shape result fed to Size, Sub,
Div, Mod ("cannot handle ShapeExpr inputs"), so the suite's import goes through ``tvmfuse.conformance``,
which folds the static shape computations first, as ``tvmfuse.load_onnx`` does.  Attention's body needs two
rounds of folding: Q is reshaped by a Shape -> Concat target, and Shape is then read off the result.

Each case: the expanded graph built by onnx's own expansion helper, imported the way the suite imports,
compiled by the tvmfuse pipeline, and checked against onnx.reference on fresh random inputs.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.backend.test.case.node import function_testcase_helper
from onnx.reference import ReferenceEvaluator

from tvmfuse import _compat as C
from tvmfuse.frontend import fold_static_shapes, fold_static_shapes_fully
from tvmfuse.passes.legalize import CUSTOM_LEGALIZE

F32 = TensorProto.FLOAT


def _vi(name, shape, dtype=F32):
    return helper.make_tensor_value_info(name, dtype, shape)


def _expanded(node, inputs, outputs, opset):
    """The model ONNX's backend suite builds for ``<case>_expanded``: ``node`` replaced by its function body."""
    tests, _ = function_testcase_helper(node, [vi.type for vi in inputs], "t",
                                        opset_imports=[helper.make_opsetid("", opset)])
    nodes, fn_opsets = tests[-1]
    opsets = {o.domain: o.version for o in fn_opsets}
    opsets[""] = max(opsets.get("", 0), opset)
    graph = helper.make_graph(nodes, "expanded", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    onnx.checker.check_model(model)
    return model


def _feeds(model, rng):
    feeds = {}
    for vi in model.graph.input:
        dims = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        feeds[vi.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


@pytest.fixture
def suite_from_onnx(monkeypatch):
    """``tvm.relax.frontend.onnx.from_onnx`` as the conformance suite calls it with tvmfuse's hook loaded
    (the package name is restored to TVM's own after the test)."""
    pkg = C.onnx_package()
    monkeypatch.setattr(pkg, "from_onnx", C.onnx_frontend().from_onnx)
    from tvmfuse import conformance

    conformance.install_import_folding()
    return pkg.from_onnx


def _run_like_suite(from_onnx, model, feeds, host):
    mod = from_onnx(model, keep_params_in_input=False)
    vm = C.VirtualMachine(C.compile_module(mod, host, "tvmfuse"), C.cpu())
    names = [vi.name for vi in model.graph.input]
    out = vm["main"](*[C.tensor(feeds[n]) for n in names])
    outs = [out] if len(model.graph.output) == 1 else list(out)
    return [o.numpy() for o in outs]


def _check(from_onnx, model, host, rng, rtol=1e-4, atol=1e-5):
    feeds = _feeds(model, rng)
    got = _run_like_suite(from_onnx, model, feeds, host)
    want = ReferenceEvaluator(model).run(None, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def _layer_norm(axis, shape):
    node = helper.make_node("LayerNormalization", ["X", "W", "B"], ["Y", "Mean", "InvStdDev"], axis=axis,
                            epsilon=1e-3)
    a = axis % len(shape)
    stat = shape[:a] + [1] * (len(shape) - a)
    return _expanded(node, [_vi("X", shape), _vi("W", shape[a:]), _vi("B", shape[a:])],
                     [_vi("Y", shape), _vi("Mean", stat), _vi("InvStdDev", stat)], 17)


def _rms_norm(axis, shape):
    node = helper.make_node("RMSNormalization", ["X", "W"], ["Y"], axis=axis, epsilon=1e-4)
    a = axis % len(shape)
    return _expanded(node, [_vi("X", shape), _vi("W", shape[a:])], [_vi("Y", shape)], 23)


def _attention_3d(q_heads, kv_heads, causal):
    b, sq, skv, d = 2, 3, 5, 4
    node = helper.make_node("Attention", ["Q", "K", "V"], ["Y"], q_num_heads=q_heads, kv_num_heads=kv_heads,
                            is_causal=int(causal))
    return _expanded(node, [_vi("Q", [b, sq, q_heads * d]), _vi("K", [b, skv, kv_heads * d]),
                            _vi("V", [b, skv, kv_heads * d])], [_vi("Y", [b, sq, q_heads * d])], 23)


def _attention_4d_mask(heads):
    b, sq, skv, d = 2, 4, 6, 8
    node = helper.make_node("Attention", ["Q", "K", "V", "M"], ["Y"])
    return _expanded(node, [_vi("Q", [b, heads, sq, d]), _vi("K", [b, heads, skv, d]),
                            _vi("V", [b, heads, skv, d]), _vi("M", [sq, skv])], [_vi("Y", [b, heads, sq, d])], 23)


CASES = {
    # axis -1 and a middle axis: the body reads the rank off Shape (Size) and the kept dims off Slice
    "layer_norm_3d_axis_last": lambda: _layer_norm(-1, [2, 3, 8]),
    "layer_norm_4d_axis1": lambda: _layer_norm(1, [2, 3, 4, 5]),
    # Range(axis, Size(Shape(X))) gives ReduceMean its axes
    "rms_norm_3d_axis_last": lambda: _rms_norm(-1, [2, 3, 8]),
    "rms_norm_4d_axis_neg3": lambda: _rms_norm(-3, [2, 3, 4, 5]),
    # 3-D inputs split into heads by q_num_heads / kv_num_heads; grouped-query (6 query heads on 2) + causal
    "attention_3d": lambda: _attention_3d(3, 3, False),
    "attention_3d_gqa_causal": lambda: _attention_3d(6, 2, True),
    "attention_4d_additive_mask": lambda: _attention_4d_mask(2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_expanded_case_matches_reference(case, suite_from_onnx, host, rng):
    _check(suite_from_onnx, CASES[case](), host, rng)


@pytest.mark.parametrize("case", ["layer_norm_4d_axis1", "rms_norm_3d_axis_last", "attention_3d_gqa_causal"])
def test_tvm_importer_alone_refuses_expanded_case(case):
    """Why the folding is there: TVM's importer without it stops at the first Shape result it cannot take."""
    with pytest.raises(ValueError, match="cannot handle ShapeExpr inputs"):
        C.onnx_frontend().from_onnx(CASES[case](), keep_params_in_input=False)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fold_leaves_no_shape_computation(case):
    """Structure: after folding, no Shape/Size node and nothing computed from one is left, only the math."""
    model = CASES[case]()
    assert not {node.op_type for node in model.graph.node} & {"Attention", "LayerNormalization",
                                                              "RMSNormalization"}   # the expanded body
    folded, n = fold_static_shapes_fully(model)
    assert n > 0
    left = {node.op_type for node in folded.graph.node}
    assert not left & {"Shape", "Size", "Range", "ConstantOfShape", "Mod"}, left
    # the folded graph is a valid model with the same inputs and outputs
    onnx.checker.check_model(folded)
    assert [i.name for i in folded.graph.input] == [i.name for i in model.graph.input]
    assert [o.name for o in folded.graph.output] == [o.name for o in model.graph.output]


def test_attention_needs_a_second_fold_round():
    """One round leaves Shape of the head-split Q (its reshape target was folded in that round)."""
    model = CASES["attention_3d"]()
    once, _ = fold_static_shapes(model)
    assert "Shape" in {node.op_type for node in once.graph.node}
    fully, _ = fold_static_shapes_fully(model)
    assert "Shape" not in {node.op_type for node in fully.graph.node}
    one_round, _ = fold_static_shapes_fully(model, max_rounds=1)
    assert [n.op_type for n in one_round.graph.node] == [n.op_type for n in once.graph.node]


def test_fold_rounds_must_be_positive():
    with pytest.raises(ValueError, match="max_rounds must be >= 1"):
        fold_static_shapes_fully(CASES["rms_norm_3d_axis_last"](), max_rounds=0)


def test_install_import_folding_is_idempotent(suite_from_onnx):
    from tvmfuse import conformance

    conformance.install_import_folding()
    pkg = C.onnx_package()
    assert pkg.from_onnx is suite_from_onnx
    assert pkg.from_onnx.__wrapped__ is C.onnx_frontend().from_onnx


# --------------------------------------------------------------------------- ReduceMax / ReduceMin extrema
# ONNX: a reduction over values that are all -inf (ReduceMax) / +inf (ReduceMin) is that infinity; TOPI's
# reductions start from the lowest / highest finite value, tvmfuse's legalization (passes/legalize.py) from
# the infinity.  ONNX's expanded Attention finds its fully masked rows by ReduceMax(bias) == -inf
# (node/test_attention_*fullymasked*_expanded).
def _reduce_model(op, shape, axes, keepdims, opset, dtype=F32):
    inputs, extra = [_vi("x", shape, dtype)], []
    kw = {"keepdims": keepdims}
    if opset >= 18:
        extra = [helper.make_tensor("axes", TensorProto.INT64, [len(axes)], axes)]
        node = helper.make_node(op, ["x", "axes"], ["y"], **kw)
    else:
        node = helper.make_node(op, ["x"], ["y"], axes=axes, **kw)
    graph = helper.make_graph([node], "reduce", inputs, [helper.make_tensor_value_info("y", dtype, None)],
                              initializer=extra)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _rows_with_infinities(rng, sign, shape=(4, 3, 5)):
    x = rng.standard_normal(shape).astype(np.float32)
    lowest = np.finfo(np.float32).min if sign < 0 else np.finfo(np.float32).max
    x[0] = sign * np.inf                       # every row of x[0] is all -inf / +inf
    x[1, 0] = sign * np.inf                    # one row all infinite, the others finite
    x[2, 1, :] = sign * np.inf                 # a row of infinities with one value exactly the finite extreme
    x[2, 1, 3] = lowest
    x[3, 2, 1] = sign * np.inf                 # one infinite value in a finite row
    x[:, 0, 0] = sign * np.inf                 # a column (over axis 0) all infinite
    return x


@pytest.mark.parametrize("op,sign", [("ReduceMax", -1), ("ReduceMin", 1)])
@pytest.mark.parametrize("opset,axes,keepdims", [(13, [-1], 1), (18, [1, 2], 0), (18, [0], 1)])
def test_reduce_extremum_of_infinite_rows_matches_reference(op, sign, opset, axes, keepdims, host, rng):
    import tvmfuse

    model = _reduce_model(op, [4, 3, 5], axes, keepdims, opset)
    cm = tvmfuse.compile(model, host)
    x = _rows_with_infinities(rng, sign)
    got = cm.run({"x": x})["y"]
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)
    assert np.isinf(want).any()        # the case is exercised


def test_reduce_extremum_is_one_reduction_from_infinity(host):
    """Structure: a float ReduceMax/ReduceMin stays one kernel, its reduction initialised to -inf/+inf;
    an integer one keeps TOPI's finite start."""
    import tvmfuse

    for op, init in (("ReduceMax", "-inf"), ("ReduceMin", "inf")):
        cm = tvmfuse.compile(_reduce_model(op, [4, 5], [1], 1, 13), host)
        assert cm.kernel_count == 1
        mod = C.relax_transform.LegalizeOps(customize_legalize_map=dict(CUSTOM_LEGALIZE))(
            tvmfuse.load_onnx(_reduce_model(op, [4, 5], [1], 1, 13)))
        funcs = [f.script() for f in mod.functions.values() if isinstance(f, C.PrimFunc)]
        assert len(funcs) == 1 and f'T.float32("{init}")' in funcs[0], funcs
        mod = C.relax_transform.LegalizeOps(customize_legalize_map=dict(CUSTOM_LEGALIZE))(
            tvmfuse.load_onnx(_reduce_model(op, [4, 5], [1], 1, 13, TensorProto.INT32)))
        funcs = [f.script() for f in mod.functions.values() if isinstance(f, C.PrimFunc)]
        assert len(funcs) == 1 and "inf" not in funcs[0], funcs


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # onnx.reference, masked row
def test_expanded_attention_fully_masked_row_is_zero(suite_from_onnx, host, rng):
    """node/test_attention_*fullymasked*_expanded, rebuilt: a boolean mask with a row all False gives 0
    there (the body's ReduceMax(bias) == -inf test), the other rows softmax as usual."""
    b, h, sq, skv, d = 1, 2, 3, 6, 4
    node = helper.make_node("Attention", ["Q", "K", "V", "M"], ["Y"])
    model = _expanded(node, [_vi("Q", [b, h, sq, d]), _vi("K", [b, h, skv, d]), _vi("V", [b, h, skv, d]),
                             _vi("M", [sq, skv], TensorProto.BOOL)], [_vi("Y", [b, h, sq, d])], 23)
    feeds = {n: rng.standard_normal(s).astype(np.float32)
             for n, s in (("Q", [b, h, sq, d]), ("K", [b, h, skv, d]), ("V", [b, h, skv, d]))}
    mask = rng.random((sq, skv)) > 0.3
    mask[0] = False
    mask[1:, 0] = True
    feeds["M"] = mask
    got = _run_like_suite(suite_from_onnx, model, feeds, host)[0]
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[:, :, 0], 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_fold_keeps_initializers_listed_as_graph_inputs():
    """IR version 3 lists every weight among the graph inputs (pytorch-converted/test_Linear_no_bias):
    folding Transpose(weight) must keep the weight's initializer, or the weight becomes an input to feed."""
    x = _vi("x", [2, 3])
    w = helper.make_tensor("w", F32, [4, 3], np.arange(12, dtype=np.float32).tolist())
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "wt"], ["y"])]
    graph = helper.make_graph(nodes, "linear", [x, _vi("w", [4, 3])], [_vi("y", [2, 4])], initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], ir_version=3)
    folded, n = fold_static_shapes_fully(model)
    assert n == 1 and [node.op_type for node in folded.graph.node] == ["MatMul"]
    assert "w" in {t.name for t in folded.graph.initializer}
    mod = C.onnx_frontend().from_onnx(folded, keep_params_in_input=False)
    assert len(mod["main"].params) == 1          # only x: w is still a weight


def test_infinite_extremum_identity_is_cpu_only():
    """The -inf / +inf identity of float max / min is a CPU legalization: CUDA targets keep TOPI's (its
    cross-thread reduction of the custom reducer failed GPU code verification of cuda_row_reduction)."""
    from tvmfuse.passes.legalize import custom_legalize
    from tvmfuse.target import parse_target

    cpu = custom_legalize(parse_target("llvm -mcpu=haswell"))
    gpu = custom_legalize(parse_target("cuda -arch=sm_80"))
    assert {"relax.max", "relax.min", "relax.reshape"} <= set(cpu)
    assert "relax.reshape" in gpu and not {"relax.max", "relax.min"} & set(gpu)
