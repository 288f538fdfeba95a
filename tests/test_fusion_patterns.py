"""Each fusion pattern of issue #3 ends in ONE kernel, and computes what onnx's reference computes.

Tolerances: float32, rtol 1e-5 with atol 1e-5 where the fused kernel evaluates the same ops in the same
order as the reference (elementwise, reductions: FuseTIR keeps each op's loop order).  Two cases change the
order of the math and get rtol 1e-4: batch-norm folding (the scale is multiplied into the conv weights
before the accumulation, not after it) and MatMul/Conv accumulations of 64-144 products, whose
summation order differs from numpy's pairwise/BLAS order.  Division by a constant becomes a multiply by
its reciprocal (1 ulp per op), inside rtol 1e-5.

These tests compile with ``schedules=False``: they check the fusion stage (groups, FuseTIR, numerics);
the schedules stage is tested in its own files.
"""
import pytest

import tvmfuse
from tvmfuse import models as M

from conftest import assert_close_to_reference

FUSION_ONLY = dict(schedules=False)

# pattern -> (builder kwargs, stock TVM kernels (measured, FuseOps), rtol)
PATTERNS = {
    "elementwise_chain": ({}, 1, 1e-5),
    "matmul_bias_gelu": ({}, 1, 1e-4),
    "conv_bn_relu_residual": ({}, 2, 1e-4),
    "layernorm_decomposed": ({}, 3, 1e-5),
    "softmax_decomposed": ({}, 4, 1e-5),
    "layernorm_softmax": ({}, 7, 1e-5),
    "mean_variance": ({}, 3, 1e-5),
    "qkv_projection": ({}, 3, 1e-4),
    "swiglu": ({}, 2, 1e-4),
    "rmsnorm": ({}, 2, 1e-5),
    "instancenorm_silu": ({}, 2, 1e-5),
}


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pattern_is_one_kernel(name, rng, host):
    kwargs, _stock, rtol = PATTERNS[name]
    model = M.PATTERN_MODELS[name](**kwargs)
    cm = tvmfuse.compile(model, host, **FUSION_ONLY)
    assert cm.kernel_count == 1, (name, cm.report.after.kernel_names, cm.report.refused)
    assert cm.report.groups and all(g["rule"] != "fuse_ops" for g in cm.report.groups)
    assert_close_to_reference(model, cm, rng, rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("builder,kwargs", [
    (M.qkv_projection, {"weights_as_inputs": True}),
    (M.conv_bn_relu_residual, {"depthwise": True}),
    (M.matmul_bias_gelu, {"form": "tanh"}),
    (M.matmul_bias_act, {"act": "SiLU"}),
    (M.gemm_bias_relu, {}),
    (M.layernorm, {"decomposed": False}),
    (M.softmax, {"decomposed": False}),
])
def test_pattern_variants_are_one_kernel(builder, kwargs, rng, host):
    model = builder(**kwargs)
    cm = tvmfuse.compile(model, host, **FUSION_ONLY)
    assert cm.kernel_count == 1, (builder.__name__, kwargs, cm.report.after.kernel_names)
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-5)


def test_stock_tvm_leaves_more_kernels(host):
    """The before column of the issue's note: TVM's FuseOps on the same graphs (30 kernels in all)."""
    stock = {name: tvmfuse.compile(M.PATTERN_MODELS[name](), host, fusion=False, **FUSION_ONLY).kernel_count
             for name in PATTERNS}
    assert stock == {name: PATTERNS[name][1] for name in PATTERNS}
    assert sum(stock.values()) == 30


def test_multi_output_groups(host):
    """Q/K/V: one kernel with three outputs, no intermediate left."""
    cm = tvmfuse.compile(M.qkv_projection(), host, **FUSION_ONLY)
    assert [g["outputs"] for g in cm.report.groups] == [3]
    assert cm.report.after.intermediates == 0


def test_mean_variance_one_pass_two_outputs(host):
    """Mean and variance: one kernel with two outputs (the sibling reductions share the input loop)."""
    cm = tvmfuse.compile(M.mean_variance(), host, **FUSION_ONLY)
    assert cm.kernel_count == 1
    assert [g["outputs"] for g in cm.report.groups] == [2]
