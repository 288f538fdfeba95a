"""The tvmfuse command line: the main commands and one clear line (no traceback) for each bad input."""
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

from tvmfuse import models as M
from tvmfuse.cli import main


def _cli(*args):
    """Run the real entry point in a fresh interpreter (as a user would)."""
    return subprocess.run([sys.executable, "-m", "tvmfuse", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.fixture
def model_path(tmp_path):
    p = tmp_path / "mlp.onnx"
    onnx.save(M.matmul_bias_gelu(m=8, k=16, n=24), p)
    return str(p)


def _has_onnxruntime() -> bool:
    import importlib.util

    return importlib.util.find_spec("onnxruntime") is not None


def _latency_lines(stdout: str) -> list[str]:
    return [ln for ln in stdout.splitlines() if ln.startswith("latency ms, median of")]


def test_demo_runs_and_checks():
    r = _cli("demo", "--quick")
    assert r.returncode == 0, r.stderr
    assert "demo: all checks passed" in r.stdout
    assert r.stdout.count("tvmfuse fusion report") == 2
    assert "transformer_block" in r.stdout and "resnet_block" in r.stdout
    # every column is named and said what it is; the count printed is the count every column ran
    assert "latency columns (ms per call, median of 10 calls each, after 2 warm-up calls, all measured in this " \
           "run)" in r.stdout
    assert "tvmfuse, untuned" in r.stdout
    lines = _latency_lines(r.stdout)
    assert len(lines) == 2 and all(ln.startswith("latency ms, median of 10 calls each") for ln in lines)
    # the TVM baseline is TVM's untuned deployment route (dlight's rules), not the unscheduled strawmen
    assert all("TVM dlight" in ln for ln in lines)
    assert not any(s in r.stdout for s in ("TVM unfused", "TVM FuseOps"))
    assert "dlight's CPU rules (GEMV, Reduction" in r.stdout
    assert all(("onnxruntime" in ln) == _has_onnxruntime() for ln in lines)
    # every engine's outputs are checked, not only tvmfuse's
    checks = [ln for ln in r.stdout.splitlines() if ln.startswith("check vs onnx ReferenceEvaluator")]
    assert len(checks) == 2 and all("tvmfuse pass" in ln and "TVM dlight pass" in ln for ln in checks)
    assert all(("onnxruntime pass" in ln) == _has_onnxruntime() for ln in checks)


def test_demo_json_names_the_columns_it_timed():
    import json

    from tvmfuse.demo import columns

    r = _cli("demo", "--quick", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout[:r.stdout.rindex("]") + 1])
    for entry in d:
        assert entry["repeat"] == 10 and entry["warmup"] == 2 and entry["check"] == "pass"
        assert set(entry["latency_ms"]) == set(entry["columns"]) == {n for n, _ in columns(None, _has_onnxruntime())}
        assert set(entry["checks"]) == set(entry["latency_ms"])       # every timed engine was checked
        assert all(c["check"] == "pass" for c in entry["checks"].values())
        assert all(v > 0 for v in entry["latency_ms"].values())


def test_demo_without_onnxruntime():
    """onnxruntime is only in the test extra: the README's first command must run on a machine without it."""
    code = ("import sys; sys.modules['onnxruntime'] = None\n"     # makes `import onnxruntime` raise ImportError
            "from tvmfuse.cli import main\nsys.exit(main(['demo', '--quick']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "demo: all checks passed" in r.stdout
    assert "onnxruntime is not installed" in r.stdout
    lines = _latency_lines(r.stdout)
    assert len(lines) == 2 and not any("onnxruntime" in ln for ln in lines)
    assert all("TVM dlight" in ln for ln in lines)


def test_demo_columns_say_which_records():
    from tvmfuse.demo import columns

    assert "untuned" in dict(columns(None, False))["tvmfuse"]
    assert "shipped" in dict(columns("shipped", False))["tvmfuse"]
    assert "onnxruntime" not in dict(columns(None, False)) and "onnxruntime" in dict(columns(None, True))


def test_demo_columns_name_the_tvm_route_per_target_family():
    from tvmfuse.demo import columns

    assert [n for n, _ in columns(None, True)] == ["tvmfuse", "onnxruntime", "TVM dlight"]
    assert "dlight's CPU rules" in dict(columns(None, False))["TVM dlight"]
    assert "dlight's GPU rules" in dict(columns(None, False, gpu=True))["TVM dlight"]


def test_demo_check_flags_wrong_outputs():
    from tvmfuse.demo import DEMO_ATOL, check_outputs

    ref = {"y": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)}
    assert check_outputs([ref["y"].copy()], ref)["check"] == "pass"
    off = ref["y"].copy()
    off[1, 2] += 100 * DEMO_ATOL
    bad = check_outputs([off], ref)
    assert bad["check"] == "FAIL" and bad["max_abs_error"] > 50 * DEMO_ATOL
    assert "shape" in check_outputs([ref["y"].T], ref)["why"]
    assert "2 outputs" in check_outputs([ref["y"], ref["y"]], ref)["why"]


def test_report_table_and_json(model_path, capsys):
    assert main(["report", model_path]) == 0
    out = capsys.readouterr().out
    assert "kernels" in out and "fused groups" in out
    assert main(["report", model_path, "--json"]) == 0
    import json

    d = json.loads(capsys.readouterr().out)
    assert d["after"]["kernels"] == 1 and d["before"]["kernels"] == 7


def test_run_with_npz_inputs(model_path, tmp_path, capsys):
    x = np.random.default_rng(0).standard_normal((8, 16)).astype("float32")
    np.savez(tmp_path / "in.npz", x=x)
    out_path = str(tmp_path / "out.npz")
    assert main(["run", model_path, "--inputs", str(tmp_path / "in.npz"), "-o", out_path]) == 0
    ref = M.reference_outputs(onnx.load(model_path), {"x": x})["y"]
    np.testing.assert_allclose(np.load(out_path)["y"], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["missing", "malformed", "unsupported", "wrong_shape", "wrong_dtype",
                                  "wrong_name", "bad_npz"])
def test_bad_input_one_line_nonzero_exit(case, tmp_path, model_path, capfd):
    """One line on stderr, exit status 2.  "missing" runs the real entry point in a fresh interpreter (its
    stderr holds whatever an import prints too); the others call ``main`` in this one (``capfd``: the C++
    side's stderr as well), which spares an interpreter start and TVM import (~2 CPU s) per case."""
    args = ["run", model_path]
    if case == "missing":
        args = ["report", str(tmp_path / "nope.onnx")]
        expect = "not found"
    elif case == "malformed":
        p = tmp_path / "bad.onnx"
        p.write_bytes(os.urandom(200))
        args = ["report", str(p)]
        expect = "ONNX"
    elif case == "unsupported":
        from onnx import TensorProto, helper

        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
        m = helper.make_model(helper.make_graph([helper.make_node("Hardmax2", ["x"], ["y"], name="n0",
                                                                  domain="com.example")], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
        p = tmp_path / "unsup.onnx"
        onnx.save(m, p)
        args = ["report", str(p)]
        expect = "unsupported ONNX op 'Hardmax2' (node 'n0')"
    else:
        arrays = {"wrong_shape": {"x": np.zeros((3, 16), "float32")},
                  "wrong_dtype": {"x": np.zeros((8, 16), "int32")},
                  "wrong_name": {"inp": np.zeros((8, 16), "float32")}}.get(case)
        npz = tmp_path / "in.npz"
        if arrays is None:
            npz.write_bytes(b"not an npz")
            expect = "npz"
        else:
            np.savez(npz, **arrays)
            expect = {"wrong_shape": "shape", "wrong_dtype": "dtype", "wrong_name": "unknown input"}[case]
        args += ["--inputs", str(npz)]
    if case == "missing":
        r = _cli(*args)
        code, stdout, stderr = r.returncode, r.stdout, r.stderr
    else:
        capfd.readouterr()
        code = main(args)
        stdout, stderr = capfd.readouterr()
    assert code == 2, (stdout, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tvmfuse: error:"), stderr
    assert expect in lines[0]
    assert "Traceback" not in stderr
