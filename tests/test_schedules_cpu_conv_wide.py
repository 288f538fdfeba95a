"""conv11: two changes to the static KxK conv templates for ResNet-like 3x3 convs.

1. ``cpu.conv2d_epilogue``'s ``shared_pad`` knob: with the channel blocks in the parallel loop
   (``parallel_depth`` 2, few row bands) the padded input is computed once, before the tiles, in its own
   parallel loop; before, each (row band, channel block) iteration copied its band again (F / oc_tile times).
2. ``cpu.conv2d_lanes`` on planes of ``plane_pixels_below`` pixels or more and fewer than
   ``wide_plane_pixels_below`` whose rows the direct template's register tile fills to less than
   ``wide_lane_use_below`` of the vector lanes (28 columns on AVX-512: 14 of 16 lanes): output channels on the
   lanes, weights blocked by the graph rewrite, the ``wide_min_accumulators`` / most-pixels tile.

Numerics: tvmfuse.compile on the host vs onnx's reference evaluator, and explicit configs vs the unscheduled
kernel, on fresh random inputs.  Structure on named targets (znver5, skylake-avx512, haswell, NEON): which
template takes the conv, the weight layout, the default tile, where the padded input is computed (parallel
loops, its buffer's size); and where the rules must not fire (rows the vector divides, a 56x56 plane,
NEON's 4 lanes, parallel_depth 1).
"""
import json

import numpy as np
import pytest

import tvmfuse
from tvmfuse import target as TG
from tvmfuse import _compat as C
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.base import schedule_with
from tvmfuse.schedules.cpu import common as U
from tvmfuse.schedules.cpu.conv2d import Conv2DEpilogue, row_lane_use
from tvmfuse.schedules.cpu.conv_lanes import FAMILY as LANES, plane_why

import schedule_cases as S
from conftest import assert_close_to_reference
from test_schedules_cpu import _structure
from test_schedules_cpu_conv import conv_block
from test_schedules_cpu_conv1x1 import _kernel

CONV = "cpu.conv2d_epilogue"
ZNVER5 = '{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver5", "num-cores": 2}'
NEON = '{"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "neoverse-n1", "num-cores": 2}'
TARGETS = {"znver5": ZNVER5, "skylake": S.SKYLAKE, "haswell": S.HASWELL, "neon": NEON}

# bench_cpu.py's resnet_block at half its channels (16 -> 16 on 28x28, the residual add), and at 32 output
# channels (two vectors: the wide tile 1 x 7 x 2), cheap to build
RESNET_28 = dict(cin=16, cout=16, h=28, w=28)
WIDE_28 = dict(cin=16, cout=32, h=28, w=28)


def _parallel_loops(func) -> int:
    return sum(1 for f in S.loops(func) if int(f.kind) == int(C.ForKind.PARALLEL))


# ----------------------------------------------------------------------------------------- lane use
def test_row_lane_use():
    """The direct template's best row tile: 14 of 16 lanes on 28 or 56 columns, whole vectors on 16/32/64,
    7 of 8 on AVX2's 28 columns, every lane on NEON's 4."""
    assert row_lane_use(28, 16) == row_lane_use(56, 16) == 0.875
    assert row_lane_use(16, 16) == row_lane_use(32, 16) == row_lane_use(64, 16) == 1.0
    assert row_lane_use(28, 8) == 0.875 and row_lane_use(56, 8) == 1.0
    assert row_lane_use(28, 4) == 1.0
    assert row_lane_use(7, 16) == 7 / 16


# ----------------------------------------------------------------------------------------- wide planes
# (target, conv_block kwargs, template, default (oh_tile, ow_tile, nvec) on the lanes)
WIDE = [
    ("znver5", RESNET_28, CONV, None),          # one vector of channels: 1 x 7 x 1, under wide_min_accumulators
    ("neon", dict(cin=8, cout=16, h=17, w=17), CONV, None),     # 17 columns: a 1 x 1 x 4 tile, 4 accumulators
    ("znver5", dict(cin=16, cout=32, h=28, w=28), LANES, (1, 7, 2)),
    ("skylake", dict(cin=16, cout=32, h=28, w=28), LANES, (1, 7, 2)),
    ("haswell", dict(cin=16, cout=32, h=28, w=28), LANES, (1, 4, 2)),   # 16 registers: 8 accumulators
    ("neon", dict(cin=16, cout=32, h=28, w=28), CONV, None),            # 28 = 7 x 4 lanes: every lane used
    ("skylake", dict(cin=16, cout=32, h=32, w=32), CONV, None),         # 32 columns: whole vectors
    ("skylake", dict(cin=16, cout=32, h=56, w=56), CONV, None),         # 3136 pixels: wide_plane_pixels_below
    ("haswell", dict(cin=16, cout=32, h=56, w=56), CONV, None),         # 56 = 7 x 8 lanes
]
WIDE_IDS = [f"{t}-{k['cout']}x{k['h']}" for t, k, _, _ in WIDE]


@pytest.mark.parametrize("tname,kwargs,template,tile", WIDE, ids=WIDE_IDS)
def test_wide_plane_route(tname, kwargs, template, tile):
    """Which template takes a 3x3 conv on a plane of 256 pixels or more, its weight layout and default tile."""
    tgt = tvmfuse.parse_target(TARGETS[tname])
    kname, func = _kernel(conv_block(**kwargs), tgt)
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is not None and res.template == template, res and res.template
    w = [int(d) for d in func.params[1].shape]
    if template == CONV:
        assert w == [kwargs["cout"], kwargs["cin"], 3, 3], f"weights rewritten for a declined conv: {w}"
        assert plane_why(kwargs["h"], kwargs["w"], kwargs["cout"], kwargs["cin"], tgt) is not None
        return
    cfg = res.config
    assert (cfg["oh_tile"], cfg["ow_tile"], cfg["nvec"]) == tile, cfg
    block = cfg["nvec"] * cfg["lanes"]
    assert w == [kwargs["cout"] // block, kwargs["cin"], 3, 3, block], w
    # vectors of output channels, nothing scalarized, the padded input once (its own parallel loop) and one
    # register tile of the conv's output
    assert cfg["lanes"] in S.vector_lanes(res.func)
    assert not S.scalarized_loops(res.func), "a vectorized loop was scalarized"
    assert _parallel_loops(res.func) == 2
    allocs, _ = _structure(res.func)
    padded = kwargs["cin"] * (kwargs["h"] + 2) * (kwargs["w"] + 2)
    assert sorted(n for _, n in allocs) == sorted([padded, cfg["oh_tile"] * cfg["ow_tile"] * block]), allocs


def test_wide_rule_comes_from_the_target_table(monkeypatch):
    """wide_lane_use_below 0 (never) or wide_plane_pixels_below at the plane's pixels: the 28x28 conv keeps its
    OIHW weights and the direct template, the kernel of before this rule."""
    tgt = tvmfuse.parse_target(ZNVER5)
    model = conv_block(**WIDE_28)
    kname, func = _kernel(model, tgt)
    assert schedule_prim_func(func, tgt, {}, kname).template == LANES
    for entry, value in (("wide_lane_use_below", 0), ("wide_plane_pixels_below", 784)):
        table = json.loads(json.dumps(TG.cpu_table()))
        table["template_defaults"][LANES][entry] = value
        monkeypatch.setattr(TG, "cpu_table", lambda table=table: table)
        kname, func = _kernel(model, tgt)
        assert [int(d) for d in func.params[1].shape] == [32, 16, 3, 3], entry
        assert schedule_prim_func(func, tgt, {}, kname).template == CONV, entry


def test_wide_plane_numerics_vs_reference(host, rng):
    """The 16 -> 32 conv on 28x28 with its residual add, compiled for the host (on the lanes where the host's vectors
    leave the direct template's rows partly empty, else the direct template) vs the ONNX reference."""
    model = conv_block(**WIDE_28)
    cm = tvmfuse.compile(model, host)
    want = CONV if plane_why(28, 28, 32, 16, host) else LANES
    assert [s["template"] for s in cm.report.schedules] == [want], cm.report.schedules
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------- shared_pad
def _direct(kwargs, tgt):
    """The direct template's kernel of ``kwargs`` (the CPU rewrites off: OIHW weights) and its match."""
    kname, func = _kernel(conv_block(**kwargs), tgt, schedules=False)
    t = Conv2DEpilogue()
    match = t.match(func, tgt)
    assert match is not None
    return func, t, match


# resnet18's first stage at the corpus' 64x64 input (64 -> 64 on 16x16) at a quarter of its channels: 4 row
# bands of 4 rows (oh_tile 4) < 4 per core x 2 cores, so the channel blocks join the parallel loop
STAGE_16 = dict(cin=16, cout=16, h=16, w=16)


@pytest.mark.parametrize("tname", ["znver5", "skylake", "haswell", "neon"])
def test_shared_pad_structure(tname):
    """parallel_depth 2 takes shared_pad by default: the padded input is one buffer of the whole padded
    plane, computed before the tiles (in its own parallel loop where it is over the fork/join cost); shared_pad off (the kernel of before) copies
    a band of oh_tile + 2 rows inside the tiles' one parallel loop.  parallel_depth 1 (a 56x56 plane) keeps
    the copy per band by default."""
    tgt = tvmfuse.parse_target(TARGETS[tname])
    func, t, match = _direct(STAGE_16, tgt)
    cfg = t.default_config(match, tgt)
    assert cfg["shared_pad"] == (cfg["parallel_depth"] == 2) and not cfg["im2col"], cfg
    # AVX-512: 4-row tiles, 4 bands; haswell's 1-row tiles make 16 bands (depth 1); the structure at depth 2
    assert cfg["parallel_depth"] == (2 if tname in ("znver5", "skylake") else cfg["parallel_depth"])
    cfg = {**cfg, "parallel_depth": 2, "shared_pad": True}
    whole = STAGE_16["cin"] * 18 * 18
    shared = schedule_with(t, match, func, cfg)
    allocs, _ = _structure(shared)
    assert whole in [n for _, n in allocs], allocs
    # the copy of 16 x 18 x 18 floats is under the fork/join cost (2 x 16384): serial, before the tiles' one
    # parallel loop; with the cost lowered to a tenth of it, its own parallel loop
    assert whole < U.min_parallel_work(tgt) and _parallel_loops(shared) == 1
    small = dict(match.info, min_parallel_work=whole // 10)
    assert _parallel_loops(schedule_with(t, type(match)(match.family, small), func, cfg)) == 2
    before = schedule_with(t, match, func, {**cfg, "shared_pad": False})
    allocs, _ = _structure(before)
    band = STAGE_16["cin"] * (cfg["oh_tile"] + 2) * 18
    assert band in [n for _, n in allocs] and whole not in [n for _, n in allocs], allocs
    assert _parallel_loops(before) == 1
    # a record written before the knob existed reads back as the kernel of before
    assert t.config_type.pre_knob_values()["shared_pad"] is False
    wide = dict(cin=16, cout=16, h=56, w=56)
    _, t2, m2 = _direct(wide, tgt)
    c2 = t2.default_config(m2, tgt)
    assert c2["parallel_depth"] == 1 and not c2["shared_pad"], c2


@pytest.mark.parametrize("depth", [1, 2])
def test_shared_pad_numerics(depth, host, rng):
    """shared_pad on and off, at both parallel depths, computes what the unscheduled kernel computes; and the
    compiled block (default: shared_pad) matches the ONNX reference."""
    func, t, match = _direct(STAGE_16, host)
    args = S.random_args(func, rng)
    want = S.run_func(func, host, args)[0]
    cfg = t.default_config(match, host)
    for shared in (True, False):
        got = S.run_func(schedule_with(t, match, func, {**cfg, "parallel_depth": depth, "shared_pad": shared}),
                         host, args)[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"shared_pad={shared}")
    if depth == 2:
        model = conv_block(**STAGE_16)
        cm = tvmfuse.compile(model, host)
        assert [s["template"] for s in cm.report.schedules] == [CONV], cm.report.schedules
        assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)
