"""CPU (llvm) schedule templates, in match order (first match wins).

Each file holds one family; the order puts the most specific structure first.
"""
from .matmul import MatmulEpilogue

TEMPLATES: list = [
    MatmulEpilogue(),
]
