"""``cpu.scan``: TVM's extern cumsum kernel (ONNX CumSum: RoBERTa's position ids ``cumsum(ids != pad)``, OPT's
positions from its attention mask; corpus ``roberta``, ``opt_dyn``, benchmarks/notes/corpus11.md).  Its one
block has no iterators and no root block, so every family and the generic schedule refused it ("Cannot find a
block with the name: root") and it ran unscheduled; ``cpu.scan`` rewrites its row loop.

Structure on named targets (AVX2, AVX-512, Zen 3, aarch64 NEON): the kernel gets cpu.scan; a scan whose work
is under the target's fork/join cost has no parallel loop, one over it a parallel row loop; over symbolic
extents the kernel holds a serial and a parallel nest under a branch on rows x length; each lowers.  Numerics:
whole models vs onnxruntime (last axis, a middle axis, exclusive + reverse, float), static and symbolic
(batch 1 and 3), and each knob value vs the unscheduled kernel.  Must not fire: kernels with blocks."""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.models import _G
from tvmfuse.schedules.base import find_template, schedule_with
from tvmfuse.schedules.cpu import TEMPLATES
from tvmfuse.schedules.cpu.common import min_parallel_work
from tvmfuse.schedules.cpu.scan import Scan, scan_nest

import schedule_cases as S

ZNVER3 = '{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver3", "num-cores": 2}'
NEON = '{"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72", "num-cores": 2}'
TARGETS = (S.HASWELL, S.SKYLAKE, ZNVER3, NEON)
TARGET_IDS = ["haswell", "skx", "znver3", "neon"]


def position_ids(shape=(1, 32), axis=-1, exclusive=0, reverse=0, dtype=TensorProto.INT64):
    """RoBERTa's position ids: ``cumsum(ids != 1, axis) * (ids != 1) + 1`` (the Equal/Not/Cast prologue and
    the Mul/Add epilogue are kernels of their own; the scan is one)."""
    g = _G("position_ids")
    x = g.input("ids", list(shape), dtype)
    if dtype == TensorProto.FLOAT:
        g.op("CumSum", x, g.const(np.array(axis, np.int64)), exclusive=exclusive, reverse=reverse)
        return S.finish(g)
    ne = g.op("Cast", g.op("Not", g.op("Equal", x, g.const(np.array(1, np.int64)))), to=TensorProto.INT32)
    cs = g.op("CumSum", ne, g.const(np.array(axis, np.int64)), exclusive=exclusive, reverse=reverse)
    g.op("Add", g.op("Mul", cs, ne), g.const(np.array(1, np.int32)))
    return S.finish(g)


def _scan_func(model, target):
    tgt = tvmfuse.parse_target(target) if isinstance(target, str) else target
    funcs = S.graph_funcs(model, tgt)
    scans = [f for f in funcs.values() if scan_nest(f) is not None]
    assert len(scans) == 1, f"expected one scan kernel among {sorted(funcs)}"
    return scans[0], tgt, funcs


def _kinds(func) -> list[int]:
    return [int(f.kind) for f in S.loops(func)]


def _feeds(model, rng, dims=None):
    inp = model.graph.input[0]
    shape = [dims[d.dim_param] if d.dim_param else d.dim_value for d in inp.type.tensor_type.shape.dim]
    if inp.type.tensor_type.elem_type == TensorProto.FLOAT:
        return {inp.name: rng.standard_normal(shape).astype(np.float32)}
    return {inp.name: rng.integers(0, 4, shape).astype(np.int64)}


def _check_model(model, rng, dims_list=(None,)):
    cm = tvmfuse.compile(model)
    used = {s["kernel"]: s.get("template") for s in cm.report.schedules}
    assert "cpu.scan" in used.values(), used
    assert not [k for k, t in used.items() if t in ("unscheduled", "fallback", "cpu.generic")], used
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for dims in dims_list:
        feeds = _feeds(model, rng, dims)
        got = cm.run(feeds)
        got = next(iter(got.values())) if isinstance(got, dict) else got
        want = sess.run(None, feeds)[0]
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_a_small_scan_gets_cpu_scan_and_runs_serial(target):
    func, tgt, _ = _scan_func(position_ids((1, 32)), target)
    found = find_template(func, tgt, TEMPLATES)        # the first family that matches
    assert found is not None and found[0].family == "cpu.scan"
    t = Scan()
    match = t.match(func, tgt)
    assert match.info["work"] == 32 < min_parallel_work(tgt)
    config = t.default_config(match, tgt)
    assert config == {"parallel": False}
    sched = schedule_with(t, match, func, config)
    assert int(C.ForKind.PARALLEL) in _kinds(func)           # TVM's kernel forks for 32 additions
    assert int(C.ForKind.PARALLEL) not in _kinds(sched)
    C.lower_tir(C.IRModule({"main": sched.with_attr("global_symbol", "main")}), tgt)


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_a_large_scan_keeps_its_parallel_row_loop(target):
    tgt = tvmfuse.parse_target(target)
    length = 512
    rows = min_parallel_work(tgt) // length + 2            # work over the target's fork/join cost
    func, tgt, _ = _scan_func(position_ids((rows, length)), tgt)
    t = Scan()
    match = t.match(func, tgt)
    assert (match.info["rows"], match.info["length"]) == (rows, length)
    config = t.default_config(match, tgt)
    assert config == {"parallel": True}
    sched = schedule_with(t, match, func, config)
    assert _kinds(sched).count(int(C.ForKind.PARALLEL)) == 1
    C.lower_tir(C.IRModule({"main": sched.with_attr("global_symbol", "main")}), tgt)


@pytest.mark.parametrize("target", (S.SKYLAKE, NEON), ids=["skx", "neon"])
def test_a_symbolic_scan_branches_between_a_serial_and_a_parallel_nest(target):
    model = S.symbolic_dims(position_ids((1, 32)))
    func, tgt, _ = _scan_func(model, target)
    t = Scan()
    match = t.match(func, tgt)
    assert match.info["work"] == -1 and match.info["serial_up_to"] == min_parallel_work(tgt) - 1
    sched = schedule_with(t, match, func, t.default_config(match, tgt))
    branches = [n for n in S.nodes(sched) if isinstance(n, C.tirx.IfThenElse)]
    assert len(branches) == 1
    kinds = _kinds(sched)
    assert kinds.count(int(C.ForKind.PARALLEL)) == 1 and kinds.count(int(C.ForKind.SERIAL)) == 3
    C.lower_tir(C.IRModule({"main": sched.with_attr("global_symbol", "main")}), tgt)
    serial = schedule_with(t, match, func, {"parallel": False})
    assert int(C.ForKind.PARALLEL) not in _kinds(serial)


@pytest.mark.parametrize("parallel", [False, True])
def test_each_knob_value_matches_the_unscheduled_kernel(parallel, host, rng):
    func, tgt, _ = _scan_func(position_ids((3, 45)), host)
    t = Scan()
    match = t.match(func, tgt)
    args = S.random_args(func, rng)
    want = S.run_func(func, tgt, args)[0]
    got = S.run_func(schedule_with(t, match, func, {"parallel": parallel}), tgt, args)[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape,axis,exclusive,reverse,dtype", [
    ((1, 32), 1, 0, 0, TensorProto.INT64),
    ((2, 9, 5), 1, 0, 0, TensorProto.INT64),                # a middle axis: rows = 2 x 5, stride 5
    ((3, 17), -1, 1, 1, TensorProto.INT64),                 # exclusive, reversed
    ((4, 33), 1, 0, 0, TensorProto.FLOAT),
], ids=["roberta", "middle_axis", "exclusive_reverse", "float"])
def test_models_with_a_scan_match_onnxruntime(shape, axis, exclusive, reverse, dtype, rng):
    _check_model(position_ids(shape, axis, exclusive, reverse, dtype), rng)


def test_a_symbolic_model_with_a_scan_matches_onnxruntime(rng):
    model = S.symbolic_dims(position_ids((1, 32)))
    _check_model(model, rng, dims_list=({"batch": 1, "sequence": 17}, {"batch": 3, "sequence": 40}))


def test_kernels_with_blocks_are_not_scans(host):
    _, tgt, funcs = _scan_func(position_ids((1, 32)), host)
    others = [f for f in funcs.values() if scan_nest(f) is None]
    assert len(others) == 2                                  # the prologue and the epilogue kernels
    assert all(Scan().match(f, tgt) is None for f in others)
    func = next(iter(S.graph_funcs(S.matmul_3d(), tgt).values()))
    assert Scan().match(func, tgt) is None
