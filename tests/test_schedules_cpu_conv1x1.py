"""cpu.conv1x1 (tvmfuse/schedules/cpu/conv1x1.py) and the graph rewrite that feeds it
(passes/rewrites.py: TransposePointwiseWeights): 1x1 stride-1 convs on small planes as matmuls with the output
channels on the vector lanes.

Numerics: tvmfuse.compile on the host vs onnx's reference evaluator (planes 1x1 to 15x15, with and without
BN/bias + ReLU and a residual add), and sampled knob configurations vs the unscheduled kernel (weights
transposed by the graph, or packed by the kernel), on fresh random inputs.
Structure on named AVX2 / AVX-512 targets: the template and the weight layout, vectors of output channels
(whole vectors of the target's or half its width, never a vector of pixels), one parallel loop, the conv's
output only as a register tile, nothing scalarized, bounded unrolling; where the family declines (a large
plane, channels no vector divides, a window, groups) the conv keeps its OIHW weights and cpu.conv2d_epilogue.
"""
import json

import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import target as TG
from tvmfuse.pipeline import PipelineOptions, graph_stage
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.base import schedule_with
from tvmfuse.schedules.cpu.common import MAX_UNROLLED_COPIES, PARALLEL_FAMILY, min_parallel_work
from tvmfuse.schedules.cpu.conv1x1 import FAMILY, Conv1x1, parallel_why_not

import schedule_cases as S
from conftest import assert_close_to_reference
from test_schedules_cpu import _structure
from test_schedules_cpu_conv import conv_block

CONV = "cpu.conv2d_epilogue"
# (cout, cin, plane side, epilogue): mobilenet_v2's 2x2 and 4x4 planes with many channels, squeezenet's 7x7
# and 15x15 fire modules, a 1x1 plane (after a global pool)
EPILOGUES = {"bn_relu_residual": dict(bn=True, relu=True, residual=True),
             "bias_relu": dict(bn=True, relu=True, residual=False),
             "plain": dict(bn=False, relu=False, residual=False),
             "residual": dict(bn=False, relu=False, residual=True)}
CASES = [(1280, 320, 1, "bias_relu"), (1280, 112, 2, "plain"), (512, 64, 4, "bn_relu_residual"),
         (96, 24, 7, "residual"), (64, 16, 15, "bias_relu"), (16, 128, 15, "bn_relu_residual"),
         (32, 128, 7, "plain"), (64, 16, 2, "bn_relu_residual")]
IDS = [f"{co}x{ci}_{hw}x{hw}_{epi}" for co, ci, hw, epi in CASES]


def _model(cout, cin, hw, epi):
    return conv_block(cin, cout, hw, hw, k=1, pads=(0, 0, 0, 0), **EPILOGUES[epi])


def _kernel(model, target, schedules=True):
    """The one fused PrimFunc of ``model`` (``schedules`` False: the graph stage without the CPU rewrites,
    so the conv keeps its OIHW weights)."""
    mod = tvmfuse.load_onnx(model)
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions(schedules=schedules)))(mod)
    funcs = [(str(gv.name_hint), f) for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)]
    assert len(funcs) == 1, [n for n, _ in funcs]
    return funcs[0]


@pytest.mark.parametrize("cout,cin,hw,epi", CASES, ids=IDS)
def test_numerics_vs_reference(cout, cin, hw, epi, host, rng):
    model = _model(cout, cin, hw, epi)
    cm = tvmfuse.compile(model, host)
    used = [s["template"] for s in cm.report.schedules]
    assert used == [FAMILY], cm.report.schedules
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("transposed", [True, False], ids=["blocked_weights", "packed_oihw_weights"])
@pytest.mark.parametrize("cout,cin,hw,epi", [(96, 24, 7, "bn_relu_residual"), (48, 40, 3, "plain")],
                         ids=["96x24_7x7", "48x40_3x3"])
def test_sampled_configs_vs_unscheduled(cout, cin, hw, epi, transposed, host, rng):
    """Every sampled knob combination applies and computes what the unscheduled kernel does, with the graph's
    transposed weights or (weights that are no constants) the kernel's packed copy."""
    name, func = _kernel(_model(cout, cin, hw, epi), host, schedules=transposed)
    t = Conv1x1()
    match = t.match(func, host)
    assert match is not None and match.info["weight_layout"] == ("OIHWo" if transposed else "OIHW")
    S.assert_sampled_configs_compute_the_unscheduled(t, match, func, host, rng)


@pytest.mark.parametrize("target,lanes", [(S.HASWELL, 8), (S.SKYLAKE, 16)], ids=["haswell", "skylake"])
@pytest.mark.parametrize("cout,cin,hw,epi", CASES, ids=IDS)
def test_structure(cout, cin, hw, epi, target, lanes):
    tgt = tvmfuse.parse_target(target)
    name, func = _kernel(_model(cout, cin, hw, epi), tgt)
    weight = func.params[1]
    res = schedule_prim_func(func, tgt, {}, name)
    assert res is not None and res.template == FAMILY, res and res.template
    cfg = res.config
    block = cfg["nvec"] * cfg["lanes"]
    assert [int(d) for d in weight.shape] == [cout // block, cin, 1, 1, block], \
        "weights not stored in blocks of the register tile's channels [co // B, ci, 1, 1, B] by the graph"
    assert cout % (cfg["nvec"] * cfg["lanes"]) == 0 and cfg["lanes"] in (lanes, lanes // 2), cfg
    # vectors of output channels only: a pixel vector would have the plane's (or a row's) extent
    assert S.vector_lanes(res.func) == {cfg["lanes"]}, (S.vector_lanes(res.func), cfg)
    assert not S.scalarized_loops(res.func), "a vectorized loop was scalarized"
    parallel = [f for f in S.loops(res.func) if int(f.kind) == int(C.ForKind.PARALLEL)]
    # one parallel loop (the weights need no copy); none under the fork/join cost (64x16 on 2x2, 96x24 on 7x7)
    wanted = int(cout * cin * hw * hw >= min_parallel_work(tgt))
    assert len(parallel) == wanted, f"{len(parallel)} parallel loops, expected {wanted}"
    allocs, _ = _structure(res.func)
    out_elems = cout * hw * hw
    assert all(n < out_elems or n == cfg["mr"] * cfg["nvec"] * cfg["lanes"] for _, n in allocs), allocs
    assert [n for _, n in allocs] == [cfg["mr"] * cfg["nvec"] * cfg["lanes"]], \
        f"the conv's output is not one register tile: {allocs}"
    assert S.max_unrolled_copies(res.func) <= MAX_UNROLLED_COPIES


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
def test_packed_weights_without_the_rewrite(target):
    """Weights the graph did not transpose (OIHW): one packed copy in its own parallel loop, written in whole
    vectors of channels; the tiles' loop is not nested in it."""
    tgt = tvmfuse.parse_target(target)
    name, func = _kernel(_model(96, 24, 7, "bias_relu"), tgt, schedules=False)
    t = Conv1x1()
    match = t.match(func, tgt)
    sched = schedule_with(t, match, func, t.default_config(match, tgt))
    top = [f for f in S.loops(sched) if int(f.kind) == int(C.ForKind.PARALLEL)]
    assert len(top) == 2, len(top)
    nested = []
    for loop in top:
        C.post_order_visit(loop.body, lambda n: nested.append(n) if isinstance(n, C.tirx.For)
                           and int(n.kind) == int(C.ForKind.PARALLEL) else None)
    assert not nested, "a parallel loop inside another"
    allocs, _ = _structure(sched)
    assert (f"{match.info['weight_buffer']}_global", 24 * 96) in allocs, allocs
    assert not S.scalarized_loops(sched)


LANES = "cpu.conv2d_lanes"


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
@pytest.mark.parametrize("kwargs,why,template", [
    (dict(cin=16, cout=48, h=16, w=16, k=1, pads=(0, 0, 0, 0)), "plane of 256 pixels", CONV),
    (dict(cin=16, cout=10, h=7, w=7, k=1, pads=(0, 0, 0, 0)), "no vector width", CONV),
    (dict(cin=16, cout=32, h=7, w=7, k=3), None, LANES),
    (dict(cin=16, cout=32, h=7, w=7, k=1, pads=(0, 0, 0, 0), group=2), None, CONV),
    (dict(cin=16, cout=32, h=14, w=14, k=1, stride=2, pads=(0, 0, 0, 0)), None, LANES),
], ids=["large_plane", "10_channels", "3x3", "grouped", "stride_2"])
def test_declined_convs_keep_oihw_weights_and_the_conv_template(kwargs, why, template, target):
    """Convs this family declines: the direct conv template with OIHW weights, or (a window or a stride on a
    small plane) cpu.conv2d_lanes with weights blocked [co // B, ci, ky, kx, B]
    (tests/test_schedules_cpu_conv_lanes.py)."""
    tgt = tvmfuse.parse_target(target)
    name, func = _kernel(conv_block(**kwargs), tgt)
    w = [int(d) for d in func.params[1].shape]
    blocked = template != CONV
    assert (w[0] * w[-1] if blocked else w[0]) == kwargs["cout"] and len(w) == (5 if blocked else 4), f"weights: {w}"
    assert Conv1x1().match(func, tgt) is None
    res = schedule_prim_func(func, tgt, {}, name)
    assert res.template == template, res.template
    if why:
        from tvmfuse.schedules.cpu.conv1x1 import plane_why

        hw = kwargs["h"] * kwargs["w"]
        assert why in plane_why(hw, kwargs["cout"], tgt)


def test_plane_threshold_comes_from_the_target_table(monkeypatch):
    """plane_pixels_below (template_defaults["cpu.conv1x1"]) decides: lowered below 7x7, the 7x7 conv keeps
    its OIHW weights and the direct conv template."""
    tgt = tvmfuse.parse_target(S.SKYLAKE)
    model = _model(96, 24, 7, "bias_relu")
    assert schedule_prim_func(_kernel(model, tgt)[1], tgt, {}).template == FAMILY
    table = json.loads(json.dumps(TG.cpu_table()))
    table["template_defaults"][FAMILY]["plane_pixels_below"] = 49
    monkeypatch.setattr(TG, "cpu_table", lambda: table)
    name, func = _kernel(model, tgt)
    assert [int(d) for d in func.params[1].shape] == [96, 24, 1, 1]
    assert schedule_prim_func(func, tgt, {}, name).template == CONV


def test_weights_as_graph_input_are_packed_by_the_kernel(host, rng):
    """Weights that are no constant (a graph input) are not rewritten: the kernel reads them OIHW through its
    packed copy, and the numbers match the reference."""
    cin, cout = 24, 96
    model = S.conv_relu_weights_input(cin, cout, hw=7, k=1)
    name, func = _kernel(model, host)
    assert [int(d) for d in func.params[1].shape] == [cout, cin, 1, 1]
    cm = tvmfuse.compile(model, host)
    assert [s["template"] for s in cm.report.schedules] == [FAMILY], cm.report.schedules
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)


def _parallel_loops(func) -> int:
    return sum(int(f.kind) == int(C.ForKind.PARALLEL) for f in S.loops(func))


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
def test_parallel_threshold_comes_from_the_target_table(monkeypatch, target):
    """The shared fork/join cost (template_defaults["cpu.parallel"]) decides: a 64x16 conv on 15x15 (230400
    multiply-adds) has one parallel loop; with the cost raised above it, none (a fork/join would cost
    more than the work), with the same template, tile and vectors; the choice is the config's parallel knob."""
    tgt = tvmfuse.parse_target(target)
    model = _model(64, 16, 15, "bias_relu")
    name, func = _kernel(model, tgt)
    before = schedule_prim_func(func, tgt, {}, name)
    assert before.template == FAMILY and _parallel_loops(before.func) == 1
    assert before.config["parallel"] and parallel_why_not(Conv1x1().match(func, tgt).info, tgt) is None
    table = json.loads(json.dumps(TG.cpu_table()))
    cores = TG.cpu_info(tgt).cores
    table["template_defaults"][PARALLEL_FAMILY]["fork_join_work_per_core"] = 64 * 16 * 225 // cores + 1
    monkeypatch.setattr(TG, "cpu_table", lambda: table)
    assert "under the fork/join cost" in parallel_why_not(Conv1x1().match(func, tgt).info, tgt)
    after = schedule_prim_func(func, tgt, {}, name)
    assert after.template == FAMILY and after.config == {**before.config, "parallel": False}
    assert _parallel_loops(after.func) == 0, "a parallel loop under the fork/join cost"
    assert S.vector_lanes(after.func) == S.vector_lanes(before.func)
    assert not S.scalarized_loops(after.func)


def test_serial_conv_numerics_vs_reference(monkeypatch, host, rng):
    """The same conv made serial by the threshold (on the host) matches onnx's reference on fresh inputs."""
    table = json.loads(json.dumps(TG.cpu_table()))
    table["template_defaults"][PARALLEL_FAMILY]["fork_join_work_per_core"] = 1 << 40
    monkeypatch.setattr(TG, "cpu_table", lambda: table)
    model = _model(96, 24, 7, "bn_relu_residual")
    tgt = tvmfuse.parse_target(host)
    name, func = _kernel(model, tgt)
    assert _parallel_loops(schedule_prim_func(func, tgt, {}, name).func) == 0
    cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 1
    assert [s["template"] for s in cm.report.schedules] == [FAMILY]
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)
