"""tvmfuse's own legalizations (passed to TVM's LegalizeOps), where TVM's default lowers badly.

``relax.reshape`` over symbolic extents: TOPI's reshape recomputes every source index from the flat
index, so a reshape that only splits or merges static trailing dims, ``(batch, sequence, 64) ->
(batch, sequence, 4, 16)``, reads ``p[(f // sequence) % batch, f % sequence, ...]`` with ``f = (i * 16 +
j) // 64 + b * sequence + s``.  No simplifier proves that equal to ``p[b, s, ...]`` for symbolic
``batch``/``sequence``; fused into a kernel (Llama's rotary embedding: reshape, slices, concat) the
nested ``% sequence // sequence % batch`` indices, one set per concat arm, took LLVM minutes per kernel
(issue 13).  Here the dims both shapes share in front pass through unchanged and only the static
remainder is re-indexed.  Reshapes of static shapes keep TVM's legalization.
"""
from __future__ import annotations

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


CUSTOM_LEGALIZE = {"relax.reshape": legalize_reshape}
