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


def _bias(log=True, full_min=False, i_minus_j=False):
    """x [batch, sequence, 4] -> x's last axis mean [batch, 1, 1, sequence] + bias [1, heads, s, s] where
    bias = table[bucket(j - i)], bucket = min(int(log(|j - i| + 1) * 4), 15) (``log`` False: min(|j - i|, 15)).
    ``full_min``: the min is taken against a [s, s] tensor of 15s (``ConstantOfShape``), as T5's export does,
    so the whole chain up to the gather from the table is per diagonal (else the min with a scalar constant
    ends the diagonal part at the bucket's cast).  ``i_minus_j``: DeBERTa's orientation, ``rel = i - j`` (query
    minus key position) and a bucket with its sign, ``clip(sign(rel) * ceil(log(|rel| + 1) * 2) + 8, 0, 15)``:
    each side of the diagonal its own bucket (a pass that took ``i - j`` for ``j - i`` swaps them)."""
    g = M._G("relpos_bias")
    x = g.input("x", ("batch", "sequence", 4))
    s = g.op("Gather", g.op("Shape", x), g.const(np.array(1, np.int64)), axis=0)
    pos = g.op("Range", g.const(np.array(0, np.int64)), s, g.const(np.array(1, np.int64)))
    row, col = (g.op("Unsqueeze", pos, g.const(np.array([a], np.int64))) for a in (0, 1))
    rel = g.op("Sub", col, row) if i_minus_j else g.op("Sub", row, col)
    mag = g.op("Abs", rel)
    if i_minus_j:
        f = g.op("Log", g.op("Add", g.op("Cast", mag, to=onnx.TensorProto.FLOAT), g.const(np.array(1.0, np.float32))))
        side = g.op("Mul", g.op("Cast", g.op("Sign", rel), to=onnx.TensorProto.FLOAT),
                    g.op("Ceil", g.op("Mul", f, g.const(np.array(2.0, np.float32)))))
        mag = g.op("Add", g.op("Cast", side, to=onnx.TensorProto.INT64), g.const(np.array(BUCKETS // 2, np.int64)))
        mag = g.op("Max", mag, g.const(np.array(0, np.int64)))
    elif log:
        f = g.op("Log", g.op("Add", g.op("Cast", mag, to=onnx.TensorProto.FLOAT), g.const(np.array(1.0, np.float32))))
        mag = g.op("Cast", g.op("Mul", f, g.const(np.array(4.0, np.float32))), to=onnx.TensorProto.INT64)
    if full_min:
        top = g.op("ConstantOfShape", g.op("Shape", rel),
                   value=onnx.helper.make_tensor("v", onnx.TensorProto.INT64, [1], [BUCKETS - 1]))
        bucket = g.op("Min", mag, top)
    else:
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


def _op_shapes(mod, op: str) -> list[str]:
    out = []
    for block in mod["main"].body.blocks:
        for b in block.bindings:
            if isinstance(b.value, C.relax.Call) and getattr(b.value.op, "name", "") == op:
                out.append(str(C.type_of(b.var).shape))
    return out


def _log_shapes(mod) -> list[str]:
    return _op_shapes(mod, "relax.log")


def test_log_bucket_computed_per_diagonal():
    shapes = _log_shapes(_pre_legalized(_bias(log=True)))
    assert shapes == ["R.shape([2, sequence])"], shapes


def test_i_minus_j_bucket_computed_per_diagonal_with_its_sign():
    """DeBERTa's orientation (``i - j``): the chain is per diagonal too, on the negated diagonals."""
    mod = _pre_legalized(_bias(log=True, i_minus_j=True))
    assert _log_shapes(mod) == ["R.shape([2, sequence])"]
    assert _op_shapes(mod, "relax.negative").count("R.shape([2, sequence])") == 1
    # T5's j - i: the diagonals as they are (its one negative, of a [sequence] arange, is the read-back's)
    assert "R.shape([2, sequence])" not in _op_shapes(_pre_legalized(_bias(log=True)), "relax.negative")


def test_chain_without_a_transcendental_is_left_alone():
    mod = _pre_legalized(_bias(log=False))
    text = mod["main"].script()
    assert "(2, sequence)" not in text and "R.abs" in text, text


@pytest.mark.parametrize("log, full_min, i_minus_j", [(True, False, False), (False, False, False),
                                                      (True, True, False), (True, False, True),
                                                      (True, True, True)],
                         ids=["log", "no_log", "full_min", "i_minus_j", "i_minus_j_full_min"])
def test_bias_numbers(host, rng, log, full_min, i_minus_j):
    model = _bias(log=log, full_min=full_min, i_minus_j=i_minus_j)
    cm = tvmfuse.compile(model, target=host)
    for b, s in ((1, 1), (2, 5), (1, 17), (3, 40), (1, 128)):
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
    # the unit nest (every shape variable 1: schedules.buckets.unit_nest) holds its copy at sequence 1
    for extents in log_blocks:
        assert extents in (["T.int64(2)", "sequence"], ["T.int64(2)", "T.int64(1)"]), extents
    assert ["T.int64(2)", "sequence"] in log_blocks


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


# the named x86 targets and a Zen 5 (this project's host) one: the read-back's vectorization is LLVM's, so the
# test builds the kernel for each (no run: a cross build for aarch64 works on any host)
_BIAS_TARGETS = {
    "znver5-2": {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver5", "num-cores": 2},
    "skx-2": "skx-2",
    "neon-4": "neon-4",
}


@pytest.mark.parametrize("target", list(_BIAS_TARGETS))
def test_bias_rows_are_contiguous_slices_of_the_diagonal_table(target):
    """T5's form (the chain through the gather per diagonal): the scheduled bias kernel (``cpu.generic``)
    keeps the per-diagonal table [heads, 2 sequence] as its own block (``generic._reread``: its gathers and
    divisions are not folded into the [batch, heads, s, s] writes), and the output reads it at an index
    without a load or a division (``table[h, j - i + s]``: a bias row is a contiguous slice of a table row);
    built, the output's loop over j is on vectors: contiguous float vector loads, no gather."""
    import re

    import schedule_cases as S
    from tvmfuse.schedules.cpu import generic as G

    spec = _BIAS_TARGETS[target]
    tgt = tvmfuse.parse_target(spec) if isinstance(spec, dict) else named_target(spec)
    funcs = S.graph_funcs(_bias(log=True, full_min=True), tgt)
    (func,) = [f for f in funcs.values() if "log" in f.script()]
    scheduled, _report = G.schedule_generic(func, tgt)
    out_buf = [p for p in scheduled.params if hasattr(p, "shape")][-1]      # TVM: the output is last
    table_shapes, output_reads = [], []

    def visit(node):
        if not (isinstance(node, C.SBlock) and len(node.iter_vars)):
            return
        written = node.writes[0].source
        shape = list(written.shape)
        if len(shape) == 2 and isinstance(shape[0], C.tirx.IntImm) and int(shape[0]) == HEADS and \
                str(shape[1]).replace(" ", "") in ("sequence*T.int64(2)", "T.int64(2)*sequence"):
            table_shapes.append(written)
        if written.same_as(out_buf):
            C.post_order_visit(node.body, lambda n: output_reads.append(n) if isinstance(n, C.TensorLoad)
                               else None)

    C.post_order_visit(scheduled.body, visit)
    assert table_shapes, scheduled.script()
    table_reads = [ld for ld in output_reads if any(ld.source.same_as(t) for t in table_shapes)]
    assert table_reads, scheduled.script()
    for load in output_reads:
        bad = []
        for idx in load.indices:
            C.post_order_visit(idx, lambda n: bad.append(n) if isinstance(n, (C.TensorLoad, C.tirx.FloorDiv,
                                                                              C.tirx.FloorMod)) else None)
        assert not bad, f"the output reads {load.source.name} at {list(load.indices)}"

    lib = C.build_prim_module(C.IRModule({"main": scheduled.with_attr("global_symbol", "main")}), tgt)
    ll = (lib.mod if hasattr(lib, "mod") else lib).inspect_source("ll")
    # the output's nest is the last parallel loop of the kernel's parallel branch: TVM's last closure
    lambdas = re.split(r"\ndefine ", ll)
    last = [f for f in lambdas if f.startswith("private") and "__tvm_parallel_lambda" in f.split("(")[0]][-1]
    lanes = {int(n) for n in re.findall(r"load <(\d+) x float>", last)}
    assert lanes and max(lanes) >= 4, last
    assert "gather" not in last, last
