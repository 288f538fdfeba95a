"""benchmarks/bench_models.py without timing anything: which engines a command runs, how a skipped engine
shows in the table and in the pass/fail verdict, and that every engine the help names is one it runs."""
import importlib.util
import os

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bench_models", os.path.join(_ROOT, "benchmarks", "bench_models.py"))
B = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(B)


def test_default_engines_stay_the_three_of_the_timed_table():
    """The 13-model table keeps its time slot: the opt-in engines never run unless named."""
    assert B.parse_engines(None) == ["tvmfuse", "ort", "ort_nospin"]
    assert B.parse_engines(None, attention=True) == ["tvmfuse", "tvmfuse_noattn", "ort"]
    assert not set(B.OPT_IN_ENGINES) & set(B.parse_engines(None))
    assert {"tvm_dlight", "torch_compile"} <= set(B.OPT_IN_ENGINES)


@pytest.mark.parametrize("given, expected", [
    (["tvmfuse", "ort", "tvm_dlight"], ["tvmfuse", "ort", "tvm_dlight"]),
    (["tvmfuse,ort", "torch_compile"], ["tvmfuse", "ort", "torch_compile"]),     # comma-separated too
    (["ort", "tvmfuse", "ort"], ["ort", "tvmfuse"]),                            # each once, first place kept
])
def test_engine_lists_parse_in_order(given, expected):
    assert B.parse_engines(given) == expected


@pytest.mark.parametrize("given, match", [(["tvmfuse", "tvm"], "unknown engine 'tvm'"),
                                          ([","], "names no engine")])
def test_a_bad_engine_list_is_refused_naming_the_cause(given, match):
    with pytest.raises(ValueError, match=match) as e:
        B.parse_engines(given)
    assert "tvm_dlight" in str(e.value)          # the known engines are listed


def test_bad_engine_on_the_command_line_exits_with_the_message(capsys):
    with pytest.raises(SystemExit) as e:
        B.main(["--engines", "tvmfuse", "onnxruntime", "--models", "bert"])
    assert e.value.code == 2
    assert "unknown engine 'onnxruntime'" in capsys.readouterr().err


def test_help_describes_every_engine():
    for engine in B.ALL_ENGINES:
        assert f"  {engine} " in B.__doc__, engine


def _row(ms, correct=True):
    return {"median_ms": ms, "p25_ms": ms, "p75_ms": ms, "correct": correct}


def test_a_skipped_engine_is_shown_with_its_reason_and_is_no_failure():
    results = [{"model": "bert", "engines": {
        "tvmfuse": {**_row(1.0), "kernels_before": 80, "kernels": 16, "unscheduled": [], "compile_s": 1.0},
        "ort": _row(2.0), "torch_compile": {"skipped": "torch does not import in py (No module named 'torch')"}}}]
    table = B._table(results, ["tvmfuse", "ort", "torch_compile"])
    line = next(ln for ln in table.splitlines() if ln.startswith("bert"))
    assert "skipped" in line and line.rstrip().endswith("ok") and "2.00x" in line
    assert "bert torch_compile: torch does not import" in table
    assert all(B._passed(r) for r in results[0]["engines"].values())


def test_a_mismatch_or_an_error_fails_the_row():
    results = [{"model": "vit", "engines": {"ort": _row(2.0), "tvm_dlight": _row(3.0, correct=False),
                                            "torch_compile": {"error": "RuntimeError: exited"}}}]
    table = B._table(results, ["ort", "tvm_dlight", "torch_compile"])
    assert "MISMATCH/ERROR tvm_dlight, torch_compile" in table
    assert not B._passed(results[0]["engines"]["tvm_dlight"]) and not B._passed(results[0]["engines"]["torch_compile"])


def test_torch_compile_without_torch_is_skipped_with_the_reason(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)            # `import torch` raises ImportError
    entry = {e["name"]: e for e in B.corpus_io.load_manifest()["models"]}["resnet18"]
    with pytest.raises(B.EngineSkipped, match="torch does not import in .*--torch-python"):
        B._torch_runner(entry, None)


def test_a_skipping_worker_process_reports_its_reason(tmp_path):
    """The driver side: a worker that says "skipped" becomes EngineSkipped, not an error (its interpreter
    here is told that torch is missing, whether or not it has torch)."""
    import sys

    fake = tmp_path / "python_without_torch"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -c \"import runpy, sys; sys.modules['torch'] = None; "
                    f"sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')\" \"$@\"\n")
    fake.chmod(0o755)
    with pytest.raises(B.EngineSkipped, match="torch does not import"):
        B.Worker(os.path.join(_ROOT, "benchmarks", "bench_models.py"), "torch_compile",
                 ["--models", "resnet18", "--seed", "0", "--out-npz", str(tmp_path / "o.npz")], python=str(fake))


def test_the_opt_in_engines_get_a_ratio_to_tvmfuse():
    results = [{"model": "bert", "engines": {
        "tvmfuse": {**_row(0.5), "kernels_before": 80, "kernels": 16, "unscheduled": [], "compile_s": 1.0},
        "ort": _row(1.0), "tvm_dlight": _row(20.0), "torch_compile": _row(2.0)}}]
    head, _, line = B._table(results, ["tvmfuse", "ort", "tvm_dlight", "torch_compile"]).splitlines()[:3]
    assert "tvm_dlight/tvmfuse" in head and "torch_compile/tvmfuse" in head
    assert line.split()[-7:-3] == ["2.00x", "40.00x", "4.00x", "80->16"]


def test_default_models_leave_the_opt_in_ones_out():
    """The default table keeps its 13 models (and its time slot); session 8's unseen architectures are in the
    manifest and run when named (``--models swin``)."""
    entries = {e["name"]: e for e in B.corpus_io.load_manifest()["models"]}
    default = B.corpus_io.default_models(entries)
    assert len(default) == 13 and not set(default) & set(B.corpus_io.OPT_IN_MODELS)
    assert set(B.corpus_io.OPT_IN_MODELS) <= set(entries)
    assert set(default) | set(B.corpus_io.OPT_IN_MODELS) == set(entries)


def test_an_unknown_model_is_refused_naming_the_corpus(capsys):
    with pytest.raises(SystemExit) as e:
        B.main(["--models", "swin_t"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown model(s) ['swin_t']" in err and "'swin'" in err


def test_worker_close_kills_a_worker_that_does_not_quit(monkeypatch, capsys):
    """A worker whose exit after "quit" outlasts WORKER_EXIT_TIMEOUT_S is killed, not left to fail the run."""
    import subprocess
    import sys

    monkeypatch.setattr(B, "WORKER_EXIT_TIMEOUT_S", 0.5)
    w = object.__new__(B.Worker)
    w.engine = "stuck"
    w.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.PIPE, text=True)
    w.close()
    assert w.proc.returncode is not None and w.proc.returncode != 0
    assert "stuck worker" in capsys.readouterr().err
