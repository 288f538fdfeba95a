"""GPU check of tvmfuse's CUDA schedules, on one NVIDIA GPU: every family's pattern model and both demo
models are built with tvmfuse and with stock TVM (FuseOps + dlight defaults), checked against a float64
reference (onnx's ReferenceEvaluator on float64 inputs cast back), timed, and compared with torch when
it is installed.  Prints one table (ratios, roofline fractions) and writes JSON to $OUT if set.

    python benchmarks/gpu_check.py [--arch sm_90] [--only a,b] [--repeat 50]
    python benchmarks/gpu_check.py --dry-run     # no GPU: build everything for cuda, run nothing
    python benchmarks/gpu_check.py --build DIR [--corpus resnet18,bert] [--sizes small]
        # here (TVM's compiler, nvcc, no GPU): export every model as a CUDA artifact (tvmfuse and stock) with
        # its inputs and reference outputs; then on a GPU machine that has only TVM's runtime:
        #   python benchmarks/gpu_run.py DIR    (numerics + timing; writes $OUT/gpu_run.json)

Roofline (H200 defaults, override with --hbm-tbs / --tflops): time >= max(bytes / HBM bandwidth,
flops / fp32 non-tensor-core peak); the fraction printed is that bound over the measured time.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import numpy as np

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M

FAMILY_MODELS = {      # pattern model -> the CUDA family it exercises
    "elementwise_chain": "cuda_elementwise",
    "matmul_bias_gelu": "cuda_matmul",
    "conv_bn_relu_residual": "cuda_conv2d",
    "layernorm_decomposed": "cuda_row_reduction",
    "softmax_decomposed": "cuda_row_reduction",
    "layernorm_softmax": "cuda_row_reduction",
    "rmsnorm": "cuda_row_reduction",
    "instancenorm_silu": "cuda_row_reduction",
    "mean_variance": "cuda_row_reduction",
    "qkv_projection": "cuda_siblings",
    "swiglu": "cuda_siblings",
    "depthwise_conv_bn_relu_residual": "cuda_depthwise_conv2d",
    "attention": "cuda_attention",
    "attention_causal": "cuda_attention",
}


def _attention_model(causal: bool):
    """bench_attention.py's multi-head attention graph (small by default: the dry run's size)."""
    spec = importlib.util.spec_from_file_location(
        "bench_attention", os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_attention.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return lambda seq=40, heads=2, head_dim=16: mod.attention_model(seq, heads, head_dim, causal)


# family models that are not in tvmfuse.models.PATTERN_MODELS under their own name
EXTRA_MODELS = {
    "depthwise_conv_bn_relu_residual": lambda **kw: M.conv_bn_relu_residual(depthwise=True, **kw),
    "attention": _attention_model(causal=False),
    "attention_causal": _attention_model(causal=True),
}
# GPU-sized inputs (the pattern builders' defaults are CPU-test sized)
SIZES = {
    "elementwise_chain": dict(n=1 << 24),
    "matmul_bias_gelu": dict(m=2048, k=1024, n=4096),
    "conv_bn_relu_residual": dict(channels=128, size=56),
    "layernorm_decomposed": dict(rows=8192, d=1024),
    "softmax_decomposed": dict(rows=8192, d=1024),
    "layernorm_softmax": dict(rows=8192, d=1024),
    "rmsnorm": dict(rows=8192, d=1024),
    "instancenorm_silu": dict(channels=256, size=64),
    "mean_variance": dict(rows=8192, d=1024),
    "qkv_projection": dict(seq=2048, hidden=1024),
    "swiglu": dict(seq=2048, hidden=1024, ffn=2816),
    "depthwise_conv_bn_relu_residual": dict(channels=256, size=56),
    "attention": dict(seq=2048, heads=12, head_dim=64),          # issue 14's attention, batch 1
    "attention_causal": dict(seq=2048, heads=12, head_dim=64),
    "transformer_block": dict(seq=512, hidden=768, heads=12, ffn=3072),
    "resnet_block": dict(channels=64, size=56, batch=8),
}
# the same families with their weights cut to fit one transfer to a GPU machine (64 MB in all)
SMALL_SIZES = {
    "matmul_bias_gelu": dict(m=4096, k=1024, n=1024),
    "qkv_projection": dict(seq=4096, hidden=512),
    "swiglu": dict(seq=4096, hidden=512, ffn=1408),
    "transformer_block": dict(seq=512, hidden=384, heads=6, ffn=1536),
}
RTOL, ATOL = 1e-3, 1e-4     # fp32 kernels vs a float64 reference (erf/exp approximations included)


def builders() -> dict:
    out = {name: EXTRA_MODELS.get(name) or M.PATTERN_MODELS[name] for name in FAMILY_MODELS}
    out.update(M.DEMO_MODELS)
    return out


def model_cost(model) -> tuple[float, float]:
    """(flops, bytes) lower bounds: MatMul/Gemm/Conv flops; graph inputs, weights and outputs once."""
    from onnx import shape_inference

    m = shape_inference.infer_shapes(model)
    shapes = {}
    for vi in list(m.graph.input) + list(m.graph.value_info) + list(m.graph.output):
        shapes[vi.name] = [d.dim_value for d in vi.type.tensor_type.shape.dim]
    for t in m.graph.initializer:
        shapes[t.name] = list(t.dims)
    flops = 0.0
    for n in m.graph.node:
        if n.op_type in ("MatMul", "Gemm") and n.output[0] in shapes:
            k = shapes[n.input[0]][-1]
            flops += 2.0 * float(np.prod(shapes[n.output[0]])) * k
        elif n.op_type == "Conv" and n.output[0] in shapes:
            w = shapes[n.input[1]]
            flops += 2.0 * float(np.prod(shapes[n.output[0]])) * float(np.prod(w[1:]))
    elem = 4
    io = [i.name for i in m.graph.input] + [t.name for t in m.graph.initializer] + [o.name for o in m.graph.output]
    nbytes = sum(float(np.prod(shapes[n])) * elem for n in io if n in shapes)
    return flops, nbytes


def reference64(model, feeds) -> dict:
    """The onnx reference evaluated in float64 (model and inputs cast), for the numerics check."""
    import onnx
    from onnx import numpy_helper

    m64 = onnx.ModelProto()
    m64.CopyFrom(model)
    for t in m64.graph.initializer:
        if t.data_type == onnx.TensorProto.FLOAT:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
    for vi in list(m64.graph.input) + list(m64.graph.output):
        if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    for n in m64.graph.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.t.data_type == onnx.TensorProto.FLOAT:
                    a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float64)))
    return M.reference_outputs(m64, {k: v.astype(np.float64) for k, v in feeds.items()})


def torch_time(model, feeds, repeat: int) -> float | None:
    """Median time of the same graph in torch (onnx2torch if installed), else None."""
    try:
        import torch
        from onnx2torch import convert
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    net = convert(model).cuda().eval()
    args = [torch.from_numpy(v).cuda() for v in feeds.values()]
    with torch.no_grad():
        for _ in range(3):
            net(*args)
        torch.cuda.synchronize()
        ts = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            net(*args)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def check_one(name, builder, target, args) -> dict:
    model = builder(**SIZES.get(name, {})) if not args.dry_run else builder()
    row = {"model": name, "family": FAMILY_MODELS.get(name, "demo"), "built": False}
    t0 = time.perf_counter()
    fused = tvmfuse.compile(model, target=target)
    stock = tvmfuse.compile(model, target=target, fusion=False, schedules=False, fast_math=False)
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    row["built"] = True
    row["templates"] = sorted({s["template"] for s in fused.report.schedules})
    # the family's template scheduled a kernel, and no kernel was left to dlight's fallback
    row["family_ok"] = (row["family"] == "demo" or row["family"] in row["templates"]) and \
        all(t.startswith("cuda_") for t in row["templates"])
    row["kernels"] = [stock.kernel_count, fused.kernel_count]
    if args.dry_run:
        src = C.cuda_device_source(fused.executable)
        row["cuda_kernels"] = src.count("__global__")
        return row
    feeds = M.random_feeds(model, seed=0)
    ref = reference64(model, feeds)
    out = fused.run(feeds)
    err = max(float(np.max(np.abs(out[k].astype(np.float64) - r))) for k, r in ref.items())
    row["max_abs_err"] = err
    row["numerics_ok"] = all(np.allclose(out[k], r, rtol=RTOL, atol=ATOL) for k, r in ref.items())
    row["tvmfuse_ms"] = fused.benchmark(feeds, repeat=args.repeat, warmup=5) * 1e3
    row["stock_ms"] = stock.benchmark(feeds, repeat=args.repeat, warmup=5) * 1e3
    tt = torch_time(model, feeds, args.repeat)
    row["torch_ms"] = tt * 1e3 if tt is not None else None
    flops, nbytes = model_cost(model)
    bound = max(nbytes / (args.hbm_tbs * 1e12), flops / (args.tflops * 1e12))
    row["roofline_frac"] = bound / (row["tvmfuse_ms"] * 1e-3)
    return row


def _tolerance_elementwise() -> dict:
    return {"kind": "allclose", "rtol": RTOL, "atol": ATOL}


CORPUS_REL_TOL = 1e-4   # the corpus target (tests/test_corpus.py): max |a - e| / max |e| vs onnxruntime


REF_SAMPLE = 1 << 16    # outputs larger than this are checked on a fixed random sample of this many elements


def feed_recipe(feeds: dict, draws: dict) -> list[dict]:
    """How ``gpu_run.py`` redraws the inputs: one ``default_rng(0)`` drawn input after input, in this order."""
    return [{"name": k, "shape": list(v.shape), "dtype": str(v.dtype), "draw": draws.get(k, "normal")}
            for k, v in feeds.items()]


def feeds_digest(arrays) -> str:
    import hashlib

    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _save_case(out_dir: str, name: str, refs: list) -> tuple[str, list]:
    """References (float64, stored as float32) of each output, all of it or a fixed sample of ``REF_SAMPLE`` flat indices."""
    rel = f"{name}/data.npz"
    arrays, shapes = {}, []
    rng = np.random.default_rng(1)
    for i, r in enumerate(refs):
        r = np.asarray(r, dtype=np.float64)
        shapes.append(list(r.shape))
        if r.size > REF_SAMPLE:
            idx = np.sort(rng.choice(r.size, REF_SAMPLE, replace=False)).astype(np.int64)
            arrays[f"idx{i}"] = idx.astype(np.int32 if r.size < 2**31 else np.int64)
            arrays[f"ref{i}"] = r.reshape(-1)[idx].astype(np.float32)
        else:
            arrays[f"ref{i}"] = r.reshape(-1).astype(np.float32)
    np.savez(os.path.join(out_dir, rel), **arrays)
    return rel, shapes


def build_one(out_dir: str, name: str, model, target, engines: dict, refs_fn, tolerance: dict,
              family: str) -> dict:
    """Export ``model`` once per engine (name -> compile options) and store how to redraw its inputs and
    its reference outputs (the inputs themselves are redrawn on the GPU machine, checked by digest)."""
    os.makedirs(os.path.join(out_dir, name), exist_ok=True)
    row = {"model": name, "family": family, "artifacts": {}, "tolerance": tolerance}
    t0 = time.perf_counter()
    inputs = None
    for eng, opts in engines.items():
        try:
            cm = tvmfuse.compile(model, target=target, **opts)
            tvmfuse.export(cm, os.path.join(out_dir, name, eng))
        except Exception as e:   # recorded per engine (gpu_run.py skips it): the build goes on
            row[f"{eng}_build_error"] = f"{type(e).__name__}: {str(e)[-1500:]}"
            print(f"{name} {eng}: build failed: {str(e).splitlines()[-1][:300] if str(e) else type(e)}",
                  file=sys.stderr)
            continue
        row["artifacts"][eng] = f"{name}/{eng}"
        row[f"{eng}_kernels"] = cm.kernel_count
        inputs = inputs or [s.name for s in cm.inputs]
        if eng == "tvmfuse":
            row["templates"] = sorted({s["template"] for s in cm.report.schedules})
    row["build_s"] = round(time.perf_counter() - t0, 1)
    if inputs is None:
        return row
    feeds, draws, refs = refs_fn()
    row["feeds"] = feed_recipe(feeds, draws)
    row["feed_order"] = inputs
    row["feeds_sha256"] = feeds_digest(feeds[k] for k in inputs)
    row["data"], row["output_shapes"] = _save_case(out_dir, name, refs)
    return row


def _without_families(families: set):
    """A context in which tvmfuse's templates of ``families`` decline every kernel (the fallback takes
    them): a diagnostic build that tells which family's kernels make a model's numbers wrong on the GPU."""
    import contextlib

    import tvmfuse.schedules as S

    @contextlib.contextmanager
    def ctx():
        real = S.schedule_prim_func

        def declining(*a, **kw):
            res = real(*a, **kw)
            return None if res is not None and res.template in families else res
        S.schedule_prim_func = declining
        try:
            yield
        finally:
            S.schedule_prim_func = real
    return ctx()


def add_bisect_variants(out_dir: str, row: dict, model, target) -> None:
    """One more artifact of the model per CUDA family it uses, built with that family's kernels on the
    fallback (``no_<family>``): gpu_run.py checks each, so a wrong model names the family at fault."""
    for fam in row.get("templates", []):
        if not fam.startswith("cuda_"):
            continue
        eng = f"no_{fam}"
        try:
            with _without_families({fam}):
                cm = tvmfuse.compile(model, target=target)
            tvmfuse.export(cm, os.path.join(out_dir, row["model"], eng))
        except Exception as e:   # recorded per variant: the build goes on
            row[f"{eng}_build_error"] = f"{type(e).__name__}: {str(e)[-600:]}"
            continue
        row["artifacts"][eng] = f"{row['model']}/{eng}"


def build(args, target) -> int:
    """Write DIR/plan.json and one folder per model (artifacts + data.npz) for ``gpu_run.py``."""
    out_dir = args.build
    os.makedirs(out_dir, exist_ok=True)
    engines = {"tvmfuse": {}, "stock": dict(fusion=False, schedules=False, fast_math=False)}
    plan = {"arch": args.arch, "date": time.strftime("%Y-%m-%d"), "tvm": C.TVM_VERSION,
            "hbm_tbs": args.hbm_tbs, "tflops": args.tflops, "sizes": args.sizes, "rows": []}
    todo = builders()
    names = args.only.split(",") if args.only else list(todo)
    for name in names:
        size = {"gpu": SIZES.get(name, {}), "small": SMALL_SIZES.get(name, SIZES.get(name, {})),
                "default": {}}[args.sizes]
        model = todo[name](**size)

        def refs_fn(model=model):
            feeds = M.random_feeds(model, seed=0)
            return feeds, {}, list(reference64(model, feeds).values())

        row = build_one(out_dir, name, model, target, engines, refs_fn, _tolerance_elementwise(),
                        FAMILY_MODELS.get(name, "demo"))
        row["size"] = size
        row["flops"], row["bytes"] = model_cost(model)
        plan["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.corpus:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "corpus"))
        import corpus_io
        import onnx
        import onnxruntime as ort

        entries = {e["name"]: e for e in corpus_io.load_manifest()["models"]}
        for name in args.corpus.split(","):
            entry = entries[name]
            path = corpus_io.model_path(entry, "static")

            def refs_fn(entry=entry, path=path):
                feeds = corpus_io.random_feeds(entry, np.random.default_rng(0))
                sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
                draws = {s["name"]: ["integers"] + list(s["int_range"]) for s in entry["inputs"]
                         if np.issubdtype(np.dtype(s["dtype"]), np.integer)}
                return feeds, draws, sess.run(None, feeds)

            row = build_one(out_dir, name, path, target, {"tvmfuse": {}}, refs_fn,
                            {"kind": "relative", "max": CORPUS_REL_TOL}, "corpus")
            if name in args.bisect.split(","):
                add_bisect_variants(out_dir, row, path, target)
            row["flops"], row["bytes"] = model_cost(onnx.load(path))
            plan["rows"].append(row)
            print(json.dumps(row), flush=True)
    plan["tolerance_note"] = ("pattern and demo models: allclose(rtol=%g, atol=%g) vs a float64 onnx reference; "
                              "corpus: max|a-e|/max|e| <= %g vs onnxruntime CPU" % (RTOL, ATOL, CORPUS_REL_TOL))
    with open(os.path.join(out_dir, "plan.json"), "w") as f:
        json.dump(plan, f, indent=1)
    total = sum(os.path.getsize(os.path.join(d, n)) for d, _s, ns in os.walk(out_dir) for n in ns)
    print(f"wrote {len(plan['rows'])} models to {out_dir} ({total / 1e6:.1f} MB)")
    return 0


def print_table(rows, dry_run: bool) -> None:
    if dry_run:
        print(f"{'model':32s} {'kernels stock->fused':>20s} {'cuda kernels':>12s} {'family':>6s}  templates")
        for r in rows:
            print(f"{r['model']:32s} {str(r['kernels'][0]) + ' -> ' + str(r['kernels'][1]):>20s} "
                  f"{r['cuda_kernels']:>12d} {'ok' if r['family_ok'] else 'NO':>6s}  {', '.join(r['templates'])}")
        return
    print(f"{'model':32s} {'ok':>3s} {'err':>9s} {'tvmfuse ms':>10s} {'stock/tf':>8s} {'torch/tf':>8s} {'roofline':>8s}")
    for r in rows:
        torch_ratio = f"{r['torch_ms'] / r['tvmfuse_ms']:.2f}" if r.get("torch_ms") else "-"
        print(f"{r['model']:32s} {'yes' if r['numerics_ok'] else 'NO':>3s} {r['max_abs_err']:9.2e} "
              f"{r['tvmfuse_ms']:10.3f} {r['stock_ms'] / r['tvmfuse_ms']:8.2f} {torch_ratio:>8s} "
              f"{r['roofline_frac']:8.1%}")


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--only", default="", help="comma-separated model names")
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM bandwidth, TB/s (H200: 4.8)")
    p.add_argument("--tflops", type=float, default=67.0, help="fp32 non-tensor-core peak (H200: ~67)")
    p.add_argument("--dry-run", action="store_true", help="build for cuda (small sizes), run nothing")
    p.add_argument("--build", metavar="DIR", help="export artifacts + data for gpu_run.py into DIR, run nothing")
    p.add_argument("--corpus", default="", help="with --build: corpus models too (tvmfuse only, vs onnxruntime)")
    p.add_argument("--bisect", default="", help="with --build: corpus models also built once per CUDA family "
                   "with that family's kernels on the fallback (which family makes a wrong model wrong)")
    p.add_argument("--sizes", default="gpu", choices=["gpu", "small", "default"],
                   help="with --build: SIZES, SMALL_SIZES (weights fit a 64 MB transfer), or the builders' defaults")
    p.add_argument("--cpu", action="store_true", help="with --build: for this host's CPU (smoke test of gpu_run.py)")
    args = p.parse_args(argv)
    target = C.Target({"kind": "cuda", "arch": args.arch}, host=tvmfuse.host_target())
    if args.cpu:
        target = tvmfuse.host_target()
    if args.build:
        return build(args, target)
    todo = builders()
    if args.only:
        names = args.only.split(",")
        unknown = [n for n in names if n not in todo]
        if unknown:
            p.error(f"unknown model(s): {', '.join(unknown)}")
        todo = {n: todo[n] for n in names}
    rows = [check_one(name, b, target, args) for name, b in todo.items()]
    print_table(rows, args.dry_run)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_check.json"), "w") as f:
            json.dump({"arch": args.arch, "date": time.strftime("%Y-%m-%d"), "dry_run": args.dry_run,
                       "tvm": C.TVM_VERSION, "rows": rows}, f, indent=1)
    if not args.dry_run and not all(r["numerics_ok"] for r in rows):
        print("numerics check FAILED", file=sys.stderr)
    if not all(r["family_ok"] for r in rows):
        print("template check FAILED: a family's template did not schedule its model (see 'family')",
              file=sys.stderr)
    return rows


if __name__ == "__main__":
    if "--build" in sys.argv:
        sys.exit(main())
    rows = main()
    sys.exit(0 if all(r.get("numerics_ok", True) and r["family_ok"] for r in rows) else 1)
