"""Serial size buckets over symbolic extents (issue 13, Table 10's bert at sequence 1 and resnet18 at batch 1):
a kernel over a symbolic batch or row count whose smallest sizes are under the target's fork/join cost
(``cpu.parallel.fork_join_work_per_core`` x cores, the rule that makes a static build's kernel serial) holds a
serial nest for those sizes next to the parallel one (``schedules.buckets.BatchBuckets``,
``symbolic_matmul.RowBuckets``), so at every size it runs the static build's ``parallel`` choice instead of a
thread-pool fork per call.  Structure on named targets, numbers against onnx's reference evaluator on the host.
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu.elementwise import Elementwise
from tvmfuse.target import cpu_info, parse_target, template_defaults

import schedule_cases as S
from conftest import NAMED_TARGETS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("corpus_io", os.path.join(ROOT, "corpus", "corpus_io.py"))
corpus_io = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(corpus_io)


def _limit(tgt) -> int:
    """The fork/join cost in scalar operations: the table's per-core work x the target's cores."""
    return int(template_defaults(tgt, "cpu.parallel")["fork_join_work_per_core"]) * cpu_info(tgt).cores


def _mask(batch="batch", seq="sequence", width=1):
    """BERT's attention-mask kernel: (1 - float(mask[:, None, None, :])) * -10000 over [batch, sequence]
    (``width`` > 1: a static trailing axis of that many elements per row, [batch, sequence, width])."""
    g = M._G("mask_sym")
    shape = (batch, seq) if width == 1 else (batch, seq, width)
    m = g.input("m", shape)
    g.op("Mul", g.op("Sub", g.const(np.array(1.0, np.float32)), g.op("Unsqueeze", m, g.const(np.array([1], np.int64)))),
         g.const(np.array(-10000.0, np.float32)))
    g.rename_last("y", (batch, 1, seq) if width == 1 else (batch, 1, seq, width))
    return g.model()


def _branches(func):
    """The nests of a bucketed kernel, in bucket order (its root block's body: a chain of branches)."""
    out, node = [], func.body.block.body
    while isinstance(node, C.tirx.IfThenElse):
        out.append(node.then_case)
        node = node.else_case
    return out + [node]


def _parallel_loops(stmt) -> int:
    found = []
    C.post_order_visit(stmt, lambda n: found.append(n) if isinstance(n, C.tirx.For)
                       and int(n.kind) == int(C.ForKind.PARALLEL) else None)
    return len(found)


@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
@pytest.mark.parametrize("width", [1, 64])
def test_symbolic_elementwise_is_serial_under_the_fork_join_cost(target, width):
    tgt = parse_target(NAMED_TARGETS[target])
    (kname, func), = S.graph_funcs(_mask(width=width), tgt).items()
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is not None and res.template == Elementwise.family, res and res.template
    bound = (_limit(tgt) - 1) // width       # batch x sequence rows of `width` elements under the cost
    buckets = res.config["buckets"]
    assert [b["bucket"] for b in buckets] == [f"batch<={bound}", f"batch>{bound}"]
    assert [b["config"]["parallel"] for b in buckets] == [False, True]
    serial, parallel = _branches(res.func)
    assert _parallel_loops(serial) == 0 and _parallel_loops(parallel) == 1
    # the static build's choice on each side of the bound (batch 1 x sequence bound, and one more)
    for seq, want in ((bound, False), (bound + 1, True)):
        (sname, sfunc), = S.graph_funcs(_mask(1, seq, width), tgt).items()
        static = schedule_prim_func(sfunc, tgt, {}, sname)
        assert static.template == Elementwise.family and static.config["parallel"] is want
    # every other knob: the symbolic default's (predicated splits of an unknown extent)
    assert {k: v for k, v in buckets[0]["config"].items() if k != "parallel"} == \
        {k: v for k, v in buckets[1]["config"].items() if k != "parallel"}


def test_symbolic_elementwise_numbers_on_both_sides_of_the_bound(host, rng):
    model = _mask(width=64)
    cm = tvmfuse.compile(model, target=host)
    (sched,) = cm.report.schedules
    bound = int(sched["knobs"]["buckets"][0]["bucket"].split("<=")[1])
    for b, s in ((1, 1), (3, 17), (1, bound), (1, bound + 1), (2, bound)):
        feeds = {"m": rng.standard_normal((b, s, 64)).astype(np.float32)}
        np.testing.assert_allclose(cm.run(feeds)["y"], M.reference_outputs(model, feeds)["y"], rtol=1e-6,
                                   err_msg=f"batch {b} x sequence {s}")


def _rotary(static_table=False):
    """llama's rotary kernel in small (Table 10's llama b1 s1): cos of a position table, an output of its
    own over [sequence] x 16 ([16]: ``static_table``), times the queries over [batch, sequence] x 16: one
    kernel whose outputs' symbolic extents differ (``sequence`` vs ``batch x sequence``)."""
    g = M._G("rotary_sym")
    p = g.input("p", (16,) if static_table else ("sequence", 16))
    x = g.input("x", ("batch", "sequence", 16))
    g.op("Cos", p)
    c = g.rename_last("c", (16,) if static_table else ("sequence", 16))
    g.op("Mul", x, c)
    g.rename_last("y", ("batch", "sequence", 16))
    return g.model()


@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
@pytest.mark.parametrize("static_table", [False, True])
def test_elementwise_outputs_over_different_symbolic_extents_get_a_serial_bucket(target, static_table):
    """Outputs over ``sequence`` (or static extents) next to one over ``batch x sequence``: buckets over the
    covering ``batch x sequence`` whose bound counts every output's elements per row (16 + 16), a serial
    nest under it.  Before, the kernel had one parallel nest: llama's rotary kernel forked the thread pool
    at b1 s1 (11.9 us in the model against 1.5 us on one thread, measured under load, notes/sym9.md)."""
    tgt = parse_target(NAMED_TARGETS[target])
    (kname, func), = S.graph_funcs(_rotary(static_table), tgt).items()
    assert len(func.params) == 4, func            # one kernel: both inputs, both outputs
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is not None and res.template == Elementwise.family, res and res.template
    bound = (_limit(tgt) - 1) // (16 + 16)
    buckets = res.config["buckets"]
    assert [b["bucket"] for b in buckets] == [f"batch<={bound}", f"batch>{bound}"]
    assert [b["config"]["parallel"] for b in buckets] == [False, True]
    serial, parallel = _branches(res.func)
    assert _parallel_loops(serial) == 0 and _parallel_loops(parallel) >= 1
    # the dispatch is on the covering product, not on the position table's extent
    cond = str(res.func.body.block.body.condition)
    assert "batch" in cond and "sequence" in cond, cond


@pytest.mark.parametrize("static_table", [False, True])
def test_elementwise_outputs_over_different_symbolic_extents_numbers(host, rng, static_table):
    model = _rotary(static_table)
    cm = tvmfuse.compile(model, target=host)
    (sched,) = cm.report.schedules
    bound = int(sched["knobs"]["buckets"][0]["bucket"].split("<=")[1])
    for b, s in ((1, 1), (3, 17), (1, bound), (1, bound + 1), (2, bound)):
        feeds = {"p": rng.standard_normal((16,) if static_table else (s, 16)).astype(np.float32),
                 "x": rng.standard_normal((b, s, 16)).astype(np.float32)}
        got, want = cm.run(feeds), M.reference_outputs(model, feeds)
        for k in ("c", "y"):
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=f"{k} {b} x {s}")


# the kernels Table 10e's profile (benchmarks/HISTORY.md) found parallel over the symbolic batch and serial in
# the static build: three 1x1 convs (cpu.conv2d_lanes), the max pool, the global mean (names follow TVM's op
# counters: with the numpy constant fold, passes/fold.py, no reshape is left before the mean's)
SERIAL_AT_1 = {"fused_conv2d4_add3", "fused_conv2d7_add5", "fused_conv2d10_add7", "max_pool2d", "fused_mean_reshape"}


@pytest.mark.slow          # the corpus model's graph stage twice per target (~10 s alone)
@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
def test_resnet18_dyn_runs_the_static_parallel_choice_at_batch_1(target):
    """Table 10's resnet18 at batch 1 (1.33x): its 1x1 convs, pooling and mean were parallel over a symbolic
    batch, serial in the static build (3-4 us of fork/join per call each on 0.5 us of work).  Now the nest
    a batch of 1 runs has the static batch-1 kernel's ``parallel`` knob, kernel by kernel."""
    tgt = parse_target(NAMED_TARGETS[target])
    entry = {e["name"]: e for e in corpus_io.load_manifest()["models"]}["resnet18"]
    sym = S.graph_funcs(corpus_io.model_path(entry, "dynamic"), tgt)
    static = S.graph_funcs(corpus_io.model_path(entry, "static"), tgt)
    assert sorted(sym) == sorted(static)
    serial_at_1 = []
    for kname, func in sorted(sym.items()):
        if kname not in SERIAL_AT_1 and not kname.startswith(("fused_conv2d_", "fused_conv2d9_")):
            continue               # (test time: the serial ones and two parallel ones are enough)
        res, ref = schedule_prim_func(func, tgt, {}, kname), schedule_prim_func(static[kname], tgt, {}, kname)
        if res.template == "cpu.symbolic_rows":
            continue               # the classifier: cpu.matmul_epilogue static, no parallel knob over rows
        assert res.template == ref.template, kname
        if "buckets" in res.config:
            first = res.config["buckets"][0]
            assert first["bucket"].split("<=")[1].isdigit() and int(first["bucket"].split("<=")[1]) >= 1
            at_1 = first["config"]
        else:
            at_1 = res.config
        assert at_1.get("parallel", True) == ref.config.get("parallel", True), (kname, at_1, ref.config)
        if not ref.config.get("parallel", True):
            serial_at_1.append(kname)
    assert set(serial_at_1) == SERIAL_AT_1, serial_at_1


# ---------------------------------------------------------------------------------------------------------
# The static side of Table 10 (bert at batch 1 x sequence 17 slower static than symbolic): cpu.matmul_epilogue
# sized its macro tile for L2 alone, 16 register tiles of 6 rows for 17 rows (13 tiles with every row
# predicated off, each running its k loop, the predicate inside it).  Now the macro tile is at most as tall
# as the rows, and rows that do not fill the macro tiles get the loop-partition hint (whole register tiles
# without the row predicate), as cpu.symbolic_matmul's row-tiled nest does.

def _gelu_proj(rows, k=64, n=256):
    """gelu(x @ W + b) over x [1, rows, k] (BERT's FFN-in at sequence ``rows``)."""
    g = M._G("gelu_proj_static")
    x = g.input("x", (1, rows, k))
    M._gelu_erf(g, g.op("Add", g.op("MatMul", x, g.weight((k, n))), g.weight((n,), 0.1)))
    g.rename_last("y", (1, rows, n))
    return g.model()


def _hinted_loops(func) -> list:
    found = []
    C.post_order_visit(func.body, lambda n: found.append(n) if isinstance(n, C.tirx.For)
                       and "pragma_loop_partition_hint" in n.annotations else None)
    return found


@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
@pytest.mark.parametrize("rows", [17, 136, 96])
def test_static_matmul_macro_tile_fits_the_rows(rows, target):
    tgt = parse_target(NAMED_TARGETS[target])
    (kname, func), = S.graph_funcs(_gelu_proj(rows), tgt).items()
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res.template == "cpu.matmul_epilogue", res.template
    cfg = res.config
    fill = -(-rows // cfg["mr"])                              # register tiles the rows fill
    assert cfg["mc_tiles"] <= max(fill, 1), cfg
    hinted = _hinted_loops(res.func)
    if rows % (cfg["mr"] * cfg["mc_tiles"]):
        assert hinted and all(int(f.kind) in (int(C.ForKind.SERIAL), int(C.ForKind.PARALLEL)) for f in hinted)
    else:
        assert not hinted


@pytest.mark.parametrize("rows", [1, 17, 136])
def test_static_matmul_numbers_with_partial_macro_tiles(rows, host, rng):
    model = _gelu_proj(rows)
    cm = tvmfuse.compile(model, target=host)
    assert [s["template"] for s in cm.report.schedules] == ["cpu.matmul_epilogue"]
    feeds = {"x": rng.standard_normal((1, rows, 64)).astype(np.float32)}
    np.testing.assert_allclose(cm.run(feeds)["y"], M.reference_outputs(model, feeds)["y"], rtol=1e-4, atol=1e-4)
