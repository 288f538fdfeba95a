"""benchmarks/conv_kernel_ab.py: its cases reach the conv templates benchmarks/gaps_cnn.md names, every knob
variant's output is checked against the default's, bad arguments are refused by name.  No timing is
asserted (one round of one call, only to run the code path)."""
import importlib.util
import os

import numpy as np
import pytest

from conftest import named_target

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("conv_kernel_ab",
                                               os.path.join(_ROOT, "benchmarks", "conv_kernel_ab.py"))
A = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(A)

# the family each case exercises on both named x86 targets (the doc's per-kernel rows are keyed so)
FAMILIES = {
    "stem": "cpu.conv2d_epilogue",           # 3 input channels: the direct template (im2col, padded rows)
    "fire3x3_15": "cpu.conv2d_lanes",        # 225-pixel plane: output channels on the lanes
    "fire3x3_3": "cpu.conv2d_lanes",
    "fire1x1_15": "cpu.conv1x1",
    "conv64_56": "cpu.conv2d_epilogue",      # 3136-pixel plane: vectorized along the row
    "conv32_28": "cpu.conv2d_lanes",         # 784 pixels, 28-column rows: 7 of 8 / 14 of 16 lanes (wide_lane_use_below)
    "conv64_32": "cpu.conv2d_epilogue",      # 32-column rows: whole vectors
}


@pytest.mark.parametrize("tname", ["haswell-2", "skx-2"])
def test_cases_reach_their_templates(tname):
    target = named_target(tname)
    for case, family in FAMILIES.items():
        _, template, match = A.conv_kernel(A.conv_relu(*A.CASES[case]), target)
        assert template.family == family, (case, tname)
        ci, co, hw, k, stride, pad = A.CASES[case]
        assert (match.info["RC"], match.info["F"], match.info["KH"]) == (ci, co, k)
        assert match.info["OH"] == (hw + 2 * pad - k) // stride + 1


def test_variant_checked_against_default(host):
    out = A.run_case("fire3x3_15", [{"ow_tile": 3, "nvec": 2}], host, rounds=1, number=1)
    assert out["template"] == "cpu.conv2d_lanes"
    assert set(out["us_min_median"]) == {"default", "v0", "onnxruntime_1op"}
    assert all(v[0] > 0 for v in out["us_min_median"].values())
    assert out["configs"]["v0"] == {"ow_tile": 3, "nvec": 2}


def test_wrong_variant_output_is_caught(host, monkeypatch):
    """A variant whose kernel leaves its output untouched (a broken schedule) fails the check by name."""
    real = A.build
    calls = []

    def build(func, template, match, config, target, rng_seed=0):
        fn, args, out = real(func, template, match, config, target, rng_seed)
        calls.append(config)
        return (fn if len(calls) == 1 else (lambda *a: None)), args, out

    monkeypatch.setattr(A, "build", build)
    with pytest.raises(AssertionError, match="differs from the default"):
        A.run_case("fire1x1_15", [{"mr": 1}], host, rounds=1, number=1)


def test_unknown_case_refused():
    with pytest.raises(SystemExit, match="unknown case.*nope"):
        A.main(["--cases", "nope"])


def test_conv_relu_shapes():
    m = A.conv_relu(3, 8, 9, 3, 2, 0)
    dims = [d.dim_value for d in m.graph.output[0].type.tensor_type.shape.dim]
    assert dims == [1, 8, 4, 4]
    w = [i for i in m.graph.initializer if i.name == "W"][0]
    assert list(w.dims) == [8, 3, 3, 3] and np.prod(w.dims) > 0


def test_template_defaults_variant_recomputes_the_default():
    """A variant's ``template_defaults`` entry gives the default under those table entries (the kernel of
    before a table change: the depthwise 2x2 plane back on the columns), and leaves the table as it was; an
    entry the family does not have is refused by name."""
    target = named_target("skx-2")
    _, template, match = A.conv_kernel(A.conv_relu(*A.CASES["dw336_2"]), target)
    assert template.family == "cpu.depthwise_conv2d_epilogue"
    assert template.default_config(match, target)["channel_lanes"] == 16
    before = A.default_with_table(template, match, target, {"lanes_plane_pixels_below": 0})
    assert before["channel_lanes"] == 0
    assert template.default_config(match, target)["channel_lanes"] == 16
    with pytest.raises(SystemExit, match="no \\['no_such_entry'\\]"):
        A.default_with_table(template, match, target, {"no_such_entry": 1})
