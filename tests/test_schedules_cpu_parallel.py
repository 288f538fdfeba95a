"""The shared parallel decision of the CPU families (``common.parallel_why_not``, issue 12): a kernel whose
work is under the target's fork/join cost (``template_defaults["cpu.parallel"]["fork_join_work_per_core"]``
x cores, schedules/cpu_targets.json) has no parallel loop at all; a big one has one; the choice is the
``parallel`` knob of the family's config; a serial kernel computes what the unscheduled one does."""
import json

import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import target as TG
from tvmfuse.models import _G
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.cpu.common import PARALLEL_FAMILY, min_parallel_work

import schedule_cases as S

HASWELL_2 = S.HASWELL
SKYLAKE_32 = '{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512", "num-cores": 32}'


def _elementwise(shape):
    g = _G("elementwise")
    g.op("Relu", g.op("Add", g.input("a", shape), g.input("b", shape)))
    return S.finish(g)


def _softmax(rows, cols):
    g = _G("softmax")
    g.op("Softmax", g.input("x", [rows, cols]), axis=-1)
    return S.finish(g)


def _depthwise(c, hw):
    return S.conv(cin=c, cout=c, h=hw, w=hw, group=c)


# family, the tiny kernel (serial on every named target), the big one (parallel on every named target), and
# one in between (parallel on 2 cores, serial on 32: the cost scales with the cores)
CASES = {
    "cpu.depthwise_conv2d_epilogue": (_depthwise(336, 2), _depthwise(64, 56), _depthwise(32, 14)),
    "cpu.conv2d_lanes": (S.conv(cin=8, cout=16, h=4, w=4), S.conv(cin=64, cout=64, h=15, w=15),
                         S.conv(cin=16, cout=32, h=8, w=8)),
    "cpu.conv2d_epilogue": (S.conv(cin=3, cout=4, h=8, w=8), S.conv(cin=16, cout=32, h=32, w=32),
                            S.conv(cin=4, cout=8, h=16, w=16)),
    "cpu.window_pool": (S.maxpool(c=4, h=8, w=8), S.maxpool(c=64, h=112, w=112), S.maxpool(c=16, h=32, w=32)),
    "cpu.elementwise": (_elementwise([1, 4, 8, 8]), _elementwise([1, 64, 128, 128]), _elementwise([1, 16, 64, 64])),
    "cpu.row_reduction": (_softmax(8, 64), _softmax(1024, 1024), _softmax(128, 512)),
    "cpu.matmul_epilogue": (S.matmul_3d(b=1, s=4, k=16, n=32), S.matmul_3d(b=4, s=128, k=256, n=256),
                            S.matmul_3d(b=2, s=37, k=45, n=67)),
}


def _kernel(model, target):
    funcs = S.graph_funcs(model, target)
    assert len(funcs) == 1, list(funcs)
    (name, func), = funcs.items()
    return name, func


def _parallel_loops(func) -> int:
    return sum(int(f.kind) == int(C.ForKind.PARALLEL) for f in S.loops(func))


@pytest.mark.parametrize("family", sorted(CASES))
@pytest.mark.parametrize("target", [HASWELL_2, SKYLAKE_32], ids=["haswell-2", "skylake-avx512-32"])
def test_parallel_loop_only_over_the_fork_join_cost(family, target):
    tgt = tvmfuse.parse_target(target)
    tiny, big, mid = CASES[family]
    cores = TG.cpu_info(tgt).cores
    for size, model, wanted in (("tiny", tiny, False), ("big", big, True), ("mid", mid, cores == 2)):
        name, func = _kernel(model, tgt)
        res = schedule_prim_func(func, tgt, {}, name)
        assert res.template == family, f"{size}: {res.template}"
        assert res.config["parallel"] is wanted, f"{size} on {cores} cores: {res.config}"
        n = _parallel_loops(res.func)
        assert (n > 0) is wanted, f"{size} on {cores} cores: {n} parallel loops ({res.config})"
        assert S.vector_lanes(res.func), f"{size}: no vectorized loop"


def test_the_cost_comes_from_the_target_table(monkeypatch):
    """Raising the table's fork/join cost above the big depthwise conv's work makes it serial; a CPU row may
    override it (per target)."""
    tgt = tvmfuse.parse_target(HASWELL_2)
    assert min_parallel_work(tgt) == 2 * TG.cpu_table()["template_defaults"][PARALLEL_FAMILY][
        "fork_join_work_per_core"]
    name, func = _kernel(CASES["cpu.depthwise_conv2d_epilogue"][1], tgt)
    assert _parallel_loops(schedule_prim_func(func, tgt, {}, name).func) > 0
    table = json.loads(json.dumps(TG.cpu_table()))
    table["cpus"]["haswell"]["template_defaults"] = {PARALLEL_FAMILY: {"fork_join_work_per_core": 1 << 30}}
    monkeypatch.setattr(TG, "cpu_table", lambda: table)
    res = schedule_prim_func(func, tgt, {}, name)
    assert res.config["parallel"] is False and _parallel_loops(res.func) == 0
    assert min_parallel_work(tvmfuse.parse_target(S.SKYLAKE)) == \
        2 * table["template_defaults"][PARALLEL_FAMILY]["fork_join_work_per_core"]


@pytest.mark.parametrize("family", sorted(CASES))
def test_serial_kernel_numerics(family, host, rng):
    """The tiny (serial) kernel on the host computes what the unscheduled kernel computes, on fresh inputs."""
    tgt = tvmfuse.parse_target(host)
    name, func = _kernel(CASES[family][0], tgt)
    res = schedule_prim_func(func, tgt, {}, name)
    assert res.template == family and _parallel_loops(res.func) == 0, res.config
    args = S.random_args(func, rng)
    got = S.run_func(res.func, tgt, args)[0]
    want = S.run_func(func, tgt, args)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
