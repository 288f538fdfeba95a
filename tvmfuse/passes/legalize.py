"""tvmfuse's own legalizations (passed to TVM's LegalizeOps), where TVM's default lowers badly.

``relax.reshape`` over symbolic extents: TOPI's reshape recomputes every source index from the flat
index, so a reshape that only splits or merges static trailing dims, ``(batch, sequence, 64) ->
(batch, sequence, 4, 16)``, reads ``p[(f // sequence) % batch, f % sequence, ...]`` with ``f = (i * 16 +
j) // 64 + b * sequence + s``.  No simplifier proves that equal to ``p[b, s, ...]`` for symbolic
``batch``/``sequence``; fused into a kernel (Llama's rotary embedding: reshape, slices, concat) the
nested ``% sequence // sequence % batch`` indices, one set per concat arm, took LLVM minutes per kernel
(issue 13).  Here the dims both shapes share in front pass through unchanged and only the static
remainder is re-indexed.  Reshapes of static shapes keep TVM's legalization.

``relax.max`` / ``relax.min`` of floats: TOPI's reductions start from the lowest / highest finite value, so a
row that is all -inf (an attention row masked everywhere) has max -3.4e38, not -inf, and ONNX's
``ReduceMax(bias) == -inf`` test of a fully masked row fails (the conformance suite's expanded Attention
cases); an empty reduction likewise gives the finite extreme, where ONNX gives -inf / +inf.  Here the
reduction starts from -inf / +inf: the same single reduction, only its identity differs.

``relax.nn.conv2d`` with blocked weights (kernel layout ``OIHW<B>o``: ``[co // B, ci, ky, kx, co % B]``, what
``passes.rewrites.TransposePointwiseWeights`` stores for the CPU families with the output channels on the vector
lanes): TVM's legalization declines a layout with a channel block; here the NCHW conv reads the weights at
``W[f // B, rc, ry, rx, f % B]`` (TOPI's padding block and names otherwise).  Every other conv keeps TVM's.
"""
from __future__ import annotations

import re

from .. import _compat as C


def _shape_of(expr) -> list | None:
    shape = getattr(getattr(expr, "ty", None), "shape", None)
    values = getattr(shape, "values", None)
    return list(values) if values is not None else None


def _static(dims) -> bool:
    return all(isinstance(d, C.tirx.IntImm) for d in dims)


def shared_prefix(src: list, dst: list) -> int:
    """How many leading dims ``src`` and ``dst`` have structurally equal (the dims a reshape keeps)."""
    n = 0
    analyzer = C.Analyzer()
    for a, b in zip(src, dst):
        if not analyzer.can_prove_equal(a, b):
            break
        n += 1
    return n


def prefix_reshape_plan(src: list, dst: list) -> int | None:
    """The number of leading dims a reshape of ``src`` into ``dst`` keeps in place when this legalization
    applies: some dim symbolic, every dim after the shared prefix static; else None (TVM's default)."""
    if _static(src) and _static(dst):
        return None
    k = shared_prefix(src, dst)
    if k == 0 or not _static(src[k:]) or not _static(dst[k:]):
        return None
    return k


def _reshape_keep_prefix(x, dst: list, k: int):
    src = list(x.shape)
    src_tail = [int(d) for d in src[k:]]
    dst_tail = [int(d) for d in dst[k:]]

    def index(*idx):
        flat = 0
        for i, d in zip(idx[k:], dst_tail):
            flat = flat * d + i
        tail = []
        for d in reversed(src_tail):
            tail.append(flat % d)
            flat = flat // d
        return x(*idx[:k], *reversed(tail))

    return C.te.compute(dst, index, name="T_reshape", tag="injective")


def legalize_reshape(bb, call):
    """LegalizeOps' function for ``relax.reshape``: the shared leading dims kept (see the module doc)."""
    x, target = call.args
    if isinstance(target, C.relax.Var):
        target = bb.lookup_binding(target)
    src = _shape_of(x)
    dst = list(target.values) if isinstance(target, C.relax.ShapeExpr) else None
    k = prefix_reshape_plan(src, dst) if src is not None and dst is not None else None
    if k is None:
        return bb.call_te(C.topi.reshape, x, target, primfunc_name_hint="reshape")
    return bb.call_te(lambda t: _reshape_keep_prefix(t, dst, k), x, primfunc_name_hint="reshape")


# The identity a float max / min reduction starts from (TOPI's: the lowest / highest finite value).
_EXTREMUM_IDENTITY = {"max": float("-inf"), "min": float("inf")}


def _extremum_compute(kind: str, x, axis, keepdims: bool):
    """``max`` / ``min`` of ``x`` over ``axis`` (all axes if None) with an infinite identity."""
    ndim = len(x.shape)
    axes = sorted({int(a) % ndim for a in axis}) if axis is not None else list(range(ndim))
    combine = C.tirx.max if kind == "max" else C.tirx.min
    reducer = C.te.comm_reducer(lambda a, b: combine(a, b),
                                lambda dtype: C.tirx.const(_EXTREMUM_IDENTITY[kind], dtype), name=kind)
    rvars = [C.te.reduce_axis((0, x.shape[a]), name=f"k{a}") for a in axes]
    out_shape = [1 if i in axes else x.shape[i] for i in range(ndim)] if keepdims else \
        [x.shape[i] for i in range(ndim) if i not in axes]

    def body(*idx):
        outer, inner, full = iter(idx), iter(rvars), []
        for i in range(ndim):
            if i in axes:
                full.append(next(inner))
                if keepdims:
                    next(outer)
            else:
                full.append(next(outer))
        return reducer(x[tuple(full)], axis=rvars)

    return C.te.compute(out_shape, body, name=f"{x.op.name}_red", tag="comm_reduce")   # TOPI's names


def _legalize_extremum(kind: str):
    def legalize(bb, call):
        x = call.args[0]
        axis, keepdims = call.attrs.axis, bool(call.attrs.keepdims)
        if not str(C.type_of(x).dtype).startswith(("float", "bfloat")):
            reduce = C.topi.max if kind == "max" else C.topi.min
            return bb.call_te(reduce, x, axis, keepdims)
        return bb.call_te(lambda t: _extremum_compute(kind, t, axis, keepdims), x, primfunc_name_hint=kind)

    legalize.__name__ = legalize.__qualname__ = f"legalize_{kind}"
    legalize.__doc__ = f"LegalizeOps' function for ``relax.{kind}``: a float reduction starts from an infinity."
    return legalize


_BLOCKED_KERNEL = re.compile(r"OIHW(\d+)o")


def kernel_block(kernel_layout: str) -> int | None:
    """B of a blocked kernel layout ``OIHW<B>o``, else None."""
    m = _BLOCKED_KERNEL.fullmatch(str(kernel_layout))
    return int(m.group(1)) if m else None


def _blocked_conv2d(data, weight, strides, padding, dilation, out_dtype: str):
    """NCHW conv2d (groups 1) on weights ``[co // B, ci, ky, kx, B]``."""
    nb, ci, kh, kw, block = [int(d) for d in weight.shape]
    n, _, h, w = data.shape
    (sh, sw), (dh, dw) = [int(s) for s in strides], [int(d) for d in dilation]
    top, left, bottom, right = [int(p) for p in padding]
    oh = (int(h) + top + bottom - (kh - 1) * dh - 1) // sh + 1
    ow = (int(w) + left + right - (kw - 1) * dw - 1) // sw + 1
    pad = C.topi.nn.pad(data, [0, 0, top, left], [0, 0, bottom, right], name="pad_temp")
    rc = C.te.reduce_axis((0, ci), name="rc")
    ry = C.te.reduce_axis((0, kh), name="ry")
    rx = C.te.reduce_axis((0, kw), name="rx")

    def body(nn, ff, yy, xx):
        x = pad[nn, rc, yy * sh + ry * dh, xx * sw + rx * dw].astype(out_dtype)
        return C.te.sum(x * weight[ff // block, rc, ry, rx, ff % block].astype(out_dtype), axis=[rc, ry, rx])

    return C.te.compute((n, nb * block, oh, ow), body, name="conv2d_nchw", tag="conv2d_nchw")


def legalize_conv2d(bb, call):
    """LegalizeOps' function for ``relax.nn.conv2d``: blocked weights (``OIHW<B>o``, NCHW, groups 1) here,
    every other conv TVM's own."""
    a = call.attrs
    block = kernel_block(a.kernel_layout)
    if block is None:
        return C.default_legalize("relax.nn.conv2d")(bb, call)
    if str(a.data_layout) != "NCHW" or str(a.out_layout) != "NCHW" or int(a.groups) != 1:
        raise ValueError(f"conv2d with kernel layout {a.kernel_layout}: only NCHW data/output and groups 1 "
                         f"are legalized (got {a.data_layout}/{a.out_layout}, groups {a.groups})")
    out_dtype = str(C.type_of(call).dtype)          # the conv's own output type (out_dtype, else the input's)
    return bb.call_te(lambda x, w: _blocked_conv2d(x, w, a.strides, a.padding, a.dilation, out_dtype),
                      call.args[0], call.args[1], primfunc_name_hint="conv2d")


CUSTOM_LEGALIZE = {"relax.nn.conv2d": legalize_conv2d, "relax.reshape": legalize_reshape,
                   "relax.max": _legalize_extremum("max"),
                   "relax.min": _legalize_extremum("min")}
# CPU only: on CUDA the infinite identity failed the row-reduction template's GPU code verification (the
# cross-thread reduction of the custom reducer; tests/test_schedules_cuda.py test_sampled_configs_are_legal
# [cuda_row_reduction]), so GPU targets keep TOPI's finite identity (a fully masked row's max is -3.4e38 there)
CPU_ONLY_LEGALIZE = frozenset({"relax.max", "relax.min"})


def custom_legalize(target) -> dict:
    """The legalizations of this module that apply to ``target`` (LegalizeOps' ``customize_legalize_map``)."""
    cpu = target is None or str(target.kind.name) == "llvm"
    return {op: fn for op, fn in CUSTOM_LEGALIZE.items() if cpu or op not in CPU_ONLY_LEGALIZE}
