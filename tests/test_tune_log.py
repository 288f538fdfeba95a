"""Tuning logs: round trip, corrupt and truncated lines, other targets, merge/best/show, best_configs."""
import json
import logging

import pytest

import tvmfuse
from tvmfuse import cli
from tvmfuse.tune import log as L

# a target no x86 host running these tests can be (the host is "this" target of the records)
OTHER = tvmfuse.parse_target({"kind": "llvm", "mcpu": "neoverse-n1", "mtriple": "aarch64-linux-gnu"})


def _rec(target, wk="aaaa", cfg=None, costs=(1e-3, 1.1e-3), error=None):
    return L.make_measure_record(target=target, workload_key=wk, workload={"name": f"k_{wk}", "params": []},
                                 template="test.family", config=cfg or {"x": 1},
                                 costs=list(costs) if error is None else None, error=error)


def _write(path, recs):
    with L.LogWriter(path) as w:
        for r in recs:
            w.write(r)


def test_round_trip_and_versioning(tmp_path, host):
    p = tmp_path / "a.jsonl"
    recs = [_rec(host, cfg={"x": 1}, costs=[2e-3]), _rec(host, cfg={"x": 2}, costs=[1e-3, 3e-3, 1.5e-3]),
            _rec(host, cfg={"x": 3}, error={"kind": "timeout", "message": "no result within 1 s"})]
    _write(p, recs)
    tl = L.load(p, host)
    assert [r["config"] for r in tl.measures] == [{"x": 1}, {"x": 2}, {"x": 3}]
    r0 = tl.measures[0]
    assert r0["tvmfuse"] == tvmfuse.__version__ and r0["tvm"].startswith("0.27")
    assert r0["target"]["kind"] == "llvm" and r0["target_key"].startswith("llvm")
    best = tl.best()["aaaa"]
    assert best["config"] == {"x": 2} and L.median_cost(best) == pytest.approx(1.5e-3)
    assert set(tl.measured("aaaa")) == {L.config_id({"x": i}) for i in (1, 2, 3)}


def test_record_needs_costs_or_error(host):
    with pytest.raises(ValueError):
        L.make_measure_record(target=host, workload_key="a", workload={}, template="t", config={}, costs=None)
    with pytest.raises(ValueError):
        L.make_measure_record(target=host, workload_key="a", workload={}, template="t", config={},
                              error={"kind": "made-up", "message": ""})


def test_corrupt_and_truncated_lines_are_skipped_with_their_line(tmp_path, host, caplog):
    p = tmp_path / "c.jsonl"
    _write(p, [_rec(host, cfg={"x": 1})])
    with open(p, "a") as f:
        f.write("{this is not json\n")
        f.write(json.dumps({"type": "measure", "workload_key": "b"}) + "\n")   # fields missing
    _write(p, [_rec(host, cfg={"x": 2})])
    full = json.dumps(_rec(host, cfg={"x": 3}))
    with open(p, "a") as f:
        f.write(full[: len(full) // 2])                                        # killed mid-write
    with caplog.at_level(logging.WARNING, logger="tvmfuse.tune"):
        tl = L.load(p, host)
    assert [r["config"]["x"] for r in tl.measures] == [1, 2]
    msgs = [m for m in caplog.messages if "corrupt" in m]
    assert any(f"{p}:2:" in m and "not valid JSON" in m for m in msgs), msgs
    assert any(f"{p}:3:" in m and "missing field" in m for m in msgs), msgs
    assert any(f"{p}:5:" in m for m in msgs), msgs
    assert len(tl.skipped) == 3
    # appending after a truncated line starts a fresh line: the new record is readable
    _write(p, [_rec(host, cfg={"x": 4})])
    assert [r["config"]["x"] for r in L.load(p, host).measures] == [1, 2, 4]


def test_other_targets_ignored_unless_asked(tmp_path, host):
    p = tmp_path / "t.jsonl"
    _write(p, [_rec(host, cfg={"x": 1}), _rec(OTHER, cfg={"x": 2}, costs=[1e-6])])
    tl = L.load(p, host)
    assert [r["config"] for r in tl.measures] == [{"x": 1}] and tl.other_targets == 1
    assert len(L.load(p, host, all_targets=True).measures) == 2
    assert L.best_configs(str(p), host)["aaaa"]["config"] == {"x": 1}
    assert L.best_configs(str(p), OTHER)["aaaa"]["config"] == {"x": 2}


def test_missing_log_is_a_clear_error(tmp_path, host):
    with pytest.raises(tvmfuse.TuningLogError, match="not found"):
        L.best_configs(str(tmp_path / "nope.jsonl"), host)


def test_logs_merge_best_show_cli(tmp_path, host, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _write(a, [_rec(host, "w1", {"x": 1}, [3e-3]), _rec(host, "w1", {"x": 2}, [2e-3]),
               _rec(host, "w2", {"x": 1}, error={"kind": "crash", "message": "SIGSEGV"})])
    _write(b, [_rec(host, "w1", {"x": 3}, [1e-3]), _rec(OTHER, "w1", {"x": 4}, [5e-4]),
               _rec(host, "w2", {"x": 2}, [4e-3])])
    with open(b, "a") as f:
        f.write("garbage\n")
    m = tmp_path / "m.jsonl"
    assert cli.main(["logs", "merge", str(a), str(b), "-o", str(m)]) == 0
    assert len(L.load(m, all_targets=True).measures) == 6
    assert "1 unreadable line" in capsys.readouterr().out
    bst = tmp_path / "best.jsonl"
    assert cli.main(["logs", "best", str(m), "-o", str(bst)]) == 0
    recs = L.load(bst, all_targets=True).measures
    got = {(r["workload_key"], r["target_key"]): r["config"]["x"] for r in recs}
    assert got == {("w1", L.load(a, host).measures[0]["target_key"]): 3,
                   ("w1", recs[0]["target_key"] if recs[0]["target"]["mcpu"] != host.attrs["mcpu"]
                    else recs[1]["target_key"]): 4,
                   ("w2", L.load(a, host).measures[0]["target_key"]): 2}
    capsys.readouterr()
    assert cli.main(["logs", "show", str(m)]) == 0
    out = capsys.readouterr().out
    assert "k_w1" in out and "k_w2" in out and "1 ms" in out and "neoverse-n1" in out
    assert cli.main(["logs", "show", str(m), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    w2 = next(r for r in rows if r["workload_key"] == "w2")
    assert w2["trials"] == 2 and w2["errors"] == {"crash": 1} and w2["best"] == pytest.approx(4e-3)
    assert cli.main(["logs", "show", str(tmp_path / "missing.jsonl")]) == 2
