"""PyTorch baselines on the GPU for the models of a ``gpu_check.py --build DIR`` plan, at the plan's sizes.

Runs on the GPU machine beside ``gpu_run.py`` (torch there; no TVM, no tvmfuse): each family / demo model is
written here in torch eager at the size the plan recorded (fp32, TF32 off: tvmfuse's CUDA kernels are plain
fp32 FMA; BatchNorm folded into the conv as tvmfuse folds it), and each corpus model of the plan is rebuilt
from its public definition with ``corpus/make_corpus.py``'s builders (random weights: timing does not
depend on them). ``--compile a,b`` also times ``torch.compile`` (Inductor, default mode) for those models.
Device time per inference with CUDA events (median of ``--rounds`` rounds of ``--number`` calls, inputs on
the GPU); writes ``$OUT/gpu_torch.json`` when ``OUT`` is set. Timing only: numerics are ``gpu_run.py``'s.

    python benchmarks/gpu_torch.py DIR [--compile elementwise_chain,rmsnorm] [--only a,b]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
DEV = "cuda"   # --device cpu: a smoke test of this script where there is no GPU


def _w(*shape, scale=1.0):
    return torch.randn(*shape, device=DEV) * scale


def _layernorm_parts(d):
    return _w(d, scale=0.1) + 1, _w(d, scale=0.1)


def family(name: str, size: dict):
    """(fn, args) computing the plan model ``name`` at ``size`` in torch eager."""
    s = size
    if name == "elementwise_chain":
        a, b, c = (_w(s["n"]) for _ in range(3))
        return (lambda a, b, c: torch.sigmoid((a + b) * c)), (a, b, c)
    if name == "matmul_bias_gelu":
        x, w, bias = _w(s["m"], s["k"]), _w(s["k"], s["n"]), _w(s["n"], scale=0.1)
        return (lambda x: F.gelu(x @ w + bias)), (x,)
    if name in ("conv_bn_relu_residual", "depthwise_conv_bn_relu_residual"):
        c, n = s["channels"], s["size"]
        groups = c if name.startswith("depthwise") else 1
        w, bias = _w(c, c // groups, 3, 3, scale=0.1), _w(c, scale=0.1)
        return (lambda x: F.relu(F.conv2d(x, w, bias, padding=1, groups=groups)) + x), (_w(1, c, n, n),)
    if name in ("layernorm_decomposed", "softmax_decomposed", "layernorm_softmax", "rmsnorm", "mean_variance"):
        x = _w(s["rows"], s["d"])
        g, b = _layernorm_parts(s["d"])
        fn = {"layernorm_decomposed": lambda x: F.layer_norm(x, (x.shape[-1],), g, b),
              "softmax_decomposed": lambda x: torch.softmax(x, -1),
              "layernorm_softmax": lambda x: torch.softmax(F.layer_norm(x, (x.shape[-1],), g, b), -1),
              "rmsnorm": lambda x: F.rms_norm(x, (x.shape[-1],), g, eps=1e-6),
              "mean_variance": lambda x: torch.var_mean(x, -1, correction=0, keepdim=True)}[name]
        return fn, (x,)
    if name == "instancenorm_silu":
        c, n = s["channels"], s["size"]
        g, b = _layernorm_parts(c)
        return (lambda x: F.silu(F.instance_norm(x, weight=g, bias=b, eps=1e-5))), (_w(1, c, n, n),)
    if name == "qkv_projection":
        x, ws = _w(s["seq"], s["hidden"]), [_w(s["hidden"], s["hidden"]) for _ in range(3)]
        return (lambda x: (x @ ws[0], x @ ws[1], x @ ws[2])), (x,)
    if name == "swiglu":
        x, wg, wu = _w(s["seq"], s["hidden"]), _w(s["hidden"], s["ffn"]), _w(s["hidden"], s["ffn"])
        return (lambda x: F.silu(x @ wg) * (x @ wu)), (x,)
    if name in ("attention", "attention_causal"):
        seq, heads, dh = s["seq"], s["heads"], s["head_dim"]
        causal = name.endswith("causal")

        def attn(q, k, v):
            split = [t.view(1, seq, heads, dh).transpose(1, 2) for t in (q, k, v)]
            o = F.scaled_dot_product_attention(*split, is_causal=causal)
            return o.transpose(1, 2).reshape(1, seq, heads * dh)
        return attn, tuple(_w(1, seq, heads * dh) for _ in range(3))
    if name == "transformer_block":
        seq, hid, heads, ffn = s["seq"], s["hidden"], s["heads"], s["ffn"]
        dh = hid // heads
        wq, wk, wv, wo = (_w(hid, hid, scale=hid ** -0.5) for _ in range(4))
        bq, bk, bv, bo = (_w(hid, scale=0.1) for _ in range(4))
        w1, b1, w2, b2 = _w(hid, ffn, scale=hid ** -0.5), _w(ffn, scale=0.1), _w(ffn, hid, scale=ffn ** -0.5), \
            _w(hid, scale=0.1)
        g1, be1 = torch.ones(hid, device=DEV), torch.zeros(hid, device=DEV)
        g2, be2 = _layernorm_parts(hid)

        def block(x):
            h = F.layer_norm(x, (hid,), g1, be1)
            q, k, v = ((h @ w + b).view(seq, heads, dh).transpose(0, 1) for w, b in ((wq, bq), (wk, bk), (wv, bv)))
            p = torch.softmax((q @ k.transpose(1, 2)) * dh ** -0.5, -1)
            ctx = (p @ v).transpose(0, 1).reshape(seq, hid)
            x1 = x + ctx @ wo + bo
            return x1 + F.gelu(F.layer_norm(x1, (hid,), g2, be2) @ w1 + b1) @ w2 + b2
        return block, (_w(seq, hid),)
    if name == "resnet_block":
        c, n, batch = s["channels"], s["size"], s["batch"]
        w1, w2 = _w(c, c, 3, 3, scale=0.05), _w(c, c, 3, 3, scale=0.05)
        b1, b2 = _w(c, scale=0.1), _w(c, scale=0.1)
        return (lambda x: F.relu(F.conv2d(F.relu(F.conv2d(x, w1, b1, padding=1)), w2, b2, padding=1) + x)), \
            (_w(batch, c, n, n),)
    return None


def corpus_model(name: str):
    """(module, args) for corpus model ``name`` from make_corpus.py's builders, on the GPU, eval mode."""
    sys.path.insert(0, os.path.join(HERE, "..", "corpus"))
    import make_corpus as MC

    for mname, builder, library, inputs, _out in MC.MODELS:
        if mname != name:
            continue
        module, _cfg = builder()
        module = MC._single_output(MC._perturb(module, 0), library).eval().to(DEV)
        args = []
        for spec in inputs:
            if spec["dtype"] == "int64":
                lo, hi = spec.get("int_range", [0, 2])
                args.append(torch.randint(lo, hi, spec["shape"], device=DEV))
            else:
                args.append(torch.randn(*spec["shape"], device=DEV))
        return module, tuple(args)
    return None


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def device_ms(fn, args, number: int, rounds: int) -> tuple[float, float, float]:
    """(median, min, max) ms per call over ``rounds`` rounds of ``number`` calls, CUDA events."""
    with torch.no_grad():
        for _ in range(3):
            fn(*args)
        _sync()
        times = []
        for _ in range(rounds):
            if DEV != "cuda":
                t0 = time.perf_counter()
                for _ in range(number):
                    fn(*args)
                times.append((time.perf_counter() - t0) * 1e3 / number)
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(number):
                fn(*args)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / number)
    times.sort()
    return times[len(times) // 2], times[0], times[-1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir")
    p.add_argument("--only", default="")
    p.add_argument("--compile", default="", help="comma-separated models also timed with torch.compile")
    p.add_argument("--number", type=int, default=20)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args(argv)
    global DEV
    DEV = args.device
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    with open(os.path.join(args.dir, "plan.json")) as f:
        plan = json.load(f)
    only = set(args.only.split(",")) if args.only else None
    compiled = set(args.compile.split(",")) if args.compile else set()
    info = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu", "tf32": False,
            "cudnn": torch.backends.cudnn.version(), "date": time.strftime("%Y-%m-%d"),
            "number": args.number, "rounds": args.rounds}
    print(json.dumps(info), flush=True)
    rows = []
    for prow in plan["rows"]:
        name = prow["model"]
        if only and name not in only:
            continue
        row = {"model": name, "size": prow.get("size")}
        try:
            made = family(name, prow.get("size") or {}) if prow.get("family") != "corpus" else None
            made = made or corpus_model(name)
            if made is None:
                row["error"] = "no torch version of this model"
            else:
                fn, fargs = made
                row["eager_ms"], row["eager_min_ms"], row["eager_max_ms"] = device_ms(fn, fargs, args.number,
                                                                                     args.rounds)
                if name in compiled:
                    t0 = time.perf_counter()
                    cfn = torch.compile(fn)
                    with torch.no_grad():
                        cfn(*fargs)
                    _sync()
                    row["compile_s"] = round(time.perf_counter() - t0, 1)
                    row["compiled_ms"], row["compiled_min_ms"], row["compiled_max_ms"] = device_ms(
                        cfn, fargs, args.number, args.rounds)
        except Exception as e:   # recorded per model: the baseline run goes on
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            row["trace"] = traceback.format_exc()[-1200:]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'model':34s} {'eager ms':>9s} {'compiled ms':>11s}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:34s} ERR {r['error'][:80]}")
        else:
            c = f"{r['compiled_ms']:11.4f}" if "compiled_ms" in r else f"{'-':>11s}"
            print(f"{r['model']:34s} {r['eager_ms']:9.4f} {c}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_torch.json"), "w") as f:
            json.dump({**info, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
