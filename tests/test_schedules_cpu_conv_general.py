"""The CPU conv family on every conv of real models: stride 1 and 2, 1x1, 3x3 to 7x7, 16x16 patch convs,
asymmetric padding, dilation, grouped and depthwise (stride 2 too), 3-channel stems, small planes with
many channels, and a block's conv with its strided shortcut conv added (two anchors: refused by the
fusion rules with a reason naming the templates, each conv then scheduled by its template).

Numerics: tvmfuse.compile on the host vs onnx's reference evaluator, fresh random inputs.
Structure on named AVX2/AVX-512 targets: the template matches, the outer loop is parallel, the inner loop
vectorized, and the generated code is bounded: no nest of unrolled loops makes more than
common.MAX_UNROLLED_COPIES copies of a body (a fully unrolled 7x7 or 16x16 window took LLVM 18-62 s)."""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.explain import Recorder
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu.common import MAX_UNROLLED_COPIES, parallel_why_not
from tvmfuse.schedules.cpu.conv2d import conv_work, find_conv

import schedule_cases as S

CONV, DEPTHWISE, CONV1X1 = "cpu.conv2d_epilogue", "cpu.depthwise_conv2d_epilogue", "cpu.conv1x1"
LANES = "cpu.conv2d_lanes"        # a window or stride on a plane under 256 pixels (conv_lanes.plane_why)

# (name, conv kwargs, family)
CASES = [
    ("3x3", dict(), CONV),
    ("3x3_s2", dict(s=2), LANES),
    ("1x1", dict(k=1, pads=[0] * 4), CONV1X1),              # 15x17 plane: under plane_pixels_below
    ("1x1_s2", dict(k=1, s=2, pads=[0] * 4), LANES),
    ("5x5", dict(k=5), CONV),
    ("stem_7x7_s2", dict(cin=3, cout=16, h=32, w=32, k=7, s=2, pads=[3] * 4), CONV),
    ("asymmetric_pads", dict(pads=[0, 1, 1, 0], s=2), LANES),
    ("dilation_2", dict(dil=2), CONV),
    ("grouped", dict(cin=8, cout=16, group=4), CONV),
    ("depthwise", dict(cin=16, cout=16, group=16), DEPTHWISE),
    ("depthwise_s2", dict(cin=16, cout=16, group=16, s=2), DEPTHWISE),
    ("depthwise_5x5_s2", dict(cin=16, cout=16, group=16, s=2, k=5), DEPTHWISE),
    ("small_plane_many_channels", dict(cin=64, cout=64, h=7, w=7), LANES),
    ("patch_16x16", dict(cin=3, cout=32, h=32, w=32, k=16, s=16, pads=[0] * 4, act=None), CONV),
]
IDS = [c[0] for c in CASES]
# large kernels of real models, structure only: code size must stay bounded
LARGE = [
    ("stem_224", dict(cin=3, cout=64, h=224, w=224, k=7, s=2, pads=[3] * 4), CONV),
    ("vit_patch_224", dict(cin=3, cout=192, h=224, w=224, k=16, s=16, pads=[0] * 4, act=None), CONV),
    ("convnext_dw_7x7", dict(cin=96, cout=96, h=56, w=56, k=7, group=96, act=None), DEPTHWISE),
    ("7x7x512", dict(cin=512, cout=512, h=7, w=7), LANES),
    ("efficientnet_dw_5x5_s2", dict(cin=144, cout=144, h=56, w=56, k=5, s=2, group=144, act=None), DEPTHWISE),
]


def _conv_kernel(model, target):
    funcs = S.graph_funcs(model, target)
    found = [(n, f) for n, f in funcs.items() if "conv" in n]
    assert len(found) == 1, list(funcs)
    name, func = found[0]
    return name, func, schedule_prim_func(func, target, {}, name)


@pytest.mark.parametrize("case,kwargs,family", CASES, ids=IDS)
def test_conv_family_numerics_vs_reference(case, kwargs, family, host, rng):
    model = S.conv(**kwargs)
    with Recorder() as rec:
        cm = tvmfuse.compile(model, host)
    assert [s["template"] for s in rec.schedules] == [family], rec.schedules
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in model.graph.input}
    ref = M.reference_outputs(model, feeds)
    out = cm.run(feeds)
    for name, r in ref.items():
        np.testing.assert_allclose(out[name], r, rtol=1e-4, atol=2e-5, err_msg=f"{case}: {rec.schedules}")


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
@pytest.mark.parametrize("case,kwargs,family", CASES + LARGE, ids=IDS + [c[0] for c in LARGE])
def test_conv_family_structure_and_code_size(case, kwargs, family, target):
    tgt = tvmfuse.parse_target(target)
    name, func, res = _conv_kernel(S.conv(**kwargs), tgt)
    assert res is not None and res.template == family, f"{case}: {res and res.template}"
    kinds = S.kinds(res.func)
    # a conv under the target's fork/join cost runs serial (common.parallel_why_not, every conv family)
    info = find_conv(func, depthwise=family == "cpu.depthwise_conv2d_epilogue") or find_conv(func, depthwise=False)
    serial = parallel_why_not(conv_work(info), tgt) is not None
    assert (int(C.ForKind.PARALLEL) in kinds) != serial, f"{case}: parallel loop {not serial} wanted"
    assert int(C.ForKind.VECTORIZED) in kinds, f"{case}: no vectorized loop"
    copies = S.max_unrolled_copies(res.func)
    assert copies <= MAX_UNROLLED_COPIES, f"{case} ({res.config}): {copies} unrolled copies"


def test_unroll_bound_can_fail(monkeypatch):
    """The measure is real: the 7x7 stem's window fully unrolled (the bound lifted) exceeds the bound."""
    from tvmfuse.schedules.cpu import common as U

    tgt = tvmfuse.parse_target(S.SKYLAKE)
    model = S.conv(cin=3, cout=64, h=224, w=224, k=7, s=2, pads=[3] * 4)
    _, _, bounded = _conv_kernel(model, tgt)
    monkeypatch.setattr(U.unroll_bounded, "__defaults__", (10 ** 6,))     # the bound lifted
    _, _, unbounded = _conv_kernel(model, tgt)
    assert S.max_unrolled_copies(bounded.func) <= MAX_UNROLLED_COPIES < S.max_unrolled_copies(unbounded.func)


def test_two_conv_anchors_refused_with_reason(host, rng):
    """conv 3x3/2 + shortcut conv 1x1/2 + add: the rules refuse one kernel of two convs (the reason names
    the templates); each conv is scheduled by a conv template (cpu.conv2d_lanes: a small plane), the add and
    ReLU on the residual conv's tile; the numbers match the reference."""
    model = S.conv_with_shortcut_conv()
    with Recorder() as rec:
        cm = tvmfuse.compile(model, host)
    reasons = [r["reason"] for r in rec.refused if "two conv anchors" in r["reason"]]
    assert reasons and "cpu.conv2d_epilogue" in reasons[0], rec.refused
    # each conv on its 7x7 output plane (16 channels: a vector of AVX-512, two of AVX2) by cpu.conv2d_lanes
    assert sorted(s["template"] for s in rec.schedules) == [LANES, LANES], rec.schedules
    feeds = {"x": rng.standard_normal([1, 8, 14, 14]).astype(np.float32)}
    np.testing.assert_allclose(cm.run(feeds)["out"], M.reference_outputs(model, feeds)["out"], rtol=1e-4,
                               atol=2e-5)


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
@pytest.mark.parametrize("hw", [7, 28])
def test_pointwise_conv_fused_rows(hw, target, rng):
    """A 1x1 stride-1 conv (a matmul over pixels): with fuse_rows the tile's full-width rows are one
    vectorized run of pixels (49 pixels of a 7x7 plane in one loop, not seven 7-wide vectors); TVM keeps it
    vector (nothing scalarized); same numbers as the unscheduled kernel (host run); a 3x3 conv fuses rows
    only through the im2col knob (its padded rows are not contiguous).  26 output channels: no vector width
    divides them, so cpu.conv1x1 (tests/test_schedules_cpu_conv1x1.py) leaves the 7x7 plane to this template."""
    from tvmfuse.schedules.base import schedule_with
    from tvmfuse.schedules.cpu.conv2d import Conv2DEpilogue

    tgt = tvmfuse.parse_target(target)
    t = Conv2DEpilogue()
    name, func, res = _conv_kernel(S.conv(cin=16, cout=26, h=hw, w=hw, k=1, pads=[0] * 4), tgt)
    match = t.match(func, tgt)
    space = t.space(match, tgt)
    assert match.info["pointwise"] and True in space.to_dict()["fuse_rows"]
    oh = max(d for d in space.to_dict()["oh_tile"] if hw % d == 0)
    cfg = {**res.config, "fuse_rows": True, "ow_tile": hw, "oh_tile": oh}
    assert space.contains(cfg)
    fused = schedule_with(t, match, func, cfg)
    assert not S.scalarized_loops(fused)
    vec = [int(f.extent) for f in S.loops(fused) if int(f.kind) == int(C.ForKind.VECTORIZED)]
    assert oh * hw in vec, (oh, hw, vec)
    host = tvmfuse.host_target()
    args = S.random_args(func, rng)
    np.testing.assert_allclose(S.run_func(fused, host, args)[0], S.run_func(func, host, args)[0], rtol=1e-5,
                               atol=1e-6)
    assert space.to_dict()["im2col"] == [False], "a 1x1 stride-1 conv reads contiguous pixels: no im2col"
    _, f3, _ = _conv_kernel(S.conv(cin=16, cout=24, h=hw, w=hw, k=3), tgt)
    # a 3x3 conv's padded rows are not contiguous: rows fuse only through the im2col copy
    assert t.space(t.match(f3, tgt), tgt).to_dict()["im2col"] == [False, True]
