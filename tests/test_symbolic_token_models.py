"""Token models over a symbolic batch x sequence (issue 13): the kernels a static build gets, at its speed.

- ``cpu.symbolic_matmul`` / ``cpu.symbolic_siblings``' row-tiled nest keeps its register-tile accumulators
  a stack array of static size (TVM serves 1 KiB or more from its workspace allocator, and inside a
  compiled model LLVM then stores every partial sum: BERT's FFN and Q/K/V kernels ran at 2-3x static),
  and its macro tile of rows is the table's ``row_mc_tiles`` (the last macro tile is the predicated one);
- GPT-2's attention output, reshaped to ``[batch * sequence, hidden]`` before its Gemm, still forms the
  attention kernel (the kernel stops before the merge of two symbols) and the reshape is a view, not a
  copy kernel (a transposed flatten keeps its kernel);
- a causal mask computed per call from ``Range(0, sequence)`` is the attention kernel's causal flag, as
  the static build's constant mask is (an anti-causal or finitely filled mask stays a mask);
- the token models of the symbolic corpus have the static build's kernel count, or more by a kernel the
  static build folds to a constant (T5's position bias; slow).

Structural tests on named targets, numbers against onnxruntime / numpy on the host.
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
from onnx import numpy_helper

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu import matmul as MM
from tvmfuse.schedules.cpu.symbolic_matmul import SymbolicMatmulEpilogue
from tvmfuse.schedules.cpu.symbolic_siblings import SymbolicSiblings
from tvmfuse.target import cpu_info, parse_target

import schedule_cases as S
from conftest import NAMED_TARGETS, compile_shared

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTOL, ATOL = 1e-4, 1e-5
# the sizes: batch 1, 3, 8 at sequence 17; sequence 1, 17, 128 at batch 1
SIZES = [(1, 17), (3, 17), (8, 17), (1, 1), (1, 128)]


def _ffn(hidden=64, ffn=256):
    """x [batch, sequence, hidden] -> GELU(x @ W1 + b1) @ W2 + b2 + x (BERT's FFN, two matmul kernels)."""
    g = M._G("ffn_sym")
    x = g.input("x", ("batch", "sequence", hidden))
    h = g.op("Add", g.op("MatMul", x, g.weight((hidden, ffn))), g.weight((ffn,), 0.1))
    h = g.op("Relu", h)
    y = g.op("Add", g.op("Add", g.op("MatMul", h, g.weight((ffn, hidden))), g.weight((hidden,), 0.1)), x)
    g.rename_last("y", ("batch", "sequence", hidden))
    return g.model()


def _qkv(hidden=64):
    g = M._G("qkv_sym")
    x = g.input("x", ("batch", "sequence", hidden))
    for name in ("q", "k", "v"):
        g.op("MatMul", x, g.weight((hidden, hidden)))
        g.rename_last(name, ("batch", "sequence", hidden))
    return g.model()


def _accumulators(func) -> list:
    """The buffers a scheduled kernel allocates, after TVM's allocation planning and compaction."""
    mod = C.Sequential([C.s_tir.transform.LowerInitBlock(),
                        C.s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
                        C.s_tir.transform.ConvertBlocksToOpaque(),
                        C.s_tir.transform.CompactBufferAllocation()])(C.IRModule({"main": func}))
    allocs = []
    C.post_order_visit(mod["main"].body, lambda n: allocs.extend(n.alloc_buffers)
                       if isinstance(n, C.SBlock) else None)
    return allocs


@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
@pytest.mark.parametrize("build, family", [(_ffn, SymbolicMatmulEpilogue.family), (_qkv, SymbolicSiblings.family)],
                         ids=["ffn", "qkv"])
def test_row_tiled_accumulators_are_static_stack_arrays(build, family, target):
    tgt = parse_target(NAMED_TARGETS[target])
    lanes = cpu_info(tgt).float32_lanes
    funcs = S.graph_funcs(build(), tgt)
    matmuls = {n: f for n, f in funcs.items() if "matmul" in n}
    assert matmuls, funcs.keys()
    for name, func in matmuls.items():
        res = schedule_prim_func(func, tgt, {}, name)
        assert res is not None and res.template == family, (name, res and res.template)
        big = res.config["buckets"][-1]
        assert big["bucket"].startswith("rows>"), res.config
        cfg = big["config"]
        # the open (row-tiled) bucket: the table's macro tile of rows, an accumulator under 1 KiB
        template = SymbolicMatmulEpilogue() if family == SymbolicMatmulEpilogue.family else SymbolicSiblings()
        row_mc = int(template.table_defaults(tgt)["row_mc_tiles"])
        assert cfg["mc_tiles"] == row_mc and cfg["mr"] > 1, cfg
        assert cfg["mr"] * cfg["nvec"] <= MM.stack_accumulator_vectors(lanes), cfg
        allocs = _accumulators(res.func)
        assert allocs, "expected register-tile accumulators"
        padded_a = [b for b in allocs if str(b.name).endswith("_global_pad")] if cfg.get("pad_m") else []
        for buf in allocs:
            shape = [d for d in buf.shape]
            assert all(isinstance(d, C.IntImm) for d in shape), (name, buf.name, shape)   # no rows x N buffer
            if buf in padded_a:
                # A's rows padded to the register tile (matmul.pads_symbolic_rows): one tile, mr x K
                assert len(shape) == 2 and int(shape[0]) == cfg["mr"], (name, buf.name, shape)
                continue
            assert int(np.prod([int(d) for d in shape])) * 4 < C.MAX_STACK_ALLOCA_BYTES, (name, buf.name, shape)
        assert len(padded_a) == (1 if cfg.get("pad_m") else 0), (name, [b.name for b in allocs])


def test_one_register_tile_per_macro_tile_loses_the_compaction():
    """Why ``row_mc_tiles`` is 2: with one register tile of rows per macro tile, TVM's compaction keeps the
    accumulator rows x N (a workspace allocation per kernel call: the slow kernel)."""
    tgt = parse_target(NAMED_TARGETS["skx-2"])
    t = SymbolicMatmulEpilogue()
    funcs = S.graph_funcs(_ffn(), tgt)
    func = next(f for n, f in funcs.items() if "matmul" in n)
    match = t.match(func, tgt)
    big = t.bucket_match(match, t.buckets(match, tgt)[-1])
    cfg = t.default_config(big, tgt)
    # the unpadded nest (pad_m False: the last register tile predicated per row); with the rows padded to the
    # tile (the default since padrows12) the padded accumulator is compacted to the tile at any macro tile
    for mc, pad_m, static in ((1, False, False), (cfg["mc_tiles"], False, True), (1, True, True),
                              (cfg["mc_tiles"], True, True)):
        sch = C.Schedule(func)
        t.apply(sch, big, {**cfg, "mc_tiles": mc, "pad_m": pad_m})
        shapes = [list(b.shape) for b in _accumulators(sch.mod["main"])]
        assert all(isinstance(d, C.IntImm) for s in shapes for d in s) == static, (mc, pad_m, shapes)


@pytest.mark.parametrize("build", [_ffn, _qkv], ids=["ffn", "qkv"])
def test_symbolic_rows_match_onnxruntime_at_every_size(build, host, rng):
    """Row counts on every bucket and tail: 1 (serial GEMV), 17 (row tiles + a partial one), 24, 51, 128."""
    ort = pytest.importorskip("onnxruntime")
    model = build()
    cm = tvmfuse.compile(model, host)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for b, s in SIZES + [(3, 8)]:
        feeds = {"x": rng.standard_normal((b, s, 64)).astype(np.float32)}
        want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        got = cm.run(feeds)
        for name, ref in want.items():
            np.testing.assert_allclose(got[name], ref, rtol=RTOL, atol=ATOL, err_msg=f"{name} at {b}x{s}")


def _gpt2_attention(heads=2, d=16):
    """GPT-2's attention tail: softmax(Q K^T * s) V per head, heads merged, rows flattened to
    [batch * sequence, hidden] for the output Gemm (the symbolic export's Reshape(-1, hidden))."""
    hidden = heads * d
    g = M._G("gpt2_attn_sym")
    q = g.input("q", ("batch", heads, "sequence", d))
    k = g.input("k", ("batch", heads, "sequence", d))
    v = g.input("v", ("batch", heads, "sequence", d))
    kt = g.op("Transpose", k, perm=[0, 1, 3, 2])
    p = g.op("Softmax", g.op("Mul", g.op("MatMul", q, kt), g.const(np.float32(1 / np.sqrt(d)))), axis=-1)
    o = g.op("Transpose", g.op("MatMul", p, v), perm=[0, 2, 1, 3])
    flat = g.op("Reshape", o, g.const(np.array([-1, hidden], np.int64)))
    g.op("MatMul", flat, g.weight((hidden, hidden)))
    g.rename_last("y", ("rows", hidden))
    return g.model()


def test_attention_forms_when_its_output_is_flattened_over_symbols(host, rng):
    ort = pytest.importorskip("onnxruntime")
    model = _gpt2_attention()
    cm = tvmfuse.compile(model, host)
    assert [s["template"] for s in cm.report.schedules].count("cpu.attention") == 1, cm.report.refused
    assert not any("not a plain symbol" in str(r) for r in cm.report.refused), cm.report.refused
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for b, s in SIZES:
        feeds = {n: rng.standard_normal((b, 2, s, 16)).astype(np.float32) for n in ("q", "k", "v")}
        want = sess.run(None, feeds)[0]
        np.testing.assert_allclose(cm.run(feeds)["y"], want, rtol=RTOL, atol=ATOL, err_msg=f"{b}x{s}")


@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
def test_reshape_kernel_becomes_a_view(target):
    """The flattening reshape left between the attention kernel and its Gemm is a view (R.reshape), not a
    copy kernel: attention + matmul, as the static build (whose attention kernel writes the flat rows)."""
    kernels, mod = _graph(_gpt2_attention(), target)
    assert len(kernels) == 2 and not any("reshape" in n for n in kernels), kernels
    assert "R.reshape(" in str(mod["main"])


def _transposed_flatten():
    """[batch, sequence, 4, 16] -> transpose(0, 2, 1, 3) -> [batch * 4 * sequence, 16] @ W: the flatten of a
    transposed tensor is a copy (not TVM's reshape pattern), so its kernel stays."""
    g = M._G("transposed_flatten")
    x = g.input("x", ("batch", "sequence", 4, 16))
    t = g.op("Transpose", x, perm=[0, 2, 1, 3])
    g.op("MatMul", g.op("Reshape", t, g.const(np.array([-1, 16], np.int64))), g.weight((16, 8)))
    g.rename_last("y", ("rows", 8))
    return g.model()


def test_transposed_flatten_keeps_its_copy_kernel(host, rng):
    kernels, mod = _graph(_transposed_flatten(), "skx-2")
    assert len(kernels) == 2 and "R.reshape(" not in str(mod["main"]), kernels
    model = _transposed_flatten()
    run = tvmfuse.compile(model, host)
    w = next(numpy_helper.to_array(i) for i in model.graph.initializer if i.dims[:] == [16, 8])
    for b, s in ((1, 1), (2, 17)):
        x = rng.standard_normal((b, s, 4, 16)).astype(np.float32)
        want = x.transpose(0, 2, 1, 3).reshape(-1, 16) @ w
        np.testing.assert_allclose(run.run({"x": x})["y"], want, rtol=RTOL, atol=ATOL)


def _computed_mask_attention(compare="LessOrEqual", masked=-np.inf, heads=2, d=16):
    """softmax(Q K^T / sqrt(d) + where(compare(j, i), 0, masked)) V with i, j from Range(0, sequence): the
    causal mask a symbolic export computes per call (a static export folds it into a constant)."""
    g = M._G(f"computed_mask_{compare}")
    q = g.input("q", ("batch", heads, "sequence", d))
    k = g.input("k", ("batch", heads, "sequence", d))
    v = g.input("v", ("batch", heads, "sequence", d))
    seq = g.op("Gather", g.op("Shape", q), g.const(np.int64(2)), axis=0)
    r = g.op("Range", g.const(np.int64(0)), seq, g.const(np.int64(1)))
    j = g.op("Unsqueeze", r, g.const(np.array([0], np.int64)))       # [1, sequence]: the key position
    i = g.op("Unsqueeze", r, g.const(np.array([1], np.int64)))       # [sequence, 1]: the query position
    mask = g.op("Where", g.op(compare, j, i), g.const(np.float32(0.0)), g.const(np.float32(masked)))
    scores = g.op("Mul", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])), g.const(np.float32(d ** -0.5)))
    p = g.op("Softmax", g.op("Add", scores, mask), axis=-1)
    g.op("MatMul", p, v)
    g.rename_last("y", ("batch", heads, "sequence", d))
    return g.model()


def _mask_reference(feeds, allowed):
    q, k, v = feeds["q"], feeds["k"], feeds["v"]
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    s = np.where(allowed(np.arange(s.shape[-1])[None], np.arange(s.shape[-2])[:, None]), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def _graph(model, target):
    """The graph stage's module (fused, unscheduled) of ``model`` for a named target: (kernel names, module)."""
    from tvmfuse.pipeline import PipelineOptions, graph_stage
    from tvmfuse.report import graph_stats

    tgt = parse_target(NAMED_TARGETS[target])
    with tgt:
        mod = C.Sequential(graph_stage(tgt, PipelineOptions()))(tvmfuse.load_onnx(model))
    return graph_stats(mod).kernel_names, mod


def _attention_spec(mod):
    from tvmfuse.schedules.cpu.attention import ATTR, AttentionSpec

    funcs = [f for f in mod.functions.values() if isinstance(f, C.PrimFunc) and f.attrs is not None
             and ATTR in f.attrs]
    assert len(funcs) == 1, [str(gv.name_hint) for gv in mod.functions]
    return AttentionSpec.from_json(str(funcs[0].attrs[ATTR]))


@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
def test_computed_causal_mask_becomes_the_causal_flag(target):
    kernels, mod = _graph(_computed_mask_attention(), target)
    spec = _attention_spec(mod)
    assert len(kernels) == 1 and spec.causal_offset == 0 and spec.mask is None, kernels


@pytest.mark.parametrize("compare, masked", [("GreaterOrEqual", -np.inf), ("LessOrEqual", -1e4)],
                         ids=["anti_causal", "finite_fill"])
def test_other_computed_masks_stay_masks(compare, masked):
    """j >= i is no causal mask, and a finite fill is not -inf (the static build keeps both as masks)."""
    spec = _attention_spec(_graph(_computed_mask_attention(compare, masked), "skx-2")[1])
    assert spec.causal_offset is None and spec.mask is not None


def test_computed_causal_mask_matches_the_reference(host, rng):
    cm = tvmfuse.compile(_computed_mask_attention(), host)
    for b, s in ((1, 1), (3, 17), (1, 40)):
        feeds = {n: rng.standard_normal((b, 2, s, 16)).astype(np.float32) for n in ("q", "k", "v")}
        np.testing.assert_allclose(cm.run(feeds)["y"], _mask_reference(feeds, lambda j, i: j <= i), rtol=RTOL,
                                   atol=ATOL, err_msg=f"{b}x{s}")


# ------------------------------------------------------------------ the symbolic corpus's token models
_spec = importlib.util.spec_from_file_location("corpus_io", os.path.join(ROOT, "corpus", "corpus_io.py"))
corpus_io = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(corpus_io)
ENTRIES = {e["name"]: e for e in corpus_io.load_manifest()["models"]}
# the corpus's default models (corpus_io.OPT_IN_MODELS run in benchmarks/new_models_check.py: session 9's phi
# and qwen2 have *fewer* symbolic kernels, 17 vs 19, the symbolic build joining the Q and K rotary kernels
# that the static build keeps apart: benchmarks/notes/corpus9.md)
TOKEN_MODELS = [n for n in corpus_io.default_models(ENTRIES)
                if any("sequence" in spec["dyn_shape"] for spec in ENTRIES[n]["inputs"])]
# token models whose symbolic build has more kernels than the static one, explained (extra kernels, why, a
# name part of each extra kernel): T5's relative position bias.  Its RMSNorms fuse with Q/K/V and the FFN in
# both builds (cpu.norm_matmul, cpu.symbolic_norm_matmul: 16 vs 12 kernels before).
_spec = importlib.util.spec_from_file_location("symbolic_check", os.path.join(ROOT, "benchmarks",
                                                                              "symbolic_check.py"))
symbolic_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(symbolic_check)
EXPLAINED_EXTRA = symbolic_check.EXPLAINED_EXTRA_KERNELS


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", TOKEN_MODELS)
def test_token_model_has_the_static_kernel_count(name, host):
    entry = ENTRIES[name]
    static = compile_shared(corpus_io.model_path(entry, "static"), host)
    dyn = compile_shared(corpus_io.model_path(entry, "dynamic"), host)
    extra, why, part = EXPLAINED_EXTRA.get(name, (0, "", ""))
    kernels = ([s["kernel"] for s in dyn.report.schedules], [s["kernel"] for s in static.report.schedules])
    assert dyn.kernel_count == static.kernel_count + extra, (why, kernels)
    if extra:
        # per call (report.groups: a kernel two layers call counts twice), not per compiled function
        calls = ([g["kernel"] for g in dyn.report.groups], [g["kernel"] for g in static.report.groups])
        assert len([k for k in calls[0] if part in k]) == extra, (why, calls)
        assert not [k for k in calls[1] if part in k], (why, calls)
