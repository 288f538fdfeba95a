"""BLOOM's ALiBi bias over a symbolic batch (corpus ``bloom_dyn``, benchmarks/notes/corpus10.md): TVM's ONNX
importer failed twice on it.  ``Expand`` of data with a symbolic dim to a constant shape read ``dim.value``
of every data dim ("'Var' object has no attribute 'value'": ``frontend.SymbolicDataExpand``), and a ``Tile``
whose repeats are ``Concat(batch, 1, 1)`` is refused before conversion ("cannot handle ShapeExpr inputs":
``frontend.tile_leading_repeats`` rewrites it as Unsqueeze -> Expand -> Reshape).

Graphs built with onnx.helper as the exporter writes them (Shape -> Gather -> Unsqueeze -> Concat repeats);
numerics against onnxruntime at batch 1 and 3; the rewrite leaves Tiles it does not cover alone.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.frontend import expand_shape, tile_leading_repeats

HEADS, SEQ = 4, 5


def _i64(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _model(nodes, inits, inputs, out_shape) -> onnx.ModelProto:
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)
    g = helper.make_graph(nodes, "alibi", inputs, [y], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def alibi_tile(other_reps=(1, 1)) -> onnx.ModelProto:
    """slopes [HEADS, 1, SEQ] tiled by Concat(batch, *other_reps) -> [batch * HEADS, 1, SEQ], plus x's rows
    (x [batch, SEQ], as BLOOM adds the bias to the scores)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
        helper.make_node("Unsqueeze", ["batch", "axes0"], ["batch1"]),
        helper.make_node("Concat", ["batch1", "r1", "r2"], ["reps"], axis=0),
        helper.make_node("Tile", ["slopes", "reps"], ["tiled"]),
        helper.make_node("Unsqueeze", ["x", "axes1"], ["x3"]),                       # [batch, 1, SEQ]
        helper.make_node("Tile", ["x3", "heads_reps"], ["xt"]),                      # constant repeats
        helper.make_node("Reshape", ["xt", "flat"], ["xf"]),                          # [batch * HEADS, 1, SEQ]
        helper.make_node("Add", ["tiled", "xf"], ["y"]),
    ]
    rng = np.random.default_rng(7)
    inits = [numpy_helper.from_array(rng.standard_normal((HEADS, 1, SEQ)).astype(np.float32), "slopes"),
             _i64("zero", 0), _i64("axes0", [0]), _i64("axes1", [1]), _i64("r1", [other_reps[0]]),
             _i64("r2", [other_reps[1]]), _i64("heads_reps", [1, HEADS, 1]), _i64("flat", [-1, 1, SEQ])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", SEQ])
    return _model(nodes, inits, [x], ["n", 1, SEQ])


def expand_symbolic() -> onnx.ModelProto:
    """x [batch, 1, SEQ] expanded to the constant shape [1, HEADS, 1] -> [batch, HEADS, SEQ], times 2."""
    nodes = [helper.make_node("Expand", ["x", "shape"], ["e"]), helper.make_node("Mul", ["e", "two"], ["y"])]
    inits = [_i64("shape", [1, HEADS, 1]), numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, SEQ])
    return _model(nodes, inits, [x], ["batch", HEADS, SEQ])


def _ort(model, feeds):
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.parametrize("build,shape", [(alibi_tile, lambda b: (b, SEQ)), (expand_symbolic, lambda b: (b, 1, SEQ))],
                         ids=["tile", "expand"])
def test_symbolic_batch_imports_and_matches_onnxruntime(build, shape, host, rng):
    model = build()
    cm = tvmfuse.compile(model, host)
    for b in (1, 3):
        x = rng.standard_normal(shape(b)).astype(np.float32)
        np.testing.assert_allclose(cm.run({"x": x})["y"], _ort(model, {"x": x}), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("build", [alibi_tile, expand_symbolic], ids=["tile", "expand"])
def test_tvm_importer_alone_fails_on_these_graphs(build):
    """The regression the converters fix: TVM's importer without tvmfuse's converters and rewrite."""
    with pytest.raises(Exception, match="ShapeExpr|has no attribute 'value'"):
        C.from_onnx(build())


def test_rewrite_covers_a_leading_run_time_repeat_only():
    rewritten, n = tile_leading_repeats(alibi_tile())
    assert n == 1                                           # the constant-repeats Tile stays a Tile
    assert [x.op_type for x in rewritten.graph.node].count("Tile") == 1
    _, n_other = tile_leading_repeats(alibi_tile(other_reps=(2, 1)))
    assert n_other == 0                                     # a repeat other than 1 on another axis


def test_expand_shape_broadcasts_and_names_a_mismatch():
    batch = C.tirx.Var("batch", "int64")
    got = expand_shape([batch, C.IntImm("int64", 1), C.IntImm("int64", SEQ)], [1, HEADS, -1])
    assert got[0].same_as(batch) and [int(d) for d in got[1:]] == [HEADS, SEQ]
    wide = expand_shape([batch], [2, 3, 1])
    assert [int(d) for d in wide[:2]] == [2, 3] and wide[2].same_as(batch)
    with pytest.raises(ValueError, match=r"axis 1: 5 vs 4"):
        expand_shape([batch, C.IntImm("int64", 5)], [1, 4])
