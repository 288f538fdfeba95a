"""Latency of the corpus models (corpus/manifest.json): tvmfuse through ``CompiledModel.run`` vs onnxruntime.

    python benchmarks/bench_models.py [--models resnet18 bert] [--rounds 15] [--block 0.2] [--json out.json]
    python benchmarks/bench_models.py --quick --models bert      # a check that it runs, not a measurement
    python benchmarks/bench_models.py --attention [--quick]      # issue 14: the transformers, attention on/off

Engines (each in its own process, so that one runtime's idle worker threads never run next to another's):
  tvmfuse       ``tvmfuse.compile(model).run(feeds)``: numpy in, numpy out
  ort           onnxruntime, default session options
  ort_nospin    onnxruntime with ``session.intra_op.allow_spinning=0`` (idle workers sleep, as TVM's do)
  tvmfuse_noattn  ``tvmfuse.compile(model, attention=False)``: without the attention rule (the chain through
                the pairwise rules, the scores in memory); not run unless named in ``--engines``

``--attention`` (issue 14's end-to-end table): the corpus transformers (``ATTENTION_MODELS``) with the engines
tvmfuse, tvmfuse_noattn and ort; the table adds each build's kernel count, its attention kernels and the
speedup of the attention rule (tvmfuse_noattn / tvmfuse).

One round = one block of back-to-back calls (``--block`` seconds) of every engine in turn, with ``--pause``
seconds of idle time between engines; the latency is the median over rounds of the per-call time of each
block, with the 25th/75th percentiles and min/max as spread. Every engine's outputs, on the same random
inputs (``--seed``), are checked against onnxruntime's (default options) with the corpus error measure
(max |a - b| / max |b| per output), and every engine's (onnxruntime's too) against onnx's
ReferenceEvaluator (``--no-reference`` skips that second check). The table goes to stdout, everything (rounds, kernel counts, schedule sources,
compile time, errors) to the JSON file.

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
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("corpus_io", os.path.join(ROOT, "corpus", "corpus_io.py"))
corpus_io = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(corpus_io)

ENGINES = ("tvmfuse", "ort", "ort_nospin")          # the default engines
ALL_ENGINES = (*ENGINES, "tvmfuse_noattn")
ATTENTION_MODELS = ("bert", "gpt2", "llama", "t5_encoder", "vit")    # --attention: the corpus transformers
ATTENTION_ENGINES = ("tvmfuse", "tvmfuse_noattn", "ort")
REFERENCE_ENGINE = "ort"
REL_TOL = 1e-4          # the corpus target: an engine above it is reported as a mismatch
WORKER_START_TIMEOUT_S = 900   # compile + first run of one model in a worker


# ---- worker: one engine, one model, driven over stdin/stdout with one JSON object per line ----

def _engine_runner(engine: str, path: str, threads: int | None):
    """(run(feeds) -> {name: array}, info dict) for one engine."""
    if engine in ("tvmfuse", "tvmfuse_noattn"):
        import tvmfuse

        t0 = time.perf_counter()
        cm = tvmfuse.compile(path, num_threads=threads, attention=engine == "tvmfuse")
        info = {"compile_s": time.perf_counter() - t0, "kernels_before": cm.report.kernels_before,
                "kernels": cm.kernel_count,
                "attention_groups": sum(g["rule"] == "attention" for g in cm.report.groups),
                "schedule_sources": dict(collections.Counter(f"{s['template']} ({s.get('source', '')})"
                                                             for s in cm.report.schedules)),
                "unscheduled": [s["kernel"] for s in cm.report.schedules if s.get("template") == "unscheduled"],
                "fallback": [s["kernel"] for s in cm.report.schedules if s.get("template") == "fallback"]}
        return cm.run, info
    if engine in ("ort", "ort_nospin"):
        import onnxruntime as ort

        so = ort.SessionOptions()
        if threads:
            so.intra_op_num_threads = threads
        if engine == "ort_nospin":
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        t0 = time.perf_counter()
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        info = {"compile_s": time.perf_counter() - t0, "onnxruntime": ort.__version__}
        return (lambda feeds: dict(zip(names, sess.run(names, feeds)))), info
    raise ValueError(f"unknown engine {engine!r}; known: {ALL_ENGINES}")


def worker(engine: str, model: str, seed: int, threads: int | None, out_npz: str) -> int:
    entry = {e["name"]: e for e in corpus_io.load_manifest()["models"]}[model]
    path = corpus_io.model_path(entry, "static")
    run, info = _engine_runner(engine, path, threads)
    feeds = corpus_io.random_feeds(entry, np.random.default_rng(seed))
    return serve(run, feeds, info, out_npz)


def serve(run, feeds: dict, info: dict, out_npz: str) -> int:
    """The worker's side of the protocol (shared with bench_attention.py): write the first run's outputs
    to ``out_npz``, say ready with ``info``, then time one block of back-to-back calls per "time" command."""
    np.savez(out_npz, **run(feeds))
    print(json.dumps({"ready": True, **info}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        run(feeds)   # warm the caches after the other engines' blocks
        n, t0 = 0, time.perf_counter()
        while True:
            run(feeds)
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= cmd["block_s"] and n >= cmd["min_calls"]:
                break
        print(json.dumps({"per_call_s": elapsed / n, "calls": n}), flush=True)
    return 0


# ---- driver ----

class Worker:
    """The driver's side: one engine's worker process, ``script --worker ENGINE *argv`` (shared with
    bench_attention.py), driven over stdin/stdout with one JSON object per line."""

    def __init__(self, script: str, engine: str, argv: list[str]):
        cmd = [sys.executable, script, "--worker", engine, *argv]
        self.engine = engine
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._reply()
        self.info.pop("ready", None)

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait(timeout=WORKER_START_TIMEOUT_S)
            raise RuntimeError(f"engine {self.engine} exited (status {rc}) without a result; its error is above")
        return json.loads(line)

    def block(self, block_s: float, min_calls: int) -> dict:
        self.proc.stdin.write(json.dumps({"op": "time", "block_s": block_s, "min_calls": min_calls}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)


def _reference_outputs(path: str, feeds: dict) -> dict:
    import onnx
    from onnx.reference import ReferenceEvaluator

    model = onnx.load(path)
    names = [o.name for o in model.graph.output]
    return dict(zip(names, ReferenceEvaluator(model).run(names, feeds)))


def bench_model(entry: dict, args) -> dict:
    name = entry["name"]
    res = {"model": name, "parameters": entry["parameters"], "engines": {}}
    with tempfile.TemporaryDirectory() as tmp:
        workers = {}
        try:
            # one engine at a time while they compile and load (a compile is 2 cores' worth of work)
            for engine in args.engines:
                npz = os.path.join(tmp, f"{engine}.npz")
                try:
                    workers[engine] = Worker(os.path.abspath(__file__), engine,
                                             ["--models", name, "--seed", str(args.seed), "--out-npz", npz]
                                             + (["--threads", str(args.threads)] if args.threads else []))
                except Exception as e:  # an engine that cannot compile this model: reported, others go on
                    res["engines"][engine] = {"error": f"{type(e).__name__}: {e}"}
                    print(f"  {name}: {engine} failed: {e}", file=sys.stderr, flush=True)
                    continue
                with np.load(npz) as z:
                    workers[engine].outputs = {k: z[k] for k in z.files}
                time.sleep(args.pause)
            rounds = {e: [] for e in workers}
            for _ in range(args.rounds):
                for engine, w in workers.items():
                    rounds[engine].append(w.block(args.block, args.min_calls)["per_call_s"])
                    time.sleep(args.pause)
        finally:
            for w in workers.values():
                w.close()
    ref = workers[REFERENCE_ENGINE].outputs if REFERENCE_ENGINE in workers else None
    if args.reference:
        feeds = corpus_io.random_feeds(entry, np.random.default_rng(args.seed))
        ref_eval = _reference_outputs(corpus_io.model_path(entry, "static"), feeds)
    for engine, w in workers.items():
        r = sorted(rounds[engine])
        q = statistics.quantiles(r, n=4) if len(r) >= 2 else [r[0]] * 3
        row = {**w.info, "rounds_ms": [x * 1e3 for x in rounds[engine]], "median_ms": statistics.median(r) * 1e3,
               "p25_ms": q[0] * 1e3, "p75_ms": q[2] * 1e3, "min_ms": r[0] * 1e3, "max_ms": r[-1] * 1e3}
        if ref is not None:
            row["rel_err_vs_ort"] = {k: corpus_io.relative_error(v, ref[k]) for k, v in w.outputs.items()}
        if args.reference:
            row["rel_err_vs_onnx_reference"] = {k: corpus_io.relative_error(v, ref_eval[k])
                                                for k, v in w.outputs.items()}
        errs = list(row.get("rel_err_vs_ort", {}).values()) + list(row.get("rel_err_vs_onnx_reference", {}).values())
        row["correct"] = bool(errs) and max(errs) <= REL_TOL
        res["engines"][engine] = row
    return res


def _table(results: list[dict], engines) -> str:
    attn = "tvmfuse_noattn" in engines
    head = f"{'model':<20}" + "".join(f"{e + ' ms':>22}" for e in engines) + \
        f"{'ort/tvmfuse':>12}{'kernels':>10}{'unsched':>8}{'compile s':>10}" + \
        (f"{'noattn/tvmfuse':>15}{'kernels noattn':>15}{'attn kernels':>13}" if attn else "") + "  check"
    rows = [head, "-" * len(head)]
    for res in results:
        eng = res["engines"]
        cells = []
        for e in engines:
            r = eng.get(e, {})
            cells.append(f"{r['median_ms']:9.3f} [{r['p25_ms']:.3f}-{r['p75_ms']:.3f}]" if "median_ms" in r
                         else "error")
        t, o = eng.get("tvmfuse", {}), eng.get("ort", {})
        ratio = f"{o['median_ms'] / t['median_ms']:.2f}x" if "median_ms" in t and "median_ms" in o else "-"
        kern = f"{t['kernels_before']}->{t['kernels']}" if "kernels" in t else "-"
        check = "ok" if all(r.get("correct") for r in eng.values()) else "MISMATCH/ERROR " + ", ".join(
            e for e, r in eng.items() if not r.get("correct"))
        unsched = len(t["unscheduled"]) if "unscheduled" in t else "-"
        extra = ""
        if attn:
            u = eng.get("tvmfuse_noattn", {})
            speed = f"{u['median_ms'] / t['median_ms']:.2f}x" if "median_ms" in t and "median_ms" in u else "-"
            ukern = f"{u['kernels_before']}->{u['kernels']}" if "kernels" in u else "-"
            extra = f"{speed:>15}{ukern:>15}{t.get('attention_groups', '-'):>13}"
        rows.append(f"{res['model']:<20}" + "".join(f"{c:>22}" for c in cells) + f"{ratio:>12}{kern:>10}"
                    f"{unsched:>8}{t.get('compile_s', float('nan')):>10.1f}{extra}  {check}")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", help="corpus model names (default: all in the manifest)")
    ap.add_argument("--engines", nargs="*", default=None, choices=ALL_ENGINES,
                    help=f"default: {' '.join(ENGINES)} ({' '.join(ATTENTION_ENGINES)} with --attention)")
    ap.add_argument("--attention", action="store_true",
                    help="issue 14's table: the corpus transformers with the attention rule on and off")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (median over them)")
    ap.add_argument("--block", type=float, default=0.2, help="seconds of back-to-back calls per engine per round")
    ap.add_argument("--min-calls", type=int, default=3, help="calls per block at least")
    ap.add_argument("--pause", type=float, default=0.5, help="idle seconds between two engines' blocks")
    ap.add_argument("--threads", type=int, default=None, help="threads per engine (default: each engine's own)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs (same for every engine)")
    ap.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                    help="also check every engine (onnxruntime too) vs onnx ReferenceEvaluator (default: on)")
    ap.add_argument("--quick", action="store_true", help="3 rounds of 0.02 s blocks: checks that it runs")
    ap.add_argument("--json", default=None,
                    help="where to write the results (default: bench_models.json, bench_models_attention.json "
                         "with --attention)")
    ap.add_argument("--worker", choices=ALL_ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--out-npz", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.models[0], args.seed, args.threads, args.out_npz)
    if args.quick:
        args.rounds, args.block, args.pause, args.min_calls = 3, 0.02, 0.1, 1
    if args.engines is None:
        args.engines = list(ATTENTION_ENGINES if args.attention else ENGINES)
    if args.json is None:
        args.json = "bench_models_attention.json" if args.attention else "bench_models.json"
    entries = {e["name"]: e for e in corpus_io.load_manifest()["models"]}
    names = args.models or (list(ATTENTION_MODELS) if args.attention else list(entries))
    unknown = sorted(set(names) - set(entries))
    if unknown:
        ap.error(f"unknown model(s) {unknown}; the corpus has {sorted(entries)}")
    if REFERENCE_ENGINE not in args.engines and not args.reference:
        ap.error(f"outputs are checked against {REFERENCE_ENGINE!r}: keep it in --engines or add --reference")
    results = []
    for n in names:
        print(f"{n} ...", file=sys.stderr, flush=True)
        results.append(bench_model(entries[n], args))
    print(_table(results, args.engines))
    doc = {"benchmark": "benchmarks/bench_models.py", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": " ".join(["python", "benchmarks/bench_models.py"] + (argv if argv is not None else sys.argv[1:])),
           "load_avg_end": os.getloadavg(), "host": platform.node(), "machine": platform.machine(),
           "processor": platform.processor(), "cpus": os.cpu_count(), "python": platform.python_version(),
           "settings": {k: getattr(args, k) for k in ("rounds", "block", "min_calls", "pause", "threads", "seed",
                                                      "quick", "engines", "reference", "attention")},
           "rel_tol": REL_TOL, "results": results}
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {args.json}", file=sys.stderr)
    bad = [r["model"] for r in results if not all(e.get("correct") for e in r["engines"].values())]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
