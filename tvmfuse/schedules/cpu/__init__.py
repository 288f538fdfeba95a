"""CPU (llvm) schedule templates, in match order (first match wins).

Each file holds one family; the order puts the most specific structure first.
"""
from .attention import Attention
from .conv1x1 import Conv1x1
from .conv2d import Conv2DEpilogue
from .conv_lanes import ConvLanes
from .depthwise import DepthwiseConv2DEpilogue
from .elementwise import Elementwise
from .matmul import MatmulEpilogue
from .pooling import WindowPool
from .prologue import NormMatmul
from .reduction import RowReduction
from .scan import Scan
from .siblings import SiblingMatmuls
from .symbolic import SymbolicRows
from .symbolic_batch_matmul import SymbolicBatchMatmul
from .symbolic_matmul import SymbolicMatmulEpilogue
from .symbolic_prologue import SymbolicNormMatmul
from .symbolic_siblings import SymbolicSiblings

TEMPLATES: list = [
    Scan(),                       # first: TVM's extern cumsum / cumprod kernel has no root block, on which
                                  # the other families' match fails (a template error, not a refusal)
    NormMatmul(),                 # the norm_prologue rule's kernels: row sums + a norm feeding matmuls
    MatmulEpilogue(),
    Attention(),                  # the attention rule's kernels (spec attribute); matmul_epilogue rejects
                                  # them (several reductions): test_attention checks which template ran
    Conv1x1(),                    # before Conv2DEpilogue: 1x1 convs on small planes, channels on the lanes
    ConvLanes(),                  # before Conv2DEpilogue: KxK convs on small planes (IHWO weights)
    Conv2DEpilogue(),             # before RowReduction: a conv is also a trailing reduction
    DepthwiseConv2DEpilogue(),
    SiblingMatmuls(),             # several matmuls of one input: before RowReduction
    WindowPool(),                 # before RowReduction: a strided max pool is also a trailing reduction
    RowReduction(),
    Elementwise(),
    SymbolicNormMatmul(),         # the norm_prologue rule's kernels over symbolic rows (batch x seq)
    SymbolicMatmulEpilogue(),     # a matmul over symbolic rows (batch x seq) with static N/K
    SymbolicSiblings(),           # several matmuls of one input over symbolic rows: before SymbolicRows
    SymbolicBatchMatmul(),        # a batched matmul over symbolic extents (B per batch): before SymbolicRows
    SymbolicRows(),               # last: reductions over symbolic extents the static templates refuse
]
