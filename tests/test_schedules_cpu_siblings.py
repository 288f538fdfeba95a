"""CPU sibling-matmuls template (Q/K/V, SwiGLU gate/up, the transformer's fused projections): matched by
structure, correct on fresh random inputs with odd shapes, loops really fused (no C of full size, the
siblings' row-block loops merged into one parallel loop, vector inner loops), every sampled config legal;
and no kernel of the built-in models is left to the fallback."""
import random

import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.explain import Recorder
from tvmfuse.pipeline import PipelineOptions, graph_stage
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu import TEMPLATES
from tvmfuse.schedules.cpu.reduction import RowReduction
from tvmfuse.schedules.cpu.siblings import SiblingMatmuls

from conftest import NAMED_TARGETS, assert_close_to_reference, named_target
from schedule_cases import compacted as _lowered, nodes as _nodes, numel as _numel

SIBLINGS = "cpu.sibling_matmuls"

# (builder, kwargs): odd sizes that divide neither the register tiles nor the vector width
CASES = [
    ("qkv_projection", dict(seq=37, hidden=45)),
    ("qkv_projection", dict(seq=37, hidden=45, weights_as_inputs=True)),
    ("swiglu", dict(seq=29, hidden=33, ffn=50)),
    ("transformer_block", dict(seq=13, hidden=36, heads=3, ffn=70)),
]
IDS = [f"{b}-{i}" for i, (b, _) in enumerate(CASES)]


def _graph_funcs(model, target):
    """The fused PrimFuncs tvmfuse's graph stage (default fusion) makes of ``model``."""
    mod = tvmfuse.load_onnx(model)
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions()))(mod)
    return {str(gv.name_hint): f for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)}


def _sibling_func(model, target):
    found = [(n, f) for n, f in _graph_funcs(model, target).items() if SiblingMatmuls().match(f, target)]
    assert len(found) == 1, f"expected one sibling-matmul kernel, got {[n for n, _ in found]}"
    return found[0]


def _run(func, target, args):
    lib = C.build_prim_module(C.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    out = C.tensor(np.zeros([int(d) for d in func.params[-1].shape], "float32"))
    lib["main"](*[C.tensor(a) for a in args], out)
    return out.numpy()


@pytest.mark.parametrize("builder,kwargs", CASES, ids=IDS)
def test_siblings_numerics_vs_reference(builder, kwargs, host, rng):
    model = getattr(M, builder)(**kwargs)
    with Recorder() as rec:
        cm = tvmfuse.compile(model, host)
    used = [s["template"] for s in rec.schedules]
    # the transformer block's Q/K/V share a kernel with the LayerNorm before them (norm_prologue rule):
    # cpu.norm_matmul tiles them as this template does (tests/test_norm_prologue.py)
    family = "cpu.norm_matmul" if builder == "transformer_block" else SIBLINGS
    assert family in used, f"{family} not used: {rec.schedules}"
    assert not [s for s in rec.schedules if s["source"] == "fallback" or s["template"] == "unscheduled"], \
        rec.schedules
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tname", list(NAMED_TARGETS))
@pytest.mark.parametrize("builder,kwargs", CASES[:3], ids=IDS[:3])
def test_siblings_structure(builder, kwargs, tname):
    """No C of full size left; one parallel row-block loop holds every sibling; vector inner loops."""
    target = named_target(tname)
    name, func = _sibling_func(getattr(M, builder)(**kwargs), target)
    res = schedule_prim_func(func, target, {}, name)
    assert res is not None and res.template == SIBLINGS
    n_out = len(SiblingMatmuls().match(func, target).info["chains"])
    nodes = _nodes(_lowered(res.func))
    smallest_out = min(_numel(p.shape) for p in func.params[-n_out:])
    allocs = [(str(b.name), _numel(b.shape)) for s in nodes if isinstance(s, C.SBlock) for b in s.alloc_buffers]
    # a zero-padded copy of a weight panel (pad_n: columns not a multiple of the register tile) is B-sized
    b_pads = {f"{b}_pad" for b in SiblingMatmuls().match(func, target).info["b_buffers"].values()}
    big = [a for a in allocs if a[1] >= smallest_out and a[0] not in b_pads]
    assert not big, f"full-size intermediates left: {big}"
    loops = [s for s in nodes if isinstance(s, C.tirx.For)]
    assert any(int(s.kind) == int(C.ForKind.VECTORIZED) for s in loops), "no vectorized loop"
    parallel = [s for s in loops if int(s.kind) == int(C.ForKind.PARALLEL)]
    assert parallel, "no parallel loop"
    if res.config["share_rows"]:
        assert len(parallel) == 1, f"{len(parallel)} parallel loops: the siblings' row loops were not merged"
        written = set()
        C.post_order_visit(parallel[0].body, lambda s: written.add(str(s.buffer.name))
                           if isinstance(s, C.BufferStore) else None)
        outs = {str(p.name) for p in res.func.params[-n_out:]}
        assert outs <= written, f"outputs {outs - written} are written outside the shared row loop"


def test_siblings_space_is_legal(host):
    """Configs sampled from the knob space apply and compute the same numbers (odd shapes, 6 samples)."""
    name, func = _sibling_func(M.swiglu(seq=19, hidden=21, ffn=43), host)
    tmpl = SiblingMatmuls()
    match = tmpl.match(func, host)
    space = tmpl.space(match, host)
    assert space.size() >= 100
    assert space.contains(tmpl.default_config(match, host))
    args = [np.random.default_rng(0).standard_normal([int(d) for d in p.shape]).astype("float32")
            for p in func.params[:-1]]
    want = _run(func, host, args)
    rnd = random.Random(0)
    configs = [space.sample(rnd) for _ in range(6)]
    configs[0]["share_rows"] = True
    for cfg in configs:
        sch = C.Schedule(func)
        tmpl.apply(sch, match, cfg)
        np.testing.assert_allclose(_run(sch.mod["main"], host, args), want, rtol=1e-5, atol=1e-5,
                                   err_msg=str(cfg))


@pytest.mark.parametrize("tname", ["haswell-2", "skx-2"])
def test_qkv_shares_rows_across_three_outputs(tname):
    """Q/K/V with the default config: one merged parallel loop over row blocks, three chains."""
    target = named_target(tname)
    name, func = _sibling_func(M.qkv_projection(seq=37, hidden=45), target)
    match = SiblingMatmuls().match(func, target)
    assert [a for a, _ in match.info["chains"]] == [None, None, None]
    assert len(match.info["inputs"]) == 1, "the three matmuls read one input"
    assert SiblingMatmuls().default_config(match, target)["share_rows"] is True


@pytest.mark.parametrize("tname", ["haswell-2", "skx-32"])
def test_row_reduction_refuses_matmuls(tname):
    """A matmul is a trailing reduction too; the row-reduction template must not take it."""
    target = named_target(tname)
    for model in (M.qkv_projection(seq=8, hidden=16), M.matmul_bias_gelu(m=8, k=16, n=24)):
        for name, func in _graph_funcs(model, target).items():
            assert RowReduction().match(func, target) is None, name


def _conv_templates_present() -> bool:
    return any("conv" in t.family for t in TEMPLATES)


@pytest.mark.parametrize("tname", ["haswell-2", "skx-32", "neon-4"])
@pytest.mark.parametrize("name", sorted(M.PATTERN_MODELS) + sorted(M.DEMO_MODELS))
def test_no_kernel_falls_back(name, tname):
    """Every kernel of every built-in model gets a template (conv kernels only once conv templates exist),
    and the template applies without an error."""
    target = named_target(tname)
    build = {**M.PATTERN_MODELS, **M.DEMO_MODELS}[name]
    bad = []
    for kernel, func in _graph_funcs(build(), target).items():
        if schedule_prim_func(func, target, {}, kernel) is None:
            bad.append(kernel)
    if not _conv_templates_present():
        bad = [k for k in bad if "conv" not in k]
    assert not bad, f"no template for {bad}"


@pytest.mark.parametrize("builder,kwargs", [("swiglu", dict(seq=19, hidden=21, ffn=43)),
                                            ("qkv_projection", dict(seq=23, hidden=37))])
@pytest.mark.parametrize("order,pack_b", [("cols", True), ("cols", False), ("rows", True)])
def test_siblings_pack_b_and_column_order(builder, kwargs, order, pack_b, host):
    """order='cols' (parallel loop over B panels) and pack_b (each matmul's B panel copied into a compact
    buffer inside that loop): same numbers on odd shapes, and structurally B is only read by the pack
    blocks, each of which fills a buffer of one panel (K x nc), never the whole of B."""
    name, func = _sibling_func(getattr(M, builder)(**kwargs), host)
    tmpl = SiblingMatmuls()
    match = tmpl.match(func, host)
    cfg = {**tmpl.default_config(match, host), "order": order, "pack_b": pack_b, "share_rows": False,
           "nc_tiles": 1}
    assert tmpl.space(match, host).contains(cfg)
    args = [np.random.default_rng(1).standard_normal([int(d) for d in p.shape]).astype("float32")
            for p in func.params[:-1]]
    sch = C.Schedule(func)
    tmpl.apply(sch, match, cfg)
    np.testing.assert_allclose(_run(sch.mod["main"], host, args), _run(func, host, args), rtol=1e-5, atol=1e-5,
                               err_msg=str(cfg))
    lowered = _lowered(sch.mod["main"])
    nodes = _nodes(lowered)
    b_names = set(match.info["b_buffers"].values())
    k = match.info["K"]
    nr = cfg["nvec"] * cfg["lanes"]
    allocs = {str(b.name): _numel(b.shape) for s in nodes if isinstance(s, C.SBlock) for b in s.alloc_buffers}
    packs = {n: e for n, e in allocs.items() if any(n.startswith(b) for b in b_names)}
    if pack_b:
        assert len(packs) == len(b_names), f"expected one pack buffer per B, got {allocs}"
        assert all(e <= k * nr for e in packs.values()), f"pack buffers larger than one panel: {packs}"
        scheduled = _nodes(sch.mod["main"])        # blocks before lowering: their own reads, no opaque parents
        readers = [s for s in scheduled if isinstance(s, C.SBlock)
                   and any(str(r.source.name) in b_names for r in s.reads)]
        assert readers and all(len(s.writes) == 1 and str(s.writes[0].source.name) in packs for s in readers), \
            "B is read by blocks other than the pack blocks"
    elif cfg["pad_n"] and any(n % nr for n in match.info["Ns"].values()):
        # columns padded to the register tile: each B panel is zero-padded, one panel at a time
        assert packs and all(n.endswith("_pad") and e <= k * nr for n, e in packs.items()), allocs
    else:
        assert not packs, allocs
    parallel = [s for s in nodes if isinstance(s, C.tirx.For) and int(s.kind) == int(C.ForKind.PARALLEL)]
    assert len(parallel) == len(match.info["chains"]), "one parallel loop per chain"


@pytest.mark.parametrize("tname", ["haswell-2", "skx-2"])
def test_siblings_default_packs_long_k_weights(tname):
    """A long reduction (K=768: a B strip of 768 cache lines, 2 KB apart: more than a quarter of the
    target's L1d, 32 KB on both targets here) gets the column order with packed B panels by default
    (SwiGLU 512x768x2048 on a 2-core znver3: 155 -> 46 ms); a short one keeps the rows."""
    target = named_target(tname)
    for model, want in ((M.swiglu(seq=64, hidden=768, ffn=512), ("cols", True)),
                        (M.qkv_projection(seq=37, hidden=45), ("rows", False))):
        name, func = _sibling_func(model, target)
        tmpl = SiblingMatmuls()
        match = tmpl.match(func, target)
        cfg = tmpl.default_config(match, target)
        assert (cfg["order"], cfg["pack_b"]) == want, (name, cfg)
        assert tmpl.space(match, target).contains(cfg)
