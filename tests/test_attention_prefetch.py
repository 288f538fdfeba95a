"""The CPU attention kernel's software prefetch (``prefetch`` knob, schedules/cpu/attention.py; issue 14's
plain S=512 case): the rows the next query block reads (Q), the rows this block writes (out) and, with packed
K/V, the next task's K/V rows are prefetched into L2 a few per row of score tiles.

Structure: the default at S=512 (12 heads x 64, the benchmark's heads-interleaved graph) on named AVX-512 and
AVX2 targets (the level chosen from the target table), where the prefetches sit (in the score-tile loop, not in
the head-dim FMA loop), one per cache line, and no S x S buffer.  Numerics: every prefetch level vs onnx's
ReferenceEvaluator in float64 (conftest.reference_outputs_f64) on fresh random inputs, with a fully masked row, large magnitudes and causal masking.
"""
import importlib.util
import os

import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.base import schedule_with
from tvmfuse.schedules.cpu.attention import LINE_FLOATS, Attention
from tvmfuse.target import template_defaults

from test_attention import (HASWELL, SKYLAKE, _allocs_and_loops, _attention_func, _chain, _masked_row_case,
                            _run_kernel)
from schedule_cases import stmts_with_loops
from conftest import assert_close_scaled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("attention_ab", os.path.join(ROOT, "benchmarks", "attention_ab.py"))
attention_ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(attention_ab)
RTOL, ATOL = 1e-4, 1e-5


def _prefetches(func) -> list[tuple[str, int]]:
    """(buffer name, read 0 / write 1) of every prefetch of a scheduled kernel."""
    found = []

    def visit(s):
        if _is_prefetch(s):
            load = s.value.args[0].args[0]           # tirx.address_of(the element)
            found.append((str(load.source.name), int(s.value.args[1])))

    C.post_order_visit(func.body, visit)
    return found


def _is_prefetch(s) -> bool:
    return isinstance(s, C.tirx.Evaluate) and getattr(s.value, "op", None) is not None and \
        str(s.value.op.name) == "tirx.prefetch"


def _loops_holding_prefetches(func) -> list:
    """The names of the loops around each prefetch, outermost first."""
    return [[str(lp.loop_var.name) for lp in loops] for s, loops in stmts_with_loops(func.body)
            if _is_prefetch(s)]


@pytest.mark.parametrize("target,level", [(SKYLAKE, 2), (HASWELL, 1)], ids=["avx512", "avx2"])
def test_default_at_s512_prefetches_and_keeps_scores_out_of_memory(target, level):
    """S=512, 12 heads x 64: on Skylake-SP (1 MiB L2) both tasks' packed K/V rows fit the L2 share, so the
    default prefetches Q, out and the next task's K/V (level 2); on Haswell (256 KiB) K/V are not packed
    and the level is 1 (Q and out).  One prefetch per 64-byte line of a row (64 floats: 4), reads for Q/K/V,
    writes for out; each inside the score-tile loop (under the key-block loop), none in the head-dim loop."""
    t, match, func = attention_ab.attention_kernel(512, 12, 64, False, target)
    table = template_defaults(target, "cpu.attention")
    assert table["prefetch"] == 2
    res = schedule_prim_func(func, target)
    assert res.template == "cpu.attention" and res.config["prefetch"] == level, res.config
    assert res.config["pack_kv"] == (1 if level == 2 else 0)
    found = _prefetches(res.func)
    per_row = 64 // LINE_FLOATS
    want = {("q", 0): per_row, ("out", 1): per_row}
    if level == 2:
        want.update({("k", 0): per_row, ("v", 0): per_row})
    assert {k: found.count(k) for k in set(found)} == want, found
    chains = _loops_holding_prefetches(res.func)
    assert chains and all(len(c) == len(chains[0]) for c in chains)
    allocs, loops = _allocs_and_loops(res.func)
    assert max(n for _, n, _ in allocs) < 512 * 512, allocs            # the S x S scores never in memory
    assert loops.count(int(C.ForKind.PARALLEL)) == 1
    # the prefetches' loop nest: parallel task, (query block), key block, score-tile row, prefetched row
    nest = chains[0]
    assert len(nest) == (5 if res.config["q_blocks"] > 1 else 4), nest


def test_prefetch_off_is_the_kernel_without_prefetches():
    t, match, func = attention_ab.attention_kernel(512, 12, 64, False, SKYLAKE)
    config = {**t.default_config(match, SKYLAKE), "prefetch": 0}
    assert not _prefetches(schedule_with(t, match, func, config))


def test_symbolic_sequence_has_no_prefetch_level(host):
    """The rows per score-tile row are static: a symbolic sequence's space has level 0 only, and a config
    asking for more is refused with the reason."""
    model = _chain(b=1, sq="sequence", sk="sequence", d=16, dv=8)
    func = _attention_func(tvmfuse.compile(model, host, schedules=False))
    t = Attention()
    match = t.match(func, host)
    assert {k.name: k.choices for k in t.space(match, host).knobs}["prefetch"] == (0,)
    assert t.default_config(match, host)["prefetch"] == 0
    with pytest.raises(ValueError, match="prefetch needs a static sequence"):
        t.apply(C.Schedule(func), match, {**t.default_config(match, host), "prefetch": 1})


@pytest.mark.parametrize("mask", ["input", "causal"])
def test_every_prefetch_level_matches_reference(mask, host, rng):
    """Levels 1 (K/V in place, one query block per task) and 2 (packed K/V, two query blocks per task, the
    last task with fewer: 45 rows; level 0 is the kernel of tests/test_attention.py):
    the same numbers as the reference, with a fully masked row (NaN, as onnx's Softmax) and logits ~1e4."""
    c = _masked_row_case(host, rng, seq=45, d=16, mask=mask)
    t, match, base, ref = c["t"], c["match"], c["base"], c["ref"]
    lanes = base["lanes"]
    for over in (dict(q_block=lanes, q_blocks=2, pack_kv=1, prefetch=2),
                 dict(q_block=lanes, q_blocks=1, pack_kv=0, prefetch=1)):
        config = {**base, **over}
        assert t.space(match, host).contains(config), config
        scheduled = schedule_with(t, match, c["func"], config)
        assert bool(_prefetches(scheduled)) == bool(config["prefetch"])
        got = _run_kernel(scheduled, c["args"], ref.shape, host)
        assert_close_scaled(got, ref, RTOL, ATOL, err_msg=str(config))
        if c["masked"]:
            assert np.isnan(got[0, :, 4]).all() and np.isnan(ref[0, :, 4]).all()
