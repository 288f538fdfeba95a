"""benchmarks/sequence_replay.py: the captured calls are the model's kernel calls in order, on the arguments
of its run (replayed, they reproduce its output), and the sums are of its rows.  No timing is asserted (one
round of one call, only to run the code path)."""
import importlib.util
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import tvmfuse

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("sequence_replay",
                                               os.path.join(_ROOT, "benchmarks", "sequence_replay.py"))
R = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(R)


def _conv_pool_conv(path: str) -> dict:
    """Conv + Relu -> MaxPool 3x3/2 -> Conv (1x1): three kernels, written to ``path``; its feeds."""
    rng = np.random.default_rng(3)
    w1 = numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.2).astype("float32"), "W1")
    w2 = numpy_helper.from_array((rng.standard_normal((4, 8, 1, 1)) * 0.2).astype("float32"), "W2")
    nodes = [helper.make_node("Conv", ["x", "W1"], ["c"], kernel_shape=[3, 3]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[3, 3], strides=[2, 2]),
             helper.make_node("Conv", ["p", "W2"], ["y"], kernel_shape=[1, 1])]
    g = helper.make_graph(nodes, "ccp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 17, 17])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 7, 7])], [w1, w2])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, path)
    return {"x": rng.standard_normal((1, 3, 17, 17)).astype("float32")}


def test_capture_is_the_run_in_order(tmp_path):
    path = str(tmp_path / "ccp.onnx")
    feeds = _conv_pool_conv(path)
    cm = tvmfuse.compile(path)
    want, = cm.run(feeds).values()          # {output name: array}
    want = want.numpy() if hasattr(want, "numpy") else np.asarray(want)
    probe = tvmfuse.compile(path)
    seq = R.capture(probe, feeds)
    assert len(seq) == cm.kernel_count == 3, [n for n, _ in seq]
    assert "pool" in seq[1][0], [n for n, _ in seq]
    # replayed on copies of the captured arguments, the last call reproduces the model's output
    lib = probe.executable.mod.imports[0]
    from tvmfuse import _compat as C
    name, args = seq[-1]
    dev = [C.tensor(a) for a in args]
    dev[-1] = C.tensor(np.zeros_like(args[-1]))
    lib[name](*dev)
    np.testing.assert_allclose(dev[-1].numpy(), want, rtol=1e-5, atol=1e-5)


def test_profile_rows_and_sums(tmp_path):
    path = str(tmp_path / "ccp.onnx")
    feeds = _conv_pool_conv(path)
    out = R.profile(path, feeds, rounds=1, number=1)
    assert len(out["calls"]) == 3
    assert out["in_sequence_sum_us"] == round(sum(r["in_sequence_us"] for r in out["calls"]), 1)
    assert out["alone_sum_us"] == round(sum(r["alone_us"] for r in out["calls"]), 1)
    assert all(r["alone_us"] > 0 and r["in_sequence_us"] > 0 for r in out["calls"])
    assert "measured under load" in out["clock"]
