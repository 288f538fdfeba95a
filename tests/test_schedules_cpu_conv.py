"""CPU Conv2D and depthwise Conv2D templates (tvmfuse/schedules/cpu/conv2d.py, depthwise.py).

Conv + BatchNorm + ReLU + residual add graphs with odd shapes (channels, rows and columns that divide no
tile; strides 1 and 2; asymmetric pads): the template named in the report scheduled the fused kernel, the
numbers match onnx's reference evaluator on fresh random inputs, the scheduled TIR keeps no buffer of
the conv output's size (the epilogue runs on the register tile), its inner loops are vectorized and its
outer loop parallel, and configurations sampled from the knob space apply and stay correct.
"""
import json
import random

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.pipeline import PipelineOptions, graph_stage
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu import TEMPLATES
from tvmfuse.schedules.cpu.common import parallel_why_not
from tvmfuse.schedules.cpu.conv2d import conv_work

from conftest import NAMED_TARGETS, assert_close_to_reference, named_target
from schedule_cases import numel as _numel
from test_schedules_cpu import _structure

CONV = "cpu.conv2d_epilogue"
DEPTHWISE = "cpu.depthwise_conv2d_epilogue"


def conv_block(cin, cout, h, w, k=3, stride=1, pads=(1, 1, 1, 1), group=1, residual=True, relu=True,
               bn=True, seed=0):
    """Conv -> [BatchNorm] -> [ReLU] -> [+ a residual input of the output's shape]."""
    rng = np.random.default_rng(seed)
    oh = (h + pads[0] + pads[2] - k) // stride + 1
    ow = (w + pads[1] + pads[3] - k) // stride + 1
    inits = [numpy_helper.from_array((rng.standard_normal((cout, cin // group, k, k))
                                      / np.sqrt(cin // group * k * k)).astype(np.float32), "W")]
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], kernel_shape=[k, k], strides=[stride, stride],
                              pads=list(pads), group=group)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, h, w])]
    last = "c"
    if bn:
        for name, v in (("s", 1 + 0.1 * rng.standard_normal(cout)), ("b", 0.1 * rng.standard_normal(cout)),
                        ("m", 0.1 * rng.standard_normal(cout)), ("v", 1 + 0.1 * np.abs(rng.standard_normal(cout)))):
            inits.append(numpy_helper.from_array(v.astype(np.float32), name))
        nodes.append(helper.make_node("BatchNormalization", [last, "s", "b", "m", "v"], ["bn"], epsilon=1e-5))
        last = "bn"
    if relu:
        nodes.append(helper.make_node("Relu", [last], ["r"]))
        last = "r"
    if residual:
        inputs.append(helper.make_tensor_value_info("res", TensorProto.FLOAT, [1, cout, oh, ow]))
        nodes.append(helper.make_node("Add", [last, "res"], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", [last], ["y"]))
    out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, cout, oh, ow])]
    g = helper.make_graph(nodes, "conv_block", inputs, out, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


# (kwargs, family of the conv kernel): odd sizes on purpose; none divides the default tiles
CASES = [
    (dict(cin=7, cout=13, h=9, w=11), CONV),
    (dict(cin=5, cout=9, h=13, w=13, stride=2, pads=(1, 0, 2, 1)), CONV),
    (dict(cin=6, cout=11, h=10, w=19, k=1, pads=(0, 0, 0, 0), relu=False), CONV),
    (dict(cin=4, cout=6, h=7, w=9, group=2, bn=False, residual=False), CONV),
    (dict(cin=13, cout=13, h=9, w=11, group=13), DEPTHWISE),
    (dict(cin=7, cout=7, h=13, w=12, group=7, stride=2, pads=(1, 1, 1, 1)), DEPTHWISE),
    (dict(cin=9, cout=9, h=11, w=21, k=5, group=9, pads=(2, 2, 2, 2), relu=False, residual=False), DEPTHWISE),
]
IDS = [f"{fam.split('.')[1]}-{i}" for i, (_, fam) in enumerate(CASES)]


def _fused_prim_funcs(model, target):
    """The PrimFuncs of tvmfuse's fused module (BN folded, conv + epilogue in one kernel)."""
    mod = tvmfuse.load_onnx(model)
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions()))(mod)
    return {str(gv.name_hint): f for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)}


def _conv_kernel(funcs, target, family):
    tmpl = next(t for t in TEMPLATES if t.family == family)
    found = [(n, f, tmpl.match(f, target)) for n, f in funcs.items()]
    found = [x for x in found if x[2] is not None]
    assert len(found) == 1, f"{family}: expected one matching kernel, got {[x[0] for x in found]}"
    return tmpl, *found[0]


@pytest.mark.parametrize("kwargs,family", CASES, ids=IDS)
def test_conv_numerics_and_report(kwargs, family, host, rng):
    model = conv_block(**kwargs)
    cm = tvmfuse.compile(model, host)
    used = {s["kernel"]: s["template"] for s in cm.report.schedules}
    assert family in used.values(), f"{family} not used: {cm.report.schedules}"
    assert "fallback" not in used.values(), f"a kernel fell back: {cm.report.schedules}"
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tname", list(NAMED_TARGETS))
@pytest.mark.parametrize("kwargs,family", CASES, ids=IDS)
def test_conv_structure(kwargs, family, tname):
    target = named_target(tname)
    funcs = _fused_prim_funcs(conv_block(**kwargs), target)
    tmpl, name, func, match = _conv_kernel(funcs, target, family)
    res = schedule_prim_func(func, target, {}, name)
    assert res is not None and res.template == family, f"{name}: {res and res.template}"
    if kwargs.get("relu", True) or kwargs.get("bn", True):
        assert match.info["epilogue"] is not None, f"{name}: the epilogue was not matched"
    allocs, kinds = _structure(res.func)
    # the padded input per row band, or (shared_pad, the default with parallel_depth 2) once for the whole
    # input in its own loop before the tiles (tests/test_schedules_cpu_conv_wide.py)
    shared = bool(res.config.get("shared_pad"))
    if shared:
        whole = [e for n, e in allocs if n == match.info["pad"]]
        assert len(whole) == 1 and whole[0] >= _numel(func.params[0].shape), f"{name}: {allocs}"
        allocs = [(n, e) for n, e in allocs if n != match.info["pad"]]
    out_elems = _numel(func.params[-1].shape)
    big = [(n, e) for n, e in allocs if e >= out_elems]
    assert not big, f"{name}: buffers of the output's size left (conv result materialized): {big}"
    pad_elems = _numel(func.params[0].shape)
    assert all(e < pad_elems for _, e in allocs), f"{name}: padded input materialized whole: {allocs}"
    assert int(C.ForKind.VECTORIZED) in kinds, f"{name}: no vectorized loop"
    if parallel_why_not(conv_work(match.info), target) is None:
        # (a shared padded input under the fork/join cost is copied serially before the parallel tiles)
        assert (int(C.ForKind.PARALLEL) in kinds) if shared else kinds[0] == int(C.ForKind.PARALLEL), \
            f"{name}: outer loop not parallel: {kinds[:3]}"
    else:       # under the target's fork/join cost (common.parallel_why_not): no parallel loop at all
        assert int(C.ForKind.PARALLEL) not in kinds, f"{name}: a parallel loop under the fork/join cost"


@pytest.mark.parametrize("family,kwargs,samples", [
    (CONV, dict(cin=5, cout=11, h=9, w=13, stride=1), 6),
    (CONV, dict(cin=3, cout=7, h=11, w=10, stride=2, pads=(0, 1, 1, 0)), 3),
    (DEPTHWISE, dict(cin=6, cout=6, h=11, w=17, group=6), 5),
])
def test_sampled_configs_apply_and_stay_correct(family, kwargs, samples, host):
    funcs = _fused_prim_funcs(conv_block(**kwargs), host)
    tmpl, name, func, match = _conv_kernel(funcs, host, family)
    space = tmpl.space(match, host)
    assert space.contains(tmpl.default_config(match, host))
    ref = C.build_prim_module(C.IRModule({"main": func.with_attr("global_symbol", "main")}), target=host)
    data = np.random.default_rng()
    args = [data.standard_normal([int(d) for d in p.shape]).astype("float32") for p in func.params]
    want = C.tensor(np.zeros_like(args[-1]))
    ref["main"](*[C.tensor(a) for a in args[:-1]], want)
    rnd = random.Random(0)      # fixed configs, fresh inputs (see schedule_cases.CONFIG_SEED)
    configs = [space.sample(rnd) for _ in range(samples)]
    for cfg in configs:
        sch = C.Schedule(func)
        tmpl.apply(sch, match, cfg)
        lib = C.build_prim_module(C.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}),
                          target=host)
        got = C.tensor(np.zeros_like(args[-1]))
        lib["main"](*[C.tensor(a) for a in args[:-1]], got)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4, err_msg=str(cfg))


def test_conv_not_matched_by_other_families():
    """A conv kernel is not a matmul and not a depthwise conv, and vice versa (match by structure)."""
    host = named_target("haswell-2")
    conv = _fused_prim_funcs(conv_block(cin=4, cout=5, h=6, w=7), host)
    dw = _fused_prim_funcs(conv_block(cin=5, cout=5, h=6, w=7, group=5), host)
    by = {t.family: t for t in TEMPLATES}
    assert all(by[DEPTHWISE].match(f, host) is None for f in conv.values())
    assert all(by[CONV].match(f, host) is None for f in dw.values())
    assert all(by["cpu.matmul_epilogue"].match(f, host) is None for f in list(conv.values()) + list(dw.values()))


@pytest.mark.parametrize("case", [2, 4], ids=[IDS[2], IDS[4]])
def test_second_parallel_level_bound_comes_from_the_target_table(case, monkeypatch):
    """min_parallel_per_core is the family's ``template_defaults`` entry: at 0 the default keeps one parallel
    level, past the kernel's parallel iterations per core it adds the second (channel blocks / row bands)."""
    kwargs, family = CASES[case]
    target = named_target(next(iter(NAMED_TARGETS)))
    tmpl, name, func, match = _conv_kernel(_fused_prim_funcs(conv_block(**kwargs), target), target, family)
    assert tmpl.min_parallel_per_core(target) == \
        tvmfuse.target.cpu_table()["template_defaults"][family]["min_parallel_per_core"]
    depths = {}
    for bound in (0, 10 ** 6):
        table = json.loads(json.dumps(tvmfuse.target.cpu_table()))
        table["template_defaults"][family]["min_parallel_per_core"] = bound
        monkeypatch.setattr(tvmfuse.target, "cpu_table", lambda table=table: table)
        depths[bound] = tmpl.default_config(match, target)["parallel_depth"]
    assert depths == {0: 1, 10 ** 6: 2}, depths
