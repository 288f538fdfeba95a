"""CPU benchmark of issue #4's workloads: numpy op by op, onnxruntime, stock TVM, tvmfuse (untuned).

    python benchmarks/bench_cpu.py [--quick] [--repeat N] [--threads T] [--json out.json] [--no-models] [--io]

Runs are interleaved (one round = a block of calls of every engine per workload), medians over the rounds; ratios are
to the best peer (numpy / onnxruntime) and to a roofline floor measured in the same run (a large copy for
memory-bound workloads, a large matmul for compute-bound ones).  MatMul+Bias+GELU is also run as three
separate kernels (tvmfuse schedules, no fusion) for the fused-vs-separate ratio.

``--io`` adds the cost of getting data in and out (issue 11), per workload: the VM call on device tensors
next to ``CompiledModel.run()`` with numpy arrays in and out, for ordinary numpy inputs (not 64-byte
aligned: copied once) and for ``tvmfuse.empty`` inputs (zero copy), and the same three for ``Runner.run``
of the exported artifact (``tvmfuse.load``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.target import configure_threads

FLOOR_COPY_BYTES = 256 * 1024 * 1024 // 4 * 4     # the copy that measures DRAM bandwidth
FLOOR_MATMUL = 1024                               # the square matmul that measures float32 FLOP/s


def _gelu_np(x):
    from scipy.special import erf

    return 0.5 * x * (1.0 + erf(x / np.sqrt(np.float32(2.0)))).astype(np.float32)


def workloads(quick: bool):
    s = 4 if quick else 1
    mm = (512 // s, 768 // s, 3072 // s)
    return [
        # name, model, kind (compute/memory), work (flops or bytes), numpy op-by-op function
        ("matmul_bias_gelu", M.matmul_bias_gelu(m=mm[0], k=mm[1], n=mm[2]), "compute", 2 * mm[0] * mm[1] * mm[2]),
        ("conv3x3_bn_relu_res", M.conv_bn_relu_residual(channels=64 // s, size=56 // s), "compute",
         2 * (64 // s) ** 2 * 9 * (56 // s) ** 2),
        ("layernorm", M.layernorm(rows=512 // s, d=768, decomposed=False), "memory", 2 * 4 * 512 // s * 768),
        ("softmax", M.softmax(rows=512 // s, d=3072, decomposed=False), "memory", 2 * 4 * 512 // s * 3072),
        ("sigmoid_chain", M.elementwise_chain(n=4 * 1024 * 1024 // s), "memory", 4 * 4 * 4 * 1024 * 1024 // s),
        ("qkv", M.qkv_projection(seq=512 // s, hidden=768 // s), "compute", 3 * 2 * (512 // s) * (768 // s) ** 2),
    ]


BLOCK_SECONDS = 0.05   # each engine runs a block of calls this long per round (see _time)


def _time(fn, warmup=1):
    """Seconds per call over a block of back-to-back calls (about BLOCK_SECONDS long).

    Engines are interleaved block by block, not call by call: a runtime's worker threads spin for a
    while after each call, and one call of the next engine right after it competes with them for the
    2 cores (measured here: single-call alternation made either engine up to 10x slower)."""
    for _ in range(warmup):
        fn()
    t = time.perf_counter()
    fn()
    one = time.perf_counter() - t
    n = max(1, min(200, int(BLOCK_SECONDS / max(one, 1e-6))))
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


class Engines:
    """One callable per engine and workload; inputs are prepared outside the timed call."""

    def __init__(self, model, threads, io=False, workdir=None):
        self.model = model
        self.feeds = {k: np.random.default_rng(0).standard_normal(v.shape).astype(v.dtype)
                      for k, v in M.random_feeds(model).items()}
        self.runs = {}
        self.runs["numpy"] = self._numpy()
        self.runs["onnxruntime"] = self._ort(threads)
        for name, kw in (("stock TVM", dict(fusion=False, schedules=False, fast_math=False)),
                         ("tvmfuse", {})):
            self.runs[name] = self._tvm(kw)
        self.runs["tvmfuse separate"] = self._separate()
        if io:
            self.runs.update(self._io(workdir))

    def _io(self, workdir):
        """run() with numpy in and out beside the VM call on device tensors, compiled and exported."""
        cm = tvmfuse.compile(self.model)
        runner = tvmfuse.load(tvmfuse.export(cm, os.path.join(workdir, f"m{id(self)}")))
        aligned = {}
        for k, v in self.feeds.items():
            aligned[k] = tvmfuse.empty(v.shape, v.dtype)
            aligned[k][...] = v
        runs = {}
        for label, m in (("", cm), ("artifact ", runner)):
            args = [C.tensor(self.feeds[s.name]) for s in m.inputs]
            f = m._main()
            runs[f"{label}VM call"] = lambda f=f, args=args: f(*args)
            runs[f"{label}run() numpy"] = lambda m=m: m.run(self.feeds)
            runs[f"{label}run() aligned"] = lambda m=m: m.run(aligned)
        return runs

    def _separate(self):
        """Each op its own kernel, each kernel scheduled by tvmfuse (the fused-vs-separate baseline)."""
        from tvmfuse.pipeline import Stages

        stages = Stages(tvmfuse.host_target())

        @C.module_pass(opt_level=0, name="bench.separate")
        def _sep(mod, _ctx):
            with stages.target:
                return C.Sequential(stages.unfused() + stages.schedule() + stages.lower())(mod)

        ex = C.compile_module(tvmfuse.load_onnx(self.model), stages.target, _sep)
        vm = C.VirtualMachine(ex, C.cpu())
        args = [C.tensor(v) for v in self.feeds.values()]
        return lambda: vm["main"](*args)

    def _numpy(self):
        from onnx.reference import ReferenceEvaluator

        ev = ReferenceEvaluator(self.model)   # the ONNX reference runtime: numpy, one op at a time
        return lambda: ev.run(None, self.feeds)

    def _ort(self, threads):
        try:
            import onnxruntime as ort
        except ImportError:
            return None
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        # idle workers sleep instead of spinning into the next engine's block (TVM's do the same)
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        sess = ort.InferenceSession(self.model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return lambda: sess.run(None, self.feeds)

    def _tvm(self, kw):
        cm = tvmfuse.compile(self.model, **kw)
        args = [C.tensor(self.feeds[s.name]) for s in cm.inputs]
        f = cm.vm["main"]
        return lambda: f(*args)


def floors(threads):
    """Roofline numbers of this run: DRAM copy bandwidth (B/s) and matmul FLOP/s (numpy/BLAS)."""
    a = np.ones(FLOOR_COPY_BYTES // 4, np.float32)
    b = np.empty_like(a)
    bw = 2 * a.nbytes / min(_time(lambda: np.copyto(b, a)) for _ in range(5))
    x = np.random.default_rng(0).standard_normal((FLOOR_MATMUL, FLOOR_MATMUL)).astype(np.float32)
    flops = 2 * FLOOR_MATMUL ** 3 / min(_time(lambda: x @ x) for _ in range(5))
    return {"copy_GBps": bw / 1e9, "matmul_GFLOPs": flops / 1e9}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="quarter-size workloads")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default="benchmarks/bench_cpu.json")
    ap.add_argument("--no-models", action="store_true", help="skip the demo models end to end")
    ap.add_argument("--io", action="store_true", help="also time run() with numpy in/out against the VM call on "
                    "device tensors, compiled and exported (Runner.run)")
    args = ap.parse_args(argv)
    configure_threads(args.threads)
    fl = floors(args.threads)
    wl = workloads(args.quick)
    if not args.no_models:
        wl += [("transformer_block", M.transformer_block(), "model", 0),
               ("resnet_block", M.resnet_block(), "model", 0)]
    workdir = tempfile.mkdtemp(prefix="bench-io-")
    engines = {name: Engines(model, args.threads, io=args.io, workdir=workdir) for name, model, _, _ in wl}
    times = {n: {e: [] for e, f in eng.runs.items() if f is not None} for n, eng in engines.items()}
    for _ in range(args.repeat):                          # interleaved rounds
        for n, eng in engines.items():
            for e, f in eng.runs.items():
                if f is not None:
                    times[n][e].append(_time(f))
    rows = []
    for name, model, kind, work in wl:
        med = {e: statistics.median(ts) * 1e3 for e, ts in times[name].items()}
        peers = {e: v for e, v in med.items() if e in ("numpy", "onnxruntime")}
        best = min(peers.values())
        floor_ms = (work / (fl["matmul_GFLOPs"] * 1e9) if kind == "compute" else
                    work / (fl["copy_GBps"] * 1e9) if kind == "memory" else float("nan")) * 1e3
        rows.append({"fused_vs_separate": med["tvmfuse separate"] / med["tvmfuse"], "workload": name, "kind": kind, "ms": med, "floor_ms": floor_ms,
                     "tvmfuse_vs_best_peer": best / med["tvmfuse"],
                     "tvmfuse_vs_floor": floor_ms / med["tvmfuse"] if floor_ms == floor_ms else None})
    engines_order = ["numpy", "onnxruntime", "stock TVM", "tvmfuse separate", "tvmfuse"]
    head = f"{'workload':22s}" + "".join(f"{e:>17s}" for e in engines_order) + f"{'floor':>10s}{'vs peer':>9s}{'vs floor':>9s}"
    print(head)
    for r in rows:
        line = f"{r['workload']:22s}" + "".join(f"{r['ms'].get(e, float('nan')):17.3f}" for e in engines_order)
        vf = r["tvmfuse_vs_floor"]
        line += f"{r['floor_ms']:10.3f}{r['tvmfuse_vs_best_peer']:9.2f}" + (f"{vf:9.2f}" if vf else f"{'-':>9s}")
        print(line)
    if args.io:
        io_order = [f"{p}{e}" for p in ("", "artifact ") for e in ("VM call", "run() numpy", "run() aligned")]
        print("\nI/O: ms per call; VM call = device tensors in and out, run() = numpy in and out "
              "(numpy inputs copied, aligned inputs zero-copy)")
        print(f"{'workload':22s}" + "".join(f"{e:>24s}" for e in io_order))
        for r in rows:
            print(f"{r['workload']:22s}" + "".join(f"{r['ms'].get(e, float('nan')):24.3f}" for e in io_order))
    print(f"floors: copy {fl['copy_GBps']:.1f} GB/s, matmul {fl['matmul_GFLOPs']:.1f} GFLOP/s; ms are medians "
          f"of {args.repeat} interleaved rounds; 'vs peer' = best peer time / tvmfuse time (>1: tvmfuse faster)")
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
           "cpu": C.llvm_system_cpu(), "threads": args.threads, "load_avg": os.getloadavg(),
           "command": " ".join([sys.executable.split("/")[-1]] + sys.argv), "floors": fl, "rows": rows}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
