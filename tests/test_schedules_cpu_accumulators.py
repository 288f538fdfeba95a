"""Register-tile accumulators of the conv templates (cpu.conv1x1, cpu.conv2d_lanes, cpu.conv2d_epilogue) stay
in the "global" storage scope, so that TVM puts a tile under ``common.MAX_STACK_ALLOCA_BYTES`` on the stack
(LowerTVMBuiltin): no TVMBackendAllocWorkspace call (nor the memset of its init) in the parallel loop's body
per tile.  In the "local" scope every tile was a workspace allocation.

Structure on named AVX2 / AVX-512 targets, read from the LLVM IR of the built kernel: the tiles' parallel
lambda allocates from the workspace (once) exactly when the tile has MAX_STACK_ALLOCA_BYTES bytes or more (the rule both
ways); numerics: the kernels on the host against onnx's reference on fresh random inputs.

The direct template's and cpu.conv1x1's defaults take a tile under that size where the reduction per tile is
short (the table's ``stack_tile_below_steps``: squeezenet1_1's stem, 3 x 3 x 3 steps; a 1x1 conv of 16 input
channels), and keep their tile otherwise.
"""
import json
import re

import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import target as TG
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu.common import MAX_STACK_ALLOCA_BYTES

import schedule_cases as S
from conftest import assert_close_to_reference
from test_schedules_cpu_conv import conv_block
from test_schedules_cpu_conv1x1 import _kernel

# (name, conv_block kwargs, template): a 1x1 conv on a 2x2 plane (mobilenet_v2's 56 -> 336), a fire-module
# 3x3 conv on 15x15 (squeezenet1_1's 16 -> 64: 768 bytes on AVX-512, 320 on AVX2), a 1x1 conv on 14x14.  The direct template
# (cpu.conv2d_epilogue) keeps its accumulator the same way, but also allocates the padded input of each row
# band in the parallel loop: its numerics are tests/test_schedules_cpu_conv*.py's
CASES = [
    ("conv1x1_2x2", dict(cin=56, cout=336, h=2, w=2, k=1, pads=(0, 0, 0, 0), residual=False), "cpu.conv1x1"),
    ("lanes_15x15", dict(cin=16, cout=64, h=15, w=15, residual=False, bn=False), "cpu.conv2d_lanes"),
    # a 1x1 conv 64 -> 256 on 14x14 (resnet-like): a 4 x 4-vector tile on AVX-512, 1024 bytes, the side at the
    # limit since the accumulator cap (cpu_targets.json max_accumulators) made the 15x15 tile 1x3x4 (768 bytes)
    ("conv1x1_14x14", dict(cin=64, cout=256, h=14, w=14, k=1, pads=(0, 0, 0, 0), residual=False), "cpu.conv1x1"),
]
IDS = [c[0] for c in CASES]


def tile_bytes(template: str, cfg: dict) -> int:
    """Bytes of the kernel's register tile (float32) from its config."""
    if template == "cpu.conv1x1":
        return cfg["mr"] * cfg["nvec"] * cfg["lanes"] * 4
    return cfg["oh_tile"] * cfg["ow_tile"] * cfg["nvec"] * cfg["lanes"] * 4


def workspace_buffers(func, target) -> dict[str, list[tuple[str, int]]]:
    """Per LLVM function of the built kernel: the (buffer, bytes) of each TVMBackendAllocWorkspace call it
    makes (the call through that runtime function's pointer names the buffer and its constant size; -1 for
    a size known at run time only)."""
    lib = C.build_prim_module(C.IRModule({"main": func.with_attr("global_symbol", "main")}), target)
    ll = (lib.mod if hasattr(lib, "mod") else lib).inspect_source("ll")
    calls, cur, pointer = {}, None, None
    for line in ll.splitlines():
        m = re.match(r"define .*@([\w.$]+)\(", line)
        if m:
            cur = m.group(1)
            calls[cur] = []
        elif cur and "@__TVMBackendAllocWorkspace" in line:
            pointer = line.split("=")[0].strip()
        elif cur and pointer and f"call ptr {pointer}(" in line:
            size = re.search(r"i64 (-?\d+|%[\w.]+)", line.split(f"call ptr {pointer}(")[1]).group(1)
            calls[cur].append((line.split("=")[0].strip().lstrip("%"), int(size) if size[0] != "%" else -1))
            pointer = None
    return calls


def workspace_allocations(func, target) -> dict[str, int]:
    """Per LLVM function of the built kernel: how many TVMBackendAllocWorkspace calls it makes."""
    return {name: len(bufs) for name, bufs in workspace_buffers(func, target).items()}


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
@pytest.mark.parametrize("name,kwargs,template", CASES, ids=IDS)
def test_tile_on_the_stack_when_it_fits(name, kwargs, template, target):
    tgt = tvmfuse.parse_target(target)
    kname, func = _kernel(conv_block(**kwargs), tgt)
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res.template == template, res.template
    lambdas = {k: v for k, v in workspace_allocations(res.func, tgt).items() if k.startswith("__tvm_parallel_lambda")}
    assert lambdas, "no parallel loop"
    tile = tile_bytes(template, res.config)
    expected = 1 if tile >= MAX_STACK_ALLOCA_BYTES else 0
    assert max(lambdas.values()) == expected, \
        f"{tile}-byte tile ({res.config}): workspace allocations per parallel lambda {lambdas}"


def test_both_sides_of_the_rule_are_exercised():
    """The cases above include tiles on both sides of MAX_STACK_ALLOCA_BYTES (else the test above checks
    one side only)."""
    sides = set()
    for target in S.NAMED_TARGETS:
        tgt = tvmfuse.parse_target(target)
        for _, kwargs, _template in CASES:
            kname, func = _kernel(conv_block(**kwargs), tgt)
            res = schedule_prim_func(func, tgt, {}, kname)
            sides.add(tile_bytes(res.template, res.config) >= MAX_STACK_ALLOCA_BYTES)
    assert sides == {False, True}


@pytest.mark.parametrize("name,kwargs,template", CASES, ids=IDS)
def test_numerics_vs_reference(name, kwargs, template, host, rng):
    model = conv_block(**kwargs)
    cm = tvmfuse.compile(model, host)
    assert [s["template"] for s in cm.report.schedules] == [template], cm.report.schedules
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)


# cpu.conv2d_epilogue: a direct conv with a short reduction per tile prefers a tile on the stack
STEM = dict(cin=3, cout=64, h=64, w=64, stride=2, pads=(0, 0, 0, 0), residual=False)     # squeezenet1_1's
LONG = dict(cin=16, cout=32, h=16, w=16, residual=False)       # 16 x 3 x 3 = 144 steps: not short


def _direct_default(kwargs, target, steps=None, monkeypatch=None) -> dict:
    """The direct template's default config of the conv (with stack_tile_below_steps set to ``steps``)."""
    tgt = tvmfuse.parse_target(target)
    if steps is not None:
        table = json.loads(json.dumps(TG.cpu_table()))
        table["template_defaults"]["cpu.conv2d_epilogue"]["stack_tile_below_steps"] = steps
        monkeypatch.setattr(TG, "cpu_table", lambda: table)
    kname, func = _kernel(conv_block(**kwargs), tgt)
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res.template == "cpu.conv2d_epilogue", res.template
    return res.config


def _direct_tile_bytes(cfg: dict, ow: int) -> int:
    """Bytes of the direct template's register tile: oc_tile x oh_tile x the tile's row (padded to whole
    vectors where pad_width applies)."""
    width = -(-ow // cfg["lanes"]) * cfg["lanes"] if cfg["pad_width"] else cfg["ow_tile"]
    return cfg["oc_tile"] * cfg["oh_tile"] * width * 4


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
def test_short_reduction_takes_a_stack_tile(target, monkeypatch):
    """The stem's 27-step reduction: a tile under MAX_STACK_ALLOCA_BYTES by default; with the table's
    stack_tile_below_steps at 0 (the rule off) the skylake default is the 8 x 32 tile of 1024 bytes."""
    cfg = _direct_default(STEM, target)
    assert _direct_tile_bytes(cfg, 31) < MAX_STACK_ALLOCA_BYTES, cfg
    off = _direct_default(STEM, target, 0, monkeypatch)
    if target == S.SKYLAKE:
        assert _direct_tile_bytes(off, 31) >= MAX_STACK_ALLOCA_BYTES, off


def test_long_reduction_keeps_its_tile(monkeypatch):
    """144 reduction steps per tile: the rule does not apply (the same default with the rule off)."""
    assert _direct_default(LONG, S.SKYLAKE) == _direct_default(LONG, S.SKYLAKE, 0, monkeypatch)


def test_stem_numerics_vs_reference(host, rng):
    model = conv_block(**STEM)
    cm = tvmfuse.compile(model, host)
    assert [s["template"] for s in cm.report.schedules] == ["cpu.conv2d_epilogue"], cm.report.schedules
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)


POINTWISE_SHORT = dict(cin=16, cout=96, h=8, w=8, k=1, pads=(0, 0, 0, 0), residual=False)   # mobilenet_v2's


def test_pointwise_short_reduction_takes_a_stack_tile(monkeypatch):
    """cpu.conv1x1 with 16 input channels (under its table's stack_tile_below_steps) on AVX-512: a tile under
    MAX_STACK_ALLOCA_BYTES by default; with the rule off, the 8 x 3-vector tile of 1536 bytes."""
    tgt = tvmfuse.parse_target(S.SKYLAKE)

    def default():
        kname, func = _kernel(conv_block(**POINTWISE_SHORT), tgt)
        res = schedule_prim_func(func, tgt, {}, kname)
        assert res.template == "cpu.conv1x1", res.template
        return tile_bytes(res.template, res.config)

    assert default() < MAX_STACK_ALLOCA_BYTES
    table = json.loads(json.dumps(TG.cpu_table()))
    table["template_defaults"]["cpu.conv1x1"]["stack_tile_below_steps"] = 0
    monkeypatch.setattr(TG, "cpu_table", lambda: table)
    assert default() >= MAX_STACK_ALLOCA_BYTES
