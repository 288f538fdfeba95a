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
from tvm.relax.frontend.onnx import from_onnx
from tvm.s_tir import Schedule, dlight
from tvm.s_tir import meta_schedule
from tvm.target import Target

tir = tirx  # the TIR namespace under its 0.27 name

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
