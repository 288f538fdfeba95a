"""Issue 12, without a GPU: every kernel of a CUDA build is scheduled and lowers.

- the last resort (``schedules/cuda/fallback.py``) on awkward kernels: a reduction over the first axis,
  extents no thread count divides, several outputs, a symbolic extent, a 0-d buffer: dlight's first rule
  whose schedule lowers, else one thread per root block; both lower and nvcc compiles them for sm_80;
- a rule that raises or whose schedule does not lower is passed over, and a template schedule that does not
  lower goes to the fallback with the reason (the build never fails on a schedule);
- ``cuda_row_reduction`` on ConvNeXt's norms: an output that enumerates the rows transposed (NCHW from
  sums over (n, h, w)) and one that enumerates a single row by no loop at all; GPT-2's, whose residual
  sum is an output the reductions read.

Numbers without a GPU: a scheduled CUDA kernel's loop nest runs on the CPU with its thread bindings as
serial loops (``on_cpu``), against the unscheduled kernel on fresh random inputs.  That checks what each
thread computes and that the nest covers every element; not the cross-thread synchronization.
"""
import re
import shutil

import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import schedules as SCH
from tvmfuse.explain import Recorder
from tvmfuse.schedules.base import Match, Template, find_template
from tvmfuse.schedules.cuda import fallback as F
from tvmfuse.schedules.cuda._common import verification_target, verify_gpu_schedule

import schedule_cases as S

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not installed: CUDA sources are not compiled")
T = C.script_tir


def cuda(arch="sm_80"):
    return C.Target({"kind": "cuda", "arch": arch}, host=tvmfuse.host_target())


# --------------------------------------------------------------------------- awkward kernels
@T.prim_func(private=True, s_tir=True)
def column_sum(a: T.Buffer((37, 45), "float32"), out: T.Buffer((45,), "float32")):
    """A reduction over the first axis (the output is the transposed row), 37 x 45: no warp divides."""
    for j, i in T.grid(45, 37):
        with T.sblock("colsum"):
            vj, vi = T.axis.remap("SR", [j, i])
            with T.init():
                out[vj] = T.float32(0)
            out[vj] = out[vj] + a[vi, vj]


@T.prim_func(private=True, s_tir=True)
def transposed_softmax(a: T.Buffer((19, 23), "float32"), out: T.Buffer((23, 19), "float32")):
    """Softmax over the first axis, written transposed: three blocks, reductions not over the last axis."""
    mx = T.sblock_alloc_buffer((23,))
    den = T.sblock_alloc_buffer((23,))
    for j, i in T.grid(23, 19):
        with T.sblock("max"):
            vj, vi = T.axis.remap("SR", [j, i])
            with T.init():
                mx[vj] = T.float32(-3.0e38)
            mx[vj] = T.max(mx[vj], a[vi, vj])
    for j, i in T.grid(23, 19):
        with T.sblock("den"):
            vj, vi = T.axis.remap("SR", [j, i])
            with T.init():
                den[vj] = T.float32(0)
            den[vj] = den[vj] + T.exp(a[vi, vj] - mx[vj])
    for j, i in T.grid(23, 19):
        with T.sblock("norm"):
            vj, vi = T.axis.remap("SS", [j, i])
            out[vj, vi] = T.exp(a[vi, vj] - mx[vj]) / den[vj]


@T.prim_func(private=True, s_tir=True)
def two_outputs(a: T.Buffer((7, 13), "float32"), y: T.Buffer((7, 13), "float32"), s: T.Buffer((7,), "float32")):
    """Two outputs of one intermediate: an elementwise one and a row sum (7 x 13, both prime)."""
    t = T.sblock_alloc_buffer((7, 13))
    for i, j in T.grid(7, 13):
        with T.sblock("t"):
            vi, vj = T.axis.remap("SS", [i, j])
            t[vi, vj] = a[vi, vj] * T.float32(2)
    for i, j in T.grid(7, 13):
        with T.sblock("y"):
            vi, vj = T.axis.remap("SS", [i, j])
            y[vi, vj] = t[vi, vj] + T.float32(1)
    for i, j in T.grid(7, 13):
        with T.sblock("s"):
            vi, vj = T.axis.remap("SR", [i, j])
            with T.init():
                s[vi] = T.float32(0)
            s[vi] = s[vi] + t[vi, vj]


@T.prim_func(private=True, s_tir=True)
def symbolic_rows(a_h: T.handle, out_h: T.handle):
    """Row max subtracted from its row, over a symbolic number of rows."""
    n = T.int64()
    a = T.match_buffer(a_h, (n, 37), "float32")
    out = T.match_buffer(out_h, (n, 37), "float32")
    mx = T.sblock_alloc_buffer((n,))
    for i, j in T.grid(n, 37):
        with T.sblock("max"):
            vi, vj = T.axis.remap("SR", [i, j])
            with T.init():
                mx[vi] = T.float32(-3.0e38)
            mx[vi] = T.max(mx[vi], a[vi, vj])
    for i, j in T.grid(n, 37):
        with T.sblock("sub"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = a[vi, vj] - mx[vi]


@T.prim_func(private=True, s_tir=True)
def scalar_total(a: T.Buffer((5, 3), "float32"), out: T.Buffer((), "float32")):
    """Every element summed into a 0-d buffer, then a block with no loop at all."""
    tot = T.sblock_alloc_buffer(())
    for i, j in T.grid(5, 3):
        with T.sblock("total"):
            vi, vj = T.axis.remap("RR", [i, j])
            with T.init():
                tot[()] = T.float32(0)
            tot[()] = tot[()] + a[vi, vj]
    with T.sblock("half"):
        out[()] = tot[()] * T.float32(0.5)


AWKWARD = {"column_sum": (column_sum, 1), "transposed_softmax": (transposed_softmax, 1),
           "two_outputs": (two_outputs, 2), "symbolic_rows": (symbolic_rows, 1), "scalar_total": (scalar_total, 1)}
SYMBOLIC_N = 11          # the symbolic kernel's row count in the numeric check


def on_cpu(func: C.PrimFunc) -> C.PrimFunc:
    """A scheduled CUDA kernel's loop nest for the CPU: thread bindings as serial loops, shared and local
    buffers in plain memory (the TVMScript text rewritten and parsed back)."""
    text, head = func.script(), "T.thread_binding("
    while head in text:
        start = text.index(head)
        depth, end = 0, start + len(head) - 1
        for end in range(end, len(text)):           # the call's closing parenthesis
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        extent = re.sub(r',\s*thread="[^"]+"\s*$', "", text[start + len(head):end])
        text = text[:start] + f"T.serial({extent})" + text[end + 1:]
    text = re.sub(r', scope="(shared|local)"', "", text)
    assert "threadIdx" not in text and "blockIdx" not in text, text
    return C.parse_script(text)


def concrete_args(func, rng, n_out):
    """Random inputs for ``func``'s inputs and zeroed outputs, symbolic extents at SYMBOLIC_N."""
    shapes = [[int(d) if isinstance(d, C.IntImm) else SYMBOLIC_N for d in p.shape] for p in func.params]
    ins = [rng.standard_normal(s).astype("float32") for s in shapes[:-n_out]]
    return ins, shapes[-n_out:]


def run_on_cpu(func, ins, out_shapes) -> list:
    lib = C.build_prim_module(C.IRModule({"main": func.with_attr("global_symbol", "main")}), tvmfuse.host_target())
    outs = [C.tensor(np.zeros(s, "float32")) for s in out_shapes]
    lib["main"](*[C.tensor(a) for a in ins], *outs)
    return [o.numpy() for o in outs]


def assert_computes_the_unscheduled(func, scheduled, n_out, rng):
    ins, out_shapes = concrete_args(func, rng, n_out)
    want = run_on_cpu(func, ins, out_shapes)
    got = run_on_cpu(on_cpu(scheduled), ins, out_shapes)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def launches(func) -> int:
    return func.script().count('thread="blockIdx.x"')


def build_for(func, target):
    """nvcc-compiled module of one scheduled kernel (TVM's build for the cuda target)."""
    return C.build_prim_module(C.IRModule({"main": func.with_attr("global_symbol", "main")}), target)


# --------------------------------------------------------------------------- the last resort
@pytest.mark.parametrize("case", list(AWKWARD))
def test_fallback_schedules_awkward_kernels_legally(case, rng):
    func, n_out = AWKWARD[case]
    target = cuda("sm_80")
    done, by, _ = F.schedule_fallback(func, target)
    assert "tirx.is_scheduled" in done.attrs and (by == "serial" or by.startswith("dlight."))
    assert F.lowering_error(done, target) is None
    assert launches(done) >= 1 and 'thread="threadIdx.x"' in done.script()
    assert_computes_the_unscheduled(func, done, n_out, rng)


@pytest.mark.parametrize("case", list(AWKWARD))
def test_serial_schedule_is_legal_for_any_kernel(case, rng):
    """The answer when no dlight rule's schedule lowers: one launch per root block, its loops as written."""
    func, n_out = AWKWARD[case]
    done = F.serial_schedule(func)
    sch = C.Schedule(func)
    roots = len(sch.get_child_blocks(sch.get_sblock("root")))
    assert launches(done) == roots
    assert F.lowering_error(done.with_attr("tirx.is_scheduled", True), cuda("sm_80")) is None
    assert_computes_the_unscheduled(func, done, n_out, rng)


@needs_nvcc
@pytest.mark.parametrize("case", ["column_sum", "two_outputs", "symbolic_rows", "scalar_total"])
def test_fallback_and_serial_build_for_sm80(case):
    func, _ = AWKWARD[case]
    target = cuda("sm_80")
    for done in (F.schedule_fallback(func, target)[0], F.serial_schedule(func)):
        assert "__global__" in C.cuda_device_source(build_for(done, target))


class _Raises:
    """A dlight rule that misjudges the kernel."""

    def apply(self, func, target, tunable):
        raise C.ScheduleError("refused (test)")

    def is_target_available(self, target):
        return True


class _Asserts(_Raises):
    """A dlight rule whose own assertion fails on the kernel (dlight.gpu.Matmul on one of llama's kernels:
    "There are some consumers of the cache-write stage that are not properly inlined")."""

    def apply(self, func, target, tunable):
        raise AssertionError("consumers not inlined (test)")


class _Unbound(_Raises):
    """A dlight rule whose schedule binds no thread: TVM cannot lower it for a GPU."""

    def apply(self, func, target, tunable):
        return C.Schedule(func)


def test_rules_that_raise_or_do_not_lower_are_passed_over():
    target = cuda("sm_80")
    done, by, notes = F.schedule_fallback(column_sum, target, rules=[_Raises(), _Asserts(), _Unbound()])
    assert by == "serial"
    assert "_Raises raised: refused (test)" in notes and "_Unbound does not lower" in notes, notes
    assert "_Asserts raised: consumers not inlined (test)" in notes, notes
    assert F.lowering_error(done, target) is None
    done, by, notes = F.schedule_fallback(column_sum, target, rules=[_Unbound(), *F.dlight_rules()])
    assert by.startswith("dlight.") and "_Unbound does not lower" in notes


class _NoBindings(Template):
    """A template that takes every kernel and binds no thread (a broken template)."""

    family, target_kinds = "cuda_broken", ("cuda",)

    def match(self, func, target):
        return Match(self.family)

    def default_config(self, match, target):
        return {}

    def apply(self, sch, match, config):
        return None


class SCH_OPTIONS:     # what apply_schedules reads of the pipeline options
    tuning_log = None


def test_template_schedule_that_does_not_lower_goes_to_the_fallback(monkeypatch):
    target = cuda("sm_80")
    monkeypatch.setattr(SCH, "templates_for", lambda target: [_NoBindings()])
    mod = C.IRModule({"colsum": column_sum})
    with target, Recorder() as rec:
        out = C.Sequential([SCH.apply_schedules(target, SCH_OPTIONS)] + SCH.fallback_passes(target))(mod)
    (r,) = rec.schedules
    assert r["template"] == "fallback" and "cuda_broken schedule does not lower" in r["reason"], r
    assert F.lowering_error(out["colsum"], target) is None


# --------------------------------------------------------------------------- cuda_row_reduction on ConvNeXt's norms
def _norm_kernel(model, target):
    funcs = S.graph_funcs(model, target)
    (func,) = [f for n, f in funcs.items() if "layer_norm" in n]
    template, match = find_template(func, target, SCH.templates_for(target))
    assert template.family == "cuda_row_reduction"
    return func, template, match


NORM_CASES = {   # model, the row axes of each output of its norm kernel, outputs
    "transposed": (S.transposed_layernorm, [[2, 3]], 1),
    "one_row": (S.pooled_layernorm_flatten, [[]], 1),
    "residual": (S.residual_layernorm, [[1], [0]], 2),
}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("case", list(NORM_CASES))
def test_row_reduction_takes_convnext_and_gpt2_norms(case, arch, rng):
    """NCHW out of sums over (n, h, w): the row loops are the output's h and w (its c and h only had
    their extents); the pooled head norm: one row, no output loop over it; GPT-2's residual sum, an output
    the reductions read, beside the reshaped norm.  Each schedules, verifies, lowers and computes what
    the unscheduled kernel computes."""
    build, axes, n_out = NORM_CASES[case]
    target = cuda(arch)
    func, template, match = _norm_kernel(build(), target)
    assert list(match.info["output_row_axes"].values()) == axes, match.info
    sch = C.Schedule(func)
    template.apply(sch, match, template.default_config(match, target))
    out = sch.mod["main"]
    assert verify_gpu_schedule(sch, verification_target(target))
    assert F.lowering_error(out, target) is None
    assert launches(out) == 1 and "T.axis.reduce" in out.script() and '"shared"' in out.script()
    assert_computes_the_unscheduled(func, out, n_out, rng)


@needs_nvcc
@pytest.mark.parametrize("case", list(NORM_CASES))
def test_norms_build_on_templates_for_sm80(case):
    cm = tvmfuse.compile(NORM_CASES[case][0](), target=cuda("sm_80"))
    assert {s["template"] for s in cm.report.schedules} == {"cuda_row_reduction"}, cm.report.schedules
    assert C.nvcc_compile(C.cuda_device_source(cm.executable), cuda("sm_80"))
