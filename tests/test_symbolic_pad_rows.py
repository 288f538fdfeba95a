"""Symbolic rows padded to the register tile (``cpu.symbolic_matmul``'s ``pad_m``, branch padrows12) and the
sibling matmuls' register tile capped where their last tile stays predicated (``predicated_mr_max``).

Without the padding the row-tiled nest's last register tile keeps a "this row exists" predicate inside its k
loop (partial sums in memory); with it A's rows are copied per register tile (zeros past the end: pad_einsum
over ceil(rows / mr) x mr rows, after the batch rows are flattened) and only the epilogue's stores are
predicated.  Structural tests lower the open bucket's nest for named targets; the numbers are checked against
numpy at every row count from 1 to 26 and at 3 x 17 (batch x sequence), with the padding on and off."""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.schedules.cpu import matmul as MM
from tvmfuse.schedules.cpu.symbolic_matmul import SymbolicMatmulEpilogue
from tvmfuse.schedules.cpu.symbolic_siblings import SymbolicSiblings
from tvmfuse.target import parse_target

from conftest import NAMED_TARGETS
from lowered_bounds import lowered, out_of_bounds
from test_symbolic_matmul_rows import _guarded_k_loops, _kernels, _proj, _qkv


def _open(template, func, target, **override):
    match = template.match(func, target)
    assert match is not None
    bm = template.bucket_match(match, template.buckets(match, target)[-1])
    config = {**template.default_config(bm, target), **override}
    sch = C.Schedule(func)
    template.apply(sch, bm, config)
    return sch.mod["main"], config


@pytest.mark.parametrize("target", ["haswell-2", "skx-2", "neon-4"])
def test_padded_rows_leave_no_row_predicate_in_the_k_loops(target):
    tgt = parse_target(NAMED_TARGETS[target])
    (_, func), = _kernels(_proj(k=96), tgt).items()
    nest, config = _open(SymbolicMatmulEpilogue(), func, tgt)
    assert config["pad_m"] and config["mr"] > 1, config
    plain, guarded = _guarded_k_loops(lowered(nest, tgt).body)
    assert plain >= 1 and guarded == 0, (plain, guarded)
    # A's padded copy reads nothing past the input, the padded stores write nothing past the output
    sizes = [{"batch": b, "sequence": s} for b, s in ((1, 2), (1, 5), (1, 17), (3, 17), (2, 67))]
    assert out_of_bounds(nest, tgt, sizes) == []
    # the knob off: the last register tile keeps its row predicate (what the padding removes)
    nest_off, _ = _open(SymbolicMatmulEpilogue(), func, tgt, pad_m=False)
    assert _guarded_k_loops(lowered(nest_off, tgt).body)[1] >= 1


@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
def test_padding_does_not_apply_to_the_gemv_nest_static_rows_or_one_row_tiles(target):
    """Must not fire: the few-rows bucket (one row per tile: its space has no pad_m), a tile of one row, and
    static rows (cpu.matmul_epilogue's own pad_m rule, pads_rows)."""
    tgt = parse_target(NAMED_TARGETS[target])
    (_, func), = _kernels(_proj(), tgt).items()
    t = SymbolicMatmulEpilogue()
    match = t.match(func, tgt)
    for bucket in t.buckets(match, tgt)[:-1]:
        bm = t.bucket_match(match, bucket)
        pad_choices = {kb.name: kb.choices for kb in t.space(bm, tgt).knobs}["pad_m"]
        assert tuple(pad_choices) == (False,) and not t.default_config(bm, tgt)["pad_m"], bucket
    big = t.default_config(t.bucket_match(match, t.buckets(match, tgt)[-1]), tgt)
    assert MM.pads_symbolic_rows(match.info, MM.MatmulConfig.from_dict(big))
    # one-row tiles: nothing to pad; static rows: cpu.matmul_epilogue's pads_rows, not this rule
    assert not MM.pads_symbolic_rows(match.info, MM.MatmulConfig.from_dict({**big, "mr": 1}))
    static = {**match.info, "M": 17, "batch": [1]}
    assert not MM.pads_symbolic_rows(static, MM.MatmulConfig.from_dict(big))


def test_sibling_register_tile_is_capped_where_its_last_tile_is_predicated():
    tgt = parse_target(NAMED_TARGETS["haswell-2"])
    t = SymbolicSiblings()
    (_, func), = _kernels(_qkv(), tgt).items()
    cap = int(t.table_defaults(tgt)["predicated_mr_max"])
    _, config = _open(t, func, tgt)
    assert 1 < config["mr"] <= cap, config


@pytest.mark.parametrize("pad_m", [True, False])
def test_padded_and_unpadded_nests_match_the_reference_at_every_row_count(pad_m, host, rng, monkeypatch):
    """The model compiled for the host with the open bucket's pad_m forced on or off, on row counts 1..26
    (every tail of every register tile, every bucket) and 3 x 17, against the ONNX reference."""
    real = SymbolicMatmulEpilogue.default_config

    def forced(self, match, target):
        cfg = real(self, match, target)
        return cfg if match.info.get("small", False) else {**cfg, "pad_m": pad_m}

    monkeypatch.setattr(SymbolicMatmulEpilogue, "default_config", forced)
    model = _proj(k=96)
    cm = tvmfuse.compile(model, target=host, tuning_log=None)
    open_bucket = [s for s in cm.report.schedules if s["template"] == SymbolicMatmulEpilogue.family]
    assert open_bucket and open_bucket[0]["knobs"]["buckets"][-1]["config"]["pad_m"] == pad_m
    for b, s in [(1, n) for n in range(1, 27)] + [(3, 17)]:
        feeds = {"x": rng.standard_normal((b, s, 96)).astype(np.float32)}
        want = M.reference_outputs(model, feeds)["y"]
        np.testing.assert_allclose(cm.run(feeds)["y"], want, rtol=1e-4, atol=1e-4, err_msg=f"{b}x{s}")


def _window_matmul(n: int):
    """swin_dyn's window projection: [batch * 16 windows, 16 tokens, 32] @ [32, n], rows a multiple of 16."""
    te, tir = C.te, C.tirx
    i64 = lambda v: tir.const(v, "int64")   # noqa: E731  (Relax's extents are int64)
    batch = tir.Var("batch", "int64")
    a = te.placeholder((batch * i64(16), i64(16), i64(32)), "float32", name="A")
    w = te.placeholder((i64(32), i64(n)), "float32", name="B")
    k = te.reduce_axis((i64(0), i64(32)), name="k")
    out = te.compute((batch * i64(16), i64(16), i64(n)), lambda b, i, j: te.sum(a[b, i, k] * w[k, j], axis=k),
                     name="matmul")
    return te.create_prim_func([a, w, batch, out])


@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
def test_rows_that_the_register_tile_divides_are_not_padded(target):
    """Rows of ``batch * 16 x 16`` in register tiles that divide 16: nothing to pad (pad_einsum made no block
    and the template refused the kernel, so swin_dyn's window matmuls ran on cpu.symbolic_rows), no row
    predicate left in the k loops either."""
    tgt = parse_target(NAMED_TARGETS[target])
    t = SymbolicMatmulEpilogue()
    func = _window_matmul(96)
    match = t.match(func, tgt)
    assert match is not None
    nest, config = _open(t, func, tgt)
    assert config["pad_m"] and 16 % config["mr"] == 0, config
    assert MM.rows_divide([match.info["M"], *match.info["batch"]], config["mr"])
    assert not MM.rows_divide([C.tirx.Var("rows", "int64")], config["mr"])
    names = []
    C.post_order_visit(nest.body, lambda n: names.append(n.name_hint) if isinstance(n, C.SBlock) else None)
    assert not any("pad" in n for n in names), names
    assert _guarded_k_loops(lowered(nest, tgt).body)[1] == 0


def test_window_matmul_matches_numpy(host, rng):
    t = SymbolicMatmulEpilogue()
    func = _window_matmul(96)
    match = t.match(func, host)
    assert match is not None
    for bucket in t.buckets(match, host):
        bm = t.bucket_match(match, bucket)
        sch = C.Schedule(func)
        t.apply(sch, bm, t.default_config(bm, host))
        lib = C.build_prim_module(C.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), host)
        for b in (1, 3):
            a = rng.standard_normal((b * 16, 16, 32)).astype(np.float32)
            w = rng.standard_normal((32, 96)).astype(np.float32)
            out = C.tensor(np.zeros((b * 16, 16, 96), np.float32))
            lib["main"](C.tensor(a), C.tensor(w), b, out)
            np.testing.assert_allclose(out.numpy(), a @ w, rtol=1e-4, atol=1e-4, err_msg=f"{bucket.name} b{b}")
