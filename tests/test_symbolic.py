"""Symbolic dims (ONNX dim_param: ``batch``, ``sequence``) fuse like static ones (issue 13): legality by
symbolic equality of the extents, the same groups and kernel count as the static model, and numbers equal
to the unfused reference at several sizes the symbols allow."""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.explain_cli import explain
from tvmfuse.passes import rules as R
from tvmfuse.pipeline import PipelineOptions, legalize_passes, pre_legalize_passes


def _mlp(batch="batch"):
    g = M._G("mlp_dyn")
    x = g.input("x", (batch, 64))
    g.op("Relu", g.op("Add", g.op("MatMul", x, g.weight((64, 32))), g.weight((32,), 0.1)))
    g.rename_last("y", (batch, 32))
    return g.model()


def _check(model, cm, rng, shapes, rtol=1e-4, atol=1e-4):
    feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    out, ref = cm.run(feeds), M.reference_outputs(model, feeds)
    for name, r in ref.items():
        assert out[name].shape == r.shape
        np.testing.assert_allclose(out[name], r, rtol=rtol, atol=atol, err_msg=f"{name} at {shapes}")


def _groups(d):
    return sorted((tuple(g["ops"]), g["rule"]) for g in d["groups"])


# ----------------------------------------------------------------------------------- the graph
def test_matmul_add_relu_with_symbolic_batch_is_one_kernel(host, rng):
    model = _mlp()
    cm = tvmfuse.compile(model, target=host)
    assert cm.kernel_count == 1 and cm.report.kernels_before == 3
    assert [g["rule"] for g in cm.report.groups] == ["contraction_epilogue+elementwise_chain"]
    assert not any("symbolic" in r["reason"] for r in cm.report.refused)
    assert cm.inputs[0].shape == ("batch", 64) and cm.outputs[0].shape == ("batch", 32)
    # the fused kernel is one symbolic PrimFunc: its buffers are sized by the batch var
    fused = [f for gv, f in cm.fused_module.functions.items()
             if isinstance(f, C.PrimFunc) and str(gv.name_hint).startswith("fused_")]
    assert len(fused) == 1
    assert any(not isinstance(d, C.IntImm) for p in fused[0].params for d in p.shape)
    for batch in (1, 3, 8):
        _check(model, cm, rng, {"x": (batch, 64)})


# ----------------------------------------------------------------------------------- same groups as static
@pytest.mark.parametrize("name, static, symbolic", [
    ("transformer_block", lambda: M.transformer_block(seq=16, hidden=64, heads=4, ffn=128),
     lambda: M.transformer_block(seq="sequence", hidden=64, heads=4, ffn=128)),
    ("resnet_block", lambda: M.resnet_block(channels=8, size=8, batch=2),
     lambda: M.resnet_block(channels=8, size=8, batch="batch")),
    ("layernorm_softmax", lambda: M.layernorm_softmax(rows=16, d=32), None),
    ("qkv_projection", lambda: M.qkv_projection(seq=16, hidden=32), None),
])
def test_symbolic_model_gets_the_static_groups(name, static, symbolic, host):
    sym_model = symbolic() if symbolic else _make_symbolic(static(), axis=0, dim="rows")
    d_static, d_sym = explain(static(), target=host), explain(sym_model, target=host)
    assert d_sym["kernels_fused"] == d_static["kernels_fused"] < d_sym["kernels_unfused"]
    assert _groups(d_sym) == _groups(d_static)


def _make_symbolic(model, axis: int, dim: str):
    """The model with ``axis`` of every graph input and output made the symbolic dim ``dim``."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    for vi in list(out.graph.input) + list(out.graph.output):
        d = vi.type.tensor_type.shape.dim[axis]
        d.Clear()
        d.dim_param = dim
    del out.graph.value_info[:]
    return out


@pytest.mark.parametrize("seqs", [(5, 16)])
def test_symbolic_transformer_block_runs_at_any_length(seqs, host, rng):
    model = M.transformer_block(seq="sequence", hidden=64, heads=4, ffn=128)
    cm = tvmfuse.compile(model, target=host)
    for s in seqs:
        _check(model, cm, rng, {"x": (s, 64)})


def test_symbolic_resnet_block_runs_at_any_batch(host, rng):
    model = M.resnet_block(channels=8, size=8, batch="batch")
    cm = tvmfuse.compile(model, target=host)
    assert cm.kernel_count == 2   # conv+bn+relu, conv+bn+add+relu: batch norm folded as in the static build
    for b in (1, 3):
        _check(model, cm, rng, {"x": (b, 8, 8, 8)})


# ----------------------------------------------------------------------------------- legality pieces
def test_same_shape_is_symbolic_equality():
    n, m = C.tir.Var("n", "int64"), C.tir.Var("m", "int64")
    assert R.same_shape((n, 64), (n, 64))
    assert R.same_shape((n * 2, 64), (2 * n, 64))
    assert not R.same_shape((n, 64), (m, 64))        # unproven: different symbols
    assert not R.same_shape((n, 64), (n, 32))
    assert not R.same_shape((n, 64), (n, 64, 1))
    assert not R.same_shape((n,), None)
    assert R.is_symbolic((3, (n, 2))) and not R.is_symbolic((3, (4, 2)))


def test_sibling_matmuls_with_symbolic_rows_fuse(host):
    # two matmuls of x: [a, 16] with outputs [a, 8]: output shapes proven equal, one kernel
    g = M._G("sib")
    x = g.input("x", ("a", 16))
    g.op("MatMul", x, g.weight((16, 8)))
    g.rename_last("p", ("a", 8))
    g.op("MatMul", x, g.weight((16, 8)))
    g.rename_last("q", ("a", 8))
    d = explain(g.model(), target=host)
    assert [grp["rule"] for grp in d["groups"]] == ["sibling_contractions"] and d["kernels_fused"] == 1


def _legalized(model, host):
    mod = tvmfuse.load_onnx(model)
    with host:
        return C.Sequential(pre_legalize_passes(host, PipelineOptions()) + legalize_passes(host))(mod)


def test_symbolic_reshape_is_injective_not_opaque(host):
    g = M._G("rs")
    x = g.input("x", ("seq", 64))
    g.op("Transpose", g.op("Reshape", x, g.const(np.array([0, 4, 16], np.int64))), perm=[1, 0, 2])
    g.rename_last("y", (4, "seq", 16))
    mod = _legalized(g.model(), host)
    # TVM annotates the symbolic reshape opaque (its index holds "% seq"); tvmfuse sees it is injective
    assert int(mod["reshape"].attrs["op_pattern"]) == 8
    assert R.symbolic_injective(mod["reshape"])
    d = explain(g.model(), target=host)
    assert d["kernels_fused"] == 1 and d["refused"] == []


def test_symbolic_injective_must_not_fire(host):
    g = M._G("nf")
    x = g.input("x", ("seq", 64))
    g.op("Softmax", x, axis=-1)
    g.rename_last("y", ("seq", 64))
    assert not R.symbolic_injective(_legalized(g.model(), host)["softmax"])   # reductions
    g2 = M._G("nf2")
    x2 = g2.input("x", (8, 64))
    g2.op("Reshape", x2, g2.const(np.array([8, 4, 16], np.int64)))
    g2.rename_last("y", (8, 4, 16))
    static = _legalized(g2.model(), host)
    assert not any(R.symbolic_injective(f) for f in static.functions.values() if isinstance(f, C.PrimFunc))
