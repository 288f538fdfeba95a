"""The CPU attention kernel's P @ V rescale and its default key block (schedules/cpu/attention.py; issue 14's
plain S=512 case).

The running rescale ``acc = acc * alpha`` is folded into the first key's step of each P @ V row group
(``acc = acc * alpha + p * V``): no pass of its own that loads and stores the accumulators once more per key
block.  On 48 KiB-L1 AVX-512 server cores (Sapphire/Emerald/Granite Rapids rows of schedules/cpu_targets.json)
a plain kernel's key block is 64 keys with a 64-row query block; causal kernels keep their own share
(``causal_l1_share_kv``) and other targets keep theirs.

Structure on named targets (AVX2, AVX-512, 48 KiB AVX-512): the accumulator stores (zero-fill, the folded
first step, the other steps; none that only rescales), their vector loop over the contiguous value axis, no
S x S buffer.  Numerics: the 64-key blocks and the folded rescale vs onnx's ReferenceEvaluator in float64
(conftest.reference_outputs_f64) on fresh random S=128, 512 and an odd S, plain, masked (a fully masked row: NaN) and causal, logits near 1e4 (exact in float32:
test_attention._large_logit_feeds).
"""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.base import schedule_with
from tvmfuse.schedules.cpu.attention import Attention
from tvmfuse.target import cpu_info, template_defaults

from test_attention import (HASWELL, SKYLAKE, _allocs_and_loops, _attention_func, _causal, _chain,
                            _large_logit_feeds, _masked_row_case, _run_kernel)
from schedule_cases import stmts_with_loops
from conftest import assert_close_scaled

RTOL, ATOL = 1e-4, 1e-5
EMERALD = tvmfuse.parse_target({"kind": "llvm", "mcpu": "emeraldrapids", "mtriple": "x86_64-linux-gnu",
                                "num-cores": 2})
SAPPHIRE = tvmfuse.parse_target({"kind": "llvm", "mcpu": "sapphirerapids", "mtriple": "x86_64-linux-gnu",
                                 "num-cores": 2})
ZEN5 = tvmfuse.parse_target({"kind": "llvm", "mcpu": "znver5", "mtriple": "x86_64-linux-gnu", "num-cores": 2})


def _reads(expr) -> list:
    """The buffers ``expr`` loads."""
    found = []
    C.post_order_visit(expr, lambda n: found.append(n.source) if isinstance(n, C.TensorLoad) else None)
    return found


def _any(sources, among) -> bool:
    """Whether a load's source (the buffer, or its data var) is one of the buffers ``among``."""
    return any(x.same_as(b) or x.same_as(b.data) for x in sources for b in among)


def _stores_with_loops(func, buffer):
    """(store, loops around it, innermost last) of every store into ``buffer``."""
    return [(s, loops) for s, loops in stmts_with_loops(func.body)
            if isinstance(s, C.BufferStore) and s.buffer.same_as(buffer)]


def _task_buffers(func) -> list:
    """(buffer, shape) of each buffer the scheduled kernel allocates."""
    out = []

    def visit(n):
        if isinstance(n, C.SBlock):
            for b in n.alloc_buffers:
                out.append((b, tuple(int(x) for x in b.shape)))

    C.post_order_visit(func.body, visit)
    return out


@pytest.mark.parametrize("target", [HASWELL, SKYLAKE, EMERALD], ids=["avx2", "avx512", "avx512-l1-48k"])
def test_pv_rescale_is_folded_into_the_first_key_step(target):
    """d 16, dv 48, S=512 (the accumulators' shape [q_block, 48] is no other buffer's): the accumulators are
    stored by the zero-fill, the first key's step (reads the rescale factors and the probabilities) and the
    other keys' steps (the probabilities, no rescale factor), each in a vector loop over the value axis (the
    contiguous one); no store only rescales them; no buffer of S x S."""
    s, d, dv = 512, 16, 48
    cm = tvmfuse.compile(_chain(b=1, h=2, sq=s, sk=s, d=d, dv=dv), target, schedules=False)
    res = schedule_prim_func(_attention_func(cm), target)
    assert res.template == "cpu.attention"
    qb, kb = res.config["q_block"], res.config["k_block"]
    shapes = _task_buffers(res.func)
    acc = [b for b, sh in shapes if sh == (qb, dv)]
    assert len(acc) == 1, shapes
    row_stats = [b for b, sh in shapes if sh == (qb,)]           # max, new max, rescale, sum
    scores = [b for b, sh in shapes if sh == (kb, qb)]
    assert len(scores) == 1 and len(row_stats) >= 4, shapes
    kinds = []
    for store, loops in _stores_with_loops(res.func, acc[0]):
        reads = _reads(store.value)
        if not reads:
            kinds.append("zero")
        elif _any(reads, scores):
            kinds.append("first" if _any(reads, row_stats) else "step")
        elif _any(reads, row_stats):
            kinds.append("rescale only")
        else:
            kinds.append("other")
        # the innermost loop is vectorized and indexes the value axis (the buffer's last)
        inner = loops[-1]
        assert int(inner.kind) == int(C.ForKind.VECTORIZED), (kinds[-1], inner.kind)
        names = set()
        C.post_order_visit(store.indices[-1], lambda n: names.add(str(n.name)) if isinstance(n, C.tirx.Var) else None)
        assert str(inner.loop_var.name) in names
    assert "rescale only" not in kinds, kinds
    assert sorted(set(kinds)) == ["first", "step", "zero"], kinds
    allocs, _ = _allocs_and_loops(res.func)
    assert all(n < s * s for _, n, _ in allocs), allocs


@pytest.mark.parametrize("target,plain,causal", [
    (EMERALD, (64, 64), (64, 32)), (SAPPHIRE, (64, 64), (64, 32)), (ZEN5, (64, 64), (64, 32)),
    (SKYLAKE, (32, 32), (32, 32)), (HASWELL, (32, 32), (32, 32)),
], ids=["emeraldrapids", "sapphirerapids", "znver5", "skylake-avx512", "haswell"])
def test_default_key_block_follows_the_l1_share_of_the_target(target, plain, causal):
    """Head dim 64, 12 heads, S=512: (query block, key block) of the plain and the causal kernel.  The key
    block is the largest whose K and V rows fit the target's l1_share_kv (causal: causal_l1_share_kv) of
    L1; the 48 KiB-L1 server rows of the table take 64 keys for the plain kernel (their query block stays
    64 rows: l1_share_query_block), the causal kernel and the 32 KiB-L1 targets keep 32."""
    t = Attention()
    table = template_defaults(target, "cpu.attention")
    l1 = cpu_info(target).l1d_bytes
    for mask, want, share in ((None, plain, table["l1_share_kv"]),
                              (_causal(512), causal, table["causal_l1_share_kv"])):
        func = _attention_func(tvmfuse.compile(_chain(b=1, h=12, sq=512, sk=512, d=64, dv=64, mask=mask),
                                               target, schedules=False))
        cfg = t.default_config(t.match(func, target), target)
        assert (cfg["q_block"], cfg["k_block"]) == want, cfg
        kb = cfg["k_block"]
        largest = max(next(k.choices for k in t.space(t.match(func, target), target).knobs if k.name == "k_block"))
        assert 128 * kb * 4 <= share * l1 and (kb == largest or share * l1 < 128 * 2 * kb * 4), cfg


def test_zen5_packs_kv_only_for_many_query_blocks_and_reads_in_place_with_its_own_share():
    """znver5's row (48 KiB L1, 1 MiB L2; benchmarks/notes/attn9.md): a task packs its K/V rows only when
    at least pack_kv_min_q_blocks query blocks share them (S=512: 8, packed, 64-key blocks); S=128 (2 query
    blocks; causal 4) reads K/V in place, and in place (also S=2048, whose rows exceed the L2 share) the key
    block follows l1_share_kv_in_place (32 keys).  Emerald Rapids (no such keys: the base table's, 2 and
    none) keeps packing at S=128 with 64-key blocks; a rule that must not fire there."""
    t = Attention()
    z5 = template_defaults(ZEN5, "cpu.attention")
    assert z5["pack_kv_min_q_blocks"] == 8 and z5["l1_share_kv_in_place"] == 0.5
    want = {  # (seq, causal): (q_block, k_block, q_blocks, pack_kv, prefetch)
        (ZEN5, 512, False): (64, 64, 8, 1, 2), (ZEN5, 128, False): (64, 32, 1, 0, 1),
        (ZEN5, 128, True): (32, 32, 1, 0, 1), (ZEN5, 2048, False): (64, 32, 1, 0, 1),
        (EMERALD, 128, False): (64, 64, 2, 1, 2), (EMERALD, 128, True): (32, 32, 4, 1, 2),
    }
    for (target, seq, causal), expect in want.items():
        model = _chain(b=1, h=12, sq=seq, sk=seq, d=64, dv=64, mask=_causal(seq) if causal else None)
        func = _attention_func(tvmfuse.compile(model, target, schedules=False))
        cfg = t.default_config(t.match(func, target), target)
        got = tuple(cfg[k] for k in ("q_block", "k_block", "q_blocks", "pack_kv", "prefetch"))
        assert got == expect, (str(target.attrs["mcpu"]), seq, causal, cfg)
        if not cfg["pack_kv"]:      # in place: no local copy of the key length's rows
            allocs, _ = _allocs_and_loops(schedule_with(t, t.match(func, target), func, cfg))
            assert all(n < seq * 64 for _, n, _ in allocs), allocs


@pytest.mark.parametrize("seq,mask", [(128, None), (512, "input"), (77, "causal"), (77, "input")],
                         ids=["s128", "s512-mask", "s77-causal", "s77-mask"])
def test_64_key_blocks_and_folded_rescale_match_reference(seq, mask, host, rng):
    """64-key blocks (the 48 KiB-L1 default) and 32-key blocks, each with 1 and 4 row groups, vs onnx's
    ReferenceEvaluator in float64: logits near 1e4 (the running max rescales the accumulators often), a fully masked
    row (NaN, as onnx's Softmax gives), causal and an odd S (a key tail in the last block)."""
    c = _masked_row_case(host, rng, seq=seq, d=64, mask=mask)
    t, match, base, ref = c["t"], c["match"], c["base"], c["ref"]
    for over in (dict(k_block=64, rows=4), dict(k_block=64, rows=1), dict(k_block=32, rows=4)):
        config = {**base, **over}
        assert t.space(match, host).contains(config), config
        got = _run_kernel(schedule_with(t, match, c["func"], config), c["args"], ref.shape, host)
        assert_close_scaled(got, ref, RTOL, ATOL, err_msg=str(config))
        if c["masked"]:
            assert np.isnan(got[0, :, 4]).all() and np.isnan(ref[0, :, 4]).all()
            assert np.isfinite(np.delete(got, 4, axis=2)).all()
