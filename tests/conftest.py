import numpy as np
import pytest

import tvmfuse
from tvmfuse import models as M


@pytest.fixture(scope="session")
def host():
    return tvmfuse.host_target()


@pytest.fixture
def rng():
    # fresh random inputs each run: the seed is printed on failure by the assertion messages
    seed = int(np.random.SeedSequence().entropy % (2**32))
    return np.random.default_rng(seed)


def assert_close_to_reference(model, compiled, rng, rtol=1e-5, atol=1e-5):
    """Outputs of ``compiled`` vs. onnx's ReferenceEvaluator on fresh normal inputs."""
    feeds = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in M.random_feeds(model).items()}
    ref = M.reference_outputs(model, feeds)
    out = compiled.run(feeds)
    for name, r in ref.items():
        np.testing.assert_allclose(out[name], r, rtol=rtol, atol=atol, err_msg=f"output {name}")
    return out
