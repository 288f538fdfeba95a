"""Pads computed from shapes (torchvision's Swin Transformer pads each block's NHWC input to a multiple of
its window: ``pad = (window - W % window) % window`` from ``Shape -> Gather``), which TVM's ONNX importer
refuses unless the pads are constants ("Dynamic pads are not supported yet").

Two cases the corpus's ``swin`` hit (benchmarks/notes/corpus8.md): a second Pad whose pads come from the
shape of the first Pad's output (ONNX shape inference only knows that shape once the first pads are folded:
``load_onnx`` folds to a fixed point), and a symbolic batch (the Shape is not static, the H and W it
gives to the pads are: ``Gather`` of static dims folds).  The ONNX graphs are built with onnx.helper.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmfuse
from conftest import named_target
from tvmfuse.errors import ModelLoadError
from tvmfuse.frontend import fold_static_shapes, fold_static_shapes_fully

H, W, CH = 5, 6, 8
WINDOWS = (4, 3)      # the first Pad pads H and W to a multiple of 4 (8, 8), the second to one of 3 (9, 9)


def _i64(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _window_pad(prefix: str, x: str, window: int, out: str) -> tuple[list, list]:
    """Pad NHWC ``x`` at the bottom/right of H and W to a multiple of ``window``, the pads computed from
    ``Shape(x)`` as torchvision's ``_shifted_window_attention`` exports them."""
    p = prefix
    nodes = [helper.make_node("Shape", [x], [f"{p}shape"])]
    pads = []
    for axis in (1, 2):
        nodes += [
            helper.make_node("Gather", [f"{p}shape", f"{p}axis{axis}"], [f"{p}d{axis}"], axis=0),
            helper.make_node("Mod", [f"{p}d{axis}", f"{p}win"], [f"{p}m{axis}"]),
            helper.make_node("Sub", [f"{p}win", f"{p}m{axis}"], [f"{p}s{axis}"]),
            helper.make_node("Mod", [f"{p}s{axis}", f"{p}win"], [f"{p}pad{axis}"]),
            helper.make_node("Unsqueeze", [f"{p}pad{axis}", f"{p}zero_axis"], [f"{p}u{axis}"]),
        ]
        pads.append(f"{p}u{axis}")
    # [n_begin, h_begin, w_begin, c_begin, n_end, h_end, w_end, c_end]
    nodes += [helper.make_node("Concat", [f"{p}zeros4", f"{p}zero1", pads[0], pads[1], f"{p}zero1"], [f"{p}pads"], axis=0),
              helper.make_node("Pad", [x, f"{p}pads"], [out])]
    inits = [_i64(f"{p}axis1", 1), _i64(f"{p}axis2", 2), _i64(f"{p}win", window), _i64(f"{p}zero_axis", [0]),
             _i64(f"{p}zeros4", [0, 0, 0, 0]), _i64(f"{p}zero1", [0])]
    return nodes, inits


def _model(batch) -> onnx.ModelProto:
    """x [batch, H, W, C] -> window pad (4) -> Relu -> window pad (3) -> * 2: the second pads read the shape
    of the first Pad's output."""
    n1, i1 = _window_pad("a_", "x", WINDOWS[0], "p1")
    n2, i2 = _window_pad("b_", "r", WINDOWS[1], "p2")
    nodes = n1 + [helper.make_node("Relu", ["p1"], ["r"])] + n2 + [helper.make_node("Mul", ["p2", "two"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, H, W, CH])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 9, 9, CH])
    g = helper.make_graph(nodes, "window_pads", [x], [y],
                          i1 + i2 + [numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def _expected(x: np.ndarray) -> np.ndarray:
    def pad(a, w):
        return np.pad(a, [(0, 0), (0, (w - a.shape[1] % w) % w), (0, (w - a.shape[2] % w) % w), (0, 0)])
    return pad(np.maximum(pad(x, WINDOWS[0]), 0), WINDOWS[1]) * 2


def _pads_inputs(model: onnx.ModelProto) -> dict[str, np.ndarray | None]:
    """Per Pad node: its pads as a constant, None where they are still computed."""
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    return {n.output[0]: inits.get(n.input[1]) for n in model.graph.node if n.op_type == "Pad"}


@pytest.mark.parametrize("batch", [2, "batch"], ids=["static", "symbolic"])
def test_every_window_pad_becomes_a_constant(batch):
    """Structure: after folding, both Pads' pads are constants (what TVM's importer needs); one round is not
    enough for the second (its input's shape is unknown until the first pads fold)."""
    model = _model(batch)
    once, _ = fold_static_shapes(model)
    assert _pads_inputs(once)["p2"] is None
    folded, _ = fold_static_shapes_fully(model, max_rounds=None)
    pads = _pads_inputs(folded)
    assert pads["p1"].tolist() == [0, 0, 0, 0, 0, 3, 2, 0]       # 5 -> 8, 6 -> 8
    assert pads["p2"].tolist() == [0, 0, 0, 0, 0, 1, 1, 0]       # 8 -> 9, 8 -> 9
    # nothing of the shape arithmetic is left but, with a symbolic batch, the Shape nodes nothing reads
    assert {n.op_type for n in folded.graph.node} - {"Shape"} == {"Pad", "Relu", "Mul"}


def test_unbounded_fixed_point_refuses_a_bad_round_count():
    with pytest.raises(ValueError, match="max_rounds must be >= 1 or None, got 0"):
        fold_static_shapes_fully(_model(2), max_rounds=0)


@pytest.mark.parametrize("batch", [2, "batch"], ids=["static", "symbolic"])
def test_window_pads_import_and_fuse(batch):
    """The module imports (it raised ModelLoadError "Dynamic pads are not supported yet" before) and the
    pads, relu and scale are one kernel on a named target."""
    model = _model(batch)
    cm = tvmfuse.compile(model, named_target("haswell-2"))
    assert cm.kernel_count == 1, [s.get("kernel") for s in cm.report.schedules]
    # without the fold, TVM's importer still refuses it (with a symbolic shape in the pads, or "Dynamic pads")
    with pytest.raises(ModelLoadError, match="TVM.s ONNX importer failed"):
        tvmfuse.load_onnx(model, fold_shapes=False)


@pytest.mark.parametrize("batch, run_batch", [(2, 2), ("batch", 3)], ids=["static", "symbolic"])
def test_window_pads_match_numpy(batch, run_batch, rng):
    cm = tvmfuse.compile(_model(batch))
    x = rng.standard_normal((run_batch, H, W, CH)).astype(np.float32)
    got = cm.run({"x": x})["y"]
    assert got.shape == (run_batch, 9, 9, CH)
    np.testing.assert_allclose(got, _expected(x), rtol=1e-6, atol=1e-6)
