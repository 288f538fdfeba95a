"""tvmfuse: operation fusion for Apache TVM (Relax passes, fused-kernel schedules, tuner, export).

Importing tvmfuse registers the "tvmfuse" Relax pipeline with TVM.  onnx is imported only when a model
is imported or compiled, so a deployed artifact loads (``tvmfuse.load``) without onnx; tvmfuse itself
imports TVM's compiler library (``tvm.relax``), so loading needs a full TVM install.  On a runtime-only
TVM (``TVM_USE_RUNTIME_LIB=1``, or a wheel without ``libtvm_compiler``) an artifact's ``model.so`` runs
through ``tvm.runtime`` alone, as ``benchmarks/gpu_run.py`` does.
"""
from __future__ import annotations

from .version import __version__  # noqa: E402

from .compiled import CompiledModel, compile  # noqa: E402,A004
from .errors import (ArtifactError, InputError, ModelLoadError, TargetError, TuningLogError,  # noqa: E402
                     TvmfuseError, UnsupportedOpError)
from .export import export, load  # noqa: E402
from .io import ALIGNMENT, Binding, aligned_numpy, empty, zeros  # noqa: E402
from .pipeline import (PipelineOptions, dlight_pipeline, pipeline, register as _register_pipeline,  # noqa: E402
                       stock_pipeline)
from .report import FusionReport  # noqa: E402
from .target import host_target, parse_target  # noqa: E402


def load_onnx(path_or_model, **kwargs):
    """Import an ONNX model as a Relax IRModule (see ``tvmfuse.frontend.load_onnx``)."""
    from .frontend import load_onnx as _load_onnx

    return _load_onnx(path_or_model, **kwargs)


_register_pipeline()

__all__ = ["compile", "CompiledModel", "load_onnx", "export", "load", "pipeline", "stock_pipeline", "dlight_pipeline",
           "PipelineOptions",
           "FusionReport", "empty", "zeros", "aligned_numpy", "ALIGNMENT", "Binding", "host_target", "parse_target", "TvmfuseError", "ModelLoadError",
           "UnsupportedOpError", "InputError", "TargetError", "ArtifactError", "TuningLogError",
           "__version__"]
