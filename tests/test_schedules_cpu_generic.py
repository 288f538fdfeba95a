"""The generic CPU schedule (tvmfuse/schedules/cpu/generic.py) and the fallback chain behind the templates
(tvmfuse/schedules/__init__.py: template -> dlight -> generic, never a kernel left with naive loops).

The generic schedule is applied directly to every kernel of small graphs of the ops real models hold and
no template is built around (pooling, global pooling, channel LayerNorm, mean over H,W, gather, layout
ops, Resize, softmax over channels, two conv anchors in one kernel): same numbers as the unscheduled
kernel on fresh random inputs; on named AVX2/AVX-512 targets, large enough kernels get a parallel outer
loop and vectorized inner loops, and nothing is unrolled."""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import schedules as SCH
from tvmfuse.explain import Recorder
from tvmfuse.report import schedule_source_counts
from tvmfuse.schedules.cpu import generic as G

import schedule_cases as S

# (builder, kwargs): small odd shapes (numerics)
SMALL = [
    ("maxpool", dict()), ("avgpool", dict()), ("global_avgpool", dict()), ("channel_layernorm", dict()),
    ("mean_hw", dict()), ("embedding", dict()), ("layout_ops", dict()), ("resize", dict()),
    ("softmax_channels", dict()), ("conv_with_shortcut_conv", dict()),
]
# (builder, kwargs, blocks that must be vectorized): sizes above GenericConfig.min_parallel_elements (structure)
LARGE = [
    ("maxpool", dict(c=32, h=56, w=56), {"pool_max"}),
    ("avgpool", dict(c=32, h=56, w=56), {"pool_sum", "pool_avg"}),
    ("channel_layernorm", dict(c=96, h=28, w=28), {"x_red", "x_red1"}),
    ("mean_hw", dict(n=2, c=64, h=28, w=28), set()),
    ("softmax_channels", dict(n=2, c=64, h=16, w=16), {"T_softmax_maxelem", "T_softmax_expsum"}),
    ("resize", dict(c=16, h=32, w=32), {"resize"}),
    ("conv_with_shortcut_conv", dict(cin=32, cout=64, h=28, w=28), {"conv2d_nchw"}),
]


def _funcs(builder, kwargs, target):
    return S.graph_funcs(getattr(S, builder)(**kwargs), target)


@pytest.mark.parametrize("builder,kwargs", SMALL, ids=[b for b, _ in SMALL])
def test_generic_numerics_vs_unscheduled(builder, kwargs, host, rng):
    for name, func in _funcs(builder, kwargs, host).items():
        scheduled, report = G.schedule_generic(func, host)
        args = S.random_args(func, rng)
        want = S.run_func(func, host, args)
        got = S.run_func(scheduled, host, args)
        for w, g in zip(want, got):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"{builder}/{name}: {report}")


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
@pytest.mark.parametrize("builder,kwargs,vector_blocks", LARGE, ids=[b for b, _, _ in LARGE])
def test_generic_structure_parallel_vectorized(builder, kwargs, vector_blocks, target):
    tgt = tvmfuse.parse_target(target)
    for name, func in _funcs(builder, kwargs, tgt).items():
        scheduled, report = G.schedule_generic(func, tgt)
        cfg = G.GenericConfig.for_target(tgt)
        kinds = S.kinds(scheduled)
        assert int(C.ForKind.PARALLEL) in kinds, f"{name}: no parallel loop: {report}"
        assert int(C.ForKind.UNROLLED) not in kinds, f"{name}: the generic schedule unrolls nothing"
        for block, done in report.items():
            assert "skipped" not in done, done
            # every block runs in a parallel loop of its own or inside its consumer's, or is too small
            assert done.get("parallel") or done.get("computed_at") or \
                done["elements"] < cfg.min_parallel_elements, f"{name}: {block} serial: {report}"
        missing = {b for b in vector_blocks if not report.get(b, {}).get("vector")}
        assert not missing, f"{name}: not vectorized: {missing}: {report}"


def test_vector_width_never_predicates():
    """The vector split divides the loop (or takes it whole when short): no predicated tail."""
    whole = 4
    for lanes in (8, 16):
        for ext in range(1, 300):
            w = G.vector_width(ext, lanes, whole)
            assert w == 0 or ext % w == 0, (ext, lanes, w)
            if ext <= whole * lanes and ext >= 2:
                assert w == ext
    assert G.vector_width(197, 16, whole) == 0          # a prime length: left to LLVM's loop vectorizer
    assert G.vector_width(200, 16, whole) == 8
    assert G.vector_width(64, 16, 1) == 16              # past whole_vectors vectors: split by the lanes


def test_generic_config_from_the_target_and_the_table():
    """The generic schedule's numbers: lanes and cores from the target, thresholds from cpu_targets.json."""
    from tvmfuse.target import template_defaults

    for target, lanes in ((S.NAMED_TARGETS[0], 8), (S.NAMED_TARGETS[1], 16)):
        tgt = tvmfuse.parse_target(target)
        cfg = G.GenericConfig.for_target(tgt)
        assert (cfg.lanes, cfg.cores) == (lanes, int(tgt.attrs["num-cores"]))
        assert {k: v for k, v in cfg.asdict().items() if k not in ("lanes", "cores")} == \
            template_defaults(tgt, G.FAMILY)


def test_integer_shift_left_alone(host):
    """Shifts (undefined in LLVM at >= the bit width) are not transformed (see common.has_shift)."""
    from onnx import TensorProto

    g = S._G("shift")
    g.op("BitShift", g.input("x", [64], TensorProto.UINT8), g.input("s", [64], TensorProto.UINT8),
         direction="LEFT")
    (name, func), = S.graph_funcs(S.finish(g), host).items()
    scheduled, report = G.schedule_generic(func, host)
    assert all("integer shift" in r.get("skipped", "") for r in report.values()), report
    assert C.structural_equal(scheduled.body, func.body)


def _fallback_module(builder, kwargs, target):
    funcs = _funcs(builder, kwargs, target)
    return C.IRModule({name: f for name, f in funcs.items()}), funcs


@pytest.mark.parametrize("builder,kwargs", [("layout_ops", dict()), ("maxpool", dict(c=32, h=56, w=56)),
                                            ("conv_with_shortcut_conv", dict())])
def test_fallback_chain_leaves_nothing_unscheduled(builder, kwargs, host, rng):
    """The fallback passes alone (no template): every kernel comes out scheduled, by dlight or by the
    generic schedule, with one record each; the numbers are the unscheduled kernels'."""
    mod, funcs = _fallback_module(builder, kwargs, host)
    with Recorder() as rec:
        out = C.Sequential(SCH.fallback_passes(host))(mod)
    assert len(rec.schedules) == len(funcs), rec.schedules
    for gv, f in out.functions.items():
        assert "tirx.is_scheduled" in f.attrs, gv.name_hint
    assert {s["source"] for s in rec.schedules} <= {"fallback", "generic"}
    assert all(s["template"] in ("fallback", G.FAMILY) for s in rec.schedules)
    for gv, f in out.functions.items():
        args = S.random_args(funcs[str(gv.name_hint)], rng)
        for w, g in zip(S.run_func(funcs[str(gv.name_hint)], host, args), S.run_func(f, host, args)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_dlight_failure_goes_to_generic(host, monkeypatch):
    """A dlight rule that raises (as its CPU Reduction does on some kernels) is answered by the generic
    schedule, and the record says why: never 'unscheduled'."""
    class Broken:
        def apply(self, func, target, tunable):
            raise C.ScheduleError("compute-at refused (test)")

        def is_target_available(self, target):
            return True

    monkeypatch.setattr(SCH, "_dlight_rules", lambda target: [Broken()])
    mod, funcs = _fallback_module("maxpool", dict(), host)
    with Recorder() as rec:
        out = C.Sequential(SCH.fallback_passes(host))(mod)
    assert [s["template"] for s in rec.schedules] == [G.FAMILY] * len(funcs)
    assert all("dlight failed" in s["reason"] for s in rec.schedules), rec.schedules
    assert all("tirx.is_scheduled" in f.attrs for f in out.functions.values())


def test_compile_counts_schedule_sources(host):
    """The report counts kernels per schedule source; a model of template kernels has no fallback."""
    model = S.matmul_3d()
    cm = tvmfuse.compile(model, host)
    counts = cm.report.to_dict()["schedule_sources"]
    assert counts == {"template": 1, "tuned": 0, "fallback (dlight)": 0, "generic": 0, "unscheduled": 0}, counts
    assert "schedules: template 1, tuned 0, fallback (dlight) 0, generic 0, unscheduled 0" in cm.report.table()
    assert schedule_source_counts([{"source": "generic"}, {"source": "fallback"}, {"source": "default"},
                                   {"source": "generic"}]) == \
        {"template": 1, "tuned": 0, "fallback (dlight)": 1, "generic": 2, "unscheduled": 0}


def test_generic_failure_is_recorded_not_hidden(host, monkeypatch):
    """Should the generic schedule itself fail (a bug), the kernel keeps its correct naive loops and the
    record and the report's counts say 'unscheduled' with the error."""
    def broken(func, target):
        raise RuntimeError("generic bug (test)")

    monkeypatch.setattr(G, "schedule_generic", broken)
    monkeypatch.setattr(SCH, "_dlight_rules", lambda target: [])
    mod, funcs = _fallback_module("maxpool", dict(), host)
    with Recorder() as rec:
        C.Sequential(SCH.fallback_passes(host))(mod)
    assert [s["template"] for s in rec.schedules] == ["unscheduled"] * len(funcs)
    assert all("generic bug (test)" in s["reason"] for s in rec.schedules)
    assert schedule_source_counts(rec.schedules)["unscheduled"] == len(funcs)


def _concrete(buf, sizes: dict) -> list[int]:
    return [int(d) if isinstance(d, C.tirx.IntImm) else sizes[str(d)] for d in buf.shape]


@pytest.fixture(scope="module")
def symbolic_softmax_funcs(host):
    """Softmax over channels with a symbolic batch (8 x 8 x 8 = 512 elements per image): the serial nest up to
    7 images (GenericConfig.min_parallel_elements = 4096 on every target table), the parallel one above."""
    model = S.symbolic_dims(S.softmax_channels(n=2, c=8, h=8, w=8), names=("batch",))
    return S.graph_funcs(model, host)


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
def test_generic_symbolic_extents_get_a_parallel_nest(symbolic_softmax_funcs, target):
    """Symbolic extents (issue 13: t5_encoder_dyn's relative-position bias ran serial at every sequence): two
    nests under a branch on the output's element count, the serial one up to min_parallel_elements - 1, the
    other with a parallel loop over the symbolic rows (run-time trip count: reported as -1), nothing
    unrolled."""
    tgt = tvmfuse.parse_target(target)
    cfg = G.GenericConfig.for_target(tgt)
    for name, func in symbolic_softmax_funcs.items():
        scheduled, report = G.schedule_generic(func, tgt)
        ifs = []
        C.post_order_visit(scheduled.body, lambda n: ifs.append(n) if isinstance(n, C.tirx.IfThenElse) else None)
        assert any(isinstance(i.condition, C.tirx.LE) and isinstance(i.condition.b, C.tirx.IntImm)
                   and int(i.condition.b) == cfg.min_parallel_elements - 1 for i in ifs), f"{name}: no size branch"
        kinds = S.kinds(scheduled)
        assert int(C.ForKind.PARALLEL) in kinds and int(C.ForKind.UNROLLED) not in kinds, report
        assert any(d.get("parallel") == -1 for d in report.values()), report
        assert all(d["serial_up_to_elements"] == cfg.min_parallel_elements - 1 for d in report.values()), report


def test_generic_symbolic_nests_match_unscheduled(symbolic_softmax_funcs, host, rng):
    """Both nests (1 image: serial; 9 images: parallel) compute what the unscheduled kernel computes."""
    for name, func in symbolic_softmax_funcs.items():
        scheduled, report = G.schedule_generic(func, host)
        built = {k: C.build_prim_module(C.IRModule({"main": f.with_attr("global_symbol", "main")}), host)["main"]
                 for k, f in (("ref", func), ("got", scheduled))}
        bufs = [p for p in func.params if hasattr(p, "shape")]
        for batch in (1, 9):
            ins = [rng.standard_normal(_concrete(b, {"batch": batch})).astype(str(b.dtype)) for b in bufs[:-1]]
            outs = {}
            for k, f in built.items():
                out = C.tensor(np.zeros(_concrete(bufs[-1], {"batch": batch}), str(bufs[-1].dtype)))
                f(*[C.tensor(a) for a in ins], out)
                outs[k] = out.numpy()
            np.testing.assert_allclose(outs["got"], outs["ref"], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name} at batch {batch}: {report}")


def test_generic_keeps_a_producer_that_folding_would_recompute(host, rng):
    """A log over [16, 16] added to a [2, 4, 16, 16] input (t5_encoder's relative-position bias, small): the
    log block is not folded into the add (it would run 8 times per element, once per batch and head) nor
    computed inside the add's parallel loop; one log per element of [16, 16], same numbers as unscheduled."""
    from tvmfuse import models as M

    g = M._G("broadcast_log")
    a, x = g.input("a", (16, 16)), g.input("x", (2, 4, 16, 16))
    lg = g.op("Log", g.op("Add", g.op("Abs", a), g.const(np.float32(1.0))))
    g.op("Add", x, g.op("Mul", lg, g.const(np.float32(3.0))))
    g.rename_last("y", (2, 4, 16, 16))
    for name, func in S.graph_funcs(g.model(), host).items():
        scheduled, report = G.schedule_generic(func, host)
        logs, log_blocks = [], []

        def visit(n):
            if isinstance(n, C.Call) and getattr(n.op, "name", "") == "tirx.log":
                logs.append(n)
            if isinstance(n, C.SBlock):
                inner = []
                C.post_order_visit(n.body, lambda m: inner.append(m) if isinstance(m, C.Call)
                                   and getattr(m.op, "name", "") == "tirx.log" else None)
                if inner and str(n.name_hint) != "root":
                    log_blocks.append(str(n.name_hint))

        C.post_order_visit(scheduled.body, visit)
        assert len(logs) == 1 and len(log_blocks) == 1, (log_blocks, report)
        assert not report[log_blocks[0]].get("computed_at"), report
        args = S.random_args(func, rng)
        np.testing.assert_allclose(S.run_func(scheduled, host, args)[0], S.run_func(func, host, args)[0],
                                   rtol=1e-5, atol=1e-5, err_msg=f"{name}: {report}")


def test_gather_read_once_per_element_is_still_folded(host, rng):
    """``generic._reread`` must not fire on a gather its consumer reads once per element: an embedding
    lookup ``table[ids]`` [6, 8] added to x [6, 8] (2 consumer loop variables for 2 axes) stays folded into the
    add (one block writes [6, 8]: the gather is not a block of its own), with the same numbers as unscheduled.  (It fires on T5's per-diagonal table:
    test_passes_relpos.py::test_bias_rows_are_contiguous_slices_of_the_diagonal_table.)"""
    from tvmfuse import models as M

    g = M._G("embedding_add")
    import onnx

    from conftest import named_target

    ids, x = g.input("ids", (6,), dtype=onnx.TensorProto.INT64), g.input("x", (6, 8))   # ids in [0, 5)
    g.op("Add", x, g.op("Gather", g.weight((16, 8), scale=1.0), ids, axis=0))
    g.rename_last("y", (6, 8))
    for target in (named_target("skx-2"), host):
        for name, func in S.graph_funcs(g.model(), target).items():
            scheduled, report = G.schedule_generic(func, target)
            rows = []            # blocks writing a [6, 8] buffer (the index's where(ids < 0, ...) is [6])
            C.post_order_visit(scheduled.body, lambda n: rows.append(str(n.name_hint))
                               if isinstance(n, C.SBlock) and str(n.name_hint) != "root"
                               and [int(d) for d in n.writes[0].source.shape] == [6, 8] else None)
            assert len(rows) == 1, (rows, report)
            if target is host:
                args = S.random_args(func, rng)
                np.testing.assert_allclose(S.run_func(scheduled, host, args)[0], S.run_func(func, host, args)[0],
                                           rtol=1e-6, atol=1e-6, err_msg=f"{name}: {report}")
