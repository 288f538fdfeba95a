"""The row-tiled nests of the symbolic matmul families (``cpu.symbolic_matmul``, ``cpu.symbolic_siblings``)
at run time (branch symmm11): one launch of the thread pool per call, whole register tiles without the
"row exists" predicate.  Structural tests lower the open bucket's nest with TVM's own TIR pipeline for named
targets; the numbers are checked against the ONNX reference at M = 1, 17 and 128."""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.pipeline import PipelineOptions, graph_stage
from tvmfuse.schedules.cpu.symbolic_matmul import SymbolicMatmulEpilogue
from tvmfuse.schedules.cpu.symbolic_siblings import SymbolicSiblings
from tvmfuse.target import parse_target

from conftest import NAMED_TARGETS
from lowered_bounds import lowered, out_of_bounds

TARGETS = {**NAMED_TARGETS, "znver5-2": {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver5",
                                         "num-cores": 2}}


def _proj(n=64, k=64):
    """y = x @ W + b over x [batch, sequence, k] (gpt2's attention output projection)."""
    g = M._G("proj_rows")
    x = g.input("x", ("batch", "sequence", k))
    g.op("Add", g.op("MatMul", x, g.weight((k, n))), g.weight((n,), 0.1))
    g.rename_last("y", ("batch", "sequence", n))
    return g.model()


def _qkv():
    """Three sibling projections of one input (Q, K, V: cpu.symbolic_siblings)."""
    g = M._G("qkv_rows")
    x = g.input("x", ("batch", "sequence", 64))
    for name in ("y0", "y1", "y2"):
        g.op("Add", g.op("MatMul", x, g.weight((64, 64))), g.weight((64,), 0.1))
        g.rename_last(name, ("batch", "sequence", 64))
    return g.model()


def _kernels(model, target):
    mod = tvmfuse.load_onnx(model)
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions()))(mod)
    return {str(gv.name_hint): f for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)}


def _open_nest(template, func, target):
    """The open (many-rows) bucket's nest of ``func`` scheduled with its default config, and the config."""
    match = template.match(func, target)
    assert match is not None
    bucket = template.buckets(match, target)[-1]
    assert bucket.max_extent is None
    bm = template.bucket_match(match, bucket)
    sch = C.Schedule(func)
    config = template.default_config(bm, target)
    template.apply(sch, bm, config)
    return sch.mod["main"], config


def _parallel_loops(stmt) -> list:
    found = []
    C.post_order_visit(stmt, lambda n: found.append(n) if isinstance(n, C.tirx.For)
                       and n.kind == C.ForKind.PARALLEL else None)
    return found


def _guarded_k_loops(stmt) -> tuple[int, int]:
    """(k loops without any ``if`` inside, k loops with one) of a lowered kernel: its innermost serial loops
    that hold a broadcast (A's element, times a vector of B), the register tiles' reduction loops."""
    plain = guarded = 0

    def visit(node):
        nonlocal plain, guarded
        if not (isinstance(node, C.tirx.For) and node.kind == C.ForKind.SERIAL):
            return
        kinds = set()
        C.post_order_visit(node.body, lambda n: kinds.add(type(n).__name__)
                           if isinstance(n, (C.tirx.IfThenElse, C.tirx.For, C.tirx.Broadcast)) else None)
        if "For" in kinds or "Broadcast" not in kinds:
            return
        if "IfThenElse" in kinds:
            guarded += 1
        else:
            plain += 1

    C.post_order_visit(stmt, visit)
    return plain, guarded


@pytest.mark.parametrize("target", ["haswell-2", "skx-2", "znver5-2", "neon-4"])
@pytest.mark.parametrize("family, build", [("matmul", _proj), ("siblings", _qkv)])
def test_row_tiled_nest_launches_the_thread_pool_once(family, build, target):
    """The loop-partition hint stays off the parallel row loop: TVM's LoopPartition would split it into two
    parallel loops (whole macro tiles, then the last one), two launches of the thread pool per call.  The
    whole register tiles inside each macro tile still lose the row predicate (a k loop without an ``if``)."""
    tgt = parse_target(TARGETS[target])
    template = SymbolicMatmulEpilogue() if family == "matmul" else SymbolicSiblings()
    (kname, func), = _kernels(build(), tgt).items()
    nest, config = _open_nest(template, func, tgt)
    low = lowered(nest, tgt)
    # a macro tile of one register tile (NEON's siblings) has no row loop inside the parallel one: that one
    # is split then (whole tiles, then the last), the one case of two launches
    assert len(_parallel_loops(low.body)) == (1 if config["mc_tiles"] > 1 else 2), str(low)
    plain, guarded = _guarded_k_loops(low.body)
    if config.get("pad_m"):
        # rows padded to the register tile (matmul.pads_symbolic_rows): no k loop keeps a row predicate
        assert plain >= 1 and guarded == 0, (plain, guarded)
    else:
        assert plain >= 1 and guarded >= 1, (plain, guarded)
    # the partitioned tiles stay inside the buffers at row counts around the tiles
    sizes = [{"batch": b, "sequence": s} for b, s in ((1, 1), (1, 2), (1, 5), (1, 17), (3, 17), (1, 128), (2, 67))]
    assert out_of_bounds(nest, tgt, sizes) == []


@pytest.mark.parametrize("build, outputs", [(_proj, ["y"]), (_qkv, ["y0", "y1", "y2"])])
def test_row_tiled_nests_match_the_reference_at_1_17_128_rows(build, outputs, host, rng):
    model = build()
    cm = tvmfuse.compile(model, target=host)
    assert {s["template"] for s in cm.report.schedules} <= {SymbolicMatmulEpilogue.family,
                                                             SymbolicSiblings.family}
    for b, s in ((1, 1), (1, 17), (1, 128), (3, 17)):
        feeds = {"x": rng.standard_normal((b, s, 64)).astype(np.float32)}
        ref = M.reference_outputs(model, feeds)
        got = cm.run(feeds)
        for name in outputs:
            np.testing.assert_allclose(got[name], ref[name], rtol=1e-4, atol=1e-4, err_msg=f"{name} {b}x{s}")


@pytest.mark.parametrize("target", ["skx-2", "znver5-2"])
def test_padded_sibling_columns_keep_the_parallel_loop_split(target):
    """SwiGLU's gate/up with N = 172 (llama: columns zero-padded to the register tile): the hint stays on the
    parallel loop too (as before this branch); with it inside the macro tiles only, the
    kernel ran 8.2 -> 10.1 us per call at 17 rows, one thread, under load (benchmarks/notes/symmm11.md)."""
    tgt = parse_target(TARGETS[target])
    (kname, func), = _kernels(M.swiglu(seq="rows", hidden=64, ffn=172), tgt).items()
    template = SymbolicSiblings()
    nest, config = _open_nest(template, func, tgt)
    assert config["pad_n"] and 172 % (config["nvec"] * config["lanes"])
    assert _hinted_parallel_loops(nest.body)
    assert out_of_bounds(nest, tgt, [{"rows": n} for n in (17, 18, 64, 67)]) == []
    # and the unpadded Q/K/V siblings' parallel loop is not hinted
    (kname, func), = _kernels(_qkv(), tgt).items()
    nest, config = _open_nest(template, func, tgt)
    assert config["mc_tiles"] > 1 and not _hinted_parallel_loops(nest.body)


def _hinted_parallel_loops(stmt) -> list:
    found = []
    C.post_order_visit(stmt, lambda n: found.append(n) if isinstance(n, C.tirx.For) and n.kind == C.ForKind.PARALLEL
                       and "pragma_loop_partition_hint" in n.annotations else None)
    return found


def test_padded_swiglu_matches_the_reference(host, rng):
    model = M.swiglu(seq="rows", hidden=64, ffn=172)
    cm = tvmfuse.compile(model, target=host)
    for n in (1, 17, 128):
        feeds = {"x": rng.standard_normal((n, 64)).astype(np.float32)}
        np.testing.assert_allclose(cm.run(feeds)["y"], M.reference_outputs(model, feeds)["y"], rtol=1e-4,
                                   atol=1e-4, err_msg=f"rows={n}")


@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
def test_column_predicate_with_row_tiles_builds(target):
    """A column macro tile that N does not divide (N = 192 in register tiles of 16 columns (AVX2: 2 x 8
    lanes) in macro tiles of 8, or of 32 (AVX-512: 2 x 16) in macro tiles of 4) puts a column predicate
    beside the rows'; the loop-partition hint stays off the column loops (matmul._column_loop_vars), since
    TVM 0.27's LoopPartition writes an int32 start into an int64 loop there and the TIR pipeline then fails
    ("LT: mismatched types int32 vs int64", gpt2_dyn with a 4 x 2 tile on znver3).  The nest builds, keeps
    the hint on its row loops, and stays in bounds."""
    tgt = parse_target(TARGETS[target])
    template = SymbolicMatmulEpilogue()
    (_, func), = _kernels(_proj(n=192, k=64), tgt).items()
    match = template.match(func, tgt)
    bm = template.bucket_match(match, template.buckets(match, tgt)[-1])
    config = {**template.default_config(bm, tgt), "mr": 4, "nvec": 2,
              "nc_tiles": 8 if target == "haswell-2" else 4}
    space = {kb.name: kb.choices for kb in template.space(bm, tgt).knobs}
    assert all(config[k] in space[k] for k in ("mr", "nvec", "nc_tiles")), "a point of the tuning space"
    sch = C.Schedule(func)
    template.apply(sch, bm, config)
    nest = sch.mod["main"]
    hinted = []
    C.post_order_visit(nest.body, lambda n: hinted.append(str(n.loop_var.name)) if isinstance(n, C.tirx.For)
                       and "pragma_loop_partition_hint" in n.annotations else None)
    assert hinted, "the row loops keep the hint"
    C.build_prim_module(C.IRModule({"main": nest.with_attr("global_symbol", "main")}), tgt)
    assert out_of_bounds(nest, tgt, [{"batch": b, "sequence": s} for b, s in ((1, 1), (1, 17), (3, 17), (2, 67))]) == []
