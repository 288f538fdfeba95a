"""Static ``cpu.norm_matmul`` defaults at the token models' sizes (issue 13: static builds slower than the
symbolic ones): llama's RMSNorm + SwiGLU gate/up over batch x sequence rows with N = 172 columns (no vector
width divides it).  The defaults must leave no row predicate on the register tiles (a predicated row keeps
LLVM's accumulators in memory), copy the zero-padded weights once per call where they fit the L2 share, and
run the SwiGLU epilogue on whole target-width vectors (the padded columns computed, a crop to the real
ones).  Structure on named targets; numbers against the unscheduled kernel on fresh random inputs.

Also: a static export's causal mask (a constant bool table sliced and turned into 0/-inf by ``where``)
reaches the attention kernel as its causal flag, not as an additive mask input."""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.passes.attention import _causal_offset, _folded_mask, _Function
from tvmfuse.pipeline import PipelineOptions, graph_stage
from tvmfuse.schedules.cpu.prologue import NormMatmul

import schedule_cases as S
from conftest import named_target
from schedule_cases import compacted as _lowered

# llama's gate/up at batch 8 x sequence 17 (136 rows: 17 per batch, a prime) and at 1 x 128; a
# LayerNorm Q/K/V case whose N divides the vector width (nothing padded)
SWIGLU_8x17 = dict(norm="rmsnorm", rows=17, d=64, n=172, batch=8, bias=False, swiglu=True)
SWIGLU_1x128 = dict(norm="rmsnorm", rows=128, d=64, n=172, batch=1, bias=False, swiglu=True)
QKV_3x17 = dict(norm="layernorm", rows=17, d=64, n=64, batch=3, heads=3)
TARGETS = ["haswell-2", "skx-2", "skx-32"]


def _func(kwargs, target):
    (name, func), = S.graph_funcs(M.norm_matmul(**kwargs), target).items()
    match = NormMatmul().match(func, target)
    assert match is not None, name
    return func, match


def _scheduled(func, match, config):
    sch = C.Schedule(func)
    NormMatmul().apply(sch, match, config)
    return sch.mod["main"]


def _block_predicates(func) -> dict:
    """Block name -> its predicate (text), for blocks with one."""
    out = {}

    def visit(n):
        if isinstance(n, C.SBlockRealize) and not (isinstance(n.predicate, C.IntImm) and int(n.predicate)):
            out[str(n.block.name_hint)] = str(n.predicate)

    C.post_order_visit(func.body, visit)
    return out


@pytest.mark.parametrize("tname", TARGETS)
@pytest.mark.parametrize("kwargs", [SWIGLU_8x17, SWIGLU_1x128], ids=["8x17", "1x128"])
def test_swiglu_defaults_whole_row_tiles_padded_once(kwargs, tname):
    """Batch rows flattened; row blocks of whole register tiles; padded weights copied once; no matmul
    block under a row predicate; the SwiGLU epilogue at the target's full width."""
    target = named_target(tname)
    func, match = _func(kwargs, target)
    cfg = NormMatmul().default_config(match, target)
    lanes = 16 if tname.startswith("skx") else 8
    rows = kwargs["rows"] * kwargs["batch"]
    assert cfg["flatten_batch"] and match.info["rows"] == rows
    assert cfg["lanes"] == lanes and rows % (cfg["mr"] * cfg["mc_tiles"]) == 0, cfg
    assert cfg["pad_n"] and cfg["pad_once"], cfg               # 2 x 64 x 176..192 floats: well under L2
    sched = _scheduled(func, match, cfg)
    preds = _block_predicates(sched)
    matmul_preds = {b: p for b, p in preds.items() if b.startswith("matmul")}
    assert not matmul_preds, matmul_preds                     # register tiles: no row or column predicate
    names = [str(n.name_hint) for n in S.nodes(sched) if isinstance(n, C.SBlock)]
    assert any(n.startswith("T_multiply") and "pad" in n for n in names), names   # the crop to 172 columns
    # the padded B copies are not under the parallel row-block loop (once per call)
    par = [f for f in S.loops(sched) if f.kind == C.ForKind.PARALLEL]
    assert len(par) == 1, [str(f.loop_var) for f in par]
    inside = []
    C.post_order_visit(par[0].body, lambda n: inside.append(str(n.name_hint)) if isinstance(n, C.SBlock) else None)
    assert not any(n.startswith("p") and "_pad" in n and "T_" not in n for n in inside), inside
    # the epilogue's vectors are the target's width; nothing left to TVM's scalarizing vectorizer but the
    # padded copy's last vector
    assert lanes in S.vector_lanes(sched)
    assert all("pad" in v or v.startswith("ax1") for v in S.scalarized_loops(sched)), S.scalarized_loops(sched)


@pytest.mark.parametrize("tname", ["haswell-2", "skx-2"])
def test_nothing_padded_keeps_pad_once_off(tname):
    """Columns a multiple of the register tile: pad_once is not a choice (the kernel would not change)."""
    target = named_target(tname)
    func, match = _func(QKV_3x17, target)
    tmpl = NormMatmul()
    cfg = tmpl.default_config(match, target)
    assert not cfg["pad_once"] and cfg["flatten_batch"], cfg
    space = tmpl.space(match, target)
    assert not space.contains({**cfg, "pad_once": True})
    assert space.excluded({**cfg, "pad_once": True}) == "pad_once without padded columns"


@pytest.mark.parametrize("kwargs", [SWIGLU_8x17, SWIGLU_1x128, QKV_3x17], ids=["8x17", "1x128", "qkv3x17"])
def test_static_defaults_compute_the_unscheduled_kernel(kwargs, host, rng):
    """The default, its unflattened and per-panel-padded variants and the unscheduled PrimFunc agree on
    fresh random inputs."""
    func, match = _func(kwargs, host)
    tmpl = NormMatmul()
    default = tmpl.default_config(match, host)
    n_out = len(match.info["chains"])
    args = S.random_args(func, rng, n_out)
    want = S.run_func(func, host, args, n_out)
    space = tmpl.space(match, host)
    variants = [default, {**default, "flatten_batch": False}, {**default, "pad_once": False}]
    for cfg in [v for v in variants if space.contains(v)]:
        got = S.run_func(_scheduled(func, match, cfg), host, args, n_out)
        for g, w in zip(got, want):
            # float32 sums in another order: an element's error scales with the kernel's magnitudes, not its
            # own (SwiGLU: silu(gate) near 0 times an up of ~50), so atol is relative to the largest output
            # (seed 108187497 at 1x128: one element 3.9e-5 off at 0.168, the largest diff 3e-7 of max |w|)
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=max(1e-5, 1e-6 * float(np.abs(w).max())),
                                       err_msg=str(cfg))


# ------------------------------------------------------------------------------ causal mask, static export
def _mask_function(table, sq):
    """A Relax function: scores + where(strided_slice(table, axis 3, [0, sq)), 0, -inf)."""
    bb = C.BlockBuilder()
    b = table.shape[0]
    x = C.relax.Var("x", C.relax.TensorType((b, 1, sq, sq), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            cond = bb.emit(C.relax.op.strided_slice(C.relax.const(table), axes=[3], begin=[0], end=[sq]))
            mask = bb.emit(C.relax.op.where(cond, C.relax.const(np.float32(0.0)),
                                            C.relax.const(np.float32(-np.inf))))
            out = bb.emit_output(C.relax.op.add(x, mask))
        bb.emit_func_output(out)
    return bb.get()["main"], mask


@pytest.mark.parametrize("sq", [17, 5])
def test_static_causal_mask_table_is_the_causal_flag(sq):
    """llama's static export: a [batch, 1, S, S_max] bool table, sliced to S keys, made 0/-inf: causal
    offset 0; a table whose batch slices differ, or that is not causal, stays an additive mask."""
    smax = 32
    causal = np.tril(np.ones((smax, smax), bool))[None, None, :sq, :]
    table = np.broadcast_to(causal, (4, 1, sq, smax)).copy()
    func, mask = _mask_function(table, sq)
    fn = _Function(func)
    assert _causal_offset(_folded_mask(fn, mask), sq, sq) == 0
    other = table.copy()
    other[1, 0, 0, 1] = True                      # one batch's row 0 sees key 1
    func, mask = _mask_function(other, sq)
    assert _causal_offset(_folded_mask(_Function(func), mask), sq, sq) is None
    upper = np.broadcast_to(np.triu(np.ones((smax, smax), bool))[None, None, :sq, :], (4, 1, sq, smax)).copy()
    func, mask = _mask_function(upper, sq)
    assert _causal_offset(_folded_mask(_Function(func), mask), sq, sq) is None


def test_static_llama_attention_takes_the_causal_flag():
    """The corpus llama pinned to 8 x 17: its attention kernels have the causal flag and no mask input."""
    import importlib.util
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("corpus_io", os.path.join(root, "corpus", "corpus_io.py"))
    corpus_io = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(corpus_io)
    entry = {e["name"]: e for e in corpus_io.load_manifest()["models"]}["llama"]
    target = named_target("skx-2")
    mod = tvmfuse.load_onnx(corpus_io.model_path(entry, "dynamic"), input_shapes={"batch": 8, "sequence": 17})
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions()))(mod)
    funcs = {str(gv.name_hint): f for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)}
    att = {n: f for n, f in funcs.items() if "attention" in n}
    assert att, list(funcs)
    for name, f in att.items():
        spec_text = str(f.attrs["tvmfuse.attention"])
        assert '"causal_offset": 0' in spec_text and '"mask": null' in spec_text, (name, spec_text[:300])
        assert len(f.params) == 4, [list(p.shape) for p in f.params]


# ------------------------------------------------------------------------------ whole-row register tiles
@pytest.mark.parametrize("tname", TARGETS)
@pytest.mark.parametrize("rows", [17, 51, 136])
def test_static_matmul_tiles_divide_the_rows(rows, tname):
    """cpu.matmul_epilogue at GPT-2's sizes (1/3/8 x 17 rows, 64 -> 256): the default register tile divides
    the rows, or (session 10, ``pad_m``) the rows are zero-padded to it (17: a 6-row tile over 18 rows; before,
    a one-row tile: a 6-row tile's predicate kept every tile's accumulators in memory): no matmul block's
    predicate reads a loop of the register tile (unrolled rows and vectors); a macro tile past the rows
    leaves a predicate the same for all of a tile's multiply-adds (one-row tiles at 17 rows: 8.9 us with it,
    8.8 without, kernel-only under load; padded 6-row tiles 2.3-3.3x faster, benchmarks/notes/corpus10.md)."""
    from tvmfuse.schedules.cpu.matmul import MatmulEpilogue
    target = named_target(tname)
    (name, func), = S.graph_funcs(S.matmul_3d(b=1, s=rows, k=64, n=256), target).items()
    tmpl = MatmulEpilogue()
    match = tmpl.match(func, target)
    assert match is not None, name
    cfg = tmpl.default_config(match, target)
    assert rows % cfg["mr"] == 0 or cfg["pad_m"], cfg
    sch = C.Schedule(func)
    tmpl.apply(sch, match, cfg)
    func = sch.mod["main"]
    tile_vars = [f.loop_var for f in S.loops(func) if f.kind in (C.ForKind.UNROLLED, C.ForKind.VECTORIZED)]
    used = []

    def visit(n):
        if isinstance(n, C.SBlockRealize) and str(n.block.name_hint).startswith("matmul"):
            C.post_order_visit(n.predicate, lambda v: used.append(str(n.block.name_hint)) if isinstance(
                v, C.tirx.Var) and any(v.same_as(t) for t in tile_vars) else None)

    C.post_order_visit(func.body, visit)
    assert not used, (cfg, _block_predicates(func))
    if rows == 17:        # prime: only a one-row tile divides them; a taller one comes with padded rows
        assert cfg["mr"] > 1 and cfg["pad_m"], cfg
    if rows % cfg["mr"] == 0:
        assert not cfg["pad_m"], cfg


@pytest.mark.parametrize("rows", [17, 51])
def test_static_matmul_whole_row_default_computes_the_unscheduled(rows, host, rng):
    from tvmfuse.schedules.cpu.matmul import MatmulEpilogue
    (name, func), = S.graph_funcs(S.matmul_3d(b=1, s=rows, k=64, n=256), host).items()
    tmpl = MatmulEpilogue()
    match = tmpl.match(func, host)
    args = S.random_args(func, rng)
    want = S.run_func(func, host, args)
    sch = C.Schedule(func)
    tmpl.apply(sch, match, tmpl.default_config(match, host))
    got = S.run_func(sch.mod["main"], host, args)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
