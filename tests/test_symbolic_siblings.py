"""``cpu.symbolic_siblings`` (tvmfuse/schedules/cpu/symbolic_siblings.py): sibling matmuls of one input
(Q/K/V, gate/up) over a symbolic row count (batch, batch x sequence) with static N/K get
``cpu.sibling_matmuls``'s register-tiled schedule in two size buckets, not ``cpu.symbolic_rows``.
Structural tests on named targets, numbers vs the ONNX reference at row counts with partial last tiles."""
import random

import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse import target as TG
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu.siblings import SiblingMatmuls
from tvmfuse.schedules.cpu.symbolic import SymbolicRows
from tvmfuse.schedules.cpu.symbolic_siblings import SymbolicSiblings
from tvmfuse.target import parse_target

import schedule_cases as S
from conftest import NAMED_TARGETS

FAMILY = SymbolicSiblings.family


def _qkv(rows=("batch", "sequence"), hidden=64, bias=True):
    """q, k, v = x @ W_s (+ b_s) over x [*rows, hidden] (BERT's projections: three outputs)."""
    g = M._G("qkv_sym")
    x = g.input("x", (*rows, hidden))
    for name in ("q", "k", "v"):
        y = g.op("MatMul", x, g.weight((hidden, hidden)))
        if bias:
            g.op("Add", y, g.weight((hidden,), 0.1))
        g.rename_last(name, (*rows, hidden))
    return g.model()


def _swiglu(rows="rows", hidden=48, ffn=64):
    """silu(x @ Wg) * (x @ Wu) over x [rows, hidden] (the demo model with symbolic rows)."""
    return M.swiglu(seq=rows, hidden=hidden, ffn=ffn)


def _loops(stmt):
    """(kind, extent, annotations) of every loop of a loop nest, outermost first."""
    out = []
    C.post_order_visit(stmt, lambda n: out.append((int(n.kind), n.extent, dict(n.annotations)))
                       if isinstance(n, C.tirx.For) else None)
    return out[::-1]


def _is_static(e) -> bool:
    return isinstance(e, C.IntImm)


@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
@pytest.mark.parametrize("name, build", [("qkv3d", _qkv), ("swiglu", _swiglu)])
def test_symbolic_siblings_get_a_register_tiled_nest_per_bucket(name, build, target):
    tgt = parse_target(NAMED_TARGETS[target])
    lanes = 16 if target.startswith("skx") else 8
    (kname, func), = S.graph_funcs(build(), tgt).items()
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is not None and res.template == FAMILY, res and res.template
    # one kernel branching on the row count: a serial GEMV-like nest for fewer rows than two per core
    # (serial_rows_per_core) or, if more, the rows whose multiply-adds are under the fork/join cost (qkv3d:
    # 3 x 64 x 64 per row, 2 rows; swiglu: 2 x 48 x 64, 5 rows), the parallel GEMV-like nest up to
    # small_rows, else the row-tiled one
    per_row = {"qkv3d": 3 * 64 * 64, "swiglu": 2 * 48 * 64}[name]
    limit = int(TG.template_defaults(tgt, "cpu.parallel")["fork_join_work_per_core"]) * 2
    serial = max(int(TG.template_defaults(tgt, FAMILY)["serial_rows_per_core"]) * 2 - 1, (limit - 1) // per_row)
    assert serial == {"qkv3d": 3, "swiglu": 5}[name]
    assert [b["bucket"] for b in res.config["buckets"]] == [f"rows<={serial}", "rows<=16", "rows>16"]
    nests, body = [], res.func.body.block.body
    while isinstance(body, C.tirx.IfThenElse):
        nests.append(body.then_case)
        body = body.else_case
    nests.append(body)
    assert len(nests) == 3
    serial_cfg, small_cfg, big_cfg = (b["config"] for b in res.config["buckets"])
    for cfg, nest in zip((serial_cfg, small_cfg, big_cfg), nests):
        loops = _loops(nest)
        assert cfg["lanes"] == lanes and not cfg["pad_n"]
        # the register tile: nvec vectors (and mr rows) unrolled, lanes vectorized, static extents
        unrolled = [int(e) for k, e, _ in loops if k == int(C.ForKind.UNROLLED)]
        assert cfg["nvec"] == 1 or cfg["nvec"] in unrolled
        assert cfg["mr"] == 1 or cfg["mr"] in unrolled
        vec = [int(e) for k, e, _ in loops if k == int(C.ForKind.VECTORIZED)]
        assert vec and all(v == lanes for v in vec)
        assert all(_is_static(e) for k, e, _ in loops if k in (int(C.ForKind.UNROLLED),
                                                               int(C.ForKind.VECTORIZED)))
        par = [e for k, e, _ in loops if k == int(C.ForKind.PARALLEL)]
        hinted = [a for _, _, a in loops if "pragma_loop_partition_hint" in a]
        if cfg is not big_cfg:
            # one row per tile, no row predicate to partition; one parallel loop (one thread-pool launch)
            # over the rows with every chain inside it, none in the serial nest
            assert cfg["mr"] == 1 and cfg["mc_tiles"] == 1 and cfg["order"] == "rows"
            assert not hinted
            assert (not par) if cfg is serial_cfg else (len(par) == 1 and not _is_static(par[0]))
        else:
            # row tiles: the parallel loop runs over a symbolic number of row blocks (one for all chains
            # when the rows are shared); whole tiles partitioned from the last one
            assert cfg["mr"] > 1 and hinted
            assert par and (cfg["order"] == "cols" or not _is_static(par[0]))
            if cfg["order"] == "rows" and name == "qkv3d":
                assert cfg["share_rows"] and len(par) == 1


def test_many_cores_have_no_serial_bucket():
    """Two rows per core on 32 cores is past small_rows: the parallel GEMV-like nest takes every few rows."""
    tgt = parse_target(NAMED_TARGETS["skx-32"])
    t = SymbolicSiblings()
    (kname, func), = S.graph_funcs(_qkv(), tgt).items()
    assert [b.name for b in t.buckets(t.match(func, tgt), tgt)] == ["rows<=16", "rows>16"]


def test_every_sampled_config_of_each_bucket_schedules(host):
    """The knob space per bucket is legal: sampled points of it apply to the kernel."""
    tgt = parse_target(NAMED_TARGETS["skx-2"])
    t = SymbolicSiblings()
    (kname, func), = S.graph_funcs(_qkv(), tgt).items()
    match = t.match(func, tgt)
    pick = random.Random(0)
    for bucket in t.buckets(match, tgt):
        bm = t.bucket_match(match, bucket)
        space = t.space(bm, tgt)
        for _ in range(6):
            cfg = {kb.name: pick.choice(kb.choices) for kb in space.knobs}
            t.apply(C.Schedule(func), bm, cfg)


def test_qkv_over_symbolic_rows_leaves_no_full_size_matmul_buffer():
    """The matmuls accumulate on register tiles: after lowering, every buffer the kernel allocates has
    a static size (no rows x N intermediate)."""
    tgt = parse_target(NAMED_TARGETS["skx-2"])
    (kname, func), = S.graph_funcs(_qkv(), tgt).items()
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res.template == FAMILY
    mod = C.Sequential([C.s_tir.transform.LowerInitBlock(),
                        C.s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
                        C.s_tir.transform.ConvertBlocksToOpaque(),
                        C.s_tir.transform.CompactBufferAllocation()])(C.IRModule({"main": res.func}))
    allocs = []
    C.post_order_visit(mod["main"].body, lambda n: allocs.extend(n.alloc_buffers)
                       if isinstance(n, C.SBlock) else None)
    assert allocs, "expected register-tile accumulators"
    assert all(_is_static(d) for b in allocs for d in b.shape), [(b.name, list(b.shape)) for b in allocs]


def test_must_not_fire_on_static_kernels_and_pads_column_tails():
    tgt = parse_target(NAMED_TARGETS["skx-2"])
    t = SymbolicSiblings()
    static = S.graph_funcs(_qkv(rows=(2, 8)), tgt)
    assert static and all(t.match(f, tgt) is None for f in static.values())
    assert any(SiblingMatmuls().match(f, tgt) is not None for f in static.values())
    # N = 40: no multiple of the 16 lanes: the columns padded to the register tile (was cpu.symbolic_rows,
    # one row at a time; tests/test_symbolic_index.py has the numbers)
    (kname, func), = S.graph_funcs(_qkv(hidden=40), tgt).items()
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is not None and res.template == FAMILY and res.template != SymbolicRows.family
    *small, big = (b["config"] for b in res.config["buckets"])
    assert big["pad_n"] and 40 % (big["nvec"] * big["lanes"])
    # the GEMV-like nests: half-width vectors divide 40 (no padded copy of B per call)
    assert small and all(c["lanes"] == 8 and not c["pad_n"] for c in small)


@pytest.mark.parametrize("rows", [(1, 5, 17, 64, 136)])
def test_symbolic_siblings_match_the_reference_at_any_row_count(rows, host, rng):
    model = _swiglu()
    cm = tvmfuse.compile(model, target=host)
    assert [s["template"] for s in cm.report.schedules] == [FAMILY]
    for n in rows:
        feeds = {"x": rng.standard_normal((n, 48)).astype(np.float32)}
        ref = M.reference_outputs(model, feeds)
        np.testing.assert_allclose(cm.run(feeds)["y"], ref["y"], rtol=1e-4, atol=1e-4, err_msg=f"rows={n}")


def test_qkv_over_batch_and_sequence_matches_the_reference(host, rng):
    model = _qkv()
    cm = tvmfuse.compile(model, target=host)
    assert [s["template"] for s in cm.report.schedules] == [FAMILY]
    # rows 1, 5, 17, 64, 136: both buckets, partial and whole row tiles, tiles across a batch boundary
    for b, s in ((1, 1), (1, 5), (1, 17), (4, 16), (8, 17)):
        feeds = {"x": rng.standard_normal((b, s, 64)).astype(np.float32)}
        ref = M.reference_outputs(model, feeds)
        out = cm.run(feeds)
        for name in ("q", "k", "v"):
            np.testing.assert_allclose(out[name], ref[name], rtol=1e-4, atol=1e-4, err_msg=f"{name} {b}x{s}")
