"""Kernel-only A/B of a static kernel's default config against config overrides, on a corpus model pinned to
sizes (the static build's kernels of Table 10): each kernel of the chosen template families scheduled with its
template's default and with each ``--set`` override, built for ``--target`` (default: the host with one core),
timed interleaved on the calling thread's CPU time (``time.thread_time``; run with TVM_NUM_THREADS=1), min of
rounds.  Every variant's outputs are compared with the default's.  Output: JSON lines.

    TVM_NUM_THREADS=1 PYTHONPATH=. python benchmarks/static_kernel_ab.py llama --dims batch=8,sequence=17 \
        --family cpu.norm_matmul --set mr=4 --set mr=8,mc_tiles=1
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import schedule_cases as S  # noqa: E402

import tvmfuse  # noqa: E402
from tvmfuse import _compat as C  # noqa: E402
from tvmfuse import fastmath  # noqa: E402
from tvmfuse.pipeline import PipelineOptions, graph_stage  # noqa: E402
from tvmfuse.schedules import templates_for  # noqa: E402
from tvmfuse.schedules.base import find_template, schedule_with  # noqa: E402

_spec = importlib.util.spec_from_file_location("corpus_io", os.path.join(ROOT, "corpus", "corpus_io.py"))
corpus_io = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(corpus_io)


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _override(text: str) -> dict:
    """``mr=4,order=ij`` -> {"mr": 4, "order": "ij"}."""
    out = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep:
            raise SystemExit(f"--set {text!r}: expected KNOB=VALUE[,KNOB=VALUE...]")
        out[name.strip()] = _value(value.strip())
    return out


def _dims(text: str) -> dict:
    out = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        out[name.strip()] = int(value)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--dims", required=True, help="sizes the symbolic dims are pinned to: batch=8,sequence=17")
    ap.add_argument("--family", action="append", default=[], help="template families to time (default: all)")
    ap.add_argument("--kernel", action="append", default=[], help="only kernels whose name contains this")
    ap.add_argument("--set", action="append", default=[], help="config override KNOB=VALUE[,...] (repeatable)")
    ap.add_argument("--target", default=None, help="build target (default: the host, its cores)")
    ap.add_argument("--no-fast-math", action="store_true", help="leave exp/sigmoid/tanh as TVM lowers them")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args(argv)
    target = tvmfuse.parse_target(a.target) if a.target else tvmfuse.host_target()
    entry = {e["name"]: e for e in corpus_io.load_manifest()["models"]}[a.model]
    mod = tvmfuse.load_onnx(corpus_io.model_path(entry, "dynamic"), input_shapes=_dims(a.dims))
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions()))(mod)
    funcs = {str(gv.name_hint): f for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)}
    for name, func in sorted(funcs.items()):
        if a.kernel and not any(k in name for k in a.kernel):
            continue
        found = find_template(func, target, templates_for(target))
        if found is None or (a.family and found[0].family not in a.family):
            continue
        template, match = found
        default = template.default_config(match, target)
        variants = {"default": default}
        for text in a.set:
            cfg = {**default, **_override(text)}
            if not template.space(match, target).contains(cfg):
                print(json.dumps({"kernel": name, "skipped": text, "why": "outside the knob space"}))
                continue
            variants[text] = cfg
        # outputs: the buffers the kernel writes (its last params by TVM's convention)
        built, rng = {}, np.random.default_rng(0)
        written = set()
        C.post_order_visit(func.body, lambda n: written.add(str(n.buffer.name))
                           if isinstance(n, C.BufferStore) else None)
        params = list(func.params)
        n_out = sum(1 for b in params if str(b.name) in written)
        ins = [C.tensor(x) for x in S.random_args(func, rng, n_out)]
        for label, cfg in variants.items():
            sched = schedule_with(template, match, func, cfg)
            if not a.no_fast_math:        # as the pipeline does after scheduling (PipelineOptions.fast_math)
                sched = fastmath.rewrite(sched, {})[0]
            lib = C.build_prim_module(C.IRModule({"main": sched.with_attr("global_symbol", "main")}), target)
            outs = [C.tensor(np.zeros([int(d) for d in b.shape], str(b.dtype))) for b in params[-n_out:]]
            built[label] = (lib["main"], ins + outs, outs)
        ref = None
        for label, (f, args, outs) in built.items():
            f(*args)
            got = [o.numpy() for o in outs]
            if ref is None:
                ref = got
            else:
                for r, g in zip(ref, got):
                    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4, err_msg=f"{name} {label}")
        times = {v: [] for v in built}
        for _ in range(a.rounds):
            for v, (f, args, _) in built.items():
                t0 = time.thread_time()
                for _ in range(a.repeat):
                    f(*args)
                times[v].append((time.thread_time() - t0) / a.repeat * 1e6)
        print(json.dumps({"model": a.model, "dims": a.dims, "kernel": name, "family": template.family,
                          "us": {v: round(min(t), 2) for v, t in times.items()}, "default": default,
                          "clock": "thread_time, min of rounds, one thread, measured under load"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
