"""The one place where tvmfuse imports TVM.

TVM 0.27 moved a lot of its Python API (``tir`` -> ``tirx``, schedules and MetaSchedule under
``tvm.s_tir``, ``struct_info`` -> ``ty``).  Every other tvmfuse module imports TVM names from here,
so the next rename is fixed in one file.
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import IRModule, relax, te, tirx, topi
from tvm import s_tir
from tvm.ir import transform as ir_transform
from tvm.relax import transform as relax_transform
from tvm.relax.expr_functor import PyExprMutator, PyExprVisitor, mutator, visitor
from tvm.s_tir import Schedule, dlight
from tvm.s_tir import meta_schedule
from tvm.target import Target

tir = tirx  # the TIR namespace under its 0.27 name


def from_onnx(*args, **kwargs):
    """TVM's ONNX importer, imported on first use (a deployed artifact loads without onnx)."""
    from tvm.relax.frontend.onnx import from_onnx as _from_onnx

    return _from_onnx(*args, **kwargs)


def onnx_frontend_module():
    """TVM's ONNX importer module (its converter map and OnnxOpConverter), imported on first use."""
    from tvm.relax.frontend.onnx import onnx_frontend

    return onnx_frontend

TVM_VERSION: str = tvm.__version__
TVM_FFI_VERSION: str = getattr(tvm_ffi, "__version__", "unknown")

module_pass = ir_transform.module_pass
function_pass = relax_transform.function_pass
PassContext = ir_transform.PassContext
Sequential = ir_transform.Sequential
PrimFunc = tirx.PrimFunc
Executable = relax.VMExecutable
VirtualMachine = relax.VirtualMachine
structural_hash = tvm_ffi.structural_hash
assert_structural_equal = tvm.ir.assert_structural_equal
save_json = tvm.ir.save_json
load_json = tvm.ir.load_json
get_global_func = tvm_ffi.get_global_func


def tensor(array, device=None):
    """A TVM runtime tensor (``tvm.nd.array`` in older TVM) from a numpy array."""
    return tvm.runtime.tensor(array, device=device) if device is not None else tvm.runtime.tensor(array)


def cpu(index: int = 0):
    return tvm.cpu(index)


def cuda(index: int = 0):
    return tvm.cuda(index)


def device_for(target: Target):
    """The runtime device on which code for ``target`` runs."""
    kind = target.kind.name
    return tvm.cpu(0) if kind in ("llvm", "c") else tvm.device(kind, 0)


def compile_module(mod: IRModule, target: Target, relax_pipeline, tir_pipeline="default") -> Executable:
    return tvm.compile(mod, target=target, relax_pipeline=relax_pipeline, tir_pipeline=tir_pipeline)


def register_relax_pipeline(name: str, factory) -> None:
    """Register ``factory`` (no-argument callable returning a Pass) under ``name`` for tvm.compile."""
    relax.pipeline.PIPELINE_MAP[name] = factory


def backend_passes(target: Target, stage: str) -> list:
    """TVM's own per-target pass lists: stage is library_dispatch, legalize, dataflow_lower or finalize."""
    kind = target.kind.name
    family = {"llvm": "cpu_generic", "c": "cpu_generic", "cuda": "cuda", "rocm": "rocm",
              "metal": "metal"}.get(kind, "gpu_generic")
    return list(getattr(getattr(relax.backend, family).pipeline, f"{stage}_passes")(target))


def set_runtime_threads(n: int) -> None:
    """Size TVM's CPU thread pool (mode 1 = big cores)."""
    get_global_func("runtime.config_threadpool")(1, int(n))


def runtime_threads() -> int:
    return int(get_global_func("runtime.NumThreads")())


def llvm_system_cpu() -> str:
    return str(tvm.target.codegen.llvm_get_system_cpu())


def llvm_system_triple() -> str:
    return str(tvm.target.codegen.llvm_get_system_triple())


def llvm_cpu_features(target: Target) -> set[str]:
    return {str(k) for k in tvm.target.codegen.llvm_get_cpu_features(target)}


def load_module(path: str):
    return tvm.runtime.load_module(path)


def current_target():
    return Target.current(allow_none=True)

# Relax type names (0.27 renamed StructInfo -> Type, ``.struct_info`` -> ``.ty``).
TensorType = relax.TensorType
TupleType = relax.TupleType
Op = tvm.ir.Op
GlobalVar = tvm.ir.GlobalVar
IntImm = tirx.IntImm


def type_of(expr):
    """The Relax type (formerly struct info) of an expression or var."""
    return expr.ty


def ret_type(func):
    return func.ret_ty


def var_name(var) -> str:
    return str(var.name_hint) if hasattr(var, "name_hint") else str(var.name)

# Schedule-level names used by the CPU templates (tvmfuse.schedules.cpu) and fast math (tvmfuse.fastmath).
from tvm.s_tir import ScheduleError, SBlock, SBlockRealize  # noqa: E402
from tvm.s_tir.schedule import SBlockRV, LoopRV  # noqa: E402

ForKind = tirx.ForKind
BufferStore = tirx.BufferStore
TensorLoad = tvm.ir.expr.TensorLoad   # a load: .source (the buffer var), .indices
Call = tvm.ir.expr.Call
FloatImm = tirx.FloatImm

# --- CUDA schedule templates (tvmfuse/schedules/cuda): TIR node types, schedule errors, GPU checks.
SBlockRealize = s_tir.SBlockRealize
ScheduleError = s_tir.schedule.ScheduleError
Var = tirx.Var
TensorLoad = tvm.ir.expr.TensorLoad   # a load: .source (the buffer var), .indices
BufferStore = tirx.BufferStore
Add = tirx.Add
Mul = tirx.Mul
Cast = tirx.Cast


class IterVarKind:
    """``tirx.IterVar`` iteration kinds (0.27 keeps them as class constants)."""

    DataPar = int(tirx.IterVar.DataPar)
    CommReduce = int(tirx.IterVar.CommReduce)


def post_order_visit(node, fvisit) -> None:
    """Call ``fvisit`` on every sub-node of a TIR expression or statement (children first)."""
    tvm_ffi.structural_walk(node, fvisit, order="post")


def verify_gpu_schedule(sch: Schedule, target: Target) -> bool:
    """MetaSchedule's VerifyGPUCode check of a scheduled function (threads per block, shared memory,
    vector bytes), after the same lowering it applies when tuning."""
    post = meta_schedule.postproc.VerifyGPUCode()
    post._initialize_with_tune_context(meta_schedule.TuneContext(mod=sch.mod, target=target))
    return bool(post.apply(sch))

# Graph passes (tvmfuse.passes): TIR block analysis and Relax building.
from tvm.s_tir.schedule import ScheduleError  # noqa: E402
IterVar = tirx.IterVar
BlockBuilder = relax.BlockBuilder
relax_free_vars = relax.analysis.free_vars
TVMError = (ScheduleError, tvm.error.InternalError)


# --- deployment (tvmfuse/export.py): runtime loading and ahead-of-time device code ---------------------
register_global_func = tvm_ffi.register_global_func


def runtime_enabled(kind: str) -> bool:
    """Whether this TVM build has the runtime for ``kind`` ("cuda", "llvm", ...)."""
    return bool(tvm.runtime.enabled(kind))


def device(kind: str, index: int = 0):
    return tvm.device(kind, index)


def cross_compiler(cc: str):
    """An ``export_library`` fcompile that links with ``cc`` (e.g. aarch64-linux-gnu-gcc)."""
    from tvm.support import cc as _cc

    return _cc.cross_compiler(cc)


def nvcc_fatbin(code: str, arch: list[str], target: Target) -> bytes:
    """Compile CUDA source to a fatbin with nvcc; ``arch`` is nvcc's -gencode argument list."""
    from tvm.support import nvcc as _nvcc

    with target:  # nvcc.py reads the compute version of the current target
        return bytes(_nvcc.compile_cuda(code, target_format="fatbin", arch=arch, compiler="nvcc"))

# --- autotuner (tvmfuse.tune): RPC, MetaSchedule's per-store features, runtime timing
from tvm import rpc  # noqa: E402
from tvm.s_tir.meta_schedule.arg_info import ArgInfo as MSArgInfo  # noqa: E402


_FEATURE_CONTEXTS: dict = {}


def _feature_context(target: Target):
    """A bare TuneContext (target only) for feature extraction.  ``TuneContext.__init__`` first imports
    ``tvm.s_tir.tensor_intrin`` (parses ~500 TVMScript intrinsics: 40 s on this host), which features
    never use, so the object is made through its FFI constructor as that __init__ would make it."""
    key = str(target)
    if key not in _FEATURE_CONTEXTS:
        from tvm.s_tir.meta_schedule import _ffi_api as _ms_api
        from tvm.s_tir.meta_schedule.logging import get_logger, get_logging_func

        ctx = meta_schedule.TuneContext.__new__(meta_schedule.TuneContext)
        ctx.__init_handle_by_constructor__(_ms_api.TuneContext, None, target, None, None, "main", 1, -1,
                                           get_logging_func(get_logger("tvmfuse.tune.features")))
        _ms_api.TuneContextInitialize(ctx)
        _FEATURE_CONTEXTS[key] = ctx
    return _FEATURE_CONTEXTS[key]


def per_store_features(mod: IRModule, target: Target):
    """MetaSchedule's PerStoreFeature of a scheduled module: a (stores x 164) numpy array."""
    sch = Schedule(mod)
    cand = meta_schedule.MeasureCandidate(sch, MSArgInfo.from_prim_func(mod["main"]))
    fx = meta_schedule.feature_extractor.PerStoreFeature()
    return fx.extract_from(_feature_context(target), [cand])[0].numpy()


def build_prim_module(mod: IRModule, target: Target):
    """Compile an IRModule of PrimFuncs (TVM's default TIR pipeline); ``.export_library(path)``."""
    return tvm.compile(mod, target=target)


def time_function(module, name: str, device, number: int, repeat: int, min_repeat_ms: int = 0):
    """TVM's time evaluator: a callable returning ``.results`` (seconds per repeat)."""
    return module.time_evaluator(name, device, number=number, repeat=repeat, min_repeat_ms=min_repeat_ms)


def cuda_device_source(executable) -> str:
    """The CUDA C source TVM generated for an executable built for a cuda target ("" if none)."""
    def walk(mod):
        if mod.kind == "cuda":
            yield mod.inspect_source()
        for sub in mod.imports:
            yield from walk(sub)
    return "\n".join(walk(executable.mod))


def nvcc_compile(source: str, target: Target, fmt: str = "cubin") -> bytes:
    """Compile CUDA C with nvcc for the target's arch (TVM's own nvcc driver); raises on errors."""
    from tvm.support import nvcc

    with target:
        return nvcc.compile_cuda(source, target_format=fmt, arch=str(target.attrs["arch"]), compiler="nvcc")
TensorLoad = tvm.ir.expr.TensorLoad  # what tirx.BufferLoad builds in 0.27 (buffer in ``.source``)
Constant = tvm.ir.expr.Constant  # relax constants (metadata GenericConst) in 0.27


def region_tensor(region):
    """The tensor (buffer var) a block's read/write region refers to (``.buffer`` before 0.27)."""
    return region.source


def tensor_shape(tensor_var) -> tuple:
    """Shape of a TIR buffer var of 0.27 (``buffer.shape`` before)."""
    return tuple(tensor_var.ty.shape)
structural_equal = tvm_ffi.structural_equal


def const_value(expr):
    """The numpy value of a Relax constant (``.data.numpy()`` before 0.27)."""
    import numpy as _np

    v = expr.value
    return v.numpy() if hasattr(v, "numpy") else _np.asarray(v)


def prim_func_params(func) -> list[tuple[list[int], str]]:
    """(shape, dtype) of each PrimFunc parameter (0.27: parameters are buffer vars, no buffer_map)."""
    return [([int(d) for d in p.shape], str(p.dtype)) for p in func.params]


def ms_measure_callback_class(apply):
    """A MetaSchedule measure callback calling ``apply(task_scheduler, task_id, candidates, builder_results,
    runner_results)`` (benchmarks/bench_tuner.py notes MetaSchedule's progress with one)."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

    @derived_object
    class _Callback(PyMeasureCallback):
        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
            apply(task_scheduler, task_id, measure_candidates, builder_results, runner_results)

    return _Callback()


def import_tensor_intrin() -> None:
    """What ``TuneContext()`` imports first (MetaSchedule's tensor intrinsics; slow: timed apart)."""
    import tvm.s_tir.tensor_intrin  # noqa: F401

# --- fast math (tvmfuse.fastmath): proving an exp's argument <= 0 from the max reduction it subtracts.
from tvm import sym as arith  # noqa: E402  (0.27: tvm.arith -> tvm.sym)

Analyzer = arith.Analyzer
detect_iter_map = arith.detect_iter_map
Range = tvm.ir.Range

# TIR built in Python (the attention template writes its loop nest over a kernel's own buffers)
from tvm.script.ir_builder import IRBuilder  # noqa: E402
from tvm.tirx.script.builder import ir as tir_builder  # noqa: E402
