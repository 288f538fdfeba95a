"""Knob-space fuzzer: every config a template's knob space holds must schedule, build and compute the
unscheduled kernel's numbers (the tuner samples these spaces; tests that sample them flake when it does not).

For each workload (tests/schedule_cases.py's graphs and a few corpus-like shapes: odd N, 1/5/136 rows,
symbolic rows), each named target, each kernel a template matches (each size bucket of a symbolic
template), it draws configs from ``Template.space(match, target)`` with a deterministic seed, applies each
with ``schedules.base.schedule_with``, builds it, and on the x86 targets this host has the CPU features of (haswell; skylake-avx512 on an
AVX-512 host: ``runs_here``) runs it against the unscheduled kernel on random inputs (symbolic extents at two sizes).
Cross targets (neon, CUDA) are scheduled and built only.  Each candidate runs in a worker process under a
time limit (a crash or a hang is recorded, the fuzz goes on).

    python benchmarks/space_fuzz.py --samples 20 --json out.json
    python benchmarks/space_fuzz.py --cases qkv_3d,gemv --targets skylake --samples 50
    python benchmarks/space_fuzz.py --replay out.json          # rerun the failures of a report

The JSON report: ``{"settings", "summary": {family: {target: {ok, schedule, build, numbers, timeout,
crash}}}, "failures": [{case, target, kernel, family, bucket, config, kind, message}]}``.  Exit status 1
when any candidate failed.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import select
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

TARGETS = {
    "haswell": {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "haswell", "num-cores": 2},
    "skylake": {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512", "num-cores": 2},
    "neon": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "neoverse-n1", "num-cores": 4},
    "cuda": {"kind": "cuda", "arch": "sm_80"},
}
RUNS_ON_HOST_CANDIDATES = ("haswell", "skylake")   # x86 targets that run where the host has their features
RTOL, ATOL = 1e-4, 1e-4                    # float32 reassociation of reductions (atol scaled by max |ref|)
SYMBOLIC_SIZES = (5, 37)                   # a symbolic extent without a bucket size: run at these


# ----------------------------------------------------------------------------- workloads
def _cases() -> dict:
    """name -> a function making the ONNX model (imports the test helpers lazily: worker side only)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import numpy as np

    import schedule_cases as S
    from tvmfuse import models as M

    def attention(b=1, h=2, sq=13, sk=21, d=16, seq_sym=False):
        g = M._G("attention")
        sq_ = "sequence" if seq_sym else sq
        sk_ = "sequence" if seq_sym else sk
        q, k, v = g.input("q", [b, h, sq_, d]), g.input("k", [b, h, sk_, d]), g.input("v", [b, h, sk_, d])
        s = g.op("Mul", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])),
                 g.const(np.float32(d ** -0.5)))
        g.op("MatMul", g.op("Softmax", s, axis=-1), v)
        g.rename_last("y", [b, h, sq_, d])
        return g.model()

    def mlp_sym(rows="batch", k=64, n=32):
        g = M._G("mlp_sym")
        g.op("Relu", g.op("Add", g.op("MatMul", g.input("x", (rows, k)), g.weight((k, n))), g.weight((n,), 0.1)))
        g.rename_last("y", (rows, n))
        return g.model()

    def proj3d_sym(k=64, n=64):
        g = M._G("proj3d_sym")
        x = g.input("x", ("batch", "sequence", k))
        g.op("Add", g.op("MatMul", x, g.weight((k, n))), g.weight((n,), 0.1))
        g.rename_last("y", ("batch", "sequence", n))
        return g.model()

    def qkv_sym(h=64):
        g = M._G("qkv_sym")
        x = g.input("x", ("batch", "sequence", h))
        for name in "qkv":
            g.op("Add", g.op("MatMul", x, g.weight((h, h))), g.weight((h,), 0.1))
            g.rename_last(name, ("batch", "sequence", h))
        return g.model()

    def layernorm_sym(d=96):
        g = M._G("ln_sym")
        g.op("LayerNormalization", g.input("x", ("batch", "sequence", d)), g.weight((d,)), g.weight((d,)),
             axis=-1, epsilon=1e-5)
        g.rename_last("y", ("batch", "sequence", d))
        return g.model()

    return {
        # tests/schedule_cases.py
        "matmul_3d": S.matmul_3d, "matmul_3d_s1": lambda: S.matmul_3d(b=8, s=1, k=24, n=40),
        "matmul_3d_n37": lambda: S.matmul_3d(b=1, s=136, k=64, n=37, act="Sigmoid"),
        "matmul_n172": lambda: S.matmul_3d(b=1, s=5, k=96, n=172, act=None),
        "batched_matmul": S.batched_matmul, "broadcast_matmul": S.broadcast_matmul,
        "scores_matmul": S.scores_matmul, "gemm_transb": S.gemm_transb, "gemv": S.gemv,
        "gemv_1000": lambda: S.gemv(k=64, n=1000),
        "qkv_3d": S.qkv_3d, "qkv_3d_s1": lambda: S.qkv_3d(b=4, s=1, h=40),
        "qkv_wide": lambda: S.qkv_3d(b=1, s=5, h=172), "swiglu_3d": S.swiglu_3d,
        "swiglu_37": lambda: S.swiglu_3d(b=1, s=136, h=32, f=37),
        "vit_block": S.vit_block,
        "maxpool": S.maxpool, "maxpool_even": lambda: S.maxpool(c=16, h=32, w=32),
        "maxpool_small": lambda: S.maxpool(c=4, h=8, w=8), "avgpool": S.avgpool, "global_avgpool": S.global_avgpool,
        "channel_layernorm": S.channel_layernorm, "transposed_layernorm": S.transposed_layernorm,
        "pooled_layernorm_flatten": S.pooled_layernorm_flatten, "residual_layernorm": S.residual_layernorm,
        "mean_hw": S.mean_hw, "embedding": S.embedding, "layout_ops": S.layout_ops,
        "softmax_channels": S.softmax_channels,
        "conv": S.conv, "conv_s2": lambda: S.conv(cin=16, cout=24, h=14, w=14, s=2),
        "conv_1x1": lambda: S.conv(cin=32, cout=48, h=7, w=7, k=1), "conv_dw": lambda: S.conv(
            cin=16, cout=16, h=15, w=15, group=16), "conv_dil": lambda: S.conv(dil=2),
        "conv_small_plane": lambda: S.conv(cin=64, cout=64, h=7, w=7),
        "conv_shortcut": S.conv_with_shortcut_conv,
        # tvmfuse.models: norms, norm + matmul, softmax
        "layernorm_r1": lambda: M.layernorm(rows=1, d=172), "layernorm_r136": lambda: M.layernorm(rows=136, d=96),
        "softmax_r5": lambda: M.softmax(rows=5, d=37), "rmsnorm": M.rmsnorm, "mean_variance": M.mean_variance,
        "layernorm_softmax": M.layernorm_softmax, "instancenorm_silu": M.instancenorm_silu,
        "norm_matmul": lambda: M.norm_matmul(rows=5, d=96, n=37),
        "norm_matmul_qkv": lambda: M.norm_matmul(rows=136, d=64, n=64, heads=3),
        "rms_swiglu": lambda: M.norm_matmul(rows=1, d=64, n=172, norm="rmsnorm", swiglu=True),
        "norm_matmul_gelu": lambda: M.norm_matmul(rows=17, d=48, n=96, act="gelu", batch=2),
        "elementwise_chain": M.elementwise_chain,
        # attention
        "attention": attention, "attention_s1": lambda: attention(sq=1, sk=37, d=32),
        "attention_long": lambda: attention(b=1, h=1, sq=136, sk=136, d=32),
        # symbolic rows
        "mlp_sym": mlp_sym, "mlp_sym_n37": lambda: mlp_sym(n=37), "proj3d_sym": proj3d_sym,
        "qkv_sym": qkv_sym, "layernorm_sym": layernorm_sym,
        "norm_matmul_sym": lambda: M.norm_matmul(rows="sequence", d=64, n=64, batch=1),
        "attention_sym": lambda: attention(seq_sym=True),
        "transformer_sym": lambda: M.transformer_block(seq="sequence", hidden=64, heads=2, ffn=128),
    }


CASE_NAMES = ("matmul_3d matmul_3d_s1 matmul_3d_n37 matmul_n172 batched_matmul broadcast_matmul scores_matmul "
              "gemm_transb gemv gemv_1000 qkv_3d qkv_3d_s1 qkv_wide swiglu_3d swiglu_37 vit_block maxpool "
              "maxpool_even maxpool_small avgpool global_avgpool channel_layernorm transposed_layernorm pooled_layernorm_flatten "
              "residual_layernorm mean_hw embedding layout_ops softmax_channels conv conv_s2 conv_1x1 conv_dw "
              "conv_dil conv_small_plane conv_shortcut layernorm_r1 layernorm_r136 softmax_r5 rmsnorm "
              "mean_variance layernorm_softmax instancenorm_silu norm_matmul norm_matmul_qkv rms_swiglu "
              "norm_matmul_gelu elementwise_chain attention attention_s1 attention_long mlp_sym mlp_sym_n37 "
              "proj3d_sym qkv_sym layernorm_sym norm_matmul_sym attention_sym transformer_sym").split()


# ----------------------------------------------------------------------------- worker side
def _seed(*parts) -> int:
    return int(hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:12], 16)


def _size_sets(func, task) -> list[dict]:
    """Sizes of the symbolic variables to run a candidate at: the bucket's own size and a smaller odd one
    inside it; without a bucket, ``SYMBOLIC_SIZES``; [{}] for a static kernel."""
    from tvmfuse import _compat as C

    names = []

    def visit(node):
        if isinstance(node, C.tirx.Var) and str(node.name) not in names:
            names.append(str(node.name))

    for p in func.params:
        for d in p.shape:
            C.post_order_visit(d, visit)
    if not names:
        return [{}]
    if task.sizes:
        small = {n: max(1, (v // 2) | 1) if v > 1 else 1 for n, v in task.sizes.items()}
        base = {n: 1 for n in names}
        out = [{**base, **task.sizes}]
        if task.bucket and "<=" in task.bucket:
            out.append({**base, **small})
        else:
            out.append({**base, **{n: v + 3 if v > 1 else v for n, v in task.sizes.items()}})
        return out
    return [{n: (s if i == len(names) - 1 else 2) for i, n in enumerate(names)} for s in SYMBOLIC_SIZES]


class _Job:
    """One (case, target): its tasks and their sampled configs, made identically in every worker run."""

    def __init__(self, case: str, target_name: str, samples: int, seed: int, families=None):
        from tvmfuse import _compat as C
        from tvmfuse.target import host_target, parse_target
        from tvmfuse.tune.tasks import fused_module, tasks_for

        self.case, self.target_name = case, target_name
        spec = TARGETS[target_name]
        self.target = C.Target(spec, host=host_target()) if spec["kind"] == "cuda" else parse_target(spec)
        model = _cases()[case]()
        mod = fused_module(model, self.target)
        self.tasks = []
        for gv, func in mod.functions.items():
            if not isinstance(func, C.PrimFunc):
                continue
            for t in tasks_for(func, self.target, str(gv.name_hint)):
                if families and not any(f in t.family for f in families):
                    continue
                self.tasks.append(t)
        self.candidates = []        # (task index, sample index, config)
        import random

        for ti, t in enumerate(self.tasks):
            r = random.Random(_seed(seed, case, target_name, t.name, t.bucket))
            seen = []
            cfgs = [t.default_config]
            for _ in range(samples * 3):
                if len(cfgs) >= samples + 1:
                    break
                c = t.space.sample(r)
                if c not in cfgs and c not in seen:
                    cfgs.append(c)
                seen.append(c)
            for si, c in enumerate(cfgs):
                self.candidates.append((ti, si, c))
        self._refs = {}

    def reference(self, ti: int):
        """Inputs and outputs of the unscheduled kernel of task ``ti`` at each size set (host build)."""
        if ti not in self._refs:
            import numpy as np

            from tvmfuse import _compat as C
            from tvmfuse.target import host_target
            from tvmfuse.tune.measure import normal_inputs

            t = self.tasks[ti]
            lib = C.build_prim_module(C.IRModule({"main": t.func.with_attr("global_symbol", "main")}),
                                      host_target())
            refs = []
            for k, sizes in enumerate(_size_sets(t.func, t)):
                args = normal_inputs(t.func, seed=_seed("inputs", self.case, t.name, k), sizes=sizes)
                args = [a * np.asarray(0.5, a.dtype) if a.dtype.kind == "f" else a for a in args]
                outs = _call(lib, args)
                refs.append((sizes, args, outs))
            self._refs[ti] = refs
        return self._refs[ti]

    def run(self, ci: int) -> dict:
        """Schedule, build and (host targets) run candidate ``ci``: {"kind": "ok"} or the failure."""
        from tvmfuse import _compat as C
        from tvmfuse.schedules.base import schedule_with
        from tvmfuse.tune.measure import compare_outputs

        ti, si, cfg = self.candidates[ci]
        t = self.tasks[ti]
        if not t.space.contains(cfg):
            return {"kind": "space", "message": f"config outside its space: {t.space.excluded(cfg)}"}
        try:
            func = schedule_with(t.template, t.match, t.func, cfg)
        except Exception as e:  # recorded: this is what the fuzzer looks for
            return _fail("schedule", e)
        try:
            # built for the named target (what the tuner builds); an x86 one then runs on this host
            lib = C.build_prim_module(C.IRModule({"main": func.with_attr("global_symbol", "main")}), self.target)
        except Exception as e:  # recorded
            return _fail("build", e)
        if not runs_here(self.target_name):
            return {"kind": "ok"}
        for sizes, args, want in self.reference(ti):
            try:
                got = _call(lib, args)
            except Exception as e:  # recorded
                return _fail("run", e, f"sizes {sizes}")
            why = compare_outputs(want, got, RTOL, ATOL)
            if why is not None:
                return {"kind": "numbers", "message": f"sizes {sizes}: {why}"}
        return {"kind": "ok"}


def runs_here(target_name: str) -> bool:
    """Whether this host runs what is built for ``target_name`` (an x86 target whose CPU features the host
    has: skylake-avx512 code on an AVX2-only host would die with SIGILL); the others are built only."""
    from tvmfuse.target import parse_target, runs_on_host

    return target_name in RUNS_ON_HOST_CANDIDATES and runs_on_host(parse_target(TARGETS[target_name]))


def _call(lib, args):
    import numpy as np

    from tvmfuse import _compat as C

    ts = [C.tensor(np.array(a)) for a in args]
    lib["main"](*ts)
    return [x.numpy() for x in ts]


def _fail(kind: str, e: BaseException, where: str = "") -> dict:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    # TVM errors end with the check that failed; keep the head and the tail
    msg = " | ".join(lines[:2] + (["..."] + lines[-3:] if len(lines) > 5 else lines[2:]))
    return {"kind": kind, "message": (f"{where}: " if where else "") + f"{type(e).__name__}: {msg}"[:1500]}


def worker_main() -> int:
    """Reads one job per stdin line; writes JSON lines to stdout: ``{"candidates": [...]}`` once per job,
    then ``{"start": i}`` before and ``{"done": i, ...}`` after each candidate, ``{"end": true}`` last."""
    out = os.fdopen(os.dup(1), "w")   # replies on a copy of stdout; fd 1 (TVM's C++ prints too) -> stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        req = json.loads(line)
        try:
            job = _Job(req["case"], req["target"], req["samples"], req["seed"], req.get("families"))
        except Exception as e:  # a workload that does not build is a fuzzer-level failure, reported
            out.write(json.dumps({"job_error": f"{type(e).__name__}: {e}"[:1500],
                                  "trace": traceback.format_exc()[-1500:]}) + "\n")
            out.flush()
            continue
        only = req.get("only")
        out.write(json.dumps({"candidates": [
            {"kernel": job.tasks[ti].name, "family": job.tasks[ti].family, "bucket": job.tasks[ti].bucket,
             "sample": si, "config": c} for ti, si, c in job.candidates]}) + "\n")
        out.flush()
        for ci in range(len(job.candidates)):
            if ci in set(req.get("skip", ())) or (only is not None and ci not in only):
                continue
            out.write(json.dumps({"start": ci}) + "\n")
            out.flush()
            t0 = time.time()
            res = job.run(ci)
            res.update(done=ci, s=round(time.time() - t0, 2))
            out.write(json.dumps(res) + "\n")
            out.flush()
        out.write(json.dumps({"end": True}) + "\n")
        out.flush()
    return 0


# ----------------------------------------------------------------------------- parent side
class _Proc:
    def __init__(self, python: str):
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "TVM_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        self.p = subprocess.Popen([python, os.path.abspath(__file__), "--worker"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        self.buf = b""

    def send(self, req: dict):
        self.p.stdin.write((json.dumps(req) + "\n").encode())
        self.p.stdin.flush()

    def read(self, timeout: float):
        """The next reply, None on timeout, or {"died": rc} when the worker exited.  Reads the pipe's file
        descriptor itself (a buffered reader would hold lines that ``select`` no longer sees)."""
        deadline = time.time() + timeout
        fd = self.p.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.time()
            if left <= 0:
                return None
            r, _, _ = select.select([fd], [], [], left)
            if not r:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return {"died": self.p.wait()}
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def kill(self):
        self.p.kill()
        self.p.wait()


def run_job(req: dict, python: str, timeout: float, setup_timeout: float, log) -> tuple[list, list]:
    """All candidates of one (case, target) job: (candidate descriptions, results), restarting the worker
    past a candidate that crashed it or ran over ``timeout`` seconds."""
    skip, results, cands = [], {}, None
    while True:
        proc = _Proc(python)
        proc.send({**req, "skip": skip + list(results)})
        msg = proc.read(setup_timeout)
        if msg is None or "died" in msg:
            proc.kill()
            return [], [{"kind": "job", "message": "workload setup timed out or crashed" if msg is None
                         else f"worker died during setup (exit {msg['died']})"}]
        if "job_error" in msg:
            proc.kill()
            return [], [{"kind": "job", "message": msg["job_error"]}]
        cands = msg["candidates"]
        current, restart = None, False
        while True:
            msg = proc.read(timeout if current is not None else setup_timeout)
            if msg is None or "died" in msg:
                if current is None:
                    proc.kill()
                    return cands, list(results.values()) + [{"kind": "job", "message": "worker stalled"}]
                kind = "timeout" if msg is None else "crash"
                results[current] = {"kind": kind, "done": current, "message": (
                    f"over {timeout:g} s" if msg is None else f"worker exited with {msg['died']}")}
                log(req, cands[current], results[current])
                proc.kill()
                restart = True
                break
            if "start" in msg:
                current = msg["start"]
            elif "done" in msg:
                results[msg["done"]] = msg
                log(req, cands[msg["done"]], msg)
                current = None
            elif msg.get("end"):
                proc.kill()
                break
        if not restart:
            return cands, [results[i] for i in sorted(results)]


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        return worker_main()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--cases", default="all", help=f"comma-separated workloads (default all: {' '.join(CASE_NAMES)})")
    ap.add_argument("--targets", default="haswell,skylake,neon,cuda", help=f"comma-separated, of {list(TARGETS)}")
    ap.add_argument("--families", default="", help="comma-separated substrings of template families to fuzz")
    ap.add_argument("--samples", type=int, default=10, help="sampled configs per kernel (plus its default)")
    ap.add_argument("--cuda-samples", type=int, default=4, help="sampled configs per kernel on cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per candidate")
    ap.add_argument("--setup-timeout", type=float, default=300.0, help="seconds to build a workload's tasks")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes in parallel")
    ap.add_argument("--replay", help="a report: rerun only its failed candidates")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--progress", action="store_true", help="print a line per finished workload")
    args = ap.parse_args(argv)
    families = [f for f in args.families.split(",") if f]

    jobs = []
    if args.replay:
        with open(args.replay) as f:
            old = json.load(f)
        settings = old["settings"]
        by_job = collections.defaultdict(list)
        for fl in old["failures"]:
            if "index" in fl:
                by_job[(fl["case"], fl["target"])].append(fl["index"])
        for (case, tgt), idx in sorted(by_job.items()):
            jobs.append({"case": case, "target": tgt, "seed": settings["seed"], "families": settings["families"],
                         "samples": settings["cuda_samples"] if tgt == "cuda" else settings["samples"],
                         "only": sorted(idx)})
    else:
        settings = {k: getattr(args, k) for k in ("samples", "cuda_samples", "seed", "timeout")}
        settings.update(families=families, cases=args.cases, targets=args.targets, rtol=RTOL, atol=ATOL)
        cases = CASE_NAMES if args.cases == "all" else args.cases.split(",")
        unknown = [c for c in cases if c not in CASE_NAMES] + [t for t in args.targets.split(",") if t not in TARGETS]
        if unknown:
            ap.error(f"unknown cases/targets {unknown}")
        for tgt in args.targets.split(","):
            for case in cases:
                jobs.append({"case": case, "target": tgt, "seed": args.seed, "families": families,
                             "samples": args.cuda_samples if tgt == "cuda" else args.samples})

    failures, summary = [], collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
    t0 = time.time()

    def log(req, cand, res):
        kind = res["kind"]
        summary[cand["family"]][req["target"]][kind] += 1
        if kind != "ok":
            print(f"[{time.time() - t0:7.0f}s] {kind:8s} {req['case']} {req['target']} {cand['kernel']} "
                  f"{cand['family']} {cand['bucket'] or ''} {json.dumps(cand['config'])}: "
                  f"{res.get('message', '')[:300]}", flush=True)

    def one(req):
        cands, results = run_job(req, args.python, args.timeout, args.setup_timeout, log)
        if args.progress:
            print(f"[{time.time() - t0:7.0f}s] done {req['case']} {req['target']}: {len(results)} candidates, "
                  f"{sum(r['kind'] != 'ok' for r in results)} failed", flush=True)
        out = []
        for res in results:
            if res["kind"] == "ok":
                continue
            if res["kind"] == "job":
                print(f"JOB FAILED {req['case']} {req['target']}: {res['message'][:300]}", flush=True)
                out.append({"case": req["case"], "target": req["target"], "kind": "job", "message": res["message"]})
                continue
            c = cands[res["done"]]
            out.append({"case": req["case"], "target": req["target"], "index": res["done"], **c,
                        "kind": res["kind"], "message": res.get("message", "")})
        return out

    import threading
    from concurrent.futures import ThreadPoolExecutor

    lock = threading.Lock()

    def report(done: int) -> dict:
        rep = {"settings": settings, "seconds": round(time.time() - t0), "jobs_done": done, "jobs": len(jobs),
               "summary": {f: {t: dict(c) for t, c in v.items()} for f, v in sorted(summary.items())},
               "failures": failures}
        if args.json:       # rewritten after every workload: a run cut short keeps what it did
            with open(args.json + ".tmp", "w") as f:
                json.dump(rep, f, indent=1)
            os.replace(args.json + ".tmp", args.json)
        return rep

    rep = report(0)
    with ThreadPoolExecutor(max(1, args.jobs)) as ex:
        for i, out in enumerate(ex.map(one, jobs)):
            with lock:
                failures.extend(out)
                rep = report(i + 1)
    print(json.dumps(rep["summary"], indent=1))
    print(f"{sum(sum(c.values()) for v in summary.values() for c in v.values())} candidates, "
          f"{len(failures)} failures, {rep['seconds']} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
