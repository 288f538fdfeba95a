"""run()'s native step (tvmfuse.runtime_native, issue 11): built and used where a C compiler is, the same
results and the same no-copy rules as the Python path, and the Python path when it is off or cannot be
built.  Each behaviour runs both ways (``way`` fixture)."""
from __future__ import annotations

import os
import shutil
import sysconfig

import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse import runtime_native


def _has_compiler() -> bool:
    """A C compiler and Python's headers: what the native step needs to be built (else the Python path is
    what runs, and only its half of these tests applies)."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) is not None and os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))


@pytest.fixture(params=["native", "python"])
def way(request, monkeypatch):
    """Models whose plan is made in this test take the native step or the Python path."""
    if request.param == "native":
        if not _has_compiler():
            pytest.skip("no C compiler or Python headers: the native step cannot be built here")
        runtime_native._reset_for_tests()
        assert runtime_native.load() is not None, runtime_native.reason()
    else:
        runtime_native._reset_for_tests(enabled=False)
    yield request.param
    runtime_native._reset_for_tests()


def _path_name(model) -> str:
    return model.run.__code__.co_name


def _softmax_reference(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_each_way_takes_its_path_and_gives_the_reference(way, host, rng):
    rows, d = int(rng.integers(1, 9)), int(rng.integers(8, 200))
    cm = tvmfuse.compile(M.softmax(rows=rows, d=d, decomposed=False), host)
    x = (rng.standard_normal((rows, d)) * 3).astype(np.float32)
    out = cm.run({cm.inputs[0].name: x})
    assert _path_name(cm) == ("run_native" if way == "native" else "run_one")
    (name, y), = out.items()
    assert name == cm.outputs[0].name and y.dtype == np.float32 and y.shape == (rows, d)
    np.testing.assert_allclose(y, _softmax_reference(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(y, cm._main()(C.from_dlpack(x)).numpy())   # the VM call's own result


def test_no_copies_and_results_stay_valid(way, host, rng):
    cm = tvmfuse.compile(M.layernorm(rows=4, d=64, decomposed=False), host)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    feeds = {"x": x} if cm.inputs[0].name == "x" else {cm.inputs[0].name: x}
    first = cm.run(feeds)
    (name, y1), = first.items()
    # the input read in place: the view the plan handed the VM is the caller's memory
    seen = cm._io_plan().last[0]
    assert seen[0] is x and seen[2] == x.__array_interface__["data"][0]
    # the output views the VM's result tensor (its base holds it), no copy
    assert y1.base is not None and y1.flags.c_contiguous and y1.flags.writeable
    kept = y1.copy()
    x2 = rng.standard_normal((4, 64)).astype(np.float32)
    x[...] = x2                                      # refill the input in place, call again
    y2 = cm.run(feeds)[name]
    assert not np.shares_memory(y1, y2)              # the earlier result is not overwritten
    np.testing.assert_array_equal(y1, kept)
    np.testing.assert_array_equal(y2, cm._main()(C.from_dlpack(x2)).numpy())


def test_dropped_results_reuse_the_pool(way, host, rng):
    cm = tvmfuse.compile(M.layernorm(rows=4, d=64, decomposed=False), host)
    feeds = {cm.inputs[0].name: rng.standard_normal((4, 64)).astype(np.float32)}
    addresses = {next(iter(cm.run(feeds).values())).__array_interface__["data"][0] for _ in range(8)}
    assert len(addresses) <= 2                       # the VM's pool hands the dropped buffers back


def test_an_output_that_is_the_input_or_a_constant_is_copied(way, host):
    g = M._G("identity_native")
    x = g.input("x", (16,))
    g.op("Identity", x)
    g.rename_last("y", (16,))
    cm = tvmfuse.compile(g.model(), host)
    xa = np.arange(16, dtype=np.float32)
    y = cm.run({"x": xa})["y"]
    assert _path_name(cm) == ("run_native" if way == "native" else "run_one")
    assert not np.shares_memory(y, xa)
    xa[...] = 0
    np.testing.assert_array_equal(y, np.arange(16, dtype=np.float32))

    g = M._G("const_native")
    g.input("x", (4,))
    g.op("Add", g.const(np.ones(4, np.float32)), g.const(np.ones(4, np.float32)))
    g.rename_last("z", (4,))
    cm = tvmfuse.compile(g.model(), host)
    first = cm.run({"x": np.zeros(4, np.float32)})
    first["z"][...] = 7.0                            # must not change the model's constant
    np.testing.assert_array_equal(cm.run({"x": np.zeros(4, np.float32)})["z"], np.full(4, 2.0, np.float32))


def test_the_artifact_takes_the_same_path(way, host, rng, tmp_path):
    cm = tvmfuse.compile(M.layernorm(rows=4, d=32, decomposed=False), host)
    runner = tvmfuse.load(tvmfuse.export(cm, str(tmp_path / "ln")))
    feeds = {cm.inputs[0].name: rng.standard_normal((4, 32)).astype(np.float32)}
    a, b = cm.run(feeds), runner.run(feeds)
    assert _path_name(runner) == _path_name(cm) == ("run_native" if way == "native" else "run_one")
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_wrong_feeds_are_still_a_clear_error(way, host, rng):
    cm = tvmfuse.compile(M.layernorm(rows=4, d=32, decomposed=False), host)
    name = cm.inputs[0].name
    cm.run({name: rng.standard_normal((4, 32)).astype(np.float32)})
    with pytest.raises(tvmfuse.InputError, match="shape"):
        cm.run({name: np.zeros((4, 31), np.float32)})
    with pytest.raises(tvmfuse.InputError, match="dtype"):
        cm.run({name: np.zeros((4, 32), np.float64)})


def test_call_one_hands_back_what_it_does_not_take(host, rng):
    # an error raised by the function, a result that is not a tensor: None (run() then makes the call through
    # tvm-ffi's Python path, which raises or handles it); a tensor of another dtype than expected: None too
    if not _has_compiler():
        pytest.skip("no C compiler or Python headers: the native step cannot be built here")
    runtime_native._reset_for_tests()
    module = runtime_native.load()
    assert module is not None, runtime_native.reason()
    x = C.from_dlpack(rng.standard_normal(8).astype(np.float32))
    f32 = runtime_native.numpy_typenum(np.float32)

    def fails(t):
        raise ValueError("raised on purpose")

    def not_a_tensor(t):
        return 3

    def same(t):
        return t

    for fn, expect_none in ((fails, True), (not_a_tensor, True), (same, False)):
        f = C.tvm_ffi_function(fn)
        got = module.call_one(f.__chandle__(), x.__chandle__(), x.data_ptr(), "y", f32)
        if expect_none:
            assert got is None
        else:                                        # the input's own memory: a copy
            assert set(got) == {"y"} and not np.shares_memory(got["y"], np.from_dlpack(x))
            np.testing.assert_array_equal(got["y"], x.numpy())
    f = C.tvm_ffi_function(same)
    assert module.call_one(f.__chandle__(), x.__chandle__(), x.data_ptr(), "y",
                           runtime_native.numpy_typenum(np.float64)) is None


def test_numpy_typenum_covers_the_dtypes_of_the_c_step():
    for dt in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint32", "bool"):
        assert runtime_native.numpy_typenum(dt) == np.dtype(dt).num
    for dt in ("complex64", "float128" if hasattr(np, "float128") else "complex128", ">f4", "U4"):
        assert runtime_native.numpy_typenum(dt) is None


def test_off_by_environment_and_unbuildable_fall_back(host, rng, monkeypatch, tmp_path):
    feeds_x = rng.standard_normal((2, 16)).astype(np.float32)
    monkeypatch.setenv(runtime_native.ENV_SWITCH, "0")
    runtime_native._reset_for_tests()
    cm = tvmfuse.compile(M.layernorm(rows=2, d=16, decomposed=False), host)
    feeds = {cm.inputs[0].name: feeds_x}
    want = cm._main()(C.from_dlpack(feeds_x)).numpy()
    np.testing.assert_array_equal(next(iter(cm.run(feeds).values())), want)
    assert _path_name(cm) == "run_one" and "TVMFUSE_NATIVE_IO=0" in runtime_native.reason()

    # a compiler that does not exist, an empty cache: the reason names the failure, run() still works
    monkeypatch.delenv(runtime_native.ENV_SWITCH)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("TVMFUSE_CACHE_DIR", str(tmp_path / "cache"))
    runtime_native._reset_for_tests()
    cm._reset_plan()
    np.testing.assert_array_equal(next(iter(cm.run(feeds).values())), want)
    assert _path_name(cm) == "run_one"
    assert "no-such-cc" in runtime_native.reason() and "cannot build" in runtime_native.reason()
    runtime_native._reset_for_tests()


def test_bind_run_takes_the_native_step_too(way, host, rng):
    cm = tvmfuse.compile(M.softmax(rows=4, d=40, decomposed=False), host)
    name = cm.inputs[0].name
    x = rng.standard_normal((4, 40)).astype(np.float32)
    b = cm.bind({name: x})
    y1 = b.run()[cm.outputs[0].name]
    assert (b._native[1] is not None) == (way == "native")
    np.testing.assert_allclose(y1, _softmax_reference(x), rtol=1e-5, atol=1e-6)
    want1 = _softmax_reference(x)                    # update() writes into x itself (bound in place)
    x2 = rng.standard_normal((4, 40)).astype(np.float32)
    b.update({name: x2})
    y2 = b.run()[cm.outputs[0].name]
    np.testing.assert_allclose(y2, _softmax_reference(x2), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_allclose(y1, want1, rtol=1e-5, atol=1e-6)   # still valid, not overwritten
    buf = np.empty((4, 40), np.float32)
    assert b.run(outputs={cm.outputs[0].name: buf})[cm.outputs[0].name] is buf
    np.testing.assert_array_equal(buf, y2)


def _hand_back(monkeypatch, which: str) -> list:
    """runtime_native's module replaced by one whose ``which`` (call_one / call_many) records its arguments
    and hands every result back (returns None, as for an error or an unexpected result); the records."""
    calls = []

    def hands_back(*args):
        calls.append(args)
        return None

    runtime_native._reset_for_tests()
    monkeypatch.setitem(runtime_native._state, "module", type("HandsBack", (), {which: staticmethod(hands_back)}))
    monkeypatch.setitem(runtime_native._state, "reason", None)
    return calls


def test_a_result_handed_back_is_made_in_python_and_later_calls_skip_the_c_step(host, rng, monkeypatch):
    # call_one returning None (an error, an unexpected result): run() makes the call through tvm-ffi's Python
    # path and _finish, then stops asking the C step (no second VM call per run)
    calls = _hand_back(monkeypatch, "call_one")
    cm = tvmfuse.compile(M.softmax(rows=3, d=24, decomposed=False), host)
    name = cm.inputs[0].name
    x = rng.standard_normal((3, 24)).astype(np.float32)
    for _ in range(3):
        y = cm.run({name: x})[cm.outputs[0].name]
        np.testing.assert_allclose(y, _softmax_reference(x), rtol=1e-5, atol=1e-6)
    assert _path_name(cm) == "run_native" and len(calls) == 1
    b = cm.bind({name: x})
    for _ in range(3):
        np.testing.assert_allclose(b.run()[cm.outputs[0].name], _softmax_reference(x), rtol=1e-5, atol=1e-6)
    assert len(calls) == 2
    runtime_native._reset_for_tests()


def _capsule_name(array: np.ndarray) -> str | None:
    """The name of the PyCapsule at the base of a numpy array (runtime_native's "tvmfuse.tensor", or
    DLPack's for the Python path's np.from_dlpack), None when its base is no capsule."""
    import ctypes

    base = array.base
    if type(base).__name__ != "PyCapsule":
        return None
    get = ctypes.pythonapi.PyCapsule_GetName
    get.restype, get.argtypes = ctypes.c_char_p, [ctypes.py_object]
    name = get(base)
    return name.decode() if name is not None else None


def _three_inputs():
    """sigmoid(a * b + c): bench_cpu's sigmoid_chain at a small size (three inputs, one output)."""
    g = M._G("three_inputs_native")
    a, b, c = (g.input(n, (8, 40)) for n in ("a", "b", "c"))
    g.op("Sigmoid", g.op("Add", g.op("Mul", a, b), c))
    g.rename_last("y", (8, 40))
    return g.model()


def test_several_inputs_take_call_many_without_copies(way, host, rng):
    """Issue 11: a model of several inputs and one output makes the VM call and its numpy result in C
    (``call_many``) as one-input models do: the result views the VM's tensor (no copy), stays valid after
    the next call, and equals the Python path's and the reference."""
    cm = tvmfuse.compile(_three_inputs(), host)
    assert len(cm.inputs) == 3
    feeds = {n: rng.standard_normal((8, 40)).astype(np.float32) for n in ("a", "b", "c")}
    want = 1.0 / (1.0 + np.exp(-(feeds["a"] * feeds["b"] + feeds["c"])))
    y1 = cm.run(feeds)["y"]
    np.testing.assert_allclose(y1, want, rtol=1e-5, atol=1e-6)
    assert y1.flags.c_contiguous and y1.flags.writeable
    assert (_capsule_name(y1) == "tvmfuse.tensor") == (way == "native"), _capsule_name(y1)
    for i, n in enumerate(("a", "b", "c")):          # each input read in place
        assert cm._io_plan().last[i][2] == feeds[n].__array_interface__["data"][0]
    kept = y1.copy()
    feeds2 = {n: rng.standard_normal((8, 40)).astype(np.float32) for n in ("a", "b", "c")}
    y2 = cm.run(feeds2)["y"]
    assert not np.shares_memory(y1, y2)
    np.testing.assert_array_equal(y1, kept)
    np.testing.assert_array_equal(y2, cm._main()(*[C.from_dlpack(feeds2[n]) for n in ("a", "b", "c")]).numpy())
    with pytest.raises(tvmfuse.InputError, match="shape"):
        cm.run({**feeds, "b": np.zeros((8, 39), np.float32)})


def test_call_many_handing_back_makes_the_result_in_python_once(host, rng, monkeypatch):
    """call_many returning None (an error, an unexpected result): the call is made again through tvm-ffi's
    Python path and later calls do not ask the C step (no second VM call per run)."""
    calls = _hand_back(monkeypatch, "call_many")
    cm = tvmfuse.compile(_three_inputs(), host)
    feeds = {n: rng.standard_normal((8, 40)).astype(np.float32) for n in ("a", "b", "c")}
    want = 1.0 / (1.0 + np.exp(-(feeds["a"] * feeds["b"] + feeds["c"])))
    for _ in range(3):
        np.testing.assert_allclose(cm.run(feeds)["y"], want, rtol=1e-5, atol=1e-6)
    assert len(calls) == 1
    (func, handles, ptrs, name, typenum), = calls
    assert len(handles) == len(ptrs) == 3 and name == "y"
    assert list(ptrs) == [feeds[n].__array_interface__["data"][0] for n in ("a", "b", "c")]
    runtime_native._reset_for_tests()


def test_call_many_refuses_malformed_arguments():
    if not _has_compiler():
        pytest.skip("no C compiler or Python headers: the native step cannot be built here")
    runtime_native._reset_for_tests()
    module = runtime_native.load()
    assert module is not None, runtime_native.reason()
    with pytest.raises(TypeError, match="call_many"):
        module.call_many(1, [1], (1,), "y", 11)
    with pytest.raises(ValueError, match="2 handles and 1 data pointers"):
        module.call_many(1, (1, 2), (1,), "y", 11)
    with pytest.raises(ValueError, match="null tensor handle"):
        module.call_many(1, (0,), (0,), "y", 11)
    runtime_native._reset_for_tests()


def _symbolic(inputs=("x",)):
    """sigmoid(x [* w]) + a constant over [batch, 24] inputs (a symbolic batch, one output)."""
    g = M._G("symbolic_native")
    xs = [g.input(n, ("batch", 24)) for n in inputs]
    y = xs[0]
    for x in xs[1:]:
        y = g.op("Mul", y, x)
    g.op("Add", g.op("Sigmoid", y), g.weight((24,), 1.0))
    g.rename_last("y", ("batch", 24))
    return g.model()


def _symbolic_reference(model, feeds: dict) -> np.ndarray:
    return M.reference_outputs(model, feeds)["y"]


@pytest.mark.parametrize("inputs", [("x",), ("x", "w")], ids=["one_input", "two_inputs"])
def test_symbolic_models_take_the_c_step_at_every_size(way, host, rng, inputs):
    """Session 13 (issue 13: qwen2 at one token paid 3.7 us in Python): a model with a symbolic batch makes
    its VM call and numpy result in C too (call_one / call_many), at sizes that change between calls and
    repeat; results view the VM's tensors, stay valid after the next call and equal the reference; a batch
    that disagrees between inputs is still the InputError."""
    model = _symbolic(inputs)
    cm = tvmfuse.compile(model, host)
    kept = []
    for b in (1, 3, 3, 8, 1, 1):
        feeds = {n: rng.standard_normal((b, 24)).astype(np.float32) for n in inputs}
        for _ in range(2):                 # the same arrays again: the one-input shortcut (run_one)
            y = cm.run(feeds)["y"]
            np.testing.assert_allclose(y, _symbolic_reference(model, feeds), rtol=1e-5, atol=1e-6)
            assert (_capsule_name(y) == "tvmfuse.tensor") == (way == "native"), _capsule_name(y)
        kept.append((y, y.copy()))
    for y, copy in kept:
        np.testing.assert_array_equal(y, copy)
    if way == "native" and len(inputs) == 1:
        assert _path_name(cm) == "run_one"
    if len(inputs) == 2:
        with pytest.raises(tvmfuse.InputError, match="batch"):
            cm.run({"x": np.zeros((2, 24), np.float32), "w": np.zeros((3, 24), np.float32)})


def test_symbolic_handing_back_makes_the_result_in_python_once(host, rng, monkeypatch):
    calls = _hand_back(monkeypatch, "call_one")
    model = _symbolic()
    cm = tvmfuse.compile(model, host)
    for b in (2, 2, 5):
        feeds = {"x": rng.standard_normal((b, 24)).astype(np.float32)}
        np.testing.assert_allclose(cm.run(feeds)["y"], _symbolic_reference(model, feeds), rtol=1e-5, atol=1e-6)
    assert len(calls) == 1 and calls[0][3] == "y"
    runtime_native._reset_for_tests()
