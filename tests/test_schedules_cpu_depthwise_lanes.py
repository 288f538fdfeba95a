"""``cpu.depthwise_conv2d_epilogue``'s ``channel_lanes`` nest (output channels on the vector lanes, for small
planes; tvmfuse/schedules/cpu/depthwise.py): numerics against the unscheduled kernel and the ONNX reference,
the default's choice per named target and from the target table, the TIR it makes (folded padding taps, the
channel-last padded input per channel block), and convs it must not take."""
import json
import random

import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import target as TG
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.base import schedule_with
from tvmfuse.schedules.cpu.common import Registers
from tvmfuse.schedules.cpu.depthwise import DepthwiseConfig, folds_padding

from conftest import assert_close_to_reference
from test_schedules_cpu import _structure
from test_schedules_cpu_conv import DEPTHWISE, _conv_kernel, _fused_prim_funcs, conv_block

ZNVER5 = {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver5", "num-cores": 2}
ZNVER3 = {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver3", "num-cores": 2}
SKX = {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512", "num-cores": 2}
HASWELL = {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "haswell", "num-cores": 2}
NEON = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "neoverse-n1", "num-cores": 4}
TARGETS = {"znver5": ZNVER5, "znver3": ZNVER3, "skx": SKX, "haswell": HASWELL, "neon": NEON}

# (name, conv_block kwargs, default channel_lanes on AVX-512 / AVX2 / NEON): the late depthwise convs of
# mobilenet_v2 / mnasnet at a 64x64 input (2x2, 4x4 planes, 3x3 and 5x5 windows), odd shapes, and convs
# the nest must not take (no vector width divides 13 channels; a 16x16 or 8x8 plane: lanes_plane_pixels_below)
CASES = [
    ("2x2", dict(cin=32, cout=32, h=2, w=2, group=32), (16, 8, 4)),
    ("2x2_k5", dict(cin=48, cout=48, h=2, w=2, k=5, pads=(2, 2, 2, 2), group=48, residual=False), (16, 8, 4)),
    ("4x4_k5", dict(cin=48, cout=48, h=4, w=4, k=5, pads=(2, 2, 2, 2), group=48), (16, 8, 4)),
    ("7x7_s2", dict(cin=24, cout=24, h=7, w=7, stride=2, group=24), (8, 8, 4)),
    ("7x7_40", dict(cin=40, cout=40, h=7, w=7, group=40, relu=False), (8, 8, 4)),
    ("5x3_pads", dict(cin=16, cout=16, h=5, w=3, pads=(0, 1, 2, 1), group=16), (16, 8, 4)),
    ("13ch", dict(cin=13, cout=13, h=4, w=4, group=13), (0, 0, 0)),
    ("8x8", dict(cin=32, cout=32, h=8, w=8, group=32), (0, 0, 0)),
    ("16x16", dict(cin=32, cout=32, h=16, w=16, group=32), (0, 0, 0)),
]
IDS = [c[0] for c in CASES]
EXPECTED = {"znver5": 0, "skx": 0, "znver3": 1, "haswell": 1, "neon": 2}


def _kernel(kwargs, target):
    return _conv_kernel(_fused_prim_funcs(conv_block(**kwargs), target), target, DEPTHWISE)


@pytest.mark.parametrize("name,kwargs,lanes", CASES, ids=IDS)
def test_numerics_vs_reference(name, kwargs, lanes, host, rng):
    model = conv_block(**kwargs)
    cm = tvmfuse.compile(model, host)
    assert [s["template"] for s in cm.report.schedules] == [DEPTHWISE], cm.report.schedules
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tname", list(TARGETS))
@pytest.mark.parametrize("name,kwargs,lanes", CASES, ids=IDS)
def test_default_channel_lanes_per_target(name, kwargs, lanes, tname):
    """The default: the widest vector dividing the channels where the plane has fewer than the table's
    lanes_plane_pixels_below pixels (64), from the named target (never the host); the tile then at most
    lanes_max_pixels pixels (and half the registers), several rows only as whole rows, dividing the rows."""
    target = tvmfuse.parse_target(TARGETS[tname])
    tmpl, kname, func, match = _kernel(kwargs, target)
    cfg = tmpl.default_config(match, target)
    assert cfg["channel_lanes"] == lanes[EXPECTED[tname]], (tname, cfg)
    assert tmpl.space(match, target).contains(cfg)
    if cfg["channel_lanes"]:
        i = match.info
        oh, ow = cfg["oh_tile"], cfg["ow_tile"]
        regs = Registers.for_bits(TG.cpu_info(target).vector_bits).count
        assert oh * ow <= min(16, regs // 2), cfg
        assert i["OW"] % ow == 0 and i["OH"] % oh == 0 and (oh == 1 or ow == i["OW"]), cfg
        assert cfg["deinterleave"] is False


def _vector_multiplies(func, target) -> int:
    """Vector multiplies left in ``func`` after TVM's TIR lowering (unrolled, simplified) for ``target``."""
    mod = C.lower_tir(C.IRModule({"main": func.with_attr("global_symbol", "main")}), target)
    found = []
    C.post_order_visit(mod["main"].body, lambda n: found.append(n) if isinstance(n, C.tirx.Mul) and
                       not n.ty.is_scalar() else None)
    return len(found)


def _vector_loops(func) -> list[int]:
    """Extents of the vectorized loops of a scheduled PrimFunc."""
    found = []
    C.post_order_visit(func.body, lambda n: found.append(int(n.extent)) if isinstance(n, C.tirx.For) and
                       n.kind == C.ForKind.VECTORIZED else None)
    return found


def _valid_taps(oh, ow, h, w, k, stride, top, left) -> int:
    return sum(0 <= y * stride + ky - top < h and 0 <= x * stride + kx - left < w
               for y in range(oh) for x in range(ow) for ky in range(k) for kx in range(k))


@pytest.mark.parametrize("name,tname", [("2x2", "znver5"), ("2x2", "haswell"), ("2x2_k5", "znver5"),
                                        ("2x2_k5", "haswell"), ("7x7_s2", "znver5"), ("7x7_s2", "skx")])
def test_padding_taps_fold_away(name, tname):
    """Where the tile spans the plane and the unrolled window is small: no padded copy, and after lowering
    one vector multiply-add per (pixel, tap) pair inside the unpadded input (a 5x5 window on a 2x2 plane:
    16 of 100); a tile of one row keeps the padded copy (channel-last, per channel block) and every tap."""
    kwargs = dict(CASES[IDS.index(name)][1])
    target = tvmfuse.parse_target(TARGETS[tname])
    tmpl, kname, func, match = _kernel(kwargs, target)
    res = schedule_prim_func(func, target, {}, kname)
    cfg, i = res.config, match.info
    assert res.template == DEPTHWISE and cfg["channel_lanes"] > 0
    assert folds_padding(i, cfg["oh_tile"], cfg["ow_tile"])
    k, stride = kwargs.get("k", 3), kwargs.get("stride", 1)
    pads = kwargs.get("pads", (1, 1, 1, 1))
    valid = _valid_taps(i["OH"], i["OW"], kwargs["h"], kwargs["w"], k, stride, pads[0], pads[1])
    assert valid < i["OH"] * i["OW"] * k * k
    assert _vector_multiplies(res.func, target) == valid
    allocs, _ = _structure(res.func)
    tile = cfg["oh_tile"] * cfg["ow_tile"] * cfg["channel_lanes"]
    assert sorted(n for _, n in allocs) == [tile], f"buffers other than the register tile: {allocs}"
    assert cfg["channel_lanes"] in _vector_loops(res.func)
    row = {**cfg, "oh_tile": 1, "parallel_depth": 1}
    copied = schedule_with(tmpl, match, func, row)
    assert _vector_multiplies(copied, target) == i["OW"] * k * k     # one row of pixels, the window unrolled
    padded_cols = kwargs["w"] + pads[1] + pads[3]
    allocs, _ = _structure(copied)
    assert any(n % (padded_cols * cfg["channel_lanes"]) == 0 and n > tile for _, n in allocs), allocs


@pytest.mark.parametrize("name", ["4x4_k5", "7x7_40"])
def test_channel_last_copy_per_block(name):
    """Without folding (a 5x5 window on a 4x4 plane: 400 unrolled copies; a 7-pixel row tile): the padded
    input is one channel block's, channel-last, inside the parallel loop (never the whole padded input), the
    channels vectorized in the copy, the window sum and the epilogue."""
    kwargs = dict(CASES[IDS.index(name)][1])
    target = tvmfuse.parse_target(ZNVER5)
    tmpl, kname, func, match = _kernel(kwargs, target)
    res = schedule_prim_func(func, target, {}, kname)
    cfg, i = res.config, match.info
    assert cfg["channel_lanes"] and not folds_padding(i, cfg["oh_tile"], cfg["ow_tile"])
    allocs, kinds = _structure(res.func)
    pad = kwargs.get("pads", (1, 1, 1, 1))
    whole = i["F"] * (kwargs["h"] + pad[0] + pad[2]) * (kwargs["w"] + pad[1] + pad[3])
    sizes = sorted(n for _, n in allocs)
    assert len(sizes) == 2 and sizes[1] < whole and sizes[1] % cfg["channel_lanes"] == 0, (sizes, whole)
    assert (kinds[0] == int(C.ForKind.PARALLEL)) == cfg["parallel"], (kinds[:3], cfg)
    assert _vector_loops(res.func).count(cfg["channel_lanes"]) >= 3, _vector_loops(res.func)


def test_plane_threshold_comes_from_the_target_table(monkeypatch):
    """lanes_plane_pixels_below (template_defaults["cpu.depthwise_conv2d_epilogue"]) decides: at 4 the 2x2
    plane keeps the columns on the lanes; at 300 the 16x16 one takes the channels; lanes_max_pixels caps
    the tile."""
    target = tvmfuse.parse_target(ZNVER5)
    small = _kernel(CASES[0][1], target)
    large = _kernel(CASES[-1][1], target)
    k5 = _kernel(CASES[2][1], target)
    assert small[0].default_config(small[3], target)["channel_lanes"] == 16
    assert large[0].default_config(large[3], target)["channel_lanes"] == 0
    table = json.loads(json.dumps(TG.cpu_table()))
    table["template_defaults"][DEPTHWISE]["lanes_plane_pixels_below"] = 4
    monkeypatch.setattr(TG, "cpu_table", lambda: table)
    assert small[0].default_config(small[3], target)["channel_lanes"] == 0
    table["template_defaults"][DEPTHWISE].update(lanes_plane_pixels_below=17, lanes_max_pixels=4)
    cfg = k5[0].default_config(k5[3], target)
    assert cfg["channel_lanes"] == 16 and cfg["oh_tile"] * cfg["ow_tile"] <= 4, cfg
    table["template_defaults"][DEPTHWISE]["lanes_plane_pixels_below"] = 300
    assert large[0].default_config(large[3], target)["channel_lanes"] == 16


def test_sampled_channel_lanes_configs_stay_correct(host):
    """Configs of the space with channel_lanes on (every tile, parallel depth, unroll) against the
    unscheduled kernel, on fresh random inputs; a record from before the knob reads back as 0."""
    assert DepthwiseConfig.pre_knob_values() == {"channel_lanes": 0}
    tmpl, name, func, match = _kernel(dict(cin=48, cout=48, h=6, w=4, stride=1, group=48), host)
    space = tmpl.space(match, host)
    ref = C.build_prim_module(C.IRModule({"main": func.with_attr("global_symbol", "main")}), target=host)
    data = np.random.default_rng()
    args = [data.standard_normal([int(d) for d in p.shape]).astype("float32") for p in func.params]
    want = C.tensor(np.zeros_like(args[-1]))
    ref["main"](*[C.tensor(a) for a in args[:-1]], want)
    rnd = random.Random(0)
    configs = [c for c in (space.sample(rnd) for _ in range(40)) if c["channel_lanes"]][:4]
    assert configs, "no sampled config with channel_lanes"
    for cfg in configs:
        f = schedule_with(tmpl, match, func, cfg)
        lib = C.build_prim_module(C.IRModule({"main": f.with_attr("global_symbol", "main")}), target=host)
        got = C.tensor(np.zeros_like(args[-1]))
        lib["main"](*[C.tensor(a) for a in args[:-1]], got)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4, err_msg=str(cfg))


def test_channel_lanes_not_dividing_the_channels_is_refused(host):
    tmpl, name, func, match = _kernel(CASES[0][1], host)
    cfg = {**tmpl.default_config(match, host), "channel_lanes": 12}
    with pytest.raises(ValueError, match="channel_lanes 12 does not divide the 32 channels"):
        schedule_with(tmpl, match, func, cfg)
