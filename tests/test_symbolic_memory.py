"""What a symbolic model costs between its kernels (issue 13): the VM's shape functions must not take
``noalias`` away from the kernels (``tvmfuse.restrict_shape_funcs``), and ``shape_upper_bounds`` lets
Relax plan intermediate storage once for the bound (``tir_var_upper_bound``), refusing larger sizes."""
import re

import numpy as np
import onnx
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.cli import main
from tvmfuse.errors import InputError
from tvmfuse.frontend import load_onnx
from tvmfuse.pipeline import PipelineOptions, Stages, _restrict_shape_funcs

from conftest import named_target

BOUND = 16


def _block(batch="batch"):
    return M.resnet_block(channels=8, size=8, batch=batch)


def _lowered_main(model, target, **options) -> str:
    """TVMScript of ``main`` after tvmfuse's whole Relax pipeline (memory planned, VM builtins explicit)."""
    with target:
        st = Stages(target, PipelineOptions(**options))
        return C.Sequential(st.all())(load_onnx(model))["main"].script()


def _storage_sizes(main_text: str) -> list[str]:
    """The size argument of each ``R.vm.alloc_storage`` in ``main``: ``R.shape([n])`` (planned, constant)
    or the name of a shape computed per call."""
    return re.findall(r"R\.vm\.alloc_storage\((R\.shape\(\[\d+\]\)|\w+),", main_text)


# ----------------------------------------------------------------------------------- noalias kept
def _compute_functions(ll: str) -> dict[str, str]:
    """LLVM IR: each kernel's ``<name>_compute_`` function -> its parameter list."""
    return dict(re.findall(r"^define internal [^@]*@(\w+)_compute_\(([^)]*)\)", ll, re.M))


def test_kernels_of_a_symbolic_model_keep_noalias_arguments():
    """TVM's LLVM code generator let shape_func's missing ``tirx.noalias`` (it sorts after the kernels)
    strip ``noalias`` from every kernel's arguments and inline their compute functions: the kernels of a
    symbolic resnet18 ran 1.5-3x slower inside the model than alone."""
    cm = tvmfuse.compile(_block(), target=named_target("skx-2"))
    ll = cm.executable.mod.imports[0].inspect_source("ll")
    assert "@__tvm_ffi_shape_func(" in ll          # the case that matters: the module has a shape function
    computes = _compute_functions(ll)
    kernels = sorted(k for k in computes if k.startswith("fused_"))
    assert len(kernels) == cm.kernel_count == 2
    for k in kernels:
        pointers = [p for p in computes[k].split(",") if p.strip().startswith("ptr")]
        assert pointers and all("noalias" in p for p in pointers), (k, computes[k])


@C.script_ir.ir_module
class _HostFuncs:
    @C.script_tir.prim_func(s_tir=True)
    def shape_func(H: C.script_tir.Buffer((4,), "int64")):
        C.script_tir.func_attr({"tirx.is_host_func": True})
        H[1] = H[0] * C.script_tir.int64(2)

    @C.script_tir.prim_func(s_tir=True)
    def two_pointers(A: C.script_tir.Buffer((4,), "int64"), B: C.script_tir.Buffer((4,), "int64")):
        C.script_tir.func_attr({"tirx.is_host_func": True})
        B[0] = A[0]

    @C.script_tir.prim_func(s_tir=True)
    def kernel(A: C.script_tir.Buffer((4,), "float32"), B: C.script_tir.Buffer((4,), "float32")):
        B[0] = A[0]


def test_restrict_shape_funcs_marks_only_one_pointer_host_functions():
    out = _restrict_shape_funcs(_HostFuncs)
    noalias = {gv.name_hint: bool(f.attrs.get(C.NOALIAS_ATTR)) for gv, f in out.functions.items()}
    # a second pointer could alias the first: left as TVM made it; a kernel is not the pass's business
    assert noalias == {"shape_func": True, "two_pointers": False, "kernel": False}


# ----------------------------------------------------------------------------------- shapes made once
def _make_shapes(main_text: str) -> list[str]:
    """The shapes ``main`` builds per call (``vm.builtin.make_shape``), as their heap-slot arguments."""
    return re.findall(r'"vm\.builtin\.make_shape", shape_heap, ([\d, ]+), ty_args', main_text)


def test_each_symbolic_shape_is_made_once_per_call():
    """VMShapeLower made one ``make_shape`` per use of a symbolic shape (a symbolic BERT's main: 28 per call
    for 6 distinct shapes); ``tvmfuse.share_shapes`` binds each distinct shape once and passes that."""
    target = named_target("skx-2")
    shared = _lowered_main(_block(), target)
    # two storages ([2048 * batch] and [4 * batch * 8 * 8 * 8]: equal once simplified) and two tensors
    # ([batch, 8, 8, 8]): two distinct shapes, two make_shape, each passed twice
    made = _make_shapes(shared)
    assert len(made) == len(set(made)) == 2, made
    assert len(re.findall(r"R\.vm\.alloc_storage\((shape\d+),", shared)) == 2
    assert len(re.findall(r"R\.vm\.alloc_tensor\(\w+, 0, (shape\d+),", shared)) == 2
    with target:
        st = Stages(target, PipelineOptions())
        passes = [p for p in st.all() if p.info.name != "tvmfuse.share_shapes"]
        unshared = C.Sequential(passes)(load_onnx(_block()))["main"].script()
    assert len(_make_shapes(unshared)) == 4
    # a static model has no shape to make, and a bounded one plans its storage with constant sizes
    assert _make_shapes(_lowered_main(_block(3), target)) == []
    assert len(_make_shapes(_lowered_main(_block(), target, shape_upper_bounds={"batch": BOUND}))) == 2


def _reshapes_module():
    I, RS, T = C.script_ir, C.script_relax, C.script_tir

    @I.ir_module
    class Reshapes:
        @RS.function
        def main(x: RS.Tensor(("b", 16), "float32")):
            b = T.int64()
            y = RS.reshape(x, RS.shape([b * 16]))
            z = RS.reshape(y, RS.shape([b * 16]))
            return z

    return Reshapes


def test_share_shapes_leaves_other_calls_alone():
    """A Relax op's shape argument (``R.reshape`` here) is read as a literal by its type and legalization:
    left as it is (the VM's allocations, ``vm.builtin.reshape`` and a kernel's symbolic scalars take shared
    ones: tests/test_symbolic_vm_calls.py)."""
    from tvmfuse.pipeline import _share_shapes

    C.assert_structural_equal(_share_shapes(_reshapes_module()), _reshapes_module())


@pytest.fixture(scope="module")
def symbolic_block(host):
    return tvmfuse.compile(_block(), target=host)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_shared_shapes_model_matches_reference(symbolic_block, rng, batch):
    x = rng.standard_normal((batch, 8, 8, 8)).astype(np.float32)
    got = symbolic_block.run({"x": x})["y"]
    assert got.shape == (batch, 8, 8, 8)
    np.testing.assert_allclose(got, M.reference_outputs(_block(), {"x": x})["y"], rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------- storage planned once
def test_bound_plans_intermediate_storage_once():
    target = named_target("skx-2")
    unbounded = _storage_sizes(_lowered_main(_block(), target))
    bounded = _storage_sizes(_lowered_main(_block(), target, shape_upper_bounds={"batch": BOUND}))
    static = _storage_sizes(_lowered_main(_block(3), target))
    # without a bound every storage is sized per call; with it only the returned output's (it leaves main)
    assert len(unbounded) == 2 and not any(s.startswith("R.shape") for s in unbounded)
    assert len(bounded) == len(static) == 2
    planned = [s for s in bounded if s.startswith("R.shape")]
    assert len(planned) == 1 and all(s.startswith("R.shape") for s in static)
    # the intermediate (batch, 8, 8, 8) float32 planned for the bound
    assert planned == [f"R.shape([{BOUND * 8 * 8 * 8 * 4}])"]


@pytest.fixture(scope="module")
def bounded_and_static(host):
    sym = tvmfuse.compile(_block(), target=host, shape_upper_bounds={"batch": BOUND})
    return sym, {b: tvmfuse.compile(_block(b), target=host) for b in (1, 3, 8)}


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_bounded_model_matches_static_and_reference(bounded_and_static, rng, batch):
    sym, static = bounded_and_static
    assert sym.shape_upper_bounds == {"batch": BOUND} and sym.kernel_count == static[batch].kernel_count
    x = rng.standard_normal((batch, 8, 8, 8)).astype(np.float32)
    got = sym.run({"x": x})["y"]
    np.testing.assert_allclose(got, static[batch].run({"x": x})["y"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, M.reference_outputs(_block(), {"x": x})["y"], rtol=1e-4, atol=1e-4)


def test_size_above_the_bound_is_an_input_error(bounded_and_static, rng, tmp_path):
    sym, _ = bounded_and_static
    x = rng.standard_normal((BOUND + 1, 8, 8, 8)).astype(np.float32)
    with pytest.raises(InputError, match=rf"'batch' is {BOUND + 1} in input 'x'.*above the bound {BOUND}"):
        sym.run({"x": x})
    with pytest.raises(InputError, match="above the bound"):
        sym.bind({"x": x})
    ok = rng.standard_normal((BOUND, 8, 8, 8)).astype(np.float32)   # the bound itself is allowed
    np.testing.assert_allclose(sym.run({"x": ok})["y"], M.reference_outputs(_block(), {"x": ok})["y"],
                               rtol=1e-4, atol=1e-4)
    # an exported artifact keeps the bound and its check
    art = tvmfuse.export(sym, str(tmp_path / "art"))
    runner = tvmfuse.load(art)
    assert runner.manifest["shape_upper_bounds"] == {"batch": BOUND}
    with pytest.raises(InputError, match="above the bound"):
        runner.run({"x": x})


@pytest.mark.parametrize("bounds, match", [
    ({"sequence": 8}, "'sequence', which is not a symbolic dim of the model's inputs"),
    ({"batch": 0}, "a bound is an integer >= 1"),
    ({"batch": 2.5}, "a bound is an integer >= 1"),
])
def test_bad_bounds_are_input_errors(bounds, match):
    with pytest.raises(InputError, match=match):
        tvmfuse.compile(_block(), target=named_target("skx-2"), shape_upper_bounds=bounds)


def test_cli_shape_bound(tmp_path, capsys):
    path = tmp_path / "block_dyn.onnx"
    onnx.save(_block(), path)
    art = tmp_path / "art"
    assert main(["compile", str(path), "--shape-bound", f"batch={BOUND}", "-o", str(art)]) == 0
    assert tvmfuse.load(str(art)).shape_upper_bounds == {"batch": BOUND}
    assert main(["compile", str(path), "--shape-bound", "batch=2,3", "-o", str(tmp_path / "a2")]) == 2
    assert "give one size per symbolic dim" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- builtins per call
def _symbolic_call_bench():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                        "symbolic_call.py")
    spec = importlib.util.spec_from_file_location("symbolic_call", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_builtins_per_call_counted_by_the_benchmark(symbolic_block, host, rng):
    """What one call of main runs (benchmarks/symbolic_call.py): the symbolic block's two kernels, its two
    storages sized per call, and its two distinct shapes made once each; the static block makes none."""
    bench = _symbolic_call_bench()
    x = rng.standard_normal((3, 8, 8, 8)).astype(np.float32)
    calls = bench.builtin_calls(symbolic_block, {"x": x})
    assert calls["kernel"] == symbolic_block.kernel_count == 2
    assert calls["vm.builtin.make_shape"] == 2 and calls["vm.builtin.alloc_storage"] == 2
    assert calls["vm.builtin.alloc_tensor"] == 2
    static = tvmfuse.compile(_block(3), target=host)
    static_calls = bench.builtin_calls(static, {"x": x})
    assert "vm.builtin.make_shape" not in static_calls and static_calls["kernel"] == 2
    assert set(bench.vm_instructions(symbolic_block)) == {"main"}


def test_call_benchmark_times_on_either_clock(symbolic_block, rng):
    """benchmarks/symbolic_call.py ``--clock wall`` (what a user sees on several runtime threads) or the
    thread's CPU time: per build and path, min <= median, both positive."""
    bench = _symbolic_call_bench()
    x = rng.standard_normal((3, 8, 8, 8)).astype(np.float32)
    for clock in bench.CLOCKS.values():
        t = bench.timed({"symbolic": symbolic_block}, {"x": x}, rounds=2, repeat=2, clock=clock)["symbolic"]
        assert set(t) == {"vm", "run"} and all(0 < p["min_us"] <= p["median_us"] for p in t.values())
