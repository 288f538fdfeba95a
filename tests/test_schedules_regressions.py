"""Kernels the ONNX conformance gate caught miscompiled or failing in the CPU schedules stage.

Each case is the conformance test's graph rebuilt small, compiled by the full default pipeline and
compared with onnx's ReferenceEvaluator (exact for integers).
"""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import tvmfuse
from tvmfuse import models as M

F, I8, I64 = TensorProto.FLOAT, TensorProto.INT8, TensorProto.INT64


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "regression", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                          [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs], list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    return m


CASES = {
    # a reduction with a small row count: the row loop (holding the chain) must not be vectorized
    "mean_of_three": _model([helper.make_node("Mean", ["a", "b", "c"], ["y"])],
                            [("a", F, [3]), ("b", F, [3]), ("c", F, [3])], [("y", F, [3])]),
    "global_average_pool": _model([helper.make_node("GlobalAveragePool", ["x"], ["y"])],
                                  [("x", F, [1, 3, 5, 5])], [("y", F, [1, 3, 1, 1])]),
    "argmax_keepdims": _model([helper.make_node("ArgMax", ["x"], ["y"], axis=1, keepdims=1)],
                              [("x", F, [2, 2])], [("y", I64, [2, 1])]),
    # no vector lowering for cosh/sinh in TVM's LLVM backend
    "cosh": _model([helper.make_node("Cosh", ["x"], ["y"])], [("x", F, [4, 8])], [("y", F, [4, 8])]),
    "sinh": _model([helper.make_node("Sinh", ["x"], ["y"])], [("x", F, [4, 8])], [("y", F, [4, 8])]),
    # vector shifts by >= the bit width differ from the scalar ones
    "bitshift_int8": _model([helper.make_node("BitShift", ["x", "s"], ["y"], direction="LEFT")],
                            [("x", I8, [32]), ("s", I8, [32])], [("y", I8, [32])]),
}


def _feeds(model, rng):
    feeds = {}
    for vi in model.graph.input:
        t = vi.type.tensor_type
        shape = [d.dim_value for d in t.shape.dim]
        if t.elem_type == I8:
            feeds[vi.name] = rng.integers(0, 12 if vi.name == "s" else 16, size=shape).astype(np.int8)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


@pytest.mark.parametrize("name", sorted(CASES))
def test_conformance_regression(name, rng):
    model = CASES[name]
    onnx.checker.check_model(model)
    cm = tvmfuse.compile(model)
    feeds = _feeds(model, rng)
    ref = M.reference_outputs(model, feeds)
    out = cm.run(feeds)
    for k, r in ref.items():
        if name == "bitshift_int8":
            # a shift by >= the bit width is undefined in LLVM (even stock TVM's loop, auto-vectorized
            # by LLVM, gives other values than numpy's 0 at this length): compare the defined shifts.
            # The conformance case (3 elements) is kept passing by not scheduling shifts at all.
            ok = feeds["s"] < 8
            np.testing.assert_array_equal(out[k][ok], r[ok])
            # no template takes it; the generic schedule leaves the shift's loops as they are
            sched = cm.report.schedules[0]
            assert sched["template"] == "cpu.generic", sched
            assert all("integer shift" in b.get("skipped", "") for b in sched["knobs"]["blocks"]), sched
        elif np.issubdtype(r.dtype, np.integer):
            np.testing.assert_array_equal(out[k], r)
        else:
            np.testing.assert_allclose(out[k], r, rtol=1e-5, atol=1e-5)
