"""The CUDA attention kernel (schedules/cuda/attention.py), without a GPU: it schedules the attention rule's
kernel on sm_80 and sm_90, the scores never in global memory (only registers), the query rows and the
K/V tiles staged in shared memory, one thread block per query block and one thread per query row,
TVM's GPU code verification passes, and nvcc compiles what tvm.compile generates.  Its numbers need a
GPU: benchmarks/gpu_check.py runs it there.
"""
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.pipeline import PipelineOptions, graph_stage
from tvmfuse.schedules import templates_for
from tvmfuse.schedules.base import find_template
from tvmfuse.schedules.cpu.attention import ATTR, AttentionSpec
from tvmfuse.schedules.cuda._common import ARCHS, verification_target, verify_gpu_schedule
from tvmfuse.schedules.cuda.attention import CudaAttention, shared_bytes

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not installed: CUDA sources are not compiled")
F = TensorProto.FLOAT


def cuda(arch="sm_90"):
    return C.Target({"kind": "cuda", "arch": arch}, host=tvmfuse.host_target())


def _chain(b=1, h=2, s=40, d=16, causal=False, mask=False):
    """softmax(Q K^T / sqrt(d) [+ causal constant | + mask input]) V on [b, h, s, d] tensors."""
    inits = [onnx.numpy_helper.from_array(np.array(np.float32(1 / np.sqrt(d))), "scale")]
    inputs = [("q", [b, h, s, d]), ("k", [b, h, s, d]), ("v", [b, h, s, d])]
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["qk"]),
             helper.make_node("Mul", ["qk", "scale"], ["x"])]
    logits = "x"
    if causal or mask:
        if causal:
            m = np.where(np.arange(s)[None] <= np.arange(s)[:, None], 0, -np.inf).astype(np.float32)
            inits.append(onnx.numpy_helper.from_array(m.reshape(1, 1, s, s), "mask"))
        else:
            inputs.append(("mask", [b, 1, s, s]))
        nodes.append(helper.make_node("Add", ["x", "mask"], ["xm"]))
        logits = "xm"
    nodes += [helper.make_node("Softmax", [logits], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v"], ["y"])]
    g = helper.make_graph(nodes, "attn", [helper.make_tensor_value_info(n, F, sh) for n, sh in inputs],
                          [helper.make_tensor_value_info("y", F, [b, h, s, d])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def _attention_kernel(model, target):
    mod = tvmfuse.load_onnx(model)
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions()))(mod)
    funcs = [f for f in mod.functions.values() if isinstance(f, C.PrimFunc) and ATTR in (f.attrs or {})]
    assert len(funcs) == 1, [str(gv.name_hint) for gv in mod.functions]
    return funcs[0]


def _blocks(func):
    found = []
    C.post_order_visit(func.body, lambda n: found.append(n) if isinstance(n, C.SBlock) else None)
    return found


def _allocs(func):
    return [(str(b.scope()), int(np.prod([int(x) for x in b.shape]))) for blk in _blocks(func) for b in blk.alloc_buffers]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(mask=True)], ids=["plain", "causal", "mask"])
def test_default_schedule_structure_and_gpu_verification(arch, kw):
    target = cuda(arch)
    s = 40
    func = _attention_kernel(_chain(s=s, **kw), target)
    template, match = find_template(func, target, templates_for(target))
    assert template.family == "cuda_attention"
    spec = match.info["spec"]
    config = template.default_config(match, target)
    assert template.space(match, target).contains(config)
    sch = C.Schedule(func)
    template.apply(sch, match, config)
    out = sch.mod["main"]
    text = out.script()
    # one thread block per query block, one thread per query row
    assert text.count('thread="blockIdx.x"') == 1 and text.count('thread="threadIdx.x"') == 1
    allocs = _allocs(out)
    rows, kb = config["rows"], config["k_block"]
    # shared: the query rows and the K and V tiles; everything else per thread (registers): no S x S
    # scores and no buffer outside the thread block
    assert sorted(n for scope, n in allocs if scope == "shared") == sorted([spec.d * rows, kb * spec.d, kb * spec.dv])
    assert {scope for scope, _ in allocs} == {"shared", "local"}
    assert all(n < s * s for _, n in allocs), allocs
    assert sum(n for scope, n in allocs if scope == "local") == kb + spec.dv + 4
    assert shared_bytes(spec, rows, kb) <= ARCHS[arch].max_shared_bytes
    assert verify_gpu_schedule(sch, verification_target(target))


def test_space_is_limited_by_shared_memory():
    """d = 128: 128 rows of Q alone take 64 KB (> 48 KB): not in the space; a pair of knobs the space
    holds but whose sum exceeds the shared memory fails verification; one within it passes."""
    target = cuda("sm_80")
    limit = ARCHS["sm_80"].max_shared_bytes
    func = _attention_kernel(_chain(s=300, d=128), target)
    t = CudaAttention()
    match = t.match(func, target)
    space = t.space(match, target)
    spec = match.info["spec"]
    rows, kbs = space.knobs[0].choices, space.knobs[1].choices
    assert rows == (32, 64) and kbs == (8, 16, 32)      # 64 keys: 64 KB of K/V tiles
    assert all(shared_bytes(spec, r, kbs[0]) <= limit for r in rows)
    too_big = {"rows": 64, "k_block": 32}              # 32 KB of Q + 32 KB of K/V tiles
    assert shared_bytes(spec, too_big["rows"], too_big["k_block"]) > limit
    sch = C.Schedule(func)
    t.apply(sch, match, too_big)
    assert not verify_gpu_schedule(sch, verification_target(target))
    default = t.default_config(match, target)
    assert shared_bytes(spec, default["rows"], default["k_block"]) <= limit
    small = {"rows": 64, "k_block": 8}                 # 32 KB of Q + 8 KB of K/V tiles
    assert space.contains(small)
    sch = C.Schedule(func)
    t.apply(sch, match, small)
    assert verify_gpu_schedule(sch, verification_target(target))


def test_template_refuses_a_kernel_without_the_spec():
    target = cuda()
    mod = tvmfuse.load_onnx(M.matmul_bias_gelu(m=32, k=32, n=32))
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions()))(mod)
    funcs = [f for f in mod.functions.values() if isinstance(f, C.PrimFunc)]
    assert funcs and all(CudaAttention().match(f, target) is None for f in funcs)


def test_spec_json_round_trips_through_the_cuda_kernel():
    func = _attention_kernel(_chain(causal=True), cuda())
    spec = AttentionSpec.from_json(str(func.attrs[ATTR]))
    assert spec.causal_offset == 0 and AttentionSpec.from_json(spec.to_json()) == spec


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_transformer_block_builds_with_one_attention_kernel_and_nvcc_compiles(arch):
    target = cuda(arch)
    cm = tvmfuse.compile(M.transformer_block(seq=32, hidden=32, heads=2, ffn=64), target=target)
    assert [g["rule"] for g in cm.report.groups].count("attention") == 1
    templates = [s["template"] for s in cm.report.schedules]
    assert templates.count("cuda_attention") == 1 and all(t.startswith("cuda_") for t in templates), templates
    src = C.cuda_device_source(cm.executable)
    assert "__shared__" in src and "__syncthreads" in src
    assert C.nvcc_compile(src, target)


def test_symbolic_kernel_is_refused_with_reason():
    """cuda_attention is built for static extents: over a symbolic batch/sequence the attention pass forms no
    kernel for cuda and says why (the same chain, static, is one kernel: test above)."""
    from tvmfuse.explain import Recorder
    from tvmfuse.passes.attention import FuseAttention

    target = cuda()
    mod = tvmfuse.load_onnx(_chain(b="batch", s="sequence", mask=True))
    with Recorder() as rec:
        out = FuseAttention(target)(mod)
    assert not any(isinstance(f, C.PrimFunc) for f in out.functions.values())
    reasons = [r["reason"] for r in rec.refused if r["rule"] == "attention"]
    assert any("no cuda template" in r and "symbolic extents (batch, sequence)" in r for r in reasons), reasons
    cpu = FuseAttention(tvmfuse.host_target())(mod)
    kernels = [f for f in cpu.functions.values() if isinstance(f, C.PrimFunc)]
    assert [str(f.attrs["tvmfuse.template"]) for f in kernels] == ["cpu.attention"]
