"""Issue 13, Llama's rotary embedding over symbolic batch/sequence: a reshape of the projection into
heads, the halves sliced, negated and concatenated (rotate_half), times cos/sin.  TVM's reshape lowering
recomputed the source index through ``// sequence % batch``; in the fused kernel LLVM spent minutes on
those indices (one set per concat arm).  passes/legalize.py keeps the shared leading dims in place."""
import numpy as np
import pytest

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


# ------------------------------------------------------------ rotate-half lanes: the select's pieces (sym10)
NAMED_TARGETS = {
    "haswell": '{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "haswell", "num-cores": 2}',
    "skylake-avx512": '{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512", "num-cores": 8}',
    "neoverse-n1": '{"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "neoverse-n1", "num-cores": 4}',
}


def _scheduled_kernel(model, target: str):
    from tvmfuse.pipeline import PipelineOptions, graph_stage
    from tvmfuse.schedules import schedule_prim_func
    from tvmfuse.target import parse_target

    tgt = parse_target(target)
    mod = tvmfuse.load_onnx(model)
    with tgt:
        mod = C.Sequential(graph_stage(tgt, PipelineOptions()))(mod)
    (name, func), = [(str(gv.name_hint), f) for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)]
    res = schedule_prim_func(func, tgt, {}, name)
    assert res is not None and res.template == "cpu.elementwise", res and res.template
    return res.func, tgt


def _loops(func) -> list:
    loops = []
    C.post_order_visit(func.body, lambda n: loops.append(n) if isinstance(n, C.tirx.For) else None)
    return loops


def _float_selects(mod) -> list[str]:
    """The float if_then_else calls left in a lowered module (the argument unpacking's are handles)."""
    found = []
    for _, f in mod.functions.items():
        C.post_order_visit(f.body, lambda n: found.append(str(n)[:120])
                           if getattr(getattr(n, "op", None), "name", "") == "prim.if_then_else"
                           and str(n.ty).startswith("float") else None)
    return found


def _vector_lanes(func) -> set[int]:
    return {int(lp.extent) for lp in _loops(func) if int(lp.kind) == int(C.ForKind.VECTORIZED)}


def _partition_hints(func) -> int:
    return sum(1 for lp in _loops(func) if "pragma_loop_partition_hint" in lp.annotations)


@pytest.mark.parametrize("target", list(NAMED_TARGETS))
def test_rotate_half_lanes_are_split_where_the_concat_flips(target):
    """llama_dyn's rotary kernels: the concat's ``if_then_else(8 <= i, x[i - 8], -x[(h * 16 + i + 8) % 32])``
    over a 16-lane vector loop made TVM's vectorizer scalarize the lane loop (14.9 us against 1.15 with the
    split, kernel-only at sequence 128, one thread, under load).  The vector loop is split at 8 under a
    loop-partition hint: each piece has the condition constant, and no float select is left after lowering
    (8-lane pieces; NEON: two 4-lane vectors per piece)."""
    func, tgt = _scheduled_kernel(rotary(), NAMED_TARGETS[target])
    assert _partition_hints(func) >= 1
    lanes = {"haswell": 8, "skylake-avx512": 8, "neoverse-n1": 4}[target]
    assert _vector_lanes(func) == {lanes}, _vector_lanes(func)
    lowered = C.lower_tir(C.IRModule({"main": func.with_attr("global_symbol", "main")}), tgt)
    assert _float_selects(lowered) == []


def head_scale(batch="batch", seq="seq"):
    """The rotary layout without the concat: no select on the lanes."""
    g = M._G("head_scale_dyn")
    x = g.input("x", (batch, seq, 64))
    cos = g.input("cos", (seq, 16))
    h = g.op("Transpose", g.op("Reshape", x, g.const(I64([0, 0, 4, 16]))), perm=[0, 2, 1, 3])
    g.op("Mul", h, cos)
    g.rename_last("y", (batch, 4, seq, 16))
    return g.model()


@pytest.mark.parametrize("target", ["haswell", "skylake-avx512"])
def test_lanes_without_a_select_stay_whole_vectors(target):
    func, _ = _scheduled_kernel(head_scale(), NAMED_TARGETS[target])
    assert _partition_hints(func) == 0
    assert _vector_lanes(func) == {16 if target == "skylake-avx512" else 8}


_BOUNDS_FUNC = """
@T.prim_func(private=True, s_tir=True)
def main(var_x: T.handle, var_y: T.handle):
    n = T.int64()
    x = T.match_buffer(var_x, (n, T.int64(4), T.int64(16)), "float32")
    y = T.match_buffer(var_y, (n, T.int64(4), T.int64(16)), "float32")
    for i, j, k in T.grid(n, T.int64(4), T.int64(16)):
        with T.sblock("y"):
            vi, vj, vk = T.axis.remap("SSS", [i, j, k])
            y[vi, vj, vk] = T.if_then_else(COND, x[vi, vj, vk], T.float32(0))
"""


@pytest.mark.parametrize("cond, n_inner, want", [
    ("T.int64(8) <= vk", 2, [8]), ("vk < T.int64(8)", 2, [8]), ("vk <= T.int64(7)", 2, [8]),
    ("T.int64(7) < vk", 2, [8]), ("vj < T.int64(1)", 2, [16]), ("vk == T.int64(3)", 2, [3, 4]),
    ("T.int64(20) <= vk", 2, []),        # never flips inside the axis
    ("vi < T.int64(2)", 2, []),          # the symbolic outer axis: not a lane
    ("T.int64(8) <= vk", 0, []),
])
def test_lane_condition_bounds(cond, n_inner, want):
    from tvmfuse.schedules.cpu.common import lane_condition_bounds

    func = C.parse_script(_BOUNDS_FUNC.replace("COND", cond))
    sch = C.Schedule(func)
    assert sorted(set(lane_condition_bounds(sch, sch.get_sblock("y"), n_inner))) == want
