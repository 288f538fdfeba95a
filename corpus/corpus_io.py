"""Reading the model corpus: its manifest, random inputs for a model, and the error measure used to compare.

numpy and the standard library only: the tests and ``benchmarks/bench_models.py`` load this file by path
(``corpus/`` is not a package that tvmfuse installs). ``make_corpus.py`` writes what this file reads.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

CORPUS_DIR = os.path.dirname(os.path.abspath(__file__))
MANIFEST = os.path.join(CORPUS_DIR, "manifest.json")


# Models the benchmarks run only when named (or with ``--all``): session 8's architectures tvmfuse had not been
# tuned against (benchmarks/notes/corpus8.md).  Their default runs (bench_models.py's table, symbolic_check.py's
# numerics) keep the 13 models and the length they had.
OPT_IN_MODELS = ("regnet_y", "densenet", "swin", "whisper_encoder",
                 # session 9 (benchmarks/notes/corpus9.md)
                 "resnext", "googlenet", "mobilevit", "wav2vec2", "phi", "qwen2",
                 # session 10 (benchmarks/notes/corpus10.md)
                 "opt", "bloom", "albert", "efficientnet_v2", "inception_v3",
                 # session 11 (benchmarks/notes/corpus11.md)
                 "roberta", "deberta_v2", "segformer", "convnextv2", "levit")


# The config fields that bound a token model's ``sequence``: a position table of that many rows (learned
# embeddings: BERT, ALBERT, OPT, RoBERTa ``max_position_embeddings``, GPT-2 ``n_positions``; the rotary models'
# cos/sin cache).  The first field a model's
# config has is its table size.
POSITION_TABLE_FIELDS = ("max_position_embeddings", "n_positions")
# model class -> (config field, added offset, why): the first position id a model reads when it is not 0, so the
# longest legal sequence is the table size minus this offset.
POSITION_OFFSETS = {
    # RoBERTa counts positions from padding_idx + 1 (create_position_ids_from_input_ids): 98 rows, pad 1 -> 96
    # tokens; onnxruntime rejects sequence 128 (Gather idx=98 out of [-98, 97]; benchmarks/notes/symtok12.md)
    "transformers.RobertaModel": ("pad_token_id", 1, "positions count from pad_token_id + 1"),
}


def dim_limits(entry: dict) -> dict[str, dict]:
    """The largest legal size of each symbolic dim the model's config bounds, ``{dim: {"max": n, "why": text}}``
    (empty when none is bounded): ``sequence`` by a learned position table (``POSITION_TABLE_FIELDS``) less the
    first position id (``POSITION_OFFSETS``).  A model without a ``sequence`` dim, or without such a field, has
    no limit here."""
    dims = {d for spec in entry["inputs"] for d in spec["dyn_shape"] if isinstance(d, str)}
    config = entry.get("source", {}).get("config", {})
    field = next((f for f in POSITION_TABLE_FIELDS if f in config), None)
    if "sequence" not in dims or field is None:
        return {}
    rows = int(config[field])
    offset, why = 0, f"{field} {rows}"
    row = POSITION_OFFSETS.get(entry.get("source", {}).get("class", ""))
    if row is not None:
        key, extra, reason = row
        offset = int(config[key]) + extra
        why = f"{field} {rows} - {offset} ({reason}, {key} {config[key]})"
    return {"sequence": {"max": rows - offset, "why": why}}


def default_models(entries) -> list[str]:
    """The corpus models a benchmark runs when none is named: every one but ``OPT_IN_MODELS``."""
    return [n for n in entries if n not in OPT_IN_MODELS]


def load_manifest(path: str = MANIFEST) -> dict:
    """The manifest: ``{"models": [entry, ...], ...}``; see ``make_corpus.py`` for an entry's fields."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def model_path(entry: dict, variant: str = "static") -> str:
    """Absolute path of a model's ``static`` (``<name>.onnx``) or ``dynamic`` (``<name>_dyn.onnx``) file."""
    if variant not in entry["files"]:
        raise KeyError(f"model {entry['name']!r} has no {variant!r} variant; it has {sorted(entry['files'])}")
    return os.path.join(CORPUS_DIR, entry["files"][variant]["path"])


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def random_feeds(entry: dict, rng: np.random.Generator, dims: dict | None = None) -> dict[str, np.ndarray]:
    """Fresh random inputs for a model: float inputs standard normal, integer inputs uniform in their
    manifest ``int_range`` [low, high) (token ids stay inside the vocabulary).

    ``dims`` gives a size for each symbolic dimension name (``batch``, ``sequence``) of the dynamic
    variant; without it the static shapes are used.
    """
    feeds = {}
    for spec in entry["inputs"]:
        shape = spec["shape"] if dims is None else [dims[d] if isinstance(d, str) else d
                                                     for d in spec["dyn_shape"]]
        dtype = np.dtype(spec["dtype"])
        if np.issubdtype(dtype, np.integer):
            low, high = spec["int_range"]
            feeds[spec["name"]] = rng.integers(low, high, size=shape, dtype=dtype)
        else:
            feeds[spec["name"]] = rng.standard_normal(shape).astype(dtype)
    return feeds


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max |expected|, over one whole output tensor.

    Normalising by the output's largest magnitude (not element by element) keeps entries near zero from
    blowing the measure up; an all-zero expected output falls back to the absolute error.
    """
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {a.shape} vs expected {b.shape}")
    if a.size == 0:
        return 0.0
    if not np.all(np.isfinite(a)):
        return float("inf")
    scale = float(np.max(np.abs(b)))
    err = float(np.max(np.abs(a - b)))
    return err / scale if scale > 0 else err
