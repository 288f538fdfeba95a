"""The attention rule on BLOOM's and Swin's attention forms (issue 14, notes/attn11.md).

- BLOOM: the scores are ``[b * h, q, k]`` (baddbmm with the ALiBi bias), viewed as ``[b, h, q, k]`` for the
  causal mask (``torch.finfo(float32).min``, not -inf, where a key is masked), the probabilities viewed back
  as ``[b * h, q, k]`` for P @ V: reshapes of the batch axes on both sides of the softmax.
- Swin's shifted windows: ``Q @ K^T + bias[h, n, n]``, viewed as ``[batch, windows, h, n, n]`` for the shift
  mask ``[windows, 1, n, n]`` and back: two constant additive terms, summed into one ``[windows, h, n, n]``
  mask read by the window's digit of the batch index.
Numerics against the float64 ONNX reference on fresh inputs; structure (kernel count, the spec) under a named
target; a -FLT_MAX mask is a causal flag only when every row sees a key (-FLT_MAX over a whole row is uniform
weights, -inf is not).
- DeBERTa-v2: K^T divided by the scale, a relative-position bias computed per call and ``masked_fill`` as a
  where: the bias and the where one mask tensor computed per call, the where a select between constants
  added to the bias; several additive terms not all constants likewise (BLOOM's causal triangle still the
  causal flag beside a computed ALiBi). Must not fire: a where with a finite fill, or before the scale.
"""
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmfuse
from tvmfuse.explain_cli import explain
from tvmfuse.passes import attention as A
from tvmfuse.schedules.cpu.attention import ATTR, AttentionSpec

from conftest import NAMED_TARGETS, reference_outputs_f64

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F = TensorProto.FLOAT
RTOL, ATOL = 1e-4, 1e-5
SKX = tvmfuse.parse_target(NAMED_TARGETS["skx-2"])
LOWEST = np.finfo(np.float32).min


def _model(nodes, inputs, outputs, inits):
    g = helper.make_graph(nodes, "attn", [helper.make_tensor_value_info(n, F, sh) for n, sh in inputs],
                          [helper.make_tensor_value_info(n, F, sh) for n, sh in outputs], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _shape(name, dims):
    return numpy_helper.from_array(np.array(dims, np.int64), name)


def bloom_chain(b=2, h=4, s=13, d=8, batch="static", alibi_input=False, padding=False):
    """BLOOM's attention: scores [b*h, s, s] scaled, + ALiBi [h, 1, s] on the [b, h, s, s] view, + the causal
    mask (0 / float32 lowest) [1, 1, s, s]; softmax; probabilities viewed as [b*h, s, s] for P @ V; the
    output viewed as [b, h, s, d].  ``batch="symbolic"``: b is the symbol ``batch``; ``alibi_input``: the
    ALiBi bias is a graph input (a second, non-constant term: must not fire); ``padding``: the mask hides
    the last 3 keys of every row instead (no causal flag)."""
    bdim = b if batch == "static" else "batch"
    slopes = (2.0 ** -np.arange(1, h + 1)).astype(np.float32)
    alibi = (slopes[:, None, None] * np.arange(s, dtype=np.float32)[None, None, :]).astype(np.float32)
    ii, jj = np.arange(s)[:, None], np.arange(s)[None, :]
    allowed = (jj < s - 3) & (ii >= 0) if padding else jj <= ii
    mask = np.where(allowed, 0.0, LOWEST).astype(np.float32).reshape(1, 1, s, s)
    inits = [numpy_helper.from_array(np.array(1 / np.sqrt(d), np.float32), "scale"),
             numpy_helper.from_array(mask, "mask"),
             _shape("flat", [-1, s, d]), _shape("flat_s", [-1, s, s]), _shape("heads", [-1, h, s, s]),
             _shape("heads_d", [-1, h, s, d])]
    inputs = [("q", [bdim, h, s, d]), ("k", [bdim, h, s, d]), ("v", [bdim, h, s, d])]
    if alibi_input:
        inputs.append(("alibi", [h, 1, s]))
    else:
        inits.append(numpy_helper.from_array(alibi, "alibi"))
    nodes = [helper.make_node("Reshape", ["q", "flat"], ["qf"]),
             helper.make_node("Reshape", ["k", "flat"], ["kf"]),
             helper.make_node("Reshape", ["v", "flat"], ["vf"]),
             helper.make_node("Transpose", ["kf"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["qf", "kt"], ["x"]),
             helper.make_node("Mul", ["x", "scale"], ["xs"]),
             helper.make_node("Reshape", ["xs", "heads"], ["x4"]),
             helper.make_node("Add", ["x4", "alibi"], ["xa"]),
             helper.make_node("Add", ["xa", "mask"], ["xm"]),
             helper.make_node("Softmax", ["xm"], ["p"], axis=-1),
             helper.make_node("Reshape", ["p", "flat_s"], ["pf"]),
             helper.make_node("MatMul", ["pf", "vf"], ["o"]),
             helper.make_node("Reshape", ["o", "heads_d"], ["y"])]
    return _model(nodes, inputs, [("y", [bdim, h, s, d])], inits)


def swin_chain(batch=2, windows=4, h=3, n=16, d=8, symbolic=False, mask_input=False):
    """Swin's shifted-window attention: Q (scaled) @ K^T over [batch * windows, h, n, n] + the relative-position
    bias [h, n, n], viewed as [batch, windows, h, n, n] + the shift mask [windows, 1, n, n] (0 / -100), viewed
    back; softmax; P @ V.  ``mask_input``: the shift mask is a graph input (two terms, one not constant)."""
    rng = np.random.default_rng(7)
    bdim = "batch" if symbolic else batch
    bias = rng.standard_normal((h, n, n)).astype(np.float32)
    region = rng.integers(0, 3, size=(windows, n))
    shift = np.where(region[:, :, None] == region[:, None, :], 0.0, -100.0).astype(np.float32)
    shift = shift.reshape(windows, 1, n, n)
    inits = [numpy_helper.from_array(np.array(d ** -0.5, np.float32), "scale"),
             numpy_helper.from_array(bias, "bias"),
             _shape("win", [-1, h, n, d]), _shape("split", [-1, windows, h, n, n]), _shape("merge", [-1, h, n, n])]
    inputs = [(x, [bdim, windows, h, n, d]) for x in ("q", "k", "v")]
    if mask_input:
        inputs.append(("shift", [windows, 1, n, n]))
    else:
        inits.append(numpy_helper.from_array(shift, "shift"))
    nodes = [helper.make_node("Reshape", ["q", "win"], ["qw"]),
             helper.make_node("Reshape", ["k", "win"], ["kw"]),
             helper.make_node("Reshape", ["v", "win"], ["vw"]),
             helper.make_node("Mul", ["qw", "scale"], ["qs"]),
             helper.make_node("Transpose", ["kw"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["qs", "kt"], ["x"]),
             helper.make_node("Add", ["x", "bias"], ["xb"]),
             helper.make_node("Reshape", ["xb", "split"], ["x5"]),
             helper.make_node("Add", ["x5", "shift"], ["xm"]),
             helper.make_node("Reshape", ["xm", "merge"], ["x4"]),
             helper.make_node("Softmax", ["x4"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "vw"], ["y"])]
    return _model(nodes, inputs, [("y", ["nw" if symbolic else batch * windows, h, n, d])], inits)


def deberta_chain(b=2, h=4, s=7, d=8, batch="static", fill=LOWEST, scale_first=False):
    """DeBERTa-v2's attention: Q and K^T from [b, s, h*d] by head split, K^T divided by the scale before
    Q @ K^T, + a relative-position bias computed per call (here a graph input viewed as [b*h, s, s]), viewed as
    [b, h, s, s], ``masked_fill`` as ``where(not mask, fill, scores)`` with a key-padding mask [b, 1, 1, s]
    (> 0.5: visible), softmax, P @ V, the heads merged back to [b, s, h*d].  ``scale_first``: the where
    applied to the scores before they are scaled (must not fire)."""
    bdim = b if batch == "static" else "batch"
    inits = [numpy_helper.from_array(np.array(np.sqrt(d * 3.0), np.float32), "scale"),
             numpy_helper.from_array(np.array(fill, np.float32), "fill"),
             numpy_helper.from_array(np.array(0.5, np.float32), "half"),
             _shape("split", [0, 0, h, d]), _shape("flat", [-1, s, d]), _shape("heads", [-1, h, s, s]),
             _shape("flat_s", [-1, s, s]), _shape("heads_d", [-1, h, s, d]), _shape("merged", [-1, s, h * d])]
    inputs = [("q", [bdim, s, h * d]), ("k", [bdim, s, h * d]), ("v", [bdim, s, h * d]),
              ("rel", [bdim, h, s, s]), ("m", [bdim, 1, 1, s])]
    nodes = []
    for x in ("q", "k", "v"):
        nodes += [helper.make_node("Reshape", [x, "split"], [f"{x}4"]),
                  helper.make_node("Transpose", [f"{x}4"], [f"{x}t"], perm=[0, 2, 1, 3]),
                  helper.make_node("Reshape", [f"{x}t", "flat"], [f"{x}f"])]
    nodes += [helper.make_node("Transpose", ["kf"], ["kT"], perm=[0, 2, 1]),
              helper.make_node("Reshape", ["rel", "flat_s"], ["relf"]),
              helper.make_node("Greater", ["m", "half"], ["seen"]),
              helper.make_node("Not", ["seen"], ["hidden"])]
    if scale_first:
        nodes += [helper.make_node("MatMul", ["qf", "kT"], ["x"]),
                  helper.make_node("Add", ["x", "relf"], ["xb"]),
                  helper.make_node("Reshape", ["xb", "heads"], ["x4"]),
                  helper.make_node("Where", ["hidden", "fill", "x4"], ["xw"]),
                  helper.make_node("Div", ["xw", "scale"], ["xm"])]
    else:
        nodes += [helper.make_node("Div", ["kT", "scale"], ["kTs"]),
                  helper.make_node("MatMul", ["qf", "kTs"], ["x"]),
                  helper.make_node("Add", ["x", "relf"], ["xb"]),
                  helper.make_node("Reshape", ["xb", "heads"], ["x4"]),
                  helper.make_node("Where", ["hidden", "fill", "x4"], ["xm"])]
    nodes += [helper.make_node("Softmax", ["xm"], ["p"], axis=-1),
              helper.make_node("Reshape", ["p", "flat_s"], ["pf"]),
              helper.make_node("MatMul", ["pf", "vf"], ["o"]),
              helper.make_node("Reshape", ["o", "heads_d"], ["o4"]),
              helper.make_node("Transpose", ["o4"], ["ot"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ot", "merged"], ["y"])]
    return _model(nodes, inputs, [("y", [bdim, s, h * d])], inits)


def _feeds(model, rng, sizes=None):
    sizes = sizes or {}
    out = {}
    for vi in model.graph.input:
        dims = [d.dim_value if d.HasField("dim_value") else sizes[d.dim_param]
                for d in vi.type.tensor_type.shape.dim]
        out[vi.name] = rng.standard_normal(dims).astype(np.float32)
    return out


def _specs(module) -> list:
    return [AttentionSpec.from_json(str(f.attrs[ATTR])) for f in module.functions.values()
            if isinstance(f, tvmfuse._compat.PrimFunc) and f.attrs is not None and ATTR in f.attrs]


# ------------------------------------------------------------------------------ BLOOM
def test_bloom_form_is_one_kernel_with_the_causal_flag(host, rng):
    model = bloom_chain()
    cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 1, (cm.report.after.kernel_names, cm.report.refused)
    (spec,) = _specs(cm.fused_module)
    # the float32-lowest triangle is the causal flag; ALiBi the one mask, read per head (b1) and key
    assert spec.causal_offset == 0 and spec.mask is not None
    assert spec.batch == (2, 4) and spec.mask.axes == ("b1", "1", "j")
    assert spec.out.axes[0] == ("b0", "b1") or spec.out.axes[:2] == ("b0", "b1")
    feeds = _feeds(model, rng)
    np.testing.assert_allclose(cm.run(feeds)["y"], reference_outputs_f64(model, feeds)["y"], rtol=RTOL, atol=ATOL)


def test_bloom_form_over_a_symbolic_batch(host, rng):
    model = bloom_chain(batch="symbolic")
    cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 1, (cm.report.after.kernel_names, cm.report.refused)
    (spec,) = _specs(cm.fused_module)
    assert spec.causal_offset == 0 and str(spec.batch[0]) == "batch"
    for b in (1, 3):
        feeds = _feeds(model, rng, {"batch": b})
        np.testing.assert_allclose(cm.run(feeds)["y"], reference_outputs_f64(model, feeds)["y"],
                                   rtol=RTOL, atol=ATOL)


def test_lowest_value_mask_of_no_causal_shape_is_summed_with_alibi(host, rng):
    """A float32-lowest padding mask (the last keys hidden) is no causal flag: it stays an additive mask,
    summed with the constant ALiBi bias into one, and the kernel matches the reference."""
    model = bloom_chain(b=1, padding=True)
    cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 1, (cm.report.after.kernel_names, cm.report.refused)
    (spec,) = _specs(cm.fused_module)
    assert spec.causal_offset is None and spec.mask is not None
    feeds = _feeds(model, rng)
    np.testing.assert_allclose(cm.run(feeds)["y"], reference_outputs_f64(model, feeds)["y"], rtol=RTOL, atol=ATOL)


def test_causal_offset_reads_the_lowest_value_only_when_every_row_sees_a_key():
    s = 6
    ii, jj = np.arange(s)[:, None], np.arange(s)[None, :]
    tvm_const = tvmfuse._compat.relax.const
    # -FLT_MAX with k < 0 hides row 0 whole: the reference gives it uniform weights, the flag would not
    for k, want in ((0, 0), (2, 2), (-1, None)):
        m = np.where(jj <= ii + k, 0.0, LOWEST).astype(np.float32)
        assert A._causal_offset(tvm_const(m), s, s) == want
    m = np.where(jj <= ii - 1, 0.0, -np.inf).astype(np.float32)     # -inf: the kernel's flag as before
    assert A._causal_offset(tvm_const(m), s, s) == -1


# ------------------------------------------------------------------------------ Swin
@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
def test_swin_shifted_window_form_is_one_kernel(symbolic, host, rng):
    model = swin_chain(symbolic=symbolic)
    cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 1, (cm.report.after.kernel_names, cm.report.refused)
    (spec,) = _specs(cm.fused_module)
    # bias + shift mask summed: [windows, heads, n, n], the window the batch index's last digit
    assert spec.mask.shape == (4, 3, 16, 16)
    assert spec.mask.axes == (("%", "b0", 1, 4), "b1", "i", "j")
    for b in ((1, 3) if symbolic else (2,)):
        feeds = _feeds(model, rng, {"batch": b})
        np.testing.assert_allclose(cm.run(feeds)["y"], reference_outputs_f64(model, feeds)["y"],
                                   rtol=RTOL, atol=ATOL)


def test_sum_of_constant_terms_is_the_sum_over_their_axes():
    ext = {"b0": 8, "b1": 3, "i": 5, "j": 5}
    rng = np.random.default_rng(0)
    bias = rng.standard_normal((3, 5, 5)).astype(np.float32)
    shift = rng.standard_normal((4, 1, 5, 5)).astype(np.float32)
    arr, labels = A._sum_constants([(bias, ["b1", "i", "j"]), (shift, [("%", "b0", 1, 4), "1", "i", "j"])], ext)
    assert labels == [("%", "b0", 1, 4), "b1", "i", "j"]
    np.testing.assert_array_equal(arr, bias[None] + shift)
    with pytest.raises(A._Refused, match="whole and by its digits"):
        A._sum_constants([(rng.standard_normal((8, 5, 5)), ["b0", "i", "j"]),
                          (shift, [("%", "b0", 1, 4), "1", "i", "j"])], ext)


# ------------------------------------------------------------------------------ DeBERTa: a computed mask
def _feeds_deberta(model, rng, b):
    feeds = _feeds(model, rng, {"batch": b})
    feeds["m"][:, :, :, 0] = 1.0          # most rows see a key; others hidden whole (uniform weights)
    return feeds


@pytest.mark.parametrize("batch", ["static", "symbolic"])
def test_deberta_form_is_one_kernel_with_a_computed_mask(batch, host, rng):
    """``where(not mask, lowest, Q @ (K^T / scale) + rel)``: the scale peeled from K^T, the bias and the
    select one mask tensor computed per call (its own small kernel: the bias viewed per head, the where),
    the attention one kernel reading Q / K / V in their [b, s, h*d] layout and writing the merged heads."""
    model = deberta_chain(batch=batch)
    cm = tvmfuse.compile(model, host)
    (spec,) = _specs(cm.fused_module)
    assert cm.kernel_count == 2, (cm.report.after.kernel_names, cm.report.refused)
    assert spec.mask is not None and spec.mask.axes == ("b0", "b1", "i", "j") and spec.causal_offset is None
    assert spec.q.axes == ("b0", "i", ("b1", "d")) and spec.out.axes == ("b0", "i", ("b1", "e"))
    assert spec.scale == pytest.approx(1 / np.sqrt(8 * 3.0), rel=1e-6)
    for b in ((1, 3) if batch == "symbolic" else (2,)):
        feeds = _feeds_deberta(model, rng, b)
        np.testing.assert_allclose(cm.run(feeds)["y"], reference_outputs_f64(model, feeds)["y"],
                                   rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("form", ["bloom", "swin"])
def test_two_terms_not_both_constants_are_one_computed_mask(form, host, rng):
    """A second additive term that is a graph input: the terms summed into one mask tensor per call (the
    kernel adds one mask), numerics as the reference."""
    model = bloom_chain(alibi_input=True, padding=True) if form == "bloom" else swin_chain(mask_input=True)
    d = explain(model, SKX)
    groups = [g for g in d["groups"] if g["rule"] == "attention"]
    assert len(groups) == 1 and "computed mask" in groups[0]["ops"], d["refused"]
    cm = tvmfuse.compile(model, host)
    (spec,) = _specs(cm.fused_module)
    assert spec.causal_offset is None and spec.mask is not None
    feeds = _feeds(model, rng, {"batch": 2})
    np.testing.assert_allclose(cm.run(feeds)["y"], reference_outputs_f64(model, feeds)["y"], rtol=RTOL, atol=ATOL)


def _bindings(mod, op_name):
    """The main function's bindings whose value calls ``op_name``, as (var, call)."""
    C = tvmfuse._compat
    out = []
    for block in mod["main"].body.blocks:
        for b in block.bindings:
            v = b.value
            if isinstance(v, C.relax.Call) and getattr(v.op, "name", None) == op_name:
                out.append((b.var, v))
    return out


def test_deberta_where_mask_is_a_select_between_constants():
    """The computed mask applies DeBERTa's where as ``add(bias, where(hidden, lowest, 0))``: a select
    between two constants, added to the terms, never ``where(hidden, lowest, bias)`` (a select on loaded
    data: the symbolic relative-position kernel 127 vs 56 us at deberta_v2 b1 s128, notes/attn26.md)."""
    C = tvmfuse._compat
    from tvmfuse.passes.attention import FuseAttention

    mod = C.relax_transform.DeadCodeElimination()(tvmfuse.load_onnx(deberta_chain(batch="symbolic")))
    out = C.relax_transform.DeadCodeElimination()(FuseAttention(SKX)(mod))   # the replaced chain dropped
    wheres = _bindings(out, "relax.where")
    assert len(wheres) == 1, out["main"]
    (sel_var, sel), = wheres
    fill, zero = sel.args[1], sel.args[2]          # where(hidden, fill, scores): the fill where true
    assert isinstance(fill, C.Constant) and isinstance(zero, C.Constant)
    assert float(C.const_value(fill)) == LOWEST and float(C.const_value(zero)) == 0.0
    adds = [call for _, call in _bindings(out, "relax.add") if any(a.same_as(sel_var) for a in call.args)]
    assert len(adds) == 1                           # the select added to the bias
    assert len(_specs(out)) == 1


def test_alibi_input_with_a_causal_constant_keeps_the_causal_flag(host, rng):
    """A non-constant ALiBi term and the causal triangle (BLOOM's symbolic export computes its ALiBi): the
    triangle is still the causal flag and the ALiBi the one mask read in place, no computed mask (a
    computed mask here made a broadcast_to / reshape kernel that failed its template)."""
    model = bloom_chain(alibi_input=True)
    d = explain(model, SKX)
    groups = [g for g in d["groups"] if g["rule"] == "attention"]
    assert len(groups) == 1 and "computed mask" not in groups[0]["ops"], d["groups"]
    assert "causal mask" in groups[0]["ops"]
    cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 1, (cm.report.after.kernel_names, cm.report.refused)
    (spec,) = _specs(cm.fused_module)
    assert spec.causal_offset == 0 and spec.mask is not None
    feeds = _feeds(model, rng)
    np.testing.assert_allclose(cm.run(feeds)["y"], reference_outputs_f64(model, feeds)["y"], rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------------------ must not fire
@pytest.mark.parametrize("case", ["finite_fill", "before_scale"])
def test_select_that_is_no_mask_stays_unfused(case, host):
    """``where(not mask, -10000, scores)`` (a finite fill is not an additive mask: the select replaces the
    score) and a where applied before the scale: refused with the reason, the graph as without the
    attention rule (``expected = before``)."""
    model = deberta_chain(fill=-10000.0) if case == "finite_fill" else deberta_chain(scale_first=True)
    d = explain(model, SKX)
    before = explain(model, SKX, attention=False)
    assert not [g for g in d["groups"] if g["rule"] == "attention"]
    want = "other than -inf" if case == "finite_fill" else "before the scale"
    assert any(r.get("rule") == "attention" and want in r["reason"] for r in d["refused"]), d["refused"]
    assert d["kernels_fused"] == before["kernels_fused"]
    assert [g["ops"] for g in d["groups"]] == [g["ops"] for g in before["groups"]]


# ------------------------------------------------------------------------------ the corpus exports
@pytest.mark.parametrize("name", ["bloom_dyn", "swin_dyn"])
def test_corpus_exports_get_their_attention_kernels(name):
    """Graph stage only (no build): bloom's 2 and swin's 4 attention layers each one ``cpu.attention``
    kernel over the symbolic batch, none refused (numerics: benchmarks/new_models_check.py, notes/attn11.md)."""
    d = explain(os.path.join(ROOT, "corpus", f"{name}.onnx"), SKX)
    groups = [g for g in d["groups"] if g["rule"] == "attention"]
    assert len(groups) == {"bloom_dyn": 2, "swin_dyn": 4}[name], d["refused"]
    assert {g["template"] for g in groups} == {"cpu.attention"}
    assert not [r for r in d["refused"] if r.get("rule") == "attention"]


# ------------------------------------------------------------------------------ CUDA (structure only)
@pytest.mark.parametrize("form", ["bloom", "swin"])
def test_cuda_template_schedules_the_variants(form):
    """The same kernels on a CUDA target (sm_90): one attention PrimFunc, ``cuda_attention`` takes it and its
    default schedule passes TVM's GPU verification (the composite and digit mask labels index on the GPU as
    on the CPU: ``operand_index``)."""
    from tvmfuse import _compat as C
    from tvmfuse.pipeline import PipelineOptions, graph_stage
    from tvmfuse.schedules import templates_for
    from tvmfuse.schedules.base import find_template
    from tvmfuse.schedules.cuda._common import verification_target, verify_gpu_schedule

    target = C.Target({"kind": "cuda", "arch": "sm_90"}, host=SKX)
    model = bloom_chain() if form == "bloom" else swin_chain()
    mod = tvmfuse.load_onnx(model)
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions()))(mod)
    funcs = [f for f in mod.functions.values() if isinstance(f, C.PrimFunc) and ATTR in (f.attrs or {})]
    assert len(funcs) == 1, [str(gv.name_hint) for gv in mod.functions]
    template, match = find_template(funcs[0], target, templates_for(target))
    assert template.family == "cuda_attention"
    sch = C.Schedule(funcs[0])
    template.apply(sch, match, template.default_config(match, target))
    assert verify_gpu_schedule(sch, verification_target(target))
