"""cpu.conv2d_lanes (tvmfuse/schedules/cpu/conv_lanes.py) and the graph rewrite that feeds it
(passes/rewrites.py: TransposePointwiseWeights stores the constant weights of a KxK or strided conv on a small
plane blocked by the register tile's channels, [co // B, ci, ky, kx, B]): convs with a window on small planes with
the output channels on the vector lanes.

Numerics: tvmfuse.compile on the host vs onnx's reference evaluator (SqueezeNet's 3x3 fire convs on 15x15,
7x7 and 3x3 planes, ResNet's 3x3 convs on 8x8 / 4x4 / 2x2 planes with the residual add, a strided 3x3 conv,
a 5x5 window, dilation), and sampled knob configurations vs the unscheduled kernel, on fresh random inputs.
Structure on named AVX2 / AVX-512 targets: the template and the weight layout, vectors of output channels
only, one parallel loop for the tiles (and one for the small padded input), the conv's output only as a
register tile, nothing scalarized, bounded unrolling; where the family declines (a plane of 256 pixels or
more, channels no vector divides, a depthwise or grouped conv, weights that are no constants) the conv keeps
its OIHW weights and the template it had before.
"""
import json

import numpy as np
import pytest

import tvmfuse
from tvmfuse import target as TG
from tvmfuse import _compat as C
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu.common import MAX_UNROLLED_COPIES
from tvmfuse.schedules.base import schedule_with
from tvmfuse.schedules.cpu.conv_lanes import FAMILY, ConvLanes, folds_padding, pixel_tiles

import schedule_cases as S
from conftest import assert_close_to_reference
from test_schedules_cpu import _structure
from test_schedules_cpu_conv import conv_block
from test_schedules_cpu_conv1x1 import _kernel

CONV = "cpu.conv2d_epilogue"
# (name, conv_block kwargs): squeezenet1_1's fire-module 3x3 expand convs, resnet18's (1/8 width) late
# stages with their residual add, a strided conv, a 5x5 window, a dilated window, odd channel counts
CASES = [
    ("fire_15x15", dict(cin=16, cout=64, h=15, w=15, residual=False, bn=False)),
    ("fire_7x7", dict(cin=32, cout=128, h=7, w=7, residual=False, bn=False)),
    ("fire_3x3", dict(cin=48, cout=192, h=3, w=3, residual=False, bn=False)),
    ("resnet_8x8_residual", dict(cin=16, cout=16, h=8, w=8)),
    ("resnet_2x2_residual", dict(cin=64, cout=64, h=2, w=2)),
    ("stride2_4x4", dict(cin=32, cout=64, h=4, w=4, stride=2, residual=False)),
    ("k5_pad2_plain", dict(cin=8, cout=24, h=9, w=10, k=5, pads=(2, 2, 2, 2), residual=False, bn=False,
                           relu=False)),
    ("asym_pad_5x6", dict(cin=12, cout=40, h=5, w=6, pads=(0, 1, 1, 0), residual=False)),
]
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("name,kwargs", CASES, ids=IDS)
def test_numerics_vs_reference(name, kwargs, host, rng):
    model = conv_block(**kwargs)
    cm = tvmfuse.compile(model, host)
    used = [s["template"] for s in cm.report.schedules]
    assert used == [FAMILY], cm.report.schedules
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)


def test_dilated_window_numerics(host, rng):
    """A dilated 3x3 window (pads 2, dilation 2) on a 6x6 plane: the broadcast input index carries the
    dilation."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array((rng.standard_normal((32, 8, 3, 3)) * 0.2).astype(np.float32), "W")
    node = helper.make_node("Conv", ["x", "W"], ["y"], kernel_shape=[3, 3], pads=[2, 2, 2, 2], dilations=[2, 2])
    g = helper.make_graph([node], "dilated", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 6, 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, 6, 6])], [w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    cm = tvmfuse.compile(model, host)
    assert [s["template"] for s in cm.report.schedules] == [FAMILY], cm.report.schedules
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,kwargs", [CASES[1], CASES[5], CASES[7]], ids=[CASES[1][0], CASES[5][0], CASES[7][0]])
def test_sampled_configs_vs_unscheduled(name, kwargs, host, rng):
    """Every sampled knob combination applies (oh_tile with a partial-row ow_tile falls back to one row) and
    computes what the unscheduled kernel does."""
    kname, func = _kernel(conv_block(**kwargs), host)
    t = ConvLanes()
    match = t.match(func, host)
    assert match is not None and match.info["weight_layout"] == "OIHWo"
    S.assert_sampled_configs_compute_the_unscheduled(t, match, func, host, rng)


@pytest.mark.parametrize("target,lanes", [(S.HASWELL, 8), (S.SKYLAKE, 16)], ids=["haswell", "skylake"])
@pytest.mark.parametrize("name,kwargs", CASES[:6], ids=IDS[:6])
def test_structure(name, kwargs, target, lanes):
    tgt = tvmfuse.parse_target(target)
    kname, func = _kernel(conv_block(**kwargs), tgt)
    k = kwargs.get("k", 3)
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is not None and res.template == FAMILY, res and res.template
    cfg = res.config
    block = cfg["nvec"] * cfg["lanes"]
    assert [int(d) for d in func.params[1].shape] == [kwargs["cout"] // block, kwargs["cin"], k, k, block], \
        "weights not stored in blocks of the register tile's channels [co // B, ci, ky, kx, B] by the graph"
    oh, ow = _plane(func)
    assert (cfg["oh_tile"], cfg["ow_tile"]) in pixel_tiles(oh, ow), cfg
    assert kwargs["cout"] % (cfg["nvec"] * cfg["lanes"]) == 0 and cfg["lanes"] in (lanes, lanes // 2), cfg
    tile = cfg["oh_tile"] * cfg["ow_tile"] * cfg["nvec"]
    assert tile + cfg["nvec"] + 1 <= (32 if lanes == 16 else 16), f"register tile {cfg} spills"
    # vectors of output channels only (the padding copy is vectorized along its rows: that loop's extent
    # is a padded row, not a vector of channels)
    assert cfg["lanes"] in S.vector_lanes(res.func)
    assert not S.scalarized_loops(res.func), "a vectorized loop was scalarized"
    # the padded input copied in its own parallel loop, unless the tile spans the plane (pad_in_loads: the
    # padding read in the loads, no copy)
    folded = folds_padding(ConvLanes().match(func, tgt).info, cfg["oh_tile"], cfg["ow_tile"], cfg["nvec"])
    assert folded == ((cfg["oh_tile"], cfg["ow_tile"]) == (oh, ow) and kwargs.get("pads", (1,)) != (0, 0, 0, 0)), cfg
    assert folded == (name in PLANE_TILES), (name, cfg)
    copied = kwargs.get("pads", (1,)) != (0, 0, 0, 0) and not folded
    parallel = [f for f in S.loops(res.func) if int(f.kind) == int(C.ForKind.PARALLEL)]
    assert len(parallel) == (2 if copied else 1), len(parallel)
    allocs, _ = _structure(res.func)
    padded = kwargs["cin"] * (kwargs["h"] + 2) * (kwargs["w"] + 2)        # pads 1: the small padded input
    assert sorted(n for _, n in allocs) == sorted([padded] * copied + [tile * cfg["lanes"]]), \
        f"buffers other than the padded input and one register tile of the conv's output: {allocs}"
    assert S.max_unrolled_copies(res.func) <= MAX_UNROLLED_COPIES


# the cases whose default register tile spans the output plane (3x3, 2x2): pad_in_loads applies
PLANE_TILES = {"fire_3x3", "resnet_2x2_residual", "stride2_4x4"}


def _valid_taps(oh, ow, h, w, k, stride, pad) -> int:
    """(output pixel, window tap) pairs whose input lies inside the unpadded plane."""
    return sum(0 <= y * stride + ky - pad < h and 0 <= x * stride + kx - pad < w
               for y in range(oh) for x in range(ow) for ky in range(k) for kx in range(k))


def _vector_multiplies(func, target) -> int:
    """Vector multiplies left in ``func`` after TVM's TIR lowering (unrolled, simplified) for ``target``."""
    mod = C.lower_tir(C.IRModule({"main": func.with_attr("global_symbol", "main")}), target)
    found = []
    C.post_order_visit(mod["main"].body, lambda n: found.append(n) if isinstance(n, C.tirx.Mul) and
                       not n.ty.is_scalar() else None)
    return len(found)


@pytest.mark.parametrize("name", ["fire_3x3", "stride2_4x4"])
def test_padding_taps_fold_away(name):
    """pad_in_loads (the default where the tile spans the plane): after lowering, one multiply-add per
    vector of channels per (pixel, tap) pair inside the unpadded input, per input channel (a 3x3 window on
    a 3x3 plane: 49 of 81 pairs); with pad_in_loads off, every pair of the padded window (the row loop
    kept, kx unrolled); no padded copy left."""
    kwargs = dict(CASES[IDS.index(name)][1])
    tgt = tvmfuse.parse_target(S.SKYLAKE)
    kname, func = _kernel(conv_block(**kwargs), tgt)
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res.config["pad_in_loads"] is True
    oh, ow = _plane(func)
    stride = kwargs.get("stride", 1)
    nvec, k = res.config["nvec"], kwargs.get("k", 3)
    assert (res.config["oh_tile"], res.config["ow_tile"]) == (oh, ow)
    valid = _valid_taps(oh, ow, kwargs["h"], kwargs["w"], k, stride, 1)
    assert valid < oh * ow * k * k
    assert _vector_multiplies(res.func, tgt) == valid * nvec
    assert not _structure(res.func)[0][1:], "a padded copy left"
    copied = schedule_with(ConvLanes(), ConvLanes().match(func, tgt), func, {**res.config, "pad_in_loads": False})
    assert _vector_multiplies(copied, tgt) == oh * ow * k * nvec       # ky a loop, kx unrolled: no folding


def _plane(func) -> tuple[int, int]:
    out = [int(d) for d in func.params[-1].shape]
    return out[2], out[3]


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
@pytest.mark.parametrize("kwargs,template", [
    (dict(cin=16, cout=32, h=16, w=16), CONV),                        # a 256-pixel plane: along the pixels
    (dict(cin=16, cout=10, h=7, w=7), CONV),                          # 10 channels: no vector divides them
    (dict(cin=32, cout=32, h=7, w=7, group=32), "cpu.depthwise_conv2d_epilogue"),
    (dict(cin=32, cout=32, h=7, w=7, group=2), CONV),                 # grouped
    (dict(cin=3, cout=64, h=64, w=64, stride=2, pads=(0, 0, 0, 0)), CONV),    # squeezenet's stem (31x31)
    (dict(cin=3, cout=32, h=8, w=8), CONV),                           # 3 input channels (min_in_channels)
    (dict(cin=8, cout=16, h=15, w=17), CONV),                         # 17 columns: a 1-pixel tile
], ids=["large_plane", "10_channels", "depthwise", "grouped", "stem_31x31", "3_in_channels", "17_columns"])
def test_declined_convs_keep_oihw_weights_and_their_template(kwargs, template, target):
    """Convs this family declines stay as they were: OIHW weights, the direct (or depthwise) template."""
    tgt = tvmfuse.parse_target(target)
    kname, func = _kernel(conv_block(**kwargs), tgt)
    w = [int(d) for d in func.params[1].shape]
    assert w[0] == kwargs["cout"], f"weights transposed: {w}"
    assert ConvLanes().match(func, tgt) is None
    assert schedule_prim_func(func, tgt, {}, kname).template == template


def test_weights_as_graph_input_stay_with_the_direct_template(host, rng):
    """Weights that are no constant (a graph input) are not rewritten, and this family (which reads weights
    with the output channels last only) declines: the direct template reads them OIHW, and the numbers match the
    reference."""
    model = S.conv_relu_weights_input(cin=32, cout=128, hw=7, k=3)
    cm = tvmfuse.compile(model, host)
    assert [s["template"] for s in cm.report.schedules] == [CONV], cm.report.schedules
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)


def test_plane_threshold_comes_from_the_target_table(monkeypatch):
    """plane_pixels_below and wide_lane_use_below (template_defaults["cpu.conv2d_lanes"]) decide: with the first
    lowered to 49 the 7x7 fire conv is a wide plane, still taken (its 7-column rows fill 7 of 16 lanes) with the
    wide tile rule; with the second 0 as well, it keeps its OIHW weights and the direct conv template."""
    tgt = tvmfuse.parse_target(S.SKYLAKE)
    model = conv_block(**CASES[1][1])
    assert schedule_prim_func(_kernel(model, tgt)[1], tgt, {}).template == FAMILY
    table = json.loads(json.dumps(TG.cpu_table()))
    table["template_defaults"][FAMILY]["plane_pixels_below"] = 49
    monkeypatch.setattr(TG, "cpu_table", lambda: table)
    kname, func = _kernel(model, tgt)
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res.template == FAMILY
    assert (res.config["oh_tile"], res.config["ow_tile"], res.config["nvec"]) == (1, 7, 2), res.config
    table["template_defaults"][FAMILY]["wide_lane_use_below"] = 0
    kname, func = _kernel(model, tgt)
    assert [int(d) for d in func.params[1].shape] == [128, 32, 3, 3]
    assert schedule_prim_func(func, tgt, {}, kname).template == CONV


# (name, conv_block kwargs, target, default (oh_tile, ow_tile, nvec)): the table's max_accumulators (18)
# caps the default register tile with 32 vector registers (squeezenet's 15x15 fire conv was 1 x 5 x 4 = 20,
# its 48->192 3x3-plane conv 3 x 3 x 3 = 27); the 64->256 conv's 3 x 3 x 2 (18) and every AVX2 tile (at most
# 14 accumulators fit 16 registers) are under it: must not change.  On haswell the 48->192 3x3-plane conv's 9
# accumulators are the whole plane x 1 vector (3 x 3 x 1, its padded taps fold away: pick_tile's tie-break),
# not 1 x 3 x 3
ACC_CAP = [
    ("fire_15x15_skylake", CASES[0][1], S.SKYLAKE, (1, 3, 4)),
    ("fire_3x3_192_skylake", CASES[2][1], S.SKYLAKE, (3, 3, 2)),
    ("fire_3x3_256_skylake", dict(cin=64, cout=256, h=3, w=3, residual=False, bn=False), S.SKYLAKE, (3, 3, 2)),
    ("fire_15x15_haswell", CASES[0][1], S.HASWELL, (1, 5, 2)),
    ("fire_3x3_192_haswell", CASES[2][1], S.HASWELL, (3, 3, 1)),
]


@pytest.mark.parametrize("name,kwargs,target,tile", ACC_CAP, ids=[c[0] for c in ACC_CAP])
def test_default_tile_under_the_accumulator_cap(name, kwargs, target, tile):
    tgt = tvmfuse.parse_target(target)
    kname, func = _kernel(conv_block(**kwargs), tgt)
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is not None and res.template == FAMILY, res and res.template
    cfg = res.config
    assert (cfg["oh_tile"], cfg["ow_tile"], cfg["nvec"]) == tile, cfg
    assert tile[0] * tile[1] * tile[2] <= TG.template_defaults(tgt, FAMILY)["max_accumulators"]
    block = cfg["nvec"] * cfg["lanes"]      # the graph rewrite blocks the weights by the capped tile
    assert int(func.params[1].shape[-1]) == block
    # the tile's accumulators only: one register tile of the conv's output and the small padded input (none
    # where the tile spans the plane: pad_in_loads)
    allocs, _ = _structure(res.func)
    copied = not folds_padding(ConvLanes().match(func, tgt).info, *tile)
    assert sorted(n for _, n in allocs) == sorted([kwargs["cin"] * (kwargs["h"] + 2) * (kwargs["w"] + 2)] * copied
                                                  + [tile[0] * tile[1] * block])


def test_plane_tile_tie_break_only_for_padded_convs():
    """pick_tile prefers the plane-spanning tile only between tiles of as many accumulators and only for a
    padded conv (its taps on the padding fold away); an unpadded conv keeps the tile with fewer loads, and a
    larger tile still wins over a folding one."""
    from tvmfuse.schedules.cpu.conv_lanes import pick_tile
    nvecs = (1, 2, 3, 4, 6, 8)
    assert pick_tile(3, 3, 192, 8, 16, nvecs, 18, fold_window=9) == (3, 3, 1)
    assert pick_tile(3, 3, 192, 8, 16, nvecs, 18, fold_window=0) == (1, 3, 3)
    assert pick_tile(3, 3, 256, 16, 32, nvecs, 18, fold_window=9) == (3, 3, 2)
    # 16 registers, a 7x7 plane: no tile spans it (49 pixels), the tie-break never applies
    assert pick_tile(7, 7, 128, 8, 16, nvecs, 18, fold_window=9) == pick_tile(7, 7, 128, 8, 16, nvecs, 18)


def test_unpadded_3x3_plane_keeps_the_row_tile():
    """A 3x3 conv without padding onto a 3x3 plane (5x5 input), haswell: nothing to fold, the default stays
    1 x 3 pixels x 3 vectors (and the weights are blocked by it)."""
    tgt = tvmfuse.parse_target(S.HASWELL)
    kname, func = _kernel(conv_block(cin=48, cout=192, h=5, w=5, pads=(0, 0, 0, 0), residual=False, bn=False), tgt)
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res.template == FAMILY
    cfg = res.config
    assert (cfg["oh_tile"], cfg["ow_tile"], cfg["nvec"]) == (1, 3, 3), cfg
    assert int(func.params[1].shape[-1]) == cfg["nvec"] * cfg["lanes"]
    assert not folds_padding(ConvLanes().match(func, tgt).info, 3, 3, 1)
