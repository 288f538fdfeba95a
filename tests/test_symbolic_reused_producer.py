"""``cpu.elementwise`` over symbolic extents keeps a producer in memory when its consumers' domain is many
times its own (``elementwise.reused_producer``; the table's ``keep_reuse_min`` at ``typical_symbol_size``):
deberta_v2_dyn computes its relative-position tables at run time (a log bucket over [2, S], an index over
[S, S]) and folding them into the per-head [b*4, S, S] gathers recomputed each log 4 x S / 2 times; b1 s128
went from 1.56-1.62x its pinned build to 1.18-1.19x (benchmarks/notes/relpos17.md).

The case: ``t = log(|p| + 1) * 3 + p`` over p[S] (5 operations: more than ``common.CHEAP_PRODUCER_OPS``), then
``y = x * t`` over x[batch, 4, S, S].  Structure on named
targets: the table stays a block of its own over [S] before the output's nest; the rule does not fire on the
static build (folded: one block), on a cheap producer (a plain copy of p), or with ``keep_reuse_min`` above the
reuse.  Numerics: against numpy at several sizes."""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import target as TG
from tvmfuse.models import _G
from tvmfuse.schedules.cpu import common as U
from tvmfuse.schedules.cpu import elementwise as EW

import schedule_cases as S

NEON = '{"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72", "num-cores": 2}'
TARGETS = (S.HASWELL, S.SKYLAKE, NEON)
TARGET_IDS = ["haswell", "skx", "neon"]


def table_times_x(seq="seq", batch="batch", cheap=False):
    g = _G("table_times_x")
    p = g.input("p", [seq])
    x = g.input("x", [batch, 4, seq, seq])
    t = p if cheap else g.op("Add", g.op("Mul", g.op("Log", g.op("Add", g.op("Abs", p), g.const(np.float32(1.0)))),
                                           g.const(np.float32(3.0))), p)
    g.op("Mul", x, t)
    return S.finish(g)


def reference(p, x, cheap=False):
    t = p if cheap else np.log(np.abs(p) + 1.0) * 3.0 + p
    return (x * t).astype(np.float32)


def _kernel(model, target):
    funcs = S.graph_funcs(model, target)
    assert len(funcs) == 1, sorted(funcs)
    return next(iter(funcs.values())), tvmfuse.parse_target(target)


def _left_blocks(func, tgt):
    match = EW.Elementwise().match(func, tgt)
    assert match is not None
    return match, match.info["blocks"]


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_symbolic_table_stays_in_memory(target):
    func, tgt = _kernel(table_times_x(), target)
    match, left = _left_blocks(func, tgt)
    d = TG.template_defaults(tgt, "cpu.elementwise")
    assert match.info["keep_reused"] == [d["keep_reuse_min"], d["typical_symbol_size"]]
    assert len(left) == 2, left                           # the [S] table, then the output
    sch = C.Schedule(func)
    EW.Elementwise().apply(sch, match, EW.Elementwise().default_config(match, tgt))
    blocks = [b for b in U_blocks(sch.mod["main"]) if b.name_hint != "root"]
    table = next(b for b in blocks if b.name_hint == left[0])
    (written,) = [C.region_tensor(w) for w in table.writes]
    assert len(C.tensor_shape(written)) == 1 and not isinstance(C.tensor_shape(written)[0], C.IntImm)


def U_blocks(func):
    found = []
    C.post_order_visit(func.body, lambda n: found.append(n) if isinstance(n, C.SBlock) else None)
    return found


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_rule_does_not_fire_static_cheap_or_above_the_threshold(target, monkeypatch):
    # static: the same graph at S = 16, batch 2, folds into one block (no rule for static kernels)
    func, tgt = _kernel(table_times_x(seq=16, batch=2), target)
    match, left = _left_blocks(func, tgt)
    assert match.info["keep_reused"] is None and len(left) == 1
    # a cheap producer (p itself, no arithmetic) folds
    func, tgt = _kernel(table_times_x(cheap=True), target)
    assert len(_left_blocks(func, tgt)[1]) == 1
    # a reuse threshold above the reuse at typical sizes (4 x 64 x 64 = 16384): folded
    real = TG.template_defaults
    monkeypatch.setattr(U, "template_defaults",
                        lambda t, fam: {**real(t, fam), "keep_reuse_min": 10 ** 6} if fam == EW.FAMILY else real(t, fam))
    func, tgt = _kernel(table_times_x(), target)
    assert len(_left_blocks(func, tgt)[1]) == 1


@pytest.mark.parametrize("cheap", [False, True], ids=["log_table", "copy"])
def test_numerics_at_several_sizes(cheap, rng):
    cm = tvmfuse.compile(table_times_x(cheap=cheap))
    for batch, seq in ((1, 1), (2, 7), (3, 33)):
        p = rng.standard_normal(seq).astype(np.float32)
        x = rng.standard_normal((batch, 4, seq, seq)).astype(np.float32)
        (got,) = cm.run({"p": p, "x": x}).values()
        np.testing.assert_allclose(got, reference(p, x, cheap), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_kept_table_nest_is_serial(target):
    """The kept table's nest has no parallel loop of its own (one more fork/join per call: +6 us on
    deberta_v2_dyn at s1); the output's nest keeps the config's parallel loop."""
    func, tgt = _kernel(table_times_x(), target)
    match, left = _left_blocks(func, tgt)
    assert match.info["kept"] == [left[0]]
    config = {**EW.Elementwise().default_config(match, tgt), "parallel": True}
    sch = C.Schedule(func)
    EW.Elementwise().apply(sch, match, config)
    kinds = {}
    for name in left:
        loops = sch.get_loops(sch.get_sblock(name))
        kinds[name] = [int(sch.get(lp).kind) for lp in loops]
    par = int(C.ForKind.PARALLEL)
    assert par not in kinds[left[0]] and par in kinds[left[1]], kinds


def flat_table_gather(seq="seq", batch="batch"):
    """deberta_v2's form: a table over [2, S] flattened to [2 * S] (a product no output has), read by a
    gather with per-head indices over [batch, 4, S, S]."""
    g = _G("flat_table_gather")
    p = g.input("p", [2, seq])
    idx = g.input("idx", [batch, 4, seq, seq], dtype=S.TensorProto.INT64)
    t = g.op("Add", g.op("Mul", g.op("Log", g.op("Add", g.op("Abs", p), g.const(np.float32(1.0)))),
                         g.const(np.float32(3.0))), p)
    flat = g.op("Reshape", t, g.const(np.array([-1], dtype=np.int64)))
    g.op("Gather", flat, idx, axis=0)
    return S.finish(g)


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_kept_table_does_not_size_the_buckets(target):
    """A kept [2 * S] table shares no symbolic product with the [batch, 4, S, S] output; the size buckets
    (serial below the fork/join cost) come from the outputs alone, as without the rule (without buckets,
    deberta_v2_dyn's s1 call forked the pool for every nest: +5 us)."""
    func, tgt = _kernel(flat_table_gather(), target)
    match, left = _left_blocks(func, tgt)
    assert match.info["kept"] and "batch" in match.info, match.info
    assert EW.Elementwise().buckets(match, tgt)


def test_flat_table_gather_numerics(rng):
    cm = tvmfuse.compile(flat_table_gather())
    for batch, seq in ((1, 1), (2, 9)):
        p = rng.standard_normal((2, seq)).astype(np.float32)
        idx = rng.integers(0, 2 * seq, size=(batch, 4, seq, seq)).astype(np.int64)
        (got,) = cm.run({"p": p, "idx": idx}).values()
        table = (np.log(np.abs(p) + 1.0) * 3.0 + p).reshape(-1)
        np.testing.assert_allclose(got, table[idx], rtol=1e-5, atol=1e-5)
