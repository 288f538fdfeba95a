"""Latency of the corpus models (corpus/manifest.json): tvmfuse through ``CompiledModel.run`` beside the engines
a TVM, onnxruntime or PyTorch user would deploy, every engine's outputs checked.

    python benchmarks/bench_models.py [--models resnet18 bert] [--rounds 15] [--block 0.2] [--json out.json]
    python benchmarks/bench_models.py --quick --models bert      # a check that it runs, not a measurement
    python benchmarks/bench_models.py --engines tvmfuse ort tvm_dlight torch_compile \
        --torch-python /work/venv-corpus/bin/python              # + TVM's untuned route and torch.compile
    python benchmarks/bench_models.py --attention [--quick]      # issue 14: the transformers, attention on/off

Engines (each in its own process, so that one runtime's idle worker threads never run next to another's;
every one is timed with numpy in and numpy out, as a user calls it):
  tvmfuse       ``tvmfuse.compile(model).run(feeds)``
  ort           onnxruntime, default session options (the reference engine of the output check)
  ort_nospin    onnxruntime with ``session.intra_op.allow_spinning=0`` (idle workers sleep, as TVM's do)
  tvm_dlight    TVM untuned: TVM's own fusion (LegalizeOps + FuseOps + FuseTIR), every kernel scheduled by
                dlight's CPU rules (GEMV, Reduction; a kernel neither matches keeps TVM's default loop nest),
                TVM's lowering (``tvmfuse.dlight_pipeline``: the same ``Stages.dlight`` as bench_cpu.py's
                tvm_dlight column), run by TVM's VM on tensors copied from the numpy inputs; opt-in
  torch_compile ``torch.compile`` (inductor, default mode) of the model's torch definition (the module
                ``corpus/make_corpus.py`` exported, rebuilt with its seed: ``seeded_module``), run under
                ``torch.no_grad`` by the interpreter ``--torch-python`` (one with torch, and transformers for
                the token models); where torch is missing or a model does not compile, the row says
                "skipped" and why (the table lists the reasons); opt-in
  tvmfuse_noattn  ``tvmfuse.compile(model, attention=False)``: without the attention rule (the chain through
                the pairwise rules, the scores in memory); opt-in
The default models (every corpus model but ``corpus_io.OPT_IN_MODELS``, session 8's unseen architectures,
which run when named in ``--models``) and the default engines (ENGINES) keep the 13-model table inside its
time slot (~7 min); name the others in
``--engines`` (tvm_dlight's naive loop nests cost seconds per CNN call; torch.compile takes a minute per model).

``--attention`` (issue 14's end-to-end table): the corpus transformers (``ATTENTION_MODELS``) with the engines
tvmfuse, tvmfuse_noattn and ort; the table adds each build's kernel count, its attention kernels and the
speedup of the attention rule (tvmfuse_noattn / tvmfuse).

One round = one block of back-to-back calls (``--block`` seconds) of every engine in turn (the order rotated
each round), with ``--pause`` seconds of idle time between engines; the latency is the median over rounds of
the per-call time of each block, with the 25th/75th percentiles and min/max as spread. Every engine's outputs,
on the same random inputs (``--seed``), are checked against onnxruntime's (default options) with the corpus
error measure (max |a - b| / max |b| per output), and every engine's (onnxruntime's too) against onnx's
ReferenceEvaluator (``--no-reference`` skips that second check). The table goes to stdout, everything
(rounds, kernel counts, schedule sources, compile time, errors, skip reasons) to the JSON file.

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
OPT_IN_ENGINES = ("tvm_dlight", "torch_compile", "tvmfuse_noattn")   # run only when named in --engines
ALL_ENGINES = (*ENGINES, *OPT_IN_ENGINES)
TORCH_ENGINES = ("torch_compile",)                  # their workers run under --torch-python
ATTENTION_MODELS = ("bert", "gpt2", "llama", "t5_encoder", "vit")    # --attention: the corpus transformers
ATTENTION_ENGINES = ("tvmfuse", "tvmfuse_noattn", "ort")
REFERENCE_ENGINE = "ort"
REL_TOL = 1e-4          # the corpus target: an engine above it is reported as a mismatch
WORKER_START_TIMEOUT_S = 900   # compile + first run of one model in a worker
WORKER_EXIT_TIMEOUT_S = 300    # a worker's exit after "quit" (on a loaded host one took over 60 s); then killed


class EngineSkipped(RuntimeError):
    """The engine cannot run this model here (a package missing, a model it does not compile): the row
    says "skipped" with this reason; the other engines go on."""


def parse_engines(names: list[str] | None, attention: bool = False) -> list[str]:
    """The engines to run, in order, each once: ``names`` (``--engines``; comma-separated items allowed)
    or the default list. An unknown name is a ValueError naming it and the known ones."""
    if names is None:
        return list(ATTENTION_ENGINES if attention else ENGINES)
    out = []
    for item in names:
        for name in filter(None, (n.strip() for n in item.split(","))):
            if name not in ALL_ENGINES:
                raise ValueError(f"unknown engine {name!r}; known: {', '.join(ALL_ENGINES)}")
            if name not in out:
                out.append(name)
    if not out:
        raise ValueError(f"--engines names no engine; known: {', '.join(ALL_ENGINES)}")
    return out


# ---- worker: one engine, one model, driven over stdin/stdout with one JSON object per line ----

def _load_by_path(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tvm_arrays(res) -> list:
    """The VM's result (a tensor or a tuple of them) as numpy arrays, in output order."""
    if hasattr(res, "numpy"):
        return [res.numpy()]
    return [a for r in res for a in _tvm_arrays(r)]


def _torch_runner(entry: dict, threads: int | None):
    """torch.compile of the corpus model's torch definition (make_corpus.seeded_module); EngineSkipped
    where torch (or the model's library) does not import, or torch.compile fails on the model."""
    try:
        import torch
    except ImportError as e:
        raise EngineSkipped(f"torch does not import in {sys.executable} ({e}); --torch-python names an "
                            "interpreter with torch") from e
    sys.path.insert(0, os.path.join(ROOT, "corpus"))
    make_corpus = _load_by_path("make_corpus", os.path.join(ROOT, "corpus", "make_corpus.py"))
    try:
        _, _, module = make_corpus.seeded_module(entry["name"])
    except ImportError as e:   # transformers (token models), torchvision (CNNs) missing
        raise EngineSkipped(f"{entry['name']}'s torch definition does not import in {sys.executable} ({e})") from e
    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    net = torch.compile(module)
    names = entry["outputs"]

    def run(feeds):
        args = [torch.from_numpy(feeds[spec["name"]]) for spec in entry["inputs"]]
        with torch.no_grad():
            out = net(*args)
        outs = out if isinstance(out, (tuple, list)) else [out]
        return {n: o.numpy() for n, o in zip(names, outs)}

    try:      # torch.compile compiles on the first call: a model it cannot compile fails here
        run(corpus_io.random_feeds(entry, np.random.default_rng(0)))
    except Exception as e:  # noqa: BLE001 - any compiler failure is this engine's skip reason, reported
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        raise EngineSkipped(f"torch.compile failed on {entry['name']}: {type(e).__name__}: {first}") from e
    info = {"compile_s": time.perf_counter() - t0, "torch": torch.__version__, "python": sys.executable,
            "torch_threads": torch.get_num_threads()}
    return run, info


def _engine_runner(engine: str, path: str, threads: int | None, entry: dict | None = None):
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
    if engine == "tvm_dlight":
        import onnx

        import tvmfuse
        from tvmfuse import _compat as C
        from tvmfuse.target import configure_threads

        configure_threads(threads)
        target = tvmfuse.host_target()
        t0 = time.perf_counter()
        ex = C.compile_module(tvmfuse.load_onnx(path), target, tvmfuse.dlight_pipeline(target))
        f = C.VirtualMachine(ex, C.cpu())["main"]
        graph = onnx.load(path, load_external_data=False).graph
        inputs = [i.name for i in graph.input]
        names = [o.name for o in graph.output]
        info = {"compile_s": time.perf_counter() - t0, "target": str(target),
                "pipeline": "tvmfuse.dlight_pipeline (FuseOps + dlight cpu.GEMV, cpu.Reduction)"}
        return (lambda feeds: dict(zip(names, _tvm_arrays(f(*[C.tensor(feeds[n]) for n in inputs]))))), info
    if engine in TORCH_ENGINES:
        return _torch_runner(entry, threads)
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
    # the protocol keeps fd 1 to itself: what compilers and their subprocesses write to stdout goes to stderr
    sys.stdout = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    try:
        run, info = _engine_runner(engine, path, threads, entry)
    except EngineSkipped as e:
        print(json.dumps({"skipped": str(e)}), flush=True)
        return 0
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

    def __init__(self, script: str, engine: str, argv: list[str], python: str | None = None):
        cmd = [python or sys.executable, script, "--worker", engine, *argv]
        self.engine = engine
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._reply()
        if "skipped" in self.info:
            self.proc.wait(timeout=60)
            raise EngineSkipped(self.info["skipped"])
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
        """Ask the worker to quit; one still running after WORKER_EXIT_TIMEOUT_S (its results are in by
        then) is killed, with a line on stderr, instead of failing the run."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=WORKER_EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                print(f"  {self.engine} worker (pid {self.proc.pid}) still running {WORKER_EXIT_TIMEOUT_S} s after "
                      "quit: killed", file=sys.stderr, flush=True)
                self.proc.kill()
                self.proc.wait()


def interleaved_rounds(workers: dict, n_rounds: int, block_s: float, min_calls: int, pause_s: float) -> dict:
    """Per-call seconds of each worker, one figure per round: in each round every worker in turn times one
    block of back-to-back calls, the order rotated round by round (no engine always runs first), with
    ``pause_s`` idle seconds after each block so idle runtime workers stop spinning."""
    rounds = {e: [] for e in workers}
    order = list(workers)
    for r in range(n_rounds):
        for engine in order[r % len(order):] + order[:r % len(order)]:
            rounds[engine].append(workers[engine].block(block_s, min_calls)["per_call_s"])
            time.sleep(pause_s)
    return rounds


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
                                             + (["--threads", str(args.threads)] if args.threads else []),
                                             python=args.torch_python if engine in TORCH_ENGINES else None)
                except EngineSkipped as e:   # torch missing, a model torch.compile does not compile: the reason
                    res["engines"][engine] = {"skipped": str(e)}
                    print(f"  {name}: {engine} skipped: {e}", file=sys.stderr, flush=True)
                    continue
                except Exception as e:  # an engine that cannot compile this model: reported, others go on
                    res["engines"][engine] = {"error": f"{type(e).__name__}: {e}"}
                    print(f"  {name}: {engine} failed: {e}", file=sys.stderr, flush=True)
                    continue
                with np.load(npz) as z:
                    workers[engine].outputs = {k: z[k] for k in z.files}
                time.sleep(args.pause)
            rounds = interleaved_rounds(workers, args.rounds, args.block, args.min_calls, args.pause)
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
    others = [e for e in ("tvm_dlight", "torch_compile") if e in engines]   # each one's time / tvmfuse's
    head = f"{'model':<20}" + "".join(f"{e + ' ms':>22}" for e in engines) + \
        f"{'ort/tvmfuse':>12}" + "".join(f"{e + '/tvmfuse':>{len(e) + 10}}" for e in others) + \
        f"{'kernels':>10}{'unsched':>8}{'compile s':>10}" + \
        (f"{'noattn/tvmfuse':>15}{'kernels noattn':>15}{'attn kernels':>13}" if attn else "") + "  check"
    rows = [head, "-" * len(head)]
    for res in results:
        eng = res["engines"]
        cells = []
        for e in engines:
            r = eng.get(e, {})
            cells.append(f"{r['median_ms']:9.3f} [{r['p25_ms']:.3f}-{r['p75_ms']:.3f}]" if "median_ms" in r
                         else "skipped" if "skipped" in r else "error")
        t, o = eng.get("tvmfuse", {}), eng.get("ort", {})
        ratio = f"{o['median_ms'] / t['median_ms']:.2f}x" if "median_ms" in t and "median_ms" in o else "-"
        ratio = f"{ratio:>12}"
        for e in others:
            x = eng.get(e, {})
            r = f"{x['median_ms'] / t['median_ms']:.2f}x" if "median_ms" in t and "median_ms" in x else "-"
            ratio += f"{r:>{len(e) + 10}}"
        kern = f"{t['kernels_before']}->{t['kernels']}" if "kernels" in t else "-"
        check = "ok" if all(_passed(r) for r in eng.values()) else "MISMATCH/ERROR " + ", ".join(
            e for e, r in eng.items() if not _passed(r))
        unsched = len(t["unscheduled"]) if "unscheduled" in t else "-"
        extra = ""
        if attn:
            u = eng.get("tvmfuse_noattn", {})
            speed = f"{u['median_ms'] / t['median_ms']:.2f}x" if "median_ms" in t and "median_ms" in u else "-"
            ukern = f"{u['kernels_before']}->{u['kernels']}" if "kernels" in u else "-"
            extra = f"{speed:>15}{ukern:>15}{t.get('attention_groups', '-'):>13}"
        rows.append(f"{res['model']:<20}" + "".join(f"{c:>22}" for c in cells) + f"{ratio}{kern:>10}"
                    f"{unsched:>8}{t.get('compile_s', float('nan')):>10.1f}{extra}  {check}")
    skipped = [f"  {res['model']} {e}: {r['skipped']}" for res in results for e, r in res["engines"].items()
               if "skipped" in r]
    if skipped:
        rows += ["skipped (not run, not counted as a failure):"] + skipped
    return "\n".join(rows)


def _passed(row: dict) -> bool:
    """An engine's row passes when its outputs matched, or when it was skipped with a reason."""
    return bool(row.get("correct")) or "skipped" in row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", help="corpus model names (default: all in the manifest but "
                                                "corpus_io.OPT_IN_MODELS, which run when named)")
    ap.add_argument("--engines", nargs="+", default=None, metavar="ENGINE",
                    help=f"any of {', '.join(ALL_ENGINES)} (see above); default: {' '.join(ENGINES)} "
                         f"({' '.join(ATTENTION_ENGINES)} with --attention); opt-in: {' '.join(OPT_IN_ENGINES)}")
    ap.add_argument("--torch-python", default=sys.executable, metavar="PYTHON",
                    help="interpreter of the torch_compile workers: one with torch (and transformers, "
                         "torchvision for the corpus models' definitions), e.g. /work/venv-corpus/bin/python "
                         "(default: this one)")
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
    try:
        args.engines = parse_engines(args.engines, args.attention)
    except ValueError as e:
        ap.error(str(e))
    if args.json is None:
        args.json = "bench_models_attention.json" if args.attention else "bench_models.json"
    entries = {e["name"]: e for e in corpus_io.load_manifest()["models"]}
    names = args.models or (list(ATTENTION_MODELS) if args.attention else corpus_io.default_models(entries))
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
                                                      "quick", "engines", "reference", "attention", "torch_python")},
           "rel_tol": REL_TOL, "results": results}
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {args.json}", file=sys.stderr)
    bad = [r["model"] for r in results if not all(_passed(e) for e in r["engines"].values())]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
