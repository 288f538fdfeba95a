"""The public API of the foundation: load_onnx, pipeline, compile, CompiledModel, FusionReport."""
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.report import graph_stats

from conftest import assert_close_to_reference


def test_save_json_roundtrip():
    """apache-tvm-ffi 0.1.15.x segfaults here; the pin to 0.1.14.post1 keeps it working."""
    mod = tvmfuse.load_onnx(M.matmul_bias_gelu(m=4, k=8, n=8))
    text = C.save_json(mod)
    C.assert_structural_equal(C.load_json(text), mod)


def test_load_onnx_binds_weights_as_constants():
    mod = tvmfuse.load_onnx(M.matmul_bias_gelu(m=4, k=8, n=8))
    assert [C.var_name(p) for p in mod["main"].params] == ["x"]
    m = M.matmul_bias_gelu(m=4, k=8, n=8)
    mod2 = tvmfuse.load_onnx(m, keep_params_in_input=True)
    assert len(mod2["main"].params) == 1 + len(m.graph.initializer)


def _shape_chain_model():
    """PyTorch-style reshape: the target shape computed at run time from Shape -> Gather -> Div -> Concat."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 8])
    i64 = lambda name, v: helper.make_tensor(name, TensorProto.INT64, [len(v)], v)  # noqa: E731
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "idx1"], ["d1"], axis=0),
        helper.make_node("Div", ["d1", "two"], ["half"]),
        helper.make_node("Gather", ["s", "idx0"], ["d0"], axis=0),
        helper.make_node("Concat", ["d0", "half", "minus1"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["r"]),
        helper.make_node("Relu", ["r"], ["y"]),
    ]
    g = helper.make_graph(nodes, "shape_chain", [x], [y],
                          [i64("idx1", [1]), i64("idx0", [0]), i64("two", [2]), i64("minus1", [-1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_shape_subgraph_is_folded_before_import():
    from tvmfuse.frontend import fold_static_shapes

    m = _shape_chain_model()
    folded, n = fold_static_shapes(m)
    assert n == 5
    assert [nd.op_type for nd in folded.graph.node] == ["Reshape", "Relu"]
    cm = tvmfuse.compile(m)
    x = np.random.default_rng(0).standard_normal((2, 6, 4)).astype("float32")
    np.testing.assert_array_equal(cm.run({"x": x})["y"], np.maximum(x.reshape(2, 3, 8), 0))


def test_compile_onnx_and_run_matches_reference(rng):
    m = M.transformer_block(seq=16, hidden=32, heads=2, ffn=64)
    cm = tvmfuse.compile(m)
    assert isinstance(cm, tvmfuse.CompiledModel)
    assert [i.name for i in cm.inputs] == ["x"] and [o.name for o in cm.outputs] == ["y"]
    assert_close_to_reference(m, cm, rng, rtol=1e-4, atol=1e-5)
    assert cm.kernel_count == cm.report.kernels_after < cm.report.kernels_before


def test_compile_from_path_and_irmodule(tmp_path, rng):
    m = M.elementwise_chain(n=64)
    p = tmp_path / "m.onnx"
    onnx.save(m, p)
    cm = tvmfuse.compile(str(p))
    assert cm.report.model == "m.onnx"
    assert_close_to_reference(m, cm, rng)
    cm2 = tvmfuse.compile(tvmfuse.load_onnx(m))
    a, b, c = (rng.standard_normal(64).astype("float32") for _ in range(3))
    out = cm2.run({"a": a, "b": b, "c": c})["output0"]
    np.testing.assert_allclose(out, 1 / (1 + np.exp(-(a + b) * c)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("as_pass", [True, False])
def test_tvm_compile_with_tvmfuse_pipeline(as_pass, rng):
    """tvm.compile(mod, target, relax_pipeline=tvmfuse.pipeline(target)) and relax_pipeline="tvmfuse"."""
    m = M.matmul_bias_gelu(m=8, k=16, n=24)
    mod = tvmfuse.load_onnx(m)
    target = tvmfuse.host_target()
    ex = C.compile_module(mod, target, relax_pipeline=tvmfuse.pipeline(target) if as_pass else "tvmfuse")
    vm = C.VirtualMachine(ex, C.cpu())
    feeds = M.random_feeds(m, seed=3)
    out = vm["main"](C.tensor(feeds["x"])).numpy()
    np.testing.assert_allclose(out, M.reference_outputs(m, feeds)["y"], rtol=1e-4, atol=1e-5)


def test_pipeline_is_a_named_pass():
    p = tvmfuse.pipeline(tvmfuse.host_target())
    assert isinstance(p, C.ir_transform.Pass)
    assert p.info.name == "tvmfuse.pipeline"


def _hand_graph():
    """x -> relu -> exp -> (tanh, sigmoid) -> add : 5 ops, 4 unfused intermediates of 16x8 float32."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 8])
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Exp", ["r"], ["e"]),
             helper.make_node("Tanh", ["e"], ["t"]), helper.make_node("Sigmoid", ["e"], ["s"]),
             helper.make_node("Add", ["t", "s"], ["y"])]
    m = helper.make_model(helper.make_graph(nodes, "hand", [x], [y]),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_report_numbers_by_hand(rng):
    """Unfused: 5 kernels; intermediates r, e, t, s (512 B each); e is read by two kernels.
    traffic = r (write+read) + e (write + 2 reads) + t (w+r) + s (w+r) = 512*(2+3+2+2) = 4608 B.
    Fused: one kernel, no intermediate."""
    m = _hand_graph()
    cm = tvmfuse.compile(m)
    r = cm.report
    assert (r.before.kernels, r.before.intermediates) == (5, 4)
    assert r.before.intermediate_bytes == 4 * 16 * 8 * 4
    assert r.before.traffic_bytes == 512 * 9
    assert (r.after.kernels, r.after.intermediates, r.after.traffic_bytes) == (1, 0, 0)
    assert r.traffic_removed_bytes == 4608
    assert len(r.groups) == 1 and sorted(r.groups[0]["ops"]) == sorted(["relu", "exp", "tanh", "sigmoid", "add"])
    d = json.loads(r.to_json())
    assert d["before"]["kernels"] == 5 and d["after"]["kernels"] == 1
    assert "kernels" in r.table() and "4.6 kB" in r.table()
    x = rng.standard_normal((16, 8)).astype("float32")
    e = np.exp(np.maximum(x, 0))
    np.testing.assert_allclose(cm.run({"x": x})["y"], np.tanh(e) + 1 / (1 + np.exp(-e)), rtol=1e-5, atol=1e-6)


def test_run_rejects_bad_feeds():
    cm = tvmfuse.compile(M.elementwise_chain(n=8))
    good = {k: np.zeros(8, "float32") for k in "abc"}
    with pytest.raises(tvmfuse.InputError, match="unknown input"):
        cm.run({**good, "d": np.zeros(8, "float32")})
    with pytest.raises(tvmfuse.InputError, match="missing input"):
        cm.run({"a": good["a"]})
    with pytest.raises(tvmfuse.InputError, match="shape"):
        cm.run({**good, "a": np.zeros(9, "float32")})
    with pytest.raises(tvmfuse.InputError, match="dtype"):
        cm.run({**good, "a": np.zeros(8, "float64")})


def test_bad_models_have_clear_errors(tmp_path):
    with pytest.raises(tvmfuse.ModelLoadError, match="not found"):
        tvmfuse.load_onnx(str(tmp_path / "missing.onnx"))
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00\x01garbage" * 10)
    with pytest.raises(tvmfuse.ModelLoadError):
        tvmfuse.load_onnx(str(bad))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 1, 3, 2])
    node = helper.make_node("LSTM", ["x", "w", "r"], ["y"], name="my_lstm", hidden_size=2)
    g = helper.make_graph([node], "g", [x], [y], [
        helper.make_tensor("w", TensorProto.FLOAT, [1, 8, 4], np.zeros(32).tolist()),
        helper.make_tensor("r", TensorProto.FLOAT, [1, 8, 2], np.zeros(16).tolist())])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(tvmfuse.UnsupportedOpError, match="'LSTM'.*my_lstm"):
        tvmfuse.load_onnx(m)


def test_threads_default_to_physical_cores(monkeypatch):
    from tvmfuse.target import configure_threads, physical_cores

    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    assert configure_threads() == physical_cores()
    assert configure_threads(1) == 1
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    assert configure_threads() == 1


def test_target_parsing():
    from tvmfuse.target import parse_target

    assert parse_target(None).kind.name == "llvm"
    assert parse_target("host").attrs["mcpu"] == C.llvm_system_cpu()
    assert parse_target('{"kind": "llvm", "mcpu": "skylake-avx512"}').attrs["mcpu"] == "skylake-avx512"
    cuda = parse_target("cuda")
    assert cuda.kind.name == "cuda" and cuda.host is not None
    with pytest.raises(tvmfuse.TargetError):
        parse_target("nonsense-target-kind")
