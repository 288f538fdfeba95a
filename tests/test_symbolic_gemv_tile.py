"""``cpu.symbolic_matmul``'s GEMV-like nest (tvmfuse/schedules/cpu/symbolic_matmul.py, ``_gemv_vectors``):
one row per register tile, so each accumulator vector is one FMA chain.  The serial nest (rows under the
fork/join cost: gpt2_dyn at one token row) takes up to the table's ``gemv_accumulators`` vectors that divide
N; a parallel one keeps a column tile per core.  Structure on named targets (the bucket dispatch, each
bucket's register tile and the serial nest's loops), numbers vs the ONNX reference at 1, 2, 17 and 128
rows through one compiled model (benchmarks/notes/gpt2one14.md)."""
import json

import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse import target as TG
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu import matmul as MM
from tvmfuse.schedules.cpu.symbolic_matmul import SymbolicMatmulEpilogue
from tvmfuse.target import parse_target

from conftest import NAMED_TARGETS
from test_symbolic_buckets import _branches, _loops_and_predicates
from test_symbolic_matmul import _kernels

FAMILY = SymbolicMatmulEpilogue.family


def _proj(n: int, k: int = 64):
    """y = x @ W + b over x [batch, sequence, k] (a token model's projection, rows = batch x sequence)."""
    g = M._G(f"proj_{k}x{n}")
    x = g.input("x", (("batch", "sequence", k)))
    g.op("Add", g.op("MatMul", x, g.weight((k, n))), g.weight((n,), 0.1))
    g.rename_last("y", ("batch", "sequence", n))
    return g.model()


def _scheduled(model, target):
    (kname, func), = _kernels(model, target).items()
    res = schedule_prim_func(func, target, {}, kname)
    assert res is not None and res.template == FAMILY, res and res.template
    return func, res


# target, N (K = 64): the serial GEMV-like nest's vectors (the most dividing N, at most 8; the MatmulConfig
# tile of before: 4 at most), and the parallel small bucket's (a column tile per core: unchanged here)
CASES = [
    ("haswell-2", 192, 8, None),       # gpt2's qkv projection: 3 tiles of 64 columns
    ("haswell-2", 64, 8, 4),           # 64 columns: 8 vectors serial; the parallel nest keeps 2 tiles of 4
    ("haswell-2", 32, 4, 4),           # 4 vectors are all of N
    ("skx-2", 192, 6, None),           # 12 vectors of 16 lanes: 6 divides, 8 does not
    ("skx-2", 256, 8, None),
    ("neon-4", 64, 8, 4),
]


@pytest.mark.parametrize("target, n, serial_nvec, parallel_nvec", CASES)
def test_serial_gemv_nest_holds_more_accumulators(target, n, serial_nvec, parallel_nvec):
    tgt = parse_target(NAMED_TARGETS[target])
    func, res = _scheduled(_proj(n), tgt)
    buckets = res.config["buckets"]
    # the dispatch: a branch per bounded bucket, the first (fewest rows) the serial GEMV-like nest
    assert len(_branches(res.func)) == len(buckets) >= 2
    first = buckets[0]["config"]
    assert first["mr"] == 1 and first["mc_tiles"] == 1 and not first["parallel"]
    assert first["nvec"] == serial_nvec and n % (serial_nvec * first["lanes"]) == 0
    assert first["nvec"] <= int(TG.template_defaults(tgt, FAMILY)["gemv_accumulators"])
    small = [b["config"] for b in buckets[1:-1]]
    assert [c["nvec"] for c in small] == ([parallel_nvec] if parallel_nvec else [])
    for c in small:          # a parallel GEMV-like nest: wider than a GEMM row's tile only with a column tile per core
        assert c["parallel"] and (c["nvec"] <= max(MM.NVEC_CHOICES)
                                  or n // (c["nvec"] * c["lanes"]) >= TG.cpu_info(tgt).cores)
    # the serial nest's loops: no parallel loop, no predicate, one row loop over the run-time row count,
    # the register tile's vectors unrolled (nvec) around the vectorized lanes
    (_, nest), *_ = _branches(res.func)
    loops, preds = _loops_and_predicates(nest)
    kinds = [k for k, _ in loops]
    assert int(C.ForKind.PARALLEL) not in kinds and not preds
    rows = SymbolicMatmulEpilogue().dispatch_extent(SymbolicMatmulEpilogue().match(func, tgt))
    assert [e for _, e in loops if not isinstance(e, C.IntImm)] and all(
        C.Analyzer().can_prove_equal(e, rows) for _, e in loops if not isinstance(e, C.IntImm))
    unrolled = [int(e) for k, e in loops if k == int(C.ForKind.UNROLLED)]
    assert serial_nvec in unrolled, unrolled
    assert {int(e) for k, e in loops if k == int(C.ForKind.VECTORIZED)} == {first["lanes"]}


def test_gemv_accumulators_come_from_the_target_table(monkeypatch):
    tgt = parse_target(NAMED_TARGETS["haswell-2"])
    table = json.loads(json.dumps(TG.cpu_table()))
    table["template_defaults"][FAMILY]["gemv_accumulators"] = 4      # MatmulConfig's widest tile
    monkeypatch.setattr(TG, "cpu_table", lambda: table)
    _, res = _scheduled(_proj(192), tgt)
    assert res.config["buckets"][0]["config"]["nvec"] == 4


def test_space_of_the_gemv_nest_offers_the_wide_tiles():
    tgt = parse_target(NAMED_TARGETS["haswell-2"])
    func, _ = _scheduled(_proj(192), tgt)
    t = SymbolicMatmulEpilogue()
    match = t.match(func, tgt)
    small, large = t.buckets(match, tgt)[0], t.buckets(match, tgt)[-1]
    nvec = {kb.name: kb.choices for kb in t.space(t.bucket_match(match, small), tgt).knobs}["nvec"]
    assert set(nvec) == {1, 2, 3, 4, 6, 8} - {v for v in (1, 2, 3, 4, 6, 8) if 192 % (v * 8)}
    assert max({kb.name: kb.choices for kb in t.space(t.bucket_match(match, large), tgt).knobs}["nvec"]) <= 4


@pytest.mark.parametrize("n", [192, 64])
def test_one_model_is_right_at_1_2_17_and_128_rows(n, host, rng):
    model = _proj(n)
    cm = tvmfuse.compile(model, target=host)
    assert [s["template"] for s in cm.report.schedules] == [FAMILY]
    for batch, seq in ((1, 1), (2, 1), (1, 17), (4, 32)):         # rows 1, 2, 17, 128
        feeds = {"x": rng.standard_normal((batch, seq, 64)).astype(np.float32)}
        ref = M.reference_outputs(model, feeds)
        np.testing.assert_allclose(cm.run(feeds)["y"], ref["y"], rtol=1e-4, atol=1e-4,
                                   err_msg=f"batch {batch}, sequence {seq}")
