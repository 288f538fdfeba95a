"""Kernels of the corpus models (corpus/) that a template refused or broke on, each reduced to a small
model: structure on named targets, numerics on the host against onnx's reference on fresh random inputs."""
from __future__ import annotations

import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.explain import Recorder
from tvmfuse.pipeline import PipelineOptions, graph_stage
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.target import cpu_info

from conftest import NAMED_TARGETS, assert_close_to_reference, named_target


def _prim_funcs(model, target, fusion=True):
    mod = tvmfuse.load_onnx(model)
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions(fusion=fusion)))(mod)
    return {str(gv.name_hint): f for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)}


def _loop_kinds(func) -> list[int]:
    kinds = []
    C.post_order_visit(func.body, lambda s: kinds.append(int(s.kind)) if isinstance(s, C.tirx.For) else None)
    return kinds


# ---- row reductions whose row is exactly one rfactor width (resnet18's global mean over 2x2, softmax over
# 16 or 32 keys, LayerNorm over 8): the unit outer reduction loop disappeared under compute_at and the
# template's reorder failed ("ScheduleError ... 'reorder'"), leaving the kernel to dlight's fallback ----

ROW_IS_ONE_WIDTH = [
    ("softmax", dict(rows=23, d=16)),
    ("softmax", dict(rows=23, d=32)),
    ("layernorm", dict(rows=5, d=8)),
    ("mean_variance", dict(rows=7, d=4)),
]


@pytest.mark.parametrize("tname", list(NAMED_TARGETS))
@pytest.mark.parametrize("builder,kwargs", ROW_IS_ONE_WIDTH, ids=[f"{b}-{k['d']}" for b, k in ROW_IS_ONE_WIDTH])
def test_row_of_one_rfactor_width_keeps_vector_partial_sums(builder, kwargs, tname):
    target = named_target(tname)
    seen = False
    for name, func in _prim_funcs(getattr(M, builder)(**kwargs), target).items():
        res = schedule_prim_func(func, target, {}, name)
        assert res is not None and res.template == "cpu.row_reduction", name
        if not res.config["vectorize_reductions"]:
            continue
        if res.config["rf_width"] == kwargs["d"]:
            seen = True
        assert int(C.ForKind.VECTORIZED) in _loop_kinds(res.func), f"{name}: no vectorized loop"
        assert res.config["lanes"] == cpu_info(target).float32_lanes
    if kwargs["d"] <= cpu_info(target).float32_lanes:
        assert seen, f"no kernel took rf_width == the row ({kwargs['d']}) on {tname}"


@pytest.mark.parametrize("builder,kwargs", ROW_IS_ONE_WIDTH, ids=[f"{b}-{k['d']}" for b, k in ROW_IS_ONE_WIDTH])
def test_row_of_one_rfactor_width_numerics(builder, kwargs, host, rng):
    model = getattr(M, builder)(**kwargs)
    with Recorder() as rec:
        cm = tvmfuse.compile(model, host)
    sources = {s["kernel"]: s["source"] for s in rec.schedules}
    assert "fallback" not in sources.values() and "generic" not in sources.values(), rec.schedules
    assert_close_to_reference(model, cm, rng, rtol=1e-4, atol=1e-5)
