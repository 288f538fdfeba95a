"""Typed configs of the CPU families (matmul, siblings, symbolic matmul, symbolic rows, elementwise, row
reduction, norm + matmul, conv2d, depthwise conv2d, generic).

Each family declares a frozen ``Config`` dataclass: its knob space is derived from the fields (in field
order), its untuned default is one point of that space built from the *target* (``cpu_info``) and the
family's ``template_defaults`` row of schedules/cpu_targets.json (editing the table changes the default),
the schedule record keeps the config as a JSON dict, and a dict naming other knobs is a clear error.
Numerics of these templates under these configs: test_schedules_cpu*.py, test_symbolic_matmul.py.
"""
import json

import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse import target as TG
from tvmfuse.explain import Recorder
from tvmfuse.schedules import schedule_prim_func, templates_for
from tvmfuse.schedules.base import Config
from tvmfuse.schedules.cpu import generic as G

import schedule_cases as S

TARGETS = {"haswell": S.HASWELL, "skylake": S.SKYLAKE}


def _mlp_symbolic_rows():
    """relu(x @ W + b) over x [rows, 64] (rows symbolic): cpu.symbolic_matmul."""
    g = M._G("mlp_sym")
    x = g.input("x", ("rows", 64))
    g.op("Relu", g.op("Add", g.op("MatMul", x, g.weight((64, 32))), g.weight((32,), 0.1)))
    g.rename_last("y", ("rows", 32))
    return g.model()


def _softmax_symbolic_rows():
    """softmax over [rows, seq] (both symbolic): cpu.symbolic_rows."""
    g = M._G("softmax_sym")
    g.op("Softmax", g.input("x", ("rows", "seq")), axis=-1)
    g.rename_last("y", ("rows", "seq"))
    return g.model()


def _qkv_symbolic_rows():
    """q, k, v = x @ W_s + b_s over x [batch, seq, 64] (rows symbolic): cpu.symbolic_siblings."""
    g = M._G("qkv_sym")
    x = g.input("x", ("batch", "seq", 64))
    for name in ("q", "k", "v"):
        g.op("Add", g.op("MatMul", x, g.weight((64, 64))), g.weight((64,), 0.1))
        g.rename_last(name, ("batch", "seq", 64))
    return g.model()


def _scores_symbolic():
    """q @ k per (batch, head), N = sequence (both symbolic): cpu.symbolic_batch_matmul."""
    g = M._G("scores_sym")
    g.op("MatMul", g.input("q", ("batch", 4, "seq", 16)), g.input("k", ("batch", 4, 16, "seq")))
    g.rename_last("y", ("batch", 4, "seq", "seq"))
    return g.model()


# family -> a model one of whose fused kernels the family matches
CASES = {
    "cpu.matmul_epilogue": lambda: S.matmul_3d(k=48),
    "cpu.sibling_matmuls": lambda: S.qkv_3d(),
    "cpu.symbolic_matmul": _mlp_symbolic_rows,
    "cpu.symbolic_siblings": _qkv_symbolic_rows,
    "cpu.symbolic_batch_matmul": _scores_symbolic,
    "cpu.symbolic_rows": _softmax_symbolic_rows,
    "cpu.elementwise": lambda: M.elementwise_chain(n=4096),
    "cpu.row_reduction": lambda: M.layernorm(rows=512, d=96),   # over the fork/join cost: parallel
    "cpu.norm_matmul": lambda: M.norm_matmul(norm="layernorm", rows=21, d=64, n=24),
    "cpu.symbolic_norm_matmul": lambda: S.symbolic_dims(M.norm_matmul(norm="rmsnorm", rows=8, d=64, n=64, batch=2)),
    "cpu.conv2d_epilogue": lambda: S.conv(s=2),
    "cpu.depthwise_conv2d_epilogue": lambda: S.conv(cin=8, cout=8, group=8),
}


def _matched(family: str, target):
    template = {t.family: t for t in templates_for(target)}[family]
    for func in S.graph_funcs(CASES[family](), target).values():
        match = template.match(func, target)
        if match is not None:
            return template, match, func
    raise AssertionError(f"{family}: no kernel of its case model matches")


@pytest.mark.parametrize("tname", list(TARGETS))
@pytest.mark.parametrize("family", list(CASES))
def test_default_is_a_typed_point_of_the_space(family, tname):
    target = C.Target(TARGETS[tname])
    template, match, func = _matched(family, target)
    cfg_type = template.config_type
    assert cfg_type is not None and issubclass(cfg_type, Config)
    space = template.space(match, target)
    assert space.names == cfg_type.knob_names()
    default = template.default_config(match, target)
    assert space.contains(default), (default, space.to_dict())
    assert cfg_type.from_dict(default).asdict() == default
    json.dumps(default)                                       # records keep it as JSON data
    if "lanes" in default:
        assert default["lanes"] in (TG.cpu_info(target).float32_lanes, TG.cpu_info(target).float32_lanes // 2)
    with pytest.raises(ValueError, match="does not name the knobs"):
        cfg_type.from_dict({k: v for k, v in default.items() if k != space.names[0]})
    with pytest.raises(ValueError, match="does not name the knobs"):
        cfg_type.from_dict({**default, "bogus": 1})


@pytest.mark.parametrize("family,key,value,knob,expected", [
    ("cpu.matmul_epilogue", "order", "ij", "order", "ij"),
    ("cpu.matmul_epilogue", "k_unroll", 8, "k_unroll", 8),
    ("cpu.sibling_matmuls", "k_unroll", 8, "k_unroll", 8),
    ("cpu.symbolic_matmul", "order", "ji", "order", "ji"),
    ("cpu.symbolic_siblings", "k_unroll", 8, "k_unroll", 8),
    ("cpu.symbolic_rows", "vector_mult", 2, "vector_mult", 2),
    ("cpu.symbolic_batch_matmul", "mr", 6, "mr", 6),
    ("cpu.symbolic_batch_matmul", "tile_floats", 8, "nvec", 1),           # haswell: 8 lanes
    ("cpu.symbolic_batch_matmul", "k_unroll", 2, "k_unroll", 2),
    ("cpu.elementwise", "unroll", 4, "unroll", 4),
    ("cpu.elementwise", "vector_mult", 2, "vector_mult", 2),
    ("cpu.row_reduction", "unroll", 2, "unroll", 2),
    ("cpu.row_reduction", "max_rf_vectors", 1, "rf_width", 8),          # haswell: 8 lanes
    ("cpu.row_reduction", "min_rows_per_core", 10 ** 6, "parallel", False),
    ("cpu.norm_matmul", "k_unroll", 8, "k_unroll", 8),
    ("cpu.norm_matmul", "pad_n", False, "pad_n", False),
    ("cpu.norm_matmul", "max_rf_vectors", 1, "rf_width", 8),
])
def test_default_reads_the_target_table(family, key, value, knob, expected, monkeypatch):
    """Editing the family's template_defaults row changes the default (nothing is hard-wired)."""
    target = C.Target(S.HASWELL)
    template, match, _ = _matched(family, target)
    before = template.default_config(match, target)
    assert before[knob] != expected
    table = json.loads(json.dumps(TG.cpu_table()))
    table["template_defaults"][family][key] = value
    monkeypatch.setattr(TG, "cpu_table", lambda: table)
    assert template.default_config(match, target)[knob] == expected


def test_sibling_row_blocks_per_core_from_the_table(monkeypatch):
    """Fewer row blocks wanted per core: the default keeps larger macro tiles (mc_tiles never smaller)."""
    target = C.Target(S.HASWELL)
    template, match, _ = _matched("cpu.sibling_matmuls", target)
    table = json.loads(json.dumps(TG.cpu_table()))
    many, few = dict(table), json.loads(json.dumps(table))
    many["template_defaults"]["cpu.sibling_matmuls"]["row_blocks_per_core"] = 64
    few["template_defaults"]["cpu.sibling_matmuls"]["row_blocks_per_core"] = 1
    monkeypatch.setattr(TG, "cpu_table", lambda: many)
    mc_many = template.default_config(match, target)["mc_tiles"]
    monkeypatch.setattr(TG, "cpu_table", lambda: few)
    mc_few = template.default_config(match, target)["mc_tiles"]
    assert mc_few >= mc_many and min(template.space(match, target).to_dict()["mc_tiles"]) == mc_many


def test_schedule_records_keep_the_typed_config():
    """A compiled model's schedule records: each template kernel's knobs are its family's typed config as
    data; a kernel the fallback gives the generic schedule records the target's GenericConfig (and what it
    did per block)."""
    from tvmfuse import schedules as SCH

    target = C.Target(S.HASWELL)
    by_family = {t.family: t.config_type for t in templates_for(target)}
    records = tvmfuse.compile(S.matmul_3d(), target=target).report.schedules
    typed = [r for r in records if by_family.get(r["template"]) is not None]
    assert "cpu.matmul_epilogue" in {r["template"] for r in typed}, records
    for r in typed:
        assert by_family[r["template"]].from_dict(r["knobs"]).asdict() == r["knobs"]
    (name, func), = S.graph_funcs(S.maxpool(c=8, h=20, w=20), target).items()
    with target, Recorder() as rec:
        C.Sequential(SCH.fallback_passes(target))(C.IRModule({name: func}))
    (r,) = rec.schedules
    assert r["template"] == G.FAMILY, r
    assert {k: v for k, v in r["knobs"].items() if k != "blocks"} == G.GenericConfig.for_target(target).asdict()
    assert r["knobs"]["blocks"], r


def test_schedule_prim_func_applies_the_default_of_the_typed_config():
    target = C.Target(S.SKYLAKE)
    template, match, func = _matched("cpu.matmul_epilogue", target)
    res = schedule_prim_func(func, target)
    assert res.template == "cpu.matmul_epilogue" and res.source == "default"
    assert res.config == template.default_config(match, target)
