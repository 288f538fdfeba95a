"""The one place where tvmfuse imports TVM.

TVM 0.27 moved a lot of its Python API (``tir`` -> ``tirx``, schedules and MetaSchedule under
``tvm.s_tir``, ``struct_info`` -> ``ty``, ``arith`` -> ``sym``).  Every other tvmfuse module, test and
benchmark imports TVM names from here, so the next rename is fixed in one file.  This module only
re-exports names and bridges renamed calls (a few lines each); code that *uses* TVM lives with its user.
``tests/test_layering.py`` keeps it so: each name defined once, each name used somewhere.
"""
from __future__ import annotations

import ctypes as _ctypes
import sys as _sys

import tvm as _tvm
import tvm_ffi as _tvm_ffi
from tvm import IRModule, relax, rpc, s_tir, te, tirx, topi
from tvm import sym as _sym  # 0.27: tvm.arith -> tvm.sym
from tvm.ir import transform as ir_transform
from tvm.relax import transform as relax_transform
from tvm.relax.analysis import has_reshape_pattern   # what RewriteDataflowReshape turns into a free view
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.s_tir import SBlock, SBlockRealize, Schedule, ScheduleError, dlight, meta_schedule
from tvm.s_tir.schedule import SBlockRV
from tvm.target import Target
from tvm.script.ir_builder import IRBuilder  # TIR built in Python (the attention template's loop nest)
from tvm.tirx.script.builder import ir as tir_builder
from tvm.tirx.buffer import is_buffer_var   # a PrimFunc parameter that is a buffer handle (schedules.index_bounds)

TVM_VERSION: str = _tvm.__version__
TVM_FFI_VERSION: str = getattr(_tvm_ffi, "__version__", "unknown")

# --- IR and passes ---------------------------------------------------------------------------------------
module_pass = ir_transform.module_pass
Sequential = ir_transform.Sequential
PrimFunc = tirx.PrimFunc
VirtualMachine = relax.VirtualMachine
BlockBuilder = relax.BlockBuilder
relax_free_vars = relax.analysis.free_vars
relax_get_pipeline = relax.get_pipeline   # TVM's named Relax pipelines ("static_shape_tuning", ...)
structural_hash = _tvm_ffi.structural_hash
structural_equal = _tvm_ffi.structural_equal
structural_map = _tvm_ffi.structural_map   # typed rewrite of a TIR tree: (type, callback) entries, post-order
assert_structural_equal = _tvm.ir.assert_structural_equal
save_json = _tvm.ir.save_json
load_json = _tvm.ir.load_json
register_global_func = _tvm_ffi.register_global_func
script_tir = _tvm.script.tirx   # TVMScript's TIR parser (``T.prim_func``)
script_ir = _tvm.script.ir   # TVMScript's IRModule parser (``I.ir_module``)
script_relax = _tvm.script.relax   # TVMScript's Relax parser (``R.function``)
parse_script = _tvm.script.from_source   # TVMScript text -> PrimFunc / IRModule

# --- Relax types (0.27 renamed StructInfo -> Type, ``.struct_info`` -> ``.ty``) -----------------------------
TensorType = relax.TensorType
TupleType = relax.TupleType
PrimType = _tvm.ir.PrimType  # a scalar's type (a symbolic dim passed to a kernel: ``int64``)
Op = _tvm.ir.Op
GlobalVar = _tvm.ir.GlobalVar
Constant = _tvm.ir.expr.Constant  # relax constants (metadata GenericConst) in 0.27
GenericConst = _tvm.ir.GenericConst  # what the ONNX importer's get_constant returns for a constant
is_prim_expr = _tvm.ir.is_prim_expr  # 0.27: relax and TIR share one expression type; this tells a TIR one

# --- TIR node types ------------------------------------------------------------------------------------------
IntImm = tirx.IntImm
Var = tirx.Var
IndexMap = tirx.IndexMap
Add = tirx.Add
Mul = tirx.Mul
Cast = tirx.Cast
FloorDiv = tirx.FloorDiv
FloorMod = tirx.FloorMod
ForKind = tirx.ForKind
IterVar = tirx.IterVar
BufferStore = tirx.BufferStore
Range = _tvm.ir.Range
TensorLoad = _tvm.ir.expr.TensorLoad  # what tirx.BufferLoad builds in 0.27 (buffer var in ``.source``)
Call = _tvm.ir.expr.Call
Analyzer = _sym.Analyzer
ConstIntBound = _sym.ConstIntBound
detect_iter_map = _sym.detect_iter_map
detect_linear_equation = _sym.detect_linear_equation

# --- errors TVM raises ---------------------------------------------------------------------------------------
InternalError = _tvm.error.InternalError
TVMError = (ScheduleError, InternalError)   # schedule primitives and TVM's checks (ICHECK, LOG(FATAL))
# What a TVM pass raises when it fails: TVM's own error classes and the builtin ones tvm_ffi maps C++ errors
# to (``tvm_ffi.error.register_error``: RuntimeError, ValueError, TypeError, ...).  Catch these only around
# TVM's passes; a failure in tvmfuse's own passes is a bug and must propagate.
TVM_PASS_ERRORS = (InternalError, _tvm.error.DiagnosticError, ScheduleError, RuntimeError, ValueError, TypeError)


class IterVarKind:
    """``tirx.IterVar`` iteration kinds (0.27 keeps them as class constants)."""

    DataPar = int(tirx.IterVar.DataPar)
    CommReduce = int(tirx.IterVar.CommReduce)


def default_legalize(op_name: str):
    """TVM's registered legalization of a Relax op (``FLegalize``), for a custom one that defers to it."""
    return Op.get(op_name).get_attr("FLegalize")


def type_of(expr):
    """The Relax type (formerly struct info) of an expression or var."""
    return expr.ty


def ret_type(func):
    return func.ret_ty


def var_name(var) -> str:
    return str(var.name_hint) if hasattr(var, "name_hint") else str(var.name)


def region_tensor(region):
    """The tensor (buffer var) a block's read/write region refers to (``.buffer`` before 0.27)."""
    return region.source


def tensor_shape(tensor_var) -> tuple:
    """Shape of a TIR buffer var of 0.27 (``buffer.shape`` before)."""
    return tuple(tensor_var.ty.shape)


def const_value(expr):
    """The numpy value of a Relax constant (``.data.numpy()`` before 0.27)."""
    import numpy as _np

    v = expr.value
    return v.numpy() if hasattr(v, "numpy") else _np.asarray(v)


# TVM's kMaxStackAlloca: a CPU kernel's allocation of this many bytes or more is not a stack array but a
# call to the runtime's workspace allocator (LowerTVMBuiltin), made where the allocation is declared
MAX_STACK_ALLOCA_BYTES = 1024


def prim_func_params(func) -> list[tuple[list[int], str]]:
    """(shape, dtype) of each PrimFunc parameter (0.27: parameters are buffer vars, no buffer_map)."""
    return [([int(d) for d in p.shape], str(p.dtype)) for p in func.params]


def post_order_visit(node, fvisit) -> None:
    """Call ``fvisit`` on every sub-node of a TIR expression or statement (children first)."""
    _tvm_ffi.structural_walk(node, fvisit, order="post")


# --- frontend ------------------------------------------------------------------------------------------------
def from_onnx(*args, converters: dict | None = None, **kwargs):
    """TVM's ONNX importer, imported on first use (a deployed artifact loads without onnx).

    ``converters`` (ONNX op type -> converter class) replace the importer's own for this call only: the
    importer has no converter-map argument, so its map function is wrapped while the import runs.
    (The importer module's own function: ``tvmfuse.conformance`` wraps the package's name.)"""
    from tvm.relax.frontend.onnx import onnx_frontend as _F

    _from_onnx = _F.from_onnx

    if not converters:
        return _from_onnx(*args, **kwargs)
    original = _F._get_convert_map

    def _with_overrides():
        return {**original(), **converters}

    _F._get_convert_map = _with_overrides
    try:
        return _from_onnx(*args, **kwargs)
    finally:
        _F._get_convert_map = original


def onnx_package():
    """``tvm.relax.frontend.onnx``, whose ``from_onnx`` name callers import (the ONNX suite among them)."""
    import tvm.relax.frontend.onnx as _pkg

    return _pkg


def onnx_frontend():
    """TVM's ONNX importer module (its converter base class and helpers), for tvmfuse's converters."""
    from tvm.relax.frontend.onnx import onnx_frontend as _F

    return _F


# --- targets, building, runtime ---------------------------------------------------------------------------
def current_target():
    return Target.current(allow_none=True)


def llvm_system_cpu() -> str:
    return str(_tvm.target.codegen.llvm_get_system_cpu())


def llvm_system_triple() -> str:
    return str(_tvm.target.codegen.llvm_get_system_triple())


def llvm_cpu_features(target: Target) -> set[str]:
    return {str(k) for k in _tvm.target.codegen.llvm_get_cpu_features(target)}


def compile_module(mod: IRModule, target: Target, relax_pipeline, tir_pipeline="default"):
    """``tvm.compile`` of a Relax module: a VM executable."""
    return _tvm.compile(mod, target=target, relax_pipeline=relax_pipeline, tir_pipeline=tir_pipeline)


def build_vm(mod: IRModule, target: Target, exec_mode: str = "bytecode"):
    """``relax.build`` with TVM's default pipeline and the VM's ``exec_mode`` ("bytecode": interpreted
    instructions, "compiled": the VM functions compiled to machine code); tvm.compile has no exec_mode."""
    return relax.build(mod, target, exec_mode=exec_mode)


def build_prim_module(mod: IRModule, target: Target):
    """Compile an IRModule of PrimFuncs (TVM's default TIR pipeline); ``.export_library(path)``."""
    return _tvm.compile(mod, target=target)


allocated_bytes = s_tir.analysis.calculate_allocated_bytes   # {"main": {scope: bytes}} of a lowered PrimFunc


def lower_tir(mod: IRModule, target: Target) -> IRModule:
    """TVM's TIR lowering of a module of scheduled PrimFuncs for ``target`` (``tirx.build`` up to code
    generation: bind the target, the default pipeline, host/device split and finalization); raises what
    the lowering raises.  Costs no nvcc run: it tells a schedule that cannot lower before the build does."""
    from tvm.tirx.build import split_host_device_mods

    target = Target(target) if target.host is not None else Target(target, host="llvm")
    mod = tirx.transform.BindTarget(target)(mod)
    pipeline, finalize_host, finalize_device = tirx.get_default_tir_pipeline(target)
    mod = pipeline(mod)
    host, devices = split_host_device_mods(mod)
    finalize_host()(host)
    for dev in devices.values():
        finalize_device()(dev)
    return mod


def register_relax_pipeline(name: str, factory) -> None:
    """Register ``factory`` (no-argument callable returning a Pass) under ``name`` for tvm.compile."""
    relax.pipeline.PIPELINE_MAP[name] = factory


def backend_passes(target: Target, stage: str) -> list:
    """TVM's own per-target pass lists: stage is library_dispatch, legalize, dataflow_lower or finalize."""
    kind = target.kind.name
    family = {"llvm": "cpu_generic", "c": "cpu_generic", "cuda": "cuda", "rocm": "rocm",
              "metal": "metal"}.get(kind, "gpu_generic")
    return list(getattr(getattr(relax.backend, family).pipeline, f"{stage}_passes")(target))


def tensor(array, device=None):
    """A TVM runtime tensor (``tvm.nd.array`` in older TVM) from a numpy array."""
    return _tvm.runtime.tensor(array, device=device) if device is not None else _tvm.runtime.tensor(array)


Tensor = _tvm.runtime.Tensor


def from_dlpack(array):
    """A TVM tensor viewing ``array``'s memory (numpy, or any DLPack producer): no copy."""
    return _tvm_ffi.from_dlpack(array)


NOALIAS_ATTR = "tirx.noalias"         # PrimFunc attribute: its pointer arguments do not alias (C's restrict)
HOST_FUNC_ATTR = "tirx.is_host_func"  # PrimFunc attribute: runs on the host (the VM's shape functions)


def pointer_param_count(func) -> int:
    """How many of a PrimFunc's parameters are pointers (buffers or handles), the rest being scalars."""
    from tvm.ir.type import PointerType
    from tvm.tirx.buffer import is_buffer_var

    return sum(1 for p in func.params if is_buffer_var(p) or isinstance(getattr(p, "ty", None), PointerType))


def with_element_aligned_params(func):
    """``func`` with each buffer parameter declared aligned to its element size only.

    TVM declares a PrimFunc's buffer parameters ``data_alignment`` 64 (kAllocAlignment); MakePackedAPI marks
    each argument's data pointer with that ``storage_alignment`` and the LLVM code generator gives every
    vector load and store the alignment that follows (``align 64``), so LLVM may emit aligned moves that
    fault on a numpy array (16-byte aligned).  Declared with the element size, the loads say ``align 4``
    (float32) and compile to unaligned moves, which cost the same on aligned data.
    """
    from tvm.tirx.buffer import BufferType, decl_buffer, is_buffer_var
    from tvm.tirx.transform.common import BufferReplacer

    new = {}
    for p in func.params:
        if not is_buffer_var(p) or not isinstance(p.ty, BufferType):
            continue
        t = p.ty
        element = max(1, _tvm_ffi.dtype(str(t.dtype)).bits * _tvm_ffi.dtype(str(t.dtype)).lanes // 8)
        if t.data_alignment == element:
            continue
        new[p] = decl_buffer(t.shape, t.dtype, p.name, None, t.strides, t.elem_offset, t.storage_scope,
                             element, t.offset_factor, layout=t.layout)
    return BufferReplacer(new)(func) if new else func


def strong_ref_count(obj) -> int:
    """Strong references to a TVM FFI object: the low 32 bits of ``combined_ref_count``, the first field of
    the TVMFFIObject header (tvm-ffi's stable C ABI, include/tvm/ffi/c_api.h)."""
    return strong_ref_word(obj.__chandle__()).value


def _strong_ref_word_big_endian(handle: int):
    return _ctypes.c_uint32.from_address(handle + 4)


# ``strong_ref_word(obj.__chandle__()).value`` is ``strong_ref_count(obj)`` without a Python frame: run()'s
# per-call path reads it once per output (issue 11: every step after a kernel that swept the caches runs
# cold).  The strong count is the low half of the 64-bit word: its first 4 bytes on a little-endian host.
strong_ref_word = (_ctypes.c_uint32.from_address if _sys.byteorder == "little" else _strong_ref_word_big_endian)


FfiFunction = _tvm_ffi.Function     # a VM function's type: runtime_native calls it through its C handle
tvm_ffi_function = _tvm_ffi.convert  # a Python callable as a tvm-ffi Function (tests of runtime_native)


def tvm_ffi_build_paths() -> tuple[list[str], str, str]:
    """(include directories, library directory, library name) to compile C code against tvm-ffi's C API
    (``tvmfuse/runtime_native.c``: ``tvm/ffi/c_api.h`` and ``dlpack/dlpack.h``, linked to libtvm_ffi)."""
    import os as _os

    from tvm_ffi import libinfo as _libinfo
    includes = list(dict.fromkeys(list(_libinfo.include_paths()) + [_libinfo.find_dlpack_include_path()]))
    lib = _libinfo.find_libtvm_ffi()
    name = _os.path.basename(lib)
    name = name[3:] if name.startswith("lib") else name
    return includes, _os.path.dirname(lib), name.split(".")[0]


def cpu(index: int = 0):
    return _tvm.cpu(index)


def device(kind: str, index: int = 0):
    return _tvm.device(kind, index)


def device_for(target: Target):
    """The runtime device on which code for ``target`` runs."""
    kind = target.kind.name
    return _tvm.cpu(0) if kind in ("llvm", "c") else _tvm.device(kind, 0)


def runtime_enabled(kind: str) -> bool:
    """Whether this TVM build has the runtime for ``kind`` ("cuda", "llvm", ...)."""
    return bool(_tvm.runtime.enabled(kind))


def set_runtime_threads(n: int) -> None:
    """Size TVM's CPU thread pool (mode 1 = big cores)."""
    _tvm_ffi.get_global_func("runtime.config_threadpool")(1, int(n))


def global_func(name: str):
    """A function registered with TVM's FFI by name (``vm.builtin.match_shape``, ...)."""
    return _tvm_ffi.get_global_func(name)


def runtime_threads() -> int:
    return int(_tvm_ffi.get_global_func("runtime.NumThreads")())


def load_module(path: str):
    return _tvm.runtime.load_module(path)


def time_function(module, name: str, device, number: int, repeat: int, min_repeat_ms: int = 0):
    """TVM's time evaluator: a callable returning ``.results`` (seconds per repeat)."""
    return module.time_evaluator(name, device, number=number, repeat=repeat, min_repeat_ms=min_repeat_ms)


def cross_compiler(cc: str):
    """An ``export_library`` fcompile that links with ``cc`` (e.g. aarch64-linux-gnu-gcc)."""
    from tvm.support import cc as _cc

    return _cc.cross_compiler(cc)


def nvcc_compile(code: str, target: Target, target_format: str = "cubin", arch=None) -> bytes:
    """Compile CUDA C with TVM's nvcc driver (raises on errors); ``arch`` is nvcc's -gencode argument
    list, or by default the target's arch."""
    from tvm.support import nvcc as _nvcc

    with target:  # nvcc.py reads the compute version of the current target
        return bytes(_nvcc.compile_cuda(code, target_format=target_format,
                                        arch=arch if arch is not None else str(target.attrs["arch"]),
                                        compiler="nvcc"))


def cuda_device_source(executable) -> str:
    """The CUDA C source TVM generated for an executable built for a cuda target ("" if none)."""
    def walk(mod):
        if mod.kind == "cuda":
            yield mod.inspect_source()
        for sub in mod.imports:
            yield from walk(sub)
    return "\n".join(walk(executable.mod))


# --- MetaSchedule internals (tvmfuse.tune.features, benchmarks/bench_tuner.py) -------------------------------
def ms_internals():
    """(ffi api, ArgInfo, get_logger, get_logging_func) of MetaSchedule: what a bare TuneContext needs."""
    from tvm.s_tir.meta_schedule import _ffi_api
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.meta_schedule.logging import get_logger, get_logging_func

    return _ffi_api, ArgInfo, get_logger, get_logging_func


def bare_tune_context(target, mod=None, name: str = "tvmfuse"):
    """A TuneContext of ``target`` (and ``mod``) made through its FFI constructor as ``TuneContext.__init__``
    makes it (one thread, no space generator or search strategy), without the import of
    ``tvm.s_tir.tensor_intrin`` that __init__ starts with (~500 TVMScript intrinsics parsed: 30-40 s of
    CPU once per process) and that a postprocessor's check or feature extraction never uses."""
    ms_api, _, get_logger, get_logging_func = ms_internals()
    ctx = meta_schedule.TuneContext.__new__(meta_schedule.TuneContext)
    ctx.__init_handle_by_constructor__(ms_api.TuneContext, mod, target, None, None, "main", 1, -1,
                                       get_logging_func(get_logger(name)))
    ms_api.TuneContextInitialize(ctx)
    return ctx


def ms_tensor_info(dtype: str, shape):
    """MetaSchedule's TensorInfo (an argument's dtype and static shape)."""
    from tvm.s_tir.meta_schedule.arg_info import TensorInfo

    return TensorInfo(dtype, shape)


def ms_py_measure_callback():
    """(derived_object, PyMeasureCallback): what a Python MetaSchedule measure callback is built from."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

    return derived_object, PyMeasureCallback


def import_tensor_intrin() -> None:
    """What ``TuneContext()`` imports first (MetaSchedule's tensor intrinsics; slow: timed apart)."""
    import tvm.s_tir.tensor_intrin  # noqa: F401
