"""Rules that ask the templates: on a target whose template families declare ``accepts`` (CUDA), a group
is formed only when a family said it will schedule the fused kernel, and that answer is honest: for every
kernel the rules formed in the demo models and in corpus models (static shapes), the family that
accepted the group really matches the fused PrimFunc.  A refusal names the families that declined and why.
On CPU the matmul families (cpu.matmul_epilogue, cpu.sibling_matmuls, cpu.symbolic_matmul) and
cpu.symbolic_rows declare ``accepts``; a group none of them takes passes when the generic schedule (asked
last) takes it, i.e. unless it holds a matmul anchor: such groups record no template."""
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
    assert accepting_template(R.GroupInfo([add, add], [add]), target) == (None, None)


def test_cpu_groups_record_no_template_and_keep_their_fusions():
    _, rec = _graph(S.channel_layernorm(), C.Target(S.HASWELL))
    assert rec.groups and all("template" not in g for g in rec.groups)
    assert any(any("mean" in op for op in g["ops"]) for g in rec.groups)


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
