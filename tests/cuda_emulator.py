"""Run a scheduled CUDA PrimFunc on the CPU: TVM's own lowering and CUDA code generation, the generated
CUDA C++ compiled by g++ against ``cuda_emu/emu.h`` (one OS thread per CUDA thread of a block, barriers
for ``__syncthreads`` and warp shuffles), each kernel launched over its grid in the host's order.

Unlike running the loop nest with its thread loops made serial (``on_cpu`` in
test_schedules_cuda_fallback.py), this runs the code after lowering: thread loops of one axis are one
thread index, shared memory is shared by the block's threads, cross-thread reductions are TVM's warp
shuffles. It found (2026-12-04) what only the first GPU run had shown: the conv template's padded window
staged per thread, the sibling template's stores ahead of its k loop. Static shapes only; slow (OS
threads): keep test sizes small.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np

from tvmfuse import _compat as C

HERE = os.path.dirname(os.path.abspath(__file__))
EMU_DIR = os.path.join(HERE, "cuda_emu")
CXX = shutil.which("g++")
_CACHE: dict[str, ctypes.CDLL] = {}
_C_TYPES = {"float": np.float32, "double": np.float64, "int": np.int32, "int64_t": np.int64,
            "signed char": np.int8, "char": np.int8, "unsigned char": np.uint8, "bool": np.bool_,
            "uint": np.uint32, "unsigned int": np.uint32, "short": np.int16, "long long": np.int64}


def _kernels(lowered) -> list[tuple[str, dict, list[str]]]:
    """(name, launch extents by thread tag, parameter names) of each device kernel, in launch order."""
    host = [f for f in lowered.functions.values() if "tirx.kernel_launch_params" not in (f.attrs or {})]
    host_text = "\n".join(f.script() for f in host)
    found = []
    for gv, f in lowered.functions.items():
        if f.attrs is None or "tirx.kernel_launch_params" not in f.attrs:
            continue
        extents = {}

        def visit(node):
            if isinstance(node, C.tirx.AttrStmt) and str(node.attr_key) == "thread_extent":
                if not isinstance(node.value, C.IntImm):
                    raise NotImplementedError(f"kernel {gv.name_hint}: symbolic launch extent {node.value}")
                extents[str(node.node.thread_tag)] = int(node.value)
        C.post_order_visit(f.body, visit)
        if any("dyn" in str(t) for t in f.attrs["tirx.kernel_launch_params"]):
            raise NotImplementedError(f"kernel {gv.name_hint}: dynamic shared memory")
        name = str(gv.name_hint)
        pos = host_text.find(f'"{name}"')
        found.append((pos if pos >= 0 else 1 << 30, name, extents, [C.var_name(p) for p in f.params]))
    return [(n, e, p) for _pos, n, e, p in sorted(found)]


def _signature(source: str, name: str) -> list[str]:
    """The C types of kernel ``name``'s parameters, from its declaration in the generated source."""
    m = re.search(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?' + re.escape(name) + r"\(([^)]*)\)",
                  source)
    if m is None:
        raise AssertionError(f"kernel {name} not found in the generated CUDA source")
    types = []
    for p in m.group(1).split(","):
        p = p.replace("__restrict__", "").strip()
        types.append(re.sub(r"\s*\b\w+$", "", p).strip())
    return types


def _library(source: str, kernels: list, sigs: dict) -> ctypes.CDLL:
    wrappers = []
    for name, _ext, _params in kernels:
        args = ", ".join(f"({t})a[{i}]" if t.endswith("*") else f"*({t}*)a[{i}]" for i, t in enumerate(sigs[name]))
        wrappers.append(f'extern "C" void emu_call_{name}(void** a) {{ {name}({args}); }}')
    # g++ wants the alignment before ``static`` (emu.h's __shared__)
    source = re.sub(r"__shared__ (alignas\(\d+\)) ", r"\1 __shared__ ", source)
    # every shared array registers for poisoning (emu.h) where it is declared
    source = re.sub(r"(__shared__[^;=()]*?\b(\w+)(?:\[\d+\])*;)", r"\1 EMU_SHARED(\2);", source)
    text = source + "\n" + "\n".join(wrappers) + "\n"
    with open(os.path.join(EMU_DIR, "emu.h")) as f:
        key = hashlib.sha256((f.read() + text).encode()).hexdigest()[:24]
    if key in _CACHE:
        return _CACHE[key]
    # the work folder goes once the library is loaded (a loaded library stays mapped after its file is gone)
    with tempfile.TemporaryDirectory(prefix="tvmfuse-cuda-emu-") as work:
        src, lib = os.path.join(work, "k.cpp"), os.path.join(work, f"k{key}.so")
        with open(src, "w") as f:
            f.write(text)
        cmd = [CXX, "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-w", "-I", EMU_DIR,
               "-include", os.path.join(EMU_DIR, "emu.h"), "-x", "c++", src, "-o", lib]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise AssertionError(f"g++ rejected the generated CUDA source:\n{res.stderr[-3000:]}")
        _CACHE[key] = ctypes.CDLL(lib)
    return _CACHE[key]


ORDERS = {"parallel": 0, "ascending": 1, "descending": -1}


def emulate(func: C.PrimFunc, target, inputs: list[np.ndarray], order: str = "parallel") -> list[np.ndarray]:
    """Outputs of scheduled kernel ``func`` (its parameters after ``inputs``, NaN-filled first) run on
    the CPU as the CUDA code TVM generates for ``target``. ``order``: "parallel" (the block's threads
    run together), or "ascending" / "descending": one thread at a time, each barrier passing the turn on
    in that thread order (deterministic; a missing barrier shows in one of the two)."""
    mod = C.IRModule({"main": func.with_attr("global_symbol", "main")})
    lowered = C.lower_tir(mod, target)
    kernels = _kernels(lowered)
    source = C.cuda_device_source(C.build_prim_module(mod, target))
    sigs = {name: _signature(source, name) for name, _e, _p in kernels}
    lib = _library(source, kernels, sigs)
    arrays = {}
    params = [C.var_name(p) for p in func.params]
    for i, p in enumerate(func.params):
        if i < len(inputs):
            arrays[params[i]] = np.ascontiguousarray(inputs[i])
        else:
            # outputs start as NaN (-1 for integers): an element no thread writes shows
            shape, dt = [int(d) for d in p.shape], np.dtype(str(p.dtype))
            arrays[params[i]] = np.full(shape, np.nan if dt.kind == "f" else -1, dt)
    for name, ext, kparams in kernels:
        ptrs = []
        for kp, ctype in zip(kparams, sigs[name]):
            buf = kp[:-4] if kp.endswith("_ptr") else kp
            if ctype.endswith("*"):
                if buf not in arrays:
                    raise NotImplementedError(f"kernel {name}: parameter {kp} is no buffer of the function")
                ptrs.append(arrays[buf].ctypes.data_as(ctypes.c_void_p))
            else:
                raise NotImplementedError(f"kernel {name}: scalar parameter {kp} ({ctype})")
        argv = (ctypes.c_void_p * len(ptrs))(*[p.value for p in ptrs])
        call = getattr(lib, f"emu_call_{name}")
        g = [ext.get(f"blockIdx.{a}", 1) for a in "xyz"]
        b = [ext.get(f"threadIdx.{a}", 1) for a in "xyz"]
        lib.emu_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_uint] * 6 + [ctypes.c_int]
        rc = lib.emu_launch(ctypes.cast(call, ctypes.c_void_p), argv, *g, *b, ORDERS[order])
        assert rc == 0
    return [arrays[n] for n in params[len(inputs):]]


def available() -> bool:
    return CXX is not None


__all__ = ["emulate", "emulate_model", "available"]


def schedule_module(mod, target):
    """tvmfuse's CUDA schedules (templates, then the fallback) on every PrimFunc of a fused module."""
    from tvmfuse import schedules as S
    from tvmfuse.pipeline import PipelineOptions

    with target:
        return C.Sequential([S.apply_schedules(target, PipelineOptions()), *S.fallback_passes(target)])(mod)


def emulate_model(compiled, feeds: dict, order: str = "parallel", trace: list | None = None) -> list[np.ndarray]:
    """The outputs of a CUDA ``tvmfuse.compile`` result run on the CPU: its fused module's main function
    interpreted binding by binding (call_tir, tuple items, constants), each kernel scheduled as the build
    schedules it and emulated. ``trace`` (a list) gets (kernel, inputs, outputs) per call, to find the first
    kernel whose outputs differ from its unscheduled version's."""
    mod = schedule_module(compiled.fused_module, compiled.target)
    main = mod["main"]
    env = {}
    for p, spec in zip(main.params, compiled.inputs):
        env[p] = np.ascontiguousarray(feeds[spec.name])

    def value(e):
        if isinstance(e, C.relax.Var):
            return env[e]
        if isinstance(e, C.Constant):
            return np.ascontiguousarray(C.const_value(e))
        if isinstance(e, C.relax.Tuple):
            return [value(f) for f in e.fields]
        raise NotImplementedError(f"cuda emulator: Relax expression {type(e).__name__}")

    body = main.body
    for block in body.blocks:
        for b in block.bindings:
            v = b.value
            if isinstance(v, C.relax.TupleGetItem):
                env[b.var] = value(v.tuple_value)[v.index]
            elif isinstance(v, C.relax.Call) and str(v.op.name) == "relax.call_tir":
                gv, args = v.args[0], value(v.args[1])
                outs = emulate(mod[gv], compiled.target, args, order=order)
                if trace is not None:
                    trace.append((str(gv.name_hint), args, outs))
                env[b.var] = outs if isinstance(v.ty, C.TupleType) else outs[0]
            else:
                env[b.var] = value(v)
    out = value(body.body)
    return out if isinstance(out, list) else [out]
