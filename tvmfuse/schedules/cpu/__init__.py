"""CPU (llvm) schedule templates, in match order (first match wins).

Each file holds one family; the order puts the most specific structure first.
"""
from .elementwise import Elementwise
from .matmul import MatmulEpilogue
from .reduction import RowReduction

TEMPLATES: list = [
    MatmulEpilogue(),
    RowReduction(),
    Elementwise(),
]
