"""benchmarks/symbolic_check.py's per-model size limits (issue 13): a dim the model's config bounds (roberta's 98
learned positions counted from pad_token_id + 1 = 2: 96 tokens) is checked at its largest legal size instead of
the issue's (sequence 128), the record says so, and a size onnxruntime rejects is a row error naming the size,
not an uncaught exception.  No compile: the tvmfuse build is a stand-in that runs onnxruntime itself."""
import importlib.util
import os
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("symbolic_check_limits",
                                               os.path.join(ROOT, "benchmarks", "symbolic_check.py"))
symbolic_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(symbolic_check)
corpus_io = symbolic_check.corpus_io
ENTRIES = {e["name"]: e for e in corpus_io.load_manifest()["models"]}


def test_dim_limits_from_the_config():
    roberta = corpus_io.dim_limits(ENTRIES["roberta"])
    assert roberta["sequence"]["max"] == 96                        # 98 rows - (pad_token_id 1 + 1)
    assert "pad_token_id" in roberta["sequence"]["why"] and "98" in roberta["sequence"]["why"]
    assert corpus_io.dim_limits(ENTRIES["bert"])["sequence"]["max"] == 128
    assert corpus_io.dim_limits(ENTRIES["gpt2"])["sequence"]["max"] == 128     # n_positions
    assert corpus_io.dim_limits(ENTRIES["resnet18"]) == {}                       # batch only
    assert corpus_io.dim_limits(ENTRIES["bloom"]) == {}                          # ALiBi: no position table
    # every limit a corpus model has leaves the sizes but roberta's 128 as they are
    for name, entry in ENTRIES.items():
        for dims, capped in symbolic_check.within_limits(entry, symbolic_check.size_points(entry)):
            assert not capped or name == "roberta", (name, dims, capped)


def test_sizes_over_the_limit_are_lowered_and_say_from_what():
    points = symbolic_check.size_points(ENTRIES["roberta"])
    assert {"batch": 1, "sequence": 128} in points
    got = symbolic_check.within_limits(ENTRIES["roberta"], points)
    assert ({"batch": 1, "sequence": 96}, {"sequence": 128}) in got
    assert all(d["sequence"] <= 96 for d, _ in got) and len(got) == len(points)
    assert ({"batch": 3, "sequence": 17}, {}) in got
    # a size the limit makes equal to one already listed is checked once
    dup = symbolic_check.within_limits(ENTRIES["roberta"], [{"batch": 1, "sequence": 96},
                                                            {"batch": 1, "sequence": 128}])
    assert dup == [({"batch": 1, "sequence": 96}, {})]
    bert = symbolic_check.size_points(ENTRIES["bert"])
    assert symbolic_check.within_limits(ENTRIES["bert"], bert) == [(p, {}) for p in bert]


class _OrtBuild:
    """A CompiledModel stand-in for check_model (numerics only): onnxruntime's outputs as its own."""

    def __init__(self, path):
        import onnxruntime as ort

        self.sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        self.kernel_count, self.shape_upper_bounds = 1, {}
        self.report = SimpleNamespace(schedules=[])

    def run(self, feeds):
        names = [o.name for o in self.sess.get_outputs()]
        return dict(zip(names, self.sess.run(names, feeds)))


def _check(entry, points):
    return symbolic_check.check_model(entry, points=points, compile_fn=lambda path, **_: _OrtBuild(path))


def test_roberta_runs_at_its_largest_sequence_and_the_table_says_so():
    pytest.importorskip("onnxruntime")
    rec = _check(ENTRIES["roberta"], [{"batch": 1, "sequence": 128}, {"batch": 2, "sequence": 17}])
    assert rec["dim_limits"]["sequence"]["max"] == 96
    row = rec["sizes"][0]
    assert row["dims"] == {"batch": 1, "sequence": 96} and row["capped_from"] == {"sequence": 128}
    assert row["ok"] and row["rel_err"] == 0.0 and rec["ok"]
    assert "capped_from" not in rec["sizes"][1]
    assert "1x96(for 1x128):" in symbolic_check._line(rec)
    timed = dict(rec, sizes=[dict(row, dyn_ms=1.0, static_ms=1.0, ratio=1.0, pinned_kernels=1)])
    assert "| roberta | batch=1, sequence=96 (for 128) | 1 / 1 |" in symbolic_check.latency_table([timed])


def test_a_size_onnxruntime_rejects_is_a_row_error(monkeypatch):
    """Without the limit (as before this check had one), roberta at sequence 128 makes onnxruntime raise: the
    row records it, naming the size, and the run goes on to the next size."""
    pytest.importorskip("onnxruntime")
    monkeypatch.setattr(corpus_io, "dim_limits", lambda entry: {})
    rec = _check(ENTRIES["roberta"], [{"batch": 1, "sequence": 128}, {"batch": 1, "sequence": 1}])
    bad, good = rec["sizes"]
    assert not bad["ok"] and bad["error"].startswith("onnxruntime rejects batch=1, sequence=128")
    assert "rel_err" not in bad and good["ok"] and not rec["ok"]
    assert "batch=1, sequence=128: onnxruntime rejects" in symbolic_check._line(rec)
    assert "onnxruntime rejects" in symbolic_check.latency_table([rec])


def test_random_feeds_at_the_limit_stay_inside_the_table():
    """The positions roberta reads at its limit: pad_token_id + 1 .. 96 + pad_token_id, all < 98 rows."""
    entry = ENTRIES["roberta"]
    limit = corpus_io.dim_limits(entry)["sequence"]["max"]
    cfg = entry["source"]["config"]
    ids = corpus_io.random_feeds(entry, np.random.default_rng(0), {"batch": 1, "sequence": limit})["input_ids"]
    mask = ids != cfg["pad_token_id"]
    positions = np.cumsum(mask, axis=1) * mask + cfg["pad_token_id"]
    assert positions.max() <= cfg["max_position_embeddings"] - 1
