"""The attention rule on exported transformers (issue 14): one attention kernel per attention layer in the
BERT-, GPT-2- and Llama-style models of the corpus, correct vs onnxruntime, and ``tvmfuse explain`` naming
the pattern; the forms those exports use (PyTorch SDPA: ``where(isnan(P), 0, P)`` and the scale split
over Q and K) on small synthetic chains; ``PipelineOptions.attention=False`` as the unfused baseline.

The number of attention layers of a model is its number of ONNX ``Softmax`` nodes (each of these models
has a softmax in attention only).
"""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmfuse
from tvmfuse import models as M
from tvmfuse.explain_cli import explain
from tvmfuse.schedules.cpu.attention import ATTR, AttentionSpec

from conftest import compile_shared, reference_outputs_f64

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("corpus_io", os.path.join(ROOT, "corpus", "corpus_io.py"))
corpus_io = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(corpus_io)
ENTRIES = {e["name"]: e for e in corpus_io.load_manifest()["models"]}
_bspec = importlib.util.spec_from_file_location("bench_attention",
                                                os.path.join(ROOT, "benchmarks", "bench_attention.py"))
bench_attention = importlib.util.module_from_spec(_bspec)
_bspec.loader.exec_module(bench_attention)

# vit: its softmax reaches P @ V through two float -> float casts; t5_encoder: its scores + position bias
# through one before the softmax (no scale)
MODELS = ("bert", "gpt2", "llama", "vit", "t5_encoder")
# compiled and run here (vit's compile alone is ~40 s under load: its attention kernels are counted by the
# explain test below, its numerics by tests/test_corpus.py)
KERNEL_MODELS = ("bert", "gpt2", "llama", "t5_encoder")
REL_TOL = 1e-4          # the corpus target (as tests/test_corpus.py)
RTOL, ATOL = 1e-4, 1e-5
SKYLAKE = tvmfuse.parse_target({"kind": "llvm", "mcpu": "skylake-avx512", "mtriple": "x86_64-linux-gnu",
                                "num-cores": 2})
F = TensorProto.FLOAT


def _softmax_count(path) -> int:
    return sum(n.op_type == "Softmax" for n in onnx.load(path).graph.node)


def _attention_kernels(module) -> list:
    return [f for f in module.functions.values()
            if isinstance(f, tvmfuse._compat.PrimFunc) and f.attrs is not None and ATTR in f.attrs]


# ------------------------------------------------------------------------------ corpus models
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", KERNEL_MODELS)
def test_corpus_model_has_one_attention_kernel_per_layer(name, rng):
    ort = pytest.importorskip("onnxruntime")
    entry = ENTRIES[name]
    path = corpus_io.model_path(entry, "static")
    layers = _softmax_count(path)
    config = entry["source"]["config"]
    assert layers == next(config[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if k in config)
    cm = compile_shared(path)
    groups = [g for g in cm.report.groups if g["rule"] == "attention"]
    assert len(groups) == layers, (cm.report.groups, cm.report.refused)
    # identical layers may share one PrimFunc: count the kernel calls, each to an attention PrimFunc
    names = {str(gv.name_hint) for gv, f in cm.fused_module.functions.items()
             if isinstance(f, tvmfuse._compat.PrimFunc) and f.attrs is not None and ATTR in f.attrs}
    assert sum(n in names for n in cm.report.after.kernel_names) == layers, cm.report.after.kernel_names
    assert {s["template"] for s in cm.report.schedules if s["kernel"] in names} == {"cpu.attention"}
    assert not any(r.get("rule") == "attention" for r in cm.report.refused), cm.report.refused
    feeds = corpus_io.random_feeds(entry, rng)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    want = dict(zip(entry["outputs"], sess.run(entry["outputs"], feeds)))
    got = cm.run(feeds)
    for out, w in want.items():
        err = corpus_io.relative_error(got[out], w)
        assert err <= REL_TOL, f"{name} output {out}: relative error {err:.3g}"


@pytest.mark.parametrize("name", MODELS)
def test_explain_names_the_attention_pattern(name):
    path = corpus_io.model_path(ENTRIES[name], "static")
    d = explain(path, SKYLAKE)
    groups = [g for g in d["groups"] if g["rule"] == "attention"]
    assert len(groups) == _softmax_count(path)
    assert all(g["ops"][:3] == ["matmul", "softmax", "matmul"] for g in groups), groups
    assert not [r for r in d["refused"] if r.get("rule") == "attention"], d["refused"]


def test_explain_cli_prints_the_attention_rule():
    path = corpus_io.model_path(ENTRIES["gpt2"], "static")
    res = subprocess.run([sys.executable, "-m", "tvmfuse", "explain", path], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if "[attention]" in ln]
    assert len(lines) == 2 and all("matmul + softmax + matmul" in ln for ln in lines), res.stdout


# ------------------------------------------------------------------------------ SDPA export forms
def _sdpa_chain(b=1, h=2, s=19, d=8, mask="causal"):
    """(Q * c) @ (K^T * c) + mask -> Softmax -> Where(IsNaN(P), 0, P) @ V, as torch's SDPA exports it."""
    c = np.float32(1 / np.sqrt(np.sqrt(d)))
    inits = [numpy_helper.from_array(np.array([c], np.float32), "c"),
             numpy_helper.from_array(np.array([0.0], np.float32), "zero")]
    inputs = [("q", [b, h, s, d]), ("k", [b, h, s, d]), ("v", [b, h, s, d])]
    if mask == "causal":
        m = np.where(np.arange(s)[None] <= np.arange(s)[:, None], 0, -np.inf).astype(np.float32)
        inits.append(numpy_helper.from_array(m.reshape(1, 1, s, s), "mask"))
    else:
        inputs.append(("mask", [b, 1, s, s]))
    nodes = [helper.make_node("Mul", ["q", "c"], ["qs"]),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("Mul", ["kt", "c"], ["kts"]),
             helper.make_node("MatMul", ["qs", "kts"], ["x"]),
             helper.make_node("Add", ["x", "mask"], ["xm"]),
             helper.make_node("Softmax", ["xm"], ["p"], axis=-1),
             helper.make_node("IsNaN", ["p"], ["nan"]),
             helper.make_node("Where", ["nan", "zero", "p"], ["pz"]),
             helper.make_node("MatMul", ["pz", "v"], ["y"])]
    g = helper.make_graph(nodes, "sdpa", [helper.make_tensor_value_info(n, F, sh) for n, sh in inputs],
                          [helper.make_tensor_value_info("y", F, [b, h, s, d])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _feeds(model, rng):
    return {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in M.random_feeds(model).items()}


def test_sdpa_form_is_one_kernel_with_the_scale_folded(host, rng):
    model = _sdpa_chain()
    cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 1, (cm.report.after.kernel_names, cm.report.refused)
    (func,) = _attention_kernels(cm.fused_module)
    spec = AttentionSpec.from_json(str(func.attrs[ATTR]))
    assert spec.causal_offset == 0 and spec.mask is None and spec.zero_empty_rows
    assert spec.scale == pytest.approx(1 / np.sqrt(8), rel=1e-6)
    feeds = _feeds(model, rng)
    np.testing.assert_allclose(cm.run(feeds)["y"], reference_outputs_f64(model, feeds)["y"], rtol=RTOL, atol=ATOL)


def test_sdpa_form_fully_masked_row_gives_zero(host, rng):
    """where(isnan(P), 0, P) @ V: a row whose logits are all -inf is 0 (the reference's NaN row, zeroed)."""
    model = _sdpa_chain(mask="input")
    cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 1, (cm.report.after.kernel_names, cm.report.refused)
    feeds = _feeds(model, rng)
    feeds["mask"][0, 0, 3, :] = -np.inf
    feeds["mask"][0, 0, 7, 2:] = -np.inf
    ref = reference_outputs_f64(model, feeds)["y"]
    out = cm.run(feeds)["y"]
    assert (ref[0, :, 3] == 0).all() and (out[0, :, 3] == 0).all()
    np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL)


def test_nan_test_read_elsewhere_is_refused(host):
    model = _sdpa_chain()
    model.graph.output.append(helper.make_tensor_value_info("nan", TensorProto.BOOL, [1, 2, 19, 19]))
    d = explain(model, host)
    assert not [g for g in d["groups"] if g["rule"] == "attention"]
    assert any(r.get("rule") == "attention" and "NaN test" in r["reason"] for r in d["refused"]), d["refused"]


# ------------------------------------------------------------------------------ the unfused baseline
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_option_off_keeps_the_scores_in_memory(causal, host, rng):
    """bench_attention.py's graph: one kernel with the rule; without it (attention=False) several kernels
    and an S x S scores intermediate per head; both match the ONNX reference."""
    seq, heads, dim = 24, 2, 8
    model = bench_attention.attention_model(seq, heads, dim, causal)
    feeds = bench_attention.feeds_for({"seq": seq, "heads": heads, "head_dim": dim}, int(rng.integers(1 << 30)))
    ref = reference_outputs_f64(model, feeds)["y"]
    fused = tvmfuse.compile(model, host)
    off = tvmfuse.compile(model, host, attention=False)
    assert fused.kernel_count == 1 and [g["rule"] for g in fused.report.groups] == ["attention"]
    assert off.kernel_count > 1 and not [g for g in off.report.groups if g["rule"] == "attention"]
    scores = heads * seq * seq * 4
    assert off.report.after.intermediate_bytes >= scores
    assert fused.report.after.intermediate_bytes == 0
    for cm in (fused, off):
        np.testing.assert_allclose(cm.run(feeds)["y"], ref, rtol=RTOL, atol=ATOL)


def test_bench_attention_quick_writes_checked_json(tmp_path):
    """The benchmark's smoke mode (small shapes, 2 rounds): every engine's output checked vs onnxruntime."""
    pytest.importorskip("onnxruntime")
    out = tmp_path / "bench.json"
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_attention.py"), "--quick",
                          "--seqs", "24", "--json", str(out)], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [r["workload"]["name"] for r in doc["results"]] == ["s24", "s24_causal"]
    for r in doc["results"]:
        assert all(e["correct"] for e in r["engines"].values()), r
        assert r["engines"]["tvmfuse"]["attention_groups"] == 1
        assert r["intermediate_bytes_removed_by_attention"] >= r["score_matrix_bytes"]
