"""Conv1d lowered to a conv2d one row high (``passes.conv1d.Conv1dAsConv2d``), so the CPU conv templates take
Whisper's front end (``Conv1d + bias + GELU``, then a transpose) instead of ``cpu.generic``
(benchmarks/notes/conv1d8.md).  The ONNX graphs are built with onnx.helper; the pass tests build Relax."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmfuse
from conftest import assert_close_to_reference, named_target
from tvmfuse import _compat as C
from tvmfuse.passes.conv1d import Conv1dAsConv2d

relax, op = C.relax, C.relax.op
CI, WIDTH = 16, 40

# name -> (conv attrs, output channels, the conv template the target's defaults pick)
CASES = {
    "stride1_pad1": (dict(strides=[1], pads=[1, 1]), 32, "cpu.conv2d_lanes"),
    "stride2_pad1": (dict(strides=[2], pads=[1, 1]), 32, "cpu.conv2d_lanes"),
    "depthwise": (dict(strides=[1], pads=[1, 1], group=CI), CI, "cpu.depthwise_conv2d_epilogue"),
    "grouped4": (dict(strides=[1], pads=[1, 1], group=4), 32, "cpu.conv2d_epilogue"),
}


def _model(case: str, batch=1, seed=0, batch_norm=False) -> onnx.ModelProto:
    """x [batch, CI, WIDTH] -> Conv1d (k3) -> Add bias [F, 1] -> Gelu -> Transpose [batch, W, F] (Whisper's
    front end: the transpose reads the conv's output, as the positional add does there); ``batch_norm``: a
    BatchNormalization (constant statistics) in place of the Add (PyTorch's Conv1d(bias=False) + BatchNorm1d)."""
    attrs, co, _ = CASES[case]
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((co, CI // attrs.get("group", 1), 3)) * 0.2).astype(np.float32)
    b = rng.standard_normal((co, 1)).astype(np.float32)
    ow = (WIDTH + sum(attrs["pads"]) - 3) // attrs["strides"][0] + 1
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3], **attrs),
             helper.make_node("BatchNormalization", ["c", "s", "bb", "m", "v"], ["a"]) if batch_norm else
             helper.make_node("Add", ["c", "b"], ["a"]),
             helper.make_node("Gelu", ["a"], ["g"]),
             helper.make_node("Transpose", ["g"], ["y"], perm=[0, 2, 1])]
    graph = helper.make_graph(
        nodes, f"conv1d_{case}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, CI, WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, ow, co])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
        + (_bn_params(rng, co) if batch_norm else []))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def _bn_params(rng, co: int) -> list:
    """BatchNormalization's scale, shift, mean and variance (constant, a positive variance)."""
    values = (rng.uniform(0.5, 1.5, co), rng.standard_normal(co), rng.standard_normal(co), rng.uniform(0.5, 2, co))
    return [numpy_helper.from_array(v.astype(np.float32), n) for n, v in zip(["s", "bb", "m", "v"], values)]


def _schedules(compiled) -> dict[str, str]:
    return {s["kernel"]: s["template"] for s in compiled.report.schedules}


@pytest.fixture(scope="module", params=sorted(CASES))
def host_build(request, host):
    return request.param, tvmfuse.compile(_model(request.param), host)


def test_numerics_vs_reference(host_build, rng):
    case, compiled = host_build
    assert_close_to_reference(_model(case), compiled, rng, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_conv_template_takes_conv_and_epilogue(case, target):
    compiled = tvmfuse.compile(_model(case), named_target(target))
    report = compiled.report
    # the conv, its bias and GELU in one kernel on the conv template; the transpose its own (as before)
    convs = [g for g in report.groups if "conv2d" in g["ops"]]
    assert len(convs) == 1 and {"add", "gelu"} <= set(convs[0]["ops"]), report.groups
    assert _schedules(compiled)[convs[0]["kernel"]] == CASES[case][2]
    assert "cpu.generic" not in _schedules(compiled).values()
    assert compiled.kernel_count == 2 and report.after.kernels == 2
    assert report.after.intermediates == 1        # the conv kernel's output, read by the transpose kernel


def test_symbolic_batch(rng):
    model = _model("stride2_pad1", batch="batch")
    compiled = tvmfuse.compile(model, tvmfuse.host_target())
    assert "cpu.generic" not in _schedules(compiled).values()
    assert any("conv2d" in g["ops"] and "gelu" in g["ops"] for g in compiled.report.groups)
    for batch in (1, 3):
        static = _model("stride2_pad1", batch=batch)
        feeds = {"x": rng.standard_normal((batch, CI, WIDTH)).astype(np.float32)}
        from tvmfuse import models as M

        ref = M.reference_outputs(static, feeds)["y"]
        np.testing.assert_allclose(compiled.run(feeds)["y"], ref, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- the Relax rewrite
def _func(body, weight_param=False):
    bb = C.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 10), "float32"))
    params = [x] + ([relax.Var("w", relax.TensorType((8, 4, 3), "float32"))] if weight_param else [])
    with bb.function("main", params):
        with bb.dataflow():
            out = None
            for e in body(bb, *params):
                out = bb.emit(e) if e is not None else out
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get()


W3 = np.arange(8 * 4 * 3, dtype=np.float32).reshape(8, 4, 3) / 50
B3 = np.arange(8, dtype=np.float32).reshape(8, 1)


def _run(mod, passes):
    with tvmfuse.host_target():
        return C.Sequential(passes + [C.relax_transform.CanonicalizeBindings(),
                                      C.relax_transform.DeadCodeElimination()])(mod)


def test_rewrite_before_expected():
    """conv1d (stride 2, padding 1) + bias + GELU, then a transpose: the conv and its epilogue in 4-D, one
    reshape before the transpose."""
    def before(bb, x):
        c = bb.emit(op.nn.conv1d(x, relax.const(W3), strides=2, padding=1))
        return [op.permute_dims(op.nn.gelu(op.add(c, relax.const(B3))), [0, 2, 1])]

    def expected(bb, x):
        x4 = bb.emit(op.reshape(x, (1, 4, 1, 10)))
        c = bb.emit(op.nn.conv2d(x4, relax.const(W3.reshape(8, 4, 1, 3)), strides=(1, 2), padding=(0, 1, 0, 1),
                                     out_dtype="float32"))
        g = bb.emit(op.nn.gelu(op.add(c, relax.const(B3.reshape(1, 8, 1, 1)))))
        return [op.permute_dims(op.reshape(g, (1, 8, 5)), [0, 2, 1])]

    C.assert_structural_equal(_run(_func(before), [Conv1dAsConv2d()]), _run(_func(expected), []))


@pytest.mark.parametrize("name", ["weights_not_constant", "layout_nwc"])
def test_rewrite_must_not_fire(name):
    if name == "weights_not_constant":
        mod = _func(lambda bb, x, w: [op.nn.relu(op.nn.conv1d(x, w))], weight_param=True)
    else:
        mod = _func(lambda bb, x: [op.nn.conv1d(op.permute_dims(x, [0, 2, 1]), relax.const(W3.transpose(0, 1, 2)),
                                                data_layout="NWC", out_layout="NWC")])
    C.assert_structural_equal(_run(mod, [Conv1dAsConv2d()]), _run(mod, []))


def test_other_tensor_operand_stays_3d():
    """An elementwise op whose other operand is a tensor of the model (not a constant) reads the 3-D view:
    only the conv (and constant epilogue ops) move to 4-D."""
    def before(bb, x):
        c = bb.emit(op.nn.conv1d(x, relax.const(W3), padding=1))
        return [op.add(c, op.sum(x, axis=[1], keepdims=True)), None]

    out = _run(_func(before), [Conv1dAsConv2d()])
    ops = [b.value.op.name for b in out["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert ops.count("relax.nn.conv2d") == 1 and "relax.nn.conv1d" not in ops
    add = [b.value for b in out["main"].body.blocks[0].bindings
           if isinstance(b.value, relax.Call) and b.value.op.name == "relax.add"]
    assert len(add) == 1 and len(C.type_of(add[0]).shape) == 3


def _func_no_dataflow(body):
    """``_func`` without a dataflow block: every binding is a function-level var."""
    bb = C.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 10), "float32"))
    with bb.function("main", [x]):
        out = None
        for e in body(bb, x):
            out = bb.emit(e) if e is not None else out
        bb.emit_func_output(out)
    return bb.get()


def test_rewrite_must_not_fire_outside_a_dataflow_block():
    """The epilogue's value bound outside a dataflow block: its reshape back to 3-D would be a copy kernel
    (RewriteDataflowReshape rewrites dataflow blocks only), so the conv stays a conv1d (expected = before) and
    the refusal says why."""
    from tvmfuse.explain import Recorder

    mod = _func_no_dataflow(
        lambda bb, x: [op.nn.gelu(op.add(op.nn.conv1d(x, relax.const(W3), padding=1), relax.const(B3)))])
    with Recorder() as rec:
        got = _run(mod, [Conv1dAsConv2d()])
    C.assert_structural_equal(got, _run(mod, []))
    assert any(r["rule"] == "conv1d_as_conv2d" and "outside a dataflow block" in r["reason"] for r in rec.refused)


def test_rewrite_fires_on_dataflow_output():
    """The epilogue's value is the dataflow block's output (the function's result): rewritten as any other,
    the reshape back to 3-D bound to the output var (OutputReshapeView makes it a view after the grouping)."""
    mod = _func(lambda bb, x: [op.nn.gelu(op.add(op.nn.conv1d(x, relax.const(W3), padding=1), relax.const(B3)))])
    ops = [b.value.op.name for b in _run(mod, [Conv1dAsConv2d()])["main"].body.blocks[0].bindings
           if isinstance(b.value, relax.Call)]
    assert "relax.nn.conv2d" in ops and "relax.nn.conv1d" not in ops and ops[-1] == "relax.reshape", ops


def _output_model() -> onnx.ModelProto:
    model = _model("stride1_pad1")
    del model.graph.node[-1]
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("g", TensorProto.FLOAT, [1, 32, WIDTH]))
    return model


@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
def test_output_conv_takes_the_conv_template(target):
    """ONNX Conv1d + Add + Gelu as the model's output: one kernel (no reshape copy after it, as without the
    rewrite) and it is the conv template's (it was cpu.generic's while the conv stayed a conv1d)."""
    compiled = tvmfuse.compile(_output_model(), named_target(target))
    assert compiled.kernel_count == 1, _schedules(compiled)
    assert list(_schedules(compiled).values()) == ["cpu.conv2d_lanes"], _schedules(compiled)
    assert not any(r["rule"] == "conv1d_as_conv2d" for r in compiled.report.refused), compiled.report.refused


def test_output_conv_numerics_and_runs_keep_their_outputs(host, rng):
    """The output is a view of the conv kernel's output: right on fresh inputs, and a second run does not
    overwrite the first run's result (the memory planner does not reuse a returned view's storage)."""
    model = _output_model()
    compiled = tvmfuse.compile(model, host)
    assert_close_to_reference(model, compiled, rng, rtol=1e-5, atol=1e-5)
    f = compiled.vm["main"]
    x1, x2 = (rng.standard_normal((1, CI, WIDTH)).astype(np.float32) for _ in range(2))
    r1 = f(C.tensor(x1))
    first = r1.numpy().copy()
    r2 = f(C.tensor(x2))
    np.testing.assert_array_equal(r1.numpy(), first)
    assert not np.array_equal(r2.numpy(), first)


def test_batch_norm_folds_into_the_conv1d(rng):
    """Conv1d + BatchNormalization + Gelu: the BN folds into the conv1d's weights (FoldBatchNorm, before the
    rewrite), so conv, BN shift and GELU are one conv-template kernel."""
    model = _model("stride1_pad1", batch_norm=True)
    compiled = tvmfuse.compile(model, tvmfuse.host_target())
    assert compiled.kernel_count == 2 and "cpu.conv2d_lanes" in _schedules(compiled).values()
    assert not any("batch_norm" in g["ops"] for g in compiled.report.groups)
    assert_close_to_reference(model, compiled, rng, rtol=1e-5, atol=1e-5)
