"""``passes.relpos.DiagonalRelativePosition`` (issue 13, t5_encoder over a symbolic sequence): an elementwise
chain on ``j - i`` (T5's relative-position bucket: abs, a log, clamps, a gather from a [buckets, heads] table)
is computed once per diagonal, over [2, sequence], and read back at [sequence, sequence]; without a
transcendental op in the chain it is left alone.  Structure: the Relax module after tvmfuse's pre-legalize
passes (target-neutral); numbers: the compiled model against onnx's reference evaluator at several sizes.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.passes import pre_legalize_passes
from tvmfuse.pipeline import PipelineOptions

from conftest import named_target

BUCKETS, HEADS = 16, 4


def _bias(log=True):
    """x [batch, sequence, 4] -> x's last axis mean [batch, 1, 1, sequence] + bias [1, heads, s, s] where
    bias = table[bucket(j - i)], bucket = min(int(log(|j - i| + 1) * 4), 15) (``log`` False: min(|j - i|, 15))."""
    g = M._G("relpos_bias")
    x = g.input("x", ("batch", "sequence", 4))
    s = g.op("Gather", g.op("Shape", x), g.const(np.array(1, np.int64)), axis=0)
    pos = g.op("Range", g.const(np.array(0, np.int64)), s, g.const(np.array(1, np.int64)))
    rel = g.op("Sub", g.op("Unsqueeze", pos, g.const(np.array([0], np.int64))),
               g.op("Unsqueeze", pos, g.const(np.array([1], np.int64))))
    mag = g.op("Abs", rel)
    if log:
        f = g.op("Log", g.op("Add", g.op("Cast", mag, to=onnx.TensorProto.FLOAT), g.const(np.array(1.0, np.float32))))
        mag = g.op("Cast", g.op("Mul", f, g.const(np.array(4.0, np.float32))), to=onnx.TensorProto.INT64)
    bucket = g.op("Min", mag, g.const(np.array(BUCKETS - 1, np.int64)))
    table = g.weight((BUCKETS, HEADS), scale=1.0)
    bias = g.op("Unsqueeze", g.op("Transpose", g.op("Gather", table, bucket, axis=0), perm=[2, 0, 1]),
                g.const(np.array([0], np.int64)))
    mean = g.op("Unsqueeze", g.op("ReduceMean", x, g.const(np.array([2], np.int64)), keepdims=0),
                g.const(np.array([1, 2], np.int64)))
    g.op("Add", bias, mean)
    g.rename_last("y", ("batch", HEADS, "sequence", "sequence"))
    return g.model()


def _pre_legalized(model):
    target = named_target("skx-2")
    mod = tvmfuse.load_onnx(model)
    with target:
        return C.Sequential(pre_legalize_passes(target, PipelineOptions()))(mod)


def _log_shapes(mod) -> list[str]:
    out = []
    for block in mod["main"].body.blocks:
        for b in block.bindings:
            if isinstance(b.value, C.relax.Call) and getattr(b.value.op, "name", "") == "relax.log":
                out.append(str(C.type_of(b.var).shape))
    return out


def test_log_bucket_computed_per_diagonal():
    shapes = _log_shapes(_pre_legalized(_bias(log=True)))
    assert shapes == ["R.shape([2, sequence])"], shapes


def test_chain_without_a_transcendental_is_left_alone():
    mod = _pre_legalized(_bias(log=False))
    text = mod["main"].script()
    assert "(2, sequence)" not in text and "R.abs" in text, text


@pytest.mark.parametrize("log", [True, False])
def test_bias_numbers(host, rng, log):
    model = _bias(log=log)
    cm = tvmfuse.compile(model, target=host)
    for b, s in ((1, 1), (2, 5), (1, 17), (3, 40)):
        feeds = {"x": rng.standard_normal((b, s, 4)).astype(np.float32)}
        np.testing.assert_allclose(cm.run(feeds)["y"], M.reference_outputs(model, feeds)["y"], rtol=1e-5,
                                   atol=1e-5, err_msg=f"batch {b} x sequence {s}")


@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
def test_scheduled_kernel_takes_each_log_once_per_diagonal(target):
    """The fused bias kernel, scheduled (``cpu.generic``): the log stays in a block over [2, sequence], not
    folded into the [batch, heads, sequence, sequence] output (where it would be computed per element)."""
    import schedule_cases as S
    from tvmfuse.schedules.cpu import generic as G

    tgt = named_target(target)
    funcs = S.graph_funcs(_bias(log=True), tgt)
    (func,) = [f for f in funcs.values() if "log" in f.script()]
    scheduled, _report = G.schedule_generic(func, tgt)
    log_blocks = []

    def visit(node):
        if isinstance(node, C.SBlock) and len(node.iter_vars):      # not the root block
            calls = []
            C.post_order_visit(node.body, lambda n: calls.append(n) if isinstance(n, C.Call)
                               and str(getattr(n.op, "name", "")) == "tirx.log" else None)
            if calls:
                log_blocks.append([str(iv.dom.extent) for iv in node.iter_vars])

    C.post_order_visit(scheduled.body, visit)
    assert log_blocks, scheduled.script()
    for extents in log_blocks:
        assert extents == ["T.int64(2)", "sequence"], extents


def _summed_over_rows():
    """log(|j - i| + 1) summed over i (a function of j, not of j - i): the sum stays over [s, s] (only the
    log's chain is per diagonal), x [batch, sequence] + that sum."""
    g = M._G("relpos_rowsum")
    x = g.input("x", ("batch", "sequence"))
    s = g.op("Gather", g.op("Shape", x), g.const(np.array(1, np.int64)), axis=0)
    pos = g.op("Range", g.const(np.array(0, np.int64)), s, g.const(np.array(1, np.int64)))
    rel = g.op("Sub", g.op("Unsqueeze", pos, g.const(np.array([0], np.int64))),
               g.op("Unsqueeze", pos, g.const(np.array([1], np.int64))))
    f = g.op("Log", g.op("Add", g.op("Cast", g.op("Abs", rel), to=onnx.TensorProto.FLOAT),
                         g.const(np.array(1.0, np.float32))))
    g.op("Add", x, g.op("ReduceSum", f, g.const(np.array([0], np.int64)), keepdims=1))
    g.rename_last("y", ("batch", "sequence"))
    return g.model()


def test_reduction_over_rows_stays_over_rows(host, rng):
    model = _summed_over_rows()
    assert _log_shapes(_pre_legalized(model)) == ["R.shape([2, sequence])"]
    cm = tvmfuse.compile(model, target=host)
    for b, s in ((1, 1), (2, 7), (1, 33)):
        feeds = {"x": rng.standard_normal((b, s)).astype(np.float32)}
        np.testing.assert_allclose(cm.run(feeds)["y"], M.reference_outputs(model, feeds)["y"], rtol=1e-5,
                                   atol=1e-4, err_msg=f"batch {b} x sequence {s}")


def test_square_constant_without_j_minus_i_is_left_alone():
    """log(full([s, s], 2)) + x: a square cone with a transcendental op but no ``j - i`` in it has no
    diagonal to read its result back by; the pass leaves the function as it is (it raised "no j - i over s")."""
    from tvmfuse.passes.relpos import DiagonalRelativePosition

    s = C.tirx.Var("s", "int64")
    x = C.relax.Var("x", C.TensorType([s, s], "float32"))
    bb = C.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            c = bb.emit(C.relax.op.full(C.relax.ShapeExpr([s, s]), C.relax.const(2.0, "float32"), "float32"))
            y = bb.emit_output(C.relax.op.add(bb.emit(C.relax.op.log(c)), x))
        bb.emit_func_output(y)
    mod = bb.get()
    C.assert_structural_equal(DiagonalRelativePosition()(mod), mod)
