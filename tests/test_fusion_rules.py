"""One structural test per fusion rule (the rule fires: groups, kernels, intermediate bytes) and one where
it must not fire (the refusal is recorded with its reason; ``expected = before`` where the graph holds
nothing else to fuse).  Graph stage only (no build): fast."""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.explain import Recorder
from tvmfuse.passes import rules as R
from tvmfuse.passes.grouping import FuseGroups
from tvmfuse.pipeline import PipelineOptions, fuse_tir_passes, legalize_passes, pre_legalize_passes
from tvmfuse.report import graph_stats, groups_in

AX = np.array([-1], np.int64)


def _graph(name, inputs, build):
    """An ONNX model: ``inputs`` {name: shape}, ``build(g, *input names) -> [(out name, shape)]``."""
    g = M._G(name)
    names = [g.input(k, s) for k, s in inputs.items()]
    for out, shape in build(g, *names):
        _rename(g, out, shape)
    return g.model()


def _rename(g, tensor, shape):
    for n in g.nodes:
        for i, o in enumerate(n.output):
            if o == tensor:
                n.output[i] = "out_" + tensor
        for i, x in enumerate(n.input):
            if x == tensor:
                n.input[i] = "out_" + tensor
    g.output("out_" + tensor, shape)


def _legalized(model, host):
    mod = tvmfuse.load_onnx(model)
    with host:
        return C.Sequential(pre_legalize_passes(host, PipelineOptions()) + legalize_passes(host))(mod)


# GPU limits: reduction kernels with several outputs allowed (CPU refuses them, see rules._LIMITS)
MULTI_OUT = R.TargetLimits(max_ops=64, max_outputs=8, multi_output_reductions=True)
ONE_OUT_REDUCTIONS = R.TargetLimits(max_ops=64, max_outputs=8, multi_output_reductions=False)


def _group(model, host, limits=None):
    before = _legalized(model, host)
    with host, Recorder() as rec:
        after = FuseGroups(host, limits)(before)
        fused = C.Sequential(fuse_tir_passes(host, PipelineOptions()))(after)
    return before, after, fused, rec.refused


def _rules_of(after):
    return [g["rule"] for g in groups_in(after)]


def _refused(refused, rule):
    return [r for r in refused if r["rule"] == rule]


def test_rules_are_data():
    names = [r.name for r in R.RULES]
    assert len(names) == len(set(names))
    for r in R.RULES:
        assert r.kind in ("edge", "sibling", "horizontal", "chain") and r.first and r.second and "test_" in r.why


# ----------------------------------------------------------------------------------------- fires
def test_elementwise_chain_fires(host):
    _, after, fused, _ = _group(M.elementwise_chain(n=64), host)
    assert _rules_of(after) == ["elementwise_chain"]
    s = graph_stats(fused)
    assert (s.kernels, s.intermediates, s.intermediate_bytes) == (1, 0, 0)


def test_contraction_epilogue_fires(host):
    _, after, fused, _ = _group(M.matmul_bias_act(m=8, k=16, n=8, act="Relu"), host)
    assert _rules_of(after) == ["contraction_epilogue+elementwise_chain"] or \
        _rules_of(after) == ["contraction_epilogue"]
    assert graph_stats(fused).kernels == 1


def test_reduction_prologue_and_epilogue_fire(host):
    m = _graph("prologue", {"x": (4, 16)}, lambda g, x: [
        (g.op("Mul", g.op("ReduceSum", g.op("Mul", x, x), g.const(AX), keepdims=1),
              g.const(np.float32(0.5))), (4, 1))])
    _, after, fused, _ = _group(m, host)
    assert _rules_of(after) == ["reduction_prologue+reduction_epilogue"]
    assert graph_stats(fused).kernels == 1 and graph_stats(fused).intermediate_bytes == 0


def test_reduction_chain_fires(host):
    # a softmax (one PrimFunc, same rows in and out) feeding a row sum over the same rows
    m = _graph("chain", {"x": (4, 16)}, lambda g, x: [
        (g.op("ReduceSum", g.op("Softmax", x, axis=-1), g.const(AX), keepdims=1), (4, 1))])
    _, after, fused, _ = _group(m, host)
    assert _rules_of(after) == ["reduction_chain"]
    assert graph_stats(fused).kernels == 1


def test_sibling_contractions_fire(host):
    _, after, fused, _ = _group(M.qkv_projection(seq=8, hidden=16, weights_as_inputs=True), host)
    groups = groups_in(after)
    assert [(g["rule"], g["outputs"]) for g in groups] == [("sibling_contractions", 3)]
    assert graph_stats(fused).kernels == 1


def test_sibling_reductions_fire(host):
    m = _graph("sib_red", {"x": (4, 16)}, lambda g, x: [
        (g.op("ReduceMax", x, g.const(AX), keepdims=1), (4, 1)),
        (g.op("ReduceSum", x, g.const(AX), keepdims=1), (4, 1))])
    _, after, fused, _ = _group(m, host, MULTI_OUT)
    assert [(g["rule"], g["outputs"]) for g in groups_in(after)] == [("sibling_reductions", 2)]
    assert graph_stats(fused).kernels == 1
    # a target whose reduction schedules take one output refuses it (the target-support check)
    before, after, _, refused = _group(m, host, ONE_OUT_REDUCTIONS)
    C.assert_structural_equal(after, before)
    assert any("several outputs" in r["reason"] for r in _refused(refused, "sibling_reductions"))


def test_mean_variance_one_kernel_with_two_outputs_where_supported(host):
    _, after, fused, _ = _group(M.mean_variance(), host, MULTI_OUT)
    assert [g["outputs"] for g in groups_in(after)] == [2]
    assert graph_stats(fused).kernels == 1


def test_sibling_elementwise_fire(host):
    m = _graph("sib_ew", {"x": (4, 16)}, lambda g, x: [
        (g.op("Sigmoid", x), (4, 16)), (g.op("Tanh", x), (4, 16)), (g.op("Relu", x), (4, 16))])
    _, after, fused, _ = _group(m, host)
    assert [(g["rule"], g["outputs"]) for g in groups_in(after)] == [("sibling_elementwise", 3)]
    assert graph_stats(fused).kernels == 1



def _table_readers(table_shape):
    """q * T and k * T: two elementwise ops reading one constant T (the rotary cos/sin table of a static
    llama / qwen2 / phi build, read by the Q and by the K rotary)."""
    g = M._G("table_readers")
    q, k = g.input("q", (4, 16)), g.input("k", (4, 16))
    t = g.weight(table_shape, 1.0)
    g.op("Mul", q, t)
    g.rename_last("qt", (4, 16))
    g.op("Mul", k, t)
    g.rename_last("kt", (4, 16))
    return g.model()


def test_siblings_reading_one_constant_table(host, rng):
    """A constant of at least SHARED_TABLE_MIN_ELEMENTS elements (rank 2 or more) read by two elementwise ops
    makes them siblings as a tensor would (rules.shared_table): one kernel reading the table once."""
    model = _table_readers((4, 16))
    _, after, fused, _ = _group(model, host)
    assert [(g["rule"], g["outputs"]) for g in groups_in(after)] == [("sibling_elementwise", 2)]
    assert graph_stats(fused).kernels == 1
    cm = tvmfuse.compile(model, host)
    feeds = {"q": rng.standard_normal((4, 16)).astype(np.float32), "k": rng.standard_normal((4, 16)).astype(np.float32)}
    ref, got = M.reference_outputs(model, feeds), cm.run(feeds)
    for name, want in ref.items():
        np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-6)


def test_small_shared_constants_make_no_siblings(host):
    """expected = before: a bias-sized vector (16 elements) shared by two ops is no table worth a join."""
    model = _table_readers((16,))
    _, after, fused, _ = _group(model, host)
    assert groups_in(after) == [] and graph_stats(fused).kernels == 2


def test_intermediate_used_outside_stays_an_output(host):
    # h = relu(x + b) is also a graph output: it is written once, by the fused kernel, as its 2nd output
    m = _graph("two_uses", {"x": (4, 16), "b": (4, 16)}, lambda g, x, b: [
        (g.op("Relu", g.op("Add", x, b)), (4, 16)),
        (g.op("Sigmoid", "out_relu_2"), (4, 16))])
    _, after, fused, _ = _group(m, host)
    assert [g["outputs"] for g in groups_in(after)] == [2]
    assert graph_stats(fused).kernels == 1


# ----------------------------------------------------------------------------------- must not fire
def test_elementwise_chain_fires_on_symbolic_shapes(host):
    # symbolic extents are compared symbolically (tests/test_symbolic.py has the models)
    g = M._G("dyn")
    x = g.input("x", ("n", 8))
    g.op("Sigmoid", g.op("Relu", x))
    g.rename_last("y", ("n", 8))
    _, after, fused, refused = _group(g.model(), host)
    assert _rules_of(after) == ["elementwise_chain"] and graph_stats(fused).kernels == 1
    assert refused == []


def test_sibling_elementwise_fires_on_symbolic_shapes(host):
    g = M._G("dyn_sib")
    x = g.input("x", ("n", 8))
    g.op("Sigmoid", x)
    g.rename_last("a", ("n", 8))
    g.op("Tanh", x)
    g.rename_last("b", ("n", 8))
    _, after, fused, _ = _group(g.model(), host)
    assert _rules_of(after) == ["sibling_elementwise"] and graph_stats(fused).kernels == 1


def test_contraction_epilogue_refuses_a_second_unrelated_matmul(host):
    # y = x1 @ W1 + x2 @ W2: the add joins the first matmul; the second reads another input
    m = _graph("two_mm", {"x1": (8, 16), "x2": (8, 16)}, lambda g, x1, x2: [
        (g.op("Add", g.op("MatMul", x1, g.weight((16, 8))), g.op("MatMul", x2, g.weight((16, 8)))), (8, 8))])
    _, after, fused, refused = _group(m, host)
    assert len(groups_in(after)) == 1 and graph_stats(fused).kernels == 2
    r = _refused(refused, "contraction_epilogue")
    assert r and "do not read the same input" in r[0]["reason"]


def test_reduction_prologue_refused_after_matmul(host):
    # mean(x @ W + b): the row reduction stays out of the matmul kernel (and the bias add with it)
    m = _graph("mm_red", {"x": (8, 16)}, lambda g, x: [
        (g.op("ReduceMean", M._matmul_bias(g, x, 16, 8), g.const(AX), keepdims=1), (8, 1))])
    _, after, fused, refused = _group(m, host)
    assert graph_stats(fused).kernels == 2
    r = _refused(refused, "reduction_prologue")
    assert r and "row reduction" in r[0]["reason"]


def test_reduction_epilogue_refused_into_matmul_group(host):
    m = _graph("red_mm", {"x": (8, 16)}, lambda g, x: [
        (g.op("Add", g.op("MatMul", x, g.weight((16, 8))), g.op("ReduceMax", x, g.const(AX), keepdims=1)),
         (8, 8))])
    _, after, fused, refused = _group(m, host)
    assert graph_stats(fused).kernels == 2
    assert _refused(refused, "reduction_epilogue")


def test_reduction_chain_not_over_other_rows(host):
    # softmax over columns, then a sum over rows: two passes that cannot share a row loop
    m = _graph("chain_no", {"x": (4, 16)}, lambda g, x: [
        (g.op("ReduceSum", g.op("Softmax", x, axis=0), g.const(AX), keepdims=1), (4, 1))])
    before, after, _, refused = _group(m, host)
    C.assert_structural_equal(after, before)
    r = _refused(refused, "reduction_chain")
    assert r and "different rows" in r[0]["reason"]


def test_sibling_contractions_not_with_other_output_shapes(host):
    m = _graph("sib_mm_no", {"x": (8, 16)}, lambda g, x: [
        (g.op("MatMul", x, g.weight((16, 8))), (8, 8)), (g.op("MatMul", x, g.weight((16, 12))), (8, 12))])
    before, after, _, refused = _group(m, host)
    C.assert_structural_equal(after, before)
    assert any("different output shapes" in r["reason"] for r in _refused(refused, "sibling_contractions"))


def test_sibling_reductions_not_over_other_axes(host):
    m = _graph("sib_red_no", {"x": (4, 16)}, lambda g, x: [
        (g.op("ReduceSum", x, g.const(AX), keepdims=1), (4, 1)),
        (g.op("ReduceSum", x, g.const(np.array([0], np.int64)), keepdims=1), (1, 16))])
    before, after, _, refused = _group(m, host)
    C.assert_structural_equal(after, before)
    assert _refused(refused, "sibling_reductions")


def test_no_cycle_through_an_outside_consumer(host):
    # a = relu(x); m = a @ W; y = a + m.  Fusing relu with the add would need m inside, and m needs a.
    m = _graph("cycle", {"x": (8, 8)}, lambda g, x: [
        (g.op("Add", g.op("Relu", x), g.op("MatMul", "relu_1", g.weight((8, 8)))), (8, 8))])
    _, after, fused, refused = _group(m, host)
    assert any("leaves the group and comes back" in r["reason"] for r in refused)
    # the add went with the matmul (its epilogue); relu stays alone: 2 kernels, no cycle
    assert graph_stats(fused).kernels == 2
