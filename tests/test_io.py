"""Zero-copy I/O of ``run()`` / ``bind()`` (tvmfuse/io.py), for a compiled model and a loaded artifact.

Every test runs twice: on ``tvmfuse.compile``'s CompiledModel and on ``tvmfuse.load`` of its exported
artifact (the Runner), which share the code.  The models compile with ``element_aligned_args`` (the
default: ordinary numpy arrays go in place); ``model64`` without it (TVM's 64-byte assumption).  "No
copy" is checked on pointers: the data pointers of the tensors the VM's ``main`` receives and returns
(recorded by a spy around it) against the numpy arrays' ``__array_interface__`` addresses.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import tvmfuse
from conftest import named_target
from tvmfuse import models as M
from tvmfuse.io import ALIGNMENT

N = 4096


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _reference(f):
    return 1.0 / (1.0 + np.exp(-((f["a"].astype(np.float64) + f["b"]) * f["c"])))


@pytest.fixture(scope="module")
def compiled():
    return tvmfuse.compile(M.elementwise_chain(N))          # sigmoid((a + b) * c), host target


@pytest.fixture(scope="module", params=["compiled", "artifact"])
def model(request, compiled, tmp_path_factory):
    if request.param == "compiled":
        return compiled
    return tvmfuse.load(tvmfuse.export(compiled, str(tmp_path_factory.mktemp("io") / "chain")))


@pytest.fixture(scope="module", params=["compiled", "artifact"])
def model64(request, tmp_path_factory):
    """The chain compiled with TVM's 64-byte alignment assumption (``element_aligned_args=False``)."""
    cm = tvmfuse.compile(M.elementwise_chain(N), element_aligned_args=False)
    if request.param == "compiled":
        return cm
    return tvmfuse.load(tvmfuse.export(cm, str(tmp_path_factory.mktemp("io64") / "chain")))


class Spy:
    """Wraps the model's VM ``main``: records the data pointers of its arguments and results."""

    def __init__(self, model, monkeypatch):
        inner = model._main()
        self.args, self.results = [], []

        def main(*args):
            self.args.append([a.data_ptr() for a in args])
            r = inner(*args)
            self.results.append(r.data_ptr())
            return r

        monkeypatch.setattr(model, "_main", lambda: main)
        # run()'s per-model plan binds the VM's function once (tvmfuse.io._static_run) and, for a static
        # model, becomes its run: a fresh one binds the spy (monkeypatch puts the model's own back)
        monkeypatch.delitem(model.__dict__, "_plan", raising=False)
        monkeypatch.delitem(model.__dict__, "run", raising=False)


def _feeds(rng, alloc=tvmfuse.empty):
    out = {}
    for k in "abc":
        a = alloc(N, "float32")
        a[...] = rng.standard_normal(N)
        out[k] = a
    return out


def _at_offset(values: np.ndarray, offset: int) -> np.ndarray:
    """A copy of ``values`` whose data starts ``offset`` bytes past a 64-byte boundary."""
    raw = np.empty(values.nbytes + 2 * ALIGNMENT, np.uint8)
    start = (-_addr(raw)) % ALIGNMENT + offset
    a = raw[start:start + values.nbytes].view(values.dtype).reshape(values.shape)
    a[...] = values
    return a


def test_empty_is_aligned_and_contiguous():
    for shape, dtype in [((3, 5), "float32"), (7, "int8"), ((2, 3, 4), "float64"), ((0, 4), "float32")]:
        a = tvmfuse.empty(shape, dtype)
        assert a.shape == (tuple(shape) if isinstance(shape, tuple) else (shape,)) and a.dtype == dtype
        assert (a.size == 0 or _addr(a) % ALIGNMENT == 0) and a.flags.c_contiguous and a.flags.writeable
    assert not tvmfuse.zeros((4, 4)).any()


@pytest.mark.parametrize("alloc", [np.empty, tvmfuse.empty], ids=["numpy", "tvmfuse.empty"])
def test_numpy_inputs_and_outputs_are_not_copied(model, rng, monkeypatch, alloc):
    spy = Spy(model, monkeypatch)
    feeds = _feeds(rng, alloc)
    assert model.element_aligned_args
    out = model.run(feeds)["y"]
    assert spy.args == [[_addr(feeds[k]) for k in "abc"]]           # the kernels read the arrays in place
    assert _addr(out) == spy.results[0]                              # the output views the VM's tensor
    np.testing.assert_allclose(out, _reference(feeds), rtol=1e-5, atol=1e-6)
    assert model.bind(feeds).copied == {}


@pytest.mark.parametrize("offset", [4, 8, 16, 20, 32, 60])
def test_element_aligned_inputs_at_any_offset_go_in_place(model, rng, monkeypatch, offset):
    # before element_aligned_args these pointers crashed the kernels (aligned vector moves; tvmfuse/io.py)
    spy = Spy(model, monkeypatch)
    feeds = {k: _at_offset(v, offset) for k, v in _feeds(rng).items()}
    assert all(_addr(v) % ALIGNMENT == offset for v in feeds.values())
    out = model.run(feeds)["y"]
    assert spy.args[0] == [_addr(feeds[k]) for k in "abc"]
    np.testing.assert_allclose(out, _reference(feeds), rtol=1e-5, atol=1e-6)
    # a view one element into a larger array (np.empty(n + 1)[1:]) goes in place too
    views = {}
    for k, v in feeds.items():
        big = np.empty(N + 1, np.float32)
        big[1:] = v
        views[k] = big[1:]
    np.testing.assert_array_equal(model.run(views)["y"], out)
    assert spy.args[1] == [_addr(views[k]) for k in "abc"]


def test_input_not_element_aligned_is_copied(model, rng, monkeypatch):
    spy = Spy(model, monkeypatch)
    feeds = _feeds(rng)
    odd = {**feeds, "b": _at_offset(feeds["b"], 2)}                   # float32 data 2 bytes off: not aligned
    assert _addr(odd["b"]) % 4 == 2
    out = model.run(odd)["y"]
    assert spy.args[0][1] != _addr(odd["b"]) and spy.args[0][1] % ALIGNMENT == 0
    assert spy.args[0][0] == _addr(feeds["a"]) and spy.args[0][2] == _addr(feeds["c"])
    np.testing.assert_allclose(out, _reference(feeds), rtol=1e-5, atol=1e-6)
    assert model.bind(odd).copied == {"b": "data not 4-byte aligned (address % 4 = 2)"}


@pytest.mark.parametrize("offset", [4, 16, 32])
def test_misaligned_input_is_copied_for_64_byte_kernels(model64, rng, monkeypatch, offset):
    # given as they are, these pointers crash kernels compiled with TVM's 64-byte assumption (see tvmfuse/io.py)
    model = model64
    assert not model.element_aligned_args
    spy = Spy(model, monkeypatch)
    feeds = {k: _at_offset(v, offset) for k, v in _feeds(rng).items()}
    assert all(_addr(v) % ALIGNMENT == offset for v in feeds.values())
    out = model.run(feeds)["y"]
    assert all(p % ALIGNMENT == 0 and p != _addr(feeds[k]) for p, k in zip(spy.args[0], "abc"))
    np.testing.assert_allclose(out, _reference(feeds), rtol=1e-5, atol=1e-6)
    # the same values aligned go in place, and give the same result
    again = {k: _at_offset(v, 0) for k, v in feeds.items()}
    np.testing.assert_array_equal(model.run(again)["y"], out)
    assert spy.args[1] == [_addr(again[k]) for k in "abc"]


def test_non_contiguous_and_read_only_inputs_give_right_results(model, rng, monkeypatch):
    spy = Spy(model, monkeypatch)
    base = _feeds(rng)
    wide = tvmfuse.empty((N, 2))
    wide[:, 0] = base["a"]
    ro = base["c"].copy()
    ro.flags.writeable = False
    feeds = {"a": wide[:, 0], "b": base["b"], "c": ro}
    out = model.run(feeds)["y"]
    np.testing.assert_allclose(out, _reference(base), rtol=1e-5, atol=1e-6)
    assert spy.args[0][0] != _addr(wide) and spy.args[0][1] == _addr(base["b"]) and spy.args[0][2] != _addr(ro)


def test_wrong_inputs_are_a_clear_error(model, rng):
    good = _feeds(rng)
    with pytest.raises(tvmfuse.InputError, match="input 'a' has dtype float64, the model expects float32"):
        model.run({**good, "a": good["a"].astype(np.float64)})
    with pytest.raises(tvmfuse.InputError, match=r"input 'b' has shape \[4095\]"):
        model.run({**good, "b": good["b"][1:]})
    with pytest.raises(tvmfuse.InputError, match="missing input"):
        model.run({"a": good["a"]})


def test_ordinary_feeds_skip_the_full_checks_and_others_still_get_them(model, rng, monkeypatch):
    # run() checks ordinary numpy feeds against a plan made once per model (issue 11: the full checks
    # cost 30-40 us a call); anything else (a dict subclass, a wrong name, a TVM tensor) takes the full
    # path, which gives the same results or the same errors
    import collections

    import tvmfuse.io as io

    feeds = _feeds(rng, np.empty)
    full = []
    real = io.validate_feeds
    monkeypatch.setattr(io, "validate_feeds", lambda f, i, *b: full.append(1) or real(f, i, *b))
    np.testing.assert_allclose(model.run(feeds)["y"], _reference(feeds), rtol=1e-5, atol=1e-6)
    assert full == []
    ordered = collections.OrderedDict(feeds)
    np.testing.assert_allclose(model.run(ordered)["y"], _reference(feeds), rtol=1e-5, atol=1e-6)
    assert full == [1]
    with pytest.raises(tvmfuse.InputError, match=r"unknown input name\(s\) \['z'\]"):
        model.run({"a": feeds["a"], "b": feeds["b"], "z": feeds["c"]})      # right count, wrong name
    with pytest.raises(tvmfuse.InputError, match=r"input 'c' has shape \[1, 4096\]"):
        model.run({**feeds, "c": feeds["c"][None]})
    with pytest.raises(tvmfuse.InputError, match="input 'b' has dtype int32"):
        model.run({**feeds, "b": feeds["b"].astype(np.int32)})


def test_symbolic_dims_are_checked_on_every_call(host, rng):
    # x: [batch, seq, 16] and m: [batch, seq] share both dims: sizes that agree run (twice, with other
    # sizes the second time), sizes that disagree are an InputError naming the dim and both inputs
    g = M._G("two_inputs")
    x = g.input("x", ("batch", "seq", 16))
    m = g.input("m", ("batch", "seq"))
    g.op("Mul", x, g.op("Unsqueeze", m, g.const(np.array([-1], np.int64))))
    g.rename_last("y", ("batch", "seq", 16))
    cm = tvmfuse.compile(g.model(), host)
    for b, t in [(2, 5), (3, 7)]:
        f = {"x": rng.standard_normal((b, t, 16)).astype(np.float32),
             "m": rng.standard_normal((b, t)).astype(np.float32)}
        np.testing.assert_allclose(cm.run(f)["y"], f["x"] * f["m"][..., None], rtol=1e-6, atol=1e-6)
    bad = {"x": np.zeros((2, 5, 16), np.float32), "m": np.zeros((2, 6), np.float32)}
    with pytest.raises(tvmfuse.InputError, match=r"symbolic dim 'seq' is 5 in input 'x' \(axis 1\) but 6 in input 'm'"):
        cm.run(bad)
    with pytest.raises(tvmfuse.InputError, match=r"input 'x' has shape \[2, 5, 8\]"):
        cm.run({"x": np.zeros((2, 5, 8), np.float32), "m": np.zeros((2, 5), np.float32)})


def test_results_stay_valid_after_the_next_call(model, rng):
    f1, f2 = _feeds(rng), _feeds(rng)
    y1 = model.run(f1)["y"]
    kept = y1.copy()
    y2 = model.run(f2)["y"]
    np.testing.assert_array_equal(y1, kept)                      # call 2 did not write into call 1's result
    assert not np.shares_memory(y1, y2)
    np.testing.assert_allclose(y2, _reference(f2), rtol=1e-5, atol=1e-6)
    # refilling the same input arrays in place (the zero-copy loop) leaves earlier results alone too
    for k in "abc":
        f1[k][...] = f2[k]
    y3 = model.run(f1)["y"]
    np.testing.assert_array_equal(y1, kept)
    np.testing.assert_array_equal(y3, y2)


def test_preallocated_outputs_receive_the_results(model, rng):
    feeds = _feeds(rng)
    dst = tvmfuse.empty(N)
    out = model.run(feeds, outputs={"y": dst})
    assert out["y"] is dst
    np.testing.assert_allclose(dst, _reference(feeds), rtol=1e-5, atol=1e-6)
    with pytest.raises(tvmfuse.InputError, match=r"output 'y' has shape \[8\]"):
        model.run(feeds, outputs={"y": np.empty(8, np.float32)})
    with pytest.raises(tvmfuse.InputError, match="unknown output name"):
        model.run(feeds, outputs={"z": dst})
    ro = tvmfuse.empty(N)
    ro.flags.writeable = False
    with pytest.raises(tvmfuse.InputError, match="read-only"):
        model.run(feeds, outputs={"y": ro})
    # a TVM tensor receives the result too
    from tvmfuse import _compat as C

    t = C.tensor(np.zeros(N, np.float32))
    assert model.run(feeds, outputs={"y": t})["y"] is t
    np.testing.assert_allclose(t.numpy(), _reference(feeds), rtol=1e-5, atol=1e-6)


def test_bind_keeps_inputs_in_place_across_runs(model, rng, monkeypatch):
    spy = Spy(model, monkeypatch)
    feeds = _feeds(rng)
    b = model.bind(feeds)
    assert b.copied == {}
    assert [b.inputs[k].data_ptr() for k in "abc"] == [_addr(feeds[k]) for k in "abc"]
    y1 = b.run()["y"]
    np.testing.assert_allclose(y1, _reference(feeds), rtol=1e-5, atol=1e-6)
    nxt = _feeds(rng)
    feeds["a"][...] = nxt["a"]                    # write the next batch into the bound array itself
    b.update({"b": nxt["b"], "c": nxt["c"]})      # or through update()
    dst = tvmfuse.empty(N)
    y2 = b.run(outputs={"y": dst})["y"]
    assert y2 is dst
    np.testing.assert_allclose(y2, _reference(nxt), rtol=1e-5, atol=1e-6)
    assert spy.args[0] == spy.args[1] == [_addr(feeds[k]) for k in "abc"]
    # a misaligned array is copied once at bind time, and the reason is recorded
    mis = model.bind({**feeds, "a": _at_offset(feeds["a"], 2)})
    assert set(mis.copied) == {"a"} and "aligned" in mis.copied["a"]
    np.testing.assert_allclose(mis.run()["y"], _reference(feeds), rtol=1e-5, atol=1e-6)


def test_bind_run_checks_preallocated_outputs(model, rng):
    # Binding.run takes right outputs without the full checks (_Plan.static_outputs_ok) and still names
    # what is wrong with the others
    feeds = _feeds(rng)
    b = model.bind(feeds)
    dst = np.empty(N, np.float32)
    assert b.run(outputs={"y": dst})["y"] is dst
    np.testing.assert_allclose(dst, _reference(feeds), rtol=1e-5, atol=1e-6)
    with pytest.raises(tvmfuse.InputError, match="output 'y' has dtype float64"):
        b.run(outputs={"y": np.empty(N, np.float64)})
    with pytest.raises(tvmfuse.InputError, match=r"output 'y' has shape \[2\]"):
        b.run(outputs={"y": np.empty(2, np.float32)})
    dst.flags.writeable = False
    with pytest.raises(tvmfuse.InputError, match="read-only"):
        b.run(outputs={"y": dst})
    with pytest.raises(tvmfuse.InputError, match="unknown output name"):
        b.run(outputs={"z": np.empty(N, np.float32)})


def test_an_output_that_views_an_input_is_copied(host):
    # Identity and Flatten return the input tensor itself from the VM (0 kernels): the output must not
    # alias the caller's array, or refilling the input would change the result
    g = M._G("views")
    x = g.input("x", (4, 8))
    g.op("Identity", x)
    g.rename_last("y", (4, 8))
    g.op("Flatten", x)
    g.rename_last("z", (4, 8))
    cm = tvmfuse.compile(g.model(), host)
    assert cm.kernel_count == 0
    xa = tvmfuse.empty((4, 8))
    xa[...] = np.arange(32).reshape(4, 8)
    out = cm.run({"x": xa})
    for name in "yz":
        np.testing.assert_array_equal(out[name], np.arange(32, dtype=np.float32).reshape(4, 8))
        assert not np.shares_memory(out[name], xa)
    assert not np.shares_memory(out["y"], out["z"])
    xa[...] = 0
    np.testing.assert_array_equal(out["y"], np.arange(32, dtype=np.float32).reshape(4, 8))


def test_a_single_output_that_is_the_input_is_copied(host):
    # one output (the VM returns a tensor, not a tuple): Identity hands back the caller's own memory
    g = M._G("identity")
    x = g.input("x", (16,))
    g.op("Identity", x)
    g.rename_last("y", (16,))
    cm = tvmfuse.compile(g.model(), host)
    xa = np.arange(16, dtype=np.float32)
    y = cm.run({"x": xa})["y"]
    assert not np.shares_memory(y, xa)
    xa[...] = 0
    np.testing.assert_array_equal(y, np.arange(16, dtype=np.float32))


def test_a_constant_output_is_copied(host):
    # an output computed from constants only is the VM's constant tensor: a view of it handed out
    # writeable would let the caller change the model
    g = M._G("const_out")
    x = g.input("x", (4,))
    g.op("Relu", x)
    g.rename_last("y", (4,))
    g.op("Add", g.const(np.ones(4, np.float32)), g.const(np.ones(4, np.float32)))
    g.rename_last("z", (4,))
    cm = tvmfuse.compile(g.model(), host)
    first = cm.run({"x": tvmfuse.zeros(4)})
    first["z"][...] = 7.0
    first["y"][...] = 7.0
    again = cm.run({"x": tvmfuse.zeros(4)})
    np.testing.assert_array_equal(again["z"], np.full(4, 2.0, np.float32))
    np.testing.assert_array_equal(again["y"], np.zeros(4, np.float32))


def test_a_single_constant_output_is_copied(host):
    # one input, one output computed from constants only: the static one-input path (run_one) reads the
    # result's strong reference count (C.strong_ref_word, no frame) and copies what the VM also holds
    from tvmfuse import _compat as C

    g = M._G("const_single")
    g.input("x", (4,))
    g.op("Add", g.const(np.ones(4, np.float32)), g.const(np.ones(4, np.float32)))
    g.rename_last("z", (4,))
    cm = tvmfuse.compile(g.model(), host)
    x = tvmfuse.zeros(4)
    first = cm.run({"x": x})
    assert cm.run is cm._io_plan().run_static
    first["z"][...] = 7.0
    again = cm.run({"x": x})
    np.testing.assert_array_equal(again["z"], np.full(4, 2.0, np.float32))
    held = cm._main()(C.from_dlpack(x))
    assert C.strong_ref_word(held.__chandle__()).value == C.strong_ref_count(held) > 2


def test_strong_ref_word_counts_the_vm_register_and_the_wrapper(host, rng):
    # a fresh result is held by its Python wrapper and the VM's last-result register (2): run()'s test
    # for a view it may hand out; the next call releases the register's reference (1)
    from tvmfuse import _compat as C

    cm = tvmfuse.compile(M.layernorm(rows=2, d=16, decomposed=False), host)
    x = C.from_dlpack(rng.standard_normal((2, 16)).astype(np.float32))
    f = cm._main()
    r1 = f(x)
    assert C.strong_ref_word(r1.__chandle__()).value == C.strong_ref_count(r1) == 2
    r2 = f(x)
    assert C.strong_ref_count(r1) == 1 and C.strong_ref_count(r2) == 2


def test_one_input_one_output_with_preallocated_outputs(host, rng):
    # the one-input path hands preallocated outputs to the general static path: written in place,
    # the given array returned; an empty dict is no outputs (a fresh view); a wrong one is an InputError
    cm = tvmfuse.compile(M.layernorm(rows=2, d=16, decomposed=False), host)
    x = rng.standard_normal((2, 16)).astype(np.float32)
    ref = cm.run({"x": x})["y"].copy()
    out = np.empty((2, 16), np.float32)
    got = cm.run({"x": x}, outputs={"y": out})
    assert got["y"] is out
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(cm.run({"x": x}, outputs={})["y"], ref)
    with pytest.raises(tvmfuse.InputError, match="'y'"):
        cm.run({"x": x}, outputs={"y": np.empty((2, 15), np.float32)})


# ------------------------------------------------------------------ loading: onnx.checker complaints
def _graph_model(nodes, outputs, inputs=(("x", [2, 3]),)):
    from onnx import TensorProto, helper

    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs]
    return helper.make_model(helper.make_graph(nodes, "g", ins, outputs),
                             opset_imports=[helper.make_opsetid("", 17)])


def test_outputs_without_shape_or_type_load_with_a_warning(host, caplog):
    # onnx.checker requires a shape on every graph output; onnxruntime and TVM's importer do not
    from onnx import TensorProto, helper

    model = _graph_model([helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Exp", ["y"], ["z"])],
                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),   # no shape
                          helper.make_empty_tensor_value_info("z")])                     # no type at all
    with caplog.at_level("WARNING", logger="tvmfuse"):
        cm = tvmfuse.compile(model, host)
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("tvmfuse")]
    assert any("Field 'shape' of 'type' is required but missing" in m and "['y', 'z']" in m for m in warned), warned
    assert [(s.name, s.shape, s.dtype) for s in cm.outputs] == [("y", (2, 3), "float32"), ("z", (2, 3), "float32")]
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    out = cm.run({"x": x})
    np.testing.assert_allclose(out["y"], np.maximum(x, 0), rtol=1e-6)
    np.testing.assert_allclose(out["z"], np.exp(np.maximum(x, 0)), rtol=1e-5)


def test_malformed_models_still_fail_naming_the_cause():
    from onnx import TensorProto, helper

    from tvmfuse.frontend import read_model

    undefined = [helper.make_node("Relu", ["nope"], ["y"])]
    with pytest.raises(tvmfuse.ModelLoadError, match="malformed ONNX model: .*'nope'"):
        read_model(_graph_model(undefined, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])]))
    # the same fault behind a tolerated complaint (an output without a shape) is still found
    with pytest.raises(tvmfuse.ModelLoadError, match="malformed ONNX model: .*'nope'"):
        read_model(_graph_model(undefined, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]))
    with pytest.raises(tvmfuse.ModelLoadError, match="not a valid ONNX model"):
        read_model(b"\x08\x07garbage that is no protobuf \xff\xff")


def _llvm_code(cm, kind: str) -> str:
    return "".join(m.inspect_source(kind) for m in cm.executable.mod.imports if m.kind == "llvm")


# An aligned vector move with a memory operand that is not the stack: what faults on a numpy array.
_ALIGNED_MOVE_TO_MEMORY = re.compile(r"\bv?mov(aps|apd|dqa|dqa32|dqa64|ntps|ntpd|ntdq)\s+[^\n]*\((?!%rsp\))")


@pytest.mark.parametrize("name", ["haswell-2", "skx-2"])
def test_kernels_do_not_assume_64_byte_aligned_arguments(name):
    target = named_target(name)
    cm = tvmfuse.compile(M.elementwise_chain(4099), target)
    ll, asm = _llvm_code(cm, "ll"), _llvm_code(cm, "asm")
    vector_access = re.compile(r"(?:load <\d+ x float>, ptr|store <\d+ x float> [^,]+, ptr) [^,]+, align (\d+)")
    aligns = {int(a) for a in vector_access.findall(ll)}
    assert aligns == {4}, aligns                                 # float32 arguments: element alignment only
    assert not _ALIGNED_MOVE_TO_MEMORY.search(asm), _ALIGNED_MOVE_TO_MEMORY.search(asm).group(0)
    # the same kernel with TVM's assumption: 64-byte vector accesses and aligned moves (what the check sees)
    cm64 = tvmfuse.compile(M.elementwise_chain(4099), target, element_aligned_args=False)
    assert 64 in {int(a) for a in vector_access.findall(_llvm_code(cm64, "ll"))}
    assert _ALIGNED_MOVE_TO_MEMORY.search(_llvm_code(cm64, "asm"))


@pytest.mark.parametrize("make", [lambda: M.softmax(rows=8, d=1000), lambda: M.layernorm(rows=8, d=97),
                                  lambda: M.matmul_bias_gelu(m=16, k=40, n=72), lambda: M.conv_bn_relu_residual(),
                                  lambda: M.transformer_block(seq=16, hidden=64, heads=2, ffn=128)],
                         ids=["softmax", "layernorm", "matmul", "conv", "transformer"])
def test_models_read_element_aligned_inputs_in_place(make, host, rng, monkeypatch):
    # every input 4 bytes past a 64-byte boundary (float32 element alignment): in place, right results
    model = make()
    cm = tvmfuse.compile(model, host)
    spy = Spy(cm, monkeypatch) if len(cm.outputs) == 1 else None
    feeds = {k: _at_offset(rng.standard_normal(v.shape).astype(v.dtype), 4)
             for k, v in M.random_feeds(model).items()}
    out = cm.run(feeds)
    ref = M.reference_outputs(model, feeds)
    for spec in cm.outputs:
        np.testing.assert_allclose(out[spec.name], ref[spec.name], rtol=1e-4, atol=1e-4)
    if spy is not None:
        assert spy.args[0] == [_addr(feeds[s.name]) for s in cm.inputs]
    assert cm.bind(feeds).copied == {}


@pytest.fixture(scope="module", params=["compiled", "artifact"])
def layernorm(request, tmp_path_factory):
    """benchmarks/bench_cpu.py's layernorm workload: [512, 768], one input, one output, one kernel."""
    cm = tvmfuse.compile(M.layernorm(rows=512, d=768, decomposed=False))
    assert cm.kernel_count == 1
    if request.param == "compiled":
        return cm
    return tvmfuse.load(tvmfuse.export(cm, str(tmp_path_factory.mktemp("ln") / "layernorm")))


def test_layernorm_workload_runs_without_a_copy(layernorm, rng, monkeypatch):
    # issue 11: run() / Runner.run on the layernorm workload as the VM call: the ordinary numpy input read
    # in place, the output a view of the VM's result, through run()'s short path (one fresh output: no
    # _finish), the same array refilled and given again reusing its DLPack view
    model = layernorm
    spy = Spy(model, monkeypatch)
    finished = []
    real_finish = model._finish
    monkeypatch.setattr(model, "_finish", lambda *a: finished.append(1) or real_finish(*a))
    x = rng.standard_normal((512, 768)).astype(np.float32)
    y1 = model.run({"x": x})["y"]
    assert spy.args == [[_addr(x)]] and _addr(y1) == spy.results[0]
    ref1 = M.reference_outputs(M.layernorm(rows=512, d=768, decomposed=False), {"x": x})["y"]
    np.testing.assert_allclose(y1, ref1, rtol=1e-4, atol=1e-4)
    kept = y1.copy()
    x[...] = rng.standard_normal((512, 768))              # refill in place, call again with the same array
    y2 = model.run({"x": x})["y"]
    assert spy.args[1] == [_addr(x)] and _addr(y2) == spy.results[1]
    assert not np.shares_memory(y1, y2)
    np.testing.assert_array_equal(y1, kept)               # the second call left the first result alone
    ref2 = M.reference_outputs(M.layernorm(rows=512, d=768, decomposed=False), {"x": x})["y"]
    np.testing.assert_allclose(y2, ref2, rtol=1e-4, atol=1e-4)
    assert finished == []


def test_an_array_reshaped_in_place_is_imported_again(host, rng):
    # run() reuses the DLPack view of an array object given again; one whose shape was changed in place
    # (same object, same memory) must not run on the old view's shape
    g = M._G("symbolic_mul")
    x = g.input("x", ("batch", "seq", 16))
    m = g.input("m", ("batch", "seq"))
    g.op("Mul", x, g.op("Unsqueeze", m, g.const(np.array([-1], np.int64))))
    g.rename_last("y", ("batch", "seq", 16))
    cm = tvmfuse.compile(g.model(), host)
    f = {"x": rng.standard_normal((2, 6, 16)).astype(np.float32), "m": rng.standard_normal((2, 6)).astype(np.float32)}
    np.testing.assert_allclose(cm.run(f)["y"], f["x"] * f["m"][..., None], rtol=1e-6, atol=1e-6)
    f["x"].shape = (3, 4, 16)
    f["m"].shape = (3, 4)
    y = cm.run(f)["y"]
    assert y.shape == (3, 4, 16)
    np.testing.assert_allclose(y, f["x"] * f["m"][..., None], rtol=1e-6, atol=1e-6)
    # the same array made read-only since: not read in place any more (copied), still right
    f["x"].flags.writeable = False
    np.testing.assert_allclose(cm.run(f)["y"], f["x"] * f["m"][..., None], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ run()'s paths (tvmfuse.io._Plan)
def _count_calls(monkeypatch, owner, name) -> list:
    calls = []
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_a_static_model_takes_the_static_path(model, rng, monkeypatch):
    # every input's shape fixed: ordinary feeds go through _Plan.run_static (checks, VM call, views in
    # one function), not the symbolic checks (_Plan.in_place) nor the full ones (validate_feeds)
    import tvmfuse.io as io

    spy = Spy(model, monkeypatch)
    symbolic = _count_calls(monkeypatch, io._Plan, "in_place")
    full = _count_calls(monkeypatch, io, "validate_feeds")
    assert model._io_plan().path == "static" and model._io_plan().run_static is not None
    feeds = _feeds(rng, np.empty)
    y1 = model.run(feeds)["y"]
    assert spy.args == [[_addr(feeds[k]) for k in "abc"]] and _addr(y1) == spy.results[0]
    kept = y1.copy()
    for k in "abc":                                   # the zero-copy loop: refill, call again
        feeds[k][...] = rng.standard_normal(N)
    y2 = model.run(feeds)["y"]
    np.testing.assert_allclose(y2, _reference(feeds), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(y1, kept)          # valid after the next call
    assert spy.args[1] == spy.args[0] and not np.shares_memory(y1, y2)
    dst = np.empty(N, np.float32)                     # preallocated outputs take it too
    assert model.run(feeds, outputs={"y": dst})["y"] is dst
    np.testing.assert_allclose(dst, _reference(feeds), rtol=1e-5, atol=1e-6)
    assert symbolic == [] and full == []


def test_the_static_path_hands_what_it_cannot_take_to_the_full_checks(model, rng, monkeypatch):
    # the same array object changed since the last call (made read-only, reshaped in place), an input
    # at an odd byte, a wrong preallocated output: right results (copied where needed) or the InputError
    import tvmfuse.io as io

    full = _count_calls(monkeypatch, io, "validate_feeds")
    feeds = _feeds(rng, np.empty)
    np.testing.assert_allclose(model.run(feeds)["y"], _reference(feeds), rtol=1e-5, atol=1e-6)
    feeds["a"].flags.writeable = False
    np.testing.assert_allclose(model.run(feeds)["y"], _reference(feeds), rtol=1e-5, atol=1e-6)
    assert full == [1]
    feeds["a"] = feeds["a"].copy()
    feeds["b"].shape = (2, N // 2)
    with pytest.raises(tvmfuse.InputError, match=r"input 'b' has shape \[2, 2048\]"):
        model.run(feeds)
    feeds["b"].shape = (N,)
    odd = _at_offset(feeds["c"], 2)                   # float32 data 2 bytes past a boundary: copied
    np.testing.assert_allclose(model.run({**feeds, "c": odd})["y"], _reference(feeds), rtol=1e-5, atol=1e-6)
    with pytest.raises(tvmfuse.InputError, match="output 'y' has dtype float64"):
        model.run(feeds, outputs={"y": np.empty(N, np.float64)})
    np.testing.assert_allclose(model.run(feeds)["y"], _reference(feeds), rtol=1e-5, atol=1e-6)


def test_compiled_model_and_runner_share_one_static_run(compiled, tmp_path, rng, monkeypatch):
    # after the first call a static model's run is the plan's function itself (no method lookups on the
    # way to the VM), one code for CompiledModel and Runner; a copy makes its own (its own _main), and a
    # feed it cannot take still reaches the full checks (InputError)
    import copy

    import tvmfuse.io as io

    cm = copy.copy(compiled)
    runner = tvmfuse.load(tvmfuse.export(compiled, str(tmp_path / "chain")))
    feeds = _feeds(rng, np.empty)
    for m in (cm, runner):
        assert "run" not in m.__dict__
        np.testing.assert_allclose(m.run(feeds)["y"], _reference(feeds), rtol=1e-5, atol=1e-6)
        assert m.run is m._io_plan().run_static and m.run.__name__ == "run"
        assert m.run.__doc__ == io.Executes.run.__doc__
    assert cm.run.__code__ is runner.run.__code__
    calls = []
    inner = cm._main()
    monkeypatch.setattr(cm, "_main", lambda: lambda *a: calls.append(1) or inner(*a))
    other = copy.copy(cm)                              # its plan binds the replaced _main
    assert "run" not in other.__dict__ and "_plan" not in other.__dict__
    np.testing.assert_allclose(other.run(feeds)["y"], _reference(feeds), rtol=1e-5, atol=1e-6)
    assert calls == [1] and other.run is not cm.run
    with pytest.raises(tvmfuse.InputError, match=r"input 'a' has dtype float64"):
        runner.run({**feeds, "a": feeds["a"].astype(np.float64)})


def test_a_symbolic_model_takes_the_symbolic_path(host, rng, monkeypatch):
    # a symbolic input: no static path; run() is the plan's run_symbolic, which checks rank, fixed and
    # named dims (_Plan.shapes_ok) only when the shapes differ from the last call's that passed; wrong
    # shapes and preallocated outputs still get the full checks (InputError, the copy)
    import tvmfuse.io as io

    g = M._G("symbolic_scale")
    x = g.input("x", ("batch", 16))
    g.op("Mul", x, g.const(np.full(16, 2.0, np.float32)))
    g.rename_last("y", ("batch", 16))
    cm = tvmfuse.compile(g.model(), host, shape_upper_bounds={"batch": 8})
    shape_checks = _count_calls(monkeypatch, io._Plan, "shapes_ok")
    checked = _count_calls(monkeypatch, io._Plan, "in_place")
    cm._reset_plan()                                  # a plan that binds the counting shapes_ok
    plan = cm._io_plan()
    assert plan.path == "symbolic" and plan.run_static is None and cm.run is plan.run_symbolic
    for b in (3, 5, 5, 3):
        xa = rng.standard_normal((b, 16)).astype(np.float32)
        np.testing.assert_allclose(cm.run({"x": xa})["y"], 2 * xa, rtol=1e-6)
    assert len(shape_checks) == 3 and checked == []   # the second 5 reused the last check
    xa.shape = (3, 2, 8)                              # the same array object, reshaped in place
    with pytest.raises(tvmfuse.InputError, match=r"input 'x' has shape \[3, 2, 8\]"):
        cm.run({"x": xa})
    with pytest.raises(tvmfuse.InputError, match=r"symbolic dim 'batch' is 9 .* above the bound 8"):
        cm.run({"x": np.zeros((9, 16), np.float32)})
    xa.shape = (3, 16)
    assert len(checked) == 2
    dst = np.empty((3, 16), np.float32)                # a preallocated output of this call's batch
    assert cm.run({"x": xa}, outputs={"y": dst})["y"] is dst
    np.testing.assert_allclose(dst, 2 * xa, rtol=1e-6)
    assert len(checked) == 2
    with pytest.raises(tvmfuse.InputError, match=r"output 'y' has shape \[4, 16\], this call's result has "
                                                 r"shape \[3, 16\]"):
        cm.run({"x": xa}, outputs={"y": np.empty((4, 16), np.float32)})
    one = rng.standard_normal((1, 16)).astype(np.float32)   # a batch-1 result is not broadcast into dst
    with pytest.raises(tvmfuse.InputError, match=r"output 'y' has shape \[3, 16\], this call's result has "
                                                 r"shape \[1, 16\]"):
        cm.run({"x": one}, outputs={"y": dst})
    assert len(checked) == 4


def test_bind_run_outputs_are_fresh_and_never_an_input(compiled, host, rng):
    # Binding.run's short path (one fresh output): a view of the result, valid after the next run; an
    # Identity's output (the bound input's own memory) is copied
    g = M._G("identity")
    x = g.input("x", (16,))
    g.op("Identity", x)
    g.rename_last("y", (16,))
    cm = tvmfuse.compile(g.model(), host)
    xa = np.arange(16, dtype=np.float32)
    y = cm.bind({"x": xa}).run()["y"]
    assert not np.shares_memory(y, xa)
    xa[...] = 0
    np.testing.assert_array_equal(y, np.arange(16, dtype=np.float32))
    feeds = _feeds(rng)
    b = compiled.bind(feeds)
    y1 = b.run()["y"]
    kept = y1.copy()
    b.update({"a": rng.standard_normal(N).astype(np.float32)})
    y2 = b.run()["y"]
    np.testing.assert_array_equal(y1, kept)
    assert not np.shares_memory(y1, y2)
    np.testing.assert_allclose(y2, _reference(feeds), rtol=1e-5, atol=1e-6)   # update wrote the bound array
