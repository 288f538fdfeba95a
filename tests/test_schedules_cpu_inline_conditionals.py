"""``common.inline_elementwise`` keeps a producer apart rather than nest more than ``MAX_CONDITIONAL_DEPTH``
conditionals on one path of a consumer's expression (``common.nests_conditionals``).

Why: each ``where`` reads its input two or three times, so folding a chain of them copies the chain into
every read, and TVM's TIR simplifier re-simplifies a conditional's operands under its condition at a cost
that grows steeply with the nesting: t5_encoder_dyn's relative-position bucket kernel took 62-185 s to
lower (0.3 s with the limit; tests/test_symbolic_token_models.py compiles it).  Numbers: same as the
unscheduled kernel on fresh random inputs.  Structure: on named targets, no block nests more than the
limit, and a chain within the limit still folds into one block (must not fire)."""
import numpy as np
import onnx
import pytest

from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.schedules.cpu import common as U
from tvmfuse.schedules.cpu import generic as G

import schedule_cases as S

SHAPE = (5, 37)


def _where_chain(levels: int) -> onnx.ModelProto:
    """``levels`` nested where's over x (abs, then clamps), plus x: the last one's result reads x."""
    g = M._G(f"where_chain{levels}")
    x = g.input("x", SHAPE)
    v = g.op("Where", g.op("Less", x, g.const(np.float32(0.0))), g.op("Neg", x), x)
    for k in range(1, levels):
        c = g.const(np.float32(0.5 * k))
        v = g.op("Where", g.op("Greater", v, c), g.op("Sub", v, c), g.op("Mul", v, g.const(np.float32(2.0))))
    g.op("Add", v, x)
    g.rename_last("y", SHAPE)
    return g.model()


def _blocks(func) -> list:
    out = []
    C.post_order_visit(func.body, lambda n: out.append(n) if isinstance(n, C.SBlock)
                       and str(n.name_hint) != "root" else None)
    return out


def _depths(func) -> dict:
    return {str(b.name_hint): U.conditional_depth(b.body.value) for b in _blocks(func)
            if isinstance(b.body, C.BufferStore)}


def test_conditional_depth_counts_one_path():
    x = C.tirx.Var("x", "float32")
    zero = C.tirx.FloatImm("float32", 0.0)
    inner = C.tirx.Select(x < zero, -x, x)
    assert U.conditional_depth(x + zero) == 0
    assert U.conditional_depth(inner) == 1
    assert U.conditional_depth(C.tirx.Select(inner < zero, inner, x) + inner) == 2


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
def test_deep_where_chain_is_kept_apart(target):
    from tvmfuse import parse_target

    tgt = parse_target(target)
    funcs = S.graph_funcs(_where_chain(4), tgt)
    assert len(funcs) == 1
    for name, func in funcs.items():
        scheduled, report = G.schedule_generic(func, tgt)
        depths = _depths(scheduled)
        assert max(depths.values()) <= U.MAX_CONDITIONAL_DEPTH, (depths, report)
        assert len(depths) >= 2, (depths, report)     # a producer kept as its own block


@pytest.mark.parametrize("target", S.NAMED_TARGETS, ids=["haswell", "skylake"])
def test_shallow_where_chain_still_folds(target):
    """Within the limit (two nested where's): one block, as before the limit (must not fire)."""
    from tvmfuse import parse_target

    tgt = parse_target(target)
    for name, func in S.graph_funcs(_where_chain(2), tgt).items():
        scheduled, report = G.schedule_generic(func, tgt)
        depths = _depths(scheduled)
        assert len(depths) == 1 and max(depths.values()) == 2, (depths, report)


@pytest.mark.parametrize("levels", [2, 4, 6])
def test_where_chain_numbers_match_unscheduled(levels, host, rng):
    for name, func in S.graph_funcs(_where_chain(levels), host).items():
        scheduled, report = G.schedule_generic(func, host)
        args = S.random_args(func, rng)
        np.testing.assert_allclose(S.run_func(scheduled, host, args)[0], S.run_func(func, host, args)[0],
                                   rtol=1e-6, atol=1e-6, err_msg=f"{name}: {report}")
