"""``schedules.buckets.join_buckets``: each size bucket's nest binds loop variables of its own.

The nests joined in one kernel are schedules of one PrimFunc; a loop that no schedule transformed (the padding
block a conv template computes at the root, unsplit) kept the original variable in every nest: one variable
with a range per nest, which TVM's lowering refuses ("Trying to update var 'i0' with a different const
bound").  inception_v3_dyn (corpus) failed to compile on it: its 3x3 convs on 1x1 planes over a symbolic batch
(notes/visionsym13.md).  Structural: on named targets every loop of a bucketed kernel has its own variable and
the kernel lowers; numeric: the symbolic build of such a conv against onnx's reference at batch 1, 3, 8.
"""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.buckets import Bucket, join_buckets

import schedule_cases as S
from conftest import NAMED_TARGETS, named_target
from test_symbolic_conv import cnn_block

# inception_v3's shape: a 3x3 conv (pad 1) on a 1x1 plane, 56 -> 48 channels, BatchNorm + ReLU
ONE_PIXEL = dict(cin=56, cout=48, h=1, w=1, k=3, residual=False)


def _loop_vars(func):
    found = []
    C.post_order_visit(func.body, lambda n: found.append(n.loop_var) if isinstance(n, C.tirx.For) else None)
    return found


def _distinct(loop_vars) -> bool:
    return all(not a.same_as(b) for i, a in enumerate(loop_vars) for b in loop_vars[i + 1:])


def test_join_buckets_renames_the_loops_of_later_nests():
    """Two copies of one unscheduled func joined: without fresh variables both nests bind the same loop vars."""
    func = next(iter(S.graph_funcs(cnn_block("batch", **ONE_PIXEL), named_target("haswell-2")).values()))
    batch = func.params[0].shape[0]
    assert not _distinct(_loop_vars(func) + _loop_vars(func))           # the hazard: the same func twice
    joined = join_buckets([func, func], (Bucket("batch<=1", 1), Bucket("batch>1", None)), batch)
    loops = _loop_vars(joined)
    assert len(loops) == 2 * len(_loop_vars(func)) and _distinct(loops)
    assert [str(v.name) for v in loops] == [str(v.name) for v in _loop_vars(func)] * 2   # names kept


@pytest.mark.parametrize("tname", sorted(NAMED_TARGETS))
def test_bucketed_conv_on_a_one_pixel_plane_lowers(tname):
    target = named_target(tname)
    bucketed = 0
    for kname, func in S.graph_funcs(cnn_block("batch", **ONE_PIXEL), target).items():
        res = schedule_prim_func(func, target, {}, kname)
        assert res is not None, kname
        if "buckets" not in res.config:
            continue
        bucketed += 1
        assert _distinct(_loop_vars(res.func)), f"{kname} ({res.template}): a loop variable in two nests"
        C.lower_tir(C.IRModule({"main": res.func.with_attr("global_symbol", "main")}), target)
    if tname in ("haswell-2", "skx-2"):
        assert bucketed, f"{tname}: no batch buckets; the case no longer covers join_buckets"


def test_symbolic_conv_on_a_one_pixel_plane_numbers(host, rng):
    model = cnn_block("batch", **ONE_PIXEL)
    cm = tvmfuse.compile(model, target=host)
    assert cm.kernel_count == tvmfuse.compile(cnn_block(1, **ONE_PIXEL), target=host).kernel_count
    for batch in (1, 3, 8):
        feeds = {"x": rng.standard_normal((batch, 56, 1, 1)).astype(np.float32)}
        got, want = cm.run(feeds), M.reference_outputs(model, feeds)
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-4, atol=1e-4, err_msg=f"batch {batch}")
