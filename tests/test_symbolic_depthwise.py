"""Depthwise convs over a symbolic batch run the static kernels' code (issue 13, benchmarks/notes/symconv11.md).

Two differences from the static batch-1 kernel made the symbolic ones 3-5x slower, kernel alone:

- a ``channel_lanes`` register tile of 16 pixels x 16 lanes (1024 bytes, AVX-512) is a TVM workspace, not a
  stack array; in a kernel with a parallel loop (a symbolic batch's size buckets share one function with a
  parallel nest; a static nest that is parallel itself) LLVM then cannot tell it from the input and redoes every
  strided gather per tap.  ``depthwise.stack_tile_pixels`` keeps such a tile under the stack limit
  (``stack_tile_when_parallel`` in schedules/cpu_targets.json); a serial static nest keeps its larger tile.
- the column nest's padded copy over a symbolic batch has int64 indices, and LLVM vectorized its row loop
  across rows with 64-bit gathers and scatters; ``conv2d.unroll_copy_rows`` unrolls that row loop (within
  ``common.MAX_UNROLLED_COPIES``), the static kernel's int32 copy stays a loop.

Structural tests on named targets (znver5 and skylake-avx512: AVX-512; haswell: AVX2; neoverse-n1: NEON), the
rules that must not fire, and the numbers at batch 1, 3 and 8 against onnx's reference evaluator.
"""
import re

import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu.common import MAX_STACK_ALLOCA_BYTES, MAX_UNROLLED_COPIES

from test_symbolic_conv import DEPTHWISE, _feeds, _fused_prim_funcs, cnn_block

TARGETS = {
    "znver5": {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver5", "num-cores": 2},
    "skx": {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512", "num-cores": 2},
    "haswell": {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "haswell", "num-cores": 2},
    "neon": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "neoverse-n1", "num-cores": 4},
}
AVX512 = ("znver5", "skx")
# mobilenet_v2's 144-channel depthwise conv on a 4x4 plane (channel_lanes, 16-pixel tile statically) and its
# 48-channel 16x16 stride-2 one (the column nest, deinterleaved padded copy); a large plane the row unroll
# must leave alone (66 padded rows)
PLANE_4X4 = dict(cin=144, cout=144, h=4, w=4, group=144)
STRIDE2_16 = dict(cin=48, cout=48, h=16, w=16, group=48, stride=2, residual=False)
LARGE_PLANE = dict(cin=16, cout=16, h=64, w=64, group=16, residual=False)


def _kernel(kwargs, batch, target):
    funcs = _fused_prim_funcs(cnn_block(batch, **kwargs), target)
    (name, func), = funcs.items()
    res = schedule_prim_func(func, target, {}, name)
    assert res is not None and res.template == DEPTHWISE, (name, res and res.template)
    return res


def _configs(res) -> list[dict]:
    return [b["config"] for b in res.config["buckets"]] if "buckets" in res.config else [res.config]


def _tile_bytes(cfg) -> int:
    return cfg["oh_tile"] * cfg["ow_tile"] * cfg["channel_lanes"] * 4


def _vector_allocs(func, target) -> list[int]:
    """Bytes of every float vector buffer of the conv's accumulator (the register tiles: named after the conv
    buffer; not the padded input copy) of ``func`` after TVM's TIR lowering."""
    low = C.lower_tir(C.IRModule({"main": func.with_attr("global_symbol", "main")}), target)
    out = []

    def visit(node):
        if type(node).__name__ == "AllocBuffer":
            m = re.fullmatch(r"float(\d+)x(\d+)", str(node.buffer.dtype))
            if m and "conv2d" in str(node.buffer.name):
                n = 1
                for d in node.buffer.shape:
                    n *= int(d)
                out.append(n * int(m.group(1)) // 8 * int(m.group(2)))

    C.post_order_visit(low["main"].body, visit)
    return out


@pytest.mark.parametrize("tname", list(TARGETS))
def test_channel_lanes_tile_stays_on_the_stack_where_the_kernel_has_a_parallel_loop(tname):
    target = tvmfuse.parse_target(TARGETS[tname])
    sym = _kernel(PLANE_4X4, "batch", target)
    serial = _kernel(PLANE_4X4, 1, target)
    parallel = _kernel(PLANE_4X4, 64, target)
    assert serial.config["channel_lanes"] and not serial.config["parallel"], serial.config
    assert parallel.config["channel_lanes"] and parallel.config["parallel"], parallel.config
    for cfg in _configs(sym) + [parallel.config]:
        assert cfg["channel_lanes"] and _tile_bytes(cfg) < MAX_STACK_ALLOCA_BYTES, cfg
    assert all(b < MAX_STACK_ALLOCA_BYTES for b in _vector_allocs(sym.func, target)), _vector_allocs(sym.func, target)
    if tname in AVX512:
        # the serial static nest keeps the 16-pixel tile spanning the plane (a 1024-byte workspace LLVM keeps
        # in registers there): the rule must not fire without a parallel loop
        assert (serial.config["oh_tile"], serial.config["ow_tile"]) == (4, 4), serial.config
        assert _tile_bytes(serial.config) == MAX_STACK_ALLOCA_BYTES
        assert MAX_STACK_ALLOCA_BYTES in _vector_allocs(serial.func, target)
    else:
        # 8 (AVX2) or 4 (NEON) lanes: half the registers bind first, the tile was under the limit already
        assert all(cfg["oh_tile"] * cfg["ow_tile"] == serial.config["oh_tile"] * serial.config["ow_tile"]
                   for cfg in _configs(sym)), (serial.config, _configs(sym))


def test_stack_tile_rule_comes_from_the_target_table(monkeypatch):
    """``stack_tile_when_parallel`` off in the table: the symbolic kernel's serial nest takes the static tile."""
    from tvmfuse import target as TG

    target = tvmfuse.parse_target(TARGETS["znver5"])
    real = TG.template_defaults

    def patched(t, family):
        d = dict(real(t, family))
        if family == DEPTHWISE:
            d["stack_tile_when_parallel"] = False
        return d

    monkeypatch.setattr("tvmfuse.schedules.cpu.depthwise.template_defaults", patched)
    sym = _kernel(PLANE_4X4, "batch", target)
    assert max(_tile_bytes(c) for c in _configs(sym)) == MAX_STACK_ALLOCA_BYTES, _configs(sym)


def _unrolled_loops(func) -> list[int]:
    found = []
    C.post_order_visit(func.body, lambda n: found.append(int(n.extent)) if isinstance(n, C.tirx.For)
                       and n.kind == C.ForKind.UNROLLED and isinstance(n.extent, C.tirx.IntImm) else None)
    return found


@pytest.mark.parametrize("tname", list(TARGETS))
def test_symbolic_column_nest_unrolls_its_padded_copy_rows(tname):
    """Each size-bucket nest of the symbolic 16x16 stride-2 conv unrolls its padded copy's 17 rows; the static
    kernel's copy keeps a serial row loop; a 64x64 plane's copy (66 rows) stays a loop in both."""
    target = tvmfuse.parse_target(TARGETS[tname])
    rows = 17                                     # padded rows a 3x3 stride-2 window reads for 8 output rows
    sym, static = _kernel(STRIDE2_16, "batch", target), _kernel(STRIDE2_16, 1, target)
    assert all(c["channel_lanes"] == 0 for c in _configs(sym)), _configs(sym)
    assert _unrolled_loops(sym.func).count(rows) == len(_configs(sym)), _unrolled_loops(sym.func)
    assert rows not in _unrolled_loops(static.func)
    large = _kernel(LARGE_PLANE, "batch", target)
    lanes = _configs(large)[0]["lanes"]
    assert 66 * -(-66 // lanes) > MAX_UNROLLED_COPIES
    assert 66 not in _unrolled_loops(large.func)


@pytest.mark.parametrize("kwargs", [PLANE_4X4, STRIDE2_16], ids=["4x4_plane", "16x16_stride2"])
def test_symbolic_depthwise_numbers_at_batch_1_3_8(kwargs, host, rng):
    model = cnn_block("batch", **kwargs)
    cm = tvmfuse.compile(model, target=host)
    assert [s["template"] for s in cm.report.schedules] == [DEPTHWISE], cm.report.schedules
    for batch in (1, 3, 8):
        feeds = _feeds(model, batch, rng)
        got, want = cm.run(feeds), M.reference_outputs(model, feeds)
        for out, ref in want.items():
            np.testing.assert_allclose(got[out], ref, rtol=1e-4, atol=1e-4, err_msg=f"batch {batch}")
