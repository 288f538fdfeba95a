"""CUDA schedule templates, without a GPU: which template matches each fused kernel, the structure of
what it builds (thread bindings, shared-memory stages, cross-thread reductions, vector loads), TVM's GPU
code verification (threads per block, shared memory), and nvcc accepting the generated CUDA."""
import random
import shutil

import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.pipeline import PipelineOptions, graph_stage
from tvmfuse.schedules import templates_for
from tvmfuse.schedules.base import find_template, schedule_with
from tvmfuse.schedules.cuda import TEMPLATES
from tvmfuse.schedules.cuda._common import ARCHS, arch_of, verification_target

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not installed: CUDA sources are not compiled")


def cuda(arch="sm_90"):
    return C.Target({"kind": "cuda", "arch": arch}, host=tvmfuse.host_target())


def fused_funcs(model, target):
    mod = tvmfuse.load_onnx(model)
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions()))(mod)
    return {str(gv.name_hint): f for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)}


# one small model per family, and the template that must schedule its anchor kernel
FAMILY_CASES = {
    "cuda_matmul": lambda: M.matmul_bias_gelu(m=64, k=96, n=128),
    "cuda_conv2d": lambda: M.conv_bn_relu_residual(channels=16, size=14),
    "cuda_row_reduction": lambda: M.layernorm_softmax(rows=32, d=96),
    "cuda_elementwise": lambda: M.elementwise_chain(n=4096),
    "cuda_siblings": lambda: M.qkv_projection(seq=32, hidden=64),
}


def family_kernel(family, target):
    """The fused kernel of the family's model that the family's template matches (asserts one exists)."""
    funcs = fused_funcs(FAMILY_CASES[family](), target)
    for name, f in funcs.items():
        found = find_template(f, target, templates_for(target))
        if found is not None and found[0].family == family:
            return name, f, found
    got = {n: (find_template(f, target, templates_for(target)) or (None,))[0] for n, f in funcs.items()}
    raise AssertionError(f"{family}: no kernel matched; templates per kernel: "
                         f"{ {n: getattr(t, 'family', None) for n, t in got.items()} }")


def test_templates_gated_on_cuda_and_ordered():
    assert [t.family for t in TEMPLATES] == ["cuda_siblings", "cuda_matmul", "cuda_conv2d",
                                             "cuda_row_reduction", "cuda_elementwise"]
    assert all(t.target_kinds == ("cuda",) for t in TEMPLATES)
    assert templates_for(cuda()) == TEMPLATES
    host_families = {t.family for t in templates_for(tvmfuse.host_target())}
    assert not host_families & {t.family for t in TEMPLATES}


def test_arch_numbers_per_target():
    assert arch_of(cuda("sm_80")) is ARCHS["sm_80"] and arch_of(cuda("sm_90")) is ARCHS["sm_90"]
    assert arch_of(cuda("sm_89")) is ARCHS["sm_80"]      # newest known arch not newer than the target
    assert arch_of(cuda("sm_100")) is ARCHS["sm_90"]
    assert ARCHS["sm_90"].mm_tile_k != ARCHS["sm_80"].mm_tile_k


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("family", list(FAMILY_CASES))
def test_family_default_schedule_structure_and_gpu_verification(family, arch):
    target = cuda(arch)
    _, func, (template, match) = family_kernel(family, target)
    space = template.space(match, target)
    config = template.default_config(match, target)
    assert space.contains(config), (config, space.to_dict())
    sch = C.Schedule(func)
    template.apply(sch, match, config)
    text = sch.mod.script()
    assert 'thread="blockIdx.' in text and 'thread="threadIdx.x"' in text
    if family in ("cuda_matmul", "cuda_conv2d", "cuda_siblings"):
        assert '"shared"' in text and '"local"' in text          # staged operands, register tiles
    if family == "cuda_row_reduction":
        # the reduction loop itself is bound to threadIdx.x: TVM lowers it to a cross-thread allreduce
        assert "T.axis.reduce" in text and '"shared"' in text
    if family in ("cuda_elementwise", "cuda_matmul"):
        assert "T.vectorized" in text
    assert C.verify_gpu_schedule(sch, verification_target(target)), f"{family} on {arch}: GPU code verification failed"


@pytest.mark.parametrize("family", list(FAMILY_CASES))
def test_sampled_configs_are_legal(family):
    """The tuner may pick any point of the space: a few random ones must schedule and verify."""
    target = cuda("sm_90")
    _, func, (template, match) = family_kernel(family, target)
    space = template.space(match, target)
    rng = random.Random(7)
    for config in [space.sample(rng) for _ in range(3)]:
        assert space.contains(config)
        sch = C.Schedule(func)
        template.apply(sch, match, config)
        assert C.verify_gpu_schedule(sch, verification_target(target)), (family, config)


def test_row_reduction_refuses_a_matmul_and_matmul_refuses_a_norm():
    target = cuda()
    rr = next(t for t in TEMPLATES if t.family == "cuda_row_reduction")
    mm = next(t for t in TEMPLATES if t.family == "cuda_matmul")
    _, mm_func, _ = family_kernel("cuda_matmul", target)
    _, rr_func, _ = family_kernel("cuda_row_reduction", target)
    assert rr.match(mm_func, target) is None
    assert mm.match(rr_func, target) is None


BUILD_CASES = {**{f"pattern:{k}": v for k, v in M.PATTERN_MODELS.items()},
               **{"demo:transformer_block": lambda: M.transformer_block(seq=32, hidden=64, heads=2, ffn=128),
                  "demo:resnet_block": lambda: M.resnet_block(channels=16, size=14)}}


# kernels no CUDA template takes yet (TVM's dlight fallback schedules them, and says so):
FALLBACK_CASES = {
    "pattern:mean_variance",   # two outputs, one read by the other: no compute_at of an output block
    "pattern:swiglu",          # two matmul anchors joined by one epilogue (gate * up)
}


@needs_nvcc
@pytest.mark.parametrize("case", list(BUILD_CASES))
def test_models_build_for_cuda_and_nvcc_compiles(case):
    """tvm.compile for cuda (sm_90) succeeds, the tvmfuse templates schedule the kernels, and nvcc
    compiles the generated CUDA source."""
    target = cuda("sm_90")
    model = BUILD_CASES[case]()
    cm = tvmfuse.compile(model, target=target)
    scheds = cm.report.schedules
    assert scheds, "no kernel was scheduled"
    failed = [s for s in scheds if "template error" in s.get("reason", "")]
    assert not failed, failed
    ours = [s for s in scheds if s["template"].startswith("cuda_")]
    if case in FALLBACK_CASES:
        assert any(s["reason"] == "no template matches this kernel" for s in scheds), scheds
    else:
        assert ours, scheds
    src = C.cuda_device_source(cm.executable)
    assert "__global__" in src
    assert C.nvcc_compile(src, target)


@needs_nvcc
def test_demo_builds_for_sm80():
    target = cuda("sm_80")
    cm = tvmfuse.compile(M.transformer_block(seq=32, hidden=64, heads=2, ffn=128), target=target)
    src = C.cuda_device_source(cm.executable)
    assert "float4" in src and "__shared__" in src and "__shfl" in src
    assert C.nvcc_compile(src, target)


def test_gpu_check_dry_run(capsys):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.main(["--dry-run", "--only", "elementwise_chain,layernorm_decomposed"])
    assert [r["model"] for r in rows] == ["elementwise_chain", "layernorm_decomposed"]
    assert all(r["built"] for r in rows)
    assert "elementwise_chain" in capsys.readouterr().out
