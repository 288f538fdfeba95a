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


def test_table_7_rows_from_an_export_bench_json(tmp_path, monkeypatch):
    """Table 7 (no committed run yet) from a JSON as export_bench.py writes it: median [min-max] per form."""
    row = {"model": "resnet_block", "form": "tar", "bytes": 61400, "check": "pass", "max_abs_error": 1e-6}
    for k, v in {"import_s": 2.5, "load_s": 0.0183, "first_run_s": 0.0047, "run_s": 2.2e-5}.items():
        row[k], row[k + "_range"] = v, [v * 0.5, v * 2]
    path = tmp_path / "export_bench.json"
    path.write_text(json.dumps({"date": "d", "command": "c", "rows": [row]}))
    monkeypatch.setitem(R.JSON_OVERRIDE, "7", str(path))
    lines = R.table_7()
    assert "| resnet_block | tar | 61.4 | 2.50 [1.25-5.00] | 18.3 [9.2-36.6] | 4.70 [2.35-9.40] | 0.022 [0.011-0.044] " \
           "| pass |" in lines, lines


def test_table_1_names_failed_checks_and_skipped_engines(tmp_path, monkeypatch):
    ms = {"median": 2.0, "p25": 1.5, "p75": 2.5}
    d = {"date": "d", "command": "c", "engines": {"onnx_reference": "", "ort_default": "", "torch_compile": "",
                                                  "tvmfuse": ""},
         "rows": [{"workload": "w", "engines": {"onnx_reference": {"check": "pass"},
                                                "ort_default": {"ms": ms, "check": "pass"},
                                                "torch_compile": {"skipped": "no torch"},
                                                "tvmfuse": {"ms": {**ms, "median": 1.0}, "check": "FAIL"}}}]}
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(d))
    monkeypatch.setitem(R.JSON_OVERRIDE, "1", str(path))
    lines = R.table_1()
    assert "| w | 2.000 [1.500-2.500] | - | 1.000 [1.500-2.500] | FAIL: tvmfuse | 2.00x |" in lines, lines
    assert "not run: torch_compile: no torch" in lines


def test_table_5_prints_errors_and_the_warm_start_picks(tmp_path, monkeypatch):
    t = {"median_s": 1e-3, "wall_s": 10.0}
    study = {"pieces": [{"date": "d", "command": "c"}],
             "workloads": {"mm": {"shape": {"m": 8}, "seeds": {"0": {"error": "RuntimeError: boom", "budgets": {}}}},
                           "conv": {"shape": {"c": 8}, "skipped": "no kernel matches"}},
             "transfer": {"mm": {"shape": {"m": 8}, "sources": [{"m": 4}], "source_trials": 64, "seeds": {"0": {
                 "default": {"median_s": 2e-3},
                 "budgets": {"64": {"without_records": t, "with_records": {"error": "x", "wall_s": 12.0}}}}}}}}
    path = tmp_path / "study.json"
    path.write_text(json.dumps(study))
    monkeypatch.setitem(R.JSON_OVERRIDE, "5", str(path))
    lines = R.table_5()
    assert "workload mm 8, seed 0: error: RuntimeError: boom" in lines
    assert "workload conv: skipped: no kernel matches" in lines
    assert "| default | 2.00 | | | |" in lines and "| 64 | 1.00 | error | 10 | 12 |" in lines, lines


def test_tables_3_and_10_add_the_paired_columns_only_when_the_json_has_them(tmp_path, monkeypatch):
    """Session 10's JSON fields (Table 10's paired per-round ratio, Table 3's run() on the VM's own tensors)
    become columns; a JSON without them keeps the old layout (older files stay readable)."""
    monkeypatch.setattr(R, "HERE", str(tmp_path))
    p = {"median": 1.01, "ci": [0.99, 1.03]}
    size = {"dims": {"batch": 1}, "ratio": 1.25, "dyn_ms": 0.125, "static_ms": 0.1, "pinned_kernels": 7}
    sym = {"rounds": 3, "repeat": 2, "thread_time": False, "shape_bounds": None,
           "records": [{"model": "m", "dyn_kernels": 7, "sizes": [dict(size)]}]}
    (tmp_path / "symbolic_check.json").write_text(json.dumps(sym))
    (tmp_path / "bench_cpu_io.json").write_text(json.dumps({"io_paired": {"w": {k: p for k in (
        "run/vm", "run/vm_views", "artifact_run/vm", "artifact_run/vm_views")}}}))
    assert "| m | b1 | 7 / 7 | 0.125 | 0.100 | **1.25** |" in R.table_10()
    assert R.table_3()[-1].count("|") == 6
    sym["records"][0]["sizes"][0].update(ratio_paired_median=1.12, ratio_paired_ci95=[1.05, 1.31])
    (tmp_path / "symbolic_check.json").write_text(json.dumps(sym))
    (tmp_path / "bench_cpu_io.json").write_text(json.dumps({"io_paired": {"w": {k: p for k in (
        "run/vm", "run/vm_views", "artifact_run/vm", "artifact_run/vm_views", "run_same/vm",
        "artifact_run_same/vm")}}}))
    assert "| m | b1 | 7 / 7 | 0.125 | 0.100 | **1.25** | 1.12 [1.05-1.31] |" in R.table_10()
    assert R.table_3()[-1].count("|") == 8 and R.table_3()[-1].endswith("| 1.010 [0.990-1.030] |")
