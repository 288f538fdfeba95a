"""The fusion rule ``sibling_copies`` (passes/rules.py, a ``horizontal`` rule): the copy/elementwise kernels that
each read an output of one kernel become one kernel (one loop nest per output, one call).

DeBERTa's self-attention: the Q, K and V projections are one sibling-matmul kernel with three outputs, and
each output is re-laid-out to heads (reshape [b, s, h, d] + transpose) by a copy kernel of its own; the
three copies are now one kernel.  Numerics: through ``tvmfuse.compile`` against onnx's reference on fresh
random inputs, static and symbolic (batch, sequence) at several sizes.  Structure (graph stage, named
AVX2 / AVX-512 targets): the kernels before and after, and the rule in the group's record.  Must not fire:
a reader that holds a reduction (a softmax), readers that are free views only (sequence 1: the head
transposes move a unit axis).  Also: two copies of one single-output matmul's result join.
"""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.explain import Recorder
from tvmfuse.passes import rules as R
from tvmfuse.passes.grouping import FuseGroups
from tvmfuse.pipeline import PipelineOptions, fuse_tir_passes, legalize_passes, pre_legalize_passes
from tvmfuse.report import graph_stats, groups_in

from conftest import NAMED_TARGETS, assert_close_to_reference

RULE = "sibling_copies"
TARGETS = ["haswell-2", "skx-2"]


def qkv_heads(batch=2, seq=5, hidden=64, heads=4, v_reader="heads", seed=0):
    """x [batch, seq, hidden] -> Q, K, V projections (one input: a sibling-matmul kernel) -> each reshaped
    to [batch, seq, heads, hidden / heads] and transposed to [batch, heads, seq, d] (graph outputs).
    ``v_reader``: "heads" (V like Q and K), "softmax" (V's reader a softmax over its last axis instead)."""
    rng = np.random.default_rng(seed)
    d = hidden // heads
    inits = [numpy_helper.from_array((rng.standard_normal((hidden, hidden)) * 0.1).astype(np.float32), f"W{n}")
             for n in "qkv"]
    inits.append(numpy_helper.from_array(np.array([0, 0, heads, d], np.int64), "heads_shape"))
    n = helper.make_node
    nodes, outs = [], []
    for name in "qkv":
        nodes.append(n("MatMul", ["x", f"W{name}"], [f"{name}_proj"]))
        if name == "v" and v_reader == "softmax":
            nodes.append(n("Softmax", ["v_proj"], ["v_out"], axis=-1))
            outs.append(helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [batch, seq, hidden]))
            continue
        nodes += [n("Reshape", [f"{name}_proj", "heads_shape"], [f"{name}_4d"]),
                  n("Transpose", [f"{name}_4d"], [f"{name}_out"], perm=[0, 2, 1, 3])]
        outs.append(helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [batch, heads, seq, d]))
    g = helper.make_graph(nodes, "qkv_heads",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, hidden])], outs, inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def matmul_two_copies(n=8, k=16, m=12):
    """x [2, n, k] @ W -> two different transposes of the one result, one scaled (graph outputs): a
    single-output kernel read by two copy kernels (no sibling rule joins two injective readers of one
    tensor)."""
    rng = np.random.default_rng(0)
    nd = helper.make_node
    inits = [numpy_helper.from_array(rng.standard_normal((k, m)).astype(np.float32), "W"),
             numpy_helper.from_array(np.array(0.5, np.float32), "half")]
    nodes = [nd("MatMul", ["x", "W"], ["y"]), nd("Transpose", ["y"], ["a"], perm=[0, 2, 1]),
             nd("Transpose", ["y"], ["t"], perm=[1, 0, 2]), nd("Mul", ["t", "half"], ["b"])]
    outs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, m, n]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [n, 2, m])]
    g = helper.make_graph(nodes, "two_copies",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, n, k])], outs, inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _group(model, target, rules=None):
    """(groups formed, kernels after FuseTIR, refusals) of ``model`` on ``target``; ``rules``: the rule table
    to use (default: tvmfuse's)."""
    mod = tvmfuse.load_onnx(model)
    real = R.RULES
    if rules is not None:
        R.RULES = rules
    try:
        with target:
            before = C.Sequential(pre_legalize_passes(target, PipelineOptions()) + legalize_passes(target))(mod)
            with Recorder() as rec:
                after = FuseGroups(target)(before)
            fused = C.Sequential(fuse_tir_passes(target, PipelineOptions()))(after)
    finally:
        R.RULES = real
    return groups_in(after), graph_stats(fused).kernels, rec.refused


def _without_rule():
    return tuple(r for r in R.RULES if r.name != RULE)


# ----------------------------------------------------------------------------------------------- fires
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("batch,seq", [(2, 5), ("batch", "sequence")], ids=["static", "symbolic"])
def test_head_copies_of_qkv_join(target, batch, seq):
    t = C.Target(NAMED_TARGETS[target])
    model = qkv_heads(batch=batch, seq=seq)
    groups, kernels, _ = _group(model, t)
    _, kernels_before, _ = _group(model, t, _without_rule())
    assert (kernels_before, kernels) == (4, 2)
    copies = [g for g in groups if RULE in g["rule"]]
    assert len(copies) == 1 and copies[0]["outputs"] == 3, groups
    assert copies[0]["ops"].count("transpose") == 3


def test_rule_row():
    rule = R.RULES_BY_NAME[RULE]
    assert rule.kind == "horizontal" and rule.template == "elementwise" and "test_fusion_rules_sibling_copies" in rule.why
    mm = R.NodeInfo("matmul", R.CONTRACTION, 4)
    t = R.NodeInfo("transpose", R.INJECTIVE, 2)
    assert R.check_sibling_copies([t, t]) is None
    assert "copy and elementwise kernels only" in R.check_sibling_copies([t, mm])


@pytest.mark.parametrize("target", TARGETS)
def test_two_copies_of_one_result_join(target):
    t = C.Target(NAMED_TARGETS[target])
    model = matmul_two_copies()
    groups, kernels, _ = _group(model, t)
    _, kernels_before, _ = _group(model, t, _without_rule())
    assert (kernels_before, kernels) == (3, 2)
    assert [g["outputs"] for g in groups if RULE in g["rule"]] == [2]


def test_two_copies_numerics(host, rng):
    model = matmul_two_copies()
    cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 2
    assert_close_to_reference(model, cm, rng)


@pytest.mark.parametrize("batch,seq,sizes", [(2, 5, [(2, 5)]), ("batch", "sequence", [(1, 1), (3, 17), (2, 4)])],
                         ids=["static", "symbolic"])
def test_numerics_vs_reference(batch, seq, sizes, host, rng):
    model = qkv_heads(batch=batch, seq=seq, seed=int(rng.integers(2**31)))
    cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 2
    for b, s in sizes:
        feeds = {"x": rng.standard_normal((b, s, 64)).astype(np.float32)}
        ref = M.reference_outputs(model, feeds)
        out = cm.run(feeds)
        for name, r in ref.items():
            np.testing.assert_allclose(out[name], r, rtol=1e-5, atol=1e-5, err_msg=f"{name} at {b}x{s}")


# ------------------------------------------------------------------------------------------- must not fire
@pytest.mark.parametrize("target", TARGETS)
def test_a_softmax_reader_keeps_its_kernel(target):
    """V read by a softmax: the Q and K copies join, the softmax (a row reduction) keeps its own kernel."""
    t = C.Target(NAMED_TARGETS[target])
    groups, kernels, _ = _group(qkv_heads(v_reader="softmax"), t)
    copies = [g for g in groups if RULE in g["rule"]]
    assert len(copies) == 1 and copies[0]["outputs"] == 2 and "softmax" not in copies[0]["ops"]
    assert kernels == 3          # Q/K/V matmuls, the two head copies, the softmax


@pytest.mark.parametrize("target", TARGETS)
def test_free_views_do_not_join(target):
    """Sequence 1: each head transpose moves a unit axis (a free view, no kernel); joined they would be a
    copy kernel.  expected = before."""
    t = C.Target(NAMED_TARGETS[target])
    model = qkv_heads(batch=1, seq=1)
    groups, kernels, _ = _group(model, t)
    groups_before, kernels_before, _ = _group(model, t, _without_rule())
    assert not [g for g in groups if RULE in g["rule"]]
    assert (groups, kernels) == (groups_before, kernels_before)
