"""``cpu.symbolic_rows`` over a symbolic row length (a softmax over ``seq`` keys): the row reductions run on
vector partial results (split by the lanes, rfactored, the split's predicate on the last vector only, its
loop hinted for TVM's LoopPartition) and the elementwise pass over the row on whole vectors; before, each
row was a chain of dependent scalar steps (deberta's masked softmax 4x the time of ``cpu.generic``,
benchmarks/notes/deberta19.md).  Structure on named targets; numbers on the host, with rows laid out so that
a vector read past its row's end (a lost predicate) changes the result."""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.pipeline import PipelineOptions, graph_stage
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu.symbolic import PARTITION_HINT, SymbolicRows
from tvmfuse.target import cpu_info, parse_target

from conftest import NAMED_TARGETS


def _softmax():
    g = M._G("softmax_rows")
    g.op("Softmax", g.input("x", ("rows", "seq")), axis=-1)
    g.rename_last("y", ("rows", "seq"))
    return g.model()


def _masked_softmax():
    """softmax(scores + mask) over [batch, 4, seq, seq] with a [batch, 1, 1, seq] mask (BERT's attention
    probabilities as a kernel of their own)."""
    g = M._G("masked_softmax_rows")
    s = g.input("s", ("batch", 4, "seq", "seq"))
    m = g.input("m", ("batch", 1, 1, "seq"))
    g.op("Softmax", g.op("Add", s, m), axis=-1)
    g.rename_last("y", ("batch", 4, "seq", "seq"))
    return g.model()


def _residual_norm():
    """LayerNorm over a static row of 64 with symbolic rows (the static rows' rfactor, unchanged)."""
    g = M._G("res_ln_rows")
    x, r = g.input("x", ("sequence", 64)), g.input("r", ("sequence", 64))
    s = g.op("Add", x, r)
    g.op("LayerNormalization", s, g.weight((64,), 1.0), g.weight((64,), 1.0), axis=-1, epsilon=1e-5)
    g.rename_last("y", ("sequence", 64))
    return g.model()


def _scheduled(model, tgt):
    mod = tvmfuse.load_onnx(model)
    with tgt:
        mod = C.Sequential(graph_stage(tgt, PipelineOptions()))(mod)
    (kname, func), = [(str(gv.name_hint), f) for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)]
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is not None and res.template == SymbolicRows.family
    return res.func


def _realizes(func):
    """(block name, its realize, the loops above it, innermost first) of every block of ``func``."""
    out = []

    def walk(stmt, loops):
        if isinstance(stmt, C.tirx.For):
            walk(stmt.body, [stmt] + loops)
        elif isinstance(stmt, C.SBlockRealize):
            out.append((str(stmt.block.name_hint), stmt, loops))
            walk(stmt.block.body, loops)
            if stmt.block.init is not None:
                walk(stmt.block.init, loops)
        elif isinstance(stmt, C.SBlock):
            walk(stmt.body, loops)
        elif isinstance(stmt, C.tirx.SeqStmt):
            for s in stmt:
                walk(s, loops)
        elif isinstance(stmt, C.tirx.IfThenElse):     # the size buckets' branch
            walk(stmt.then_case, loops)
            if stmt.else_case is not None:
                walk(stmt.else_case, loops)
        elif hasattr(stmt, "body"):
            walk(stmt.body, loops)

    walk(func.body, [])
    return out


def _is_true(pred) -> bool:
    return isinstance(pred, C.tirx.IntImm) and int(pred) == 1


@pytest.mark.parametrize("target", ["haswell-2", "skx-2", "neon-4"])
def test_softmax_over_symbolic_keys_reduces_on_vector_partial_results(target):
    tgt = parse_target(NAMED_TARGETS[target])
    lanes = cpu_info(tgt).float32_lanes
    blocks = _realizes(_scheduled(_softmax(), tgt))
    updates = [(n, r, loops) for n, r, loops in blocks if n.endswith("_rf_update")]
    # max and sum, one nest per size bucket
    assert sorted(n for n, _, _ in updates) == sorted(["T_softmax_maxelem_rf_update",
                                                       "T_softmax_expsum_rf_update"] * 2)
    for name, realize, loops in updates:
        inner, outer = loops[0], next(lp for lp in loops[1:] if not (isinstance(lp.extent, C.tirx.IntImm)
                                                                      and int(lp.extent) == 1))
        assert inner.kind == C.ForKind.VECTORIZED and int(inner.extent) == lanes, name
        assert not isinstance(outer.extent, C.tirx.IntImm), name           # ceil(seq / lanes) vectors
        assert int(outer.annotations[PARTITION_HINT]) == 1, name
        # the split's predicate is there (compute_at drops it; _restore_predicate puts it back)
        assert not _is_true(realize.predicate) and "seq" in str(realize.predicate), name
    # the write-backs reduce the lanes only; no block reduces over seq one element at a time
    for name, realize, loops in blocks:
        if name in ("T_softmax_maxelem", "T_softmax_expsum"):
            reduce_ivs = [iv for iv in realize.block.iter_vars if int(iv.iter_type) == int(C.IterVar.CommReduce)]
            assert [int(iv.dom.extent) for iv in reduce_ivs] == [lanes], name
    # the output pass: whole vectors (hinted), the last one under the predicate
    for name, realize, loops in blocks:
        if name == "T_softmax_norm":
            assert loops[0].kind == C.ForKind.VECTORIZED and int(loops[0].extent) == lanes
            assert int(loops[1].annotations[PARTITION_HINT]) == 1


@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
def test_static_rows_keep_their_rfactor_without_predicate_or_hint(target):
    """Must not fire: a norm's static row of 64 keeps the static rows' rfactor (no predicate, no hint)."""
    tgt = parse_target(NAMED_TARGETS[target])
    func = _scheduled(_residual_norm(), tgt)
    blocks = _realizes(func)
    assert any(n.endswith("_rf") or n.endswith("_rf_update") for n, _, _ in blocks)
    assert all(_is_true(r.predicate) for _, r, _ in blocks)
    assert PARTITION_HINT not in func.script()


def _rows_that_poison_their_neighbours(rows: int, seq: int, rng) -> np.ndarray:
    """Rows whose successor holds a far larger value in every one of its first 16 places: a vector that
    reads past its row's end takes it into the row's max (softmax then underflows to 0)."""
    x = rng.standard_normal((rows, seq)).astype("float32")
    x += (50.0 * np.arange(rows, dtype="float32"))[:, None]
    return x


@pytest.mark.parametrize("rows,seq", [(1, 1), (5, 7), (4, 8), (300, 9), (17, 131), (64, 128), (3, 33)])
def test_softmax_over_symbolic_keys_matches_numpy(host, rng, rows, seq):
    cm = tvmfuse.compile(_softmax(), host)
    assert [s["template"] for s in cm.report.schedules] == [SymbolicRows.family]
    x = _rows_that_poison_their_neighbours(rows, seq, rng)
    y = cm.run({"x": x})["y"]
    ref = np.exp(x - x.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch,seq", [(1, 1), (2, 7), (3, 17), (1, 128)])
def test_masked_softmax_over_symbolic_keys_matches_numpy(host, rng, batch, seq):
    cm = tvmfuse.compile(_masked_softmax(), host)
    assert [s["template"] for s in cm.report.schedules] == [SymbolicRows.family]
    s = _rows_that_poison_their_neighbours(batch * 4 * seq, seq, rng).reshape(batch, 4, seq, seq)
    m = np.where(rng.random((batch, 1, 1, seq)) < 0.2, -1e4, 0.0).astype("float32")
    z = s + m
    ref = np.exp(z - z.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    np.testing.assert_allclose(cm.run({"s": s, "m": m})["y"], ref, rtol=1e-5, atol=1e-6)
