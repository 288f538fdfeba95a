"""The conv template's im2col knob (tvmfuse/schedules/cpu/conv2d.py): the band's windows copied into
[channel, ky, kx, row, column] so that full-width rows of a small plane are one vectorized run of pixels.

Numerics: every shape class of real models (3x3 planes with many channels as SqueezeNet's Fire modules,
odd 7x7 / 15x15 / 31x31 planes, stride 2 without padding (a stem), asymmetric pads, dilation, 5x5) with
im2col forced on, rows fused or not, parallel over bands or bands x channel blocks: the same numbers as
the unscheduled kernel on fresh random inputs (host).  Structure on named AVX2/AVX-512 targets: which
convs take im2col by default, the fused pixel loop's width, no loop scalarized, the copy's layout, the
padding folded into the copy, generated code bounded.
"""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.schedules.base import schedule_with
from tvmfuse.schedules.cpu import conv2d as conv_mod
from tvmfuse.schedules.cpu.common import MAX_UNROLLED_COPIES
from tvmfuse.schedules.cpu.conv2d import Conv2DEpilogue

import schedule_cases as S

# (id, conv kwargs): odd planes and every window kind
SHAPES = [
    ("fire_3x3_plane", dict(cin=24, cout=32, h=3, w=3)),
    ("plane_7x7", dict(cin=8, cout=20, h=7, w=7)),
    ("plane_15x15", dict(cin=6, cout=18, h=15, w=15)),
    ("stem_31x31_s2_nopad", dict(cin=3, cout=16, h=64, w=64, s=2, pads=[0] * 4)),
    ("asymmetric_s2", dict(cin=5, cout=17, h=13, w=11, s=2, pads=[0, 1, 1, 0])),
    ("dilation_2", dict(cin=4, cout=16, h=9, w=9, dil=2)),
    ("5x5", dict(cin=4, cout=16, h=6, w=6, k=5)),
]


def _kernel(kwargs, target):
    tgt = tvmfuse.parse_target(target)
    funcs = S.graph_funcs(S.conv(**kwargs), tgt)
    (name, func), = [(n, f) for n, f in funcs.items() if "conv" in n]
    t = Conv2DEpilogue()
    match = t.match(func, tgt)
    assert match is not None, f"{name}: the conv template did not match"
    return t, match, func, tgt


def _config(t, match, tgt, **over):
    cfg = {**t.default_config(match, tgt), "deinterleave": False, **over}
    assert t.space(match, tgt).contains(cfg), cfg
    return cfg


@pytest.mark.parametrize("fused", [True, False], ids=["fused_rows", "row_tiles"])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("case,kwargs", SHAPES, ids=[c[0] for c in SHAPES])
def test_im2col_numerics_vs_unscheduled(case, kwargs, depth, fused, rng):
    host = tvmfuse.host_target()
    t, match, func, tgt = _kernel(kwargs, host)
    i = match.info
    ow, oh = (i["OW"], max(d for d in t.space(match, tgt).to_dict()["oh_tile"] if i["OH"] % d == 0 and
                          d * i["OW"] <= 4 * 16)) if fused else (1, 1)
    cfg = _config(t, match, tgt, im2col=True, fuse_rows=fused, ow_tile=ow, oh_tile=oh, parallel_depth=depth)
    scheduled = schedule_with(t, match, func, cfg)
    args = S.random_args(func, rng)
    np.testing.assert_allclose(S.run_func(scheduled, host, args)[0], S.run_func(func, host, args)[0],
                               rtol=1e-5, atol=1e-5, err_msg=f"{case}: {cfg}")


def _allocs(func) -> dict:
    return {str(b.name): [int(d) for d in b.shape] for n in S.nodes(func) if isinstance(n, C.SBlock)
            for b in n.alloc_buffers}


def test_fire_module_3x3_plane_default_on_avx512():
    """SqueezeNet's 3x3 conv on a 3x3 plane (F=256, C=64): on AVX-512 the default copies the windows and
    vectorizes the 9 pixels of the plane as one loop (not three 3-wide rows); the copy holds the pixels
    innermost, the padding is folded into it (no pad buffer left), nothing is scalarized, code bounded."""
    t, match, func, tgt = _kernel(dict(cin=64, cout=256, h=3, w=3), S.SKYLAKE)
    cfg = t.default_config(match, tgt)
    assert cfg["im2col"] and cfg["fuse_rows"] and cfg["oh_tile"] * cfg["ow_tile"] == 9, cfg
    res = schedule_with(t, match, func, cfg)
    vec = {int(f.extent) for f in S.loops(res) if int(f.kind) == int(C.ForKind.VECTORIZED)}
    assert 9 in vec, vec
    allocs = _allocs(res)
    cols = [shape for name, shape in allocs.items() if "reindex" in name]
    assert cols == [[1, 64, 3, 3, 3, 3]], allocs              # [n, c, ky, kx, rows, cols]
    assert "pad_temp" not in allocs, f"the padding block was not folded into the copy: {allocs}"
    assert not S.scalarized_loops(res)
    assert S.max_unrolled_copies(res) <= MAX_UNROLLED_COPIES


@pytest.mark.parametrize("target,hw,expected", [
    (S.SKYLAKE, 3, True),     # 9 pixels: one vector of 16
    (S.SKYLAKE, 4, True),     # 16 pixels: one whole vector
    (S.SKYLAKE, 7, False),    # 49 pixels: an odd-sized vector LLVM spills (whole_vectors)
    (S.SKYLAKE, 16, False),   # rows already whole vectors: the direct tile
    (S.HASWELL, 3, False),    # 9 pixels on 8 lanes: not whole vectors
    (S.HASWELL, 2, True),     # 4 pixels: one vector of 8
])
def test_im2col_default_only_where_rows_fill_whole_vectors(target, hw, expected):
    t, match, func, tgt = _kernel(dict(cin=16, cout=32, h=hw, w=hw), target)
    cfg = t.default_config(match, tgt)
    assert cfg["im2col"] is expected, cfg
    if expected:
        assert cfg["fuse_rows"] and cfg["ow_tile"] == hw and not cfg["deinterleave"]
    res = schedule_with(t, match, func, cfg)
    assert not S.scalarized_loops(res)


def test_im2col_needs_enough_output_channels():
    """The copy is shared by the output channels: below IM2COL_MIN_CHANNELS the direct tile stays."""
    few = conv_mod.IM2COL_MIN_CHANNELS - 1
    t, match, func, tgt = _kernel(dict(cin=16, cout=few, h=3, w=3), S.SKYLAKE)
    assert not t.default_config(match, tgt)["im2col"]


@pytest.mark.parametrize("kwargs", [dict(k=1, pads=[0] * 4), dict(group=4)], ids=["pointwise", "grouped"])
def test_im2col_not_offered(kwargs):
    """A 1x1 stride-1 conv reads contiguous pixels already; a grouped conv's copy would be per output
    channel: neither offers the knob."""
    t, match, func, tgt = _kernel(dict(cin=16, cout=32, h=3, w=3, **kwargs), S.SKYLAKE)
    assert t.space(match, tgt).to_dict()["im2col"] == [False]


def test_im2col_with_deinterleave_is_refused():
    """Both knobs lay out the conv's input: a config asking for both is an error naming them."""
    t, match, func, tgt = _kernel(dict(cin=3, cout=16, h=16, w=16, s=2), S.SKYLAKE)
    cfg = {**t.default_config(match, tgt), "im2col": True, "deinterleave": True}
    assert t.space(match, tgt).contains(cfg)
    with pytest.raises(ValueError, match="im2col and deinterleave"):
        schedule_with(t, match, func, cfg)
