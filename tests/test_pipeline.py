"""The stage builder: groups recorded once by the pass that forms them, TVM's failures guarded, tvmfuse's not."""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.explain import Recorder
from tvmfuse.passes.grouping import FuseGroups
from tvmfuse.pipeline import PipelineOptions, Stages, guarded, legalize_passes, pre_legalize_passes
from tvmfuse.report import graph_stats, groups_in


def _legalized(model, host):
    with host:
        return C.Sequential(pre_legalize_passes(host, PipelineOptions()) + legalize_passes(host))(
            tvmfuse.load_onnx(model))


@pytest.mark.parametrize("model", [M.matmul_bias_gelu(m=8, k=16, n=24),
                                   M.qkv_projection(seq=8, hidden=16, weights_as_inputs=True),
                                   M.layernorm_softmax(rows=4, d=32)])
def test_recorded_groups_are_the_groups_of_the_module(model, host):
    """What FuseGroups records (the report's groups) is what its output module holds: kernels, ops, rules,
    outputs."""
    legal = _legalized(model, host)
    with host, Recorder() as rec:
        grouped = FuseGroups(host)(legal)
    assert rec.groups, "the model has at least one group"
    assert sorted(rec.groups, key=lambda g: g["kernel"]) == groups_in(grouped)


def test_compile_report_lists_recorded_groups_for_both_groupings(host):
    m = M.qkv_projection(seq=8, hidden=16, weights_as_inputs=True)
    ours = tvmfuse.compile(m, host).report.groups
    assert [(g["rule"], g["outputs"]) for g in ours] == [("sibling_contractions", 3)]
    stock = tvmfuse.compile(M.matmul_bias_gelu(m=8, k=16, n=24), host, fusion=False, schedules=False, fast_math=False).report
    assert stock.groups and all(g["rule"] == "fuse_ops" for g in stock.groups)
    assert len(stock.groups) == sum(1 for n in stock.after.kernel_names if n.startswith("fused_"))


@C.module_pass(opt_level=0, name="test.tvm_fails")
def _tvm_fails(mod, _ctx):
    raise C.InternalError("Check failed: simulated failure inside a TVM pass")


@C.module_pass(opt_level=0, name="test.tvmfuse_bug")
def _tvmfuse_bug(mod, _ctx):
    return {}["missing"]   # a KeyError: a bug in one of tvmfuse's own passes


def test_tvm_failure_leaves_the_module_unfused_and_says_why(host):
    legal = _legalized(M.matmul_bias_gelu(m=8, k=16, n=24), host)
    with host, Recorder() as rec:
        out = guarded([_tvm_fails], "fusion", own_passes=[FuseGroups(host)])(legal)
    C.assert_structural_equal(out, legal)
    assert rec.groups == []   # FuseGroups formed one, but it was not built
    assert [(r["producer"], r["rule"]) for r in rec.refused] == [("<module>", "fusion")]
    assert "InternalError" in rec.refused[0]["reason"] and "simulated failure" in rec.refused[0]["reason"]


def test_bug_in_tvmfuse_pass_is_not_swallowed(host):
    legal = _legalized(M.matmul_bias_gelu(m=8, k=16, n=24), host)
    with host, pytest.raises(KeyError, match="missing"):
        guarded([], "fusion", own_passes=[_tvmfuse_bug])(legal)


def test_stages_graph_fuses_and_the_rest_builds_it(host, rng):
    m = M.matmul_bias_gelu(m=8, k=16, n=24)
    stages = Stages(host)
    with host:
        fused = C.Sequential(stages.graph())(tvmfuse.load_onnx(m))
        ex = C.compile_module(fused, host, relax_pipeline=C.Sequential(stages.schedule() + stages.lower()))
    assert graph_stats(fused).kernels == 1
    feeds = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in M.random_feeds(m).items()}
    out = C.VirtualMachine(ex, C.cpu())["main"](*[C.tensor(feeds[i.name]) for i in m.graph.input])
    ref = M.reference_outputs(m, feeds)
    np.testing.assert_allclose(out.numpy(), next(iter(ref.values())), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build", [lambda: _relu6(), M.transformer_block,
                                   lambda: M.norm_matmul(rows=5, d=12, n=8), M.resnet_block],
                         ids=["relu6", "transformer_block", "norm_matmul", "resnet_block"])
def test_unfused_view_counts_what_fold_constant_leaves(host, build):
    """The report's baseline (``Stages.unfused_view``: no FoldConstant, which builds every call on constants)
    counts kernels, intermediates and bytes exactly as the unfused module after FoldConstant."""
    mod = tvmfuse.load_onnx(build())
    with host:
        stages = Stages(host, PipelineOptions())
        want = graph_stats(C.Sequential(stages.unfused())(mod))
        view = C.Sequential(stages.unfused_view())(mod)
    assert "FoldConstant" not in [type(p).__name__ for p in stages.unfused_view()]
    assert graph_stats(view, fold_constant_calls=True) == want


def _relu6():
    """Clip(x, 0, 6) with constant bounds (MobileNet's ReLU6): legalized, isnan/where of each bound run on
    constants only (FoldConstant folds them)."""
    g = M._G("relu6")
    x = g.input("x", (4, 6))
    g.op("Clip", x, g.const(np.float32(0)), g.const(np.float32(6)))
    g.rename_last("y", (4, 6))
    return g.model()


def test_unfused_view_leaves_out_the_calls_on_constants(host):
    # the view keeps the calls on constants (FoldConstant would build and run them); graph_stats leaves
    # them out, and the report's baseline is that count
    with host:
        view = C.Sequential(Stages(host, PipelineOptions()).unfused_view())(tvmfuse.load_onnx(_relu6()))
    assert graph_stats(view).kernel_names == ["tir_isnan", "where", "maximum", "tir_isnan", "where", "minimum"]
    assert graph_stats(view, fold_constant_calls=True).kernel_names == ["maximum", "minimum"]
    assert tvmfuse.compile(_relu6(), host).report.before == graph_stats(view, fold_constant_calls=True)
