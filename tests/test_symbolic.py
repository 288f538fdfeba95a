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
from tvmfuse.target import parse_target


def _mlp(batch="batch"):
    """MatMul + Add + Relu on x: [batch, 64] (issue 13's example; test_input_shapes uses it too)."""
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
def mobilenetv3_block(batch):
    """A MobileNetV3 bottleneck with squeeze-excite and a classifier head (Flatten + Gemm on batch)."""
    from tvmfuse.models import _conv_bn

    g = M._G("mbv3_block")
    x = g.input("x", (batch, 16, 14, 14))
    h = g.op("HardSwish", _conv_bn(g, x, 16, 48, k=1))
    h = g.op("HardSwish", _conv_bn(g, h, 48, 48, k=3, group=48))
    s = g.op("Relu", g.op("Conv", g.op("GlobalAveragePool", h), g.weight((12, 48, 1, 1)), g.weight((12,), 0.1),
                          kernel_shape=[1, 1]))
    s = g.op("HardSigmoid", g.op("Conv", s, g.weight((48, 12, 1, 1)), g.weight((48,), 0.1), kernel_shape=[1, 1]))
    h = g.op("Add", _conv_bn(g, g.op("Mul", h, s), 48, 16, k=1), x)
    p = g.op("Flatten", g.op("GlobalAveragePool", h), axis=1)
    g.op("Gemm", p, g.weight((10, 16)), g.weight((10,), 0.1), transB=1)
    g.rename_last("y", (batch, 10))
    return g.model()


@pytest.mark.parametrize("name, static, symbolic", [
    ("transformer_block", lambda: M.transformer_block(seq=16, hidden=64, heads=4, ffn=128),
     lambda: M.transformer_block(seq="sequence", hidden=64, heads=4, ffn=128)),
    ("resnet_block", lambda: M.resnet_block(channels=8, size=8, batch=2),
     lambda: M.resnet_block(channels=8, size=8, batch="batch")),
    ("layernorm_softmax", lambda: M.layernorm_softmax(rows=16, d=32), None),
    ("qkv_projection", lambda: M.qkv_projection(seq=16, hidden=32), None),
    ("swiglu", lambda: M.swiglu(seq=16, hidden=32, ffn=48), None),
    ("gemm_bias_relu", lambda: M.gemm_bias_relu(), None),
    ("depthwise_conv_bn_relu_residual", lambda: M.conv_bn_relu_residual(channels=16, size=14, depthwise=True),
     None),
    ("instancenorm_silu", lambda: M.instancenorm_silu(channels=8, size=12), None),
    ("mobilenetv3_block", lambda: mobilenetv3_block(2), lambda: mobilenetv3_block("batch")),
])
def test_symbolic_model_gets_the_static_groups(name, static, symbolic, host):
    """The symbolic model gets the static model's groups, the norm prologue's included (LayerNorm + QKV,
    LayerNorm + FFN-up: cpu.symbolic_norm_matmul over symbolic rows, tests/test_symbolic_norm_prologue.py)."""
    sym_model = symbolic() if symbolic else _make_symbolic(static(), axis=0, dim="rows")
    d_static, d_sym = explain(static(), target=host), explain(sym_model, target=host)
    assert d_sym["kernels_fused"] == d_static["kernels_fused"] < d_sym["kernels_unfused"]
    assert _groups(d_sym) == _groups(d_static), (_groups(d_sym), _groups(d_static))
    split, _ = _norm_prologue_groups(d_static)
    assert len(_norm_prologue_groups(d_sym)[0]) == len(split)


def _norm_prologue_groups(d):
    """(ops of each norm-prologue group, the other groups as ``_groups`` gives them)."""
    split = [tuple(g["ops"]) for g in d["groups"] if "norm_prologue" in g["rule"].split("+")]
    kept = sorted((tuple(g["ops"]), g["rule"]) for g in d["groups"] if "norm_prologue" not in g["rule"].split("+"))
    return split, kept


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


@pytest.mark.parametrize("seqs", [(1, 5, 17, 128)])
def test_symbolic_transformer_block_runs_at_any_length(seqs, host, rng):
    """One attention kernel over the symbolic sequence (query/key tails at 5 and 17), as in the static
    block, and its two norm-prologue kernels (LN + QKV, LN + FFN-up): 5 kernels, as the static block."""
    model = M.transformer_block(seq="sequence", hidden=64, heads=4, ffn=128)
    cm = tvmfuse.compile(model, target=host)
    assert [g["rule"] for g in cm.report.groups].count("attention") == 1, cm.report.refused
    static = tvmfuse.compile(M.transformer_block(seq=16, hidden=64, heads=4, ffn=128), target=host)
    assert (cm.kernel_count, static.kernel_count) == (5, 5)
    for s in seqs:
        _check(model, cm, rng, {"x": (s, 64)})


def test_symbolic_mobilenetv3_block_runs_at_any_batch(host, rng):
    model = mobilenetv3_block("batch")
    cm = tvmfuse.compile(model, target=host)
    assert cm.kernel_count == tvmfuse.compile(mobilenetv3_block(2), target=host).kernel_count
    for b in (1, 3):
        _check(model, cm, rng, {"x": (b, 16, 14, 14)})


def test_symbolic_resnet_block_runs_at_any_batch(host, rng):
    model = M.resnet_block(channels=8, size=8, batch="batch")
    cm = tvmfuse.compile(model, target=host)
    assert cm.kernel_count == 2   # conv+bn+relu, conv+bn+add+relu: batch norm folded as in the static build
    for b in (1, 3):
        _check(model, cm, rng, {"x": (b, 8, 8, 8)})


# ----------------------------------------------------------------------------------- legality pieces
def test_same_shape_is_symbolic_equality():
    n, m = C.tirx.Var("n", "int64"), C.tirx.Var("m", "int64")
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


def _flattened_rows_module():
    """x [b, s, 16] flattened to [b * s, 16] for the matmul, its result reshaped back to [b, s, 32]
    (a transformer's projections as PyTorch exports them): the group after the matmul reads only the
    [b * s, 32] tensor, whose shape defines neither b nor s."""
    I, RS, T = C.script_ir, C.script_relax, C.script_tir

    @I.ir_module
    class Flattened:
        @RS.function
        def main(x: RS.Tensor(("b", "s", 16), "float32"), w: RS.Tensor((16, 32), "float32")):
            b = T.int64()
            s = T.int64()
            with RS.dataflow():
                x2 = RS.reshape(x, RS.shape([b * s, 16]))
                y = RS.matmul(x2, w)
                z = RS.multiply(RS.nn.relu(RS.reshape(y, RS.shape([b, s, 32]))), RS.const(2.0, "float32"))
                RS.output(z)
            return z

    return Flattened


def test_group_gets_the_symbols_its_tensors_do_not_define(host, rng):
    """gpt2_dyn/llama_dyn: FuseTIR left such a group's result shape unknown (call_tir then failed); the
    group takes the symbols as one more parameter and its result keeps [b, s, 32]."""
    from tvmfuse.passes.grouping import FuseGroups

    with host:
        legal = C.Sequential(legalize_passes(host))(_flattened_rows_module())
        grouped = FuseGroups(host)(legal)
    fused = {str(gv.name_hint): f for gv, f in grouped.functions.items()
             if isinstance(f, C.relax.Function) and f.attrs is not None and "Primitive" in f.attrs}
    with_shape = [n for n, f in fused.items() if isinstance(C.type_of(f.params[-1]), C.relax.ShapeType)]
    assert with_shape, {n: [str(C.type_of(p)) for p in f.params] for n, f in fused.items()}
    for name in with_shape:
        assert sorted(str(v.name) for v in C.type_of(fused[name].params[-1]).values) == ["b", "s"]
        assert C.type_of(fused[name]).ret.shape is not None      # the result shape is known
    cm = tvmfuse.compile(_flattened_rows_module(), target=host)
    assert cm.outputs[0].shape == ("b", "s", 32)
    assert any(g["ops"][:2] == ["reshape", "relu"] for g in cm.report.groups), cm.report.groups
    w = rng.standard_normal((16, 32)).astype(np.float32)
    for b, s in ((1, 5), (3, 17)):
        x = rng.standard_normal((b, s, 16)).astype(np.float32)
        out = cm.run({"x": x, "w": w})["output0"]
        np.testing.assert_allclose(out, 2 * np.maximum(x @ w, 0), rtol=1e-5, atol=1e-5, err_msg=f"{b}x{s}")


def test_group_whose_tensors_define_its_symbols_gets_no_shape_parameter(host):
    """Must not fire: a group reading [b, s, 16] itself needs no extra parameter."""
    from tvmfuse.passes.grouping import FuseGroups

    g = M._G("defined")
    x = g.input("x", ("b", "s", 16))
    g.op("Mul", g.op("Relu", x), g.const(np.float32(2.0)))
    g.rename_last("y", ("b", "s", 16))
    with host:
        grouped = FuseGroups(host)(_legalized(g.model(), host))
    fused = [f for f in grouped.functions.values()
             if isinstance(f, C.relax.Function) and f.attrs is not None and "Primitive" in f.attrs]
    assert len(fused) == 1
    assert not any(isinstance(C.type_of(p), C.relax.ShapeType) for p in fused[0].params)


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
    # the shared leading dim kept (passes/legalize.py): no "% seq" in the index, TVM sees it injective
    assert int(mod["reshape"].attrs["op_pattern"]) == 2
    d = explain(g.model(), target=host)
    assert d["kernels_fused"] == 1 and d["refused"] == []
    # TVM's own reshape over seq (the legalization of a reshape that keeps no leading dim): TVM annotates
    # it opaque (its index holds "% seq"); tvmfuse sees it is injective
    seq = C.tirx.Var("seq", "int64")
    src = C.te.placeholder((seq, 64), name="x")
    mod = C.relax_transform.AnnotateTIROpPattern()(C.IRModule(
        {"reshape": C.te.create_prim_func([src, C.topi.reshape(src, (4, seq, 16))])}))
    assert int(mod["reshape"].attrs["op_pattern"]) == 8
    assert R.symbolic_injective(mod["reshape"])


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


def _embedding(batch, seq, vocab=50, hidden=64):
    """An encoder's embedding: token lookup (Gather) + position embedding (Add) + LayerNorm."""
    g = M._G("emb")
    ids = g.input("ids", (batch, seq), C_INT64)
    tok = g.op("Gather", g.weight((vocab, hidden), 1.0), ids, axis=0)
    x = g.op("Add", tok, g.weight((hidden,), 1.0))
    g.op("LayerNormalization", x, g.const(np.ones(hidden, np.float32)), g.const(np.zeros(hidden, np.float32)),
         axis=-1, epsilon=1e-5)
    g.rename_last("y", (batch, seq, hidden))
    return g.model()


C_INT64 = 7     # onnx TensorProto.INT64


@pytest.mark.parametrize("batch, seq", [(2, 9), ("batch", "sequence")], ids=["static", "symbolic"])
def test_gather_fuses_into_the_norm_over_static_and_symbolic_extents(batch, seq, host, rng):
    """TVM annotates a gather opaque (its index is loaded); tvmfuse sees it is injective, so the lookup,
    the add and the LayerNorm are one kernel in the static build as in the symbolic one (bert_dyn and
    bert: the same kernel count), with the unfused reference's numbers."""
    model = _embedding(batch, seq)
    mod = _legalized(model, host)
    take = [f for n, f in mod.functions.items() if str(n.name_hint).startswith("take")]
    assert any(int(f.attrs["op_pattern"]) == 8 and R.gather_injective(f) for f in take)
    d = explain(model, target=host)
    assert d["kernels_fused"] == 1 and d["refused"] == [], d["refused"]
    cm = tvmfuse.compile(model, target=host)
    sizes = [(2, 9)] if batch == 2 else [(1, 1), (3, 17), (2, 128)]
    for b, s in sizes:
        feeds = {"ids": rng.integers(0, 50, (b, s)).astype(np.int64)}
        out, ref = cm.run(feeds)["y"], M.reference_outputs(model, feeds)["y"]
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4, err_msg=f"{b}x{s}")


def test_gather_injective_must_not_fire(host):
    """Not a gather: a static reshape (indices of iterators only), a softmax (a reduction)."""
    g = M._G("nf3")
    x = g.input("x", (8, 64))
    g.op("Softmax", g.op("Reshape", x, g.const(np.array([8, 4, 16], np.int64))), axis=-1)
    g.rename_last("y", (8, 4, 16))
    funcs = [f for f in _legalized(g.model(), host).functions.values() if isinstance(f, C.PrimFunc)]
    assert funcs and not any(R.gather_injective(f) for f in funcs)


# ----------------------------------------------------------------------------------- PyTorch's shape subgraphs
# Graphs reproducing what torch.onnx.export emits for symbolic batch/sequence (built with onnx.helper via
# models._G): each imports as symbolic Relax shape computations, fuses, and runs at several sizes.
I64 = lambda v: np.array(v, np.int64)  # noqa: E731


def _dim_of(g, t, axis):
    """Shape(t)[axis] as a 1-element int64 tensor (torch: x.size(axis) -> Shape, Gather, Unsqueeze)."""
    return g.op("Unsqueeze", g.op("Gather", g.op("Shape", t), g.const(I64(axis)), axis=0), g.const(I64([0])))


def _value(v):
    import onnx

    return onnx.numpy_helper.from_array(np.array([v], np.float32))


def constant_of_shape_mask():
    """HF default attention mask: ones(x.shape) -> (1 - m) * -1e4 added to x."""
    g = M._G("constant_of_shape")
    x = g.input("x", ("batch", "seq"))
    shape = g.op("Concat", _dim_of(g, x, 0), _dim_of(g, x, 1), axis=0)
    ones = g.op("ConstantOfShape", shape, value=_value(1.0))
    g.op("Add", x, g.op("Mul", g.op("Sub", g.const(np.float32(1.0)), ones), g.const(np.float32(-1e4))))
    g.rename_last("y", ("batch", "seq"))
    return g.model()


def expand_to_computed_shape():
    """bias.expand(x.size(0), x.size(1), 16) + x."""
    g = M._G("expand")
    x = g.input("x", ("batch", "seq", 16))
    shape = g.op("Concat", _dim_of(g, x, 0), _dim_of(g, x, 1), g.const(I64([16])), axis=0)
    g.op("Add", x, g.op("Expand", g.weight((1, 1, 16)), shape))
    g.rename_last("y", ("batch", "seq", 16))
    return g.model()


def range_positions():
    """Position embeddings: table[arange(seq)] added to x (Range to the sequence length)."""
    g = M._G("range")
    x = g.input("x", ("batch", "seq", 16))
    seq = g.op("Gather", g.op("Shape", x), g.const(I64(1)), axis=0)
    ids = g.op("Range", g.const(I64(0)), seq, g.const(I64(1)))
    emb = g.op("Gather", g.weight((64, 16)), ids, axis=0)
    g.op("Add", x, g.op("Unsqueeze", emb, g.const(I64([0]))))
    g.rename_last("y", ("batch", "seq", 16))
    return g.model()


def padding_mask():
    """BERT: where(mask == 0, -1e4, 0)[:, None, None, :] added to the scores, then softmax."""
    from onnx import TensorProto

    g = M._G("padding_mask")
    s = g.input("scores", ("batch", 2, "seq", "seq"))
    m = g.input("mask", ("batch", "seq"), TensorProto.INT64)
    bias = g.op("Where", g.op("Equal", m, g.const(I64(0))), g.const(np.float32(-1e4)), g.const(np.float32(0.0)))
    g.op("Softmax", g.op("Add", s, g.op("Unsqueeze", bias, g.const(I64([1, 2])))), axis=-1)
    g.rename_last("y", ("batch", 2, "seq", "seq"))
    return g.model()


def causal_mask():
    """Llama: arange(seq) compared col > row, full([seq, seq], -1e4) where future, added to the scores."""
    g = M._G("causal_mask")
    s = g.input("scores", ("batch", "seq", "seq"))
    seq = g.op("Gather", g.op("Shape", s), g.const(I64(1)), axis=0)
    r = g.op("Range", g.const(I64(0)), seq, g.const(I64(1)))
    future = g.op("Greater", g.op("Unsqueeze", r, g.const(I64([0]))), g.op("Unsqueeze", r, g.const(I64([1]))))
    seq1 = g.op("Unsqueeze", seq, g.const(I64([0])))
    full = g.op("ConstantOfShape", g.op("Concat", seq1, seq1, axis=0), value=_value(-1e4))
    g.op("Softmax", g.op("Add", s, g.op("Where", future, full, g.const(np.float32(0.0)))), axis=-1)
    g.rename_last("y", ("batch", "seq", "seq"))
    return g.model()


def reshape_heads():
    """Attention heads: x.view(b, s, 4, d // 4) from Shape/Gather/Div/Concat, transposed and back."""
    g = M._G("reshape_heads")
    x = g.input("x", ("batch", "seq", 64))
    dh = g.op("Div", g.op("Gather", g.op("Shape", x), g.const(I64(2)), axis=0), g.const(I64(4)))
    shape = g.op("Concat", _dim_of(g, x, 0), _dim_of(g, x, 1), g.const(I64([4])),
                 g.op("Unsqueeze", dh, g.const(I64([0]))), axis=0)
    h = g.op("Transpose", g.op("Reshape", x, shape), perm=[0, 2, 1, 3])
    back = g.op("Concat", _dim_of(g, x, 0), _dim_of(g, x, 1), g.const(I64([64])), axis=0)
    g.op("Relu", g.op("Reshape", g.op("Transpose", h, perm=[0, 2, 1, 3]), back))
    g.rename_last("y", ("batch", "seq", 64))
    return g.model()


def expand_minus_one():
    """mask[:, None, None, :].expand(b, 1, s, s) as torch exports it: ConstantOfShape(Shape(shape)),
    Mul -1, Equal, Where, Expand."""
    g = M._G("expand_minus_one")
    s = g.input("scores", ("batch", 1, "seq", "seq"))
    m4 = g.op("Unsqueeze", g.input("mask", ("batch", "seq")), g.const(I64([1, 2])))
    shape = g.op("Concat", _dim_of(g, s, 0), g.const(I64([1])), _dim_of(g, s, 2), _dim_of(g, s, 3), axis=0)
    import onnx

    ones = g.op("ConstantOfShape", g.op("Shape", shape), value=onnx.numpy_helper.from_array(I64([1])))
    w = g.op("Where", g.op("Equal", shape, g.op("Mul", ones, g.const(I64(-1)))), ones, shape)
    g.op("Add", s, g.op("Expand", m4, w))
    g.rename_last("y", ("batch", 1, "seq", "seq"))
    return g.model()


def slice_cache():
    """Rotary cache: cos[:seq] sliced to the sequence length, times x."""
    g = M._G("slice_cache")
    x = g.input("x", ("batch", "seq", 16))
    c = g.op("Slice", g.weight((128, 16)), g.const(I64([0])), _dim_of(g, x, 1), g.const(I64([0])))
    g.op("Mul", x, c)
    g.rename_last("y", ("batch", "seq", 16))
    return g.model()


def trilu_causal():
    """full((s, s), -1e4).triu(1) added to the scores, softmax."""
    g = M._G("trilu_causal")
    s = g.input("scores", ("batch", "seq", "seq"))
    seq = _dim_of(g, s, 1)
    full = g.op("ConstantOfShape", g.op("Concat", seq, seq, axis=0), value=_value(-1e4))
    g.op("Softmax", g.op("Add", s, g.op("Trilu", full, g.const(I64(1)), upper=1)), axis=-1)
    g.rename_last("y", ("batch", "seq", "seq"))
    return g.model()


def chunk_channels():
    """ShuffleNet's channel split: x.chunk(2, dim=1) exports Shape -> Gather([1]) -> Div -> Slice, the
    static channel count gathered from a shape whose batch is symbolic."""
    g = M._G("chunk_channels")
    x = g.input("x", ("batch", 8, 6))
    c = g.op("Gather", g.op("Shape", x), g.const(I64([1])), axis=0)
    half = g.op("Div", c, g.const(I64([2])))
    a = g.op("Slice", x, g.const(I64([0])), half, g.const(I64([1])))
    b = g.op("Slice", x, half, g.op("Mul", half, g.const(I64([2]))), g.const(I64([1])))
    g.op("Add", g.op("Relu", a), b)
    g.rename_last("y", ("batch", 4, 6))
    return g.model()


def slice_from_end():
    """T5's position bias[:, :, -seq:, :]: a Slice whose start is minus the symbolic sequence length."""
    g = M._G("slice_from_end")
    x = g.input("x", ("batch", "seq", 8))
    start = g.op("Unsqueeze", g.op("Neg", g.op("Gather", g.op("Shape", x), g.const(I64(1)), axis=0)),
                 g.const(I64([0])))
    tail = g.op("Slice", g.op("Relu", x), start, g.const(I64([np.iinfo(np.int64).max])), g.const(I64([1])))
    g.op("Mul", tail, x)
    g.rename_last("y", ("batch", "seq", 8))
    return g.model()


DYNAMIC_EXPORTS = {"chunk_channels": chunk_channels, "slice_from_end": slice_from_end,
                   "reshape_heads": reshape_heads, "expand_minus_one": expand_minus_one,
                   "slice_cache": slice_cache, "trilu_causal": trilu_causal,
                   "constant_of_shape_mask": constant_of_shape_mask,
                   "expand_to_computed_shape": expand_to_computed_shape, "range_positions": range_positions,
                   "padding_mask": padding_mask, "causal_mask": causal_mask}


def _feeds_for(cm, rng, sizes):
    feeds = {}
    for spec in cm.inputs:
        shape = [sizes.get(d, d) if isinstance(d, str) else d for d in spec.shape]
        feeds[spec.name] = (rng.integers(0, 2, shape) if spec.dtype == "int64"
                            else rng.standard_normal(shape)).astype(spec.dtype)
    return feeds


@pytest.mark.parametrize("name", sorted(DYNAMIC_EXPORTS))
def test_dynamic_export_pattern_imports_fuses_and_runs(name, host, rng):
    model = DYNAMIC_EXPORTS[name]()
    cm = tvmfuse.compile(model, target=host)
    # the symbols survive the shape computations: inputs and output keep batch/seq
    assert all(isinstance(d, int) or d in ("batch", "seq") for s in cm.inputs + cm.outputs for d in s.shape)
    assert cm.outputs[0].shape == tuple(d.dim_param or d.dim_value
                                        for d in model.graph.output[0].type.tensor_type.shape.dim)
    assert cm.kernel_count == 1 < cm.report.kernels_before
    for sizes in ({"batch": 1, "seq": 5}, {"batch": 2, "seq": 7}):
        feeds = _feeds_for(cm, rng, sizes)
        out, ref = cm.run(feeds), M.reference_outputs(model, feeds)
        np.testing.assert_allclose(out["y"], ref["y"], rtol=1e-5, atol=1e-5, err_msg=f"{name} {sizes}")


def test_range_keeps_the_sequence_symbol():
    # TVM's own Range converter computes the length into a fresh var: the add then has no known shape
    from tvmfuse.compiled import relax_io as _relax_io

    model = range_positions()
    assert _relax_io(tvmfuse.load_onnx(model))[1][0].shape == ("batch", "seq", 16)
    stock = C.from_onnx(model)   # without tvmfuse's converters
    assert _relax_io(stock)[1][0].shape != ("batch", "seq", 16)


def test_constant_of_shape_of_an_empty_shape_is_a_scalar(host, rng):
    # torch.full((), v) exports ConstantOfShape(int64[0]): TVM's converter broadcasts the [1]-shaped value
    # to rank 0 and fails; folded when shapes fold, and converted by tvmfuse's converter when they do not
    g = M._G("scalar_fill")
    x = g.input("x", ("batch", 4))
    g.op("Mul", x, g.op("ConstantOfShape", g.const(np.zeros((0,), np.int64)), value=_value(-2.5)))
    g.rename_last("y", ("batch", 4))
    model = g.model()
    with pytest.raises(Exception, match="broadcast_to expects the input shape"):
        C.from_onnx(model)
    mod = tvmfuse.load_onnx(model, fold_shapes=False)
    cm = tvmfuse.compile(mod, target=host)
    x3 = rng.standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(cm.run({"x": x3})["output0"], x3 * -2.5, rtol=1e-6)


def test_static_parts_of_a_symbolic_graph_still_fold(host, rng):
    # Reshape(x, concat([-1], shape(x)[1:])): the sliced Shape is static although batch is not
    from tvmfuse.frontend import fold_static_shapes

    g = M._G("partial")
    x = g.input("x", ("batch", 8, 4))
    tail = g.op("Shape", x, start=1)
    g.op("Relu", g.op("Reshape", g.op("Transpose", x, perm=[0, 2, 1]),
                      g.op("Concat", g.const(I64([-1])), tail, axis=0)))
    g.rename_last("y", ("batch", 8, 4))
    model = g.model()
    folded, n = fold_static_shapes(model)
    assert n == 2 and [node.op_type for node in folded.graph.node] == ["Transpose", "Reshape", "Relu"]
    cm = tvmfuse.compile(model, target=host)
    x2 = rng.standard_normal((2, 8, 4)).astype(np.float32)
    ref = M.reference_outputs(model, {"x": x2})["y"]
    np.testing.assert_allclose(cm.run({"x": x2})["y"], ref, rtol=1e-6)


# ----------------------------------------------------------------------------------- run() / Runner.run()
def _shared_seq_model():
    """x: [batch, seq, 16] and mask: [batch, seq] share both symbols: y = x * mask[..., None]."""
    g = M._G("shared_seq")
    x = g.input("x", ("batch", "seq", 16))
    m = g.input("mask", ("batch", "seq"))
    g.op("Relu", g.op("Mul", x, g.op("Unsqueeze", m, g.const(I64([-1])))))
    g.rename_last("y", ("batch", "seq", 16))
    return g.model()


def test_run_checks_that_inputs_agree_on_a_shared_symbol(host, rng):
    from tvmfuse.errors import InputError

    model = _shared_seq_model()
    cm = tvmfuse.compile(model, target=host)
    for b, s in ((1, 3), (4, 9)):
        _check(model, cm, rng, {"x": (b, s, 16), "mask": (b, s)})
    bad = {"x": rng.standard_normal((2, 5, 16)).astype(np.float32),
           "mask": rng.standard_normal((2, 6)).astype(np.float32)}
    with pytest.raises(InputError, match=r"symbolic dim 'seq' is 5 in input 'x' \(axis 1\) but 6 in input "
                                         r"'mask' \(axis 1\)"):
        cm.run(bad)
    bad["mask"] = rng.standard_normal((3, 5)).astype(np.float32)
    with pytest.raises(InputError, match="symbolic dim 'batch' is 2 in input 'x'"):
        cm.run(bad)
    with pytest.raises(InputError, match=r"'mask' has shape \[2, 5, 1\], the model expects \['batch', 'seq'\]"):
        cm.run({"x": bad["x"], "mask": np.zeros((2, 5, 1), np.float32)})


def test_exported_symbolic_model_records_its_dims_and_runs_any_size(host, rng, tmp_path):
    from tvmfuse.errors import InputError

    model = _shared_seq_model()
    cm = tvmfuse.compile(model, target=host)
    runner = tvmfuse.load(tvmfuse.export(cm, str(tmp_path / "art")))
    assert runner.manifest["symbolic_dims"] == {
        "batch": [{"input": "x", "axis": 0}, {"input": "mask", "axis": 0}],
        "seq": [{"input": "x", "axis": 1}, {"input": "mask", "axis": 1}]}
    assert [s.shape for s in runner.inputs] == [("batch", "seq", 16), ("batch", "seq")]
    for b, s in ((1, 2), (3, 7)):
        _check(model, runner, rng, {"x": (b, s, 16), "mask": (b, s)})
    with pytest.raises(InputError, match="symbolic dim 'seq'"):
        runner.run({"x": np.zeros((1, 2, 16), np.float32), "mask": np.zeros((1, 3), np.float32)})


def test_cli_runs_a_symbolic_artifact_at_a_pinned_size(host, tmp_path):
    from tvmfuse.cli import main

    model = _shared_seq_model()
    art = tvmfuse.export(tvmfuse.compile(model, target=host), str(tmp_path / "art"))
    out = tmp_path / "o.npz"
    assert main(["run", art, "--shape", "batch=2", "--shape", "seq=3", "-o", str(out)]) == 0
    with np.load(out) as z:
        assert z["y"].shape == (2, 3, 16)
    assert main(["run", art, "--shape", "batch=2"]) == 2   # seq left open: one error line


# ----------------------------------------------------------------------------------- schedules
NAMED_TARGETS = ['{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "haswell", "num-cores": 2}',
                 '{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512", "num-cores": 8}']


def _symbolic_kernels(model, target):
    from tvmfuse.pipeline import graph_stage

    mod = tvmfuse.load_onnx(model)
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions()))(mod)
    return {str(gv.name_hint): f for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)
            and any(not isinstance(d, C.IntImm) for p in f.params for d in p.shape)}


def _loops_and_allocs(func):
    """Loop kinds of a scheduled PrimFunc, and the element counts of its intermediate buffers after
    compaction (a producer computed per row keeps a row-size buffer)."""
    mod = C.Sequential([C.s_tir.transform.LowerInitBlock(),
                        C.s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
                        C.s_tir.transform.ConvertBlocksToOpaque(),
                        C.s_tir.transform.CompactBufferAllocation()])(C.IRModule({"main": func}))
    kinds, allocs = [], []

    def walk(s):
        if isinstance(s, C.SBlock):
            allocs.extend(_numel(buf.shape) for buf in s.alloc_buffers)
        if isinstance(s, C.tirx.For):
            kinds.append(int(s.kind))
        for attr in ("body", "then_case", "else_case", "block", "init"):
            child = getattr(s, attr, None)
            if child is not None and hasattr(child, "same_as") and not hasattr(child, "ty"):
                walk(child)
        for child in getattr(s, "seq", ()) or ():
            walk(child)

    walk(mod["main"].body)
    return kinds, allocs


def _numel(shape):
    n = 1
    for d in shape:
        n = n * d
    return n


def _reductions(func) -> int:
    """Blocks of ``func`` with a reduction axis (a matmul's accumulation)."""
    blocks = []
    C.post_order_visit(func.body, lambda n: blocks.append(n) if isinstance(n, C.SBlock) and
                       any(int(iv.iter_type) == C.IterVarKind.CommReduce for iv in n.iter_vars) else None)
    return len(blocks)


@pytest.mark.parametrize("target", NAMED_TARGETS, ids=["haswell", "skylake-avx512"])
@pytest.mark.parametrize("name, build", [
    ("mlp", _mlp),
    ("transformer_block", lambda: M.transformer_block(seq="sequence", hidden=64, heads=4, ffn=128)),
    ("resnet_block", lambda: M.resnet_block(channels=8, size=8, batch="batch")),
    ("causal_mask", causal_mask),
])
def test_symbolic_kernels_get_a_parallel_vectorized_schedule(name, build, target):
    from tvmfuse.schedules import schedule_prim_func

    tgt = parse_target(target)
    funcs = _symbolic_kernels(build(), tgt)
    assert funcs
    for kname, func in funcs.items():
        res = schedule_prim_func(func, tgt, {}, kname)
        assert res is not None, f"{kname}: unscheduled"
        kinds, allocs = _loops_and_allocs(res.func)
        assert int(C.ForKind.PARALLEL) in kinds, f"{kname} ({res.template}): no parallel loop"
        assert int(C.ForKind.VECTORIZED) in kinds, f"{kname} ({res.template}): no vectorized loop"
        # producers live on rows: no intermediate as large as the output is left
        out = _numel(func.params[-1].shape)
        full = [a for a in allocs if C.Analyzer().can_prove_equal(a, out)]
        if res.template in ("cpu.symbolic_matmul", "cpu.symbolic_siblings", "cpu.symbolic_norm_matmul"):
            # known limitation: each matmul's mr x nr accumulator keeps the rows x N shape here (TVM's strict
            # buffer compaction cannot prove rows >= mr for a symbolic row count; lowering shrinks them:
            # test_symbolic_siblings.test_qkv_over_symbolic_rows_leaves_no_full_size_matmul_buffer);
            # cpu.symbolic_norm_matmul over rows without batch axes: its nests share the norm's buffers too
            # (tests/test_symbolic_norm_prologue.py: none left with batch axes); nothing else may be left
            full = full[_reductions(func):]
        assert not full, f"{kname} ({res.template}): full-size intermediates left: {full}"


def test_symbolic_rows_must_not_fire_on_static_kernels(host):
    from tvmfuse.schedules.cpu.symbolic import SymbolicRows

    funcs = _symbolic_kernels(_mlp(), host)
    assert funcs   # the symbolic one matches
    assert all(SymbolicRows().match(f, host) is not None for f in funcs.values())
    mod = tvmfuse.load_onnx(_mlp(8))
    from tvmfuse.pipeline import graph_stage

    with host:
        mod = C.Sequential(graph_stage(host, PipelineOptions()))(mod)
    static = [f for f in mod.functions.values() if isinstance(f, C.PrimFunc)]
    assert static and all(SymbolicRows().match(f, host) is None for f in static)


def _layer_norm(rows=("batch", "sequence"), hidden=64):
    g = M._G("ln_dyn")
    x = g.input("x", (*rows, hidden))
    g.op("LayerNormalization", x, g.weight((hidden,), 1.0), g.weight((hidden,), 1.0), axis=-1, epsilon=1e-5)
    g.rename_last("y", (*rows, hidden))
    return g.model()


@pytest.mark.parametrize("target", NAMED_TARGETS, ids=["haswell", "skylake-avx512"])
def test_symbolic_norm_is_serial_for_few_rows_and_vectorized(target):
    """cpu.symbolic_rows over one symbolic row axis ([sequence, hidden]; over several, [batch, sequence,
    hidden], cpu.row_reduction takes the norm: test_symbolic_norms.py): one nest per size bucket, serial up to min_rows_per_core x
    cores - 1 rows or (more, here) the rows whose 64 elements each stay under the fork/join cost (a
    thread-pool fork costs more than a few rows of a norm; the static default's rule), parallel above; in both the
    mean and variance sums are vector partial sums (rfactor by the lanes: vectorized reduction loops) and
    the normalization is vectorized along the static row; no intermediate is left at full size."""
    from tvmfuse.schedules import schedule_prim_func
    from tvmfuse.schedules.cpu.symbolic import SymbolicRows
    from tvmfuse.target import cpu_info, template_defaults

    tgt = parse_target(target)
    (kname, func), = _symbolic_kernels(_layer_norm(rows=("sequence",)), tgt).items()
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res.template == "cpu.symbolic_rows"
    cores = cpu_info(tgt).cores
    limit = template_defaults(tgt, "cpu.parallel")["fork_join_work_per_core"] * cores
    bound = max(template_defaults(tgt, "cpu.symbolic_rows")["min_rows_per_core"] * cores - 1, (limit - 1) // 64)
    assert bound == (limit - 1) // 64       # the work rule binds: 64-element rows
    assert [b["bucket"] for b in res.config["buckets"]] == [f"rows<={bound}", f"rows>{bound}"]
    t = SymbolicRows()
    match = t.match(func, tgt)
    lanes = cpu_info(tgt).float32_lanes
    for bucket, parallel in zip(t.buckets(match, tgt), (False, True)):
        bm = t.bucket_match(match, bucket)
        nest = C.Schedule(func)
        t.apply(nest, bm, t.default_config(bm, tgt))
        kinds, allocs = _loops_and_allocs(nest.mod["main"])
        assert kinds.count(int(C.ForKind.PARALLEL)) == int(parallel), bucket.name
        vec = []
        C.post_order_visit(nest.mod["main"].body, lambda n: vec.append(n) if isinstance(n, C.tirx.For)
                           and n.kind == C.ForKind.VECTORIZED and int(n.extent) == lanes else None)
        assert len(vec) >= 5, bucket.name       # 2 rf inits, 2 rf sums, the normalization
        assert all(isinstance(a, C.IntImm) or isinstance(a, int) for a in allocs), allocs   # per row


@pytest.mark.parametrize("rows", [(1, 1), (1, 3), (2, 2), (3, 17), (2, 128)])
def test_symbolic_norm_matches_the_reference_on_both_sides_of_the_bucket(rows, host, rng):
    model = _layer_norm()
    cm = tvmfuse.compile(model, target=host)
    assert cm.kernel_count == 1
    _check(model, cm, rng, {"x": (*rows, 64)})


def _head_split(batch="batch", seq="sequence"):
    """Q / K^T head split of a symbolic [batch, sequence, 64]: Reshape to 4 heads of 16, then Transpose to
    [batch, 4, sequence, 16] and to [batch, 4, 16, sequence] (K^T), each scaled (gpt2's Q/K/V split)."""
    g = M._G("head_split")
    x = g.input("x", (batch, seq, 64))
    h = g.op("Reshape", x, g.const(np.array([0, 0, 4, 16], dtype=np.int64)))
    g.op("Mul", g.op("Transpose", h, perm=[0, 2, 1, 3]), g.const(np.array(0.25, dtype=np.float32)))
    g.rename_last("q", (batch, 4, seq, 16))
    g.op("Mul", g.op("Transpose", h, perm=[0, 2, 3, 1]), g.const(np.array(0.25, dtype=np.float32)))
    g.rename_last("kt", (batch, 4, 16, seq))
    return g.model()


def _lane_divisions(func):
    """Block bindings inside a vectorized loop that divide (floordiv / floormod) an expression of that
    loop's var by a non-constant: a per-lane division by a symbolic extent (the vector loads gather)."""
    found = []

    def uses(expr, var):
        hit = []
        C.post_order_visit(expr, lambda n: hit.append(1) if isinstance(n, C.tirx.Var) and n.same_as(var) else None)
        return bool(hit)

    def walk(stmt, vec_vars):
        if isinstance(stmt, C.tirx.For):
            inner = vec_vars + [stmt.loop_var] if int(stmt.kind) == int(C.ForKind.VECTORIZED) else vec_vars
            walk(stmt.body, inner)
            return
        if isinstance(stmt, C.SBlockRealize):
            for value in stmt.iter_values:
                divs = []
                C.post_order_visit(value, lambda n: divs.append(n) if isinstance(n, (C.tirx.FloorDiv, C.tirx.FloorMod))
                                   and not isinstance(n.b, C.IntImm) else None)
                found.extend(str(d) for d in divs if any(uses(d.a, v) for v in vec_vars))
            walk(stmt.block.body, vec_vars)
            return
        for child in getattr(stmt, "seq", None) or []:
            walk(child, vec_vars)
        for attr in ("body", "then_case", "else_case"):
            sub = getattr(stmt, attr, None)
            if sub is not None and not isinstance(stmt, C.tirx.For):
                walk(sub, vec_vars)

    walk(func.body, [])
    return found


@pytest.mark.parametrize("target", NAMED_TARGETS, ids=["haswell", "skylake-avx512"])
def test_symbolic_injective_keeps_static_inner_axes_as_vectors(target):
    """A symbolic head split (gpt2_dyn's Q/K/V split + transposes: 175 us per call vs 5 us static when every
    loop was fused into one and each lane divided by batch x sequence): the static inner axes are the vector
    loop, the symbolic ones the parallel outer loop; no lane divides by a symbolic extent; still parallel
    and vectorized."""
    from tvmfuse.schedules import schedule_prim_func

    tgt = parse_target(target)
    funcs = _symbolic_kernels(_head_split(), tgt)
    assert funcs
    for kname, func in funcs.items():
        res = schedule_prim_func(func, tgt, {}, kname)
        assert res is not None and res.template == "cpu.elementwise", (kname, res and res.template)
        kinds, _ = _loops_and_allocs(res.func)
        assert int(C.ForKind.PARALLEL) in kinds and int(C.ForKind.VECTORIZED) in kinds, kname
        assert not _lane_divisions(res.func), (kname, _lane_divisions(res.func))


def test_symbolic_injective_head_split_numerics(host, rng):
    model = _head_split()
    cm = tvmfuse.compile(model, target=host)
    for b, s in ((1, 1), (3, 17), (2, 40)):
        _check(model, cm, rng, {"x": (b, s, 64)}, rtol=0, atol=0)
