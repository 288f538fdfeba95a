"""``schedules.buckets.join_buckets``: each size bucket's nest gets its own intermediate buffers.

Nests scheduled from one PrimFunc share its intermediate buffers (a layer norm's row sums over
[batch, sequence]); joined under one root with those buffers shared, lowering had to keep each allocation at
the root, at the symbolic extent's size: a run-time workspace allocation per call (2 per layer norm of
bert_dyn, the row sums).  With a copy per nest each allocation goes inside its nest's row loop, compacted
to a row (a stack array).
"""
from __future__ import annotations

import pytest
from conftest import named_target
from test_schedules_cpu_accumulators import workspace_buffers
from test_symbolic import _check, _layer_norm, _symbolic_kernels

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.buckets import Bucket, join_buckets


def _accessed(stmt) -> list:
    """The buffers that stores under ``stmt`` write."""
    out = []

    def visit(n):
        if isinstance(n, C.BufferStore) and not any(n.buffer.same_as(b) for b in out):
            out.append(n.buffer)

    C.post_order_visit(stmt, visit)
    return out


@pytest.mark.parametrize("name", ["haswell-2", "skx-2"])
def test_bucketed_norm_keeps_no_run_time_sized_workspace(name):
    """A layer norm over [batch, sequence, 64] (cpu.row_reduction, one nest per batch-size bucket): no
    intermediate buffer is touched by two nests, and the built kernel allocates no workspace of a run-time
    size (each row sum is a row's stack array)."""
    target = named_target(name)
    (kname, func), = _symbolic_kernels(_layer_norm(), target).items()
    res = schedule_prim_func(func, target, {}, kname)
    assert res.template == "cpu.row_reduction" and len(res.config["buckets"]) == 2, res.config
    root = res.func.body.block
    nest_if = root.body
    assert isinstance(nest_if, C.tirx.IfThenElse), nest_if
    params = list(res.func.params)
    per_nest = [[b for b in _accessed(part) if not any(b.data.same_as(p) or b.same_as(p) for p in params)]
                for part in (nest_if.then_case, nest_if.else_case)]
    assert per_nest[0] and per_nest[1]
    assert not [b for b in per_nest[0] if any(b.same_as(c) for c in per_nest[1])], per_nest
    sizes = [n for bufs in workspace_buffers(res.func, target).values() for _, n in bufs]
    assert -1 not in sizes, sizes


def test_join_refuses_nests_of_other_parameters(host):
    """Nests that do not share the kernel's parameters are refused with the cause."""
    (_, a), = _symbolic_kernels(_layer_norm(), host).items()
    (_, b), = _symbolic_kernels(_layer_norm(hidden=32), host).items()
    with pytest.raises(ValueError, match="do not share the kernel's parameters"):
        join_buckets([a, b], [Bucket("rows<=4", 4), Bucket("rows>4", None)], a.params[0].shape[0])


@pytest.mark.parametrize("rows", [(1, 1), (3, 17), (40, 17)])
def test_bucketed_norm_matches_the_reference(rows, host, rng):
    """1, 51 and 680 rows (the serial and the parallel bucket on a 2-core table: 511 rows) with their own
    buffers give the reference's numbers."""
    model = _layer_norm()
    cm = tvmfuse.compile(model, target=host)
    assert cm.kernel_count == 1
    _check(model, cm, rng, {"x": (*rows, 64)})
