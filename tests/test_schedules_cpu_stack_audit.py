"""Workspace allocations of the CPU templates' kernels (TVM 0.27 serves a CPU buffer of
``C.MAX_STACK_ALLOCA_BYTES`` or more from TVMBackendAllocWorkspace, where it is declared): ``audit`` lists,
per representative kernel (tests/schedule_cases.py) and named target, each such buffer with its LLVM function
(a parallel lambda: once per parallel iteration) and size, read from the LLVM IR by the accumulators test's
reader.  ``python tests/test_schedules_cpu_stack_audit.py`` prints it as JSON lines.

The register-blocked matmul families (cpu.matmul_epilogue, cpu.sibling_matmuls, cpu.norm_matmul) have a table
knob, ``stack_accumulator``: on, the default register tile stays under the limit (``matmul.stack_accumulator_vectors``);
off by default (schedules/cpu_targets.json says why: measured, it does not win on static kernels).  Structure on
both named targets with the knob on: the tile's workspace allocation is gone (skylake) or there was none
(haswell, the same config); numerics: the knob-on kernels against onnx's reference on fresh random inputs.
cpu.attention keeps its per-task buffers in the "global" scope (``attention.BUFFER_SCOPE``): the small ones
(running max / sum rows) on the stack.
"""
import json
import sys

import pytest

import tvmfuse
from tvmfuse import target as TG
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu.common import MAX_STACK_ALLOCA_BYTES

import schedule_cases as S
from conftest import assert_close_to_reference
from test_schedules_cpu_accumulators import workspace_buffers

# (name, model builder, template of the kernel audited): one representative kernel per CPU template family
CASES = [
    ("matmul", lambda: S.matmul_3d(b=2, s=32, k=64, n=128), "cpu.matmul_epilogue"),
    ("qkv", lambda: S.qkv_3d(b=2, s=16, h=64), "cpu.sibling_matmuls"),
    ("vit", lambda: S.vit_block(s=20, d=64, h=2, f=128), "cpu.norm_matmul"),
    ("vit", lambda: S.vit_block(s=20, d=64, h=2, f=128), "cpu.attention"),
    ("softmax", lambda: S.softmax_channels(), "cpu.row_reduction"),
    ("conv", lambda: S.conv(cin=16, cout=64, h=15, w=15), "cpu.conv2d_lanes"),
]
TILE_FAMILIES = ["cpu.matmul_epilogue", "cpu.sibling_matmuls", "cpu.norm_matmul"]
TARGET_IDS = ["haswell", "skylake"]


def _kernel(build, template: str, target) -> tuple:
    """(kernel name, Scheduled) of the model's first kernel that ``template`` schedules."""
    for kname, func in S.graph_funcs(build(), target).items():
        res = schedule_prim_func(func, target, {}, kname)
        if res is not None and res.template == template:
            return kname, res
    raise AssertionError(f"no kernel scheduled by {template}")


def audit(target) -> list[dict]:
    """One row per workspace buffer of the CASES' kernels on ``target``: case, template, kernel, LLVM
    function, buffer, bytes."""
    rows = []
    for name, build, template in CASES:
        kname, res = _kernel(build, template, target)
        for fn, bufs in workspace_buffers(res.func, target).items():
            rows += [dict(case=name, template=template, kernel=kname, function=fn, buffer=b, bytes=n)
                     for b, n in bufs]
    return rows


def _with_knob(monkeypatch, family: str, value: bool) -> None:
    table = json.loads(json.dumps(TG.cpu_table()))
    table["template_defaults"][family]["stack_accumulator"] = value
    monkeypatch.setattr(TG, "cpu_table", lambda: table)


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=TARGET_IDS)
def test_audit_finds_only_buffers_over_the_limit(target):
    """Every template of CASES schedules its kernel; the reader finds the workspace calls (the packed,
    padded and row buffers) with their sizes, and none under MAX_STACK_ALLOCA_BYTES: no template leaves a
    small buffer in the workspace (cpu.attention's running max / sum rows were "local": 5 calls per task)."""
    rows = audit(tvmfuse.parse_target(target))
    assert {r["template"] for r in rows} >= {"cpu.attention", "cpu.conv2d_lanes"}, rows
    # softmax's exp row is written into the output row (issue 11): no workspace per row any more
    assert not [r for r in rows if r["template"] == "cpu.row_reduction"], rows
    small = [r for r in rows if not r["bytes"] >= MAX_STACK_ALLOCA_BYTES]
    assert not small, small


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=TARGET_IDS)
def test_attention_local_scope_puts_row_buffers_in_the_workspace(target, monkeypatch):
    """The other side of the attention rule: with its buffers in the "local" scope the same kernel allocates
    its qb-float rows from the workspace (so the test above can fail)."""
    from tvmfuse.schedules.cpu import attention
    monkeypatch.setattr(attention, "BUFFER_SCOPE", "local")
    tgt = tvmfuse.parse_target(target)
    build = next(b for _, b, t in CASES if t == "cpu.attention")
    _, res = _kernel(build, "cpu.attention", tgt)
    sizes = [n for bufs in workspace_buffers(res.func, tgt).values() for _, n in bufs]
    assert any(n < MAX_STACK_ALLOCA_BYTES for n in sizes), sizes


def test_attention_numerics_vs_reference(host, rng):
    model = next(b for _, b, t in CASES if t == "cpu.attention")()
    cm = tvmfuse.compile(model, host)
    assert "cpu.attention" in [s["template"] for s in cm.report.schedules], cm.report.schedules
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)


def _tile_workspace(family: str, target, on: bool, monkeypatch) -> tuple[dict, list[int]]:
    """The default config of ``family``'s CASES kernel with the knob ``on``, and its workspace buffers' sizes."""
    _with_knob(monkeypatch, family, on)
    build = next(b for _, b, t in CASES if t == family)
    _, res = _kernel(build, family, target)
    return res.config, [n for bufs in workspace_buffers(res.func, target).values() for _, n in bufs]


@pytest.mark.parametrize("family", TILE_FAMILIES)
@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=TARGET_IDS)
def test_stack_accumulator_knob(family, target, monkeypatch):
    """Knob on: the default tile is under the limit; on AVX-512 the 4 x 4-vector tile's (1 KiB or more)
    workspace allocation goes (norm_matmul's narrower strip may also drop its packed panel), on AVX2 (a
    tile under the limit either way) the config does not change."""
    tgt = tvmfuse.parse_target(target)
    on_cfg, on_allocs = _tile_workspace(family, tgt, True, monkeypatch)
    off_cfg, off_allocs = _tile_workspace(family, tgt, False, monkeypatch)
    assert on_cfg["mr"] * on_cfg["nvec"] * on_cfg["lanes"] * 4 < MAX_STACK_ALLOCA_BYTES, on_cfg
    off_bytes = off_cfg["mr"] * off_cfg["nvec"] * off_cfg["lanes"] * 4
    if off_bytes < MAX_STACK_ALLOCA_BYTES:
        assert target == S.HASWELL and on_cfg == off_cfg, (on_cfg, off_cfg)
    else:
        # fewer buffers of the tile's size (norm_matmul's row statistics may have the same size)
        assert on_allocs.count(off_bytes) < off_allocs.count(off_bytes) and len(on_allocs) < len(off_allocs), \
            (on_cfg, on_allocs, off_cfg, off_allocs)


@pytest.mark.parametrize("family", TILE_FAMILIES)
def test_stack_accumulator_numerics_vs_reference(family, host, rng, monkeypatch):
    _with_knob(monkeypatch, family, True)
    model = next(b for _, b, t in CASES if t == family)()
    cm = tvmfuse.compile(model, host)
    assert family in [s["template"] for s in cm.report.schedules], cm.report.schedules
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)


if __name__ == "__main__":
    for t in (sys.argv[1:] or S.NAMED_TARGETS):
        for row in audit(tvmfuse.parse_target(t)):
            print(json.dumps({"target": t, **row}))
