"""benchmarks/ab_common.py, the pieces the A/B scripts share: ``--dims`` parsing (bad entries refused by name),
the interleaved timing (every call runs ``repeat`` times a round, in order), the paired median, the JSON
writer (whole file or appended lines) and the common command line.  No timing is asserted."""
import importlib.util
import json
import os

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("ab_common", os.path.join(_ROOT, "benchmarks", "ab_common.py"))
A = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(A)


def test_parse_dims():
    assert A.parse_dims("batch=3,sequence=17") == {"batch": 3, "sequence": 17}
    assert A.parse_dims("") is None
    for bad in ("batch", "batch=x", "=3"):
        with pytest.raises(SystemExit, match=f"bad --dims entry '{bad}'"):
            A.parse_dims(bad)


def test_interleaved_us_runs_each_call_repeat_times_per_round_in_order():
    order = []
    calls = {"a": (lambda x: order.append(("a", x)), [1]), "b": (lambda x: order.append(("b", x)), [2])}
    ticks = iter(range(100))
    ts = A.interleaved_us(calls, rounds=2, repeat=3, clock=lambda: next(ticks))
    assert order == [("a", 1)] * 3 + [("b", 2)] * 3 + [("a", 1)] * 3 + [("b", 2)] * 3
    # the fake clock advances 1 per read: each round's span is 1 tick over 3 calls
    assert ts == {"a": [1 / 3 * 1e6] * 2, "b": [1 / 3 * 1e6] * 2}


def test_paired_median():
    assert A.paired_median([2.0, 3.0, 10.0], [1.0, 3.0, 1.0]) == 2.0
    with pytest.raises(ValueError, match="equally long"):
        A.paired_median([1.0], [1.0, 2.0])


def test_write_json_whole_file_and_lines(tmp_path):
    whole, lines = tmp_path / "w.json", tmp_path / "l.jsonl"
    A.write_json({"x": 1}, str(whole))
    A.write_json({"x": 2}, str(whole))
    assert json.loads(whole.read_text()) == {"x": 2}
    A.write_json({"x": 1}, str(lines), append_line=True)
    A.write_json({"x": 2}, str(lines), append_line=True)
    assert [json.loads(s) for s in lines.read_text().splitlines()] == [{"x": 1}, {"x": 2}]
    A.write_json({"x": 3}, None)        # no path: nothing written, no error


def test_model_parser_and_entry():
    a = A.model_parser("d", rounds=5, number=20).parse_args(["resnet18"])
    assert (a.model, a.rounds, a.number, a.json) == ("resnet18", 5, 20, None)
    with pytest.raises(SystemExit):
        A.model_parser("d").parse_args(["no_such_model"])
    assert A.manifest_entry("resnet18")["name"] == "resnet18"
    with pytest.raises(SystemExit, match="no model 'nope'"):
        A.manifest_entry("nope")


def test_new_old_static_summary():
    ts = {"new": [2.0, 4.0, 3.0], "old": [4.0, 4.0, 6.0], "static": [1.0, 2.0, 2.0]}
    out = A.new_old_static_summary(ts, 1)
    assert out == {"min_us": {"new": 2.0, "old": 4.0, "static": 1.0},
                   "median_us": {"new": 3.0, "old": 4.0, "static": 2.0},
                   "ratio_to_static_min": {"new": 2.0, "old": 4.0},
                   "paired_median_new_over_old": 0.5}
