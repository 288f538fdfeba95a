"""The ``norm_prologue`` rule and the ``cpu.norm_matmul`` template (issue 14): a LayerNorm / RMSNorm (the
ONNX op as TVM legalizes it, or decomposed into mean, sub, pow/mul, mean, add eps, sqrt, div/reciprocal,
scale, bias) in one kernel with the matmul(s) it feeds; the statistics computed once per row block, the
normalised rows written only into the matmuls' A panel.

Numbers: each fused model against onnx's op-by-op reference on fresh random inputs (2-D and 3-D
activations, with and without the norm's bias, hidden sizes that no vector width divides, Q/K/V siblings,
SwiGLU's gate/up).  Structure (named targets): one kernel, scheduled by ``cpu.norm_matmul``, no buffer of
the normalised tensor's full size after buffer compaction, one parallel row-block loop, vector loops.
Refusals: a normalised tensor that something else reads, a softmax (a max reduction) before a matmul and
a symbolic row length K (symbolic rows fuse: test_symbolic_norm_prologue.py) leave the groups exactly as
without the rule, with the reason in ``tvmfuse explain``."""
import random

import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.explain import Recorder
from tvmfuse.explain_cli import explain, format_explain
from tvmfuse.passes import rules as R
from tvmfuse.pipeline import PipelineOptions, graph_stage
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu.prologue import NormMatmul

import schedule_cases as S
from conftest import assert_close_to_reference, named_target
from schedule_cases import compacted as _lowered, nodes as _nodes, numel as _numel

FAMILY = "cpu.norm_matmul"
RULE = "norm_prologue"

# (kwargs of models.norm_matmul): every norm form; 2-D and 3-D; d = 37, 45, 100: no vector width divides
CASES = [
    dict(norm="layernorm", rows=21, d=37, n=24),
    dict(norm="layernorm", rows=9, d=45, n=40, batch=2, bias=False, heads=3),
    dict(norm="layernorm_decomposed", rows=13, d=37, n=50, heads=3),
    dict(norm="layernorm_decomposed", rows=11, d=64, n=48, batch=3, bias=False, act="gelu"),
    dict(norm="rmsnorm", rows=32, d=100, n=70, batch=2, bias=False, act="gelu"),
    dict(norm="rmsnorm", rows=17, d=48, n=33, matmul_bias=False),
    dict(norm="rmsnorm_reciprocal", rows=16, d=45, n=48, bias=False, swiglu=True),
    dict(norm="rmsnorm_reciprocal", rows=5, d=96, n=64, batch=2, bias=True, heads=2, matmul_bias=False),
]
IDS = ["{norm}-{shape}-d{d}{extra}".format(
    norm=c["norm"], shape="3d" if "batch" in c else "2d", d=c["d"],
    extra=("-nobias" if c.get("bias") is False else "") + ("-qkv" if c.get("heads", 1) == 3 else "")
    + ("-swiglu" if c.get("swiglu") else "") + (f"-{c['act']}" if c.get("act") else "")) for c in CASES]


def _graph_funcs(model, target):
    """The fused PrimFuncs of tvmfuse's graph stage."""
    mod = tvmfuse.load_onnx(model)
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions()))(mod)
    return {str(gv.name_hint): f for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)}


def _run(func, target, args):
    lib = C.build_prim_module(C.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    outs = [C.tensor(np.zeros([int(d) for d in p.shape], "float32")) for p in func.params[len(args):]]
    lib["main"](*[C.tensor(a) for a in args], *outs)
    return [o.numpy() for o in outs]


# ------------------------------------------------------------------------------------------ the rule row
def test_rule_row_carries_check_template_and_test():
    rule = R.RULES_BY_NAME[RULE]
    assert rule.kind == "edge" and rule.check is R.check_norm_prologue and rule.template == "norm_matmul"
    assert rule.second == (R.CONTRACTION,) and rule.producer_group == (R.REDUCTION,)
    assert "test_norm_prologue" in rule.why


# ------------------------------------------------------------------------------------------ numbers
@pytest.mark.parametrize("kwargs", CASES, ids=IDS)
def test_norm_and_matmuls_one_kernel_match_reference(kwargs, host, rng):
    model = M.norm_matmul(**kwargs)
    with Recorder() as rec:
        cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 1, (cm.report.after.kernel_names, cm.report.refused)
    assert [s["template"] for s in rec.schedules] == [FAMILY], rec.schedules
    assert any(RULE in g["rule"] for g in cm.report.groups), cm.report.groups
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-5)


def test_space_is_legal(host):
    """Configs sampled from the knob space apply and compute what the default computes (odd shapes)."""
    funcs = _graph_funcs(M.norm_matmul(norm="layernorm_decomposed", rows=19, d=40, n=43, heads=2), host)
    (name, func), = funcs.items()
    tmpl = NormMatmul()
    match = tmpl.match(func, host)
    assert match is not None, name
    space = tmpl.space(match, host)
    default = tmpl.default_config(match, host)
    assert space.contains(default) and space.size() >= 100
    # a predicated 7 x 2-vector register tile unrolled 8 times took 26-33 s to build: not in the space
    slow = {**default, "mr": 7, "nvec": 2, "k_unroll": 8, "pad_n": False}
    assert not space.contains(slow) and "slow to build" in space.excluded(slow)
    data = np.random.default_rng(0)
    n_in = len(func.params) - len(match.info["chains"])
    args = [data.standard_normal([int(d) for d in p.shape]).astype("float32") for p in func.params[:n_in]]
    sch = C.Schedule(func)
    tmpl.apply(sch, match, default)
    want = _run(sch.mod["main"], host, args)
    rnd = random.Random(0)
    for cfg in [space.sample(rnd) for _ in range(4)]:
        sch = C.Schedule(func)
        tmpl.apply(sch, match, cfg)
        for got, w in zip(_run(sch.mod["main"], host, args), want):
            np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-5, err_msg=str(cfg))


# ------------------------------------------------------------------------------------------ structure
@pytest.mark.parametrize("tname", ["haswell-2", "skx-2"])
@pytest.mark.parametrize("kwargs", [CASES[1], CASES[3], CASES[6]], ids=[IDS[1], IDS[3], IDS[6]])
def test_normalised_tensor_never_written_whole(kwargs, tname):
    """One kernel; after buffer compaction no buffer holds the normalised tensor (rows x K) whole; the
    statistics and the panel live under one parallel row-block loop; vector loops."""
    target = named_target(tname)
    funcs = _graph_funcs(M.norm_matmul(**kwargs), target)
    assert len(funcs) == 1, list(funcs)
    (name, func), = funcs.items()
    res = schedule_prim_func(func, target, {}, name)
    assert res is not None and res.template == FAMILY
    info = NormMatmul().match(func, target).info
    rows = info["M"] * int(np.prod(info["batch"] or [1]))
    full = rows * info["K"]
    nodes = _nodes(_lowered(res.func))
    allocs = [(str(b.name), _numel(b.shape)) for s in nodes if isinstance(s, C.SBlock) for b in s.alloc_buffers]
    # copies of weight panels: zero-padded (pad_n) or packed (pack_b), as large as the weights' strips
    b_copies = {f"{b}{suffix}" for b in info["b_buffers"].values() for suffix in ("_pad", "_global")}
    assert not [a for a in allocs if a[1] >= full and a[0] not in b_copies], f"full-size buffers left: {allocs}"
    sch = C.Schedule(func)
    normed = str(sch.get(sch.get_sblock(info["norm"])).writes[0].source.name)
    assert [n for n, size in allocs if n == normed] == [normed], (normed, allocs)
    loops = [s for s in nodes if isinstance(s, C.tirx.For)]
    parallel = [s for s in loops if int(s.kind) == int(C.ForKind.PARALLEL)]
    assert len(parallel) == 1, f"{len(parallel)} parallel loops: the row blocks of the siblings were not merged"
    # the panel (the norm block's buffer) and every statistic are written inside the parallel row loop
    written_inside = set()
    C.post_order_visit(parallel[0].body, lambda s: written_inside.add(str(s.buffer.name))
                       if isinstance(s, C.BufferStore) else None)
    written_all = {str(s.buffer.name) for s in nodes if isinstance(s, C.BufferStore)}
    assert written_all <= written_inside, f"written outside the row-block loop: {written_all - written_inside}"
    panel = res.config["mc_tiles"] * res.config["mr"] * info["K"]
    assert dict(allocs)[normed] == panel < full, f"the normalised rows are not an mc x K panel: {allocs}"
    assert any(int(s.kind) == int(C.ForKind.VECTORIZED) for s in loops), "no vectorized loop"


def test_transformer_block_in_five_kernels(host, rng):
    """The demo block: LN+QKV, attention, out-projection+residual, LN+FFN-up+GELU, FFN-down+residual."""
    model = M.transformer_block(seq=24, hidden=36, heads=3, ffn=70)
    with Recorder() as rec:
        cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 5, cm.report.after.kernel_names
    norm_groups = [g for g in cm.report.groups if RULE in g["rule"]]
    assert len(norm_groups) == 2, cm.report.groups
    assert [s["template"] for s in rec.schedules].count(FAMILY) == 2, rec.schedules
    assert not [s for s in rec.schedules if s["source"] in ("fallback", "generic")], rec.schedules
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tname", ["haswell-2", "skx-2"])
def test_demo_transformer_block_kernel_count(tname):
    """The demo's block at its default size (what `tvmfuse demo` compiles): 42 ops -> 5 kernels."""
    d = explain(M.transformer_block(), named_target(tname))
    assert (d["kernels_unfused"], d["kernels_fused"]) == (42, 5), d["groups"]
    rules = [g["rule"] for g in d["groups"] if RULE in g["rule"]]
    assert len(rules) == 2 and any("sibling_contractions" in r for r in rules), rules


# ------------------------------------------------------------------------------------------ refusals
def _without_rule(monkeypatch, model, target):
    with monkeypatch.context() as mp:
        mp.setattr(R, "RULES", tuple(r for r in R.RULES if r.name != RULE))
        return explain(model, target)


def _softmax_matmul():
    g = M._G("softmax_matmul")
    x = g.input("x", (16, 40))
    g.op("MatMul", g.op("Softmax", x, axis=-1), g.weight((40, 24)))
    g.rename_last("y", (16, 24))
    return g.model()


PROFIT, TARGET = "not profitable: ", "not supported by the target: "


@pytest.mark.parametrize("model, kind, reason", [
    (M.norm_matmul(norm="layernorm", rows=8, d=20, n=16, norm_output=True), PROFIT,
     "the normalised tensor layer_norm(lv"),
    (M.norm_matmul(norm="rmsnorm", rows=8, d=20, n=16, heads=2, norm_output=True), PROFIT, "is also read by"),
    (_softmax_matmul(), PROFIT, "is not a sum over the rows"),
    # symbolic rows fuse (tests/test_symbolic_norm_prologue.py); a symbolic row length K does not
    (S.rmsnorm_matmul_symbolic_k(), PROFIT, "symbolic shapes"),
    # 3 x 256 x 384 float32 weights = 1.125 MiB: over the CPU's prologue_weight_bytes (1 MiB)
    (M.norm_matmul(norm="layernorm", rows=8, d=256, n=384, heads=3), TARGET, "every row block reads all"),
], ids=["layernorm-output", "rmsnorm-siblings-output", "softmax", "symbolic", "weights-over-limit"])
def test_rule_does_not_fire_and_says_why(model, kind, reason, monkeypatch, host):
    """expected = before: the groups are those made without the rule; the refusal is in explain's text."""
    d = explain(model, host)
    before = _without_rule(monkeypatch, model, host)
    assert d["groups"] == before["groups"] and d["kernels_fused"] == before["kernels_fused"]
    assert not any(RULE in g["rule"] for g in d["groups"])
    refused = [r for r in d["refused"] if r["rule"] == RULE]
    assert refused and reason in refused[0]["reason"], d["refused"]
    text = format_explain("m", d)
    assert f"[{RULE}]: {kind}" in text and reason in text


def test_normalised_tensor_read_outside_stays_correct(host, rng):
    model = M.norm_matmul(norm="layernorm_decomposed", rows=12, d=36, n=20, heads=3, norm_output=True)
    cm = tvmfuse.compile(model, host)
    assert not any(RULE in g["rule"] for g in cm.report.groups)
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-5)
