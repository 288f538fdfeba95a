"""Conformance cases the merged pipeline once broke (ONNX backend suite), rebuilt small with onnx.helper.

- Range with a run-time length: the length is computed, turned into a shape by match_cast, and arange's
  consumers read it; grouping put both into one kernel that FuseTIR could not order (call_tir without a shape).
- DynamicQuantizeLinear: round(x / scale) with the division made a reciprocal multiply (fast math) flips a
  rounded value by one; stores that round or become integers keep an exact division.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import tvmfuse


def _scalar(name):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [])


def test_range_with_runtime_length_compiles_and_matches(host):
    node = helper.make_node("Range", ["start", "limit", "delta"], ["y"])
    graph = helper.make_graph([node], "range", [_scalar("start"), _scalar("limit"), _scalar("delta")],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    cm = tvmfuse.compile(model, host)
    # the ops over the run-time extent keep their own kernel, with the reason recorded
    assert any("defined at run time by a match_cast" in r["reason"] for r in cm.report.refused), cm.report.refused
    for start, limit, delta in [(1.0, 5.0, 0.5), (3.0, -7.0, -1.5), (0.0, 2.0, 3.0)]:
        feeds = {"start": np.float32(start), "limit": np.float32(limit), "delta": np.float32(delta)}
        got = cm.run({k: np.asarray(v) for k, v in feeds.items()})["y"]
        want = ReferenceEvaluator(model).run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_dynamic_quantize_linear_rounds_exactly(host, rng):
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "scale", "zp"])
    graph = helper.make_graph([node], "dql", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [257])],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, [257]),
                               helper.make_tensor_value_info("scale", TensorProto.FLOAT, []),
                               helper.make_tensor_value_info("zp", TensorProto.UINT8, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    cm = tvmfuse.compile(model, host)
    ref = ReferenceEvaluator(model)
    for _ in range(5):
        x = (rng.standard_normal(257) * rng.uniform(0.1, 10)).astype(np.float32)
        got = cm.run({"x": x})
        want = ref.run(None, {"x": x})
        np.testing.assert_array_equal(got["y"], want[0])
        np.testing.assert_array_equal(got["zp"], want[2])
        # scale = (max - min) / 255: the x / c -> x * (1/c) peephole leaves it within 1 ulp
        np.testing.assert_allclose(got["scale"], want[1], rtol=2.5e-7)
