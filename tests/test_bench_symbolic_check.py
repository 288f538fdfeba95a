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
