"""cpu.window_pool (tvmfuse/schedules/cpu/pooling.py): strided max pooling with the padded input stored by
column phase and the max on vectors of output columns.

Numerics: tvmfuse.compile on the host vs onnx's reference evaluator (SqueezeNet's 3x3/2 ceil_mode pools on
31x31 / 15x15 / 7x7 planes, the same fed by a concat, ResNet's padded 3x3/2 pool on an odd plane, a 2x2/2
pool without padding: the input copied), and every knob combination vs the unscheduled kernel, on fresh
random inputs.  Structure on named AVX2 / AVX-512 targets: the template, one parallel loop, the padded input
5-D (deinterleaved) and computed per plane, the output columns vectorized, nothing scalarized.  Pools this
family declines (stride 1, average pooling) keep the schedule they had.
"""
import itertools
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.records import workload_key
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.base import schedule_with
from tvmfuse.schedules.cpu.common import parallel_why_not
from tvmfuse.schedules.cpu.pooling import FAMILY, WindowPool, shuffle_loads, shuffle_max_loads

import schedule_cases as S
from conftest import assert_close_to_reference
from test_schedules_cpu import _structure


def _pool_model(c, h, w, k=3, s=2, pads=(0, 0, 0, 0), ceil=0, op="MaxPool", concat=False, dilation=1):
    """[Concat of two inputs ->] a pooling node (ONNX NCHW)."""
    cin = c // 2 if concat else c
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, cin, h, w])
              for n in (("a", "b") if concat else ("x",))]
    nodes = [helper.make_node("Concat", ["a", "b"], ["x"], axis=1)] if concat else []
    attrs = dict(kernel_shape=[k, k], strides=[s, s], pads=list(pads), ceil_mode=ceil)
    if dilation != 1:
        attrs["dilations"] = [dilation, dilation]
    nodes.append(helper.make_node(op, ["x"], ["y"], **attrs))
    g = helper.make_graph(nodes, "pool", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    m = onnx.shape_inference.infer_shapes(m)
    onnx.checker.check_model(m)
    return m


CASES = [
    ("squeezenet_31x31_ceil", dict(c=64, h=31, w=31, ceil=1)),
    ("squeezenet_15x15_ceil_concat", dict(c=128, h=15, w=15, ceil=1, concat=True)),
    ("squeezenet_7x7_ceil_concat", dict(c=256, h=7, w=7, ceil=1, concat=True)),
    ("resnet_pad1", dict(c=8, h=33, w=32, pads=(1, 1, 1, 1))),
    ("k2s2_no_pad", dict(c=5, h=16, w=18, k=2)),
    ("k3s3_asym_pad", dict(c=6, h=13, w=17, s=3, pads=(0, 1, 2, 0))),      # 17 + 1 columns: 3 phases of 6
    ("k2s2_ceil", dict(c=6, h=15, w=15, k=2, ceil=1)),       # the last window reads the ceil_mode column
    ("resnet_112", dict(c=2, h=112, w=112, pads=(1, 1, 1, 1))),    # 56 output columns: several lane groups
    ("k4s2_wide", dict(c=3, h=9, w=40, k=4, pads=(1, 1, 1, 1))),   # 20 columns: a full group and a short one
    ("k5s3_wide", dict(c=3, h=9, w=66, k=5, s=3, pads=(2, 2, 2, 1))),
    ("k2s2_one_column", dict(c=4, h=2, w=2, k=2)),                 # one output column: scalar picks
    ("k3s2_dilation2", dict(c=3, h=20, w=22, pads=(1, 1, 1, 1), dilation=2)),   # a dilated window
]
IDS = [c[0] for c in CASES]


def _kernel(model, target):
    funcs = S.graph_funcs(model, target)
    assert len(funcs) == 1, list(funcs)
    return next(iter(funcs.items()))


@pytest.mark.parametrize("name,kwargs", CASES, ids=IDS)
def test_numerics_vs_reference(name, kwargs, host, rng):
    model = _pool_model(**kwargs)
    cm = tvmfuse.compile(model, host)
    assert [s["template"] for s in cm.report.schedules] == [FAMILY], cm.report.schedules
    assert_close_to_reference(model, cm, rng, rtol=0, atol=0)      # max pooling is exact


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
def test_large_window_takes_no_shuffle(target, host, rng):
    """A window whose unrolled 'shuffle' row block would exceed shuffle_max_loads vector loads (a 30x30
    window of dilation 3, stride 10; the ONNX gate's 60x80 one of dilation 10 took LLVM 45 s to compile):
    'shuffle' is out of its space and its default; a small dilated window keeps it; numerics exact."""
    large = _pool_model(c=1, h=200, w=200, k=30, s=10, dilation=3)
    t, tgt = WindowPool(), tvmfuse.parse_target(target)
    lanes = tvmfuse.target.cpu_info(tgt).float32_lanes
    match = t.match(_kernel(large, tgt)[1], tgt)
    assert match is not None and shuffle_loads(match.info, lanes) > shuffle_max_loads(tgt)
    assert t.default_config(match, tgt)["rows"] == "deinterleave"
    assert "shuffle" not in t.space(match, tgt).to_dict()["rows"]
    small = t.match(_kernel(_pool_model(**dict(CASES[IDS.index("k3s2_dilation2")][1])), tgt)[1], tgt)
    assert shuffle_loads(small.info, lanes) <= shuffle_max_loads(tgt)
    assert t.default_config(small, tgt)["rows"] == "shuffle"
    if target == S.NAMED_TARGETS[0]:        # numerics once, on the host
        cm = tvmfuse.compile(large, host)
        assert_close_to_reference(large, cm, rng, rtol=0, atol=0)


def test_shuffle_bound_comes_from_the_target_table(monkeypatch):
    """shuffle_max_loads is the table's ``template_defaults["cpu.window_pool"]`` (a CPU row may override it):
    a bound under a small dilated pool's loads takes 'shuffle' out of its space and its default."""
    tgt = tvmfuse.parse_target(S.NAMED_TARGETS[0])
    t, lanes = WindowPool(), tvmfuse.target.cpu_info(tgt).float32_lanes
    small = t.match(_kernel(_pool_model(**dict(CASES[IDS.index("k3s2_dilation2")][1])), tgt)[1], tgt)
    loads = shuffle_loads(small.info, lanes)
    table = json.loads(json.dumps(tvmfuse.target.cpu_table()))
    assert shuffle_max_loads(tgt) == table["template_defaults"][FAMILY]["shuffle_max_loads"]
    table["template_defaults"][FAMILY]["shuffle_max_loads"] = loads - 1
    monkeypatch.setattr(tvmfuse.target, "cpu_table", lambda: table)
    assert shuffle_max_loads(tgt) == loads - 1
    assert t.default_config(small, tgt)["rows"] == "deinterleave"
    assert "shuffle" not in t.space(small, tgt).to_dict()["rows"]


def test_unused_tuned_record_says_why(monkeypatch):
    """A tuned record the template cannot use (outside its knob space; in it, but its schedule raises)
    gives the target default, and the result's reason (the report's) names the record and the cause."""
    tgt = tvmfuse.parse_target(S.NAMED_TARGETS[0])
    kname, func = _kernel(_pool_model(**dict(CASES[0][1])), tgt)
    key = workload_key(func)
    default = schedule_prim_func(func, tgt, {}, kname)
    assert (default.source, default.reason) == ("default", "")
    outside = {key: {"template": FAMILY, "config": {**default.config, "rows": "nope"}}}
    res = schedule_prim_func(func, tgt, outside, kname)
    assert (res.source, res.config) == ("default", default.config)
    assert key in res.reason and "outside cpu.window_pool's current knob space" in res.reason, res.reason
    real = WindowPool.apply

    def broken(self, sch, match, config):
        if config["rows"] == "gather":
            raise ValueError("gather broke")
        return real(self, sch, match, config)
    monkeypatch.setattr(WindowPool, "apply", broken)
    res = schedule_prim_func(func, tgt, {key: {"template": FAMILY, "config": {**default.config, "rows": "gather"}}},
                             kname)
    assert (res.source, res.config) == ("default", default.config)
    assert "does not apply (ValueError: gather broke)" in res.reason, res.reason


@pytest.mark.parametrize("name,kwargs", [CASES[i] for i in (0, 3, 4, 6, 7, 11)],
                         ids=[IDS[i] for i in (0, 3, 4, 6, 7, 11)])
def test_every_config_vs_unscheduled(name, kwargs, host, rng):
    kname, func = _kernel(_pool_model(**kwargs), host)
    t = WindowPool()
    match = t.match(func, host)
    assert match is not None
    space = t.space(match, host).to_dict()
    args = S.random_args(func, rng)
    want = S.run_func(func, host, args)[0]
    for values in itertools.product(*space.values()):
        cfg = dict(zip(space, values))
        got = S.run_func(schedule_with(t, match, func, cfg), host, args)[0]
        np.testing.assert_array_equal(got, want, err_msg=str(cfg))


def _plane_loop(res, func, tgt, overrides=None):
    """The one parallel loop over the planes (the config's own, or the same config with parallel on where
    the pool is under the target's fork/join cost: then the default has none)."""
    match = WindowPool().match(func, tgt)
    wanted = parallel_why_not(match.info["work"], tgt) is None
    assert res.config["parallel"] is wanted
    parallel = [f for f in S.loops(res.func) if int(f.kind) == int(C.ForKind.PARALLEL)]
    assert len(parallel) == int(wanted), f"{len(parallel)} parallel loops"
    if not wanted:
        res.func = schedule_with(WindowPool(), match, func, {**res.config, **(overrides or {}), "parallel": True})
        parallel = [f for f in S.loops(res.func) if int(f.kind) == int(C.ForKind.PARALLEL)]
        assert len(parallel) == 1, f"{len(parallel)} parallel loops"
    return parallel[0]


# the cases whose windows never read a padded row or column (or that have no padding): the default reads
# the input in place, no copy; the others copy the padded plane first (the concat-fed pools too: their
# windows read no padding, but the folded concatenation is copied, pooling._in_place)
UNPADDED_READS = {"squeezenet_31x31_ceil", "k2s2_no_pad", "k2s2_one_column"}


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
@pytest.mark.parametrize("name,kwargs", CASES, ids=IDS)
def test_structure(name, kwargs, target):
    """The default ('shuffle' rows): per plane (one parallel loop) a serial loop over output rows whose one
    block stores whole vectors of output columns (groups of the target's lanes), each the max over the
    window columns of register shuffles of contiguous vector loads; no reduction loop, no strided load,
    no copy by column phase, and no copy at all where the windows read no padding."""
    tgt = tvmfuse.parse_target(target)
    lanes = tvmfuse.target.cpu_info(tgt).float32_lanes
    kname, func = _kernel(_pool_model(**kwargs), tgt)
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is not None and res.template == FAMILY, res and res.template
    assert res.config["rows"] == "shuffle", res.config
    plane = _plane_loop(res, func, tgt)
    inner = []
    C.post_order_visit(plane.body, lambda n: inner.append(n) if isinstance(n, C.tirx.For) else None)
    rows = [f for f in inner if isinstance(f.body, C.SBlockRealize) and
            f.body.block.name_hint.endswith("_rows")]
    assert len(rows) == 1, "no loop over output rows with one block"
    out_shape = [int(d) for d in func.params[-1].shape]
    assert int(rows[0].extent) == out_shape[2] and int(rows[0].kind) == int(C.ForKind.SERIAL)
    body = rows[0].body.block.body
    stmts = list(body.seq) if isinstance(body, C.tirx.SeqStmt) else [body]
    stores = [st for st in stmts if isinstance(st, C.BufferStore)]
    assert all(isinstance(st, (C.BufferStore, C.tirx.Bind)) for st in stmts), stmts
    ow = out_shape[3]
    widths = [int(st.indices[-1].lanes) if isinstance(st.indices[-1], C.tirx.Ramp) else 1 for st in stores]
    assert widths == [min(lanes, ow - x0) for x0 in range(0, ow, lanes)], widths
    shuffles, strided, loads = [], [], []

    def visit(n):
        if isinstance(n, C.tirx.Shuffle):
            shuffles.append(n)
        if isinstance(n, C.TensorLoad):
            loads.append(n)
        if isinstance(n, C.TensorLoad) and isinstance(n.indices[-1], C.tirx.Ramp) and \
                int(n.indices[-1].stride) != 1:
            strided.append(n)

    C.post_order_visit(body, visit)
    k = kwargs.get("k", 3)
    assert len(shuffles) == k * len(stores), f"{len(shuffles)} shuffles for {len(stores)} groups"
    # each vector of columns loaded once per window row (bound, not repeated in every shuffle)
    assert len(loads) == shuffle_loads(WindowPool().match(func, tgt).info, lanes), len(loads)
    assert not strided, strided
    assert not any(int(f.kind) == int(C.ForKind.VECTORIZED) for f in S.loops(res.func)
                   if f.body is rows[0].body), "the row block is not a vector expression"
    assert not S.scalarized_loops(res.func), "a vectorized loop was scalarized"
    buffers = _alloc_buffers(res.func)
    if name in UNPADDED_READS:
        assert not buffers, f"a copy of an input whose padding is never read: {buffers}"
    else:           # the padded plane, as it is (4-D), computed inside the plane loop
        assert len(buffers) == 1 and len(buffers[0].shape) == 4, buffers
        assert len(inner) >= 3, "the padded copy is not inside the plane loop"


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
@pytest.mark.parametrize("name,kwargs", CASES, ids=IDS)
def test_structure_deinterleave(name, kwargs, target):
    """rows='deinterleave' (a tuner's alternative): the padded input stored by column phase inside the plane
    loop, the output columns vectorized over the window loops."""
    tgt = tvmfuse.parse_target(target)
    kname, func = _kernel(_pool_model(**kwargs), tgt)
    match = WindowPool().match(func, tgt)
    res = schedule_prim_func(func, tgt, {}, kname)
    res.func = schedule_with(WindowPool(), match, func, {**res.config, "rows": "deinterleave"})
    plane = _plane_loop(res, func, tgt, {"rows": "deinterleave"})
    # the padded input (or the input's copy) is computed inside the parallel loop over the planes
    inner = []
    C.post_order_visit(plane.body, lambda n: inner.append(n) if isinstance(n, C.tirx.For) else None)
    assert len(inner) >= 5, "the input copy and the pool are not both inside the plane loop"
    vec = [int(f.extent) for f in S.loops(res.func) if int(f.kind) == int(C.ForKind.VECTORIZED)]
    out_w = [int(d) for d in func.params[-1].shape][3]
    assert out_w in vec, f"output columns ({out_w}) not vectorized: {vec}"
    assert not S.scalarized_loops(res.func), "a vectorized loop was scalarized"
    allocs, _ = _structure(res.func)
    assert len(allocs) == 1, allocs        # one input buffer, deinterleaved: [n, c, y, phase, column]
    assert any(len(b.shape) == 5 for b in _alloc_buffers(res.func)), "input copy not stored by column phase"


def _alloc_buffers(func) -> list:
    found = []
    C.post_order_visit(func.body, lambda n: found.extend(n.alloc_buffers) if hasattr(n, "alloc_buffers") else None)
    return found


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
@pytest.mark.parametrize("kwargs", [dict(c=8, h=15, w=15, s=1, pads=(1, 1, 1, 1)),
                                    dict(c=8, h=15, w=15, op="AveragePool", pads=(1, 1, 1, 1)),
                                    dict(c=8, h=15, w=15, pads=(1, 1, 1, 1))],
                         ids=["stride_1", "average", "odd_padded_width"])
def test_declined_pools_keep_their_schedule(kwargs, target):
    """Stride 1 (contiguous windows), average pooling and a padded width the stride does not divide (17
    columns, stride 2) are not this family's: whatever scheduled them before still does."""
    tgt = tvmfuse.parse_target(target)
    kname, func = _kernel(_pool_model(**kwargs), tgt)
    assert WindowPool().match(func, tgt) is None
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is None or res.template != FAMILY
