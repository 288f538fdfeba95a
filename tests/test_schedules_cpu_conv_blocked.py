"""Constant conv weights stored in blocks of output channels (kernel layout ``OIHW<B>o``: ``[co // B, ci, ky, kx,
co % B]``) for the CPU families with the output channels on the vector lanes (cpu.conv1x1, cpu.conv2d_lanes):
the graph rewrite (passes/rewrites.py: TransposePointwiseWeights), its legalization (passes/legalize.py:
legalize_conv2d) and the templates reading it (schedules/cpu/conv2d.py: analyze_conv).

Why: stored [ci, ky, kx, co], a register tile of nr channels read nr floats a whole row of co apart per
reduction step; in a model, where a conv's weights come from outside L2, that is one cache line per step.
Blocked by the default tile's channels, each tile's weights are one contiguous run.

Numerics: the blocked legalization against TVM's OIHW conv on fresh random inputs (strides, asymmetric padding,
dilation, blocks of 8 and 16), and squeezenet's fire convs through tvmfuse.compile against onnx's reference.
Structure on named AVX2 / AVX-512 targets: the block is the chosen register tile's channels, every vector of
weights a contiguous load; a conv with OIHW weights keeps TVM's legalization (must not fire); a blocked layout
the legalization does not cover is an error naming the cause.
"""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.passes.legalize import custom_legalize, kernel_block
from tvmfuse.schedules import schedule_prim_func

import schedule_cases as S
from conftest import assert_close_to_reference
from test_schedules_cpu_conv import conv_block
from test_schedules_cpu_conv1x1 import _kernel

# (name, conv_block kwargs, family): squeezenet1_1's fire convs (3x3 expand on 3x3 / 7x7 planes, 1x1 expand)
FIRE = [
    ("expand3x3_3x3", dict(cin=64, cout=256, h=3, w=3, residual=False, bn=False), "cpu.conv2d_lanes"),
    ("expand3x3_7x7", dict(cin=32, cout=128, h=7, w=7, residual=False, bn=False), "cpu.conv2d_lanes"),
    ("expand1x1_3x3", dict(cin=48, cout=192, h=3, w=3, k=1, pads=(0, 0, 0, 0), residual=False, bn=False),
     "cpu.conv1x1"),
]


def _legalized(x_shape, w, **attrs):
    """The PrimFunc tvmfuse's legalization makes of one conv2d (constant weights ``w``)."""
    bb = C.BlockBuilder()
    x = C.relax.Var("x", C.TensorType(x_shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(C.relax.op.nn.conv2d(x, C.relax.const(w), **attrs))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    mod = C.relax_transform.LegalizeOps(customize_legalize_map=custom_legalize(None))(bb.get())
    funcs = [f for f in mod.functions.values() if isinstance(f, C.PrimFunc)]
    assert len(funcs) == 1, mod
    return funcs[0]


@pytest.mark.parametrize("block,stride,padding,dilation", [
    (8, (1, 1), (1, 1, 1, 1), (1, 1)),
    (16, (2, 2), (0, 1, 2, 0), (1, 1)),
    (8, (1, 2), (2, 2, 2, 2), (2, 2)),
], ids=["b8_pad1", "b16_stride2_asym_pad", "b8_dilated"])
def test_blocked_legalization_computes_the_oihw_conv(block, stride, padding, dilation, host, rng):
    co, ci, k = 32, 5, 3
    x = rng.standard_normal((1, ci, 9, 11)).astype("float32")
    w = rng.standard_normal((co, ci, k, k)).astype("float32")
    blocked = np.ascontiguousarray(w.reshape(co // block, block, ci, k, k).transpose(0, 2, 3, 4, 1))
    attrs = dict(strides=stride, padding=padding, dilation=dilation)
    f_blocked = _legalized(x.shape, blocked, kernel_layout=f"OIHW{block}o", **attrs)
    f_ref = _legalized(x.shape, w, **attrs)
    assert [int(d) for d in f_blocked.params[-1].shape] == [int(d) for d in f_ref.params[-1].shape]
    got = S.run_func(f_blocked, host, [x, blocked])[0]
    want = S.run_func(f_ref, host, [x, w])[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_oihw_conv_keeps_tvms_legalization():
    """Must not fire: a conv with OIHW weights is legalized exactly as TVM does it."""
    w = np.ones((16, 4, 3, 3), "float32")
    ours = _legalized((1, 4, 6, 6), w, padding=(1, 1, 1, 1))
    bb = C.BlockBuilder()
    x = C.relax.Var("x", C.TensorType((1, 4, 6, 6), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(C.relax.op.nn.conv2d(x, C.relax.const(w), padding=(1, 1, 1, 1))))
        bb.emit_func_output(out)
    mod = C.relax_transform.LegalizeOps()(bb.get())
    tvms = [f for f in mod.functions.values() if isinstance(f, C.PrimFunc)][0]
    C.assert_structural_equal(ours, tvms)
    assert kernel_block("OIHW") is None and kernel_block("OIHW16o") == 16 and kernel_block("OIHW16i") is None


def test_blocked_grouped_conv_is_an_error():
    w = np.ones((1, 2, 3, 3, 8), "float32")          # 8 output channels, 2 input channels per group
    with pytest.raises(ValueError, match="groups 1"):
        _legalized((1, 4, 6, 6), w, kernel_layout="OIHW8o", groups=2, padding=(1, 1, 1, 1))


@pytest.mark.parametrize("name,kwargs,family", FIRE, ids=[f[0] for f in FIRE])
def test_fire_convs_numerics(name, kwargs, family, host, rng):
    model = conv_block(**kwargs)
    cm = tvmfuse.compile(model, host)
    assert [s["template"] for s in cm.report.schedules] == [family], cm.report.schedules
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)


def _weight_loads(func, weight) -> list:
    """The loads of the weight parameter in ``func`` lowered through TVM's vectorizer."""
    low = S.lowered_vectorized(func)
    name = str(weight.name)
    return [n for n in S.nodes(low) if isinstance(n, C.TensorLoad) and str(n.source.name) == name]


@pytest.mark.parametrize("target,lanes", [(S.HASWELL, 8), (S.SKYLAKE, 16)], ids=["haswell", "skylake"])
@pytest.mark.parametrize("name,kwargs,family", FIRE, ids=[f[0] for f in FIRE])
def test_block_is_the_register_tile_and_weight_vectors_are_contiguous(name, kwargs, family, target, lanes):
    tgt = tvmfuse.parse_target(target)
    kname, func = _kernel(conv_block(**kwargs), tgt)
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is not None and res.template == family, res and res.template
    cfg = res.config
    block = cfg["nvec"] * cfg["lanes"]
    k = kwargs.get("k", 3)
    assert [int(d) for d in func.params[1].shape] == [kwargs["cout"] // block, kwargs["cin"], k, k, block]
    loads = _weight_loads(res.func, res.func.params[1])
    assert loads, "no weight load found"
    for load in loads:
        assert S.is_vector(load), f"a scalar weight load: {load}"
        (index,) = load.indices               # flattened
        assert isinstance(index, C.tirx.Ramp) and int(index.stride) == 1 and int(index.lanes) == cfg["lanes"], \
            f"a weight vector that is not one contiguous load: {index}"
