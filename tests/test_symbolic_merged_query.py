"""Attention whose query rows are merged with the batch (issue 13; torchvision's LeViT, ``corpus/levit_dyn.onnx``).

LeViT's subsampling attention projects its queries with ``Linear_BN``: the BatchNorm runs over
``x.flatten(0, 1)``, so after BN folding the attention kernel reads its queries as one ``[batch * 4, C]``
tensor (axes ``(b0, i), (b1, d)``).  Over a symbolic batch that extent is ``batch * 4``, an expression: the
kernel spec took plain symbols only and refused it ("symbolic extent batch * T.int64(4) is not a plain
symbol"), leaving the symbolic build 2 kernels over the static one per such block (levit_dyn 61 vs 59).
The spec now takes a sum or product of symbols whose symbols are some operand's plain extent
(``attention._EXTENT_OPS``; K/V give ``batch``), JSON ``["*", "batch", 4]``.

The ONNX graph below is one such block, built with onnx.helper, static and with a symbolic batch.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tvmfuse import _compat as C
from tvmfuse.schedules.cpu.attention import ATTR, AttentionSpec, Operand
from test_symbolic_windows import _graph, check_against_onnxruntime   # graph stage on a named target; vs ort

N, NQ, C_IN, HEADS, KD, DV = 16, 4, 16, 2, 8, 8


def _model(batch, seed: int = 0) -> onnx.ModelProto:
    """x [batch, N, C_IN] -> K/V from every token, Q from the first NQ tokens flattened to [batch * NQ, C_IN] (LeViT's
    Linear_BN flattens batch and rows) -> softmax(q k^T * s + bias) v -> [batch, NQ, HEADS * DV]."""
    rng = np.random.default_rng(seed)
    const = lambda name, arr: numpy_helper.from_array(np.asarray(arr), name)
    inits = [
        const("s_rows", np.array([-1, C_IN], np.int64)),
        const("s_q", np.array([-1, NQ, HEADS, KD], np.int64)),
        const("s_kv", np.array([-1, N, HEADS, KD + DV], np.int64)),
        const("s_out", np.array([-1, NQ, HEADS * DV], np.int64)),
        const("split", np.array([KD, DV], np.int64)),
        const("starts", np.array([0], np.int64)), const("ends", np.array([NQ], np.int64)),
        const("axes", np.array([1], np.int64)),
        const("w_q", (rng.standard_normal((C_IN, HEADS * KD)) * 0.3).astype(np.float32)),
        const("b_q", (rng.standard_normal(HEADS * KD) * 0.1).astype(np.float32)),
        const("w_kv", (rng.standard_normal((C_IN, HEADS * (KD + DV))) * 0.3).astype(np.float32)),
        const("bias", rng.standard_normal((HEADS, NQ, N)).astype(np.float32)),
        const("scale", np.array(KD ** -0.5, np.float32)),
    ]
    n = helper.make_node
    nodes = [
        n("MatMul", ["x", "w_kv"], ["kv0"]),
        n("Reshape", ["kv0", "s_kv"], ["kv1"]),
        n("Split", ["kv1", "split"], ["k0", "v0"], axis=3),
        n("Transpose", ["k0"], ["kt"], perm=[0, 2, 3, 1]),             # [batch, HEADS, KD, N]
        n("Transpose", ["v0"], ["v"], perm=[0, 2, 1, 3]),              # [batch, HEADS, N, DV]
        n("Slice", ["x", "starts", "ends", "axes"], ["xs"]),           # [batch, NQ, C_IN]
        n("Reshape", ["xs", "s_rows"], ["xr"]),                        # [batch * NQ, C_IN]
        n("MatMul", ["xr", "w_q"], ["q0"]),
        n("Add", ["q0", "b_q"], ["q1"]),                               # [batch * NQ, HEADS * KD]
        n("Reshape", ["q1", "s_q"], ["q2"]),
        n("Transpose", ["q2"], ["q"], perm=[0, 2, 1, 3]),              # [batch, HEADS, NQ, KD]
        n("MatMul", ["q", "kt"], ["s0"]),
        n("Mul", ["s0", "scale"], ["s1"]),
        n("Add", ["s1", "bias"], ["s2"]),
        n("Softmax", ["s2"], ["p"], axis=-1),
        n("MatMul", ["p", "v"], ["o0"]),
        n("Transpose", ["o0"], ["o1"], perm=[0, 2, 1, 3]),
        n("Reshape", ["o1", "s_out"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, N, C_IN])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, NQ, HEADS * DV])
    m = helper.make_model(helper.make_graph(nodes, "subsample_attention", [x], [y], inits),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def _specs(mod) -> list[dict]:
    return [json.loads(str(f.attrs[ATTR])) for f in mod.functions.values()
            if isinstance(f, C.PrimFunc) and f.attrs is not None and ATTR in f.attrs]


@pytest.mark.parametrize("target", ["haswell-2", "skx-2", "neon-4"])
def test_merged_query_rows_get_the_static_groups(target):
    """Structure: the symbolic build has the static build's kernels, one of them the attention kernel,
    whose spec reads q as [batch * 4, HEADS * KD] (the expression in JSON)."""
    static_kernels, static_mod = _graph(_model(2), target)
    dyn_kernels, dyn_mod = _graph(_model("batch"), target)
    assert len(dyn_kernels) == len(static_kernels), (sorted(static_kernels), sorted(dyn_kernels))
    assert "softmax" not in dyn_kernels, dyn_kernels
    specs = _specs(dyn_mod)
    assert len(specs) == 1, dyn_kernels
    assert specs[0]["q"]["shape"] == [["*", "batch", NQ], HEADS * KD], specs[0]["q"]
    assert specs[0]["q"]["axes"] == [["b0", "i"], ["b1", "d"]]
    assert _specs(static_mod)[0]["q"]["shape"] == [2 * NQ, HEADS * KD]


@pytest.mark.parametrize("run_batch", [1, 3, 8])
def test_merged_query_rows_match_onnxruntime(run_batch, rng):
    """Numerics: the symbolic build (the kernel on cpu.attention, nothing unscheduled) against onnxruntime."""
    model = _model("batch", seed=int(rng.integers(2**31)))
    check_against_onnxruntime(model, rng.standard_normal((run_batch, N, C_IN)).astype(np.float32))


def _spec(q_shape, kv_batch) -> AttentionSpec:
    """A spec over q [q_shape] (axes (b0, i), (b1, d)) and K/V [kv_batch, HEADS, N, ...]."""
    return AttentionSpec(
        batch=(kv_batch, HEADS), sq=NQ, sk=N, d=KD, dv=DV,
        q=Operand((("b0", "i"), ("b1", "d")), q_shape),
        k=Operand(("b0", "b1", "j", "d"), (kv_batch, HEADS, N, KD)),
        v=Operand(("b0", "b1", "j", "e"), (kv_batch, HEADS, N, DV)),
        out=Operand(("b0", "b1", "i", "e"), (kv_batch, HEADS, NQ, DV)))


def test_expression_extent_round_trips_through_json_and_bind():
    """``to_json`` writes [op, a, b]; ``from_json`` + ``bind`` rebuild it over the kernel's own var."""
    batch = C.tirx.Var("batch", "int64")
    spec = _spec((batch * NQ, HEADS * KD), batch)
    spec.validate()
    assert set(spec.symbols()) == {"batch"}
    back = AttentionSpec.from_json(spec.to_json())
    assert back.q.shape == (("*", "batch", NQ), HEADS * KD) and not back.is_static()
    own = C.tirx.Var("batch", "int64")
    bound = back.bind({"batch": own})
    assert C.Analyzer().can_prove_equal(bound.q.shape[0], own * NQ)
    assert bound.to_json() == spec.to_json()


def test_expression_over_a_symbol_no_operand_defines_is_refused():
    """Must not fire: q [rows * 4, ..] where ``rows`` is no operand's plain extent (call_tir could not bind
    it from the tensors) is refused with the reason; a division (no sum or product) as before."""
    batch, rows = C.tirx.Var("batch", "int64"), C.tirx.Var("rows", "int64")
    spec = _spec((rows * NQ, HEADS * KD), batch)
    with pytest.raises(ValueError, match=r"not a plain symbol, and its symbols \['rows'\] are no operand"):
        spec.validate()
    with pytest.raises(ValueError, match=r"is not a plain symbol \(batch, sequence\)"):
        _spec((C.tirx.floordiv(batch * 8, 2), HEADS * KD), batch).validate()
