"""Window attention over a symbolic batch (issue 13; torchvision's Swin, ``corpus/swin_dyn.onnx``).

A Swin block partitions its NHWC map into windows: the windows of every image are one batch axis of extent
``batch * windows``.  Over a symbolic ``batch`` that extent is an expression, not a plain symbol, and three
things kept the symbolic build from the static build's groups (88 kernels against 44 in session 8):

- TVM's Gather converter normalises ``qkv[0]`` (a constant index) at run time from ``shape_of`` once the
  tensor has a symbolic dim: the index is no constant, each take an opaque gather (``frontend``:
  ``_constant_index_take`` normalises it at import);
- LegalizeOps passes ``batch`` as a scalar argument to every PrimFunc sized ``batch * windows`` only (no
  buffer shape defines it): ``rules.classify`` called those ops "unknown shape" and fused none of them
  (``rules.scalar_arg``: the scalar stays in the group's function, its symbol from the shape parameter);
- the attention kernel's spec took plain symbols only (``attention._own_batch_symbols``: the window batch
  becomes a symbol of the kernel's own, bound by call_tir from the tensors).

The ONNX graph below is one such block (window partition, Q/K/V projection, relative position bias, window
merge, residual), built with onnx.helper, static and with a symbolic batch.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmfuse
from conftest import NAMED_TARGETS
from tvmfuse import _compat as C
from tvmfuse.passes import rules as R
from tvmfuse.target import parse_target

H = W = 8
WIN = 4                       # 2 x 2 windows of 4 x 4 pixels
CH, HEADS = 16, 2
HD = CH // HEADS
NWIN, TOK = (H // WIN) * (W // WIN), WIN * WIN


def _model(batch, merge_rows: bool = False, seed: int = 0) -> onnx.ModelProto:
    """x [batch, H, W, CH] -> window partition -> qkv -> softmax(q k^T * s + bias) v -> proj -> window merge
    -> + x.  ``merge_rows``: the attention output is reshaped to [batch * windows * tokens, CH] (a merge of
    the window batch with the rows, which the attention kernel's output must not absorb) before the proj."""
    rng = np.random.default_rng(seed)

    def const(name, arr):
        return numpy_helper.from_array(np.asarray(arr), name)

    inits = [
        const("s_part", np.array([-1, H // WIN, WIN, W // WIN, WIN, CH], np.int64)),
        const("s_tok", np.array([-1, TOK, CH], np.int64)),
        const("s_qkv", np.array([-1, TOK, 3, HEADS, HD], np.int64)),
        const("s_rows", np.array([-1, CH], np.int64)),
        const("s_back", np.array([-1, H // WIN, W // WIN, WIN, WIN, CH], np.int64)),
        const("s_img", np.array([-1, H, W, CH], np.int64)),
        const("w_qkv", (rng.standard_normal((CH, 3 * CH)) * 0.3).astype(np.float32)),
        const("b_qkv", (rng.standard_normal(3 * CH) * 0.1).astype(np.float32)),
        const("w_proj", (rng.standard_normal((CH, CH)) * 0.3).astype(np.float32)),
        const("b_proj", (rng.standard_normal(CH) * 0.1).astype(np.float32)),
        const("bias", rng.standard_normal((HEADS, TOK, TOK)).astype(np.float32)),
        const("scale", np.array(HD ** -0.5, np.float32)),
        const("i0", np.array(0, np.int64)), const("i1", np.array(1, np.int64)), const("i2", np.array(2, np.int64)),
    ]
    n = helper.make_node
    nodes = [
        n("Reshape", ["x", "s_part"], ["xp"]),
        n("Transpose", ["xp"], ["xt"], perm=[0, 1, 3, 2, 4, 5]),
        n("Reshape", ["xt", "s_tok"], ["tok"]),                       # [batch * 4, 16, CH]
        n("MatMul", ["tok", "w_qkv"], ["qkv0"]),
        n("Add", ["qkv0", "b_qkv"], ["qkv1"]),
        n("Reshape", ["qkv1", "s_qkv"], ["qkv2"]),
        n("Transpose", ["qkv2"], ["qkv"], perm=[2, 0, 3, 1, 4]),      # [3, batch * 4, HEADS, 16, HD]
        n("Gather", ["qkv", "i0"], ["q0"], axis=0),
        n("Gather", ["qkv", "i1"], ["k"], axis=0),
        n("Gather", ["qkv", "i2"], ["v"], axis=0),
        n("Mul", ["q0", "scale"], ["q"]),
        n("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        n("MatMul", ["q", "kt"], ["s0"]),
        n("Add", ["s0", "bias"], ["s1"]),                             # relative position bias
        n("Softmax", ["s1"], ["p"], axis=-1),
        n("MatMul", ["p", "v"], ["o0"]),
        n("Transpose", ["o0"], ["o1"], perm=[0, 2, 1, 3]),            # [batch * 4, 16, HEADS, HD]
    ]
    if merge_rows:
        nodes += [n("Reshape", ["o1", "s_rows"], ["o2"])]             # [batch * 64, CH]
    else:
        nodes += [n("Reshape", ["o1", "s_tok"], ["o2"])]              # [batch * 4, 16, CH]
    nodes += [
        n("MatMul", ["o2", "w_proj"], ["y0"]),
        n("Add", ["y0", "b_proj"], ["y1"]),
        n("Reshape", ["y1", "s_back"], ["y2"]),
        n("Transpose", ["y2"], ["y3"], perm=[0, 1, 3, 2, 4, 5]),
        n("Reshape", ["y3", "s_img"], ["y4"]),
        n("Add", ["y4", "x"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, H, W, CH])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, H, W, CH])
    m = helper.make_model(helper.make_graph(nodes, "window_attention", [x], [y], inits),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def _graph(model, target: str):
    """(kernel names, graph-stage module) of ``model`` for a named target (no schedule, no build)."""
    from tvmfuse.pipeline import PipelineOptions, graph_stage
    from tvmfuse.report import graph_stats

    tgt = parse_target(NAMED_TARGETS[target])
    with tgt:
        mod = C.Sequential(graph_stage(tgt, PipelineOptions()))(tvmfuse.load_onnx(model))
    return graph_stats(mod).kernel_names, mod


def _attention_ops(mod) -> list[list[str]]:
    import json

    from tvmfuse.schedules.cpu.attention import ATTR

    return [json.loads(str(f.attrs["tvmfuse.ops"])) for f in mod.functions.values()
            if isinstance(f, C.PrimFunc) and f.attrs is not None and ATTR in f.attrs]


@pytest.mark.parametrize("target", ["skx-2", "neon-4"])
def test_symbolic_windows_get_the_static_groups(target):
    """Structure: the symbolic build has the static build's kernels, one of them the attention kernel with
    the head merge (permute + reshape) inside it, and no gather left opaque."""
    static_kernels, static_mod = _graph(_model(2), target)
    dyn_kernels, dyn_mod = _graph(_model("batch"), target)
    assert len(dyn_kernels) == len(static_kernels), (sorted(static_kernels), sorted(dyn_kernels))
    assert _attention_ops(dyn_mod) == _attention_ops(static_mod)
    ops = _attention_ops(dyn_mod)
    assert len(ops) == 1 and ops[0][-2:] == ["permute_dims", "reshape"], ops
    # window partition + qkv: one projection kernel (matmul + bias), the takes in one layout kernel
    assert not any(k.startswith(("take", "shape_to_tensor", "where")) for k in dyn_kernels), dyn_kernels


def test_merge_of_window_batch_and_rows_stays_out_of_the_attention_kernel():
    """Must not fire: a reshape that merges the window batch (``batch * 4``) with the query rows into
    ``batch * 64`` rows is no axis of the kernel's spec (one symbol per logical extent): the kernel's output
    stops at the permute, as GPT-2's [batch * sequence, 768] does."""
    _, mod = _graph(_model("batch", merge_rows=True), "skx-2")
    ops = _attention_ops(mod)
    assert len(ops) == 1 and ops[0][-1] == "permute_dims", ops


def test_scalar_arguments_are_not_tensors():
    """``rules.scalar_arg``: the symbolic scalar LegalizeOps passes (``batch``) is one, a tensor var is not."""
    batch = C.tirx.Var("batch", "int64")
    x = C.relax.Var("x", C.TensorType([batch * 4, 16], "float32"))
    assert R.scalar_arg(batch) and R.scalar_arg(batch * 4)
    assert not R.scalar_arg(x)


def check_against_onnxruntime(model, x):
    """Compile ``model`` (one attention kernel on cpu.attention, nothing unscheduled) and compare its output
    ``y`` for input ``x`` with onnxruntime's."""
    ort = pytest.importorskip("onnxruntime")
    from tvmfuse.report import schedule_source_counts

    cm = tvmfuse.compile(model)
    assert schedule_source_counts(cm.report.schedules)["unscheduled"] == 0, cm.report.schedules
    assert [s["template"] for s in cm.report.schedules].count("cpu.attention") == 1, cm.report.refused
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(cm.run({"x": x})["y"], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("run_batch", [1, 3])
def test_symbolic_windows_match_onnxruntime(run_batch, rng):
    model = _model("batch", seed=int(rng.integers(2**31)))
    check_against_onnxruntime(model, rng.standard_normal((run_batch, H, W, CH)).astype(np.float32))
