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
symbol (``scalar_arg``)."""
import numpy as np
import onnx
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


def test_reshape_passed_a_symbol_stays_a_view(host, rng):
    """Must not fire: a reshape that is passed the symbol stays out of every group (RewriteDataflowReshape
    makes it a free view; in a kernel it would be one more index remap), with its own refusal reason; the
    transpose before it still joins the Relu's kernel; numbers against the reference."""
    model = _unfold_model(fold_batch=True)
    d = explain(model, named_target("skx-2"))
    assert any("a reshape over symbols" in r["reason"] for r in d["refused"]), d["refused"]
    ops = [g["ops"] for g in d["groups"]]
    assert ["relu", "reshape", "transpose"] in ops and not any(o.count("reshape") > 1 for o in ops), ops
    cm = tvmfuse.compile(model, host)
    ref = ReferenceEvaluator(model)
    for batch in (1, 3):
        x = rng.standard_normal((batch, C_, H_, W_)).astype(np.float32)
        np.testing.assert_allclose(cm.run({"x": x})["y"], ref.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)
