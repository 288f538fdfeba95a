"""Storage of a symbolic CNN shared across sizes of its activations (issue 13, ``tvmfuse.share_symbolic_storage``):
Relax plans a storage of symbolic size again only for an equal size expression, so a CNN over a symbolic
batch (activations ``8192 * batch``, ``2048 * batch``, ... bytes) allocated a storage per distinct size every
call (resnet18_dyn: 15 against 5 static).  The pass shares them where lifetimes do not overlap."""
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.frontend import load_onnx
from tvmfuse.pipeline import PipelineOptions, Stages, _share_symbolic_storage

from conftest import named_target

PASS = "tvmfuse.share_symbolic_storage"


def _shrinking_cnn(batch="batch", seed: int = 0) -> onnx.ModelProto:
    """Conv-ReLU-MaxPool twice, then Conv: activations of three sizes ([b, 8, 16, 16], [b, 8, 8, 8],
    [b, 8, 4, 4])."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []
    x = "x"
    for i, (cin, pool) in enumerate([(4, True), (8, True), (8, False)]):
        w = f"w{i}"
        inits.append(numpy_helper.from_array((rng.standard_normal((8, cin, 3, 3)) / np.sqrt(9 * cin))
                                             .astype(np.float32), w))
        nodes.append(helper.make_node("Conv", [x, w], [f"c{i}"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
        x = f"c{i}"
        if pool:
            nodes.append(helper.make_node("Relu", [x], [f"r{i}"]))
            nodes.append(helper.make_node("MaxPool", [f"r{i}"], [f"p{i}"], kernel_shape=[2, 2], strides=[2, 2]))
            x = f"p{i}"
    nodes[-1].output[0] = "y"
    g = helper.make_graph(nodes, "shrinking_cnn",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 8, 4, 4])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _lowered_main(model, target, without: str | None = None) -> str:
    """TVMScript of ``main`` after tvmfuse's whole Relax pipeline (without the pass named ``without``)."""
    with target:
        passes = [p for p in Stages(target, PipelineOptions()).all() if p.info.name != without]
        return C.Sequential(passes)(load_onnx(model))["main"].script()


def _storages(main_text: str) -> list[str]:
    """The size of each ``R.vm.alloc_storage`` of ``main``: ``R.shape([n])`` or a shape variable's name."""
    return re.findall(r"R\.vm\.alloc_storage\((R\.shape\(\[\d+\]\)|\w+),", main_text)


@pytest.fixture(scope="module")
def lowered():
    target = named_target("skx-2")
    return {"shared": _lowered_main(_shrinking_cnn(), target),
            "unshared": _lowered_main(_shrinking_cnn(), target, without=PASS),
            "static": _lowered_main(_shrinking_cnn(3), target),
            "static_unshared": _lowered_main(_shrinking_cnn(3), target, without=PASS)}


def test_symbolic_storages_shared_like_the_static_plan(lowered):
    # kernels: conv+relu, maxpool, conv+relu, maxpool, conv; intermediates of 3 sizes, each live while the
    # next is written: TVM alone gives one storage per intermediate size and liveness (4 + the output)
    assert len(_storages(lowered["unshared"])) == 5
    # shared: two storages alternate (the first sized for the largest activation) + the output, as static
    assert len(_storages(lowered["shared"])) == len(_storages(lowered["static"])) == 3
    assert lowered["shared"].count("R.vm.alloc_tensor(") == lowered["unshared"].count("R.vm.alloc_tensor(")


@pytest.fixture(scope="module")
def builds(host):
    return tvmfuse.compile(_shrinking_cnn(), target=host), tvmfuse.compile(_shrinking_cnn(3), target=host)


def test_shared_storage_model_matches_static_and_reference(builds, rng):
    sym, static = builds
    assert sym.kernel_count == static.kernel_count == 5
    for batch in (3, 1, 3):        # a smaller size between larger ones: the storages are made per call
        x = rng.standard_normal((batch, 4, 16, 16)).astype(np.float32)
        got = sym.run({"x": x})["y"]
        assert got.shape == (batch, 8, 4, 4)
        if batch == 3:
            np.testing.assert_allclose(got, static.run({"x": x})["y"], rtol=1e-5, atol=1e-5)
        else:      # the reference evaluator's Python convolutions: one size
            np.testing.assert_allclose(got, M.reference_outputs(_shrinking_cnn(), {"x": x})["y"], rtol=1e-4,
                                       atol=1e-4)


# ----------------------------------------------------------------------------------- the pass on its own
def _shared(mod) -> tuple[str, list[str], int]:
    """``main`` after the pass: its TVMScript, the storage each ``alloc_tensor`` takes (in order) and the
    number of ``alloc_storage`` calls left."""
    main = _share_symbolic_storage(mod)["main"].script()
    return (main, re.findall(r"R\.memory\.alloc_tensor\((\w+),", main),
            len(re.findall(r"R\.memory\.alloc_storage\(", main)))


_STUBS = {"copy": "a: T.handle, b: T.handle", "two": "a: T.handle, b: T.handle, c: T.handle"}


def _alloc(i: int, size: str, shape: str, tensor: str | None = None) -> list[str]:
    """The two lines of a planned allocation: storage ``s<i>`` of ``size`` floats, tensor ``t<i>`` (or
    ``tensor``) of ``shape`` in it."""
    return [f's{i} = R.memory.alloc_storage(R.shape([{size}]), 0, "global", "float32")',
            f'{tensor or f"t{i}"} = R.memory.alloc_tensor(s{i}, 0, R.shape([{shape}]), "float32")']


def _planned(name: str, params: str, sizes: str, body: list[str], kernels=("copy",)):
    """A module as the memory planning leaves one: do-nothing kernels ``kernels`` (``_STUBS``) and an impure
    ``main(params)`` binding the shape variables ``sizes``, then ``body`` (TVMScript lines, ``cls`` the module)."""
    pad = "\n" + " " * 8
    stubs = "".join(f"    @T.prim_func\n    def {k}({_STUBS[k]}):\n        T.evaluate(0)\n\n" for k in kernels)
    lines = [sizes, f"cls = {name}", *body]
    return C.parse_script(f"@I.ir_module\nclass {name}:\n{stubs}    @R.function(pure=False)\n"
                          f"    def main({params}):{pad}" + pad.join(lines) + "\n")


def _planned_module():
    """``main`` as the memory planning leaves it: four symbolic storages, ``t0`` read by the second kernel
    (so ``t1`` overlaps it), ``t2`` of a size not comparable with ``t0``'s, ``t3`` returned."""
    return _planned("Planned", 'x: R.Tensor(("n", "m"), "float32")', "n, m = T.int64(), T.int64()", [
        *_alloc(0, "n * 64", "n, 16"), "cls.copy(x, t0)",
        *_alloc(1, "n * 32", "n, 8"), "cls.copy(t0, t1)",
        *_alloc(2, "m * 4", "m"), "cls.copy(t1, t2)",
        *_alloc(3, "n * 32", "n, 8"), "cls.copy(t2, t3)",
        "return t3"])


def test_pass_shares_only_storages_whose_tensors_are_dead():
    main, used, _ = _shared(_planned_module())
    sizes = re.findall(r"= R\.memory\.alloc_storage\(R\.shape\(\[(.*?)\]\)", main)
    # t0's storage (dead after the second kernel) takes t2 (size m * 4: the larger of the two not provable,
    # so their max); t1 (overlaps t0) gets its own; s3 holds the result, which leaves main: left as it is
    assert sizes == ["T.max(n * 64, m * 4)", "n * 32", "n * 32"], main
    assert used[0] == used[2] != used[1] and used[3] == "s3", used


def test_pass_leaves_static_storage_alone(lowered):
    """Constant sizes are TVM's own planning; nothing to share in a static model's ``main``."""
    assert lowered["static"] == lowered["static_unshared"]


def _aliased_module():
    """``t0`` read after ``t1``'s allocation only through a view (a packed call's result)."""
    return _planned("Aliased", 'x: R.Tensor(("n", 16), "float32")', "n = T.int64()", [
        *_alloc(0, "n * 64", "n, 16"), "cls.copy(x, t0)",
        'v0 = R.call_packed("vm.builtin.reshape", t0, R.shape([n * 16]), ty_args=R.Tensor((n * 16,), "float32"))',
        *_alloc(1, "n * 32", "n, 8"), "cls.copy(v0, t1)",
        *_alloc(2, "n * 64", "n, 16"), "cls.copy(t1, t2)",
        *_alloc(3, "n * 32", "n, 8", "out"), "cls.copy(t2, out)",
        "return out"])


def test_pass_follows_views_and_keeps_returned_storage():
    main, used, storages = _shared(_aliased_module())
    # t1 overlaps t0 through its view v0: a storage of its own; t2 takes t0's, dead after the view's last
    # read; the result's storage (s3) is left as it is
    assert used[0] == used[2] != used[1] and used[3] == "s3", main
    assert storages == 3


def _tuple_outputs_module():
    """A kernel writing two outputs read back through their tuple (``lv = t[0]``, as FuseTIR's multi-output
    kernels are): ``t1`` (field 1) is last read before ``t3``'s allocation, ``t0`` (field 0) after it."""
    return _planned("Tupled", 'x: R.Tensor(("n", 16), "float32")', "n = T.int64()", [
        *_alloc(0, "n * 64", "n, 16"), *_alloc(1, "n * 64", "n, 16"), "cls.two(x, t0, t1)",
        "tup = (t0, t1)", "a = tup[0]", "b = tup[1]",
        *_alloc(2, "n * 64", "n, 16"), "cls.copy(b, t2)",
        *_alloc(3, "n * 64", "n, 16"), "cls.two(a, t2, t3)",
        *_alloc(4, "n * 64", "n, 16", "out"), "cls.copy(t3, out)",
        "return out"], kernels=("copy", "two"))


def test_pass_reads_a_tuple_field_as_that_output_only():
    """Reading ``a = tup[0]`` keeps ``t0`` alive, not its sibling ``t1``: ``t3`` takes ``t1``'s storage (before,
    every field of a kernel's output tuple lived as long as any one was read: llama_dyn kept 11 storages per
    call, 9 now)."""
    main, used, storages = _shared(_tuple_outputs_module())
    assert used[3] == used[1] and len({used[0], used[1], used[2]}) == 3 and used[4] == "s4", main
    assert storages == 4
