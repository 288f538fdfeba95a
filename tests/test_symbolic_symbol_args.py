"""Ops that LegalizeOps passes a symbol as a scalar (session 9, mobilevit_dyn): a transpose of a
[batch * 128, 2, 4, 2] tensor cannot read ``batch`` off any extent of its buffers, so its PrimFunc takes
``batch`` as an argument (``call_tir(transpose, (x, batch))``).  The grouping took that argument for a tensor
of unknown shape and left every such op, and the attention and norms after it, a kernel of its own
(MobileViT's unfold/fold of patches over a symbolic batch: 219 kernels against 98 static).

Built here with onnx.helper: MobileViT's unfold, ``[batch, C, H, W] -> [batch * C * H/2, 2, W/2, 2]
-> transpose -> [batch, C, H*W/4, 4]`` (the shapes computed from Shape -> Gather -> Mul -> Concat, as the
exporter writes them) between a Relu and a SiLU.  Structure: the symbol-passing transpose is no opaque op
and the whole chain is one kernel (three before);
numbers against onnx's reference at two batch sizes; a call_tir argument that is a float scalar is no
symbol (``scalar_arg``).

Reshapes (session 10, grouping Steps 2c and 3): a reshape (also a transpose that moves unit axes only) is alone
a free view (RewriteDataflowReshape).  Between two ops of a group it fuses (one kernel, not two: swin_dyn's
window reshapes around the shifted-window mask); passed a symbol as a scalar and at the edge of a group it stays
out (a view, not an index remap by the symbol); a group of reshapes only is split back into views, static and
symbolic alike (mobilevit's one-patch stage)."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh
from onnx.reference import ReferenceEvaluator

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.explain_cli import explain
from tvmfuse.passes import rules as R

from conftest import named_target

C_, H_, W_ = 8, 8, 8


def _unfold_model(fold_batch: bool = False) -> onnx.ModelProto:
    """``fold_batch``: the last reshape keeps batch folded into the channels, ``[batch * C, H*W/4, 4]``
    (no extent of its input or output is ``batch`` alone: LegalizeOps passes the reshape the symbol too)."""
    def const(name, v):
        return nh.from_array(np.array(v, np.int64), name)

    out_shape = ["batch_c", H_ * W_ // 4, 4] if fold_batch else ["batch", C_, H_ * W_ // 4, 4]

    nodes = [
        h.make_node("Relu", ["x"], ["xr"]),
        h.make_node("Shape", ["xr"], ["s"]),
        h.make_node("Gather", ["s", "i0"], ["b"], axis=0),
        h.make_node("Gather", ["s", "i1"], ["ch"], axis=0),
        h.make_node("Mul", ["b", "ch"], ["bc"]),
        h.make_node("Mul", ["bc", "nh"], ["bcn"]),
        h.make_node("Unsqueeze", ["bcn", "ax0"], ["u"]),
        h.make_node("Concat", ["u", "two", "nw", "two"], ["shp"], axis=0),
        h.make_node("Reshape", ["xr", "shp"], ["r"]),
        h.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3]),
        h.make_node("Unsqueeze", ["bc" if fold_batch else "b", "ax0"], ["ub"]),
        h.make_node("Concat", ["ub", "patch" if fold_batch else "cpatch"], ["shp2"], axis=0),
        h.make_node("Reshape", ["t", "shp2"], ["p"]),
        h.make_node("Sigmoid", ["p"], ["sg"]),
        h.make_node("Mul", ["p", "sg"], ["y"]),
    ]
    g = h.make_graph(
        nodes, "unfold", [h.make_tensor_value_info("x", T.FLOAT, ["batch", C_, H_, W_])],
        [h.make_tensor_value_info("y", T.FLOAT, out_shape)],
        initializer=[const("i0", 0), const("i1", 1), const("nh", H_ // 2), const("ax0", [0]), const("two", [2]),
                     const("nw", [W_ // 2]), const("cpatch", [C_, H_ * W_ // 4, 4]),
                     const("patch", [H_ * W_ // 4, 4])])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def test_symbol_argument_is_no_opaque_tensor():
    """The transpose's symbol argument leaves it fusable: no refusal for an unknown shape, and the
    Relu -> reshape -> transpose -> reshape -> SiLU chain is one kernel (before: three, the transpose
    apart)."""
    target = named_target("skx-2")
    d = explain(_unfold_model(), target)
    assert not any("unknown shape or rank" in r["reason"] for r in d["refused"]), d["refused"]
    assert d["kernels_fused"] == 1, d["groups"]
    (group,) = d["groups"]
    assert group["ops"] == ["relu", "reshape", "transpose", "reshape", "sigmoid", "multiply"], group


def test_symbol_argument_matches_the_reference(host, rng):
    model = _unfold_model()
    cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 1, cm.report.after.kernel_names
    ref = ReferenceEvaluator(model)
    for batch in (1, 3):
        x = rng.standard_normal((batch, C_, H_, W_)).astype(np.float32)
        want = ref.run(None, {"x": x})[0]
        np.testing.assert_allclose(cm.run({"x": x})["y"], want, rtol=1e-5, atol=1e-6)


def test_scalar_arg():
    batch = C.tirx.Var("batch", "int64")
    assert R.scalar_arg(batch)
    assert R.scalar_arg(batch * 4)
    assert not R.scalar_arg(C.tirx.FloatImm("float32", 1.0))
    assert not R.scalar_arg(C.relax.Var("x", C.relax.TensorType((2,), "float32")))


def _explain(model, target: str, batch: int | None = None) -> dict:
    return explain(model, named_target(target), input_shapes={"batch": batch} if batch else None)


@pytest.mark.parametrize("target", ["skx-2", "neon-4"])
def test_reshape_between_two_ops_joins_their_kernel(target):
    """A reshape that is passed the symbol (``[batch * C, H*W/4, 4]``: no extent is ``batch`` alone) between
    the transpose and the SiLU fuses with both: one kernel, as the static build (batch 2) has; alone it would
    be a free view, but the ops on each side of it would be two kernels (Swin's window reshapes around the
    shifted-window mask: swin_dyn 46 kernels against 44 static before)."""
    model = _unfold_model(fold_batch=True)
    d = _explain(model, target)
    assert d["kernels_fused"] == 1 == _explain(model, target, batch=2)["kernels_fused"], d["groups"]
    (group,) = d["groups"]
    assert group["ops"] == ["relu", "reshape", "transpose", "reshape", "sigmoid", "multiply"], group


def test_reshape_between_two_ops_matches_the_reference(host, rng):
    model = _unfold_model(fold_batch=True)
    cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 1, cm.report.after.kernel_names
    ref = ReferenceEvaluator(model)
    for batch in (1, 3):
        x = rng.standard_normal((batch, C_, H_, W_)).astype(np.float32)
        np.testing.assert_allclose(cm.run({"x": x})["y"], ref.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)


def _edge_model(unit_transpose: bool = False) -> onnx.ModelProto:
    """x [batch, C, H, W] -> Relu -> the unfold reshape -> transpose -> reshape to [batch * C, H*W/4, 4] ->
    MatMul by a [4, 4] weight: the last reshape is at the edge of the Relu's group (a reshape before a
    matmul fuses with neither side).  ``unit_transpose``: MatMul [batch, 8] x [8, 8] -> reshape
    [batch, 1, 2, 4] -> transpose to [batch, 2, 1, 4] (moves a unit axis: a reshape too) -> reshape
    [batch, 8] -> MatMul: three reshapes between two matmuls."""
    def const(name, v, dtype=np.int64):
        return nh.from_array(np.array(v, dtype), name)

    w = const("w", np.linspace(-1, 1, 16).reshape(4, 4), np.float32)
    if unit_transpose:
        nodes = [h.make_node("MatMul", ["x", "w8"], ["a"]),
                 h.make_node("Reshape", ["a", "s4"], ["r"]),
                 h.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3]),
                 h.make_node("Reshape", ["t", "s2"], ["f"]),
                 h.make_node("MatMul", ["f", "w8"], ["y"])]
        inits = [const("w8", np.linspace(-1, 1, 64).reshape(8, 8), np.float32), const("s4", [-1, 1, 2, 4]),
                 const("s2", [-1, 8])]
        g = h.make_graph(nodes, "views", [h.make_tensor_value_info("x", T.FLOAT, ["batch", 8])],
                         [h.make_tensor_value_info("y", T.FLOAT, ["batch", 8])], initializer=inits)
        return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m = _unfold_model(fold_batch=True)
    g = m.graph
    keep = [n for n in g.node if n.op_type not in ("Sigmoid", "Mul") or n.output[0] in ("bc", "bcn")]
    del g.node[:]
    g.node.extend(keep + [h.make_node("MatMul", ["p", "w"], ["y"])])
    g.initializer.append(w)
    del g.output[:]
    g.output.append(h.make_tensor_value_info("y", T.FLOAT, ["batch_c", H_ * W_ // 4, 4]))
    return m


@pytest.mark.parametrize("target", ["skx-2", "neon-4"])
def test_reshape_at_the_edge_of_a_symbolic_group_stays_a_view(target):
    """Must not fire: a reshape passed the symbol at the edge of a group (between the transpose and a
    matmul, which takes no reshape before it) stays out of the group: alone a free view
    (RewriteDataflowReshape), in the kernel an index remap over the symbol that saves no kernel.  The
    static build (batch 2) keeps it in the group (a constant remap): the same kernel count."""
    model = _edge_model()
    d = _explain(model, target)
    ops = sorted(g["ops"] for g in d["groups"])
    assert ["relu", "reshape", "transpose"] in ops and not any(o.count("reshape") > 1 for o in ops), ops
    assert any("a reshape passed a symbol, at the edge of a group" in r["reason"]
               and r["producer"].startswith("transpose") and r["consumer"].startswith("reshape")
               for r in d["refused"]), d["refused"]
    static = _explain(model, target, batch=2)
    assert ["relu", "reshape", "transpose", "reshape"] in [g["ops"] for g in static["groups"]], static["groups"]
    assert d["kernels_fused"] == static["kernels_fused"] == 2


@pytest.mark.parametrize("target", ["skx-2", "neon-4"])
@pytest.mark.parametrize("batch", [None, 2])
def test_reshapes_only_stay_views(target, batch):
    """Must not fire: reshape -> transpose of a unit axis -> reshape between two matmuls (each a free view
    alone) would be one copy kernel as a group: split back into views, static (batch 2) and symbolic alike,
    the reason named; the two matmuls are the kernels (mobilevit's last stage, one patch: its static build
    had six such copy kernels, 98 against the symbolic build's 92)."""
    d = _explain(_edge_model(unit_transpose=True), target, batch=batch)
    assert d["kernels_fused"] == 2, d["groups"]
    assert not any("reshape" in g["ops"] or "transpose" in g["ops"] for g in d["groups"]), d["groups"]
    assert any("reshapes only" in r["reason"] for r in d["refused"]), d["refused"]


@pytest.mark.parametrize("unit_transpose", [False, True])
def test_edge_and_view_models_match_the_reference(host, rng, unit_transpose):
    model = _edge_model(unit_transpose)
    cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 2, cm.report.after.kernel_names
    ref = ReferenceEvaluator(model)
    for batch in (1, 3):
        shape = (batch, 8) if unit_transpose else (batch, C_, H_, W_)
        x = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_allclose(cm.run({"x": x})["y"], ref.run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)
