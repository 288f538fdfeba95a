"""``tvmfuse.FuseAttention``: the attention chain as one kernel, matched on Relax ops before legalization.

The chain (one row of ``rules.RULES``, ``attention``):

    P = softmax(scale * (Q @ K^T) [+ mask] [+ causal constant], axis=-1)     [where(guard, 0, P)]
    O = P @ V                                                                 [permute_dims(O)]

is replaced by one ``call_tir`` to the kernel of ``schedules.cpu.attention`` (reference stages, scheduled
by the ``cpu.attention`` template into an online softmax).  Q, K and V are read in place through the
``permute_dims`` and axis-splitting/merging ``reshape`` that produce them (head split, K^T) and through
``expand_dims`` + ``broadcast_to`` (grouped-query K/V), the output through the ``permute_dims`` and
``reshape`` that consume it alone (head merge); a constant 0/-inf lower-triangular mask becomes the
kernel's causal flag (0 / float32-lowest too, BLOOM's, when every row sees a key).  Between Q @ K^T and the
softmax and between the softmax and P @ V, reshapes that keep the query and key axes and split or merge
batch axes relabel them (BLOOM: scores ``[b * h, q, k]`` viewed as ``[b, h, q, k]`` for the mask and back;
Swin's shifted windows: ``[batch * windows, h, n, n]`` viewed as ``[batch, windows, h, n, n]`` for the shift
mask); the logical batch is the softmax's.  The kernel adds one mask: several constant additive terms
(Swin's relative-position bias and shift mask) are summed into one constant over the union of their axes
(``_sum_constants``; one float32 rounding of bias + mask where the graph rounds (s + bias) + mask); terms
not all constants are refused.  notes/attn11.md, tests/test_attention_variants.py.
Matching happens before LegalizeOps because after it softmax is four PrimFuncs and Q @ K^T a batch
matmul whose transpose is another kernel; on Relax ops each step is one call with its attributes.

A chain that reaches the softmax but fails a check is recorded as a refusal naming the reason.
"""
from __future__ import annotations

import json
import logging

import numpy as np

from .. import _compat as C
from ..explain import record_group, record_refusal
from ..schedules import templates_for
from ..schedules.cpu.attention import (AttentionSpec, Operand, axis_parts, part_extent, reference_prim_func,
                                       same_extent, static)
from . import rules as R
from .grouping import with_functions

log = logging.getLogger("tvmfuse.fusion")
RULE = "attention"


def _dims(expr) -> tuple | None:
    """The shape of a tensor: ints, TIR expressions for symbolic extents; None when unknown."""
    ty = C.type_of(expr)
    if not isinstance(ty, C.TensorType) or not isinstance(ty.shape, C.relax.ShapeExpr):
        return None
    return tuple(int(d.value) if isinstance(d, C.IntImm) else d for d in ty.shape.values)


def _plain_extents(dims: tuple, batch_extents: tuple = ()) -> bool:
    """Every extent an int, a plain symbol, or (provably) one of ``batch_extents``: what the kernel spec
    takes (a batch extent such as Swin's windows ``batch * 16`` becomes a symbol of the kernel's own,
    ``_own_batch_symbols``; a merge of a batch axis with the sequence, ``batch * sequence``, is not one)."""
    return all(isinstance(n, (int, C.tirx.Var)) or any(R.same_shape(n, b) for b in batch_extents
                                                       if not isinstance(b, int)) for n in dims)


def _own_batch_symbols(batch: tuple) -> dict:
    """A symbol of the kernel's own for each logical batch extent that is a symbolic expression, not a
    plain symbol (Swin's window batch ``batch * 16``: windows of a symbolic batch): index -> (expression,
    var).  The kernel's buffers are sized by the var, which call_tir binds from the tensors it is given
    (``batch * 16`` at run time); the spec and its JSON then hold plain symbols only.  Legal because the
    kernel only loops over a batch axis (row-major, no split of it): its extent's value is all it needs."""
    own = {}
    for k, n in enumerate(batch):
        if not isinstance(n, (int, C.tirx.Var)):
            dtype = str(getattr(n, "dtype", None) or "int64")
            own[k] = (n, C.tirx.Var(f"attn_b{k}", dtype))
    return own


def _with_own_symbols(spec: AttentionSpec, own: dict, batch: tuple = ()) -> AttentionSpec:
    """``spec`` with each extent provably equal to an expression of ``own`` replaced by its var, and each
    provably equal to a plain-symbol batch extent by that symbol (BLOOM's output
    ``[T.Div(batch * 4, 4), 4, ..]``: ``batch``)."""
    pairs = list(own.values()) + [(b, b) for b in batch if isinstance(b, C.tirx.Var)]

    def sub(n):
        if isinstance(n, (int, C.tirx.Var)):
            return n
        return next((v for e, v in pairs if R.same_shape(n, e)), n)
    return spec.map_dims(sub)


def _is1(n) -> bool:
    return isinstance(n, int) and n == 1


def _dtype(expr) -> str:
    ty = C.type_of(expr)
    return str(ty.dtype) if isinstance(ty, C.TensorType) else ""


class _Refused(Exception):
    """The chain was found but cannot become one kernel (the message says why)."""


class _Function:
    """Bindings of one Relax function: value of each var, and who reads each var."""

    def __init__(self, func):
        self.value, self.users = {}, {}
        for block in func.body.blocks:
            for b in block.bindings:
                self.value[b.var] = b.value
                for v in C.relax_free_vars(b.value):
                    self.users.setdefault(v, []).append(b.var)
        for v in C.relax_free_vars(func.body.body):
            self.users.setdefault(v, []).append(None)

    def call(self, expr, op: str):
        """The call ``op(...)`` bound to ``expr`` (or ``expr`` itself), else None."""
        if isinstance(expr, C.relax.Var):
            expr = self.value.get(expr)
        if isinstance(expr, C.relax.Call) and isinstance(expr.op, C.Op) and expr.op.name == op:
            return expr
        return None

    def single_use(self, var) -> bool:
        return isinstance(var, C.relax.Var) and len(self.users.get(var, [])) == 1


def _scalar_const(expr) -> float | None:
    if not isinstance(expr, C.Constant):
        return None
    arr = C.const_value(expr)
    return float(arr.reshape(-1)[0]) if arr.size == 1 else None


def _static_ints(expr) -> list[int] | None:
    """The ints of a static tuple argument (``(3,)``: IntImm / PrimValue fields), None when symbolic."""
    fields = getattr(expr, "fields", None)
    if fields is None:
        return None
    out = [_int_value(f) for f in fields]
    return None if any(v is None for v in out) else out


def _folded_mask(fn: _Function, expr):
    """The constant that ``where(strided_slice(c), x, y)`` is when ``c`` is a constant and x, y scalar
    constants, computed here (a static export's causal mask, sliced from a [batch, 1, S, S] table of the
    largest size: no pass folds it before this rule); else ``expr``."""
    w = fn.call(_unalias(fn, expr), "relax.where")
    if w is None:
        return expr
    cond, keep, drop = (_unalias(fn, a) for a in w.args)
    keep_v, drop_v = _scalar_const(keep), _scalar_const(drop)
    if keep_v is None or drop_v is None:
        return expr
    sl = fn.call(cond, "relax.strided_slice")
    if sl is not None:
        src = _unalias(fn, sl.args[0])
        axes, begin, end = (_static_ints(a) for a in sl.args[1:4])
        strides = _static_ints(sl.args[4]) if len(sl.args) > 4 else [1] * len(axes or ())
        if not isinstance(src, C.Constant) or None in (axes, begin, end, strides):
            return expr
        arr = C.const_value(src)
        index = [slice(None)] * arr.ndim
        for a, b, e, st in zip(axes, begin, end, strides):
            index[a] = slice(b, e, st)
        arr = arr[tuple(index)]
    elif isinstance(cond, C.Constant):
        arr = C.const_value(cond)
    else:
        return expr
    if arr.dtype != np.bool_:
        return expr
    return C.relax.const(np.where(arr, np.float32(keep_v), np.float32(drop_v)).astype("float32"))


# the float32 lowest value: what BLOOM's export (``torch.finfo(float32).min``) adds where a key is masked
_F32_LOWEST = float(np.finfo(np.float32).min)


def _masked_value(v) -> bool:
    """-inf or the float32 lowest value: a logit a mask makes weigh 0 after the softmax (exp underflows
    to 0 as long as the row has one finite logit, which a causal mask with an offset >= 0 keeps)."""
    return v is not None and (bool(np.isneginf(v)) or v == _F32_LOWEST)


def _causal_offset(expr, sq, sk) -> int | None:
    """k if ``expr`` is a constant 0/-inf mask that allows exactly j <= i + k, else None.  Leading axes may
    repeat the same [sq, sk] mask (a static build folds llama's causal mask expanded to [batch, 1, sq, sk]:
    read as an additive mask it made the static attention kernel ~2x the symbolic one at 8 x 17)."""
    if not isinstance(expr, C.Constant) or not isinstance(sq, int) or not isinstance(sk, int):
        return None
    arr = C.const_value(expr)
    if arr.ndim < 2 or tuple(arr.shape[-2:]) != (sq, sk):
        return None
    arr = arr.reshape(-1, sq, sk)
    if not np.array_equal(arr, np.broadcast_to(arr[:1], arr.shape)):
        return None
    arr = arr[0]
    allowed = arr == 0
    lowest = arr == np.float32(_F32_LOWEST)
    if not np.all(allowed | np.isneginf(arr) | lowest):
        return None
    k = int(allowed[0].sum()) - 1
    ii, jj = np.arange(sq)[:, None], np.arange(sk)[None, :]
    if lowest.any() and k < 0:
        return None                 # a row without a visible key: -FLT_MAX there is no -inf (uniform weights)
    return k if np.array_equal(allowed, jj <= ii + k) else None


# compare(row, column) -> the offset k of "j <= i + k" given (start of the row's arange - start of the
# column's); a > b is b < a (the operands swapped)
_CAUSAL_COMPARES = {"relax.less_equal": (False, 0), "relax.less": (False, -1),
                    "relax.greater_equal": (True, 0), "relax.greater": (True, -1)}
# the layout ops a computed mask passes through on its way to the scores: each keeps the last two axes
_MASK_LAYOUT_OPS = ("relax.expand_dims", "relax.broadcast_to", "relax.strided_slice", "relax.reshape")


def _arange_axis(fn: _Function, expr) -> tuple | None:
    """(axis, start) when ``expr`` is ``arange(start, n, 1)`` along the last axis ("j": a row of [.., 1, n] or
    [n]) or along the one before it ("i": a column [.., n, 1], the arange reshaped or expanded); else None."""
    expr = _unalias(fn, expr)
    dims = _dims(expr)
    while dims is not None:
        call = next((c for c in (fn.call(expr, op) for op in ("relax.reshape", "relax.expand_dims"))
                     if c is not None), None)
        if call is None:
            break
        src = _dims(call.args[0])
        kept, now = [d for d in src or () if not _is1(d)], [d for d in dims if not _is1(d)]
        if src is None or len(kept) != len(now) or not all(same_extent(a, b) for a, b in zip(kept, now)):
            return None                       # only unit axes added or removed
        expr = _unalias(fn, call.args[0])
    a = fn.call(expr, "relax.arange")
    if a is None or dims is None or len(dims) < 1 or len(_dims(expr) or ()) != 1:
        return None
    start, step = _int_value(a.args[0]), _int_value(a.args[2])
    n = _dims(expr)[0]
    if start is None or step != 1:
        return None
    if len(dims) >= 2 and _is1(dims[-1]) and not _is1(dims[-2]):
        return "i", start, n
    if all(_is1(d) for d in dims[:-1]):
        return "j", start, n
    return None


def _unalias(fn: _Function, expr):
    """The var ``expr`` is bound to when its binding is another var (``lv8 = lv7``: FuseAttention runs
    before CanonicalizeBindings)."""
    while isinstance(expr, C.relax.Var) and isinstance(fn.value.get(expr), C.relax.Var):
        expr = fn.value[expr]
    return expr


def _int_value(v) -> int | None:
    """The int of an ``arange`` argument (an IntImm, or a PrimValue holding one), None when symbolic."""
    value = v if isinstance(v, C.IntImm) else getattr(v, "value", None)
    return int(value.value) if isinstance(value, C.IntImm) else None


def _computed_causal_offset(fn: _Function, expr, sq, sk) -> int | None:
    """k if ``expr`` is the 0/-inf causal mask a symbolic export computes per call, ``where(j <= i + k, 0,
    -inf)`` with i, j from ``arange`` (through unit-axis reshapes, broadcasts and full slices); the mask the
    static build folds into a constant that ``_causal_offset`` reads.  Else None."""
    w = fn.call(_unalias(fn, expr), "relax.where")
    if w is None:
        return None
    cond, keep, drop = w.args
    cond = _unalias(fn, cond)
    drop_v = _scalar_const(_unalias(fn, drop))
    if _scalar_const(_unalias(fn, keep)) != 0.0 or not _masked_value(drop_v):
        return None
    # Step 1. Through the layout ops that keep the [sq, sk] meaning of the last two axes.
    while True:
        dims = _dims(cond)
        if dims is None or len(dims) < 2 or not (same_extent(dims[-2], sq) and same_extent(dims[-1], sk)):
            return None
        call = next((c for c in (fn.call(cond, op) for op in _MASK_LAYOUT_OPS) if c is not None), None)
        if call is None:
            break
        src = _dims(call.args[0])
        if src is None or len(src) < 2 or not (same_extent(src[-2], sq) or _is1(src[-2])) or \
                not (same_extent(src[-1], sk) or _is1(src[-1])):
            return None
        if call.op.name == "relax.reshape" and not (same_extent(src[-2], dims[-2])
                                                    and same_extent(src[-1], dims[-1])):
            return None                       # a reshape that moves the [sq, sk] axes
        cond = _unalias(fn, call.args[0])
    # Step 2. The comparison of a row of key positions j with a column of query positions i.
    for op, (swap, bias) in _CAUSAL_COMPARES.items():
        cmp = fn.call(cond, op)
        if cmp is None:
            continue
        row, col = (cmp.args[1], cmp.args[0]) if swap else cmp.args
        r, c = _arange_axis(fn, row), _arange_axis(fn, col)
        if r is None or c is None or r[0] != "j" or c[0] != "i":
            return None
        if not (same_extent(r[2], sk) and same_extent(c[2], sq)):
            return None
        # j + r_start <= i + c_start (+ bias for "<")
        k = c[1] - r[1] + bias
        if k < 0 and not np.isneginf(drop_v):
            return None             # a row without a visible key: -FLT_MAX there is no -inf
        return k
    return None


def _aligned_labels(shape: tuple, full: tuple, labels: list, what: str) -> list[str]:
    """Labels of the axes of a tensor broadcast (numpy rules, right-aligned) to ``full``."""
    off = len(full) - len(shape)
    if off < 0:
        raise _Refused(f"{what} has more axes ({len(shape)}) than it broadcasts to ({len(full)})")
    out = []
    for t, n in enumerate(shape):
        k = off + t
        if same_extent(n, full[k]):
            out.append(labels[k])
        elif _is1(n):
            out.append("1")
        else:
            raise _Refused(f"{what} axis {t} ({n}) does not broadcast to {full[k]}")
    return out


def _runs(fine: tuple, coarse: tuple) -> list[list[int]] | None:
    """Each axis of ``coarse`` as a run of consecutive axes of ``fine`` (a reshape that only splits or
    merges neighbouring axes, row-major); None for any other reshape.  Symbolic extents compare by
    provable equality (``[batch, sequence, 64]`` -> ``[batch, sequence, 4, 16]``)."""
    runs, f = [], 0
    for c in coarse:
        run, prod = [], 1
        while f < len(fine) and (not same_extent(prod, c) or (not run and _is1(c) and _is1(fine[f]))):
            run.append(f)
            prod = prod * fine[f]
            f += 1
        if not same_extent(prod, c):
            return None
        runs.append(run)
    while f < len(fine):
        if not _is1(fine[f]) or not runs:
            return None
        runs[-1].append(f)
        f += 1
    return runs


def _merge(labels: list, runs: list[list[int]], ext: dict | None = None) -> list:
    """The labels of the coarse axes: a composite (row-major tuple) where a run has several labels; the
    digits of one label that together hold all of it (``ext``: the logical extents) merge back into it
    (Swin's window batch split for the shift mask and merged again)."""
    out = []
    for run in runs:
        subs = []
        for r in run:
            subs.extend(axis_parts(labels[r]))
        subs = [x for x in subs if x != "1"]
        whole = _whole_label(subs, ext)
        if whole is not None:
            subs = [whole]
        out.append("1" if not subs else (subs[0] if len(subs) == 1 else tuple(subs)))
    return out


def _is_digit(part) -> bool:
    return isinstance(part, tuple) and len(part) == 4 and part[0] == "%"


def _whole_label(subs: list, ext: dict | None):
    """The label that the digits ``subs`` (most significant first) hold all of, else None."""
    if ext is None or len(subs) < 2 or not all(_is_digit(x) for x in subs):
        return None
    base = subs[0][1]
    if base not in ext or any(x[1] != base for x in subs) or not same_extent(subs[-1][2], 1):
        return None
    if not all(same_extent(a[2], b[2] * b[3]) for a, b in zip(subs, subs[1:])):
        return None
    return base if same_extent(subs[0][2] * subs[0][3], ext[base]) else None


def _relabel(labels: list, from_dims: tuple, to_dims: tuple, ext: dict | None) -> list | None:
    """Labels of the axes of ``reshape(x, to_dims)`` given those of x (``from_dims``), for a reshape that
    merges or splits neighbouring axes; None for any other."""
    runs = _runs(from_dims, to_dims)
    if runs is not None:
        return _merge(labels, runs, ext)
    return _split(labels, to_dims, from_dims, ext)


def _permute(labels: list, axes) -> list:
    n = len(labels)
    return list(range(n))[::-1] if axes is None else [int(a) % n for a in axes]


def _peel_layout(fn: _Function, expr, labels: list, ops: list, ext: dict | None = None) -> tuple:
    """Read through the ``permute_dims`` and axis split/merge ``reshape`` producers of an operand:
    (tensor read, labels of its axes)."""
    while True:
        p = fn.call(expr, "relax.permute_dims")
        if p is not None:
            new = [None] * len(labels)
            for i, a in enumerate(_permute(labels, p.attrs.axes)):
                new[a] = labels[i]
            expr, labels = p.args[0], new
            ops.append("permute_dims")
            continue
        r = fn.call(expr, "relax.reshape")
        if r is not None:
            src, cur = _dims(r.args[0]), _dims(expr)
            runs = _runs(cur, src) if src is not None and cur is not None else None
            if runs is not None:          # the source's axes merge the operand's (head split)
                expr, labels = r.args[0], _merge(labels, runs, ext)
                ops.append("reshape")
                continue
            split = _split(labels, src, cur, ext) if src is not None and cur is not None else None
            if split is not None and all(isinstance(x, int) for lab in split for part in axis_parts(lab)
                                         if _is_digit(part) for x in part[2:]):
                # the source's axes split the operand's (grouped heads); not into a digit of symbolic stride
                # or extent (``batch * 4`` split into [batch, 4]: the kernel indexes digits by static strides
                # only, so the operand is read before that reshape)
                expr, labels = r.args[0], split
                ops.append("reshape")
                continue
        b = fn.call(expr, "relax.broadcast_to")
        if b is not None and _dims(b.args[0]) is not None and _dims(expr) is not None:
            src, cur = _dims(b.args[0]), _dims(expr)
            off = len(cur) - len(src)
            expr = b.args[0]
            labels = ["1" if _is1(src[t]) and not _is1(cur[off + t]) else labels[off + t]
                      for t in range(len(src))]
            ops.append("broadcast_to")
            continue
        e = fn.call(expr, "relax.expand_dims")
        if e is not None:
            n = len(labels)
            drop = {int(a) % n for a in e.attrs.axis}
            expr, labels = e.args[0], [lab for t, lab in enumerate(labels) if t not in drop]
            ops.append("expand_dims")
            continue
        return expr, labels


def _split(labels: list, src: tuple, cur: tuple, ext: dict | None = None) -> list | None:
    """Labels of ``src`` when each axis of ``cur`` (labelled) is a run of ``src`` axes: a split plain
    label becomes digits (``("%", label, stride, extent)``), most significant first; a composite split
    back into its parts (``ext``: their extents) becomes those parts; else None."""
    runs = _runs(src, cur)
    if runs is None:
        return None
    out = []
    for lab, run in zip(labels, runs):
        if len(run) <= 1:
            out.extend([lab] * len(run))
            continue
        parts = axis_parts(lab)
        if ext is not None and len(parts) > 1:
            got, k = [], 0              # each axis of the run takes the next part of its extent, or is a unit
            for t in run:
                if k < len(parts) and same_extent(part_extent(parts[k], ext), src[t]):
                    got.append(parts[k])
                    k += 1
                elif _is1(src[t]):
                    got.append("1")
                else:
                    return None
            if k != len(parts):
                return None
            out.extend(got)
            continue
        if not isinstance(lab, str):
            return None           # a split of a composite or digit axis: not expressible, stop here
        for m, t in enumerate(run):
            stride = 1
            for u in run[m + 1:]:
                stride = stride * src[u]
            out.append("1" if _is1(src[t]) or lab == "1" else ("%", lab, stride, src[t]))
    return out


def _reduce_axis(call) -> int | None:
    """The one axis a keepdims reduction (max, sum) reduces, else None."""
    axes = call.attrs.axis
    if axes is None or len(axes) != 1 or not bool(call.attrs.keepdims):
        return None
    return int(axes[0])


def _softmax(fn: _Function, p) -> tuple | None:
    """(softmax input, axis, its readers inside the softmax) of ``p``: the relax softmax op, or
    exp(x [- max(x)]) / sum(exp(...)) over one axis (a decomposed export); None if neither."""
    sm = fn.call(p, "relax.nn.softmax")
    if sm is not None:
        return sm.args[0], int(sm.attrs.axis), 1
    div = fn.call(p, "relax.divide")
    if div is None:
        return None
    e, total = div.args
    ex, sm_ = fn.call(e, "relax.exp"), fn.call(total, "relax.sum")
    if ex is None or sm_ is None or not sm_.args[0].same_as(e) or _reduce_axis(sm_) is None:
        return None
    axis = _reduce_axis(sm_)
    if len(fn.users.get(e, [])) != 2 or not fn.single_use(total):
        raise _Refused("the exponentials of the decomposed softmax are read outside the attention chain")
    arg = ex.args[0]
    sub = fn.call(arg, "relax.subtract")
    if sub is not None:
        mx = fn.call(sub.args[1], "relax.max")
        if mx is not None and mx.args[0].same_as(sub.args[0]) and _reduce_axis(mx) == axis:
            if not (fn.single_use(arg) and fn.single_use(sub.args[1])):
                raise _Refused("the decomposed softmax's max is read outside the attention chain")
            return sub.args[0], axis, 2
    return arg, axis, 1


def _scores_chain(fn: _Function, expr, first_readers: int, labels: list, ext: dict, ops: list) -> tuple:
    """(Q @ K^T call, scale, additive terms as (tensor, labels of its axes), labels of Q @ K^T's axes, mask
    steps) of the softmax input, whose axes ``labels`` names; every step read only by the next (the input
    itself by ``first_readers`` ops of the softmax).  A reshape that keeps the query and key axes and splits
    or merges batch axes relabels them (BLOOM's [b * h, q, k] -> [b, h, q, k] for its mask, Swin's window
    batch split into [batch, windows] for the shift mask and merged again).  A ``where(mask, x, fill)`` (or
    ``where(mask, fill, x)``) whose fill is -inf or the float32 lowest is a select mask (DeBERTa's
    ``masked_fill``).  The mask steps, from the softmax input inward (``("add", term)``,
    ``("reshape", inner dims, outer dims)``, ``("where", cond, fill, keep where true)``), are what
    ``_computed_mask`` rebuilds as one tensor."""
    scale, terms, steps = 1.0, [], []
    readers = first_readers
    while True:
        n = len(fn.users.get(expr, [])) if isinstance(expr, C.relax.Var) else 0
        ok, readers = n == readers, 1
        if not ok:
            what = C.var_name(expr) if isinstance(expr, C.relax.Var) else \
                "a constant" if isinstance(expr, C.Constant) else type(expr).__name__
            raise _Refused(f"{what} (part of the scores) is read outside the attention chain")
        # a plain alias (what Peephole leaves of a cast to the same dtype) or such a cast: T5's
        # scores + position bias go through a float -> float cast before the softmax
        alias = fn.value.get(expr) if isinstance(expr, C.relax.Var) else None
        if isinstance(alias, C.relax.Var):
            expr = alias
            continue
        cast = fn.call(expr, "relax.astype")
        if cast is not None and _dtype(expr) and _dtype(cast.args[0]) == _dtype(expr):
            expr = cast.args[0]
            continue
        mm = fn.call(expr, "relax.matmul")
        if mm is not None:
            return mm, scale, terms, labels, steps
        wh = fn.call(expr, "relax.where")
        if wh is not None:
            cond, a, b = wh.args
            fill_a, fill_b = _scalar_const(a), _scalar_const(b)
            if _masked_value(fill_b) and _leads_to_matmul(fn, a):
                x, fill, keep = a, fill_b, True
            elif _masked_value(fill_a) and _leads_to_matmul(fn, b):
                x, fill, keep = b, fill_a, False
            else:
                raise _Refused("a where selects between the scores and something other than -inf or the float32 "
                               "lowest (the kernel takes a select only as a mask)")
            if scale != 1.0:
                raise _Refused("the mask is applied before the scale (the kernel scales the scores only)")
            dims, cdims, xdims = _dims(expr), _dims(cond), _dims(x)
            if dims is None or cdims is None or xdims is None or _dtype(cond) != "bool":
                raise _Refused("the where mask's condition is not a bool tensor of known shape")
            _aligned_labels(cdims, dims, labels, "where mask")
            steps.append(("where", cond, fill, keep))
            labels = _aligned_labels(xdims, dims, labels, "scores")
            expr = x
            ops.append("where mask")
            continue
        add = fn.call(expr, "relax.add")
        if add is not None:
            a, b = add.args
            x, t = (a, b) if _leads_to_matmul(fn, a) else (b, a)
            if scale != 1.0:
                raise _Refused("the mask is added before the scale (the kernel scales the scores only)")
            dims, tdims, xdims = _dims(expr), _dims(t), _dims(x)
            if dims is None or tdims is None or xdims is None:
                raise _Refused("unknown shape of a term of the scores")
            terms.append((t, _aligned_labels(tdims, dims, labels, "mask")))
            steps.append(("add", t))
            labels = _aligned_labels(xdims, dims, labels, "scores")
            expr = x
            continue
        rs = fn.call(expr, "relax.reshape")
        if rs is not None:
            src, cur = _dims(rs.args[0]), _dims(expr)
            if src is None or cur is None or len(src) < 2 or not (same_extent(src[-2], cur[-2])
                                                                  and same_extent(src[-1], cur[-1])):
                raise _Refused("a reshape of the scores moves the query or key axis")
            new = _relabel(labels, cur, src, ext)
            if new is None or new[-2:] != ["i", "j"]:
                raise _Refused("a reshape of the scores is no split or merge of their batch axes")
            labels, expr = new, rs.args[0]
            steps.append(("reshape", src, cur))
            ops.append("reshape")
            continue
        for op, inv in (("relax.multiply", False), ("relax.divide", True)):
            mul = fn.call(expr, op)
            if mul is None:
                continue
            a, b = mul.args
            c = _scalar_const(b)
            x = a
            if c is None and not inv:
                c, x = _scalar_const(a), b
            if c is None:
                raise _Refused("the scores are scaled by a tensor, not a constant scalar")
            scale *= (1.0 / c) if inv else c
            expr = x
            break
        else:
            raise _Refused("the softmax input is not scale/mask ops over Q @ K^T")


def _scalar_factors(fn: _Function, expr, ops: list) -> tuple:
    """(operand, product of the constant scalars it is multiplied by): ``multiply(x, c)`` and
    ``divide(x, c)`` steps read only by the next step are peeled (one "multiply" / "divide" in ``ops``
    each; DeBERTa divides K^T by its scale before Q @ K^T)."""
    factor = 1.0
    while fn.single_use(expr):
        mul = fn.call(expr, "relax.multiply")
        div = fn.call(expr, "relax.divide") if mul is None else None
        if mul is None and div is None:
            break
        if mul is not None:
            a, b = mul.args
            c, x = _scalar_const(b), a
            if c is None:
                c, x = _scalar_const(a), b
        else:
            x, c = div.args[0], _scalar_const(div.args[1])
            c = None if c is None or c == 0.0 else 1.0 / c
        if c is None or _dims(x) is None or _dims(expr) is None or not R.same_shape(_dims(x), _dims(expr)):
            break            # a tensor factor, or one that broadcasts the operand: not a scale
        factor *= c
        expr = x
        ops.append("multiply" if mul is not None else "divide")
    return expr, factor


def _leads_to_matmul(fn: _Function, expr, depth: int = 8) -> bool:
    """Whether ``expr`` is a matmul, through at most ``depth`` add/multiply/divide steps, aliases and
    reshapes (the scores viewed with a split batch: BLOOM, Swin's shifted windows)."""
    if depth == 0 or not isinstance(expr, C.relax.Var) or expr not in fn.value:
        return False
    v = fn.value[expr]
    if isinstance(v, C.relax.Var):
        return _leads_to_matmul(fn, v, depth - 1)
    if not (isinstance(v, C.relax.Call) and isinstance(v.op, C.Op)):
        return False
    if v.op.name == "relax.matmul":
        return True
    if v.op.name == "relax.reshape":
        return _leads_to_matmul(fn, v.args[0], depth - 1)
    if v.op.name == "relax.where":
        return any(_leads_to_matmul(fn, a, depth - 1) for a in v.args[1:])
    if v.op.name not in ("relax.add", "relax.multiply", "relax.divide"):
        return False
    return any(_leads_to_matmul(fn, a, depth - 1) for a in v.args)


def _identity_casts(fn: _Function, p) -> tuple:
    """(the probabilities under ``p``, the number of casts peeled): through ``astype`` to the dtype its input
    has already and plain aliases (``lv28 = lv27``: what Peephole leaves of such a cast), each read only by
    the next step (ViT's export casts the softmax float -> float twice before P @ V); ``p`` itself and 0
    where there is neither."""
    count = 0
    while isinstance(p, C.relax.Var) and fn.single_use(p) and _dtype(p):
        value = fn.value.get(p)
        if isinstance(value, C.relax.Var):
            p = value
            continue
        cast = fn.call(p, "relax.astype")
        if cast is None or _dtype(cast.args[0]) != _dtype(p):
            break
        p, count = cast.args[0], count + 1
    return p, count


def _one_mask(fn: _Function, masks: list, batch: tuple, ext: dict, ops: list) -> tuple | None:
    """(tensor, Operand) of the one additive mask the kernel reads, from the scores' additive terms
    ``masks`` [(tensor, labels)]: none; one, read through the reshapes / broadcasts that make it when its
    extents are not plain symbols (BLOOM's symbolic ALiBi ``[batch * heads, 1, sequence]`` from
    ``[heads, 1, sequence]``); several constants summed into one (Swin's relative-position bias [heads, 16,
    16] and shift mask [windows, 1, 16, 16]).  Raises _Refused for several terms not all constants."""
    if not masks:
        return None
    if len(masks) > 1:
        if not all(isinstance(_unalias(fn, t), C.Constant) for t, _ in masks):
            raise _Refused(f"{len(masks)} additive masks, not all constants (the kernel adds one mask)")
        arr, labels = _sum_constants([(C.const_value(_unalias(fn, t)), labs) for t, labs in masks], ext)
        ops.append("sum masks")
        const = C.relax.const(arr, "float32")
        return const, Operand(tuple(labels), tuple(int(n) for n in arr.shape), "float32")
    t, labels = masks[0]
    tdims = _dims(t)
    if not _plain_extents(tdims, batch):
        t, labels = _peel_layout(fn, _unalias(fn, t), list(labels), ops, ext)
        tdims = _dims(t)
    return t, Operand(tuple(labels), tdims, _dtype(t))


def _computed_mask(steps: list, dims_x: tuple, labels_x: list, like_var, ops: list) -> tuple:
    """(new bindings [(var, value)], mask var, Operand): the scores' additive terms and where masks
    (``_scores_chain``'s steps) as one tensor over the softmax input's axes, for a chain whose mask is not
    one term read in place or a sum of constants: DeBERTa's ``where(mask, fill, scores + c2p + p2c)`` is
    ``scale * Q @ K^T + (c2p + p2c + where(mask, 0, fill))``, the bias computed per call.  Equal to the
    chain's value wherever the fill is -inf, and wherever the fill is the float32 lowest as long as the
    scaled Q @ K^T and the bias stay under about 1e31 in magnitude (they then round away in the sums).  The
    select is between two constants, added to the terms: with a select between the loaded terms and the
    fill, deberta_v2_dyn's relative-position kernel took 127 us at b1 s128, with the add 56 (Zen 3; the
    cause, branches for the select, is suspected, not read in the assembly: benchmarks/notes/attn26.md).
    The new bindings are elementwise ops (add, reshape, where), which the grouping fuses with the terms' own
    kernels."""
    bb = C.BlockBuilder()
    var_type = C.relax.DataflowVar if isinstance(like_var, C.relax.DataflowVar) else C.relax.Var
    bindings = []

    def emit(value, what):
        value = bb.normalize(value)
        var = var_type(f"attention_{what}{len(bindings)}", C.type_of(value))
        bindings.append((var, value))
        return var

    mask = None                   # the mask so far, in the frame of the current step (None: zero)
    for step in reversed(steps):  # from Q @ K^T outward
        if step[0] == "add":
            mask = step[1] if mask is None else emit(C.relax.op.add(mask, step[1]), "mask")
        elif step[0] == "reshape" and mask is not None:
            _, inner, outer = step
            if not R.same_shape(tuple(_dims(mask)), tuple(inner)):
                mask = emit(C.relax.op.broadcast_to(mask, C.relax.ShapeExpr(list(inner))), "mask")
            mask = emit(C.relax.op.reshape(mask, C.relax.ShapeExpr(list(outer))), "mask")
        elif step[0] == "where":
            _, cond, fill, keep = step
            zero = C.relax.const(0.0, "float32")
            fill = C.relax.const(float(np.float32(fill)), "float32")
            sel = emit(C.relax.op.where(cond, zero, fill) if keep else C.relax.op.where(cond, fill, zero), "mask")
            mask = sel if mask is None else emit(C.relax.op.add(mask, sel), "mask")
    if mask is None:
        return [], None, None
    if _dtype(mask) != "float32":
        raise _Refused(f"the computed mask is {_dtype(mask)}, not float32")
    dims = _dims(mask)
    labels = _aligned_labels(dims, dims_x, labels_x, "mask")
    ops.append("computed mask")
    return bindings, mask, Operand(tuple(labels), dims, "float32")


def _label_order(part) -> tuple:
    """Sort key of an atomic label: batch axes b0, b1, .. then i, j; a label's digits most significant first."""
    base = part[1] if _is_digit(part) else part
    rank = int(base[1:]) if base.startswith("b") else {"i": 10_000, "j": 10_001}[base]
    return (rank, 0 if not _is_digit(part) else -int(part[2]))


def _sum_constants(terms: list, ext: dict) -> tuple:
    """The sum of constant additive terms [(array, labels of its axes)] as one array over the union of their
    axes (each composite axis split into its parts), and that array's labels.  _Refused when a label is
    symbolic in one of them or one term holds a label whole and another its digits."""
    parts_of = []
    for arr, labels in terms:
        atoms, shape = [], []
        for lab in labels:
            for part in axis_parts(lab):
                n = 1 if part == "1" else part_extent(part, ext)
                if not isinstance(n, int):
                    n = static(n)
                if n is None:
                    raise _Refused(f"a constant mask axis {part} has a symbolic extent")
                atoms.append(part)
                shape.append(n)
        parts_of.append((np.asarray(arr, dtype="float32").reshape(shape), atoms))
    union = sorted({a for _, atoms in parts_of for a in atoms if a != "1"}, key=_label_order)
    bases = {}
    for a in union:
        bases.setdefault(a[1] if _is_digit(a) else a, set()).add(_is_digit(a))
    if any(len(kinds) > 1 for kinds in bases.values()):
        raise _Refused("the constant masks index one axis whole and by its digits (not summed)")
    total = None
    for arr, atoms in parts_of:
        keep = [k for k, a in enumerate(atoms) if a != "1"]
        arr = arr.reshape([arr.shape[k] for k in keep])
        names = [atoms[k] for k in keep]
        present = [a for a in union if a in names]
        arr = np.transpose(arr, [names.index(a) for a in present])
        arr = arr.reshape([arr.shape[present.index(a)] if a in names else 1 for a in union])
        total = arr if total is None else total + arr
    if not union:
        return np.asarray(total, dtype="float32").reshape(1), ["1"]
    return np.ascontiguousarray(total, dtype="float32"), list(union)


def match(fn: _Function, var, target) -> tuple | None:
    """(the var to replace, the spec, the call's arguments, the ops it covers, new bindings to place before
    the replaced one: a computed mask's) for ``var = P @ V``; None when ``var`` is not the end of an
    attention chain.  Raises _Refused for a near miss."""
    mm = fn.call(var, "relax.matmul")
    if mm is None:
        return None
    p, v = mm.args
    p, casts = _identity_casts(fn, p)
    views = []          # reshapes of the probabilities that keep the query and key axes (BLOOM's [b * h, q, k])
    while fn.single_use(p):
        rs = fn.call(p, "relax.reshape")
        src, cur = (_dims(rs.args[0]), _dims(p)) if rs is not None else (None, None)
        if src is None or cur is None or len(src) < 2 or len(cur) < 2 or \
                not (same_extent(src[-2], cur[-2]) and same_extent(src[-1], cur[-1])):
            break
        views.append((src, cur))
        p, more = _identity_casts(fn, rs.args[0])
        casts += more
    guard, zero_empty, p_readers = None, False, 1
    wh = fn.call(p, "relax.where")
    if wh is not None and _scalar_const(wh.args[1]) == 0.0 and \
            fn.call(wh.args[2], "relax.nn.softmax") is not None:
        if not fn.single_use(p):
            raise _Refused("the guarded probabilities are read outside the attention chain")
        nan = fn.call(wh.args[0], "relax.isnan")
        if nan is not None and nan.args[0].same_as(wh.args[2]):
            # where(isnan(P), 0, P) (PyTorch SDPA exports): a row with no finite logit gives 0
            if not fn.single_use(wh.args[0]):
                raise _Refused("the NaN test of the probabilities is read outside the attention chain")
            zero_empty, p, p_readers = True, wh.args[2], 2
        else:
            guard, p = wh.args[0], wh.args[2]
    found = _softmax(fn, p)
    if found is None:
        return None
    x, axis, x_readers = found
    dims_x = _dims(x)
    if dims_x is None:
        raise _Refused("unknown shape of the scores")
    if axis % len(dims_x) != len(dims_x) - 1:
        raise _Refused(f"softmax over axis {axis}, not the last (key) axis")
    if len(fn.users.get(p, [])) != p_readers:
        raise _Refused("the probabilities are read outside the attention chain")
    ops = ["matmul", "softmax", "matmul"] + (["isnan", "where"] if zero_empty else []) + ["astype"] * casts
    ops += ["reshape"] * len(views)
    # the logical batch: the softmax's (its scores' batch axes b0, b1, ..)
    batch = tuple(dims_x[:-2])
    blabels = [f"b{k}" for k in range(len(batch))]
    ext = {**{lab: n for lab, n in zip(blabels, batch)}, "i": dims_x[-2], "j": dims_x[-1]}
    p_labels = blabels + ["i", "j"]
    for src, cur in reversed(views):
        p_labels = _relabel(p_labels, src, cur, ext)
        if p_labels is None or p_labels[-2:] != ["i", "j"]:
            raise _Refused("a reshape of the probabilities is no split or merge of their batch axes")
    qk, scale, terms, qk_labels, steps = _scores_chain(fn, x, x_readers, blabels + ["i", "j"], ext, ops)
    if qk_labels[-2:] != ["i", "j"]:
        raise _Refused("the scores broadcast Q @ K^T over the query or key axis")
    peeled = []
    for t in qk.args:      # (Q * c) @ (K^T * c'): the scale split over both operands, as SDPA exports it
        t, c = _scalar_factors(fn, t, ops)
        scale *= c
        peeled.append(t)
    q, kt = peeled
    conds = [st[1] for st in steps if st[0] == "where"]
    reason = R.check_attention_operands([q, kt, v, var] + [t for t, _ in terms] + conds +
                                        ([guard] if guard is not None else []), target)
    if reason is not None:
        raise _Refused(reason)
    if min(len(_dims(t)) for t in (q, kt, v)) < 2:
        raise _Refused("a matmul operand is a vector (the kernel takes [..., rows, features] operands)")
    sq, d = _dims(q)[-2:]
    sk = _dims(kt)[-1]
    dv = _dims(v)[-1]
    out_dims = _dims(var)
    p_dims = views[0][1] if views else dims_x
    if not R.same_shape(tuple(p_dims[:-2]), tuple(out_dims[:-2])):
        raise _Refused("the scores and the output have different batch shapes")

    def operand(expr, tail, what, bdims, blabs):
        dims = _dims(expr)
        labels = _aligned_labels(dims[:-2], bdims, blabs, what) + list(tail)
        src, labels = _peel_layout(fn, expr, labels, ops, ext)
        return src, Operand(tuple(labels), _dims(src), _dtype(src))

    args, specs = [], {}
    qk_batch = (_dims(qk)[:-2], qk_labels[:-2])
    for name, expr, tail, (bdims, blabs) in (("q", q, "id", qk_batch), ("k", kt, "dj", qk_batch),
                                             ("v", v, "je", (out_dims[:-2], p_labels[:-2]))):
        src, op = operand(expr, tail, name, bdims, blabs)
        args.append(src)
        specs[name] = op
    causal, masks, term_ops = None, [], []
    for t, tlabels in terms:
        off = _causal_offset(t, sq, sk)
        if off is None:
            off = _causal_offset(_folded_mask(fn, t), sq, sk)
        if off is None:
            off = _computed_causal_offset(fn, t, sq, sk)
        if off is not None and causal is None:
            causal = off
            term_ops.append("causal mask")
            continue
        masks.append((t, tlabels))
        term_ops.append("add mask")
    # a where mask, or several masks left after the causal one that are not all constants: one mask tensor
    # computed from the whole chain (_computed_mask).  Otherwise the terms as read in place (BLOOM's ALiBi +
    # causal chain keeps this path: its computed mask's broadcast_to / reshape kernel failed its template).
    bindings = []
    if conds or (len(masks) > 1 and not all(isinstance(_unalias(fn, t), C.Constant) for t, _ in masks)):
        causal = None                       # the triangle is summed into the computed mask too
        bindings, mvar, mop = _computed_mask(steps, dims_x, blabels + ["i", "j"], var, ops)
        mask = (mvar, mop) if mvar is not None else None
    else:
        ops += term_ops
        mask = _one_mask(fn, masks, batch, ext, ops)
    if mask is not None:
        args.append(mask[0])
    glabels = None
    if guard is not None:
        gdims = _dims(guard)
        if _dtype(guard) != "bool" or not gdims or not _is1(gdims[-1]):
            raise _Refused("the row guard is not a bool tensor with one value per query row")
        glabels = _aligned_labels(gdims, (*batch, sq, 1), blabels + ["i", "1"], "row guard")
        args.append(guard)
        ops.append("row guard")
    # the output, through the permute_dims / reshapes that consume it alone (head merge)
    out_var, out_labels = var, list(p_labels[:-2]) + ["i", "e"]
    while fn.single_use(out_var):
        user = fn.users[out_var][0]
        pd = fn.call(user, "relax.permute_dims") if user is not None else None
        if pd is not None:
            out_labels = [out_labels[a] for a in _permute(out_labels, pd.attrs.axes)]
            out_var = user
            ops.append("permute_dims")
            continue
        rs = fn.call(user, "relax.reshape") if user is not None else None
        new = _relabel(out_labels, _dims(out_var), _dims(user), ext) \
            if rs is not None and _dims(user) is not None else None
        if new is None or any(_is_digit(x) for lab in new for x in axis_parts(lab)) or \
                not _plain_extents(_dims(user), tuple(batch)):
            break      # e.g. GPT-2's [batch * sequence, 768] before its Gemm: the kernel's output stops short
        out_labels, out_var = new, user
        ops.append("reshape")
    spec = AttentionSpec(batch=tuple(batch), sq=sq, sk=sk, d=d, dv=dv, q=specs["q"], k=specs["k"],
                         v=specs["v"], out=Operand(tuple(out_labels), _dims(out_var), "float32"),
                         mask=mask[1] if mask is not None else None,
                         guard=Operand(tuple(glabels), gdims, "bool") if guard is not None else None,
                         scale=float(np.float32(scale)), causal_offset=causal, zero_empty_rows=zero_empty)
    spec = _with_own_symbols(spec, _own_batch_symbols(tuple(batch)), tuple(batch))
    try:
        spec.validate()
    except ValueError as e:
        raise _Refused(str(e)) from None
    return out_var, spec, args, ops, bindings


def _scheduling_family(prim, target) -> str | None:
    """The template family of the target that takes the attention kernel (first match), None if none does."""
    for t in templates_for(target):
        if t.match(prim, target) is not None:
            return t.family
    return None


@C.module_pass(opt_level=0, name="tvmfuse.FuseAttention")
class FuseAttention:
    """softmax(scale * Q @ K^T + mask) @ V chains -> one call_tir to the attention kernel."""

    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod, _ctx):
        target = self.target or C.current_target()
        reason = R.check_attention_target(target)
        mbb = C.BlockBuilder(mod)
        updates = {}
        for gv, func in mod.functions.items():
            if not isinstance(func, C.relax.Function) or (func.attrs and "Primitive" in func.attrs):
                continue
            if not isinstance(func.body, C.relax.SeqExpr):
                continue
            fn = _Function(func)
            replace, before = {}, {}
            for block in func.body.blocks:
                for b in block.bindings:
                    try:
                        found = match(fn, b.var, target)
                    except _Refused as e:
                        record_refusal(f"softmax->matmul({C.var_name(b.var)})", "attention", str(e), RULE)
                        continue
                    if found is None:
                        continue
                    if reason is not None:
                        record_refusal(f"matmul({C.var_name(b.var)})", "attention", reason, RULE)
                        continue
                    out_var, spec, args, ops, bindings = found
                    # the kernel gets vars of its own for the symbolic extents (call_tir binds them)
                    own = {name: C.tirx.Var(name, var.ty) for name, var in spec.symbols().items()}
                    prim = reference_prim_func(spec.bind(own) if own else spec)
                    prim = prim.with_attr("tvmfuse.ops", json.dumps(ops))
                    family = _scheduling_family(prim, target)
                    if family is None:
                        record_refusal(f"matmul({C.var_name(b.var)})", "attention",
                                       f"no {target.kind.name} template schedules the attention kernel"
                                       + (f" over symbolic extents ({', '.join(own)})" if own else ""), RULE)
                        continue
                    prim = prim.with_attr("tvmfuse.template", family)
                    kernel = mbb.add_func(prim, "fused_attention")
                    record_group(str(kernel.name_hint), ops, RULE, outputs=1, template=family)
                    # the result in the function's own extents (a window batch ``batch * 16``, not the
                    # kernel's symbol for it)
                    call = C.relax.call_tir(kernel, C.relax.Tuple(args),
                                            C.TensorType(_dims(out_var), "float32"))
                    replace[out_var] = call
                    before[out_var] = bindings
                    log.debug("attention: %s -> %s (%s)", C.var_name(b.var), kernel.name_hint, " + ".join(ops))
            if not replace:
                continue
            blocks = []
            for block in func.body.blocks:
                binds = []
                for b in block.bindings:
                    if b.var in replace:     # the computed mask first (its inputs are bound before the chain)
                        binds += [C.relax.VarBinding(v, value) for v, value in before[b.var]]
                        binds.append(C.relax.VarBinding(b.var, mbb.normalize(replace[b.var])))
                    else:
                        binds.append(b)
                blocks.append(C.relax.DataflowBlock(binds) if isinstance(block, C.relax.DataflowBlock)
                              else C.relax.BindingBlock(binds))
            updates[gv] = C.relax.Function(func.params, C.relax.SeqExpr(blocks, func.body.body), func.ret_ty,
                                           func.is_pure, func.attrs, func.span)
        return with_functions(mod, mbb, updates)
