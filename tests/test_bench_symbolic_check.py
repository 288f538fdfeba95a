"""benchmarks/symbolic_check.py's timing (Table 10): rounds in alternating order, the paired per-round ratio
and its bootstrap interval.  Fake builds and a fake clock: no compile, no timing."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("symbolic_check_timing",
                                               os.path.join(ROOT, "benchmarks", "symbolic_check.py"))
symbolic_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(symbolic_check)


class _FakeBuild:
    """A CompiledModel stand-in whose calls advance the fake clock by ``cost`` and log the build's name."""

    def __init__(self, name, cost, clock, log):
        self.name, self.cost, self.clock, self.log = name, cost, clock, log

    def _to_device(self, v):
        return (v,)

    def _main(self):
        def call(*_):
            self.clock.t += self.cost
            self.log.append(self.name)
        return call

    def run(self, feeds):
        assert type(feeds) is dict and all(type(v).__name__ == "ndarray" for v in feeds.values())
        self.clock.t += self.cost
        self.log.append(("run", self.name))


class _Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_rounds_alternate_the_builds_order(monkeypatch):
    monkeypatch.setattr(symbolic_check, "cm_inputs", lambda cm, feeds: [0])
    clock, log = _Clock(), []
    builds = {"dyn": _FakeBuild("dyn", 2e-6, clock, log), "static": _FakeBuild("static", 1e-6, clock, log)}
    t = symbolic_check.interleaved_ms(builds, {}, repeat=1, rounds=4, clock=clock, path="vm")
    timed = log[4:]                       # 2 warm-up calls per build first
    assert timed == ["dyn", "static", "static", "dyn", "dyn", "static", "static", "dyn"]
    assert t["dyn"]["rounds_ms"] == pytest.approx([2e-3] * 4) and t["static"]["min_ms"] == pytest.approx(1e-3)
    log.clear()
    symbolic_check.interleaved_ms(builds, {}, repeat=1, rounds=2, clock=clock, alternate=False, path="vm")
    assert log[4:] == ["dyn", "static", "dyn", "static"]


def test_the_default_path_times_run_on_numpy():
    """Table 10 since session 13 times what a user runs: run() on numpy arrays (the fake build's run checks
    it gets a dict of arrays), in the same alternating rounds."""
    import numpy as np

    clock, log = _Clock(), []
    builds = {"dyn": _FakeBuild("dyn", 2e-6, clock, log), "static": _FakeBuild("static", 1e-6, clock, log)}
    t = symbolic_check.interleaved_ms(builds, {"x": np.zeros((2, 3), np.float32)}, repeat=1, rounds=2, clock=clock)
    assert log[4:] == [("run", "dyn"), ("run", "static"), ("run", "static"), ("run", "dyn")]
    assert t["dyn"]["min_ms"] == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="path"):
        symbolic_check.interleaved_ms(builds, {}, repeat=1, rounds=1, clock=clock, path="kernels")


def test_paired_ratio_median_and_interval():
    dyn = [1.10, 1.12, 1.08, 1.11, 1.09, 5.00, 1.10, 1.10, 1.13, 1.07]   # one round hit by a stall
    static = [1.00] * 10
    p = symbolic_check.paired_ratio(dyn, static)
    assert p["median"] == pytest.approx(1.10)
    lo, hi = p["ci"]
    assert 1.07 <= lo <= 1.10 <= hi <= 1.13          # the stalled round does not reach the interval
    assert symbolic_check.paired_ratio(dyn, static) == p  # a fixed seed: the same rounds, the same interval
    wide = symbolic_check.paired_ratio([0.6, 1.6, 0.7, 1.5, 1.0, 0.8, 1.4], [1.0] * 7)
    assert wide["ci"][1] - wide["ci"][0] > hi - lo
    with pytest.raises(ValueError, match="no rounds"):
        symbolic_check.paired_ratio([], [])


def test_isolated_model_runs_in_its_own_process_with_this_runs_options(monkeypatch, tmp_path):
    """--isolate (the default for a --latency run of several models): each model is checked by a fresh
    process of the script, with this run's options, and its record read back."""
    import json
    import subprocess
    import sys

    seen = []

    def fake_run(cmd, capture_output, text, timeout):
        seen.append(cmd)
        out = cmd[cmd.index("--json") + 1]
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"records": [{"model": cmd[2], "ok": True, "sizes": []}]}, f)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    args = symbolic_check.argparse.Namespace(seed=3, path="run", latency=True, thread_time=False, quick=False,
                                             shape_bound=["batch=8"], size=["batch=1,sequence=1"])
    rec = symbolic_check.check_model_isolated("bert", symbolic_check._child_args(args, repeat=5, rounds=7))
    assert rec == {"model": "bert", "ok": True, "sizes": []}
    (cmd,) = seen
    assert cmd[0] == sys.executable and cmd[1].endswith("symbolic_check.py") and cmd[2] == "bert"
    text = " ".join(cmd)
    for part in ("--no-isolate", "--repeat 5", "--rounds 7", "--seed 3", "--path run", "--latency",
                 "--shape-bound batch=8", "--size batch=1,sequence=1"):
        assert part in text, (part, text)
    assert "--thread-time" not in cmd and "--quick" not in cmd


def test_isolated_model_whose_process_dies_or_hangs_is_a_failed_record(monkeypatch):
    import subprocess

    def dies(cmd, capture_output, text, timeout):
        return subprocess.CompletedProcess(cmd, -11, "", "compiling...\nSegmentation fault\n")

    monkeypatch.setattr(subprocess, "run", dies)
    rec = symbolic_check.check_model_isolated("gpt2", [])
    assert rec["model"] == "gpt2" and rec["ok"] is False
    assert "exited -11 without a record" in rec["error"] and "Segmentation fault" in rec["error"]
    assert "gpt2" in symbolic_check._line(rec) and "error" in symbolic_check.latency_table([rec])

    def hangs(cmd, capture_output, text, timeout):
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(subprocess, "run", hangs)
    rec = symbolic_check.check_model_isolated("gpt2", [], timeout_s=5)
    assert rec["ok"] is False and "over 5 s" in rec["error"]
