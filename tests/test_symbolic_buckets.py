"""Size-bucket dispatch (tvmfuse/schedules/buckets.py, ``cpu.symbolic_matmul``'s buckets): one compiled
kernel holds a GEMV-like nest for few rows and a row-tiled nest for many, picked at run time by the row
count; each bucket has its own tuning record (``records.bucket_key``).  Numbers vs the ONNX reference at
row counts on both sides of the bucket bound, through one compiled model; structure on named targets."""
import json

import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse import records as R
from tvmfuse import target as TG
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.buckets import Bucket, join_buckets
from tvmfuse.schedules.cpu.symbolic_matmul import SymbolicMatmulEpilogue
from tvmfuse.target import parse_target

from conftest import NAMED_TARGETS
from test_symbolic_matmul import _kernels, _mlp, _proj3d

FAMILY = SymbolicMatmulEpilogue.family


def _gelu_proj(batch="batch", seq="sequence"):
    """gelu(x @ W + b) over x [batch, seq, 64] (erf GELU, as BERT exports it)."""
    g = M._G("gelu_proj_sym")
    x = g.input("x", (batch, seq, 64))
    M._gelu_erf(g, g.op("Add", g.op("MatMul", x, g.weight((64, 64))), g.weight((64,), 0.1)))
    g.rename_last("y", (batch, seq, 64))
    return g.model()


def _small_rows(target) -> int:
    return int(TG.template_defaults(target, FAMILY)["small_rows"])


def _serial_rows(func, target) -> int:
    """The serial bucket's bound: the most rows whose multiply-adds (rows x N x K) stay under the target's
    fork/join cost (the static default's rule, ``fork_join_work_per_core`` x cores in the target table)."""
    info = SymbolicMatmulEpilogue().match(func, target).info
    limit = int(TG.template_defaults(target, "cpu.parallel")["fork_join_work_per_core"]) * \
        TG.cpu_info(target).cores
    return (limit - 1) // (info["N"] * info["K"])


def _bucket_names(func, target) -> list[str]:
    small, serial = _small_rows(target), _serial_rows(func, target)
    return ([f"rows<={serial}"] if 0 < serial < small else []) + [f"rows<={small}", f"rows>{small}"]


def _branches(func):
    """[(condition, nest), ..., (None, last nest)] of a bucketed kernel: its root block's body is a chain
    of branches, one per bounded bucket."""
    root = func.body
    assert isinstance(root, C.SBlockRealize), type(root)
    out, node = [], root.block.body
    assert isinstance(node, C.tirx.IfThenElse), type(node)
    while isinstance(node, C.tirx.IfThenElse):
        out.append((node.condition, node.then_case))
        node = node.else_case
    return out + [(None, node)]


def _nests(func):
    """(condition, small nest, large nest) of a bucketed kernel: the GEMV-like bucket's branch and the open
    bucket's nest (after the serial bucket's branch, where there is one)."""
    (cond, small), (_, large) = _branches(func)[-2:]
    return cond, small, large


def _loops_and_predicates(stmt):
    loops, preds = [], []

    def visit(node):
        if isinstance(node, C.tirx.For):
            loops.append((int(node.kind), node.extent))
        elif isinstance(node, C.SBlockRealize) and not (isinstance(node.predicate, C.IntImm)
                                                         and int(node.predicate) == 1):
            preds.append(node.predicate)

    C.post_order_visit(stmt, visit)
    return loops[::-1], preds


@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
@pytest.mark.parametrize("name, build", [("mlp", _mlp), ("proj3d", _proj3d), ("gelu", _gelu_proj)])
def test_one_kernel_holds_a_gemv_nest_and_a_row_tiled_nest(name, build, target):
    tgt = parse_target(NAMED_TARGETS[target])
    (kname, func), = _kernels(build(), tgt).items()
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is not None and res.template == FAMILY, res and res.template
    small, serial = _small_rows(tgt), _serial_rows(func, tgt)
    assert 0 < serial < small      # these kernels' rows x N x K: a few rows are under the fork/join cost
    buckets = res.config["buckets"]
    assert [b["bucket"] for b in buckets] == _bucket_names(func, tgt)
    assert [b["source"] for b in buckets] == ["default"] * 3
    serial_cfg, small_cfg, large_cfg = (b["config"] for b in buckets)
    assert small_cfg["mr"] == 1 and small_cfg["mc_tiles"] == 1 and small_cfg["order"] == "ji"
    assert large_cfg["mr"] > 1
    # the serial bucket: the GEMV-like nest without its parallel loop (the knob the static build has there),
    # its register tile as wide as one row's FMA chains want (tests/test_symbolic_gemv_tile.py)
    wide = {k: serial_cfg[k] for k in ("nvec", "nc_tiles")}
    assert serial_cfg == {**small_cfg, "parallel": False, **wide} and small_cfg["parallel"] and large_cfg["parallel"]
    assert serial_cfg["nvec"] >= small_cfg["nvec"]

    t = SymbolicMatmulEpilogue()
    rows = t.dispatch_extent(t.match(func, tgt))
    (serial_cond, serial_nest), _, _ = _branches(res.func)
    cond, small_nest, large_nest = _nests(res.func)
    ana = C.Analyzer()
    assert isinstance(cond, C.tirx.LE) and ana.can_prove_equal(cond.a, rows) and int(cond.b) == small
    assert ana.can_prove_equal(serial_cond.a, rows) and int(serial_cond.b) == serial
    lanes = 16 if target.startswith("skx") else 8
    loops, preds = _loops_and_predicates(serial_nest)
    assert int(C.ForKind.PARALLEL) not in [k for k, _ in loops] and not preds
    serial_kind = {int(C.ForKind.PARALLEL): int(C.ForKind.SERIAL)}

    def shape(nest, extents=True):
        return [(serial_kind.get(k, k), str(e) if extents or not isinstance(e, C.IntImm) else "")
                for k, e in _loops_and_predicates(nest)[0]]

    # else the same loops as the GEMV-like nest (the same extents where the register tile is as wide)
    assert shape(serial_nest, wide == {k: small_cfg[k] for k in wide}) == \
        shape(small_nest, wide == {k: small_cfg[k] for k in wide})
    for nest in (small_nest, large_nest):
        loops, _ = _loops_and_predicates(nest)
        assert int(C.ForKind.PARALLEL) in [k for k, _ in loops]
        assert [int(e) for k, e in loops if k == int(C.ForKind.VECTORIZED)] and \
            all(int(e) == lanes for k, e in loops if k == int(C.ForKind.VECTORIZED))
    # small: not row-tiled: rows looped one at a time (one loop over exactly the row count), no predicate,
    # the parallel loop over columns (static)
    loops, preds = _loops_and_predicates(small_nest)
    sym = [e for _, e in loops if not isinstance(e, C.IntImm)]
    assert len(sym) == 1 and ana.can_prove_equal(sym[0], rows), sym
    assert not preds, preds
    assert all(isinstance(e, C.IntImm) for k, e in loops if k == int(C.ForKind.PARALLEL))
    # large: rows in register tiles of mr (a loop over ceil(rows / tile), the last tile predicated)
    loops, preds = _loops_and_predicates(large_nest)
    kind, extent = loops[0]
    assert kind == int(C.ForKind.PARALLEL) and not isinstance(extent, C.IntImm)
    assert not ana.can_prove_equal(extent, rows)
    assert large_cfg["mr"] in [int(e) for k, e in loops if k == int(C.ForKind.UNROLLED)]
    assert preds


def test_bucket_bound_and_small_order_come_from_the_target_table(monkeypatch):
    tgt = parse_target(NAMED_TARGETS["skx-2"])
    (kname, func), = _kernels(_mlp(), tgt).items()
    table = json.loads(json.dumps(TG.cpu_table()))
    table["template_defaults"][FAMILY]["small_rows"] = 4
    table["template_defaults"][FAMILY]["small_order"] = "ij"
    monkeypatch.setattr(TG, "cpu_table", lambda: table)
    res = schedule_prim_func(func, tgt, {}, kname)
    # a serial bound (15 rows of the 64 x 32 weight under the fork/join cost) past small_rows: no serial
    # bucket of its own, the GEMV-like nest is the serial one
    assert _serial_rows(func, tgt) >= 4
    assert [b["bucket"] for b in res.config["buckets"]] == ["rows<=4", "rows>4"]
    assert res.config["buckets"][0]["config"]["order"] == "ij"
    assert [b["config"]["parallel"] for b in res.config["buckets"]] == [False, True]
    cond, _, _ = _nests(res.func)
    assert int(cond.b) == 4


@pytest.mark.parametrize("name, build, shapes", [
    ("mlp", _mlp, [(1,), (3,), (16,), (17,), (128,)]),
    ("gelu", _gelu_proj, [(1, 1), (1, 3), (2, 8), (1, 17), (4, 32)]),     # rows 1, 3, 16, 17, 128
])
def test_one_compiled_model_is_right_on_both_sides_of_the_bucket_bound(name, build, shapes, host, rng):
    model = build()
    cm = tvmfuse.compile(model, target=host)
    scheds = cm.report.schedules
    assert [s["template"] for s in scheds] == [FAMILY]
    (kname, func), = _kernels(model, host).items()
    names = _bucket_names(func, host)
    assert [b["bucket"] for b in scheds[0]["knobs"]["buckets"]] == names
    assert "[" + ", ".join(f"{n}: default" for n in names) + "]" in cm.report.table()
    bounds = [int(n.split("<=")[1]) for n in names[:-1]]
    rows_seen = set()
    for lead in shapes:
        shape = (*lead, 64)
        rows_seen.add(next((b for b in bounds if int(np.prod(lead)) <= b), None))
        feeds = {"x": rng.standard_normal(shape).astype(np.float32)}
        ref = M.reference_outputs(model, feeds)
        np.testing.assert_allclose(cm.run(feeds)["y"], ref["y"], rtol=1e-4, atol=1e-4, err_msg=f"{shape}")
    assert rows_seen == {*bounds, None}      # every nest ran


def test_records_are_keyed_by_bucket_and_applied_per_bucket(tmp_path):
    tgt = parse_target(NAMED_TARGETS["skx-2"])
    (kname, func), = _kernels(_mlp(), tgt).items()
    wk = R.workload_key(func)
    small = _small_rows(tgt)
    assert R.bucket_key(wk, f"rows<={small}") == f"{wk}@rows<={small}" and R.bucket_key(wk) == wk
    default = schedule_prim_func(func, tgt, {}, kname).config["buckets"]
    i = [b["bucket"] for b in default].index(f"rows<={small}")       # after the serial bucket, if any
    small_cfg = {**default[i]["config"], "k_unroll": 2 if default[i]["config"]["k_unroll"] != 2 else 1}
    base = {"type": "measure", "target_key": R.target_key(tgt), "workload_key": wk, "template": FAMILY,
            "tvm": C.TVM_VERSION}
    log = tmp_path / "log.jsonl"
    lines = [
        {**base, "bucket": f"rows<={small}", "config": small_cfg, "costs": [1e-6]},
        {**base, "bucket": f"rows<={small}", "config": default[i]["config"], "costs": [2e-6]},
        {**base, "config": default[-1]["config"], "costs": [9e-7]},      # no bucket: the whole kernel's key
        {**base, "bucket": 3, "config": small_cfg, "costs": [1e-7]},      # corrupt: skipped
    ]
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    tl = R.load(log, tgt)
    assert len(tl.skipped) == 1 and "bucket" in tl.skipped[0]
    assert set(tl.best()) == {wk, f"{wk}@rows<={small}"}
    assert len(tl.measured(wk, f"rows<={small}")) == 2 and len(tl.measured(wk)) == 1
    best = R.best_configs(str(log), tgt)
    assert best[f"{wk}@rows<={small}"]["config"] == small_cfg
    res = schedule_prim_func(func, tgt, best, kname)
    got = res.config["buckets"]
    # the small bucket's record applies to the small nest only; the others have no record of their keys
    assert (got[i]["source"], got[i]["config"]) == ("tuned", small_cfg)
    assert [(g["source"], g["config"]) for j, g in enumerate(got) if j != i] == \
        [("default", d["config"]) for j, d in enumerate(default) if j != i]
    assert res.source == "tuned"


def test_join_buckets_refuses_bad_buckets():
    tgt = parse_target(NAMED_TARGETS["skx-2"])
    (_, func), = _kernels(_mlp(), tgt).items()
    rows = func.params[0].shape[0]
    with pytest.raises(ValueError, match="one last open bucket"):
        join_buckets([func, func], [Bucket("a", 4), Bucket("b", 8)], rows)
    with pytest.raises(ValueError, match="names must differ"):
        join_buckets([func, func], [Bucket("a", 4), Bucket("a", None)], rows)
    with pytest.raises(ValueError, match="2 size buckets"):
        join_buckets([func], [Bucket("a", 4), Bucket("b", None)], rows)


def _wide_mlp(rows="batch", k=64, n=256):
    """gelu(x @ W + b) over x [rows, k], W k x n (64 x 256, 64 KiB: convnext_dyn's MLP up-projection;
    128 x 512: its third stage's, over the fork/join cost at one row on two cores)."""
    g = M._G("wide_mlp_sym")
    x = g.input("x", (rows, k))
    M._gelu_erf(g, g.op("Add", g.op("MatMul", x, g.weight((k, n))), g.weight((n,), 0.1)))
    g.rename_last("y", (rows, n))
    return g.model()


@pytest.mark.parametrize("k, n", [(64, 256), (128, 512)])
@pytest.mark.parametrize("target", ["haswell-2", "skx-2", "znver5-2", "neoverse-n1-4"])
def test_a_weight_over_the_l1_share_leaves_the_gemv_nest_at_the_serial_bound(target, k, n):
    """The GEMV-like nest reads the whole weight per row: with a weight over gemv_weight_l1_share of L1 it
    keeps only the rows under the fork/join cost (serial), the row-tiled nest takes every other count
    (convnext_dyn b1's 16- and 4-row MLPs ran 2-3x the static kernels in the GEMV-like nest).  A weight
    within the share keeps the three buckets (the other tests here)."""
    spec = {"znver5-2": '{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver5", "num-cores": 2}',
            "neoverse-n1-4": '{"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "neoverse-n1", '
                             '"num-cores": 4}'}
    tgt = parse_target(spec[target] if target in spec else NAMED_TARGETS[target])
    (kname, func), = _kernels(_wide_mlp(k=k, n=n), tgt).items()
    t = SymbolicMatmulEpilogue()
    match = t.match(func, tgt)
    share = float(TG.template_defaults(tgt, FAMILY)["gemv_weight_l1_share"])
    assert k * n * 4 > share * TG.cpu_info(tgt).l1d_bytes
    bound = max(1, min(t.serial_rows(match, tgt), _small_rows(tgt)))
    assert bound < _small_rows(tgt)
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is not None and res.template == FAMILY
    buckets = res.config["buckets"]
    assert [b["bucket"] for b in buckets] == [f"rows<={bound}", f"rows>{bound}"]
    gemv, tiled = (b["config"] for b in buckets)
    # serial where its rows are under the fork/join cost (one row of a weight over it: parallel columns)
    assert gemv["mr"] == 1 and gemv["parallel"] == (t.serial_rows(match, tgt) < bound)
    assert tiled["mr"] > 1 and tiled["parallel"]
    # the kernel: one branch on the row count, the row-tiled nest (predicated last row tile) in the else
    (cond, _), (_, large) = _branches(res.func)
    assert int(cond.b) == bound
    assert _loops_and_predicates(large)[1]
    # the narrow weights of this file's other tests keep the GEMV-like bucket up to small_rows
    (kname, func), = _kernels(_mlp(), tgt).items()
    assert f"rows<={_small_rows(tgt)}" in [b.name for b in t.buckets(t.match(func, tgt), tgt)]


@pytest.mark.parametrize("k, n", [(64, 256), (128, 512)])
def test_wide_weight_numbers_on_both_sides_of_the_serial_bound(host, rng, k, n):
    model = _wide_mlp(k=k, n=n)
    cm = tvmfuse.compile(model, target=host)
    assert [s["template"] for s in cm.report.schedules] == [FAMILY]
    assert cm.report.schedules[0]["source"] == "default"      # no fallback: every bucket scheduled
    for rows in (1, 2, 3, 4, 16, 17):
        feeds = {"x": rng.standard_normal((rows, k)).astype(np.float32)}
        ref = M.reference_outputs(model, feeds)
        np.testing.assert_allclose(cm.run(feeds)["y"], ref["y"], rtol=1e-4, atol=1e-4, err_msg=f"{rows} rows")
