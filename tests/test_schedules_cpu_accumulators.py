"""Register-tile accumulators of the conv templates (cpu.conv1x1, cpu.conv2d_lanes, cpu.conv2d_epilogue) stay
in the "global" storage scope, so that TVM puts a tile under ``common.MAX_STACK_ALLOCA_BYTES`` on the stack
(LowerTVMBuiltin): no TVMBackendAllocWorkspace call (nor the memset of its init) in the parallel loop's body
per tile.  In the "local" scope every tile was a workspace allocation.

Structure on named AVX2 / AVX-512 targets, read from the LLVM IR of the built kernel: the tiles' parallel
lambda allocates from the workspace (once) exactly when the tile has MAX_STACK_ALLOCA_BYTES bytes or more (the rule both
ways); numerics: the kernels on the host against onnx's reference on fresh random inputs.
"""
import re

import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu.common import MAX_STACK_ALLOCA_BYTES

import schedule_cases as S
from conftest import assert_close_to_reference
from test_schedules_cpu_conv import conv_block
from test_schedules_cpu_conv1x1 import _kernel

# (name, conv_block kwargs, template): a 1x1 conv on a 2x2 plane (mobilenet_v2's 56 -> 336), a fire-module
# 3x3 conv on 15x15 (squeezenet1_1's 16 -> 64: 1280 bytes on AVX-512, 320 on AVX2).  The direct template
# (cpu.conv2d_epilogue) keeps its accumulator the same way, but also allocates the padded input of each row
# band in the parallel loop: its numerics are tests/test_schedules_cpu_conv*.py's
CASES = [
    ("conv1x1_2x2", dict(cin=56, cout=336, h=2, w=2, k=1, pads=(0, 0, 0, 0), residual=False), "cpu.conv1x1"),
    ("lanes_15x15", dict(cin=16, cout=64, h=15, w=15, residual=False, bn=False), "cpu.conv2d_lanes"),
]
IDS = [c[0] for c in CASES]


def tile_bytes(template: str, cfg: dict) -> int:
    """Bytes of the kernel's register tile (float32) from its config."""
    if template == "cpu.conv1x1":
        return cfg["mr"] * cfg["nvec"] * cfg["lanes"] * 4
    return cfg["oh_tile"] * cfg["ow_tile"] * cfg["nvec"] * cfg["lanes"] * 4


def workspace_allocations(func, target) -> dict[str, int]:
    """Per LLVM function of the built kernel: how many TVMBackendAllocWorkspace calls it makes (the loads of
    that runtime function's pointer)."""
    lib = C.build_prim_module(C.IRModule({"main": func.with_attr("global_symbol", "main")}), target)
    ll = (lib.mod if hasattr(lib, "mod") else lib).inspect_source("ll")
    counts, cur = {}, None
    for line in ll.splitlines():
        m = re.match(r"define .*@([\w.$]+)\(", line)
        if m:
            cur = m.group(1)
            counts[cur] = 0
        elif cur and "@__TVMBackendAllocWorkspace" in line:
            counts[cur] += 1
    return counts


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
