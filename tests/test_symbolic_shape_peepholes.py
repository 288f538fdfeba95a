"""Per-call shape code of symbolic token models as fusable ops (notes/symtok12.md):

- ``take_of_symbolic_shape``: ``take(shape_to_tensor(shape), k)`` (ONNX Shape -> Gather of one dim, as in
  albert_dyn's / roberta_dyn's mask and position code) -> ``arange(d, d + 1)`` as a scalar;
- ``cumsum_of_ones``: ``cumsum(full(shape, 1), axis)`` (opt_dyn's position ids from its all-ones mask) ->
  ``arange(1, n + 1)`` broadcast;
- ``matmul_of_broadcast_constant``: ``x [B h, M, K] @ transpose(reshape(broadcast_to(c, [B, h, R, C])))`` (deberta_v2_dyn's
  relative-position keys / queries per head, copied for the batch per call) -> a 4-D matmul reading ``c`` itself
  (notes/corpus13.md).

Before/expected Relax under ``Peephole`` (fires and must-not-fire), the kernel count of a small ONNX graph
with both patterns against its static build for named targets, and its outputs against onnxruntime at
several sizes.  The rows' names are in ``tests/test_passes_rewrites.py``'s peephole table check too."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmfuse
from conftest import NAMED_TARGETS
from tvmfuse import _compat as C
from tvmfuse.passes.rewrites import PEEPHOLES, Peephole
from tvmfuse.target import parse_target

relax = C.relax
op = relax.op
I64 = "int64"


def _sym_mod(body, dtype=I64):
    """main(ids: [batch, sequence] ``dtype``) computing ``body(ids, batch, sequence)`` (exprs to emit)."""
    b, s = C.tirx.Var("batch", I64), C.tirx.Var("sequence", I64)
    bb = C.BlockBuilder()
    ids = relax.Var("ids", relax.TensorType([b, s], dtype))
    with bb.function("main", [ids]):
        with bb.dataflow():
            out = None
            for e in body(ids, b, s):
                out = bb.emit(e)
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get()


def _run(passes, mod):
    with parse_target(NAMED_TARGETS["haswell-2"]):
        return C.Sequential(passes + [C.relax_transform.CanonicalizeBindings(),
                                      C.relax_transform.DeadCodeElimination()])(mod)


def _const(v, dtype):
    return relax.const(np.asarray(v, dtype))


def _stt(ids, b, s):
    return op.shape_to_tensor(relax.ShapeExpr([b, s]))


def _gather_index(c):
    k = _const(c, I64)
    return op.where(op.less(k, _const(0, I64)), op.add(k, _const(2, I64)), k)


# a constant per head [1, heads=4, R=3, C=2] (DeBERTa's relative-position keys, heads split off)
_PER_HEAD = np.arange(24, dtype=np.float32).reshape(1, 4, 3, 2) / 7.0


def _heads(ids, b, s, k):
    """x [b * 4, s, k] from the ids (a head-split activation of a symbolic batch)."""
    x = op.broadcast_to(op.reshape(op.astype(ids, "float32"), [b, 1, s, 1]), relax.ShapeExpr([b, 4, s, k]))
    return op.reshape(x, [b * 4, s, k])


def _broadcast_heads(c, b, transposed=True):
    """DeBERTa's per-head constant repeated for the batch: broadcast_to [b, 4, R, C], reshape [b * 4, R, C],
    transposed to [b * 4, C, R] (``transposed``)."""
    w = op.reshape(op.broadcast_to(relax.const(c), relax.ShapeExpr([b, *c.shape[-3:]])),
                   [b * c.shape[-3], *c.shape[-2:]])
    return op.permute_dims(w, [0, 2, 1]) if transposed else w


def _matmul_per_head(x, c, b, s, n):
    """The rewrite's form: x [b h, s, K] as [b, h, s, K] @ the constant [h, K, N], back to [b h, s, N]."""
    heads, k = c.shape[0], c.shape[1]
    y = op.matmul(op.reshape(x, relax.ShapeExpr([b, heads, s, k])), relax.const(c))
    return op.reshape(y, relax.ShapeExpr([b * heads, s, n]))


FIRES = {
    # DeBERTa's c2p keys: x [b*4, s, 2] @ transpose(reshape(broadcast_to(c, [b, 4, 3, 2]))) -> [b*4, s, 3]
    "matmul_of_broadcast_constant": (
        lambda ids, b, s: [op.matmul(_heads(ids, b, s, 2), _broadcast_heads(_PER_HEAD, b))],
        lambda ids, b, s: [_matmul_per_head(_heads(ids, b, s, 2),
                                            np.ascontiguousarray(_PER_HEAD[0].transpose(0, 2, 1)), b, s, 3)]),
    # the constant read as it is (no transpose), given without its leading 1
    "matmul_of_broadcast_constant_plain": (
        lambda ids, b, s: [op.matmul(_heads(ids, b, s, 3), _broadcast_heads(_PER_HEAD[0], b, transposed=False))],
        lambda ids, b, s: [_matmul_per_head(_heads(ids, b, s, 3), _PER_HEAD[0], b, s, 2)]),
    # ids + batch (Shape -> Gather(0)): no shape_to_tensor, no take
    "take_of_symbolic_shape": (
        lambda ids, b, s: [op.add(ids, op.take(_stt(ids, b, s), _const(0, I64), axis=0))],
        lambda ids, b, s: [op.add(ids, op.reshape(op.arange(b, b + 1, 1, I64), []))]),
    # the index wraps as ONNX Gather's negative indices do: -1 is the last dim
    "take_of_symbolic_shape_negative": (
        lambda ids, b, s: [op.add(ids, op.take(_stt(ids, b, s), _const(-1, I64), axis=0))],
        lambda ids, b, s: [op.add(ids, op.reshape(op.arange(s, s + 1, 1, I64), []))]),
    # the importer's Gather: a 1-D index [1] normalized by where(c < 0, c + 2, c) (albert_dyn's mask code)
    "take_of_symbolic_shape_gather_index": (
        lambda ids, b, s: [op.add(ids, op.take(_stt(ids, b, s), _gather_index([1]), axis=0))],
        lambda ids, b, s: [op.add(ids, op.arange(s, s + 1, 1, I64))]),
    # OPT: cumsum of the all-ones mask along the sequence (the last axis: no reshape)
    "cumsum_of_ones": (
        lambda ids, b, s: [op.cumsum(op.full((b, s), _const(1.0, "float32"), "float32"), axis=1)],
        lambda ids, b, s: [op.broadcast_to(op.arange(1, s + 1, 1, "float32"), relax.ShapeExpr([b, s]))]),
    # along the batch axis: the ramp reshaped to a column first
    "cumsum_of_ones_axis0": (
        lambda ids, b, s: [op.cumsum(op.full((b, s), _const(1, I64), I64), axis=0)],
        lambda ids, b, s: [op.broadcast_to(op.reshape(op.arange(1, b + 1, 1, I64), [b, 1]),
                                           relax.ShapeExpr([b, s]))]),
}
NOT_FIRES = {
    # a weight computed from data (not a constant): the matmul reads the copy
    "matmul_of_broadcast_data": lambda ids, b, s: [op.matmul(
        _heads(ids, b, s, 2),
        op.permute_dims(op.reshape(op.broadcast_to(op.reshape(op.astype(op.take(ids, relax.const(0, I64), axis=1),
                                                                          "float32"), [b, 1, 1, 1]),
                                                   relax.ShapeExpr([b, 4, 3, 2])), [b * 4, 3, 2]), [0, 2, 1]))],
    # a constant that differs per sequence of the batch (leading dim 2, broadcast to 2): no per-head constant
    "matmul_of_two_constants": lambda ids, b, s: [op.matmul(
        op.reshape(op.broadcast_to(op.reshape(op.astype(ids, "float32"), [b, 1, s, 1]), relax.ShapeExpr([2, 4, s, 3])),
                   [8, s, 3]),
        op.reshape(op.broadcast_to(relax.const(np.concatenate([_PER_HEAD] * 2)), relax.ShapeExpr([2, 4, 3, 2])),
                   [8, 3, 2]))],
    # a shape of constants: FoldConstant's job
    "take_of_static_shape": lambda ids, b, s: [
        op.add(ids, op.take(op.shape_to_tensor(relax.ShapeExpr([2, 3])), _const(0, I64), axis=0))],
    # two indices: a tensor, not one dim
    "take_of_two_dims": lambda ids, b, s: [op.take(_stt(ids, b, s), _const([0, 1], I64), axis=0)],
    # an index computed from data, not the importer's normalization of a constant
    "take_of_data_index": lambda ids, b, s: [
        op.take(_stt(ids, b, s), op.take(op.reshape(ids, [b * s]), _const(0, I64), axis=0), axis=0)],
    # a fill of 2: cumsum is 2, 4, ... (the row only rewrites ones)
    "cumsum_of_twos": lambda ids, b, s: [op.cumsum(op.full((b, s), _const(2.0, "float32"), "float32"), axis=1)],
    "cumsum_exclusive": lambda ids, b, s: [
        op.cumsum(op.full((b, s), _const(1.0, "float32"), "float32"), axis=1, exclusive=True)],
    # a scan of data
    "cumsum_of_ids": lambda ids, b, s: [op.cumsum(ids, axis=1)],
}


def test_every_symbolic_row_is_tested():
    from test_passes_rewrites import SYMBOLIC_ROWS

    rows = {r.name for r in PEEPHOLES}
    assert set(SYMBOLIC_ROWS) <= rows
    assert {row for row in SYMBOLIC_ROWS if any(case.startswith(row) for case in FIRES)} == set(SYMBOLIC_ROWS)


@pytest.mark.parametrize("name", sorted(FIRES))
def test_symbolic_peephole(name):
    before, expected = FIRES[name]
    C.assert_structural_equal(_run([Peephole()], _sym_mod(before)), _run([], _sym_mod(expected)))


@pytest.mark.parametrize("name", sorted(NOT_FIRES))
def test_symbolic_peephole_must_not_fire(name):
    before = _sym_mod(NOT_FIRES[name])
    C.assert_structural_equal(_run([Peephole()], before), _run([], before))


# ------------------------------------------------------------------ a token-embedding graph with both patterns
VOCAB, POSITIONS, HIDDEN, OFFSET = 50, 140, 8, 2


def _model(batch, sequence, seed: int = 0) -> onnx.ModelProto:
    """OPT-style embeddings: ``emb[ids] + pos[cumsum(ones(shape(ids)), 1) - 1 + OFFSET]``, times the batch
    size read from the shape (ALBERT/RoBERTa's ``Shape -> Gather`` of one dim), a [batch, sequence,
    HIDDEN] output."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), "emb"),
             numpy_helper.from_array(rng.standard_normal((POSITIONS, HIDDEN)).astype(np.float32), "pos"),
             numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one_f"),
             numpy_helper.from_array(np.array(1, np.int64), "axis1"),
             numpy_helper.from_array(np.array(OFFSET - 1, np.int64), "offset")]
    n = helper.make_node
    nodes = [
        n("Shape", ["ids"], ["shape"]),
        n("ConstantOfShape", ["shape"], ["ones"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
        n("CumSum", ["ones", "axis1"], ["csum"]),
        n("Cast", ["csum"], ["csum_i"], to=TensorProto.INT64),
        n("Add", ["csum_i", "offset"], ["positions"]),
        n("Gather", ["pos", "positions"], ["pos_e"]),
        n("Gather", ["emb", "ids"], ["tok_e"]),
        n("Add", ["tok_e", "pos_e"], ["e"]),
        n("Gather", ["shape", "zero"], ["nb"]),
        n("Cast", ["nb"], ["nb_f"], to=TensorProto.FLOAT),
        n("Mul", ["e", "nb_f"], ["y"]),
    ]
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [batch, sequence])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, sequence, HIDDEN])
    m = helper.make_model(helper.make_graph(nodes, "positions", [ids], [y], inits),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def _kernels(model, target: str) -> list[str]:
    from tvmfuse.pipeline import PipelineOptions, graph_stage
    from tvmfuse.report import graph_stats

    tgt = parse_target(NAMED_TARGETS[target])
    with tgt:
        mod = C.Sequential(graph_stage(tgt, PipelineOptions()))(tvmfuse.load_onnx(model))
    return graph_stats(mod).kernel_names


@pytest.mark.parametrize("target", ["haswell-2", "skx-2", "neon-4"])
def test_symbolic_position_code_has_the_static_kernel_count(target):
    """Structure: the symbolic graph has as many kernels as the static one (one: the lookups, the add and
    the scale), no scan, fill, shape_to_tensor or take kernel of its own."""
    static = _kernels(_model(2, 5), target)
    dyn = _kernels(_model("batch", "sequence"), target)
    assert len(dyn) == len(static) == 1, (static, dyn)
    assert not any(k.startswith(("cumsum", "full", "shape_to_tensor", "take")) for k in dyn), dyn


@pytest.mark.parametrize("dims", [(1, 1), (3, 17), (2, 128)])
def test_symbolic_position_code_matches_onnxruntime(dims, rng):
    ort = pytest.importorskip("onnxruntime")
    model = _model("batch", "sequence", seed=int(rng.integers(2**31)))
    cm = tvmfuse.compile(model)
    ids = rng.integers(0, VOCAB, size=dims).astype(np.int64)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]
    np.testing.assert_allclose(cm.run({"ids": ids})["y"], want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------ DeBERTa's per-head position keys over a symbolic batch
HEADS, HEAD_DIM, SPAN = 4, 8, 6


def _position_keys_mod(batch, sequence, keys: np.ndarray):
    """DeBERTa-style c2p scores as TVM's importer gives them for deberta_v2_dyn (the ONNX importer takes no
    computed shape for the head split here, so the Relax form is built directly): x [batch, sequence,
    HEADS * HEAD_DIM] split into heads ([batch * HEADS, sequence, HEAD_DIM]) times the relative-position keys,
    a constant [1, HEADS, SPAN, HEAD_DIM] broadcast to the batch, reshaped to [batch * HEADS, SPAN, HEAD_DIM]
    and transposed: [batch * HEADS, sequence, SPAN].  ``batch`` an int: the static build (FoldConstant folds
    the broadcast keys); a name: a symbolic batch."""
    b = C.tirx.Var(batch, I64) if isinstance(batch, str) else batch
    bb = C.BlockBuilder()
    x = relax.Var("x", relax.TensorType([b, sequence, HEADS * HEAD_DIM], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            xh = bb.emit(op.permute_dims(op.reshape(x, [b, sequence, HEADS, HEAD_DIM]), [0, 2, 1, 3]))
            xh = bb.emit(op.reshape(xh, [b * HEADS, sequence, HEAD_DIM]))
            kb = bb.emit(op.broadcast_to(relax.const(keys), relax.ShapeExpr([b, HEADS, SPAN, HEAD_DIM])))
            kt = bb.emit(op.permute_dims(op.reshape(kb, [b * HEADS, SPAN, HEAD_DIM]), [0, 2, 1]))
            gv = bb.emit_output(op.matmul(xh, kt))
        bb.emit_func_output(gv)
    return bb.get()


def _reference(x, keys):
    b, s, _ = x.shape
    xh = x.reshape(b, s, HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
    return np.einsum("bhsd,hpd->bhsp", xh.astype(np.float64), keys[0].astype(np.float64)).reshape(b * HEADS, s, SPAN)


def _keys(seed=0):
    return np.random.default_rng(seed).standard_normal((1, HEADS, SPAN, HEAD_DIM)).astype(np.float32)


def _mod_kernels(mod, target: str) -> list[str]:
    from tvmfuse.pipeline import PipelineOptions, graph_stage
    from tvmfuse.report import graph_stats

    tgt = parse_target(NAMED_TARGETS[target])
    with tgt:
        return graph_stats(C.Sequential(graph_stage(tgt, PipelineOptions()))(mod)).kernel_names


@pytest.mark.parametrize("target", ["haswell-2", "skx-2", "neon-4"])
def test_symbolic_position_keys_have_the_static_kernel_count(target):
    """Structure: the symbolic graph has the static build's kernels (the matmul with its head split), no
    broadcast_to kernel copying the keys per call (deberta_v2_dyn: 37 -> 33 kernels, the static count)."""
    static = _mod_kernels(_position_keys_mod(2, 5, _keys()), target)
    dyn = _mod_kernels(_position_keys_mod("batch", 5, _keys()), target)
    assert len(dyn) == len(static), (static, dyn)
    assert not any("broadcast_to" in k for k in dyn), dyn


@pytest.mark.parametrize("batch, sequence", [(1, 1), (3, 17), (8, 5)])
def test_symbolic_position_keys_match_the_reference(batch, sequence, rng):
    """Numbers: the symbolic build (sequence static per build: the rewrite is over the batch) against numpy's
    float64 product of the unfused graph at fresh inputs."""
    keys = _keys(int(rng.integers(2**31)))
    cm = tvmfuse.compile(_position_keys_mod("batch", sequence, keys))
    x = rng.standard_normal((batch, sequence, HEADS * HEAD_DIM)).astype(np.float32)
    (got,) = cm.run({"x": x}).values()
    np.testing.assert_allclose(got, _reference(x, keys), rtol=1e-5, atol=1e-5)
