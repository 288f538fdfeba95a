import os

# Under pytest-xdist (README's test command: two worker processes on two cores) TVM's idle pool workers of
# one process would spin after each parallel call and slow the other process's compile and run (10x seen
# between runtimes); told not to spin, they sleep.  Read when TVM makes its pool (the first parallel call),
# so set before any test runs; a value the user set is kept.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import pytest  # noqa: E402

import tvmfuse  # noqa: E402
from tvmfuse import models as M


@pytest.fixture(scope="session")
def host():
    """This machine, for numeric tests only (a structural test names its targets: NAMED_TARGETS)."""
    return tvmfuse.host_target()


# Fixed targets for structural tests: a schedule's defaults come from the target (its mcpu, mattr and
# num-cores, and schedules/cpu_targets.json), so these tests give the same kernels on every host.
NAMED_TARGETS = {
    "haswell-2": {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "haswell", "num-cores": 2},
    "skx-2": {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512", "num-cores": 2},
    "skx-32": {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512", "num-cores": 32},
    "neon-4": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "neoverse-n1", "num-cores": 4},
}


def named_target(name: str):
    return tvmfuse.parse_target(NAMED_TARGETS[name])


def pytest_addoption(parser):
    parser.addoption("--rng-seed", type=int, default=None,
                     help="seed of the `rng` fixture (default: a fresh one per test, reported on failure)")


@pytest.fixture
def rng(request):
    """Fresh random inputs each run; a failing test's report names the seed (section "rng seed"), and
    ``pytest --rng-seed=N`` replays it."""
    seed = request.config.getoption("--rng-seed")
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % (2**32))
    request.node.stash[RNG_SEED] = seed
    return np.random.default_rng(seed)


RNG_SEED = pytest.StashKey[int]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = item.stash.get(RNG_SEED, None)
    if report.failed and seed is not None:
        report.sections.append(("rng seed", f"rng fixture seed: {seed} (replay: pytest --rng-seed={seed} "
                                            f"{item.nodeid})"))


def assert_close_to_reference(model, compiled, rng, rtol=1e-5, atol=1e-5):
    """Outputs of ``compiled`` vs. onnx's ReferenceEvaluator on fresh normal inputs."""
    feeds = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in M.random_feeds(model).items()}
    ref = M.reference_outputs(model, feeds)
    out = compiled.run(feeds)
    for name, r in ref.items():
        np.testing.assert_allclose(out[name], r, rtol=rtol, atol=atol, err_msg=f"output {name}")
    return out


NARROW_FLOATS = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT8E4M3FN,
                 onnx.TensorProto.FLOAT8E4M3FNUZ, onnx.TensorProto.FLOAT8E5M2, onnx.TensorProto.FLOAT8E5M2FNUZ)


def float64_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` computing in float64: every float32 graph input, output, value_info, initializer and Constant
    becomes float64 (its float32 values, exactly), and so does a Cast to float32; a Cast to a narrower float
    is refused (ValueError: its rounding is not the float32 model's)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    f32, f64 = onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE

    def widen_tensor(t):
        if t.data_type == f32:
            t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t).astype(np.float64), t.name))

    def widen_graph(g):
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            if vi.type.tensor_type.elem_type == f32:
                vi.type.tensor_type.elem_type = f64
        for t in g.initializer:
            widen_tensor(t)
        for node in g.node:
            for a in node.attribute:
                if node.op_type == "Cast" and a.name == "to" and a.i == f32:
                    a.i = f64
                elif node.op_type == "Cast" and a.name == "to" and a.i in NARROW_FLOATS:
                    # float64 -> float16 and float32 -> float16 round some values to neighbouring halves:
                    # the widened model would not be the truth of the float32 one (1e-4 off at some seeds)
                    raise ValueError(f"float64_model: node {node.name or node.output[0]!r} casts to "
                                     f"{onnx.TensorProto.DataType.Name(a.i)}; compare such a model with its "
                                     "float32 reference")
                elif a.type == onnx.AttributeProto.TENSOR:
                    widen_tensor(a.t)
                elif a.type == onnx.AttributeProto.GRAPH:
                    widen_graph(a.g)

    widen_graph(m.graph)
    return m


def reference_outputs_f64(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """onnx's ReferenceEvaluator on ``float64_model(model)`` with the float32 ``feeds`` widened, exactly:
    the float64 truth of the float32 inputs, for a float32 kernel whose error alone is then measured (a
    float32 reference adds rounding of its own, in another order).  Inputs whose float32 computation is
    ill-conditioned stay so: attention logits ~1e4 carry ~5e-4 of float32 rounding in any order, the
    kernel's as numpy's (test_attention._large_logit_feeds makes them exact; benchmarks/notes/review10.md)."""
    wide = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feeds.items()}
    out = M.reference_outputs(float64_model(model), wide)
    for name, r in out.items():
        assert r.dtype == np.float64, f"float64 reference: output {name} is {r.dtype}"
    return out


def assert_close_scaled(got, ref, rtol, atol, err_msg=""):
    """``got`` vs ``ref`` element-wise within ``rtol`` of the larger of ``|ref|`` and the output's scale
    (``max |ref|``, NaNs ignored), plus ``atol``: an output that is a near-cancelling sum of large values
    (attention with logits ~1e4 over values ~30) carries the rounding of its terms, not of itself
    (tests/test_attention_blocks.py, seed 1 on a znver5 host: 2.5e-3 off on an element of 1.9, 3e-6 of the
    output's scale).  NaNs must sit where the reference has them."""
    scale = float(np.nanmax(np.abs(ref))) if np.size(ref) and not np.isnan(ref).all() else 0.0
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=max(atol, rtol * scale), err_msg=err_msg)


_SHARED_BUILDS: dict = {}


def compile_shared(path, target=None, **kwargs):
    """``tvmfuse.compile(path, target, **kwargs)`` of a model file, built once per test session: the corpus
    models are compiled by several test files (tests/test_corpus.py, test_symbolic_corpus.py,
    test_attention_corpus.py, test_symbolic_token_models.py), each asserting something else of the same
    build.  The same path, target and options give the same build (an option given as None is its default);
    callers only read it (report, run).  A repeated call still sizes the runtime's threads as compile does."""
    import os

    from tvmfuse.target import configure_threads, is_gpu

    target = tvmfuse.parse_target(target)
    given = {k: v for k, v in kwargs.items() if v is not None}
    key = (os.path.abspath(str(path)), str(target), tuple(sorted((k, repr(v)) for k, v in given.items())))
    if key in _SHARED_BUILDS:
        if not is_gpu(target):
            configure_threads(given.get("num_threads"))
    else:
        _SHARED_BUILDS[key] = tvmfuse.compile(str(path), target, **given)
    return _SHARED_BUILDS[key]
