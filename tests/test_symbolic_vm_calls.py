"""What a symbolic model does per call outside its kernels (issue 13): ``tvmfuse.share_shapes`` makes each
distinct symbolic scalar a kernel takes (``call_tir``'s ``tir_vars``: ``batch``, ``sequence`` of a matmul
over ``[batch * sequence, hidden]`` rows) and each distinct shape of a ``vm.builtin.reshape`` once per
call, not once per use (a symbolic GPT-2 made 24 ``make_prim_value`` per call for 2 scalars).

Structural tests on named targets (the lowered ``main``'s VM builtins), the builtins one call runs on the
host (a VM instrument counts them: no timing), numbers against numpy at two sizes.
"""
from __future__ import annotations

import collections
import re

import numpy as np
import pytest
from onnx import numpy_helper

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.frontend import load_onnx
from tvmfuse.pipeline import PipelineOptions, Stages, _share_shapes

from conftest import named_target

HEADS, D = 2, 16
HIDDEN = HEADS * D
LAYERS = 2
SIZES = [(1, 1), (2, 17)]     # (batch, sequence)
RTOL, ATOL = 1e-4, 1e-5


def _gpt2_like(layers=LAYERS):
    """``layers`` GPT-2 attention tails over a symbolic batch x sequence: per layer softmax(Q K^T / sqrt(d))
    V per head with Q = K = V the layer's input, heads merged, rows flattened to [batch * sequence, hidden]
    (the symbolic export's Reshape(-1, hidden)), a Gemm and a ReLU, reshaped back for the next layer.
    Each layer's Gemm runs over the merged rows, so its kernel takes ``batch`` and ``sequence`` as scalars,
    and the flatten is a ``vm.builtin.reshape`` view."""
    g = M._G("gpt2_like_sym")
    x = g.input("x", ("batch", HEADS, "sequence", D))
    for i in range(layers):
        kt = g.op("Transpose", x, perm=[0, 1, 3, 2])
        p = g.op("Softmax", g.op("Mul", g.op("MatMul", x, kt), g.const(np.float32(1 / np.sqrt(D)))), axis=-1)
        o = g.op("Transpose", g.op("MatMul", p, x), perm=[0, 2, 1, 3])
        flat = g.op("Reshape", o, g.const(np.array([-1, HIDDEN], np.int64)))
        h = g.op("Relu", g.op("MatMul", flat, g.weight((HIDDEN, HIDDEN))))
        if i + 1 < layers:
            x = g.op("Transpose", g.op("Reshape", h, g.const(np.array([-1, 1, HEADS, D], np.int64))),
                     perm=[0, 2, 1, 3])
            # [batch * sequence, 1, heads, d] -> [batch * sequence, heads, 1, d]: a new batch of sequence 1
    g.rename_last("y", ("rows", HIDDEN))
    return g.model()


def _numpy_reference(model, x):
    weights = [numpy_helper.to_array(i) for i in model.graph.initializer if list(i.dims) == [HIDDEN, HIDDEN]]
    assert len(weights) == LAYERS
    for i, w in enumerate(weights):
        s = x @ x.transpose(0, 1, 3, 2) / np.sqrt(D)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        h = np.maximum((p @ x).transpose(0, 2, 1, 3).reshape(-1, HIDDEN) @ w, 0)
        if i + 1 < len(weights):
            x = h.reshape(-1, 1, HEADS, D).transpose(0, 2, 1, 3)
    return h


def _lowered_main(model, target, drop=(), input_shapes=None) -> str:
    """TVMScript of ``main`` after tvmfuse's whole Relax pipeline, without the passes named in ``drop``."""
    with target:
        st = Stages(target, PipelineOptions())
        passes = [p for p in st.all() if p.info.name not in drop]
        return C.Sequential(passes)(load_onnx(model, input_shapes=input_shapes))["main"].script()


def _builtin_calls(main_text: str, name: str) -> list[str]:
    """The heap-slot arguments of each ``vm.builtin.<name>`` call in the lowered ``main``."""
    return re.findall(rf'"vm\.builtin\.{name}", shape_heap, ([\d, ]+), ty_args', main_text)


@pytest.mark.parametrize("target", ["haswell-2", "skx-2"])
def test_kernel_scalars_and_reshape_shapes_made_once_per_call(target):
    model = _gpt2_like()
    tgt = named_target(target)
    shared = _lowered_main(model, tgt)
    unshared = _lowered_main(model, tgt, drop=("tvmfuse.share_shapes",))
    # without sharing: two scalars (batch, sequence) per call of each of the layers' Gemm kernels, one shape
    # per reshape; with it: each distinct scalar and shape once
    before = _builtin_calls(unshared, "make_prim_value")
    after = _builtin_calls(shared, "make_prim_value")
    assert len(before) >= 2 * LAYERS and len(set(before)) == 2, before
    assert len(after) == len(set(after)) == 2, after
    made = _builtin_calls(shared, "make_shape")
    assert len(made) == len(set(made)), made
    assert len(made) < len(_builtin_calls(unshared, "make_shape"))
    # every reshape and kernel now takes a variable bound once
    reshapes = re.findall(r'"vm\.builtin\.reshape", \w+, (\w+)', shared)
    assert len(reshapes) >= LAYERS and all(r.startswith("shape") for r in reshapes), reshapes
    assert len(set(reshapes)) < len(reshapes)       # the layers' flattens share their shape
    # a static build passes neither shapes nor scalars
    static = _lowered_main(model, tgt, input_shapes={"batch": 2, "sequence": 17})
    assert _builtin_calls(static, "make_prim_value") == _builtin_calls(static, "make_shape") == []


def _calls_per_call(cm, feeds) -> collections.Counter:
    """What one call of ``main`` runs: {"kernel": n, "<VM builtin>": n} (a VM instrument; no timing)."""
    kernels = {gv.name_hint for gv, f in cm.fused_module.functions.items() if isinstance(f, C.PrimFunc)}
    counts: collections.Counter = collections.Counter()

    def instrument(func, symbol, before_run, ret_value, *args):
        if before_run:
            counts["kernel" if str(symbol) in kernels else str(symbol)] += 1
        return 0                        # run the call

    vm = C.VirtualMachine(cm.executable, cm.device)
    vm.set_instrument(instrument)
    vm["main"](*[C.tensor(v, cm.device) for v in feeds.values()])
    return counts


@pytest.fixture(scope="module")
def gpt2_like(host):
    return _gpt2_like(), tvmfuse.compile(_gpt2_like(), host)


@pytest.mark.parametrize("batch, sequence", SIZES)
def test_gpt2_like_matches_numpy_and_makes_each_scalar_once(gpt2_like, rng, batch, sequence):
    model, cm = gpt2_like
    x = rng.standard_normal((batch, HEADS, sequence, D)).astype(np.float32)
    got = cm.run({"x": x})["y"]
    assert got.shape == (batch * sequence, HIDDEN)
    np.testing.assert_allclose(got, _numpy_reference(model, x), rtol=RTOL, atol=ATOL)
    calls = _calls_per_call(cm, {"x": x})
    assert calls["vm.builtin.make_prim_value"] == 2, calls
    assert calls["vm.builtin.reshape"] >= LAYERS and calls["kernel"] == cm.kernel_count, calls
    assert calls["vm.builtin.make_shape"] < calls["vm.builtin.reshape"] + calls["vm.builtin.alloc_tensor"], calls


# ----------------------------------------------------------------------------------- the pass alone
def _kernel_call_module():
    """A lowered-style ``main`` calling a kernel twice with the symbolic scalar ``n`` and ``n * 2``, once
    with a Relax scalar variable and once with a constant."""
    I, RS, T = C.script_ir, C.script_relax, C.script_tir

    @I.ir_module
    class Mod:
        @T.prim_func(private=True)
        def k(a: T.handle, n: T.int64, m: T.int64):
            A = T.match_buffer(a, (n,), "float32")
            T.evaluate(m)

        @RS.function(pure=False)
        def main(x: RS.Tensor(("n",), "float32"), s: RS.Prim("int64")):
            n = T.int64()
            cls = Mod
            cls.k(x, RS.prim_value(n), RS.prim_value(n * 2))
            cls.k(x, RS.prim_value(n), RS.prim_value(n + n))
            cls.k(x, s, RS.prim_value(T.int64(3)))
            return x

    return Mod


def test_share_shapes_binds_each_symbolic_kernel_scalar_once():
    out = _share_shapes(_kernel_call_module())["main"]
    bindings = out.body.blocks[0].bindings
    scalars = [b for b in bindings if C.var_name(b.var).startswith("scalar")]
    # n and n * 2 (== n + n once simplified): two bindings, before the first call
    assert [str(b.value) for b in scalars] == ["n", "n * T.int64(2)"], [str(b.value) for b in scalars]
    calls = [b.value for b in bindings if isinstance(b.value, C.relax.Call)]
    assert len(calls) == 3
    assert [list(c.args[1:]) for c in calls[:2]] == [[s.var for s in scalars]] * 2
    # a Relax variable and a constant are passed as they are
    last = _kernel_call_module()["main"].body.blocks[0].bindings[-1].value
    C.assert_structural_equal(calls[2].args[1:], last.args[1:], map_free_vars=True)


def _tuples_module():
    """A tuple no one reads (``t``), one the return reads (``u``) and one read by a later binding (``w``)."""
    I, RS = C.script_ir, C.script_relax

    @I.ir_module
    class Mod:
        @RS.function
        def main(x: RS.Tensor((4,), "float32"), y: RS.Tensor((4,), "float32")):
            t = (x, y)
            w = (y,)
            v = w[0]
            u = (x, v)
            return u

    return Mod


def test_drop_unused_tuples_drops_only_the_unread_tuple():
    """CallTIRRewrite's tuple of a multi-output kernel's allocations is never read, but the VM built it
    every call (``make_tuple``: 6 per call of GPT-2); a tuple something reads stays."""
    from tvmfuse.pipeline import _drop_unused_tuples

    before = _tuples_module()
    out = _drop_unused_tuples(before)["main"]
    names = [C.var_name(b.var) for b in out.body.blocks[0].bindings]
    assert names == ["w", "v", "u"], names
    # nothing to drop: the module as it was
    C.assert_structural_equal(_drop_unused_tuples(_drop_unused_tuples(_tuples_module())),
                              _drop_unused_tuples(_tuples_module()))


def test_no_tuple_built_per_call_for_multi_output_kernels():
    """A residual add + layer norm kernel writes two outputs (the sum, read again by the next residual, and
    the normed rows), as GPT-2's do; after lowering no ``make_tuple`` is left for their unread tuple."""
    g = M._G("two_outputs")
    x = g.input("x", ("rows", HIDDEN))
    s = g.op("Add", x, g.weight((HIDDEN,), 0.1))
    ln = g.op("LayerNormalization", s, g.weight((HIDDEN,), 1.0), g.weight((HIDDEN,), 0.1), axis=-1)
    g.op("Add", g.op("MatMul", ln, g.weight((HIDDEN, HIDDEN))), s)
    g.rename_last("y", ("rows", HIDDEN))
    model = g.model()
    tgt = named_target("skx-2")
    kept = _lowered_main(model, tgt, drop=("tvmfuse.drop_unused_tuples",))
    dropped = _lowered_main(model, tgt)
    tuples = re.compile(r"^\s+\w+: R\.Tuple\(.*\) = \w+, \w+$", re.M)    # VM codegen: make_tuple
    assert len(tuples.findall(kept)) == 1, kept
    assert tuples.findall(dropped) == [], dropped
    # the same in the executable the model runs
    cm = tvmfuse.compile(model, target=tgt)
    assert "vm.builtin.make_tuple" not in cm.executable.as_text() and cm.kernel_count == 2
