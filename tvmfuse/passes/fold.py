"""Constant folding in numpy, before legalization: the calls on constants whose numpy result is bit-identical to
what TVM's FoldConstant computes by building the call's PrimFunc with LLVM and running it.

Why: TVM's FoldConstant (after LegalizeOps) builds one LLVM module per distinct call on constants; the ONNX
importer leaves one per conv bias (``reshape(b, [1, C, 1, 1])``), per Clip bound (``isnan`` / ``where`` on a
scalar) and per Gemm weight (``permute_dims``).  mobilenet_v2 has 55 such calls: FoldConstant took 5.1 of its
~9 s of compile, resnet18's 21 calls 2.8 of ~5.5 s (pass timings, measured under load; benchmarks/gaps_cnn.md).
Folded here, FoldConstant finds nothing left to build.

One row per folded op: the Relax op, the numpy function, the dtypes it is exact for, why.  Only ops whose
result is exact in numpy are rows: data movement (reshape and its kin, permute_dims), predicates and selects,
and float arithmetic that IEEE 754 rounds correctly (+, -, *, /; each call is its own PrimFunc in FoldConstant,
so no two operations are contracted into one FMA there either).  A call with a non-constant argument, an op
not in the table or a dtype outside the row's is left for TVM's FoldConstant (``fold`` returns None).
tests/test_passes_fold.py checks every row bit-identical to TVM's FoldConstant and that it does not fire on a
non-constant argument.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import _compat as C
from .rewrites import rewrite_functions

# float16 left to TVM: numpy computes it through float32, LLVM may not
FLOAT_DTYPES = frozenset({"float32", "float64"})
ANY_DTYPE = None


def _static_shape(expr) -> tuple[int, ...] | None:
    ty = C.type_of(expr)
    if not isinstance(ty, C.TensorType) or not isinstance(ty.shape, C.relax.ShapeExpr):
        return None
    dims = list(ty.shape.values)
    if not all(isinstance(d, C.IntImm) for d in dims):
        return None
    return tuple(int(d.value) for d in dims)


# --------------------------------------------------------------------------- numpy evaluations of one call
# each takes (call, [numpy arrays of its tensor arguments], output shape) and returns the numpy result
def _as_shape(call, arrays, shape):
    return np.reshape(arrays[0], shape)


def _permute_dims(call, arrays, shape):
    axes = call.attrs.axes
    return np.transpose(arrays[0], None if axes is None else [int(a) for a in axes])


def _unary(fn):
    return lambda call, arrays, shape: fn(arrays[0])


def _binary(fn):
    return lambda call, arrays, shape: fn(arrays[0], arrays[1])


def _where(call, arrays, shape):
    return np.where(arrays[0], arrays[1], arrays[2])


@dataclass(frozen=True)
class ConstantFold:
    name: str
    op: str
    evaluate: Callable
    dtypes: frozenset | None   # the dtypes (of every argument and the result) it is exact for; None: any
    why: str


CONSTANT_FOLDS: tuple[ConstantFold, ...] = (
    ConstantFold("reshape", "relax.reshape", _as_shape, ANY_DTYPE,
                 "a conv bias reshaped to [1, C, 1, 1] (one per ONNX Conv with bias); test_passes_fold"),
    ConstantFold("expand_dims", "relax.expand_dims", _as_shape, ANY_DTYPE,
                 "a view: the same elements in C order; test_passes_fold"),
    ConstantFold("squeeze", "relax.squeeze", _as_shape, ANY_DTYPE,
                 "a view: the same elements in C order; test_passes_fold"),
    ConstantFold("flatten", "relax.flatten", _as_shape, ANY_DTYPE,
                 "a view: the same elements in C order; test_passes_fold"),
    ConstantFold("permute_dims", "relax.permute_dims", _permute_dims, ANY_DTYPE,
                 "a Gemm's transposed weight (transB); test_passes_fold"),
    ConstantFold("isnan", "relax.isnan", _unary(np.isnan), ANY_DTYPE,
                 "ONNX Clip's bounds (isnan then where on a scalar, two per ReLU6); test_passes_fold"),
    ConstantFold("where", "relax.where", _where, ANY_DTYPE,
                 "ONNX Clip's bounds; test_passes_fold"),
    ConstantFold("add", "relax.add", _binary(np.add), FLOAT_DTYPES,
                 "IEEE addition: correctly rounded in numpy and LLVM alike; test_passes_fold"),
    ConstantFold("subtract", "relax.subtract", _binary(np.subtract), FLOAT_DTYPES,
                 "IEEE subtraction; test_passes_fold"),
    ConstantFold("multiply", "relax.multiply", _binary(np.multiply), FLOAT_DTYPES,
                 "IEEE multiplication; test_passes_fold"),
    ConstantFold("divide", "relax.divide", _binary(np.divide), FLOAT_DTYPES,
                 "IEEE division (float only: integer division rounds differently); test_passes_fold"),
)
_FOLD_BY_OP = {row.op: row for row in CONSTANT_FOLDS}


def fold(call, constant_of: Callable) -> C.Constant | None:
    """``call`` evaluated in numpy as a constant, or None when it does not apply: its op has no row, an
    argument is not a constant (``constant_of(arg)``: the arg's constant or None), a dtype is outside the row's,
    or the result's shape is not static."""
    if not (isinstance(call, C.relax.Call) and isinstance(call.op, C.Op)):
        return None
    row = _FOLD_BY_OP.get(call.op.name)
    if row is None:
        return None
    shape = _static_shape(call)
    if shape is None:
        return None
    tensors = [a for a in call.args if isinstance(C.type_of(a), C.TensorType)]
    consts = [constant_of(a) for a in tensors]
    if not tensors or any(c is None for c in consts):
        return None
    out_dtype = str(C.type_of(call).dtype)
    arrays = [C.const_value(c) for c in consts]
    if row.dtypes is not None and (out_dtype not in row.dtypes or any(str(a.dtype) != out_dtype for a in arrays)):
        return None     # outside the row's dtypes, or mixed (TVM's legalization casts; numpy promotes)
    with np.errstate(all="ignore"):      # x / 0, inf - inf: IEEE results, as the compiled kernel gives
        result = np.asarray(row.evaluate(call, arrays, shape))
    if result.shape != shape or str(result.dtype) != out_dtype:
        return None     # a row's evaluation disagrees with the call's type: leave it to TVM
    return C.relax.const(np.array(result, order="C"), out_dtype)   # a copy; keeps a 0-d result 0-d


@C.mutator
class _FoldMutator(C.PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)

    def _constant_of(self, expr):
        if isinstance(expr, C.Constant):
            return expr
        if isinstance(expr, C.relax.Var):
            bound = self.lookup_binding(expr)
            return bound if isinstance(bound, C.Constant) else None
        return None

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        new = fold(call, self._constant_of)
        return call if new is None else new


@C.module_pass(opt_level=0, name="tvmfuse.FoldConstantsNumpy")
class FoldConstantsNumpy:
    """Calls on constants folded in numpy where the result is exact (``CONSTANT_FOLDS``), before TVM's
    FoldConstant, which builds an LLVM module per call."""

    def transform_module(self, mod, _ctx):
        return rewrite_functions(mod, _FoldMutator)
