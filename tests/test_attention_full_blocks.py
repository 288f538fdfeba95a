"""The CPU attention kernel over a symbolic sequence: its query blocks whose rows all exist run without row
clamps (schedules/cpu/attention.py, ``query_block``; issue 13, albert_dyn).

Each query block of a symbolic sequence used to clamp every row index it reads to the last row (``min(i,
sequence - 1)``: the last block's rows past the end read a row that exists), in each lane of the mask read (a
gather of one element per row) and in the Q transpose: albert_dyn's attention kernel ran 1.33x its static
kernel at sequence 128 (118 vs 89 us, kernel-only, one thread, under load; benchmarks/notes/albert14.md).
Now a block whose rows all exist (``q0 + q_block <= sequence``) takes a nest without the clamps and with the
static row-group counts; the last block keeps the clamped one.

Structure on named targets (AVX2, AVX-512): the branch on the block's end, mask loads whose query row is not
clamped next to the last block's clamped ones.  Numerics vs onnxruntime on fresh random inputs at sequences
that end on a block boundary, inside the last block and past a bucket bound.
"""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.schedules.base import schedule_with
from tvmfuse.schedules.cpu.attention import Attention

from conftest import assert_close_scaled
from test_attention import (HASWELL, RTOL, ATOL, SKYLAKE, _attention_func, _chain, _ort_outputs, _sym_feeds,
                            _walk)


def _mask_rows(func) -> list[str]:
    """The query-row index of every load of the mask operand, as text."""
    rows = []
    C.post_order_visit(func.body, lambda n: rows.append(str(n.indices[2])) if isinstance(n, C.TensorLoad)
                       and str(n.source.name) == "mask" else None)
    return rows


@pytest.mark.parametrize("target", [HASWELL, SKYLAKE], ids=["avx2", "avx512"])
def test_full_query_blocks_read_rows_unclamped(target):
    """The seq<=128 nest (blocks smaller than its bound: more than one query block): a branch on
    ``q0 + q_block <= sequence``; the full blocks' mask loads read their rows unclamped, the last block's
    clamp them to the last row.  A static kernel has no such branch (its clamps fold away)."""
    model = _chain(b="batch", h=4, sq="sequence", sk="sequence", d=64, dv=64, mask="input")
    sym = _attention_func(tvmfuse.compile(model, target, schedules=False))
    t = Attention()
    match = t.match(sym, target)
    bucket = [b for b in t.buckets(match, target) if b.max_extent == 128][0]
    bm = t.bucket_match(match, bucket)
    config = t.default_config(bm, target)
    assert config["q_block"] < 128, config          # several query blocks in the bucket
    nest = schedule_with(t, bm, sym, config)
    conds = []
    _walk(nest.body, lambda s: conds.append(str(s.condition)) if isinstance(s, C.tirx.IfThenElse) else None)
    qb = f"T.int64({config['q_block']})"
    assert any(f"* {qb} + {qb} <= sequence" in c for c in conds), conds
    rows = _mask_rows(nest)
    assert any("min" not in r for r in rows) and any("min" in r for r in rows), rows

    stat = _attention_func(tvmfuse.compile(_chain(b=1, h=4, sq=128, sk=128, d=64, dv=64, mask="input"), target,
                                           schedules=False))
    conds = []
    _walk(schedule_with(t, t.match(stat, target), stat, config).body,
          lambda s: conds.append(str(s.condition)) if isinstance(s, C.tirx.IfThenElse) else None)
    assert not any("<= 128" in c for c in conds), conds


def test_full_and_last_query_blocks_match_onnxruntime(host, rng):
    """Masked self-attention over a symbolic batch and sequence: sequences that end on a block boundary
    (64, 128, 256: every block full), inside the last block (65, 100, 127, 200) and past the last bounded
    bucket (129, 300), batch 1 and 3."""
    model = _chain(b="batch", h=2, sq="sequence", sk="sequence", d=16, dv=16, mask="input")
    cm = tvmfuse.compile(model, host)
    assert [s["template"] for s in cm.report.schedules] == ["cpu.attention"]
    for b, s in ((1, 64), (1, 65), (3, 100), (1, 127), (1, 128), (3, 129), (1, 200), (1, 256), (1, 300)):
        feeds = _sym_feeds(rng, b, s, h=2, d=16, dv=16, mask=True)
        out, ref = cm.run(feeds)["y"], _ort_outputs(model, feeds)["y"]
        assert_close_scaled(out, ref, RTOL, ATOL, err_msg=f"batch {b}, sequence {s}")
