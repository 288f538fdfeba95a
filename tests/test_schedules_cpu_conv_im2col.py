"""The conv template's im2col knob (tvmfuse/schedules/cpu/conv2d.py): the band's windows copied into
[channel, ky, kx, row, column] so that full-width rows of a small plane are one vectorized run of pixels.

Numerics: every shape class of real models (3x3 planes with many channels as SqueezeNet's Fire modules,
odd 7x7 / 15x15 / 31x31 planes, stride 2 without padding (a stem), asymmetric pads, dilation, 5x5) with
im2col forced on, rows fused or not, parallel over bands or bands x channel blocks: the same numbers as
the unscheduled kernel on fresh random inputs (host).  Structure on named AVX2/AVX-512 targets: which
convs take im2col by default, the fused pixel loop's width, no loop scalarized, the copy's layout, the
padding folded into the copy, generated code bounded.
"""
import json

import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.schedules.base import schedule_with
from tvmfuse.schedules.cpu.common import MAX_UNROLLED_COPIES
from tvmfuse.schedules.cpu.conv2d import Conv2DEpilogue
from tvmfuse.target import template_defaults

import schedule_cases as S

# (id, conv kwargs): odd planes and every window kind
SHAPES = [
    ("fire_3x3_plane", dict(cin=24, cout=32, h=3, w=3)),
    ("plane_7x7", dict(cin=8, cout=20, h=7, w=7)),
    ("plane_15x15", dict(cin=6, cout=18, h=15, w=15)),
    ("stem_31x31_s2_nopad", dict(cin=3, cout=16, h=64, w=64, s=2, pads=[0] * 4)),
    ("asymmetric_s2", dict(cin=5, cout=17, h=13, w=11, s=2, pads=[0, 1, 1, 0])),
    ("dilation_2", dict(cin=4, cout=16, h=9, w=9, dil=2)),
    ("5x5", dict(cin=4, cout=16, h=6, w=6, k=5)),
]


def _kernel(kwargs, target):
    tgt = tvmfuse.parse_target(target)
    funcs = S.graph_funcs(S.conv(**kwargs), tgt)
    (name, func), = [(n, f) for n, f in funcs.items() if "conv" in n]
    t = Conv2DEpilogue()
    match = t.match(func, tgt)
    assert match is not None, f"{name}: the conv template did not match"
    return t, match, func, tgt


def _config(t, match, tgt, **over):
    cfg = {**t.default_config(match, tgt), "deinterleave": False, "pad_width": False, **over}
    assert t.space(match, tgt).contains(cfg), cfg
    return cfg


@pytest.mark.parametrize("fused", [True, False], ids=["fused_rows", "row_tiles"])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("case,kwargs", SHAPES, ids=[c[0] for c in SHAPES])
def test_im2col_numerics_vs_unscheduled(case, kwargs, depth, fused, rng):
    host = tvmfuse.host_target()
    t, match, func, tgt = _kernel(kwargs, host)
    i = match.info
    ow, oh = (i["OW"], max(d for d in t.space(match, tgt).to_dict()["oh_tile"] if i["OH"] % d == 0 and
                          d * i["OW"] <= 4 * 16)) if fused else (1, 1)
    cfg = _config(t, match, tgt, im2col=True, fuse_rows=fused, ow_tile=ow, oh_tile=oh, parallel_depth=depth)
    scheduled = schedule_with(t, match, func, cfg)
    args = S.random_args(func, rng)
    np.testing.assert_allclose(S.run_func(scheduled, host, args)[0], S.run_func(func, host, args)[0],
                               rtol=1e-5, atol=1e-5, err_msg=f"{case}: {cfg}")


def _allocs(func) -> dict:
    return {str(b.name): [int(d) for d in b.shape] for n in S.nodes(func) if isinstance(n, C.SBlock)
            for b in n.alloc_buffers}


def test_fire_module_3x3_plane_default_on_avx512():
    """SqueezeNet's 3x3 conv on a 3x3 plane (F=256, C=64): on AVX-512 the default copies the windows and
    vectorizes the 9 pixels of the plane as one loop (not three 3-wide rows); the copy holds the pixels
    innermost, the padding is folded into it (no pad buffer left), nothing is scalarized, code bounded."""
    t, match, func, tgt = _kernel(dict(cin=64, cout=256, h=3, w=3), S.SKYLAKE)
    cfg = t.default_config(match, tgt)
    assert cfg["im2col"] and cfg["fuse_rows"] and cfg["oh_tile"] * cfg["ow_tile"] == 9, cfg
    res = schedule_with(t, match, func, cfg)
    vec = {int(f.extent) for f in S.loops(res) if int(f.kind) == int(C.ForKind.VECTORIZED)}
    assert 9 in vec, vec
    allocs = _allocs(res)
    cols = [shape for name, shape in allocs.items() if "reindex" in name]
    assert cols == [[1, 64, 3, 3, 3, 3]], allocs              # [n, c, ky, kx, rows, cols]
    assert "pad_temp" not in allocs, f"the padding block was not folded into the copy: {allocs}"
    assert not S.scalarized_loops(res)
    assert S.max_unrolled_copies(res) <= MAX_UNROLLED_COPIES


@pytest.mark.parametrize("target,hw,expected", [
    (S.SKYLAKE, 3, True),     # 9 pixels: one vector of 16
    (S.SKYLAKE, 4, True),     # 16 pixels: one whole vector
    (S.SKYLAKE, 7, False),    # 49 pixels: an odd-sized vector LLVM spills (whole_vectors)
    (S.SKYLAKE, 16, False),   # rows already whole vectors: the direct tile
    (S.HASWELL, 3, False),    # 9 pixels on 8 lanes: not whole vectors
    (S.HASWELL, 2, True),     # 4 pixels: one vector of 8
])
def test_im2col_default_only_where_rows_fill_whole_vectors(target, hw, expected):
    t, match, func, tgt = _kernel(dict(cin=16, cout=32, h=hw, w=hw), target)
    cfg = t.default_config(match, tgt)
    assert cfg["im2col"] is expected, cfg
    if expected:
        assert cfg["fuse_rows"] and cfg["ow_tile"] == hw and not cfg["deinterleave"]
    res = schedule_with(t, match, func, cfg)
    assert not S.scalarized_loops(res)


def test_im2col_needs_enough_output_channels():
    """The copy is shared by the output channels: below the table's im2col_min_channels the direct tile
    stays (at it, im2col)."""
    need = int(template_defaults(tvmfuse.parse_target(S.SKYLAKE), "cpu.conv2d_epilogue")["im2col_min_channels"])
    t, match, func, tgt = _kernel(dict(cin=16, cout=need - 1, h=3, w=3), S.SKYLAKE)
    assert not t.default_config(match, tgt)["im2col"]
    t, match, func, tgt = _kernel(dict(cin=16, cout=need, h=3, w=3), S.SKYLAKE)
    assert t.default_config(match, tgt)["im2col"]


def test_im2col_band_bound_comes_from_the_target_table(monkeypatch):
    """A band copy over the table's im2col_max_band_kib keeps the direct tile (the bound is data)."""
    t, match, func, tgt = _kernel(dict(cin=16, cout=32, h=3, w=3), S.SKYLAKE)
    assert t.default_config(match, tgt)["im2col"]
    table = json.loads(json.dumps(tvmfuse.target.cpu_table()))
    table["template_defaults"]["cpu.conv2d_epilogue"]["im2col_max_band_kib"] = 0
    monkeypatch.setattr(tvmfuse.target, "cpu_table", lambda: table)
    assert not t.default_config(match, tgt)["im2col"]


@pytest.mark.parametrize("kwargs", [dict(k=1, pads=[0] * 4), dict(group=4), dict(k=1, s=2, pads=[0] * 4)],
                         ids=["pointwise", "grouped", "1x1_stride_2"])
def test_im2col_not_offered(kwargs):
    """A 1x1 stride-1 conv reads contiguous pixels already; a grouped conv's copy would be per output
    channel: neither offers the knob."""
    t, match, func, tgt = _kernel(dict(cin=16, cout=32, h=3, w=3, **kwargs), S.SKYLAKE)
    assert t.space(match, tgt).to_dict()["im2col"] == [False]


def test_every_knob_combination_is_legal_im2col_over_deinterleave():
    """im2col replaces the padded input that deinterleave lays out: with both on, the kernel is im2col's
    (the same TIR), so every config of the space applies (the tuner samples them all)."""
    t, match, func, tgt = _kernel(dict(cin=3, cout=16, h=16, w=16, s=2), S.SKYLAKE)
    cfg = {**t.default_config(match, tgt), "im2col": True, "fuse_rows": False}
    both = {**cfg, "deinterleave": True}
    assert t.space(match, tgt).contains(both)
    C.assert_structural_equal(schedule_with(t, match, func, both), schedule_with(t, match, func,
                                                                                 {**cfg, "deinterleave": False}))


# ----------------------------------------------------------------------------- pad_width
# rows wider than a vector and not a multiple of it (on 16 and 8 lanes alike)
WIDE = [
    ("stem_31x31_s2_nopad", dict(cin=3, cout=16, h=64, w=64, s=2, pads=[0] * 4)),
    ("3x3_ow19", dict(cin=4, cout=16, h=5, w=19)),
    ("5x5_ow20", dict(cin=3, cout=16, h=8, w=20, k=5)),
    ("dilation_2_ow21", dict(cin=2, cout=16, h=6, w=21, dil=2)),
    ("asymmetric_s2_ow20", dict(cin=3, cout=16, h=9, w=40, s=2, pads=[0, 1, 1, 0])),
    ("no_epilogue_ow17", dict(cin=3, cout=16, h=4, w=17, act=None, bias=False)),
]


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("case,kwargs", WIDE, ids=[c[0] for c in WIDE])
def test_pad_width_numerics_vs_unscheduled(case, kwargs, depth, rng):
    """The padded row computed whole and its valid columns stored: the same numbers as the unscheduled
    kernel (fresh random inputs), with the register tile over one or several rows."""
    host = tvmfuse.host_target()
    t, match, func, tgt = _kernel(kwargs, host)
    assert True in t.space(match, tgt).to_dict()["pad_width"], f"{case}: pad_width not offered"
    args = S.random_args(func, rng)
    want = S.run_func(func, host, args)[0]
    for oh in sorted({1, max(d for d in (1, 2, 3) if match.info["OH"] % d == 0)}):
        cfg = _config(t, match, tgt, im2col=True, pad_width=True, fuse_rows=False, ow_tile=match.info["OW"],
                      oh_tile=oh, oc_tile=4, parallel_depth=depth)
        got = S.run_func(schedule_with(t, match, func, cfg), host, args)[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{case}: {cfg}")


def _lowered(func, target):
    """``func`` lowered as TVM's CPU pipeline does up to its vectorizer (loops canonicalized: partitioned
    loops start at 0; simplified: a partition's provably true predicate is dropped)."""
    st, tx = C.s_tir.transform, C.tirx.transform
    mod = C.IRModule({"main": func.with_attr("target", target)})
    with target:
        return C.Sequential([st.CanonicalizeLoop(), st.LowerInitBlock(), st.PlanAndUpdateBufferAllocationLocation(),
                             st.ConvertBlocksToOpaque(), st.CompactBufferAllocation(), st.LowerMatchBuffer(),
                             st.StmtSimplify(), st.LowerOpaqueBlock(), tx.FlattenBuffer(),
                             tx.VectorizeLoop(True)])(mod)["main"]


def _store_lanes(func, buffer_prefix):
    lanes = []
    C.post_order_visit(func.body, lambda s: lanes.append(int(s.value.ty.dtype.lanes))
                       if isinstance(s, C.BufferStore) and str(s.buffer.name).startswith(buffer_prefix) else None)
    return lanes


@pytest.mark.parametrize("target,lanes", [(S.SKYLAKE, 16), (S.HASWELL, 8)], ids=["skylake", "haswell"])
def test_stem_31_columns_padded_to_whole_vectors(target, lanes):
    """SqueezeNet's stem (3x3 stride 2 on 64x64: 31 output columns): by default the copied columns are
    padded to 32 and the accumulators are whole vectors (no 31- or 15-lane vector, which LLVM splits and
    spills); the epilogue stores the 31 valid columns as whole vectors plus one narrower vector, nothing
    scalarized; the padding block folded into the copy; code bounded."""
    t, match, func, tgt = _kernel(dict(cin=3, cout=64, h=64, w=64, s=2, pads=[0] * 4), target)
    cfg = t.default_config(match, tgt)
    assert cfg["im2col"] and cfg["pad_width"] and not cfg["fuse_rows"], cfg
    res = schedule_with(t, match, func, cfg)
    allocs = _allocs(res)
    assert [s[-1] for n, s in allocs.items() if "reindex" in n] == [32], allocs
    low = _lowered(res, tgt)
    acc = _store_lanes(low, "conv2d_nchw_intermediate")
    assert acc and all(n % lanes == 0 for n in acc), f"accumulator vectors of {sorted(set(acc))} lanes"
    out = set(_store_lanes(low, "compute"))
    assert 31 % lanes in out and all(n % lanes == 0 or n == 31 % lanes for n in out), \
        f"output stores of {sorted(out)} lanes"
    assert not [str(f.loop_var.name) for f in S.loops(low) if str(f.loop_var.name).endswith("_s")]
    assert S.max_unrolled_copies(res) <= MAX_UNROLLED_COPIES


def test_pad_width_bound_comes_from_the_target_table(monkeypatch):
    """The stem's padded rows are the default while a row's window copy fits the table's
    pad_width_l1_share of L1; with a share of 0 they are not."""
    t, match, func, tgt = _kernel(dict(cin=3, cout=64, h=64, w=64, s=2, pads=[0] * 4), S.SKYLAKE)
    assert t.default_config(match, tgt)["pad_width"]
    table = json.loads(json.dumps(tvmfuse.target.cpu_table()))
    table["template_defaults"]["cpu.conv2d_epilogue"]["pad_width_l1_share"] = 0
    monkeypatch.setattr(tvmfuse.target, "cpu_table", lambda: table)
    assert not t.default_config(match, tgt)["pad_width"]


@pytest.mark.parametrize("kwargs,why", [
    (dict(cin=3, cout=16, h=34, w=34, pads=[0] * 4), "32 columns: whole vectors already"),
    (dict(cin=3, cout=16, h=9, w=9), "7 columns: one (narrower) vector"),
    (dict(cin=3, cout=16, h=8, w=100), "98 columns: wider than a register-tile row"),
    (dict(cin=4, cout=16, h=8, w=20, group=2), "grouped: no im2col"),
])
def test_pad_width_not_offered(kwargs, why):
    t, match, func, tgt = _kernel(kwargs, S.SKYLAKE)
    assert t.space(match, tgt).to_dict()["pad_width"] == [False], why


@pytest.mark.parametrize("other", [dict(im2col=False), dict(fuse_rows=True, oh_tile=1)],
                         ids=["without_im2col", "with_fused_rows"])
def test_pad_width_applies_only_with_im2col_unfused_rows(other):
    """pad_width pads im2col's unfused rows; with im2col off or rows fused it changes nothing (the same
    TIR as with it off): every config of the space applies."""
    t, match, func, tgt = _kernel(dict(cin=3, cout=16, h=64, w=64, s=2, pads=[0] * 4), S.SKYLAKE)
    cfg = {**t.default_config(match, tgt), "ow_tile": match.info["OW"], **other}
    on, off = {**cfg, "pad_width": True}, {**cfg, "pad_width": False}
    assert t.space(match, tgt).contains(on)
    C.assert_structural_equal(schedule_with(t, match, func, on), schedule_with(t, match, func, off))


def test_all_layout_knob_combinations_apply_and_stay_correct(rng):
    """Every combination of the input-layout knobs (im2col, pad_width, fuse_rows, deinterleave) on a strided
    padded conv with a row wider than a vector (19 columns): applies and gives the unscheduled numbers."""
    import itertools

    host = tvmfuse.host_target()
    t, match, func, tgt = _kernel(dict(cin=2, cout=16, h=9, w=38, s=2), host)
    space = t.space(match, tgt).to_dict()
    names = ["im2col", "pad_width", "fuse_rows", "deinterleave"]
    args = S.random_args(func, rng)
    want = S.run_func(func, host, args)[0]
    base = t.default_config(match, tgt)
    for values in itertools.product(*(space[n] for n in names)):
        cfg = {**base, **dict(zip(names, values))}
        got = S.run_func(schedule_with(t, match, func, cfg), host, args)[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(cfg))


@pytest.mark.parametrize("target", [S.SKYLAKE, S.HASWELL], ids=["skylake", "haswell"])
@pytest.mark.parametrize("cin,hw", [(32, 28), (64, 56)], ids=["32ch_28x28", "64ch_56x56"])
def test_no_im2col_on_large_planes(target, cin, hw):
    """ResNet-sized planes keep the direct tile: rows as wide as a vector or wider are not fused through the
    window copy, and a row's copy larger than a quarter of L1 is not padded (measured alone on skx: both
    were 4-6x slower with the copy; benchmarks/bench_cpu_io.json conv3x3_bn_relu_res before the fix)."""
    t, match, func, tgt = _kernel(dict(cin=cin, cout=cin, h=hw, w=hw), target)
    cfg = t.default_config(match, tgt)
    assert not cfg["im2col"] and not cfg["pad_width"], cfg


def _parallel_extents(func) -> list[int]:
    """Extents of the parallel loops, in program order (the post-order visit keeps sibling order)."""
    return [int(f.extent) for f in S.loops(func) if f.kind == C.ForKind.PARALLEL]


# (id, conv kwargs, target, parallel extents of the default schedule): the padded im2col copy made once
# before the tiles (its own parallel loop, then row bands x channel blocks) where the whole copy fits the
# target's shared_copy_l2_share of L2, else per row band inside the tiles' loop (one parallel loop)
SHARED_COPY = [
    # squeezenet's stem: 27 x 31 x 32 floats (107 kB) <= 1/4 of skx's 1 MiB L2; oc_tile 4: 16 channel blocks
    ("stem_skylake", dict(cin=3, cout=64, h=64, w=64, s=2, pads=[0] * 4), S.SKYLAKE, [27 * 31, 31 * 16]),
    # must not fire: over 1/4 of haswell's 256 KiB L2
    ("stem_haswell", dict(cin=3, cout=64, h=64, w=64, s=2, pads=[0] * 4), S.HASWELL, [31]),
    # must not fire: 198 padded rows of 27 x 64 floats (1.4 MB) on skx
    ("tall_plane_skylake", dict(cin=3, cout=16, h=200, w=65, pads=[0] * 4), S.SKYLAKE, [198]),
]


@pytest.mark.parametrize("case,kwargs,target,extents", SHARED_COPY, ids=[c[0] for c in SHARED_COPY])
def test_padded_copy_shared_where_it_fits_l2(case, kwargs, target, extents):
    t, match, func, tgt = _kernel(kwargs, target)
    cfg = t.default_config(match, tgt)
    assert cfg["im2col"] and cfg["pad_width"], cfg
    assert cfg["parallel_depth"] == (2 if len(extents) == 2 else 1), cfg
    assert _parallel_extents(schedule_with(t, match, func, cfg)) == extents
