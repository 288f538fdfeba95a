"""Symbolic kernels as lean as static ones (issue 13, gpt2_dyn / llama_dyn vs their pinned builds):
no index divided by a symbolic extent where the static build's simplifier removes the division
(``schedules/index_bounds.py``; ``common._symbolic_outer_static_inner``'s groups), no workspace allocation
per row of ``cpu.symbolic_rows`` (``symbolic._own_intermediates``), and sibling matmuls whose N is not a
multiple of the vector width (llama's SwiGLU, 172 columns) on ``cpu.symbolic_siblings`` with padded
columns instead of ``cpu.symbolic_rows``.  Structure on named targets, numbers vs the ONNX reference."""
import numpy as np
import pytest

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.index_bounds import drop_wrapless_modulo
from tvmfuse.target import parse_target

import schedule_cases as S
from conftest import NAMED_TARGETS
from test_schedules_cpu_accumulators import workspace_buffers

TARGETS = ["haswell-2", "skx-2"]


def _check(model, cm, rng, shapes, rtol=1e-4, atol=1e-4):
    feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    out, ref = cm.run(feeds), M.reference_outputs(model, feeds)
    for name, r in ref.items():
        np.testing.assert_allclose(out[name], r, rtol=rtol, atol=atol, err_msg=f"{name} at {shapes}")


def _symbolic_divisions(func) -> list[str]:
    """Every floordiv / floormod of the scheduled kernel whose divisor is not a constant."""
    found = []
    C.post_order_visit(func.body, lambda n: found.append(str(n)) if isinstance(n, (C.tirx.FloorDiv, C.tirx.FloorMod))
                       and not isinstance(n.b, C.IntImm) else None)
    return found


def _residual_norm(d=64):
    """h = x + r (an output: the residual stream), y = LayerNorm(h) reshaped to [rows, d] (gpt2's kernel:
    cpu.symbolic_rows, two outputs; the reshape reads h at [row // sequence % batch, row % sequence])."""
    g = M._G("residual_norm")
    x = g.input("x", ("batch", "sequence", d))
    r = g.input("r", ("batch", "sequence", d))
    g.op("Add", x, r)
    h = g.rename_last("h", ("batch", "sequence", d))
    y = g.op("LayerNormalization", h, g.weight((d,), 1.0), g.weight((d,), 0.1), axis=-1, epsilon=1e-5)
    g.op("Reshape", y, g.const(np.array([-1, d], dtype=np.int64)))
    g.rename_last("y", ("rows", d))
    return g.model()


def _heads(batch="batch", seq="sequence"):
    """One output [batch, 4, sequence, 16] (a rotary / head-split layout), scaled: cpu.elementwise with
    size buckets over batch x sequence."""
    g = M._G("heads")
    x = g.input("x", (batch, seq, 64))
    h = g.op("Reshape", x, g.const(np.array([0, 0, 4, 16], dtype=np.int64)))
    g.op("Mul", g.op("Transpose", h, perm=[0, 2, 1, 3]), g.const(np.array(0.5, dtype=np.float32)))
    g.rename_last("q", (batch, 4, seq, 16))
    return g.model()


# ----------------------------------------------------------------------------------- index_bounds
def test_wrapless_modulo_drops_only_what_it_proves():
    """(b * S + s) % (B * S) with b < B, s < S is b * S + s; (b * S + s + 1) % (B * S) may wrap and stays;
    (f // S) % B with f < B * S is f // S."""
    TS = C.script_tir

    @TS.prim_func(private=True, s_tir=True)
    def before(a: TS.handle, o1: TS.handle, o2: TS.handle):
        batch = TS.int64()
        sequence = TS.int64()
        A = TS.match_buffer(a, (batch * sequence + 1,), "float32")
        O1 = TS.match_buffer(o1, (batch, sequence), "float32")
        O2 = TS.match_buffer(o2, (batch, sequence), "float32")
        for f in range(batch * sequence):
            with TS.sblock("keep"):
                vf = TS.axis.spatial(batch * sequence, f)
                O1[vf // sequence % batch, vf % sequence] = A[(vf + 1) % (batch * sequence)]
            with TS.sblock("drop"):
                vb = TS.axis.spatial(batch, f // sequence % batch)
                vs = TS.axis.spatial(sequence, f % sequence)
                O2[vb, vs] = A[(vb * sequence + vs) % (batch * sequence)]

    after = drop_wrapless_modulo(before)
    text = after.script()
    assert "(vf + T.int64(1)) % (batch * sequence)" in text           # may wrap: kept
    assert "(vb * sequence + vs) % (batch * sequence)" not in text and "vb * sequence + vs]" in text
    assert "f // sequence % batch" not in text and "vf // sequence % batch" not in text
    # nothing to prove: the same function back
    assert drop_wrapless_modulo(after).same_as(after)


def test_flat_index_splits_into_quotient_and_remainder():
    """A reshape's flat index over two symbolic dims (deberta_v2_dyn's masked softmax, [batch * 4, sequence,
    sequence] read as [batch, 4, sequence, sequence]): ``(x * S + k) // S`` is ``x`` and ``% S`` is ``k`` when
    ``k < S``; with ``k + 1`` (may reach S) both stay."""
    TS = C.script_tir

    @TS.prim_func(private=True, s_tir=True)
    def before(a: TS.handle, o1: TS.handle, o2: TS.handle):
        batch = TS.int64()
        sequence = TS.int64()
        A = TS.match_buffer(a, (batch * 4, sequence, sequence + 1), "float32")
        O1 = TS.match_buffer(o1, (batch, 4, sequence, sequence), "float32")
        O2 = TS.match_buffer(o2, (batch, 4, sequence, sequence), "float32")
        for b, h, i, j in TS.grid(batch, TS.int64(4), sequence, sequence):
            with TS.sblock("split"):
                vb, vh, vi, vj = TS.axis.remap("SSSS", [b, h, i, j])
                O1[vb, vh, vi, vj] = A[(((vb * 4 + vh) * sequence + vi) * sequence + vj) // sequence // sequence
                                       % (batch * 4),
                                       (((vb * 4 + vh) * sequence + vi) * sequence + vj) // sequence % sequence,
                                       (((vb * 4 + vh) * sequence + vi) * sequence + vj) % sequence]
            with TS.sblock("keep"):
                wb, wh, wi, wj = TS.axis.remap("SSSS", [b, h, i, j])
                O2[wb, wh, wi, wj] = A[0, 0, ((wi * sequence + wj + 1) // sequence) % (sequence + 1)]

    text = drop_wrapless_modulo(before).script()
    assert "A[vb * T.int64(4) + vh, vi, vj]" in text, text
    assert "(wi * sequence + wj + T.int64(1)) // sequence" in text, text


def test_gather_wrap_select_of_a_non_negative_index_takes_its_branch():
    """A gather's negative-index wrap ``Select(0 < int64(i < 0), i + n, i)`` of a flat index ``b * S + s``
    (never negative) is ``i``, whose ``// S % B`` and ``% S`` then split into ``b`` and ``s`` (``+ 0`` terms, as
    TVM's inlining leaves them, do not hide the product); the wrap of ``s - 1`` (negative at s = 0) stays, and
    so does its division.  A ``floordiv`` proved 0 becomes an int64 0."""
    TS = C.script_tir

    @TS.prim_func(private=True, s_tir=True)
    def before(a: TS.handle, o1: TS.handle, o2: TS.handle, o3: TS.handle):
        batch = TS.int64()
        sequence = TS.int64()
        A = TS.match_buffer(a, (batch, sequence), "float32")
        O1 = TS.match_buffer(o1, (batch, sequence), "float32")
        O2 = TS.match_buffer(o2, (batch, sequence), "float32")
        O3 = TS.match_buffer(o3, (batch, sequence), "float32")
        for b, s in TS.grid(batch, sequence):
            with TS.sblock("wrap"):
                vb, vs = TS.axis.remap("SS", [b, s])
                O1[vb, vs] = A[
                    TS.Add(TS.Select(TS.int64(0) < TS.Cast("int64", vs + TS.Add(vb, TS.int64(0))
                                                          * TS.Add(sequence, TS.int64(0)) < TS.int64(0)),
                                     vs + vb * sequence + batch * sequence,
                                     vs + TS.Add(vb, TS.int64(0)) * TS.Add(sequence, TS.int64(0))),
                           TS.int64(0)) // sequence % batch,
                    TS.Select(vs + vb * sequence < TS.int64(0), vs + vb * sequence + batch * sequence,
                              vs + vb * sequence) % sequence]
            with TS.sblock("keep"):
                wb, ws = TS.axis.remap("SS", [b, s])
                O2[wb, ws] = A[wb, TS.Select(ws - TS.int64(1) < TS.int64(0), ws - TS.int64(1) + sequence,
                                             ws - TS.int64(1)) % sequence]
            with TS.sblock("zero"):
                zb, zs = TS.axis.remap("SS", [b, s])
                O3[zb, zs] = A[zs // sequence, zs]

    after = drop_wrapless_modulo(before)
    text = after.script()
    assert "O1[vb, vs] = A[vb, vs]" in text, text
    assert "ws - T.int64(1) < T.int64(0)" in text and "% sequence" in text, text     # may be negative: kept
    assert "O3[zb, zs] = A[T.int64(0), zs]" in text, text
    assert drop_wrapless_modulo(after).same_as(after)


def flat_padding_mask(fill=-3.4028234663852886e38):
    """transformers' vmap-style padding mask (albert_dyn, roberta_dyn): the [batch, seq] mask flattened,
    gathered at ``b * seq + kv`` (an ONNX Gather: its index wrapped where negative), and-ed with
    ``q >= 0`` over [batch, 1, seq, seq], then where(mask, 0, fill): one cpu.elementwise kernel per call."""
    from onnx import TensorProto

    I64 = lambda v: np.array(v, dtype=np.int64)      # noqa: E731
    g = M._G("flat_padding_mask")
    m = g.input("mask", ("batch", "seq"), TensorProto.INT64)
    shape = g.op("Shape", m)
    b = g.op("Gather", shape, g.const(I64(0)), axis=0)
    s = g.op("Gather", shape, g.const(I64(1)), axis=0)
    rb = g.op("Range", g.const(I64(0)), b, g.const(I64(1)))
    rs = g.op("Range", g.const(I64(0)), s, g.const(I64(1)))
    idx = g.op("Add", g.op("Mul", g.op("Unsqueeze", rb, g.const(I64([1]))), s),
               g.op("Unsqueeze", rs, g.const(I64([0]))))
    flat = g.op("Reshape", g.op("Cast", m, to=TensorProto.BOOL), g.const(I64([-1])))
    valid = g.op("Unsqueeze", g.op("Gather", flat, idx, axis=0), g.const(I64([1, 2])))        # [batch, 1, 1, seq]
    rows = g.op("GreaterOrEqual", g.op("Unsqueeze", rs, g.const(I64([0, 1, 3]))), g.const(I64(0)))  # [1, 1, seq, 1]
    g.op("Where", g.op("And", rows, valid), g.const(np.float32(0.0)), g.const(np.float32(fill)))
    g.rename_last("y", ("batch", 1, "seq", "seq"))
    return g.model()


def _loads_of(func, name: str) -> list:
    loads = []
    C.post_order_visit(func.body, lambda n: loads.append(n) if isinstance(n, C.TensorLoad)
                       and str(n.source.name) == name else None)
    return loads


@pytest.mark.parametrize("target", TARGETS + ["neon-4"])
def test_flat_padding_mask_reads_the_mask_at_b_kv(target):
    """The mask kernel reads ``mask[b, kv]``: no wrap select, no division by batch or sequence in the index
    (was ``mask[(kv + b * S) // S % B, (kv + b * S) % S]`` under the wrap: three 64-bit divisions per element
    and no vector loop, albert_dyn's mask kernel 92 us per call at sequence 128 vs 9.4 static, one thread,
    under load; notes/albert14.md)."""
    tgt = parse_target(NAMED_TARGETS[target])
    (kname, func), = S.graph_funcs(flat_padding_mask(), tgt).items()
    mask = str(func.params[0].name)
    assert any(not isinstance(i, C.IntImm) and "//" in str(i) for ld in _loads_of(func, mask) for i in ld.indices) \
        or "Select" in func.script()                                   # the unscheduled kernel: a flat gather
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is not None and res.template == "cpu.elementwise", res and res.template
    loads = _loads_of(res.func, mask)
    assert loads
    for ld in loads:
        text = [str(i) for i in ld.indices]
        assert not any(("//" in t or "%" in t or "Select" in t) for t in text), text
    C.lower_tir(C.IRModule({"main": res.func.with_attr("global_symbol", "main")}), tgt)


def test_flat_padding_mask_numerics(host, rng):
    model = flat_padding_mask()
    cm = tvmfuse.compile(model, target=host)
    for b, s in ((1, 1), (1, 128), (3, 17), (2, 5)):
        feeds = {"mask": rng.integers(0, 2, size=(b, s)).astype(np.int64)}
        out, ref = cm.run(feeds), M.reference_outputs(model, feeds)
        np.testing.assert_array_equal(out["y"], ref["y"], err_msg=f"at {(b, s)}")


@pytest.mark.parametrize("target", TARGETS)
def test_symbolic_norm_through_reshapes_divides_by_no_symbolic_extent(target):
    """gpt2_dyn's residual + LayerNorm kernel: every index that a static build simplifies is free of
    divisions by batch or sequence (was: `% (batch * sequence)` per row read, `// sequence % batch` per
    block binding), and no buffer of the parallel rows is a workspace allocation (was: four per row)."""
    tgt = parse_target(NAMED_TARGETS[target])
    funcs = {k: f for k, f in S.graph_funcs(_residual_norm(), tgt).items()
             if any(not isinstance(d, C.IntImm) for p in f.params for d in getattr(p, "shape", ()) or ())}
    assert len(funcs) == 1, list(funcs)
    (kname, func), = funcs.items()
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is not None and res.template == "cpu.symbolic_rows", res and res.template
    assert "%" in func.script()                          # the unscheduled kernel has them (reshape indices)
    divs = _symbolic_divisions(res.func)
    # what is left: the fused row loop's own split into (batch, sequence) for the (batch, sequence, d) buffers
    assert all("% (batch * sequence)" not in d and "% batch" not in d for d in divs), divs
    lambdas = {fn: bufs for fn, bufs in workspace_buffers(res.func, tgt).items() if "parallel_lambda" in fn}
    assert lambdas and not any(lambdas.values()), lambdas


def test_symbolic_norm_through_reshapes_numerics(host, rng):
    model = _residual_norm()
    cm = tvmfuse.compile(model, target=host)
    for b, s in ((1, 1), (1, 3), (3, 17), (2, 40)):
        _check(model, cm, rng, {"x": (b, s, 64), "r": (b, s, 64)})


# ----------------------------------------------------------------------------------- injective groups
@pytest.mark.parametrize("target", TARGETS)
def test_symbolic_heads_layout_divides_by_constants_only(target):
    """[batch, 4, sequence, 16]: (batch x 4) the parallel loop, sequence a serial loop inside it, the 16 the
    vector: no index divided by a symbolic extent (was: each vector's index divided by sequence x 4 and by
    sequence), in every size bucket's nest."""
    tgt = parse_target(NAMED_TARGETS[target])
    (kname, func), = S.graph_funcs(_heads(), tgt).items()
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is not None and res.template == "cpu.elementwise", res and res.template
    assert len(res.config["buckets"]) >= 2                     # the nests share nothing (lowering accepts them)
    assert not _symbolic_divisions(res.func), _symbolic_divisions(res.func)
    kinds = []
    C.post_order_visit(res.func.body, lambda n: kinds.append(int(n.kind)) if isinstance(n, C.tirx.For) else None)
    assert int(C.ForKind.PARALLEL) in kinds and int(C.ForKind.VECTORIZED) in kinds
    C.lower_tir(C.IRModule({"main": res.func.with_attr("global_symbol", "main")}), tgt)


def test_symbolic_heads_layout_numerics(host, rng):
    model = _heads()
    cm = tvmfuse.compile(model, target=host)
    for b, s in ((1, 1), (3, 17), (8, 5)):
        _check(model, cm, rng, {"x": (b, s, 64)}, rtol=0, atol=0)


# ----------------------------------------------------------------------------------- padded siblings
@pytest.mark.parametrize("target", TARGETS)
def test_symbolic_siblings_pad_columns_no_vector_divides(target):
    """SwiGLU gate/up with 172 columns (llama_dyn; no vector width divides 172): cpu.symbolic_siblings
    with the columns padded to the register tile in the row-tiled nest (was cpu.symbolic_rows, one row at a
    time: 608 us per call at 128 rows, the static build 112 us with its norm; profile_kernels, under load)."""
    tgt = parse_target(NAMED_TARGETS[target])
    (kname, func), = S.graph_funcs(M.swiglu(seq="rows", hidden=64, ffn=172), tgt).items()
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is not None and res.template == "cpu.symbolic_siblings", res and res.template
    big = res.config["buckets"][-1]["config"]
    assert big["pad_n"] and big["mr"] > 1
    assert 172 % (big["nvec"] * big["lanes"])                  # the tile does not divide: padded
    # the padded accumulator: a whole register tile per row, so the inner j loop is a vector loop
    kinds = []
    C.post_order_visit(res.func.body, lambda n: kinds.append(int(n.kind)) if isinstance(n, C.tirx.For) else None)
    assert int(C.ForKind.VECTORIZED) in kinds and int(C.ForKind.PARALLEL) in kinds


def test_symbolic_siblings_padded_numerics(host, rng):
    model = M.swiglu(seq="rows", hidden=64, ffn=172)
    cm = tvmfuse.compile(model, target=host)
    assert [s["template"] for s in cm.report.schedules] == ["cpu.symbolic_siblings"]
    for rows in (1, 3, 17, 51):
        _check(model, cm, rng, {"x": (rows, 64)})


@pytest.mark.parametrize("target", TARGETS)
def test_symbolic_multi_output_layout_gets_the_serial_bucket(target):
    """gpt2's Q/K/V head split (three outputs over batch x sequence): size buckets over batch x sequence as
    for one output, a serial nest while all outputs' elements are under the fork/join cost (the static
    build's choice at these sizes; was: always parallel, a thread-pool launch per call at sequence 1)."""
    from test_symbolic import _head_split

    tgt = parse_target(NAMED_TARGETS[target])
    funcs = S.graph_funcs(_head_split(), tgt)
    (kname, func), = funcs.items()
    res = schedule_prim_func(func, tgt, {}, kname)
    assert res is not None and res.template == "cpu.elementwise", res and res.template
    first, *_, last = (b["config"] for b in res.config["buckets"])
    assert not first["parallel"] and last["parallel"]
    assert not _symbolic_divisions(res.func), _symbolic_divisions(res.func)
    C.lower_tir(C.IRModule({"main": res.func.with_attr("global_symbol", "main")}), tgt)


def _reshape_gather():
    """deberta_v2_dyn's c2p gather (shortened): a position-key table [batch, 4, sequence, 32] reshaped to
    [batch * 4, sequence, 32] and gathered along its last axis at a per-element index, then scaled."""
    TS = C.script_tir

    @TS.prim_func(private=True, s_tir=True)
    def func(p0: TS.handle, p1: TS.handle, out: TS.handle):
        batch = TS.int64()
        sequence = TS.int64()
        P0 = TS.match_buffer(p0, (batch, 4, sequence, 32), "float32")
        P1 = TS.match_buffer(p1, (batch * 4, sequence, sequence), "int64")
        O = TS.match_buffer(out, (batch * 4, sequence, sequence), "float32")
        R = TS.sblock_alloc_buffer((batch * 4, sequence, 32), "float32")
        G = TS.sblock_alloc_buffer((batch * 4, sequence, sequence), "float32")
        for a0, a1, a2 in TS.grid(batch * 4, sequence, TS.int64(32)):
            with TS.sblock("T_reshape"):
                v0, v1, v2 = TS.axis.remap("SSS", [a0, a1, a2])
                R[v0, v1, v2] = P0[(v2 // 32 + v0 * sequence + v1) // sequence // 4 % batch,
                                   (v2 // 32 + v0 * sequence + v1) // sequence % 4,
                                   (v2 // 32 + v0 * sequence + v1) % sequence, v2 % 32]
        for a0, a1, a2 in TS.grid(batch * 4, sequence, sequence):
            with TS.sblock("T_gather"):
                w0, w1, w2 = TS.axis.remap("SSS", [a0, a1, a2])
                G[w0, w1, w2] = R[w0, w1, P1[w0, w1, w2]]
        for a0, a1, a2 in TS.grid(batch * 4, sequence, sequence):
            with TS.sblock("T_divide"):
                u0, u1, u2 = TS.axis.remap("SSS", [a0, a1, a2])
                O[u0, u1, u2] = G[u0, u1, u2] * TS.float32(0.5)

    return func


def test_static_divisor_no_op_dropped_before_a_gather_inlines_it():
    """A reshape's ``k // 32`` and ``k % 32`` over its own iterator k < 32 are dropped (a static divisor, a
    proved no-op), and ``0 + x`` folded, so the flat index still splits; once the gather is inlined its data
    index stands where k was and nothing bounds it (the kernel kept 3 divisions by sequence per element:
    deberta_v2_dyn's c2p / p2c gathers 1855 us vs 106 at b1 s128, kernel-only, under load)."""
    text = drop_wrapless_modulo(_reshape_gather()).script()
    assert "P0[v0 // T.int64(4), v0 % T.int64(4), v1, v2]" in text, text


@pytest.mark.parametrize("target", TARGETS + ["neon-4"])
def test_gather_through_a_reshape_divides_by_no_symbolic_extent(target):
    tgt = parse_target(NAMED_TARGETS[target])
    res = schedule_prim_func(_reshape_gather(), tgt, {}, "reshape_gather")
    assert res is not None
    divs = _symbolic_divisions(res.func)
    # what is left: the fused row loop's own split into (batch * 4, sequence), per nest; none per element
    # (was: the gathered value's ``(p1 // 32 + v0 * sequence + v1) // sequence // 4 % batch`` and two more)
    assert divs and set(divs) <= {"a0_a1_fused // sequence", "a0_a1_fused % sequence"}, divs


def test_gather_through_a_reshape_numerics(host, rng):
    res = schedule_prim_func(_reshape_gather(), host, {}, "reshape_gather")
    lib = C.build_prim_module(C.IRModule({"main": res.func.with_attr("global_symbol", "main")}), host)
    for b, s in ((1, 1), (2, 5), (3, 17)):
        p0 = rng.standard_normal((b, 4, s, 32)).astype(np.float32)
        p1 = rng.integers(0, 32, (b * 4, s, s)).astype(np.int64)
        out = C.tensor(np.zeros((b * 4, s, s), np.float32))
        lib["main"](C.tensor(p0), C.tensor(p1), out)
        ref = np.take_along_axis(p0.reshape(b * 4, s, 32), p1, axis=2) * 0.5
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-6, atol=1e-6, err_msg=f"b={b} s={s}")
