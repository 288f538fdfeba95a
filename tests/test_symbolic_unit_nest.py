"""The unit nest (``schedules.buckets.unit_nest`` / ``join_unit``): a kernel over symbolic extents whose nest
at the smallest sizes allocates buffers of run-time size or divides indices by a symbolic extent also holds a
copy of that nest with every shape variable 1, run when the shapes are all 1 (``cpu.generic``,
``cpu.elementwise``, ``cpu.symbolic_batch_matmul``; ``unit_nest`` in schedules/cpu_targets.json).  And each
size bucket's nest holds its own buffers in a block of its own (``join_buckets``), so lowering allocates them
inside that nest's branch or merges them across the branches, not once per nest at the kernel's entry.

deberta_v2_dyn at b1 s1 (notes/unit24.md): its masked softmax and mask kernels (cpu.generic) 0.29 -> 0.10 us
a call, the Q/K/V head copies 0.20 -> 0.05, the relative-position kernel 0.29 -> 0.15, the batched matmuls
0.13 / 0.12 / 0.07 -> 0.08 / 0.08 / 0.02.  Structure on named targets, numbers against the ONNX reference at
the unit size and at sizes that take the other nests.
"""
from __future__ import annotations

import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.buckets import join_unit, shape_vars, symbolic_division, symbolic_workspace, unit_nest
from tvmfuse.schedules.cpu import generic as G
from tvmfuse.schedules.cpu.elementwise import Elementwise

import schedule_cases as S
from conftest import named_target
from test_schedules_cpu_accumulators import workspace_buffers
from test_symbolic import _symbolic_kernels


def _channel_softmax_funcs(target):
    """Softmax over the channels of [batch, 8, 8, 8] (cpu.generic; tests/test_schedules_cpu_generic.py): its
    max, exp and sum over [batch, 8, 8] are buffers of run-time size."""
    return S.graph_funcs(S.symbolic_dims(S.softmax_channels(n=2, c=8, h=8, w=8), names=("batch",)), target)


def _heads_merge():
    """[batch, 4, sequence, 16] flattened per batch, a ReLU, unflattened, heads moved behind the sequence and
    merged to [batch, sequence, 64]: the unflatten's index divides by the sequence (cpu.elementwise)."""
    g = M._G("heads_merge_sym")
    x = g.input("x", ("batch", 4, "sequence", 16))
    flat = g.op("Relu", g.op("Reshape", x, g.const(np.array([0, -1], dtype=np.int64))))
    y = g.op("Reshape", flat, g.const(np.array([0, 4, -1, 16], dtype=np.int64)))
    y = g.op("Transpose", y, perm=[0, 2, 1, 3])
    g.op("Reshape", y, g.const(np.array([0, 0, 64], dtype=np.int64)))
    g.rename_last("y", ("batch", "sequence", 64))
    return g.model()


def _loops(stmt) -> list:
    out = []
    C.post_order_visit(stmt, lambda n: out.append(n) if isinstance(n, C.tirx.For) else None)
    return out


def _alloc_buffers(stmt) -> list:
    out = []
    C.post_order_visit(stmt, lambda n: out.extend(n.alloc_buffers) if isinstance(n, C.SBlock) else None)
    return out


@pytest.mark.parametrize("target", ["haswell-2", "skx-2", "neon-4"])
def test_generic_kernel_gets_a_static_unit_nest(target):
    """The channel softmax on cpu.generic: the kernel's first branch tests every shape variable at 1 and holds
    a nest of static loops and static buffers; the other nests keep the symbolic extents, each nest's
    buffers allocated by a block inside its own branch.  Built, the kernel makes fewer run-time workspace
    allocations than the nests have buffers of run-time size (each was made at entry before)."""
    tgt = named_target(target)
    (name, func), = _channel_softmax_funcs(tgt).items()
    scheduled, report = G.schedule_generic(func, tgt)
    assert all(r.get("unit_nest") for r in report.values()), report
    top = scheduled.body.block.body
    assert isinstance(top, C.tirx.IfThenElse), top
    assert [str(v.name) for v in shape_vars(scheduled)] == ["batch"]
    assert isinstance(top.condition, C.tirx.LE) and int(top.condition.b) == 0, top.condition
    unit = top.then_case
    assert _loops(unit) and all(isinstance(lp.extent, C.IntImm) for lp in _loops(unit))
    bufs = _alloc_buffers(unit)
    assert bufs and all(isinstance(d, C.IntImm) for b in bufs for d in b.shape), [b.shape for b in bufs]
    assert not scheduled.body.block.alloc_buffers          # the root holds none: each nest's block does
    rest = top.else_case
    symbolic = [b for b in _alloc_buffers(rest) if not all(isinstance(d, C.IntImm) for d in b.shape)]
    assert symbolic and any(not isinstance(lp.extent, C.IntImm) for lp in _loops(rest))
    sizes = [n for bufs in workspace_buffers(scheduled, tgt).values() for _, n in bufs]
    assert len(sizes) < len(symbolic), (sizes, len(symbolic))


def test_generic_unit_nest_numbers(host, rng):
    """The scheduled kernel computes what the unscheduled one computes at batch 1 (the unit nest), 2 (the
    serial nest) and 9 (the parallel one)."""
    (name, func), = _channel_softmax_funcs(host).items()
    scheduled, report = G.schedule_generic(func, host)
    built = {k: C.build_prim_module(C.IRModule({"main": f.with_attr("global_symbol", "main")}), host)["main"]
             for k, f in (("ref", func), ("got", scheduled))}
    bufs = [p for p in func.params if hasattr(p, "shape")]

    def concrete(buf, batch):
        return [int(d) if isinstance(d, C.tirx.IntImm) else batch for d in buf.shape]

    for batch in (1, 2, 9):
        ins = [rng.standard_normal(concrete(b, batch)).astype(str(b.dtype)) for b in bufs[:-1]]
        outs = {}
        for k, f in built.items():
            out = C.tensor(np.zeros(concrete(bufs[-1], batch), str(bufs[-1].dtype)))
            f(*[C.tensor(a) for a in ins], out)
            outs[k] = out.numpy()
        np.testing.assert_allclose(outs["got"], outs["ref"], rtol=1e-5, atol=1e-6, err_msg=f"batch {batch}")


def test_unit_nest_must_not_fire_without_cost_or_shape_variables(host):
    """A static kernel has no shape variables (join_unit leaves it as it is); an elementwise kernel over
    symbolic extents without a buffer of run-time size or a symbolic division does not get one."""
    g = M._G("static_exp")
    g.op("Exp", g.input("x", (2, 8)))
    g.rename_last("y", (2, 8))
    from test_symbolic_batch_matmul import _kernels

    (_, static), = _kernels(g.model(), host).items()
    assert shape_vars(static) == [] and join_unit(static, unit_nest(static)) is static
    g = M._G("plain_exp_sym")
    g.op("Exp", g.input("x", ("batch", "sequence", 16)))
    g.rename_last("y", ("batch", "sequence", 16))
    (kname, func), = _symbolic_kernels(g.model(), host).items()
    res = schedule_prim_func(func, host, {}, kname)
    assert res.template == "cpu.elementwise"
    assert not symbolic_workspace(res.func) and not symbolic_division(func)
    t = Elementwise()
    assert not t.wants_unit_nest(t.match(func, host), host, func, res.func)
    assert "sequence - T.int64(1)" not in res.func.script()


@pytest.mark.parametrize("target", ["haswell-2", "neon-4"])
def test_elementwise_head_merge_gets_a_unit_nest(target):
    """The head merge divides its index by the sequence: the elementwise kernel gets the unit nest, whose
    loops are static and whose indices divide by no symbolic value."""
    tgt = named_target(target)
    kernels = _symbolic_kernels(_heads_merge(), tgt)
    scheduled = [schedule_prim_func(f, tgt, {}, k) for k, f in kernels.items()]
    with_div = [(f, s) for f, s in zip(kernels.values(), scheduled) if symbolic_division(f)]
    assert with_div and all(s.template == "cpu.elementwise" for _, s in with_div), \
        [(s.template, s.func.script()[:300]) for s in scheduled]
    for _, s in with_div:
        top = s.func.body.block.body
        assert isinstance(top, C.tirx.IfThenElse) and "sequence - T.int64(1)" in str(top.condition)
        assert all(isinstance(lp.extent, C.IntImm) for lp in _loops(top.then_case))
        assert symbolic_division(s.func.with_body(top.else_case))
        assert not symbolic_division(s.func.with_body(top.then_case))


@pytest.mark.parametrize("make", [_heads_merge])
def test_unit_nest_numbers_at_one_and_past_it(make, host, rng):
    """One compiled model gives the reference's numbers at the unit size (batch 1, sequence 1) and at sizes
    where only one of the variables is 1 or neither (the other nests)."""
    model = make()
    cm = tvmfuse.compile(model, target=host)
    name = model.graph.input[0].name
    dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    for b, s in ((1, 1), (1, 5), (3, 1), (2, 7)):
        shape = [{"batch": b, "sequence": s}.get(d, d) for d in dims]
        feeds = {name: rng.standard_normal(shape).astype(np.float32)}
        ref = M.reference_outputs(model, feeds)
        np.testing.assert_allclose(cm.run(feeds)["y"], ref["y"], rtol=1e-5, atol=1e-6, err_msg=str((b, s)))
