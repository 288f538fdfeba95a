"""CPU schedule templates: each family matches by structure, fuses the loops for real (no intermediate of
full output size, inner loops vectorized, outer loop parallel) and computes the same numbers as the
unfused reference on fresh random inputs with odd shapes that do not divide the tiles.

Structural tests run on fixed named targets (conftest.NAMED_TARGETS: AVX2, AVX-512 with 2 and 32 cores,
NEON), whose facts come from the target, so they pass or fail alike on every host; numeric tests run on
the host."""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.explain import Recorder
from tvmfuse.pipeline import PipelineOptions, graph_stage
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu import TEMPLATES
from tvmfuse.schedules.cpu.common import min_parallel_work

from tvmfuse.target import cpu_info

from conftest import NAMED_TARGETS, assert_close_to_reference, named_target
from schedule_cases import store_lanes as _store_lanes

# (model builder, kwargs, family expected on its main kernel): odd sizes on purpose
CASES = [
    ("matmul_bias_gelu", dict(m=37, k=45, n=67), "cpu.matmul_epilogue"),
    ("matmul_bias_act", dict(m=29, k=33, n=50, act="Relu"), "cpu.matmul_epilogue"),
    ("matmul_bias_act", dict(m=29, k=33, n=50, act="Sigmoid"), "cpu.matmul_epilogue"),
    ("layernorm", dict(rows=37, d=101, decomposed=False), "cpu.row_reduction"),
    ("layernorm", dict(rows=37, d=104), "cpu.row_reduction"),
    ("softmax", dict(rows=23, d=96, decomposed=False), "cpu.row_reduction"),
    ("softmax", dict(rows=23, d=101), "cpu.row_reduction"),
    ("rmsnorm", dict(rows=37, d=101), "cpu.row_reduction"),
    ("mean_variance", dict(rows=37, d=96), "cpu.row_reduction"),
    ("elementwise_chain", dict(n=4099), "cpu.elementwise"),
]


def _fused_prim_funcs(model, target):
    mod = tvmfuse.load_onnx(model)
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions(fusion=False)))(mod)
    return {str(gv.name_hint): f for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)}


def _walk(stmt, visit):
    """Visit every statement of a TIR body (the Python side of TVM 0.27 has no stmt functor)."""
    visit(stmt)
    for attr in ("body", "then_case", "else_case", "block", "init"):
        child = getattr(stmt, attr, None)
        if child is not None and not isinstance(child, (str, int)) and hasattr(child, "same_as") \
                and not hasattr(child, "ty"):
            _walk(child, visit)
    for child in getattr(stmt, "seq", ()) or ():
        _walk(child, visit)


def _structure(func):
    """Intermediate allocations (element counts) after buffer compaction, and the loop kinds seen."""
    mod = C.IRModule({"main": func})
    mod = C.Sequential([C.s_tir.transform.LowerInitBlock(), C.s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
                        C.s_tir.transform.ConvertBlocksToOpaque(),
                        C.s_tir.transform.CompactBufferAllocation()])(mod)
    allocs, kinds, outer = [], [], []

    def visit(s):
        if isinstance(s, C.SBlock):
            for buf in s.alloc_buffers:
                n = 1
                for d in buf.shape:
                    n *= int(d)
                allocs.append((str(buf.name), n))
        if isinstance(s, C.tirx.For):
            kinds.append(int(s.kind))

    _walk(mod["main"].body, visit)
    return allocs, kinds


def _pure_unvectorizable_reduction(res, func, target):
    if res.template != "cpu.row_reduction" or res.config["vectorize_reductions"]:
        return False
    info = next(t for t in TEMPLATES if t.family == res.template).match(func, target).info
    return set(info["blocks"]) == set(info["reductions"])


def _numel(func):
    sizes = []
    for p in func.params:
        n = 1
        for d in p.shape:
            n *= int(d)
        sizes.append(n)
    return sizes


@pytest.mark.parametrize("tname", list(NAMED_TARGETS))
@pytest.mark.parametrize("builder,kwargs,family", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_family_matches_and_fuses_loops(builder, kwargs, family, tname):
    target = named_target(tname)
    funcs = _fused_prim_funcs(getattr(M, builder)(**kwargs), target)
    families = {}
    for name, func in funcs.items():
        res = schedule_prim_func(func, target, {}, name)
        assert res is not None, f"{name}: no CPU template matched\n{func.script()}"
        families[name] = res.template
        allocs, kinds = _structure(res.func)
        out_elems = _numel(func)[-1]
        # no intermediate of full output size is left: producers live on tiles / rows
        # (a zero-padded copy of an input's panel, pad_n of the matmul templates, is not an intermediate)
        input_pads = {f"{p.name}_pad" for p in func.params}
        big = [(n, e) for n, e in allocs if e >= out_elems and out_elems > 64 and n not in input_pads]
        assert not big, f"{name} ({res.template}): full-size intermediates left: {big}"
        if _pure_unvectorizable_reduction(res, func, target):
            continue   # a lone reduction over rows of odd length: scalar (see README, what is left)
        assert int(C.ForKind.VECTORIZED) in kinds, f"{name}: no vectorized loop"
        parallel = int(C.ForKind.PARALLEL) in kinds
        if "parallel" in res.config:
            # the loop does what the config says; the default forks for any output over the target's fork/join
            # cost (common.min_parallel_work: the kernel's work is at least its output)
            assert parallel == res.config["parallel"], f"{name}: parallel loop {parallel}, config {res.config}"
            if out_elems >= min_parallel_work(target):
                assert parallel, f"{name}: no parallel loop on {cpu_info(target).cores} cores"
        elif out_elems >= 1024:
            assert parallel, f"{name}: no parallel loop"
    assert family in families.values(), f"expected {family}, got {families}"


@pytest.mark.parametrize("builder,kwargs,family", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_family_numerics_vs_reference(builder, kwargs, family, host, rng):
    model = getattr(M, builder)(**kwargs)
    with Recorder() as rec:
        cm = tvmfuse.compile(model, host, fusion=False)
    used = {s["template"] for s in rec.schedules}
    assert family in used, f"{family} not used: {rec.schedules}"
    assert "fallback" not in used, f"a kernel fell back: {[s for s in rec.schedules if s['source'] == 'fallback']}"
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-5)


def test_matmul_knob_space_is_legal(host):
    """Every config the tuner may sample from the matmul space applies and is correct (a sample of 6)."""
    import random

    model = M.matmul_bias_gelu(m=13, k=20, n=30)
    func = next(iter(_fused_prim_funcs(model, host).values()))
    tmpl = next(t for t in TEMPLATES if t.family == "cpu.matmul_epilogue")
    match = tmpl.match(func, host)
    assert match is not None
    space = tmpl.space(match, host)
    # the space's size on the named x86 targets (it depends on the vector width: 8-lane AVX2 holds more nvec
    # choices for N = 30 than 16-lane AVX-512; 2 x the parallel knob x 2 pad_m, less the tiles dividing the
    # 13 rows); the host's space is sampled below
    for tname in ("haswell-2", "skx-2"):
        named = named_target(tname)
        sized = tmpl.space(tmpl.match(next(iter(_fused_prim_funcs(model, named).values())), named), named).size()
        assert 100 <= sized <= 200000, (tname, sized)
    ref = C.build_prim_module(C.IRModule({"main": func.with_attr("global_symbol", "main")}), target=host)
    args = [np.random.default_rng(0).standard_normal([int(d) for d in p.shape]).astype("float32")
            for p in func.params]
    want = C.tensor(np.zeros_like(args[-1]))
    ref["main"](*[C.tensor(a) for a in args[:-1]], want)
    rnd = random.Random(0)
    for _ in range(6):
        cfg = space.sample(rnd)
        sch = C.Schedule(func)
        tmpl.apply(sch, match, cfg)
        lib = C.build_prim_module(C.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}),
                          target=host)
        got = C.tensor(np.zeros_like(args[-1]))
        lib["main"](*[C.tensor(a) for a in args[:-1]], got)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5, err_msg=str(cfg))


def test_no_template_for_opaque_kernel_is_recorded():
    """A kernel no template matches is left to the fallback with a reason (here: a 1-D cumulative scan)."""
    T = C.script_tir

    @T.prim_func(private=True, s_tir=True)
    def scan(a: T.Buffer((T.int64(16),), "float32"), b: T.Buffer((T.int64(16),), "float32")):
        for i in range(T.int64(16)):
            with T.sblock("scan"):
                vi = T.axis.opaque(T.int64(16), i)
                b[vi] = a[vi] + T.if_then_else(vi > T.int64(0), b[vi - T.int64(1)], T.float32(0))

    assert schedule_prim_func(scan, named_target("haswell-2"), {}, "scan") is None


def test_runtime_uses_the_configured_threads():
    """configure_threads(n) really gives TVM n threads (TVM sizes its pool once, on first use, from
    TVM_NUM_THREADS or half the logical CPUs on x86: a 2-vCPU VM got 1 thread whatever was asked)."""
    import os
    import subprocess
    import sys

    from tvmfuse.target import physical_cores

    want = physical_cores()
    code = ("from tvmfuse.target import configure_threads; from tvmfuse import _compat as C; "
            f"print(configure_threads({want}), C.runtime_threads())")
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == [str(want), str(want)], out.stdout + out.stderr


@pytest.mark.parametrize("kwargs", [dict(channels=6, size=9), dict(channels=3, size=16)])
def test_row_reduction_inlines_producer_read_once(kwargs, host, rng):
    """InstanceNorm's (x - mean)^2 is read only by the variance sum, once per element: it is computed inside
    that sum (no row buffer written and read back in a pass of its own), and the numbers stay right."""
    model = M.instancenorm_silu(**kwargs)
    row = kwargs["size"] ** 2
    for target in (named_target("haswell-2"), named_target("skx-32")):
        for name, func in _fused_prim_funcs(model, target).items():
            res = schedule_prim_func(func, target, {}, name)
            assert res is not None and res.template == "cpu.row_reduction", name
            allocs, _ = _structure(res.func)
            rows = [(n, e) for n, e in allocs if e >= row]
            assert not rows, f"{name}: row buffers left: {rows}"
    cm = tvmfuse.compile(model, host, fusion=False)
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-5)


def _softmax_kernel(model, target, fusion, family="cpu.row_reduction"):
    """The scheduled softmax PrimFunc (the one with the exp) and the name of the buffer its exp writes."""
    mod = tvmfuse.load_onnx(model)
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions(fusion=fusion)))(mod)
    for name, func in ((str(gv.name_hint), f) for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)):
        written = []

        def visit(node):
            if isinstance(node, C.BufferStore):
                calls = []
                C.post_order_visit(node.value, lambda e: calls.append(e) if isinstance(e, C.Call) and
                                   str(getattr(e.op, "name", "")) == "tirx.exp" else None)
                if calls:
                    written.append(str(node.buffer.name))

        C.post_order_visit(func.body, visit)
        if written:
            res = schedule_prim_func(func, target, {}, name)
            assert res is not None and res.template == family, name
            return res.func, written[0]
    raise AssertionError("no kernel with an exp")


def _row_store_lanes(d: int, lanes: int) -> set:
    """Lanes of the stores of a row-reduction kernel's elementwise pass over rows of ``d``: full vectors in
    the main loop and the row's last ``d % lanes`` elements as one vector of that many lanes (issue 11:
    reduction._vectorize_pass; a tail of 1 element is one scalar store)."""
    return {lanes, d % lanes} - {0}


@pytest.mark.parametrize("tname", list(NAMED_TARGETS))
@pytest.mark.parametrize("kwargs,fusion", [(dict(rows=23, d=96, decomposed=False), False),
                                           (dict(rows=7, d=3072, decomposed=False), False),
                                           (dict(rows=23, d=104), True),
                                           (dict(rows=7, d=3071, decomposed=False), False),
                                           (dict(rows=7, d=65, decomposed=False), False)],
                         ids=["softmax-op-96", "softmax-op-3072", "decomposed-fused-104", "softmax-op-3071",
                              "softmax-op-65"])
def test_softmax_uses_nonpositive_exp_and_stays_vectorized(kwargs, fusion, tname):
    """The softmax kernel's exp(x - rowmax) gets fast math's cheaper exp (its argument is proved <= 0 from
    the max reduction, also after rfactor and over a row cut into a vector main part and a scalar tail:
    3071, 65), its division by the row sum becomes one reciprocal per row and
    multiplies, and the exp row buffer and the output are still stored a full vector of the target at a
    time (a row the vector does not divide: full vectors and one vector of the rest)."""
    from tvmfuse import fastmath as F

    target = named_target(tname)
    lanes = cpu_info(target).float32_lanes
    func, exp_buf = _softmax_kernel(M.softmax(**kwargs), target, fusion)
    stats = {}
    new, _ = F.rewrite(func, stats)
    # every exp takes the cheaper variant (a row with a scalar tail has two copies of the exp)
    exps = []
    C.post_order_visit(func.body, lambda e: exps.append(e) if isinstance(e, C.Call) and
                       str(getattr(e.op, "name", "")) == "tirx.exp" else None)
    assert stats["nonpositive_exp"] == len(exps) >= 1, (stats, len(exps))
    # one reciprocal per row in the scale pass's main loop, and in its tail where that is a vector too
    assert stats["reciprocal_stores"] == (2 if kwargs["d"] % lanes > 1 else 1), stats
    got = _store_lanes(new, target)
    want = _row_store_lanes(kwargs["d"], lanes)
    out = str(func.params[-1].name)
    assert got.get(out) == want, f"output stores of {got.get(out)} lanes, want {want}"
    if exp_buf in got:          # a row buffer (kept when the exp is read by the sum and the division)
        assert got[exp_buf] == want, f"exp row buffer stores of {got[exp_buf]} lanes, want {want}"


# Partial-sum lanes of the row max and sum by row length and vector lanes (AVX-512 16, AVX2 8, NEON 4): the
# widest of 1, 2 or 4 whole, half or quarter vectors up to 2 vectors (the target table's max_rf_vectors)
# that divides the row, else 2 full vectors over the main part; 1000 takes 2 full vectors with a tail
# vector (32 on AVX-512, 16 on AVX2) rather than one 8-lane chain (reduction.default_rf_width).
PARTIAL_SUM_LANES = {65: {16: 32, 8: 16, 4: 8}, 97: {16: 32, 8: 16, 4: 8}, 104: {16: 8, 8: 8, 4: 8},
                     1000: {16: 32, 8: 16, 4: 8}, 3071: {16: 32, 8: 16, 4: 8}}


@pytest.mark.parametrize("lanes,row_len,want,rule", [
    (16, 1000, 32, "tail"), (8, 1000, 16, "tail"),   # one 8-lane chain of 125 steps -> 2 vectors + a tail
    (16, 1008, 16, None), (16, 3072, 32, None), (16, 768, 32, None), (8, 768, 16, None),  # a full-vector width divides
    (16, 104, 8, None), (16, 200, 8, None),   # short rows: a wider width would not cut the steps (write-back)
    (4, 1000, 8, None),                       # NEON: 2 vectors divide 1000
    (4, 500, 8, "tail")])                     # 500: 2 vectors + a tail
def test_default_partial_sum_width(lanes, row_len, want, rule):
    """The row-reduction default partial-sum width: the table's max_rf_vectors (2) vectors when they divide
    the row; else those vectors with one tail vector where that cuts the dependent steps by the table's
    rf_tail_gain (1000 floats on AVX2: 16 lanes, 137 us kernel-only against 167 for 5 x 8 lanes and 143 for
    rows padded to 1008, notes/coord14.md); else several vectors of a narrower dividing width where that
    cuts them by rf_chain_gain (which the tail rule, tried first, now leaves for short rows and tuning).  A table
    asking more of the tail rule keeps the plain or chain width (1000 floats: 5 x 8 lanes, as before)."""
    from tvmfuse.schedules.cpu.reduction import (default_rf_width, full_vector_tail_widths, rf_chain_widths,
                                                 rf_tail_widths)
    from tvmfuse.target import template_defaults

    widths = tuple(sorted(set(rf_chain_widths(lanes, row_len) or rf_tail_widths(lanes, row_len)) |
                          set(full_vector_tail_widths(lanes, row_len))))
    d = template_defaults(named_target(next(iter(NAMED_TARGETS))), "cpu.row_reduction")
    gain, tail_gain = float(d["rf_chain_gain"]), float(d["rf_tail_gain"])
    assert default_rf_width(widths, lanes, 2 * lanes, row_len, gain, tail_gain) == want
    plain = default_rf_width(widths, lanes, 2 * lanes, row_len, float("inf"), float("inf"))
    assert (want != plain) == (rule is not None)
    if rule == "tail":      # taken for its gain: a table asking more keeps the plain (or the chain) width
        assert want in full_vector_tail_widths(lanes, row_len)
        gained = (row_len // plain + plain) / (row_len // want + 1 + want)
        assert gained >= tail_gain
        assert default_rf_width(widths, lanes, 2 * lanes, row_len, float("inf"), 1.01 * gained) == plain
        chain = default_rf_width(widths, lanes, 2 * lanes, row_len, gain, 1.01 * gained)
        assert chain == {(16, 1000): 40, (8, 1000): 40, (4, 500): 20}[(lanes, row_len)]


@pytest.mark.parametrize("tname", list(NAMED_TARGETS))
@pytest.mark.parametrize("d", [65, 97, 104, 1000, 3071])
def test_softmax_rows_not_a_multiple_of_the_vector_keep_full_vectors(d, tname):
    """Rows of 65 (a ViT's softmax over 65 keys), 97, 104, 1000 and 3071 floats (none a multiple of 16;
    65, 97 and 3071 of no vector width): the elementwise passes store full vectors of the target in their
    main loop and finish the row with one vector of its last d % lanes elements; the row max and sum run on
    vector partial sums, of a width that divides the row when one does (whole, half or quarter vectors:
    104 = 13 x 8, 1000 = 125 x 8), else of full vectors over the row's first d - d % width elements and one
    vector of the last d % width lanes into the same partial sums before their write-back (issue 11: no
    scalar reduction tail); over long rows at least two vectors of them (PARTIAL_SUM_LANES)."""
    from tvmfuse.schedules.cpu.reduction import rf_tail_widths, rf_widths

    target = named_target(tname)
    lanes = cpu_info(target).float32_lanes
    func, exp_buf = _softmax_kernel(M.softmax(rows=5, d=d, decomposed=False), target, fusion=False)
    got = _store_lanes(func, target)
    want = _row_store_lanes(d, lanes)
    out = str(func.params[-1].name)
    assert got[out] == want, f"{out}: stores of {got[out]} lanes, want {want}"
    widths = rf_widths(lanes, d) or rf_tail_widths(lanes, d)
    width = PARTIAL_SUM_LANES[d][lanes]
    allocated = [str(b.name) for b in func.body.block.alloc_buffers]
    if width >= lanes:
        # the exp goes into the output row (normalized there in place): no row buffer, no workspace per row
        assert exp_buf not in got and exp_buf not in allocated, f"a row buffer is left: {allocated}"
    else:
        # partial sums narrower than the exp pass's vector stores (104 = 13 x 8 on 16 lanes) read the row
        # buffer, not the output row just stored (2x slower there, bench_cpu --tails): it stays, full vectors
        assert got[exp_buf] == want, f"exp row buffer stores of {got[exp_buf]} lanes, want {want}"
    partial = {b: v for b, v in got.items() if b.endswith(".rf")}
    # the row's last d % width elements: one vector of that many lanes into the partial sums (no scalar chain)
    assert len(partial) == 2 and all(v == {width, d % width} - {0} for v in partial.values()), \
        f"partial sums {partial}, want {width} lanes and a tail vector of {d % width} (candidates {widths})"
    if not rf_widths(lanes, d):
        assert width % lanes == 0, f"a row no width divides gets partial sums of full vectors, not {width}"
    # at least two vectors of partial sums (independent chains) where the row is long (issue 11: rows of
    # 1000 on one 8-lane chain of 125 steps were 1.2x slower than rows of 1008 on 16 lanes)
    if d >= 1000:
        assert width >= 2 * min(lanes, 8), f"{width} lanes of partial sums over rows of {d}: one chain"
    # no scalar loop left: the elementwise passes' tails are one vector each (a tail of 1: one store)
    tail = _scalar_tail_extents(func)
    assert tail == {d % lanes} & {1}, f"scalar tails of {tail} iterations"


def _row_reduction_kernel(model, target):
    """The scheduled row-reduction kernel of ``model`` (tvmfuse's graph stage; exactly one)."""
    mod = tvmfuse.load_onnx(model)
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions()))(mod)
    found = []
    for gv, func in mod.functions.items():
        if isinstance(func, C.PrimFunc):
            res = schedule_prim_func(func, target, {}, str(gv.name_hint))
            if res is not None and res.template == "cpu.row_reduction":
                found.append(res.func)
    assert len(found) == 1, f"{len(found)} row-reduction kernels"
    return found[0]


@pytest.mark.parametrize("tname", ["haswell-2", "skx-2"])
@pytest.mark.parametrize("builder,kwargs", [("layernorm", dict(rows=6, decomposed=False)), ("layernorm", dict(rows=6)),
                                            ("rmsnorm", dict(rows=6)), ("softmax", dict(rows=6))],
                         ids=["layernorm-op", "layernorm-fused", "rmsnorm-fused", "softmax-fused"])
@pytest.mark.parametrize("d", [17, 65, 97, 3071])
def test_row_reductions_no_width_divides_use_vector_partial_sums(builder, kwargs, d, tname):
    """LayerNorm, RMSNorm and fused decomposed Softmax over rows no partial-sum width divides (65, 97,
    3071): the reductions that run on vector partial sums over a row of 96 do so here too (formerly they
    ran scalar), on full vectors over the row's first d - d % width elements and one vector of the rest
    folded into the partial sums (no scalar reduction tail)."""
    from tvmfuse.schedules.cpu.reduction import rf_tail_widths

    target = named_target(tname)
    lanes = cpu_info(target).float32_lanes
    width = max(w for w in rf_tail_widths(lanes, d) if w <= 2 * lanes)   # max_rf_vectors: 2
    func = _row_reduction_kernel(getattr(M, builder)(d=d, **kwargs), target)
    got = _store_lanes(func, target)
    partial = {b: v for b, v in got.items() if b.endswith(".rf")}
    dividing = {b for b in _store_lanes(_row_reduction_kernel(getattr(M, builder)(d=96, **kwargs), target),
                                        target) if b.endswith(".rf")}
    assert len(partial) == len(dividing) >= 1, (partial, dividing)
    assert all(v == {width, d % width} - {0} for v in partial.values()), \
        f"partial sums {partial}, want {width} lanes and a tail vector of {d % width}"
    assert _scalar_tail_extents(func) == {d % lanes} & {1}      # elementwise tails: one vector each


@pytest.mark.parametrize("builder,kwargs", [("layernorm", dict(rows=6, decomposed=False)), ("rmsnorm", dict(rows=6)),
                                            ("softmax", dict(rows=6)), ("mean_variance", dict(rows=6))],
                         ids=["layernorm-op", "rmsnorm-fused", "softmax-fused", "mean-variance"])
@pytest.mark.parametrize("d", [7, 17, 65, 97, 3071])
def test_row_reductions_with_a_tail_numerics(builder, kwargs, d, host, rng):
    """The same kernels on this host against the unfused reference (main part and tail both reduced; 7 and
    17: a main part of a single partial-sum step)."""
    model = getattr(M, builder)(d=d, **kwargs)
    assert_close_to_reference(model, tvmfuse.compile(model, host), rng, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("tname", list(NAMED_TARGETS))
@pytest.mark.parametrize("builder,kwargs", [("elementwise_chain", dict(n=4099)),
                                            ("elementwise_chain", dict(n=65)), ("elementwise_chain", dict(n=97)),
                                            ("elementwise_chain", dict(n=1000)), ("elementwise_chain", dict(n=3071)),
                                            ("layernorm", dict(rows=37, d=101, decomposed=False)),
                                            ("layernorm", dict(rows=5, d=65, decomposed=False)),
                                            ("rmsnorm", dict(rows=37, d=101)), ("rmsnorm", dict(rows=5, d=3071))])
def test_elementwise_and_norm_tails_keep_full_vectors(builder, kwargs, tname):
    """Elementwise kernels and normalization passes over lengths no vector width divides (4099 elements,
    rows of 101): every output is stored in full vectors of the target's lanes (times the template's
    vector_mult) in the main loop, plus scalars for the tail; never a partial, lane-by-lane vector."""
    target = named_target(tname)
    for name, func in _fused_prim_funcs(getattr(M, builder)(**kwargs), target).items():
        res = schedule_prim_func(func, target, {}, name)
        assert res is not None and res.template in ("cpu.elementwise", "cpu.row_reduction"), name
        width = res.config["lanes"] * res.config.get("vector_mult", 1)
        got = _store_lanes(res.func, target)
        out = func.params[-1]
        # the vectorized loop: all elements fused (elementwise), or the row (row reduction)
        length = _numel(func)[-1] if res.template == "cpu.elementwise" else int(out.shape[-1])
        # a row reduction's passes end the row with one vector of the rest, an elementwise kernel in scalars
        want = _row_store_lanes(length, width) if res.template == "cpu.row_reduction" else \
            ({width} if length % width == 0 else {width, 1})
        assert got[str(out.name)] == want, f"{name} ({res.template}): stores of {got[str(out.name)]} lanes"


@pytest.mark.parametrize("d", [65, 97, 104, 1000, 3071])
def test_softmax_rows_not_a_multiple_of_the_vector_numerics(d, host, rng):
    """The same softmax rows on this host against float64 numpy (the vector main loop and the scalar tail
    both computed right, every row summing to 1)."""
    rows = 5
    cm = tvmfuse.compile(M.softmax(rows=rows, d=d, decomposed=False), host, fusion=False)
    x = (rng.standard_normal((rows, d)) * 4).astype(np.float32)
    y = cm.run({cm.inputs[0].name: x})["y"].astype(np.float64)
    e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(axis=1, keepdims=True), rtol=2e-5, atol=1e-9)
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-5)


def _scalar_tail_extents(func) -> set:
    """Extents of the serial loops that hold a store and no other loop (the scalar tails), after the
    schedule (loop_partition makes them loops starting past 0)."""
    out = set()

    def visit(s):
        if isinstance(s, C.tirx.For) and int(s.kind) == int(C.ForKind.SERIAL) and int(s.min) > 0:
            inner = []
            C.post_order_visit(s.body, lambda n: inner.append(n) if isinstance(n, C.tirx.For) else None)
            if not inner:
                out.add(int(s.extent))

    C.post_order_visit(func.body, visit)
    return out


def test_exp_not_proved_nonpositive_keeps_full_variant():
    """Decomposed softmax without fusion: the max is another kernel, its result a parameter of the exp
    kernel, so nothing proves x - max <= 0 there: the full exp (overflow to inf, subnormals) stays."""
    from tvmfuse import fastmath as F

    func, _ = _softmax_kernel(M.softmax(rows=23, d=101), named_target("haswell-2"), fusion=False,
                              family="cpu.elementwise")
    stats = {}
    _, count = F.rewrite(func, stats)
    assert count >= 1 and stats["nonpositive_exp"] == 0, stats


@pytest.mark.parametrize("rows,d", [(7, 3072), (5, 37), (3, 200), (4, 104), (5, 1000), (7, 3071)])
def test_softmax_numerics_masked_and_large_inputs(rows, d, host, rng):
    """Softmax (cheaper exp, reciprocal of the row sum) against float64 numpy on odd shapes, with -inf
    entries (masks: exactly 0 out), large magnitudes and tiny differences; rows sum to 1."""
    model = M.softmax(rows=rows, d=d, decomposed=False)
    cm = tvmfuse.compile(model, host, fusion=False)
    x = (rng.standard_normal((rows, d)) * 30).astype(np.float32)
    x[0, ::3] = -np.inf
    x[1, :] = 3.0e38
    x[1, 5] = -3.0e38
    x[2, :] = np.float32(1e-30) * np.arange(d, dtype=np.float32)
    name = cm.inputs[0].name
    y = cm.run({name: x})["y"].astype(np.float64)
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=1, keepdims=True))
    want = e / e.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-9)
    assert (y[0, ::3] == 0).all()
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-5)
