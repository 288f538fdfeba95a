"""The attention kernel's row nest: the small-sequence bucket over a symbolic sequence (issue 13, sequence 1).

Over a symbolic sequence ``cpu.attention`` holds one nest per size bucket; sequences up to the target
table's ``row_nest_max_seq`` run the row nest (``attention._row_root``): one query row per task, each score
a dot product over the head dim, keys in one block sized to the sequence, the task loop serial under the
target's fork/join cost (``serial_work``).  Numerics against a numpy reference on fresh random inputs at
sequences 1, 2, 17 (17 runs a block nest: both sides of the bucket's bound), causal, masked (a fully masked
row), grouped-query, guarded and cross-attention kernels; structure on haswell and skylake-avx512.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import named_target

from tvmfuse import _compat as C
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.base import schedule_with
from tvmfuse.schedules.cpu import attention as A
from tvmfuse.schedules.cpu import common as U
from tvmfuse.target import template_defaults

RTOL, ATOL = 1e-4, 1e-5
H, D, DV = 4, 16, 8          # query heads, head dims (D: one AVX-512 vector, two AVX2 vectors)


def _spec(causal=None, mask=False, gqa=1, guard=False, zero_empty=False, sk=None, sq=None) -> A.AttentionSpec:
    """Attention over [batch, heads, sequence, dim] with symbolic batch and sequence; ``sk``: the key
    length (default: the query sequence itself; an int or a name: cross-attention); ``sq``: a static query
    length (the keys then the symbolic ``sequence``); ``gqa``: query heads per K/V head."""
    batch, seq = C.tirx.Var("batch", "int64"), C.tirx.Var("sequence", "int64")
    keys = seq if sk is None else (sk if isinstance(sk, int) else C.tirx.Var(sk, "int64"))
    seq = seq if sq is None else sq
    hk = H // gqa
    kv_head = "b1" if gqa == 1 else ("%", "b1", gqa, hk)
    op = A.Operand
    return A.AttentionSpec(
        batch=(batch, H), sq=seq, sk=keys, d=D, dv=DV,
        q=op(("b0", "b1", "i", "d"), (batch, H, seq, D)),
        k=op(("b0", kv_head, "j", "d"), (batch, hk, keys, D)),
        v=op(("b0", kv_head, "j", "e"), (batch, hk, keys, DV)),
        out=op(("b0", "b1", "i", "e"), (batch, H, seq, DV)),
        mask=op(("b0", "1", "i", "j"), (batch, 1, seq, keys)) if mask else None,
        guard=op(("b0", "i"), (batch, seq), "bool") if guard else None,
        scale=float(1 / np.sqrt(D)), causal_offset=causal, zero_empty_rows=zero_empty)


def _reference(spec: A.AttentionSpec, feeds: dict, gqa: int) -> np.ndarray:
    q, k, v = feeds["q"], np.repeat(feeds["k"], gqa, axis=1), np.repeat(feeds["v"], gqa, axis=1)
    x = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), k) * spec.scale
    if spec.mask is not None:
        x = x + feeds["mask"]
    if spec.causal_offset is not None:
        sq, sk = x.shape[-2:]
        x = np.where(np.arange(sk)[None, :] > np.arange(sq)[:, None] + spec.causal_offset, -np.inf, x)
    with np.errstate(invalid="ignore"):
        p = np.exp(x - x.max(-1, keepdims=True))
        s = p.sum(-1, keepdims=True)
        out = (p / s) @ v
    if spec.zero_empty_rows:
        out = np.where(np.isnan(s) | (s == 0), 0.0, out)
    if spec.guard is not None:
        out = np.where(feeds["guard"][:, None, :, None], 0.0, out)
    return out.astype(np.float32)


def _feeds(spec, rng, batch, sq, sk, gqa):
    feeds = {"q": rng.standard_normal((batch, H, sq, D)), "k": rng.standard_normal((batch, H // gqa, sk, D)),
             "v": rng.standard_normal((batch, H // gqa, sk, DV))}
    if spec.mask is not None:
        feeds["mask"] = rng.standard_normal((batch, 1, sq, sk))
        feeds["mask"][0, 0, sq - 1, :] = -np.inf           # a fully masked row
    feeds = {n: a.astype(np.float32) for n, a in feeds.items()}
    if spec.guard is not None:
        feeds["guard"] = rng.random((batch, sq)) < 0.3
    return feeds


def _run(func, host, feeds, names, out_shape):
    lib = C.build_prim_module(C.IRModule({"main": func.with_attr("global_symbol", "main")}), host)
    args = [C.tensor(feeds[n]) for n in names] + [C.tensor(np.zeros(out_shape, np.float32))]
    lib["main"](*args)
    return args[-1].numpy()


def _row_bucket(t, match, target):
    buckets = t.buckets(match, target)
    rows = [b for b in buckets if b.name.startswith(A.ROW_BUCKET)]
    assert len(rows) == 1 and buckets[0] is rows[0], [b.name for b in buckets]
    return rows[0]


CASES = {
    "plain": dict(),
    "mask": dict(mask=True),
    "causal": dict(causal=0),
    "causal_mask_gqa": dict(causal=0, mask=True, gqa=2),
    "guard_zero_empty": dict(mask=True, guard=True, zero_empty=True),
}


def _row_nest(spec, target, config=None):
    """The row bucket's nest alone (its default config, or ``config``) and its match."""
    func = A.reference_prim_func(spec)
    t = A.Attention()
    match = t.match(func, target)
    bm = t.bucket_match(match, _row_bucket(t, match, target))
    return schedule_with(t, bm, func, config or t.default_config(bm, target)), bm


@pytest.mark.parametrize("case", list(CASES))
def test_row_nest_matches_reference(case, host, rng):
    """The row nest at sequences 1, 2 and its bucket's bound gives the reference's numbers (NaN where a row
    is fully masked, 0 for a guarded row or, with zero_empty_rows, a row without weight)."""
    kw = dict(CASES[case])
    gqa = kw.setdefault("gqa", 1)
    spec = _spec(**kw)
    nest, bm = _row_nest(spec, host)
    names = [n for n, _ in spec.inputs()]
    for batch, seq in ((1, 1), (3, 2), (2, bm.info["seq_size"])):
        feeds = _feeds(spec, rng, batch, seq, seq, gqa)
        ref = _reference(spec, feeds, gqa)
        out = _run(nest, host, feeds, names, ref.shape)
        np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL, err_msg=f"{case}: batch {batch}, seq {seq}")
        if spec.mask is not None and not spec.zero_empty_rows:
            assert np.isnan(out[0, :, seq - 1]).all()


def test_whole_kernel_dispatches_by_sequence(host, rng):
    """The whole kernel (every bucket's nest, chosen at run time), causal with a mask over grouped-query
    K/V: sequences 1 and 2 (the row nest) and 17 (a block nest) give the reference's numbers."""
    spec = _spec(causal=0, mask=True, gqa=2)
    res = schedule_prim_func(A.reference_prim_func(spec), host)
    assert res.template == "cpu.attention" and res.config["buckets"][0]["config"]["q_block"] == 1, res.config
    names = [n for n, _ in spec.inputs()]
    for batch, seq in ((1, 1), (3, 2), (2, 17)):
        feeds = _feeds(spec, rng, batch, seq, seq, 2)
        ref = _reference(spec, feeds, 2)
        out = _run(res.func, host, feeds, names, ref.shape)
        np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL, err_msg=f"batch {batch}, seq {seq}")


@pytest.mark.parametrize("causal", [None, 3], ids=["plain", "causal_offset"])
def test_row_nest_configs_over_long_keys_match_reference(causal, host, rng):
    """Cross-attention, a short symbolic query sequence over longer keys (static 37, not a multiple of any
    key block; a causal offset of 3 as with 3 past keys): every config of the row bucket's space (key
    blocks, serial and parallel task loops), several key blocks with a tail."""
    spec = _spec(causal=causal, mask=True, sk=37)
    func = A.reference_prim_func(spec)
    t = A.Attention()
    match = t.match(func, host)
    bm = t.bucket_match(match, _row_bucket(t, match, host))
    configs = list(t.space(bm, host).all_configs())
    assert {c["serial_work"] for c in configs} == {0, U.min_parallel_work(host)}
    assert len({c["k_block"] for c in configs}) > 1, configs
    names = [n for n, _ in spec.inputs()]
    for config in configs:
        scheduled = schedule_with(t, bm, func, config)
        for batch, seq in ((1, 1), (2, 3)):
            feeds = _feeds(spec, rng, batch, seq, 37, 1)
            ref = _reference(spec, feeds, 1)
            out = _run(scheduled, host, feeds, names, ref.shape)
            np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL, err_msg=f"{config}: {batch} x {seq}")


def test_row_nest_one_static_query_over_symbolic_keys(host, rng):
    """One static query row over a symbolic key length (a decoding step over its cache, with a mask): the
    buckets dispatch on the keys; the row nest's keys are one block of the bound, and a larger cache runs
    a block nest."""
    spec = _spec(mask=True, sq=1)
    res = schedule_prim_func(A.reference_prim_func(spec), host)
    assert res.config["buckets"][0]["config"]["q_block"] == 1, res.config
    names = [n for n, _ in spec.inputs()]
    for batch, keys in ((1, 1), (2, 5), (1, 40)):
        feeds = _feeds(spec, rng, batch, 1, keys, 1)
        ref = _reference(spec, feeds, 1)
        out = _run(res.func, host, feeds, names, ref.shape)
        np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL, err_msg=f"batch {batch}, keys {keys}")


def _loops(stmt) -> list:
    """(kind, extent, vars of the extent) of every loop under ``stmt``."""
    out = []

    def visit(s):
        if isinstance(s, C.tirx.For):
            names = set()
            C.post_order_visit(s.extent, lambda n: names.add(str(n.name)) if isinstance(n, C.tirx.Var) else None)
            out.append((int(s.kind), s.extent, names))

    C.post_order_visit(stmt, visit)
    return out


def _allocs(stmt) -> list:
    out = []
    C.post_order_visit(stmt, lambda s: out.extend(s.alloc_buffers) if isinstance(s, C.SBlock) else None)
    return out


@pytest.mark.parametrize("name", ["haswell-2", "skx-2"])
def test_row_bucket_is_chosen_for_small_sequences_and_its_nest(name):
    """Over a symbolic sequence the first bucket is the row nest's, bounded by the target table's
    row_nest_max_seq and dispatched on the sequence before the block nests' buckets; its nest: one task per
    (batch, head, row) whose loop runs serial below the target's fork/join cost (a run-time branch on the
    multiply-adds) and parallel above it; per row one key block (the bucket bounds the keys) whose score,
    exp and P @ V loops run over the sequence (no key past the end computed), dot products of a vector
    over the head dim; buffers of at most a key block or a value row."""
    target = named_target(name)
    spec = _spec(mask=True)
    func = A.reference_prim_func(spec)
    t = A.Attention()
    match = t.match(func, target)
    bound = int(template_defaults(target, "cpu.attention")["row_nest_max_seq"])
    bucket = _row_bucket(t, match, target)
    assert bucket.max_extent == bound and 1 <= bound < A.SEQ_BUCKETS[0]
    res = schedule_prim_func(func, target)
    configs = {b["bucket"]: b["config"] for b in res.config["buckets"]}
    row = configs[bucket.name]
    lanes = row["lanes"]
    assert row["q_block"] == 1 and row["k_block"] == bound and row["serial_work"] == U.min_parallel_work(target)
    assert all(c["q_block"] > 1 and c["serial_work"] == 0 for b, c in configs.items() if b != bucket.name)
    # the dispatch: the row nest's bound first, then the block nests'
    conds = []
    C.post_order_visit(res.func.body, lambda s: conds.append(s.condition) if isinstance(s, C.tirx.IfThenElse) else None)
    seq_bounds = [int(c.b) for c in conds if isinstance(c, C.tirx.LE) and
                  isinstance(c.a, C.tirx.Var) and str(c.a.name) == "sequence"]
    assert sorted(seq_bounds) == [bound, *(b for b in A.SEQ_BUCKETS if b > bound)], conds
    outer = res.func.body.block.body        # the first test: the row nest's bound
    assert isinstance(outer, C.tirx.IfThenElse) and int(outer.condition.b) == bound, outer.condition
    # the row nest alone
    nest = schedule_with(t, t.bucket_match(match, bucket), func, row)
    branch = []
    C.post_order_visit(nest.body, lambda s: branch.append(s) if isinstance(s, C.tirx.IfThenElse) else None)
    (work,) = branch
    assert isinstance(work.condition, C.tirx.LT) and int(work.condition.b) == U.min_parallel_work(target)
    for part, kind in ((work.then_case, C.ForKind.SERIAL), (work.else_case, C.ForKind.PARALLEL)):
        loops = _loops(part)
        task = [lp for lp in loops if lp[2] >= {"batch", "sequence"}]
        assert len(task) == 1 and task[0][0] == int(kind), loops         # one task per (batch, head, row)
        assert sum(k == int(C.ForKind.PARALLEL) for k, _, _ in loops) == int(kind == C.ForKind.PARALLEL)
        over_keys = [lp for lp in loops if lp[2] == {"sequence"}]
        assert len(over_keys) == 3 and all(k == int(C.ForKind.SERIAL) for k, _, _ in over_keys), loops
        # one key block: the loop around the key loops has the static extent 1
        blocks = []
        C.post_order_visit(part, lambda s: blocks.append(s) if isinstance(s, C.tirx.For)
                           and isinstance(s.extent, C.IntImm)
                           and any(v == {"sequence"} for _, _, v in _loops(s.body)) else None)
        assert len(blocks) == 1 and int(blocks[0].extent) == 1, blocks
        width = max(int(e) for k, e, _ in loops if k == int(C.ForKind.VECTORIZED))
        assert width == min(lanes, D), loops
        assert max(int(b.shape[0]) for b in _allocs(part)) <= max(bound, DV, lanes)
    # no branch without a serial threshold: the parallel loop alone
    nest0 = schedule_with(t, t.bucket_match(match, bucket), func, {**row, "serial_work": 0})
    kinds = [k for k, _, _ in _loops(nest0.body)]
    ifs = []
    C.post_order_visit(nest0.body, lambda s: ifs.append(s) if isinstance(s, C.tirx.IfThenElse) else None)
    assert kinds.count(int(C.ForKind.PARALLEL)) == 1 and not ifs


def test_serial_work_outside_the_row_nest_is_refused(host):
    """serial_work is the row nest's knob: a block-nest config with it is an error naming it."""
    spec = _spec()
    func = A.reference_prim_func(spec)
    t = A.Attention()
    match = t.match(func, host)
    bm = t.bucket_match(match, t.buckets(match, host)[1])
    config = {**t.default_config(bm, host), "serial_work": 100}
    with pytest.raises(ValueError, match="serial_work"):
        schedule_with(t, bm, func, config)
