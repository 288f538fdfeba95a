"""Run the artifacts ``gpu_check.py --build DIR`` wrote, on an NVIDIA GPU, with the TVM runtime alone.

The GPU machine has no TVM compiler (only ``libtvm_runtime`` and ``tvm_ffi``), so nothing here imports
tvmfuse or onnx: each artifact's library is dlopen'ed, its kernels come from the artifact's prebuilt fatbin
(answered to the CUDA runtime's compile request by source sha256, as ``tvmfuse.export`` does), and the
Relax VM runs it.  Per model and engine (tvmfuse, stock TVM FuseOps + dlight): the outputs against the
float64 onnx reference the build stored, the device time of one inference (``time_evaluator``, inputs
already on the GPU) and the time of a call from numpy (copies in and out included).

    TVM_USE_RUNTIME_LIB=1 python benchmarks/gpu_run.py DIR [--repeat 20] [--only a,b]

Prints one table and writes ``$OUT/gpu_run.json`` when ``OUT`` is set.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
import traceback

import numpy as np

os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
import tvm  # noqa: E402
import tvm_ffi  # noqa: E402
from tvm.runtime.vm import VirtualMachine  # noqa: E402


def _load_cuda_runtime() -> None:
    """TVM 0.27 loads ``libtvm_runtime_cuda`` from its CUDA backend hook, which runtime-only mode skips;
    without it a CUDA library fails to load ("a loader of that name is not registered")."""
    import ctypes

    if "tvm_runtime_cuda" in tvm.base._LOADED_LIBS:
        return
    libdir = os.path.dirname(os.path.realpath(tvm.base._LOADED_LIBS["tvm_runtime"]._name))
    tvm.base._LOADED_LIBS["tvm_runtime_cuda"] = ctypes.CDLL(os.path.join(libdir, "libtvm_runtime_cuda.so"))

_FATBINS: dict[str, bytes] = {}


def _prebuilt(code, *_args):
    key = hashlib.sha256(str(code).encode()).hexdigest()
    if key not in _FATBINS:
        raise RuntimeError(f"no prebuilt fatbin for kernel source {key[:12]}")
    return _FATBINS[key]


def load(art_dir: str, dev):
    with open(os.path.join(art_dir, "manifest.json")) as f:
        manifest = json.load(f)
    for entry in manifest.get("device_code", []):
        with open(os.path.join(art_dir, entry["file"]), "rb") as f:
            _FATBINS[entry["source_sha256"]] = f.read()
    lib = tvm.runtime.load_module(os.path.join(art_dir, manifest["library"]))
    return manifest, VirtualMachine(lib, dev)


def redraw(prow: dict) -> list[np.ndarray]:
    """The inputs ``gpu_check.py --build`` drew (same generator, seed and order), in call order."""
    rng = np.random.default_rng(0)
    feeds = {}
    for spec in prow["feeds"]:
        dtype = np.dtype(spec["dtype"])
        if spec["draw"] == "normal":
            feeds[spec["name"]] = rng.standard_normal(spec["shape"]).astype(dtype)
        else:
            _kind, low, high = spec["draw"]
            feeds[spec["name"]] = rng.integers(low, high, size=spec["shape"], dtype=dtype)
    out = [feeds[k] for k in prow["feed_order"]]
    h = hashlib.sha256()
    for a in out:
        h.update(np.ascontiguousarray(a).tobytes())
    if h.hexdigest() != prow["feeds_sha256"]:
        raise RuntimeError("the redrawn inputs differ from the build's (numpy's generator changed?)")
    return out


def _outputs(r) -> list[np.ndarray]:
    if hasattr(r, "numpy"):
        return [r.numpy()]
    return [x.numpy() for x in r]


def run_engine(art_dir: str, feeds: list[np.ndarray], refs: list[tuple], tol: dict, repeat: int,
               dev) -> dict:
    row: dict = {}
    t0 = time.perf_counter()
    manifest, vm = load(art_dir, dev)
    row["load_s"] = round(time.perf_counter() - t0, 3)
    main = vm["main"]
    args = [tvm.runtime.tensor(x, dev) for x in feeds]
    outs = _outputs(main(*args))
    dev.sync()
    if len(outs) != len(refs):
        raise RuntimeError(f"{len(outs)} outputs, the reference has {len(refs)}")
    errs, rels, oks = [], [], []
    for o, (shape, idx, r) in zip(outs, refs):
        if list(o.shape) != list(shape):
            raise RuntimeError(f"output shape {list(o.shape)}, the reference has {shape}")
        o64 = o.astype(np.float64).reshape(-1)
        o64 = o64[idx] if idx is not None else o64
        err = float(np.max(np.abs(o64 - r))) if r.size else 0.0
        scale = float(np.max(np.abs(r))) if r.size else 0.0
        rel = err / scale if scale > 0 else err
        errs.append(err)
        rels.append(rel if np.all(np.isfinite(o64)) else float("inf"))
        if tol["kind"] == "relative":      # the corpus measure: max |a - e| / max |e| over the tensor
            oks.append(rels[-1] <= tol["max"])
        else:                              # elementwise, against a float64 reference
            oks.append(bool(np.all(np.isfinite(o64))) and
                       bool(np.allclose(o64, r, rtol=tol["rtol"], atol=tol["atol"])))
    row["rel_err"] = max(rels)
    row["max_abs_err"] = max(errs)
    row["numerics_ok"] = all(oks)
    # device time: inputs on the GPU, time_evaluator synchronises after each repeat
    ev = vm.time_evaluator("main", dev, number=1, repeat=repeat, min_repeat_ms=20)
    res = ev(*args)
    row["device_ms"] = float(np.median(res.results)) * 1e3
    row["device_ms_spread"] = [float(np.min(res.results)) * 1e3, float(np.max(res.results)) * 1e3]
    # a call from numpy: copy in, run, copy out
    ts = []
    for _ in range(max(3, repeat // 2)):
        t1 = time.perf_counter()
        a = [tvm.runtime.tensor(x, dev) for x in feeds]
        _outputs(main(*a))
        ts.append(time.perf_counter() - t1)
    row["numpy_call_ms"] = float(np.median(ts)) * 1e3
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--only", default="")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a smoke test of this script on artifacts built with gpu_check.py --build --cpu")
    args = p.parse_args(argv)
    with open(os.path.join(args.dir, "plan.json")) as f:
        plan = json.load(f)
    if args.device == "cuda":
        _load_cuda_runtime()
        # TVM's CUDA module asks this callback for the kernels at load; its own (tvm.support.nvcc) would
        # compile with NVRTC, which runtime-only TVM cannot drive ("no attribute 'TargetCurrent'")
        tvm_ffi.register_global_func("tvm_callback_cuda_compile", _prebuilt, override=True)
    dev = tvm.cuda(0) if args.device == "cuda" else tvm.cpu(0)
    if not dev.exist:
        print(f"no {args.device} device", file=sys.stderr)
        return 2
    info = {"device": str(dev.device_name), "compute_version": str(dev.compute_version),
            "tvm": tvm.__version__, "tvm_ffi": getattr(tvm_ffi, "__version__", "?"),
            "python": platform.python_version(), "numpy": np.__version__,
            "date": time.strftime("%Y-%m-%d"), "plan": {k: v for k, v in plan.items() if k != "rows"}}
    print(json.dumps(info))
    only = set(args.only.split(",")) if args.only else None
    rows = []
    for prow in plan["rows"]:
        if only and prow["model"] not in only:
            continue
        row = dict(prow)
        if not prow["artifacts"]:
            row["tvmfuse"] = {"error": "build failed: " + prow.get("tvmfuse_build_error", "")[-300:]}
            rows.append(row)
            continue
        with np.load(os.path.join(args.dir, prow["data"]), allow_pickle=False) as d:
            refs = [(shape, d[f"idx{i}"] if f"idx{i}" in d else None, d[f"ref{i}"])
                    for i, shape in enumerate(prow["output_shapes"])]
        try:
            feeds = redraw(prow)
        except Exception as e:
            row["tvmfuse"] = {"error": f"inputs: {e}"}
            rows.append(row)
            print(json.dumps({"model": prow["model"], "error": str(e)}), flush=True)
            continue
        for eng in ["tvmfuse", "stock"] + [e for e in prow["artifacts"] if e not in ("tvmfuse", "stock")]:
            if f"{eng}_build_error" in prow:
                row[eng] = {"error": "build failed: " + prow[f"{eng}_build_error"][-300:]}
                continue
            if eng not in prow["artifacts"]:
                continue
            rel = prow["artifacts"][eng]
            try:
                row[eng] = run_engine(os.path.join(args.dir, rel), feeds, refs, prow["tolerance"],
                                      args.repeat, dev)
            except Exception as e:   # recorded per engine: the check goes on
                row[eng] = {"error": f"{type(e).__name__}: {str(e)[:600]}",
                            "trace": traceback.format_exc()[-1500:]}
            print(json.dumps({"model": prow["model"], eng: row[eng]}), flush=True)
        flops, nbytes = prow.get("flops", 0.0), prow.get("bytes", 0.0)
        tf = row.get("tvmfuse", {})
        if "device_ms" in tf:
            bound = max(nbytes / (plan["hbm_tbs"] * 1e12), flops / (plan["tflops"] * 1e12))
            row["roofline_frac"] = bound / (tf["device_ms"] * 1e-3)
        rows.append(row)
    print()
    print(f"{'model':34s} {'ok':>4s} {'max err':>9s} {'tvmfuse ms':>10s} {'stock/tf':>8s} {'numpy ms':>9s} "
          f"{'roofline':>8s}")
    for r in rows:
        tf, st = r.get("tvmfuse", {}), r.get("stock", {})
        if "error" in tf:
            print(f"{r['model']:34s} ERR  {tf['error'][:90]}")
            continue
        ratio = f"{st['device_ms'] / tf['device_ms']:.2f}" if "device_ms" in st else ("ERR" if st else "-")
        print(f"{r['model']:34s} {'yes' if tf['numerics_ok'] else 'NO':>4s} {tf['max_abs_err']:9.2e} "
              f"{tf['device_ms']:10.3f} {ratio:>8s} {tf['numpy_call_ms']:9.3f} {r.get('roofline_frac', 0):8.1%}")
    variants = [(r["model"], e, v) for r in rows for e, v in r.items()
                if e.startswith("no_") and isinstance(v, dict)]
    if variants:
        print("\nbisect (the model with one CUDA family's kernels on the fallback):")
        for model, eng, v in variants:
            print(f"{model:20s} {eng:28s} " + (f"ok {v['numerics_ok']} rel_err {v['rel_err']:.2e}"
                                                 if "numerics_ok" in v else v.get("error", "?")[:80]))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_run.json"), "w") as f:
            json.dump({**info, "rows": rows}, f, indent=1)
    bad = [r["model"] for r in rows if not r.get("tvmfuse", {}).get("numerics_ok")]
    if bad:
        print("numerics or run FAILED:", ", ".join(bad), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
