import numpy as np
import pytest

import tvmfuse
from tvmfuse import models as M


@pytest.fixture(scope="session")
def host():
    return tvmfuse.host_target()


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
