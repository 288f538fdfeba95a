"""The CPU matmul family on every layout real exports produce: leading batch dims on the data operand with
a shared weight ([B, S, K] @ [K, N]), true batched matmul (A[b] @ B[b]), a batch dim broadcast on one
operand, B transposed (Q @ K^T, Gemm transB=1 with alpha/beta), M = 1 (GEMV), M/N/K that divide no tile,
and sibling matmuls (Q/K/V, SwiGLU) over 3-D activations.

Numerics: tvmfuse.compile on the host vs onnx's reference evaluator, fresh random inputs.
Structure, on named AVX2 and AVX-512 targets: the template matches (no dlight / generic fallback), the
outer loop is parallel, and the register tile's accumulator is only ever written by vector stores
(columns that divide no tile are padded: TVM's vectorizer turns a per-lane predicate into scalar code)."""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.explain import Recorder
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu.common import MAX_UNROLLED_COPIES

import schedule_cases as S

MATMUL, SIBLINGS = "cpu.matmul_epilogue", "cpu.sibling_matmuls"

# (builder, kwargs, family of the kernel holding the matmul)
CASES = [
    ("matmul_3d", dict(), MATMUL),
    ("matmul_3d", dict(b=3, s=8, k=64, n=48, act="Sigmoid"), MATMUL),
    ("matmul_3d", dict(b=8, s=1, k=64, n=67), MATMUL),                 # batched decode: M = 1 per batch
    ("batched_matmul", dict(), MATMUL),
    ("broadcast_matmul", dict(), MATMUL),
    ("scores_matmul", dict(), MATMUL),
    ("gemm_transb", dict(), MATMUL),
    ("gemv", dict(), MATMUL),
    ("gemv", dict(k=64, n=1000), MATMUL),
    ("qkv_3d", dict(), SIBLINGS),
    ("swiglu_3d", dict(), SIBLINGS),
]
IDS = [f"{b}-{i}" for i, (b, _, _) in enumerate(CASES)]


def _model(builder, kwargs):
    return getattr(S, builder)(**kwargs)


def _matmul_kernels(model, target):
    """(name, func, Scheduled) of every kernel of ``model`` that holds a matmul (a contraction)."""
    out = []
    for name, func in S.graph_funcs(model, target).items():
        if "matmul" in name or "gemm" in name:
            out.append((name, func, schedule_prim_func(func, target, {}, name)))
    assert out, f"no matmul kernel in {list(S.graph_funcs(model, target))}"
    return out


@pytest.mark.parametrize("builder,kwargs,family", CASES, ids=IDS)
def test_matmul_layouts_numerics_vs_reference(builder, kwargs, family, host, rng):
    model = _model(builder, kwargs)
    with Recorder() as rec:
        cm = tvmfuse.compile(model, host)
    matmuls = [s for s in rec.schedules if "matmul" in s["kernel"]]
    assert matmuls and all(s["template"] == family for s in matmuls), rec.schedules
    assert not [s for s in rec.schedules if s["source"] in ("fallback", "generic")], rec.schedules
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in model.graph.input}
    ref = M.reference_outputs(model, feeds)
    out = cm.run(feeds)
    for name, r in ref.items():
        np.testing.assert_allclose(out[name], r, rtol=1e-4, atol=1e-5, err_msg=f"{builder} output {name}")


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
@pytest.mark.parametrize("builder,kwargs,family", CASES, ids=IDS)
def test_matmul_layouts_structure(builder, kwargs, family, target):
    tgt = tvmfuse.parse_target(target)
    lanes = 16 if "avx512" in target else 8
    for name, func, res in _matmul_kernels(_model(builder, kwargs), tgt):
        assert res is not None and res.template == family, f"{name}: {res and res.template}\n{func.script()}"
        assert res.config["lanes"] in (lanes, lanes // 2), res.config
        kinds = S.kinds(res.func)
        assert int(C.ForKind.PARALLEL) in kinds or _elements(func) < 4096, f"{name}: no parallel loop"
        assert int(C.ForKind.VECTORIZED) in kinds, f"{name}: no vectorized loop"
        assert S.max_unrolled_copies(res.func) <= MAX_UNROLLED_COPIES
        # the register tile: every store into an accumulator is a vector store (no scalar fallback)
        low = S.lowered_vectorized(res.func)
        acc = [n for n in S.nodes(low) if isinstance(n, C.BufferStore) and "matmul" in str(n.buffer.name)
               and str(n.buffer.name) not in {str(p.name) for p in func.params}]
        assert acc, f"{name}: no accumulator stores found"
        scalar = [str(n.buffer.name) for n in acc if not S.is_vector(n.value)]
        assert not scalar, f"{name} ({res.config}): scalar stores into the register tile: {set(scalar)}"


def _elements(func):
    n = 1
    for d in func.params[-1].shape:
        n *= int(d)
    return n


def test_padded_columns_keep_the_register_tile_vectorized():
    """N = 67 on AVX-512 (no register-tile width divides it): with pad_n the accumulator's stores are vector
    stores; the predicated alternative (pad_n False) is what TVM scalarizes: the check can fail."""
    tgt = tvmfuse.parse_target(S.SKYLAKE)
    name, func, res = _matmul_kernels(S.matmul_3d(n=67), tgt)[0]
    assert res.config["pad_n"] and res.config["lanes"] == 16 and (res.config["nvec"] * res.config["lanes"]) % 67
    from tvmfuse.schedules.base import schedule_with
    from tvmfuse.schedules.cpu.matmul import MatmulEpilogue

    t = MatmulEpilogue()
    match = t.match(func, tgt)
    unpadded = schedule_with(t, match, func, {**res.config, "pad_n": False})
    for f, want_scalar in ((res.func, False), (unpadded, True)):
        low = S.lowered_vectorized(f)
        scalar = [n for n in S.nodes(low) if isinstance(n, C.BufferStore) and "matmul" in str(n.buffer.name)
                  and not S.is_vector(n.value)]
        assert bool(scalar) == want_scalar


def test_shared_weight_batch_and_broadcast_roles(host):
    """The analysis gives the data operand's batch axes and the weight's (broadcast) batch axes."""
    from tvmfuse.schedules.cpu.matmul import MatmulEpilogue

    t = MatmulEpilogue()
    (_, f3d, _), = _matmul_kernels(S.matmul_3d(b=2, s=5, k=7, n=9), host)
    info = t.match(f3d, host).info
    assert (info["batch"], info["b_batch"], info["M"], info["N"], info["K"]) == ([2], [False], 5, 9, 7)
    (_, fb, _), = _matmul_kernels(S.broadcast_matmul(b=2, h=3, m=4, k=5, n=6), host)
    info = t.match(fb, host).info
    assert (info["batch"], info["b_batch"]) == ([2, 3], [False, True])


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
def test_knob_space_configs_apply_on_3d_activations(target, rng):
    """Sampled configs of the 3-D matmul apply and compute the unscheduled kernel's numbers (host run)."""
    import random

    from tvmfuse.schedules.base import schedule_with
    from tvmfuse.schedules.cpu.matmul import MatmulEpilogue

    tgt = tvmfuse.parse_target(target)
    host = tvmfuse.host_target()
    (_, func, _), = _matmul_kernels(S.matmul_3d(b=2, s=11, k=13, n=21), tgt)
    t = MatmulEpilogue()
    match = t.match(func, tgt)
    space = t.space(match, tgt)
    args = S.random_args(func, rng)
    want = S.run_func(func, host, args)[0]
    r = random.Random(S.CONFIG_SEED)
    for _ in range(4):
        cfg = space.sample(r)
        got = S.run_func(schedule_with(t, match, func, cfg), host, args)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=str(cfg))


def test_half_width_vectors_instead_of_padding_for_few_rows():
    """GEMV over 1000 columns on AVX-512: 16 does not divide 1000, 8 does; one row cannot amortize a padded
    copy of the weight, so the default takes 8-lane vectors and no padding; with many rows it pads."""
    from tvmfuse.schedules.cpu.matmul import HALF_LANES_BELOW_ROWS_PER_LANE, pick_lanes

    tgt = tvmfuse.parse_target(S.SKYLAKE)
    (name, func, res), = _matmul_kernels(S.gemv(k=64, n=1000), tgt)
    assert res.config["lanes"] == 8 and 1000 % (res.config["nvec"] * 8) == 0, res.config
    assert not [b for b in S.nodes(res.func) if isinstance(b, C.SBlock) and b.name_hint.endswith("_pad")]
    rows = HALF_LANES_BELOW_ROWS_PER_LANE * 16
    assert pick_lanes(rows - 1, 1000, 16) == 8 and pick_lanes(rows, 1000, 16) == 16
    assert pick_lanes(1, 1024, 16) == 16 and pick_lanes(1, 1001, 16) == 16


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
def test_shared_weight_batches_flattened_into_rows(target, rng):
    """[8, 1, K] @ W (batched decode): the 8 batch rows form one M = 8 (each B panel is read once, not once
    per batch): the matmul block of the scheduled kernel has one row iterator; with flatten_batch off the
    batch loop stays; both compute the unscheduled kernel's numbers (host run)."""
    from tvmfuse.schedules.base import schedule_with
    from tvmfuse.schedules.cpu.matmul import MatmulEpilogue

    tgt = tvmfuse.parse_target(target)
    (name, func, res), = _matmul_kernels(S.matmul_3d(b=8, s=1, k=24, n=40), tgt)
    t = MatmulEpilogue()
    match = t.match(func, tgt)
    assert match.info["rows"] == 8 and res.config["flatten_batch"] and res.config["mr"] > 1, res.config
    unflat = schedule_with(t, match, func, {**res.config, "flatten_batch": False, "mr": 1})

    def matmul_iters(f):
        blocks = [n for n in S.nodes(f) if isinstance(n, C.SBlock) and n.name_hint == "matmul_update"]
        return {len(b.iter_vars) for b in blocks}

    assert matmul_iters(res.func) == {3} and matmul_iters(unflat) == {4}
    host = tvmfuse.host_target()
    args = S.random_args(func, rng)
    want = S.run_func(func, host, args)[0]
    for f in (res.func, unflat):
        np.testing.assert_allclose(S.run_func(f, host, args)[0], want, rtol=1e-5, atol=1e-5)


def test_vit_block_every_kernel_from_a_template(host, rng):
    """A ViT encoder block (3-D activations everywhere, odd sequence length 50): every kernel is scheduled
    by a template (none by dlight or the generic schedule) and the block computes the reference."""
    model = S.vit_block()
    with Recorder() as rec:
        cm = tvmfuse.compile(model, host)
    counts = cm.report.to_dict()["schedule_sources"]
    assert counts["template"] == len(rec.schedules) and counts["template"] > 0, rec.schedules
    families = {s["template"] for s in rec.schedules}
    # the Q/K/V siblings after the first LayerNorm are one cpu.norm_matmul kernel (norm_prologue rule)
    assert {MATMUL, "cpu.norm_matmul"} <= families, families
    feeds = {"x": rng.standard_normal([1, 50, 96]).astype(np.float32)}
    np.testing.assert_allclose(cm.run(feeds)["out"], M.reference_outputs(model, feeds)["out"], rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("builder,kwargs", [("qkv_3d", dict(b=4, s=1, h=40)), ("swiglu_3d", dict(b=3, s=5))])
def test_siblings_over_batches_flattened_and_sampled_configs(builder, kwargs, rng):
    """Q/K/V and SwiGLU over [B, S, H]: the batch rows flattened into one M by default (weights shared);
    the default and sampled configs (flattened or not) compute the unscheduled kernel's numbers."""
    import random

    from tvmfuse.schedules.base import schedule_with
    from tvmfuse.schedules.cpu.siblings import SiblingMatmuls

    t = SiblingMatmuls()
    host = tvmfuse.host_target()
    tgt = tvmfuse.parse_target(S.SKYLAKE)
    (name, func), = [(n, f) for n, f in S.graph_funcs(getattr(S, builder)(**kwargs), tgt).items() if t.match(f, tgt)]
    match = t.match(func, tgt)
    assert match.info["rows"] == kwargs["b"] * kwargs["s"] and t.default_config(match, tgt)["flatten_batch"]
    n_out = len(match.info["chains"])
    args = S.random_args(func, rng, n_out)
    want = S.run_func(func, host, args, n_out)
    r = random.Random(S.CONFIG_SEED)
    configs = [t.default_config(match, tgt)] + [t.space(match, tgt).sample(r) for _ in range(3)]
    for cfg in configs:
        got = S.run_func(schedule_with(t, match, func, cfg), host, args, n_out)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=str(cfg))


# Sampled configs that once failed to schedule (CI, session 6): packed B panels wider than N, two or more
# matmuls under one panel loop. A packed copy's vector tail left opaque blocks there before the next matmul's
# compute_at; the copies are now vectorized after every matmul is placed.
_WIDE_PACKED_PANELS = [
    ("swiglu_3d", dict(b=3, s=5), dict(mr=3, nvec=3, lanes=16, mc_tiles=4, nc_tiles=2, k_unroll=2,
                                        share_rows=False, order="cols", pack_b=True, pad_n=False,
                                        flatten_batch=True)),
    ("qkv_3d", dict(b=4, s=1, h=40), dict(mr=2, nvec=2, lanes=16, mc_tiles=4, nc_tiles=2, k_unroll=1,
                                           share_rows=False, order="cols", pack_b=True, pad_n=False,
                                           flatten_batch=True)),
]


@pytest.mark.parametrize("builder,kwargs,cfg", _WIDE_PACKED_PANELS, ids=[c[0] for c in _WIDE_PACKED_PANELS])
def test_siblings_packed_panels_wider_than_n(builder, kwargs, cfg, rng):
    """Packed B panels wider than N under one panel loop: the kernel schedules and computes the unscheduled
    kernel's numbers, and every matmul keeps its own packed copy."""
    from tvmfuse.schedules.base import schedule_with
    from tvmfuse.schedules.cpu.siblings import SiblingMatmuls

    t = SiblingMatmuls()
    host = tvmfuse.host_target()
    tgt = tvmfuse.parse_target(S.SKYLAKE)
    (name, func), = [(n, f) for n, f in S.graph_funcs(getattr(S, builder)(**kwargs), tgt).items() if t.match(f, tgt)]
    match = t.match(func, tgt)
    n_out = len(match.info["chains"])
    args = S.random_args(func, rng, n_out)
    want = S.run_func(func, host, args, n_out)
    scheduled = schedule_with(t, match, func, cfg)
    script = scheduled.script()
    for b in set(match.info["b_buffers"].values()):
        assert f"{b}_global[" in script, b
    got = S.run_func(scheduled, host, args, n_out)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=str(cfg))
