"""Issue 13, Llama's rotary embedding over symbolic batch/sequence: a reshape of the projection into
heads, the halves sliced, negated and concatenated (rotate_half), times cos/sin.  TVM's reshape lowering
recomputed the source index through ``// sequence % batch``; in the fused kernel LLVM spent minutes on
those indices (one set per concat arm).  passes/legalize.py keeps the shared leading dims in place."""
import numpy as np

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.passes.legalize import prefix_reshape_plan

I64 = lambda v: np.array(v, np.int64)  # noqa: E731


def rotary(batch="batch", seq="seq"):
    g = M._G("rotary_dyn")
    x = g.input("x", (batch, seq, 64))
    cos = g.input("cos", (seq, 16))
    sin = g.input("sin", (seq, 16))
    h = g.op("Transpose", g.op("Reshape", x, g.const(I64([0, 0, 4, 16]))), perm=[0, 2, 1, 3])
    x1 = g.op("Slice", h, g.const(I64([0])), g.const(I64([8])), g.const(I64([3])))
    x2 = g.op("Slice", h, g.const(I64([8])), g.const(I64([16])), g.const(I64([3])))
    rot = g.op("Concat", g.op("Neg", x2), x1, axis=3)
    g.op("Add", g.op("Mul", h, cos), g.op("Mul", rot, sin))
    g.rename_last("y", (batch, 4, seq, 16))
    return g.model()


def _symbolic_divisions(func) -> list[str]:
    """Every floordiv/floormod in ``func`` whose divisor is not a constant."""
    found = []

    def visit(node):
        if isinstance(node, (C.tirx.FloorDiv, C.tirx.FloorMod)) and not isinstance(node.b, C.tirx.IntImm):
            found.append(str(node))

    C.post_order_visit(func.body, visit)
    return found


def test_rotary_kernel_has_no_division_by_a_symbolic_extent(host):
    cm = tvmfuse.compile(rotary(), target=host)
    assert cm.kernel_count == 1, cm.report.groups
    fused = [f for gv, f in cm.fused_module.functions.items() if isinstance(f, C.PrimFunc)]
    assert len(fused) == 1
    assert _symbolic_divisions(fused[0]) == []


def test_rotary_matches_the_reference_at_several_sizes(host, rng):
    model = rotary()
    cm = tvmfuse.compile(model, target=host)
    for b, s in ((1, 17), (3, 128), (2, 1)):
        feeds = {"x": rng.standard_normal((b, s, 64)).astype(np.float32),
                 "cos": rng.standard_normal((s, 16)).astype(np.float32),
                 "sin": rng.standard_normal((s, 16)).astype(np.float32)}
        want = M.reference_outputs(model, feeds)["y"]
        np.testing.assert_allclose(cm.run(feeds)["y"], want, rtol=1e-5, atol=1e-5, err_msg=f"{b}x{s}")


def test_static_rotary_keeps_tvms_reshape(host):
    assert prefix_reshape_plan([C.IntImm("int64", 2), C.IntImm("int64", 64)],
                               [C.IntImm("int64", 2), C.IntImm("int64", 4), C.IntImm("int64", 16)]) is None
    static = tvmfuse.compile(rotary(2, 17), target=host)
    assert static.kernel_count == 1


def test_reshape_of_a_symbolic_tail_keeps_tvms_reshape():
    s = C.tirx.Var("seq", "int64")
    four = C.IntImm("int64", 4)
    assert prefix_reshape_plan([four, s], [s, four]) is None          # no shared leading dim
    assert prefix_reshape_plan([four, s, four], [four, s * 4]) is None   # symbolic dim after the prefix
    assert prefix_reshape_plan([s, C.IntImm("int64", 64)], [s, four, C.IntImm("int64", 16)]) == 1
