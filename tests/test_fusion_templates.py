"""Rules that ask the templates: on a target whose template families declare ``accepts`` (CUDA), a group
is formed only when a family said it will schedule the fused kernel, and that answer is honest: for every
kernel the rules formed in the demo models and in corpus models (static shapes), the family that
accepted the group really matches the fused PrimFunc.  A refusal names the families that declined and why.
On CPU the matmul families (cpu.matmul_epilogue, cpu.sibling_matmuls, cpu.symbolic_matmul, cpu.norm_matmul),
cpu.row_reduction, cpu.elementwise and cpu.symbolic_rows declare ``accepts``; a group none of them takes passes
when the generic schedule (asked last) takes it, i.e. unless it holds a matmul anchor: such groups record no
template, and why the families of the rules that formed them declined."""
import re
from pathlib import Path

import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.explain import Recorder
from tvmfuse.passes import rules as R
from tvmfuse.pipeline import PipelineOptions, graph_stage
from tvmfuse.schedules import templates_for

import schedule_cases as S

CORPUS = Path(__file__).resolve().parent.parent / "corpus"
CORPUS_MODELS = ("resnet18", "mobilenet_v2", "efficientnet_b0", "convnext", "bert", "gpt2", "llama", "t5_encoder")


def cuda(arch="sm_90"):
    return C.Target({"kind": "cuda", "arch": arch}, host=tvmfuse.host_target())


def _graph(model, target):
    mod = tvmfuse.load_onnx(model)
    with Recorder() as rec, target:
        mod = C.Sequential(graph_stage(target, PipelineOptions()))(mod)
    funcs = {str(gv.name_hint): f for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)}
    return funcs, rec


def _check_accepted_templates_match(model, target):
    funcs, rec = _graph(model, target)
    by_family = {t.family: t for t in templates_for(target)}
    assert rec.groups, "the model forms no group: nothing was checked"
    for g in rec.groups:
        assert g.get("template") in by_family, f"{g['kernel']}: formed without a template accepting it"
        # FuseTIR keeps one PrimFunc of structurally equal groups: fused_x_1 is fused_x
        func = funcs.get(g["kernel"]) or funcs[re.sub(r"_\d+$", "", g["kernel"])]
        assert by_family[g["template"]].match(func, target) is not None, \
            f"{g['kernel']}: {g['template']}.accepts said yes, its match refuses the fused kernel"
    return rec


MODELS = {**{f"demo:{n}": b for n, b in M.DEMO_MODELS.items()},
          **{f"corpus:{n}": (lambda n=n: str(CORPUS / f"{n}.onnx")) for n in CORPUS_MODELS},
          "vit_block": S.vit_block, "qkv_3d": S.qkv_3d, "swiglu_3d": S.swiglu_3d}


@pytest.mark.parametrize("name", list(MODELS))
def test_accepting_template_matches_every_fused_kernel(name):
    _check_accepted_templates_match(MODELS[name](), cuda("sm_90"))


def test_accepted_families_cover_every_cuda_family_on_the_pattern_models():
    target = cuda("sm_80")
    seen = set()
    for model in (M.matmul_bias_gelu(), M.conv_bn_relu_residual(), M.conv_bn_relu_residual(depthwise=True),
                  M.layernorm_softmax(), M.elementwise_chain(), M.qkv_projection(), M.transformer_block()):
        seen |= {g["template"] for g in _check_accepted_templates_match(model, target).groups}
    assert seen == {t.family for t in templates_for(target)}


def test_refusal_names_the_template_that_declined():
    """A LayerNorm over the channels of NCHW (means over axis 1): the row-reduction family reduces innermost
    axes only, so on CUDA the means stay apart and the refusal says which family declined and why."""
    funcs, rec = _graph(S.channel_layernorm(), cuda())
    reasons = [r["reason"] for r in rec.refused if r["rule"].startswith("reduction")]
    assert any("no template schedules the group" in r and "cuda_row_reduction: a reduction over axes" in r
               for r in reasons), rec.refused
    # the refused pair: no group holds the mean and its consumer
    assert not any(("mean" in op) for g in rec.groups for op in g["ops"]), rec.groups


CPU_MODELS = {**{f"demo:{n}": b for n, b in M.DEMO_MODELS.items()},
              **{f"corpus:{n}": (lambda n=n: str(CORPUS / f"{n}.onnx")) for n in ("bert", "llama")},
              "vit_block": S.vit_block, "qkv_3d": S.qkv_3d, "swiglu_3d": S.swiglu_3d, "matmul_3d": S.matmul_3d}


@pytest.mark.parametrize("name", list(CPU_MODELS))
def test_cpu_accepting_template_matches_every_fused_kernel(name):
    """On CPU (AVX2 and AVX-512 named targets) a family that accepted a group really matches its fused
    kernel, and the matmul groups are accepted by a matmul family."""
    for target in (C.Target(S.HASWELL), C.Target(S.SKYLAKE)):
        funcs, rec = _graph(CPU_MODELS[name](), target)
        by_family = {t.family: t for t in templates_for(target)}
        assert rec.groups, "the model forms no group: nothing was checked"
        for g in rec.groups:
            if not g.get("template"):
                if g.get("rule") == "attention":
                    continue        # one kernel of its own pass (passes/attention.py), not a group of the gate
                assert not any(op.startswith("matmul") for op in g["ops"]), \
                    f"{g['kernel']}: a matmul group no CPU matmul family accepted"
                continue
            func = funcs.get(g["kernel"]) or funcs[re.sub(r"_\d+$", "", g["kernel"])]
            assert by_family[g["template"]].match(func, target) is not None, \
                f"{g['kernel']}: {g['template']}.accepts said yes, its match refuses the fused kernel"


def _matmul_node(m: int, k: int, n: int) -> R.NodeInfo:
    """The NodeInfo of a lone [m, k] @ [k, n] (its unfused PrimFunc from the graph stage)."""
    g = M._G(f"mm_{m}_{k}_{n}")
    g.op("MatMul", g.input("x", (m, k)), g.weight((k, n)))
    g.rename_last("y", (m, n))
    (name, func), = S.graph_funcs(g.model(), S.HASWELL).items()
    return R.NodeInfo(name, R.CONTRACTION, 4, reduce_axes=1, out_shape=(m, n), func=func)


def test_cpu_gate_refuses_a_matmul_group_no_matmul_family_takes_and_names_them():
    """Two matmuls over different rows in one group: no CPU matmul family tiles it and the generic schedule
    declines a matmul anchor, so the gate refuses it, naming every family that declined and why; one
    matmul with an elementwise op is accepted by cpu.matmul_epilogue; a group without a matmul passes
    without a family (the families without ``accepts`` or the generic schedule take it)."""
    from tvmfuse.schedules import accepting_template

    target = C.Target(S.HASWELL)
    a, b = _matmul_node(8, 16, 24), _matmul_node(12, 16, 24)
    add = R.NodeInfo("add", R.ELEMWISE, 0, out_shape=(8, 24))
    family, why = accepting_template(R.GroupInfo([a, b], [a, b]), target, prefer="sibling")
    assert family is None and why.startswith("no template schedules the group (cpu.sibling_matmuls: "), why
    for part in ("cpu.sibling_matmuls: the matmuls have different rows", "cpu.matmul_epilogue: 2 matmul/conv",
                 "cpu.symbolic_rows: static extents", "cpu.generic: " + a.name + " is a matmul"):
        assert part in why, why
    assert accepting_template(R.GroupInfo([a, add], [add]), target, prefer="matmul") == \
        ("cpu.matmul_epilogue", None)
    assert accepting_template(R.GroupInfo([add, add], [add]), target) == ("cpu.elementwise", None)
    for part in ("cpu.row_reduction: a matmul/conv anchor", f"cpu.elementwise: {a.name} is a contraction"):
        assert part in why, why


def test_cpu_groups_no_family_accepts_keep_their_fusions_and_say_why():
    """A LayerNorm over the channels of NCHW: cpu.row_reduction declines (not the innermost axes), the
    generic schedule takes the group: it keeps its fusions, records no template and why the families of
    its rules declined."""
    _, rec = _graph(S.channel_layernorm(), C.Target(S.HASWELL))
    means = [g for g in rec.groups if any("mean" in op for op in g["ops"])]
    assert means and all("template" not in g for g in means), rec.groups
    for g in means:
        assert "cpu.row_reduction: mean(" in g["declined"] and "not the innermost ones" in g["declined"], g


# --------------------------------------------------------------------------- CPU row reduction, elementwise
def _red(name, shape, axes, out, readers=()):
    return R.NodeInfo(name, R.REDUCTION, 4, row_keys=frozenset({(shape, axes)}), out_shape=out, readers=readers)


def _ew(name, out, kind=R.ELEMWISE, func=None):
    return R.NodeInfo(name, kind, 0 if kind == R.ELEMWISE else 2, out_shape=out, func=func)


def test_cpu_row_reduction_accepts_rows_and_says_why_not():
    """cpu.row_reduction accepts static row reductions over the innermost axes with the ops over the same rows
    (a LayerNorm's mean -> subtract); each refusal names its cause."""
    from tvmfuse.schedules.cpu.reduction import RowReduction

    t, fam = C.Target(S.HASWELL), RowReduction()
    sub = _ew("subtract", (2, 19, 40))
    mean = _red("mean", (2, 19, 40), (2,), (2, 19, 1), readers=(sub,))
    assert fam.accepts(R.GroupInfo([mean, sub], [sub]), t) is None
    fused = _red("layer_norm", (2, 19, 40), (2,), (2, 19, 40))       # a layer_norm op writes its rows
    assert fam.accepts(R.GroupInfo([_ew("add", (2, 19, 40)), fused], [fused]), t) is None
    cases = [
        ([_red("mean", (1, 24, 9, 11), (1,), (1, 1, 9, 11))], "reduces axes [1] of [1, 24, 9, 11], not the innermost"),
        ([_red("pool", (1, 8, 20, 20), (2, 3), (1, 8, 9, 9))], "a window reduction"),
        ([_red("sum", (40,), (0,), (1,))], "reduces every axis"),
        ([_red("a", (4, 40), (1,), (4, 1)), _red("b", (5, 40), (1,), (5, 1))], "reductions over different rows"),
        ([_red("m", (4, 40), (1,), (4, 1)), _ew("reshape", (40, 4), R.INJECTIVE)], "does not run over the rows"),
        ([_red("m", (4, 4, 8), (2,), (4, 4, 1), readers=(_t := _ew("transpose", (4, 4, 8), R.INJECTIVE),)), _t],
         "transpose [4, 4, 8] after the reductions"),
        ([_ew("add", (4, 40))], "no row reduction"),
        ([_red("m", (4, 40), (1,), (4, 1)), R.NodeInfo("matmul", R.CONTRACTION, 4, reduce_axes=1, out_shape=(4, 8))],
         "a matmul/conv anchor"),
    ]
    for members, why in cases:
        got = fam.accepts(R.GroupInfo(members, members[-1:]), t)
        assert got is not None and why in got, (why, got)
    n = C.tirx.Var("n", "int64")
    sym = _red("mean", (n, 40), (1,), (n, 1))
    assert "symbolic extents" in fam.accepts(R.GroupInfo([sym], [sym]), t)


def test_cpu_elementwise_accepts_elementwise_ops_but_not_shifts():
    """cpu.elementwise accepts elementwise and layout ops (static or symbolic); a reduction or an integer shift
    (which its match leaves to the generic schedule) is refused by name."""
    from onnx import TensorProto

    from tvmfuse.schedules.cpu.elementwise import Elementwise

    t, fam = C.Target(S.HASWELL), Elementwise()
    n = C.tirx.Var("n", "int64")
    ok = [_ew("add", (4, 40)), _ew("transpose", (40, 4), R.INJECTIVE), _ew("sigmoid", (n, 8))]
    assert fam.accepts(R.GroupInfo(ok, ok[-1:]), t) is None
    red = _red("mean", (4, 40), (1,), (4, 1))
    assert "mean is a reduction, not an elementwise" in fam.accepts(R.GroupInfo([ok[0], red], [red]), t)
    g = M._G("shift")
    g.op("BitShift", g.input("x", [64], TensorProto.UINT8), g.input("s", [64], TensorProto.UINT8), direction="LEFT")
    (name, func), = S.graph_funcs(S.finish(g), S.HASWELL).items()
    shift = _ew(name, (64,), func=func)
    assert "shifts integers" in fam.accepts(R.GroupInfo([shift], [shift]), t)
    assert fam.match(func, t) is None                    # what accepts foresees: the template refuses it


def test_rule_rows_carry_their_check_and_template():
    families = [t.family for t in templates_for(cuda()) + templates_for(C.Target(S.HASWELL))]
    for rule in R.RULES:
        assert rule.template, f"{rule.name}: names no template family"
        assert any(rule.template in f for f in families), f"{rule.name}: no family named {rule.template!r}"
    with_checks = {r.name for r in R.RULES if r.check is not None}
    assert {"contraction_epilogue", "sibling_contractions", "reduction_chain"} <= with_checks


def test_rule_checks_run_for_every_rule_that_formed_the_group():
    """An injective op brought into a matmul group by the elementwise rule is refused by the
    contraction_epilogue rule's own check, which formed the group first."""
    a = R.NodeInfo("matmul", R.CONTRACTION, 4)
    t = R.NodeInfo("transpose", R.INJECTIVE, 2)
    chain = R.RULES_BY_NAME["elementwise_chain"]
    assert R.check_rules([chain], [a, t]) is None
    why = R.check_rules([R.RULES_BY_NAME["contraction_epilogue"], chain], [a, t])
    assert why is not None and "layout op transpose" in why
