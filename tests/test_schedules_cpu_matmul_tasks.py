"""cpu.matmul_epilogue's static default keeps ``row_blocks_per_core`` parallel tasks per core (staticmm13b,
issue 13): its row blocks (``mc_tiles``) were sized to L2 alone, so BERT's 128-row FFN ([1, 128, 64] @
[64, 256], one 256-column panel) was ONE row block of 4 x 32 rows: the parallel loop had one iteration and the
whole kernel ran on one core (static bert b1 s128 0.745x the symbolic build's speed on Zen 3, Table 10). At
8 x 17 = 136 rows: two blocks of 128 and 8 rows.

Structure, on named targets (AVX2 haswell/znver3, AVX-512 skx, NEON; 2 and 4 cores): the default's parallel
loop gives every core a task and its busiest core (TVM chunks the loop statically: ceil(tasks / cores)
tasks each) at most the register tiles of an even split rounded to a row block; with the table entry at 0
(the defaults before) the 1x128 FFN had one iteration. Must not fire: enough column panels (mc_tiles stays
L2-sized), a serial kernel, 17 rows on 2 cores (3 tasks would cost the busiest core as much as 2).
Numerics: the new default vs the unscheduled kernel on fresh random inputs (host).
"""
import numpy as np
import pytest

from tvmfuse import _compat as C
from tvmfuse import target as TG
from tvmfuse.schedules.base import schedule_with

import schedule_cases as S

NEON = '{"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"], "num-cores": 2}'
ZNVER3 = '{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver3", "num-cores": 2}'
ZNVER3_4 = ZNVER3.replace('"num-cores": 2', '"num-cores": 4')
TARGETS = (S.HASWELL, ZNVER3, ZNVER3_4, S.SKYLAKE, NEON)
TARGET_IDS = ("haswell", "znver3", "znver3-4cores", "skx", "neon")
FAMILY = "cpu.matmul_epilogue"
# (b, s, k, n): bert's FFN up / down and output projection at 1 x 128 rows; FFN up at 8 x 17 (flattened rows)
SHAPES = [(1, 128, 64, 256), (1, 128, 256, 64), (1, 128, 64, 64), (8, 17, 64, 256)]
SHAPE_IDS = ["128x64x256", "128x256x64", "128x64x64", "8x17x64x256"]


from test_schedules_cpu_matmul_pad_rows import _kernel  # noqa: E402  (template, match, func, target)


def _parallel_iterations(func) -> list[int]:
    return [int(n.extent) for n in S.nodes(func)
            if isinstance(n, C.tirx.For) and int(n.kind) == int(C.ForKind.PARALLEL)]


def _cores(tgt) -> int:
    return TG.cpu_info(tgt).cores


def _with_table(monkeypatch, **entries):
    table = TG.cpu_table()
    patched = {**table, "template_defaults": {**table["template_defaults"],
                                              FAMILY: {**table["template_defaults"][FAMILY], **entries}}}
    monkeypatch.setattr(TG, "cpu_table", lambda: patched)


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_default_gives_every_core_its_share(shape, target):
    b, s, k, n = shape
    t, match, func, tgt = _kernel(S.matmul_3d(b=b, s=s, k=k, n=n, act="Relu"), target)
    cfg = t.default_config(match, tgt)
    assert cfg["parallel"], cfg
    cores = _cores(tgt)
    par = _parallel_iterations(schedule_with(t, match, func, cfg))
    assert len(par) == 1 and par[0] >= cores, (par, cores, cfg)
    tiles = -(-(b * s) // cfg["mr"])
    panels = par[0] // -(-tiles // cfg["mc_tiles"])
    busiest = -(-par[0] // cores) * cfg["mc_tiles"]
    # an even split of the register tiles over the cores (per column panel), up to one row block
    assert busiest <= -(-tiles * panels // cores) + cfg["mc_tiles"], (busiest, tiles, panels, cfg)


@pytest.mark.parametrize("target", (S.HASWELL, ZNVER3, S.SKYLAKE), ids=("haswell", "znver3", "skx"))
def test_l2_sized_row_blocks_alone_left_bert_ffn_one_task(target, monkeypatch):
    """The defaults before (row_blocks_per_core 0): BERT's 128-row FFN up was one parallel iteration."""
    _with_table(monkeypatch, row_blocks_per_core=0)
    t, match, func, tgt = _kernel(S.matmul_3d(b=1, s=128, k=64, n=256, act="Relu"), target)
    cfg = t.default_config(match, tgt)
    assert _parallel_iterations(schedule_with(t, match, func, cfg)) == [1], cfg


def test_enough_column_panels_keep_the_l2_sized_row_blocks(monkeypatch):
    """Many column panels (N = 2048 on AVX2: 16 panels of 128 columns at most) already give every core its
    tasks: the row blocks keep their L2-sized height (the same config as with the entry at 0)."""
    model = S.matmul_3d(b=1, s=128, k=64, n=2048, act=None)
    t, match, func, tgt = _kernel(model, S.HASWELL)
    new = t.default_config(match, tgt)
    _with_table(monkeypatch, row_blocks_per_core=0)
    assert t.default_config(match, tgt) == new


def test_17_rows_on_2_cores_keep_2_tasks(monkeypatch):
    """bert's 17 rows (3 six-row tiles, padded) on 2 cores: 2 blocks of 2 tiles or 3 of 1 leave the busiest
    core 2 tiles either way; the larger blocks stay (the config of the entry at 0)."""
    t, match, func, tgt = _kernel(S.matmul_3d(b=1, s=17, k=64, n=256, act="Relu"), ZNVER3)
    new = t.default_config(match, tgt)
    assert new["mr"] == 6 and new["mc_tiles"] == 2, new
    _with_table(monkeypatch, row_blocks_per_core=0)
    assert t.default_config(match, tgt) == new


def test_a_serial_kernel_keeps_its_row_blocks(monkeypatch):
    """Work under the fork/join cost (cpu.parallel): a serial kernel, whose row blocks are no tasks."""
    model = S.matmul_3d(b=1, s=8, k=16, n=16, act=None)
    t, match, func, tgt = _kernel(model, S.HASWELL)
    new = t.default_config(match, tgt)
    assert new["parallel"] is False, new
    _with_table(monkeypatch, row_blocks_per_core=0)
    assert t.default_config(match, tgt) == new


@pytest.mark.parametrize("shape", [(1, 128, 64, 256), (8, 17, 64, 256), (1, 79, 256, 64)],
                         ids=["128x64x256", "8x17x64x256", "79x256x64-padded"])
def test_default_matches_the_unscheduled_kernel(shape, host, rng):
    b, s, k, n = shape
    t, match, func, tgt = _kernel(S.matmul_3d(b=b, s=s, k=k, n=n, act="Relu"), host)
    cfg = t.default_config(match, tgt)
    args = S.random_args(func, rng)
    want = S.run_func(func, tgt, args)[0]
    got = S.run_func(schedule_with(t, match, func, cfg), tgt, args)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(want).max())),
                               err_msg=str(cfg))
