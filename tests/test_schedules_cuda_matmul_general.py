"""CUDA matmul family on the layouts real exports produce (no GPU needed: structure and TVM's GPU code
verification): [B, S, K] @ a shared weight, true batched and broadcast-batch matmuls, Q @ K^T, Gemm
transB with alpha/beta, GEMV, and Q/K/V / SwiGLU siblings over 3-D activations are scheduled by the CUDA
templates (not dlight's fallback), with every kernel passing verification on sm_80 and sm_90."""
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cuda._common import verification_target, verify_gpu_schedule

import schedule_cases as S

CASES = [("matmul_3d", "cuda_matmul"), ("batched_matmul", "cuda_matmul"), ("broadcast_matmul", "cuda_matmul"),
         ("scores_matmul", "cuda_matmul"), ("gemm_transb", "cuda_matmul"), ("gemv", "cuda_matmul"),
         ("qkv_3d", "cuda_siblings"), ("swiglu_3d", "cuda_siblings")]


def cuda(arch):
    return C.Target({"kind": "cuda", "arch": arch}, host=tvmfuse.host_target())


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("builder,family", CASES, ids=[c[0] for c in CASES])
def test_cuda_matmul_layouts_matched_and_verified(builder, family, arch):
    target = cuda(arch)
    found = []
    for name, func in S.graph_funcs(getattr(S, builder)(), target).items():
        res = schedule_prim_func(func, target, {}, name)
        assert res is not None, f"{name}: no CUDA template matched"
        assert verify_gpu_schedule(C.Schedule(res.func), verification_target(target)), \
            f"{name} ({res.template}) on {arch}: GPU code verification failed"
        found.append(res.template)
    assert family in found, found
