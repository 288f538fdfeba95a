"""``cpu.symbolic_rows``'s serial size bucket (branch symmm11): rows whose elements stay under the target's
fork/join cost run the serial nest, as a static build of that size does (gpt2_dyn's residual + LayerNorm
kernels at 17 rows of 64 ran two parallel loops on 1k elements).  Structure on named targets, numbers against
the ONNX reference on both sides of the bound."""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.pipeline import PipelineOptions, graph_stage
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu.symbolic import SymbolicRows
from tvmfuse.target import cpu_info, parse_target, template_defaults

from conftest import NAMED_TARGETS

TARGETS = {**NAMED_TARGETS, "znver5-2": {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver5",
                                         "num-cores": 2}}
HIDDEN = 64


def _residual_norm():
    """y = LayerNorm(x + r), s = x + r over [sequence, 64] (gpt2's residual add and norm: two outputs)."""
    g = M._G("res_ln_rows")
    x, r = g.input("x", ("sequence", HIDDEN)), g.input("r", ("sequence", HIDDEN))
    s = g.op("Add", x, r)
    g.op("LayerNormalization", s, g.weight((HIDDEN,), 1.0), g.weight((HIDDEN,), 1.0), axis=-1, epsilon=1e-5)
    g.rename_last("y", ("sequence", HIDDEN))
    g.output(s, ("sequence", HIDDEN))
    return g.model()


def _position_norm():
    """y = LayerNorm(x + 2 p) over x [batch, sequence, 64] and a position table p [sequence, 64] (gpt2's
    embedding kernel: a block over ``sequence x 64`` next to the ``batch x sequence`` rows)."""
    g = M._G("pos_ln_rows")
    x, p = g.input("x", ("batch", "sequence", HIDDEN)), g.input("p", ("sequence", HIDDEN))
    s = g.op("Add", x, g.op("Mul", p, g.const(np.float32(2.0))))
    g.op("LayerNormalization", s, g.weight((HIDDEN,), 1.0), g.weight((HIDDEN,), 1.0), axis=-1, epsilon=1e-5)
    g.rename_last("y", ("batch", "sequence", HIDDEN))
    return g.model()


def _softmax():
    """softmax over [rows, seq] (both symbolic): elements per row unknown until run time."""
    g = M._G("softmax_rows")
    g.op("Softmax", g.input("x", ("rows", "seq")), axis=-1)
    g.rename_last("y", ("rows", "seq"))
    return g.model()


def _only_kernel(model, tgt):
    mod = tvmfuse.load_onnx(model)
    with tgt:
        mod = C.Sequential(graph_stage(tgt, PipelineOptions()))(mod)
    (kname, func), = [(str(gv.name_hint), f) for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)]
    return kname, func


def _parallel_loops(func) -> int:
    found = []
    C.post_order_visit(func.body, lambda n: found.append(n) if isinstance(n, C.tirx.For)
                       and n.kind == C.ForKind.PARALLEL else None)
    return len(found)


def _table_bound(tgt) -> int:
    return template_defaults(tgt, SymbolicRows.family)["min_rows_per_core"] * cpu_info(tgt).cores - 1


@pytest.mark.parametrize("target", ["haswell-2", "skx-2", "znver5-2", "neon-4"])
def test_rows_under_the_fork_join_cost_take_the_serial_nest(target):
    tgt = parse_target(TARGETS[target])
    kname, func = _only_kernel(_residual_norm(), tgt)
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is not None and res.template == SymbolicRows.family
    limit = template_defaults(tgt, "cpu.parallel")["fork_join_work_per_core"] * cpu_info(tgt).cores
    bound = (limit - 1) // HIDDEN
    assert bound > _table_bound(tgt)           # the work rule binds, not min_rows_per_core
    assert [b["bucket"] for b in res.config["buckets"]] == [f"rows<={bound}", f"rows>{bound}"]
    t = SymbolicRows()
    match = t.match(func, tgt)
    for bucket, parallel in zip(t.buckets(match, tgt), (False, True)):
        bm = t.bucket_match(match, bucket)
        nest = C.Schedule(func)
        t.apply(nest, bm, t.default_config(bm, tgt))
        assert (_parallel_loops(nest.mod["main"]) > 0) == parallel, bucket.name


@pytest.mark.parametrize("target", ["skx-2", "neon-4"])
def test_a_block_over_a_factor_of_the_rows_counts_its_elements_per_row_at_most(target):
    """The position table's block (``sequence x 64``) has at most 64 elements per ``batch x sequence`` row."""
    tgt = parse_target(TARGETS[target])
    kname, func = _only_kernel(_position_norm(), tgt)
    t = SymbolicRows()
    match = t.match(func, tgt)
    assert match is not None and match.info["row_len"] == HIDDEN
    limit = template_defaults(tgt, "cpu.parallel")["fork_join_work_per_core"] * cpu_info(tgt).cores
    assert t.buckets(match, tgt)[0].max_extent == (limit - 1) // HIDDEN


@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
def test_rows_of_symbolic_length_keep_the_table_bound(target):
    """A softmax over ``seq``: the elements per row are not a constant, so the bound stays the table's."""
    tgt = parse_target(TARGETS[target])
    kname, func = _only_kernel(_softmax(), tgt)
    t = SymbolicRows()
    match = t.match(func, tgt)
    assert match is not None and match.info["row_len"] is None
    bound = _table_bound(tgt)
    assert [b.name for b in t.buckets(match, tgt)] == [f"rows<={bound}", f"rows>{bound}"]


def test_residual_norm_matches_the_reference_on_both_sides_of_the_bound(host, rng):
    model = _residual_norm()
    cm = tvmfuse.compile(model, target=host)
    bound = (template_defaults(host, "cpu.parallel")["fork_join_work_per_core"] * cpu_info(host).cores - 1) \
        // HIDDEN
    for n in sorted({1, 17, 128, max(1, bound), bound + 1}):
        feeds = {k: rng.standard_normal((n, HIDDEN)).astype(np.float32) for k in ("x", "r")}
        out, ref = cm.run(feeds), M.reference_outputs(model, feeds)
        for name, r in ref.items():
            np.testing.assert_allclose(out[name], r, rtol=1e-4, atol=1e-4, err_msg=f"{name} at {n} rows")


def test_position_norm_matches_the_reference(host, rng):
    model = _position_norm()
    cm = tvmfuse.compile(model, target=host)
    for b, s in ((1, 1), (1, 17), (3, 17), (1, 128), (2, 300)):
        feeds = {"x": rng.standard_normal((b, s, HIDDEN)).astype(np.float32),
                 "p": rng.standard_normal((s, HIDDEN)).astype(np.float32)}
        np.testing.assert_allclose(cm.run(feeds)["y"], M.reference_outputs(model, feeds)["y"], rtol=1e-4,
                                   atol=1e-4, err_msg=f"{b}x{s}")
