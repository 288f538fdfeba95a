"""Convs with a unit window or output axis (Inception v3's factorised 1x7 / 7x1 and 1x3 / 3x1 convs, 3x3
convs on a 1x1 map; corpus ``inception_v3``, benchmarks/notes/corpus10.md): ``im2col``'s copy lost the unit
axis in ``reindex`` and its 6-D layout map failed ("args.size() == initial_indices_orig.size()"), so these
kernels ran on cpu.generic or the fallback.  ``im2col_choices`` now leaves im2col out for them.

Structure on named AVX2 / AVX-512 targets: cpu.conv2d_epilogue's im2col knob has False only, its default
schedules and lowers (in a model cpu.conv2d_lanes takes some of these convs first on AVX2).  Numerics: the default schedule vs the unscheduled kernel on fresh random inputs (host).
Must not fire: a 3x3 conv on a 3x3 map keeps the im2col choice."""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.models import _G
from tvmfuse.schedules.base import schedule_with
from tvmfuse.schedules.cpu.conv2d import Conv2DEpilogue

import schedule_cases as S

# (id, kernel (kh, kw), plane (h, w), pads [top, left, bottom, right], in / out channels as inception_v3's)
CASES = [
    ("1x7_on_3x3", (1, 7), (3, 3), [0, 3, 0, 3], 20),
    ("7x1_on_3x3", (7, 1), (3, 3), [3, 0, 3, 0], 20),
    ("3x3_on_1x1", (3, 3), (1, 1), [1, 1, 1, 1], 24),
    ("1x3_on_1x1", (1, 3), (1, 1), [0, 1, 0, 1], 24),
]
IDS = [c[0] for c in CASES]


def conv_kxk(kernel, plane, pads, ch):
    """x [1, ch, h, w] -> Conv (kernel, pads, bias, ch outputs) -> Relu."""
    g = _G("conv_unit_axes")
    x = g.input("x", [1, ch, *plane])
    y = g.op("Conv", x, g.weight([ch, ch, *kernel]), g.weight([ch]), kernel_shape=list(kernel),
             pads=pads, strides=[1, 1])
    g.op("Relu", y)
    return S.finish(g)


def _conv_kernel(kernel, plane, pads, ch, target):
    tgt = tvmfuse.parse_target(target) if isinstance(target, str) else target
    (func,) = [f for n, f in S.graph_funcs(conv_kxk(kernel, plane, pads, ch), tgt).items() if "conv" in n]
    t = Conv2DEpilogue()          # the family with the im2col knob (cpu.conv2d_lanes takes some of these
    match = t.match(func, tgt)     # convs first on some targets: AVX2 at 20 channels)
    assert match is not None, "cpu.conv2d_epilogue did not match the conv"
    return t, match, func, tgt


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skx"])
@pytest.mark.parametrize("case,kernel,plane,pads,ch", CASES, ids=IDS)
def test_unit_axis_conv_gets_the_conv_template_without_im2col(case, kernel, plane, pads, ch, target):
    t, match, func, tgt = _conv_kernel(kernel, plane, pads, ch, target)
    assert t.space(match, tgt).to_dict()["im2col"] == [False], case
    sched = schedule_with(t, match, func, t.default_config(match, tgt))
    C.lower_tir(C.IRModule({"main": sched.with_attr("global_symbol", "main")}), tgt)


@pytest.mark.parametrize("case,kernel,plane,pads,ch", CASES, ids=IDS)
def test_unit_axis_conv_matches_the_unscheduled_kernel(case, kernel, plane, pads, ch, host, rng):
    t, match, func, tgt = _conv_kernel(kernel, plane, pads, ch, host)
    args = S.random_args(func, rng)
    want = S.run_func(func, tgt, args)[0]
    got = S.run_func(schedule_with(t, match, func, t.default_config(match, tgt)), tgt, args)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))


def test_a_square_window_on_a_larger_map_keeps_im2col():
    t, match, _, tgt = _conv_kernel((3, 3), (3, 3), [1, 1, 1, 1], 20, S.SKYLAKE)
    assert True in t.space(match, tgt).to_dict()["im2col"]
