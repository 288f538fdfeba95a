"""``cpu.symbolic_batch_matmul`` (tvmfuse/schedules/cpu/symbolic_batch_matmul.py): a batched matmul over
symbolic extents whose second operand follows a batch axis (attention's QK^T + bias, probs @ V, a weight per
head) gets a register-tiled schedule on zero-padded i / j domains instead of ``cpu.symbolic_rows``'s row at a
time (deberta_v2_dyn's QK^T + bias: 545 -> 29 us at b1 s128, kernel-only, under load; notes/deberta14.md).
Numbers against the ONNX reference at sizes that leave partial tiles; structure on named targets."""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.pipeline import PipelineOptions, graph_stage
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu.symbolic_batch_matmul import SymbolicBatchMatmul
from tvmfuse.schedules.cpu.symbolic_matmul import SymbolicMatmulEpilogue
from tvmfuse.target import parse_target

from conftest import NAMED_TARGETS

FAMILY = SymbolicBatchMatmul.family
HEADS, D = 4, 16
TINY = 1024         # schedules/cpu_targets.json: cpu.symbolic_batch_matmul.tiny_macs


def _scores():
    """y = q @ k + bias per (batch, head): N = sequence, K static (QK^T with DeBERTa's c2p / p2c bias)."""
    g = M._G("bmm_scores")
    q = g.input("q", ("batch", HEADS, "sequence", D))
    k = g.input("k", ("batch", HEADS, D, "sequence"))
    bias = g.input("bias", ("batch", HEADS, "sequence", "sequence"))
    g.op("Add", g.op("MatMul", q, k), bias)
    g.rename_last("y", ("batch", HEADS, "sequence", "sequence"))
    return g.model()


def _values():
    """y = p @ v per (batch, head): K = sequence, N static (attention's probs @ V)."""
    g = M._G("bmm_values")
    p = g.input("p", ("batch", HEADS, "sequence", "sequence"))
    v = g.input("v", ("batch", HEADS, "sequence", D))
    g.op("MatMul", p, v)
    g.rename_last("y", ("batch", HEADS, "sequence", D))
    return g.model()


def _head_weight(n=24, seq="sequence"):
    """y = x @ W[h] with a constant weight per head (N = 24: no multiple of the 16-float tile)."""
    g = M._G("bmm_head_weight")
    x = g.input("x", ("batch", HEADS, seq, D))
    g.op("MatMul", x, g.weight((HEADS, D, n)))
    g.rename_last("y", ("batch", HEADS, seq, n))
    return g.model()


def _static_rows():
    """The per-head weight at a static M = 17 (no multiple of mr) under a symbolic batch: both tile loops
    static, predicated, and without the partition hint (TVM's LoopPartition broke the build there:
    test_symbolic_shape_peepholes' position keys at sequence 17)."""
    return _head_weight(seq=17)


MODELS = {"scores": _scores, "values": _values, "head_weight": _head_weight, "static_rows": _static_rows}


def _kernels(model, target):
    mod = tvmfuse.load_onnx(model)
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions()))(mod)
    return {str(gv.name_hint): f for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)}


def _realizes(func):
    out = []
    C.post_order_visit(func.body, lambda n: out.append(n) if isinstance(n, C.SBlockRealize) else None)
    return out


def _loops(func):
    out = []
    C.post_order_visit(func.body, lambda n: out.append(n) if isinstance(n, C.tirx.For) else None)
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_batched_symbolic_matmul_matches_the_reference(name, host, rng):
    model = MODELS[name]()
    cm = tvmfuse.compile(model, target=host)
    assert [s["template"] for s in cm.report.schedules] == [FAMILY]
    inputs = [i for i in model.graph.input]
    # (1, 1), (1, 2): scores and values in the tiny bucket (64 and 256 multiply-adds), head_weight in the
    # few-MACs one; (2, 5), (3, 33): partial last row and column tiles after whole ones (the loop partition
    # splits them); (1, 32): whole tiles only
    for b, s in ((1, 1), (1, 2), (2, 5), (3, 33), (1, 32)) if name != "static_rows" else ((1, 17), (3, 17)):
        sizes = {"batch": b, "sequence": s}
        feeds = {}
        for i in inputs:
            dims = [sizes[d.dim_param] if d.dim_param else d.dim_value for d in i.type.tensor_type.shape.dim]
            feeds[i.name] = rng.standard_normal(dims).astype(np.float32)
        ref = M.reference_outputs(model, feeds)
        np.testing.assert_allclose(cm.run(feeds)["y"], ref["y"], rtol=1e-4, atol=1e-4, err_msg=str(sizes))


class _Nest:
    def __init__(self, func, config):
        self.func, self.config = func, config


def _bucket_nest(func, tgt, kind: str) -> _Nest:
    """One size bucket's nest of ``func`` alone (its default config): "tiny" (the scalar nest), "few" (the
    serial few-MACs one) or "open" (the padded, parallel one)."""
    t = SymbolicBatchMatmul()
    match = t.match(func, tgt)
    assert match is not None
    bms = [t.bucket_match(match, b) for b in t.buckets(match, tgt)]
    bm, = [m for m in bms if kind == ("tiny" if m.info["tiny"] else "few" if m.info["few"] else "open")]
    config = t.default_config(bm, tgt)
    sch = C.Schedule(func)
    t.apply(sch, bm, config)
    return _Nest(sch.mod["main"], config)


@pytest.mark.parametrize("target, lanes", [("haswell-2", 8), ("skx-2", 16), ("neon-4", 4)])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_register_tile_on_padded_domains(name, target, lanes):
    """The matmul's update block runs without a predicate (i and j padded to whole tiles), vectorized at the
    target's lanes under a parallel batch loop; the row tile loop carries the partition hint, and the column
    tile loop over a symbolic N."""
    tgt = parse_target(NAMED_TARGETS[target])
    (kname, func), = _kernels(MODELS[name](), tgt).items()
    res = _bucket_nest(func, tgt, "open")
    assert res.config["lanes"] == lanes
    updates = [r for r in _realizes(res.func) if str(r.block.name_hint).endswith("_update")]
    assert len(updates) == 1
    assert isinstance(updates[0].predicate, C.IntImm) and int(updates[0].predicate) == 1, updates[0].predicate
    loops = _loops(res.func)
    assert any(int(lp.kind) == int(C.ForKind.PARALLEL) for lp in loops)
    assert lanes in {int(lp.extent) for lp in loops if int(lp.kind) == int(C.ForKind.VECTORIZED)}
    hinted = [lp for lp in loops if "pragma_loop_partition_hint" in lp.annotations]
    # only loops over a symbolic extent: rows (not static_rows'), columns (scores' N = sequence)
    assert len(hinted) == {"scores": 2, "values": 1, "head_weight": 1, "static_rows": 0}[name]
    # operand copies zero-padded per batch: A (symbolic rows) always, B where N is symbolic (scores) or no
    # multiple of the 16-float tile (head_weight's 24); the values' N = 16 is whole tiles
    out = str(res.func.params[-1].name)
    pads = sorted(str(r.block.name_hint) for r in _realizes(res.func) if str(r.block.name_hint).endswith("_pad")
                  and str(r.block.writes[0].source.name) != out)
    assert pads == {"scores": ["p0_pad", "p1_pad"], "values": ["p_pad"], "head_weight": ["B_pad", "x_pad"],
                    "static_rows": ["B_pad", "x_pad"]}[name]
    # and it lowers for the target (TVM's LoopPartition on a predicated static column loop did not)
    C.lower_tir(C.IRModule({"main": res.func.with_attr("global_symbol", "main")}), tgt)


def test_must_not_fire_on_shared_weights_or_static_kernels():
    tgt = parse_target(NAMED_TARGETS["haswell-2"])
    t = SymbolicBatchMatmul()
    # a weight shared by every batch: cpu.symbolic_matmul's
    g = M._G("shared_weight")
    g.op("MatMul", g.input("x", ("batch", "sequence", 64)), g.weight((64, 32)))
    g.rename_last("y", ("batch", "sequence", 32))
    (kname, func), = _kernels(g.model(), tgt).items()
    assert t.match(func, tgt) is None
    assert schedule_prim_func(func, tgt, {}, kname).template == SymbolicMatmulEpilogue.family
    # all static: cpu.matmul_epilogue's
    g = M._G("static_bmm")
    g.op("MatMul", g.input("q", (2, HEADS, 8, D)), g.input("k", (2, HEADS, D, 8)))
    g.rename_last("y", (2, HEADS, 8, 8))
    static = _kernels(g.model(), tgt)
    assert static and all(t.match(f, tgt) is None for f in static.values())


@pytest.mark.parametrize("target, lanes, cores", [("haswell-2", 8, 2), ("skx-32", 16, 32), ("neon-4", 4, 4)])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_few_macs_bucket_is_serial_without_row_padding(name, target, lanes, cores):
    """The bounded bucket (up to the target's fork/join cost in multiply-adds): no parallel loop, one-row
    register tiles (A read in place: no row padding), B's padded copy per column tile, a K x nr panel of
    static size (a stack buffer) where K is static; the update still without a predicate and vectorized.
    The joined kernel branches on batch x M x N x K against the bound and lowers."""
    from tvmfuse.schedules.cpu import common as U

    tgt = parse_target(NAMED_TARGETS[target])
    (kname, func), = _kernels(MODELS[name](), tgt).items()
    t = SymbolicBatchMatmul()
    match = t.match(func, tgt)
    bound = U.serial_batches(1, tgt)
    assert bound == U.min_parallel_work(tgt) - 1
    assert [b.name for b in t.buckets(match, tgt)] == [f"macs<={TINY}", f"macs<={bound}", f"macs>{bound}"]
    nest = _bucket_nest(func, tgt, "few")
    assert nest.config["mr"] == 1 and nest.config["parallel"] is False and nest.config["lanes"] == lanes
    loops = _loops(nest.func)
    assert not any(int(lp.kind) == int(C.ForKind.PARALLEL) for lp in loops)
    assert lanes in {int(lp.extent) for lp in loops if int(lp.kind) == int(C.ForKind.VECTORIZED)}
    updates = [r for r in _realizes(nest.func) if str(r.block.name_hint).endswith("_update")]
    assert len(updates) == 1 and isinstance(updates[0].predicate, C.IntImm), updates[0].predicate
    out = str(nest.func.params[-1].name)
    pads = sorted(str(r.block.name_hint) for r in _realizes(nest.func) if str(r.block.name_hint).endswith("_pad")
                  and str(r.block.writes[0].source.name) != out)
    assert pads == {"scores": ["p1_pad"], "values": [], "head_weight": ["B_pad"], "static_rows": ["B_pad"]}[name]
    # B's copy is computed under the column tile loop: lowered, its buffer is a static K x nr panel
    lowered = C.lower_tir(C.IRModule({"main": nest.func.with_attr("global_symbol", "main")}), tgt)
    allocs = []
    C.post_order_visit(lowered["main"].body, lambda n: allocs.append(n.buffer)
                       if isinstance(n, C.tirx.AllocBuffer) else None)
    for pad in pads:
        sizes = [b.shape for b in allocs if pad in str(b.name)]
        assert sizes and all(isinstance(e, C.IntImm) for ext in sizes for e in ext), (pad, sizes)
    # the joined kernel: both nests under a branch on the multiply-adds
    res = schedule_prim_func(func, tgt, {}, kname)
    assert [b["bucket"] for b in res.config["buckets"]] == [f"macs<={TINY}", f"macs<={bound}", f"macs>{bound}"]
    # the few-MACs and open nests' updates, and the unit nest's (every shape variable 1) where that size
    # falls in the few-MACs bucket (head_weight: 1536 multiply-adds at 1; scores / values: 64, tiny)
    n_updates = {"scores": 2, "values": 2, "head_weight": 3, "static_rows": 3}[name]
    assert len([r for r in _realizes(res.func) if str(r.block.name_hint).endswith("_update")]) == n_updates
    C.lower_tir(C.IRModule({"main": res.func.with_attr("global_symbol", "main")}), tgt)


@pytest.mark.parametrize("target", ["haswell-2", "skx-32", "neon-4", "haswell-1"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_tiny_bucket_is_a_scalar_dot_product(name, target):
    """The first bucket (up to the table's ``tiny_macs`` multiply-adds, also on a 1-core target, which has no
    few-MACs bucket): no padded copy of either operand, no parallel or vector loop, the matmul computed per
    output element inside the epilogue's loops so its accumulator lowers to a one-element stack buffer (no
    run-time workspace allocation), and the reduction's k loop innermost."""
    tgt = parse_target(NAMED_TARGETS[target] if target != "haswell-1"
                       else {**NAMED_TARGETS["haswell-2"], "num-cores": 1})
    (kname, func), = _kernels(MODELS[name](), tgt).items()
    t = SymbolicBatchMatmul()
    match = t.match(func, tgt)
    names = [b.name for b in t.buckets(match, tgt)]
    assert names[0] == f"macs<={TINY}" and names[-1].startswith("macs>")
    assert len(names) == (2 if target == "haswell-1" else 3)
    nest = _bucket_nest(func, tgt, "tiny")
    assert nest.config["parallel"] is False and nest.config["mr"] == 1
    blocks = [str(r.block.name_hint) for r in _realizes(nest.func)]
    assert not any(b.endswith("_pad") for b in blocks), blocks
    loops = _loops(nest.func)
    assert all(int(lp.kind) in (int(C.ForKind.SERIAL), int(C.ForKind.UNROLLED)) for lp in loops)
    lowered = C.lower_tir(C.IRModule({"main": nest.func.with_attr("global_symbol", "main")}), tgt)
    allocs = []
    C.post_order_visit(lowered["main"].body, lambda n: allocs.append(n.buffer)
                       if isinstance(n, C.tirx.AllocBuffer) else None)
    assert all(isinstance(e, C.IntImm) for b in allocs for e in b.shape), [b.shape for b in allocs]
    # the joined kernel dispatches to it first and lowers
    res = schedule_prim_func(func, tgt, {}, kname)
    assert [b["bucket"] for b in res.config["buckets"]] == names
    C.lower_tir(C.IRModule({"main": res.func.with_attr("global_symbol", "main")}), tgt)


def test_tiny_bucket_sizes_and_bounds():
    """The tuner measures each bucket at sizes inside it: the tiny one at every variable 1, the next ones at
    the smallest last-variable size past the bucket below (scores: 4 x 16 x S^2 multiply-adds at batch 1)."""
    tgt = parse_target(NAMED_TARGETS["haswell-2"])
    (kname, func), = _kernels(_scores(), tgt).items()
    t = SymbolicBatchMatmul()
    match = t.match(func, tgt)
    tiny, few, open_ = t.buckets(match, tgt)
    assert t.bucket_sizes(match, tiny, tgt) == {"batch": 1, "sequence": 1}
    bound = few.max_extent
    seq_few = t.bucket_sizes(match, few, tgt)["sequence"]
    seq_open = t.bucket_sizes(match, open_, tgt)["sequence"]
    assert 64 * (seq_few - 1) ** 2 <= TINY < 64 * seq_few ** 2 <= bound
    assert 64 * (seq_open - 1) ** 2 <= bound < 64 * seq_open ** 2
