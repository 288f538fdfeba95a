"""The CPU attention kernel's base-2 exps (``exp2`` knob, schedules/cpu/attention.py; issue 14's plain S=512
case): the scores' exps and the rescale factors as 2^x of arguments <= 0 (x log2(e) minus the block max times
log2(e), rounded up and shared by both), which tvmfuse.fastmath expands without the ln 2 reduction (fewer
vector instructions per score than e^x's expansion).

Structure: the default on named AVX-512 and AVX2 targets (the target table's level), the kernel's exp calls
(exp2 / exp, one for the scores and one for the rescale factors) and fastmath's expansion of both.
Numerics: both settings after fastmath vs onnx's ReferenceEvaluator in float64 (conftest.reference_outputs_f64)
on fresh random inputs, with a fully masked row (NaN, as onnx's Softmax), logits ~1e3 and an input mask or causal masking.
"""
import numpy as np
import pytest

from tvmfuse import _compat as C
from tvmfuse import fastmath as F
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.base import schedule_with
from tvmfuse.target import template_defaults

from test_attention import HASWELL, SKYLAKE, _masked_row_case, _run_kernel
from test_attention_prefetch import attention_ab
from conftest import assert_close_scaled

RTOL, ATOL = 1e-4, 1e-5


def _calls(func) -> list[str]:
    """The names of the exp-family calls of a kernel."""
    found = []

    def visit(e):
        if isinstance(e, C.Call) and hasattr(e.op, "name") and str(e.op.name) in ("tirx.exp", "tirx.exp2"):
            found.append(str(e.op.name))

    C.post_order_visit(func.body, visit)
    return found


@pytest.mark.parametrize("target", [SKYLAKE, HASWELL], ids=["avx512", "avx2"])
def test_default_follows_the_target_table_and_both_exps_take_the_cheap_expansion(target):
    """S=512, 12 heads x 64: the default's exp2 is the table's; its kernel has two exp calls of that base (the
    scores' and the rescale factors'), each of an argument fastmath proves <= 0, so none is left after it."""
    t, match, func = attention_ab.attention_kernel(512, 12, 64, False, target)
    res = schedule_prim_func(func, target)
    assert res.template == "cpu.attention"
    assert res.config["exp2"] == int(template_defaults(target, "cpu.attention")["exp2"]), res.config
    for exp2 in (0, 1):
        scheduled = schedule_with(t, match, func, {**res.config, "exp2": exp2})
        assert _calls(scheduled) == ["tirx.exp2" if exp2 else "tirx.exp"] * 2
        stats = {}
        fast, _ = F.rewrite(scheduled, stats)
        assert stats["nonpositive_exp"] == 2 and not _calls(fast)


@pytest.mark.parametrize("mask", ["input", "causal"])
def test_both_bases_match_reference(mask, host, rng):
    """exp2 on and off (after fastmath, as the pipeline builds them; packed K/V, two query blocks per task, 45
    rows): the reference's numbers, a fully masked row NaN, logits ~1e3 and an input mask ~3e2."""
    c = _masked_row_case(host, rng, seq=45, d=16, mask=mask, mask_scale=10.0)
    t, match, base, ref = c["t"], c["match"], c["base"], c["ref"]
    for exp2 in (0, 1):
        config = {**base, "q_block": base["lanes"], "q_blocks": 2, "pack_kv": 1, "exp2": exp2}
        assert t.space(match, host).contains(config), config
        fast, _ = F.rewrite(schedule_with(t, match, c["func"], config))
        got = _run_kernel(fast, c["args"], ref.shape, host)
        assert_close_scaled(got, ref, RTOL, ATOL, err_msg=str(config))
        if c["masked"]:
            assert np.isnan(got[0, :, 4]).all() and np.isnan(ref[0, :, 4]).all()
