"""The fusion rule ``concat_prologue`` (passes/rules.py: a channel concat read by a 1x1 conv with blocked constant
weights) and what ``cpu.conv1x1`` does with it (schedules/cpu/conv1x1.py: the concat inlined into the conv's input
loads, the input-channel loop cut at the concat's boundaries).

SqueezeNet's fire modules concatenate their two expand branches and feed the next squeeze conv: the concat was a
copy kernel of its own.  Numerics: fire modules (equal and unequal branches, branches the reduction unroll does
not divide) through tvmfuse.compile against onnx's reference on fresh random inputs.  Structure on named AVX2 /
AVX-512 targets: no concat kernel, one cpu.conv1x1 kernel reading both branches, no select left after TVM's
simplifier, the input-channel loop in one part per branch.  A 1x1 conv whose output channels no vector divides
keeps OIHW weights and ``cpu.conv2d_epilogue`` (SqueezeNet's 512 -> 10 classifier): it reads the concat through
its input loads the same way.  Numerics also against onnxruntime, with a branch that is a graph output too (the
branch is written anyway; only the concat's other readers stop the rule).  Must not fire: a concat that is also a
graph output, a concat read by a 3x3 conv.
"""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.explain import Recorder
from tvmfuse.passes import rules as R
from tvmfuse.schedules import schedule_prim_func

import schedule_cases as S
from conftest import assert_close_to_reference
from test_schedules_cpu import _structure


def fire(cin=16, e1=32, e3=32, hw=7, out=16, k_next=1, concat_output=False, seed=0, batch=1, branch_output=False,
         stride_next=1):
    """A fire module (squeeze output ``x`` -> expand 1x1 + ReLU, expand 3x3 + ReLU -> concat) and the next conv
    (``k_next`` x ``k_next``) + ReLU; ``concat_output``: the concat is a graph output too; ``branch_output``: the
    expand 1x1 branch ``r1`` is a graph output too."""
    rng = np.random.default_rng(seed)

    def w(name, shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name)

    pad = (k_next - 1) // 2
    inits = [w("W1", (e1, cin, 1, 1)), w("B1", (e1,)), w("W3", (e3, cin, 3, 3)), w("B3", (e3,)),
             w("W", (out, e1 + e3, k_next, k_next)), w("B", (out,))]
    nodes = [helper.make_node("Conv", ["x", "W1", "B1"], ["c1"], kernel_shape=[1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["x", "W3", "B3"], ["c3"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c3"], ["r3"]),
             helper.make_node("Concat", ["r1", "r3"], ["cat"], axis=1),
             helper.make_node("Conv", ["cat", "W", "B"], ["c"], kernel_shape=[k_next, k_next], pads=[pad] * 4,
                              strides=[stride_next] * 2),
             helper.make_node("Relu", ["c"], ["y"])]
    ohw = (hw + 2 * pad - k_next) // stride_next + 1
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, out, ohw, ohw])]
    if concat_output:
        outs.append(helper.make_tensor_value_info("cat", TensorProto.FLOAT, [batch, e1 + e3, hw, hw]))
    if branch_output:
        outs.append(helper.make_tensor_value_info("r1", TensorProto.FLOAT, [batch, e1, hw, hw]))
    g = helper.make_graph(nodes, "fire", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, cin, hw, hw])],
                          outs, inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


# (name, fire kwargs): squeezenet1_1's fire 3 -> 4 (15x15) and fire 8 -> 9 (3x3) shapes, unequal branches,
# branches of 6 and 10 channels (the default reduction unroll of 4 divides neither: the select stays)
CASES = [
    ("squeezenet_15x15", dict(cin=16, e1=64, e3=64, hw=15, out=16)),
    ("squeezenet_3x3", dict(cin=64, e1=256, e3=256, hw=3, out=64)),
    ("unequal_7x7", dict(cin=8, e1=24, e3=40, hw=7, out=32)),
    ("branches_6_10", dict(cin=8, e1=6, e3=10, hw=5, out=16)),
]
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("name,kwargs", CASES, ids=IDS)
def test_numerics_vs_reference(name, kwargs, host, rng):
    model = fire(**kwargs)
    cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 3, [s["kernel"] for s in cm.report.schedules]
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)


def _concat_kernels(funcs: dict) -> list[str]:
    return [n for n in funcs if "concatenate" in n]


def _scheduled_concat_conv(kwargs, target, family):
    """The fire's kernel of the concat and the 1x1 conv after it (one of three kernels), scheduled on the named
    ``target``; its template must be ``family``."""
    tgt = tvmfuse.parse_target(target)
    funcs = S.graph_funcs(fire(**kwargs), tgt)
    assert len(funcs) == 3, list(funcs)
    (kname,) = _concat_kernels(funcs)
    assert "conv2d" in kname, f"the concat is a kernel of its own: {list(funcs)}"
    res = schedule_prim_func(funcs[kname], tgt, {}, kname)
    assert res is not None and res.template == family, res and res.template
    return res


def _selects_left(func) -> bool:
    """Whether the lowered, vectorized kernel still selects per input load after TVM's simplifier."""
    low = C.tirx.transform.StmtSimplify()(C.IRModule({"main": S.lowered_vectorized(func)}))["main"]
    return "if_then_else" in low.script()


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
@pytest.mark.parametrize("name,kwargs", CASES[:3], ids=IDS[:3])
def test_structure(name, kwargs, target):
    res = _scheduled_concat_conv(kwargs, target, "cpu.conv1x1")
    assert not _selects_left(res.func), "a select per input load is left"
    # the input-channel loop in one part per branch: two serial loops, each over its branch's channels
    ku = res.config["k_unroll"]
    parts = sorted(int(f.extent) for f in S.loops(res.func) if int(f.kind) == int(C.ForKind.SERIAL)
                   and str(f.loop_var.name).startswith("ax3_0"))
    assert parts == sorted([kwargs["e1"] // ku, kwargs["e3"] // ku]), parts


def test_symbolic_batch_fuses_the_same():
    """A fire exported with a dynamic batch: the concat joins the 1x1 conv as in the static build."""
    _scheduled_concat_conv(dict(batch="N"), S.SKYLAKE, "cpu.conv1x1")


def test_branches_the_unroll_does_not_divide_keep_the_select():
    """6 + 10 input channels with a reduction unroll of 4: no cut of the loop (its parts would not be whole
    unrolled steps); the fused kernel reads through the concat's select."""
    tgt = tvmfuse.parse_target(S.SKYLAKE)
    funcs = S.graph_funcs(fire(**CASES[3][1]), tgt)
    (kname,) = _concat_kernels(funcs)
    res = schedule_prim_func(funcs[kname], tgt, {}, kname)
    assert res.template == "cpu.conv1x1" and res.config["k_unroll"] == 4, (res.template, res.config)
    assert "if_then_else" in res.func.script()


@pytest.mark.parametrize("kwargs,why", [
    (dict(concat_output=True), "is also read by the function's result"),
    (dict(k_next=3), "not a 1x1 conv with constant weights"),
    (dict(stride_next=2, out=10), "does not read the concat's plane pixel for pixel"),
], ids=["concat_is_an_output", "next_conv_3x3", "next_conv_1x1_stride2"])
@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
def test_must_not_fire(kwargs, why, target):
    """The concat stays a kernel of its own; the refusal (tvmfuse.explain's record) names why."""
    tgt = tvmfuse.parse_target(target)
    with Recorder() as rec:
        funcs = S.graph_funcs(fire(**kwargs), tgt)
    reasons = [r["reason"] for r in rec.refused if r["rule"] == "concat_prologue"]
    assert reasons and all(why in r for r in reasons), rec.refused
    assert len(funcs) == 4, list(funcs)
    assert [n for n in funcs if n.startswith("concatenate")], list(funcs)


def test_check_names_the_cause():
    """check_concat_prologue's reasons, on ops as the rules see them."""
    conv = R.NodeInfo("conv2d(lv)", R.CONTRACTION, 4, reduce_axes=3)
    other = R.NodeInfo("transpose(lv)", R.INJECTIVE, 2)
    conv.readers = ()
    other.readers = (conv,)
    assert not R.channel_concat(other)
    why = R.check_rules([R.RULES_BY_NAME["concat_prologue"]], [other, conv])
    assert why is not None and "not a channel concat" in why


def test_check_reads_the_concat_plane_past_a_scalar_parameter():
    """A concat over a window batch ``n * 16`` takes ``n`` as a scalar parameter after its output buffer
    (LegalizeOps: no buffer shape defines it); check_concat_prologue reads the concat's plane from its
    output buffer, not from its last parameter (it raised AttributeError: a Var has no shape)."""
    n = C.tirx.Var("n", "int64")
    a = C.te.placeholder((n * 16, 8, 4, 4), "float32", "a")
    b = C.te.placeholder((n * 16, 8, 4, 4), "float32", "b")
    cat_func = C.te.create_prim_func([a, b, C.topi.concatenate([a, b], axis=1), n])
    assert not C.is_buffer_var(cat_func.params[-1])       # the scalar n, after the output
    x = C.te.placeholder((n * 16, 16, 4, 4), "float32", "x")
    w = C.te.placeholder((32, 16, 1, 1), "float32", "w")
    conv_func = C.te.create_prim_func([x, w, C.topi.nn.conv2d_nchw(x, w, 1, 0, 1), n])
    lv = C.relax.Var("lv", C.TensorType([n * 16, 16, 4, 4], "float32"))
    for plane, why in (((4, 4), None), ((2, 2), "does not read the concat's plane pixel for pixel")):
        cat = R.NodeInfo("concatenate(lv)", R.INJECTIVE, 2, func=cat_func, var=lv)
        conv = R.NodeInfo("conv2d(lv1)", R.CONTRACTION, 4, reduce_axes=3, data_arg=lv,
                          out_shape=(n * 16, 32, *plane), func=conv_func)
        cat.readers, conv.readers = (conv,), ()
        assert R.channel_concat(cat)
        got = R.check_concat_prologue([cat, conv])
        assert got == why if why is None else why in got, got


# squeezenet1_1's classifier (fire 9's expand branches 256 + 256 -> concat -> 1x1 conv to 10 classes on 3x3) and a
# larger plane with an odd channel count; the 10 / 6 output channels keep OIHW weights (no vector divides them)
OIHW_CASES = [
    ("squeezenet_classifier", dict(cin=64, e1=256, e3=256, hw=3, out=10)),
    ("plane_13x13_6ch", dict(cin=8, e1=16, e3=32, hw=13, out=6)),
]


@pytest.mark.parametrize("name,kwargs", OIHW_CASES, ids=[c[0] for c in OIHW_CASES])
def test_oihw_pointwise_conv_numerics(name, kwargs, host, rng):
    model = fire(**kwargs)
    cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 3, [s["kernel"] for s in cm.report.schedules]
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
@pytest.mark.parametrize("name,kwargs", OIHW_CASES, ids=[c[0] for c in OIHW_CASES])
def test_oihw_pointwise_conv_structure(name, kwargs, target):
    """The concat joins the 1x1 conv's kernel (cpu.conv2d_epilogue): no concat kernel, no per-band copy of the
    concat (no buffer of its shape inside the kernel), no select left after TVM's simplifier."""
    res = _scheduled_concat_conv(kwargs, target, "cpu.conv2d_epilogue")
    # a copy of the concat would hold every concat channel of whole rows (a row band): none may
    row = (kwargs["e1"] + kwargs["e3"]) * kwargs["hw"]
    allocs, _ = _structure(res.func)
    assert not any(n % row == 0 for _, n in allocs), f"the concat is copied in the kernel: {allocs}"
    assert not _selects_left(res.func), "a select per input load is left"


def test_numerics_vs_onnxruntime_branch_is_an_output(host, rng):
    """A fire whose expand 1x1 branch is also a graph output: the concat still joins the next conv (the branch
    is written to memory anyway); every output against onnxruntime on fresh inputs."""
    ort = pytest.importorskip("onnxruntime")
    model = fire(cin=16, e1=64, e3=64, hw=15, out=16, branch_output=True)
    cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 3 and any("concatenate" in s["kernel"] and "conv2d" in s["kernel"]
                                        for s in cm.report.schedules), cm.report.schedules
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((1, 16, 15, 15)).astype(np.float32)
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x})))
    got = cm.run({"x": x})
    for name, ref in want.items():
        np.testing.assert_allclose(got[name], ref, rtol=1e-4, atol=1e-4, err_msg=name)
