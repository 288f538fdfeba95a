"""Pre-legalize rewrites on high-level Relax ops: batch-norm folding and peephole simplifications.

Each rewrite is one row of a table (name, the op it looks at, the function that returns the replacement
or None when it does not apply, one-line why naming its test).  The passes leave dead bindings behind;
``pre_legalize_passes`` runs TVM's CanonicalizeBindings and DeadCodeElimination after them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import _compat as C
from ..explain import record_refusal
from .grouping import rewrite_dataflow_blocks


def _const_array(expr) -> np.ndarray | None:
    return C.const_value(expr) if isinstance(expr, C.Constant) else None


def _same_type(a, b) -> bool:
    return C.structural_equal(C.type_of(a), C.type_of(b))


def _is_float(expr) -> bool:
    ty = C.type_of(expr)
    return isinstance(ty, C.TensorType) and str(ty.dtype).startswith(("float", "bfloat"))


def _static_dims(expr, symbolic_batch: bool = False) -> list[int | None] | None:
    """The static dims of ``expr``'s shape, or None; with ``symbolic_batch`` the first dim may be symbolic
    (given as None)."""
    ty = C.type_of(expr)
    if not isinstance(ty, C.TensorType) or not isinstance(ty.shape, C.relax.ShapeExpr):
        return None
    dims = list(ty.shape.values)
    if not all(isinstance(d, C.IntImm) for d in dims[1 if symbolic_batch else 0:]):
        return None
    return [int(d.value) if isinstance(d, C.IntImm) else None for d in dims]


# --------------------------------------------------------------------------- peephole rows
def _drop_constant(value: float, either_side: bool):
    """The peephole ``x op c -> x`` for a constant ``c`` all of whose elements are ``value`` (and ``x`` of the
    call's type, so no broadcast is lost); ``either_side``: ``c op x`` too (a commutative op)."""

    def rewrite(m, call):
        x, c = call.args
        for a, b in ((x, c), (c, x))[:2 if either_side else 1]:
            arr = _const_array(b)
            if arr is not None and arr.size and np.all(arr == value) and _same_type(a, call):
                return a
        return None

    return rewrite


_mul_one = _drop_constant(1, either_side=True)
_add_zero = _drop_constant(0, either_side=True)
_sub_zero = _drop_constant(0, either_side=False)


def _div_const(m, call):
    x, c = call.args
    arr = _const_array(c)
    if arr is None or not _is_float(call) or not _is_float(c) or arr.size == 0:
        return None
    if not np.all(np.isfinite(arr)) or np.any(arr == 0):
        return None  # x / 0 and x / inf keep their IEEE meaning
    return C.relax.op.multiply(x, C.relax.const((1.0 / arr.astype(np.float64)).astype(arr.dtype)))


MAX_MULTIPLY_POWER = 4     # pow(x, n) up to this n becomes multiplies (the same bound as fastmath's)


def _integer_power(m, call):
    """``pow(x, n)`` for a constant integer ``1 <= n <= MAX_MULTIPLY_POWER`` (every element of the exponent
    the same, the result of ``x``'s type) -> multiplies. CUDA builds compile with nvcc's --use_fast_math,
    where powf is exp2(y * log2(x)): NaN for every negative x (GPT-2's GELU x^3, RMSNorm's x^2); the
    multiplies are exact everywhere and cheaper."""
    x, c = call.args
    arr = _const_array(c)
    if arr is None or arr.size == 0 or not _is_float(call) or not _same_type(x, call):
        return None
    n = float(arr.reshape(-1)[0])
    if not np.all(arr == n) or n != int(n) or not 1 <= n <= MAX_MULTIPLY_POWER:
        return None
    n = int(n)
    if n == 1:
        return x
    if n == 4:
        sq = m.builder_.emit(C.relax.op.multiply(x, x))
        return C.relax.op.multiply(sq, sq)
    out = C.relax.op.multiply(x, x)
    if n == 3:
        out = C.relax.op.multiply(m.builder_.emit(out), x)
    return out


def _identity_reshape(m, call):
    x = call.args[0]
    return x if _static_dims(x) is not None and _same_type(x, call) else None


def _identity_transpose(m, call):
    x = call.args[0]
    axes = call.attrs.axes
    if axes is None:
        ndim = len(_static_dims(x) or [])
        return x if ndim <= 1 and _same_type(x, call) else None
    return x if [int(a) for a in axes] == list(range(len(axes))) and _same_type(x, call) else None


def _identity_cast(m, call):
    x = call.args[0]
    ty = C.type_of(x)
    return x if isinstance(ty, C.TensorType) and str(ty.dtype) == str(call.attrs.dtype) else None


def _outer_product_matmul(m, call):
    """``a [..., M, 1] @ b [..., 1, N]``: a sum over one product, i.e. ``a * b`` broadcast (exact in every
    dtype: the matmul adds its one product to zero).  None for any other matmul."""
    a, b = call.args
    ta, tb = C.type_of(a), C.type_of(b)
    if not all(isinstance(t, C.TensorType) and isinstance(t.shape, C.relax.ShapeExpr) for t in (ta, tb)):
        return None
    da, db = list(ta.shape.values), list(tb.shape.values)
    out_dtype = str(call.attrs.out_dtype) if call.attrs.out_dtype is not None else ""
    if len(da) < 2 or len(db) < 2 or str(ta.dtype) != str(tb.dtype) or out_dtype not in ("", "void", str(ta.dtype)):
        return None
    k_a, k_b = da[-1], db[-2]
    if not (isinstance(k_a, C.IntImm) and int(k_a.value) == 1 and isinstance(k_b, C.IntImm) and int(k_b.value) == 1):
        return None
    return C.relax.op.multiply(a, b)


def _matmul_of_broadcast_constant(m, call):
    """``x [B h, M, K] @ w``, ``w`` a constant ``c`` [1?, h, R, C] broadcast over a symbolic batch ``B``
    (``broadcast_to`` [B, h, R, C], ``reshape`` [B h, R, C], optionally ``permute_dims`` [0, 2, 1]: DeBERTa's
    relative-position keys / queries per head, repeated for every sequence of the batch) ->
    ``reshape(reshape(x, [B, h, M, K]) @ c' [h, K, N], [B h, M, N])``, ``c'`` the constant as the matmul reads
    it (transposed in numpy): the matmul broadcasts the constant itself, no [B h, K, N] copy per call (a
    kernel of its own: what a static build folds to the constant).  Exact (the same products and sums).
    None when ``w`` is anything else or the batch is static (FoldConstant folds the copy there)."""
    x, w = call.args
    perm = _op_call(m, w, "permute_dims")
    if perm is not None:
        axes = [int(a) for a in perm.attrs.axes] if perm.attrs.axes is not None else None
        if axes != [0, 2, 1]:
            return None
    reshape = _op_call(m, perm.args[0] if perm is not None else w, "reshape")
    bcast = _op_call(m, reshape.args[0], "broadcast_to") if reshape is not None else None
    arr = _const_array(bcast.args[0]) if bcast is not None else None
    target = _shape_values(bcast.args[1]) if bcast is not None else None
    tx = C.type_of(x)
    if arr is None or target is None or len(target) != 4 or isinstance(target[0], C.IntImm) \
            or not isinstance(tx, C.TensorType) or not isinstance(tx.shape, C.relax.ShapeExpr):
        return None
    if arr.ndim == 4 and arr.shape[0] == 1:
        arr = arr[0]
    dx = list(tx.shape.values)
    if arr.ndim != 3 or len(dx) != 3 or not all(isinstance(d, C.IntImm) for d in target[1:]) \
            or [int(d) for d in target[1:]] != list(arr.shape):
        return None
    heads = arr.shape[0]
    batch = C.Analyzer().simplify(target[0])
    merged = _shape_values(reshape.args[1]) or []
    if not (C.Analyzer().can_prove_equal(dx[0], batch * heads) and len(merged) == 3
            and all(isinstance(d, C.IntImm) for d in merged[1:])
            and [int(d) for d in merged[1:]] == list(arr.shape[1:])):
        return None
    weight = np.ascontiguousarray(arr.transpose(0, 2, 1) if perm is not None else arr)
    if not isinstance(dx[2], C.IntImm) or int(dx[2]) != weight.shape[1]:
        return None
    x4 = C.relax.op.reshape(x, C.relax.ShapeExpr([batch, heads, dx[1], dx[2]]))
    y4 = C.relax.op.matmul(x4, C.relax.const(weight, str(C.type_of(call).dtype)), out_dtype=call.attrs.out_dtype)
    return C.relax.op.reshape(y4, C.relax.ShapeExpr([dx[0], dx[1], weight.shape[2]]))


def _shape_values(expr) -> list | None:
    """The dims of a Relax shape (an ``R.shape([...])`` or a var of a known Shape type), or None."""
    if isinstance(expr, C.relax.ShapeExpr):
        return list(expr.values)
    ty = C.type_of(expr)
    values = getattr(ty, "values", None) if isinstance(ty, C.relax.ShapeType) else None
    return list(values) if values is not None else None


def _op_call(m, expr, name: str):
    """The call of ``relax.<name>`` that ``expr`` (a dataflow var) is bound to, or None."""
    bound = m.lookup_binding(expr) if isinstance(expr, C.relax.Var) else expr
    ok = isinstance(bound, C.relax.Call) and isinstance(bound.op, C.Op) and bound.op.name == f"relax.{name}"
    return bound if ok else None


def _gather_index(m, index) -> np.ndarray | None:
    """A constant index, also behind the ONNX importer's Gather normalization ``where(c < 0, c + n, c)`` of a
    constant ``c`` (None otherwise): ``c`` itself, whose negative values the caller wraps."""
    arr = _const_array(index)
    if arr is not None:
        return arr
    where = _op_call(m, index, "where")
    if where is None:
        return None
    cond, neg, c = where.args
    less, add = _op_call(m, cond, "less"), _op_call(m, neg, "add")
    c_arr = _const_array(c)
    if less is None or add is None or c_arr is None or not (less.args[0].same_as(c) and add.args[0].same_as(c)):
        return None
    return c_arr


def _take_of_symbolic_shape(m, call):
    """``take(shape_to_tensor(shape), k)`` for a constant ``k`` and a shape with a symbolic dim (ONNX ``Shape``
    then ``Gather`` of one dim: BERT-style models' mask and position code) -> ``arange(d, d + 1)`` reshaped to
    a scalar, ``d`` the shape's k-th dim: an injective op that fuses into the kernel reading it, where
    ``shape_to_tensor`` and the ``take`` were two kernels of their own per call.  Exact (the dim itself, int64).
    A one-element index ``[k]`` (ONNX Gather with a 1-D index: albert_dyn's mask code) gives ``arange(d, d + 1)``
    itself.  None for a shape of constants (FoldConstant folds it), an unknown shape, a non-constant index or
    a ``take`` with more than one index."""
    data, index = call.args
    if not isinstance(data, C.relax.Var):
        return None
    src = m.lookup_binding(data)
    if not (isinstance(src, C.relax.Call) and isinstance(src.op, C.Op) and src.op.name == "relax.shape_to_tensor"):
        return None
    values = _shape_values(src.args[0])
    k = _gather_index(m, index)
    if not values or all(isinstance(v, C.IntImm) for v in values) or k is None or k.size != 1 or k.ndim > 1:
        return None
    d = values[int(k.reshape(-1)[0]) % len(values)]
    ty = C.type_of(call)
    if not (isinstance(ty, C.TensorType) and str(ty.dtype) == "int64"):
        return None
    one = C.relax.op.arange(d, d + 1, 1, "int64")        # [1]: a one-element index keeps its axis
    return one if k.ndim == 1 else C.relax.op.reshape(one, [])


def _cumsum_of_ones(m, call):
    """``cumsum(full(shape, 1), axis)`` (OPT's position ids: ``cumsum`` of the all-ones attention mask that the
    exported graph builds when no mask is given): ``arange(1, n + 1)`` along ``axis``, broadcast to the
    shape, an injective op that fuses into the position lookup; the scan is an extern kernel of its own
    (``cpu.scan``) and ``full`` one more.  Exact in integer dtypes; in float32 the scan's partial sums are the
    integers 1..n, exact while n <= 2**24 (the float32 mantissa), as the arange's values are.  None for any
    other fill value, an exclusive scan, a cast to another dtype or an unknown rank."""
    data = call.args[0]
    full = m.lookup_binding(data) if isinstance(data, C.relax.Var) else data
    if not (isinstance(full, C.relax.Call) and isinstance(full.op, C.Op) and full.op.name == "relax.full"):
        return None
    fill = _const_array(full.args[1])
    ty = C.type_of(call)
    if fill is None or fill.size != 1 or float(fill.reshape(-1)[0]) != 1.0 or bool(call.attrs.exclusive):
        return None
    dims = list(ty.shape.values) if isinstance(ty, C.TensorType) and isinstance(ty.shape, C.relax.ShapeExpr) else None
    if dims is None or call.attrs.axis is None or str(ty.dtype) != str(C.type_of(data).dtype):
        return None
    axis = int(call.attrs.axis) % len(dims)
    ramp = C.relax.op.arange(1, dims[axis] + 1, 1, str(ty.dtype))
    if axis != len(dims) - 1:   # along the last axis the ramp broadcasts as it is (no layout op: an epilogue)
        ramp = C.relax.op.reshape(ramp, [dims[axis] if i == axis else 1 for i in range(len(dims))])
    return C.relax.op.broadcast_to(ramp, C.relax.ShapeExpr(dims))


@dataclass(frozen=True)
class PeepholeRule:
    name: str
    op: str
    rewrite: Callable
    why: str


PEEPHOLES: tuple[PeepholeRule, ...] = (
    PeepholeRule("mul_one", "relax.multiply", _mul_one,
             "x*1 -> x: no kernel for a copy; test_passes_rewrites::test_peephole[mul_one]"),
    PeepholeRule("add_zero", "relax.add", _add_zero,
             "x+0 -> x; test_passes_rewrites::test_peephole[add_zero]"),
    PeepholeRule("sub_zero", "relax.subtract", _sub_zero,
             "x-0 -> x; test_passes_rewrites::test_peephole[sub_zero]"),
    PeepholeRule("div_const", "relax.divide", _div_const,
             "x/c -> x*(1/c): a multiply is cheaper than a divide in every lane (1 ulp); "
             "test_passes_rewrites::test_peephole[div_const]"),
    PeepholeRule("integer_power", "relax.power", _integer_power,
                 "pow(x, n), n = 1..4 -> multiplies: exact for negative x, where CUDA's fast-math powf is NaN "
                 "(gpt2 and llama were NaN on an H200: notes/gpu22.md); test_passes_rewrites::test_peephole"
                 "[integer_power]"),
    PeepholeRule("identity_reshape", "relax.reshape", _identity_reshape,
             "reshape to its own shape -> x; test_passes_rewrites::test_peephole[identity_reshape]"),
    PeepholeRule("identity_transpose", "relax.permute_dims", _identity_transpose,
             "transpose with perm 0..n-1 -> x; test_passes_rewrites::test_peephole[identity_transpose]"),
    PeepholeRule("outer_product_matmul", "relax.matmul", _outer_product_matmul,
             "a [.., M, 1] @ b [.., 1, N] -> a * b: a reduction over one element is a broadcast multiply, "
             "which fuses with its elementwise neighbours (a symbolic Llama's rotary angles, position x "
             "inverse frequency: a kernel of their own as a matmul); "
             "test_passes_rewrites::test_peephole[outer_product_matmul]"),
    PeepholeRule("identity_cast", "relax.astype", _identity_cast,
             "cast to its own dtype -> x (HF Llama/T5 cast the residual stream to float32 before RMSNorm: "
             "a copy the residual add and the norm prologue shared); test_passes_rewrites::test_peephole[identity_cast]"),
    PeepholeRule("matmul_of_broadcast_constant", "relax.matmul", _matmul_of_broadcast_constant,
                 "x [B h, M, K] @ a constant per head broadcast over a symbolic batch -> a 4-D matmul that "
                 "broadcasts the constant itself: no copy kernel per call (deberta_v2_dyn's position keys and "
                 "queries, 37 -> 33 kernels: notes/corpus13.md); "
                 "test_symbolic_shape_peepholes::test_symbolic_peephole[matmul_of_broadcast_constant]"),
    PeepholeRule("take_of_symbolic_shape", "relax.take", _take_of_symbolic_shape,
                 "one symbolic dim of a shape as a tensor -> arange(d, d+1): fuses into its reader, where "
                 "shape_to_tensor and the take of the dim were two kernels per call (albert_dyn, roberta_dyn; "
                 "notes/symtok12.md); test_symbolic_shape_peepholes::test_symbolic_peephole[take_of_symbolic_shape]"),
    PeepholeRule("cumsum_of_ones", "relax.cumsum", _cumsum_of_ones,
                 "cumsum of an all-ones fill -> arange(1, n+1) broadcast: no scan kernel and no fill kernel per "
                 "call (opt_dyn's position ids); test_symbolic_shape_peepholes::test_symbolic_peephole[cumsum_of_ones]"),
)
_PEEPHOLE_BY_OP: dict[str, list[PeepholeRule]] = {}
for _row in PEEPHOLES:
    _PEEPHOLE_BY_OP.setdefault(_row.op, []).append(_row)


@C.mutator
class _PeepholeMutator(C.PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        if not (isinstance(call, C.relax.Call) and isinstance(call.op, C.Op)):
            return call
        for row in _PEEPHOLE_BY_OP.get(call.op.name, ()):
            new = row.rewrite(self, call)
            if new is not None:
                return new
        return call


@C.module_pass(opt_level=0, name="tvmfuse.Peephole")
class Peephole:
    """x*1, x+0, x-0, identity reshape/transpose/cast -> x; division by a constant -> multiply; a matmul
    over one element -> a broadcast multiply."""

    def transform_module(self, mod, _ctx):
        return rewrite_functions(mod, _PeepholeMutator)


def rewrite_functions(mod, mutator_cls, *extra):
    """``mod`` with each Relax function (not a fused kernel's Primitive function) through one
    ``mutator_cls(mod, *extra)``; shared by the expression-mutator passes (here, fold.py, relpos.py)."""
    m = mutator_cls(mod, *extra)
    for gv, func in mod.functions.items():
        if isinstance(func, C.relax.Function) and not (func.attrs and "Primitive" in func.attrs):
            m.builder_.update_func(gv, m.visit_expr(func))
    return m.builder_.get()


# --------------------------------------------------------------------------- batch-norm folding
def _use_counts(mod) -> dict:
    counts: dict = {}
    for func in mod.functions.values():
        if not isinstance(func, C.relax.Function):
            continue
        for block in func.body.blocks:
            for b in block.bindings:
                for v in C.relax_free_vars(b.value):
                    counts[v] = counts.get(v, 0) + 1
        for v in C.relax_free_vars(func.body.body):
            counts[v] = counts.get(v, 0) + 1
    return counts


@C.mutator
class _FoldBatchNormMutator(C.PyExprMutator):
    """``bn(conv2d(x, W))[0]`` / ``bn(matmul(x, W))[0]`` with constant W and BN parameters becomes
    ``conv2d(x, W * s) + (beta - mean * s)`` with ``s = gamma / sqrt(var + eps)``."""

    def __init__(self, mod, uses):
        super().__init__(mod)
        self.uses = uses

    def visit_tuple_getitem_(self, tgi):
        tgi = self.visit_expr_post_order(tgi)
        if int(tgi.index) != 0 or not isinstance(tgi.tuple_value, C.relax.Var):
            return tgi
        bn = self.lookup_binding(tgi.tuple_value)
        if not (isinstance(bn, C.relax.Call) and isinstance(bn.op, C.Op) and bn.op.name == "relax.nn.batch_norm"):
            return tgi
        new = self._fold(bn)
        return tgi if new is None else new

    def _refuse(self, producer: str, reason: str):
        record_refusal(producer, "batch_norm", reason, "fold_batch_norm")
        return None

    def _fold(self, bn):
        data, gamma, beta, mean, var = bn.args
        if not isinstance(data, C.relax.Var):
            return None
        name = C.var_name(data)
        params = [_const_array(p) for p in (gamma, beta, mean, var)]
        if any(p is None for p in params):
            return self._refuse(name, "batch-norm parameters are not constants (nothing to fold at compile time)")
        if bool(bn.attrs.training) or not (bool(bn.attrs.center) and bool(bn.attrs.scale)):
            return self._refuse(name, "batch norm in training mode or without center/scale")
        prod = self.lookup_binding(data)
        if not (isinstance(prod, C.relax.Call) and isinstance(prod.op, C.Op)):
            return self._refuse(C.var_name(data), "the batch norm's input is not a conv2d, conv1d or matmul")
        op = prod.op.name
        if op not in ("relax.nn.conv2d", "relax.nn.conv1d", "relax.matmul"):
            return self._refuse(op, "the batch norm's input is not a conv2d, conv1d or matmul")
        if self.uses.get(data, 0) != 1:
            return self._refuse(op, "the conv/matmul output has other users (folding would compute it twice)")
        x, w = prod.args
        w_arr = _const_array(w)
        if w_arr is None or not _is_float(w):
            return self._refuse(op, "the weights are not constants")
        ty = C.type_of(data)
        if not isinstance(ty, C.TensorType) or int(ty.ndim) < 0:
            return self._refuse(op, "unknown output rank")
        out_dims = [None] * int(ty.ndim)   # only the rank matters: symbolic extents (batch) fold the same
        axis = int(bn.attrs.axis) % len(out_dims)
        if op in ("relax.nn.conv2d", "relax.nn.conv1d"):
            a = prod.attrs
            want = ("NCHW", "OIHW", "NCHW") if op == "relax.nn.conv2d" else ("NCW", "OIW", "NCW")
            if (str(a.data_layout), str(a.kernel_layout), str(a.out_layout)) != want or axis != 1:
                return self._refuse(op, f"layout other than {want[0]}/{want[1]} with the batch norm on channels")
            w_axis = 0
        else:
            if w_arr.ndim != 2 or axis != len(out_dims) - 1:
                return self._refuse(op, "matmul weight not 2-D or batch norm not on the last axis")
            w_axis = 1
        g, b, mu, v = (p.astype(np.float64) for p in params)
        scale = g / np.sqrt(v + float(bn.attrs.epsilon))
        bshape = [1] * w_arr.ndim
        bshape[w_axis] = -1
        new_w = (w_arr.astype(np.float64) * scale.reshape(bshape)).astype(w_arr.dtype)
        bias_shape = [1] * len(out_dims)
        bias_shape[axis] = -1
        bias = (b - mu * scale).reshape(bias_shape).astype(w_arr.dtype)
        new_prod = self.builder_.emit(C.relax.Call(prod.op, [x, C.relax.const(new_w)], prod.attrs, prod.ty_args))
        return C.relax.op.add(new_prod, C.relax.const(bias))


@C.module_pass(opt_level=0, name="tvmfuse.FoldBatchNorm")
class FoldBatchNorm:
    """Batch norm with constant parameters after a conv2d / conv1d (any groups) or matmul folded into its
    weights."""

    def transform_module(self, mod, _ctx):
        return rewrite_functions(mod, _FoldBatchNormMutator, _use_counts(mod))


# --------------------------------------------------------------------------- pointwise conv weights
def _ints_all(values, want: int) -> bool:
    return all(int(v) == want for v in values)


def _transposed_pointwise(call, target):
    """``conv2d(x, W)`` (NCHW/OIHW, groups 1, constant float W) whose plane ``cpu.conv1x1`` (1x1, stride 1, no
    padding: ``conv1x1.plane_why``) or ``cpu.conv2d_lanes`` (any other: ``conv_lanes.plane_why``) takes on
    ``target`` -> the same conv with W stored in blocks of the family's default register tile's channels B,
    ``[co // B, ci, ky, kx, co % B]`` (kernel layout ``OIHW<B>o``, legalized by ``passes.legalize``): those
    templates put the output channels on the vector lanes and read a vector of weights contiguously, instead of
    packing W transposed on every call, and each register tile's weights are one contiguous run (stored
    [ci, ky, kx, co] they were nr channels every row of co: cold in the model, 6-9x the warm kernel); else None."""
    if not (isinstance(call, C.relax.Call) and isinstance(call.op, C.Op) and call.op.name == "relax.nn.conv2d"):
        return None
    a = call.attrs
    if (str(a.data_layout), str(a.kernel_layout), str(a.out_layout)) != ("NCHW", "OIHW", "NCHW") \
            or int(a.groups) != 1:
        return None
    x, w = call.args
    w_arr = _const_array(w)
    out = _static_dims(call, symbolic_batch=True)      # both families take a symbolic batch
    if w_arr is None or not _is_float(w) or w_arr.ndim != 4 or out is None:
        return None
    pointwise = list(w_arr.shape[2:]) == [1, 1] and _ints_all(a.strides, 1) and _ints_all(a.padding, 0) \
        and _ints_all(a.dilation, 1)
    # a pointwise conv for cpu.conv1x1, any other (a window, a stride) for cpu.conv2d_lanes
    if pointwise:
        from ..schedules.cpu import conv1x1 as family

        why = family.plane_why(out[2] * out[3], out[1], target)
        block = None if why else family.weight_block(out[2] * out[3], out[1], int(w_arr.shape[1]), target)
    else:
        from ..schedules.cpu import conv_lanes as family

        why = family.plane_why(out[2], out[3], out[1], int(w_arr.shape[1]), target)
        padded = 0 if _ints_all(a.padding, 0) else int(w_arr.shape[2]) * int(w_arr.shape[3])
        block = None if why else family.weight_block(out[2], out[3], out[1], target, padded)
    if why is not None:
        return None
    out_dtype = str(C.type_of(call).dtype)      # the conv's own output type
    co, ci, kh, kw = w_arr.shape
    blocked = w_arr.reshape(co // block, block, ci, kh, kw).transpose(0, 2, 3, 4, 1)
    return C.relax.op.nn.conv2d(x, C.relax.const(np.ascontiguousarray(blocked)),
                                strides=a.strides, padding=a.padding, dilation=a.dilation, groups=1,
                                data_layout="NCHW", kernel_layout=f"OIHW{block}o", out_layout="NCHW",
                                out_dtype=out_dtype)


@C.mutator
class _TransposePointwiseMutator(C.PyExprMutator):
    def __init__(self, mod, target):
        super().__init__(mod)
        self.target = target

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        new = _transposed_pointwise(call, self.target)
        return call if new is None else new


@C.module_pass(opt_level=0, name="tvmfuse.TransposePointwiseWeights")
class TransposePointwiseWeights:
    """CPU: the constant weights of a conv on a small plane (``cpu.conv1x1``, ``cpu.conv2d_lanes``) stored in
    blocks of output channels, ``OIHW<B>o`` (see ``_transposed_pointwise``); run after FoldBatchNorm, which
    folds into OIHW weights."""

    def __init__(self, target):
        self.target = target

    def transform_module(self, mod, _ctx):
        return rewrite_functions(mod, _TransposePointwiseMutator, self.target)


def _kernel_output_reshape(binding, kernels: set) -> bool:
    """``gv = call_tir(reshape PrimFunc, (lv,))`` bound to an output var, ``lv`` a kernel's output of the same
    dataflow block (not a parameter or a constant: a view of those would hand the caller their storage)."""
    v = binding.value
    if (isinstance(binding.var, C.relax.DataflowVar) or not isinstance(v, C.relax.Call)
            or not (isinstance(v.op, C.Op) and v.op.name == "relax.call_tir")):
        return False
    args = v.args[1].fields if isinstance(v.args[1], C.relax.Tuple) else ()
    return len(args) == 1 and isinstance(args[0], C.relax.Var) and any(args[0].same_as(k) for k in kernels)


@C.module_pass(opt_level=0, name="tvmfuse.OutputReshapeView")
class OutputReshapeView:
    """A reshape kernel whose result is a dataflow block's output (the function's result) and whose input is
    another kernel's output: bound to a dataflow var first (``lv = reshape(k); gv = lv``), so
    RewriteDataflowReshape, which rewrites dataflow vars only, makes it a view of ``k`` instead of a copy kernel
    (a Conv1d rewritten as a Conv2d one row high whose epilogue is the model's output: its squeeze back to
    [N, C, W]).  Run right before RewriteDataflowReshape (CanonicalizeBindings would fold the alias back).
    The memory planner keeps a view's storage as it keeps an output's: the view is returned, its storage is
    not reused.  Tests: test_passes_conv1d::test_output_conv_takes_the_conv_template."""

    def transform_module(self, mod, _ctx):
        def with_views(block):
            kernels, bindings, changed = set(), [], False
            for b in block.bindings:
                if _kernel_output_reshape(b, kernels) and self._is_reshape(mod, b.value.args[0]):
                    lv = C.relax.DataflowVar(f"{C.var_name(b.var)}_view", C.type_of(b.var))
                    bindings += [C.relax.VarBinding(lv, b.value), C.relax.VarBinding(b.var, lv)]
                    changed = True
                    continue
                bindings.append(b)
                v = getattr(b, "value", None)
                if (isinstance(v, C.relax.Call) and isinstance(v.op, C.Op) and v.op.name == "relax.call_tir"):
                    kernels.add(b.var)
            return C.relax.DataflowBlock(bindings) if changed else None

        return rewrite_dataflow_blocks(mod, C.BlockBuilder(mod), with_views)

    @staticmethod
    def _is_reshape(mod, gvar) -> bool:
        func = mod[gvar] if isinstance(gvar, C.GlobalVar) else None
        return isinstance(func, C.PrimFunc) and bool(C.has_reshape_pattern(func))
