"""Hook for the ONNX conformance suite (../shared/onnx-suite/run_suite.py).

``--hook tvmfuse.conformance:hook --relax-pipeline tvmfuse``: importing this module imports tvmfuse,
which registers the "tvmfuse" Relax pipeline; the suite then compiles every case through it.
The suite calls TVM's importer itself (``tvm.relax.frontend.onnx.from_onnx``); importing this module makes
that import what ``tvmfuse.load_onnx`` does before TVM's importer runs:

- tvmfuse's ONNX converters go in (Attention-23, LayerNormalization, RMSNormalization);
- the shape computations over static shapes are folded to constants first (``fold_static_shapes_fully``):
  ONNX's function-expanded cases (``*_expanded``) compute reshape targets and reduce axes from Shape, and
  TVM's importer refuses a Shape result fed to Size, Sub, Div, Mod, ... ("cannot handle ShapeExpr inputs").

The hook itself returns the imported module unchanged: all of tvmfuse's work happens in the pipeline.
"""
from __future__ import annotations

import functools

import tvmfuse  # noqa: F401  (registers the "tvmfuse" pipeline with TVM)
from tvmfuse import _compat as C
from tvmfuse.frontend import fold_static_shapes_fully, register_onnx_converters


def install_import_folding() -> None:
    """Wrap ``tvm.relax.frontend.onnx.from_onnx`` (the name the suite imports) so that it folds the static
    shape computations of the model before TVM's importer sees it (idempotent)."""
    pkg = C.onnx_package()
    tvm_from_onnx = pkg.from_onnx
    if getattr(tvm_from_onnx, "tvmfuse_folds_shapes", False):
        return

    @functools.wraps(tvm_from_onnx)
    def from_onnx(model, *args, **kwargs):
        folded, _ = fold_static_shapes_fully(model)
        return tvm_from_onnx(folded, *args, **kwargs)

    from_onnx.tvmfuse_folds_shapes = True
    pkg.from_onnx = from_onnx


register_onnx_converters()   # the suite calls TVM's importer itself: tvmfuse's converters go in first
install_import_folding()


def hook(mod):
    return mod
