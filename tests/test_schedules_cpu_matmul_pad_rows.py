"""cpu.matmul_epilogue over static rows that no register tile divides (``pad_m``, session 10): wav2vec2's FFN
at 79 frames (a prime row count) got a 1-row register tile (``whole_rows``: a tile dividing the rows), which
re-reads the whole B panel per row, ~30 GFLOP/s; any taller tile left a "row exists" predicate inside the k
loop of every tile (the loop-partition hint does nothing on a static kernel: TVM 0.27's NarrowDataType
leaves the hint on the old int64 loop variable).  The rows are now zero-padded to a multiple of ``mr`` (A's
rows copied per register-row tile), so the k loop has no predicate.

Numerics: the scheduled kernel vs the unscheduled one on fresh random inputs (host).  Structure, on named
targets (AVX2, AVX-512, aarch64 NEON): the default pads the rows, the A copy sits under the row-tile loop,
the lowered kernel tests ``row < M`` only outside the k loop (in the epilogue), and with ``pad_m`` off the
same kernel tests it per row inside the k loop (the check sees the predicate when it is there).  Must not
fire: rows a multiple of the tile, several batches, a symbolic row count.
"""
import numpy as np
import pytest

from tvmfuse import _compat as C
from tvmfuse.schedules import templates_for
from tvmfuse.schedules.base import find_template, schedule_with
from tvmfuse.schedules.cpu.matmul import MatmulConfig

import schedule_cases as S

NEON = '{"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"], "num-cores": 2}'
ZNVER3 = '{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver3", "num-cores": 2}'
TARGETS = (S.HASWELL, S.SKYLAKE, ZNVER3, NEON)
TARGET_IDS = ("haswell", "skx", "znver3", "neon")
FAMILY = "cpu.matmul_epilogue"


def _kernel(model, target):
    """(template, match, func) of the one matmul kernel of ``model`` for ``target``."""
    import tvmfuse

    tgt = tvmfuse.parse_target(target) if isinstance(target, str) else target
    funcs = [f for n, f in S.graph_funcs(model, tgt).items() if "matmul" in n]
    assert len(funcs) == 1, funcs
    found = find_template(funcs[0], tgt, templates_for(tgt))
    assert found is not None and found[0].family == FAMILY, found
    return found[0], found[1], funcs[0], tgt


def _tests_in_k_loop(func, target, rows: int) -> tuple[int, int]:
    """(conditions inside the k loop (the innermost serial loop around a multiply-add), row tests
    ``x < rows`` anywhere) of ``func`` lowered for ``target`` (C.lower_tir: TVM's TIR pipeline, no code
    generation; the simplifier rewrites a register row's ``i0 + r < rows`` to other constants)."""
    mod = C.lower_tir(C.IRModule({"main": func.with_attr("global_symbol", "main")}), target)
    body = [f for f in mod.functions.values() if isinstance(f, C.PrimFunc)]
    inside, total = 0, 0

    def row_test(cond) -> bool:
        found = []
        C.post_order_visit(cond, lambda n: found.append(n) if isinstance(n, C.tirx.LT)
                           and isinstance(n.b, C.tirx.IntImm) and int(n.b.value) == rows else None)
        return bool(found)

    def has_mac(stmt) -> bool:
        found = []
        C.post_order_visit(stmt, lambda n: found.append(n) if isinstance(n, C.tirx.Mul) else None)
        return bool(found)

    def serial_loops(stmt) -> bool:
        found = []
        C.post_order_visit(stmt, lambda n: found.append(n) if isinstance(n, C.tirx.For)
                           and int(n.kind) == int(C.ForKind.SERIAL) else None)
        return bool(found)

    def walk(stmt, in_k):
        nonlocal inside, total
        if isinstance(stmt, C.tirx.IfThenElse):
            total += row_test(stmt.condition)
            inside += in_k
        if isinstance(stmt, C.tirx.For) and int(stmt.kind) == int(C.ForKind.SERIAL) \
                and int(getattr(stmt.extent, "value", 0)) > 1 and has_mac(stmt.body) \
                and not serial_loops(stmt.body):
            in_k = 1          # the innermost serial loop around a multiply-add: the k loop
        for attr in ("body", "then_case", "else_case"):
            child = getattr(stmt, attr, None)
            if child is not None and hasattr(child, "same_as") and not hasattr(child, "ty"):
                walk(child, in_k)
        for child in getattr(stmt, "seq", ()) or ():
            walk(child, in_k)

    for f in body:
        walk(f.body, 0)
    return inside, total


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_prime_rows_are_padded_not_predicated_in_the_k_loop(target):
    """wav2vec2's FFN-down shape ([1, 79, 256] @ [256, 64] + residual-like bias): the default pads the
    rows, its tile is taller than 1 row, and no condition is left inside the k loop (the row tests are in
    the epilogue); pad_m off keeps one per register row there (the first row of a tile always exists)."""
    t, match, func, tgt = _kernel(S.matmul_3d(b=1, s=79, k=256, n=64, act=None), target)
    cfg = t.default_config(match, tgt)
    assert cfg["pad_m"] is True and cfg["mr"] > 1 and 79 % cfg["mr"], cfg
    sched = schedule_with(t, match, func, cfg)
    pads = [b for b in S.nodes(sched) if isinstance(b, C.SBlock) and str(b.name_hint).endswith("_pad")]
    a_name = str(func.params[0].name)          # the activation [1, 79, 256]: A
    assert [str(b.name_hint) for b in pads] == [f"{a_name}_pad"], [str(b.name_hint) for b in pads]
    inside, total = _tests_in_k_loop(sched, tgt, 79)
    assert inside == 0 and total >= 1, (inside, total)
    off = schedule_with(t, match, func, {**cfg, "pad_m": False})
    inside_off, _ = _tests_in_k_loop(off, tgt, 79)
    assert inside_off >= cfg["mr"] - 1, inside_off        # a test per register row but the first


@pytest.mark.parametrize("case", [dict(b=1, s=79, k=64, n=256, act="Relu"),      # wav2vec2's FFN-up shape
                                  dict(b=1, s=17, k=45, n=67, act="Sigmoid"),    # rows and columns padded
                                  dict(b=1, s=13, k=16, n=48, act=None)],         # no epilogue: write-back
                         ids=["79x64x256", "17x45x67", "13x16x48"])
def test_padded_rows_match_the_unscheduled_kernel(case, host, rng):
    t, match, func, tgt = _kernel(S.matmul_3d(**case), host)
    cfg = t.default_config(match, tgt)
    assert cfg["pad_m"] is True and case["s"] % cfg["mr"], cfg
    args = S.random_args(func, rng)
    want = S.run_func(func, tgt, args)[0]
    for over in ({}, {"mr": 4, "mc_tiles": 1}, {"mr": 3, "nvec": 1, "mc_tiles": 2, "pack_b": True}):
        c = {**cfg, **over}
        assert t.space(match, tgt).contains(c), c
        got = S.run_func(schedule_with(t, match, func, c), tgt, args)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(want).max())),
                                   err_msg=str(c))


@pytest.mark.parametrize("case,why", [(dict(b=1, s=48, k=64, n=64), "rows a multiple of the tile"),
                                      (dict(b=3, s=79, k=64, n=64), "several batches")],
                         ids=["whole-tiles", "batches"])
def test_rows_are_not_padded_when_not_needed(case, why):
    t, match, func, tgt = _kernel(S.matmul_3d(**case, act=None), S.SKYLAKE)
    cfg = t.default_config(match, tgt)
    assert cfg["pad_m"] is False, (why, cfg)
    if case["b"] > 1:
        assert [k.choices for k in t.space(match, tgt).knobs if k.name == "pad_m"] == [(False,)], why


def test_symbolic_rows_pad_in_the_row_tiled_bucket_only():
    """cpu.symbolic_matmul shares MatmulConfig: since padrows12 its row-tiled (open) bucket pads the symbolic
    rows to the register tile (matmul.pads_symbolic_rows, tests/test_symbolic_pad_rows.py); the few-rows
    buckets (one row per tile) hold pad_m False only."""
    import tvmfuse

    tgt = tvmfuse.parse_target(S.SKYLAKE)
    model = S.symbolic_dims(S.matmul_3d(b=2, s=37, k=64, n=64, act=None))
    funcs = [f for n, f in S.graph_funcs(model, tgt).items() if "matmul" in n]
    found = find_template(funcs[0], tgt, templates_for(tgt))
    assert found is not None and found[0].family == "cpu.symbolic_matmul", found
    t, match = found
    buckets = t.buckets(match, tgt)
    for bucket in buckets:
        bm = t.bucket_match(match, bucket)
        knobs = {k.name: k.choices for k in t.space(bm, tgt).knobs}
        assert knobs["pad_m"] == ((False, True) if bucket.max_extent is None else (False,)), bucket
        assert t.default_config(bm, tgt)["pad_m"] == (bucket.max_extent is None), bucket


def test_records_before_the_knob_ran_predicated():
    assert MatmulConfig.pre_knob_values()["pad_m"] is False
