"""Attention as one kernel (rules row ``attention``, passes/attention.py, schedules/cpu/attention.py) and
the ONNX Attention-23 / LayerNormalization / RMSNormalization converters (frontend.py).

Numerics: every case is compared with onnx's ReferenceEvaluator on fresh random inputs, in float64 from the
same float32 inputs (conftest.reference_outputs_f64: the kernel's error alone, not a float32 reference's
too).  The kernel sums q.k over the head dim and p.v over the keys in another order than numpy and uses
tvmfuse's fast exp, so float32 results get rtol 1e-4 (the issue's bound) of the output's scale, atol 1e-5.  Structure: the kernel count of the
compiled model, the rule that formed the kernel, and the scheduled TIR (no buffer of S x S, parallel
and vectorized loops) on named AVX2 and AVX-512 targets.
"""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse import models as M
from tvmfuse.explain import Recorder
from tvmfuse.explain_cli import explain
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.schedules.base import schedule_with
from tvmfuse.schedules.cpu.attention import ATTR, Attention, AttentionSpec, reference_prim_func
from conftest import assert_close_scaled, reference_outputs_f64

RTOL, ATOL = 1e-4, 1e-5
HASWELL = tvmfuse.parse_target({"kind": "llvm", "mcpu": "haswell", "mtriple": "x86_64-linux-gnu",
                                "num-cores": 2})
SKYLAKE = tvmfuse.parse_target({"kind": "llvm", "mcpu": "skylake-avx512", "mtriple": "x86_64-linux-gnu",
                                "num-cores": 4})
F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=(), opset=18):
    g = helper.make_graph(nodes, "attn", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                          [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs], list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10 if opset >= 23 else 8
    onnx.checker.check_model(m)
    return m


def _chain(b=2, h=3, sq=13, sk=21, d=16, dv=8, mask=None, softmax_axis=-1, scale_op="Mul", decomposed=False):
    """softmax(Q @ K^T * s [+ mask]) @ V on [B, H, S, D] inputs; ``mask``: None, "input" or an initializer."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["qk"]),
             helper.make_node(scale_op, ["qk", "s"], ["x"])]
    s = np.float32(1 / np.sqrt(d)) if scale_op == "Mul" else np.float32(np.sqrt(d))
    inits = [onnx.numpy_helper.from_array(np.array(s), "s")]
    inputs = [("q", F, [b, h, sq, d]), ("k", F, [b, h, sk, d]), ("v", F, [b, h, sk, dv])]
    logits = "x"
    if mask is not None:
        if isinstance(mask, np.ndarray):
            inits.append(onnx.numpy_helper.from_array(mask, "mask"))
        else:
            inputs.append(("mask", F, [b, 1, sq, sk]))
        nodes.append(helper.make_node("Add", ["x", "mask"], ["xm"]))
        logits = "xm"
    if decomposed:       # ReduceMax, Sub, Exp, ReduceSum, Div (an exporter's softmax)
        inits.append(onnx.numpy_helper.from_array(np.array([softmax_axis], np.int64), "ax"))
        nodes += [helper.make_node("ReduceMax", [logits, "ax"], ["mx"], keepdims=1),
                  helper.make_node("Sub", [logits, "mx"], ["xs"]),
                  helper.make_node("Exp", ["xs"], ["ex"]),
                  helper.make_node("ReduceSum", ["ex", "ax"], ["se"], keepdims=1),
                  helper.make_node("Div", ["ex", "se"], ["p"])]
    else:
        nodes.append(helper.make_node("Softmax", [logits], ["p"], axis=softmax_axis))
    nodes.append(helper.make_node("MatMul", ["p", "v"], ["y"]))
    return _model(nodes, inputs, [("y", F, [b, h, sq, dv])], inits)


def _feeds(model, rng, scale=1.0):
    return {k: (rng.standard_normal(v.shape) * scale).astype(v.dtype)
            for k, v in M.random_feeds(model).items()}


def _large_logit_feeds(model, rng, scale=30.0):
    """Inputs ~``scale`` (logits ~1e4 at head dim 64) whose logits are exact in float32: Q, K and an input
    mask are whole numbers and the chain's logit scale a power of 2 (1/sqrt(d), d 16 or 64), so every q.k
    (|q.k| < 2^21) comes out the same in any summation order, numpy's or the kernel's.  Compared with the
    float64 truth (conftest.reference_outputs_f64) at 1e-4 of the output's scale, the kernel's own rounding
    (exps, running max and sums, P @ V) is then what is checked.  Unrounded inputs ~30 put ~5e-4 of rounding
    (half an ulp at 1e4) into every float32 logit, the reference's as the kernel's, and move outputs by up to
    ~3e-4 of their scale in both alike (benchmarks/notes/review10.md)."""
    feeds = _feeds(model, rng, scale)
    for name in ("q", "k", "mask"):
        if name in feeds:
            feeds[name] = np.rint(feeds[name])
    s = onnx.numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "s"))
    assert np.log2(s) == np.rint(np.log2(s)), f"logit scale {s} is not a power of 2: its products round"
    qk = np.abs(feeds["q"].astype(np.float64)) @ np.abs(np.swapaxes(feeds["k"], -1, -2).astype(np.float64))
    assert qk.max() < 2**21, f"|q|.|k| up to {qk.max()}: partial sums of q.k would round in float32"
    return feeds


def _check(model, cm, feeds, reference=reference_outputs_f64):
    ref = reference(model, feeds)
    out = cm.run(feeds)
    for name, r in ref.items():
        assert_close_scaled(out[name], r, RTOL, ATOL, err_msg=f"output {name}")
    return out, ref


def _attention_groups(cm):
    return [g for g in cm.report.groups if g["rule"] == "attention"]


def _attention_func(cm) -> C.PrimFunc:
    funcs = [f for f in cm.fused_module.functions.values()
             if isinstance(f, C.PrimFunc) and f.attrs is not None and ATTR in f.attrs]
    assert len(funcs) == 1, [str(gv.name_hint) for gv in cm.fused_module.functions]
    return funcs[0]


def _causal(s):
    """A causal additive mask [1, 1, s, s]: 0 on and below the diagonal, -inf above."""
    return np.where(np.arange(s)[None] <= np.arange(s)[:, None], 0, -np.inf).astype(np.float32).reshape(1, 1, s, s)


def _masked_row_case(host, rng, seq: int, d: int, mask, mask_scale: float = 1.0) -> dict:
    """The attention kernel (unscheduled) of a one-batch, two-head chain of ``seq`` queries and keys, head dim
    ``d`` (mask: None, "input" or "causal"), its template, match and default config, large-logit feeds (an
    input mask times ``mask_scale`` with row 4 fully masked: a NaN row, as onnx's Softmax gives), the float64
    reference output and the kernel's arguments: the set-up every schedule-variant-vs-reference test shares."""
    model = _chain(b=1, h=2, sq=seq, sk=seq, d=d, dv=d, mask=_causal(seq) if mask == "causal" else mask)
    func = _attention_func(tvmfuse.compile(model, host, schedules=False))
    t = Attention()
    match = t.match(func, host)
    feeds = _large_logit_feeds(model, rng)
    if "mask" in feeds:
        feeds["mask"] *= mask_scale
        feeds["mask"][0, 0, 4, :] = -np.inf
    ref = reference_outputs_f64(model, feeds)["y"]
    args = [feeds["q"], feeds["k"], feeds["v"]] + ([feeds["mask"]] if "mask" in feeds else [])
    return dict(t=t, match=match, func=func, base=t.default_config(match, host), masked="mask" in feeds,
                ref=ref, args=args)


# ------------------------------------------------------------------------------------------ numerics
@pytest.mark.parametrize("kw", [
    dict(),                                              # S not a multiple of any block
    dict(mask="input"),                                  # additive mask, broadcast over heads
    dict(b=1, h=2, sq=64, sk=64, d=32, dv=32),           # multiples of the blocks
    dict(sq=5, sk=3, d=4, dv=4),                         # fewer keys than one vector
    dict(scale_op="Div"),                                # 1/sqrt(d) as a division
    dict(mask="input", decomposed=True),                 # max/sub/exp/sum/div instead of Softmax
])
def test_chain_is_one_kernel_and_matches_reference(kw, host, rng):
    model = _chain(**kw)
    cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 1, (cm.report.after.kernel_names, cm.report.refused)
    assert [g["ops"][:3] for g in _attention_groups(cm)] == [["matmul", "softmax", "matmul"]]
    assert [s["template"] for s in cm.report.schedules] == ["cpu.attention"]
    _check(model, cm, _feeds(model, rng))


def test_causal_constant_becomes_the_causal_flag(host, rng):
    sq = sk = 19
    causal = np.where(np.arange(sk)[None] <= np.arange(sq)[:, None], 0, -np.inf).astype(np.float32)
    model = _chain(sq=sq, sk=sk, mask=causal.reshape(1, 1, sq, sk))
    cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 1
    spec = AttentionSpec.from_json(str(_attention_func(cm).attrs[ATTR]))
    assert spec.causal_offset == 0 and spec.mask is None      # no mask read: the flag
    _check(model, cm, _feeds(model, rng))


def test_fully_masked_row_and_large_magnitudes(host, rng):
    """A row with an all -inf mask is NaN, as onnx's Softmax gives (0/0); logits near 1e4 stay finite."""
    model = _chain(mask="input")
    cm = tvmfuse.compile(model, host)
    feeds = _large_logit_feeds(model, rng)                    # q.k up to ~1e4: exp needs the running max
    feeds["mask"][0, 0, 4, :] = -np.inf
    feeds["mask"][1, 0, :, 5:] = -np.inf                      # whole key blocks masked for batch 1
    out, ref = _check(model, cm, feeds)
    assert np.isnan(ref["y"][0, :, 4]).all() and np.isnan(out["y"][0, :, 4]).all()
    assert np.isfinite(out["y"][1]).all()


# ------------------------------------------------------------------------------------------ structure
def test_transformer_block_attention_is_one_kernel(host, rng):
    model = M.transformer_block(seq=24, hidden=32, heads=2, ffn=64)
    cm = tvmfuse.compile(model, host)
    groups = _attention_groups(cm)
    assert len(groups) == 1 and "permute_dims" in groups[0]["ops"], cm.report.groups
    # 13 before the rule: Q/K/V head splits, K^T, scores, softmax, P @ V and the head merge were apart;
    # 5 with the norm_prologue rule (LN+QKV, attention, out-projection, LN+FFN-up, FFN-down)
    assert cm.kernel_count == 5, cm.report.after.kernel_names
    spec = AttentionSpec.from_json(str(_attention_func(cm).attrs[ATTR]))
    # head split (reshape + transpose) and merge are read/written in place: [seq, heads*dim] buffers
    assert spec.q.axes == ("i", ("b0", "d")) and spec.k.axes == ("j", ("b0", "d"))
    assert spec.out.axes == ("i", ("b0", "e")) and spec.out.shape == (24, 32)
    _check(model, cm, _feeds(model, rng))
    d = explain(model, host)
    assert any(g["rule"] == "attention" for g in d["groups"])


def _walk(stmt, visit):
    visit(stmt)
    for attr in ("body", "then_case", "else_case", "block", "init"):
        child = getattr(stmt, attr, None)
        if child is not None and hasattr(child, "same_as") and not hasattr(child, "ty"):
            _walk(child, visit)
    for child in getattr(stmt, "seq", ()) or ():
        _walk(child, visit)


def _run_kernel(scheduled: C.PrimFunc, inputs: list, out_shape, host) -> np.ndarray:
    """Build a scheduled attention PrimFunc for ``host``, run it on ``inputs`` and return its output."""
    lib = C.build_prim_module(C.IRModule({"main": scheduled.with_attr("global_symbol", "main")}), host)
    args = [C.tensor(a) for a in list(inputs) + [np.zeros(out_shape, np.float32)]]
    lib["main"](*args)
    return args[-1].numpy()


def _allocs_and_loops(func):
    allocs, loops = [], []

    def visit(s):
        if isinstance(s, C.SBlock):
            for buf in s.alloc_buffers:
                allocs.append((str(buf.name), int(np.prod([int(d) for d in buf.shape])), str(buf.scope())))
        if isinstance(s, C.tirx.For):
            loops.append(int(s.kind))

    _walk(func.body, visit)
    return allocs, loops


@pytest.mark.parametrize("target", [HASWELL, SKYLAKE], ids=["avx2", "avx512"])
def test_scheduled_kernel_has_no_scores_buffer(target):
    sq, sk = 256, 240        # longer than the largest blocks: a block-sized buffer is not S x S
    model = _chain(b=1, h=2, sq=sq, sk=sk, d=16, dv=16, mask="input")
    cm = tvmfuse.compile(model, target)
    func = _attention_func(cm)
    before, _ = _allocs_and_loops(func)
    assert any(n >= sq * sk for _, n, _ in before)             # the reference stages hold S x S scores
    res = schedule_prim_func(func, target)
    assert res.template == "cpu.attention"
    allocs, loops = _allocs_and_loops(res.func)
    # task buffers in attention.BUFFER_SCOPE ("global": the small ones on the stack, test_schedules_cpu_stack_audit)
    assert allocs and all(scope == "global" and n < sq * sk for _, n, scope in allocs), allocs
    lanes = 16 if target is SKYLAKE else 8
    assert res.config["k_block"] % lanes == 0
    assert int(C.ForKind.PARALLEL) in loops and int(C.ForKind.VECTORIZED) in loops
    assert loops.count(int(C.ForKind.PARALLEL)) == 1


def test_knob_space_and_every_config_match_reference(host, rng):
    """Each (query block, key block) of the space computes the same numbers (S odd: tails everywhere);
    a sixth of the space, drawn with a fixed seed."""
    import random

    model = _chain(b=1, h=2, sq=11, sk=37, d=8, dv=8, mask="input")
    cm = tvmfuse.compile(model, host)
    func = _attention_func(cm)
    t = Attention()
    match = t.match(func, host)
    space = t.space(match, host)
    assert set(space.names) == {"q_block", "k_block", "lanes", "rows", "tile_keys", "tile_qvecs", "q_blocks",
                                "pack_kv", "prefetch", "exp2", "serial_work"}
    assert space.contains(t.default_config(match, host))
    feeds = _feeds(model, rng)
    ref = reference_outputs_f64(model, feeds)["y"]
    args_np = [feeds["q"], feeds["k"], feeds["v"], feeds["mask"], np.zeros(ref.shape, np.float32)]
    configs = list(space.all_configs())
    assert {c["pack_kv"] for c in configs} == {0, 1} and {c["prefetch"] for c in configs} == {0, 1, 2}
    assert {c["exp2"] for c in configs} == {0, 1}
    # a sixth of the space without the prefetch level and the exp base, each drawn with a level and a base
    draw = random.Random(0)
    configs = [c for c in configs if c["prefetch"] == 0 and c["exp2"] == 0]
    for config in draw.sample(configs, len(configs) // 6):
        config = {**config, "prefetch": draw.choice((0, 1, 2)), "exp2": draw.choice((0, 1))}
        scheduled = schedule_with(t, match, func, config)
        lib = C.build_prim_module(C.IRModule({"main": scheduled.with_attr("global_symbol", "main")}), host)
        args = [C.tensor(a) for a in args_np]
        lib["main"](*args)
        assert_close_scaled(args[-1].numpy(), ref, RTOL, ATOL, err_msg=str(config))


def test_reference_kernel_alone_matches(host, rng):
    """The unscheduled kernel (what a target without the template runs) computes the same numbers."""
    model = _chain(mask="input")
    cm = tvmfuse.compile(model, host, schedules=False)
    assert cm.kernel_count == 1
    _check(model, cm, _feeds(model, rng))


def _with_casts(model, to, before_softmax=False):
    """The chain with Cast(to) nodes between Softmax and the P @ V MatMul (ViT's export: float -> float
    twice), or between the logits and Softmax (T5's: scores + position bias, cast, softmax)."""
    g = model.graph
    sm = next(n for n in g.node if n.op_type == "Softmax")
    if before_softmax:
        reader, src = sm, sm.input[0]
        at_node = next(n for n in g.node if src in n.output)
    else:
        reader = next(n for n in g.node if n.op_type == "MatMul" and n.input[0] == sm.output[0])
        src, at_node = sm.output[0], sm
    casts, prev = [], src
    for k, t in enumerate(to):
        casts.append(helper.make_node("Cast", [prev], [f"cast{k}"], to=t))
        prev = f"cast{k}"
    reader.input[0] = prev
    nodes = list(g.node)
    at = nodes.index(at_node) + 1
    g.ClearField("node")
    g.node.extend(nodes[:at] + casts + nodes[at:])
    onnx.checker.check_model(model)
    return model


def test_identity_casts_before_pv_stay_in_the_kernel(host, rng):
    """Softmax -> Cast(float) -> Cast(float) -> MatMul (ViT's export) and Add(mask) -> Cast(float) -> Softmax
    (T5's): the casts change nothing, the chain is one attention kernel; a float16 round trip is not."""
    model = _with_casts(_chain(mask="input"), [F, F])
    cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 1 and len(_attention_groups(cm)) == 1, (cm.report.after.kernel_names,
                                                                       cm.report.refused)
    _check(model, cm, _feeds(model, rng))
    # before the softmax (T5: the masked logits cast float -> float)
    model = _with_casts(_chain(mask="input"), [F], before_softmax=True)
    cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == 1 and len(_attention_groups(cm)) == 1, cm.report.refused
    _check(model, cm, _feeds(model, rng))
    # a float -> float16 -> float round trip changes the values: not an identity, not fused
    rounded = _with_casts(_chain(mask="input"), [TensorProto.FLOAT16, F], before_softmax=True)
    cm = tvmfuse.compile(rounded, host)
    assert not _attention_groups(cm)
    with pytest.raises(ValueError, match="casts to FLOAT16"):
        reference_outputs_f64(rounded, _feeds(rounded, rng))
    # the float32 reference: float16 rounding of float64 logits differs from that of float32 ones at some
    # seeds (1e-4 of the output at seed 13), so the float64 model is no truth of this one
    _check(rounded, cm, _feeds(rounded, rng), reference=M.reference_outputs)


# ------------------------------------------------------------------------------------------ must not fire
def test_softmax_over_other_axis_keeps_old_groups(host, rng):
    model = _chain(sq=12, sk=12, softmax_axis=2)
    cm = tvmfuse.compile(model, host)
    assert not _attention_groups(cm)
    reasons = [r["reason"] for r in cm.report.refused if r["rule"] == "attention"]
    assert reasons and "not the last" in reasons[0]
    _check(model, cm, _feeds(model, rng))


def test_matmul_chain_without_softmax_is_untouched(host):
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["qk"]),
             helper.make_node("Mul", ["qk", "s"], ["x"]),
             helper.make_node("MatMul", ["x", "v"], ["y"])]
    model = _model(nodes, [("q", F, [8, 4]), ("kt", F, [4, 8]), ("v", F, [8, 4])], [("y", F, [8, 4])],
                   [onnx.numpy_helper.from_array(np.array(np.float32(0.5)), "s")])
    cm = tvmfuse.compile(model, host)
    assert not _attention_groups(cm) and not [r for r in cm.report.refused if r["rule"] == "attention"]
    assert cm.kernel_count == 2


def test_scores_read_elsewhere_is_refused(host):
    """The scores are also a graph output: they must exist in memory, so no attention kernel."""
    model = _chain()
    model.graph.output.append(helper.make_tensor_value_info("x", F, [2, 3, 13, 21]))
    cm = tvmfuse.compile(model, host)
    assert not _attention_groups(cm)
    assert any("read outside" in r["reason"] for r in cm.report.refused if r["rule"] == "attention")


def test_gpu_target_without_template_refuses_with_reason():
    """cuda has an attention template (tests/test_schedules_cuda_attention.py); rocm has none."""
    from tvmfuse.passes.attention import FuseAttention

    mod = tvmfuse.load_onnx(_chain())
    with Recorder() as rec:
        out = FuseAttention(tvmfuse.parse_target("rocm"))(mod)
    assert not any(isinstance(f, C.PrimFunc) for f in out.functions.values())
    assert any("no rocm template" in r["reason"] for r in rec.refused)
    assert any(isinstance(f, C.PrimFunc) for f in FuseAttention(tvmfuse.parse_target("cuda"))(mod).functions.values())


def test_spec_validation_names_the_operand():
    spec = AttentionSpec.from_json(str(reference_prim_func(AttentionSpec.from_json(_SPEC)).attrs[ATTR]))
    bad = AttentionSpec.from_json(_SPEC.replace('"e"], "shape": [2, 4, 8]', '"e"], "shape": [2, 5, 8]'))
    with pytest.raises(ValueError, match="operand v"):
        bad.validate()
    spec.validate()


_SPEC = ('{"batch": [2], "sq": 3, "sk": 4, "d": 8, "dv": 8, "scale": 1.0, "causal_offset": null, '
         '"mask": null, "guard": null, '
         '"q": {"axes": ["b0", "i", "d"], "shape": [2, 3, 8], "dtype": "float32"}, '
         '"k": {"axes": ["b0", "j", "d"], "shape": [2, 4, 8], "dtype": "float32"}, '
         '"v": {"axes": ["b0", "j", "e"], "shape": [2, 4, 8], "dtype": "float32"}, '
         '"out": {"axes": ["b0", "i", "e"], "shape": [2, 3, 8], "dtype": "float32"}}')


# ------------------------------------------------------------------------------------------ ONNX import
def _attention23(q_shape, k_shape, v_shape, mask=None, past=None, **attrs):
    inputs = [("Q", F, q_shape), ("K", F, k_shape), ("V", F, v_shape)]
    names = ["Q", "K", "V"]
    if mask is not None:
        inputs.append(("attn_mask", mask[0], mask[1]))
    names.append("attn_mask" if mask is not None else "")
    if len(q_shape) == 4:
        y_shape = q_shape[:3] + v_shape[3:]
    else:
        y_shape = q_shape[:2] + [attrs["q_num_heads"] * v_shape[2] // attrs["kv_num_heads"]]
    outputs = [("Y", F, y_shape)]
    if past is not None:
        inputs += [("past_key", F, past[0]), ("past_value", F, past[1])]
        names += ["past_key", "past_value"]
        total = past[0][2] + k_shape[2]
        outputs += [("present_key", F, k_shape[:2] + [total, k_shape[3]]),
                    ("present_value", F, v_shape[:2] + [total, v_shape[3]])]
    while names[-1] == "":
        names.pop()
    node = helper.make_node("Attention", names, [o[0] for o in outputs], **attrs)
    return _model([node], inputs, outputs, opset=23)


@pytest.mark.parametrize("case", [
    dict(q_shape=[2, 3, 7, 8], k_shape=[2, 3, 9, 8], v_shape=[2, 3, 9, 8]),
    dict(q_shape=[2, 3, 7, 8], k_shape=[2, 3, 9, 8], v_shape=[2, 3, 9, 8], is_causal=1),
    dict(q_shape=[2, 5, 24], k_shape=[2, 6, 12], v_shape=[2, 6, 12], q_num_heads=4, kv_num_heads=2),
    dict(q_shape=[2, 3, 7, 8], k_shape=[2, 3, 9, 8], v_shape=[2, 3, 9, 8], mask=(TensorProto.BOOL, [7, 9])),
    dict(q_shape=[2, 3, 7, 8], k_shape=[2, 3, 9, 8], v_shape=[2, 3, 9, 8], mask=(F, [2, 1, 7, 9]), scale=0.2),
    dict(q_shape=[1, 2, 4, 8], k_shape=[1, 2, 3, 8], v_shape=[1, 2, 3, 8], is_causal=1,
         past=([1, 2, 5, 8], [1, 2, 5, 8])),
    dict(q_shape=[1, 4, 6, 8], k_shape=[1, 2, 7, 8], v_shape=[1, 2, 7, 8], mask=(F, [1, 4, 6, 7]), is_causal=1),
], ids=["4d", "causal", "3d_gqa", "bool_mask", "float_mask_scale", "past_causal", "gqa_head_mask_causal"])
def test_onnx_attention23_imports_and_fuses(case, host, rng):
    model = _attention23(**case)
    cm = tvmfuse.compile(model, host)
    assert len(_attention_groups(cm)) == 1, (cm.report.groups, cm.report.refused)
    # grouped-query heads are a broadcast the kernel reads in place, not a repeated copy of K/V
    assert not any("repeat" in k for k in cm.report.after.kernel_names)
    feeds = _feeds(model, rng)
    if "attn_mask" in feeds and feeds["attn_mask"].dtype == bool:
        feeds["attn_mask"] = rng.random(feeds["attn_mask"].shape) > 0.3
        feeds["attn_mask"][2, :] = False                       # a fully masked row: 0 by ONNX's rule
    out, _ = _check(model, cm, feeds)
    if "attn_mask" in feeds and feeds["attn_mask"].dtype == bool:
        assert (out["Y"][:, :, 2] == 0).all()


def test_onnx_layer_and_rms_normalization_import(host, rng):
    x_shape = [3, 4, 10]
    ln = helper.make_node("LayerNormalization", ["x", "g", "b"], ["y", "mean", "inv"], axis=1, epsilon=1e-4)
    rms = helper.make_node("RMSNormalization", ["x", "g2"], ["z"], axis=0)
    inits = [onnx.numpy_helper.from_array(rng.standard_normal([4, 10]).astype(np.float32), "g"),
             onnx.numpy_helper.from_array(rng.standard_normal([4, 10]).astype(np.float32), "b"),
             onnx.numpy_helper.from_array(rng.standard_normal(x_shape).astype(np.float32), "g2")]
    model = _model([ln, rms], [("x", F, x_shape)],
                   [("y", F, x_shape), ("mean", F, [3, 1, 1]), ("inv", F, [3, 1, 1]), ("z", F, x_shape)],
                   inits, opset=23)
    cm = tvmfuse.compile(model, host)
    _check(model, cm, _feeds(model, rng))


def test_kernel_exp_is_fast_math_after_scheduling():
    """tvmfuse.fastmath runs after the schedules on CPU: no libm exp call stays in the attention kernel."""
    from tvmfuse.pipeline import PipelineOptions, schedule_passes

    cm = tvmfuse.compile(_chain(mask="input"), SKYLAKE)
    with SKYLAKE:
        fast = C.Sequential(schedule_passes(SKYLAKE, PipelineOptions()))(cm.fused_module)
        slow = C.Sequential(schedule_passes(SKYLAKE, PipelineOptions(fast_math=False)))(cm.fused_module)
    texts = [[f.script() for f in m.functions.values() if isinstance(f, C.PrimFunc) and ATTR in f.attrs]
             for m in (fast, slow)]
    assert len(texts[0]) == 1 and "T.exp(" not in texts[0][0] and "T.exp2(" not in texts[0][0]
    assert "T.exp2(" in texts[1][0]     # the table's default: a base-2 softmax (exp2 knob)


@pytest.mark.parametrize("target", [HASWELL, SKYLAKE], ids=["avx2", "avx512"])
@pytest.mark.parametrize("mask", [None, "input", "causal"])
def test_kernel_exps_take_the_nonpositive_variant(target, mask):
    """Both exps of the kernel (the probabilities and the rescale factor) have arguments <= 0 by
    construction, written min(x, 0): tvmfuse.fastmath takes its cheaper exp for each, and none stays."""
    from tvmfuse.fastmath import rewrite

    sq = 40
    if mask == "causal":
        mask = np.where(np.arange(sq)[None] <= np.arange(sq)[:, None], 0, -np.inf).astype(np.float32)
        mask = mask.reshape(1, 1, sq, sq)
    cm = tvmfuse.compile(_chain(b=1, h=2, sq=sq, sk=sq, d=16, dv=16, mask=mask), target, schedules=False)
    res = schedule_prim_func(_attention_func(cm), target)
    assert res.template == "cpu.attention"
    assert res.func.script().count("T.exp2(" if res.config["exp2"] else "T.exp(") == 2
    stats = {}
    new, _ = rewrite(res.func, stats)
    assert stats["nonpositive_exp"] == 2 and "T.exp(" not in new.script() and "T.exp2(" not in new.script()


def test_record_from_before_the_exp2_knob_keeps_the_base_e_kernel(host, rng, tmp_path):
    """A tuning record written before the exp2 knob existed (its config lacks exp2, and prefetch/pack_kv/
    q_blocks/serial_work of earlier sessions) was measured with the base-e kernel: it still applies (source
    "tuned") with each missing knob at its pre-knob value (exp2 0: e^x, no exp2), not the target default
    (exp2 1); a record that names exp2 keeps its value.  Structure on named AVX-512 and AVX2 targets (the
    host's table may differ), numerics through a tuning log on the host."""
    import json

    from tvmfuse.records import target_key
    from tvmfuse.tune.tasks import extract_tasks

    model = _chain(b=1, h=2, sq=40, sk=40, d=16, dv=16)
    pre = ("exp2", "prefetch", "pack_kv", "q_blocks", "serial_work")

    def old_record(target):
        (task,) = [t for t in extract_tasks(model, target) if t.template.family == "cpu.attention"]
        func, key = task.func, task.workload_key         # the kernel (and key) the schedule pass sees
        default = schedule_prim_func(func, target).config
        return func, key, default, {k: v for k, v in default.items() if k not in pre}

    for target in (SKYLAKE, HASWELL):                   # structure on named targets only
        func, key, default, old = old_record(target)
        assert default["exp2"] == 1, default          # the target table's default
        res = schedule_prim_func(func, target, {key: {"template": "cpu.attention", "config": old}})
        assert res.source == "tuned", res.reason
        assert res.config == {**old, "exp2": 0, "prefetch": 0, "pack_kv": 0, "q_blocks": 1, "serial_work": 0}
        text = res.func.script()
        assert text.count("T.exp(") == 2 and "T.exp2(" not in text
        named = schedule_prim_func(func, target, {key: {"template": "cpu.attention", "config": default}})
        assert named.source == "tuned" and named.config["exp2"] == 1 and "T.exp2(" in named.func.script()
    # the host: the old record through a tuning log, as compile reads it, and the result vs the reference
    _, key, _, old = old_record(host)
    log_path = tmp_path / "old_attention.jsonl"
    log_path.write_text(json.dumps({"type": "measure", "target_key": target_key(host), "workload_key": key,
                                    "template": "cpu.attention", "config": old, "costs": [1e-4],
                                    "tvm": C.TVM_VERSION}) + "\n")
    cm = tvmfuse.compile(model, host, tuning_log=str(log_path))
    sched = [s for s in cm.report.schedules if s["template"] == "cpu.attention"]
    assert len(sched) == 1 and sched[0]["source"] == "tuned" and sched[0]["knobs"]["exp2"] == 0, sched
    _check(model, cm, _feeds(model, rng))


@pytest.mark.parametrize("target,lanes", [(HASWELL, 8), (SKYLAKE, 16)], ids=["avx2", "avx512"])
def test_query_block_is_transposed_by_shuffles_where_rows_are_vectors(target, lanes):
    """Head dim a multiple of the vector width and contiguous in Q: the query block is transposed in
    lanes x lanes blocks (row vectors in, log2(lanes) stages of two-vector shuffles); head dim 8 on
    AVX-512 (half a vector) keeps the element-wise transposition."""
    for d, shuffled in ((64, True), (8, lanes == 8)):
        cm = tvmfuse.compile(_chain(b=1, h=2, sq=40, sk=40, d=d, dv=d), target, schedules=False)
        res = schedule_prim_func(_attention_func(cm), target)
        text = res.func.script()
        assert ("T.Shuffle(" in text) == shuffled, (d, lanes)


def test_grouped_query_expand_is_read_in_place(host, rng):
    """PyTorch's repeat_kv (Unsqueeze -> Expand -> Reshape of K and V to the query heads) is read through:
    query head h reads key/value head h // r, and no expanded K/V copy is made."""
    b, hk, r, sq, sk, d = 2, 2, 3, 7, 10, 8
    nodes, inits = [], [onnx.numpy_helper.from_array(np.array(np.float32(1 / np.sqrt(d))), "s"),
                        onnx.numpy_helper.from_array(np.array([2], np.int64), "ax"),
                        onnx.numpy_helper.from_array(np.array([b, hk, r, sk, d], np.int64), "big"),
                        onnx.numpy_helper.from_array(np.array([b, hk * r, sk, d], np.int64), "heads")]
    for t in ("k", "v"):
        nodes += [helper.make_node("Unsqueeze", [t, "ax"], [f"{t}u"]),
                  helper.make_node("Expand", [f"{t}u", "big"], [f"{t}e"]),
                  helper.make_node("Reshape", [f"{t}e", "heads"], [f"{t}r"])]
    nodes += [helper.make_node("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["q", "kt"], ["qk"]),
              helper.make_node("Mul", ["qk", "s"], ["x"]),
              helper.make_node("Softmax", ["x"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "vr"], ["y"])]
    model = _model(nodes, [("q", F, [b, hk * r, sq, d]), ("k", F, [b, hk, sk, d]), ("v", F, [b, hk, sk, d])],
                   [("y", F, [b, hk * r, sq, d])], inits)
    for schedules in (True, False):          # the online-softmax kernel and the reference stages
        cm = tvmfuse.compile(model, host, schedules=schedules)
        assert cm.kernel_count == 1, cm.report.after.kernel_names
        spec = AttentionSpec.from_json(str(_attention_func(cm).attrs[ATTR]))
        assert spec.k.shape == (b, hk, sk, d) and spec.k.axes[1] == ("%", "b1", r, hk)
        _check(model, cm, _feeds(model, rng))


@pytest.mark.parametrize("target,rows", [(HASWELL, 1), (SKYLAKE, 4)], ids=["avx2", "avx512"])
def test_default_row_group_fits_the_vector_registers(target, rows):
    """Head dim 64: a row's accumulators are 64 / lanes vectors (AVX2: 8 of 16 registers, one row per
    group; AVX-512: 4 of 32, four rows); the row group's loops are unrolled (register tiles), and the
    query block is a multiple of the group."""
    model = _chain(b=1, h=2, sq=256, sk=256, d=64, dv=64)
    cm = tvmfuse.compile(model, target)
    func = _attention_func(cm)
    res = schedule_prim_func(func, target)
    assert res.config["rows"] == rows and res.config["q_block"] % rows == 0
    _, loops = _allocs_and_loops(res.func)
    assert int(C.ForKind.UNROLLED) in loops
    text = res.func.script()
    assert f"T.unroll({rows})" in text or rows == 1


def test_causal_query_block_is_a_small_share_of_the_sequence():
    """A causal kernel skips the key blocks past its query block: its default block is at most an eighth
    of the sequence, here where the plain kernel's (sized by L1 alone: Neoverse N1's 64 KiB) is larger."""
    sq = 256
    causal = np.where(np.arange(sq)[None] <= np.arange(sq)[:, None], 0, -np.inf).astype(np.float32)
    n1 = tvmfuse.parse_target({"kind": "llvm", "mcpu": "neoverse-n1", "mtriple": "aarch64-linux-gnu",
                               "num-cores": 2})
    t = Attention()
    blocks = {}
    for name, mask in (("plain", None), ("causal", causal.reshape(1, 1, sq, sq))):
        cm = tvmfuse.compile(_chain(b=1, h=2, sq=sq, sk=sq, d=16, dv=16, mask=mask), SKYLAKE, schedules=False)
        func = _attention_func(cm)
        blocks[name] = t.default_config(t.match(func, n1), n1)["q_block"]
    assert blocks["causal"] <= sq // 8 < blocks["plain"], blocks


@pytest.mark.parametrize("target,l1,q_block", [(HASWELL, 32 * 1024, 32), (SKYLAKE, 32 * 1024, 32),
                                                (tvmfuse.parse_target({"kind": "llvm", "mcpu": "sapphirerapids",
                                                                       "mtriple": "x86_64-linux-gnu",
                                                                       "num-cores": 2}), 48 * 1024, 64)],
                         ids=["avx2", "avx512", "avx512-l1-48k"])
def test_default_query_block_fits_l1(target, l1, q_block):
    """Head dim 64, S=512: the query block's transposed queries, accumulators and scores (q_block x
    (d + dv + k_block) floats) fit the target's L1 data cache, with the largest block that does."""
    cm = tvmfuse.compile(_chain(b=1, h=12, sq=512, sk=512, d=64, dv=64), target)
    t = Attention()
    func = _attention_func(cm)
    cfg = t.default_config(t.match(func, target), target)
    assert cfg["q_block"] == q_block, cfg
    assert cfg["q_block"] * (64 + 64 + cfg["k_block"]) * 4 <= l1 < 2 * cfg["q_block"] * (64 + 64 + cfg["k_block"]) * 4


@pytest.mark.parametrize("mcpu,tile", [("haswell", (4, 2)), ("skylake-avx512", (8, 2)), ("sapphirerapids", (4, 4))])
def test_default_score_tile_has_the_fewest_loads_per_fma(mcpu, tile):
    """Head dim 64, S=512: the score tile (keys x row vectors) within the accumulator share of the vector
    registers that loads the least per multiply-add: AVX2 (12 of 16 registers) 4 x 2; AVX-512 with 32-row
    query blocks (two row vectors) 8 x 2; with 64-row blocks (48 KiB L1) 4 x 4 (8 loads per 16 FMAs, not 10)."""
    target = tvmfuse.parse_target({"kind": "llvm", "mcpu": mcpu, "mtriple": "x86_64-linux-gnu", "num-cores": 2})
    func = _attention_func(tvmfuse.compile(_chain(b=1, h=12, sq=512, sk=512, d=64, dv=64), target, schedules=False))
    t = Attention()
    cfg = t.default_config(t.match(func, target), target)
    assert (cfg["tile_keys"], cfg["tile_qvecs"]) == tile, cfg


def test_default_blocks_follow_the_target_table(monkeypatch):
    """The default blocks' thresholds are the target's row of schedules/cpu_targets.json: a CPU entry that
    doubles its query block's share of L1 gets a query block twice as large."""
    import json

    from tvmfuse import target as TG

    cm = tvmfuse.compile(_chain(b=1, h=12, sq=512, sk=512, d=64, dv=64), SKYLAKE, schedules=False)
    func, t = _attention_func(cm), Attention()
    base = t.default_config(t.match(func, SKYLAKE), SKYLAKE)
    table = json.loads(json.dumps(TG.cpu_table()))
    share = table["template_defaults"]["cpu.attention"]["l1_share_query_block"]
    table["cpus"]["skylake-avx512"]["template_defaults"] = {"cpu.attention": {"l1_share_query_block": 2 * share}}
    monkeypatch.setattr(TG, "cpu_table", lambda: table)
    wider = t.default_config(t.match(func, SKYLAKE), SKYLAKE)
    assert wider["q_block"] == 2 * base["q_block"] and wider["k_block"] == base["k_block"], (base, wider)


def test_configs_with_several_row_vectors_match_reference(host, rng):
    """Query blocks of several vectors and score tiles of several row vectors and keys (the space's
    larger choices), causal and masked, rows and keys not multiples of anything: same numbers."""
    import random

    sq = sk = 45
    causal = np.where(np.arange(sk)[None] <= np.arange(sq)[:, None], 0, -np.inf).astype(np.float32)
    for mask in ("input", causal.reshape(1, 1, sq, sk)):
        model = _chain(b=1, h=2, sq=sq, sk=sk, d=8, dv=8, mask=mask)
        cm = tvmfuse.compile(model, host)
        func = _attention_func(cm)
        t = Attention()
        match = t.match(func, host)
        space = t.space(match, host)
        lanes = t.default_config(match, host)["lanes"]
        feeds = _feeds(model, rng)
        ref = reference_outputs_f64(model, feeds)["y"]
        args_np = [feeds["q"], feeds["k"], feeds["v"]] + ([feeds["mask"]] if isinstance(mask, str) else [])
        configs = [c for c in space.all_configs() if c["q_block"] > lanes and c["tile_qvecs"] > 1]
        assert configs
        for config in random.Random(0).sample(configs, 4):
            scheduled = schedule_with(t, match, func, config)
            lib = C.build_prim_module(C.IRModule({"main": scheduled.with_attr("global_symbol", "main")}), host)
            args = [C.tensor(a) for a in args_np + [np.zeros(ref.shape, np.float32)]]
            lib["main"](*args)
            assert_close_scaled(args[-1].numpy(), ref, RTOL, ATOL, err_msg=str(config))


def _loads_of(func) -> dict:
    """Name of the buffer -> number of loads of it in the scheduled kernel's TIR (an element whose address a
    software prefetch takes is not read: not counted)."""
    import collections

    count, prefetched = collections.Counter(), collections.Counter()

    def visit(e):
        if isinstance(e, C.TensorLoad):
            count.update([str(e.source.name)])
        elif isinstance(e, C.tirx.Evaluate) and getattr(e.value, "op", None) is not None and \
                str(e.value.op.name) == "tirx.prefetch":
            prefetched.update([str(e.value.args[0].args[0].source.name)])

    C.post_order_visit(func.body, visit)
    return count - prefetched


def test_packed_kv_configs_match_reference(host, rng):
    """Packed K/V (each task copies the K/V rows its query blocks see, once) with several query blocks
    per task, a last task with fewer blocks than the others (3 blocks, 2 per task), causal (the copy stops
    at the last key the task's rows see) and masked: the same numbers as without packing."""
    sq = sk = 45
    causal = np.where(np.arange(sk)[None] <= np.arange(sq)[:, None], 0, -np.inf).astype(np.float32)
    for mask in ("input", causal.reshape(1, 1, sq, sk)):
        model = _chain(b=1, h=2, sq=sq, sk=sk, d=16, dv=8, mask=mask)
        func = _attention_func(tvmfuse.compile(model, host))
        t = Attention()
        match = t.match(func, host)
        base = t.default_config(match, host)
        lanes = base["lanes"]
        feeds = _feeds(model, rng)
        ref = reference_outputs_f64(model, feeds)["y"]
        args_np = [feeds["q"], feeds["k"], feeds["v"]] + ([feeds["mask"]] if isinstance(mask, str) else [])
        for over in (dict(q_block=lanes, q_blocks=2, pack_kv=1), dict(q_block=lanes, q_blocks=4, pack_kv=1),
                     dict(q_block=lanes, k_block=lanes, q_blocks=2, pack_kv=1, rows=2),
                     dict(q_block=lanes, q_blocks=2, pack_kv=0)):
            config = {**base, **over}
            assert t.space(match, host).contains(config), config
            scheduled = schedule_with(t, match, func, config)
            assert _loads_of(scheduled)["k"] == (1 if config["pack_kv"] else 2), config   # one copy loop
            lib = C.build_prim_module(C.IRModule({"main": scheduled.with_attr("global_symbol", "main")}), host)
            args = [C.tensor(a) for a in args_np + [np.zeros(ref.shape, np.float32)]]
            lib["main"](*args)
            assert_close_scaled(args[-1].numpy(), ref, RTOL, ATOL, err_msg=str(config))


def test_packed_kv_with_symbolic_batch_matches_onnxruntime(host, rng):
    """A symbolic batch over a static sequence may pack (the packed rows are sized by the key length): two
    query blocks per task, at batch 1 and 3."""
    model = _chain(b="batch", sq=40, sk=40, d=16, dv=8, mask="input")
    func = _attention_func(tvmfuse.compile(model, host))
    t = Attention()
    match = t.match(func, host)
    lanes = t.default_config(match, host)["lanes"]
    config = {**t.default_config(match, host), "q_block": lanes, "q_blocks": 2, "pack_kv": 1}
    assert t.space(match, host).contains(config)
    scheduled = schedule_with(t, match, func, config)
    lib = C.build_prim_module(C.IRModule({"main": scheduled.with_attr("global_symbol", "main")}), host)
    for b in (1, 3):
        feeds = _sym_feeds(rng, b, 40, h=3, d=16, dv=8, mask=True)
        ref = _ort_outputs(model, feeds)["y"]
        args = [C.tensor(feeds[n]) for n in ("q", "k", "v", "mask")] + [C.tensor(np.zeros(ref.shape, np.float32))]
        lib["main"](*args)
        assert_close_scaled(args[-1].numpy(), ref, RTOL, ATOL, err_msg=f"batch {b}")


@pytest.mark.parametrize("target,seq", [(HASWELL, 256), (SKYLAKE, 512)], ids=["avx2", "avx512"])
def test_default_packs_kv_once_per_task(target, seq):
    """Head dim 64, 12 heads, S=256 (Haswell: 256 KiB of L2) or 512 (Skylake-SP: 1 MiB): by default each
    task packs its head's K and V rows (S x 64 local rows each, half the L2 at most; no S x S buffer) once and runs several query blocks on them, with at least
    min_tasks_per_core tasks per core; K and V are each read by one loop (the copy), not by the score and
    P @ V loops.  Where the packed rows would overflow the L2 share (S=8192), no packing and one query
    block per task."""
    from tvmfuse.target import cpu_info, template_defaults

    t = Attention()
    func = _attention_func(tvmfuse.compile(_chain(b=1, h=12, sq=seq, sk=seq, d=64, dv=64), target, schedules=False))
    res = schedule_prim_func(func, target)
    cfg = res.config
    assert cfg["pack_kv"] == 1 and cfg["q_blocks"] > 1, cfg
    tasks = 12 * -(-seq // (cfg["q_block"] * cfg["q_blocks"]))
    assert tasks >= template_defaults(target, "cpu.attention")["min_tasks_per_core"] * cpu_info(target).cores
    loads = _loads_of(res.func)
    assert loads["k"] == loads["v"] == 1, loads
    allocs, loops = _allocs_and_loops(res.func)
    assert sorted(n for _, n, _ in allocs)[-2:] == [seq * 64, seq * 64] and max(n for _, n, _ in allocs) < seq * seq
    assert loops.count(int(C.ForKind.PARALLEL)) == 1
    long = _attention_func(tvmfuse.compile(_chain(b=1, h=2, sq=8192, sk=8192, d=64, dv=64), target,
                                           schedules=False))
    cfg_long = t.default_config(t.match(long, target), target)
    assert (cfg_long["pack_kv"], cfg_long["q_blocks"]) == (0, 1), cfg_long


# ------------------------------------------------------------------------------------------ symbolic shapes
def _ort_outputs(model, feeds):
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def _sym_feeds(rng, batch, seq, h=3, d=16, dv=8, sk=None, mask=False):
    sk = seq if sk is None else sk
    feeds = {"q": rng.standard_normal((batch, h, seq, d)), "k": rng.standard_normal((batch, h, sk, d)),
             "v": rng.standard_normal((batch, h, sk, dv))}
    if mask:
        feeds["mask"] = rng.standard_normal((batch, 1, seq, sk))
    return {k: v.astype(np.float32) for k, v in feeds.items()}


@pytest.mark.parametrize("kw, sizes", [
    # self-attention: one symbol for queries and keys; the sizes (batch 1, 3, 8; sequence 1, 17, 128)
    (dict(b="batch", sq="sequence", sk="sequence"),
     [(b, s, s) for b in (1, 3, 8) for s in (1, 17, 128)]
     # both sides of every size bucket's bound (SEQ_BUCKETS: 16, 32, 64, 128)
     + [(2, s, s) for s in (16, 32, 33, 64, 65, 129)]),
    # cross-attention with an additive mask: two symbols, key tails and query tails apart
    (dict(b="batch", sq="q_len", sk="k_len", mask="input"), [(1, 1, 17), (3, 17, 1), (2, 128, 33)]),
], ids=["self", "cross_mask"])
def test_symbolic_chain_is_one_kernel_and_matches_onnxruntime(kw, sizes, host, rng):
    model = _chain(**kw)
    static = _chain(**{**kw, "b": 2, "sq": 13, "sk": 13 if kw["sk"] == kw["sq"] else 21})
    cm = tvmfuse.compile(model, host)
    assert cm.kernel_count == tvmfuse.compile(static, host).kernel_count == 1, cm.report.refused
    assert [s["template"] for s in cm.report.schedules] == ["cpu.attention"]
    spec = AttentionSpec.from_json(str(_attention_func(cm).attrs[ATTR]))
    assert (spec.batch[0], spec.sq, spec.sk) == (kw["b"], kw["sq"], kw["sk"])    # the symbols, by name
    for b, sq, sk in sizes:
        feeds = _sym_feeds(rng, b, sq, sk=sk, mask="mask" in kw)
        out, ref = cm.run(feeds)["y"], _ort_outputs(model, feeds)["y"]
        assert out.shape == ref.shape == (b, 3, sq, 8)
        assert_close_scaled(out, ref, RTOL, ATOL, err_msg=f"batch {b}, q {sq}, k {sk}")


@pytest.mark.parametrize("target", [HASWELL, SKYLAKE], ids=["avx2", "avx512"])
def test_symbolic_kernel_keeps_scores_out_of_memory(target):
    """Over a symbolic sequence: every buffer the kernel allocates has a static size (no S x S scores),
    one parallel loop whose extent holds the symbols (batch x heads x query blocks), vectorized loops."""
    model = _chain(b="batch", sq="sequence", sk="sequence", mask="input")
    cm = tvmfuse.compile(model, target)
    func = _attention_func(cm)
    res = schedule_prim_func(func, target)
    assert res.template == "cpu.attention"
    allocs, loops = _allocs_and_loops(res.func)     # int() of every alloc extent: a symbolic one raises
    configs = [b["config"] for b in res.config["buckets"]]      # one nest per size bucket
    kb, qb = max(c["k_block"] for c in configs), max(c["q_block"] for c in configs)
    assert allocs and all(scope == "global" for _, _, scope in allocs), allocs     # attention.BUFFER_SCOPE
    assert max(n for _, n, _ in allocs) <= max(qb, 16) * max(kb, 16)
    assert loops.count(int(C.ForKind.PARALLEL)) == len(configs)     # one parallel loop per nest
    assert int(C.ForKind.VECTORIZED) in loops
    par = []

    def visit(s):
        if isinstance(s, C.tirx.For) and s.kind == C.ForKind.PARALLEL:
            par.append(s.extent)

    _walk(res.func.body, visit)
    names = [_symbols_of(extent) for extent in par]
    # a bounded bucket whose query block holds all its rows has one query block (its extent: batch x heads)
    assert all("batch" in n and n <= {"batch", "sequence"} for n in names), par
    assert names[-1] == {"batch", "sequence"}, par        # the open bucket's: query blocks too


@pytest.mark.parametrize("target", [HASWELL, SKYLAKE], ids=["avx2", "avx512"])
def test_symbolic_kernel_holds_the_static_blocks_of_each_sequence_bucket(target):
    """Over a symbolic sequence the kernel holds one nest per size bucket (SEQ_BUCKETS and an open one,
    after the row nest's bucket for the shortest sequences: tests/test_attention_rows.py), picked at run
    time by the sequence; a bounded bucket's nest has the knobs a static build of that length gets (at
    sequence 1 a 128-row query block computed 128x the scores), the open one those of SYMBOLIC_OPEN_HINT;
    a static kernel has no buckets."""
    from tvmfuse.schedules.cpu import attention as A
    from tvmfuse.target import template_defaults

    kw = dict(b=1, h=4, d=64, dv=64)
    func = _attention_func(tvmfuse.compile(_chain(**{**kw, "sq": "sequence", "sk": "sequence"}), target))
    res = schedule_prim_func(func, target)
    got = {b["bucket"]: b["config"] for b in res.config["buckets"]}
    small = int(template_defaults(target, "cpu.attention")["row_nest_max_seq"])
    assert list(got)[0] == f"{A.ROW_BUCKET}<={small}" and got.pop(list(got)[0])["q_block"] == 1
    assert list(got) == [f"seq<={n}" for n in A.SEQ_BUCKETS] + [f"seq>{A.SEQ_BUCKETS[-1]}"]
    for n, config in zip([*A.SEQ_BUCKETS, A.SYMBOLIC_OPEN_HINT], got.values()):
        static = schedule_prim_func(_attention_func(tvmfuse.compile(_chain(**{**kw, "sq": n, "sk": n}), target)),
                                    target)
        assert "buckets" not in static.config
        # the same blocks and tiles; no packed K/V (its rows are a buffer of the static key length)
        assert {**config, **NO_PACK} == {**static.config, **NO_PACK} and _packing(config) == NO_PACK, n
    # the dispatch: one branch per bounded bucket on the sequence
    conds = []
    _walk(res.func.body, lambda s: conds.append(s.condition) if isinstance(s, C.tirx.IfThenElse) else None)
    bounds = sorted(int(c.b) for c in conds if isinstance(c, C.tirx.LE) and _symbols_of(c.a) == {"sequence"})
    assert bounds == [small, *A.SEQ_BUCKETS], conds


def test_symbolic_spec_round_trips_and_binds_the_kernel_vars(host):
    """The spec's JSON names the symbols; ``Attention.match`` binds them to the kernel's own vars (not the
    Relax function's), and a spec whose symbol is not among the kernel's extents does not match."""
    cm = tvmfuse.compile(_chain(b="batch", sq="sequence", sk="sequence"), host)
    func = _attention_func(cm)
    m = Attention().match(func, host)
    assert m is not None
    spec = m.info["spec"]
    kernel_vars = {str(d.name): d for p in func.params for d in C.tensor_shape(p) if isinstance(d, C.tirx.Var)}
    assert spec.sq.same_as(kernel_vars["sequence"]) and spec.batch[0].same_as(kernel_vars["batch"])
    assert AttentionSpec.from_json(spec.to_json()) == AttentionSpec.from_json(str(func.attrs[ATTR]))
    renamed = func.with_attr(ATTR, str(func.attrs[ATTR]).replace('"sequence"', '"seq"'))
    assert Attention().match(renamed, host) is None


def test_symbolic_head_dim_is_refused_with_reason(host):
    """The kernel tiles the head dims: a symbolic head dim keeps the chain apart, with the reason."""
    model = _chain(b=1, h=2, sq=5, sk=5, d=16, dv=16)
    for vi in list(model.graph.input) + list(model.graph.output):
        last = vi.type.tensor_type.shape.dim[3]
        last.Clear()
        last.dim_param = "dim"
    cm = tvmfuse.compile(model, host)
    assert not _attention_groups(cm)
    reasons = [r["reason"] for r in cm.report.refused if r["rule"] == "attention"]
    assert reasons and "head dim d is symbolic" in reasons[0], reasons


NO_PACK = {"q_blocks": 1, "pack_kv": 0, "prefetch": 0}   # one query block per task, K/V read in place, no
# software prefetch (the knobs a static sequence alone has)


def _packing(config: dict) -> dict:
    return {k: config[k] for k in NO_PACK}


def _loop_extents(func):
    """(kind, extent) of every loop of a scheduled kernel."""
    out = []

    def visit(s):
        if isinstance(s, C.tirx.For):
            out.append((int(s.kind), s.extent))

    _walk(func.body, visit)
    return out


def _symbols_of(expr) -> set:
    names = set()
    C.post_order_visit(expr, lambda n: names.add(str(n.name)) if isinstance(n, C.tirx.Var) else None)
    return names


@pytest.mark.parametrize("target", [HASWELL, SKYLAKE], ids=["avx2", "avx512"])
def test_symbolic_kernel_keeps_the_register_tiles_and_runs_only_live_row_groups(target):
    """The symbolic kernel's nest for sequences up to 128 is the static 128 kernel's loop nest (same knobs,
    the same unrolled register tiles) with the query block's row-group loops (score tiles, row vectors, P @ V
    row groups) and the key-block loop over the symbolic sequence; the static kernel's loops are all static
    (no causal mask here).  Static counts where the run-time ones would always equal them: the key-block
    loop where one block holds the bucket's bound, the row-group loops where one unit of rows (a score
    tile's rows, a P @ V row group) is the whole query block."""
    sym = _attention_func(tvmfuse.compile(_chain(b="batch", sq="sequence", sk="sequence", d=64, dv=64), target))
    stat = _attention_func(tvmfuse.compile(_chain(b=1, sq=128, sk=128, d=64, dv=64), target))
    res_stat = schedule_prim_func(stat, target)
    t = Attention()
    match = t.match(sym, target)
    bucket = [b for b in t.buckets(match, target) if b.max_extent == 128][0]      # the nest for 65..128
    bm = t.bucket_match(match, bucket)
    config = t.default_config(bm, target)
    assert {**config, **NO_PACK} == {**res_stat.config, **NO_PACK} and res_stat.template == "cpu.attention"
    config, res_stat = {**config, **NO_PACK}, schedule_with(t, t.match(stat, target), stat, {**res_stat.config, **NO_PACK})
    sym_nest = schedule_with(t, bm, sym, config)
    unrolled = int(C.ForKind.UNROLLED)
    loops_sym, loops_stat = _loop_extents(sym_nest), _loop_extents(res_stat)
    # the register tiles: the query block's body twice (its rows all there: the full blocks; the last
    # block's, clamped: tests/test_attention_full_blocks.py), each with the static kernel's unrolled loops,
    # each of a static extent
    assert sum(k == unrolled for k, _ in loops_sym) == 2 * sum(k == unrolled for k, _ in loops_stat) > 0
    assert all(isinstance(e, C.IntImm) for k, e in loops_sym if k == unrolled)
    assert all(isinstance(e, C.IntImm) for k, e in loops_stat if k != int(C.ForKind.PARALLEL))
    serial = [_symbols_of(e) for k, e in loops_sym if k == int(C.ForKind.SERIAL) and not isinstance(e, C.IntImm)]
    # key blocks (in both bodies) + the last block's score-tile groups, row vectors and P @ V row groups
    # follow the sequence (the last three: the block's live rows; a full block's counts are static)
    unit = max(config["tile_qvecs"] * config["lanes"], config["rows"])
    want = 2 * int(config["k_block"] < 128) + 3 * int(unit < config["q_block"])
    assert len(serial) == want and all("sequence" in s and "batch" not in s for s in serial), (serial, config)


@pytest.mark.parametrize("target", [HASWELL, SKYLAKE], ids=["avx2", "avx512"])
def test_symbolic_kernel_lowers_to_static_buffers_only(target):
    """Every buffer of the lowered symbolic kernel (all its size buckets' nests) has a static size.  Where a
    bucket's last query block runs only its live row groups (AVX-2: score tiles of 16 rows in a 32-row
    block), TVM's CompactBufferAllocation shrank the score tile to the live columns: a run-time sized stack
    buffer with a run-time row stride, kept out of registers (qwen2_dyn's attention at 17 rows 34.6 us
    against 18.8 us static, one thread).  The nests also run the live row groups only (the test above)."""
    func = _attention_func(tvmfuse.compile(_chain(b="batch", h=4, sq="sequence", sk="sequence", d=16, dv=16),
                                           target))
    res = schedule_prim_func(func, target)
    assert res.template == "cpu.attention" and len(res.config["buckets"]) > 2
    low = C.lower_tir(C.IRModule({"main": res.func.with_attr("global_symbol", "main")}), target)
    sizes = []

    def visit(s):
        if isinstance(s, C.tirx.AllocBuffer):
            sizes.append(list(s.buffer.shape))

    for f in low.functions.values():
        if isinstance(f, C.PrimFunc):
            C.post_order_visit(f.body, visit)
    assert sizes, "no buffer allocated: the kernel's local buffers are gone"
    assert all(isinstance(d, C.IntImm) for shape in sizes for d in shape), sizes


@pytest.mark.parametrize("name, static_loops", [("skx-2", True), ("haswell-2", False)])
def test_bounded_bucket_nest_has_the_static_kernels_loops(name, static_loops):
    """BERT's attention (4 heads of 16 here) at sequences up to 32 runs the seq<=32 nest: where its blocks
    hold the bound (AVX-512: a 32-row query block and key block, score tiles of 2 x 16 rows) its loops are
    the static 32 kernel's, every count static but the parallel loop's (batch x heads); before, the
    key-block and row-group loops counted over the sequence at run time (always 1 block and the static
    groups).  Structure only: no speed difference was measured from this (one thread, under load)."""
    from conftest import named_target

    target = named_target(name)
    kw = dict(h=4, d=16, dv=16, mask="input")
    sym = _attention_func(tvmfuse.compile(_chain(b="batch", sq="sequence", sk="sequence", **kw), target))
    stat = _attention_func(tvmfuse.compile(_chain(b=3, sq=32, sk=32, **kw), target))
    t = Attention()
    match = t.match(sym, target)
    bucket = [b for b in t.buckets(match, target) if b.max_extent == 32][0]
    bm = t.bucket_match(match, bucket)
    config = t.default_config(bm, target)
    res_stat = schedule_with(t, t.match(stat, target), stat, {**config, **NO_PACK})
    loops_sym, loops_stat = _loop_extents(schedule_with(t, bm, sym, config)), _loop_extents(res_stat)
    par = int(C.ForKind.PARALLEL)
    whole = config["q_block"] >= 32 and config["k_block"] >= 32 and \
        max(config["tile_qvecs"] * config["lanes"], config["rows"]) == config["q_block"]
    assert whole == static_loops, config
    if whole:
        assert [(k, int(e)) for k, e in loops_sym if k != par] == [(k, int(e)) for k, e in loops_stat if k != par]
        (p_sym,), (p_stat,) = [e for k, e in loops_sym if k == par], [e for k, e in loops_stat if k == par]
        assert _symbols_of(p_sym) == {"batch"} and int(p_stat) == 3 * 4
    else:      # smaller blocks (AVX2): the counts past one block still follow the sequence
        assert any(not isinstance(e, C.IntImm) for k, e in loops_sym if k != par)


def test_symbolic_register_tile_configs_match_reference(host, rng):
    """Symbolic batch/sequence with the space's larger choices (several row vectors per block and per
    score tile, row groups of several rows) at sequences shorter than a vector, inside one block and over
    several blocks with a tail: the built kernel gives the unfused reference's numbers at every size."""
    import random

    model = _chain(b="batch", sq="sequence", sk="sequence", d=8, dv=8, mask="input")
    func = _attention_func(tvmfuse.compile(model, host))
    t = Attention()
    match = t.match(func, host)
    lanes = t.default_config(match, host)["lanes"]
    configs = [c for c in t.space(match, host).all_configs()
               if c["q_block"] > lanes and c["tile_qvecs"] > 1 and c["rows"] > 1]
    assert configs
    for config in random.Random(1).sample(configs, 3):
        scheduled = schedule_with(t, match, func, config)
        lib = C.build_prim_module(C.IRModule({"main": scheduled.with_attr("global_symbol", "main")}), host)
        for b, s in ((1, 1), (2, 3 * lanes + 1), (1, 2 * config["q_block"] + 5)):
            feeds = _sym_feeds(rng, b, s, d=8, mask=True)
            ref = _ort_outputs(model, feeds)["y"]
            args = [C.tensor(feeds[n]) for n in ("q", "k", "v", "mask")] + [C.tensor(np.zeros(ref.shape, np.float32))]
            lib["main"](*args)
            assert_close_scaled(args[-1].numpy(), ref, RTOL, ATOL, err_msg=f"{config}, {b}x{s}")
