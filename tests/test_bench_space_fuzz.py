"""benchmarks/space_fuzz.py, the knob-space fuzzer: its workloads reach their templates, a candidate that
computes other numbers than the unscheduled kernel is reported as such (with the config), a config outside
its space is refused, and the command line writes a JSON report.  No timing is asserted."""
import importlib.util
import json
import os

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("space_fuzz", os.path.join(_ROOT, "benchmarks", "space_fuzz.py"))
F = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(F)


def test_every_listed_case_has_a_builder():
    assert set(F.CASE_NAMES) == set(F._cases())


def test_only_targets_the_host_can_execute_are_run():
    """skylake-avx512 code on an AVX2-only host dies with SIGILL (it killed the test run on a Zen 3 host):
    a target runs only where the host has its CPU features; cross targets are built only."""
    from tvmfuse import _compat as C
    from tvmfuse.target import host_target, parse_target

    host = C.llvm_cpu_features(host_target())
    assert F.runs_here("skylake") == ("avx512f" in host and "avx512bw" in host)
    assert F.runs_here("haswell") == ({"avx2", "fma"} <= host)
    assert not F.runs_here("neon") and not F.runs_here("cuda")
    assert C.llvm_cpu_features(parse_target(F.TARGETS["skylake"])) >= {"avx512f"}


def _runnable_x86() -> str:
    runnable = [t for t in F.RUNS_ON_HOST_CANDIDATES if F.runs_here(t)]
    if not runnable:
        pytest.skip("this host runs none of the x86 fuzz targets")
    return runnable[-1]


def test_wrong_numbers_and_configs_outside_the_space_are_reported():
    job = F._Job("gemv", _runnable_x86(), 1, seed=0)
    assert [t.family for t in job.tasks] == ["cpu.matmul_epilogue"] and len(job.candidates) == 2
    assert job.run(0) == {"kind": "ok"}                         # the default config
    for sizes, args, outs in job.reference(0):
        outs[-1][..., 0] += 1.0                                 # as if the schedule had computed this
    res = job.run(0)
    assert res["kind"] == "numbers" and "1 of 77 values differ" in res["message"], res
    ti, si, cfg = job.candidates[0]
    job.candidates[0] = (ti, si, {**cfg, "lanes": 3})
    assert job.run(0)["kind"] == "space"


def test_symbolic_rows_run_at_each_bucket_size():
    job = F._Job("mlp_sym", "haswell", 0, seed=0)
    assert {t.family for t in job.tasks} == {"cpu.symbolic_matmul"} and len(job.tasks) > 1   # one per bucket
    for t in job.tasks:
        sets = F._size_sets(t.func, t)
        assert len(sets) == 2 and all(set(s) == {"batch"} for s in sets) and sets[0] != sets[1], sets
    assert [ti for ti, _, _ in job.candidates] == list(range(len(job.tasks)))     # each bucket's default
    for ci in range(len(job.candidates)):
        assert job.run(ci)["kind"] == "ok"


def test_command_line_writes_the_report(tmp_path):
    out = tmp_path / "fuzz.json"
    rc = F.main(["--cases", "gemv", "--targets", "haswell", "--samples", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["failures"] == [], report
    assert report["summary"] == {"cpu.matmul_epilogue": {"haswell": {"ok": 2}}}


def test_unknown_case_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        F.main(["--cases", "no_such_case"])
    assert "no_such_case" in capsys.readouterr().err


def test_replay_reruns_only_the_failed_candidates(tmp_path):
    """--replay: the candidates a report lists as failed (by index), nothing else."""
    old = {"settings": {"samples": 1, "cuda_samples": 1, "seed": 0, "families": []},
           "failures": [{"case": "gemv", "target": "haswell", "index": 1, "kind": "numbers"}]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    rc = F.main(["--replay", str(tmp_path / "old.json"), "--json", str(tmp_path / "new.json")])
    report = json.loads((tmp_path / "new.json").read_text())
    assert rc == 0 and report["summary"] == {"cpu.matmul_epilogue": {"haswell": {"ok": 1}}}, report
