"""CUDA templates' numbers without a GPU, and the two checks that stand in for the GPU's.

The first GPU run of tvmfuse's CUDA kernels (H200, 2026-12-04, ``benchmarks/notes/gpu22.md``) found two
template bugs that every CPU-side test had passed:
- ``cuda_siblings`` stored the first anchors' accumulators ahead of the merged k loop (merging moves the
  merged loops to the last anchor's place): qkv_projection's q and k were never written;
- ``cuda_conv2d`` computed the padded input window under the thread loops before putting it in shared
  memory: the window was sized per thread, then loaded cooperatively, so after lowering (the outer and
  inner thread loops are one thread index) each thread loaded one element of its own window.

Each family's kernel here runs as the CUDA code TVM generates for it, on the CPU (``cuda_emulator``: g++
and one OS thread per CUDA thread, shared memory poisoned between blocks, outputs NaN-filled), against the
unscheduled kernel on fresh random inputs; both bugs fail that (the tests below put each back). Two
structural checks in ``lowering_error`` name the bug classes in every build, GPU or not:
``fallback.stale_thread_index`` (the conv bug: a block indexed by a thread loop that a loop inside binds
again) and ``fallback.scratch_read_before_write`` (the siblings bug); a template schedule that fails one
goes to the fallback with the reason in the report.
"""
import importlib.util
import os

import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.schedules.cuda import _common as CC
from tvmfuse.schedules.cuda import conv2d as CONV
from tvmfuse.schedules.cuda import fallback as F

import cuda_emulator as E
from test_schedules_cuda import FAMILY_CASES, cuda, family_kernel, fused_funcs
from tvmfuse.schedules import templates_for
from tvmfuse.schedules.base import find_template
from test_schedules_cuda_fallback import run_on_cpu

needs_gxx = pytest.mark.skipif(not E.available(), reason="g++ not installed: no CUDA emulation")


def _attention(causal: bool):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "bench_attention.py")
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.attention_model(24, 2, 16, causal)

# cases beyond FAMILY_CASES: the shapes the GPU run found wrong (rows of 56 at a row-aligned pixel tile;
# sibling matmuls with a bias each, as a transformer's Q/K/V)
EXTRA_CASES = {
    "cuda_conv2d@56": ("cuda_conv2d", lambda: M.conv_bn_relu_residual(channels=16, size=56)),
    # a 1 x 1 map (squeeze-excite's convs: idle pixel threads stored over the one output) and maps whose
    # rows no thread count of the space was aligned to (the window failed to stage)
    "cuda_conv2d@1": ("cuda_conv2d", lambda: M.conv_bn_relu_residual(channels=16, size=1)),
    "cuda_conv2d@3": ("cuda_conv2d", lambda: M.conv_bn_relu_residual(channels=16, size=3)),
    "cuda_conv2d@7": ("cuda_conv2d", lambda: M.conv_bn_relu_residual(channels=16, size=7)),
    "cuda_depthwise_conv2d@1": ("cuda_depthwise_conv2d",
                                lambda: M.conv_bn_relu_residual(channels=16, size=1, depthwise=True)),
    "cuda_siblings+bias": ("cuda_siblings", lambda: M.transformer_block(seq=16, hidden=32, heads=2, ffn=64)),
    "cuda_siblings+joint": ("cuda_siblings", lambda: M.swiglu(seq=32, hidden=64, ffn=96)),
    "cuda_attention": ("cuda_attention", lambda: _attention(False)),
    "cuda_attention+causal": ("cuda_attention", lambda: _attention(True)),
}
CASES = {**{f: (f, build) for f, build in FAMILY_CASES.items()}, **EXTRA_CASES}


def scheduled_case(case, target):
    """(unscheduled kernel, the family template's default schedule of it) of the case's model."""
    family, build = CASES[case]
    found = [(f, t) for f in fused_funcs(build(), target).values()
             for t in [find_template(f, target, templates_for(target))] if t is not None and t[0].family == family]
    assert found, f"{case}: no kernel matched by {family}"
    func, (template, match) = found[0]
    sch = C.Schedule(func)
    template.apply(sch, match, template.default_config(match, target))
    return func, sch.mod["main"]


def assert_emulates_the_unscheduled(func, scheduled, target, rng, order="parallel"):
    n_in = _n_inputs(func)
    shapes = [[int(d) for d in p.shape] for p in func.params]
    ins = [rng.standard_normal(s).astype(str(p.dtype)) for s, p in zip(shapes[:n_in], func.params)]
    want = run_on_cpu(func, ins, shapes[n_in:])
    got = E.emulate(scheduled, target, ins, order=order)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * max(1.0, float(np.max(np.abs(w)))))


@needs_gxx
@pytest.mark.parametrize("case", sorted(CASES))
def test_family_kernel_computes_the_unscheduled_and_passes_the_checks(case, rng):
    """Each kernel twice from one compile: the block's threads running together, then one thread at a
    time in descending order (a read that no barrier separates from a lower thread's write then sees the
    poisoned value). sm_90's build; sm_80's differs in tile sizes only (test_schedules_cuda.py)."""
    target = cuda("sm_90")
    func, out = scheduled_case(case, target)
    assert F.lowering_error(out, target) is None
    assert F.scratch_read_before_write(out) is None and F.stale_thread_index(out) is None
    for order in ("parallel", "descending"):
        assert_emulates_the_unscheduled(func, out, target, rng, order=order)


def _n_inputs(func) -> int:
    """Parameters the kernel reads but never writes (its outputs come last)."""
    written = set()

    def visit(node):
        if isinstance(node, C.SBlock):
            written.update(C.region_tensor(w) for w in node.writes)
    C.post_order_visit(func.body, visit)
    return sum(1 for p in func.params if p not in written)


def test_conv_window_staged_before_shared_is_refused(monkeypatch):
    """The conv bug, put back: the padded window computed under the thread loops while still global,
    then moved to shared memory. The template's result is refused with the reason (and it would fail on
    a GPU: the GPU run's conv_bn_relu_residual rel. error 0.66)."""
    def old_stage_window(sch, anchor, pad, operand, at):
        data = sch.get_sblock(pad)
        sch.compute_at(data, at, preserve_unit_loops=True)
        sch.set_scope(data, 0, "shared")
        return data

    monkeypatch.setattr(CONV, "stage_window", old_stage_window)
    target = cuda("sm_90")
    func, out = scheduled_case("cuda_conv2d@56", target)
    if E.available():      # the numbers are wrong, as on the GPU
        with pytest.raises(AssertionError):
            assert_emulates_the_unscheduled(func, out, target, np.random.default_rng(0))
    why = F.lowering_error(out, target)
    assert why is not None and "a thread loop that a loop inside it binds again" in why, why
    cm = tvmfuse.compile(M.conv_bn_relu_residual(channels=16, size=56), target=target)
    (rec,) = cm.report.schedules
    assert rec["template"] == "fallback" and "binds again" in str(cm.report.to_dict()), rec


def test_sibling_stores_ahead_of_the_k_loop_are_refused(rng):
    """The siblings bug, put back by hand: each anchor's register store placed under its own thread loop
    before the nests are merged ends up ahead of the merged k loop."""
    target = cuda("sm_90")
    _name, func, (template, match) = family_kernel("cuda_siblings", target)
    sch = C.Schedule(func)
    anchors = match.info["anchors"]
    knobs = template.default_config(match, target)
    nests = {a: CC.tile_contraction(sch, sch.get_sblock(a), match.info["batch"], knobs["threads_m"],
                                 knobs["threads_n"], knobs["micro_m"], knobs["micro_n"], knobs["tile_k"])
             for a in anchors}
    for a in anchors:
        CC.store_in_registers(sch, sch.get_sblock(a), nests[a][4])
    merged = [sch.merge(*[nests[a][d] for a in anchors]) for d in range(6)]
    CC.bind_tile(sch, *merged[:5])
    for a in anchors:
        sch.decompose_reduction(sch.get_sblock(a), merged[5])
    why = F.scratch_read_before_write(sch.mod["main"])
    assert why is not None and "before any block writes it" in why, why
    if E.available():      # q and k wrong, v right: as on the GPU
        n_in = _n_inputs(func)
        shapes = [[int(d) for d in p.shape] for p in func.params]
        ins = [rng.standard_normal(s).astype("float32") for s in shapes[:n_in]]
        want = run_on_cpu(func, ins, shapes[n_in:])
        got = E.emulate(sch.mod["main"], target, ins)
        close = [bool(np.allclose(g, w, rtol=1e-4, atol=1e-4)) for g, w in zip(got, want)]
        assert close == [False] * (len(close) - 1) + [True], close


def test_checks_pass_every_fallback_schedule(rng):
    """dlight's rules and the serial schedule go through the same checks: none of theirs is refused."""
    target = cuda("sm_90")
    cm = tvmfuse.compile(M.transformer_block(seq=16, hidden=32, heads=2, ffn=64), target=target,
                         schedules=False)
    assert cm.report.schedules == [] or all(s["template"] == "fallback" for s in cm.report.schedules)
    assert "does not lower" not in str(cm.report.to_dict())


# --------------------------------------------------------------------------- whole models
def _model_reference(model, feeds):
    return list(tvmfuse.compile(model).run(feeds).values())


@needs_gxx
@pytest.mark.parametrize("name", ["layernorm_pow", "transformer_block", "resnet_block"])
def test_cuda_build_of_a_model_emulates_its_cpu_build(name, rng):
    """A whole CUDA build run on the CPU (every call_tir of the fused module emulated, as the build
    schedules it) against the CPU build, on fresh random inputs: the demo models, which were NaN on the
    GPU, and a LayerNorm written with Pow(x - mean, 2), which was NaN there under nvcc's fast-math powf."""
    model = {"layernorm_pow": lambda: M.norm_matmul(rows=16, d=32, n=24, norm="layernorm_decomposed"),
             "transformer_block": lambda: M.transformer_block(seq=16, hidden=32, heads=2, ffn=64),
             "resnet_block": lambda: M.resnet_block(channels=8, size=10)}[name]()
    feeds = M.random_feeds(model, seed=int(rng.integers(1 << 30)))
    cm = tvmfuse.compile(model, target=cuda("sm_90"))
    for got, want in zip(E.emulate_model(cm, feeds), _model_reference(model, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, float(np.max(np.abs(want)))))


@needs_gxx
def test_integer_pow_without_the_peephole_is_nan_under_fast_math(monkeypatch, rng):
    """The emulator computes powf as nvcc's --use_fast_math does (exp2(y log2 x)): with the integer_power
    peephole off, the LayerNorm's Pow(x - mean, 2) turns NaN, as GPT-2's x^3 did on the H200."""
    import tvmfuse.passes.rewrites as RW

    monkeypatch.setitem(RW._PEEPHOLE_BY_OP, "relax.power", [])
    model = M.norm_matmul(rows=16, d=32, n=24, norm="layernorm_decomposed")
    feeds = M.random_feeds(model, seed=int(rng.integers(1 << 30)))
    (got,) = E.emulate_model(tvmfuse.compile(model, target=cuda("sm_90")), feeds)
    assert np.isnan(got).any()
