"""benchmarks/check_readme.py, the README-vs-JSON check: every table it covers is computed from the committed
JSON (so a JSON whose layout changed breaks here, not silently in the README), the figures are the JSON's
(a median recomputed here from the rows), and a README that lacks a row is reported.  No timing."""
import importlib.util
import json
import os
import statistics

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("check_readme", os.path.join(_ROOT, "benchmarks", "check_readme.py"))
R = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(R)


@pytest.mark.parametrize("table", sorted(R.TABLES) + sorted(R.EXTRA))
def test_every_table_is_computed_from_its_json(table):
    lines = {**R.TABLES, **R.EXTRA}[table]()
    rows = [line for line in lines if line.startswith("| ")]
    assert len(rows) >= 2, (table, lines)                # a header and at least one row of figures


def test_table_6_figures_are_the_jsons():
    with open(os.path.join(_ROOT, "benchmarks", "bench_models.json"), encoding="utf-8") as f:
        d = json.load(f)
    r = d["results"][0]
    t = r["engines"]["tvmfuse"]
    assert statistics.median(t["rounds_ms"]) == pytest.approx(t["median_ms"])
    ratio = r["engines"]["ort"]["median_ms"] / t["median_ms"]
    row = next(line for line in R.table_6() if line.startswith(f"| {r['model']} |"))
    assert f"| {t['median_ms']:.3f} [" in row and f"| {ratio:.2f}x |" in row, row


def test_a_readme_without_a_row_is_reported():
    lines = R.table_9()
    rows = [line for line in lines if line.startswith("| ")]
    assert R.missing_rows(rows, lines) == []
    changed = [rows[0]] + [rows[2].replace("x |", "0x |", 1)] + rows[1:2] + rows[3:]
    assert R.missing_rows(changed, lines) == [rows[2]]


def test_a_missing_json_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "HERE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="bench_attention.json"):
        R.table_9()
