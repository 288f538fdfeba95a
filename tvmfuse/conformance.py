"""Hook for the ONNX conformance suite (../shared/onnx-suite/run_suite.py).

``--hook tvmfuse.conformance:hook --relax-pipeline tvmfuse``: importing this module imports tvmfuse,
which registers the "tvmfuse" Relax pipeline; the suite then compiles every case through it.
The hook itself returns the imported module unchanged: all of tvmfuse's work happens in the pipeline
and in the ONNX converters it registers (Attention-23, LayerNormalization, RMSNormalization).
"""
from __future__ import annotations

import tvmfuse  # noqa: F401  (registers the "tvmfuse" pipeline with TVM)
from tvmfuse.frontend import register_onnx_converters

register_onnx_converters()   # the suite calls TVM's importer itself: tvmfuse's converters go in first


def hook(mod):
    return mod
