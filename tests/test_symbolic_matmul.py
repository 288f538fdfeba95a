"""``cpu.symbolic_matmul`` (tvmfuse/schedules/cpu/symbolic_matmul.py): a matmul + epilogue over a symbolic
row count (batch, batch x sequence) with static N/K gets the register-tiled GEMM schedule, rows looped with
a predicated last tile.  Structural tests on named targets, numbers vs the ONNX reference at row counts
that leave a partial last tile."""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.pipeline import PipelineOptions, graph_stage
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu.symbolic import SymbolicRows
from tvmfuse.schedules.cpu.symbolic_matmul import SymbolicMatmulEpilogue
from tvmfuse.target import parse_target

from conftest import NAMED_TARGETS

FAMILY = SymbolicMatmulEpilogue.family


def _mlp(rows="batch", n=32):
    """y = relu(x @ W + b) over x [rows, 64]."""
    g = M._G("mlp_sym")
    x = g.input("x", (rows, 64))
    g.op("Relu", g.op("Add", g.op("MatMul", x, g.weight((64, n))), g.weight((n,), 0.1)))
    g.rename_last("y", (rows, n))
    return g.model()


def _proj3d(batch="batch", seq="sequence"):
    """y = x @ W + b + x over x [batch, seq, 64] (a projection with residual: rows = batch x seq)."""
    g = M._G("proj3d_sym")
    x = g.input("x", (batch, seq, 64))
    g.op("Add", g.op("Add", g.op("MatMul", x, g.weight((64, 64))), g.weight((64,), 0.1)), x)
    g.rename_last("y", (batch, seq, 64))
    return g.model()


def _batched(seq="sequence"):
    """q @ k^T per head (the weight follows the batch axis): not this template's."""
    g = M._G("bmm_sym")
    q = g.input("q", (4, seq, 16))
    k = g.input("k", (4, 16, 32))
    g.op("MatMul", q, k)
    g.rename_last("y", (4, seq, 32))
    return g.model()


def _kernels(model, target):
    mod = tvmfuse.load_onnx(model)
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions()))(mod)
    return {str(gv.name_hint): f for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)}


def _loops(stmt):
    """(kind, extent) of every loop of a scheduled loop nest, outermost first."""
    out = []

    def visit(node):
        if isinstance(node, C.tirx.For):
            out.append((int(node.kind), node.extent))

    C.post_order_visit(stmt, visit)
    return out[::-1]


@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
@pytest.mark.parametrize("name, build", [("mlp", _mlp), ("proj3d", _proj3d)])
def test_symbolic_rows_matmul_gets_the_register_tiled_schedule(name, build, target):
    tgt = parse_target(NAMED_TARGETS[target])
    lanes = 16 if target.startswith("skx") else 8
    (kname, func), = _kernels(build(), tgt).items()
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is not None and res.template == FAMILY, res and res.template
    # the kernel branches on the row count (tests/test_symbolic_buckets.py); the nest for many rows:
    cfg = res.config["buckets"][-1]["config"]
    assert cfg["lanes"] == lanes and cfg["flatten_batch"]
    nest = res.func.body.block.body
    while isinstance(nest, C.tirx.IfThenElse):        # the open bucket's nest: the chain's last branch
        nest = nest.else_case
    loops = _loops(nest)
    # outermost: one parallel loop over row tiles, its extent symbolic (rows known at run time only)
    kind, extent = loops[0]
    assert kind == int(C.ForKind.PARALLEL) and not isinstance(extent, C.IntImm)
    # the register tile: mr rows x nvec vectors unrolled, lanes vectorized (static extents)
    unrolled = [int(e) for k, e in loops if k == int(C.ForKind.UNROLLED)]
    assert cfg["mr"] == 1 or cfg["mr"] in unrolled
    assert cfg["nvec"] == 1 or cfg["nvec"] in unrolled
    vec = [int(e) for k, e in loops if k == int(C.ForKind.VECTORIZED)]
    assert vec and all(v == lanes for v in vec)
    # rows flattened into one symbolic axis: the matmul accumulates into a rows x N buffer, and only the
    # parallel loop and the row tiles inside it depend on the row count
    assert sum(not isinstance(e, C.IntImm) for _, e in loops) == 1


def test_must_not_fire_on_static_kernels_batched_weights_or_column_tails(host):
    tgt = parse_target(NAMED_TARGETS["skx-2"])
    t = SymbolicMatmulEpilogue()
    static = _kernels(_mlp(rows=8), tgt)
    assert static and all(t.match(f, tgt) is None for f in static.values())
    batched = _kernels(_batched(), tgt)
    assert batched and all(t.match(f, tgt) is None for f in batched.values())
    # N = 10 (a classifier): no multiple of the 16 lanes; cpu.symbolic_rows keeps it
    (kname, func), = _kernels(_mlp(n=10), tgt).items()
    assert t.match(func, tgt) is None
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is not None and res.template == SymbolicRows.family


@pytest.mark.parametrize("rows", [(1, 5, 37, 64, 67, 136)])
def test_symbolic_matmul_matches_the_reference_at_any_row_count(rows, host, rng):
    model = _mlp()
    cm = tvmfuse.compile(model, target=host)
    assert [s["template"] for s in cm.report.schedules] == [FAMILY]
    # 1 and 5: fewer rows than one register tile; 37, 67: a partial last tile after whole ones (the loop
    # partition splits them); 64, 136: whole tiles only
    for n in rows:
        feeds = {"x": rng.standard_normal((n, 64)).astype(np.float32)}
        ref = M.reference_outputs(model, feeds)
        np.testing.assert_allclose(cm.run(feeds)["y"], ref["y"], rtol=1e-4, atol=1e-4, err_msg=f"rows={n}")


@pytest.mark.parametrize("target", ["haswell-2", "skx-32", "neon-4"])
def test_row_tiled_nest_partitions_whole_tiles_from_the_last(target):
    """The row-tiled bucket's matmul loops carry TVM's loop-partition hint (the tiles whose rows all
    exist lose the per-row predicate inside the k loop, so their accumulators stay in registers); the
    GEMV-like bucket has no row predicate and no hint."""
    tgt = parse_target(NAMED_TARGETS[target])
    (kname, func), = _kernels(_proj3d(), tgt).items()
    t = SymbolicMatmulEpilogue()
    match = t.match(func, tgt)
    hints = {}
    for bucket in t.buckets(match, tgt):
        bm = t.bucket_match(match, bucket)
        sch = C.Schedule(func)
        t.apply(sch, bm, t.default_config(bm, tgt))
        found = []
        C.post_order_visit(sch.mod["main"].body, lambda n: found.append(n) if isinstance(n, C.tirx.For)
                           and "pragma_loop_partition_hint" in n.annotations else None)
        hints[bucket.max_extent is None] = found
    assert not hints[False] and hints[True]
    assert all(f.kind in (C.ForKind.SERIAL, C.ForKind.PARALLEL) for f in hints[True])


def test_symbolic_matmul_over_batch_and_sequence_matches_the_reference(host, rng):
    model = _proj3d()
    cm = tvmfuse.compile(model, target=host)
    assert [s["template"] for s in cm.report.schedules] == [FAMILY]
    for b, s in ((1, 1), (3, 17), (2, 128)):      # tiles that cross a batch boundary (3 x 17)
        feeds = {"x": rng.standard_normal((b, s, 64)).astype(np.float32)}
        ref = M.reference_outputs(model, feeds)
        np.testing.assert_allclose(cm.run(feeds)["y"], ref["y"], rtol=1e-4, atol=1e-4, err_msg=f"{b}x{s}")
