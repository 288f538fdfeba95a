"""``tvmfuse.dlight_pipeline``: TVM's untuned route (its own fusion, kernels scheduled by dlight's rules for
the target), the TVM baseline of ``tvmfuse demo`` and of the benchmarks' tvm_dlight engines.

Structure on named targets: TVM's fusion unchanged (the kernel count of ``stock_pipeline``), dlight's CPU rules
scheduling the kernels they match (a GEMV, a row reduction) and leaving a conv's loop nest as TVM wrote it.
Numbers: on this host, fresh random inputs, against onnx's ReferenceEvaluator."""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.pipeline import PipelineOptions, Stages, dlight_rules

from conftest import named_target

CASES = {   # name: (model, whether dlight's CPU rules schedule its main kernel)
    "gemv": (lambda: M.matmul_bias_gelu(m=1, k=64, n=96), True),           # cpu.GEMV
    "softmax_rows": (lambda: M.softmax(rows=8, d=100, decomposed=False), True),   # cpu.Reduction
    "conv": (lambda: M.conv_bn_relu_residual(channels=8, size=6), False),  # neither: TVM's loop nest
}


def _primfuncs(model, target, dlight: bool) -> dict:
    stages = Stages(target, PipelineOptions(fusion=False, schedules=False, fast_math=False))
    passes = stages.graph() + (stages.dlight() if dlight else [])
    with stages.target:
        mod = C.Sequential(passes)(tvmfuse.load_onnx(model))
    return {str(gv.name_hint): f for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)}


def _scheduled(func) -> bool:
    return func.attrs is not None and "tirx.is_scheduled" in func.attrs and bool(func.attrs["tirx.is_scheduled"])


@pytest.mark.parametrize("tname", ["haswell-2", "skx-2"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_dlight_schedules_what_its_cpu_rules_match_and_keeps_tvm_fusion(case, tname):
    build, matched = CASES[case]
    target = named_target(tname)
    stock = _primfuncs(build(), target, dlight=False)
    funcs = _primfuncs(build(), target, dlight=True)
    assert sorted(funcs) == sorted(stock)                        # TVM's FuseOps kernels, no other fusion
    main = max(funcs, key=lambda n: len(str(funcs[n])))         # the matmul / softmax / conv kernel
    assert _scheduled(funcs[main]) == matched, (case, main)
    assert not any(_scheduled(f) for f in stock.values())       # the schedule comes from the dlight stage
    if not matched:                                             # a kernel no rule matches: TVM's own loops
        assert C.structural_equal(funcs[main], stock[main])


def test_dlight_rules_per_target_family():
    cpu = dlight_rules(named_target("skx-2"))
    assert [type(r).__name__ for r in cpu] == ["GEMV", "Reduction"]
    gpu = dlight_rules(tvmfuse.parse_target("cuda -arch=sm_80"))
    assert [type(r).__name__ for r in gpu][-1] == "Fallback" and "Matmul" in [type(r).__name__ for r in gpu]


@pytest.mark.parametrize("case", sorted(CASES))
def test_dlight_build_computes_the_reference(case, host, rng):
    model = CASES[case][0]()
    feeds = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in M.random_feeds(model).items()}
    ref = M.reference_outputs(model, feeds)
    ex = C.compile_module(tvmfuse.load_onnx(model), host, tvmfuse.dlight_pipeline(host))
    vm = C.VirtualMachine(ex, C.cpu())
    out = vm["main"](*[C.tensor(v) for v in feeds.values()])
    got = out.numpy() if hasattr(out, "numpy") else out[0].numpy()
    (want,) = ref.values()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
