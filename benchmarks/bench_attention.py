"""Attention alone (issue 14's targets): tvmfuse's attention kernel vs tvmfuse without it vs onnxruntime.

    python benchmarks/bench_attention.py [--seqs 128 512 2048] [--rounds 15] [--json bench_attention.json]
    python benchmarks/bench_attention.py --quick      # a check that it runs (small shapes), not a measurement

Workloads: batch 1, ``--heads`` heads (12), head dim ``--head-dim`` (64), each sequence of ``--seqs``, causal
and not; the ONNX graph an exporter writes for multi-head attention on [batch, seq, heads * dim] tensors:

    q/k/v: Reshape [b, s, h, d] -> Transpose (q, v: [b, h, s, d]; k: [b, h, d, s])
    Y = Transpose(Softmax(MatMul(q, kT) * 1/sqrt(d) [+ causal]) @ v) -> Reshape [b, s, h * d]

the causal variant adds a constant [s, s] mask (0 on and below the diagonal, -inf above), as exporters
write it.  Engines (each in its own worker process, so that one runtime's idle worker threads never run
next to another's):

  tvmfuse             ``tvmfuse.compile(model).run(feeds)``: the attention rule's one kernel
  tvmfuse_unfused     the same with ``attention=False`` (``PipelineOptions.attention``): the chain goes through
                      tvmfuse's pairwise rules and schedules, the S x S scores in memory
  ort                 onnxruntime, default session options (``--threads`` sets intra-op threads)

Method (as ``bench_models.py``): every engine is built and run once in its worker, its outputs written to
an .npz and checked here against onnxruntime's and against onnx's ReferenceEvaluator (max |a - b| /
max |b| <= REL_TOL; ``--no-reference`` skips the second); then ``--rounds``
rounds, in each round every engine in turn (order rotated each round) runs a block of back-to-back calls
``--block`` seconds long, with ``--pause`` idle seconds between engines.  Figure: median over rounds of
the per-call time, with p25/p75 and min/max.  The JSON also has, for the tvmfuse engines, the kernel
count, the templates and the report's intermediate bytes and memory traffic (before -> after fusion):
the difference between the two tvmfuse engines is the score matrices the kernel keeps out of memory.

Timings are only meaningful on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bench_models", os.path.join(ROOT, "benchmarks", "bench_models.py"))
bench_models = importlib.util.module_from_spec(_spec)     # the worker protocol and the corpus helpers
_spec.loader.exec_module(bench_models)
ENGINES = ("tvmfuse", "tvmfuse_unfused", "ort")
REFERENCE_ENGINE = "ort"
REL_TOL = 1e-4               # issue 14's numerics bound (max relative error vs onnxruntime)
QUICK_SEQS = (16, 40)        # --quick: small shapes (40: not a multiple of the vector width)
QUICK_HEADS, QUICK_HEAD_DIM = 2, 16


# ---- the workload ----

def attention_model(seq: int, heads: int, head_dim: int, causal: bool, batch: int = 1):
    """The ONNX multi-head attention graph described in the module docstring (opset 18)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    hidden = heads * head_dim
    inits = [numpy_helper.from_array(np.array([batch, seq, heads, head_dim], np.int64), "split_shape"),
             numpy_helper.from_array(np.array([batch, seq, hidden], np.int64), "merge_shape"),
             numpy_helper.from_array(np.array(1.0 / np.sqrt(head_dim), np.float32), "scale")]
    nodes = []
    for x, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
        nodes += [helper.make_node("Reshape", [x, "split_shape"], [f"{x}_split"]),
                  helper.make_node("Transpose", [f"{x}_split"], [f"{x}_heads"], perm=perm)]
    nodes += [helper.make_node("MatMul", ["q_heads", "k_heads"], ["scores"]),
              helper.make_node("Mul", ["scores", "scale"], ["logits"])]
    logits = "logits"
    if causal:
        mask = np.where(np.arange(seq)[None, :] <= np.arange(seq)[:, None], 0.0, -np.inf).astype(np.float32)
        inits.append(numpy_helper.from_array(mask.reshape(1, 1, seq, seq), "causal_mask"))
        nodes.append(helper.make_node("Add", ["logits", "causal_mask"], ["masked"]))
        logits = "masked"
    nodes += [helper.make_node("Softmax", [logits], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", "v_heads"], ["ctx"]),
              helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ctx_t", "merge_shape"], ["y"])]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [batch, seq, hidden]) for n in "qkvy"]
    graph = helper.make_graph(nodes, f"attention_s{seq}{'_causal' if causal else ''}", io[:3], io[3:], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def workloads(args) -> list[dict]:
    return [{"name": f"s{s}{'_causal' if c else ''}", "seq": s, "causal": c, "heads": args.heads,
             "head_dim": args.head_dim} for s in args.seqs for c in (False, True)]


def feeds_for(w: dict, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    shape = (1, w["seq"], w["heads"] * w["head_dim"])
    return {n: rng.standard_normal(shape).astype(np.float32) for n in "qkv"}


# ---- worker: one engine, one workload, driven over stdin/stdout with one JSON object per line ----

def _report_info(cm) -> dict:
    rep = cm.report
    return {"kernels_before": rep.kernels_before, "kernels": cm.kernel_count,
            "templates": dict(collections.Counter(s["template"] for s in rep.schedules)),
            "attention_groups": sum(g["rule"] == "attention" for g in rep.groups),
            "intermediate_bytes_before": rep.before.intermediate_bytes,
            "intermediate_bytes_after": rep.after.intermediate_bytes,
            "traffic_bytes_before": rep.before.traffic_bytes, "traffic_bytes_after": rep.after.traffic_bytes}


def _engine_runner(engine: str, path: str, threads: int | None):
    """(run(feeds) -> {name: array}, info dict) for one engine."""
    if engine in ("tvmfuse", "tvmfuse_unfused"):
        import tvmfuse

        t0 = time.perf_counter()
        cm = tvmfuse.compile(path, num_threads=threads, attention=engine == "tvmfuse")
        return cm.run, {"compile_s": time.perf_counter() - t0, **_report_info(cm)}
    if engine == "ort":
        import onnxruntime as ort

        so = ort.SessionOptions()
        if threads:
            so.intra_op_num_threads = threads
        t0 = time.perf_counter()
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        info = {"compile_s": time.perf_counter() - t0, "onnxruntime": ort.__version__}
        return (lambda feeds: dict(zip(names, sess.run(names, feeds)))), info
    raise ValueError(f"unknown engine {engine!r}; known: {ENGINES}")


def worker(engine: str, w: dict, seed: int, threads: int | None, model_path: str, out_npz: str) -> int:
    run, info = _engine_runner(engine, model_path, threads)
    return bench_models.serve(run, feeds_for(w, seed), info, out_npz)

# ---- driver ----

def bench_workload(w: dict, args) -> dict:
    import onnx

    res = {"workload": w, "engines": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_path = os.path.join(tmp, f"{w['name']}.onnx")
        onnx.save(attention_model(w["seq"], w["heads"], w["head_dim"], w["causal"]), model_path)
        workers = {}
        try:
            for engine in args.engines:       # one at a time while they compile
                npz = os.path.join(tmp, f"{engine}.npz")
                try:
                    workers[engine] = bench_models.Worker(
                        os.path.abspath(__file__), engine,
                        ["--workload", json.dumps(w), "--seed", str(args.seed), "--model-path", model_path,
                         "--out-npz", npz] + (["--threads", str(args.threads)] if args.threads else []))
                except (RuntimeError, OSError, ValueError) as e:   # reported in the JSON; others go on
                    res["engines"][engine] = {"error": f"{type(e).__name__}: {e}"}
                    print(f"  {w['name']}: {engine} failed: {e}", file=sys.stderr, flush=True)
                    continue
                with np.load(npz) as z:
                    workers[engine].outputs = {k: z[k] for k in z.files}
                time.sleep(args.pause)
            rounds = bench_models.interleaved_rounds(workers, args.rounds, args.block, args.min_calls, args.pause)
        finally:
            for wk in workers.values():
                wk.close()
        ref_eval = bench_models._reference_outputs(model_path, feeds_for(w, args.seed)) if args.reference else None
    ref = workers[REFERENCE_ENGINE].outputs if REFERENCE_ENGINE in workers else None
    for engine, wk in workers.items():
        r = sorted(rounds[engine])
        q = statistics.quantiles(r, n=4, method="inclusive") if len(r) >= 2 else [r[0]] * 3
        row = {**wk.info, "rounds_ms": [x * 1e3 for x in rounds[engine]], "median_ms": statistics.median(r) * 1e3,
               "p25_ms": q[0] * 1e3, "p75_ms": q[2] * 1e3, "min_ms": r[0] * 1e3, "max_ms": r[-1] * 1e3}
        if ref is not None:
            row["rel_err_vs_ort"] = {k: bench_models.corpus_io.relative_error(v, ref[k])
                                     for k, v in wk.outputs.items()}
        if ref_eval is not None:
            row["rel_err_vs_onnx_reference"] = {k: bench_models.corpus_io.relative_error(v, ref_eval[k])
                                                for k, v in wk.outputs.items()}
        errs = list(row.get("rel_err_vs_ort", {}).values()) + list(row.get("rel_err_vs_onnx_reference", {}).values())
        row["correct"] = bool(errs) and max(errs) <= REL_TOL
        res["engines"][engine] = row
    eng = res["engines"]
    fused, unfused = eng.get("tvmfuse", {}), eng.get("tvmfuse_unfused", {})
    if "intermediate_bytes_after" in fused and "intermediate_bytes_after" in unfused:
        res["intermediate_bytes_removed_by_attention"] = (unfused["intermediate_bytes_after"]
                                                          - fused["intermediate_bytes_after"])
        res["traffic_bytes_removed_by_attention"] = unfused["traffic_bytes_after"] - fused["traffic_bytes_after"]
        res["score_matrix_bytes"] = w["heads"] * w["seq"] * w["seq"] * 4
    for base in ("tvmfuse_unfused", "ort"):
        if "median_ms" in fused and "median_ms" in eng.get(base, {}):
            res[f"speedup_vs_{base}"] = eng[base]["median_ms"] / fused["median_ms"]
    return res


def _table(results: list[dict], engines) -> str:
    head = f"{'workload':<14}" + "".join(f"{e + ' ms':>26}" for e in engines) + \
        f"{'vs unfused':>11}{'vs ort':>8}{'kernels':>9}{'bytes removed':>15}  check"
    rows = [head, "-" * len(head)]
    for res in results:
        eng = res["engines"]
        cells = [f"{eng[e]['median_ms']:9.3f} [{eng[e]['p25_ms']:.3f}-{eng[e]['p75_ms']:.3f}]"
                 if "median_ms" in eng.get(e, {}) else "error" for e in engines]
        t = eng.get("tvmfuse", {})
        ratio = [f"{res[k]:.2f}x" if k in res else "-" for k in ("speedup_vs_tvmfuse_unfused", "speedup_vs_ort")]
        kern = f"{t['kernels_before']}->{t['kernels']}" if "kernels" in t else "-"
        removed = f"{res['intermediate_bytes_removed_by_attention'] / 2**20:.2f} MiB" \
            if "intermediate_bytes_removed_by_attention" in res else "-"
        check = "ok" if all(r.get("correct") for r in eng.values()) else "MISMATCH/ERROR " + ", ".join(
            e for e, r in eng.items() if not r.get("correct"))
        rows.append(f"{res['workload']['name']:<14}" + "".join(f"{c:>26}" for c in cells)
                    + f"{ratio[0]:>11}{ratio[1]:>8}{kern:>9}{removed:>15}  {check}")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", nargs="*", type=int, default=None,
                    help="sequence lengths (default 128 512 2048; with --quick, %s)" % (QUICK_SEQS,))
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--engines", nargs="*", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (median over them)")
    ap.add_argument("--block", type=float, default=0.2, help="seconds of back-to-back calls per engine per round")
    ap.add_argument("--min-calls", type=int, default=3, help="calls per block at least")
    ap.add_argument("--pause", type=float, default=0.5, help="idle seconds between two engines' blocks")
    ap.add_argument("--threads", type=int, default=None, help="threads per engine (default: each engine's own)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs (same for every engine)")
    ap.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                    help="also check every engine (onnxruntime too) vs onnx ReferenceEvaluator (default: on)")
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK_HEADS} heads of {QUICK_HEAD_DIM}, 2 rounds of 0.02 s blocks")
    ap.add_argument("--json", default="bench_attention.json", help="where to write the results")
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    ap.add_argument("--out-npz", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker, json.loads(args.workload), args.seed, args.threads, args.model_path,
                      args.out_npz)
    if args.quick:
        args.seqs, args.heads, args.head_dim = args.seqs or list(QUICK_SEQS), QUICK_HEADS, QUICK_HEAD_DIM
        args.rounds, args.block, args.pause, args.min_calls = 2, 0.02, 0.05, 1
    args.seqs = args.seqs or [128, 512, 2048]
    if REFERENCE_ENGINE not in args.engines and not args.reference:
        ap.error(f"outputs are checked against {REFERENCE_ENGINE!r}: keep it in --engines or keep --reference")
    if any(s < 1 for s in args.seqs) or args.heads < 1 or args.head_dim < 1:
        ap.error("--seqs, --heads and --head-dim must be positive")
    results = []
    for w in workloads(args):
        print(f"{w['name']} ...", file=sys.stderr, flush=True)
        results.append(bench_workload(w, args))
    print(_table(results, args.engines))
    doc = {"benchmark": "benchmarks/bench_attention.py", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "host": platform.node(), "machine": platform.machine(), "processor": platform.processor(),
           "cpus": os.cpu_count(), "python": platform.python_version(),
           "settings": {k: getattr(args, k) for k in ("seqs", "heads", "head_dim", "rounds", "block", "min_calls",
                                                      "pause", "threads", "seed", "quick", "engines", "reference")},
           "command": " ".join(["python", "benchmarks/bench_attention.py"] + (argv if argv is not None else sys.argv[1:])),
           "load_avg_end": os.getloadavg(),
           "rel_tol": REL_TOL, "results": results}
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {args.json}", file=sys.stderr)
    bad = [r["workload"]["name"] for r in results if not all(e.get("correct") for e in r["engines"].values())]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
