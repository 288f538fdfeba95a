"""benchmarks/io_native_ab.py and benchmarks/io_control.py (io11): the A/B's three paths are what they say
(native step, Python path, VM call; same results), and the control analysis reads bench_cpu --io's rounds
(a synthetic run whose ratios are known).  No timing is asserted."""
import importlib.util
import json
import os
import shutil
import sysconfig

import numpy as np
import pytest

import tvmfuse
from tvmfuse import models as M
from tvmfuse import runtime_native

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(_ROOT, "benchmarks", name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_native_ab_paths_run_what_they_name(host):
    if shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) is None:
        pytest.skip("no C compiler: the native step cannot be built here")
    A = _load("io_native_ab")
    cm = tvmfuse.compile(M.layernorm(rows=2, d=16, decomposed=False), host)
    paths, feeds = A.make_paths(cm)
    assert set(paths) == set(A.PATHS)
    native, python, vm = paths["run_native"](), paths["run_python"](), paths["vm"]()
    np.testing.assert_array_equal(native["y"], python["y"])
    np.testing.assert_array_equal(native["y"], vm.numpy())
    res = A.measure(paths, rounds=2, clock=A.time.perf_counter_ns, block_s=0.001)
    assert set(res["us"]) == set(A.PATHS) and len(res["by_round"]["vm"]) == 2
    runtime_native._reset_for_tests()


def test_control_pairs_and_halves_from_rounds(tmp_path):
    B = _load("io_control")
    rounds = 8
    vm = [1.0] * rounds
    # the artifact's VM 10% slower in the first half only; run() 5% over the VM throughout
    engines = {"io_vm": vm, "io_artifact_vm": [1.1] * 4 + [1.0] * 4, "io_vm_views": vm,
               "io_run_numpy": [1.05] * rounds, "io_artifact_run_numpy": [1.05] * rounds}
    data = {"date": "d",
            "rows": [{"workload": "w", "engines": {e: {"ms": {"by_round": r}} for e, r in engines.items()}}]}
    path = tmp_path / "io.json"
    path.write_text(json.dumps(data))
    res = B.analyse(data)["w"]
    assert res["artifact_vm/vm"]["first_half"] == pytest.approx(1.1)
    assert res["artifact_vm/vm"]["second_half"] == pytest.approx(1.0)
    assert res["artifact_vm/vm"]["halves_differ_by"] == pytest.approx(0.1)
    assert res["run/vm"]["median"] == pytest.approx(1.05) and res["artifact_run/run"]["median"] == pytest.approx(1.0)
    assert "run_same/vm" not in res                  # not in that run: left out, not invented
    out = tmp_path / "out.json"
    assert B.main([str(path), "--json", str(out)]) == 0
    assert json.loads(out.read_text())[str(path)]["workloads"]["w"]["vm_ms"] == 1.0
