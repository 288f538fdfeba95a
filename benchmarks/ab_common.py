"""What the whole-model A/B and profiling scripts in ``benchmarks/`` share (folded from copies in
``model_knob_ab.py``, ``rule_ab.py``, ``conv1d_ab.py``, ``sequence_replay.py``, ``symbolic_commit_ab.py`` and
``symbolic_paired_ab.py``): the corpus loader, the common command line of a corpus-model script, the model's
random inputs, the interleaved timing of back-to-back VM calls, and writing the result as JSON.

Imported by path from the scripts' folder (``sys.path`` has it when a script runs as ``python benchmarks/x.py``;
the tests load the scripts with ``importlib``, which runs the same ``sys.path.insert``).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_module(name: str, path: str):
    """The Python file ``path`` imported as module ``name`` (the corpus tools are not a package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise ImportError(f"no Python module at {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


corpus_io = load_module("corpus_io", os.path.join(ROOT, "corpus", "corpus_io.py"))


def parse_dims(text: str) -> dict[str, int] | None:
    """``"batch=3,sequence=17"`` -> ``{"batch": 3, "sequence": 17}``; ``""`` -> None."""
    dims = {}
    for part in (p for p in text.split(",") if p):
        name, sep, value = part.partition("=")
        if not sep or not name or not value.strip().lstrip("-").isdigit():
            raise SystemExit(f"bad --dims entry {part!r}: want name=integer, e.g. batch=3,sequence=17")
        dims[name.strip()] = int(value)
    return dims or None


def model_parser(description: str, rounds: int = 15, number: int = 40,
                 json_help: str = "write the result to this JSON file",
                 model_optional: bool = False) -> argparse.ArgumentParser:
    """The command line every corpus-model A/B script starts from: the model (a manifest name), ``--rounds``,
    ``--number`` (calls per timed round) and ``--json``; a script adds its own options to it (``model_optional``:
    the model may be left out, for a script that offers another source of its model)."""
    names = [e["name"] for e in corpus_io.load_manifest()["models"]]
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("model", choices=names, nargs="?" if model_optional else None)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--number", type=int, default=number, help="calls per timed round")
    ap.add_argument("--json", help=json_help)
    return ap


def manifest_entry(name: str) -> dict:
    """The corpus manifest's entry of model ``name``."""
    entries = {e["name"]: e for e in corpus_io.load_manifest()["models"]}
    if name not in entries:
        raise SystemExit(f"no model {name!r} in the corpus manifest; it has {sorted(entries)}")
    return entries[name]


def one_thread_model(name: str, variant: str = "static", dims: dict | None = None) -> tuple[dict, str]:
    """(random feeds with seed 0, model file) of a corpus model, with ``TVM_NUM_THREADS`` defaulted to 1 first
    (before TVM starts its thread pool) so the kernels run on the calling, timed thread."""
    os.environ.setdefault("TVM_NUM_THREADS", "1")
    entry = manifest_entry(name)
    return corpus_io.random_feeds(entry, np.random.default_rng(0), dims), corpus_io.model_path(entry, variant)


def vm_calls(builds: dict, feeds: dict, warmup: int = 2) -> dict:
    """Per build name, ``(main, args)``: the compiled ``main`` and the inputs placed on its device once, so a
    timed call is the VM call alone; each called ``warmup`` times."""
    from tvmfuse.io import validate_feeds

    calls = {}
    for n, cm in builds.items():
        args = [cm._to_device(v)[0] for v in validate_feeds(feeds, cm.inputs, cm.shape_upper_bounds)]
        f = cm._main()
        for _ in range(warmup):
            f(*args)
        calls[n] = (f, args)
    return calls


def interleaved_us(calls: dict, rounds: int, repeat: int, clock=time.perf_counter) -> dict[str, list[float]]:
    """Per call name, the microseconds per call of each of ``rounds`` rounds; in a round every call runs
    ``repeat`` times back to back, one call after the other."""
    ts = {n: [] for n in calls}
    for _ in range(rounds):
        for n, (f, args) in calls.items():
            t0 = clock()
            for _ in range(repeat):
                f(*args)
            ts[n].append((clock() - t0) / repeat * 1e6)
    return ts


def paired_median(a: list[float], b: list[float]) -> float:
    """The median of the per-round ratios ``a / b`` (rounded to 3 places)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired rounds need two equally long, non-empty series (got {len(a)} and {len(b)})")
    return round(float(np.median(np.array(a) / np.array(b))), 3)


def new_old_static_summary(ts: dict[str, list[float]], digits: int) -> dict:
    """The figures of a new / old / static timing (``interleaved_us`` of those three): min and median per
    build (``digits`` places), new's and old's min over static's, and the paired median new / old."""
    return {"min_us": {n: round(min(t), digits) for n, t in ts.items()},
            "median_us": {n: round(float(np.median(t)), digits) for n, t in ts.items()},
            "ratio_to_static_min": {n: round(min(ts[n]) / min(ts["static"]), 3) for n in ("new", "old")},
            "paired_median_new_over_old": paired_median(ts["new"], ts["old"])}


def write_json(out: dict, path: str | None, append_line: bool = False) -> None:
    """``out`` to ``path`` (nothing without one): the whole file, indented, or one line appended to it."""
    if not path:
        return
    if append_line:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(out) + "\n")
    else:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
