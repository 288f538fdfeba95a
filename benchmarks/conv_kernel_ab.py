"""Kernel-level A/B of conv schedules on one core: each case's tvmfuse kernel under its target default and
under knob variants, next to onnxruntime (one thread) running the same one-conv graph, interleaved.

    PYTHONPATH=. python benchmarks/conv_kernel_ab.py --cases fire3x3_15,stem \
        --variants '{"fire3x3_15": [{"ow_tile": 5, "nvec": 2}], "stem": [{"oc_tile": 8}]}'
    PYTHONPATH=. python benchmarks/conv_kernel_ab.py --cases dw336_2 \
        --variants '{"dw336_2": [{"template_defaults": {"lanes_plane_pixels_below": 0}}]}'

A variant's ``template_defaults`` entry is not a knob: the variant is the default config computed with those
entries of the case's family in ``schedules/cpu_targets.json`` replaced (the default before a table change),
then its other knobs applied.

Why one core and CPU time: on a shared 2-core machine wall-clock times of a 2-thread kernel swing 1.5-3x
between runs (benchmarks/gaps_cnn.md); the calling thread's CPU time (``time.thread_time``) of a kernel run
on that thread (TVM_NUM_THREADS=1: ``main`` sets it unless the caller did, before TVM starts its pool) ranks
tiles far more stably, and interleaving the contenders within each round puts them under the same load.  It measures per-core
efficiency (register tile, loads, stores), not the parallel split: the kernels are scheduled for ``--cores``
cores (the default's parallel loop and tiles), then run on one.

onnxruntime runs the same Conv + Relu graph alone (``intra_op_num_threads`` 1): that includes its NCHW <->
NCHWc reorders and its ``run()`` call, which a model amortizes, so read its column as an upper bound of its
per-node time inside a model (``benchmarks/profile_kernels.py`` gives that, not interleaved).

Every variant's output is checked against the default's on the same random arguments (the default's own
numerics are the test suite's business).  Output: one JSON line per case, min and median of the rounds in
microseconds per call; every number is labelled as measured under whatever load the machine had.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import target as TG
from tvmfuse.pipeline import PipelineOptions, graph_stage
from tvmfuse.schedules import find_template, templates_for
from tvmfuse.schedules.base import schedule_with

# (input channels, output channels, input height = width, kernel, stride, padding[, groups]): squeezenet1_1's
# convs, bench_cpu.py's conv3x3_bn_relu_res (conv64_56) and resnet_block (conv32_28) workloads (their BatchNorm
# folds into the bias; no residual here), ResNet-like stages (conv64_16: resnet18's first stage at the corpus'
# 64x64 input; conv64_32, conv128_28: a row the vector divides, another it does not) and
# the depthwise convs of mobilenet_v2 / mnasnet at the corpus' 64x64 input (dw<channels>_<plane>[_k5][s2])
CASES = {
    "stem": (3, 64, 64, 3, 2, 0),
    "fire3x3_15": (16, 64, 15, 3, 1, 1),
    "fire3x3_7": (32, 128, 7, 3, 1, 1),
    "fire3x3_3": (64, 256, 3, 3, 1, 1),
    "fire3x3_3b": (48, 192, 3, 3, 1, 1),
    "fire1x1_15": (16, 64, 15, 1, 1, 0),
    "squeeze_15": (128, 16, 15, 1, 1, 0),
    "conv64_56": (64, 64, 56, 3, 1, 1),
    "conv32_28": (32, 32, 28, 3, 1, 1),
    "conv64_16": (64, 64, 16, 3, 1, 1),
    "conv64_32": (64, 64, 32, 3, 1, 1),
    "conv128_28": (128, 128, 28, 3, 1, 1),
    "dw336_2": (336, 336, 2, 3, 1, 1, 336),
    "dw288_2_k5": (288, 288, 2, 5, 1, 2, 288),
    "dw144_4": (144, 144, 4, 3, 1, 1, 144),
    "dw144_4_k5": (144, 144, 4, 5, 1, 2, 144),
    "dw192_4s2": (192, 192, 4, 3, 2, 1, 192),
    "dw96_8": (96, 96, 8, 3, 1, 1, 96),
    "dw48_8_k5": (48, 48, 8, 5, 1, 2, 48),
    "dw48_16": (48, 48, 16, 3, 1, 1, 48),
    "dw160_7": (160, 160, 7, 3, 1, 1, 160),
    "dw16_32": (16, 16, 32, 3, 1, 1, 16),
}


def conv_relu(ci: int, co: int, hw: int, k: int, stride: int, pad: int, group: int = 1,
              seed: int = 1) -> onnx.ModelProto:
    """Conv (bias, ``group`` groups) + Relu on a [1, ci, hw, hw] input, constant random weights."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array((rng.standard_normal((co, ci // group, k, k)) * 0.1).astype("float32"), "W")
    b = numpy_helper.from_array(rng.standard_normal(co).astype("float32"), "B")
    oh = (hw + 2 * pad - k) // stride + 1
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], kernel_shape=[k, k], strides=[stride] * 2,
                              pads=[pad] * 4, group=group),
             helper.make_node("Relu", ["c"], ["y"])]
    g = helper.make_graph(nodes, "conv_relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, ci, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, co, oh, oh])], [w, b])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def conv_kernel(model: onnx.ModelProto, target: C.Target):
    """(PrimFunc, template, match) of the model's one conv kernel after tvmfuse's graph stage."""
    mod = tvmfuse.load_onnx(model)
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions()))(mod)
    found = [(f, find_template(f, target, templates_for(target))) for gv, f in mod.functions.items()
             if isinstance(f, C.PrimFunc) and "conv" in gv.name_hint]
    if len(found) != 1 or found[0][1] is None:
        raise SystemExit(f"expected one scheduled conv kernel, got {len(found)}")
    func, (template, match) = found[0]
    return func, template, match


def build(func, template, match, config: dict, target: C.Target, rng_seed: int = 0):
    """The kernel under ``config``, built, with random arguments: (callable, args, output tensor)."""
    f = schedule_with(template, match, func, config)
    lib = C.build_prim_module(C.IRModule({"main": f.with_attr("global_symbol", "main")}), target)
    rng = np.random.default_rng(rng_seed)
    args = [C.tensor(rng.standard_normal([int(d) for d in p.shape]).astype(str(p.dtype))) for p in f.params[:-1]]
    out = C.tensor(np.zeros([int(d) for d in f.params[-1].shape], str(f.params[-1].dtype)))
    return lib["main"], args + [out], out


def interleaved(contenders: dict, rounds: int, number: int) -> dict:
    """{name: (min, median)} of the calling thread's CPU microseconds per call, contenders interleaved."""
    times = {k: [] for k in contenders}
    for fn in contenders.values():
        fn()
    for _ in range(rounds):
        for k, fn in contenders.items():
            t0 = time.thread_time()
            for _ in range(number):
                fn()
            times[k].append((time.thread_time() - t0) / number * 1e6)
    return {k: (round(min(v), 1), round(float(np.median(v)), 1)) for k, v in times.items()}


def default_with_table(template, match, target: C.Target, entries: dict) -> dict:
    """The template's default config with ``entries`` of its family's ``template_defaults`` replaced."""
    table = TG.cpu_table()
    unknown = sorted(set(entries) - set(table["template_defaults"][template.family]))
    if unknown:
        raise SystemExit(f"template_defaults of {template.family} has no {unknown}")
    patched = json.loads(json.dumps({k: v for k, v in table.items()}))
    patched["template_defaults"][template.family].update(entries)
    real = TG.cpu_table
    TG.cpu_table = lambda: patched
    try:
        return template.default_config(match, target)
    finally:
        TG.cpu_table = real


def run_case(name: str, variants: list, target: C.Target, rounds: int, number: int) -> dict:
    import onnxruntime as ort

    model = conv_relu(*CASES[name])
    func, template, match = conv_kernel(model, target)
    default = template.default_config(match, target)
    fn, args, out = build(func, template, match, default, target)
    fn(*args)
    reference = out.numpy()
    contenders = {"default": lambda fn=fn, args=args: fn(*args)}
    configs = {"default": default}
    for i, over in enumerate(variants):
        knobs = {k: v for k, v in over.items() if k != "template_defaults"}
        base = default_with_table(template, match, target, over["template_defaults"]) \
            if "template_defaults" in over else default
        cfg = {**base, **knobs}
        vfn, vargs, vout = build(func, template, match, cfg, target)
        vfn(*vargs)
        np.testing.assert_allclose(vout.numpy(), reference, rtol=1e-4, atol=1e-4,
                                   err_msg=f"{name} variant {over} differs from the default")
        contenders[f"v{i}"] = lambda fn=vfn, args=vargs: fn(*args)
        configs[f"v{i}"] = over
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal(
        [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]).astype("float32")
    contenders["onnxruntime_1op"] = lambda: sess.run(None, {"x": x})
    return {"case": name, "template": template.family, "configs": configs,
            "us_min_median": interleaved(contenders, rounds, number),
            "clock": "thread_time, one thread, interleaved rounds, measured under load"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {sorted(CASES)}")
    ap.add_argument("--variants", default="{}", help='JSON {case: [knob overrides, ...]}')
    ap.add_argument("--cores", type=int, default=2, help="num-cores of the target the kernels are scheduled for")
    ap.add_argument("--target", help="a target (JSON or string) the host can run, e.g. '{\"kind\": \"llvm\", "
                                     "\"mcpu\": \"haswell\", \"num-cores\": 2}' for AVX2 code; default: the host's")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--number", type=int, default=20, help="calls per timed round")
    a = ap.parse_args(argv)
    # one worker, before the first parallel call creates TVM's pool: the kernels run on the timed thread
    os.environ.setdefault("TVM_NUM_THREADS", "1")
    if os.environ["TVM_NUM_THREADS"] != "1":
        print("note: TVM_NUM_THREADS is not 1: kernels may run on other threads than the timed one", file=sys.stderr)
    names = [c for c in a.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {sorted(CASES)}")
    variants = json.loads(a.variants)
    target = tvmfuse.parse_target(json.loads(a.target) if a.target and a.target.lstrip().startswith("{")
                                  else a.target) if a.target else TG.host_target(a.cores)
    for name in names:
        print(json.dumps(run_case(name, variants.get(name, []), target, a.rounds, a.number)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
