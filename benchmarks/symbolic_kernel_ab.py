"""Kernel-only A/B of a symbolic kernel's size-bucket nest against config overrides and against the static
build's kernel for the same size (issue 13): each kernel of the corpus model's ``_dyn`` variant whose name
contains ``--kernel``, the bucket ``--bucket`` (default: the open, last one) scheduled with its default and each
``--set`` override, and the same kernel of a build pinned to ``--dims`` with its static template's default;
all built for ``--target`` (default: the host), timed interleaved on the calling thread's CPU time
(``time.thread_time``; run with TVM_NUM_THREADS=1; ``--wall``: wall clock, default threads), min of rounds, at the ``--dims`` sizes.  Every variant's
outputs are compared with the static kernel's.  Output: JSON lines; on a shared machine the times are
measured under load.

    TVM_NUM_THREADS=1 PYTHONPATH=. python benchmarks/symbolic_kernel_ab.py t5_encoder --dims batch=1,sequence=128 \
        --kernel matmul1_relu --set pack_b=false --set mr=4,mc_tiles=2
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
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import static_kernel_ab as SK  # noqa: E402

import tvmfuse  # noqa: E402
from tvmfuse import _compat as C  # noqa: E402
from tvmfuse import fastmath  # noqa: E402
from tvmfuse.pipeline import PipelineOptions, graph_stage  # noqa: E402
from tvmfuse.schedules import templates_for  # noqa: E402
from tvmfuse.schedules.base import find_template, schedule_with  # noqa: E402

corpus_io = SK.corpus_io


def _kernels(path: str, dims: dict | None, target, names: list[str]) -> dict:
    mod = tvmfuse.load_onnx(path, input_shapes=dims)
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions()))(mod)
    return {str(gv.name_hint): f for gv, f in mod.functions.items()
            if isinstance(f, C.PrimFunc) and any(k in str(gv.name_hint) for k in names)}


def _build(func, target):
    func = fastmath.rewrite(func, {})[0]
    return C.build_prim_module(C.IRModule({"main": func.with_attr("global_symbol", "main")}), target)["main"]


def _same_signature(a, b, dims: dict) -> bool:
    """Same buffer parameters (dtypes and shapes, the symbolic one's at ``dims``) in the same order: the static
    kernel ``a`` is the symbolic ``b`` pinned (ranks alone would pair gpt2's 64 x 64 and 64 x 256 matmuls)."""
    pa, pb = _buffers(a), _buffers(b)
    return len(pa) == len(pb) and all(
        str(x.dtype) == str(y.dtype) and [_eval(d, dims) for d in x.shape] == [_eval(d, dims) for d in y.shape]
        for x, y in zip(pa, pb))


def _buffers(func) -> list:
    """The kernel's buffer parameters (its symbolic kernels also take shape scalars)."""
    return [p for p in func.params if hasattr(p, "shape")]


def _eval(dim, dims: dict) -> int:
    """A buffer extent (an int, a shape variable or an expression of them) at the sizes ``dims``."""
    if isinstance(dim, C.tirx.IntImm):
        return int(dim)
    ana = C.Analyzer()
    free = []
    C.post_order_visit(dim, lambda n: free.append(n) if isinstance(n, C.tirx.Var) else None)
    for v in free:
        ana.bind(v, C.tirx.IntImm(str(v.ty), dims[str(v.name)]))
    return int(ana.simplify(dim))


def _ordered(params, values: dict, outs: list) -> list:
    """The kernel's arguments in parameter order: inputs and scalars from ``values``, then the outputs."""
    out = iter(outs)
    return [values[p] if p in values else next(out) for p in params]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--dims", required=True, help="the size timed (and the static build pinned to): batch=1,sequence=128")
    ap.add_argument("--kernel", action="append", required=True, help="kernels whose name contains this")
    ap.add_argument("--bucket", default=None, help="the size bucket's name (default: the last, open one)")
    ap.add_argument("--set", action="append", default=[], help="config override KNOB=VALUE[,...] (repeatable)")
    ap.add_argument("--static-set", action="append", default=[],
                    help="config override of the static kernel KNOB=VALUE[,...] (repeatable; what a knob the "
                         "symbolic nest lacks is worth)")
    ap.add_argument("--target", default=None, help="build target (default: the host, its cores)")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--wall", action="store_true",
                    help="time wall clock (perf_counter) with the runtime's default threads, not the calling "
                         "thread's CPU time: a kernel's parallel split and fork/join show only there")
    a = ap.parse_args(argv)
    clock = time.perf_counter if a.wall else time.thread_time
    target = tvmfuse.parse_target(a.target) if a.target else tvmfuse.host_target()
    entry = {e["name"]: e for e in corpus_io.load_manifest()["models"]}[a.model]
    dims = SK._dims(a.dims)
    path = corpus_io.model_path(entry, "dynamic")
    sym, static = _kernels(path, None, target, a.kernel), _kernels(path, dims, target, a.kernel)
    for name, func in sorted(sym.items()):
        found = find_template(func, target, templates_for(target))
        if found is None:
            print(json.dumps({"kernel": name, "skipped": "no template"}))
            continue
        template, match = found
        buckets = template.buckets(match, target)
        bucket = next((b for b in buckets if b.name == a.bucket), buckets[-1]) if buckets else None
        bm = template.bucket_match(match, bucket) if bucket is not None else match
        default = template.default_config(bm, target)
        variants = {"default": default}
        for text in a.set:
            cfg = {**default, **SK._override(text)}
            if not template.space(bm, target).contains(cfg):
                print(json.dumps({"kernel": name, "skipped": text, "why": "outside the knob space"}))
                continue
            variants[text] = cfg
        built = {label: _build(schedule_with(template, bm, func, cfg), target) for label, cfg in variants.items()}
        pinned = [(n, f) for n, f in static.items() if _same_signature(f, func, dims)]
        if pinned:
            sname, sfunc = pinned[0]
            sfound = find_template(sfunc, target, templates_for(target))
            if sfound is not None:
                st, sm = sfound
                sdefault = st.default_config(sm, target)
                for text in a.static_set:
                    cfg = {**sdefault, **SK._override(text)}
                    if not st.space(sm, target).contains(cfg):
                        print(json.dumps({"kernel": sname, "skipped": f"static {text}",
                                          "why": "outside the knob space"}))
                        continue
                    built[f"static {st.family} {text}"] = _build(schedule_with(st, sm, sfunc, cfg), target)
                # the static default last: every variant's outputs are compared with it
                built[f"static {st.family}"] = _build(schedule_with(st, sm, sfunc, sdefault), target)
        # arguments: the symbolic kernel's buffers at --dims (the static build may have fused the kernel
        # differently: then it is timed without the static comparator); scalars (shape variables) by name
        rng = np.random.default_rng(0)
        params = list(func.params)
        bufs = _buffers(func)
        written = set()
        C.post_order_visit(func.body, lambda n: written.add(str(n.buffer.name))
                           if isinstance(n, C.BufferStore) else None)
        n_out = sum(1 for b in bufs if str(b.name) in written)
        shape = lambda b: [_eval(d, dims) for d in b.shape]
        values = {}
        for p in params:
            if hasattr(p, "shape") and bufs.index(p) < len(bufs) - n_out:
                values[p] = C.tensor(rng.standard_normal(shape(p)).astype(str(p.dtype)))
            elif not hasattr(p, "shape"):
                values[p] = dims[str(p.name)]
        outs = {label: [C.tensor(np.zeros(shape(b), str(b.dtype))) for b in bufs[-n_out:]] for label in built}
        ins = [values[p] for p in params if p in values]
        results = {}
        for label, f in built.items():
            if label.startswith("static"):
                f(*[v for p, v in zip(params, [values.get(p) for p in params]) if hasattr(p, "shape")
                    and p in values], *outs[label])
            else:
                f(*_ordered(params, values, outs[label]))
            results[label] = [o.numpy() for o in outs[label]]
        ref = results[list(built)[-1]]
        for label, got in results.items():
            for r, g in zip(ref, got):
                np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4, err_msg=f"{name} {label}")
        times = {v: [] for v in built}
        for _ in range(a.rounds):
            for v, f in built.items():
                args = ([values[p] for p in params if hasattr(p, "shape") and p in values] + outs[v]
                        if v.startswith("static") else _ordered(params, values, outs[v]))
                t0 = clock()
                for _ in range(a.repeat):
                    f(*args)
                times[v].append((clock() - t0) / a.repeat * 1e6)
        print(json.dumps({"model": a.model, "dims": a.dims, "kernel": name, "family": template.family,
                          "bucket": bucket.name if bucket else None,
                          "us": {v: round(min(t), 2) for v, t in times.items()}, "default": default,
                          "clock": ("wall, default threads" if a.wall else "thread_time, one thread")
                          + ", min of rounds, measured under load",
                          "load_1min": round(os.getloadavg()[0], 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
