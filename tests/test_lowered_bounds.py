"""tests/lowered_bounds.py, the out-of-bounds check of lowered kernels at concrete sizes (the regression
test of issue 13's heap corruption relies on it): it must report a loop one past the end, a vectorized
tail past the end and an ``if_then_else`` whose guarded load would be past the end only when taken, and
nothing for the kernels that stay in bounds."""
from tvmfuse import _compat as C

import lowered_bounds
from conftest import named_target

TS = C.script_tir


def _copy(extra: int, guard: bool):
    """O[i] = A[i] * 2 for i < n + extra (with ``guard``: A read only where i < n, else 0)."""

    @TS.prim_func(private=True, s_tir=True)
    def func(a: TS.handle, o: TS.handle):
        n = TS.int64()
        A = TS.match_buffer(a, (n,), "float32")
        O = TS.match_buffer(o, (n + extra,), "float32")
        for i in range(n + extra):
            with TS.sblock("copy"):
                vi = TS.axis.spatial(n + extra, i)
                O[vi] = TS.if_then_else(vi < n, A[vi] * 2.0, 0.0) if guard else A[vi] * 2.0

    return func


def _vector_tail():
    """O[i] = A[i] over n rounded up to 8 lanes (a wrong predicate): the last vector reads and writes past n."""

    @TS.prim_func(private=True, s_tir=True)
    def func(a: TS.handle, o: TS.handle):
        n = TS.int64()
        A = TS.match_buffer(a, (n,), "float32")
        O = TS.match_buffer(o, (n,), "float32")
        for i0 in range((n + 7) // 8):
            for i1 in TS.vectorized(8):
                with TS.sblock("copy"):
                    vi = TS.axis.spatial(n, i0 * 8 + i1)
                    TS.where(i0 * 8 + i1 < n + 7)
                    O[vi] = A[vi]

    return func


def test_reports_accesses_past_the_end():
    target = named_target("skx-2")
    sizes = [{"n": 5}, {"n": 16}]
    # O has n + 1 elements: only the load of A[n] is out
    one_past = lowered_bounds.out_of_bounds(_copy(1, False), target, sizes)
    assert one_past == ["load A[5..5] outside [0, 5) at {'n': 5}", "load A[16..16] outside [0, 16) at {'n': 16}"]
    # 13 elements in two vectors of 8: the second loads and stores 3 past the end (TVM scalarizes the
    # predicated vector: one report per element)
    tail = lowered_bounds.out_of_bounds(_vector_tail(), target, [{"n": 13}], max_reports=10)
    assert sorted(tail) == sorted(f"{what} {buf}[{i}..{i}] outside [0, 13) at {{'n': 13}}"
                                  for what, buf in (("load", "A"), ("store", "O")) for i in (13, 14, 15)), tail


def test_in_bounds_kernels_report_nothing():
    target = named_target("skx-2")
    sizes = [{"n": n} for n in (1, 5, 16)]
    assert lowered_bounds.out_of_bounds(_copy(0, False), target, sizes) == []
    # O has n + 1 elements, A is read only where the guard holds
    assert lowered_bounds.out_of_bounds(_copy(1, True), target, sizes) == []
