"""numpy's 64-byte aligned allocator (``tvmfuse.io.aligned_numpy``, NEP 49, issue 11): every array numpy
allocates while it is on starts on a cache line, its data behaves as numpy's own (zeros stay zero, resize
keeps the data), switching back frees what it made, and the first CPU model compiled in a process turns it
on (unless ``TVMFUSE_ALIGNED_NUMPY=0``), so ordinary numpy inputs made after that reach the kernels
64-byte aligned and uncopied.  The automatic switch is checked in fresh interpreters (it happens once per
process)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tvmfuse
from tvmfuse import io, runtime_native

from test_runtime_native import _has_compiler

pytestmark = pytest.mark.skipif(not _has_compiler(), reason="no C compiler: the allocator cannot be built here")

SIZES = [0, 1, 3, 7, 15, 16, 17, 63, 64, 65, 1000, 4096, 100_003, 1 << 20, (1 << 22) + 5]


@pytest.fixture
def aligned():
    """numpy's allocator is tvmfuse's for the test, and what it was before afterwards."""
    before = io.numpy_allocator()
    assert io.aligned_numpy(True), runtime_native.reason()
    yield
    io.aligned_numpy(before == io.ALIGNED_HANDLER_NAME)


@pytest.mark.parametrize("make", [np.empty, np.zeros, np.ones], ids=["empty", "zeros", "ones"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "float16"])
def test_every_allocation_starts_on_a_cache_line(aligned, make, dtype, rng):
    assert io.numpy_allocator() == io.ALIGNED_HANDLER_NAME
    for n in SIZES:
        a = make(n, dtype)
        assert a.ctypes.data % 64 == 0 or a.size == 0, (n, a.ctypes.data % 64)
        if a.size:
            if make is np.zeros:
                assert not a.any()
            a[...] = rng.standard_normal(a.size).astype(dtype)     # the whole block is writable
            assert np.array_equal(a.copy(), a)


def test_results_of_numpy_operations_are_aligned_and_right(aligned, rng):
    x = rng.standard_normal((257, 129)).astype(np.float32)
    with np.errstate(all="ignore"):
        for y in (x + 1, x @ x.T, np.exp(x), np.concatenate([x, x]), x.T.copy(), x.astype(np.float64)):
            assert y.ctypes.data % 64 == 0
    np.testing.assert_allclose((x @ x.T)[3, 5], np.dot(x[3].astype(np.float64), x[5]), rtol=1e-4)


def test_resize_keeps_the_data_and_the_alignment(aligned, rng):
    """ndarray.resize goes through the allocator's realloc: the block may move, and the boundary within it
    with it; the first elements must survive every growth and shrink."""
    values = rng.standard_normal(37)
    a = values.copy()
    for n in [40, 1000, 90, 100_000, 37, 5_000_000, 38]:
        a.resize(n, refcheck=False)
        assert a.ctypes.data % 64 == 0
        np.testing.assert_array_equal(a[:37], values)


def test_switching_back_frees_what_each_allocator_made(rng):
    before = io.numpy_allocator()
    try:
        assert io.aligned_numpy(True)
        made_aligned = [np.full(n, 7.0) for n in SIZES]
        assert not io.aligned_numpy(False)
        assert io.numpy_allocator() == io.NUMPY_DEFAULT_HANDLER_NAME
        made_default = [np.full(n, 3.0) for n in SIZES]
        assert io.aligned_numpy(True)
        for a in made_aligned:                 # still readable, then freed by the allocator that made them
            assert (a == 7.0).all()
        del made_aligned, made_default
    finally:
        io.aligned_numpy(before == io.ALIGNED_HANDLER_NAME)


def _fresh_python(code: str, **env) -> str:
    full = dict(os.environ, **env)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env=full, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


_COMPILE_THEN_RUN = """
    import numpy as np, tvmfuse
    from tvmfuse import io, models as M
    before = io.numpy_allocator()
    cm = tvmfuse.compile(M.softmax(rows=8, d=200, decomposed=False), "llvm")
    x = np.random.default_rng(0).standard_normal((8, 200)).astype(np.float32)
    b = cm.bind({cm.inputs[0].name: x})
    (y,) = cm.run({cm.inputs[0].name: x}).values()
    e = np.exp(x - x.max(-1, keepdims=True))
    ok = np.allclose(y, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)
    print(before, io.numpy_allocator(), io.aligned_numpy_status().split(":")[0].replace(" ", "_"),
          x.ctypes.data % 64, b.copied == {}, ok)
"""


def test_the_first_cpu_model_turns_it_on():
    before, after, status, offset, uncopied, ok = _fresh_python(_COMPILE_THEN_RUN).split()
    assert (before, after, status) == (io.NUMPY_DEFAULT_HANDLER_NAME, io.ALIGNED_HANDLER_NAME, "on")
    assert offset == "0" and uncopied == "True" and ok == "True"


def test_environment_switch_leaves_numpy_alone():
    before, after, status, offset, uncopied, ok = _fresh_python(_COMPILE_THEN_RUN, TVMFUSE_ALIGNED_NUMPY="0").split()
    assert (before, after, status) == (io.NUMPY_DEFAULT_HANDLER_NAME,) * 2 + ("off_(TVMFUSE_ALIGNED_NUMPY=0)",)
    assert uncopied == "True" and ok == "True"       # element-aligned numpy inputs still go in place


def test_without_the_native_extension_nothing_changes():
    line = _fresh_python("""
        import tvmfuse
        from tvmfuse import io, models as M
        cm = tvmfuse.compile(M.softmax(rows=2, d=16, decomposed=False), "llvm")
        print(io.numpy_allocator(), io.aligned_numpy(True), io.aligned_numpy_status().split(":")[0])
    """, TVMFUSE_NATIVE_IO="0")
    assert line.split() == [io.NUMPY_DEFAULT_HANDLER_NAME, "False", "unavailable"]


def test_a_loaded_artifact_turns_it_on_too(tmp_path):
    from tvmfuse import models as M

    path = tvmfuse.export(tvmfuse.compile(M.softmax(rows=2, d=16, decomposed=False), "llvm"),
                          str(tmp_path / "artifact"))
    line = _fresh_python(f"""
        import numpy as np, tvmfuse
        from tvmfuse import io
        r = tvmfuse.load({str(path)!r})
        print(io.numpy_allocator(), np.empty((2, 16), np.float32).ctypes.data % 64)
    """)
    assert line.split() == [io.ALIGNED_HANDLER_NAME, "0"]


def test_another_allocator_is_left_alone(monkeypatch):
    """The automatic switch does not replace an allocator some other library installed (rule that must
    not fire); the explicit call still can."""
    monkeypatch.setattr(io, "_aligned_state", {})
    monkeypatch.setattr(io, "numpy_allocator", lambda: "someone_elses_allocator")
    calls = []
    monkeypatch.setattr(io, "aligned_numpy", lambda enable=True: calls.append(enable) or True)
    io._auto_aligned_numpy()
    assert calls == [] and io.aligned_numpy_status() == "left alone: numpy's allocator is 'someone_elses_allocator'"
    io._auto_aligned_numpy()                       # decided once per process
    assert calls == []
