"""The fusion rule ``scale_prologue`` (passes/rules.py: squeeze-excitation's per-channel scale read by the next
1x1 conv with blocked constant weights) and what ``cpu.conv1x1`` does with it (the scale inlined into the
conv's input loads: one multiply per broadcast input element, the scaled activation never written).

RegNet-Y, EfficientNet and MobileNetV3 blocks: ``x * gate(fc(pool(x)))`` then a 1x1 projection conv + folded
BN (+ residual); the scale was a kernel of its own per block (it cannot join the gate's conv: it broadcasts
that conv's [n, C, 1, 1] output).  Numerics: SE blocks through tvmfuse.compile against onnx's reference on
fresh random inputs.  Structure on named AVX2 / AVX-512 / NEON targets: no multiply kernel, one cpu.conv1x1
kernel reading the activation and the gate.  Must not fire: a scaled tensor that is also a graph output, a
3x3 next conv, a scale that is not per channel (a full tensor product), a next conv whose channels no vector
divides (OIHW weights).
"""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmfuse
from tvmfuse.explain import Recorder
from tvmfuse.passes import rules as R
from tvmfuse.schedules import schedule_prim_func

import schedule_cases as S
from conftest import assert_close_to_reference

NEON = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "neoverse-n1", "num-cores": 4}


def se_block(c=32, hw=8, out=16, k_next=1, scaled_output=False, full_gate=False, batch=1, seed=0):
    """x -> 3x3 conv + ReLU (``a``) -> SE gate sigmoid(1x1 conv(relu(1x1 conv(mean(a))))) -> ``a * gate`` ->
    next conv (``k_next``) + bias + residual ``x``.  ``full_gate``: the gate is a whole [n, c, h, w] tensor
    (sigmoid(a)), not per channel; ``scaled_output``: the scaled tensor is a graph output too."""
    rng = np.random.default_rng(seed)

    def w(name, shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name)

    sq = max(c // 4, 1)
    pad = (k_next - 1) // 2
    inits = [w("W0", (c, out, 3, 3)), w("B0", (c,)), w("Ws", (sq, c, 1, 1)), w("Bs", (sq,)),
             w("We", (c, sq, 1, 1)), w("Be", (c,)), w("W", (out, c, k_next, k_next)), w("B", (out,))]
    n = helper.make_node
    nodes = [n("Conv", ["x", "W0", "B0"], ["c0"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             n("Relu", ["c0"], ["a"])]
    if full_gate:
        nodes += [n("Sigmoid", ["a"], ["g"])]
    else:
        nodes += [n("GlobalAveragePool", ["a"], ["p"]),
                  n("Conv", ["p", "Ws", "Bs"], ["s0"], kernel_shape=[1, 1]), n("Relu", ["s0"], ["s1"]),
                  n("Conv", ["s1", "We", "Be"], ["e0"], kernel_shape=[1, 1]), n("Sigmoid", ["e0"], ["g"])]
    nodes += [n("Mul", ["a", "g"], ["scaled"]),
              n("Conv", ["scaled", "W", "B"], ["c1"], kernel_shape=[k_next, k_next], pads=[pad] * 4),
              n("Add", ["c1", "x"], ["y"])]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, out, hw, hw])]
    if scaled_output:
        outs.append(helper.make_tensor_value_info("scaled", TensorProto.FLOAT, [batch, c, hw, hw]))
    g = helper.make_graph(nodes, "se_block",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, out, hw, hw])], outs, inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _scale_kernels(funcs: dict) -> list[str]:
    return [k for k in funcs if "multiply" in k]


CASES = [("c32_8x8", dict(c=32, hw=8, out=16)), ("c48_4x4", dict(c=48, hw=4, out=32)),
         ("c24_7x7", dict(c=24, hw=7, out=16))]
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("name,kwargs", CASES, ids=IDS)
def test_numerics_vs_reference(name, kwargs, host, rng):
    model = se_block(**kwargs, seed=int(rng.integers(2**31)))
    cm = tvmfuse.compile(model, host)
    kernels = [s["kernel"] for s in cm.report.schedules]
    assert not [k for k in kernels if k.startswith("multiply")], kernels
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("target", [*S.NAMED_TARGETS, NEON], ids=["haswell", "skylake", "neon"])
@pytest.mark.parametrize("batch", [1, "N"], ids=["static", "symbolic"])
def test_structure(target, batch):
    """The scale is in the 1x1 conv's kernel (scheduled by cpu.conv1x1), over a static or symbolic batch."""
    tgt = tvmfuse.parse_target(target)
    with Recorder() as rec:
        funcs = S.graph_funcs(se_block(batch=batch), tgt)
    (kname,) = _scale_kernels(funcs)
    assert "conv2d" in kname, f"the scale is a kernel of its own: {list(funcs)}"
    assert any(g["rule"].startswith("scale_prologue") for g in rec.groups), rec.groups
    res = schedule_prim_func(funcs[kname], tgt, {}, kname)
    assert res is not None and res.template == "cpu.conv1x1", res and res.template
    # the scaled activation is no buffer of the kernel: the conv reads the activation and the gate
    assert len(res.func.params) == 6, [str(p.name) for p in res.func.params]   # a, gate, W, B, x, out


@pytest.mark.parametrize("kwargs,why", [
    (dict(scaled_output=True), "is also read by the function's result"),
    (dict(k_next=3), "not a 1x1 conv with blocked constant weights"),
    (dict(out=10), "not a 1x1 conv with blocked constant weights"),
], ids=["scaled_is_an_output", "next_conv_3x3", "10_channels_oihw"])
@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
def test_must_not_fire(kwargs, why, target):
    """The scale stays a kernel of its own; the refusal (tvmfuse.explain's record) names why."""
    tgt = tvmfuse.parse_target(target)
    with Recorder() as rec:
        funcs = S.graph_funcs(se_block(**kwargs), tgt)
    reasons = [r["reason"] for r in rec.refused if r["rule"] == "scale_prologue"]
    assert reasons and all(why in r for r in reasons), rec.refused
    assert [k for k in funcs if k.startswith("multiply")], list(funcs)


def test_full_tensor_product_is_no_channel_scale():
    """``a * sigmoid(a)`` (a whole-tensor factor, SiLU-like) is no per-channel scale: no rule covers it
    before the conv (it joins the ReLU's elementwise chain instead), and no kernel has it with the conv."""
    tgt = tvmfuse.parse_target(S.SKYLAKE)
    with Recorder() as rec:
        funcs = S.graph_funcs(se_block(full_gate=True), tgt)
    assert not any("scale_prologue" in g["rule"] for g in rec.groups), rec.groups
    assert not [k for k in funcs if "multiply" in k and "conv2d1" in k], list(funcs)


def test_check_names_the_cause():
    """check_scale_prologue's reasons, on ops as the rules see them (no PrimFunc: no scale)."""
    conv = R.NodeInfo("conv2d(lv)", R.CONTRACTION, 4, reduce_axes=3)
    relu = R.NodeInfo("relu(lv)", R.ELEMWISE, 0)
    conv.readers = ()
    relu.readers = (conv,)
    assert not R.channel_scale(relu)
    assert not R.RULES_BY_NAME["scale_prologue"].matches(relu, conv)
    why = R.check_rules([R.RULES_BY_NAME["scale_prologue"]], [relu, conv])
    assert why is not None and "not a per-channel scale" in why
