"""CNN kernels over a symbolic batch (issue 13): a model exported with a dynamic batch gets the static
conv, depthwise, pointwise and pooling templates (tvmfuse/schedules/cpu/conv2d.py, conv1x1.py,
depthwise.py, reduction.py), not the one-row-at-a-time ``cpu.symbolic_rows``.

Conv + BatchNorm + ReLU (+ residual add) graphs, pooling graphs: the symbolic build has the kernels of the
static one, each scheduled by the same family, and matches onnx's reference evaluator at batch 1, 3
and 8 (fresh random inputs); on named targets the symbolic kernel's loop nest is the static batch-1 kernel's
with the batch folded into the parallel loop (same register tile, same vector loops, same knobs), or, where
the static default's parallel loop changes with the batch, one nest per size bucket, each the static
kernel's at a batch inside the bucket; knob choices of the space apply to the symbolic kernel and stay
correct.
"""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.pipeline import PipelineOptions, graph_stage
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.base import schedule_with
from tvmfuse.schedules.cpu import TEMPLATES
from tvmfuse.schedules.cpu.common import MAX_STACK_ALLOCA_BYTES

from conftest import NAMED_TARGETS, named_target

CONV = "cpu.conv2d_epilogue"
POINTWISE = "cpu.conv1x1"
DEPTHWISE = "cpu.depthwise_conv2d_epilogue"
ROWS = "cpu.row_reduction"
LANES = "cpu.conv2d_lanes"       # KxK convs on planes under the table's plane_pixels_below (static: 256)
POOL = "cpu.window_pool"
SYMBOLIC_ROWS = "cpu.symbolic_rows"


def cnn_block(batch, cin, cout, h, w, k=3, stride=1, group=1, residual=True, pool=None, seed=0):
    """x[batch, cin, h, w] -> Conv(k, stride, pad k//2, group) -> BatchNorm -> ReLU [-> + res] [-> pool]:
    ``pool`` "max" (MaxPool 3x3 stride 2 pad 1) or "global" (GlobalAveragePool + Flatten)."""
    rng = np.random.default_rng(seed)
    pad = k // 2
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    inits = [numpy_helper.from_array((rng.standard_normal((cout, cin // group, k, k))
                                      / np.sqrt(cin // group * k * k)).astype(np.float32), "W")]
    for name, v in (("s", 1 + 0.1 * rng.standard_normal(cout)), ("b", 0.1 * rng.standard_normal(cout)),
                    ("m", 0.1 * rng.standard_normal(cout)), ("v", 1 + 0.1 * np.abs(rng.standard_normal(cout)))):
        inits.append(numpy_helper.from_array(v.astype(np.float32), name))
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], kernel_shape=[k, k], strides=[stride, stride],
                              pads=[pad] * 4, group=group),
             helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["bn"], epsilon=1e-5),
             helper.make_node("Relu", ["bn"], ["r"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, cin, h, w])]
    last = "r"
    if residual:
        inputs.append(helper.make_tensor_value_info("res", TensorProto.FLOAT, [batch, cout, oh, ow]))
        nodes.append(helper.make_node("Add", [last, "res"], ["a"]))
        last = "a"
    out_shape = [batch, cout, oh, ow]
    if pool == "max":
        nodes.append(helper.make_node("MaxPool", [last], ["p"], kernel_shape=[3, 3], strides=[2, 2],
                                      pads=[1, 1, 1, 1]))
        last, out_shape = "p", [batch, cout, (oh - 1) // 2 + 1, (ow - 1) // 2 + 1]
    elif pool == "global":
        nodes += [helper.make_node("GlobalAveragePool", [last], ["g"]),
                  helper.make_node("Flatten", ["g"], ["p"], axis=1)]
        last, out_shape = "p", [batch, cout]
    nodes.append(helper.make_node("Identity", [last], ["y"]))
    out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)]
    m = helper.make_model(helper.make_graph(nodes, "cnn_block", inputs, out, inits),
                          opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


# (name, kwargs, the families of its kernels): stride 1 and 2, pointwise on a small plane (conv1x1) and a
# large one (the direct template's fused rows), depthwise with a residual, a 7x7 plane (im2col on AVX-512),
# pooling and global pooling after a conv
CASES = [
    ("conv3x3_residual", dict(cin=16, cout=16, h=16, w=16), [CONV]),
    ("conv3x3_stride2", dict(cin=8, cout=16, h=33, w=33, stride=2, residual=False), [CONV]),
    ("conv3x3_small_plane", dict(cin=16, cout=16, h=14, w=14), [LANES]),
    ("conv3x3_small_plane_stride2", dict(cin=8, cout=16, h=15, w=15, stride=2, residual=False), [LANES]),
    ("pointwise_small_plane", dict(cin=32, cout=32, h=7, w=7, k=1), [POINTWISE]),
    ("pointwise_large_plane", dict(cin=8, cout=24, h=28, w=28, k=1), [CONV]),
    ("depthwise_residual", dict(cin=24, cout=24, h=14, w=14, group=24), [DEPTHWISE]),
    ("depthwise_stride2", dict(cin=16, cout=16, h=15, w=15, group=16, stride=2, residual=False), [DEPTHWISE]),
    # small planes: the channels on the lanes (channel_lanes), the padding folded (4x4) or read in the loads
    ("depthwise_4x4_plane", dict(cin=48, cout=48, h=4, w=4, group=48), [DEPTHWISE]),
    ("depthwise_5x5_on_2x2", dict(cin=32, cout=32, h=2, w=2, k=5, group=32, residual=False), [DEPTHWISE]),
    ("conv3x3_7x7_plane", dict(cin=32, cout=32, h=7, w=7), [LANES]),
    ("stem_7x7_plane", dict(cin=3, cout=32, h=7, w=7), [CONV]),      # a stem: cpu.conv2d_lanes declines it
    ("conv_maxpool", dict(cin=3, cout=16, h=16, w=16, residual=False, pool="max"), [CONV, POOL]),
    ("conv_global_pool", dict(cin=8, cout=32, h=8, w=8, residual=False, pool="global"), [LANES, ROWS]),
]
IDS = [c[0] for c in CASES]


def _fused_prim_funcs(model, target):
    mod = tvmfuse.load_onnx(model)
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions()))(mod)
    return {str(gv.name_hint): f for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)}


def _families(cm) -> list[str]:
    return sorted(s["template"] for s in cm.report.schedules)


def _feeds(model, batch, rng):
    feeds = {}
    for vi in model.graph.input:
        shape = [batch if d.dim_param else d.dim_value for d in vi.type.tensor_type.shape.dim]
        feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


@pytest.mark.parametrize("name, kwargs, families", CASES, ids=IDS)
def test_symbolic_batch_cnn_gets_the_static_kernels_and_numbers(name, kwargs, families, host, rng):
    model = cnn_block("batch", **kwargs)
    cm = tvmfuse.compile(model, target=host)
    static = tvmfuse.compile(cnn_block(1, **kwargs), target=host)
    assert cm.kernel_count == static.kernel_count, (cm.report.schedules, static.report.schedules)
    assert _families(cm) == _families(static) == sorted(families), (_families(cm), _families(static))
    for batch in (1, 3, 8):
        feeds = _feeds(model, batch, rng)
        got, want = cm.run(feeds), M.reference_outputs(model, feeds)
        for out, ref in want.items():
            assert got[out].shape == ref.shape
            np.testing.assert_allclose(got[out], ref, rtol=1e-4, atol=1e-4, err_msg=f"{name} at batch {batch}")


def _loop_nest(func, batch=None, size=1):
    """Every loop of ``func`` (a PrimFunc or a statement; children first): (kind, extent), the extent with
    ``batch`` (a shape var) set to ``size``, so a symbolic kernel's nest compares with the static one's."""
    ana = C.Analyzer()
    if batch is not None:
        ana.bind(batch, C.tirx.const(size, "int64"))      # relax shape vars are int64
    loops = []

    def visit(node):
        if isinstance(node, C.tirx.For):
            ext = ana.simplify(node.extent)
            loops.append((int(node.kind), int(ext) if isinstance(ext, C.tirx.IntImm) else str(ext)))

    root = func.body if isinstance(func, C.PrimFunc) else func
    C.post_order_visit(root, visit)
    return loops


def _as_over_a_symbolic_batch(static, func, target, parallel: bool):
    """(config, func) of the static kernel ``static`` (scheduled from ``func``) as a symbolic batch schedules it:
    the work of a symbolic batch grows with the batch, so its kernel keeps the parallel loop
    (``common.parallel_why_not``) where the static one is under the target's fork/join cost and serial."""
    if not parallel or static.config.get("parallel", True):
        return static.config, static.func
    tmpl = next(t for t in TEMPLATES if t.family == static.template)
    config = {**static.config, "parallel": True}
    return config, schedule_with(tmpl, tmpl.match(func, target), func, config)


@pytest.mark.parametrize("tname", ["haswell-2", "skx-2", "skx-32"])
@pytest.mark.parametrize("name, kwargs, families", CASES, ids=IDS)
def test_symbolic_batch_kernel_has_the_static_loop_nest(name, kwargs, families, tname):
    target = named_target(tname)
    sym = _fused_prim_funcs(cnn_block("batch", **kwargs), target)
    static = _fused_prim_funcs(cnn_block(1, **kwargs), target)
    assert sorted(sym) == sorted(static)
    seen = []
    for kname, func in sym.items():
        batch = func.params[0].shape[0]
        assert isinstance(batch, C.tirx.Var), f"{kname}: batch {batch} is not symbolic"
        res, ref = schedule_prim_func(func, target, {}, kname), schedule_prim_func(static[kname], target, {}, kname)
        assert res is not None and ref is not None, kname
        seen.append(res.template)
        assert res.template == ref.template, f"{kname}: {res.template} over a symbolic batch, {ref.template} static"
        if "buckets" in res.config:
            _check_buckets(res, kname, kwargs, target, batch)
            continue
        ref_config, ref_func = _as_over_a_symbolic_batch(ref, static[kname], target, res.config.get("parallel", True))
        assert res.config == ref_config, f"{kname}: knobs differ from the static batch-1 kernel's"
        nest, want = _loop_nest(res.func, batch), _loop_nest(ref_func)
        nest = _copy_rows_as_static(nest, want, res.template, kname)
        assert nest == want, f"{kname} ({res.template}): loop nest differs from the static one"
        kinds = [k for k, _ in nest]
        assert int(C.ForKind.VECTORIZED) in kinds and int(C.ForKind.PARALLEL) in kinds, kname
        # the batch is only in the parallel loop (never split): every other loop has a static extent
        raw = _loop_nest(res.func)
        symbolic = [(k, e) for k, e in raw if isinstance(e, str)]
        assert symbolic and all(k in (int(C.ForKind.PARALLEL), int(C.ForKind.SERIAL)) for k, _ in symbolic), raw
        assert all(str(batch.name) in e for _, e in symbolic), raw
    assert sorted(seen) == sorted(families)


# the knobs a static default changes with the batch: the parallel loop (serial while the work is under the
# target's fork/join cost) and, for the direct and depthwise convs, its depth (a second level for small batches),
# and with that depth the direct conv's shared_pad (the padded input once before the tiles at depth 2)
BATCH_KNOBS = {"parallel", "parallel_depth", "shared_pad"}


def _check_buckets(res, kname, kwargs, target, batch_var):
    """A kernel with size buckets over the batch (the small batches' parallel loop needs another level, or
    is not worth it): each bucket's knobs and loop nest are the static kernel's at a batch inside it (its
    bound, or the open bucket's smallest), under one chain of branches on the batch."""
    buckets = res.config["buckets"]
    assert len(buckets) >= 2 and all(b["bucket"].startswith("batch<=") for b in buckets[:-1]), buckets
    bounds = [int(b["bucket"].split("<=")[1]) for b in buckets[:-1]]
    assert bounds == sorted(set(bounds)) and buckets[-1]["bucket"] == f"batch>{bounds[-1]}"
    nests, node = [], res.func.body.block.body
    while isinstance(node, C.tirx.IfThenElse):
        nests.append(node.then_case)
        node = node.else_case
    nests.append(node)
    assert len(nests) == len(buckets), f"{kname}: the buckets are not one chain of branches on the batch"
    for b, nest, batch in zip(buckets, nests, bounds + [bounds[-1] + 1]):
        sfunc = _fused_prim_funcs(cnn_block(batch, **kwargs), target)[kname]
        static = schedule_prim_func(sfunc, target, {}, kname)
        config, sfunc_nest = _stack_tile_as_static(b["config"], static, sfunc, target, res.template, kname)
        assert b["config"] == config, f"{kname} at batch {batch}"
        got = _copy_rows_as_static(_loop_nest(nest, batch_var, batch), _loop_nest(sfunc_nest), res.template, kname)
        assert got == _loop_nest(sfunc_nest), f"{kname} at batch {batch}"
    for a, b in zip(buckets, buckets[1:]):        # each bucket its own nest: a knob the batch changes differs
        changed = {k for k in a["config"] if a["config"][k] != b["config"][k]}
        assert changed and changed <= BATCH_KNOBS, (kname, a, b)


def _copy_rows_as_static(nest, want, template, kname):
    """``nest`` (a symbolic kernel's loops) with the one difference a symbolic batch makes in the depthwise
    column nest undone: its padded copy's row loop unrolled (``conv2d.unroll_copy_rows``: with int64
    indices LLVM vectorized that loop across rows with 64-bit gathers and scatters), serial in the static
    kernel.  Exactly one loop may differ so, and only there."""
    if template != DEPTHWISE or len(nest) != len(want):
        return nest
    diff = [i for i, (a, b) in enumerate(zip(nest, want)) if a != b]
    unrolled = [i for i in diff if nest[i][0] == int(C.ForKind.UNROLLED) and want[i][0] == int(C.ForKind.SERIAL)
                and nest[i][1] == want[i][1]]
    if not diff:
        return nest
    assert unrolled == diff and len(unrolled) == 1, f"{kname}: {[(nest[i], want[i]) for i in diff]}"
    return want


def _stack_tile_as_static(config, static, sfunc, target, template, kname):
    """(knobs, loop nest) a size bucket's nest must have: the static kernel's at a batch inside the bucket,
    except that a depthwise ``channel_lanes`` register tile of a symbolic kernel stays under the stack limit
    (``depthwise.stack_tile_pixels``: the bucket nests share one function with a parallel one), where the
    static serial kernel keeps a larger (workspace) tile: then the static kernel scheduled with that tile."""
    if config == static.config:
        return static.config, static.func
    changed = {k for k in config if config[k] != static.config[k]}
    assert template == DEPTHWISE and changed <= {"oh_tile", "ow_tile"} and config["channel_lanes"], (kname, changed)
    tile = config["oh_tile"] * config["ow_tile"] * config["channel_lanes"] * 4
    assert tile < MAX_STACK_ALLOCA_BYTES <= \
        static.config["oh_tile"] * static.config["ow_tile"] * static.config["channel_lanes"] * 4, (kname, config)
    tmpl = next(t for t in TEMPLATES if t.family == template)
    return config, schedule_with(tmpl, tmpl.match(sfunc, target), sfunc, config)


# a few knob choices per family that change the loop structure most, on a symbolic batch
KNOB_CASES = [
    ("conv3x3_stride2", CONV, [{"parallel_depth": 1}, {"parallel_depth": 2}, {"deinterleave": False},
                               {"deinterleave": True}]),
    ("conv3x3_7x7_plane", CONV, [{"im2col": True, "fuse_rows": True, "oh_tile": 1},
                                 {"im2col": True, "fuse_rows": False}, {"im2col": False}]),
    ("pointwise_large_plane", CONV, [{"fuse_rows": True, "ow_tile": 28, "oh_tile": 2}, {"fuse_rows": False}]),
    ("depthwise_stride2", DEPTHWISE, [{"parallel_depth": 1}, {"parallel_depth": 2}, {"deinterleave": True}]),
    ("pointwise_small_plane", POINTWISE, [{"mr": 1}, {"k_unroll": 1}]),
]


@pytest.mark.parametrize("name, family, changes", KNOB_CASES, ids=[c[0] for c in KNOB_CASES])
def test_knob_choices_apply_over_a_symbolic_batch(name, family, changes, host, rng):
    kwargs = dict(next(c[1] for c in CASES if c[0] == name))
    funcs = _fused_prim_funcs(cnn_block("batch", **kwargs), host)
    tmpl = next(t for t in TEMPLATES if t.family == family)
    found = [(n, f, tmpl.match(f, host)) for n, f in funcs.items()]
    (kname, func, match), = [x for x in found if x[2] is not None]
    assert match.info["N"] is None
    space = tmpl.space(match, host)
    default = tmpl.default_config(match, host)
    ref = C.build_prim_module(C.IRModule({"main": func.with_attr("global_symbol", "main")}), target=host)
    args = [rng.standard_normal([3 if isinstance(d, C.tirx.Var) else int(d) for d in p.shape]).astype("float32")
            for p in func.params]
    want = C.tensor(np.zeros_like(args[-1]))
    ref["main"](*[C.tensor(a) for a in args[:-1]], want)
    applied = 0
    for change in changes:
        cfg = {**default, **change}
        if not space.contains(cfg):
            continue      # a choice this target's space does not offer (e.g. lanes that do not divide)
        sch = C.Schedule(func)
        tmpl.apply(sch, match, cfg)
        lib = C.build_prim_module(C.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}),
                                  target=host)
        got = C.tensor(np.zeros_like(args[-1]))
        lib["main"](*[C.tensor(a) for a in args[:-1]], got)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4, err_msg=f"{kname} {cfg}")
        applied += 1
    assert applied, f"{kname}: none of {changes} is in the space {space.to_dict()}"


def test_only_the_batch_may_be_symbolic(host):
    """A conv whose plane is symbolic is not the conv templates' (their tiles split the rows and columns):
    it stays with cpu.symbolic_rows."""
    from tvmfuse.schedules.cpu.conv2d import Conv2DEpilogue

    g = M._G("sym_plane")
    x = g.input("x", (1, 8, "h", "w"))
    g.op("Relu", g.op("Conv", x, g.weight((8, 8, 3, 3)), kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
    g.rename_last("y", (1, 8, "h", "w"))
    funcs = _fused_prim_funcs(g.model(), host)
    convs = [f for n, f in funcs.items() if "conv" in n]
    assert convs
    assert all(Conv2DEpilogue().match(f, host) is None for f in convs)
    res = [schedule_prim_func(f, host, {}, "k") for f in convs]
    assert all(r is not None and r.template == SYMBOLIC_ROWS for r in res), [r and r.template for r in res]


def test_row_reduction_takes_a_symbolic_batch_not_a_symbolic_row_count(host):
    """cpu.row_reduction takes a pooling kernel whose outermost row axis is a symbolic batch, not a [rows, d]
    norm whose only row axis is symbolic (a token model's: cpu.symbolic_rows keeps those)."""
    from tvmfuse.schedules.cpu.reduction import RowReduction

    norm = _fused_prim_funcs(M.layernorm(rows="rows", d=32), host)
    assert norm and all(RowReduction().match(f, host) is None for f in norm.values())
    pool = _fused_prim_funcs(cnn_block("batch", **dict(CASES[-1][1])), host)
    taken = [n for n, f in pool.items() if RowReduction().match(f, host) is not None]
    assert len(taken) == 1 and "mean" in taken[0], taken
