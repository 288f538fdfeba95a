"""``cpu.elementwise`` declines a kernel whose chain, folded into its outputs, computes more than the table's
``max_folded_ops`` operations per element (schedules/cpu_targets.json): deberta_v2_dyn's relative-position
kernel (a log bucket read by several wheres and gathers) folded to ~10^4 operations per element and TVM's TIR
lowering ran for over 20 minutes on it (benchmarks/notes/corpus11.md); the generic schedule keeps the repeated
producers in memory and lowers it in seconds.

The case: a chain in which every step reads the previous one three times (``y_{i+1} = y_i * y_i + y_i``), so
folding triples the expression per step.  Structure on named targets: 7 steps (~4400 operations folded) are
declined and the compiled kernel is on cpu.generic; 2 steps (~20) stay cpu.elementwise (must not fire); raising the
table's limit takes the deep chain back (nothing hard-wired).  Numerics: the deep chain vs onnxruntime."""
import json

import numpy as np
import onnxruntime as ort
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import target as TG
from tvmfuse.models import _G
from tvmfuse.schedules.cpu import common as U
from tvmfuse.schedules.cpu.elementwise import Elementwise

import schedule_cases as S

ZNVER3 = '{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver3", "num-cores": 2}'
NEON = '{"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72", "num-cores": 2}'
TARGETS = (S.HASWELL, S.SKYLAKE, ZNVER3, NEON)
TARGET_IDS = ["haswell", "skx", "znver3", "neon"]


def tripling_chain(steps: int, shape=(3, 40)):
    """x -> tanh -> ``steps`` x (y * y + y) -> *0.5: every step reads its input three times."""
    g = _G("tripling_chain")
    y = g.op("Tanh", g.input("x", list(shape)))
    for _ in range(steps):
        y = g.op("Add", g.op("Mul", y, y), y)
    g.op("Mul", y, g.const(np.float32(0.5)))
    return S.finish(g)


def _kernel(model, target):
    tgt = tvmfuse.parse_target(target) if isinstance(target, str) else target
    funcs = S.graph_funcs(model, tgt)
    assert len(funcs) == 1, sorted(funcs)             # the whole chain is one fused kernel
    return next(iter(funcs.values())), tgt


def _folded_ops(func) -> int:
    sch = C.Schedule(func)
    left = U.inline_elementwise(sch)
    return max(U.count_ops(U.store_value(sch, sch.get_sblock(b))) for b in left)


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_a_chain_that_folds_past_the_limit_is_declined(target):
    func, tgt = _kernel(tripling_chain(7), target)
    limit = TG.template_defaults(tgt, "cpu.elementwise")["max_folded_ops"]
    assert _folded_ops(func) > limit
    assert Elementwise().match(func, tgt) is None


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_a_short_chain_stays_elementwise(target):
    func, tgt = _kernel(tripling_chain(2), target)
    assert _folded_ops(func) <= TG.template_defaults(tgt, "cpu.elementwise")["max_folded_ops"]
    assert Elementwise().match(func, tgt) is not None


def test_the_limit_comes_from_the_table(monkeypatch):
    func, tgt = _kernel(tripling_chain(7), S.HASWELL)
    table = json.loads(json.dumps(TG.cpu_table()))
    table["template_defaults"]["cpu.elementwise"]["max_folded_ops"] = 10 ** 6
    monkeypatch.setattr(TG, "cpu_table", lambda: table)
    assert Elementwise().match(func, tgt) is not None


def test_the_declined_chain_compiles_on_the_generic_schedule_and_matches_onnxruntime(rng):
    model = tripling_chain(7)
    cm = tvmfuse.compile(model)
    used = [s.get("template") for s in cm.report.schedules]
    assert used == ["cpu.generic"], used
    x = rng.uniform(-0.5, 0.5, (3, 40)).astype(np.float32)
    got = cm.run({"x": x})
    got = np.asarray(next(iter(got.values())) if isinstance(got, dict) else got)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
