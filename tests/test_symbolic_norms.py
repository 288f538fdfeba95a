"""Row reductions over symbolic rows (issue 13): BERT's LayerNorm over [batch, sequence, hidden] and its
embedding kernel (token and position lookups + add + LayerNorm) take ``cpu.row_reduction``, as in the static
build: the symbolic rows fused into one loop (serial up to the table's ``min_rows_per_core`` x cores - 1
rows or the rows under the fork/join cost, parallel above: two size buckets over batch x sequence), the static hidden row vectorized with the
static build's knobs (partial-sum width, unroll).  Numbers against onnx's reference evaluator at the issue's
sizes on the host; structure on named targets.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu.reduction import RowReduction
from tvmfuse.target import cpu_info, parse_target, template_defaults

import schedule_cases as S
from conftest import NAMED_TARGETS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILY = RowReduction.family
SIZES = [(1, 1), (1, 17), (3, 17), (8, 17), (1, 128)]      # (batch, sequence)
HIDDEN, VOCAB, MAX_POS = 64, 50, 128
INT64 = 7   # onnx TensorProto.INT64


def _residual_norm(batch="batch", seq="sequence"):
    """LayerNorm(x + r) over [batch, sequence, hidden] (BERT's post-attention norm)."""
    g = M._G("res_ln_sym")
    x, r = g.input("x", (batch, seq, HIDDEN)), g.input("r", (batch, seq, HIDDEN))
    g.op("LayerNormalization", g.op("Add", x, r), g.weight((HIDDEN,), 1.0), g.weight((HIDDEN,), 1.0),
         axis=-1, epsilon=1e-5)
    g.rename_last("y", (batch, seq, HIDDEN))
    return g.model()


def _embedding(batch="batch", seq="sequence"):
    """BERT's embedding: word lookup + position lookup (positions sliced to the sequence length from a
    [1, MAX_POS] constant, as the export does) + LayerNorm."""
    g = M._G("emb_ln_sym")
    ids = g.input("ids", (batch, seq), INT64)
    words = g.op("Gather", g.weight((VOCAB, HIDDEN), 1.0), ids, axis=0)
    seq_len = g.op("Slice", g.op("Shape", ids), g.const(np.array([1], np.int64)), g.const(np.array([2], np.int64)))
    pos_ids = g.op("Slice", g.const(np.arange(MAX_POS, dtype=np.int64)[None]), g.const(np.array([0], np.int64)),
                   seq_len, g.const(np.array([1], np.int64)))
    pos = g.op("Gather", g.weight((MAX_POS, HIDDEN), 1.0), pos_ids, axis=0)
    g.op("LayerNormalization", g.op("Add", words, pos), g.weight((HIDDEN,), 1.0), g.weight((HIDDEN,), 1.0),
         axis=-1, epsilon=1e-5)
    g.rename_last("y", (batch, seq, HIDDEN))
    return g.model()


def _feeds(name, b, s, rng):
    if name == "embedding":
        return {"ids": rng.integers(0, VOCAB, (b, s)).astype(np.int64)}
    return {k: rng.standard_normal((b, s, HIDDEN)).astype(np.float32) for k in ("x", "r")}


BUILDS = {"residual_norm": _residual_norm, "embedding": _embedding}


def _serial_rows(tgt) -> int:
    """The serial nest's most rows: fewer than ``min_rows_per_core`` per core, or (more here) rows whose
    elements (rows x HIDDEN) stay under the target's fork/join cost: the static default's two rules."""
    cores = cpu_info(tgt).cores
    need = template_defaults(tgt, FAMILY)["min_rows_per_core"] * cores
    limit = template_defaults(tgt, "cpu.parallel")["fork_join_work_per_core"] * cores
    return max(need - 1, (limit - 1) // HIDDEN)


def _vector_stores(func, lanes: int) -> int:
    """Stores of whole vectors (a Ramp index of ``lanes`` or more) once TVM's vectorizer has run."""
    found = []

    def visit(n):
        if isinstance(n, C.BufferStore) and any(isinstance(i, C.tirx.Ramp) and int(i.lanes) >= lanes
                                                 for i in n.indices):
            found.append(n)

    C.post_order_visit(S.lowered_vectorized(func).body, visit)
    return len(found)


def _only_kernel(model, tgt):
    funcs = S.graph_funcs(model, tgt)
    assert len(funcs) == 1, sorted(funcs)        # the kernel count: one, as in the static build
    return next(iter(funcs.items()))


@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_symbolic_norm_takes_row_reduction_like_the_static_build(name, target):
    tgt = parse_target(NAMED_TARGETS[target])
    lanes = cpu_info(tgt).float32_lanes
    kname, func = _only_kernel(BUILDS[name](), tgt)
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is not None and res.template == FAMILY, res and res.template
    # two nests: serial up to _serial_rows (511 rows of 64 on 2 cores), parallel above
    serial = _serial_rows(tgt)
    assert serial == 511
    nests = res.config["buckets"]
    assert [b["bucket"] for b in nests] == [f"batch<={serial}", f"batch>{serial}"]
    assert [b["config"]["parallel"] for b in nests] == [False, True]
    # the hidden row: the static build's knobs (at a row count on the parallel side)
    s_name, s_func = _only_kernel(BUILDS[name](3, 17), tgt)
    static = schedule_prim_func(s_func, tgt, {}, s_name)
    assert static.template == FAMILY
    # the parallel knob is each nest's own (checked above: the bucket decides it; the static 3 x 17 kernel is
    # under the shared fork/join rule's work and serial); every other knob is the static build's
    for nest in nests:
        assert {k: v for k, v in nest["config"].items() if k != "parallel"} == \
            {k: v for k, v in static.config.items() if k != "parallel"}
    # the bound is where the static build's parallel knob flips: 51 rows serial, 8 x 64 = 512 rows parallel
    b_name, b_func = _only_kernel(BUILDS[name](8, 64), tgt)
    assert static.config["parallel"] is False
    assert schedule_prim_func(b_func, tgt, {}, b_name).config["parallel"] is True
    # vector partial sums and a vectorized normalization in both nests, as many as the static kernel's x 2
    n_static = _vector_stores(static.func, lanes)
    assert n_static >= 3
    assert _vector_stores(res.func, lanes) == 2 * n_static
    kinds = [int(n.kind) for n in S.nodes(res.func) if isinstance(n, C.tirx.For)]
    assert kinds.count(int(C.ForKind.PARALLEL)) == 1          # the open bucket's fused row loop


@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
def test_bert_dyn_norms_and_embedding_take_row_reduction(target):
    """In the corpus's bert_dyn: every LayerNorm kernel and the embedding kernel are cpu.row_reduction's
    (before issue 13's fix: cpu.symbolic_rows, 3x the static kernel's time); the kernel count is the static
    bert's."""
    path = os.path.join(ROOT, "corpus", "bert_dyn.onnx")
    if not os.path.exists(path):
        pytest.skip("corpus model bert_dyn.onnx not present")
    tgt = parse_target(NAMED_TARGETS[target])
    dyn = S.graph_funcs(path, tgt)
    static = S.graph_funcs(os.path.join(ROOT, "corpus", "bert.onnx"), tgt)
    assert len(dyn) == len(static)
    # the row reductions: every kernel with a reduction block but the matmuls and attention
    norms = {n: f for n, f in dyn.items() if "matmul" not in n and "attention" not in n and any(
        isinstance(b, C.SBlock) and any(int(iv.iter_type) == C.IterVarKind.CommReduce for iv in b.iter_vars)
        for b in S.nodes(f))}
    embedding = [n for n, f in norms.items() if any(str(p.dtype) == "int64" for p in f.params if hasattr(p, "dtype"))]
    assert len(embedding) == 1 and len(norms) >= 2, sorted(dyn)
    lanes = cpu_info(tgt).float32_lanes
    for n, f in norms.items():
        res = schedule_prim_func(f, tgt, {}, n)
        assert res.template == FAMILY, (n, res.template)
        assert _vector_stores(res.func, lanes) >= 6, n


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_symbolic_norm_matches_the_reference_at_every_size(name, host, rng):
    model = BUILDS[name]()
    cm = tvmfuse.compile(model, target=host)
    assert cm.kernel_count == 1
    assert [s["template"] for s in cm.report.schedules] == [FAMILY]
    for b, s in SIZES:
        feeds = _feeds(name, b, s, rng)
        got, want = cm.run(feeds)["y"], M.reference_outputs(model, feeds)["y"]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{name} at {b}x{s}")


def test_tuner_measures_each_bucket_at_a_row_count_inside_it():
    """The size buckets split batch x sequence: a tuner binds the sequence to the bucket's row count and
    the batch to 1 (``BatchBuckets.bucket_sizes``), so each nest is measured at rows it runs at."""
    tgt = parse_target(NAMED_TARGETS["skx-2"])
    _, func = _only_kernel(_residual_norm(), tgt)
    t = RowReduction()
    match = t.match(func, tgt)
    assert match is not None
    small, large = t.buckets(match, tgt)
    serial = _serial_rows(tgt)
    assert t.bucket_sizes(match, small, tgt) == {"batch": 1, "sequence": serial}
    assert t.bucket_sizes(match, large, tgt) == {"batch": 1, "sequence": serial + 1}
    for bucket, parallel in ((small, False), (large, True)):
        assert t.default_config(t.bucket_match(match, bucket), tgt)["parallel"] is parallel
