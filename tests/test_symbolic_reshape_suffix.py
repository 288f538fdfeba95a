"""Issue 13, deberta_v2's masked softmax over symbolic batch/sequence: the scores ``[batch * 4, seq, seq]`` are
viewed per head ``[batch, 4, seq, seq]`` for the mask and back.  TOPI's reshape recomputed every source
index from the flat index (``// seq // seq % (batch * 4)``), which no template reads as rows: the softmax
kernel ran on ``cpu.generic``.  ``legalize.reshape_plan`` keeps the shared trailing dims in place and
re-indexes only the part between (one dim on one side): ``p[b * 4 + h, i, j]``, ``p[f // 4, f % 4, i, j]``.

Structure on named targets: the plan, the reshape's indices (no division by a symbolic extent) and the
template that schedules the fused softmax; numerics against onnx's reference on fresh random inputs at
several sizes; must not fire: static shapes, no shared trailing dim, several dims on both sides.
"""
import numpy as np
import pytest
from onnx import TensorProto

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.passes.legalize import reshape_plan

from conftest import NAMED_TARGETS

I64 = lambda v: np.array(v, np.int64)  # noqa: E731
SEQ = C.tirx.Var("seq", "int64")
BATCH = C.tirx.Var("batch", "int64")


def _i(v):
    return C.IntImm("int64", v)


def masked_head_softmax(batch="batch", seq="seq", heads=4):
    """q [batch, heads, seq, 16] @ k^T -> scores merged to [batch * heads, seq, seq] and scaled -> viewed
    [batch, heads, seq, seq] -> where(mask [batch, 1, seq, seq], -1e9, scores) -> softmax over the keys ->
    viewed back [batch * heads, seq, seq] (deberta_v2's XSoftmax between its score and value products)."""
    g = M._G("masked_head_softmax")
    q = g.input("q", (batch, heads, seq, 16))
    k = g.input("k", (batch, heads, 16, seq))
    mask = g.input("mask", (batch, 1, seq, seq), dtype=TensorProto.BOOL)
    mm = g.op("MatMul", q, k)

    def dims(x, axes):          # PyTorch's export of x.size(a): Shape -> Gather -> Unsqueeze, per axis
        shape = g.op("Shape", x)
        return [g.op("Unsqueeze", g.op("Gather", shape, g.const(np.int64(a))), g.const(I64([0]))) for a in axes]

    scores = g.op("Reshape", mm, g.op("Concat", g.const(I64([-1])), *dims(mm, (2, 3)), axis=0))
    scaled = g.op("Mul", scores, g.const(np.float32(0.25)))
    v = g.op("Reshape", scaled, g.op("Concat", g.const(I64([-1, heads])), *dims(scores, (1, 2)), axis=0))
    w = g.op("Where", mask, g.const(np.float32(-1e9)), v)
    p = g.op("Softmax", w, axis=-1)
    g.op("Reshape", p, g.op("Concat", g.const(I64([-1])), *dims(p, (2, 3)), axis=0))
    rows = batch * heads if isinstance(batch, int) else "rows"
    g.rename_last("y", (rows, seq, seq))
    return g.model()


def _feeds(rng, b, s, heads=4):
    return {"q": rng.standard_normal((b, heads, s, 16)).astype(np.float32),
            "k": rng.standard_normal((b, heads, 16, s)).astype(np.float32),
            "mask": rng.random((b, 1, s, s)) < 0.3}


def test_plan():
    four = _i(4)
    assert reshape_plan([BATCH * 4, SEQ, SEQ], [BATCH, four, SEQ, SEQ]) == (0, 2)     # split: one dim in
    assert reshape_plan([BATCH, four, SEQ, SEQ], [BATCH * 4, SEQ, SEQ]) == (1, 2) or \
        reshape_plan([BATCH, four, SEQ, SEQ], [BATCH * 4, SEQ, SEQ]) == (0, 2)
    assert reshape_plan([BATCH * SEQ, _i(32)], [BATCH, SEQ, _i(32)]) == (0, 1)
    # the prefix plan still comes first: shared leading dims, static remainder
    assert reshape_plan([SEQ, _i(64)], [SEQ, four, _i(16)]) == (1, 0)


def test_plan_does_not_apply():
    four = _i(4)
    assert reshape_plan([_i(8), _i(3), _i(3)], [_i(2), four, _i(3), _i(3)]) is None        # static: TVM's
    assert reshape_plan([BATCH * SEQ, _i(32)], [BATCH, SEQ, four, _i(8)]) is None           # no shared tail
    assert reshape_plan([BATCH, four, SEQ, _i(2)], [BATCH * 2, _i(2), SEQ, _i(2)]) is None  # 2 dims each side


def _symbolic_divisions(func) -> list[str]:
    found = []

    def visit(node):
        if isinstance(node, (C.tirx.FloorDiv, C.tirx.FloorMod)) and not isinstance(node.b, C.tirx.IntImm):
            found.append(str(node))

    C.post_order_visit(func.body, visit)
    return found


def _softmax_kernels(cm) -> list:
    return [s for s in cm.report.schedules if "softmax" in s["kernel"]]


@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
def test_masked_softmax_over_head_views_is_a_row_kernel(target):
    t = C.Target(NAMED_TARGETS[target])
    cm = tvmfuse.compile(masked_head_softmax(), target=t)
    soft = _softmax_kernels(cm)
    assert [s["template"] for s in soft] == ["cpu.symbolic_rows"], cm.report.schedules
    fused = [f for gv, f in cm.fused_module.functions.items()
             if isinstance(f, C.PrimFunc) and gv.name_hint == soft[0]["kernel"]]
    assert len(fused) == 1 and _symbolic_divisions(fused[0]) == []


def test_masked_softmax_matches_the_reference(host, rng):
    model = masked_head_softmax()
    cm = tvmfuse.compile(model, target=host)
    for b, s in ((1, 1), (1, 17), (3, 5), (2, 128)):
        feeds = _feeds(rng, b, s)
        want = M.reference_outputs(model, feeds)["y"]
        np.testing.assert_allclose(cm.run(feeds)["y"], want, rtol=1e-5, atol=1e-5, err_msg=f"{b}x{s}")


def test_static_build_keeps_tvms_reshape(host, rng):
    model = masked_head_softmax(batch=2, seq=5)
    cm = tvmfuse.compile(model, target=host)
    feeds = _feeds(rng, 2, 5)
    np.testing.assert_allclose(cm.run(feeds)["y"], M.reference_outputs(model, feeds)["y"], rtol=1e-5, atol=1e-5)
