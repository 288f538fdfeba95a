"""Kernels of the corpus models (corpus/) that a template refused or broke on, each reduced to a small
model: structure on named targets, numerics on the host against onnx's reference on fresh random inputs."""
from __future__ import annotations

import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.explain import Recorder
from tvmfuse.pipeline import PipelineOptions, graph_stage
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.target import cpu_info

from conftest import NAMED_TARGETS, assert_close_to_reference, named_target


def _prim_funcs(model, target, fusion=True):
    mod = tvmfuse.load_onnx(model)
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions(fusion=fusion)))(mod)
    return {str(gv.name_hint): f for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)}


def _loop_kinds(func) -> list[int]:
    kinds = []
    C.post_order_visit(func.body, lambda s: kinds.append(int(s.kind)) if isinstance(s, C.tirx.For) else None)
    return kinds


# ---- row reductions whose row is exactly one rfactor width (resnet18's global mean over 2x2, softmax over
# 16 or 32 keys, LayerNorm over 8): the unit outer reduction loop disappeared under compute_at and the
# template's reorder failed ("ScheduleError ... 'reorder'"), leaving the kernel to dlight's fallback ----

ROW_IS_ONE_WIDTH = [
    ("softmax", dict(rows=23, d=16)),
    ("softmax", dict(rows=23, d=32)),
    ("layernorm", dict(rows=5, d=8)),
    ("mean_variance", dict(rows=7, d=4)),
]


@pytest.mark.parametrize("tname", list(NAMED_TARGETS))
@pytest.mark.parametrize("builder,kwargs", ROW_IS_ONE_WIDTH, ids=[f"{b}-{k['d']}" for b, k in ROW_IS_ONE_WIDTH])
def test_row_of_one_rfactor_width_keeps_vector_partial_sums(builder, kwargs, tname):
    target = named_target(tname)
    seen = False
    for name, func in _prim_funcs(getattr(M, builder)(**kwargs), target).items():
        res = schedule_prim_func(func, target, {}, name)
        assert res is not None and res.template == "cpu.row_reduction", name
        if not res.config["vectorize_reductions"]:
            continue
        if res.config["rf_width"] == kwargs["d"]:
            seen = True
        assert int(C.ForKind.VECTORIZED) in _loop_kinds(res.func), f"{name}: no vectorized loop"
        assert res.config["lanes"] == cpu_info(target).float32_lanes
    if kwargs["d"] <= cpu_info(target).float32_lanes:
        assert seen, f"no kernel took rf_width == the row ({kwargs['d']}) on {tname}"


@pytest.mark.parametrize("builder,kwargs", ROW_IS_ONE_WIDTH, ids=[f"{b}-{k['d']}" for b, k in ROW_IS_ONE_WIDTH])
def test_row_of_one_rfactor_width_numerics(builder, kwargs, host, rng):
    model = getattr(M, builder)(**kwargs)
    with Recorder() as rec:
        cm = tvmfuse.compile(model, host)
    sources = {s["kernel"]: s["source"] for s in rec.schedules}
    assert "fallback" not in sources.values() and "generic" not in sources.values(), rec.schedules
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-5)


# ---- strided convs (resnet18's 7x7 stride-2 stem, MobileNet's stride-2 3x3 and depthwise convs): vector
# loads of output columns read every s-th input column, a gather per vector; the padded input is stored by
# column phase instead (deinterleave), so each vector is one contiguous load ----

def _strided_conv(cin: int, cout: int, size: int, k: int, stride: int, depthwise: bool = False, seed: int = 0):
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    group = cin if depthwise else 1
    w = rng.standard_normal((cout, cin // group, k, k)).astype("float32")
    b = rng.standard_normal(cout).astype("float32")
    out = (size + 2 * (k // 2) - k) // stride + 1
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[k, k], strides=[stride, stride],
                              pads=[k // 2] * 4, group=group),
             helper.make_node("Relu", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "strided_conv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, cout, out, out])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


STRIDED = [
    ("stem7x7", dict(cin=3, cout=8, size=64, k=7, stride=2), "cpu.conv2d_epilogue"),
    # a 17x17 output plane: smaller ones (squeezenet's 15x15) are cpu.conv2d_lanes' (test_schedules_cpu_conv_lanes)
    ("conv3x3", dict(cin=8, cout=16, size=34, k=3, stride=2), "cpu.conv2d_epilogue"),
    ("dw3x3", dict(cin=16, cout=16, size=32, k=3, stride=2, depthwise=True), "cpu.depthwise_conv2d_epilogue"),
    ("dw5x5s3", dict(cin=8, cout=8, size=25, k=5, stride=3, depthwise=True), "cpu.depthwise_conv2d_epilogue"),
    ("patch8", dict(cin=3, cout=16, size=32, k=8, stride=8), "cpu.conv2d_epilogue"),   # ViT: no overlap
]


def _loads_of(func, buffer_name: str) -> list:
    loads = []
    C.post_order_visit(func.body, lambda e: loads.append(e) if isinstance(e, C.TensorLoad) and
                       str(e.source.name) == buffer_name else None)
    return loads


@pytest.mark.parametrize("tname", list(NAMED_TARGETS))
@pytest.mark.parametrize("case,kwargs,family", STRIDED, ids=[c[0] for c in STRIDED])
def test_strided_conv_reads_the_padded_input_by_column_phase(case, kwargs, family, tname):
    target = named_target(tname)
    funcs = _prim_funcs(_strided_conv(**kwargs), target)
    (name, func), = [(n, f) for n, f in funcs.items() if "conv2d" in n]
    res = schedule_prim_func(func, target, {}, name)
    assert res is not None and res.template == family, (name, res and res.template)
    pad_w = kwargs["size"] + 2 * (kwargs["k"] // 2)
    if pad_w % kwargs["stride"] or kwargs["k"] <= kwargs["stride"]:
        # a width the stride does not divide, or windows that do not overlap (patchify): plain layout
        assert res.config["deinterleave"] is False
        return
    if res.config.get("im2col"):
        # the im2col copy lays each window offset's columns out contiguously instead (a row of an odd number of
        # lanes: tests/test_schedules_cpu_conv_im2col.py)
        assert any("reindex" in str(b.name) for b in _alloc_buffers(res.func)), res.config
        return
    assert res.config["deinterleave"] is True
    # the padded input is 5-D, [n, c, y, column phase, column // stride], and the conv reads it so
    pads = [b for b in _alloc_buffers(res.func) if b.name == "pad_temp"]
    assert len(pads) == 1 and len(pads[0].shape) == 5, [(b.name, list(b.shape)) for b in pads]
    assert int(pads[0].shape[3]) == kwargs["stride"]
    assert all(len(ld.indices) == 5 for ld in _loads_of(res.func, "pad_temp"))
    assert int(C.ForKind.VECTORIZED) in _loop_kinds(res.func)


def _alloc_buffers(func) -> list:
    out = []
    C.post_order_visit(func.body, lambda s: out.extend(s.alloc_buffers) if isinstance(s, C.SBlock) else None)
    return out


@pytest.mark.parametrize("case,kwargs,family", STRIDED, ids=[c[0] for c in STRIDED])
def test_strided_conv_numerics(case, kwargs, family, host, rng):
    model = _strided_conv(**kwargs)
    with Recorder() as rec:
        cm = tvmfuse.compile(model, host)
    assert family in {s["template"] for s in rec.schedules}, rec.schedules
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)


# ---- matmuls over M rows that no even register-tile height divides (ViT: 64 patches + the class token =
# 65 rows; 7x7 = 49 pixels): a tile of 6 or 8 rows leaves a predicated tail on every register tile (4x
# slower measured on ViT's 65x256x64); 5- and 7-row tiles divide them ----

ODD_ROWS = [
    ("matmul_bias_gelu", dict(m=65, k=64, n=256), "cpu.matmul_epilogue"),
    ("matmul_bias_act", dict(m=49, k=32, n=64, act="Relu"), "cpu.matmul_epilogue"),
    ("qkv_projection", dict(seq=65, hidden=64), "cpu.sibling_matmuls"),
]


@pytest.mark.parametrize("tname", list(NAMED_TARGETS))
@pytest.mark.parametrize("builder,kwargs,family", ODD_ROWS, ids=[c[0] for c in ODD_ROWS])
def test_register_tile_rows_divide_odd_m(builder, kwargs, family, tname):
    target = named_target(tname)
    rows = kwargs.get("m", kwargs.get("seq"))
    tiles = {}
    for name, func in _prim_funcs(getattr(M, builder)(**kwargs), target).items():
        res = schedule_prim_func(func, target, {}, name)
        if res is not None and res.template == family:
            tiles[name] = res.config["mr"]
    assert tiles, f"no {family} kernel"
    for name, mr in tiles.items():
        assert mr > 1 and rows % mr == 0, f"{name} on {tname}: register tile of {mr} rows over M = {rows}"


@pytest.mark.parametrize("builder,kwargs,family", ODD_ROWS, ids=[c[0] for c in ODD_ROWS])
def test_register_tile_rows_divide_odd_m_numerics(builder, kwargs, family, host, rng):
    model = getattr(M, builder)(**kwargs)
    with Recorder() as rec:
        cm = tvmfuse.compile(model, host)
    assert family in {s["template"] for s in rec.schedules}, rec.schedules
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)


# ---- squeeze-excite (MobileNetV3's hardsigmoid, EfficientNet's SiLU gate): the expand conv over the pooled
# [1, C, 1, 1] and its activation were grouped with the multiply that broadcasts them over the feature map;
# no template takes an epilogue larger than the anchor's output (dlight's fallback did): the fusion rules
# refuse it, naming the templates, and each kernel gets a template ----

def _squeeze_excite(channels: int = 16, size: int = 8, gate: str = "HardSigmoid", seed: int = 0):
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = rng.standard_normal((channels, channels, 1, 1)).astype("float32")
    b = rng.standard_normal(channels).astype("float32")
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["p"]),
             helper.make_node("Conv", ["p", "w", "b"], ["e"], kernel_shape=[1, 1]),
             helper.make_node(gate, ["e"], ["s"]),
             helper.make_node("Mul", ["x", "s"], ["y"])]
    shape = [1, channels, size, size]
    graph = helper.make_graph(nodes, "squeeze_excite", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("gate", ["HardSigmoid", "Sigmoid"])
@pytest.mark.parametrize("tname", ["haswell-2", "skx-32"])
def test_squeeze_excite_broadcast_multiply_is_refused_and_every_kernel_has_a_template(gate, tname):
    target = named_target(tname)
    model = _squeeze_excite(gate=gate)
    with Recorder() as rec:
        funcs = _prim_funcs(model, target)
    refused = [r for r in rec.refused if "broadcasts the output of" in r["reason"]]
    assert refused and "cpu.conv2d_epilogue" in refused[0]["reason"], rec.refused
    conv_kernels = [n for n in funcs if "conv2d" in n]
    assert len(conv_kernels) == 1, sorted(funcs)
    # the conv kernel writes the gate [1, C, 1, 1] only; the broadcast multiply is a kernel of its own
    out = funcs[conv_kernels[0]].params[-1]
    assert [int(d) for d in out.shape] == [1, 16, 1, 1], sorted(funcs)
    for name, func in funcs.items():
        res = schedule_prim_func(func, target, {}, name)
        assert res is not None, f"{name}: no template"
        if name in conv_kernels:
            # a 1x1 conv on the pooled 1x1 plane: channels on the lanes (cpu.conv1x1)
            assert res.template == "cpu.conv1x1", (name, res.template)


@pytest.mark.parametrize("gate", ["HardSigmoid", "Sigmoid"])
def test_squeeze_excite_numerics(gate, host, rng):
    model = _squeeze_excite(gate=gate)
    with Recorder() as rec:
        cm = tvmfuse.compile(model, host)
    assert not [s for s in rec.schedules if s["source"] in ("fallback", "generic", "unscheduled")], rec.schedules
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-5)


# ---- ConvNeXt's block tail: layer scale x (NHWC -> NCHW) + residual, then LayerNorm over the channels of
# the NCHW sum and back: the rows (n, h, w) do not lead the output's loops (n, c, h, w), so cpu.row_reduction
# refuses it; dlight's cpu.Reduction scheduled it 50x slower than the generic schedule: the CPU fallback
# goes to the generic schedule ----

def _nchw_layernorm(c: int = 16, size: int = 8, seed: int = 0):
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    consts = {"g": rng.standard_normal(c), "b": rng.standard_normal(c), "s": rng.standard_normal((c, 1, 1))}
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 3, 1]),
             helper.make_node("Transpose", ["t"], ["t2"], perm=[0, 3, 1, 2]),
             helper.make_node("Mul", ["t2", "s"], ["m"]),
             helper.make_node("Add", ["m", "r"], ["a"]),
             helper.make_node("Transpose", ["a"], ["an"], perm=[0, 2, 3, 1]),
             helper.make_node("LayerNormalization", ["an", "g", "b"], ["ln"], axis=-1, epsilon=1e-6),
             helper.make_node("Transpose", ["ln"], ["y"], perm=[0, 3, 1, 2])]
    shape = [1, c, size, size]
    graph = helper.make_graph(
        nodes, "nchw_layernorm",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("x", "r")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(v.astype("float32"), k) for k, v in consts.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("tname", ["haswell-2", "skx-32"])
def test_channel_layernorm_of_nchw_gets_the_generic_schedule_not_dlight(tname):
    from tvmfuse import schedules as SCH
    from tvmfuse.schedules.cpu.generic import FAMILY

    target = named_target(tname)
    funcs = _prim_funcs(_nchw_layernorm(), target)
    (name, func), = [(n, f) for n, f in funcs.items() if "layer" in n]
    assert schedule_prim_func(func, target, {}, name) is None      # no template: the fallback's kernel
    with target, Recorder() as rec:
        out = C.Sequential(SCH.fallback_passes(target))(C.IRModule({name: func}))
    (rec_,) = rec.schedules
    assert (rec_["template"], rec_["source"]) == (FAMILY, "generic"), rec_
    kinds = _loop_kinds(out[name])
    assert int(C.ForKind.VECTORIZED) in kinds, kinds


def test_channel_layernorm_of_nchw_numerics(host, rng):
    model = _nchw_layernorm()
    with Recorder() as rec:
        cm = tvmfuse.compile(model, host)
    assert "fallback" not in {s["source"] for s in rec.schedules}, rec.schedules
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)


def _transposed_layernorm(c: int = 16, size: int = 16, seed: int = 0):
    """ConvNeXt's stem norm: NCHW -> NHWC, LayerNorm over channels, back to NCHW (c == h == w: the row loops
    (n, h, w) and the output's (n, c, h) have equal extents)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 3, 1]),
             helper.make_node("LayerNormalization", ["t", "g", "b"], ["ln"], axis=-1, epsilon=1e-6),
             helper.make_node("Transpose", ["ln"], ["y"], perm=[0, 3, 1, 2])]
    shape = [1, c, size, size]
    graph = helper.make_graph(
        nodes, "transposed_layernorm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(rng.standard_normal(c).astype("float32"), k) for k in ("g", "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("tname", ["haswell-2", "skx-32"])
def test_row_reduction_refuses_rows_that_only_look_aligned(tname):
    target = named_target(tname)
    funcs = _prim_funcs(_transposed_layernorm(), target)
    (name, func), = [(n, f) for n, f in funcs.items() if "layer" in n]
    res = schedule_prim_func(func, target, {}, name)
    assert res is None or res.template != "cpu.row_reduction", (name, res and res.config)


def test_transposed_layernorm_numerics(host, rng):
    model = _transposed_layernorm()
    cm = tvmfuse.compile(model, host)
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-4)


def _pool_flatten(c: int = 64, size: int = 2):
    """ResNet's head: global average pool over a 2x2 plane, flattened (the reshape reads mean[0, i % c])."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["p"]), helper.make_node("Flatten", ["p"], ["y"])]
    graph = helper.make_graph(nodes, "pool_flatten",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("tname", ["haswell-2", "skx-32"])
def test_row_reduction_takes_a_reshape_reading_its_rows(tname):
    target = named_target(tname)
    funcs = _prim_funcs(_pool_flatten(), target)
    (name, func), = [(n, f) for n, f in funcs.items() if "mean" in n]
    res = schedule_prim_func(func, target, {}, name)
    assert res is not None and res.template == "cpu.row_reduction", (name, res and res.template)


def test_pool_flatten_numerics(host, rng):
    model = _pool_flatten()
    cm = tvmfuse.compile(model, host)
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-5)
