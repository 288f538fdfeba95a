"""CUDA schedule templates, in match order (first match wins).

Gated on the target: ``templates_for`` imports this list for GPU targets, and every template declares
``target_kinds = ("cuda",)``.  Per-architecture numbers live in ``_common.ARCHS``.
"""
from .attention import CudaAttention
from .conv2d import CudaConv2d
from .depthwise import CudaDepthwiseConv2d
from .elementwise import CudaElementwise
from .matmul import CudaMatmul
from .row_reduction import CudaRowReduction
from .siblings import CudaSiblings

TEMPLATES: list = [
    CudaAttention(),       # the attention rule's kernels (spec attribute): online softmax, K/V tiles in shared
    CudaSiblings(),        # several matmuls of one shape (Q/K/V, SwiGLU): one tile loop, X staged once
    CudaMatmul(),          # (batch) matmul + epilogue: shared-memory tiles, register accumulators
    CudaDepthwiseConv2d(), # depthwise conv + epilogue: a thread per pixel(s), input rows shared, weights in registers
    CudaConv2d(),          # NCHW conv + epilogue: padded window and weights staged in shared memory
    CudaRowReduction(),    # normalization chains: a block per row, cross-thread allreduce
    CudaElementwise(),     # all-spatial groups: flatten, blocks x threads x 128-bit vectors
]
